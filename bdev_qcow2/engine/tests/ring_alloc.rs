//! Nothing on the prefetch ring's path allocates: with the chain's metadata cached, a
//! stream of reads served from the ring (whole, in part, or waiting for a read-ahead in
//! flight) and the read-aheads that keep it ahead — issued, completed, handed to the reads
//! that waited — make no heap allocation. On an overlay whose read-aheads come mostly
//! from its backing image (the golden-image case) no read-ahead takes a task (guest
//! reads the ring misses there still take the slow path, which allocates, as before).
//! A stream's first pass over slices not cached (a cache too small for the disk, so every
//! pass is a first one) allocates nothing either, once the slice loads' records exist:
//! the ring's read-aheads wait for their slice's load, and the slice read-ahead loads the
//! next slice, without a task. Counted by a global allocator on the test's own
//! thread, around a host loop like the hosts' (look the read up in the ring, queue it on
//! the slot it waits for, route the rest, poll the executor once per request).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use qcow2_engine::io::{BufSlice, HeapBuf};
use qcow2_engine::ring::{RingConfig, RingServed, RingStats, WriteGens, CHUNK};
use qcow2_engine::testing::host;
use qcow2_engine::testing::MemDevice;
use qcow2_engine::{Chain, Exec, Layer, OpenOptions, OwnerLink, Qcow2};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;
use std::process::Command;
use std::rc::Rc;
use std::sync::Arc;

/// The system allocator, counting the allocations of a thread while it asks for it.
struct Counting;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    // `try_with`: never panics inside the allocator (a thread being torn down).
    let _ = COUNTING.try_with(|on| {
        if on.get() {
            let _ = ALLOCS.try_with(|n| n.set(n.get() + 1));
        }
    });
}

// SAFETY: every call goes to `System` unchanged; counting touches only const-initialized
// thread-locals, which allocate nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// C's allocator, counted the same way: libzstd (C, linked statically into this binary)
/// allocates with `malloc`, which Rust's allocator never sees. These definitions take the
/// place of libc's for the code linked into the executable, and pass each call on to
/// glibc's own entry points. Rust's `System` allocator calls them too, so a
/// Rust allocation may count twice: the tests ask for none.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod c_alloc {
    use std::ffi::c_void;

    extern "C" {
        fn __libc_malloc(size: usize) -> *mut c_void;
        fn __libc_calloc(n: usize, size: usize) -> *mut c_void;
        fn __libc_realloc(ptr: *mut c_void, size: usize) -> *mut c_void;
        fn __libc_memalign(align: usize, size: usize) -> *mut c_void;
    }

    #[no_mangle]
    extern "C" fn malloc(size: usize) -> *mut c_void {
        super::count();
        // SAFETY: glibc's malloc, with the caller's arguments.
        unsafe { __libc_malloc(size) }
    }

    #[no_mangle]
    extern "C" fn calloc(n: usize, size: usize) -> *mut c_void {
        super::count();
        // SAFETY: glibc's calloc, with the caller's arguments.
        unsafe { __libc_calloc(n, size) }
    }

    #[no_mangle]
    extern "C" fn realloc(ptr: *mut c_void, size: usize) -> *mut c_void {
        super::count();
        // SAFETY: glibc's realloc, with the caller's arguments (a pointer from these).
        unsafe { __libc_realloc(ptr, size) }
    }

    #[no_mangle]
    extern "C" fn aligned_alloc(align: usize, size: usize) -> *mut c_void {
        super::count();
        // SAFETY: glibc's memalign takes what aligned_alloc takes.
        unsafe { __libc_memalign(align, size) }
    }

    /// Whether the definitions above are the ones libzstd calls: making a decoder's
    /// state (`ZSTD_createDCtx`, a C `malloc`) is counted. (Only code linked into the
    /// executable binds to them: a Rust binary exports no symbols to shared libraries.)
    pub fn interposed() -> bool {
        super::allocations(|| drop(zstd::zstd_safe::DCtx::create())) > 0
    }
}

