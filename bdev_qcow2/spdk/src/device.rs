//! The engine's device seam over a base bdev: [`SpdkDevice`] (one per base bdev per SPDK
//! thread) over the SPDK side in `ffi/base.rs`, and the buffers it does I/O with,
//! [`SpdkBuf`] (`ffi/dma.rs`).
//!
//! `submit` calls `spdk_bdev_{readv,writev,flush}_blocks` at once. `-ENOMEM` (SPDK's pool of
//! bdev_ios on this thread is empty) → `Busy`, and the device queues itself with
//! `spdk_bdev_queue_io_wait`: until SPDK calls back (a bdev_io was freed), every submission
//! answers `Busy` without calling SPDK, and the executor resubmits in order on the poll after
//! the callback. The completion callback hands `(tag, result)` to the host whose
//! [`SinkRef`] it was given ([`BaseDevice::deliver_to`], while `ffi` has it armed: a channel delivers
//! it into its executor at once, so a fast-path request completes right in the callback);
//! otherwise, or when the sink declines (the host is inside the engine), it records it in the
//! device's queue, and [`BlockDevice::poll`] — run by the poller through the executor —
//! hands it to the engine. Per-operation state lives in a fixed pool of slots allocated
//! when the channel is created, so a submission allocates nothing.

use crate::ffi::base::{BaseIo, BaseOp, LazyIo, Submitted};
use crate::ffi::bdev::Desc;
use crate::ffi::bdev_io::DirectTarget;
use crate::ffi::dma::DmaMem;
pub use crate::ffi::dma::SpdkBuf;
use crate::ffi::granule::GranuleBuf;
use crate::ffi::iov::IovView;
use crate::ffi::sink::SinkRef;
use crate::ffi::sys;
use qcow2_engine::golden::{CachedDevice, InPlace, SharedReadCache};
use qcow2_engine::io::{BlockDevice, BufSlice, Busy, DeviceError, DeviceOp};
use qcow2_engine::DevId;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The data of a guest request (its iovecs, handed over by
/// [`EngineTags::hand`](crate::ffi::bdev_io::EngineTags::hand)) as an engine buffer.
#[inline(always)]
pub fn guest_buf(view: IovView) -> BufSlice<SpdkBuf> {
    BufSlice::whole(SpdkBuf::Iov(view))
}

/// A base device as the direct path sees it: its id in the host's executor (a grant's
/// [`Grant::dev`](qcow2_engine::Grant::dev) must match) and where to submit.
#[derive(Debug)]
pub struct Target {
    /// The device's id in its executor.
    pub dev: DevId,
    /// Its descriptor and this thread's channel.
    pub base: DirectTarget,
}

/// A bdev as the engine sees it from one SPDK thread: a base bdev, or a backing bdev read
/// through the shared read cache of its golden image ([`open_cached`]).
pub type SpdkDevice = CachedDevice<BaseDevice>;

/// How long a lazy device whose bdev gave no channel fails operations before it asks again.
const RETRY_CHANNEL: Duration = Duration::from_secs(1);

/// The error of an open whose bdev gave this thread no I/O channel (`what`: which bdev),
/// with the two causes an operator meets: memory, and an AIO bdev's kernel AIO context.
pub fn no_channel(what: &str) -> String {
    format!(
        "no I/O channel for {what} (out of memory, or for an AIO bdev the kernel's \
         fs.aio-max-nr reached)"
    )
}

/// A device over `desc` on the calling thread, reading it directly (see
/// [`BaseDevice::new`]).
pub fn open(desc: &Desc) -> Option<SpdkDevice> {
    BaseDevice::new(desc).map(CachedDevice::plain)
}

/// A device over backing bdev `desc` on the calling thread, reading it through `cache`
/// when given (the cache's fills complete through the executor's poll: they are its own).
pub fn open_cached(desc: &Desc, cache: Option<&Arc<SharedReadCache>>) -> Option<SpdkDevice> {
    BaseDevice::new(desc).map(|d| CachedDevice::new(d, cache.cloned()).with_in_place(IN_PLACE))
}

/// Fills read the golden bdev straight into the cache's DMA slots (one copy fewer).
const IN_PLACE: InPlace<BaseDevice> = InPlace {
    lend: |dev, lent| GranuleBuf::new(lent, dev.buf_align).map(|g| SpdkBuf::Granule(Rc::new(g))),
    take_back: |buf| match buf {
        SpdkBuf::Granule(g) => Rc::try_unwrap(g).ok().map(GranuleBuf::into_lent),
        _ => None,
    },
};

/// [`open_cached`] taking the thread's channel of the bdev on first use (see
/// [`BaseDevice::lazy`]); `small`: with the request slots of a layer
/// ([`LAYER_SLOTS`](crate::ffi::base::LAYER_SLOTS), iovecs allocated on use), for a device
/// that sees little I/O (a link of a chain's channel on its md thread, which only SPDK's
/// examines and RPCs read: a thousand of them stay small).
pub fn open_cached_lazy(
    desc: &Desc,
    cache: Option<&Arc<SharedReadCache>>,
    small: bool,
) -> SpdkDevice {
    let dev = match small {
        true => BaseDevice::lazy_with_slots(desc, crate::ffi::base::LAYER_SLOTS, 0),
        false => BaseDevice::lazy(desc),
    };
    CachedDevice::new(dev, cache.cloned()).with_in_place(IN_PLACE)
}

/// A device over a deep chain's layer (or raw bottom) `desc` on the calling thread (see
/// [`BaseDevice::layer`]).
pub fn open_layer(desc: &Desc) -> Option<SpdkDevice> {
    BaseDevice::layer(desc).map(CachedDevice::plain)
}

/// [`open_layer`] taking the thread's channel of the bdev on first use (a layer whose image
/// is copied from a seed: see [`BaseDevice::layer_lazy`]).
pub fn open_layer_lazy(desc: &Desc) -> SpdkDevice {
    CachedDevice::plain(BaseDevice::layer_lazy(desc))
}

/// A bdev as the engine sees it from one SPDK thread, read and written directly.
///
/// A backing bdev can be hot-removed and come back (ARCHITECTURE.md §15, degraded mode):
/// [`leave`](Self::leave) fails every later operation at once and keeps the bdev's channel
/// only until what it had in flight completes ([`settle`](Self::settle) puts it then);
/// [`join`](Self::join) reads a returning bdev again.
pub struct BaseDevice {
    /// `None` while the bdev is gone, or until `later` opens it.
    io: Option<BaseIo>,
    /// The bdev's I/O before its channel is taken ([`lazy`](Self::lazy)).
    later: Option<LazyIo>,
    /// After SPDK gave no channel: no new attempt before then (each attempt that fails
    /// logs, and an AIO bdev's tries a kernel AIO context).
    retry_at: Option<Instant>,
    /// The I/O of a bdev that left, until what it had in flight completes.
    draining: Vec<BaseIo>,
    /// Operations refused because the bdev is gone, completed by the next poll.
    refused: std::collections::VecDeque<(u64, Result<(), DeviceError>)>,
    /// The size it had when it left (a chain's backing layer keeps its size).
    size_gone: u64,
    /// Reads may go through a shared cache one day (reported to the executor at once: it
    /// asks only when the device is added).
    may_cache: bool,
    buf_align: usize,
    /// The engine leaves zeroing to the bdev ([`zero_offload`]).
    cheap_zeroes: bool,
    /// The bdev's module unmaps (a thin lvol, NVMe, malloc, AIO): freed clusters are
    /// discarded on it.
    unmaps: bool,
    /// Its unmap punches a hole that reads zeros ([`discard_zeroes`]).
    punches: bool,
    /// The bdev takes FLUSH. One that does not (an lvol) has no volatile cache: its
    /// completed writes are stable, and a flush has nothing to do (as SPDK's NVMe-oF
    /// target answers a Flush to such a bdev).
    flushes: bool,
    /// The executor polls it only while it has operations outstanding (a layer of a deep
    /// chain: a thousand of them would otherwise be visited on every poll).
    tracked: bool,
    /// Completions delivered by channels that drained and were put since last asked.
    delivered_carry: u32,
}

impl BaseDevice {
    /// A device over `desc` on the calling thread (gets the thread's channel of the bdev).
    /// `None` if SPDK has no channel for it.
    ///
    /// The descriptor must stay open as long as the device exists (the node that owns it
    /// outlives every channel).
    pub fn new(desc: &Desc) -> Option<BaseDevice> {
        Some(BaseDevice::over(desc, BaseIo::new(desc)?))
    }

    /// A device over `desc` that takes the thread's channel of the bdev on its first
    /// operation (a backing bdev: a read-only qcow2 bdev's channel would otherwise build
    /// the channels of a whole chain under it at once, nested). If SPDK has no channel to
    /// give then, that operation fails, and so does every one for a second before the
    /// next asks again (a writable bdev's channel sends such a read to the owner).
    pub fn lazy(desc: &Desc) -> BaseDevice {
        BaseDevice {
            io: None,
            later: Some(LazyIo::new(desc)),
            ..BaseDevice::with(desc, None)
        }
    }

    /// [`lazy`](Self::lazy) opening with `slots` request slots of `iovs` preallocated
    /// iovecs each (see [`BaseIo::with_slots`](crate::ffi::base::BaseIo::with_slots)).
    pub fn lazy_with_slots(desc: &Desc, slots: usize, iovs: usize) -> BaseDevice {
        BaseDevice {
            io: None,
            later: Some(LazyIo::with_slots(desc, slots, iovs)),
            ..BaseDevice::with(desc, None)
        }
    }

    /// A device over `desc` doing its I/O through `io`.
    fn over(desc: &Desc, io: BaseIo) -> BaseDevice {
        BaseDevice::with(desc, Some(io))
    }

    fn with(desc: &Desc, io: Option<BaseIo>) -> BaseDevice {
        BaseDevice {
            io,
            later: None,
            retry_at: None,
            draining: Vec::new(),
            refused: Default::default(),
            size_gone: 0,
            may_cache: false,
            buf_align: desc.buf_align().max(4096),
            cheap_zeroes: zero_offload(desc, None),
            unmaps: desc.supports_natively(sys::SPDK_BDEV_IO_TYPE_UNMAP),
            punches: discard_zeroes(desc),
            flushes: desc.supports_natively(sys::SPDK_BDEV_IO_TYPE_FLUSH),
            tracked: false,
            delivered_carry: 0,
        }
    }

    /// A device over a deep chain's layer `desc` (read only, never through a cache): the
    /// executor polls it only while it has operations outstanding.
    pub fn layer(desc: &Desc) -> Option<BaseDevice> {
        let io = BaseIo::with_slots(desc, crate::ffi::base::LAYER_SLOTS, 0)?;
        Some(BaseDevice {
            tracked: true,
            ..BaseDevice::over(desc, io)
        })
    }

    /// [`layer`](Self::layer) taking its channel on first use: a layer nothing reads on
    /// this thread holds none.
    pub fn layer_lazy(desc: &Desc) -> BaseDevice {
        BaseDevice {
            tracked: true,
            ..BaseDevice::lazy_with_slots(desc, crate::ffi::base::LAYER_SLOTS, 0)
        }
    }

    /// The device of a backing bdev that is gone (hot-removed) and had `size` bytes and
    /// needed `align`-byte buffers: every operation fails until it [`join`](Self::join)s
    /// a returning bdev. `may_cache`: its reads may go through a shared cache then.
    pub fn missing(size: u64, align: usize, may_cache: bool) -> BaseDevice {
        BaseDevice {
            io: None,
            later: None,
            retry_at: None,
            draining: Vec::new(),
            refused: Default::default(),
            size_gone: size,
            may_cache,
            buf_align: align.max(4096),
            cheap_zeroes: false,
            unmaps: false,
            punches: false,
            flushes: false,
            tracked: false,
            delivered_carry: 0,
        }
    }

    /// The bdev is going (hot-removed): later operations fail at once, and what is in
    /// flight drains ([`settle`](Self::settle)).
    pub fn leave(&mut self) {
        if let Some(l) = self.later.take() {
            self.size_gone = l.size();
        }
        if let Some(io) = self.io.take() {
            self.size_gone = io.num_blocks() * io.block_size();
            self.draining.push(io);
        }
        self.settle();
    }

    /// Puts the channels of a bdev that left once their operations are done (their
    /// completions were delivered or are queued for `poll`, which reaps them first).
    /// Returns whether any is still draining.
    pub fn settle(&mut self) -> bool {
        for io in self.draining.iter_mut().filter(|io| io.idle()) {
            self.delivered_carry += io.take_delivered();
        }
        self.draining.retain(|io| !io.idle());
        !self.draining.is_empty()
    }

    /// Reads the returning bdev of `desc` from now on (this thread's channel of it); `false`
    /// when SPDK gave no channel (the device stays gone).
    pub fn join(&mut self, desc: &Desc) -> bool {
        let Some(io) = BaseIo::new(desc) else {
            return false;
        };
        self.io = Some(io);
        self.later = None;
        // A device built while the bdev was gone learns what it is like now.
        self.buf_align = desc.buf_align().max(4096);
        self.unmaps = desc.supports_natively(sys::SPDK_BDEV_IO_TYPE_UNMAP);
        self.punches = discard_zeroes(desc);
        self.flushes = desc.supports_natively(sys::SPDK_BDEV_IO_TYPE_FLUSH);
        true
    }

    /// Whether the bdev is gone (operations fail).
    pub fn is_gone(&self) -> bool {
        self.io.is_none() && self.later.is_none()
    }

    /// A lazy device's first operation: takes the thread's channel of the bdev. `false`
    /// when SPDK gave none (the operation fails; the next one tries again).
    #[inline(always)]
    fn take_channel(&mut self) -> bool {
        self.later.is_none() || self.open_later()
    }

    /// [`take_channel`](Self::take_channel)'s first time (out of line: once per device),
    /// and its retries, at most one per [`RETRY_CHANNEL`].
    #[cold]
    #[inline(never)]
    fn open_later(&mut self) -> bool {
        let Some(l) = &self.later else {
            return true;
        };
        if self.retry_at.is_some_and(|t| Instant::now() < t) {
            return false;
        }
        match l.open() {
            Some(io) => {
                self.io = Some(io);
                self.later = None;
                self.retry_at = None;
                true
            }
            None => {
                tracing::warn!("{}, on this thread", no_channel("a backing bdev"));
                self.retry_at = Some(Instant::now() + RETRY_CHANNEL);
                false
            }
        }
    }

    /// Sets whether the engine leaves zeroing to this device (see [`zero_offload`]).
    pub fn set_zero_offload(&mut self, on: bool) {
        self.cheap_zeroes = on;
    }

    /// Makes SPDK's completion callback offer each completion to the host of `sink` (while
    /// `ffi` has it armed) before queueing it for `poll`.
    pub fn deliver_to(&mut self, sink: SinkRef) {
        if let Some(io) = &mut self.io {
            io.deliver_to(sink)
        } else if let Some(l) = &mut self.later {
            l.deliver_to(sink)
        }
    }

    /// What the direct path needs to submit to this device without the executor
    /// ([`Target`]), for the device registered as `dev`.
    ///
    /// Only for a base bdev, which never leaves (its removal takes the qcow2 bdev away).
    pub fn direct_target(&self, dev: DevId) -> Target {
        let Some(io) = &self.io else {
            unreachable!("a direct target of a bdev that is gone")
        };
        Target {
            dev,
            base: io.direct_target(),
        }
    }

    /// [`BlockDevice::poll`] of a bdev that left (or was refused operations since it did):
    /// the completions of its channel, of the channels it left draining, and the refusals.
    #[inline(never)]
    fn poll_left(&mut self, done: &mut dyn FnMut(u64, Result<(), DeviceError>)) -> usize {
        let mut n = 0;
        for io in self.io.iter_mut().chain(self.draining.iter_mut()) {
            while let Some((tag, r)) = io.pop_done() {
                done(tag, r);
                n += 1;
            }
        }
        while let Some((tag, r)) = self.refused.pop_front() {
            done(tag, r);
            n += 1;
        }
        n
    }
}

/// Whether the engine leaves zeroing to the bdev behind `desc`
/// ([`BlockDevice::zeroes_cheaply`]): with `force` unset, where it is an NVMe bdev (a Write
/// Zeroes command moves no data); with `Some(true)`, wherever its module zeroes itself;
/// never with `Some(false)`. SPDK's own emulation (writes of a zeroed buffer) never
/// counts. Elsewhere zeroing costs as much or more than the write it replaces: malloc
/// fills as fast as it copies; a thin lvol allocates the cluster for a write of zeros like
/// for data; AIO zeroes with an `fallocate` that blocks the reactor (4 KiB first writes
/// into fresh 64 KiB clusters ran at 0.15-0.5x of one write from a zeroed buffer).
pub fn zero_offload(desc: &Desc, force: Option<bool>) -> bool {
    let native = desc.supports_natively(sys::SPDK_BDEV_IO_TYPE_WRITE_ZEROES);
    match force {
        Some(on) => on && native,
        None => native && desc.module_name() == "nvme",
    }
}

/// Whether the engine zeroes the base behind `desc` ahead of its allocator
/// (`OpenOptions::zero_ahead`): with `force` unset, where it is an NVMe bdev (Write Zeroes
/// moves no data) or an AIO file that punches holes ([`discard_zeroes`]: the zeros take no
/// space, and a first write into a new cluster writes its 4 KiB alone where whole-cluster
/// writes filled 64 KiB of pages: on tmpfs #48's first writes were 0.5x of
/// qemu-storage-daemon's, which zeroes with `fallocate` too); with `Some(true)`, wherever its
/// module zeroes itself or punches; never with `Some(false)`, nor with SPDK's emulation
/// (writes of a zeroed buffer). Not by Write Zeroes on an AIO file: on ext4, 4 KiB writes
/// into a range zeroed with `fallocate`'s zero range (unwritten extents) split its extents,
/// and ran at about a tenth of the IOPS of whole-cluster writes into holes.
pub fn zero_ahead(desc: &Desc, force: Option<bool>) -> bool {
    let native = desc.supports_natively(sys::SPDK_BDEV_IO_TYPE_WRITE_ZEROES);
    match force {
        Some(on) => on && (native || discard_zeroes(desc)),
        None => (native && desc.module_name() == "nvme") || discard_zeroes(desc),
    }
}

/// Whether an unmap of the bdev behind `desc` leaves zeros
/// ([`BlockDevice::discard_zeroes`]): an AIO bdev made with `fallocate`, whose unmap is
/// `fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)` — a hole in a file, a zeroing
/// that must not fall back on a block device. Other modules promise nothing of the kind.
pub fn discard_zeroes(desc: &Desc) -> bool {
    desc.module_name() == "aio" && desc.supports_natively(sys::SPDK_BDEV_IO_TYPE_UNMAP)
}

/// How the engine zeroes on one base: per partial first write ([`zero_offload`]) and
/// ahead of the allocator ([`zero_ahead`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Zeroing {
    /// Partial first writes leave the rest of their cluster to the base's Write Zeroes.
    pub offload: bool,
    /// The base is zeroed ahead of the allocator.
    pub ahead: bool,
}

