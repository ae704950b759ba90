//! The read path on the in-memory device, against qemu-img as the oracle: fast-path
//! behaviour (one device I/O per contiguous host run, no task), a busy and slow device,
//! and a failure injected at every device operation.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use qcow2_engine::io::{BufSlice, HeapBuf, IoBuffer};
use qcow2_engine::ring::{RingConfig, WriteGens};
use qcow2_engine::testing::host;
use qcow2_engine::testing::MemDevice;
use qcow2_engine::{Chain, Error, Exec, Layer, OpenOptions, Qcow2, ReadRoute, WriteRoute};
use std::cell::RefCell;
use std::path::Path;
use std::process::Command;
use std::rc::Rc;
use std::sync::Arc;

mod mem_chain;

fn sh(cmd: &mut Command) {
    let out = cmd.output().expect("run");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Creates an image with qemu-img, runs qemu-io commands, returns (image bytes, raw bytes).
fn make_image(dir: &Path, opts: &str, size: &str, io: &[&str]) -> (Vec<u8>, Vec<u8>) {
    let img = dir.join("img.qcow2");
    let raw = dir.join("img.raw");
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-o", opts])
        .arg(&img)
        .arg(size));
    let mut q = Command::new("qemu-io");
    q.args(["-f", "qcow2"]);
    for c in io {
        q.arg("-c").arg(c);
    }
    sh(q.arg(&img));
    sh(Command::new("qemu-img")
        .args(["convert", "-O", "raw"])
        .arg(&img)
        .arg(&raw));
    (std::fs::read(&img).unwrap(), std::fs::read(&raw).unwrap())
}

fn open(
    bytes: Vec<u8>,
    opts: OpenOptions,
) -> (
    Exec<MemDevice>,
    MemDevice,
    Result<Rc<Chain<MemDevice>>, Error>,
) {
    let exec = Exec::new();
    let dev = MemDevice::new(bytes);
    let id = exec.add_device(dev.clone());
    let e2 = exec.clone();
    let q = exec.block_on(async move { Qcow2::open(&e2, id, opts).await });
    let chain = q.and_then(|q| Chain::new(&exec, vec![Layer::Qcow2(Box::new(q))]));
    (exec, dev, chain)
}

/// Reads [off, off+len) through the submit/poll interface; returns the data or the error.
fn submit_and_wait(
    exec: &Exec<MemDevice>,
    chain: &Rc<Chain<MemDevice>>,
    off: u64,
    len: usize,
) -> Result<Vec<u8>, Error> {
    let buf = HeapBuf::new(len);
    wait_for(exec, |t| {
        host::read(chain, t, off, BufSlice::whole(buf.clone()))
    })
    .map(|_| buf.to_vec())
}

#[test]
fn fast_path_is_one_device_io_per_contiguous_run() {
    let dir = tempfile::tempdir().unwrap();
    let (img, raw) = make_image(
        dir.path(),
        "cluster_size=65536",
        "16M",
        &["write -P 0x11 0 1M", "write -z 1M 64k"],
    );
    let (exec, dev, chain) = open(img, OpenOptions::default());
    let chain = chain.unwrap();
    // First read misses the slice: slow path.
    let a = submit_and_wait(&exec, &chain, 0, 1 << 20).unwrap();
    assert_eq!(a, raw[..1 << 20]);
    assert_eq!(chain.counters().reads().slow_reads, 1);
    // Second read: every slice cached, 16 contiguous clusters -> exactly one device read.
    let reads = dev.0.borrow().reads;
    let tasks = exec.stats().tasks_spawned;
    let b = submit_and_wait(&exec, &chain, 0, 1 << 20).unwrap();
    assert_eq!(b, raw[..1 << 20]);
    assert_eq!(chain.counters().reads().fast_reads, 1);
    assert_eq!(
        dev.0.borrow().reads - reads,
        1,
        "contiguous clusters must be one device I/O"
    );
    assert_eq!(
        exec.stats().tasks_spawned,
        tasks,
        "the fast path spawns no task"
    );
    // Data plus a zero cluster plus unallocated space: still one device read on the fast path.
    let reads = dev.0.borrow().reads;
    let c = submit_and_wait(&exec, &chain, 0, 2 << 20).unwrap();
    assert_eq!(c, raw[..2 << 20]);
    assert_eq!(dev.0.borrow().reads - reads, 1);
    let Layer::Qcow2(q) = &chain.layers()[0] else {
        panic!()
    };
    let s = q.l2_cache_stats();
    assert!(s.hits >= 2 && s.misses >= 1, "{s:?}");
}

#[test]
fn busy_slow_device_reads_like_qemu() {
    let dir = tempfile::tempdir().unwrap();
    let (img, raw) = make_image(
        dir.path(),
        "cluster_size=4096,extended_l2=off",
        "8M",
        &[
            "write -P 0x21 0 3M",
            "write -P 0x22 5000k 100k",
            "discard 1M 512k",
            "write -z 2M 8k",
        ],
    );
    let (exec, dev, chain) = open(
        img,
        OpenOptions {
            l2_cache_bytes: Some(4096),
            cache_ways: 2,
            ..Default::default()
        },
    );
    let chain = chain.unwrap();
    {
        let mut s = dev.0.borrow_mut();
        s.queue_depth = 1;
        s.latency_polls = 3;
    }
    // Many requests in flight at once through a device that takes one at a time.
    let n = 64;
    let chunk = raw.len() / n;
    let bufs: Vec<HeapBuf> = (0..n).map(|_| HeapBuf::new(chunk)).collect();
    for (i, b) in bufs.iter().enumerate() {
        host::read(
            &chain,
            i as u64,
            (i * chunk) as u64,
            BufSlice::whole(b.clone()),
        );
    }
    let mut done = 0;
    while done < n {
        exec.poll(&mut |_, r| {
            r.unwrap();
            done += 1;
        });
    }
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(b.to_vec(), raw[i * chunk..(i + 1) * chunk], "chunk {i}");
    }
    assert!(exec.stats().busy_retries > 0, "the device never said busy");
}

#[test]
fn a_failure_at_every_device_io_reaches_the_caller() {
    let dir = tempfile::tempdir().unwrap();
    let (img, raw) = make_image(
        dir.path(),
        "cluster_size=4096",
        "4M",
        &["write -P 0x31 0 1M", "write -P 0x32 2M 40k"],
    );
    // Count the device operations of a clean open + full read.
    let (exec, dev, chain) = open(
        img.clone(),
        OpenOptions {
            l2_cache_bytes: Some(4096),
            ..Default::default()
        },
    );
    let data = submit_and_wait(&exec, &chain.unwrap(), 0, raw.len()).unwrap();
    assert_eq!(data, raw);
    let total = dev.0.borrow().ops;
    assert!(total > 5);
    for errno in [5, 28] {
        for k in 0..total {
            let exec = Exec::new();
            let dev = MemDevice::new(img.clone());
            dev.0.borrow_mut().fail_op = Some((k, errno));
            let id = exec.add_device(dev.clone());
            let e2 = exec.clone();
            let opts = OpenOptions {
                l2_cache_bytes: Some(4096),
                ..Default::default()
            };
            let r = exec
                .block_on(async move { Qcow2::open(&e2, id, opts).await })
                .and_then(|q| Chain::new(&exec, vec![Layer::Qcow2(Box::new(q))]))
                .and_then(|c| submit_and_wait(&exec, &c, 0, raw.len()));
            assert_eq!(
                r,
                Err(Error::Io(errno)),
                "failing op {k} with errno {errno}"
            );
        }
    }
}

