//! Helpers shared by the tool's integration tests: running commands and the QEMU oracle.

#![allow(dead_code)] // each test crate uses its own subset

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, Output};

/// `p` as a `&str` (test paths are UTF-8).
pub fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// Runs `cmd` and returns its output (whatever the exit status).
pub fn output(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// Runs `cmd`, which must succeed.
pub fn run(cmd: &mut Command) -> Output {
    let out = output(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    out
}

/// `qemu-img ARGS`, which must succeed.
pub fn qemu_img(args: &[&str]) -> Output {
    run(Command::new("qemu-img").args(args))
}

/// `qemu-io -f qcow2 -c CMD... IMG`, which must succeed.
pub fn qemu_io(img: &std::path::Path, cmds: &[&str]) {
    let mut c = Command::new("qemu-io");
    c.arg("-f").arg("qcow2");
    for cmd in cmds {
        c.arg("-c").arg(cmd);
    }
    run(c.arg(img));
}

/// `qemu-io -f FMT -c CMD... IMG`, which must succeed and print no error: qemu-io exits 0
/// when a `-c` command fails, so its output is what tells.
pub fn qemu_io_clean<C: AsRef<OsStr>>(img: &Path, fmt: &str, cmds: &[C]) -> Output {
    let mut c = Command::new("qemu-io");
    c.arg("-f").arg(fmt);
    for cmd in cmds {
        c.arg("-c").arg(cmd);
    }
    let out = run(c.arg(img));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        !text.contains("error") && !text.contains("failed"),
        "qemu-io: {text}"
    );
    out
}

/// `qemu-img check IMG` finds nothing (exit status 0).
pub fn assert_check_clean(img: &Path) {
    let out = output(Command::new("qemu-img").arg("check").arg(img));
    assert_eq!(
        out.status.code(),
        Some(0),
        "qemu-img check {}: {}{}",
        img.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `qemu-img compare A B` (formats given) says identical.
pub fn assert_same(a: &Path, fa: &str, b: &Path, fb: &str) {
    let out = output(
        Command::new("qemu-img")
            .args(["compare", "-f", fa, "-F", fb])
            .arg(a)
            .arg(b),
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "qemu-img compare {} {}: {}{}",
        a.display(),
        b.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `qemu-img info`'s bitmaps list of `img` (null without any).
pub fn info_bitmaps(img: &std::path::Path) -> serde_json::Value {
    let out = qemu_img(&["info", "--output=json", img.to_str().expect("utf-8 path")]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    v["format-specific"]["data"]["bitmaps"].clone()
}
