//! Crash tests of the disk's life-cycle operations (resize; ARCHITECTURE.md §7, §13).
//!
//! An image is written and flushed, then the device records every write and flush of one
//! operation. For every device-flush boundary, and for random subsets of the writes issued
//! after it, the crashed image is rebuilt: `qemu-img check` must find no corruption (leaks
//! are allowed) and the image must read as the disk before the operation or the disk after
//! it, whole.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

mod crash_common;
use crash_common::states::{for_each_crash_state, qemu_accepts, qemu_clean, say_states};
use crash_common::{new_image, open};
mod mem_chain;
use mem_chain::bitmaps_of;

use qcow2_engine::create::CreateOptions;
use qcow2_engine::format::header::Header;
use qcow2_engine::io::{BufSlice, HeapBuf, IoBuffer};
use qcow2_engine::testing::{LoggedOp, MemDevice, Rng};
use qcow2_engine::{Chain, Error, Exec, Layer};
use std::process::Command;
use std::rc::Rc;

/// Guest bytes `[off, off+len)` of the image in `bytes`, and its virtual size.
fn read_range(bytes: Vec<u8>, off: u64, len: u64) -> (u64, Vec<u8>) {
    let exec = Exec::new();
    let dev = MemDevice::new(bytes);
    let chain = open(&exec, &dev, false).unwrap();
    let size = chain.size();
    let len = len.min(size.saturating_sub(off));
    let buf = HeapBuf::new(len as usize);
    let b2 = buf.clone();
    let c = chain.clone();
    exec.block_on(async move { c.read(off, BufSlice::whole(b2)).await })
        .unwrap();
    (size, buf.to_vec())
}

fn write(exec: &Exec<MemDevice>, chain: &Rc<Chain<MemDevice>>, off: u64, data: &[u8]) {
    let buf = HeapBuf::new(data.len());
    buf.copy_in(0, data);
    let c = chain.clone();
    exec.block_on(async move { c.write(off, BufSlice::whole(buf)).await })
        .unwrap();
}

/// An image of `opts` holding `data` at offset 0, flushed and closed; its bytes.
fn written_image(opts: &CreateOptions, data: &[u8], fixed: Option<usize>) -> Vec<u8> {
    let initial = new_image(opts);
    let exec = Exec::new();
    let dev = match fixed {
        Some(n) => MemDevice::fixed(initial, n),
        None => MemDevice::new(initial),
    };
    let chain = open(&exec, &dev, true).unwrap();
    write(&exec, &chain, 0, data);
    let c = chain.clone();
    exec.block_on(async move { c.close().await }).unwrap();
    dev.contents()
}

/// Resizes an image holding `data` from `opts.size` to `new_size` under the recorder, then
/// checks every crash state: accepted by qemu-img, and either the old disk (old size, the
/// data) or the new one (new size, the data, zeros after it to the new end).
/// Returns the number of states tried and the headers before and after.
fn resize_crash_test(
    opts: CreateOptions,
    data_len: usize,
    new_size: u64,
    fixed: Option<usize>,
) -> (usize, Header, Header) {
    let old_size = opts.size;
    let mut r = Rng(0x5eed);
    let data: Vec<u8> = (0..data_len).map(|_| r.next() as u8).collect();
    let initial = written_image(&opts, &data, fixed);
    let exec = Exec::new();
    let dev = match fixed {
        Some(n) => MemDevice::fixed(initial.clone(), n),
        None => MemDevice::new(initial.clone()),
    };
    let chain = open(&exec, &dev, true).unwrap();
    dev.0.borrow_mut().record = true;
    let c = chain.clone();
    let old = exec
        .block_on(async move {
            let old = c.resize(new_size, true).await?;
            c.close().await?;
            Ok::<_, Error>(old)
        })
        .unwrap();
    assert_eq!(old, old_size);
    assert_eq!(chain.size(), new_size);
    let log = dev.0.borrow().log.clone();
    assert!(log.iter().any(|e| matches!(e, LoggedOp::Flush)));
    // The finished image is the new disk.
    let tail = 1u64 << 20;
    let mut seen_new = false;
    let n = for_each_crash_state(&initial, &log, 3, 0xc0ffee, |label, img| {
        qemu_accepts(label, &img);
        let (size, head) = read_range(img.clone(), 0, data_len as u64);
        assert!(
            size == old_size || size == new_size,
            "crash state {label}: size {size}, neither {old_size} nor {new_size}"
        );
        assert!(head == data, "crash state {label}: the data changed");
        if size == new_size {
            seen_new = true;
            // The disk past the old data reads zeros, up to the new end.
            let from = new_size.saturating_sub(tail).max(data_len as u64);
            let (_, end) = read_range(img, from, new_size - from);
            assert!(
                end.iter().all(|b| *b == 0),
                "crash state {label}: the new range is not zeros"
            );
        }
    });
    assert!(seen_new, "no crash state reached the new size");
    // And the last state (the whole log) is the new disk, with no leak.
    let before = header_of(&initial);
    let mut fin = initial;
    for e in &log {
        if let LoggedOp::Write(off, d) = e {
            let end = *off as usize + d.len();
            if fin.len() < end {
                fin.resize(end, 0);
            }
            fin[*off as usize..end].copy_from_slice(d);
        }
    }
    let after = header_of(&fin);
    assert_eq!(read_range(fin, 0, 0).0, new_size);
    (n, before, after)
}

