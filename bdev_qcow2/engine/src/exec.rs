//! The per-core executor: drives slow paths written as `async fn`s and the devices they use.
//!
//! One `Exec` per core (SPDK thread / reactor). Everything in it is single-threaded
//! (`Rc`/`RefCell`), so nothing here locks. Tasks are woken only by their own device
//! completions, which arrive when the host calls [`Exec::poll`]; no waker machinery is
//! needed (tasks are polled with a no-op waker).
//!
//! Guest requests complete through a queue that [`Exec::poll`] drains into the host's
//! callback, so hot paths (cache-hit reads) submit device I/O directly without a task.
//!
//! Its parts: `request` (fast-path requests, waiters and how requests end), `grace` (the
//! grace-period entry token), `sink` (the engine's own requests' ends), `future` (device
//! operations as futures), `wait` (wait queues and the async lock).

use crate::error::Result;
use crate::io::{BlockDevice, Busy, DeviceError, DeviceOp};
use slab::Slab;
use std::cell::{Cell, OnceCell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

mod crypt;
mod future;
mod grace;
mod polled;
mod request;
mod sink;
mod wait;

pub use future::{join_all, read_bytes, IoFuture};
pub(crate) use grace::GraceLane;
pub use grace::{GraceEntry, JoinRefused, Joiner};
pub use request::Outcome;
pub(crate) use sink::OwnedSink;
pub use sink::{InternalSink, SinkId, SINK_SHIFT};
pub use wait::{AsyncLock, LockGuard, WaitQueue};

use request::{Request, Waiter};
use sink::SinkEntry;

/// Index of a device registered with an [`Exec`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DevId(pub usize);

type Task = Pin<Box<dyn Future<Output = ()>>>;

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
    /// Which devices a poll visits (`exec/polled.rs`).
    polled: RefCell<polled::Polled>,
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
    /// Encrypted views of devices (`crypt`), indexed by a view id's low bits.
    views: RefCell<Vec<crypt::View>>,
    /// Reads through a view in flight, to decrypt when they complete.
    crypt_reads: RefCell<Slab<crypt::CryptRead<D::Buf>>>,
    /// Operations failed at submission (a locked view), completed by the next poll.
    failed: RefCell<Vec<(u64, Result<(), DeviceError>)>>,
    /// This core's membership in a shared image's grace periods (`exec/grace.rs`). Set
    /// once: every guest request reads it, without a borrow flag.
    grace: OnceCell<grace::Member>,
    /// A device may have work of its own ([`BlockDevice::may_have_own_work`]).
    own_work: Cell<bool>,
    /// A device is visited only while it has operations outstanding
    /// ([`BlockDevice::completes_only_submitted`], a deep chain's layer): without one, a
    /// submission counts nothing for `polled`.
    any_tracked: Cell<bool>,
}

