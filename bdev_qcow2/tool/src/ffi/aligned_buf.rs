//! A 4 KiB-aligned, zero-initialised heap buffer shared by handle, like a DMA buffer.

use qcow2_engine::compress::Decompressor;
use qcow2_engine::format::CompressionType;
use qcow2_engine::io::IoBuffer;
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::cell::Cell;
use std::ptr::NonNull;
use std::rc::Rc;

/// Memory alignment of every buffer (enough for O_DIRECT on 4 KiB-sector devices).
pub const BUF_ALIGN: usize = 4096;

struct AlignedMem {
    ptr: NonNull<u8>,
    layout: Layout,
    /// Whether a Rust slice of this memory is lent out (`with_bytes_mut`, the
    /// decompressions): any other access meanwhile would alias it, and panics instead.
    lent: Cell<bool>,
}

impl Drop for AlignedMem {
    fn drop(&mut self) {
        // SAFETY: `ptr` was returned by `alloc_zeroed(layout)` and is freed exactly once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Marks the memory lent for as long as it lives.
struct Lend<'a>(&'a Cell<bool>);

impl<'a> Lend<'a> {
    fn new(flag: &'a Cell<bool>) -> Self {
        assert!(!flag.replace(true), "buffer lent twice");
        Lend(flag)
    }
}

impl Drop for Lend<'_> {
    fn drop(&mut self) {
        self.0.set(false);
    }
}

/// A 4 KiB-aligned, zero-initialised heap buffer shared by handle (like a DMA buffer).
///
/// Clones share the memory. The engine never touches a range while a device operation on
/// it is in flight, and the ring ([`super::ring::Ring`]) holds a clone until the operation
/// completes, so the kernel never writes into freed memory.
#[derive(Clone)]
pub struct AlignedBuf {
    mem: Rc<AlignedMem>,
    len: usize,
}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes.
    pub fn new(len: usize) -> Self {
        let size = len.max(1).next_multiple_of(BUF_ALIGN);
        let Ok(layout) = Layout::from_size_align(size, BUF_ALIGN) else {
            panic!("buffer of {len} bytes is too large");
        };
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        AlignedBuf {
            mem: Rc::new(AlignedMem {
                ptr,
                layout,
                lent: Cell::new(false),
            }),
            len,
        }
    }

    /// The address of `len` bytes at `off` (panics if the range is out of bounds, or if a
    /// slice of the buffer is lent out).
    pub(crate) fn ptr(&self, off: usize, len: usize) -> *mut u8 {
        assert!(
            off.checked_add(len).is_some_and(|e| e <= self.len),
            "buffer range out of bounds"
        );
        assert!(!self.mem.lent.get(), "buffer accessed while lent");
        // SAFETY: `off + len <= self.len` was just checked, so the result stays inside the
        // allocation.
        unsafe { self.mem.ptr.as_ptr().add(off) }
    }

    /// Whether both handles share one allocation.
    pub(crate) fn same_memory(&self, other: &Self) -> bool {
        Rc::ptr_eq(&self.mem, &other.mem)
    }

    /// Whether `len` bytes at `off` are all zero (no device I/O may be in flight on them).
    pub fn is_zero(&self, off: usize, len: usize) -> bool {
        let p = self.ptr(off, len);
        // SAFETY: the range is in bounds (checked by `ptr`) and initialised (the allocation
        // is zeroed at creation); no I/O writes it meanwhile (the caller's contract), and the
        // slice does not outlive this call, which runs no other code.
        let s = unsafe { std::slice::from_raw_parts(p, len) };
        s.iter().all(|b| *b == 0)
    }

    /// A copy of `len` bytes at `off`.
    pub fn to_vec(&self, off: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.copy_out(off, &mut v);
        v
    }
}

