//! The direct path: a guest read or write the engine granted one extent of the base
//! ([`Grant`], from `Chain::route_read` / `Chain::route_write`) goes straight there with its
//! own iovecs — one child bdev_io, as SPDK's passthru does — and its completion
//! ([`ChildDone`]) leaves the grace period and completes it. Both hosts use it: a channel on
//! its replica, the owner on the writable image.
//!
//! Every function here returns the guest request (`Err(io)`), having submitted nothing and
//! ended the grant, when the base cannot take it (another device, no target, base busy):
//! the engine path runs it then.

use crate::device::SpdkDevice;
pub use crate::device::Target;
use crate::ffi::bdev_io::ChildDone;
use crate::types::{BdevIo, Qcow2Bdev};
use qcow2_engine::{Exec, Grant};

/// Submits request `io` (a `write` or a read), granted the one extent `grant`, to the base;
/// `D` completes it. On refusal (the grant is for another device, no target, base busy) the
/// grant ends and the request comes back.
#[inline(always)]
pub fn submit<D: ChildDone<Qcow2Bdev>>(
    exec: &Exec<SpdkDevice>,
    target: Option<&Target>,
    mut io: BdevIo,
    grant: Grant,
    write: bool,
) -> Result<(), BdevIo> {
    let Some(t) = target.filter(|t| t.dev == grant.dev()) else {
        grant.finish(exec);
        return Err(io);
    };
    let host = grant.host().0;
    // The completion leaves the grace period with the entry kept in the request's context.
    io.ctx_mut().set_entry(grant.submitted());
    t.base
        .submit::<Qcow2Bdev, D>(io, write, host)
        .map_err(|(io, _)| {
            // Refused: over before it began.
            leave(exec, &io);
            io
        })
}

/// Leaves the grace period a completed direct-path request `io` held.
#[inline(always)]
pub fn leave(exec: &Exec<SpdkDevice>, io: &BdevIo) {
    if let Some(entry) = io.ctx().take_entry() {
        exec.guest_exit(entry);
    }
}
