//! The metadata owner of a writable bdev: the one writable instance of the image (allocator,
//! dirty L2 slices and refcount blocks), its executor and base channels, all on the md thread
//! (the thread that created the bdev), driven by the owner's poller.
//!
//! Only one writable instance may exist per image, and a per-thread replica would read stale
//! metadata after a write on another thread, so every channel of a writable bdev forwards
//! every request it cannot serve itself to the owner. The owner runs it on its chain with
//! the bdev_io's own iovecs and sends the completion back to the submitting thread, which
//! completes the bdev_io there (SPDK requires completion on the submitting thread). The
//! status travels in the bdev_io's per-I/O context (`io_ctx.rs`).
//!
//! Both ways, requests travel in queues ([`IoQueue`]): bdev_ios linked through their driver
//! area (no allocation), one `spdk_thread_send_msg` per queue. A channel's poller sends what
//! its thread forwarded since its last pass, the owner's poller what it completed for each
//! thread. A thread runs at most eight messages per poll (SPDK's batch), so one message per
//! request would move at most eight requests per poll each way, however many are in flight;
//! a queue moves all of them, with one message's cost.
//!
//! Requests submitted on the md thread itself skip both messages.
//!
//! As on a channel, the owner's [`Driver`] delivers base completions from SPDK's callback,
//! so a fast-path request (an overwrite of an allocated cluster, a cached read) completes
//! without waiting for the owner's poller; the poller drives the slow paths. Everything here
//! runs on the md thread, which debug builds assert ([`Owner::assert_md_thread`]).

mod reserve;

use crate::backing_slot::BackingSlot;
use crate::device::SpdkDevice;
use crate::direct::{self, DirectHost, Target};
use crate::engine_host::{Driver, Host};
use crate::ffi::bdev_io::QueueReceiver;
use crate::ffi::sink::Sinks;
use crate::ffi::thread::{self, Poll, Polled, PollerSlot, Thread};
use crate::ffi::types::Closing;
use crate::status::Status;
use crate::types::{Arrived, BdevIo, IoQueue, OwnerBox, Qcow2Bdev};
use qcow2_engine::exec::Outcome;
use qcow2_engine::ring::zones::SWEEP_EVERY;
use qcow2_engine::{Chain, DevId, Exec, Op, Request, Step};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::{Duration, Instant};

/// What the owner needs of the channels that forward requests to it and ask it for slices
/// (implemented in `channel.rs`, which depends on this module, not the other way round).
pub trait ChannelSide {
    /// A channel's slice request, answered here and sent back.
    type Ask: Send + 'static;
    /// Sends an answered request back to its channel (again: SPDK's message pool was empty
    /// the first time).
    fn send_ask(a: Box<Self::Ask>);
    /// Completes a request the owner ran on the thread (and channel) it was submitted on,
    /// with the status its context carries back.
    fn complete_forwarded(io: BdevIo);
}

/// The stream job (`bdev_qcow2_stream`) an owner keeps and drives from its poller
/// (implemented in `stream_rpc.rs`).
pub trait StreamSide {
    /// The job's state.
    type Stream;
    /// One step of `owner`'s stream job; returns the work done.
    fn poll_stream(owner: &Owner) -> usize;
    /// The stream's state for `bdev_qcow2_get_stats` (`null` before any stream).
    fn stream_json(owner: &Owner) -> serde_json::Value;
}

/// A channel's slice request, as the owner keeps an answer it could not send yet.
type Ask = <Qcow2Bdev as ChannelSide>::Ask;
/// The owner's stream job.
type Stream = <Qcow2Bdev as StreamSide>::Stream;

/// What happens once the owner closed (metadata flushed), on the md thread.
/// What follows a close: gets the owner's final read-ahead and slice-cache counters.
type Then = Box<dyn FnOnce(OwnerCounters)>;

