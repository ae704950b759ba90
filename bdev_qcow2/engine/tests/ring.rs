//! The prefetch ring on the in-memory device, against qemu-img as the oracle: sequential
//! reads served from the ring read what QEMU reads in every kind of mapping (allocated,
//! zero, unallocated over a backing image or not, compressed), zeros cost no data read,
//! a compressed cluster is read and decompressed once, nothing past the end of the disk,
//! and a write makes what the ring holds of it unusable.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use qcow2_engine::io::{BufSlice, HeapBuf};
use qcow2_engine::ring::{RingConfig, RingServed, WriteGens};
use qcow2_engine::testing::host;
use qcow2_engine::testing::MemDevice;
use qcow2_engine::{Chain, Exec, Layer, OpenOptions, Qcow2};
use std::path::Path;
use std::process::Command;
use std::rc::Rc;
use std::sync::Arc;

mod mem_chain;
use mem_chain::compressed_at;

fn sh(cmd: &mut Command) {
    let out = cmd.output().expect("run");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn qemu_io(img: &Path, cmds: &[&str]) {
    let mut q = Command::new("qemu-io");
    q.args(["-f", "qcow2"]);
    for c in cmds {
        q.arg("-c").arg(c);
    }
    sh(q.arg(img));
}

fn raw_of(img: &Path) -> Vec<u8> {
    let raw = img.with_extension("raw");
    sh(Command::new("qemu-img")
        .args(["convert", "-O", "raw"])
        .arg(img)
        .arg(&raw));
    std::fs::read(&raw).unwrap()
}

/// A chain over the images (top first), each on its own memory device, with the ring on;
/// returns the devices too.
fn chain_of(
    images: &[&Path],
    opts: OpenOptions,
) -> (Exec<MemDevice>, Rc<Chain<MemDevice>>, Vec<MemDevice>) {
    let exec = Exec::new();
    let mut layers = Vec::new();
    let mut devs = Vec::new();
    for p in images {
        let dev = MemDevice::new(std::fs::read(p).unwrap());
        let id = exec.add_device(dev.clone());
        devs.push(dev);
        let e2 = exec.clone();
        let q = exec
            .block_on(async move { Qcow2::open(&e2, id, opts).await })
            .unwrap();
        layers.push(Layer::Qcow2(Box::new(q)));
    }
    let chain = Chain::new(&exec, layers).unwrap();
    let gens = Arc::new(WriteGens::new());
    chain.enable_ring(RingConfig::default(), gens).unwrap();
    (exec, chain, devs)
}

/// One guest read as a host serves it: from the ring, else through the engine (the part
/// the ring did not hold).
fn read(exec: &Exec<MemDevice>, chain: &Rc<Chain<MemDevice>>, off: u64, len: usize) -> Vec<u8> {
    let buf = HeapBuf::new(len);
    let slice = BufSlice::whole(buf.clone());
    let rest = match chain.ring_read(off, &slice) {
        RingServed::All => None,
        RingServed::Nothing => Some((off, slice)),
        RingServed::Prefix(n) => Some((off + n, slice.sub(n as usize, len - n as usize))),
        RingServed::Wait(w) => {
            Some((u64::MAX, slice.clone())).inspect(|_| chain.ring().wait(w, 7, slice))
        }
    };
    if let Some((off, slice)) = rest {
        if off != u64::MAX {
            host::engine_read(chain, 7, off, slice);
        }
        let mut done = None;
        while done.is_none() {
            exec.poll(&mut |t, r| {
                assert_eq!(t, 7);
                done = Some(r);
            });
        }
        done.unwrap().unwrap();
    }
    // Read-aheads run as the host polls.
    exec.poll(&mut |_, _| panic!("no request in flight"));
    buf.to_vec()
}

/// Reads the whole disk front to back in `len`-byte requests.
fn read_all(exec: &Exec<MemDevice>, chain: &Rc<Chain<MemDevice>>, len: usize) -> Vec<u8> {
    let size = chain.size() as usize;
    let mut out = Vec::with_capacity(size);
    let mut off = 0;
    while off < size {
        let n = len.min(size - off);
        out.extend(read(exec, chain, off as u64, n));
        off += n;
    }
    out
}

#[test]
fn sequential_reads_from_the_ring_read_what_qemu_reads_over_a_backing_image() {
    let dir = tempfile::tempdir().unwrap();
    let (base, top) = (dir.path().join("base.qcow2"), dir.path().join("top.qcow2"));
    // A disk that does not end on a chunk: the last read-ahead is short.
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&base)
        .arg("3000k"));
    qemu_io(&base, &["write -P 0x41 0 2M", "write -P 0x44 2900k 100k"]);
    sh(Command::new("qemu-img")
        .args([
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "qcow2",
            "-b",
            "base.qcow2",
        ])
        .arg(&top));
    qemu_io(
        &top,
        &[
            "write -P 0x42 1M 68k",
            "write -z 1280k 128k",
            "discard 1536k 64k",
            "write -P 0x43 2100k 4k",
        ],
    );
    let expect = raw_of(&top);
    for len in [4096, 12 << 10, 128 << 10] {
        let (exec, chain, _) = chain_of(&[&top, &base], OpenOptions::default());
        let got = read_all(&exec, &chain, len);
        assert!(got == expect, "{len}-byte reads differ from qemu-img");
        let s = chain.ring().stats().unwrap();
        assert!(s.bytes_served > expect.len() as u64 / 2, "{len}: {s:?}");
        // Never past the end of the disk.
        assert!(s.bytes_read_ahead <= expect.len() as u64, "{s:?}");
    }
}

