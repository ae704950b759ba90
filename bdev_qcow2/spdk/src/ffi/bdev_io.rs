//! The bdev_io SPDK hands to our `submit_request`.

use super::sys;
use std::ptr::NonNull;

/// A bdev_io submitted to our bdev. A plain handle: ownership is a protocol — it is
/// completed exactly once, by [`BdevIo::complete`], after which no copy may be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BdevIo(NonNull<sys::spdk_bdev_io>);

impl BdevIo {
    /// Wraps a bdev_io from SPDK.
    ///
    /// # Safety
    /// `p` must be a bdev_io submitted to our bdev and not yet completed.
    pub unsafe fn from_raw(p: *mut sys::spdk_bdev_io) -> Option<BdevIo> {
        NonNull::new(p).map(BdevIo)
    }

    /// The handle as an engine request tag.
    pub fn tag(self) -> u64 {
        self.0.as_ptr() as u64
    }

    /// Back from a tag made by [`BdevIo::tag`].
    ///
    /// # Safety
    /// `tag` must come from `tag()` of a bdev_io that is not yet completed.
    pub unsafe fn from_tag(tag: u64) -> Option<BdevIo> {
        NonNull::new(tag as *mut sys::spdk_bdev_io).map(BdevIo)
    }

    /// The raw pointer.
    pub fn raw(self) -> *mut sys::spdk_bdev_io {
        self.0.as_ptr()
    }

    /// `SPDK_BDEV_IO_TYPE_*`.
    pub fn io_type(self) -> sys::spdk_bdev_io_type {
        // SAFETY: the bdev_io is live (type contract).
        sys::spdk_bdev_io_type::from(unsafe { (*self.0.as_ptr()).type_ })
    }

    /// First block.
    pub fn offset_blocks(self) -> u64 {
        // SAFETY: live bdev_io; for block I/O types `u.bdev` is the active union member.
        unsafe { (*self.0.as_ptr()).u.bdev.offset_blocks }
    }

    /// Number of blocks.
    pub fn num_blocks(self) -> u64 {
        // SAFETY: as in `offset_blocks`.
        unsafe { (*self.0.as_ptr()).u.bdev.num_blocks }
    }

    /// The data iovecs as SPDK holds them (pointer, count), for passing straight on.
    #[inline(always)]
    pub fn raw_iovs(self) -> (*mut sys::iovec, std::ffi::c_int) {
        // SAFETY: as in `offset_blocks`.
        unsafe {
            let b = &(*self.0.as_ptr()).u.bdev;
            (b.iovs, b.iovcnt)
        }
    }

    /// The data iovecs: pointer and count.
    pub fn iovs(self) -> (*mut sys::iovec, usize) {
        // SAFETY: as in `offset_blocks`.
        let (iovs, cnt) = unsafe {
            let b = &(*self.0.as_ptr()).u.bdev;
            (b.iovs, b.iovcnt)
        };
        (iovs, usize::try_from(cnt).unwrap_or(0))
    }

    /// Whether the bdev_io carries data buffers (reads may arrive without; see `get_buf`).
    pub fn has_buf(self) -> bool {
        let (iovs, cnt) = self.iovs();
        // SAFETY: `iovs` points at `cnt` iovecs when `cnt > 0`.
        cnt > 0 && !iovs.is_null() && !unsafe { (*iovs).iov_base }.is_null()
    }

    /// Asks SPDK to attach a data buffer of `len` bytes, then calls `cb`.
    pub fn get_buf(self, cb: sys::spdk_bdev_io_get_buf_cb, len: u64) {
        // SAFETY: live bdev_io of a block I/O type.
        unsafe { sys::spdk_bdev_io_get_buf(self.0.as_ptr(), cb, len) }
    }

    /// The SPDK thread the bdev_io was submitted on (where it must be completed).
    pub fn thread(self) -> *mut sys::spdk_thread {
        // SAFETY: live bdev_io.
        unsafe { sys::spdk_bdev_io_get_thread(self.0.as_ptr()) }
    }

    /// The channel of our bdev it was submitted on.
    pub fn io_channel(self) -> *mut sys::spdk_io_channel {
        // SAFETY: live bdev_io.
        unsafe { sys::spdk_bdev_io_get_io_channel(self.0.as_ptr()) }
    }

    /// The `ctxt` of the bdev it was submitted to (our node).
    pub fn bdev_ctxt(self) -> *mut std::ffi::c_void {
        // SAFETY: live bdev_io of a registered bdev.
        unsafe { (*(*self.0.as_ptr()).bdev).ctxt }
    }

    /// The module's per-I/O context area (`get_ctx_size` bytes, suitably aligned for `u64`).
    pub fn driver_ctx(self) -> *mut u8 {
        // SAFETY: live bdev_io; the area follows the struct.
        unsafe { (*self.0.as_ptr()).driver_ctx.as_mut_ptr() }
    }

    /// Completes the bdev_io with `status` (`SPDK_BDEV_IO_STATUS_*`). Consumes the handle.
    pub fn complete(self, status: sys::spdk_bdev_io_status) {
        // SAFETY: live bdev_io, completed exactly once (type contract).
        unsafe { sys::spdk_bdev_io_complete(self.0.as_ptr(), status) }
    }
}
