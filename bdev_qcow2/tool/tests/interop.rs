//! Interop matrix against the QEMU oracle: images are built at test time with `qemu-img`
//! and `qemu-io`; for each, `qcow2 convert -O raw` must be byte-identical to
//! `qemu-img convert -O raw`, and `qcow2 map --output=json` must equal
//! `qemu-img map --output=json`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use qcow2_tool::rng::Rng;
use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{qemu_img, qemu_io_clean, run};

const QCOW2: &str = env!("CARGO_BIN_EXE_qcow2");

/// Runs qemu-io commands (one process, many `-c`) on a qcow2 image. Commands may name
/// `RAND`, replaced by a file of random bytes next to the image (for `write -s`).
fn qemu_io(img: &Path, cmds: &[String]) {
    let rand = img.with_file_name("random.bin");
    if !rand.exists() {
        let mut r = Rng(0x1234_5678);
        let data: Vec<u8> = (0..8 << 20).map(|_| r.next() as u8).collect();
        std::fs::write(&rand, data).expect("write random data");
    }
    let cmds: Vec<String> = cmds
        .iter()
        .map(|c| c.replace("RAND", rand.to_str().expect("utf-8")))
        .collect();
    qemu_io_clean(img, "qcow2", &cmds);
}

/// A random workload of writes (constant patterns, and random bytes so that data misplaced
/// within a cluster shows), zero writes (with and without unmap) and discards, 512-byte
/// aligned, sizes from one sector to several clusters.
fn workload(seed: u64, size: u64, cluster: u64, n: usize) -> Vec<String> {
    let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let sectors = size / 512;
    let mut cmds = Vec::new();
    for _ in 0..n {
        let max_len = (cluster * 3 / 512).clamp(1, 8192);
        let len = (1 + r.below(max_len)).min(sectors) * 512;
        let off = r.below(sectors - len / 512 + 1) * 512;
        let cmd = match r.below(10) {
            0 => format!("write -z {off} {len}"),
            1 => format!("write -z -u {off} {len}"),
            2 => format!("discard {off} {len}"),
            3 | 4 => format!("write -s RAND {off} {len}"),
            _ => format!("write -P {} {off} {len}", 1 + r.below(254)),
        };
        cmds.push(cmd);
    }
    cmds
}

struct Case {
    dir: tempfile::TempDir,
}

impl Case {
    fn new() -> Case {
        Case {
            dir: tempfile::tempdir().expect("tempdir"),
        }
    }
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
    /// `qemu-img create -f qcow2 -o OPTS name size`.
    fn create(&self, name: &str, opts: &str, size: &str) -> PathBuf {
        let p = self.path(name);
        let ps = p.to_str().expect("utf-8 path");
        if opts.is_empty() {
            qemu_img(&["create", "-q", "-f", "qcow2", ps, size]);
        } else {
            qemu_img(&["create", "-q", "-f", "qcow2", "-o", opts, ps, size]);
        }
        p
    }

