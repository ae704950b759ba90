//! Overlays on one golden bdev read it once for all of them: four qcow2 overlays (made by
//! `bdev_qcow2_format` with `backing_bdev`, on malloc bases) over one read-only qcow2
//! golden bdev, read sequentially by bdevperf on two cores; the golden bdev serves about
//! one golden image's bytes, where without the shared cache (`backing_cache_size: 0`) it
//! serves every overlay's. The cache's counters show in `bdev_qcow2_get_stats` and in
//! `bdev_get_bdevs`.

use super::*;

const GOLDEN: u64 = 32 * MIB;

/// bytes_read of bdev `name` (`bdev_get_iostat`).
fn bytes_read(sock: &Path, name: &str) -> u64 {
    let v = iostat(sock, name);
    v["bytes_read"]
        .as_u64()
        .unwrap_or_else(|| panic!("no bytes_read: {v}"))
}

/// `n` overlays over golden qcow2 image `golden`, with `cache` bytes of shared cache (`None`:
/// the default); returns (golden bytes read, bytes the overlays read, vm0's stats, vm0's
/// bdev).
fn storm(
    d: &Path,
    golden: &Path,
    n: usize,
    cache: Option<u64>,
    tag: &str,
) -> (u64, u64, Value, Value) {
    let cfg = d.join(format!("{tag}.json"));
    let mut calls = vec![aio(golden, "aio_golden")];
    let mut g = qcow2("golden", "aio_golden", None);
    g["params"]["read_only"] = json!(true);
    calls.push(g);
    for i in 0..n {
        let (m, vm) = (format!("m{i}"), format!("vm{i}"));
        calls.push(json!({"method": "bdev_malloc_create",
                          "params": {"name": m, "num_blocks": 2 * GOLDEN / 512, "block_size": 512}}));
        calls.push(json!({"method": "bdev_qcow2_format",
                          "params": {"base_bdev": m, "backing_bdev": "golden"}}));
        let mut c = qcow2(&vm, &m, Some("golden"));
        if let Some(cache) = cache {
            c["params"]["backing_cache_size"] = json!(cache);
        }
        calls.push(c);
    }
    write_config(&cfg, calls);
    let job = [
        "-q", "4", "-o", "131072", "-w", "read", "-t", "2", "-m", "0x3",
    ];
    let mut out = (0, 0, Value::Null, Value::Null);
    bdevperf_driven_with(d, &cfg, tag, &job, |sock, perform| {
        let r = perform(&[]);
        let golden_read = bytes_read(sock, "golden");
        let overlays: u64 = (0..n).map(|i| bytes_read(sock, &format!("vm{i}"))).sum();
        let stats = plugin_json(sock, &["bdev_qcow2_get_stats", "-b", "vm0"]);
        let bdev = plugin_json(sock, &["bdev_get_bdevs", "-b", "vm0"]);
        assert!(r["results"].is_array(), "{r}");
        out = (golden_read, overlays, stats[0].clone(), bdev[0].clone());
    });
    out
}

#[test]
fn four_overlays_read_their_golden_bdev_once() {
    require!("bdevperf");
    require_rpc!();
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let golden = d.join("golden.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&golden), "32M"]);
    qemu_io(&golden, &["write -P 0x61 0 32M"]);

    let (shared, read, stats, bdev) = storm(d, &golden, 4, Some(64 * MIB), "shared");
    let c = &stats["backing_cache"];
    say(&format!(
        "golden bdev read {} MiB for {} MiB read by 4 overlays with the shared cache; {c}",
        shared >> 20,
        read >> 20
    ));
    assert!(
        read >= 4 * GOLDEN,
        "every overlay read the whole disk: {read}"
    );
    assert!(
        shared as f64 <= 1.1 * GOLDEN as f64,
        "the golden bdev served {shared} bytes for a {GOLDEN}-byte image"
    );
    assert!(c["hits"].as_u64().unwrap_or(0) > 0, "{stats}");
    assert_eq!(c["sharers"], json!(4), "{stats}");
    // (What else the golden bdev served: the examine of new bdevs, the overlays' opens.)
    let filled = c["fill_bytes"].as_u64().unwrap_or(0);
    assert!(filled >= GOLDEN && filled <= shared, "{stats}");
    // Every fill read the golden bdev straight into its slot's DMA memory.
    assert_eq!(c["fills_in_place"], c["fills"], "{stats}");
    assert!(
        c["memory_bytes"].as_u64().unwrap_or(u64::MAX) <= 64 * MIB,
        "{stats}"
    );
    assert_eq!(
        bdev["driver_specific"]["qcow2"]["backing_cache"]["fills"], c["fills"],
        "bdev_get_bdevs shows the same cache: {bdev}"
    );

    let (alone, read, stats, _) = storm(d, &golden, 4, Some(0), "unshared");
    say(&format!(
        "without it: golden bdev read {} MiB for {} MiB read",
        alone >> 20,
        read >> 20
    ));
    assert!(stats["backing_cache"].is_null(), "{stats}");
    assert!(
        alone >= 4 * GOLDEN,
        "each overlay read the golden bdev itself: {alone}"
    );
}

#[test]
fn a_lone_overlay_reads_its_golden_bdev_directly() {
    require!("bdevperf");
    require_rpc!();
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let golden = d.join("golden.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&golden), "32M"]);
    qemu_io(&golden, &["write -P 0x61 0 32M"]);

    // The default cache (on): one overlay shares it with nobody, so it reads past it.
    let (golden_read, read, stats, _) = storm(d, &golden, 1, None, "alone");
    let c = &stats["backing_cache"];
    say(&format!(
        "one overlay: golden bdev read {} MiB for {} MiB; {c}",
        golden_read >> 20,
        read >> 20
    ));
    assert_eq!(c["sharers"], json!(1), "{stats}");
    assert_eq!(
        (
            c["fills"].as_u64(),
            c["hits"].as_u64(),
            c["memory_bytes"].as_u64()
        ),
        (Some(0), Some(0), Some(0)),
        "{stats}"
    );
    assert!(
        c["capacity_bytes"].as_u64() == Some(256 * MIB),
        "the default size: {stats}"
    );
    assert!(
        golden_read >= GOLDEN,
        "it read the golden bdev itself: {golden_read}"
    );
}