#[test]
fn backing_chain_on_memory_devices() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.qcow2");
    let top = dir.path().join("top.qcow2");
    let raw = dir.path().join("top.raw");
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&base)
        .arg("4M"));
    sh(Command::new("qemu-io")
        .args(["-f", "qcow2", "-c", "write -P 0x41 0 2M"])
        .arg(&base));
    sh(Command::new("qemu-img")
        .args([
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "backing_file=base.qcow2,backing_fmt=qcow2",
        ])
        .arg(&top));
    sh(Command::new("qemu-io")
        .args([
            "-f",
            "qcow2",
            "-c",
            "write -P 0x42 1M 4k",
            "-c",
            "discard 1536k 64k",
        ])
        .arg(&top));
    sh(Command::new("qemu-img")
        .args(["convert", "-O", "raw"])
        .arg(&top)
        .arg(&raw));
    let exec = Exec::new();
    let mut layers = Vec::new();
    for p in [&top, &base] {
        let id = exec.add_device(MemDevice::new(std::fs::read(p).unwrap()));
        let e2 = exec.clone();
        let q = exec
            .block_on(async move { Qcow2::open(&e2, id, OpenOptions::default()).await })
            .unwrap();
        layers.push(Layer::Qcow2(Box::new(q)));
    }
    let chain = Chain::new(&exec, layers).unwrap();
    let expect = std::fs::read(&raw).unwrap();
    for _ in 0..2 {
        assert_eq!(
            submit_and_wait(&exec, &chain, 0, expect.len()).unwrap(),
            expect
        );
    }
    // With the slices cached, guest reads follow the mapping down the chain on the fast
    // path (no task), across the top's data, its discarded (zero) range and the backing
    // image's data and unallocated clusters.
    let before = chain.counters().reads();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..300 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = ((x % 48 + 1) * 512) as usize;
        let off = (x >> 20) % (expect.len() - len) as u64 / 512 * 512;
        assert_eq!(
            submit_and_wait(&exec, &chain, off, len).unwrap(),
            expect[off as usize..off as usize + len],
            "{len} bytes at {off:#x}"
        );
    }
    let after = chain.counters().reads();
    assert_eq!(after.slow_reads, before.slow_reads, "{after:?}");
    assert_eq!(after.fast_reads - before.fast_reads, 300);
    // Unaligned and out-of-range requests are refused, not served.
    assert!(matches!(
        submit_and_wait(&exec, &chain, 100, 512),
        Err(Error::InvalidRequest(_))
    ));
    assert!(matches!(
        submit_and_wait(&exec, &chain, 4 << 20, 512),
        Err(Error::InvalidRequest(_))
    ));
}

#[test]
fn replica_for_another_core_reads_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let (img, raw) = make_image(
        dir.path(),
        "cluster_size=4096",
        "4M",
        &["write -P 0x51 0 1M", "write -z 2M 64k"],
    );
    let (_exec, dev, chain) = open(img, OpenOptions::default());
    let chain = chain.unwrap();
    let Layer::Qcow2(q) = &chain.layers()[0] else {
        panic!()
    };
    // Another core: its own executor and device channel, no re-read of the metadata.
    let exec2: Exec<MemDevice> = Exec::new();
    let id2 = exec2.add_device(dev.clone());
    let reads_before = dev.0.borrow().reads;
    let r = q.replica(&exec2, id2, OpenOptions::default()).unwrap();
    assert_eq!(
        dev.0.borrow().reads,
        reads_before,
        "a replica copies, it does not re-read"
    );
    let chain2 = Chain::new(&exec2, vec![Layer::Qcow2(Box::new(r))]).unwrap();
    assert_eq!(submit_and_wait(&exec2, &chain2, 0, raw.len()).unwrap(), raw);
}

#[test]
fn completions_delivered_from_a_device_callback_finish_fast_path_reads_at_once() {
    use qcow2_engine::io::BlockDevice;
    let dir = tempfile::tempdir().unwrap();
    let (img, raw) = make_image(
        dir.path(),
        "cluster_size=65536",
        "4M",
        &["write -P 0x61 0 1M"],
    );
    let (exec, _dev, chain) = open(img, OpenOptions::default());
    let chain = chain.unwrap();
    // Warm the slice cache (slow path), then a cached read takes the fast path.
    submit_and_wait(&exec, &chain, 0, 65536).unwrap();
    let buf = HeapBuf::new(65536);
    host::read(&chain, 9, 0, BufSlice::whole(buf.clone()));
    // The host's device callback hands each completion to the executor directly (as SPDK's
    // completion callback would), with no Exec::poll in between.
    let mut got = None;
    while got.is_none() {
        let mut reaped = Vec::new();
        exec.with_device(qcow2_engine::DevId(0), |d| {
            d.poll(&mut |t, r| reaped.push((t, r)))
        });
        for (t, r) in reaped {
            exec.device_completed(t, r);
        }
        exec.take_completions(&mut |tag, r| got = Some((tag, r)));
    }
    assert_eq!(got, Some((9, Ok(()))));
    assert_eq!(buf.to_vec(), raw[..65536]);
}

/// `qemu-img map --output=json`: (start, length, data, offset) per extent.
fn qemu_map(img: &Path) -> Vec<(u64, u64, bool, Option<u64>)> {
    let out = Command::new("qemu-img")
        .args(["map", "--output=json"])
        .arg(img)
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["start"].as_u64().unwrap(),
                e["length"].as_u64().unwrap(),
                e["data"].as_bool().unwrap(),
                e["offset"].as_u64(),
            )
        })
        .collect()
}

/// The direct path (`Chain::route_read` / `route_write`'s grant, what the SPDK module hands
/// straight to the base bdev): one extent exactly where qemu-img maps the data, and none
/// for everything the
/// engine must run itself — uncached slices, zeros, compressed and unallocated clusters,
/// requests spanning them, bad ranges, writes on a read-only image.
#[test]
fn direct_path_maps_where_qemu_img_maps() {
    let dir = tempfile::tempdir().unwrap();
    let (img, raw) = make_image(
        dir.path(),
        "cluster_size=65536",
        "16M",
        &[
            "write -P 0x11 0 1M",
            "write -z 1M 64k",
            "write -c -P 0x22 2M 64k",
            "write -P 0x33 4M 64k",
        ],
    );
    let map = qemu_map(&dir.path().join("img.qcow2"));
    let host_of = |off: u64| {
        map.iter()
            .find(|e| e.0 <= off && off < e.0 + e.1)
            .and_then(|e| e.3.filter(|_| e.2).map(|h| h + off - e.0))
    };
    let extent_end = |off: u64| {
        map.iter()
            .find(|e| e.0 <= off && off < e.0 + e.1)
            .map(|e| e.0 + e.1)
    };
    for writable in [false, true] {
        let (exec, dev, chain) = open(
            img.clone(),
            OpenOptions {
                writable,
                ..OpenOptions::default()
            },
        );
        let chain = chain.unwrap();
        // Nothing cached yet: the engine must load the slice.
        assert_eq!(direct_host(&exec, &chain, 0, 4096, false), None);
        submit_and_wait(&exec, &chain, 0, 4096).unwrap();
        for (off, len) in [
            (0u64, 4096u64),
            (65536 - 512, 1024),
            (512, 65536),
            (4 << 20, 65536),
        ] {
            let host =
                direct_host(&exec, &chain, off, len, false).expect("cached data maps directly");
            assert_eq!(Some(host), host_of(off), "read at {off}");
            // The extent holds the guest's bytes.
            let mem = &dev.0.borrow().data;
            assert_eq!(
                mem[host as usize..(host + len) as usize],
                raw[off as usize..(off + len) as usize]
            );
            // In-place writes: only on the writable image (qemu-io's clusters are COPIED).
            let w = direct_host(&exec, &chain, off, len, true);
            assert_eq!(w, host_of(off).filter(|_| writable), "write at {off}");
        }
        // A run over the whole first MiB is one extent only if qemu-img says so.
        let whole = direct_host(&exec, &chain, 0, 1 << 20, false);
        assert_eq!(whole.is_some(), extent_end(0) >= Some(1 << 20));
        for (off, len, why) in [
            (1 << 20, 4096, "zero cluster"),
            ((1 << 20) - 4096, 8192, "data then zeros"),
            (2 << 20, 4096, "compressed cluster"),
            (3 << 20, 4096, "unallocated cluster"),
            (100, 4096, "unaligned"),
            (0, 0, "empty"),
            ((16 << 20) - 512, 1024, "past the end"),
        ] {
            assert_eq!(direct_host(&exec, &chain, off, len, false), None, "{why}");
            assert_eq!(
                direct_host(&exec, &chain, off, len, true),
                None,
                "{why} (write)"
            );
        }
    }
}

/// An 8 MiB image of 4 KiB clusters with data in its first and last 3 MiB, and the raw
/// bytes QEMU reads from it.
fn two_runs_image(dir: &Path) -> (Vec<u8>, Vec<u8>) {
    make_image(
        dir,
        "cluster_size=4096",
        "8M",
        &["write -P 0x5a 0 3M", "write -P 0xa5 5M 3M"],
    )
}

