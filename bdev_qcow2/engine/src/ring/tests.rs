//! The ring's state machine driven as `chain` drives it, with read-aheads completed by
//! the test.

use super::*;

const B: u64 = 4096;
const DISK: u64 = 1 << 40;

struct Waiting {
    slots: Vec<u16>,
    rest: u64,
    prefix: bool,
    dead: bool,
}

/// A ring, its hot half, its generations (one per chunk, by chunk index) and the
/// read-aheads in flight.
struct Sim {
    ring: Ring,
    hot: Hot,
    gens: std::collections::HashMap<u64, u32>,
    /// Where the read-aheads' watches come from (their generations are `gens`').
    watches: WriteGens,
    inflight: Vec<Fill>,
    /// Reads waiting: the slots they still wait for, the bytes of their rest, whether a
    /// prefix was served before, whether a chunk came in unusable.
    waiting: Vec<Waiting>,
}

impl Sim {
    fn new(cfg: RingConfig, disk: u64) -> Self {
        Sim {
            ring: Ring::new(cfg, disk),
            hot: {
                // (The ring is on: `passes` looks at the stream table.)
                let h = Hot::default();
                h.turn_on();
                h
            },
            gens: Default::default(),
            watches: WriteGens::new(),
            inflight: Vec::new(),
            waiting: Vec::new(),
        }
    }

    fn gen(&self, off: u64) -> u32 {
        self.gens.get(&(off / CHUNK)).copied().unwrap_or(0)
    }

    /// A read: whether it hit (whole); the read-aheads it started stay in flight.
    fn read(&mut self, off: u64, len: u64) -> bool {
        self.read_prefix(off, len) == len
    }

    /// A read as `chain` drives it, the hot half first: the bytes served from its start.
    fn read_prefix(&mut self, off: u64, len: u64) -> u64 {
        if self.hot.passes(off, len).by() {
            return 0;
        }
        let gens = self.gens.clone();
        let g = |o: u64| gens.get(&(o / CHUNK)).copied().unwrap_or(0);
        let (i, want) = match self.ring.lookup(&self.hot, off, len, g) {
            Lookup::Started => return 0,
            Lookup::Miss { stream } => (stream, 0),
            Lookup::Hit { stream } => (stream, len),
            Lookup::Partial { stream, covered } => {
                assert!(covered > 0 && covered < len);
                (stream, covered)
            }
            Lookup::Wait {
                stream,
                covered,
                slot,
                chunks,
            } => {
                assert!(covered < len);
                let c0 = (off + covered) / CHUNK;
                assert_eq!(c0 + chunks as u64 - 1, (off + len - 1) / CHUNK);
                let slots: Vec<u16> = (c0..c0 + chunks as u64)
                    .map(|c| self.ring.held_slot(stream, c).unwrap())
                    .collect();
                assert_eq!(slots[0], slot);
                for &k in &slots {
                    assert_eq!(self.ring.slots[k as usize].state, State::Filling);
                }
                self.waiting.push(Waiting {
                    slots,
                    rest: len - covered,
                    prefix: covered > 0,
                    dead: false,
                });
                (stream, covered)
            }
        };
        if want > 0 {
            let mut covered = 0;
            self.ring.pieces(i, off, want, |_, at, n| {
                assert_eq!(at as u64, covered);
                covered += n as u64;
            });
            assert_eq!(covered, want);
        }
        while let Some(f) = self.ring.next_fill(&self.hot, i) {
            let gen = self.gen(f.offset);
            let (_, watch) = self.watches.record(f.offset);
            self.ring.filling(f.slot, (gen, watch));
            self.inflight.push(f);
        }
        want
    }

    /// Completes every read-ahead in flight; returns them.
    fn complete(&mut self) -> Vec<Fill> {
        let done: Vec<Fill> = self.inflight.drain(..).collect();
        for f in &done {
            self.fill_done(*f, true);
        }
        done
    }

