//! A guest request's data iovecs as the engine uses them, in the two ways it may: lent for
//! one call ([`IovRef`], a borrow of the request: the plan's copy of a read the prefetch
//! ring serves, a direct read's decryption), or held by a task the request was handed to
//! ([`IovView`], under a [`Lease`] that ends when the host takes the request back, after
//! which any use of the view panics instead of reaching memory the request gave back).

use super::sys;
use std::cell::Cell;
use std::marker::PhantomData;
use std::rc::Rc;

/// A request's iovec array: where it is, how many, and the bytes they cover.
#[derive(Clone, Copy, Debug)]
pub(super) struct Iovecs {
    pub(super) iovs: *const sys::iovec,
    pub(super) cnt: usize,
    pub(super) len: usize,
}

impl Iovecs {
    /// Calls `f(ptr, len, pos)` for each contiguous piece of `len` bytes at `off`, where
    /// `pos` is the piece's offset from `off`. Panics if the range is out of bounds or the
    /// iovecs are shorter than they say (never, for a bdev_io SPDK checked).
    ///
    /// # Safety
    /// The array and the memory it describes are valid (the request is outstanding).
    unsafe fn segments(&self, off: usize, len: usize, mut f: impl FnMut(*mut u8, usize, usize)) {
        assert!(
            off.checked_add(len).is_some_and(|e| e <= self.len),
            "buffer range out of bounds"
        );
        let mut skip = off;
        let mut pos = 0;
        for i in 0..self.cnt {
            if pos == len {
                return;
            }
            // SAFETY: `i < cnt`; the array is valid (the caller's contract).
            let v = unsafe { &*self.iovs.add(i) };
            let (base, ilen) = (v.iov_base.cast::<u8>(), v.iov_len);
            if skip >= ilen {
                skip -= ilen;
                continue;
            }
            let n = (ilen - skip).min(len - pos);
            // SAFETY: `skip < ilen`, so the pointer stays inside this iovec.
            f(unsafe { base.add(skip) }, n, pos);
            pos += n;
            skip = 0;
        }
        assert!(pos == len, "iovecs shorter than the request");
    }
}

/// A request's iovecs lent for as long as the borrow of its handle (`'a`): neither `Copy`
/// nor `Clone`, and unusable once the handle may complete the request.
#[derive(Debug)]
pub struct IovRef<'a> {
    iovs: Iovecs,
    _io: PhantomData<&'a ()>,
}

impl IovRef<'_> {
    /// # Safety
    /// `iovs` is the array of a request outstanding for `'a` (its handle's borrow).
    pub(super) unsafe fn new<'a>(iovs: Iovecs) -> IovRef<'a> {
        IovRef {
            iovs,
            _io: PhantomData,
        }
    }

    /// Bytes covered.
    pub fn len(&self) -> usize {
        self.iovs.len
    }

    /// Whether it covers nothing.
    pub fn is_empty(&self) -> bool {
        self.iovs.len == 0
    }

    /// As [`IovView::segments`].
    pub fn segments(&self, off: usize, len: usize, f: impl FnMut(*mut u8, usize, usize)) {
        // SAFETY: the request is outstanding while the borrow lasts (`new`).
        unsafe { self.iovs.segments(off, len, f) }
    }
}

/// How long a handed request's views may be used: while its slot's count has not moved
/// since the view was made ([`EngineTags`](super::bdev_io::EngineTags) moves it when it
/// gives the request back).
#[derive(Clone, Debug)]
pub(super) struct Lease {
    slot: Rc<Cell<u32>>,
    at: u32,
}

impl Lease {
    /// A lease on `slot` as its count is now.
    pub(super) fn on(slot: &Rc<Cell<u32>>) -> Lease {
        Lease {
            slot: slot.clone(),
            at: slot.get(),
        }
    }

    /// Ends every lease on `slot` made before.
    pub(super) fn end_all(slot: &Cell<u32>) {
        slot.set(slot.get().wrapping_add(1));
    }

    fn live(&self) -> bool {
        self.slot.get() == self.at
    }
}

/// The data iovecs of a request handed to the engine, which its tasks keep and clone:
/// usable until the host takes the request back ([`Lease`]); a use past that panics.
#[derive(Clone, Debug)]
pub struct IovView {
    iovs: Iovecs,
    lease: Lease,
}