/// Allocations `f` makes on this thread.
fn allocations(f: impl FnOnce()) -> u64 {
    ALLOCS.with(|n| n.set(0));
    COUNTING.with(|c| c.set(true));
    f();
    COUNTING.with(|c| c.set(false));
    ALLOCS.with(|n| n.get())
}

fn sh(cmd: &mut Command) {
    let out = cmd.output().expect("run");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What QEMU reads from `img`.
fn raw_of(img: &Path) -> Vec<u8> {
    let raw = img.with_extension("raw");
    sh(Command::new("qemu-img")
        .args(["convert", "-O", "raw"])
        .arg(img)
        .arg(&raw));
    std::fs::read(&raw).unwrap()
}

/// An 8 MiB image (64 KiB clusters) of a different byte per MiB, with a zero cluster.
fn image(dir: &Path) -> std::path::PathBuf {
    let img = dir.join("a.qcow2");
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-o", "cluster_size=65536"])
        .arg(&img)
        .arg("8M"));
    let mut q = Command::new("qemu-io");
    q.args(["-f", "qcow2"]);
    for i in 0..8 {
        q.arg("-c").arg(format!("write -P {} {i}M 1M", 0x41 + i));
    }
    q.arg("-c").arg("write -z 3M 64k");
    sh(q.arg(&img));
    img
}

/// An overlay of `base` with a few clusters of its own (data and zeros).
fn overlay(dir: &Path, base: &Path) -> std::path::PathBuf {
    let top = dir.join("top.qcow2");
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(base)
        .arg(&top));
    sh(Command::new("qemu-io")
        .args(["-f", "qcow2", "-c", "write -P 0x77 1M 64k", "-c"])
        .arg("write -P 0x78 5M 200k")
        .args(["-c", "write -z 6400k 64k"])
        .arg(&top));
    top
}

/// One reader: its region, request size, where it is, its buffer (allocated once).
struct Reader {
    start: u64,
    end: u64,
    len: usize,
    pos: u64,
    buf: HeapBuf,
}

/// The host: one request of `r` at QD1, as a host serves it; then one poll of the
/// executor (the reactor polls between requests, so read-aheads complete meanwhile).
fn step(exec: &Exec<MemDevice>, chain: &Rc<Chain<MemDevice>>, r: &mut Reader, expect: &[u8]) {
    const TAG: u64 = 7;
    let len = r.len.min((r.end - r.pos) as usize);
    let whole = BufSlice::whole(r.buf.clone());
    let slice = whole.sub(0, len);
    // As the hosts' plan does: the ring's look-up tells the slice read-ahead the stream it
    // found (a no-op while read-ahead is off).
    let wait = match chain.ring_read(r.pos, &slice) {
        RingServed::All => false,
        RingServed::Nothing => {
            host::engine_read(chain, TAG, r.pos, slice.clone());
            true
        }
        RingServed::Prefix(n) => {
            let n = n as usize;
            let rest = slice.sub(n, len - n);
            host::engine_read(chain, TAG, r.pos + n as u64, rest);
            true
        }
        RingServed::Wait(w) => {
            chain.ring().wait(w, TAG, slice.clone());
            true
        }
    };
    let mut done = !wait;
    exec.poll(&mut |t, res| {
        assert_eq!(t, TAG);
        res.unwrap();
        done = true;
    });
    while !done {
        exec.poll(&mut |t, res| {
            assert_eq!(t, TAG);
            res.unwrap();
            done = true;
        });
    }
    let got = r.buf.0.borrow();
    let at = r.pos as usize;
    assert!(got[..len] == expect[at..at + len], "bytes at {at}");
    r.pos += len as u64;
    if r.pos == r.end {
        r.pos = r.start;
    }
}

#[test]
fn ring_served_reads_and_read_aheads_allocate_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path());
    let (allocs, tasks, _) = run_readers(&[&img]);
    assert_eq!(allocs, 0, "allocations on the ring's path");
    assert_eq!(tasks, 0, "read-aheads ran as tasks");
}

