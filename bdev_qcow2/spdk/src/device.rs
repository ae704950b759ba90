//! The engine's device seam over a base bdev: [`SpdkDevice`] (one per base bdev per SPDK
//! thread) and the buffers it does I/O with, [`SpdkBuf`].
//!
//! `submit` calls `spdk_bdev_{readv,writev,flush}_blocks` at once. `-ENOMEM` (SPDK's pool of
//! bdev_ios on this thread is empty) → `Busy`, and the device queues itself with
//! `spdk_bdev_queue_io_wait`: until SPDK calls back (a bdev_io was freed), every submission
//! answers `Busy` without calling SPDK, and the executor resubmits in order on the poll after
//! the callback. The completion callback hands `(tag, result)` to the device's
//! [`CompletionSink`] if the host installed one ([`SpdkDevice::set_sink`]: a channel delivers
//! it into its executor at once, so a fast-path request completes right in the callback);
//! otherwise, or when the sink declines (the host is inside the engine), it records it in the
//! device's queue, and [`BlockDevice::poll`] — run by the poller through the executor —
//! hands it to the engine. Per-operation state lives in a fixed pool of slots allocated
//! when the channel is created, so a submission allocates nothing.

use crate::direct::Target;
use crate::ffi::bdev::Desc;
use crate::ffi::bdev_io::{DirectTarget, IovView};
use crate::ffi::dma::DmaMem;
use crate::ffi::io_channel::ChannelRef;
use crate::ffi::sys;
use qcow2_engine::io::{BlockDevice, BufSlice, Busy, DeviceError, DeviceOp, IoBuffer};
use qcow2_engine::DevId;
use std::collections::VecDeque;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::rc::Rc;

/// The data of a guest request (its iovecs, handed over by
/// [`BdevIo::into_engine`](crate::ffi::bdev_io::BdevIo::into_engine)) as an engine buffer.
#[inline(always)]
pub fn guest_buf(view: IovView) -> BufSlice<SpdkBuf> {
    BufSlice::whole(SpdkBuf::Iov(view))
}

/// A buffer the engine can read into: DMA memory (metadata, bounce buffers) or the
/// iovecs of a guest bdev_io (the hot path reads straight into them).
#[derive(Clone)]
pub enum SpdkBuf {
    /// Memory from `spdk_dma_zmalloc`, shared by handle.
    Dma(Rc<DmaMem>),
    /// A guest request's own iovecs.
    Iov(IovView),
}

impl SpdkBuf {
    /// Calls `f(ptr, len, pos)` for each contiguous piece of `len` bytes at `off`, where `pos`
    /// is the piece's offset from `off`. Panics if the range is out of bounds (the engine
    /// never asks for that).
    fn segments(&self, off: usize, len: usize, mut f: impl FnMut(*mut u8, usize, usize)) {
        assert!(
            off.checked_add(len).is_some_and(|e| e <= self.len()),
            "buffer range out of bounds"
        );
        if len == 0 {
            return;
        }
        match self {
            SpdkBuf::Dma(m) => {
                // SAFETY: in bounds (asserted above).
                f(unsafe { m.as_ptr().add(off) }, len, 0)
            }
            SpdkBuf::Iov(v) => v.segments(off, len, f),
        }
    }

    /// Appends iovecs describing `len` bytes at `off` to `out` (no allocation while `out`
    /// has capacity).
    pub fn append_iovs(&self, off: usize, len: usize, out: &mut Vec<sys::iovec>) {
        self.segments(off, len, |p, n, _| {
            out.push(sys::iovec {
                iov_base: p.cast::<c_void>(),
                iov_len: n,
            })
        });
    }
}

impl IoBuffer for SpdkBuf {
    fn len(&self) -> usize {
        match self {
            SpdkBuf::Dma(m) => m.len(),
            SpdkBuf::Iov(v) => v.len(),
        }
    }
    fn copy_out(&self, off: usize, dst: &mut [u8]) {
        self.segments(off, dst.len(), |p, n, pos| {
            // SAFETY: `p..p+n` is inside the buffer (segments); `dst[pos..pos+n]` is in
            // bounds; a Rust slice never overlaps device memory; no I/O is in flight on it.
            unsafe { std::ptr::copy_nonoverlapping(p, dst.as_mut_ptr().add(pos), n) }
        });
    }
    fn copy_in(&self, off: usize, src: &[u8]) {
        self.segments(off, src.len(), |p, n, pos| {
            // SAFETY: as in `copy_out`, with the roles swapped.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().add(pos), p, n) }
        });
    }
    fn fill(&self, off: usize, len: usize, byte: u8) {
        self.segments(off, len, |p, n, _| {
            // SAFETY: `p..p+n` is inside the buffer (segments).
            unsafe { std::ptr::write_bytes(p, byte, n) }
        });
    }
}

