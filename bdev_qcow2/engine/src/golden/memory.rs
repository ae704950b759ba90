//! Where a shared read cache keeps its granules' bytes: memory the host provides per slot
//! ([`GranuleMemory`]; SPDK: DMA memory, copied with one `memcpy`), or by default atomic
//! words on the heap ([`AtomicWords`]), which need no `unsafe` anywhere.
//!
//! The cache's slot protocol (see `cache.rs`) decides who may touch a slot's bytes and
//! hands out the proof: an [`Exclusive`] to the one filler that claimed the slot while no
//! reader pinned it, a [`Shared`] to readers that pinned it after its fill was published.
//! Only this module's parent can make either, so a host's memory may rely on them: while
//! an `Exclusive` for a slot lives, nothing else reads or writes that slot's bytes; while a
//! `Shared` lives, nothing writes them; and every store happens before every load of the
//! same fill (the publish's release, the pin's acquire). A host that reads a fill straight
//! into the slot's memory (its device writes it) gets the `Exclusive` lent with the slot
//! ([`LentGranule`](super::LentGranule)) and writes only while it holds it.

#[cfg(loom)]
use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU64, Ordering};

/// Proof that the holder is the one filler of a slot: no reader pins it.
#[derive(Debug)]
pub struct Exclusive(());

/// Proof that the holder pinned a published slot: nobody writes it.
#[derive(Debug)]
pub struct Shared(());

impl Exclusive {
    pub(super) fn new() -> Exclusive {
        Exclusive(())
    }
}

impl Shared {
    pub(super) fn new() -> Shared {
        Shared(())
    }
}

/// One slot's granule of bytes.
pub trait GranuleMemory: Send + Sync {
    /// Copies `src` into the granule at byte `off` (in bounds).
    fn store(&self, proof: &Exclusive, off: usize, src: &[u8]);
    /// Copies `dst.len()` bytes of the granule from byte `off` (in bounds) into `dst`.
    fn load(&self, proof: &Shared, off: usize, dst: &mut [u8]);
    /// The memory as the host's own type, for a host that reads fills straight into it
    /// ([`LentGranule`](super::LentGranule)); `None` (the default): fills are stored.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }
}

/// Makes the zeroed memory of one granule of `len` bytes (a slot's first fill calls it).
pub type GranuleAlloc = fn(len: usize) -> Box<dyn GranuleMemory>;

/// The default: the granule in atomic words (native byte order), copied word by word.
pub struct AtomicWords(Box<[AtomicU64]>);

impl AtomicWords {
    /// A [`GranuleAlloc`].
    pub fn alloc(len: usize) -> Box<dyn GranuleMemory> {
        Box::new(AtomicWords(
            (0..len.div_ceil(8)).map(|_| AtomicU64::new(0)).collect(),
        ))
    }
}

impl GranuleMemory for AtomicWords {
    fn store(&self, _: &Exclusive, off: usize, src: &[u8]) {
        debug_assert!(off.is_multiple_of(8) && src.len().is_multiple_of(8));
        for (w, chunk) in self.0[off / 8..].iter().zip(src.chunks_exact(8)) {
            let mut b = [0u8; 8];
            b.copy_from_slice(chunk);
            w.store(u64::from_ne_bytes(b), Ordering::Relaxed);
        }
    }

    fn load(&self, _: &Shared, off: usize, dst: &mut [u8]) {
        let words = &self.0;
        if off.is_multiple_of(8) && dst.len().is_multiple_of(8) {
            // Whole words (every sector-aligned read): a load and a store each.
            for (w, out) in words[off / 8..].iter().zip(dst.chunks_exact_mut(8)) {
                out.copy_from_slice(&w.load(Ordering::Relaxed).to_ne_bytes());
            }
            return;
        }
        let mut pos = off;
        let mut out = 0;
        while out < dst.len() {
            let w = words[pos / 8].load(Ordering::Relaxed).to_ne_bytes();
            let from = pos % 8;
            let n = (8 - from).min(dst.len() - out);
            dst[out..out + n].copy_from_slice(&w[from..from + n]);
            out += n;
            pos += n;
        }
    }
}
