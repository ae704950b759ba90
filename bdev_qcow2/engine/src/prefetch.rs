//! L2 slice read-ahead on sequential streams, one per core replica: the chain's
//! [`ReadAhead`] part, its stream detector, state and counters (`readahead` issues the loads
//! it asks for: [`Chain::read_ahead`](crate::Chain::read_ahead)).
//!
//! A host tells its chain where each guest request goes. Four stream slots remember where
//! recent streams will continue; a request that starts exactly there extends its stream,
//! anything else takes the least recently continued slot that holds no sequential stream
//! (random I/O costs a compare per slot and never loads anything; up to three random
//! requests between a stream's requests do not push it out). Once a stream has run
//! [`SEQ_MIN`] requests in a row, the slice *after* the last one its request covers is
//! loaded into this core's cache in the background, so the stream does not wait for a
//! slice read when it crosses into it. Each slice is asked for once per stream; one cached
//! already (current epoch), one without an L2 table, and on a core one the owner holds
//! dirty are not loaded.
//!
//! Single-threaded like the rest of a replica: nothing here is shared, nothing locks.

use crate::ring::{StreamSlots, ALL, STREAMS};
use std::cell::{Cell, RefCell};

/// Requests in a row that make a stream sequential.
pub const SEQ_MIN: u32 = 4;
/// Slices loaded ahead and not yet reached, remembered to count the useful ones.
const LOADED: usize = 8;
/// The least tail of a slice in which
/// [`Chain::read_ahead_memo`](crate::Chain::read_ahead_memo) watches requests: 256
/// requests of 4 KiB, time enough for a stream to be seen and its next slice to load.
pub const TAIL_MIN: u64 = 1 << 20;

/// Read-ahead counters of one replica.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PrefetchStats {
    /// Slice loads started ahead of a sequential stream.
    pub issued: u64,
    /// ... that put a slice into the cache.
    pub loaded: u64,
    /// Slices loaded ahead that their stream reached after the load completed.
    pub hits: u64,
    /// Sequential streams detected (a stream counts once, when it reaches [`SEQ_MIN`]).
    pub streams: u64,
}

/// What every request looks at: whether read-ahead is on and where the followed streams
/// continue. Kept in the [`Chain`](crate::Chain) next to the fields every request reads, so a random
/// request costs no cache line of its own.
struct Hot {
    on: Cell<bool>,
    /// Slots holding a sequential stream (bit per slot): a new stream takes another slot
    /// first, so random requests between a stream's requests do not push it out.
    seq: Cell<u8>,
    /// Where each stream's next request starts, and the round robin (the stream table
    /// the prefetch ring's detector is built on too).
    slots: StreamSlots,
    /// Per stream: requests in a row, and the last slice asked for (`u64::MAX`: none).
    /// Here rather than in [`Prefetch`]: a random request restarts a stream.
    run: [Cell<(u32, u64)>; STREAMS],
    /// [`Chain::read_ahead_memo`](crate::Chain::read_ahead_memo)'s tail of a slice: a request whose offset within its
    /// slice (`offset & tail_mask`) plus its length passes `tail_from` ends in the tail.
    tail_mask: u64,
    tail_from: u64,
}

impl Hot {
    /// The state of a chain whose top image has slices of `coverage` bytes (`None`: a raw
    /// top layer, whose requests are all watched).
    fn new(coverage: Option<u64>) -> Self {
        let (tail_mask, tail_from) = match coverage {
            // The last eighth, at least TAIL_MIN (or the whole slice).
            Some(c) => (c - 1, c.saturating_sub((c / 8).max(TAIL_MIN))),
            None => (0, 0),
        };
        Hot {
            tail_mask,
            tail_from,
            on: Cell::new(false),
            seq: Cell::new(0),
            slots: StreamSlots::default(),
            run: std::array::from_fn(|_| Cell::new((0, u64::MAX))),
        }
    }
}

