//! The metadata owner's state: what the one writer of an image keeps in memory between
//! requests. Each concern is its own type with private fields, in its own file:
//!
//! - [`dirty`]: dirty L2 slices, refcount blocks, L1 and refcount-table entries;
//! - [`alloc`]: the allocator (hint, fresh clusters, data regions, allocations in flight);
//! - [`frees`]: deferred frees and grace periods;
//! - [`header_writer`]: the copies of the first sector and the dirty bit;
//! - [`zeroed_tail`]: the zeroed tail as kept;
//! - [`index`]: the clusters of metadata, for the overlap check;
//! - [`background`]: the background write-back's timer;
//! - [`stats`]: the counters.
//!
//! This layer does no I/O and knows nothing of the image: the image holds a [`Meta`] when
//! it is writable, and the owner's operations (`crate::image::owner`), built on the image,
//! change it through these types' methods. So the dependencies go one way: state ← image ←
//! owner.

pub(crate) mod alloc;
pub(crate) mod background;
pub(crate) mod bitmaps;
pub(crate) mod dirty;
pub(crate) mod frees;
pub(crate) mod header_writer;
pub(crate) mod index;
pub(crate) mod stats;
pub(crate) mod zeroed_tail;

pub use alloc::Inflight;
pub use background::BACKGROUND_WRITEBACK_INTERVAL;
pub use stats::OwnerStats;

use crate::coherency::Shared;
use crate::exec::{AsyncLock, Exec, WaitQueue};
use crate::format::ImageHeader;
use crate::io::BlockDevice;
use std::cell::{Ref, RefCell, RefMut};

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
    /// Deferred frees and grace periods.
    pub(crate) frees: frees::Frees,
    /// The first sector's copies.
    pub(crate) header: header_writer::HeaderCopies,
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
    st: RefCell<MetaState>,
    /// `OpenOptions::ordered_layout`.
    ordered_layout: bool,
    /// `OpenOptions::alloc_granule` in clusters (a power of two, 1: off).
    granule_clusters: u64,
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
            ordered_layout,
            granule_clusters,
            st: RefCell::new(MetaState {
                dirty: Default::default(),
                alloc: alloc::AllocState::new(fresh_from),
                frees: Default::default(),
                header: header_writer::HeaderCopies::new(c0),
                tail,
                index: Default::default(),
                timer: Default::default(),
                stats: OwnerStats::default(),
                bitmaps: None,
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
    /// The metadata lock.
    pub(crate) fn lock(&self) -> &AsyncLock<D> {
        &self.lock
    }
    /// Waits until an allocation in flight ends.
    pub(crate) async fn wait_inflight(&self) {
        self.inflight_wait.wait().await
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
        self.st.borrow().stats
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
