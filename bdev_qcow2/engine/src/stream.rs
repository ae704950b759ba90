//! Streaming (ARCHITECTURE.md §13): copying into the top image every cluster it reads from
//! its backing chain, in the background, then dropping the backing reference.
//!
//! On the owner's core. Each step takes a few clusters of one L2 slice: it marks them in
//! flight (guest writers of those clusters wait, as behind any allocation), reads what the
//! guest sees there through the chain's read path, writes it into new clusters (or the
//! unallocated subclusters of an extended-L2 cluster, in place) and commits the mappings
//! only if the L2 words are still those it planned from. A guest write that completed
//! before the step planned made the cluster allocated, and the step leaves it alone; one
//! that arrives later waits for the step's commit and then writes over it. So guest writes
//! always win. Backing data that reads as zeros becomes a zero flag (version 3), not data.
//!
//! The [`StreamJob`] drives the steps from the host's poller, throttled to a rate, and
//! then drops the backing reference ([`Chain::finish_stream`]); the host detaches the
//! backing layer from every core's chain, and only then from the owner's
//! ([`StreamJob::cores_detached`]).

use crate::chain::{read_layer, Chain, Layer};
use crate::error::{Error, Field, Result};
use crate::format::{L2Entry, SubclusterBitmap};
use crate::image::owner::alloc::Allocation;
use crate::image::owner::discards::FreeKind;
use crate::image::owner::Owner;
use crate::image::Qcow2;
use crate::io::{BlockDevice, BufSlice, IoBuffer};
use crate::types::{GuestOffset, HostOffset, HostRange};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::{Duration, Instant};

/// Guest bytes one step covers at most (fewer at a slice's end).
const STEP_BYTES: u64 = 1 << 20;

/// What a step does to one guest cluster; `entry` and `bitmap` are its L2 words as the
/// step planned from them (the commit happens only while they still hold).
#[derive(Debug, Clone, Copy)]
struct Fill {
    cluster: GuestOffset,
    entry: L2Entry,
    bitmap: SubclusterBitmap,
    /// The subclusters to fill (all 32 bits, or bit 0 alone, without extended L2: the
    /// whole cluster).
    fill: u32,
    /// `Some(host)`: extended L2, a COPIED cluster: the fill goes in place. `None`: a new
    /// cluster takes what the guest sees of the whole cluster.
    in_place: Option<HostOffset>,
}

impl<D: BlockDevice> Chain<D> {
    /// The top image as its owner, and where the backing chain ends (`None`: no backing).
    fn stream_owner(&self) -> Result<(&Qcow2<D>, Option<u64>)> {
        let Some(Layer::Qcow2(q)) = self.layers().first() else {
            return Err(Error::ReadOnly);
        };
        q.owner()?;
        Ok((q, self.layers().get(1).map(Layer::size)))
    }

    /// How many guest bytes a stream covers: the disk up to where the backing chain ends,
    /// in whole clusters (0 without a backing layer).
    pub fn stream_extent(&self) -> Result<u64> {
        let (q, backing_end) = self.stream_owner()?;
        let cs = q.geometry().cluster_size();
        Ok(backing_end.map_or(0, |b| b.min(self.size()).div_ceil(cs) * cs))
    }

