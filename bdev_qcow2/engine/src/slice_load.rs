//! L2 slices loaded without a task, for read-ahead: the slice read-ahead of a sequential
//! stream (`readahead.rs`), and a ring read-ahead whose chunk's slice is not cached (it
//! waits for the load, then goes out on the fast path). Per chain, per layer, a few
//! records with a slice buffer each, allocated the first time a layer needs one; a load
//! is the engine's own request (`Exec::request_single_as`) into that buffer, and its end
//! comes back through the chain's internal sink to [`Chain::slice_loaded`], which caches
//! the slice as [`Qcow2::load_slice`](crate::Qcow2) would (`image/preload.rs`). After that
//! first use nothing on this path allocates. A load these records cannot take (all busy,
//! or one that needs a task: the owner holds the slice dirty) is left to the caller.

use crate::chain::{Chain, Layer};
use crate::coherency::SliceStamp;
use crate::exec::{InternalSink, OwnedSink, SinkId};
use crate::image::Preload;
use crate::io::{BlockDevice, BufSlice, DeviceOp};
use crate::types::GuestOffset;
use std::rc::Rc;

/// The bit of an internal token's payload that names a slice load (the others: a ring
/// slot, or a compressed fill's record).
pub(crate) const LOAD_BIT: u32 = 1 << 31;
/// Slice buffers per layer: the bytes of this many default (4 KiB) slices, at least two
/// slices, at most eight.
const LOAD_BYTES: usize = 32 << 10;

/// A slice load in flight.
struct Load<B> {
    busy: bool,
    /// Guest offset in the slice (what its look-ups were).
    off: u64,
    stamp: SliceStamp,
    /// The slice read-ahead asked for it: counted when it lands.
    ahead: bool,
    buf: B,
}

/// The records of one layer.
struct LayerLoads<B> {
    slots: Box<[Load<B>]>,
}

/// A chain's slice loads (see the module documentation).
pub(crate) struct SliceLoads<B> {
    /// By layer; a layer's records are allocated the first time it loads a slice.
    layers: Vec<Option<LayerLoads<B>>>,
    /// Where a slice's bytes are copied out of its buffer to be decoded.
    scratch: Vec<u8>,
}

impl<B> Default for SliceLoads<B> {
    fn default() -> Self {
        SliceLoads {
            layers: Vec::new(),
            scratch: Vec::new(),
        }
    }
}

/// How a slice load was asked for ([`Chain::load_slice_ahead`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SliceLoad {
    /// Nothing to load: cached already, or no L2 table there.
    Nothing,
    /// In flight (started now, or already): its end reaches [`Chain::slice_loaded`] with
    /// this payload.
    Loading(u32),
    /// Not taken: every record of the layer is busy, or the load needs a task.
    Refused,
}

fn payload(layer: usize, slot: usize) -> u32 {
    LOAD_BIT | (layer as u32) << 8 | slot as u32
}

impl<D: BlockDevice> Chain<D> {
    /// The chain's sink among the executor's (added the first time; removed when the chain
    /// goes): the ends of its ring read-aheads and slice loads.
    pub(crate) fn sink(self: &Rc<Self>) -> SinkId {
        self.sink
            .get_or_init(|| {
                // Weak: the executor must not keep the chain alive.
                let chain = Rc::downgrade(self);
                let sink: InternalSink = Rc::new(move |payload, ok| {
                    if let Some(c) = chain.upgrade() {
                        c.internal_end(payload, ok);
                    }
                });
                OwnedSink::add(self.exec(), sink)
            })
            .id()
    }

    /// One of this chain's own requests ended.
    fn internal_end(self: &Rc<Self>, payload: u32, ok: bool) {
        if payload & LOAD_BIT != 0 {
            self.slice_loaded(payload, ok);
        } else if payload & crate::ring::compressed::ZIP_BIT != 0 {
            self.zip_filled(payload, ok);
        } else {
            self.ring_filled(payload as u16, ok);
        }
    }

