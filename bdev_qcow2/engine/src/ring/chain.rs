//! The prefetch ring of a [`Chain`]: reads are looked up in it before they are routed,
//! and read-ahead fills it through the chain's own read path, so it follows the mapping
//! in every layer (allocated clusters from the image's device, unallocated ones from the
//! backing layer, zeros from metadata without a read, compressed clusters decompressed
//! once into the ring, nothing past the end of the disk).

use super::wait::{Waiter, Waiters};
use super::zones::SWEEP_EVERY;
use super::{Fill, Lookup, Ring, RingConfig, RingStats, WriteGens, CHUNK};
use crate::chain::{read_layer, Chain, Layer, Unplanned};
use crate::error::{Error, Result};
use crate::io::{BlockDevice, BufSlice, IoBuffer};
use crate::slice_load::SliceLoad;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Times a read-ahead waits for a slice load before it runs as a task instead: a chunk
/// spans several slices of a layer only with tiny ones (slices cover 16 KiB at least:
/// eight a chunk), and a load may find its slice changed.
const PARK_TRIES: u8 = 12;

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

/// What the ring did with a guest read ([`Chain::ring_read`]).
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
    /// chunk or several): the host must hand the read to [`Chain::ring_wait`] at once,
    /// with a tag; the engine completes that tag once the rest is copied from the ring
    /// (or, when a write made one of those chunks unusable while it filled or its
    /// read-ahead failed, read from the base).
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

/// A core's ring with its buffer and the image's write generations.
pub(crate) struct RingHost<B> {
    ring: Ring,
    buf: B,
    gens: Arc<WriteGens>,
    waiters: Waiters<B>,
    parked: Parked,
    /// [`Chain::tick_ring_zones`] calls since it last read the clock, and when it sweeps next.
    ticks: u32,
    next_sweep: Instant,
    sweep_every: Duration,
}

/// [`Chain::tick_ring_zones`] calls between two reads of the clock.
const TICKS_PER_CLOCK: u32 = 64;

impl<D: BlockDevice> Chain<D> {
    /// Turns the prefetch ring on for this core: allocates its buffer once, from the top
    /// layer's device (DMA memory on SPDK), of `cfg.ring_bytes`. `gens` are the image's
    /// write generations, shared by every core of the image: each core's writes must go
    /// through [`ring_written`](Self::ring_written) from then on. Refuses a configuration
    /// [`RingConfig::validate`] refuses, and a second call. Everything the ring's path uses
    /// is allocated here: the buffer, the slots, the waiter table, and where the executor
    /// reports the ends of read-aheads (the chain's internal sink, removed with the chain).
    pub fn enable_ring(self: &Rc<Self>, cfg: RingConfig, gens: Arc<WriteGens>) -> Result<()> {
        cfg.validate().map_err(Error::InvalidRequest)?;
        let mut slot = self.ring.borrow_mut();
        if slot.is_some() {
            return Err(Error::InvalidRequest("prefetch ring already on"));
        }
        let dev = match &self.layers()[0] {
            Layer::Qcow2(q) => q.dev(),
            Layer::Raw { dev, .. } => *dev,
        };
        let buf = self.exec().alloc_buf(dev, cfg.ring_bytes as usize);
        let _ = self.ring_gens.set(gens.clone());
        let _ = self.sink();
        *slot = Some(RingHost {
            ring: Ring::new(cfg, self.size()),
            buf,
            gens,
            waiters: Waiters::new(cfg.slots()),
            parked: Parked::new(cfg.slots()),
            ticks: 0,
            next_sweep: Instant::now() + SWEEP_EVERY,
            sweep_every: SWEEP_EVERY,
        });
        self.ring_on.set(true);
        Ok(())
    }

    /// Whether the prefetch ring is on: a host may test it before it builds what
    /// [`ring_read`](Self::ring_read) takes.
    #[inline(always)]
    pub fn ring_is_on(&self) -> bool {
        self.ring_on.get()
    }

    /// The image's write generations, when the ring is on.
    pub fn write_gens(&self) -> Option<&Arc<WriteGens>> {
        self.ring_gens.get()
    }

    /// A guest write, write-zeroes or discard of `len` bytes at `offset`, run on any path
    /// of any core of this image, is about to complete (successfully or not): makes every
    /// core's prefetched data of those bytes unusable. Hosts call it before they report
    /// the completion; a no-op while the ring is off.
    #[inline(always)]
    pub fn ring_written(&self, offset: u64, len: u64) {
        if let Some(g) = self.ring_gens.get() {
            g.written(offset, len);
        }
    }

