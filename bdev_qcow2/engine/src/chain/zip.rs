//! The chain's side of ring read-aheads whose chunk holds compressed clusters
//! (`ring/compressed.rs`, which keeps the records and decompresses): planned by the fast
//! path with the compressed parts included, issued as one engine request, and handed to
//! the ring when their reads end.

use super::{Chain, Layer, Unplanned};
use crate::exec::GraceEntry;
use crate::image::Qcow2;
use crate::io::{BlockDevice, BufSlice, DeviceOp};
use crate::ring::compressed::{ZipLayers, ZipRefused};
use std::rc::Rc;

impl<D: BlockDevice> ZipLayers<D> for Chain<D> {
    fn zip_layer(&self, layer: usize) -> Option<&Qcow2<D>> {
        match self.layers().get(layer) {
            Some(Layer::Qcow2(q)) => Some(q),
            _ => None,
        }
    }
}

impl From<ZipRefused> for Unplanned {
    fn from(e: ZipRefused) -> Self {
        match e {
            ZipRefused::Busy(record) => Unplanned::Busy(record),
            ZipRefused::Unfit => Unplanned::Other,
        }
    }
}

impl<D: BlockDevice> Chain<D> {
    /// Issues the read-ahead of the chunk at `offset` into `dst` (ring slot `slot`), whose
    /// mapping holds compressed clusters (see `ring/compressed.rs`): one request of the
    /// plan's data runs into `dst` and of the compressed bytes' reads into a record;
    /// `entry` is the request's ([`Exec::guest_enter`](crate::Exec::guest_enter)), exited
    /// when its device reads end. Nothing issued on an error, which hands the entry back:
    /// [`Unplanned::Slice`] (a slice to load first), [`Unplanned::Busy`] (every record
    /// busy: retry when that one ends), or another (a task must do it).
    pub(super) fn start_zip_fill(
        self: &Rc<Self>,
        slot: u16,
        offset: u64,
        dst: &BufSlice<D::Buf>,
        entry: GraceEntry,
    ) -> Result<(), (Unplanned, GraceEntry)> {
        let sink = self.sink();
        let Ok(mut zips) = self.ring.zips().try_borrow_mut() else {
            return Err((Unplanned::Other, entry));
        };
        let plan = match self.plan_fast::<true>(offset, dst) {
            Ok(plan) => plan,
            Err(e) => return Err((e, entry)),
        };
        if !zips.has_records() {
            let dev = match &self.layers()[0] {
                Layer::Qcow2(q) => q.dev(),
                Layer::Raw { dev, .. } => *dev,
            };
            let cluster = self
                .layers()
                .iter()
                .filter_map(|l| match l {
                    Layer::Qcow2(q) => Some(q.geometry().cluster_size() as usize),
                    Layer::Raw { .. } => None,
                })
                .max()
                .unwrap_or(0);
            zips.allocate(cluster, |bytes| self.exec().alloc_buf(dev, bytes));
        }
        let (runs, parts) = (&plan.runs, &plan.zips);
        let payload = match zips.take(&**self, parts, slot, dst) {
            Ok(payload) => payload,
            Err(e) => return Err((e.into(), entry)),
        };
        let exec = self.exec();
        let req = exec.request_begin_as(sink.token(payload), entry, true);
        for r in runs {
            let buf = dst.sub(r.buf_off, r.len);
            exec.request_op(
                req,
                r.dev,
                DeviceOp::Read {
                    offset: r.host,
                    buf,
                },
            );
        }
        for r in zips.reads(payload) {
            let op = DeviceOp::Read {
                offset: r.host,
                buf: r.dst,
            };
            exec.request_op(req, r.dev, op);
        }
        exec.request_arm(req);
        Ok(())
    }

    /// The device reads of compressed fill `payload` ended (`ok`): its clusters are
    /// decompressed into the ring slot, then the fill goes to the ring and the read-aheads
    /// that waited for a record to it.
    pub(crate) fn zip_filled(self: &Rc<Self>, payload: u32, ok: bool) {
        let zips = self.ring.zips().try_borrow_mut();
        let (Ok(mut zips), false) = (zips, self.ring.host().try_borrow_mut().is_err()) else {
            // Reported while either is in use: handled at the executor's next report.
            return self.exec().internal_done(self.sink().token(payload), ok);
        };
        let Some((slot, ok)) = zips.finish(&**self, payload, ok) else {
            return;
        };
        drop(zips);
        self.ring_filled(slot, ok);
        self.ring_slice_loaded(payload);
    }
}
