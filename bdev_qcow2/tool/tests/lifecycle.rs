//! The disk's life cycle through the `qcow2` tool against `qemu-img`: resize (and the
//! operations added next to it), each result checked by `qemu-img check` and compared with
//! what `qemu-img` makes of the same image.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{output, qemu_img, qemu_io, run, s};

const QCOW2: &str = env!("CARGO_BIN_EXE_qcow2");

struct Dir(tempfile::TempDir);

impl Dir {
    fn new() -> Dir {
        Dir(tempfile::tempdir().expect("tempdir"))
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }
    /// A qemu-img image `name` of `size` with `opts`, written by `cmds`.
    fn image(&self, name: &str, opts: &str, size: &str, cmds: &[&str]) -> PathBuf {
        let p = self.path(name);
        qemu_img(&["create", "-q", "-f", "qcow2", "-o", opts, s(&p), size]);
        if !cmds.is_empty() {
            qemu_io(&p, cmds);
        }
        p
    }
}

/// `qemu-img check` finds nothing wrong (no leak either).
fn clean(img: &Path) {
    qemu_img(&["check", s(img)]);
}

/// `qemu-img compare` (strict: sizes too) says the two disks are identical.
fn same_disk(a: &Path, b: &Path) {
    let out = output(Command::new("qemu-img").args(["compare", "-s", s(a), s(b)]));
    assert!(
        out.status.success(),
        "{} and {} differ: {}",
        a.display(),
        b.display(),
        String::from_utf8_lossy(&out.stdout)
    );
}

fn virtual_size(img: &Path) -> u64 {
    let out = qemu_img(&["info", "--output=json", s(img)]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    v["virtual-size"].as_u64().expect("virtual-size")
}

#[test]
fn resize_grows_like_qemu_img() {
    for (opts, grow) in [
        ("cluster_size=4096", "+3G"),
        ("cluster_size=65536", "+3G"),
        ("cluster_size=512,refcount_bits=64", "+100M"),
        ("compat=0.10,cluster_size=4096", "+3G"),
        ("extended_l2=on,cluster_size=16384", "+3G"),
    ] {
        let d = Dir::new();
        let cmds = ["write -P 1 0 1M", "write -P 2 3M 64k", "write -z 5M 128k"];
        let ours = d.image("ours.qcow2", opts, "8M", &cmds);
        let theirs = d.image("theirs.qcow2", opts, "8M", &cmds);
        run(Command::new(QCOW2).args(["resize", s(&ours), grow]));
        qemu_img(&["resize", "-q", s(&theirs), grow]);
        clean(&ours);
        assert_eq!(virtual_size(&ours), virtual_size(&theirs), "{opts}");
        same_disk(&ours, &theirs);
        // QEMU writes the grown image, and reads back what it wrote.
        qemu_io(
            &ours,
            &["write -P 9 90M 64k", "read -P 9 90M 64k", "read -P 1 0 1M"],
        );
        clean(&ours);
    }
}

#[test]
fn resize_shrinks_only_an_empty_tail() {
    let d = Dir::new();
    let img = d.image(
        "img.qcow2",
        "cluster_size=4096",
        "64M",
        &["write -P 1 0 1M", "write -P 2 40M 4k"],
    );
    let out = output(Command::new(QCOW2).args(["resize", s(&img), "32M"]));
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--shrink"));
    let out = output(Command::new(QCOW2).args(["resize", "--shrink", s(&img), "32M"]));
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("holds data"), "{err}");
    assert_eq!(virtual_size(&img), 64 << 20);
    qemu_io(&img, &["discard 40M 4k"]);
    run(Command::new(QCOW2).args(["resize", "--shrink", s(&img), "-32M"]));
    assert_eq!(virtual_size(&img), 32 << 20);
    clean(&img);
    qemu_io(&img, &["read -P 1 0 1M", "read -P 0 1M 31M"]);
    // Grown again, the range cut off reads as zeros.
    run(Command::new(QCOW2).args(["resize", s(&img), "64M"]));
    qemu_io(&img, &["read -P 0 32M 32M"]);
    clean(&img);
}

#[test]
fn resize_over_a_longer_backing_image_zeroes_the_new_range() {
    let d = Dir::new();
    let base = d.image(
        "base.qcow2",
        "cluster_size=65536",
        "64M",
        &["write -P 5 0 64M"],
    );
    let mk = |name: &str| {
        let p = d.path(name);
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
            s(&p),
            "16M",
        ]);
        qemu_io(&p, &["write -P 6 1M 64k"]);
        p
    };
    let ours = mk("ours.qcow2");
    let theirs = mk("theirs.qcow2");
    run(Command::new(QCOW2).args(["resize", "--allow-backing", s(&ours), "48M"]));
    qemu_img(&["resize", "-q", s(&theirs), "48M"]);
    clean(&ours);
    qemu_io(
        &ours,
        &["read -P 5 0 1M", "read -P 6 1M 64k", "read -P 0 16M 32M"],
    );
    same_disk(&ours, &theirs);
    let _ = base;
}

