//! L1 and L2 table entries, the extended-L2 subcluster bitmap and compressed-cluster
//! descriptors. Raw words live behind accessors; callers match on [`ClusterMapping`].

use crate::error::{corrupt, Field, Result};
use crate::types::{HostOffset, HostRange, SUBCLUSTERS};

/// Bits 9..=55: the cluster-aligned host offset of an L1/L2 entry.
const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// COPIED: refcount is exactly one (bit 63).
pub const COPIED: u64 = 1 << 63;
/// Compressed cluster (bit 62, L2 only).
pub const COMPRESSED: u64 = 1 << 62;
/// Reads as zero (bit 0, standard L2 entries of v3 images).
pub const ZERO: u64 = 1;
/// Reserved bits of an L1 entry: 0..=8 and 56..=62.
const L1_RESERVED: u64 = 0x7f00_0000_0000_01ff;
/// Reserved bits of a standard (uncompressed) L2 entry: 1..=8 and 56..=61.
const L2_RESERVED: u64 = 0x3f00_0000_0000_01fe;

/// One L1 entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct L1Entry(pub u64);

impl L1Entry {
    /// Host offset of the L2 table, or `None` when unallocated.
    ///
    /// Errors (corruption) when reserved bits are set, the offset is not cluster aligned,
    /// or the table would lie past `device_size`.
    pub fn l2_table(&self, cluster_size: u64, device_size: u64) -> Result<Option<HostOffset>> {
        let v = self.0;
        if v & L1_RESERVED != 0 {
            return Err(corrupt(Field::L1Entry, v, "reserved bits set"));
        }
        let off = v & OFFSET_MASK;
        if off == 0 {
            if v & COPIED != 0 {
                return Err(corrupt(Field::L1Entry, v, "offset 0 with COPIED set"));
            }
            return Ok(None);
        }
        if !off.is_multiple_of(cluster_size) {
            return Err(corrupt(
                Field::L1Entry,
                v,
                "L2 table offset not aligned to a cluster",
            ));
        }
        if off
            .checked_add(cluster_size)
            .is_none_or(|e| e > device_size)
        {
            return Err(corrupt(
                Field::L1Entry,
                v,
                "L2 table past the end of the device",
            ));
        }
        Ok(Some(HostOffset(off)))
    }
    /// Whether COPIED is set.
    pub fn is_copied(&self) -> bool {
        self.0 & COPIED != 0
    }
    /// An entry pointing at `l2`, its COPIED flag as `copied` says.
    pub fn new(l2: HostOffset, copied: CopiedFlag) -> L1Entry {
        L1Entry(
            l2.0 | match copied {
                CopiedFlag::Set => COPIED,
                CopiedFlag::Clear => 0,
            },
        )
    }
}

/// The COPIED flag of an L1 or L2 entry: set when the table or cluster it points at has a
/// refcount of exactly one (it may be written in place).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopiedFlag {
    /// Refcount one: written in place.
    Set,
    /// Shared (refcount above one, e.g. with a snapshot): copied before a write.
    Clear,
}

impl CopiedFlag {
    /// The flag for a table or cluster of refcount `refcount`.
    pub fn for_refcount(refcount: i64) -> Self {
        if refcount == 1 {
            CopiedFlag::Set
        } else {
            CopiedFlag::Clear
        }
    }
}

/// One L2 entry (the first 64 bits of an extended entry).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct L2Entry(pub u64);

/// The 64-bit subcluster bitmap of an extended L2 entry: bits 0..32 allocated,
/// bits 32..64 reads-as-zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SubclusterBitmap(pub u64);

impl SubclusterBitmap {
    /// No subcluster allocated or zero; also the bitmap word of a standard (not extended)
    /// entry, which has none.
    pub const NONE: SubclusterBitmap = SubclusterBitmap(0);

