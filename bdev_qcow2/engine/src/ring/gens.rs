//! Write generations: how a write on any core makes every core's prefetched data of the
//! guest range it changed unusable (ARCHITECTURE.md §6, prefetched data).
//!
//! One `AtomicU32` per guest region of [`REGION`] bytes (hashed into at most
//! [`GEN_SLOTS`] slots; a shared slot only costs false misses), shared by every core
//! of an image. The protocol:
//!
//! - a guest write, write-zeroes or discard, on any core, bumps the generation of every
//!   region it touches **after** everything it did reached the device and the metadata
//!   (its data, a new mapping, a COW) and **before** the request completes
//!   ([`WriteGens::written`]);
//! - read-ahead records the generation of its region **before** it resolves the mapping
//!   and issues the read ([`WriteGens::current`]);
//! - prefetched data is used only while the generation still equals the recorded one
//!   ([`WriteGens::current`] again, when a request would be served from it).
//!
//! Why that suffices: a write W that completed before a read R was submitted bumped the
//! generation before R looks, so R sees the bump. If the read-ahead's record saw W's bump
//! (acquire of W's release), W's data and mapping were in place before the read-ahead
//! resolved and read, so its data is W's or newer; if it did not, R finds the generation
//! moved and does not use it. An in-place overwrite changes no mapping and no epoch, which
//! is why slice epochs alone cannot protect data. The bump is a read-modify-write: two
//! writers that both loaded the same value and stored value + 1 would leave a read-ahead
//! that recorded between them unable to see the second.
//!
//! The atomics come from `loom` under `--cfg loom` (`tests/loom_epochs.rs` checks them).

#[cfg(loom)]
use loom::sync::atomic::{AtomicU32, Ordering};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU32, Ordering};

/// Bytes of guest space one generation covers: one ring chunk, so a hit checks one
/// generation per chunk.
pub const REGION: u64 = 128 << 10;

/// Generation slots of an image (256 KiB): regions this many apart share one, which only
/// costs false misses. A fixed count, so that the write path indexes without a bounds
/// check or a load of the mask. (Few under loom, which models every atomic.)
#[cfg(not(loom))]
pub const GEN_SLOTS: usize = 1 << 16;
#[cfg(loom)]
pub const GEN_SLOTS: usize = 8;

/// The write generations of one image, shared by its cores (`Arc`).
pub struct WriteGens {
    gens: Box<[AtomicU32; GEN_SLOTS]>,
}

impl std::fmt::Debug for WriteGens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteGens")
            .field("slots", &GEN_SLOTS)
            .finish()
    }
}

impl Default for WriteGens {
    fn default() -> Self {
        Self::new()
    }
}

impl WriteGens {
    /// Generations for an image, all 0.
    pub fn new() -> Self {
        WriteGens {
            gens: (0..GEN_SLOTS)
                .map(|_| AtomicU32::new(0))
                .collect::<Box<[AtomicU32]>>()
                .try_into()
                .unwrap_or_else(|_| unreachable!("GEN_SLOTS generations")),
        }
    }

    /// The slot of region `region`.
    #[inline(always)]
    fn slot(&self, region: u64) -> &AtomicU32 {
        &self.gens[region as usize % GEN_SLOTS]
    }

    /// The generation of the region holding guest byte `offset` (acquire: pairs with the
    /// release of [`written`](Self::written)).
    #[inline(always)]
    pub fn current(&self, offset: u64) -> u32 {
        self.slot(offset / REGION).load(Ordering::Acquire)
    }

    /// A guest write (write-zeroes, discard) of `len` bytes at `offset` is about to
    /// complete, everything it did on the device and in the metadata done: bumps the
    /// generation of each region it touched (each slot once when the range covers them
    /// all). Also after a failed write, which may have changed some of its bytes.
    #[inline(always)]
    pub fn written(&self, offset: u64, len: u64) {
        // A write inside one region (every small write but those that straddle a
        // boundary): one bump, no loop. (Its first and last byte differ only below the
        // region's bits; a write of nothing may bump one, which costs only a false miss.)
        if offset ^ offset.wrapping_add(len).wrapping_sub(1) < REGION {
            self.slot(offset / REGION).fetch_add(1, Ordering::AcqRel);
        } else {
            self.written_range(offset, len);
        }
    }

    /// [`written`](Self::written) of a range over several regions (or none).
    #[inline(never)]
    fn written_range(&self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        let first = offset / REGION;
        let last = offset.saturating_add(len - 1) / REGION;
        let count = (last - first).saturating_add(1).min(GEN_SLOTS as u64);
        for r in first..first + count {
            self.slot(r).fetch_add(1, Ordering::AcqRel);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_write_moves_the_generation_of_every_region_it_touches() {
        let g = WriteGens::new();
        let before: Vec<u32> = (0..4).map(|r| g.current(r * REGION)).collect();
        g.written(REGION - 512, 1024);
        assert_ne!(g.current(0), before[0]);
        assert_ne!(g.current(REGION), before[1]);
        assert_eq!(g.current(2 * REGION), before[2]);
        // Within a region every byte shares it.
        assert_eq!(g.current(REGION + 4096), g.current(2 * REGION - 1));
    }

    #[test]
    fn huge_ranges_bump_each_slot_once() {
        let g = WriteGens::new();
        g.written(0, u64::MAX);
        assert!((0..GEN_SLOTS as u64).all(|r| g.current(r * REGION) == 1));
        // Regions GEN_SLOTS apart share a slot.
        g.written(GEN_SLOTS as u64 * REGION, 1);
        assert_eq!(g.current(0), 2);
        let fresh = WriteGens::new();
        fresh.written(0, 0);
        assert_eq!(fresh.current(0), 0);
        fresh.written(u64::MAX, 1);
        assert_eq!(fresh.current(u64::MAX), 1);
    }
}
