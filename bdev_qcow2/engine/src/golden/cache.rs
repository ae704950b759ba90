//! The shared read cache of one golden image: granules of its data in slots that every
//! core reads without a lock.
//!
//! Each slot has one state word: `tag << TAG_SHIFT | pins << PIN_SHIFT | state`. A reader
//! pins a ready slot holding its granule with one compare-and-swap, copies out, and unpins;
//! a filler takes a ready slot nobody pins (or an empty one) with one compare-and-swap,
//! writes the granule and publishes it ready. The golden image never changes under its
//! overlays, so a slot needs no coherency beyond its replacement: pins keep a slot's bytes
//! still while anyone copies them, and the release of a publish (or of an unpin) pairs
//! with the acquire of the next pin (or of the replacement's claim).
//!
//! So a slot's bytes are written only by the one filler that claimed it (no pin on it) and
//! read only under pins taken after the publish: whatever memory holds them
//! ([`GranuleMemory`]: the host's DMA memory, copied with `memcpy`) is never written while
//! it is read, and no lock is taken. `tests/loom_golden.rs` model-checks this.

use super::memory::{AtomicWords, Exclusive, GranuleAlloc, GranuleMemory, Shared};
#[cfg(loom)]
use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

const STATE_MASK: u64 = 0b11;
const EMPTY: u64 = 0;
const FILLING: u64 = 1;
const READY: u64 = 2;
const PIN_SHIFT: u32 = 2;
const PIN_ONE: u64 = 1 << PIN_SHIFT;
const PIN_BITS: u32 = 16;
const PIN_MASK: u64 = ((1 << PIN_BITS) - 1) << PIN_SHIFT;
const TAG_SHIFT: u32 = PIN_SHIFT + PIN_BITS;
/// Granule indexes a tag holds (granules beyond it are never cached).
const MAX_TAG: u64 = u64::MAX >> TAG_SHIFT;

/// Slots per set: a granule may live in any slot of its set.
pub const WAYS: usize = 8;
/// The default granule: what one fill reads of the golden image.
pub const DEFAULT_GRANULE: u32 = 64 << 10;

/// Counters of a cache, summed over every core that reads through it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CacheStats {
    /// Reads of granules served from the cache.
    pub hits: u64,
    /// Granules read from the golden image into the cache.
    pub fills: u64,
    /// Bytes read from the golden image into the cache.
    pub fill_bytes: u64,
    /// Of the fills, those the host read straight into their slot (no copy).
    pub fills_in_place: u64,
    /// Times a read found its granule being filled by another read and waited for it.
    pub waits: u64,
    /// Reads sent to the golden image past the cache (no slot could be taken, or a fill
    /// failed).
    pub bypasses: u64,
    /// Bytes of memory the cache holds now.
    pub memory_bytes: u64,
    /// Bytes it may hold at most.
    pub capacity_bytes: u64,
    /// Readers holding it as [`Sharer`]s (overlays of the golden image).
    pub sharers: u64,
}

/// The shared read cache of one golden image (see the module documentation).
pub struct SharedReadCache {
    granule: u32,
    sets: usize,
    state: Box<[AtomicU64]>,
    /// Each slot's bytes, allocated by its first fill: memory follows use, up to the size.
    data: Box<[OnceLock<Box<dyn GranuleMemory>>]>,
    alloc: GranuleAlloc,
    /// Per set: where its next replacement starts looking (a clock hand).
    hand: Box<[AtomicU32]>,
    counters: Counters,
    /// How many [`Sharer`]s hold it: while one or none does, reads skip it.
    sharers: Padded,
    /// The model check's deliberately broken protocol.
    #[cfg(loom)]
    broken: Broken,
}

/// Deliberately broken slot protocols the model check must catch.
#[cfg(loom)]
#[derive(Debug, Default, Clone, Copy)]
pub struct Broken {
    /// A claim takes a ready slot that readers pin.
    pub claim_pinned: bool,
    /// A publish makes the slot ready without a release.
    pub relaxed_publish: bool,
}

/// Counters, each on its own cache line (every core bumps them).
#[derive(Default)]
struct Counters {
    hits: Padded,
    fills: Padded,
    fill_bytes: Padded,
    fills_in_place: Padded,
    waits: Padded,
    bypasses: Padded,
    slots_allocated: Padded,
}

#[repr(align(128))]
struct Padded(AtomicU64);

impl Default for Padded {
    fn default() -> Padded {
        Padded(AtomicU64::new(0))
    }
}

