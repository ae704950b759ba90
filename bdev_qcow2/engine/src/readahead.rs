//! Read-ahead for a chain: tells the stream detector (`prefetch`) about each guest request
//! and loads the next L2 slice of a sequential stream into this replica's cache in the
//! background.
//!
//! Above the chain and the detector: neither uses this module.

use crate::chain::{Chain, Layer};
use crate::io::BlockDevice;
use crate::prefetch::PrefetchStats;
use crate::slice_load::SliceLoad;
use crate::types::GuestOffset;
use std::rc::Rc;

impl<D: BlockDevice> Chain<D> {
    /// Turns read-ahead of L2 slices on sequential streams on or off for this replica
    /// (off by default; hosts turn it on per their configuration).
    pub fn set_prefetch(&self, on: bool) {
        self.pf_hot.on.set(on);
    }

    /// Whether read-ahead is on.
    pub fn prefetch_enabled(&self) -> bool {
        self.pf_hot.on.get()
    }

    /// Read-ahead counters.
    pub fn prefetch_stats(&self) -> PrefetchStats {
        self.prefetch.borrow().stats
    }

    /// Tells read-ahead about a guest request (read or write) of `len` bytes at `offset`
    /// that this replica is about to serve or route; when it continues a sequential stream
    /// and the stream's next slice is not cached here, starts loading that slice in the
    /// background (the engine's own request on this executor, `slice_load.rs`; a task
    /// only when its records cannot take it; a failure is left to the request that needs
    /// the slice, which reports it). Costs a few compares when off or on random I/O.
    #[inline]
    pub fn read_ahead(self: &Rc<Self>, offset: u64, len: u64) {
        if !self.pf_hot.on.get() || len == 0 {
            return;
        }
        if let Ok(i) = self.pf_hot.find_or_start(offset, len) {
            self.continue_stream(i, offset, len);
        }
    }

    /// [`read_ahead`](Self::read_ahead) for a request that the memo of slices
    /// mapped (a [`Grant`](crate::Grant) `from_memo`): its slice is cached, and what
    /// read-ahead would load is the next one, so only a request that ends in the slice's
    /// tail (its last eighth, at least [`TAIL_MIN`](crate::prefetch::TAIL_MIN)) is
    /// watched. A sequential stream is seen there and its next slice loads before the
    /// stream reaches it; a random request elsewhere in the slice costs one compare instead
    /// of the stream look-up. (A stream is counted again in each slice's tail.)
    #[inline(always)]
    pub fn read_ahead_memo(self: &Rc<Self>, offset: u64, len: u64) {
        if (offset & self.pf_hot.tail_mask) + len > self.pf_hot.tail_from {
            self.read_ahead(offset, len);
        }
    }

    /// [`read_ahead`](Self::read_ahead) for a request that continues stream `i`.
    #[inline(never)]
    fn continue_stream(self: &Rc<Self>, i: usize, offset: u64, len: u64) {
        let Layer::Qcow2(q) = &self.layers()[0] else {
            return;
        };
        let coverage = q.geometry().slice_coverage();
        let Ok(mut p) = self.prefetch.try_borrow_mut() else {
            return;
        };
        let target = p.advance(&self.pf_hot, i, offset, len, coverage, self.size());
        if self.pf_hot.is_sequential_run(i) {
            self.pf_hot.mark_sequential(i);
        }
        drop(p);
        let Some(target) = target else {
            return;
        };
        // Cached already; no L2 table there (nothing to load: it reads as zeros); or, on a
        // core replica, held dirty by the owner (a stream of first writes: the copy would
        // cost a message pair and be stale at the owner's next change).
        if q.slice_is_current(GuestOffset(target))
            || q.slice_dirty_elsewhere(GuestOffset(target))
            || !matches!(q.l2_table(GuestOffset(target)), Ok(Some(_)))
        {
            return;
        }
        self.prefetch.borrow_mut().stats.issued += 1;
        // Without a task as a rule (`slice_load.rs`): its end comes to `slice_ahead_loaded`.
        if self.load_slice_ahead(0, target, true) != SliceLoad::Refused {
            return;
        }
        // Every record busy, or a slice the owner holds dirty: a task.
        let chain = self.clone();
        self.exec().spawn(async move {
            let Layer::Qcow2(q) = &chain.layers()[0] else {
                return;
            };
            if let Ok(Some(_)) = q.load_slice(GuestOffset(target)).await {
                chain.slice_ahead_loaded(target);
            }
        });
    }

    /// The slice covering `target` that read-ahead asked for is cached: counts it, and
    /// remembers it to count the stream reaching it.
    pub(crate) fn slice_ahead_loaded(&self, target: u64) {
        let Layer::Qcow2(q) = &self.layers()[0] else {
            return;
        };
        let coverage = q.geometry().slice_coverage();
        let key = target / coverage;
        // A stream already in the slice was not helped: not remembered as a hit.
        let late =
            self.pf_hot.next.iter().any(|n| {
                n.get() != u64::MAX && n.get() > target && (n.get() - 1) / coverage == key
            });
        let mut p = self.prefetch.borrow_mut();
        p.stats.loaded += 1;
        if !late {
            p.remember_loaded(key);
        }
    }
}
