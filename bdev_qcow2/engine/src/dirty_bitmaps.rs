//! The persistent bitmaps an image open for writing keeps in memory ([`DirtyBitmaps`]):
//! every core marks what its guest writes change; the owner loads them at open and stores
//! them at close (`image::owner::bitmaps`).
//!
//! Invariant: a write marks its granules before it is submitted, so every write that
//! completed before the owner stores the bitmaps is in what it stores.

use crate::format::bitmaps::MAX_PHYS_SIZE;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

/// log2 of the granules a segment of bits holds (128 KiB of words).
const SEG_BITS: u32 = 20;
/// Words per segment.
const SEG_WORDS: usize = 1 << (SEG_BITS - 6);
/// Segments of the largest bitmap QEMU holds ([`MAX_PHYS_SIZE`] bytes of data).
const MAX_SEGS: usize = ((MAX_PHYS_SIZE * 8) >> SEG_BITS) as usize;

/// Memory one bitmap of `granules` takes: its segments and their index.
pub(crate) fn memory_for(granules: u64) -> u64 {
    let segs = granules.div_ceil(1 << SEG_BITS);
    segs * (SEG_WORDS as u64 * 8)
        + MAX_SEGS as u64 * std::mem::size_of::<OnceLock<Box<[AtomicU64]>>>() as u64
}

/// One bitmap's bits: bit `i % 64` of word `i / 64` stands for granule `i`. The words are
/// in segments, allocated by the owner for the granules the disk has before any core may
/// write there ([`cover`](Self::cover)), so that a disk that grows keeps its bits where
/// they are while cores mark them.
pub(crate) struct Bits {
    granularity_bits: u32,
    segs: Box<[OnceLock<Box<[AtomicU64]>>]>,
    /// Whether it records guest writes (the `auto` flag).
    enabled: AtomicBool,
    /// Whether a bit changed since the bitmap was loaded or last stored.
    changed: AtomicBool,
    /// Whether the bitmap was removed (its slot stays, unused).
    retired: AtomicBool,
}

impl Bits {
    /// A bitmap of `granularity_bits` covering `granules`, whose bits are `data` as stored
    /// (bit `i` is bit `i % 8` of byte `i / 8`; words past `granules` are dropped, and a
    /// store clears the bits past the disk's end).
    pub(crate) fn new(granularity_bits: u8, data: &[u8], granules: u64, enabled: bool) -> Self {
        let b = Bits {
            granularity_bits: u32::from(granularity_bits),
            segs: (0..MAX_SEGS).map(|_| OnceLock::new()).collect(),
            enabled: AtomicBool::new(enabled),
            changed: AtomicBool::new(false),
            retired: AtomicBool::new(false),
        };
        b.cover(granules);
        for (i, chunk) in data
            .chunks(8)
            .take(granules.div_ceil(64) as usize)
            .enumerate()
        {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            if let Some(a) = b.word(i) {
                a.store(u64::from_le_bytes(w), Ordering::Relaxed);
            }
        }
        b
    }

    /// Allocates the words of the first `granules` (those past what QEMU holds never
    /// are).
    fn cover(&self, granules: u64) {
        let segs = granules.div_ceil(1 << SEG_BITS) as usize;
        for s in self.segs.iter().take(segs) {
            s.get_or_init(|| (0..SEG_WORDS).map(|_| AtomicU64::new(0)).collect());
        }
    }

    /// Bytes of the disk the bits can ever stand for.
    fn max_coverage(&self) -> u128 {
        u128::from(MAX_PHYS_SIZE * 8) << self.granularity_bits
    }

    /// The word of granules `64 * w ..`, when allocated.
    #[inline]
    fn word(&self, w: usize) -> Option<&AtomicU64> {
        self.segs
            .get(w >> (SEG_BITS - 6))?
            .get()?
            .get(w & (SEG_WORDS - 1))
    }

    /// The first and last granule of the disk bytes `[offset, offset + len)` (`len` > 0).
    #[inline]
    fn granules_of(&self, offset: u64, len: u64) -> (u64, u64) {
        (
            offset >> self.granularity_bits,
            (offset + len - 1) >> self.granularity_bits,
        )
    }

