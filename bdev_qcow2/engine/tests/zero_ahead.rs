//! Zeroing ahead of the allocator (`OpenOptions::zero_ahead`): an image `qemu-img` made
//! records no zeroed tail, and the device past it holds whatever it held (here, stale
//! bytes). The owner zeroes the device past every cluster in use before it takes clusters
//! there, so a first write into a new cluster writes the guest's bytes alone; it never
//! zeroes a cluster in use, and where zeroing fails it writes whole clusters as before.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use qcow2_engine::testing::{LoggedOp, MemDevice, Rng};
use qcow2_engine::{Chain, Exec};
use std::path::Path;
use std::process::Command;
use std::rc::Rc;

mod mem_chain;
use mem_chain::{close, flush, image, open, read, write};

const CS: u64 = 64 << 10;
const SIZE: u64 = 64 << 20;
const DEV_SIZE: usize = 96 << 20;
const STALE: u8 = 0xee;

fn sh(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{cmd:?}: {text}");
    text
}

/// An image made and written by QEMU: data at the start and far into the disk, and a
/// cluster QEMU wrote and freed in between (its bytes stay on the device: a hole below
/// the image's end). Returns the image file's bytes and the guest's view (raw).
fn qemu_image(dir: &Path) -> (Vec<u8>, Vec<u8>) {
    let path = dir.join("q.qcow2");
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&path)
        .arg(SIZE.to_string()));
    let opts = format!(
        "driver=qcow2,pass-discard-request=off,file.driver=file,file.filename={}",
        path.display()
    );
    sh(Command::new("qemu-io")
        .args(["--image-opts", "-d", "unmap"])
        .args([
            "-c",
            "write -P 0x31 0 192k",
            "-c",
            "write -P 0x32 256k 64k",
            "-c",
            "write -P 0x33 40m 128k",
            "-c",
            "discard 256k 64k",
        ])
        .arg(&opts));
    let raw = dir.join("q.raw");
    sh(Command::new("qemu-img")
        .args(["convert", "-O", "raw"])
        .arg(&path)
        .arg(&raw));
    (std::fs::read(&path).unwrap(), std::fs::read(&raw).unwrap())
}

/// A fixed-size device (a bdev) holding `img`, stale bytes past it.
fn device(img: &[u8]) -> MemDevice {
    let mut data = img.to_vec();
    data.resize(DEV_SIZE, STALE);
    MemDevice::fixed(data, DEV_SIZE)
}

/// Writes 4 KiB of a fresh pattern into `n` clusters of the guest's disk that QEMU left
/// unallocated, in random order, flushing now and then; applies them to `model`. Returns
/// the length of the device write that carried each pattern.
fn first_writes(
    exec: &Exec<MemDevice>,
    chain: &Rc<Chain<MemDevice>>,
    dev: &MemDevice,
    model: &mut [u8],
    rng: &mut Rng,
    n: usize,
) -> Vec<usize> {
    let mut lens = Vec::new();
    let mut done = 0;
    while done < n {
        let c = rng.below(SIZE / CS);
        let at = (c * CS) as usize;
        if model[at..at + CS as usize].iter().any(|b| *b != 0) {
            continue;
        }
        let off = c * CS + rng.below(CS / 4096) * 4096;
        let data = vec![(done % 200) as u8 + 40; 4096];
        let seen = dev.0.borrow().log.len();
        write(exec, chain, off, &data);
        let carried = dev.0.borrow().log[seen..]
            .iter()
            .filter_map(|e| match e {
                LoggedOp::Write(_, d) if d.windows(4096).any(|w| w == &data[..]) => Some(d.len()),
                _ => None,
            })
            .collect::<Vec<_>>();
        assert_eq!(
            carried.len(),
            1,
            "write {done}: one device write carries the data"
        );
        lens.push(carried[0]);
        model[off as usize..off as usize + 4096].copy_from_slice(&data);
        done += 1;
        if done % 37 == 0 {
            flush(exec, chain);
        }
    }
    lens
}

/// QEMU's checks of the device's image against the guest's view `model`.
fn qemu_agrees(dir: &Path, dev: &MemDevice, model: &[u8]) {
    let img = dir.join("out.qcow2");
    let raw = dir.join("model.raw");
    std::fs::write(&img, dev.contents()).unwrap();
    std::fs::write(&raw, model).unwrap();
    sh(Command::new("qemu-img")
        .args(["check", "-q", "-f", "qcow2"])
        .arg(&img));
    sh(Command::new("qemu-img")
        .args(["compare", "-q", "-f", "qcow2", "-F", "raw"])
        .arg(&img)
        .arg(&raw));
}