/// The owner's read-ahead, slice-cache and prefetch ring counters.
pub type OwnerCounters = (
    qcow2_engine::prefetch::PrefetchStats,
    qcow2_engine::cache::CacheStats,
    qcow2_engine::ring::RingStats,
);
/// The close task's result: `None` while it runs, then whether the flush succeeded.
type Closed = Rc<Cell<Option<bool>>>;

/// The writable image and everything that drives it. Lives on the md thread only.
pub struct Owner {
    /// The executor, the in-engine mark and the poller.
    driver: Driver,
    /// Where its devices deliver completions (armed by `ffi` while it is its poller's state).
    sinks: Sinks<Owner>,
    /// The thread it lives on (the md thread).
    md_thread: Option<Thread>,
    /// The base device for the direct path.
    direct: Option<Target>,
    /// The backing bdev's device, as it leaves and comes back (`hotplug.rs`).
    backing: BackingSlot,
    chain: Rc<Chain<SpdkDevice>>,
    /// Completed requests on their way back, one queue per thread (sent by the poller;
    /// kept for the next poll when SPDK's message pool is empty).
    outboxes: RefCell<Vec<(Thread, IoQueue)>>,
    /// Requests forwarded by other threads in this poll's batch of messages, run by the
    /// poller right after the batch: each message only prefetches its L2 entry, so the
    /// batch's cache misses overlap instead of stalling one request after another.
    arrived: RefCell<Vec<BdevIo>>,
    /// Answers to channels' slice requests SPDK could not queue yet (see `channel.rs`).
    #[allow(clippy::vec_box)] // boxed: each goes out again as the message it was
    unsent_asks: RefCell<Vec<Box<Ask>>>,
    /// `Some` once closing: the close task's result (`None` while it runs) and what follows.
    closing: RefCell<Option<(Closed, Then)>>,
    /// Polls so far: the quiet write-back's test runs on one poll in
    /// [`WRITEBACK_TEST_EVERY`].
    polls: Cell<u32>,
    /// The stream job, once `bdev_qcow2_stream` started one (kept after it ends, for its
    /// state in `bdev_qcow2_get_stats`).
    stream: RefCell<Option<Stream>>,
    /// Life-cycle jobs ([`run_job`](Self::run_job): resize, snapshots) not finished yet.
    jobs: Rc<Cell<u32>>,
    /// Other jobs (counting the space) not finished yet.
    side_jobs: Rc<Cell<u32>>,
    /// With the prefetch ring: sweeps the zones every read-ahead left, so that writes there
    /// skip their generation bump again (a timer: the poller pauses while idle).
    _sweeper: Option<thread::Ticker>,
    /// When the last "base is full" warning was logged (one per [`FULL_WARNING_EVERY`]).
    full_warned: Cell<Option<Instant>>,
    /// The share of the base the image's end may reach before a warning
    /// (`CreateParams::space_warn_percent`).
    space_warn_percent: Option<u8>,
}

/// At most one warning this often while writes fail for want of room on the base.
const FULL_WARNING_EVERY: Duration = Duration::from_secs(10);

/// How often (in polls) the owner asks whether dirty metadata waited long enough for a
/// background write-back: its interval is milliseconds, a poll takes well under one
/// microsecond, and asking on every poll cost a few per cent of the owner's time while an
/// image fills.
const WRITEBACK_TEST_EVERY: u32 = 16;

