//! Chains of encrypted images in SPDK. An external snapshot of an encrypted bdev under
//! bdevperf's verify: the overlay is encrypted with the same keyring key (a LUKS header of
//! its own), the old image becomes a read-only bdev unlocked with the key it had, and what
//! QEMU decrypts of the chain with the passphrase is what SPDK reads after a reload from
//! `save_config`. A stream of an encrypted overlay from an encrypted golden bdev, each with
//! its own key: the overlay alone then holds what the chain showed.

use super::encrypted::{
    dd_out, decrypted, key_file, keyed_config, keyed_qcow2, luks_image, qemu_io_keyed, same, PASS,
};
use super::*;

/// `qemu-img` arguments that open `img` (over its encrypted backing file if `backed`),
/// each image encrypted with the passphrase in `pw`.
fn chain_args(pw: &Path, img: &Path, backed: bool) -> Vec<String> {
    let backing = if backed {
        ",backing.encrypt.key-secret=s0"
    } else {
        ""
    };
    vec![
        "--object".into(),
        format!("secret,id=s0,file={}", s(pw)),
        "--image-opts".into(),
        format!(
            "driver=qcow2,file.filename={},encrypt.key-secret=s0{backing}",
            s(img)
        ),
    ]
}

#[test]
fn external_snapshot_of_an_encrypted_bdev_makes_an_encrypted_overlay() {
    require!("spdk_tgt", "spdk_dd", "bdevperf");
    require_rpc!();
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let pw = d.join("pw.key");
    key_file(&pw, PASS);
    let old = d.join("old.qcow2");
    luks_image(&pw, &old, "64M", "", &[]);
    qemu_io_keyed(&pw, &old, PATTERNS);
    sparse(&old, 128 * MIB);
    let ov = d.join("ov.qcow2");
    sparse(&ov, 96 * MIB);
    let cfg = d.join("encext.json");
    keyed_config(
        &cfg,
        &pw,
        vec![aio(&old, "aio0"), keyed_qcow2("q0", "aio0", false)],
    );
    let mut answers = Vec::new();
    let mut old_after = Vec::new();
    let (ok, text) = verify_load_with_rpc(d, &cfg, "encext", 8, |sock| {
        let rpc = |args: &[&str]| plugin_rpc(sock, args);
        answers.push(rpc(&["bdev_aio_create", s(&ov), "aio1", "512"]));
        std::thread::sleep(Duration::from_millis(1000));
        answers.push(rpc(&[
            "bdev_qcow2_snapshot_external",
            "-b",
            "q0",
            "--base-bdev",
            "aio1",
            "--encrypt-iter-time-ms",
            "10",
        ]));
        old_after = fs::read(&old).unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        answers.push(rpc(&["bdev_get_bdevs", "-b", "q0"]));
        answers.push(rpc(&["save_config"]));
        std::thread::sleep(Duration::from_millis(1000));
    });
    assert!(
        ok,
        "bdevperf verify failed across the external snapshot:\n{text}"
    );
    for (i, (ok, a)) in answers.iter().enumerate() {
        assert!(ok, "answer {i}: {a}");
    }
    let sw: Value = serde_json::from_str(answers[1].1.trim()).unwrap();
    assert_eq!(sw["snapshot"], "q0_snap0", "{sw}");
    let q0: Value = serde_json::from_str(answers[2].1.trim()).unwrap();
    let q = &q0[0]["driver_specific"]["qcow2"];
    assert_eq!(q["base_bdev"], "aio1", "{q0}");
    assert!(
        !q0.to_string().contains(PASS),
        "the passphrase in an answer"
    );
    assert!(
        fs::read(&old).unwrap() == old_after,
        "the old image changed after the switch"
    );
    // The overlay: LUKS-encrypted as qemu-img makes one, naming the read-only bdev (for
    // qemu-img, a file of that name beside it), clean with the passphrase.
    std::os::unix::fs::symlink(&old, d.join("q0_snap0")).unwrap();
    let out = run_ok(Command::new("qemu-img").args(["info", "-U", "--output=json", s(&ov)]));
    let info: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(info["encrypted"], true, "{info}");
    assert_eq!(
        info["format-specific"]["data"]["encrypt"]["format"], "luks",
        "{info}"
    );
    assert_eq!(info["backing-filename"], "q0_snap0", "{info}");
    let old_info = run_ok(Command::new("qemu-img").args(["info", "-U", "--output=json", s(&old)]));
    let old_info: Value = serde_json::from_slice(&old_info.stdout).unwrap();
    let uuid = |i: &Value| i["format-specific"]["data"]["encrypt"]["uuid"].clone();
    assert_ne!(
        uuid(&info),
        uuid(&old_info),
        "the overlay's LUKS header is its own"
    );
    for (img, backed) in [(&ov, true), (&old, false)] {
        let out = Command::new("qemu-img")
            .arg("check")
            .args(chain_args(&pw, img, backed))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "qemu-img check {}: {}{}",
            s(img),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // What QEMU decrypts of the chain is what SPDK reads after a reload from save_config
    // (the keyring's key first, the read-only bdev, the overlay over it).
    let want = d.join("want.raw");
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-O", "raw"])
            .args(chain_args(&pw, &ov, true))
            .arg(s(&want)),
    );
    let want = fs::read(&want).unwrap();
    let mut config: Value = serde_json::from_str(answers[3].1.trim()).unwrap();
    assert!(
        !config.to_string().contains(PASS),
        "the passphrase in save_config"
    );
    for sub in config["subsystems"].as_array_mut().unwrap() {
        if let Some(calls) = sub["config"].as_array_mut() {
            calls.retain(|c| c["method"] != "bdev_enable_histogram");
        }
    }
    let saved = d.join("saved.json");
    fs::write(&saved, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
    let got = dd_out(d, &saved, "q0", &d.join("got.raw"), "reload");
    same(
        &got,
        &want,
        "spdk_dd of q0 after a reload against qemu-img's decryption",
    );
    say("bdev_qcow2_snapshot_external of an encrypted bdev under bdevperf verify: the overlay is LUKS-encrypted with the same key (its own header), both images check clean, QEMU's decryption of the chain equals SPDK's read after a reload");
}

/// A keyring key named `name` over the passphrase file `path`.
fn keyring_key(name: &str, path: &Path) -> Value {
    json!({"method": "keyring_file_add_key", "params": {"name": name, "path": s(path)}})
}

#[test]
fn stream_of_an_encrypted_overlay_from_an_encrypted_golden_bdev() {
    require!("spdk_tgt");
    require_rpc!();
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (pw_g, pw_o) = (d.join("golden.key"), d.join("overlay.key"));
    key_file(&pw_g, PASS);
    key_file(&pw_o, "another passphrase for the overlay");
    let secret = |id: &str, pw: &Path| format!("secret,id={id},file={}", s(pw));
    let golden = d.join("golden.qcow2");
    luks_image(&pw_g, &golden, "64M", "", &[]);
    qemu_io_keyed(&pw_g, &golden, PATTERNS);
    let ov = d.join("ov.qcow2");
    luks_image(
        &pw_o,
        &ov,
        "64M",
        "",
        &["-u", "-b", s(&golden), "-F", "qcow2"],
    );
    // The overlay's own writes over part of what the golden image holds.
    let chain = format!(
        "driver=qcow2,file.filename={},encrypt.key-secret=s1,backing.encrypt.key-secret=s0",
        s(&ov)
    );
    let objs = [
        "--object".to_string(),
        secret("s0", &pw_g),
        "--object".to_string(),
        secret("s1", &pw_o),
    ];
    run_ok(
        Command::new("qemu-io")
            .args(&objs)
            .args(["-c", "write -P 0x77 512k 1M", "-c", "write -P 0x78 30M 64k"])
            .args(["--image-opts", &chain]),
    );
    let want = d.join("want.raw");
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-O", "raw"])
            .args(&objs)
            .args(["--image-opts", &chain])
            .arg(s(&want)),
    );
    let want = fs::read(&want).unwrap();
    sparse(&ov, 128 * MIB);
    pad(&golden);
    let cfg = d.join("encst.json");
    let c = json!({"subsystems": [
        {"subsystem": "keyring", "config": [keyring_key("kg", &pw_g), keyring_key("ko", &pw_o)]},
        {"subsystem": "bdev", "config": [
            aio(&golden, "aio_g"),
            json!({"method": "bdev_qcow2_create", "params": {
                "name": "gq", "base_bdev": "aio_g", "key": "kg", "read_only": true}}),
            aio(&ov, "aio_o"),
            json!({"method": "bdev_qcow2_create", "params": {
                "name": "q0", "base_bdev": "aio_o", "backing_bdev": "gq", "key": "ko"}}),
            json!({"method": "bdev_wait_for_examine"}),
        ]},
    ]});
    fs::write(&cfg, serde_json::to_vec_pretty(&c).unwrap()).unwrap();
    let t = Target::start(d, "encst", Some(&cfg));
    t.rpc(&["bdev_qcow2_stream", "-b", "q0"]);
    let last = wait_stream_done("q0", |a| t.try_rpc(a));
    t.stop();
    assert_eq!(last["bytes_done"], last["bytes_total"], "{last}");
    // The overlay alone: no backing file, clean, still encrypted with its own key, and it
    // decrypts to what the chain showed.
    no_backing(&ov);
    let out = run_ok(Command::new("qemu-img").args(["info", "--output=json", s(&ov)]));
    let info: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(info["encrypted"], true, "{info}");
    let got = decrypted(&pw_o, &ov, &d.join("got.raw"));
    same(
        &got,
        &want,
        "the streamed overlay alone against the chain before",
    );
    let out = Command::new("qemu-img")
        .arg("check")
        .args(["--object", &secret("s1", &pw_o)])
        .args([
            "--image-opts",
            &format!(
                "driver=qcow2,file.filename={},encrypt.key-secret=s1",
                s(&ov)
            ),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "qemu-img check: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    say("bdev_qcow2_stream of an encrypted overlay from an encrypted golden bdev (keys kg, ko): the overlay alone, clean and still encrypted, decrypts to what the chain showed");
}
