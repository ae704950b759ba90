//! `qcow2 perf`: runs, reports the documented JSON keys, and its verify workload finds no
//! mismatch (data written through the engine reads back).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use std::process::Command;

const QCOW2: &str = env!("CARGO_BIN_EXE_qcow2");

fn perf(args: &[&str]) -> Vec<serde_json::Value> {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(QCOW2)
        .arg("perf")
        .args(["--json", "-t", "0.5", "--sample-size", "64M"])
        .args(args)
        .env("TMPDIR", dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn randread_reports_qcow2_and_raw_side_by_side() {
    let runs = perf(&["-w", "randread", "-q", "8"]);
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0]["target"], "qcow2");
    assert_eq!(runs[1]["target"], "raw");
    for r in &runs {
        for k in [
            "iops",
            "mibps",
            "lat_avg_us",
            "lat_p99_us",
            "cache_hits",
            "cache_misses",
            "cache_evictions",
        ] {
            assert!(r[k].is_number(), "missing {k}: {r}");
        }
        assert!(r["iops"].as_f64().unwrap() > 0.0);
    }
    // Metadata was cached before the timed run: no misses while it ran.
    assert!(runs[0]["cache_hits"].as_u64().unwrap() > 0);
}

#[test]
fn verify_finds_no_mismatch() {
    for size in ["4k", "64k"] {
        let runs = perf(&["-w", "verify", "-s", size, "-q", "16"]);
        assert_eq!(runs[0]["verify_failures"], 0, "{size}");
        assert!(runs[0]["iops"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn fresh_writes_into_an_empty_image_against_an_empty_raw_file() {
    // Without -w, --fresh runs random writes; 4 KiB and 64 KiB clusters.
    for cs in ["cluster_size=4k", "cluster_size=64k"] {
        let runs = perf(&["--fresh", "-o", cs, "-q", "8"]);
        assert_eq!(runs.len(), 2, "{cs}");
        assert_eq!(runs[0]["target"], "qcow2");
        assert_eq!(runs[0]["workload"], "randwrite");
        assert_eq!(runs[1]["target"], "raw");
        assert!(runs.iter().all(|r| r["iops"].as_f64().unwrap() > 0.0));
        // Every request writes the device at least once; the raw file exactly once.
        for r in &runs {
            let (w, ops) = (r["device_writes"].as_u64(), r["ops"].as_u64());
            assert!(w.unwrap() >= ops.unwrap() && ops.unwrap() > 0, "{cs}: {r}");
        }
        assert_eq!(runs[1]["device_writes"], runs[1]["ops"], "{cs}");
    }
    // Verify also runs on it (written data reads back).
    let runs = perf(&["--fresh", "-w", "verify", "-q", "8"]);
    assert_eq!(runs[0]["verify_failures"], 0);
    // A given image is not made fresh.
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("x.qcow2");
    let out = Command::new(QCOW2)
        .args(["perf", "--fresh", img.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--fresh makes its own image"));
}

#[test]
fn two_cores_read_and_mixed_workloads_run() {
    let runs = perf(&["-w", "randread", "--cores", "2"]);
    assert_eq!(runs[0]["cores"], 2);
    let runs = perf(&["-w", "randrw", "-M", "70", "--base-latency-us", "50"]);
    assert!(runs[0]["iops"].as_f64().unwrap() > 0.0);
}

#[test]
fn cold_sequential_reads_load_slices_ahead() {
    // No warm-up, 512-byte slices (64 KiB clusters: 4 MiB per slice), 64 KiB sequential
    // reads: read-ahead loads each next slice before the stream reaches it, on one core
    // and on each core of two.
    for cores in ["1", "2"] {
        let args = [
            "-w",
            "read",
            "-s",
            "64k",
            "-q",
            "1",
            "--cold",
            "--l2-slice-size",
            "512",
            "--cores",
            cores,
        ];
        let runs = perf(&args);
        let q = &runs[0];
        assert_eq!(q["target"], "qcow2");
        let loaded = q["prefetch_loaded"].as_u64().unwrap();
        let hits = q["prefetch_hits"].as_u64().unwrap();
        assert!(loaded > 0 && hits > 0 && hits <= loaded, "{q}");
        // Off: nothing is loaded ahead, every slice is a miss of the stream itself.
        let runs = perf(&[&args[..], &["--prefetch", "off"]].concat());
        assert_eq!(runs[0]["prefetch_loaded"], 0, "{}", runs[0]);
        assert!(runs[0]["cache_misses"].as_u64().unwrap() > 0);
    }
}

#[test]
fn thrash_reports_miss_rate_and_the_one_read_per_miss_bound() {
    // 64 MiB, 64 KiB clusters, 512 B slices (4 MiB each): 16 slices; 2 ways so that a
    // quarter of them (4) is two sets.
    let runs = perf(&[
        "--thrash",
        "25,50",
        "--l2-slice-size",
        "512",
        "--cache-ways",
        "2",
        "-q",
        "8",
    ]);
    assert_eq!(runs.len(), 2);
    for (r, pct) in runs.iter().zip([25u64, 50]) {
        assert_eq!(r["percent"].as_u64().unwrap(), pct);
        assert_eq!(r["image_slices"].as_u64().unwrap(), 16);
        assert_eq!(r["l2_cache_size"].as_u64().unwrap(), 16 * 512 * pct / 100);
        assert_eq!(r["cache_slices"].as_u64().unwrap(), 16 * pct / 100);
        // Uniform random reads over the disk: a cache of a fraction f misses 1 - f of them.
        let miss = r["miss_rate"].as_f64().unwrap();
        let want = 1.0 - pct as f64 / 100.0;
        assert!((miss - want).abs() < 0.1, "{pct}%: miss rate {miss}");
        // The whole-cache run never misses; the bound follows from the two runs.
        assert_eq!(r["run_hit"]["cache_misses"].as_u64().unwrap(), 0);
        let (iops, hit) = (r["iops"].as_f64().unwrap(), r["iops_hit"].as_f64().unwrap());
        assert!(iops > 0.0 && hit > 0.0);
        let bound = hit / (1.0 + miss);
        assert!((r["bound"].as_f64().unwrap() - bound).abs() < 1e-6 * bound);
        assert!((r["ratio"].as_f64().unwrap() - iops / bound).abs() < 1e-6);
        assert_eq!(r["run"]["target"], "qcow2");
    }
}

#[test]
fn o_formats_the_sample_image_as_create_does() {
    // 4 KiB clusters: a 512 B slice maps 64 clusters (256 KiB), so 64 MiB is 256 slices
    // (64 KiB clusters would make 16).
    let runs = perf(&[
        "-o",
        "cluster_size=4k",
        "-o",
        "refcount_bits=1",
        "--thrash",
        "50",
        "--l2-slice-size",
        "512",
        "-q",
        "8",
    ]);
    assert_eq!(runs[0]["image_slices"].as_u64().unwrap(), 256);
    // `size=` sets the sample's size, over --sample-size (64M here).
    let runs = perf(&[
        "-o",
        "size=32M,cluster_size=4k",
        "--thrash",
        "50",
        "--l2-slice-size",
        "512",
    ]);
    assert_eq!(runs[0]["image_slices"].as_u64().unwrap(), 128);
}

#[test]
fn o_refuses_what_create_refuses_and_what_a_sample_cannot_be() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("x.qcow2");
    for (args, want) in [
        (
            vec!["-o", "cluster_size=3k"],
            "Cluster size must be a power of two",
        ),
        (vec!["-o", "bogus=1"], "Invalid parameter 'bogus'"),
        (
            vec!["-o", "preallocation=full"],
            "preallocation does not apply",
        ),
        (
            vec!["-o", "backing_file=b.qcow2,backing_fmt=qcow2"],
            "no backing file",
        ),
        (
            vec!["-o", "cluster_size=4k", img.to_str().unwrap()],
            "does not apply to a given image",
        ),
    ] {
        let out = Command::new(QCOW2)
            .arg("perf")
            .args(&args)
            .env("TMPDIR", dir.path())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
    // Nothing was created for the refused runs.
    assert!(!img.exists());
}
