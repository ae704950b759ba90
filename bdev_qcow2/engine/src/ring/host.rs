//! A core's ring with what it needs around the state machine: its buffer, the image's
//! write generations, the reads waiting for read-aheads, the read-aheads waiting for a
//! slice load or a compressed fill's record, and the owner's sweep timer. It does no I/O:
//! the chain (`chain/ring.rs`) looks every read up here before it is routed, and issues the
//! read-aheads this hands out through the chain's own read path.

use super::probe::SyncProbe;
use super::wait::{Waiter, Waiters};
use super::zones::SWEEP_EVERY;
use super::{Fill, Hot, Lookup, Ring, RingConfig, RingStats, WriteGens, CHUNK};
use crate::io::{BufSlice, IoBuffer};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Ring read-aheads waiting for a slice load (their chunk's slice was not cached): per
/// slot, the load's payload and how many loads it waited for. Allocated with the ring.
struct Parked {
    by_slot: Box<[(u32, u8)]>,
    count: u16,
}

impl Parked {
    const NONE: u32 = 0;

    fn new(slots: usize) -> Self {
        Parked {
            by_slot: vec![(Self::NONE, 0); slots].into_boxed_slice(),
            count: 0,
        }
    }

    fn park(&mut self, slot: u16, load: u32, tries: u8) {
        self.by_slot[slot as usize] = (load, tries);
        self.count += 1;
    }

    /// Slots that may hold a parked read-ahead (none when nothing is parked).
    fn slots(&self) -> usize {
        if self.count == 0 {
            0
        } else {
            self.by_slot.len()
        }
    }

    /// Takes the read-ahead of `slot` if it waits for `load`: how many loads it waited for.
    fn take(&mut self, slot: usize, load: u32) -> Option<u8> {
        let (l, tries) = self.by_slot[slot];
        if l != load {
            return None;
        }
        self.by_slot[slot] = (Self::NONE, 0);
        self.count -= 1;
        Some(tries)
    }
}

/// Where a ring hit's bytes go: called with (ring buffer, offset in it, offset in the
/// read, length) for each piece, in order.
pub type RingCopy<'a, B> = dyn FnMut(&B, usize, usize, usize) + 'a;

/// A read-ahead taken out of its wait for a load ([`RingHost::unpark`]).
pub(crate) struct Unparked<B> {
    /// What it reads.
    pub(crate) fill: Fill,
    /// Its slot's buffer.
    pub(crate) dst: BufSlice<B>,
    /// How many loads it waited for.
    pub(crate) tries: u8,
}

/// What the ring did with a guest read ([`Chain::ring_read`](crate::Chain::ring_read)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum RingServed {
    /// Nothing: the host routes the whole read as usual.
    Nothing,
    /// Every byte was copied: the read is done, with no device I/O.
    All,
    /// The first `n` bytes (not all, not none) were copied: the host routes the rest,
    /// `len - n` bytes at `offset + n` into the read's buffer from `n` on.
    Prefix(u64),
    /// The first bytes (maybe none) were copied and the rest is being read ahead (one
    /// chunk or several): the host must hand the read to
    /// [`ChainRing::wait`](crate::ring::ChainRing::wait) at once, with a tag; the engine
    /// completes that tag once the rest is copied from the ring (or, when a write made one
    /// of those chunks unusable while it filled or its read-ahead failed, read from the
    /// base).
    Wait(RingWait),
}

/// A read that waits for a read-ahead in flight ([`RingServed::Wait`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct RingWait {
    /// The stream holding the chunks it waits for.
    stream: u8,
    /// Bytes from the start of the read already copied.
    covered: u64,
    /// Guest offset of the read.
    offset: u64,
}

/// A read that waited, handed on once every chunk it waited for came in
/// ([`RingHost::next_woken`]).
pub(crate) enum Woken<B> {
    /// Its rest was copied from the ring: complete `tag`.
    Served {
        /// The host's tag.
        tag: u64,
    },
    /// A chunk came in unusable: its rest, `buf` at `offset`, goes to the base under `tag`.
    ToBase {
        /// The host's tag.
        tag: u64,
        /// Guest offset of the rest.
        offset: u64,
        /// Where the rest goes.
        buf: BufSlice<B>,
    },
}

/// A core's ring with its buffer and the image's write generations.
pub(crate) struct RingHost<B> {
    ring: Ring,
    buf: B,
    gens: Arc<WriteGens>,
    waiters: Waiters<B>,
    parked: Parked,
    /// [`tick_zones`](Self::tick_zones) calls since it last read the clock, and when it
    /// sweeps next.
    ticks: u32,
    next_sweep: Instant,
    sweep_every: Duration,
    /// Whether read-ahead can pay on this base ([`SyncProbe`]), and per slot when its
    /// read-ahead was submitted and how long the submission took (while it is timed).
    probe: SyncProbe,
    issued: Box<[Option<(Instant, Duration)>]>,
}

