//! SPDK threads, messages and pollers.

use super::sink::{HomeRef, Sinks};
use super::sys;
use std::cell::Cell;
use std::ffi::{c_int, c_void, CStr};
use std::ptr::NonNull;

/// The SPDK thread the caller runs on (null outside SPDK threads).
pub fn current() -> *mut sys::spdk_thread {
    // SAFETY: no arguments; returns the calling thread's SPDK thread or null.
    unsafe { sys::spdk_get_thread() }
}

/// The calling SPDK thread's name (empty outside SPDK threads).
pub fn current_name() -> String {
    // SAFETY: `current()` is the calling thread or null; a thread's name is a valid C string
    // or null.
    unsafe {
        let t = current();
        if t.is_null() {
            return String::new();
        }
        let n = sys::spdk_thread_get_name(t);
        if n.is_null() {
            String::new()
        } else {
            CStr::from_ptr(n).to_string_lossy().into_owned()
        }
    }
}

/// A hint to the CPU to load the cache line at `p` (no effect on other architectures).
#[inline]
pub fn prefetch_line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults, whatever the address; SSE is part of x86_64.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// The CPU the calling thread runs on (`None` if the kernel does not say). A reactor is
/// pinned to its core, so on an SPDK thread this names the reactor's core.
pub fn current_cpu() -> Option<u32> {
    // SAFETY: sched_getcpu takes no arguments and only reads the caller's own state.
    let cpu = unsafe { libc::sched_getcpu() };
    u32::try_from(cpu).ok()
}

/// An SPDK thread, as a handle that any thread may hold and send messages to.
///
/// Invariant: the thread is live. Handles are taken from running SPDK threads
/// ([`Thread::current`]) and kept in the state of a bdev (its md thread) or a channel; SPDK
/// frees its threads only when the application stops, after the bdev layer (and so every
/// bdev of ours and its channels) is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Thread(NonNull<sys::spdk_thread>);

// SAFETY: the handle only names the thread; SPDK's message calls may be made from any thread
// to any live thread (its message ring is multi-producer).
unsafe impl Send for Thread {}
// SAFETY: as for `Send`: every method takes the handle by value and calls thread-safe SPDK
// functions.
unsafe impl Sync for Thread {}

/// A closure sent to a thread, boxed once more to pass through SPDK's `void *`.
type Msg = Box<dyn FnOnce() + Send>;

unsafe extern "C" fn run_msg(ctx: *mut c_void) {
    // SAFETY: `ctx` is the `Box<Msg>` leaked by `Thread::queue`, delivered exactly once.
    let f = unsafe { Box::from_raw(ctx.cast::<Msg>()) };
    f();
}

impl Thread {
    /// The SPDK thread the caller runs on (`None` outside SPDK threads).
    pub fn current() -> Option<Thread> {
        NonNull::new(current()).map(Thread)
    }

    /// The thread behind a pointer that is known not to be null.
    ///
    /// # Safety
    /// `raw` is a live SPDK thread that stays so as the type's invariant says.
    #[inline(always)]
    pub(super) unsafe fn from_raw_unchecked(raw: *mut sys::spdk_thread) -> Thread {
        // SAFETY: not null, per the contract.
        Thread(unsafe { NonNull::new_unchecked(raw) })
    }

    /// The raw thread (for code that still keeps raw pointers and compares them).
    pub fn raw(self) -> *mut sys::spdk_thread {
        self.0.as_ptr()
    }

    /// Whether the caller runs on this thread.
    pub fn is_current(self) -> bool {
        current() == self.raw()
    }

    /// Runs `f` on this thread: now if it is the calling thread, else as a message. Returns
    /// the errno SPDK reported if the message could not be queued (then `f` is dropped, not
    /// run).
    pub fn exec(self, f: impl FnOnce() + Send + 'static) -> Result<(), i32> {
        self.queue(f, true)
    }

    /// Queues `f` to run on this thread as a message (even if it is the calling thread).
    /// Returns the errno SPDK reported if the message could not be queued (then `f` is
    /// dropped, not run).
    pub fn send(self, f: impl FnOnce() + Send + 'static) -> Result<(), i32> {
        self.queue(f, false)
    }

