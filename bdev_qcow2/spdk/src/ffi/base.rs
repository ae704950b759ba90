//! A base bdev's I/O from one SPDK thread ([`BaseIo`]): submissions with `spdk_bdev_*_blocks`
//! from a fixed pool of slots (so a submission allocates nothing), completions handed to a
//! [`CompletionSink`] right in SPDK's callback or queued for the poller, and the wait for a
//! free bdev_io after `-ENOMEM`.

use super::bdev::Desc;
use super::bdev_io::DirectTarget;
use super::channel_ref::ChannelRef;
use super::dma::SpdkBuf;
use super::rw::Blocks;
use super::sink::SinkRef;
use super::sys;
use qcow2_engine::io::{BufSlice, DeviceError};
use std::collections::VecDeque;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::rc::Rc;

/// Iovecs preallocated per slot; requests with more segments grow that slot's vector once.
const SLOT_IOVS: usize = 8;
/// Operations one device can have in flight; beyond that `submit` answers `Busy`.
pub const SLOTS: usize = 1024;
/// ... for a layer of a deep chain (the executor resubmits past it, in order).
pub const LAYER_SLOTS: usize = 128;

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
    /// Where the callback delivers completions first: the host that drives the device
    /// ([`BaseIo::deliver_to`]).
    sink: Option<SinkRef>,
    /// Completions the sink took since [`BaseIo::take_delivered`] last asked.
    delivered: u32,
}

/// A base bdev's I/O as seen from one SPDK thread.
pub struct BaseIo {
    desc: *mut sys::spdk_bdev_desc,
    /// This thread's channel of it, shared with the direct path's target
    /// ([`direct_target`](Self::direct_target)): put back when both are gone.
    ch: Rc<ChannelRef>,
    /// The base bdev (its size is read live: a base may grow while open).
    bdev: *mut sys::spdk_bdev,
    block_size: u64,
    pool: NonNull<Pool>,
}

/// An operation for [`BaseIo::submit`].
pub enum BaseOp<'a> {
    /// Flush the whole device.
    Flush,
    /// Write zeroes to `len` bytes at `offset`.
    WriteZeroes {
        /// First byte.
        offset: u64,
        /// Bytes.
        len: u64,
    },
    /// Unmap `len` bytes at `offset` (the base gives their space back).
    Unmap {
        /// First byte.
        offset: u64,
        /// Bytes.
        len: u64,
    },
    /// Read into `buf` from `offset`.
    Read {
        /// First byte.
        offset: u64,
        /// Where to (its length is the read's).
        buf: &'a BufSlice<SpdkBuf>,
    },
    /// Write `buf` at `offset`.
    Write {
        /// First byte.
        offset: u64,
        /// What (its length is the write's).
        buf: &'a BufSlice<SpdkBuf>,
    },
}

/// How a [`BaseIo::submit`] went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Submitted {
    /// In flight: its completion will come.
    Yes,
    /// Not now (no slot, or SPDK's bdev_io pool is empty): submit it again later.
    Busy,
    /// Refused with this errno.
    Failed(i32),
}

impl BaseIo {
    /// The I/O of `desc` on the calling thread (gets the thread's channel of the bdev).
    /// `None` if SPDK has no channel for it.
    ///
    /// The descriptor must stay open as long as this exists (the node that owns it
    /// outlives every channel).
    pub fn new(desc: &Desc) -> Option<BaseIo> {
        BaseIo::with_slots(desc, SLOTS, SLOT_IOVS)
    }

    /// [`new`](Self::new) with `slots` operations in flight at most, each slot's iovecs
    /// preallocated for `iovs` segments: a deep chain's layer takes [`LAYER_SLOTS`] without
    /// iovecs until used, so a thousand layers per thread stay small (about 12 KiB each).
    pub fn with_slots(desc: &Desc, slots: usize, iovs: usize) -> Option<BaseIo> {
        // SAFETY: `desc` is open, and stays open while this exists (see `new`).
        unsafe { BaseIo::of_raw(desc.raw(), slots, iovs) }
    }

