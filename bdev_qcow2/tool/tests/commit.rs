//! `qcow2 commit` against `qemu-img commit` (issue #49): chains built with qemu-img and
//! qemu-io are copied, one copy committed by us and the other by qemu-img, and the bases
//! must compare identical (`qemu-img compare`), every image we touched must pass `qemu-img
//! check`, the top image must read as before, and (unless `-d` or `-b`) hold nothing.
//! Refusals exit as qemu-img does, with its message, and change nothing.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test helpers may panic

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
#[path = "common/holder.rs"]
mod holder;
use common::{assert_check_clean, assert_same, output, qemu_img, s};
use holder::QemuHolder;

const QCOW2: &str = env!("CARGO_BIN_EXE_qcow2");

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `qemu-io -f FMT -c CMD... IMG`, which must succeed.
fn io(img: &Path, fmt: &str, cmds: &[&str]) {
    let mut c = Command::new("qemu-io");
    c.args(["-f", fmt]);
    for x in cmds {
        c.arg("-c").arg(x);
    }
    common::run(c.arg(img));
}

/// `qemu-img create -f qcow2 [-o OPTS] [-b BACKING -F FMT] IMG [SIZE]` in `dir`, with the
/// backing file named relative to `dir` (so that a copy of `dir` is a chain of its own).
fn create(dir: &Path, name: &str, opts: &str, backing: Option<(&str, &str)>, size: Option<&str>) {
    let mut a = vec!["create", "-q", "-f", "qcow2"];
    if !opts.is_empty() {
        a.extend(["-o", opts]);
    }
    if let Some((b, f)) = backing {
        a.extend(["-b", b, "-F", f]);
    }
    let p = dir.join(name);
    a.push(s(&p));
    a.extend(size);
    qemu_img(&a);
}

fn our_commit(args: &[&str], top: &Path) -> Output {
    output(
        Command::new(QCOW2)
            .arg("commit")
            .arg("--allow-backing")
            .args(args)
            .arg(top),
    )
}

fn qemu_commit(args: &[&str], top: &Path) -> Output {
    output(Command::new("qemu-img").arg("commit").args(args).arg(top))
}

/// `qemu-img map --output=json IMG`.
fn map(img: &Path) -> Vec<serde_json::Value> {
    let out = qemu_img(&["map", "--output=json", s(img)]);
    serde_json::from_slice(&out.stdout).expect("qemu-img map JSON")
}

/// Whether the top image itself holds anything (data or zero clusters at depth 0).
fn top_holds_something(img: &Path) -> bool {
    map(img)
        .iter()
        .any(|e| e["depth"] == 0 && e["present"] == true)
}

/// The disk `img` shows, flattened into a raw file `out`.
fn flatten(img: &Path, out: &Path) {
    qemu_img(&["convert", "-O", "raw", s(img), s(out)]);
}

/// A chain built by `setup` in a fresh directory, and a copy of it.
struct Case {
    _tmp: tempfile::TempDir,
    ours: PathBuf,
    theirs: PathBuf,
}

impl Case {
    fn new(setup: impl Fn(&Path)) -> Case {
        let tmp = tempfile::tempdir().expect("scratch dir");
        let ours = tmp.path().join("ours");
        std::fs::create_dir(&ours).expect("mkdir");
        setup(&ours);
        let theirs = tmp.path().join("theirs");
        common::run(Command::new("cp").arg("-a").arg(&ours).arg(&theirs));
        Case {
            _tmp: tmp,
            ours,
            theirs,
        }
    }

