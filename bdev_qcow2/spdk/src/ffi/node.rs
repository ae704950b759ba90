//! A node's life as SPDK sees it: leaked at registration (its address is the io_device and
//! the bdev's `ctxt`), handed back to teardown on its md thread, freed there. The raw node
//! pointer stays in this file; `crate::node` drives the steps, in their order, through the
//! handles here:
//!
//! - [`register`] gives a [`Registered`] handle, which the registry keeps;
//! - SPDK's destruct takes it out of the registry and consumes it
//!   ([`Registered::unregister_device`]);
//! - once the last channel is gone, an [`Unregistered`] handle reaches
//!   `crate::node::channels_gone` (any thread), which moves to the md thread
//!   ([`Unregistered::on_md_thread`]), where an [`MdNode`] closes the owner, then the
//!   descriptors, and ends destruct ([`MdNode::destruct_done`]).
//!
//! The metadata owner a writable node holds goes the same way: an [`OwnerBox`] from
//! [`OwnerBox::start`] until the node takes it, and back out of the node once its channels
//! are gone, to be closed once on the md thread.

use super::bdev::{self, Desc, Props};
use super::io_channel::{self, ChannelIter};
use super::sys;
use super::thread::{Homed, Thread};
use crate::device::SpdkDevice;
use crate::node::{ImageInfo, Node};
use crate::owner::{Owner, OwnerCounters};
use crate::params::CreateParams;
use qcow2_engine::{Chain, CoreSeed, DevId, Exec};
use std::ffi::{c_int, c_void};
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

/// Names a node (by address) for look-ups in the registry, without giving access to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeKey(usize);

impl NodeKey {
    /// The key of the node at `ctxt` (a bdev's `ctxt`, an io_device).
    pub(super) fn of(ctxt: *const c_void) -> NodeKey {
        NodeKey(ctxt as usize)
    }
}

/// A registered node: the one handle to it from [`register`] until teardown consumes it
/// ([`Registered::unregister_device`]). Neither `Clone` nor `Copy`, so while it exists the
/// node is live; the registry keeps it.
pub struct Registered(NonNull<Node>);

// SAFETY: a registered node is shared by every SPDK thread (its channels read it); what
// changes (SPDK's `bdev`, the descriptors and owner at teardown) is not reached through
// this handle except the owner, and only on the md thread (`owner_here`).
unsafe impl Send for Registered {}

impl Registered {
    /// The key that finds this node again.
    pub fn key(&self) -> NodeKey {
        NodeKey::of(self.0.as_ptr().cast())
    }

    /// The node.
    pub fn node(&self) -> &Node {
        // SAFETY: a node is freed only by teardown, which begins by consuming this handle.
        unsafe { self.0.as_ref() }
    }

    /// A writable node's metadata owner, if the caller runs on the md thread (the only one
    /// that may use it); `None` otherwise, or for a read-only node.
    pub fn owner_here(&self) -> Option<&Owner> {
        let n = self.node();
        if n.owner.is_null() || !n.md_thread.is_some_and(Thread::is_current) {
            return None;
        }
        // SAFETY: the owner is set before registration and freed by teardown after this
        // handle is consumed, on the md thread — the calling thread, so not meanwhile. The
        // reference is not `Send` (the owner is not `Sync`): it stays on this thread.
        let o = unsafe { &*n.owner };
        o.wake();
        Some(o)
    }