    /// Completes read-ahead `f` (`ok`: it succeeded) as `chain` does: the reads waiting on
    /// it are taken off it, and those that wait for nothing more are served from the ring
    /// (every chunk they waited for usable), or sent to the base; returns how many of each.
    fn fill_done(&mut self, f: Fill, ok: bool) -> (u64, u64) {
        let usable = self.ring.filled(f.slot, ok, self.gen(f.offset));
        let (mut served, mut to_base) = (0, 0);
        let waiting = std::mem::take(&mut self.waiting);
        for mut w in waiting {
            let Some(at) = w.slots.iter().position(|&k| k == f.slot) else {
                self.waiting.push(w);
                continue;
            };
            w.slots.remove(at);
            let copy = usable && !w.dead;
            w.dead |= !usable;
            self.ring.waited_chunk(f.slot, copy);
            if !w.slots.is_empty() {
                self.waiting.push(w);
            } else if w.dead {
                self.ring.waited_read(0, w.prefix);
                to_base += 1;
            } else {
                self.ring.waited_read(w.rest, w.prefix);
                served += 1;
            }
        }
        self.ring.woken(f.slot);
        (served, to_base)
    }

    /// Completes the read-aheads in flight of chunks before `end`.
    fn complete_before(&mut self, end: u64) {
        let (done, still): (Vec<Fill>, Vec<Fill>) =
            self.inflight.drain(..).partition(|f| f.offset < end);
        self.inflight = still;
        for f in done {
            self.fill_done(f, true);
        }
    }

    fn write(&mut self, off: u64) {
        *self.gens.entry(off / CHUNK).or_default() += 1;
    }
}

#[test]
fn a_stream_between_random_reads_is_one_stream() {
    // 100, 1157, 27520, 4, 101, 312, 102 (in 4 KiB blocks): 100-101-102 is one stream.
    let mut s = Sim::new(RingConfig::default(), DISK);
    for blk in [100u64, 1157, 27520, 4, 101, 312, 102] {
        s.read(blk * B, B);
    }
    assert_eq!(s.ring.stats().streams, 1);
    let chunks: Vec<u64> = s.inflight.iter().map(|f| f.offset / CHUNK).collect();
    // 103 is in chunk 3 (32 blocks per chunk): the chunks after it.
    assert_eq!(chunks, vec![4, 5]);
}

#[test]
fn interleaved_readers_are_followed_apart_and_served_from_the_ring() {
    let mut s = Sim::new(RingConfig::default(), DISK);
    let bases = [0u64, 1 << 30, 2 << 30];
    let mut hits = 0;
    for k in 0..512u64 {
        for b in bases {
            hits += s.read(b + k * B, B) as u64;
        }
        s.complete();
    }
    let st = s.ring.stats();
    assert_eq!(st.streams, 3);
    // Every read after the first chunk of each stream is served from the ring.
    assert!(hits >= 3 * (512 - 32), "{hits}");
    assert_eq!(st.bytes_served, hits * B);
    assert_eq!(st.bytes_evicted_unread, 0);
}

#[test]
fn random_reverse_and_strided_reads_never_read_ahead() {
    let mut s = Sim::new(RingConfig::default(), DISK);
    let mut x = 7u64;
    for _ in 0..10_000 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        s.read(((x >> 20) % (1 << 30)) & !(B - 1), B);
    }
    for k in (0..1000u64).rev() {
        s.read(k * B, B);
    }
    for k in 0..1000u64 {
        s.read(k * 2 * B, B);
    }
    assert_eq!(s.ring.stats(), RingStats::default());
}

#[test]
fn the_window_grows_while_used_up_to_its_maximum() {
    let cfg = RingConfig::default();
    let mut s = Sim::new(cfg, DISK);
    let mut max_ahead = 0u64;
    for k in 0..4096u64 {
        s.read(k * B, B);
        s.complete();
        let i = s.ring.streams.iter().position(|t| t.window > 0);
        if let Some(i) = i {
            max_ahead = max_ahead.max(s.ring.streams[i].count as u64);
        }
    }
    let w = s.ring.streams.iter().map(|t| t.window).max().unwrap_or(0);
    assert_eq!(w as u64, cfg.max_window / CHUNK);
    // The chunk the stream is in, the one it is about to enter, and its window.
    assert!(max_ahead <= cfg.max_window / CHUNK + 2, "{max_ahead}");
}

#[test]
fn written_chunks_are_not_served_and_the_window_shrinks_to_off() {
    let mut s = Sim::new(RingConfig::default(), DISK);
    // A read-modify-write stream: each chunk is written after it was read ahead.
    let mut hits = 0;
    for k in 0..2048u64 {
        let off = k * B;
        hits += s.read(off, B) as u64;
        s.complete();
        // Writes land a chunk ahead of the reader: everything read ahead goes stale.
        s.write(off + CHUNK);
        s.write(off + 2 * CHUNK);
    }
    let st = s.ring.stats();
    assert_eq!(hits, 0);
    assert!(st.invalidated > 0);
    assert!(s.ring.streams.iter().any(|t| t.off));
    // Off for good: a few read-aheads, not one per chunk.
    assert!(st.readahead_ios < 8, "{st:?}");
}

