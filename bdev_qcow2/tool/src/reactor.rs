//! N polling reactors on one image (ARCHITECTURE.md §3), the same shape as the SPDK module:
//! reactor 0 is the metadata owner (it opens the image writable and shares it), every other
//! reactor is a core with its own executor, device channel (its own io_uring) and slice
//! cache replica. Cores serve cache-hit reads and in-place writes themselves; they send
//! everything else (allocating writes, discard, write-zeroes, flush) and their requests for
//! dirty slices to the owner over lock-free queues (crossbeam `SegQueue`) that every
//! reactor polls. Nothing blocks and nothing sleeps on a reactor.
//!
//! Reads and writes are routed by the engine calls the SPDK module uses
//! ([`Chain::route_read`], [`Chain::route_write`]): a direct grant goes to this reactor's
//! device at once, the engine path runs on this reactor, and a write for the owner is
//! forwarded.

use crate::host::{ToolError, ToolResult};
use crossbeam_queue::SegQueue;
use qcow2_engine::coherency::SliceReply;
use qcow2_engine::exec::Outcome;
use qcow2_engine::io::{BlockDevice, BufSlice, IoBuffer};
use qcow2_engine::ring::{RingConfig, WriteGens};
use qcow2_engine::{
    Chain, CoreSeed, DevId, Exec, GraceEntry, Layer, Op, OpenOptions, OwnerLink, Qcow2, Request,
    Reserved, Step, Ticket,
};
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};

/// Tag bit the owner uses for requests it runs on behalf of a core.
const FORWARDED: u64 = 1 << 63;
/// Tag bit of a core's write on its engine path (it may end as [`Outcome::ToOwner`]).
const LOCAL_WRITE: u64 = 1 << 62;
/// Tag bit of a write whose completion moves the image's write generations first (the
/// prefetch ring is on): the rest of the tag is its slot in `Reactor::ring_writes`.
const RING_WRITE: u64 = 1 << 61;
/// Tag bit of a core's data write into clusters the owner reserved for it (its
/// completion goes back to the owner, which commits the mapping): the rest of the tag is
/// its slot in `Reactor::reserved`.
const RESERVED_WRITE: u64 = 1 << 60;

/// Messages to the owner.
enum ToOwner {
    Ask {
        core: usize,
        key: u64,
        ticket: u64,
    },
    /// A guest request the core's plan sent here, with its data (reads and writes).
    Request {
        core: usize,
        tag: u64,
        req: Request,
        data: Option<Vec<u8>>,
    },
    /// A first write the core found not in place, without its data: the owner plans it
    /// and answers where the core writes it ([`Chain::reserve_write`]).
    Reserve {
        core: usize,
        /// The write's slot in the core's `Reactor::reserving`.
        slot: usize,
        offset: u64,
        len: u64,
    },
    /// The core's data write of a reservation ended: the owner commits it (or frees its
    /// clusters) and answers `Done` for `tag`.
    Written {
        core: usize,
        tag: u64,
        ticket: Ticket,
        result: qcow2_engine::Result<()>,
    },
    /// The data of a reservation the owner writes itself ([`Reserved::Data`]).
    Data {
        core: usize,
        tag: u64,
        ticket: Ticket,
        data: Vec<u8>,
    },
}

/// Messages to a core.
enum ToCore {
    Slice {
        ticket: u64,
        reply: SliceReply,
    },
    Done {
        tag: u64,
        result: qcow2_engine::Result<()>,
    },
    /// The owner's answer to `Reserve` for the write in `slot`.
    Reserved {
        slot: usize,
        answer: Reserved,
    },
}

/// The queues between reactors.
struct Mesh {
    owner: SegQueue<ToOwner>,
    cores: Vec<SegQueue<ToCore>>,
    /// Cores still running (the owner serves until it is 0).
    running: AtomicUsize,
    /// Set when the owner stopped (cores waiting for it give up instead of spinning).
    owner_gone: std::sync::atomic::AtomicBool,
}