    /// Tells SPDK the bdev now has `blocks` blocks (`spdk_bdev_notify_blockcnt_change`):
    /// descriptors hear of it. SPDK refuses to shrink a bdev someone has open (`EBUSY`);
    /// `Err` carries its errno.
    pub fn notify_blockcnt_change(&self, blocks: u64) -> Result<(), i32> {
        // SAFETY: the node (and the bdev in it) is live while this handle exists; SPDK
        // changes the block count under its own lock.
        let rc = unsafe {
            sys::spdk_bdev_notify_blockcnt_change(
                std::ptr::addr_of_mut!((*self.0.as_ptr()).bdev),
                blocks,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(-rc)
        }
    }

    /// Puts `new` under the node in place of its image (an external snapshot: the bdev
    /// goes on under the same name over another image): descriptors, owner, replica seed,
    /// parameters, header information, and the count of channel states built from them.
    /// Returns the former ones, or `new` back when the caller is not on the md thread of a
    /// writable node. The caller quiesced the bdev (no request in flight) and then moves
    /// every channel onto a state built from the new image ([`ChannelIter::renew_state`]);
    /// the former owner is closed once the former states are gone.
    pub fn switch_image(&self, new: Box<Image>) -> Result<Box<Image>, Box<Image>> {
        let p = self.0.as_ptr();
        if self.owner_here().is_none() || new.owner.is_none() {
            return Err(new);
        }
        // SAFETY: the node is live while this handle exists. Its fields are read by channel
        // creation on any thread, which holds `switching` (not written here), and by this
        // (md) thread; the owner only on the md thread. No request is in flight (quiesced).
        unsafe {
            let _g = (*p).switching.lock().unwrap_or_else(|e| e.into_inner());
            let owner = new.owner.map_or(std::ptr::null_mut(), OwnerBox::into_node);
            let old_owner = std::mem::replace(&mut (*p).owner, owner);
            // The new image names its backing (the old one): nothing was dropped from it.
            (*p).backing_dropped
                .store(false, std::sync::atomic::Ordering::Release);
            Ok(Box::new(Image {
                base: std::mem::replace(&mut (*p).base, new.base),
                backing: std::mem::replace(&mut (*p).backing, new.backing),
                // Started on this thread (the md thread) and given to no other box.
                owner: OwnerBox::from_raw(old_owner),
                seed: std::mem::replace(&mut (*p).seed, new.seed),
                params: std::mem::replace(&mut (*p).params, new.params),
                info: std::mem::replace(&mut (*p).info, new.info),
                live_channels: std::mem::replace(&mut (*p).live_channels, new.live_channels),
            }))
        }
    }

    /// Quiesces the bdev (`spdk_bdev_quiesce`): once every request in flight has completed,
    /// with new ones held back by SPDK, `done(0)` runs on this thread; `done(-errno)` when
    /// SPDK refuses. [`unquiesce`](Self::unquiesce) lets the held requests go.
    pub fn quiesce(&self, done: impl FnOnce(c_int) + 'static) {
        self.quiesce_call(true, Box::new(done));
    }

    /// Ends a [`quiesce`](Self::quiesce); `done` gets SPDK's status.
    pub fn unquiesce(&self, done: impl FnOnce(c_int) + 'static) {
        self.quiesce_call(false, Box::new(done));
    }

    fn quiesce_call(&self, quiesce: bool, done: Box<dyn FnOnce(c_int)>) {
        let ctx = Box::into_raw(Box::new(done)).cast::<c_void>();
        let bdev = std::ptr::addr_of_mut!(
            // SAFETY: the node is live while this handle exists.
            unsafe { &mut *self.0.as_ptr() }.bdev
        );
        let module = super::module::module_ptr();
        // SAFETY: a registered bdev of our module; `ctx` is reclaimed exactly once, by
        // `quiesce_done` (SPDK calls it once) or below when SPDK refuses at once.
        let rc = unsafe {
            if quiesce {
                sys::spdk_bdev_quiesce(bdev, module, Some(quiesce_done), ctx)
            } else {
                sys::spdk_bdev_unquiesce(bdev, module, Some(quiesce_done), ctx)
            }
        };
        if rc != 0 {
            // SAFETY: SPDK refused, so it will not call back: the box is still ours.
            let done = unsafe { Box::from_raw(ctx.cast::<Box<dyn FnOnce(c_int)>>()) };
            done(rc);
        }
    }

    /// Visits every channel of the node on its own thread with `each`, then calls `done` on
    /// the calling thread (each step continues the iteration once, as `ChannelIter` says).
    pub fn for_each_channel<C: 'static>(
        &self,
        ctx: C,
        each: fn(ChannelIter, &mut C),
        done: fn(C, c_int),
    ) {
        // SAFETY: a registered node is a registered io_device (this handle exists); SPDK
        // refuses to unregister an io_device while an iteration over it is outstanding, so
        // it stays registered until `done`.
        unsafe { io_channel::for_each_channel(self.0.as_ptr().cast(), ctx, each, done) }
    }

