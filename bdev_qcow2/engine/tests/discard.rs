//! Freed clusters discarded on the device (`OpenOptions::pass_discard_*`, QEMU's
//! `pass-discard-*`): which frees are, that a discard reaches the device only after a flush
//! made the frees stable, and that freed space is reused afterwards. Crash states with
//! discards are in `crash.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

mod mem_chain;
use mem_chain::{flush, image, read, write};

use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::testing::{LoggedOp, MemDevice};
use qcow2_engine::{Chain, Exec, Layer, OpenOptions, Qcow2};
use std::rc::Rc;

const MIB: u64 = 1 << 20;

/// A new 16 MiB image (64 KiB clusters) on a device that discards if `discards`, opened
/// writable with `opts`' switches.
fn setup(discards: bool, opts: OpenOptions) -> (Exec<MemDevice>, MemDevice, Rc<Chain<MemDevice>>) {
    let exec = Exec::new();
    let dev = MemDevice::new(Vec::new());
    let id = exec.add_device(dev.clone());
    let e2 = exec.clone();
    exec.block_on(async move {
        create(
            &e2,
            id,
            &CreateOptions {
                size: 16 * MIB,
                ..Default::default()
            },
        )
        .await
    })
    .unwrap();
    dev.0.borrow_mut().discards = discards;
    let e2 = exec.clone();
    let opts = OpenOptions {
        writable: true,
        ..opts
    };
    let q = exec
        .block_on(async move { Qcow2::open(&e2, id, opts).await })
        .unwrap();
    let chain = Chain::new(&exec, vec![Layer::Qcow2(Box::new(q))]).unwrap();
    (exec, dev, chain)
}

fn discard(exec: &Exec<MemDevice>, chain: &Rc<Chain<MemDevice>>, off: u64, len: u64) {
    let c = chain.clone();
    exec.block_on(async move { c.discard(off, len).await })
        .unwrap();
}

fn discarded(dev: &MemDevice) -> u64 {
    dev.0.borrow().discarded_bytes
}

#[test]
fn guest_discards_reach_the_device_after_the_flush_that_made_the_frees_stable() {
    let (exec, dev, chain) = setup(true, OpenOptions::default());
    write(&exec, &chain, 0, &vec![0xab; 4 * MIB as usize]);
    flush(&exec, &chain);
    dev.0.borrow_mut().record = true;
    discard(&exec, &chain, 0, 4 * MIB);
    assert_eq!(discarded(&dev), 0, "nothing discarded before a write-back");
    flush(&exec, &chain);
    assert_eq!(
        discarded(&dev),
        4 * MIB,
        "every freed data cluster discarded"
    );
    let stats = image(&chain).owner_stats().unwrap();
    assert_eq!(stats.bytes_discarded, 4 * MIB);
    assert_eq!(
        stats.discards, 1,
        "64 adjacent clusters merged into one discard"
    );
    // Ordering: a flush lies between every metadata write and the first discard.
    let log = dev.0.borrow().log.clone();
    let first = log
        .iter()
        .position(|e| matches!(e, LoggedOp::Discard(..)))
        .unwrap();
    let last_write = log[..first]
        .iter()
        .rposition(|e| matches!(e, LoggedOp::Write(..)))
        .unwrap();
    assert!(
        log[last_write..first].contains(&LoggedOp::Flush),
        "discard issued before the write-back that freed the clusters was flushed: {:?}",
        &log[last_write..first]
    );
    assert_eq!(read(&exec, &chain, 0, 64 << 10), vec![0; 64 << 10]);
    // The freed space is taken again (the device does not grow) and reads back.
    let size = dev.0.borrow().data.len();
    write(&exec, &chain, 8 * MIB, &vec![0xcd; 4 * MIB as usize]);
    flush(&exec, &chain);
    assert_eq!(dev.0.borrow().data.len(), size);
    assert_eq!(read(&exec, &chain, 8 * MIB, 4096), vec![0xcd; 4096]);
}

#[test]
fn write_zeroes_with_unmap_discards_and_without_keeps_the_clusters() {
    let (exec, dev, chain) = setup(true, OpenOptions::default());
    write(&exec, &chain, 0, &vec![0xab; 2 * MIB as usize]);
    let c = chain.clone();
    exec.block_on(async move { c.write_zeroes(0, MIB, false).await })
        .unwrap();
    flush(&exec, &chain);
    assert_eq!(
        discarded(&dev),
        0,
        "zeroes without unmap keep their clusters"
    );
    let c = chain.clone();
    exec.block_on(async move { c.write_zeroes(MIB, MIB, true).await })
        .unwrap();
    flush(&exec, &chain);
    assert_eq!(discarded(&dev), MIB);
    assert_eq!(
        read(&exec, &chain, 0, 2 * MIB as usize),
        vec![0; 2 * MIB as usize]
    );
}

