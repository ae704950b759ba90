//! An in-memory block device for tests, with hooks to inject what a real device cannot do
//! on demand: failures of the k-th operation, latency (in polls), a queue depth that makes
//! it report busy, and a log of every write and flush (for crash-state replay).
//! [`host`] puts guest requests in as a host does.

use crate::io::{BlockDevice, Busy, DeviceError, DeviceOp, HeapBuf};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

/// One recorded device write or flush.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoggedOp {
    /// Bytes written at an offset.
    Write(u64, Vec<u8>),
    /// A completed flush.
    Flush,
    /// The device grew to this many bytes (a file's new length, stable like a write once a
    /// flush follows).
    Grow(u64),
    /// Bytes discarded at an offset (they may read as anything afterwards; a replay that
    /// fills them with garbage shows whether anything still pointed at them).
    Discard(u64, u64),
}

/// State shared between a [`MemDevice`] and the test that inspects it.
#[derive(Default)]
pub struct MemState {
    /// Device contents.
    pub data: Vec<u8>,
    /// Most operations in flight before `submit` says busy (0: unlimited).
    pub queue_depth: usize,
    /// Polls an operation takes to complete.
    pub latency_polls: u64,
    /// Fail the operation with this index (0-based, counting every submitted op) with errno.
    pub fail_op: Option<(u64, i32)>,
    /// Operations submitted so far.
    pub ops: u64,
    /// Reads submitted so far.
    pub reads: u64,
    /// Whether to record writes and flushes in `log`.
    pub record: bool,
    /// Recorded writes and flushes.
    pub log: Vec<LoggedOp>,
    /// A fixed-size device (like a bdev): it never grows ([`MemDevice::fixed`]).
    pub fixed: bool,
    /// Claims [`BlockDevice::zeroes_cheaply`] (like an NVMe namespace or a malloc bdev), so
    /// the engine zeroes with [`DeviceOp::WriteZeroes`].
    pub cheap_zeroes: bool,
    /// Claims [`BlockDevice::discards`] (like a sparse file or a thin bdev): a discard
    /// zeroes the range here (a punched hole).
    pub discards: bool,
    /// Claims [`BlockDevice::discard_zeroes`] (a file's punched hole): a discard is
    /// logged as a write of zeros, which a crash keeps or not until a flush.
    pub discard_zeroes: bool,
    /// Bytes discarded so far.
    pub discarded_bytes: u64,
    /// `WriteZeroes` operations submitted so far.
    pub zero_writes: u64,
    /// Fail every `WriteZeroes` with this errno (a file system without `fallocate`'s
    /// zero range, say).
    pub zeroes_fail: Option<i32>,
    /// Fail every operation with this errno: the device went away (a hot-removed bdev).
    pub gone: Option<i32>,
    inflight: VecDeque<(u64, u64, Result<(), DeviceError>)>,
    polls: u64,
}

/// The in-memory device. Clones share the same state.
#[derive(Clone)]
pub struct MemDevice(pub Rc<RefCell<MemState>>);

impl MemDevice {
    /// A device holding `data`.
    pub fn new(data: Vec<u8>) -> Self {
        MemDevice(Rc::new(RefCell::new(MemState {
            data,
            ..Default::default()
        })))
    }
    /// A fixed-size device of `size` bytes (like a bdev) starting with `data`: it never
    /// grows, so the allocator keeps inside it (and lays out data regions).
    pub fn fixed(mut data: Vec<u8>, size: usize) -> Self {
        data.resize(size.max(data.len()), 0);
        MemDevice(Rc::new(RefCell::new(MemState {
            data,
            fixed: true,
            ..Default::default()
        })))
    }
    /// The device contents.
    pub fn contents(&self) -> Vec<u8> {
        self.0.borrow().data.clone()
    }
}

impl MemState {
    /// Writes `bytes` at `offset` (and logs it, if recording).
    fn write(&mut self, offset: u64, bytes: Vec<u8>) -> Result<(), DeviceError> {
        let end = offset as usize + bytes.len();
        if self.fixed && self.data.len() < end {
            // Like a bdev: nothing is written past its end.
            return Err(DeviceError(5)); // EIO
        }
        if self.data.len() < end {
            self.data.resize(end, 0);
        }
        self.data[offset as usize..end].copy_from_slice(&bytes);
        if self.record {
            self.log.push(LoggedOp::Write(offset, bytes));
        }
        Ok(())
    }
}

