//! Model test of the write path: seeded random writes (cluster-aligned and not, one sector
//! to several clusters), write-zeroes, discards and flushes against a plain in-memory
//! reference disk. Every read must equal the reference; after close, `qemu-img check` must
//! exit 0 and `qemu-img compare` must find the image equal to the reference.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::io::{BufSlice, HeapBuf, IoBuffer};
use qcow2_engine::testing::host;
use qcow2_engine::testing::MemDevice;
use qcow2_engine::testing::Rng;
use qcow2_engine::{Chain, Exec, Layer, OpenOptions, Qcow2};
use std::process::Command;
use std::rc::Rc;

struct Setup {
    lazy: bool,
    cluster_bits: u32,
    extended_l2: bool,
    refcount_order: u32,
    backing: bool,
    size: u64,
    ops: usize,
    seed: u64,
}

fn open_layer(exec: &Exec<MemDevice>, dev: &MemDevice, writable: bool) -> Layer<MemDevice> {
    let id = exec.add_device(dev.clone());
    let e2 = exec.clone();
    let opts = OpenOptions {
        writable,
        l2_cache_bytes: Some(16 << 10),
        ..Default::default()
    };
    let q = exec
        .block_on(async move { Qcow2::open(&e2, id, opts).await })
        .unwrap();
    Layer::Qcow2(Box::new(q))
}

/// Writes `len` random bytes at `off` through `chain` and into `reference`.
fn write_random(
    exec: &Exec<MemDevice>,
    chain: &Rc<Chain<MemDevice>>,
    rng: &mut Rng,
    reference: &mut [u8],
    off: u64,
    len: u64,
) -> qcow2_engine::Result<()> {
    let data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
    let buf = HeapBuf::new(len as usize);
    buf.copy_in(0, &data);
    let c = chain.clone();
    exec.block_on(async move { c.write(off, BufSlice::whole(buf)).await })?;
    reference[off as usize..(off + len) as usize].copy_from_slice(&data);
    Ok(())
}

