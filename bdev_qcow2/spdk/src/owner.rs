//! The metadata owner of a writable bdev: the one writable instance of the image (allocator,
//! dirty L2 slices and refcount blocks), its executor and base channels, all on the md thread
//! (the thread that created the bdev), driven by the owner's poller.
//!
//! Only one writable instance may exist per image, and a per-thread replica would read stale
//! metadata after a write on another thread, so every channel of a writable bdev forwards
//! every request it cannot serve itself to the owner. The owner runs it on its chain with
//! the bdev_io's own iovecs and sends the completion back to the submitting thread, which
//! completes the bdev_io there (SPDK requires completion on the submitting thread). The
//! status travels in the bdev_io's driver context ([`IoCtx`]).
//!
//! Both ways, requests travel in [`Batch`]es: bdev_ios linked through their driver context
//! (no allocation), one `spdk_thread_send_msg` per batch. A channel's poller sends what its
//! thread forwarded since its last pass, the owner's poller what it completed for each
//! thread. A thread runs at most eight messages per poll (SPDK's batch), so one message per
//! request would move at most eight requests per poll each way, however many are in flight;
//! a batch moves all of them, with one message's cost (4 KiB random writes into a fresh
//! image with 4 KiB clusters, where every write goes to the owner and back, on 2 cores:
//! 1.03-1.20x the IOPS of one message per request; on 1 core within the machine's noise).
//!
//! Requests submitted on the md thread itself skip both messages.
//!
//! As on a read-only channel, base completions are delivered into the owner's executor from
//! SPDK's callback ([`deliver`]), so a fast-path request (an overwrite of an allocated
//! cluster, a cached read) completes without waiting for the owner's poller; the poller
//! drives the slow paths.

use crate::channel;
use crate::device::{IovView, SpdkDevice};
use crate::ffi::bdev_io::BdevIo;
use crate::ffi::sys;
use crate::ffi::thread::{self, Poller, POLLER_BUSY, POLLER_IDLE};
use crate::node::{Node, BLOCK_SIZE};
use qcow2_engine::io::DeviceError;
use qcow2_engine::{Chain, DevId, Exec};
use std::cell::{Cell, RefCell};
use std::ffi::{c_int, c_void};
use std::rc::Rc;

/// The module's per-I/O context (SPDK reserves `get_ctx_size` bytes in every bdev_io).
#[repr(C)]
pub struct IoCtx {
    /// `SPDK_BDEV_IO_STATUS_*` of a forwarded request, on its way back.
    pub status: sys::spdk_bdev_io_status,
    /// Grace-period entry of a request on the direct path (`channel::submit_direct`).
    pub parity: u8,
    /// The channel state a channel's direct-path request belongs to, so its completion
    /// (`channel::chan_direct_done`) finds it without asking SPDK.
    pub chan: *const std::ffi::c_void,
    /// A forwarded write the channel's replica routed as `WriteRoute::Owner { slow: true }`:
    /// the owner skips its direct path (set by every `forward`).
    pub slow: bool,
    /// The next request of the [`Batch`] this one travels in.
    pub next: *mut sys::spdk_bdev_io,
}

/// Requests on their way to one thread, linked through [`IoCtx::next`]; sent as one
/// message. Empty: both ends null.
#[derive(Clone, Copy)]
pub struct Batch {
    head: *mut sys::spdk_bdev_io,
    tail: *mut sys::spdk_bdev_io,
}

impl Batch {
    /// No requests.
    pub const EMPTY: Batch = Batch {
        head: std::ptr::null_mut(),
        tail: std::ptr::null_mut(),
    };

    /// Whether it holds no request.
    pub fn is_empty(&self) -> bool {
        self.head.is_null()
    }

    /// Appends `io` (ours until it is completed, and in no other batch).
    pub fn push(&mut self, io: BdevIo) {
        // SAFETY: as in `set_status`.
        unsafe { (*ctx(io)).next = std::ptr::null_mut() };
        // SAFETY: the tail, if any, is a live request of this batch.
        match unsafe { BdevIo::from_raw(self.tail) } {
            // SAFETY: as in `set_status`.
            Some(t) => unsafe { (*ctx(t)).next = io.raw() },
            None => self.head = io.raw(),
        }
        self.tail = io.raw();
    }

