//! The chain's side of its prefetch ring (`crate::ring`): reads are looked up in the ring
//! before they are routed, and read-ahead fills it through the chain's own read path, so
//! it follows the mapping in every layer (allocated clusters from the image's device,
//! unallocated ones from the backing layer, zeros from metadata without a read,
//! compressed clusters decompressed once into the ring, nothing past the end of the disk).
//! The ring's state ([`RingHost`]) decides; the methods here issue what it hands out.

use super::{read_layer, Chain, Unplanned};
use crate::error::{Error, Result};
use crate::io::{BlockDevice, BufSlice, IoBuffer};
use crate::ring::host::{RingHost, Woken};
use crate::ring::{ChainRing, Fill, Passes, RingConfig, RingCopy, RingServed, WriteGens};
use crate::slice_load::SliceLoad;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

/// Times a read-ahead waits for a slice load before it runs as a task instead: a chunk
/// spans several slices of a layer only with tiny ones (slices cover 16 KiB at least:
/// eight a chunk), and a load may find its slice changed.
const PARK_TRIES: u8 = 12;

impl<D: BlockDevice> Chain<D> {
    /// The chain's prefetch ring part: on or off, counters, configuration, the write
    /// generations every write moves ([`ChainRing::written`]).
    #[inline(always)]
    pub fn ring(&self) -> &ChainRing<D::Buf> {
        &self.ring
    }

