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
            // Allocated by the first insert: a backing layer of a deep chain that is
            // never read keeps no blocks (`insert_evicting`).
            data: Vec::new(),
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
        if self.data.is_empty() {
            self.data = vec![T::default(); self.slots.len() * self.block_len];
        }
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
mod tests;
