//! The part of the ring's stream table every read looks at, on plain cells outside the
//! ring's `RefCell`: where each stream continues, which stream slot a new stream takes
//! next, and which slots a new stream may take without touching the ring's state.
//!
//! A random read continues no stream and starts one in a slot that reads nothing ahead
//! and holds no chunk: [`Hot::start_here`] does that here, with a few compares and stores,
//! no borrow and no call. Everything else — a read that continues a stream, or one that
//! must push out a stream holding chunks — goes to [`Ring::lookup`](super::Ring::lookup).
//! A stream restarted here is marked fresh; the ring resets the rest of its state (its
//! run, window, off switch) when the stream is next continued. The hot half also counts
//! reads and when each stream was last started or continued: a stream not continued in
//! [`STALE_READS`] reads has left, and its slot goes to the ring to hand on.

use super::{STALE_READS, STREAMS};
use crate::streams::StreamSlots;
use std::cell::Cell;

/// Where the followed streams continue and which slots are free to take (see the module
/// documentation). One per core's chain, next to the fields every request reads.
#[derive(Debug)]
pub struct Hot {
    /// Where each stream's next read starts, and the round robin (the stream table
    /// read-ahead's detector is built on too).
    slots: StreamSlots,
    /// Per slot: a new stream may not take it here (reading ahead, or holding chunks).
    /// Bytes rather than bits: one compare to test, one store to set.
    busy: [Cell<bool>; STREAMS],
    /// Per slot: restarted here, its state in the ring not reset yet.
    fresh: [Cell<bool>; STREAMS],
    /// Reads looked at so far, and the read that last started or continued each stream:
    /// a stream not continued in [`STALE_READS`] reads has left.
    reads: Cell<u64>,
    last: [Cell<u64>; STREAMS],
}

impl Default for Hot {
    fn default() -> Self {
        Hot {
            slots: StreamSlots::default(),
            busy: Default::default(),
            fresh: Default::default(),
            reads: Cell::new(0),
            last: Default::default(),
        }
    }
}

impl Hot {
    /// A read of `len` bytes at `offset` arrives: when it continues no stream and a slot
    /// that neither reads ahead nor holds chunks is free, starts its stream there and
    /// returns true (the read is a miss, nothing more to do). False: the ring's state
    /// decides ([`Ring::lookup`](super::Ring::lookup)).
    #[inline(always)]
    pub fn start_here(&self, offset: u64, len: u64) -> bool {
        self.reads.set(self.reads.get() + 1);
        if self.slots.continues(offset) {
            return false;
        }
        // Most often the slot in turn is idle itself: no search.
        let v = self.slots.turn();
        let i = if !self.busy[v].get() {
            v
        } else if self.left(v) {
            // Its chunks must go first: the ring takes it.
            return false;
        } else {
            match self.idle() {
                Some(i) => i,
                None => return false,
            }
        };
        // (Wraps only past the end of any disk: a stream no read continues.)
        self.start(i, offset.wrapping_add(len));
        true
    }

    /// The stream whose next read starts at `offset`.
    #[inline(always)]
    pub(super) fn find(&self, offset: u64) -> Option<usize> {
        self.slots.find(offset)
    }

    /// The first slot from the round robin's position on that a new stream may take here.
    fn idle(&self) -> Option<usize> {
        let idle = (0..STREAMS).filter(|&i| !self.busy[i].get());
        self.first_of(idle.fold(0, |m, i| m | 1 << i))
    }

    /// The slots (a bit each) that are idle or whose stream has left.
    pub(super) fn idle_or_left(&self) -> u32 {
        (0..STREAMS)
            .filter(|&i| !self.busy[i].get() || self.left(i))
            .fold(0, |m, i| m | 1 << i)
    }

    /// Whether stream `i` was not started or continued in the last [`STALE_READS`] reads.
    pub(super) fn left(&self, i: usize) -> bool {
        self.reads.get() - self.last[i].get() > STALE_READS
    }

    /// The read that last started or continued stream `i`.
    pub(super) fn last(&self, i: usize) -> u64 {
        self.last[i].get()
    }

    /// The stream least recently started or continued, other than `but`.
    pub(super) fn least_recent(&self, but: usize) -> usize {
        (0..STREAMS)
            .filter(|&j| j != but)
            .min_by_key(|&j| self.last[j].get())
            .unwrap_or(0)
    }

    /// The first slot of `mask` (a bit per slot) from the round robin's position on.
    pub(super) fn first_of(&self, mask: u32) -> Option<usize> {
        self.slots.first_of(mask)
    }

    /// Stream `i` starts with a read ending at `end`: its state in the ring is reset when
    /// it is next continued ([`take_fresh`](Self::take_fresh)).
    #[inline(always)]
    pub(super) fn start(&self, i: usize, end: u64) {
        self.slots.moved(i, end);
        self.fresh[i].set(true);
        self.last[i].set(self.reads.get());
    }

    /// Stream `i` was continued by a read ending at `end`: the slot just continued is the
    /// last a new stream would take.
    #[inline(always)]
    pub(super) fn continued(&self, i: usize, end: u64) {
        self.slots.moved(i, end);
        self.last[i].set(self.reads.get());
    }

    /// Where stream `i` continues.
    #[inline(always)]
    pub(super) fn next(&self, i: usize) -> u64 {
        self.slots.next(i)
    }

    /// Whether stream `i` was restarted since the ring last saw it (clears the mark).
    #[inline(always)]
    pub(super) fn take_fresh(&self, i: usize) -> bool {
        self.fresh[i].replace(false)
    }

    /// Records whether slot `i` is busy (reading ahead or holding chunks).
    #[inline(always)]
    pub(super) fn set_busy(&self, i: usize, busy: bool) {
        self.busy[i].set(busy);
    }
}
