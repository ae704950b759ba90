//! Refcounts on the owner: changes in the dirty copy of a block, new self-describing
//! refcount blocks, and a larger refcount table.
//!
//! Invariants: a refcount never wraps (that is corruption); a new block lies at the first
//! cluster of the range it covers and counts itself; a new refcount table and its blocks
//! are written and flushed before the header points at them, and the old table is freed
//! only after that.

use super::discards::FreeKind;
use super::{words_to_bytes, Owner};
use crate::error::{corrupt, Error, Field, Result};
use crate::format::refcount::{entries_per_block, get_refcount, set_refcount};
use crate::io::{BlockDevice, BufSlice, IoBuffer};
use crate::types::{HostOffset, HostRange};

impl<D: BlockDevice> Owner<'_, D> {
    /// Refcount entries per refcount block.
    pub(crate) fn per_block(&self) -> u64 {
        let h = self.header.borrow();
        entries_per_block(h.header.cluster_bits, h.header.refcount_order)
    }

    /// Adds `delta` to the refcount of host cluster `cluster` (in the dirty copy). Never
    /// wraps: a refcount that would leave its range is corruption.
    pub(crate) async fn update_refcount(&self, cluster: u64, delta: i64) -> Result<u64> {
        let (block, idx) = self.ensure_rc_block(cluster).await?;
        self.load_rc_block(block).await?;
        self.update_loaded_refcount(block, idx, cluster, delta)
    }

    /// [`update_refcount`](Self::update_refcount) of host cluster `cluster` at index `idx`
    /// of refcount block `block`, which is dirty or cached (no await since it was loaded).
    pub(crate) fn update_loaded_refcount(
        &self,
        block: u64,
        idx: u64,
        cluster: u64,
        delta: i64,
    ) -> Result<u64> {
        let order = self.header.borrow().header.refcount_order;
        let mut st = self.meta().st_mut();
        let b = st.dirty.rc_or_load(block, || self.clean_rc_block(block))?;
        let old = get_refcount(b, order, idx);
        let new = if delta >= 0 {
            old.checked_add(delta as u64)
        } else {
            old.checked_sub(delta.unsigned_abs())
        }
        .ok_or_else(|| corrupt(Field::RefcountBlockEntry, cluster, "refcount would wrap"))?;
        set_refcount(b, order, idx, new)?;
        Ok(new)
    }

    /// Takes the `count` host clusters from `first` on, at indices `idx..` of refcount
    /// block `block`, which is dirty or cached: each refcount goes from 0 to 1, in one
    /// look-up of the block. A refcount found in use is corruption (the caller checked
    /// them free, and nothing ran since).
    pub(crate) fn take_loaded_refcounts(
        &self,
        block: u64,
        idx: u64,
        count: u64,
        first: u64,
    ) -> Result<()> {
        let order = self.header.borrow().header.refcount_order;
        let mut st = self.meta().st_mut();
        let b = st.dirty.rc_or_load(block, || self.clean_rc_block(block))?;
        for i in 0..count {
            if get_refcount(b, order, idx + i) != 0 {
                return Err(corrupt(
                    Field::RefcountBlockEntry,
                    first + i,
                    "allocated cluster already in use",
                ));
            }
            set_refcount(b, order, idx + i, 1)?;
        }
        Ok(())
    }

    /// The cached bytes of refcount block `block`, taken out of the cache as it becomes
    /// dirty (the dirty copy is the only one from then on).
    fn clean_rc_block(&self, block: u64) -> Result<Vec<u8>> {
        let bytes = {
            let cache = self.rc_cache.borrow();
            let w = cache.probe(block, 0).map(|h| h.way).ok_or_else(|| {
                corrupt(
                    Field::RefcountBlockEntry,
                    block,
                    "refcount block evicted while in use",
                )
            })?;
            cache.block(w).to_vec()
        };
        self.rc_cache.borrow_mut().invalidate(block);
        Ok(bytes)
    }

    /// The refcount block covering host cluster `cluster`, allocating a self-describing
    /// block (placed at the first cluster of the range it covers) and growing the refcount
    /// table when needed. Returns (block offset, index within block).
    pub(crate) async fn ensure_rc_block(&self, cluster: u64) -> Result<(u64, u64)> {
        if let Some(loc) = self.rc_locate(cluster)? {
            return Ok(loc);
        }
        let per_block = self.per_block();
        let bits = self.geo.cluster_bits;
        let r = cluster / per_block;
        if r >= self.refcount_table.borrow().len() as u64 {
            Box::pin(self.grow_refcount_table(r + 1)).await?;
            if let Some(loc) = self.rc_locate(cluster)? {
                return Ok(loc);
            }
        }
        let b = r * per_block;
        let cs = self.geo.cluster_size();
        if self.overlaps_metadata(HostOffset(b << bits), cs) {
            return Err(self
                .mark_corrupt(
                    Field::RefcountTableEntry,
                    b,
                    "new refcount block would overlap metadata",
                )
                .await);
        }
        // No zeroed tail to raise here: the block lies at the start of the range it covers,
        // at or before the cluster whose allocation asked for it, and that allocation raises
        // the tail past itself before anything is written (the block waits for a write-back).
        let order = self.header.borrow().header.refcount_order;
        let mut bytes = vec![0u8; cs as usize];
        set_refcount(&mut bytes, order, 0, 1)?;
        {
            let mut st = self.meta().st_mut();
            st.dirty.put_rc(b << bits, bytes);
            st.dirty.dirty_rt(r);
            st.index.insert(b);
            if let Some(sh) = self.published() {
                sh.set_meta_cluster(b);
            }
            st.alloc.take_fresh(b, 1);
        }
        self.refcount_table.borrow_mut()[r as usize] = b << bits;
        self.note_allocated(b + 1)?;
        Ok((b << bits, cluster % per_block))
    }

    /// Replaces the refcount table by a larger one holding at least `min_entries`: the new
    /// table and the refcount blocks covering it are placed past every allocated cluster,
    /// written and flushed, then the header points at them, then the old table is freed.
    async fn grow_refcount_table(&self, min_entries: u64) -> Result<()> {
        let m = self.meta();
        let cs = self.geo.cluster_size();
        let bits = self.geo.cluster_bits;
        let per_block = self.per_block();
        let order = self.header.borrow().header.refcount_order;
        let old: Vec<u64> = self.refcount_table.borrow().clone();
        let (old_off, old_clusters) = {
            let h = self.header.borrow();
            (
                h.header.refcount_table_offset,
                u64::from(h.header.refcount_table_clusters),
            )
        };
        // First make every pending refcount change stable in the old layout.
        self.writeback_mode(true).await?;
        m.st_mut().alloc.rt_growing();
        // Past every allocated cluster on a device that grows; on one that cannot (a bdev),
        // the first free run inside it that holds the table and its new blocks.
        let dev_end = self.device_size.get() / cs;
        let can_grow = self.exec.with_device(self.dev, |d| d.can_grow());
        let mut start = if can_grow {
            m.st()
                .alloc
                .fresh_from()
                .max(self.device_size.get().div_ceil(cs))
        } else {
            m.st().alloc.hint().max(1)
        };
        let mut wrapped = false;
        let (start, entries, table_clusters, missing) = loop {
            let mut entries = min_entries.max(old.len() as u64 * 2).max(cs / 8);
            let mut extra = 0u64;
            let (table_clusters, missing) = loop {
                let table_clusters = (entries * 8).div_ceil(cs);
                let end = start + table_clusters + extra;
                let (lo, hi) = (start / per_block, (end - 1) / per_block);
                if hi >= entries {
                    entries = hi + 1;
                    continue;
                }
                let missing: Vec<u64> = (lo..=hi)
                    .filter(|r| old.get(*r as usize).is_none_or(|e| *e == 0))
                    .collect();
                if missing.len() as u64 == extra {
                    break (table_clusters, missing);
                }
                extra = missing.len() as u64;
            };
            if can_grow {
                break (start, entries, table_clusters, missing);
            }
            let len = table_clusters + missing.len() as u64;
            if start + len > dev_end {
                if !wrapped {
                    // Nothing past the hint: look below it once.
                    wrapped = true;
                    start = 1;
                    continue;
                }
                return Err(Error::Io(28)); // ENOSPC
            }
            match self.first_busy(start, len).await? {
                None => break (start, entries, table_clusters, missing),
                Some(c) => start = c + 1,
            }
        };
        if table_clusters << bits > crate::limits::MAX_REFCOUNT_TABLE_BYTES {
            return Err(Error::UnsupportedFeature(
                "refcount table would exceed 8 MiB".into(),
            ));
        }
        let end = start + table_clusters + missing.len() as u64;
        self.raise_zeroed_tail(end).await?;
        let mut table = old.clone();
        table.resize(entries as usize, 0);
        // New blocks, right after the new table; each counts the new clusters in its range.
        for (i, r) in missing.iter().enumerate() {
            let at = start + table_clusters + i as u64;
            table[*r as usize] = at << bits;
            let mut bytes = vec![0u8; cs as usize];
            for c in (r * per_block).max(start)..((r + 1) * per_block).min(end) {
                set_refcount(&mut bytes, order, c % per_block, 1)?;
            }
            let buf = self.exec.alloc_buf(self.dev, cs as usize);
            buf.copy_in(0, &bytes);
            self.exec
                .write(self.dev, at << bits, BufSlice::whole(buf))
                .await?;
            m.st_mut().index.insert(at);
            if let Some(sh) = self.published() {
                sh.set_meta_cluster(at);
            }
        }
        self.note_allocated(end)?;
        // Existing blocks covering part of the new area count it too.
        *self.refcount_table.borrow_mut() = table.clone();
        for c in start..end {
            let r = c / per_block;
            if !missing.contains(&r) {
                self.update_refcount(c, 1).await?;
            }
        }
        // Write those blocks, then the new table, then flush.
        self.write_dirty_rc().await?;
        let mut tbytes = vec![0u8; (table_clusters << bits) as usize];
        words_to_bytes(&table, &mut tbytes);
        let buf = self.exec.alloc_buf(self.dev, tbytes.len());
        buf.copy_in(0, &tbytes);
        self.exec
            .write(self.dev, start << bits, BufSlice::whole(buf))
            .await?;
        self.exec.flush(self.dev).await?;
        if let Some(sh) = self.published() {
            for c in start..start + table_clusters {
                sh.set_meta_cluster(c);
            }
        }
        // Then the header.
        {
            let mut h = self.header.borrow_mut();
            h.header.refcount_table_offset = start << bits;
            h.header.refcount_table_clusters = table_clusters as u32;
            let mut st = m.st_mut();
            st.header
                .set_refcount_table(start << bits, table_clusters as u32);
            st.dirty.clear_rt();
            st.alloc.written_below(end);
        }
        self.write_header().await?;
        self.exec.flush(self.dev).await?;
        // Finally the old table's clusters are free.
        let old = HostRange::new(HostOffset(old_off), old_clusters << bits);
        m.st_mut().frees.free_later(old, FreeKind::Other);
        Ok(())
    }
}
