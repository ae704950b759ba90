//! The guard rails of a shared golden bdev (issue #46): a golden bdev that something holds
//! open for writing is refused as a backing bdev (shared or not: the overlay's read-only
//! claim, `READ_MANY_WRITE_NONE`, cannot coexist with a writer), and while overlays read
//! it nothing can open it for writing; the overlays' writes never reach it; the stream of
//! one overlay leaves the others sharing its cache.

use super::*;

const GOLDEN: u64 = 32 * MIB;

/// The `backing_cache` object of bdev `name` in `bdev_qcow2_get_stats`.
fn cache_stats(sock: &Path, name: &str) -> Value {
    plugin_json(sock, &["bdev_qcow2_get_stats", "-b", name])[0]["backing_cache"].clone()
}

fn overlay_args<'a>(name: &'a str, base: &'a str) -> [&'a str; 7] {
    [
        "bdev_qcow2_overlay_create",
        "-b",
        name,
        "--base-bdev",
        base,
        "--backing-bdev",
        "gold",
    ]
}

#[test]
fn a_golden_bdev_open_for_writing_is_refused_and_no_writer_opens_a_shared_one() {
    require!("spdk_tgt");
    require_rpc!();
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let golden = d.join("golden.raw");
    let bytes = golden_bytes(GOLDEN as usize, 0x901d);
    fs::write(&golden, &bytes).unwrap();

    let t = Target::start(d, "guard", None);
    // A writable AIO bdev: the guard is the claim, not the bdev's own read-only flag.
    t.rpc(&["bdev_aio_create", s(&golden), "gold", "512"]);
    for m in ["m0", "m1", "m2"] {
        t.rpc(&["bdev_malloc_create", "-b", m, "64", "512"]);
    }
    // Exported writable over NVMe-oF: the subsystem holds the golden bdev open for writing.
    let nqn = "nqn.2016-06.io.spdk:guard";
    t.rpc(&["nvmf_create_subsystem", nqn, "-a"]);
    t.rpc(&["nvmf_subsystem_add_ns", nqn, "gold"]);
    let (ok, text) = t.try_rpc(&overlay_args("vm0", "m0"));
    assert!(
        !ok,
        "an overlay over a golden bdev open for writing: {text}"
    );
    assert!(t.bdev("vm0").is_none(), "a refused overlay registered");
    // (The export holds its own claim: SPDK's NVMe-oF target claims what it exports.)
    let g = t.bdev("gold").unwrap();
    assert_eq!(g["claim_type"], json!("exclusive_write"), "{g}");

    // The writer gone, two overlays share it.
    t.rpc(&["nvmf_subsystem_remove_ns", nqn, "1"]);
    // The refused overlay left no claim behind.
    assert_eq!(t.bdev("gold").unwrap()["claimed"], json!(false));
    t.rpc(&overlay_args("vm0", "m0"));
    t.rpc(&overlay_args("vm1", "m1"));
    let g = t.bdev("gold").unwrap();
    assert_eq!(g["claimed"], json!(true), "{g}");
    assert_eq!(g["claim_type"], json!("read_many_write_none"), "{g}");
    let c = cache_stats(&t.sock, "vm1");
    assert_eq!(c["sharers"], json!(2), "{c}");

    // Nothing can open it for writing while they read it: not an NVMe-oF namespace, not
    // a bdev module that claims its base for writing.
    let (ok, text) = t.try_rpc(&["nvmf_subsystem_add_ns", nqn, "gold"]);
    assert!(!ok, "a shared golden bdev exported writable: {text}");
    let (ok, text) = t.try_rpc(&["bdev_passthru_create", "-b", "gold", "-p", "pt"]);
    assert!(!ok, "a shared golden bdev claimed by passthru: {text}");
    assert!(t.bdev("pt").is_none());
    // A third overlay still joins.
    t.rpc(&overlay_args("vm2", "m2"));
    assert_eq!(cache_stats(&t.sock, "vm0")["sharers"], json!(3));
    t.stop();
    assert!(
        fs::read(&golden).unwrap() == bytes,
        "the golden image changed"
    );
    say("golden guard: refused while exported writable; once shared, no writable export or passthru claim; the golden image unchanged");
}

