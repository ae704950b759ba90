//! The write-back at the dirty bound, which lets allocations run while its L2 slices are
//! written (#48): random first writes over a large disk dirty a new slice with nearly every
//! allocation, so the bound is reached every few thousand of them, and a write-back of some
//! 2,000 slices under the metadata lock stalled every allocating write for its duration.
//!
//! Under the lock: phase 1 as always (refcounts, then a flush that also makes every data
//! write completed so far stable), then a snapshot of what that made safe to write — the
//! dirty slices (into the writing set, where they stay readable), the dirty L1 entries
//! with the sectors holding them, the pending frees. The lock is released while the
//! slices are written: allocations meanwhile change copies of their own (dirty again,
//! written by a later write-back whose phase 1 covers their refcounts and data). Then,
//! under the lock again: a flush, the snapshot's L1 sectors, a flush, the snapshot's frees
//! (phase 3). Every other write-back first waits for the slices in flight
//! ([`Owner::wait_window`]) and takes the snapshot's L1 entries and frees with its own, so
//! a guest flush meanwhile still makes them stable; this one then writes only what is left
//! of its snapshot, and nothing at all when another write-back ran (its sectors may be
//! older than what that one wrote). Nothing is written here that the locked write-back
//! would not have written in the same order (ARCHITECTURE.md §7).

use super::writeback::table_sectors;
use super::Owner;
use crate::error::Result;
use crate::io::BlockDevice;

impl<D: BlockDevice> Owner<'_, D> {
    /// Writes back when the dirty set has grown past its bound, as the locked write-back
    /// does but with the lock released while the slices are written (see the module doc).
    /// The caller does not hold the metadata lock.
    pub(crate) async fn writeback_at_bound(&self) -> Result<()> {
        let m = self.meta();
        let g = m.lock().lock().await;
        if !self.over_bound() || m.st().dirty.writing_any() {
            // Written back meanwhile, or a write-back at the bound is writing already.
            return Ok(());
        }
        let moves = m.st().header.is_dirty() || m.st().dirty.has_rt();
        if moves {
            // A table moved or the refcount table grew: the ordinary write-back.
            return self.writeback_locked().await;
        }
        {
            let mut st = m.st_mut();
            st.stats.writebacks += 1;
            st.stats.writebacks_at_bound += 1;
        }
        let lazy = self.header.borrow().lazy_refcounts();
        self.write_refcounts_first(lazy).await?;
        let keys = m.st_mut().dirty.begin_slice_writeback();
        let targets = self.slice_targets(&keys).await?;
        let (l1_off, l1_sectors, writebacks) = {
            let mut st = m.st_mut();
            let l1 = st.dirty.take_l1_window();
            st.frees.take_pending_window();
            let words: Vec<u64> = self.l1.borrow().iter().map(|e| e.0).collect();
            let off = self.header.borrow().header.l1_table_offset;
            (off, table_sectors(&words, &l1), st.stats.writebacks)
        };
        let allocated = m.st().stats.clusters_allocated;
        drop(g);
        // Allocations run meanwhile.
        let written = self.write_slices(&targets).await;
        m.window_closed();
        {
            let mut st = m.st_mut();
            st.stats.clusters_allocated_during_writeback += st.stats.clusters_allocated - allocated;
        }
        let _g = m.lock().lock().await;
        let (l1, frees) = {
            let mut st = m.st_mut();
            (st.dirty.end_l1_window(), st.frees.end_window())
        };
        let alone = m.st().stats.writebacks == writebacks
            && self.header.borrow().header.l1_table_offset == l1_off;
        if written.is_err() || !alone {
            // Dirty and pending again (when another write-back ran, it took them already;
            // a later one writes them after every slice).
            let mut st = m.st_mut();
            st.dirty.l1_not_written(l1);
            st.frees.restore_pending(frees);
            return written;
        }
        // The slices stable before the L1 entries naming new tables (rule 4).
        let r = self.exec.flush(self.dev).await;
        let r = match r {
            Ok(()) if !l1.is_empty() => match self.write_sectors(l1_off, &l1_sectors).await {
                Ok(()) => self.exec.flush(self.dev).await,
                Err(e) => Err(e),
            },
            r => r,
        };
        if let Err(e) = r {
            let mut st = m.st_mut();
            st.dirty.l1_not_written(l1);
            st.frees.restore_pending(frees);
            return Err(e);
        }
        // Phase 3: the removals the slices held are stable.
        self.apply_frees(frees, lazy).await?;
        self.process_discards().await;
        Ok(())
    }

    /// Waits until no slice of a write-back at the bound is being written (every slice is
    /// then dirty or written), and makes what it wrote stable: the caller takes its L1
    /// entries and frees, which need its slices stable first even when the caller has no
    /// slice of its own to write (and so no flush of its own before them).
    pub(crate) async fn wait_window(&self) -> Result<()> {
        let m = self.meta();
        if !m.st().dirty.writing_any() {
            return Ok(());
        }
        while m.st().dirty.writing_any() {
            m.wait_window_closed().await;
        }
        self.exec.flush(self.dev).await
    }
}
