//! Deep backing chains through the tool (`--allow-backing`): a chain of a thousand images
//! opens and reads as its bottom image; a loop of two images and a chain one image deeper
//! than the limit are refused with a clear error.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

mod common;

use common::{output, qemu_img, qemu_io, run};
use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::limits::MAX_BACKING_DEPTH;
use qcow2_engine::testing::MemDevice;
use qcow2_engine::Exec;
use std::path::{Path, PathBuf};
use std::process::Command;

const QCOW2: &str = env!("CARGO_BIN_EXE_qcow2");

/// Writes `n` empty overlays of `size` bytes above `bottom` (in its directory), each backed
/// by the one below by file name; returns the top.
fn overlays(bottom: &Path, size: u64, n: usize) -> PathBuf {
    let dir = bottom.parent().unwrap();
    let mut below = bottom.file_name().unwrap().to_string_lossy().into_owned();
    let mut top = bottom.to_path_buf();
    for i in 1..=n {
        let dev = MemDevice::new(Vec::new());
        let exec: Exec<MemDevice> = Exec::new();
        let id = exec.add_device(dev.clone());
        let opts = CreateOptions {
            size,
            backing_file: Some(below.clone()),
            backing_format: Some("qcow2".into()),
            ..CreateOptions::default()
        };
        let e2 = exec.clone();
        exec.block_on(async move { create(&e2, id, &opts).await })
            .unwrap();
        below = format!("o{i:05}.qcow2");
        top = dir.join(&below);
        std::fs::write(&top, dev.contents()).unwrap();
    }
    top
}

#[test]
fn chain_of_1000_reads_as_its_bottom_image() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.qcow2");
    let s = base.to_str().unwrap();
    qemu_img(&["create", "-q", "-f", "qcow2", s, "8M"]);
    qemu_io(&base, &["write -P 0x3c 0 3M", "write -P 0x7e 5M 1M"]);
    let top = overlays(&base, 8 << 20, 999);
    let out = dir.path().join("out.raw");
    run(Command::new(QCOW2)
        .args(["convert", "--allow-backing", "-O", "raw"])
        .arg(&top)
        .arg(&out));
    let expect = dir.path().join("base.raw");
    qemu_img(&["convert", "-O", "raw", s, expect.to_str().unwrap()]);
    assert!(std::fs::read(&out).unwrap() == std::fs::read(&expect).unwrap());
    // The chain as qemu-img reads it too.
    let out = run(Command::new(QCOW2)
        .args(["compare", "--allow-backing", "-F", "qcow2"])
        .arg(&top)
        .arg(&base));
    assert!(out.status.success());
}

#[test]
fn loop_and_chain_over_the_limit_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.qcow2");
    let b = dir.path().join("b.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", a.to_str().unwrap(), "1M"]);
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-F",
        "qcow2",
        "-b",
        "a.qcow2",
        b.to_str().unwrap(),
    ]);
    qemu_img(&[
        "rebase",
        "-u",
        "-F",
        "qcow2",
        "-b",
        "b.qcow2",
        a.to_str().unwrap(),
    ]);
    let out = output(Command::new(QCOW2).args(["map", "--allow-backing"]).arg(&b));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("loop") && err.contains("b.qcow2"), "{err}");

    let base = dir.path().join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", base.to_str().unwrap(), "1M"]);
    let top = overlays(&base, 1 << 20, MAX_BACKING_DEPTH);
    let out = output(
        Command::new(QCOW2)
            .args(["map", "--allow-backing"])
            .arg(&top),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(&format!("deeper than {MAX_BACKING_DEPTH} images")),
        "{err}"
    );
}
