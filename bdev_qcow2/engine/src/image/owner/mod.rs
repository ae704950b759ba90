//! The metadata owner: its state and its operations, one module per concern, each holding
//! the concern's state (a private type changed only through its methods) together with
//! the operations built on it: allocation, refcounts, L2 tables, deferred frees, the
//! header and the ordered write-back ([`writeback`], ARCHITECTURE.md §7).
//!
//! The operations are methods of [`Owner`], a view of an image open for writing together
//! with its owner state ([`Meta`]): obtained once, at an entry point, by [`Qcow2::owner`]
//! (which fails with `ReadOnly` on a read-only image or a core replica), so that an
//! operation that needs the owner cannot be called without one. A child module of the
//! image, they reach its private fields (`Owner` dereferences to it); the image holds the
//! [`Meta`] when it is writable and reads it through its methods, and nothing below the
//! image calls the operations.
//!
//! - [`alloc`]: host clusters for data and metadata, the allocator's state, allocations
//!   in flight;
//! - [`regions`]: data regions of the ordered layout;
//! - [`bitmaps`]: persistent dirty bitmaps, loaded at open and stored at close;
//! - [`bitmap_change`]: enabling, disabling, clearing and merging them;
//! - [`refcount`]: refcount changes, new refcount blocks, a larger refcount table;
//! - [`l2`]: dirty L2 slices, new or copied L2 tables;
//! - [`dirty`]: the dirty metadata (L2 slices, refcount blocks, L1 and refcount-table
//!   entries);
//! - [`frees`]: frees after the metadata that removed a reference is stable, and grace
//!   periods;
//! - [`discards`]: freed clusters discarded on the device once nothing can point at them;
//! - [`header`]: the copies of the first sector, the corrupt and dirty bits;
//! - [`zeroed_tail`]: the zeroed tail, as kept and as raised;
//! - [`index`]: the clusters of metadata, for the overlap check;
//! - [`background`]: the background write-back and its timer;
//! - [`stats`]: the counters;
//! - [`resize`]: growing and shrinking the virtual disk;
//! - [`shadow`]: changes of refcounts and active tables switched by one header write;
//! - [`snapshot`]: internal snapshots (create, delete, apply);
//! - [`stream`]: dropping the backing reference after a stream;
//! - [`writeback`]: the ordered write-back, flush and close.

pub(crate) mod alloc;
pub(crate) mod background;
pub(crate) mod bitmap_change;
pub(crate) mod bitmap_dir;
pub(crate) mod bitmaps;
pub(crate) mod dirty;
pub(crate) mod discards;
pub(crate) mod frees;
pub(crate) mod header;
pub(crate) mod index;
pub(crate) mod l2;
pub(crate) mod refcount;
pub(crate) mod regions;
pub(crate) mod resize;
pub(crate) mod shadow;
pub(crate) mod snapshot;
pub(crate) mod space;
pub(crate) mod stats;
pub(crate) mod stream;
pub(crate) mod window;
pub(crate) mod writeback;
pub(crate) mod zeroed_tail;

pub use alloc::Inflight;
pub use background::BACKGROUND_WRITEBACK_INTERVAL;
pub use space::SpaceUsage;
pub use stats::OwnerStats;

use crate::coherency::Shared;
use crate::error::{Error, Result};
use crate::exec::{AsyncLock, Exec, WaitQueue};
use crate::format::ImageHeader;
use crate::image::Qcow2;
use crate::io::BlockDevice;
use std::cell::{Ref, RefCell, RefMut};

/// An image in its role of metadata owner: the image and its owner state (see the module
/// doc). Copied freely (three references).
pub(crate) struct Owner<'a, D: BlockDevice> {
    q: &'a Qcow2<D>,
    m: &'a Meta<D>,
    sh: Option<&'a Shared>,
}

impl<D: BlockDevice> Clone for Owner<'_, D> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<D: BlockDevice> Copy for Owner<'_, D> {}

impl<'a, D: BlockDevice> std::ops::Deref for Owner<'a, D> {
    type Target = Qcow2<D>;
    #[inline]
    fn deref(&self) -> &Qcow2<D> {
        self.q
    }
}

impl<'a, D: BlockDevice> Owner<'a, D> {
    /// The owner state.
    #[inline]
    pub(crate) fn meta(&self) -> &'a Meta<D> {
        self.m
    }
    /// The state published to the core replicas, once the image is
    /// [`share`](Qcow2::share)d.
    #[inline]
    pub(crate) fn published(&self) -> Option<&'a Shared> {
        self.sh
    }
}