#[test]
fn reads_of_a_stream_turned_off_pass_the_hot_half_and_continue_it() {
    let mut s = Sim::new(RingConfig::default(), DISK);
    // The read-modify-write stream above, until the ring turned it off and let go of its
    // chunks.
    let mut k = 0u64;
    let i = loop {
        if let Some(i) =
            (0..STREAMS).find(|&i| s.ring.streams[i].off && s.ring.streams[i].count == 0)
        {
            break i;
        }
        assert!(k < 2048, "never turned off");
        s.read(k * B, B);
        s.complete();
        s.write(k * B + CHUNK);
        s.write(k * B + 2 * CHUNK);
        k += 1;
    };
    assert_eq!(s.hot.next(i), k * B);
    let ios = s.ring.stats().readahead_ios;
    // Its next reads: passed on the hot half, which moves the stream on itself.
    for k in k..k + 64 {
        assert_eq!(s.hot.passes(k * B, B), Passes::ByStream(i as u8));
        assert_eq!(s.hot.next(i), (k + 1) * B);
    }
    assert_eq!(s.ring.stats().readahead_ios, ios);
    // A new stream that takes its slot is followed by the ring again.
    for r in 1..=4u64 {
        for k in 0..64u64 {
            s.read((r << 32) + k * B, B);
            s.complete();
        }
    }
    assert!(s.ring.stats().readahead_ios > ios);
}

#[test]
fn a_hit_checks_the_generation_at_the_time_of_the_read() {
    let mut s = Sim::new(RingConfig::default(), DISK);
    for k in 0..8u64 {
        s.read(k * B, B);
        s.complete();
    }
    // Chunk 1 is ready; a write to it moves its generation.
    s.write(CHUNK + 8 * B);
    for k in 8..32u64 {
        s.read(k * B, B);
        s.complete();
    }
    assert!(!s.read(CHUNK, B), "stale chunk served");
    assert_eq!(s.ring.stats().invalidated, 1);
    // Later chunks, read ahead after nothing wrote them, still hit.
    for k in 33..64u64 {
        s.read(k * B, B);
        s.complete();
    }
    assert!(s.read(2 * CHUNK, B));
}

#[test]
fn reads_spanning_chunks_hit_only_when_all_are_ready() {
    let mut s = Sim::new(RingConfig::default(), DISK);
    let len = 96 << 10;
    let mut hits = 0;
    for k in 0..64u64 {
        hits += s.read(k * len, len) as u64;
        s.complete();
    }
    assert!(hits > 50, "{hits}");
}

#[test]
fn nothing_past_the_end_of_the_disk() {
    let disk = 5 * CHUNK + 8192;
    let mut s = Sim::new(RingConfig::default(), disk);
    let mut fills = Vec::new();
    let mut k = 0;
    while (k + 1) * B <= disk {
        s.read(k * B, B);
        fills.extend(s.complete());
        k += 1;
    }
    assert!(fills.iter().all(|f| f.offset + f.len as u64 <= disk));
    let last = fills.iter().max_by_key(|f| f.offset).copied();
    assert_eq!(last.map(|f| (f.offset, f.len)), Some((5 * CHUNK, 8192)));
}

#[test]
fn a_replaced_stream_frees_its_slots_even_while_they_fill() {
    let cfg = RingConfig {
        ring_bytes: 4 * CHUNK,
        max_window: 2 * CHUNK,
    };
    let mut s = Sim::new(cfg, DISK);
    for k in 0..4u64 {
        s.read(k * B, B);
    }
    assert!(!s.inflight.is_empty());
    assert_eq!(s.inflight.len(), 2);
    // Three more streams turn sequential (the first takes the two slots left) ...
    for r in 1..=3u64 {
        for k in 0..3u64 {
            s.read((r << 30) + k * B, B);
        }
    }
    assert!(s.ring.free.is_empty());
    // ... and a fifth pushes out the least recently continued, the first: at its second
    // read, where it turns out a stream (one read alone is a random read, which pushes out
    // nothing).
    s.read(4 << 30, B);
    s.read((4 << 30) + B, B);
    s.complete();
    assert_eq!(s.ring.free.len(), 2);
    let st = s.ring.stats();
    assert_eq!(st.bytes_evicted_unread, 2 * CHUNK);
    assert_eq!(st.bytes_read_ahead, 4 * CHUNK);
}