impl BlockDevice for MemDevice {
    type Buf = HeapBuf;
    fn size(&self) -> u64 {
        self.0.borrow().data.len() as u64
    }
    fn alloc_buf(&mut self, len: usize) -> HeapBuf {
        HeapBuf::new(len)
    }
    fn submit(&mut self, op: DeviceOp<HeapBuf>, tag: u64) -> Result<(), Busy<HeapBuf>> {
        let mut s = self.0.borrow_mut();
        if s.queue_depth > 0 && s.inflight.len() >= s.queue_depth {
            return Err(Busy(op, tag));
        }
        let index = s.ops;
        s.ops += 1;
        let fail = match s.fail_op {
            Some((k, errno)) if k == index => Some(DeviceError(errno)),
            _ => s.gone.map(DeviceError),
        };
        let result = match (fail, op) {
            (Some(e), _) => Err(e),
            (None, DeviceOp::Read { offset, buf }) => {
                s.reads += 1;
                // Straight into the buffer: a read allocates nothing (tests count
                // allocations on the read path).
                let size = s.data.len() as u64;
                let n = if offset < size {
                    (size - offset).min(buf.len as u64) as usize
                } else {
                    0
                };
                if n > 0 {
                    buf.copy_in(0, &s.data[offset as usize..offset as usize + n]);
                }
                buf.sub(n, buf.len - n).zero();
                Ok(())
            }
            (None, DeviceOp::Write { offset, buf }) => {
                let mut tmp = vec![0u8; buf.len];
                buf.copy_out(0, &mut tmp);
                s.write(offset, tmp)
            }
            (None, DeviceOp::WriteZeroes { offset, len }) => {
                s.zero_writes += 1;
                match s.zeroes_fail {
                    Some(errno) => Err(DeviceError(errno)),
                    None => s.write(offset, vec![0u8; len as usize]),
                }
            }
            (None, DeviceOp::Discard { offset, len }) => {
                // Only inside the device, like a hole punched with the size kept.
                let end = (offset + len).min(s.data.len() as u64);
                if s.discards && offset < end {
                    s.data[offset as usize..end as usize].fill(0);
                    s.discarded_bytes += end - offset;
                    if s.record {
                        let logged = if s.discard_zeroes {
                            LoggedOp::Write(offset, vec![0; (end - offset) as usize])
                        } else {
                            LoggedOp::Discard(offset, end - offset)
                        };
                        s.log.push(logged);
                    }
                }
                Ok(())
            }
            (None, DeviceOp::Flush) => {
                if s.record {
                    s.log.push(LoggedOp::Flush);
                }
                Ok(())
            }
        };
        let due = s.polls + s.latency_polls;
        s.inflight.push_back((due, tag, result));
        Ok(())
    }
    fn can_grow(&self) -> bool {
        !self.0.borrow().fixed
    }
    fn zeroes_cheaply(&self) -> bool {
        self.0.borrow().cheap_zeroes
    }
    fn discards(&self) -> bool {
        self.0.borrow().discards
    }
    fn discard_zeroes(&self) -> bool {
        let s = self.0.borrow();
        s.discards && s.discard_zeroes
    }
    fn ensure_size(&mut self, size: u64) -> Result<(), DeviceError> {
        let mut s = self.0.borrow_mut();
        if (s.data.len() as u64) < size {
            if s.fixed {
                return Err(DeviceError(28)); // ENOSPC
            }
            s.data.resize(size as usize, 0);
            if s.record {
                s.log.push(LoggedOp::Grow(size));
            }
        }
        Ok(())
    }
    fn poll(&mut self, done: &mut dyn FnMut(u64, Result<(), DeviceError>)) -> usize {
        let mut s = self.0.borrow_mut();
        s.polls += 1;
        let now = s.polls;
        let mut n = 0;
        while let Some(&(due, tag, res)) = s.inflight.front() {
            if due > now {
                break;
            }
            s.inflight.pop_front();
            n += 1;
            done(tag, res);
        }
        n
    }
}

pub use crate::rng::Rng;

pub mod host;

/// One core's channel to a disk shared by every core (tests of several executors on one
/// image): the bytes are common, each channel's operations complete on its next poll.
pub struct SharedDisk {
    data: Rc<RefCell<Vec<u8>>>,
    done: VecDeque<u64>,
}

impl SharedDisk {
    /// A channel of the disk holding `data` (shared with every other channel of it).
    pub fn new(data: &Rc<RefCell<Vec<u8>>>) -> SharedDisk {
        SharedDisk {
            data: data.clone(),
            done: VecDeque::new(),
        }
    }

    /// Another channel of the same disk.
    pub fn channel(&self) -> SharedDisk {
        SharedDisk::new(&self.data)
    }
}

impl BlockDevice for SharedDisk {
    type Buf = HeapBuf;
    fn size(&self) -> u64 {
        self.data.borrow().len() as u64
    }
    fn alloc_buf(&mut self, len: usize) -> HeapBuf {
        HeapBuf::new(len)
    }
    fn submit(&mut self, op: DeviceOp<HeapBuf>, tag: u64) -> Result<(), Busy<HeapBuf>> {
        let mut d = self.data.borrow_mut();
        match op {
            DeviceOp::Read { offset, buf } => {
                let mut tmp = vec![0u8; buf.len];
                let o = offset as usize;
                if o < d.len() {
                    let n = (d.len() - o).min(buf.len);
                    tmp[..n].copy_from_slice(&d[o..o + n]);
                }
                buf.copy_in(0, &tmp);
            }
            DeviceOp::Write { offset, buf } => {
                let end = offset as usize + buf.len;
                if d.len() < end {
                    d.resize(end, 0);
                }
                buf.copy_out(0, &mut d[offset as usize..end]);
            }
            DeviceOp::WriteZeroes { offset, len } => {
                let end = (offset + len) as usize;
                if d.len() < end {
                    d.resize(end, 0);
                }
                d[offset as usize..end].fill(0);
            }
            // Claims no discards: never sent one.
            DeviceOp::Discard { .. } | DeviceOp::Flush => {}
        }
        self.done.push_back(tag);
        Ok(())
    }
    fn can_grow(&self) -> bool {
        true
    }
    fn ensure_size(&mut self, size: u64) -> Result<(), DeviceError> {
        let mut d = self.data.borrow_mut();
        if (d.len() as u64) < size {
            d.resize(size as usize, 0);
        }
        Ok(())
    }
    fn poll(&mut self, done: &mut dyn FnMut(u64, Result<(), DeviceError>)) -> usize {
        let n = self.done.len();
        while let Some(t) = self.done.pop_front() {
            done(t, Ok(()));
        }
        n
    }
}
