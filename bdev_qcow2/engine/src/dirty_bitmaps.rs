//! The persistent bitmaps an image open for writing keeps in memory ([`DirtyBitmaps`]):
//! every core marks what its guest writes change; the owner loads them at open and stores
//! them at close (`image::owner::bitmaps`).
//!
//! Invariant: a write marks its granules before it is submitted, so every write that
//! completed before the owner stores the bitmaps is in what it stores.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// One bitmap's bits: bit `i` of word `i / 64` stands for granule `i`.
pub(crate) struct Bits {
    granularity_bits: u32,
    words: Box<[AtomicU64]>,
    /// Whether it records guest writes (the `auto` flag).
    enabled: bool,
    /// Whether a bit was set since it was loaded.
    changed: AtomicBool,
}

impl Bits {
    /// A bitmap of `granularity_bits`, `data` its bytes as stored (bit `i` is bit `i % 8`
    /// of byte `i / 8`), `len` bytes long in memory (at least `data`'s length).
    pub(crate) fn new(granularity_bits: u8, data: &[u8], len: usize, enabled: bool) -> Self {
        let mut words: Vec<AtomicU64> = (0..len.div_ceil(8)).map(|_| AtomicU64::new(0)).collect();
        for (w, chunk) in words.iter_mut().zip(data.chunks(8)) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            *w.get_mut() = u64::from_le_bytes(b);
        }
        Bits {
            granularity_bits: u32::from(granularity_bits),
            words: words.into_boxed_slice(),
            enabled,
            changed: AtomicBool::new(false),
        }
    }

    /// Granules the bits can stand for.
    fn granules(&self) -> u64 {
        self.words.len() as u64 * 64
    }

    /// Sets the bits of the granules `[offset, offset + len)` touches (`len` > 0).
    #[inline]
    fn mark(&self, offset: u64, len: u64) {
        let first = offset >> self.granularity_bits;
        let last = ((offset + len - 1) >> self.granularity_bits).min(self.granules() - 1);
        let mut g = first;
        while g <= last {
            let w = (g / 64) as usize;
            let lo = g % 64;
            let hi = (last - (g - lo)).min(63);
            let mask = (u64::MAX >> (63 - hi)) & (u64::MAX << lo);
            // Most writes find their bits set already: a load, and no write to the line
            // the other cores read.
            if self.words[w].load(Ordering::Relaxed) & mask != mask {
                self.words[w].fetch_or(mask, Ordering::Relaxed);
                self.changed.store(true, Ordering::Relaxed);
            }
            g += hi - lo + 1;
        }
    }

    /// Clears the bits of the granules wholly or partly past `size` bytes (a disk that
    /// shrank: the bits past it must be zero, and stay so if it grows back).
    pub(crate) fn clear_from(&self, size: u64) {
        let first = size.div_ceil(1u64 << self.granularity_bits);
        for (i, w) in self.words.iter().enumerate() {
            let base = i as u64 * 64;
            if base + 64 <= first {
                continue;
            }
            let keep = first.saturating_sub(base);
            let mask = if keep == 0 {
                0
            } else {
                u64::MAX >> (64 - keep)
            };
            if w.load(Ordering::Relaxed) & !mask != 0 {
                w.fetch_and(mask, Ordering::Relaxed);
                self.changed.store(true, Ordering::Relaxed);
            }
        }
    }

    /// Whether a bit was set (or cleared) since the bitmap was loaded.
    pub(crate) fn changed(&self) -> bool {
        self.changed.load(Ordering::Relaxed)
    }

    /// The first `len` bytes of the bitmap's data as stored.
    pub(crate) fn data(&self, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len.div_ceil(8) * 8);
        for w in self.words.iter().take(len.div_ceil(8)) {
            out.extend_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
        }
        out.resize(len, 0);
        out
    }
}

/// The persistent bitmaps of an image open for writing, in the order of its directory
/// (those the owner loaded: see `image::owner::bitmaps`). Shared by every core's chain.
pub struct DirtyBitmaps {
    maps: Box<[Bits]>,
}

impl std::fmt::Debug for DirtyBitmaps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirtyBitmaps")
            .field("bitmaps", &self.maps.len())
            .finish()
    }
}

impl DirtyBitmaps {
    pub(crate) fn new(maps: Vec<Bits>) -> Self {
        DirtyBitmaps {
            maps: maps.into_boxed_slice(),
        }
    }

    /// A guest write, write-zeroes or discard of `len` bytes at `offset` is about to
    /// change the disk: every enabled bitmap records it.
    #[inline]
    pub fn mark(&self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        for b in self.maps.iter().filter(|b| b.enabled) {
            b.mark(offset, len);
        }
    }

    pub(crate) fn get(&self, i: usize) -> &Bits {
        &self.maps[i]
    }

    /// The bitmaps' bits past `size` bytes are cleared (the disk shrank).
    pub(crate) fn clear_from(&self, size: u64) {
        for b in self.maps.iter() {
            b.clear_from(size);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_set_every_granule_a_range_touches_and_nothing_else() {
        // 64 KiB granules, 3 words.
        let b = Bits::new(16, &[0b1000_0001], 24, true);
        assert!(!b.changed());
        b.mark(0, 1);
        assert!(!b.changed(), "granule 0 was set already");
        b.mark((1 << 16) - 1, 2); // granules 0 and 1
        b.mark(70 << 16, (60 << 16) + 1); // granules 70..=130
        b.mark(191 << 16, 1 << 30); // granule 191 on, clipped at the end
        let d = b.data(24);
        assert!(b.changed());
        let bit = |i: usize| d[i / 8] >> (i % 8) & 1 == 1;
        let set: Vec<usize> = (0..192).filter(|&i| bit(i)).collect();
        let want: Vec<usize> = [0, 1, 7]
            .into_iter()
            .chain(70..=130)
            .chain(std::iter::once(191))
            .collect();
        assert_eq!(set, want);
        assert_eq!(b.data(3), d[..3].to_vec());
        b.clear_from((100 << 16) + 1); // granule 100 stays: the disk still ends inside it
        let d = b.data(24);
        let set: Vec<usize> = (0..192).filter(|&i| d[i / 8] >> (i % 8) & 1 == 1).collect();
        let want: Vec<usize> = [0, 1, 7].into_iter().chain(70..=100).collect();
        assert_eq!(set, want);
    }

    #[test]
    fn only_enabled_bitmaps_record_writes() {
        let m = DirtyBitmaps::new(vec![
            Bits::new(9, &[], 8, false),
            Bits::new(12, &[], 8, true),
        ]);
        m.mark(4096, 512);
        m.mark(0, 0);
        assert_eq!(m.get(0).data(8), vec![0; 8]);
        assert_eq!(m.get(1).data(8), vec![2, 0, 0, 0, 0, 0, 0, 0]);
        assert!(m.get(1).changed() && !m.get(0).changed());
    }
}
