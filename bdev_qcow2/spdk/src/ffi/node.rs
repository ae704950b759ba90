//! A node's life as SPDK sees it: leaked at registration (its address is the io_device and
//! the bdev's `ctxt`), handed back to teardown on its md thread, freed there. The raw node
//! pointer stays in this file; the module drives the steps, in their order, through the
//! handles here and the hooks of [`Nodes`]:
//!
//! - [`register`] gives a [`Registered`] handle, which the module's registry keeps;
//! - SPDK's destruct ([`Nodes::destruct`]) takes it out of the registry and consumes it
//!   ([`Registered::unregister_device`]);
//! - once the last channel is gone, an [`Unregistered`] handle reaches
//!   [`Nodes::channels_gone`] (any thread), which moves to the md thread
//!   ([`Unregistered::on_md_thread`]), where an [`MdNode`] closes the owner, then the
//!   descriptors, and ends destruct ([`MdNode::destruct_done`]).
//!
//! The metadata owner a writable node holds goes the same way: an
//! [`OwnerBox`](super::types::OwnerBox) until the node takes it, and back out of the node
//! once its channels are gone, to be closed once on the md thread.

use super::bdev::{self, Props};
use super::bdev_io::{self, Requests};
use super::io_channel::{self, ChannelIter};
use super::sys;
use super::thread::Thread;
use super::types::{BdevTypes, OwnerBox, Switching};
use std::ffi::{c_int, c_void, CString};
use std::marker::PhantomData;
use std::ptr::NonNull;

/// What SPDK's calls on module `M`'s bdevs do, and what an image switch changes.
pub trait Nodes: Requests {
    /// What [`Registered::switch_image`] puts under a node in place of its image.
    type Image;
    /// SPDK's `destruct` of the bdev of node `key` (unregistered and unused): teardown
    /// begins ([`Registered::unregister_device`]).
    fn destruct(key: NodeKey);
    /// Teardown: the node's last channel is gone (any thread).
    fn channels_gone(node: Unregistered<Self>);
    /// A node whose bdev failed to register, back once its io_device is gone (on the md
    /// thread), with its owner.
    fn never_registered(node: Self::Node, owner: Option<OwnerBox<Self>>);
    /// SPDK's `io_type_supported`.
    fn io_type_supported(node: &Self::Node, ty: sys::spdk_bdev_io_type) -> bool;
    /// What `dump_info_json` writes (under `"qcow2"`), with the node's metadata owner when
    /// SPDK asks on its md thread (the image as it is now: `None` on other threads and for
    /// read-only nodes).
    fn info_json(node: &Self::Node, owner: Option<&Self::Owner>) -> serde_json::Value;
    /// The calls `write_config_json` writes.
    fn config_json(node: &Self::Node) -> Vec<serde_json::Value>;
    /// Puts `new` under `node` in place of its image and returns the former one (`Err`:
    /// `new` back, refused); the token lets the node's owner back into its box. The node
    /// keeps what a switch changes behind its own lock (channel creation reads it on
    /// other threads).
    fn swap_image(
        node: &Self::Node,
        new: Box<Self::Image>,
        token: &Switching,
    ) -> Result<Box<Self::Image>, Box<Self::Image>>;
}

/// A node as SPDK holds it: the module's node first (so the address of this is also the
/// node's: the io_device and the bdev's `ctxt`), then SPDK's bdev and its name. Only
/// reached through raw places: SPDK writes the bdev while others read the node.
#[repr(C)]
struct NodeCell<M: BdevTypes> {
    node: M::Node,
    bdev: sys::spdk_bdev,
    name: CString,
}

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
pub struct Registered<M: BdevTypes>(NonNull<NodeCell<M>>);

// SAFETY: a registered node is shared by every SPDK thread (its channels read it); what
// changes is SPDK's `bdev` (not reached through this handle) and what a switch or teardown
// changes, which the node keeps behind its own lock and atomic owner pointer; the owner is
// used only on the md thread (`owner_here`).
unsafe impl<M: BdevTypes> Send for Registered<M> {}