    fn queue(self, f: impl FnOnce() + Send + 'static, now_if_here: bool) -> Result<(), i32> {
        let ctx = Box::into_raw(Box::new(Box::new(f) as Msg)).cast::<c_void>();
        // SAFETY: the thread is live (the type's invariant); `run_msg` takes back ownership
        // of `ctx`, which holds a `Send` closure (it may run on another thread).
        let rc = unsafe {
            if now_if_here {
                sys::spdk_sys_thread_exec_msg(self.raw(), Some(run_msg), ctx)
            } else {
                sys::spdk_thread_send_msg(self.raw(), Some(run_msg), ctx)
            }
        };
        if rc != 0 {
            // SAFETY: the message was not queued, so `ctx` is still ours.
            drop(unsafe { Box::from_raw(ctx.cast::<Msg>()) });
            return Err(-rc);
        }
        Ok(())
    }

    /// Queues `m` to arrive on this thread ([`Message::arrive`]); gives it back if SPDK's
    /// message pool is empty.
    pub fn send_boxed<M: Message + Send>(self, m: Box<M>) -> Result<(), Box<M>> {
        // SAFETY: the thread is live (the type's invariant); `M` may move between threads.
        unsafe { send_boxed(self.raw(), m) }
    }
}

/// State of type `T` living on one SPDK thread, as a handle that may travel to other threads
/// (in a message) and back, and is dereferenced only on that thread ([`Homed::get`]).
///
/// Invariant: the state outlives every handle to it. Handles are made in `ffi` only, for
/// states whose lifetime `ffi` manages: a channel's state ([`HomeRef::homed`]), kept busy
/// by the requests that carry its handle until they return, and a writable node's owner
/// ([`Homed::owner`]), which outlives the node's channels, the only holders of its handle.
#[derive(Debug)]
pub struct Homed<T> {
    state: NonNull<T>,
    home: Thread,
}

// SAFETY: other threads only carry the handle; it is dereferenced on its home thread alone
// (`get`), where the state lives, so `T` itself never crosses threads.
unsafe impl<T> Send for Homed<T> {}

/// Another handle to the same state, under the same invariant (not `Copy`: each copy is
/// made where it is needed, in sight).
impl<T> Clone for Homed<T> {
    fn clone(&self) -> Self {
        Homed {
            state: self.state,
            home: self.home,
        }
    }
}

impl<T> Homed<T> {
    /// # Safety
    /// `state` lives on `home` and outlives every copy of the handle (the type's invariant).
    pub(super) unsafe fn new(state: &T, home: Thread) -> Homed<T> {
        Homed {
            state: NonNull::from(state),
            home,
        }
    }

    /// The thread the state lives on.
    pub fn home(&self) -> Thread {
        self.home
    }

    /// The state, on its home thread (debug builds assert the caller runs there).
    #[track_caller]
    pub fn get(&self) -> &T {
        debug_assert!(self.home.is_current(), "a homed state used off its thread");
        // SAFETY: live (the type's invariant), and used on its own thread only.
        unsafe { self.state.as_ref() }
    }
}

impl<H> HomeRef<H> {
    /// A handle to the host armed now, homed on the calling thread (the host's: a
    /// `HomeRef` never leaves it), for a request that leaves the thread and comes back
    /// while the host waits for it (`None`: no host armed, or not on an SPDK thread).
    pub fn homed(&self) -> Option<Homed<H>> {
        let host = self.armed()?;
        let home = Thread::current()?;
        // SAFETY: an armed host is a poller state `start` boxed on this thread (neither
        // the registration nor its host leaves its thread), which `stop` frees only once
        // its poll said done or SPDK released it idle: a host waits for the requests that
        // carry its handle (a channel's replica, for its asks) before it is either.
        Some(unsafe { Homed::new(host.as_ref(), home) })
    }
}

/// What one run of a poller did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Poll {
    /// Some work.
    Busy,
    /// Nothing to do.
    Idle,
    /// The state is done: the poller stops and [`Polled::finish`] consumes it.
    Done,
}

impl Poll {
    /// One run of a one-shot engine task (a create or format job) that polled `polled`
    /// things: done once `finished` (its result is in and its executor has nothing in
    /// flight), else busy when the run polled something.
    pub fn of_task(polled: usize, finished: bool) -> Poll {
        if finished {
            Poll::Done
        } else if polled > 0 {
            Poll::Busy
        } else {
            Poll::Idle
        }
    }
}

/// Where a polled state keeps its poller (set by [`start`]), and whether it is paused.
#[derive(Debug, Default)]
pub struct PollerSlot(Cell<*mut sys::spdk_poller>, Cell<bool>);