#[test]
fn read_aheads_from_a_backing_image_take_no_task() {
    let dir = tempfile::tempdir().unwrap();
    let base = image(dir.path());
    let top = overlay(dir.path(), &base);
    let (_, tasks, slow_reads) = run_readers(&[&top, &base]);
    // Each task is a guest read's slow path (a miss through the backing image).
    assert_eq!(tasks, slow_reads, "read-aheads ran as tasks");
}

/// Three interleaved readers over the chain of `images` (top first), warmed up, then
/// counted (every byte what QEMU reads): returns the allocations, the tasks spawned and
/// the guest reads that took the slow path.
fn run_readers(images: &[&Path]) -> (u64, u64, u64) {
    let expect = raw_of(images[0]);
    let exec = Exec::new();
    let mut layers = Vec::new();
    for img in images {
        let dev = MemDevice::new(std::fs::read(img).unwrap());
        // A read-ahead takes longer than a 96 KiB reader served from the ring needs to
        // pass a whole window (8 chunks, at 3 polls per 96 KiB): some reads wait for one
        // in flight.
        dev.0.borrow_mut().latency_polls = 40;
        let id = exec.add_device(dev);
        let e2 = exec.clone();
        let q = exec
            .block_on(async move { Qcow2::open(&e2, id, OpenOptions::default()).await })
            .unwrap();
        layers.push(Layer::Qcow2(Box::new(q)));
    }
    let chain = Chain::new(&exec, layers).unwrap();
    let gens = Arc::new(WriteGens::new());
    chain.enable_ring(RingConfig::default(), gens).unwrap();
    // Three interleaved readers: 4 KiB, and 96 KiB reads that straddle chunks (served
    // in part, or waiting for the chunk filling with their rest), each in its own region.
    let mb = 1u64 << 20;
    let mut readers: Vec<Reader> = [(0, 4, 4096), (4, 6, 96 << 10), (6, 8, 96 << 10)]
        .into_iter()
        .map(|(a, b, len)| Reader {
            start: a * mb,
            end: b * mb,
            len,
            pos: a * mb,
            buf: HeapBuf::new(len),
        })
        .collect();
    // Their streams run side by side, one request each in turn.
    let round = |readers: &mut Vec<Reader>| {
        step(&exec, &chain, &mut readers[0], &expect);
        step(&exec, &chain, &mut readers[1], &expect);
        step(&exec, &chain, &mut readers[2], &expect);
    };
    // Warm up: the slices are loaded, the executor's and the device's queues reach their
    // depth (first-pass reads of what was never read ahead allocate on the slow path).
    for _ in 0..1200 {
        round(&mut readers);
    }
    let before: RingStats = chain.ring().stats().unwrap();
    let tasks = exec.stats().tasks_spawned;
    let slow = chain.counters().reads().slow_reads;
    let n = allocations(|| {
        for _ in 0..1200 {
            round(&mut readers);
        }
    });
    let s = chain.ring().stats().unwrap().since(&before);
    assert!(s.readahead_ios > 50, "{s:?}");
    assert!(s.reads_served > 3000, "{s:?}");
    assert!(s.reads_waited > 0, "{s:?}");
    assert!(s.reads_partial > 0, "{s:?}");
    (
        n,
        exec.stats().tasks_spawned - tasks,
        chain.counters().reads().slow_reads - slow,
    )
}

