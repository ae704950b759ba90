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
use crate::format::be::{get_u16, get_u32, get_u64, put_u64};
use crate::format::bitmaps;
use crate::format::header::{autoclear, incompat, peek_cluster_bits, PEEK_LEN};
use crate::format::refcount::{entries_per_block, get_refcount, max_refcount, set_refcount};
use crate::format::{HeaderPatch, ImageHeader};
use crate::io::{BlockDevice, BufSlice, DeviceOp, IoBuffer, SECTOR};
use crate::limits::{MAX_L1_ENTRIES, MAX_SNAPSHOT_EXTRA_DATA, MAX_SNAPSHOT_TABLE_BYTES};
use std::collections::{BTreeSet, HashMap};

mod placement;

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

    /// Reads the active L1 table, the refcount table and the snapshot table, and notes
    /// where the metadata lies (for the overlap check of repairs).
    async fn load_tables(&mut self) -> Step {
        let h = self.header.header.clone();
        let l1 = read_bytes(
            self.exec,
            self.dev,
            h.l1_table_offset,
            u64::from(h.l1_size) * 8,
        )
        .await?;
        self.l1 = words(&l1);
        let rt = read_bytes(
            self.exec,
            self.dev,
            self.rt_offset,
            self.rt_clusters * self.cs,
        )
        .await?;
        self.rt = words(&rt);
        if h.nb_snapshots > 0 {
            self.read_snapshot_table(h.snapshots_offset, h.nb_snapshots)
                .await?;
        }
        let cs = self.cs;
        let mut md = vec![(0, cs)];
        md.push((
            h.l1_table_offset,
            h.l1_table_offset + u64::from(h.l1_size) * 8,
        ));
        md.push((self.rt_offset, self.rt_offset + self.rt_clusters * cs));
        md.push((h.snapshots_offset, h.snapshots_offset + self.snapshots_size));
        for s in &self.snapshots {
            let start = s.l1_offset;
            md.push((start, start.saturating_add(u64::from(s.l1_size) * 8)));
        }
        for e in &self.rt {
            let off = e & REFT_OFFSET_MASK;
            if off != 0 {
                md.push((off, off.saturating_add(cs)));
            }
        }
        if let Some(b) = &self.header.extensions.bitmaps {
            md.push((
                b.directory_offset,
                b.directory_offset.saturating_add(b.directory_size),
            ));
        }
        // Whole clusters, as QEMU's overlap check compares them.
        self.metadata = md
            .into_iter()
            .filter(|(s, e)| e > s)
            .map(|(s, e)| (s & !(cs - 1), e.div_ceil(cs).saturating_mul(cs)))
            .collect();
        Ok(())
    }

    /// Reads the snapshot table leniently: only a table that cannot be walked is an error
    /// (QEMU refuses to open it); snapshot L1 tables are judged later, as corruptions.
    async fn read_snapshot_table(&mut self, offset: u64, nb: u32) -> Step {
        let avail = self.file_len.saturating_sub(offset);
        let mut want = (u64::from(nb) * 64).max(4096);
        loop {
            let len = want.min(avail).min(MAX_SNAPSHOT_TABLE_BYTES);
            let buf = read_bytes(self.exec, self.dev, offset, len).await?;
            match walk_snapshots(&buf, nb)? {
                Some((snaps, size)) => {
                    self.snapshots = snaps;
                    self.snapshots_size = size;
                    return Ok(());
                }
                None if len >= avail || len >= MAX_SNAPSHOT_TABLE_BYTES => {
                    return Err(Stop::Engine(invalid(
                        Field::SnapshotTable,
                        offset,
                        "snapshot table extends past the end of the image",
                    )));
                }
                None => want = want.saturating_mul(2),
            }
        }
    }

    /// Counts one reference to every cluster of `[offset, offset + size)`
    /// (`qcow2_inc_refcounts_imrt`).
    fn inc(&mut self, offset: u64, size: u64) {
        if size == 0 {
            return;
        }
        // The last cluster may be partly past the end of the file; a reference a whole
        // cluster or more past it is a corruption.
        if u128::from(offset) + u128::from(size) >= u128::from(self.file_len) + u128::from(self.cs)
        {
            self.corruption(format!(
                "ERROR: counting reference for region exceeding the end of the file by one \
                 cluster or more: offset {offset:#x} size {size:#x}"
            ));
            return;
        }
        let first = offset >> self.cluster_bits;
        let last = (offset + size - 1) >> self.cluster_bits;
        for k in first..=last {
            let k = k as usize;
            if k >= self.imrt.len() {
                self.imrt.resize(k + 1, 0);
            }
            if self.imrt[k] >= self.refcount_max {
                self.corruption(format!(
                    "ERROR: overflow cluster offset={:#x}",
                    (k as u64) << self.cluster_bits
                ));
                continue;
            }
            self.imrt[k] += 1;
        }
    }

    fn expected(&self, cluster: u64) -> u64 {
        self.imrt.get(cluster as usize).map_or(0, |v| u64::from(*v))
    }

    /// `calculate_refcounts`: every reference, in QEMU's order (the order decides which of
    /// two overlapping refcount blocks is reported).
    async fn calculate_refcounts(&mut self) -> Step {
        let cs = self.cs;
        self.inc(0, cs);
        let (l1_off, l1_size) = (
            self.header.header.l1_table_offset,
            self.header.header.l1_size,
        );
        self.check_l1(l1_off, l1_size, true, None).await?;
        for i in 0..self.snapshots.len() {
            let (l1_offset, l1_size) = (self.snapshots[i].l1_offset, self.snapshots[i].l1_size);
            let label = format!("{} ({})", self.snapshots[i].id, self.snapshots[i].name);
            if !l1_offset.is_multiple_of(cs) {
                self.corruption(format!(
                    "ERROR snapshot {label} l1_offset={l1_offset:#x}: L1 table is not cluster \
                     aligned; snapshot table entry corrupted"
                ));
                continue;
            }
            if u64::from(l1_size) > MAX_L1_ENTRIES {
                self.corruption(format!(
                    "ERROR snapshot {label} l1_size={l1_size:#x}: L1 table is too large; \
                     snapshot table entry corrupted"
                ));
                continue;
            }
            self.check_l1(l1_offset, l1_size, false, None).await?;
        }
        self.inc(self.header.header.snapshots_offset, self.snapshots_size);
        self.inc(self.rt_offset, self.rt_clusters * cs);
        self.check_bitmaps().await?;
        self.check_refblocks();
        Ok(())
    }

    /// `check_refcounts_l1`: counts an L1 table, its L2 tables and their clusters.
    /// `active` counts allocation statistics; `table` passes an L1 already read.
    async fn check_l1(
        &mut self,
        offset: u64,
        size: u32,
        active: bool,
        table: Option<Vec<u64>>,
    ) -> Step {
        if size == 0 {
            return Ok(());
        }
        self.inc(offset, u64::from(size) * 8);
        let l1 = match table {
            Some(t) => t,
            None if active => self.l1.clone(),
            None => words(&read_bytes(self.exec, self.dev, offset, u64::from(size) * 8).await?),
        };
        for (i, &e) in l1.iter().enumerate() {
            if e == 0 {
                continue;
            }
            if e & L1_RESERVED != 0 {
                self.corruption(format!(
                    "ERROR found L1 entry with reserved bits set: {e:x}"
                ));
            }
            let l2_off = e & OFFSET_MASK;
            self.inc(l2_off, self.cs);
            if !l2_off.is_multiple_of(self.cs) {
                self.corruption(format!(
                    "ERROR l2_offset={l2_off:x}: Table is not cluster aligned; L1 entry \
                     corrupted (L1 index {i})"
                ));
            }
            self.check_l2(l2_off, active).await?;
        }
        Ok(())
    }

    /// `check_refcounts_l2`: counts the clusters of one L2 table and checks its entries.
    async fn check_l2(&mut self, l2_off: u64, active: bool) -> Step {
        let raw = read_bytes(self.exec, self.dev, l2_off, self.cs).await?;
        let table = words(&raw);
        let step = if self.extended_l2 { 2 } else { 1 };
        let mut next_contiguous = 0u64;
        for i in 0..self.l2_entries as usize {
            let mut entry = table[i * step];
            let bitmap = if self.extended_l2 {
                table[i * step + 1]
            } else {
                0
            };
            let ty = cluster_type(entry, self.extended_l2);
            if ty != ClusterType::Compressed && entry & L2_STD_RESERVED != 0 {
                self.corruption(format!(
                    "ERROR found l2 entry with reserved bits set: {entry:x}"
                ));
            }
            match ty {
                ClusterType::Compressed => {
                    if entry & COPIED != 0 {
                        let (coffset, _) = self.compressed_range(entry);
                        self.corruption(format!(
                            "ERROR: coffset={coffset:#x}: copied flag must never be set for \
                             compressed clusters"
                        ));
                        entry &= !COPIED;
                    }
                    if bitmap != 0 {
                        self.corruption(format!(
                            "ERROR compressed cluster {i} with non-zero subcluster allocation \
                             bitmap, entry={entry:#x}"
                        ));
                        continue;
                    }
                    let (coffset, csize) = self.compressed_range(entry);
                    self.inc(coffset, csize);
                    if active {
                        self.report.allocated_clusters += 1;
                        self.report.compressed_clusters += 1;
                        // Compressed clusters share sectors: fragmented by nature (QEMU).
                        self.report.fragmented_clusters += 1;
                    }
                }
                ClusterType::ZeroAlloc | ClusterType::Normal => {
                    let offset = entry & OFFSET_MASK;
                    if (bitmap >> 32) & bitmap != 0 {
                        self.corruption(format!(
                            "ERROR offset={offset:x}: Allocated cluster has corrupted \
                             subcluster allocation bitmap"
                        ));
                    }
                    if !offset.is_multiple_of(self.cs) {
                        let contains_data = if self.extended_l2 {
                            bitmap & BITMAP_ALL_ALLOC != 0
                        } else {
                            entry & ZERO == 0
                        };
                        self.report.corruptions += 1;
                        if contains_data {
                            self.msg(format!(
                                "ERROR offset={offset:x}: Data cluster is not properly \
                                 aligned; L2 entry corrupted."
                            ));
                        } else {
                            let fix = self.repair.errors();
                            self.msg(format!(
                                "{} offset={offset:x}: Preallocated cluster is not properly \
                                 aligned; L2 entry corrupted.",
                                if fix { "Repairing" } else { "ERROR" }
                            ));
                            if fix {
                                match self.zero_l2_entry(l2_off, i as u64, bitmap).await? {
                                    ZeroFix::Done => {
                                        self.report.corruptions -= 1;
                                        self.report.corruptions_fixed += 1;
                                        continue;
                                    }
                                    // QEMU stops checking this table.
                                    ZeroFix::Overlap => return Ok(()),
                                }
                            }
                        }
                    }
                    if active {
                        self.report.allocated_clusters += 1;
                        if next_contiguous != 0 && offset != next_contiguous {
                            self.report.fragmented_clusters += 1;
                        }
                        next_contiguous = offset + self.cs;
                    }
                    self.inc(offset, self.cs);
                }
                ClusterType::ZeroPlain => {}
                ClusterType::Unallocated => {
                    if bitmap & BITMAP_ALL_ALLOC != 0 {
                        self.corruption(
                            "ERROR: Unallocated cluster has non-zero subcluster allocation map"
                                .into(),
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Host range a compressed descriptor references: QEMU counts from its offset to the
    /// end of its last 512-byte sector.
    fn compressed_range(&self, entry: u64) -> (u64, u64) {
        let shift = 62 - (self.cluster_bits - 8);
        let offset = entry & ((1u64 << shift) - 1);
        let sectors = ((entry >> shift) & ((1u64 << (self.cluster_bits - 8)) - 1)) + 1;
        (offset, sectors * 512 - (offset & 511))
    }

    /// Turns an L2 entry whose preallocated zero cluster is unaligned into a plain zero
    /// entry (QEMU's `fix_l2_entry_by_zero`).
    async fn zero_l2_entry(&mut self, l2_off: u64, index: u64, bitmap: u64) -> Step<ZeroFix> {
        let entry_bytes = if self.extended_l2 { 16 } else { 8 };
        let at = l2_off + index * entry_bytes;
        if self.overlaps_metadata(at, entry_bytes) {
            self.report.check_errors += 1;
            self.msg("ERROR: Overlap check failed".into());
            return Ok(ZeroFix::Overlap);
        }
        let mut data = vec![0u8; entry_bytes as usize];
        if self.extended_l2 {
            // Allocated subclusters become zero.
            let b = (bitmap | (bitmap << 32)) & BITMAP_ALL_ZERO;
            put_u64(&mut data, 8, b);
        } else {
            put_u64(&mut data, 0, ZERO);
        }
        self.patch(at, &data).await?;
        self.flush().await?;
        Ok(ZeroFix::Done)
    }

    /// Whether writing `[offset, offset + len)` would touch metadata other than L2 tables.
    fn overlaps_metadata(&self, offset: u64, len: u64) -> bool {
        let start = offset & !(self.cs - 1);
        let end = (offset + len).div_ceil(self.cs) * self.cs;
        self.metadata.iter().any(|&(s, e)| start < e && s < end)
    }

    /// `qcow2_check_bitmaps_refcounts`: the bitmap directory, bitmap tables and data.
    /// A directory or table that cannot be parsed aborts the check, as in QEMU.
    async fn check_bitmaps(&mut self) -> Step {
        let Some(ext) = self.header.extensions.bitmaps.clone() else {
            return Ok(());
        };
        self.inc(ext.directory_offset, ext.directory_size);
        let dir = read_bytes(
            self.exec,
            self.dev,
            ext.directory_offset,
            ext.directory_size,
        )
        .await?;
        let virtual_size = self.header.header.size / SECTOR * SECTOR;
        let bitmaps = match bitmaps::parse_directory(&dir, ext.nb_bitmaps, self.cs, virtual_size) {
            Ok(b) => b,
            Err(why) => {
                self.corruption(format!("ERROR bitmap directory: {why}"));
                self.report.check_errors += 1;
                return Err(Stop::Abort);
            }
        };
        for bm in bitmaps {
            let bytes = u64::from(bm.table_size) * 8;
            self.inc(bm.table_offset, bytes);
            let table = words(&read_bytes(self.exec, self.dev, bm.table_offset, bytes).await?);
            let mut data = Vec::with_capacity(table.len());
            for e in table {
                if !bitmaps::table_entry_ok(e, self.cs) {
                    self.corruption(format!(
                        "ERROR bitmap table at {:#x}: invalid entry {e:#x}",
                        bm.table_offset
                    ));
                    self.report.check_errors += 1;
                    return Err(Stop::Abort);
                }
                data.push(e & OFFSET_MASK);
            }
            for off in data.into_iter().filter(|o| *o != 0) {
                self.inc(off, self.cs);
            }
        }
        Ok(())
    }

    /// `check_refblocks`: the refcount table's entries, and one reference to each block.
    fn check_refblocks(&mut self) {
        for i in 0..self.rt.len() {
            let raw = self.rt[i];
            let offset = raw & REFT_OFFSET_MASK;
            let cluster = offset >> self.cluster_bits;
            if raw & REFT_RESERVED != 0 {
                self.corruption(format!(
                    "ERROR refcount table entry {i} has reserved bits set"
                ));
                self.mark_bad(i as u64, false);
                continue;
            }
            if !offset.is_multiple_of(self.cs) {
                self.corruption(format!(
                    "ERROR refcount block {i} is not cluster aligned; refcount table entry \
                     corrupted"
                ));
                self.mark_bad(i as u64, false);
                continue;
            }
            if cluster >= self.imrt.len() as u64 {
                // QEMU grows the file to cover the block; we give it a new block instead.
                self.corruption(format!(
                    "{} refcount block {i} is outside image",
                    if self.repair.errors() {
                        "Repairing"
                    } else {
                        "ERROR"
                    }
                ));
                self.mark_bad(i as u64, false);
                continue;
            }
            if offset != 0 {
                self.inc(offset, self.cs);
                let rc = self.expected(cluster);
                if rc != 1 {
                    self.corruption(format!("ERROR refcount block {i} refcount={rc}"));
                    self.mark_bad(i as u64, true);
                }
            }
        }
    }

    fn mark_bad(&mut self, index: u64, counted: bool) {
        self.rebuild = true;
        self.refcount_corruptions += 1;
        self.bad_blocks.insert(index);
        if counted {
            self.counted_bad_blocks.insert(index);
        }
    }

    /// The stored refcount block for refcount-table index `index` (QEMU's
    /// `qcow2_get_refcount` rules): `Ok(None)` when there is none (all zero), an error
    /// string when its offset is unaligned.
    async fn stored_block(&mut self, index: u64) -> Step<std::result::Result<Option<u64>, ()>> {
        let Some(&raw) = self.rt.get(index as usize) else {
            return Ok(Ok(None));
        };
        let off = raw & REFT_OFFSET_MASK;
        if off == 0 {
            return Ok(Ok(None));
        }
        if !off.is_multiple_of(self.cs) {
            return Ok(Err(()));
        }
        if !self.block_cache.contains_key(&off) {
            if self.block_cache.len() >= REFBLOCK_CACHE_BLOCKS {
                self.block_cache.clear();
            }
            let b = read_bytes(self.exec, self.dev, off, self.cs).await?;
            self.block_cache.insert(off, b);
        }
        Ok(Ok(Some(off)))
    }

    /// Stored refcount of `cluster`, or `Err` when it cannot be read.
    async fn stored(&mut self, cluster: u64) -> Step<std::result::Result<u64, ()>> {
        let index = cluster / self.per_block;
        Ok(match self.stored_block(index).await? {
            Ok(None) => Ok(0),
            Ok(Some(off)) => Ok(self.block_cache.get(&off).map_or(0, |b| {
                get_refcount(b, self.refcount_order, cluster % self.per_block)
            })),
            Err(()) => Err(()),
        })
    }

    /// `compare_refcounts` (without fixing): counts leaks and refcount errors, finds the
    /// image end, and notes whether a refcount block is missing where one is needed.
    async fn compare_refcounts(&mut self) -> Step<Mismatches> {
        let mut counts = Mismatches::default();
        let mut highest = 0u64;
        let n = self.imrt.len() as u64;
        for index in 0..n.div_ceil(self.per_block) {
            let base = index * self.per_block;
            let block = self.stored_block(index).await?;
            for i in base..(base + self.per_block).min(n) {
                let expected = self.expected(i);
                let stored = match block {
                    Ok(None) => 0,
                    Ok(Some(off)) => self
                        .block_cache
                        .get(&off)
                        .map_or(0, |b| get_refcount(b, self.refcount_order, i - base)),
                    Err(()) => {
                        self.report.check_errors += 1;
                        self.msg(format!(
                            "Can't get refcount for cluster {i}: Input/output error"
                        ));
                        continue;
                    }
                };
                if stored > 0 || expected > 0 {
                    highest = i;
                }
                if stored == expected {
                    continue;
                }
                if stored == 0 {
                    self.rebuild = true;
                }
                let fixing = if stored > expected {
                    self.repair.leaks()
                } else {
                    self.repair.errors()
                };
                let label = if fixing {
                    "Repairing"
                } else if stored < expected {
                    "ERROR"
                } else {
                    "Leaked"
                };
                self.msg(format!(
                    "{label} cluster {i} refcount={stored} reference={expected}"
                ));
                if stored < expected {
                    counts.errors += 1;
                    self.report.corruptions += 1;
                } else {
                    counts.leaks += 1;
                    self.report.leaks += 1;
                }
            }
        }
        self.report.image_end_offset = (highest + 1) * self.cs;
        Ok(counts)
    }

    /// Lowers the stored refcount of every leaked cluster to its reference count
    /// (`-r leaks`; only called when no refcount block is missing or unusable).
    async fn fix_leaks(&mut self) -> Step {
        let n = self.imrt.len() as u64;
        let mut fixed = 0;
        for index in 0..n.div_ceil(self.per_block) {
            let Ok(Some(off)) = self.stored_block(index).await? else {
                continue;
            };
            let Some(mut block) = self.block_cache.get(&off).cloned() else {
                continue;
            };
            let base = index * self.per_block;
            let mut dirty = 0;
            for i in base..(base + self.per_block).min(n) {
                let stored = get_refcount(&block, self.refcount_order, i - base);
                let expected = self.expected(i);
                if stored > expected {
                    set_refcount(&mut block, self.refcount_order, i - base, expected)?;
                    dirty += 1;
                }
            }
            if dirty > 0 {
                self.write(off, &block).await?;
                self.block_cache.insert(off, block);
                fixed += dirty;
            }
        }
        self.flush().await?;
        self.report.leaks_fixed += fixed;
        self.report.leaks -= fixed.min(self.report.leaks);
        Ok(())
    }

    /// Whether the repair keeps the block that refcount-table index `i` names: one is
    /// named, and it is usable.
    fn keeps_block(&self, i: u64) -> bool {
        self.rt
            .get(i as usize)
            .is_some_and(|e| e & REFT_OFFSET_MASK != 0 && !self.bad_blocks.contains(&i))
    }

    /// Where the new refcount structures for the blocks of `need` go: past the end of the
    /// image on a device that grows; on a fixed-size device (a bdev, a block device), in
    /// whole clusters below its end that no reference uses. `None` when a fixed-size device
    /// has no room for them.
    fn place(&self, need: &BTreeSet<u64>) -> Option<placement::Layout> {
        let present = |i: u64| self.keeps_block(i);
        let g = placement::Geometry {
            cluster_size: self.cs,
            per_block: self.per_block,
            table_len: self.rt.len() as u64,
            present: &present,
        };
        if self.exec.with_device(self.dev, |d| d.can_grow()) {
            return Some(placement::past_the_end(self.imrt.len() as u64, need, &g));
        }
        let free = |c: u64| self.imrt.get(c as usize).is_some_and(|v| *v == 0);
        placement::in_holes(self.file_len / self.cs, &free, need, &g)
    }

    /// Makes every stored refcount (for clusters up to the end of the image) equal its
    /// reference count: relocates unusable refcount blocks, creates missing ones (past the
    /// end of the image, or in unused clusters of a fixed-size device), grows the refcount table into a new one if needed, and rewrites
    /// existing blocks in place. Crash-safe order: blocks, flush, table (new table, flush,
    /// header), flush, then the old table is freed.
    async fn fix_all(&mut self) -> Step {
        let cs = self.cs;
        let per = self.per_block;
        // Blocks that were counted but will be dropped by the table: one reference less.
        for &i in &self.counted_bad_blocks.clone() {
            let c = (self.rt[i as usize] & REFT_OFFSET_MASK) >> self.cluster_bits;
            if let Some(v) = self.imrt.get_mut(c as usize) {
                *v = v.saturating_sub(1);
            }
        }
        let rt_len = self.rt.len() as u64;
        // Blocks needed for the clusters in use today.
        let n0 = self.imrt.len() as u64;
        let mut need: BTreeSet<u64> = BTreeSet::new();
        for b in 0..n0.div_ceil(per) {
            if self.keeps_block(b) {
                continue;
            }
            let lo = (b * per) as usize;
            let hi = ((b + 1) * per).min(n0) as usize;
            if self.imrt[lo..hi].iter().any(|v| *v > 0) {
                need.insert(b);
            }
        }
        if need.is_empty() {
            // Only in-place changes: no allocation. Unusable entries whose range needs no
            // refcounts are cleared once the blocks are right.
            self.rewrite_blocks().await?;
            self.flush().await?;
            for b in self.bad_blocks.clone() {
                if b < rt_len {
                    self.patch(self.rt_offset + b * 8, &[0u8; 8]).await?;
                    self.rt[b as usize] = 0;
                }
            }
            self.flush().await?;
            return Ok(());
        }
        let Some(layout) = self.place(&need) else {
            self.report.check_errors += 1;
            self.msg(format!(
                "ERROR allocating refcount blocks: no room on the fixed-size device for {} \
                 refcount block(s) and the refcount table; free clusters inside the image \
                 or make the device larger",
                need.len()
            ));
            return Err(Stop::Abort);
        };
        let (table_start, t) = layout.table;
        if let Some(end) = layout.clusters().max() {
            if end >= MAX_CHECK_CLUSTERS {
                self.report.check_errors += 1;
                self.msg("ERROR allocating refcount blocks: image too large".into());
                return Err(Stop::Abort);
            }
            if end >= self.imrt.len() as u64 {
                self.imrt.resize(end as usize + 1, 0);
            }
        }
        for c in layout.clusters() {
            self.imrt[c as usize] = 1;
        }
        // New structures may lie in a zeroed tail, which the repair does not keep.
        self.void_zeroed_tail().await?;
        let mut new_rt = self.rt.clone();
        if t > 0 {
            new_rt.resize((t * cs / 8) as usize, 0);
        }
        for &(b, c) in &layout.blocks {
            new_rt[b as usize] = c * cs;
        }
        let placed: BTreeSet<u64> = layout.blocks.iter().map(|&(b, _)| b).collect();
        for &b in &self.bad_blocks {
            if !placed.contains(&b) {
                // A bad entry whose range needs no refcounts: drop it.
                new_rt[b as usize] = 0;
            }
        }
        // 1. New blocks, and corrections of the existing ones.
        for &(b, c) in &layout.blocks {
            let block = self.encode_block(b);
            self.write(c * cs, &block).await?;
        }
        // A stale cached copy could sit at a new block's offset (a bad entry, a hole).
        self.block_cache.clear();
        self.rewrite_blocks().await?;
        self.flush().await?;
        // 2. The table.
        let old_rt = (self.rt_offset, self.rt_clusters);
        if t == 0 {
            for (i, (old, new)) in self.rt.iter().zip(&new_rt).enumerate() {
                if old != new {
                    let mut e = [0u8; 8];
                    put_u64(&mut e, 0, *new);
                    self.patch(self.rt_offset + i as u64 * 8, &e).await?;
                }
            }
            self.rt = new_rt;
            self.block_cache.clear();
            self.flush().await?;
            return Ok(());
        }
        let mut table = vec![0u8; (t * cs) as usize];
        for (i, e) in new_rt.iter().enumerate() {
            put_u64(&mut table, i * 8, *e);
        }
        self.write(table_start * cs, &table).await?;
        self.flush().await?;
        let hdr = HeaderPatch::refcount_table(table_start * cs, t as u32);
        self.patch(hdr.offset(), hdr.bytes()).await?;
        self.flush().await?;
        self.rt = new_rt;
        self.block_cache.clear();
        self.rt_offset = table_start * cs;
        self.rt_clusters = t;
        self.header.header.refcount_table_offset = self.rt_offset;
        self.header.header.refcount_table_clusters = t as u32;
        // 3. Free the old table (a crash before this point leaves only a leak).
        let first = old_rt.0 >> self.cluster_bits;
        for c in first..first + old_rt.1 {
            if let Some(v) = self.imrt.get_mut(c as usize) {
                *v = v.saturating_sub(1);
            }
        }
        self.rewrite_blocks().await?;
        self.flush().await?;
        self.msg(format!(
            "Repairing refcount table: moved to {:#x} ({t} clusters)",
            self.rt_offset
        ));
        Ok(())
    }

    /// A refcount block for table index `index` holding the expected refcounts.
    fn encode_block(&self, index: u64) -> Vec<u8> {
        let mut block = vec![0u8; self.cs as usize];
        let base = index * self.per_block;
        let n = self.imrt.len() as u64;
        for i in base..(base + self.per_block).min(n) {
            // Values are capped at the refcount width's maximum, so this cannot fail.
            let _ = set_refcount(&mut block, self.refcount_order, i - base, self.expected(i));
        }
        block
    }

    /// Rewrites every present, usable refcount block whose entries (up to the end of the
    /// image) differ from the expected refcounts.
    async fn rewrite_blocks(&mut self) -> Step {
        let n = self.imrt.len() as u64;
        for index in 0..n.div_ceil(self.per_block) {
            if self.bad_blocks.contains(&index) {
                continue;
            }
            let Ok(Some(off)) = self.stored_block(index).await? else {
                continue;
            };
            let Some(mut block) = self.block_cache.get(&off).cloned() else {
                continue;
            };
            let base = index * self.per_block;
            let mut dirty = false;
            for i in base..(base + self.per_block).min(n) {
                let expected = self.expected(i);
                if get_refcount(&block, self.refcount_order, i - base) != expected {
                    set_refcount(&mut block, self.refcount_order, i - base, expected)?;
                    dirty = true;
                }
            }
            if dirty {
                self.write(off, &block).await?;
                self.block_cache.insert(off, block);
            }
        }
        Ok(())
    }

    /// `check_oflag_copied`: COPIED must be set exactly when the stored refcount is 1, on
    /// active L1 entries and on normal / preallocated-zero active L2 entries.
    async fn check_oflag_copied(&mut self) -> Step {
        let repair = match self.repair {
            Repair::All => true,
            // Repair only when the refcounts are known to be right.
            Repair::Leaks => {
                self.report.check_errors == 0
                    && self.report.corruptions == 0
                    && self.report.leaks == 0
            }
            Repair::None => false,
        };
        let l1_offset = self.header.header.l1_table_offset;
        for i in 0..self.l1.len() {
            let l1e = self.l1[i];
            let l2_off = l1e & OFFSET_MASK;
            if l2_off == 0 {
                continue;
            }
            let Ok(rc) = self.stored(l2_off >> self.cluster_bits).await? else {
                continue;
            };
            if (rc == 1) != (l1e & COPIED != 0) {
                self.report.corruptions += 1;
                self.msg(format!(
                    "{} OFLAG_COPIED L2 cluster: l1_index={i} l1_entry={l1e:x} refcount={rc}",
                    if repair { "Repairing" } else { "ERROR" }
                ));
                if repair {
                    let fixed = if rc == 1 { l1e | COPIED } else { l1e & !COPIED };
                    let mut e = [0u8; 8];
                    put_u64(&mut e, 0, fixed);
                    self.patch(l1_offset + i as u64 * 8, &e).await?;
                    self.l1[i] = fixed;
                    self.report.corruptions -= 1;
                    self.report.corruptions_fixed += 1;
                }
            }
            let mut raw = read_bytes(self.exec, self.dev, l2_off, self.cs).await?;
            let step = if self.extended_l2 { 16 } else { 8 };
            let mut dirty = 0u64;
            for j in 0..self.l2_entries as usize {
                let e = get_u64(&raw, j * step);
                if !matches!(
                    cluster_type(e, self.extended_l2),
                    ClusterType::Normal | ClusterType::ZeroAlloc
                ) {
                    continue;
                }
                let Ok(rc) = self.stored((e & OFFSET_MASK) >> self.cluster_bits).await? else {
                    continue;
                };
                if (rc == 1) != (e & COPIED != 0) {
                    self.report.corruptions += 1;
                    self.msg(format!(
                        "{} OFLAG_COPIED data cluster: l2_entry={e:x} refcount={rc}",
                        if repair { "Repairing" } else { "ERROR" }
                    ));
                    if repair {
                        let fixed = if rc == 1 { e | COPIED } else { e & !COPIED };
                        put_u64(&mut raw, j * step, fixed);
                        dirty += 1;
                    }
                }
            }
            if dirty > 0 {
                if self.overlaps_metadata(l2_off, self.cs) {
                    self.report.check_errors += 1;
                    self.msg(
                        "ERROR: Could not write L2 table; metadata overlap check failed".into(),
                    );
                    return Err(Stop::Abort);
                }
                self.patch(l2_off, &raw).await?;
                self.report.corruptions -= dirty.min(self.report.corruptions);
                self.report.corruptions_fixed += dirty;
            }
        }
        if repair {
            self.flush().await?;
        }
        Ok(())
    }

    /// Clears the dirty and corrupt bits after a successful repair (QEMU's
    /// `qcow2_mark_clean` / `qcow2_mark_consistent`).
    async fn mark_clean(&mut self) -> Step {
        let h = &self.header.header;
        let bits = incompat::DIRTY | incompat::CORRUPT;
        if h.version < 3 || h.incompatible_features & bits == 0 {
            return Ok(());
        }
        let v = h.incompatible_features & !bits;
        let b = HeaderPatch::incompatible_features(v);
        self.flush().await?;
        self.patch(b.offset(), b.bytes()).await?;
        self.flush().await?;
        self.header.header.incompatible_features = v;
        Ok(())
    }

    /// Clears the zeroed tail's autoclear bit (written and flushed) before a repair
    /// writes where the tail may lie: the repair does not keep it, so it voids it.
    async fn void_zeroed_tail(&mut self) -> Step {
        let h = &self.header.header;
        if h.version < 3 || h.autoclear_features & autoclear::ZEROED_TAIL == 0 {
            return Ok(());
        }
        let v = h.autoclear_features & !autoclear::ZEROED_TAIL;
        let b = HeaderPatch::autoclear_features(v);
        self.patch(b.offset(), b.bytes()).await?;
        self.flush().await?;
        self.header.header.autoclear_features = v;
        self.header.extensions.zeroed_tail = None;
        Ok(())
    }

    /// Writes `data` at a sector-aligned `offset` (its length is a multiple of 512).
    async fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        let buf = self.exec.alloc_buf(self.dev, data.len());
        buf.copy_in(0, data);
        self.exec
            .io(
                self.dev,
                DeviceOp::Write {
                    offset,
                    buf: BufSlice::whole(buf),
                },
            )
            .await
    }

    /// Writes `data` at any `offset` by read-modify-write of the sectors it touches.
    async fn patch(&self, offset: u64, data: &[u8]) -> Result<()> {
        let start = offset / SECTOR * SECTOR;
        let end = (offset + data.len() as u64).div_ceil(SECTOR) * SECTOR;
        let mut sectors = read_bytes(self.exec, self.dev, start, end - start).await?;
        let at = (offset - start) as usize;
        sectors[at..at + data.len()].copy_from_slice(data);
        self.write(start, &sectors).await
    }

    async fn flush(&self) -> Result<()> {
        self.exec.io(self.dev, DeviceOp::Flush).await
    }
}

/// Leaks and refcount errors found by the comparison.
#[derive(Debug, Default, Clone, Copy)]
struct Mismatches {
    leaks: u64,
    errors: u64,
}

enum ZeroFix {
    Done,
    Overlap,
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
