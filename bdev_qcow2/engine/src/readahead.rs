//! Read-ahead for a chain: hands its [`ReadAhead`] part (`prefetch`) each guest request
//! that continues a stream of the chain's stream table, and loads the next L2 slice of a
//! sequential stream into this replica's cache in the background.
//!
//! Above the chain and the detector: neither uses this module.

use crate::chain::Chain;
use crate::io::BlockDevice;
use crate::prefetch::ReadAhead;
use crate::slice_load::SliceLoad;
use crate::types::GuestOffset;
use std::rc::Rc;

impl<D: BlockDevice> Chain<D> {
    /// The chain's read-ahead part: on or off, counters.
    pub fn prefetch(&self) -> &ReadAhead {
        &self.readahead
    }

    /// Tells read-ahead about a guest request (read or write) of `len` bytes at `offset`
    /// that this replica is about to serve or route and that the prefetch ring did not
    /// look up: it is looked up in the chain's stream table
    /// ([`Hot::watch`](crate::ring::Hot::watch)); when it continues a sequential stream
    /// and the stream's next slice is not cached here, that slice starts loading in the
    /// background (the engine's own request on this executor, `slice_load.rs`; a task
    /// only when its records cannot take it; a failure is left to the request that needs
    /// the slice, which reports it). Costs a few compares when off or on random I/O.
    #[inline]
    pub fn read_ahead(self: &Rc<Self>, offset: u64, len: u64) {
        if let Some(i) = self.readahead.watch(self.ring.hot(), offset, len) {
            self.continue_stream(i, offset, len);
        }
    }

    /// [`read_ahead`](Self::read_ahead) for a guest read after the prefetch ring's look-up:
    /// `stream` is the stream it continued there. `None`: the ring continued none (the read
    /// is random, or starts a stream), or, while the ring is off, it did not look the read
    /// up, and read-ahead does.
    #[inline(never)]
    pub(crate) fn read_ahead_after_ring(
        self: &Rc<Self>,
        stream: Option<u8>,
        offset: u64,
        len: u64,
    ) {
        match stream {
            Some(i) if self.readahead.is_on() => self.continue_stream(i as usize, offset, len),
            Some(_) => {}
            None if self.ring.is_on() => {}
            None => self.read_ahead(offset, len),
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
        if self.readahead.in_tail(offset, len) {
            self.read_ahead(offset, len);
        }
    }

    /// [`read_ahead`](Self::read_ahead) for a request that continues stream `i`.
    #[inline(never)]
    fn continue_stream(self: &Rc<Self>, i: usize, offset: u64, len: u64) {
        let Some(q) = self.disk.top_qcow2() else {
            return;
        };
        let coverage = q.geometry().slice_coverage();
        let Some(target) =
            self.readahead
                .advance(self.ring.hot(), i, offset, len, coverage, self.size())
        else {
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
        self.readahead.count_issued();
        // Without a task as a rule (`slice_load.rs`): its end comes to `slice_ahead_loaded`.
        if self.load_slice_ahead(0, target, true) != SliceLoad::Refused {
            return;
        }
        // Every record busy, or a slice the owner holds dirty: a task.
        let chain = self.clone();
        self.exec().spawn(async move {
            let Some(q) = chain.disk.top_qcow2() else {
                return;
            };
            if let Ok(Some(_)) = q.load_slice(GuestOffset(target)).await {
                chain.slice_ahead_loaded(target);
            }
        });
    }

    /// The slice covering `target` that read-ahead asked for is cached: counts it.
    pub(crate) fn slice_ahead_loaded(&self, target: u64) {
        if let Some(q) = self.disk.top_qcow2() {
            self.readahead
                .loaded(self.ring.hot(), target, q.geometry().slice_coverage());
        }
    }
}
