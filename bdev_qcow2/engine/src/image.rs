//! An open qcow2 image: validated header, L1 table, refcount table, snapshot table and the
//! per-core caches of L2 slices and refcount blocks.
//!
//! Layering: the image builds on the checker ([`crate::check`], which repairs a dirty image
//! before it opens for writing), which does not know the image. The metadata owner
//! ([`owner`], a child module: its operations reach the image's private fields) holds its
//! state next to its operations; the image holds that state when writable and consults it
//! for dirty copies through its methods. The request paths build on the image.

use crate::cache::{CacheStats, SetAssocCache};
use crate::coherency::{Shared, SliceReply};
use crate::dirty_bitmaps::DirtyBitmaps;
use crate::error::{invalid, Field, Result};
use crate::exec::{DevId, Exec, WaitQueue};
use crate::format::{ImageHeader, L1Entry, L2Context, LinearSlice, Snapshot};
use crate::io::{BlockDevice, SECTOR};
use crate::memo::SliceMemo;
use crate::types::{Geometry, GuestOffset};
use std::cell::{Cell, Ref, RefCell};
use std::rc::Rc;
use std::sync::Arc;

mod encryption;
mod lookup;
mod metadata;
mod open;
pub(crate) mod owner;
mod preload;
mod replica;
mod role;
mod seed;
mod slices;
pub use encryption::{LockedLuks, Luks, UnlockedKey};
pub(crate) use lookup::{CachedExtent, MemoFirst, Wanted};
pub use owner::bitmap_change::{BitmapBits, BitmapChange};
pub use owner::snapshot::SnapshotTime;
pub use owner::SpaceUsage;
pub(crate) use preload::Preload;
pub use seed::ReadOnlySeed;

/// Options for opening an image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenOptions {
    /// Bytes of L2 slice cache per core (like QEMU's `l2-cache-size`). `None`: enough to
    /// cover the whole image, capped at 32 MiB.
    pub l2_cache_bytes: Option<u64>,
    /// L2 slice size in bytes (power of two, 512 ..= cluster size; clamped to the cluster).
    pub l2_slice_bytes: u64,
    /// Ways per set of the slice cache.
    pub cache_ways: usize,
    /// Bytes of refcount block cache.
    pub refcount_cache_bytes: u64,
    /// Open for writing (the image must not be marked corrupt).
    pub writable: bool,
    /// On a device that cannot grow (a bdev, a block device): lay each L2 slice's data
    /// clusters out in guest order in a host region reserved for the slice, whatever order
    /// they are written in (see the owner's `alloc_data`). Off: clusters are appended in the
    /// order they are first written, as QEMU does (fastest for random first writes).
    pub ordered_layout: bool,
    /// Bytes a first write into an image without a backing file takes at once, when the
    /// clusters it can take read as zeros (fresh: a zeroed tail, or past a growing file's
    /// end, inside the device): the aligned group of unallocated clusters around the
    /// write, in one host run, so later first writes into the group are overwrites.
    /// At most the cluster size: one cluster per first write, as QEMU does.
    pub alloc_granule: u64,
    /// On a device that cannot grow, whose image records no zeroed tail: zero the space
    /// past every cluster in use ahead of the allocator, in large write-zeroes, so that a
    /// first write into a new cluster writes the guest's bytes alone (the rest reads as
    /// zeros) instead of the whole cluster. For a device that zeroes ranges cheaply and
    /// takes scattered small writes into them well (NVMe Write Zeroes; on ext4, such writes
    /// split a file's extents); nothing is recorded in the image.
    pub zero_ahead: bool,
    /// Discard on the device the host clusters a guest discard or a write-zeroes with
    /// unmap frees (QEMU's `pass-discard-request`; on by default, as QEMU has it with
    /// `discard=unmap`, which qemu-io and a bdev advertising unmap stand for).
    pub pass_discard_request: bool,
    /// Discard the host clusters a snapshot's deletion (or apply) frees (QEMU's
    /// `pass-discard-snapshot`, on by default).
    pub pass_discard_snapshot: bool,
    /// Discard the host clusters any other change frees: a copied-on-write cluster, an old
    /// L2 or refcount table, an aborted allocation (QEMU's `pass-discard-other`, off by
    /// default).
    pub pass_discard_other: bool,
    /// Dirty metadata (L2 slices and refcount blocks) beyond which an allocating write
    /// writes it back. `None`: the L2 cache's size, clamped to 8 ..= 32 MiB, and a quarter
    /// more for refcount blocks — random first writes over a disk whose L2 tables that
    /// covers then write each slice back once per many allocations rather than nearly once
    /// per allocation, and once every L2 table is dirty the refcount blocks of a file the
    /// disk's size (16-bit refcounts take a quarter of what its L2 entries take) do not
    /// pass the bound either (#48).
    pub dirty_bound_bytes: Option<u64>,
}

