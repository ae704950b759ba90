//! An open qcow2 image: validated header, L1 table, refcount table, snapshot table and the
//! per-core caches of L2 slices and refcount blocks.
//!
//! Layering: the image builds on the checker ([`crate::check`], which repairs a dirty image
//! before it opens for writing), which does not know the image. The metadata owner
//! ([`owner`], a child module: its operations reach the image's private fields) holds its
//! state next to its operations; the image holds that state when writable and consults it
//! for dirty copies through its methods. The request paths build on the image.

use crate::cache::{CacheConfig, CacheStats, SetAssocCache};
use crate::coherency::{Shared, SliceReply, SliceStamp};
use crate::dirty_bitmaps::DirtyBitmaps;
use crate::error::{corrupt, invalid, Error, Field, Result};
use crate::exec::{DevId, Exec, WaitQueue};
use crate::format::header::{peek_cluster_bits, PEEK_LEN};
use crate::format::refcount::{entries_per_block, get_refcount, refcount_block_offset};
use crate::format::snapshot::{decode_snapshots, SnapshotDecode};
use crate::format::{
    ClusterMapping, ImageHeader, L1Entry, L2Context, L2Entry, LinearSlice, Snapshot,
    SubclusterBitmap,
};
use crate::io::{BlockDevice, BufSlice, IoBuffer, SECTOR};
use crate::limits::MAX_CACHE_BYTES;
use crate::memo::{MappedRow, SliceMemo, MEMO_NO_META_GEN};
use crate::types::{Geometry, GuestOffset, HostOffset, SUBCLUSTERS};
use std::cell::{Cell, Ref, RefCell};
use std::sync::Arc;

pub(crate) mod owner;
mod preload;
pub use owner::snapshot::SnapshotTime;
pub(crate) use preload::Preload;

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
        }
    }
}

/// Default cap on the L2 cache when the operator gives no size (QEMU's default maximum).
pub const DEFAULT_L2_CACHE_MAX: u64 = 32 << 20;

/// An open qcow2 image on one device.
pub struct Qcow2<D: BlockDevice> {
    exec: Exec<D>,
    dev: DevId,
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
    memo: SliceMemo,
    rc_cache: RefCell<SetAssocCache<u8>>,
    /// The metadata owner's state (`None` when opened read-only, and on a core replica):
    /// reached by the owner's operations through [`owner`](Self::owner).
    meta: Option<owner::Meta<D>>,
    /// State published to other cores (owner: after [`share`](Self::share); core replica:
    /// always).
    shared: Option<Arc<Shared>>,
    /// Set on a core replica of a shared image: reached through
    /// [`replica_side`](Self::replica_side) by what only a replica does.
    core: Option<CoreSide<D>>,
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
    /// The owner's published state (the image's `shared` too): here, so that a core's
    /// look-ups reach it with one check.
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
    /// Opens and validates the image on `dev`. Reads cluster 0, the L1 table, the refcount
    /// table and the snapshot table; returns the first invalid field found.
    pub async fn open(exec: &Exec<D>, dev: DevId, opts: OpenOptions) -> Result<Self> {
        Self::open_inner(exec, dev, opts, false).await
    }

    async fn open_inner(
        exec: &Exec<D>,
        dev: DevId,
        opts: OpenOptions,
        repaired: bool,
    ) -> Result<Self> {
        let device_size = exec.device_size(dev);
        if device_size < PEEK_LEN as u64 {
            return Err(invalid(
                Field::HeaderLength,
                device_size,
                "device smaller than a header",
            ));
        }
        let peek = read_bytes(exec, dev, 0, PEEK_LEN as u64).await?;
        let cluster_bits = peek_cluster_bits(&peek)?;
        let c0_len = (1u64 << cluster_bits).min(device_size);
        let c0 = read_bytes(exec, dev, 0, c0_len).await?;
        let header = ImageHeader::decode(&c0, device_size)?;
        let h = &header.header;
        let geo = header.geometry(opts.l2_slice_bytes.max(512).ilog2());
        let ctx = L2Context {
            cluster_bits,
            v3: h.version == 3,
            extended_l2: header.extended_l2(),
            device_size,
        };
        let l1_bytes = read_bytes(exec, dev, h.l1_table_offset, u64::from(h.l1_size) * 8).await?;
        let l1: Vec<L1Entry> = be_words(&l1_bytes).map(L1Entry).collect();
        let rt_bytes = read_bytes(
            exec,
            dev,
            h.refcount_table_offset,
            u64::from(h.refcount_table_clusters) << cluster_bits,
        )
        .await?;
        let refcount_table: Vec<u64> = be_words(&rt_bytes).collect();
        let snapshots = Self::read_snapshots(exec, dev, &header, device_size).await?;

        let (l2_cache, rc_cache) = Self::new_caches(&geo, l1.len(), refcount_table.len(), &opts)?;
        let meta = if opts.writable {
            if header.is_corrupt() {
                return Err(Error::MarkedCorrupt);
            }
            if header.is_dirty() && repaired {
                return Err(Error::UnsupportedFeature(
                    "image is still dirty after its repair; run `qcow2 check -r all`".into(),
                ));
            }
            if header.is_dirty() {
                // Refcounts may be stale (lazy refcounts, or a crash while dirty): rebuild
                // them before accepting writes (ARCHITECTURE.md §7 rule 7), then open afresh.
                tracing::info!("qcow2: image is dirty; repairing refcounts before writing");
                let report = crate::check::check(exec, dev, crate::check::Repair::All).await?;
                if report.corruptions > report.corruptions_fixed || report.check_errors > 0 {
                    return Err(Error::UnsupportedFeature(
                        "image is dirty and its repair failed; run `qcow2 check -r all`".into(),
                    ));
                }
                return Box::pin(Self::open_inner(exec, dev, opts, true)).await;
            }
            Some(owner::Meta::new(
                exec,
                &header,
                &c0,
                device_size,
                opts.ordered_layout,
                opts.alloc_granule,
            ))
        } else {
            None
        };
        let mut q = Qcow2 {
            exec: exec.clone(),
            dev,
            decompressor: RefCell::default(),
            last_compressed: RefCell::default(),
            reuse_local: Cell::new(0),
            device_size: Cell::new(device_size),
            header: RefCell::new(header),
            geo,
            ctx: Cell::new(ctx),
            l1: RefCell::new(l1),
            refcount_table: RefCell::new(refcount_table),
            snapshots: RefCell::new(snapshots),
            memo: SliceMemo::new(
                l2_cache.capacity(),
                geo.slice_entries() as usize,
                geo.cluster_bits,
            ),
            l2_cache: RefCell::new(l2_cache),
            rc_cache: RefCell::new(rc_cache),
            meta,
            shared: None,
            core: None,
            dirty_bitmaps: None,
        };
        q.index_metadata();
        if q.meta.is_some() {
            q.dirty_bitmaps = q.owner()?.load_bitmaps().await?;
        }
        if opts.zero_ahead && q.meta.is_some() {
            q.owner()?.start_zero_ahead().await?;
        }
        Ok(q)
    }

