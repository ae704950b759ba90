//! The guest write path: in-place writes, allocating writes as two-phase plans (plan under
//! the metadata lock → data I/O without it → commit or abort under the lock), write-zeroes,
//! discard and flush.
//!
//! Allocating writes merge the COW head and tail with the guest data into one device write,
//! and skip COW areas that read as zero when the new cluster was never written (it reads
//! zero already). With extended L2 only the touched subclusters are written. Writers of a
//! guest cluster with an allocation in flight wait for it to commit, so overlapping
//! allocations are ordered.

use crate::chain::{read_layer, Chain, Layer};
use crate::coherency::Shared;
use crate::error::{corrupt, Error, Field, Result};
use crate::exec::{DevId, GraceEntry};
use crate::format::{ClusterMapping, L2Entry, SubclusterBitmap};
use crate::image::owner::alloc::Allocation;
use crate::image::owner::Owner;
use crate::image::{CachedExtent, Qcow2, Touch};
use crate::io::{BlockDevice, BufSlice, DeviceOp, IoBuffer};
use crate::types::{ClusterSpan, Geometry, GuestOffset, HostOffset, HostRange};
use smallvec::SmallVec;
use std::rc::Rc;

/// What a write does to one guest cluster. `host` is always where the cluster starts on
/// the device; `entry` and `bitmap` are its L2 words as the plan found them.
#[derive(Debug, Clone, Copy)]
enum Action {
    /// Data goes to `host`, no metadata change.
    InPlace { host: HostOffset },
    /// Extended L2, cluster allocated and COPIED: data to `host`, then the bitmap changes.
    SubclusterInPlace {
        host: HostOffset,
        entry: L2Entry,
        bitmap: SubclusterBitmap,
    },
    /// A preallocated zero cluster (COPIED): rewrite the whole cluster, clear the zero flag.
    Rewrite { host: HostOffset, entry: L2Entry },
    /// Needs a new cluster; `old` is what it replaces (freed after commit when shared).
    Alloc {
        bitmap: SubclusterBitmap,
        old: ClusterMapping,
    },
}

impl Action {
    /// A cluster a first write takes with its group (`OpenOptions::alloc_granule`) but does
    /// not write: unallocated, reading zeros, as its fresh new cluster does.
    const UNWRITTEN: Action = Action::Alloc {
        bitmap: SubclusterBitmap::NONE,
        old: ClusterMapping::Unallocated { host: None },
    };
}

/// One guest cluster of a write.
#[derive(Debug, Clone, Copy)]
struct Part {
    /// The guest offset where the cluster starts.
    cluster: GuestOffset,
    /// The guest's bytes within the cluster; what the plan writes around them is COW data
    /// ([`Chain::part_range`]).
    written: ClusterSpan,
    /// What the write does to the cluster.
    action: Action,
}

impl Part {
    /// The part of guest bytes `[pos, end)`, which lie in the cluster starting at `cluster`.
    #[inline(always)]
    fn new(cluster: u64, pos: u64, end: u64, action: Action) -> Part {
        let cluster = GuestOffset(cluster);
        Part {
            cluster,
            written: ClusterSpan::of_guest(cluster, GuestOffset(pos), GuestOffset(end)),
            action,
        }
    }

    /// The guest offset of byte `at` of the cluster.
    #[inline(always)]
    fn guest(&self, at: u64) -> GuestOffset {
        self.cluster.plus(at)
    }
}

/// The parts of a plan, and its allocated runs of host clusters: inline for requests of up
/// to two clusters, so the common write allocates nothing for them.
type Parts = SmallVec<[Part; 2]>;
type Allocs = SmallVec<[Allocation; 2]>;

/// The host clusters of a plan's allocations, handed out in order to its allocating parts
/// (the `i`-th allocating part takes the `i`-th cluster of the runs).
struct AllocCursor<'a> {
    allocs: &'a [Allocation],
    taken: u64,
}

/// A host cluster a plan allocated for one of its parts ([`AllocCursor::next_cluster`]).
#[derive(Debug, Clone, Copy)]
struct NewCluster {
    /// Where the cluster starts on the device.
    host: HostOffset,
    /// Never written since open: it reads as zeros.
    fresh: bool,
}

impl<'a> AllocCursor<'a> {
    /// A cursor at the first cluster of `allocs`.
    fn new(allocs: &'a [Allocation]) -> Self {
        AllocCursor { allocs, taken: 0 }
    }

    /// The host cluster of the next allocating part (host offset 0, not fresh, past the
    /// last one allocated, which a plan never asks for).
    fn next_cluster(&mut self, geo: &Geometry) -> NewCluster {
        let mut i = self.taken;
        self.taken += 1;
        for a in self.allocs {
            if i < a.count {
                return NewCluster {
                    host: geo.host_cluster_offset(a.nth(i)),
                    fresh: a.fresh,
                };
            }
            i -= a.count;
        }
        NewCluster {
            host: HostOffset(0),
            fresh: false,
        }
    }
}

/// Kinds of zeroing requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ZeroKind {
    /// write-zeroes keeping allocation (unless `unmap`).
    WriteZeroes { unmap: bool },
    /// discard: free where possible, zero flag where a backing image would show through.
    Discard,
}

/// What a write does to a guest cluster whose L2 words are `(entry, bitmap)` (see
/// [`Action`]); an invalid entry is corruption.
fn action_for<D: BlockDevice>(
    q: &Qcow2<D>,
    entry: L2Entry,
    bitmap: SubclusterBitmap,
) -> Result<Action> {
    let geo = q.geometry();
    let ctx = q.l2_context();
    Ok(if geo.extended_l2 {
        if entry.is_compressed() {
            return Err(corrupt(
                Field::L2Entry,
                entry.0,
                "compressed cluster in an image with extended L2",
            ));
        }
        // Validate (reserved bits, bitmap consistency) through the mapping decoder.
        entry.subcluster_mapping(bitmap, 0, &ctx)?;
        let host = entry.host_bits();
        if host != 0 && entry.is_copied() {
            Action::SubclusterInPlace {
                host: HostOffset(host),
                entry,
                bitmap,
            }
        } else {
            let old = if host != 0 {
                ClusterMapping::Data {
                    host: HostOffset(host),
                    copied: false,
                }
            } else {
                ClusterMapping::Unallocated { host: None }
            };
            Action::Alloc { bitmap, old }
        }
    } else {
        match entry.mapping(&ctx)? {
            ClusterMapping::Data { host, copied: true } => Action::InPlace { host },
            ClusterMapping::Zero { host: Some(h) } if entry.is_copied() => {
                Action::Rewrite { host: h, entry }
            }
            old => Action::Alloc { bitmap, old },
        }
    })
}

fn top<D: BlockDevice>(chain: &Chain<D>) -> Result<&Qcow2<D>> {
    match &chain.layers()[0] {
        Layer::Qcow2(q) if q.is_writable() => Ok(q),
        _ => Err(Error::ReadOnly),
    }
}

/// What the one-extent check of an in-place write found
/// ([`Chain::plan_write_extent`]).
pub(crate) enum WriteExtent {
    /// One extent of COPIED clusters on this device, at this host offset.
    One(DevId, HostOffset),
    /// Not in place (the slow path runs it).
    Refused,
    /// Not one cached extent: plan it cluster by cluster.
    Walk,
}

