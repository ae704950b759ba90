//! The standalone host's block device: a file or block device driven by io_uring.
//!
//! `submit` only queues an SQE (busy when the ring is full); `poll` submits queued SQEs
//! without waiting and reaps CQEs, so nothing ever sleeps in the kernel. Files are opened
//! with O_DIRECT when the file system accepts 512-byte aligned direct I/O, buffered
//! otherwise. Short reads at end of file are completed with zeros, other short transfers
//! are resubmitted for the remainder. A discard punches a hole (`fallocate` with
//! `FALLOC_FL_PUNCH_HOLE`, the size kept; on a block device the kernel unmaps, or answers
//! EOPNOTSUPP).

use crate::ffi::ring::{Ring, RingOp};
use crate::ffi::sys;
use qcow2_engine::io::{BlockDevice, BufSlice, Busy, DeviceError, DeviceOp, IoBuffer};
use slab::Slab;
use std::fs::{File, OpenOptions};
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::Path;

pub use crate::ffi::aligned_buf::{AlignedBuf, BUF_ALIGN};

/// An operation in flight: what to resubmit after a short transfer.
struct InFlight {
    tag: u64,
    op: DeviceOp<AlignedBuf>,
    done: usize,
}

/// A file or block device served through io_uring.
pub struct UringDevice {
    file: File,
    ring: Ring,
    size: u64,
    /// Length of the file on disk: at least `size`; grown ahead of appending writes (see
    /// `grow_ahead`) and trimmed back to `size` on drop. 0 for block devices.
    file_len: u64,
    regular_file: bool,
    /// Whether this device grows and trims the file (false for the extra channels of a
    /// multi-core host: only the metadata owner's channel changes the file's length).
    owns_len: bool,
    depth: usize,
    inflight: Slab<InFlight>,
    unsubmitted: usize,
    direct: bool,
    completions: Vec<(u64, Result<(), DeviceError>)>,
    /// Reaped CQEs (user data, result), kept between polls: a poll that finds few
    /// completions costs no more than it reaps (a zeroed stack array cost 1 KiB of stores
    /// per poll).
    cqes: Vec<(u64, i32)>,
    stats: DeviceStats,
    /// Whether this open took image lock bytes ([`UringDevice::lock`]), released on drop.
    locked: bool,
    /// Whether the file lives in memory (tmpfs), where `fsync` does nothing: a flush then
    /// completes at once instead of a round trip through io_uring's workers.
    in_memory: bool,
}

/// Operation counters of a [`UringDevice`] (for benchmarks: write amplification).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DeviceStats {
    /// Read operations submitted.
    pub reads: u64,
    /// Write operations submitted.
    pub writes: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Flushes submitted.
    pub flushes: u64,
    /// Discards (holes punched) submitted.
    pub discards: u64,
    /// Bytes of those discards.
    pub bytes_discarded: u64,
}

impl Drop for UringDevice {
    fn drop(&mut self) {
        // Give back the space grown ahead of appending writes (what was never written).
        if self.regular_file && self.owns_len && self.file_len > self.size {
            let _ = self.file.set_len(self.size);
        }
        if self.locked {
            // Released here rather than by the close: the file may outlive this device
            // (io_uring drops its references asynchronously, a child being spawned holds
            // a copy of the descriptor table until it execs), and the lock must not.
            crate::lock::unlock(self.file.as_fd());
        }
    }
}

/// Size of a file or block device.
fn device_size(file: &File) -> std::io::Result<u64> {
    let md = file.metadata()?;
    if md.file_type().is_block_device() {
        sys::block_device_size(file.as_fd())
    } else {
        Ok(md.len())
    }
}

/// Whether `file` lies on tmpfs (memory only: its `fsync` is a no-op).
fn on_tmpfs(file: &File) -> bool {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    sys::fs_type(file.as_fd()).is_ok_and(|t| t == TMPFS_MAGIC)
}

/// Whether 512-byte aligned O_DIRECT reads work on this file (a file system that cannot do
/// direct I/O at that alignment answers EINVAL; an empty file answers 0 bytes).
fn direct_io_works(file: &File) -> bool {
    let buf = AlignedBuf::new(512);
    let mut ok = false;
    buf.with_bytes_mut(0, 512, &mut |b| ok = file.read_at(b, 0).is_ok());
    ok
}

/// How [`UringDevice::open`] opens a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenMode {
    /// For writing as well as reading.
    pub writable: bool,
    /// With O_DIRECT when the file system supports it (buffered otherwise).
    pub direct: bool,
}

