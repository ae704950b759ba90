//! The direct path: a guest read or write that cached metadata maps to one extent of the
//! base goes straight there with its own iovecs — one child bdev_io, as SPDK's passthru
//! does — and its completion ([`ChildDone`]) leaves the grace period and completes it. Both
//! hosts use it: a channel on its replica, the owner on the writable image.
//!
//! Every function here returns the guest request (`Err(io)`), having submitted nothing and
//! left no grace period open, when the engine must run it: a slice miss, an allocation,
//! several extents, zeros, a backing image, or a busy base.

use crate::device::SpdkDevice;
use crate::ffi::bdev_io::{BdevIo, ChildDone, DirectTarget};
use qcow2_engine::{Chain, DevId, Direct, Exec};

/// A base device as the direct path sees it: its id in the host's executor (an extent's
/// [`Direct::dev`] must match) and where to submit.
#[derive(Clone, Copy, Debug)]
pub struct Target {
    /// The device's id in its executor.
    pub dev: DevId,
    /// Its descriptor and this thread's channel.
    pub base: DirectTarget,
}

/// A guest request, as the direct path looks it up.
#[derive(Clone, Copy, Debug)]
pub struct DirectReq {
    /// First guest byte.
    pub off: u64,
    /// Length in bytes.
    pub len: u64,
    /// A write (else a read).
    pub write: bool,
    /// Whether the chain's memo of linear slices is still to be asked
    /// (`Chain::map_direct`); without, the caller asked it already
    /// (`Chain::map_direct_past_memo`).
    pub ask_memo: bool,
}

impl DirectReq {
    /// The request `io` (`write` or read).
    #[inline(always)]
    pub fn of(io: &BdevIo, write: bool, ask_memo: bool) -> DirectReq {
        DirectReq {
            off: io.offset_bytes(),
            len: io.len_bytes(),
            write,
            ask_memo,
        }
    }
}

/// Looks `req` (the request `io`) up in cached metadata and, when it maps to one extent,
/// submits it there; `D` completes it.
#[inline(always)]
pub fn submit_direct<D: ChildDone>(
    chain: &Chain<SpdkDevice>,
    exec: &Exec<SpdkDevice>,
    target: Option<&Target>,
    io: BdevIo,
    req: DirectReq,
) -> Result<(), BdevIo> {
    if target.is_none() {
        return Err(io);
    }
    let found = if req.ask_memo {
        chain.map_direct(req.off, req.len, req.write)
    } else {
        chain.map_direct_past_memo(req.off, req.len, req.write)
    };
    let Some(d) = found else {
        return Err(io);
    };
    if req.write {
        return submit_mapped::<D>(exec, target, io, d, true);
    }
    submit_read_mapped::<D>(chain, exec, target, io, d)
}

/// [`submit_mapped`] for a read, counted as served on the direct path once submitted.
#[inline(always)]
pub fn submit_read_mapped<D: ChildDone>(
    chain: &Chain<SpdkDevice>,
    exec: &Exec<SpdkDevice>,
    target: Option<&Target>,
    io: BdevIo,
    d: Direct,
) -> Result<(), BdevIo> {
    submit_mapped::<D>(exec, target, io, d, false)?;
    chain.count_direct_read();
    Ok(())
}

/// Submits request `io` (a `write` or a read), mapped to the one extent `d` (whose grace
/// period it holds), to the base; on refusal (another device, no target, base busy) leaves
/// the grace period.
#[inline(always)]
pub fn submit_mapped<D: ChildDone>(
    exec: &Exec<SpdkDevice>,
    target: Option<&Target>,
    mut io: BdevIo,
    d: Direct,
    write: bool,
) -> Result<(), BdevIo> {
    let Some(t) = target.filter(|t| t.dev == d.dev) else {
        exec.guest_exit(d.parity);
        return Err(io);
    };
    io.ctx_mut().set_parity(d.parity);
    t.base.submit::<D>(io, write, d.host).map_err(|(io, _)| {
        exec.guest_exit(d.parity);
        io
    })
}

/// Leaves the grace period a completed direct-path request `io` held.
#[inline(always)]
pub fn leave(exec: &Exec<SpdkDevice>, io: &BdevIo) {
    exec.guest_exit(io.ctx().parity());
}