    /// On the image's owner, from its poll loop (as often as it polls): every
    /// [`SWEEP_EVERY`], clears the zones no read-ahead watches any more
    /// ([`Zones::sweep`](super::Zones::sweep)), so that writes there skip their generation
    /// bump again once every reader has left. Returns whether it swept.
    pub fn tick_ring_zones(&self) -> bool {
        let Ok(mut guard) = self.ring.try_borrow_mut() else {
            return false;
        };
        let Some(rh) = guard.as_mut() else {
            return false;
        };
        rh.ticks += 1;
        if rh.ticks < TICKS_PER_CLOCK {
            return false;
        }
        rh.ticks = 0;
        let now = Instant::now();
        if now < rh.next_sweep {
            return false;
        }
        rh.next_sweep = now + rh.sweep_every;
        rh.gens.zones().sweep();
        true
    }

    /// Sets how often [`tick_ring_zones`](Self::tick_ring_zones) sweeps (default
    /// [`SWEEP_EVERY`]): a stress test sweeps often, to race sweeps with the rings.
    pub fn set_ring_sweep_every(&self, every: Duration) {
        if let Some(rh) = self.ring.borrow_mut().as_mut() {
            rh.sweep_every = every;
            rh.next_sweep = Instant::now() + every;
        }
    }

    /// The ring's counters (`None` while it is off).
    pub fn ring_stats(&self) -> Option<RingStats> {
        self.ring.borrow().as_ref().map(|r| r.ring.stats())
    }

    /// The ring's configuration (`None` while it is off).
    pub fn ring_config(&self) -> Option<RingConfig> {
        self.ring.borrow().as_ref().map(|r| r.ring.config())
    }

    /// Looks a guest read of `buf.len` bytes at `offset` up in the ring, before the host
    /// routes it; see [`ring_read_with`](Self::ring_read_with). What the ring holds is
    /// copied into `buf`.
    #[inline(always)]
    pub fn ring_read(self: &Rc<Self>, offset: u64, buf: &BufSlice<D::Buf>) -> RingServed {
        self.ring_read_with(offset, buf.len as u64, &mut |src, src_off, off, n| {
            src.copy_to(src_off, &buf.buf, buf.off + off, n)
        })
    }

    /// Looks a guest read of `len` bytes at `offset` up in the ring, before the host
    /// routes it: tells the stream detector about it, and starts the read-ahead its stream
    /// needs now (the engine's own requests on this executor, see `start_fill`). The bytes from the start of the read that are
    /// in the ring, valid under the current write generations, are handed to `copy` as
    /// (ring buffer, offset in it, offset in the read, length): all of them
    /// ([`RingServed::All`]: the read is done, with no device I/O) or a prefix
    /// ([`RingServed::Prefix`]: the host reads the rest). [`RingServed::Nothing`] (a miss,
    /// the ring off, an invalid request): the host routes the read as usual. Takes no lock
    /// and allocates nothing; a random read costs a few compares on plain cells
    /// ([`Hot::start_here`](crate::ring::Hot::start_here)).
    #[inline(always)]
    pub fn ring_read_with(
        self: &Rc<Self>,
        offset: u64,
        len: u64,
        copy: &mut RingCopy<'_, D::Buf>,
    ) -> RingServed {
        if self.ring_passes(offset, len) {
            return RingServed::Nothing;
        }
        self.ring_read_past(offset, len, copy)
    }

    /// The first half of [`ring_read_with`](Self::ring_read_with), for a host that builds
    /// its `copy` only when it is needed: true when the ring has nothing to do with the
    /// read (off, or a read that starts a stream on the hot half); false: call
    /// [`ring_read_past`](Self::ring_read_past).
    #[inline(always)]
    pub fn ring_passes(&self, offset: u64, len: u64) -> bool {
        !self.ring_on.get() || self.ring_hot.start_here(offset, len)
    }