/// Signs a core off when its thread ends, even by a panic (the owner must not wait on it).
struct SignOff<'a>(&'a Mesh);
impl Drop for SignOff<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Marks the owner gone when its thread ends (cores stop waiting for it).
struct OwnerGone<'a>(&'a Mesh);
impl Drop for OwnerGone<'_> {
    fn drop(&mut self) {
        self.0.owner_gone.store(true, Ordering::Release);
    }
}

struct QueueLink {
    core: usize,
    mesh: Arc<Mesh>,
}

impl OwnerLink for QueueLink {
    fn ask_slice(&self, key: u64, ticket: u64) {
        self.mesh.owner.push(ToOwner::Ask {
            core: self.core,
            key,
            ticket,
        });
    }
}

/// Counters of one reactor.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReactorStats {
    /// Writes served on this core (in place).
    pub local_writes: u64,
    /// Requests sent to the owner.
    pub forwarded: u64,
    /// Slices asked from the owner.
    pub slice_asks: u64,
    /// Requests served for other cores (owner).
    pub served: u64,
    /// Messages this reactor took from its queue (other reactors sent them).
    pub received: u64,
}

/// One reactor: its executor, its chain (the owner's image or a core replica) and its ends
/// of the queues. Lives on its own thread.
pub struct Reactor<D: BlockDevice> {
    /// This reactor's index (0: the owner).
    id: usize,
    exec: Exec<D>,
    chain: Rc<Chain<D>>,
    dev: DevId,
    mesh: Arc<Mesh>,
    /// Owner: (core, tag) of forwarded requests in flight.
    forwarded: slab::Slab<(usize, u64)>,
    /// Core: requests sent to the owner and not yet answered.
    pending: usize,
    /// Core: writes tried here, by slot: (tag, offset, buffer) to send to the owner if they
    /// turn out not to be in-place writes.
    local: slab::Slab<(u64, u64, BufSlice<D::Buf>)>,
    /// Core: writes waiting for the owner's answer, by slot: (tag, offset, buffer, grace).
    reserving: slab::Slab<(u64, u64, BufSlice<D::Buf>, GraceEntry)>,
    /// Core: data writes into reserved clusters in flight, by slot: (tag, ticket).
    reserved: slab::Slab<(u64, Ticket)>,
    /// With the prefetch ring on: writes in flight, by slot: (tag, offset, length), whose
    /// range the completion invalidates in every core's ring before it is reported.
    ring_writes: slab::Slab<(u64, u64, u64)>,
    stats: ReactorStats,
}

impl<D: BlockDevice> Reactor<D> {
    /// This reactor's index (0: the owner).
    pub fn id(&self) -> usize {
        self.id
    }

    /// Its executor.
    pub fn exec(&self) -> &Exec<D> {
        &self.exec
    }

    /// Its chain (the owner's image or a core replica, with the backing layers).
    pub fn chain(&self) -> &Rc<Chain<D>> {
        &self.chain
    }

    /// This core's channel to the image's device.
    pub fn dev(&self) -> DevId {
        self.dev
    }

    /// Whether this is the metadata owner.
    pub fn is_owner(&self) -> bool {
        self.id == 0
    }

    /// Counters so far.
    pub fn stats(&self) -> ReactorStats {
        let r = self.chain.counters().requests();
        ReactorStats {
            local_writes: r.writes_here,
            forwarded: r.to_owner,
            ..self.stats
        }
    }

    fn image(&self) -> Option<&Qcow2<D>> {
        match &self.chain.layers()[0] {
            Layer::Qcow2(q) => Some(q),
            Layer::Raw { .. } => None,
        }
    }

    /// L2 slice cache counters of this reactor.
    pub fn cache_stats(&self) -> qcow2_engine::cache::CacheStats {
        self.image().map(|q| q.l2_cache_stats()).unwrap_or_default()
    }

    /// Starts guest request `req` under `tag` (tags below 2^60 - 1: the reactor uses the
    /// bits above), with its buffer (`None` for write zeroes, discard, flush): the engine
    /// decides it ([`Chain::plan`]) and this reactor takes the step — completes it, reads
    /// or writes the granted extent on its device, starts the engine's task, or sends it
    /// to the owner.
    pub fn submit(&mut self, tag: u64, req: Request, buf: Option<BufSlice<D::Buf>>) {
        let tag = match req.op.changes_data() {
            true => self.ring_tag(tag, req.offset, req.len),
            false => tag,
        };
        self.take_step(tag, req, buf);
    }