    async fn read_snapshots(
        exec: &Exec<D>,
        dev: DevId,
        header: &ImageHeader,
        device_size: u64,
    ) -> Result<Vec<Snapshot>> {
        let h = &header.header;
        if h.nb_snapshots == 0 {
            return Ok(Vec::new());
        }
        let cs = header.cluster_size();
        let mut want = (u64::from(h.nb_snapshots) * 64).max(4096);
        loop {
            let avail = device_size.saturating_sub(h.snapshots_offset);
            let len = want.min(avail);
            let buf = read_bytes(exec, dev, h.snapshots_offset, len).await?;
            match decode_snapshots(&buf, h.nb_snapshots, cs, device_size)? {
                SnapshotDecode::Done(s) => return Ok(s),
                SnapshotDecode::NeedBytes(n) => {
                    if n > avail {
                        return Err(invalid(
                            Field::SnapshotTable,
                            n,
                            "snapshot table extends past the end of the device",
                        ));
                    }
                    want = n.max(want * 2);
                }
            }
        }
    }

    /// Builds empty L2 slice and refcount block caches sized by `opts`.
    fn new_caches(
        geo: &Geometry,
        l1_entries: usize,
        rt_entries: usize,
        opts: &OpenOptions,
    ) -> Result<(SetAssocCache<u64, SliceSummary>, SetAssocCache<u8>)> {
        // By default, enough slices for the whole image, capped.
        let total_slices = (l1_entries as u64).max(1) * geo.slices_per_l2();
        let slice_bytes = 1u64 << geo.slice_bits;
        let want = opts
            .l2_cache_bytes
            .unwrap_or_else(|| (total_slices * slice_bytes).min(DEFAULT_L2_CACHE_MAX));
        if want > MAX_CACHE_BYTES {
            return Err(Error::InvalidRequest("l2 cache size above 4 GiB"));
        }
        let l2_cache = SetAssocCache::new(
            CacheConfig {
                size_bytes: want.max(slice_bytes),
                ways: opts.cache_ways,
            },
            (slice_bytes / 8) as usize,
            total_slices,
        );
        let rc_cache = SetAssocCache::new(
            CacheConfig {
                size_bytes: opts.refcount_cache_bytes.max(geo.cluster_size()),
                ways: 4,
            },
            geo.cluster_size() as usize,
            rt_entries as u64,
        );
        Ok((l2_cache, rc_cache))
    }

    /// A read-only replica of this image for another core: the header, L1 and refcount
    /// table validated here are copied (nothing is re-read), with empty caches sized by
    /// `opts`, doing I/O on `dev` (that core's channel to the same device) through `exec`.
    ///
    /// A replica must not be used while this image is open for writing: it does not see the
    /// owner's later metadata changes (per-core coherency is the epoch protocol's job).
    pub fn replica(&self, exec: &Exec<D>, dev: DevId, opts: OpenOptions) -> Result<Self> {
        let l1 = self.l1.borrow().clone();
        let refcount_table = self.refcount_table.borrow().clone();
        let (l2_cache, rc_cache) =
            Self::new_caches(&self.geo, l1.len(), refcount_table.len(), &opts)?;
        Ok(Qcow2 {
            exec: exec.clone(),
            dev,
            decompressor: RefCell::default(),
            last_compressed: RefCell::default(),
            reuse_local: Cell::new(0),
            device_size: Cell::new(self.device_size.get()),
            header: RefCell::new(self.header.borrow().clone()),
            geo: self.geo,
            ctx: Cell::new(self.ctx.get()),
            l1: RefCell::new(l1),
            refcount_table: RefCell::new(refcount_table),
            snapshots: RefCell::new(self.snapshots.borrow().clone()),
            memo: SliceMemo::new(
                l2_cache.capacity(),
                self.geo.slice_entries() as usize,
                self.geo.cluster_bits,
            ),
            l2_cache: RefCell::new(l2_cache),
            rc_cache: RefCell::new(rc_cache),
            meta: None,
            shared: None,
            core: None,
            dirty_bitmaps: None,
        })
    }

    /// Publishes this image's metadata to other cores (ARCHITECTURE.md §6) and returns the shared
    /// state; later calls return the same. From now on every metadata change bumps the
    /// epochs the core replicas validate against. Call on the owner's core.
    pub fn share(&mut self) -> Arc<Shared> {
        if let Some(s) = &self.shared {
            return s.clone();
        }
        let cs = self.geo.cluster_size();
        let l1: Vec<u64> = self.l1.borrow().iter().map(|e| e.0).collect();
        let total_slices = (l1.len() as u64).max(1) * self.geo.slices_per_l2();
        // Metadata can grow to about the disk size plus its tables; the margin keeps
        // in-place writes local for every cluster a sane image will have.
        let max_clusters = self
            .device_size
            .get()
            .saturating_add(self.size())
            .saturating_add(self.size() / 8)
            .div_ceil(cs)
            .saturating_add(1024);
        let shared = Arc::new(Shared::new(
            total_slices,
            &l1,
            self.device_size.get(),
            max_clusters,
        ));
        // Every metadata cluster: header, tables, snapshot tables (as the owner's overlap
        // check knows them), refcount blocks and L2 tables.
        let bits = self.geo.cluster_bits;
        self.any_static_metadata(|off, len| {
            if len > 0 {
                for c in (off >> bits)..=((off + len - 1) >> bits) {
                    shared.set_meta_cluster(c);
                }
            }
            false
        });
        for c in self.table_clusters() {
            shared.set_meta_cluster(c);
        }
        if let Some(m) = &self.meta {
            let mut st = m.st_mut();
            for c in st.index.iter() {
                shared.set_meta_cluster(c);
            }
            st.dirty.publish_to(&shared);
        }
        // The owner's own requests take part in grace periods too (its fast paths race
        // with its own discards like a core's do).
        self.exec.join_grace(shared.clone(), true);
        shared.set_virtual_size(self.size());
        self.shared = Some(shared.clone());
        // Its generation is `Shared`'s from now on: what was kept under the owner's own is
        // not comparable.
        *self.last_compressed.borrow_mut() = Default::default();
        shared
    }

    /// What another core needs to build its replica ([`from_seed`](Self::from_seed)).
    /// [`share`](Self::share) must have run.
    pub fn core_seed(&self) -> Result<CoreSeed> {
        let shared = self.shared.clone().ok_or(Error::InvalidRequest(
            "image not shared: call share() first",
        ))?;
        Ok(CoreSeed {
            header: self.header.borrow().clone(),
            geo: self.geo,
            ctx: self.ctx.get(),
            snapshots: self.snapshots.borrow().clone(),
            shared,
            writable: self.meta.is_some(),
            dirty_bitmaps: self.dirty_bitmaps.clone(),
        })
    }

