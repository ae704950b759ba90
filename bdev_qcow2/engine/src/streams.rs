//! The stream table both stream detectors are built on — read-ahead of L2 slices
//! ([`ReadAhead`](crate::prefetch::ReadAhead)) and the prefetch ring's hot half
//! ([`ring::Hot`](crate::ring::Hot)): where each followed stream continues, and the round
//! robin that says which slot a new stream takes first. A request continues the stream
//! whose next request starts where it starts; each detector decides what a stream is worth
//! (its run, its chunks) and which slots a new stream may take.
//!
//! Plain cells: one table per chain, on the chain's core.

use std::cell::Cell;

/// Streams followed at once by each detector.
pub const STREAMS: usize = 4;

// The search rotates a mask of slots in a `u32`; the round robin's position is a `u8`
// taken modulo STREAMS, which must divide 256 to wrap evenly.
const _: () = assert!(STREAMS <= 8 && 256 % STREAMS == 0);
/// Every slot, a bit each.
pub(crate) const ALL: u32 = (1 << STREAMS) - 1;

/// Where [`STREAMS`] streams continue, and whose turn it is.
#[derive(Debug)]
pub(crate) struct StreamSlots {
    /// Where each stream's next request starts (`u64::MAX`: none).
    next: [Cell<u64>; STREAMS],
    /// Where the search for a slot for a new stream starts (round robin; taken modulo
    /// [`STREAMS`], so that moving it on is one add).
    victim: Cell<u8>,
}

impl Default for StreamSlots {
    fn default() -> Self {
        StreamSlots {
            next: std::array::from_fn(|_| Cell::new(u64::MAX)),
            victim: Cell::new(0),
        }
    }
}

impl StreamSlots {
    /// The stream whose next request starts at `offset`.
    #[inline(always)]
    pub(crate) fn find(&self, offset: u64) -> Option<usize> {
        self.next.iter().position(|n| n.get() == offset)
    }

    /// Whether a stream's next request starts at `offset`.
    #[inline(always)]
    pub(crate) fn continues(&self, offset: u64) -> bool {
        self.next.iter().any(|n| n.get() == offset)
    }

    /// Stream `i` was started or continued by a request ending at `end`: the slot just
    /// used is the last a new stream would take.
    #[inline(always)]
    pub(crate) fn moved(&self, i: usize, end: u64) {
        self.next[i].set(end);
        self.victim.set(i as u8 + 1);
    }

    /// Where stream `i` continues.
    #[inline(always)]
    pub(crate) fn next(&self, i: usize) -> u64 {
        self.next[i].get()
    }

    /// Where each stream continues.
    pub(crate) fn nexts(&self) -> impl Iterator<Item = u64> + '_ {
        self.next.iter().map(Cell::get)
    }

    /// The round robin's position: the slot a new stream takes first.
    #[inline(always)]
    pub(crate) fn turn(&self) -> usize {
        self.victim.get() as usize % STREAMS
    }

    /// The first slot of `mask` (a bit per slot) from the round robin's position on.
    #[inline(always)]
    pub(crate) fn first_of(&self, mask: u32) -> Option<usize> {
        let v = self.turn() as u32;
        let turned = ((mask | mask << STREAMS) >> v) & ALL;
        (turned != 0).then(|| ((v + turned.trailing_zeros()) as usize) % STREAMS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_stream_takes_the_first_slot_of_a_mask_in_turn() {
        let s = StreamSlots::default();
        assert_eq!(s.first_of(ALL), Some(0));
        s.moved(1, 4096);
        assert_eq!(s.find(4096), Some(1));
        assert_eq!(s.turn(), 2);
        assert_eq!(s.first_of(0b0011), Some(0));
        assert_eq!(s.first_of(0b1000), Some(3));
        assert_eq!(s.first_of(0), None);
        s.moved(3, 8192);
        assert_eq!(s.turn(), 0);
    }
}
