//! SPDK's bdev_io pool too small for the load: bdevperf's requests hold most of it, so the
//! child requests our bdev submits to its base are refused (`-ENOMEM`) many times a second.
//! Every refused request must be retried and complete, and the image stay consistent: a
//! real fault an operator meets with many bdevs and deep queues (`bdev_set_options`).

use super::*;

#[test]
fn an_exhausted_bdev_io_pool_delays_requests_and_loses_none() {
    require!("bdevperf", "spdk_tgt");
    require_rpc!();
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = d.join("pool.qcow2");
    sparse(&img, 96 * MIB);
    let cfg = d.join("pool.json");
    // 96 bdev_ios for every thread; bdevperf's two jobs of 32 take 64 of them.
    write_config(
        &cfg,
        vec![
            json!({"method": "bdev_set_options",
                   "params": {"bdev_io_pool_size": 96, "bdev_io_cache_size": 8}}),
            aio(&img, "aio0"),
            format_call("aio0", 64 * MIB),
            qcow2("q0", "aio0", None),
        ],
    );
    let job = [
        "-T", "q0", "-q", "32", "-o", "4096", "-w", "verify", "-t", "4", "-m", "0x3", "-C",
    ];
    let mut result = Value::Null;
    let mut stats = Value::Null;
    bdevperf_driven_with(d, &cfg, "pool", &job, |sock, perform| {
        result = perform(&[]);
        stats = plugin_json(sock, &["bdev_qcow2_get_stats", "-b", "q0"]);
    });
    let (failed, done) = job_counts(&result);
    assert_eq!(failed, 0.0, "requests failed: {result}");
    assert!(done > 0.0, "{result}");
    let retries = stats[0]["total"]["busy_retries"].as_u64().unwrap_or(0);
    assert!(
        retries > 0,
        "no child request was refused: the pool was not exhausted\n{stats}"
    );
    check_clean(&img, "the image after the load");
    say(&format!(
        "bdevperf verify on 2 cores with a bdev_io pool of 96: {done:.0} requests, none failed, {retries} base submissions refused and retried; the image clean"
    ));
}