fn header_of(img: &[u8]) -> Header {
    qcow2_engine::format::ImageHeader::decode(img, img.len() as u64)
        .unwrap()
        .header
}

#[test]
fn resize_grows_the_l1_table_over_two_clusters() {
    // 4 KiB clusters: 512 L1 entries per cluster, each covering 2 MiB; 3 GiB needs 1,536.
    let (n, before, after) = resize_crash_test(
        CreateOptions {
            size: 8 << 20,
            cluster_bits: 12,
            ..Default::default()
        },
        3 << 20,
        3 << 30,
        None,
    );
    eprintln!("crash states tried (grow 8 MiB to 3 GiB, 4 KiB clusters): {n}");
    assert!(n > 5);
    assert_eq!((before.l1_size, after.l1_size), (4, 1536));
    assert_ne!(before.l1_table_offset, after.l1_table_offset);
}

#[test]
fn resize_grows_refcount_structures_too() {
    // 512-byte clusters with 64-bit refcounts: a refcount block covers 64 clusters and the
    // first refcount table 2 MiB of host; the new 60-cluster L1 table takes the image past
    // it, so refcount blocks and the table grow during the resize.
    let (n, before, after) = resize_crash_test(
        CreateOptions {
            size: 4 << 20,
            cluster_bits: 9,
            refcount_order: 6,
            ..Default::default()
        },
        1980 << 10,
        120 << 20,
        None,
    );
    eprintln!("crash states tried (grow with refcount growth, 512 B clusters): {n}");
    assert!(n > 5);
    assert_ne!(before.refcount_table_offset, after.refcount_table_offset);
    assert!(after.refcount_table_clusters > before.refcount_table_clusters);
}

#[test]
fn resize_on_a_fixed_size_device() {
    let (n, _, after) = resize_crash_test(
        CreateOptions {
            size: 8 << 20,
            cluster_bits: 12,
            ..Default::default()
        },
        2 << 20,
        2 << 30,
        Some(16 << 20),
    );
    assert_eq!(after.l1_size, 1024);
    eprintln!("crash states tried (grow on a fixed-size device): {n}");
    assert!(n > 5);
}

#[test]
fn resize_within_the_l1_table_and_shrink() {
    // 64 KiB clusters: one L1 entry covers 512 MiB; 8 MiB to 300 MiB changes only the size.
    let (n, before, after) = resize_crash_test(
        CreateOptions {
            size: 8 << 20,
            ..Default::default()
        },
        1 << 20,
        300 << 20,
        None,
    );
    assert!(n >= 2);
    assert_eq!(before.l1_table_offset, after.l1_table_offset);
    // Shrinking to a size that cuts no data.
    let (n, _, after) = resize_crash_test(
        CreateOptions {
            size: 64 << 20,
            ..Default::default()
        },
        1 << 20,
        2 << 20,
        None,
    );
    assert!(n >= 2);
    assert_eq!(after.size, 2 << 20);
}

#[test]
fn shrink_is_refused_without_the_flag_and_over_data() {
    let opts = CreateOptions {
        size: 64 << 20,
        cluster_bits: 12,
        ..Default::default()
    };
    let img = written_image(&opts, &[7u8; 8192], None);
    let exec = Exec::new();
    let dev = MemDevice::new(img);
    let chain = open(&exec, &dev, true).unwrap();
    write(&exec, &chain, 40 << 20, &[9u8; 4096]);
    let c = chain.clone();
    let r = exec.block_on(async move { c.resize(32 << 20, false).await });
    assert!(
        matches!(r, Err(Error::Refused(ref m)) if m.contains("--shrink")),
        "{r:?}"
    );
    let c = chain.clone();
    let r = exec.block_on(async move { c.resize(32 << 20, true).await });
    assert!(
        matches!(r, Err(Error::Refused(ref m)) if m.contains("holds data")),
        "{r:?}"
    );
    // A cut through the middle of a cluster keeps that cluster: refused for its data too.
    let c = chain.clone();
    let r = exec.block_on(async move { c.resize((40 << 20) + 512, true).await });
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(chain.size(), (40 << 20) + 512);
    let c = chain.clone();
    let r = exec.block_on(async move { c.discard(40 << 20, 4096).await });
    assert!(r.is_err(), "a discard past the end is refused");
    // Unaligned sizes are refused.
    let c = chain.clone();
    let r = exec.block_on(async move { c.resize(1000, true).await });
    assert!(matches!(r, Err(Error::Refused(_))), "{r:?}");
}