    /// Asserts our convert and map equal qemu-img's for `img`.
    fn check(&self, img: &Path, extra: &[&str]) {
        let ours = self.path("ours.raw");
        let theirs = self.path("theirs.raw");
        let img_s = img.to_str().expect("utf-8 path");
        run(Command::new(QCOW2)
            .arg("convert")
            .args(extra)
            .arg("-O")
            .arg("raw")
            .arg(img)
            .arg(&ours));
        qemu_img(&[
            "convert",
            "-O",
            "raw",
            img_s,
            theirs.to_str().expect("utf-8"),
        ]);
        let a = std::fs::read(&ours).expect("read ours");
        let b = std::fs::read(&theirs).expect("read theirs");
        assert_eq!(a.len(), b.len(), "raw size differs for {img_s}");
        if let Some(i) = a.iter().zip(&b).position(|(x, y)| x != y) {
            panic!(
                "{img_s}: convert differs from qemu-img at byte {i} ({:#x} vs {:#x})",
                a[i], b[i]
            );
        }

        let ours = run(Command::new(QCOW2)
            .arg("map")
            .arg("--output=json")
            .args(extra)
            .arg(img));
        let theirs = qemu_img(&["map", "--output=json", img_s]);
        let o: serde_json::Value = serde_json::from_slice(&ours.stdout).expect("our map is JSON");
        let t: serde_json::Value =
            serde_json::from_slice(&theirs.stdout).expect("qemu map is JSON");
        if o != t {
            let os = String::from_utf8_lossy(&ours.stdout);
            let ts = String::from_utf8_lossy(&theirs.stdout);
            let first = os.lines().zip(ts.lines()).position(|(a, b)| a != b);
            panic!("{img_s}: map differs (first differing line {first:?})\nours:\n{os}\nqemu-img:\n{ts}");
        }
        // Byte-identical text too, since we print it the same way.
        assert_eq!(ours.stdout, theirs.stdout, "{img_s}: map text differs");
    }
}

/// Builds an image with `opts`, runs a seeded workload on it and compares.
fn matrix_case(opts: &str, size: &str, cluster: u64, seed: u64, ops: usize) {
    let c = Case::new();
    let img = c.create("img.qcow2", opts, size);
    let size_b = qcow2_tool::parse_size(size).expect("size");
    qemu_io(&img, &workload(seed, size_b, cluster, ops));
    c.check(&img, &[]);
}

#[test]
fn cluster_512() {
    matrix_case("cluster_size=512", "8M", 512, 1, 300);
}

#[test]
fn cluster_4k() {
    matrix_case("cluster_size=4096", "32M", 4096, 2, 300);
}

#[test]
fn cluster_64k() {
    matrix_case("cluster_size=65536", "64M", 65536, 3, 300);
}

#[test]
fn cluster_2m() {
    matrix_case("cluster_size=2M", "256M", 2 << 20, 4, 120);
}

#[test]
fn compat_0_10() {
    // Version 2: no zero flag; qemu-io's write -z allocates zeroed data instead.
    matrix_case("compat=0.10", "64M", 65536, 5, 300);
}

#[test]
fn compat_0_10_small_clusters() {
    matrix_case("compat=0.10,cluster_size=4096", "16M", 4096, 6, 300);
}

#[test]
fn refcount_bits_1() {
    matrix_case("refcount_bits=1", "64M", 65536, 7, 200);
}

#[test]
fn refcount_bits_64() {
    matrix_case("refcount_bits=64", "64M", 65536, 8, 200);
}

#[test]
fn extended_l2_64k() {
    matrix_case("extended_l2=on", "64M", 65536, 9, 400);
}

#[test]
fn extended_l2_16k() {
    matrix_case("extended_l2=on,cluster_size=16384", "32M", 16384, 10, 400);
}

#[test]
fn extended_l2_2m() {
    matrix_case("extended_l2=on,cluster_size=2M", "256M", 2 << 20, 11, 150);
}

#[test]
fn l2_slices_smaller_than_table_and_tiny_cache() {
    // The same image read through a 1-way, 2-slice cache with 512-byte slices: forces
    // evictions on nearly every cluster.
    let c = Case::new();
    let img = c.create("img.qcow2", "cluster_size=65536", "64M");
    qemu_io(&img, &workload(12, 64 << 20, 65536, 300));
    c.check(
        &img,
        &[
            "--l2-cache-size",
            "1k",
            "--l2-slice-size",
            "512",
            "--cache-ways",
            "1",
        ],
    );
    c.check(&img, &["--l2-slice-size", "65536"]);
}

