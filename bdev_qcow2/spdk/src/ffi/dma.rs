//! DMA-able memory for metadata and bounce buffers.

use super::sys;
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ffi::c_void;
use std::ptr::NonNull;

/// A zeroed, aligned region from `spdk_dma_zmalloc` (pinned, translatable for every bdev),
/// or — only when SPDK's allocator is exhausted — from the heap, so that a failed
/// allocation fails I/O on devices that need DMA memory instead of aborting the process.
pub struct DmaMem {
    ptr: NonNull<u8>,
    len: usize,
    heap: Option<Layout>,
}

impl DmaMem {
    /// `len` zeroed bytes aligned to `align` (a power of two).
    pub fn new(len: usize, align: usize) -> DmaMem {
        let size = len.max(1);
        // SAFETY: plain allocation; a null return is handled below.
        let p = unsafe { sys::spdk_dma_zmalloc(size, align, std::ptr::null_mut()) };
        if let Some(ptr) = NonNull::new(p.cast::<u8>()) {
            return DmaMem {
                ptr,
                len,
                heap: None,
            };
        }
        tracing::warn!("spdk_dma_zmalloc({size}) failed; using heap memory");
        let Ok(layout) = Layout::from_size_align(size, align.max(1)) else {
            std::alloc::handle_alloc_error(Layout::new::<u8>());
        };
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        DmaMem {
            ptr,
            len,
            heap: Some(layout),
        }
    }

    /// Start of the region.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DmaMem {
    fn drop(&mut self) {
        match self.heap {
            // SAFETY: allocated by `alloc_zeroed(layout)` in `new`, freed once.
            Some(layout) => unsafe { dealloc(self.ptr.as_ptr(), layout) },
            // SAFETY: allocated by `spdk_dma_zmalloc` in `new`, freed once.
            None => unsafe { sys::spdk_dma_free(self.ptr.as_ptr().cast::<c_void>()) },
        }
    }
}