    /// Allocation bit of subcluster `i`.
    pub fn allocated(&self, i: u64) -> bool {
        (self.0 >> i) & 1 != 0
    }
    /// Reads-as-zero bit of subcluster `i`.
    pub fn zero(&self, i: u64) -> bool {
        (self.0 >> (32 + i)) & 1 != 0
    }
    /// Whether subclusters `first..=last` (`first <= last < 32`) are all allocated data:
    /// allocation bits set, reads-as-zero bits clear.
    #[inline]
    pub fn all_data(&self, first: u64, last: u64) -> bool {
        let m = (u32::MAX >> (31 - last)) & (u32::MAX << first);
        let (alloc, zero) = (self.0 as u32, (self.0 >> 32) as u32);
        alloc & m == m && zero & m == 0
    }
    /// Bitmap with the given allocation and zero masks.
    pub fn new(alloc: u32, zero: u32) -> SubclusterBitmap {
        SubclusterBitmap(u64::from(alloc) | (u64::from(zero) << 32))
    }
    /// The allocation mask: bit `i` set when subcluster `i` is allocated.
    #[inline]
    pub fn alloc_mask(&self) -> u32 {
        self.0 as u32
    }
    /// The reads-as-zero mask: bit `i` set when subcluster `i` reads as zeros.
    #[inline]
    pub fn zero_mask(&self) -> u32 {
        (self.0 >> 32) as u32
    }
}

/// A compressed cluster's location.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompressedDescriptor {
    /// First byte of the compressed stream.
    pub offset: HostOffset,
    /// Bytes from `offset` to the end of the last 512-byte sector used.
    pub len: u64,
}

impl CompressedDescriptor {
    /// The 512-byte sectors the compressed stream occupies (what freeing the cluster gives
    /// back).
    pub fn sectors(&self) -> HostRange {
        let start = self.offset.0 & !511;
        HostRange::new(
            HostOffset(start),
            (self.offset.0 + self.len).div_ceil(512) * 512 - start,
        )
    }
}

/// What an L2 entry says about one cluster (or, with extended L2, one subcluster).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterMapping {
    /// Not allocated here: read from the backing image, or zeros without one. `host` is
    /// set when the cluster is allocated but this subcluster is not (extended L2).
    Unallocated {
        /// Host offset reserved for the subcluster, if any.
        host: Option<HostOffset>,
    },
    /// Reads as zeros (zero flag, or subcluster zero bit). `host` is set when the cluster
    /// stays allocated (preallocated zero cluster).
    Zero {
        /// Host offset of the preallocated (sub)cluster, if any.
        host: Option<HostOffset>,
    },
    /// Data at `host` (the host offset of the start of the cluster / subcluster).
    Data {
        /// Host offset of the (sub)cluster's first byte.
        host: HostOffset,
        /// Whether COPIED is set (refcount 1: writable in place).
        copied: bool,
    },
    /// A compressed cluster.
    Compressed(CompressedDescriptor),
}

/// Image properties needed to interpret L2 entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct L2Context {
    /// log2 of the cluster size.
    pub cluster_bits: u32,
    /// Version 3 (zero flag allowed).
    pub v3: bool,
    /// Extended L2 entries.
    pub extended_l2: bool,
    /// Size of the device holding the image.
    pub device_size: u64,
}

impl ClusterMapping {
    /// Host offset of the (sub)cluster, when the entry names one (data, preallocated zero,
    /// allocated-but-unused subcluster). Compressed clusters report none.
    pub fn host(&self) -> Option<HostOffset> {
        match *self {
            ClusterMapping::Data { host, .. } => Some(host),
            ClusterMapping::Zero { host } | ClusterMapping::Unallocated { host } => host,
            ClusterMapping::Compressed(_) => None,
        }
    }

