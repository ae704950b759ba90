//! DMA-able memory for metadata and bounce buffers, and the buffers the engine does I/O
//! with ([`SpdkBuf`]).

pub use super::dma_mem::DmaMem;
use super::granule::GranuleBuf;
use super::iov::{IovRef, IovView};
use super::sys;
use qcow2_engine::compress::Decompressor;
use qcow2_engine::format::CompressionType;
use qcow2_engine::io::{IoBuffer, LentBuf};
use std::ffi::c_void;
use std::rc::Rc;

/// A buffer the engine can read into: DMA memory (metadata, bounce buffers) or the
/// iovecs of a guest bdev_io (the hot path reads straight into them).
#[derive(Clone)]
pub enum SpdkBuf {
    /// Memory from `spdk_dma_zmalloc`, shared by handle.
    Dma(Rc<DmaMem>),
    /// A guest request's own iovecs.
    Iov(IovView),
    /// A shared read cache slot's memory, lent to a fill that reads into it in place.
    Granule(Rc<GranuleBuf>),
}

impl SpdkBuf {
    /// Calls `f(ptr, len, pos)` for each contiguous piece of `len` bytes at `off`, where `pos`
    /// is the piece's offset from `off`. Panics if the range is out of bounds (the engine
    /// never asks for that).
    fn segments(&self, off: usize, len: usize, mut f: impl FnMut(*mut u8, usize, usize)) {
        assert!(
            off.checked_add(len).is_some_and(|e| e <= self.len()),
            "buffer range out of bounds"
        );
        if len == 0 {
            return;
        }
        match self {
            SpdkBuf::Dma(m) => {
                // SAFETY: in bounds (asserted above).
                f(unsafe { m.as_ptr().add(off) }, len, 0)
            }
            SpdkBuf::Iov(v) => v.segments(off, len, f),
            SpdkBuf::Granule(g) => {
                // SAFETY: in bounds (asserted above).
                f(unsafe { g.as_ptr().add(off) }, len, 0)
            }
        }
    }

    /// The address of `len` bytes at `off` (non-empty) where they are one piece of DMA
    /// memory (`None`: a guest's iovecs, or out of bounds).
    fn piece(&self, off: usize, len: usize) -> Option<(*mut u8, usize)> {
        match self {
            SpdkBuf::Dma(m) if len > 0 && off.checked_add(len)? <= m.len() => {
                // SAFETY: in bounds (just checked).
                Some((unsafe { m.as_ptr().add(off) }, len))
            }
            _ => None,
        }
    }

    /// Appends iovecs describing `len` bytes at `off` to `out` (no allocation while `out`
    /// has capacity).
    pub fn append_iovs(&self, off: usize, len: usize, out: &mut Vec<sys::iovec>) {
        self.segments(off, len, |p, n, _| {
            out.push(sys::iovec {
                iov_base: p.cast::<c_void>(),
                iov_len: n,
            })
        });
    }
}

