//! Newtype units: guest and host offsets and the cluster geometry that converts between
//! them. Conversions are named methods; no ad-hoc shifts elsewhere.

use std::fmt;

/// A byte offset in the guest's virtual disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct GuestOffset(pub u64);

/// A byte offset in the image file (the base device).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HostOffset(pub u64);

/// A host cluster: its index on the base device (host offset / cluster size).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HostCluster(pub u64);

impl HostCluster {
    /// The host cluster `n` clusters past this one.
    #[inline]
    pub fn plus(self, n: u64) -> HostCluster {
        HostCluster(self.0 + n)
    }
}

impl GuestOffset {
    /// The guest offset `n` bytes past this one.
    #[inline(always)]
    pub fn plus(self, n: u64) -> GuestOffset {
        GuestOffset(self.0 + n)
    }
    /// Bytes from `base` to this offset (`base` is not past it).
    #[inline(always)]
    pub fn since(self, base: GuestOffset) -> u64 {
        self.0 - base.0
    }
}

impl HostOffset {
    /// The host offset `n` bytes past this one.
    #[inline(always)]
    pub fn plus(self, n: u64) -> HostOffset {
        HostOffset(self.0 + n)
    }
}

/// A byte range on the base device: `len` bytes from `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostRange {
    start: HostOffset,
    len: u64,
}

impl HostRange {
    /// `len` bytes from host offset `start`.
    #[inline]
    pub fn new(start: HostOffset, len: u64) -> HostRange {
        HostRange { start, len }
    }
    /// The first byte.
    #[inline]
    pub fn start(&self) -> HostOffset {
        self.start
    }
    /// Length in bytes.
    #[inline]
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the range holds no byte.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The indices of the host clusters of 2^`cluster_bits` bytes the range touches,
    /// partly or whole.
    #[inline]
    pub fn clusters(&self, cluster_bits: u32) -> std::ops::Range<u64> {
        (self.start.0 >> cluster_bits)..(self.start.0 + self.len).div_ceil(1 << cluster_bits)
    }
}

/// A byte range within one cluster, as offsets from the cluster's first byte:
/// `start <= end <= cluster size`. Where the cluster lies, in the guest or on the host, is
/// its owner's business; [`GuestOffset::plus`] and [`HostOffset::plus`] place it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClusterSpan {
    start: u64,
    end: u64,
}

impl ClusterSpan {
    /// Bytes `start..end` of a cluster (`start <= end`).
    #[inline(always)]
    pub fn new(start: u64, end: u64) -> ClusterSpan {
        debug_assert!(start <= end);
        ClusterSpan { start, end }
    }
    /// The whole cluster of `cluster_size` bytes.
    #[inline(always)]
    pub fn whole(cluster_size: u64) -> ClusterSpan {
        ClusterSpan::new(0, cluster_size)
    }
    /// The guest bytes `[a, b)` of the cluster starting at guest offset `cluster`
    /// (`cluster <= a <= b <= cluster + cluster size`).
    #[inline(always)]
    pub fn of_guest(cluster: GuestOffset, a: GuestOffset, b: GuestOffset) -> ClusterSpan {
        ClusterSpan::new(a.since(cluster), b.since(cluster))
    }
    /// First byte, from the cluster's start.
    #[inline(always)]
    pub fn start(&self) -> u64 {
        self.start
    }
    /// End (exclusive), from the cluster's start.
    #[inline(always)]
    pub fn end(&self) -> u64 {
        self.end
    }
    /// Length in bytes.
    #[inline(always)]
    pub fn len(&self) -> u64 {
        self.end - self.start
    }
    /// Whether the span holds no byte.
    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }
    /// The span widened to whole units of `unit` bytes (a power of two dividing the
    /// cluster size: subclusters).
    #[inline(always)]
    pub fn round_out(&self, unit: u64) -> ClusterSpan {
        ClusterSpan::new(self.start / unit * unit, self.end.div_ceil(unit) * unit)
    }
    /// The units of `unit` bytes (subclusters) the span touches, as a mask: bit `i` for
    /// unit `i` (at most 32 units per cluster).
    #[inline(always)]
    pub fn unit_mask(&self, unit: u64) -> u32 {
        (self.start / unit..self.end.div_ceil(unit)).fold(0u32, |m, s| m | (1 << s))
    }
    /// The units of `unit` bytes the span covers whole, as a mask (see
    /// [`unit_mask`](Self::unit_mask); for a span already on unit boundaries).
    #[inline(always)]
    pub fn whole_unit_mask(&self, unit: u64) -> u32 {
        (self.start / unit..self.end / unit).fold(0u32, |m, s| m | (1 << s))
    }
}

impl fmt::Display for HostCluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "host cluster {:#x}", self.0)
    }
}

impl fmt::Display for GuestOffset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "guest {:#x}", self.0)
    }
}

impl fmt::Display for HostOffset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "host {:#x}", self.0)
    }
}