    /// One step of a stream: copies into the top image what the backing chain shows of
    /// guest bytes `[start, end)` (inside one L2 slice; cluster aligned) and the top
    /// image does not hold (see the module doc). Returns the bytes filled.
    pub async fn stream_range(self: &Rc<Self>, start: u64, end: u64) -> Result<u64> {
        let (q, Some(backing_end)) = self.stream_owner()? else {
            return Ok(0);
        };
        let o = q.owner()?;
        let cs = q.geometry().cluster_size();
        let end = end.min(self.size());
        if start >= end {
            return Ok(0);
        }
        let (first, last) = (start / cs, (end - 1) / cs);
        loop {
            let guard = self.lock_clusters(&o, first, last).await;
            let planned = self.plan_fills(&o, start, end, backing_end).await;
            drop(guard);
            let r = match planned {
                Ok(fills) if fills.is_empty() => Ok(Some(0)),
                Ok(fills) => self.run_fills(&o, &fills).await,
                Err(e) => Err(e),
            };
            self.unmark_clusters(&o, first, last);
            match r {
                Ok(Some(n)) => return Ok(n),
                // The mappings changed under the step (not by a guest write: those wait):
                // plan again.
                Ok(None) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// The fills of guest bytes `[start, end)`: every (sub)cluster below `backing_end` the
    /// top image does not allocate and does not read as zeros. Caller holds the lock.
    async fn plan_fills(
        &self,
        o: &Owner<'_, D>,
        start: u64,
        end: u64,
        backing_end: u64,
    ) -> Result<Vec<Fill>> {
        let geo = o.geometry();
        let (cs, sc) = (geo.cluster_size(), geo.subcluster_size());
        let ctx = o.l2_context();
        let mut fills = Vec::new();
        let mut c = start / cs * cs;
        while c < end && c < backing_end {
            let cluster = GuestOffset(c);
            let (entry, bitmap) = o.l2_words(cluster).await?;
            c += cs;
            if !geo.extended_l2() {
                if let crate::format::ClusterMapping::Unallocated { .. } = entry.mapping(&ctx)? {
                    fills.push(Fill {
                        cluster,
                        entry,
                        bitmap,
                        fill: 1,
                        in_place: None,
                    });
                }
                continue;
            }
            // Validates the entry and the bitmap; a compressed cluster holds all its data.
            if let crate::format::ClusterMapping::Compressed(_) =
                entry.subcluster_mapping(bitmap, 0, &ctx)?
            {
                continue;
            }
            // Subclusters wholly past the backing chain read as zeros either way.
            let below = (backing_end - cluster.0).div_ceil(sc).min(32);
            let mask = if below >= 32 {
                u32::MAX
            } else {
                (1u32 << below) - 1
            };
            let fill = !bitmap.alloc_mask() & !bitmap.zero_mask() & mask;
            if fill == 0 {
                continue;
            }
            let host = entry.host_bits();
            let in_place = (host != 0 && entry.is_copied()).then_some(HostOffset(host));
            if let Some(h) = in_place {
                // Rule 6, as for a guest write: never write through an entry into metadata.
                if o.overlaps_metadata(h, cs) {
                    return Err(o
                        .mark_corrupt(Field::L2Entry, h.0, "L2 entry points into metadata")
                        .await);
                }
            }
            fills.push(Fill {
                cluster,
                entry,
                bitmap,
                fill,
                in_place,
            });
        }
        Ok(fills)
    }

    /// Reads, writes and commits planned `fills` (their clusters marked in flight, the
    /// lock not held). `Ok(None)` when a cluster's L2 words changed meanwhile: nothing was
    /// committed, the step plans again.
    async fn run_fills(self: &Rc<Self>, o: &Owner<'_, D>, fills: &[Fill]) -> Result<Option<u64>> {
        let geo = o.geometry();
        let (cs, sc) = (geo.cluster_size(), geo.subcluster_size());
        let dev = o.data_dev();
        let exec = self.exec().clone();
        // What the guest sees of each cluster (of its fill subclusters, in place).
        let bufs: Vec<D::Buf> = fills
            .iter()
            .map(|_| exec.alloc_buf(dev, cs as usize))
            .collect();
        let mut reads = Vec::new();
        for (f, b) in fills.iter().zip(&bufs) {
            for (at, len) in runs(f, cs, sc) {
                let sub = BufSlice {
                    buf: b.clone(),
                    off: at as usize,
                    len: len as usize,
                };
                reads.push(read_layer(self.clone(), 0, f.cluster.0 + at, sub));
            }
        }
        crate::exec::join_all(reads).await?;
        // Backing data of zeros: a zero flag, no data (version 3 only).
        let v3 = o.l2_context().v3;
        let zero: Vec<bool> = fills
            .iter()
            .zip(&bufs)
            .map(|(f, b)| {
                v3 && (f.in_place.is_some() || f.entry.host_bits() == 0)
                    && runs(f, cs, sc).all(|(at, len)| {
                        let mut v = vec![0u8; len as usize];
                        b.copy_out(at as usize, &mut v);
                        v.iter().all(|&x| x == 0)
                    })
            })
            .collect();
        // New clusters for the data that needs one.
        let mut allocs: Vec<Option<Allocation>> = vec![None; fills.len()];
        {
            let _g = o.meta().lock().lock().await;
            let mut r = Ok(());
            for (i, f) in fills.iter().enumerate() {
                if zero[i] || f.in_place.is_some() {
                    continue;
                }
                match o.alloc_data(geo.guest_cluster(f.cluster), 1).await {
                    Ok(a) => allocs[i] = Some(a),
                    Err(e) => {
                        r = Err(e);
                        break;
                    }
                }
            }
            if r.is_ok() {
                r = o.ensure_l2(fills[0].cluster).await;
            }
            if let Err(e) = r {
                free_all(o, &allocs).await;
                return Err(e);
            }
        }
        // Data, without the lock.
        let mut writes = Vec::new();
        for (i, (f, b)) in fills.iter().zip(&bufs).enumerate() {
            if zero[i] {
                continue;
            }
            match (f.in_place, allocs[i]) {
                (Some(h), _) => {
                    for (at, len) in runs(f, cs, sc) {
                        let sub = BufSlice {
                            buf: b.clone(),
                            off: at as usize,
                            len: len as usize,
                        };
                        writes.push(exec.write(dev, h.0 + at, sub));
                    }
                }
                (None, Some(a)) => {
                    let h = geo.host_cluster_offset(a.first);
                    writes.push(exec.write(dev, h.0, BufSlice::whole(b.clone())));
                }
                (None, None) => {}
            }
        }
        let written = crate::exec::join_all(writes).await;
        // Commit, if the mappings are still those planned from.
        let _g = o.meta().lock().lock().await;
        if let Err(e) = written {
            free_all(o, &allocs).await;
            return Err(e);
        }
        let mut same = matches!(o.writable_l2(fills[0].cluster), Ok(Ok(())));
        for f in fills {
            if !same {
                break;
            }
            same = o.l2_words(f.cluster).await? == (f.entry, f.bitmap);
        }
        if !same {
            free_all(o, &allocs).await;
            return Ok(None);
        }
        o.dirty_slice_for(fills[0].cluster).await?;
        let mut filled = 0;
        for (i, f) in fills.iter().enumerate() {
            let (a, z) = (f.bitmap.alloc_mask(), f.bitmap.zero_mask());
            let words = if !geo.extended_l2() {
                match allocs[i] {
                    Some(al) => (
                        L2Entry::copied_data(geo.host_cluster_offset(al.first)),
                        SubclusterBitmap::NONE,
                    ),
                    None => (L2Entry::ZERO, SubclusterBitmap::NONE),
                }
            } else if zero[i] {
                (f.entry, SubclusterBitmap::new(a, z | f.fill))
            } else if f.in_place.is_some() {
                (f.entry, SubclusterBitmap::new(a | f.fill, z))
            } else {
                let Some(al) = allocs[i] else { continue };
                let old = f.entry.host_bits();
                if old != 0 {
                    // A cluster shared with a snapshot, copied whole: the copy keeps its
                    // allocated subclusters, the shared one loses this reference.
                    o.free_later(HostRange::new(HostOffset(old), cs), FreeKind::Other);
                }
                let keep = if old != 0 { a } else { 0 };
                (
                    L2Entry::copied_data(geo.host_cluster_offset(al.first)),
                    SubclusterBitmap::new(keep | f.fill, z),
                )
            };
            o.set_l2_words(f.cluster, words.0, words.1)?;
            filled += runs(f, cs, sc).map(|(_, len)| len).sum::<u64>();
        }
        o.maybe_writeback_locked().await?;
        Ok(Some(filled))
    }

    /// Ends a stream whose every cluster is in the top image: checks that no (sub)cluster
    /// below the end of the backing chain still reads from it, then drops the backing
    /// reference from the header ([`Owner::drop_backing`]). Returns whether the backing
    /// format extension went too. The chain still reads through its backing layer until
    /// [`Disk::detach_backing`](crate::chain::Disk::detach_backing): the host detaches the cores' chains first.
    pub async fn finish_stream(self: &Rc<Self>) -> Result<bool> {
        let (q, backing_end) = self.stream_owner()?;
        if let Some(b) = backing_end {
            let end = b.min(self.size());
            let mut pos = 0;
            while pos < end {
                let (m, n) = q.extent(pos, end).await?;
                if let crate::format::ClusterMapping::Unallocated { .. } = m {
                    return Err(Error::Refused(format!(
                        "guest offset {pos} still reads from the backing chain; stream it first"
                    )));
                }
                pos += n.max(1);
            }
        }
        q.owner()?.drop_backing().await
    }

    /// Drops the backing reference without looking at what the top image holds: what it
    /// read from the backing chain reads as zeros from now on (`qemu-img rebase -u -b ''`).
    /// The chain stops reading its backing layer at once (no other core may read it).
    pub async fn forget_backing(self: &Rc<Self>) -> Result<bool> {
        let (q, _) = self.stream_owner()?;
        let gone = q.owner()?.drop_backing().await?;
        self.disk.detach_backing();
        Ok(gone)
    }

    /// A whole stream on a chain no other core reads (the tool, tests): every step at
    /// full speed, the drop, and the backing layer detached. Returns the bytes filled.
    pub async fn stream(self: &Rc<Self>) -> Result<u64> {
        self.stream_with(|_| {}).await
    }

    /// [`stream`](Self::stream), telling `progress` after each step.
    pub async fn stream_with(
        self: &Rc<Self>,
        mut progress: impl FnMut(&StreamProgress),
    ) -> Result<u64> {
        let job = StreamJob::new(self, 0)?;
        while let Some((start, end)) = job.next_step() {
            let n = self.stream_range(start, end).await?;
            job.step_done(end, n);
            progress(&job.progress());
        }
        *job.0.state.borrow_mut() = StreamState::Dropping;
        self.finish_stream().await?;
        self.disk.detach_backing();
        *job.0.state.borrow_mut() = StreamState::Done;
        progress(&job.progress());
        Ok(job.progress().bytes_filled)
    }
}

/// The byte runs `(offset in the cluster, length)` a fill reads and writes: the whole
/// cluster for a new one, each run of fill subclusters in place.
fn runs(f: &Fill, cs: u64, sc: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
    let whole = f.in_place.is_none();
    let mut i = 0u64;
    std::iter::from_fn(move || {
        if whole {
            return (i == 0).then(|| {
                i = 1;
                (0, cs)
            });
        }
        while i < 32 && f.fill & (1 << i) == 0 {
            i += 1;
        }
        if i >= 32 {
            return None;
        }
        let s = i;
        while i < 32 && f.fill & (1 << i) != 0 {
            i += 1;
        }
        Some((s * sc, (i - s) * sc))
    })
}

async fn free_all<D: BlockDevice>(o: &Owner<'_, D>, allocs: &[Option<Allocation>]) {
    for a in allocs.iter().flatten() {
        let _ = o.free_unreferenced(*a).await;
    }
}

/// Where a stream job is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamState {
    /// Copying clusters.
    Copying,
    /// Every cluster copied: writing back, then dropping the backing reference.
    Dropping,
    /// The header no longer names a backing file: the host detaches the backing layer
    /// from every core, then calls [`StreamJob::cores_detached`].
    Detaching,
    /// Done: the image stands alone.
    Done,
    /// Cancelled before the drop: what was copied stays in the image, which still names
    /// its backing file (a later stream goes on from there).
    Cancelled,
    /// Failed with this error; the image still names its backing file unless the drop
    /// itself was under way.
    Failed(String),
}

impl StreamState {
    /// A name for status reports.
    pub fn name(&self) -> &'static str {
        match self {
            StreamState::Copying => "copying",
            StreamState::Dropping => "dropping_backing",
            StreamState::Detaching => "detaching",
            StreamState::Done => "done",
            StreamState::Cancelled => "cancelled",
            StreamState::Failed(_) => "failed",
        }
    }
    /// Whether the job is still running.
    pub fn running(&self) -> bool {
        matches!(
            self,
            StreamState::Copying | StreamState::Dropping | StreamState::Detaching
        )
    }
}

/// A stream's progress (`bdev_qcow2_get_stats`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamProgress {
    /// Where the job is.
    pub state: StreamState,
    /// Guest bytes looked at so far, of `bytes_total`.
    pub bytes_done: u64,
    /// Guest bytes the stream covers (the disk up to the end of the backing chain).
    pub bytes_total: u64,
    /// Bytes copied into the top image (or recorded as zeros) so far.
    pub bytes_filled: u64,
    /// Clusters looked at so far, of `clusters_total`.
    pub clusters_done: u64,
    /// Clusters the stream covers.
    pub clusters_total: u64,
    /// The rate limit, bytes per second of data copied (0: none).
    pub rate_limit: u64,
}

