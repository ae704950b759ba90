//! Watched zones: where a write must bump its write generation, because some core's ring
//! holds or is reading data there (ARCHITECTURE.md §6, unwatched zones).
//!
//! A zone is [`ZONE`] bytes of guest space; zones [`ZONES`] apart share one word. The
//! word counts the zone's live [`Watch`]es (a read-ahead's, from its record until its slot
//! is freed) and has [`ARMED`] set once the heavy half of the asymmetric fence pair ran
//! after a watch was counted. A write that finds the word 0 skips its bump:
//!
//! - **Watching.** A read-ahead adds its watch (acquire), and if the zone was not armed
//!   it runs the heavy half itself, then arms it (release), before it resolves its mapping
//!   and reads. Any write whose load found no watch ran before that barrier on its CPU:
//!   what it did was done before this read-ahead reads. A watch that finds the zone armed
//!   skips the barrier: the armer's barrier came after every write that missed the armer's
//!   count, and the watch synchronizes with the arming. A watch that finds a count but no
//!   arming (another core still in its barrier) runs its own.
//! - **Unwatching.** A watch is dropped (release) when its slot is freed or found dead:
//!   that data is never served again. The last one leaves the zone armed, so that a
//!   stream's short runs cost no barrier each.
//! - **Sweeping.** [`Zones::sweep`] clears the zones armed without a watch, with a
//!   compare-and-swap that fails if a watch came in. Hosts call it now and then (the owner's
//!   poll, [`SWEEP_EVERY`]), so a zone costs at most one barrier per sweep, and writes skip
//!   their bump again where every reader has left.
//! - **The whole image.** One more word, kept by the same rules, covers every zone: each
//!   watch counts itself there too (one barrier after both counts serves both), and a write
//!   that finds it 0 skips its bump without reading its range or its zone's word — where
//!   no core reads ahead at all, a write's whole test is one load.
//!
//! The atomics come from `loom` under `--cfg loom` (`tests/loom_ring.rs`).

#[cfg(not(loom))]
use crate::coherency::fences;
#[cfg(loom)]
use loom::sync::atomic::{fence, AtomicU32, Ordering};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Bytes of guest space one zone covers.
pub const ZONE: u64 = 64 << 20;
/// Zone words of an image (16 KiB): zones this many apart share one, which only costs
/// bumps that were not needed.
#[cfg(not(loom))]
pub const ZONES: usize = 1 << 12;
/// Zone words of an image under loom.
#[cfg(loom)]
pub const ZONES: usize = 1;
/// A zone's word: the heavy half ran after a watch was counted (and no sweep since).
const ARMED: u32 = 1 << 31;
/// The image's word where writes never skip their bump (no asymmetric pair): armed, with
/// a count no watch takes away, so no sweep clears it.
const PINNED: u32 = ARMED | 1 << 30;
/// How often a host sweeps ([`Zones::sweep`]).
pub const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// The zone words of one image, shared by its cores (through its
/// [`WriteGens`](super::WriteGens)).
pub struct Zones {
    /// In the structure itself (the image's `Arc<Zones>`), not behind a box of their own:
    /// a write's test loads its word one pointer closer.
    words: [AtomicU32; ZONES],
    /// The word of the whole image: every watch counts here too (see the module
    /// documentation).
    any: AtomicU32,
    /// Zones cleared by sweeps so far.
    swept: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Zones {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Zones").field("zones", &ZONES).finish()
    }
}

/// A read-ahead's hold on its zone: while it lives, writes there bump their generation.
/// Dropping it is unwatching (the data it was taken for is never served again).
#[derive(Debug)]
#[must_use = "dropping a watch unwatches its zone at once"]
pub struct Watch {
    zones: Arc<Zones>,
    zone: usize,
}

impl Drop for Watch {
    fn drop(&mut self) {
        // Release: a write that finds the zone swept after this comes after every serve
        // from the watched data.
        self.zones.words[self.zone].fetch_sub(1, Ordering::Release);
        self.zones.any.fetch_sub(1, Ordering::Release);
    }
}