/// Iovecs preallocated per slot; requests with more segments grow that slot's vector once.
const SLOT_IOVS: usize = 8;
/// Operations one device can have in flight; beyond that `submit` answers `Busy`.
pub const SLOTS: usize = 1024;

/// Takes a completion `(tag, result)` straight from SPDK's callback, with the context given
/// to [`SpdkDevice::set_sink`]. Returns `false` to decline (the completion is then queued
/// for [`BlockDevice::poll`]), e.g. when the callback runs inside the engine (SPDK completing
/// inline during a submission).
///
/// # Safety
/// Called only with the context it was installed with, on the device's thread, outside any
/// method of the device.
pub type CompletionSink = unsafe fn(*mut c_void, u64, Result<(), DeviceError>) -> bool;

/// One operation in flight.
struct Slot {
    owner: *mut Pool,
    index: u32,
    tag: u64,
    /// Keeps DMA memory alive until the operation completes.
    buf: Option<SpdkBuf>,
    iovs: Vec<sys::iovec>,
}

/// Slots and completions of one device, at a stable address (the callbacks' `cb_arg`s
/// point into it).
struct Pool {
    slots: Box<[Slot]>,
    free: Vec<u32>,
    done: VecDeque<(u64, Result<(), DeviceError>)>,
    /// The io_wait entry queued with SPDK while `waiting`.
    wait: sys::spdk_bdev_io_wait_entry,
    /// Queued with `spdk_bdev_queue_io_wait` and not called back yet.
    waiting: bool,
    /// Where the callback delivers completions first (see [`CompletionSink`]).
    sink: Option<(CompletionSink, *mut c_void)>,
}

/// A base bdev as seen from one SPDK thread.
pub struct SpdkDevice {
    desc: *mut sys::spdk_bdev_desc,
    ch: ChannelRef,
    block_size: u64,
    num_blocks: u64,
    buf_align: usize,
    /// The engine leaves zeroing to the bdev ([`zero_offload`]).
    cheap_zeroes: bool,
    pool: NonNull<Pool>,
}

impl SpdkDevice {
    /// A device over `desc` on the calling thread (gets the thread's channel of the bdev).
    /// `None` if SPDK has no channel for it.
    ///
    /// The descriptor must stay open as long as the device exists (the node that owns it
    /// outlives every channel).
    pub fn new(desc: &Desc) -> Option<SpdkDevice> {
        let ch = ChannelRef::of_bdev(desc)?;
        let pool = Box::into_raw(Box::new(Pool {
            slots: Box::new([]),
            free: (0..SLOTS as u32).rev().collect(),
            done: VecDeque::with_capacity(SLOTS),
            // SAFETY: a plain C struct (pointers, an optional callback, list links) for
            // which all-zero is a valid unqueued state.
            wait: unsafe { std::mem::zeroed() },
            waiting: false,
            sink: None,
        }));
        let slots: Box<[Slot]> = (0..SLOTS as u32)
            .map(|index| Slot {
                owner: pool,
                index,
                tag: 0,
                buf: None,
                iovs: Vec::with_capacity(SLOT_IOVS),
            })
            .collect();
        // SAFETY: `pool` was just leaked from a Box and is not shared yet.
        unsafe { (*pool).slots = slots };
        Some(SpdkDevice {
            desc: desc.raw(),
            ch,
            block_size: u64::from(desc.block_size()),
            num_blocks: desc.num_blocks(),
            buf_align: desc.buf_align().max(4096),
            cheap_zeroes: zero_offload(desc, None),
            // SAFETY: `Box::into_raw` never returns null.
            pool: unsafe { NonNull::new_unchecked(pool) },
        })
    }

    /// Sets whether the engine leaves zeroing to this device (see [`zero_offload`]).
    pub fn set_zero_offload(&mut self, on: bool) {
        self.cheap_zeroes = on;
    }

    /// Makes SPDK's completion callback offer each completion to `sink` (with `ctx`) before
    /// queueing it for `poll`.
    ///
    /// # Safety
    /// `ctx` must stay valid for `sink` as long as the device may complete operations (the
    /// device clears it if it is dropped with operations in flight).
    pub unsafe fn set_sink(&mut self, sink: CompletionSink, ctx: *mut c_void) {
        // SAFETY: see `in_flight`.
        unsafe { (*self.pool.as_ptr()).sink = Some((sink, ctx)) };
    }