    /// Teardown, step 1 (SPDK's destruct took the node out of the registry): unregisters
    /// the io_device. `crate::node::channels_gone` gets the node once its last channel is
    /// destroyed.
    pub fn unregister_device(self) {
        // SAFETY: a registered io_device; the node stays allocated until `MdNode` frees it,
        // after `device_gone`.
        unsafe { io_channel::unregister_device(self.0.as_ptr().cast(), device_gone) }
    }
}

/// The image under a node, as [`Registered::switch_image`] swaps it.
pub struct Image {
    /// The base descriptor (holding the image).
    pub base: Option<Desc>,
    /// The backing descriptor.
    pub backing: Option<Desc>,
    /// The image's metadata owner.
    pub owner: Option<OwnerBox>,
    /// What other threads' replicas are built from.
    pub seed: Option<CoreSeed>,
    /// The create call `save_config` writes.
    pub params: CreateParams,
    /// What the header said.
    pub info: ImageInfo,
    /// Channel states built from this image that are not freed yet.
    pub live_channels: Arc<AtomicUsize>,
}

/// SPDK finished a quiesce or unquiesce: hands the status to the boxed callback.
unsafe extern "C" fn quiesce_done(ctx: *mut c_void, status: c_int) {
    // SAFETY: `ctx` is the box `quiesce_call` leaked, reclaimed here once.
    let done = unsafe { Box::from_raw(ctx.cast::<Box<dyn FnOnce(c_int)>>()) };
    done(status);
}

/// Leaks `node` and registers it: as an io_device (each channel gets a
/// [`Channel`](crate::channel::Channel) state), then its bdev (`props`, the node as `ctxt`).
/// Then `split` gets the request size SPDK chose (`max_rw_size`, 0: no limit) and may
/// return a smaller one, at which requests are then split (also the optimal I/O boundary).
///
/// On failure (SPDK's errno), the io_device is unregistered again and the node comes back
/// to `crate::node::never_registered` on this thread once that is done.
pub fn register(
    node: Box<Node>,
    props: &Props,
    split: impl FnOnce(u32) -> Option<u32>,
) -> Result<Registered, i32> {
    let node = NonNull::from(Box::leak(node));
    let p = node.as_ptr();
    // SAFETY: `node` is live (leaked above) until `device_gone` or `free_unregistered`
    // reclaims it; SPDK copies the name.
    unsafe { io_channel::register_device(p, (*p).c_name()) };
    // SAFETY: as just said; the bdev's name lives in the node.
    if let Err(e) = unsafe { bdev::register(p, props) } {
        // SAFETY: registered just above; `free_unregistered` reclaims the node (no bdev to
        // finish).
        unsafe { io_channel::unregister_device(p.cast(), free_unregistered) };
        return Err(e);
    }
    // SAFETY: registered just above on this thread; no request reaches the bdev before we
    // return to the reactor, and SPDK does not write these fields after registration.
    let b = unsafe { &mut (*p).bdev };
    if let Some(cut) = split(b.max_rw_size) {
        b.max_rw_size = cut;
        b.optimal_io_boundary = cut;
        bdev::set_split_on_optimal_io_boundary(b);
    }
    Ok(Registered(node))
}