/// Cluster and L2 geometry of one image, derived from the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// log2 of the cluster size (9..=21).
    pub cluster_bits: u32,
    /// The width of its L2 entries.
    width: L2EntryWidth,
    /// log2 of the L2 slice size in bytes (9..=cluster_bits).
    pub slice_bits: u32,
    /// [`slice_coverage_bits`](Self::slice_coverage_bits), computed once by
    /// [`new`](Self::new): every request's slice look-up shifts by it.
    coverage_bits: u32,
    /// [`slice_coverage`](Self::slice_coverage) minus 1, computed once too: the offset of a
    /// guest byte within its slice is one mask.
    coverage_mask: u64,
}

/// The width of an image's L2 entries (the `extended_l2` incompatible feature).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L2EntryWidth {
    /// 64-bit entries, one per cluster.
    Standard,
    /// 128-bit extended entries: the mapping and a bitmap of 32 subclusters.
    Extended,
}

/// Number of subclusters per cluster with extended L2 entries.
pub const SUBCLUSTERS: u64 = 32;

impl Geometry {
    /// The geometry of clusters of 2^`cluster_bits` bytes, with L2 entries of `width`,
    /// cached in slices of 2^`slice_bits` bytes.
    pub fn new(cluster_bits: u32, width: L2EntryWidth, slice_bits: u32) -> Self {
        let coverage_bits = cluster_bits + slice_bits
            - if width == L2EntryWidth::Extended {
                4
            } else {
                3
            };
        Geometry {
            cluster_bits,
            width,
            slice_bits,
            coverage_bits,
            coverage_mask: (1 << coverage_bits) - 1,
        }
    }
    /// The width of the image's L2 entries.
    #[inline]
    pub fn l2_entry_width(&self) -> L2EntryWidth {
        self.width
    }
    /// Whether L2 entries are 128-bit extended entries (32 subclusters each).
    #[inline]
    pub fn extended_l2(&self) -> bool {
        self.width == L2EntryWidth::Extended
    }
    /// Cluster size in bytes.
    #[inline]
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }
    /// Bytes per L2 entry (8, or 16 with extended L2).
    #[inline]
    pub fn l2_entry_bytes(&self) -> u64 {
        if self.extended_l2() {
            16
        } else {
            8
        }
    }
    /// log2 of the number of L2 entries in one L2 table (one cluster).
    #[inline]
    pub fn l2_bits(&self) -> u32 {
        self.cluster_bits - if self.extended_l2() { 4 } else { 3 }
    }
    /// Entries per L2 table.
    #[inline]
    pub fn l2_entries(&self) -> u64 {
        1 << self.l2_bits()
    }
    /// Guest bytes covered by one L1 entry (one whole L2 table).
    #[inline]
    pub fn l1_entry_coverage(&self) -> u64 {
        1 << (self.cluster_bits + self.l2_bits())
    }
    /// L2 entries per slice.
    #[inline]
    pub fn slice_entries(&self) -> u64 {
        (1 << self.slice_bits) / self.l2_entry_bytes()
    }
    /// Slices per L2 table.
    #[inline]
    pub fn slices_per_l2(&self) -> u64 {
        1 << (self.cluster_bits - self.slice_bits)
    }
    /// Subcluster size in bytes (the cluster size without extended L2).
    #[inline]
    pub fn subcluster_size(&self) -> u64 {
        if self.extended_l2() {
            self.cluster_size() / SUBCLUSTERS
        } else {
            self.cluster_size()
        }
    }
    /// Guest cluster index of a guest offset.
    #[inline]
    pub fn guest_cluster(&self, off: GuestOffset) -> u64 {
        off.0 >> self.cluster_bits
    }
    /// Offset within its cluster.
    #[inline]
    pub fn offset_in_cluster(&self, off: u64) -> u64 {
        off & (self.cluster_size() - 1)
    }
    /// L1 index covering a guest offset.
    #[inline]
    pub fn l1_index(&self, off: GuestOffset) -> u64 {
        off.0 >> (self.cluster_bits + self.l2_bits())
    }
    /// L2 index (within its table) of a guest offset.
    #[inline]
    pub fn l2_index(&self, off: GuestOffset) -> u64 {
        self.guest_cluster(off) & (self.l2_entries() - 1)
    }
    /// Global slice id of a guest offset: dense over the image, used as the cache key.
    #[inline]
    pub fn slice_id(&self, off: GuestOffset) -> u64 {
        off.0 >> self.slice_coverage_bits()
    }
    /// Index within its slice of the L2 entry for a guest offset.
    #[inline]
    pub fn index_in_slice(&self, off: GuestOffset) -> u64 {
        self.guest_cluster(off) & (self.slice_entries() - 1)
    }
    /// Which slice of its L2 table holds a guest offset's entry.
    #[inline]
    pub fn slice_in_l2(&self, off: GuestOffset) -> u64 {
        self.l2_index(off) / self.slice_entries()
    }
    /// Host offset of the slice holding `off`'s entry, given its L2 table's offset.
    #[inline]
    pub fn slice_host_offset(&self, l2_table: HostOffset, off: GuestOffset) -> HostOffset {
        HostOffset(l2_table.0 + (self.slice_in_l2(off) << self.slice_bits))
    }
    /// Guest bytes covered by one slice.
    #[inline]
    pub fn slice_coverage(&self) -> u64 {
        self.coverage_mask + 1
    }
    /// Offset of a guest byte within its slice.
    #[inline]
    pub fn within_slice(&self, off: GuestOffset) -> u64 {
        off.0 & self.coverage_mask
    }
    /// The slice of a non-empty range of `len` bytes at `off` that lies inside one slice,
    /// and the range's offset within it (the memo's look-up: one function, its fields read
    /// directly).
    #[inline(always)]
    pub fn in_one_slice(&self, off: u64, len: u64) -> Option<(u64, u64)> {
        let within = off & self.coverage_mask;
        (len != 0 && within + len <= self.coverage_mask + 1)
            .then_some((off >> self.coverage_bits, within))
    }
    /// log2 of [`slice_coverage`](Self::slice_coverage): a slice holds
    /// 2^(slice_bits - log2(entry bytes)) entries of one cluster each.
    #[inline]
    pub fn slice_coverage_bits(&self) -> u32 {
        self.coverage_bits
    }
    /// The host offset where host cluster `c` starts.
    #[inline]
    pub fn host_cluster_offset(&self, c: HostCluster) -> HostOffset {
        HostOffset(c.0 << self.cluster_bits)
    }
    /// The host cluster holding host offset `off`.
    #[inline]
    pub fn host_cluster(&self, off: HostOffset) -> HostCluster {
        HostCluster(off.0 >> self.cluster_bits)
    }
    /// Number of L1 entries needed to address `size` guest bytes.
    #[inline]
    pub fn l1_entries_for(&self, size: u64) -> u64 {
        size.div_ceil(self.l1_entry_coverage())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_64k() {
        let g = Geometry::new(16, L2EntryWidth::Standard, 12);
        assert_eq!(g.l2_entries(), 8192);
        assert_eq!(g.slice_entries(), 512);
        assert_eq!(g.slices_per_l2(), 16);
        assert_eq!(g.l1_entry_coverage(), 512 << 20);
        let off = GuestOffset((512 << 20) + 3 * 65536 * 512 + 7 * 65536 + 5);
        assert_eq!(g.l1_index(off), 1);
        assert_eq!(g.slice_in_l2(off), 3);
        assert_eq!(g.index_in_slice(off), 7);
        assert_eq!(g.slice_id(off), 16 + 3);
        assert_eq!(
            g.slice_host_offset(HostOffset(1 << 20), off),
            HostOffset((1 << 20) + 3 * 4096)
        );
    }

    #[test]
    fn host_clusters_and_offsets() {
        let g = Geometry::new(16, L2EntryWidth::Standard, 12);
        assert_eq!(g.host_cluster_offset(HostCluster(3)), HostOffset(3 << 16));
        assert_eq!(g.host_cluster(HostOffset((3 << 16) + 5)), HostCluster(3));
        assert_eq!(HostCluster(3).plus(2), HostCluster(5));
    }

    #[test]
    fn cluster_spans() {
        let s = ClusterSpan::of_guest(
            GuestOffset(0x10000),
            GuestOffset(0x10a00),
            GuestOffset(0x11200),
        );
        assert_eq!((s.start(), s.end(), s.len()), (0xa00, 0x1200, 0x800));
        assert_eq!(s.round_out(0x800), ClusterSpan::new(0x800, 0x1800));
        assert_eq!(s.unit_mask(0x800), 0b110);
        assert_eq!(ClusterSpan::new(0x800, 0x1400).whole_unit_mask(0x800), 0b10);
        assert_eq!(
            ClusterSpan::whole(1 << 16).whole_unit_mask(1 << 11),
            u32::MAX
        );
        assert_eq!(GuestOffset(5).plus(3).since(GuestOffset(2)), 6);
        assert_eq!(HostOffset(5).plus(3), HostOffset(8));
        let r = HostRange::new(HostOffset(0x1fe00), 0x10400);
        assert_eq!((r.start(), r.len()), (HostOffset(0x1fe00), 0x10400));
        assert_eq!(r.clusters(16), 1..4);
    }

    #[test]
    fn geometry_extended() {
        let g = Geometry::new(16, L2EntryWidth::Extended, 12);
        assert_eq!(g.l2_entries(), 4096);
        assert_eq!(g.slice_entries(), 256);
        assert_eq!(g.subcluster_size(), 2048);
    }

    #[test]
    fn slice_coverage_bits_match_the_entry_arithmetic() {
        for cluster_bits in 9..=21 {
            for slice_bits in 9..=cluster_bits {
                for width in [L2EntryWidth::Standard, L2EntryWidth::Extended] {
                    let g = Geometry::new(cluster_bits, width, slice_bits);
                    assert_eq!(g.slice_coverage(), g.slice_entries() << cluster_bits);
                    for off in [0, 1, (1 << 40) + 12345, u64::MAX >> 3] {
                        let off = GuestOffset(off);
                        assert_eq!(g.slice_id(off), g.guest_cluster(off) / g.slice_entries());
                        assert_eq!(g.within_slice(off), off.0 % g.slice_coverage());
                    }
                }
            }
        }
    }
}
