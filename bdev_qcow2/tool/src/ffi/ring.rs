//! An io_uring whose SQEs can only point at memory the ring itself keeps alive.

use super::aligned_buf::AlignedBuf;
use io_uring::{opcode, squeue, types, IoUring};
use std::os::fd::{AsRawFd, BorrowedFd};

/// One operation to queue: reads and writes name a range of an [`AlignedBuf`], whose
/// handle the ring keeps until the operation's completion is reaped.
pub enum RingOp<'a> {
    /// Reads into `len` bytes at `off` of `buf` from `at` of the file.
    Read {
        /// The buffer read into.
        buf: &'a AlignedBuf,
        /// Offset in `buf`.
        off: usize,
        /// Bytes to read.
        len: u32,
        /// Offset in the file.
        at: u64,
    },
    /// Writes `len` bytes at `off` of `buf` to `at` of the file.
    Write {
        /// The buffer written from.
        buf: &'a AlignedBuf,
        /// Offset in `buf`.
        off: usize,
        /// Bytes to write.
        len: u32,
        /// Offset in the file.
        at: u64,
    },
    /// `fdatasync`.
    DataSync,
    /// Punches a hole of `len` bytes at `at`, the file size kept.
    PunchHole {
        /// Offset in the file.
        at: u64,
        /// Length of the hole.
        len: u64,
    },
}

/// The submission queue is full: nothing was queued.
#[derive(Debug)]
pub struct SqFull;

/// An io_uring and the buffers its queued and running operations point at.
pub struct Ring {
    ring: IoUring,
    /// Per user-data slot, the buffer of the operation in flight there: the kernel may
    /// read or write it until that operation's CQE is reaped.
    kept: Vec<Option<AlignedBuf>>,
}

impl Ring {
    /// A ring of `entries` SQEs (a power of two).
    pub fn new(entries: u32) -> std::io::Result<Self> {
        Ok(Ring {
            ring: IoUring::new(entries)?,
            kept: Vec::new(),
        })
    }

    /// Queues `op` on `fd`, tagged `slot` (its CQE's user data). A slot has one operation
    /// in flight at a time: queueing a second before the first was reaped panics.
    pub fn push(&mut self, fd: BorrowedFd<'_>, op: RingOp<'_>, slot: usize) -> Result<(), SqFull> {
        if self.kept.len() <= slot {
            self.kept.resize_with(slot + 1, || None);
        }
        assert!(
            self.kept[slot].is_none(),
            "ring slot {slot} already in flight"
        );
        let fd = types::Fd(fd.as_raw_fd());
        let (entry, buf): (squeue::Entry, _) = match op {
            RingOp::Read { buf, off, len, at } => {
                let p = buf.ptr(off, len as usize);
                (opcode::Read::new(fd, p, len).offset(at).build(), Some(buf))
            }
            RingOp::Write { buf, off, len, at } => {
                let p = buf.ptr(off, len as usize);
                (opcode::Write::new(fd, p, len).offset(at).build(), Some(buf))
            }
            RingOp::DataSync => (
                opcode::Fsync::new(fd)
                    .flags(types::FsyncFlags::DATASYNC)
                    .build(),
                None,
            ),
            RingOp::PunchHole { at, len } => (
                opcode::Fallocate::new(fd, len)
                    .offset(at)
                    .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
                    .build(),
                None,
            ),
        };
        let entry = entry.user_data(slot as u64);
        // SAFETY: a read's or write's range is inside its buffer (checked by `ptr`), and a
        // clone of that buffer's handle is kept in `kept[slot]` from now until this
        // entry's CQE is reaped (`reap`), or forever if the ring is dropped first (`Drop`),
        // so the memory outlives the kernel's use of it.
        let pushed = unsafe { self.ring.submission().push(&entry).is_ok() };
        if !pushed {
            return Err(SqFull);
        }
        self.kept[slot] = buf.cloned();
        Ok(())
    }

    /// Hands the queued SQEs to the kernel without waiting.
    pub fn submit(&mut self) -> std::io::Result<usize> {
        self.ring.submit()
    }

    /// Appends the completions ready, as (slot, result), to `out`, and releases their
    /// buffers.
    pub fn reap(&mut self, out: &mut Vec<(u64, i32)>) {
        let start = out.len();
        out.extend(
            self.ring
                .completion()
                .map(|cqe| (cqe.user_data(), cqe.result())),
        );
        for &(slot, _) in &out[start..] {
            if let Some(k) = self.kept.get_mut(slot as usize) {
                *k = None;
            }
        }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // Operations still in flight may yet write into their buffers after the ring is
        // gone (the kernel finishes them asynchronously): their memory is leaked rather
        // than freed under them. A device is dropped idle in every normal path.
        for buf in self.kept.drain(..).flatten() {
            std::mem::forget(buf);
        }
    }
}