/// A background stream on the owner's core, driven by [`poll`](Self::poll) from the
/// host's poller: one step at a time, each spawned on the chain's executor, no faster
/// than the rate limit allows.
#[derive(Clone)]
pub struct StreamJob(Rc<Job>);

struct Job {
    total: u64,
    cluster_size: u64,
    slice_coverage: u64,
    next: Cell<u64>,
    filled: Cell<u64>,
    rate: Cell<u64>,
    /// The earliest time the next step may start (rate limit).
    not_before: Cell<Instant>,
    step_running: Cell<bool>,
    cancel: Cell<bool>,
    state: RefCell<StreamState>,
}

impl StreamJob {
    /// A stream of the top image of `chain` (on its owner's core) at `rate` bytes per
    /// second (0: unlimited). Refused when the chain has no backing layer.
    pub fn new<D: BlockDevice>(chain: &Chain<D>, rate: u64) -> Result<StreamJob> {
        let (q, backing) = chain.stream_owner()?;
        if backing.is_none() {
            return Err(Error::Refused(
                "the image has no backing file to stream from".into(),
            ));
        }
        let geo = q.geometry();
        Ok(StreamJob(Rc::new(Job {
            total: chain.stream_extent()?,
            cluster_size: geo.cluster_size(),
            slice_coverage: geo.slice_coverage(),
            next: Cell::new(0),
            filled: Cell::new(0),
            rate: Cell::new(rate),
            not_before: Cell::new(Instant::now()),
            step_running: Cell::new(false),
            cancel: Cell::new(false),
            state: RefCell::new(StreamState::Copying),
        })))
    }