    /// A core's replica of a shared image: its own slice cache sized by `opts`, I/O on `dev`
    /// through `exec`, metadata validated against the owner's epochs, dirty slices fetched
    /// through `link`. It serves reads (every kind) and in-place writes to COPIED clusters
    /// on its own; every other write goes to the owner (see
    /// [`Chain::try_submit_write`](crate::Chain::try_submit_write)).
    pub fn from_seed(
        seed: CoreSeed,
        exec: &Exec<D>,
        dev: DevId,
        opts: OpenOptions,
        link: Box<dyn OwnerLink>,
    ) -> Result<Self> {
        if !exec.join_grace(seed.shared.clone(), false) {
            return Err(Error::InvalidRequest(
                "too many cores share this image (256 at most)",
            ));
        }
        // Sized by the table, not by the room the owner keeps for it to grow online.
        let l1_len = seed.header.header.l1_size as usize;
        let (l2_cache, rc_cache) = Self::new_caches(&seed.geo, l1_len, 0, &opts)?;
        // One reading for both: the owner may have grown the device since the seed was
        // taken, and `sync_core` only looks for changes from `device_size`.
        let device_size = seed.shared.device_size();
        Ok(Qcow2 {
            exec: exec.clone(),
            dev,
            decompressor: RefCell::default(),
            last_compressed: RefCell::default(),
            reuse_local: Cell::new(0),
            device_size: Cell::new(device_size),
            header: RefCell::new(seed.header),
            geo: seed.geo,
            ctx: Cell::new(L2Context {
                device_size,
                ..seed.ctx
            }),
            l1: RefCell::new(Vec::new()),
            refcount_table: RefCell::new(Vec::new()),
            snapshots: RefCell::new(seed.snapshots),
            memo: SliceMemo::new(
                l2_cache.capacity(),
                seed.geo.slice_entries() as usize,
                seed.geo.cluster_bits,
            ),
            l2_cache: RefCell::new(l2_cache),
            rc_cache: RefCell::new(rc_cache),
            meta: None,
            shared: Some(seed.shared.clone()),
            core: Some(CoreSide {
                shared: seed.shared,
                link,
                tickets: RefCell::new(slab::Slab::new()),
                wait: WaitQueue::new(exec),
                writable: seed.writable,
            }),
            dirty_bitmaps: seed.dirty_bitmaps,
        })
    }

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

    /// The shared state, if [`share`](Self::share)d (owner) or a core replica.
    pub fn shared(&self) -> Option<&Arc<Shared>> {
        self.shared.as_ref()
    }

    /// Whether this is a core replica of a shared image.
    pub fn is_core_replica(&self) -> bool {
        self.core.is_some()
    }

    /// Owner: the answer to a core's [`OwnerLink::ask_slice`] (no I/O, no await).
    pub fn slice_for_core(&self, key: u64) -> SliceReply {
        let Some(shared) = &self.shared else {
            return SliceReply::Retry;
        };
        if let Some(m) = &self.meta {
            if let Some(words) = m.dirty_slice(key) {
                return SliceReply::Copy {
                    words,
                    stamp: shared.stamp(key),
                };
            }
        }
        SliceReply::Clean {
            stamp: shared.stamp(key),
        }
    }

    /// Core replica: hands over the owner's answer to ticket `ticket` (on this core).
    /// Nothing on any other image.
    pub fn deliver_slice(&self, ticket: u64, reply: SliceReply) {
        if let Some(r) = self.replica_side() {
            r.deliver(ticket, reply);
        }
    }

