//! DMA-able memory (`spdk_dma_zmalloc`, the heap where SPDK's is exhausted): the regions
//! behind metadata, bounce buffers and the shared read cache's granules.

use super::sys;
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

/// Allocations that fell back to the heap, for the rate limit of their warning.
static HEAP_FALLBACKS: AtomicU64 = AtomicU64::new(0);

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
        // Once per power of two: a cache filling its slots while SPDK's memory is short
        // would otherwise warn once per slot (thousands).
        let n = HEAP_FALLBACKS.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_power_of_two() {
            tracing::warn!("spdk_dma_zmalloc({size}) failed; using heap memory ({n} times so far)");
        }
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

    /// Whether the region is SPDK's DMA memory (not the heap's fallback).
    pub fn is_dma(&self) -> bool {
        self.heap.is_none()
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