impl Owner {
    /// Starts the owner of `chain` (whose devices `devs`, and `layers` of a deep chain read
    /// in place of the backing bdev, belong to `exec`) on the calling thread, the md
    /// thread. Returns its box, freed after [`Owner::close`], or `None` if SPDK refused a
    /// poller.
    pub fn start(
        exec: Exec<SpdkDevice>,
        chain: Rc<Chain<SpdkDevice>>,
        devs: impl IntoIterator<Item = DevId>,
        layers: Vec<DevId>,
        space_warn_percent: Option<u8>,
    ) -> Option<OwnerBox> {
        let devs: Vec<DevId> = devs.into_iter().collect();
        let backing_generation = devs.get(1).map_or(1, |&d| {
            u64::from(!exec.with_device(d, |dev| dev.inner().is_gone()))
        });
        // The top image's device (the base) comes first.
        let direct = devs
            .first()
            .map(|&d| exec.with_device(d, |dev| dev.inner().direct_target(d)));
        let sweeper = chain.ring().write_gens().and_then(|g| {
            let g = g.clone();
            let t = thread::every(SWEEP_EVERY, c"qcow2_zones", Box::new(move || {
                g.zones().sweep();
            }));
            if t.is_none() {
                tracing::warn!(
                    "no poller for the zone sweep: writes keep their generation bump wherever a read-ahead was"
                );
            }
            t
        });
        let o = Box::new(Owner {
            driver: Driver::new(exec),
            sinks: Sinks::new(),
            md_thread: Thread::current(),
            direct,
            // The backing device follows the base (`start_owner`); one missing at creation
            // reads generation 0 until the bdev appears.
            backing: if layers.is_empty() {
                BackingSlot::new(devs.get(1).copied(), backing_generation, None)
            } else {
                BackingSlot::layers(layers.clone(), backing_generation, None)
            },
            chain,
            outboxes: RefCell::new(Vec::new()),
            arrived: RefCell::new(Vec::with_capacity(64)),
            unsent_asks: RefCell::new(Vec::new()),
            closing: RefCell::new(None),
            polls: Cell::new(0),
            stream: RefCell::new(None),
            jobs: Rc::new(Cell::new(0)),
            side_jobs: Rc::new(Cell::new(0)),
            _sweeper: sweeper,
            full_warned: Cell::new(None),
            space_warn_percent,
        });
        for d in devs.into_iter().chain(layers) {
            o.driver.attach(d, &*o);
        }
        o.watch_space();
        OwnerBox::start(o, c"qcow2_owner")
    }

    /// Sets the image's space threshold from the base's size now (at start, and when the
    /// base was resized), then counts where the image ends (a background job) so that an
    /// image already past it is reported too.
    pub fn watch_space(&self) {
        self.assert_md_thread();
        let Some(pct) = self.space_warn_percent else {
            return;
        };
        let Some(qcow2_engine::Layer::Qcow2(q)) = self.chain.layers().first() else {
            return;
        };
        let base = q.dev();
        // The base's size now (read live: it may have grown).
        let threshold = (self.exec().device_size(base) as u128 * pct as u128 / 100) as u64;
        let _ = self.run(|| q.set_space_threshold(Some(threshold)));
        self.run_side_job(move |chain| async move {
            if let Some(qcow2_engine::Layer::Qcow2(q)) = chain.layers().first() {
                if let Err(e) = q.space_usage().await {
                    tracing::warn!("counting the space of the image on {base:?} failed: {e}");
                }
            }
        });
    }

    /// What the image takes of its base, for `bdev_qcow2_get_stats` (counted from the
    /// refcounts by a job; `then` gets it on the md thread).
    pub fn space_json(&self, then: impl FnOnce(serde_json::Value) + 'static) {
        self.run_side_job(move |chain| async move {
            let Some(qcow2_engine::Layer::Qcow2(q)) = chain.layers().first() else {
                return then(serde_json::Value::Null);
            };
            let v = match q.space_usage().await {
                Ok(u) => serde_json::json!({
                    "allocated_bytes": u.allocated_bytes,
                    "image_end_bytes": u.image_end_bytes,
                    "base_capacity_bytes": u.device_bytes,
                    "free_bytes": u.free_bytes(),
                    "threshold_exceeded": q.space_threshold_exceeded(),
                }),
                Err(e) => serde_json::json!({ "error": e.to_string() }),
            };
            then(v)
        });
    }

    /// Asserts (in debug builds) that the caller runs on the md thread, where alone the
    /// owner may be used.
    #[inline(always)]
    #[track_caller]
    pub fn assert_md_thread(&self) {
        debug_assert!(
            self.md_thread.is_some_and(Thread::is_current),
            "the metadata owner used off its md thread"
        );
    }

