//! The per-core executor: drives slow paths written as `async fn`s and the devices they use.
//!
//! One `Exec` per core (SPDK thread / reactor). Everything in it is single-threaded
//! (`Rc`/`RefCell`), so nothing here locks. Tasks are woken only by their own device
//! completions, which arrive when the host calls [`Exec::poll`]; no waker machinery is
//! needed (tasks are polled with a no-op waker).
//!
//! Guest requests complete through a queue that [`Exec::poll`] drains into the host's
//! callback, so hot paths (cache-hit reads) submit device I/O directly without a task.

use crate::error::{Error, Result};
use crate::io::{BlockDevice, BufSlice, Busy, DeviceError, DeviceOp, IoBuffer, SECTOR};
use slab::Slab;
use std::cell::{Cell, OnceCell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

/// Index of a device registered with an [`Exec`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DevId(pub usize);

type Task = Pin<Box<dyn Future<Output = ()>>>;

/// Who waits for a device operation.
enum Waiter {
    /// A task; the result is parked here until the task polls it.
    Task {
        task: usize,
        result: Option<Result<(), DeviceError>>,
    },
    /// A guest request on the fast path.
    Request(usize),
    /// A fast-path request of exactly one device operation: (tag, grace entry, whether
    /// the engine's sink hears of it rather than the host: [`Exec::add_internal_sink`]).
    Single(u64, GraceEntry, bool),
}

/// A guest request split into several device operations on the fast path.
struct Request {
    tag: u64,
    remaining: u32,
    error: Option<Error>,
    /// The guest request's grace entry ([`Exec::guest_enter`]).
    entry: GraceEntry,
    /// The engine's own request (a read-ahead): its end goes to the internal sink.
    internal: bool,
}

/// Where the engine hears of its own fast-path requests' ends ([`Exec::add_internal_sink`]):
/// called with (the payload of the request's token, success).
pub type InternalSink = Rc<dyn Fn(u32, bool)>;

/// Bits of an internal request's token below the sink's number ([`SinkId::token`]).
pub const SINK_SHIFT: u32 = 48;
/// Bits of an internal request's token below the sink's generation: the payload's.
const SINK_GEN_SHIFT: u32 = 32;

/// A sink added to an executor ([`Exec::add_internal_sink`]): its number and the
/// generation of that number, so that a request still in flight for a sink removed since
/// is dropped when it ends rather than reaching a later sink of the same number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SinkId {
    index: u16,
    gen: u16,
}

impl SinkId {
    /// The token of an internal request whose end this sink hears of with `payload`.
    #[inline(always)]
    pub fn token(self, payload: u32) -> u64 {
        (self.index as u64) << SINK_SHIFT | (self.gen as u64) << SINK_GEN_SHIFT | payload as u64
    }

    fn of(token: u64) -> (SinkId, u32) {
        let id = SinkId {
            index: (token >> SINK_SHIFT) as u16,
            gen: (token >> SINK_GEN_SHIFT) as u16,
        };
        (id, token as u32)
    }
}

/// A sink that leaves its executor's table when dropped: held by what it reports to (a
/// chain), so that a chain rebuilt on the same core leaves no dead sink behind.
pub(crate) struct OwnedSink<D: BlockDevice> {
    exec: Exec<D>,
    id: SinkId,
}

impl<D: BlockDevice> OwnedSink<D> {
    /// Adds `sink` to `exec` ([`Exec::add_internal_sink`]).
    pub(crate) fn add(exec: &Exec<D>, sink: InternalSink) -> Self {
        OwnedSink {
            exec: exec.clone(),
            id: exec.add_internal_sink(sink),
        }
    }

    /// Its id.
    pub(crate) fn id(&self) -> SinkId {
        self.id
    }
}

impl<D: BlockDevice> Drop for OwnedSink<D> {
    fn drop(&mut self) {
        self.exec.remove_internal_sink(self.id);
    }
}

/// One entry of the executor's sink table: a number free while `sink` is `None`, reused
/// under the next generation.
struct SinkEntry {
    sink: Option<InternalSink>,
    gen: u16,
}

/// A guest request's entry into its core's grace period ([`Exec::guest_enter`]): neither
/// `Copy` nor `Clone`, and ended by passing it to [`Exec::guest_exit`] (or to what exits
/// for it: a request record, [`Exec::complete_entered`], [`Exec::hand_to_owner`]) once the
/// request can no longer use a mapping it resolved. A freed cluster is not reused while
/// an entry of its generation is open (`coherency::Grace`).
#[must_use = "a grace entry ends only in Exec::guest_exit"]
#[derive(Debug, PartialEq, Eq)]
pub struct GraceEntry(Entered);