    /// Sends the batch to `thread`, where `f` gets its first request; empties it unless
    /// SPDK's message pool is empty (then it stays, to be sent again). Whether it went.
    ///
    /// # Safety
    /// `thread` is live, and `f` takes the batch's requests over (see [`Batch::take`]).
    pub unsafe fn send(
        &mut self,
        thread: *mut sys::spdk_thread,
        f: unsafe extern "C" fn(*mut c_void),
    ) -> bool {
        // SAFETY: per the contract; the requests stay ours until `f` runs.
        if unsafe { thread::send_raw(thread, f, self.head.cast()) }.is_err() {
            return false;
        }
        *self = Batch::EMPTY;
        true
    }

    /// Calls `f` on each request of the batch that starts at `head` (a message's context),
    /// in order. `f` may complete the request: its successor is read first.
    ///
    /// # Safety
    /// `head` comes from a [`Batch::send`] and is taken once.
    pub unsafe fn take(head: *mut c_void, mut f: impl FnMut(BdevIo)) {
        let mut p = head.cast::<sys::spdk_bdev_io>();
        // SAFETY: per the contract, every request of the batch is live and ours.
        while let Some(io) = unsafe { BdevIo::from_raw(p) } {
            // SAFETY: as in `set_status`.
            p = unsafe { (*ctx(io)).next };
            f(io);
        }
    }
}

/// What happens once the owner closed (metadata flushed), on the md thread.
/// What follows a close: gets the owner's final read-ahead and slice-cache counters.
type Then = Box<dyn FnOnce(OwnerCounters)>;

/// The owner's read-ahead and slice-cache counters.
pub type OwnerCounters = (
    qcow2_engine::prefetch::PrefetchStats,
    qcow2_engine::cache::CacheStats,
);
/// The close task's result: `None` while it runs, then whether the flush succeeded.
type Closed = Rc<Cell<Option<bool>>>;

/// The writable image and everything that drives it. Lives on the md thread only.
pub struct Owner {
    exec: Exec<SpdkDevice>,
    /// The base device for the direct path.
    direct: Option<crate::device::DirectTarget>,
    chain: Rc<Chain<SpdkDevice>>,
    poller: RefCell<Option<Poller>>,
    /// Completed requests on their way back, one batch per thread (sent by the poller;
    /// kept for the next poll when SPDK's message pool is empty).
    outboxes: RefCell<Vec<(*mut sys::spdk_thread, Batch)>>,
    /// Requests forwarded by other threads in this poll's batch of messages, run by the
    /// poller right after the batch: each message only prefetches its L2 entry, so the
    /// batch's cache misses overlap instead of stalling one request after another.
    arrived: RefCell<Vec<BdevIo>>,
    /// Answers to channels' slice requests SPDK could not queue yet (see `channel.rs`).
    unsent_asks: RefCell<Vec<*mut c_void>>,
    /// `Some` once closing: the close task's result (`None` while it runs) and what follows.
    closing: RefCell<Option<(Closed, Then)>>,
    /// Set while the owner runs engine code: a base completion arriving then is left for
    /// the poller (see [`deliver`]).
    in_engine: Cell<bool>,
    /// Polls so far: the quiet write-back's test runs on one poll in
    /// [`WRITEBACK_TEST_EVERY`].
    polls: Cell<u32>,
}

/// How often (in polls) the owner asks whether dirty metadata waited long enough for a
/// background write-back: its interval is milliseconds, a poll takes well under one
/// microsecond, and asking on every poll cost a few per cent of the owner's time while an
/// image fills.
const WRITEBACK_TEST_EVERY: u32 = 16;

