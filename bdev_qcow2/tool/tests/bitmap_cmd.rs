//! `qcow2 bitmap --enable/--disable/--clear/--merge` against `qemu-img bitmap` (`--add`
//! and `--remove`: `bitmap_add_remove.rs`): the same
//! operations on two copies of one image leave the same flags, granularities and bits
//! (as `qemu-nbd` exports them), a clean `qemu-img check`, and the same errors; images
//! changed by one tool are changed further by the other.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
#[path = "common/dirty_ranges.rs"]
mod dirty_ranges;
#[path = "common/holder.rs"]
mod holder;
use common::{info_bitmaps as bitmaps, output, qemu_img, qemu_io, s};
use dirty_ranges::dirty_ranges;
use holder::QemuHolder;

const QCOW2: &str = env!("CARGO_BIN_EXE_qcow2");

/// A 64 MiB image with data and bitmaps `b0` (enabled, 64 KiB), `fine` (enabled, 4 KiB,
/// holding later writes) and `off` (disabled, 512 B, holding other writes); and a copy.
fn pair(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let ours = dir.join("ours.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&ours), "64M"]);
    qemu_io(&ours, &["write -P 1 0 1M"]);
    qemu_img(&["bitmap", "--add", s(&ours), "b0"]);
    qemu_io(&ours, &["write -P 2 3M 100k"]);
    qemu_img(&["bitmap", "--add", "-g", "4k", s(&ours), "fine"]);
    qemu_io(&ours, &["write -P 3 10000000 5000", "write -z 20M 1M"]);
    qemu_img(&["bitmap", "--add", "-g", "512", s(&ours), "off"]);
    qemu_io(&ours, &["write -P 4 40M 3000"]);
    qemu_img(&["bitmap", "--disable", s(&ours), "off"]);
    qemu_io(&ours, &["write -P 5 50M 64k"]);
    let theirs = dir.join("theirs.qcow2");
    std::fs::copy(&ours, &theirs).unwrap();
    let other = dir.join("other.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&other), "64M"]);
    qemu_img(&["bitmap", "--add", "-g", "16k", s(&other), "src"]);
    qemu_io(&other, &["write -P 6 33M 200k", "write -P 7 63M 1M"]);
    (ours, theirs, other)
}

/// Runs the same `bitmap` arguments (`IMG` standing for the image) with both tools.
fn both(ours: &Path, theirs: &Path, args: &[&str]) {
    let with = |img: &Path| -> Vec<String> {
        args.iter()
            .map(|a| {
                if *a == "IMG" {
                    s(img).to_string()
                } else {
                    a.to_string()
                }
            })
            .collect()
    };
    let o = output(Command::new(QCOW2).arg("bitmap").args(with(ours)));
    assert!(o.status.success(), "ours {args:?}: {o:?}");
    qemu_img(
        &[
            &["bitmap"],
            &with(theirs).iter().map(String::as_str).collect::<Vec<_>>()[..],
        ]
        .concat(),
    );
}

/// Both images alike: flags, granularities, every bitmap's bits; clean.
fn alike(ours: &Path, theirs: &Path) {
    let out = qemu_img(&["check", s(ours)]);
    assert!(out.status.success());
    let (a, b) = (bitmaps(ours), bitmaps(theirs));
    assert_eq!(a, b);
    for bm in a.as_array().unwrap() {
        let name = bm["name"].as_str().unwrap();
        assert!(
            bm["flags"]
                .as_array()
                .unwrap()
                .iter()
                .all(|f| f != "in-use"),
            "{a}"
        );
        assert_eq!(
            dirty_ranges(ours, name),
            dirty_ranges(theirs, name),
            "bitmap {name}"
        );
    }
}

#[test]
fn enable_disable_clear_merge_as_qemu_img() {
    let d = tempfile::tempdir().unwrap();
    let (ours, theirs, other) = pair(d.path());
    assert!(!dirty_ranges(&ours, "fine").is_empty());
    both(&ours, &theirs, &["--disable", "IMG", "b0"]);
    both(&ours, &theirs, &["--enable", "IMG", "off"]);
    alike(&ours, &theirs);
    // Writes after: recorded by the enabled ones only (ours through our own io).
    run_io(&ours, "write -P 8 60M 8k");
    qemu_io(&theirs, &["write -P 8 60M 8k"]);
    alike(&ours, &theirs);
    // Merges across granularities, within the image and from another one.
    both(&ours, &theirs, &["--merge", "fine", "IMG", "b0"]);
    both(&ours, &theirs, &["--merge", "b0", "IMG", "off"]);
    both(
        &ours,
        &theirs,
        &[
            "--merge",
            "src",
            "-b",
            s(&other),
            "-F",
            "qcow2",
            "IMG",
            "fine",
        ],
    );
    alike(&ours, &theirs);
    both(&ours, &theirs, &["--clear", "--enable", "IMG", "b0"]);
    alike(&ours, &theirs);
    assert!(dirty_ranges(&ours, "b0").is_empty());
    // qemu-img goes on with what we left, and we with what it left.
    qemu_img(&["bitmap", "--add", s(&ours), "new"]);
    qemu_img(&["bitmap", "--remove", s(&ours), "fine"]);
    qemu_img(&["bitmap", "--add", s(&theirs), "new"]);
    qemu_img(&["bitmap", "--remove", s(&theirs), "fine"]);
    run_io(&ours, "write -P 9 5M 4k");
    qemu_io(&theirs, &["write -P 9 5M 4k"]);
    both(&ours, &theirs, &["--merge", "new", "IMG", "off"]);
    both(&ours, &theirs, &["--disable", "IMG", "new"]);
    alike(&ours, &theirs);
}

fn run_io(img: &Path, cmd: &str) {
    let o = output(Command::new(QCOW2).args(["io", "-c", cmd, s(img)]));
    assert!(o.status.success(), "{o:?}");
}

#[test]
fn errors_leave_the_image_as_it_was() {
    let d = tempfile::tempdir().unwrap();
    let (ours, theirs, _) = pair(d.path());
    let small = d.path().join("small.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&small), "32M"]);
    qemu_img(&["bitmap", "--add", s(&small), "src"]);
    let missing = d.path().join("missing");
    for args in [
        vec!["--enable", s(&ours), "nosuch"],
        vec!["--merge", "nosuch", s(&ours), "b0"],
        vec!["--clear", s(&missing), "b0"],
        vec!["--merge", "src", "-b", s(&small), s(&ours), "b0"],
        vec![s(&ours), "b0"],
        vec!["-g", "64k", "--clear", s(&ours), "b0"],
        vec!["--add", s(&ours), "b0"],
        vec!["--remove", s(&ours), "nosuch"],
        vec!["--add", "--remove", s(&ours), "fine"],
        vec!["--enable", "-f", "raw", s(&ours), "b0"],
    ] {
        let o = output(Command::new(QCOW2).arg("bitmap").args(&args));
        assert_eq!(o.status.code(), Some(1), "{args:?}: {o:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.starts_with("qcow2: "), "{err}");
        // qemu-img refuses the same.
        if !args.contains(&"raw") {
            let theirs_args: Vec<&str> = args
                .iter()
                .map(|a| if *a == s(&ours) { s(&theirs) } else { a })
                .collect();
            let t = output(Command::new("qemu-img").arg("bitmap").args(&theirs_args));
            assert_eq!(t.status.code(), Some(1), "{theirs_args:?}");
        }
    }
    let err = output(Command::new(QCOW2).args(["bitmap", "--enable", s(&ours), "nosuch"]));
    assert_eq!(
        String::from_utf8_lossy(&err.stderr),
        "qcow2: Operation enable on bitmap nosuch failed: Dirty bitmap 'nosuch' not found\n"
    );
    alike(&ours, &theirs);
    // An image qemu-io has open for writing is refused, untouched.
    let holder = QemuHolder::open(&ours, false);
    let o = output(Command::new(QCOW2).args(["bitmap", "--clear", s(&ours), "b0"]));
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("lock"), "{o:?}");
    holder.close();
    alike(&ours, &theirs);
    // A bitmap left in use (a writer that never closed): refused as QEMU refuses it.
    let mut bytes = std::fs::read(&ours).unwrap();
    let flags = find_in_use_flag(&ours, &bytes);
    bytes[flags + 3] |= 1;
    std::fs::write(&ours, &bytes).unwrap();
    let o = output(Command::new(QCOW2).args(["bitmap", "--clear", s(&ours), "b0"]));
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("inconsistent"),
        "{o:?}"
    );
}

/// The byte offset of bitmap `b0`'s flags field (the first directory entry) in `bytes`.
fn find_in_use_flag(img: &Path, bytes: &[u8]) -> usize {
    let out = qemu_img(&["info", "--output=json", s(img)]);
    let _: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // The bitmaps extension (type 0x23852875) names the directory's offset.
    let magic = 0x2385_2875u32.to_be_bytes();
    let at = bytes.windows(4).position(|w| w == magic).unwrap();
    let dir = u64::from_be_bytes(bytes[at + 24..at + 32].try_into().unwrap()) as usize;
    // Entry: table offset (8), table size (4), flags (4), …
    dir + 12
}