#[test]
fn read_ahead_loads_the_next_slice_of_a_sequential_stream() {
    // 4 KiB clusters and 512-byte slices: a slice covers 256 KiB, so 32 KiB reads cross
    // into a new slice every 8 requests.
    const LEN: usize = 32 << 10;
    let dir = tempfile::tempdir().unwrap();
    let (img, raw) = two_runs_image(dir.path());
    let cov = 256 << 10;
    let run = |prefetch: bool, offsets: &[u64]| {
        let (exec, _dev, chain) = open_sliced(img.clone(), 512, prefetch);
        assert_eq!(chain.prefetch().is_on(), prefetch);
        for &off in offsets {
            // Read-ahead fed here, as a plan feeds it; the read itself on the engine's path.
            chain.read_ahead(off, LEN as u64);
            let buf = HeapBuf::new(LEN);
            let slice = BufSlice::whole(buf.clone());
            wait_for(&exec, |t| host::engine_read(&chain, t, off, slice)).unwrap();
            let got = buf.to_vec();
            assert_eq!(got[..], raw[off as usize..off as usize + LEN], "at {off}");
        }
        (chain.counters().reads(), chain.prefetch().stats())
    };
    let seq: Vec<u64> = (0..256).map(|i| i * LEN as u64).collect();
    let slices = (8 << 20) / cov;
    let (plain, p) = run(false, &seq);
    assert_eq!(
        plain.slow_reads, slices,
        "without read-ahead every slice is a miss"
    );
    assert_eq!(p, Default::default());
    let (ahead, p) = run(true, &seq);
    // Only the first slice is loaded by a guest read; every other one was there in time.
    assert_eq!(ahead.slow_reads, 1);
    assert_eq!(ahead.fast_reads, 255);
    assert_eq!(p.streams, 1);
    assert_eq!(
        p.issued,
        slices - 1,
        "each next slice once, nothing past the end"
    );
    assert_eq!(p.loaded, p.issued);
    assert_eq!(
        p.hits, p.loaded,
        "the stream reached every slice loaded for it"
    );
    // Random reads start no stream and load nothing ahead.
    let mut x = 7u64;
    let random: Vec<u64> = (0..200)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            (x >> 33) % 256 * LEN as u64
        })
        .collect();
    let (_, p) = run(true, &random);
    assert_eq!(p.issued, 0, "{p:?}");
}

#[test]
fn the_prefetch_ring_and_read_ahead_follow_one_stream() {
    // As above, with the prefetch ring on too: the ring looks each read up in the chain's
    // one stream table, and read-ahead of L2 slices follows the stream it found there.
    const LEN: usize = 32 << 10;
    let dir = tempfile::tempdir().unwrap();
    let (img, raw) = two_runs_image(dir.path());
    let (exec, _dev, chain) = open_sliced(img, 512, true);
    chain
        .enable_ring(RingConfig::default(), Arc::new(WriteGens::new()))
        .unwrap();
    let mut x = 7u64;
    for off in (0..256).map(|i| i * LEN as u64) {
        // Random reads between the stream's: neither follows them.
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        let far = ((x >> 33) % 64) * 2 * LEN as u64 + 4096;
        for at in [off, far] {
            let buf = HeapBuf::new(LEN.min((8 << 20) - at as usize));
            let slice = BufSlice::whole(buf.clone());
            let n = slice.len;
            wait_for(&exec, |t| host::read(&chain, t, at, slice)).unwrap();
            assert_eq!(
                buf.to_vec()[..],
                raw[at as usize..at as usize + n],
                "at {at}"
            );
        }
    }
    let p = chain.prefetch().stats();
    let r = chain.ring().stats().unwrap();
    assert_eq!((p.streams, r.streams), (1, 1), "{p:?} {r:?}");
    // (The ring's own read-aheads load the slices they cross: read-ahead finds them cached.)
    assert!(r.readahead_ios > 0, "{r:?}");
}

#[test]
fn read_ahead_on_memo_hits_watches_the_tail_of_each_slice() {
    // 64 KiB clusters and 4 KiB slices: a slice covers 32 MiB, whose last eighth (4 MiB) is
    // its tail. Both slices of the first L2 table have data, so both can be loaded.
    const MIB: u64 = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let (img, _raw) = make_image(
        dir.path(),
        "cluster_size=65536",
        "64M",
        &["write -P 0x5a 0 1M", "write -P 0xa5 40M 1M"],
    );
    let fresh = || open_sliced(img.clone(), 4096, true);
    let (_exec, _dev, chain) = fresh();
    // A sequential stream through the slice's first 28 MiB is not watched.
    for i in 0..28 {
        chain.read_ahead_memo(i * MIB, MIB);
    }
    assert_eq!(chain.prefetch().stats(), Default::default());
    // Once it reaches the tail it is: seen there, and the next slice is asked for.
    for i in 28..32 {
        chain.read_ahead_memo(i * MIB, MIB);
    }
    let p = chain.prefetch().stats();
    assert_eq!((p.streams, p.issued), (1, 1), "{p:?}");
    // `read_ahead` watches every request: the head of the slice is enough.
    let (_exec, _dev, chain) = fresh();
    for i in 0..24 {
        chain.read_ahead(i * MIB, MIB);
    }
    let p = chain.prefetch().stats();
    assert_eq!((p.streams, p.issued), (1, 1), "{p:?}");
}

/// Opens `img` read-only with L2 slices of `slice_bytes`, read-ahead on or off.
fn open_sliced(
    img: Vec<u8>,
    slice_bytes: u64,
    prefetch: bool,
) -> (Exec<MemDevice>, MemDevice, Rc<Chain<MemDevice>>) {
    let (exec, dev, chain) = open(
        img,
        OpenOptions {
            l2_slice_bytes: slice_bytes,
            ..OpenOptions::default()
        },
    );
    let chain = chain.unwrap();
    chain.prefetch().set_on(prefetch);
    (exec, dev, chain)
}

/// Submits one request with `submit(tag)` and polls until it completes.
fn wait_for(exec: &Exec<MemDevice>, submit: impl FnOnce(u64)) -> Result<(), Error> {
    submit(11);
    let result: RefCell<Option<Result<(), Error>>> = RefCell::new(None);
    while result.borrow().is_none() {
        exec.poll(&mut |tag, r| {
            assert_eq!(tag, 11);
            *result.borrow_mut() = Some(r);
        });
    }
    result.into_inner().unwrap()
}

/// Opens `img` for writing (the image must open).
fn open_writable(img: Vec<u8>) -> (Exec<MemDevice>, MemDevice, Rc<Chain<MemDevice>>) {
    let (exec, dev, chain) = open(
        img,
        OpenOptions {
            writable: true,
            ..OpenOptions::default()
        },
    );
    (exec, dev, chain.unwrap())
}

/// The device's image (flushed by the caller) passes `qemu-img check` and compares equal
/// to `raw`.
fn check_and_compare(dir: &Path, dev: &MemDevice, raw: &[u8]) {
    let out = dir.join("after.qcow2");
    std::fs::write(&out, dev.contents()).unwrap();
    sh(Command::new("qemu-img").args(["check", "-q"]).arg(&out));
    std::fs::write(dir.join("after.raw"), raw).unwrap();
    sh(Command::new("qemu-img")
        .args(["compare", "-q", "-f", "qcow2", "-F", "raw"])
        .arg(&out)
        .arg(dir.join("after.raw")));
}

/// Where the direct path maps `[off, off + len)`: the extent `Chain::route_read` (with
/// `write`, `Chain::route_write`) grants, the grant finished at once.
fn direct_host(
    exec: &Exec<MemDevice>,
    chain: &Chain<MemDevice>,
    off: u64,
    len: u64,
    write: bool,
) -> Option<u64> {
    let grant = match write {
        true => match chain.route_write(off, len) {
            WriteRoute::Direct(g) => Some(g),
            WriteRoute::Engine | WriteRoute::Owner { .. } => None,
        },
        false => match chain.route_read(off, len) {
            ReadRoute::Direct(g) => Some(g),
            ReadRoute::Engine => None,
        },
    };
    grant.map(|g| {
        let host = g.host().0;
        g.finish(exec);
        host
    })
}

/// A slice written front to back maps without loading its entries (`LinearSlice`); the
/// owner's changes to one entry (discard, reallocation elsewhere) are seen at once by the
/// look-ups that follow, on the direct path and through the engine, and the image stays
/// what qemu-img expects.
#[test]
fn linear_slices_follow_the_owners_changes() {
    let dir = tempfile::tempdir().unwrap();
    let (img, mut raw) = make_image(
        dir.path(),
        "cluster_size=65536",
        "64M",
        &["write -P 0x11 0 32M"],
    );
    let map = qemu_map(&dir.path().join("img.qcow2"));
    assert_eq!(
        map[0].1,
        32 << 20,
        "qemu-io allocated the first 32 MiB in one run"
    );
    let h0 = map[0].3.unwrap();
    let cs = 65536u64;
    let (exec, dev, chain) = open_writable(img);
    submit_and_wait(&exec, &chain, 0, 4096).unwrap();
    let host = |off: u64| direct_host(&exec, &chain, off, 4096, false);
    for c in [0, 1, 5, 511] {
        assert_eq!(host(c * cs), Some(h0 + c * cs), "cluster {c}");
    }
    // Discard cluster 5: it reads as zeros, its neighbours stay where they were.
    wait_for(&exec, |t| host::discard(&chain, t, 5 * cs, cs)).unwrap();
    raw[5 * cs as usize..6 * cs as usize].fill(0);
    assert_eq!(host(5 * cs), None);
    assert_eq!(host(4 * cs), Some(h0 + 4 * cs));
    assert_eq!(host(6 * cs), Some(h0 + 6 * cs));
    assert_eq!(
        submit_and_wait(&exec, &chain, 5 * cs, 4096).unwrap(),
        vec![0; 4096]
    );
    // Write it again: wherever the allocator puts it, reads follow the new entry.
    let buf = HeapBuf::new(cs as usize);
    buf.copy_in(0, &vec![0x22; cs as usize]);
    wait_for(&exec, |t| {
        host::write(&chain, t, 5 * cs, BufSlice::whole(buf))
    })
    .unwrap();
    raw[5 * cs as usize..6 * cs as usize].fill(0x22);
    let h5 = host(5 * cs).expect("cluster 5 allocated");
    assert_eq!(dev.0.borrow().data[h5 as usize], 0x22);
    for c in [4, 5, 6] {
        assert_eq!(
            submit_and_wait(&exec, &chain, c * cs, 4096).unwrap(),
            raw[(c * cs) as usize..(c * cs + 4096) as usize],
            "cluster {c}"
        );
    }
    wait_for(&exec, |t| host::flush(&chain, t)).unwrap();
    check_and_compare(dir.path(), &dev, &raw);
}