    /// Commits `top` with `args` in both copies (ours first) and checks everything: the
    /// bases (`base`, format `fmt`) compare identical, the images we wrote are clean, the
    /// top reads as before and is empty unless `emptied` is false, in which case it is
    /// unchanged.
    fn commit(&self, args: &[&str], top: &str, base: &str, fmt: &str, emptied: bool) {
        let (t, tt) = (self.ours.join(top), self.theirs.join(top));
        let before = self.ours.join("before.raw");
        flatten(&t, &before);
        let map_before = map(&t);
        let out = our_commit(args, &t);
        assert!(
            out.status.success(),
            "qcow2 commit {args:?}: {}",
            text(&out.stderr)
        );
        assert_eq!(text(&out.stdout), "Image committed.\n");
        let q = qemu_commit(args, &tt);
        assert!(q.status.success(), "qemu-img commit: {}", text(&q.stderr));
        assert_same(&self.ours.join(base), fmt, &self.theirs.join(base), fmt);
        if fmt == "qcow2" {
            assert_check_clean(&self.ours.join(base));
        }
        assert_check_clean(&t);
        assert_same(&t, "qcow2", &before, "raw");
        assert_same(&t, "qcow2", &tt, "qcow2");
        if emptied {
            assert!(!top_holds_something(&t), "top not emptied: {:?}", map(&t));
            assert!(
                !top_holds_something(&tt),
                "qemu-img left the top holding data"
            );
        } else {
            assert_eq!(map(&t), map_before, "the top changed");
        }
    }
}

/// Writes at various offsets, partial and whole clusters, zero writes and discards, over
/// a base with data (some of it compressed, extended L2 or not), and a compressed
/// cluster in the top.
fn mixed(dir: &Path, base_opts: &str, top_opts: &str) {
    create(dir, "base.qcow2", base_opts, None, Some("8M"));
    let b = dir.join("base.qcow2");
    let c = "-c ";
    io(
        &b,
        "qcow2",
        &[
            "write -P 0x22 0 2M",
            &format!("write {c}-P 0x33 2M 64k"),
            &format!("write {c}-P 0x34 4M 128k"),
            "write -P 0x35 6M 512k",
        ],
    );
    create(
        dir,
        "top.qcow2",
        top_opts,
        Some(("base.qcow2", "qcow2")),
        None,
    );
    io(
        &dir.join("top.qcow2"),
        "qcow2",
        &[
            "write -P 0x11 4k 8k",
            "write -P 0x12 1000448 1536",
            "write -z 512k 128k",
            "write -z 8k 1k",
            "discard 1M 256k",
            "write -P 0x44 2M 4k",
            "write -P 0x45 4M 192k",
            "write -z 6M 64k",
            "write -P 0x46 7M 1M",
            "write -P 0x47 8387584 512",
        ],
    );
    io(
        &dir.join("top.qcow2"),
        "qcow2",
        &["write -c -P 0x48 5M 64k"],
    );
}

#[test]
fn default_clusters() {
    let c = Case::new(|d| mixed(d, "", ""));
    c.commit(&[], "top.qcow2", "base.qcow2", "qcow2", true);
}

#[test]
fn small_clusters_overlay() {
    let c = Case::new(|d| mixed(d, "cluster_size=64k", "cluster_size=4k"));
    c.commit(&[], "top.qcow2", "base.qcow2", "qcow2", true);
}

#[test]
fn extended_l2_overlay() {
    let c = Case::new(|d| mixed(d, "", "extended_l2=on,cluster_size=16k"));
    c.commit(&[], "top.qcow2", "base.qcow2", "qcow2", true);
}

#[test]
fn extended_l2_base_and_overlay() {
    let c = Case::new(|d| mixed(d, "extended_l2=on", "extended_l2=on,cluster_size=32k"));
    c.commit(&[], "top.qcow2", "base.qcow2", "qcow2", true);
}

#[test]
fn version_2_images() {
    let c = Case::new(|d| mixed(d, "compat=0.10", "compat=0.10"));
    c.commit(&[], "top.qcow2", "base.qcow2", "qcow2", true);
}

#[test]
fn keep_top_with_d_and_show_progress() {
    let c = Case::new(|d| mixed(d, "", ""));
    c.commit(&["-d"], "top.qcow2", "base.qcow2", "qcow2", false);
    // -p prints qemu-img's progress lines, then the result; -q prints nothing.
    let t = c.ours.join("top.qcow2");
    let out = our_commit(&["-p", "-d", "-r", "64M"], &t);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let o = text(&out.stdout);
    assert!(o.starts_with("    (0.00/100%)\r"), "{o:?}");
    assert!(
        o.ends_with("    (100.00/100%)\r\nImage committed.\n"),
        "{o:?}"
    );
    let out = our_commit(&["-q", "-t", "writeback"], &t);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "");
    assert!(!top_holds_something(&t));
    assert_check_clean(&t);
}