    /// Starts loading the slice of layer `layer` covering guest offset `off` without a
    /// task (`ahead`: for the slice read-ahead, which counts it when it lands); joins a
    /// load of that slice in flight.
    pub(crate) fn load_slice_ahead(
        self: &Rc<Self>,
        layer: usize,
        off: u64,
        ahead: bool,
    ) -> SliceLoad {
        let Some(Layer::Qcow2(q)) = self.layers().get(layer) else {
            return SliceLoad::Refused;
        };
        let (host, stamp) = match q.preload_begin(GuestOffset(off)) {
            Preload::Nothing => return SliceLoad::Nothing,
            Preload::Task => return SliceLoad::Refused,
            Preload::Read { host, stamp } => (host, stamp),
        };
        let sink = self.sink();
        let Ok(mut loads) = self.loads.try_borrow_mut() else {
            return SliceLoad::Refused;
        };
        if loads.layers.len() <= layer {
            loads.layers.resize_with(layer + 1, || None);
        }
        let bytes = q.slice_bytes();
        let recs = loads.layers[layer].get_or_insert_with(|| {
            let n = (LOAD_BYTES / bytes).clamp(2, 8);
            LayerLoads {
                slots: (0..n)
                    .map(|_| Load {
                        busy: false,
                        off: 0,
                        stamp: SliceStamp::OWNER,
                        ahead: false,
                        buf: self.exec().alloc_buf(q.device(), bytes),
                    })
                    .collect(),
            }
        });
        let key = off / q.geometry().slice_coverage();
        if let Some(i) = recs
            .slots
            .iter()
            .position(|l| l.busy && l.off / q.geometry().slice_coverage() == key)
        {
            recs.slots[i].ahead |= ahead;
            return SliceLoad::Loading(payload(layer, i));
        }
        let Some(i) = recs.slots.iter().position(|l| !l.busy) else {
            return SliceLoad::Refused;
        };
        let rec = &mut recs.slots[i];
        *rec = Load {
            busy: true,
            off,
            stamp,
            ahead,
            buf: rec.buf.clone(),
        };
        let buf = BufSlice::whole(rec.buf.clone());
        if loads.scratch.len() < bytes {
            loads.scratch.resize(bytes, 0);
        }
        drop(loads);
        // Like a guest request: the L2 table it reads is not reused before it is over.
        let parity = self.exec().guest_enter();
        let p = payload(layer, i);
        let op = DeviceOp::Read { offset: host, buf };
        self.exec()
            .request_single_as(sink.token(p), parity, true, q.device(), op);
        SliceLoad::Loading(p)
    }

    /// The slice load `payload` ended (`ok`): caches the slice if it is still good, then
    /// hands the news to the slice read-ahead and to the ring read-aheads that wait for it.
    fn slice_loaded(self: &Rc<Self>, payload: u32, ok: bool) {
        let (layer, i) = (
            ((payload & !LOAD_BIT) >> 8) as usize,
            (payload & 0xff) as usize,
        );
        let loads = self.loads.try_borrow_mut();
        let (Ok(mut loads), false) = (loads, self.ring.try_borrow_mut().is_err()) else {
            // Reported while either is in use: handled at the executor's next report.
            return self.exec().internal_done(self.sink().token(payload), ok);
        };
        let SliceLoads { layers, scratch } = &mut *loads;
        let Some(rec) = layers
            .get_mut(layer)
            .and_then(Option::as_mut)
            .and_then(|l| l.slots.get_mut(i))
            .filter(|r| r.busy)
        else {
            return;
        };
        rec.busy = false;
        let (off, ahead) = (rec.off, rec.ahead);
        let cached = ok
            && match self.layers().get(layer) {
                Some(Layer::Qcow2(q)) => {
                    let raw = &mut scratch[..q.slice_bytes()];
                    BufSlice::whole(rec.buf.clone()).copy_out(0, raw);
                    q.preload_end(GuestOffset(off), rec.stamp, raw)
                }
                _ => false,
            };
        drop(loads);
        if ahead && cached {
            self.slice_ahead_loaded(off);
        }
        self.ring_slice_loaded(payload);
    }
}