impl<M: Nodes> Registered<M> {
    /// The key that finds this node again.
    pub fn key(&self) -> NodeKey {
        NodeKey::of(self.0.as_ptr().cast())
    }

    /// The node.
    pub fn node(&self) -> &M::Node {
        // SAFETY: a node is freed only by teardown, which begins by consuming this handle.
        unsafe { &(*self.0.as_ptr()).node }
    }

    /// The node's own reference to its channel on the calling thread (see
    /// [`Kept`](super::io_channel::Kept)); `None` if SPDK made none.
    pub fn keep_channel(&self) -> Option<super::io_channel::Kept> {
        // SAFETY: the node is our registered io_device; its teardown drops what it keeps
        // before its io_device finishes unregistering (SPDK waits for every channel).
        unsafe { super::io_channel::Kept::take(self.0.as_ptr().cast()) }
    }

    /// A writable node's metadata owner, if the caller runs on the md thread (the only one
    /// that may use it); `None` otherwise, or for a read-only node.
    pub fn owner_here(&self) -> Option<&M::Owner> {
        // SAFETY: a node is unregistered only by teardown, which begins by consuming this
        // handle.
        let o = unsafe { owner_on_md_thread::<M>(self.node()) }?;
        M::wake(o);
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
    /// goes on under the same name over another image), through [`Nodes::swap_image`].
    /// Returns the former one, or `new` back when the caller is not on the md thread of a
    /// writable node (or the swap refused). The caller quiesced the bdev (no request in
    /// flight) and then moves every channel onto a state built from the new image
    /// ([`ChannelIter::renew_state`]); the former owner is closed once the former states
    /// are gone.
    pub fn switch_image(&self, new: Box<M::Image>) -> Result<Box<M::Image>, Box<M::Image>> {
        if self.owner_here().is_none() {
            return Err(new);
        }
        // On the md thread of a writable node (just checked); the caller quiesced it.
        M::swap_image(self.node(), new, &Switching(()))
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
        // SAFETY: the node is live while this handle exists; only the bdev's place is taken.
        let bdev = unsafe { std::ptr::addr_of_mut!((*self.0.as_ptr()).bdev) };
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
        each: fn(ChannelIter<M>, &mut C),
        done: fn(C, c_int),
    ) {
        // SAFETY: a registered node is a registered io_device (this handle exists); SPDK
        // refuses to unregister an io_device while an iteration over it is outstanding, so
        // it stays registered until `done`.
        unsafe { io_channel::for_each_channel::<M, C>(self.0.as_ptr().cast(), ctx, each, done) }
    }

    /// Teardown, step 1 (SPDK's destruct took the node out of the registry): unregisters
    /// the io_device. [`Nodes::channels_gone`] gets the node once its last channel is
    /// destroyed.
    pub fn unregister_device(self) {
        // SAFETY: a registered io_device; the node stays allocated until `MdNode` frees it,
        // after `device_gone`.
        unsafe { io_channel::unregister_device(self.0.as_ptr().cast(), device_gone::<M>) }
    }
}

/// The owner of the writable node `n` if the caller runs on its md thread (the only one
/// that may use it); `None` otherwise, or for a read-only node.
///
/// # Safety
/// `n` stays registered (teardown, which frees the owner, has not begun) while the returned
/// reference is used.
unsafe fn owner_on_md_thread<M: Nodes>(n: &M::Node) -> Option<&M::Owner> {
    let o = M::owner(n).raw();
    if o.is_null() || !M::md_thread(n).is_some_and(Thread::is_current) {
        return None;
    }
    // SAFETY: the owner is set before registration, replaced by a switch and freed by
    // teardown only on the md thread — the calling thread, so not meanwhile — and teardown
    // waits for unregistration (the contract). The reference is not `Send` (the owner is
    // not `Sync`): it stays on this thread.
    Some(unsafe { &*o })
}

/// SPDK finished a quiesce or unquiesce: hands the status to the boxed callback.
unsafe extern "C" fn quiesce_done(ctx: *mut c_void, status: c_int) {
    // SAFETY: `ctx` is the box `quiesce_call` leaked, reclaimed here once.
    let done = unsafe { Box::from_raw(ctx.cast::<Box<dyn FnOnce(c_int)>>()) };
    done(status);
}

/// Where SPDK cuts a bdev's requests ([`register`]'s `cut`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cut {
    /// The longest request, in blocks; also reported as the optimal I/O boundary.
    pub blocks: u32,
    /// Whether SPDK also splits a request at every multiple of `blocks` it crosses (a test
    /// SPDK then makes on every request), rather than only by size.
    pub at_boundaries: bool,
}

