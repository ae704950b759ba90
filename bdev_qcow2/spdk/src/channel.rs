//! Per-thread state of a qcow2 bdev. Each SPDK thread that opens a channel gets its own
//! engine executor, its own replica of the image (slice cache included), its own channels of
//! the base and backing bdevs, and a poller that drives them.
//!
//! - Read-only bdev: the replica is a read-only copy opened asynchronously when the channel
//!   is created; requests arriving meanwhile wait in a queue.
//! - Writable bdev, on a thread other than the metadata owner's: the replica is built at once
//!   from the owner's [`CoreSeed`](qcow2_engine::CoreSeed) and validated against the owner's
//!   epochs (ARCHITECTURE.md §6). Reads of every kind and in-place writes to COPIED clusters run
//!   here; an allocating write goes to the owner without its data, which reserves its
//!   clusters and answers where this channel writes it (`channel/reserve.rs`); write-zeroes,
//!   unmap and flush go to the owner (`owner.rs`) as messages carrying the bdev_io, and so
//!   do the replica's requests for slices the owner holds dirty ([`SpdkLink`]).
//! - Writable bdev, on the owner's thread: everything goes straight to the owner.
//!
//! Every field is a `Cell`/`RefCell`/`OnceCell` used through `&Channel`, because completing
//! a bdev_io can re-enter `submit_request` on the same channel.
//!
//! A request's path: [`submit_request`] (the one switch on the I/O type) → `read`/`write`
//! on the replica, routed by the engine (`Chain::route_read` / `Chain::route_write`) → the
//! direct path (`direct.rs`) when it grants one extent, else the engine through the
//! channel's [`Driver`] (`engine_host.rs`), else the owner (`owner::forward`; a first write
//! by the reservation protocol, `channel/reserve.rs`). The poller drives slow paths (tasks),
//! resubmissions after `-ENOMEM`, opening the replica, and sending forwarded requests.

mod ask;
mod backing;
mod below;
mod hooks;
mod replica;
mod reserve;

use crate::ffi::sink::Sinks;
use ask::SpdkLink;
pub use ask::{send_ask, Ask};
use below::Underneath;
pub use hooks::stats_step;
use replica::ReplicaState;
use reserve::FirstWrites;