    /// Whether `next`, starting `delta` bytes after `self`, extends the same extent: the same
    /// kind, and host offsets either both absent or contiguous.
    pub fn continues_with(&self, next: &ClusterMapping, delta: u64) -> bool {
        let same_kind = matches!(
            (self, next),
            (ClusterMapping::Data { .. }, ClusterMapping::Data { .. })
                | (ClusterMapping::Zero { .. }, ClusterMapping::Zero { .. })
                | (
                    ClusterMapping::Unallocated { .. },
                    ClusterMapping::Unallocated { .. }
                )
        );
        same_kind
            && match (self.host(), next.host()) {
                (None, None) => true,
                (Some(a), Some(b)) => a.0.checked_add(delta) == Some(b.0),
                _ => false,
            }
    }
}

impl L2Entry {
    /// The entry of an unallocated cluster (reads from the backing image, or zeros).
    pub const UNALLOCATED: L2Entry = L2Entry(0);
    /// The entry of a cluster that reads as zeros without host space (version 3).
    pub const ZERO: L2Entry = L2Entry(ZERO);

    /// A data cluster at `host` with COPIED set (refcount 1: writable in place).
    #[inline]
    pub fn copied_data(host: HostOffset) -> L2Entry {
        L2Entry(host.0 | COPIED)
    }
    /// A preallocated zero cluster at `host` with COPIED set: reads as zeros, keeps its
    /// host cluster.
    #[inline]
    pub fn copied_zero(host: HostOffset) -> L2Entry {
        L2Entry(host.0 | COPIED | ZERO)
    }
    /// This entry with its zero flag cleared and COPIED and the host offset `host` set:
    /// a preallocated zero cluster at `host` once its data is written.
    #[inline]
    pub fn written_at(self, host: HostOffset) -> L2Entry {
        L2Entry((self.0 & !ZERO) | COPIED | host.0)
    }
    /// The host offset bits of a standard entry, unvalidated (0: no host cluster).
    pub fn host_bits(&self) -> u64 {
        self.0 & OFFSET_MASK
    }
    /// Whether this is a compressed descriptor.
    pub fn is_compressed(&self) -> bool {
        self.0 & COMPRESSED != 0
    }
    /// Whether COPIED is set.
    pub fn is_copied(&self) -> bool {
        self.0 & COPIED != 0
    }
    /// Decodes a compressed descriptor (bit 62 must be set).
    pub fn compressed(&self, cluster_bits: u32, device_size: u64) -> Result<CompressedDescriptor> {
        let v = self.0;
        // x = 62 - (cluster_bits - 8): bits 0..x are the offset, x..62 the extra sectors.
        let x = 62 - (cluster_bits - 8);
        let offset = v & ((1u64 << x) - 1);
        let sectors = ((v & !(COPIED | COMPRESSED)) >> x) + 1;
        if v & COPIED != 0 {
            return Err(corrupt(
                Field::CompressedDescriptor,
                v,
                "COPIED set on a compressed cluster",
            ));
        }
        if offset == 0 {
            return Err(corrupt(
                Field::CompressedDescriptor,
                v,
                "compressed data at offset 0",
            ));
        }
        let len = sectors * 512 - (offset & 511);
        if offset
            .checked_add(len)
            .is_none_or(|e| e > device_size.div_ceil(512).saturating_mul(512))
        {
            return Err(corrupt(
                Field::CompressedDescriptor,
                v,
                "compressed data extends past the end of the device",
            ));
        }
        Ok(CompressedDescriptor {
            offset: HostOffset(offset),
            len,
        })
    }

    /// The common case of [`mapping`](Self::mapping) without building an error: a valid
    /// standard data entry (allocated, not compressed, no zero flag, no reserved bits,
    /// aligned, inside the device) gives `Some((host, copied))`; anything else `None`, and
    /// the caller falls back to `mapping`, which validates and explains.
    #[inline]
    pub fn plain_data(&self, cluster_bits: u32, device_size: u64) -> Option<(u64, bool)> {
        let v = self.0;
        let off = v & OFFSET_MASK;
        let cs = 1u64 << cluster_bits;
        if v & (COMPRESSED | ZERO | L2_RESERVED) != 0
            || off == 0
            || off & (cs - 1) != 0
            || off.checked_add(cs).is_none_or(|e| e > device_size)
        {
            return None;
        }
        Some((off, v & COPIED != 0))
    }