fn run(s: Setup) {
    let mut rng = Rng(s.seed | 1);
    let exec: Exec<MemDevice> = Exec::new();
    let dir = tempfile::tempdir().unwrap();
    // Backing image: a qcow2 made by us, filled with random data in places.
    let mut reference = vec![0u8; s.size as usize];
    let base_dev = if s.backing {
        let dev = MemDevice::new(Vec::new());
        let id = exec.add_device(dev.clone());
        let e2 = exec.clone();
        let opts = CreateOptions {
            size: s.size,
            cluster_bits: 16,
            ..Default::default()
        };
        exec.block_on(async move { create(&e2, id, &opts).await })
            .unwrap();
        let chain = Chain::new(&exec, vec![open_layer(&exec, &dev, true)]).unwrap();
        for _ in 0..20 {
            let len = (1 + rng.below(64)) * 4096;
            let off = rng.below((s.size - len) / 4096) * 4096;
            write_random(&exec, &chain, &mut rng, &mut reference, off, len).unwrap();
        }
        let c = chain.clone();
        exec.block_on(async move { c.flush().await }).unwrap();
        std::fs::write(dir.path().join("base.qcow2"), dev.contents()).unwrap();
        Some(dev)
    } else {
        None
    };
    let dev = MemDevice::new(Vec::new());
    let id = exec.add_device(dev.clone());
    let e2 = exec.clone();
    let opts = CreateOptions {
        size: s.size,
        cluster_bits: s.cluster_bits,
        extended_l2: s.extended_l2,
        refcount_order: s.refcount_order,
        lazy_refcounts: s.lazy,
        backing_file: s.backing.then(|| "base.qcow2".to_string()),
        backing_format: s.backing.then(|| "qcow2".to_string()),
        ..Default::default()
    };
    exec.block_on(async move { create(&e2, id, &opts).await })
        .unwrap();
    let mut layers = vec![open_layer(&exec, &dev, true)];
    if let Some(b) = &base_dev {
        layers.push(open_layer(&exec, b, false));
    }
    let chain: Rc<Chain<MemDevice>> = Chain::new(&exec, layers).unwrap();

    let cs = 1u64 << s.cluster_bits;
    let sc = if s.extended_l2 { cs / 32 } else { cs };
    let sectors = s.size / 512;
    for op in 0..s.ops {
        let max = (cs * 3 / 512).clamp(1, 4096);
        let len = (1 + rng.below(max)).min(sectors) * 512;
        let off = if rng.below(2) == 0 {
            // Cluster aligned.
            rng.below((s.size - len) / cs + 1) * cs
        } else {
            rng.below(sectors - len / 512 + 1) * 512
        }
        .min(s.size - len);
        let c = chain.clone();
        match rng.below(12) {
            0 => {
                let unmap = rng.below(2) == 0;
                exec.block_on(async move { c.write_zeroes(off, len, unmap).await })
                    .unwrap();
                reference[off as usize..(off + len) as usize].fill(0);
            }
            1 => {
                exec.block_on(async move { c.discard(off, len).await })
                    .unwrap();
                // Whole (sub)clusters read as zeros after a discard; partial ones are kept.
                let gran = if s.extended_l2 { sc } else { cs };
                let a = off.div_ceil(gran) * gran;
                let b = (off + len) / gran * gran;
                if a < b {
                    reference[a as usize..b as usize].fill(0);
                }
            }
            2 => {
                exec.block_on(async move { c.flush().await }).unwrap();
            }
            _ => {
                write_random(&exec, &chain, &mut rng, &mut reference, off, len).unwrap();
            }
        }
        // Read back a random window and, every so often, the whole disk.
        let (roff, rlen) = if op % 50 == 49 {
            (0, s.size)
        } else {
            (off, len)
        };
        let buf = HeapBuf::new(rlen as usize);
        let c = chain.clone();
        let b2 = buf.clone();
        exec.block_on(async move { c.read(roff, BufSlice::whole(b2)).await })
            .unwrap();
        let got = buf.to_vec();
        if got[..] != reference[roff as usize..(roff + rlen) as usize] {
            let i = got
                .iter()
                .zip(&reference[roff as usize..])
                .position(|(a, b)| a != b)
                .unwrap();
            panic!("op {op}: read mismatch at guest byte {}", roff + i as u64);
        }
    }
    let c = chain.clone();
    exec.block_on(async move { c.close().await }).unwrap();
    check_and_compare(dir.path(), &dev.contents(), &reference, "model");
}

/// Writes `image` and `reference` to files in `dir` (where a backing file would be):
/// `qemu-img check` must exit 0 (returns its output) and `qemu-img compare` must find them
/// equal.
fn check_and_compare(dir: &std::path::Path, image: &[u8], reference: &[u8], what: &str) -> String {
    let img = dir.join("img.qcow2");
    let raw = dir.join("ref.raw");
    std::fs::write(&img, image).unwrap();
    std::fs::write(&raw, reference).unwrap();
    let out = Command::new("qemu-img")
        .args(["check", "-f", "qcow2"])
        .arg(&img)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what}: qemu-img check: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new("qemu-img")
        .args(["compare", "-f", "qcow2", "-F", "raw"])
        .arg(&img)
        .arg(&raw)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{what}: qemu-img compare: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    text
}

macro_rules! model {
    ($name:ident, $bits:expr, $ext:expr, $order:expr, $backing:expr, $size:expr, $ops:expr) => {
        #[test]
        fn $name() {
            run(Setup {
                lazy: false,
                cluster_bits: $bits,
                extended_l2: $ext,
                refcount_order: $order,
                backing: $backing,
                size: $size,
                ops: $ops,
                seed: line!() as u64,
            });
        }
    };
}

model!(c512_rc16, 9, false, 4, false, 2 << 20, 400);
model!(c512_rc1_backing, 9, false, 0, true, 2 << 20, 400);
model!(c64k_rc16, 16, false, 4, false, 32 << 20, 400);
model!(c64k_rc1, 16, false, 0, false, 32 << 20, 300);
model!(c64k_backing, 16, false, 4, true, 32 << 20, 400);
model!(c2m_rc16, 21, false, 4, false, 64 << 20, 150);
model!(c2m_backing, 21, false, 4, true, 64 << 20, 150);
model!(ext_l2_64k, 16, true, 4, false, 32 << 20, 400);
model!(ext_l2_64k_backing_rc1, 16, true, 0, true, 32 << 20, 400);
model!(ext_l2_2m, 21, true, 4, false, 64 << 20, 150);