/// Which of its core's two counters a request entered under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Entered {
    Even = 0,
    Odd = 1,
    /// The image is not shared: no grace period to enter.
    Unshared = 2,
}

impl GraceEntry {
    /// The entry of a request on an image no other core shares: its exit does nothing.
    pub fn unshared() -> GraceEntry {
        GraceEntry(Entered::Unshared)
    }

    /// The entry into a shared image's grace period under counter `parity` (0 or 1).
    #[inline(always)]
    pub(crate) fn of_parity(parity: u8) -> GraceEntry {
        GraceEntry(if parity & 1 == 0 {
            Entered::Even
        } else {
            Entered::Odd
        })
    }
}

/// How a guest request the engine ran ended ([`Exec::poll_outcomes`]).
#[derive(Debug)]
pub enum Outcome {
    /// It completed, with this result.
    Done(Result<()>),
    /// A core replica found the request is not its to run (a write that is not in place
    /// there) and changed nothing: the host sends it to the metadata owner.
    ToOwner,
}

impl Outcome {
    /// The outcome of a request no core replica's write path ran (the only path that
    /// hands requests to the owner): its result, a hand-over being the host's bug
    /// ([`Error::InvalidRequest`]).
    #[inline(always)]
    pub fn into_result(self) -> Result<()> {
        match self {
            Outcome::Done(r) => r,
            Outcome::ToOwner => Err(Error::InvalidRequest(
                "a request was handed to the owner outside a core's write path",
            )),
        }
    }
}

/// Per-operation counters.
#[derive(Debug, Default, Clone, Copy)]
pub struct ExecStats {
    /// Device operations submitted.
    pub device_ops: u64,
    /// Submissions refused as busy and retried later.
    pub busy_retries: u64,
    /// Tasks spawned (slow paths).
    pub tasks_spawned: u64,
}

/// A submission the device refused as busy, to retry: device, operation, tag.
type Queued<D> = (DevId, DeviceOp<<D as BlockDevice>::Buf>, u64);

struct Inner<D: BlockDevice> {
    devs: RefCell<Vec<D>>,
    waiters: RefCell<Slab<Waiter>>,
    requests: RefCell<Slab<Request>>,
    retry: RefCell<VecDeque<Queued<D>>>,
    tasks: RefCell<Slab<Option<Task>>>,
    ready: RefCell<VecDeque<usize>>,
    current: Cell<Option<usize>>,
    done: RefCell<VecDeque<(u64, Outcome)>>,
    /// Reused scratch for reaped completions (no allocation per poll).
    reaped: RefCell<Vec<(u64, Result<(), DeviceError>)>>,
    /// The engine's own requests that ended: (token, success), handed to `sink` by
    /// [`Exec::take_outcomes`] (so never inside a submission).
    internal: RefCell<VecDeque<(u64, bool)>>,
    /// Indexed by a token's bits from [`SINK_SHIFT`] up.
    sinks: RefCell<Vec<SinkEntry>>,
    stats: Cell<ExecStats>,
    /// This core's membership in a shared image's grace periods.
    /// (shared state, member slot, whether its entries need no full fence: the owner's, or
    /// a core's with the asymmetric pair; see `Grace::enter_as`). Set once: every guest
    /// request reads it, without a borrow flag.
    grace: OnceCell<(std::sync::Arc<crate::coherency::Shared>, usize, bool)>,
}

impl<D: BlockDevice> Drop for Inner<D> {
    fn drop(&mut self) {
        if let Some((sh, slot, _)) = self.grace.take() {
            sh.grace.unregister(slot);
        }
    }
}

/// A per-core executor (cheap to clone: a shared handle).
pub struct Exec<D: BlockDevice> {
    inner: Rc<Inner<D>>,
}

impl<D: BlockDevice> Clone for Exec<D> {
    fn clone(&self) -> Self {
        Exec {
            inner: self.inner.clone(),
        }
    }
}

impl<D: BlockDevice> Default for Exec<D> {
    fn default() -> Self {
        Self::new()
    }
}

