//! One decision per guest request: [`Chain::plan`] looks at the prefetch ring, routes the
//! request from cached metadata, feeds read-ahead, marks the persistent bitmaps and counts
//! it, and returns the one [`Step`] the host takes. A host runs that step and nothing else:
//! it submits a [`Grant`] as one device I/O with the request's own buffers, hands a
//! [`Task`] to [`Chain::start`], sends [`Step::Owner`] to the metadata owner, or completes
//! the request. Both hosts (the SPDK module's channels and metadata thread, the tool's
//! reactors) are that loop; the policy lives here, once.

use crate::chain::Chain;
pub use crate::chain::RequestStats;
use crate::direct::PastMemo;
use crate::error::{Error, Result};
use crate::exec::GraceEntry;
use crate::io::{BlockDevice, BufSlice, DeviceOp, LentBuf};
use crate::memo::Spot;
use crate::ring::{Passes, RingServed, RingWait};
use crate::route::{
    Access, FoundBy, Grant, GuestRange, ReadRoute, Role, WriteDecision, WriteRoute,
};
use crate::types::HostOffset;
use std::rc::Rc;

/// An overwrite the write plan's fast half granted ([`Chain::plan_write_fast`]).
#[must_use = "a grant ends only in its submission or Chain::not_submitted"]
pub struct FastWrite {
    /// What the host submits.
    pub grant: Grant,
    /// The write ends in its slice's tail: once the host submitted it, it calls
    /// [`Chain::watch_tail`].
    pub in_tail: bool,
}

/// What a guest request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Read.
    Read,
    /// Write.
    Write,
    /// A write a core replica found not in place (an allocation, COW, zero clusters) with
    /// current metadata: the owner, which holds the same metadata, starts its slow path at
    /// once instead of looking for an in-place extent first.
    WriteNotInPlace,
    /// Write zeroes; the clusters stay allocated.
    WriteZeroes,
    /// Write zeroes; whole clusters may be deallocated.
    WriteZeroesUnmap,
    /// Discard (SPDK's unmap).
    Discard,
    /// Flush: every write completed before it is durable after it.
    Flush,
}

impl Op {
    /// Whether the request carries guest data (its buffer is the engine's to read or fill).
    #[inline(always)]
    pub fn has_data(self) -> bool {
        matches!(self, Op::Read | Op::Write | Op::WriteNotInPlace)
    }

    /// Whether the request changes the disk's bytes (the prefetch ring of every core must
    /// stop serving what it replaced before it completes).
    #[inline(always)]
    pub fn changes_data(self) -> bool {
        !matches!(self, Op::Read | Op::Flush)
    }
}

/// A guest request: what, where, how long (bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// What it asks for.
    pub op: Op,
    /// Guest offset in bytes.
    pub offset: u64,
    /// Length in bytes (0 for a flush).
    pub len: u64,
}

impl Request {
    /// A request of `op` over `len` bytes at `offset`.
    #[inline(always)]
    pub fn new(op: Op, offset: u64, len: u64) -> Request {
        Request { op, offset, len }
    }
}

/// What the host does with a guest request ([`Chain::plan`]).
#[must_use = "a step is the request's only way on (a grant holds a grace-period entry)"]
#[derive(Debug)]
pub enum Step {
    /// Complete the request now with this result, no I/O (a read the prefetch ring held
    /// whole; a write to a read-only image).
    Complete(Result<()>),
    /// One I/O of one device extent with the request's own buffers: the host submits it
    /// (SPDK: a child bdev_io, as passthru does) and calls
    /// [`Chain::direct_done`] when it completes, or [`Chain::submit_direct`] has the
    /// executor do both; if the device refuses it, [`Chain::not_submitted`] turns it into
    /// a task.
    Direct(Grant),
    /// Engine work on this core: the host hands the request's buffer and a tag to
    /// [`Chain::start`] at once; the executor reports the tag's
    /// [`Outcome`](crate::exec::Outcome).
    Task(Task),
    /// The metadata owner runs it, as this operation: the host sends the request there,
    /// where the owner's chain plans it again.
    Owner(Op),
}

