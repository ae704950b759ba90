//! The shared read cache's granules in DMA memory: a hit is one `memcpy` out of the slot,
//! and a fill reads the golden bdev straight into the slot ([`GranuleBuf`]; the engine's
//! default copies atomic words one by one).

use super::dma_mem::DmaMem;
use qcow2_engine::golden::{Exclusive, GranuleMemory, LentGranule, Shared};
use std::any::Any;

/// Alignment of a granule: a bdev that needs no more reads into it in place.
const GRANULE_ALIGN: usize = 4096;

/// One slot's granule: DMA memory (`spdk_dma_zmalloc`, the heap if SPDK's is exhausted).
pub struct DmaGranule(DmaMem);

impl DmaGranule {
    /// A [`GranuleAlloc`](qcow2_engine::golden::GranuleAlloc): `len` zeroed bytes.
    pub fn alloc(len: usize) -> Box<dyn GranuleMemory> {
        Box::new(DmaGranule(DmaMem::new(len, GRANULE_ALIGN)))
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
// SAFETY: shared access goes through `store`, `load` and `GranuleBuf` only, which the cache
// and the engine's device call under its slot protocol: `store` and a `GranuleBuf` with
// the one `Exclusive` of the slot (no reader pins it), `load` with a `Shared` (a pin taken
// after the publish, nobody writes it); the engine alone makes either proof, and its
// release/acquire pairs order every store before the loads of the same fill
// (`engine/src/golden/memory.rs`, model-checked by `engine/tests/loom_golden.rs`).
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

    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}

/// A slot's DMA memory lent for a fill to read into in place: the [`LentGranule`] (with its
/// `Exclusive`) and where its bytes are. Held by an `SpdkBuf` while the bdev reads into it.
pub struct GranuleBuf {
    lent: LentGranule,
    ptr: *mut u8,
    len: usize,
}

impl GranuleBuf {
    /// A buffer over `lent`'s memory where it is DMA memory aligned to `align` (a bdev's
    /// buffer alignment); `Err` gives the loan back (heap memory, another alignment).
    pub fn new(lent: LentGranule, align: usize) -> Result<GranuleBuf, LentGranule> {
        let (mem, _) = lent.memory();
        let Some(g) = mem.as_any().and_then(|a| a.downcast_ref::<DmaGranule>()) else {
            return Err(lent);
        };
        let (ptr, len) = (g.0.as_ptr(), g.0.len());
        if !g.0.is_dma() || !(ptr as usize).is_multiple_of(align.max(1)) {
            return Err(lent);
        }
        Ok(GranuleBuf { lent, ptr, len })
    }

    /// The loan back: the bdev wrote its bytes, nothing holds this buffer any more.
    pub fn into_lent(self) -> LentGranule {
        self.lent
    }

    /// Start of the granule: written only while this value (with the loan's `Exclusive`)
    /// lives, which keeps the memory (its cache) alive.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the granule is empty (never).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