/// A raw backing file that ends inside a sector (our host serves such files; the disk is
/// a whole number of sectors, the bytes past the file's end zeros): the chunk at its end
/// is planned like any other, its last sector read whole, with no task.
#[test]
fn a_raw_backing_file_ending_inside_a_sector_is_read_ahead_without_a_task() {
    let dir = tempfile::tempdir().unwrap();
    let (base, top) = (dir.path().join("base.img"), dir.path().join("top.qcow2"));
    let len = (3000 << 10) + 300;
    std::fs::write(
        &base,
        (0..len).map(|i| (i % 251) as u8 + 1).collect::<Vec<u8>>(),
    )
    .unwrap();
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b", "base.img"])
        .arg(&top));
    qemu_io(&top, &["write -P 0x42 1M 68k"]);
    let expect = raw_of(&top);
    assert_eq!(expect.len() as u64, (len as u64).next_multiple_of(512));
    for rlen in [4096, 128 << 10] {
        let exec = Exec::new();
        let id = exec.add_device(MemDevice::new(std::fs::read(&top).unwrap()));
        let e2 = exec.clone();
        let q = exec
            .block_on(async move { Qcow2::open(&e2, id, OpenOptions::default()).await })
            .unwrap();
        let raw = exec.add_device(MemDevice::new(std::fs::read(&base).unwrap()));
        let size = exec.device_size(raw);
        assert_eq!(size, len as u64);
        let layers = vec![Layer::Qcow2(Box::new(q)), Layer::Raw { dev: raw, size }];
        let chain = Chain::new(&exec, layers).unwrap();
        chain
            .enable_ring(RingConfig::default(), Arc::new(WriteGens::new()))
            .unwrap();
        let got = read_all(&exec, &chain, rlen);
        assert!(got == expect, "{rlen}-byte reads differ from qemu-img");
        let s = chain.ring().stats().unwrap();
        assert!(s.bytes_served > expect.len() as u64 / 2, "{rlen}: {s:?}");
        assert_eq!(s.readahead_tasks, 0, "{rlen}: {s:?}");
    }
}

#[test]
fn zeros_are_answered_from_metadata_and_compressed_clusters_read_once() {
    let dir = tempfile::tempdir().unwrap();
    // An empty image: every read-ahead is zeros from metadata, no data read.
    let empty = dir.path().join("empty.qcow2");
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&empty)
        .arg("64M"));
    let (exec, chain, devs) = chain_of(&[&empty], OpenOptions::default());
    let before = devs[0].0.borrow().reads;
    assert!(read_all(&exec, &chain, 4096).iter().all(|&b| b == 0));
    let s = chain.ring().stats().unwrap();
    assert!(s.bytes_served > 60 << 20, "{s:?}");
    assert_eq!(devs[0].0.borrow().reads - before, 0, "zeros were read");

    // A compressed image of 64 KiB clusters: each cluster's compressed data once.
    let plain = dir.path().join("plain.qcow2");
    let comp = dir.path().join("comp.qcow2");
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&plain)
        .arg("8M"));
    qemu_io(&plain, &["write -P 0x5a 0 3M", "write -P 0x17 5M 2M"]);
    sh(Command::new("qemu-img")
        .args(["convert", "-c", "-O", "qcow2"])
        .arg(&plain)
        .arg(&comp));
    let expect = raw_of(&comp);
    let (exec, chain, devs) = chain_of(&[&comp], OpenOptions::default());
    let before = devs[0].0.borrow().reads;
    assert!(read_all(&exec, &chain, 4096) == expect);
    let reads = devs[0].0.borrow().reads - before;
    // 80 compressed clusters and a few L2 slices; 16 reads per cluster without the ring.
    assert!(reads < 120, "{reads} device reads");
}

