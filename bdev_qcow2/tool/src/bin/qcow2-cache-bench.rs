#![forbid(unsafe_code)]
#![allow(clippy::expect_used, clippy::unwrap_used)] // a benchmark: abort on setup failure

//! L2 slice cache benchmark (issue 5's figures): the per-core set-associative cache
//! (`qcow2_engine::cache::SetAssocCache`, ARCHITECTURE.md §4) at 256, 4096 and 65536 cached 4 KiB
//! slices (8 ways), against a QEMU-style cache that scans every entry.
//!
//! - Hit: `probe` + `touch` + one word of the slice, as `Qcow2::resolve_cached` does, with
//!   keys drawn at random from the resident set; also the metadata alone and, as the floor,
//!   one random word of a plain array as large as the cached slices. Each both with
//!   independent lookups (throughput) and with each key depending on the word read before
//!   (latency: no overlap of memory misses). And hits on keys that are not in their home
//!   way (keys sharing one home), which scan the set: the set-associative look-up itself.
//! - Miss: `lookup` (miss) + `insert_with` of a 4 KiB slice, as `load_slice` does; also
//!   without the copy, `lookup` + `victim`, and each of them alone.
//! - QEMU-style reference: `qcow2_cache_do_get` (block/qcow2-cache.c) modelled: a circular
//!   scan of all entries from a hint, looking for the key and for the least recently used
//!   unreferenced entry; then `qcow2_cache_put` bumps the LRU counter.
//!
//! Each figure is the median of `--rounds` timed rounds after a warm-up (`--min`: the
//! fastest round, steadier on a loaded machine).

use clap::Parser;
use qcow2_engine::cache::{CacheConfig, SetAssocCache};
use qcow2_tool::rng::Rng;
use std::hint::black_box;
use std::time::Instant;

/// u64 words per 4 KiB slice.
const SLICE_WORDS: usize = 512;
const WAYS: usize = 8;
const SIZES: [usize; 3] = [256, 4096, 65536];
/// The QEMU-style model's keys that miss are 21-bit slice ids: a 64 TiB disk with 64 KiB clusters (32 MiB per
/// slice) has 2^21 slices.
const KEY_BITS: u32 = 21;