impl Owner {
    /// Starts the owner of `chain` (whose devices `devs` belong to `exec`) on the calling
    /// thread, the md thread. Returns a pointer freed by [`Owner::close`], or `None` if SPDK
    /// refused a poller.
    pub fn start(
        exec: Exec<SpdkDevice>,
        chain: Rc<Chain<SpdkDevice>>,
        devs: impl IntoIterator<Item = DevId>,
    ) -> Option<*mut Owner> {
        let devs: Vec<DevId> = devs.into_iter().collect();
        // The top image's device (the base) comes first.
        let direct = devs
            .first()
            .map(|&d| exec.with_device(d, |dev| dev.direct_target(d)));
        let o = Box::into_raw(Box::new(Owner {
            exec,
            direct,
            chain,
            poller: RefCell::new(None),
            outboxes: RefCell::new(Vec::new()),
            arrived: RefCell::new(Vec::with_capacity(64)),
            unsent_asks: RefCell::new(Vec::new()),
            closing: RefCell::new(None),
            in_engine: Cell::new(false),
            polls: Cell::new(0),
        }));
        for d in devs {
            // SAFETY: `o` is boxed (stable address) and owns the executor that owns the
            // device; a device dropped with operations in flight clears its sink.
            unsafe { (*o).exec.with_device(d, |d| d.set_sink(deliver, o.cast())) };
        }
        // SAFETY: `o` stays alive until `owner_poll` frees it after unregistering.
        match unsafe { Poller::register(owner_poll, o.cast(), 0, c"qcow2_owner") } {
            Some(p) => {
                // SAFETY: `o` is live and only ours.
                unsafe { *(*o).poller.borrow_mut() = Some(p) };
                Some(o)
            }
            None => {
                // SAFETY: no poller refers to it.
                drop(unsafe { Box::from_raw(o) });
                None
            }
        }
    }

    /// Flushes the metadata (`Chain::close`: refcounts, dirty bit), then frees the owner and
    /// calls `then`, on the md thread. Every forwarded request has completed (the node's
    /// channels are gone).
    ///
    /// # Safety
    /// `owner` comes from [`Owner::start`] and is closed once, on the md thread.
    pub unsafe fn close(owner: *mut Owner, then: impl FnOnce(OwnerCounters) + 'static) {
        // SAFETY: per the contract.
        let o = unsafe { &*owner };
        let result: Closed = Rc::new(Cell::new(None));
        let (r2, chain) = (result.clone(), o.chain.clone());
        o.exec.spawn(async move {
            let r = chain.close().await;
            if let Err(e) = &r {
                tracing::error!("flushing the image's metadata failed: {e}");
            }
            r2.set(Some(r.is_ok()));
        });
        *o.closing.borrow_mut() = Some((result, Box::new(then)));
    }

    /// The owner's counters for `bdev_qcow2_get_stats`: clusters allocated, write-backs,
    /// and its own slice cache (the md thread serves the allocating writes).
    pub fn stats_json(&self) -> serde_json::Value {
        match self.chain.layers().first() {
            Some(qcow2_engine::Layer::Qcow2(q)) => {
                let s = q.owner_stats().unwrap_or_default();
                let (p, c) = self.cache_stats();
                serde_json::json!({
                    "clusters_allocated": s.clusters_allocated,
                    "writes_planned_now": s.writes_planned_now,
                    "l2_slices_written": s.l2_slices_written,
                    "writebacks": s.writebacks,
                    "zeroed_tail_raises": s.zeroed_tail_raises,
                    "l2_cache_hits": c.hits,
                    "l2_cache_misses": c.misses,
                    "l2_cache_evictions": c.evictions,
                    "prefetch_streams": p.streams,
                    "prefetch_issued": p.issued,
                    "prefetch_loaded": p.loaded,
                    "prefetch_hits": p.hits,
                })
            }
            _ => serde_json::Value::Null,
        }
    }

    /// The owner's read-ahead and slice-cache counters.
    pub fn cache_stats(&self) -> OwnerCounters {
        let c = match self.chain.layers().first() {
            Some(qcow2_engine::Layer::Qcow2(q)) => q.l2_cache_stats(),
            _ => Default::default(),
        };
        (self.chain.prefetch_stats(), c)
    }

    /// Keeps an answered slice request to send again on the next poll (message pool empty).
    pub fn defer_ask(&self, a: *mut c_void) {
        self.unsent_asks.borrow_mut().push(a);
    }