/// Engine work the host starts with [`Chain::start`]: made only by the engine's plan.
#[must_use = "a task is a request the host must start"]
#[derive(Debug)]
pub struct Task {
    kind: TaskKind,
    offset: u64,
    len: u64,
}

#[derive(Debug)]
enum TaskKind {
    /// The engine's read path, from `skip` bytes into the request (the ring copied the
    /// first `skip`).
    Read { skip: u64 },
    /// The rest of a read the ring is reading ahead.
    RingWait(RingWait),
    /// The write path of the image (the owner's: allocation, COW, in place).
    Write,
    /// The owner's slow write path at once, for a write known not in place: a core
    /// replica's [`Op::WriteNotInPlace`], or a write the owner's own route found not in
    /// place (`WriteDecision::EngineNotInPlace`). Nothing plans it in place again.
    WriteNotInPlace,
    /// A core replica's in-place write that needs a slice loaded first; it ends as
    /// [`Outcome::ToOwner`](crate::exec::Outcome::ToOwner) if not in place after all.
    WriteInPlace,
    /// Write zeroes (`unmap`: clusters may go).
    WriteZeroes { unmap: bool },
    /// Discard.
    Discard,
    /// Flush.
    Flush,
}

impl<D: BlockDevice> Chain<D> {
    /// Decides guest request `req` — the one call a host makes per request. `buf` lends
    /// the request's buffer ([`LentBuf`]: the host may lend a borrow, kept for this call
    /// alone); it is called only when the prefetch ring copies into it.
    ///
    /// Reads: the prefetch ring first (a read it holds whole completes here; a partial
    /// hit becomes a task for the rest), then the route (memo, slice cache), read-ahead
    /// fed on what the route did not find in the memo (or in a memo slice's tail).
    /// Writes: the route; on a core replica what is not in place goes to the owner, and
    /// read-ahead watches the writes that load a slice here; on the owner every write
    /// feeds read-ahead. Write zeroes, discard, flush: the owner's (a task there).
    #[inline(always)]
    pub fn plan<B, L>(self: &Rc<Self>, req: Request, buf: B) -> Step
    where
        B: FnOnce() -> L,
        L: LentBuf<D::Buf>,
    {
        match req.op {
            Op::Read => self.plan_read(req.offset, req.len, buf),
            Op::Write => self.plan_write(req.offset, req.len),
            _ => self.plan_other(req),
        }
    }

    /// The role of this chain's top image.
    #[inline(always)]
    pub fn role(&self) -> Role {
        self.role
    }

    /// Where a guest read of `len` bytes at `offset` goes, from cached metadata alone:
    /// - [`ReadRoute::Direct`] when the bytes are plain data in one contiguous extent of a
    ///   device — exactly the reads the engine's read path would serve with a single
    ///   device operation. The host reads the extent itself with the guest's
    ///   buffers (SPDK hands a bdev_io's iovecs to the base bdev, as its passthru does;
    ///   others call [`submit_direct`](Self::submit_direct)); the [`Grant`]
    ///   says how its grace-period entry ends.
    /// - [`ReadRoute::Engine`] otherwise (a slice not cached, zeros, several extents,
    ///   compressed or backing data, an empty or invalid request, which the engine
    ///   reports): nothing changed but LRU/hit counters; the read is a task
    ///   ([`Chain::start`]).
    #[inline(always)]
    pub fn route_read(&self, offset: u64, len: u64) -> ReadRoute {
        self.route_read_in(offset, len, self.memo.spot(offset, len))
    }