impl Padded {
    #[inline]
    fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    #[inline]
    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl std::fmt::Debug for SharedReadCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedReadCache")
            .field("granule", &self.granule)
            .field("slots", &self.state.len())
            .finish()
    }
}

/// What [`SharedReadCache::pin`] found for a granule.
#[derive(Debug)]
pub enum Lookup<'a> {
    /// Ready and pinned: copy out, then drop the pin.
    Hit(Pin<'a>),
    /// Another read is filling it: look again later.
    Filling,
    /// Not cached.
    Miss,
}

/// A pinned ready slot: its bytes stay as they are until it is dropped.
#[derive(Debug)]
#[must_use = "a pin is for copying the granule out"]
pub struct Pin<'a> {
    cache: &'a SharedReadCache,
    slot: usize,
}

/// A slot taken for filling with one granule ([`SharedReadCache::claim`]): readers of that
/// granule wait until [`publish`](Fill::publish); dropped unpublished (the read failed),
/// the slot is empty again and they read it themselves.
#[derive(Debug)]
#[must_use = "a fill must be published or dropped"]
pub struct Fill {
    cache: Arc<SharedReadCache>,
    slot: usize,
    granule: u64,
    done: bool,
}

impl SharedReadCache {
    /// A cache of at most `bytes` bytes in granules of `granule` bytes (a power of two of at
    /// least 4 KiB), rounded down to whole sets of [`WAYS`] slots; `None` when that is no
    /// set at all. Its bytes are in atomic words on the heap.
    pub fn new(bytes: u64, granule: u32) -> Option<Arc<SharedReadCache>> {
        SharedReadCache::with_memory(bytes, granule, AtomicWords::alloc)
    }

    /// The model check's cache with a broken protocol.
    #[cfg(loom)]
    pub fn new_broken(
        bytes: u64,
        granule: u32,
        alloc: GranuleAlloc,
        broken: Broken,
    ) -> Option<Arc<SharedReadCache>> {
        let mut c = SharedReadCache::with_memory(bytes, granule, alloc)?;
        Arc::get_mut(&mut c)?.broken = broken;
        Some(c)
    }

    /// As [`new`](Self::new), each slot's bytes in memory from `alloc` (made by the slot's
    /// first fill).
    pub fn with_memory(
        bytes: u64,
        granule: u32,
        alloc: GranuleAlloc,
    ) -> Option<Arc<SharedReadCache>> {
        if !granule.is_power_of_two() || granule < 4096 {
            return None;
        }
        let sets = usize::try_from(bytes / u64::from(granule) / WAYS as u64).ok()?;
        if sets == 0 {
            return None;
        }
        let slots = sets * WAYS;
        Some(Arc::new(SharedReadCache {
            granule,
            sets,
            state: (0..slots).map(|_| AtomicU64::new(EMPTY)).collect(),
            data: (0..slots).map(|_| OnceLock::new()).collect(),
            alloc,
            hand: (0..sets).map(|_| AtomicU32::new(0)).collect(),
            counters: Counters::default(),
            sharers: Padded::default(),
            #[cfg(loom)]
            broken: Broken::default(),
        }))
    }

    /// Bytes per granule.
    pub fn granule(&self) -> u32 {
        self.granule
    }

    /// The counters now.
    pub fn stats(&self) -> CacheStats {
        let c = &self.counters;
        CacheStats {
            hits: c.hits.get(),
            fills: c.fills.get(),
            fill_bytes: c.fill_bytes.get(),
            fills_in_place: c.fills_in_place.get(),
            waits: c.waits.get(),
            bypasses: c.bypasses.get(),
            memory_bytes: c.slots_allocated.get() * u64::from(self.granule),
            capacity_bytes: self.state.len() as u64 * u64::from(self.granule),
            sharers: self.sharers.get(),
        }
    }

    /// One more reader of the golden image (an overlay) holds the cache, until the
    /// returned [`Sharer`] is dropped.
    pub fn share(self: &Arc<Self>) -> Sharer {
        self.sharers.add(1);
        Sharer(self.clone())
    }

    /// Whether two readers or more hold it: only then do reads go through it. A reader
    /// alone would only pay the copies of a hit for what its own read-ahead already does.
    /// Inline: every read of a backing device asks it (a call from another crate otherwise).
    #[inline]
    pub fn is_shared(&self) -> bool {
        self.sharers.get() > 1
    }

    /// Counts a wait for another read's fill.
    pub(crate) fn count_wait(&self) {
        self.counters.waits.add(1);
    }

    /// Counts a read sent past the cache.
    pub(crate) fn count_bypass(&self) {
        self.counters.bypasses.add(1);
    }

