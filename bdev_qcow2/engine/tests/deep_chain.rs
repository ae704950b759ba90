//! Deep backing chains: a chain of hundreds of images made with qemu-img reads as qemu-img
//! reads it, on the slow path and on the fast path through the layer index
//! (`chain/index.rs`), and once read, every read takes the fast path; the index gives what
//! a walk of the layers gives, after a write to the top and through a stream too.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::io::{BufSlice, HeapBuf, IoBuffer};
use qcow2_engine::stream::{StreamJob, StreamState};
use qcow2_engine::testing::{host, MemDevice, Rng};
use qcow2_engine::{Chain, Error, Exec, Layer, OpenOptions, Qcow2};
use std::cell::RefCell;
use std::path::Path;
use std::process::Command;
use std::rc::Rc;

fn sh(cmd: &mut Command) {
    let out = cmd.output().expect("run");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A chain over `devs` (top first), the top writable when `writable`.
fn chain_of(exec: &Exec<MemDevice>, devs: &[MemDevice], writable: bool) -> Rc<Chain<MemDevice>> {
    let mut layers = Vec::new();
    for (i, d) in devs.iter().enumerate() {
        let id = exec.add_device(d.clone());
        let e2 = exec.clone();
        let opts = OpenOptions {
            writable: writable && i == 0,
            ..Default::default()
        };
        let q = exec
            .block_on(async move { Qcow2::open(&e2, id, opts).await })
            .unwrap();
        layers.push(Layer::Qcow2(Box::new(q)));
    }
    Chain::new(exec, layers).unwrap()
}

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

/// Reads through the host's path (the fast path when every slice it needs is cached).
fn read_host(
    exec: &Exec<MemDevice>,
    chain: &Rc<Chain<MemDevice>>,
    off: u64,
    len: usize,
) -> Vec<u8> {
    let buf = HeapBuf::new(len);
    wait_for(exec, |t| {
        host::read(chain, t, off, BufSlice::whole(buf.clone()))
    })
    .unwrap();
    buf.to_vec()
}

/// Reads on the slow path (a task, the walk that loads slices).
fn read_task(
    exec: &Exec<MemDevice>,
    chain: &Rc<Chain<MemDevice>>,
    off: u64,
    len: usize,
) -> Vec<u8> {
    let (c, buf) = (chain.clone(), HeapBuf::new(len));
    let b2 = buf.clone();
    exec.block_on(async move { c.read(off, BufSlice::whole(b2)).await })
        .unwrap();
    buf.to_vec()
}

/// A random sector-aligned range of a disk of `size` bytes, up to 3 clusters of 64 KiB.
fn range(r: &mut Rng, size: u64) -> (u64, usize) {
    let len = ((r.next() % 384) + 1) * 512;
    let off = (r.next() % (size / 512)) * 512;
    (off.min(size - len), len as usize)
}

#[test]
fn qemu_img_chain_of_300_reads_as_qemu_img_does() {
    const DEPTH: usize = 300;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let name = |i: usize| d.join(format!("l{i:03}.qcow2"));
    // All data in the bottom image; a few layers hold some of it, with other cluster
    // sizes, subclusters and zeros among them.
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-o", "cluster_size=65536"])
        .arg(name(0))
        .arg("4M"));
    let io = |p: &Path, cmds: &[String]| {
        let mut q = Command::new("qemu-io");
        q.args(["-f", "qcow2"]);
        for c in cmds {
            q.arg("-c").arg(c);
        }
        sh(q.arg(p));
    };
    io(&name(0), &["write -P 0x5a 0 4M".into()]);
    for i in 1..DEPTH {
        let opts = match i {
            100 => "cluster_size=4096",
            200 => "extended_l2=on,cluster_size=65536",
            _ => "cluster_size=65536",
        };
        let backing = format!("l{:03}.qcow2", i - 1);
        sh(Command::new("qemu-img")
            .args([
                "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", &backing, "-o", opts,
            ])
            .arg(name(i))
            .current_dir(d));
        let cmds: Vec<String> = match i {
            100 => vec!["write -P 0x64 12k 8k".into()],
            150 => vec!["write -z 512k 128k".into()],
            200 => vec!["write -P 0xc8 8k 2k".into(), "write -z 1M 4k".into()],
            250 => vec!["write -P 0xfa 100k 5k".into()],
            i if i % 37 == 0 => vec![format!(
                "write -P {} {} 64k",
                i % 251,
                (i as u64 * 65536) % (4 << 20)
            )],
            _ => vec![],
        };
        if !cmds.is_empty() {
            io(&name(i), &cmds);
        }
    }
    let raw = d.join("top.raw");
    sh(Command::new("qemu-img")
        .args(["convert", "-O", "raw"])
        .arg(name(DEPTH - 1))
        .arg(&raw));
    let expect = std::fs::read(&raw).unwrap();
    let devs: Vec<MemDevice> = (0..DEPTH)
        .rev()
        .map(|i| MemDevice::new(std::fs::read(name(i)).unwrap()))
        .collect();

    // The slow path, whole.
    let exec = Exec::new();
    let chain = chain_of(&exec, &devs, false);
    assert_eq!(chain.layers().len(), DEPTH);
    assert!(read_task(&exec, &chain, 0, expect.len()) == expect);

    // The host's path on a fresh chain: ranges read twice (first touch, then fast).
    let exec = Exec::new();
    let chain = chain_of(&exec, &devs, false);
    let size = expect.len() as u64;
    let mut r = Rng(48);
    for _ in 0..400 {
        let (off, len) = range(&mut r, size);
        let o = off as usize;
        for _ in 0..2 {
            assert!(
                read_host(&exec, &chain, off, len) == expect[o..o + len],
                "{len} bytes at {off}"
            );
        }
    }
    // Once all of it has been read, every read is planned from the cache and the index.
    for off in (0..size).step_by(1 << 16) {
        read_host(&exec, &chain, off, 1 << 16);
    }
    let before = chain.counters().reads();
    for _ in 0..400 {
        let (off, len) = range(&mut r, size);
        let o = off as usize;
        assert!(read_host(&exec, &chain, off, len) == expect[o..o + len]);
    }
    let after = chain.counters().reads();
    assert_eq!(
        after.slow_reads, before.slow_reads,
        "a read left the fast path"
    );
    assert_eq!(after.fast_reads - before.fast_reads, 400);
    // 4 MiB of 4 KiB units (layer 100's clusters): 2 bytes each, in one 32 KiB chunk.
    assert_eq!(chain.layer_index_bytes(), 32 << 10);
}

