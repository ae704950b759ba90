//! I/O devices, their per-thread channels, and iteration over every channel.

use super::sys;
use std::ffi::{c_int, c_void, CStr};

/// A reference to a channel of some io_device (a base bdev's channel), put back on drop.
/// Must be dropped on the thread that got it.
pub struct ChannelRef(*mut sys::spdk_io_channel);

impl ChannelRef {
    /// Gets this thread's channel of the bdev open as `desc`; `None` if SPDK refused.
    pub fn of_bdev(desc: &super::bdev::Desc) -> Option<ChannelRef> {
        // SAFETY: `desc` is open; the call runs on an SPDK thread.
        let ch = unsafe { sys::spdk_bdev_get_io_channel(desc.raw()) };
        (!ch.is_null()).then_some(ChannelRef(ch))
    }

    /// The raw channel (for I/O submission).
    pub fn raw(&self) -> *mut sys::spdk_io_channel {
        self.0
    }
}

impl Drop for ChannelRef {
    fn drop(&mut self) {
        // SAFETY: the reference was obtained on this thread and is put back once.
        unsafe { sys::spdk_put_io_channel(self.0) }
    }
}

/// The context area of one of our channels (what `create_cb` filled in).
///
/// # Safety
/// `ch` must be a live channel of one of our io_devices.
pub unsafe fn ctx_of(ch: *mut sys::spdk_io_channel) -> *mut c_void {
    // SAFETY: per the contract.
    unsafe { sys::io_channel_get_ctx(ch) }
}

/// Channel constructor/destructor signature of `spdk_io_device_register`.
pub type ChannelCb = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;
/// Destructor signature.
pub type ChannelDtor = unsafe extern "C" fn(*mut c_void, *mut c_void);

/// Registers `io_device` (any unique address) whose channels have `ctx_size` bytes of
/// context built by `create` and torn down by `destroy`.
///
/// # Safety
/// `io_device` must stay valid until the unregister callback of [`unregister_device`].
pub unsafe fn register_device(
    io_device: *mut c_void,
    create: ChannelCb,
    destroy: ChannelDtor,
    ctx_size: u32,
    name: &CStr,
) {
    // SAFETY: per the contract; SPDK copies `name`.
    unsafe {
        sys::spdk_io_device_register(
            io_device,
            Some(create),
            Some(destroy),
            ctx_size,
            name.as_ptr(),
        )
    }
}

/// Unregisters `io_device`; `done(io_device)` runs once every channel is gone.
///
/// # Safety
/// `io_device` must be registered.
pub unsafe fn unregister_device(io_device: *mut c_void, done: unsafe extern "C" fn(*mut c_void)) {
    // SAFETY: per the contract.
    unsafe { sys::spdk_io_device_unregister(io_device, Some(done)) }
}

/// One step of [`for_each_channel`]: the channel being visited. Must be continued exactly
/// once with [`ChannelIter::next`] — now or later, on the channel's thread.
pub struct ChannelIter(*mut sys::spdk_io_channel_iter);

impl ChannelIter {
    /// The visited channel's context area.
    pub fn ctx(&self) -> *mut c_void {
        // SAFETY: the iterator is live until continued; the channel it names is ours.
        unsafe { ctx_of(sys::spdk_io_channel_iter_get_channel(self.0)) }
    }

    /// Moves to the next channel (or to the completion), with `status` (non-zero stops).
    pub fn next(self, status: c_int) {
        // SAFETY: the iterator is live and continued once (consumed).
        unsafe { sys::spdk_for_each_channel_continue(self.0, status) }
    }
}

struct IterState<C> {
    each: fn(ChannelIter, &mut C),
    done: fn(C, c_int),
    ctx: C,
}

unsafe extern "C" fn iter_each<C>(i: *mut sys::spdk_io_channel_iter) {
    // SAFETY: the iteration context is the `IterState<C>` leaked by `for_each_channel`, alive
    // until `iter_done`; steps run one at a time, so this is the only reference.
    let st = unsafe { &mut *sys::spdk_io_channel_iter_get_ctx(i).cast::<IterState<C>>() };
    (st.each)(ChannelIter(i), &mut st.ctx);
}

unsafe extern "C" fn iter_done<C>(i: *mut sys::spdk_io_channel_iter, status: c_int) {
    // SAFETY: as in `iter_each`; this is the last use, so ownership is taken back.
    let st = unsafe { Box::from_raw(sys::spdk_io_channel_iter_get_ctx(i).cast::<IterState<C>>()) };
    (st.done)(st.ctx, status);
}

/// Visits every channel of `io_device` on its own thread with `each`, then calls `done`
/// on the calling thread.
///
/// # Safety
/// `io_device` must be registered and stay so until `done` runs.
pub unsafe fn for_each_channel<C: 'static>(
    io_device: *mut c_void,
    ctx: C,
    each: fn(ChannelIter, &mut C),
    done: fn(C, c_int),
) {
    let st = Box::into_raw(Box::new(IterState { each, done, ctx })).cast::<c_void>();
    // SAFETY: per the contract; `st` is reclaimed by `iter_done`.
    unsafe { sys::spdk_for_each_channel(io_device, Some(iter_each::<C>), st, Some(iter_done::<C>)) }
}