impl Hot {
    /// The stream a request at `offset` continues, if any. A request that continues
    /// neither a stream nor a recent request is random: only its end is recorded. One that
    /// starts where a recent request ended starts that request's stream (a run of 1, as if
    /// that request had started it), in a slot without a sequential stream, else in the
    /// next slot in turn (whose stream then counts as new), and continues it.
    #[inline(always)]
    fn find_or_start(&self, offset: u64, len: u64) -> Option<usize> {
        if self.slots.continues_nothing(offset, len) {
            return None;
        }
        let next = offset.saturating_add(len);
        if let Some(i) = self.slots.find(offset) {
            // The slot just continued is the last a new stream would take.
            self.slots.moved(i, next);
            return Some(i);
        }
        if !self.slots.ended_at(offset) {
            // Another offset with the same hash: a request that continues nothing.
            self.slots.note_end(next);
            return None;
        }
        // In turn, skipping sequential streams unless every slot holds one.
        let seq = self.seq.get();
        let v = self
            .slots
            .first_of(!u32::from(seq) & ALL)
            .unwrap_or_else(|| self.slots.turn());
        self.seq.set(seq & !(1 << v));
        self.slots.moved(v, next);
        self.run[v].set((1, u64::MAX));
        Some(v)
    }

    /// Slot `i` holds a sequential stream.
    fn mark_sequential(&self, i: usize) {
        self.seq.set(self.seq.get() | 1 << i);
    }

    /// Whether stream `i` has run long enough to be sequential.
    fn is_sequential_run(&self, i: usize) -> bool {
        self.run[i].get().0 >= SEQ_MIN
    }
}

/// The rest of a replica's read-ahead state (touched only by sequential requests).
#[derive(Default)]
struct Prefetch {
    /// Slices loaded ahead, not yet reached (`u64::MAX`: empty).
    loaded: [u64; LOADED],
    loaded_pos: usize,
    stats: PrefetchStats,
}

impl Prefetch {
    fn new() -> Self {
        Prefetch {
            loaded: [u64::MAX; LOADED],
            ..Default::default()
        }
    }

    /// Request `offset`/`len` continues stream `i` (in slices of `coverage` bytes, on a
    /// disk of `size`): returns the guest offset of a slice to load ahead, if any — the
    /// slice after the last one the request covers.
    fn advance(
        &mut self,
        hot: &Hot,
        i: usize,
        offset: u64,
        len: u64,
        coverage: u64,
        size: u64,
    ) -> Option<u64> {
        let first = offset / coverage;
        let last = offset.saturating_add(len.max(1) - 1) / coverage;
        let (run, a) = hot.run[i].get();
        let r = run.saturating_add(1);
        hot.run[i].set((r, a));
        for slot in self.loaded.iter_mut() {
            if (first..=last).contains(slot) {
                *slot = u64::MAX;
                self.stats.hits += 1;
            }
        }
        if r == SEQ_MIN {
            self.stats.streams += 1;
        }
        let ahead = last + 1;
        if r < SEQ_MIN || a == ahead {
            return None;
        }
        let target = ahead.checked_mul(coverage).filter(|&t| t < size)?;
        hot.run[i].set((r, ahead));
        Some(target)
    }

    fn remember_loaded(&mut self, key: u64) {
        self.loaded[self.loaded_pos] = key;
        self.loaded_pos = (self.loaded_pos + 1) % LOADED;
    }
}

/// A chain's read-ahead ([`Chain::prefetch`](crate::Chain::prefetch)): what every
/// request looks at, and the rest, touched only by sequential requests.
pub struct ReadAhead {
    hot: Hot,
    cold: RefCell<Prefetch>,
}

impl ReadAhead {
    /// Off, for a chain whose top image has slices of `coverage` bytes (`None`: a raw top
    /// layer, whose requests are all watched).
    pub(crate) fn new(coverage: Option<u64>) -> Self {
        ReadAhead {
            hot: Hot::new(coverage),
            cold: RefCell::new(Prefetch::new()),
        }
    }

    /// Turns read-ahead of L2 slices on sequential streams on or off for this replica
    /// (off by default; hosts turn it on per their configuration).
    pub fn set_on(&self, on: bool) {
        self.hot.on.set(on);
    }

    /// Whether read-ahead is on.
    pub fn is_on(&self) -> bool {
        self.hot.on.get()
    }

    /// Read-ahead counters.
    pub fn stats(&self) -> PrefetchStats {
        self.cold.borrow().stats
    }