/// `qemu-img convert -O raw` of `img` (of snapshot `snap` with `-l`) into `out`.
fn raw_of(img: &Path, snap: Option<&str>, out: &Path) {
    let mut args = vec!["convert", "-O", "raw"];
    if let Some(sn) = snap {
        args.extend(["-l", sn]);
    }
    args.extend([s(img), s(out)]);
    qemu_img(&args);
}

fn same_bytes(a: &Path, b: &Path) {
    assert!(
        std::fs::read(a).unwrap() == std::fs::read(b).unwrap(),
        "{} and {} differ",
        a.display(),
        b.display()
    );
}

fn ours(args: &[&str], img: &Path) {
    run(Command::new(QCOW2).arg("snapshot").args(args).arg(img));
}

#[test]
fn snapshots_made_here_are_read_and_applied_by_qemu_img() {
    for opts in [
        "cluster_size=65536",
        "cluster_size=4096",
        "extended_l2=on,cluster_size=16384",
        "compat=0.10,cluster_size=4096",
    ] {
        let d = Dir::new();
        let img = d.image(
            "img.qcow2",
            opts,
            "32M",
            &[
                "write -P 1 0 3M",
                "write -c -P 3 8M 64k",
                "write -z 12M 64k",
            ],
        );
        ours(&["-c", "first"], &img);
        clean(&img);
        let first = d.path("first.raw");
        raw_of(&img, None, &first);
        qemu_io(
            &img,
            &["write -P 2 1M 1M", "write -P 4 20M 64k", "discard 8M 64k"],
        );
        clean(&img);
        ours(&["-c", "second"], &img);
        qemu_io(&img, &["write -P 5 0 64k"]);
        clean(&img);
        // QEMU lists them as we do, and reads each.
        let theirs = qemu_img(&["snapshot", "-l", s(&img)]);
        let list = run(Command::new(QCOW2).args(["snapshot", "-l"]).arg(&img));
        assert_eq!(
            String::from_utf8_lossy(&list.stdout),
            String::from_utf8_lossy(&theirs.stdout),
            "{opts}"
        );
        let from_qemu = d.path("first-qemu.raw");
        raw_of(&img, Some("first"), &from_qemu);
        same_bytes(&first, &from_qemu);
        // QEMU applies ours.
        qemu_img(&["snapshot", "-a", "first", s(&img)]);
        clean(&img);
        let now = d.path("now.raw");
        raw_of(&img, None, &now);
        same_bytes(&first, &now);
        // And deletes ours.
        qemu_img(&["snapshot", "-d", "second", s(&img)]);
        clean(&img);
    }
}

#[test]
fn snapshots_made_by_qemu_img_are_deleted_and_applied_here() {
    for opts in ["cluster_size=65536", "cluster_size=4096,refcount_bits=8"] {
        let d = Dir::new();
        let img = d.image(
            "img.qcow2",
            opts,
            "32M",
            &["write -P 1 0 3M", "write -c -P 3 8M 64k"],
        );
        qemu_img(&["snapshot", "-c", "a", s(&img)]);
        let a = d.path("a.raw");
        raw_of(&img, None, &a);
        qemu_io(&img, &["write -P 2 1M 1M"]);
        qemu_img(&["snapshot", "-c", "b", s(&img)]);
        let b = d.path("b.raw");
        raw_of(&img, None, &b);
        qemu_io(&img, &["write -P 6 2M 1M", "discard 0 64k"]);
        ours(&["-d", "a"], &img);
        clean(&img);
        let out = qemu_img(&["snapshot", "-l", s(&img)]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(!text.contains(" a ") && text.contains(" b "), "{text}");
        let got = d.path("b-got.raw");
        raw_of(&img, Some("b"), &got);
        same_bytes(&b, &got);
        ours(&["-a", "b"], &img);
        clean(&img);
        let now = d.path("now.raw");
        raw_of(&img, None, &now);
        same_bytes(&b, &now);
        // Writes after the apply copy on write: the snapshot keeps its data.
        qemu_io(&img, &["write -P 7 0 2M"]);
        ours(&["-d", "b"], &img);
        clean(&img);
        let out = output(Command::new(QCOW2).args(["snapshot", "-d", "b"]).arg(&img));
        assert_eq!(
            out.status.code(),
            Some(1),
            "deleting a missing snapshot fails"
        );
    }
}

/// The offline external snapshot: `qcow2 create -b OLD -F qcow2 NEW` (no size: the backing
/// image's) makes the overlay `qemu-img create` makes, reading as the old image.
#[test]
fn create_with_a_backing_file_is_an_external_snapshot() {
    let d = Dir::new();
    let old = d.image(
        "old.qcow2",
        "cluster_size=65536",
        "24M",
        &["write -P 7 0 3M", "write -P 8 20M 64k"],
    );
    let ours = d.path("ours.qcow2");
    let theirs = d.path("theirs.qcow2");
    run(Command::new(QCOW2)
        .args([
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            "old.qcow2",
            "-F",
            "qcow2",
        ])
        .arg(&ours));
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "old.qcow2",
        "-F",
        "qcow2",
        s(&theirs),
    ]);
    clean(&ours);
    let info = |p: &Path| {
        let out = Command::new("qemu-img")
            .args(["info", "--output=json", s(p)])
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (
            v["virtual-size"].clone(),
            v["cluster-size"].clone(),
            v["backing-filename"].clone(),
            v["backing-filename-format"].clone(),
        )
    };
    assert_eq!(info(&ours), info(&theirs));
    assert_eq!(info(&ours).2, "old.qcow2");
    same_disk(&ours, &old);
    same_disk(&ours, &theirs);
}

