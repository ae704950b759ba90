//! A set-associative cache of fixed-size metadata blocks (L2 slices, refcount blocks).
//!
//! `set = hash(key) & (sets - 1)`; each set has `ways` entries stored flat, so lookup and
//! victim choice cost O(ways) whatever the cache size. Victim: an invalid way first, else
//! the least recently used way of the set. Each way remembers the epoch its contents were
//! read under; a lookup hits only when the caller's current epoch matches, which is how a
//! per-core replica is validated against the metadata owner (DESIGN.md §5).
//!
//! In front of the sets, a direct-mapped table indexed by the key's low bits names the way
//! and epoch of the keys in use, exactly (every change to a way updates it), so a hit is one
//! load and an LRU stamp store however large the cache; the set is scanned only when the
//! key's slot names another key.

/// Key value marking an invalid way.
const INVALID: u64 = u64::MAX;

/// Odd 64-bit multipliers (2^64 / golden ratio; murmur3's) for the hash in [`set_of`].
///
/// [`set_of`]: SetAssocCache::set_of
const MIX: [u64; 2] = [0x9E37_79B9_7F4A_7C15, 0xC2B2_AE3D_27D4_EB4F];

/// A slot of the direct-mapped front table: `key` is held in `way` under `epoch`, exactly
/// (every change to a way updates or clears the slot that names it), or `key == INVALID`.
#[derive(Clone, Copy)]
struct Front {
    key: u64,
    way: u32,
    epoch: u32,
}

const NO_FRONT: Front = Front {
    key: INVALID,
    way: 0,
    epoch: 0,
};

/// The LRU clock restarts before it reaches this value, so that a stamp shifted left by 3
/// with a way's index in the low bits is still a positive `i32` (see [`victim`]).
///
/// [`victim`]: SetAssocCache::victim
const CLOCK_END: u32 = 1 << 28;

/// The rank of `way` with LRU stamp `stamp` (0: invalid): the stamp shifted left by 3 with
/// the way's index modulo 8 in the low bits. Stored as is, so that choosing a victim
/// compares ranks and nothing else: stamps are distinct, so ranks order like stamps; and
/// in a set of 8 ways (which starts at a multiple of 8) the low bits of the smallest rank
/// name its way, even among invalid ways, which all have stamp 0.
#[inline(always)]
fn rank(stamp: u32, way: usize) -> u32 {
    stamp << 3 | (way & 7) as u32
}

/// A successful [`probe`](SetAssocCache::probe): the way holding the key, to read and to
/// commit with [`touch`](SetAssocCache::touch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hit {
    /// The way holding the key.
    pub way: usize,
    key: u64,
    /// Whether the front table named the way (else the set scan found it, and the touch
    /// points the front table at it).
    in_front: bool,
}

/// Hit/miss/eviction counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups that found a valid entry with the current epoch.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
    /// Valid entries replaced by an insert.
    pub evictions: u64,
    /// Entries found with an outdated epoch (counted as misses too).
    pub stale: u64,
}

/// Sizing of a cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    /// Total bytes of cached blocks (rounded down to a power-of-two number of sets).
    pub size_bytes: u64,
    /// Ways per set.
    pub ways: usize,
}

/// A set-associative cache of blocks of `T` (u64 words for L2 slices, bytes for refcounts),
/// each way with a summary `A` of its block that the cache's user derives and keeps in step
/// (reset to `A::default()` by every insert).
pub struct SetAssocCache<T, A = ()> {
    ways: usize,
    /// Number of sets minus 1 (sets are a power of two).
    set_mask: u64,
    block_len: usize,
    keys: Vec<u64>,
    epochs: Vec<u32>,
    /// Each way's LRU rank: its stamp (below [`CLOCK_END`]: see [`tick`](Self::tick); 0 for
    /// an invalid way) shifted left by 3, with the way's index modulo 8 in the low bits (see
    /// [`rank`] and [`victim`](Self::victim)).
    ranks: Vec<u32>,
    data: Vec<T>,
    aux: Vec<A>,
    /// A direct-mapped table in front of the sets: `front[key & mask]` names the way and
    /// epoch of the last key with those low bits that was used, for as long as it stays
    /// cached. A hit there costs one load and two compares: no hash, no set scan, and no
    /// second load that depends on the first, so its cost barely grows with the cache.
    front: Vec<Front>,
    clock: u32,
    stats: CacheStats,
}