#[derive(Parser)]
#[command(about = "qcow2 L2 slice cache benchmark (set-associative vs full scan)")]
struct Args {
    /// Timed rounds per figure (the median is reported).
    #[arg(long, default_value_t = 7)]
    rounds: usize,
    /// Target length of one round, in milliseconds.
    #[arg(long, default_value_t = 20)]
    round_ms: u64,
    /// Report the fastest round instead of the median (for a loaded machine).
    #[arg(long)]
    min: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// Runs `op` repeatedly: a warm-up that also sizes the rounds, then `rounds` timed rounds.
/// Returns the median (or, with `--min`, the smallest) nanoseconds per call.
fn measure(a: &Args, mut op: impl FnMut(&mut Rng) -> u64) -> f64 {
    let round_ns = a.round_ms as u128 * 1_000_000;
    let mut rng = Rng::new(0x5eed_cafe_f00d);
    let mut acc = 0u64;
    let mut n: u64 = 64;
    loop {
        let t = Instant::now();
        for _ in 0..n {
            acc = acc.wrapping_add(op(&mut rng));
        }
        let e = t.elapsed().as_nanos();
        if e * 4 >= round_ns {
            n = ((n as u128 * round_ns / e.max(1)) as u64).max(1);
            break;
        }
        n *= 2;
    }
    let mut v: Vec<f64> = (0..a.rounds.max(1))
        .map(|_| {
            let t = Instant::now();
            for _ in 0..n {
                acc = acc.wrapping_add(op(&mut rng));
            }
            t.elapsed().as_nanos() as f64 / n as f64
        })
        .collect();
    black_box(acc);
    v.sort_by(f64::total_cmp);
    if a.min {
        v[0]
    } else {
        v[v.len() / 2]
    }
}

/// A key that is never resident, from a random `x`: 40 random bits above 2^40 (resident
/// keys are below 2^17; a repeat within the slices a figure inserts is unlikely, and
/// `miss_fraction` shows how often one hit).
fn miss_key(x: u64) -> u64 {
    1 << 40 | x >> 24
}

/// A bijection on `KEY_BITS`-bit integers that scatters consecutive inputs, so a counter
/// gives keys that never repeat within 2^21 calls and follow no stride.
fn scatter(i: u64) -> u64 {
    let m = (1u64 << KEY_BITS) - 1;
    let mut x = i & m;
    x ^= x >> 11;
    x = x.wrapping_mul(0x9E37_79B1) & m;
    x ^= x >> 10;
    x = x.wrapping_mul(0x85EB_CA6B) & m;
    x ^= x >> 11;
    x
}

/// The word index within a slice, from bits of `r` the key does not use.
fn word_of(r: u64) -> usize {
    (r >> 40) as usize & (SLICE_WORDS - 1)
}

/// QEMU's `Qcow2CachedTable`.
#[repr(C)]
struct QEntry {
    /// Host offset of the table; 0 = empty (we store key + 1).
    offset: u64,
    lru_counter: u64,
    refs: i32,
    dirty: bool,
}

/// A model of QEMU's qcow2 metadata cache (block/qcow2-cache.c): entries scanned linearly.
struct QemuCache {
    entries: Vec<QEntry>,
    tables: Vec<u64>,
    lru_counter: u64,
}

impl QemuCache {
    fn new(n: usize) -> Self {
        QemuCache {
            entries: (0..n)
                .map(|_| QEntry {
                    offset: 0,
                    lru_counter: 0,
                    refs: 0,
                    dirty: false,
                })
                .collect(),
            tables: vec![0; n * SLICE_WORDS],
            lru_counter: 0,
        }
    }

    /// `qcow2_cache_do_get`: the entry holding `key`, filled from `src` on a miss.
    fn get(&mut self, key: u64, src: &[u64]) -> usize {
        let n = self.entries.len();
        let offset = key + 1;
        let start = (key as usize).wrapping_mul(4) % n;
        let mut i = start;
        let mut min_lru = u64::MAX;
        let mut min_i = usize::MAX;
        loop {
            let t = &self.entries[i];
            if t.offset == offset {
                self.entries[i].refs += 1;
                return i;
            }
            if t.refs == 0 && t.lru_counter < min_lru {
                min_lru = t.lru_counter;
                min_i = i;
            }
            i += 1;
            if i == n {
                i = 0;
            }
            if i == start {
                break;
            }
        }
        let e = &mut self.entries[min_i];
        e.offset = offset;
        e.dirty = false;
        e.refs += 1;
        self.tables[min_i * SLICE_WORDS..(min_i + 1) * SLICE_WORDS].copy_from_slice(src);
        min_i
    }