/// Hash maps and sets of the owner's state: looked up on every allocating write, so with a
/// fast hasher (foldhash: seeded per process, far cheaper than SipHash on u64 keys).
pub(crate) type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
pub(crate) type HashSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

/// The owner's mutable state, one part per concern (see the module doc).
pub(crate) struct MetaState {
    /// Dirty metadata, written back in order.
    pub(crate) dirty: dirty::DirtyMetadata,
    /// The allocator.
    pub(crate) alloc: alloc::AllocState,
    /// The data regions of the ordered layout.
    pub(crate) regions: regions::DataRegions,
    /// Deferred frees and grace periods.
    pub(crate) frees: frees::Frees,
    /// The first sector's copies.
    pub(crate) header: header::HeaderCopies,
    /// The zeroed tail.
    pub(crate) tail: zeroed_tail::TailKeeper,
    /// Clusters of refcount blocks and active L2 tables.
    pub(crate) index: index::MetadataIndex,
    /// The background write-back's timer.
    pub(crate) timer: background::BackgroundTimer,
    /// Counters.
    pub(crate) stats: OwnerStats,
    /// The persistent bitmaps, when the image has any it keeps up to date.
    pub(crate) bitmaps: Option<bitmaps::KeptBitmaps>,
    /// The image's end against its space threshold.
    pub(crate) space: space::SpaceWatch,
}

impl MetaState {
    /// Zeroes ahead of the allocator from cluster `used_end` on, which lies past every
    /// cluster in use (`OpenOptions::zero_ahead`). Called at open, before anything is taken:
    /// clusters become fresh as the tail is raised past them.
    pub(crate) fn start_zero_ahead(&mut self, used_end: u64, cluster_bits: u32) {
        self.tail = zeroed_tail::TailKeeper::zeroed_ahead(used_end << cluster_bits);
        self.alloc = alloc::AllocState::new(used_end);
    }
    /// Gives the zeroed-ahead tail up (zeroing failed): no cluster inside the device,
    /// `dev_end` clusters long, is fresh any more.
    pub(crate) fn stop_zero_ahead(&mut self, dev_end: u64) {
        self.tail.drop_tail();
        self.alloc.written_below(dev_end);
    }
    /// What changes whenever metadata is allocated or newly dirtied (the quiet write-back's
    /// test that nothing happened).
    pub(crate) fn change_signature(&self) -> background::ChangeSignature {
        (
            self.stats.clusters_allocated,
            self.dirty.slices(),
            self.dirty.rc_blocks(),
        )
    }
}

/// The owner: its lock (every metadata mutation runs under it, so a write-back sees a
/// consistent set), the writers waiting for an allocation in flight, and its state.
pub struct Meta<D: BlockDevice> {
    lock: AsyncLock<D>,
    inflight_wait: WaitQueue<D>,
    /// Write-backs waiting for the slices a write-back at the bound writes unlocked.
    window_wait: WaitQueue<D>,
    st: RefCell<MetaState>,
    /// `OpenOptions::ordered_layout`.
    ordered_layout: bool,
    /// `OpenOptions::alloc_granule` in clusters (a power of two, 1: off).
    granule_clusters: u64,
    /// Dirty metadata bytes beyond which an allocating write writes back
    /// (`OpenOptions::dirty_bound_bytes`).
    dirty_bound: u64,
}

impl<D: BlockDevice> Meta<D> {
    /// The owner's state of an image opened for writing: `header` and cluster 0 `c0` as
    /// read, on a device of `device_size` bytes.
    pub(crate) fn new(
        exec: &Exec<D>,
        header: &ImageHeader,
        c0: &[u8],
        device_size: u64,
        ordered_layout: bool,
        alloc_granule: u64,
        pass_discard: discards::PassDiscard,
    ) -> Self {
        let cs = header.cluster_size();
        let granule_clusters = (alloc_granule / cs).max(1).next_power_of_two();
        let end = device_size.div_ceil(cs);
        // Past a zeroed tail (in the first sector, where we keep it), clusters read as zeros
        // from the start.
        let tail = zeroed_tail::TailKeeper::new(header.extensions.zeroed_tail);
        let fresh_from = tail.from().map_or(end, |f| f.div_ceil(cs).min(end));
        Meta {
            lock: AsyncLock::new(exec),
            inflight_wait: WaitQueue::new(exec),
            window_wait: WaitQueue::new(exec),
            ordered_layout,
            granule_clusters,
            dirty_bound: crate::image::MIN_DIRTY_BOUND,
            st: RefCell::new(MetaState {
                dirty: Default::default(),
                alloc: alloc::AllocState::new(fresh_from),
                regions: Default::default(),
                frees: frees::Frees::new(pass_discard),
                header: header::HeaderCopies::new(c0),
                tail,
                index: Default::default(),
                timer: Default::default(),
                stats: OwnerStats::default(),
                bitmaps: None,
                space: Default::default(),
            }),
        }
    }