/// Leaks `node` and registers it: as an io_device (each channel gets a `M::Channel`
/// state), then its bdev called `name` (`props`, the node as `ctxt`). Then `cut` gets the
/// request size SPDK chose (`max_rw_size`, 0: no limit) and may return a [`Cut`] of at most
/// that many blocks, at which requests are then split.
///
/// On failure (SPDK's errno), the io_device is unregistered again and the node comes back
/// to [`Nodes::never_registered`] on this thread once that is done.
pub fn register<M: Nodes>(
    node: M::Node,
    name: CString,
    props: &Props,
    cut: impl FnOnce(u32) -> Option<Cut>,
) -> Result<Registered<M>, i32> {
    let cell = NonNull::from(Box::leak(Box::new(NodeCell::<M> {
        node,
        bdev: bdev::blank(),
        name,
    })));
    let p = cell.as_ptr();
    // SAFETY: `p` is live (leaked above) until `device_gone` or `free_unregistered`
    // reclaims it; SPDK copies the name.
    unsafe { io_channel::register_device::<M>(p.cast(), &(*p).name) };
    // SAFETY: as just said; the bdev's name lives in the cell.
    if let Err(e) = unsafe { register_bdev(p, props) } {
        // SAFETY: registered just above; `free_unregistered` reclaims the node (no bdev to
        // finish).
        unsafe { io_channel::unregister_device(p.cast(), free_unregistered::<M>) };
        return Err(e);
    }
    // SAFETY: registered just above on this thread; no request reaches the bdev before we
    // return to the reactor, and SPDK does not write these fields after registration.
    let b = unsafe { &mut (*p).bdev };
    if let Some(cut) = cut(b.max_rw_size) {
        b.max_rw_size = cut.blocks;
        b.optimal_io_boundary = cut.blocks;
        if cut.at_boundaries {
            bdev::set_split_on_optimal_io_boundary(b);
        }
    }
    Ok(Registered(cell))
}

/// Fills in the bdev of `cell` from `props` and registers it with SPDK, with `M`'s function
/// table and our module, the node as its `ctxt` and the cell's name. Returns SPDK's errno
/// on failure.
///
/// # Safety
/// `cell` is live and stays at its address until SPDK's destruct of the bdev completes (or,
/// on failure, until the caller frees it).
unsafe fn register_bdev<M: Nodes>(cell: *mut NodeCell<M>, props: &Props) -> Result<(), i32> {
    // SAFETY: per the contract; nothing else uses the cell yet.
    let (b, name) = unsafe { (&mut (*cell).bdev, (*cell).name.as_ptr()) };
    b.name = name.cast_mut();
    b.product_name = c"QCOW2 disk".as_ptr().cast_mut();
    b.blocklen = bdev_io::BLOCK_SIZE;
    b.blockcnt = props.blockcnt;
    b.write_cache = i32::from(props.write_cache);
    b.required_alignment = props.required_alignment;
    b.uuid = props.uuid.raw();
    b.ctxt = cell.cast();
    b.fn_table = &FnTable::<M>::TABLE;
    b.module = super::module::module_ptr();
    // SAFETY: the bdev struct is filled in and lives in the cell (contract).
    let rc = unsafe { sys::spdk_bdev_register(b) };
    if rc != 0 {
        return Err(-rc);
    }
    Ok(())
}