    /// Answers a channel's replica asking for slice `key` (ARCHITECTURE.md §6). On the md thread.
    pub fn slice_for_core(&self, key: u64) -> qcow2_engine::coherency::SliceReply {
        match self.chain.layers().first() {
            Some(qcow2_engine::Layer::Qcow2(q)) => q.slice_for_core(key),
            _ => qcow2_engine::coherency::SliceReply::Retry,
        }
    }

    /// Runs `f` marked as inside the engine (nests: restores the previous mark).
    fn in_engine<R>(&self, f: impl FnOnce() -> R) -> R {
        let prev = self.in_engine.replace(true);
        let r = f();
        self.in_engine.set(prev);
        r
    }

    /// Runs `io` (submitted to a writable bdev) on the owner's chain. On the md thread.
    fn submit(&self, io: BdevIo) {
        self.in_engine(|| self.submit_inner(io));
    }

    fn submit_inner(&self, io: BdevIo) {
        let bs = u64::from(BLOCK_SIZE);
        let (off, len) = (io.offset_blocks() * bs, io.num_blocks() * bs);
        let c = &self.chain;
        match io.io_type() {
            sys::SPDK_BDEV_IO_TYPE_READ | sys::SPDK_BDEV_IO_TYPE_WRITE => {
                c.read_ahead(off, len);
                // SAFETY: as in `set_status`; `forward` set the flag.
                let slow = unsafe { (*ctx(io)).slow };
                let write = io.io_type() == sys::SPDK_BDEV_IO_TYPE_WRITE;
                let target = self.direct.as_ref();
                let what = (off, len, write, true);
                if !slow
                    && channel::submit_direct(c, &self.exec, target, io, what, owner_direct_done)
                {
                    return;
                }
                // SAFETY: the bdev_io is completed only after the engine reported the
                // request done.
                let buf = unsafe { IovView::guest_buf(io) };
                if io.io_type() == sys::SPDK_BDEV_IO_TYPE_READ {
                    c.submit_read(io.tag(), off, buf);
                } else if slow {
                    c.submit_write_slow(io.tag(), off, buf);
                } else {
                    c.submit_write(io.tag(), off, buf);
                }
            }
            sys::SPDK_BDEV_IO_TYPE_WRITE_ZEROES => c.submit_write_zeroes(io.tag(), off, len, false),
            sys::SPDK_BDEV_IO_TYPE_UNMAP => c.submit_discard(io.tag(), off, len),
            sys::SPDK_BDEV_IO_TYPE_FLUSH => c.submit_flush(io.tag()),
            _ => done(io, sys::SPDK_BDEV_IO_STATUS_FAILED),
        }
    }
}

/// The module's context in `io`'s driver context area.
fn ctx(io: BdevIo) -> *mut IoCtx {
    io.driver_ctx().cast()
}

fn set_status(io: BdevIo, status: sys::spdk_bdev_io_status) {
    // SAFETY: the driver context has room for an `IoCtx` (`module::get_ctx_size`) and is
    // cache-line aligned; the bdev_io is ours until completed.
    unsafe { (*ctx(io)).status = status };
}

/// The owner of the writable bdev behind `io`.
fn owner_of(io: BdevIo) -> *mut Owner {
    // SAFETY: bdev_ios reaching us belong to our registered bdevs, whose `ctxt` is the node;
    // `owner` is immutable after registration.
    unsafe { (*io.bdev_ctxt().cast::<Node>()).owner }
}

/// Hands `io` to the owner of its (writable) bdev: directly on the md thread, else into
/// `outbox`, the batch its channel's poller sends ([`send_forwarded`]). The caller counted
/// it as outstanding on its channel. `slow`: a write its channel routed as
/// `WriteRoute::Owner { slow: true }` (the owner skips its direct path).
pub fn forward(md_thread: *mut sys::spdk_thread, io: BdevIo, slow: bool, outbox: &Cell<Batch>) {
    let slow = slow && io.io_type() == sys::SPDK_BDEV_IO_TYPE_WRITE;
    // SAFETY: as in `set_status`.
    unsafe { (*ctx(io)).slow = slow };
    if thread::current() == md_thread {
        // SAFETY: on the md thread; the owner lives while the bdev has channels.
        return unsafe { (*owner_of(io)).submit(io) };
    }
    let mut b = outbox.get();
    b.push(io);
    outbox.set(b);
}

