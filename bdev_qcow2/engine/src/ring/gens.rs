//! Write generations: how a write on any core makes every core's prefetched data of the
//! guest range it changed unusable (ARCHITECTURE.md §6, prefetched data).
//!
//! One `AtomicU32` per guest region of [`REGION`] bytes (hashed into at most
//! [`MAX_GEN_SLOTS`] slots; a shared slot only costs false misses), shared by every core
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

/// Upper bound on generation slots (1 MiB of generations): larger disks share slots.
pub const MAX_GEN_SLOTS: u64 = 1 << 18;

/// The write generations of one image, shared by its cores (`Arc`).
pub struct WriteGens {
    gens: Box<[AtomicU32]>,
    mask: u64,
}

impl std::fmt::Debug for WriteGens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteGens")
            .field("slots", &self.gens.len())
            .finish()
    }
}

impl WriteGens {
    /// Generations for a disk of `disk_size` bytes: a power of two of slots, one per
    /// region up to [`MAX_GEN_SLOTS`].
    pub fn new(disk_size: u64) -> Self {
        let regions = disk_size.div_ceil(REGION).clamp(1, MAX_GEN_SLOTS);
        let slots = regions.next_power_of_two();
        WriteGens {
            gens: (0..slots).map(|_| AtomicU32::new(0)).collect(),
            mask: slots - 1,
        }
    }

    /// The slot of the region holding guest byte `offset`.
    #[inline(always)]
    fn slot(&self, region: u64) -> &AtomicU32 {
        &self.gens[(region & self.mask) as usize]
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
        // boundary): one bump, no loop.
        if len != 0 && len <= REGION - offset % REGION {
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
        let count = (last - first).saturating_add(1).min(self.mask + 1);
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
        let g = WriteGens::new(1 << 30);
        let before: Vec<u32> = (0..4).map(|r| g.current(r * REGION)).collect();
        g.written(REGION - 512, 1024);
        assert_ne!(g.current(0), before[0]);
        assert_ne!(g.current(REGION), before[1]);
        assert_eq!(g.current(2 * REGION), before[2]);
        // Within a region every byte shares it.
        assert_eq!(g.current(REGION + 4096), g.current(2 * REGION - 1));
    }

    #[test]
    fn huge_ranges_bump_each_slot_once_and_sizes_stay_bounded() {
        let g = WriteGens::new(u64::MAX);
        assert_eq!(g.gens.len() as u64, MAX_GEN_SLOTS);
        g.written(0, u64::MAX);
        assert!((0..MAX_GEN_SLOTS).all(|r| g.current(r * REGION) == 1));
        let small = WriteGens::new(3 * REGION);
        assert_eq!(small.gens.len(), 4);
        small.written(0, 0);
        assert_eq!(small.current(0), 0);
    }
}
