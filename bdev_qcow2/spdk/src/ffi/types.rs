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

/// The types of a bdev module, as SPDK's callbacks reach them. Implemented once, for the
/// module's marker type.
pub trait BdevTypes: Sized + 'static {
    /// The per-I/O context each of the module's bdev_ios carries in its driver area.
    type Ctx;
    /// The context a request starts with (`submit_request` writes it).
    const NEW_CTX: Self::Ctx;
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
    /// The same, to take it out at teardown or put another in.
    fn owner_mut(node: &mut Self::Node) -> &mut OwnerPtr<Self>;
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

/// Permission to take a node's owner back into its box while another goes in: made only by
/// [`Registered::switch_image`](super::node::Registered::switch_image), on the md thread of
/// a writable node with no request in flight.
pub struct Switching(pub(super) ());

/// A node's metadata owner, as the node keeps it (null: a read-only node). Made only from
/// an [`OwnerBox`] and turned back into one only by `ffi` or with a [`Switching`] token, so
/// an owner is boxed or in one node, never both. Neither `Clone` nor `Copy`.
pub struct OwnerPtr<M: BdevTypes>(*mut M::Owner);

impl<M: BdevTypes> OwnerPtr<M> {
    /// No owner (a read-only node).
    pub const fn null() -> OwnerPtr<M> {
        OwnerPtr(std::ptr::null_mut())
    }

    /// Whether there is none (a read-only node).
    pub fn is_null(&self) -> bool {
        self.0.is_null()
    }

    /// The raw owner, for `ffi`'s accesses on the md thread.
    pub(super) fn raw(&self) -> *mut M::Owner {
        self.0
    }

    /// Takes the owner out (on the md thread of a node with no channel left).
    pub(super) fn take(&mut self) -> *mut M::Owner {
        std::mem::replace(&mut self.0, std::ptr::null_mut())
    }

    /// Turns a node's former owner back into its box while an image switch puts another
    /// one in (see [`Switching`]).
    pub fn into_box(mut self, _: &Switching) -> Option<OwnerBox<M>> {
        // SAFETY: made from an `OwnerBox` started on the md thread, which the token proves
        // this is; the pointer is consumed, so it is boxed once.
        unsafe { OwnerBox::from_raw(self.take()) }
    }

    /// A handle to the owner on its md thread `md` (`None`: a read-only node, or no md
    /// thread).
    pub fn homed(&self, md: Option<Thread>) -> Option<Homed<M::Owner>> {
        let md = md?;
        // SAFETY: a writable node's owner is set before registration, immutable while it has
        // channels, and freed by teardown only after the node's last channel — the holders
        // of this handle — is gone; it lives on the md thread.
        NonNull::new(self.0).map(|o| unsafe { Homed::new(o.as_ref(), md) })
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
        OwnerPtr(self.0.as_ptr())
    }
}
