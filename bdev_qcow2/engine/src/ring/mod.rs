//! The prefetch ring (ARCHITECTURE.md §10): per core, a fixed ring of preallocated
//! buffers that read-ahead fills ahead of detected sequential read streams, and that
//! serves later reads of those bytes by a copy, with no base I/O.
//!
//! - [`Ring`] is the state machine alone: the stream table, each stream's window and
//!   chunks, the slots and their free list. It does no I/O and is unit-tested here.
//! - `host` holds it with its buffer, the reads waiting for read-aheads and the
//!   read-aheads waiting for slice loads; `compressed` the records of chunks holding
//!   compressed clusters. Neither issues I/O nor knows the chain: the chain
//!   (`chain/ring.rs`) looks every read up there
//!   ([`Chain::ring_read`](crate::Chain::ring_read)) and fills the chunks they hand out
//!   through its own read path, so read-ahead follows the mapping in every layer.
//! - [`gens`] keeps prefetched data coherent with writes on any core.
//! - [`Hot`] is the part of the stream table every read looks at, on plain cells: a
//!   random read starts its stream there without borrowing the ring.
//!
//! Read-ahead works in chunks of [`CHUNK`] bytes aligned in guest space, one slot each.
//! Single-threaded like the rest of a core: nothing here is shared but the generations,
//! nothing locks, and after [`Ring::new`] nothing allocates.

pub(crate) mod compressed;
mod config;
pub mod gens;
pub(crate) mod host;
mod hot;
mod part;
pub mod probe;
mod wait;
pub mod zones;

pub use config::{RingConfig, RingStats};
pub use gens::WriteGens;
pub use host::{RingCopy, RingServed, RingWait};
pub(crate) use hot::SliceRun;
pub use hot::{Hot, Passes};
pub use part::ChainRing;
pub use zones::{Watch, Zones};

use gens::REGION;

/// Bytes of one ring slot and of one read-ahead I/O: one write-generation region, so a
/// chunk checks a single generation.
pub const CHUNK: u64 = REGION;
/// Sequential requests in a row after which a stream reads ahead.
pub const SEQ_MIN: u32 = 3;
// A stream just started reads nothing ahead: `Lookup::Started` skips the fills.
const _: () = assert!(SEQ_MIN > 1);
/// Streams followed at once per core (the stream table's, `hot.rs`).
pub use hot::STREAMS;
/// Reads that may wait at once, per core, on chunks whose read-ahead is in flight
/// ([`Lookup::Wait`]); one more goes to the base. Bounds the fixed waiter table.
pub const MAX_WAITERS: u16 = 256;
/// Chunks those reads may wait for at once, per core (a read whose rest spans `n`
/// filling chunks waits for each): one read more that would pass it goes to the base.
pub const MAX_WAIT_LINKS: u16 = 2 * MAX_WAITERS;
/// The window of a stream that just turned sequential, in chunks.
const WINDOW_START: u32 = 2;
/// Most chunks one stream may hold (bounds the per-stream bookkeeping).
pub const MAX_WINDOW_CHUNKS: u32 = 64;
/// Chunks in a row a stream may pass before their read-ahead was of use (still filling,
/// or ready only after the reads went to the base) before it stops reading ahead: its
/// reader's own queue keeps it ahead of the ring, which would only read everything twice.
pub const LATE_OFF: u8 = 4;
/// Reads (on this core) after which a stream not continued in them counts as left: its
/// slot and its chunks go to the next stream that needs them (a reader that jumped
/// elsewhere, or finished, would otherwise keep its read-ahead, and its slot from new
/// streams, until pushed out). Many times the interleaving of [`STREAMS`] streams, so that
/// random reads between a stream's reads do not end it.
pub const STALE_READS: u64 = 64 * STREAMS as u64;

/// What a slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing; on the free list.
    Free,
    /// A read-ahead is in flight into it.
    Filling,
    /// Its chunk's bytes, valid while the generation recorded stays current.
    Ready,
    /// The read-ahead failed or found the chunk written since: never served.
    Dead,
}

#[derive(Debug)]
struct Slot {
    state: State,
    /// Guest offset of its chunk.
    offset: u64,
    /// Valid bytes (less than a chunk only at the end of the disk).
    len: u32,
    /// Write generation of the chunk's region, recorded before its read-ahead was issued.
    gen: u32,
    /// The read-ahead's watch on its zone, while its data may still be served.
    watch: Option<Watch>,
    /// Whether a read was served from it (once ready, or waiting for it).
    used: bool,
    /// Reads waiting for its read-ahead (while [`State::Filling`]; a read waiting for
    /// several chunks counts in each).
    waiters: u16,
    /// Released by its stream while filling: freed when the read-ahead completes and its
    /// waiters are handed on.
    orphan: bool,
}