/// One piece of an in-place write: `len` bytes from offset `buf_off` of the guest's
/// buffer to host offset `host`.
#[derive(Debug, Clone, Copy)]
struct WriteRun {
    host: HostOffset,
    buf_off: usize,
    len: usize,
}

impl WriteRun {
    const EMPTY: WriteRun = WriteRun {
        host: HostOffset(0),
        buf_off: 0,
        len: 0,
    };
}

/// The pieces of an in-place write the fast path takes at most.
type WriteRuns = [WriteRun; 8];

/// Who checks an in-place write's clusters ([`Chain::fast_write_side`]), and whether the
/// image takes in-place writes at all.
#[derive(Clone, Copy)]
enum InPlaceSide<'a> {
    /// The metadata owner (or an image one core serves): its in-flight allocations and its
    /// exact metadata index.
    Owner,
    /// A writable core replica: the owner's published metadata-cluster bitmap (an
    /// allocation in flight is not COPIED data in its view yet).
    Core(&'a Shared),
    /// No in-place writes here (a read-only image or replica: no owner state either).
    ReadOnly,
}

/// Whether host range `[h, h + len)` (non-empty) touches the image's metadata, as `side`
/// checks it: on a core replica by the owner's published metadata-cluster bitmap, on the
/// owner by its exact index (a read-only side takes no write: true).
#[inline(always)]
fn overlaps_meta<D: BlockDevice>(
    q: &Qcow2<D>,
    side: InPlaceSide<'_>,
    h: HostOffset,
    len: u64,
) -> bool {
    match side {
        InPlaceSide::Core(sh) => {
            let bits = q.geometry().cluster_bits;
            let (first, last) = (h.0 >> bits, (h.0 + len - 1) >> bits);
            // Most writes lie in one cluster: one bitmap test, no range iterator.
            if first == last {
                return sh.is_meta_cluster(first);
            }
            (first..=last).any(|c| sh.is_meta_cluster(c))
        }
        InPlaceSide::Owner => q.overlaps_metadata(h, len),
        InPlaceSide::ReadOnly => true,
    }
}

/// The fewest bytes of zeros around a partial first write that a device which zeroes
/// cheaply is asked to zero itself (up to two `WriteZeroes` beside the data write); below
/// this, one write of the (sub)cluster from a zeroed buffer costs less than the extra
/// operations (on a malloc bdev, an operation costs about as much as copying 8 KiB).
const ZEROES_OFFLOAD_MIN: u64 = 16 << 10;

impl<D: BlockDevice> Chain<D> {
    /// Starts a guest write; completion is reported with `tag` by [`crate::Exec::poll`].
    /// A write into allocated clusters whose refcount is 1, with their L2 slice cached, is
    /// submitted directly (no task, no metadata); anything else runs as a slow-path task.
    pub fn submit_write(self: &Rc<Self>, tag: u64, offset: u64, buf: BufSlice<D::Buf>) {
        self.start_write(tag, offset, buf, true);
    }

    /// [`submit_write`](Self::submit_write) for a write known not in place: a core replica
    /// routed it here as [`WriteRoute::Owner`](crate::route::WriteRoute::Owner)
    /// `{ slow: true }`, or this chain's own route found it so. Runs the slow path without
    /// planning a fast-path write first (it would not find one; the slow path handles it
    /// if it could).
    pub fn submit_write_slow(self: &Rc<Self>, tag: u64, offset: u64, buf: BufSlice<D::Buf>) {
        self.start_write(tag, offset, buf, false);
    }

    fn start_write(self: &Rc<Self>, tag: u64, offset: u64, buf: BufSlice<D::Buf>, fast: bool) {
        if let Err(e) = top(self).and_then(|_| self.check_range(offset, buf.len as u64)) {
            return self.exec().complete(tag, Err(e));
        }
        self.note_change(offset, buf.len as u64);
        let mut entry = self.exec().guest_enter();
        if fast {
            match self.try_fast_write(tag, offset, &buf, entry) {
                Ok(()) => return,
                Err(back) => entry = back,
            }
        }
        let chain = self.clone();
        if let Ok(q) = top(self) {
            match self.plan_now(q, offset, offset + buf.len as u64) {
                Ok(Some(planned)) => {
                    let fut = chain.planned_task(tag, entry, GuestOffset(offset), planned, buf);
                    return self.exec().spawn(fut);
                }
                Ok(None) => {}
                Err(e) => return self.exec().complete_entered(tag, Err(e), entry),
            }
        }
        self.exec().spawn(async move {
            let r = chain.write(offset, buf).await;
            chain.exec().complete_entered(tag, r, entry);
        });
    }

    /// Starts a write-zeroes (`unmap`: the clusters may be deallocated).
    pub fn submit_write_zeroes(self: &Rc<Self>, tag: u64, offset: u64, len: u64, unmap: bool) {
        let chain = self.clone();
        self.exec().spawn(async move {
            let r = chain.write_zeroes(offset, len, unmap).await;
            chain.exec().complete(tag, r);
        });
    }

    /// Starts a discard.
    pub fn submit_discard(self: &Rc<Self>, tag: u64, offset: u64, len: u64) {
        let chain = self.clone();
        self.exec().spawn(async move {
            let r = chain.discard(offset, len).await;
            chain.exec().complete(tag, r);
        });
    }

    /// Starts a guest flush.
    pub fn submit_flush(self: &Rc<Self>, tag: u64) {
        let chain = self.clone();
        self.exec().spawn(async move {
            let r = chain.flush().await;
            chain.exec().complete(tag, r);
        });
    }

    /// On a core replica of a shared image ([`Qcow2::from_seed`]): runs the write here when
    /// it is an in-place write (the fast path, or after loading the slices it needs into
    /// this core's cache). Otherwise the request ends as
    /// [`Outcome::ToOwner`](crate::exec::Outcome::ToOwner), having changed nothing: the
    /// host then sends it to the metadata owner.
    pub fn submit_write_local(self: &Rc<Self>, tag: u64, offset: u64, buf: BufSlice<D::Buf>) {
        if let Err(e) = self.check_range(offset, buf.len as u64) {
            return self.exec().complete(tag, Err(e));
        }
        self.note_change(offset, buf.len as u64);
        let entry = match self.try_fast_write(tag, offset, &buf, self.exec().guest_enter()) {
            Ok(()) => return self.tally.wrote_here(),
            Err(entry) => entry,
        };
        let chain = self.clone();
        self.exec().spawn(async move {
            let exec = chain.exec();
            if let Layer::Qcow2(q) = &chain.layers()[0] {
                let cov = q.geometry().slice_coverage();
                let end = offset + buf.len as u64;
                let mut pos = offset;
                while pos < end {
                    match q.load_slice(GuestOffset(pos)).await {
                        Ok(Some(_)) => {}
                        // No L2 table: an allocation, for the owner.
                        Ok(None) => {
                            chain.tally.sent_to_owner();
                            return exec.hand_to_owner(tag, entry);
                        }
                        Err(e) => return exec.complete_entered(tag, Err(e), entry),
                    }
                    pos = (pos / cov + 1) * cov;
                }
            }
            match chain.try_fast_write(tag, offset, &buf, entry) {
                Ok(()) => chain.tally.wrote_here(),
                Err(entry) => {
                    chain.tally.sent_to_owner();
                    exec.hand_to_owner(tag, entry);
                }
            }
        });
    }

