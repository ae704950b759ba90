//! Formatting a fresh image on a device (`qcow2 create`, and the SPDK format RPC).
//!
//! Layout, as QEMU lays it out: the header in cluster 0, then the refcount table, the
//! refcount blocks covering the metadata, then the L1 table. Everything is written, then
//! flushed; the header is written last so a crash leaves no valid-looking half image.

use crate::crypto::LuksArea;
use crate::error::{invalid, Error, Field, Result};
use crate::exec::{DevId, Exec};
use crate::format::header::{
    self, default_feature_names, incompat, CompressionType, Extensions, Header, ZeroedTail,
};
use crate::format::refcount::{entries_per_block, set_refcount};
use crate::format::{ImageHeader, L2Entry, SubclusterBitmap};
use crate::io::{BlockDevice, BufSlice, IoBuffer};
use crate::limits::{
    MAX_CLUSTER_BITS, MAX_L1_ENTRIES, MAX_VIRTUAL_SIZE, MIN_CLUSTER_BITS,
    MIN_CLUSTER_BITS_EXTENDED_L2,
};

/// What to create (the `qemu-img create -o` options).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateOptions {
    /// Virtual size in bytes (rounded up to 512).
    pub size: u64,
    /// log2 of the cluster size (default 16: 64 KiB).
    pub cluster_bits: u32,
    /// 2 (compat=0.10) or 3 (compat=1.1, default).
    pub version: u32,
    /// log2 of the refcount width in bits (default 4: 16 bits).
    pub refcount_order: u32,
    /// Extended L2 entries (subclusters).
    pub extended_l2: bool,
    /// Lazy refcounts (compatible feature bit).
    pub lazy_refcounts: bool,
    /// Compression algorithm for compressed clusters.
    pub compression_type: CompressionType,
    /// Backing file name recorded in the image (never opened here).
    pub backing_file: Option<String>,
    /// Backing file format recorded in the image.
    pub backing_format: Option<String>,
    /// The device reads zeros past where the image's metadata ends (its caller zeroed it):
    /// record it ([`ZeroedTail`]), so that a writer knows new clusters there read as zeros
    /// and writes only the guest's bytes into them. For a device that cannot grow; on one
    /// that can (a file), what lies past its end reads as zeros anyway. Compat 1.1 only.
    pub zeroed_tail: bool,
    /// Encrypt the image with LUKS (`encrypt.format=luks`): the header area
    /// [`build_luks_area`](crate::crypto::build_luks_area) made, placed in the clusters
    /// after the L1 table (as QEMU places it), `crypt_method` 2 and the encryption header
    /// extension pointing at it.
    pub encryption: Option<LuksArea>,
}

impl Default for CreateOptions {
    fn default() -> Self {
        CreateOptions {
            size: 0,
            cluster_bits: 16,
            version: 3,
            refcount_order: 4,
            extended_l2: false,
            lazy_refcounts: false,
            compression_type: CompressionType::Zlib,
            backing_file: None,
            backing_format: None,
            zeroed_tail: false,
            encryption: None,
        }
    }
}

impl CreateOptions {
    pub(crate) fn validate(&self) -> Result<()> {
        if !(MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS).contains(&self.cluster_bits) {
            return Err(invalid(
                Field::ClusterBits,
                self.cluster_bits.into(),
                "cluster size must be 512 B – 2 MiB",
            ));
        }
        if self.version != 2 && self.version != 3 {
            return Err(Error::UnsupportedVersion(self.version));
        }
        if self.refcount_order > 6 {
            return Err(invalid(
                Field::RefcountOrder,
                self.refcount_order.into(),
                "refcount_bits must be 1..=64",
            ));
        }
        if self.version == 2 {
            if self.refcount_order != 4 {
                return Err(invalid(
                    Field::RefcountOrder,
                    self.refcount_order.into(),
                    "compat=0.10 needs refcount_bits=16",
                ));
            }
            if self.extended_l2
                || self.lazy_refcounts
                || self.zeroed_tail
                || self.compression_type != CompressionType::Zlib
            {
                return Err(invalid(
                    Field::Version,
                    2,
                    "extended_l2, lazy_refcounts, zstd and a zeroed tail need compat=1.1",
                ));
            }
        }
        if self.encryption.is_some() && self.zeroed_tail {
            // Zeros on the device are not the cipher text of zeros.
            return Err(Error::UnsupportedFeature(
                "a zeroed tail with encryption".into(),
            ));
        }
        if self.extended_l2 && self.cluster_bits < MIN_CLUSTER_BITS_EXTENDED_L2 {
            return Err(invalid(
                Field::ClusterBits,
                self.cluster_bits.into(),
                "extended_l2 needs clusters of at least 16 KiB",
            ));
        }
        if self.size > MAX_VIRTUAL_SIZE {
            return Err(invalid(
                Field::Size,
                self.size,
                "virtual size above 2^61 bytes",
            ));
        }
        if self.backing_file.as_ref().is_some_and(|b| b.len() > 1023) {
            return Err(invalid(
                Field::BackingFileSize,
                1024,
                "backing file name longer than 1023 bytes",
            ));
        }
        Ok(())
    }
}