impl<T: Copy + Default, A: Copy + Default> SetAssocCache<T, A> {
    /// A cache of `sets * ways` blocks of `block_len` items, where `sets` is the largest
    /// power of two with `sets * ways * block_bytes <= size_bytes` (at least 1), and never
    /// more entries than `max_blocks` (no point caching more blocks than the image has).
    pub fn new(cfg: CacheConfig, block_len: usize, max_blocks: u64) -> Self {
        let ways = cfg.ways.clamp(1, 64);
        let block_bytes = (block_len * std::mem::size_of::<T>()).max(1) as u64;
        let blocks = (cfg.size_bytes / block_bytes).min(max_blocks.max(1)).max(1);
        let sets = (blocks / ways as u64).max(1);
        let set_bits = 63 - sets.leading_zeros();
        let n = (1usize << set_bits) * ways;
        SetAssocCache {
            ways,
            set_mask: (1 << set_bits) - 1,
            block_len,
            keys: vec![INVALID; n],
            epochs: vec![0; n],
            ranks: (0..n).map(|w| rank(0, w)).collect(),
            data: vec![T::default(); n * block_len],
            aux: vec![A::default(); n],
            front: vec![NO_FRONT; n.next_power_of_two()],
            clock: 0,
            stats: CacheStats::default(),
        }
    }

    /// Number of sets.
    pub fn sets(&self) -> usize {
        self.set_mask as usize + 1
    }
    /// Ways per set.
    pub fn ways(&self) -> usize {
        self.ways
    }
    /// Total number of blocks the cache holds.
    pub fn capacity(&self) -> usize {
        self.keys.len()
    }
    /// Items per block.
    pub fn block_len(&self) -> usize {
        self.block_len
    }
    /// Counters.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// The set a key maps to: its low `set_bits` bits XORed with a multiplicative hash of
    /// the rest. For a fixed rest the low bits run through every set once, so consecutive
    /// keys (sequential slices) fill every set evenly and a cache as large as the image
    /// holds all of it; any other pattern (strides, keys far apart) spreads like a random
    /// hash, with no stride that lands on one set (a plain XOR fold of the key's chunks puts
    /// every multiple of `sets + 1` below `sets²` in set 0; one multiply leaves some strides
    /// on a tenth of the sets, two mix like a random function). Branch-free, a few cycles.
    ///
    /// No shift by a variable amount (three micro-ops each on many x86 cores): the rest is
    /// the key with its low bits cleared, and the top `set_bits` bits of the hash are the
    /// high half of its product with the number of sets.
    #[inline]
    pub fn set_of(&self, key: u64) -> usize {
        let mask = self.set_mask;
        let h = (key & !mask).wrapping_mul(MIX[0]);
        let high = (h ^ h >> 32).wrapping_mul(MIX[1]);
        let top = (u128::from(high) * u128::from(mask + 1)) >> 64;
        ((top as u64 ^ key) & mask) as usize
    }

    #[inline]
    fn front_slot(&self, key: u64) -> usize {
        key as usize & (self.front.len() - 1)
    }

    /// The way holding `key` and its epoch, if cached, and whether the front table named it
    /// (else the set scan found it).
    #[inline(always)]
    fn find(&self, key: u64) -> Option<(usize, u32, bool)> {
        let f = self.front[self.front_slot(key)];
        if f.key == key {
            return Some((f.way as usize, f.epoch, true));
        }
        self.find_in_set(key).map(|w| (w, self.epochs[w], false))
    }

