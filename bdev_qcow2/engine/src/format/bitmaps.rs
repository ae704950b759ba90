//! Persistent bitmaps (QEMU `docs/interop/qcow2.rst`, "Bitmaps"): the bitmap directory,
//! bitmap tables and the size of a bitmap's data. Bytes in, typed values out; no I/O.

use super::be::{get_u16, get_u32, get_u64, put_u32, put_u64};

/// Most entries a bitmap table may have (QEMU's limit).
pub const MAX_TABLE_SIZE: u64 = 0x800_0000;
/// Most bytes of data one bitmap may have (QEMU's limit on its size in memory).
pub const MAX_PHYS_SIZE: u64 = 0x2000_0000;
/// Finest granularity QEMU supports (log2 of bytes per bit).
pub const MIN_GRANULARITY_BITS: u8 = 9;
/// Coarsest granularity QEMU supports.
pub const MAX_GRANULARITY_BITS: u8 = 31;
/// Longest name QEMU supports.
pub const MAX_NAME_SIZE: u16 = 1023;

/// Directory entry flag: the bitmap was not saved correctly and may be inconsistent.
pub const FLAG_IN_USE: u32 = 1;
/// Directory entry flag: the bitmap is enabled (it must record every change of the disk).
pub const FLAG_AUTO: u32 = 2;
/// Flags QEMU refuses: the reserved ones, and extra_data_compatible (it knows no extra
/// data).
const RESERVED_FLAGS: u32 = 0xffff_fffc;

/// Bitmap table entry bits that must be zero.
const TABLE_RESERVED: u64 = 0xff00_0000_0000_01fe;
/// Bitmap table entry: with no offset, the cluster reads as all ones.
pub const TABLE_ALL_ONES: u64 = 1;
/// Bitmap table entry: the host offset bits.
pub const TABLE_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;

/// Bytes of a directory entry before its extra data and name.
const ENTRY_HEAD: usize = 24;

/// One entry of the bitmap directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitmapEntry {
    /// Where the entry starts in the directory (bytes).
    pub pos: usize,
    /// Host offset of the bitmap table.
    pub table_offset: u64,
    /// Entries of the bitmap table.
    pub table_size: u32,
    /// [`FLAG_IN_USE`], [`FLAG_AUTO`].
    pub flags: u32,
    /// log2 of the bytes of the disk one bit stands for.
    pub granularity_bits: u8,
    /// The bitmap's name (lossy UTF-8, for messages).
    pub name: String,
}

impl BitmapEntry {
    /// Whether the bitmap may be inconsistent (its last writer did not save it).
    pub fn in_use(&self) -> bool {
        self.flags & FLAG_IN_USE != 0
    }
    /// Whether the bitmap is enabled: it must record every change of the disk.
    pub fn auto(&self) -> bool {
        self.flags & FLAG_AUTO != 0
    }
    /// Bytes of the disk its table's clusters can describe, for clusters of `cluster_size`.
    pub fn coverage(&self, cluster_size: u64) -> u128 {
        (u128::from(self.table_size) * u128::from(cluster_size) * 8) << self.granularity_bits
    }
}

/// Bytes of data a bitmap of granularity `granularity_bits` has for a disk of
/// `virtual_size` bytes (one bit per granule, the last byte's unused bits zero).
pub fn data_bytes(virtual_size: u64, granularity_bits: u8) -> u64 {
    virtual_size.div_ceil(1u64 << granularity_bits).div_ceil(8)
}