impl Zones {
    /// Zones with none watched; `skipping`: writes may skip their bump (else the image's
    /// word stays set, and a write's first test never skips).
    pub(super) fn new(skipping: bool) -> Self {
        Zones {
            words: std::array::from_fn(|_| AtomicU32::new(0)),
            any: AtomicU32::new(if skipping { 0 } else { PINNED }),
            swept: Default::default(),
        }
    }

    #[inline(always)]
    fn index(offset: u64) -> usize {
        (offset / ZONE) as usize % ZONES
    }

    /// Watches the zone holding guest byte `offset`: on return, a write there that skips
    /// its bump had done everything before this point (see the module documentation).
    pub(super) fn watch(self: &Arc<Self>, offset: u64) -> Watch {
        let zone = Self::index(offset);
        let w = &self.words[zone];
        // Acquire: synchronizes with the arming this may find. Both counts before the
        // barrier: it then serves whichever word was not armed.
        let any = self.any.fetch_add(1, Ordering::Acquire);
        let own = w.fetch_add(1, Ordering::Acquire);
        if any & own & ARMED == 0 {
            #[cfg(not(loom))]
            fences::heavy();
            #[cfg(loom)]
            fence(Ordering::SeqCst);
            if own & ARMED == 0 {
                w.fetch_or(ARMED, Ordering::Release);
            }
            if any & ARMED == 0 {
                self.any.fetch_or(ARMED, Ordering::Release);
            }
        }
        Watch {
            zones: self.clone(),
            zone,
        }
    }

    /// The deliberately broken watch of the model check: it trusts any watch it finds,
    /// one whose barrier may not have run yet.
    #[cfg(loom)]
    pub(super) fn watch_trusting(self: &Arc<Self>, offset: u64) -> Watch {
        let zone = Self::index(offset);
        let w = &self.words[zone];
        let any = self.any.fetch_add(1, Ordering::Acquire);
        let own = w.fetch_add(1, Ordering::Acquire);
        if any == 0 || own == 0 {
            fence(Ordering::SeqCst);
            w.fetch_or(ARMED, Ordering::Release);
            self.any.fetch_or(ARMED, Ordering::Release);
        }
        Watch {
            zones: self.clone(),
            zone,
        }
    }

    /// The deliberately broken watch of the model check: it counts in its zone's word
    /// only, not in the image's (which a write tests first).
    #[cfg(loom)]
    pub(super) fn watch_zone_only(self: &Arc<Self>, offset: u64) -> Watch {
        let zone = Self::index(offset);
        let w = &self.words[zone];
        if w.fetch_add(1, Ordering::Acquire) & ARMED == 0 {
            fence(Ordering::SeqCst);
            w.fetch_or(ARMED, Ordering::Release);
        }
        // (Its drop takes one from the image's word: counted here after the barrier, too
        // late for a write that tested the word before.)
        self.any.fetch_add(1, Ordering::Relaxed);
        Watch {
            zones: self.clone(),
            zone,
        }
    }

    /// A write's test, after the light half of the pair: whether no read-ahead watches the
    /// zone holding guest byte `offset` (acquire: after every serve of data unwatched there).
    #[inline(always)]
    pub(super) fn unwatched(&self, offset: u64) -> bool {
        // (`index`, written out: every write inside one region runs this.)
        self.words[(offset / ZONE) as usize % ZONES].load(Ordering::Acquire) == 0
    }

    /// A write's first test, after the light half of the pair: whether no read-ahead
    /// watches any zone (acquire, as [`unwatched`](Self::unwatched)).
    #[inline(always)]
    pub(super) fn none_watched(&self) -> bool {
        self.any.load(Ordering::Acquire) == 0
    }

    /// Whether the zone holding guest byte `offset` is watched or still armed (writes
    /// there bump).
    pub fn is_watched(&self, offset: u64) -> bool {
        !self.unwatched(offset)
    }

