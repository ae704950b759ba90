//! In-place writes from cached metadata: the one-extent check the route asks
//! ([`Chain::plan_write_extent`]), the cluster-by-cluster walk, and the fast path that
//! submits an overwrite without a task ([`Chain::try_fast_write`]).

use crate::chain::{Chain, Layer};
use crate::coherency::Shared;
use crate::exec::{DevId, GraceEntry};
use crate::format::ClusterMapping;
use crate::image::{CachedExtent, MemoFirst, Qcow2, Touch, Wanted};
use crate::io::{BlockDevice, BufSlice, DeviceOp};
use crate::types::{GuestOffset, HostOffset};

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

impl<D: BlockDevice> Chain<D> {
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
        self.plan_write_extent_with(offset, len, MemoFirst::Ask)
    }

    /// [`plan_write_extent`](Self::plan_write_extent); with [`MemoFirst::Skip`], for a
    /// caller that has just asked the memo, straight to the slice cache.
    #[inline(always)]
    pub(crate) fn plan_write_extent_with(
        &self,
        offset: u64,
        len: u64,
        memo: MemoFirst,
    ) -> WriteExtent {
        let Layer::Qcow2(q) = &self.layers()[0] else {
            return WriteExtent::Refused;
        };
        if let Some(h) = (memo == MemoFirst::Ask)
            .then(|| q.memo_overwrite(offset, len))
            .flatten()
        {
            return WriteExtent::One(q.data_dev(), HostOffset(h));
        }
        let side = match self.fast_write_side(q) {
            InPlaceSide::ReadOnly => return WriteExtent::Refused,
            side => side,
        };
        let h = match q.cached_extent_with(offset, len, Wanted::CopiedData, memo) {
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
        WriteExtent::One(q.data_dev(), h)
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
        Some((q.data_dev(), n))
    }

    /// In-place fast path: every cluster COPIED data (standard L2), slice cached, no
    /// allocation in flight. Otherwise hands `entry` back, having changed nothing.
    pub(super) fn try_fast_write(
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
}