#[test]
fn overlays_writes_never_reach_the_golden_bdev_and_a_stream_leaves_the_others_sharing() {
    require!("bdevperf");
    require_rpc!();
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let golden = d.join("golden.raw");
    let bytes = golden_bytes(GOLDEN as usize, 0x5ab1e);
    fs::write(&golden, &bytes).unwrap();
    let mut calls = vec![aio(&golden, "gold")];
    for i in 0..3 {
        let (m, vm) = (format!("m{i}"), format!("vm{i}"));
        calls.push(json!({"method": "bdev_malloc_create",
                          "params": {"name": m, "num_blocks": 2 * GOLDEN / 512, "block_size": 512}}));
        calls.push(json!({"method": "bdev_qcow2_overlay_create",
                          "params": {"name": vm, "base_bdev": m, "backing_bdev": "gold"}}));
    }
    let cfg = d.join("gw.json");
    write_config(&cfg, calls);
    // Every overlay (the golden and malloc bdevs are claimed), two cores, reading.
    let job = [
        "-q", "8", "-o", "65536", "-w", "read", "-t", "1", "-m", "0x3",
    ];
    bdevperf_driven_with(d, &cfg, "gw", &job, |sock, perform| {
        let failed = |r: &Value| {
            r["results"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|j| j["io_failed"].as_f64().unwrap_or(0.0))
                        .sum()
                })
                .unwrap_or(-1.0)
        };
        let r = perform(&[]);
        assert_eq!(failed(&r), 0.0, "{r}");
        let c = cache_stats(sock, "vm1");
        assert_eq!(c["sharers"], json!(3), "{c}");
        assert!(c["hits"].as_u64().unwrap_or(0) > 0, "{c}");

        // vm0 streams the golden image into itself and drops it.
        let (ok, text) = plugin_rpc(sock, &["bdev_qcow2_stream", "-b", "vm0"]);
        assert!(ok, "bdev_qcow2_stream: {text}");
        wait_stream_done("vm0", |a| plugin_rpc(sock, a));
        let (_, all) = plugin_rpc(sock, &["bdev_qcow2_get_stats", "-b", "vm0"]);
        assert!(
            cache_stats(sock, "vm0").is_null(),
            "vm0 still shares: {all}"
        );
        let before = cache_stats(sock, "vm1");
        assert_eq!(before["sharers"], json!(2), "{before}");
        let read_before = iostat(sock, "gold")["bytes_read"].as_u64().unwrap();

        // The two left still share: their reads hit, the golden bdev serves at most one
        // image more.
        let r = perform(&[]);
        assert_eq!(failed(&r), 0.0, "{r}");
        let after = cache_stats(sock, "vm1");
        assert_eq!(after["sharers"], json!(2), "{after}");
        assert!(
            after["hits"].as_u64() > before["hits"].as_u64(),
            "{before} -> {after}"
        );
        let served = iostat(sock, "gold")["bytes_read"].as_u64().unwrap() - read_before;
        assert!(
            served as f64 <= 1.1 * GOLDEN as f64,
            "the golden bdev served {served} bytes to two sharing overlays"
        );

        // Writes (and reads) on every overlay: none reaches the golden bdev.
        let r = perform(&["-w", "randrw", "-M", "50", "-t", "2"]);
        assert_eq!(failed(&r), 0.0, "{r}");
        for vm in ["vm0", "vm1", "vm2"] {
            let v = iostat(sock, vm);
            assert!(
                v["bytes_written"].as_u64().unwrap_or(0) > 0,
                "{vm} wrote nothing: {v}"
            );
        }
        let g = iostat(sock, "gold");
        assert_eq!(g["bytes_written"], json!(0), "{g}");
        say(&format!(
            "golden guard: 3 overlays wrote, the golden bdev none; after vm0's stream the other two share ({before} -> {after}), gold served {served} bytes"
        ));
    });
    assert!(
        fs::read(&golden).unwrap() == bytes,
        "the golden image changed"
    );
}
