//! `qcow2 compare` against `qemu-img compare` on the same images: the same line on stdout
//! and the same exit status (0 identical, 1 different, 2 cannot open), strict mode
//! included, qcow2 and raw on either side, chains, and images of different sizes.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use std::path::PathBuf;
use std::process::Command;

mod common;
#[path = "common/holder.rs"]
mod holder;
use common::{output, qemu_img, qemu_io, s};
use holder::QemuHolder;

const QCOW2: &str = env!("CARGO_BIN_EXE_qcow2");

struct Dir(tempfile::TempDir);

impl Dir {
    fn new() -> Dir {
        Dir(tempfile::tempdir().unwrap())
    }
    fn p(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }
    /// A qcow2 image `name` of `size` with the qemu-io commands `cmds` run on it.
    fn qcow2(&self, name: &str, opts: &str, size: &str, cmds: &[&str]) -> PathBuf {
        let p = self.p(name);
        let mut args = vec!["create", "-q", "-f", "qcow2"];
        if !opts.is_empty() {
            args.extend(["-o", opts]);
        }
        args.extend([s(&p), size]);
        qemu_img(&args);
        if !cmds.is_empty() {
            qemu_io(&p, cmds);
        }
        p
    }
}

/// Runs `qcow2 compare ARGS` and `qemu-img compare ARGS`; both must print the same on
/// stdout and exit alike. Returns the exit status.
fn same(args: &[&str]) -> i32 {
    let ours = output(Command::new(QCOW2).arg("compare").args(args));
    let theirs = output(Command::new("qemu-img").arg("compare").args(args));
    let text = |o: &std::process::Output| String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(
        (text(&ours), ours.status.code()),
        (text(&theirs), theirs.status.code()),
        "compare {args:?}: ours (stderr {}) vs qemu-img (stderr {})",
        String::from_utf8_lossy(&ours.stderr),
        String::from_utf8_lossy(&theirs.stderr)
    );
    ours.status.code().unwrap()
}

#[test]
fn identical_and_different_images_as_qemu_img_says() {
    let d = Dir::new();
    let a = d.qcow2("a", "", "8M", &["write -P 1 1M 4k", "write -P 2 5M 100k"]);
    let b = d.qcow2("b", "", "8M", &["write -P 1 1M 4k", "write -P 2 5M 100k"]);
    assert_eq!(same(&[s(&a), s(&b)]), 0);
    assert_eq!(same(&["-s", s(&a), s(&b)]), 0);
    // One byte off, deep inside a sector: reported at the sector's start.
    let c = d.qcow2("c", "", "8M", &["write -P 1 1M 4k", "write -P 2 5M 100k"]);
    qemu_io(&c, &["write -P 3 5308000 1"]);
    assert_eq!(same(&[s(&a), s(&c)]), 1);
    assert_eq!(same(&["-q", s(&a), s(&c)]), 1);
    // Zeros written where the other image is unallocated: the same content, but strict
    // mode sees the allocation.
    let z = d.qcow2("z", "", "8M", &["write -P 1 1M 4k", "write -P 2 5M 100k"]);
    qemu_io(&z, &["write -P 0 7M 64k", "write -z 3M 64k"]);
    assert_eq!(same(&[s(&a), s(&z)]), 0);
    assert_eq!(same(&["-s", s(&a), s(&z)]), 1);
    // Another cluster size and extended L2, same content.
    let e = d.qcow2(
        "e",
        "cluster_size=32k,extended_l2=on",
        "8M",
        &["write -P 1 1M 4k", "write -P 2 5M 100k"],
    );
    assert_eq!(same(&[s(&a), s(&e)]), 0);
    assert_eq!(same(&["-s", s(&a), s(&e)]), 1);
    // Compressed data against plain data.
    let zc = d.p("zc");
    qemu_img(&["convert", "-c", "-O", "qcow2", s(&a), s(&zc)]);
    assert_eq!(same(&[s(&a), s(&zc)]), 0);
    assert_eq!(same(&["-s", s(&a), s(&zc)]), 1);
}