    /// Sets the bits of the granules `[offset, offset + len)` touches (`len` > 0).
    #[inline]
    fn mark(&self, offset: u64, len: u64) {
        let (first, last) = self.granules_of(offset, len);
        if first / 64 == last / 64 {
            // One word (a request of up to 64 granules, most of them).
            let mask = (u64::MAX >> (63 - last % 64)) & (u64::MAX << (first % 64));
            return self.set(first / 64, mask);
        }
        let mut g = first;
        while g <= last {
            let lo = g % 64;
            let hi = (last - (g - lo)).min(63);
            let mask = (u64::MAX >> (63 - hi)) & (u64::MAX << lo);
            self.set(g / 64, mask);
            g += hi - lo + 1;
        }
    }

    /// Sets the bits `mask` of word `w`.
    #[inline]
    fn set(&self, w: u64, mask: u64) {
        // Most writes find their bits set already: a load, and no write to the line the
        // other cores read. (Every granule inside the disk has its word.)
        if let Some(a) = self.word(w as usize) {
            if a.load(Ordering::Relaxed) & mask != mask {
                a.fetch_or(mask, Ordering::Relaxed);
                self.changed.store(true, Ordering::Relaxed);
            }
        }
    }

    /// Clears the bits of the granules wholly or partly past `size` bytes (a disk that
    /// shrank: the bits past it must be zero, and stay so if it grows back).
    pub(crate) fn clear_from(&self, size: u64) {
        let first = size.div_ceil(1u64 << self.granularity_bits);
        let mut w = (first / 64) as usize;
        while let Some(a) = self.word(w) {
            let keep = first.saturating_sub(w as u64 * 64).min(64);
            let mask = if keep == 0 {
                0
            } else {
                u64::MAX >> (64 - keep)
            };
            if a.load(Ordering::Relaxed) & !mask != 0 {
                a.fetch_and(mask, Ordering::Relaxed);
                self.changed.store(true, Ordering::Relaxed);
            }
            w += 1;
        }
    }

    /// Starts or stops recording guest writes (through [`DirtyBitmaps::set_enabled`], which
    /// keeps its `recording` true).
    fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
    }

    /// Clears every bit.
    pub(crate) fn clear_all(&self) {
        for seg in self.segs.iter().filter_map(OnceLock::get) {
            for a in seg.iter() {
                if a.swap(0, Ordering::Relaxed) != 0 {
                    self.changed.store(true, Ordering::Relaxed);
                }
            }
        }
    }

    /// Sets the bits of every granule that another bitmap's set bits touch: `data` as
    /// stored, of granularity `granularity_bits`, over a disk of `size` bytes.
    pub(crate) fn merge(&self, granularity_bits: u8, data: &[u8], size: u64) {
        let g = u32::from(granularity_bits);
        for (i, &byte) in data.iter().enumerate().filter(|(_, b)| **b != 0) {
            for bit in (0..8).filter(|b| byte >> b & 1 == 1) {
                let start = ((i as u64) * 8 + bit) << g;
                if start >= size {
                    return;
                }
                self.mark(start, (1u64 << g).min(size - start));
            }
        }
    }

    /// Whether a bit was set (or cleared) since the bitmap was loaded or stored.
    pub(crate) fn changed(&self) -> bool {
        self.changed.load(Ordering::Relaxed)
    }

    /// The bits as they are now are stored.
    pub(crate) fn stored(&self) {
        self.changed.store(false, Ordering::Relaxed);
    }

    /// The first `len` bytes of the bitmap's data as stored.
    pub(crate) fn data(&self, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len.div_ceil(8) * 8);
        for w in 0..len.div_ceil(8) {
            let v = self.word(w).map_or(0, |a| a.load(Ordering::Relaxed));
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.resize(len, 0);
        out
    }
}

/// Bitmaps that may be added while an image is open (`qemu-img bitmap --add`), past those
/// it had at open.
pub(crate) const ADDED_SLOTS: usize = 16;

/// The persistent bitmaps of an image open for writing, in slots (those the owner loaded,
/// in the order of its directory, then those added while open: see
/// `image::owner::bitmaps`). Shared by every core's chain: a slot once set stays set (a
/// removed bitmap is retired, recording nothing), so cores read them without locks.
pub struct DirtyBitmaps {
    maps: Box<[OnceLock<Bits>]>,
    /// Whether any live bitmap is enabled: tested inline on every write, so that an image
    /// with no bitmap recording pays no call ([`refresh`](Self::refresh) keeps it).
    recording: AtomicBool,
}

impl std::fmt::Debug for DirtyBitmaps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirtyBitmaps")
            .field("bitmaps", &self.live().count())
            .finish()
    }
}

