//! First writes from core replicas (#48): a channel away from the md thread sends its
//! allocating write to the owner without its data, writes the data where the owner
//! reserved it, and hands the ticket back. Driven by bdevperf on two cores into a fresh
//! image: every request verifies, `owner.first_writes_by_cores` counts the writes the
//! cores wrote themselves, `qemu-img check` is clean and spdk_dd reads what qemu-img
//! reads; and with the base failing writes, the failed reservations free their clusters
//! (a verify pass afterwards reuses them) and the image has no corruption.

use super::*;

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