/// Sends a channel's forwarded requests to the md thread as one message; they stay for
/// the next poll when SPDK's message pool is empty. Whether it sent any.
pub fn send_forwarded(md_thread: *mut sys::spdk_thread, outbox: &Cell<Batch>) -> bool {
    let mut b = outbox.get();
    if b.is_empty() {
        return false;
    }
    // SAFETY: the md thread lives as long as the bdev; `fwd_submit` takes the batch.
    let sent = unsafe { b.send(md_thread, fwd_submit) };
    outbox.set(b);
    sent
}

unsafe extern "C" fn fwd_submit(ctx: *mut c_void) {
    // SAFETY: `send_forwarded` sent a batch of live bdev_ios of a writable bdev.
    unsafe { Batch::take(ctx, arrive) };
}

/// A forwarded request arriving on the md thread: its L2 entry is prefetched, and the
/// owner's poller runs it with the others of this poll.
fn arrive(io: BdevIo) {
    // SAFETY: on the md thread; the owner lives while the bdev has channels (and its
    // poller runs `arrived` before the owner can close: closing waits for the channels).
    let o = unsafe { &*owner_of(io) };
    if matches!(
        io.io_type(),
        sys::SPDK_BDEV_IO_TYPE_READ | sys::SPDK_BDEV_IO_TYPE_WRITE
    ) {
        let off = io.offset_blocks() * u64::from(BLOCK_SIZE);
        if let Some(p) = o.chain.entry_hint(off) {
            channel::prefetch_line(p.cast());
        }
        if io.io_type() == sys::SPDK_BDEV_IO_TYPE_WRITE {
            if let Some(p) = o.chain.dirty_entry_hint(off) {
                channel::prefetch_line(p.cast());
            }
        }
    }
    o.arrived.borrow_mut().push(io);
}

/// Completion of a request the owner sent down the direct path.
unsafe extern "C" fn owner_direct_done(
    child: *mut sys::spdk_bdev_io,
    success: bool,
    arg: *mut c_void,
) {
    // SAFETY: per SPDK's completion contract.
    let Some((io, parity)) = (unsafe { channel::direct_completed(child, arg) }) else {
        return;
    };
    // SAFETY: on the md thread; the owner lives while the bdev has I/O.
    unsafe { (*owner_of(io)).exec.guest_exit(parity) };
    done(
        io,
        if success {
            sys::SPDK_BDEV_IO_STATUS_SUCCESS
        } else {
            sys::SPDK_BDEV_IO_STATUS_FAILED
        },
    );
}

/// A request finished on the owner: back to its thread, in that thread's batch (the
/// owner's poller sends it).
fn done(io: BdevIo, status: sys::spdk_bdev_io_status) {
    set_status(io, status);
    let t = io.thread();
    if t == thread::current() {
        return channel::complete_forwarded(io);
    }
    // SAFETY: only the md thread touches the owner, live while the bdev has I/O.
    let mut boxes = unsafe { (*owner_of(io)).outboxes.borrow_mut() };
    match boxes.iter_mut().find(|(to, _)| *to == t) {
        Some((_, b)) => b.push(io),
        None => {
            let mut b = Batch::EMPTY;
            b.push(io);
            boxes.push((t, b));
        }
    }
}

unsafe extern "C" fn fwd_done(ctx: *mut c_void) {
    // SAFETY: `Owner::send_done` sent a batch of live bdev_ios, on their own thread now.
    unsafe { Batch::take(ctx, channel::complete_forwarded) };
}

impl Owner {
    /// Sends each thread its batch of completed requests. Returns how many batches went.
    fn send_done(&self) -> usize {
        let mut n = 0;
        for (t, b) in self.outboxes.borrow_mut().iter_mut() {
            // SAFETY: the submitting thread lives while its channel (holding these
            // requests) does; `fwd_done` takes the batch.
            if !b.is_empty() && unsafe { b.send(*t, fwd_done) } {
                n += 1;
            }
        }
        n
    }
}