    /// [`route_read`](Self::route_read) of the request at `spot` in the memo's slices
    /// (`MemoView::spot`). The memo's hit is asked here, of the chain's view of it
    /// (`MemoView`), in one step.
    #[inline(always)]
    fn route_read_in(&self, offset: u64, len: u64, spot: Spot) -> ReadRoute {
        let Ok(range) = self.disk.check_range(offset, len) else {
            return ReadRoute::Engine;
        };
        // Before resolving anything: a cluster freed meanwhile is not reused until the
        // request is over (shared images; see `coherency::Grace`).
        let entry = self.guest_enter();
        let m = &self.memo;
        if let Some(host) = m.read(spot, len) {
            let grant = Grant::new(
                m.dev(),
                HostOffset(host),
                range,
                entry,
                FoundBy::Memo,
                Access::Read,
            );
            return ReadRoute::Direct(grant);
        }
        match self.route_read_past_memo(range, entry) {
            PastMemo::Direct(dev, host, entry) => ReadRoute::Direct(Grant::new(
                dev,
                host,
                range,
                entry,
                FoundBy::Lookup,
                Access::Read,
            )),
            PastMemo::Engine | PastMemo::Owner { .. } | PastMemo::NotInPlace => ReadRoute::Engine,
        }
    }

    /// Where a guest write of `len` bytes at `offset` goes, from one look-up of this
    /// replica's cached metadata:
    /// - [`WriteRoute::Direct`] when it overwrites COPIED clusters outside the image's
    ///   metadata, with no allocation in flight, in one extent of the device (the host
    ///   writes it itself, as [`route_read`](Self::route_read) describes for reads; or
    ///   [`submit_direct`](Self::submit_direct));
    /// - [`WriteRoute::Owner`], on a writable core replica, when the write is not in place
    ///   and either every slice involved is current here (allocation, COW, zero clusters:
    ///   the owner's work), or one has no L2 table yet, or one changed since this core
    ///   cached it and the owner still holds it dirty (it is allocating there: fetching its
    ///   copy would cost a message pair and a slice copy only to find, most of the time, a
    ///   cluster not in place yet);
    /// - else [`WriteRoute::Engine`]: this replica's engine path, which loads an uncached
    ///   slice on a core (so later overwrites stay there) and reports invalid requests.
    #[inline(always)]
    pub fn route_write(&self, offset: u64, len: u64) -> WriteRoute {
        self.decide_write(offset, len).into()
    }

    /// [`route_write`](Self::route_write) as the plan takes it: on a chain that runs its
    /// own writes, a write its metadata shows not in place is
    /// [`WriteDecision::EngineNotInPlace`], so that its task does not plan it in place
    /// again.
    #[inline(always)]
    pub(crate) fn decide_write(&self, offset: u64, len: u64) -> WriteDecision {
        self.decide_write_in(offset, len).0
    }

    /// [`decide_write`](Self::decide_write), and whether a memo hit ends in its slice's
    /// tail (false past the memo), as [`route_read_in`](Self::route_read_in).
    #[inline(always)]
    fn decide_write_in(&self, offset: u64, len: u64) -> (WriteDecision, bool) {
        let Ok(range) = self.disk.check_range(offset, len) else {
            return (WriteDecision::Engine, false);
        };
        self.disk.note_change(offset, len);
        let entry = match self.memo_overwrite(range, self.guest_enter()) {
            Ok(hit) => return (WriteDecision::Direct(hit.grant), hit.in_tail),
            Err(entry) => entry,
        };
        let decision = match self.route_write_past_memo(range, entry) {
            PastMemo::Direct(dev, host, entry) => WriteDecision::Direct(Grant::new(
                dev,
                host,
                range,
                entry,
                FoundBy::Lookup,
                Access::Write,
            )),
            PastMemo::Engine => WriteDecision::Engine,
            PastMemo::NotInPlace => WriteDecision::EngineNotInPlace,
            PastMemo::Owner { slow } => WriteDecision::Owner { slow },
        };
        (decision, false)
    }

    // No function out of line below returns a `Step`: one that did would make every
    // branch store its step in a stack slot the host's match reads back, where inline
    // branches keep a grant in registers.

