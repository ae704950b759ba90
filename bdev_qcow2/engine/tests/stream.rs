//! Streaming while the guest writes (ARCHITECTURE.md §13): guest writes win over the data
//! a stream copies in, whatever the interleaving, and the disk reads the same after the
//! backing reference is dropped.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::io::{BufSlice, HeapBuf, IoBuffer};
use qcow2_engine::stream::{StreamJob, StreamState};
use qcow2_engine::testing::{MemDevice, Rng};
use qcow2_engine::{Chain, Exec, Layer, OpenOptions, Qcow2};
use std::rc::Rc;

fn overlay(exec: &Exec<MemDevice>, opts: &CreateOptions, base: &[u8]) -> Rc<Chain<MemDevice>> {
    let dev = MemDevice::new(Vec::new());
    let id = exec.add_device(dev.clone());
    let (e2, o) = (exec.clone(), opts.clone());
    exec.block_on(async move { create(&e2, id, &o).await })
        .unwrap();
    // Every device operation completes some polls later: tasks interleave.
    dev.0.borrow_mut().latency_polls = 3;
    let e2 = exec.clone();
    let q = exec
        .block_on(async move {
            Qcow2::open(
                &e2,
                id,
                OpenOptions {
                    writable: true,
                    l2_cache_bytes: Some(8 << 10),
                    ..Default::default()
                },
            )
            .await
        })
        .unwrap();
    let b = exec.add_device(MemDevice::new(base.to_vec()));
    Chain::new(
        exec,
        vec![
            Layer::Qcow2(Box::new(q)),
            Layer::Raw {
                dev: b,
                size: base.len() as u64,
            },
        ],
    )
    .unwrap()
}

fn read_all(exec: &Exec<MemDevice>, chain: &Rc<Chain<MemDevice>>) -> Vec<u8> {
    let buf = HeapBuf::new(chain.size() as usize);
    let (b2, c) = (buf.clone(), chain.clone());
    exec.block_on(async move { c.read(0, BufSlice::whole(b2)).await })
        .unwrap();
    buf.to_vec()
}

/// Runs a stream job (rate-limited or not) from a poll loop while guest writes of random
/// sizes land all over the disk, most of them on clusters the stream has not reached yet;
/// then checks the disk is the backing image with every write on top, before and after
/// the backing layer is gone.
fn guest_writes_win(opts: CreateOptions, seed: u64) {
    let size = opts.size as usize;
    let mut r = Rng(seed);
    let base: Vec<u8> = (0..size).map(|_| (r.next() | 1) as u8).collect();
    let exec = Exec::new();
    let chain = overlay(
        &exec,
        &CreateOptions {
            backing_file: Some("base.raw".into()),
            backing_format: Some("raw".into()),
            ..opts
        },
        &base,
    );
    let mut expect = base.clone();
    // Throttled (32 MiB/s: a quarter of a second) so that many writes land meanwhile.
    let job = StreamJob::new(&chain, 32 << 20).unwrap();
    let done = Rc::new(std::cell::Cell::new(0usize));
    let mut writes = 0;
    let mut polls = 0u64;
    loop {
        let state = job.poll(&chain);
        // A few writes per poll while the stream copies, each to a range no other write
        // touches (their order does not matter then), 512 bytes to 3 clusters long.
        if state == StreamState::Copying && writes < 300 {
            let len = ((r.next() % 96) as usize + 1) * 512;
            // Half of them just ahead of the stream, where its next steps race them.
            let off = if r.next().is_multiple_of(2) {
                job.progress().bytes_done as usize + (r.next() as usize % 2048) * 512
            } else {
                (r.next() as usize % (size / 512)) * 512
            };
            let off = off.min(size - len);
            if expect[off..off + len]
                .iter()
                .zip(&base[off..off + len])
                .all(|(a, b)| a == b)
            {
                let d: Vec<u8> = (0..len).map(|_| (r.next() & !1) as u8).collect();
                expect[off..off + len].copy_from_slice(&d);
                let buf = HeapBuf::new(len);
                buf.copy_in(0, &d);
                let (c, n) = (chain.clone(), done.clone());
                exec.spawn(async move {
                    c.write(off as u64, BufSlice::whole(buf)).await.unwrap();
                    n.set(n.get() + 1);
                });
                writes += 1;
            }
        }
        if state == StreamState::Detaching {
            // No other core: the owner's chain detaches at once.
            job.cores_detached(&chain);
        }
        if let StreamState::Failed(e) = &state {
            panic!("stream failed: {e}");
        }
        if state == StreamState::Done && done.get() == writes {
            break;
        }
        exec.poll(&mut |_, _| {});
        polls += 1;
        assert!(polls < 10_000_000, "the stream does not end");
    }
    let p = job.progress();
    assert_eq!(p.bytes_done, p.bytes_total);
    assert!(p.bytes_filled > 0);
    assert!(writes > 50, "only {writes} guest writes during the stream");
    assert_eq!(chain.layers().len(), 1);
    assert!(
        read_all(&exec, &chain) == expect,
        "the disk is not the backing image plus every write"
    );
    let Some(Layer::Qcow2(q)) = chain.layers().first() else {
        unreachable!()
    };
    assert_eq!(q.header().backing_file, None);
}

