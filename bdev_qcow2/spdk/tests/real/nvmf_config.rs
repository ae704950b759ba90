//! The README's NVMe-oF/TCP config, run: `spdk_tgt` started with
//! `configs/nvmf_tcp_qcow2.json` as it is (only the image's path and the port changed, so
//! that the test runs beside anything else) exports the qcow2 bdev; SPDK's initiators see
//! one namespace of the image's size with the config's model number, and `bdevperf -w
//! verify` over `bdev_nvme_attach_controller` in a second process writes and reads it back;
//! afterwards the image checks clean.

use super::*;

/// The repository's config, with the image at `img` and the listener on `port`.
fn config(img: &Path, port: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/nvmf_tcp_qcow2.json");
    let text = fs::read_to_string(&path).unwrap();
    assert!(
        text.contains("/var/tmp/disk.qcow2") && text.contains("\"4420\""),
        "the config no longer serves /var/tmp/disk.qcow2 on port 4420 (update the README and this test)"
    );
    let text = text
        .replace("/var/tmp/disk.qcow2", s(img))
        .replace("\"4420\"", &format!("\"{port}\""));
    serde_json::from_str(&text).unwrap()
}

#[test]
fn the_nvmf_tcp_config_exports_the_image_to_spdk_initiators() {
    require!("spdk_tgt", "spdk_nvme_identify", "bdevperf");
    require_rpc!();
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // As the README makes it: an image with room to grow.
    let img = d.join("disk.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&img), "64M"]);
    pad(&img);
    sparse(&img, 96 * MIB);
    let port = free_port().to_string();
    let cfg_json = config(&img, &port);
    let nqn = cfg_json["subsystems"][1]["config"][1]["params"]["nqn"]
        .as_str()
        .unwrap()
        .to_string();
    let cfg = d.join("nvmf.json");
    fs::write(&cfg, serde_json::to_vec_pretty(&cfg_json).unwrap()).unwrap();
    let t = Target::start(d, "nvmf-cfg", Some(&cfg));

    let trid = format!("trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:{port} subnqn:{nqn}");
    let (ok, text) = run_timed(
        Command::new("spdk_nvme_identify")
            .args(mem_args())
            .args(["-r", &trid]),
        &d.join("identify.log"),
        60,
    );
    assert!(ok, "spdk_nvme_identify failed:\n{text}\n{}", t.log_text());
    assert!(
        text.contains("bdev_qcow2"),
        "no model number bdev_qcow2:\n{text}"
    );
    let ns = text
        .split("Namespace ID:1\n")
        .nth(1)
        .unwrap_or_else(|| panic!("no namespace 1 in:\n{text}"));
    assert!(
        ns.lines()
            .any(|l| l.starts_with("Size (in LBAs):")
                && l.split_whitespace().nth(3) == Some("131072")),
        "namespace 1 is not 64 MiB of 512-byte LBAs:\n{ns}"
    );

    let init = d.join("initiator.json");
    let init_json = json!({"subsystems": [{"subsystem": "bdev", "config": [
        {"method": "bdev_nvme_attach_controller",
         "params": {"name": "nvme0", "trtype": "tcp", "adrfam": "ipv4",
                    "traddr": "127.0.0.1", "trsvcid": port, "subnqn": nqn}},
        {"method": "bdev_wait_for_examine"}]}]});
    fs::write(&init, serde_json::to_vec_pretty(&init_json).unwrap()).unwrap();
    let (ok, text) = run_timed(
        Command::new("bdevperf")
            .arg("-u")
            .args(mem_args())
            .args(["--disable-cpumask-locks", "-m", initiator_mask()])
            .args(["--json", s(&init)])
            .args(["-q", "16", "-o", "65536", "-w", "verify", "-t", "3"]),
        &d.join("verify.log"),
        120,
    );
    assert!(
        ok,
        "bdevperf over the fabric failed:\n{text}\n{}",
        t.log_text()
    );
    let (iops, fails) = bdevperf_row(&text, "nvme0n1");
    assert!(iops > 0.0 && fails == 0.0, "verify over NVMe-oF:\n{text}");
    t.stop();
    check_clean(&img, "after the NVMe-oF config's export");
    say(&format!(
        "configs/nvmf_tcp_qcow2.json: namespace of 64 MiB, model bdev_qcow2; bdevperf verify over TCP {iops:.0} IOPS, 0 failures; qemu-img check clean"
    ));
}
