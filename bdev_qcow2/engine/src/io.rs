//! The seams a host implements: a polled block device and the buffers it reads into.
//!
//! The shape fits an SPDK base-bdev channel (submit returns at once, `-ENOMEM` means busy,
//! completions arrive when the thread polls), an io_uring file (SQ full means busy, CQEs
//! are reaped by polling) and the in-memory test device alike. Nothing here blocks.

use crate::compress::Decompressor;
use crate::error::Result;
use crate::format::CompressionType;
use std::fmt;

/// Alignment (offset, length and memory) the engine keeps for every device I/O.
pub const SECTOR: u64 = 512;

/// A buffer the device reads into or writes from. It is a cheap handle (cloning shares the
/// same memory, like an iovec or a DMA buffer pointer); the host guarantees the memory stays
/// valid while any clone exists. Methods panic only on out-of-range offsets, which the
/// engine never passes.
pub trait IoBuffer: Clone + 'static {
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Whether the buffer is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `dst.len()` bytes starting at `off` out of the buffer.
    fn copy_out(&self, off: usize, dst: &mut [u8]);
    /// Copies `src` into the buffer at `off`.
    fn copy_in(&self, off: usize, src: &[u8]);
    /// Sets `len` bytes at `off` to `byte`.
    fn fill(&self, off: usize, len: usize, byte: u8);
    /// Copies `len` bytes at `off` into `dst` at `dst_off` (another buffer). This default
    /// goes through a small stack buffer; hosts whose memory they can address directly
    /// copy at once.
    fn copy_to(&self, off: usize, dst: &Self, dst_off: usize, len: usize) {
        let mut bounce = [0u8; 4096];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(bounce.len());
            self.copy_out(off + done, &mut bounce[..n]);
            dst.copy_in(dst_off + done, &bounce[..n]);
            done += n;
        }
    }
    /// Runs `f` on `len` bytes at `off`, changed in place (an encrypted image's sectors, a
    /// cached granule copied in). `f` must not reach this buffer (or a clone of it). This
    /// default goes through a copy; hosts whose memory they can address lend it.
    fn with_bytes_mut(&self, off: usize, len: usize, f: &mut dyn FnMut(&mut [u8])) {
        let mut tmp = vec![0u8; len];
        self.copy_out(off, &mut tmp);
        f(&mut tmp);
        self.copy_in(off, &tmp);
    }
    /// Decompresses the `ct` cluster in `len` bytes at `off` into `out` (filled whole),
    /// reading the bytes where they are. `None` where this buffer cannot lend them as one
    /// piece (the caller copies them out first). The decompressor gets the buffer's bytes
    /// and `out` alone: nothing else runs on them meanwhile.
    fn decompress_to(
        &self,
        off: usize,
        len: usize,
        dec: &mut Decompressor,
        ct: CompressionType,
        out: &mut [u8],
    ) -> Option<Result<()>> {
        let _ = (off, len, dec, ct, out);
        None
    }

    /// Decompresses the `ct` cluster in `src_len` bytes at `src_off` of `src` straight
    /// into `len` bytes at `off` of this buffer (filled whole), each read or written where
    /// it is. `None` where either buffer cannot lend its range as one piece, or the two
    /// overlap (the caller goes through its own memory).
    #[allow(clippy::too_many_arguments)]
    fn decompress_into(
        &self,
        off: usize,
        len: usize,
        src: &Self,
        src_off: usize,
        src_len: usize,
        dec: &mut Decompressor,
        ct: CompressionType,
    ) -> Option<Result<()>> {
        let _ = (off, len, src, src_off, src_len, dec, ct);
        None
    }
}

/// A byte range of an [`IoBuffer`].
#[derive(Clone)]
pub struct BufSlice<B> {
    /// The buffer.
    pub buf: B,
    /// Start within the buffer.
    pub off: usize,
    /// Length.
    pub len: usize,
}