/// Parses the bitmap directory `dir` that the header extension says holds `nb_bitmaps`
/// entries, as QEMU does (`bitmap_list_load`, `check_dir_entry`), for an image of
/// `virtual_size` bytes and clusters of `cluster_size`. An entry QEMU would refuse is an
/// error (it refuses the image then).
pub fn parse_directory(
    dir: &[u8],
    nb_bitmaps: u32,
    cluster_size: u64,
    virtual_size: u64,
) -> Result<Vec<BitmapEntry>, &'static str> {
    let mut out = Vec::new();
    let mut off = 0usize;
    while off < dir.len() {
        if off + ENTRY_HEAD > dir.len() {
            return Err("broken bitmap directory");
        }
        if out.len() as u64 >= u64::from(nb_bitmaps) {
            return Err("more bitmaps found than specified in header extension");
        }
        let table_offset = get_u64(dir, off);
        let table_size = get_u32(dir, off + 8);
        let flags = get_u32(dir, off + 12);
        let ty = dir[off + 16];
        let granularity_bits = dir[off + 17];
        let name_size = get_u16(dir, off + 18);
        let extra = get_u32(dir, off + 20) as usize;
        let next = (off + ENTRY_HEAD + usize::from(name_size) + extra).div_ceil(8) * 8;
        if next > dir.len() {
            return Err("broken bitmap directory");
        }
        if extra != 0 {
            return Err("bitmap extra data is not supported");
        }
        let phys = u64::from(table_size) * cluster_size;
        let entry = BitmapEntry {
            pos: off,
            table_offset,
            table_size,
            flags,
            granularity_bits,
            name: String::from_utf8_lossy(
                &dir[off + ENTRY_HEAD + extra..off + ENTRY_HEAD + extra + usize::from(name_size)],
            )
            .into_owned(),
        };
        let bad = table_size == 0
            || table_offset == 0
            || !table_offset.is_multiple_of(cluster_size)
            || u64::from(table_size) > MAX_TABLE_SIZE
            || !(MIN_GRANULARITY_BITS..=MAX_GRANULARITY_BITS).contains(&granularity_bits)
            || flags & RESERVED_FLAGS != 0
            || name_size > MAX_NAME_SIZE
            || ty != 1
            || phys > MAX_PHYS_SIZE
            || (!entry.in_use() && u128::from(virtual_size) > entry.coverage(cluster_size));
        if bad {
            return Err("a bitmap does not satisfy the constraints");
        }
        out.push(entry);
        off = next;
    }
    if out.len() as u64 != u64::from(nb_bitmaps) {
        return Err("fewer bitmaps found than specified in header extension");
    }
    Ok(out)
}

/// Whether a bitmap table entry is valid (QEMU's `check_table_entry`).
pub fn table_entry_ok(entry: u64, cluster_size: u64) -> bool {
    if entry & TABLE_RESERVED != 0 {
        return false;
    }
    let off = entry & TABLE_OFFSET_MASK;
    off == 0 || (entry & TABLE_ALL_ONES == 0 && off.is_multiple_of(cluster_size))
}

/// Bytes a directory entry for a name of `name_len` bytes takes (no extra data; padded
/// to 8 as QEMU's `calc_dir_entry_size`).
pub fn entry_size(name_len: usize) -> usize {
    (ENTRY_HEAD + name_len).div_ceil(8) * 8
}

/// A directory entry (no extra data) for bitmap `name` of `granularity_bits`, with its
/// table at `table_offset`, `table_size` entries long, and `flags`.
pub fn encode_entry(
    table_offset: u64,
    table_size: u32,
    flags: u32,
    granularity_bits: u8,
    name: &[u8],
) -> Vec<u8> {
    let mut e = vec![0u8; entry_size(name.len())];
    put_u64(&mut e, 0, table_offset);
    put_u32(&mut e, 8, table_size);
    put_u32(&mut e, 12, flags);
    e[16] = 1;
    e[17] = granularity_bits;
    e[18..20].copy_from_slice(&(name.len() as u16).to_be_bytes());
    e[ENTRY_HEAD..ENTRY_HEAD + name.len()].copy_from_slice(name);
    e
}

/// The bytes of entry `e` in directory `dir` (as [`parse_directory`] accepted it: no
/// extra data).
pub fn entry_range(dir: &[u8], e: &BitmapEntry) -> std::ops::Range<usize> {
    let name_size = usize::from(get_u16(dir, e.pos + 18));
    e.pos..e.pos + entry_size(name_size)
}

