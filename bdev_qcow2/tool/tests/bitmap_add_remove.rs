//! `qcow2 bitmap --add/--remove` against `qemu-img bitmap`: the same operations on two
//! copies of one image leave the same bitmaps (names, flags, granularities, and the bits
//! later writes set, as `qemu-nbd` exports them), a `qemu-img check` with no leak, and the
//! same errors and exit codes; operations run in command-line order as qemu-img runs them.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
#[path = "common/dirty_ranges.rs"]
mod dirty_ranges;
use common::{info_bitmaps as bitmaps, output, qemu_img, qemu_io, s};
use dirty_ranges::dirty_ranges;

const QCOW2: &str = env!("CARGO_BIN_EXE_qcow2");

/// `qcow2 bitmap ARGS` on `ours` and `qemu-img bitmap ARGS` on `theirs` (`IMG` standing
/// for the image): both outputs.
fn both_out(ours: &Path, theirs: &Path, args: &[&str]) -> (Output, Output) {
    let with = |img: &Path| -> Vec<String> {
        args.iter()
            .map(|a| if *a == "IMG" { s(img) } else { a }.to_string())
            .collect()
    };
    (
        output(Command::new(QCOW2).arg("bitmap").args(with(ours))),
        output(Command::new("qemu-img").arg("bitmap").args(with(theirs))),
    )
}

/// [`both_out`], which must succeed for both.
fn both(ours: &Path, theirs: &Path, args: &[&str]) {
    let (o, t) = both_out(ours, theirs, args);
    assert!(o.status.success(), "ours {args:?}: {o:?}");
    assert!(t.status.success(), "theirs {args:?}: {t:?}");
}

/// `qemu-img check` finds nothing (no leak either: exit status 3 would say leaks).
fn clean(img: &Path) {
    let out = output(Command::new("qemu-img").args(["check", "--output=json", s(img)]));
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v.get("leaks").is_none(), "{v}");
}

/// Both images alike: the bitmaps qemu-img lists, and every bitmap's bits; ours clean.
fn alike(ours: &Path, theirs: &Path) {
    clean(ours);
    let (a, b) = (bitmaps(ours), bitmaps(theirs));
    assert_eq!(a, b);
    for bm in a.as_array().into_iter().flatten() {
        let name = bm["name"].as_str().unwrap();
        assert_eq!(
            dirty_ranges(ours, name),
            dirty_ranges(theirs, name),
            "bitmap {name}"
        );
    }
}

fn run_io(img: &Path, cmd: &str) {
    let o = output(Command::new(QCOW2).args(["io", "--allow-backing", "-c", cmd, s(img)]));
    assert!(o.status.success(), "{o:?}");
}

/// A 64 MiB image of `cluster_size` with data, and a copy.
fn pair(dir: &Path, cluster_size: &str, backing: Option<&Path>) -> (PathBuf, PathBuf) {
    let ours = dir.join(format!("ours-{cluster_size}.qcow2"));
    let mut args = vec!["create", "-q", "-f", "qcow2", "-o"];
    let opt = format!("cluster_size={cluster_size}");
    args.push(&opt);
    if let Some(b) = backing {
        args.extend(["-b", s(b), "-F", "qcow2"]);
    }
    args.extend([s(&ours), "64M"]);
    qemu_img(&args);
    qemu_io(&ours, &["write -P 1 0 1M", "write -P 2 30M 100k"]);
    let theirs = dir.join(format!("theirs-{cluster_size}.qcow2"));
    std::fs::copy(&ours, &theirs).unwrap();
    (ours, theirs)
}

#[test]
fn added_bitmaps_are_qemu_img_s_and_record_writes() {
    let d = tempfile::tempdir().unwrap();
    for cs in ["64k", "512", "2M"] {
        let (ours, theirs) = pair(d.path(), cs, None);
        // The default granularity follows the cluster size as QEMU's does.
        both(&ours, &theirs, &["--add", "IMG", "b0"]);
        both(
            &ours,
            &theirs,
            &["--add", "-g", "4k", "--disable", "IMG", "off"],
        );
        both(&ours, &theirs, &["--add", "-g", "512", "IMG", "fine"]);
        alike(&ours, &theirs);
        // Writes through our io and qemu-io set the same bits in the enabled ones.
        for cmd in ["write -P 3 5M 4k", "write -z 40M 1M", "write -P 4 63M 1000"] {
            run_io(&ours, cmd);
            qemu_io(&theirs, &[cmd]);
        }
        alike(&ours, &theirs);
        assert!(!dirty_ranges(&ours, "b0").is_empty());
        assert!(dirty_ranges(&ours, "off").is_empty());
        // Removed one by one, the last with the extension: no leak, no bitmaps.
        for name in ["fine", "b0", "off"] {
            both(&ours, &theirs, &["--remove", "IMG", name]);
            alike(&ours, &theirs);
        }
        assert!(bitmaps(&ours).is_null());
        // And added again.
        both(&ours, &theirs, &["--add", "IMG", "again"]);
        alike(&ours, &theirs);
    }
}