impl UringDevice {
    /// Opens `path` as `mode` says with a ring of `depth` entries.
    pub fn open(path: &Path, mode: OpenMode, depth: u32) -> std::io::Result<Self> {
        let OpenMode { writable, direct } = mode;
        let open = |direct: bool| {
            let mut o = OpenOptions::new();
            o.read(true).write(writable);
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            o.open(path)
        };
        let (file, direct) = match open(direct) {
            Ok(f) => {
                if !direct || direct_io_works(&f) {
                    (f, direct)
                } else {
                    (open(false)?, false)
                }
            }
            Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => (open(false)?, false),
            Err(e) => return Err(e),
        };
        let size = device_size(&file)?;
        let ring = Ring::new(depth.next_power_of_two())?;
        let regular_file = file.metadata()?.file_type().is_file();
        let in_memory = regular_file && on_tmpfs(&file);
        Ok(UringDevice {
            file,
            ring,
            size,
            file_len: size,
            regular_file,
            owns_len: true,
            depth: depth as usize,
            inflight: Slab::with_capacity(depth as usize),
            unsubmitted: 0,
            direct,
            completions: Vec::with_capacity(depth as usize),
            cqes: Vec::with_capacity(depth as usize),
            stats: DeviceStats::default(),
            locked: false,
            in_memory,
        })
    }

    /// Takes the image lock bytes of `access` on this open ([`crate::lock::lock`]), before
    /// anything reads or writes the image; they are released when the device is dropped
    /// (also after a failure here, for the bytes already taken).
    pub fn lock(&mut self, access: crate::lock::Access) -> Result<(), crate::lock::LockFailure> {
        self.locked = true;
        crate::lock::lock(self.file.as_fd(), access)
    }

    /// Extends a regular file (sparsely) by 1 GiB past `end` before a write that would
    /// append to it: appending direct writes are serialised by file systems (each changes
    /// the file size), writes inside the file are not. Holes keep the image thin. What was
    /// never written is trimmed off when the device is dropped; after a crash the tail
    /// stays as a hole, which qcow2 ignores.
    fn grow_ahead(&mut self, end: u64) {
        if !self.regular_file || !self.owns_len {
            return;
        }
        let target = end.max(self.file_len + (1 << 30)).next_multiple_of(1 << 20);
        if self.file.set_len(target).is_ok() {
            self.file_len = target;
        }
    }

    /// Makes this device another channel to a file whose length someone else (the metadata
    /// owner's channel) manages: it never grows nor trims the file. Without this, a core's
    /// channel, which knows the file length at its open only, would cut off what the owner
    /// appended since when it grows ahead or trims on drop.
    pub fn into_channel(mut self) -> Self {
        self.owns_len = false;
        self
    }

    /// Operation counters.
    pub fn stats(&self) -> DeviceStats {
        self.stats
    }

    /// Whether O_DIRECT is in use.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Queues the SQE for `inflight[idx]` (its remaining part). Returns false if the SQ is full.
    fn push_sqe(&mut self, idx: usize) -> bool {
        let f = &self.inflight[idx];
        let op = match &f.op {
            DeviceOp::Read { offset, buf } | DeviceOp::Write { offset, buf } => {
                let (off, len, at) = (
                    buf.off + f.done,
                    (buf.len - f.done) as u32,
                    offset + f.done as u64,
                );
                if matches!(f.op, DeviceOp::Read { .. }) {
                    RingOp::Read {
                        buf: &buf.buf,
                        off,
                        len,
                        at,
                    }
                } else {
                    RingOp::Write {
                        buf: &buf.buf,
                        off,
                        len,
                        at,
                    }
                }
            }
            DeviceOp::Flush => RingOp::DataSync,
            DeviceOp::Discard { offset, len } => RingOp::PunchHole {
                at: *offset,
                len: *len,
            },
            DeviceOp::WriteZeroes { .. } => unreachable!("`submit` writes zeroes from a buffer"),
        };
        let pushed = self.ring.push(self.file.as_fd(), op, idx).is_ok();
        if pushed {
            self.unsubmitted += 1;
        }
        pushed
    }

    /// Handles one CQE; may resubmit the remainder of a short transfer.
    fn complete(&mut self, idx: usize, res: i32) {
        if res < 0 {
            let f = self.inflight.remove(idx);
            self.completions.push((f.tag, Err(DeviceError(-res))));
            return;
        }
        let n = res as usize;
        let f = &mut self.inflight[idx];
        let (total, is_read, buf) = match &f.op {
            DeviceOp::Read { buf, .. } => (buf.len, true, Some(buf.clone())),
            DeviceOp::Write { buf, .. } => (buf.len, false, None),
            DeviceOp::WriteZeroes { .. } | DeviceOp::Discard { .. } | DeviceOp::Flush => {
                (0, false, None)
            }
        };
        f.done += n;
        if f.done >= total {
            let f = self.inflight.remove(idx);
            self.completions.push((f.tag, Ok(())));
        } else if n == 0 && is_read {
            // End of file: the rest reads as zeros.
            if let Some(b) = buf {
                b.buf.fill(b.off + f.done, total - f.done, 0);
            }
            let f = self.inflight.remove(idx);
            self.completions.push((f.tag, Ok(())));
        } else if n == 0 {
            let f = self.inflight.remove(idx);
            self.completions.push((f.tag, Err(DeviceError(libc::EIO))));
        } else if !self.push_sqe(idx) {
            // Cannot happen: this entry's own slot in the ring was just freed.
            let f = self.inflight.remove(idx);
            self.completions
                .push((f.tag, Err(DeviceError(libc::EBUSY))));
        }
    }
}

