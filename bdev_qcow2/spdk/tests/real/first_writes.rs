//! First writes from core replicas (#48): a channel away from the md thread sends its
//! allocating write to the owner without its data, writes the data where the owner
//! reserved it, and hands the ticket back. Driven by bdevperf on two cores into a fresh
//! image: every request verifies, `owner.first_writes_by_cores` counts the writes the
//! cores wrote themselves, `qemu-img check` is clean and spdk_dd reads what qemu-img
//! reads; and with the base failing writes, the failed reservations free their clusters
//! (a verify pass afterwards reuses them) and the image has no corruption. And across
//! cores: data first written through one core's channel reads back through the other
//! core's channel, whose cache held the slices (and the empty L1 entry) from before.

use super::*;
use std::io::{Seek as _, SeekFrom, Write as _};

/// `owner.first_writes_by_cores` of q0 in `bdev_qcow2_get_stats`.
fn first_writes_by_cores(sock: &Path) -> u64 {
    let v = q0_stats(sock);
    v["owner"]["first_writes_by_cores"]
        .as_u64()
        .unwrap_or_else(|| panic!("no owner.first_writes_by_cores: {v}"))
}

/// bdevperf's job on both cores (`-C`: one job per core, each on its share of q0).
const TWO_CORES: [&str; 13] = [
    "-T", "q0", "-q", "32", "-o", "4096", "-w", "verify", "-t", "3", "-C", "-m", "0x3",
];

#[test]
fn first_writes_from_two_cores_verify_and_read_as_qemu_reads_them() {
    require!("bdevperf");
    require!("spdk_dd");
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = d.join("fw.qcow2");
    sparse(&img, 160 * MIB);
    let cfg = d.join("fw.json");
    // An AIO bdev made with fallocate: the image zeroes ahead by punching, so its first
    // writes need the guest's bytes alone, which the cores write.
    let mut base = aio(&img, "b0");
    base["params"]["fallocate"] = json!(true);
    write_config(
        &cfg,
        vec![
            base.clone(),
            format_call("b0", 128 * MIB),
            qcow2("q0", "b0", None),
        ],
    );
    bdevperf_driven_with(d, &cfg, "fw", &TWO_CORES, |sock, perform| {
        let (failed, done) = job_counts(&perform(&[]));
        assert!(failed == 0.0 && done > 0.0, "{failed} failed, {done} done");
        let by_cores = first_writes_by_cores(sock);
        assert!(
            by_cores > 0,
            "no first write was written by a core: {}",
            q0_stats(sock)
        );
        say(&format!(
            "two cores, fresh image, verify: {done:.0} requests, 0 failed; \
             {by_cores} first writes written by the cores"
        ));
    });
    check_clean(&img, "two cores' first writes");
    let open = d.join("fw-open.json");
    write_config(&open, vec![base, qcow2("q0", "b0", None)]);
    dd_and_compare(d, &open, "q0", &img, "fw");
}

