//! Where a base device delivers its completions from SPDK's callback: the host that drives
//! its executor (a channel, the metadata owner), reached through a registration ffi arms
//! only while the host sits at the address ffi owns it at.
//!
//! A host keeps one [`Sinks`]; its devices keep a [`SinkRef`] to it. ffi arms the
//! registration with the host's address when [`thread::start`](super::thread::start)
//! takes the boxed host for its poller, and disarms it before it frees the host
//! ([`thread::stop`](super::thread::stop)) or when the `Sinks` is dropped: a device never
//! reaches a host that moved or is gone, and one that completes while no host is armed
//! queues the completion for its poll.

use qcow2_engine::io::DeviceError;
use std::cell::Cell;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::rc::Rc;

/// Whoever drives the executor that owns a device — a channel or the metadata owner — as
/// the device's callback sees it: it takes each completion first.
pub trait SinkHost: Sized {
    /// Takes the completion `(tag, r)` in SPDK's callback, on the device's thread; `false`
    /// declines it (it is queued for the poller).
    fn offer(&self, tag: u64, r: Result<(), DeviceError>) -> bool;
}

/// Calls the armed host's [`SinkHost::offer`].
type OfferFn = unsafe fn(NonNull<c_void>, u64, Result<(), DeviceError>) -> bool;

/// The armed host (null: none) and how to offer it a completion.
struct Gate {
    host: Cell<*const c_void>,
    offer: OfferFn,
}

/// Host `H`'s registration for its devices' completions: armed by ffi while `H` is the
/// poller state it owns (see the module's doc).
pub struct Sinks<H> {
    gate: Rc<Gate>,
    host: PhantomData<*const H>,
}

impl<H: SinkHost> Sinks<H> {
    /// A registration of a host of type `H`, not armed yet.
    pub fn new() -> Sinks<H> {
        Sinks {
            gate: Rc::new(Gate {
                host: Cell::new(std::ptr::null()),
                offer: offer::<H>,
            }),
            host: PhantomData,
        }
    }
}

impl<H: SinkHost> Default for Sinks<H> {
    fn default() -> Self {
        Sinks::new()
    }
}

impl<H> Sinks<H> {
    /// What a device keeps to deliver to this registration's host.
    pub fn reference(&self) -> SinkRef {
        SinkRef(self.gate.clone())
    }

    /// What a request leaving the host's thread keeps to find the host again
    /// ([`HomeRef::homed`](super::thread::Homed)).
    pub fn home(&self) -> HomeRef<H> {
        HomeRef {
            gate: self.gate.clone(),
            host: PhantomData,
        }
    }

    /// Arms the registration with `host`, which ffi owns at that address until it
    /// [`disarm`](Self::disarm)s it.
    pub(super) fn arm(&self, host: NonNull<H>) {
        self.gate.host.set(host.as_ptr().cast_const().cast());
    }

    /// No host from now on: completions queue for the devices' polls.
    pub(super) fn disarm(&self) {
        self.gate.host.set(std::ptr::null());
    }
}

impl<H> Drop for Sinks<H> {
    fn drop(&mut self) {
        // Devices may outlive their registration (a pool leaked with operations in flight).
        self.disarm();
    }
}

/// A reference to host `H`'s registration, on the host's thread (it is neither `Send`
/// nor `Sync`): [`homed`](Self::homed) gives the armed host a handle for other threads.
pub struct HomeRef<H> {
    gate: Rc<Gate>,
    host: PhantomData<*const H>,
}

impl<H> HomeRef<H> {
    /// The host armed now (`None`: not started yet, or finished).
    pub(super) fn armed(&self) -> Option<NonNull<H>> {
        // Armed only with an `H` (`Sinks::<H>::arm`: the gate is `H`'s).
        NonNull::new(self.gate.host.get().cast_mut()).map(NonNull::cast)
    }
}

/// A device's reference to its host's registration ([`Sinks::reference`]).
#[derive(Clone)]
pub struct SinkRef(Rc<Gate>);

impl SinkRef {
    /// The armed host, if any, to offer one completion to at once ([`Armed::offer`]).
    #[inline(always)]
    pub(super) fn armed(&self) -> Option<Armed> {
        let g = &*self.0;
        NonNull::new(g.host.get().cast_mut()).map(|host| Armed {
            host,
            offer: g.offer,
        })
    }
}

/// A host armed in a [`SinkRef`] when its device's callback looked (copied out, so the
/// callback holds no reference into the device while the host runs). Used at once, in
/// that callback: ffi frees a host only from its own poller or SPDK's channel teardown,
/// never while a completion callback runs.
#[derive(Clone, Copy)]
pub(super) struct Armed {
    host: NonNull<c_void>,
    offer: OfferFn,
}

impl Armed {
    /// Offers the completion `(tag, r)` to the host, on the device's thread, outside any
    /// method of the device. `false`: it declined.
    #[inline(always)]
    pub(super) fn offer(self, tag: u64, r: Result<(), DeviceError>) -> bool {
        // SAFETY: armed only with the address of the live `H` whose `offer::<H>` the gate
        // holds (`Sinks::<H>::new`, `arm`), disarmed before that host is freed, and read
        // just now in the same callback (see the type's doc).
        unsafe { (self.offer)(self.host, tag, r) }
    }
}

/// [`OfferFn`] of `H`.
///
/// # Safety
/// `host` is a live `H`, used on its thread.
#[inline(always)]
unsafe fn offer<H: SinkHost>(host: NonNull<c_void>, tag: u64, r: Result<(), DeviceError>) -> bool {
    // SAFETY: per the contract.
    H::offer(unsafe { host.cast::<H>().as_ref() }, tag, r)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host that counts what it was offered.
    struct Counting(Cell<u32>);

    impl SinkHost for Counting {
        fn offer(&self, _: u64, _: Result<(), DeviceError>) -> bool {
            self.0.set(self.0.get() + 1);
            true
        }
    }

    #[test]
    fn a_device_reaches_its_host_only_while_armed() {
        let host = Box::new(Counting(Cell::new(0)));
        let sinks = Sinks::<Counting>::new();
        let dev = sinks.reference();
        assert!(
            dev.armed().is_none(),
            "not armed before ffi starts the host"
        );
        sinks.arm(NonNull::from(&*host));
        assert!(dev.armed().is_some_and(|a| a.offer(1, Ok(()))));
        assert_eq!(host.0.get(), 1);
        assert!(sinks.home().armed().is_some());
        sinks.disarm();
        assert!(dev.armed().is_none() && sinks.home().armed().is_none());
        sinks.arm(NonNull::from(&*host));
        drop(sinks);
        assert!(
            dev.armed().is_none(),
            "a dropped registration reaches no host"
        );
        assert_eq!(host.0.get(), 1);
    }
}