impl Zeroing {
    /// The zeroing of the create call's `zero_offload` and `zero_ahead` on `desc`.
    pub fn of(desc: &Desc, offload: Option<bool>, ahead: Option<bool>) -> Zeroing {
        Zeroing {
            offload: zero_offload(desc, offload),
            ahead: zero_ahead(desc, ahead),
        }
    }
}

impl BlockDevice for BaseDevice {
    type Buf = SpdkBuf;

    fn size(&self) -> u64 {
        match (&self.io, &self.later) {
            (Some(io), _) => io.num_blocks() * io.block_size(),
            (None, Some(l)) => l.size(),
            (None, None) => self.size_gone,
        }
    }

    fn alloc_buf(&mut self, len: usize) -> SpdkBuf {
        SpdkBuf::Dma(Rc::new(DmaMem::new(len, self.buf_align)))
    }

    fn zeroes_cheaply(&self) -> bool {
        self.cheap_zeroes
    }

    fn discards(&self) -> bool {
        self.unmaps
    }

    fn discard_zeroes(&self) -> bool {
        self.punches
    }

    fn submit(&mut self, op: DeviceOp<SpdkBuf>, tag: u64) -> Result<(), Busy<SpdkBuf>> {
        if !self.take_channel() {
            self.refused
                .push_back((tag, Err(DeviceError(libc::ENOMEM))));
            return Ok(());
        }
        let Some(io) = &mut self.io else {
            // Gone: what needs the bdev fails (never zeros where its data belongs).
            self.refused.push_back((tag, Err(DeviceError(libc::EIO))));
            return Ok(());
        };
        let bs = io.block_size();
        // (`size()` with a channel.)
        let size = io.num_blocks() * bs;
        // Reads past the end of the device return zeros for the missing part (the seam's
        // contract); the part inside goes to the bdev.
        let inside_buf;
        let (offset, len, base_op) = match &op {
            DeviceOp::Flush if !self.flushes => {
                io.complete_now(tag, Ok(()));
                return Ok(());
            }
            DeviceOp::Flush => (0, 0, BaseOp::Flush),
            DeviceOp::WriteZeroes { offset, len } => (
                *offset,
                *len,
                BaseOp::WriteZeroes {
                    offset: *offset,
                    len: *len,
                },
            ),
            DeviceOp::Discard { offset, len } => (
                *offset,
                *len,
                BaseOp::Unmap {
                    offset: *offset,
                    len: *len,
                },
            ),
            DeviceOp::Read { offset, buf } => {
                let len = buf.len as u64;
                let inside = size.saturating_sub(*offset).min(len);
                if inside < len {
                    buf.sub(inside as usize, (len - inside) as usize).zero();
                }
                if inside == 0 {
                    io.complete_now(tag, Ok(()));
                    return Ok(());
                }
                inside_buf = buf.sub(0, inside as usize);
                (
                    *offset,
                    inside,
                    BaseOp::Read {
                        offset: *offset,
                        buf: &inside_buf,
                    },
                )
            }
            DeviceOp::Write { offset, buf } => (
                *offset,
                buf.len as u64,
                BaseOp::Write {
                    offset: *offset,
                    buf,
                },
            ),
        };
        if !offset.is_multiple_of(bs) || !len.is_multiple_of(bs) {
            io.complete_now(tag, Err(DeviceError(libc::EINVAL)));
            return Ok(());
        }
        match io.submit(base_op, tag) {
            Submitted::Yes => Ok(()),
            Submitted::Busy => Err(Busy(op, tag)),
            Submitted::Failed(e) => {
                io.complete_now(tag, Err(DeviceError(e)));
                Ok(())
            }
        }
    }