#[test]
fn a_full_ring_issues_nothing_more_and_recovers() {
    let cfg = RingConfig {
        ring_bytes: 2 * CHUNK,
        max_window: 8 * CHUNK,
    };
    let mut s = Sim::new(cfg, DISK);
    let mut hits = 0;
    for k in 0..1024u64 {
        hits += s.read(k * B, B) as u64;
        s.complete();
    }
    assert!(hits > 900, "{hits}");
}

#[test]
fn configurations_are_checked() {
    assert!(RingConfig::default().validate().is_ok());
    for (r, w) in [
        (0, CHUNK),
        (CHUNK + 1, CHUNK),
        (CHUNK, 0),
        (CHUNK, CHUNK + 512),
        (CHUNK, (MAX_WINDOW_CHUNKS as u64 + 1) * CHUNK),
    ] {
        let c = RingConfig {
            ring_bytes: r,
            max_window: w,
        };
        assert!(c.validate().is_err(), "{c:?}");
    }
}

#[test]
fn reads_larger_than_the_starting_window_are_served() {
    // 1 MiB reads: eight chunks each, the whole default maximum window.
    let mut s = Sim::new(RingConfig::default(), DISK);
    let len = 1 << 20;
    let mut hits = 0;
    for k in 0..64u64 {
        hits += s.read(k * len, len) as u64;
        s.complete();
    }
    assert!(hits > 55, "{hits}");
    assert!(!s.ring.streams.iter().any(|t| t.off));
}

#[test]
fn a_read_partly_in_the_ring_gets_its_ready_prefix() {
    let mut s = Sim::new(RingConfig::default(), DISK);
    // Chunks 1 and 2 read ahead; a write then makes chunk 2 unusable.
    for k in 0..16u64 {
        s.read(k * B, B);
        s.complete();
    }
    s.write(2 * CHUNK);
    for k in 16..56u64 {
        s.read(k * B, B);
        s.complete();
    }
    let served = s.ring.stats().bytes_served;
    // 64 KiB at 224 KiB: 32 KiB in chunk 1, 32 KiB in the written chunk 2.
    assert_eq!(s.read_prefix(56 * B, 16 * B), 8 * B);
    assert_eq!(s.ring.stats().bytes_served - served, 8 * B);
    // A read whose first chunk is not ready gets nothing, even if later ones are.
    let mut t = Sim::new(RingConfig::default(), DISK);
    for k in 0..16u64 {
        t.read(k * B, B);
        t.complete();
    }
    t.write(CHUNK);
    for k in 16..24u64 {
        t.read(k * B, B);
        t.complete();
    }
    assert_eq!(t.read_prefix(24 * B, CHUNK), 0);
}

#[test]
fn random_reads_start_streams_on_the_hot_half_alone() {
    let mut s = Sim::new(RingConfig::default(), DISK);
    // Every random read passes the hot half without the ring (it records where it ends).
    for k in 0..64u64 {
        assert!(s.hot.passes((k * 7919 % 1000) << 20, B).by());
    }
    // A stream that reads ahead keeps its slot busy: the hot half skips it, and its next
    // read goes to the ring (which continues it and serves it).
    let at = |k: u64| (5 << 30) + k * B;
    for k in 0..40u64 {
        s.read(at(k), B);
        s.complete();
    }
    let busy = s.hot.find(at(40)).unwrap();
    for k in 0..16u64 {
        assert!(s.hot.passes((k * 104729 % 1000) << 21, B).by());
        assert_eq!(s.hot.find(at(40)), Some(busy), "the stream was pushed out");
    }
    assert!(!s.hot.passes(at(40), B).by());
    assert!(s.read(at(40), B));
    assert_eq!(s.hot.find(at(41)), Some(busy));
    assert_eq!(s.ring.stats().streams, 1);
}

