//! Repair: leaks fixed in place, every mismatch fixed with new refcount blocks and a new
//! refcount table where needed (placed past the end, or in unused clusters of a device
//! that cannot grow: `placement.rs`), written in the crash-safe order; the image marked
//! clean; and the device writes they make.

use super::placement;
use super::{Checker, Step, Stop, MAX_CHECK_CLUSTERS, REFT_OFFSET_MASK};
use crate::error::Result;
use crate::exec::read_bytes;
use crate::format::be::put_u64;
use crate::format::header::{autoclear, incompat};
use crate::format::refcount::{get_refcount, set_refcount};
use crate::format::HeaderPatch;
use crate::io::{BlockDevice, BufSlice, DeviceOp, IoBuffer, SECTOR};
use std::collections::BTreeSet;

impl<D: BlockDevice> Checker<'_, D> {
    /// Lowers the stored refcount of every leaked cluster to its reference count
    /// (`-r leaks`; only called when no refcount block is missing or unusable).
    pub(super) async fn fix_leaks(&mut self) -> Step {
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
    pub(super) fn keeps_block(&self, i: u64) -> bool {
        self.rt
            .get(i as usize)
            .is_some_and(|e| e & REFT_OFFSET_MASK != 0 && !self.bad_blocks.contains(&i))
    }

    /// Where the new refcount structures for the blocks of `need` go: past the end of the
    /// image on a device that grows; on a fixed-size device (a bdev, a block device), in
    /// whole clusters below its end that no reference uses. `None` when a fixed-size device
    /// has no room for them.
    pub(super) fn place(&self, need: &BTreeSet<u64>) -> Option<placement::Layout> {
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
    pub(super) async fn fix_all(&mut self) -> Step {
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
    pub(super) fn encode_block(&self, index: u64) -> Vec<u8> {
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
    pub(super) async fn rewrite_blocks(&mut self) -> Step {
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

    /// Clears the dirty and corrupt bits after a successful repair (QEMU's
    /// `qcow2_mark_clean` / `qcow2_mark_consistent`).
    pub(super) async fn mark_clean(&mut self) -> Step {
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
    pub(super) async fn void_zeroed_tail(&mut self) -> Step {
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
    pub(super) async fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
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
    pub(super) async fn patch(&self, offset: u64, data: &[u8]) -> Result<()> {
        let start = offset / SECTOR * SECTOR;
        let end = (offset + data.len() as u64).div_ceil(SECTOR) * SECTOR;
        let mut sectors = read_bytes(self.exec, self.dev, start, end - start).await?;
        let at = (offset - start) as usize;
        sectors[at..at + data.len()].copy_from_slice(data);
        self.write(start, &sectors).await
    }

    pub(super) async fn flush(&self) -> Result<()> {
        self.exec.io(self.dev, DeviceOp::Flush).await
    }
}