    fn set_of(&self, granule: u64) -> std::ops::Range<usize> {
        // Fibonacci hashing: neighbouring granules spread over the sets.
        let h = granule.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        let set = (h % self.sets as u64) as usize;
        set * WAYS..(set + 1) * WAYS
    }

    /// Looks `granule` up, pinning it when it is ready (in any slot: two cores that missed
    /// it at once may both fill it).
    pub fn pin(&self, granule: u64) -> Lookup<'_> {
        if granule > MAX_TAG {
            return Lookup::Miss;
        }
        let mut filling = false;
        for slot in self.set_of(granule) {
            let word = &self.state[slot];
            let mut s = word.load(Ordering::Acquire);
            loop {
                if s >> TAG_SHIFT != granule || s & STATE_MASK == EMPTY {
                    break;
                }
                if s & STATE_MASK == FILLING {
                    filling = true;
                    break;
                }
                if s & PIN_MASK == PIN_MASK {
                    // Every pin taken (never with fewer readers than that): read around it.
                    return Lookup::Miss;
                }
                match word.compare_exchange_weak(
                    s,
                    s + PIN_ONE,
                    Ordering::Acquire,
                    Ordering::Acquire,
                ) {
                    Ok(_) => {
                        self.counters.hits.add(1);
                        return Lookup::Hit(Pin { cache: self, slot });
                    }
                    Err(now) => s = now,
                }
            }
        }
        match filling {
            true => Lookup::Filling,
            false => Lookup::Miss,
        }
    }

    /// Takes a slot of `granule`'s set to fill with it: an empty slot, else a ready one no
    /// read pins, from the set's clock hand on. `None` when the granule is cached or being
    /// filled already (look it up again), or every slot is busy.
    pub fn claim(self: &Arc<Self>, granule: u64) -> Option<Fill> {
        if granule > MAX_TAG {
            return None;
        }
        let set = self.set_of(granule);
        let words = &self.state[set.clone()];
        let snapshot: [u64; WAYS] = std::array::from_fn(|i| words[i].load(Ordering::Acquire));
        if snapshot
            .iter()
            .any(|&s| s & STATE_MASK != EMPTY && s >> TAG_SHIFT == granule)
        {
            return None;
        }
        let hand = &self.hand[set.start / WAYS];
        let start = hand.fetch_add(1, Ordering::Relaxed) as usize;
        let taken = FILLING | granule << TAG_SHIFT;
        // Empty slots first, then ready ones nobody pins.
        for want_empty in [true, false] {
            for k in 0..WAYS {
                let i = (start + k) % WAYS;
                let s = snapshot[i];
                let free = match want_empty {
                    true => s & STATE_MASK == EMPTY,
                    false => s & STATE_MASK == READY && (s & PIN_MASK == 0 || self.claims_pinned()),
                };
                // The acquire pairs with the release of the last unpin: every copy out of
                // the old granule is over before the new one is written.
                if free
                    && words[i]
                        .compare_exchange(s, taken, Ordering::Acquire, Ordering::Relaxed)
                        .is_ok()
                {
                    return Some(Fill {
                        cache: self.clone(),
                        slot: set.start + i,
                        granule,
                        done: false,
                    });
                }
            }
        }
        None
    }

    pub(super) fn memory(&self, slot: usize) -> &dyn GranuleMemory {
        &**self.data[slot].get_or_init(|| {
            self.counters.slots_allocated.add(1);
            (self.alloc)(self.granule as usize)
        })
    }

    #[cfg(not(loom))]
    #[inline(always)]
    fn claims_pinned(&self) -> bool {
        false
    }

    #[cfg(loom)]
    fn claims_pinned(&self) -> bool {
        self.broken.claim_pinned
    }

    #[cfg(not(loom))]
    #[inline(always)]
    fn publish_order(&self) -> Ordering {
        Ordering::Release
    }

    #[cfg(loom)]
    fn publish_order(&self) -> Ordering {
        match self.broken.relaxed_publish {
            true => Ordering::Relaxed,
            false => Ordering::Release,
        }
    }
}

/// A reader's hold on a [`SharedReadCache`] ([`SharedReadCache::share`]).
#[derive(Debug)]
pub struct Sharer(Arc<SharedReadCache>);

impl Sharer {
    /// The cache held.
    pub fn cache(&self) -> &Arc<SharedReadCache> {
        &self.0
    }
}

