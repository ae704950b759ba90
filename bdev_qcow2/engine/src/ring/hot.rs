//! The chain's one stream table ([`Hot`]), which both users of sequential streams read:
//! the prefetch ring (data read ahead into the ring, `ring/`) and read-ahead of L2
//! slices (`prefetch.rs`). Each request is looked up in it once: every read by the ring
//! while the ring is on ([`Hot::passes`], then [`Ring::lookup`](super::Ring::lookup)),
//! and the requests read-ahead watches that the ring did not see ([`Hot::watch`]: writes,
//! and reads while the ring is off). A stream keeps one slot for both; what each user
//! keeps of it beside the slot (the ring's window and chunks, read-ahead's run) is reset
//! when the slot is restarted.
//!
//! [`StreamSlots`] holds where each followed stream continues, the round robin that says
//! which slot a new stream takes first, and where recent requests that continued nothing
//! ended. The rest of [`Hot`] sits on plain cells outside the ring's `RefCell`: which
//! slots a new stream may take without touching the ring's state, when each stream last
//! moved, and read-ahead's share of each stream.
//!
//! A random request continues no stream and no recent request:
//! [`StreamSlots::continues_nothing`] finds that with one hash of its offset, a bit of a
//! mask and one compare, and records where the request ends in a small table indexed by
//! the same hash ([`ENDS`] slots of the end's low 32 bits: four cache lines, which stay in
//! the L1 cache between random requests where eight lines of whole offsets did not), with
//! no borrow and no call; it takes no stream slot. A request that starts where a recent
//! request ended is the second of a stream: that earlier request's stream takes its slot
//! then, as if the earlier request had started it, and this request continues it — so a
//! sequential chain is followed from the same request as when every request took a slot.
//! In the ring, everything else — a read that continues a stream, or one whose stream must
//! push out a stream holding chunks — goes to [`Ring::lookup`](super::Ring::lookup). A
//! stream restarted here is marked fresh; the ring resets the rest of its state (its run,
//! window, off switch) when the stream is next continued. The hot half also counts reads
//! and when each stream was last started or continued: a stream not continued in
//! [`STALE_READS`] reads has left, and its slot goes to the ring to hand on.

use super::STALE_READS;
use std::cell::Cell;

/// Streams followed at once per chain.
pub const STREAMS: usize = 4;

// The search rotates a mask of slots in a `u32`; the round robin's position is a `u8`
// taken modulo STREAMS, which must divide 256 to wrap evenly.
const _: () = assert!(STREAMS <= 8 && 256 % STREAMS == 0);
/// Every slot, a bit each.
const ALL: u32 = (1 << STREAMS) - 1;

/// Slots of the table of recent reads' ends (a power of two: the hash's top bits index
/// it, and the streams' mask has a bit per slot).
pub const ENDS: usize = 64;
const _: () = assert!(ENDS.is_power_of_two() && ENDS <= 64);

/// The hash of the table of ends (Fibonacci hashing: the top bits of a multiplication, so
/// that ends a request size apart spread over every slot), and the shift to its top bits.
const HASH: u64 = 0x9E37_79B9_7F4A_7C15;
const HASH_SHIFT: u32 = 64 - ENDS.trailing_zeros();

/// The slot of byte offset `x` in the table of ends.
#[inline(always)]
fn slot_of(x: u64) -> usize {
    (x.wrapping_mul(HASH) >> HASH_SHIFT) as usize
}

/// What the table of ends keeps of an end: its low 32 bits. Two ends in one slot that
/// share them lie a multiple of 4 GiB apart (once in 2^23 random pairs of 512-byte aligned
/// ends): a read then starts a stream that its next read does not continue (the ring reads
/// ahead only after [`SEQ_MIN`](super::SEQ_MIN) reads of one).
type EndBits = u32;

/// An empty slot: bits no end has (every read is 512-byte aligned, or refused).
const NO_END: EndBits = EndBits::MAX;

/// The table of ends, on cache lines of its own.
#[repr(align(64))]
struct Ends([Cell<EndBits>; ENDS]);

impl std::fmt::Debug for Ends {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ends")
    }
}