/// `qemu-img check` of a crash state of a snapshot operation: no corruption at all (leaks
/// allowed: exit 0 or 3). Returns the snapshot names `qemu-img snapshot -l` shows.
///
/// A state whose header has the dirty bit (lazy refcounts: refcounts not written yet, by
/// design) is checked as QEMU opens it for writing: repaired first (`-r all`), then the
/// same.
fn snapshot_state_accepted(label: &str, img: &[u8]) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("crash.qcow2");
    std::fs::write(&path, img).unwrap();
    let incompat = u64::from_be_bytes(img[72..80].try_into().unwrap());
    if incompat & 1 != 0 {
        let out = Command::new("qemu-img")
            .args(["check", "-r", "all", "-f", "qcow2"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            matches!(out.status.code(), Some(0) | Some(3)),
            "crash state {label}: qemu-img check -r all of a dirty image failed"
        );
    }
    let out = Command::new("qemu-img")
        .args(["check", "-f", "qcow2"])
        .arg(&path)
        .output()
        .unwrap();
    let code = out.status.code().unwrap_or(-1);
    assert!(
        code == 0 || code == 3,
        "crash state {label}: qemu-img check {code}\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let list = Command::new("qemu-img")
        .args(["snapshot", "-l", "-f", "qcow2"])
        .arg(&path)
        .output()
        .unwrap();
    String::from_utf8_lossy(&list.stdout)
        .lines()
        .skip(2)
        .filter_map(|l| l.split_whitespace().nth(1).map(String::from))
        .collect()
}

/// Guest bytes `[0, len)` of snapshot `name` of the image in `img`, read by QEMU.
fn snapshot_bytes(img: &[u8], name: &str, len: usize) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.qcow2");
    let raw = dir.path().join("s.raw");
    std::fs::write(&path, img).unwrap();
    let out = Command::new("qemu-img")
        .args(["convert", "-f", "qcow2", "-O", "raw", "-l", name])
        .arg(&path)
        .arg(&raw)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut b = std::fs::read(&raw).unwrap();
    b.truncate(len);
    b
}

/// Runs `op` on an image holding `data` (4 KiB clusters and what `tweak` changes, and a
/// snapshot `base` of `data` when `with_base`) under the recorder; checks every crash state with `verify(label,
/// image, snapshot names)`. Returns the number of states.
fn snapshot_crash_test(
    data: &[u8],
    with_base: bool,
    tweak: impl Fn(&mut CreateOptions),
    op: impl FnOnce(&Exec<MemDevice>, &Rc<Chain<MemDevice>>),
    mut verify: impl FnMut(&str, &[u8], &[String]),
) -> usize {
    let mut opts = CreateOptions {
        size: 16 << 20,
        cluster_bits: 12,
        ..Default::default()
    };
    tweak(&mut opts);
    let mut initial = written_image(&opts, data, None);
    if with_base {
        let exec = Exec::new();
        let dev = MemDevice::new(initial);
        let chain = open(&exec, &dev, true).unwrap();
        let c = chain.clone();
        exec.block_on(async move {
            let Some(Layer::Qcow2(q)) = c.layers().first() else {
                unreachable!()
            };
            q.snapshot_create("base", Default::default()).await?;
            c.close().await
        })
        .unwrap();
        initial = dev.contents();
    }
    qemu_clean("before the operation", &initial);
    let exec = Exec::new();
    let dev = MemDevice::new(initial.clone());
    let chain = open(&exec, &dev, true).unwrap();
    dev.0.borrow_mut().record = true;
    op(&exec, &chain);
    let log = dev.0.borrow().log.clone();
    qemu_clean("after the operation", &dev.contents());
    for_each_crash_state(&initial, &log, 2, 0xabc, |label, img| {
        let names = snapshot_state_accepted(label, &img);
        verify(label, &img, &names);
    })
}

#[test]
fn snapshot_create_is_all_or_nothing() {
    let mut r = Rng(7);
    let data: Vec<u8> = (0..(3 << 20)).map(|_| r.next() as u8).collect();
    let mut seen = false;
    let n = snapshot_crash_test(
        &data,
        false,
        |_| {},
        |exec, chain| {
            let c = chain.clone();
            exec.block_on(async move {
                let Some(Layer::Qcow2(q)) = c.layers().first() else {
                    unreachable!()
                };
                q.snapshot_create("s1", Default::default()).await?;
                c.close().await
            })
            .unwrap();
        },
        |label, img, names| {
            let (_, head) = read_range(img.to_vec(), 0, data.len() as u64);
            assert!(head == data, "crash state {label}: the active disk changed");
            match names {
                [] => {}
                [s] if s == "s1" => {
                    seen = true;
                    assert!(
                        snapshot_bytes(img, "s1", data.len()) == data,
                        "crash state {label}: the snapshot does not hold the disk"
                    );
                }
                other => panic!("crash state {label}: snapshots {other:?}"),
            }
        },
    );
    assert!(seen, "no crash state has the snapshot");
    eprintln!("crash states tried (snapshot create): {n}");
}

#[test]
fn snapshot_delete_is_all_or_nothing() {
    delete_test(|_| {});
}

#[test]
fn snapshot_delete_with_64_bit_refcounts_is_all_or_nothing() {
    // What only the snapshot held is freed across several refcount blocks.
    delete_test(|o| o.refcount_order = 6);
}

