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
//!   and issues the read ([`WriteGens::record`]);
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
//! **Unwatched zones.** The bump is a locked read-modify-write on a line every writing
//! core shares: on a random-write workload it was most of what a write costs over SPDK's
//! passthru. Yet only guest space that some ring is reading ahead in needs it. So a
//! read-ahead holds a [`Watch`] on its zone from its record until its slot is freed, and a
//! write inside one region skips its bump where no watch is (the light half of the
//! asymmetric fence pair, then the zone's load; the protocol is in [`zones`](super::zones)).
//! Without the asymmetric pair every write bumps, as a full fence would cost what the bump
//! does.
//!
//! The atomics come from `loom` under `--cfg loom` (`tests/loom_ring.rs` checks them, with
//! `fence(SeqCst)` for each half of the pair).

use super::zones::{Watch, Zones};
use crate::coherency::fences;
#[cfg(loom)]
use loom::sync::atomic::{fence, AtomicU32, Ordering};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// Bytes of guest space one generation covers: one ring chunk, so a hit checks one
/// generation per chunk.
pub const REGION: u64 = 128 << 10;

/// Generation slots of an image (256 KiB): regions this many apart share one, which only
/// costs false misses. A fixed count, so that the write path indexes without a bounds
/// check or a load of the mask. (Few under loom, which models every atomic.)
#[cfg(not(loom))]
pub const GEN_SLOTS: usize = 1 << 16;
/// Generation slots of an image under loom.
#[cfg(loom)]
pub const GEN_SLOTS: usize = 8;

/// The write generations of one image, shared by its cores (`Arc`).
pub struct WriteGens {
    gens: Box<[AtomicU32; GEN_SLOTS]>,
    /// Where some core reads ahead (writes elsewhere skip their bump).
    zones: Arc<Zones>,
    /// Writes outside watched zones skip the bump: only with the asymmetric fence pair,
    /// whose light half costs a write nothing (a full fence would cost what the bump does).
    skip_unwatched: bool,
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
    /// Generations for an image, all 0, no zone watched. (Fixes the fence mode, as the
    /// first shared image would: a host installs its barrier before it opens images.)
    pub fn new() -> Self {
        fences::init();
        Self::with_mode(cfg!(loom) || fences::asymmetric())
    }

    /// Generations whose writes skip their bump outside watched zones when
    /// `skip_unwatched` (the zones know it too: see [`written_of`](Self::written_of)).
    fn with_mode(skip_unwatched: bool) -> Self {
        WriteGens {
            gens: (0..GEN_SLOTS)
                .map(|_| AtomicU32::new(0))
                .collect::<Box<[AtomicU32]>>()
                .try_into()
                .unwrap_or_else(|_| unreachable!("GEN_SLOTS generations")),
            zones: Arc::new(Zones::new(skip_unwatched)),
            skip_unwatched,
        }
    }

    /// A read-ahead of the region holding guest byte `offset` is about to resolve its
    /// mapping and read: returns the generation to hold its data against, and its watch on
    /// the zone, to keep until its data is never served again (its slot freed or dead).
    /// Watching comes first, so that a write that skips its bump there had completed
    /// before this read-ahead reads.
    #[inline]
    pub fn record(&self, offset: u64) -> (u32, Watch) {
        let watch = self.zones.watch(offset);
        (self.current(offset), watch)
    }

    /// The deliberately broken [`record`](Self::record) of the model check: its watch
    /// trusts a zone another core is still arming.
    #[cfg(loom)]
    pub fn record_trusting(&self, offset: u64) -> (u32, Watch) {
        let watch = self.zones.watch_trusting(offset);
        (self.current(offset), watch)
    }

    /// The deliberately broken [`record`](Self::record) of the model check: its watch
    /// is counted in its zone but not in the image's word.
    #[cfg(loom)]
    pub fn record_zone_only(&self, offset: u64) -> (u32, Watch) {
        let watch = self.zones.watch_zone_only(offset);
        (self.current(offset), watch)
    }

    /// The zones read-ahead watches: hosts [`sweep`](Zones::sweep) them every
    /// [`SWEEP_EVERY`](super::zones::SWEEP_EVERY).
    pub fn zones(&self) -> &Zones {
        &self.zones
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
        self.written_of(|| (offset, len))
    }

    /// [`written`](Self::written) of the range `range` returns (byte offset, length),
    /// asked for only when some zone is watched: where no core reads ahead, a write's
    /// test is the image's word alone.
    #[inline(always)]
    pub fn written_of(&self, range: impl FnOnce() -> (u64, u64)) {
        // The light half of the pair: what the write did, then the words' loads. (Without
        // the pair the image's word is pinned set: no flag to test first, and a load whose
        // order does not matter, as its answer is always "bump".)
        #[cfg(not(loom))]
        fences::light(true);
        #[cfg(loom)]
        fence(Ordering::SeqCst);
        if self.zones.none_watched() {
            return;
        }
        let (offset, len) = range();
        // A write inside one region (every small write but those that straddle a
        // boundary): one bump, no loop, and none where its zone is not watched. (Its first
        // and last byte differ only below the region's bits; a write of nothing may bump
        // one, which costs only a false miss.) Others bump while any zone is watched.
        if offset ^ offset.wrapping_add(len).wrapping_sub(1) < REGION {
            if self.skip_unwatched && self.zones.unwatched(offset) {
                return;
            }
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
    use crate::ring::zones::{ZONE, ZONES};

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
    fn writes_bump_only_in_zones_a_read_ahead_watches() {
        let g = WriteGens::with_mode(true);
        g.written(4096, 512);
        assert_eq!(g.current(4096), 0, "no read-ahead there: no bump");
        let (gen, watch) = g.record(4096);
        assert_eq!(gen, 0);
        g.written(4096, 512);
        assert_eq!(g.current(4096), 1);
        // The whole zone is watched; the next one is not; zones ZONES apart share a word.
        g.written(ZONE - REGION, 512);
        assert_eq!(g.current(ZONE - REGION), 1);
        g.written(ZONE, 512);
        assert_eq!(g.current(ZONE), 0);
        let alias = ZONES as u64 * ZONE + 3 * REGION;
        g.written(alias, 512);
        assert_eq!(g.current(alias), 1);
        // A write over a region's end (here a zone's too) bumps whatever it touched.
        g.written(2 * ZONE - 512, 1024);
        assert_eq!(g.current(2 * ZONE - 512), 1);
        assert_eq!(g.current(2 * ZONE), 1);
        // Unwatched: writes bump until a sweep, then skip.
        drop(watch);
        g.written(4096, 512);
        assert_eq!(g.current(4096), 2);
        assert_eq!(g.zones().sweep(), 1);
        g.written(4096, 512);
        assert_eq!(g.current(4096), 2);
        // Nothing watched anywhere (swept): a write over a region's end skips too.
        g.written(2 * ZONE - 512, 1024);
        assert_eq!(g.current(2 * ZONE - 512), 1);
        assert_eq!(g.current(2 * ZONE), 1);
        // Without the asymmetric pair every write bumps.
        let all = WriteGens::with_mode(false);
        all.written(4096, 512);
        assert_eq!(all.current(4096), 1);
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
