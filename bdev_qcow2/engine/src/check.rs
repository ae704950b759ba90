//! Consistency check and repair of a qcow2 image, counted the way `qemu-img check` counts.
//!
//! The check works directly on the device (the image is not open otherwise) and trusts
//! nothing but the header: it rebuilds the expected refcount of every host cluster from all
//! references (header, active and snapshot L1 tables, every L2 table they name, data and
//! compressed clusters, the refcount table and blocks, the snapshot table, the bitmap
//! directory, bitmap tables and bitmap data) and compares it with the stored refcounts.
//!
//! The numbers follow QEMU (`block/qcow2-refcount.c`, `block/qcow2-bitmap.c`), so that an
//! operator sees the same counts from both tools:
//! - stored refcount below the number of references: a corruption
//!   (`ERROR cluster N refcount=A reference=B`); above it: a leak (`Leaked cluster …`);
//! - L1/L2 entries with reserved bits or unaligned offsets, references past the end of the
//!   file, refcount table entries that are unaligned, have reserved bits or point outside
//!   the image, refcount blocks whose own refcount is not 1, compressed entries with COPIED,
//!   inconsistent subcluster bitmaps: one corruption each;
//! - a COPIED flag that disagrees with "refcount is exactly 1" on an active L1 entry or on
//!   an active L2 entry (normal or preallocated zero cluster): one corruption each;
//! - refcounts that cannot be read (unaligned refcount block): one check error per cluster.
//!
//! Repair ([`Repair::Leaks`], [`Repair::All`]) rewrites stored refcounts to the expected
//! values. Where a needed refcount block is missing or unusable, a new one is placed past the
//! end of the image (describing itself when it must), and the refcount table is grown into
//! a new table when it is too small. A fixed-size device (a bdev, a block device) cannot
//! grow: there the new structures take clusters no reference uses below its end, and the
//! repair fails with a check error, writing nothing, when there are not enough of them. Writes go in the crash-safe order: refcount blocks,
//! flush, table entries (or new table, flush, header), flush, and only then the old table is
//! freed. QEMU rebuilds the whole refcount structure in the cases where we relocate single
//! blocks; both leave an image that checks clean.
//!
//! Memory is bounded: one `u16` per host cluster up to the end of the file (refused above
//! [`MAX_CHECK_CLUSTERS`]), one L1 table and one L2 table at a time, a few refcount blocks.

use crate::error::{invalid, Error, Field, Result};
use crate::exec::read_bytes;
use crate::exec::{DevId, Exec};
use crate::format::be::{get_u16, get_u32, get_u64};
use crate::format::header::{peek_cluster_bits, PEEK_LEN};
use crate::format::refcount::{entries_per_block, max_refcount};
use crate::format::ImageHeader;
use crate::io::{BlockDevice, SECTOR};
use crate::limits::{MAX_SNAPSHOT_EXTRA_DATA, MAX_SNAPSHOT_TABLE_BYTES};
use std::collections::{BTreeSet, HashMap};

mod placement;
mod references;
mod repair;
mod stored;

/// Most host clusters (file size / cluster size) an image may have for `check`: the
/// in-memory refcount array takes two bytes per cluster (512 MiB at this limit).
pub const MAX_CHECK_CLUSTERS: u64 = 1 << 28;

/// Most messages kept in a [`CheckReport`]; the rest are counted in `messages_dropped`.
pub const MAX_MESSAGES: usize = 100_000;

/// Refcount blocks kept in memory while looking up stored refcounts at random.
const REFBLOCK_CACHE_BLOCKS: usize = 32;

/// What a check may repair (`qemu-img check -r`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Repair {
    /// Report only; the image is not written.
    #[default]
    None,
    /// Lower refcounts of leaked clusters to the number of references.
    Leaks,
    /// Also raise refcounts that are too low (allocating refcount blocks and growing the
    /// refcount table if needed) and correct wrong COPIED flags.
    All,
}

impl Repair {
    fn leaks(self) -> bool {
        self != Repair::None
    }
    fn errors(self) -> bool {
        self == Repair::All
    }
}