/// The status a forwarded request carries back.
pub fn status_of(io: BdevIo) -> sys::spdk_bdev_io_status {
    // SAFETY: as in `set_status`.
    unsafe { (*ctx(io)).status }
}

/// Sends back the request the engine reported done under `tag`.
fn complete_tag(tag: u64, r: qcow2_engine::Result<()>) {
    // SAFETY: tags are bdev_ios we submitted to the engine and have not completed.
    if let Some(io) = unsafe { BdevIo::from_tag(tag) } {
        let status = match &r {
            Ok(()) => sys::SPDK_BDEV_IO_STATUS_SUCCESS,
            Err(e) => {
                tracing::debug!("request failed: {e}");
                sys::SPDK_BDEV_IO_STATUS_FAILED
            }
        };
        done(io, status);
    }
}

/// The owner's devices' [`CompletionSink`](crate::device::CompletionSink): delivers a base
/// completion into the executor from SPDK's callback and sends back the requests it
/// finished, unless the owner is inside the engine (then the poller does).
///
/// # Safety
/// `ctx` is the live owner whose executor holds the device (see [`Owner::start`]).
unsafe fn deliver(ctx: *mut c_void, tag: u64, r: Result<(), DeviceError>) -> bool {
    // SAFETY: per the contract.
    let o = unsafe { &*ctx.cast::<Owner>() };
    if o.in_engine.get() {
        return false;
    }
    o.in_engine(|| {
        o.exec.device_completed(tag, r);
        o.exec.take_completions(&mut complete_tag);
    });
    true
}

unsafe extern "C" fn owner_poll(ctx: *mut c_void) -> c_int {
    let op = ctx.cast::<Owner>();
    // SAFETY: the poller's context is the live owner (freed only below, after unregistering).
    let o = unsafe { &*op };
    let mut n = 0;
    if !o.arrived.borrow().is_empty() {
        let arrived = std::mem::take(&mut *o.arrived.borrow_mut());
        for io in arrived.iter() {
            n += 1;
            o.submit(*io);
        }
        // Keep the vector's capacity (no allocation per batch).
        let mut a = arrived;
        a.clear();
        if o.arrived.borrow().is_empty() {
            *o.arrived.borrow_mut() = a;
        }
    }
    let asks = std::mem::take(&mut *o.unsent_asks.borrow_mut());
    for a in asks {
        n += 1;
        // SAFETY: deferred by `channel::send_ask` with its answer.
        unsafe { channel::resend_ask(a) };
    }
    // Dirty metadata that waited long enough for a flush goes back on its own, so the
    // cores take overwrites into its slices again (see `tick_background_writeback`).
    let polls = o.polls.get().wrapping_add(1);
    o.polls.set(polls);
    if polls.is_multiple_of(WRITEBACK_TEST_EVERY)
        && o.in_engine(|| o.chain.tick_background_writeback())
    {
        n += 1;
    }
    if o.exec.busy() {
        n += o.in_engine(|| o.exec.poll(&mut complete_tag));
    }
    // Last: what this poll and the base completions since the last one finished.
    n += o.send_done();
    let closed = o
        .closing
        .borrow()
        .as_ref()
        .is_some_and(|(r, _)| r.get().is_some())
        && !o.exec.busy()
        && o.arrived.borrow().is_empty()
        && o.outboxes.borrow().iter().all(|(_, b)| b.is_empty())
        && o.unsent_asks.borrow().is_empty();
    if closed {
        if let Some(p) = o.poller.borrow_mut().as_mut() {
            p.unregister();
        }
        // SAFETY: closed, idle and unregistered: the last use of the owner. Dropping it puts
        // the md thread's base channels back before `then` closes the descriptors.
        let o = unsafe { Box::from_raw(op) };
        let then = o.closing.borrow_mut().take().map(|(_, t)| t);
        let counters = o.cache_stats();
        drop(o);
        if let Some(t) = then {
            t(counters);
        }
        return POLLER_BUSY;
    }
    if n > 0 {
        POLLER_BUSY
    } else {
        POLLER_IDLE
    }
}