#[test]
fn a_base_failing_reserved_data_writes_frees_their_clusters() {
    require!("bdevperf");
    require!("spdk_dd");
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = d.join("fwerr.qcow2");
    sparse(&img, 160 * MIB);
    let cfg = d.join("fwerr.json");
    // The first 300 writes reaching the base after the image is open fail: with nothing
    // written yet, those are the cores' data writes into reserved clusters.
    write_config(
        &cfg,
        vec![
            aio(&img, "aio0"),
            json!({"method": "bdev_error_create", "params": {"base_name": "aio0"}}),
            // Zeroed by the format (a tail recorded): first writes need the guest's bytes
            // alone, which the cores write.
            {
                let mut f = format_call("EE_aio0", 128 * MIB);
                f["params"]["zero_base"] = json!(true);
                f
            },
            qcow2("q0", "EE_aio0", None),
            json!({"method": "bdev_error_inject_error", "params": {
                "name": "EE_aio0", "io_type": "write", "error_type": "failure", "num": 300}}),
        ],
    );
    let mut job = TWO_CORES;
    job[7] = "randwrite";
    bdevperf_driven_with(d, &cfg, "fwerr", &job, |sock, perform| {
        let (failed, done) = job_counts(&perform(&[]));
        assert!(
            failed > 0.0,
            "the injected failures did not reach bdevperf ({done} done): {}",
            q0_stats(sock)
        );
        let by_cores = first_writes_by_cores(sock);
        assert!(
            by_cores > 0,
            "no first write was written by a core: {}",
            q0_stats(sock)
        );
        // The failures are spent: a verify pass over the whole disk (reusing what the
        // failed writes freed) has none.
        let (vfailed, vdone) = job_counts(&perform(&["-w", "verify", "-t", "2"]));
        assert!(
            vfailed == 0.0 && vdone > 0.0,
            "verify after the failures: {vfailed} failed, {vdone} done"
        );
        say(&format!(
            "base failing writes: {failed:.0} of {done:.0} random writes into the fresh image failed \
             ({by_cores} written by the cores); then verify: {vdone:.0}, 0 failed"
        ));
    });
    check_no_corruption(&img, "failed reserved writes");
    let open = d.join("fwerr-open.json");
    write_config(&open, vec![aio(&img, "b0"), qcow2("q0", "b0", None)]);
    dd_and_compare(d, &open, "q0", &img, "fwerr");
}

/// The vhost-user-blk controllers of the cross-core test: (name, core mask). SPDK runs each
/// controller on a thread of its own, on its mask's core, and every session of a controller
/// on that thread: one bdev channel per controller.
const CONTROLLERS: [(&str, &str); 2] = [("vc0", "0x1"), ("vc1", "0x2")];

/// A bdev config attaching SPDK's virtio-user initiator to each of `CONTROLLERS` (bdevs
/// `V0` and `V1`).
fn vhost_clients(cfg: &Path, vhost_dir: &Path) {
    let calls = CONTROLLERS
        .iter()
        .enumerate()
        .map(|(i, (name, _))| {
            json!({"method": "bdev_virtio_attach_controller", "params": {
                "name": format!("V{i}"), "trtype": "user", "dev_type": "blk",
                "traddr": s(&vhost_dir.join(name))}})
        })
        .collect();
    write_config(cfg, calls);
}

/// Arguments of an SPDK client process next to the target: core 1 (shared with the
/// target's), no core lock, memory in one hugepage file as virtio-user needs it.
const CLIENT_ARGS: [&str; 6] = ["--disable-cpumask-locks", "-m", "0x2", "-g", "-s", "256"];

/// [`spawn_spdk`] with its memory in `args` alone: a client started while the target holds
/// hugepages would find too few free and be given `--no-huge`, which virtio-user cannot use.
fn spawn_client(app: &str, args: &[String], log: &Path) -> Proc {
    spawn_spdk_with_memory(app, &[], args, log)
}

/// Waits for an SPDK application's RPC socket `sock` to answer; fails after a minute.
fn wait_rpc(sock: &Path, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(sock.exists() && plugin_rpc(sock, &["framework_wait_init"]).0) {
        assert!(
            Instant::now() < deadline,
            "no answer on {}:\n{}",
            sock.display(),
            fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The requests q0's channel on SPDK thread `thread` completed (`bdev_qcow2_get_stats`),
/// if it has a channel there.
fn channel_of(sock: &Path, thread: &str) -> Option<u64> {
    let v = q0_stats(sock);
    v["channels"]
        .as_array()?
        .iter()
        .find(|c| c["thread"] == thread)
        .and_then(|c| c["completed"].as_u64())
}

/// `n` bytes of a pattern particular to `seed` (no zero byte: a stale read shows).
fn pattern(seed: u8, n: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_u32 ^ u32::from(seed);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as u8) | 1
        })
        .collect()
}