    /// Operations submitted and not yet reaped by `poll`.
    pub fn in_flight(&self) -> usize {
        // SAFETY: the pool is ours; no callback runs concurrently (same thread).
        let p = unsafe { self.pool.as_ref() };
        SLOTS - p.free.len() + p.done.len()
    }

    /// After `-ENOMEM`: asks SPDK to call back when a bdev_io is free again. If SPDK refuses
    /// (its cache is not actually empty), the executor simply retries on its next poll.
    fn wait_for_bdev_io(&mut self) {
        let pool = self.pool.as_ptr();
        // SAFETY: see `in_flight`; the entry lives in the pool, which is not freed while
        // `waiting` (see `Drop`); `desc` and `ch` are open on this thread.
        unsafe {
            if (*pool).waiting {
                return;
            }
            let bdev = sys::spdk_bdev_desc_get_bdev(self.desc);
            (*pool).wait.bdev = bdev;
            (*pool).wait.cb_fn = Some(io_wait_done);
            (*pool).wait.cb_arg = pool.cast();
            if sys::spdk_bdev_queue_io_wait(bdev, self.ch.raw(), &mut (*pool).wait) == 0 {
                (*pool).waiting = true;
            }
        }
    }

    /// What the direct path needs to submit to this device without the executor
    /// ([`Target`]), for the device registered as `dev`.
    pub fn direct_target(&self, dev: DevId) -> Target {
        // SAFETY: `desc` is open and `ch` is this thread's channel of it while the device
        // lives, which the target's holder guarantees (it owns the device's executor).
        let base = unsafe { DirectTarget::new(self.desc, self.ch.raw(), self.block_size) };
        Target { dev, base }
    }

    fn complete_now(&mut self, tag: u64, r: Result<(), DeviceError>) {
        // SAFETY: see `in_flight`.
        unsafe { (*self.pool.as_ptr()).done.push_back((tag, r)) };
    }
}

unsafe extern "C" fn io_wait_done(cb_arg: *mut c_void) {
    // SAFETY: `cb_arg` is the pool that queued the entry, kept alive while `waiting`; the
    // callback runs on the device's thread, outside its methods.
    unsafe { (*cb_arg.cast::<Pool>()).waiting = false };
}