impl<B: IoBuffer> BufSlice<B> {
    /// The whole buffer.
    pub fn whole(buf: B) -> Self {
        let len = buf.len();
        BufSlice { buf, off: 0, len }
    }
    /// A sub-range (`off` relative to this slice).
    pub fn sub(&self, off: usize, len: usize) -> Self {
        debug_assert!(off + len <= self.len);
        BufSlice {
            buf: self.buf.clone(),
            off: self.off + off,
            len,
        }
    }
    /// Fills the whole slice with zeros.
    pub fn zero(&self) {
        self.buf.fill(self.off, self.len, 0);
    }
    /// Copies `src` into the slice at `off`.
    pub fn copy_in(&self, off: usize, src: &[u8]) {
        self.buf.copy_in(self.off + off, src);
    }
    /// Copies out of the slice at `off`.
    pub fn copy_out(&self, off: usize, dst: &mut [u8]) {
        self.buf.copy_out(self.off + off, dst);
    }
    /// Runs `f` on `len` bytes at `off` of the slice, in place where the host lends them
    /// ([`IoBuffer::with_bytes_mut`]).
    pub fn with_bytes_mut(&self, off: usize, len: usize, f: &mut dyn FnMut(&mut [u8])) {
        self.buf.with_bytes_mut(self.off + off, len, f);
    }
}

/// A guest request's buffer lent to the engine for one call (the plan's copy of a read
/// the prefetch ring serves, the decryption of a direct read): a host may lend a borrow of
/// its request, which the engine cannot keep past the call. A [`BufSlice`] lends itself.
pub trait LentBuf<B: IoBuffer> {
    /// Bytes covered.
    fn len(&self) -> usize;
    /// Whether it covers nothing.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `n` bytes at `src_off` of `src` to `off` of this buffer.
    fn copy_from(&self, off: usize, src: &B, src_off: usize, n: usize);
    /// Runs `f` on all its bytes, changed in place ([`IoBuffer::with_bytes_mut`]).
    fn with_bytes_mut(&self, f: &mut dyn FnMut(&mut [u8]));
}

impl<B: IoBuffer> LentBuf<B> for BufSlice<B> {
    fn len(&self) -> usize {
        self.len
    }
    fn copy_from(&self, off: usize, src: &B, src_off: usize, n: usize) {
        src.copy_to(src_off, &self.buf, self.off + off, n);
    }
    fn with_bytes_mut(&self, f: &mut dyn FnMut(&mut [u8])) {
        self.buf.with_bytes_mut(self.off, self.len, f);
    }
}

impl<B> fmt::Debug for BufSlice<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BufSlice({}+{})", self.off, self.len)
    }
}

/// One device operation.
#[derive(Debug, Clone)]
pub enum DeviceOp<B> {
    /// Read `buf.len` bytes at `offset` into `buf`. A read past the end of the device
    /// returns zeros for the missing part (like a file).
    Read {
        /// Byte offset on the device.
        offset: u64,
        /// Destination.
        buf: BufSlice<B>,
    },
    /// Write `buf` at `offset`.
    Write {
        /// Byte offset on the device.
        offset: u64,
        /// Source.
        buf: BufSlice<B>,
    },
    /// Make `len` bytes at `offset` read as zeros, with no data transfer where the device
    /// can ([`BlockDevice::zeroes_cheaply`]; elsewhere it writes zeros).
    WriteZeroes {
        /// Byte offset on the device.
        offset: u64,
        /// Bytes to zero.
        len: u64,
    },
    /// `len` bytes at `offset` are no longer needed: the device may give their space back
    /// (a file punches a hole, a thin bdev unmaps), after which they read as anything.
    /// The engine issues it only where [`BlockDevice::discards`] says so, and only for
    /// host clusters nothing on the device refers to any more; a failure loses nothing.
    Discard {
        /// Byte offset on the device.
        offset: u64,
        /// Bytes to discard.
        len: u64,
    },
    /// Make every completed write stable.
    Flush,
}