#[test]
fn switched_off_or_on_a_device_that_cannot_the_space_stays() {
    for (discards, request) in [(true, false), (false, true)] {
        let opts = OpenOptions {
            pass_discard_request: request,
            ..Default::default()
        };
        let (exec, dev, chain) = setup(discards, opts);
        write(&exec, &chain, 0, &vec![0xab; 2 * MIB as usize]);
        discard(&exec, &chain, 0, 2 * MIB);
        flush(&exec, &chain);
        assert_eq!(
            discarded(&dev),
            0,
            "device discards {discards}, switch {request}"
        );
        assert_eq!(image(&chain).owner_stats().unwrap().discards, 0);
        // The clusters are free all the same: the image does not grow for new data.
        let size = dev.0.borrow().data.len();
        write(&exec, &chain, 4 * MIB, &vec![0xcd; 2 * MIB as usize]);
        flush(&exec, &chain);
        assert_eq!(dev.0.borrow().data.len(), size);
    }
}

#[test]
fn a_snapshot_deletion_discards_what_only_the_snapshot_held() {
    for snapshot in [true, false] {
        let opts = OpenOptions {
            pass_discard_snapshot: snapshot,
            ..Default::default()
        };
        let (exec, dev, chain) = setup(true, opts);
        write(&exec, &chain, 0, &vec![0xab; 2 * MIB as usize]);
        let c = chain.clone();
        exec.block_on(async move {
            image(&c).snapshot_create("s", Default::default()).await?;
            // Overwritten: the old clusters are the snapshot's alone now.
            let buf = qcow2_engine::io::HeapBuf::new(MIB as usize);
            c.write(0, qcow2_engine::io::BufSlice::whole(buf)).await?;
            c.flush().await
        })
        .unwrap();
        // (Taking the snapshot may free a cluster or two of tables it replaced.)
        let before = discarded(&dev);
        let c = chain.clone();
        exec.block_on(async move { image(&c).snapshot_delete("s").await })
            .unwrap();
        let d = discarded(&dev) - before;
        if snapshot {
            // The 16 overwritten data clusters and the snapshot's L1 table at least.
            assert!(d > MIB, "discarded {d} bytes");
        } else {
            assert_eq!(d, 0);
        }
        assert_eq!(read(&exec, &chain, MIB, 4096), vec![0xab; 4096]);
    }
}

#[test]
fn make_empty_unallocates_every_cluster_and_frees_as_a_snapshot_does() {
    for snapshot in [true, false] {
        let opts = OpenOptions {
            pass_discard_snapshot: snapshot,
            pass_discard_request: false,
            ..Default::default()
        };
        let (exec, dev, chain) = setup(true, opts);
        // Data, a preallocated zero cluster, a zero flag, a compressed cluster, data
        // at the end of the disk.
        write(&exec, &chain, 0, &vec![0xab; 2 * MIB as usize]);
        let c = chain.clone();
        exec.block_on(async move {
            c.write_zeroes(MIB, 64 << 10, false).await?;
            c.write_zeroes(4 * MIB, 64 << 10, true).await?;
            c.write_compressed(8 * MIB, &vec![0xcd; 64 << 10]).await?;
            c.flush().await
        })
        .unwrap();
        write(&exec, &chain, 16 * MIB - 4096, &[0xef; 4096]);
        flush(&exec, &chain);
        let before = discarded(&dev);
        let c = chain.clone();
        exec.block_on(async move {
            c.make_empty().await?;
            c.close().await
        })
        .unwrap();
        let c = chain.clone();
        let mapping = exec
            .block_on(async move { c.block_status(0, 0, 16 * MIB).await })
            .unwrap();
        assert_eq!(
            mapping,
            (
                qcow2_engine::format::ClusterMapping::Unallocated { host: None },
                16 * MIB
            ),
            "nothing left allocated"
        );
        assert_eq!(read(&exec, &chain, 0, 4096), vec![0; 4096]);
        let d = discarded(&dev) - before;
        if snapshot {
            // 2 MiB of data (the preallocated zero cluster among it) and the last cluster.
            assert!(d >= 2 * MIB + (64 << 10), "discarded {d} bytes");
        } else {
            assert_eq!(d, 0);
        }
        let id = image(&chain).dev();
        let e2 = exec.clone();
        let report = exec
            .block_on(async move {
                qcow2_engine::check::check(&e2, id, qcow2_engine::check::Repair::None).await
            })
            .unwrap();
        assert_eq!(
            (report.corruptions, report.leaks, report.allocated_clusters),
            (0, 0, 0),
            "{:?}",
            report.messages
        );
    }
}