    /// A request of `len` bytes at `offset`: the stream it continues, if read-ahead is on
    /// (one that continues none starts one).
    #[inline(always)]
    pub(crate) fn watch(&self, offset: u64, len: u64) -> Option<usize> {
        if !self.hot.on.get() || len == 0 {
            return None;
        }
        self.hot.find_or_start(offset, len)
    }

    /// Whether a request the memo mapped ends in its slice's tail, where read-ahead
    /// watches it.
    #[inline(always)]
    pub(crate) fn in_tail(&self, offset: u64, len: u64) -> bool {
        (offset & self.hot.tail_mask) + len > self.hot.tail_from
    }

    /// Where a slice's tail starts ([`in_tail`](Self::in_tail)), in bytes from the slice's
    /// start: the memo's view tests it on the offset within the slice it computed anyway
    /// (`memo::MemoView`).
    pub(crate) fn tail_from(&self) -> u64 {
        self.hot.tail_from
    }

    /// Stream `i` was continued by `len` bytes at `offset` (slices of `coverage` bytes, a
    /// disk of `size`): the guest offset of the slice to load ahead, if any.
    pub(crate) fn advance(
        &self,
        i: usize,
        offset: u64,
        len: u64,
        coverage: u64,
        size: u64,
    ) -> Option<u64> {
        let mut p = self.cold.try_borrow_mut().ok()?;
        let target = p.advance(&self.hot, i, offset, len, coverage, size);
        if self.hot.is_sequential_run(i) {
            self.hot.mark_sequential(i);
        }
        target
    }

    /// A load of the slice ahead was started.
    pub(crate) fn count_issued(&self) {
        self.cold.borrow_mut().stats.issued += 1;
    }

