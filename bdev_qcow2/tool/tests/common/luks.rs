//! Helpers of the encryption tests: secrets, `--image-opts` strings, qemu-io / qemu-img /
//! `qcow2` runs on encrypted images (every one given both secrets).

#![allow(dead_code)] // each test crate uses its own subset

use crate::common::{output, run};
use std::path::Path;
use std::process::{Command, Output};

/// The `qcow2` binary.
pub const QCOW2: &str = env!("CARGO_BIN_EXE_qcow2");
/// Secret `sec0`.
pub const SECRET: &str = "secret,id=sec0,data=correct horse";
/// Secret `sec1` (a backing image's own key).
pub const SECRET1: &str = "secret,id=sec1,data=battery staple";

/// `--image-opts` of `img` unlocked by secret `key` (`None`: a plain image).
pub fn opts(img: &Path, key: Option<&str>) -> String {
    let mut s = format!("driver=qcow2,file.filename={}", img.display());
    if let Some(k) = key {
        s += &format!(",encrypt.key-secret={k}");
    }
    s
}

/// Both secrets as arguments.
fn objects(c: &mut Command) -> &mut Command {
    c.args(["--object", SECRET, "--object", SECRET1])
}

/// qemu-io on `image_opts`; every command must succeed (patterns verified).
pub fn qemu_io_opts(image_opts: &str, cmds: &[&str]) {
    let mut c = Command::new("qemu-io");
    objects(&mut c).arg("--image-opts").arg(image_opts);
    for x in cmds {
        c.arg("-c").arg(x);
    }
    let out = run(&mut c);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        !text.contains("error") && !text.contains("failed"),
        "qemu-io {image_opts}: {text}"
    );
}

/// `qcow2 ARGS` (whatever the exit status).
pub fn ours(args: &[&str]) -> Output {
    output(Command::new(QCOW2).args(args))
}

/// `qcow2 SUB --object … --object … REST`, which must succeed; its stdout.
pub fn ours_ok(sub: &str, rest: &[&str]) -> String {
    let mut c = Command::new(QCOW2);
    c.arg(sub);
    objects(&mut c).args(rest);
    let out = output(&mut c);
    assert!(
        out.status.success(),
        "qcow2 {sub} {rest:?}: {}{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `qcow2 io` of `cmds` on `image_opts` (backing files allowed); all must succeed.
pub fn our_io_opts(image_opts: &str, cmds: &[&str]) {
    let mut a = vec!["--allow-backing", "--image-opts", image_opts];
    for c in cmds {
        a.push("-c");
        a.push(c);
    }
    let text = ours_ok("io", &a);
    assert!(!text.contains("failed"), "qcow2 io {image_opts}: {text}");
}

/// `qemu-img ARGS` with both secrets, which must succeed.
pub fn qemu_img_secrets(args: &[&str]) -> Output {
    let mut c = Command::new("qemu-img");
    c.arg(args[0]);
    objects(&mut c).args(&args[1..]);
    run(&mut c)
}

/// `qemu-img check` of `image_opts` is clean.
pub fn qemu_check_clean(image_opts: &str) {
    let mut c = Command::new("qemu-img");
    c.arg("check");
    objects(&mut c).arg("--image-opts").arg(image_opts);
    let out = output(&mut c);
    assert_eq!(
        out.status.code(),
        Some(0),
        "qemu-img check {image_opts}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `qemu-img compare` of two `--image-opts` says identical.
pub fn qemu_same(a: &str, b: &str) {
    let mut c = Command::new("qemu-img");
    c.arg("compare");
    objects(&mut c).args(["--image-opts", a, b]);
    let out = output(&mut c);
    assert_eq!(
        out.status.code(),
        Some(0),
        "qemu-img compare {a} {b}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