#[test]
fn guest_writes_during_a_stream_win() {
    guest_writes_win(
        CreateOptions {
            size: 8 << 20,
            cluster_bits: 12,
            ..Default::default()
        },
        1,
    );
}

#[test]
fn guest_writes_during_a_stream_win_extended_l2() {
    guest_writes_win(
        CreateOptions {
            size: 8 << 20,
            cluster_bits: 16,
            extended_l2: true,
            ..Default::default()
        },
        2,
    );
}

#[test]
fn a_stream_without_backing_is_refused_and_a_rate_limit_holds() {
    let exec = Exec::new();
    let base = vec![7u8; 4 << 20];
    let chain = overlay(
        &exec,
        &CreateOptions {
            size: 4 << 20,
            cluster_bits: 16,
            backing_file: Some("b".into()),
            backing_format: Some("raw".into()),
            ..Default::default()
        },
        &base,
    );
    // 8 MiB/s over 4 MiB of backing data: about half a second, not less.
    let job = StreamJob::new(&chain, 8 << 20).unwrap();
    let t0 = std::time::Instant::now();
    loop {
        match job.poll(&chain) {
            StreamState::Detaching => job.cores_detached(&chain),
            StreamState::Done => break,
            StreamState::Failed(e) => panic!("{e}"),
            _ => {}
        }
        exec.poll(&mut |_, _| {});
    }
    let took = t0.elapsed();
    assert!(
        took >= std::time::Duration::from_millis(350),
        "took {took:?}"
    );
    assert!(read_all(&exec, &chain).iter().all(|&b| b == 7));
    // Now it has no backing: refused.
    assert!(StreamJob::new(&chain, 0).is_err());
}

#[test]
fn the_drop_is_refused_while_anything_still_reads_from_the_backing() {
    let exec = Exec::new();
    let base = vec![9u8; 1 << 20];
    let chain = overlay(
        &exec,
        &CreateOptions {
            size: 1 << 20,
            cluster_bits: 16,
            backing_file: Some("b".into()),
            backing_format: Some("raw".into()),
            ..Default::default()
        },
        &base,
    );
    // One step of two: the second half still reads from the backing image.
    let c = chain.clone();
    let filled = exec
        .block_on(async move { c.stream_range(0, 512 << 10).await })
        .unwrap();
    assert_eq!(filled, 512 << 10);
    let c = chain.clone();
    let r = exec.block_on(async move { c.finish_stream().await });
    assert!(matches!(r, Err(qcow2_engine::Error::Refused(_))), "{r:?}");
    let Some(Layer::Qcow2(q)) = chain.layers().first() else {
        unreachable!()
    };
    assert!(q.header().backing_file.is_some());
    // The rest, and the drop goes through.
    let c = chain.clone();
    exec.block_on(async move {
        c.stream_range(512 << 10, 1 << 20).await?;
        c.finish_stream().await
    })
    .unwrap();
    assert!(read_all(&exec, &chain).iter().all(|&b| b == 9));
}