impl Drop for Sharer {
    fn drop(&mut self) {
        self.0.sharers.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Pin<'_> {
    /// Copies `dst.len()` bytes of the granule from byte `off` on.
    pub fn copy_out(&self, off: usize, dst: &mut [u8]) {
        // A pin on a published slot: nobody writes its bytes until it is dropped.
        self.cache.memory(self.slot).load(&Shared::new(), off, dst);
    }
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        // Release: the copy is over before a claim (acquire) sees the pin gone.
        self.cache.state[self.slot].fetch_sub(PIN_ONE, Ordering::Release);
    }
}

impl Fill {
    /// The granule being filled.
    pub fn granule(&self) -> u64 {
        self.granule
    }

    /// Where the granule is on the device (byte offset) and its length.
    pub fn device_range(&self) -> (u64, usize) {
        let g = self.cache.granule;
        (self.granule * u64::from(g), g as usize)
    }

    /// Stores the granule's bytes (`src`: the whole granule) and makes it ready for every
    /// reader.
    pub fn publish(self, src: &[u8]) {
        debug_assert_eq!(src.len(), self.cache.granule as usize);
        // Claimed with no pin on it, not yet published: this fill alone touches the bytes.
        self.memory().store(&Exclusive::new(), 0, src);
        self.publish_stored(false);
    }

    /// The slot's memory (allocated by its first fill).
    pub(super) fn memory(&self) -> &dyn GranuleMemory {
        self.cache.memory(self.slot)
    }

    /// Makes the granule ready for every reader: its bytes are in the slot (read there in
    /// place by the host's device when `in_place`).
    pub(super) fn publish_stored(mut self, in_place: bool) {
        let c = &self.cache;
        if in_place {
            c.counters.fills_in_place.add(1);
        }
        c.counters.fills.add(1);
        c.counters.fill_bytes.add(u64::from(c.granule));
        // Release: the bytes before the state any pin (acquire) reads.
        c.state[self.slot].store(READY | self.granule << TAG_SHIFT, c.publish_order());
        self.done = true;
    }
}

impl Drop for Fill {
    fn drop(&mut self) {
        if !self.done {
            self.cache.state[self.slot].store(EMPTY, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_then_hit_then_replace_only_unpinned() {
        let c = SharedReadCache::new(8 * 4096, 4096).expect("one set");
        assert!(matches!(c.pin(3), Lookup::Miss));
        let f = c.claim(3).expect("an empty slot");
        assert!(matches!(c.pin(3), Lookup::Filling));
        assert!(c.claim(3).is_none(), "being filled: no second slot");
        f.publish(&[7u8; 4096]);
        let Lookup::Hit(p) = c.pin(3) else {
            panic!("ready")
        };
        let mut b = [0u8; 5];
        p.copy_out(4090, &mut b[..5]);
        assert_eq!(b, [7; 5]);
        // Fill the other seven ways, then one more: the pinned slot stays.
        for g in 100..107 {
            c.claim(g).expect("empty").publish(&[g as u8; 4096]);
        }
        for round in 0..20 {
            let f = c.claim(1000 + round).expect("an unpinned ready slot");
            f.publish(&[1; 4096]);
            assert!(matches!(c.pin(3), Lookup::Hit(_)), "pinned: never replaced");
        }
        drop(p);
        let s = c.stats();
        assert_eq!(s.fills, 28);
        assert_eq!(s.memory_bytes, 8 * 4096);
        assert_eq!(s.capacity_bytes, 8 * 4096);
    }

    #[test]
    fn a_dropped_fill_leaves_the_slot_empty() {
        let c = SharedReadCache::new(8 * 4096, 4096).expect("one set");
        drop(c.claim(9).expect("empty"));
        assert!(matches!(c.pin(9), Lookup::Miss));
        assert!(c.claim(9).is_some());
    }

    #[test]
    fn sizes_refused() {
        assert!(
            SharedReadCache::new(4096, 4096).is_none(),
            "less than a set"
        );
        assert!(SharedReadCache::new(1 << 20, 3000).is_none());
    }

    #[test]
    fn many_threads_read_what_was_filled() {
        let c = SharedReadCache::new(16 * 4096, 4096).expect("two sets");
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let c = c.clone();
                std::thread::spawn(move || {
                    for i in 0..20_000u64 {
                        let g = (i * 7 + t) % 40;
                        match c.pin(g) {
                            Lookup::Hit(p) => {
                                let mut b = [0u8; 64];
                                p.copy_out(1000, &mut b);
                                assert!(b.iter().all(|&x| x == g as u8), "granule {g}");
                            }
                            Lookup::Filling => {}
                            Lookup::Miss => {
                                if let Some(f) = c.claim(g) {
                                    f.publish(&[g as u8; 4096]);
                                }
                            }
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("no reader saw another granule's bytes");
        }
    }
}