    /// The second half of [`ring_read_with`](Self::ring_read_with), for a read
    /// [`ring_passes`](Self::ring_passes) did not pass (calling it for one it passed would
    /// look the read up twice).
    #[inline(never)]
    pub fn ring_read_past(
        self: &Rc<Self>,
        offset: u64,
        len: u64,
        copy: &mut RingCopy<'_, D::Buf>,
    ) -> RingServed {
        if self.check_range(offset, len).is_err() {
            return RingServed::Nothing;
        }
        let Ok(mut guard) = self.ring.try_borrow_mut() else {
            return RingServed::Nothing;
        };
        let Some(RingHost {
            ring,
            buf,
            gens,
            parked,
            ..
        }) = guard.as_mut()
        else {
            return RingServed::Nothing;
        };
        let hot = &self.ring_hot;
        let (stream, served) = match ring.lookup(hot, offset, len, |o| gens.current(o)) {
            // A new stream has nothing read ahead and reads nothing ahead yet.
            Lookup::Started => return RingServed::Nothing,
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
        };
        while let Some(f) = ring.next_fill(hot, stream) {
            // Recorded before the read-ahead resolves anything (see `gens`).
            ring.filling(f.slot, gens.record(f.offset));
            let (base, _) = Ring::slot_range(f.slot);
            let dst = BufSlice {
                buf: buf.clone(),
                off: base,
                len: f.len as usize,
            };
            self.start_fill(f, dst, ring, parked, 0);
        }
        served
    }

    /// Issues read-ahead `f` into `dst` (its slot's part of the ring's buffer). Where the
    /// cached metadata of the layers it reaches maps the whole chunk (the steady state of
    /// a stream, through a backing image too), its device reads are submitted at once as
    /// the engine's own request, in the executor's preallocated records, and its end
    /// reaches [`ring_filled`](Self::ring_filled) through the chain's internal sink:
    /// nothing allocates. Where a slice it needs is not cached (a stream's first pass),
    /// the slice is loaded without a task ([`load_slice_ahead`](Self::load_slice_ahead))
    /// and the read-ahead waits in `parked` until it is in
    /// ([`ring_slice_loaded`](Self::ring_slice_loaded)), `tries` counting the loads it
    /// waited for. A chunk holding compressed clusters is read and decompressed without a
    /// task too (`compressed.rs`), waiting the same way when every record for that is
    /// busy. Otherwise (compressed bytes no record can take, a slice no record could
    /// load) a task runs the chain's whole read path,
    /// counted in `ring`.
    fn start_fill(
        self: &Rc<Self>,
        f: Fill,
        dst: BufSlice<D::Buf>,
        ring: &mut Ring,
        parked: &mut Parked,
        tries: u8,
    ) {
        // A read-ahead is a request like a guest's: a cluster it resolves is not reused
        // before it is over.
        let mut parity = self.exec().guest_enter();
        let token = self.sink().token(f.slot as u32);
        let issued = match self.try_fast_read_as(token, f.offset, &dst, parity, true) {
            Err(Unplanned::Compressed) => {
                let r = self.start_zip_fill(f.slot, f.offset, &dst, parity);
                if r.is_ok() {
                    ring.count_compressed_fill();
                }
                r
            }
            r => r,
        };
        match issued {
            Ok(()) => return,
            Err(Unplanned::Slice { layer, offset }) if tries < PARK_TRIES => {
                // It resolved nothing: it enters again when it is issued.
                self.exec().guest_exit(parity);
                if let SliceLoad::Loading(load) =
                    self.load_slice_ahead(layer as usize, offset, false)
                {
                    parked.park(f.slot, load, tries + 1);
                    return;
                }
                parity = self.exec().guest_enter();
            }
            Err(Unplanned::Busy(record)) => {
                // As for a slice load: it enters again when it is issued. Not a try: a
                // record always ends, and each end issues a chunk that waited for it.
                self.exec().guest_exit(parity);
                parked.park(f.slot, record, tries);
                return;
            }
            Err(_) => {}
        }
        ring.count_readahead_task();
        let chain = self.clone();
        self.exec().spawn(async move {
            let r = read_layer(chain.clone(), 0, f.offset, dst).await;
            chain.exec().guest_exit(parity);
            chain.ring_filled(f.slot, r.is_ok());
        });
    }