/// [`RingHost::tick_zones`] calls between two reads of the clock.
const TICKS_PER_CLOCK: u32 = 64;

impl<B: IoBuffer> RingHost<B> {
    /// A ring of `cfg` (validated) for a disk of `disk_size` bytes, over `buf`
    /// (`cfg.ring_bytes` long), under the image's write generations `gens`.
    pub(crate) fn new(cfg: RingConfig, disk_size: u64, buf: B, gens: Arc<WriteGens>) -> Self {
        RingHost {
            ring: Ring::new(cfg, disk_size),
            buf,
            gens,
            waiters: Waiters::new(cfg.slots()),
            parked: Parked::new(cfg.slots()),
            ticks: 0,
            next_sweep: Instant::now() + SWEEP_EVERY,
            sweep_every: SWEEP_EVERY,
            probe: SyncProbe::default(),
            issued: vec![None; cfg.slots()].into_boxed_slice(),
        }
    }

    /// Times read-aheads from now on and stops reading ahead once the base proves
    /// synchronous ([`SyncProbe`]).
    pub(crate) fn probe_base(&mut self) {
        self.probe.turn_on();
    }

    /// Whether read-aheads are being timed: the chain then times each one's submission
    /// ([`fill_issued`](Self::fill_issued)).
    pub(crate) fn times_fills(&self) -> bool {
        self.probe.is_on()
    }

    /// The read-ahead into `slot` was submitted at `at`, its submission taking `took`.
    pub(crate) fn fill_issued(&mut self, slot: u16, at: Instant, took: Duration) {
        self.issued[slot as usize] = Some((at, took));
    }

    /// One tick of the owner's poll loop: every `sweep_every`, clears the zones no
    /// read-ahead watches any more ([`Zones::sweep`](super::Zones::sweep)). Returns whether
    /// it swept.
    pub(crate) fn tick_zones(&mut self) -> bool {
        self.ticks += 1;
        if self.ticks < TICKS_PER_CLOCK {
            return false;
        }
        self.ticks = 0;
        let now = Instant::now();
        if now < self.next_sweep {
            return false;
        }
        self.next_sweep = now + self.sweep_every;
        self.gens.zones().sweep();
        true
    }

    /// Sweeps every `every` from now on.
    pub(crate) fn set_sweep_every(&mut self, every: Duration) {
        self.sweep_every = every;
        self.next_sweep = Instant::now() + every;
    }

    /// The ring's counters.
    pub(crate) fn stats(&self) -> RingStats {
        self.ring.stats()
    }

    /// The ring's configuration.
    pub(crate) fn config(&self) -> RingConfig {
        self.ring.config()
    }

    /// Looks a guest read of `len` bytes at `offset` up ([`Ring::lookup`] under the current
    /// write generations) and hands what the ring holds of it, from its start, to `copy`.
    /// Returns the stream it continues and what was served; `None` when it started a
    /// stream (which has nothing read ahead and reads nothing ahead yet).
    #[inline]
    pub(crate) fn look_up(
        &mut self,
        hot: &Hot,
        offset: u64,
        len: u64,
        copy: &mut RingCopy<'_, B>,
    ) -> Option<(u8, RingServed)> {
        let RingHost {
            ring, buf, gens, ..
        } = self;
        Some(match ring.lookup(hot, offset, len, |o| gens.current(o)) {
            Lookup::Started => return None,
            Lookup::Miss { stream } => (stream, RingServed::Nothing),
            Lookup::Hit { stream } => {
                ring.pieces(stream, offset, len, |src_off, off, n| {
                    copy(buf, src_off, off, n)
                });
                (stream, RingServed::All)
            }
            Lookup::Partial { stream, covered } => {
                ring.pieces(stream, offset, covered, |src_off, off, n| {
                    copy(buf, src_off, off, n)
                });
                (stream, RingServed::Prefix(covered))
            }
            Lookup::Wait {
                stream, covered, ..
            } => {
                if covered > 0 {
                    ring.pieces(stream, offset, covered, |src_off, off, n| {
                        copy(buf, src_off, off, n)
                    });
                }
                let wait = RingWait {
                    stream,
                    covered,
                    offset,
                };
                (stream, RingServed::Wait(wait))
            }
        })
    }

    /// The next read-ahead `stream` should issue now ([`Ring::next_fill`]), its chunk's
    /// write generation recorded (before the read-ahead resolves anything, see `gens`),
    /// with its slot's part of the buffer.
    /// None while the base proved synchronous: streams then read from the base (the
    /// probe lets one through now and then to look again, [`SyncProbe::withholds`]).
    pub(crate) fn next_fill(&mut self, hot: &Hot, stream: u8) -> Option<(Fill, BufSlice<B>)> {
        if self.probe.withholds() {
            return None;
        }
        let f = self.ring.next_fill(hot, stream)?;
        self.ring.filling(f.slot, self.gens.record(f.offset));
        Some((f, self.slot_buf(f)))
    }

