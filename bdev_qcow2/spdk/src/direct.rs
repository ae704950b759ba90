//! The direct path: a guest read or write the engine granted one extent of the base
//! ([`Grant`], from `Chain::route_read` / `Chain::route_write`) goes straight there with its
//! own iovecs — one child bdev_io, as SPDK's passthru does — and its completion ([`Done`])
//! leaves the grace period and completes it. Both hosts use it: a channel on its replica,
//! the owner on the writable image; each says how through [`DirectHost`].
//!
//! A read granted on an encrypted image's crypt view over the base goes there the same way
//! ([`Decrypt`]) and is decrypted in the request's own buffer in the child's completion, on
//! the same core, before the request completes. A write through the view (encrypted in a
//! bounce buffer), a grant on another device, or a host without a target goes to the
//! executor as the one device operation it is ([`Chain::submit_direct`]): no task, no
//! second plan; its completion reaches the host as the engine's ([`Host::request_done`]).
//!
//! [`submit`] returns the guest request (`Err(io)`), having submitted nothing and ended the
//! grant, only when the base refused it (busy): the engine path runs it then.

use crate::device::SpdkDevice;
pub use crate::device::Target;
use crate::engine_host::Host;
use crate::ffi::bdev_io::ChildDone;
use crate::types::{BdevIo, Qcow2Bdev};
use qcow2_engine::{Chain, Exec, Grant};
use std::marker::PhantomData;

/// A host of the direct path (a channel, the owner): where its requests' completions find
/// it, and what completing one means there.
pub trait DirectHost: Host {
    /// Calls `f` with the host of direct-path request `io` (the channel it arrived on, or
    /// its bdev's owner) and the request, on the host's thread.
    fn with_host<R>(io: BdevIo, f: impl FnOnce(&Self, BdevIo) -> R) -> R;
    /// A write this host ran is about to complete: no thread's prefetch ring may serve the
    /// bytes it replaced any more.
    fn written(&self, io: &BdevIo);
    /// Completes `io` (its child I/O ended with `success`).
    fn complete_direct(&self, io: BdevIo, success: bool);
}

/// What a direct request is, as a type: its completion is compiled once per kind, so that
/// reads pay nothing for what only writes do.
pub trait Kind {
    /// Whether the child I/O writes.
    const WRITE: bool;
    /// Whether the child read is decrypted before the request completes (a read granted on
    /// an encrypted image's crypt view).
    const DECRYPT: bool = false;
}

/// A direct read.
pub enum Read {}
/// A direct write.
pub enum Write {}

impl Kind for Read {
    const WRITE: bool = false;
}

impl Kind for Write {
    const WRITE: bool = true;
}

/// A direct read of an encrypted image: read from the base under its crypt view, decrypted
/// in place when it completes.
pub enum Decrypt {}

impl Kind for Decrypt {
    const WRITE: bool = false;
    const DECRYPT: bool = true;
}

/// Completion of host `H`'s direct request of kind `K`: leaves the grace period, moves the
/// write generations of a write's range ([`DirectHost::written`]), completes the request.
pub struct Done<H, K>(PhantomData<(H, K)>);

impl<H: DirectHost, K: Kind> ChildDone<Qcow2Bdev> for Done<H, K> {
    // Inline in SPDK's callback, the generation bump (writes only) included.
    #[inline(always)]
    fn child_done(io: BdevIo, success: bool) {
        H::with_host(io, |h, io| {
            let mut success = success;
            if K::DECRYPT && success {
                // On the request's core, in its own buffer, before it completes; the
                // grace period still holds the clusters the IVs came from. (A decrypting
                // request without its view was never submitted so: failed, not plaintext.)
                match io.ctx().crypt() {
                    Some((view, host)) => h.driver().exec().decrypt_view(view, host, &io.data()),
                    None => success = false,
                }
            }
            // (`leave`, written out: the completion's one function here.)
            if let Some(entry) = io.ctx().take_entry() {
                h.driver().exec().guest_exit(entry);
            }
            if K::WRITE {
                h.written(&io);
            }
            h.complete_direct(io, success);
        })
    }
}

/// Submits request `io` of kind `K`, granted the one extent `grant` of `chain`: to the base
/// through `target` ([`Done<H, K>`] completes it; a read on the crypt view over it,
/// [`Done<H, Decrypt>`], in [`crypt_or_exec`]), or, for another device (or without a
/// target), through the executor ([`through_exec`]). When the base refused it (busy) the
/// grant ends and the request comes back.
#[inline(always)]
pub fn submit<H: DirectHost, K: Kind>(
    host: &H,
    chain: &Chain<SpdkDevice>,
    target: &Option<Target>,
    io: BdevIo,
    grant: Grant,
) -> Result<(), BdevIo> {
    // (The indices compared: `DevId`'s derived `==` would be one more function per request.
    // The host's own `Option` matched, not an `Option<&Target>` made of it: no pointer to
    // build on every request.)
    match target {
        Some(t) if t.dev.0 == grant.dev().0 => to_base::<H, K>(host, t, io, grant),
        _ => crypt_or_exec::<H, K>(host, chain, target.as_ref(), io, grant),
    }
}

/// One child I/O of `t`'s base at the grant's host offset with the request's own iovecs,
/// completed by [`Done<H, K>`].
#[inline(always)]
fn to_base<H: DirectHost, K: Kind>(
    host: &H,
    t: &Target,
    mut io: BdevIo,
    grant: Grant,
) -> Result<(), BdevIo> {
    let h = grant.host().0;
    // The completion leaves the grace period with the entry kept in the request's context.
    io.ctx_mut().set_entry(grant.submitted());
    t.base
        .submit::<Qcow2Bdev, Done<H, K>>(io, K::WRITE, h)
        .map_err(|(io, _)| {
            // Refused: over before it began.
            leave(host.driver().exec(), &io);
            io
        })
}

/// A grant on a device other than the target's: a read on the crypt view over the target
/// goes to the base as a [`Decrypt`] request; anything else through the executor. Out of
/// line: plain images never come here.
#[inline(never)]
fn crypt_or_exec<H: DirectHost, K: Kind>(
    host: &H,
    chain: &Chain<SpdkDevice>,
    target: Option<&Target>,
    mut io: BdevIo,
    grant: Grant,
) -> Result<(), BdevIo> {
    let exec = host.driver().exec();
    let view = grant.dev();
    let t = match target {
        Some(t) if !K::WRITE && exec.unlocked_view_base(view).map(|d| d.0) == Some(t.dev.0) => t,
        _ => {
            through_exec(host, chain, io, grant);
            return Ok(());
        }
    };
    // The IVs come from the host offset: the completion decrypts with it.
    io.ctx_mut().set_crypt(view, grant.host().0);
    to_base::<H, Decrypt>(host, t, io, grant)
}

/// A grant the base does not serve itself (an encrypted image's crypt view): the executor
/// submits its one device operation with the request's buffers, and that operation's
/// completion — in SPDK's callback, decrypted in place for a read — completes the request
/// and leaves its grace period ([`Chain::submit_direct`]). Out of line: plain images never
/// come here.
#[inline(never)]
fn through_exec<H: Host>(host: &H, chain: &Chain<SpdkDevice>, io: BdevIo, grant: Grant) {
    host.driver()
        .submit_grant(io, |tag, buf| chain.submit_direct(tag, grant, buf));
}

/// Leaves the grace period a completed direct-path request `io` held.
#[inline(always)]
fn leave(exec: &Exec<SpdkDevice>, io: &BdevIo) {
    if let Some(entry) = io.ctx().take_entry() {
        exec.guest_exit(entry);
    }
}
