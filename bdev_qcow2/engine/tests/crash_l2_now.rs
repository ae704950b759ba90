//! Crash states of first writes that make their L2 table on the spot (`Chain::plan_now`,
//! `Owner::ensure_l2_now`): a fresh image with 4 KiB clusters (one L2 table per 2 MiB of
//! guest disk), writes submitted as a host submits them, the first write into each 2 MiB
//! region planned on the spot. The test asserts that those writes did make their table that
//! way (the region's L1 entry was empty before the write, and the write was planned on the
//! spot, which `plan_now` does only once `ensure_l2_now` made the table), then rebuilds the
//! image at every device write (the log's prefixes) and at every flush boundary with random
//! subsets of the writes after it: `qemu-img check` finds no corruption (leaks allowed) and
//! every byte the last completed guest flush covered reads back, unless a later write changed
//! it (the new table is stable before the L1 entry that points at it, ARCHITECTURE.md §7).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

#[allow(dead_code)] // the openers the other crash tests use
mod crash_common;
use crash_common::states::{qemu_accepts, qemu_clean, replay_op, say_states};
use crash_common::{new_image, open, open_with};

use qcow2_engine::create::CreateOptions;
use qcow2_engine::io::{BufSlice, HeapBuf, IoBuffer};
use qcow2_engine::testing::{host, LoggedOp, MemDevice, Rng};
use qcow2_engine::{Chain, Exec, Layer};
use std::rc::Rc;

/// The guest disk: 16 L2 tables of 4 KiB clusters.
const SIZE: u64 = 32 << 20;
const CLUSTER_BITS: u32 = 12;
/// Guest bytes one L2 table (one L1 entry) covers with 4 KiB clusters: 512 entries.
const L1_COVERAGE: u64 = 2 << 20;

#[derive(Clone, Debug)]
enum Op {
    Write(u64, Vec<u8>),
    Flush,
}

/// A write at the start of the disk (the image's first allocation reads refcounts, so the
/// write's task makes its table), then a first write into every other 2 MiB region in a
/// shuffled order, each followed by a write into a region written already (a first write
/// of its cluster, or an overwrite) and now and then a flush; a flush last.
fn workload(seed: u64) -> Vec<Op> {
    let mut r = Rng(seed | 1);
    let mut bytes = |len: u64| (0..len).map(|_| r.next() as u8).collect::<Vec<u8>>();
    let mut r2 = Rng(seed ^ 0x5eed);
    let mut order: Vec<u64> = (1..SIZE / L1_COVERAGE).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, r2.below(i as u64 + 1) as usize);
    }
    let mut ops = vec![Op::Write(0, bytes(4096))];
    let mut written = vec![0];
    // 512 B to 12 KiB at a sector of `region`.
    let in_region = |region: u64, r2: &mut Rng| {
        let len = (1 + r2.below(24)) * 512;
        (
            region * L1_COVERAGE + r2.below((L1_COVERAGE - len) / 512) * 512,
            len,
        )
    };
    for (i, region) in order.into_iter().enumerate() {
        let (off, len) = in_region(region, &mut r2);
        ops.push(Op::Write(off, bytes(len)));
        written.push(region);
        let again = written[r2.below(written.len() as u64) as usize];
        let (off, len) = in_region(again, &mut r2);
        ops.push(Op::Write(off, bytes(len)));
        if i % 2 == 1 {
            ops.push(Op::Flush);
        }
    }
    ops.push(Op::Flush);
    ops
}

fn owner_writes_planned_now(chain: &Chain<MemDevice>) -> u64 {
    match &chain.layers()[0] {
        Layer::Qcow2(q) => q.owner_stats().unwrap().writes_planned_now,
        Layer::Raw { .. } => unreachable!("a chain of one qcow2 layer"),
    }
}

/// Submits `op` as a host does and polls until it completes.
fn submit(exec: &Exec<MemDevice>, chain: &Rc<Chain<MemDevice>>, op: &Op) {
    match op {
        Op::Write(off, data) => {
            let buf = HeapBuf::new(data.len());
            buf.copy_in(0, data);
            host::write(chain, 1, *off, BufSlice::whole(buf));
        }
        Op::Flush => host::flush(chain, 1),
    }
    let mut res = None;
    while res.is_none() {
        exec.poll(&mut |_, r| res = Some(r));
    }
    res.unwrap().unwrap();
}

/// The guest disk of image bytes `img`.
fn read_all(img: Vec<u8>) -> Vec<u8> {
    let exec = Exec::new();
    let dev = MemDevice::new(img);
    let chain = open(&exec, &dev, false).unwrap();
    let buf = HeapBuf::new(SIZE as usize);
    let b2 = buf.clone();
    exec.block_on(async move { chain.read(0, BufSlice::whole(b2)).await })
        .unwrap();
    buf.to_vec()
}

/// Raw L1 entry `idx` of image bytes `img` (big-endian, at the header's L1 table offset).
fn l1_entry(img: &[u8], idx: u64) -> u64 {
    let be64 = |o: usize| u64::from_be_bytes(img[o..o + 8].try_into().unwrap());
    be64(be64(40) as usize + idx as usize * 8)
}

