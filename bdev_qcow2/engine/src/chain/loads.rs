//! The chain's own requests (ring read-aheads, compressed fills, slice loads): the
//! executor's internal sink that reports their ends, and the slice loads
//! (`crate::slice_load`) the chain issues without a task for both read-aheads.

use super::{Chain, Layer};
use crate::exec::{InternalSink, OwnedSink, SinkId};
use crate::image::Preload;
use crate::io::{BlockDevice, DeviceOp};
use crate::ring::compressed::ZIP_BIT;
use crate::slice_load::{load_of, SliceLoad, Taken, LOAD_BIT};
use crate::types::GuestOffset;
use std::rc::Rc;

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
        } else if payload & ZIP_BIT != 0 {
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
        let (p, buf) = match loads.take(self.exec(), q, layer, off, stamp, ahead) {
            Taken::Joined(p) => return SliceLoad::Loading(p),
            Taken::Busy => return SliceLoad::Refused,
            Taken::Start { payload, buf } => (payload, buf),
        };
        drop(loads);
        // Like a guest request: the L2 table it reads is not reused before it is over.
        let parity = self.guest_enter();
        let op = DeviceOp::Read { offset: host, buf };
        self.exec()
            .request_single_as(sink.token(p), parity, true, q.device(), op);
        SliceLoad::Loading(p)
    }

    /// The slice load `payload` ended (`ok`): caches the slice if it is still good, then
    /// hands the news to the slice read-ahead and to the ring read-aheads that wait for it.
    fn slice_loaded(self: &Rc<Self>, payload: u32, ok: bool) {
        let (layer, i) = load_of(payload);
        let loads = self.loads.try_borrow_mut();
        let (Ok(mut loads), false) = (loads, self.ring.host().try_borrow_mut().is_err()) else {
            // Reported while either is in use: handled at the executor's next report.
            return self.exec().internal_done(self.sink().token(payload), ok);
        };
        let q = match self.layers().get(layer) {
            Some(Layer::Qcow2(q)) => Some(&**q),
            _ => None,
        };
        let Some(done) = loads.finish(layer, i, ok, q) else {
            return;
        };
        drop(loads);
        if done.ahead && done.cached {
            self.slice_ahead_loaded(done.off);
        }
        self.ring_slice_loaded(payload);
    }
}