#[test]
fn a_write_makes_what_the_ring_holds_of_it_unusable() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img.qcow2");
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&img)
        .arg("4M"));
    qemu_io(&img, &["write -P 0x11 0 4M"]);
    let opts = OpenOptions {
        writable: true,
        ..OpenOptions::default()
    };
    let (exec, chain, _) = chain_of(&[&img], opts);
    // A stream reads ahead past 256 KiB.
    for k in 0..16u64 {
        read(&exec, &chain, k * 4096, 4096);
    }
    let before = chain.ring().stats().unwrap();
    assert!(before.readahead_ios > 0, "{before:?}");
    // An in-place overwrite ahead of the stream: no mapping changes, only its data.
    let w = HeapBuf::new(4096);
    w.0.borrow_mut().fill(0x99);
    host::write(&chain, 9, 200 << 10, BufSlice::whole(w));
    let mut done = None;
    while done.is_none() {
        exec.poll(&mut |_, r| done = Some(r));
    }
    chain.ring().written(200 << 10, 4096);
    done.unwrap().unwrap();
    let mut seen = Vec::new();
    for k in 16..64u64 {
        seen.extend(read(&exec, &chain, k * 4096, 4096));
    }
    // (The write moved chunk 1's generation; the read of its first 4 KiB found that.)
    let at = (200 << 10) - 16 * 4096;
    assert!(
        seen[at..at + 4096].iter().all(|&b| b == 0x99),
        "stale data served"
    );
    assert!(seen[..at].iter().all(|&b| b == 0x11));
    assert_eq!(chain.ring().stats().unwrap().invalidated, 1);
}

/// Writes `len` bytes of `byte` at `off` as a host does, the ring told before completion.
fn write(exec: &Exec<MemDevice>, chain: &Rc<Chain<MemDevice>>, off: u64, len: usize, byte: u8) {
    let w = HeapBuf::new(len);
    w.0.borrow_mut().fill(byte);
    host::write(chain, 9, off, BufSlice::whole(w));
    let mut done = None;
    while done.is_none() {
        exec.poll(&mut |_, r| done = Some(r));
    }
    chain.ring().written(off, len as u64);
    done.unwrap().unwrap();
}

#[test]
fn a_read_partly_in_the_ring_is_served_its_part_and_reads_only_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img.qcow2");
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&img)
        .arg("4M"));
    qemu_io(&img, &["write -P 0x11 0 4M"]);
    let opts = OpenOptions {
        writable: true,
        ..OpenOptions::default()
    };
    let (exec, chain, devs) = chain_of(&[&img], opts);
    // A stream of 4 KiB reads: chunks 1 and 2 (128-384 KiB) are read ahead.
    for k in 0..16u64 {
        read(&exec, &chain, k * 4096, 4096);
    }
    // A write into chunk 2 makes it unusable; chunk 1 stays good.
    write(&exec, &chain, 260 << 10, 4096, 0x99);
    for k in 16..56u64 {
        read(&exec, &chain, k * 4096, 4096);
    }
    // 64 KiB at 224 KiB: its first 32 KiB in chunk 1 (in the ring), the rest in chunk 2.
    let before = chain.ring().stats().unwrap();
    let reads = devs[0].0.borrow().reads;
    let got = read(&exec, &chain, 224 << 10, 64 << 10);
    let s = chain.ring().stats().unwrap().since(&before);
    assert_eq!(s.bytes_served, 32 << 10, "{s:?}");
    assert_eq!(s.reads_served, 1);
    assert_eq!(s.invalidated, 1);
    let mut expect = vec![0x11u8; 64 << 10];
    expect[36 << 10..40 << 10].fill(0x99);
    assert!(got == expect, "partial hit read the wrong bytes");
    // The rest is one device read of its own (the read-aheads it started come after).
    assert!(devs[0].0.borrow().reads > reads);
}

/// Starts one guest read as a host does, under `tag`, without polling: from the ring,
/// else (the part it did not hold) through the engine, or waiting for a read-ahead in
/// flight. Returns its buffer, and whether it is already done (served from the ring).
fn start(chain: &Rc<Chain<MemDevice>>, off: u64, len: usize, tag: u64) -> (HeapBuf, bool) {
    let buf = HeapBuf::new(len);
    let slice = BufSlice::whole(buf.clone());
    match chain.ring_read(off, &slice) {
        RingServed::All => return (buf, true),
        RingServed::Nothing => host::engine_read(chain, tag, off, slice),
        RingServed::Prefix(n) => {
            let rest = slice.sub(n as usize, len - n as usize);
            host::engine_read(chain, tag, off + n, rest)
        }
        RingServed::Wait(w) => chain.ring().wait(w, tag, slice),
    }
    (buf, false)
}