    /// Inline: the executor visits the device on every pass of a channel's poller while a
    /// request is in flight; a bdev that did not leave has one queue to look at.
    #[inline]
    fn poll(&mut self, done: &mut dyn FnMut(u64, Result<(), DeviceError>)) -> usize {
        if !self.draining.is_empty() || !self.refused.is_empty() {
            return self.poll_left(done);
        }
        let Some(io) = self.io.as_mut() else {
            return 0;
        };
        let mut n = 0;
        while let Some((tag, r)) = io.pop_done() {
            done(tag, r);
            n += 1;
        }
        n
    }

    fn may_have_own_work(&self) -> bool {
        self.may_cache
    }

    /// A bdev that did not leave, with its completions going to a host's sink and none
    /// queued (nor refused) for `poll`.
    #[inline]
    fn completions_announced(&self) -> bool {
        self.draining.is_empty()
            && self.refused.is_empty()
            && self.io.as_ref().is_none_or(BaseIo::announces)
    }

    fn completes_only_submitted(&self) -> bool {
        self.tracked
    }

    fn take_delivered(&mut self) -> u32 {
        let mut n = std::mem::take(&mut self.delivered_carry);
        for io in self.io.iter_mut().chain(self.draining.iter_mut()) {
            n += io.take_delivered();
        }
        n
    }
}