impl<D: BlockDevice> Exec<D> {
    /// An executor with no devices.
    pub fn new() -> Self {
        Exec {
            inner: Rc::new(Inner {
                devs: RefCell::new(Vec::new()),
                waiters: RefCell::new(Slab::with_capacity(256)),
                requests: RefCell::new(Slab::with_capacity(256)),
                retry: RefCell::new(VecDeque::new()),
                tasks: RefCell::new(Slab::with_capacity(64)),
                ready: RefCell::new(VecDeque::with_capacity(64)),
                current: Cell::new(None),
                done: RefCell::new(VecDeque::with_capacity(256)),
                reaped: RefCell::new(Vec::with_capacity(256)),
                internal: RefCell::new(VecDeque::with_capacity(256)),
                sinks: RefCell::new(Vec::new()),
                stats: Cell::new(ExecStats::default()),
                grace: OnceCell::new(),
            }),
        }
    }

    /// Makes this core a member of `shared`'s grace periods (see
    /// [`Grace`](crate::coherency::Grace)); false when every member slot is taken. Once a
    /// member, every guest request must enter ([`guest_enter`](Self::guest_enter)) before it
    /// resolves a mapping and exit when it completes. `owner`: this is the metadata owner's
    /// executor, on the thread that advances the grace periods (its entries need no fence:
    /// see [`Grace::enter_owner`](crate::coherency::Grace::enter_owner)).
    pub fn join_grace(
        &self,
        shared: std::sync::Arc<crate::coherency::Shared>,
        owner: bool,
    ) -> bool {
        if self.inner.grace.get().is_some() {
            return true;
        }
        match shared.grace.register() {
            Some(slot) => {
                // Not set before (checked above; one thread): `set` succeeds.
                let light = owner || shared.grace.light_entries();
                let _ = self.inner.grace.set((shared, slot, light));
                true
            }
            None => false,
        }
    }

    /// A guest request starts (before it resolves any mapping): its grace entry.
    #[inline(always)]
    pub fn guest_enter(&self) -> GraceEntry {
        match self.inner.grace.get() {
            Some((sh, slot, light)) => GraceEntry::of_parity(sh.grace.enter_as(*slot, *light)),
            None => GraceEntry::unshared(),
        }
    }

    /// The guest request that entered with `entry` is over.
    #[inline]
    pub fn guest_exit(&self, entry: GraceEntry) {
        let parity = match entry.0 {
            Entered::Unshared => return,
            p => p as u8,
        };
        if let Some((sh, slot, _)) = self.inner.grace.get() {
            sh.grace.exit(*slot, parity);
        }
    }

    /// Completes a guest request that entered with `entry` (from a task or at once).
    pub fn complete_entered(&self, tag: u64, result: Result<()>, entry: GraceEntry) {
        self.guest_exit(entry);
        self.complete(tag, result);
    }

    /// Hands a guest request that entered with `entry`, and changed nothing, to the
    /// metadata owner: reported as [`Outcome::ToOwner`].
    pub fn hand_to_owner(&self, tag: u64, entry: GraceEntry) {
        self.guest_exit(entry);
        self.inner
            .done
            .borrow_mut()
            .push_back((tag, Outcome::ToOwner));
    }

    /// Registers a device; its completions are reaped by [`Exec::poll`].
    pub fn add_device(&self, dev: D) -> DevId {
        let mut devs = self.inner.devs.borrow_mut();
        devs.push(dev);
        DevId(devs.len() - 1)
    }

    /// Runs `f` on a registered device (e.g. to read its size or allocate a buffer).
    pub fn with_device<R>(&self, dev: DevId, f: impl FnOnce(&mut D) -> R) -> R {
        f(&mut self.inner.devs.borrow_mut()[dev.0])
    }

    /// Size of a registered device.
    pub fn device_size(&self, dev: DevId) -> u64 {
        self.with_device(dev, |d| d.size())
    }

    /// Allocates a zeroed DMA-able buffer from a device.
    pub fn alloc_buf(&self, dev: DevId, len: usize) -> D::Buf {
        self.with_device(dev, |d| d.alloc_buf(len))
    }

    /// Counters.
    pub fn stats(&self) -> ExecStats {
        self.inner.stats.get()
    }

    fn bump(&self, f: impl FnOnce(&mut ExecStats)) {
        let mut s = self.inner.stats.get();
        f(&mut s);
        self.inner.stats.set(s);
    }

    /// Submits now, or queues for retry when the device is busy (order is preserved).
    fn submit_raw(&self, dev: DevId, op: DeviceOp<D::Buf>, tag: u64) {
        self.bump(|s| s.device_ops += 1);
        let mut retry = self.inner.retry.borrow_mut();
        if !retry.is_empty() {
            retry.push_back((dev, op, tag));
            return;
        }
        if let Err(Busy(op, tag)) = self.inner.devs.borrow_mut()[dev.0].submit(op, tag) {
            self.bump(|s| s.busy_retries += 1);
            retry.push_back((dev, op, tag));
        }
    }