    /// The executor.
    fn exec(&self) -> &Exec<SpdkDevice> {
        self.driver.exec()
    }

    /// Flushes the metadata (`Chain::close`: refcounts, dirty bit), then frees the owner and
    /// calls `then`, on the md thread. Every forwarded request has completed (the node's
    /// channels are gone). Only the owner's [`OwnerBox`](crate::ffi::types::OwnerBox) can
    /// call it (it alone makes the [`Closing`] token), once, on the md thread.
    pub fn close(&self, _: Closing, then: impl FnOnce(OwnerCounters) + 'static) {
        let o = self;
        o.assert_md_thread();
        o.wake();
        let result: Closed = Rc::new(Cell::new(None));
        let (r2, chain) = (result.clone(), o.chain.clone());
        o.exec().spawn(async move {
            let r = chain.close().await;
            if let Err(e) = &r {
                tracing::error!("flushing the image's metadata failed: {e}");
            }
            r2.set(Some(r.is_ok()));
        });
        *o.closing.borrow_mut() = Some((result, Box::new(then)));
    }

    /// The virtual size of the image as the owner has it now.
    pub fn size(&self) -> u64 {
        self.assert_md_thread();
        self.chain.size()
    }

    /// Runs `job` on the owner's chain as a task of its executor (driven by the owner's
    /// poller, so requests keep flowing): the life-cycle operations (resize, snapshots)
    /// start here and report from the task's end, on the md thread.
    pub fn run_job<F>(&self, job: impl FnOnce(Rc<Chain<SpdkDevice>>) -> F)
    where
        F: std::future::Future<Output = ()> + 'static,
    {
        self.spawn_counted(&self.jobs, job);
    }

    /// Runs `job` as [`run_job`](Self::run_job) does, counted in `count` while it runs
    /// (the poller does not pause meanwhile).
    fn spawn_counted<F>(&self, count: &Rc<Cell<u32>>, job: impl FnOnce(Rc<Chain<SpdkDevice>>) -> F)
    where
        F: std::future::Future<Output = ()> + 'static,
    {
        self.assert_md_thread();
        self.wake();
        let fut = job(self.chain.clone());
        let count = count.clone();
        count.set(count.get() + 1);
        self.exec().spawn(async move {
            fut.await;
            count.set(count.get() - 1);
        });
    }

    /// Runs `job` (counting the image's space) as [`run_job`](Self::run_job) does, but not
    /// as a life-cycle job: a stream may start meanwhile.
    fn run_side_job<F>(&self, job: impl FnOnce(Rc<Chain<SpdkDevice>>) -> F)
    where
        F: std::future::Future<Output = ()> + 'static,
    {
        self.spawn_counted(&self.side_jobs, job);
    }

    /// Whether a life-cycle job started by [`run_job`](Self::run_job) is still running.
    pub fn job_running(&self) -> bool {
        self.jobs.get() > 0
    }

    /// The stream job's slot (`stream_rpc.rs`).
    pub fn stream(&self) -> &RefCell<Option<Stream>> {
        self.assert_md_thread();
        &self.stream
    }

    /// The owner's chain (for the stream job, which drives its steps on it).
    pub fn chain(&self) -> &Rc<Chain<SpdkDevice>> {
        &self.chain
    }

    /// Runs `f` as engine code (spawning tasks, polling the executor) on the md thread.
    pub fn run<R>(&self, f: impl FnOnce() -> R) -> R {
        self.driver.run(f)
    }

    /// The internal snapshots of the image.
    pub fn snapshots(&self) -> Vec<qcow2_engine::format::Snapshot> {
        self.assert_md_thread();
        match self.chain.layers().first() {
            Some(qcow2_engine::Layer::Qcow2(q)) => q.snapshots(),
            _ => Vec::new(),
        }
    }