#[test]
fn top_with_snapshot() {
    let c = Case::new(|d| {
        mixed(d, "", "");
        qemu_img(&["snapshot", "-c", "s1", s(&d.join("top.qcow2"))]);
        io(&d.join("top.qcow2"), "qcow2", &["write -P 0x66 4k 4k"]);
    });
    c.commit(&[], "top.qcow2", "base.qcow2", "qcow2", true);
}

#[test]
fn base_grows_to_top_size() {
    let c = Case::new(|d| {
        mixed(d, "", "");
        let t = d.join("top.qcow2");
        qemu_img(&["resize", "-q", s(&t), "12M"]);
        io(&t, "qcow2", &["write -P 0x77 10M 1M", "write -z 11M 64k"]);
    });
    c.commit(&[], "top.qcow2", "base.qcow2", "qcow2", true);
    let info = qemu_img(&["info", "--output=json", s(&c.ours.join("base.qcow2"))]);
    let v: serde_json::Value = serde_json::from_slice(&info.stdout).expect("info JSON");
    assert_eq!(v["virtual-size"], 12 << 20);
}

#[test]
fn shorter_top_leaves_the_rest() {
    let c = Case::new(|d| {
        create(d, "base.qcow2", "", None, Some("8M"));
        io(&d.join("base.qcow2"), "qcow2", &["write -P 0x22 0 8M"]);
        create(
            d,
            "top.qcow2",
            "",
            Some(("base.qcow2", "qcow2")),
            Some("4M"),
        );
        io(&d.join("top.qcow2"), "qcow2", &["write -P 0x11 1M 3M"]);
    });
    c.commit(&[], "top.qcow2", "base.qcow2", "qcow2", true);
}

#[test]
fn raw_backing_file() {
    let c = Case::new(|d| {
        let b = d.join("base.raw");
        qemu_img(&["create", "-q", "-f", "raw", s(&b), "4M"]);
        io(&b, "raw", &["write -P 0x22 0 3M"]);
        create(d, "top.qcow2", "", Some(("base.raw", "raw")), Some("6M"));
        io(
            &d.join("top.qcow2"),
            "qcow2",
            &[
                "write -P 0x11 64k 64k",
                "write -z 1M 1M",
                "write -P 0x13 5M 64k",
            ],
        );
    });
    c.commit(&[], "top.qcow2", "base.raw", "raw", true);
}

/// base <- mid <- top: `-b` commits top and mid into base (and, as qemu-img, leaves the
/// top as it was); without `-b` the top goes into mid.
fn three_deep(d: &Path) {
    create(d, "base.qcow2", "", None, Some("8M"));
    io(&d.join("base.qcow2"), "qcow2", &["write -P 0x22 0 8M"]);
    create(d, "mid.qcow2", "", Some(("base.qcow2", "qcow2")), None);
    io(
        &d.join("mid.qcow2"),
        "qcow2",
        &[
            "write -P 0x33 1M 1M",
            "write -z 3M 64k",
            "write -P 0x34 5M 4k",
        ],
    );
    create(d, "top.qcow2", "", Some(("mid.qcow2", "qcow2")), None);
    io(
        &d.join("top.qcow2"),
        "qcow2",
        &[
            "write -P 0x44 1536k 1M",
            "write -z 5M 64k",
            "write -P 0x45 7M 4k",
        ],
    );
}

#[test]
fn base_option_three_deep() {
    let c = Case::new(three_deep);
    c.commit(
        &["-b", "base.qcow2"],
        "top.qcow2",
        "base.qcow2",
        "qcow2",
        false,
    );
    assert_check_clean(&c.ours.join("mid.qcow2"));
    // The absolute path names the same base.
    let c = Case::new(three_deep);
    let abs = c.ours.join("base.qcow2");
    let t = c.ours.join("top.qcow2");
    let out = our_commit(&["-b", s(&abs)], &t);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let q = qemu_commit(
        &["-b", s(&c.theirs.join("base.qcow2"))],
        &c.theirs.join("top.qcow2"),
    );
    assert!(q.status.success(), "{}", text(&q.stderr));
    assert_same(&abs, "qcow2", &c.theirs.join("base.qcow2"), "qcow2");
}

