//! `bdev_qcow2_overlay_create`: an overlay in one call. On a qcow2 golden bdev and on a raw
//! one, the new image records the backing bdev's name and format as `qemu-img create -b -F`
//! records them, has the backing's size, reads through it (spdk_dd against qemu-img's view of
//! the golden image), checks clean, and comes back from `save_config`. A missing backing
//! bdev or an existing name is refused before anything is written on the base.

use super::*;

/// `qemu-img info` of `img` as JSON (the backing file itself is not opened).
fn info(img: &Path) -> Value {
    let out = run_ok(Command::new("qemu-img").args(["info", "--output=json", s(img)]));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn an_overlay_in_one_call_reads_through_and_survives_save_config() {
    require!("spdk_tgt", "spdk_dd");
    require_rpc!();
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A golden qcow2 image and the same bytes as a raw file.
    let golden = d.join("golden.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&golden), "32M"]);
    qemu_io(&golden, &["write -P 0x61 0 4M", "write -P 0x62 20M 3M"]);
    pad(&golden);
    let golden_raw = d.join("golden.raw");
    qemu_img(&["convert", "-O", "raw", s(&golden), s(&golden_raw)]);
    let (ov_q, ov_r) = (d.join("vm1.qcow2"), d.join("vm2.qcow2"));
    for f in [&ov_q, &ov_r] {
        sparse(f, 64 * MIB);
    }

    let t = Target::start(d, "overlay", None);
    t.rpc(&["bdev_aio_create", s(&golden), "aio_golden", "512", "-r"]);
    t.rpc(&[
        "bdev_qcow2_create",
        "-b",
        "golden",
        "--base-bdev",
        "aio_golden",
        "--read-only",
    ]);
    t.rpc(&["bdev_aio_create", s(&golden_raw), "raw_golden", "512", "-r"]);
    t.rpc(&["bdev_aio_create", s(&ov_q), "aio_vm1", "512"]);
    t.rpc(&["bdev_aio_create", s(&ov_r), "aio_vm2", "512"]);

    // Refused, the base untouched: no such backing bdev; a name in use.
    let (ok, text) = t.try_rpc(&[
        "bdev_qcow2_overlay_create",
        "-b",
        "vm1",
        "--base-bdev",
        "aio_vm1",
        "--backing-bdev",
        "nope",
    ]);
    assert!(!ok && text.contains("nope"), "{text}");
    let (ok, text) = t.try_rpc(&[
        "bdev_qcow2_overlay_create",
        "-b",
        "golden",
        "--base-bdev",
        "aio_vm1",
        "--backing-bdev",
        "raw_golden",
    ]);
    assert!(!ok && text.contains("exists"), "{text}");
    assert!(
        fs::read(&ov_q).unwrap().iter().all(|b| *b == 0),
        "a refused overlay wrote on its base"
    );

    let made = t.rpc(&[
        "bdev_qcow2_overlay_create",
        "-b",
        "vm1",
        "--base-bdev",
        "aio_vm1",
        "--backing-bdev",
        "golden",
    ]);
    assert_eq!(made, json!("vm1"));
    t.rpc(&[
        "bdev_qcow2_overlay_create",
        "-b",
        "vm2",
        "--base-bdev",
        "aio_vm2",
        "--backing-bdev",
        "raw_golden",
        "--cluster-size",
        "16384",
        "--extended-l2",
    ]);
    for (name, want_blocks) in [("vm1", 32 * MIB / 512), ("vm2", 32 * MIB / 512)] {
        let b = t.bdev(name).unwrap_or_else(|| panic!("no bdev {name}"));
        assert_eq!(b["num_blocks"], json!(want_blocks), "{b}");
    }
    let saved = d.join("saved.json");
    let cfg = t.rpc(&["save_config"]);
    fs::write(&saved, serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
    t.stop();

    // The images as QEMU reads them.
    for (img, fmt, cluster) in [(&ov_q, "qcow2", 65536), (&ov_r, "raw", 16384)] {
        let i = info(img);
        let want = if fmt == "qcow2" {
            "golden"
        } else {
            "raw_golden"
        };
        assert_eq!(i["backing-filename"], json!(want), "{i}");
        assert_eq!(i["backing-filename-format"], json!(fmt), "{i}");
        assert_eq!(i["cluster-size"], json!(cluster), "{i}");
        assert_eq!(i["virtual-size"], json!(32 * MIB), "{i}");
        // (The recorded backing file is a bdev's name: checked without it.)
        let spec = json!({"driver": "qcow2", "backing": null,
                          "file": {"driver": "file", "filename": s(img)}});
        run_ok(Command::new("qemu-img").args(["check", &format!("json:{spec}")]));
    }
    // Read through, from the saved config: the golden image's bytes.
    dd_and_compare(d, &saved, "vm1", &golden, "vm1-through");
    dd_and_compare(d, &saved, "vm2", &golden, "vm2-through");
    say("bdev_qcow2_overlay_create: overlays of a qcow2 and a raw golden bdev, backing recorded as qemu-img records it, read through from save_config; refusals left the base untouched");
}