/// A linear slice maps a range inside it to one extent (however many clusters it spans);
/// a range leaving the slice, or clusters past the end of the device (a truncated image),
/// go the general way: the truncated part is refused, never read past the device.
#[test]
fn linear_extents_stop_at_slices_and_at_the_device_end() {
    let dir = tempfile::tempdir().unwrap();
    let (mut img, raw) = make_image(
        dir.path(),
        "cluster_size=65536",
        "96M",
        &["write -P 0x11 0 32M", "write -P 0x33 32M 32M"],
    );
    let map = qemu_map(&dir.path().join("img.qcow2"));
    assert_eq!(map[0].1, 64 << 20, "qemu-io allocated 64 MiB in one run");
    let h0 = map[0].3.unwrap();
    // Cut the file 8 MiB into the second slice's data (32 MiB of guest space per slice).
    let cut = h0 + (40 << 20);
    img.truncate(cut as usize);
    let (exec, _dev, chain) = open(img, OpenOptions::default());
    let chain = chain.unwrap();
    submit_and_wait(&exec, &chain, 0, 4096).unwrap();
    submit_and_wait(&exec, &chain, 32 << 20, 4096).unwrap();
    let host = |off: u64, len: u64| direct_host(&exec, &chain, off, len, false);
    // 1 MiB (16 clusters) inside slice 0: one extent.
    assert_eq!(host(3 << 20, 1 << 20), Some(h0 + (3 << 20)));
    // Crossing into slice 1: still one extent (the general path joins contiguous
    // clusters), and the same bytes as qemu's.
    let across = (32 << 20) - 65536;
    assert_eq!(host(across, 131072), Some(h0 + across));
    assert_eq!(
        submit_and_wait(&exec, &chain, across, 131072).unwrap(),
        raw[across as usize..across as usize + 131072]
    );
    // Slice 1's clusters before the cut are served; those past it are not.
    assert_eq!(host(36 << 20, 65536), Some(h0 + (36 << 20)));
    assert_eq!(host(48 << 20, 4096), None);
    assert_eq!(
        host((40 << 20) - 65536, 131072),
        None,
        "its second cluster is cut"
    );
    assert!(
        submit_and_wait(&exec, &chain, 48 << 20, 4096).is_err(),
        "a cluster past the device's end is an error, not a read past it"
    );
}

/// Outside linear slices the cache still maps a range inside one cluster straight from its
/// entry: any plain data cluster for a read, only a COPIED one for an in-place write; a
/// range over two clusters that are not adjacent on the device is not one extent.
#[test]
fn single_cluster_extents_from_non_linear_slices() {
    let dir = tempfile::tempdir().unwrap();
    // Cluster 1 is allocated before cluster 0: the slice is not linear.
    let (img, raw) = make_image(
        dir.path(),
        "cluster_size=65536",
        "8M",
        &["write -P 0x11 64k 64k", "write -P 0x22 0 64k"],
    );
    let map = qemu_map(&dir.path().join("img.qcow2"));
    let host_of = |g: u64| {
        map.iter()
            .find(|e| e.0 <= g && g < e.0 + e.1)
            .and_then(|e| e.3.map(|h| h + g - e.0))
    };
    let (h0, h1) = (host_of(0).unwrap(), host_of(65536).unwrap());
    assert_eq!(h0, h1 + 65536, "qemu placed cluster 0 after cluster 1");
    let check = |img: Vec<u8>, writes_in_place: bool| {
        let (exec, _dev, chain) = open_writable(img);
        submit_and_wait(&exec, &chain, 0, 4096).unwrap();
        let host = |off: u64, len: u64, write: bool| direct_host(&exec, &chain, off, len, write);
        assert_eq!(host(4096, 4096, false), Some(h0 + 4096));
        assert_eq!(host(65536 + 512, 512, false), Some(h1 + 512));
        assert_eq!(host(61440, 8192, false), None, "two clusters, not adjacent");
        let w = writes_in_place.then_some(h0 + 4096);
        assert_eq!(host(4096, 4096, true), w);
        assert_eq!(
            submit_and_wait(&exec, &chain, 61440, 8192).unwrap(),
            raw[61440..61440 + 8192]
        );
    };
    check(img, true);
    // An internal snapshot shares the clusters: no longer COPIED, so no in-place write,
    // while reads still map.
    sh(Command::new("qemu-img")
        .args(["snapshot", "-c", "s1"])
        .arg(dir.path().join("img.qcow2")));
    check(std::fs::read(dir.path().join("img.qcow2")).unwrap(), false);
}

/// A write the direct path found no in-place plan for goes down the slow path, allocates,
/// and reads back; the next look-up of that range maps it directly. A refused range that
/// the host never submits does not keep a different in-place write off the fast path
/// (what the route found travels in the plan's task, not in the chain).
#[test]
fn a_write_the_direct_path_refused_is_written_once_by_the_slow_path() {
    let dir = tempfile::tempdir().unwrap();
    let (img, mut raw) = make_image(
        dir.path(),
        "cluster_size=65536",
        "16M",
        &["write -P 0x11 0 64k", "write -P 0x11 128k 64k"],
    );
    let cs = 65536u64;
    let (exec, dev, chain) = open_writable(img);
    submit_and_wait(&exec, &chain, 0, 4096).unwrap();
    // Cluster 1 is unallocated: no direct extent for a write there.
    assert_eq!(direct_host(&exec, &chain, cs, 4096, true), None);
    let buf = HeapBuf::new(4096);
    buf.copy_in(0, &[0x5a; 4096]);
    let tasks = exec.stats().tasks_spawned;
    wait_for(&exec, |t| {
        host::write(&chain, t, cs, BufSlice::whole(buf.clone()))
    })
    .unwrap();
    assert_eq!(
        exec.stats().tasks_spawned,
        tasks + 1,
        "the slow path ran it"
    );
    raw[cs as usize..(cs + 4096) as usize].fill(0x5a);
    assert_eq!(
        submit_and_wait(&exec, &chain, cs, 4096).unwrap(),
        raw[cs as usize..(cs + 4096) as usize]
    );
    let h1 = direct_host(&exec, &chain, cs, 4096, true).expect("allocated now, in place");
    assert_eq!(dev.0.borrow().data[h1 as usize], 0x5a);
    // A refused range the host drops (cluster 3), then an in-place write elsewhere: that
    // one still takes the fast path (no task).
    assert_eq!(direct_host(&exec, &chain, 3 * cs, 4096, true), None);
    let tasks = exec.stats().tasks_spawned;
    wait_for(&exec, |t| {
        host::write(&chain, t, 2 * cs, BufSlice::whole(buf.clone()))
    })
    .unwrap();
    assert_eq!(
        exec.stats().tasks_spawned,
        tasks,
        "in place, on the fast path"
    );
    raw[2 * cs as usize..(2 * cs + 4096) as usize].fill(0x5a);
    wait_for(&exec, |t| host::flush(&chain, t)).unwrap();
    check_and_compare(dir.path(), &dev, &raw);
}

/// Device operations other than reads submitted so far (writes, and flushes if any).
fn device_writes(dev: &MemDevice) -> u64 {
    let s = dev.0.borrow();
    s.ops - s.reads
}