#[test]
fn bitmaps_qemu_made_are_removed_without_leaks_and_each_tool_goes_on() {
    let d = tempfile::tempdir().unwrap();
    let base = d.path().join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "64M"]);
    let (ours, theirs) = pair(d.path(), "64k", Some(&base));
    for img in [&ours, &theirs] {
        qemu_img(&["bitmap", "--add", s(img), "a"]);
        qemu_img(&["bitmap", "--add", "-g", "512", s(img), "b"]);
        // Bits over much of the disk: data clusters in both bitmaps' tables.
        qemu_io(img, &["write -P 5 0 20M", "write -P 6 50M 3M"]);
        qemu_img(&["bitmap", "--add", s(img), "c"]);
    }
    both(&ours, &theirs, &["--remove", "IMG", "b"]);
    alike(&ours, &theirs);
    // We add, qemu-img removes ours and adds; we remove theirs.
    both(&ours, &theirs, &["--add", "-g", "16k", "IMG", "d"]);
    run_io(&ours, "write -P 7 10M 64k");
    qemu_io(&theirs, &["write -P 7 10M 64k"]);
    alike(&ours, &theirs);
    for img in [&ours, &theirs] {
        qemu_img(&["bitmap", "--remove", s(img), "a"]);
        qemu_img(&["bitmap", "--add", s(img), "e"]);
    }
    both(&ours, &theirs, &["--remove", "IMG", "e"]);
    both(&ours, &theirs, &["--remove", "IMG", "c"]);
    alike(&ours, &theirs);
    both(&ours, &theirs, &["--remove", "IMG", "d"]);
    alike(&ours, &theirs);
    assert!(bitmaps(&ours).is_null());
    // The backing file is still there.
    let info = qemu_img(&["info", "--output=json", s(&ours)]);
    let v: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(v["backing-filename"].as_str(), Some(s(&base)));
}

#[test]
fn operations_run_in_command_line_order() {
    let d = tempfile::tempdir().unwrap();
    let (ours, theirs) = pair(d.path(), "64k", None);
    both(&ours, &theirs, &["--add", "IMG", "x"]);
    run_io(&ours, "write -P 8 1M 64k");
    qemu_io(&theirs, &["write -P 8 1M 64k"]);
    // Removed, then added again (empty); then cleared, disabled, enabled.
    both(&ours, &theirs, &["--remove", "--add", "IMG", "x"]);
    alike(&ours, &theirs);
    assert!(dirty_ranges(&ours, "x").is_empty());
    both(&ours, &theirs, &["--add", "--disable", "IMG", "y"]);
    both(
        &ours,
        &theirs,
        &["--add", "--clear", "--disable", "IMG", "z"],
    );
    alike(&ours, &theirs);
    // Added first, so the removal of an existing one never runs: both refuse.
    let (o, t) = both_out(&ours, &theirs, &["--add", "--remove", "IMG", "x"]);
    assert_eq!((o.status.code(), t.status.code()), (Some(1), Some(1)));
    same_message(&o, &t);
    alike(&ours, &theirs);
    // The first failure stops the rest.
    for first in ["--enable", "--disable", "--clear"] {
        let (o, t) = both_out(&ours, &theirs, &[first, "--add", "IMG", "w"]);
        assert_eq!((o.status.code(), t.status.code()), (Some(1), Some(1)));
        same_message(&o, &t);
    }
    alike(&ours, &theirs);
}

/// Our message is qemu-img's (QEMU names its node in some: we do not).
fn same_message(ours: &Output, theirs: &Output) {
    let o = String::from_utf8_lossy(&ours.stderr);
    let t = String::from_utf8_lossy(&theirs.stderr);
    let t = match (t.find(" persistent in '"), t.find("': ")) {
        (Some(a), Some(b)) if b > a => format!("{} persistent:{}", &t[..a], &t[b + 2..]),
        _ => t.to_string(),
    };
    assert_eq!(
        o.strip_prefix("qcow2: "),
        t.strip_prefix("qemu-img: "),
        "ours {o:?}, theirs {t:?}"
    );
}

