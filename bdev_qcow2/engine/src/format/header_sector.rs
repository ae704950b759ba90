//! Changing header bytes in place: the fields a writer changes after creation (feature
//! bits, the virtual size, the refcount table's and the L1 table's place, the snapshot
//! table's place and count, the zeroed tail's offset), each
//! encoded at the offset the qcow2 specification gives it, and nowhere else.
//!
//! [`HeaderPatch`] is one such change (bytes and where they go), for a writer that patches
//! the device directly; [`HeaderSector`] is the first sector of an image kept in memory and
//! changed only through its setters, which apply those patches.

use super::be::{get_u32, get_u64, put_u32, put_u64};
use super::header::{ext_type, incompat, ZeroedTail};
use crate::io::SECTOR;

mod bitmaps_ext;
pub use bitmaps_ext::NO_ROOM as NO_ROOM_FOR_BITMAPS;

/// Offsets of the header fields changed in place (qcow2 specification, "Header").
pub mod offset {
    /// `version` (u32).
    pub const VERSION: usize = 4;
    /// `size` (u64): the virtual disk size.
    pub const SIZE: usize = 24;
    /// `l1_size` (u32), followed by `l1_table_offset` (u64).
    pub const L1_SIZE: usize = 36;
    /// `l1_table_offset` (u64).
    pub const L1_TABLE_OFFSET: usize = 40;
    /// `refcount_table_offset` (u64), followed by `refcount_table_clusters` (u32).
    pub const REFCOUNT_TABLE_OFFSET: usize = 48;
    /// `refcount_table_clusters` (u32).
    pub const REFCOUNT_TABLE_CLUSTERS: usize = 56;
    /// `nb_snapshots` (u32), followed by `snapshots_offset` (u64).
    pub const NB_SNAPSHOTS: usize = 60;
    /// `incompatible_features` (u64; version 3).
    pub const INCOMPATIBLE_FEATURES: usize = 72;
    /// `autoclear_features` (u64; version 3).
    pub const AUTOCLEAR_FEATURES: usize = 88;
}

/// Bytes to write at a header offset: one field, or two adjacent ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeaderPatch {
    at: usize,
    buf: [u8; 12],
    len: usize,
}