impl DirtyBitmaps {
    /// `maps` in the first slots, and room for [`ADDED_SLOTS`] more.
    pub(crate) fn new(maps: Vec<Bits>) -> Self {
        let slots: Vec<OnceLock<Bits>> = maps
            .into_iter()
            .map(OnceLock::from)
            .chain((0..ADDED_SLOTS).map(|_| OnceLock::new()))
            .collect();
        let d = DirtyBitmaps {
            maps: slots.into_boxed_slice(),
            recording: AtomicBool::new(false),
        };
        d.refresh();
        d
    }

    /// A set with no bitmap and no room for one, which never records (a chain whose top
    /// layer keeps no bitmaps asks it as it asks any other).
    pub(crate) fn never_recording() -> Self {
        DirtyBitmaps {
            maps: Box::new([]),
            recording: AtomicBool::new(false),
        }
    }

    /// Whether a write must be [`mark`](Self::mark)ed: some bitmap records.
    #[inline(always)]
    pub fn recording(&self) -> bool {
        self.recording.load(Ordering::Relaxed)
    }

    /// Recomputes [`recording`](Self::recording) after a bitmap was added, removed,
    /// enabled or disabled.
    fn refresh(&self) {
        let on = self.live().any(|b| b.enabled.load(Ordering::Relaxed));
        self.recording.store(on, Ordering::Relaxed);
    }

    /// Starts or stops recording guest writes in the bitmap of slot `i`.
    pub(crate) fn set_enabled(&self, i: usize, on: bool) {
        if let Some(b) = self.get(i) {
            b.set_enabled(on);
        }
        self.refresh();
    }

    /// The bitmaps not retired.
    fn live(&self) -> impl Iterator<Item = &Bits> {
        self.maps
            .iter()
            .map_while(OnceLock::get)
            .filter(|b| !b.retired.load(Ordering::Relaxed))
    }

    /// A guest write, write-zeroes or discard of `len` bytes at `offset` is about to
    /// change the disk: every enabled bitmap records it. (Out of line: the request paths
    /// it is called from stay as small as without bitmaps.)
    #[inline(never)]
    pub fn mark(&self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        for b in self.maps.iter().map_while(OnceLock::get) {
            if b.enabled.load(Ordering::Relaxed) {
                b.mark(offset, len);
            }
        }
    }

    /// The bitmap in slot `i`, if set.
    pub(crate) fn get(&self, i: usize) -> Option<&Bits> {
        self.maps.get(i)?.get()
    }

    /// Puts `b` in the first free slot, whose number it returns; `None` when every slot
    /// is taken.
    pub(crate) fn add(&self, b: Bits) -> Option<usize> {
        let i = self.maps.iter().position(|m| m.get().is_none())?;
        self.maps[i].set(b).ok()?;
        self.refresh();
        Some(i)
    }

    /// The bitmap in slot `i` is removed: it records nothing more, and its slot stays.
    pub(crate) fn retire(&self, i: usize) {
        if let Some(b) = self.get(i) {
            b.set_enabled(false);
            b.retired.store(true, Ordering::Relaxed);
        }
        self.refresh();
    }

    /// Memory the bitmaps take for a disk of `size` bytes.
    pub(crate) fn memory_for(&self, size: u64) -> u64 {
        self.live()
            .map(|b| memory_for(size.div_ceil(1 << b.granularity_bits)))
            .sum()
    }

    /// The slot of the first bitmap that cannot describe a disk of `size` bytes (QEMU's
    /// limit of granules), if any.
    pub(crate) fn too_small(&self, size: u64) -> Option<usize> {
        self.maps
            .iter()
            .map_while(OnceLock::get)
            .position(|b| !b.retired.load(Ordering::Relaxed) && u128::from(size) > b.max_coverage())
    }

    /// Before the disk becomes `size` bytes (not [`too_small`](Self::too_small) for it):
    /// every bitmap gets the words for it.
    pub(crate) fn cover(&self, size: u64) {
        for b in self.live() {
            b.cover(size.div_ceil(1 << b.granularity_bits));
        }
    }

