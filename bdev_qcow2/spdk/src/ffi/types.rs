//! What a bdev module built on these wrappers keeps for SPDK, named once: [`BdevTypes`],
//! implemented by the module for a marker type that every generic wrapper here takes
//! (`BdevIo<M>`, `Registered<M>`, ...). So the wrappers name none of the module's own
//! modules, and what SPDK hands back (a bdev's `ctxt`, a channel's context, a bdev_io's
//! driver area) comes back as the module's type, with no cast outside `ffi`.
//!
//! Also here: a writable node's metadata owner as the node holds it ([`OwnerPtr`]) and as
//! its md thread closes it ([`OwnerBox`]).

use super::thread::{self, Homed, Polled, Thread};
use std::ffi::CStr;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicPtr, Ordering};

/// The types of a bdev module, as SPDK's callbacks reach them. Implemented once, for the
/// module's marker type.
pub trait BdevTypes: Sized + 'static {
    /// The per-I/O context each of the module's bdev_ios carries in its driver area.
    type Ctx;
    /// The context a request starts with (`submit_request` writes it; a function, so that
    /// it is built in place: see `IoCtx::new`).
    fn new_ctx() -> Self::Ctx;
    /// A bdev of the module (its `ctxt`, and its io_device).
    type Node: 'static;
    /// The state of one of its channels (one per SPDK thread that opened the bdev).
    type Channel: Polled;
    /// A writable bdev's metadata owner, on the bdev's md thread.
    type Owner: Polled;
    /// What an owner reports when it closed.
    type OwnerCounters;

    /// The node's metadata owner (null: a read-only node).
    fn owner(node: &Self::Node) -> &OwnerPtr<Self>;
    /// The thread that created the node (its metadata owner's).
    fn md_thread(node: &Self::Node) -> Option<Thread>;
    /// The owner is about to be used: its poller resumes if it paused.
    fn wake(owner: &Self::Owner);
    /// Flushes and frees the owner, then calls `then` with its counters, on its md thread;
    /// only [`OwnerBox::close`] calls it (it alone makes the [`Closing`] token).
    fn close(owner: &Self::Owner, token: Closing, then: impl FnOnce(Self::OwnerCounters) + 'static);
    /// Name of the pollers of the module's channels.
    const CHANNEL_POLLER: &'static CStr;
}

/// Permission to close an owner ([`BdevTypes::close`]): made only by [`OwnerBox::close`],
/// which consumes the owner's one box on its md thread, so an owner is closed once and no
/// node still points at it.
pub struct Closing(());

/// Permission to put another image (and owner) under a node and take its owner back into
/// its box ([`OwnerPtr::replace`]): made only by
/// [`Registered::switch_image`](super::node::Registered::switch_image), on the md thread of
/// a writable node with no request in flight.
pub struct Switching(pub(super) ());

/// A node's metadata owner, as the node keeps it (null: a read-only node). Made only from
/// an [`OwnerBox`] and turned back into one only by `ffi` at teardown or with a
/// [`Switching`] token, so an owner is boxed or in one node, never both. Neither `Clone` nor
/// `Copy`. Atomic so that a switch can put another owner in through a shared node (channel
/// creation on other threads reads it, under the node's lock); its loads are plain loads.
pub struct OwnerPtr<M: BdevTypes>(AtomicPtr<M::Owner>);

impl<M: BdevTypes> OwnerPtr<M> {
    /// No owner (a read-only node).
    pub const fn null() -> OwnerPtr<M> {
        OwnerPtr(AtomicPtr::new(std::ptr::null_mut()))
    }

    /// Whether there is none (a read-only node).
    pub fn is_null(&self) -> bool {
        self.raw().is_null()
    }

    /// The raw owner, for `ffi`'s accesses on the md thread.
    #[inline(always)]
    pub(super) fn raw(&self) -> *mut M::Owner {
        // Relaxed: the md thread wrote it (or a switch did, there), and other threads read
        // it only under the node's lock, which orders them after the switch.
        self.0.load(Ordering::Relaxed)
    }

    /// Takes the owner out (on the md thread of a node with no channel left).
    pub(super) fn take(&self) -> *mut M::Owner {
        self.0.swap(std::ptr::null_mut(), Ordering::Relaxed)
    }

    /// Puts `new` in place of the node's owner (an image switch, see [`Switching`]) and
    /// returns the former one in its box (`None`: there was none).
    pub fn replace(&self, new: OwnerBox<M>, _: &Switching) -> Option<OwnerBox<M>> {
        let old = self.0.swap(new.0.as_ptr(), Ordering::Relaxed);
        // SAFETY: made from an `OwnerBox` started on the md thread, which the token proves
        // this is; taken out of the node here, so boxed once.
        unsafe { OwnerBox::from_raw(old) }
    }

    /// A handle to the owner on its md thread `md` (`None`: a read-only node, or no md
    /// thread).
    pub fn homed(&self, md: Option<Thread>) -> Option<Homed<M::Owner>> {
        let md = md?;
        // SAFETY: a writable node's owner is set before registration, changed only by a
        // switch while no request is in flight (a former owner lives until the channel
        // states built with it are gone), and freed by teardown only after the node's last
        // channel — the holders of this handle — is gone; it lives on the md thread.
        NonNull::new(self.raw()).map(|o| unsafe { Homed::new(o.as_ref(), md) })
    }
}

/// A writable bdev's metadata owner, as [`OwnerBox::start`] started it on this thread (its
/// md thread): closed once, there, by [`OwnerBox::close`], unless a node takes it
/// ([`OwnerBox::into_node`]) and gives it back at teardown.
pub struct OwnerBox<M: BdevTypes>(NonNull<M::Owner>, PhantomData<*const ()>);

impl<M: BdevTypes> OwnerBox<M> {
    /// Starts the poller of `owner` on the calling thread (its md thread), named `name`.
    /// `None` if SPDK refused a poller (the owner is dropped).
    pub fn start(owner: Box<M::Owner>, name: &CStr) -> Option<OwnerBox<M>> {
        let p = thread::start(owner, name).ok()?;
        // SAFETY: just started on this thread.
        unsafe { OwnerBox::from_raw(p.cast_mut()) }
    }

    /// # Safety
    /// `raw` is null or an owner started by [`OwnerBox::start`] on the calling thread, not
    /// closed, and given to no other `OwnerBox`.
    pub(super) unsafe fn from_raw(raw: *mut M::Owner) -> Option<OwnerBox<M>> {
        NonNull::new(raw).map(|o| OwnerBox(o, PhantomData))
    }

    /// Flushes the metadata, frees the owner and then calls `then` with its final counters,
    /// on this thread (see [`BdevTypes::close`]). Every request through it must have
    /// completed.
    pub fn close(self, then: impl FnOnce(M::OwnerCounters) + 'static) {
        // SAFETY: started on this thread (the box is not `Send`) and not freed before its
        // close; the poller frees it only after this call returned.
        let o = unsafe { self.0.as_ref() };
        M::close(o, Closing(()), then);
    }

    /// What a node keeps (its owner) until teardown takes it back.
    pub fn into_node(self) -> OwnerPtr<M> {
        OwnerPtr(AtomicPtr::new(self.0.as_ptr()))
    }
}
