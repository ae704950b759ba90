//! Guest requests on the fast path: who waits for a device operation ([`Waiter`]), the
//! record of a request split into several operations, and how requests end ([`Outcome`]):
//! completions queued for the host, reported by [`Exec::take_outcomes`].

use super::grace::GraceEntry;
use super::{DevId, Exec};
use crate::error::{Error, Result};
use crate::io::{BlockDevice, DeviceError, DeviceOp};

/// Who waits for a device operation.
pub(super) enum Waiter {
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
pub(super) struct Request {
    tag: u64,
    remaining: u32,
    error: Option<Error>,
    /// The guest request's grace entry ([`Exec::guest_enter`]).
    entry: GraceEntry,
    /// The engine's own request (a read-ahead): its end goes to the internal sink.
    internal: bool,
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

impl<D: BlockDevice> Exec<D> {
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

    /// Delivers one device completion (`tag` as given to the device's `submit`). Hosts whose
    /// device reports completions in a callback (SPDK) may call this from that callback,
    /// outside [`Exec::poll`]: a fast-path request then finishes at once and
    /// [`Exec::take_completions`] reports it without waiting for the next poll; a task is
    /// made ready and runs at the next poll.
    pub fn device_completed(&self, tag: u64, res: Result<(), DeviceError>) {
        if tag & super::crypt::CRYPT_TAG != 0 {
            return self.crypt_read_done(tag, res);
        }
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
}