/// Polls until the reads of `tags` are done (each must succeed).
fn wait_all(exec: &Exec<MemDevice>, mut tags: Vec<u64>) {
    while !tags.is_empty() {
        exec.poll(&mut |t, r| {
            r.unwrap();
            let k = tags.iter().position(|&x| x == t).expect("a tag in flight");
            tags.swap_remove(k);
        });
    }
}

/// Reads `len`-byte requests from `from` to `to` (one after the other, each polled to
/// its end): returns the bytes.
fn read_range(
    exec: &Exec<MemDevice>,
    chain: &Rc<Chain<MemDevice>>,
    from: u64,
    to: u64,
    len: usize,
) -> Vec<u8> {
    let mut out = Vec::new();
    let mut off = from;
    while off < to {
        let n = len.min((to - off) as usize);
        let (buf, done) = start(chain, off, n, 1);
        if !done {
            wait_all(exec, vec![1]);
        }
        out.extend(buf.to_vec());
        off += n as u64;
    }
    out
}

#[test]
fn reads_that_reach_a_chunk_while_it_fills_wait_for_it_and_read_what_qemu_reads() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.qcow2");
    let img = dir.path().join("img.qcow2");
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&base)
        .arg("3M"));
    qemu_io(&base, &["write -P 0x41 0 3M"]);
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(&base)
        .arg(&img));
    qemu_io(&img, &["write -P 0x42 700k 300k", "write -z 1500k 200k"]);
    let expect = raw_of(&img);
    // 320 KiB and 260 KiB reads: their rest spans two or three chunks, all filling.
    for len in [320usize << 10, 260 << 10, 128 << 10, 96 << 10, 4 << 10] {
        let (exec, chain, devs) = chain_of(&[&img, &base], OpenOptions::default());
        // A slow device: a read-ahead is still in flight when the reader reaches it.
        for d in &devs {
            d.0.borrow_mut().latency_polls = 40;
        }
        let got = read_range(&exec, &chain, 0, chain.size(), len);
        assert!(got == expect, "{len}-byte reads differ from qemu-img's");
        let st = chain.ring().stats().unwrap();
        assert!(st.reads_waited > 0, "{len}: {st:?}");
        assert_eq!(st.waited_to_base, 0, "{len}: {st:?}");
        // Every waiting read is served from the ring, not read a second time.
        assert!(st.bytes_served >= chain.size() / 2, "{len}: {st:?}");
    }
}

/// Where the 4 KiB of `byte` start in `dev` (unique in the image).
fn find_block(dev: &MemDevice, byte: u8) -> usize {
    let s = dev.0.borrow();
    (0..s.data.len() / 4096)
        .map(|k| k * 4096)
        .find(|&o| s.data[o..o + 4096].iter().all(|&b| b == byte))
        .expect("the block")
}

/// After a write completed while chunk 1 fills (`tags`: the reads in flight before it):
/// reads of 32..40 (in 4 KiB blocks), submitted now, reach chunk 1 while it fills and wait;
/// when it ends, the write found, all eight go to the base. Returns their buffers and the
/// ring's counters then.
fn reads_after_the_write_wait_and_go_to_the_base(
    exec: &Exec<MemDevice>,
    chain: &Rc<Chain<MemDevice>>,
    mut tags: Vec<u64>,
) -> (Vec<HeapBuf>, qcow2_engine::ring::RingStats) {
    let mut bufs = Vec::new();
    for k in 32..40u64 {
        let (b, done) = start(chain, k * 4096, 4096, 100 + k);
        assert!(!done);
        bufs.push(b);
        tags.push(100 + k);
    }
    assert_eq!(chain.ring().stats().unwrap().reads_waited, 8);
    wait_all(exec, tags);
    let st = chain.ring().stats().unwrap();
    assert_eq!(st.waited_to_base, 8, "{st:?}");
    assert_eq!(st.invalidated, 1, "{st:?}");
    (bufs, st)
}

#[test]
fn a_write_completed_while_a_chunk_fills_sends_the_reads_waiting_for_it_to_the_base() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img.qcow2");
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&img)
        .arg("1M"));
    qemu_io(&img, &["write -P 0x11 0 1M", "write -P 0x22 132k 4k"]);
    let (exec, chain, devs) = chain_of(&[&img], OpenOptions::default());
    let host = find_block(&devs[0], 0x22);
    devs[0].0.borrow_mut().latency_polls = 50;
    // A stream of 4 KiB reads through chunk 0, all in flight: chunks 1 and 2 are read
    // ahead once the executor runs.
    let mut tags = Vec::new();
    for k in 0..32u64 {
        let (_, done) = start(&chain, k * 4096, 4096, 100 + k);
        assert!(!done);
        tags.push(100 + k);
    }
    exec.poll(&mut |_, _| panic!("nothing completes yet"));
    // The read-ahead of chunk 1 read its old bytes; now another core overwrites 132 KiB
    // in place and completes: its data on the device, the generation moved.
    devs[0].0.borrow_mut().data[host..host + 4096].fill(0x99);
    chain.ring().written(132 << 10, 4096);
    let (bufs, _) = reads_after_the_write_wait_and_go_to_the_base(&exec, &chain, tags);
    for (k, b) in bufs.iter().enumerate() {
        let want = if k == 1 { 0x99 } else { 0x11 };
        assert!(
            b.to_vec().iter().all(|&x| x == want),
            "read {} after the write got stale data",
            32 + k
        );
    }
}

