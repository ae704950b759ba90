//! The ordered write-back of the owner's dirty metadata, which keeps every crash state
//! consistent (ARCHITECTURE.md §7), and the flush and close built on it.
//!
//! Ordering is expressed as phases of one write-back, each a dependency of the next:
//! 1. refcount blocks (increments; new blocks are self-describing) — then a flush, then the
//!    refcount-table entries of new blocks — then a flush. That flush also makes every data
//!    write completed so far stable, so (rule 3) no L2 entry can reach the device before the
//!    data it points at.
//! 2. L2 slices (new tables whole) — then a flush — then L1 entries of new tables — flush.
//! 3. Frees: references removed by phase 2 are now stable, so the refcount decrements are
//!    applied and written — flush — and only then may the allocator reuse those clusters.
//! 4. The header, when a table moved or the dirty bit goes.
//!
//! With lazy refcounts (rule 7) phase 1 writes no refcount block: the dirty bit, set and
//! stable first, tells a later open to rebuild them. Every metadata mutation runs under the
//! metadata lock, so a write-back sees a consistent set. On error, whatever was not written
//! stays dirty.

use super::{words_to_bytes, Owner};
use crate::coherency::SliceStamp;
use crate::error::{corrupt, Field, Result};
use crate::io::{BlockDevice, BufSlice, IoBuffer, SECTOR};
use crate::types::GuestOffset;
use std::collections::{BTreeMap, BTreeSet};

/// Metadata writes of one phase in flight at once. One at a time, a write-back of the
/// 8 MiB bound (2,048 slices of 4 KiB) took 2,048 device round trips under the metadata
/// lock, which every allocating write waited out (p99 of first writes in tens of ms); the
/// order inside a phase does not matter (the flush after it does).
const WRITEBACK_BATCH: usize = 64;