    #[inline(always)]
    fn plan_read<B, L>(self: &Rc<Self>, offset: u64, len: u64, buf: B) -> Step
    where
        B: FnOnce() -> L,
        L: LentBuf<D::Buf>,
    {
        // The stream the ring's look-up continued: read-ahead of L2 slices follows the same
        // streams, and a read is looked up in their table once.
        let mut stream = None;
        match self.ring.passes(offset, len) {
            Passes::By => {}
            Passes::ByStream(i) => stream = Some(i),
            Passes::ToRing => {
                let buf = buf();
                let (served, continued) =
                    self.ring_read_past(offset, len, &mut |src, src_off, off, n| {
                        buf.copy_from(off, src, src_off, n)
                    });
                let kind = match served {
                    RingServed::Nothing => None,
                    RingServed::All => {
                        self.ring_served(continued, offset, len);
                        return Step::Complete(Ok(()));
                    }
                    RingServed::Prefix(n) => Some(TaskKind::Read { skip: n }),
                    RingServed::Wait(w) => Some(TaskKind::RingWait(w)),
                };
                if let Some(kind) = kind {
                    self.read_ahead_after_ring(continued, offset, len);
                    return Step::Task(Task { kind, offset, len });
                }
                stream = continued;
            }
        }
        // Read-ahead watches every read in its slice's tail, and the rest unless the memo
        // maps them (their slice is cached: the next one is loaded from the tail). The
        // tail's before the route, so that nothing the route resolves is kept across it.
        let spot = self.memo.spot(offset, len);
        let tail = self.memo.in_tail(spot);
        if tail {
            self.read_ahead_after_ring(stream, offset, len);
        }
        match self.route_read_in(offset, len, spot) {
            ReadRoute::Direct(grant) if grant.from_memo() => {
                self.counters.fast_read();
                Step::Direct(grant)
            }
            ReadRoute::Direct(grant) => {
                if !tail {
                    self.read_ahead_after_ring(stream, offset, len);
                }
                self.counters.fast_read();
                Step::Direct(grant)
            }
            ReadRoute::Engine => {
                if !tail {
                    self.read_ahead_after_ring(stream, offset, len);
                }
                Step::Task(Task {
                    kind: TaskKind::Read { skip: 0 },
                    offset,
                    len,
                })
            }
        }
    }

    /// A read the prefetch ring served whole, continuing `stream`: read-ahead of L2 slices
    /// follows the stream the ring serves too (its own read-aheads then find the next
    /// slices cached).
    #[inline(never)]
    fn ring_served(self: &Rc<Self>, stream: Option<u8>, offset: u64, len: u64) {
        self.read_ahead_after_ring(stream, offset, len);
        self.counters.served_from_ring();
    }

    /// Read-ahead watches an overwrite [`plan_write_fast`](Self::plan_write_fast) granted
    /// in its slice's tail (as [`plan`](Self::plan) does before it grants one); after the
    /// child's submission, out of line.
    #[inline(never)]
    pub fn watch_tail(self: &Rc<Self>, offset: u64, len: u64) {
        self.read_ahead(offset, len);
    }

    /// [`read_ahead`](Self::read_ahead) out of line: the memo's path stays small.
    #[inline(never)]
    fn read_ahead_out_of_line(self: &Rc<Self>, offset: u64, len: u64) {
        self.read_ahead(offset, len);
    }

    /// The fast half of a write's plan, for a host whose fast path must make no call
    /// before the child's submission (every call on it keeps the registers of the whole
    /// path saved): on a core replica whose persistent bitmaps do not record, an overwrite
    /// the memo answers in place, granted as [`plan`](Self::plan) grants it (the same
    /// checks, the same grant), with whether it ends in its slice's tail, for
    /// [`watch_tail`](Self::watch_tail) after the submission. `None` leaves nothing behind
    /// (an entry taken is left again, no counter moved): the request then takes `plan`.
    #[inline(always)]
    pub fn plan_write_fast(&self, offset: u64, len: u64) -> Option<FastWrite> {
        // (Not on another role: the memo's view answers overwrites on a writable core
        // replica alone, `MemoView::overwrite`, the condition of `Role::Replica`.)
        if self.disk.marks_writes() {
            return None;
        }
        let range = self.disk.range_now(offset, len)?;
        match self.memo_overwrite(range, self.guest_enter_light()?) {
            Ok(hit) => {
                self.counters.wrote_here();
                Some(hit)
            }
            Err(entry) => {
                self.exec().guest_exit(entry);
                None
            }
        }
    }