    /// The owner's counters for `bdev_qcow2_get_stats`: clusters allocated, write-backs,
    /// and its own slice cache (the md thread serves the allocating writes).
    pub fn stats_json(&self) -> serde_json::Value {
        self.assert_md_thread();
        match self.chain.layers().first() {
            Some(qcow2_engine::Layer::Qcow2(q)) => {
                let s = q.owner_stats().unwrap_or_default();
                let (p, c, r) = self.cache_stats();
                serde_json::json!({
                    "clusters_allocated": s.clusters_allocated,
                    "writes_planned_now": s.writes_planned_now,
                    "first_writes_by_cores": s.first_writes_by_cores,
                    // Guest requests the owner ran as engine tasks (as a channel's).
                    "engine_tasks": self.driver.tasks(),
                    "clusters_taken_ahead": s.clusters_taken_ahead,
                    "l2_slices_written": s.l2_slices_written,
                    "writebacks": s.writebacks,
                    "zeroed_tail_raises": s.zeroed_tail_raises,
                    "zeroed_ahead_bytes": s.zeroed_ahead_bytes,
                    "discards": s.discards,
                    "discards_failed": s.discards_failed,
                    "bytes_discarded": s.bytes_discarded,
                    "discards_skipped": s.discards_skipped,
                    "l2_cache_hits": c.hits,
                    "l2_cache_misses": c.misses,
                    "l2_cache_evictions": c.evictions,
                    "prefetch_streams": p.streams,
                    "prefetch_issued": p.issued,
                    "prefetch_loaded": p.loaded,
                    "prefetch_hits": p.hits,
                    "ring_streams": r.streams,
                    "ring_readahead_ios": r.readahead_ios,
                    "ring_bytes_read_ahead": r.bytes_read_ahead,
                    "ring_bytes_served": r.bytes_served,
                    "ring_reads_served": r.reads_served,
                    "ring_reads_partial": r.reads_partial,
                    "ring_partial_waited": r.partial_waited,
                    "ring_reads_waited": r.reads_waited,
                    "ring_waited_to_base": r.waited_to_base,
                    "ring_bytes_evicted_unread": r.bytes_evicted_unread,
                    "ring_invalidated": r.invalidated,
                    "ring_compressed_fills": r.compressed_fills,
                    "ring_readahead_tasks": r.readahead_tasks,
                    "ring_synchronous_base": r.synchronous_base,
                    // Zones where writes bump their write generation (a ring holds data
                    // there, or left less than a sweep ago), and how many sweeps cleared.
                    "ring_zones_watched": self.chain.ring().write_gens().map_or(0, |g| g.zones().watched()),
                    "ring_zones_swept": self.chain.ring().write_gens().map_or(0, |g| g.zones().swept()),
                    "stream": Qcow2Bdev::stream_json(self),
                })
            }
            _ => serde_json::Value::Null,
        }
    }

    /// The owner's read-ahead, slice-cache and prefetch ring counters.
    pub fn cache_stats(&self) -> OwnerCounters {
        let c = match self.chain.layers().first() {
            Some(qcow2_engine::Layer::Qcow2(q)) => q.l2_cache_stats(),
            _ => Default::default(),
        };
        (
            self.chain.prefetch().stats(),
            c,
            self.chain.ring().stats().unwrap_or_default(),
        )
    }

    /// Keeps an answered slice request to send again on the next poll (message pool empty).
    pub fn defer_ask(&self, a: Box<Ask>) {
        self.assert_md_thread();
        self.wake();
        self.unsent_asks.borrow_mut().push(a);
    }

    /// Resumes the owner's poller if it paused itself while idle ([`Owner::poll`]): called
    /// wherever the owner may get work — every access to it (`BdevIo::with_owner`,
    /// `NodeRef::owner_here`), its executor's work (`Driver`), a close, a job, a deferred
    /// answer.
    #[inline(always)]
    pub fn wake(&self) {
        self.driver.slot().resume();
    }

    /// The backing bdev is going: the owner's reads that need it, and its copies on write
    /// from it, fail from now on (ARCHITECTURE.md §15, degraded mode).
    pub fn backing_leave(&self) {
        self.assert_md_thread();
        self.backing.leave(self);
        self.wake();
    }