/// With extended L2, an overwrite of allocated subclusters of a COPIED cluster changes no
/// metadata: it is planned from the cache and written in place (one device write, no
/// task), like a standard cluster; a write that touches an unallocated or zero subcluster
/// takes the slow path, which updates the bitmap. The image stays what qemu-img expects.
#[test]
fn extended_l2_overwrites_of_allocated_subclusters_take_the_fast_path() {
    let dir = tempfile::tempdir().unwrap();
    // 64 KiB clusters of 32 subclusters of 2 KiB: cluster 0 allocated whole, cluster 1 in
    // its first two subclusters only, cluster 2 zero.
    let (img, mut raw) = make_image(
        dir.path(),
        "cluster_size=65536,extended_l2=on",
        "16M",
        &[
            "write -P 0x11 0 64k",
            "write -P 0x22 64k 4k",
            "write -z 128k 64k",
        ],
    );
    let k = 1024u64;
    let (exec, dev, chain) = open_writable(img);
    assert_eq!(
        submit_and_wait(&exec, &chain, 0, 256 << 10).unwrap(),
        raw[..256 << 10]
    );
    let h0 = direct_host(&exec, &chain, 0, 4096, false).expect("cluster 0 reads directly");
    let h1 = direct_host(&exec, &chain, 64 * k, 4096, false).expect("cluster 1, allocated part");
    // (offset, length, in place on the fast path)
    let cases = [
        (8 * k, 4 * k, true),
        (64 * k, 4 * k, true),
        // Across two allocated subclusters of cluster 1 (2 KiB each), at an odd offset.
        (65 * k, 2 * k, true),
        // Into cluster 1's unallocated subclusters, and across the boundary.
        (72 * k, 4 * k, false),
        (66 * k, 4 * k, false),
        // Zero subclusters.
        (130 * k, 4 * k, false),
    ];
    for (i, &(off, len, fast)) in cases.iter().enumerate() {
        let planned = direct_host(&exec, &chain, off, len, true);
        if fast {
            let want = if off < 64 * k {
                h0 + off
            } else {
                h1 + off - 64 * k
            };
            assert_eq!(planned, Some(want), "case {i}: in place");
        } else {
            assert_eq!(planned, None, "case {i}: needs the slow path");
        }
        let fill = 0x40 + i as u8;
        let buf = HeapBuf::new(len as usize);
        buf.copy_in(0, &vec![fill; len as usize]);
        let (tasks, writes) = (exec.stats().tasks_spawned, device_writes(&dev));
        wait_for(&exec, |t| {
            host::write(&chain, t, off, BufSlice::whole(buf.clone()))
        })
        .unwrap();
        if fast {
            assert_eq!(exec.stats().tasks_spawned, tasks, "case {i}: no task");
            assert_eq!(
                device_writes(&dev) - writes,
                1,
                "case {i}: one device write"
            );
        } else {
            assert_eq!(exec.stats().tasks_spawned, tasks + 1, "case {i}: slow path");
        }
        raw[off as usize..(off + len) as usize].fill(fill);
        assert_eq!(
            submit_and_wait(&exec, &chain, 0, 256 << 10).unwrap(),
            raw[..256 << 10],
            "case {i}"
        );
    }
    wait_for(&exec, |t| host::flush(&chain, t)).unwrap();
    check_and_compare(dir.path(), &dev, &raw);
}

/// With extended L2, a slice of whole clusters (every subcluster allocated data) at
/// consecutive host offsets is linear too: look-ups compute the mapping from its summary
/// (no entry to prefetch) and a range across clusters is one extent. A subcluster that
/// comes to read as zeros spoils it, and writing data there again makes it linear again.
#[test]
fn extended_l2_slices_of_whole_clusters_are_linear() {
    let dir = tempfile::tempdir().unwrap();
    // 64 KiB clusters: a 4 KiB slice holds 256 extended entries, 16 MiB.
    let (img, mut raw) = make_image(
        dir.path(),
        "cluster_size=65536,extended_l2=on",
        "32M",
        &["write -P 0x11 0 16M"],
    );
    let map = qemu_map(&dir.path().join("img.qcow2"));
    assert_eq!(map[0].1, 16 << 20, "qemu-io allocated 16 MiB in one run");
    let h0 = map[0].3.unwrap();
    let k = 1024u64;
    let (exec, dev, chain) = open_writable(img);
    submit_and_wait(&exec, &chain, 0, 4096).unwrap();
    assert_eq!(chain.disk().entry_hint(0), None, "linear: no entry to load");
    assert_eq!(
        direct_host(&exec, &chain, 60 * k, 512 * k, false),
        Some(h0 + 60 * k)
    );
    // Subcluster 4 of cluster 1 reads as zeros now.
    wait_for(&exec, |t| {
        host::write_zeroes(&chain, t, 72 * k, 2 * k, false)
    })
    .unwrap();
    raw[72 * k as usize..74 * k as usize].fill(0);
    assert!(chain.disk().entry_hint(0).is_some(), "no longer linear");
    assert_eq!(direct_host(&exec, &chain, 64 * k, 64 * k, false), None);
    assert_eq!(
        direct_host(&exec, &chain, 0, 64 * k, true),
        Some(h0),
        "cluster 0 still in place"
    );
    assert_eq!(
        submit_and_wait(&exec, &chain, 0, 256 << 10).unwrap(),
        raw[..256 << 10]
    );
    // Data there again: the cluster is whole, in place, and the slice linear again.
    let buf = HeapBuf::new(2048);
    buf.copy_in(0, &[0x5a; 2048]);
    wait_for(&exec, |t| {
        host::write(&chain, t, 72 * k, BufSlice::whole(buf.clone()))
    })
    .unwrap();
    raw[72 * k as usize..74 * k as usize].fill(0x5a);
    assert_eq!(chain.disk().entry_hint(0), None, "linear again");
    assert_eq!(
        direct_host(&exec, &chain, 72 * k, 2 * k, false),
        Some(h0 + 72 * k)
    );
    assert_eq!(
        submit_and_wait(&exec, &chain, 0, 256 << 10).unwrap(),
        raw[..256 << 10]
    );
    wait_for(&exec, |t| host::flush(&chain, t)).unwrap();
    check_and_compare(dir.path(), &dev, &raw);
}

/// Opens `img` writable on a fixed-size device of `size` bytes (like a bdev), with the
/// ordered layout or not.
fn open_fixed(
    img: Vec<u8>,
    size: usize,
    ordered_layout: bool,
) -> (Exec<MemDevice>, MemDevice, Rc<Chain<MemDevice>>) {
    let exec = Exec::new();
    let dev = MemDevice::fixed(img, size);
    let id = exec.add_device(dev.clone());
    let e2 = exec.clone();
    let opts = OpenOptions {
        writable: true,
        ordered_layout,
        ..OpenOptions::default()
    };
    let q = exec.block_on(async move { Qcow2::open(&e2, id, opts).await });
    let chain = Chain::new(&exec, vec![Layer::Qcow2(Box::new(q.unwrap()))]).unwrap();
    (exec, dev, chain)
}

/// Writes cluster `c` (64 KiB) with a pattern of its own; returns the pattern byte.
fn write_cluster(exec: &Exec<MemDevice>, chain: &Rc<Chain<MemDevice>>, c: u64) -> u8 {
    let cs = 65536usize;
    let fill = (c % 251) as u8 + 1;
    let buf = HeapBuf::new(cs);
    buf.copy_in(0, &vec![fill; cs]);
    wait_for(exec, |t| {
        host::write(chain, t, c * cs as u64, BufSlice::whole(buf.clone()))
    })
    .unwrap();
    fill
}

/// Guest clusters `0..n` in a scrambled order (a fixed permutation).
fn scrambled(n: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    let mut x = 0x9e37_79b9_u64;
    for i in (1..v.len()).rev() {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        v.swap(i, (x >> 33) as usize % (i + 1));
    }
    v
}

/// With the ordered layout, on a device that cannot grow (a bdev), the allocator reserves
/// a host region per L2 slice: clusters written in any order land in guest order, so each
/// slice is one extent (linear) and sequential reads are sequential on the device.
/// qemu-img agrees with the layout, the refcounts and the content. Without it (the
/// default) the same writes are appended in the order they come.
#[test]
fn on_a_fixed_device_slices_written_in_any_order_are_laid_out_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let (img, _) = make_image(dir.path(), "cluster_size=65536", "64M", &[]);
    let cs = 65536u64;
    {
        let (exec, _, chain) = open_fixed(img.clone(), 80 << 20, false);
        for c in scrambled(1024) {
            write_cluster(&exec, &chain, c);
        }
        submit_and_wait(&exec, &chain, 0, 4096).unwrap();
        assert!(
            chain.disk().entry_hint(0).is_some(),
            "appended: full but not linear"
        );
    }
    let (exec, dev, chain) = open_fixed(img, 80 << 20, true);
    let mut raw = vec![0u8; 64 << 20];
    // Two slices of 512 clusters (4 KiB slices), written in one scrambled order that
    // interleaves them.
    for c in scrambled(1024) {
        let fill = write_cluster(&exec, &chain, c);
        raw[(c * cs) as usize..((c + 1) * cs) as usize].fill(fill);
    }
    wait_for(&exec, |t| host::flush(&chain, t)).unwrap();
    check_and_compare(dir.path(), &dev, &raw);
    let map = qemu_map(&dir.path().join("after.qcow2"));
    for slice in 0..2u64 {
        let (lo, hi) = (slice * 512 * cs, (slice + 1) * 512 * cs);
        let extents: Vec<_> = map
            .iter()
            .filter(|e| e.2 && e.0 < hi && e.0 + e.1 > lo)
            .collect();
        assert_eq!(extents.len(), 1, "slice {slice}: {extents:?}");
        assert!(extents[0].0 <= lo && extents[0].0 + extents[0].1 >= hi);
    }
    // And the slices are linear in the cache: no entry to load.
    submit_and_wait(&exec, &chain, 0, 4096).unwrap();
    assert_eq!(chain.disk().entry_hint(0), None);
}