/// Default [`OpenOptions::alloc_granule`]: the default cluster size, so that an image with
/// small clusters grows in the steps of one with default clusters.
pub const DEFAULT_ALLOC_GRANULE: u64 = 64 << 10;

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            l2_cache_bytes: None,
            l2_slice_bytes: 4096,
            cache_ways: 8,
            refcount_cache_bytes: 256 * 1024,
            writable: false,
            ordered_layout: false,
            alloc_granule: DEFAULT_ALLOC_GRANULE,
            zero_ahead: false,
            pass_discard_request: true,
            pass_discard_snapshot: true,
            pass_discard_other: false,
            dirty_bound_bytes: None,
        }
    }
}

/// Default cap on the L2 cache when the operator gives no size (QEMU's default maximum).
pub const DEFAULT_L2_CACHE_MAX: u64 = 32 << 20;

/// Least default [`OpenOptions::dirty_bound_bytes`] (the bound before #48).
pub const MIN_DIRTY_BOUND: u64 = 8 << 20;

impl OpenOptions {
    /// The dirty-metadata bound for an image whose L2 tables take `l2_bytes` (see
    /// [`dirty_bound_bytes`](Self::dirty_bound_bytes)).
    pub fn dirty_bound(&self, l2_bytes: u64) -> u64 {
        self.dirty_bound_bytes.unwrap_or_else(|| {
            let cache = self
                .l2_cache_bytes
                .unwrap_or(l2_bytes.min(DEFAULT_L2_CACHE_MAX));
            let l2 = cache.clamp(MIN_DIRTY_BOUND, DEFAULT_L2_CACHE_MAX);
            l2 + l2 / 4
        })
    }
}

/// An open qcow2 image on one device.
pub struct Qcow2<D: BlockDevice> {
    exec: Exec<D>,
    dev: DevId,
    /// Where data clusters are read and written: `dev`, or for an encrypted image its
    /// encrypted view (metadata always goes to `dev`).
    data_dev: DevId,
    /// An encrypted image's LUKS header and cipher.
    luks: Option<Arc<Luks>>,
    /// Decoder state for the compressed clusters guest reads decompress, kept from one to
    /// the next (reset per cluster) rather than made each time.
    decompressor: RefCell<crate::compress::Decompressor>,
    /// The compressed cluster guest reads decompressed last (and read-ahead chunks that
    /// take a part of a cluster), whole.
    last_compressed: RefCell<crate::compress::LastCluster>,
    /// The owner's reuse generation before it shares the image (then `Shared`'s).
    reuse_local: Cell<u64>,
    /// Size of the device as far as entries may point (grows as clusters are allocated).
    device_size: Cell<u64>,
    header: RefCell<ImageHeader>,
    geo: Geometry,
    ctx: Cell<L2Context>,
    l1: RefCell<Vec<L1Entry>>,
    refcount_table: RefCell<Vec<u64>>,
    /// The snapshot table (changed by the owner's snapshot operations).
    snapshots: RefCell<Vec<Snapshot>>,
    l2_cache: RefCell<SetAssocCache<u64, SliceSummary>>,
    /// The direct path's memo of slices, in front of `l2_cache`.
    /// (Shared with the chain's view of it, `MemoView`.)
    memo: Rc<SliceMemo>,
    rc_cache: RefCell<SetAssocCache<u8>>,
    /// Read-only, metadata owner or core replica, with the state only that role has.
    role: role::ImageRole<D>,
    /// The persistent bitmaps every guest write marks (an image open for writing that has
    /// some, on the owner and every core).
    dirty_bitmaps: Option<Arc<DirtyBitmaps>>,
}

/// How a core replica reaches the metadata owner. The host carries the messages (SPDK:
/// `spdk_thread_send_msg`; the standalone host: a lock-free queue) and hands the owner's
/// answer back on this core with [`Qcow2::deliver_slice`].
pub trait OwnerLink {
    /// Asks the owner for slice `key` ([`Qcow2::slice_for_core`] on the owner's core); the
    /// answer must come back with the same `ticket`.
    fn ask_slice(&self, key: u64, ticket: u64);
}

/// A core replica's side of the protocol.
pub(crate) struct CoreSide<D: BlockDevice> {
    /// The owner's published state.
    shared: Arc<Shared>,
    /// How requests for the owner's dirty slices leave this core.
    link: Box<dyn OwnerLink>,
    /// The owner's answers, by ticket, until the asking task takes them.
    tickets: RefCell<slab::Slab<Option<SliceReply>>>,
    /// Tasks waiting for an answer.
    wait: WaitQueue<D>,
    /// In-place writes allowed (the owner's image is writable).
    writable: bool,
}

