//! The module's per-I/O context: what a request carries in its bdev_io's driver area (SPDK
//! reserves it in every bdev_io: `get_ctx_size`). `submit_request` initializes it; the handle
//! reaches it with [`BdevIo::ctx`](crate::ffi::bdev_io::BdevIo::ctx).

use crate::ffi::sys;
use qcow2_engine::Op;

/// The per-I/O context.
#[repr(C)]
#[derive(Debug)]
pub struct IoCtx {
    /// `SPDK_BDEV_IO_STATUS_*` of a forwarded request, on its way back.
    status: sys::spdk_bdev_io_status,
    /// Grace-period entry of a request on the direct path.
    parity: u8,
    /// What the owner runs for a forwarded request.
    op: Op,
}

impl IoCtx {
    /// A fresh context (nothing recorded yet).
    pub const NEW: IoCtx = IoCtx {
        status: sys::SPDK_BDEV_IO_STATUS_SUCCESS,
        parity: 0,
        op: Op::Read,
    };

    /// The status a forwarded request carries back.
    pub fn status(&self) -> sys::spdk_bdev_io_status {
        self.status
    }

    /// Sets the status a forwarded request carries back.
    pub fn set_status(&mut self, s: sys::spdk_bdev_io_status) {
        self.status = s;
    }

    /// The grace-period entry of a direct-path request.
    #[inline(always)]
    pub fn parity(&self) -> u8 {
        self.parity
    }

    /// Records the grace-period entry of a direct-path request.
    #[inline(always)]
    pub fn set_parity(&mut self, p: u8) {
        self.parity = p;
    }

    /// What the owner runs for this forwarded request.
    #[inline(always)]
    pub fn op(&self) -> Op {
        self.op
    }

    /// Sets what the owner runs for this request.
    #[inline(always)]
    pub fn set_op(&mut self, op: Op) {
        self.op = op;
    }
}
