//! The module's per-I/O context: what a request carries in its bdev_io's driver area (SPDK
//! reserves it in every bdev_io: `get_ctx_size`). `submit_request` initializes it; the handle
//! reaches it with [`BdevIo::ctx`](crate::ffi::bdev_io::BdevIo::ctx).

use crate::reservation::Reservation;
use crate::status::Status;
use qcow2_engine::{DevId, GraceEntry, Op};
use std::cell::Cell;

/// The per-I/O context.
#[repr(C)]
pub struct IoCtx {
    /// How a forwarded request ended, on its way back.
    status: Status,
    /// The grace-period entry of a request on the direct path, taken by its one exit
    /// (a cell: the completion reaches the context through a shared handle).
    entry: Cell<Option<GraceEntry>>,
    /// What the owner runs for a forwarded request.
    op: Op,
    /// A direct read of an encrypted image: the crypt view it was granted and the host
    /// offset read, which its completion decrypts with.
    crypt: (DevId, u64),
    /// A core replica's first write: its step in the owner's reservation protocol.
    reservation: Reservation,
}

impl IoCtx {
    /// A fresh context (nothing recorded yet). A value to initialize with: each use is a
    /// context of its own, so its cell is never shared.
    #[allow(clippy::declare_interior_mutable_const)]
    pub const NEW: IoCtx = IoCtx {
        status: Status::Success,
        entry: Cell::new(None),
        op: Op::Read,
        crypt: (DevId(0), 0),
        reservation: Reservation::None,
    };

    /// The status a forwarded request carries back.
    pub fn status(&self) -> Status {
        self.status
    }

    /// Sets the status a forwarded request carries back.
    pub fn set_status(&mut self, s: Status) {
        self.status = s;
    }

    /// Takes the grace-period entry of a direct-path request (`None` once taken).
    #[inline(always)]
    pub fn take_entry(&self) -> Option<GraceEntry> {
        self.entry.take()
    }

    /// Records the grace-period entry of a direct-path request.
    #[inline(always)]
    pub fn set_entry(&mut self, e: GraceEntry) {
        self.entry.set(Some(e));
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

impl IoCtx {
    /// Whether the request is a first write in the owner's reservation protocol.
    #[inline(always)]
    pub fn reserving(&self) -> bool {
        !matches!(self.reservation, Reservation::None)
    }

    /// Takes the request's step in the reservation protocol (leaves
    /// [`Reservation::None`]).
    pub fn take_reservation(&mut self) -> Reservation {
        std::mem::take(&mut self.reservation)
    }

    /// Sets the request's step in the reservation protocol.
    pub fn set_reservation(&mut self, r: Reservation) {
        self.reservation = r;
    }
}

impl IoCtx {
    /// The crypt view and host offset of a direct read of an encrypted image.
    #[inline(always)]
    pub fn crypt(&self) -> (DevId, u64) {
        self.crypt
    }

    /// Records the crypt view and host offset of a direct read of an encrypted image.
    #[inline(always)]
    pub fn set_crypt(&mut self, view: DevId, host: u64) {
        self.crypt = (view, host);
    }
}

impl std::fmt::Debug for IoCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoCtx")
            .field("status", &self.status)
            .field("op", &self.op)
            .finish_non_exhaustive()
    }
}