    /// Points `key`'s front slot at `way`, which holds `key` under `epoch`.
    #[inline]
    fn remember(&mut self, key: u64, way: usize, epoch: u32) {
        let s = self.front_slot(key);
        self.front[s] = Front {
            key,
            way: way as u32,
            epoch,
        };
    }

    /// Before `key` leaves its way: clears its front slot if the slot names it.
    fn forget(&mut self, key: u64) {
        let s = self.front_slot(key);
        if self.front[s].key == key {
            self.front[s] = NO_FRONT;
        }
    }

    fn find_in_set(&self, key: u64) -> Option<usize> {
        let base = self.set_of(key) * self.ways;
        // Branchless: a mask of the matching ways (a key is in at most one), so where the
        // key sits in its set is never a mispredicted early exit (ways <= 64).
        let mut mask = 0u64;
        for (i, &k) in self.keys[base..base + self.ways].iter().enumerate() {
            mask |= u64::from(k == key) << i;
        }
        (mask != 0).then(|| base + mask.trailing_zeros() as usize)
    }

    /// A new LRU stamp. Stamps are below [`CLOCK_END`] (less memory on every hit, and
    /// room for a way index beside them in [`victim`](Self::victim)); when the clock runs
    /// out, once per 2^28 look-ups, every set's valid ways are renumbered 1, 2, … in their
    /// LRU order, so nothing is forgotten. Invalid ways keep 0.
    #[inline]
    fn tick(&mut self) -> u32 {
        if self.clock == CLOCK_END - 1 {
            self.restart_clock();
        }
        self.clock += 1;
        self.clock
    }

    #[cold]
    fn restart_clock(&mut self) {
        // On the stack (ways <= 64): a look-up allocates nothing, even this one.
        let mut buf = [(0u32, 0usize); 64];
        let by_age = &mut buf[..self.ways];
        for base in (0..self.ranks.len()).step_by(self.ways) {
            for (i, slot) in by_age.iter_mut().enumerate() {
                *slot = (self.ranks[base + i], base + i);
            }
            by_age.sort_unstable();
            for (stamp, &(old, w)) in (1..).zip(by_age.iter()) {
                if old >> 3 != 0 {
                    self.ranks[w] = rank(stamp, w);
                }
            }
        }
        self.clock = self.ways as u32;
    }

