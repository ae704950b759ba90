//! Crash and fault tests of the write path (ARCHITECTURE.md §7).
//!
//! Crash: the in-memory device records every write and flush of a workload. For every
//! device-flush boundary, and for random subsets of the writes issued after it, the crashed
//! image is rebuilt and reopened: `qemu-img check` must find no corruption (leaks are
//! allowed) and every byte written before the last completed guest flush, and not written
//! since, must read back.
//!
//! Fault: for every k, the k-th device operation of a workload fails (EIO, then ENOSPC):
//! no panic, the error reaches the caller, and after reopening the image has no corruption.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

#[path = "crash_common/concurrent.rs"]
mod concurrent;
mod crash_common;
use concurrent::{run_concurrent, Flushes};
use crash_common::states::replay_op;
use crash_common::{new_image, open, open_with};

use qcow2_engine::create::CreateOptions;
use qcow2_engine::io::{BufSlice, HeapBuf, IoBuffer};
use qcow2_engine::testing::host;
use qcow2_engine::testing::Rng;
use qcow2_engine::testing::{LoggedOp, MemDevice};
use qcow2_engine::{Chain, Error, Exec, Layer};
use std::path::Path;
use std::process::Command;
use std::rc::Rc;

#[derive(Clone, Debug)]
enum Op {
    Write(u64, Vec<u8>),
    Zero(u64, u64, bool),
    Discard(u64, u64),
    Flush,
    /// Deletes internal snapshot `base` (the guest disk is unchanged).
    DeleteSnapshot,
}

fn workload(seed: u64, size: u64, cs: u64, n: usize) -> Vec<Op> {
    let mut r = Rng(seed | 1);
    (0..n)
        .map(|_| {
            let len = (1 + r.below((cs * 2 / 512).clamp(1, 512))) * 512;
            let off = r.below((size - len) / 512) * 512;
            match r.below(10) {
                0 => Op::Zero(off, len, r.below(2) == 0),
                1 => Op::Discard(off, len),
                2 | 3 => Op::Flush,
                _ => Op::Write(off, (0..len).map(|_| r.next() as u8).collect()),
            }
        })
        .collect()
}

fn apply(exec: &Exec<MemDevice>, chain: &Rc<Chain<MemDevice>>, op: &Op) -> Result<(), Error> {
    apply_via(exec, chain, op, false)
}

/// [`apply`]; with `submit`, a write goes in as a host submits it (`Chain::plan` and its step:
/// planned on the spot where it can, which is where first writes take their group of
/// clusters ahead, `OpenOptions::alloc_granule`).
fn apply_via(
    exec: &Exec<MemDevice>,
    chain: &Rc<Chain<MemDevice>>,
    op: &Op,
    submit: bool,
) -> Result<(), Error> {
    let c = chain.clone();
    match op.clone() {
        Op::Write(off, data) if submit => {
            let buf = HeapBuf::new(data.len());
            buf.copy_in(0, &data);
            host::write(&c, 1, off, BufSlice::whole(buf));
            let mut res = None;
            while res.is_none() {
                exec.poll(&mut |_, r| res = Some(r));
            }
            res.unwrap_or(Ok(()))
        }
        Op::Write(off, data) => {
            let buf = HeapBuf::new(data.len());
            buf.copy_in(0, &data);
            exec.block_on(async move { c.write(off, BufSlice::whole(buf)).await })
        }
        Op::Zero(off, len, unmap) => {
            exec.block_on(async move { c.write_zeroes(off, len, unmap).await })
        }
        Op::Discard(off, len) => exec.block_on(async move { c.discard(off, len).await }),
        Op::Flush => exec.block_on(async move { c.flush().await }),
        Op::DeleteSnapshot => exec.block_on(async move {
            let Some(Layer::Qcow2(q)) = c.layers().first() else {
                unreachable!("a chain of one qcow2 layer")
            };
            q.snapshot_delete("base").await.map(|_| ())
        }),
    }
}