/// A fixed device with room for the data and metadata but hardly more: with 4 KiB
/// clusters every slice is a whole L2 table, allocated beside the regions; half of each
/// slice is written, so the first region leaves no room for the second, and once the
/// space outside the first region is used up, allocations (data and L2 tables) take the
/// first region's free slots. Every write succeeds; the image checks clean and reads back.
#[test]
fn a_full_fixed_device_still_takes_every_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let (img, _) = make_image(dir.path(), "cluster_size=4096", "8M", &[]);
    let cs = 4096u64;
    let written: Vec<u64> = scrambled(2048).into_iter().take(1000).collect();
    // What the image has, the data, four L2 tables, 2 spare.
    let clusters = img.len() as u64 / cs + written.len() as u64 + 4 + 2;
    let (exec, dev, chain) = open_fixed(img, (clusters * cs) as usize, true);
    let mut raw = vec![0u8; (2048 * cs) as usize];
    for &c in &written {
        let fill = (c % 251) as u8 + 1;
        let buf = HeapBuf::new(cs as usize);
        buf.copy_in(0, &vec![fill; cs as usize]);
        wait_for(&exec, |t| {
            host::write(&chain, t, c * cs, BufSlice::whole(buf.clone()))
        })
        .unwrap_or_else(|e| panic!("cluster {c}: {e}"));
        raw[(c * cs) as usize..((c + 1) * cs) as usize].fill(fill);
    }
    wait_for(&exec, |t| host::flush(&chain, t)).unwrap();
    check_and_compare(dir.path(), &dev, &raw);
}

/// The ordered layout after a reopen: a slice half written before it keeps its region
/// (found from where its data lies), so the other half, written in any order after the
/// reopen, completes it in guest order.
#[test]
fn the_ordered_layout_continues_a_slice_after_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let (img, _) = make_image(dir.path(), "cluster_size=65536", "32M", &[]);
    let cs = 65536u64;
    let size = 48 << 20;
    let order = scrambled(512);
    let mut raw = vec![0u8; 32 << 20];
    let mut write = |exec: &Exec<MemDevice>, chain: &Rc<Chain<MemDevice>>, cs_: &[u64]| {
        for &c in cs_ {
            let fill = write_cluster(exec, chain, c);
            raw[(c * cs) as usize..((c + 1) * cs) as usize].fill(fill);
        }
        wait_for(exec, |t| host::flush(chain, t)).unwrap();
    };
    let (exec, dev, chain) = open_fixed(img, size, true);
    // Half the slice (a fresh reservation after the reopen would start past that data).
    write(&exec, &chain, &order[..256]);
    let before = dev.contents();
    drop(chain);
    let (exec, dev, chain) = open_fixed(before, size, true);
    write(&exec, &chain, &order[256..]);
    submit_and_wait(&exec, &chain, 0, 4096).unwrap();
    assert_eq!(
        chain.disk().entry_hint(0),
        None,
        "linear: the region was kept"
    );
    check_and_compare(dir.path(), &dev, &raw);
}

/// The owner's metadata counters (writable image).
fn owner_stats(chain: &Chain<MemDevice>) -> qcow2_engine::meta::OwnerStats {
    match &chain.layers()[0] {
        Layer::Qcow2(q) => q.owner_stats().unwrap(),
        Layer::Raw { .. } => panic!("not a qcow2 layer"),
    }
}