#[test]
fn a_read_waiting_for_two_chunks_reads_what_qemu_reads_or_goes_to_the_base_when_written() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img.qcow2");
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&img)
        .arg("1M"));
    qemu_io(
        &img,
        &[
            "write -P 0x11 0 1M",
            "write -P 0x22 200k 4k",
            "write -P 0x33 300k 4k",
        ],
    );
    for written in [false, true] {
        let (exec, chain, devs) = chain_of(&[&img], OpenOptions::default());
        let mut expect = raw_of(&img)[128 << 10..384 << 10].to_vec();
        let host = find_block(&devs[0], 0x33);
        devs[0].0.borrow_mut().latency_polls = 50;
        // A stream of 4 KiB reads through chunk 0, all in flight: chunks 1 and 2 are
        // read ahead at once.
        let mut tags = Vec::new();
        for k in 0..32u64 {
            assert!(!start(&chain, k * 4096, 4096, 100 + k).1);
            tags.push(100 + k);
        }
        // 256 KiB at 128 KiB: its rest (all of it) is chunks 1 and 2, both filling.
        let (buf, done) = start(&chain, 128 << 10, 256 << 10, 1);
        assert!(!done);
        tags.push(1);
        let st = chain.ring().stats().unwrap();
        assert_eq!(st.reads_waited, 1, "{st:?}");
        if written {
            // Another core overwrites 300 KiB (chunk 2) in place and completes.
            devs[0].0.borrow_mut().data[host..host + 4096].fill(0x99);
            chain.ring().written(300 << 10, 4096);
            expect[172 << 10..176 << 10].fill(0x99);
        }
        wait_all(&exec, tags);
        assert!(buf.to_vec() == expect, "written {written}: wrong bytes");
        let st = chain.ring().stats().unwrap();
        assert_eq!(st.waited_to_base, u64::from(written), "{st:?}");
        assert_eq!(
            st.bytes_served,
            if written { 0 } else { 256 << 10 },
            "{st:?}"
        );
    }
}

#[test]
fn a_failed_read_ahead_sends_the_reads_waiting_for_it_to_the_base() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img.qcow2");
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&img)
        .arg("1M"));
    qemu_io(&img, &["write -P 0x33 0 1M"]);
    let (exec, chain, devs) = chain_of(&[&img], OpenOptions::default());
    // The mapping cached first: the guest reads below go to the device as they are
    // submitted, not from tasks that would run before the read-ahead's.
    read(&exec, &chain, 900 << 10, 4096);
    devs[0].0.borrow_mut().latency_polls = 10;
    let mut tags = Vec::new();
    for k in 0..32u64 {
        if k == 2 {
            // The third read starts the stream's read-ahead, chunks 1 and 2, submitted
            // at once before the read's own: chunk 1's fails.
            let mut s = devs[0].0.borrow_mut();
            s.fail_op = Some((s.ops, 5));
        }
        assert!(!start(&chain, k * 4096, 4096, 100 + k).1);
        tags.push(100 + k);
    }
    let mut bufs = Vec::new();
    for k in 32..36u64 {
        let (b, done) = start(&chain, k * 4096, 4096, 100 + k);
        assert!(!done);
        bufs.push(b);
        tags.push(100 + k);
    }
    wait_all(&exec, tags);
    let st = chain.ring().stats().unwrap();
    assert_eq!((st.reads_waited, st.waited_to_base), (4, 4), "{st:?}");
    assert!(bufs.iter().all(|b| b.to_vec().iter().all(|&x| x == 0x33)));
}