    /// `f`'s slot's part of the ring's buffer.
    fn slot_buf(&self, f: Fill) -> BufSlice<B> {
        let (base, _) = Ring::slot_range(f.slot);
        BufSlice {
            buf: self.buf.clone(),
            off: base,
            len: f.len as usize,
        }
    }

    /// A read-ahead was issued with compressed clusters in its chunk, without a task.
    pub(crate) fn count_compressed_fill(&mut self) {
        self.ring.count_compressed_fill();
    }

    /// A read-ahead runs as a task.
    pub(crate) fn count_readahead_task(&mut self) {
        self.ring.count_readahead_task();
    }

    /// The read-ahead into `slot` waits for the end of `load` (a slice load's or a
    /// compressed fill record's payload), having waited for `tries` loads.
    pub(crate) fn park(&mut self, slot: u16, load: u32, tries: u8) {
        self.parked.park(slot, load, tries);
    }

    /// Slots [`unpark`](Self::unpark) may find a read-ahead in (none when nothing waits).
    pub(crate) fn parked_slots(&self) -> usize {
        self.parked.slots()
    }

    /// Takes the read-ahead parked in slot `k` if it waits for `load`.
    pub(crate) fn unpark(&mut self, k: usize, load: u32) -> Option<Unparked<B>> {
        let tries = self.parked.take(k, load)?;
        let slot = k as u16;
        let fill = Fill {
            slot,
            offset: self.ring.chunk_offset(slot),
            len: self.ring.chunk_len(slot),
        };
        Some(Unparked {
            fill,
            dst: self.slot_buf(fill),
            tries,
        })
    }

    /// Queues read `tag`, answered `wait`, with `buf` its whole buffer, on every chunk it
    /// waits for.
    pub(crate) fn wait(&mut self, wait: RingWait, tag: u64, buf: BufSlice<B>) {
        let covered = wait.covered as usize;
        let rest = buf.sub(covered, buf.len - covered);
        // The chunks the lookup counted it waiting for, still the stream's (nothing ran
        // since): one link on each.
        let from = wait.offset + wait.covered;
        let (c0, c1) = (from / CHUNK, (from + rest.len as u64 - 1) / CHUNK);
        let read = self.waiters.add(Waiter {
            tag,
            offset: from,
            buf: rest,
            prefix: covered > 0,
            pending: (c1 - c0 + 1) as u32,
            dead: false,
        });
        for c in c0..=c1 {
            let Some(slot) = self.ring.held_slot(wait.stream, c) else {
                unreachable!("a chunk a read waits for stays held until it completes");
            };
            self.waiters.link(slot, read);
        }
    }

    /// The read-ahead into `slot` completed (`ok`): returns whether its data is usable
    /// ([`Ring::filled`] under the chunk's generation read now, after every waiting read
    /// was submitted, as a hit reads it).
    pub(crate) fn filled(&mut self, slot: u16, ok: bool) -> bool {
        if let Some((at, took)) = self.issued[slot as usize].take() {
            if ok && self.probe.record(took, at.elapsed()) {
                self.ring.count_synchronous_base();
            }
        }
        let gen_now = self.gens.current(self.ring.chunk_offset(slot));
        self.ring.filled(slot, ok, gen_now)
    }

    /// After [`filled`](Self::filled) of `slot` (`usable`): takes the reads waiting on it
    /// off it one by one, copying their bytes in its chunk from it when `usable`, and
    /// returns the next read that waited for nothing else; `None` once none is left (the
    /// slot is then freed if its stream released it).
    pub(crate) fn next_woken(&mut self, slot: u16, usable: bool) -> Option<Woken<B>> {
        loop {
            let Some(read) = self.waiters.pop(slot) else {
                self.ring.woken(slot);
                return None;
            };
            let chunk = self.ring.chunk_offset(slot);
            let Some(w) = self.waiters.get_mut(read) else {
                unreachable!("a linked read stays in the table until taken");
            };
            let copy = usable && !w.dead;
            if copy {
                // The read's bytes in this chunk.
                let from = w.offset.max(chunk);
                let to = (w.offset + w.buf.len as u64).min(chunk + CHUNK);
                let (src, n) = Ring::waited_range(slot, from, to - from);
                let at = w.buf.off + (from - w.offset) as usize;
                self.buf.copy_to(src, &w.buf.buf, at, n);
            }
            w.dead |= !usable;
            w.pending -= 1;
            self.ring.waited_chunk(slot, copy);
            if w.pending > 0 {
                continue;
            }
            let Some(w) = self.waiters.take(read) else {
                continue;
            };
            return Some(if w.dead {
                self.ring.waited_read(0, w.prefix);
                Woken::ToBase {
                    tag: w.tag,
                    offset: w.offset,
                    buf: w.buf,
                }
            } else {
                self.ring.waited_read(w.buf.len as u64, w.prefix);
                Woken::Served { tag: w.tag }
            });
        }
    }
}