    /// Looks `key` up under `epoch`: `Some(way)` on a hit (and the way becomes most recently
    /// used), `None` on a miss. Counts the result.
    #[inline]
    pub fn lookup(&mut self, key: u64, epoch: u32) -> Option<usize> {
        match self.find(key) {
            Some((way, e, in_front)) if e == epoch => {
                self.touch(Hit { way, key, in_front });
                Some(way)
            }
            Some(_) => {
                self.stats.stale += 1;
                self.stats.misses += 1;
                None
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Like [`lookup`](Self::lookup) but changes nothing (no counters, no LRU update): the
    /// hit, for the caller to [`touch`](Self::touch) once it used the block.
    #[inline]
    pub fn probe(&self, key: u64, epoch: u32) -> Option<Hit> {
        let (way, e, in_front) = self.find(key)?;
        (e == epoch).then_some(Hit { way, key, in_front })
    }

    /// The way holding `key` under any epoch (no counters, no LRU update): for prefetch
    /// hints only, never for using the contents.
    pub fn peek(&self, key: u64) -> Option<usize> {
        self.find(key).map(|(w, ..)| w)
    }

    /// The epoch `key` is cached under, if cached (no counters, no LRU update).
    pub fn peek_epoch(&self, key: u64) -> Option<u32> {
        self.find(key).map(|(_, e, _)| e)
    }

    /// Commits a [`probe`](Self::probe): marks its way most recently used and counts a hit;
    /// when the probe found the way through the set scan, points the front table at it —
    /// only if the way still holds the key (a hit kept across changes to the cache never
    /// makes the front table name a way that lost its key).
    #[inline(always)]
    pub fn touch(&mut self, hit: Hit) {
        let stamp = self.tick();
        self.ranks[hit.way] = rank(stamp, hit.way);
        self.stats.hits += 1;
        if !hit.in_front {
            self.remember_found(hit);
        }
    }

    /// [`touch`](Self::touch)'s front-table update for a hit the set scan found.
    #[cold]
    fn remember_found(&mut self, hit: Hit) {
        if self.keys[hit.way] == hit.key {
            self.remember(hit.key, hit.way, self.epochs[hit.way]);
        }
    }

    /// The block stored in `way`.
    #[inline]
    pub fn block(&self, way: usize) -> &[T] {
        &self.data[way * self.block_len..(way + 1) * self.block_len]
    }

    /// The block stored in `way`, for in-place updates that keep the replica in step with
    /// the owner's dirty copy (the caller keeps the way's summary in step too).
    pub fn block_mut(&mut self, way: usize) -> &mut [T] {
        &mut self.data[way * self.block_len..(way + 1) * self.block_len]
    }

    /// The summary of the block in `way` (`A::default()` until its user sets one).
    #[inline]
    pub fn aux(&self, way: usize) -> A {
        self.aux[way]
    }

    /// Sets the summary of the block in `way`.
    pub fn set_aux(&mut self, way: usize, a: A) {
        self.aux[way] = a;
    }

    /// The way `insert` fills for a key not cached: an invalid way if the set has one,
    /// else its least recently used way, i.e. the smallest rank (invalid ways have stamp 0,
    /// valid ones distinct stamps). No key is compared. For 8 ways (the default) without
    /// branches: the smallest rank wins, as a tree of minimums, and its low bits name the
    /// way (see [`rank`]).
    #[inline(always)]
    pub fn victim(&self, key: u64) -> usize {
        let base = self.set_of(key) * self.ways;
        let ranks = &self.ranks[base..base + self.ways];
        let best = if let Ok(r) = <&[u32; 8]>::try_from(ranks) {
            // Signed: ranks stay below 2^31, and SSE2 compares signed words only.
            let r = r.map(|x| x as i32);
            let m: [i32; 4] = std::array::from_fn(|i| r[i].min(r[i + 4]));
            (m[0].min(m[2]).min(m[1].min(m[3])) & 7) as usize
        } else {
            (0..self.ways).min_by_key(|&i| ranks[i]).unwrap_or(0)
        };
        base + best
    }

    /// Stores `block` under `key` read at `epoch`: in the way already holding `key`, else
    /// in the [`victim`](Self::victim). Returns the way. `fill` writes the block contents in
    /// place (no temporary copy).
    pub fn insert_with(&mut self, key: u64, epoch: u32, fill: impl FnOnce(&mut [T])) -> usize {
        let w = match self.find(key) {
            Some((w, ..)) => w,
            None => self.victim(key),
        };
        let old = self.keys[w];
        if old != INVALID && old != key {
            self.stats.evictions += 1;
        }
        self.forget(old);
        self.keys[w] = key;
        self.epochs[w] = epoch;
        let stamp = self.tick();
        self.ranks[w] = rank(stamp, w);
        self.aux[w] = A::default();
        self.remember(key, w, epoch);
        fill(&mut self.data[w * self.block_len..(w + 1) * self.block_len]);
        w
    }

    /// Drops `key` if cached.
    pub fn invalidate(&mut self, key: u64) {
        if let Some((w, ..)) = self.find(key) {
            self.forget(key);
            self.keys[w] = INVALID;
            self.epochs[w] = 0;
            self.ranks[w] = rank(0, w);
        }
    }

    /// Drops everything.
    pub fn clear(&mut self) {
        self.keys.fill(INVALID);
        self.epochs.fill(0);
        for (w, r) in self.ranks.iter_mut().enumerate() {
            *r = rank(0, w);
        }
        self.front.fill(NO_FRONT);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(sets: u64, ways: usize) -> SetAssocCache<u64> {
        SetAssocCache::new(
            CacheConfig {
                size_bytes: sets * ways as u64 * 64,
                ways,
            },
            8,
            u64::MAX,
        )
    }

    /// `n` distinct keys that all map to the set of `key0`.
    fn same_set(c: &SetAssocCache<u64>, key0: u64, n: usize) -> Vec<u64> {
        let s = c.set_of(key0);
        (0..).filter(|k| c.set_of(*k) == s).take(n).collect()
    }

    #[test]
    fn sizing() {
        let c = cache(16, 8);
        assert_eq!(c.sets(), 16);
        assert_eq!(c.capacity(), 128);
        // Never more blocks than the image has.
        let c = SetAssocCache::<u64>::new(
            CacheConfig {
                size_bytes: 1 << 30,
                ways: 8,
            },
            8,
            20,
        );
        assert!(c.capacity() <= 20);
        // Non-power-of-two budgets round down.
        let c = SetAssocCache::<u64>::new(
            CacheConfig {
                size_bytes: 64 * 8 * 5,
                ways: 8,
            },
            8,
            u64::MAX,
        );
        assert_eq!(c.sets(), 4);
    }

    #[test]
    fn set_mapping_spreads_sequential_keys() {
        let c = cache(64, 4);
        let mut counts = vec![0; c.sets()];
        for k in 0..64 * 16 {
            counts[c.set_of(k)] += 1;
        }
        assert!(counts.iter().all(|&n| n == 16), "{counts:?}");
        // Strides spread like a random hash: no stride piles onto a few sets, including
        // `sets + 1`, which a plain XOR fold of the key's chunks sends all to set 0.
        for stride in [64u64, 65, 63, 4096, 1 << 20, 3 << 30] {
            let mut used = vec![false; c.sets()];
            for i in 0..64u64 {
                used[c.set_of(i * stride)] = true;
            }
            let n = used.iter().filter(|&&u| u).count();
            assert!(n >= 32, "stride {stride}: {n} of 64 sets");
        }
        // One set: everything maps to it.
        let one = cache(1, 4);
        assert!([0, 1, u64::MAX - 1].iter().all(|&k| one.set_of(k) == 0));
    }

    #[test]
    fn hit_miss_and_counters() {
        let mut c = cache(4, 2);
        assert_eq!(c.lookup(7, 0), None);
        let w = c.insert_with(7, 0, |b| b.fill(42));
        assert_eq!(c.lookup(7, 0), Some(w));
        assert!(c.block(w).iter().all(|&x| x == 42));
        // A different epoch is a (stale) miss.
        assert_eq!(c.lookup(7, 2), None);
        assert_eq!(
            c.stats(),
            CacheStats {
                hits: 1,
                misses: 2,
                evictions: 0,
                stale: 1
            }
        );
    }

    #[test]
    fn invalid_ways_first_then_lru() {
        let mut c = cache(4, 4);
        let keys = same_set(&c, 0, 6);
        for &k in &keys[..4] {
            c.insert_with(k, 0, |_| {});
        }
        assert_eq!(c.stats().evictions, 0);
        // Invalidate one: the next insert must reuse that way, evicting nothing.
        let w1 = c.probe(keys[1], 0).unwrap().way;
        c.invalidate(keys[1]);
        assert_eq!(c.insert_with(keys[4], 0, |_| {}), w1);
        assert_eq!(c.stats().evictions, 0);
        // Touch keys[0]; LRU is now keys[2].
        assert!(c.lookup(keys[0], 0).is_some());
        let w2 = c.probe(keys[2], 0).unwrap().way;
        assert_eq!(c.insert_with(keys[5], 0, |_| {}), w2);
        assert_eq!(c.stats().evictions, 1);
        assert!(c.probe(keys[2], 0).is_none());
        assert!(c.probe(keys[0], 0).is_some());
        assert!(c.probe(keys[3], 0).is_some());
    }

    #[test]
    fn a_stale_probe_never_reaches_the_front_table() {
        // One set of 2 ways, front slots by the key's lowest bit: 0, 2 and 4 share slot 0.
        let mut c = cache(1, 2);
        let (a, b, k) = (0, 2, 4);
        let wa = c.insert_with(a, 0, |x| x.fill(a));
        c.insert_with(b, 0, |x| x.fill(b));
        // The front slot names b, so a probe of a finds it through the set: a hit whose
        // touch would point the front slot at a. It is kept, not touched yet.
        let stale = c.probe(a, 0);
        assert_eq!(stale.map(|h| h.way), Some(wa));
        // a is the least recently used: k replaces it.
        assert_eq!(c.insert_with(k, 0, |x| x.fill(k)), wa);
        // Neither a probe of k (through the front slot) and its touch nor, after them, a
        // touch of that stale hit may bring back a.
        let hk = c.probe(k, 0).unwrap();
        assert_eq!(hk.way, wa);
        c.touch(hk);
        c.touch(stale.unwrap());
        assert_eq!(c.lookup(a, 0), None);
        assert_eq!(c.peek(a), None);
        assert_eq!(c.block(c.probe(k, 0).unwrap().way)[0], k);
    }

    #[test]
    fn reinsert_same_key_does_not_evict() {
        let mut c = cache(1, 2);
        let w = c.insert_with(1, 0, |b| b.fill(1));
        assert_eq!(c.insert_with(1, 2, |b| b.fill(2)), w);
        assert_eq!(c.stats().evictions, 0);
        assert_eq!(c.lookup(1, 2), Some(w));
        assert_eq!(c.block(w)[0], 2);
    }

    use proptest::prelude::*;

    /// What a cache operation does in [`the_front_hint_never_misleads`].
    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, u32),
        Lookup(u64, u32),
        ProbeTouch(u64, u32),
        /// A probe whose touch comes later (after other operations), if at all.
        Probe(u64, u32),
        /// Touches the way the last `Probe` found, if any.
        TouchLast,
        Invalidate(u64),
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        // Keys in a small range (many share a set and a front slot) and far apart ones
        // with the same low bits (same front slot, other sets).
        let key = prop_oneof![0u64..48, (0u64..4).prop_map(|k| k << 20 | 5)];
        prop_oneof![
            (key.clone(), 0u32..3).prop_map(|(k, e)| Op::Insert(k, e)),
            (key.clone(), 0u32..3).prop_map(|(k, e)| Op::Lookup(k, e)),
            (key.clone(), 0u32..3).prop_map(|(k, e)| Op::ProbeTouch(k, e)),
            (key.clone(), 0u32..3).prop_map(|(k, e)| Op::Probe(k, e)),
            Just(Op::TouchLast),
            key.prop_map(Op::Invalidate),
            Just(Op::Clear),
        ]
    }

    /// What an operation on one set does in [`exact_lru_in_every_set_shape`].
    #[derive(Debug, Clone)]
    enum SetOp {
        /// Inserts the key with this index in the set's key list.
        Insert(usize),
        /// Looks up (and on a hit touches) the key with this index.
        Lookup(usize),
        Invalidate(usize),
        Clear,
    }

    fn set_op() -> impl Strategy<Value = SetOp> {
        prop_oneof![
            4 => (0usize..32).prop_map(SetOp::Insert),
            4 => (0usize..32).prop_map(SetOp::Lookup),
            1 => (0usize..32).prop_map(SetOp::Invalidate),
            1 => Just(SetOp::Clear),
        ]
    }

    proptest! {
        /// Every set shape (1 to 24 ways, one or several sets) replaces exactly as
        /// an LRU list does: an insert of a key not cached evicts an invalid way if the set
        /// has one, else the least recently used (inserted or hit) key; the model tracks the
        /// keys of one set, most recent first.
        #[test]
        fn exact_lru_in_every_set_shape(
            ways in 1usize..=24,
            sets in prop_oneof![Just(1u64), Just(4)],
            ops in proptest::collection::vec(set_op(), 1..300),
            clock in prop_oneof![Just(0u32), Just(CLOCK_END - 40)],
        ) {
            let mut c = cache(sets, ways);
            // Half the runs start near the clock's end: LRU order survives its restart.
            c.clock = clock;
            prop_assert_eq!(c.ways(), ways);
            let keys = same_set(&c, 3, 32);
            let mut lru: Vec<u64> = Vec::new();
            for o in ops {
                match o {
                    SetOp::Insert(i) => {
                        let k = keys[i];
                        let before = c.stats().evictions;
                        let victim = if lru.contains(&k) || lru.len() < ways {
                            None
                        } else {
                            lru.last().copied()
                        };
                        let w = c.insert_with(k, 0, |b| b.fill(k));
                        if let Some(v) = victim {
                            prop_assert_eq!(c.peek(v), None, "{} should be evicted", v);
                            prop_assert_eq!(c.stats().evictions, before + 1);
                            lru.pop();
                        } else {
                            prop_assert_eq!(c.stats().evictions, before);
                        }
                        lru.retain(|&x| x != k);
                        lru.insert(0, k);
                        prop_assert_eq!(c.block(w)[0], k);
                    }
                    SetOp::Lookup(i) => {
                        let k = keys[i];
                        let got = c.lookup(k, 0);
                        prop_assert_eq!(got.is_some(), lru.contains(&k));
                        if got.is_some() {
                            lru.retain(|&x| x != k);
                            lru.insert(0, k);
                        }
                    }
                    SetOp::Invalidate(i) => {
                        c.invalidate(keys[i]);
                        lru.retain(|&x| x != keys[i]);
                    }
                    SetOp::Clear => {
                        c.clear();
                        lru.clear();
                    }
                }
                for &k in &lru {
                    prop_assert!(c.peek(k).is_some(), "{} lost", k);
                }
            }
        }

        /// With the direct-mapped front hint, every look-up answers exactly what the cache
        /// holds: a model map of the keys still cached (an insert may evict: the model
        /// follows the cache's own report) agrees on presence, epoch and block contents.
        #[test]
        fn the_front_hint_never_misleads(ops in proptest::collection::vec(op(), 1..200)) {
            let mut c = cache(4, 4);
            let mut model = std::collections::HashMap::<u64, (u32, u64)>::new();
            let mut last = None;
            for o in ops {
                match o {
                    Op::Insert(k, e) => {
                        let w = c.insert_with(k, e, |b| b.fill(k * 10 + u64::from(e)));
                        // Whatever the way held before is gone.
                        model.retain(|_, v| v.1 != w as u64);
                        model.insert(k, (e, w as u64));
                    }
                    Op::Lookup(k, e) => {
                        let got = c.lookup(k, e);
                        let want = model.get(&k).filter(|v| v.0 == e).map(|v| v.1 as usize);
                        prop_assert_eq!(got, want);
                        if let Some(w) = got {
                            prop_assert_eq!(c.block(w)[0], k * 10 + u64::from(e));
                        }
                    }
                    Op::ProbeTouch(k, e) => {
                        let got = c.probe(k, e);
                        prop_assert_eq!(got.map(|h| h.way), model.get(&k).filter(|v| v.0 == e).map(|v| v.1 as usize));
                        prop_assert_eq!(c.peek_epoch(k), model.get(&k).map(|v| v.0));
                        if let Some(h) = got {
                            c.touch(h);
                        }
                    }
                    Op::Probe(k, e) => {
                        last = c.probe(k, e);
                        prop_assert_eq!(last.map(|h| h.way), model.get(&k).filter(|v| v.0 == e).map(|v| v.1 as usize));
                    }
                    Op::TouchLast => {
                        if let Some(h) = last.take() {
                            c.touch(h);
                        }
                    }
                    Op::Invalidate(k) => {
                        c.invalidate(k);
                        model.remove(&k);
                    }
                    Op::Clear => {
                        c.clear();
                        model.clear();
                    }
                }
            }
        }
    }
}