/// Where [`STREAMS`] streams continue, whose turn it is, and where recent requests that
/// continued nothing ended: a request that starts at none of those is random, found with
/// one hash ([`continues_nothing`](Self::continues_nothing)); one that starts where a
/// recent request ended is the second of a stream, which takes a slot then.
#[derive(Debug)]
struct StreamSlots {
    /// Where each stream's next request starts (`u64::MAX`: none).
    next: [Cell<u64>; STREAMS],
    /// Where the search for a slot for a new stream starts (round robin; taken modulo
    /// [`STREAMS`], so that moving it on is one add).
    victim: Cell<u8>,
    /// Where recent requests that continued nothing ended ([`EndBits`]), each in the slot
    /// of its hash ([`NO_END`]: none; a later end with the same hash replaces it).
    ends: Ends,
    /// A bit per slot of `ends` whose hash some stream's next request has: a request whose
    /// bit is clear continues no stream, without looking at them. Kept whenever a stream
    /// moves.
    at: Cell<u64>,
}

impl Default for StreamSlots {
    fn default() -> Self {
        StreamSlots {
            next: std::array::from_fn(|_| Cell::new(u64::MAX)),
            victim: Cell::new(0),
            ends: Ends(std::array::from_fn(|_| Cell::new(NO_END))),
            at: Cell::new(0),
        }
    }
}

impl StreamSlots {
    /// The stream whose next request starts at `offset`.
    #[inline(always)]
    pub(crate) fn find(&self, offset: u64) -> Option<usize> {
        self.next.iter().position(|n| n.get() == offset)
    }

    /// Stream `i` was started or continued by a request ending at `end`: the slot just
    /// used is the last a new stream would take, and the mask of the streams' next
    /// requests follows.
    #[inline(always)]
    pub(crate) fn moved(&self, i: usize, end: u64) {
        self.next[i].set(end);
        self.victim.set(i as u8 + 1);
        let at = self
            .nexts()
            .filter(|&n| n != u64::MAX)
            .fold(0u64, |m, n| m | 1 << slot_of(n));
        self.at.set(at);
    }

    /// A request of `len` bytes at `offset`: true when it continues no stream and starts
    /// where no recent request ended (its end is recorded then), by one hash of its
    /// offset, a bit of the streams' mask and one compare. False: it may continue a stream
    /// ([`find`](Self::find)) or a recent request ([`ended_at`](Self::ended_at)).
    #[inline(always)]
    pub(crate) fn continues_nothing(&self, offset: u64, len: u64) -> bool {
        // (`slot_of` written out: the request path's functions stay few, tests/read_path.py.)
        let h = (offset.wrapping_mul(HASH) >> HASH_SHIFT) as usize;
        if self.at.get() >> h & 1 == 0 && self.ends.0[h].get() != offset as EndBits {
            // (Wraps only past the end of any disk: an end no request starts at.)
            let end = offset.wrapping_add(len);
            self.ends.0[(end.wrapping_mul(HASH) >> HASH_SHIFT) as usize].set(end as EndBits);
            return true;
        }
        false
    }

    /// Whether a recent request that continued no stream ended at `offset`, by the bits the
    /// table keeps ([`EndBits`]).
    #[inline]
    pub(crate) fn ended_at(&self, offset: u64) -> bool {
        self.ends.0[slot_of(offset)].get() == offset as EndBits
    }

    /// A request that continued nothing ended at `end`.
    #[inline]
    pub(crate) fn note_end(&self, end: u64) {
        self.ends.0[slot_of(end)].set(end as EndBits);
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

/// Read-ahead's share of a stream (`prefetch.rs`): requests in a row, and the last slice
/// asked for (`u64::MAX`: none). Reset when its slot is restarted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SliceRun {
    pub(crate) run: u32,
    pub(crate) asked: u64,
}

impl SliceRun {
    /// A stream just started: the request that started it counts.
    const STARTED: SliceRun = SliceRun {
        run: 1,
        asked: u64::MAX,
    };
}

/// What the hot half says of a read ([`Hot::passes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Passes {
    /// The ring's state decides ([`Ring::lookup`](super::Ring::lookup)).
    ToRing,
    /// The ring has nothing to do with the read.
    By,
    /// Nor with this read, which continued stream `.0`: one the ring turned off for good
    /// and holds nothing of (it reads nothing ahead for it again until the slot is
    /// restarted). Read-ahead of L2 slices still follows it.
    ByStream(u8),
}