    /// What this entry (with `bitmap` when `extended`) lets a core overwrite in place, by
    /// its bits alone: the host offset and the mask of subclusters (all 32 bits for a
    /// standard entry) that are COPIED plain data; `None` when nothing (unallocated, zero,
    /// compressed, shared, reserved bits). The device's bounds are the reader's to check.
    #[inline]
    pub fn in_place(&self, bitmap: SubclusterBitmap, extended: bool) -> Option<(u64, u32)> {
        let v = self.0;
        let off = v & OFFSET_MASK;
        if v & (COMPRESSED | ZERO | L2_RESERVED) != 0 || v & COPIED == 0 || off == 0 {
            return None;
        }
        let mask = match extended {
            true => bitmap.alloc_mask() & !bitmap.zero_mask(),
            false => u32::MAX,
        };
        (mask != 0).then_some((off, mask))
    }

    /// Whether changing an entry from `old` to `new` (entry and bitmap, `extended` as in
    /// [`in_place`](Self::in_place)) only adds: every subcluster `old` lets a core
    /// overwrite in place, `new` lets it overwrite at the same host offset. The owner counts
    /// any other change as a removal (ARCHITECTURE.md §6).
    pub fn change_only_adds(
        old: (L2Entry, SubclusterBitmap),
        new: (L2Entry, SubclusterBitmap),
        extended: bool,
    ) -> bool {
        match old.0.in_place(old.1, extended) {
            None => true,
            Some((host, mask)) => new
                .0
                .in_place(new.1, extended)
                .is_some_and(|(h, m)| h == host && m & mask == mask),
        }
    }

    /// Interprets a standard L2 entry for the whole cluster (no extended L2), validated (see
    /// [`plain_data`](Self::plain_data) for the hot path).
    pub fn mapping(&self, ctx: &L2Context) -> Result<ClusterMapping> {
        let v = self.0;
        if self.is_compressed() {
            return Ok(ClusterMapping::Compressed(
                self.compressed(ctx.cluster_bits, ctx.device_size)?,
            ));
        }
        if v & L2_RESERVED != 0 {
            return Err(corrupt(Field::L2Entry, v, "reserved bits set"));
        }
        let zero = v & ZERO != 0;
        if zero && !ctx.v3 {
            return Err(corrupt(Field::L2Entry, v, "zero flag in a version 2 image"));
        }
        let off = v & OFFSET_MASK;
        let cs = 1u64 << ctx.cluster_bits;
        if off == 0 {
            if v & COPIED != 0 {
                return Err(corrupt(Field::L2Entry, v, "offset 0 with COPIED set"));
            }
            return Ok(if zero {
                ClusterMapping::Zero { host: None }
            } else {
                ClusterMapping::Unallocated { host: None }
            });
        }
        check_data_cluster(v, off, cs, ctx.device_size)?;
        if zero {
            // Preallocated zero cluster: reads as zeros.
            return Ok(ClusterMapping::Zero {
                host: Some(HostOffset(off)),
            });
        }
        Ok(ClusterMapping::Data {
            host: HostOffset(off),
            copied: v & COPIED != 0,
        })
    }

