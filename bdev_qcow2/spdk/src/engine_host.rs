//! What a channel and the metadata owner both are to the engine: a [`Driver`] that owns an
//! executor, knows whether its host is inside the engine, hands it guest requests, delivers
//! base completions from SPDK's callback, and completes the requests they finished through
//! the host ([`Host::request_done`], with the engine's [`Outcome`]).
//!
//! Base completions are delivered into the executor right in SPDK's completion callback, so
//! a request the engine finishes there completes without waiting for the host's poller.
//! When the callback runs while the host is inside the engine (SPDK completing inline during
//! a submission), the completion stays queued in the device and the poller delivers it.

use crate::device::{guest_buf, SpdkBuf, SpdkDevice};
use crate::ffi::bdev_io::EngineTags;
use crate::ffi::sink::{SinkHost, Sinks};
use crate::ffi::thread::PollerSlot;
use crate::types::{BdevIo, Qcow2Bdev};
use qcow2_engine::exec::Outcome;
use qcow2_engine::golden::is_fill_tag;
use qcow2_engine::io::{BufSlice, DeviceError};
use qcow2_engine::{DevId, Exec};
use std::cell::Cell;

/// A channel or the owner: whoever drives a [`Driver`] and completes its requests.
pub trait Host: Sized {
    /// Its driver.
    fn driver(&self) -> &Driver;
    /// Where its devices deliver completions from SPDK's callback (armed by `ffi` while
    /// the host is its poller's state: [`Polled::sinks`](crate::ffi::thread::Polled::sinks)
    /// returns the same).
    fn sinks(&self) -> &Sinks<Self>;
    /// The engine reported how the guest request `io` ended: done with a result, or (a
    /// core replica's write that is not in place there) for the metadata owner.
    fn request_done(&self, io: BdevIo, outcome: Outcome);
}

/// An executor and its host's engine state.
pub struct Driver {
    exec: Exec<SpdkDevice>,
    /// Set while the host runs engine code (its executor or chain may be borrowed).
    in_engine: Cell<bool>,
    /// The host's poller (the host is [`Polled`](crate::ffi::thread::Polled)).
    slot: PollerSlot,
    /// Guest requests handed to the engine as tasks ([`submit`](Self::submit),
    /// [`submit_no_data`](Self::submit_no_data)): `engine_tasks` in the statistics.
    tasks: Cell<u64>,
    /// The guest requests the engine holds, by tag.
    handed: EngineTags<Qcow2Bdev>,
}

impl Driver {
    /// A driver of `exec`.
    pub fn new(exec: Exec<SpdkDevice>) -> Driver {
        Driver {
            exec,
            in_engine: Cell::new(false),
            slot: PollerSlot::default(),
            tasks: Cell::new(0),
            handed: EngineTags::default(),
        }
    }

    /// The executor.
    #[inline(always)]
    pub fn exec(&self) -> &Exec<SpdkDevice> {
        &self.exec
    }

    /// Runs `f` marked as inside the engine (nests: restores the previous mark).
    #[inline(always)]
    pub fn run<R>(&self, f: impl FnOnce() -> R) -> R {
        let prev = self.in_engine.replace(true);
        let r = f();
        self.in_engine.set(prev);
        r
    }

    /// Hands guest request `io` to the engine with `submit(tag, offset, buffer)` (one of
    /// `Chain`'s `submit_*` calls, a task); the host hears of it again in
    /// [`Host::request_done`].
    #[inline(always)]
    pub fn submit(&self, io: BdevIo, submit: impl FnOnce(u64, u64, BufSlice<SpdkBuf>)) {
        self.tasks.set(self.tasks.get() + 1);
        let off = io.offset_bytes();
        self.hand(io, |tag, buf| submit(tag, off, buf));
    }