impl Passes {
    /// Whether the ring has nothing to do with the read.
    pub fn by(self) -> bool {
        self != Passes::ToRing
    }
}

/// The chain's stream table: where the followed streams continue and which slots are free
/// to take (see the module documentation). One per core's chain, next to the fields every
/// request reads.
#[derive(Debug)]
pub struct Hot {
    /// Whether the ring is on: every read looks at it, here with the rest.
    on: Cell<bool>,
    /// Where each stream's next request starts, and the round robin.
    slots: StreamSlots,
    /// Per slot: a new stream may not take it here (the ring reads ahead for it, or it
    /// holds chunks). Bytes rather than bits: one compare to test, one store to set.
    busy: [Cell<bool>; STREAMS],
    /// Slots whose stream read-ahead found sequential (a bit each): a new stream takes
    /// another slot first, so that random requests between its requests do not push it
    /// out.
    seq: Cell<u8>,
    /// Per slot: read-ahead's share of its stream.
    slice_runs: [Cell<SliceRun>; STREAMS],
    /// Per slot: restarted here, its state in the ring not reset yet.
    fresh: [Cell<bool>; STREAMS],
    /// Per slot: the ring turned its stream off for good and holds none of its chunks; its
    /// reads pass here ([`Passes::ByStream`]) and skip the ring's look-up, whose answer
    /// would be a miss and no read-ahead.
    dormant: [Cell<bool>; STREAMS],
    /// Reads looked at so far, and the read that last started or continued each stream:
    /// a stream not continued in [`STALE_READS`] reads has left.
    reads: Cell<u64>,
    last: [Cell<u64>; STREAMS],
}

impl Default for Hot {
    fn default() -> Self {
        Hot {
            on: Cell::new(false),
            slots: StreamSlots::default(),
            busy: Default::default(),
            seq: Cell::new(0),
            slice_runs: std::array::from_fn(|_| Cell::new(SliceRun::STARTED)),
            fresh: Default::default(),
            dormant: Default::default(),
            reads: Cell::new(0),
            last: Default::default(),
        }
    }
}

impl Hot {
    /// The ring is on from now on.
    pub(super) fn turn_on(&self) {
        self.on.set(true);
    }

    /// Whether the ring is on.
    #[inline(always)]
    pub(super) fn is_on(&self) -> bool {
        self.on.get()
    }

    /// A read of `len` bytes at `offset` arrives. [`Passes::By`] when the ring has nothing
    /// to do with it: the ring is off, or the read continues no stream and starts where no
    /// recent read ended (it is a miss; where it ends is recorded), or it is the second of
    /// a stream that a slot neither reading ahead nor holding chunks takes here.
    /// [`Passes::ByStream`] when it continues a dormant stream (moved on here).
    /// [`Passes::ToRing`]: the ring's state decides ([`Ring::lookup`](super::Ring::lookup)).
    ///
    /// Every read runs it, and a random read nothing else of the ring: the count, one hash,
    /// a bit of the streams' mask, one compare and one store.
    #[inline(always)]
    pub(crate) fn passes(&self, offset: u64, len: u64) -> Passes {
        if !self.on.get() {
            return Passes::By;
        }
        self.reads.set(self.reads.get() + 1);
        if self.slots.continues_nothing(offset, len) {
            return Passes::By;
        }
        self.continues(offset, len)
    }

    /// [`passes`](Self::passes) for a read whose hash a stream's next read or a recent
    /// end has.
    #[inline(never)]
    fn continues(&self, offset: u64, len: u64) -> Passes {
        if let Some(i) = self.find(offset) {
            if !self.dormant[i].get() {
                return Passes::ToRing;
            }
            // As the ring's look-up would move it (and find nothing to serve or read).
            self.continued(i, offset.saturating_add(len));
            return Passes::ByStream(i as u8);
        }
        if !self.ended_at(offset) {
            // Another offset with the same hash: a read that continues nothing.
            self.slots.note_end(offset.wrapping_add(len));
            return Passes::By;
        }
        // The stream of the read that ended here starts now, in the slot in turn if it is
        // idle (most often), else in an idle one; the ring continues it with this read.
        let v = self.slots.turn();
        let i = if !self.taken(v) {
            v
        } else if self.left(v) {
            // Its chunks must go first: the ring takes it.
            return Passes::ToRing;
        } else {
            match self.idle() {
                Some(i) => i,
                None => return Passes::ToRing,
            }
        };
        self.start(i, offset);
        Passes::ToRing
    }