impl<B> DeviceOp<B> {
    /// Short name for logs.
    pub fn name(&self) -> &'static str {
        match self {
            DeviceOp::Read { .. } => "read",
            DeviceOp::Write { .. } => "write",
            DeviceOp::WriteZeroes { .. } => "write_zeroes",
            DeviceOp::Discard { .. } => "discard",
            DeviceOp::Flush => "flush",
        }
    }
}

/// A device failure: the errno the device reported (EIO, ENOSPC, …).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceError(pub i32);

/// `submit` could not take the operation now (queue full / `-ENOMEM`); it is handed back and
/// the caller retries after polling.
#[derive(Debug)]
pub struct Busy<B>(pub DeviceOp<B>, pub u64);

/// A polled block device. `submit` never blocks; completions are reported by `poll`.
pub trait BlockDevice: 'static {
    /// The buffer type this device does I/O with (DMA-able memory on SPDK).
    type Buf: IoBuffer;
    /// Size in bytes.
    fn size(&self) -> u64;
    /// Allocates a zeroed, suitably aligned buffer for metadata or bounce I/O.
    fn alloc_buf(&mut self, len: usize) -> Self::Buf;
    /// Submits `op` tagged `tag`; returns at once. `Err(Busy)` hands the op back.
    fn submit(&mut self, op: DeviceOp<Self::Buf>, tag: u64) -> Result<(), Busy<Self::Buf>>;
    /// Reaps completed operations, calling `done(tag, result)` for each; returns how many.
    fn poll(&mut self, done: &mut dyn FnMut(u64, Result<(), DeviceError>)) -> usize;
    /// Whether the device completes only the operations submitted to it with
    /// [`submit`](Self::submit), each once, in [`poll`](Self::poll): the executor then
    /// polls it only while some are outstanding (a chain of a thousand images has a
    /// thousand devices). Default `false`: polled always.
    fn completes_only_submitted(&self) -> bool {
        false
    }
    /// How many operations submitted to this device completed outside
    /// [`poll`](Self::poll) since it was last asked: a host whose device hands completions
    /// to the executor from a callback (SPDK's) says so here, so that a device that
    /// [`completes_only_submitted`](Self::completes_only_submitted) stops being polled once
    /// nothing is outstanding. Asked only of such devices, on each poll that visits them.
    fn take_delivered(&mut self) -> u32 {
        0
    }
    /// Whether [`ensure_size`](Self::ensure_size) can make the device longer (a regular
    /// file, a memory device); a fixed-size device (a bdev, a block device) cannot. The
    /// allocator reserves data regions past the end only on a device that grows.
    fn can_grow(&self) -> bool {
        false
    }
    /// Whether [`DeviceOp::WriteZeroes`] costs less than writing zeros: the device zeroes
    /// without a data transfer (an NVMe namespace). Only then does the engine zero what a
    /// first write leaves of a new cluster with it (as QEMU does), and a full preallocation
    /// with it, rather than write zeros from a buffer. Every device takes the operation
    /// either way.
    fn zeroes_cheaply(&self) -> bool {
        false
    }
    /// Whether [`DeviceOp::Discard`] gives space back (a sparse file, a thin or an NVMe
    /// bdev that unmaps). Only then does the engine issue it, for the clusters the image
    /// frees; a device that says no is never sent one.
    fn discards(&self) -> bool {
        false
    }
    /// Whether a [`DeviceOp::Discard`] that completed leaves its range reading zeros, and
    /// stable like a write once a flush follows (a file's punched hole, which a
    /// `FALLOC_FL_PUNCH_HOLE` guarantees on every file system and block device that takes
    /// it). Then zeroing ahead of the allocator (`OpenOptions::zero_ahead`) punches rather
    /// than writes zeros: nothing is allocated for the zeros, and a first write into a new
    /// cluster fills one page of it, not all of it. Implies [`discards`](Self::discards).
    fn discard_zeroes(&self) -> bool {
        false
    }
    /// Whether a poll of this device could find nothing now that no one else will announce:
    /// each of its operations in flight completes through a callback that hands it to the
    /// executor or wakes the executor's host ([`Exec::needs_poll`](crate::exec::Exec::needs_poll)),
    /// and none waits for a poll. A host then stops polling while its requests wait only on
    /// such devices (SPDK's bdevs). Default `false`: polled while operations are outstanding.
    fn completions_announced(&self) -> bool {
        false
    }
    /// Whether the device has work of its own in flight that only its
    /// [`poll`](Self::poll) finishes (a fill of a shared cache other cores wait for), with
    /// no request of the executor waiting on it: the host keeps polling until it has none.
    fn has_own_work(&self) -> bool {
        false
    }
    /// Whether [`has_own_work`](Self::has_own_work) can ever be true for this device (asked
    /// once, when it is added: an executor whose devices cannot asks none of them).
    fn may_have_own_work(&self) -> bool {
        false
    }
    /// Makes the device at least `size` bytes long, reading zeros in the new part (a file
    /// grows sparsely). Fixed-size devices (bdevs, block devices) only check the size.
    /// Called when clusters are allocated past the end (rarely blocks: files grow ahead).
    fn ensure_size(&mut self, size: u64) -> Result<(), DeviceError> {
        if size <= self.size() {
            Ok(())
        } else {
            Err(DeviceError(28)) // ENOSPC
        }
    }
}