    /// On a core replica of a shared image ([`Qcow2::from_seed`]): starts the write here if
    /// it is an in-place write (fast path) and returns true; returns false, having changed
    /// nothing, when the write must go to the metadata owner (allocation, COW, anything
    /// else), where the host submits it with [`submit_write`](Self::submit_write).
    pub fn try_submit_write(
        self: &Rc<Self>,
        tag: u64,
        offset: u64,
        buf: &BufSlice<D::Buf>,
    ) -> bool {
        if self.check_range(offset, buf.len as u64).is_err() {
            return false;
        }
        self.note_change(offset, buf.len as u64);
        match self.try_fast_write(tag, offset, buf, self.exec().guest_enter()) {
            Ok(()) => true,
            Err(entry) => {
                self.exec().guest_exit(entry);
                false
            }
        }
    }

    /// Plans an in-place write of `len` bytes at `offset` from cached metadata alone (no side
    /// effects but LRU/hit counters): `Some((device, n))` with `runs[..n]` the pieces of
    /// the write when every cluster is COPIED data of the top image
    /// (with extended L2: every subcluster written is allocated data, not zero, so its
    /// bitmap stays as it is), outside the image's metadata, with no allocation in flight
    /// and at most `runs.len()` discontiguous pieces; `None` when the write needs the slow
    /// path.
    #[inline(always)]
    fn plan_fast_write(
        &self,
        offset: u64,
        len: u64,
        runs: &mut WriteRuns,
    ) -> Option<(DevId, usize)> {
        match self.plan_write_extent(offset, len) {
            WriteExtent::One(dev, host) => {
                runs[0] = WriteRun {
                    host,
                    buf_off: 0,
                    len: len as usize,
                };
                Some((dev, 1))
            }
            WriteExtent::Refused => None,
            WriteExtent::Walk => self.walk_fast_write(offset, len, runs),
        }
    }

    /// The first half of [`plan_fast_write`](Self::plan_fast_write), for the usual case
    /// without its run array: the write as one extent of COPIED clusters straight from the
    /// cache (one linear slice, or one cluster), refused, or to be planned cluster by
    /// cluster.
    #[inline(always)]
    pub(crate) fn plan_write_extent(&self, offset: u64, len: u64) -> WriteExtent {
        self.plan_write_extent_with(offset, len, true)
    }

    /// [`plan_write_extent`](Self::plan_write_extent); without `memo`, for a caller that
    /// has just asked the memo, straight to the slice cache.
    #[inline(always)]
    pub(crate) fn plan_write_extent_with(&self, offset: u64, len: u64, memo: bool) -> WriteExtent {
        let Layer::Qcow2(q) = &self.layers()[0] else {
            return WriteExtent::Refused;
        };
        if let Some(h) = memo.then(|| q.memo_overwrite(offset, len)).flatten() {
            return WriteExtent::One(q.dev(), HostOffset(h));
        }
        let side = match self.fast_write_side(q) {
            InPlaceSide::ReadOnly => return WriteExtent::Refused,
            side => side,
        };
        let h = match q.cached_extent_with(offset, len, true, memo) {
            CachedExtent::Host(h) => HostOffset(h),
            // One cluster with no host cluster, or not COPIED: the walk would find the same.
            CachedExtent::NotInPlace => return WriteExtent::Refused,
            CachedExtent::Unknown => return WriteExtent::Walk,
        };
        let inflight = q.meta_state().is_some_and(|m| {
            let cs = q.geometry().cluster_size();
            m.inflight_any(offset / cs, (offset + len - 1) / cs)
        });
        if inflight || overlaps_meta(q, side, h, len) {
            return WriteExtent::Refused;
        }
        WriteExtent::One(q.dev(), h)
    }