impl PollerSlot {
    /// Pauses the poller: SPDK's thread skips it (no cost per reactor pass) until
    /// [`resume`](Self::resume). Called from the poller's own poll, on its thread.
    pub fn pause(&self) {
        let p = self.0.get();
        if p.is_null() || self.1.get() {
            return;
        }
        self.1.set(true);
        // SAFETY: a live poller (the slot is nulled when it is unregistered), on the thread
        // that registered it (the state is only used there); SPDK moves it to its paused
        // list after the current run.
        unsafe { sys::spdk_poller_pause(p) };
    }

    /// Resumes a paused poller (one load and a branch when it runs). On its thread.
    #[inline(always)]
    pub fn resume(&self) {
        if self.1.get() {
            self.resume_paused();
        }
    }

    #[cold]
    fn resume_paused(&self) {
        self.1.set(false);
        let p = self.0.get();
        if !p.is_null() {
            // SAFETY: as in `pause`: live, on its own thread.
            unsafe { sys::spdk_poller_resume(p) };
        }
    }
}

/// State that a poller of its own drives on the thread that started it, and owns: it lives
/// at a fixed address from [`start`] until it finishes (its poll said [`Poll::Done`], or
/// [`stop`] was called).
pub trait Polled: Sized + 'static {
    /// Its poller's slot.
    fn slot(&self) -> &PollerSlot;
    /// One run.
    fn poll(&self) -> Poll;
    /// Where its devices deliver completions (a host's: a channel, the owner), armed with
    /// the state's address from [`start`] until it finishes; `None` by default.
    fn sinks(&self) -> Option<&Sinks<Self>> {
        None
    }
    /// The poller has stopped: the last use of the state (dropped here by default). Never
    /// inlined, so that a profile tells teardown from the poll that ended it.
    #[inline(never)]
    fn finish(self: Box<Self>) {}
}

/// Runs one poll of `ctx`, the state of a data-path poller (a channel, the owner).
unsafe extern "C" fn run_poller<T: Polled>(ctx: *mut c_void) -> c_int {
    // SAFETY: per `poll_once`.
    unsafe { poll_once::<T>(ctx) }
}

/// Runs one poll of `ctx`, the state of a control-path poller (a creation, a format). Kept
/// apart from [`run_poller`] so that profiles (`tests/spdk_instr.sh`) can count the data
/// path's pollers by name.
unsafe extern "C" fn run_task_poller<T: Polled>(ctx: *mut c_void) -> c_int {
    // SAFETY: per `poll_once`.
    unsafe { poll_once::<T>(ctx) }
}

/// # Safety
/// `ctx` is the live state `start` leaked for its poller, freed only by [`stop`], which
/// unregisters the poller first.
#[inline(always)]
unsafe fn poll_once<T: Polled>(ctx: *mut c_void) -> c_int {
    // SAFETY: per the contract.
    let state = unsafe { &*ctx.cast::<T>() };
    match state.poll() {
        Poll::Busy => POLLER_BUSY,
        Poll::Idle => POLLER_IDLE,
        Poll::Done => {
            // SAFETY: the state said it is done; this is its poller's last run.
            unsafe { stop(ctx.cast::<T>()) };
            POLLER_BUSY
        }
    }
}

/// Starts a poller on the calling thread (every iteration) that drives and owns `state`, a
/// channel or the owner. Returns the state's address (valid until it finishes), or the
/// state back if SPDK refused a poller.
pub fn start<T: Polled>(state: Box<T>, name: &CStr) -> Result<*const T, Box<T>> {
    register(state, name, run_poller::<T>)
}

/// [`start`] for a control-path task (a creation, a format).
pub fn start_task<T: Polled>(state: Box<T>, name: &CStr) -> Result<*const T, Box<T>> {
    register(state, name, run_task_poller::<T>)
}

fn register<T: Polled>(
    state: Box<T>,
    name: &CStr,
    run: unsafe extern "C" fn(*mut c_void) -> c_int,
) -> Result<*const T, Box<T>> {
    let ctx = Box::into_raw(state);
    // SAFETY: `run` is `run_poller::<T>` or `run_task_poller::<T>`, which get the leaked
    // state, live until `stop`; SPDK copies `name`.
    let p = unsafe { sys::spdk_poller_register_named(Some(run), ctx.cast(), 0, name.as_ptr()) };
    if p.is_null() {
        // SAFETY: no poller refers to it: still only ours.
        return Err(unsafe { Box::from_raw(ctx) });
    }
    // SAFETY: live (just leaked), and only read from now on.
    let st = unsafe { &*ctx };
    st.slot().0.set(p);
    if let Some(s) = st.sinks() {
        // At its final address, which `stop` frees after disarming it.
        s.arm(NonNull::from(st));
    }
    Ok(ctx)
}