impl BlockDevice for UringDevice {
    type Buf = AlignedBuf;

    fn size(&self) -> u64 {
        self.size
    }

    fn alloc_buf(&mut self, len: usize) -> AlignedBuf {
        AlignedBuf::new(len)
    }

    fn submit(&mut self, op: DeviceOp<AlignedBuf>, tag: u64) -> Result<(), Busy<AlignedBuf>> {
        if self.inflight.len() >= self.depth {
            return Err(Busy(op, tag));
        }
        // Zeroes are written from a zeroed buffer: this device does not claim
        // `zeroes_cheaply`, so the engine asks for them only where it has no choice.
        let op = match op {
            DeviceOp::WriteZeroes { offset, len } => DeviceOp::Write {
                offset,
                buf: BufSlice::whole(AlignedBuf::new(len as usize)),
            },
            op => op,
        };
        match &op {
            DeviceOp::Write { offset, buf } => {
                let end = offset + buf.len as u64;
                if end > self.file_len {
                    self.grow_ahead(end);
                }
                self.size = self.size.max(end);
                self.stats.writes += 1;
                self.stats.bytes_written += buf.len as u64;
            }
            DeviceOp::Read { .. } => self.stats.reads += 1,
            DeviceOp::Flush if self.in_memory => {
                self.stats.flushes += 1;
                self.completions.push((tag, Ok(())));
                return Ok(());
            }
            DeviceOp::Flush => self.stats.flushes += 1,
            DeviceOp::Discard { len, .. } => {
                self.stats.discards += 1;
                self.stats.bytes_discarded += len;
            }
            DeviceOp::WriteZeroes { .. } => unreachable!("turned into a write above"),
        }
        let idx = self.inflight.insert(InFlight { tag, op, done: 0 });
        if !self.push_sqe(idx) {
            let f = self.inflight.remove(idx);
            return Err(Busy(f.op, f.tag));
        }
        Ok(())
    }

    fn can_grow(&self) -> bool {
        self.regular_file && self.owns_len
    }

    fn completes_only_submitted(&self) -> bool {
        // Each submitted operation completes once, in `poll`; nothing else does.
        true
    }

    fn discards(&self) -> bool {
        // A file's holes; a block device unmaps where it can (EOPNOTSUPP stops the engine
        // asking).
        true
    }

    fn ensure_size(&mut self, size: u64) -> Result<(), DeviceError> {
        if size <= self.size {
            return Ok(());
        }
        if !self.regular_file {
            return Err(DeviceError(libc::ENOSPC));
        }
        if size > self.file_len && self.owns_len {
            // Sparse, and ahead like appending writes (allocations call this one by one).
            self.grow_ahead(size);
            if size > self.file_len {
                self.file
                    .set_len(size)
                    .map_err(|e| DeviceError(e.raw_os_error().unwrap_or(libc::EIO)))?;
                self.file_len = size;
            }
        }
        self.size = size;
        Ok(())
    }

    fn poll(&mut self, done: &mut dyn FnMut(u64, Result<(), DeviceError>)) -> usize {
        if self.unsubmitted > 0 {
            // Never waits: only hands the queued SQEs to the kernel.
            match self.ring.submit() {
                Ok(_) => self.unsubmitted = 0,
                Err(e)
                    if e.raw_os_error() == Some(libc::EBUSY)
                        || e.raw_os_error() == Some(libc::EAGAIN) => {}
                Err(e) => tracing::error!("io_uring submit failed: {e}"),
            }
        }
        let mut cqes = std::mem::take(&mut self.cqes);
        self.ring.reap(&mut cqes);
        for &(idx, res) in &cqes {
            self.complete(idx as usize, res);
        }
        cqes.clear();
        self.cqes = cqes;
        let count = self.completions.len();
        for (tag, res) in self.completions.drain(..) {
            done(tag, res);
        }
        count
    }
}

/// Whether `pos` of a file lies in data or a hole, and where that run ends (`SEEK_DATA` /
/// `SEEK_HOLE`). Returns `(is_data, end)`; file systems without hole reporting say data.
pub fn data_or_hole(file: &File, pos: u64, end: u64) -> (bool, u64) {
    let Ok(data) = sys::seek_data(file.as_fd(), pos) else {
        // ENXIO: no data at or after pos — a hole to the end.
        return (false, end);
    };
    if data > pos {
        return (false, data.min(end));
    }
    let hole = sys::seek_hole(file.as_fd(), pos).unwrap_or(end);
    (true, hole.min(end).max(pos + 1))
}

/// A hint to the CPU to load the cache line at `p` into its caches (no effect on other
/// architectures): hosts prefetch the L2 entries of a batch of requests before submitting
/// them ([`Disk::entry_hint`](qcow2_engine::chain::Disk::entry_hint)).
#[inline]
pub fn prefetch_line(p: *const u8) {
    sys::prefetch_line(p)
}