#[test]
fn a_chain_rebuilt_on_the_same_executor_leaves_no_sink_behind() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("a.qcow2");
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&img)
        .arg("4M"));
    qemu_io(&img, &["write -P 0x5a 0 4M"]);
    let expect = raw_of(&img);
    let exec = Exec::new();
    let dev = MemDevice::new(std::fs::read(&img).unwrap());
    // Read-aheads stay in flight over a few polls.
    dev.0.borrow_mut().latency_polls = 20;
    let id = exec.add_device(dev);
    let build = || {
        let e2 = exec.clone();
        let q = exec
            .block_on(async move { Qcow2::open(&e2, id, OpenOptions::default()).await })
            .unwrap();
        let chain = Chain::new(&exec, vec![Layer::Qcow2(Box::new(q))]).unwrap();
        let gens = Arc::new(WriteGens::new());
        chain.enable_ring(RingConfig::default(), gens).unwrap();
        chain
    };
    let first = build();
    assert_eq!(exec.internal_sinks(), 1);
    let mut off = 0;
    // Until read-aheads are in flight.
    while first.ring().stats().unwrap().readahead_ios == 0 || !exec.busy() {
        assert_eq!(
            read(&exec, &first, off, 4096),
            expect[off as usize..][..4096]
        );
        off += 4096;
        assert!(off < 1 << 20, "no read-ahead in flight");
    }
    drop(first);
    assert_eq!(exec.internal_sinks(), 0, "the dropped chain's sink is gone");
    // Rebuilt (a host reopening the image on this core): one sink again, and the old
    // read-aheads' ends, dropped, reach nothing.
    let second = build();
    assert_eq!(exec.internal_sinks(), 1);
    while exec.busy() {
        exec.poll(&mut |_, _| panic!("no guest request in flight"));
    }
    assert_eq!(second.ring().stats().unwrap().bytes_read_ahead, 0);
    assert_eq!(read_all(&exec, &second, 64 << 10), expect);
    let s = second.ring().stats().unwrap();
    assert!(s.reads_served > 0, "{s:?}");
    assert_eq!(exec.internal_sinks(), 1);
}

#[test]
fn a_write_completed_while_a_read_ahead_waits_for_its_slice_makes_it_unusable() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img.qcow2");
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-o", "cluster_size=4096"])
        .arg(&img)
        .arg("1M"));
    qemu_io(&img, &["write -P 0x11 0 1M", "write -P 0x22 260k 4k"]);
    // Slices of 256 KiB of guest: chunk 2 (256-384 KiB) is in the second slice.
    let opts = OpenOptions {
        l2_slice_bytes: 512,
        ..OpenOptions::default()
    };
    let (exec, chain, devs) = chain_of(&[&img], opts);
    let host = find_block(&devs[0], 0x22);
    devs[0].0.borrow_mut().latency_polls = 50;
    // A stream of 4 KiB reads through chunk 0, all in flight before anything ran: nothing
    // is cached, so chunks 1, 2 (and 3) are read ahead by waiting for their slices'
    // loads, not by tasks (the 32 tasks are the reads').
    let tasks = exec.stats().tasks_spawned;
    let mut tags = Vec::new();
    for k in 0..32u64 {
        assert!(!start(&chain, k * 4096, 4096, 100 + k).1);
        tags.push(100 + k);
    }
    assert!(chain.ring().stats().unwrap().readahead_ios >= 2);
    assert_eq!(exec.stats().tasks_spawned - tasks, 32);
    exec.poll(&mut |_, _| panic!("nothing completes yet"));
    // Another core overwrites 260 KiB in place and completes while chunk 2 waits for its
    // slice: its generation was recorded before it waited, so whatever the read-ahead
    // reads once the slice is in, it is never served.
    devs[0].0.borrow_mut().data[host..host + 4096].fill(0x99);
    chain.ring().written(260 << 10, 4096);
    wait_all(&exec, tags);
    let got = read_range(&exec, &chain, 128 << 10, 384 << 10, 4096);
    for (k, b) in got.chunks(4096).enumerate() {
        let want = if k == (260 - 128) / 4 { 0x99 } else { 0x11 };
        assert!(b.iter().all(|&x| x == want), "block {k} of 128-384 KiB");
    }
    let st = chain.ring().stats().unwrap();
    assert_eq!(st.invalidated, 1, "{st:?}");
    assert!(st.reads_served > 0, "{st:?}");
}

/// A 2 MiB source of text that compresses, each 4 KiB block its own, converted by
/// `qemu-img convert -c` (zlib): every cluster compressed. Returns the image and the
/// source's bytes.
fn compressed_text(dir: &Path) -> (std::path::PathBuf, Vec<u8>) {
    let mut src = Vec::with_capacity(2 << 20);
    for block in 0..512u64 {
        let line = format!("block {block:06} of a compressed disk. ");
        let mut b = line.repeat(4096 / line.len() + 1).into_bytes();
        b.truncate(4096);
        src.extend(b);
    }
    let raw = dir.join("text.raw");
    std::fs::write(&raw, &src).unwrap();
    let img = dir.join("text.qcow2");
    sh(Command::new("qemu-img")
        .args(["convert", "-q", "-c", "-f", "raw", "-O", "qcow2"])
        .arg(&raw)
        .arg(&img));
    (img, src)
}