#[test]
fn a_slot_restarted_on_the_hot_half_forgets_its_stream_turned_off() {
    let mut s = Sim::new(RingConfig::default(), DISK);
    // A stream whose read-ahead is always written over turns itself off.
    for k in 0..2048u64 {
        s.read(k * B, B);
        s.complete();
        s.write(k * B + CHUNK);
        s.write(k * B + 2 * CHUNK);
    }
    let off = s.ring.streams.iter().position(|t| t.off).unwrap();
    // Four new streams, one after another: one of them takes the slot turned off, started
    // on the hot half; each reads ahead and is served.
    for r in 1..=4u64 {
        let mut hits = 0;
        for k in 0..256u64 {
            hits += s.read((r << 32) + k * B, B) as u64;
            s.complete();
        }
        assert!(hits > 200, "stream {r}: {hits} hits");
    }
    assert!(!s.ring.streams[off].off);
}

#[test]
fn readers_that_jump_leave_no_read_ahead_stuck_and_push_out_no_live_stream() {
    // Four readers in turn, 128 KiB reads, each wrapping to the start of its region of 512
    // chunks (as bdevperf jobs do): each wrap leaves the old stream behind, its read-ahead
    // past the region's end, in a slot that is reading ahead.
    let mut s = Sim::new(RingConfig::default(), DISK);
    let region = 512 * CHUNK;
    let rounds = 3 * 512;
    let mut hits = 0u64;
    for k in 0..rounds {
        for r in 0..4u64 {
            hits += s.read(r * (1 << 30) + (k * CHUNK) % region, CHUNK) as u64;
        }
        s.complete();
    }
    let st = s.ring.stats();
    // After a wrap the new streams share the one idle slot until the old ones have left
    // (STALE_READS reads), then each takes its old stream's slot back and reads ahead.
    let wraps = rounds / 512;
    let lost = 3 * 4 + wraps * (STALE_READS + 4 * 8);
    assert!(
        hits >= 4 * rounds - lost,
        "{hits} of {}: {st:?}",
        4 * rounds
    );
    // What a wrap leaves behind: at most the window and the chunks about it, per stream.
    let per_wrap = RingConfig::default().max_window + 2 * CHUNK;
    assert!(st.bytes_evicted_unread <= 4 * wraps * per_wrap, "{st:?}");
}

#[test]
fn a_reader_always_ahead_of_its_read_ahead_turns_it_off() {
    // 128 KiB reads at QD8 on a fast base: the reader's own queue reaches as far as the
    // ring, so each chunk is reached while it fills, its read waits, and the next read
    // passes it still filling (late). After LATE_OFF such chunks the stream reads ahead
    // no more.
    const QD: u64 = 8;
    let mut sim = Sim::new(RingConfig::default(), DISK);
    let mut issued = 0u64;
    let mut per_read = Vec::new();
    for k in 0..64u64 {
        let before = sim.inflight.len();
        assert!(
            !sim.read(k * CHUNK, CHUNK),
            "nothing is ready before its read"
        );
        issued += (sim.inflight.len() - before) as u64;
        per_read.push(issued);
        // The read QD back completes: so do the read-aheads up to it.
        sim.complete_before((k + 1).saturating_sub(QD - 1) * CHUNK);
    }
    assert!(
        per_read[SEQ_MIN as usize + 1] > 0,
        "it did read ahead at first"
    );
    assert!(sim.ring.stats().reads_waited > 0);
    assert_eq!(
        per_read[63], per_read[31],
        "read-ahead still issued after the stream was always late: {per_read:?}"
    );
}

#[test]
fn a_reader_that_waits_alone_keeps_reading_ahead_and_its_window_grows() {
    // 128 KiB reads at QD1 on a slow base: each read reaches its chunk while it fills
    // and waits for it. That is of use (the read-ahead started before the read): the
    // window grows, the stream stays on.
    let cfg = RingConfig::default();
    let mut sim = Sim::new(cfg, DISK);
    let mut most_in_flight = 0;
    for k in 0..64u64 {
        sim.read(k * CHUNK, CHUNK);
        most_in_flight = most_in_flight.max(sim.inflight.len() as u64);
        // Only the chunk the read waits for has come in.
        sim.complete_before((k + 1) * CHUNK);
    }
    // Read-ahead of a whole window in flight at once, ahead of the reader (and the chunks
    // about it: the one it waits for, the one it is about to enter).
    let w = cfg.max_window / CHUNK;
    assert!((w..=w + 2).contains(&most_in_flight), "{most_in_flight}");
    let st = sim.ring.stats();
    assert!(st.reads_waited > 50, "{st:?}");
    assert_eq!(st.waited_to_base, 0);
    assert_eq!(st.reads_served, st.reads_waited, "{st:?}");
    assert_eq!(st.bytes_served, st.reads_served * CHUNK);
    let s = sim.ring.streams.iter().find(|t| t.count > 0).unwrap();
    assert!(!s.off);
    assert_eq!(s.window as u64, cfg.max_window / CHUNK);
    assert_eq!(st.bytes_evicted_unread, 0);
}