    /// The bitmaps' bits past `size` bytes are cleared (the disk shrank).
    pub(crate) fn clear_from(&self, size: u64) {
        for b in self.live() {
            b.clear_from(size);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_set_every_granule_a_range_touches_and_nothing_else() {
        // 64 KiB granules, a disk of 192.
        let b = Bits::new(16, &[0b1000_0001], 192, true);
        assert!(!b.changed());
        b.mark(0, 1);
        assert!(!b.changed(), "granule 0 was set already");
        b.mark((1 << 16) - 1, 2); // granules 0 and 1
        b.mark(70 << 16, (60 << 16) + 1); // granules 70..=130
        b.mark(191 << 16, 1 << 16);
        let set = |b: &Bits, n: usize| -> Vec<usize> {
            let d = b.data(n.div_ceil(8));
            (0..n).filter(|&i| d[i / 8] >> (i % 8) & 1 == 1).collect()
        };
        assert!(b.changed());
        let want: Vec<usize> = [0, 1, 7]
            .into_iter()
            .chain(70..=130)
            .chain(std::iter::once(191))
            .collect();
        assert_eq!(set(&b, 1 << 21), want, "nothing past the disk");
        b.clear_from((100 << 16) + 1); // granule 100 stays: the disk still ends inside it
        let want: Vec<usize> = [0, 1, 7].into_iter().chain(70..=100).collect();
        assert_eq!(set(&b, 1 << 21), want);
        // A disk that grows past the first segment gets words for the new granules.
        let m = DirtyBitmaps::new(vec![b]);
        let past = (1u64 << SEG_BITS) + 5;
        m.mark(past << 16, 1);
        assert_eq!(
            set(m.get(0).unwrap(), 1 << 22).last(),
            Some(&100),
            "no words there yet"
        );
        assert_eq!(m.too_small((past + 1) << 16), None);
        m.cover((past + 1) << 16);
        m.mark(past << 16, 1);
        assert_eq!(
            set(m.get(0).unwrap(), 1 << 22).last(),
            Some(&(past as usize))
        );
        // QEMU's limit: 2^32 granules.
        assert_eq!(m.too_small((1u64 << 48) + 1), Some(0));
        assert_eq!(m.too_small(1u64 << 48), None);
    }

    #[test]
    fn clear_and_merge_across_granularities() {
        // 4 KiB granules over a disk of 1 MiB + 1 KiB.
        let size: u64 = (1 << 20) + 1024;
        let b = Bits::new(12, &[0b1], size.div_ceil(4096), true);
        b.clear_all();
        assert!(b.changed());
        assert_eq!(b.data(33), vec![0; 33]);
        // A 64 KiB-granule source with granules 1 and 16 set: 16 covers only the disk's
        // last KiB, i.e. granule 256 here.
        b.merge(16, &[0b10, 0, 0b1], size);
        let d = b.data(33);
        let set: Vec<usize> = (0..257).filter(|&i| d[i / 8] >> (i % 8) & 1 == 1).collect();
        assert_eq!(
            set,
            (16..32).chain(std::iter::once(256)).collect::<Vec<_>>()
        );
        // A 512-byte-granule source: granule 1 lies in 4 KiB granule 0.
        b.merge(9, &[0b10], size);
        assert_eq!(b.data(1)[0] & 1, 1);
        b.set_enabled(false);
        let m = DirtyBitmaps::new(vec![b]);
        m.mark(900_000, 1);
        assert_eq!(
            m.get(0).unwrap().data(33),
            d.iter()
                .enumerate()
                .map(|(i, x)| if i == 0 { x | 1 } else { *x })
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn bitmaps_added_record_and_retired_ones_do_not() {
        let m = DirtyBitmaps::new(vec![Bits::new(9, &[], 64, true)]);
        let i = m.add(Bits::new(12, &[], 8, true)).unwrap();
        assert_eq!(i, 1);
        m.mark(4096, 1);
        assert_eq!(m.get(1).unwrap().data(1), vec![2]);
        m.retire(0);
        m.mark(0, 1);
        assert_eq!(
            m.get(0).unwrap().data(2),
            vec![0, 1],
            "granule 8 only: marked before"
        );
        assert_eq!(m.get(1).unwrap().data(1), vec![3]);
        assert_eq!(m.memory_for(1 << 20), memory_for(256));
        for _ in 1..ADDED_SLOTS {
            assert!(m.add(Bits::new(12, &[], 8, false)).is_some());
        }
        assert!(
            m.add(Bits::new(12, &[], 8, false)).is_none(),
            "every slot taken"
        );
    }

    #[test]
    fn only_enabled_bitmaps_record_writes() {
        let m = DirtyBitmaps::new(vec![
            Bits::new(9, &[], 64, false),
            Bits::new(12, &[], 64, true),
        ]);
        m.mark(4096, 512);
        m.mark(0, 0);
        assert_eq!(m.get(0).unwrap().data(8), vec![0; 8]);
        assert_eq!(m.get(1).unwrap().data(8), vec![2, 0, 0, 0, 0, 0, 0, 0]);
        assert!(m.get(1).unwrap().changed() && !m.get(0).unwrap().changed());
    }
}
