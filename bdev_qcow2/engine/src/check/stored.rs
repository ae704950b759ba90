//! The stored refcounts: the refcount table's entries and blocks checked, refcounts read
//! a block at a time, and compared with the expected ones (corruptions and leaks).

use super::{Checker, Mismatches, Step, REFBLOCK_CACHE_BLOCKS, REFT_OFFSET_MASK, REFT_RESERVED};
use crate::exec::read_bytes;
use crate::format::refcount::get_refcount;
use crate::io::BlockDevice;

impl<D: BlockDevice> Checker<'_, D> {
    /// `check_refblocks`: the refcount table's entries, and one reference to each block.
    pub(super) fn check_refblocks(&mut self) {
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

    pub(super) fn mark_bad(&mut self, index: u64, counted: bool) {
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
    pub(super) async fn stored_block(
        &mut self,
        index: u64,
    ) -> Step<std::result::Result<Option<u64>, ()>> {
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
    pub(super) async fn stored(&mut self, cluster: u64) -> Step<std::result::Result<u64, ()>> {
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
    pub(super) async fn compare_refcounts(&mut self) -> Step<Mismatches> {
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
}