/// Updates the reference disk; returns the guest range an op may change. `gran` is the
/// discard granularity (cluster, or subcluster with extended L2).
fn reference_apply(reference: &mut [u8], op: &Op, gran: u64) -> Option<(u64, u64)> {
    match op {
        Op::Write(off, data) => {
            reference[*off as usize..*off as usize + data.len()].copy_from_slice(data);
            Some((*off, data.len() as u64))
        }
        Op::Zero(off, len, _) => {
            reference[*off as usize..(*off + *len) as usize].fill(0);
            Some((*off, *len))
        }
        // Discard: whole (sub)clusters read as zeros afterwards, partial ones are unchanged.
        Op::Discard(off, len) => {
            let (a, b) = (off.div_ceil(gran) * gran, (off + len) / gran * gran);
            if a < b {
                reference[a as usize..b as usize].fill(0);
            }
            Some((*off, *len))
        }
        Op::Flush | Op::DeleteSnapshot => None,
    }
}

fn qemu_check(path: &Path) -> (i32, String) {
    let out = Command::new("qemu-img")
        .args(["check", "-f", "qcow2"])
        .arg(path)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

fn read_all(bytes: Vec<u8>, size: u64) -> Vec<u8> {
    let exec = Exec::new();
    let dev = MemDevice::new(bytes);
    let chain = open(&exec, &dev, false).unwrap();
    let buf = HeapBuf::new(size as usize);
    let b2 = buf.clone();
    exec.block_on(async move { chain.read(0, BufSlice::whole(b2)).await })
        .unwrap();
    buf.to_vec()
}

fn crash_test(opts: CreateOptions, seed: u64, ops: usize, subsets: usize) -> usize {
    crash_test_on(opts, seed, ops, subsets, None, false)
}

/// [`crash_test`] on a device of a fixed size (`Some(bytes)`, like a bdev, opened with the
/// ordered layout: data in per-slice regions) or one that grows (`None`, like a file);
/// with `cheap_zeroes`, the device zeroes itself (`WriteZeroes`, logged as writes of zeros).
fn crash_test_on(
    opts: CreateOptions,
    seed: u64,
    ops: usize,
    subsets: usize,
    fixed: Option<usize>,
    cheap_zeroes: bool,
) -> usize {
    let setup = Setup {
        fixed,
        cheap_zeroes,
        ..Default::default()
    };
    crash_test_with(opts, seed, ops, subsets, setup)
}

/// The device and host of a crash test.
#[derive(Default, Clone, Copy)]
struct Setup {
    /// A device of this fixed size (like a bdev); `None`: one that grows (like a file).
    fixed: Option<usize>,
    /// The device zeroes itself (`WriteZeroes`, logged as writes of zeros).
    cheap_zeroes: bool,
    /// Writes submitted as a host does ([`apply_via`]).
    submit: bool,
    /// On a fixed device, stale bytes past the image, and the owner zeroes ahead of its
    /// allocator (`OpenOptions::zero_ahead`).
    zero_ahead: bool,
    /// With `zero_ahead`: the device has no write-zeroes but its discard leaves zeros (a
    /// file's punched hole on tmpfs), so zeroing ahead punches.
    punch: bool,
    /// The device discards, and every freed cluster is discarded
    /// (`OpenOptions::pass_discard_*`): a crash replay fills discarded bytes with garbage.
    discards: bool,
    /// The disk starts written (its first half) with internal snapshot `base` of it, which
    /// the workload deletes halfway: writes copy shared clusters and L2 tables, and the
    /// deletion frees the snapshot's.
    snapshot: bool,
    /// Opened with this dirty bound (`OpenOptions::dirty_bound_bytes`) and 512-byte
    /// slices, the ops submitted as a host does, up to 8 at a time (writes, write-zeroes
    /// and discards of distinct ranges; a flush once those before it completed, with the
    /// next ones in flight): write-backs at the bound run while allocations go on.
    concurrent_bound: Option<u64>,
    /// With `punch`: the owner punches once, at its first allocation, from the clusters in
    /// use to where the image fully allocated ends, and never past it: the device from
    /// this byte on keeps its stale bytes in every crash state.
    stale_from: Option<usize>,
}

/// What a crash replay leaves in discarded bytes: anything, so not zeros.
const DISCARDED: u8 = 0xd5;

/// Writes pseudo-random bytes over the first half of the disk, takes internal snapshot
/// `base` of it and flushes; returns the disk's bytes.
fn written_with_snapshot(
    exec: &Exec<MemDevice>,
    chain: &Rc<Chain<MemDevice>>,
    size: u64,
    seed: u64,
) -> Vec<u8> {
    let mut r = Rng(seed | 1);
    let mut disk = vec![0u8; size as usize];
    disk[..size as usize / 2].fill_with(|| r.next() as u8);
    apply(
        exec,
        chain,
        &Op::Write(0, disk[..size as usize / 2].to_vec()),
    )
    .unwrap();
    let c = chain.clone();
    exec.block_on(async move {
        let Some(Layer::Qcow2(q)) = c.layers().first() else {
            unreachable!("a chain of one qcow2 layer")
        };
        q.snapshot_create("base", Default::default()).await?;
        c.flush().await
    })
    .unwrap();
    disk
}

/// [`crash_test`] with the device and host of `setup`.
fn crash_test_with(
    opts: CreateOptions,
    seed: u64,
    ops: usize,
    subsets: usize,
    setup: Setup,
) -> usize {
    let Setup {
        fixed,
        cheap_zeroes,
        submit,
        zero_ahead,
        punch,
        discards,
        snapshot,
        concurrent_bound,
        stale_from,
    } = setup;
    let size = opts.size;
    let cs = 1u64 << opts.cluster_bits;
    let mut initial = new_image(&opts);
    if let (Some(bytes), true) = (fixed, zero_ahead) {
        initial.resize(bytes, 0xee);
    }
    let exec = Exec::new();
    let dev = match fixed {
        Some(bytes) => MemDevice::fixed(initial.clone(), bytes),
        None => MemDevice::new(initial.clone()),
    };
    dev.0.borrow_mut().discards = discards || punch;
    if punch {
        let mut s = dev.0.borrow_mut();
        s.discard_zeroes = true;
        s.zeroes_fail = Some(95); // EOPNOTSUPP
    }
    let chain = match concurrent_bound {
        Some(bound) => crash_common::open_opts(
            &exec,
            &dev,
            qcow2_engine::OpenOptions {
                writable: true,
                l2_slice_bytes: 512,
                l2_cache_bytes: Some(8 << 10),
                dirty_bound_bytes: Some(bound),
                ..Default::default()
            },
        )
        .unwrap(),
        None => open_with(&exec, &dev, true, zero_ahead).unwrap(),
    };
    let mut reference = vec![0u8; size as usize];
    if snapshot {
        reference = written_with_snapshot(&exec, &chain, size, seed);
        initial = dev.contents();
    }
    dev.0.borrow_mut().record = true;
    dev.0.borrow_mut().cheap_zeroes = cheap_zeroes;
    let mut work = workload(seed, size, cs, ops);
    if snapshot {
        work.insert(ops / 2, Op::DeleteSnapshot);
    }
    // Per completed guest flush: (device log length at completion, reference snapshot,
    // index of the op).
    let mut flushes: Flushes = vec![(0, reference.clone(), 0)];
    let mut touched_after: Vec<Vec<(u64, u64)>> = vec![Vec::new()];
    let gran = if opts.extended_l2 { cs / 32 } else { cs };
    if concurrent_bound.is_some() {
        run_concurrent(
            &exec,
            &chain,
            &dev,
            &work,
            gran,
            &mut reference,
            &mut flushes,
            &mut touched_after,
        );
    }
    for (i, op) in work.iter().enumerate() {
        if concurrent_bound.is_some() {
            break;
        }
        apply_via(&exec, &chain, op, submit).unwrap();
        if let Some(r) = reference_apply(&mut reference, op, gran) {
            for t in touched_after.iter_mut() {
                t.push(r);
            }
        }
        if matches!(op, Op::Flush) {
            flushes.push((dev.0.borrow().log.len(), reference.clone(), i));
            touched_after.push(Vec::new());
        }
    }
    if discards {
        // Closed, as a lazy-refcount image frees (and discards) only at a full write-back.
        let c = chain.clone();
        exec.block_on(async move { c.close().await }).unwrap();
        flushes.push((dev.0.borrow().log.len(), reference.clone(), work.len()));
        touched_after.push(Vec::new());
    }
    let log = dev.0.borrow().log.clone();
    if cheap_zeroes {
        assert!(
            dev.0.borrow().zero_writes > 0,
            "the workload leaves zeroing to the device"
        );
    }
    if discards {
        assert!(
            log.iter().any(|e| matches!(e, LoggedOp::Discard(..))),
            "the workload discards freed clusters"
        );
    }
    if stale_from.is_some() {
        // A punch on a device whose discard leaves zeros is logged as a write of zeros;
        // stepping ahead would punch a MiB or more at a time, several times.
        let punches = log
            .iter()
            .filter(|e| matches!(e, LoggedOp::Write(_, d) if d.len() >= 1 << 20 && d.iter().all(|b| *b == 0)))
            .count();
        assert_eq!(punches, 1, "one punch ahead per open");
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("crash.qcow2");
    let mut rng = Rng(seed ^ 0xdead_beef);
    let mut states = 0;
    // Every device-flush boundary (and the very start).
    let mut boundaries: Vec<usize> = vec![0];
    boundaries.extend(
        log.iter()
            .enumerate()
            .filter(|(_, e)| matches!(e, LoggedOp::Flush))
            .map(|(i, _)| i + 1),
    );
    for &p in &boundaries {
        // Writes after p up to the next flush may or may not have reached the disk.
        let next = log[p..]
            .iter()
            .position(|e| matches!(e, LoggedOp::Flush))
            .map_or(log.len(), |q| p + q);
        for subset in 0..=subsets {
            let mut img = initial.clone();
            let mut replay = |e: &LoggedOp| match e {
                // A file's new length survives like a write: kept or not until a flush.
                LoggedOp::Write(..) | LoggedOp::Grow(_) => replay_op(&mut img, e),
                // Discarded bytes read as anything: garbage shows a cluster still in use.
                LoggedOp::Discard(off, len) => {
                    let end = ((off + len) as usize).min(img.len());
                    if (*off as usize) < end {
                        img[*off as usize..end].fill(DISCARDED);
                    }
                }
                LoggedOp::Flush => {}
            };
            log[..p].iter().for_each(&mut replay);
            if subset > 0 {
                if next == p {
                    break;
                }
                for e in &log[p..next] {
                    if rng.below(2) == 0 {
                        replay(e);
                    }
                }
            }
            states += 1;
            if let Some(from) = stale_from {
                assert!(
                    img[from..].iter().all(|b| *b == 0xee),
                    "crash state at log {p} subset {subset}: the device past the image's \
                     fully allocated end was touched"
                );
            }
            if opts.lazy_refcounts {
                // A dirty image is repaired when opened for writing; then it must be clean.
                let exec = Exec::new();
                let dev = MemDevice::new(img.clone());
                let chain = open(&exec, &dev, true).unwrap();
                exec.block_on(async move { chain.close().await }).unwrap();
                img = dev.contents();
            }
            // Whatever a crash keeps, the device reads zeros past the zeroed tail it claims.
            let h =
                qcow2_engine::format::ImageHeader::decode(&img[..cs as usize], img.len() as u64)
                    .unwrap();
            if let Some(z) = h.extensions.zeroed_tail {
                let from = (z.from as usize).min(img.len());
                if let Some(i) = img[from..].iter().position(|b| *b != 0) {
                    panic!(
                        "crash state at log {p} subset {subset}: byte {:#x} past the zeroed tail {from:#x} is not zero",
                        from + i
                    );
                }
            }
            std::fs::write(&path, &img).unwrap();
            let (code, out) = qemu_check(&path);
            assert!(
                code == 0 || code == 3,
                "crash state at log {p} subset {subset}: qemu-img check {code}\n{out}"
            );
            // The last guest flush completed by p: its data must be there, except where a
            // later op may have changed it.
            let g = flushes.iter().rposition(|(at, _, _)| *at <= p).unwrap_or(0);
            let data = read_all(img, size);
            let (_, snap, _) = &flushes[g];
            let mut mask = vec![true; size as usize];
            for &(o, l) in &touched_after[g] {
                mask[o as usize..(o + l) as usize].fill(false);
            }
            if let Some(i) = (0..size as usize).find(|&i| mask[i] && data[i] != snap[i]) {
                let hist: Vec<String> = work
                    .iter()
                    .enumerate()
                    .filter_map(|(k, op)| {
                        let r = match op {
                            Op::Write(o, d) => (*o, d.len() as u64, "write"),
                            Op::Zero(o, l, u) => (*o, *l, if *u { "zero-unmap" } else { "zero" }),
                            Op::Discard(o, l) => (*o, *l, "discard"),
                            Op::Flush => return Some(format!("{k}:flush")),
                            Op::DeleteSnapshot => return Some(format!("{k}:delete-snapshot")),
                        };
                        (r.0 <= i as u64 && (i as u64) < r.0 + r.1)
                            .then(|| format!("{k}:{}@{:#x}+{:#x}", r.2, r.0, r.1))
                    })
                    .collect();
                panic!(
                    "crash state at log {p} subset {subset}: byte {i} lost (flush {g} = op {}): got {:#x} want {:#x}; history {hist:?}",
                    flushes[g].2, data[i], snap[i]
                );
            }
        }
    }
    states
}

#[test]
fn crash_states_64k() {
    let n = crash_test(
        CreateOptions {
            size: 8 << 20,
            ..Default::default()
        },
        11,
        120,
        3,
    );
    eprintln!("crash states tried (64 KiB clusters): {n}");
    assert!(n > 50);
}

#[test]
fn crash_states_fixed_device() {
    // A bdev-like device: data clusters go to per-slice regions (4 KiB clusters: a slice
    // is a whole L2 table), reserved in the order the workload touches them.
    let n = crash_test_on(
        CreateOptions {
            size: 8 << 20,
            cluster_bits: 12,
            ..Default::default()
        },
        15,
        120,
        3,
        Some(10 << 20),
        false,
    );
    eprintln!("crash states tried (fixed-size device, 4 KiB clusters): {n}");
    assert!(n > 50);
}

#[test]
fn crash_states_first_writes_taking_their_group_ahead() {
    // 4 KiB clusters on a device that grows, writes submitted as a host does: first writes
    // planned on the spot take the aligned 64 KiB group around them (clusters past the
    // file's end, which read zeros unwritten) and write only their own bytes. Every crash
    // state must still read back what the last completed flush covered, and check clean.
    let n = crash_test_with(
        CreateOptions {
            size: 8 << 20,
            cluster_bits: 12,
            ..Default::default()
        },
        23,
        120,
        3,
        Setup {
            submit: true,
            ..Default::default()
        },
    );
    eprintln!("crash states tried (clusters taken ahead): {n}");
    assert!(n > 50);
}

#[test]
fn crash_states_zeroing_ahead() {
    // A bdev holding an image with no zeroed tail and stale bytes past it: the owner
    // zeroes the device ahead of its allocator, and first writes (64 KiB clusters, taking
    // their group with 4 KiB ones) write the guest's bytes alone. Whatever a crash keeps,
    // the stale bytes never show through a cluster the image maps.
    for (cluster_bits, seed) in [(16, 31), (12, 37)] {
        let n = crash_test_with(
            CreateOptions {
                size: 8 << 20,
                cluster_bits,
                ..Default::default()
            },
            seed,
            120,
            3,
            Setup {
                fixed: Some(12 << 20),
                submit: true,
                zero_ahead: true,
                ..Default::default()
            },
        );
        eprintln!(
            "crash states tried (zeroing ahead, {} KiB clusters): {n}",
            1 << (cluster_bits - 10)
        );
        assert!(n > 50);
    }
}

#[test]
fn crash_states_zeroing_ahead_by_punching() {
    // As above on a device whose discard leaves zeros and that has no write-zeroes (an AIO
    // file on tmpfs): the owner punches ahead of its allocator; a punch a crash loses
    // leaves the stale bytes, which must never show through a cluster the image maps.
    for (cluster_bits, seed) in [(16, 43), (12, 47)] {
        let n = crash_test_with(
            CreateOptions {
                size: 8 << 20,
                cluster_bits,
                ..Default::default()
            },
            seed,
            120,
            3,
            Setup {
                fixed: Some(12 << 20),
                submit: true,
                zero_ahead: true,
                punch: true,
                ..Default::default()
            },
        );
        eprintln!(
            "crash states tried (punching ahead, {} KiB clusters): {n}",
            1 << (cluster_bits - 10)
        );
        assert!(n > 50);
    }
}

#[test]
fn crash_states_punching_ahead_once_to_the_images_end() {
    // As above on a device far larger than the image needs: the first allocation punches
    // from the clusters in use to where the image fully allocated ends, in one go (on ext4
    // each punch waits for every direct I/O in flight, #48), and no further. Whatever a
    // crash keeps, the stale bytes never show through a mapped cluster, and the device past
    // what the image can need keeps them.
    let size = 8u64 << 20;
    let need = qcow2_engine::format::measure::prealloc_size(size, 64 << 10, 4, false);
    let n = crash_test_with(
        CreateOptions {
            size,
            cluster_bits: 16,
            ..Default::default()
        },
        53,
        120,
        3,
        Setup {
            fixed: Some(48 << 20),
            submit: true,
            zero_ahead: true,
            punch: true,
            stale_from: Some(need as usize),
            ..Default::default()
        },
    );
    eprintln!("crash states tried (one punch ahead to the image's end): {n}");
    assert!(n > 50);
}

#[test]
fn crash_states_zeroed_tail() {
    // A bdev formatted after zeroing it: first writes past the zeroed tail write the
    // guest's bytes alone, and the tail on disk must always lie past every byte written
    // (data in per-slice regions, placed out of order).
    let n = crash_test_on(
        CreateOptions {
            size: 8 << 20,
            cluster_bits: 12,
            zeroed_tail: true,
            ..Default::default()
        },
        19,
        120,
        3,
        Some(80 << 20),
        false,
    );
    eprintln!("crash states tried (zeroed tail): {n}");
    assert!(n > 50);
}

#[test]
fn crash_states_device_that_zeroes() {
    // A malloc bdev or an NVMe namespace: partial first writes into 64 KiB clusters leave
    // the rest of the cluster to the device's WriteZeroes, which must be as ordered as the
    // data write before the L2 entry that maps the cluster.
    let n = crash_test_on(
        CreateOptions {
            size: 8 << 20,
            ..Default::default()
        },
        17,
        120,
        3,
        Some(12 << 20),
        true,
    );
    eprintln!("crash states tried (device that zeroes, 64 KiB clusters): {n}");
    assert!(n > 50);
}

#[test]
fn crash_states_small_clusters_refcount_1() {
    let n = crash_test(
        CreateOptions {
            size: 2 << 20,
            cluster_bits: 9,
            refcount_order: 0,
            ..Default::default()
        },
        12,
        120,
        3,
    );
    eprintln!("crash states tried (512 B clusters, refcount_bits 1): {n}");
    assert!(n > 50);
}

#[test]
fn crash_states_writebacks_at_the_bound_with_allocations_running() {
    // 4 KiB clusters, 512-byte slices, a dirty bound of 4 slices: write-backs at the bound
    // write their slices with the metadata lock released while the other ops in flight
    // allocate, free and dirty slices again, and flushes arrive during them. Every crash
    // state must check clean and read back what the last completed flush covered.
    for (seed, lazy) in [(31, false), (32, false), (33, true)] {
        let opts = CreateOptions {
            size: 8 << 20,
            cluster_bits: 12,
            lazy_refcounts: lazy,
            ..Default::default()
        };
        let setup = Setup {
            concurrent_bound: Some(2 << 10),
            ..Default::default()
        };
        let n = crash_test_with(opts.clone(), seed, 160, 2, setup);
        eprintln!("crash states tried (write-backs at the bound, lazy {lazy}): {n}");
        assert!(n > 40);
    }
}

#[test]
fn crash_states_lazy_refcounts() {
    let n = crash_test(
        CreateOptions {
            size: 8 << 20,
            lazy_refcounts: true,
            ..Default::default()
        },
        14,
        100,
        2,
    );
    eprintln!("crash states tried (lazy refcounts, repaired on open): {n}");
    assert!(n > 30);
}

#[test]
fn crash_states_extended_l2() {
    let n = crash_test(
        CreateOptions {
            size: 8 << 20,
            extended_l2: true,
            ..Default::default()
        },
        13,
        120,
        3,
    );
    eprintln!("crash states tried (extended L2): {n}");
    assert!(n > 50);
}

#[test]
fn crash_states_discarding_freed_clusters() {
    // A device that discards (a sparse file, a thin lvol): every cluster the workload frees
    // (guest discards, write-zeroes with unmap) is discarded on it, and a crash replay
    // leaves garbage there. No crash state may read garbage where flushed data was: a
    // cluster is discarded only once nothing on the device points at it, and never after
    // it was handed out again.
    // Small disks, so that discards often meet allocated clusters.
    for (cluster_bits, size, seed, lazy_refcounts) in [
        (16, 4 << 20, 41, false),
        (12, 512 << 10, 43, false),
        (16, 4 << 20, 47, true),
    ] {
        let n = crash_test_with(
            CreateOptions {
                size,
                cluster_bits,
                lazy_refcounts,
                ..Default::default()
            },
            seed,
            120,
            3,
            Setup {
                discards: true,
                ..Default::default()
            },
        );
        eprintln!("crash states tried (discards, {cluster_bits} cluster bits, lazy {lazy_refcounts}): {n}");
        assert!(n > 50);
    }
}

#[test]
fn crash_states_discarding_what_a_snapshot_deletion_frees() {
    // The disk starts with a snapshot of its first half: writes copy shared clusters and L2
    // tables, then the snapshot is deleted halfway, freeing (and discarding) the clusters
    // and tables only it still held, while the workload goes on reusing freed space.
    for (cluster_bits, seed) in [(16, 53), (12, 59)] {
        let n = crash_test_with(
            CreateOptions {
                size: 4 << 20,
                cluster_bits,
                ..Default::default()
            },
            seed,
            120,
            2,
            Setup {
                discards: true,
                snapshot: true,
                ..Default::default()
            },
        );
        eprintln!(
            "crash states tried (snapshot deleted, discards, {cluster_bits} cluster bits): {n}"
        );
        assert!(n > 50);
    }
}

fn fault_test(opts: CreateOptions, seed: u64, ops: usize, errno: i32) -> usize {
    let size = opts.size;
    let cs = 1u64 << opts.cluster_bits;
    let initial = new_image(&opts);
    let work = workload(seed, size, cs, ops);
    // Count the device operations of a clean run.
    let total = {
        let exec = Exec::new();
        let dev = MemDevice::new(initial.clone());
        let chain = open(&exec, &dev, true).unwrap();
        let start = dev.0.borrow().ops;
        for op in &work {
            apply(&exec, &chain, op).unwrap();
        }
        apply(&exec, &chain, &Op::Flush).unwrap();
        let end = dev.0.borrow().ops;
        end - start
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fault.qcow2");
    for k in 0..total {
        let exec = Exec::new();
        let dev = MemDevice::new(initial.clone());
        let chain = open(&exec, &dev, true).unwrap();
        let start = dev.0.borrow().ops;
        dev.0.borrow_mut().fail_op = Some((start + k, errno));
        let mut saw = false;
        for op in work.iter().chain(std::iter::once(&Op::Flush)) {
            match apply(&exec, &chain, op) {
                Ok(()) => {}
                Err(Error::Io(e)) if e == errno => saw = true,
                Err(e) => panic!("fault at op {k}: unexpected error {e:?}"),
            }
        }
        assert!(saw, "fault at device op {k} never reached the caller");
        // A final flush after the fault persists whatever was still dirty.
        let _ = apply(&exec, &chain, &Op::Flush);
        std::fs::write(&path, dev.contents()).unwrap();
        let (code, out) = qemu_check(&path);
        assert!(
            code == 0 || code == 3,
            "fault at device op {k} (errno {errno}): qemu-img check {code}\n{out}"
        );
    }
    total as usize
}

#[test]
fn faults_eio_then_enospc() {
    let opts = CreateOptions {
        size: 4 << 20,
        cluster_bits: 12,
        ..Default::default()
    };
    for errno in [5, 28] {
        let n = fault_test(opts.clone(), 21, 40, errno);
        eprintln!("fault points tried with errno {errno}: {n}");
        assert!(n > 20);
    }
}

#[test]
fn faults_extended_l2() {
    let opts = CreateOptions {
        size: 4 << 20,
        cluster_bits: 14,
        extended_l2: true,
        ..Default::default()
    };
    let n = fault_test(opts, 22, 40, 5);
    eprintln!("fault points tried (extended L2): {n}");
}
