//! Encrypted images we create (`qcow2 create -o encrypt.format=luks,…`), against the QEMU
//! oracle: qemu-img info shows the encrypt fields it shows for an image it made itself,
//! qemu-io reads what we wrote and we read what it wrote (for each cipher, mode, IV
//! generator and hash), qemu-img check is clean, a wrong key is refused with nothing
//! written, legacy AES is refused; encrypted overlays on plain and encrypted bases; and
//! snapshot, resize, bitmap, commit and convert on encrypted images, read back by QEMU.
//! PBKDF2 cost kept low (iter-time=10).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use std::path::Path;

mod common;
#[path = "common/luks.rs"]
mod luks;
use luks::{
    opts, our_io_opts, ours, ours_ok, qemu_check_clean, qemu_img_secrets, qemu_io_opts, qemu_same,
    SECRET,
};

/// `qcow2 create` of an encrypted image keyed by `key`, with `extra` options.
fn our_create(img: &Path, size: &str, key: &str, extra: &str, args: &[&str]) {
    let o = format!("encrypt.format=luks,encrypt.key-secret={key},encrypt.iter-time=10{extra}");
    let mut a = vec!["-q", "-f", "qcow2", "-o", &o];
    a.extend_from_slice(args);
    a.push(img.to_str().unwrap());
    a.push(size);
    ours_ok("create", &a);
}

/// The encrypt fields of `qemu-img info`, less those that differ between any two images
/// (UUID, calibrated iterations).
fn qemu_encrypt_fields(img: &Path) -> serde_json::Value {
    let out = qemu_img_secrets(&["info", "--output=json", img.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["encrypted"], true);
    let mut e = v.pointer("/format-specific/data/encrypt").unwrap().clone();
    let m = e.as_object_mut().unwrap();
    m.remove("uuid");
    m.remove("master-key-iters");
    for s in m["slots"].as_array_mut().unwrap() {
        s.as_object_mut().unwrap().remove("iters");
    }
    e
}

const CIPHERS: [(&str, &str); 16] = [
    ("v2-4k-clusters", ",compat=0.10,cluster_size=4k"),
    ("extended-l2", ",extended_l2=on,cluster_size=32k"),
    ("default", ""),
    (
        "xts128-sha1",
        ",encrypt.cipher-alg=aes-128,encrypt.hash-alg=sha1",
    ),
    (
        "cbc128-plain64-sha512",
        ",encrypt.cipher-alg=aes-128,encrypt.cipher-mode=cbc,encrypt.hash-alg=sha512",
    ),
    ("xts192", ",encrypt.cipher-alg=aes-192"),
    (
        "cbc256-essiv",
        ",encrypt.cipher-mode=cbc,encrypt.ivgen-alg=essiv,encrypt.ivgen-hash-alg=sha256",
    ),
    (
        "xts128-essiv-sha224",
        ",encrypt.cipher-alg=aes-128,encrypt.ivgen-alg=essiv,encrypt.hash-alg=sha224",
    ),
    (
        "xts-plain-sha384",
        ",encrypt.ivgen-alg=plain,encrypt.hash-alg=sha384",
    ),
    (
        "xts-plain64-ivhash",
        ",encrypt.ivgen-alg=plain64,encrypt.ivgen-hash-alg=sha1",
    ),
    ("xts-md5", ",encrypt.hash-alg=md5"),
    ("twofish256-xts", ",encrypt.cipher-alg=twofish-256"),
    ("serpent128-xts", ",encrypt.cipher-alg=serpent-128"),
    // twofish-192-cbc is refused: QEMU aborts on its key material (not whole sectors).
    (
        "twofish128-cbc-essiv",
        ",encrypt.cipher-alg=twofish-128,encrypt.cipher-mode=cbc,encrypt.ivgen-alg=essiv",
    ),
    (
        "cast5-cbc-plain64",
        ",encrypt.cipher-alg=cast5-128,encrypt.cipher-mode=cbc,encrypt.ivgen-alg=plain64",
    ),
    (
        "cbc128-essiv-ripemd160",
        ",encrypt.cipher-alg=aes-128,encrypt.cipher-mode=cbc,encrypt.ivgen-alg=essiv,encrypt.ivgen-hash-alg=md5,encrypt.hash-alg=ripemd160",
    ),
];

#[test]
fn our_images_read_and_written_by_qemu_for_each_cipher() {
    let dir = tempfile::tempdir().unwrap();
    for (name, extra) in CIPHERS {
        let img = dir.path().join(format!("{name}.qcow2"));
        our_create(&img, "4M", "sec0", extra, &[]);
        // The same options through qemu-img: the same encrypt fields.
        let theirs = dir.path().join(format!("{name}-qemu.qcow2"));
        let o = format!("encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10{extra}");
        qemu_img_secrets(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            &o,
            theirs.to_str().unwrap(),
            "4M",
        ]);
        assert_eq!(
            qemu_encrypt_fields(&img),
            qemu_encrypt_fields(&theirs),
            "{name}"
        );
        let e = opts(&img, Some("sec0"));
        qemu_check_clean(&e);
        // QEMU writes, we read; we write, QEMU reads.
        qemu_io_opts(&e, &["write -P 0x5a 0 64k", "write -P 0x11 100k 12k"]);
        our_io_opts(
            &e,
            &[
                "read -P 0x5a 0 64k",
                "read -P 0x11 100k 12k",
                "read -P 0 112k 16k",
                "write -P 0x77 1M 64k",
                "write -P 0x42 2097664 1k",
                "write -P 0x33 60k 8k",
            ],
        );
        qemu_io_opts(
            &e,
            &[
                "read -P 0x5a 0 60k",
                "read -P 0x33 60k 8k",
                "read -P 0 68k 32k",
                "read -P 0x11 100k 12k",
                "read -P 0x77 1M 64k",
                "read -P 0 2M 512",
                "read -P 0x42 2097664 1k",
            ],
        );
        qemu_check_clean(&e);
        // Our own check agrees (the LUKS area is no leak).
        ours_ok("check", &[img.to_str().unwrap()]);
    }
}