    /// Who checks an in-place write's clusters of `q` ([`InPlaceSide`]).
    #[inline(always)]
    fn fast_write_side<'a>(&self, q: &'a Qcow2<D>) -> InPlaceSide<'a> {
        match q.writable_core_shared() {
            Some(sh) => InPlaceSide::Core(sh),
            // A read-only replica has no owner state either.
            None if q.meta_state().is_some() => InPlaceSide::Owner,
            None => InPlaceSide::ReadOnly,
        }
    }

    /// What [`plan_write_extent`](Self::plan_write_extent) found, `e`, for a caller that can
    /// use one extent only, walking the clusters when it says so: as
    /// [`walk_single_write`](Self::walk_single_write) answers.
    pub(crate) fn single_write_extent(
        &self,
        offset: u64,
        len: u64,
        e: WriteExtent,
    ) -> Option<(DevId, Option<HostOffset>)> {
        match e {
            WriteExtent::One(dev, host) => Some((dev, Some(host))),
            WriteExtent::Refused => None,
            WriteExtent::Walk => self.walk_single_write(offset, len),
        }
    }

    /// [`walk_fast_write`](Self::walk_fast_write) for a caller that can use one extent
    /// only: `Some((device, Some(host)))` when the clusters follow each other on the
    /// device, `Some((device, None))` when they do not (in place all the same), `None`
    /// when the write is not in place.
    #[inline(never)]
    pub(crate) fn walk_single_write(
        &self,
        offset: u64,
        len: u64,
    ) -> Option<(DevId, Option<HostOffset>)> {
        let mut runs = [WriteRun::EMPTY; 8];
        let (dev, n) = self.walk_fast_write(offset, len, &mut runs)?;
        Some((dev, (n == 1).then_some(runs[0].host)))
    }

    /// [`plan_fast_write`](Self::plan_fast_write) cluster by cluster, for a write that is
    /// not one cached extent.
    #[inline(never)]
    fn walk_fast_write(
        &self,
        offset: u64,
        len: u64,
        runs: &mut WriteRuns,
    ) -> Option<(DevId, usize)> {
        let Layer::Qcow2(q) = &self.layers()[0] else {
            return None;
        };
        let side = match self.fast_write_side(q) {
            InPlaceSide::ReadOnly => return None,
            side => side,
        };
        let m = q.meta_state();
        let cs = q.geometry().cluster_size();
        // The mapping's host offset is where its (sub)cluster starts.
        let unit = q.geometry().subcluster_size();
        let end = offset + len;
        let mut n = 0;
        let mut pos = offset;
        let st = m.map(|m| m.st());
        while pos < end {
            if st
                .as_ref()
                .is_some_and(|st| st.alloc.inflight().contains(pos / cs))
            {
                return None;
            }
            // A hit is counted (and the slice touched) only for an entry the write can use.
            let Ok(Some((ClusterMapping::Data { host, copied: true }, c_end))) =
                q.resolve_cached_as(GuestOffset(pos), Touch::IfCopied)
            else {
                return None;
            };
            let len = (c_end.min(end) - pos) as usize;
            let h = host.plus(pos & (unit - 1));
            if overlaps_meta(q, side, h, len as u64) {
                // The slow path refuses it and marks the image corrupt.
                return None;
            }
            let boff = (pos - offset) as usize;
            if n > 0 && runs[n - 1].host.plus(runs[n - 1].len as u64) == h {
                runs[n - 1].len += len;
            } else if n < runs.len() {
                runs[n] = WriteRun {
                    host: h,
                    buf_off: boff,
                    len,
                };
                n += 1;
            } else {
                return None;
            }
            pos += len as u64;
        }
        Some((q.dev(), n))
    }

    /// In-place fast path: every cluster COPIED data (standard L2), slice cached, no
    /// allocation in flight. Otherwise hands `entry` back, having changed nothing.
    fn try_fast_write(
        &self,
        tag: u64,
        offset: u64,
        buf: &BufSlice<D::Buf>,
        entry: GraceEntry,
    ) -> Result<(), GraceEntry> {
        let mut runs = [WriteRun::EMPTY; 8];
        let Some((dev, n)) = self.plan_fast_write(offset, buf.len as u64, &mut runs) else {
            return Err(entry);
        };
        if n == 1 {
            let r = runs[0];
            self.exec().request_single(
                tag,
                entry,
                dev,
                DeviceOp::Write {
                    offset: r.host.0,
                    buf: buf.sub(r.buf_off, r.len),
                },
            );
            return Ok(());
        }
        let req = self.exec().request_begin_entered(tag, entry);
        for r in &runs[..n] {
            self.exec().request_op(
                req,
                dev,
                DeviceOp::Write {
                    offset: r.host.0,
                    buf: buf.sub(r.buf_off, r.len),
                },
            );
        }
        self.exec().request_arm(req);
        Ok(())
    }

    /// Writes `buf` at `offset` and waits for it (acknowledged, not yet durable: see
    /// [`flush`](Self::flush)).
    pub async fn write(self: &Rc<Self>, offset: u64, buf: BufSlice<D::Buf>) -> Result<()> {
        let q = top(self)?;
        self.check_range(offset, buf.len as u64)?;
        self.note_change(offset, buf.len as u64);
        let end = offset + buf.len as u64;
        let cov = q.geometry().slice_coverage();
        let mut pos = offset;
        while pos < end {
            let chunk_end = end.min((pos / cov + 1) * cov);
            let sub = buf.sub((pos - offset) as usize, (chunk_end - pos) as usize);
            self.write_chunk(q, pos, chunk_end, Some(sub)).await?;
            pos = chunk_end;
        }
        Ok(())
    }

    /// Takes the metadata lock once no cluster of `[first, last]` has an allocation in
    /// flight, and marks them in flight.
    pub(crate) async fn lock_clusters<'q>(
        &self,
        q: &Owner<'q, D>,
        first: u64,
        last: u64,
    ) -> crate::exec::LockGuard<'q, D> {
        let m = q.meta();
        loop {
            let g = m.lock().lock().await;
            let busy = m.inflight_any(first, last);
            if !busy {
                m.st_mut().alloc.inflight_mut().mark(first, last);
                return g;
            }
            drop(g);
            m.wait_inflight().await;
        }
    }

    pub(crate) fn unmark_clusters(&self, q: &Owner<'_, D>, first: u64, last: u64) {
        q.meta().end_inflight(first, last);
    }

    /// Writes guest bytes `[start, end)` (inside one L2 slice); `data` is `None` for zeros.
    async fn write_chunk(
        self: &Rc<Self>,
        q: &Qcow2<D>,
        start: u64,
        end: u64,
        data: Option<BufSlice<D::Buf>>,
    ) -> Result<()> {
        let o = q.owner()?;
        let cs = q.geometry().cluster_size();
        let (first, last) = (start / cs, (end - 1) / cs);
        let guard = self.lock_clusters(&o, first, last).await;
        let planned = self.plan_chunk(&o, start, end).await;
        let (parts, allocs) = match planned {
            Ok(p) => p,
            Err(e) => {
                drop(guard);
                self.unmark_clusters(&o, first, last);
                return Err(e);
            }
        };
        drop(guard);
        // Data phase, without the lock.
        let res = self
            .write_data(&o, GuestOffset(start), &parts, &allocs, data)
            .await;
        self.finish_chunk(&o, &parts, &allocs, res).await
    }

    /// The end of a planned chunk after its data phase (`res`): under the metadata lock,
    /// commits the plan (or frees its new clusters), writes metadata back if enough is
    /// dirty, then lets waiting writers of its clusters go.
    async fn finish_chunk(
        &self,
        q: &Owner<'_, D>,
        parts: &[Part],
        allocs: &[Allocation],
        res: Result<()>,
    ) -> Result<()> {
        let geo = q.geometry();
        let (first, last) = match (parts.first(), parts.last()) {
            (Some(a), Some(b)) => (geo.guest_cluster(a.cluster), geo.guest_cluster(b.cluster)),
            _ => return res,
        };
        let guard = q.meta().lock().lock().await;
        let r = match res {
            Ok(()) => self.commit(q, parts, allocs).await,
            Err(e) => {
                for &a in allocs {
                    // Boxed: rare, and the write path's per-request future stays small.
                    let _ = Box::pin(q.free_unreferenced(a)).await;
                }
                Err(e)
            }
        };
        let r = match r {
            Ok(()) => q.maybe_writeback_locked().await,
            Err(e) => Err(e),
        };
        drop(guard);
        self.unmark_clusters(q, first, last);
        r
    }

    /// The aligned group of guest clusters `first..end` that a first write of guest
    /// clusters `g..g + n` (`parts`, every one unallocated) takes at once under
    /// `OpenOptions::alloc_granule`, with the plan that takes it: the write's own parts and,
    /// in guest order between them, a part of nothing for every other cluster of the group
    /// that is unallocated (no backing file: it reads as zeros, as the fresh cluster taken
    /// for it does). Clusters of the group allocated already are left alone, so that a group
    /// one write could not take whole (an allocation in flight, the zeroed tail in the way,
    /// a new L2 table) is taken by the next first write into it. `None` when the group is no
    /// larger than the write, crosses its slice or the disk's end, has an allocation in
    /// flight or nothing else to take. Returns the first and last guest cluster of the plan
    /// with it.
    fn granule_run(
        &self,
        q: &Owner<'_, D>,
        parts: &[Part],
        g: u64,
        n: u64,
    ) -> Option<(u64, u64, Parts)> {
        let per = q.meta().granule_clusters();
        let geo = q.geometry();
        if per <= 1 || geo.extended_l2 || self.layers().len() > 1 || parts.len() as u64 != n {
            return None;
        }
        let unwritten = |p: &Part| {
            matches!(
                p.action,
                Action::Alloc {
                    old: ClusterMapping::Unallocated { host: None },
                    ..
                }
            )
        };
        if !parts.iter().all(unwritten) {
            return None;
        }
        let bits = geo.cluster_bits;
        let g0 = g & !(per - 1);
        let end = (g + n)
            .next_multiple_of(per)
            .min(q.size().div_ceil(geo.cluster_size()));
        let slice = |c: u64| geo.slice_id(GuestOffset(c << bits));
        // Graced clusters come back before the look at freshness, as `alloc_clusters_now`
        // would bring them back: they lower the allocation hint below the fresh clusters.
        q.reclaim_graced();
        if end <= g0 + n || slice(g0) != slice(end - 1) || q.meta().inflight_any(g0, end - 1) {
            return None;
        }
        let mut all = Parts::new();
        let mut own = parts.iter();
        for c in g0..end {
            if (g..g + n).contains(&c) {
                all.extend(own.next().copied());
            } else if q
                .l2_words_now(GuestOffset(c << bits))
                .is_some_and(|(e, _)| e.0 == 0)
            {
                let at = c << bits;
                all.push(Part::new(at, at, at, Action::UNWRITTEN));
            }
        }
        let take = all.len() as u64;
        // The clusters marked in flight, from the plan's first part to its last (what
        // `finish_chunk` unmarks); allocated ones between them only wait a little.
        let first = all.first().map(|p| geo.guest_cluster(p.cluster))?;
        let last = all.last().map(|p| geo.guest_cluster(p.cluster))?;
        (take > n && q.next_run_fresh(take)).then_some((first, last, all))
    }

    /// [`plan_chunk`](Self::plan_chunk) on the spot, for a write of guest bytes `[start, end)` inside
    /// one L2 slice that changes metadata (allocation, an extended-L2 bitmap, a zero flag),
    /// when everything it needs is in memory: the metadata lock free (no plan, commit or
    /// write-back under way), no allocation in flight on its clusters, its L2 table
    /// writable, its slice dirty or cached, no cluster in place already, the clusters to
    /// allocate consecutive (one run of host clusters, found without I/O). Then, as
    /// [`lock_clusters`](Self::lock_clusters) and `plan` would, marks the clusters in
    /// flight, takes the new clusters and returns the plan; else `Ok(None)`, having changed
    /// nothing (the task runs the write as usual, and reports any corruption). An error is
    /// the allocation's (the device cannot hold the new cluster): the write fails with it,
    /// as it would in the task.
    ///
    /// Nothing awaits between the checks and the changes, so holding the lock would change
    /// nothing; skipping the task's lock, planning futures and slice look-ups is the point:
    /// a first write into a fresh image then costs little more than an overwrite.
    fn plan_now(&self, q: &Qcow2<D>, start: u64, end: u64) -> Result<Option<(Parts, Allocs)>> {
        let Ok(o) = q.owner() else {
            return Ok(None);
        };
        let (q, m) = (&o, o.meta());
        let geo = q.geometry();
        let cs = geo.cluster_size();
        let (first, last) = (start / cs, (end - 1) / cs);
        if m.lock().is_locked()
            || geo.slice_id(GuestOffset(start)) != geo.slice_id(GuestOffset(end - 1))
            || m.inflight_any(first, last)
            || !matches!(q.writable_l2(GuestOffset(start)), Ok(Ok(())))
            || q.allocates_by_region()
        {
            return Ok(None);
        }
        let mut parts = Parts::new();
        // The allocating parts' guest clusters: one run (first, count), as one allocation.
        let mut allocating: Option<(u64, u64)> = None;
        let mut pos = start;
        while pos < end {
            let cluster = pos & !(cs - 1);
            let b = end.min(cluster + cs);
            let Some((entry, bitmap)) = q.l2_words_now(GuestOffset(cluster)) else {
                return Ok(None);
            };
            let Ok(action) = action_for(q, entry, bitmap) else {
                return Ok(None);
            };
            match action {
                // In place: the direct path's (which refused it) or the task's.
                Action::InPlace { .. } => return Ok(None),
                Action::Alloc { .. } => match &mut allocating {
                    None => allocating = Some((cluster / cs, 1)),
                    Some((g, n)) if *g + *n == cluster / cs => *n += 1,
                    Some(_) => return Ok(None),
                },
                // A bitmap or zero-flag change in place. Rule 6 as in `plan` (the task
                // marks the image corrupt).
                Action::SubclusterInPlace { host, .. } | Action::Rewrite { host, .. } => {
                    if q.overlaps_metadata(geo.host_cluster_offset(geo.host_cluster(host)), cs) {
                        return Ok(None);
                    }
                }
            }
            parts.push(Part::new(cluster, pos, b, action));
            pos = b;
        }
        let mut allocs = Allocs::new();
        let (mut first, mut last) = (first, last);
        if let Some((g, n)) = allocating {
            let granule = self.granule_run(q, &parts, g, n);
            let run = match &granule {
                Some((_, _, all)) => q.alloc_clusters_now(all.len() as u64)?,
                None => None,
            };
            match (granule, run) {
                (Some((g_first, g_last, all)), Some(run)) => {
                    // The other unallocated clusters of the group join the plan as first
                    // writes of nothing: their entries map the run, and fresh clusters
                    // read zeros.
                    m.st_mut().stats.clusters_taken_ahead += all.len() as u64 - n;
                    parts = all;
                    (first, last) = (g_first, g_last);
                    allocs.push(run);
                }
                _ => {
                    let Some(run) = q.alloc_clusters_now(n)? else {
                        return Ok(None);
                    };
                    allocs.push(run);
                }
            }
        }
        let mut st = m.st_mut();
        st.alloc.inflight_mut().mark(first, last);
        st.stats.writes_planned_now += 1;
        Ok(Some((parts, allocs)))
    }

    /// The task of a guest write [`plan_now`](Self::plan_now) planned (`tag`, entered with
    /// `entry`): its data, then [`finish_chunk`](Self::finish_chunk), then completion.
    /// Data that is the guest's alone, on consecutive host bytes (whole new clusters, or
    /// part of one that reads as zeros), is one device write awaited in place; anything
    /// else (COW data) goes through [`write_data`](Self::write_data), boxed. One async fn
    /// with nothing nested but the I/O and the commit, so that the task's future stays
    /// small (within the allocator's per-thread cache: ~1 KiB).
    async fn planned_task(
        self: Rc<Self>,
        tag: u64,
        entry: GraceEntry,
        start: GuestOffset,
        (parts, allocs): (Parts, Allocs),
        data: BufSlice<D::Buf>,
    ) {
        let r = match top(&self).and_then(|q| q.owner()) {
            Ok(o) => {
                let q = &o;
                let mut cursor = AllocCursor::new(&allocs);
                let mut one_run = true;
                let mut host_start = None;
                let mut next = None;
                for p in &parts {
                    let (h, span) = self.part_range(q, p, &mut cursor);
                    if span.is_empty() {
                        // A cluster of the group that this write leaves alone.
                        continue;
                    }
                    let host_off = h.plus(span.start());
                    one_run &= span == p.written && next.is_none_or(|n| n == host_off);
                    host_start.get_or_insert(host_off);
                    next = Some(host_off.plus(span.len()));
                }
                let res = match host_start {
                    Some(h) if one_run => self.exec().write(q.dev(), h.0, data).await,
                    _ => Box::pin(self.write_data(q, start, &parts, &allocs, Some(data))).await,
                };
                self.finish_chunk(q, &parts, &allocs, res).await
            }
            Err(e) => Err(e),
        };
        self.exec().complete_entered(tag, r, entry);
    }

    /// Decides the action for each guest cluster of `[start, end)` and allocates what is
    /// needed (refcounts and L2 tables, in the dirty metadata). Returns the parts and, per
    /// allocated run, its [`Allocation`]. Caller holds the lock.
    async fn plan_chunk(&self, q: &Owner<'_, D>, start: u64, end: u64) -> Result<(Parts, Allocs)> {
        let geo = q.geometry();
        let cs = geo.cluster_size();
        let mut parts = Parts::new();
        let mut pos = start;
        while pos < end {
            let cluster = pos & !(cs - 1);
            let b = end.min(cluster + cs);
            let (entry, bitmap) = q.l2_words(GuestOffset(cluster)).await?;
            let action = action_for(q, entry, bitmap)?;
            parts.push(Part::new(cluster, pos, b, action));
            pos = b;
        }
        // Rule 6: an entry pointing into the image's own metadata is corruption; never
        // write through it.
        for p in &parts {
            let host = match p.action {
                Action::InPlace { host }
                | Action::Rewrite { host, .. }
                | Action::SubclusterInPlace { host, .. } => host,
                Action::Alloc { .. } => continue,
            };
            if q.overlaps_metadata(geo.host_cluster_offset(geo.host_cluster(host)), cs) {
                return Err(q
                    .mark_corrupt(Field::L2Entry, host.0, "L2 entry points into metadata")
                    .await);
            }
        }
        let need = parts
            .iter()
            .filter(|p| matches!(p.action, Action::Alloc { .. }))
            .count() as u64;
        let mut allocs = Allocs::new();
        if need > 0
            || parts.iter().any(|p| {
                matches!(
                    p.action,
                    Action::SubclusterInPlace { .. } | Action::Rewrite { .. }
                )
            })
        {
            q.ensure_l2(GuestOffset(start)).await?;
        }
        // The allocating parts' guest clusters, in order; each run of consecutive ones gets
        // host clusters where the allocator places that run (`alloc_data`).
        let mut guest = parts
            .iter()
            .filter(|p| matches!(p.action, Action::Alloc { .. }))
            .map(|p| geo.guest_cluster(p.cluster))
            .peekable();
        while let Some(g) = guest.next() {
            let mut run = 1;
            while guest.next_if_eq(&(g + run)).is_some() {
                run += 1;
            }
            let mut done = 0;
            while done < run {
                let a = match q.alloc_data(g + done, run - done).await {
                    Ok(a) => a,
                    Err(e) => {
                        for &a in &allocs {
                            let _ = q.free_unreferenced(a).await;
                        }
                        return Err(e);
                    }
                };
                allocs.push(a);
                done += a.count;
            }
        }
        Ok((parts, allocs))
    }

    /// Whether guest bytes of `old` (the mapping of the guest cluster starting at
    /// `cluster`) in this layer read as zeros without looking at data.
    fn reads_zero(&self, old: &ClusterMapping, cluster: GuestOffset) -> bool {
        match old {
            ClusterMapping::Zero { .. } => true,
            ClusterMapping::Unallocated { .. } => {
                self.layers().get(1).is_none_or(|b| cluster.0 >= b.size())
            }
            _ => false,
        }
    }

    /// Where part `p` of a plan writes: (host offset of its cluster, the span of the
    /// cluster written, which is `p.written` or more when it needs COW data around the
    /// guest's). An allocating part takes the next cluster of `allocs`.
    fn part_range(
        &self,
        q: &Qcow2<D>,
        p: &Part,
        allocs: &mut AllocCursor<'_>,
    ) -> (HostOffset, ClusterSpan) {
        let geo = q.geometry();
        let whole = ClusterSpan::whole(geo.cluster_size());
        let sc = geo.subcluster_size();
        match p.action {
            Action::InPlace { host } => (host, p.written),
            Action::Rewrite { host, .. } => (host, whole),
            Action::SubclusterInPlace { host, .. } => (host, p.written.round_out(sc)),
            Action::Alloc { old, .. } => {
                let NewCluster { host: h, fresh } = allocs.next_cluster(&geo);
                if geo.extended_l2 {
                    if matches!(old, ClusterMapping::Data { .. }) {
                        // A shared cluster: copy all of it.
                        (h, whole)
                    } else {
                        (h, p.written.round_out(sc))
                    }
                } else if fresh && self.reads_zero(&old, p.cluster) {
                    (h, p.written)
                } else {
                    (h, whole)
                }
            }
        }
    }

    /// Issues the data writes of a plan: one device write per part (head and tail COW
    /// merged in), and one per run of consecutive new clusters written straight from the
    /// guest buffer when no COW data is needed. `data` holds the guest bytes from `start`
    /// (`None`: zeros).
    async fn write_data(
        self: &Rc<Self>,
        q: &Owner<'_, D>,
        start: GuestOffset,
        parts: &[Part],
        allocs: &[Allocation],
        data: Option<BufSlice<D::Buf>>,
    ) -> Result<()> {
        let mut futs = Vec::new();
        // Pending direct run: (host start, guest start, len).
        let mut run: Option<(HostOffset, GuestOffset, u64)> = None;
        let mut cursor = AllocCursor::new(allocs);
        let exec = self.exec().clone();
        let dev = q.dev();
        // A cluster of a group taken ahead has no guest bytes (and may lie past them).
        let guest = |at: GuestOffset, len: u64| {
            data.as_ref()
                .filter(|_| len > 0)
                .map(|d| d.sub(at.since(start) as usize, len as usize))
        };
        // A direct run's data: the guest's bytes, or zeros.
        let run_buf = |g: GuestOffset, len: u64| {
            guest(g, len).unwrap_or_else(|| BufSlice::whole(exec.alloc_buf(dev, len as usize)))
        };
        let flush_run = |run: &mut Option<(HostOffset, GuestOffset, u64)>, futs: &mut Vec<_>| {
            if let Some((h, g, len)) = run.take() {
                futs.push(Box::pin(exec.write(dev, h.0, run_buf(g, len))));
            }
        };
        for p in parts {
            // `span` is what this part writes of its cluster, `w` the guest's part of it.
            let (host, span) = self.part_range(q, p, &mut cursor);
            let w = p.written;
            let host_off = host.plus(span.start());
            let len = span.len();
            let guest_at = p.guest(w.start());
            if len == 0 {
                // A cluster of the group taken ahead that reads zeros as it is.
                continue;
            }
            if span == w {
                // Guest data only: extend or start a direct run.
                match &mut run {
                    Some((h, g, l)) if h.plus(*l) == host_off && g.plus(*l) == guest_at => {
                        *l += len
                    }
                    _ => {
                        flush_run(&mut run, &mut futs);
                        run = Some((host_off, guest_at, len));
                    }
                }
                continue;
            }
            flush_run(&mut run, &mut futs);
            if q.overlaps_metadata(host_off, len) {
                return Err(q
                    .mark_corrupt(
                        Field::L2Entry,
                        host_off.0,
                        "data write would overlap metadata",
                    )
                    .await);
            }
            // COW data that reads as zeros needs no read (a first write into a new cluster
            // on a device that may hold old data: the cluster is written whole).
            let zero_cow = match p.action {
                Action::Rewrite { .. } => true,
                Action::Alloc { old, .. } => self.reads_zero(&old, p.cluster),
                Action::SubclusterInPlace { bitmap: b, .. } => {
                    // The COW data lies in the first and the last subcluster written: zeros
                    // where they are not allocated and read as zeros or no backing data.
                    let sc = q.geometry().subcluster_size();
                    let no_backing =
                        self.reads_zero(&ClusterMapping::Unallocated { host: None }, p.cluster);
                    // Whether the subcluster holding byte `at` of the cluster reads as zeros.
                    let zero = |at: u64| {
                        let i = at / sc;
                        !b.allocated(i) && (b.zero(i) || no_backing)
                    };
                    (span.start() == w.start() || zero(w.start()))
                        && (span.end() == w.end() || zero(w.end() - 1))
                }
                Action::InPlace { .. } => false,
            };
            if zero_cow
                && len - w.len() >= ZEROES_OFFLOAD_MIN
                && exec.with_device(dev, |d| d.zeroes_cheaply())
            {
                // The device zeroes around the guest data itself (as QEMU does where zeroing
                // is cheap): the guest's bytes go from its own buffer, nothing bounces.
                let (head, tail) = (w.start() - span.start(), span.end() - w.end());
                match guest(guest_at, w.len()) {
                    Some(g) => {
                        if head > 0 {
                            futs.push(Box::pin(exec.write_zeroes(dev, host_off.0, head)));
                        }
                        futs.push(Box::pin(exec.write(dev, host_off.plus(head).0, g)));
                        if tail > 0 {
                            futs.push(Box::pin(exec.write_zeroes(
                                dev,
                                host_off.plus(len - tail).0,
                                tail,
                            )));
                        }
                    }
                    // The guest writes zeros too.
                    None => futs.push(Box::pin(exec.write_zeroes(dev, host_off.0, len))),
                }
                continue;
            }
            // Bounce: COW data around the guest data (zeroed: zeros need no read).
            let bounce = q.exec().alloc_buf(dev, len as usize);
            if !zero_cow {
                if span.start() < w.start() {
                    let b = BufSlice {
                        buf: bounce.clone(),
                        off: 0,
                        len: (w.start() - span.start()) as usize,
                    };
                    read_layer(self.clone(), 0, p.guest(span.start()).0, b).await?;
                }
                if w.end() < span.end() {
                    let b = BufSlice {
                        buf: bounce.clone(),
                        off: (w.end() - span.start()) as usize,
                        len: (span.end() - w.end()) as usize,
                    };
                    read_layer(self.clone(), 0, p.guest(w.end()).0, b).await?;
                }
            }
            if let Some(g) = guest(guest_at, w.len()) {
                let mut tmp = vec![0u8; g.len];
                g.copy_out(0, &mut tmp);
                bounce.copy_in((w.start() - span.start()) as usize, &tmp);
            }
            futs.push(Box::pin(q.exec().write(
                dev,
                host_off.0,
                BufSlice::whole(bounce),
            )));
        }
        if futs.is_empty() {
            // One device write (the common case): awaited in place, nothing boxed.
            return match run {
                Some((h, g, len)) => exec.write(dev, h.0, run_buf(g, len)).await,
                None => Ok(()),
            };
        }
        flush_run(&mut run, &mut futs);
        crate::exec::join_all(futs).await
    }

    /// Records a finished plan in the dirty metadata. Caller holds the lock. The parts
    /// lie in one L2 slice (a chunk): it is made dirty once, if anything changes.
    async fn commit(&self, q: &Owner<'_, D>, parts: &[Part], allocs: &[Allocation]) -> Result<()> {
        let mut cursor = AllocCursor::new(allocs);
        let changes = parts
            .iter()
            .any(|p| Self::new_words(q, p, &mut cursor).is_some());
        if let (true, Some(p)) = (changes, parts.first()) {
            q.dirty_slice_for(p.cluster).await?;
        }
        let mut cursor = AllocCursor::new(allocs);
        for p in parts {
            let Some((entry, bitmap)) = Self::new_words(q, p, &mut cursor) else {
                continue;
            };
            q.set_l2_words(p.cluster, entry, bitmap)?;
            if let Action::Alloc { old, .. } = p.action {
                let cs = q.geometry().cluster_size();
                match old {
                    ClusterMapping::Data { host, .. } => q.free_later(HostRange::new(host, cs)),
                    ClusterMapping::Zero { host: Some(h) } => q.free_later(HostRange::new(h, cs)),
                    ClusterMapping::Compressed(d) => q.free_later(d.sectors()),
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// The L2 words (entry, bitmap) part `p` of a finished plan leaves, `None` when they
    /// stay as they are. An allocating part takes the next cluster of `allocs`.
    fn new_words(
        q: &Qcow2<D>,
        p: &Part,
        allocs: &mut AllocCursor<'_>,
    ) -> Option<(L2Entry, SubclusterBitmap)> {
        let geo = q.geometry();
        let sc = geo.subcluster_size();
        let touched = || p.written.unit_mask(sc);
        match p.action {
            Action::InPlace { .. } => None,
            Action::Rewrite { host, entry } => {
                Some((entry.written_at(host), SubclusterBitmap::NONE))
            }
            Action::SubclusterInPlace { entry, bitmap, .. } => {
                let t = touched();
                let nb = SubclusterBitmap::new(bitmap.alloc_mask() | t, bitmap.zero_mask() & !t);
                (nb != bitmap).then_some((entry, nb))
            }
            Action::Alloc { bitmap, old } => {
                let h = allocs.next_cluster(&geo).host;
                let nb = if geo.extended_l2 {
                    // A copied shared cluster keeps its allocated subclusters.
                    let old_alloc = if matches!(old, ClusterMapping::Data { .. }) {
                        bitmap.alloc_mask()
                    } else {
                        0
                    };
                    let t = touched();
                    SubclusterBitmap::new(old_alloc | t, bitmap.zero_mask() & !t)
                } else {
                    SubclusterBitmap::NONE
                };
                Some((L2Entry::copied_data(h), nb))
            }
        }
    }

    /// Writes zeros over `[offset, offset+len)`: whole clusters (or subclusters) through
    /// metadata only, partial ones as data.
    pub async fn write_zeroes(self: &Rc<Self>, offset: u64, len: u64, unmap: bool) -> Result<()> {
        self.zero_range(offset, len, ZeroKind::WriteZeroes { unmap })
            .await
    }

    /// Discards `[offset, offset+len)`: whole clusters are freed (or get the zero flag when a
    /// backing image would otherwise show through); partial clusters are left alone.
    pub async fn discard(self: &Rc<Self>, offset: u64, len: u64) -> Result<()> {
        self.zero_range(offset, len, ZeroKind::Discard).await
    }

    async fn zero_range(self: &Rc<Self>, offset: u64, len: u64, kind: ZeroKind) -> Result<()> {
        let q = top(self)?;
        self.check_range(offset, len)?;
        self.note_change(offset, len);
        let geo = q.geometry();
        let cs = geo.cluster_size();
        let gran = geo.subcluster_size();
        let v3 = q.l2_context().v3;
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let cluster = pos & !(cs - 1);
            let b = end.min(cluster + cs);
            let whole_units = if geo.extended_l2 {
                (pos.div_ceil(gran) * gran, b / gran * gran)
            } else if pos == cluster && b == cluster + cs {
                (pos, b)
            } else {
                (pos, pos)
            };
            // Version 2 has no zero flag: only a discard with nothing underneath can go
            // through metadata (the cluster becomes unallocated and reads as zeros).
            let no_backing = self.layers().get(1).is_none_or(|l| cluster >= l.size());
            let metadata_ok =
                whole_units.0 < whole_units.1 && (v3 || (kind == ZeroKind::Discard && no_backing));
            if !metadata_ok {
                if let ZeroKind::WriteZeroes { .. } = kind {
                    self.write_chunk(q, pos, b, None).await?;
                }
                pos = b;
                continue;
            }
            // Partial head/tail subclusters of write-zeroes are written as data.
            if let ZeroKind::WriteZeroes { .. } = kind {
                if pos < whole_units.0 {
                    self.write_chunk(q, pos, whole_units.0, None).await?;
                }
                if whole_units.1 < b {
                    self.write_chunk(q, whole_units.1, b, None).await?;
                }
            }
            let span = ClusterSpan::new(whole_units.0 - cluster, whole_units.1 - cluster);
            self.zero_cluster_metadata(q, GuestOffset(cluster), span, kind)
                .await?;
            pos = b;
        }
        Ok(())
    }

    /// Zeroes/discards `span` (whole subclusters, or the whole cluster) of the guest
    /// cluster starting at `cluster` through its L2 entry.
    async fn zero_cluster_metadata(
        &self,
        q: &Qcow2<D>,
        cluster: GuestOffset,
        span: ClusterSpan,
        kind: ZeroKind,
    ) -> Result<()> {
        let geo = q.geometry();
        let cs = geo.cluster_size();
        let c = geo.guest_cluster(cluster);
        let o = q.owner()?;
        let q = &o;
        let guard = self.lock_clusters(q, c, c).await;
        let r = async {
            let has_backing = self.layers().get(1).is_some_and(|l| cluster.0 < l.size());
            let (entry, bitmap) = q.l2_words(cluster).await?;
            let ctx = q.l2_context();
            let old = if geo.extended_l2 {
                entry.subcluster_mapping(bitmap, 0, &ctx)?;
                None
            } else {
                Some(entry.mapping(&ctx)?)
            };
            // The new words, and the host bytes to free once they are stable.
            let (new_entry, new_bitmap, free): (_, _, Option<HostRange>) = if geo.extended_l2 {
                let sc = geo.subcluster_size();
                let t = span.whole_unit_mask(sc);
                let host = entry.host_bits();
                let all = t == u32::MAX;
                let unmap = matches!(
                    kind,
                    ZeroKind::Discard | ZeroKind::WriteZeroes { unmap: true }
                );
                if all && unmap && host != 0 {
                    let zero = if has_backing || kind != ZeroKind::Discard {
                        u32::MAX
                    } else {
                        0
                    };
                    (
                        L2Entry::UNALLOCATED,
                        SubclusterBitmap::new(0, zero),
                        Some(HostRange::new(HostOffset(host), cs)),
                    )
                } else if kind == ZeroKind::Discard && !has_backing {
                    (
                        entry,
                        SubclusterBitmap::new(bitmap.alloc_mask() & !t, bitmap.zero_mask() & !t),
                        None,
                    )
                } else {
                    (
                        entry,
                        SubclusterBitmap::new(bitmap.alloc_mask() & !t, bitmap.zero_mask() | t),
                        None,
                    )
                }
            } else {
                let old = old.unwrap_or(ClusterMapping::Unallocated { host: None });
                let unmap = matches!(
                    kind,
                    ZeroKind::Discard | ZeroKind::WriteZeroes { unmap: true }
                );
                let free = match old {
                    ClusterMapping::Data { host, copied } if unmap || !copied => {
                        Some(HostRange::new(host, cs))
                    }
                    ClusterMapping::Zero { host: Some(h) } if unmap || !entry.is_copied() => {
                        Some(HostRange::new(h, cs))
                    }
                    ClusterMapping::Compressed(d) => Some(d.sectors()),
                    _ => None,
                };
                let keep_host = match (free, old) {
                    (None, ClusterMapping::Data { host, .. }) => Some(host),
                    (None, ClusterMapping::Zero { host: Some(h) }) => Some(h),
                    _ => None,
                };
                let ne = match (kind, keep_host) {
                    (_, Some(h)) => L2Entry::copied_zero(h),
                    (ZeroKind::Discard, None) if !has_backing => L2Entry::UNALLOCATED,
                    _ => L2Entry::ZERO,
                };
                (ne, SubclusterBitmap::NONE, free)
            };
            if new_entry == entry && new_bitmap == bitmap {
                return Ok(());
            }
            if q.l2_table(cluster)?.is_none() {
                if new_entry == L2Entry::UNALLOCATED && new_bitmap == SubclusterBitmap::NONE {
                    return Ok(());
                }
                q.ensure_l2(cluster).await?;
            } else if !q.l1_copied(cluster) {
                q.ensure_l2(cluster).await?;
            }
            q.dirty_slice_for(cluster).await?;
            q.set_l2_words(cluster, new_entry, new_bitmap)?;
            if let Some(r) = free {
                q.free_later(r);
            }
            q.maybe_writeback_locked().await
        }
        .await;
        drop(guard);
        self.unmark_clusters(q, c, c);
        r
    }

    /// Guest flush: all writes completed before it are durable when it returns.
    pub async fn flush(self: &Rc<Self>) -> Result<()> {
        top(self)?.flush().await
    }

    /// On the metadata owner, called from its poll loop: when dirty metadata has waited
    /// [`BACKGROUND_WRITEBACK_INTERVAL`](crate::meta::BACKGROUND_WRITEBACK_INTERVAL) without
    /// a flush, starts writing it back (a task; no device flush). Returns whether it
    /// started one. A failure leaves the metadata dirty for the next flush, which reports it.
    pub fn tick_background_writeback(self: &Rc<Self>) -> bool {
        let Ok(q) = top(self) else {
            return false;
        };
        if !q.background_writeback_due() {
            return false;
        }
        let chain = self.clone();
        self.exec().spawn(async move {
            if let Ok(q) = top(&chain) {
                if let Err(e) = q.background_writeback().await {
                    tracing::warn!("background metadata write-back failed: {e}");
                }
            }
        });
        true
    }

    /// Whether dirty metadata waits for [`tick_background_writeback`](Self::tick_background_writeback)
    /// to start its write-back: a poll loop that stops polling while idle must not stop
    /// while this holds (the quiet write-back bounds how long a slice stays dirty).
    pub fn background_writeback_pending(&self) -> bool {
        top(self).is_ok_and(|q| q.background_writeback_pending())
    }

    /// Flushes everything, refcounts included, and clears the dirty bit (lazy refcounts):
    /// call before dropping a writable chain.
    pub async fn close(self: &Rc<Self>) -> Result<()> {
        top(self)?.close().await
    }
}