/// An image in its role of core replica: the image and its side of the protocol, obtained
/// by [`Qcow2::replica_side`]. What only a replica does (load a slice under the epoch
/// protocol, ask the owner for a dirty one) is a method of it, so it cannot run elsewhere.
pub(crate) struct Replica<'a, D: BlockDevice> {
    q: &'a Qcow2<D>,
    side: &'a CoreSide<D>,
}

impl<D: BlockDevice> Clone for Replica<'_, D> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<D: BlockDevice> Copy for Replica<'_, D> {}

/// Whether a cached look-up marks its slice most recently used and counts a hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Touch {
    /// Always (a guest read uses whatever it finds).
    Yes,
    /// Only when the entry is COPIED data (an in-place write can use only that).
    IfCopied,
}

/// What a cached slice carries besides its entries: its linear summary, and the slot's
/// count of removals it was read under (on a core replica: while the slot's count is still
/// that, the copy's COPIED clusters may be overwritten in place even if the epoch moved on,
/// ARCHITECTURE.md §6).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SliceSummary {
    linear: LinearSlice,
    removals: u32,
}

/// What a writable core replica's copy of a slice older than the slot's epoch says of an
/// overwrite ([`Qcow2::kept_overwrite`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeptCopy {
    /// The range is COPIED data in the copy, under the slot's current count of removals,
    /// inside the device and clear of metadata: it goes in place at this host offset.
    Host(u64),
    /// The copy holds under the current count of removals but does not show the range in
    /// place; `changes`: how many times the slot changed since the copy was taken.
    NotInPlace {
        /// Epoch steps since the copy, halved (wrapping).
        changes: u32,
    },
    /// No usable copy: none cached, a removal since, or not one slice.
    Unusable,
}

/// A core replica's copy of one slice, as seen by a write
/// ([`Qcow2::core_slice_state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CoreSlice {
    /// Cached under the current epoch.
    Valid,
    /// Cached under an older epoch, and the owner holds the slice dirty now (it is
    /// changing it).
    StaleDirty,
    /// Not cached, and the owner holds the slice dirty (only the owner's copy answers).
    Dirty,
    /// Not cached, or stale and clean on the device (the core reads it itself).
    Missing,
}

/// What a core needs to build its replica of a shared image (`Send`: made on the owner's
/// core, used on another).
#[derive(Debug, Clone)]
pub struct CoreSeed {
    header: ImageHeader,
    geo: Geometry,
    ctx: L2Context,
    snapshots: Vec<Snapshot>,
    shared: Arc<Shared>,
    writable: bool,
    dirty_bitmaps: Option<Arc<DirtyBitmaps>>,
    luks: Option<Arc<Luks>>,
}

pub use crate::exec::read_bytes;

fn be_words(bytes: &[u8]) -> impl ExactSizeIterator<Item = u64> + Clone + '_ {
    bytes.chunks_exact(8).map(|c| {
        let mut a = [0u8; 8];
        a.copy_from_slice(c);
        u64::from_be_bytes(a)
    })
}

impl<D: BlockDevice> Qcow2<D> {
    /// The bitmap directory's entries (none without the bitmaps extension), read from the
    /// device: names, flags, granularities. A directory QEMU would refuse is an error.
    pub async fn bitmap_directory(&self) -> Result<Vec<crate::format::bitmaps::BitmapEntry>> {
        let Some(ext) = self.header.borrow().extensions.bitmaps.clone() else {
            return Ok(Vec::new());
        };
        let bad = |why| invalid(Field::BitmapsExtension, ext.directory_offset, why);
        if ext.directory_offset.saturating_add(ext.directory_size) > self.device_size.get() {
            return Err(bad("bitmap directory extends past the end of the device"));
        }
        let dir = read_bytes(
            &self.exec,
            self.dev,
            ext.directory_offset,
            ext.directory_size,
        )
        .await?;
        crate::format::bitmaps::parse_directory(
            &dir,
            ext.nb_bitmaps,
            self.geo.cluster_size(),
            self.size(),
        )
        .map_err(bad)
    }

    /// The persistent bitmaps guest writes must mark, when the image keeps any.
    pub(crate) fn dirty_bitmaps(&self) -> Option<&Arc<DirtyBitmaps>> {
        self.dirty_bitmaps.as_ref()
    }