    /// Spawns a slow-path task; it first runs at the next [`Exec::poll`].
    pub fn spawn(&self, fut: impl Future<Output = ()> + 'static) {
        self.bump(|s| s.tasks_spawned += 1);
        let id = self.inner.tasks.borrow_mut().insert(Some(Box::pin(fut)));
        self.inner.ready.borrow_mut().push_back(id);
    }

    /// A future that performs one device operation and yields its result.
    pub fn io(&self, dev: DevId, op: DeviceOp<D::Buf>) -> IoFuture<D> {
        IoFuture {
            exec: self.clone(),
            state: IoState::Init(dev, op),
        }
    }

    /// Reads `buf.len` bytes at `offset` of `dev` into `buf`.
    pub fn read(&self, dev: DevId, offset: u64, buf: BufSlice<D::Buf>) -> IoFuture<D> {
        self.io(dev, DeviceOp::Read { offset, buf })
    }

    /// Adds a place where the engine hears of its own fast-path requests' ends (those
    /// started with `internal` set: a read-ahead into a chain's prefetch ring, a slice
    /// loaded ahead) and returns its id: internal requests whose token it made
    /// ([`SinkId::token`]) end there. Allocated once, here: an internal request allocates
    /// nothing. Takes the number of a removed sink if there is one (a rebuilt chain leaves
    /// nothing behind), under a new generation.
    pub fn add_internal_sink(&self, sink: InternalSink) -> SinkId {
        let mut sinks = self.inner.sinks.borrow_mut();
        if let Some(index) = sinks.iter().position(|e| e.sink.is_none()) {
            sinks[index].sink = Some(sink);
            return SinkId {
                index: index as u16,
                gen: sinks[index].gen,
            };
        }
        assert!(
            sinks.len() < 1 << 16,
            "more than 65536 internal sinks at once"
        );
        sinks.push(SinkEntry {
            sink: Some(sink),
            gen: 0,
        });
        SinkId {
            index: (sinks.len() - 1) as u16,
            gen: 0,
        }
    }

    /// Removes sink `id` (its owner is gone): the ends of its requests still in flight are
    /// dropped, and its number is free for the next [`add_internal_sink`](Self::add_internal_sink).
    pub fn remove_internal_sink(&self, id: SinkId) {
        let mut sinks = self.inner.sinks.borrow_mut();
        if let Some(e) = sinks.get_mut(id.index as usize) {
            if e.gen == id.gen && e.sink.is_some() {
                e.sink = None;
                e.gen = e.gen.wrapping_add(1);
            }
        }
    }

    /// Internal sinks added and not removed.
    pub fn internal_sinks(&self) -> usize {
        self.inner
            .sinks
            .borrow()
            .iter()
            .filter(|e| e.sink.is_some())
            .count()
    }

    /// An internal request of token `token` ended (`ok`): queues it for the sink. Also how
    /// the sink puts back one it cannot take now (it is re-offered at the next
    /// [`take_outcomes`](Self::take_outcomes)).
    pub(crate) fn internal_done(&self, token: u64, ok: bool) {
        self.inner.internal.borrow_mut().push_back((token, ok));
    }

    /// Starts a fast-path guest request: returns its id for [`Exec::request_read`] calls,
    /// then [`Exec::request_arm`] once every device operation is submitted.
    pub fn request_begin(&self, tag: u64) -> usize {
        self.request_begin_entered(tag, GraceEntry::unshared())
    }

    /// [`request_begin`](Self::request_begin) for a guest request that entered with
    /// `entry` ([`guest_enter`](Self::guest_enter)): it exits when it completes.
    pub fn request_begin_entered(&self, tag: u64, entry: GraceEntry) -> usize {
        self.request_begin_as(tag, entry, false)
    }

    /// [`request_begin_entered`](Self::request_begin_entered); `internal`: the engine's
    /// own request, whose end goes to the internal sink under token `tag`.
    pub(crate) fn request_begin_as(&self, tag: u64, entry: GraceEntry, internal: bool) -> usize {
        self.inner.requests.borrow_mut().insert(Request {
            internal,
            tag,
            // One extra reference held until `request_arm`, so early completions cannot
            // finish the request while it is still being built.
            remaining: 1,
            error: None,
            entry,
        })
    }