/// The function table of `M`'s bdevs: SPDK's calls go to [`Nodes`], requests to
/// [`Requests::submit_request`].
struct FnTable<M>(PhantomData<M>);

impl<M: Nodes> FnTable<M> {
    const TABLE: sys::spdk_bdev_fn_table = sys::spdk_bdev_fn_table {
        destruct: Some(destruct::<M>),
        submit_request: Some(bdev_io::submit_request::<M>),
        io_type_supported: Some(io_type_supported::<M>),
        get_io_channel: Some(get_io_channel),
        dump_info_json: Some(dump_info_json::<M>),
        write_config_json: Some(write_config_json::<M>),
        // SAFETY: every other member is an optional function pointer, for which zero is
        // `None`.
        ..unsafe { std::mem::zeroed() }
    };
}

unsafe extern "C" fn destruct<M: Nodes>(ctx: *mut c_void) -> c_int {
    // `ctx` is the node of a bdev SPDK unregistered and no longer uses.
    M::destruct(NodeKey::of(ctx));
    1 // asynchronous: `spdk_bdev_destruct_done` follows
}

unsafe extern "C" fn io_type_supported<M: Nodes>(
    ctx: *mut c_void,
    ty: sys::spdk_bdev_io_type,
) -> bool {
    // SAFETY: `ctx` is a registered node.
    M::io_type_supported(unsafe { &*ctx.cast::<M::Node>() }, ty)
}

unsafe extern "C" fn get_io_channel(ctx: *mut c_void) -> *mut sys::spdk_io_channel {
    // SAFETY: `ctx` is our registered io_device (the node).
    unsafe { sys::spdk_get_io_channel(ctx) }
}

unsafe extern "C" fn dump_info_json<M: Nodes>(
    ctx: *mut c_void,
    w: *mut sys::spdk_json_write_ctx,
) -> c_int {
    // SAFETY: `ctx` is a registered node.
    let node = unsafe { &*ctx.cast::<M::Node>() };
    // SAFETY: SPDK holds the bdev open for the call (`bdev_get_bdevs`), so it stays
    // registered: teardown begins only once every descriptor is closed.
    let owner = unsafe { owner_on_md_thread::<M>(node) };
    let v = M::info_json(node, owner);
    // SAFETY: SPDK hands us a write context inside the bdev's `driver_specific` object.
    unsafe { super::json::write_named(w, "qcow2", &v) };
    0
}

unsafe extern "C" fn write_config_json<M: Nodes>(
    bdev: *mut sys::spdk_bdev,
    w: *mut sys::spdk_json_write_ctx,
) {
    // SAFETY: `bdev` is ours, so its `ctxt` is the node.
    let calls = M::config_json(unsafe { &*(*bdev).ctxt.cast::<M::Node>() });
    for v in &calls {
        // SAFETY: SPDK hands us a write context inside the config array.
        unsafe { super::json::write_value(w, v) };
    }
}

/// The io_device of a node whose bdev failed to register is gone (on the thread that
/// registered it, the md thread).
unsafe extern "C" fn free_unregistered<M: Nodes>(io_device: *mut c_void) {
    // SAFETY: the node never reached SPDK's bdev list and its io_device is gone: only ours,
    // reclaimed once.
    let n = unsafe { Box::from_raw(io_device.cast::<NodeCell<M>>()) };
    let owner = M::owner(&n.node).take();
    // SAFETY: started on this thread (the md thread registered the node) and never used:
    // the bdev never registered.
    let owner = unsafe { OwnerBox::from_raw(owner) };
    M::never_registered(n.node, owner);
}

/// Teardown, between steps 1 and 2: the last channel is gone.
unsafe extern "C" fn device_gone<M: Nodes>(io_device: *mut c_void) {
    // SAFETY: our io_devices are nodes, live until `MdNode::destruct_done`.
    let node = unsafe { NonNull::new_unchecked(io_device.cast::<NodeCell<M>>()) };
    M::channels_gone(Unregistered(node));
}