/// Ticks the background write-back every millisecond for `d` (a quiet counts only as the
/// owner's poll loop observes it): whether a tick started one, stopping at it.
fn ticked_quietly(chain: &Rc<Chain<MemDevice>>, d: std::time::Duration) -> bool {
    let t0 = std::time::Instant::now();
    while t0.elapsed() < d {
        if chain.tick_background_writeback() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    false
}

/// Dirty metadata that stays unchanged for the background interval is written back without
/// a guest flush, in dependency order: the device then holds an image qemu-img checks clean
/// with the data written; a new allocation restarts the interval.
#[test]
fn quiet_dirty_metadata_is_written_back_without_a_flush() {
    let dir = tempfile::tempdir().unwrap();
    let (img, mut raw) = make_image(dir.path(), "cluster_size=65536", "16M", &[]);
    let (exec, dev, chain) = open_writable(img);
    let write = |off: u64, byte: u8| {
        let buf = HeapBuf::new(4096);
        buf.copy_in(0, &[byte; 4096]);
        wait_for(&exec, |t| host::write(&chain, t, off, BufSlice::whole(buf))).unwrap();
    };
    write(3 << 16, 0x33);
    raw[3 << 16..(3 << 16) + 4096].fill(0x33);
    assert_eq!(owner_stats(&chain).l2_slices_written, 0, "no flush yet");
    // The first look starts the quiet interval; a new allocation restarts it.
    assert!(!chain.tick_background_writeback());
    std::thread::sleep(qcow2_engine::meta::BACKGROUND_WRITEBACK_INTERVAL / 2);
    write(7 << 16, 0x77);
    raw[7 << 16..(7 << 16) + 4096].fill(0x77);
    assert!(
        !chain.tick_background_writeback(),
        "an allocation restarts the interval"
    );
    assert_eq!(owner_stats(&chain).l2_slices_written, 0);
    assert!(ticked_quietly(
        &chain,
        qcow2_engine::meta::BACKGROUND_WRITEBACK_INTERVAL * 20
    ));
    while exec.busy() {
        exec.poll(&mut |_, _| panic!("no guest request is in flight"));
    }
    let st = owner_stats(&chain);
    assert!(st.l2_slices_written >= 1 && st.writebacks >= 1, "{st:?}");
    assert!(
        !chain.tick_background_writeback(),
        "nothing is dirty any more"
    );
    check_and_compare(dir.path(), &dev, &raw);
}

/// A background write-back that fails leaves the metadata dirty, is not retried at once
/// (a failing device is not hammered), and the next guest flush writes everything.
#[test]
fn a_failed_background_writeback_waits_and_leaves_the_metadata_for_the_flush() {
    let dir = tempfile::tempdir().unwrap();
    let (img, mut raw) = make_image(dir.path(), "cluster_size=65536", "16M", &[]);
    let (exec, dev, chain) = open_writable(img);
    let buf = HeapBuf::new(4096);
    buf.copy_in(0, &[0x55; 4096]);
    wait_for(&exec, |t| {
        host::write(&chain, t, 5 << 16, BufSlice::whole(buf))
    })
    .unwrap();
    raw[5 << 16..(5 << 16) + 4096].fill(0x55);
    assert!(!chain.tick_background_writeback());
    // The write-back's first device operation fails.
    let next = dev.0.borrow().ops;
    dev.0.borrow_mut().fail_op = Some((next, 5));
    assert!(ticked_quietly(
        &chain,
        qcow2_engine::meta::BACKGROUND_WRITEBACK_INTERVAL * 20
    ));
    while exec.busy() {
        exec.poll(&mut |_, _| panic!("no guest request is in flight"));
    }
    dev.0.borrow_mut().fail_op = None;
    assert_eq!(owner_stats(&chain).l2_slices_written, 0);
    assert!(
        !ticked_quietly(
            &chain,
            qcow2_engine::meta::BACKGROUND_WRITEBACK_INTERVAL * 4
        ),
        "a failed write-back is retried after a second, not after the interval"
    );
    wait_for(&exec, |t| host::flush(&chain, t)).unwrap();
    assert!(owner_stats(&chain).l2_slices_written >= 1);
    check_and_compare(dir.path(), &dev, &raw);
}

/// First writes are planned on the spot, without a planning task, when their metadata is
/// in memory (`writes_planned_now`): whole new clusters, two-cluster writes (one run of
/// host clusters), and sector writes into clusters that read as zeros (a backing file
/// shows through elsewhere: the COW data comes from it). Many are in flight at once, some
/// on the same clusters (they wait for the allocation in flight, then overwrite in place);
/// the image qemu-img checks clean holds exactly what was written.
#[test]
fn first_writes_planned_on_the_spot_land_where_qemu_reads_them() {
    // One cluster per first write (no clusters taken ahead).
    first_writes_planned_on_the_spot("cluster_size=4096", 0, 512);
    // 2 KiB subclusters: most writes set bits in the bitmap of a cluster allocated already
    // (in place, planned on the spot too); writes of 512 bytes inside a subcluster that
    // reads as zeros write all of it.
    first_writes_planned_on_the_spot(
        "cluster_size=65536,extended_l2=on",
        OpenOptions::default().alloc_granule,
        512,
    );
}

/// With clusters taken ahead (`alloc_granule`, 16 clusters of 4 KiB here), the first write
/// into a group takes all of it unless another write into the group is in flight (then
/// it takes its own cluster): fewer writes are planned, many overwrite in place, and the
/// clusters taken and left unwritten read as zeros (the image qemu-img checks clean
/// compares equal to the model).
#[test]
fn first_writes_take_their_group_ahead_and_the_rest_read_zeros() {
    let st = first_writes_planned_on_the_spot("cluster_size=4096", 64 << 10, 16);
    assert!(st.writes_planned_now < 400, "{st:?}");
    assert!(st.clusters_taken_ahead >= 512, "{st:?}");
}

/// A group some of whose clusters are allocated already (here by qemu-io, or by a first
/// write through the task path) is still taken by the next first write planned on the
/// spot: its unallocated clusters, one host run in guest order, and nothing else.
#[test]
fn a_partly_allocated_group_is_taken_by_the_next_first_write() {
    let dir = tempfile::tempdir().unwrap();
    let (img, mut raw) = make_image(
        dir.path(),
        "cluster_size=4096",
        "8M",
        &["write -P 7 12K 4K", "write -P 8 36K 4K"],
    );
    let (exec, dev, chain) = open(
        img,
        OpenOptions {
            writable: true,
            alloc_granule: 64 << 10,
            ..OpenOptions::default()
        },
    );
    let chain = chain.unwrap();
    let write = |c: u64, byte: u8, raw: &mut Vec<u8>| {
        let buf = HeapBuf::new(4096);
        buf.copy_in(0, &[byte; 4096]);
        raw[(c << 12) as usize..((c + 1) << 12) as usize].fill(byte);
        wait_for(&exec, |t| {
            host::write(&chain, t, c << 12, BufSlice::whole(buf))
        })
        .unwrap();
    };
    // Through the task path (the slice is not in the owner's cache yet): one cluster.
    write(20, 1, &mut raw);
    let before = owner_stats(&chain);
    // Group 0..16 less clusters 3 and 9; group 16..32 less cluster 20.
    write(5, 2, &mut raw);
    write(22, 3, &mut raw);
    let after = owner_stats(&chain);
    assert_eq!(
        after.writes_planned_now - before.writes_planned_now,
        2,
        "{after:?}"
    );
    assert_eq!(
        after.clusters_taken_ahead - before.clusters_taken_ahead,
        13 + 14,
        "{after:?}"
    );
    let host = |c: u64| direct_host(&exec, &chain, c << 12, 4096, true).expect("allocated");
    let taken: Vec<u64> = (0..16).filter(|c| ![3, 9].contains(c)).collect();
    for w in taken.windows(2) {
        assert_eq!(
            host(w[1]),
            host(w[0]) + 4096,
            "one run in guest order: {w:?}"
        );
    }
    // The clusters taken ahead read zeros and take overwrites in place.
    write(0, 4, &mut raw);
    write(31, 5, &mut raw);
    wait_for(&exec, |t| host::flush(&chain, t)).unwrap();
    check_and_compare(dir.path(), &dev, &raw);
}

fn first_writes_planned_on_the_spot(
    opts: &str,
    granule: u64,
    at_least: u64,
) -> qcow2_engine::meta::OwnerStats {
    let dir = tempfile::tempdir().unwrap();
    let (img, mut raw) = make_image(dir.path(), opts, "8M", &[]);
    let (exec, dev, chain) = open(
        img,
        OpenOptions {
            writable: true,
            alloc_granule: granule,
            ..OpenOptions::default()
        },
    );
    let chain = chain.unwrap();
    let inflight = RefCell::new(std::collections::HashMap::new());
    let tag = std::cell::Cell::new(0u64);
    let submit = |off: u64, len: usize, byte: u8, raw: &mut Vec<u8>| {
        let buf = HeapBuf::new(len);
        buf.copy_in(0, &vec![byte; len]);
        raw[off as usize..off as usize + len].fill(byte);
        tag.set(tag.get() + 1);
        inflight.borrow_mut().insert(tag.get(), (off, len));
        host::write(&chain, tag.get(), off, BufSlice::whole(buf));
    };
    let drain = || {
        while !inflight.borrow().is_empty() {
            exec.poll(&mut |tag, r| {
                let w = inflight
                    .borrow_mut()
                    .remove(&tag)
                    .expect("a request in flight");
                r.unwrap_or_else(|e| panic!("write {w:?}: {e}"));
            });
        }
    };
    // The L2 table and the refcount block come first, through the task path; the new
    // table's slice is then in the owner's cache: an overwrite maps directly.
    submit(0, 4096, 1, &mut raw);
    drain();
    assert!(direct_host(&exec, &chain, 0, 4096, true).is_some());
    let before = owner_stats(&chain).writes_planned_now;
    // 33 requests in flight per batch, over the clusters of the first half in a scrambled
    // order.
    let order = scrambled(1023);
    for (i, chunk) in order.chunks(32).enumerate() {
        for (j, &c) in chunk.iter().enumerate() {
            let c = c + 1;
            let byte = ((i * 32 + j) % 250) as u8 + 2;
            match j % 4 {
                0 | 1 => submit(c << 12, 4096, byte, &mut raw),
                // Two clusters, the second perhaps written already (then not planned here).
                2 if c + 1 < 1024 => submit(c << 12, 8192, byte, &mut raw),
                // A sector in the middle: the rest of the new cluster reads as zeros.
                _ => submit((c << 12) + 1024, 512, byte, &mut raw),
            }
        }
        // The same cluster twice in one batch: the second waits for the first's commit.
        submit((chunk[0] + 1) << 12, 4096, 0xee, &mut raw);
        drain();
    }
    let planned = owner_stats(&chain).writes_planned_now - before;
    assert!(
        planned >= at_least,
        "{opts}: most first writes are planned on the spot: {planned}"
    );
    wait_for(&exec, |t| host::flush(&chain, t)).unwrap();
    check_and_compare(dir.path(), &dev, &raw);
    owner_stats(&chain)
}

/// A first write that comes while a flush writes metadata back (holding the metadata lock,
/// on a slow device) is not planned on the spot, although its slice and refcount block are
/// in memory (lazy refcounts keep the blocks there): it waits for the lock in a task, and
/// lands where qemu-img reads it.
#[test]
fn a_first_write_during_a_writeback_waits_for_the_metadata_lock() {
    let dir = tempfile::tempdir().unwrap();
    let (img, mut raw) = make_image(dir.path(), "cluster_size=4096,lazy_refcounts=on", "8M", &[]);
    let (exec, dev, chain) = open_writable(img);
    let write = |c: u64, byte: u8, raw: &mut Vec<u8>| {
        let buf = HeapBuf::new(4096);
        buf.copy_in(0, &[byte; 4096]);
        raw[(c << 12) as usize..((c + 1) << 12) as usize].fill(byte);
        host::write(&chain, c, c << 12, BufSlice::whole(buf));
    };
    let drain = |n: usize| {
        let mut left = n;
        while left > 0 {
            exec.poll(&mut |c, r| {
                r.unwrap_or_else(|e| panic!("request {c}: {e}"));
                left -= 1;
            });
        }
    };
    // Two L2 tables, clean; then a change in the first for the flush to write back.
    write(0, 0x10, &mut raw);
    write(600, 0x11, &mut raw);
    drain(2);
    wait_for(&exec, |t| host::flush(&chain, t)).unwrap();
    write(1, 0x12, &mut raw);
    drain(1);
    let before = owner_stats(&chain).writes_planned_now;
    assert!(before >= 1, "the last write was planned on the spot");
    dev.0.borrow_mut().latency_polls = 4;
    host::flush(&chain, 9999);
    exec.poll(&mut |_, _| panic!("the flush is still writing"));
    // A new cluster of the other table (cached, clean).
    write(601, 0x13, &mut raw);
    assert_eq!(owner_stats(&chain).writes_planned_now, before);
    drain(2);
    let c2 = chain.clone();
    exec.block_on(async move { c2.close().await }).unwrap();
    check_and_compare(dir.path(), &dev, &raw);
}

/// A fixed device (a bdev) that fills up: the first write that finds no room fails with
/// ENOSPC, on the spot or in the task, and leaves nothing behind (no cluster taken for
/// it); every write before it is there, and the image checks clean.
#[test]
fn a_full_device_fails_the_write_that_finds_no_room_and_leaks_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (img, mut raw) = make_image(dir.path(), "cluster_size=4096", "8M", &[]);
    // Room for the metadata and a few hundred data clusters.
    let size = img.len().next_multiple_of(4096) + (300 << 12);
    let (exec, dev, chain) = open_fixed(img, size, false);
    let mut failed = None;
    for c in 0..1000u64 {
        let buf = HeapBuf::new(4096);
        let byte = (c % 250) as u8 + 1;
        buf.copy_in(0, &[byte; 4096]);
        match wait_for(&exec, |t| {
            host::write(&chain, t, c << 12, BufSlice::whole(buf))
        }) {
            Ok(()) => raw[(c << 12) as usize..((c + 1) << 12) as usize].fill(byte),
            Err(e) => {
                failed = Some((c, e));
                break;
            }
        }
    }
    let (c, e) = failed.expect("the device fills up");
    assert!(c > 200, "{c} clusters written");
    assert!(matches!(e, Error::Io(28)), "ENOSPC: {e}");
    let st = owner_stats(&chain);
    assert!(st.writes_planned_now > 100, "{st:?}");
    // Once more: the same answer, and still nothing taken.
    let buf = HeapBuf::new(4096);
    assert!(wait_for(&exec, |t| host::write(
        &chain,
        t,
        c << 12,
        BufSlice::whole(buf)
    ))
    .is_err());
    assert_eq!(
        owner_stats(&chain).clusters_allocated,
        st.clusters_allocated
    );
    let c2 = chain.clone();
    exec.block_on(async move { c2.close().await }).unwrap();
    let img = dev.contents();
    assert_eq!(img.len(), size, "a fixed device does not grow");
    // No refcount past the end of the device (qemu-img check does not look there): the
    // first refcount block covers 2048 clusters of 4 KiB, 16-bit entries.
    let be = |o: usize| u64::from_be_bytes(img[o..o + 8].try_into().unwrap()) as usize;
    let block = be(be(48)) & !0x1ff;
    let past_end = size / 4096;
    assert_eq!(img[block + 2 * past_end..block + 2 * past_end + 2], [0, 0]);
    check_and_compare(dir.path(), &dev, &raw);
}

