//! Thin stays thin: clusters an image frees give their space back to the image file (holes
//! punched), side by side with QEMU doing the same on a copy, under QEMU's switches
//! (`--pass-discard-request|snapshot|other`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{qemu_img, qemu_io, run, s};

const QCOW2: &str = env!("CARGO_BIN_EXE_qcow2");
const CLUSTER: u64 = 64 << 10;
const MIB: u64 = 1 << 20;

/// Bytes the file takes on its file system (`st_blocks`).
fn allocated(p: &Path) -> u64 {
    std::fs::metadata(p).unwrap().blocks() * 512
}

/// `qcow2 ARGS`, which must succeed.
fn qcow2(args: &[&str]) {
    run(Command::new(QCOW2).args(args));
}

/// `qcow2 io [EXTRA] -c CMD... IMG`, which must succeed.
fn ours_io(img: &Path, extra: &[&str], cmds: &[&str]) {
    let mut c = Command::new(QCOW2);
    c.arg("io").args(extra);
    for cmd in cmds {
        c.arg("-c").arg(cmd);
    }
    run(c.arg(img));
}

/// Two fresh 64 MiB images (QEMU's and ours) in `dir`.
fn pair(dir: &tempfile::TempDir) -> (PathBuf, PathBuf) {
    let (q, o) = (dir.path().join("qemu.qcow2"), dir.path().join("ours.qcow2"));
    for p in [&q, &o] {
        qemu_img(&["create", "-q", "-f", "qcow2", s(p), "64M"]);
    }
    (q, o)
}

/// Ours is as thin as QEMU's: at most twice its allocation and a few clusters.
fn about_as_thin(ours: &Path, qemu: &Path, what: &str) {
    let (o, q) = (allocated(ours), allocated(qemu));
    eprintln!("{what}: ours {o} bytes allocated, QEMU's {q}");
    assert!(
        o <= 2 * q + 4 * CLUSTER,
        "{what}: ours keeps {o} bytes allocated, QEMU's {q}"
    );
}

#[test]
fn discarded_data_gives_the_file_its_space_back_as_with_qemu_io() {
    let dir = tempfile::tempdir().unwrap();
    let (q, o) = pair(&dir);
    let cmds = ["write -P 0x5a 0 32M", "discard 0 32M"];
    qemu_io(&q, &cmds);
    ours_io(&o, &[], &cmds[..1]);
    assert!(allocated(&o) >= 32 * MIB, "the data took its space first");
    ours_io(&o, &[], &cmds[1..]);
    about_as_thin(&o, &q, "write 32M, discard 32M");
    qemu_img(&["check", s(&o)]);
    qemu_img(&["compare", s(&o), s(&q)]);
    // The freed clusters are taken again: the file does not grow past its old end.
    let len = std::fs::metadata(&o).unwrap().len();
    ours_io(&o, &[], &["write -P 0x33 16M 16M", "read -P 0x33 16M 16M"]);
    assert!(std::fs::metadata(&o).unwrap().len() <= len);
    qemu_img(&["check", s(&o)]);
}

#[test]
fn write_zeroes_with_unmap_gives_the_space_back_and_without_keeps_it() {
    let dir = tempfile::tempdir().unwrap();
    let (q, o) = pair(&dir);
    let cmds = ["write 0 32M", "write -z 0 16M", "write -z -u 16M 16M"];
    qemu_io(&q, &cmds);
    ours_io(&o, &[], &cmds);
    about_as_thin(&o, &q, "write 32M, zero 16M, zero+unmap 16M");
    let a = allocated(&o);
    assert!(a < 24 * MIB, "the unmapped half was given back ({a} bytes)");
    qemu_img(&["check", s(&o)]);
    qemu_img(&["compare", s(&o), s(&q)]);
}

#[test]
fn switched_off_the_file_keeps_its_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let (_, o) = pair(&dir);
    ours_io(
        &o,
        &["--pass-discard-request", "off"],
        &["write 0 32M", "discard 0 32M", "read -P 0 0 32M"],
    );
    let a = allocated(&o);
    assert!(a >= 32 * MIB, "discards were passed: {a} bytes allocated");
    qemu_img(&["check", s(&o)]);
    // A bad value is a usage error that leaves the image alone.
    let out = Command::new(QCOW2)
        .args([
            "io",
            "--pass-discard-request",
            "maybe",
            "-c",
            "discard 0 1M",
        ])
        .arg(&o)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert_eq!(allocated(&o), a);
}

#[test]
fn snapshot_deletion_gives_the_space_back_as_with_qemu_img() {
    let dir = tempfile::tempdir().unwrap();
    let (q, o) = pair(&dir);
    for p in [&q, &o] {
        qemu_io(p, &["write -P 0x11 0 16M"]);
        qemu_img(&["snapshot", "-c", "s1", s(p)]);
        // Overwritten: the old clusters are the snapshot's alone.
        qemu_io(p, &["write -P 0x22 0 16M"]);
    }
    assert!(allocated(&o) >= 32 * MIB);
    qemu_img(&["snapshot", "-d", "s1", s(&q)]);
    qcow2(&["snapshot", "-d", "s1", s(&o)]);
    about_as_thin(&o, &q, "snapshot of 16M deleted after an overwrite");
    let a = allocated(&o);
    assert!(
        a < 20 * MIB,
        "the snapshot's clusters were given back ({a} bytes)"
    );
    qemu_img(&["check", s(&o)]);
    qemu_img(&["compare", s(&o), s(&q)]);

    // Switched off, the file keeps them.
    let p = dir.path().join("kept.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&p), "64M"]);
    qemu_io(&p, &["write -P 0x11 0 16M"]);
    qemu_img(&["snapshot", "-c", "s1", s(&p)]);
    qemu_io(&p, &["write -P 0x22 0 16M"]);
    qcow2(&[
        "snapshot",
        "--pass-discard-snapshot",
        "off",
        "-d",
        "s1",
        s(&p),
    ]);
    assert!(allocated(&p) >= 32 * MIB);
    qemu_img(&["check", s(&p)]);
}