/// Continue writing an image made by qemu: internal snapshots (clusters and L2 tables
/// shared, refcount 2) and compressed clusters must be copied on write; afterwards
/// `qemu-img check` exits 0, the active image equals the reference, and every snapshot still
/// reads exactly as before.
fn continue_qemu_image(compressed: bool, extended_l2: bool, seed: u64) {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img.qcow2");
    let sh = |args: &[&str]| {
        let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let p = img.to_str().unwrap();
    let opts = if extended_l2 {
        "extended_l2=on"
    } else {
        "cluster_size=65536"
    };
    let src = dir.path().join("src.qcow2");
    let s = src.to_str().unwrap();
    sh(&[
        "qemu-img", "create", "-q", "-f", "qcow2", "-o", opts, s, "16M",
    ]);
    sh(&[
        "qemu-io",
        "-f",
        "qcow2",
        "-c",
        "write -P 0x61 0 6M",
        "-c",
        "write -P 0x62 9M 2M",
        "-c",
        "write -z 7M 512k",
        s,
    ]);
    if compressed {
        sh(&["qemu-img", "convert", "-c", "-O", "qcow2", "-o", opts, s, p]);
        let map = Command::new("qemu-img")
            .args(["map", "--output=json", p])
            .output()
            .unwrap();
        assert!(String::from_utf8_lossy(&map.stdout).contains("\"compressed\": true"));
    } else {
        std::fs::copy(&src, &img).unwrap();
    }
    sh(&["qemu-img", "snapshot", "-c", "s1", p]);
    sh(&["qemu-io", "-f", "qcow2", "-c", "write -P 0x63 1M 1M", p]);
    sh(&["qemu-img", "snapshot", "-c", "s2", p]);
    // Expected contents of each snapshot, and of the active layer.
    let snap_raw = |name: &str| {
        let out = dir.path().join(format!("{name}.raw"));
        sh(&[
            "qemu-img",
            "convert",
            "-O",
            "raw",
            "-l",
            &format!("snapshot.name={name}"),
            p,
            out.to_str().unwrap(),
        ]);
        std::fs::read(out).unwrap()
    };
    let s1 = snap_raw("s1");
    let s2 = snap_raw("s2");
    let active = dir.path().join("active.raw");
    sh(&[
        "qemu-img",
        "convert",
        "-O",
        "raw",
        p,
        active.to_str().unwrap(),
    ]);
    let mut reference = std::fs::read(&active).unwrap();

    let exec: Exec<MemDevice> = Exec::new();
    let dev = MemDevice::new(std::fs::read(&img).unwrap());
    let chain = Chain::new(&exec, vec![open_layer(&exec, &dev, true)]).unwrap();
    let mut rng = Rng(seed);
    let size = reference.len() as u64;
    for _ in 0..200 {
        let len = (1 + rng.below(300)) * 512;
        let off = rng.below((size - len) / 512) * 512;
        let c = chain.clone();
        match rng.below(8) {
            0 => {
                exec.block_on(async move { c.write_zeroes(off, len, false).await })
                    .unwrap();
                reference[off as usize..(off + len) as usize].fill(0);
            }
            1 => {
                exec.block_on(async move { c.flush().await }).unwrap();
            }
            _ => {
                write_random(&exec, &chain, &mut rng, &mut reference, off, len).unwrap();
            }
        }
    }
    let c = chain.clone();
    exec.block_on(async move { c.flush().await }).unwrap();
    std::fs::write(&img, dev.contents()).unwrap();
    let out = Command::new("qemu-img")
        .args(["check", "-f", "qcow2", p])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "qemu-img check: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let now = dir.path().join("now.raw");
    sh(&["qemu-img", "convert", "-O", "raw", p, now.to_str().unwrap()]);
    assert!(
        std::fs::read(&now).unwrap() == reference,
        "active layer differs from the reference"
    );
    assert!(snap_raw("s1") == s1, "snapshot s1 changed");
    assert!(snap_raw("s2") == s2, "snapshot s2 changed");
}

#[test]
fn continue_qemu_image_with_snapshots() {
    continue_qemu_image(false, false, 31);
}

#[test]
fn continue_qemu_image_compressed_with_snapshots() {
    continue_qemu_image(true, false, 32);
}

#[test]
fn continue_qemu_image_extended_l2_with_snapshots() {
    continue_qemu_image(false, true, 33);
}

#[test]
fn continue_qemu_image_compressed_extended_l2_with_snapshots() {
    // QEMU writes compressed clusters into extended-L2 images too.
    continue_qemu_image(true, true, 34);
}

#[test]
fn refcount_table_growth() {
    // 512-byte clusters with 16-bit refcounts: one table cluster covers 8 MiB of host
    // space, so writing 12 MiB must grow the refcount table (new table, blocks, header).
    run(Setup {
        lazy: false,
        cluster_bits: 9,
        extended_l2: false,
        refcount_order: 4,
        backing: false,
        size: 24 << 20,
        ops: 60,
        seed: 77,
    });
}

/// The refcount table grows in the middle of long writes (512-byte clusters: one table
/// cluster covers 8 MiB of host space), on a device that grows (a file) and on one that
/// cannot (a bdev). An allocation's run of free clusters used to be found first and taken
/// after: the table that grew meanwhile (while checking the run's clusters) lay on it, and
/// the image was marked corrupt; on a fixed device the new table went past its end
/// (ENOSPC after 8 MiB).
#[test]
fn refcount_table_grows_under_long_writes() {
    for fixed in [false, true] {
        let size: u64 = 30 << 20;
        let dev_len = 40 << 20;
        let exec: Exec<MemDevice> = Exec::new();
        let dev = if fixed {
            MemDevice::fixed(Vec::new(), dev_len)
        } else {
            MemDevice::new(Vec::new())
        };
        let id = exec.add_device(dev.clone());
        let e2 = exec.clone();
        let opts = CreateOptions {
            size,
            cluster_bits: 9,
            ..Default::default()
        };
        exec.block_on(async move { create(&e2, id, &opts).await })
            .unwrap();
        let rt_before = dev.contents()[48..56].to_vec();
        let chain = Chain::new(&exec, vec![open_layer(&exec, &dev, true)]).unwrap();
        let mut rng = Rng(99);
        let mut reference = vec![0u8; size as usize];
        let mut write = |off: u64, len: u64| {
            write_random(&exec, &chain, &mut rng, &mut reference, off, len)
                .unwrap_or_else(|e| panic!("fixed {fixed}: write at {off}: {e}"));
        };
        // Sequential 1 MiB writes over most of the disk, then one long write at the end.
        for i in 0..24u64 {
            write(i << 20, 1 << 20);
        }
        write(24 << 20, 6 << 20);
        let c = chain.clone();
        exec.block_on(async move { c.close().await }).unwrap();
        let img = dev.contents();
        assert_ne!(
            img[48..56],
            rt_before[..],
            "fixed {fixed}: the table did not grow"
        );
        if fixed {
            assert_eq!(img.len(), dev_len, "a fixed device must not grow");
        }
        let dir = tempfile::tempdir().unwrap();
        check_and_compare(dir.path(), &img, &reference, &format!("fixed {fixed}"));
    }
}

/// Preallocation on a device that holds old data (a bdev): `Metadata` maps the clusters as
/// preallocated zero clusters and `Full` writes zeros, so the old bytes never show; a v2
/// image cannot mark zeros and is refused `Metadata`. Writes into a preallocated image read
/// back, and `qemu-img check` and `compare` agree.
#[test]
fn preallocation_on_a_device_with_old_data() {
    use qcow2_engine::create::{preallocate, Preallocation};
    let size: u64 = 8 << 20;
    let dev_len = 12 << 20;
    // (mode, version, the device zeroes cheaply: `Full` zeroes with WriteZeroes)
    for (mode, version, cheap_zeroes) in [
        (
            Preallocation::Metadata {
                device_reads_zeros: false,
            },
            3,
            false,
        ),
        (Preallocation::Full, 3, false),
        (Preallocation::Full, 3, true),
        (Preallocation::Full, 2, false),
        (
            Preallocation::Metadata {
                device_reads_zeros: false,
            },
            2,
            false,
        ),
    ] {
        let what = format!("{mode:?} v{version} cheap zeroes {cheap_zeroes}");
        let exec: Exec<MemDevice> = Exec::new();
        let dev = MemDevice::fixed(vec![0xab; dev_len], dev_len);
        dev.0.borrow_mut().cheap_zeroes = cheap_zeroes;
        let id = exec.add_device(dev.clone());
        let e2 = exec.clone();
        let opts = CreateOptions {
            size,
            cluster_bits: 12,
            version,
            ..Default::default()
        };
        exec.block_on(async move { create(&e2, id, &opts).await })
            .unwrap();
        let chain = Chain::new(&exec, vec![open_layer(&exec, &dev, true)]).unwrap();
        let c = chain.clone();
        let r = exec.block_on(async move { preallocate(&c, mode).await });
        if version == 2 && matches!(mode, Preallocation::Metadata { .. }) {
            assert!(r.is_err(), "{what}: must be refused");
            continue;
        }
        r.unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(
            dev.0.borrow().zero_writes > 0,
            cheap_zeroes,
            "{what}: zeroed by the device exactly when it zeroes cheaply"
        );
        // Metadata: preallocated zero clusters (nothing written); full: data.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img.qcow2");
        std::fs::write(&path, dev.contents()).unwrap();
        let out = Command::new("qemu-img")
            .args(["map", "--output=json"])
            .arg(&path)
            .output()
            .unwrap();
        let map = String::from_utf8_lossy(&out.stdout);
        let want = match mode {
            Preallocation::Metadata { .. } => r#""zero": true, "data": false"#,
            Preallocation::Full => r#""zero": false, "data": true"#,
        };
        assert!(
            out.status.success() && map.lines().all(|l| l.contains(want)),
            "{what}: {map}"
        );
        // Reopen, read everything (zeros), write a little, close.
        let chain = Chain::new(&exec, vec![open_layer(&exec, &dev, true)]).unwrap();
        let buf = HeapBuf::new(size as usize);
        let (c, b) = (chain.clone(), buf.clone());
        exec.block_on(async move { c.read(0, BufSlice::whole(b)).await })
            .unwrap();
        assert!(
            buf.to_vec().iter().all(|&x| x == 0),
            "{what}: old data shows"
        );
        let mut reference = vec![0u8; size as usize];
        for (off, len, byte) in [
            (4096u64, 4096u64, 1u8),
            (100_352, 5120, 2),
            (7 << 20, 65536, 3),
        ] {
            reference[off as usize..(off + len) as usize].fill(byte);
            let b = HeapBuf::new(len as usize);
            b.copy_in(0, &vec![byte; len as usize]);
            let c = chain.clone();
            exec.block_on(async move { c.write(off, BufSlice::whole(b)).await })
                .unwrap();
        }
        let c = chain.clone();
        exec.block_on(async move { c.close().await }).unwrap();
        let check = check_and_compare(dir.path(), &dev.contents(), &reference, &what);
        assert!(
            check.contains("100.00% allocated"),
            "{what}: not fully allocated: {check}"
        );
    }
}

#[test]
fn lazy_refcounts_64k() {
    run(Setup {
        lazy: true,
        cluster_bits: 16,
        extended_l2: false,
        refcount_order: 4,
        backing: false,
        size: 32 << 20,
        ops: 300,
        seed: 78,
    });
}

#[test]
fn lazy_refcounts_set_the_dirty_bit_until_close() {
    let exec: Exec<MemDevice> = Exec::new();
    let dev = MemDevice::new(Vec::new());
    let id = exec.add_device(dev.clone());
    let e2 = exec.clone();
    let opts = CreateOptions {
        size: 8 << 20,
        lazy_refcounts: true,
        ..Default::default()
    };
    exec.block_on(async move { create(&e2, id, &opts).await })
        .unwrap();
    let chain = Chain::new(&exec, vec![open_layer(&exec, &dev, true)]).unwrap();
    let dirty = |d: &MemDevice| d.contents()[72 + 7] & 1 != 0;
    let c = chain.clone();
    exec.block_on(async move {
        c.write(0, BufSlice::whole(HeapBuf::new(65536))).await?;
        c.flush().await
    })
    .unwrap();
    assert!(
        dirty(&dev),
        "lazy refcounts: the dirty bit must be set once L2 relies on it"
    );
    // Reopening the dirty image for writing repairs it (a second executor, as after a crash).
    let exec2: Exec<MemDevice> = Exec::new();
    let copy = MemDevice::new(dev.contents());
    let c2 = Chain::new(&exec2, vec![open_layer(&exec2, &copy, true)]).unwrap();
    assert!(
        !dirty(&copy),
        "opening a dirty image for writing repairs it first"
    );
    exec2.block_on(async move { c2.close().await }).unwrap();
    let c = chain.clone();
    exec.block_on(async move { c.close().await }).unwrap();
    assert!(!dirty(&dev), "close clears the dirty bit");
}

#[test]
fn compat_0_10_discard_deallocates() {
    // Version 2 images have no zero flag; a discard without a backing image frees whole
    // clusters (they read as zeros), as QEMU does.
    let exec: Exec<MemDevice> = Exec::new();
    let dev = MemDevice::new(Vec::new());
    let id = exec.add_device(dev.clone());
    let e2 = exec.clone();
    let opts = CreateOptions {
        size: 4 << 20,
        version: 2,
        ..Default::default()
    };
    exec.block_on(async move { create(&e2, id, &opts).await })
        .unwrap();
    let chain = Chain::new(&exec, vec![open_layer(&exec, &dev, true)]).unwrap();
    let c = chain.clone();
    let buf = HeapBuf::new(256 << 10);
    buf.fill(0, 256 << 10, 0x77);
    let read = HeapBuf::new(256 << 10);
    let r2 = read.clone();
    exec.block_on(async move {
        c.write(0, BufSlice::whole(buf)).await?;
        c.discard(0, 128 << 10).await?;
        c.read(0, BufSlice::whole(r2)).await?;
        c.close().await
    })
    .unwrap();
    let data = read.to_vec();
    assert!(data[..128 << 10].iter().all(|&b| b == 0));
    assert!(data[128 << 10..].iter().all(|&b| b == 0x77));
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("v2.qcow2");
    std::fs::write(&img, dev.contents()).unwrap();
    let out = Command::new("qemu-img")
        .args(["check", "-f", "qcow2"])
        .arg(&img)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = Command::new("qemu-img")
        .args(["map", "--output=json", "-f", "qcow2"])
        .arg(&img)
        .output()
        .unwrap();
    let map: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        map[0]["present"], false,
        "discarded clusters are unallocated: {map}"
    );
}