/// Writes `data` at `off` into the image on `dev`, opened alone, writable.
fn write_into(dev: &MemDevice, off: u64, data: &[u8]) {
    let exec = Exec::new();
    let chain = chain_of(&exec, std::slice::from_ref(dev), true);
    let (c, buf) = (chain.clone(), HeapBuf::new(data.len()));
    buf.copy_in(0, data);
    exec.block_on(async move {
        c.write(off, BufSlice::whole(buf)).await?;
        c.close().await
    })
    .unwrap();
}

/// Checks `n` random ranges of `chain` against `model`, on the host's path and the slow
/// path alike.
fn check(
    exec: &Exec<MemDevice>,
    chain: &Rc<Chain<MemDevice>>,
    model: &[u8],
    r: &mut Rng,
    n: usize,
) {
    for _ in 0..n {
        let (off, len) = range(r, model.len() as u64);
        let o = off as usize;
        let t = read_task(exec, chain, off, len);
        let first = t.iter().zip(&model[o..o + len]).position(|(a, b)| a != b);
        assert!(
            first.is_none(),
            "task: {len} at {off}: first diff at +{first:?}"
        );
        let h = read_host(exec, chain, off, len);
        let first = h.iter().zip(&model[o..o + len]).position(|(a, b)| a != b);
        assert!(
            first.is_none(),
            "host: {len} at {off}: first diff at +{first:?}"
        );
    }
}

#[test]
fn index_gives_the_walk_after_writes_to_the_top_and_a_stream() {
    const DEPTH: usize = 40;
    const SIZE: u64 = 2 << 20;
    let mut r = Rng(4801);
    // The model: what a walk of the layers gives, each layer's writes over those below.
    let mut model = vec![0u8; SIZE as usize];
    let mut devs = Vec::new();
    for i in 0..DEPTH {
        let dev = MemDevice::new(Vec::new());
        let exec: Exec<MemDevice> = Exec::new();
        let id = exec.add_device(dev.clone());
        let opts = CreateOptions {
            size: SIZE,
            cluster_bits: if i % 7 == 3 { 12 } else { 16 },
            backing_file: (i > 0).then(|| format!("l{}", i - 1)),
            backing_format: (i > 0).then(|| "qcow2".into()),
            ..CreateOptions::default()
        };
        let e2 = exec.clone();
        exec.block_on(async move { create(&e2, id, &opts).await })
            .unwrap();
        for _ in 0..(if i == 0 { 20 } else { r.next() % 4 }) {
            // Whole clusters: the layer is written alone, without its backing file, so a
            // partial cluster would be completed with zeros, not with the layers below.
            let (off, len) = range(&mut r, SIZE);
            let (off, len) = (off & !0xffff, (len + 0xffff) & !0xffff);
            let data: Vec<u8> = (0..len).map(|_| r.next() as u8 | 1).collect();
            write_into(&dev, off, &data);
            model[off as usize..off as usize + len].copy_from_slice(&data);
        }
        devs.push(dev);
    }
    devs.reverse();
    let exec = Exec::new();
    let chain = chain_of(&exec, &devs, true);
    check(&exec, &chain, &model, &mut r, 300);
    // Writes to the top: the index is below it, and the top is asked first.
    for _ in 0..100 {
        let (off, len) = range(&mut r, SIZE);
        let data: Vec<u8> = (0..len).map(|_| r.next() as u8).collect();
        let (c, buf) = (chain.clone(), HeapBuf::new(len));
        buf.copy_in(0, &data);
        exec.block_on(async move { c.write(off, BufSlice::whole(buf)).await })
            .unwrap();
        model[off as usize..off as usize + len].copy_from_slice(&data);
        let o = off as usize;
        assert!(read_host(&exec, &chain, off, len) == model[o..o + len]);
    }
    check(&exec, &chain, &model, &mut r, 300);
    // A stream copies everything up and drops the backing layers.
    let job = StreamJob::new(&chain, 0).unwrap();
    let mut polls = 0u64;
    loop {
        match job.poll(&chain) {
            StreamState::Detaching => job.cores_detached(&chain),
            StreamState::Failed(e) => panic!("stream failed: {e}"),
            StreamState::Done => break,
            _ => {}
        }
        exec.poll(&mut |_, _| {});
        polls += 1;
        assert!(polls < 10_000_000, "the stream does not end");
    }
    assert_eq!(chain.layers().len(), 1);
    check(&exec, &chain, &model, &mut r, 300);
}