    /// Hands guest request `io`, granted one extent of a device its host does not submit
    /// to itself, to the engine with `submit(tag, buffer)` (`Chain::submit_direct`): one
    /// device operation, not a task; the host hears of it again in
    /// [`Host::request_done`].
    #[inline(always)]
    pub fn submit_grant(&self, io: BdevIo, submit: impl FnOnce(u64, BufSlice<SpdkBuf>)) {
        self.hand(io, submit);
    }

    /// Hands request `io` without data (write zeroes, unmap, flush) to the engine with
    /// `submit(tag, offset, len)`.
    pub fn submit_no_data(&self, io: BdevIo, submit: impl FnOnce(u64, u64, u64)) {
        self.tasks.set(self.tasks.get() + 1);
        let (off, len) = (io.offset_bytes(), io.len_bytes());
        let (tag, _) = self.handed.hand(io);
        self.slot.resume();
        self.run(|| submit(tag, off, len));
    }

    /// Guest requests handed to the engine as tasks so far.
    pub fn tasks(&self) -> u64 {
        self.tasks.get()
    }

    #[inline(always)]
    fn hand(&self, io: BdevIo, submit: impl FnOnce(u64, BufSlice<SpdkBuf>)) {
        let (tag, view) = self.handed.hand(io);
        self.run(|| submit(tag, guest_buf(view)));
        // The executor has work for a poll (a task to run, a device to poll): a poller
        // paused while idle runs again. Not for a read waiting only on a bdev's callback.
        if self.exec.needs_poll() {
            self.slot.resume();
        }
    }

    /// One pass of the executor (if it has anything to do), completing what finished.
    /// Returns how much it did.
    pub fn poll<H: Host>(&self, host: &H) -> usize {
        if !self.exec.busy() {
            return 0;
        }
        self.run(|| {
            self.exec
                .poll_outcomes(&mut |tag, o| complete_tag(host, tag, o))
        })
    }

    /// Makes base device `dev` deliver its completions to `host` from SPDK's callback
    /// (through its [`Sinks`], once `ffi` armed them).
    pub fn attach<H: Host>(&self, dev: DevId, host: &H) {
        // A device read through a shared cache too: the sink leaves the cache's fills to
        // its poll (`deliver`), and the engine's own reads complete in the callback, so a
        // lone overlay with the cache on reads its backing bdev as one with it off does.
        self.exec
            .with_device(dev, |d| d.inner_mut().deliver_to(host.sinks().reference()));
    }

    /// Where the host's poller is kept.
    pub fn slot(&self) -> &PollerSlot {
        &self.slot
    }

    /// Drops the executor and with it the base channels (before the node may close the
    /// descriptors they belong to).
    pub fn release(&mut self) {
        self.exec = Exec::new();
    }
}

/// Hands the host the guest request the engine reported ended under `tag`.
fn complete_tag<H: Host>(host: &H, tag: u64, outcome: Outcome) {
    if let Some(io) = host.driver().handed.take(tag) {
        host.request_done(io, outcome);
    }
}

/// A host takes its devices' completions: it delivers a base completion into the executor
/// and completes what it finished, unless it is inside the engine (then its poller does).
impl<H: Host> SinkHost for H {
    #[inline(always)]
    fn offer(&self, tag: u64, r: Result<(), DeviceError>) -> bool {
        deliver(self, tag, r)
    }
}

/// See [`SinkHost::offer`].
#[inline(always)]
fn deliver<H: Host>(host: &H, tag: u64, r: Result<(), DeviceError>) -> bool {
    let d = host.driver();
    if d.in_engine.get() || is_fill_tag(tag) {
        // Queued in the device: the poller delivers it (a shared cache's fill: its device
        // publishes it there).
        d.slot.resume();
        return false;
    }
    d.run(|| {
        d.exec.device_completed(tag, r);
        d.exec
            .take_outcomes(&mut |tag, o| complete_tag(host, tag, o));
    });
    if d.exec.needs_poll() {
        d.slot.resume();
    }
    true
}
