//! The zeroed tail (`CreateOptions::zeroed_tail`): on a device that cannot grow and was
//! zeroed before the format, a first write into a new cluster past everything ever
//! allocated writes the guest's bytes alone. The claim on disk must cover every byte ever
//! written (raised, written and flushed, before anything is written past it); QEMU, which
//! does not know its autoclear bit, voids it when it writes the image.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::format::header::autoclear;
use qcow2_engine::format::ImageHeader;
use qcow2_engine::testing::{LoggedOp, MemDevice, Rng};
use qcow2_engine::Exec;
use std::path::Path;
use std::process::Command;

mod mem_chain;
use mem_chain::{close, open, read, write};

const CS: u64 = 64 << 10;

/// A fixed-size device of `dev_size` bytes (zeros) holding a fresh image of `size` bytes.
fn formatted(size: u64, dev_size: usize, zeroed_tail: bool) -> MemDevice {
    let opts = CreateOptions {
        size,
        zeroed_tail,
        ..Default::default()
    };
    formatted_with(opts, dev_size)
}

fn formatted_with(opts: CreateOptions, dev_size: usize) -> MemDevice {
    let exec = Exec::new();
    let dev = MemDevice::fixed(Vec::new(), dev_size);
    let id = exec.add_device(dev.clone());
    let e2 = exec.clone();
    exec.block_on(async move { create(&e2, id, &opts).await })
        .unwrap();
    dev
}

/// The zeroed tail an image's header claims (`None`: no valid claim).
fn tail_of(img: &[u8]) -> Option<u64> {
    header_of(img).extensions.zeroed_tail.map(|z| z.from)
}

fn header_of(img: &[u8]) -> ImageHeader {
    let cs = 1usize << qcow2_engine::format::header::peek_cluster_bits(img).unwrap();
    ImageHeader::decode(&img[..cs], img.len() as u64).unwrap()
}

/// Replays the device log of a workload on an image whose zeroed tail was `initial`:
/// every write must lie below the tail as it stood on disk and stable (the last flushed
/// header's) and below any newer header's (a crash may keep either). Returns how many
/// times the tail was raised; checks that the device reads zeros past the final one.
fn assert_writes_below_the_tail(dev: &MemDevice, initial: u64) -> usize {
    let log = dev.0.borrow().log.clone();
    let img = dev.contents();
    let at = header_of(&img).extensions.zeroed_tail.unwrap().at as usize;
    let (mut stable, mut pending) = (initial, initial);
    let mut raises = 0;
    for e in &log {
        match e {
            LoggedOp::Write(0, d) if d.len() >= at + 8 => {
                let v = u64::from_be_bytes(d[at..at + 8].try_into().unwrap());
                if v > pending {
                    raises += 1;
                }
                pending = v;
            }
            LoggedOp::Write(off, d) => {
                let end = off + d.len() as u64;
                assert!(
                    end <= stable.min(pending),
                    "write {off:#x}+{:#x} past the tail on disk ({stable:#x}, {pending:#x})",
                    d.len()
                );
            }
            LoggedOp::Flush => stable = pending,
            // (A fixed device never grows; this one does not discard.)
            LoggedOp::Grow(_) | LoggedOp::Discard(..) => {}
        }
    }
    let from = tail_of(&img).unwrap();
    assert!(img[from as usize..].iter().all(|b| *b == 0));
    raises
}

fn qemu_check_clean(img: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.qcow2");
    std::fs::write(&path, img).unwrap();
    let (code, out) = qemu_img(&["check", "-f", "qcow2"], &path);
    assert_eq!(code, 0, "qemu-img check: {out}");
}

/// Lengths of the device writes a workload made, except those of the header's sector.
fn data_write_lens(dev: &MemDevice) -> Vec<usize> {
    dev.0
        .borrow()
        .log
        .iter()
        .filter_map(|e| match e {
            LoggedOp::Write(off, d) if *off != 0 => Some(d.len()),
            _ => None,
        })
        .collect()
}