    /// [`with_slots`](Self::with_slots) by the raw descriptor.
    ///
    /// # Safety
    /// `desc` is open and stays open as long as this exists.
    unsafe fn of_raw(desc: *mut sys::spdk_bdev_desc, slots: usize, iovs: usize) -> Option<BaseIo> {
        // SAFETY: per the contract.
        let ch = unsafe { ChannelRef::of_raw(desc) }?;
        // SAFETY: the bdev of an open descriptor is registered.
        let bdev = unsafe { sys::spdk_bdev_desc_get_bdev(desc) };
        let pool = Box::into_raw(Box::new(Pool {
            slots: Box::new([]),
            free: (0..slots as u32).rev().collect(),
            done: VecDeque::with_capacity(slots),
            // SAFETY: a plain C struct (pointers, an optional callback, list links) for
            // which all-zero is a valid unqueued state.
            wait: unsafe { std::mem::zeroed() },
            waiting: false,
            sink: None,
            delivered: 0,
        }));
        let slots: Box<[Slot]> = (0..slots as u32)
            .map(|index| Slot {
                owner: pool,
                index,
                tag: 0,
                buf: None,
                iovs: Vec::with_capacity(iovs),
            })
            .collect();
        // SAFETY: `pool` was just leaked from a Box and is not shared yet.
        unsafe { (*pool).slots = slots };
        Some(BaseIo {
            desc,
            ch: Rc::new(ch),
            // SAFETY: as above.
            block_size: u64::from(unsafe { sys::spdk_bdev_get_block_size(bdev) }),
            bdev,
            // SAFETY: `Box::into_raw` never returns null.
            pool: unsafe { NonNull::new_unchecked(pool) },
        })
    }

    /// Block size in bytes.
    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    /// Number of blocks now (a thin lvol resized, an AIO file rescanned: the base grows
    /// under an open image, and allocations that failed for room succeed again).
    pub fn num_blocks(&self) -> u64 {
        // SAFETY: the descriptor keeps the bdev alive while this exists (see `new`).
        unsafe { sys::spdk_bdev_get_num_blocks(self.bdev) }
    }

    /// Makes SPDK's completion callback offer each completion to the host of `sink` (while
    /// one is armed) before queueing it for `poll`.
    pub fn deliver_to(&mut self, sink: SinkRef) {
        // SAFETY: see `in_flight`.
        unsafe { (*self.pool.as_ptr()).sink = Some(sink) };
    }

    /// Whether every operation in flight completes through SPDK's callback to the sink
    /// (one is set: it takes the completion or has its host poll), and none is queued for
    /// [`pop_done`](Self::pop_done).
    #[inline]
    pub fn announces(&self) -> bool {
        // SAFETY: see `in_flight`.
        let p = unsafe { self.pool.as_ref() };
        p.sink.is_some() && p.done.is_empty()
    }

    /// Operations submitted and not yet reaped by `poll`.
    pub fn in_flight(&self) -> usize {
        // SAFETY: the pool is ours; no callback runs concurrently (same thread).
        let p = unsafe { self.pool.as_ref() };
        // Of this pool's slots (a layer's has fewer than `SLOTS`: counting from `SLOTS`
        // made every idle layer look busy and leaked its pool when dropped).
        p.slots.len() - p.free.len() + p.done.len()
    }