/// The io_device of a node whose bdev failed to register is gone (on the thread that
/// registered it, the md thread).
unsafe extern "C" fn free_unregistered(io_device: *mut c_void) {
    // SAFETY: the node never reached SPDK's bdev list and its io_device is gone: only ours,
    // reclaimed once.
    let mut n = unsafe { Box::from_raw(io_device.cast::<Node>()) };
    let owner = std::mem::replace(&mut n.owner, std::ptr::null_mut());
    // SAFETY: started on this thread (the md thread registered the node) and never used:
    // the bdev never registered.
    let owner = unsafe { OwnerBox::from_raw(owner) };
    crate::node::never_registered(n, owner);
}

/// Teardown, between steps 1 and 2: the last channel is gone.
unsafe extern "C" fn device_gone(io_device: *mut c_void) {
    // SAFETY: our io_devices are nodes, live until `MdNode::destruct_done`.
    let node = unsafe { NonNull::new_unchecked(io_device.cast::<Node>()) };
    crate::node::channels_gone(Unregistered(node));
}

/// A node whose io_device is unregistered and whose channels are gone, on its way to the
/// md thread.
pub struct Unregistered(NonNull<Node>);

// SAFETY: nothing touches the node through this handle; it only carries it to the md
// thread, where `MdNode` takes over.
unsafe impl Send for Unregistered {}

impl Unregistered {
    /// Runs `f` with the node on its md thread: now if that is the calling thread, else as
    /// a message. `Err`: SPDK's errno when the message could not be queued (the node is
    /// then left allocated).
    pub fn on_md_thread(self, f: fn(MdNode)) -> Result<(), i32> {
        self.md_thread()?.exec(move || f(self.arrived()))
    }

    /// Queues `f` with the node as a message to its md thread (also when on it already).
    fn send_to_md_thread(self, f: fn(MdNode)) -> Result<(), i32> {
        self.md_thread()?.send(move || f(self.arrived()))
    }

    /// On the md thread: the handle that may touch the node there.
    fn arrived(self) -> MdNode {
        MdNode(self.0, PhantomData)
    }

    /// The node's md thread (`ESRCH` if it has none: not created on an SPDK thread).
    fn md_thread(&self) -> Result<Thread, i32> {
        // SAFETY: no channel is left, and nothing writes the node's fields but teardown on
        // the md thread, which this handle is on its way to.
        unsafe { self.0.as_ref() }.md_thread.ok_or(libc::ESRCH)
    }
}

/// A node in teardown, on its md thread: unregistered, no channel left, out of the
/// registry. Not `Send`: only this thread touches the node now.
pub struct MdNode(NonNull<Node>, PhantomData<*const ()>);

impl MdNode {
    /// The node.
    pub fn node(&self) -> &Node {
        // SAFETY: live until `destruct_done`, which consumes this handle.
        unsafe { self.0.as_ref() }
    }

    /// Looks again shortly: queues `f` with the node as a message to this (the md) thread.
    /// `Err`: SPDK's errno when the message could not be queued (the node is then left
    /// allocated).
    pub fn again(self, f: fn(MdNode)) -> Result<(), i32> {
        Unregistered(self.0).send_to_md_thread(f)
    }

    /// Teardown, step 2: a writable node's owner flushes the metadata and is freed, then
    /// `then` gets the node and the owner's final counters, on this thread; a read-only
    /// node goes to `then` at once (`None`).
    pub fn close_owner(self, then: impl FnOnce(MdNode, Option<OwnerCounters>) + 'static) {
        // SAFETY: on the md thread with no channel left: only this thread uses the node's
        // owner, and it is taken once (nulled).
        let raw = std::mem::replace(
            unsafe { &mut (*self.0.as_ptr()).owner },
            std::ptr::null_mut(),
        );
        // SAFETY: the owner was started on this thread and every request through it has
        // completed (no channel is left).
        match unsafe { OwnerBox::from_raw(raw) } {
            Some(owner) => owner.close(move |counters| then(self, Some(counters))),
            None => then(self, None),
        }
    }