/// A node whose io_device is unregistered and whose channels are gone, on its way to the
/// md thread.
pub struct Unregistered<M: BdevTypes>(NonNull<NodeCell<M>>);

// SAFETY: nothing touches the node through this handle; it only carries it to the md
// thread, where `MdNode` takes over.
unsafe impl<M: BdevTypes> Send for Unregistered<M> {}

impl<M: Nodes> Unregistered<M> {
    /// Runs `f` with the node on its md thread: now if that is the calling thread, else as
    /// a message. `Err`: SPDK's errno when the message could not be queued (the node is
    /// then left allocated).
    pub fn on_md_thread(self, f: fn(MdNode<M>)) -> Result<(), i32> {
        self.md_thread()?.exec(move || f(self.arrived()))
    }

    /// Queues `f` with the node as a message to its md thread (also when on it already).
    fn send_to_md_thread(self, f: fn(MdNode<M>)) -> Result<(), i32> {
        self.md_thread()?.send(move || f(self.arrived()))
    }

    /// On the md thread: the handle that may touch the node there.
    fn arrived(self) -> MdNode<M> {
        MdNode(self.0, PhantomData)
    }

    /// The node's md thread (`ESRCH` if it has none: not created on an SPDK thread).
    fn md_thread(&self) -> Result<Thread, i32> {
        // SAFETY: no channel is left, and nothing writes the node's fields but teardown on
        // the md thread, which this handle is on its way to.
        M::md_thread(unsafe { &self.0.as_ref().node }).ok_or(libc::ESRCH)
    }
}

/// A node in teardown, on its md thread: unregistered, no channel left, out of the
/// registry. Not `Send`: only this thread touches the node now.
pub struct MdNode<M: BdevTypes>(NonNull<NodeCell<M>>, PhantomData<*const ()>);

impl<M: Nodes> MdNode<M> {
    /// The node.
    pub fn node(&self) -> &M::Node {
        // SAFETY: live until `destruct_done`, which consumes this handle.
        unsafe { &self.0.as_ref().node }
    }

    /// Looks again shortly: queues `f` with the node as a message to this (the md) thread.
    /// `Err`: SPDK's errno when the message could not be queued (the node is then left
    /// allocated).
    pub fn again(self, f: fn(MdNode<M>)) -> Result<(), i32> {
        Unregistered(self.0).send_to_md_thread(f)
    }

    /// Teardown, step 2: a writable node's owner flushes the metadata and is freed, then
    /// `then` gets the node and the owner's final counters, on this thread; a read-only
    /// node goes to `then` at once (`None`).
    pub fn close_owner(self, then: impl FnOnce(MdNode<M>, Option<M::OwnerCounters>) + 'static) {
        // On the md thread with no channel left: only this thread uses the node's owner,
        // and it is taken once (nulled).
        let raw = M::owner(self.node()).take();
        // SAFETY: the owner was started on this thread and every request through it has
        // completed (no channel is left).
        match unsafe { OwnerBox::<M>::from_raw(raw) } {
            Some(owner) => owner.close(move |counters| then(self, Some(counters))),
            None => then(self, None),
        }
    }

    /// Teardown, step 3: tells SPDK the bdev's destruct is done and hands the node back, to
    /// be dropped.
    pub fn destruct_done(self) -> M::Node {
        // SAFETY: our bdev, being destructed (SPDK called destruct, then the io_device went).
        unsafe { sys::spdk_bdev_destruct_done(std::ptr::addr_of_mut!((*self.0.as_ptr()).bdev), 0) };
        // SAFETY: unregistered, no channel or owner left, SPDK is done with the bdev: the
        // node is only ours; reclaimed once (this handle is consumed).
        unsafe { Box::from_raw(self.0.as_ptr()) }.node
    }
}