/// Many allocating writes in flight at once, several into the same unallocated clusters
/// (distinct sectors): none may be lost, whatever order the allocations commit in.
fn concurrent_same_cluster(extended_l2: bool, backing: bool) {
    let exec: Exec<MemDevice> = Exec::new();
    let size = 4u64 << 20;
    let mut reference = vec![0u8; size as usize];
    let mut layers = Vec::new();
    let dev = MemDevice::new(Vec::new());
    let id = exec.add_device(dev.clone());
    let e2 = exec.clone();
    let opts = CreateOptions {
        size,
        extended_l2,
        ..Default::default()
    };
    exec.block_on(async move { create(&e2, id, &opts).await })
        .unwrap();
    layers.push(open_layer(&exec, &dev, true));
    if backing {
        let mut rng = Rng(5);
        let data: Vec<u8> = (0..size).map(|_| rng.next() as u8).collect();
        reference.copy_from_slice(&data);
        let raw = MemDevice::new(data);
        let rid = exec.add_device(raw);
        layers.push(Layer::Raw { dev: rid, size });
    }
    let chain = Chain::new(&exec, layers).unwrap();
    dev.0.borrow_mut().latency_polls = 7;
    let mut rng = Rng(9);
    // 4 clusters × 16 sectors of 4 KiB, in a random order, all submitted at once.
    let mut slots: Vec<u64> = (0..64).collect();
    for i in (1..slots.len()).rev() {
        slots.swap(i, rng.below(i as u64 + 1) as usize);
    }
    for (tag, s) in slots.iter().enumerate() {
        let off = (s / 16) * 65536 + (s % 16) * 4096;
        let data: Vec<u8> = (0..4096).map(|_| rng.next() as u8).collect();
        reference[off as usize..off as usize + 4096].copy_from_slice(&data);
        let buf = HeapBuf::new(4096);
        buf.copy_in(0, &data);
        host::write(&chain, tag as u64, off, BufSlice::whole(buf));
    }
    let mut done = 0;
    while done < 64 {
        exec.poll(&mut |_, r| {
            r.unwrap();
            done += 1;
        });
    }
    let read = HeapBuf::new(size as usize);
    let (c, r2) = (chain.clone(), read.clone());
    exec.block_on(async move {
        c.read(0, BufSlice::whole(r2)).await?;
        c.close().await
    })
    .unwrap();
    assert!(read.to_vec() == reference, "a concurrent write was lost");
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("c.qcow2");
    std::fs::write(&img, dev.contents()).unwrap();
    if !backing {
        let out = Command::new("qemu-img")
            .args(["check", "-f", "qcow2"])
            .arg(&img)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

#[test]
fn concurrent_allocations_of_the_same_clusters() {
    concurrent_same_cluster(false, false);
}

#[test]
fn concurrent_allocations_extended_l2() {
    concurrent_same_cluster(true, false);
}

#[test]
fn concurrent_cow_from_backing() {
    concurrent_same_cluster(false, true);
    concurrent_same_cluster(true, true);
}

#[test]
fn l2_entry_into_metadata_is_refused_and_marks_corrupt() {
    let exec: Exec<MemDevice> = Exec::new();
    let dev = MemDevice::new(Vec::new());
    let id = exec.add_device(dev.clone());
    let e2 = exec.clone();
    let opts = CreateOptions {
        size: 4 << 20,
        ..Default::default()
    };
    exec.block_on(async move { create(&e2, id, &opts).await })
        .unwrap();
    let chain = Chain::new(&exec, vec![open_layer(&exec, &dev, true)]).unwrap();
    let c = chain.clone();
    exec.block_on(async move {
        c.write(0, BufSlice::whole(HeapBuf::new(4096))).await?;
        c.close().await
    })
    .unwrap();
    drop(chain);
    // Point guest cluster 0 at the L1 table (COPIED, so it looks writable in place).
    let mut img = dev.contents();
    let be = |b: &[u8], o: usize| u64::from_be_bytes(b[o..o + 8].try_into().unwrap());
    let l1 = be(&img, 40);
    let l2 = be(&img, l1 as usize) & 0x00ff_ffff_ffff_fe00;
    img[l2 as usize..l2 as usize + 8].copy_from_slice(&(l1 | 1 << 63).to_be_bytes());
    let l1_before = img[l1 as usize..l1 as usize + 512].to_vec();
    let exec: Exec<MemDevice> = Exec::new();
    let dev = MemDevice::new(img);
    let chain = Chain::new(&exec, vec![open_layer(&exec, &dev, true)]).unwrap();
    let c = chain.clone();
    let buf = HeapBuf::new(4096);
    buf.fill(0, 4096, 0xee);
    let r = exec.block_on(async move { c.write(0, BufSlice::whole(buf)).await });
    assert!(
        matches!(r, Err(qcow2_engine::Error::Corrupt { .. })),
        "{r:?}"
    );
    let after = dev.contents();
    assert_eq!(
        after[l1 as usize..l1 as usize + 512],
        l1_before[..],
        "the L1 table was overwritten"
    );
    assert!(after[72 + 7] & 2 != 0, "the corrupt bit is set on disk");
    // A corrupt image opens read-only only.
    let e2 = exec.clone();
    let id = exec.add_device(dev.clone());
    let r = exec.block_on(async move {
        Qcow2::open(
            &e2,
            id,
            OpenOptions {
                writable: true,
                ..Default::default()
            },
        )
        .await
    });
    assert!(matches!(r, Err(qcow2_engine::Error::MarkedCorrupt)));
}