#[test]
fn our_info_and_compare_match_qemu() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("enc.qcow2");
    let plain = dir.path().join("plain.qcow2");
    our_create(&img, "8M", "sec0", "", &[]);
    ours_ok(
        "create",
        &["-q", "-f", "qcow2", plain.to_str().unwrap(), "8M"],
    );
    let cmds = [
        "write -P 0xcd 8k 4k",
        "write -P 0x99 6287360 72k",
        "write -z 1M 64k",
    ];
    our_io_opts(&opts(&img, Some("sec0")), &cmds);
    qemu_io_opts(&opts(&plain, None), &cmds);
    qemu_same(&opts(&img, Some("sec0")), &opts(&plain, None));
    let q: serde_json::Value = serde_json::from_slice(
        &qemu_img_secrets(&["info", "--output=json", img.to_str().unwrap()]).stdout,
    )
    .unwrap();
    let o: serde_json::Value =
        serde_json::from_str(&ours_ok("info", &["--output=json", img.to_str().unwrap()])).unwrap();
    let p = "/format-specific/data/encrypt";
    assert_eq!(o.pointer(p), q.pointer(p));
}

#[test]
fn wrong_key_is_refused_and_nothing_written() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("enc.qcow2");
    our_create(&img, "4M", "sec0", "", &[]);
    our_io_opts(&opts(&img, Some("sec0")), &["write -P 0xab 0 64k"]);
    let before = std::fs::read(&img).unwrap();
    let o = opts(&img, Some("bad"));
    let out = ours(&[
        "io",
        "--object",
        "secret,id=bad,data=wrong",
        "--image-opts",
        &o,
        "-c",
        "write -P 1 0 4k",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid password"));
    // QEMU refuses the wrong key too: our header says the same to it.
    let out = common::output(std::process::Command::new("qemu-io").args([
        "--object",
        "secret,id=bad,data=wrong",
        "--image-opts",
        &o,
        "-c",
        "read 0 4k",
    ]));
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Invalid password"), "{text}");
    assert!(std::fs::read(&img).unwrap() == before, "image changed");
}

#[test]
fn create_refuses_what_it_cannot_make() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("x.qcow2");
    let i = img.to_str().unwrap();
    for (o, why) in [
        ("encrypt.format=aes,encrypt.key-secret=sec0", "qemu-img convert"),
        ("encryption=on,encrypt.key-secret=sec0", "qemu-img convert"),
        ("encrypt.key-secret=sec0", "encrypt.format' is missing"),
        ("encrypt.format=luks", "'encrypt.key-secret' is required"),
        ("encrypt.format=luks,encrypt.key-secret=nope", "No secret with id 'nope'"),
        (
            "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.cipher-mode=cbc,encrypt.ivgen-alg=essiv,encrypt.ivgen-hash-alg=sha1",
            "essiv",
        ),
        ("encrypt.format=luks,encrypt.key-secret=sec0,encrypt.hash-alg=sha3-256", "sha3-256"),
        (
            "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.cipher-alg=aes-192,encrypt.cipher-mode=cbc",
            "not whole sectors",
        ),
        ("encrypt.format=luks,encrypt.key-secret=sec0,encrypt.cipher-alg=sm4", "sm4"),
        ("encrypt.format=luks,encrypt.key-secret=sec0,encrypt.cipher-alg=cast5-128", "xts"),
        (
            "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.cipher-alg=twofish-192,encrypt.cipher-mode=cbc",
            "not whole sectors",
        ),
        (
            "encrypt.format=luks,encrypt.key-secret=sec0,preallocation=metadata",
            "preallocation of an encrypted image",
        ),
    ] {
        let out = ours(&["create", "--object", SECRET, "-f", "qcow2", "-o", o, i, "1M"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{o} accepted");
        assert!(err.contains(why), "{o}: {err}");
        assert!(!img.exists(), "{o}: a file was made");
    }
}

#[test]
fn encrypted_overlays_on_plain_and_encrypted_bases() {
    let dir = tempfile::tempdir().unwrap();
    let d = |n: &str| dir.path().join(n);
    // A plain base.
    let plain = d("plain.qcow2");
    ours_ok(
        "create",
        &["-q", "-f", "qcow2", plain.to_str().unwrap(), "4M"],
    );
    qemu_io_opts(&opts(&plain, None), &["write -P 0x44 0 1M"]);
    let ov = d("ov-plain.qcow2");
    our_create(&ov, "4M", "sec0", "", &["-b", "plain.qcow2", "-F", "qcow2"]);
    let e = opts(&ov, Some("sec0"));
    qemu_io_opts(&e, &["read -P 0x44 0 1M", "write -P 0x55 64k 4k"]);
    our_io_opts(
        &e,
        &[
            "read -P 0x44 0 64k",
            "read -P 0x55 64k 4k",
            "read -P 0x44 68k 60k",
        ],
    );
    qemu_check_clean(&e);
    // Rebase onto nothing: the base's data copied in, encrypted; QEMU reads it alone.
    ours_ok("rebase", &["--allow-backing", "-b", "", "--image-opts", &e]);
    std::fs::remove_file(&plain).unwrap();
    qemu_io_opts(
        &e,
        &[
            "read -P 0x44 0 64k",
            "read -P 0x55 64k 4k",
            "read -P 0x44 68k 956k",
        ],
    );
    qemu_check_clean(&e);
    // An encrypted base with its own key; no SIZE: the base's (read without its key).
    let base = d("base.qcow2");
    our_create(
        &base,
        "4M",
        "sec1",
        ",encrypt.cipher-mode=cbc,encrypt.ivgen-alg=essiv",
        &[],
    );
    qemu_io_opts(&opts(&base, Some("sec1")), &["write -P 0x11 0 1M"]);
    let ov = d("ov-enc.qcow2");
    let o = "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10";
    ours_ok(
        "create",
        &[
            "-q",
            "-f",
            "qcow2",
            "-o",
            o,
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
            ov.to_str().unwrap(),
        ],
    );
    let chain = format!(
        "{},backing.encrypt.key-secret=sec1",
        opts(&ov, Some("sec0"))
    );
    qemu_io_opts(&chain, &["read -P 0x11 0 1M", "write -P 0x22 512k 64k"]);
    our_io_opts(
        &chain,
        &[
            "read -P 0x11 0 512k",
            "read -P 0x22 512k 64k",
            "write -P 0x33 2M 4k",
        ],
    );
    qemu_io_opts(
        &chain,
        &[
            "read -P 0x22 512k 64k",
            "read -P 0x33 2M 4k",
            "read -P 0 3M 1M",
        ],
    );
    qemu_check_clean(&chain);
    // Commit the overlay into the encrypted base: QEMU reads it with the base's key.
    ours_ok("commit", &["--allow-backing", "--image-opts", &chain]);
    let b = opts(&base, Some("sec1"));
    qemu_io_opts(
        &b,
        &[
            "read -P 0x11 0 512k",
            "read -P 0x22 512k 64k",
            "read -P 0x33 2M 4k",
        ],
    );
    qemu_check_clean(&b);
}

#[test]
fn snapshot_resize_bitmap_convert_on_encrypted_images() {
    let dir = tempfile::tempdir().unwrap();
    let d = |n: &str| dir.path().join(n);
    let img = d("enc.qcow2");
    our_create(&img, "4M", "sec0", "", &[]);
    let e = opts(&img, Some("sec0"));
    qemu_io_opts(&e, &["write -P 0x5a 0 128k"]);
    // Internal snapshot: create, overwrite, apply; QEMU reads the snapshot's data back.
    ours_ok("snapshot", &["-c", "s1", "--image-opts", &e]);
    our_io_opts(&e, &["write -P 0x66 0 64k"]);
    ours_ok("snapshot", &["-a", "s1", "--image-opts", &e]);
    qemu_io_opts(&e, &["read -P 0x5a 0 128k"]);
    // Resize (grow): QEMU writes and reads past the old end; the old data stays.
    ours_ok("resize", &["--image-opts", &e, "8M"]);
    qemu_io_opts(&e, &["write -P 0x21 6M 64k"]);
    our_io_opts(
        &e,
        &[
            "read -P 0x21 6M 64k",
            "read -P 0x5a 0 128k",
            "read -P 0 5M 64k",
        ],
    );
    // A persistent bitmap, added and listed.
    ours_ok("bitmap", &["--add", "--image-opts", &e, "b0"]);
    let info = String::from_utf8_lossy(
        &qemu_img_secrets(&["info", "--output=json", img.to_str().unwrap()]).stdout,
    )
    .to_string();
    assert!(info.contains("\"b0\""), "{info}");
    qemu_check_clean(&e);
    // Convert encrypted -> plain, and plain -> encrypted with another cipher and key.
    let plain = d("plain.qcow2");
    ours_ok(
        "convert",
        &["-O", "qcow2", "--image-opts", &e, plain.to_str().unwrap()],
    );
    qemu_same(&e, &opts(&plain, None));
    let enc2 = d("enc2.qcow2");
    let o = "encrypt.format=luks,encrypt.key-secret=sec1,encrypt.iter-time=10,encrypt.cipher-alg=aes-128";
    ours_ok(
        "convert",
        &[
            "-O",
            "qcow2",
            "-o",
            o,
            plain.to_str().unwrap(),
            enc2.to_str().unwrap(),
        ],
    );
    let e2 = opts(&enc2, Some("sec1"));
    qemu_same(&e2, &opts(&plain, None));
    qemu_check_clean(&e2);
    // Encrypted -> encrypted (each its own key), and compression is refused with it.
    let enc3 = d("enc3.qcow2");
    let o = "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10";
    ours_ok(
        "convert",
        &[
            "-O",
            "qcow2",
            "-o",
            o,
            "--image-opts",
            &e2,
            enc3.to_str().unwrap(),
        ],
    );
    qemu_same(&opts(&enc3, Some("sec0")), &e);
    let out = ours(&[
        "convert",
        "--object",
        SECRET,
        "-c",
        "-O",
        "qcow2",
        "-o",
        o,
        plain.to_str().unwrap(),
        d("c.qcow2").to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("Compression"));
}

#[test]
fn measure_counts_the_luks_area_as_qemu() {
    for o in [
        "encrypt.format=luks,encrypt.key-secret=sec0",
        "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.cipher-alg=aes-128",
        "encrypt.format=luks,encrypt.key-secret=sec0,cluster_size=4k",
    ] {
        let args = ["-O", "qcow2", "-o", o, "--size", "1G", "--output=json"];
        let q = qemu_img_secrets(&[&["measure"][..], &args[..]].concat());
        let q: serde_json::Value = serde_json::from_slice(&q.stdout).unwrap();
        let ours: serde_json::Value = serde_json::from_str(&ours_ok("measure", &args)).unwrap();
        assert_eq!(ours, q, "{o}");
    }
}
