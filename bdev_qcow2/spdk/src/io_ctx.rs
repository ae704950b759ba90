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
    /// What the few longer paths carry between their steps.
    carried: Carried,
}

/// What a request carries between the steps of a longer path: at most one of these, so one
/// enum, whose tag alone a new request writes.
enum Carried {
    /// Nothing (every request starts so).
    Nothing,
    /// A direct read of an encrypted image: the crypt view it was granted and the host
    /// offset read, which its completion decrypts with.
    Crypt(DevId, u64),
    /// A core replica's first write: its step in the owner's reservation protocol (never
    /// [`Reservation::None`]: that is `Nothing`).
    Reservation(Reservation),
}

impl IoCtx {
    /// A fresh context (nothing recorded yet). A function, not a constant: built in place
    /// it writes a few bytes and the enum's tag, where a constant's copy writes them all.
    #[inline(always)]
    pub fn new() -> IoCtx {
        IoCtx {
            status: Status::Success,
            entry: Cell::new(None),
            op: Op::Read,
            carried: Carried::Nothing,
        }
    }

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
        matches!(self.carried, Carried::Reservation(_))
    }

    /// Takes the request's step in the reservation protocol (leaves
    /// [`Reservation::None`]).
    pub fn take_reservation(&mut self) -> Reservation {
        match std::mem::replace(&mut self.carried, Carried::Nothing) {
            Carried::Reservation(r) => r,
            other => {
                self.carried = other;
                Reservation::None
            }
        }
    }

    /// Sets the request's step in the reservation protocol.
    pub fn set_reservation(&mut self, r: Reservation) {
        self.carried = match r {
            Reservation::None => Carried::Nothing,
            r => Carried::Reservation(r),
        };
    }
}

impl IoCtx {
    /// The crypt view and host offset of a direct read of an encrypted image.
    #[inline(always)]
    pub fn crypt(&self) -> Option<(DevId, u64)> {
        match self.carried {
            Carried::Crypt(view, host) => Some((view, host)),
            _ => None,
        }
    }

    /// Records the crypt view and host offset of a direct read of an encrypted image.
    #[inline(always)]
    pub fn set_crypt(&mut self, view: DevId, host: u64) {
        self.carried = Carried::Crypt(view, host);
    }
}

impl Default for IoCtx {
    fn default() -> IoCtx {
        IoCtx::new()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_context_carries_nothing() {
        let c = IoCtx::new();
        assert!(!c.reserving());
        assert_eq!(c.crypt(), None);
        assert!(c.take_entry().is_none());
        assert_eq!(c.status(), Status::Success);
    }

    #[test]
    fn reservation_and_crypt_share_one_place() {
        let mut c = IoCtx::new();
        c.set_reservation(Reservation::Ask(GraceEntry::unshared()));
        assert!(c.reserving());
        assert_eq!(c.crypt(), None);
        assert!(matches!(c.take_reservation(), Reservation::Ask(_)));
        assert!(!c.reserving());
        // Setting `None` is carrying nothing.
        c.set_reservation(Reservation::None);
        assert!(!c.reserving());
        // A crypt view is not a reservation, and taking one leaves it in place.
        c.set_crypt(DevId(3), 4096);
        assert!(!c.reserving());
        assert!(matches!(c.take_reservation(), Reservation::None));
        assert_eq!(c.crypt(), Some((DevId(3), 4096)));
    }
}