    /// The reactor's one loop, for its own requests and (on the owner) those the cores
    /// sent: the engine plans `req` and the reactor takes the step.
    fn take_step(&mut self, tag: u64, req: Request, buf: Option<BufSlice<D::Buf>>) {
        let step = match &buf {
            Some(b) => self.chain.plan(req, || b.clone()),
            None => self.chain.plan(req, || -> BufSlice<D::Buf> {
                unreachable!("a request without data")
            }),
        };
        match step {
            Step::Complete(r) => self.exec.complete(tag, r),
            Step::Direct(grant) => match buf {
                Some(b) => self.chain.submit_direct(tag, grant, b),
                None => {
                    let task = self.chain.not_submitted(grant);
                    self.chain.start(task, tag, None)
                }
            },
            Step::Task(task) => {
                // A core's write in place may still end as `Outcome::ToOwner`: kept to
                // send then.
                let tag = match (req.op, &buf, self.is_owner()) {
                    (Op::Write, Some(b), false) => {
                        LOCAL_WRITE | self.local.insert((tag, req.offset, b.clone())) as u64
                    }
                    _ => tag,
                };
                self.chain.start(task, tag, buf)
            }
            // The owner hands nothing to itself.
            Step::Owner(_) if self.is_owner() => {
                let e = qcow2_engine::Error::InvalidRequest("sent to the owner by the owner");
                self.exec.complete(tag, Err(e))
            }
            // A write the owner decides: this core writes its data where the owner says.
            Step::Owner(Op::Write | Op::WriteNotInPlace) if buf.is_some() => {
                let Some(b) = buf else { return };
                self.reserve(tag, req.offset, b);
            }
            Step::Owner(op) => self.forward_request(tag, Request { op, ..req }, buf.as_ref()),
        }
    }

    /// Starts a read of `buf.len` bytes at `offset` ([`submit`](Self::submit)).
    pub fn submit_read(&mut self, tag: u64, offset: u64, buf: BufSlice<D::Buf>) {
        let req = Request::new(Op::Read, offset, buf.len as u64);
        self.submit(tag, req, Some(buf));
    }

    /// Starts a write of `buf` at `offset` ([`submit`](Self::submit)).
    pub fn submit_write(&mut self, tag: u64, offset: u64, buf: BufSlice<D::Buf>) {
        let req = Request::new(Op::Write, offset, buf.len as u64);
        self.submit(tag, req, Some(buf));
    }

    /// Starts a write-zeroes ([`submit`](Self::submit)).
    pub fn submit_write_zeroes(&mut self, tag: u64, offset: u64, len: u64, unmap: bool) {
        let op = match unmap {
            true => Op::WriteZeroesUnmap,
            false => Op::WriteZeroes,
        };
        self.submit(tag, Request::new(op, offset, len), None);
    }

    /// Starts a discard ([`submit`](Self::submit)).
    pub fn submit_discard(&mut self, tag: u64, offset: u64, len: u64) {
        self.submit(tag, Request::new(Op::Discard, offset, len), None);
    }

    /// Starts a flush (every write completed before it, on any core, is durable after it:
    /// the owner flushes the file all reactors write to).
    pub fn submit_flush(&mut self, tag: u64) {
        self.submit(tag, Request::new(Op::Flush, 0, 0), None);
    }

    /// Sends `req` to the owner, its data copied into the message.
    fn forward_request(&mut self, tag: u64, req: Request, buf: Option<&BufSlice<D::Buf>>) {
        let data = buf.map(|b| {
            let mut data = vec![0u8; b.len];
            b.copy_out(0, &mut data);
            data
        });
        self.pending += 1;
        self.mesh.owner.push(ToOwner::Request {
            core: self.id,
            tag,
            req,
            data,
        });
    }

    /// The tag a write of `len` bytes at `offset` runs under: with the ring on, one that
    /// makes its completion invalidate the range first ([`poll`](Self::poll)).
    fn ring_tag(&mut self, tag: u64, offset: u64, len: u64) -> u64 {
        if self.chain.ring().write_gens().is_none() {
            return tag;
        }
        RING_WRITE | self.ring_writes.insert((tag, offset, len)) as u64
    }