impl IoBuffer for SpdkBuf {
    fn len(&self) -> usize {
        match self {
            SpdkBuf::Dma(m) => m.len(),
            SpdkBuf::Iov(v) => v.len(),
            SpdkBuf::Granule(g) => g.len(),
        }
    }
    fn copy_out(&self, off: usize, dst: &mut [u8]) {
        self.segments(off, dst.len(), |p, n, pos| {
            // SAFETY: `p..p+n` is inside the buffer (segments); `dst[pos..pos+n]` is in
            // bounds; a Rust slice never overlaps device memory; no I/O is in flight on it.
            unsafe { std::ptr::copy_nonoverlapping(p, dst.as_mut_ptr().add(pos), n) }
        });
    }
    fn copy_in(&self, off: usize, src: &[u8]) {
        self.segments(off, src.len(), |p, n, pos| {
            // SAFETY: as in `copy_out`, with the roles swapped.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().add(pos), p, n) }
        });
    }
    fn copy_to(&self, off: usize, dst: &Self, dst_off: usize, len: usize) {
        self.segments(off, len, |p, n, pos| {
            dst.segments(dst_off + pos, n, |q, m, at| {
                // SAFETY: both pieces are inside their buffers (segments); `copy` allows
                // overlap; no I/O is in flight on either range.
                unsafe { std::ptr::copy(p.add(at), q, m) }
            })
        });
    }
    fn with_bytes_mut(&self, off: usize, len: usize, f: &mut dyn FnMut(&mut [u8])) {
        bytes_mut(&|o, n, g| self.segments(off + o, n, g), len, f)
    }
    fn fill(&self, off: usize, len: usize, byte: u8) {
        self.segments(off, len, |p, n, _| {
            // SAFETY: `p..p+n` is inside the buffer (segments).
            unsafe { std::ptr::write_bytes(p, byte, n) }
        });
    }
    fn decompress_to(
        &self,
        off: usize,
        len: usize,
        dec: &mut Decompressor,
        ct: CompressionType,
        out: &mut [u8],
    ) -> Option<qcow2_engine::Result<()>> {
        let (p, n) = self.piece(off, len)?;
        // SAFETY: one piece inside DMA memory (`piece`), initialised (zeroed at allocation);
        // no I/O is in flight on it (the engine's contract for every copy), and for the
        // call only the decompressor, which reaches no buffer, reads it; `out` is a
        // distinct Rust slice.
        let input = unsafe { std::slice::from_raw_parts(p, n) };
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
        let (p, n) = self.piece(off, len)?;
        let (q, m) = src.piece(src_off, src_len)?;
        if (p as usize) < q as usize + m && (q as usize) < p as usize + n {
            return None;
        }
        // SAFETY: both pieces lie inside DMA memory (`piece`) and do not overlap (just
        // checked); no I/O is in flight on either; for the call only the decompressor,
        // which reaches no buffer, touches them, so the mutable slice is the only access.
        let (out, input) = unsafe {
            (
                std::slice::from_raw_parts_mut(p, n),
                std::slice::from_raw_parts(q, m),
            )
        };
        Some(dec.decompress(ct, input, out))
    }
}

/// What lists the pieces of a buffer's range: `segments(off, len, piece)` calls
/// `piece(ptr, n, pos)` for each.
type Segments<'a> = &'a dyn Fn(usize, usize, &mut dyn FnMut(*mut u8, usize, usize));

/// Runs `f` on the `len` bytes whose pieces `segments` lists, changed in place: lent as
/// they are when they are one piece, else through a copy.
fn bytes_mut(segments: Segments<'_>, len: usize, f: &mut dyn FnMut(&mut [u8])) {
    let (mut pieces, mut one) = (0, None);
    segments(0, len, &mut |p, n, _| {
        pieces += 1;
        one = Some((p, n));
    });
    match one {
        Some((p, n)) if pieces == 1 => {
            // SAFETY: one piece of `n` bytes inside the buffer's memory (segments),
            // initialised; no I/O is in flight on it, and `f` reaches no buffer (the
            // engine's contract), so for the call the slice is the only access to it.
            f(unsafe { std::slice::from_raw_parts_mut(p, n) })
        }
        // Across iovecs: through a copy.
        _ => {
            let mut tmp = vec![0u8; len];
            segments(0, len, &mut |p, n, pos| {
                // SAFETY: `p..p+n` is inside the buffer (segments), `tmp[pos..pos+n]` in
                // bounds; a Rust vector never overlaps the buffer.
                unsafe { std::ptr::copy_nonoverlapping(p, tmp.as_mut_ptr().add(pos), n) }
            });
            f(&mut tmp);
            segments(0, len, &mut |p, n, pos| {
                // SAFETY: as above, the other way.
                unsafe { std::ptr::copy_nonoverlapping(tmp.as_ptr().add(pos), p, n) }
            });
        }
    }
}

/// A request's iovecs lent to the engine for one call.
impl LentBuf<SpdkBuf> for IovRef<'_> {
    fn len(&self) -> usize {
        IovRef::len(self)
    }
    fn copy_from(&self, off: usize, src: &SpdkBuf, src_off: usize, n: usize) {
        src.segments(src_off, n, |p, m, pos| {
            self.segments(off + pos, m, |q, k, at| {
                // SAFETY: both pieces are inside their buffers (segments); the guest's
                // buffer is not the engine's, and `copy` allows overlap anyway.
                unsafe { std::ptr::copy(p.add(at), q, k) }
            })
        });
    }
    fn with_bytes_mut(&self, f: &mut dyn FnMut(&mut [u8])) {
        bytes_mut(&|o, n, g| self.segments(o, n, g), IovRef::len(self), f)
    }
}