    /// The grant of an overwrite of `range` the memo answers, under `entry` (both the plan
    /// and its fast half ask it); the entry back where the memo does not answer.
    #[inline(always)]
    fn memo_overwrite(
        &self,
        range: GuestRange,
        entry: GraceEntry,
    ) -> Result<FastWrite, GraceEntry> {
        let m = &self.memo;
        match m.overwrite(range.offset().0, range.len()) {
            Some((host, in_tail)) => Ok(FastWrite {
                grant: Grant::new(
                    m.dev(),
                    HostOffset(host),
                    range,
                    entry,
                    FoundBy::Memo,
                    Access::Write,
                ),
                in_tail,
            }),
            None => Err(entry),
        }
    }

    #[inline(always)]
    fn plan_write(self: &Rc<Self>, offset: u64, len: u64) -> Step {
        // (`matches!` rather than the derived `!=`: one function less on every write.)
        if !matches!(self.role, Role::Replica) {
            return self.plan_owner_write(Op::Write, offset, len);
        }
        match self.decide_write_in(offset, len) {
            // Read-ahead watches an overwrite in its slice's tail, as a read the memo
            // found: a stream that mixes reads and writes stays one stream there.
            (WriteDecision::Direct(grant), tail) => {
                let tail = match grant.from_memo() {
                    true => tail,
                    false => self.readahead.in_tail(offset, len),
                };
                if tail {
                    self.read_ahead(offset, len);
                }
                self.counters.wrote_here();
                Step::Direct(grant)
            }
            // A slice to load first, with read-ahead: a stream of direct overwrites needs
            // no slice loaded ahead, and the owner runs its own read-ahead on what it is
            // sent. (Not in place on a core replica is `Owner`: never `EngineNotInPlace`.)
            (WriteDecision::Engine | WriteDecision::EngineNotInPlace, _) => {
                self.read_ahead_out_of_line(offset, len);
                Step::Task(Task {
                    kind: TaskKind::WriteInPlace,
                    offset,
                    len,
                })
            }
            (WriteDecision::Owner { slow }, _) => {
                self.counters.sent_to_owner();
                Step::Owner(match slow {
                    true => Op::WriteNotInPlace,
                    false => Op::Write,
                })
            }
        }
    }

    /// A write where this chain runs every write (the owner, a lone image), or none (a
    /// read-only image).
    #[inline(always)]
    fn plan_owner_write(self: &Rc<Self>, op: Op, offset: u64, len: u64) -> Step {
        if matches!(self.role, Role::ReadOnly) {
            return Step::Complete(Err(Error::ReadOnly));
        }
        self.read_ahead_out_of_line(offset, len);
        let kind = match op {
            Op::WriteNotInPlace => TaskKind::WriteNotInPlace,
            _ => match self.decide_write(offset, len) {
                WriteDecision::Direct(grant) => return Step::Direct(grant),
                // The route found it not in place: the task starts the slow path.
                WriteDecision::EngineNotInPlace => TaskKind::WriteNotInPlace,
                // The owner is no core replica: every other write is its write path's.
                WriteDecision::Engine | WriteDecision::Owner { .. } => TaskKind::Write,
            },
        };
        Step::Task(Task { kind, offset, len })
    }

