//! The tables `qcow2 perf` prints.

use super::stats::RunResult;
use super::thrash::ThrashResult;

pub(super) fn table(rows: &[(RunResult, Option<RunResult>)]) -> String {
    let mut s = format!(
        "{:<10} {:>6} {:>3} {:>5} {:>11} {:>9} {:>9} {:>9} {:>11} {:>7}\n",
        "workload", "size", "qd", "cores", "IOPS", "MiB/s", "avg us", "p99 us", "raw IOPS", "ratio"
    );
    for (q, r) in rows {
        let (raw_iops, ratio) = match r {
            Some(r) => (
                format!("{:.0}", r.iops),
                format!("{:.3}", q.iops / r.iops.max(1e-9)),
            ),
            None => ("-".into(), "-".into()),
        };
        s += &format!(
            "{:<10} {:>6} {:>3} {:>5} {:>11.0} {:>9.1} {:>9.1} {:>9.0} {:>11} {:>7}\n",
            format!("{:?}", q.workload).to_lowercase(),
            crate::cmd::info::human_size(q.io_size).replace(' ', ""),
            q.depth,
            q.cores,
            q.iops,
            q.mibps,
            q.lat_avg_us,
            q.lat_p99_us,
            raw_iops,
            ratio
        );
        if let (true, Some(r)) = (q.workload.writes(), r) {
            // What each request cost the device: the data and, for ours, the metadata.
            let per = |x: &RunResult| {
                let ops = x.ops.max(1) as f64;
                (
                    x.device_writes as f64 / ops,
                    x.device_bytes_written as f64 / ops / 1024.0,
                )
            };
            let ((qw, qk), (rw, rk)) = (per(q), per(r));
            s += &format!(
                "  device writes per request: qcow2 {qw:.3} ({qk:.1} KiB), raw {rw:.3} ({rk:.1} KiB)\n"
            );
        }
        if q.cores > 1 {
            // Load does not move these: what crosses cores, and how much of the device
            // work the owner's channel carries.
            let ops = q.ops.max(1) as f64;
            s += &format!(
                "  messages between cores per request {:.2}; owner's share of device writes {:.2}\n",
                q.messages as f64 / ops,
                q.owner_device_writes as f64 / q.device_writes.max(1) as f64
            );
        }
        if q.verify_failures > 0 {
            s += &format!("  VERIFY FAILURES: {}\n", q.verify_failures);
        }
    }
    s
}

pub(super) fn thrash_table(rows: &[ThrashResult]) -> String {
    let mut s = format!(
        "{:>6} {:>7} {:>9} {:>11} {:>11} {:>11} {:>7}\n",
        "cache", "slices", "miss rate", "IOPS", "IOPS hit", "bound", "ratio"
    );
    for t in rows {
        s += &format!(
            "{:>5}% {:>7} {:>9.3} {:>11.0} {:>11.0} {:>11.0} {:>7.3}\n",
            t.percent, t.cache_slices, t.miss_rate, t.iops, t.iops_hit, t.bound, t.ratio
        );
    }
    s += &format!(
        "cache = share of the image's {} L2 slices asked for (slices: what the cache holds); \
         bound = IOPS hit / (1 + miss rate), one slice read per miss; ratio = IOPS / bound\n",
        rows.first().map_or(0, |t| t.image_slices)
    );
    s
}