fn delete_test(tweak: impl Fn(&mut CreateOptions)) {
    let mut r = Rng(8);
    let data: Vec<u8> = (0..(2 << 20)).map(|_| r.next() as u8).collect();
    let new: Vec<u8> = (0..(1 << 20)).map(|_| r.next() as u8).collect();
    let mut gone = false;
    let n = snapshot_crash_test(
        &data,
        true,
        tweak,
        |exec, chain| {
            // The active disk moves on (copy on write), then the snapshot goes.
            write(exec, chain, 0, &new);
            let c = chain.clone();
            exec.block_on(async move {
                c.flush().await?;
                let Some(Layer::Qcow2(q)) = c.layers().first() else {
                    unreachable!()
                };
                q.snapshot_delete("base").await?;
                c.close().await
            })
            .unwrap();
        },
        |label, img, names| {
            match names {
                [] => gone = true,
                [s] if s == "base" => assert!(
                    snapshot_bytes(img, "base", data.len()) == data,
                    "crash state {label}: the snapshot lost its data"
                ),
                other => panic!("crash state {label}: snapshots {other:?}"),
            }
            let (_, head) = read_range(img.to_vec(), 0, data.len() as u64);
            assert!(
                head[new.len()..] == data[new.len()..],
                "crash state {label}: the active disk past the new write changed"
            );
        },
    );
    assert!(gone, "no crash state lost the snapshot");
    eprintln!("crash states tried (snapshot delete): {n}");
}

/// Replays every write of `log` on `initial`: the state once all of it reached the device.
fn replayed(initial: &[u8], log: &[LoggedOp]) -> Vec<u8> {
    let mut img = initial.to_vec();
    for e in log {
        if let LoggedOp::Write(off, d) = e {
            let end = *off as usize + d.len();
            if img.len() < end {
                img.resize(end, 0);
            }
            img[*off as usize..end].copy_from_slice(d);
        }
    }
    img
}

/// Opens the qcow2 image on `dev` (read-only) as one layer.
fn layer_of(exec: &Exec<MemDevice>, dev: MemDevice) -> Result<Layer<MemDevice>, Error> {
    let id = exec.add_device(dev);
    let e2 = exec.clone();
    let q = exec.block_on(async move {
        qcow2_engine::Qcow2::open(&e2, id, qcow2_engine::OpenOptions::default()).await
    })?;
    Ok(Layer::Qcow2(Box::new(q)))
}

/// Guest bytes `[0, len)` of the overlay `overlay` over the backing image `backing` (both
/// qcow2), or the overlay's open error (no valid image on the device).
fn read_overlay(overlay: Vec<u8>, backing: Vec<u8>, len: usize) -> Result<Vec<u8>, Error> {
    let exec = Exec::new();
    let top = layer_of(&exec, MemDevice::new(overlay))?;
    let under = layer_of(&exec, MemDevice::new(backing)).expect("the backing image opens");
    let chain = Chain::new(&exec, vec![top, under])?;
    let buf = HeapBuf::new(len);
    let b2 = buf.clone();
    exec.block_on(async move { chain.read(0, BufSlice::whole(b2)).await })?;
    Ok(buf.to_vec())
}