impl HeaderPatch {
    /// `incompatible_features` = `v` (a version 3 header's).
    pub fn incompatible_features(v: u64) -> Self {
        Self::u64_at(offset::INCOMPATIBLE_FEATURES, v)
    }
    /// `autoclear_features` = `v` (a version 3 header's).
    pub fn autoclear_features(v: u64) -> Self {
        Self::u64_at(offset::AUTOCLEAR_FEATURES, v)
    }
    /// `refcount_table_offset` = `offset`, `refcount_table_clusters` = `clusters`: one
    /// patch, so the two change together.
    pub fn refcount_table(table_offset: u64, clusters: u32) -> Self {
        let mut buf = [0u8; 12];
        put_u64(&mut buf, 0, table_offset);
        put_u32(&mut buf, 8, clusters);
        HeaderPatch {
            at: offset::REFCOUNT_TABLE_OFFSET,
            buf,
            len: 12,
        }
    }
    /// `l1_size` = `size`, `l1_table_offset` = `table_offset`: one patch.
    pub fn l1_table(table_offset: u64, size: u32) -> Self {
        let mut buf = [0u8; 12];
        put_u32(&mut buf, 0, size);
        put_u64(&mut buf, 4, table_offset);
        HeaderPatch {
            at: offset::L1_SIZE,
            buf,
            len: 12,
        }
    }
    /// `size` = `bytes` (the virtual disk size).
    pub fn size(bytes: u64) -> Self {
        Self::u64_at(offset::SIZE, bytes)
    }
    /// `nb_snapshots` = `count`, `snapshots_offset` = `table_offset`: one patch.
    pub fn snapshot_table(table_offset: u64, count: u32) -> Self {
        let mut buf = [0u8; 12];
        put_u32(&mut buf, 0, count);
        put_u64(&mut buf, 4, table_offset);
        HeaderPatch {
            at: offset::NB_SNAPSHOTS,
            buf,
            len: 12,
        }
    }
    /// The zeroed tail's offset = `tail.from`, where its extension records it (`tail.at`).
    pub fn zeroed_tail(tail: ZeroedTail) -> Self {
        Self::u64_at(tail.at as usize, tail.from)
    }
    fn u64_at(at: usize, v: u64) -> Self {
        let mut buf = [0u8; 12];
        put_u64(&mut buf, 0, v);
        HeaderPatch { at, buf, len: 8 }
    }
    /// The byte offset in the image where the bytes go.
    pub fn offset(&self) -> u64 {
        self.at as u64
    }
    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

/// The first sector of an image as the owner keeps it: read at open, changed only through
/// the setters below, written whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderSector(Vec<u8>);

impl HeaderSector {
    /// The first sector of cluster 0 `c0` as read (zeros past its end).
    pub fn from_cluster0(c0: &[u8]) -> Self {
        let mut s = vec![0u8; SECTOR as usize];
        let n = c0.len().min(s.len());
        s[..n].copy_from_slice(&c0[..n]);
        HeaderSector(s)
    }
    /// The sector's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
    /// The header's version.
    pub fn version(&self) -> u32 {
        get_u32(&self.0, offset::VERSION)
    }
    /// The incompatible feature bits (0 on a version 2 header, which has none).
    pub fn incompatible_features(&self) -> u64 {
        if self.version() < 3 {
            return 0;
        }
        get_u64(&self.0, offset::INCOMPATIBLE_FEATURES)
    }
    /// Sets the incompatible feature bits to `v`; nothing on a version 2 header (whose
    /// bytes there are not a header field).
    pub fn set_incompatible_features(&mut self, v: u64) {
        if self.version() >= 3 {
            self.apply(HeaderPatch::incompatible_features(v));
        }
    }
    /// Sets the corrupt bit (version 3).
    pub fn set_corrupt(&mut self) {
        self.set_incompatible_features(self.incompatible_features() | incompat::CORRUPT);
    }
    /// Sets or clears the dirty bit (version 3).
    pub fn set_dirty(&mut self, dirty: bool) {
        let v = self.incompatible_features();
        self.set_incompatible_features(if dirty {
            v | incompat::DIRTY
        } else {
            v & !incompat::DIRTY
        });
    }
    /// Sets the autoclear feature bits to `v` (version 3).
    pub fn set_autoclear_features(&mut self, v: u64) {
        if self.version() >= 3 {
            self.apply(HeaderPatch::autoclear_features(v));
        }
    }
    /// Points the header at a refcount table of `clusters` clusters at `table_offset`.
    pub fn set_refcount_table(&mut self, table_offset: u64, clusters: u32) {
        self.apply(HeaderPatch::refcount_table(table_offset, clusters));
    }
    /// Points the header at an L1 table of `size` entries at `table_offset`.
    pub fn set_l1_table(&mut self, table_offset: u64, size: u32) {
        self.apply(HeaderPatch::l1_table(table_offset, size));
    }
    /// Sets the virtual disk size to `bytes`.
    pub fn set_size(&mut self, bytes: u64) {
        self.apply(HeaderPatch::size(bytes));
    }
    /// Points the header at a snapshot table of `count` snapshots at `table_offset`.
    pub fn set_snapshot_table(&mut self, table_offset: u64, count: u32) {
        self.apply(HeaderPatch::snapshot_table(table_offset, count));
    }
    /// Records the zeroed tail's offset `tail.from` where its extension keeps it; returns
    /// false, changing nothing, when that lies outside this sector.
    pub fn set_zeroed_tail(&mut self, tail: ZeroedTail) -> bool {
        if tail.at.saturating_add(8) > SECTOR {
            return false;
        }
        self.apply(HeaderPatch::zeroed_tail(tail));
        true
    }
    /// Drops the backing file reference: `backing_file_offset` and `backing_file_size`
    /// become 0, and the backing format extension leaves the extension list when the list
    /// without it ends inside this sector (so that one sector write switches both).
    /// `rest` is cluster 0 past this sector as on disk (the list may run into it). Returns
    /// whether the extension is gone (or there was none); false leaves it in place, where
    /// nothing reads it without a backing file: the list ran past the sector, it was
    /// malformed, or a zeroed tail extension follows it (its recorded place would move).
    pub fn clear_backing(&mut self, rest: &[u8]) -> bool {
        self.0[8..20].fill(0);
        let hl = if self.version() >= 3 {
            get_u32(&self.0, 100) as usize
        } else {
            72
        };
        let mut all = self.0.clone();
        all.extend_from_slice(rest);
        let mut kept = Vec::new();
        let mut found = false;
        let mut off = hl;
        loop {
            if off + 8 > all.len() {
                return false;
            }
            let typ = get_u32(&all, off);
            let len = get_u32(&all, off + 4) as usize;
            if typ == ext_type::END {
                break;
            }
            let next = off + 8 + len.div_ceil(8) * 8;
            if next > all.len() {
                return false;
            }
            if typ == ext_type::BACKING_FORMAT {
                found = true;
            } else {
                if found && typ == ext_type::ZEROED_TAIL {
                    return false;
                }
                kept.extend_from_slice(&all[off..next]);
            }
            off = next;
        }
        if !found {
            return true;
        }
        kept.extend_from_slice(&[0u8; 8]);
        if hl + kept.len() > self.0.len() {
            return false;
        }
        self.0[hl..hl + kept.len()].copy_from_slice(&kept);
        // What followed the list in this sector (the backing file name) is unreferenced now.
        self.0[hl + kept.len()..].fill(0);
        true
    }
    fn apply(&mut self, p: HeaderPatch) {
        self.0[p.at..p.at + p.len].copy_from_slice(p.bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::header::{autoclear, ImageHeader};

    /// A version 3 header of 64 KiB clusters, no extensions (also for `bitmaps_ext`).
    pub(in crate::format::header_sector) fn v3_image_header() -> ImageHeader {
        use crate::format::header::{CompressionType, Extensions, Header, V3_HEADER_LEN};
        ImageHeader {
            header: Header {
                version: 3,
                backing_file_offset: 0,
                backing_file_size: 0,
                cluster_bits: 16,
                size: 1 << 30,
                crypt_method: 0,
                l1_size: 2,
                l1_table_offset: 3 << 16,
                refcount_table_offset: 1 << 16,
                refcount_table_clusters: 1,
                nb_snapshots: 0,
                snapshots_offset: 0,
                incompatible_features: 0,
                compatible_features: 0,
                autoclear_features: 0,
                refcount_order: 4,
                header_length: V3_HEADER_LEN,
                compression_type: CompressionType::Zlib,
                unknown_tail: Vec::new(),
            },
            extensions: Extensions::default(),
            backing_file: None,
        }
    }

    /// A version 3 header of 64 KiB clusters with a zeroed tail extension (its offset
    /// right after the header, as `create` places it).
    fn v3() -> HeaderSector {
        let mut ih = v3_image_header();
        ih.header.autoclear_features = autoclear::ZEROED_TAIL;
        ih.extensions.zeroed_tail = Some(ZeroedTail {
            from: 4 << 16,
            at: u64::from(crate::format::header::V3_HEADER_LEN) + 8,
        });
        HeaderSector::from_cluster0(&ih.encode().expect("encode"))
    }

    fn be64(b: &[u8], at: usize) -> u64 {
        u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
    }
    fn be32(b: &[u8], at: usize) -> u32 {
        u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
    }

    /// Every byte but `range` is as in `before`.
    fn only_changed(before: &HeaderSector, after: &HeaderSector, range: std::ops::Range<usize>) {
        for (i, (a, b)) in before.bytes().iter().zip(after.bytes()).enumerate() {
            if !range.contains(&i) {
                assert_eq!(a, b, "byte {i} changed");
            }
        }
    }

    #[test]
    fn feature_bits_land_at_72_and_88() {
        let before = v3();
        let mut s = before.clone();
        s.set_corrupt();
        assert_eq!(be64(s.bytes(), 72) & incompat::CORRUPT, incompat::CORRUPT);
        s.set_dirty(true);
        assert_eq!(
            be64(s.bytes(), 72),
            be64(before.bytes(), 72) | incompat::CORRUPT | incompat::DIRTY
        );
        s.set_dirty(false);
        assert_eq!(
            be64(s.bytes(), 72),
            be64(before.bytes(), 72) | incompat::CORRUPT
        );
        only_changed(&before, &s, 72..80);
        let mut s = before.clone();
        s.set_autoclear_features(0);
        assert_eq!(be64(s.bytes(), 88), 0);
        assert_ne!(be64(before.bytes(), 88) & autoclear::ZEROED_TAIL, 0);
        only_changed(&before, &s, 88..96);
    }

    #[test]
    fn tables_land_at_36_40_48_56() {
        let before = v3();
        let mut s = before.clone();
        s.set_refcount_table(0x1234_0000, 7);
        assert_eq!(be64(s.bytes(), 48), 0x1234_0000);
        assert_eq!(be32(s.bytes(), 56), 7);
        only_changed(&before, &s, 48..60);
        let mut s = before.clone();
        s.set_l1_table(0x5678_0000, 9);
        assert_eq!(be32(s.bytes(), 36), 9);
        assert_eq!(be64(s.bytes(), 40), 0x5678_0000);
        only_changed(&before, &s, 36..48);
        // Decoded back, the header says the same.
        let mut c0 = s.bytes().to_vec();
        c0.resize(1 << 16, 0);
        let h = ImageHeader::decode(&c0, 1 << 40).expect("decode");
        assert_eq!(
            (h.header.l1_table_offset, h.header.l1_size),
            (0x5678_0000, 9)
        );
    }

    #[test]
    fn size_and_snapshot_table_land_at_24_and_60() {
        let before = v3();
        let mut s = before.clone();
        s.set_size(0x1_2345_6000);
        assert_eq!(be64(s.bytes(), 24), 0x1_2345_6000);
        only_changed(&before, &s, 24..32);
        let mut s = before.clone();
        s.set_snapshot_table(0x9_0000, 3);
        assert_eq!(be32(s.bytes(), 60), 3);
        assert_eq!(be64(s.bytes(), 64), 0x9_0000);
        only_changed(&before, &s, 60..72);
        // Decoded back (no snapshot table to validate), the header says the same.
        let mut s2 = before.clone();
        s2.set_size(1 << 20);
        let mut c0 = s2.bytes().to_vec();
        c0.resize(1 << 16, 0);
        let h = ImageHeader::decode(&c0, 1 << 40).expect("decode");
        assert_eq!(
            (
                h.header.size,
                h.header.nb_snapshots,
                h.header.snapshots_offset
            ),
            (1 << 20, 0, 0)
        );
    }

    #[test]
    fn zeroed_tail_lands_where_its_extension_keeps_it() {
        let before = v3();
        let mut c0 = before.bytes().to_vec();
        c0.resize(1 << 16, 0);
        let z = ImageHeader::decode(&c0, 1 << 40)
            .expect("decode")
            .extensions
            .zeroed_tail
            .expect("tail");
        let mut s = before.clone();
        assert!(s.set_zeroed_tail(ZeroedTail {
            from: 0xabc_0000,
            at: z.at
        }));
        assert_eq!(be64(s.bytes(), z.at as usize), 0xabc_0000);
        only_changed(&before, &s, z.at as usize..z.at as usize + 8);
        assert!(!s.set_zeroed_tail(ZeroedTail {
            from: 1,
            at: SECTOR - 4
        }));
    }

    #[test]
    fn a_version_2_header_keeps_its_bytes_past_72() {
        let mut c0 = v3().bytes().to_vec();
        c0[4..8].copy_from_slice(&2u32.to_be_bytes());
        let before = HeaderSector::from_cluster0(&c0);
        let mut s = before.clone();
        s.set_corrupt();
        s.set_dirty(true);
        s.set_autoclear_features(0);
        assert_eq!(s, before);
        assert_eq!(s.incompatible_features(), 0);
    }

    #[test]
    fn clearing_the_backing_drops_its_name_and_format_extension() {
        use crate::format::header::{Extensions, ImageHeader};
        let mut c0 = v3().bytes().to_vec();
        c0.resize(1 << 16, 0);
        let mut ih = ImageHeader::decode(&c0, 1 << 40).expect("decode");
        ih.backing_file = Some("base.qcow2".into());
        ih.extensions = Extensions {
            backing_format: Some("qcow2".into()),
            // QEMU's table would fill the sector together with our zeroed tail.
            feature_names: Vec::new(),
            ..ih.extensions
        };
        let c0 = ih.encode().expect("encode");
        let before = HeaderSector::from_cluster0(&c0);
        let mut s = before.clone();
        assert!(s.clear_backing(&c0[SECTOR as usize..]));
        let mut after = s.bytes().to_vec();
        after.extend_from_slice(&c0[SECTOR as usize..]);
        let h = ImageHeader::decode(&after, 1 << 40).expect("decode after");
        assert_eq!(h.backing_file, None);
        assert_eq!(h.extensions.backing_format, None);
        assert_eq!(h.extensions.zeroed_tail, ih.extensions.zeroed_tail);
        assert_eq!(h.extensions.feature_names, ih.extensions.feature_names);
        assert_eq!(h.header.l1_table_offset, ih.header.l1_table_offset);
        // A list that does not fit in the sector without the extension keeps it.
        let mut long = ih.clone();
        long.extensions.unknown = vec![(0x1234_5678, vec![7u8; 400])];
        let c0 = long.encode().expect("encode long");
        let mut s = HeaderSector::from_cluster0(&c0);
        assert!(!s.clear_backing(&c0[SECTOR as usize..]));
        let mut after = s.bytes().to_vec();
        after.extend_from_slice(&c0[SECTOR as usize..]);
        let h = ImageHeader::decode(&after, 1 << 40).expect("decode long");
        assert_eq!(h.backing_file, None);
        assert_eq!(h.extensions.unknown, long.extensions.unknown);
    }

    #[test]
    fn patches_carry_the_same_bytes_and_offsets() {
        let p = HeaderPatch::refcount_table(0x10000, 2);
        assert_eq!(p.offset(), 48);
        assert_eq!(p.bytes(), &[0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 2]);
        let p = HeaderPatch::incompatible_features(incompat::DIRTY);
        assert_eq!((p.offset(), p.bytes()), (72, &[0, 0, 0, 0, 0, 0, 0, 1][..]));
        let p = HeaderPatch::autoclear_features(autoclear::ZEROED_TAIL);
        assert_eq!(
            (p.offset(), p.bytes()),
            (88, &[0x80, 0, 0, 0, 0, 0, 0, 0][..])
        );
    }
}
