//! Persistent dirty bitmaps (QEMU's incremental backup) through the `qcow2` tool against
//! QEMU: the same writes on two copies of one image, one by `qcow2 io`, one by `qemu-io`,
//! must leave the same bits in every bitmap, as `qemu-nbd` exports them; the image stays
//! clean and its bitmaps consistent. What would break a bitmap is refused.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;
#[path = "common/dirty_ranges.rs"]
mod dirty_ranges;
use common::{output, qemu_img, qemu_io, run, s};
use dirty_ranges::dirty_ranges as dirty;

const QCOW2: &str = env!("CARGO_BIN_EXE_qcow2");

fn ours_io(img: &Path, cmds: &[&str]) {
    let mut c = Command::new(QCOW2);
    c.arg("io");
    for cmd in cmds {
        c.arg("-c").arg(cmd);
    }
    run(c.arg(img));
}

/// Each bitmap's name and flags, as `qemu-img info` lists them.
fn bitmap_flags(img: &Path) -> Vec<(String, Vec<String>)> {
    let out = qemu_img(&["info", "--output=json", "-U", s(img)]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let list = v["format-specific"]["data"]["bitmaps"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    list.iter()
        .map(|b| {
            let flags = b["flags"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| f.as_str().unwrap().to_string())
                .collect();
            (b["name"].as_str().unwrap().to_string(), flags)
        })
        .collect()
}

struct Pair {
    _dir: tempfile::TempDir,
    ours: PathBuf,
    qemu: PathBuf,
}

/// A 64 MiB image with an enabled bitmap `b0` (64 KiB granules), an enabled `fine` (4 KiB)
/// and a disabled `old` holding earlier writes; two copies of it.
fn pair() -> Pair {
    let dir = tempfile::tempdir().unwrap();
    let ours = dir.path().join("ours.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&ours), "64M"]);
    qemu_io(&ours, &["write -P 9 0 8M"]);
    qemu_img(&["bitmap", "--add", s(&ours), "old"]);
    qemu_io(&ours, &["write -P 7 30M 192k"]);
    qemu_img(&["bitmap", "--disable", s(&ours), "old"]);
    qemu_img(&["bitmap", "--add", s(&ours), "b0"]);
    qemu_img(&["bitmap", "--add", "-g", "4096", s(&ours), "fine"]);
    let qemu = dir.path().join("qemu.qcow2");
    std::fs::copy(&ours, &qemu).unwrap();
    Pair {
        _dir: dir,
        ours,
        qemu,
    }
}

/// The bitmaps `qcow2 info --output=json` lists.
fn ours_info_bitmaps(img: &Path) -> serde_json::Value {
    let out = run(Command::new(QCOW2).args(["info", "--output=json", s(img)]));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["format-specific"]["data"]["bitmaps"].clone()
}

/// Both copies clean, with the same bitmaps, flags and bits.
fn same_bitmaps(p: &Pair) {
    qemu_img(&["check", s(&p.ours)]);
    // `qcow2 info` lists them as `qemu-img info` does.
    let out = qemu_img(&["info", "--output=json", s(&p.ours)]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        ours_info_bitmaps(&p.ours),
        v["format-specific"]["data"]["bitmaps"]
    );
    let flags = bitmap_flags(&p.ours);
    assert_eq!(flags, bitmap_flags(&p.qemu));
    assert!(
        flags.iter().all(|(_, f)| !f.iter().any(|x| x == "in-use")),
        "{flags:?}"
    );
    for (name, _) in &flags {
        let (a, b) = (dirty(&p.ours, name), dirty(&p.qemu, name));
        assert_eq!(a, b, "bitmap {name}: ours {a:x?}, QEMU's {b:x?}");
    }
    run(Command::new("qemu-img").args(["compare", s(&p.ours), s(&p.qemu)]));
}

#[test]
fn writes_zeroes_and_discards_set_the_bits_qemu_sets() {
    let p = pair();
    let first = [
        "write -P 1 0 4k",
        "write -P 2 100k 200k",
        "write -P 3 1000000 1000",
        "write -z 5M 64k",
        "write -z -u 6M 128k",
        "discard 7M 128k",
        // The disk's last bytes.
        "write -P 4 67108352 512",
    ];
    ours_io(&p.ours, &first);
    qemu_io(&p.qemu, &first);
    // 64 KiB granules: 0 to 300k, 1000000, 5M, 6M and 7M (128k each) and the last.
    assert_eq!(
        dirty(&p.ours, "b0"),
        vec![
            (0, 5 << 16),
            (15 << 16, 1 << 16),
            (5 << 20, 1 << 16),
            (6 << 20, 2 << 16),
            (7 << 20, 2 << 16),
            ((64 << 20) - (1 << 16), 1 << 16)
        ]
    );
    assert_eq!(dirty(&p.ours, "old"), vec![(30 << 20, 192 << 10)]);
    same_bitmaps(&p);
    // A second session adds to what the first stored.
    let second = ["write -P 5 40M 64k", "write -P 6 4096 512"];
    ours_io(&p.ours, &second);
    qemu_io(&p.qemu, &second);
    same_bitmaps(&p);
    // Reading only leaves every bitmap as it was.
    let before = dirty(&p.ours, "fine");
    ours_io(&p.ours, &["read 0 1M"]);
    assert_eq!(dirty(&p.ours, "fine"), before);
    same_bitmaps(&p);
}

#[test]
fn bitmaps_follow_a_resize_and_refuse_what_would_break_them() {
    let p = pair();
    // Growing within what the tables cover, then writing past the old end.
    let r = |img: &Path, shrink: bool, size: &str| {
        let mut c = Command::new(QCOW2);
        c.arg("resize");
        if shrink {
            c.arg("--shrink");
        }
        output(c.arg(img).arg(size))
    };
    assert!(r(&p.ours, false, "+64M").status.success());
    qemu_img(&["resize", "-q", s(&p.qemu), "+64M"]);
    ours_io(&p.ours, &["write -P 3 100M 64k"]);
    qemu_io(&p.qemu, &["write -P 3 100M 64k"]);
    same_bitmaps(&p);
    // Shrinking (over no data: ours refuses to cut data off) drops the bits past the new
    // end.
    let cut = [
        "write -P 3 127M 64k",
        "discard 127M 64k",
        "discard 100M 64k",
    ];
    ours_io(&p.ours, &cut);
    qemu_io(&p.qemu, &cut);
    assert!(r(&p.ours, true, "-32M").status.success());
    qemu_img(&["resize", "-q", "--shrink", s(&p.qemu), "-32M"]);
    same_bitmaps(&p);

    // A bitmap of 512-byte granules, whose table's one cluster describes 256 MiB: the
    // disk grows past that (the close stores a larger table), and writes there are marked.
    for img in [&p.ours, &p.qemu] {
        qemu_img(&["bitmap", "--add", "-g", "512", s(img), "tiny"]);
    }
    assert!(r(&p.ours, false, "1G").status.success());
    qemu_img(&["resize", "-q", s(&p.qemu), "1G"]);
    ours_io(
        &p.ours,
        &["write -P 4 900M 64k", "write -P 4 1073741312 512"],
    );
    qemu_io(
        &p.qemu,
        &["write -P 4 900M 64k", "write -P 4 1073741312 512"],
    );
    same_bitmaps(&p);
    // Past 2^32 granules (2 TiB) QEMU cannot hold it: refused, nothing changed.
    let out = r(&p.ours, false, "3T");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("bitmap 'tiny'"),
        "{err}"
    );
    assert_eq!(qemu_img_virtual_size(&p.ours), 1 << 30);
    same_bitmaps(&p);
}

fn qemu_img_virtual_size(img: &Path) -> u64 {
    let out = qemu_img(&["info", "--output=json", s(img)]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["virtual-size"].as_u64().unwrap()
}

#[test]
fn switching_to_a_snapshot_is_refused_while_a_bitmap_is_enabled() {
    let p = pair();
    let snap = |args: &[&str]| output(Command::new(QCOW2).arg("snapshot").args(args).arg(&p.ours));
    assert!(snap(&["-c", "s1"]).status.success());
    ours_io(&p.ours, &["write -P 8 0 64k"]);
    let out = snap(&["-a", "s1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("persistent bitmaps (b0, fine)"),
        "{err}"
    );
    // As QEMU refuses it.
    qemu_img(&["snapshot", "-c", "s1", s(&p.qemu)]);
    let out = output(Command::new("qemu-img").args(["snapshot", "-a", "s1", s(&p.qemu)]));
    assert!(!out.status.success());
    qemu_img(&["check", s(&p.ours)]);
    let b0 = dirty(&p.ours, "b0");
    assert_eq!(b0, vec![(0, 64 << 10)]);
    // Disabled, the bitmaps record nothing: the switch goes ahead.
    qemu_img(&["bitmap", "--disable", s(&p.ours), "b0"]);
    qemu_img(&["bitmap", "--disable", s(&p.ours), "fine"]);
    assert!(snap(&["-a", "s1"]).status.success());
    qemu_img(&["check", s(&p.ours)]);
    assert_eq!(dirty(&p.ours, "b0"), b0);
}

#[test]
fn bitmaps_a_writer_did_not_save_are_left_in_use() {
    // `qemu-io` killed while the image is open for writing leaves `in_use` set.
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("a.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&img), "64M"]);
    qemu_img(&["bitmap", "--add", s(&img), "b0"]);
    let mut c = Command::new("qemu-io")
        .args(["-f", "qcow2", s(&img)])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !bitmap_flags(&img)
        .iter()
        .any(|(_, f)| f.iter().any(|x| x == "in-use"))
    {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "qemu-io did not open the image"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    c.kill().unwrap();
    c.wait().unwrap();
    ours_io(&img, &["write -P 1 0 64k"]);
    assert_eq!(
        bitmap_flags(&img),
        vec![(
            "b0".to_string(),
            vec!["in-use".to_string(), "auto".to_string()]
        )]
    );
    qemu_img(&["check", s(&img)]);
}

/// A bitmap table naming a cluster of other metadata (here the L1 table) would have us
/// rewrite or free it at close: the image is refused for writing, with the reason, and left
/// as it was; it still opens read-only.
#[test]
fn a_bitmap_sharing_a_cluster_with_other_metadata_is_refused_for_writing() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("hostile.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&img), "64M"]);
    qemu_img(&["bitmap", "--add", s(&img), "b0"]);
    qemu_io(&img, &["write -P 1 0 64k"]);
    let mut bytes = std::fs::read(&img).unwrap();
    let be64 = |b: &[u8], at: usize| u64::from_be_bytes(b[at..at + 8].try_into().unwrap());
    let be32 = |b: &[u8], at: usize| u32::from_be_bytes(b[at..at + 4].try_into().unwrap());
    let l1 = be64(&bytes, 40);
    // The bitmaps extension, past the header.
    let mut at = be32(&bytes, 100) as usize;
    let dir_off = loop {
        let (ty, len) = (be32(&bytes, at), be32(&bytes, at + 4) as usize);
        assert_ne!(ty, 0, "no bitmaps extension");
        if ty == 0x2385_2875 {
            break be64(&bytes, at + 8 + 16) as usize;
        }
        at += 8 + len.div_ceil(8) * 8;
    };
    let table = be64(&bytes, dir_off) as usize;
    assert_ne!(be64(&bytes, table), 0, "the bitmap has a data cluster");
    bytes[table..table + 8].copy_from_slice(&l1.to_be_bytes());
    std::fs::write(&img, &bytes).unwrap();
    let out = output(Command::new(QCOW2).args(["io", "-c", "write -P 2 0 4k", s(&img)]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("bitmap cluster is shared"),
        "{err}"
    );
    assert!(std::fs::read(&img).unwrap() == bytes, "the image changed");
    run(Command::new(QCOW2).args(["io", "-c", "read -P 1 0 64k", s(&img)]));
}

/// Bitmaps that would take more memory than the engine keeps for them (one of 512-byte
/// granules over a 1 TiB disk: 2^31 bits) refuse a writable open with the reason.
#[test]
fn bitmaps_too_large_to_keep_are_refused_for_writing() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("big.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&img), "1T"]);
    qemu_img(&["bitmap", "--add", "-g", "512", s(&img), "fine"]);
    let before = std::fs::read(&img).unwrap();
    let out = output(Command::new(QCOW2).args(["io", "-c", "write -P 2 0 4k", s(&img)]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("MiB of memory"),
        "{err}"
    );
    assert!(std::fs::read(&img).unwrap() == before, "the image changed");
}
