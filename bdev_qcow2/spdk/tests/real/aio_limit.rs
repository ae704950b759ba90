//! The kernel's `fs.aio-max-nr` reached, a real limit an operator meets with many AIO bdevs
//! and threads: an AIO bdev's channel is a kernel AIO context, and SPDK gives no channel
//! past the limit.
//! - An external snapshot under load: the overlay's AIO bdev gives the md thread its I/O
//!   channel and no other thread one. The channels on bdevperf's threads cannot build their
//!   replica of the overlay; they forward every request to the md thread instead, and
//!   nothing writes into the old image, the read-only snapshot from the switch on.
//! - bdevperf's channels of a writable bdev made at the limit: they forward from the start.
//! - Reads of an overlay whose golden bdev gives bdevperf's threads no channel: each
//!   backing read that fails there for want of one goes to the owner.
//!
//! The limit is the machine's: while it is lowered (seconds) no other process can make an
//! AIO context either. The tests hold the SPDK turn, and put the limit back when dropped.

use super::*;

const AIO_MAX_NR: &str = "/proc/sys/fs/aio-max-nr";
const AIO_NR: &str = "/proc/sys/fs/aio-nr";

/// Events one AIO bdev channel asks `io_setup` for (SPDK's `SPDK_AIO_QUEUE_DEPTH`): what one
/// more channel adds to `fs.aio-nr`.
const AIO_CHANNEL_EVENTS: u64 = 128;

fn read_u64(path: &str) -> u64 {
    fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// `fs.aio-nr` once no AIO context comes or goes: the same over half a second, after the
/// second for which a new bdev's examine channel is held.
fn steady_aio_nr() -> u64 {
    std::thread::sleep(Duration::from_millis(1500));
    let mut last = read_u64(AIO_NR);
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(500));
        let now = read_u64(AIO_NR);
        if now == last {
            return now;
        }
        last = now;
    }
    panic!("fs.aio-nr never settled (last {last})");
}

/// What one bdevperf run of q0 at the limit left: `fs.aio-nr` when the limit was set to
/// it, the run's result, q0's `bdev_qcow2_get_stats` after it, bdevperf's log.
struct AtLimit {
    nr: u64,
    result: Value,
    stats: Value,
    log: String,
}

/// bdevperf on config `cfg`, `workload` on q0 (QD32, 4 KiB, two cores, 3 s), its jobs
/// started with `fs.aio-max-nr` at the current `fs.aio-nr`: no new AIO context anywhere.
fn q0_at_the_limit(d: &Path, cfg: &Path, tag: &str, workload: &str) -> AtLimit {
    let job = [
        "-T", "q0", "-q", "32", "-o", "4096", "-w", workload, "-t", "3", "-m", "0x3", "-C",
    ];
    let (mut nr, mut result, mut stats) = (0, Value::Null, Value::Null);
    let log = bdevperf_driven_with(d, cfg, tag, &job, |sock, perform| {
        nr = steady_aio_nr();
        let limit = AioLimit::lower_to(nr);
        result = perform(&[]);
        drop(limit);
        stats = plugin_json(sock, &["bdev_qcow2_get_stats", "-b", "q0"]);
    });
    AtLimit {
        nr,
        result,
        stats,
        log,
    }
}

/// Whether this run may set the limit (root's sysctl, outside a user namespace: CI runs so;
/// tried by writing back the value it has); says why not.
fn limit_settable() -> bool {
    let now = read_u64(AIO_MAX_NR);
    match fs::write(AIO_MAX_NR, now.to_string()) {
        Ok(()) => true,
        Err(e) => {
            say(&format!(
                "SKIPPED: cannot set /proc/sys/fs/aio-max-nr ({e}; needs root)"
            ));
            false
        }
    }
}

/// The kernel's limit as it was, put back when dropped (a failed assertion included).
struct AioLimit(u64);

impl AioLimit {
    fn lower_to(limit: u64) -> AioLimit {
        let was = read_u64(AIO_MAX_NR);
        fs::write(AIO_MAX_NR, limit.to_string()).expect("set fs.aio-max-nr");
        AioLimit(was)
    }
}

impl Drop for AioLimit {
    fn drop(&mut self) {
        if let Err(e) = fs::write(AIO_MAX_NR, self.0.to_string()) {
            eprintln!("cannot restore fs.aio-max-nr to {}: {e}", self.0);
        }
    }
}