    /// Adds one device operation to a fast-path request.
    pub fn request_op(&self, req: usize, dev: DevId, op: DeviceOp<D::Buf>) {
        if let Some(r) = self.inner.requests.borrow_mut().get_mut(req) {
            r.remaining += 1;
        }
        let w = self.inner.waiters.borrow_mut().insert(Waiter::Request(req));
        self.submit_raw(dev, op, w as u64);
    }

    /// A fast-path guest request of one device operation (the common case): no request
    /// record, the operation's completion is the request's. `entry` as for
    /// [`request_begin_entered`](Self::request_begin_entered).
    pub fn request_single(&self, tag: u64, entry: GraceEntry, dev: DevId, op: DeviceOp<D::Buf>) {
        self.request_single_as(tag, entry, false, dev, op)
    }

    /// [`request_single`](Self::request_single); `internal` as for
    /// [`request_begin_as`](Self::request_begin_as).
    pub(crate) fn request_single_as(
        &self,
        tag: u64,
        entry: GraceEntry,
        internal: bool,
        dev: DevId,
        op: DeviceOp<D::Buf>,
    ) {
        let w = self
            .inner
            .waiters
            .borrow_mut()
            .insert(Waiter::Single(tag, entry, internal));
        self.submit_raw(dev, op, w as u64);
    }

    /// Drops the builder's reference; the request completes when its last op does.
    pub fn request_arm(&self, req: usize) {
        self.request_put(req, Ok(()));
    }

    fn request_put(&self, req: usize, res: Result<(), DeviceError>) {
        let mut reqs = self.inner.requests.borrow_mut();
        let Some(r) = reqs.get_mut(req) else { return };
        if let Err(e) = res {
            r.error.get_or_insert(Error::Io(e.0));
        }
        r.remaining -= 1;
        if r.remaining == 0 {
            let r = reqs.remove(req);
            drop(reqs);
            self.guest_exit(r.entry);
            if r.internal {
                return self.internal_done(r.tag, r.error.is_none());
            }
            self.inner
                .done
                .borrow_mut()
                .push_back((r.tag, Outcome::Done(r.error.map_or(Ok(()), Err))));
        }
    }

    /// Completes a guest request (from a task): reported by the next [`Exec::poll`].
    pub fn complete(&self, tag: u64, result: Result<()>) {
        self.inner
            .done
            .borrow_mut()
            .push_back((tag, Outcome::Done(result)));
    }

    /// [`poll_outcomes`](Self::poll_outcomes) for a host that submits no request a core
    /// replica may hand to the owner (see [`Outcome::into_result`]).
    pub fn poll(&self, done: &mut dyn FnMut(u64, Result<()>)) -> usize {
        self.poll_outcomes(&mut |tag, o| done(tag, o.into_result()))
    }

    /// Polls devices, runs woken tasks, and reports how guest requests ended to `done`.
    /// Returns the number of events processed (0 when idle). Never blocks.
    pub fn poll_outcomes(&self, done: &mut dyn FnMut(u64, Outcome)) -> usize {
        let mut events = 0;
        // Retry submissions the devices refused earlier, in order.
        loop {
            let Some((dev, op, tag)) = self.inner.retry.borrow_mut().pop_front() else {
                break;
            };
            if let Err(Busy(op, tag)) = self.inner.devs.borrow_mut()[dev.0].submit(op, tag) {
                self.inner.retry.borrow_mut().push_front((dev, op, tag));
                break;
            }
        }
        // Reap device completions.
        let ndev = self.inner.devs.borrow().len();
        let mut reaped = std::mem::take(&mut *self.inner.reaped.borrow_mut());
        for i in 0..ndev {
            let mut devs = self.inner.devs.borrow_mut();
            events += devs[i].poll(&mut |tag, res| reaped.push((tag, res)));
        }
        for (tag, res) in reaped.drain(..) {
            self.device_completed(tag, res);
        }
        *self.inner.reaped.borrow_mut() = reaped;
        // Run ready tasks.
        let mut cx = Context::from_waker(Waker::noop());
        loop {
            let Some(id) = self.inner.ready.borrow_mut().pop_front() else {
                break;
            };
            let fut = self
                .inner
                .tasks
                .borrow_mut()
                .get_mut(id)
                .and_then(Option::take);
            let Some(mut fut) = fut else { continue };
            events += 1;
            self.inner.current.set(Some(id));
            let r = fut.as_mut().poll(&mut cx);
            self.inner.current.set(None);
            let mut tasks = self.inner.tasks.borrow_mut();
            match r {
                Poll::Ready(()) => {
                    tasks.remove(id);
                }
                Poll::Pending => tasks[id] = Some(fut),
            }
        }
        // Report finished guest requests.
        events += self.take_outcomes(done);
        events
    }

