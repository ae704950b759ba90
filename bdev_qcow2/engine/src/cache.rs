//! A set-associative cache of fixed-size metadata blocks (L2 slices, refcount blocks).
//!
//! `set = hash(key) & (sets - 1)`; each set has `ways` entries stored flat, so lookup and
//! victim choice cost O(ways) whatever the cache size. Victim: an invalid way first, else
//! the least recently used way of the set. Each way remembers the epoch its contents were
//! read under; a lookup hits only when the caller's current epoch matches, which is how a
//! per-core replica is validated against the metadata owner (ARCHITECTURE.md §6).
//!
//! Everything a hit reads and writes about a way (its key, epoch and LRU rank) lies in one
//! 16-byte [`Slot`], so a hit touches one cache line of metadata however large the cache.
//! Each key has a **home** way in its set, chosen by the key bits just above the set bits
//! (for consecutive keys, which fill every set evenly, the keys of a set all have distinct
//! homes). An insert puts the key in its home and moves the home's occupant, with its LRU
//! stamp, its summary and its block, to the victim way; so a hit checks the home slot
//! first, and scans the set only for a key whose home another key took.

/// Key value marking an invalid way.
const INVALID: u64 = u64::MAX;

/// Odd 64-bit multipliers (2^64 / golden ratio; murmur3's) for the hash in [`set_of`].
///
/// [`set_of`]: SetAssocCache::set_of
const MIX: [u64; 2] = [0x9E37_79B9_7F4A_7C15, 0xC2B2_AE3D_27D4_EB4F];

/// One way's metadata: everything a hit reads (key, epoch) and writes (rank), in 16 bytes
/// aligned to 16, so it never straddles a cache line.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(16))]
struct Slot {
    key: u64,
    epoch: u32,
    /// The LRU rank: the way's stamp (below [`CLOCK_END`]: see [`tick`](SetAssocCache::tick);
    /// 0 for an invalid way) shifted left by 3, with the way's index modulo 8 in the low
    /// bits (see [`rank`] and [`victim`](SetAssocCache::victim)).
    rank: u32,
}