#[test]
fn a_read_of_a_filling_chunk_waits_and_is_served_from_it() {
    let mut sim = Sim::new(RingConfig::default(), DISK);
    for k in 0..SEQ_MIN as u64 {
        sim.read(k * B, B);
    }
    // Chunks 1 and 2 are filling; the stream reads on into chunk 1.
    let fills = sim.inflight.clone();
    assert_eq!(fills[0].offset, CHUNK);
    for k in SEQ_MIN as u64..32 {
        sim.read(k * B, B);
    }
    assert!(sim.waiting.is_empty());
    for k in 32..40u64 {
        assert!(!sim.read(k * B, B));
    }
    assert_eq!(sim.waiting.len(), 8);
    let before = sim.ring.free.len();
    let (served, to_base) = sim.fill_done(fills[0], true);
    assert_eq!((served, to_base), (8, 0));
    let st = sim.ring.stats();
    assert_eq!(
        (st.reads_waited, st.reads_served, st.bytes_served),
        (8, 8, 8 * B)
    );
    // The rest of the chunk is a plain hit now; the waiter table is empty again.
    assert!(sim.read(40 * B, B));
    assert_eq!(sim.ring.waiting, 0);
    assert_eq!(sim.ring.free.len(), before);
}

#[test]
fn a_write_while_a_chunk_fills_sends_its_waiters_to_the_base() {
    let mut sim = Sim::new(RingConfig::default(), DISK);
    for k in 0..32u64 {
        sim.read(k * B, B);
    }
    let fill = sim.inflight[0];
    assert_eq!(fill.offset, CHUNK);
    assert!(!sim.read(32 * B, B));
    assert_eq!(sim.waiting.len(), 1);
    // Any core writes the chunk while it fills (after its generation was recorded).
    sim.write(CHUNK + 10 * B);
    assert_eq!(sim.fill_done(fill, true), (0, 1));
    let st = sim.ring.stats();
    assert_eq!(
        (st.reads_waited, st.waited_to_base, st.reads_served),
        (1, 1, 0)
    );
    assert_eq!(st.invalidated, 1);
    // Never served later either.
    assert!(!sim.read(33 * B, B));
    assert!(sim.waiting.is_empty(), "no read waits on a dead chunk");
}

#[test]
fn a_failed_read_ahead_sends_its_waiters_to_the_base() {
    let mut sim = Sim::new(RingConfig::default(), DISK);
    for k in 0..32u64 {
        sim.read(k * B, B);
    }
    let fill = sim.inflight[0];
    assert!(!sim.read(32 * B, B) && !sim.read(33 * B, B));
    assert_eq!(sim.fill_done(fill, false), (0, 2));
    assert_eq!(sim.ring.stats().waited_to_base, 2);
    assert!(!sim.read(34 * B, B));
}

#[test]
fn a_chunk_released_while_reads_wait_on_it_serves_them_then_is_freed() {
    let mut sim = Sim::new(RingConfig::default(), DISK);
    for k in 0..32u64 {
        sim.read(k * B, B);
    }
    let fill = sim.inflight[0];
    assert!(!sim.read(32 * B, B));
    assert!(!sim.read(33 * B, 31 * B));
    // The stream moves past chunk 1 (its reads at a depth) while it fills.
    sim.read(64 * B, B);
    let slot = fill.slot as usize;
    assert!(sim.ring.slots[slot].orphan);
    let free = sim.ring.free.len();
    assert_eq!(sim.fill_done(fill, true), (2, 0));
    assert_eq!(sim.ring.slots[slot].state, State::Free);
    assert_eq!(sim.ring.free.len(), free + 1);
    // Served a read: not evicted unread.
    assert_eq!(sim.ring.stats().bytes_evicted_unread, 0);
}