#[test]
fn crash_states_of_first_writes_making_their_l2_table_on_the_spot() {
    let opts = CreateOptions {
        size: SIZE,
        cluster_bits: CLUSTER_BITS,
        ..Default::default()
    };
    let initial = new_image(&opts);
    let exec = Exec::new();
    // A device that grows, like a file (no per-slice data regions: first writes are
    // planned on the spot).
    let dev = MemDevice::new(initial.clone());
    let chain = open_with(&exec, &dev, true, false).unwrap();
    dev.0.borrow_mut().record = true;

    let work = workload(61);
    let mut reference = vec![0u8; SIZE as usize];
    // Per completed guest flush: the device log's length at its completion and the disk
    // then; and per flush, the ranges ops after it wrote.
    let mut flushes: Vec<(usize, Vec<u8>)> = vec![(0, reference.clone())];
    let mut touched_after: Vec<Vec<(u64, u64)>> = vec![Vec::new()];
    let mut regions_written = vec![false; (SIZE / L1_COVERAGE) as usize];
    let mut made_now = Vec::new();
    for op in &work {
        let planned = owner_writes_planned_now(&chain);
        submit(&exec, &chain, op);
        match op {
            Op::Write(off, data) => {
                let (first, last) = (
                    off / L1_COVERAGE,
                    (off + data.len() as u64 - 1) / L1_COVERAGE,
                );
                // An empty L1 entry before, a write planned on the spot: `ensure_l2_now`
                // made the table (plan_now plans nothing until it has).
                if first == last
                    && !regions_written[first as usize]
                    && owner_writes_planned_now(&chain) > planned
                {
                    made_now.push(first);
                }
                for r in first..=last {
                    regions_written[r as usize] = true;
                }
                reference[*off as usize..*off as usize + data.len()].copy_from_slice(data);
                for t in touched_after.iter_mut() {
                    t.push((*off, data.len() as u64));
                }
            }
            Op::Flush => {
                flushes.push((dev.0.borrow().log.len(), reference.clone()));
                touched_after.push(Vec::new());
            }
        }
    }
    // Every region's first write after the image's first made its table on the spot.
    made_now.sort_unstable();
    assert_eq!(
        made_now,
        (1..SIZE / L1_COVERAGE).collect::<Vec<u64>>(),
        "the regions whose L2 table a write planned on the spot made"
    );
    let log = dev.0.borrow().log.clone();
    let mut all = initial.clone();
    log.iter().for_each(|e| replay_op(&mut all, e));
    for &r in &made_now {
        assert_ne!(l1_entry(&all, r), 0, "L1 entry {r} after the last flush");
    }
    eprintln!(
        "L2 tables made on the spot: {} of {}; device log of {} operations",
        made_now.len(),
        SIZE / L1_COVERAGE,
        log.len()
    );

    // Crash points: after every device write (each prefix of the log), and at every flush
    // boundary with random subsets of the writes up to the next flush.
    let mut points: Vec<(usize, Option<u64>)> = (0..=log.len())
        .filter(|&k| k == 0 || matches!(log[k - 1], LoggedOp::Write(..) | LoggedOp::Grow(_)))
        .map(|k| (k, None))
        .collect();
    let mut boundaries = vec![0];
    boundaries.extend(
        log.iter()
            .enumerate()
            .filter(|(_, e)| matches!(e, LoggedOp::Flush))
            .map(|(i, _)| i + 1),
    );
    for &p in &boundaries {
        points.extend((1..=3).map(|s| (p, Some(s * 7919 + p as u64))));
    }
    let mut states = 0;
    for (p, subset) in points {
        let mut img = initial.clone();
        log[..p].iter().for_each(|e| replay_op(&mut img, e));
        if let Some(seed) = subset {
            let next = log[p..]
                .iter()
                .position(|e| matches!(e, LoggedOp::Flush))
                .map_or(log.len(), |q| p + q);
            if next == p {
                continue;
            }
            let mut rng = Rng(seed | 1);
            for e in &log[p..next] {
                if rng.below(2) == 0 {
                    replay_op(&mut img, e);
                }
            }
        }
        let label = format!("log {p} subset {subset:?}");
        qemu_accepts(&label, &img);
        // What the last guest flush completed by p covered, unless written since.
        let g = flushes.iter().rposition(|(at, _)| *at <= p).unwrap_or(0);
        let (_, snap) = &flushes[g];
        let data = read_all(img);
        let mut mask = vec![true; SIZE as usize];
        for &(o, l) in &touched_after[g] {
            mask[o as usize..(o + l) as usize].fill(false);
        }
        if let Some(i) = (0..SIZE as usize).find(|&i| mask[i] && data[i] != snap[i]) {
            panic!(
                "crash state {label}: byte {i:#x} lost (flush {g}): got {:#x} want {:#x}",
                data[i], snap[i]
            );
        }
        states += 1;
    }
    say_states("first writes making their L2 table on the spot", states);
    assert!(states > 100, "{states} crash states");

    // Closed, the image checks clean and reads as the reference.
    let c = chain.clone();
    exec.block_on(async move { c.close().await }).unwrap();
    let closed = dev.contents();
    qemu_clean("after close", &closed);
    assert!(read_all(closed) == reference, "the closed image differs");
}
