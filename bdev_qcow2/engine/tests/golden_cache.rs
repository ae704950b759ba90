//! Overlays on one golden image, each on its own thread (a core) with its own executor and
//! its own channel of the golden device, sharing one read cache: every overlay reads the
//! golden image's bytes exactly, and the golden device is read about once for all of
//! them, not once per overlay. Without the cache, each reads it all.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::golden::{CachedDevice, SharedReadCache};
use qcow2_engine::io::{BufSlice, HeapBuf};
use qcow2_engine::testing::MemDevice;
use qcow2_engine::{Chain, Exec, Layer, OpenOptions, Qcow2};
use std::sync::{Arc, Barrier};

const SIZE: u64 = 8 << 20;
const CHUNK: usize = 96 << 10; // not a multiple of the granule: reads span granules
const GRANULE: u32 = 64 << 10;

fn golden_bytes() -> Vec<u8> {
    let mut r = qcow2_engine::rng::Rng::new(7);
    (0..SIZE).map(|_| r.next() as u8).collect()
}

/// One overlay on its own executor: creates it, opens it over the golden image read
/// through `cache`, reads the whole disk, checks it, and returns the golden device's
/// reads (operations, bytes).
fn overlay_reads(golden: &[u8], cache: Option<Arc<SharedReadCache>>, start: &Barrier) -> u64 {
    let exec: Exec<CachedDevice<MemDevice>> = Exec::new();
    let img = exec.add_device(CachedDevice::plain(MemDevice::new(Vec::new())));
    let gdev = MemDevice::new(golden.to_vec());
    let gstate = gdev.0.clone();
    // This overlay holds the cache as the SPDK module's bdevs do, for as long as it reads.
    let _sharer = cache.as_ref().map(|c| c.share());
    let gid = exec.add_device(CachedDevice::new(gdev, cache));
    let e = exec.clone();
    let opts = CreateOptions {
        size: SIZE,
        cluster_bits: 16,
        backing_file: Some("golden".into()),
        backing_format: Some("raw".into()),
        ..Default::default()
    };
    exec.block_on(async move { create(&e, img, &opts).await })
        .unwrap();
    let e = exec.clone();
    let q = exec
        .block_on(async move { Qcow2::open(&e, img, OpenOptions::default()).await })
        .unwrap();
    let chain = Chain::new(
        &exec,
        vec![
            Layer::Qcow2(Box::new(q)),
            Layer::Raw {
                dev: gid,
                size: SIZE,
            },
        ],
    )
    .unwrap();
    start.wait();
    let mut off = 0u64;
    while off < SIZE {
        let n = (CHUNK as u64).min(SIZE - off) as usize;
        let buf = HeapBuf::new(n);
        let c = chain.clone();
        let b = BufSlice::whole(buf.clone());
        exec.block_on(async move { c.read(off, b).await }).unwrap();
        assert!(
            buf.to_vec() == golden[off as usize..off as usize + n],
            "bytes at {off} differ from the golden image"
        );
        off += n as u64;
    }
    let reads = gstate.borrow().reads;
    // Every overlay shares the cache until all have read (the last one alone would read
    // past it).
    start.wait();
    reads
}

fn run(overlays: usize, cache: Option<Arc<SharedReadCache>>) -> Vec<u64> {
    let golden = Arc::new(golden_bytes());
    let start = Arc::new(Barrier::new(overlays));
    let threads: Vec<_> = (0..overlays)
        .map(|_| {
            let (g, c, s) = (golden.clone(), cache.clone(), start.clone());
            std::thread::spawn(move || overlay_reads(&g, c, &s))
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

#[test]
fn four_overlays_read_the_golden_image_once() {
    let granules = SIZE / u64::from(GRANULE);
    // Twice the disk: the hash puts nine of the 128 granules in one set of eight when the
    // cache holds exactly the disk, and an overlay its thread left behind then fills again
    // what that set evicted (141 fills seen on a loaded machine). What this test asks is
    // that the overlays share what the cache holds; eviction is the small cache's test.
    let budget = 2 * SIZE;
    let cache = SharedReadCache::new(budget, GRANULE).unwrap();
    let reads = run(4, Some(cache.clone()));
    let total: u64 = reads.iter().sum();
    let s = cache.stats();
    eprintln!("golden reads per overlay {reads:?} for {granules} granules; {s:?}");
    // Every granule filled once (two cores may race to fill the same one now and then).
    assert!(
        total as f64 <= granules as f64 * 1.1,
        "golden reads {reads:?} for {granules} granules"
    );
    assert_eq!(s.fills, total, "every golden read is a fill");
    assert!(s.hits > 0 && s.bypasses == 0, "{s:?}");
    assert!(s.memory_bytes <= budget, "{s:?}");
}

#[test]
fn one_overlay_alone_reads_past_the_cache() {
    // Sharing with nobody only costs copies: the cache is used from the second sharer on.
    let cache = SharedReadCache::new(SIZE, GRANULE).unwrap();
    let reads = run(1, Some(cache.clone()));
    let s = cache.stats();
    assert!(reads[0] >= SIZE / CHUNK as u64, "{reads:?}");
    assert_eq!(
        (s.fills, s.hits, s.memory_bytes, s.sharers),
        (0, 0, 0, 0),
        "{s:?}"
    );
    let first = cache.share();
    assert!(!cache.is_shared());
    let second = cache.share();
    assert!(cache.is_shared());
    drop((first, second));
    assert_eq!(cache.stats().sharers, 0);
}

#[test]
fn without_the_cache_each_overlay_reads_it_all() {
    let reads = run(4, None);
    for r in &reads {
        assert!(*r >= SIZE / CHUNK as u64, "{reads:?}");
    }
}

#[test]
fn a_cache_smaller_than_the_image_still_reads_it_right() {
    // Two sets: slots are replaced all the time, and reads still get their bytes.
    let cache = SharedReadCache::new(16 * u64::from(GRANULE), GRANULE).unwrap();
    let _ = run(3, Some(cache.clone()));
    let s = cache.stats();
    assert!(s.memory_bytes <= 16 * u64::from(GRANULE), "{s:?}");
}