#[test]
fn reads_beyond_the_waiter_table_go_to_the_base() {
    let mut sim = Sim::new(RingConfig::default(), DISK);
    for k in 0..32u64 {
        sim.read(k * B, B);
    }
    sim.ring.waiting = MAX_WAITERS;
    assert!(!sim.read(32 * B, B));
    assert!(sim.waiting.is_empty());
    assert_eq!(sim.ring.stats().reads_waited, 0);
    // Room for one more read, but not for the two chunks it would wait for.
    let mut sim = Sim::new(RingConfig::default(), DISK);
    for k in 0..32u64 {
        sim.read(k * B, B);
    }
    sim.ring.wait_links = MAX_WAIT_LINKS - 1;
    assert!(!sim.read(32 * B, CHUNK + B));
    assert!(sim.waiting.is_empty());
    // One chunk fits.
    assert!(!sim.read(32 * B + CHUNK + B, B));
    assert_eq!(sim.waiting.len(), 1);
}

/// A stream of 4 KiB reads up to chunk 1, with chunks 1 and 2 filling.
fn two_filling() -> (Sim, Fill, Fill) {
    let mut sim = Sim::new(RingConfig::default(), DISK);
    for k in 0..32u64 {
        sim.read(k * B, B);
    }
    let (a, b) = (sim.inflight[0], sim.inflight[1]);
    assert_eq!((a.offset, b.offset), (CHUNK, 2 * CHUNK));
    (sim, a, b)
}

#[test]
fn a_read_over_two_filling_chunks_waits_for_both_and_is_served_from_them() {
    for first_done in [0, 1] {
        let (mut sim, a, b) = two_filling();
        assert!(!sim.read(32 * B, CHUNK + B));
        assert_eq!(sim.waiting.len(), 1);
        assert_eq!(sim.waiting[0].slots, vec![a.slot, b.slot]);
        let (x, y) = if first_done == 0 { (a, b) } else { (b, a) };
        assert_eq!(sim.fill_done(x, true), (0, 0), "waits for the other chunk");
        assert_eq!(sim.fill_done(y, true), (1, 0));
        let st = sim.ring.stats();
        assert_eq!(
            (st.reads_waited, st.reads_served, st.bytes_served),
            (1, 1, CHUNK + B)
        );
        assert_eq!(
            (st.waited_to_base, st.reads_partial, st.partial_waited),
            (0, 0, 0)
        );
        assert_eq!((sim.ring.waiting, sim.ring.wait_links), (0, 0));
        // Both served a read: passing them evicts nothing unread.
        sim.read(32 * B + CHUNK + B, B);
        sim.read(3 * CHUNK, B);
        assert_eq!(sim.ring.stats().bytes_evicted_unread, 0);
    }
}

#[test]
fn a_write_or_failure_in_either_chunk_sends_the_whole_rest_to_the_base() {
    for (write_to, fail) in [
        (Some(1), None),
        (Some(2), None),
        (None, Some(1)),
        (None, Some(2)),
    ] {
        let (mut sim, a, b) = two_filling();
        assert!(!sim.read(32 * B, CHUNK + B));
        if let Some(c) = write_to {
            // Any core writes the chunk while it fills.
            sim.write(c * CHUNK + 10 * B);
        }
        let ok = |f: Fill| fail != Some(f.offset / CHUNK);
        assert_eq!(sim.fill_done(a, ok(a)), (0, 0));
        assert_eq!(sim.fill_done(b, ok(b)), (0, 1), "{write_to:?} {fail:?}");
        let st = sim.ring.stats();
        assert_eq!(
            (
                st.reads_waited,
                st.waited_to_base,
                st.reads_served,
                st.bytes_served
            ),
            (1, 1, 0, 0)
        );
        assert_eq!(st.invalidated, u64::from(write_to.is_some()));
        assert_eq!((sim.ring.waiting, sim.ring.wait_links), (0, 0));
    }
}