/// Writes a fresh, empty image described by `opts` onto `dev` and flushes it.
pub async fn create<D: BlockDevice>(
    exec: &Exec<D>,
    dev: DevId,
    opts: &CreateOptions,
) -> Result<()> {
    opts.validate()?;
    let cs = 1u64 << opts.cluster_bits;
    let size = opts.size.div_ceil(512) * 512;
    let l2_bits = opts.cluster_bits - if opts.extended_l2 { 4 } else { 3 };
    let l1_entries = size.div_ceil(1u64 << (opts.cluster_bits + l2_bits));
    if l1_entries > MAX_L1_ENTRIES {
        return Err(invalid(
            Field::Size,
            size,
            "needs an L1 table larger than 32 MiB",
        ));
    }
    let l1_clusters = (l1_entries * 8).div_ceil(cs).max(1);
    let luks_clusters = opts.encryption.as_ref().map_or(0, |a| a.len().div_ceil(cs));
    let per_block = entries_per_block(opts.cluster_bits, opts.refcount_order);
    // Fixpoint: the refcount blocks must count themselves and the table.
    let (mut rt_clusters, mut blocks) = (1u64, 1u64);
    loop {
        let total = 1 + rt_clusters + blocks + l1_clusters + luks_clusters;
        let nb = total.div_ceil(per_block);
        let nrt = (nb * 8).div_ceil(cs).max(1);
        if nb == blocks && nrt == rt_clusters {
            break;
        }
        blocks = nb;
        rt_clusters = nrt;
    }
    let rt_off = cs;
    let rb_off = rt_off + rt_clusters * cs;
    let l1_off = rb_off + blocks * cs;
    let luks_off = l1_off + l1_clusters * cs;
    let total = 1 + rt_clusters + blocks + l1_clusters + luks_clusters;

    let mut incompatible = 0;
    if opts.extended_l2 {
        incompatible |= incompat::EXTENDED_L2;
    }
    if opts.compression_type != CompressionType::Zlib {
        incompatible |= incompat::COMPRESSION_TYPE;
    }
    let ih = ImageHeader {
        header: Header {
            version: opts.version,
            backing_file_offset: 0,
            backing_file_size: 0,
            cluster_bits: opts.cluster_bits,
            size,
            crypt_method: if opts.encryption.is_some() {
                header::CRYPT_LUKS
            } else {
                0
            },
            l1_size: l1_entries as u32,
            l1_table_offset: l1_off,
            refcount_table_offset: rt_off,
            refcount_table_clusters: rt_clusters as u32,
            nb_snapshots: 0,
            snapshots_offset: 0,
            incompatible_features: incompatible,
            compatible_features: if opts.lazy_refcounts {
                header::compat::LAZY_REFCOUNTS
            } else {
                0
            },
            autoclear_features: if opts.zeroed_tail {
                header::autoclear::ZEROED_TAIL
            } else {
                0
            },
            refcount_order: opts.refcount_order,
            header_length: if opts.version == 3 {
                header::V3_HEADER_LEN
            } else {
                header::V2_HEADER_LEN
            },
            compression_type: opts.compression_type,
            unknown_tail: Vec::new(),
        },
        extensions: Extensions {
            zeroed_tail: opts.zeroed_tail.then_some(ZeroedTail {
                from: total * cs,
                // The first extension, right after the header.
                at: u64::from(header::V3_HEADER_LEN) + 8,
            }),
            backing_format: opts.backing_format.clone(),
            encryption: opts.encryption.as_ref().map(|a| (luks_off, a.len())),
            feature_names: match opts.version {
                3 if opts.zeroed_tail => {
                    let mut f = default_feature_names();
                    f.push(header::FeatureName {
                        kind: 2,
                        bit: 63,
                        name: "zeroed tail".into(),
                    });
                    f
                }
                3 => default_feature_names(),
                _ => Vec::new(),
            },
            ..Default::default()
        },
        backing_file: opts.backing_file.clone(),
    };
    let c0 = ih.encode()?;

    let write = |off: u64, bytes: Vec<u8>| {
        let buf = exec.alloc_buf(dev, bytes.len());
        buf.copy_in(0, &bytes);
        exec.write(dev, off, BufSlice::whole(buf))
    };
    // Refcount table and blocks.
    let mut rt = vec![0u8; (rt_clusters * cs) as usize];
    for b in 0..blocks {
        let off = rb_off + b * cs;
        rt[(b * 8) as usize..(b * 8 + 8) as usize].copy_from_slice(&off.to_be_bytes());
        let mut block = vec![0u8; cs as usize];
        for c in (b * per_block)..((b + 1) * per_block).min(total) {
            set_refcount(&mut block, opts.refcount_order, c % per_block, 1)?;
        }
        write(off, block).await?;
    }
    write(rt_off, rt).await?;
    write(l1_off, vec![0u8; (l1_clusters * cs) as usize]).await?;
    if let Some(a) = &opts.encryption {
        // Whole clusters: the tail past the area reads as zeros, as QEMU leaves it.
        let mut area = vec![0u8; (luks_clusters * cs) as usize];
        area[..a.bytes().len()].copy_from_slice(a.bytes());
        write(luks_off, area).await?;
    }
    exec.flush(dev).await?;
    // Header last.
    write(0, c0).await?;
    exec.flush(dev).await
}