    /// Slice load `load` ended (its slice cached, or not: then a read-ahead finds it
    /// missing again and loads it again, or after [`PARK_TRIES`] runs as a task): issues
    /// the read-aheads that waited for it.
    pub(crate) fn ring_slice_loaded(self: &Rc<Self>, load: u32) {
        let mut guard = self.ring.borrow_mut();
        let Some(RingHost {
            ring, buf, parked, ..
        }) = guard.as_mut()
        else {
            return;
        };
        // Once over the slots: a read-ahead that parks again (on another slice, or the
        // same one loading again under the same record) waits for that load's end.
        for k in 0..parked.slots() {
            let Some(tries) = parked.take(k, load) else {
                continue;
            };
            let slot = k as u16;
            let (base, _) = Ring::slot_range(slot);
            let f = Fill {
                slot,
                offset: ring.chunk_offset(slot),
                len: ring.chunk_len(slot),
            };
            let dst = BufSlice {
                buf: buf.clone(),
                off: base,
                len: f.len as usize,
            };
            self.start_fill(f, dst, ring, parked, tries);
        }
    }

    /// Queues a read the ring answered [`RingServed::Wait`] (at once: before the host
    /// returns to its poller) under `tag`, with `buf`, the read's whole buffer: the engine
    /// completes `tag` when the rest of it is copied from the ring or read from the base.
    pub fn ring_wait(&self, wait: RingWait, tag: u64, buf: BufSlice<D::Buf>) {
        let covered = wait.covered as usize;
        let rest = buf.sub(covered, buf.len - covered);
        let mut guard = self.ring.borrow_mut();
        let Some(rh) = guard.as_mut() else {
            unreachable!("a ring that answered Wait stays on");
        };
        // The chunks the lookup counted it waiting for, still the stream's (nothing ran
        // since): one link on each.
        let from = wait.offset + wait.covered;
        let (c0, c1) = (from / CHUNK, (from + rest.len as u64 - 1) / CHUNK);
        let read = rh.waiters.add(Waiter {
            tag,
            offset: from,
            buf: rest,
            prefix: covered > 0,
            pending: (c1 - c0 + 1) as u32,
            dead: false,
        });
        for c in c0..=c1 {
            let Some(slot) = rh.ring.held_slot(wait.stream, c) else {
                unreachable!("a chunk a read waits for stays held until it completes");
            };
            rh.waiters.link(slot, read);
        }
    }

    /// The read-ahead into `slot` completed (`ok`): the part of each read waiting on it
    /// that lies in its chunk is copied from it if its data is usable — it succeeded and
    /// no write moved the chunk's generation since it was recorded (read now, after every
    /// waiting read was submitted, as a hit reads it). A read that waited for nothing
    /// else is done then: completed when every chunk it waited for was usable, else its
    /// whole rest is sent to the base.
    pub(crate) fn ring_filled(self: &Rc<Self>, slot: u16, ok: bool) {
        let usable = {
            let Ok(mut guard) = self.ring.try_borrow_mut() else {
                // Reported while the ring is in use (a device that completes inside its
                // submission): handled at the executor's next report.
                return self
                    .exec()
                    .internal_done(self.sink().token(slot as u32), ok);
            };
            let Some(rh) = guard.as_mut() else { return };
            let gen_now = rh.gens.current(rh.ring.chunk_offset(slot));
            rh.ring.filled(slot, ok, gen_now)
        };
        loop {
            let mut guard = self.ring.borrow_mut();
            let Some(rh) = guard.as_mut() else { return };
            let Some(read) = rh.waiters.pop(slot) else {
                rh.ring.woken(slot);
                return;
            };
            let chunk = rh.ring.chunk_offset(slot);
            let Some(w) = rh.waiters.get_mut(read) else {
                unreachable!("a linked read stays in the table until taken");
            };
            let copy = usable && !w.dead;
            if copy {
                // The read's bytes in this chunk.
                let from = w.offset.max(chunk);
                let to = (w.offset + w.buf.len as u64).min(chunk + CHUNK);
                let (src, n) = Ring::waited_range(slot, from, to - from);
                let at = w.buf.off + (from - w.offset) as usize;
                rh.buf.copy_to(src, &w.buf.buf, at, n);
            }
            w.dead |= !usable;
            w.pending -= 1;
            rh.ring.waited_chunk(slot, copy);
            if w.pending > 0 {
                continue;
            }
            let Some(w) = rh.waiters.take(read) else {
                continue;
            };
            if w.dead {
                rh.ring.waited_read(0, w.prefix);
                drop(guard);
                self.submit_read(w.tag, w.offset, w.buf);
            } else {
                rh.ring.waited_read(w.buf.len as u64, w.prefix);
                drop(guard);
                self.exec().complete(w.tag, Ok(()));
            }
        }
    }
}