    /// Write zeroes, discard, flush, and a write a core found not in place: the owner's.
    #[inline(always)]
    fn plan_other(self: &Rc<Self>, req: Request) -> Step {
        let (offset, len) = (req.offset, req.len);
        match self.role {
            Role::Replica => {
                self.counters.sent_to_owner();
                return Step::Owner(req.op);
            }
            Role::ReadOnly if req.op != Op::Flush => return Step::Complete(Err(Error::ReadOnly)),
            Role::ReadOnly | Role::Owner => {}
        }
        let kind = match req.op {
            Op::Read | Op::Write => unreachable!("planned by plan_read / plan_write"),
            Op::WriteNotInPlace => return self.plan_owner_write(req.op, offset, len),
            Op::WriteZeroes => TaskKind::WriteZeroes { unmap: false },
            Op::WriteZeroesUnmap => TaskKind::WriteZeroes { unmap: true },
            Op::Discard => TaskKind::Discard,
            Op::Flush => TaskKind::Flush,
        };
        Step::Task(Task { kind, offset, len })
    }

    /// Starts `task` (from this chain's [`plan`](Self::plan)) under `tag`, with the
    /// request's buffer (`None` for a request without data). The executor reports the
    /// tag's outcome ([`Exec::poll_outcomes`](crate::Exec::poll_outcomes)).
    pub fn start(self: &Rc<Self>, task: Task, tag: u64, buf: Option<BufSlice<D::Buf>>) {
        let Task { kind, offset, len } = task;
        let data = match (&kind, buf) {
            (TaskKind::WriteZeroes { unmap }, _) => {
                return self.submit_write_zeroes(tag, offset, len, *unmap)
            }
            (TaskKind::Discard, _) => return self.submit_discard(tag, offset, len),
            (TaskKind::Flush, _) => return self.submit_flush(tag),
            (_, Some(buf)) => buf,
            (_, None) => {
                let e = Error::InvalidRequest("a read or write without a buffer");
                return self.exec().complete(tag, Err(e));
            }
        };
        match kind {
            TaskKind::Read { skip: 0 } => self.submit_read(tag, offset, data),
            TaskKind::Read { skip } => {
                let rest = data.sub(skip as usize, (len - skip) as usize);
                self.submit_read(tag, offset + skip, rest)
            }
            TaskKind::RingWait(w) => self.ring.wait(w, tag, data),
            TaskKind::Write => self.submit_write(tag, offset, data),
            TaskKind::WriteNotInPlace => self.submit_write_slow(tag, offset, data),
            TaskKind::WriteInPlace => self.submit_write_local(tag, offset, data),
            TaskKind::WriteZeroes { .. } | TaskKind::Discard | TaskKind::Flush => {}
        }
    }

    /// A [`Step::Direct`] the host could not submit (another device than its own): the
    /// grant ends, and the same request continues as a task.
    pub fn not_submitted(&self, grant: Grant) -> Task {
        let range = grant.range();
        let op = match grant.is_write() {
            true => Op::Write,
            false => Op::Read,
        };
        grant.finish(self.exec());
        self.refused(Request::new(op, range.offset().0, range.len()))
    }

    /// The task of read or write `req`, granted the direct path, whose submission the
    /// device refused (busy) after its grant ended.
    pub fn refused(&self, req: Request) -> Task {
        let kind = match (req.op, self.role) {
            (Op::Read, _) => TaskKind::Read { skip: 0 },
            (_, Role::Replica) => TaskKind::WriteInPlace,
            (_, _) => TaskKind::Write,
        };
        Task {
            kind,
            offset: req.offset,
            len: req.len,
        }
    }

    /// Submits a [`Step::Direct`] through the executor (for hosts that do not submit to the
    /// device themselves): one device operation with `buf`, whose completion is the
    /// request's, reported under `tag`; the grant ends with it.
    #[inline(always)]
    pub fn submit_direct(&self, tag: u64, grant: Grant, buf: BufSlice<D::Buf>) {
        debug_assert_eq!(buf.len as u64, grant.range().len());
        let (dev, offset) = (grant.dev(), grant.host().0);
        let op = match grant.is_write() {
            false => DeviceOp::Read { offset, buf },
            true => DeviceOp::Write { offset, buf },
        };
        self.exec().request_single(tag, grant.submitted(), dev, op);
    }
}