    /// Polls the queues and the executor; reports finished requests to `done`. A write's
    /// completion (with the prefetch ring on) first moves the write generations of its
    /// range, so no core's ring serves the old bytes to a read submitted after it.
    pub fn poll(&mut self, done: &mut dyn FnMut(u64, qcow2_engine::Result<()>)) -> usize {
        if self.ring_writes.is_empty() {
            return self.poll_queues(done);
        }
        let mut writes = std::mem::take(&mut self.ring_writes);
        let chain = self.chain.clone();
        let n = self.poll_queues(&mut |tag, r| {
            if tag & RING_WRITE == 0 {
                return done(tag, r);
            }
            if let Some((t, off, len)) = writes.try_remove((tag & !RING_WRITE) as usize) {
                chain.ring().written(off, len);
                done(t, r)
            }
        });
        self.ring_writes = writes;
        n
    }

    fn poll_queues(&mut self, done: &mut dyn FnMut(u64, qcow2_engine::Result<()>)) -> usize {
        let mut n = 0;
        if self.is_owner() {
            while let Some(m) = self.mesh.owner.pop() {
                n += 1;
                self.stats.received += 1;
                self.serve(m);
            }
            // Dirty metadata that waited long enough for a flush goes back on its own, so
            // the cores take overwrites into its slices again.
            if self.chain.tick_background_writeback() {
                n += 1;
            }
            // Zones every read-ahead left stop costing writes their generation bump.
            self.chain.ring().tick_zones();
            let mesh = &self.mesh;
            let fwd = &mut self.forwarded;
            // The owner's requests always complete (it hands nothing to itself).
            n += self.exec.poll_outcomes(&mut |tag, o| {
                let r = o.into_result();
                if tag & FORWARDED != 0 {
                    if let Some((core, t)) = fwd.try_remove((tag & !FORWARDED) as usize) {
                        mesh.cores[core - 1].push(ToCore::Done { tag: t, result: r });
                    }
                } else {
                    done(tag, r)
                }
            });
        } else {
            while let Some(m) = self.mesh.cores[self.id - 1].pop() {
                n += 1;
                self.stats.received += 1;
                match m {
                    ToCore::Slice { ticket, reply } => {
                        self.stats.slice_asks += 1;
                        if let Some(q) = self.image() {
                            q.deliver_slice(ticket, reply);
                        }
                    }
                    ToCore::Done { tag, result } => {
                        self.pending -= 1;
                        done(tag, result);
                    }
                    ToCore::Reserved { slot, answer } => self.reserved_answer(slot, answer),
                }
            }
            let local = &mut self.local;
            let (reserved, mesh, id) = (&mut self.reserved, &self.mesh, self.id);
            let mut again = Vec::new();
            n += self.exec.poll_outcomes(&mut |tag, o| {
                if tag & RESERVED_WRITE != 0 {
                    // Still pending: the owner commits and answers `Done`.
                    if let Some((tag, ticket)) =
                        reserved.try_remove((tag & !RESERVED_WRITE) as usize)
                    {
                        let result = o.into_result();
                        mesh.owner.push(ToOwner::Written {
                            core: id,
                            tag,
                            ticket,
                            result,
                        });
                    }
                    return;
                }
                if tag & LOCAL_WRITE == 0 {
                    return done(tag, o.into_result());
                }
                let Some((t, off, buf)) = local.try_remove((tag & !LOCAL_WRITE) as usize) else {
                    return;
                };
                match o {
                    Outcome::ToOwner => again.push((t, off, buf)),
                    Outcome::Done(r) => done(t, r),
                }
            });
            for (t, off, buf) in again {
                // Not in place after all: the owner decides it (it may allocate).
                self.reserve(t, off, buf);
            }
            // Waiting on the owner, nothing moved: the CPU to the owner or a worker (no sleep).
            if n == 0 && self.pending > 0 {
                std::thread::yield_now();
            }
        }
        n
    }