    /// Whether nothing is in flight, queued or waiting for a bdev_io: the channel may be
    /// put (a bdev that left drains to this before its channel goes).
    pub fn idle(&self) -> bool {
        // SAFETY: see `in_flight`.
        self.in_flight() == 0 && !unsafe { self.pool.as_ref() }.waiting
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

    /// What the direct path needs to submit here without the executor: it holds this
    /// thread's channel too, so the channel stays while either does.
    pub fn direct_target(&self) -> DirectTarget {
        // SAFETY: `desc` is open while the node that owns it lives, which outlives every
        // channel state holding a target (see `new`).
        unsafe { DirectTarget::new(self.desc, self.ch.clone(), self.block_size) }
    }

    /// Queues a completion for [`pop_done`](Self::pop_done) (an operation finished without
    /// reaching SPDK).
    pub fn complete_now(&mut self, tag: u64, r: Result<(), DeviceError>) {
        // SAFETY: see `in_flight`.
        unsafe { (*self.pool.as_ptr()).done.push_back((tag, r)) };
    }

    /// How many completions the sink took since this was last asked.
    pub fn take_delivered(&mut self) -> u32 {
        // SAFETY: see `in_flight`.
        unsafe { std::mem::take(&mut (*self.pool.as_ptr()).delivered) }
    }

    /// The oldest completion not delivered to the sink.
    pub fn pop_done(&mut self) -> Option<(u64, Result<(), DeviceError>)> {
        // SAFETY: see `in_flight`; the borrow ends here.
        unsafe { (*self.pool.as_ptr()).done.pop_front() }
    }

    /// Submits `op` (whole blocks, inside the device) under `tag`; its completion goes to the
    /// sink or [`pop_done`](Self::pop_done).
    pub fn submit(&mut self, op: BaseOp, tag: u64) -> Submitted {
        let bs = self.block_size;
        // SAFETY: see `in_flight`.
        let pool = unsafe { &mut *self.pool.as_ptr() };
        if pool.waiting {
            return Submitted::Busy;
        }
        let Some(idx) = pool.free.pop() else {
            return Submitted::Busy;
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
            match op {
                BaseOp::WriteZeroes { offset, len } => sys::spdk_bdev_write_zeroes_blocks(
                    self.desc,
                    self.ch.raw(),
                    offset / bs,
                    len / bs,
                    Some(io_done),
                    slot_ptr,
                ),
                BaseOp::Unmap { offset, len } => sys::spdk_bdev_unmap_blocks(
                    self.desc,
                    self.ch.raw(),
                    offset / bs,
                    len / bs,
                    Some(io_done),
                    slot_ptr,
                ),
                BaseOp::Flush => sys::spdk_bdev_flush_blocks(
                    self.desc,
                    self.ch.raw(),
                    0,
                    self.num_blocks(),
                    Some(io_done),
                    slot_ptr,
                ),
                BaseOp::Read { offset, buf } | BaseOp::Write { offset, buf } => {
                    let is_read = matches!(op, BaseOp::Read { .. });
                    buf.buf.append_iovs(buf.off, buf.len, &mut slot.iovs);
                    slot.buf = (!matches!(buf.buf, SpdkBuf::Iov(_))).then(|| buf.buf.clone());
                    let iovcnt = slot.iovs.len() as i32;
                    let to = Blocks {
                        desc: self.desc,
                        ch: self.ch.raw(),
                    };
                    to.submit(
                        !is_read,
                        slot.iovs.as_mut_ptr(),
                        iovcnt,
                        offset / bs,
                        buf.len as u64 / bs,
                        io_done,
                        slot_ptr,
                    )
                }
            }
        };
        if rc == 0 {
            return Submitted::Yes;
        }
        slot.buf = None;
        pool.free.push(idx);
        if rc == -libc::ENOMEM {
            self.wait_for_bdev_io();
            return Submitted::Busy;
        }
        Submitted::Failed(-rc)
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
            let armed = pool.sink.as_ref().and_then(SinkRef::armed);
            if armed.is_some() {
                // Counted before the sink runs (the pool is not touched while it does).
                pool.delivered += 1;
            }
            armed
        };
        if let Some(s) = sink {
            if s.offer(tag, r) {
                return;
            }
            (*owner).delivered -= 1;
        }
        (*owner).done.push_back((tag, r));
    }
}

impl Drop for BaseIo {
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

/// A base bdev's I/O on this thread before its channel is taken: [`open`](Self::open) gets
/// it on first use. A read-only qcow2 bdev's device of its backing bdev is one: over a
/// chain of them, taking each channel at once nested the creation of every channel below
/// inside one `spdk_get_io_channel`, until SPDK could make no more.
pub struct LazyIo {
    desc: *mut sys::spdk_bdev_desc,
    bdev: *mut sys::spdk_bdev,
    slots: usize,
    iovs: usize,
    /// The sink to install once open (see [`BaseIo::deliver_to`]).
    sink: Option<SinkRef>,
}

impl LazyIo {
    /// The I/O of `desc` on the calling thread, taken later; the descriptor must stay open
    /// as long as this (or the [`BaseIo`] it opens) exists.
    pub fn new(desc: &Desc) -> LazyIo {
        LazyIo::with_slots(desc, SLOTS, SLOT_IOVS)
    }

    /// [`new`](Self::new) opening as [`BaseIo::with_slots`] does.
    pub fn with_slots(desc: &Desc, slots: usize, iovs: usize) -> LazyIo {
        LazyIo {
            desc: desc.raw(),
            bdev: desc.bdev(),
            slots,
            iovs,
            sink: None,
        }
    }

    /// Its size in bytes now (read live, as [`BaseIo::num_blocks`] does).
    pub fn size(&self) -> u64 {
        // SAFETY: the descriptor keeps the bdev alive while this exists (see `new`).
        unsafe {
            sys::spdk_bdev_get_num_blocks(self.bdev)
                * u64::from(sys::spdk_bdev_get_block_size(self.bdev))
        }
    }

    /// See [`BaseIo::deliver_to`]; installed when it opens.
    pub fn deliver_to(&mut self, sink: SinkRef) {
        self.sink = Some(sink);
    }

    /// Takes this thread's channel of the bdev; `None` if SPDK has none to give (the caller
    /// fails the operation that needed it and may try again later).
    pub fn open(&self) -> Option<BaseIo> {
        // SAFETY: the descriptor is open (see `new`).
        let mut io = unsafe { BaseIo::of_raw(self.desc, self.slots, self.iovs) }?;
        if let Some(sink) = &self.sink {
            io.deliver_to(sink.clone());
        }
        Some(io)
    }
}
