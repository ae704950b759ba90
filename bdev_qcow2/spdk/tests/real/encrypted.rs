//! Encrypted (LUKS) images served with the key from SPDK's keyring: an image `qemu-img`
//! made with `encrypt.format=luks` and `qemu-io` wrote, opened by `bdev_qcow2_create` with
//! the name of a `keyring_file_add_key` key; spdk_dd reads what `qemu-img convert` decrypts
//! (writable and read-only bdevs), writes through SPDK that qemu decrypts back, bdevperf's
//! verify on two cores (replicas take the cipher from the seed), `qemu-img check` clean.
//! No key, an unknown key and a wrong key are refused with the reason, the image unchanged;
//! `bdev_qcow2_format` and `bdev_qcow2_overlay_create` with a key make LUKS images qemu
//! opens with the passphrase; `save_config` names the key (never its bytes), after the
//! keyring's own config, and loads again. Warm reads of an encrypted image run no engine
//! task (`engine_tasks` in `bdev_qcow2_get_stats`): each is the view's one device operation.

use super::*;

pub(super) const PASS: &str = "correct horse battery staple";

/// The passphrase file SPDK's file keyring accepts (absolute path, mode 0600).
pub(super) fn key_file(path: &Path, bytes: &str) {
    use std::os::unix::fs::PermissionsExt;
    fs::write(path, bytes).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(0o600)).unwrap();
}

/// `qemu-img create`s the encrypted `img` of `size`, its key slot opened by the passphrase
/// in `pw`: QEMU's default cipher (aes-256-xts-plain64, sha256) with a short iter-time so
/// that the tests' key derivations stay short, `opts` appended to the `-o` options and
/// `args` (a backing file) before the image.
pub(super) fn luks_image(pw: &Path, img: &Path, size: &str, opts: &str, args: &[&str]) {
    run_ok(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "--object"])
            .arg(format!("secret,id=s0,file={}", s(pw)))
            .arg("-o")
            .arg(format!(
                "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10{opts}"
            ))
            .args(args)
            .args([s(img), size]),
    );
}

/// `qemu-img`/`qemu-io` arguments that open the encrypted `img` with the passphrase in
/// `pw`, as `--object` and `--image-opts`.
fn qemu_key_args(pw: &Path, img: &Path) -> Vec<String> {
    vec![
        "--object".into(),
        format!("secret,id=s0,file={}", s(pw)),
        "--image-opts".into(),
        format!(
            "driver=qcow2,file.filename={},encrypt.key-secret=s0",
            s(img)
        ),
    ]
}

pub(super) fn qemu_io_keyed(pw: &Path, img: &Path, cmds: &[&str]) {
    let mut c = Command::new("qemu-io");
    let a = qemu_key_args(pw, img);
    c.args(&a[..2]);
    for x in cmds {
        c.arg("-c").arg(x);
    }
    c.args(&a[2..]);
    let out = run_ok(&mut c);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        !text.contains("error") && !text.contains("failed"),
        "qemu-io: {text}"
    );
}

/// The plaintext of the encrypted `img`, as `qemu-img convert` decrypts it.
pub(super) fn decrypted(pw: &Path, img: &Path, out: &Path) -> Vec<u8> {
    let a = qemu_key_args(pw, img);
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-O", "raw"])
            .args(&a)
            .arg(s(out)),
    );
    fs::read(out).unwrap()
}

fn check_clean_keyed(pw: &Path, img: &Path, what: &str) {
    check_clean_args(&qemu_key_args(pw, img), what);
}