    /// Core: sends a write that is not in place here to the owner without its data
    /// ([`Chain::reserve_write`]), in the grace period until this core wrote it.
    fn reserve(&mut self, tag: u64, offset: u64, buf: BufSlice<D::Buf>) {
        let len = buf.len as u64;
        let entry = self.exec.guest_enter();
        let slot = self.reserving.insert((tag, offset, buf, entry));
        self.pending += 1;
        self.mesh.owner.push(ToOwner::Reserve {
            core: self.id,
            slot,
            offset,
            len,
        });
    }

    /// Core: the owner's answer to a write sent without its data.
    fn reserved_answer(&mut self, slot: usize, answer: Reserved) {
        let Some((tag, offset, buf, entry)) = self.reserving.try_remove(slot) else {
            return;
        };
        match answer {
            Reserved::InPlace { host } => {
                self.pending -= 1;
                self.chain.write_reserved(tag, host, buf, entry);
                self.chain.answered_in_place(offset);
            }
            Reserved::Write { ticket, host } => {
                let t = RESERVED_WRITE | self.reserved.insert((tag, ticket)) as u64;
                self.chain.write_reserved(t, host, buf, entry);
            }
            Reserved::Data(ticket) => {
                self.exec.guest_exit(entry);
                let mut data = vec![0u8; buf.len];
                buf.copy_out(0, &mut data);
                let core = self.id;
                self.mesh.owner.push(ToOwner::Data {
                    core,
                    tag,
                    ticket,
                    data,
                });
            }
            Reserved::Send => {
                self.exec.guest_exit(entry);
                // Counted once: `forward_request` counts it again.
                self.pending -= 1;
                let req = Request::new(Op::Write, offset, buf.len as u64);
                self.forward_request(tag, req, Some(&buf));
            }
        }
    }

    fn serve(&mut self, m: ToOwner) {
        match m {
            ToOwner::Reserve {
                core,
                slot,
                offset,
                len,
            } => {
                self.stats.served += 1;
                let answer = self.chain.reserve_write(offset, len);
                self.mesh.cores[core - 1].push(ToCore::Reserved { slot, answer });
            }
            ToOwner::Written {
                core,
                tag,
                ticket,
                result,
            } => {
                let t = FORWARDED | self.forwarded.insert((core, tag)) as u64;
                self.chain.commit_reserved(ticket, t, result);
            }
            ToOwner::Data {
                core,
                tag,
                ticket,
                data,
            } => {
                let t = FORWARDED | self.forwarded.insert((core, tag)) as u64;
                let buf = self.exec.alloc_buf(self.dev, data.len());
                buf.copy_in(0, &data);
                self.chain.run_reserved(ticket, t, BufSlice::whole(buf));
            }
            ToOwner::Ask { core, key, ticket } => {
                let reply = match self.image() {
                    Some(q) => q.slice_for_core(key),
                    None => SliceReply::Retry,
                };
                self.mesh.cores[core - 1].push(ToCore::Slice { ticket, reply });
            }
            ToOwner::Request {
                core,
                tag,
                req,
                data,
            } => {
                self.stats.served += 1;
                let t = FORWARDED | self.forwarded.insert((core, tag)) as u64;
                let buf = data.map(|data| {
                    let buf = self.exec.alloc_buf(self.dev, data.len());
                    buf.copy_in(0, &data);
                    BufSlice::whole(buf)
                });
                self.take_step(t, req, buf);
            }
        }
    }

    /// Reads `buf` at `offset`, polling until done (set-up and checks, not the hot path).
    pub fn read_now(&mut self, offset: u64, buf: BufSlice<D::Buf>) -> qcow2_engine::Result<()> {
        const TAG: u64 = RESERVED_WRITE - 1;
        self.submit_read(TAG, offset, buf);
        let mut res = None;
        while res.is_none() {
            self.poll(&mut |t, r| {
                if t == TAG {
                    res = Some(r);
                }
            });
        }
        res.unwrap_or(Ok(()))
    }