    /// The decoded header (as currently in effect).
    pub fn header(&self) -> Ref<'_, ImageHeader> {
        self.header.borrow()
    }
    /// The L2 entry context (cluster size, version, extended L2, device size) entries are
    /// decoded in.
    #[inline]
    pub(crate) fn l2_context(&self) -> L2Context {
        self.ctx.get()
    }
    /// Whether the L1 entry covering `off` has COPIED set.
    pub(crate) fn l1_copied(&self, off: GuestOffset) -> bool {
        let idx = self.geo.l1_index(off) as usize;
        self.l1.borrow().get(idx).is_some_and(|e| e.is_copied())
    }
    /// Cluster/L2 geometry.
    pub fn geometry(&self) -> Geometry {
        self.geo
    }
    /// How many L2 slices this image's slice cache holds (its size rounded down to a
    /// power-of-two number of sets, at least one set, at most the image's slices).
    pub fn l2_cache_slices(&self) -> usize {
        self.l2_cache.borrow().capacity()
    }
    /// Virtual disk size: the header's size rounded down to whole 512-byte sectors, as
    /// QEMU sees it.
    pub fn size(&self) -> u64 {
        self.header.borrow().header.size / SECTOR * SECTOR
    }
    /// Core replica: takes `size`, the virtual size the owner published after a resize.
    /// Nothing on the owner (its resize changed its own header) or a read-only image.
    pub(crate) fn adopt_size(&self, size: u64) {
        if self.is_core_replica() {
            self.header.borrow_mut().header.size = size;
        }
    }
    /// The device this image lives on.
    pub fn dev(&self) -> DevId {
        self.dev
    }
    /// How its compressed clusters are compressed.
    pub(crate) fn compression_type(&self) -> crate::format::CompressionType {
        self.header.borrow().header.compression_type
    }
    /// Size of that device.
    pub fn device_size(&self) -> u64 {
        self.device_size.get()
    }
    /// Internal snapshots (a copy of the table as the image has it now).
    pub fn snapshots(&self) -> Vec<Snapshot> {
        self.snapshots.borrow().clone()
    }
    /// The executor the image does I/O on.
    pub fn exec(&self) -> &Exec<D> {
        &self.exec
    }
    /// L2 slice cache counters.
    pub fn l2_cache_stats(&self) -> CacheStats {
        let mut s = self.l2_cache.borrow().stats();
        s.hits += self.memo.hits();
        s
    }
    /// Overwrites the memo answered through a copy older than its slot's epoch (part of
    /// [`Chain::kept_overwrites`](crate::Chain::kept_overwrites)).
    pub(crate) fn memo_kept_overwrites(&self) -> u64 {
        self.memo.kept()
    }
    /// The metadata owner's counters (`None` unless opened writable).
    pub fn owner_stats(&self) -> Option<owner::OwnerStats> {
        self.meta_state().map(|m| m.stats())
    }
    /// Whether the owner zeroes the device ahead of its allocator (`OpenOptions::zero_ahead`,
    /// on a device that cannot grow and an image without a zeroed tail of its own, until
    /// zeroing fails).
    pub fn zeroing_ahead(&self) -> bool {
        self.meta_state()
            .is_some_and(|m| m.st().tail.zeroes_ahead())
    }
    /// Whether the header's dirty bit is set on the device now: on the owner, whether it set
    /// the bit (lazy refcounts: before metadata relying on it, cleared once refcounts are
    /// written; a writable open repairs a dirty image first); elsewhere, the bit as read.
    pub fn dirty_bit(&self) -> bool {
        match self.meta_state() {
            Some(m) => m.st().header.dirty_bit_on_disk(),
            None => self.header.borrow().is_dirty(),
        }
    }
    /// Refcount block cache counters.
    pub fn refcount_cache_stats(&self) -> CacheStats {
        self.rc_cache.borrow().stats()
    }
    /// Sets and ways of the L2 slice cache.
    pub fn l2_cache_shape(&self) -> (usize, usize) {
        let c = self.l2_cache.borrow();
        (c.sets(), c.ways())
    }

    /// The generation under which bytes in use stay unchanged (see
    /// [`LastCluster`](crate::compress::LastCluster)): `Shared`'s on a shared image, else
    /// the owner's own (a read-only image never frees).
    pub(crate) fn reuse_gen(&self) -> u64 {
        match self.shared() {
            Some(sh) => sh.reuse_gen(),
            None => self.reuse_local.get(),
        }
    }

    /// Owner: freed clusters are about to be handed out again (see
    /// [`reuse_gen`](Self::reuse_gen)).
    pub(crate) fn bump_reuse(&self) {
        match self.shared() {
            Some(sh) => sh.bump_reuse(),
            None => self.reuse_local.set(self.reuse_local.get() + 1),
        }
    }

    /// The kept compressed cluster, for a read-ahead that decompresses a part of one.
    pub(crate) fn last_compressed(&self) -> &RefCell<crate::compress::LastCluster> {
        &self.last_compressed
    }
}
