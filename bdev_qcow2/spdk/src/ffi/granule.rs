//! The shared read cache's granules in DMA memory: a hit is one `memcpy` out of the slot,
//! a fill one `memcpy` into it (the engine's default copies atomic words one by one).

use super::dma::DmaMem;
use qcow2_engine::golden::{Exclusive, GranuleMemory, Shared};

/// One slot's granule: DMA memory (`spdk_dma_zmalloc`, the heap if SPDK's is exhausted).
pub struct DmaGranule(DmaMem);

impl DmaGranule {
    /// A [`GranuleAlloc`](qcow2_engine::golden::GranuleAlloc): `len` zeroed bytes.
    pub fn alloc(len: usize) -> Box<dyn GranuleMemory> {
        Box::new(DmaGranule(DmaMem::new(len, 64)))
    }

    fn check(&self, off: usize, len: usize) {
        assert!(
            off.checked_add(len).is_some_and(|e| e <= self.0.len()),
            "granule range out of bounds"
        );
    }
}

// SAFETY: the region is process-wide memory owned by this value alone; `spdk_dma_free` (or
// the heap's `dealloc`) may run on any thread.
unsafe impl Send for DmaGranule {}
// SAFETY: shared access goes through `store` and `load` only, which the cache calls under
// its slot protocol: `store` with the one `Exclusive` of the slot (no reader pins it),
// `load` with a `Shared` (a pin taken after the publish, nobody writes it); the engine
// alone makes either proof, and its release/acquire pairs order every store before the
// loads of the same fill (`engine/src/golden/memory.rs`, model-checked by
// `engine/tests/loom_golden.rs`).
unsafe impl Sync for DmaGranule {}

impl GranuleMemory for DmaGranule {
    fn store(&self, _: &Exclusive, off: usize, src: &[u8]) {
        self.check(off, src.len());
        // SAFETY: in bounds (checked); the `Exclusive` proves nothing else reads or writes
        // the slot's bytes meanwhile; a Rust slice never overlaps this DMA region.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.0.as_ptr().add(off), src.len()) }
    }

    fn load(&self, _: &Shared, off: usize, dst: &mut [u8]) {
        self.check(off, dst.len());
        // SAFETY: in bounds (checked), initialised (zeroed at allocation, then stored); the
        // `Shared` proves nobody writes the bytes meanwhile and that their fill's stores
        // happened before; `dst` is a distinct Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(self.0.as_ptr().add(off), dst.as_mut_ptr(), dst.len())
        }
    }
}