impl Slot {
    /// The invalid way `way`.
    fn empty(way: usize) -> Slot {
        Slot {
            key: INVALID,
            epoch: 0,
            rank: rank(0, way),
        }
    }
}

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
    /// log2 of the number of sets.
    set_bits: u32,
    /// `64 - set_bits`: the shift that leaves the top `set_bits` bits of a hash (see
    /// [`set_of`](Self::set_of)).
    top_shift: u32,
    /// The homes per set minus 1: the largest power of two not above `ways`, minus 1 (the
    /// homes are the first ways of a set; all of them for a power of two).
    home_mask: u64,
    block_len: usize,
    slots: Vec<Slot>,
    data: Vec<T>,
    aux: Vec<A>,
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
            set_bits,
            top_shift: 64 - set_bits,
            home_mask: (1 << (usize::BITS - 1 - ways.leading_zeros())) - 1,
            block_len,
            slots: (0..n).map(Slot::empty).collect(),
            data: vec![T::default(); n * block_len],
            aux: vec![A::default(); n],
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
        self.slots.len()
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
    /// on a tenth of the sets, two mix like a random function). Branch-free, a few cycles;
    /// the top `set_bits` bits of the hash are taken by one shift (which wraps to none for
    /// one set, where the mask leaves 0).
    #[inline(always)]
    pub fn set_of(&self, key: u64) -> usize {
        let mask = self.set_mask;
        let h = (key & !mask).wrapping_mul(MIX[0]);
        let high = (h ^ h >> 32).wrapping_mul(MIX[1]);
        ((high.wrapping_shr(self.top_shift) ^ key) & mask) as usize
    }

    /// `key`'s set and its home way: the set's way numbered by the key bits just above the
    /// set bits, among its first `home_mask + 1` ways. Consecutive keys that share a set
    /// differ there, so in a cache covering them (with a power-of-two number of ways) each
    /// key has its own home, and a hit reads one slot.
    #[inline(always)]
    fn locate(&self, key: u64) -> (usize, usize) {
        let set = self.set_of(key);
        let home = (key >> self.set_bits & self.home_mask) as usize;
        (set, set * self.ways + home)
    }

    /// The way holding `key` and its epoch, if cached: its home slot, else a scan of its set.
    #[inline(always)]
    fn find(&self, key: u64) -> Option<(usize, u32)> {
        let (set, home) = self.locate(key);
        let s = self.slots[home];
        if s.key == key {
            return Some((home, s.epoch));
        }
        self.find_in_set(key, set * self.ways)
            .map(|w| (w, self.slots[w].epoch))
    }

    fn find_in_set(&self, key: u64, base: usize) -> Option<usize> {
        // Branchless: a mask of the matching ways (a key is in at most one), so where the
        // key sits in its set is never a mispredicted early exit (ways <= 64).
        let mut mask = 0u64;
        for (i, s) in self.slots[base..base + self.ways].iter().enumerate() {
            mask |= u64::from(s.key == key) << i;
        }
        (mask != 0).then(|| base + mask.trailing_zeros() as usize)
    }

    /// A new LRU stamp. Stamps are below [`CLOCK_END`] (room for a way index beside them in
    /// [`victim`](Self::victim)); when the clock runs out, once per 2^28 look-ups, every
    /// set's valid ways are renumbered 1, 2, … in their LRU order, so nothing is forgotten.
    /// Invalid ways keep 0.
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
        for base in (0..self.slots.len()).step_by(self.ways) {
            for (i, slot) in by_age.iter_mut().enumerate() {
                *slot = (self.slots[base + i].rank, base + i);
            }
            by_age.sort_unstable();
            for (stamp, &(old, w)) in (1..).zip(by_age.iter()) {
                if old >> 3 != 0 {
                    self.slots[w].rank = rank(stamp, w);
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
            Some((way, e)) if e == epoch => {
                self.touch(Hit { way, key });
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
        let (way, e) = self.find(key)?;
        (e == epoch).then_some(Hit { way, key })
    }

    /// The hit for `key` under whatever epoch it is cached, with that epoch (no counters,
    /// no LRU update): for a caller that validates an older copy by other means.
    #[inline]
    pub fn probe_any(&self, key: u64) -> Option<(Hit, u32)> {
        self.find(key).map(|(way, e)| (Hit { way, key }, e))
    }

    /// The way holding `key` under any epoch (no counters, no LRU update): for prefetch
    /// hints only, never for using the contents.
    pub fn peek(&self, key: u64) -> Option<usize> {
        self.find(key).map(|(w, _)| w)
    }

    /// The epoch `key` is cached under, if cached (no counters, no LRU update).
    pub fn peek_epoch(&self, key: u64) -> Option<u32> {
        self.find(key).map(|(_, e)| e)
    }

    /// Commits a [`probe`](Self::probe): marks its way most recently used and counts a hit.
    /// A hit kept across changes to the cache ranks its way only if the way still holds the
    /// key (an invalid way keeps stamp 0, so it stays the first victim of its set).
    #[inline(always)]
    pub fn touch(&mut self, hit: Hit) {
        if self.slots.get(hit.way).is_some_and(|s| s.key == hit.key) {
            self.touch_fresh(hit);
        } else {
            self.stats.hits += 1;
        }
    }

    /// [`touch`](Self::touch) for a hit taken in the same borrow of the cache, with no
    /// change to it since (the way still holds the key: no check).
    #[inline(always)]
    pub fn touch_fresh(&mut self, hit: Hit) {
        let stamp = self.tick();
        if let Some(s) = self.slots.get_mut(hit.way) {
            s.rank = rank(stamp, hit.way);
        }
        self.stats.hits += 1;
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

    /// The way whose contents an insert of a key not cached replaces: an invalid way if the
    /// set has one, else its least recently used way, i.e. the smallest rank (invalid ways
    /// have stamp 0, valid ones distinct stamps). No key is compared. For 8 ways (the
    /// default) without branches: the smallest rank wins, as a tree of minimums, and its
    /// low bits name the way (see [`rank`]).
    #[inline(always)]
    pub fn victim(&self, key: u64) -> usize {
        self.victim_in(self.set_of(key) * self.ways)
    }

    #[inline(always)]
    fn victim_in(&self, base: usize) -> usize {
        let set = &self.slots[base..base + self.ways];
        let best = if let Ok(s) = <&[Slot; 8]>::try_from(set) {
            // Signed: ranks stay below 2^31, and SSE2 compares signed words only.
            let r = s.map(|x| x.rank as i32);
            let m: [i32; 4] = std::array::from_fn(|i| r[i].min(r[i + 4]));
            (m[0].min(m[2]).min(m[1].min(m[3])) & 7) as usize
        } else {
            (0..self.ways).min_by_key(|&i| set[i].rank).unwrap_or(0)
        };
        base + best
    }

    /// Stores `block` under `key` read at `epoch` and returns its way: the way already
    /// holding `key`, else `key`'s home. The [`victim`](Self::victim)'s contents leave; when
    /// the victim is not the home and the home holds a key, that key moves to the victim's
    /// way with its epoch, LRU stamp, summary and block. `fill` writes the block contents in
    /// place (no temporary copy). Ways returned earlier may name other keys afterwards.
    pub fn insert_with(&mut self, key: u64, epoch: u32, fill: impl FnOnce(&mut [T])) -> usize {
        self.insert_evicting(key, epoch, fill).0
    }

    /// [`insert_with`](Self::insert_with), also naming the key that left the cache to make
    /// room (`None` when an invalid way or `key`'s own way was taken).
    pub fn insert_evicting(
        &mut self,
        key: u64,
        epoch: u32,
        fill: impl FnOnce(&mut [T]),
    ) -> (usize, Option<u64>) {
        let mut evicted = None;
        let w = match self.find(key) {
            Some((w, _)) => w,
            None => {
                let (set, home) = self.locate(key);
                let v = self.victim_in(set * self.ways);
                if self.slots[v].key != INVALID {
                    self.stats.evictions += 1;
                    evicted = Some(self.slots[v].key);
                }
                if v != home && self.slots[home].key != INVALID {
                    // The home's occupant moves to the victim's way, keeping its place in
                    // the LRU order.
                    let mut moved = self.slots[home];
                    moved.rank = rank(moved.rank >> 3, v);
                    self.slots[v] = moved;
                    self.aux[v] = self.aux[home];
                    let bl = self.block_len;
                    self.data.copy_within(home * bl..(home + 1) * bl, v * bl);
                }
                home
            }
        };
        let stamp = self.tick();
        self.slots[w] = Slot {
            key,
            epoch,
            rank: rank(stamp, w),
        };
        self.aux[w] = A::default();
        fill(&mut self.data[w * self.block_len..(w + 1) * self.block_len]);
        (w, evicted)
    }

    /// Drops `key` if cached.
    pub fn invalidate(&mut self, key: u64) {
        if let Some((w, _)) = self.find(key) {
            self.slots[w] = Slot::empty(w);
        }
    }

    /// Drops everything.
    pub fn clear(&mut self) {
        for (w, s) in self.slots.iter_mut().enumerate() {
            *s = Slot::empty(w);
        }
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
        // Invalidate one: the next insert must take that way (moving another key to it if
        // the new key's home is elsewhere), evicting nothing.
        c.invalidate(keys[1]);
        assert_eq!(c.insert_evicting(keys[4], 0, |_| {}).1, None);
        assert_eq!(c.stats().evictions, 0);
        for k in [keys[0], keys[2], keys[3], keys[4]] {
            assert!(c.probe(k, 0).is_some(), "{k}");
        }
        // Touch keys[0]; LRU is now keys[2].
        assert!(c.lookup(keys[0], 0).is_some());
        assert_eq!(c.insert_evicting(keys[5], 0, |_| {}).1, Some(keys[2]));
        assert_eq!(c.stats().evictions, 1);
        // Re-inserting a cached key evicts nothing.
        assert_eq!(c.insert_evicting(keys[5], 0, |_| {}).1, None);
        assert!(c.probe(keys[2], 0).is_none());
        for k in [keys[0], keys[3], keys[4], keys[5]] {
            assert!(c.probe(k, 0).is_some(), "{k}");
        }
    }

    #[test]
    fn a_stale_hit_never_ranks_another_way() {
        // One set of 2 ways: keys a and b with homes 0 and 1, and k another with home 1.
        let mut c = cache(1, 2);
        let home = |c: &SetAssocCache<u64>, h: usize| (0..).find(move |&k| c.locate(k).1 == h);
        let (a, b) = (home(&c, 0).unwrap(), home(&c, 1).unwrap());
        let k = (b + 1..).find(|&k| c.locate(k).1 == 1).unwrap();
        assert_eq!(c.insert_with(a, 0, |x| x.fill(a)), 0);
        assert_eq!(c.insert_with(b, 0, |x| x.fill(b)), 1);
        // A hit on a, kept (not touched yet) while a leaves: k replaces a, the least
        // recently used, and b moves from k's home to a's way.
        let stale = c.probe(a, 0).unwrap();
        assert_eq!(c.insert_with(k, 0, |x| x.fill(k)), 1);
        assert_eq!(c.peek(b), Some(stale.way));
        assert_eq!(c.block(stale.way)[0], b);
        // Touching the stale hit must not make b the most recently used: b stays the
        // victim, and k stays.
        c.touch(stale);
        let m = (k + 1..).find(|&m| m != a).unwrap();
        c.insert_with(m, 0, |x| x.fill(m));
        assert_eq!(c.peek(b), None);
        assert_eq!(c.peek(a), None);
        assert_eq!(c.block(c.probe(k, 0).unwrap().way)[0], k);

        // A hit kept while its key is invalidated: touching it leaves the way invalid with
        // stamp 0, so the next insert takes it and evicts nothing.
        let mut c = cache(1, 2);
        c.insert_with(a, 0, |x| x.fill(a));
        c.insert_with(b, 0, |x| x.fill(b));
        let stale = c.probe(a, 0).unwrap();
        c.invalidate(a);
        c.touch(stale);
        c.insert_with(2, 0, |x| x.fill(2));
        assert_eq!(c.stats().evictions, 0);
        assert!(c.probe(b, 0).is_some() && c.probe(2, 0).is_some());
    }

    #[test]
    fn a_fresh_touch_ranks_its_way_and_counts_a_hit() {
        // One set of 2 ways holding a and b, a the least recently used: a fresh touch of a
        // makes b the victim, as `touch` does.
        let mut c = cache(1, 2);
        let home = |c: &SetAssocCache<u64>, h: usize| (0..).find(move |&k| c.locate(k).1 == h);
        let (a, b) = (home(&c, 0).unwrap(), home(&c, 1).unwrap());
        c.insert_with(a, 0, |x| x.fill(a));
        c.insert_with(b, 0, |x| x.fill(b));
        let hits = c.stats().hits;
        let hit = c.probe(a, 0).unwrap();
        c.touch_fresh(hit);
        assert_eq!(c.stats().hits, hits + 1);
        assert_eq!(c.victim(b + 1), c.peek(b).unwrap());
        let m = (b + 1..).find(|&m| m != a).unwrap();
        c.insert_with(m, 0, |x| x.fill(m));
        assert_eq!(c.peek(b), None);
        assert_eq!(c.block(c.probe(a, 0).unwrap().way)[0], a);
    }

    #[test]
    fn consecutive_keys_sit_in_their_homes() {
        // A cache as large as the keys holds them all; with a power-of-two number of ways
        // every key is found in its home slot, none by a scan of its set (so a hit reads
        // one slot).
        for ways in [1, 2, 4, 6, 8, 16] {
            let mut c = cache(64, ways);
            let n = c.capacity() as u64;
            for k in 0..n {
                c.insert_with(k, 0, |x| x.fill(k));
            }
            assert_eq!(c.stats().evictions, 0, "{ways} ways");
            for k in 0..n {
                let w = c.peek(k).unwrap();
                assert_eq!(c.block(w)[0], k);
                if ways.is_power_of_two() {
                    assert_eq!(w, c.locate(k).1, "{ways} ways, key {k}");
                }
            }
        }
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

    /// What a cache operation does in [`lookups_answer_what_the_cache_holds`].
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
        // Keys in a small range (many share a set and a home) and far apart ones with the
        // same low bits (other sets, often the same home).
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

        /// Every look-up answers exactly what the cache holds, while inserts move keys from
        /// their homes: a model map of the keys still cached (an insert evicts at most one,
        /// and the model follows the cache's own report of which) agrees on presence, epoch
        /// and block contents.
        #[test]
        fn lookups_answer_what_the_cache_holds(ops in proptest::collection::vec(op(), 1..200)) {
            let mut c = cache(4, 4);
            let mut model = std::collections::HashMap::<u64, u32>::new();
            let fill = |k: u64, e: u32| k * 10 + u64::from(e);
            let mut last = None;
            for o in ops {
                match o {
                    Op::Insert(k, e) => {
                        let before = c.stats().evictions;
                        let w = c.insert_with(k, e, |b| b.fill(fill(k, e)));
                        prop_assert_eq!(c.block(w)[0], fill(k, e));
                        model.insert(k, e);
                        let gone: Vec<u64> =
                            model.keys().copied().filter(|&x| c.peek(x).is_none()).collect();
                        prop_assert!(gone.len() <= 1, "{:?} evicted at once", gone);
                        prop_assert_eq!(c.stats().evictions - before, gone.len() as u64);
                        for x in gone {
                            model.remove(&x);
                        }
                    }
                    Op::Lookup(k, e) => {
                        let got = c.lookup(k, e);
                        prop_assert_eq!(got.is_some(), model.get(&k) == Some(&e));
                        if let Some(w) = got {
                            prop_assert_eq!(c.block(w)[0], fill(k, e));
                        }
                    }
                    Op::ProbeTouch(k, e) => {
                        let got = c.probe(k, e);
                        prop_assert_eq!(got.is_some(), model.get(&k) == Some(&e));
                        prop_assert_eq!(c.peek_epoch(k), model.get(&k).copied());
                        if let Some(h) = got {
                            prop_assert_eq!(c.block(h.way)[0], fill(k, e));
                            c.touch(h);
                        }
                    }
                    Op::Probe(k, e) => {
                        last = c.probe(k, e);
                        prop_assert_eq!(last.is_some(), model.get(&k) == Some(&e));
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
                // Every key the model holds is where a look-up finds it, with its block.
                for (&k, &e) in &model {
                    let w = c.peek(k);
                    prop_assert!(w.is_some(), "{} lost", k);
                    prop_assert_eq!(c.block(w.unwrap_or(0))[0], fill(k, e));
                }
            }
        }
    }
}