fn qemu_img(args: &[&str], path: &Path) -> (i32, String) {
    let out = Command::new("qemu-img")
        .args(args)
        .arg(path)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn a_first_write_past_the_zeroed_tail_writes_the_guest_bytes_alone() {
    let pattern = vec![0x5au8; 4096];
    for zeroed_tail in [true, false] {
        let dev = formatted(64 << 20, 80 << 20, zeroed_tail);
        let exec = Exec::new();
        let chain = open(&exec, &dev, false);
        dev.0.borrow_mut().record = true;
        write(&exec, &chain, 3 * CS + 8192, &pattern);
        // Only the data write so far (its metadata is dirty in memory).
        let lens = data_write_lens(&dev);
        let want = if zeroed_tail { 4096 } else { CS as usize };
        assert_eq!(lens, vec![want], "zeroed tail {zeroed_tail}: device writes");
        let got = read(&exec, &chain, 3 * CS, CS as usize);
        assert!(got[..8192].iter().all(|b| *b == 0));
        assert_eq!(&got[8192..8192 + 4096], &pattern[..]);
        assert!(got[8192 + 4096..].iter().all(|b| *b == 0));
        close(&exec, chain);
        let img = dev.contents();
        if zeroed_tail {
            // Closed: the tail went back to the end of what was allocated.
            let from = tail_of(&img).unwrap();
            let max_used = (0..img.len() as u64 / CS)
                .rev()
                .find(|c| {
                    img[(c * CS) as usize..((c + 1) * CS) as usize]
                        .iter()
                        .any(|b| *b != 0)
                })
                .unwrap();
            assert!(
                from > max_used * CS,
                "tail {from:#x} below written cluster {max_used}"
            );
            assert!(from < 80 << 20, "tail {from:#x} not lowered at close");
        } else {
            assert_eq!(tail_of(&img), None);
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.qcow2");
        std::fs::write(&path, &img).unwrap();
        let (code, out) = qemu_img(&["check", "-f", "qcow2"], &path);
        assert_eq!(code, 0, "qemu-img check: {out}");
        // A reopened image still writes first writes alone.
        let exec = Exec::new();
        let dev = MemDevice::fixed(img, 80 << 20);
        let chain = open(&exec, &dev, false);
        dev.0.borrow_mut().record = true;
        write(&exec, &chain, 40 * CS, &pattern);
        assert_eq!(data_write_lens(&dev), vec![want], "after a reopen");
        close(&exec, chain);
    }
}

#[test]
fn nothing_is_written_past_the_zeroed_tail_on_disk() {
    // The tail moves by a 64th of the device: filling most of it takes dozens of raises.
    let (size, dev_size) = (32u64 << 20, 40usize << 20);
    let dev = formatted(size, dev_size, true);
    let initial = tail_of(&dev.contents()).unwrap();
    let exec = Exec::new();
    let chain = open(&exec, &dev, false);
    dev.0.borrow_mut().record = true;
    let mut r = Rng(29);
    let mut clusters: Vec<u64> = (0..size / CS).collect();
    // Random order, 3/4 of the clusters (24 MiB of the device), flushes between.
    for i in (1..clusters.len()).rev() {
        clusters.swap(i, r.below(i as u64 + 1) as usize);
    }
    clusters.truncate(clusters.len() * 3 / 4);
    let mut reference = Vec::new();
    for (i, c) in clusters.iter().enumerate() {
        let off = c * CS + r.below(CS / 4096) * 4096;
        let data = vec![(i % 251) as u8 + 1; 4096];
        write(&exec, &chain, off, &data);
        reference.push((off, data));
        if i % 50 == 49 {
            let c2 = chain.clone();
            exec.block_on(async move { c2.flush().await }).unwrap();
        }
    }
    close(&exec, chain);
    let raises = assert_writes_below_the_tail(&dev, initial);
    assert!(raises >= 15, "the tail was raised {raises} times");
    let img = dev.contents();
    // The data reads back (through a fresh open), and QEMU finds the image clean.
    let exec = Exec::new();
    let dev2 = MemDevice::fixed(img.clone(), dev_size);
    let chain = open(&exec, &dev2, false);
    for (off, data) in reference.iter().step_by(97) {
        assert_eq!(&read(&exec, &chain, *off, 4096), data);
    }
    qemu_check_clean(&img);
}

#[test]
fn a_refcount_table_that_grows_stays_below_the_zeroed_tail() {
    // 512-byte clusters and 64-bit refcounts: a refcount block covers 32 KiB, the first
    // table 2 MiB; filling 5 MiB creates blocks and grows the table twice, each placed
    // where the allocator finds room.
    let opts = CreateOptions {
        size: 6 << 20,
        cluster_bits: 9,
        refcount_order: 6,
        zeroed_tail: true,
        ..Default::default()
    };
    let dev_size = 64usize << 20;
    let dev = formatted_with(opts, dev_size);
    let initial = tail_of(&dev.contents()).unwrap();
    let exec = Exec::new();
    let chain = open(&exec, &dev, false);
    dev.0.borrow_mut().record = true;
    for i in 0..(5u64 << 20) / 65536 {
        write(&exec, &chain, i * 65536, &[(i % 255) as u8 + 1; 65536]);
    }
    close(&exec, chain);
    let raises = assert_writes_below_the_tail(&dev, initial);
    assert!(raises >= 5, "the tail was raised {raises} times");
    let img = dev.contents();
    let h = header_of(&img);
    assert!(h.header.refcount_table_clusters > 1, "the table grew");
    qemu_check_clean(&img);
}

#[test]
fn qemu_writing_the_image_voids_the_zeroed_tail() {
    let dev_size = 16usize << 20;
    let img = formatted(8 << 20, dev_size, true).contents();
    assert!(tail_of(&img).is_some());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.qcow2");
    std::fs::write(&path, &img).unwrap();
    // QEMU reads it, and reading leaves the claim alone.
    let (code, out) = qemu_img(&["check", "-f", "qcow2"], &path);
    assert_eq!(code, 0, "qemu-img check: {out}");
    // QEMU writes a cluster and frees it, keeping its bytes on the device (the discard
    // stops at the qcow2 layer): a cluster past the claimed tail that is not zero.
    let opts = format!(
        "driver=qcow2,pass-discard-request=off,file.driver=file,file.filename={}",
        path.display()
    );
    let out = Command::new("qemu-io")
        .args(["--image-opts", "-d", "unmap"])
        .args(["-c", "write -P 0xaa 0 64k", "-c", "discard 0 64k"])
        .arg(&opts)
        .output()
        .unwrap();
    assert!(out.status.success(), "qemu-io: {out:?}");
    let img = std::fs::read(&path).unwrap();
    let h = ImageHeader::decode(&img[..CS as usize], img.len() as u64).unwrap();
    assert_eq!(h.header.autoclear_features & autoclear::ZEROED_TAIL, 0);
    assert_eq!(h.extensions.zeroed_tail, None);
    assert!(img.contains(&0xaa), "QEMU's data stays on the device");
    // Our first write takes that free cluster: the rest of it must read as zeros.
    let exec = Exec::new();
    let dev = MemDevice::fixed(img, dev_size);
    let chain = open(&exec, &dev, false);
    let pattern = vec![0x11u8; 4096];
    write(&exec, &chain, 5 * CS, &pattern);
    let got = read(&exec, &chain, 5 * CS, CS as usize);
    assert_eq!(&got[..4096], &pattern[..]);
    assert!(
        got[4096..].iter().all(|b| *b == 0),
        "old bytes of a freed cluster show through a first write"
    );
    close(&exec, chain);
}

#[test]
fn a_repair_voids_the_zeroed_tail() {
    // A repair that rebuilds refcount structures puts them past the image's end: it does
    // not keep the tail, so it clears its bit first.
    let dev = formatted(8 << 20, 16 << 20, true);
    let exec = Exec::new();
    let chain = open(&exec, &dev, false);
    write(&exec, &chain, 0, &[7u8; 4096]);
    close(&exec, chain);
    let mut img = dev.contents();
    // Break the refcount table's first entry (its block goes missing).
    let h = ImageHeader::decode(&img[..CS as usize], img.len() as u64).unwrap();
    let rt = h.header.refcount_table_offset as usize;
    img[rt..rt + 8].fill(0);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.qcow2");
    std::fs::write(&path, &img).unwrap();
    // (On a device that grows, as `qemu-img check -r` repairs a file: the rebuilt
    // structures go past its end.)
    let exec = Exec::new();
    let dev = MemDevice::new(img);
    let id = exec.add_device(dev.clone());
    let e2 = exec.clone();
    let report = exec
        .block_on(async move {
            qcow2_engine::check::check(&e2, id, qcow2_engine::check::Repair::All).await
        })
        .unwrap();
    assert_eq!(report.corruptions, 0, "{report:?}");
    let img = dev.contents();
    let h = ImageHeader::decode(&img[..CS as usize], img.len() as u64).unwrap();
    assert_eq!(h.header.autoclear_features & autoclear::ZEROED_TAIL, 0);
    assert_eq!(h.extensions.zeroed_tail, None);
}