    /// The state, to read.
    #[inline]
    pub(crate) fn st(&self) -> Ref<'_, MetaState> {
        self.st.borrow()
    }
    /// The state, to change (no borrow may be held across an await).
    #[inline]
    pub(crate) fn st_mut(&self) -> RefMut<'_, MetaState> {
        self.st.borrow_mut()
    }
    /// The state, to read, unless it is being changed.
    pub(crate) fn try_st(&self) -> Option<Ref<'_, MetaState>> {
        self.st.try_borrow().ok()
    }
    /// With `bound` dirty metadata bytes beyond which an allocating write writes back.
    pub(crate) fn with_dirty_bound(mut self, bound: u64) -> Self {
        self.dirty_bound = bound;
        self
    }
    /// Dirty metadata bytes beyond which an allocating write writes back.
    pub(crate) fn dirty_bound(&self) -> u64 {
        self.dirty_bound
    }
    /// The metadata lock.
    pub(crate) fn lock(&self) -> &AsyncLock<D> {
        &self.lock
    }
    /// Waits until an allocation in flight ends.
    pub(crate) async fn wait_inflight(&self) {
        self.inflight_wait.wait().await
    }
    /// Waits until a write-back at the bound finished writing its slices.
    pub(crate) async fn wait_window_closed(&self) {
        self.window_wait.wait().await
    }
    /// A write-back at the bound finished writing its slices: wakes the write-backs waiting.
    pub(crate) fn window_closed(&self) {
        self.window_wait.notify_all();
    }
    /// Unmarks guest clusters `first..=last` in flight and wakes their waiting writers.
    pub(crate) fn end_inflight(&self, first: u64, last: u64) {
        self.st
            .borrow_mut()
            .alloc
            .inflight_mut()
            .unmark(first, last);
        self.inflight_wait.notify_all();
    }
    /// Whether any of guest clusters `first..=last` has an allocation in flight.
    #[inline]
    pub(crate) fn inflight_any(&self, first: u64, last: u64) -> bool {
        self.st.borrow().alloc.inflight().any(first, last)
    }
    /// `OpenOptions::ordered_layout`.
    pub(crate) fn ordered_layout(&self) -> bool {
        self.ordered_layout
    }
    /// `OpenOptions::alloc_granule`, in clusters (1: each first write takes its own).
    pub(crate) fn granule_clusters(&self) -> u64 {
        self.granule_clusters
    }
    /// The counters.
    pub(crate) fn stats(&self) -> OwnerStats {
        let st = self.st.borrow();
        OwnerStats {
            discards_skipped: st.frees.discards_skipped(),
            ..st.stats
        }
    }

    /// A copy of a dirty L2 slice (or one being written back), if the owner holds one.
    pub(crate) fn dirty_slice(&self, key: u64) -> Option<Vec<u64>> {
        self.st.borrow().dirty.slice_copy(key)
    }
    /// Whether refcount block `block` is dirty.
    pub(crate) fn has_dirty_rc(&self, block: u64) -> bool {
        self.st.borrow().dirty.has_rc(block)
    }
    /// The dirty copy of refcount block `block`.
    pub(crate) fn dirty_rc_ref(&self, block: u64) -> Option<Ref<'_, Vec<u8>>> {
        Ref::filter_map(self.st.borrow(), |s| s.dirty.rc(block)).ok()
    }
    /// Whether host cluster `c` holds a refcount block or an active L2 table.
    #[inline]
    pub(crate) fn is_metadata_cluster(&self, c: u64) -> bool {
        self.st.borrow().index.contains(c)
    }
}