    /// Live watches of the zone holding guest byte `offset`.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn watches(&self, offset: u64) -> u32 {
        self.words[Self::index(offset)].load(Ordering::Relaxed) & !ARMED
    }

    /// Clears every zone armed without a watch (a watch that comes in meanwhile makes its
    /// compare-and-swap fail); returns how many. The compare-and-swap continues the release
    /// sequence of the last unwatch, which is all a write that reads it needs.
    pub fn sweep(&self) -> usize {
        let mut cleared = 0;
        for w in self.words.iter() {
            if w.load(Ordering::Relaxed) == ARMED
                && w.compare_exchange(ARMED, 0, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            {
                cleared += 1;
            }
        }
        // (A watch counted since makes the compare-and-swap fail, as for a zone.)
        if self.any.load(Ordering::Relaxed) == ARMED {
            let _ = self
                .any
                .compare_exchange(ARMED, 0, Ordering::Relaxed, Ordering::Relaxed);
        }
        if cleared > 0 {
            self.swept
                .fetch_add(cleared as u64, std::sync::atomic::Ordering::Relaxed);
        }
        cleared
    }

    /// Zone words now watched or armed (writes there bump their generation): an
    /// operator's look, which scans them all.
    pub fn watched(&self) -> usize {
        self.words
            .iter()
            .filter(|w| w.load(Ordering::Relaxed) != 0)
            .count()
    }

    /// Zones cleared by sweeps so far (each time one was).
    pub fn swept(&self) -> u64 {
        self.swept.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The deliberately broken sweep of the model check: it clears every zone, watched or
    /// not.
    #[cfg(loom)]
    pub fn sweep_all(&self) {
        for w in self.words.iter() {
            w.store(0, Ordering::Relaxed);
        }
        self.any.store(0, Ordering::Relaxed);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_zone_stays_watched_while_a_watch_lives_and_until_a_sweep_after() {
        let z = Arc::new(Zones::new(true));
        assert!(!z.is_watched(4096));
        let a = z.watch(4096);
        let b = z.watch(ZONE - 1);
        assert!(z.is_watched(0) && !z.is_watched(ZONE));
        // Zones ZONES apart share a word.
        assert!(z.is_watched(ZONES as u64 * ZONE));
        assert_eq!(z.sweep(), 0, "watched: not cleared");
        drop(a);
        assert_eq!(z.sweep(), 0);
        drop(b);
        assert!(z.is_watched(0), "armed until a sweep");
        assert_eq!(z.sweep(), 1);
        assert!(!z.is_watched(0));
        // Watched again: armed again.
        let c = z.watch(0);
        assert!(z.is_watched(0));
        drop(c);
        assert_eq!(z.sweep(), 1);
        assert_eq!(z.sweep(), 0);
        assert!(z.none_watched());
    }

    #[test]
    fn the_image_word_is_set_while_any_zone_is_watched_and_until_a_sweep_after() {
        let z = Arc::new(Zones::new(true));
        assert!(z.none_watched());
        let a = z.watch(ZONE);
        let b = z.watch(5 * ZONE);
        assert!(!z.none_watched());
        drop(a);
        assert!(!z.none_watched());
        assert_eq!(z.sweep(), 1, "the zone of `a` only");
        assert!(!z.none_watched(), "`b` still watches");
        drop(b);
        assert!(!z.none_watched(), "armed until a sweep");
        assert_eq!(z.sweep(), 1);
        assert!(z.none_watched());
        // Armed again by the next watch, with its zone.
        let c = z.watch(0);
        assert!(!z.none_watched() && z.is_watched(0));
        drop(c);
        assert_eq!(z.sweep(), 1);
        assert!(z.none_watched());
        // Where writes never skip, the image's word stays set.
        let pinned = Arc::new(Zones::new(false));
        assert!(!pinned.none_watched());
        drop(pinned.watch(0));
        assert_eq!(pinned.sweep(), 1);
        assert!(!pinned.none_watched());
    }
}