    /// The slice covering `target` (slices of `coverage` bytes) that read-ahead asked for
    /// is cached: counts it, and remembers it to count the stream reaching it.
    pub(crate) fn loaded(&self, target: u64, coverage: u64) {
        let key = target / coverage;
        // A stream already in the slice was not helped: not remembered as a hit.
        let late = self
            .hot
            .slots
            .nexts()
            .any(|n| n != u64::MAX && n > target && (n - 1) / coverage == key);
        let mut p = self.cold.borrow_mut();
        p.stats.loaded += 1;
        if !late {
            p.remember_loaded(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn the_tail_is_an_eighth_of_a_slice_at_least_tail_min() {
        let tail = |c: Option<u64>| {
            let h = Hot::new(c);
            (h.tail_mask, h.tail_from)
        };
        // 64 KiB clusters, 4 KiB slices: the last 4 of 32 MiB.
        assert_eq!(tail(Some(32 << 20)), ((32 << 20) - 1, 28 << 20));
        // 4 KiB clusters: 2 MiB slices, of which the last TAIL_MIN.
        assert_eq!(tail(Some(2 << 20)), ((2 << 20) - 1, 1 << 20));
        // Slices of TAIL_MIN or less, and raw layers: every request.
        assert_eq!(tail(Some(256 << 10)), ((256 << 10) - 1, 0));
        assert_eq!(tail(None), (0, 0));
    }

    /// Both halves, driven as `read_ahead` drives them.
    struct Both(Hot, Prefetch);

    impl Both {
        fn new() -> Self {
            Both(Hot::new(None), Prefetch::new())
        }
        fn note(&mut self, offset: u64, len: u64, cov: u64, size: u64) -> Option<u64> {
            let i = self.0.find_or_start(offset, len)?;
            let t = self.1.advance(&self.0, i, offset, len, cov, size);
            if self.0.is_sequential_run(i) {
                self.0.mark_sequential(i);
            }
            t
        }
    }

    const COV: u64 = 1 << 20;

    #[test]
    fn random_requests_never_prefetch() {
        let mut p = Both::new();
        let mut rng = Rng::new(12345);
        for _ in 0..10_000 {
            let off = rng.below(1 << 30) & !4095;
            assert_eq!(p.note(off, 4096, COV, 1 << 30), None);
        }
        assert_eq!(p.1.stats.streams, 0);
    }

    #[test]
    fn a_stream_asks_for_its_next_slice_once() {
        let mut p = Both::new();
        let mut asked = Vec::new();
        for i in 0..1024u64 {
            if let Some(t) = p.note(i * 65536, 65536, COV, 1 << 30) {
                asked.push(t);
            }
        }
        // 16 requests per slice: from the 4th request on, each slice's successor, once.
        assert_eq!(asked, (1..=64).map(|k| k * COV).collect::<Vec<_>>());
        assert_eq!(p.1.stats.streams, 1);
        // Nothing past the end of the disk.
        let mut p = Both::new();
        let size = 2 * COV;
        let got: Vec<_> = (0..32u64)
            .filter_map(|i| p.note(i * 65536, 65536, COV, size))
            .collect();
        assert_eq!(got, vec![COV]);
    }

    #[test]
    fn interleaved_streams_are_followed_apart() {
        let mut p = Both::new();
        let mut asked = Vec::new();
        for i in 0..8u64 {
            for base in [0u64, 100 * COV, 200 * COV] {
                if let Some(t) = p.note(base + i * 4096, 4096, COV, 1 << 40) {
                    asked.push(t);
                }
            }
        }
        assert_eq!(asked, vec![COV, 101 * COV, 201 * COV]);
        assert_eq!(p.1.stats.streams, 3);
    }

    #[test]
    fn reaching_a_loaded_slice_counts_a_hit() {
        let mut p = Both::new();
        for i in 0..4u64 {
            p.note(i * 4096, 4096, COV, 1 << 30);
        }
        p.1.remember_loaded(1);
        // The stream enters slice 1.
        let mut off = 4 * 4096;
        while off < COV + 4096 {
            p.note(off, 4096, COV, 1 << 30);
            off += 4096;
        }
        assert_eq!(p.1.stats.hits, 1);
    }

    #[test]
    fn random_requests_between_a_streams_requests_do_not_break_it() {
        let mut p = Both::new();
        let mut asked = Vec::new();
        let mut rng = Rng::new(99);
        for i in 0..64u64 {
            if let Some(t) = p.note(i * 65536, 65536, COV, 1 << 40) {
                asked.push(t);
            }
            for _ in 0..3 {
                assert_eq!(p.note(rng.below(1 << 30) & !4095, 4096, COV, 1 << 40), None);
            }
        }
        assert_eq!(asked, (1..=4).map(|k| k * COV).collect::<Vec<_>>());
    }

    #[test]
    fn random_requests_take_no_stream_slot() {
        // Four sequential streams hold every slot; eight random requests between each of
        // their requests record only their ends, so no stream is pushed out.
        let mut p = Both::new();
        let mut asked = Vec::new();
        let mut rng = Rng::new(7);
        for i in 0..64u64 {
            for base in [0u64, 100, 200, 300] {
                if let Some(t) = p.note(base * COV + i * 65536, 65536, COV, 1 << 40) {
                    asked.push(t);
                }
                for _ in 0..8 {
                    // (8 KiB apart: no random request starts where another ended, which
                    // would be a stream of two, taking a slot.)
                    let off = (1 << 32) + (rng.below(1 << 30) & !8191);
                    assert_eq!(p.note(off, 4096, COV, 1 << 40), None);
                }
            }
        }
        asked.sort_unstable();
        let want: Vec<_> = [0u64, 100, 200, 300]
            .iter()
            .flat_map(|b| (1..=4).map(move |k| (b + k) * COV))
            .collect();
        assert_eq!(asked, want);
        assert_eq!(p.1.stats.streams, 4);
    }

    #[test]
    fn a_request_longer_than_a_slice_asks_for_the_slice_after_it() {
        let mut p = Both::new();
        let len = 3 * COV / 2;
        let got: Vec<_> = (0..8u64)
            .filter_map(|i| p.note(i * len, len, COV, 1 << 40))
            .collect();
        // The 4th request covers [4.5, 6) MiB-slices: the slice after it is 6.
        assert_eq!(got, vec![6 * COV, 8 * COV, 9 * COV, 11 * COV, 12 * COV]);
        // Reaching any slice of a request counts a loaded one.
        p.1.remember_loaded(13);
        p.note(8 * len, len, COV, 1 << 40);
        assert_eq!(p.1.stats.hits, 1);
    }
}