/// The result of a check, with the fields of `qemu-img check --output=json`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckReport {
    /// One past the last byte of the last cluster in use (`image-end-offset`).
    pub image_end_offset: u64,
    /// Guest clusters of the virtual disk (`total-clusters`).
    pub total_clusters: u64,
    /// Failures of the check itself: unreadable refcounts, I/O errors (`check-errors`).
    pub check_errors: u64,
    /// Clusters whose refcount is higher than their references (`leaks`).
    pub leaks: u64,
    /// Inconsistencies that may harm data (`corruptions`).
    pub corruptions: u64,
    /// Guest clusters allocated in the active L1 (`allocated-clusters`).
    pub allocated_clusters: u64,
    /// Allocated clusters not contiguous with their predecessor (`fragmented-clusters`).
    pub fragmented_clusters: u64,
    /// Compressed clusters in the active L1 (`compressed-clusters`).
    pub compressed_clusters: u64,
    /// Leaks repaired (`leaks-fixed`).
    pub leaks_fixed: u64,
    /// Corruptions repaired (`corruptions-fixed`).
    pub corruptions_fixed: u64,
    /// What was found, one line each, worded like QEMU's (`ERROR …`, `Leaked …`,
    /// `Repairing …`).
    pub messages: Vec<String>,
    /// Messages left out after [`MAX_MESSAGES`].
    pub messages_dropped: u64,
}

/// Bits 9..=55 of an L1/L2 entry: the host offset.
const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// Reserved bits of an L1 entry (QEMU's `L1E_RESERVED_MASK`).
const L1_RESERVED: u64 = 0x7f00_0000_0000_01ff;
/// Reserved bits of a standard L2 entry (QEMU's `L2E_STD_RESERVED_MASK`).
const L2_STD_RESERVED: u64 = 0x3f00_0000_0000_01fe;
/// Offset bits of a refcount table entry (QEMU's `REFT_OFFSET_MASK`).
const REFT_OFFSET_MASK: u64 = !0x1ff;
/// Reserved bits of a refcount table entry.
const REFT_RESERVED: u64 = 0x1ff;
const COPIED: u64 = 1 << 63;
const COMPRESSED: u64 = 1 << 62;
const ZERO: u64 = 1;
/// Allocation half of an extended L2 subcluster bitmap.
const BITMAP_ALL_ALLOC: u64 = 0xffff_ffff;
/// Zero half of an extended L2 subcluster bitmap.
const BITMAP_ALL_ZERO: u64 = BITMAP_ALL_ALLOC << 32;

/// How QEMU classifies an L2 entry (`qcow2_get_cluster_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClusterType {
    Compressed,
    ZeroPlain,
    ZeroAlloc,
    Normal,
    Unallocated,
}

fn cluster_type(entry: u64, extended_l2: bool) -> ClusterType {
    if entry & COMPRESSED != 0 {
        ClusterType::Compressed
    } else if entry & ZERO != 0 && !extended_l2 {
        if entry & OFFSET_MASK != 0 {
            ClusterType::ZeroAlloc
        } else {
            ClusterType::ZeroPlain
        }
    } else if entry & OFFSET_MASK == 0 {
        ClusterType::Unallocated
    } else {
        ClusterType::Normal
    }
}

/// One internal snapshot's L1 table, as the snapshot table states it.
struct SnapshotL1 {
    id: String,
    name: String,
    l1_offset: u64,
    l1_size: u32,
}

/// Why the scan stopped early: QEMU aborts the check in these cases (exit code 1).
enum Stop {
    /// A check error was counted; the report holds what was found so far.
    Abort,
    /// An engine error (I/O) to count as a check error.
    Engine(Error),
}

impl From<Error> for Stop {
    fn from(e: Error) -> Self {
        Stop::Engine(e)
    }
}

type Step<T = ()> = std::result::Result<T, Stop>;

/// State of one check.
struct Checker<'a, D: BlockDevice> {
    exec: &'a Exec<D>,
    dev: DevId,
    repair: Repair,
    header: ImageHeader,
    file_len: u64,
    cluster_bits: u32,
    cs: u64,
    extended_l2: bool,
    /// L2 entries per table.
    l2_entries: u64,
    refcount_order: u32,
    /// Largest value the in-memory array holds (QEMU's `refcount_max`, capped to u16).
    refcount_max: u16,
    /// Refcount entries per refcount block.
    per_block: u64,
    /// Expected refcount of every host cluster (QEMU's in-memory refcount table).
    imrt: Vec<u16>,
    /// The refcount table as stored (entries, not masked).
    rt: Vec<u64>,
    rt_offset: u64,
    rt_clusters: u64,
    /// The active L1 table as stored.
    l1: Vec<u64>,
    snapshots: Vec<SnapshotL1>,
    snapshots_size: u64,
    /// Refcount table indices whose block must be replaced (QEMU would rebuild).
    bad_blocks: BTreeSet<u64>,
    /// Of those, the ones whose cluster was counted in `imrt` (the refcount-!=-1 case).
    counted_bad_blocks: BTreeSet<u64>,
    /// Whether QEMU would need to rebuild the refcount structure.
    rebuild: bool,
    /// Refcount-structure corruptions a repair of refcounts fixes.
    refcount_corruptions: u64,
    /// Metadata ranges (start, end) for the overlap check before writing an L2 table.
    metadata: Vec<(u64, u64)>,
    /// Refcount blocks read, by host offset.
    block_cache: HashMap<u64, Vec<u8>>,
    report: CheckReport,
}