/// A config with the keyring's key `k0` over `pw` and `bdev` calls.
pub(super) fn keyed_config(path: &Path, pw: &Path, calls: Vec<Value>) {
    let mut calls = calls;
    calls.push(json!({"method": "bdev_wait_for_examine"}));
    let cfg = json!({"subsystems": [
        {"subsystem": "keyring", "config": [
            {"method": "keyring_file_add_key", "params": {"name": "k0", "path": s(pw)}}
        ]},
        {"subsystem": "bdev", "config": calls},
    ]});
    fs::write(path, serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
}

pub(super) fn keyed_qcow2(name: &str, base: &str, read_only: bool) -> Value {
    json!({"method": "bdev_qcow2_create",
           "params": {"name": name, "base_bdev": base, "key": "k0", "read_only": read_only}})
}

/// spdk_dd copy of `bdev` under `cfg` into `out`, in 128 KiB reads.
pub(super) fn dd_out(d: &Path, cfg: &Path, bdev: &str, out: &Path, tag: &str) -> Vec<u8> {
    let log = d.join(format!("{tag}.dd.log"));
    let args: Vec<String> = [
        "--json",
        s(cfg),
        "--ib",
        bdev,
        "--of",
        s(out),
        "--bs",
        "131072",
    ]
    .map(String::from)
    .to_vec();
    let (ok, text) = spawn_spdk("spdk_dd", &args, &log).wait(120);
    assert!(ok, "{tag}: spdk_dd failed:\n{text}");
    fs::read(out).unwrap()
}

pub(super) fn same(a: &[u8], b: &[u8], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: sizes differ");
    if let Some(i) = a.iter().zip(b).position(|(x, y)| x != y) {
        panic!("{what}: first difference at byte {i}");
    }
}

#[test]
fn encrypted_image_served_with_a_keyring_key_reads_and_writes_as_qemu() {
    require!("spdk_tgt", "spdk_dd", "bdevperf");
    require_rpc!();
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (pw, bad) = (d.join("pw.key"), d.join("bad.key"));
    key_file(&pw, PASS);
    key_file(&bad, "not the passphrase");
    let img = d.join("enc.qcow2");
    luks_image(&pw, &img, "64M", "", &[]);
    qemu_io_keyed(&pw, &img, PATTERNS);
    // Room for the clusters the writes through SPDK allocate (an AIO bdev does not grow).
    sparse(&img, 128 * MIB);
    let want = decrypted(&pw, &img, &d.join("want.raw"));

    // spdk_dd reads the plaintext qemu decrypts: writable bdev, then read-only.
    for ro in [false, true] {
        let cfg = d.join(format!("dd{ro}.json"));
        keyed_config(
            &cfg,
            &pw,
            vec![aio(&img, "aio0"), keyed_qcow2("qe", "aio0", ro)],
        );
        let got = dd_out(d, &cfg, "qe", &d.join(format!("got{ro}.raw")), "read");
        same(&got, &want, &format!("spdk_dd read (read_only {ro})"));
    }
    say("encrypted: spdk_dd reads of the writable and the read-only bdev equal qemu-img's decryption");

    // Writes through SPDK: 4 MiB of a pattern at 5 MiB (cluster-straddling), read back by
    // qemu with the key.
    let pattern: Vec<u8> = (0..4 * MIB as usize)
        .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[3])
        .collect();
    let pat = d.join("pattern.raw");
    fs::write(&pat, &pattern).unwrap();
    let cfg = d.join("w.json");
    keyed_config(
        &cfg,
        &pw,
        vec![aio(&img, "aio0"), keyed_qcow2("qe", "aio0", false)],
    );
    let log = d.join("w.dd.log");
    let args: Vec<String> = [
        "--json",
        s(&cfg),
        "--if",
        s(&pat),
        "--ob",
        "qe",
        "--bs",
        "65536",
        "--seek",
        "81",
    ]
    .map(String::from)
    .to_vec();
    let (ok, text) = spawn_spdk("spdk_dd", &args, &log).wait(120);
    assert!(ok, "spdk_dd write failed:\n{text}");
    check_clean_keyed(&pw, &img, "after spdk_dd's writes");
    let mut want = want;
    let at = 81 * 65536;
    want[at..at + pattern.len()].copy_from_slice(&pattern);
    same(
        &decrypted(&pw, &img, &d.join("after.raw")),
        &want,
        "qemu-img convert after spdk_dd's writes",
    );
    say("encrypted: 4 MiB spdk_dd wrote through the bdev decrypt in qemu as written; check clean");

    // bdevperf verify on two cores: the second core's replica takes the cipher from the seed.
    let cfg2 = d.join("bp.json");
    keyed_config(
        &cfg2,
        &pw,
        vec![aio(&img, "aio0"), keyed_qcow2("qe", "aio0", false)],
    );
    let (ok, out) = bdevperf(
        d,
        &cfg2,
        "verify",
        &[
            "-m", "0x3", "-C", "-q", "16", "-o", "4096", "-w", "verify", "-t", "3",
        ],
        120,
    );
    assert!(ok, "bdevperf verify failed:\n{out}");
    assert!(!out.contains("miscompare"), "{out}");
    check_clean_keyed(&pw, &img, "after bdevperf verify");
    // What the target then serves is what qemu decrypts (bdevperf's verify left its own data).
    let want = decrypted(&pw, &img, &d.join("after2.raw"));
    let got = dd_out(d, &cfg, "qe", &d.join("got2.raw"), "reread");
    same(&got, &want, "spdk_dd after bdevperf verify");
    say("encrypted: bdevperf verify on two cores passed; check clean; spdk_dd equals qemu");

    // Refusals on a running target: no key, an unknown key, a wrong key, a key for a plain
    // image (that a wrong key writes nothing: `wrong_key_writes_nothing`).
    let t = Target::start(d, "enc", None);
    t.rpc(&["keyring_file_add_key", "k0", s(&pw)]);
    t.rpc(&["keyring_file_add_key", "kbad", s(&bad)]);
    t.rpc(&["bdev_aio_create", s(&img), "aio0", "512"]);
    for (key, why) in [
        (None, "encrypted"),
        (Some("nokey"), "no key named 'nokey'"),
        (Some("kbad"), "invalid password"),
    ] {
        let mut a = vec!["bdev_qcow2_create", "-b", "qe", "--base-bdev", "aio0"];
        if let Some(k) = key {
            a.extend(["--key", k]);
        }
        let (ok, text) = t.try_rpc(&a);
        assert!(!ok && text.contains(why), "key {key:?}: {text}");
        assert!(!text.contains(PASS), "the key's bytes in an answer: {text}");
        assert!(t.bdev("qe").is_none());
    }
    assert_eq!(t.bdev("aio0").unwrap()["claimed"], json!(false));
    let plain = d.join("plain.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&plain), "8M"]);
    pad(&plain);
    t.rpc(&["bdev_aio_create", s(&plain), "aio_plain", "512"]);
    let (ok, text) = t.try_rpc(&[
        "bdev_qcow2_create",
        "-b",
        "qp",
        "--base-bdev",
        "aio_plain",
        "--key",
        "k0",
    ]);
    assert!(!ok && text.contains("not encrypted"), "{text}");
    // bdev_qcow2_format and bdev_qcow2_overlay_create with a key make LUKS images.
    let (fmt, ov, gold) = (d.join("fmt.qcow2"), d.join("ov.qcow2"), d.join("gold.raw"));
    sparse(&fmt, 32 * MIB);
    sparse(&ov, 32 * MIB);
    fs::write(&gold, vec![0x77u8; 8 * MIB as usize]).unwrap();
    t.rpc(&["bdev_aio_create", s(&fmt), "aio_fmt", "512"]);
    let (ok, text) = t.try_rpc(&[
        "bdev_qcow2_format",
        "aio_fmt",
        "-s",
        "16777216",
        "--key",
        "nokey",
    ]);
    assert!(!ok && text.contains("no key named 'nokey'"), "{text}");
    let iter = ["--encrypt-iter-time-ms", "10"];
    let mut a = vec![
        "bdev_qcow2_format",
        "aio_fmt",
        "-s",
        "16777216",
        "--key",
        "k0",
    ];
    a.extend(iter);
    assert_eq!(t.rpc(&a), json!(true));
    t.rpc(&[
        "bdev_qcow2_create",
        "-b",
        "qf",
        "--base-bdev",
        "aio_fmt",
        "--key",
        "k0",
    ]);
    t.rpc(&["bdev_qcow2_delete", "qf"]);
    t.rpc(&["bdev_aio_create", s(&gold), "aio_gold", "512", "-r"]);
    t.rpc(&["bdev_aio_create", s(&ov), "aio_ov", "512"]);
    let mut a = vec![
        "bdev_qcow2_overlay_create",
        "-b",
        "qov",
        "--base-bdev",
        "aio_ov",
        "--backing-bdev",
        "aio_gold",
        "--key",
        "k0",
    ];
    a.extend(iter);
    assert_eq!(t.rpc(&a), json!("qov"));
    let r = t.rpc(&[
        "bdev_qcow2_create",
        "-b",
        "qe",
        "--base-bdev",
        "aio0",
        "--key",
        "k0",
    ]);
    assert_eq!(r, json!("qe"));
    let enc = &t.bdev("qe").unwrap()["driver_specific"]["qcow2"]["encryption"];
    assert_eq!(
        (&enc["cipher_mode"], &enc["key_bits"], &enc["key"]),
        (&json!("xts-plain64"), &json!(512), &json!("k0")),
        "{enc}"
    );
    let saved = t.rpc(&["save_config"]);
    t.stop();
    assert!(!t_log_has(d, "enc", PASS), "the key's bytes in the log");
    let text = saved.to_string();
    assert!(!text.contains(PASS), "the key's bytes in save_config");
    let subsystems: Vec<&str> = saved["subsystems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["subsystem"].as_str().unwrap())
        .collect();
    let pos = |n: &str| subsystems.iter().position(|s| *s == n).unwrap();
    assert!(pos("keyring") < pos("bdev"), "{subsystems:?}");
    let create = saved["subsystems"][pos("bdev")]["config"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["method"] == "bdev_qcow2_create")
        .cloned()
        .expect("bdev_qcow2_create saved");
    assert_eq!(create["params"]["key"], json!("k0"), "{create}");

    // save_config → load_config: the keyring first, then the bdev with its key.
    let cfg = d.join("saved.json");
    fs::write(&cfg, serde_json::to_vec_pretty(&saved).unwrap()).unwrap();
    let t = Target::start(d, "reload", Some(&cfg));
    let qe = t.bdev("qe").expect("qe created from the saved config");
    assert_eq!(qe["num_blocks"], json!(64 * 2048));
    assert!(
        t.bdev("qov").is_some(),
        "the encrypted overlay from the saved config"
    );
    t.stop();
    check_clean_keyed(&pw, &img, "after the reload");
    let ov_info = run_ok(Command::new("qemu-img").args(["info", "--output=json", s(&ov)]));
    let ov_info: Value = serde_json::from_slice(&ov_info.stdout).unwrap();
    assert_eq!(ov_info["encrypted"], json!(true), "{ov_info}");
    assert_eq!(ov_info["backing-filename"], json!("aio_gold"), "{ov_info}");

    // The image bdev_qcow2_format encrypted: spdk_dd writes through it, qemu decrypts them.
    pad(&fmt);
    check_clean_keyed(&pw, &fmt, "the formatted encrypted image");
    let cfg = d.join("fw.json");
    keyed_config(
        &cfg,
        &pw,
        vec![aio(&fmt, "aio_fmt"), keyed_qcow2("qf", "aio_fmt", false)],
    );
    let args: Vec<String> = [
        "--json",
        s(&cfg),
        "--if",
        s(&pat),
        "--ob",
        "qf",
        "--bs",
        "65536",
        "--seek",
        "17",
    ]
    .map(String::from)
    .to_vec();
    let (ok, text) = spawn_spdk("spdk_dd", &args, &d.join("fw.dd.log")).wait(120);
    assert!(ok, "spdk_dd write failed:\n{text}");
    check_clean_keyed(&pw, &fmt, "the formatted image after spdk_dd's writes");
    let mut want = vec![0u8; 16 * MIB as usize];
    let at = 17 * 65536;
    want[at..at + pattern.len()].copy_from_slice(&pattern);
    same(
        &decrypted(&pw, &fmt, &d.join("fmt.raw")),
        &want,
        "qemu-img convert of the image bdev_qcow2_format encrypted",
    );
    say("encrypted: no key, unknown key, wrong key, key for a plain image refused; format and overlay_create with a key make LUKS images qemu opens; save_config names k0 after the keyring; reload serves them");
}

/// Whether target `tag`'s log holds `needle`.
fn t_log_has(d: &Path, tag: &str, needle: &str) -> bool {
    fs::read_to_string(d.join(format!("{tag}.tgt.log")))
        .unwrap_or_default()
        .contains(needle)
}

#[test]
fn wrong_key_writes_nothing() {
    require!("spdk_tgt");
    require_rpc!();
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (pw, bad) = (d.join("pw.key"), d.join("bad.key"));
    key_file(&pw, PASS);
    key_file(&bad, "wrong");
    let img = d.join("dirty.qcow2");
    luks_image(&pw, &img, "16M", ",lazy_refcounts=on", &[]);
    qemu_io_keyed(&pw, &img, &["write -P 0x5a 0 1M"]);
    pad(&img);
    let before = fs::read(&img).unwrap();
    let t = Target::start(d, "wrong", None);
    t.rpc(&["keyring_file_add_key", "kbad", s(&bad)]);
    t.rpc(&["bdev_aio_create", s(&img), "aio0", "512"]);
    let (ok, text) = t.try_rpc(&[
        "bdev_qcow2_create",
        "-b",
        "qe",
        "--base-bdev",
        "aio0",
        "--key",
        "kbad",
    ]);
    assert!(!ok && text.contains("invalid password"), "{text}");
    t.rpc(&["bdev_aio_delete", "aio0"]);
    t.stop();
    same(
        &fs::read(&img).unwrap(),
        &before,
        "the image after a wrong key",
    );
    say("encrypted: a wrong key is refused and the image is byte-identical");
}

/// A warm 4 KiB random read of an encrypted image is granted the direct path on the
/// image's decrypting view, which the module submits to the base as one child read with the
/// request's own buffer and decrypts in its completion (no executor, no task):
/// over a whole `perform_tests` run on two cores, `engine_tasks` (channels and owner) grows
/// only by the slow reads of the run's fresh channels, not by the reads; spdk_dd then reads
/// what qemu decrypts.
#[test]
fn warm_encrypted_reads_run_no_engine_task() {
    require!("bdevperf");
    require_rpc!();
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let pw = d.join("pw.key");
    key_file(&pw, PASS);
    let img = d.join("warm.qcow2");
    luks_image(&pw, &img, "32M", "", &[]);
    // Every cluster allocated: a read is data on the view, never zeros.
    qemu_io_keyed(&pw, &img, &["write -P 0x5a 0 32M"]);
    let want = decrypted(&pw, &img, &d.join("want.raw"));
    let cfg = d.join("warm.json");
    keyed_config(
        &cfg,
        &pw,
        vec![aio(&img, "aio0"), keyed_qcow2("q0", "aio0", false)],
    );
    let job = [
        "-T", "q0", "-q", "16", "-o", "4096", "-w", "randread", "-t", "2", "-m", "0x3", "-C",
    ];
    let tasks = |v: &Value| {
        let t = &v["total"];
        (
            t["engine_tasks"].as_u64().expect("engine_tasks"),
            v["owner"]["engine_tasks"].as_u64().unwrap_or(0),
            t["completed"].as_u64().unwrap_or(0),
            t["fast_reads"].as_u64().unwrap_or(0),
            t["slow_reads"].as_u64().unwrap_or(0),
        )
    };
    let mut seen = None;
    bdevperf_driven_with(d, &cfg, "warm", &job, |sock, perform| {
        // The first run loads the slices; the second is warm.
        let r = perform(&[]);
        assert_eq!(job_counts(&r).0, 0.0, "failed reads: {r}");
        let before = tasks(&q0_stats(sock));
        let r = perform(&[]);
        assert_eq!(job_counts(&r).0, 0.0, "failed reads: {r}");
        seen = Some((before, tasks(&q0_stats(sock))));
    });
    let ((t0, o0, c0, f0, s0), (t1, o1, c1, f1, s1)) = seen.expect("the runs");
    assert!(c1 - c0 > 1000, "completed {c0} -> {c1}");
    assert!(f1 - f0 > 1000, "fast reads {f0} -> {f1}");
    // Each run's jobs open fresh channels, whose replicas start with an empty slice cache:
    // their first reads (about one per request in flight) miss it and run as tasks, and
    // are counted as slow reads. Every other read (before the crypt view's grants went to
    // the executor: every read) runs none.
    assert_eq!(
        (t1 - t0, o1 - o0),
        (s1 - s0, 0),
        "engine tasks (channels, owner) against slow reads over {} reads",
        c1 - c0
    );
    assert!(
        t1 - t0 <= 64,
        "{} engine tasks over {} reads",
        t1 - t0,
        c1 - c0
    );
    // What the bdev serves is still the plaintext qemu decrypts.
    let got = dd_out(d, &cfg, "q0", &d.join("got.raw"), "warm-read");
    same(&got, &want, "spdk_dd after the warm runs");
    say(&format!(
        "encrypted: {} warm 4 KiB random reads on two cores, engine tasks only for the fresh channels' slow reads; spdk_dd equals qemu",
        c1 - c0
    ));
}