/// A source disk of 8 MiB whose 64 KiB clusters are, in turn, text that compresses (each
/// 4 KiB block its own), bytes that do not (kept plain by `qemu-img convert -c`), and
/// zeros (left unallocated) — so most chunks hold compressed clusters next to plain
/// ones and holes — converted with compression of `kind`. Returns the image and the
/// source's bytes.
fn compressed_image(dir: &Path, kind: &str, cluster: u64) -> (std::path::PathBuf, Vec<u8>) {
    let mut src = Vec::with_capacity(8 << 20);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for c in 0..128u64 {
        for k in 0..16u64 {
            let block = c * 16 + k;
            match c % 5 {
                3 => {
                    for _ in 0..4096 / 8 {
                        // xorshift: bytes deflate and zstd cannot shrink.
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        src.extend_from_slice(&x.to_le_bytes());
                    }
                }
                4 if c % 10 == 4 => src.extend(std::iter::repeat_n(0u8, 4096)),
                _ => {
                    let line = format!("cluster {c:04} block {block:06} of the source. ");
                    let mut b = line.repeat(4096 / line.len() + 1).into_bytes();
                    b.truncate(4096);
                    src.extend(b);
                }
            }
        }
    }
    let raw = dir.join(format!("src-{kind}.raw"));
    std::fs::write(&raw, &src).unwrap();
    let img = dir.join(format!("c-{kind}.qcow2"));
    sh(Command::new("qemu-img")
        .args(["convert", "-q", "-c", "-f", "raw", "-O", "qcow2", "-o"])
        .arg(format!("compression_type={kind},cluster_size={cluster}"))
        .arg(&raw)
        .arg(&img));
    (img, src)
}

/// One 4 KiB reader at QD1 over a compressed image, round and round: once the ring's
/// records exist (the first pass), its read-aheads — the chunk's plain clusters read
/// into the ring, the compressed ones read into a record and decompressed into the ring,
/// holes zeroed — allocate nothing and take no task; every byte is the source's.
fn compressed_reads_allocate_nothing(kind: &str, cluster: u64) {
    let dir = tempfile::tempdir().unwrap();
    let (img, expect) = compressed_image(dir.path(), kind, cluster);
    let exec = Exec::new();
    let dev = MemDevice::new(std::fs::read(&img).unwrap());
    dev.0.borrow_mut().latency_polls = 6;
    let id = exec.add_device(dev);
    let e2 = exec.clone();
    let q = exec
        .block_on(async move { Qcow2::open(&e2, id, OpenOptions::default()).await })
        .unwrap();
    let chain = Chain::new(&exec, vec![Layer::Qcow2(Box::new(q))]).unwrap();
    let gens = Arc::new(WriteGens::new());
    chain.enable_ring(RingConfig::default(), gens).unwrap();
    let mut r = Reader {
        start: 0,
        end: chain.size(),
        len: 4096,
        pos: 0,
        buf: HeapBuf::new(4096),
    };
    let per_pass = (chain.size() / 4096) as usize;
    // First pass: the slices cached, the records and the decompressors' state made.
    for _ in 0..per_pass {
        step(&exec, &chain, &mut r, &expect);
    }
    let before = chain.ring().stats().unwrap();
    let (tasks, slow) = (
        exec.stats().tasks_spawned,
        chain.counters().reads().slow_reads,
    );
    let mut n = 0;
    for _ in 0..2 * per_pass {
        // A pass starts a new stream: its first reads, before it reads ahead, take the
        // guest's slow path (a task that allocates, as before).
        if r.pos < CHUNK {
            step(&exec, &chain, &mut r, &expect);
            continue;
        }
        n += allocations(|| step(&exec, &chain, &mut r, &expect));
    }
    let s = chain.ring().stats().unwrap().since(&before);
    let tasks = exec.stats().tasks_spawned - tasks;
    let slow = chain.counters().reads().slow_reads - slow;
    assert!(s.compressed_fills > 2 * 50, "{s:?}");
    // All but the reads of each pass's first chunk, never read ahead.
    assert!(s.reads_served >= 2 * (per_pass as u64 - 32), "{s:?}");
    assert_eq!(s.readahead_tasks, 0, "{s:?}");
    // Each task is one of a pass's first guest reads.
    assert_eq!(tasks, slow, "read-aheads ran as tasks");
    assert_eq!(n, 0, "allocations on the ring's path");
}