impl<D: BlockDevice> Qcow2<D> {
    /// This image as the metadata owner, or `ReadOnly` (opened read-only, or a core
    /// replica: its writes that change metadata go to the owner).
    #[inline]
    pub(crate) fn owner(&self) -> Result<Owner<'_, D>> {
        match self.owner_parts() {
            Some((m, sh)) => Ok(Owner { q: self, m, sh }),
            None => Err(Error::ReadOnly),
        }
    }

    /// Whether the owner should write its dirty metadata back now without a guest flush
    /// (see [`Owner::background_writeback_due`]); false unless this is the owner.
    pub fn background_writeback_due(&self) -> bool {
        self.owner().is_ok_and(|o| o.background_writeback_due())
    }

    /// Whether dirty L2 or L1 metadata waits for a background write-back (the owner's poll
    /// loop must keep asking [`background_writeback_due`](Self::background_writeback_due)
    /// while it does); false unless this is the owner.
    pub fn background_writeback_pending(&self) -> bool {
        self.owner().is_ok_and(|o| o.background_writeback_pending())
    }

    /// Writes the dirty metadata back in dependency order without flushing the device
    /// (see [`Owner::background_writeback`]); `ReadOnly` unless this is the owner.
    pub async fn background_writeback(&self) -> Result<()> {
        self.owner()?.background_writeback().await
    }

    /// Writes everything back (refcounts included, even with lazy refcounts), clears the
    /// dirty bit and flushes: the image is clean on disk when this returns. `ReadOnly`
    /// unless this is the owner.
    pub async fn close(&self) -> Result<()> {
        self.owner()?.close().await
    }

    /// Resizes the virtual disk to `new_size` bytes (see [`Owner::resize`]; shrinking
    /// needs `shrink` and an empty cut-off range) and returns the old size. Prefer
    /// [`Chain::resize`](crate::Chain::resize), which also keeps the chain's size and a
    /// backing image's data out of the new range. `ReadOnly` unless this is the owner.
    pub async fn resize(&self, new_size: u64, shrink: bool) -> Result<u64> {
        self.owner()?.resize(new_size, shrink).await
    }

    /// Creates internal snapshot `name` (see [`Owner::snapshot_create`]); returns its
    /// table entry. `ReadOnly` unless this is the owner.
    pub async fn snapshot_create(
        &self,
        name: &str,
        when: snapshot::SnapshotTime,
    ) -> Result<crate::format::Snapshot> {
        self.owner()?.snapshot_create(name, when).await
    }

    /// What the image takes of its device, counted from the refcounts (see
    /// [`space`](space)). `ReadOnly` unless this is the owner.
    pub async fn space_usage(&self) -> Result<SpaceUsage> {
        self.owner()?.space_usage().await
    }

    /// Warns (once, in the log) when the image's end passes `threshold` bytes of its device,
    /// or at once if it is past it already (`None`: not watched). `ReadOnly` unless this is
    /// the owner.
    pub fn set_space_threshold(&self, threshold: Option<u64>) -> Result<()> {
        self.owner()?.set_space_threshold(threshold);
        Ok(())
    }

    /// Whether the image's end passed its space threshold (false when none is set or this
    /// is not the owner).
    pub fn space_threshold_exceeded(&self) -> bool {
        self.meta_state().is_some_and(|m| m.st().space.exceeded())
    }

    /// Deletes the internal snapshot with id or name `which`; returns its table entry.
    /// `ReadOnly` unless this is the owner.
    pub async fn snapshot_delete(&self, which: &str) -> Result<crate::format::Snapshot> {
        self.owner()?.snapshot_delete(which).await
    }

    /// Makes the internal snapshot with id or name `which` the active disk (offline only).
    /// Prefer [`Chain::snapshot_apply`](crate::Chain::snapshot_apply), which keeps the
    /// chain's size. `ReadOnly` unless this is the owner.
    pub async fn snapshot_apply(&self, which: &str) -> Result<()> {
        self.owner()?.snapshot_apply(which).await
    }

    /// The persistent bitmaps this owner keeps up to date (loaded at open): each one's name
    /// and whether it is enabled (records writes). Empty on a read-only image or a core.
    pub fn kept_bitmaps(&self) -> Vec<(String, bool)> {
        let Ok(o) = self.owner() else {
            return Vec::new();
        };
        let st = o.meta().st();
        st.bitmaps.as_ref().map_or_else(Vec::new, |k| {
            k.loaded
                .iter()
                .map(|l| {
                    let e = &k.entries[l.entry];
                    (e.name.clone(), e.auto())
                })
                .collect()
        })
    }

    /// Guest flush: every write completed before it is stable when this returns.
    /// `ReadOnly` unless this is the owner.
    pub async fn flush(&self) -> Result<()> {
        self.owner()?.flush().await
    }
}

/// Big-endian bytes of table words `words` into `out`.
pub(crate) fn words_to_bytes(words: &[u64], out: &mut [u8]) {
    for (c, w) in out.chunks_exact_mut(8).zip(words) {
        c.copy_from_slice(&w.to_be_bytes());
    }
}