impl IovView {
    /// # Safety
    /// `iovs` is the array of a request outstanding until `lease` ends.
    pub(super) unsafe fn new(iovs: Iovecs, lease: Lease) -> IovView {
        IovView { iovs, lease }
    }

    /// Bytes covered.
    pub fn len(&self) -> usize {
        self.iovs.len
    }

    /// Whether it covers nothing.
    pub fn is_empty(&self) -> bool {
        self.iovs.len == 0
    }

    /// Calls `f(ptr, len, pos)` for each contiguous piece of `len` bytes at `off`, where
    /// `pos` is the piece's offset from `off`. Panics if the range is out of bounds, or
    /// once the request was taken back.
    pub fn segments(&self, off: usize, len: usize, f: impl FnMut(*mut u8, usize, usize)) {
        assert!(
            self.lease.live(),
            "a guest request's buffer used after the engine gave the request back"
        );
        // SAFETY: the request is outstanding while its lease is live (`new`).
        unsafe { self.iovs.segments(off, len, f) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two pieces of 3 and 5 bytes, and the iovecs over them.
    fn pieces() -> (Vec<u8>, Vec<u8>, Vec<sys::iovec>) {
        let (mut a, mut b) = (vec![1u8, 2, 3], vec![4u8, 5, 6, 7, 8]);
        let iovs = vec![
            sys::iovec {
                iov_base: a.as_mut_ptr().cast(),
                iov_len: a.len(),
            },
            sys::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            },
        ];
        (a, b, iovs)
    }

    fn iovecs(iovs: &[sys::iovec]) -> Iovecs {
        Iovecs {
            iovs: iovs.as_ptr(),
            cnt: iovs.len(),
            len: iovs.iter().map(|v| v.iov_len).sum(),
        }
    }

    /// The bytes `segments(off, len)` lists, in order.
    fn bytes(seg: impl Fn(&mut dyn FnMut(*mut u8, usize, usize))) -> Vec<u8> {
        let mut out = Vec::new();
        seg(&mut |p, n, _| {
            // SAFETY: a piece of the test's own vectors, alive for the test.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(p, n) })
        });
        out
    }

    #[test]
    fn a_view_reads_across_iovecs_while_its_lease_lives() {
        let (_a, _b, iovs) = pieces();
        let slot = Rc::new(Cell::new(7));
        // SAFETY: the vectors outlive the view.
        let v = unsafe { IovView::new(iovecs(&iovs), Lease::on(&slot)) };
        assert_eq!(v.len(), 8);
        assert_eq!(bytes(|f| v.segments(2, 4, f)), [3, 4, 5, 6]);
        let clone = v.clone();
        assert_eq!(bytes(|f| clone.segments(0, 8, f)), [1, 2, 3, 4, 5, 6, 7, 8]);
    }

    #[test]
    #[should_panic(expected = "after the engine gave the request back")]
    fn a_view_used_after_its_request_was_taken_back_panics() {
        let (_a, _b, iovs) = pieces();
        let slot = Rc::new(Cell::new(0));
        // SAFETY: the vectors outlive the view.
        let v = unsafe { IovView::new(iovecs(&iovs), Lease::on(&slot)) };
        let kept = v.clone();
        Lease::end_all(&slot);
        // A lease made now is live again (the slot's next request).
        // SAFETY: as above.
        let next = unsafe { IovView::new(iovecs(&iovs), Lease::on(&slot)) };
        assert_eq!(bytes(|f| next.segments(0, 1, f)), [1]);
        kept.segments(0, 1, |_, _, _| {});
    }

    #[test]
    fn a_lent_view_is_changed_in_place_across_iovecs() {
        let (a, b, iovs) = pieces();
        // SAFETY: the vectors outlive the borrow.
        let r = unsafe { IovRef::new(iovecs(&iovs)) };
        assert_eq!(bytes(|f| r.segments(1, 3, f)), [2, 3, 4]);
        qcow2_engine::io::LentBuf::with_bytes_mut(&r, &mut |s| {
            assert_eq!(s.len(), 8);
            s.iter_mut().for_each(|x| *x *= 10)
        });
        assert_eq!((a, b), (vec![10, 20, 30], vec![40, 50, 60, 70, 80]));
    }
}