#[test]
fn external_snapshot_at_the_aio_limit_forwards_and_leaves_the_snapshot_untouched() {
    require!("bdevperf", "spdk_tgt");
    require_rpc!();
    if !limit_settable() {
        return;
    }
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let old = d.join("old.qcow2");
    filled_qcow2(&old, 64);
    let f = fs::OpenOptions::new().write(true).open(&old).unwrap();
    f.set_len(128 * MIB).unwrap();
    drop(f);
    let ov = d.join("ov.qcow2");
    sparse(&ov, 96 * MIB);
    let cfg = d.join("aio-limit.json");
    write_config(&cfg, vec![aio(&old, "aio0"), qcow2("q0", "aio0", None)]);
    let mut answers = Vec::new();
    let mut old_after = Vec::new();
    let mut limits = (0, 0);
    let mut refused = (false, String::new());
    let (ok, text) = verify_load_with_rpc(d, &cfg, "aio-limit", 14, |sock| {
        let rpc = |args: &[&str]| plugin_rpc(sock, args);
        answers.push(rpc(&["bdev_aio_create", s(&ov), "aio1", "512"]));
        // The examine of aio1 has let go of its channels (ours holds one for a second).
        let nr = steady_aio_nr();
        // No room at all: the overlay cannot be formatted on aio1; refused, and q0 goes on
        // serving its image.
        let limit = AioLimit::lower_to(nr);
        refused = rpc(&[
            "bdev_qcow2_snapshot_external",
            "-b",
            "q0",
            "--base-bdev",
            "aio1",
        ]);
        drop(limit);
        let nr = steady_aio_nr();
        // Room for one more AIO channel: the md thread's of aio1, which the overlay's
        // format and its owner use. bdevperf's threads find none: their channels forward
        // (one that renews after another thread's old state let go of its aio0 context
        // might get one; at least one forwards).
        let limit = AioLimit::lower_to(nr + AIO_CHANNEL_EVENTS);
        limits = (nr, nr + AIO_CHANNEL_EVENTS);
        answers.push(rpc(&[
            "bdev_qcow2_snapshot_external",
            "-b",
            "q0",
            "--base-bdev",
            "aio1",
        ]));
        drop(limit);
        old_after = fs::read(&old).unwrap();
        // Verify goes on for seconds more, every request through the md thread.
        std::thread::sleep(Duration::from_millis(2000));
        answers.push(rpc(&["bdev_qcow2_get_stats", "-b", "q0"]));
    });
    assert!(
        ok,
        "bdevperf verify failed across the external snapshot at the AIO limit:\n{text}"
    );
    assert!(
        !refused.0,
        "a snapshot with no AIO context to spare: {}",
        refused.1
    );
    assert!(
        refused.1.contains("no I/O channel for the new base aio1")
            && refused.1.contains("fs.aio-max-nr"),
        "the refusal names the new base: {}",
        refused.1
    );
    for (i, (answered, out)) in answers.iter().enumerate() {
        assert!(answered, "answer {i}: {out}");
    }
    // The channels forwarded after the switch: the owner ran their requests.
    let stats: Value = serde_json::from_str(answers[2].1.trim()).unwrap();
    assert!(stats[0]["total"]["forwarded"].as_u64() > Some(0), "{stats}");
    // SPDK's AIO module refused the channels beyond the limit; ours fell back.
    assert!(
        text.contains("exceeding kernel limit"),
        "no AIO channel was refused (aio-nr {} limit {}): the test did not reach the limit\n{text}",
        limits.0,
        limits.1
    );
    let fallbacks = text.matches("no core replica on thread").count();
    assert!(
        fallbacks >= 1,
        "no channel fell back to forwarding:\n{text}"
    );
    assert!(
        !text.contains("could not be moved to the overlay"),
        "a channel kept the old image:\n{text}"
    );
    let sw: Value = serde_json::from_str(answers[1].1.trim()).unwrap();
    assert_eq!(sw["snapshot"], "q0_snap0", "{sw}");
    // Nothing wrote to the old image after the switch, bdevperf's shutdown included.
    assert!(
        fs::read(&old).unwrap() == old_after,
        "the old image changed after the switch"
    );
    check_clean(&old, "the old image after the switch");
    // The overlay names its backing as our module reopens it: for qemu-img, a file of
    // that name beside it.
    std::os::unix::fs::symlink(&old, d.join("q0_snap0")).unwrap();
    check_clean(&ov, "the overlay after the load");
    say(&format!(
        "bdev_qcow2_snapshot_external with fs.aio-max-nr reached: with no context to spare refused ({}); with one ({} of {}) {fallbacks} channel(s) forwarded to the md thread, verify passed, the old image unchanged and clean, the overlay clean",
        refused.1.lines().find(|l| l.contains("message")).unwrap_or("").trim(),
        limits.0,
        limits.1
    ));
}

