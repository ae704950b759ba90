//! Space the image takes on its device (`Qcow2::space_usage`), against `qemu-img check`'s
//! image end and a count of the clusters a fresh image and its writes take; and the space
//! threshold (`Qcow2::set_space_threshold`) on the image's end.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

mod mem_chain;
use mem_chain::{close, flush, image, open, write};

use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::testing::MemDevice;
use qcow2_engine::{Chain, Exec, SpaceUsage};
use std::process::Command;
use std::rc::Rc;

const MIB: u64 = 1 << 20;
const CS: u64 = 64 << 10;

/// A fresh 64 MiB image (64 KiB clusters) on a fixed device of `dev_size` bytes.
fn formatted(dev_size: usize) -> MemDevice {
    let exec = Exec::new();
    let dev = MemDevice::fixed(Vec::new(), dev_size);
    let id = exec.add_device(dev.clone());
    let e2 = exec.clone();
    let opts = CreateOptions {
        size: 64 * MIB,
        ..Default::default()
    };
    exec.block_on(async move { create(&e2, id, &opts).await })
        .unwrap();
    dev
}

fn usage(exec: &Exec<MemDevice>, chain: &Rc<Chain<MemDevice>>) -> SpaceUsage {
    let c = chain.clone();
    exec.block_on(async move { image(&c).space_usage().await })
        .unwrap()
}

fn discard(exec: &Exec<MemDevice>, chain: &Rc<Chain<MemDevice>>, off: u64, len: u64) {
    let c = chain.clone();
    exec.block_on(async move { c.discard(off, len).await })
        .unwrap();
}

/// `qemu-img check`'s image end offset of the image `dev` holds.
fn qemu_image_end(dev: &MemDevice) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.qcow2");
    std::fs::write(&path, dev.contents()).unwrap();
    let out = Command::new("qemu-img")
        .args(["check", "-f", "qcow2", "--output=json"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["image-end-offset"].as_u64().unwrap()
}

#[test]
fn usage_counts_the_clusters_in_use_and_ends_where_qemu_img_check_says() {
    let dev = formatted(256 << 20);
    let exec = Exec::new();
    let chain = open(&exec, &dev, false);
    // Header, refcount table, refcount block, L1 table.
    let fresh = usage(&exec, &chain);
    assert_eq!(fresh.allocated_bytes, 4 * CS, "{fresh:?}");
    assert_eq!(fresh.image_end_bytes, 4 * CS, "{fresh:?}");
    assert_eq!(fresh.device_bytes, 256 << 20);
    assert_eq!(fresh.free_bytes(), (256 << 20) - 4 * CS);

    // 4 MiB of data (64 clusters) and the L2 table mapping them; counted from the dirty
    // refcounts before any write-back, and the same after it.
    write(&exec, &chain, 8 * MIB, &vec![0x5a; 4 * MIB as usize]);
    let written = usage(&exec, &chain);
    assert_eq!(written.allocated_bytes, (4 + 1 + 64) * CS, "{written:?}");
    flush(&exec, &chain);
    assert_eq!(usage(&exec, &chain), written);
    assert_eq!(written.image_end_bytes, qemu_image_end(&dev));

    // Half of it discarded: the last clusters are free, so the image ends earlier.
    discard(&exec, &chain, 10 * MIB, 2 * MIB);
    flush(&exec, &chain);
    let after = usage(&exec, &chain);
    assert_eq!(after.allocated_bytes, (4 + 1 + 32) * CS, "{after:?}");
    assert_eq!(after.image_end_bytes, qemu_image_end(&dev));
    assert!(after.image_end_bytes < written.image_end_bytes);
    close(&exec, chain);
}

#[test]
fn the_threshold_is_exceeded_when_an_allocation_passes_it_and_is_rearmed_by_a_new_one() {
    let dev = formatted(256 << 20);
    let exec = Exec::new();
    let chain = open(&exec, &dev, false);
    let q = || image(&chain);
    assert!(!q().space_threshold_exceeded(), "no threshold set");
    q().set_space_threshold(Some(2 * MIB)).unwrap();
    write(&exec, &chain, 0, &vec![1; MIB as usize]);
    assert!(
        !q().space_threshold_exceeded(),
        "the image ends below 2 MiB"
    );
    write(&exec, &chain, 32 * MIB, &vec![2; 2 * MIB as usize]);
    assert!(q().space_threshold_exceeded(), "the image ends past 2 MiB");
    // A higher threshold: not exceeded; one below the end already: exceeded at once.
    q().set_space_threshold(Some(128 * MIB)).unwrap();
    assert!(!q().space_threshold_exceeded());
    q().set_space_threshold(Some(MIB)).unwrap();
    assert!(q().space_threshold_exceeded());
    q().set_space_threshold(None).unwrap();
    assert!(!q().space_threshold_exceeded());
    close(&exec, chain);
}

#[test]
fn an_image_reopened_past_its_threshold_is_known_to_be_once_counted() {
    let dev = formatted(256 << 20);
    let exec = Exec::new();
    let chain = open(&exec, &dev, false);
    write(&exec, &chain, 0, &vec![3; 8 * MIB as usize]);
    close(&exec, chain);
    let exec = Exec::new();
    let chain = open(&exec, &dev, false);
    image(&chain).set_space_threshold(Some(4 * MIB)).unwrap();
    // Nothing allocated since open: only the count finds where the image ends.
    let u = usage(&exec, &chain);
    assert!(u.image_end_bytes > 8 * MIB, "{u:?}");
    assert!(image(&chain).space_threshold_exceeded());
    close(&exec, chain);
}