#[test]
fn raw_on_either_side_and_backing_chains() {
    let d = Dir::new();
    let a = d.qcow2("a", "", "4M", &["write -P 7 0 64k", "write -P 9 3M 512"]);
    let raw = d.p("a.raw");
    qemu_img(&["convert", "-O", "raw", s(&a), s(&raw)]);
    assert_eq!(same(&["-F", "raw", s(&a), s(&raw)]), 0);
    assert_eq!(same(&["-f", "raw", "-F", "qcow2", s(&raw), s(&a)]), 0);
    assert_eq!(same(&["-f", "raw", "-F", "raw", "-s", s(&raw), s(&raw)]), 0);
    assert_eq!(same(&["-F", "raw", "-s", s(&a), s(&raw)]), 1);
    // An overlay reads its backing file's data: equal to the flattened image, until it
    // changes one sector.
    let top = d.p("top");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "a",
        "-F",
        "qcow2",
        s(&top),
    ]);
    let ours = output(Command::new(QCOW2).args(["compare", "--allow-backing", s(&top), s(&a)]));
    assert_eq!(ours.status.code(), Some(0), "{ours:?}");
    qemu_io(&top, &["write -P 8 2M 512"]);
    let ours = output(Command::new(QCOW2).args(["compare", "--allow-backing", s(&top), s(&a)]));
    let theirs = output(Command::new("qemu-img").args(["compare", s(&top), s(&a)]));
    assert_eq!(ours.status.code(), Some(1));
    assert_eq!(ours.stdout, theirs.stdout);
    assert_eq!(
        String::from_utf8_lossy(&ours.stdout),
        "Content mismatch at offset 2097152!\n"
    );
    // Without --allow-backing the overlay is refused (exit status 2).
    let ours = output(Command::new(QCOW2).args(["compare", s(&top), s(&a)]));
    assert_eq!(ours.status.code(), Some(2));
}

#[test]
fn images_of_different_sizes() {
    let d = Dir::new();
    let small = d.qcow2("small", "", "4M", &["write -P 1 0 4k"]);
    let big = d.qcow2("big", "", "8M", &["write -P 1 0 4k", "write -z 6M 64k"]);
    assert_eq!(same(&[s(&small), s(&big)]), 0);
    assert_eq!(same(&[s(&big), s(&small)]), 0);
    assert_eq!(same(&["-s", s(&small), s(&big)]), 1);
    // Data past the end of the smaller image, zeros written too: still the same.
    qemu_io(&big, &["write -P 0 5M 4k"]);
    assert_eq!(same(&[s(&small), s(&big)]), 0);
    // Nonzero data there: different, at its first sector.
    qemu_io(&big, &["write -P 4 7M 1k"]);
    assert_eq!(same(&[s(&small), s(&big)]), 1);
    assert_eq!(same(&[s(&big), s(&small)]), 1);
}

#[test]
fn errors_and_odd_inputs() {
    let d = Dir::new();
    let a = d.qcow2("a", "", "1M", &[]);
    // A missing file: exit status 2, the error on stderr.
    let missing = d.p("missing");
    for args in [[s(&a), s(&missing)], [s(&missing), s(&a)]] {
        let ours = output(Command::new(QCOW2).arg("compare").args(args));
        assert_eq!(ours.status.code(), Some(2));
        assert!(ours.stdout.is_empty());
        assert!(String::from_utf8_lossy(&ours.stderr).starts_with("qcow2: "));
    }
    // A raw file named as qcow2: refused (exit status 2), never probed.
    let raw = d.p("raw");
    std::fs::write(&raw, vec![0u8; 1 << 20]).unwrap();
    let ours = output(Command::new(QCOW2).args(["compare", s(&a), s(&raw)]));
    assert_eq!(ours.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&ours.stderr).contains("-f raw"));
    assert_eq!(same(&["-F", "raw", s(&a), s(&raw)]), 0);
    // A hostile header (L1 table past the end of the file): an error, nothing printed
    // on stdout as a result.
    let bad = d.p("bad");
    std::fs::copy(&a, &bad).unwrap();
    let mut bytes = std::fs::read(&bad).unwrap();
    bytes[40..48].copy_from_slice(&(1u64 << 40).to_be_bytes());
    std::fs::write(&bad, bytes).unwrap();
    let ours = output(Command::new(QCOW2).args(["compare", s(&a), s(&bad)]));
    assert_eq!(ours.status.code(), Some(2), "{ours:?}");
    // Two names are needed.
    let ours = output(Command::new(QCOW2).args(["compare", s(&a)]));
    assert!(!ours.status.success());
}

#[test]
fn progress_and_locks() {
    let d = Dir::new();
    let a = d.qcow2("a", "", "16M", &["write -P 1 0 4M"]);
    let b = d.qcow2("b", "", "16M", &["write -P 1 0 4M"]);
    let ours = output(Command::new(QCOW2).args(["compare", "-p", s(&a), s(&b)]));
    let text = String::from_utf8_lossy(&ours.stdout);
    assert!(text.starts_with("    (0.00/100%)\r"), "{text:?}");
    assert!(text.contains("    (100.00/100%)\r"), "{text:?}");
    assert!(text.ends_with("Images are identical.\n\n"), "{text:?}");
    // An image qemu-io holds open for writing is refused, unless -U.
    let holder = QemuHolder::open(&a, false);
    let locked = output(Command::new(QCOW2).args(["compare", s(&a), s(&b)]));
    assert_eq!(locked.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&locked.stderr).contains("lock"));
    let shared = output(Command::new(QCOW2).args(["compare", "-U", s(&a), s(&b)]));
    assert_eq!(shared.status.code(), Some(0), "{shared:?}");
    holder.close();
}