/// Checks the qcow2 image on `dev` and repairs what `repair` allows.
///
/// Returns the report; its `check_errors` is non-zero when the check could not complete
/// (an I/O error, unreadable refcounts, a broken bitmap directory). Returns an error only
/// when the header itself is unusable (not qcow2, an invalid field, a table outside the
/// device, unsupported features) or the image has more than [`MAX_CHECK_CLUSTERS`] clusters.
pub async fn check<D: BlockDevice>(
    exec: &Exec<D>,
    dev: DevId,
    repair: Repair,
) -> Result<CheckReport> {
    let file_len = exec.device_size(dev);
    if file_len < PEEK_LEN as u64 {
        return Err(invalid(
            Field::HeaderLength,
            file_len,
            "device smaller than a header",
        ));
    }
    let peek = read_bytes(exec, dev, 0, PEEK_LEN as u64).await?;
    let cluster_bits = peek_cluster_bits(&peek)?;
    let c0 = read_bytes(exec, dev, 0, (1u64 << cluster_bits).min(file_len)).await?;
    let header = ImageHeader::decode(&c0, file_len)?;
    let cs = header.cluster_size();
    let nb_clusters = file_len.div_ceil(cs);
    if nb_clusters > MAX_CHECK_CLUSTERS {
        return Err(Error::UnsupportedFeature(format!(
            "check of an image with {nb_clusters} host clusters (at most {MAX_CHECK_CLUSTERS})"
        )));
    }
    let h = &header.header;
    let refcount_order = h.refcount_order;
    let extended_l2 = header.extended_l2();
    let mut c = Checker {
        exec,
        dev,
        repair,
        file_len,
        cluster_bits,
        cs,
        extended_l2,
        l2_entries: cs / if extended_l2 { 16 } else { 8 },
        refcount_order,
        refcount_max: max_refcount(refcount_order).min(u64::from(u16::MAX)) as u16,
        per_block: entries_per_block(cluster_bits, refcount_order),
        imrt: vec![0; nb_clusters as usize],
        rt: Vec::new(),
        rt_offset: h.refcount_table_offset,
        rt_clusters: u64::from(h.refcount_table_clusters),
        l1: Vec::new(),
        snapshots: Vec::new(),
        snapshots_size: 0,
        bad_blocks: BTreeSet::new(),
        counted_bad_blocks: BTreeSet::new(),
        rebuild: false,
        refcount_corruptions: 0,
        metadata: Vec::new(),
        block_cache: HashMap::new(),
        report: CheckReport {
            total_clusters: (h.size / SECTOR * SECTOR).div_ceil(cs),
            ..CheckReport::default()
        },
        header,
    };
    match c.run().await {
        Ok(()) | Err(Stop::Abort) => {}
        Err(Stop::Engine(e)) => {
            // Header-level problems were refused above; what remains is I/O or a table we
            // could not load: the check failed.
            c.report.check_errors += 1;
            c.msg(format!("ERROR: check failed: {e}"));
        }
    }
    Ok(c.report)
}