impl<D: BlockDevice> Drop for Inner<D> {
    fn drop(&mut self) {
        if let Some(m) = self.grace.take() {
            m.leave();
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
                polled: RefCell::default(),
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
                views: RefCell::new(Vec::new()),
                crypt_reads: RefCell::new(Slab::new()),
                failed: RefCell::new(Vec::new()),
                grace: OnceCell::new(),
                own_work: Cell::new(false),
                any_tracked: Cell::new(false),
            }),
        }
    }

    /// Registers a device; its completions are reaped by [`Exec::poll`].
    pub fn add_device(&self, dev: D) -> DevId {
        let mut devs = self.inner.devs.borrow_mut();
        if dev.may_have_own_work() {
            self.inner.own_work.set(true);
        }
        let tracked = dev.completes_only_submitted();
        // `needs_poll` asks only the visited devices for work of their own.
        debug_assert!(
            !(tracked && dev.may_have_own_work()),
            "a tracked device with own work"
        );
        if tracked {
            self.inner.any_tracked.set(true);
        }
        devs.push(dev);
        self.inner.polled.borrow_mut().add(devs.len() - 1, tracked);
        DevId(devs.len() - 1)
    }

    /// Runs `f` on a registered device (e.g. to read its size or allocate a buffer).
    pub fn with_device<R>(&self, dev: DevId, f: impl FnOnce(&mut D) -> R) -> R {
        let dev = self.real_dev(dev);
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
        if dev.0 & crypt::VIEW_BIT != 0 {
            return self.submit_crypt(dev, op, tag);
        }
        self.bump(|s| s.device_ops += 1);
        let mut retry = self.inner.retry.borrow_mut();
        if !retry.is_empty() {
            retry.push_back((dev, op, tag));
            return;
        }
        match self.inner.devs.borrow_mut()[dev.0].submit(op, tag) {
            Ok(()) if self.inner.any_tracked.get() => {
                self.inner.polled.borrow_mut().submitted(dev.0)
            }
            Ok(()) => {}
            Err(Busy(op, tag)) => {
                self.bump(|s| s.busy_retries += 1);
                retry.push_back((dev, op, tag));
            }
        }
    }

    /// Spawns a slow-path task; it first runs at the next [`Exec::poll`].
    pub fn spawn(&self, fut: impl Future<Output = ()> + 'static) {
        self.bump(|s| s.tasks_spawned += 1);
        let id = self.inner.tasks.borrow_mut().insert(Some(Box::pin(fut)));
        self.inner.ready.borrow_mut().push_back(id);
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
            self.inner.polled.borrow_mut().submitted(dev.0);
        }
        // Reap device completions, of the devices that may have some: those visited always,
        // then (a deep chain's layers) those with operations outstanding.
        let mut reaped = std::mem::take(&mut *self.inner.reaped.borrow_mut());
        {
            let mut devs = self.inner.devs.borrow_mut();
            let mut polled = self.inner.polled.borrow_mut();
            for &d in polled.untracked() {
                events += devs[d].poll(&mut |tag, res| reaped.push((tag, res)));
            }
            if self.inner.any_tracked.get() {
                let mut i = polled.untracked().len();
                while let Some(d) = polled.at(i) {
                    let before = reaped.len();
                    events += devs[d].poll(&mut |tag, res| reaped.push((tag, res)));
                    let n = (reaped.len() - before) as u32 + devs[d].take_delivered();
                    i = polled.completed(i, n);
                }
            }
        }
        {
            let mut failed = self.inner.failed.borrow_mut();
            if !failed.is_empty() {
                reaped.append(&mut failed);
            }
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

    /// Whether any task, device operation or unreported completion is outstanding.
    /// Inline: a host asks it after every completion it delivers (PERFORMANCE.md §13);
    /// the scan of devices with work of their own stays out of line.
    #[inline(always)]
    pub fn busy(&self) -> bool {
        !self.inner.tasks.borrow().is_empty()
            || !self.inner.waiters.borrow().is_empty()
            || !self.inner.done.borrow().is_empty()
            || !self.inner.internal.borrow().is_empty()
            || !self.inner.failed.borrow().is_empty()
            || (self.inner.own_work.get() && self.devices_have_own_work())
    }

    /// Whether the host must poll: something is runnable or waits to be reported, a device
    /// has work of its own, or an operation is outstanding on a device that does not
    /// announce its completions ([`BlockDevice::completions_announced`]). A host whose
    /// executor is [`busy`](Self::busy) but needs no poll waits for a device's callback,
    /// which hands the completion in (or asks for a poll), or for a wake from outside (an
    /// answer its host delivers).
    #[inline(always)]
    pub fn needs_poll(&self) -> bool {
        let i = &self.inner;
        if !i.ready.borrow().is_empty()
            || !i.done.borrow().is_empty()
            || !i.internal.borrow().is_empty()
            || !i.failed.borrow().is_empty()
            || !i.retry.borrow().is_empty()
        {
            return true;
        }
        let waiting = !i.waiters.borrow().is_empty() || !i.crypt_reads.borrow().is_empty();
        (waiting || i.own_work.get()) && self.visited_devices_need_poll(waiting)
    }

    /// One pass over the devices a poll visits: one with work of its own, or (`waiting`)
    /// one that does not announce its completions. (A device that may have work of its own
    /// is visited always: [`add_device`](Self::add_device).)
    #[inline(never)]
    fn visited_devices_need_poll(&self, waiting: bool) -> bool {
        let own = self.inner.own_work.get();
        let devs = self.inner.devs.borrow();
        let polled = self.inner.polled.borrow();
        polled.visited().iter().any(|&d| {
            let d = &devs[d];
            (own && d.has_own_work()) || (waiting && !d.completions_announced())
        })
    }

    #[inline(never)]
    fn devices_have_own_work(&self) -> bool {
        self.inner.devs.borrow().iter().any(|d| d.has_own_work())
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