/// [`read`] that returns the read's result rather than unwrap it.
fn try_read(
    exec: &Exec<MemDevice>,
    chain: &Rc<Chain<MemDevice>>,
    off: u64,
    len: usize,
) -> qcow2_engine::Result<Vec<u8>> {
    let (buf, done) = start(chain, off, len, 7);
    let mut res = Ok(());
    if !done {
        let mut got = None;
        while got.is_none() {
            exec.poll(&mut |t, r| {
                assert_eq!(t, 7);
                got = Some(r);
            });
        }
        res = got.unwrap();
    }
    exec.poll(&mut |_, _| panic!("no request in flight"));
    res.map(|()| buf.to_vec())
}

#[test]
fn a_corrupt_compressed_cluster_read_ahead_fails_its_reads_as_the_base_path_does() {
    let dir = tempfile::tempdir().unwrap();
    let (img, src) = compressed_text(dir.path());
    let (exec, chain, devs) = chain_of(&[&img], OpenOptions::default());
    devs[0].0.borrow_mut().latency_polls = 4;
    // The second cluster of chunk 3: its deflate stream starts with a reserved block type.
    let bad = (3 << 17) + (64 << 10);
    let d = compressed_at(&exec, &chain, bad);
    let at = d.offset.0 as usize;
    devs[0].0.borrow_mut().data[at..at + 16].fill(0xff);
    // Twice over the disk: nothing the failed read-ahead left behind is served later.
    for _ in 0..2 {
        for k in 0..(chain.size() / 4096) {
            let off = k * 4096;
            let got = try_read(&exec, &chain, off, 4096);
            if (bad..bad + (64 << 10)).contains(&off) {
                let Err(e) = got else {
                    panic!("a read of the corrupt cluster at {off} succeeded");
                };
                assert!(e.to_string().contains("deflate"), "{e}");
            } else {
                let got = got.unwrap_or_else(|e| panic!("read at {off}: {e}"));
                assert!(
                    got == src[off as usize..off as usize + 4096],
                    "bytes at {off}"
                );
            }
        }
    }
    let s = chain.ring().stats().unwrap();
    assert!(s.compressed_fills > 20, "{s:?}");
    assert_eq!(s.readahead_tasks, 0, "{s:?}");
    // The bad chunk's reads went to the base, each pass.
    assert!(s.bytes_served <= 2 * (chain.size() - (256 << 10)), "{s:?}");
}

#[test]
fn a_write_completed_while_a_compressed_chunk_fills_sends_the_reads_waiting_for_it_to_the_base() {
    let dir = tempfile::tempdir().unwrap();
    let (img, src) = compressed_text(dir.path());
    let (exec, chain, devs) = chain_of(&[&img], OpenOptions::default());
    // Chunk 1's first cluster, and its data as another core's write leaves it: the
    // same sectors holding the compressed stream of new bytes.
    let d = compressed_at(&exec, &chain, 128 << 10);
    let new = qcow2_engine::compress::compress(
        qcow2_engine::format::CompressionType::Zlib,
        &[0x99; 64 << 10],
    )
    .unwrap();
    assert!(new.len() as u64 <= d.len);
    devs[0].0.borrow_mut().latency_polls = 50;
    // A stream of 4 KiB reads through chunk 0, all in flight: chunks 1 and 2 are read
    // ahead once the executor runs.
    let mut tags = Vec::new();
    for k in 0..32u64 {
        let (_, done) = start(&chain, k * 4096, 4096, 100 + k);
        assert!(!done);
        tags.push(100 + k);
    }
    exec.poll(&mut |_, _| panic!("nothing completes yet"));
    assert!(chain.ring().stats().unwrap().compressed_fills >= 2);
    // The fill of chunk 1 read the old compressed bytes; now the write lands and
    // completes.
    let at = d.offset.0 as usize;
    devs[0].0.borrow_mut().data[at..at + new.len()].copy_from_slice(&new);
    chain.ring().written(128 << 10, 64 << 10);
    let (bufs, st) = reads_after_the_write_wait_and_go_to_the_base(&exec, &chain, tags);
    for (k, b) in bufs.iter().enumerate() {
        assert!(
            b.to_vec().iter().all(|&x| x == 0x99),
            "read {} after the write got stale data",
            32 + k
        );
    }
    // The stream goes on: the rest of chunk 1 from the base (the written cluster's new
    // bytes, then the old second cluster), chunk 2, not written, from the ring.
    let served = st.bytes_served;
    let got = read_range(&exec, &chain, 160 << 10, 384 << 10, 4096);
    assert!(got[..32 << 10].iter().all(|&x| x == 0x99));
    assert!(got[32 << 10..] == src[192 << 10..384 << 10]);
    assert!(chain.ring().stats().unwrap().bytes_served - served >= 128 << 10);
}