#[test]
fn a_partial_hit_whose_rest_spans_filling_chunks_waits_and_is_counted_so() {
    let (mut sim, _, _) = two_filling();
    // Chunk 1 comes in; reading on into it issues chunk 3.
    sim.complete_before(2 * CHUNK);
    for k in 32..40u64 {
        assert!(sim.read(k * B, B));
    }
    assert!(sim.inflight.iter().any(|f| f.offset == 3 * CHUNK));
    // 40..104 (blocks): the rest of chunk 1 ready, then chunks 2 and 3 filling.
    assert_eq!(sim.read_prefix(40 * B, 64 * B), 24 * B);
    assert_eq!(sim.waiting.len(), 1);
    assert_eq!(sim.waiting[0].slots.len(), 2);
    let st = sim.ring.stats();
    assert_eq!((st.reads_partial, st.partial_waited), (1, 1));
    sim.complete();
    let st = sim.ring.stats();
    assert_eq!((st.waited_to_base, sim.ring.waiting), (0, 0));
    // A partial hit whose rest is read from the base: counted partial, not waited.
    let mut t = Sim::new(RingConfig::default(), DISK);
    for k in 0..32u64 {
        t.read(k * B, B);
        t.complete();
    }
    t.write(2 * CHUNK);
    for k in 32..56u64 {
        t.read(k * B, B);
        t.complete();
    }
    assert_eq!(t.read_prefix(56 * B, 16 * B), 8 * B);
    let st = t.ring.stats();
    assert_eq!((st.reads_partial, st.partial_waited), (1, 0));
}

#[test]
fn a_reader_late_at_first_and_then_served_keeps_reading_ahead() {
    // QD1 over a slow base: the first chunk read ahead comes late, later ones are ready.
    let mut sim = Sim::new(RingConfig::default(), DISK);
    let mut hits = 0;
    for k in 0..64u64 {
        if sim.read(k * CHUNK, CHUNK) {
            hits += 1;
        }
        // The reader's own read took as long as a read-ahead: those in flight completed.
        sim.complete();
    }
    assert!(hits > 50, "{hits} of 64 reads hit");
}

#[test]
fn a_stream_watches_the_zones_of_the_data_its_slots_may_still_serve() {
    use super::zones::ZONE;
    let mut s = Sim::new(RingConfig::default(), DISK);
    let start = ZONE - (2 << 20);
    let mut off = start;
    while off < ZONE + (4 << 20) {
        s.read(off, B);
        s.complete();
        off += B;
    }
    let live = |s: &Sim| s.ring.slots.iter().filter(|k| k.watch.is_some()).count() as u32;
    assert!(live(&s) > 0);
    assert_eq!(s.watches.zones().watches(ZONE), live(&s));
    // Zone 0's chunks were passed and freed: armed until the sweep, then unwatched.
    assert_eq!(s.watches.zones().watches(0), 0);
    assert!(s.watches.zones().is_watched(0));
    assert_eq!(s.watches.zones().sweep(), 1);
    assert!(!s.watches.zones().is_watched(0));
    assert!(s.watches.zones().is_watched(ZONE));
    // A chunk found written can never be served: its watch goes at once.
    let before = live(&s);
    s.write(off + CHUNK);
    while s.ring.stats().invalidated == 0 {
        s.read(off, B);
        s.complete();
        off += B;
    }
    assert!(s
        .ring
        .slots
        .iter()
        .any(|k| k.state == State::Dead && k.watch.is_none()));
    assert_eq!(s.watches.zones().watches(ZONE), live(&s));
    assert!(live(&s) <= before);
    // A ring that goes (its channel destroyed) leaves no watch.
    let Sim { ring, watches, .. } = s;
    drop(ring);
    assert_eq!(watches.zones().watches(ZONE), 0);
    assert_eq!(watches.zones().sweep(), 1);
    assert!(!watches.zones().is_watched(ZONE));
}

#[test]
fn a_stream_among_random_reads_reads_ahead_from_the_same_read_as_alone() {
    // Random reads record only where they end: the stream's second read, which starts
    // where its first ended, starts its stream as the first read used to, so that read-
    // ahead starts at the same read with or without random reads in between.
    let first_fill = |random: u64| {
        let mut s = Sim::new(RingConfig::default(), DISK);
        for k in 0..16u64 {
            for r in 0..random {
                let n = k * random + r;
                assert!(s.hot.passes((1 << 39) | (n * 7919 % 4096) << 20, B).by());
            }
            s.read((5 << 30) + k * B, B);
            if !s.inflight.is_empty() {
                return k;
            }
        }
        panic!("no read-ahead")
    };
    let alone = first_fill(0);
    assert_eq!(first_fill(3), alone);
    // Forty random reads between two of the stream's: its first end may share its slot
    // with one of theirs (here it does), and the stream starts a read later. (When every
    // read started a stream in one of four slots, forty random reads pushed it out every
    // time: it never read ahead.)
    assert!(first_fill(40) <= alone + 1);
}