/// How [`preallocate`] fills a fresh image (`preallocation=` of `qemu-img create`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preallocation {
    /// Every cluster is allocated and mapped, its contents never written.
    ///
    /// `device_reads_zeros`: the device reads zeros where the clusters go (a fresh sparse
    /// file). The entries are then plain data entries, as QEMU writes them. Otherwise (a bdev
    /// or a block device, which may hold anything) the entries are preallocated zero
    /// clusters (the v3 zero flag, so old contents never show; a v2 image cannot say that
    /// and is refused). With extended L2 the subclusters stay unallocated either way (they
    /// read as zeros, or from a backing file), as QEMU leaves them.
    Metadata {
        /// The device reads zeros past the image's metadata.
        device_reads_zeros: bool,
    },
    /// Every cluster is allocated, written with zeros and mapped as plain data: the image
    /// is fully allocated (with extended L2, see [`preallocate`]).
    Full,
}

/// Bytes of zeros one write of [`Preallocation::Full`] covers.
const ZERO_CHUNK: u64 = 1 << 20;
/// Zero writes of [`Preallocation::Full`] in flight at once.
const ZERO_DEPTH: usize = 8;

/// Preallocates every cluster of the fresh, writable top image of `chain`, contiguously, as
/// QEMU does, in the way `mode` says; the device is extended to cover them (a sparse file
/// grows; a fixed device must be large enough: `ENOSPC` otherwise). Closes (flushes) the
/// image. Refused (as by `qemu-img`) when the image has a backing file and no extended L2.
pub async fn preallocate<D: BlockDevice>(
    chain: &std::rc::Rc<crate::Chain<D>>,
    mode: Preallocation,
) -> Result<()> {
    use crate::format::entries::{COPIED, FULL_BITMAP, ZERO};
    use crate::types::GuestOffset;
    let crate::Layer::Qcow2(q) = &chain.layers()[0] else {
        return Err(Error::ReadOnly);
    };
    let o = q.owner()?;
    let q = &o;
    let geo = q.geometry();
    let (backed, version) = {
        let h = q.header();
        (h.backing_file.is_some(), h.header.version)
    };
    if backed && !geo.extended_l2() {
        // A zero or data entry would hide the backing file's data.
        return Err(Error::UnsupportedFeature(
            "preallocation with a backing file needs extended_l2".into(),
        ));
    }
    // The entry flags and bitmap every preallocated cluster gets. With extended L2 the
    // subclusters stay unallocated (as QEMU leaves them: they read as zeros or from the
    // backing file), except that a full preallocation of an image without backing file
    // marks them allocated: they hold zeros, and the image is then fully allocated.
    let (flags, bitmap) = match mode {
        Preallocation::Full if geo.extended_l2() && !backed => (COPIED, FULL_BITMAP),
        _ if geo.extended_l2() => (COPIED, 0),
        Preallocation::Full
        | Preallocation::Metadata {
            device_reads_zeros: true,
        } => (COPIED, 0),
        Preallocation::Metadata {
            device_reads_zeros: false,
        } => {
            if version < 3 {
                return Err(Error::UnsupportedFeature(
                    "preallocation=metadata on a device that may hold old data needs \
                     compat=1.1 (zero flag); use preallocation=full"
                        .into(),
                ));
            }
            (COPIED | ZERO, 0)
        }
    };
    let cs = geo.cluster_size();
    let n_clusters = q.size().div_ceil(cs);
    let per_table = geo.l2_entries();
    let exec = q.exec();
    let dev = q.dev();
    // Plain data entries whose clusters must read as zeros: all of them with `Full`; with
    // `Metadata` on a device that reads zeros, those of clusters written before (a freed
    // metadata cluster reused, such as the refcount table a growth replaced).
    let plain = flags == COPIED && !(geo.extended_l2() && bitmap == 0);
    let mut zeros: Option<BufSlice<D::Buf>> = None;
    let cheap_zeroes = exec.with_device(dev, |d| d.zeroes_cheaply());
    let mut end = 0;
    {
        let _g = q.meta().lock().lock().await;
        // Every L2 table first, so that the data clusters follow them in one run (as QEMU
        // lays a preallocated image out).
        for t in 0..n_clusters.div_ceil(per_table) {
            q.ensure_l2(GuestOffset(t * per_table * cs)).await?;
            q.maybe_writeback_locked().await?;
        }
        let mut g = 0;
        while g < n_clusters {
            let table_end = n_clusters.min((g / per_table + 1) * per_table);
            while g < table_end {
                let a = q.alloc_clusters(table_end - g).await?;
                let n = a.count;
                let (start, stop) = (
                    geo.host_cluster_offset(a.first).0,
                    geo.host_cluster_offset(a.end()).0,
                );
                if plain && (mode == Preallocation::Full || !a.fresh) {
                    // A device that zeroes cheaply does it itself; else zeros are written
                    // from one buffer.
                    let z = (!cheap_zeroes).then(|| {
                        zeros
                            .get_or_insert_with(|| {
                                let len = ZERO_CHUNK.min(n_clusters * cs) as usize;
                                BufSlice::whole(exec.alloc_buf(dev, len))
                            })
                            .clone()
                    });
                    // The zeros are on the device before any entry names the clusters (the
                    // write-back flushes data before the L2 slices that point at it).
                    let mut off = start;
                    while off < stop {
                        let mut futs = Vec::with_capacity(ZERO_DEPTH);
                        while off < stop && futs.len() < ZERO_DEPTH {
                            let len = (stop - off).min(ZERO_CHUNK);
                            futs.push(match &z {
                                Some(z) => exec.write(dev, off, z.sub(0, len as usize)),
                                None => exec.write_zeroes(dev, off, len),
                            });
                            off += len;
                        }
                        crate::exec::join_all(futs).await?;
                    }
                }
                for i in 0..n {
                    let off = GuestOffset((g + i) * cs);
                    q.dirty_slice_for(off).await?;
                    let host = geo.host_cluster_offset(a.nth(i)).0;
                    q.set_l2_words(off, L2Entry(host | flags), SubclusterBitmap(bitmap))?;
                }
                end = end.max(stop);
                g += n;
            }
            q.maybe_writeback_locked().await?;
        }
    }
    // Make the device cover the clusters (a sparse file grows), then write back.
    exec.with_device(dev, |d| d.ensure_size(end))
        .map_err(|e| Error::Io(e.0))?;
    chain.close().await
}