/// `qemu-img check` of `overlay` with `backing` beside it as its backing file `old.qcow2`
/// accepts it, and `qemu-img compare` finds it equal to `want` (raw).
fn qemu_accepts_overlay(label: &str, overlay: &[u8], backing: &[u8], want: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    let (top, old, raw) = (
        dir.path().join("top.qcow2"),
        dir.path().join("old.qcow2"),
        dir.path().join("want.raw"),
    );
    std::fs::write(&top, overlay).unwrap();
    std::fs::write(&old, backing).unwrap();
    std::fs::write(&raw, want).unwrap();
    let out = Command::new("qemu-img")
        .args(["check", "-f", "qcow2"])
        .arg(&top)
        .output()
        .unwrap();
    let code = out.status.code().unwrap_or(-1);
    assert!(
        code == 0 || code == 3,
        "crash state {label}: qemu-img check of the overlay {code}\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = Command::new("qemu-img")
        .args(["compare", "-q", "-f", "qcow2", "-F", "raw"])
        .arg(&top)
        .arg(&raw)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "crash state {label}: the overlay over its backing differs from the disk\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The external snapshot's two steps on the devices, each under the crash recorder: the old
/// image's flush (`Chain::close`, with guest writes not yet flushed) and the overlay's format
/// on a device that held another image. Every crash state of the old image is accepted by
/// qemu-img and reads, cluster by cluster, as the disk before or after the unflushed writes
/// (after all of them once the flush completed); every crash state of the new device is
/// either no image at all (never the image it held before) or the complete overlay, which
/// reads through its backing as the old disk, for us and for qemu-img.
#[test]
fn external_snapshot_switch_is_all_or_nothing() {
    let cs = 65536usize;
    let opts = CreateOptions {
        size: 8 << 20,
        ..Default::default()
    };
    let mut r = Rng(0x0e7e);
    let first: Vec<u8> = (0..4 * cs).map(|_| r.next() as u8).collect();
    let initial = written_image(&opts, &first, None);
    // Guest writes the switch's first flush did not cover: an overwrite and two new clusters.
    let later: Vec<u8> = (0..3 * cs).map(|_| r.next() as u8).collect();
    let exec = Exec::new();
    let dev = MemDevice::new(initial.clone());
    let chain = open(&exec, &dev, true).unwrap();
    write(&exec, &chain, 3 * cs as u64, &later);
    // What reached the device before the flush began (the writes' data, in place or in new
    // clusters; their metadata is still in the owner's cache).
    let unflushed = dev.contents();
    dev.0.borrow_mut().record = true;
    let c = chain.clone();
    exec.block_on(async move { c.close().await }).unwrap();
    let old_log = dev.0.borrow().log.clone();
    let mut before = first.clone();
    before.resize(6 * cs, 0);
    let mut after = first.clone();
    after.truncate(3 * cs);
    after.extend_from_slice(&later);
    let n_old = for_each_crash_state(&unflushed, &old_log, 3, 0xf105, |label, img| {
        qemu_accepts(label, &img);
        let (_, got) = read_range(img, 0, 6 * cs as u64);
        for (i, c) in got.chunks(cs).enumerate() {
            assert!(
                c == &before[i * cs..(i + 1) * cs] || c == &after[i * cs..(i + 1) * cs],
                "crash state {label}: cluster {i} is neither the old nor the new data"
            );
        }
    });
    let old = replayed(&unflushed, &old_log);
    assert_eq!(read_range(old.clone(), 0, 6 * cs as u64).1, after);

    // The overlay, on a device that held another image (whose header must never show).
    let stale_data = vec![0xc3u8; 2 * cs];
    let stale = written_image(&opts, &stale_data, None);
    let exec = Exec::new();
    let top_q = match layer_of(&exec, MemDevice::new(old.clone())).unwrap() {
        Layer::Qcow2(q) => q,
        _ => unreachable!(),
    };
    let oopts = qcow2_engine::overlay::overlay_options(&top_q, "old.qcow2");
    assert_eq!(oopts.size, opts.size);
    assert_eq!(oopts.backing_format.as_deref(), Some("qcow2"));
    let new_dev = MemDevice::new(stale.clone());
    let id = exec.add_device(new_dev.clone());
    new_dev.0.borrow_mut().record = true;
    let e2 = exec.clone();
    exec.block_on(async move { qcow2_engine::overlay::format_overlay(&e2, id, &oopts).await })
        .unwrap();
    let new_log = new_dev.0.borrow().log.clone();
    let disk = read_range(old.clone(), 0, opts.size).1;
    let (mut none, mut whole) = (0, 0);
    let n_new = for_each_crash_state(&stale, &new_log, 3, 0x0e7, |label, img| {
        if img == stale {
            // Nothing of the format reached the device yet: the switch had not begun.
            return;
        }
        match read_overlay(img.clone(), old.clone(), opts.size as usize) {
            Err(e) => {
                assert!(!matches!(e, Error::Io(_)), "crash state {label}: {e}");
                none += 1;
                let exec = Exec::new();
                assert!(
                    layer_of(&exec, MemDevice::new(img)).is_err(),
                    "crash state {label}: an image opens"
                );
            }
            Ok(got) => {
                whole += 1;
                assert!(
                    got == disk,
                    "crash state {label}: the overlay does not read as the old disk"
                );
                qemu_accepts_overlay(label, &img, &old, &disk);
            }
        }
    });
    assert!(
        none > 0 && whole > 0,
        "states: {none} without an image, {whole} whole"
    );
    say_states("external snapshot", n_old + n_new);
}

/// A chain of the overlay in `top` over the raw backing image `base` (when the overlay
/// still names it), opened with a small slice cache.
fn overlay_chain(
    exec: &Exec<MemDevice>,
    top: &MemDevice,
    base: &[u8],
    writable: bool,
) -> Rc<Chain<MemDevice>> {
    let id = exec.add_device(top.clone());
    let e2 = exec.clone();
    let opts = qcow2_engine::OpenOptions {
        writable,
        l2_cache_bytes: Some(8 << 10),
        ..Default::default()
    };
    let q = exec
        .block_on(async move { qcow2_engine::Qcow2::open(&e2, id, opts).await })
        .unwrap();
    let mut layers = Vec::new();
    let named = q.header().backing_file.is_some();
    layers.push(Layer::Qcow2(Box::new(q)));
    if named {
        let b = exec.add_device(MemDevice::new(base.to_vec()));
        layers.push(Layer::Raw {
            dev: b,
            size: base.len() as u64,
        });
    }
    Chain::new(exec, layers).unwrap()
}

/// The backing image of the stream tests: random data with runs of zeros, `len` bytes.
fn backing_data(len: usize, seed: u64) -> Vec<u8> {
    let mut r = Rng(seed);
    let mut b: Vec<u8> = (0..len).map(|_| r.next() as u8).collect();
    // Zeros: whole clusters and a few subclusters, which a stream records as zero flags.
    for z in [
        (64 << 10, 128 << 10),
        (1 << 20, 8 << 10),
        (2 << 20, 2 << 10),
    ] {
        b[z.0..z.0 + z.1].fill(0);
    }
    b
}

/// Streams an overlay (options `opts`, written by `pre` over the backing image first)
/// under the recorder, then checks every crash state: accepted by qemu-img (leaks allowed)
/// and read as the same disk whether it still names the backing file or not; the last
/// state names none. Returns the number of states.
fn stream_crash_test(opts: CreateOptions, writes: &[(u64, usize)]) -> usize {
    let size = opts.size as usize;
    let base = backing_data(size - (256 << 10), 0x57ea);
    let mut expect = base.clone();
    expect.resize(size, 0);
    let initial = {
        let img = new_image(&CreateOptions {
            backing_file: Some("base.raw".into()),
            backing_format: Some("raw".into()),
            ..opts
        });
        let exec = Exec::new();
        let dev = MemDevice::new(img);
        let chain = overlay_chain(&exec, &dev, &base, true);
        let mut r = Rng(0x77);
        for &(off, len) in writes {
            let d: Vec<u8> = (0..len).map(|_| r.next() as u8).collect();
            write(&exec, &chain, off, &d);
            expect[off as usize..off as usize + len].copy_from_slice(&d);
        }
        let c = chain.clone();
        exec.block_on(async move { c.close().await }).unwrap();
        dev.contents()
    };
    let exec = Exec::new();
    let dev = MemDevice::new(initial.clone());
    let chain = overlay_chain(&exec, &dev, &base, true);
    dev.0.borrow_mut().record = true;
    let c = chain.clone();
    let filled = exec
        .block_on(async move {
            let n = c.stream().await?;
            c.close().await?;
            Ok::<_, Error>(n)
        })
        .unwrap();
    assert!(filled > 0, "the stream filled nothing");
    assert_eq!(
        chain.layers().len(),
        1,
        "the backing layer is still attached"
    );
    let log = dev.0.borrow().log.clone();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("base.raw"), &base).unwrap();
    let (mut named, mut alone) = (false, false);
    let n = for_each_crash_state(&initial, &log, 2, 0x5173, |label, img| {
        let path = dir.path().join("top.qcow2");
        std::fs::write(&path, &img).unwrap();
        let out = Command::new("qemu-img")
            .args(["check", "-f", "qcow2"])
            .arg(&path)
            .output()
            .unwrap();
        let code = out.status.code().unwrap_or(-1);
        assert!(
            code == 0 || code == 3,
            "crash state {label}: qemu-img check {code}\n{}",
            String::from_utf8_lossy(&out.stdout)
        );
        let exec = Exec::new();
        let d = MemDevice::new(img);
        let chain = overlay_chain(&exec, &d, &base, false);
        if chain.layers().len() > 1 {
            named = true;
        } else {
            alone = true;
        }
        let buf = HeapBuf::new(size);
        let (b2, c) = (buf.clone(), chain.clone());
        exec.block_on(async move { c.read(0, BufSlice::whole(b2)).await })
            .unwrap();
        assert!(
            buf.to_vec() == expect,
            "crash state {label}: the disk changed (backing named: {})",
            chain.layers().len() > 1
        );
    });
    assert!(named && alone, "crash states: named {named}, alone {alone}");
    // The finished image: no backing file, no backing format, and QEMU reads the disk.
    let mut fin = initial;
    for e in &log {
        if let LoggedOp::Write(off, d) = e {
            let end = *off as usize + d.len();
            if fin.len() < end {
                fin.resize(end, 0);
            }
            fin[*off as usize..end].copy_from_slice(d);
        }
    }
    let h = qcow2_engine::format::ImageHeader::decode(&fin, fin.len() as u64).unwrap();
    assert_eq!(h.backing_file, None);
    assert_eq!(h.extensions.backing_format, None);
    let path = dir.path().join("fin.qcow2");
    std::fs::write(&path, &fin).unwrap();
    let raw = dir.path().join("fin.raw");
    let out = Command::new("qemu-img")
        .args(["convert", "-f", "qcow2", "-O", "raw"])
        .arg(&path)
        .arg(&raw)
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(
        std::fs::read(&raw).unwrap() == expect,
        "QEMU reads another disk"
    );
    n
}

#[test]
fn stream_then_drop_reads_the_same_disk_after_any_crash() {
    let n = stream_crash_test(
        CreateOptions {
            size: 4 << 20,
            cluster_bits: 12,
            ..Default::default()
        },
        &[(0, 4096), (10 << 12, 3 << 12), (300 << 10, 1000 << 9)],
    );
    eprintln!("crash states tried (stream): {n}");
}

#[test]
fn stream_of_extended_l2_fills_only_unallocated_subclusters() {
    // 64 KiB clusters of 2 KiB subclusters; the writes allocate parts of clusters.
    let n = stream_crash_test(
        CreateOptions {
            size: 4 << 20,
            cluster_bits: 16,
            extended_l2: true,
            ..Default::default()
        },
        &[
            (2048, 2048),
            (70 << 10, 6 << 10),
            (1 << 20, 64 << 10),
            (3 << 20, 512),
        ],
    );
    eprintln!("crash states tried (stream, extended L2): {n}");
}

#[test]
fn snapshot_create_over_an_older_snapshot_is_all_or_nothing() {
    create_over_an_older_snapshot(|_| {});
}

#[test]
fn snapshot_create_with_extended_l2_is_all_or_nothing() {
    // Two words per entry: COPIED is looked for (and changed) in the entry, never in the
    // subcluster bitmap.
    create_over_an_older_snapshot(|o| {
        o.cluster_bits = 14;
        o.extended_l2 = true;
    });
}

#[test]
fn snapshot_create_with_lazy_refcounts_is_all_or_nothing() {
    // The write before the snapshot leaves refcounts in memory (dirty bit set): the commit
    // writes them back first and plans against what is on disk.
    create_over_an_older_snapshot(|o| o.lazy_refcounts = true);
}

#[test]
fn snapshot_create_with_64_bit_refcounts_touches_several_refcount_blocks() {
    // 512 refcounts per block (2 MiB of clusters): the commit copies several blocks,
    // among them those counting its own new clusters.
    create_over_an_older_snapshot(|o| o.refcount_order = 6);
}

fn create_over_an_older_snapshot(tweak: impl Fn(&mut CreateOptions)) {
    // 4 KiB clusters: an L2 table covers 2 MiB. After `base`, the first table is copied on
    // write (its own data and data shared with `base`), the second stays shared: the new
    // snapshot copies the first (COPIED entries) and shares the second.
    let mut r = Rng(9);
    let data: Vec<u8> = (0..(3 << 20)).map(|_| r.next() as u8).collect();
    let new: Vec<u8> = (0..(512 << 10)).map(|_| r.next() as u8).collect();
    let mut moved = data.clone();
    moved[..new.len()].copy_from_slice(&new);
    let mut seen = false;
    let n = snapshot_crash_test(
        &data,
        true,
        |o| tweak(o),
        |exec, chain| {
            write(exec, chain, 0, &new);
            let c = chain.clone();
            exec.block_on(async move {
                c.flush().await?;
                let Some(Layer::Qcow2(q)) = c.layers().first() else {
                    unreachable!()
                };
                q.snapshot_create("s1", Default::default()).await?;
                c.close().await
            })
            .unwrap();
        },
        |label, img, names| {
            let (_, head) = read_range(img.to_vec(), 0, data.len() as u64);
            assert!(
                head[new.len()..] == data[new.len()..],
                "crash state {label}: the active disk past the new write changed"
            );
            assert!(
                snapshot_bytes(img, "base", data.len()) == data,
                "crash state {label}: the old snapshot lost its data"
            );
            match names {
                [b] if b == "base" => {}
                [b, s] if b == "base" && s == "s1" => {
                    seen = true;
                    assert!(
                        head == moved,
                        "crash state {label}: the active disk changed"
                    );
                    assert!(
                        snapshot_bytes(img, "s1", data.len()) == moved,
                        "crash state {label}: the new snapshot does not hold the disk"
                    );
                }
                other => panic!("crash state {label}: snapshots {other:?}"),
            }
        },
    );
    assert!(seen, "no crash state has the new snapshot");
    eprintln!("crash states tried (snapshot create over a snapshot): {n}");
}

#[test]
fn snapshot_apply_is_all_or_nothing() {
    let mut r = Rng(10);
    let data: Vec<u8> = (0..(3 << 20)).map(|_| r.next() as u8).collect();
    let new: Vec<u8> = (0..(1 << 20)).map(|_| r.next() as u8).collect();
    let mut moved = data.clone();
    moved[..new.len()].copy_from_slice(&new);
    let (mut old_seen, mut new_seen) = (false, false);
    let n = snapshot_crash_test(
        &data,
        true,
        |_| {},
        |exec, chain| {
            write(exec, chain, 0, &new);
            let c = chain.clone();
            exec.block_on(async move {
                c.flush().await?;
                let Some(Layer::Qcow2(q)) = c.layers().first() else {
                    unreachable!()
                };
                q.snapshot_apply("base").await?;
                c.close().await
            })
            .unwrap();
        },
        |label, img, names| {
            assert!(
                matches!(names, [b] if b == "base"),
                "crash state {label}: snapshots {names:?}"
            );
            assert!(
                snapshot_bytes(img, "base", data.len()) == data,
                "crash state {label}: the snapshot lost its data"
            );
            let (_, head) = read_range(img.to_vec(), 0, data.len() as u64);
            if head == data {
                new_seen = true;
            } else {
                assert!(head == moved, "crash state {label}: neither disk");
                old_seen = true;
            }
        },
    );
    assert!(
        old_seen && new_seen,
        "crash states miss the old or the new disk"
    );
    eprintln!("crash states tried (snapshot apply): {n}");
}

#[test]
fn snapshots_over_compressed_and_zero_clusters_check_clean() {
    // Compressed streams (several per host cluster) and zero clusters: counted and given
    // back like QEMU counts them, no COPIED on compressed entries.
    let dir = tempfile::tempdir().unwrap();
    let (raw, img) = (dir.path().join("src.raw"), dir.path().join("c.qcow2"));
    let mut r = Rng(11);
    // Half random (incompressible), half a repeating pattern (compressible).
    let mut data: Vec<u8> = (0..(1 << 20)).map(|_| r.next() as u8).collect();
    data.extend((0..(1 << 20)).map(|i| (i % 251) as u8));
    std::fs::write(&raw, &data).unwrap();
    let st = Command::new("qemu-img")
        .args([
            "convert",
            "-c",
            "-f",
            "raw",
            "-O",
            "qcow2",
            "-o",
            "cluster_size=4096",
        ])
        .arg(&raw)
        .arg(&img)
        .status()
        .unwrap();
    assert!(st.success());
    let st = Command::new("qemu-io")
        .args(["-f", "qcow2", "-c", "write -z 1536k 64k"])
        .arg(&img)
        .status()
        .unwrap();
    assert!(st.success());
    data[1536 << 10..(1536 + 64) << 10].fill(0);
    let exec = Exec::new();
    let dev = MemDevice::new(std::fs::read(&img).unwrap());
    let chain = open(&exec, &dev, true).unwrap();
    let new: Vec<u8> = (0..(256 << 10)).map(|_| r.next() as u8).collect();
    let c = chain.clone();
    exec.block_on(async move {
        let Some(Layer::Qcow2(q)) = c.layers().first() else {
            unreachable!()
        };
        q.snapshot_create("s1", Default::default()).await
    })
    .unwrap();
    write(&exec, &chain, 1 << 20, &new);
    let c = chain.clone();
    exec.block_on(async move {
        let Some(Layer::Qcow2(q)) = c.layers().first() else {
            unreachable!()
        };
        q.snapshot_create("s2", Default::default()).await?;
        q.snapshot_delete("s1").await?;
        c.close().await
    })
    .unwrap();
    let out = dev.contents();
    qemu_clean("after create, write, create, delete", &out);
    let mut moved = data.clone();
    moved[1 << 20..(1 << 20) + new.len()].copy_from_slice(&new);
    assert!(
        snapshot_bytes(&out, "s2", data.len()) == moved,
        "snapshot s2"
    );
    let (_, head) = read_range(out, 0, data.len() as u64);
    assert!(head == moved, "the active disk");
}

/// A session of guest writes on an image with persistent bitmaps (QEMU-made: an enabled
/// `b0` and a disabled `old` holding earlier writes), from open to close, under the
/// recorder. In every crash state the image is accepted by qemu-img, and each bitmap is
/// either `in_use` (inconsistent: a backup refuses it) or trustworthy: `b0` has a bit set
/// wherever the disk differs from the disk before the session, `old` is as it was. After
/// the close neither is `in_use`.
#[test]
fn persistent_bitmaps_are_in_use_or_right_after_any_crash() {
    let size = 8u64 << 20;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bitmaps.qcow2");
    let p = path.to_str().unwrap();
    let sh = |prog: &str, args: &[&str]| {
        let out = Command::new(prog).args(args).output().unwrap();
        assert!(out.status.success(), "{prog} {args:?}: {:?}", out);
    };
    sh("qemu-img", &["create", "-q", "-f", "qcow2", p, "8M"]);
    sh("qemu-img", &["bitmap", "--add", p, "old"]);
    sh("qemu-io", &["-f", "qcow2", "-c", "write -P 3 2M 192k", p]);
    sh("qemu-img", &["bitmap", "--disable", p, "old"]);
    sh("qemu-img", &["bitmap", "--add", p, "b0"]);
    let initial = std::fs::read(&path).unwrap();
    let before = bitmaps_of(&initial, size);
    let (_, disk_before) = read_range(initial.clone(), 0, size);

    let exec = Exec::new();
    let dev = MemDevice::new(initial.clone());
    dev.0.borrow_mut().record = true;
    let chain = open(&exec, &dev, true).unwrap();
    let mut r = Rng(0xb17);
    for (i, off) in [0u64, 3 << 20, (1 << 20) + 4096, 7 << 20, 5 << 20]
        .into_iter()
        .enumerate()
    {
        let data: Vec<u8> = (0..(64 << 10) + 512).map(|_| r.next() as u8).collect();
        write(&exec, &chain, off, &data);
        if i % 2 == 1 {
            let c = chain.clone();
            exec.block_on(async move { c.flush().await }).unwrap();
        }
    }
    let c = chain.clone();
    exec.block_on(async move { c.close().await }).unwrap();
    let log = dev.0.borrow().log.clone();
    // A second close stores nothing new.
    let closed = dev.contents();
    let c = chain.clone();
    exec.block_on(async move { c.close().await }).unwrap();
    assert!(dev.contents() == closed, "a second close changed the image");

    let mut consistent_after_writes = 0;
    let n = for_each_crash_state(&initial, &log, 3, 0xb175, |label, img| {
        qemu_accepts(label, &img);
        let (_, disk) = read_range(img.clone(), 0, size);
        let now = bitmaps_of(&img, size);
        for ((name, in_use, bits), (_, _, old_bits)) in now.iter().zip(&before) {
            if *in_use {
                continue;
            }
            if name == "old" {
                assert_eq!(
                    bits, old_bits,
                    "crash state {label}: the disabled bitmap changed"
                );
                continue;
            }
            let changed = disk.iter().zip(&disk_before).position(|(a, b)| a != b);
            for (g, bit) in bits.iter().enumerate() {
                let (s, e) = (g << 16, ((g + 1) << 16).min(size as usize));
                assert!(
                    *bit || disk[s..e] == disk_before[s..e],
                    "crash state {label}: bitmap {name} misses granule {g}, which changed"
                );
            }
            if changed.is_some() {
                consistent_after_writes += 1;
            }
        }
    });
    let last = bitmaps_of(&dev.contents(), size);
    assert!(
        last.iter().all(|(_, in_use, _)| !in_use),
        "{:?}",
        last.iter().map(|b| (&b.0, b.1)).collect::<Vec<_>>()
    );
    assert!(
        consistent_after_writes > 0,
        "no crash state after the store"
    );
    qemu_clean("after the close", &dev.contents());
    say_states("persistent bitmaps", n);
}