impl IoBuffer for AlignedBuf {
    fn len(&self) -> usize {
        self.len
    }
    fn copy_out(&self, off: usize, dst: &mut [u8]) {
        let src = self.ptr(off, dst.len());
        // SAFETY: the range is in bounds (checked by `ptr`); `dst` is a Rust slice, which
        // cannot be a lent view of this memory (`ptr` refuses while one is lent), so the
        // regions do not overlap; no device I/O is in flight on this range.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) }
    }
    fn copy_in(&self, off: usize, src: &[u8]) {
        let dst = self.ptr(off, src.len());
        // SAFETY: as in `copy_out`, with the roles swapped.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
    }
    fn copy_to(&self, off: usize, dst: &Self, dst_off: usize, len: usize) {
        let (src, to) = (self.ptr(off, len), dst.ptr(dst_off, len));
        // SAFETY: both ranges are in bounds (checked by `ptr`); `copy` allows them to
        // overlap (the same buffer); no device I/O is in flight on either range.
        unsafe { std::ptr::copy(src, to, len) }
    }
    fn fill(&self, off: usize, len: usize, byte: u8) {
        let dst = self.ptr(off, len);
        // SAFETY: the range is in bounds (checked by `ptr`), and no slice of it is lent.
        unsafe { std::ptr::write_bytes(dst, byte, len) }
    }
    fn with_bytes_mut(&self, off: usize, len: usize, f: &mut dyn FnMut(&mut [u8])) {
        let p = self.ptr(off, len);
        let _lend = Lend::new(&self.mem.lent);
        // SAFETY: in bounds (checked by `ptr`) and initialised (zeroed at allocation); no
        // device I/O is in flight on it (the engine transforms a read's bytes after it
        // completed, a write's before it is submitted); while `_lend` lives every other
        // access to this memory panics, so the slice is its only view until `f` returns.
        let bytes = unsafe { std::slice::from_raw_parts_mut(p, len) };
        f(bytes)
    }
    fn decompress_to(
        &self,
        off: usize,
        len: usize,
        dec: &mut Decompressor,
        ct: CompressionType,
        out: &mut [u8],
    ) -> Option<qcow2_engine::Result<()>> {
        let p = self.ptr(off, len);
        let _lend = Lend::new(&self.mem.lent);
        // SAFETY: in bounds (checked by `ptr`) and initialised (zeroed at allocation); no
        // device I/O is in flight on it, and while `_lend` lives nothing else reaches it;
        // `out` is a Rust slice, not a view of this memory (none can be lent meanwhile).
        let input = unsafe { std::slice::from_raw_parts(p, len) };
        Some(dec.decompress(ct, input, out))
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
    ) -> Option<qcow2_engine::Result<()>> {
        let overlap = self.same_memory(src) && off < src_off + src_len && src_off < off + len;
        if overlap {
            return None;
        }
        let (p, q) = (self.ptr(off, len), src.ptr(src_off, src_len));
        let _lend = Lend::new(&self.mem.lent);
        let _lend_src = (!self.same_memory(src)).then(|| Lend::new(&src.mem.lent));
        // SAFETY: both ranges are in bounds (checked by `ptr`) and do not overlap (just
        // checked); no device I/O is in flight on either; while the lends live nothing
        // else reaches either buffer.
        let (out, input) = unsafe {
            (
                std::slice::from_raw_parts_mut(p, len),
                std::slice::from_raw_parts(q, src_len),
            )
        };
        Some(dec.decompress(ct, input, out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use qcow2_engine::compress::compress;

    #[test]
    fn clusters_decompress_straight_between_buffers_and_never_onto_themselves() {
        let cluster: Vec<u8> = (0..65536u32)
            .map(|i| (i % 251) as u8 ^ (i >> 12) as u8)
            .collect();
        for ct in [CompressionType::Zlib, CompressionType::Zstd] {
            let z = compress(ct, &cluster).expect("compressible");
            let rec = AlignedBuf::new(z.len() + 4096);
            rec.copy_in(100, &z);
            let slot = AlignedBuf::new(3 * 65536);
            let mut dec = Decompressor::default();
            let r = slot.decompress_into(65536, 65536, &rec, 100, z.len(), &mut dec, ct);
            assert!(matches!(r, Some(Ok(()))), "{ct:?}");
            assert_eq!(slot.to_vec(65536, 65536), cluster);
            assert!(slot.is_zero(0, 65536) && slot.is_zero(2 * 65536, 65536));
            let mut out = vec![0; 65536];
            let r = rec.decompress_to(100, z.len(), &mut dec, ct, &mut out);
            assert!(matches!(r, Some(Ok(()))));
            assert_eq!(out, cluster);
            // Within one buffer: apart, straight; overlapping, refused.
            slot.copy_in(0, &z);
            let r = slot.decompress_into(65536, 65536, &slot, 0, z.len(), &mut dec, ct);
            assert!(matches!(r, Some(Ok(()))));
            assert!(slot
                .decompress_into(0, 65536, &slot, 0, z.len(), &mut dec, ct)
                .is_none());
            // Garbage is an error, not a panic.
            let r = slot.decompress_into(65536, 65536, &rec, 0, 64, &mut dec, ct);
            assert!(matches!(r, Some(Err(_))));
        }
    }

    /// A lent slice is the only view of the buffer: a clone reaching it panics.
    #[test]
    #[should_panic(expected = "buffer accessed while lent")]
    fn a_lent_slice_is_never_aliased() {
        let buf = AlignedBuf::new(4096);
        let clone = buf.clone();
        buf.with_bytes_mut(0, 512, &mut |b| {
            b[0] = 1;
            let _ = clone.to_vec(0, 1);
        });
    }
}