/// A three-image chain made by qemu-img: a compressed base, a 4 KiB-cluster middle with
/// data and zeros over it, and an extended-L2 top, larger than the base, with partial
/// subclusters, zeros, data and a compressed cluster. Returns the top.
fn stream_chain(d: &Dir) -> PathBuf {
    let b0 = d.image(
        "b0.qcow2",
        "cluster_size=65536",
        "8M",
        &[
            "write -P 0x11 0 2M",
            "write -P 0x22 3M 1M",
            "write -P 0x23 5M 64k",
            "write -P 0x24 7M 1k",
        ],
    );
    let base = d.path("base.qcow2");
    qemu_img(&["convert", "-q", "-c", "-O", "qcow2", s(&b0), s(&base)]);
    let mid = d.image(
        "mid.qcow2",
        "cluster_size=4096,backing_file=base.qcow2,backing_fmt=qcow2",
        "8M",
        &[
            "write -P 0x33 1M 256k",
            "write -z 3200k 64k",
            "write -P 0x34 6M 4k",
        ],
    );
    assert!(mid.exists());
    d.image(
        "top.qcow2",
        "extended_l2=on,cluster_size=65536,backing_file=mid.qcow2,backing_fmt=qcow2",
        "10M",
        &[
            "write -P 0x44 4k 2k",
            "write -P 0x45 3172k 10k",
            "write -z 5M 128k",
            "write -P 0x46 9M 64k",
            "write -P 0x47 7M 512",
            // A compressed cluster (its subcluster bitmap 0) over backing data.
            "write -c -P 0x48 8M 64k",
        ],
    )
}

/// `qemu-img compare` (not strict: allocation may differ) finds the same bytes, and the
/// sizes agree.
fn same_content(a: &Path, b: &Path) {
    assert_eq!(virtual_size(a), virtual_size(b));
    let out = output(Command::new("qemu-img").args(["compare", s(a), s(b)]));
    assert!(
        out.status.success(),
        "{} and {} differ: {}",
        a.display(),
        b.display(),
        String::from_utf8_lossy(&out.stdout)
    );
}

fn backing_of(img: &Path) -> Option<String> {
    let out = qemu_img(&["info", "--output=json", s(img)]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    v.get("backing-filename")
        .and_then(|b| b.as_str())
        .map(String::from)
}

#[test]
fn rebase_onto_nothing_equals_qemu_img_convert_of_the_chain() {
    let d = Dir::new();
    let top = stream_chain(&d);
    let want = d.path("want.qcow2");
    qemu_img(&["convert", "-q", "-O", "qcow2", s(&top), s(&want)]);
    // The backing chain is opened only when allowed.
    let out = output(Command::new(QCOW2).args(["rebase", "-b", "", s(&top)]));
    assert!(
        !out.status.success(),
        "rebase read a backing file it was not allowed to"
    );
    // Another backing file is not supported.
    let out =
        output(Command::new(QCOW2).args(["rebase", "--allow-backing", "-b", "x.qcow2", s(&top)]));
    assert!(!out.status.success());
    assert_eq!(backing_of(&top).as_deref(), Some("mid.qcow2"));
    run(Command::new(QCOW2).args(["rebase", "-p", "--allow-backing", "-b", "", s(&top)]));
    clean(&top);
    assert_eq!(backing_of(&top), None);
    let out = qemu_img(&["info", "--output=json", s(&top)]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert!(v.get("backing-filename-format").is_none(), "{v}");
    // Nothing of the chain is needed any more.
    std::fs::remove_file(d.path("mid.qcow2")).unwrap();
    std::fs::remove_file(d.path("base.qcow2")).unwrap();
    same_content(&top, &want);
    // A second rebase has nothing to do.
    run(Command::new(QCOW2).args(["rebase", "-b", "", s(&top)]));
    same_content(&top, &want);
}

#[test]
fn unsafe_rebase_onto_nothing_drops_the_name_only_like_qemu_img() {
    let d = Dir::new();
    let top = stream_chain(&d);
    let theirs = d.path("theirs.qcow2");
    std::fs::copy(&top, &theirs).unwrap();
    qemu_img(&["rebase", "-u", "-b", "", s(&theirs)]);
    run(Command::new(QCOW2).args(["rebase", "-u", "-b", "", s(&top)]));
    clean(&top);
    assert_eq!(backing_of(&top), None);
    same_disk(&top, &theirs);
}