#[test]
fn first_writes_on_one_core_read_back_through_the_other_cores_warm_cache() {
    // spdk_tgt on cores 0 and 1 (the md thread, which created q0, on core 0) exports q0
    // through two vhost-user-blk controllers, vc0 on core 0 and vc1 on core 1: two channels
    // with replicas of the image, apart from the owner's. An idle SPDK client keeps a
    // session open on each controller, so that the channels (and their slice caches) live
    // from the first read to the last; spdk_dd runs each step as another session.
    require!("spdk_tgt", "spdk_dd");
    require_rpc!();
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        say("SKIPPED: the cross-core test needs two cores");
        return;
    }
    if !mem_args().is_empty() {
        say("SKIPPED: vhost-user needs hugepages (none free or hugetlbfs not mounted)");
        return;
    }
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // 1 GiB of 64 KiB clusters: two L2 tables of 512 MiB, slices of 32 MiB. One cluster
    // written at 0 makes the first table; the second stays unmade (its L1 entry empty).
    let img = d.join("xc.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "cluster_size=65536",
        s(&img),
        "1G",
    ]);
    qemu_io(&img, &["write -P 0x5a 0 64k"]);
    sparse(&img, 1100 * MIB);
    // Ranges of 2 MiB (in units of spdk_dd's 128 KiB blocks): A ends slice 0, B starts
    // slice 1 (both in the first table; one read covers both), C lies in the second table.
    const BS: u64 = 128 << 10;
    let (a, b, c) = (30 * MIB / BS, 32 * MIB / BS, 520 * MIB / BS);
    let len = 2 * MIB;
    let blocks = (len / BS).to_string();
    // (range, controller that writes it, controller that reads it back).
    let ranges = [(a, 1, 0), (b, 0, 1), (c, 1, 0)];

    let cfg = d.join("xc.json");
    write_config(&cfg, vec![aio(&img, "b0"), qcow2("q0", "b0", None)]);
    let vhost_dir = d.join("vhost");
    fs::create_dir(&vhost_dir).unwrap();
    let sock = d.join("xc.sock");
    let tgt_log = d.join("xc.tgt.log");
    let tgt_args: Vec<String> = [
        "-m",
        "0x3",
        "-s",
        "512",
        "-S",
        s(&vhost_dir),
        "-r",
        s(&sock),
    ]
    .into_iter()
    .chain(["--json", s(&cfg)])
    .map(String::from)
    .collect();
    let tgt = spawn_spdk("spdk_tgt", &tgt_args, &tgt_log);
    wait_rpc(&sock, &tgt_log);
    for (name, mask) in CONTROLLERS {
        let (ok, text) = plugin_rpc(
            &sock,
            &["vhost_create_blk_controller", "--cpumask", mask, name, "q0"],
        );
        assert!(ok, "vhost_create_blk_controller {name}: {text}");
    }
    let clients = d.join("xc-clients.json");
    vhost_clients(&clients, &vhost_dir);
    let keep_sock = d.join("xc-keep.sock");
    let keep_log = d.join("xc-keep.log");
    let keep_args: Vec<String> = CLIENT_ARGS
        .into_iter()
        .chain(["-r", s(&keep_sock), "--json", s(&clients)])
        .map(String::from)
        .collect();
    let keeper = spawn_client("spdk_tgt", &keep_args, &keep_log);
    wait_rpc(&keep_sock, &keep_log);

    let step = std::cell::Cell::new(0);
    // spdk_dd with bdevs V0 and V1, arguments `args`.
    let dd = |args: &[&str]| {
        step.set(step.get() + 1);
        let log = d.join(format!("xc-dd{}.log", step.get()));
        let all: Vec<String> = CLIENT_ARGS
            .into_iter()
            .chain(["--json", s(&clients), "--bs", "131072"])
            .chain(args.iter().copied())
            .map(String::from)
            .collect();
        let (ok, text) = spawn_client("spdk_dd", &all, &log).wait(120);
        assert!(ok, "spdk_dd {args:?} failed:\n{text}");
    };
    // Reads `blocks` from block `at` of controller `ctl`'s bdev into `out`.
    let read = |ctl: usize, at: u64, count: &str, out: &Path| {
        let (bdev, skip) = (format!("V{ctl}"), at.to_string());
        dd(&[
            "--ib",
            &bdev,
            "--skip",
            &skip,
            "--count",
            count,
            "--of",
            s(out),
        ]);
        fs::read(out).unwrap()
    };

    // 1. Each channel reads what it will read back later, while it holds nothing: its
    //    cache keeps slice 0 and 1 (their entries unallocated) and sees the second
    //    table's L1 entry empty.
    let warm = d.join("xc-warm.raw");
    let ab = (2 * len / BS).to_string();
    for ctl in [0, 1] {
        assert!(read(ctl, a, &ab, &warm).iter().all(|&x| x == 0));
    }
    assert!(read(0, c, &blocks, &warm).iter().all(|&x| x == 0));
    let before: Vec<u64> = CONTROLLERS
        .iter()
        .map(|(name, _)| {
            channel_of(&sock, name)
                .unwrap_or_else(|| panic!("no channel of q0 on thread {name}: {}", q0_stats(&sock)))
        })
        .collect();

    // 2. First writes, each range through one controller: core 1's channel writes its
    //    data itself in clusters the owner reserved; core 0's (on the md thread's core)
    //    hands its writes to the owner whole.
    let written: Vec<Vec<u8>> = (1..=ranges.len() as u8)
        .map(|i| pattern(i, len as usize))
        .collect();
    for (i, &(at, writer, _)) in ranges.iter().enumerate() {
        let file = d.join(format!("xc-w{i}.raw"));
        fs::write(&file, &written[i]).unwrap();
        let (bdev, seek) = (format!("V{writer}"), at.to_string());
        dd(&["--if", s(&file), "--ob", &bdev, "--seek", &seek]);
    }
    let by_cores = first_writes_by_cores(&sock);
    assert!(
        by_cores > 0,
        "core 1 wrote no first write itself: {}",
        q0_stats(&sock)
    );

    // 3. Each range read back through the other controller's channel, the one whose cache
    //    held its slice (or the empty L1 entry) before the writes.
    let back = d.join("xc-back.raw");
    for (i, &(at, _, reader)) in ranges.iter().enumerate() {
        let got = read(reader, at, &blocks, &back);
        let want = &written[i];
        if let Some(k) = got.iter().zip(want).position(|(x, y)| x != y) {
            panic!(
                "range {i} (guest {:#x}) read through vc{reader}: byte {k} is {:#x}, \
                 written {:#x} through the other core",
                at * BS,
                got[k],
                want[k]
            );
        }
    }
    // The same channels served the requests before and after (a channel made anew
    // would count only the requests after): their caches were warm.
    for (i, (name, _)) in CONTROLLERS.iter().enumerate() {
        let done = channel_of(&sock, name).unwrap();
        // Each controller wrote one range or two and read back the others.
        let after = ranges.len() as u64 * len / BS;
        assert!(
            done >= before[i] + after,
            "q0's channel on {name} is not the one warmed: {} requests, then {done}",
            before[i]
        );
    }
    say(&format!(
        "first writes through vc1 (core 1: {by_cores} written by the core) and vc0 (core 0) \
         read back through the other core's warm channel"
    ));

    let _ = plugin_rpc(&keep_sock, &["spdk_kill_instance", "SIGTERM"]);
    let (ok, text) = keeper.wait(60);
    assert!(ok, "the idle client failed:\n{text}");
    let _ = plugin_rpc(&sock, &["spdk_kill_instance", "SIGTERM"]);
    let (ok, text) = tgt.wait(60);
    assert!(ok, "spdk_tgt failed:\n{text}");
    check_clean(&img, "first writes on two cores");
    // The whole disk as written: a sparse raw file with the cluster and the ranges.
    let raw = d.join("xc-want.raw");
    let mut f = fs::File::create(&raw).unwrap();
    f.set_len(1 << 30).unwrap();
    f.write_all(&[0x5a; 64 << 10]).unwrap();
    for (i, &(at, _, _)) in ranges.iter().enumerate() {
        f.seek(SeekFrom::Start(at * BS)).unwrap();
        f.write_all(&written[i]).unwrap();
    }
    drop(f);
    compare_with_raw(&img, &raw);
}