/// A plain heap buffer for hosts and tests that need no DMA memory: a shared `Vec<u8>`.
#[derive(Clone, Default)]
pub struct HeapBuf(pub std::rc::Rc<std::cell::RefCell<Vec<u8>>>);

impl HeapBuf {
    /// A zeroed buffer of `len` bytes.
    pub fn new(len: usize) -> Self {
        HeapBuf(std::rc::Rc::new(std::cell::RefCell::new(vec![0; len])))
    }
    /// A copy of the contents.
    pub fn to_vec(&self) -> Vec<u8> {
        self.0.borrow().clone()
    }
}

impl IoBuffer for HeapBuf {
    fn len(&self) -> usize {
        self.0.borrow().len()
    }
    fn copy_out(&self, off: usize, dst: &mut [u8]) {
        dst.copy_from_slice(&self.0.borrow()[off..off + dst.len()]);
    }
    fn copy_in(&self, off: usize, src: &[u8]) {
        self.0.borrow_mut()[off..off + src.len()].copy_from_slice(src);
    }
    fn fill(&self, off: usize, len: usize, byte: u8) {
        self.0.borrow_mut()[off..off + len].fill(byte);
    }
    fn with_bytes_mut(&self, off: usize, len: usize, f: &mut dyn FnMut(&mut [u8])) {
        f(&mut self.0.borrow_mut()[off..off + len])
    }
    fn decompress_to(
        &self,
        off: usize,
        len: usize,
        dec: &mut Decompressor,
        ct: CompressionType,
        out: &mut [u8],
    ) -> Option<Result<()>> {
        let b = self.0.try_borrow().ok()?;
        Some(dec.decompress(ct, b.get(off..off.checked_add(len)?)?, out))
    }
    fn decompress_into(
        &self,
        off: usize,
        len: usize,
        src: &Self,
        src_off: usize,
        src_len: usize,
        dec: &mut Decompressor,
        ct: CompressionType,
    ) -> Option<Result<()>> {
        if std::rc::Rc::ptr_eq(&self.0, &src.0) {
            return None;
        }
        let mut b = self.0.try_borrow_mut().ok()?;
        let out = b.get_mut(off..off.checked_add(len)?)?;
        src.decompress_to(src_off, src_len, dec, ct, out)
    }
}