/// Compressed images of every cluster size the ring meets differently — many clusters
/// to a chunk (512 bytes: 256 of them, their streams sharing sectors and read together),
/// a few, a cluster larger than a chunk (the first chunk decompresses the cluster, the
/// next take their part of it) — read sequentially through the ring: what the source holds,
/// with no task (clusters of 2 MiB that barely compress take the big record).
#[test]
fn compressed_chunks_of_every_cluster_size_read_what_the_source_holds() {
    let dir = tempfile::tempdir().unwrap();
    // 4 MiB: text for 3 MiB, then a MiB whose bytes barely compress.
    let mut src = Vec::with_capacity(4 << 20);
    for block in 0..768u64 {
        let line = format!("block {block:06} of a compressed disk. ");
        let mut b = line.repeat(4096 / line.len() + 1).into_bytes();
        b.truncate(4096);
        src.extend(b);
    }
    let mut x = 0x2545_f491_4f6c_dd1du64;
    while src.len() < 4 << 20 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // Half the bytes random: deflate keeps it compressed, at well over a chunk
        // per 2 MiB cluster.
        src.extend_from_slice(&[x as u8, 0, (x >> 8) as u8, 0]);
    }
    let raw = dir.path().join("mixed.raw");
    std::fs::write(&raw, &src).unwrap();
    // Extended L2 too: QEMU writes compressed clusters there, their bitmap 0.
    for (cs, ext) in [
        (512u64, ""),
        (4096, ""),
        (65536, ""),
        (2 << 20, ""),
        (16384, ",extended_l2=on"),
        (65536, ",extended_l2=on,compression_type=zstd"),
    ] {
        let img = dir.path().join(format!("mixed-{cs}{ext}.qcow2"));
        sh(Command::new("qemu-img")
            .args(["convert", "-q", "-c", "-f", "raw", "-O", "qcow2", "-o"])
            .arg(format!("cluster_size={cs}{ext}"))
            .arg(&raw)
            .arg(&img));
        let (exec, chain, devs) = chain_of(&[&img], OpenOptions::default());
        devs[0].0.borrow_mut().latency_polls = 3;
        let got = read_range(&exec, &chain, 0, chain.size(), 16 << 10);
        assert!(
            got == src,
            "{cs}-byte clusters{ext}: bytes differ from the source"
        );
        let s = chain.ring().stats().unwrap();
        assert!(s.compressed_fills >= 15, "{cs}: {s:?}");
        assert!(s.bytes_served >= 3 << 20, "{cs}: {s:?}");
        match cs {
            // Tables of 64 entries: a chunk spans four slices, and a stream's first pass
            // may find every slice-load record busy (a task, as for plain clusters).
            512 => assert!(s.readahead_tasks <= 4, "{cs}: {s:?}"),
            _ => assert_eq!(s.readahead_tasks, 0, "{cs}: {s:?}"),
        }
    }
}

#[test]
fn the_zones_a_stream_left_are_swept_on_the_owners_tick() {
    use qcow2_engine::ring::zones::ZONE;
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img.qcow2");
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&img)
        .arg("80M"));
    qemu_io(&img, &["write -P 0x11 0 1M", "write -P 0x22 65M 1M"]);
    let (exec, chain, _) = chain_of(&[&img], OpenOptions::default());
    let gens = chain.ring().write_gens().unwrap().clone();
    // A stream from the first zone well into the second.
    let mut off = 0;
    while off < ZONE + (8 << 20) {
        let got = read(&exec, &chain, off, 64 << 10);
        let want = match off {
            o if o < 1 << 20 => 0x11,
            o if (65 << 20..66 << 20).contains(&o) => 0x22,
            _ => 0,
        };
        assert!(got.iter().all(|&b| b == want), "at {off}");
        off += 64 << 10;
    }
    assert!(gens.zones().is_watched(0) && gens.zones().is_watched(ZONE));
    // The default interval has not passed; with none, a sweep comes within 64 ticks.
    assert!(!(0..64).any(|_| chain.ring().tick_zones()));
    chain.ring().set_sweep_every(std::time::Duration::ZERO);
    assert!((0..64).any(|_| chain.ring().tick_zones()));
    assert!(!gens.zones().is_watched(0), "left: swept");
    assert!(
        gens.zones().is_watched(ZONE),
        "read ahead in: still watched"
    );
    assert_eq!(gens.zones().swept(), 1);
    // The chain goes (its channel destroyed): nothing of it stays watched.
    drop(chain);
    assert_eq!(gens.zones().sweep(), 1);
    assert!(!gens.zones().is_watched(ZONE));
}