/// Stops the poller of `state` and finishes the state (on its thread; also from inside its
/// own poll).
///
/// # Safety
/// `state` comes from [`start`] and is not finished yet; nothing uses it afterwards.
pub unsafe fn stop<T: Polled>(state: *const T) {
    // SAFETY: per the contract, live; its poller was registered on this thread and is
    // unregistered once (the slot is nulled).
    let st = unsafe { Box::from_raw(state.cast_mut()) };
    if let Some(s) = st.sinks() {
        // Before `finish` may move or drop the state.
        s.disarm();
    }
    let mut p = st.slot().0.replace(std::ptr::null_mut());
    if !p.is_null() {
        // SAFETY: as just said; SPDK stops calling it after the current run.
        unsafe { sys::spdk_poller_unregister(&mut p) };
    }
    st.finish();
}

/// Poller return value: work was done.
const POLLER_BUSY: c_int = 1;
/// Poller return value: nothing to do.
const POLLER_IDLE: c_int = 0;

/// A boxed message between threads ([`Thread::send_boxed`]).
pub trait Message: Sized + 'static {
    /// Runs on the thread it was sent to.
    fn arrive(self: Box<Self>);
}

unsafe extern "C" fn arrive<M: Message>(ctx: *mut c_void) {
    // SAFETY: `ctx` is the box `send_boxed` gave up, delivered once.
    M::arrive(unsafe { Box::from_raw(ctx.cast::<M>()) });
}

/// Queues `m` to arrive on `thread` ([`Message::arrive`]); gives it back if SPDK's message
/// pool is empty (the body of [`Thread::send_boxed`]).
///
/// # Safety
/// `thread` must be a live SPDK thread, and `m` must be safe to use on it (it only touches
/// there what belongs to that thread).
unsafe fn send_boxed<M: Message>(thread: *mut sys::spdk_thread, m: Box<M>) -> Result<(), Box<M>> {
    let ctx = Box::into_raw(m);
    // SAFETY: `thread` is live (contract); `arrive::<M>` takes the box back.
    let rc = unsafe { sys::spdk_thread_send_msg(thread, Some(arrive::<M>), ctx.cast()) };
    if rc != 0 {
        // SAFETY: not queued: still ours.
        return Err(unsafe { Box::from_raw(ctx) });
    }
    Ok(())
}

/// A timed poller: runs its closure every period on the thread that started it, until
/// dropped (on that thread: it is neither `Send` nor `Sync`). Between its runs it costs the
/// reactor nothing but SPDK's look at its timer list.
pub struct Ticker {
    poller: *mut sys::spdk_poller,
    ctx: *mut Box<dyn FnMut()>,
}

impl std::fmt::Debug for Ticker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticker").finish_non_exhaustive()
    }
}

/// Starts a [`Ticker`] on the calling SPDK thread running `f` every `period` (at least one
/// microsecond); `None` if SPDK refused a poller.
pub fn every(period: std::time::Duration, name: &CStr, f: Box<dyn FnMut()>) -> Option<Ticker> {
    let ctx = Box::into_raw(Box::new(f));
    let us = (period.as_micros() as u64).max(1);
    // SAFETY: `run_ticker` gets the leaked closure, live until the ticker drops (after it
    // unregistered the poller); SPDK copies `name`.
    let poller =
        unsafe { sys::spdk_poller_register_named(Some(run_ticker), ctx.cast(), us, name.as_ptr()) };
    if poller.is_null() {
        // SAFETY: no poller refers to it: still only ours.
        drop(unsafe { Box::from_raw(ctx) });
        return None;
    }
    Some(Ticker { poller, ctx })
}

unsafe extern "C" fn run_ticker(ctx: *mut c_void) -> c_int {
    // SAFETY: `ctx` is the closure `every` leaked, live while its poller is registered; SPDK
    // runs a poller on its own thread only, never reentrantly.
    let f = unsafe { &mut *ctx.cast::<Box<dyn FnMut()>>() };
    f();
    POLLER_IDLE
}

impl Drop for Ticker {
    fn drop(&mut self) {
        // SAFETY: registered by `every` on this thread (the type cannot leave it) and
        // unregistered once, here; SPDK calls it no more, so its closure can go.
        unsafe {
            sys::spdk_poller_unregister(&mut self.poller);
            drop(Box::from_raw(self.ctx));
        }
    }
}
