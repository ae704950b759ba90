//! `check` on the in-memory device: images formatted by `create`, damaged here, repaired
//! and checked again; and a device failure injected at every operation of a check and of a
//! repair (no panic, the failure is reported). The qemu-img comparisons are in the tool's
//! tests (`bdev_qcow2/tool/tests/check.rs`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use qcow2_engine::check::{check, CheckReport, Repair};
use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::testing::MemDevice;
use qcow2_engine::{Error, Exec};

fn fresh(cluster_bits: u32, refcount_order: u32) -> Vec<u8> {
    let exec = Exec::new();
    let dev = MemDevice::new(Vec::new());
    let id = exec.add_device(dev.clone());
    let e2 = exec.clone();
    let opts = CreateOptions {
        size: 64 << 20,
        cluster_bits,
        refcount_order,
        ..CreateOptions::default()
    };
    exec.block_on(async move { create(&e2, id, &opts).await })
        .expect("create");
    dev.contents()
}

fn run(bytes: Vec<u8>, repair: Repair) -> (Result<CheckReport, Error>, Vec<u8>) {
    let exec = Exec::new();
    let dev = MemDevice::new(bytes);
    let id = exec.add_device(dev.clone());
    let e2 = exec.clone();
    let r = exec.block_on(async move { check(&e2, id, repair).await });
    (r, dev.contents())
}

fn be64(b: &[u8], off: u64) -> u64 {
    u64::from_be_bytes(b[off as usize..off as usize + 8].try_into().unwrap())
}

fn counts(r: &CheckReport) -> (u64, u64, u64) {
    (r.check_errors, r.corruptions, r.leaks)
}

#[test]
fn fresh_images_are_clean() {
    for (cb, ro) in [(9, 0), (12, 4), (16, 4), (16, 6), (21, 3)] {
        let (r, _) = run(fresh(cb, ro), Repair::None);
        let r = r.expect("check");
        assert_eq!(counts(&r), (0, 0, 0), "cluster_bits {cb} order {ro}: {r:?}");
        assert!(r.image_end_offset > 0);
    }
}

#[test]
fn missing_refcount_block_is_rebuilt_by_repair() {
    for (cb, ro) in [(9, 0), (16, 4), (16, 6)] {
        let img = fresh(cb, ro);
        let rt = be64(&img, 48);
        let mut bad = img.clone();
        bad[rt as usize..rt as usize + 8].fill(0);
        let (r, _) = run(bad.clone(), Repair::None);
        let r = r.unwrap();
        assert!(r.corruptions > 0, "{r:?}");
        // -r leaks cannot fix it: the check fails instead.
        let (r, _) = run(bad.clone(), Repair::Leaks);
        assert_eq!(r.unwrap().check_errors, 1);
        let (r, fixed) = run(bad, Repair::All);
        let r = r.unwrap();
        assert!(r.corruptions_fixed > 0 && r.corruptions == 0, "{r:?}");
        let (r, _) = run(fixed, Repair::None);
        assert_eq!(counts(&r.unwrap()), (0, 0, 0));
    }
}

#[test]
fn repair_grows_the_refcount_table() {
    // 512-byte clusters, 64-bit refcounts: one table cluster covers 64 blocks of 64
    // clusters (2 MiB). Pad the image to that, drop block 0: its replacement lies past
    // what the table can describe.
    let mut img = fresh(9, 6);
    let rt = be64(&img, 48);
    let covered = (512 / 8) * 64 * 512;
    assert!(img.len() < covered);
    img.resize(covered, 0);
    img[rt as usize..rt as usize + 8].fill(0);
    let (r, fixed) = run(img, Repair::All);
    assert_eq!(r.unwrap().corruptions, 0);
    assert_ne!(be64(&fixed, 48), rt, "table not moved");
    let (r, _) = run(fixed, Repair::None);
    assert_eq!(counts(&r.unwrap()), (0, 0, 0));
}

#[test]
fn leaks_are_repaired() {
    let mut img = fresh(16, 4);
    let block = be64(&img, be64(&img, 48));
    // Cluster 0 (the header) gets refcount 3; the image is extended by two clusters that
    // are marked used.
    let n = img.len() as u64 / 65536;
    for (c, v) in [(0u64, 3u16), (n, 1), (n + 1, 1)] {
        let at = (block + 2 * c) as usize;
        img[at..at + 2].copy_from_slice(&v.to_be_bytes());
    }
    img.resize(((n + 2) * 65536) as usize, 0);
    let (r, _) = run(img.clone(), Repair::None);
    assert_eq!(counts(&r.unwrap()), (0, 0, 3));
    let (r, fixed) = run(img, Repair::Leaks);
    assert_eq!(r.unwrap().leaks_fixed, 3);
    let (r, _) = run(fixed, Repair::None);
    assert_eq!(counts(&r.unwrap()), (0, 0, 0));
}