impl<D: BlockDevice> Owner<'_, D> {
    /// Writes all dirty metadata in dependency order (see the module doc). The caller holds
    /// the metadata lock. On error, whatever was not written stays dirty.
    pub(crate) async fn writeback_locked(&self) -> Result<()> {
        self.writeback_mode(false).await
    }

    /// Write-back; with lazy refcounts (and not `full`), refcount blocks stay in memory and
    /// the dirty bit, set and stable first, tells a later open to rebuild them (rule 7).
    pub(crate) async fn writeback_mode(&self, full: bool) -> Result<()> {
        // A write-back at the bound may be writing slices without the lock: its writes
        // complete first, so this one sees every slice dirty or written (window.rs).
        self.wait_window().await?;
        let m = self.meta();
        m.st_mut().stats.writebacks += 1;
        let lazy = !full && self.header.borrow().lazy_refcounts();
        let has_l2 = m.st().dirty.has_l2_or_l1();
        // Phase 1: refcounts (and the data written so far) before any L2/L1 reference.
        self.write_refcounts_first(lazy).await?;
        // Phase 2: L2 slices, then L1 entries of new tables.
        if has_l2 {
            self.write_dirty_slices().await?;
            let l1_dirty = m.st_mut().dirty.take_l1();
            if !l1_dirty.is_empty() {
                self.exec.flush(self.dev).await?;
                let words: Vec<u64> = self.l1.borrow().iter().map(|e| e.0).collect();
                let off = self.header.borrow().header.l1_table_offset;
                if let Err(e) = self.write_table_sectors(off, &words, &l1_dirty).await {
                    m.st_mut().dirty.l1_not_written(l1_dirty);
                    return Err(e);
                }
            }
            self.exec.flush(self.dev).await?;
        }
        // Phase 3: frees whose removal is now stable.
        let frees = m.st_mut().frees.take_pending();
        self.apply_frees(frees, lazy).await?;
        // Freed clusters whose decrement is stable (and grace period over) go to the
        // device's discard before the allocator may take them.
        self.process_discards().await;
        // Phase 4: the header.
        if full && m.st().header.dirty_bit_on_disk() {
            // Every refcount is stable now: the dirty bit can go.
            m.st_mut().header.clear_dirty_bit();
        }
        if m.st().header.is_dirty() {
            self.write_header().await?;
            self.exec.flush(self.dev).await?;
        }
        Ok(())
    }

    /// Phase 1: refcount blocks, then refcount-table entries of new blocks, each followed
    /// by a flush that also makes every data write completed so far stable (rules 1, 3 and
    /// 4). With `lazy` refcounts, no block is written: the dirty bit is set first (rule 7).
    pub(super) async fn write_refcounts_first(&self, lazy: bool) -> Result<()> {
        let m = self.meta();
        let (has_l2, rt_dirty) = {
            let st = m.st();
            (st.dirty.has_l2_or_l1(), st.dirty.has_rt())
        };
        let wrote_rc = if lazy && !rt_dirty {
            if has_l2 && !m.st().dirty.rc_is_empty() {
                self.set_dirty_bit().await?;
            }
            false
        } else {
            self.write_dirty_rc().await?
        };
        if rt_dirty {
            self.exec.flush(self.dev).await?;
            let rt_dirty = m.st_mut().dirty.take_rt();
            let table = self.refcount_table.borrow().clone();
            let off = self.header.borrow().header.refcount_table_offset;
            if let Err(e) = self.write_table_sectors(off, &table, &rt_dirty).await {
                m.st_mut().dirty.rt_not_written(rt_dirty);
                return Err(e);
            }
        }
        if wrote_rc || has_l2 || rt_dirty {
            self.exec.flush(self.dev).await?;
        }
        Ok(())
    }

    /// Phase 3: the decrements of `frees`, whose references' removal is stable, applied
    /// and written (flush), and only then the clusters handed back; with `lazy` refcounts
    /// they stay in memory and the clusters wait for a full write-back.
    pub(super) async fn apply_frees(
        &self,
        frees: Vec<(crate::types::HostRange, super::discards::FreeKind)>,
        lazy: bool,
    ) -> Result<()> {
        let m = self.meta();
        let bits = self.geo.cluster_bits;
        if lazy && !frees.is_empty() {
            // Decrements stay in memory with the other lazy refcounts; the clusters are not
            // reused until a full write-back made them stable.
            for (r, kind) in &frees {
                for c in r.clusters(bits) {
                    if self.update_refcount(c, -1).await? == 0 {
                        let mut st = m.st_mut();
                        st.frees.unstable(c, *kind);
                        st.index.remove(c);
                    }
                }
            }
        } else if !frees.is_empty() || (!lazy && !m.st().frees.none_unstable()) {
            for (r, kind) in &frees {
                for c in r.clusters(bits) {
                    let new = self.update_refcount(c, -1).await?;
                    if new == 0 {
                        let mut st = m.st_mut();
                        st.frees.unstable(c, *kind);
                        st.index.remove(c);
                        st.alloc.freed(c);
                    }
                }
            }
            self.write_dirty_rc().await?;
            self.exec.flush(self.dev).await?;
            self.release_unstable();
        }
        Ok(())
    }

    /// Phase 2's slices: each dirty slice written where its L2 table lies, in device order,
    /// [`WRITEBACK_BATCH`] at a time. The slices move to the writing set (still served from
    /// there) until their write completes; only then may a core read them from the device
    /// (epoch even).
    async fn write_dirty_slices(&self) -> Result<()> {
        let keys = self.meta().st_mut().dirty.begin_slice_writeback();
        let targets = self.slice_targets(&keys).await?;
        self.write_slices(&targets).await
    }

    /// Where each slice of `keys` (just taken into the writing set) is written; on error
    /// they are all dirty again.
    pub(super) async fn slice_targets(&self, keys: &[u64]) -> Result<Vec<(u64, u64)>> {
        let mut targets = Vec::with_capacity(keys.len());
        for &key in keys {
            match self.slice_target(key).await {
                Ok(host) => targets.push((key, host)),
                Err(e) => {
                    let m = self.meta();
                    let keys = keys.iter().copied();
                    m.st_mut().dirty.slices_not_written(keys, self.published());
                    return Err(e);
                }
            }
        }
        Ok(targets)
    }

    /// Writes the slices of the writing set at their `targets` ((slice, host offset)),
    /// [`WRITEBACK_BATCH`] at a time; on error, what was not written is dirty again.
    pub(super) async fn write_slices(&self, targets: &[(u64, u64)]) -> Result<()> {
        let m = self.meta();
        for (b, batch) in targets.chunks(WRITEBACK_BATCH).enumerate() {
            let failed = std::cell::RefCell::new(Vec::new());
            let writes = batch
                .iter()
                .map(|&(key, host)| self.write_slice(key, host, &failed))
                .collect();
            if let Err(e) = crate::exec::join_all(writes).await {
                let later = targets.get((b + 1) * WRITEBACK_BATCH..).unwrap_or(&[]);
                let keys = failed.into_inner().into_iter();
                let keys = keys.chain(later.iter().map(|&(k, _)| k));
                m.st_mut().dirty.slices_not_written(keys, self.published());
                return Err(e);
            }
        }
        Ok(())
    }

    /// Where dirty slice `key` is written: inside a known L2 table, else the image is
    /// corrupt.
    async fn slice_target(&self, key: u64) -> Result<u64> {
        let goff = GuestOffset(key * self.geo.slice_coverage());
        match self.l2_table(goff)? {
            Some(t) => {
                let host = self.geo.slice_host_offset(t, goff);
                if self.is_metadata_cluster(host.0) {
                    return Ok(host.0);
                }
                Err(self
                    .mark_corrupt(Field::L1Entry, host.0, "L2 write outside known L2 tables")
                    .await)
            }
            None => Err(corrupt(
                Field::L1Entry,
                key,
                "dirty slice without an L2 table",
            )),
        }
    }

    /// Writes slice `key` (its words in the writing set) at `host`; on success it is clean,
    /// on failure its key joins `failed`.
    async fn write_slice(
        &self,
        key: u64,
        host: u64,
        failed: &std::cell::RefCell<Vec<u64>>,
    ) -> Result<()> {
        let m = self.meta();
        let slice_bytes = 1usize << self.geo.slice_bits;
        let buf = self.exec.alloc_buf(self.dev, slice_bytes);
        let mut bytes = vec![0u8; slice_bytes];
        if let Some(words) = m.st().dirty.writing(key) {
            words_to_bytes(words, &mut bytes);
        }
        buf.copy_in(0, &bytes);
        if let Err(e) = self.exec.write(self.dev, host, BufSlice::whole(buf)).await {
            failed.borrow_mut().push(key);
            return Err(e);
        }
        let mut st = m.st_mut();
        let written = st.dirty.slice_written(key, self.published());
        st.stats.l2_slices_written += 1;
        // A slice only the dirty set held (a new table's) stays in memory, in the cache,
        // unless a newer dirty copy exists (then that one is written later).
        if let Some(words) = written {
            if !st.dirty.has_slice(key) && self.l2_cache.borrow().probe(key, 0).is_none() {
                self.cache_slice(key, SliceStamp::OWNER, |b| b.copy_from_slice(&words));
            }
        }
        Ok(())
    }

    /// Phase 1's refcount blocks (and those a growing refcount table changed),
    /// [`WRITEBACK_BATCH`] at a time: returns whether any was written.
    pub(crate) async fn write_dirty_rc(&self) -> Result<bool> {
        let m = self.meta();
        let blocks = m.st_mut().dirty.take_rc();
        if blocks.is_empty() {
            return Ok(false);
        }
        for (off, _) in &blocks {
            if !self.is_metadata_cluster(*off) {
                let e = self
                    .mark_corrupt(
                        Field::RefcountTableEntry,
                        *off,
                        "refcount block write outside known blocks",
                    )
                    .await;
                m.st_mut().dirty.rc_not_written(blocks);
                return Err(e);
            }
        }
        let mut result = Ok(());
        for batch in blocks.chunks(WRITEBACK_BATCH) {
            let writes = batch
                .iter()
                .map(|(off, bytes)| {
                    let buf = self.exec.alloc_buf(self.dev, bytes.len());
                    buf.copy_in(0, bytes);
                    self.exec.write(self.dev, *off, BufSlice::whole(buf))
                })
                .collect();
            result = crate::exec::join_all(writes).await;
            if result.is_err() {
                break;
            }
        }
        if let Err(e) = result {
            // Keep everything dirty so nothing is lost; the caller fails the request.
            m.st_mut().dirty.rc_not_written(blocks);
            return Err(e);
        }
        let mut cache = self.rc_cache.borrow_mut();
        for (off, bytes) in blocks {
            cache.insert_with(off, 0, |b| b.copy_from_slice(&bytes));
        }
        Ok(true)
    }

    /// Whether host byte `off` lies in a cluster of the owner's metadata index.
    fn is_metadata_cluster(&self, off: u64) -> bool {
        self.meta()
            .is_metadata_cluster(off >> self.geo.cluster_bits)
    }

    /// Writes the sectors of a table (`words` at host `table_off`) holding `indices`.
    async fn write_table_sectors(
        &self,
        table_off: u64,
        words: &[u64],
        indices: &BTreeSet<u64>,
    ) -> Result<()> {
        self.write_sectors(table_off, &table_sectors(words, indices))
            .await
    }

    /// Writes table sectors `sectors` (index of the sector in the table → its words) of
    /// the table at host `table_off`.
    pub(super) async fn write_sectors(
        &self,
        table_off: u64,
        sectors: &BTreeMap<u64, Vec<u64>>,
    ) -> Result<()> {
        for (s, words) in sectors {
            let mut bytes = vec![0u8; SECTOR as usize];
            words_to_bytes(words, &mut bytes);
            let buf = self.exec.alloc_buf(self.dev, bytes.len());
            buf.copy_in(0, &bytes);
            self.exec
                .write(self.dev, table_off + s * SECTOR, BufSlice::whole(buf))
                .await?;
        }
        Ok(())
    }

    /// Whether the dirty set has grown past its bound (bounded memory,
    /// `OpenOptions::dirty_bound_bytes`).
    pub(crate) fn over_bound(&self) -> bool {
        let st = self.meta().st();
        let dirty = st.dirty.slices() as u64 * (1u64 << self.geo.slice_bits)
            + st.dirty.rc_blocks() as u64 * self.geo.cluster_size();
        dirty > self.meta().dirty_bound()
    }

    /// Writes back when the dirty set has grown past the threshold (memory bound).
    pub(crate) async fn maybe_writeback_locked(&self) -> Result<()> {
        if self.over_bound() {
            // Boxed: rare, and the write path's per-request future stays small.
            Box::pin(self.writeback_locked()).await?;
        }
        Ok(())
    }

    /// Writes everything back (refcounts included, even with lazy refcounts), clears the
    /// dirty bit and flushes: the image is clean on disk when this returns.
    pub(crate) async fn close(&self) -> Result<()> {
        let _g = self.meta().lock().lock().await;
        self.writeback_mode(true).await?;
        self.exec.flush(self.dev).await?;
        if self.meta().st().bitmaps.is_some() {
            self.store_bitmaps().await?;
            // The old tables' frees.
            self.writeback_mode(true).await?;
        }
        self.lower_zeroed_tail().await
    }

    /// Guest flush: every write completed before it is stable when this returns.
    pub(crate) async fn flush(&self) -> Result<()> {
        let _g = self.meta().lock().lock().await;
        self.writeback_locked().await?;
        self.exec.flush(self.dev).await
    }
}

/// The sectors of table `words` holding `indices`, with their words (index of the sector in
/// the table → its words, the last one cut at the table's end).
pub(super) fn table_sectors(words: &[u64], indices: &BTreeSet<u64>) -> BTreeMap<u64, Vec<u64>> {
    let per_sector = (SECTOR / 8) as usize;
    indices
        .iter()
        .map(|&i| i / per_sector as u64)
        .collect::<BTreeSet<u64>>()
        .into_iter()
        .map(|s| {
            let first = s as usize * per_sector;
            let end = (first + per_sector).min(words.len());
            (s, words.get(first..end).unwrap_or(&[]).to_vec())
        })
        .collect()
}