    /// Finishes this reactor: a core waits for its forwarded requests and signs off; the
    /// owner serves the cores until every one signed off, then writes all metadata back
    /// and closes the image.
    fn finish(mut self) -> ToolResult<ReactorStats> {
        if self.is_owner() {
            while self.mesh.running.load(Ordering::Acquire) > 0 || !self.forwarded.is_empty() {
                self.poll(&mut |_, _| {});
            }
            // Drain anything the executor still runs (e.g. requests the body left).
            while self.exec.busy() {
                self.poll(&mut |_, _| {});
            }
            if self.image().is_some_and(|q| q.is_writable()) {
                let c = self.chain.clone();
                self.exec
                    .block_on(async move { c.close().await })
                    .map_err(|source| ToolError::Engine {
                        path: "owner".into(),
                        source,
                    })?;
            }
        } else {
            while self.pending > 0
                || self.exec.busy()
                || !self.local.is_empty()
                || !self.reserved.is_empty()
            {
                if self.mesh.owner_gone.load(Ordering::Acquire) {
                    return Err(ToolError::Usage("the owner reactor stopped".into()));
                }
                self.poll(&mut |_, _| {});
            }
        }
        Ok(self.stats())
    }
}

/// How [`run_reactors`] opens the image's device on each reactor (its own channel: its own
/// io_uring on the same file).
pub trait OpenDevice<D>: Sync {
    /// Opens the device for reactor `id`. Only reactor 0 (the owner) may change the
    /// device's length (see [`UringDevice::into_channel`](crate::uring::UringDevice::into_channel)).
    fn open(&self, id: usize, writable: bool) -> ToolResult<D>;
}

impl<D, F: Fn(usize, bool) -> ToolResult<D> + Sync> OpenDevice<D> for F {
    fn open(&self, id: usize, writable: bool) -> ToolResult<D> {
        self(id, writable)
    }
}

/// Runs `body` on `n` reactors (threads) over one image: reactor 0 opens it (writable if
/// `writable`) and owns its metadata; the others get replicas. Returns each reactor's
/// result and counters, reactor 0 first. The image is closed cleanly when this returns.
/// The prefetch ring is off ([`run_reactors_with_ring`]).
pub fn run_reactors<D, R, B>(
    n: usize,
    open: &dyn OpenDevice<D>,
    opts: OpenOptions,
    writable: bool,
    body: B,
) -> ToolResult<Vec<(R, ReactorStats)>>
where
    D: BlockDevice,
    R: Send,
    B: Fn(&mut Reactor<D>) -> ToolResult<R> + Sync,
{
    run_reactors_with_ring(n, open, opts, writable, None, body)
}

/// [`run_reactors`] with the prefetch ring of `ring` on every reactor (`None`: off): each
/// allocates its ring buffer from its own device when it starts, and all share the
/// image's write generations.
pub fn run_reactors_with_ring<D, R, B>(
    n: usize,
    open: &dyn OpenDevice<D>,
    opts: OpenOptions,
    writable: bool,
    ring: Option<RingConfig>,
    body: B,
) -> ToolResult<Vec<(R, ReactorStats)>>
where
    D: BlockDevice,
    R: Send,
    B: Fn(&mut Reactor<D>) -> ToolResult<R> + Sync,
{
    run_reactors_keyed(n, open, opts, writable, ring, None, body)
}