    /// Turns the prefetch ring on for this core: allocates its buffer once, from the top
    /// layer's device (DMA memory on SPDK), of `cfg.ring_bytes`. `gens` are the image's
    /// write generations, shared by every core of the image: each core's writes must go
    /// through [`ChainRing::written`] from then on. Refuses a configuration
    /// [`RingConfig::validate`] refuses, and a second call. Everything the ring's path uses
    /// is allocated here: the buffer, the slots, the waiter table, and where the executor
    /// reports the ends of read-aheads (the chain's internal sink, removed with the chain).
    pub fn enable_ring(self: &Rc<Self>, cfg: RingConfig, gens: Arc<WriteGens>) -> Result<()> {
        let dev = self.layers()[0].dev();
        self.ring
            .enable(cfg, self.size(), gens, |bytes| {
                let buf = self.exec().alloc_buf(dev, bytes);
                let _ = self.sink();
                buf
            })
            .map_err(Error::InvalidRequest)
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
    /// routes it, as the request plan does: looks it up in the chain's stream table once
    /// (and tells read-ahead of L2 slices the stream it continues: a host that uses this
    /// does not call [`read_ahead`](Self::read_ahead) for the read too), and starts the
    /// read-ahead its stream needs now (the engine's own requests on this executor, see
    /// `start_fill`). The bytes from the start of the read that are
    /// in the ring, valid under the current write generations, are handed to `copy` as
    /// (ring buffer, offset in it, offset in the read, length): all of them
    /// ([`RingServed::All`]: the read is done, with no device I/O) or a prefix
    /// ([`RingServed::Prefix`]: the host reads the rest). [`RingServed::Nothing`] (a miss,
    /// the ring off, an invalid request): the host routes the read as usual. Takes no lock
    /// and allocates nothing; a random read costs a few compares on plain cells
    /// ([`Hot::passes`](crate::ring::Hot::passes)).
    #[inline(always)]
    pub fn ring_read_with(
        self: &Rc<Self>,
        offset: u64,
        len: u64,
        copy: &mut RingCopy<'_, D::Buf>,
    ) -> RingServed {
        let (served, stream) = match self.ring.passes(offset, len) {
            Passes::By => (RingServed::Nothing, None),
            Passes::ByStream(i) => (RingServed::Nothing, Some(i)),
            Passes::ToRing => self.ring_read_past(offset, len, copy),
        };
        self.read_ahead_after_ring(stream, offset, len);
        served
    }

    /// The second half of [`ring_read_with`](Self::ring_read_with), for a read
    /// [`ChainRing::passes`] did not pass (calling it for one it passed would
    /// look the read up twice): what the ring served, and the stream the read continued
    /// (for read-ahead of L2 slices, which follows the same streams).
    #[inline(never)]
    pub(crate) fn ring_read_past(
        self: &Rc<Self>,
        offset: u64,
        len: u64,
        copy: &mut RingCopy<'_, D::Buf>,
    ) -> (RingServed, Option<u8>) {
        if self.disk.check_range(offset, len).is_err() {
            return (RingServed::Nothing, None);
        }
        let Ok(mut guard) = self.ring.host().try_borrow_mut() else {
            return (RingServed::Nothing, None);
        };
        let Some(rh) = guard.as_mut() else {
            return (RingServed::Nothing, None);
        };
        let hot = self.ring.hot();
        let Some((stream, served)) = rh.look_up(hot, offset, len, copy) else {
            return (RingServed::Nothing, None);
        };
        while let Some((f, dst)) = rh.next_fill(hot, stream) {
            self.start_fill(f, dst, rh, 0);
        }
        (served, Some(stream))
    }

    /// Issues read-ahead `f` into `dst` (its slot's part of the ring's buffer). Where the
    /// cached metadata of the layers it reaches maps the whole chunk (the steady state of
    /// a stream, through a backing image too), its device reads are submitted at once as
    /// the engine's own request, in the executor's preallocated records, and its end
    /// reaches [`ring_filled`](Self::ring_filled) through the chain's internal sink:
    /// nothing allocates. Where a slice it needs is not cached (a stream's first pass),
    /// the slice is loaded without a task ([`load_slice_ahead`](Self::load_slice_ahead))
    /// and the read-ahead waits, parked in `rh`, until it is in
    /// ([`ring_slice_loaded`](Self::ring_slice_loaded)), `tries` counting the loads it
    /// waited for. A chunk holding compressed clusters is read and decompressed without a
    /// task too (`ring/compressed.rs`), waiting the same way when every record for that is
    /// busy. Otherwise (compressed bytes no record can take, a slice no record could
    /// load) a task runs the chain's whole read path, counted in `rh`.
    fn start_fill(
        self: &Rc<Self>,
        f: Fill,
        dst: BufSlice<D::Buf>,
        rh: &mut RingHost<D::Buf>,
        tries: u8,
    ) {
        // A read-ahead is a request like a guest's: a cluster it resolves is not reused
        // before it is over.
        let entry = self.guest_enter();
        let token = self.sink().token(f.slot as u32);
        let timed = rh
            .times_fills()
            .then(|| (Instant::now(), self.exec().stats().device_ops));
        let issued = match self.try_fast_read_as(token, f.offset, &dst, entry, true) {
            Ok(()) => {
                // Only one that reached a device: a chunk answered from metadata (zeros,
                // holes) is over at once on any base.
                let reached = |&(_, ops): &(Instant, u64)| self.exec().stats().device_ops != ops;
                if let Some((at, _)) = timed.filter(reached) {
                    rh.fill_issued(f.slot, at, at.elapsed());
                }
                return;
            }
            Err((Unplanned::Compressed, entry)) => {
                let r = self.start_zip_fill(f.slot, f.offset, &dst, entry);
                if r.is_ok() {
                    rh.count_compressed_fill();
                }
                r
            }
            r => r,
        };
        let entry = match issued {
            Ok(()) => return,
            Err((Unplanned::Slice { layer, offset }, entry)) if tries < PARK_TRIES => {
                // It resolved nothing: it enters again when it is issued.
                self.exec().guest_exit(entry);
                if let SliceLoad::Loading(load) =
                    self.load_slice_ahead(layer as usize, offset, false)
                {
                    rh.park(f.slot, load, tries + 1);
                    return;
                }
                self.guest_enter()
            }
            Err((Unplanned::Busy(record), entry)) => {
                // As for a slice load: it enters again when it is issued. Not a try: a
                // record always ends, and each end issues a chunk that waited for it.
                self.exec().guest_exit(entry);
                rh.park(f.slot, record, tries);
                return;
            }
            Err((_, entry)) => entry,
        };
        rh.count_readahead_task();
        let chain = self.clone();
        self.exec().spawn(async move {
            let r = read_layer(chain.clone(), 0, f.offset, dst).await;
            chain.exec().guest_exit(entry);
            chain.ring_filled(f.slot, r.is_ok());
        });
    }

    /// Slice load `load` ended (its slice cached, or not: then a read-ahead finds it
    /// missing again and loads it again, or after [`PARK_TRIES`] runs as a task): issues
    /// the read-aheads that waited for it.
    pub(crate) fn ring_slice_loaded(self: &Rc<Self>, load: u32) {
        let mut guard = self.ring.host().borrow_mut();
        let Some(rh) = guard.as_mut() else {
            return;
        };
        // Once over the slots: a read-ahead that parks again (on another slice, or the
        // same one loading again under the same record) waits for that load's end.
        for k in 0..rh.parked_slots() {
            if let Some(u) = rh.unpark(k, load) {
                self.start_fill(u.fill, u.dst, rh, u.tries);
            }
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
            let Ok(mut guard) = self.ring.host().try_borrow_mut() else {
                // Reported while the ring is in use (a device that completes inside its
                // submission): handled at the executor's next report.
                return self
                    .exec()
                    .internal_done(self.sink().token(slot as u32), ok);
            };
            let Some(rh) = guard.as_mut() else { return };
            rh.filled(slot, ok)
        };
        loop {
            let mut guard = self.ring.host().borrow_mut();
            let Some(rh) = guard.as_mut() else { return };
            let Some(woken) = rh.next_woken(slot, usable) else {
                return;
            };
            drop(guard);
            match woken {
                Woken::ToBase { tag, offset, buf } => self.submit_read(tag, offset, buf),
                Woken::Served { tag } => self.exec().complete(tag, Ok(())),
            }
        }
    }
}