#[test]
fn three_deep_into_mid() {
    let c = Case::new(three_deep);
    c.commit(&[], "top.qcow2", "mid.qcow2", "qcow2", true);
    assert_same(
        &c.ours.join("base.qcow2"),
        "qcow2",
        &c.theirs.join("base.qcow2"),
        "qcow2",
    );
}

/// A refusal: exit status 1 as qemu-img's, a message containing `msg`, nothing changed.
fn refused(c: &Case, args: &[&str], top: &str, msg: &str, qemu_msg: &str) {
    let files: Vec<_> = ["base.qcow2", "top.qcow2"]
        .iter()
        .map(|f| std::fs::read(c.ours.join(f)).ok())
        .collect();
    let out = our_commit(args, &c.ours.join(top));
    let q = qemu_commit(args, &c.theirs.join(top));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert_eq!(q.status.code(), Some(1), "qemu-img: {}", text(&q.stderr));
    assert!(
        text(&out.stderr).contains(msg),
        "{:?} lacks {msg:?}",
        text(&out.stderr)
    );
    assert!(text(&q.stderr).contains(qemu_msg), "{}", text(&q.stderr));
    assert_eq!(out.stdout, b"");
    let after: Vec<_> = ["base.qcow2", "top.qcow2"]
        .iter()
        .map(|f| std::fs::read(c.ours.join(f)).ok())
        .collect();
    assert!(files == after, "a refused commit changed an image");
}

#[test]
fn refusals() {
    let c = Case::new(three_deep);
    let m = "Image does not have a backing file";
    refused(&c, &[], "base.qcow2", m, m);
    refused(&c, &["-f", "raw"], "base.qcow2", m, m);
    let top = s(&c.ours.join("top.qcow2")).to_string();
    let m = format!("Did not find 'nothere.qcow2' in the backing chain of '{top}'");
    refused(
        &c,
        &["-b", "nothere.qcow2"],
        "top.qcow2",
        &m,
        "Did not find",
    );
    // The top itself is not in its backing chain.
    refused(
        &c,
        &["-b", "top.qcow2"],
        "top.qcow2",
        "Did not find",
        "Did not find",
    );
    // A base another process holds open cannot be written.
    let hold = QemuHolder::open(&c.ours.join("mid.qcow2"), true);
    let hold2 = QemuHolder::open(&c.theirs.join("mid.qcow2"), true);
    refused(&c, &[], "top.qcow2", "Failed to get \"write\" lock", "lock");
    hold.close();
    hold2.close();
    // Backing files are opened only when the operator allows it.
    let out = output(
        Command::new(QCOW2)
            .arg("commit")
            .arg(c.ours.join("top.qcow2")),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("--allow-backing"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn shorter_image_between_reads_as_zeros() {
    // base (8M) <- mid (4M) <- top (8M): past mid's end the top read zeros where it held
    // nothing, and the base gets those zeros, as qemu-img's block status counts them.
    let c = Case::new(|d| {
        create(d, "base.qcow2", "", None, Some("8M"));
        io(&d.join("base.qcow2"), "qcow2", &["write -P 0x22 0 8M"]);
        create(
            d,
            "mid.qcow2",
            "",
            Some(("base.qcow2", "qcow2")),
            Some("4M"),
        );
        io(&d.join("mid.qcow2"), "qcow2", &["write -P 0x33 1M 1M"]);
        create(d, "top.qcow2", "", Some(("mid.qcow2", "qcow2")), Some("8M"));
        io(&d.join("top.qcow2"), "qcow2", &["write -P 0x44 6M 64k"]);
    });
    c.commit(
        &["-b", "base.qcow2"],
        "top.qcow2",
        "base.qcow2",
        "qcow2",
        false,
    );
}