    /// `qcow2_cache_put`.
    fn put(&mut self, i: usize) {
        let e = &mut self.entries[i];
        e.refs -= 1;
        if e.refs == 0 {
            self.lru_counter += 1;
            e.lru_counter = self.lru_counter;
        }
    }
}

/// Figures for one cache size, in ns per operation.
#[derive(Default)]
struct Row {
    loop_only: f64,
    set_of: f64,
    hit_meta: f64,
    hit_set: f64,
    hit: f64,
    hit_lat: f64,
    floor: f64,
    floor_lat: f64,
    miss_lookup: f64,
    victim: f64,
    miss_victim: f64,
    miss_nofill: f64,
    miss: f64,
    miss_fraction: f64,
    qemu_hit: f64,
    qemu_miss: f64,
}

fn bench_size(a: &Args, slices: usize) -> Row {
    let mut row = Row::default();
    let mask = slices as u64 - 1;
    let src: Vec<u64> = (0..SLICE_WORDS as u64).map(|i| i * 0x1_0001).collect();

    // The set-associative cache, filled with slices 0..slices (a disk the cache covers).
    let mut c = SetAssocCache::<u64>::new(
        CacheConfig {
            size_bytes: (slices * SLICE_WORDS * 8) as u64,
            ways: WAYS,
        },
        SLICE_WORDS,
        u64::MAX,
    );
    assert_eq!(c.capacity(), slices);
    for k in 0..slices as u64 {
        c.insert_with(k, 0, |b| {
            for (i, w) in b.iter_mut().enumerate() {
                *w = k << 9 | i as u64;
            }
        });
    }
    let resident = (0..slices as u64)
        .filter(|&k| c.probe(k, 0).is_some())
        .count();
    assert_eq!(resident, slices, "every slice fits: the sets are even");

    row.loop_only = measure(a, |r| {
        let x = r.next();
        black_box(x & mask) ^ word_of(x) as u64
    });
    row.set_of = measure(a, |r| c.set_of(black_box(r.next() & mask)) as u64);
    row.hit_meta = measure(a, |r| {
        let key = r.next() & mask;
        let h = c.probe(key, 0).unwrap();
        c.touch(h);
        h.way as u64
    });
    row.hit = measure(a, |r| {
        let x = r.next();
        let h = c.probe(x & mask, 0).unwrap();
        c.touch(h);
        c.block(h.way)[word_of(x)]
    });
    let zero = black_box(0u64);
    let mut last = 0u64;
    row.hit_lat = measure(a, |r| {
        let x = r.next() ^ (last & zero);
        let h = c.probe(x & mask, 0).unwrap();
        c.touch(h);
        last = c.block(h.way)[word_of(x)];
        last
    });
    // The floor: one random word of the same cached slices, the way given (no lookup).
    row.floor = measure(a, |r| {
        let x = r.next();
        c.block((x & mask) as usize)[word_of(x)]
    });
    let mut last = 0u64;
    row.floor_lat = measure(a, |r| {
        let x = r.next() ^ (last & zero);
        last = c.block((x & mask) as usize)[word_of(x)];
        last
    });
    let hits_before = c.stats().hits;

    // Hits through the set scan: a second cache holding keys that all have the same home way
    // in their sets (multiples of the cache's size: the bits above the set bits are 0), so
    // of the keys sharing a set one is in its home and the others are found by scanning the
    // set. Some of those keys collide in their sets too; the resident ones are drawn.
    let mut c2 = SetAssocCache::<u64>::new(
        CacheConfig {
            size_bytes: (slices * SLICE_WORDS * 8) as u64,
            ways: WAYS,
        },
        SLICE_WORDS,
        u64::MAX,
    );
    let stride = slices.next_power_of_two() as u64;
    for i in 0..slices as u64 {
        c2.insert_with(i * stride, 0, |_| {});
    }
    let shared_slot: Vec<u64> = (0..slices as u64)
        .map(|i| i * stride)
        .filter(|&k| c2.probe(k, 0).is_some())
        .collect();
    let m2 = (shared_slot.len().next_power_of_two() as u64 / 2).max(1) - 1;
    row.hit_set = measure(a, |r| {
        let key = shared_slot[(r.next() & m2) as usize];
        let h = c2.probe(key, 0).unwrap();
        c2.touch(h);
        h.way as u64
    });
    drop(c2);

    // Misses: keys never resident, drawn from the same generator as the hits' keys (the
    // same loop overhead in both figures).
    row.miss_lookup = measure(a, |r| {
        let key = miss_key(r.next());
        c.lookup(key, 0).map_or(key, |w| w as u64)
    });
    row.victim = measure(a, |r| c.victim(miss_key(r.next())) as u64);
    row.miss_victim = measure(a, |r| {
        let key = miss_key(r.next());
        match c.lookup(key, 0) {
            Some(w) => w as u64,
            None => c.victim(key) as u64,
        }
    });
    let s0 = c.stats();
    row.miss_nofill = measure(a, |r| {
        let key = miss_key(r.next());
        match c.lookup(key, 0) {
            Some(w) => w as u64,
            None => c.insert_with(key, 0, |_| {}) as u64,
        }
    });
    row.miss = measure(a, |r| {
        let x = r.next();
        let key = miss_key(x);
        match c.lookup(key, 0) {
            Some(w) => c.block(w)[word_of(x)],
            None => c.insert_with(key, 0, |b| b.copy_from_slice(&src)) as u64,
        }
    });
    let s1 = c.stats();
    assert_eq!(s0.hits, hits_before);
    row.miss_fraction = (s1.misses - s0.misses) as f64
        / ((s1.misses - s0.misses) + (s1.hits - s0.hits)).max(1) as f64;
    drop(c);

    // QEMU-style: the steady state of a random workload (keys at random positions, random
    // LRU order), resident keys drawn by picking a random entry.
    let mut q = QemuCache::new(slices);
    let mut order: Vec<u64> = (0..slices as u64).collect();
    let mut r = Rng::new(11);
    for i in (1..slices).rev() {
        order.swap(i, r.below(i as u64 + 1) as usize);
    }
    for (i, e) in q.entries.iter_mut().enumerate() {
        e.offset = scatter(i as u64) + 1;
        e.lru_counter = order[i] + 1;
    }
    q.lru_counter = slices as u64;
    q.tables
        .iter_mut()
        .enumerate()
        .for_each(|(i, w)| *w = i as u64);
    row.qemu_hit = measure(a, |r| {
        let x = r.next();
        let key = q.entries[(x & mask) as usize].offset - 1;
        let i = q.get(key, &src);
        let w = q.tables[i * SLICE_WORDS + word_of(x)];
        q.put(i);
        w
    });
    let mut fresh = slices as u64;
    row.qemu_miss = measure(a, |_| {
        fresh += 1;
        let i = q.get(scatter(fresh) | 1 << KEY_BITS, &src);
        q.put(i);
        i as u64
    });
    row
}

fn ratio(v: &[f64]) -> f64 {
    let max = v.iter().copied().fold(f64::MIN, f64::max);
    let min = v.iter().copied().fold(f64::MAX, f64::min);
    max / min
}

fn main() {
    let a = Args::parse();
    let t0 = Instant::now();
    let rows: Vec<Row> = SIZES.iter().map(|&s| bench_size(&a, s)).collect();
    let secs = t0.elapsed().as_secs_f64();
    let stat = if a.min { "fastest round" } else { "median" };
    type Get = fn(&Row) -> f64;
    let lines: [(&str, &str, Get); 16] = [
        ("loop", "rng + loop overhead (in every figure)", |r| {
            r.loop_only
        }),
        ("set_of", "set_of (hash) alone", |r| r.set_of),
        ("hit_meta", "hit: probe+touch (metadata only)", |r| {
            r.hit_meta
        }),
        ("hit_set", "hit through the set scan (not at home)", |r| {
            r.hit_set
        }),
        ("hit", "hit: probe+touch+word (resolve_cached)", |r| r.hit),
        ("floor", "floor: random slice word, no lookup", |r| r.floor),
        ("hit_latency", "hit, dependent chain (latency)", |r| {
            r.hit_lat
        }),
        ("floor_latency", "floor, dependent chain (latency)", |r| {
            r.floor_lat
        }),
        ("miss_lookup", "miss: lookup alone", |r| r.miss_lookup),
        ("victim", "miss: victim choice alone", |r| r.victim),
        ("miss_victim", "miss: lookup + victim (no insert)", |r| {
            r.miss_victim
        }),
        ("miss_nofill", "miss: lookup + insert_with, no copy", |r| {
            r.miss_nofill
        }),
        ("miss", "miss: lookup + insert_with 4 KiB", |r| r.miss),
        ("miss_fraction", "  (fraction of those that missed)", |r| {
            r.miss_fraction
        }),
        ("qemu_hit", "QEMU-style full scan: hit + word", |r| {
            r.qemu_hit
        }),
        ("qemu_miss", "QEMU-style full scan: miss + 4 KiB", |r| {
            r.qemu_miss
        }),
    ];
    let col = |g: Get| rows.iter().map(g).collect::<Vec<f64>>();
    let hit_meta = col(|r| r.hit_meta);
    let hit = col(|r| r.hit);
    let hit_lat = col(|r| r.hit_lat);
    let per_size = |num: Get, den: Get| rows.iter().map(|r| num(r) / den(r)).collect::<Vec<f64>>();
    let summary: Vec<(&str, &str, Vec<f64>)> = vec![
        (
            "hit_max_over_min",
            "hit ns, largest / smallest size (goal <= 1.5)",
            vec![ratio(&hit_meta), ratio(&hit), ratio(&hit_lat)],
        ),
        (
            "hit_minus_floor",
            "hit - floor, ns (the cache's own cost)",
            per_size(|r| r.hit - r.floor, |_| 1.0),
        ),
        (
            "victim_over_hit",
            "victim choice / hit, metadata (goal <= 2)",
            per_size(|r| r.victim, |r| r.hit_meta),
        ),
        (
            "victim_over_set_hit",
            "victim choice / hit through the set",
            per_size(|r| r.victim, |r| r.hit_set),
        ),
        (
            "miss_victim_over_hit",
            "miss (lookup + victim) / hit, metadata",
            per_size(|r| r.miss_victim, |r| r.hit_meta),
        ),
        (
            "nofill_over_hit",
            "miss (insert, no copy) / hit",
            per_size(|r| r.miss_nofill, |r| r.hit),
        ),
        (
            "miss_over_hit",
            "miss (insert 4 KiB) / hit",
            per_size(|r| r.miss, |r| r.hit),
        ),
        (
            "qemu_hit_over_hit",
            "QEMU-style hit / set-assoc hit",
            per_size(|r| r.qemu_hit, |r| r.hit),
        ),
        (
            "qemu_miss_over_miss",
            "QEMU-style miss / set-assoc miss",
            per_size(|r| r.qemu_miss, |r| r.miss),
        ),
    ];
    if a.json {
        let mut m = serde_json::Map::new();
        m.insert("slices".into(), serde_json::json!(SIZES));
        m.insert("ways".into(), serde_json::json!(WAYS));
        m.insert("slice_bytes".into(), serde_json::json!(SLICE_WORDS * 8));
        m.insert(
            "unit".into(),
            serde_json::json!(format!("ns per operation ({stat})")),
        );
        for (k, _, g) in &lines {
            m.insert((*k).into(), serde_json::json!(col(*g)));
        }
        for (k, _, v) in &summary {
            m.insert((*k).into(), serde_json::json!(v));
        }
        m.insert("seconds".into(), serde_json::json!(secs));
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::Value::Object(m)).unwrap_or_default()
        );
        return;
    }
    print!("{:<42}", format!("ns per operation ({stat})"));
    for s in SIZES {
        print!(" {:>12}", format!("{s} slices"));
    }
    println!();
    for (k, name, g) in &lines {
        print!("{name:<42}");
        for v in col(*g) {
            if *k == "miss_fraction" {
                print!(" {v:>12.3}");
            } else {
                print!(" {v:>12.1}");
            }
        }
        println!();
    }
    println!();
    for (k, name, v) in &summary {
        print!("{name:<42}");
        if *k == "hit_max_over_min" {
            println!(
                " {:>12} {:>12} {:>12}",
                format!("{:.2} (meta)", v[0]),
                format!("{:.2} (+word)", v[1]),
                format!("{:.2} (lat)", v[2])
            );
            continue;
        }
        for x in v {
            print!(" {x:>12.2}");
        }
        println!();
    }
    println!(
        "({WAYS} ways, {} KiB slices; cache data {} KiB .. {} MiB; {} rounds of ~{} ms, {stat}; {secs:.1} s)",
        SLICE_WORDS * 8 / 1024,
        SIZES[0] * SLICE_WORDS * 8 / 1024,
        (SIZES[2] * SLICE_WORDS * 8) >> 20,
        a.rounds,
        a.round_ms
    );
}