    /// Whether operations to the backing bdev that left still drain (puts its channel once
    /// they are done).
    pub fn backing_settle(&self) -> bool {
        self.backing.settle(self)
    }

    /// The backing bdev came back as `desc` (`generation`, read through `cache`).
    pub fn backing_join(
        &self,
        desc: &crate::ffi::bdev::Desc,
        cache: Option<&std::sync::Arc<qcow2_engine::golden::SharedReadCache>>,
        generation: u64,
    ) {
        self.assert_md_thread();
        self.backing.join(self, desc, cache, generation);
        self.wake();
    }

    /// Whether the poller may pause: nothing queued, in flight or due later (a dirty slice
    /// waits for its quiet write-back, which only the poller starts), no stream, no job.
    fn may_pause(&self) -> bool {
        !self.exec().busy()
            && !self.backing.draining()
            && self.arrived.borrow().is_empty()
            && self.unsent_asks.borrow().is_empty()
            && self.outboxes.borrow().iter().all(|(_, q)| q.is_empty())
            && self.stream.borrow().is_none()
            && self.closing.borrow().is_none()
            && self.jobs.get() == 0
            && self.side_jobs.get() == 0
            && !self.chain.background_writeback_pending()
    }

    /// Answers a channel's replica asking for slice `key` (ARCHITECTURE.md §6). On the md thread.
    pub fn slice_for_core(&self, key: u64) -> qcow2_engine::coherency::SliceReply {
        self.assert_md_thread();
        match self.chain.layers().first() {
            Some(qcow2_engine::Layer::Qcow2(q)) => q.slice_for_core(key),
            _ => qcow2_engine::coherency::SliceReply::Retry,
        }
    }

    /// Runs `io` (submitted to a writable bdev, forwarded to run `io.ctx().op()`) on the
    /// owner's chain: reads and writes on the direct path when the engine grants them one
    /// extent, else (and everything else) through the engine; a core's first write by
    /// the reservation protocol's step it is at (`owner/reserve.rs`).
    fn submit(&self, io: BdevIo) {
        self.assert_md_thread();
        if io.ctx().reserving() {
            return self.driver.run(|| self.serve_reservation(io));
        }
        self.driver.run(|| self.run_op(io));
    }

    /// The owner's one loop: its engine decides forwarded request `io` ([`Chain::plan`]),
    /// and the owner takes that step.
    fn run_op(&self, io: BdevIo) {
        let c = &self.chain;
        let req = Request::new(io.ctx().op(), io.offset_bytes(), io.len_bytes());
        match c.plan(req, || io.data()) {
            Step::Direct(grant) => {
                let target = &self.direct;
                let r = match grant.is_write() {
                    false => direct::submit::<Owner, direct::Read>(self, c, target, io, grant),
                    true => direct::submit::<Owner, direct::Write>(self, c, target, io, grant),
                };
                if let Err(io) = r {
                    let task = c.refused(req);
                    self.driver
                        .submit(io, |tag, _, buf| c.start(task, tag, Some(buf)));
                }
            }
            Step::Task(task) => match req.op.has_data() {
                true => self
                    .driver
                    .submit(io, |tag, _, buf| c.start(task, tag, Some(buf))),
                false => self
                    .driver
                    .submit_no_data(io, |tag, _, _| c.start(task, tag, None)),
            },
            Step::Complete(r) => self.request_done(io, Outcome::Done(r)),
            // The owner is no core replica: nothing goes further.
            Step::Owner(_) => self.request_done(io, Outcome::ToOwner),
        }
    }

    /// A request the owner ran is about to complete: when it wrote (write, write-zeroes,
    /// unmap: its data and its metadata in place by now), no thread's prefetch ring may
    /// serve the bytes it replaced any more (a no-op while the ring is off).
    #[inline(always)]
    /// A write failed for want of room on the base: says so (not on every write).
    #[cold]
    fn out_of_space(&self) {
        let now = Instant::now();
        if self
            .full_warned
            .get()
            .is_some_and(|t| now.duration_since(t) < FULL_WARNING_EVERY)
        {
            return;
        }
        self.full_warned.set(Some(now));
        tracing::warn!(
            "the base is full: writes that need a new cluster fail (ENOSPC, NVMe Capacity \
             Exceeded; counted in bdev_qcow2_get_stats' no_space_errors) until it grows \
             (bdev_lvol_resize, bdev_aio_rescan, ...); nothing else is affected"
        );
    }