#[test]
fn device_failure_at_every_operation() {
    let img = fresh(9, 4);
    let rt = be64(&img, 48);
    let mut bad = img.clone();
    bad[rt as usize..rt as usize + 8].fill(0);
    for repair in [Repair::None, Repair::All] {
        let mut k = 0;
        loop {
            let exec = Exec::new();
            let dev = MemDevice::new(bad.clone());
            dev.0.borrow_mut().fail_op = Some((k, 5));
            let id = exec.add_device(dev.clone());
            let e2 = exec.clone();
            let r = exec.block_on(async move { check(&e2, id, repair).await });
            let ops = dev.0.borrow().ops;
            if k >= ops {
                // Fewer operations than k: nothing failed, every case was tried.
                break;
            }
            match r {
                Err(Error::Io(5)) => {}
                Ok(rep) if rep.check_errors > 0 => {}
                other => panic!("failure at op {k} not reported: {other:?}"),
            }
            // The device is still consistent enough to be checked again.
            let (again, _) = run(dev.contents(), Repair::None);
            assert!(again.is_ok());
            k += 1;
        }
    }
}

fn run_fixed(bytes: Vec<u8>, size: usize, repair: Repair) -> (Result<CheckReport, Error>, Vec<u8>) {
    let exec = Exec::new();
    let dev = MemDevice::fixed(bytes, size);
    let id = exec.add_device(dev.clone());
    let e2 = exec.clone();
    let r = exec.block_on(async move { check(&e2, id, repair).await });
    (r, dev.contents())
}

fn put_be64(b: &mut [u8], off: u64, v: u64) {
    b[off as usize..off as usize + 8].copy_from_slice(&v.to_be_bytes());
}

#[test]
fn repair_on_a_fixed_device_rebuilds_a_lost_block_inside_it() {
    // Like a bdev larger than the image: the lost block's replacement must not go past
    // the device end (where a write fails with EIO) but into a cluster nothing uses.
    for (cb, ro) in [(9, 0), (12, 4), (16, 4), (16, 6)] {
        let img = fresh(cb, ro);
        let size = img.len() + (1 << 20);
        let rt = be64(&img, 48);
        let mut bad = img.clone();
        bad[rt as usize..rt as usize + 8].fill(0);
        let (r, fixed) = run_fixed(bad, size, Repair::All);
        let r = r.unwrap();
        assert_eq!(counts(&r), (0, 0, 0), "cluster_bits {cb} order {ro}: {r:?}");
        assert!(r.corruptions_fixed > 0, "{r:?}");
        assert_eq!(fixed.len(), size);
        let block = be64(&fixed, be64(&fixed, 48));
        assert!(
            block != 0 && block + (1 << cb) <= img.len() as u64,
            "{block:#x}"
        );
        let (r, _) = run_fixed(fixed, size, Repair::None);
        assert_eq!(counts(&r.unwrap()), (0, 0, 0));
    }
}

#[test]
fn repair_on_a_fixed_device_grows_the_refcount_table_into_holes() {
    // 512-byte clusters, 64-bit refcounts: one table cluster holds 64 blocks of 64
    // clusters (2 MiB). A new L2 table maps a cluster past those 2 MiB, whose block the
    // one-cluster table cannot name: the table grows, on a device that cannot.
    let img = fresh(9, 6);
    let covered = (512 / 8) * 64 * 512u64;
    let size = covered as usize + (64 << 10);
    assert!((img.len() as u64) < covered);
    let mut bad = img.clone();
    bad.resize(size, 0);
    let l2 = img.len() as u64;
    let l1 = be64(&img, 40);
    put_be64(&mut bad, l1, (1 << 63) | l2);
    put_be64(&mut bad, l2, (1 << 63) | (covered + 8 * 512));
    let (r, _) = run_fixed(bad.clone(), size, Repair::None);
    assert!(r.unwrap().corruptions > 0);
    let (r, fixed) = run_fixed(bad, size, Repair::All);
    let r = r.unwrap();
    assert_eq!(counts(&r), (0, 0, 0), "{r:?}");
    let rt = be64(&fixed, 48);
    assert_ne!(rt, be64(&img, 48), "table not moved");
    assert_eq!(u32::from_be_bytes(fixed[56..60].try_into().unwrap()), 2);
    assert!(rt + 2 * 512 <= size as u64);
    let (r, _) = run_fixed(fixed, size, Repair::None);
    assert_eq!(counts(&r.unwrap()), (0, 0, 0));
}

#[test]
fn repair_on_a_full_fixed_device_fails_clearly_and_writes_nothing() {
    // The lost block's cluster becomes an (empty) L2 table: every cluster of the device
    // is in use, so there is no room for the block the repair must create.
    let img = fresh(16, 4);
    let rt = be64(&img, 48);
    let block = be64(&img, rt);
    let l1 = be64(&img, 40);
    let mut bad = img.clone();
    bad[rt as usize..rt as usize + 8].fill(0);
    bad[block as usize..block as usize + 65536].fill(0);
    put_be64(&mut bad, l1, (1 << 63) | block);
    let (r, after) = run_fixed(bad.clone(), bad.len(), Repair::All);
    let r = r.unwrap();
    assert_eq!(r.check_errors, 1, "{r:?}");
    assert!(
        r.messages
            .iter()
            .any(|m| m.contains("no room on the fixed-size device")),
        "{:?}",
        r.messages
    );
    assert!(
        after == bad,
        "a repair that found no room wrote to the device"
    );
    // On a device that grows, the same image is repaired past its end.
    let (r, fixed) = run(bad.clone(), Repair::All);
    assert_eq!(r.unwrap().corruptions, 0);
    assert!(fixed.len() > bad.len());
    let (r, _) = run(fixed, Repair::None);
    assert_eq!(counts(&r.unwrap()), (0, 0, 0));
}
