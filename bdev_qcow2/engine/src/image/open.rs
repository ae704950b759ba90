//! Opening an image: the header and its extensions validated, the L1, refcount and
//! snapshot tables read, the per-core caches sized, and a writable image's owner state
//! set up (a dirty image repaired first).

use super::owner;
use super::role::ImageRole;
use super::{be_words, OpenOptions, Qcow2, SliceSummary, DEFAULT_L2_CACHE_MAX};
use crate::cache::{CacheConfig, SetAssocCache};
use crate::error::{invalid, Error, Field, Result};
use crate::exec::read_bytes;
use crate::exec::{DevId, Exec};
use crate::format::header::{peek_cluster_bits, PEEK_LEN};
use crate::format::snapshot::{decode_snapshots, SnapshotDecode};
use crate::format::{ImageHeader, L1Entry, L2Context, Snapshot};
use crate::io::BlockDevice;
use crate::limits::MAX_CACHE_BYTES;
use crate::memo::SliceMemo;
use crate::types::Geometry;
use std::cell::{Cell, RefCell};
use std::rc::Rc;

impl<D: BlockDevice> Qcow2<D> {
    /// Opens and validates the image on `dev`. Reads cluster 0, the L1 table, the refcount
    /// table and the snapshot table; returns the first invalid field found.
    pub async fn open(exec: &Exec<D>, dev: DevId, opts: OpenOptions) -> Result<Self> {
        Self::open_inner(exec, dev, opts, false).await
    }

    pub(super) async fn open_inner(
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
        let luks = super::encryption::read_luks(exec, dev, &header).await?;
        let mut opts = opts;
        if luks.is_some() {
            // Clusters that read as zeros unwritten hold no cipher text of zeros: every new
            // cluster of an encrypted image is written whole (as QEMU does).
            opts.alloc_granule = 0;
            opts.zero_ahead = false;
        }
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

        let caches = Self::new_caches(&geo, l1.len(), refcount_table.len(), &opts)?;
        let role = if opts.writable {
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
            ImageRole::Owner {
                meta: owner::Meta::new(
                    exec,
                    &header,
                    &c0,
                    device_size,
                    opts.ordered_layout,
                    opts.alloc_granule,
                    owner::discards::PassDiscard::new(
                        &opts,
                        exec.with_device(dev, |d| d.discards()),
                    ),
                )
                .with_dirty_bound(
                    opts.dirty_bound(u64::from(header.header.l1_size) * header.cluster_size()),
                ),
                shared: None,
            }
        } else {
            ImageRole::ReadOnly { shared: None }
        };
        let data_dev = super::encryption::data_view(exec, dev, luks.as_ref());
        let mut q = Qcow2 {
            exec: exec.clone(),
            dev,
            data_dev,
            luks,
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
            memo: caches.memo,
            l2_cache: RefCell::new(caches.l2),
            rc_cache: RefCell::new(caches.rc),
            role,
            dirty_bitmaps: None,
        };
        q.index_metadata();
        if let Ok(o) = q.owner() {
            let bitmaps = o.load_bitmaps().await?;
            if opts.zero_ahead {
                o.start_zero_ahead().await?;
            }
            q.dirty_bitmaps = bitmaps;
        }
        Ok(q)
    }

    pub(super) async fn read_snapshots(
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

    /// Builds a core's empty L2 slice and refcount block caches sized by `opts`, and the
    /// direct path's memo sized to the slice cache.
    pub(super) fn new_caches(
        geo: &Geometry,
        l1_entries: usize,
        rt_entries: usize,
        opts: &OpenOptions,
    ) -> Result<Caches> {
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
        let memo = Rc::new(SliceMemo::new(
            l2_cache.capacity(),
            geo.slice_entries() as usize,
            geo.cluster_bits,
        ));
        Ok(Caches {
            l2: l2_cache,
            rc: rc_cache,
            memo,
        })
    }
}

/// A core's empty caches, built together so that the memo matches the slice cache.
pub(super) struct Caches {
    /// L2 slices.
    pub(super) l2: SetAssocCache<u64, SliceSummary>,
    /// Refcount blocks.
    pub(super) rc: SetAssocCache<u8>,
    /// The direct path's memo, one slot per slice the cache holds (up to its cap).
    pub(super) memo: Rc<SliceMemo>,
}