#[test]
fn compressed_read_aheads_allocate_nothing_zlib() {
    compressed_reads_allocate_nothing("zlib", 65536);
}

#[test]
fn compressed_read_aheads_allocate_nothing_zstd() {
    compressed_reads_allocate_nothing("zstd", 65536);
}

/// Clusters of 2 MiB, a fifth of each incompressible: their streams fit no record but
/// the big one, and each chunk after a cluster's first takes its part of that cluster.
#[test]
fn compressed_read_aheads_of_clusters_larger_than_a_chunk_allocate_nothing() {
    compressed_reads_allocate_nothing("zlib", 2 << 20);
}

/// libzstd's C allocations are counted, so the zstd test above would see them.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn c_allocations_are_counted() {
    assert!(c_alloc::interposed());
}

/// A 32 MiB image of 64 KiB clusters, a different byte per MiB, read through slices of
/// 512 bytes (4 MiB of guest each) with room for four of them in the cache: a reader that
/// goes round it finds every slice it enters evicted since its last pass.
/// `core`: the chain is a core replica of the image (as an SPDK channel's), on an
/// executor of its own; else the image itself.
fn small_cache_chain(dir: &Path, core: bool) -> (Exec<MemDevice>, Rc<Chain<MemDevice>>, Vec<u8>) {
    let img = dir.join("big.qcow2");
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-o", "cluster_size=65536"])
        .arg(&img)
        .arg("32M"));
    let mut q = Command::new("qemu-io");
    q.args(["-f", "qcow2"]);
    for i in 0..32 {
        q.arg("-c").arg(format!("write -P {} {i}M 1M", 0x21 + i));
    }
    sh(q.arg(&img));
    let expect = raw_of(&img);
    let exec = Exec::new();
    let dev = MemDevice::new(std::fs::read(&img).unwrap());
    dev.0.borrow_mut().latency_polls = 8;
    let id = exec.add_device(dev);
    let e2 = exec.clone();
    let opts = OpenOptions {
        l2_slice_bytes: 512,
        l2_cache_bytes: Some(4 * 512),
        cache_ways: 4,
        ..OpenOptions::default()
    };
    let mut q = exec
        .block_on(async move { Qcow2::open(&e2, id, opts).await })
        .unwrap();
    if !core {
        let chain = Chain::new(&exec, vec![Layer::Qcow2(Box::new(q))]).unwrap();
        return (exec, chain, expect);
    }
    q.share();
    let exec2 = Exec::new();
    let id2 = exec2.add_device(exec.with_device(id, |d| d.clone()));
    let r = Qcow2::from_seed(q.core_seed().unwrap(), &exec2, id2, opts, Box::new(NoOwner)).unwrap();
    assert!(r.is_core_replica());
    let chain = Chain::new(&exec2, vec![Layer::Qcow2(Box::new(r))]).unwrap();
    // The owner changes nothing: the core's chain goes on without it, on the device's
    // other handle.
    drop(q);
    (exec2, chain, expect)
}

/// A core's link to an owner that changes nothing: no slice is ever dirty, so none is
/// asked for.
struct NoOwner;

impl OwnerLink for NoOwner {
    fn ask_slice(&self, key: u64, _ticket: u64) {
        panic!("slice {key} asked of an owner that changed nothing");
    }
}

/// Guest bytes of one slice of [`small_cache_chain`].
const SLICE_COVERAGE: u64 = 4 << 20;