/// Entry `e` of directory `dir` takes flags `flags`.
pub fn set_flags(dir: &mut [u8], e: &BitmapEntry, flags: u32) {
    put_u32(dir, e.pos + 12, flags);
}

/// Entry `e` of directory `dir` takes the table at `offset`, `size` entries long.
pub fn set_table(dir: &mut [u8], e: &BitmapEntry, offset: u64, size: u32) {
    put_u64(dir, e.pos, offset);
    put_u32(dir, e.pos + 8, size);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory entry for a bitmap named `name`.
    fn entry(table: u64, size: u32, flags: u32, gran: u8, name: &str) -> Vec<u8> {
        encode_entry(table, size, flags, gran, name.as_bytes())
    }

    #[test]
    fn table_entries() {
        assert!(table_entry_ok(0, 65536));
        assert!(table_entry_ok(1, 65536));
        assert!(table_entry_ok(0x20000, 65536));
        assert!(!table_entry_ok(0x20001, 65536));
        assert!(!table_entry_ok(0x20200, 65536));
        assert!(!table_entry_ok(1 << 60, 65536));
    }

    #[test]
    fn directories_parse_and_take_new_flags_and_tables() {
        let cs = 65536;
        let mut dir = entry(0x30000, 1, FLAG_AUTO, 16, "b0");
        dir.extend(entry(0x50000, 1, FLAG_IN_USE, 9, "older one"));
        let e = parse_directory(&dir, 2, cs, 1 << 30).unwrap();
        assert_eq!(e.len(), 2);
        assert_eq!(
            (e[0].pos, e[0].name.as_str(), e[0].auto(), e[0].in_use()),
            (0, "b0", true, false)
        );
        assert_eq!(
            (e[1].pos, e[1].name.as_str(), e[1].auto(), e[1].in_use()),
            (32, "older one", false, true)
        );
        set_flags(&mut dir, &e[0], FLAG_AUTO | FLAG_IN_USE);
        set_table(&mut dir, &e[1], 0x70000, 2);
        let again = parse_directory(&dir, 2, cs, 1 << 30).unwrap();
        assert_eq!(entry_range(&dir, &again[0]), 0..32);
        assert_eq!(entry_range(&dir, &again[1]), 32..72);
        assert_eq!(entry_size(8), 32);
        assert_eq!(entry_size(9), 40);
        assert!(again[0].in_use() && again[0].auto());
        assert_eq!((again[1].table_offset, again[1].table_size), (0x70000, 2));
        assert_eq!(data_bytes(1 << 30, 16), 2048);
        assert_eq!(data_bytes((1 << 30) + 1, 16), 2049);
        assert_eq!(data_bytes(1, 9), 1);
    }

    #[test]
    fn directories_qemu_refuses_are_errors() {
        let cs = 65536;
        let ok = |d: &[u8], n| parse_directory(d, n, cs, 1 << 30);
        assert!(
            ok(&entry(0x30000, 1, FLAG_AUTO, 16, "b"), 2).is_err(),
            "fewer"
        );
        assert!(
            ok(&entry(0x30000, 1, FLAG_AUTO, 16, "b"), 0).is_err(),
            "more"
        );
        assert!(
            ok(&entry(0x30001, 1, 0, 16, "b"), 1).is_err(),
            "unaligned table"
        );
        assert!(ok(&entry(0x30000, 1, 0, 8, "b"), 1).is_err(), "granularity");
        assert!(
            ok(&entry(0x30000, 1, 8, 16, "b"), 1).is_err(),
            "reserved flag"
        );
        // One table cluster at 512-byte granularity covers 256 MiB: too little for 1 GiB,
        // unless the bitmap is in use (its size may be outdated).
        assert!(ok(&entry(0x30000, 1, 0, 9, "b"), 1).is_err(), "too small");
        assert!(ok(&entry(0x30000, 1, FLAG_IN_USE, 9, "b"), 1).is_ok());
        let mut short = entry(0x30000, 1, 0, 16, "b");
        short.truncate(20);
        assert!(ok(&short, 1).is_err(), "broken");
    }
}