    fn written(&self, io: &BdevIo) {
        if io.ctx().op().changes_data() {
            self.chain.ring().written(io.offset_bytes(), io.len_bytes());
        }
    }

    /// Sends each thread its queue of completed requests. Returns how many queues went.
    fn send_done(&self) -> usize {
        let mut n = 0;
        for (t, q) in self.outboxes.borrow().iter() {
            if q.send::<Back>(*t) {
                n += 1;
            }
        }
        n
    }
}

impl Host for Owner {
    fn driver(&self) -> &Driver {
        &self.driver
    }

    fn sinks(&self) -> &Sinks<Owner> {
        &self.sinks
    }

    fn request_done(&self, io: BdevIo, outcome: Outcome) {
        self.written(&io);
        let status = match outcome {
            Outcome::Done(r) => {
                if let Err(e) = &r {
                    tracing::debug!("request failed: {e}");
                }
                let status = Status::of(&r);
                if status == Status::NoSpace {
                    self.out_of_space();
                }
                status
            }
            // Only a core replica hands requests to the owner.
            Outcome::ToOwner => {
                tracing::debug!("request failed: handed to the owner by the owner");
                Status::Failed
            }
        };
        done(io, status);
    }
}

/// The owner's direct-path requests (`direct.rs`): found again through their bdev (whose
/// owner it is), completed like every request the owner ran.
impl DirectHost for Owner {
    #[inline(always)]
    fn with_host<R>(io: BdevIo, f: impl FnOnce(&Owner, BdevIo) -> R) -> R {
        io.with_owner(f)
    }

    #[inline(always)]
    fn written(&self, io: &BdevIo) {
        Owner::written(self, io)
    }

    #[inline(always)]
    fn complete_direct(&self, io: BdevIo, success: bool) {
        done(io, Status::of_success(success));
    }
}

/// Hands `io` to the owner of its (writable) bdev, to run `op`: directly on the md thread,
/// else into `outbox`, the queue its channel's poller sends ([`send_forwarded`]). The caller
/// counted it as outstanding on its channel.
pub fn forward(md_thread: Thread, mut io: BdevIo, op: Op, outbox: &IoQueue) {
    io.ctx_mut().set_op(op);
    if md_thread.is_current() {
        return io.with_owner(|o, io| o.submit(io));
    }
    outbox.push(io);
}

/// Sends a channel's forwarded requests to the md thread as one message; they stay for
/// the next poll when SPDK's message pool is empty. Whether it sent any.
#[inline(always)]
pub fn send_forwarded(md_thread: Thread, outbox: &IoQueue) -> bool {
    outbox.send::<Arrive>(md_thread)
}

/// Forwarded requests arriving on the md thread.
struct Arrive;

impl QueueReceiver<Qcow2Bdev> for Arrive {
    /// Each request's L2 entry is prefetched, and the owner's poller runs it with the
    /// others of this poll.
    fn receive(q: Arrived) {
        for io in q {
            arrive(io);
        }
    }
}

/// Its poller runs `arrived` before the owner can close (closing waits for the channels).
fn arrive(io: BdevIo) {
    io.with_owner(arrive_at);
}

fn arrive_at(o: &Owner, io: BdevIo) {
    o.assert_md_thread();
    let op = io.ctx().op();
    if op.has_data() {
        let off = io.offset_bytes();
        if let Some(p) = o.chain.disk().entry_hint(off) {
            thread::prefetch_line(p.cast());
        }
        if op != Op::Read {
            if let Some(p) = o.chain.disk().dirty_entry_hint(off) {
                thread::prefetch_line(p.cast());
            }
        }
    }
    o.arrived.borrow_mut().push(io);
}

