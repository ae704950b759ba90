//! SPDK threads, messages and pollers.

use super::sys;
use std::ffi::{c_int, c_void, CStr};

/// The SPDK thread the caller runs on (null outside SPDK threads).
pub fn current() -> *mut sys::spdk_thread {
    // SAFETY: no arguments; returns the calling thread's SPDK thread or null.
    unsafe { sys::spdk_get_thread() }
}

type Msg = Box<dyn FnOnce()>;

unsafe extern "C" fn run_msg(ctx: *mut c_void) {
    // SAFETY: `ctx` is the `Box<Msg>` leaked by `send_msg`/`exec_msg`, delivered exactly once.
    let f = unsafe { Box::from_raw(ctx.cast::<Msg>()) };
    f();
}

/// Runs `f` on `thread`: now if that is the calling thread, else as a message. Returns the
/// errno SPDK reported if the message could not be queued (then `f` is dropped, not run).
///
/// # Safety
/// `thread` must be a live SPDK thread.
pub unsafe fn exec_msg(
    thread: *mut sys::spdk_thread,
    f: impl FnOnce() + 'static,
) -> Result<(), i32> {
    let ctx = Box::into_raw(Box::new(Box::new(f) as Msg)).cast::<c_void>();
    // SAFETY: `thread` is live (contract); `run_msg` takes back ownership of `ctx`.
    let rc = unsafe { sys::spdk_sys_thread_exec_msg(thread, Some(run_msg), ctx) };
    if rc != 0 {
        // SAFETY: the message was not queued, so `ctx` is still ours.
        drop(unsafe { Box::from_raw(ctx.cast::<Msg>()) });
        return Err(-rc);
    }
    Ok(())
}

/// Queues `f` to run on `thread` as a message (even if it is the calling thread).
///
/// # Safety
/// `thread` must be a live SPDK thread.
pub unsafe fn send_msg(
    thread: *mut sys::spdk_thread,
    f: impl FnOnce() + 'static,
) -> Result<(), i32> {
    let ctx = Box::into_raw(Box::new(Box::new(f) as Msg)).cast::<c_void>();
    // SAFETY: `thread` is live (contract); `run_msg` takes back ownership of `ctx`.
    let rc = unsafe { sys::spdk_thread_send_msg(thread, Some(run_msg), ctx) };
    if rc != 0 {
        // SAFETY: the message was not queued, so `ctx` is still ours.
        drop(unsafe { Box::from_raw(ctx.cast::<Msg>()) });
        return Err(-rc);
    }
    Ok(())
}

/// A registered poller; unregistered by [`Poller::unregister`] (never implicitly, because a
/// poller may unregister itself from inside its own callback).
pub struct Poller(*mut sys::spdk_poller);

impl Poller {
    /// Registers `f(ctx)` to run on the calling thread every `period_us` (0: every
    /// iteration). Returns `None` if SPDK refused.
    ///
    /// # Safety
    /// `ctx` must stay valid for `f` until the poller is unregistered.
    pub unsafe fn register(
        f: unsafe extern "C" fn(*mut c_void) -> c_int,
        ctx: *mut c_void,
        period_us: u64,
        name: &CStr,
    ) -> Option<Poller> {
        // SAFETY: `f` and `ctx` are valid per this function's contract; SPDK copies `name`.
        let p = unsafe { sys::spdk_poller_register_named(Some(f), ctx, period_us, name.as_ptr()) };
        (!p.is_null()).then_some(Poller(p))
    }

    /// Unregisters the poller (on the thread that registered it). Safe to call from inside
    /// the poller's own callback: SPDK stops calling it after the current run.
    pub fn unregister(&mut self) {
        if !self.0.is_null() {
            // SAFETY: `self.0` is a poller registered on this thread and not yet unregistered
            // (unregistering nulls it).
            unsafe { sys::spdk_poller_unregister(&mut self.0) };
        }
    }
}

/// Poller return value: work was done.
pub const POLLER_BUSY: c_int = 1;
/// Poller return value: nothing to do.
pub const POLLER_IDLE: c_int = 0;

/// Queues `f(ctx)` on `thread` without allocating (for the data path: the context is a
/// bdev_io). Returns SPDK's errno if the message could not be queued (`f` then does not run).
///
/// # Safety
/// `thread` must be a live SPDK thread and `ctx` valid for `f` when it runs there.
pub unsafe fn send_raw(
    thread: *mut sys::spdk_thread,
    f: unsafe extern "C" fn(*mut c_void),
    ctx: *mut c_void,
) -> Result<(), i32> {
    // SAFETY: per the contract.
    let rc = unsafe { sys::spdk_thread_send_msg(thread, Some(f), ctx) };
    if rc != 0 {
        return Err(-rc);
    }
    Ok(())
}