#[test]
fn first_writes_into_new_clusters_write_the_guest_bytes_alone() {
    let dir = tempfile::tempdir().unwrap();
    let (img, mut model) = qemu_image(dir.path());
    let dev = device(&img);
    let mut rng = Rng(27);
    let exec = Exec::new();
    let chain = open(&exec, &dev, true);
    assert!(image(&chain).zeroing_ahead());
    dev.0.borrow_mut().record = true;
    let lens = first_writes(&exec, &chain, &dev, &mut model, &mut rng, 300);
    // The first write takes the hole QEMU freed (stale bytes in it): that one is whole.
    let whole = lens.iter().filter(|l| **l == CS as usize).count();
    let alone = lens.iter().filter(|l| **l == 4096).count();
    assert_eq!((whole, alone), (1, 299), "device write lengths: {lens:?}");
    let stats = image(&chain).owner_stats().unwrap();
    assert!(stats.zeroed_ahead_bytes >= 300 * CS, "{stats:?}");
    // Every guest byte reads back, zeros around each first write included.
    for c in 0..SIZE / CS {
        let at = (c * CS) as usize;
        assert_eq!(
            read(&exec, &chain, c * CS, CS as usize),
            &model[at..at + CS as usize]
        );
    }
    close(&exec, chain);
    // Zeroing went as far as needed, not to the device's end.
    let data = dev.contents();
    assert!(data[DEV_SIZE - (1 << 20)..].iter().all(|b| *b == STALE));
    qemu_agrees(dir.path(), &dev, &model);

    // Reopened: zeroing starts past everything the first run wrote, and QEMU's data and
    // ours stay as they were.
    let exec = Exec::new();
    let chain = open(&exec, &dev, true);
    let lens = first_writes(&exec, &chain, &dev, &mut model, &mut rng, 100);
    assert!(lens.iter().all(|l| *l == 4096), "after a reopen: {lens:?}");
    close(&exec, chain);
    qemu_agrees(dir.path(), &dev, &model);
}

#[test]
fn without_zeroing_ahead_first_writes_write_whole_clusters() {
    let dir = tempfile::tempdir().unwrap();
    let (img, mut model) = qemu_image(dir.path());
    let dev = device(&img);
    let exec = Exec::new();
    let chain = open(&exec, &dev, false);
    assert!(!image(&chain).zeroing_ahead());
    dev.0.borrow_mut().record = true;
    let lens = first_writes(&exec, &chain, &dev, &mut model, &mut Rng(5), 40);
    assert!(lens.iter().all(|l| *l == CS as usize), "{lens:?}");
    assert_eq!(dev.0.borrow().zero_writes, 0);
    close(&exec, chain);
    qemu_agrees(dir.path(), &dev, &model);
}

#[test]
fn zeroing_that_fails_falls_back_to_whole_clusters() {
    let dir = tempfile::tempdir().unwrap();
    let (img, mut model) = qemu_image(dir.path());
    let dev = device(&img);
    // As `fallocate`'s zero range on tmpfs: not supported.
    dev.0.borrow_mut().zeroes_fail = Some(95);
    let exec = Exec::new();
    let chain = open(&exec, &dev, true);
    dev.0.borrow_mut().record = true;
    let lens = first_writes(&exec, &chain, &dev, &mut model, &mut Rng(9), 60);
    assert!(lens.iter().all(|l| *l == CS as usize), "{lens:?}");
    assert!(!image(&chain).zeroing_ahead(), "gave up after the failure");
    assert_eq!(dev.0.borrow().zero_writes, 1, "tried once");
    close(&exec, chain);
    qemu_agrees(dir.path(), &dev, &model);
}

#[test]
fn zeroing_ahead_punches_holes_where_a_discard_leaves_zeros() {
    let dir = tempfile::tempdir().unwrap();
    let (img, mut model) = qemu_image(dir.path());
    let dev = device(&img);
    // As an AIO file on tmpfs: no zero range, but a punched hole reads zeros.
    {
        let mut s = dev.0.borrow_mut();
        s.zeroes_fail = Some(95);
        s.discards = true;
        s.discard_zeroes = true;
    }
    let exec = Exec::new();
    let chain = open(&exec, &dev, true);
    assert!(image(&chain).zeroing_ahead());
    dev.0.borrow_mut().record = true;
    let lens = first_writes(&exec, &chain, &dev, &mut model, &mut Rng(41), 300);
    let whole = lens.iter().filter(|l| **l == CS as usize).count();
    let alone = lens.iter().filter(|l| **l == 4096).count();
    assert_eq!((whole, alone), (1, 299), "device write lengths: {lens:?}");
    assert!(image(&chain).zeroing_ahead(), "punching does not fail");
    assert_eq!(dev.0.borrow().zero_writes, 0, "no write-zeroes at all");
    assert!(dev.0.borrow().discarded_bytes >= 300 * CS);
    close(&exec, chain);
    let data = dev.contents();
    assert!(data[DEV_SIZE - (1 << 20)..].iter().all(|b| *b == STALE));
    qemu_agrees(dir.path(), &dev, &model);
}