    /// Takes the node's backing descriptor (to be closed here, where it was opened).
    pub fn take_backing(&mut self) -> Option<Desc> {
        // SAFETY: only this thread uses the node now (see the type).
        unsafe { &mut (*self.0.as_ptr()).backing }.take()
    }

    /// Takes the node's base descriptor (to be closed here, where it was opened).
    pub fn take_base(&mut self) -> Option<Desc> {
        // SAFETY: as in `take_backing`.
        unsafe { &mut (*self.0.as_ptr()).base }.take()
    }

    /// Teardown, step 3: tells SPDK the bdev's destruct is done and hands the node back, to
    /// be dropped.
    pub fn destruct_done(self) -> Box<Node> {
        // SAFETY: our bdev, being destructed (SPDK called destruct, then the io_device went).
        unsafe { sys::spdk_bdev_destruct_done(std::ptr::addr_of_mut!((*self.0.as_ptr()).bdev), 0) };
        // SAFETY: unregistered, no channel or owner left, SPDK is done with the bdev: the
        // node is only ours; reclaimed once (this handle is consumed).
        unsafe { Box::from_raw(self.0.as_ptr()) }
    }
}

impl Homed<Owner> {
    /// A handle to the metadata owner of `node`, on its md thread (`None`: a read-only node).
    pub fn owner(node: &Node) -> Option<Homed<Owner>> {
        let md = node.md_thread?;
        // SAFETY: a writable node's owner is set before registration, immutable after it,
        // and freed by teardown only after the node's last channel — the holders of this
        // handle — is gone; it lives on the md thread.
        NonNull::new(node.owner).map(|o| unsafe { Homed::new(o.as_ref(), md) })
    }
}

/// Permission to close an owner ([`Owner::close`]): made only by [`OwnerBox::close`],
/// which consumes the owner's one box on its md thread, so an owner is closed once and no
/// node still points at it.
pub struct Closing(());

/// A writable bdev's metadata owner, as [`OwnerBox::start`] started it on this thread (its
/// md thread): closed once, there, by [`OwnerBox::close`], unless a node takes it
/// ([`OwnerBox::into_node`]) and gives it back at teardown.
pub struct OwnerBox(NonNull<Owner>, PhantomData<*const ()>);

impl OwnerBox {
    /// Starts the owner of `chain` on the calling thread (see [`Owner::start`]). `None` if
    /// SPDK refused a poller.
    pub fn start(
        exec: Exec<SpdkDevice>,
        chain: Rc<Chain<SpdkDevice>>,
        devs: impl IntoIterator<Item = DevId>,
    ) -> Option<OwnerBox> {
        // SAFETY: just started on this thread.
        unsafe { OwnerBox::from_raw(Owner::start(exec, chain, devs)?) }
    }

    /// # Safety
    /// `raw` is null or an owner from [`Owner::start`] on the calling thread, not closed,
    /// and given to no other `OwnerBox`.
    unsafe fn from_raw(raw: *mut Owner) -> Option<OwnerBox> {
        NonNull::new(raw).map(|o| OwnerBox(o, PhantomData))
    }

    /// Flushes the metadata, frees the owner and then calls `then` with its final counters,
    /// on this thread (see [`Owner::close`]). Every request through it must have completed.
    pub fn close(self, then: impl FnOnce(OwnerCounters) + 'static) {
        // SAFETY: from `Owner::start` on this thread (the box is not `Send`) and not freed
        // before its close; the poller frees it only after this call returned.
        let o = unsafe { self.0.as_ref() };
        o.close(Closing(()), then);
    }

    /// The pointer a node keeps (its `owner`) until teardown takes it back
    /// ([`MdNode::close_owner`]).
    pub fn into_node(self) -> *mut Owner {
        self.0.as_ptr()
    }
}