    /// Whether a recent read that continued no stream ended at `offset`, by the bits the
    /// table keeps ([`EndBits`]; the ring starts its stream, which this read continues).
    #[inline]
    pub(super) fn ended_at(&self, offset: u64) -> bool {
        self.slots.ended_at(offset)
    }

    /// Stream `i` moved on to `end` (the mask of the streams' next reads follows).
    #[inline(always)]
    fn moved(&self, i: usize, end: u64) {
        self.slots.moved(i, end);
    }

    /// The stream whose next read starts at `offset`.
    #[inline(always)]
    pub(super) fn find(&self, offset: u64) -> Option<usize> {
        self.slots.find(offset)
    }

    /// Whether a new stream may not take slot `i` here: the ring reads ahead for its
    /// stream or holds chunks of it, or read-ahead found it sequential.
    #[inline(always)]
    fn taken(&self, i: usize) -> bool {
        self.busy[i].get() || self.seq.get() >> i & 1 != 0
    }

    /// The slots (a bit each) the ring is not busy with.
    fn not_busy(&self) -> u32 {
        (0..STREAMS)
            .filter(|&i| !self.busy[i].get())
            .fold(0, |m, i| m | 1 << i)
    }

    /// The first slot from the round robin's position on that a new stream may take here.
    fn idle(&self) -> Option<usize> {
        let idle = (0..STREAMS).filter(|&i| !self.taken(i));
        self.first_of(idle.fold(0, |m, i| m | 1 << i))
    }

    /// The slots (a bit each) that are idle or whose stream has left.
    pub(super) fn idle_or_left(&self) -> u32 {
        (0..STREAMS)
            .filter(|&i| !self.taken(i) || self.left(i))
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

    /// Stream `i` starts with a request ending at `end`: its state in the ring is reset
    /// when it is next continued ([`take_fresh`](Self::take_fresh)), read-ahead's at once.
    #[inline(always)]
    pub(super) fn start(&self, i: usize, end: u64) {
        self.moved(i, end);
        self.fresh[i].set(true);
        self.dormant[i].set(false);
        self.last[i].set(self.reads.get());
        self.seq.set(self.seq.get() & !(1 << i));
        self.slice_runs[i].set(SliceRun::STARTED);
    }

    /// Stream `i` was continued by a read ending at `end`: the slot just continued is the
    /// last a new stream would take.
    #[inline(always)]
    pub(super) fn continued(&self, i: usize, end: u64) {
        self.moved(i, end);
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

    /// Records whether slot `i`'s stream is dormant: turned off for good in the ring, none
    /// of its chunks held ([`Passes::ByStream`]; a restart clears it).
    pub(super) fn set_dormant(&self, i: usize, dormant: bool) {
        self.dormant[i].set(dormant);
    }

    /// A request of `len` bytes at `offset` that read-ahead watches and the ring did not
    /// look up (a write, or a read while the ring is off): the stream it continues, if
    /// any. One that continues neither a stream nor a recent request is random: only its
    /// end is recorded. One that starts where a recent request ended starts that
    /// request's stream (as if that request had started it) and continues it, in the
    /// next slot in turn that is idle (the ring is not busy with it and read-ahead did not
    /// find it sequential), else in the next the ring is not busy with (read-ahead's own
    /// streams give way; the ring's chunks are the ring's to hand on): none such, and the
    /// request continues nothing. A write that continues a stream the ring follows moves
    /// it on as a read would (a stream that mixes reads and writes stays one stream); the
    /// ring checks what it holds of the range against the write generations as ever.
    pub(crate) fn watch(&self, offset: u64, len: u64) -> Option<usize> {
        if self.slots.continues_nothing(offset, len) {
            return None;
        }
        let end = offset.saturating_add(len);
        if let Some(i) = self.find(offset) {
            self.continued(i, end);
            return Some(i);
        }
        if !self.ended_at(offset) {
            // Another offset with the same hash: a request that continues nothing.
            self.slots.note_end(end);
            return None;
        }
        let i = self.idle().or_else(|| self.first_of(self.not_busy()))?;
        self.start(i, end);
        Some(i)
    }

    /// Read-ahead's share of stream `i`.
    #[inline]
    pub(crate) fn slice_run(&self, i: usize) -> SliceRun {
        self.slice_runs[i].get()
    }

    /// Sets read-ahead's share of stream `i`; `sequential`: read-ahead found it so, and
    /// keeps its slot from new streams while it runs.
    #[inline]
    pub(crate) fn set_slice_run(&self, i: usize, run: SliceRun, sequential: bool) {
        self.slice_runs[i].set(run);
        if sequential {
            self.seq.set(self.seq.get() | 1 << i);
        }
    }

    /// Where each stream continues (`u64::MAX`: none).
    pub(crate) fn nexts(&self) -> impl Iterator<Item = u64> + '_ {
        self.slots.nexts()
    }
}

#[cfg(test)]
mod stream_slots_tests {
    use super::*;