/// [`run_reactors_with_ring`] on an encrypted image, unlocked with `key` on the owner (its
/// replicas take the cipher from the owner's seed).
#[allow(clippy::too_many_arguments)]
pub fn run_reactors_keyed<D, R, B>(
    n: usize,
    open: &dyn OpenDevice<D>,
    opts: OpenOptions,
    writable: bool,
    ring: Option<RingConfig>,
    key: Option<crate::secrets::Secret>,
    body: B,
) -> ToolResult<Vec<(R, ReactorStats)>>
where
    D: BlockDevice,
    R: Send,
    B: Fn(&mut Reactor<D>) -> ToolResult<R> + Sync,
{
    let n = n.max(1);
    let mesh = Arc::new(Mesh {
        owner: SegQueue::new(),
        cores: (1..n).map(|_| SegQueue::new()).collect(),
        running: AtomicUsize::new(n - 1),
        owner_gone: std::sync::atomic::AtomicBool::new(false),
    });
    let engine = |source| ToolError::Engine {
        path: "image".into(),
        source,
    };
    std::thread::scope(|s| {
        let mut seed_tx = Vec::new();
        let mut handles = Vec::new();
        for id in 1..n {
            let (tx, rx) = mpsc::channel::<Option<(CoreSeed, Option<Arc<WriteGens>>)>>();
            seed_tx.push(tx);
            let (mesh, body) = (mesh.clone(), &body);
            handles.push(s.spawn(move || -> ToolResult<(R, ReactorStats)> {
                let mesh2 = mesh.clone();
                let _signoff = SignOff(&mesh2);
                let Ok(Some((seed, gens))) = rx.recv() else {
                    return Err(ToolError::Usage(
                        "the owner failed to open the image".into(),
                    ));
                };
                let exec: Exec<D> = Exec::new();
                let dev = exec.add_device(open.open(id, writable)?);
                let link = Box::new(QueueLink {
                    core: id,
                    mesh: mesh.clone(),
                });
                let chain = Qcow2::from_seed(seed, &exec, dev, opts, link)
                    .and_then(|q| Chain::new(&exec, vec![Layer::Qcow2(Box::new(q))]));
                let chain = chain.map_err(engine)?;
                chain.prefetch().set_on(true);
                if let (Some(cfg), Some(gens)) = (ring, gens) {
                    chain.enable_ring(cfg, gens).map_err(engine)?;
                }
                let mut r = Reactor {
                    id,
                    exec,
                    chain,
                    dev,
                    mesh,
                    forwarded: slab::Slab::new(),
                    pending: 0,
                    local: slab::Slab::with_capacity(256),
                    reserving: slab::Slab::with_capacity(256),
                    reserved: slab::Slab::with_capacity(256),
                    ring_writes: slab::Slab::with_capacity(256),
                    stats: ReactorStats::default(),
                };
                let out = body(&mut r);
                let stats = r.finish()?;
                Ok((out?, stats))
            }));
        }
        let owner = (|| -> ToolResult<(R, ReactorStats)> {
            let _gone = OwnerGone(&mesh);
            let exec: Exec<D> = Exec::new();
            let dev = exec.add_device(open.open(0, writable)?);
            let e2 = exec.clone();
            let o = OpenOptions { writable, ..opts };
            let mut q = exec
                .block_on(crate::host::open_qcow2(e2, dev, o, key.clone(), true))
                .map_err(engine)?;
            if q.header().backing_file.is_some() {
                return Err(ToolError::Usage(
                    "multi-core reactors run images without a backing file".into(),
                ));
            }
            if n > 1 {
                // Before the first image is shared or has write generations (the fence
                // mode is fixed then).
                qcow2_engine::coherency::fences::install_membarrier();
            }
            let gens = ring.map(|_| Arc::new(WriteGens::new()));
            // One reactor alone needs no replicas, epochs nor grace periods.
            if n > 1 {
                q.share();
                let seed = q.core_seed().map_err(engine)?;
                for tx in seed_tx.drain(..) {
                    let _ = tx.send(Some((seed.clone(), gens.clone())));
                }
            }
            let chain = Chain::new(&exec, vec![Layer::Qcow2(Box::new(q))]).map_err(engine)?;
            chain.prefetch().set_on(true);
            if let (Some(cfg), Some(gens)) = (ring, gens) {
                chain.enable_ring(cfg, gens).map_err(engine)?;
            }
            let mut r = Reactor {
                id: 0,
                exec,
                chain,
                dev,
                mesh: mesh.clone(),
                forwarded: slab::Slab::new(),
                pending: 0,
                local: slab::Slab::new(),
                reserving: slab::Slab::new(),
                reserved: slab::Slab::new(),
                ring_writes: slab::Slab::with_capacity(256),
                stats: ReactorStats::default(),
            };
            let out = body(&mut r);
            let stats = r.finish()?;
            Ok((out?, stats))
        })();
        // A failed owner releases the cores waiting for their seed.
        drop(seed_tx);
        let mut results = vec![owner];
        for h in handles {
            results.push(
                h.join()
                    .unwrap_or_else(|_| Err(ToolError::Usage("a reactor panicked".into()))),
            );
        }
        results.into_iter().collect()
    })
}