#[test]
fn refusals_as_qemu_img_s() {
    let d = tempfile::tempdir().unwrap();
    let (ours, theirs) = pair(d.path(), "64k", None);
    both(&ours, &theirs, &["--add", "IMG", "b0"]);
    let long = "n".repeat(1024);
    let big = d.path().join("big.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&big), "4T"]);
    let big2 = d.path().join("big2.qcow2");
    std::fs::copy(&big, &big2).unwrap();
    let v2 = d.path().join("v2.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "compat=0.10",
        s(&v2),
        "64M",
    ]);
    let v2b = d.path().join("v2b.qcow2");
    std::fs::copy(&v2, &v2b).unwrap();
    for (o_img, t_img, args) in [
        (&ours, &theirs, vec!["--add", "IMG", "b0"]),
        (&ours, &theirs, vec!["--remove", "IMG", "nosuch"]),
        (&ours, &theirs, vec!["--add", "IMG", &long]),
        (&ours, &theirs, vec!["--add", "IMG", ""]),
        (&ours, &theirs, vec!["--add", "-g", "1000", "IMG", "g"]),
        (&ours, &theirs, vec!["--add", "-g", "256", "IMG", "g"]),
        (&ours, &theirs, vec!["--add", "-g", "4G", "IMG", "g"]),
        (&ours, &theirs, vec!["--add", "-g", "3G", "IMG", "g"]),
        (&ours, &theirs, vec!["--add", "-g", "abc", "IMG", "g"]),
        (&ours, &theirs, vec!["--add", "-g", "-1", "IMG", "g"]),
        (&ours, &theirs, vec!["--remove", "-g", "64k", "IMG", "b0"]),
        (&big, &big2, vec!["--add", "-g", "512", "IMG", "g"]),
        (&v2, &v2b, vec!["--add", "IMG", "g"]),
        (&v2, &v2b, vec!["--remove", "IMG", "g"]),
    ] {
        let (o, t) = both_out(o_img, t_img, &args);
        assert_eq!(t.status.code(), Some(1), "qemu-img {args:?}: {t:?}");
        assert_eq!(o.status.code(), Some(1), "ours {args:?}: {o:?}");
        if !args.contains(&"-g") || args.contains(&"--add") {
            if args.contains(&"abc") || args.contains(&"-1") {
                // Parse errors: qemu-img's own words, ours prefixed like every error.
                assert!(String::from_utf8_lossy(&o.stderr).contains("Invalid granularity"));
            } else {
                same_message(&o, &t);
            }
        }
    }
    alike(&ours, &theirs);
    // The largest granularity, and one qemu-img takes as 64 KiB (4G + 64k cut to 32 bits).
    both(&ours, &theirs, &["--add", "-g", "2G", "IMG", "huge"]);
    both(
        &ours,
        &theirs,
        &["--add", "-g", "4194368k", "IMG", "wrapped"],
    );
    both(&ours, &theirs, &["--add", "-g", "0", "IMG", "dflt"]);
    alike(&ours, &theirs);
}

#[test]
fn a_bitmap_left_in_use_is_removed_as_qemu_img_removes_it() {
    let d = tempfile::tempdir().unwrap();
    let (ours, theirs) = pair(d.path(), "64k", None);
    for img in [&ours, &theirs] {
        qemu_img(&["bitmap", "--add", "-g", "512", s(img), "b0"]);
        qemu_io(img, &["write -P 9 0 40M"]);
        qemu_img(&["bitmap", "--add", s(img), "b1"]);
        // b0 (the first directory entry) marked in use: a writer that never closed.
        let mut bytes = std::fs::read(img).unwrap();
        let magic = 0x2385_2875u32.to_be_bytes();
        let at = bytes.windows(4).position(|w| w == magic).unwrap();
        let dir = u64::from_be_bytes(bytes[at + 24..at + 32].try_into().unwrap()) as usize;
        bytes[dir + 15] |= 1;
        std::fs::write(img, &bytes).unwrap();
    }
    let flags = |img: &Path| bitmaps(img)[0]["flags"].clone();
    assert_eq!(flags(&ours), serde_json::json!(["in-use", "auto"]));
    let (o, t) = both_out(&ours, &theirs, &["--clear", "IMG", "b0"]);
    assert_eq!((o.status.code(), t.status.code()), (Some(1), Some(1)));
    both(&ours, &theirs, &["--remove", "IMG", "b0"]);
    alike(&ours, &theirs);
    both(&ours, &theirs, &["--remove", "IMG", "b1"]);
    alike(&ours, &theirs);
}

#[test]
fn no_room_for_the_extension_is_refused_before_anything_is_written() {
    // 512-byte clusters: the header cluster is one sector, and a long backing file name
    // fills it (QEMU fails the same add at close, "No space left on device").
    let d = tempfile::tempdir().unwrap();
    let sub = d.path().join("a".repeat(200));
    std::fs::create_dir(&sub).unwrap();
    let base = sub.join("b".repeat(140));
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "64M"]);
    let ours = d.path().join("ours.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "cluster_size=512",
        "-b",
        s(&base),
        "-F",
        "qcow2",
        s(&ours),
        "64M",
    ]);
    let theirs = d.path().join("theirs.qcow2");
    std::fs::copy(&ours, &theirs).unwrap();
    let before = std::fs::read(&ours).unwrap();
    let (o, t) = both_out(&ours, &theirs, &["--add", "IMG", "b"]);
    assert_eq!((o.status.code(), t.status.code()), (Some(1), Some(1)));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("would not fit"),
        "{o:?}"
    );
    assert!(std::fs::read(&ours).unwrap() == before, "the image changed");
    clean(&ours);
    assert!(bitmaps(&ours).is_null());
}