/// `extra`: further options of the compressed image (`,extended_l2=on`).
fn compressed_case(compression: &str, cluster: &str, extra: &str) {
    let c = Case::new();
    let src = c.create("src.qcow2", &format!("cluster_size={cluster}"), "32M");
    let cl = qcow2_tool::parse_size(cluster).expect("size");
    // Compressible patterns plus some random-looking data that does not compress.
    let mut cmds = workload(13, 32 << 20, cl, 150);
    cmds.push("write -P 0x5a 1M 1M".into());
    qemu_io(&src, &cmds);
    let dst = c.path("c.qcow2");
    qemu_img(&[
        "convert",
        "-c",
        "-O",
        "qcow2",
        "-o",
        &format!("compression_type={compression},cluster_size={cluster}{extra}"),
        src.to_str().expect("utf-8"),
        dst.to_str().expect("utf-8"),
    ]);
    c.check(&dst, &[]);
    // Partly overwritten compressed image: compressed and plain clusters side by side.
    qemu_io(&dst, &workload(14, 32 << 20, cl, 60));
    c.check(&dst, &[]);
}

#[test]
fn compressed_zlib() {
    compressed_case("zlib", "65536", "");
}

#[test]
fn compressed_zlib_4k() {
    compressed_case("zlib", "4096", "");
}

#[test]
fn compressed_zstd() {
    compressed_case("zstd", "65536", "");
}

#[test]
fn compressed_zstd_2m() {
    compressed_case("zstd", "2M", "");
}

// Compressed clusters in extended-L2 images (QEMU writes them; their bitmap is 0), and
// qemu-io's subcluster writes over them.
#[test]
fn compressed_zlib_extended_l2_16k() {
    compressed_case("zlib", "16384", ",extended_l2=on");
}

#[test]
fn compressed_zstd_extended_l2_16k() {
    compressed_case("zstd", "16384", ",extended_l2=on");
}

#[test]
fn compressed_zlib_extended_l2_64k() {
    compressed_case("zlib", "65536", ",extended_l2=on");
}

#[test]
fn compressed_zstd_extended_l2_64k() {
    compressed_case("zstd", "65536", ",extended_l2=on");
}

#[test]
fn internal_snapshots_present() {
    let c = Case::new();
    let img = c.create("img.qcow2", "", "64M");
    qemu_io(&img, &workload(15, 64 << 20, 65536, 150));
    let s = img.to_str().expect("utf-8");
    qemu_img(&["snapshot", "-c", "snap1", s]);
    qemu_io(&img, &workload(16, 64 << 20, 65536, 150));
    qemu_img(&["snapshot", "-c", "snap2", s]);
    qemu_io(&img, &workload(17, 64 << 20, 65536, 100));
    c.check(&img, &[]);
    // info lists the snapshots like qemu-img.
    let ours = run(Command::new(QCOW2)
        .args(["info", "--output=json"])
        .arg(&img));
    let v: serde_json::Value = serde_json::from_slice(&ours.stdout).expect("json");
    let names: Vec<&str> = v["snapshots"]
        .as_array()
        .expect("snapshots")
        .iter()
        .filter_map(|s| s["name"].as_str())
        .collect();
    assert_eq!(names, ["snap1", "snap2"]);
}

