//! `qcow2 measure` against `qemu-img measure`: the same numbers (human and JSON), for new
//! images of several sizes and layouts, for existing images with data, bitmaps, backing
//! files, raw input, and the same errors.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use std::process::Command;

mod common;
use common::{output, qemu_img, qemu_io, s};

const QCOW2: &str = env!("CARGO_BIN_EXE_qcow2");

/// `qcow2 measure ARGS` and `qemu-img measure ARGS` print the same and exit alike;
/// returns our stdout.
fn same(args: &[&str]) -> String {
    let ours = output(Command::new(QCOW2).arg("measure").args(args));
    let theirs = output(Command::new("qemu-img").arg("measure").args(args));
    let text = |o: &std::process::Output| String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(
        (text(&ours), ours.status.code()),
        (text(&theirs), theirs.status.code()),
        "measure {args:?}: ours (stderr {}) vs qemu-img (stderr {})",
        String::from_utf8_lossy(&ours.stderr),
        String::from_utf8_lossy(&theirs.stderr)
    );
    text(&ours)
}

#[test]
fn new_images_of_every_layout() {
    for size in ["0", "1", "512", "1M", "1000000", "1G", "100G", "3T", "1P"] {
        for opts in [
            "",
            "cluster_size=512",
            "cluster_size=4k",
            "cluster_size=2M",
            "cluster_size=16k,extended_l2=on",
            "extended_l2=on",
            "refcount_bits=1",
            "refcount_bits=64,cluster_size=8k",
            "compat=0.10",
            "preallocation=metadata",
            "preallocation=full,cluster_size=1M",
            "preallocation=falloc",
        ] {
            for out in ["human", "json"] {
                let mut args = vec!["--size", size, "-O", "qcow2", "--output", out];
                if !opts.is_empty() {
                    args.extend(["-o", opts]);
                }
                same(&args);
            }
        }
        same(&["--size", size]);
        same(&["--size", size, "-O", "raw", "--output=json"]);
    }
}

#[test]
fn existing_images_with_data_bitmaps_and_backing() {
    let d = tempfile::tempdir().unwrap();
    let img = d.path().join("img");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "cluster_size=32k",
        s(&img),
        "100M",
    ]);
    qemu_io(
        &img,
        &[
            "write -P 1 0 4k",
            "write -P 2 1M 100k",
            "write -P 3 50000000 3000000",
            "write -z 70M 1M",
            "write -P 0 80M 64k",
            "write -P 4 104857088 512",
        ],
    );
    let zip = d.path().join("zip");
    qemu_img(&["convert", "-c", "-O", "qcow2", s(&img), s(&zip)]);
    let raw = d.path().join("raw");
    qemu_img(&["convert", "-O", "raw", s(&img), s(&raw)]);
    let check = |extra: &[&str]| {
        for opts in [
            "",
            "cluster_size=4k",
            "cluster_size=2M",
            "extended_l2=on",
            "compat=0.10",
        ] {
            for target in ["qcow2", "raw"] {
                for out in ["human", "json"] {
                    let mut args = vec!["-O", target, "--output", out];
                    if !opts.is_empty() && target == "qcow2" {
                        args.extend(["-o", opts]);
                    }
                    args.extend(extra);
                    same(&args);
                }
            }
        }
    };
    check(&[s(&img)]);
    check(&[s(&zip)]);
    check(&["-f", "raw", s(&raw)]);
    check(&["-o", "backing_file=x.qcow2", s(&img)]);
    check(&["-o", "preallocation=full", s(&img)]);
    // Bitmaps, enabled and disabled, of several granularities and names.
    qemu_img(&["bitmap", "--add", "-g", "512", s(&img), "fine"]);
    qemu_img(&[
        "bitmap",
        "--add",
        "--disable",
        s(&img),
        "a-longer-name-of-a-bitmap",
    ]);
    qemu_img(&["bitmap", "--add", "-g", "2M", s(&img), "coarse"]);
    let text = same(&["-O", "qcow2", s(&img)]);
    assert!(text.contains("bitmaps size: "), "{text}");
    check(&[s(&img)]);
    // An overlay: its chain is measured through (our tool needs --allow-backing).
    let top = d.path().join("top");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "img",
        "-F",
        "qcow2",
        s(&top),
    ]);
    qemu_io(&top, &["write -P 9 90M 1M"]);
    let theirs = qemu_img(&["measure", "-O", "qcow2", s(&top)]);
    let ours =
        output(Command::new(QCOW2).args(["measure", "-O", "qcow2", "--allow-backing", s(&top)]));
    assert_eq!(ours.stdout, theirs.stdout);
    // Without it, refused rather than measured wrongly.
    let ours = output(Command::new(QCOW2).args(["measure", "-O", "qcow2", s(&top)]));
    assert_eq!(ours.status.code(), Some(1));
}

#[test]
fn errors_as_qemu_img() {
    let d = tempfile::tempdir().unwrap();
    let img = d.path().join("img");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&img), "1M"]);
    let missing = d.path().join("missing");
    for args in [
        vec![],
        vec!["--size", "1G", s(&img)],
        vec!["-O", "qcow2", s(&img), s(&img)],
        vec!["--size", "1x", "-O", "qcow2"],
        vec!["--size", "1G", "-O", "qcow2", "-o", "cluster_size=3k"],
        vec![
            "--size",
            "1G",
            "-O",
            "qcow2",
            "-o",
            "cluster_size=4k,extended_l2=on",
        ],
        vec!["--size", "1T", "-O", "qcow2", "-o", "cluster_size=512"],
        vec![
            "--size",
            "1G",
            "-O",
            "qcow2",
            "-o",
            "compat=0.10,refcount_bits=8",
        ],
        vec!["-O", "qcow2", s(&missing)],
    ] {
        let ours = output(Command::new(QCOW2).arg("measure").args(&args));
        let theirs = output(Command::new("qemu-img").arg("measure").args(&args));
        assert_eq!(ours.status.code(), Some(1), "{args:?}: {ours:?}");
        assert_eq!(theirs.status.code(), Some(1), "{args:?}");
        assert!(ours.stdout.is_empty());
        let err = String::from_utf8_lossy(&ours.stderr);
        assert!(err.starts_with("qcow2: "), "{err}");
    }
    // A raw file named as qcow2 is refused, never probed; a truncated qcow2 header too.
    let raw = d.path().join("raw");
    std::fs::write(&raw, vec![1u8; 4096]).unwrap();
    let ours = output(Command::new(QCOW2).args(["measure", "-O", "qcow2", s(&raw)]));
    assert_eq!(ours.status.code(), Some(1));
    let cut = d.path().join("cut");
    std::fs::write(&cut, &std::fs::read(&img).unwrap()[..80]).unwrap();
    let ours = output(Command::new(QCOW2).args(["measure", "-O", "qcow2", s(&cut)]));
    assert_eq!(ours.status.code(), Some(1));
}