/// An overlay on a malloc bdev over a read-only qcow2 bdev on an AIO file, read at random
/// from two cores with `fs.aio-max-nr` reached: bdevperf's threads get no channel of the
/// golden bdev (its own channel there needs an AIO context), so their backing reads fail on
/// the thread and go to the owner, which reads through its channel; no request fails.
#[test]
fn backing_reads_without_a_channel_go_to_the_owner() {
    require!("bdevperf", "spdk_tgt");
    require_rpc!();
    if !limit_settable() {
        return;
    }
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let golden = d.join("golden.qcow2");
    filled_qcow2(&golden, 64);
    let cfg = d.join("backing-limit.json");
    write_config(
        &cfg,
        vec![
            json!({"method": "bdev_malloc_create",
                   "params": {"name": "m0", "num_blocks": 96 * 2048, "block_size": 512}}),
            aio(&golden, "aio0"),
            json!({"method": "bdev_qcow2_create",
                   "params": {"name": "gold", "base_bdev": "aio0", "read_only": true}}),
            json!({"method": "bdev_qcow2_overlay_create",
                   "params": {"name": "q0", "base_bdev": "m0", "backing_bdev": "gold"}}),
        ],
    );
    let AtLimit {
        nr,
        result,
        stats,
        log,
    } = q0_at_the_limit(d, &cfg, "backing-limit", "randread");
    let (failed, done) = job_counts(&result);
    assert!(
        log.contains("no I/O channel for a backing bdev"),
        "no backing channel was refused (aio-nr {nr}): the test did not reach the limit\n{log}"
    );
    assert_eq!(failed, 0.0, "reads failed: {result}\n{log}");
    assert!(done > 0.0, "{result}");
    let forwarded = stats[0]["total"]["forwarded"].as_u64().unwrap_or(0);
    assert!(forwarded > 0, "no read went to the owner: {stats}");
    say(&format!(
        "random reads of an overlay whose golden bdev's channel the AIO limit ({nr}) refused on bdevperf's threads: {done:.0} reads, none failed, {forwarded} through the owner"
    ));
}

/// bdevperf's channels of a writable bdev on an AIO file, made with `fs.aio-max-nr` reached
/// (its base gives their threads no channel): built without a replica, they forward every
/// request to the md thread; verify passes and the image checks clean.
#[test]
fn channels_made_at_the_limit_forward_to_the_owner() {
    require!("bdevperf", "spdk_tgt");
    require_rpc!();
    if !limit_settable() {
        return;
    }
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = d.join("new-channels.qcow2");
    sparse(&img, 96 * MIB);
    let cfg = d.join("new-channels.json");
    write_config(
        &cfg,
        vec![
            aio(&img, "aio0"),
            format_call("aio0", 64 * MIB),
            qcow2("q0", "aio0", None),
        ],
    );
    let AtLimit {
        nr,
        result,
        stats,
        log,
    } = q0_at_the_limit(d, &cfg, "new-channels", "verify");
    let (failed, done) = job_counts(&result);
    let fallbacks = log.matches("no core replica on thread").count();
    assert!(
        fallbacks >= 1,
        "no channel fell back to forwarding (aio-nr {nr}):\n{log}"
    );
    assert_eq!(failed, 0.0, "requests failed: {result}\n{log}");
    assert!(done > 0.0, "{result}");
    let forwarded = stats[0]["total"]["forwarded"].as_u64().unwrap_or(0);
    assert!(forwarded > 0, "no request went to the owner: {stats}");
    check_clean(&img, "the image after the load");
    say(&format!(
        "bdevperf verify on 2 cores, its channels made at the AIO limit ({nr}): {fallbacks} forwarding, {done:.0} requests, none failed, {forwarded} through the owner; the image clean"
    ));
}
