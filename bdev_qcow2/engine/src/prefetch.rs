//! L2 slice read-ahead on sequential streams, one per core replica: the chain's
//! [`ReadAhead`] part, its state and counters (`readahead` issues the loads it asks for:
//! [`Chain::read_ahead`](crate::Chain::read_ahead)).
//!
//! Streams are the chain's one stream table's ([`Hot`], shared with the prefetch ring):
//! a host tells its chain where each guest request goes, and a request that continues a
//! stream there — looked up by the ring for a read while the ring is on, else by
//! [`Hot::watch`] — is handed here with its stream. Random I/O costs the table's one hash
//! and never loads anything; a stream read-ahead found sequential keeps its slot from new
//! streams, so random requests between its requests do not push it out. Once a stream has
//! run [`SEQ_MIN`] requests in a row, the slice *after* the last one its request covers is
//! loaded into this core's cache in the background, so the stream does not wait for a
//! slice read when it crosses into it. Each slice is asked for once per stream; one cached
//! already (current epoch), one without an L2 table, and on a core one the owner holds
//! dirty are not loaded.
//!
//! Single-threaded like the rest of a replica: nothing here is shared, nothing locks.

use crate::ring::{Hot, SliceRun};
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

/// The part of a replica's read-ahead state touched only by sequential requests.
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

    /// Request `offset`/`len` continues stream `i` of `streams` (in slices of `coverage`
    /// bytes, on a disk of `size`): returns the guest offset of a slice to load ahead, if
    /// any — the slice after the last one the request covers.
    fn advance(
        &mut self,
        streams: &Hot,
        i: usize,
        offset: u64,
        len: u64,
        coverage: u64,
        size: u64,
    ) -> Option<u64> {
        let first = offset / coverage;
        let last = offset.saturating_add(len.max(1) - 1) / coverage;
        let SliceRun { run, asked } = streams.slice_run(i);
        let run = run.saturating_add(1);
        let sequential = run >= SEQ_MIN;
        for slot in self.loaded.iter_mut() {
            if (first..=last).contains(slot) {
                *slot = u64::MAX;
                self.stats.hits += 1;
            }
        }
        if run == SEQ_MIN {
            self.stats.streams += 1;
        }
        let ahead = last + 1;
        let target = match sequential && asked != ahead {
            true => ahead.checked_mul(coverage).filter(|&t| t < size),
            false => None,
        };
        let asked = match target {
            Some(_) => ahead,
            None => asked,
        };
        streams.set_slice_run(i, SliceRun { run, asked }, sequential);
        target
    }

    fn remember_loaded(&mut self, key: u64) {
        self.loaded[self.loaded_pos] = key;
        self.loaded_pos = (self.loaded_pos + 1) % LOADED;
    }
}

/// A chain's read-ahead ([`Chain::prefetch`](crate::Chain::prefetch)): whether it is on
/// and where a slice's tail starts, which every request may look at, and the rest,
/// touched only by sequential requests.
pub struct ReadAhead {
    on: Cell<bool>,
    /// [`Chain::read_ahead_memo`](crate::Chain::read_ahead_memo)'s tail of a slice: a
    /// request whose offset within its slice (`offset & tail_mask`) plus its length passes
    /// `tail_from` ends in the tail.
    tail_mask: u64,
    tail_from: u64,
    cold: RefCell<Prefetch>,
}

impl ReadAhead {
    /// Off, for a chain whose top image has slices of `coverage` bytes (`None`: a raw top
    /// layer, whose requests are all watched).
    pub(crate) fn new(coverage: Option<u64>) -> Self {
        let (tail_mask, tail_from) = match coverage {
            // The last eighth, at least TAIL_MIN (or the whole slice).
            Some(c) => (c - 1, c.saturating_sub((c / 8).max(TAIL_MIN))),
            None => (0, 0),
        };
        ReadAhead {
            on: Cell::new(false),
            tail_mask,
            tail_from,
            cold: RefCell::new(Prefetch::new()),
        }
    }

    /// Turns read-ahead of L2 slices on sequential streams on or off for this replica
    /// (off by default; hosts turn it on per their configuration).
    pub fn set_on(&self, on: bool) {
        self.on.set(on);
    }

    /// Whether read-ahead is on.
    #[inline(always)]
    pub fn is_on(&self) -> bool {
        self.on.get()
    }

    /// Read-ahead counters.
    pub fn stats(&self) -> PrefetchStats {
        self.cold.borrow().stats
    }

    /// A request of `len` bytes at `offset` that the ring did not look up: the stream of
    /// `streams` it continues, if read-ahead is on ([`Hot::watch`]).
    #[inline(always)]
    pub(crate) fn watch(&self, streams: &Hot, offset: u64, len: u64) -> Option<usize> {
        if !self.on.get() || len == 0 {
            return None;
        }
        streams.watch(offset, len)
    }

    /// Whether a request the memo mapped ends in its slice's tail, where read-ahead
    /// watches it.
    #[inline(always)]
    pub(crate) fn in_tail(&self, offset: u64, len: u64) -> bool {
        (offset & self.tail_mask) + len > self.tail_from
    }

    /// Where a slice's tail starts ([`in_tail`](Self::in_tail)), in bytes from the slice's
    /// start: the memo's view tests it on the offset within the slice it computed anyway
    /// (`memo::MemoView`).
    pub(crate) fn tail_from(&self) -> u64 {
        self.tail_from
    }

    /// Stream `i` of `streams` was continued by `len` bytes at `offset` (slices of
    /// `coverage` bytes, a disk of `size`): the guest offset of the slice to load ahead,
    /// if any.
    pub(crate) fn advance(
        &self,
        streams: &Hot,
        i: usize,
        offset: u64,
        len: u64,
        coverage: u64,
        size: u64,
    ) -> Option<u64> {
        let mut p = self.cold.try_borrow_mut().ok()?;
        p.advance(streams, i, offset, len, coverage, size)
    }

    /// A load of the slice ahead was started.
    pub(crate) fn count_issued(&self) {
        self.cold.borrow_mut().stats.issued += 1;
    }

    /// The slice covering `target` (slices of `coverage` bytes) that read-ahead asked for
    /// is cached: counts it, and remembers it to count the stream reaching it (unless a
    /// stream of `streams` is in it already).
    pub(crate) fn loaded(&self, streams: &Hot, target: u64, coverage: u64) {
        let key = target / coverage;
        // A stream already in the slice was not helped: not remembered as a hit.
        let late = streams
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
            let r = ReadAhead::new(c);
            (r.tail_mask, r.tail_from)
        };
        // 64 KiB clusters, 4 KiB slices: the last 4 of 32 MiB.
        assert_eq!(tail(Some(32 << 20)), ((32 << 20) - 1, 28 << 20));
        // 4 KiB clusters: 2 MiB slices, of which the last TAIL_MIN.
        assert_eq!(tail(Some(2 << 20)), ((2 << 20) - 1, 1 << 20));
        // Slices of TAIL_MIN or less, and raw layers: every request.
        assert_eq!(tail(Some(256 << 10)), ((256 << 10) - 1, 0));
        assert_eq!(tail(None), (0, 0));
    }

    /// The stream table and read-ahead's state, driven as `read_ahead` drives them
    /// while the ring is off.
    struct Both(Hot, Prefetch);

    impl Both {
        fn new() -> Self {
            Both(Hot::default(), Prefetch::new())
        }
        fn note(&mut self, offset: u64, len: u64, cov: u64, size: u64) -> Option<u64> {
            let i = self.0.watch(offset, len)?;
            self.1.advance(&self.0, i, offset, len, cov, size)
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