/// Backing chain of depth 3 (base ← mid ← top) with writes at every level.
fn chain_case(opts: &str, cluster: u64, base_raw: bool) {
    let c = Case::new();
    let size = 64u64 << 20;
    let base = if base_raw {
        let p = c.path("base.raw");
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "raw",
            p.to_str().expect("utf-8"),
            "64M",
        ]);
        let mut cmds = Vec::new();
        let mut r = Rng(99);
        for _ in 0..40 {
            let off = r.below(size / 65536) * 65536;
            cmds.push(format!("write -P {} {off} 65536", 1 + r.below(200)));
        }
        let mut q = Command::new("qemu-io");
        q.args(["-f", "raw"]);
        for x in &cmds {
            q.arg("-c").arg(x);
        }
        run(q.arg(&p));
        p
    } else {
        let p = c.create("base.qcow2", opts, "64M");
        qemu_io(&p, &workload(21, size, cluster, 150));
        p
    };
    let base_fmt = if base_raw { "raw" } else { "qcow2" };
    let mid = c.path("mid.qcow2");
    let mut o = format!(
        "backing_file={},backing_fmt={base_fmt}",
        base.file_name().and_then(|n| n.to_str()).expect("name")
    );
    if !opts.is_empty() {
        o = format!("{o},{opts}");
    }
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        &o,
        mid.to_str().expect("utf-8"),
    ]);
    qemu_io(&mid, &workload(22, size, cluster, 150));
    let top = c.path("top.qcow2");
    let mut o = "backing_file=mid.qcow2,backing_fmt=qcow2".to_string();
    if !opts.is_empty() {
        o = format!("{o},{opts}");
    }
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        &o,
        top.to_str().expect("utf-8"),
    ]);
    qemu_io(&top, &workload(23, size, cluster, 150));
    c.check(&top, &["--allow-backing"]);
    c.check(&mid, &["--allow-backing"]);
}

#[test]
fn backing_chain_depth_3() {
    chain_case("", 65536, false);
}

#[test]
fn backing_chain_depth_3_extended_l2() {
    chain_case("extended_l2=on", 65536, false);
}

#[test]
fn backing_chain_depth_3_small_clusters_v2() {
    chain_case("compat=0.10,cluster_size=4096", 4096, false);
}

#[test]
fn backing_chain_raw_base() {
    chain_case("", 65536, true);
}

#[test]
fn backing_smaller_than_top() {
    // The top image is larger than its backing image: past the backing's end reads zeros.
    let c = Case::new();
    let base = c.create("base.qcow2", "", "8M");
    qemu_io(&base, &workload(31, 8 << 20, 65536, 60));
    let top = c.path("top.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "backing_file=base.qcow2,backing_fmt=qcow2",
        top.to_str().expect("utf-8"),
        "16M",
    ]);
    qemu_io(
        &top,
        &[
            "write -P 7 7M 2M".to_string(),
            "write -P 9 12M 64k".to_string(),
        ],
    );
    c.check(&top, &["--allow-backing"]);
}

#[test]
fn backing_files_need_permission() {
    let c = Case::new();
    let base = c.create("base.qcow2", "", "4M");
    let top = c.path("top.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "backing_file=base.qcow2,backing_fmt=qcow2",
        top.to_str().expect("utf-8"),
    ]);
    let _ = base;
    for sub in [&["map", "--output=json"][..], &["convert", "-O", "raw"][..]] {
        let mut cmd = Command::new(QCOW2);
        cmd.args(sub).arg(&top);
        if sub[0] == "convert" {
            cmd.arg(c.path("out.raw"));
        }
        let out = cmd.output().expect("run qcow2");
        assert!(
            !out.status.success(),
            "{sub:?} opened a backing file without --allow-backing"
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("backing files are not allowed"), "{err}");
        assert_eq!(err.lines().count(), 1, "one-line error expected: {err}");
    }
    // info never opens the backing file and works without the flag.
    let out = run(Command::new(QCOW2)
        .args(["info", "--output=json"])
        .arg(&top));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["backing-filename"], "base.qcow2");
    assert_eq!(v["backing-filename-format"], "qcow2");
}