    #[test]
    fn an_end_is_known_by_its_slot_and_low_32_bits() {
        let h = Hot::default();
        h.turn_on();
        assert!(
            !h.ended_at(0),
            "an empty slot matches no read, offset 0 included"
        );
        assert!(h.passes(0, 4096).by(), "a first read continues nothing");
        assert!(h.ended_at(4096));
        assert!(!h.ended_at(4096 + 512));
        // An end a multiple of 4 GiB further in the same slot looks the same (documented:
        // its stream is started and never continued).
        let far = (1..4096u64)
            .map(|k| 4096 + (k << 32))
            .find(|&x| slot_of(x) == slot_of(4096))
            .expect("some multiple of 4 GiB shares the slot");
        assert!(h.ended_at(far));
        let other = (1..4096u64)
            .map(|k| 4096 + (k << 32))
            .find(|&x| slot_of(x) != slot_of(4096))
            .expect("another slot");
        assert!(!h.ended_at(other));
    }

    /// A stream the ring follows, started by reads 0 and 4096: its slot.
    fn ring_stream(h: &Hot) -> usize {
        h.turn_on();
        assert!(h.passes(0, 4096).by(), "a first read continues nothing");
        assert!(
            !h.passes(4096, 4096).by(),
            "the second starts a stream for the ring"
        );
        let i = h.find(4096).expect("started in a slot");
        // As the ring's look-up continues it.
        h.continued(i, 8192);
        i
    }

    #[test]
    fn read_ahead_watches_the_streams_the_ring_follows() {
        let h = Hot::default();
        let i = ring_stream(&h);
        // A write read-ahead watches continues the ring's stream, in the same slot.
        assert_eq!(h.watch(8192, 4096), Some(i));
        assert_eq!(h.find(12288), Some(i));
        // And a random request, none.
        assert_eq!(h.watch(1 << 30, 4096), None);
        assert_eq!(h.find(12288), Some(i));
    }

    #[test]
    fn a_stream_read_ahead_found_sequential_keeps_its_slot_from_new_streams() {
        let h = Hot::default();
        let i = ring_stream(&h);
        h.set_slice_run(
            i,
            SliceRun {
                run: 4,
                asked: u64::MAX,
            },
            true,
        );
        // Streams started by the ring after it take every other slot, in turn.
        let mut taken = vec![i];
        for k in 1..STREAMS as u64 {
            let at = k << 30;
            assert!(h.passes(at, 4096).by());
            assert!(!h.passes(at + 4096, 4096).by());
            let j = h.find(at + 4096).expect("started");
            assert!(!taken.contains(&j), "slot {j} taken twice");
            taken.push(j);
        }
        assert_eq!(h.find(8192), Some(i), "the sequential stream kept its slot");
    }

    #[test]
    fn a_restarted_slot_starts_read_aheads_share_over() {
        let h = Hot::default();
        let i = ring_stream(&h);
        h.set_slice_run(i, SliceRun { run: 9, asked: 3 }, true);
        assert_eq!(h.slice_run(i), SliceRun { run: 9, asked: 3 });
        h.start(i, 1 << 20);
        assert_eq!(h.slice_run(i), SliceRun::STARTED);
        assert!(!h.taken(i), "no longer held for a sequential stream");
    }

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