/// Completed requests arriving back on the thread they were submitted on.
struct Back;

impl QueueReceiver<Qcow2Bdev> for Back {
    fn receive(q: Arrived) {
        for io in q {
            Qcow2Bdev::complete_forwarded(io);
        }
    }
}

/// A request finished on the owner: back to its thread, in that thread's queue (the
/// owner's poller sends it).
fn done(mut io: BdevIo, status: Status) {
    io.ctx_mut().set_status(status);
    let t = io.thread();
    if t.is_current() {
        return Qcow2Bdev::complete_forwarded(io);
    }
    io.with_owner(|o, io| {
        o.assert_md_thread();
        let mut boxes = o.outboxes.borrow_mut();
        match boxes.iter_mut().find(|(to, _)| *to == t) {
            Some((_, q)) => q.push(io),
            None => {
                let q = IoQueue::new();
                q.push(io);
                boxes.push((t, q));
            }
        }
    });
}

impl Polled for Owner {
    fn sinks(&self) -> Option<&Sinks<Owner>> {
        Some(&self.sinks)
    }

    fn slot(&self) -> &PollerSlot {
        self.driver.slot()
    }

    /// The owner's poller: the requests that arrived, answers to resend, the background
    /// write-back, the executor, the completed requests' way back, and the end of a close.
    #[inline(always)]
    fn poll(&self) -> Poll {
        self.assert_md_thread();
        let mut n = 0;
        if !self.arrived.borrow().is_empty() {
            let mut arrived = std::mem::take(&mut *self.arrived.borrow_mut());
            for io in arrived.drain(..) {
                n += 1;
                self.submit(io);
            }
            // Keep the vector's capacity (no allocation per batch).
            if self.arrived.borrow().is_empty() {
                *self.arrived.borrow_mut() = arrived;
            }
        }
        // (Checked first: this poller runs on every reactor iteration, mostly idle.)
        if !self.unsent_asks.borrow().is_empty() {
            let asks = std::mem::take(&mut *self.unsent_asks.borrow_mut());
            for a in asks {
                n += 1;
                Qcow2Bdev::send_ask(a);
            }
        }
        // Dirty metadata that waited long enough for a flush goes back on its own, so the
        // cores take overwrites into its slices again (see `tick_background_writeback`).
        let polls = self.polls.get().wrapping_add(1);
        self.polls.set(polls);
        if polls.is_multiple_of(WRITEBACK_TEST_EVERY)
            && self.driver.run(|| self.chain.tick_background_writeback())
        {
            n += 1;
        }
        if self.stream.borrow().is_some() && self.closing.borrow().is_none() {
            n += Qcow2Bdev::poll_stream(self);
        }
        n += self.driver.poll(self);
        // Last: what this poll and the base completions since the last one finished.
        n += self.send_done();
        let closed = self
            .closing
            .borrow()
            .as_ref()
            .is_some_and(|(r, _)| r.get().is_some())
            && !self.exec().busy()
            && self.arrived.borrow().is_empty()
            && self.outboxes.borrow().iter().all(|(_, q)| q.is_empty())
            && self.unsent_asks.borrow().is_empty();
        if closed {
            return Poll::Done;
        }
        if n > 0 {
            return Poll::Busy;
        }
        // Idle with nothing pending (e.g. reads the channels serve on their own): SPDK stops
        // calling the poller until something gives the owner work (`wake`), so the reactor
        // does not pay an idle pass per loop.
        if self.may_pause() {
            self.driver.slot().pause();
        }
        Poll::Idle
    }

    /// Closed and idle: dropping the owner puts the md thread's base channels back before
    /// what follows the close closes the descriptors.
    fn finish(self: Box<Self>) {
        let then = self.closing.borrow_mut().take().map(|(_, t)| t);
        let counters = self.cache_stats();
        drop(self);
        if let Some(t) = then {
            t(counters);
        }
    }
}