impl<D: BlockDevice> Checker<'_, D> {
    fn msg(&mut self, m: String) {
        if self.report.messages.len() < MAX_MESSAGES {
            self.report.messages.push(m);
        } else {
            self.report.messages_dropped += 1;
        }
    }

    fn corruption(&mut self, m: String) {
        self.report.corruptions += 1;
        self.msg(m);
    }

    async fn run(&mut self) -> Step {
        self.load_tables().await?;
        self.calculate_refcounts().await?;
        let counts = self.compare_refcounts().await?;
        match self.repair {
            Repair::None => {}
            Repair::Leaks if self.rebuild => {
                self.report.check_errors += 1;
                self.msg("ERROR need to rebuild refcount structures".into());
                return Err(Stop::Abort);
            }
            Repair::Leaks => {
                if counts.leaks > 0 {
                    self.fix_leaks().await?;
                }
            }
            Repair::All => {
                if counts.leaks + counts.errors > 0 || !self.bad_blocks.is_empty() {
                    self.fix_all().await?;
                    // Every stored refcount now equals its reference count.
                    self.report.leaks_fixed += self.report.leaks;
                    self.report.leaks = 0;
                    let fixed = counts.errors + self.refcount_corruptions;
                    self.report.corruptions_fixed += fixed;
                    self.report.corruptions -= fixed.min(self.report.corruptions);
                }
            }
        }
        self.check_oflag_copied().await?;
        if self.repair != Repair::None
            && self.report.check_errors == 0
            && self.report.corruptions == 0
        {
            self.mark_clean().await?;
        }
        Ok(())
    }
}

/// Leaks and refcount errors found by the comparison.
#[derive(Debug, Default, Clone, Copy)]
struct Mismatches {
    leaks: u64,
    errors: u64,
}

fn words(bytes: &[u8]) -> Vec<u64> {
    bytes.chunks_exact(8).map(|c| get_u64(c, 0)).collect()
}

/// Walks `nb` snapshot table entries in `buf`. Returns the snapshots' L1 tables and the
/// table's length, `None` when `buf` ends first, or an error for entries QEMU refuses.
fn walk_snapshots(buf: &[u8], nb: u32) -> Result<Option<(Vec<SnapshotL1>, u64)>> {
    let mut out = Vec::with_capacity(nb.min(1024) as usize);
    let mut off = 0usize;
    for _ in 0..nb {
        off = off.div_ceil(8) * 8;
        if off + 40 > buf.len() {
            return Ok(None);
        }
        let id_len = usize::from(get_u16(buf, off + 12));
        let name_len = usize::from(get_u16(buf, off + 14));
        let extra_len = get_u32(buf, off + 36) as usize;
        if extra_len as u64 > MAX_SNAPSHOT_EXTRA_DATA {
            return Err(invalid(
                Field::SnapshotTable,
                extra_len as u64,
                "snapshot extra_data_size above 1024",
            ));
        }
        let end = off + 40 + extra_len + id_len + name_len;
        if end as u64 > MAX_SNAPSHOT_TABLE_BYTES {
            return Err(invalid(
                Field::SnapshotTable,
                end as u64,
                "snapshot table larger than 64 MiB",
            ));
        }
        if end > buf.len() {
            return Ok(None);
        }
        let id_at = off + 40 + extra_len;
        out.push(SnapshotL1 {
            l1_offset: get_u64(buf, off),
            l1_size: get_u32(buf, off + 8),
            id: String::from_utf8_lossy(&buf[id_at..id_at + id_len]).into_owned(),
            name: String::from_utf8_lossy(&buf[id_at + id_len..end]).into_owned(),
        });
        off = end;
    }
    Ok(Some((out, off as u64)))
}

/// Parses the bitmap directory like QEMU's `bitmap_list_load` (entry layout in
/// `docs/interop/qcow2.rst`: table offset u64, table size u32, flags u32, type u8,
/// granularity bits u8, name size u16, extra data size u32, extra data, name, padding
/// to 8 bytes). Returns each bitmap's table, or why the directory is unusable.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_types() {
        assert_eq!(cluster_type(0, false), ClusterType::Unallocated);
        assert_eq!(cluster_type(1, false), ClusterType::ZeroPlain);
        assert_eq!(cluster_type(0x10001, false), ClusterType::ZeroAlloc);
        assert_eq!(cluster_type(0x10001, true), ClusterType::Normal);
        assert_eq!(cluster_type(COPIED, false), ClusterType::Unallocated);
        assert_eq!(cluster_type(COMPRESSED | 5, false), ClusterType::Compressed);
    }

    #[test]
    fn snapshot_walk_needs_more() {
        let mut e = vec![0u8; 48];
        e[13] = 1; // id_len
        e[40] = b'1';
        assert!(matches!(walk_snapshots(&e[..30], 1), Ok(None)));
        let Ok(Some((s, len))) = walk_snapshots(&e, 1) else {
            panic!("walk failed")
        };
        assert_eq!((s.len(), len, s[0].id.as_str()), (1, 41, "1"));
    }
}