    /// What the property test does to the table.
    #[derive(Debug, Clone)]
    enum Op {
        /// A read the ring looks up (as `Chain::ring_read_with` does, with
        /// `Ring::lookup`'s part on the table: continue the stream found, else start one
        /// in a slot the ring may take).
        RingRead(u64, u64),
        /// A request read-ahead watches (`Hot::watch`).
        Watch(u64, u64),
        /// The ring is, or is no longer, busy with a slot.
        Busy(usize, bool),
        /// Read-ahead found a stream sequential (a run of 9, slice 3 asked for).
        Sequential(usize),
        /// The ring turned a stream off for good, none of its chunks held (not busy).
        Dormant(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Offsets on a small grid of 4 KiB blocks: streams and recent ends meet often.
        let at = (0u64..64).prop_map(|b| b << 12);
        let len = (1u64..4).prop_map(|b| b << 12);
        prop_oneof![
            4 => (at.clone(), len.clone()).prop_map(|(o, l)| Op::RingRead(o, l)),
            4 => (at, len).prop_map(|(o, l)| Op::Watch(o, l)),
            1 => (0..STREAMS, any::<bool>()).prop_map(|(i, b)| Op::Busy(i, b)),
            1 => (0..STREAMS).prop_map(Op::Sequential),
            1 => (0..STREAMS).prop_map(Op::Dormant),
        ]
    }

    use proptest::prelude::*;

    proptest! {
        /// Whatever mix of ring reads and watched requests the table sees: the mask of the
        /// streams' next requests matches where they continue; a request the table says
        /// continues stream `i` leaves `i` continuing where it ends; `watch` never restarts
        /// a slot the ring is busy with, and a restarted slot's read-ahead share starts
        /// over.
        #[test]
        fn the_shared_table_keeps_its_invariants(
            ops in proptest::collection::vec(op(), 1..400),
            ring_on in any::<bool>(),
        ) {
            let h = Hot::default();
            if ring_on {
                h.turn_on();
            }
            for op in ops {
                match op {
                    Op::RingRead(o, l) => {
                        let before: Vec<u64> = h.nexts().collect();
                        let passes = h.passes(o, l);
                        if let Passes::ByStream(i) = passes {
                            let i = i as usize;
                            prop_assert_eq!(before[i], o, "passed by a stream it does not continue");
                            prop_assert!(h.dormant[i].get());
                            prop_assert_eq!(h.next(i), o + l);
                        }
                        if !passes.by() {
                            let i = match h.find(o) {
                                Some(i) => i,
                                None => {
                                    let i = h.first_of(h.idle_or_left()).unwrap_or(0);
                                    h.start(i, o);
                                    i
                                }
                            };
                            h.continued(i, o + l);
                            prop_assert_eq!(h.next(i), o + l);
                        }
                    }
                    Op::Watch(o, l) => {
                        let before: Vec<u64> = h.nexts().collect();
                        let busy: Vec<bool> = h.busy.iter().map(Cell::get).collect();
                        if let Some(i) = h.watch(o, l) {
                            prop_assert_eq!(h.next(i), o + l);
                            if before[i] != o {
                                prop_assert!(!h.dormant[i].get(), "restarted slot {} dormant", i);
                                prop_assert!(!busy[i], "restarted slot {} the ring holds", i);
                                prop_assert_eq!(h.slice_run(i), SliceRun::STARTED);
                            }
                        }
                    }
                    Op::Busy(i, b) => h.set_busy(i, b),
                    Op::Dormant(i) => {
                        h.set_busy(i, false);
                        h.set_dormant(i, true);
                    }
                    Op::Sequential(i) => {
                        let run = SliceRun { run: 9, asked: 3 };
                        h.set_slice_run(i, run, true);
                    }
                }
                let mask = h
                    .nexts()
                    .filter(|&n| n != u64::MAX)
                    .fold(0u64, |m, n| m | 1 << slot_of(n));
                prop_assert_eq!(h.slots.at.get(), mask);
            }
        }
    }
}