impl Slot {
    const EMPTY: Slot = Slot {
        state: State::Free,
        offset: 0,
        len: 0,
        gen: 0,
        watch: None,
        used: false,
        waiters: 0,
        orphan: false,
    };
}

/// One followed stream: how long it ran, its window, and the chunks it holds — consecutive
/// chunks `first..first + count`, in slots `held[(head + k) % MAX]` (where it continues is
/// in [`Ring::next`]).
#[derive(Debug, Clone, Copy)]
struct Stream {
    run: u32,
    /// Chunks to keep read ahead of `next` (0: not reading ahead).
    window: u32,
    /// Turned off for good: its read-ahead went unused.
    off: bool,
    /// Chunks in a row it passed too late to use ([`LATE_OFF`]).
    late: u8,
    /// Chunks its last read spanned: the window is at least two reads long, so that a
    /// read larger than the starting window finds all of its chunks.
    span: u32,
    first: u64,
    count: u32,
    head: u32,
    held: [u16; MAX_WINDOW_CHUNKS as usize],
}

impl Stream {
    const IDLE: Stream = Stream {
        run: 0,
        window: 0,
        off: false,
        late: 0,
        span: 1,
        first: 0,
        count: 0,
        head: 0,
        held: [0; MAX_WINDOW_CHUNKS as usize],
    };

    fn slot_of(&self, chunk: u64) -> Option<u16> {
        let k = chunk.checked_sub(self.first)?;
        (k < self.count as u64)
            .then(|| self.held[((self.head as u64 + k) % MAX_WINDOW_CHUNKS as u64) as usize])
    }
}

/// A read-ahead to issue: `len` bytes at guest `offset` into `slot` (its buffer range is
/// [`Ring::slot_range`]); the generation to record comes from the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fill {
    /// The slot.
    pub slot: u16,
    /// Guest offset of the chunk.
    pub offset: u64,
    /// Bytes to read.
    pub len: u32,
}

/// How a read request met the ring ([`Ring::lookup`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// It continues no stream: it started one, which has nothing read ahead yet.
    Started,
    /// It continues `stream`, whose ring does not hold all of its bytes.
    Miss {
        /// The stream.
        stream: u8,
    },
    /// It continues `stream` and every byte is in the ring: copy them
    /// ([`Ring::pieces`]).
    Hit {
        /// The stream.
        stream: u8,
    },
    /// It continues `stream` and its first `covered` bytes (not all, not none) are in the
    /// ring: copy those ([`Ring::pieces`] of that prefix) and read the rest.
    Partial {
        /// The stream.
        stream: u8,
        /// Bytes from the start of the read that the ring holds.
        covered: u64,
    },
    /// It continues `stream`, its first `covered` bytes (maybe none) are in the ring, and
    /// the rest lies in `chunks` chunks (one or more) whose read-aheads are all in flight,
    /// the first into `slot` (the others' slots: [`Ring::held_slot`]): copy the prefix and
    /// wait for the read-aheads (counted as waiting on each slot already: the caller must
    /// queue the read there at once), then serve the rest from the slots if the data of
    /// every one is still valid when it completes ([`Ring::filled`]), else read the whole
    /// rest from the base.
    Wait {
        /// The stream.
        stream: u8,
        /// Bytes from the start of the read that the ring holds.
        covered: u64,
        /// The slot filling with the rest's first chunk.
        slot: u16,
        /// Chunks the rest spans, each filling.
        chunks: u32,
    },
}

/// The ring's state (see the module documentation).
#[derive(Debug)]
pub struct Ring {
    cfg: RingConfig,
    disk_size: u64,
    slots: Box<[Slot]>,
    free: Vec<u16>,
    /// Streams reading ahead (a bit each; their window is not 0): a new stream takes
    /// another slot first. (Where streams continue is in [`Hot`].)
    ahead: u8,
    streams: [Stream; STREAMS],
    /// Reads waiting on every slot ([`MAX_WAITERS`] at most).
    waiting: u16,
    /// Chunks they wait for, a read counting once per chunk ([`MAX_WAIT_LINKS`] at most).
    wait_links: u16,
    stats: RingStats,
}