    /// Interprets an extended L2 entry for subcluster `sc` (0..32).
    pub fn subcluster_mapping(
        &self,
        bitmap: SubclusterBitmap,
        sc: u64,
        ctx: &L2Context,
    ) -> Result<ClusterMapping> {
        let v = self.0;
        if self.is_compressed() {
            // The whole cluster is compressed; its bitmap is reserved and must be 0 (QEMU's
            // check calls anything else corruption).
            if bitmap.0 != 0 {
                return Err(corrupt(
                    Field::SubclusterBitmap,
                    bitmap.0,
                    "nonzero subcluster bitmap in a compressed cluster",
                ));
            }
            return Ok(ClusterMapping::Compressed(
                self.compressed(ctx.cluster_bits, ctx.device_size)?,
            ));
        }
        // With extended L2 the zero flag (bit 0) is reserved too.
        if v & (L2_RESERVED | ZERO) != 0 {
            return Err(corrupt(Field::L2Entry, v, "reserved bits set"));
        }
        let alloc_mask = bitmap.0 as u32;
        let zero_mask = (bitmap.0 >> 32) as u32;
        if alloc_mask & zero_mask != 0 {
            return Err(corrupt(
                Field::SubclusterBitmap,
                bitmap.0,
                "subcluster both allocated and zero",
            ));
        }
        let off = v & OFFSET_MASK;
        let cs = 1u64 << ctx.cluster_bits;
        if off == 0 {
            if v & COPIED != 0 {
                return Err(corrupt(Field::L2Entry, v, "offset 0 with COPIED set"));
            }
            if alloc_mask != 0 {
                return Err(corrupt(
                    Field::SubclusterBitmap,
                    bitmap.0,
                    "allocated subclusters in an unallocated cluster",
                ));
            }
        } else {
            check_data_cluster(v, off, cs, ctx.device_size)?;
        }
        let host = (off != 0).then(|| HostOffset(off + sc * (cs / SUBCLUSTERS)));
        Ok(if bitmap.zero(sc) {
            ClusterMapping::Zero { host }
        } else if let (true, Some(host)) = (bitmap.allocated(sc), host) {
            ClusterMapping::Data {
                host,
                copied: v & COPIED != 0,
            }
        } else {
            ClusterMapping::Unallocated { host }
        })
    }
}

/// A cached L2 slice summarised: whether entry `i` is `first + i * cluster_size` for every
/// `i` — plain data clusters, COPIED, at consecutive host offsets, as in images written
/// front to back (`qemu-img convert`, preallocation, a sequential fill) — and, with
/// extended L2, every subcluster allocated data (bitmap [`FULL_BITMAP`]). Then a look-up
/// computes the mapping from the summary instead of loading the entry, whose cache line
/// random I/O over a large image finds cold (the dominant cost of a cache-hit look-up on a
/// busy core). Kept in step entry by entry: `mismatches` counts the entries other than the
/// first, and the bitmaps, that break the pattern.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinearSlice {
    /// Entry 0 when it is a plain COPIED data entry whose run of `len` clusters stays
    /// inside the offset field; 0 otherwise (never linear).
    first: u64,
    /// Entries `1..len` that are not `first + i * cluster_size`.
    mismatches: u32,
}

/// The subcluster bitmap of a cluster allocated whole: every subcluster data, none zero.
pub const FULL_BITMAP: u64 = u32::MAX as u64;

impl LinearSlice {
    /// Summarises a slice's words: entries, or with `extended` (entry, bitmap) pairs.
    pub fn of(words: &[u64], cluster_bits: u32, extended: bool) -> Self {
        let step = if extended { 2 } else { 1 };
        let Some(&e0) = words.first() else {
            return Self::default();
        };
        let n = words.len() / step;
        let first = Self::head(e0, n, cluster_bits);
        if !extended {
            // (The common case, in a form the compiler vectorises: a core summarises every
            // copy of a slice it takes.)
            let mismatches = words
                .iter()
                .enumerate()
                .skip(1)
                .filter(|&(i, &w)| w != Self::predict(first, i, cluster_bits))
                .count();
            return LinearSlice {
                first,
                mismatches: mismatches as u32,
            };
        }
        let mut mismatches = 0u32;
        for (i, w) in words.chunks_exact(step).enumerate() {
            if i > 0 {
                mismatches += u32::from(w[0] != Self::predict(first, i, cluster_bits));
            }
            if extended {
                mismatches += u32::from(w[1] != FULL_BITMAP);
            }
        }
        LinearSlice { first, mismatches }
    }