    /// The id of the task being polled, if any.
    pub fn current_task(&self) -> Option<usize> {
        self.inner.current.get()
    }

    /// Makes task `id` runnable (spurious wake-ups are harmless: every future re-checks).
    pub fn wake(&self, id: usize) {
        self.inner.ready.borrow_mut().push_back(id);
    }

    /// Writes `buf` at `offset` of `dev`.
    pub fn write(&self, dev: DevId, offset: u64, buf: BufSlice<D::Buf>) -> IoFuture<D> {
        self.io(dev, DeviceOp::Write { offset, buf })
    }

    /// Makes `len` bytes of `dev` at `offset` read as zeros ([`DeviceOp::WriteZeroes`]).
    pub fn write_zeroes(&self, dev: DevId, offset: u64, len: u64) -> IoFuture<D> {
        self.io(dev, DeviceOp::WriteZeroes { offset, len })
    }

    /// Flushes `dev` (every completed write becomes stable).
    pub fn flush(&self, dev: DevId) -> IoFuture<D> {
        self.io(dev, DeviceOp::Flush)
    }

    /// Delivers one device completion (`tag` as given to the device's `submit`). Hosts whose
    /// device reports completions in a callback (SPDK) may call this from that callback,
    /// outside [`Exec::poll`]: a fast-path request then finishes at once and
    /// [`Exec::take_completions`] reports it without waiting for the next poll; a task is
    /// made ready and runs at the next poll.
    pub fn device_completed(&self, tag: u64, res: Result<(), DeviceError>) {
        let req = {
            let mut waiters = self.inner.waiters.borrow_mut();
            match waiters.get_mut(tag as usize) {
                Some(Waiter::Task { task, result }) => {
                    *result = Some(res);
                    self.inner.ready.borrow_mut().push_back(*task);
                    None
                }
                Some(Waiter::Request(_)) => match waiters.remove(tag as usize) {
                    Waiter::Request(r) => Some(r),
                    _ => None,
                },
                Some(Waiter::Single(..)) => {
                    if let Waiter::Single(t, entry, internal) = waiters.remove(tag as usize) {
                        drop(waiters);
                        self.guest_exit(entry);
                        if internal {
                            return self.internal_done(t, res.is_ok());
                        }
                        self.inner
                            .done
                            .borrow_mut()
                            .push_back((t, Outcome::Done(res.map_err(|e| Error::Io(e.0)))));
                    }
                    return;
                }
                None => None,
            }
        };
        if let Some(req) = req {
            self.request_put(req, res);
        }
    }

    /// Reports finished guest requests to `done` (without polling devices or running
    /// tasks); returns how many.
    ///
    /// Only those finished when it starts: `done` may submit a new request at once (SPDK
    /// completes a bdev_io, bdevperf submits the next), and one that finishes without
    /// device I/O (a read of zeros) is queued again at once. Draining until empty would
    /// then never return and starve the host's thread (its messages, timers, pollers).
    pub fn take_completions(&self, done: &mut dyn FnMut(u64, Result<()>)) -> usize {
        self.take_outcomes(&mut |tag, o| done(tag, o.into_result()))
    }

    /// [`take_completions`](Self::take_completions) with each request's [`Outcome`]. The
    /// engine's own requests that ended go to its sink first (a read-ahead's end may
    /// complete guest reads that waited for it: they are reported in the same call).
    pub fn take_outcomes(&self, done: &mut dyn FnMut(u64, Outcome)) -> usize {
        let k = self.take_internal();
        let n = self.inner.done.borrow().len();
        for _ in 0..n {
            let Some((tag, res)) = self.inner.done.borrow_mut().pop_front() else {
                return n;
            };
            done(tag, res);
        }
        n + k
    }

    /// Hands the internal requests that ended so far to the sink; returns how many.
    fn take_internal(&self) -> usize {
        let k = self.inner.internal.borrow().len();
        for _ in 0..k {
            let Some((token, ok)) = self.inner.internal.borrow_mut().pop_front() else {
                return k;
            };
            // A handle of its own: the sink may add or remove one.
            let (id, payload) = SinkId::of(token);
            let sink = self
                .inner
                .sinks
                .borrow()
                .get(id.index as usize)
                .filter(|e| e.gen == id.gen)
                .and_then(|e| e.sink.clone());
            if let Some(sink) = sink {
                sink(payload, ok);
            }
        }
        k
    }