impl Ring {
    /// A ring of `cfg` for a disk of `disk_size` bytes (`cfg` validated by the caller).
    pub fn new(cfg: RingConfig, disk_size: u64) -> Self {
        let n = cfg.slots();
        Ring {
            cfg,
            disk_size,
            slots: (0..n).map(|_| Slot::EMPTY).collect(),
            // Popped from the end: slot 0 first.
            free: (0..n as u16).rev().collect(),
            ahead: 0,
            streams: [Stream::IDLE; STREAMS],
            waiting: 0,
            wait_links: 0,
            stats: RingStats::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> RingConfig {
        self.cfg
    }

    /// Counters so far.
    pub fn stats(&self) -> RingStats {
        self.stats
    }

    /// The byte range of `slot` in the ring's buffer.
    pub fn slot_range(slot: u16) -> (usize, usize) {
        (slot as usize * CHUNK as usize, CHUNK as usize)
    }

    /// A read of `len` bytes at `offset` arrives (`hot`: the streams' hot half, which
    /// [`Hot::passes`] may have looked at first): finds the stream it continues and
    /// moves it on, or starts one in the next slot in turn that is idle, else that does not
    /// read ahead ([`Lookup::Started`]). For a continued stream, releases the chunks it has
    /// left behind (counting, when unused, as evicted unread) and says how much of the read,
    /// from its start, is ready in the ring under the generations `gen_of(offset)` reports
    /// now: all of it, a prefix, or nothing.
    #[inline]
    pub fn lookup(
        &mut self,
        hot: &Hot,
        offset: u64,
        len: u64,
        gen_of: impl Fn(u64) -> u32,
    ) -> Lookup {
        let end = offset.saturating_add(len);
        let i = match hot.find(offset) {
            Some(i) => i,
            // The second read of a stream (a recent read ended here) whose slot the hot
            // half could not give: its stream starts as if that read had started it, and
            // this read continues it.
            None if hot.ended_at(offset) => {
                self.start_stream(hot, offset);
                match hot.find(offset) {
                    Some(i) => i,
                    None => return Lookup::Started,
                }
            }
            None => {
                self.start_stream(hot, end);
                return Lookup::Started;
            }
        };
        hot.continued(i, end);
        {
            let s = &mut self.streams[i];
            if hot.take_fresh(i) {
                // Restarted on the hot path: what `start_stream` resets.
                s.run = 1;
                s.window = 0;
                s.off = false;
                s.late = 0;
            }
            s.run = s.run.saturating_add(1);
            s.span = Self::span(len);
        }
        let stream = i as u8;
        // Chunks wholly before this read are behind the stream for good.
        while let Some(c) = self.front(i) {
            if (c + 1) * CHUNK > offset {
                break;
            }
            self.pop_front(hot, i);
        }
        if len == 0 || self.streams[i].count == 0 {
            return Lookup::Miss { stream };
        }
        // The ready prefix: chunk by chunk until one is missing, not ready, written since
        // it was read ahead, or short (the end of the disk).
        let (c0, c1) = (offset / CHUNK, (end - 1) / CHUNK);
        let mut covered = offset;
        for c in c0..=c1 {
            let Some(k) = self.streams[i].slot_of(c) else {
                break;
            };
            let slot = &mut self.slots[k as usize];
            if slot.state != State::Ready {
                break;
            }
            if gen_of(c * CHUNK) != slot.gen {
                // Written since it was read ahead: no read may see it again.
                slot.state = State::Dead;
                slot.watch = None;
                self.stats.invalidated += 1;
                break;
            }
            let upto = end.min((c + 1) * CHUNK);
            if c * CHUNK + (slot.len as u64) < upto {
                break;
            }
            covered = upto;
        }
        let partial = covered > offset && covered < end;
        if partial {
            self.stats.reads_partial += 1;
        }
        if covered < end {
            if let Some((slot, chunks)) = self.wait_slots(i, covered, end) {
                self.stats.partial_waited += u64::from(partial);
                return Lookup::Wait {
                    stream,
                    covered: covered - offset,
                    slot,
                    chunks,
                };
            }
        }
        match covered - offset {
            0 => Lookup::Miss { stream },
            n if n == len => Lookup::Hit { stream },
            n => Lookup::Partial { stream, covered: n },
        }
    }

    /// The rest of a read, `from..end`, of stream `i`: when every chunk it spans is one
    /// the stream holds whose read-ahead is in flight, and the waiter table has room,
    /// counts a read waiting on each of those slots and returns the first slot and how
    /// many chunks. (A rest that reaches a chunk ready or not held goes to the base: a
    /// ready chunk after a filling one is rare, read-ahead completing in order.)
    #[inline(never)]
    fn wait_slots(&mut self, i: usize, from: u64, end: u64) -> Option<(u16, u32)> {
        let (c0, c1) = (from / CHUNK, (end - 1) / CHUNK);
        let n = c1 - c0 + 1;
        if self.waiting >= MAX_WAITERS || self.wait_links as u64 + n > MAX_WAIT_LINKS as u64 {
            return None;
        }
        let s = &self.streams[i];
        for c in c0..=c1 {
            let k = s.slot_of(c)?;
            if self.slots[k as usize].state != State::Filling {
                return None;
            }
        }
        for c in c0..=c1 {
            let k = s.slot_of(c)?;
            self.slots[k as usize].waiters += 1;
        }
        self.waiting += 1;
        self.wait_links += n as u16;
        self.stats.reads_waited += 1;
        Some((s.slot_of(c0)?, n as u32))
    }

    /// The slot holding `chunk` (a chunk index) for `stream`, if it holds it: for a
    /// [`Lookup::Wait`], the slots of the chunks after the first.
    pub fn held_slot(&self, stream: u8, chunk: u64) -> Option<u16> {
        self.streams[stream as usize].slot_of(chunk)
    }

    /// Chunks a read of `len` bytes spans (at least 1, at most [`MAX_WINDOW_CHUNKS`]).
    #[inline(always)]
    fn span(len: u64) -> u32 {
        len.div_ceil(CHUNK).clamp(1, MAX_WINDOW_CHUNKS as u64) as u32
    }

    /// The pieces of a hit read of `len` bytes at `offset` ([`Lookup::Hit`] of `stream`,
    /// or the covered prefix of a [`Lookup::Partial`]), as (offset in the ring's buffer,
    /// offset in the read, length), in order; counts them served.
    pub fn pieces(
        &mut self,
        stream: u8,
        offset: u64,
        len: u64,
        mut each: impl FnMut(usize, usize, usize),
    ) {
        let s = self.streams[stream as usize];
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let c = pos / CHUNK;
            let Some(k) = s.slot_of(c) else {
                return;
            };
            let n = ((c + 1) * CHUNK).min(end) - pos;
            let (base, _) = Self::slot_range(k);
            each(
                base + (pos - c * CHUNK) as usize,
                (pos - offset) as usize,
                n as usize,
            );
            self.slots[k as usize].used = true;
            pos += n;
        }
        self.stats.bytes_served += len;
        self.stats.reads_served += 1;
    }

    /// The byte range, in the ring's buffer, of the `len` bytes at guest `offset` in
    /// `slot`, for a read that waited there ([`Lookup::Wait`]).
    pub fn waited_range(slot: u16, offset: u64, len: u64) -> (usize, usize) {
        let (base, _) = Self::slot_range(slot);
        (base + (offset % CHUNK) as usize, len as usize)
    }

    /// After [`lookup`](Self::lookup) of stream `i`: the read-ahead the stream should
    /// issue now to keep its window ahead of it, one chunk per call (`None`: nothing more
    /// now — not sequential yet, window full, turned off, at the end of the disk, or no
    /// free slot). The caller records the chunk's generation with
    /// [`filling`](Self::filling) before it issues the read.
    pub fn next_fill(&mut self, hot: &Hot, stream: u8) -> Option<Fill> {
        let i = stream as usize;
        let max = self.cfg.max_window_chunks();
        let s = &mut self.streams[i];
        if s.off || s.run < SEQ_MIN {
            return None;
        }
        if s.window == 0 {
            s.window = WINDOW_START.min(max);
            self.ahead |= 1 << i;
            hot.set_busy(i, true);
            self.stats.streams += 1;
        }
        let s = &mut self.streams[i];
        let window = s.window.max(2 * s.span).min(max) as u64;
        // The chunk the stream is in, then `window` chunks after it.
        let next = hot.next(i);
        let here = next / CHUNK;
        let ahead = if s.count == 0 {
            next.div_ceil(CHUNK)
        } else {
            s.first + s.count as u64
        };
        if s.count == 0 {
            s.first = ahead;
        }
        if ahead > here + window || s.count >= MAX_WINDOW_CHUNKS {
            return None;
        }
        let offset = ahead.checked_mul(CHUNK)?;
        if offset >= self.disk_size {
            return None;
        }
        let slot = match self.free.pop() {
            Some(k) => k,
            None => {
                self.reclaim(hot, i)?;
                self.free.pop()?
            }
        };
        let len = CHUNK.min(self.disk_size - offset) as u32;
        let s = &mut self.streams[i];
        s.held[((s.head + s.count) % MAX_WINDOW_CHUNKS) as usize] = slot;
        s.count += 1;
        hot.set_busy(i, true);
        self.slots[slot as usize] = Slot {
            state: State::Filling,
            offset,
            len,
            ..Slot::EMPTY
        };
        self.stats.readahead_ios += 1;
        Some(Fill { slot, offset, len })
    }

    /// Guest offset of the chunk in `slot` (filling, or filled).
    pub fn chunk_offset(&self, slot: u16) -> u64 {
        self.slots[slot as usize].offset
    }

    /// Bytes of the chunk in `slot` (filling, or filled): less than a chunk only at the
    /// end of the disk.
    pub fn chunk_len(&self, slot: u16) -> u32 {
        self.slots[slot as usize].len
    }

    /// A read-ahead was issued with compressed clusters in its chunk, without a task.
    pub fn count_compressed_fill(&mut self) {
        self.stats.compressed_fills += 1;
    }

    /// A read-ahead runs as a task.
    pub fn count_readahead_task(&mut self) {
        self.stats.readahead_tasks += 1;
    }

    /// The base proved synchronous: this ring withholds its read-aheads until the probe
    /// looks again.
    pub fn count_synchronous_base(&mut self) {
        self.stats.synchronous_base += 1;
    }

    /// The read-ahead into `slot` starts under write generation `gen` of its chunk, its
    /// zone watched by `watch` ([`WriteGens::record`]) until the slot is freed or dead.
    pub fn filling(&mut self, slot: u16, (gen, watch): (u32, Watch)) {
        let s = &mut self.slots[slot as usize];
        s.gen = gen;
        s.watch = Some(watch);
    }

    /// The read-ahead into `slot` completed (`ok`: its bytes are in the buffer) under
    /// generation `gen_now` of its chunk (read after the completion): the slot's data is
    /// usable when it succeeded and no write moved the generation since it was recorded.
    /// Returns whether it is; the caller then takes each read waiting on it off the slot
    /// ([`waited_chunk`](Self::waited_chunk)), hands on those that waited for nothing
    /// else ([`waited_read`](Self::waited_read)), and calls [`woken`](Self::woken).
    pub fn filled(&mut self, slot: u16, ok: bool, gen_now: u32) -> bool {
        let s = &mut self.slots[slot as usize];
        if ok {
            self.stats.bytes_read_ahead += s.len as u64;
        }
        let usable = ok && gen_now == s.gen;
        if ok && !usable {
            // Written while it filled: no read, waiting or later, may see it.
            self.stats.invalidated += 1;
        }
        if usable {
            s.state = State::Ready;
        } else {
            s.state = State::Dead;
            s.watch = None;
        }
        usable
    }

    /// A read waiting on `slot` is taken off it, its read-ahead completed: `copied`, its
    /// bytes in the slot were copied to the read (the slot served a read).
    pub fn waited_chunk(&mut self, slot: u16, copied: bool) {
        let s = &mut self.slots[slot as usize];
        debug_assert!(s.waiters > 0);
        s.waiters -= 1;
        self.wait_links -= 1;
        s.used |= copied;
    }

    /// A read that waited was handed on, every chunk it waited for completed: `served`
    /// bytes copied from the ring, or (0) sent to the base. `prefix`: its first part was
    /// served from the ring before it waited (the read counted served then).
    pub fn waited_read(&mut self, served: u64, prefix: bool) {
        self.waiting -= 1;
        if served > 0 {
            self.stats.bytes_served += served;
            self.stats.reads_served += u64::from(!prefix);
        } else {
            self.stats.waited_to_base += 1;
        }
    }

    /// Every read that waited on `slot` was handed on: a slot its stream released while
    /// it filled is freed now.
    pub fn woken(&mut self, slot: u16) {
        let s = &mut self.slots[slot as usize];
        debug_assert_eq!(s.waiters, 0);
        if s.orphan {
            if s.state == State::Ready && !s.used {
                self.stats.bytes_evicted_unread += s.len as u64;
            }
            *s = Slot::EMPTY;
            self.free.push(slot);
        }
    }

    /// The first chunk stream `i` holds.
    fn front(&self, i: usize) -> Option<u64> {
        let s = &self.streams[i];
        (s.count > 0).then_some(s.first)
    }

    /// Releases stream `i`'s first chunk: its window grows when the chunk served reads
    /// (once ready, or reads that waited for it: its read-ahead started before them),
    /// shrinks (down to off) when a write made it unusable or its read-ahead failed, and
    /// stays when it came too late (still filling when the stream passed it — its reads
    /// went to the base, or wait still — or ready while another chunk of the same read
    /// was not) — unless [`LATE_OFF`] chunks in a row came too late: then the reader's
    /// own queue reaches as far as the read-ahead, and the stream stops reading ahead.
    fn pop_front(&mut self, hot: &Hot, i: usize) {
        let max = self.cfg.max_window_chunks();
        let s = &mut self.streams[i];
        let k = s.held[s.head as usize];
        s.head = (s.head + 1) % MAX_WINDOW_CHUNKS;
        s.count -= 1;
        s.first += 1;
        let slot = &self.slots[k as usize];
        match (slot.state, slot.used) {
            (_, true) => {
                s.window = (s.window * 2).clamp(1, max);
                s.late = 0;
            }
            // Late, not useless, unless it always is.
            (State::Filling | State::Ready, false) => {
                s.late = s.late.saturating_add(1);
                if s.late >= LATE_OFF {
                    s.window = 0;
                    s.off = true;
                    self.ahead &= !(1 << i);
                }
            }
            (_, false) => {
                s.window /= 2;
                if s.window == 0 {
                    s.off = true;
                    self.ahead &= !(1 << i);
                }
            }
        }
        let s = &self.streams[i];
        hot.set_busy(i, s.count > 0 || self.ahead & (1 << i) != 0);
        hot.set_dormant(i, s.off && s.count == 0);
        self.release(k);
    }

    /// Gives `k` back (at once, or when its read-ahead completes).
    fn release(&mut self, k: u16) {
        let slot = &mut self.slots[k as usize];
        match slot.state {
            State::Filling => slot.orphan = true,
            State::Free => {}
            state => {
                if state == State::Ready && !slot.used {
                    self.stats.bytes_evicted_unread += slot.len as u64;
                }
                *slot = Slot::EMPTY;
                self.free.push(k);
            }
        }
    }

    /// Starts a stream at a read ending at `end`, in the next slot in turn that is idle or
    /// left ([`STALE_READS`]), else the next that is not reading ahead, else the least
    /// recently continued; the chunks it held are released.
    #[inline(never)]
    fn start_stream(&mut self, hot: &Hot, end: u64) {
        let i = hot
            .first_of(hot.idle_or_left())
            .or_else(|| hot.first_of(!self.ahead as u32 & ((1 << STREAMS) - 1)))
            .unwrap_or_else(|| hot.least_recent(STREAMS));
        self.ahead &= !(1 << i);
        self.drop_chunks(i);
        hot.set_busy(i, false);
        hot.start(i, end);
    }

    /// No slot is free for stream `i`: takes the chunks of the least recently continued
    /// other stream holding any if it was not continued in the last [`STALE_READS`] reads (it
    /// stops reading ahead; continued again, it starts over at the first window). `None`
    /// when no stream is that stale: active streams keep what they hold.
    fn reclaim(&mut self, hot: &Hot, i: usize) -> Option<()> {
        let j = (0..STREAMS)
            .filter(|&j| j != i && self.streams[j].count > 0)
            .min_by_key(|&j| hot.last(j))?;
        if !hot.left(j) {
            return None;
        }
        self.drop_chunks(j);
        self.streams[j].window = 0;
        self.ahead &= !(1 << j);
        hot.set_busy(j, false);
        hot.set_dormant(j, self.streams[j].off);
        Some(())
    }

    /// Releases every chunk stream `i` holds (it is being replaced).
    fn drop_chunks(&mut self, i: usize) {
        while self.streams[i].count > 0 {
            let s = &mut self.streams[i];
            let k = s.held[s.head as usize];
            s.head = (s.head + 1) % MAX_WINDOW_CHUNKS;
            s.count -= 1;
            s.first += 1;
            self.release(k);
        }
    }
}

// (Not under loom: they read `Zones::watches`, which loom builds leave out.)
#[cfg(test)]
#[cfg(not(loom))]
mod tests;