    /// Entry 0 if it can start a linear run of `len` clusters, else 0.
    fn head(e0: u64, len: usize, cluster_bits: u32) -> u64 {
        let off = e0 & OFFSET_MASK;
        let span = (len as u64).checked_shl(cluster_bits).unwrap_or(u64::MAX);
        let fits = off
            .checked_add(span)
            .is_some_and(|end| end <= OFFSET_MASK + 1);
        let plain = L2Entry(e0).plain_data(cluster_bits, u64::MAX) == Some((off, true));
        if plain && fits {
            e0
        } else {
            0
        }
    }

    /// Entry `i` of a linear slice starting with `first` (adds inside the offset field:
    /// `head` made sure the run fits).
    #[inline]
    fn predict(first: u64, i: usize, cluster_bits: u32) -> u64 {
        first.wrapping_add((i as u64) << cluster_bits)
    }

    /// Entry `i` of the slice (and its bitmap, with `extended`) changed from `old` to `new`
    /// (entry, bitmap; bitmaps 0 without extended L2); `words` is the slice after the
    /// change (read again only when entry 0 changed).
    pub fn changed(
        &mut self,
        i: usize,
        old: (u64, u64),
        new: (u64, u64),
        words: &[u64],
        cluster_bits: u32,
        extended: bool,
    ) {
        if i == 0 {
            *self = Self::of(words, cluster_bits, extended);
            return;
        }
        let p = Self::predict(self.first, i, cluster_bits);
        let mut m = (self.mismatches + u32::from(new.0 != p)).wrapping_sub(u32::from(old.0 != p));
        if extended {
            m = (m + u32::from(new.1 != FULL_BITMAP)).wrapping_sub(u32::from(old.1 != FULL_BITMAP));
        }
        self.mismatches = m;
    }

    /// The host offset of entry `i` and that it is COPIED, when the slice is linear; the
    /// caller still checks that the cluster lies inside the device.
    #[inline]
    pub fn host(&self, i: u64, cluster_bits: u32) -> Option<u64> {
        (self.first != 0 && self.mismatches == 0)
            .then(|| (self.first & OFFSET_MASK) + (i << cluster_bits))
    }
}

fn check_data_cluster(v: u64, off: u64, cs: u64, device_size: u64) -> Result<()> {
    if !off.is_multiple_of(cs) {
        return Err(corrupt(
            Field::L2Entry,
            v,
            "data cluster offset not aligned to a cluster",
        ));
    }
    if off.checked_add(cs).is_none_or(|e| e > device_size) {
        // QEMU pads the last data cluster only to the written length; tolerate a last cluster
        // that starts inside the device (reads past EOF return zeros like QEMU's file driver).
        if off >= device_size {
            return Err(corrupt(
                Field::L2Entry,
                v,
                "data cluster past the end of the device",
            ));
        }
    }
    Ok(())
}

