//! First writes that take a granule of small clusters at once (`OpenOptions::alloc_granule`)
//! planned on the spot: the run's refcounts are checked and taken one refcount block at a
//! time and its L2 entries set one slice at a time (#48). With 1 KiB clusters a refcount
//! block covers 512 clusters and a granule 64, so runs cross refcount blocks; the image
//! must then read back what was written, through the engine and through `qemu-img`, and
//! pass `qemu-img check` with no leak.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

mod mem_chain;
use mem_chain::{close, open, read};

use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::io::{BufSlice, HeapBuf, IoBuffer};
use qcow2_engine::testing::{host, MemDevice, Rng};
use qcow2_engine::Exec;
use std::process::Command;

const SIZE: u64 = 16 << 20;
const IO: usize = 4096;

/// A fresh image of `1 << cluster_bits`-byte clusters on a growing in-memory device.
fn fresh(cluster_bits: u32) -> MemDevice {
    let exec = Exec::new();
    let dev = MemDevice::new(Vec::new());
    let id = exec.add_device(dev.clone());
    let e2 = exec.clone();
    let opts = CreateOptions {
        size: SIZE,
        cluster_bits,
        ..Default::default()
    };
    exec.block_on(async move { create(&e2, id, &opts).await })
        .unwrap();
    dev
}

/// `qemu-img` on the image bytes `img`: `check`'s JSON and the guest disk it converts to.
fn qemu_view(img: &[u8]) -> (serde_json::Value, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let (path, raw) = (dir.path().join("t.qcow2"), dir.path().join("t.raw"));
    std::fs::write(&path, img).unwrap();
    let out = Command::new("qemu-img")
        .args(["check", "-f", "qcow2", "--output=json"])
        .arg(&path)
        .output()
        .expect("qemu-img");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let check = serde_json::from_slice(&out.stdout).unwrap();
    let out = Command::new("qemu-img")
        .args(["convert", "-f", "qcow2", "-O", "raw"])
        .arg(&path)
        .arg(&raw)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    (check, std::fs::read(&raw).unwrap())
}

#[test]
fn random_first_writes_taking_granules_across_refcount_blocks_read_back_and_check_clean() {
    for cluster_bits in [12u32, 10] {
        let cluster_size = 1u64 << cluster_bits;
        let dev = fresh(cluster_bits);
        let exec = Exec::new();
        let chain = open(&exec, &dev, false);
        let mut reference = vec![0u8; SIZE as usize];
        let mut rng = Rng::new(cluster_size);
        for i in 0..600u64 {
            let off = rng.below(SIZE / IO as u64) * IO as u64;
            let data: Vec<u8> = (0..IO).map(|b| (i as usize * 31 + b) as u8 | 1).collect();
            reference[off as usize..][..IO].copy_from_slice(&data);
            let buf = HeapBuf::new(IO);
            buf.copy_in(0, &data);
            // As a host submits it: planned on the spot, where the granule is taken.
            host::write(&chain, i, off, BufSlice::whole(buf));
            let mut res = None;
            while res.is_none() {
                exec.poll(&mut |_, r| res = Some(r));
            }
            res.unwrap().unwrap();
        }
        let stats = mem_chain::image(&chain).owner_stats().unwrap();
        // Most first writes took their group on the spot (the rest: new refcount blocks,
        // loaded through the task).
        assert!(
            stats.writes_planned_now > 100 && stats.clusters_taken_ahead > 100,
            "cluster size {cluster_size}: {stats:?}"
        );
        for off in (0..SIZE).step_by(1 << 20) {
            let got = read(&exec, &chain, off, 1 << 20);
            assert!(
                got == reference[off as usize..][..1 << 20],
                "cluster size {cluster_size}: engine read at {off} differs"
            );
        }
        close(&exec, chain);
        let (check, disk) = qemu_view(&dev.contents());
        assert_eq!(check["leaks"].as_u64().unwrap_or(0), 0, "{check}");
        assert_eq!(check["corruptions"].as_u64().unwrap_or(0), 0, "{check}");
        assert!(
            disk == reference,
            "cluster size {cluster_size}: qemu-img reads other data"
        );
    }
}