    /// Whether any task, device operation or unreported completion is outstanding.
    pub fn busy(&self) -> bool {
        !self.inner.tasks.borrow().is_empty()
            || !self.inner.waiters.borrow().is_empty()
            || !self.inner.done.borrow().is_empty()
            || !self.inner.internal.borrow().is_empty()
    }

    /// Runs `fut` to completion by polling (the host's "synchronous" entry point for open,
    /// info and the like). Busy-polls: never sleeps in the kernel. Guest requests that
    /// complete meanwhile are dropped, so do not mix it with [`Exec::poll`] users.
    pub fn block_on<T: 'static>(&self, fut: impl Future<Output = T> + 'static) -> T {
        let slot: Rc<RefCell<Option<T>>> = Rc::new(RefCell::new(None));
        let s2 = slot.clone();
        self.spawn(async move {
            let v = fut.await;
            *s2.borrow_mut() = Some(v);
        });
        loop {
            self.poll(&mut |_, _| {});
            if let Some(v) = slot.borrow_mut().take() {
                return v;
            }
        }
    }
}

enum IoState<D: BlockDevice> {
    Init(DevId, DeviceOp<D::Buf>),
    Waiting(usize),
    Done,
}

/// Future of one device operation (see [`Exec::io`]).
pub struct IoFuture<D: BlockDevice> {
    exec: Exec<D>,
    state: IoState<D>,
}

impl<D: BlockDevice> Unpin for IoFuture<D> {}

impl<D: BlockDevice> Future for IoFuture<D> {
    type Output = Result<()>;
    fn poll(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = &mut *self;
        match std::mem::replace(&mut this.state, IoState::Done) {
            IoState::Init(dev, op) => {
                let Some(task) = this.exec.inner.current.get() else {
                    return Poll::Ready(Err(Error::InvalidRequest(
                        "device future polled outside a task",
                    )));
                };
                let w = this
                    .exec
                    .inner
                    .waiters
                    .borrow_mut()
                    .insert(Waiter::Task { task, result: None });
                this.exec.submit_raw(dev, op, w as u64);
                this.state = IoState::Waiting(w);
                Poll::Pending
            }
            IoState::Waiting(w) => {
                let mut waiters = this.exec.inner.waiters.borrow_mut();
                let ready = matches!(
                    waiters.get(w),
                    Some(Waiter::Task {
                        result: Some(_),
                        ..
                    })
                );
                if !ready {
                    drop(waiters);
                    this.state = IoState::Waiting(w);
                    return Poll::Pending;
                }
                match waiters.remove(w) {
                    Waiter::Task {
                        result: Some(r), ..
                    } => Poll::Ready(r.map_err(|e| Error::Io(e.0))),
                    _ => Poll::Ready(Err(Error::Io(5))),
                }
            }
            IoState::Done => Poll::Ready(Err(Error::InvalidRequest(
                "device future polled after completion",
            ))),
        }
    }
}

/// Awaits every future of `futs` concurrently; returns the first error, after all finished.
pub async fn join_all<F: Future<Output = Result<()>>>(futs: Vec<F>) -> Result<()> {
    let mut futs: Vec<Option<Pin<Box<F>>>> = futs.into_iter().map(|f| Some(Box::pin(f))).collect();
    let mut first_err = None;
    std::future::poll_fn(move |cx| {
        let mut pending = false;
        for slot in futs.iter_mut() {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    Poll::Ready(r) => {
                        if let Err(e) = r {
                            first_err.get_or_insert(e);
                        }
                        *slot = None;
                    }
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(first_err.take().map_or(Ok(()), Err))
        }
    })
    .await
}

/// Tasks waiting for something other than a device operation (a lock, an in-flight
/// allocation). `wait` parks the current task until the next `notify_all`.
pub struct WaitQueue<D: BlockDevice> {
    exec: Exec<D>,
    waiters: RefCell<Vec<usize>>,
}

impl<D: BlockDevice> WaitQueue<D> {
    /// An empty queue.
    pub fn new(exec: &Exec<D>) -> Self {
        WaitQueue {
            exec: exec.clone(),
            waiters: RefCell::new(Vec::new()),
        }
    }