/// Builds a compressed descriptor for `offset` spanning `len` bytes (`len` at most one
/// cluster, so the sector count fits its field).
pub fn compressed_entry(cluster_bits: u32, offset: u64, len: u64) -> L2Entry {
    let x = 62 - (cluster_bits - 8);
    let end = offset + len;
    let sectors = end.div_ceil(512) - offset / 512;
    debug_assert!(sectors - 1 < 1 << (cluster_bits - 8));
    L2Entry(COMPRESSED | ((sectors - 1) << x) | offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> L2Context {
        L2Context {
            cluster_bits: 16,
            v3: true,
            extended_l2: false,
            device_size: 1 << 30,
        }
    }

    #[test]
    fn all_data_checks_exactly_the_subclusters_asked() {
        let b = SubclusterBitmap::new(0b0111_1110, 1 << 7);
        assert!(b.all_data(1, 6));
        assert!(b.all_data(3, 3));
        assert!(!b.all_data(0, 1), "subcluster 0 unallocated");
        assert!(!b.all_data(6, 7), "subcluster 7 unallocated, reads as zero");
        let full = SubclusterBitmap::new(u32::MAX, 0);
        assert!(full.all_data(0, 31));
        assert!(!SubclusterBitmap::new(u32::MAX, 1 << 31).all_data(0, 31));
        assert!(!SubclusterBitmap::new(u32::MAX >> 1, 0).all_data(31, 31));
    }

    #[test]
    fn standard_entries() {
        let c = ctx();
        assert_eq!(
            L2Entry(0).mapping(&c),
            Ok(ClusterMapping::Unallocated { host: None })
        );
        assert_eq!(
            L2Entry(1).mapping(&c),
            Ok(ClusterMapping::Zero { host: None })
        );
        assert_eq!(
            L2Entry(0x50001).mapping(&c),
            Ok(ClusterMapping::Zero {
                host: Some(HostOffset(0x50000))
            })
        );
        assert_eq!(
            L2Entry(COPIED | 0x50000).mapping(&c),
            Ok(ClusterMapping::Data {
                host: HostOffset(0x50000),
                copied: true
            })
        );
        assert!(matches!(
            L2Entry(0x50200).mapping(&c),
            Err(crate::Error::Corrupt {
                field: Field::L2Entry,
                ..
            })
        ));
        assert!(L2Entry(COPIED).mapping(&c).is_err());
        assert!(L2Entry(1 << 57 | 0x50000).mapping(&c).is_err());
        let v2 = L2Context { v3: false, ..c };
        assert!(L2Entry(1).mapping(&v2).is_err());
        assert!(L2Entry(1 << 40).mapping(&c).is_err());
    }

    #[test]
    fn compressed_roundtrip() {
        for bits in 9..=21u32 {
            let len = 3000.min(1 << bits);
            let e = compressed_entry(bits, 0x12345, len);
            let d = e.compressed(bits, 1 << 30).unwrap();
            assert_eq!(d.offset, HostOffset(0x12345));
            assert!(d.len >= len && d.len < len + 512);
        }
    }

    #[test]
    fn extended_entries() {
        let c = L2Context {
            extended_l2: true,
            ..ctx()
        };
        let e = L2Entry(COPIED | 0x40000);
        let bm = SubclusterBitmap::new(0b101, 0b010);
        assert_eq!(
            e.subcluster_mapping(bm, 2, &c),
            Ok(ClusterMapping::Data {
                host: HostOffset(0x40000 + 2 * 2048),
                copied: true
            })
        );
        assert_eq!(
            e.subcluster_mapping(bm, 1, &c),
            Ok(ClusterMapping::Zero {
                host: Some(HostOffset(0x40000 + 2048))
            })
        );
        assert_eq!(
            e.subcluster_mapping(bm, 3, &c),
            Ok(ClusterMapping::Unallocated {
                host: Some(HostOffset(0x40000 + 3 * 2048))
            })
        );
        assert!(e
            .subcluster_mapping(SubclusterBitmap::new(1, 1), 0, &c)
            .is_err());
        assert!(L2Entry(0)
            .subcluster_mapping(SubclusterBitmap::new(1, 0), 0, &c)
            .is_err());
        assert_eq!(
            L2Entry(0).subcluster_mapping(SubclusterBitmap::new(0, 1), 0, &c),
            Ok(ClusterMapping::Zero { host: None })
        );
        // A compressed cluster is one whole compressed cluster whatever the subcluster;
        // its bitmap is reserved.
        let z = compressed_entry(c.cluster_bits, 0x50000, 3000);
        let d = z.compressed(c.cluster_bits, c.device_size).unwrap();
        for sc in [0, 31] {
            assert_eq!(
                z.subcluster_mapping(SubclusterBitmap(0), sc, &c),
                Ok(ClusterMapping::Compressed(d))
            );
        }
        assert!(z.subcluster_mapping(SubclusterBitmap(1), 0, &c).is_err());
        assert!(z
            .subcluster_mapping(SubclusterBitmap::new(0, 1), 5, &c)
            .is_err());
    }
}
