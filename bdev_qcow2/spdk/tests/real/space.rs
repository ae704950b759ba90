//! Thin stays thin on a thin lvol, and the space a qcow2 bdev takes is reported: a guest
//! writes, then unmaps and flushes; the lvol's allocated clusters drop back, and
//! `bdev_qcow2_get_stats`' `owner.space` follows (clusters in use, the image's end, the
//! base's size, what is free, the threshold of `space_warn_percent` and its warning).

use super::*;

/// `owner.space` of q0 in `bdev_qcow2_get_stats`.
fn space(sock: &Path) -> Value {
    let v = q0_stats(sock);
    let s = v["owner"]["space"].clone();
    assert!(s.is_object(), "no owner.space: {v}");
    s
}

/// The clusters the thin lvol lvs/lv has allocated.
fn lvol_clusters(sock: &Path) -> u64 {
    let v = plugin_json(sock, &["bdev_get_bdevs", "-b", "lvs/lv"]);
    v[0]["driver_specific"]["lvol"]["num_allocated_clusters"]
        .as_u64()
        .unwrap_or_else(|| panic!("no num_allocated_clusters: {v}"))
}

#[test]
fn a_thin_lvol_gets_its_clusters_back_and_get_stats_reports_the_space() {
    require!("bdevperf");
    require_rpc!();
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A 64 MiB thin lvol (1 MiB clusters) under a 32 MiB image, warned about at half.
    let cfg = d.join("thin.json");
    let mut create = qcow2("q0", "lvs/lv", None);
    create["params"]["space_warn_percent"] = json!(50);
    write_config(
        &cfg,
        vec![
            json!({"method": "bdev_malloc_create",
                   "params": {"name": "m0", "num_blocks": 128 * 2048, "block_size": 512}}),
            json!({"method": "bdev_lvol_create_lvstore",
                   "params": {"bdev_name": "m0", "lvs_name": "lvs", "cluster_sz": MIB}}),
            json!({"method": "bdev_lvol_create",
                   "params": {"lvs_name": "lvs", "lvol_name": "lv", "size_in_mib": 64,
                              "thin_provision": true}}),
            format_call("lvs/lv", 32 * MIB),
            create,
        ],
    );
    let mut seen = Vec::new();
    let log = bdevperf_driven(d, &cfg, "thin", |sock, perform| {
        let fresh = space(sock);
        assert_eq!(fresh["base_capacity_bytes"], json!(64 * MIB), "{fresh}");
        assert_eq!(fresh["threshold_exceeded"], json!(false), "{fresh}");
        let before = lvol_clusters(sock);

        // Every cluster of the disk written (sequential 64 KiB writes wrap around it).
        let (failed, done) = job_counts(&perform(&["-w", "write", "-t", "2"]));
        assert!(
            failed == 0.0 && done >= 512.0,
            "{failed} failed, {done} done"
        );
        let written = space(sock);
        let allocated = written["allocated_bytes"].as_u64().unwrap();
        let end = written["image_end_bytes"].as_u64().unwrap();
        assert!(allocated > 32 * MIB && end >= allocated, "{written}");
        assert_eq!(
            written["free_bytes"].as_u64().unwrap(),
            64 * MIB - allocated,
            "{written}"
        );
        assert_eq!(written["threshold_exceeded"], json!(true), "{written}");
        let full = lvol_clusters(sock);
        assert!(full >= 32, "the lvol took {full} clusters for 32 MiB");

        // Unmapped, then flushed: the freed clusters are unmapped on the lvol once their
        // frees are stable.
        let (failed, _) = job_counts(&perform(&["-w", "unmap", "-t", "2"]));
        assert_eq!(failed, 0.0);
        let (failed, _) = job_counts(&perform(&["-w", "flush", "-t", "1"]));
        assert_eq!(failed, 0.0);
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut now = lvol_clusters(sock);
        while now > before + 1 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200));
            now = lvol_clusters(sock);
        }
        assert!(
            now <= before + 1,
            "the lvol keeps {now} clusters after the guest unmapped everything \
             ({before} before any write, {full} written)"
        );
        let unmapped = space(sock);
        assert!(
            unmapped["allocated_bytes"].as_u64().unwrap() < 2 * MIB,
            "{unmapped}"
        );
        seen.push((
            before,
            full,
            now,
            allocated,
            unmapped["allocated_bytes"].clone(),
        ));
    });
    assert!(
        log.contains("past the space threshold"),
        "no space warning in the log:\n{log}"
    );
    let (before, full, now, allocated, unmapped) = &seen[0];
    say(&format!(
        "thin lvol: {before} clusters fresh, {full} after 32 MiB written, {now} after unmap + \
         flush; qcow2 space allocated {allocated} -> {unmapped} bytes; threshold warned"
    ));
}
