//! Unit tests of the set-associative cache.

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
