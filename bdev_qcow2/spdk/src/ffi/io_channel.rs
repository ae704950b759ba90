//! I/O devices, their per-thread channels, and iteration over every channel.

use super::sys;
use super::thread::{self, Thread};
use super::types::BdevTypes;
use std::ffi::{c_int, c_void, CStr};
use std::marker::PhantomData;
use std::ptr::NonNull;

/// How module `M`'s channel states are made and let go (SPDK's `create_cb` and
/// `destroy_cb` of its io_devices, its nodes).
pub trait Channels: BdevTypes {
    /// This thread's channel state of `node` (its poller is started by the caller).
    fn create_channel(node: &Self::Node) -> Result<Box<Self::Channel>, i32>;
    /// SPDK put the channel: whether the state can be freed now (else its poll finishes it
    /// once idle).
    fn release_channel(c: &Self::Channel) -> bool;
}

/// The channel state behind a context area of one of our channels (what `create_cb` stored).
///
/// # Safety
/// `ctx` is the context area of a live channel of one of our nodes; the state outlives the
/// returned reference (it lives while the channel has requests or is open).
pub(super) unsafe fn state_of<'a, M: BdevTypes>(ctx: *mut c_void) -> &'a M::Channel {
    // SAFETY: per the contract; `create_cb` stored a live state pointer there.
    unsafe { &**ctx.cast::<*const M::Channel>() }
}

/// The context area of a live channel.
///
/// # Safety
/// `ch` must be a live channel of one of our io_devices.
pub(super) unsafe fn ctx_of(ch: *mut sys::spdk_io_channel) -> *mut c_void {
    // SAFETY: per the contract.
    unsafe { sys::io_channel_get_ctx(ch) }
}

unsafe extern "C" fn create_cb<M: Channels>(io_device: *mut c_void, ctx: *mut c_void) -> c_int {
    // SAFETY: our io_devices are nodes, live while channels exist.
    let node = unsafe { &*io_device.cast::<M::Node>() };
    let state = match new_state::<M>(node) {
        Ok(s) => s,
        Err(e) => return -e,
    };
    // SAFETY: the context area has room for one pointer (size given at registration).
    unsafe { *ctx.cast::<*const M::Channel>() = state };
    0
}

/// A channel state of `node` on this thread, its poller started.
fn new_state<M: Channels>(node: &M::Node) -> Result<*const M::Channel, i32> {
    let state = M::create_channel(node)?;
    // Dropped on failure: nothing is in flight except the open task, which its executor drops.
    thread::start(state, M::CHANNEL_POLLER).map_err(|_| libc::ENOMEM)
}

unsafe extern "C" fn destroy_cb<M: Channels>(_io_device: *mut c_void, ctx: *mut c_void) {
    // SAFETY: the area holds the state `create_cb` stored, live until finished.
    let state = unsafe { *ctx.cast::<*const M::Channel>() };
    // SAFETY: as just said.
    if M::release_channel(unsafe { &*state }) {
        // SAFETY: idle: nothing refers to the state any more; finished once (its poll
        // finishes only states that were released, and this one is gone now).
        unsafe { thread::stop(state) };
    }
}

/// Registers `node` (a `M::Node` at that address) as an io_device whose channels each get
/// a `M::Channel` state, named `name`.
///
/// # Safety
/// `node` must stay valid until the unregister callback of [`unregister_device`].
pub(super) unsafe fn register_device<M: Channels>(node: *const c_void, name: &CStr) {
    // SAFETY: per the contract; SPDK copies `name`.
    unsafe {
        sys::spdk_io_device_register(
            node.cast_mut(),
            Some(create_cb::<M>),
            Some(destroy_cb::<M>),
            std::mem::size_of::<*const M::Channel>() as u32,
            name.as_ptr(),
        )
    }
}

/// Unregisters `io_device`; `done(io_device)` runs once every channel is gone.
///
/// # Safety
/// `io_device` must be registered.
pub(super) unsafe fn unregister_device(
    io_device: *mut c_void,
    done: unsafe extern "C" fn(*mut c_void),
) {
    // SAFETY: per the contract.
    unsafe { sys::spdk_io_device_unregister(io_device, Some(done)) }
}

/// One step of [`for_each_channel`]: the channel being visited. Must be continued exactly
/// once with [`ChannelIter::next`] — now or later, on the channel's thread.
pub struct ChannelIter<M: BdevTypes>(*mut sys::spdk_io_channel_iter, PhantomData<M>);

impl<M: Channels> ChannelIter<M> {
    /// Calls `f` with the visited channel's state and the iterator (which `f` continues,
    /// or keeps in the state to continue later).
    pub fn with_channel<R>(self, f: impl FnOnce(&M::Channel, ChannelIter<M>) -> R) -> R {
        // SAFETY: the iterator is live until continued; the channel it names is one of our
        // node's, whose state lives at least until the iteration moves past it.
        let c = unsafe { state_of::<M>(ctx_of(sys::spdk_io_channel_iter_get_channel(self.0))) };
        f(c, self)
    }