#[test]
fn backing_loop_and_host_paths_refused() {
    let c = Case::new();
    // An image whose backing file is itself.
    let img = c.create("self.qcow2", "", "4M");
    let s = img.to_str().expect("utf-8");
    qemu_img(&["rebase", "-u", "-b", "self.qcow2", "-F", "qcow2", s]);
    let out = Command::new(QCOW2)
        .args(["map", "--output=json", "--allow-backing"])
        .arg(&img)
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("loop"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A backing name pointing at a host file is never opened without permission.
    qemu_img(&["rebase", "-u", "-b", "/etc/passwd", "-F", "raw", s]);
    let out = Command::new(QCOW2)
        .args(["convert", "-O", "raw"])
        .arg(&img)
        .arg(c.path("o.raw"))
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not allowed"));
}

#[test]
fn info_matches_qemu_img() {
    let c = Case::new();
    for (i, opts) in [
        "",
        "compat=0.10",
        "refcount_bits=1,cluster_size=4096",
        "extended_l2=on,compression_type=zstd",
        "lazy_refcounts=on,refcount_bits=64,cluster_size=2M",
    ]
    .iter()
    .enumerate()
    {
        let img = c.create(&format!("i{i}.qcow2"), opts, "100M");
        let ours = run(Command::new(QCOW2)
            .args(["info", "--output=json"])
            .arg(&img));
        let theirs = qemu_img(&["info", "--output=json", img.to_str().expect("utf-8")]);
        let o: serde_json::Value = serde_json::from_slice(&ours.stdout).expect("json");
        let t: serde_json::Value = serde_json::from_slice(&theirs.stdout).expect("json");
        for key in [
            "virtual-size",
            "cluster-size",
            "format",
            "dirty-flag",
            "filename",
        ] {
            assert_eq!(o[key], t[key], "{opts}: {key}");
        }
        for key in [
            "compat",
            "compression-type",
            "lazy-refcounts",
            "refcount-bits",
            "corrupt",
            "extended-l2",
        ] {
            assert_eq!(
                o["format-specific"]["data"][key], t["format-specific"]["data"][key],
                "{opts}: {key}"
            );
        }
    }
}

#[test]
fn errors_are_one_line_and_nonzero() {
    let c = Case::new();
    let p = c.path("garbage.qcow2");
    std::fs::write(&p, vec![0x42u8; 4096]).expect("write");
    for sub in [&["info"][..], &["map"][..], &["convert", "-O", "raw"][..]] {
        let mut cmd = Command::new(QCOW2);
        cmd.args(sub).arg(&p);
        if sub[0] == "convert" {
            cmd.arg(c.path("o.raw"));
        }
        let out = cmd.output().expect("run");
        assert_eq!(out.status.code(), Some(1), "{sub:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("not a qcow2 image"), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    let out = Command::new(QCOW2)
        .args(["info"])
        .arg(c.path("missing.qcow2"))
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
}

/// Punches a hole of `len` bytes at `off` into `path` (the file system deallocates it).
fn punch_hole(path: &Path, off: u64, len: u64) {
    run(Command::new("fallocate")
        .args(["-p", "-o", &off.to_string(), "-l", &len.to_string()])
        .arg(path));
}

#[test]
fn map_of_data_clusters_over_file_holes_agrees_with_qemu_img() {
    let c = Case::new();
    // Much data, one hole: not taken for metadata preallocation, so a data cluster is data
    // whatever its file bytes are.
    let img = c.create("many.qcow2", "", "16M");
    qemu_io(&img, &["write -P 1 0 8M".to_string()]);
    punch_hole(&img, 0x50000, 0x10000);
    c.check(&img, &[]);
    // Little data, a large hole: refcounts claim far more than the file holds, so QEMU
    // looks through to the file and the hole reads as zeros.
    let img = c.create("few.qcow2", "", "16M");
    qemu_io(
        &img,
        &[
            "write -P 1 0 1M".to_string(),
            "write -P 2 4M 256k".to_string(),
        ],
    );
    punch_hole(&img, 0x50000, 0x20000);
    c.check(&img, &[]);
    // Metadata preallocation: the clusters are all holes.
    let img = c.create("prealloc.qcow2", "preallocation=metadata", "16M");
    qemu_io(&img, &["write -P 3 64k 64k".to_string()]);
    c.check(&img, &[]);
}

#[test]
fn info_shows_the_zeroed_tail() {
    let c = Case::new();
    let img = c.path("tail.qcow2");
    let opts = qcow2_engine::create::CreateOptions {
        size: 64 << 20,
        zeroed_tail: true,
        ..Default::default()
    };
    qcow2_tool::cmd::create::format_image(&img, &opts).expect("format");
    let json = run(Command::new(QCOW2)
        .args(["info", "--output=json"])
        .arg(&img));
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).expect("json");
    let from = v["format-specific"]["data"]["zeroed-tail"]
        .as_u64()
        .expect("zeroed-tail in the JSON");
    let size = std::fs::metadata(&img).expect("stat").len();
    assert!(from > 0 && from <= size.max(from), "{v}");
    let human = run(Command::new(QCOW2).arg("info").arg(&img));
    let text = String::from_utf8_lossy(&human.stdout);
    assert!(
        text.contains(&format!(
            "zeroed tail: the device reads zeros from offset {from} "
        )),
        "{text}"
    );
    assert!(text.contains("autoclear features: [zeroed tail]"), "{text}");
    // QEMU writing the image voids the claim: info no longer shows it.
    qemu_io(&img, &["write -P 1 0 64k".to_string()]);
    let json = run(Command::new(QCOW2)
        .args(["info", "--output=json"])
        .arg(&img));
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).expect("json");
    assert!(
        v["format-specific"]["data"].get("zeroed-tail").is_none(),
        "{v}"
    );
}

#[test]
fn convert_of_a_raw_source_without_f_raw_says_to_add_it() {
    let c = Case::new();
    let src = c.path("disk.raw");
    std::fs::write(&src, vec![0u8; 1 << 20]).expect("write");
    let out = Command::new(QCOW2)
        .args(["convert", "-O", "raw"])
        .arg(&src)
        .arg(c.path("o.raw"))
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a qcow2 image"), "{err}");
    assert!(err.contains("add -f raw"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    // With -f raw it converts.
    run(Command::new(QCOW2)
        .args(["convert", "-f", "raw", "-O", "raw"])
        .arg(&src)
        .arg(c.path("o.raw")));
}

/// `convert -p` prints qemu-img's progress lines on stdout (a pipe here, not a terminal,
/// as qemu-img prints them anyway): from 0.00 to 100.00, then a newline; the output is
/// the same image with and without it, raw or qcow2.
#[test]
fn convert_progress_like_qemu_img() {
    let c = Case::new();
    let img = c.path("img.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", img.to_str().unwrap(), "24M"]);
    qemu_io(
        &img,
        &[
            "write -P 5 1M 3M".to_string(),
            "write -P 6 20M 64k".to_string(),
        ],
    );
    for fmt in ["raw", "qcow2"] {
        let out = c.path(&format!("out.{fmt}"));
        let theirs = qemu_img(&[
            "convert",
            "-p",
            "-O",
            fmt,
            img.to_str().unwrap(),
            out.to_str().unwrap(),
        ]);
        let ours = run(Command::new(QCOW2)
            .args(["convert", "-p", "-O", fmt])
            .arg(&img)
            .arg(&out));
        for o in [&ours, &theirs] {
            let text = String::from_utf8_lossy(&o.stdout);
            assert!(text.starts_with("    (0.00/100%)\r"), "{fmt}: {text:?}");
            assert!(text.ends_with("    (100.00/100%)\r\n"), "{fmt}: {text:?}");
            assert!(text.matches("/100%)\r").count() >= 3, "{fmt}: {text:?}");
        }
        let same = Command::new("qemu-img")
            .args([
                "compare",
                "-F",
                fmt,
                img.to_str().unwrap(),
                out.to_str().unwrap(),
            ])
            .status()
            .unwrap();
        assert!(same.success(), "{fmt}");
        // Without -p, nothing on stdout.
        let quiet = run(Command::new(QCOW2)
            .args(["convert", "-O", fmt])
            .arg(&img)
            .arg(&out));
        assert!(quiet.stdout.is_empty(), "{fmt}");
    }
}