unsafe extern "C" fn io_done(bdev_io: *mut sys::spdk_bdev_io, success: bool, cb_arg: *mut c_void) {
    // SAFETY: `bdev_io` is the child I/O SPDK hands back to us; freed once, here.
    unsafe { sys::spdk_bdev_free_io(bdev_io) };
    let slot = cb_arg.cast::<Slot>();
    let r = if success {
        Ok(())
    } else {
        Err(DeviceError(libc::EIO))
    };
    // SAFETY: `cb_arg` is a slot of a live pool (pools are freed only when no slot is in
    // flight); callbacks run on the device's thread, never inside one of its methods, so
    // no other reference to the pool is live. The pool reference ends before the sink runs
    // (it may submit on this very device), and is taken afresh if the sink declines.
    unsafe {
        let owner = (*slot).owner;
        let tag = (*slot).tag;
        (*slot).buf = None;
        let sink = {
            let pool = &mut *owner;
            pool.free.push((*slot).index);
            pool.sink
        };
        if let Some((f, ctx)) = sink {
            if f(ctx, tag, r) {
                return;
            }
        }
        (*owner).done.push_back((tag, r));
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

impl BlockDevice for SpdkDevice {
    type Buf = SpdkBuf;

    fn size(&self) -> u64 {
        self.num_blocks * self.block_size
    }

    fn alloc_buf(&mut self, len: usize) -> SpdkBuf {
        SpdkBuf::Dma(Rc::new(DmaMem::new(len, self.buf_align)))
    }

    fn zeroes_cheaply(&self) -> bool {
        self.cheap_zeroes
    }

    fn submit(&mut self, op: DeviceOp<SpdkBuf>, tag: u64) -> Result<(), Busy<SpdkBuf>> {
        let bs = self.block_size;
        let size = self.size();
        // Reads past the end of the device return zeros for the missing part (the seam's
        // contract); the part inside goes to the bdev.
        let (offset, buf, is_read) = match &op {
            DeviceOp::Flush => (0, None, false),
            DeviceOp::WriteZeroes { offset, .. } => (*offset, None, false),
            DeviceOp::Read { offset, buf } => {
                let len = buf.len as u64;
                let inside = size.saturating_sub(*offset).min(len);
                if inside < len {
                    buf.sub(inside as usize, (len - inside) as usize).zero();
                }
                if inside == 0 {
                    self.complete_now(tag, Ok(()));
                    return Ok(());
                }
                (*offset, Some(buf.sub(0, inside as usize)), true)
            }
            DeviceOp::Write { offset, buf } => (*offset, Some(buf.clone()), false),
        };
        let len = match (&buf, &op) {
            (Some(b), _) => b.len as u64,
            (None, DeviceOp::WriteZeroes { len, .. }) => *len,
            (None, _) => 0,
        };
        if !offset.is_multiple_of(bs) || !len.is_multiple_of(bs) {
            self.complete_now(tag, Err(DeviceError(libc::EINVAL)));
            return Ok(());
        }
        // SAFETY: see `in_flight`.
        let pool = unsafe { &mut *self.pool.as_ptr() };
        if pool.waiting {
            return Err(Busy(op, tag));
        }
        let Some(idx) = pool.free.pop() else {
            return Err(Busy(op, tag));
        };
        let slot = &mut pool.slots[idx as usize];
        slot.tag = tag;
        slot.iovs.clear();
        let slot_ptr = (slot as *mut Slot).cast::<c_void>();
        // SAFETY: (all three calls) `desc` is open and `ch` is this thread's channel of it;
        // the iovecs live in the slot and describe memory kept valid until completion (DMA
        // memory is held in `slot.buf`; a bdev_io's buffers live until the guest request
        // completes, which is after this operation does); `io_done` gets the slot back.
        let rc = unsafe {
            match (&buf, &op) {
                (None, DeviceOp::WriteZeroes { .. }) => sys::spdk_bdev_write_zeroes_blocks(
                    self.desc,
                    self.ch.raw(),
                    offset / bs,
                    len / bs,
                    Some(io_done),
                    slot_ptr,
                ),
                (None, _) => sys::spdk_bdev_flush_blocks(
                    self.desc,
                    self.ch.raw(),
                    0,
                    self.num_blocks,
                    Some(io_done),
                    slot_ptr,
                ),
                (Some(b), _) => {
                    b.buf.append_iovs(b.off, b.len, &mut slot.iovs);
                    slot.buf = matches!(b.buf, SpdkBuf::Dma(_)).then(|| b.buf.clone());
                    let iovcnt = slot.iovs.len() as i32;
                    let f = if is_read {
                        sys::spdk_bdev_readv_blocks
                    } else {
                        sys::spdk_bdev_writev_blocks
                    };
                    f(
                        self.desc,
                        self.ch.raw(),
                        slot.iovs.as_mut_ptr(),
                        iovcnt,
                        offset / bs,
                        b.len as u64 / bs,
                        Some(io_done),
                        slot_ptr,
                    )
                }
            }
        };
        if rc == 0 {
            return Ok(());
        }
        slot.buf = None;
        pool.free.push(idx);
        if rc == -libc::ENOMEM {
            self.wait_for_bdev_io();
            return Err(Busy(op, tag));
        }
        self.complete_now(tag, Err(DeviceError(-rc)));
        Ok(())
    }

    fn poll(&mut self, done: &mut dyn FnMut(u64, Result<(), DeviceError>)) -> usize {
        let mut n = 0;
        loop {
            // SAFETY: see `in_flight`; the borrow ends before `done` runs.
            let next = unsafe { (*self.pool.as_ptr()).done.pop_front() };
            let Some((tag, r)) = next else { break };
            done(tag, r);
            n += 1;
        }
        n
    }
}

impl Drop for SpdkDevice {
    fn drop(&mut self) {
        // SAFETY: see `in_flight`.
        let waiting = unsafe { self.pool.as_ref() }.waiting;
        if self.in_flight() > 0 || waiting {
            // Completions (or SPDK's io_wait callback) would write into a freed pool: leak
            // it instead (never expected: channels are torn down only when their executor
            // is idle, and an idle executor has no refused submission left).
            tracing::error!("base device dropped with operations in flight; leaking its pool");
            // SAFETY: see `in_flight`. The sink's context may die with the device's owner.
            unsafe { (*self.pool.as_ptr()).sink = None };
            return;
        }
        // SAFETY: leaked from a Box in `new`; no operation refers to it any more.
        drop(unsafe { Box::from_raw(self.pool.as_ptr()) });
    }
}
