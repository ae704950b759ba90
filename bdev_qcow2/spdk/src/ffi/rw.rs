//! A read or write of a base's blocks from iovecs, by the cheapest of SPDK's calls: one
//! buffer goes by `spdk_bdev_read_blocks`/`spdk_bdev_write_blocks`, which skip the vectored
//! calls' extended-options step (memory domains, accel sequences, metadata: none of which
//! our submissions carry); several by `spdk_bdev_readv_blocks`/`spdk_bdev_writev_blocks`.
//! Either way SPDK builds the same child bdev_io.

use super::sys;
use std::ffi::{c_int, c_void};

/// A base's read or write callback.
pub(super) type Done = unsafe extern "C" fn(*mut sys::spdk_bdev_io, bool, *mut c_void);

/// Where a block read or write goes: an open descriptor and this thread's channel of it.
pub(super) struct Blocks {
    pub desc: *mut sys::spdk_bdev_desc,
    pub ch: *mut sys::spdk_io_channel,
}

impl Blocks {
    /// Submits a read (or a write if `write`) of `num_blocks` blocks at `offset_blocks` with
    /// the `iovcnt` iovecs at `iovs`; SPDK's return code.
    ///
    /// # Safety
    /// `desc` is open and `ch` is this thread's channel of it; `iovs` points to `iovcnt` ≥ 1
    /// iovecs that hold the blocks' bytes and stay valid until `done` runs with `arg`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn submit(
        &self,
        write: bool,
        iovs: *mut sys::iovec,
        iovcnt: c_int,
        offset_blocks: u64,
        num_blocks: u64,
        done: Done,
        arg: *mut c_void,
    ) -> c_int {
        let (desc, ch, cb) = (self.desc, self.ch, Some(done));
        // (`write` is a constant where this is inlined: each call below is direct.)
        // SAFETY: the caller's contract; `iovs` holds at least one iovec.
        unsafe {
            if iovcnt == 1 {
                let one = if write {
                    sys::spdk_bdev_write_blocks
                } else {
                    sys::spdk_bdev_read_blocks
                };
                one(
                    desc,
                    ch,
                    (*iovs).iov_base,
                    offset_blocks,
                    num_blocks,
                    cb,
                    arg,
                )
            } else {
                let vectored = if write {
                    sys::spdk_bdev_writev_blocks
                } else {
                    sys::spdk_bdev_readv_blocks
                };
                vectored(desc, ch, iovs, iovcnt, offset_blocks, num_blocks, cb, arg)
            }
        }
    }
}
