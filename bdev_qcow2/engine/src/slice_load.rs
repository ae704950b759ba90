//! L2 slices loaded without a task, for read-ahead: the slice read-ahead of a sequential
//! stream (`readahead.rs`), and a ring read-ahead whose chunk's slice is not cached (it
//! waits for the load, then goes out on the fast path). Per chain, per layer, a few
//! records with a slice buffer each, allocated the first time a layer needs one; a load
//! is the engine's own request (`Exec::request_single_as`) into that buffer, and its end
//! comes back through the chain's internal sink (`chain/loads.rs`), which caches the slice
//! as [`Qcow2::load_slice`](crate::Qcow2) would (`image/preload.rs`). After that first use
//! nothing on this path allocates. A load these records cannot take (all busy, or one
//! that needs a task: the owner holds the slice dirty) is left to the caller.
//!
//! This module keeps the records; it issues nothing: the chain takes a record here
//! ([`SliceLoads::take`]), issues the read, and hands its end back
//! ([`SliceLoads::finish`]).

use crate::coherency::SliceStamp;
use crate::exec::Exec;
use crate::image::Qcow2;
use crate::io::{BlockDevice, BufSlice, IoBuffer};
use crate::types::GuestOffset;

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

/// How a slice load was asked for
/// ([`Chain::load_slice_ahead`](crate::Chain::load_slice_ahead)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SliceLoad {
    /// Nothing to load: cached already, or no L2 table there.
    Nothing,
    /// In flight (started now, or already): its end reaches the chain's internal sink
    /// with this payload.
    Loading(u32),
    /// Not taken: every record of the layer is busy, or the load needs a task.
    Refused,
}

/// What [`SliceLoads::take`] did.
pub(crate) enum Taken<B> {
    /// A load of that slice is in flight already (payload): joined.
    Joined(u32),
    /// A record was taken: read the slice into `buf`, its end reported with `payload`.
    Start {
        /// The load's payload.
        payload: u32,
        /// The record's buffer.
        buf: BufSlice<B>,
    },
    /// Every record of the layer is busy.
    Busy,
}

/// What a slice load that ended did ([`SliceLoads::finish`]).
pub(crate) struct Loaded {
    /// Guest offset in the slice.
    pub(crate) off: u64,
    /// The slice read-ahead asked for it.
    pub(crate) ahead: bool,
    /// The slice was cached.
    pub(crate) cached: bool,
}

fn payload(layer: usize, slot: usize) -> u32 {
    LOAD_BIT | (layer as u32) << 8 | slot as u32
}

/// The layer and the record a load's payload names.
pub(crate) fn load_of(payload: u32) -> (usize, usize) {
    (
        ((payload & !LOAD_BIT) >> 8) as usize,
        (payload & 0xff) as usize,
    )
}

impl<B: IoBuffer> SliceLoads<B> {
    /// Takes a record of layer `layer` (image `q`, on `exec`) to load the slice covering
    /// guest offset `off` under `stamp` (`ahead`: for the slice read-ahead), allocating
    /// the layer's records the first time; joins a load of that slice in flight.
    pub(crate) fn take<D: BlockDevice<Buf = B>>(
        &mut self,
        exec: &Exec<D>,
        q: &Qcow2<D>,
        layer: usize,
        off: u64,
        stamp: SliceStamp,
        ahead: bool,
    ) -> Taken<B> {
        if self.layers.len() <= layer {
            self.layers.resize_with(layer + 1, || None);
        }
        let bytes = q.slice_bytes();
        let recs = self.layers[layer].get_or_insert_with(|| {
            let n = (LOAD_BYTES / bytes).clamp(2, 8);
            LayerLoads {
                slots: (0..n)
                    .map(|_| Load {
                        busy: false,
                        off: 0,
                        stamp: SliceStamp::OWNER,
                        ahead: false,
                        buf: exec.alloc_buf(q.device(), bytes),
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
            return Taken::Joined(payload(layer, i));
        }
        let Some(i) = recs.slots.iter().position(|l| !l.busy) else {
            return Taken::Busy;
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
        if self.scratch.len() < bytes {
            self.scratch.resize(bytes, 0);
        }
        Taken::Start {
            payload: payload(layer, i),
            buf,
        }
    }

    /// The load in record `i` of layer `layer` ended (`ok`), `q` that layer's image:
    /// frees the record and caches the slice if it is still good
    /// ([`Qcow2::preload_end`]). `None` when no such load is in flight.
    pub(crate) fn finish<D: BlockDevice<Buf = B>>(
        &mut self,
        layer: usize,
        i: usize,
        ok: bool,
        q: Option<&Qcow2<D>>,
    ) -> Option<Loaded> {
        let SliceLoads { layers, scratch } = self;
        let rec = layers
            .get_mut(layer)
            .and_then(Option::as_mut)
            .and_then(|l| l.slots.get_mut(i))
            .filter(|r| r.busy)?;
        rec.busy = false;
        let (off, ahead) = (rec.off, rec.ahead);
        let cached = ok
            && match q {
                Some(q) => {
                    let raw = &mut scratch[..q.slice_bytes()];
                    BufSlice::whole(rec.buf.clone()).copy_out(0, raw);
                    q.preload_end(GuestOffset(off), rec.stamp, raw)
                }
                None => false,
            };
        Some(Loaded { off, ahead, cached })
    }
}