    /// This image as a core replica (`None` on the owner and on a read-only image).
    #[inline]
    pub(crate) fn replica_side(&self) -> Option<Replica<'_, D>> {
        self.core.as_ref().map(|side| Replica { q: self, side })
    }

    /// Core replica: takes the owner's latest device size (entries may point further).
    fn sync_core(&self) {
        if let Some(s) = self.core_shared() {
            let ds = s.device_size();
            if ds != self.device_size.get() {
                self.device_size.set(ds);
                let mut ctx = self.ctx.get();
                ctx.device_size = ds;
                self.ctx.set(ctx);
            }
        }
    }

    /// The epoch a cached copy of slice `key` must carry to be used now (0 on the owner:
    /// its cache is kept in step with its own changes).
    fn cur_epoch(&self, key: u64) -> u32 {
        match self.core_shared() {
            Some(s) => s.epoch(key),
            None => 0,
        }
    }

    /// The shared state of a core replica (`None` on the owner).
    #[inline(always)]
    fn core_shared(&self) -> Option<&Shared> {
        self.core.as_ref().map(|c| &*c.shared)
    }

    /// The decoded header (as currently in effect).
    pub fn header(&self) -> Ref<'_, ImageHeader> {
        self.header.borrow()
    }
    /// Whether the image is open for writing.
    pub fn is_writable(&self) -> bool {
        self.meta.is_some()
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
    /// The metadata owner's state, when this image is the owner (see
    /// [`owner`](Self::owner) for its operations).
    #[inline(always)]
    pub(crate) fn meta_state(&self) -> Option<&owner::Meta<D>> {
        self.meta.as_ref()
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
        if self.core.is_some() {
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
        self.meta.as_ref().map(|m| m.stats())
    }
    /// Whether the owner zeroes the device ahead of its allocator (`OpenOptions::zero_ahead`,
    /// on a device that cannot grow and an image without a zeroed tail of its own, until
    /// zeroing fails).
    pub fn zeroing_ahead(&self) -> bool {
        self.meta
            .as_ref()
            .is_some_and(|m| m.st().tail.zeroes_ahead())
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

    /// Calls `f(offset, bytes)` for each metadata range the header and snapshot table
    /// name (header cluster, L1, refcount table, snapshot table, snapshot L1s) until it
    /// returns true; returns whether it did.
    pub(crate) fn any_static_metadata(&self, mut f: impl FnMut(u64, u64) -> bool) -> bool {
        let cs = self.geo.cluster_size();
        let h = self.header.borrow();
        let hh = &h.header;
        f(0, cs)
            || f(hh.l1_table_offset, u64::from(hh.l1_size) * 8)
            || f(
                hh.refcount_table_offset,
                u64::from(hh.refcount_table_clusters) << self.geo.cluster_bits,
            )
            || (hh.nb_snapshots > 0 && f(hh.snapshots_offset, cs))
            || self
                .snapshots
                .borrow()
                .iter()
                .any(|s| f(s.l1_table_offset, u64::from(s.l1_size) * 8))
    }

    /// Clusters of refcount blocks and active L2 tables, from the refcount table and L1.
    pub(crate) fn table_clusters(&self) -> owner::HashSet<u64> {
        let cs = self.geo.cluster_size();
        let mut set = owner::HashSet::default();
        for e in self.refcount_table.borrow().iter() {
            if *e != 0 && e % cs == 0 {
                set.insert(e >> self.geo.cluster_bits);
            }
        }
        for e in self.l1.borrow().iter() {
            if let Ok(Some(t)) = e.l2_table(cs, u64::MAX) {
                set.insert(t.0 >> self.geo.cluster_bits);
            }
        }
        set
    }

    /// Whether host bytes `[off, off+len)` overlap the image's own metadata (header, L1,
    /// refcount table and blocks, active L2 tables, snapshot table and snapshot L1s).
    pub(crate) fn overlaps_metadata(&self, off: HostOffset, len: u64) -> bool {
        let off = off.0;
        // The cores' bitmap marks every metadata cluster (and some that were, never
        // cleared): a range it marks nowhere is not metadata, in a bit test per cluster.
        if let Some(sh) = &self.shared {
            let bits = self.geo.cluster_bits;
            let (first, last) = (off >> bits, (off + len.max(1) - 1) >> bits);
            if (first..=last).all(|c| !sh.is_meta_cluster(c)) {
                return false;
            }
        }
        let hit = |start: u64, bytes: u64| {
            bytes > 0 && off < start.saturating_add(bytes) && start < off.saturating_add(len)
        };
        if self.any_static_metadata(hit) {
            return true;
        }
        if let Some(m) = &self.meta {
            let st = m.st();
            let first = off >> self.geo.cluster_bits;
            let last = (off + len.max(1) - 1) >> self.geo.cluster_bits;
            if (first..=last).any(|c| st.index.contains(c)) {
                return true;
            }
        }
        false
    }

    /// Records the clusters of refcount blocks and L2 tables for the overlap check.
    pub(crate) fn index_metadata(&self) {
        let Some(m) = &self.meta else { return };
        m.st_mut().index.reset(self.table_clusters());
    }

    /// The host offset of the L2 table covering `off`, or `None` if unallocated.
    pub(crate) fn l2_table(&self, off: GuestOffset) -> Result<Option<crate::types::HostOffset>> {
        let idx = self.geo.l1_index(off) as usize;
        let e = match self.core_shared() {
            Some(s) if idx < s.l1_len() => {
                let raw = s.l1(idx);
                // The owner grows the device before it publishes an entry pointing there.
                self.sync_core();
                Some(L1Entry(raw))
            }
            Some(_) => None,
            None => self.l1.borrow().get(idx).copied(),
        }
        .ok_or_else(|| corrupt(Field::L1Entry, idx as u64, "L1 index beyond the L1 table"))?;
        e.l2_table(self.geo.cluster_size(), self.device_size.get())
    }

    /// Interprets the (sub)cluster at `off` from its slice `block`; returns the mapping and
    /// the guest offset where that (sub)cluster ends.
    pub(crate) fn resolve(&self, block: &[u64], off: GuestOffset) -> Result<(ClusterMapping, u64)> {
        let ctx = self.ctx.get();
        let i = self.geo.index_in_slice(off) as usize;
        let cs = self.geo.cluster_size();
        let cluster_start = off.0 & !(cs - 1);
        if self.geo.extended_l2 {
            let sc_size = cs / SUBCLUSTERS;
            let sc = self.geo.offset_in_cluster(off.0) / sc_size;
            let m = L2Entry(block[2 * i]).subcluster_mapping(
                SubclusterBitmap(block[2 * i + 1]),
                sc,
                &ctx,
            )?;
            Ok((m, cluster_start + (sc + 1) * sc_size))
        } else {
            Ok((L2Entry(block[i]).mapping(&ctx)?, cluster_start + cs))
        }
    }

    /// Mapping of the (sub)cluster at `off` if its slice is cached (fast path; touches the
    /// LRU and counts a hit). `Ok(None)` on a cache miss. Returns the mapping and its end.
    pub fn resolve_cached(&self, off: GuestOffset) -> Result<Option<(ClusterMapping, u64)>> {
        self.resolve_cached_as(off, Touch::Yes)
    }

    /// [`resolve_cached`](Self::resolve_cached), touching the LRU and counting a hit as
    /// `touch` says: a look-up that plans an in-place write counts only an entry it can use.
    pub(crate) fn resolve_cached_as(
        &self,
        off: GuestOffset,
        touch: Touch,
    ) -> Result<Option<(ClusterMapping, u64)>> {
        // A core's device size is synced where it matters: after loading an L1 entry
        // (`l2_table`) and before caching a slice, so every cached entry fits in it.
        let Some(_) = self.l2_table(off)? else {
            return Ok(Some((
                ClusterMapping::Unallocated { host: None },
                self.l1_entry_end(off),
            )));
        };
        let key = self.geo.slice_id(off);
        let epoch = self.cur_epoch(key);
        let mut cache = self.l2_cache.borrow_mut();
        let Some(hit) = cache.probe(key, epoch) else {
            return Ok(None);
        };
        let way = hit.way;
        if !self.geo.extended_l2 {
            let ctx = self.ctx.get();
            let i = self.geo.index_in_slice(off);
            // A linear slice gives the mapping without loading the entry.
            let data = match cache.aux(way).linear.host(i, ctx.cluster_bits) {
                Some(h) if h + (1 << ctx.cluster_bits) <= ctx.device_size => Some((h, true)),
                _ => L2Entry(cache.block(way)[i as usize])
                    .plain_data(ctx.cluster_bits, ctx.device_size),
            };
            if touch == Touch::Yes || (touch == Touch::IfCopied && data.is_some_and(|d| d.1)) {
                cache.touch(hit);
            }
            if let Some((host, copied)) = data {
                let cs = self.geo.cluster_size();
                return Ok(Some((
                    ClusterMapping::Data {
                        host: crate::types::HostOffset(host),
                        copied,
                    },
                    (off.0 & !(cs - 1)) + cs,
                )));
            }
            return self.resolve(cache.block(way), off).map(Some);
        }
        let r = self.resolve(cache.block(way), off)?;
        if touch == Touch::Yes
            || (touch == Touch::IfCopied
                && matches!(r.0, ClusterMapping::Data { copied: true, .. }))
        {
            cache.touch(hit);
        }
        Ok(Some(r))
    }

    /// The host offset of `[off, off + len)` (non-empty) when its mapping is one device
    /// extent that the cache alone gives, without the general look-up's decoding: the range
    /// lies in one cached slice that is valid now, and either the slice is linear (every
    /// entry plain COPIED data in consecutive host clusters, `LinearSlice`: any range
    /// inside it; with `memo`, asked of the memo of slices first) or the range lies
    /// in one cluster whose entry is plain data (COPIED when `copied`, as an in-place write
    /// needs; with extended L2, every subcluster the range touches allocated data). The
    /// clusters lie inside the device. Touches the LRU and counts a hit only then.
    ///
    /// `Err(true)` when the range lies in one cluster of a current slice whose standard
    /// entry has no host cluster (unallocated, or zero) or, with `copied`, is not COPIED:
    /// no in-place plan exists there, and the general look-up would find the same.
    /// `Err(false)` sends the caller to the general look-up, which also handles everything
    /// this skips: unallocated L2 tables, zero, compressed entries, unallocated or zero
    /// subclusters, a device size this core has not synced yet. (No L1 check is needed: a
    /// slice is cached only from an allocated table, and the owner makes a table's slices
    /// odd, or drops them from its own cache, before it changes the L1 entry; see
    /// `coherency`.) Without `memo`: for a caller that has just asked the memo
    /// ([`memo_extent`](Self::memo_extent)).
    #[inline(always)]
    pub(crate) fn cached_extent_with(
        &self,
        off: u64,
        len: u64,
        copied: bool,
        memo: bool,
    ) -> Result<u64, bool> {
        let Some((key, within)) = self.in_one_slice(off, len) else {
            return Err(false);
        };
        let epoch = self.cur_epoch(key);
        // A slice remembered under the current epoch: the clusters it answers for are
        // COPIED data inside the device (checked when remembered).
        if let Some(host) = memo
            .then(|| self.memo.extent(key, epoch, within, len))
            .flatten()
        {
            return Ok(host);
        }
        self.cached_extent_in_cache(off, len, copied, (key, within), epoch)
    }

    /// The slice of a non-empty range `[off, off + len)` that lies inside one slice, and
    /// the range's offset within it.
    #[inline(always)]
    fn in_one_slice(&self, off: u64, len: u64) -> Option<(u64, u64)> {
        let within = self.geo.within_slice(GuestOffset(off));
        (len != 0 && within + len <= self.geo.slice_coverage())
            .then(|| (self.geo.slice_id(GuestOffset(off)), within))
    }

    /// The shared state of a writable core replica (`None` on the owner and on read-only
    /// images): what its in-place writes are checked against.
    #[inline(always)]
    pub(crate) fn writable_core_shared(&self) -> Option<&Shared> {
        match &self.core {
            Some(c) if c.writable => Some(&c.shared),
            _ => None,
        }
    }

    /// On a writable core replica, for the memo: the metadata generation under which none
    /// of the `len` bytes of host clusters at `first` was metadata (read before the bitmap,
    /// so a cluster marked meanwhile moves it), else [`MEMO_NO_META_GEN`].
    fn slice_clear_of_metadata(&self, first: u64, len: u64) -> u64 {
        let Some(sh) = self.writable_core_shared() else {
            return MEMO_NO_META_GEN;
        };
        let g = sh.meta_gen();
        let bits = self.ctx.get().cluster_bits;
        if sh.meta_range_clear(first >> bits, len >> bits) {
            g
        } else {
            MEMO_NO_META_GEN
        }
    }

    /// On a writable core replica: where an in-place write of `[off, off + len)` goes, when
    /// the memo knows its linear slice under the current epoch and no cluster of that slice
    /// has been metadata since it looked (ARCHITECTURE.md §9: the plan `plan_write_extent` makes
    /// through the cache, with its metadata check, in a few compares).
    #[inline(always)]
    pub(crate) fn memo_overwrite(&self, off: u64, len: u64) -> Option<u64> {
        let sh = self.writable_core_shared()?;
        let (key, within) = self.in_one_slice(off, len)?;
        let now = sh.stamp(key);
        self.memo.extent_overwrite(
            key,
            (now.epoch(), now.removals()),
            sh.meta_gen(),
            within,
            len,
        )
    }

    /// The host offset of `[off, off + len)` from the memo of slices alone: a read
    /// (the slice's current epoch, as [`cached_extent_with`](Self::cached_extent_with) checks
    /// it) or, with `write`, an in-place write on a writable core replica
    /// ([`memo_overwrite`](Self::memo_overwrite)). `None` says nothing about the range: the
    /// caller asks the slice cache.
    #[inline(always)]
    pub(crate) fn memo_extent(&self, off: u64, len: u64, write: bool) -> Option<u64> {
        if write {
            return self.memo_overwrite(off, len);
        }
        let (key, within) = self.in_one_slice(off, len)?;
        self.memo.extent(key, self.cur_epoch(key), within, len)
    }

    /// [`cached_extent_with`](Self::cached_extent_with) past the memo, for the range at
    /// `within` in slice `key`: the slice cache (out of line, so that the memo's hit stays
    /// small).
    #[inline(never)]
    fn cached_extent_in_cache(
        &self,
        off: u64,
        len: u64,
        copied: bool,
        (key, within): (u64, u64),
        epoch: u32,
    ) -> Result<u64, bool> {
        let coverage = self.geo.slice_coverage();
        let Ok(mut cache) = self.l2_cache.try_borrow_mut() else {
            return Err(false);
        };
        let Some(hit) = cache.probe(key, epoch) else {
            return Err(false);
        };
        let way = hit.way;
        let ctx = self.ctx.get();
        let cs = 1u64 << ctx.cluster_bits;
        let host = match cache.aux(way).linear.host(0, ctx.cluster_bits) {
            Some(first) => {
                let host = first + within;
                // Every cluster the range touches ends inside the device (the general path
                // checks each cluster the same way).
                if (host + len).next_multiple_of(cs) > ctx.device_size {
                    return Err(false);
                }
                // The whole slice inside the device: every request within it passes the
                // check above.
                if first
                    .checked_add(coverage)
                    .is_some_and(|e| e <= ctx.device_size)
                {
                    let meta_gen = self.slice_clear_of_metadata(first, coverage);
                    let removals = cache.aux(way).removals;
                    self.memo.remember(key, first, (epoch, removals), meta_gen);
                }
                host
            }
            _ => {
                if !self.geo.extended_l2 {
                    let meta_gen = self
                        .writable_core_shared()
                        .map_or(MEMO_NO_META_GEN, |sh| sh.meta_gen());
                    let removals = cache.aux(way).removals;
                    self.refresh_mapped(key, (epoch, removals), meta_gen, cache.block(way));
                }
                let in_cluster = off & (cs - 1);
                if in_cluster + len > cs {
                    return Err(false);
                }
                let i = self.geo.index_in_slice(GuestOffset(off)) as usize;
                let block = cache.block(way);
                let entry = if self.geo.extended_l2 {
                    // The entry's host offset holds the whole cluster; the subclusters the
                    // range touches must all be allocated data.
                    let sc = self.geo.subcluster_size();
                    let (Some(&e), Some(&bitmap)) = (block.get(2 * i), block.get(2 * i + 1)) else {
                        return Err(false);
                    };
                    if !SubclusterBitmap(bitmap)
                        .all_data(in_cluster / sc, (in_cluster + len - 1) / sc)
                    {
                        return Err(false);
                    }
                    L2Entry(e)
                } else {
                    let Some(&e) = block.get(i) else {
                        return Err(false);
                    };
                    L2Entry(e)
                };
                match entry.plain_data(ctx.cluster_bits, ctx.device_size) {
                    Some((h, c)) if c || !copied => h + in_cluster,
                    // Not COPIED: the general look-up agrees.
                    Some(_) => return Err(true),
                    // No host cluster (standard L2): unallocated or zero, for everyone.
                    None => return Err(!self.geo.extended_l2 && entry.host_bits() == 0),
                }
            }
        };
        cache.touch_fresh(hit);
        Ok(host)
    }

    /// Brings the memo's mapped row of slice `key` (cached under `stamp` with entries
    /// `block`) to metadata generation `meta_gen`: in place when it holds the row under an
    /// older generation (a new L2 table or refcount block moves the generation, dozens of
    /// times in a fill, and each move would otherwise decode every slice again), else
    /// afresh when [`SliceMemo::takes_mapped`] says so.
    fn refresh_mapped(&self, key: u64, stamp: (u32, u32), meta_gen: u64, block: &[u64]) {
        let sh = self.writable_core_shared();
        let is_meta = |c: u64| sh.is_some_and(|sh| sh.is_meta_cluster(c));
        let marked_min = |since: u64| sh.and_then(|sh| sh.meta_marked_min(since, meta_gen));
        if !self
            .memo
            .revalidate_mapped(key, stamp, meta_gen, is_meta, marked_min)
            && self.memo.takes_mapped(key, stamp.0, meta_gen)
        {
            self.remember_mapped(key, stamp, meta_gen, block);
        }
    }

    /// Remembers slice `key`, a standard (not extended) slice that is not linear, cached
    /// under `epoch` with entries `block`, in the memo as mapped: the host cluster of each
    /// entry that is plain COPIED data inside the device and, on a writable core replica,
    /// not metadata under `meta_gen`, the bitmap's generation read before (as for a linear
    /// slice).
    #[inline(never)]
    fn remember_mapped(&self, key: u64, stamp: (u32, u32), meta_gen: u64, block: &[u64]) {
        // One decode per entry, the context and the bitmap read once: a slice that changes
        // under a fill is remembered again for every new copy.
        let ctx = self.ctx.get();
        let core = self.writable_core_shared();
        let hosts = block
            .iter()
            .map(|&e| memo_word_in(ctx.cluster_bits, ctx.device_size, core, L2Entry(e)));
        self.memo.remember_mapped(key, stamp, meta_gen, hosts);
    }

    /// A standard L2 entry's word in a mapped memo row: its host cluster when it is plain
    /// COPIED data inside the device and, on a writable core replica, not metadata; else 0.
    pub(crate) fn memo_word(&self, e: L2Entry) -> u32 {
        let ctx = self.ctx.get();
        memo_word_in(
            ctx.cluster_bits,
            ctx.device_size,
            self.writable_core_shared(),
            e,
        )
    }

    /// Where this replica's cached L2 entry for `off` lies in memory, if its slice is cached
    /// (under any epoch) and not linear (a linear one resolves without the entry): a host
    /// may prefetch it before starting the request, so the load in
    /// [`resolve_cached`](Self::resolve_cached) does not stall. A hint only: nothing is
    /// validated, and the pointer must not be dereferenced.
    pub fn entry_hint(&self, off: GuestOffset) -> Option<*const u64> {
        let cache = self.l2_cache.try_borrow().ok()?;
        let way = cache.peek(self.geo.slice_id(off))?;
        // A linear slice is resolved without loading the entry: nothing to prefetch.
        if cache
            .aux(way)
            .linear
            .host(0, self.geo.cluster_bits)
            .is_some()
        {
            return None;
        }
        let i = self.geo.index_in_slice(off) as usize * if self.geo.extended_l2 { 2 } else { 1 };
        cache.block(way).get(i).map(|e| e as *const u64)
    }

    /// Whether this replica holds the slice covering `off` under its current epoch (no
    /// counters, no LRU update): read-ahead skips such a slice.
    pub fn slice_is_current(&self, off: GuestOffset) -> bool {
        let key = self.geo.slice_id(off);
        let epoch = self.cur_epoch(key);
        self.l2_cache
            .try_borrow()
            .is_ok_and(|c| c.peek_epoch(key) == Some(epoch))
    }

    /// On a core replica: whether the owner holds the slice covering `off` dirty (odd
    /// epoch), so a copy would come from the owner by message. False on the owner.
    pub fn slice_dirty_elsewhere(&self, off: GuestOffset) -> bool {
        self.core.is_some() && self.cur_epoch(self.geo.slice_id(off)) & 1 == 1
    }

    /// On a writable core replica: the state of this core's copy of the slice covering
    /// `off` (see [`Chain::route_write`](crate::Chain::route_write)); `None`
    /// on the owner and on read-only replicas.
    pub fn core_slice_state(&self, off: GuestOffset) -> Option<CoreSlice> {
        let sh = self.writable_core_shared()?;
        let key = self.geo.slice_id(off);
        let now = sh.epoch(key);
        Some(match self.l2_cache.borrow().peek_epoch(key) {
            Some(e) if e == now => CoreSlice::Valid,
            Some(_) if now & 1 == 1 => CoreSlice::StaleDirty,
            _ => CoreSlice::Missing,
        })
    }

    /// On a writable core replica whose copy of the slice of `[off, off + len)` is older
    /// than the slot's epoch: whether the copy still answers an in-place overwrite
    /// (ARCHITECTURE.md §6). It does while the slot's count of removals is the one the copy
    /// was taken under: every change since only added mappings, so each cluster the copy
    /// shows as COPIED data still is, at the same host offset, and the copy grants no
    /// overwrite a current copy would refuse. The range lies in one slice, in one cluster
    /// unless the copy is linear; its clusters lie inside the device and are not metadata
    /// now (the bitmap as for any in-place write). Touches the LRU and counts a hit only
    /// for [`KeptCopy::Host`].
    pub(crate) fn kept_overwrite(&self, off: u64, len: u64) -> KeptCopy {
        let (Some(sh), Some((key, within))) =
            (self.writable_core_shared(), self.in_one_slice(off, len))
        else {
            return KeptCopy::Unusable;
        };
        // After the request's grace-period entry, like every look-up.
        let now = sh.stamp(key);
        let Ok(mut cache) = self.l2_cache.try_borrow_mut() else {
            return KeptCopy::Unusable;
        };
        let Some((hit, epoch)) = cache.probe_any(key) else {
            return KeptCopy::Unusable;
        };
        let summary = cache.aux(hit.way);
        if summary.removals != now.removals() {
            return KeptCopy::Unusable;
        }
        let not_in_place = KeptCopy::NotInPlace {
            changes: now.epoch().wrapping_sub(epoch) / 2,
        };
        let ctx = self.ctx.get();
        let cs = 1u64 << ctx.cluster_bits;
        let host = match summary.linear.host(0, ctx.cluster_bits) {
            Some(first) => first + within,
            None => {
                let in_cluster = off & (cs - 1);
                if in_cluster + len > cs {
                    return not_in_place;
                }
                let i = self.geo.index_in_slice(GuestOffset(off)) as usize;
                let block = cache.block(hit.way);
                let entry = if self.geo.extended_l2 {
                    let sc = self.geo.subcluster_size();
                    match (block.get(2 * i), block.get(2 * i + 1)) {
                        (Some(&e), Some(&bitmap))
                            if SubclusterBitmap(bitmap)
                                .all_data(in_cluster / sc, (in_cluster + len - 1) / sc) =>
                        {
                            L2Entry(e)
                        }
                        _ => return not_in_place,
                    }
                } else {
                    match block.get(i) {
                        Some(&e) => L2Entry(e),
                        None => return not_in_place,
                    }
                };
                match entry.plain_data(ctx.cluster_bits, ctx.device_size) {
                    Some((h, true)) => h + in_cluster,
                    _ => return not_in_place,
                }
            }
        };
        let bits = ctx.cluster_bits;
        if (host + len).next_multiple_of(cs) > ctx.device_size
            || ((host >> bits)..=((host + len - 1) >> bits)).any(|c| sh.is_meta_cluster(c))
        {
            return not_in_place;
        }
        // Later overwrites through this copy find it in the memo, under the same count of
        // removals (`memo_overwrite`), in a few compares.
        let stamp = (epoch, summary.removals);
        let coverage = self.geo.slice_coverage();
        match summary.linear.host(0, bits) {
            Some(first)
                if first
                    .checked_add(coverage)
                    .is_some_and(|e| e <= ctx.device_size) =>
            {
                let meta_gen = self.slice_clear_of_metadata(first, coverage);
                self.memo.remember(key, first, stamp, meta_gen);
            }
            None if !self.geo.extended_l2 => {
                let meta_gen = sh.meta_gen();
                self.refresh_mapped(key, stamp, meta_gen, cache.block(hit.way));
            }
            _ => {}
        }
        cache.touch_fresh(hit);
        KeptCopy::Host(host)
    }

    fn l1_entry_end(&self, off: GuestOffset) -> u64 {
        let cov = self.geo.l1_entry_coverage();
        (off.0 / cov + 1).saturating_mul(cov)
    }

    /// Loads the slice covering `off` into the cache if needed and returns its way (valid
    /// until the next await). `None` when the L2 table is unallocated (nothing to load).
    pub(crate) async fn load_slice(&self, off: GuestOffset) -> Result<Option<usize>> {
        if let Some(r) = self.replica_side() {
            return r.load_slice(off).await;
        }
        let Some(l2) = self.l2_table(off)? else {
            return Ok(None);
        };
        let key = self.geo.slice_id(off);
        if let Some(w) = self.l2_cache.borrow_mut().lookup(key, 0) {
            return Ok(Some(w));
        }
        // The owner's dirty copy is newer than the device.
        if let Some(m) = &self.meta {
            if let Some(words) = m.dirty_slice(key) {
                return Ok(Some(self.cache_slice(key, SliceStamp::OWNER, |b| {
                    b.copy_from_slice(&words)
                })));
            }
        }
        let raw = self.read_slice_raw(l2, off).await?;
        // A write-back may have dirtied it meanwhile: the dirty copy wins.
        if let Some(m) = &self.meta {
            if let Some(words) = m.dirty_slice(key) {
                return Ok(Some(self.cache_slice(key, SliceStamp::OWNER, |b| {
                    b.copy_from_slice(&words)
                })));
            }
        }
        let w = self.cache_slice(key, SliceStamp::OWNER, |block| {
            for (dst, w) in block.iter_mut().zip(be_words(&raw)) {
                *dst = w;
            }
        });
        Ok(Some(w))
    }

    /// Core replica: caches `words` of slice `key` (the owner's copy, or what the device
    /// holds), taken under `stamp`. When the memo holds a mapped row built from the copy
    /// cached now, the row is carried over to the new copy with only the entries that
    /// differ decoded: while the owner fills a slice a core takes a new copy every few
    /// dozen allocations, and decoding all of its entries each time cost more than the rest
    /// of the requests' work.
    fn cache_slice_carrying(
        &self,
        key: u64,
        stamp: SliceStamp,
        words: impl ExactSizeIterator<Item = u64> + Clone,
    ) -> usize {
        let carried = if self.geo.extended_l2 {
            None
        } else {
            self.carry_memo_row(key, words.clone())
        };
        let w = self.cache_slice(key, stamp, |b| {
            for (dst, w) in b.iter_mut().zip(words) {
                *dst = w;
            }
        });
        if let Some((row, meta_gen)) = carried {
            self.memo
                .carry_mapped(row, (stamp.epoch(), stamp.removals()), meta_gen);
        }
        w
    }

    /// The memo's mapped row of slice `key`, patched to `words` (standard L2), with the
    /// metadata generation it holds under; `None` when the memo holds no row built from
    /// the cached copy (or the row cannot take the patch).
    fn carry_memo_row(
        &self,
        key: u64,
        words: impl ExactSizeIterator<Item = u64>,
    ) -> Option<(MappedRow, u64)> {
        let meta_gen = self
            .writable_core_shared()
            .map_or(MEMO_NO_META_GEN, |sh| sh.meta_gen());
        let cache = self.l2_cache.borrow();
        let way = cache.peek(key)?;
        let epoch = cache.peek_epoch(key)?;
        let row = self
            .memo
            .mapped_row(key, (epoch, cache.aux(way).removals), meta_gen)?;
        let old = cache.block(way);
        if old.len() != words.len() {
            return None;
        }
        for (i, (&a, b)) in old.iter().zip(words).enumerate() {
            if a != b && !self.memo.patch_row(&row, i, self.memo_word(L2Entry(b))) {
                return None;
            }
        }
        Some((row, meta_gen))
    }

    /// Caches slice `key` read under `stamp` (`fill` writes its words) with its summary
    /// ([`SliceSummary`]); returns the way. Every L2 slice enters the cache here.
    pub(crate) fn cache_slice(
        &self,
        key: u64,
        stamp: SliceStamp,
        fill: impl FnOnce(&mut [u64]),
    ) -> usize {
        self.memo.forget(key);
        let mut cache = self.l2_cache.borrow_mut();
        let (w, evicted) = cache.insert_evicting(key, stamp.epoch(), fill);
        if let Some(old) = evicted {
            self.memo.forget(old);
        }
        let linear = LinearSlice::of(
            cache.block(w),
            self.ctx.get().cluster_bits,
            self.geo.extended_l2,
        );
        cache.set_aux(
            w,
            SliceSummary {
                linear,
                removals: stamp.removals(),
            },
        );
        w
    }

    async fn read_slice_raw(
        &self,
        l2: crate::types::HostOffset,
        off: GuestOffset,
    ) -> Result<Vec<u8>> {
        let host = self.geo.slice_host_offset(l2, off);
        let slice_bytes = 1usize << self.geo.slice_bits;
        let buf = self.exec.alloc_buf(self.dev, slice_bytes);
        self.exec
            .read(self.dev, host.0, BufSlice::whole(buf.clone()))
            .await?;
        let mut raw = vec![0u8; slice_bytes];
        buf.copy_out(0, &mut raw);
        Ok(raw)
    }

    /// Describes guest bytes starting at `off` (< `end`): the mapping of the first
    /// (sub)cluster and how many bytes from `off` share it (same kind; for data, contiguous
    /// host offsets), not crossing a slice boundary. Loads the slice on a miss.
    pub async fn extent(&self, off: u64, end: u64) -> Result<(ClusterMapping, u64)> {
        let go = GuestOffset(off);
        let Some(way) = self.load_slice(go).await? else {
            let e = self.l1_entry_end(go).min(end);
            return Ok((ClusterMapping::Unallocated { host: None }, e - off));
        };
        let slice_end = (off / self.geo.slice_coverage() + 1) * self.geo.slice_coverage();
        let stop = end.min(slice_end);
        let cache = self.l2_cache.borrow();
        let block = cache.block(way);
        let (first, mut pos) = self.resolve(block, go)?;
        while pos < stop {
            let (next, next_end) = self.resolve(block, GuestOffset(pos))?;
            // `first` describes the (sub)cluster that starts at `first_start` (<= `off`).
            let first_start = off & !(self.geo.subcluster_size() - 1);
            if !first.continues_with(&next, pos - first_start) {
                break;
            }
            pos = next_end;
        }
        Ok((first, pos.min(stop) - off))
    }

    /// Copies `dst.len` bytes at `in_cluster` of compressed cluster `d` into `dst`: from the
    /// cluster this core decompressed last when it is that one, else read and decompressed
    /// (and kept in its place).
    pub async fn read_compressed_part(
        &self,
        d: crate::format::CompressedDescriptor,
        in_cluster: usize,
        dst: &BufSlice<D::Buf>,
    ) -> Result<()> {
        let part = |c: &[u8]| -> Result<()> {
            let bytes = c.get(in_cluster..in_cluster + dst.len).ok_or_else(|| {
                corrupt(Field::CompressedData, d.offset.0, "part past its cluster")
            })?;
            dst.copy_in(0, bytes);
            Ok(())
        };
        // Read before the stream's bytes: a reuse meanwhile leaves the kept cluster unused.
        let gen = self.reuse_gen();
        if let Some(c) = self.last_compressed.borrow().get(d.offset.0, d.len, gen) {
            return part(c);
        }
        let input = read_bytes(&self.exec, self.dev, d.offset.0, d.len).await?;
        let ct = self.compression_type();
        // Nothing awaits while they are borrowed.
        let mut last = self.last_compressed.borrow_mut();
        let mut dec = self.decompressor.borrow_mut();
        let cs = self.geo.cluster_size() as usize;
        part(last.fill((d.offset.0, d.len, gen), cs, |out| {
            dec.decompress(ct, &input, out)
        })?)
    }

    /// The generation under which bytes in use stay unchanged (see
    /// [`LastCluster`](crate::compress::LastCluster)): `Shared`'s on a shared image, else
    /// the owner's own (a read-only image never frees).
    pub(crate) fn reuse_gen(&self) -> u64 {
        match &self.shared {
            Some(sh) => sh.reuse_gen(),
            None => self.reuse_local.get(),
        }
    }

    /// Owner: freed clusters are about to be handed out again (see
    /// [`reuse_gen`](Self::reuse_gen)).
    pub(crate) fn bump_reuse(&self) {
        match &self.shared {
            Some(sh) => sh.bump_reuse(),
            None => self.reuse_local.set(self.reuse_local.get() + 1),
        }
    }

    /// The kept compressed cluster, for a read-ahead that decompresses a part of one.
    pub(crate) fn last_compressed(&self) -> &RefCell<crate::compress::LastCluster> {
        &self.last_compressed
    }

    /// Refcount of the host cluster containing `host_off` (through the refcount block
    /// cache, or the owner's dirty copy).
    pub async fn refcount(&self, host_off: u64) -> Result<u64> {
        let order = self.header.borrow().header.refcount_order;
        let Some((block, idx)) = self.rc_locate(host_off >> self.geo.cluster_bits)? else {
            return Ok(0);
        };
        self.load_rc_block(block).await?;
        Ok(self.with_rc_block(block, |b| get_refcount(b, order, idx)))
    }

    /// Where the refcount of host cluster `cluster` lives: (block offset, index in block),
    /// or `None` when no refcount block covers it (refcount 0).
    pub(crate) fn rc_locate(&self, cluster: u64) -> Result<Option<(u64, u64)>> {
        let h = self.header.borrow();
        let per_block = entries_per_block(h.header.cluster_bits, h.header.refcount_order);
        let rt_index = cluster / per_block;
        let Some(&entry) = self.refcount_table.borrow().get(rt_index as usize) else {
            return Ok(None);
        };
        let Some(block) =
            refcount_block_offset(entry, self.geo.cluster_size(), self.device_size.get())?
        else {
            return Ok(None);
        };
        Ok(Some((block.0, cluster % per_block)))
    }

    /// Makes sure refcount block `block` is in the cache (or the owner's dirty set).
    pub(crate) async fn load_rc_block(&self, block: u64) -> Result<()> {
        if self.meta.as_ref().is_some_and(|m| m.has_dirty_rc(block)) {
            return Ok(());
        }
        if self.rc_cache.borrow_mut().lookup(block, 0).is_some() {
            return Ok(());
        }
        let raw = read_bytes(&self.exec, self.dev, block, self.geo.cluster_size()).await?;
        // Another task may have dirtied it meanwhile: the dirty copy wins.
        if self.meta.as_ref().is_some_and(|m| m.has_dirty_rc(block)) {
            return Ok(());
        }
        self.rc_cache
            .borrow_mut()
            .insert_with(block, 0, |b| b.copy_from_slice(&raw));
        Ok(())
    }

    /// Runs `f` on refcount block `block`, which [`load_rc_block`](Self::load_rc_block)
    /// just loaded (no await in between). The owner's dirty copy wins over the cache.
    pub(crate) fn with_rc_block<R>(&self, block: u64, f: impl FnOnce(&[u8]) -> R) -> R {
        if let Some(m) = &self.meta {
            if let Some(b) = m.dirty_rc_ref(block) {
                return f(&b);
            }
        }
        let cache = self.rc_cache.borrow();
        match cache.probe(block, 0) {
            Some(h) => f(cache.block(h.way)),
            None => f(&vec![0u8; self.geo.cluster_size() as usize]),
        }
    }
}

impl<D: BlockDevice> Replica<'_, D> {
    /// Hands over the owner's answer to ticket `ticket` and wakes the waiting tasks.
    fn deliver(&self, ticket: u64, reply: SliceReply) {
        if let Some(slot) = self.side.tickets.borrow_mut().get_mut(ticket as usize) {
            *slot = Some(reply);
        }
        self.side.wait.notify_all();
    }

    /// Asks the owner for slice `key` and waits for its answer.
    async fn ask_owner(&self, key: u64) -> SliceReply {
        let side = self.side;
        let t = side.tickets.borrow_mut().insert(None);
        side.link.ask_slice(key, t as u64);
        loop {
            let got = side.tickets.borrow_mut().get_mut(t).and_then(Option::take);
            if let Some(r) = got {
                side.tickets.borrow_mut().remove(t);
                return r;
            }
            side.wait.wait().await;
        }
    }

    /// A core replica's miss (ARCHITECTURE.md §6): with an even epoch, read the slice from the
    /// device and keep it only if the epoch did not move meanwhile (seqlock); with an odd
    /// one, ask the owner for its copy.
    async fn load_slice(&self, off: GuestOffset) -> Result<Option<usize>> {
        let (q, shared) = (self.q, &*self.side.shared);
        let key = q.geo.slice_id(off);
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            if attempts > 1000 {
                // EAGAIN: the slice kept changing under 1000 reads (the owner rewrites it
                // faster than this core can read it); the guest may retry.
                return Err(Error::Io(11));
            }
            let mut stamp = shared.stamp(key);
            if let Some(w) = q.l2_cache.borrow_mut().lookup(key, stamp.epoch()) {
                return Ok(Some(w));
            }
            if stamp.epoch() & 1 == 1 {
                match self.ask_owner(key).await {
                    SliceReply::Copy { words, stamp } => {
                        q.sync_core();
                        let w = q.cache_slice_carrying(key, stamp, words.iter().copied());
                        // Taken after this request began: valid for it whatever the epoch
                        // is now; the cache keeps it only while the epoch stays.
                        return Ok(Some(w));
                    }
                    SliceReply::Clean { stamp: s } => stamp = s,
                    SliceReply::Retry => continue,
                }
            }
            // The L1 entry is read after the epoch: a new table's slices are odd before
            // the owner publishes the entry that points at it.
            let Some(l2) = q.l2_table(off)? else {
                return Ok(None);
            };
            let raw = q.read_slice_raw(l2, off).await?;
            // An unchanged epoch means no removal either (a removal moves both).
            if shared.epoch(key) != stamp.epoch() {
                continue;
            }
            // Entries of the slice may point where the owner grew the device before it
            // wrote them.
            q.sync_core();
            return Ok(Some(q.cache_slice_carrying(key, stamp, be_words(&raw))));
        }
    }
}

/// [`Qcow2::memo_word`] with the image's cluster bits, device size and (on a writable core
/// replica) metadata bitmap given.
#[inline(always)]
fn memo_word_in(bits: u32, device_size: u64, core: Option<&Shared>, e: L2Entry) -> u32 {
    let Some((h, true)) = e.plain_data(bits, device_size) else {
        return 0;
    };
    let cluster = h >> bits;
    match u32::try_from(cluster) {
        Ok(c) if core.is_none_or(|sh| !sh.is_meta_cluster(cluster)) => c,
        _ => 0,
    }
}