/// Passes of one 64 KiB reader over the whole disk of `chain`: `warm` passes, then
/// `counted` passes whose requests are counted — except those in the first slice, where
/// the reader starts over (a new stream: its first reads miss the cache, on the guest's
/// slow path, before anything reads ahead). Returns the allocations counted, the tasks
/// spawned and the slices evicted from the cache in the counted passes (one a slice loaded).
fn first_passes(
    exec: &Exec<MemDevice>,
    chain: &Rc<Chain<MemDevice>>,
    expect: &[u8],
    warm: usize,
    counted: usize,
) -> (u64, u64, u64) {
    let mut r = Reader {
        start: 0,
        end: chain.size(),
        len: 64 << 10,
        pos: 0,
        buf: HeapBuf::new(64 << 10),
    };
    let per_pass = (chain.size() / (64 << 10)) as usize;
    for _ in 0..warm * per_pass {
        step(exec, chain, &mut r, expect);
    }
    let misses = |c: &Chain<MemDevice>| match &c.layers()[0] {
        Layer::Qcow2(q) => q.l2_cache_stats().evictions,
        Layer::Raw { .. } => 0,
    };
    let (tasks, missed) = (exec.stats().tasks_spawned, misses(chain));
    let mut n = 0;
    let mut tasks_counted = 0;
    for _ in 0..counted * per_pass {
        if r.pos < SLICE_COVERAGE {
            step(exec, chain, &mut r, expect);
            continue;
        }
        let t = exec.stats().tasks_spawned;
        n += allocations(|| step(exec, chain, &mut r, expect));
        tasks_counted += exec.stats().tasks_spawned - t;
    }
    assert!(exec.stats().tasks_spawned - tasks >= tasks_counted);
    (n, tasks_counted, misses(chain) - missed)
}

#[test]
fn ring_read_aheads_over_slices_not_cached_allocate_nothing() {
    ring_over_slices_not_cached(false, false);
}

#[test]
fn ring_read_aheads_over_slices_not_cached_allocate_nothing_on_a_core_replica() {
    ring_over_slices_not_cached(true, false);
}

/// As an SPDK channel runs them by default: a core replica, the ring and the slice
/// read-ahead both on.
#[test]
fn ring_and_slice_read_aheads_over_slices_not_cached_allocate_nothing() {
    ring_over_slices_not_cached(true, true);
}

fn ring_over_slices_not_cached(core: bool, slice_read_ahead: bool) {
    let dir = tempfile::tempdir().unwrap();
    let (exec, chain, expect) = small_cache_chain(dir.path(), core);
    chain.prefetch().set_on(slice_read_ahead);
    let gens = Arc::new(WriteGens::new());
    chain.enable_ring(RingConfig::default(), gens).unwrap();
    let before = chain.ring().stats().unwrap();
    let (allocs, tasks, missed) = first_passes(&exec, &chain, &expect, 2, 3);
    let s = chain.ring().stats().unwrap().since(&before);
    // Every slice but the first of each pass was entered by a read-ahead: 7 a pass.
    assert!(missed >= 3 * 7, "slices evicted: {missed}");
    assert!(s.readahead_ios > 3 * 200, "{s:?}");
    assert_eq!(allocs, 0, "allocations on the ring's path");
    assert_eq!(tasks, 0, "read-aheads ran as tasks");
}

#[test]
fn the_slice_read_ahead_allocates_nothing() {
    slice_read_ahead(false);
}

#[test]
fn the_slice_read_ahead_allocates_nothing_on_a_core_replica() {
    slice_read_ahead(true);
}

fn slice_read_ahead(core: bool) {
    let dir = tempfile::tempdir().unwrap();
    let (exec, chain, expect) = small_cache_chain(dir.path(), core);
    chain.prefetch().set_on(true);
    let before = chain.prefetch().stats();
    let slow = chain.counters().reads().slow_reads;
    let (allocs, tasks, missed) = first_passes(&exec, &chain, &expect, 2, 3);
    let p = chain.prefetch().stats();
    assert!(p.loaded - before.loaded >= 5 * 7, "{p:?}");
    assert!(missed >= 3 * 7, "slices evicted: {missed}");
    assert_eq!(allocs, 0, "allocations on the slice read-ahead's path");
    assert_eq!(tasks, 0, "slice read-aheads ran as tasks");
    // Past the first slice every guest read found its slice loaded ahead.
    let slow = chain.counters().reads().slow_reads - slow;
    assert!(slow <= 5 * 4, "guest reads on the slow path: {slow}");
}