    /// Puts a new state under the visited channel, built from its node as the node is now
    /// (after an external snapshot switched the node's image), and releases the old state
    /// (freed now if idle, else by its poll once idle); then continues. A channel whose new
    /// state cannot be built keeps the old one: `kept(errno)` runs, and the iteration goes
    /// on to the other channels. (`kept` runs before the iteration moves on: the next step,
    /// or its end, may run on another thread at once and owns the iteration's context.)
    pub fn renew_state(self, kept: impl FnOnce(i32)) {
        // SAFETY: the iterator is live until continued; its io_device is one of our nodes,
        // registered while the iteration runs, and its channel's context area holds a live
        // state pointer (`create_cb`), which only this thread replaces.
        let (node, ctx) = unsafe {
            (
                &*sys::spdk_io_channel_iter_get_io_device(self.0).cast::<M::Node>(),
                ctx_of(sys::spdk_io_channel_iter_get_channel(self.0)).cast::<*const M::Channel>(),
            )
        };
        match new_state::<M>(node) {
            Ok(new) => {
                // SAFETY: as above; requests already carry the state they were submitted
                // to (the old one stays until they completed), new ones find the new one.
                let old = unsafe { std::ptr::replace(ctx, new) };
                // SAFETY: live until finished, which only its poll or this does.
                if M::release_channel(unsafe { &*old }) {
                    // SAFETY: idle and no longer reachable from the channel: finished once.
                    unsafe { thread::stop(old) };
                }
            }
            Err(e) => kept(e),
        }
        self.next(0);
    }

    /// Moves to the next channel (or to the completion), with `status` (non-zero stops).
    pub fn next(self, status: c_int) {
        // SAFETY: the iterator is live and continued once (consumed).
        unsafe { sys::spdk_for_each_channel_continue(self.0, status) }
    }
}

struct IterState<M: BdevTypes, C> {
    each: fn(ChannelIter<M>, &mut C),
    done: fn(C, c_int),
    ctx: C,
}

unsafe extern "C" fn iter_each<M: BdevTypes, C>(i: *mut sys::spdk_io_channel_iter) {
    // SAFETY: the iteration context is the `IterState<M, C>` leaked by `for_each_channel`,
    // alive until `iter_done`; steps run one at a time, so this is the only reference.
    let st = unsafe { &mut *sys::spdk_io_channel_iter_get_ctx(i).cast::<IterState<M, C>>() };
    (st.each)(ChannelIter(i, PhantomData), &mut st.ctx);
}

unsafe extern "C" fn iter_done<M: BdevTypes, C>(i: *mut sys::spdk_io_channel_iter, status: c_int) {
    // SAFETY: as in `iter_each`; this is the last use, so ownership is taken back.
    let st =
        unsafe { Box::from_raw(sys::spdk_io_channel_iter_get_ctx(i).cast::<IterState<M, C>>()) };
    (st.done)(st.ctx, status);
}

/// Visits every channel of `io_device` on its own thread with `each`, then calls `done`
/// on the calling thread.
///
/// # Safety
/// `io_device` must be registered and stay so until `done` runs.
pub(super) unsafe fn for_each_channel<M: BdevTypes, C: 'static>(
    io_device: *mut c_void,
    ctx: C,
    each: fn(ChannelIter<M>, &mut C),
    done: fn(C, c_int),
) {
    let st = Box::into_raw(Box::new(IterState { each, done, ctx })).cast::<c_void>();
    // SAFETY: per the contract; `st` is reclaimed by `iter_done`.
    unsafe {
        sys::spdk_for_each_channel(
            io_device,
            Some(iter_each::<M, C>),
            st,
            Some(iter_done::<M, C>),
        )
    }
}

/// A node's own reference to its channel on the thread that took it (its md thread), put
/// back there when dropped: the channel, and what it opened, stay built between the bdev
/// I/Os that come and go on that thread.
pub struct Kept {
    ch: NonNull<sys::spdk_io_channel>,
    thread: Thread,
}

/// A channel pointer on its way home to be put.
struct Home(NonNull<sys::spdk_io_channel>);

// SAFETY: the pointer is only put, and only on the thread that got it (`Kept`'s drop sends
// it there); SPDK's channels are never touched elsewhere.
unsafe impl Send for Home {}
// SAFETY: as for `Home`: a `Kept` moves between threads (inside a node) but its channel is
// used only where it was got.
unsafe impl Send for Kept {}

impl Home {
    fn put(self) {
        // SAFETY: a channel got on this thread (see `Kept::take`), put back once.
        unsafe { sys::spdk_put_io_channel(self.0.as_ptr()) }
    }
}

impl Kept {
    /// This thread's channel of io_device `dev` (built now if it was not); `None` if SPDK
    /// made none.
    ///
    /// # Safety
    /// `dev` is one of our registered io_devices, unregistered only after this is dropped
    /// (SPDK waits for the put before it finishes unregistering).
    pub unsafe fn take(dev: *mut c_void) -> Option<Kept> {
        let thread = Thread::current()?;
        // SAFETY: per the contract; on an SPDK thread.
        let ch = NonNull::new(unsafe { sys::spdk_get_io_channel(dev) })?;
        Some(Kept { ch, thread })
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        let home = Home(self.ch);
        if self.thread.is_current() {
            return home.put();
        }
        if let Err(e) = self.thread.send(move || home.put()) {
            tracing::error!("cannot reach the thread of a kept channel ({e}): leaking it");
        }
    }
}