    /// The next step's guest range, or `None` when every cluster was looked at.
    fn next_step(&self) -> Option<(u64, u64)> {
        let j = &self.0;
        let start = j.next.get();
        if start >= j.total {
            return None;
        }
        let slice_end = (start / j.slice_coverage + 1) * j.slice_coverage;
        let len = STEP_BYTES.max(j.cluster_size);
        Some((start, (start + len).min(slice_end).min(j.total)))
    }

    /// A step up to `end` filled `filled` bytes: the next may start once the rate allows.
    fn step_done(&self, end: u64, filled: u64) {
        let j = &self.0;
        j.next.set(end);
        j.filled.set(j.filled.get() + filled);
        let rate = j.rate.get();
        if rate > 0 && filled > 0 {
            let now = Instant::now();
            // A job that waited longer than a step's worth does not burst to catch up.
            let floor = now.checked_sub(Duration::from_millis(100)).unwrap_or(now);
            let from = j.not_before.get().max(floor);
            j.not_before
                .set(from + Duration::from_secs_f64(filled as f64 / rate as f64));
        }
    }

    /// Drives the job on the owner's core (call it from the host's poller): starts the next
    /// step when none runs and the rate limit allows, the drop when every cluster was
    /// looked at. Returns the state.
    pub fn poll<D: BlockDevice>(&self, chain: &Rc<Chain<D>>) -> StreamState {
        let state = self.0.state.borrow().clone();
        if self.0.step_running.get() {
            return state;
        }
        match state {
            StreamState::Copying => {}
            _ => return state,
        }
        if self.0.cancel.get() {
            *self.0.state.borrow_mut() = StreamState::Cancelled;
            return StreamState::Cancelled;
        }
        if Instant::now() < self.0.not_before.get() {
            return state;
        }
        let job = self.clone();
        let c = chain.clone();
        self.0.step_running.set(true);
        match self.next_step() {
            Some((start, end)) => chain.exec().spawn(async move {
                match c.stream_range(start, end).await {
                    Ok(n) => job.step_done(end, n),
                    Err(e) => *job.0.state.borrow_mut() = StreamState::Failed(e.to_string()),
                }
                job.0.step_running.set(false);
            }),
            None => {
                *self.0.state.borrow_mut() = StreamState::Dropping;
                chain.exec().spawn(async move {
                    let r = c.finish_stream().await;
                    *job.0.state.borrow_mut() = match r {
                        Ok(_) => StreamState::Detaching,
                        Err(e) => StreamState::Failed(e.to_string()),
                    };
                    job.0.step_running.set(false);
                });
            }
        }
        self.0.state.borrow().clone()
    }

    /// The host detached the backing layer from every core's chain: the owner's chain
    /// stops reading it too, and the job is done. Only in [`StreamState::Detaching`].
    pub fn cores_detached<D: BlockDevice>(&self, chain: &Chain<D>) {
        if *self.0.state.borrow() == StreamState::Detaching {
            chain.disk.detach_backing();
            *self.0.state.borrow_mut() = StreamState::Done;
        }
    }

    /// Asks the job to stop after its current step (before the drop only).
    pub fn cancel(&self) {
        self.0.cancel.set(true);
    }

    /// Sets the rate limit (bytes per second; 0: none).
    pub fn set_rate(&self, rate: u64) {
        self.0.rate.set(rate);
    }

    /// Where the job is.
    pub fn progress(&self) -> StreamProgress {
        let j = &self.0;
        let done = j.next.get().min(j.total);
        StreamProgress {
            state: j.state.borrow().clone(),
            bytes_done: done,
            bytes_total: j.total,
            bytes_filled: j.filled.get(),
            clusters_done: done.div_ceil(j.cluster_size),
            clusters_total: j.total.div_ceil(j.cluster_size),
            rate_limit: j.rate.get(),
        }
    }
}