use crate::backing_slot::BackingSlot;
use crate::device::SpdkDevice;
use crate::direct::{self, DirectHost, Target};
use crate::engine_host::{Driver, Host};
use crate::ffi::bdev::Desc;
use crate::ffi::bdev_io::{BufDone, Requests};
use crate::ffi::sys;
use crate::ffi::thread::{self, Poll, Polled, PollerSlot, Thread};
use crate::node::{BaseChannel, ChannelSource, NodeAccess, Prefetch};
use crate::owner;
pub use crate::stats::ChannelStats;
use crate::status::Status;
use crate::types::{BdevIo, ChannelIter, IoQueue, Qcow2Bdev};
use qcow2_engine::exec::Outcome;
use qcow2_engine::ring::{RingConfig, WriteGens};
use qcow2_engine::{Chain, Error, Exec, Grant, Layer, Op, Qcow2, Request, Step, Task};
use std::cell::{Cell, OnceCell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

type Opened = Rc<RefCell<Option<qcow2_engine::Result<Qcow2<SpdkDevice>>>>>;

/// One thread's channel of a qcow2 bdev.
pub struct Channel {
    /// The node's count of live channel states (decremented on drop).
    live: Arc<AtomicUsize>,
    /// Where this channel's counters go when it is freed.
    retired: Arc<Mutex<ChannelStats>>,
    /// The executor, the in-engine mark and the poller.
    driver: Driver,
    /// Where its devices deliver completions (armed by `ffi` while it is its poller's state).
    sinks: Sinks<Channel>,
    /// The base device for the direct path (a replica's channels).
    direct: Option<Target>,
    /// Writable bdev: the md thread slow paths (all requests, on the md thread itself) are
    /// forwarded to.
    forward_to: Option<Thread>,
    /// Who writes the data of this channel's first writes (`channel/reserve.rs`).
    first_writes: FirstWrites,
    /// Where this channel's replica stands.
    replica: Cell<ReplicaState>,
    /// Read-ahead on sequential streams (`prefetch` of the create call).
    prefetch: bool,
    /// The prefetch ring the replica's chain allocates once it is built, and the image's
    /// write generations (`None`: `prefetch` is off).
    ring: Option<(RingConfig, Arc<WriteGens>)>,
    /// Writable bdev: requests forwarded to the owner since the poller's last pass (it
    /// sends them as one message: [`owner::send_forwarded`]).
    outbox: IoQueue,
    /// Writable bdev: slice requests that SPDK's message pool could not take yet.
    #[allow(clippy::vec_box)] // boxed: each goes out again as the message it was
    unsent_asks: RefCell<Vec<Box<Ask>>>,
    /// Writes sent to the owner before (or without) a replica to plan them.
    forwarded: Cell<u64>,
    /// The device of the backing bdev, as it leaves and comes back.
    backing: BackingSlot,
    /// What the chain reads under the top image (`channel/below.rs`): set before the chain
    /// is built, which may come after a stream dropped the backing reference.
    under: RefCell<Underneath>,
    opened: Opened,
    /// The replica's chain, set once when it is ready (`try_ready`): the request path
    /// serves on it when set.
    chain: OnceCell<Rc<Chain<SpdkDevice>>>,
    /// Reads that arrived before the replica was open.
    queued: RefCell<VecDeque<BdevIo>>,
    /// Guest requests accepted (those not completed yet are outstanding: see
    /// [`outstanding`](Self::outstanding)).
    accepted: Cell<u64>,
    /// Reset iterations waiting for no request to be outstanding.
    reset_waiters: RefCell<Vec<ChannelIter>>,
    closing: Cell<bool>,
    completed: Cell<u64>,
    errors: Cell<u64>,
    /// ... of them, for want of room on the base.
    no_space_errors: Cell<u64>,
    thread_name: String,
}

impl Channel {
    /// This thread's channel state, built from `node`'s view `src` (SPDK's `create_cb`; see
    /// `ffi/io_channel.rs`).
    pub fn create(mut src: ChannelSource<'_>) -> Result<Box<Channel>, i32> {
        let base = src.base().ok_or(libc::ENODEV)?;
        let thread_name = thread::current_name();
        src.live().fetch_add(1, Ordering::AcqRel);
        let mut ch = Box::new(Channel {
            live: src.live().clone(),
            retired: src.retired().clone(),
            driver: Driver::new(Exec::new()),
            sinks: Sinks::new(),
            direct: None,
            forward_to: None,
            first_writes: FirstWrites::Owner,
            replica: Cell::new(ReplicaState::None),
            prefetch: src.prefetch() == Prefetch::On,
            ring: src.ring().cloned(),
            outbox: IoQueue::new(),
            unsent_asks: RefCell::new(Vec::new()),
            forwarded: Cell::new(0),
            backing: BackingSlot::new(None, 0, None),
            under: RefCell::new(Underneath::Backing),
            opened: Rc::new(RefCell::new(None)),
            chain: OnceCell::new(),
            queued: RefCell::new(VecDeque::new()),
            accepted: Cell::new(0),
            reset_waiters: RefCell::new(Vec::new()),
            closing: Cell::new(false),
            completed: Cell::new(0),
            errors: Cell::new(0),
            no_space_errors: Cell::new(0),
            thread_name,
        });
        if src.access() == NodeAccess::Writable {
            ch.forward_to = src.md_thread();
            if !src.on_md_core() {
                ch.first_writes = FirstWrites::Core;
            }
            if src.md_thread().is_some_and(Thread::is_current) || src.seed().is_none() {
                return Ok(ch);
            }
        }
        let host: &Channel = &ch;
        let add = |desc: &Desc, cache| {
            let d = crate::device::open_cached(desc, cache).ok_or(libc::ENOMEM)?;
            let id = ch.exec().add_device(d);
            ch.driver.attach(id, host);
            Ok::<_, i32>(id)
        };
        // A link of a chain on its md thread (its kept channel, examines) takes its base's
        // channel on first use (`keep.rs`).
        let lazy_base = src.base_channel() == BaseChannel::OnFirstUse;
        let base_dev = if lazy_base {
            let id = ch
                .exec()
                .add_device(crate::device::open_cached_lazy(base, None, true));
            ch.driver.attach(id, host);
            id
        } else {
            add(base, None)?
        };
        let below_devs = match src.below() {
            Some(b) => ch.open_below(b)?,
            None => Vec::new(),
        };
        let backing_dev = match (src.backing(), src.backing_gone()) {
            _ if src.below().is_some() => None,
            // Its channel is taken on first use: over a chain of read-only qcow2 bdevs,
            // taking it now would build every channel below this one, nested.
            (Some(d), _) => {
                let id = ch.exec().add_device(crate::device::open_cached_lazy(
                    d,
                    src.backing_cache(),
                    lazy_base,
                ));
                ch.driver.attach(id, host);
                Some(id)
            }
            // Hot-removed: a device that fails what needs the bdev until it returns.
            (None, Some(g)) => Some(backing::add_missing(&ch, g)),
            (None, None) => None,
        };
        let exec = ch.exec();
        let chan = ch.sinks.home();
        match (src.seed(), src.take_owner()) {
            (Some(seed), Some(owner)) => {
                // A replica of the owner's image, usable at once.
                let link = Box::new(SpdkLink { owner, chan });
                let r = Qcow2::from_seed(seed.clone(), exec, base_dev, src.opts(), link);
                *ch.opened.borrow_mut() = Some(r);
            }
            // A read-only bdev's image as its creation opened it: nothing to read.
            _ if src.ro_seed().is_some() => {
                let r = src.ro_seed().map(|s| {
                    Qcow2::from_ro_seed(s, exec, base_dev, src.opts()).and_then(|q| {
                        if let Some(k) = src.key() {
                            q.unlock_with(k)?;
                        }
                        Ok(q)
                    })
                });
                *ch.opened.borrow_mut() = r;
            }
            _ => {
                let (e2, o2, opts) = (exec.clone(), ch.opened.clone(), src.opts());
                let key = src.key().cloned();
                exec.spawn(async move {
                    let r = Qcow2::open(&e2, base_dev, opts).await.and_then(|q| {
                        // An encrypted image's key, unlocked once at creation.
                        if let Some(k) = &key {
                            q.unlock_with(k)?;
                        }
                        Ok(q)
                    });
                    *o2.borrow_mut() = Some(r);
                });
            }
        }
        ch.replica.set(ReplicaState::Opening);
        let pending = Some(src.backing_pending().clone());
        ch.backing = match backing_dev {
            None if !below_devs.is_empty() => {
                BackingSlot::layers(below_devs, src.backing_generation(), pending)
            }
            d => BackingSlot::new(d, src.backing_generation(), pending),
        };
        // (A lazy base has no channel yet: its requests go through the executor.)
        ch.direct = (!lazy_base).then(|| {
            ch.exec()
                .with_device(base_dev, |d| d.inner().direct_target(base_dev))
        });
        ch.try_ready();
        ch.queued.borrow_mut().reserve(256);
        Ok(ch)
    }

    /// The executor.
    #[inline(always)]
    fn exec(&self) -> &Exec<SpdkDevice> {
        self.driver.exec()
    }

    /// Counters of this channel.
    pub fn stats(&self) -> ChannelStats {
        let mut s = ChannelStats {
            thread: self.thread_name.clone(),
            forwarded: self.forwarded.get(),
            completed: self.completed.get(),
            errors: self.errors.get(),
            no_space_errors: self.no_space_errors.get(),
            busy_retries: self.exec().stats().busy_retries,
            engine_tasks: self.driver.tasks(),
            ..ChannelStats::default()
        };
        if let Some(chain) = self.chain.get() {
            let r = chain.counters().reads();
            s.fast_reads = r.fast_reads;
            s.slow_reads = r.slow_reads;
            s.kept_overwrites = chain.kept_overwrites();
            let q = chain.counters().requests();
            s.local_writes = q.writes_here;
            s.forwarded += q.to_owner;
            let p = chain.prefetch().stats();
            s.prefetch_streams = p.streams;
            s.prefetch_issued = p.issued;
            s.prefetch_loaded = p.loaded;
            s.prefetch_hits = p.hits;
            if let Some(r) = chain.ring().stats() {
                s.add_ring(&r);
            }
            if let Some(Layer::Qcow2(q)) = chain.layers().first() {
                let c = q.l2_cache_stats();
                s.l2_cache_hits = c.hits;
                s.l2_cache_misses = c.misses;
                s.l2_cache_evictions = c.evictions;
            }
        }
        s
    }

    /// The image no longer names its backing file (a stream dropped it): this channel's
    /// chain stops reading the backing bdev, now or when it is built.
    pub fn detach_backing(&self) {
        *self.under.borrow_mut() = Underneath::Detached;
        if let Some(c) = self.chain.get() {
            c.disk().detach_backing();
        }
    }

    /// A guest read (`submit_request`).
    #[inline(always)]
    fn read(&self, io: BdevIo) {
        self.accept();
        let Some(extent) = io.buffered_extent() else {
            return io.get_buf::<Channel>();
        };
        match self.chain.get() {
            Some(chain) => self.run(chain, Op::Read, io, extent),
            None => self.start(io),
        }
    }

    /// A guest read whose buffers are attached, before the replica is ready (or without
    /// one): forwarded to the owner (writable bdev) or read from this channel's replica.
    fn start(&self, io: BdevIo) {
        match self.forward_to {
            Some(md) if !self.has_replica() => self.forward_counted(md, io, Op::Read),
            _ => self.read_replica(io),
        }
    }

    /// A guest read on this channel's replica, queued until it is open.
    fn read_replica(&self, io: BdevIo) {
        if self.replica.get() == ReplicaState::Failed {
            return self.finish(io, false);
        }
        match self.chain.get() {
            Some(chain) => {
                let extent = io.extent();
                self.run(chain, Op::Read, io, extent)
            }
            None => self.queued.borrow_mut().push_back(io),
        }
    }

    /// A guest write (`submit_request`): an overwrite the plan's fast half grants
    /// ([`Chain::plan_write_fast`]) submitted with no call before the child's, any other out
    /// of line ([`write_planned`](Self::write_planned)): its calls save no registers here.
    #[inline(always)]
    fn write(&self, io: BdevIo) {
        if let Some(chain) = self.chain.get() {
            let (offset, len) = io.extent();
            if let Some(fast) = chain.plan_write_fast(offset, len) {
                self.accept();
                let target = &self.direct;
                let r =
                    direct::submit::<Channel, direct::Write>(self, chain, target, io, fast.grant);
                return match r {
                    Err(io) => self.refused(chain, io),
                    Ok(()) if fast.in_tail => chain.watch_tail(offset, len),
                    Ok(()) => {}
                };
            }
        }
        self.write_planned(io)
    }

    /// A write past the plan's fast half (as the replica's engine plans it, or on the
    /// owner while there is no replica): the channel's one loop, [`run`](Self::run).
    #[inline(never)]
    fn write_planned(&self, io: BdevIo) {
        self.accept();
        match (self.chain.get(), self.forward_to) {
            (Some(chain), _) => {
                let extent = io.extent();
                self.run(chain, Op::Write, io, extent)
            }
            (None, Some(md)) => self.forward_counted(md, io, Op::Write),
            // A read-only bdev whose replica is not open (or failed).
            (None, None) => self.finish(io, false),
        }
    }

    /// The channel's one loop: the replica's engine decides request `io` of `len` bytes at
    /// `offset` ([`Chain::plan`]) and the channel takes that step.
    #[inline(always)]
    fn run(&self, chain: &Rc<Chain<SpdkDevice>>, op: Op, io: BdevIo, (offset, len): (u64, u64)) {
        let req = Request::new(op, offset, len);
        match chain.plan(req, || io.data()) {
            Step::Direct(grant) => self.direct(chain, io, grant),
            Step::Task(task) => self.task(chain, io, task),
            Step::Owner(op) => self.to_owner(io, op),
            Step::Complete(r) => self.complete(io, r),
        }
    }

    /// One child I/O of the base with the request's own iovecs, as passthru does (or one
    /// device operation of the executor, for an encrypted image's crypt view); if the
    /// base refuses it (busy), the engine's task for the same request.
    #[inline(always)]
    fn direct(&self, chain: &Rc<Chain<SpdkDevice>>, io: BdevIo, grant: Grant) {
        let target = &self.direct;
        let r = match grant.is_write() {
            false => direct::submit::<Channel, direct::Read>(self, chain, target, io, grant),
            true => direct::submit::<Channel, direct::Write>(self, chain, target, io, grant),
        };
        if let Err(io) = r {
            self.refused(chain, io);
        }
    }

    /// A direct request the base refused: the engine runs it (out of line: rare).
    #[inline(never)]
    fn refused(&self, chain: &Rc<Chain<SpdkDevice>>, io: BdevIo) {
        let op = match io.io_type() == sys::SPDK_BDEV_IO_TYPE_WRITE {
            true => Op::Write,
            false => Op::Read,
        };
        let (offset, len) = io.extent();
        let task = chain.refused(Request::new(op, offset, len));
        self.task(chain, io, task);
    }

    /// Engine work on this channel's executor (out of line: the direct path stays small).
    /// A write in place may still end as `Outcome::ToOwner` (see `request_done`).
    #[inline(never)]
    fn task(&self, chain: &Rc<Chain<SpdkDevice>>, io: BdevIo, task: Task) {
        self.driver
            .submit(io, |tag, _, buf| chain.start(task, tag, Some(buf)));
    }

    /// A request the plan sent to the owner (out of line).
    #[inline(never)]
    fn to_owner(&self, io: BdevIo, op: Op) {
        match self.forward_to {
            // A write needing the owner's metadata: it reserves, this core writes.
            Some(md)
                if self.first_writes == FirstWrites::Core
                    && matches!(op, Op::Write | Op::WriteNotInPlace) =>
            {
                self.reserve(md, io, op)
            }
            Some(md) => self.forward(md, io, op),
            None => self.finish(io, false),
        }
    }

    /// Completes `io` with `r` (out of line).
    #[inline(never)]
    fn complete(&self, io: BdevIo, r: qcow2_engine::Result<()>) {
        if let Err(e) = &r {
            tracing::debug!("request failed: {e}");
        }
        self.finish_status(io, Status::of(&r));
    }

    /// Write zeroes, unmap and flush (`submit_request`): as the replica's engine plans them
    /// (the owner runs them), or on the owner while there is no replica.
    fn other(&self, io: BdevIo, op: Op) {
        self.accept();
        match (self.chain.get(), self.forward_to) {
            (Some(chain), _) => {
                let extent = io.extent();
                self.run(chain, op, io, extent)
            }
            (None, Some(md)) => self.forward_counted(md, io, op),
            (None, None) => self.finish(io, false),
        }
    }

    /// A write this channel ran in place is about to complete: no thread's prefetch ring
    /// may serve the bytes it replaced any more (a no-op while the image's ring is off).
    /// The image's generations, held here: one test per write, not the chain's and its
    /// ring's (and a channel whose own ring could not be allocated still bumps them).
    #[inline(always)]
    fn written(&self, io: &BdevIo) {
        if let Some((_, gens)) = &self.ring {
            // (The range read from the request only where some core reads ahead.)
            gens.written_of(|| (io.offset_bytes(), io.len_bytes()));
        }
    }

    fn finish(&self, io: BdevIo, ok: bool) {
        self.finish_status(io, Status::of_success(ok));
    }

    fn finish_status(&self, io: BdevIo, status: Status) {
        self.completed.set(self.completed.get() + 1);
        if status != Status::Success {
            self.errors.set(self.errors.get() + 1);
            if status == Status::NoSpace {
                self.no_space_errors.set(self.no_space_errors.get() + 1);
            }
        }
        status.complete(io);
    }

    /// Guest requests accepted and not completed (every request completed was accepted
    /// first: two counts, so that each end of a request bumps one).
    fn outstanding(&self) -> u64 {
        self.accepted.get().wrapping_sub(self.completed.get())
    }

    /// Counts a guest request accepted.
    #[inline(always)]
    fn accept(&self) {
        self.accepted.set(self.accepted.get() + 1);
    }

    /// Whether nothing is in flight (the channel may be freed).
    fn idle(&self) -> bool {
        !self.exec().busy() && self.outstanding() == 0
    }

    /// [`forward`](Self::forward) of a request the engine did not route (the engine counts
    /// those it sends to the owner itself): counted in the channel's `forwarded`.
    fn forward_counted(&self, md: Thread, io: BdevIo, op: Op) {
        self.forwarded.set(self.forwarded.get() + 1);
        self.forward(md, io, op);
    }

    /// Hands `io` to the owner (see [`owner::forward`]); the poller sends the outbox.
    #[inline(always)]
    fn forward(&self, md: Thread, io: BdevIo, op: Op) {
        owner::forward(md, io, op, &self.outbox);
        self.wake();
    }

    /// Resumes the poller if it paused itself while idle ([`Channel::poll`]): wherever the
    /// channel gets work only its poller does — a request for the owner in the outbox, a
    /// request or completion for its executor ([`Driver`]), an answer to resend, a reset
    /// waiting, SPDK putting the channel, a slice the owner sent. Not on the direct path: a
    /// read served there and its completion leave the poller paused.
    #[inline(always)]
    pub fn wake(&self) {
        self.driver.slot().resume();
    }

    /// Whether the poller may pause: the replica is open (or failed), nothing in its
    /// executor that needs a poll (a read waiting only on a bdev's callback does not: the
    /// callback completes it), nothing to send, no reset waiting, not closing. Inline:
    /// every idle pass of the poller asks it.
    #[inline]
    fn may_pause(&self) -> bool {
        matches!(
            self.replica.get(),
            ReplicaState::Ready | ReplicaState::Failed
        ) && !self.exec().needs_poll()
            && self.unsent_asks.borrow().is_empty()
            && self.outbox.is_empty()
            && self.reset_waiters.borrow().is_empty()
            && !self.closing.get()
            && !self.backing.draining()
    }
}

impl Host for Channel {
    fn driver(&self) -> &Driver {
        &self.driver
    }

    fn sinks(&self) -> &Sinks<Channel> {
        &self.sinks
    }

    fn request_done(&self, io: BdevIo, outcome: Outcome) {
        if io.ctx().reserving() {
            return self.reserved_written(io, outcome);
        }
        let write = io.io_type() == sys::SPDK_BDEV_IO_TYPE_WRITE;
        match outcome {
            // A read whose backing bdev gave this thread no I/O channel (ENOMEM, from
            // `BaseDevice`'s lazy open): the owner reads it through its own.
            Outcome::Done(Err(Error::Io(libc::ENOMEM)))
                if io.io_type() == sys::SPDK_BDEV_IO_TYPE_READ =>
            {
                match self.forward_to {
                    Some(md) => self.forward_counted(md, io, Op::Read),
                    None => self.complete(io, Err(Error::Io(libc::ENOMEM))),
                }
            }
            Outcome::Done(r) => {
                if write {
                    self.written(&io);
                }
                self.complete(io, r)
            }
            // Not an in-place write after all: the owner runs it.
            Outcome::ToOwner => self.to_owner(io, if write { Op::Write } else { Op::Read }),
        }
    }
}

/// A channel's direct-path requests (`direct.rs`): found again through the channel state
/// their bdev_io recorded when they arrived, completed on the channel's thread.
impl DirectHost for Channel {
    #[inline(always)]
    fn with_host<R>(io: BdevIo, f: impl FnOnce(&Channel, BdevIo) -> R) -> R {
        io.with_recorded_channel(f)
    }

    #[inline(always)]
    fn written(&self, io: &BdevIo) {
        Channel::written(self, io)
    }

    #[inline(always)]
    fn complete_direct(&self, io: BdevIo, success: bool) {
        // `finish` written out for a child's outcome: no `Status` on the direct path.
        self.completed.set(self.completed.get() + 1);
        if success {
            io.complete(sys::SPDK_BDEV_IO_STATUS_SUCCESS)
        } else {
            self.errors.set(self.errors.get() + 1);
            io.complete(sys::SPDK_BDEV_IO_STATUS_FAILED)
        }
    }
}

/// A read's buffer arrived (`BdevIo::get_buf`).
impl BufDone<Qcow2Bdev> for Channel {
    fn buf_done(io: BdevIo, success: bool) {
        io.with_channel(|c, io| {
            if success {
                c.start(io);
            } else {
                c.finish(io, false);
            }
        });
    }
}

/// Completes a request the owner ran, on the thread (and channel) it was submitted on, with
/// the status it carries back.
pub fn complete_forwarded(io: BdevIo) {
    if io.ctx().reserving() {
        return io.with_channel(|c, io| c.reservation_back(io));
    }
    let status = io.ctx().status();
    io.with_channel(|c, io| c.finish_status(io, status));
}

impl Polled for Channel {
    fn sinks(&self) -> Option<&Sinks<Channel>> {
        Some(&self.sinks)
    }

    fn slot(&self) -> &PollerSlot {
        self.driver.slot()
    }

    /// The channel's poller: the executor, opening the replica, resending, forwarded
    /// requests, resets, and freeing the state once SPDK put the channel and it is idle.
    #[inline(always)]
    fn poll(&self) -> Poll {
        // Idle (or a writable bdev's forwarding channel): nothing for the executor to do.
        let mut n = self.driver.poll(self);
        // (The chain first: once it is built, this poll's idle checks stay cheap.)
        if self.replica.get() == ReplicaState::Opening
            && (self.forward_to.is_none() || self.opened.borrow().is_some())
        {
            self.try_ready();
            n += 1;
        }
        if !self.unsent_asks.borrow().is_empty() {
            let asks = std::mem::take(&mut *self.unsent_asks.borrow_mut());
            for a in asks {
                n += 1;
                send_ask(a);
            }
        }
        if let Some(md) = self.forward_to {
            if owner::send_forwarded(md, &self.outbox) {
                n += 1;
            }
        }
        if self.backing.draining() {
            self.backing.settle(self);
        }
        if self.outstanding() == 0 && !self.reset_waiters.borrow().is_empty() {
            let waiters = std::mem::take(&mut *self.reset_waiters.borrow_mut());
            for it in waiters {
                it.next(0);
            }
        }
        if self.closing.get() && self.idle() {
            // SPDK put the channel and nothing is in flight: the last poll.
            return Poll::Done;
        }
        if n > 0 {
            return Poll::Busy;
        }
        // Idle with nothing pending (e.g. reads on the direct path, which complete from
        // SPDK's callback): SPDK stops calling the poller until `wake`.
        if self.may_pause() {
            self.driver.slot().pause();
        }
        Poll::Idle
    }
}

/// Requests reach the channel they were submitted on ([`submit_request`]).
impl Requests for Qcow2Bdev {
    #[inline(always)]
    fn submit_request(c: &Channel, io: BdevIo, kind: sys::spdk_bdev_io_type) {
        submit_request(c, io, kind)
    }
}

/// `fn_table.submit_request` (through `ffi::bdev_io`): the one switch on the I/O type.
/// Reads and writes run on this channel (its replica, the direct path, the engine) or go to
/// the owner; what only the owner can run goes there; anything else fails.
#[inline(always)]
pub fn submit_request(c: &Channel, io: BdevIo, t: sys::spdk_bdev_io_type) {
    // Reads and writes by two compares; a match over every type compiles to a jump table,
    // an indirect branch and a few instructions more on each request.
    if t == sys::SPDK_BDEV_IO_TYPE_READ {
        c.read(io)
    } else if t == sys::SPDK_BDEV_IO_TYPE_WRITE {
        c.write(io)
    } else {
        submit_other(c, io, t)
    }
}

/// [`submit_request`] for every type but reads and writes (out of line).
#[inline(never)]
fn submit_other(c: &Channel, io: BdevIo, t: sys::spdk_bdev_io_type) {
    match t {
        sys::SPDK_BDEV_IO_TYPE_WRITE_ZEROES => c.other(io, Op::WriteZeroes),
        sys::SPDK_BDEV_IO_TYPE_UNMAP => c.other(io, Op::Discard),
        sys::SPDK_BDEV_IO_TYPE_FLUSH => c.other(io, Op::Flush),
        sys::SPDK_BDEV_IO_TYPE_RESET => io.for_each_channel(hooks::reset_step, hooks::reset_done),
        _ => io.complete(sys::SPDK_BDEV_IO_STATUS_FAILED),
    }
}
