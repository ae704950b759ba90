//! The references the check counts: the header's tables, every L1 and L2 table the
//! active disk and the snapshots name, their data and compressed clusters, the bitmaps'
//! directory, tables and data, each counted into the expected refcounts; and the COPIED
//! flags checked against them.

use super::{
    cluster_type, walk_snapshots, words, Checker, ClusterType, Repair, Step, Stop,
    BITMAP_ALL_ALLOC, BITMAP_ALL_ZERO, COPIED, L1_RESERVED, L2_STD_RESERVED, OFFSET_MASK,
    REFT_OFFSET_MASK, ZERO,
};
use crate::error::{invalid, Field};
use crate::exec::read_bytes;
use crate::format::be::{get_u64, put_u64};
use crate::format::bitmaps;
use crate::io::{BlockDevice, SECTOR};
use crate::limits::{MAX_L1_ENTRIES, MAX_SNAPSHOT_TABLE_BYTES};

impl<D: BlockDevice> Checker<'_, D> {
    /// Reads the active L1 table, the refcount table and the snapshot table, and notes
    /// where the metadata lies (for the overlap check of repairs).
    pub(super) async fn load_tables(&mut self) -> Step {
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
        if let Some((off, len)) = self.header.extensions.encryption {
            md.push((off, off.saturating_add(len)));
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
    pub(super) async fn read_snapshot_table(&mut self, offset: u64, nb: u32) -> Step {
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
    pub(super) fn inc(&mut self, offset: u64, size: u64) {
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

    pub(super) fn expected(&self, cluster: u64) -> u64 {
        self.imrt.get(cluster as usize).map_or(0, |v| u64::from(*v))
    }

    /// `calculate_refcounts`: every reference, in QEMU's order (the order decides which of
    /// two overlapping refcount blocks is reported).
    pub(super) async fn calculate_refcounts(&mut self) -> Step {
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
        // The LUKS header area of an encrypted image (QEMU counts `crypto_header`).
        if let Some((off, len)) = self.header.extensions.encryption {
            self.inc(off, len);
        }
        self.check_bitmaps().await?;
        self.check_refblocks();
        Ok(())
    }

    /// `check_refcounts_l1`: counts an L1 table, its L2 tables and their clusters.
    /// `active` counts allocation statistics; `table` passes an L1 already read.
    pub(super) async fn check_l1(
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
    pub(super) async fn check_l2(&mut self, l2_off: u64, active: bool) -> Step {
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
    pub(super) fn compressed_range(&self, entry: u64) -> (u64, u64) {
        let shift = 62 - (self.cluster_bits - 8);
        let offset = entry & ((1u64 << shift) - 1);
        let sectors = ((entry >> shift) & ((1u64 << (self.cluster_bits - 8)) - 1)) + 1;
        (offset, sectors * 512 - (offset & 511))
    }

    /// Turns an L2 entry whose preallocated zero cluster is unaligned into a plain zero
    /// entry (QEMU's `fix_l2_entry_by_zero`).
    pub(super) async fn zero_l2_entry(
        &mut self,
        l2_off: u64,
        index: u64,
        bitmap: u64,
    ) -> Step<ZeroFix> {
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
    pub(super) fn overlaps_metadata(&self, offset: u64, len: u64) -> bool {
        let start = offset & !(self.cs - 1);
        let end = (offset + len).div_ceil(self.cs) * self.cs;
        self.metadata.iter().any(|&(s, e)| start < e && s < end)
    }

    /// `qcow2_check_bitmaps_refcounts`: the bitmap directory, bitmap tables and data.
    /// A directory or table that cannot be parsed aborts the check, as in QEMU.
    pub(super) async fn check_bitmaps(&mut self) -> Step {
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

    /// `check_oflag_copied`: COPIED must be set exactly when the stored refcount is 1, on
    /// active L1 entries and on normal / preallocated-zero active L2 entries.
    pub(super) async fn check_oflag_copied(&mut self) -> Step {
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
}

pub(super) enum ZeroFix {
    Done,
    Overlap,
}