    /// Resolves after the next [`notify_all`](Self::notify_all) (callers re-check their
    /// condition in a loop).
    pub fn wait(&self) -> impl Future<Output = ()> + '_ {
        let mut registered = false;
        std::future::poll_fn(move |_| {
            if registered {
                return Poll::Ready(());
            }
            if let Some(t) = self.exec.current_task() {
                // A task polled again for another reason (two device completions in one
                // poll) must not leave a second, stale entry behind.
                let mut w = self.waiters.borrow_mut();
                if !w.contains(&t) {
                    w.push(t);
                }
            }
            registered = true;
            Poll::Pending
        })
    }

    /// Wakes the longest-waiting task, if any.
    pub fn notify_one(&self) {
        let t = {
            let mut w = self.waiters.borrow_mut();
            (!w.is_empty()).then(|| w.remove(0))
        };
        if let Some(t) = t {
            self.exec.wake(t);
        }
    }

    /// Wakes every waiting task.
    pub fn notify_all(&self) {
        for t in self.waiters.borrow_mut().drain(..) {
            self.exec.wake(t);
        }
    }
}

/// A lock for one executor's tasks (serialises metadata updates across awaits).
pub struct AsyncLock<D: BlockDevice> {
    locked: Cell<bool>,
    queue: WaitQueue<D>,
}

/// Holds an [`AsyncLock`]; unlocks on drop.
pub struct LockGuard<'a, D: BlockDevice> {
    lock: &'a AsyncLock<D>,
}

impl<D: BlockDevice> AsyncLock<D> {
    /// An unlocked lock.
    pub fn new(exec: &Exec<D>) -> Self {
        AsyncLock {
            locked: Cell::new(false),
            queue: WaitQueue::new(exec),
        }
    }

    /// Waits until the lock is free and takes it.
    pub async fn lock(&self) -> LockGuard<'_, D> {
        while self.locked.get() {
            self.queue.wait().await;
        }
        self.locked.set(true);
        LockGuard { lock: self }
    }

    /// Whether someone holds the lock.
    pub fn is_locked(&self) -> bool {
        self.locked.get()
    }
}

impl<D: BlockDevice> Drop for LockGuard<'_, D> {
    fn drop(&mut self) {
        self.lock.locked.set(false);
        // Wake every waiter: they re-check and all but one wait again. Handing over to one
        // waiter (notify_one) lost wake-ups: a waiter woken spuriously (polled for another
        // reason) consumed its registration without taking the lock, and the release woke
        // no one who still wanted it (found by tests/coherency.rs; writers hung).
        self.lock.queue.notify_all();
    }
}

/// Reads `len` bytes at `off` (any alignment) through a sector-aligned bounce buffer.
pub async fn read_bytes<D: BlockDevice>(
    exec: &Exec<D>,
    dev: DevId,
    off: u64,
    len: u64,
) -> Result<Vec<u8>> {
    let start = off / SECTOR * SECTOR;
    let end = off
        .checked_add(len)
        .and_then(|e| e.div_ceil(SECTOR).checked_mul(SECTOR))
        .ok_or(Error::InvalidRequest("read range overflows"))?;
    let n = (end - start) as usize;
    let buf = exec.alloc_buf(dev, n);
    exec.read(dev, start, BufSlice::whole(buf.clone())).await?;
    let mut out = vec![0u8; len as usize];
    buf.copy_out((off - start) as usize, &mut out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::MemDevice;

    #[test]
    fn a_removed_sinks_number_is_reused_and_its_late_ends_reach_nothing() {
        let exec: Exec<MemDevice> = Exec::new();
        let heard: Rc<RefCell<Vec<(char, u32)>>> = Rc::default();
        let sink = |name: char| -> InternalSink {
            let heard = heard.clone();
            Rc::new(move |payload, _| heard.borrow_mut().push((name, payload)))
        };
        let a = exec.add_internal_sink(sink('a'));
        // A request of `a` ends after `a` is gone.
        exec.internal_done(a.token(5), true);
        exec.remove_internal_sink(a);
        assert_eq!(exec.internal_sinks(), 0);
        let b = exec.add_internal_sink(sink('b'));
        assert_eq!(b.index, a.index, "the number is reused");
        assert_ne!(b.token(5), a.token(5));
        exec.internal_done(b.token(6), true);
        exec.poll(&mut |_, _| {});
        assert_eq!(*heard.borrow(), vec![('b', 6)]);
        // Removing `a` again (stale id) leaves `b` in place.
        exec.remove_internal_sink(a);
        assert_eq!(exec.internal_sinks(), 1);
    }
}