/// On a device that zeroes cheaply (like an NVMe namespace or a malloc bdev), a first write
/// that covers part of a new cluster (or subcluster) leaves the rest of it to
/// `DeviceOp::WriteZeroes` instead of writing it whole from a zeroed buffer; the device
/// held other data there before, and qemu-img reads zeros around the guest's bytes.
#[test]
fn partial_first_writes_leave_the_zeros_to_a_device_that_zeroes_cheaply() {
    partial_first_writes_on_a_cheaply_zeroing_device("cluster_size=65536", 65536, 8);
    // 64 KiB subclusters of 2 MiB clusters.
    partial_first_writes_on_a_cheaply_zeroing_device(
        "cluster_size=2097152,extended_l2=on",
        65536,
        8,
    );
    // 4 KiB clusters: a few KiB of zeros go along with the data in one write.
    partial_first_writes_on_a_cheaply_zeroing_device("cluster_size=4096", 4096, 0);
}

/// First writes at the start, in the middle, at the end and across two of the image's
/// allocation units (clusters, or subclusters with extended L2) of `unit` bytes;
/// `zeroings`: how many ranges they leave to the device.
fn partial_first_writes_on_a_cheaply_zeroing_device(opts: &str, unit: u64, zeroings: u64) {
    let dir = tempfile::tempdir().unwrap();
    let (img, mut raw) = make_image(dir.path(), opts, "8M", &[]);
    let (exec, dev, chain) = open_fixed(img.clone(), 16 << 20, false);
    {
        // Old data wherever clusters will be allocated.
        let mut s = dev.0.borrow_mut();
        s.data[img.len()..].fill(0xa5);
        s.cheap_zeroes = true;
    }
    let mut write = |off: u64, len: usize, byte: u8| {
        let buf = HeapBuf::new(len);
        buf.copy_in(0, &vec![byte; len]);
        raw[off as usize..off as usize + len].fill(byte);
        wait_for(&exec, |t| host::write(&chain, t, off, BufSlice::whole(buf)))
            .unwrap_or_else(|e| panic!("{opts}: write at {off}: {e}"));
    };
    let u = unit;
    // Zeros before and after the guest's bytes; only after; only before; across two new
    // units (the tail of one, the head of the next).
    write(u + u / 4, 1024, 1);
    write(2 * u, 512, 2);
    write(4 * u - 512, 512, 3);
    write(5 * u + u / 2, 512, 4);
    write(7 * u - 1024, 2048, 5);
    // An overwrite next to a first write: nothing to zero.
    write(u + u / 2, 512, 6);
    wait_for(&exec, |t| host::flush(&chain, t)).unwrap();
    check_and_compare(dir.path(), &dev, &raw);
    assert_eq!(
        dev.0.borrow().zero_writes,
        zeroings,
        "{opts}: the device zeroes around the guest's bytes"
    );
}

/// A guest reading a compressed cluster in pieces reads and decompresses it once, as QEMU
/// does: the core keeps the cluster it decompressed last (one), whole.
#[test]
fn pieces_of_a_compressed_cluster_read_its_stream_once() {
    let dir = tempfile::tempdir().unwrap();
    let (img, raw) = make_image(
        dir.path(),
        "cluster_size=65536",
        "1M",
        &["write -c -P 0x5a 0 64k", "write -c -P 0x6b 64k 64k"],
    );
    let (exec, dev, chain) = open(img, OpenOptions::default());
    let chain = chain.unwrap();
    let reads = || dev.0.borrow().reads;
    // The first piece loads the slice and reads the stream.
    assert_eq!(
        submit_and_wait(&exec, &chain, 0, 4096).unwrap(),
        raw[..4096]
    );
    let before = reads();
    for k in 1..16u64 {
        let off = k * 4096;
        let got = submit_and_wait(&exec, &chain, off, 4096).unwrap();
        assert!(got == raw[off as usize..off as usize + 4096], "piece {k}");
    }
    assert_eq!(reads(), before, "pieces of the kept cluster read nothing");
    // Another cluster takes its place; the first is read again when asked for.
    assert_eq!(
        submit_and_wait(&exec, &chain, 65536, 512).unwrap(),
        raw[65536..65536 + 512]
    );
    assert_eq!(reads(), before + 1);
    assert_eq!(
        submit_and_wait(&exec, &chain, 8192, 512).unwrap(),
        raw[8192..8192 + 512]
    );
    assert_eq!(reads(), before + 2);
}

/// The kept cluster is named by its stream's place and the reuse generation: a stream
/// written where a freed one was, with the same place and length, is read, not the
/// cluster kept from the old one.
#[test]
fn a_new_stream_in_a_freed_streams_place_is_not_served_from_the_kept_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let (img, _) = make_image(dir.path(), "cluster_size=65536", "1M", &[]);
    let (exec, _dev, chain) = open_writable(img);
    let c = chain.clone();
    exec.block_on(async move { c.write_compressed(0, &vec![0x11u8; 65536]).await })
        .unwrap();
    let old = mem_chain::compressed_at(&exec, &chain, 0);
    let got = submit_and_wait(&exec, &chain, 4096, 4096).unwrap();
    assert!(
        got == [0x11; 4096],
        "the compressed cluster reads as written"
    );
    // An overwrite moves the cluster out of its stream, whose clusters are freed once the
    // metadata is stable; the next compressed cluster goes where it was.
    let c = chain.clone();
    exec.block_on(async move {
        let data = HeapBuf::new(4096);
        data.0.borrow_mut().fill(0x99);
        c.write(0, BufSlice::whole(data)).await?;
        c.flush().await?;
        c.write_compressed(65536, &vec![0x22u8; 65536]).await
    })
    .unwrap();
    let new = mem_chain::compressed_at(&exec, &chain, 65536);
    assert_eq!(
        (new.offset, new.len),
        (old.offset, old.len),
        "the test needs the new stream where the old one was"
    );
    let got = submit_and_wait(&exec, &chain, 65536 + 4096, 4096).unwrap();
    assert!(
        got == [0x22; 4096],
        "the new stream read, not the kept cluster"
    );
    let got = submit_and_wait(&exec, &chain, 0, 4096).unwrap();
    assert!(got == [0x99; 4096], "the overwrite");
}
