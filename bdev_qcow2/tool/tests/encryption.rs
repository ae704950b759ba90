//! LUKS-encrypted qcow2 against the QEMU oracle: images qemu-img made and qemu-io wrote,
//! read by us byte for byte; images we wrote, read back by `qemu-img compare` with the same
//! secret and `qemu-img check`ed; wrong or missing keys refused with nothing written;
//! `info` as `qemu-img info` shows the LUKS header. PBKDF2 cost kept low (iter-time=10).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use qcow2_tool::rng::Rng;
use std::path::Path;
use std::process::Command;

mod common;
#[path = "common/luks.rs"]
mod luks;
use common::{qemu_img, run};
use luks::{ours, SECRET};

fn opts(img: &Path) -> String {
    luks::opts(img, Some("sec0"))
}

/// `qemu-img create` of an encrypted image with `extra` encrypt options.
fn create(img: &Path, size: &str, extra: &str) {
    let o = format!("encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10{extra}");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "--object",
        SECRET,
        "-o",
        &o,
        img.to_str().unwrap(),
        size,
    ]);
}

fn qemu_io(img: &Path, cmds: &[String]) {
    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
    luks::qemu_io_opts(&opts(img), &cmds);
}

fn our_io(img: &Path, cmds: &[String]) {
    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
    luks::our_io_opts(&opts(img), &cmds);
}

fn random_file(dir: &Path) -> String {
    let p = dir.join("random.bin");
    let mut r = Rng(0xfeed);
    std::fs::write(
        &p,
        (0..1 << 20).map(|_| r.next() as u8).collect::<Vec<u8>>(),
    )
    .unwrap();
    p.display().to_string()
}

/// Writes a mix of full, partial and scattered clusters with qemu-io.
fn qemu_fill(img: &Path, rand: &str) -> Vec<String> {
    let cmds: Vec<String> = [
        format!("write -s {rand} 0 64k"),
        "write -P 0x11 100k 12k".into(),
        format!("write -s {rand} 1M 200k"),
        "write -P 0x5a 3146240 3584".into(),
        "write -z 1114112 64k".into(),
        "discard 1179648 64k".into(),
    ]
    .into();
    qemu_io(img, &cmds);
    cmds
}

fn convert_qemu(img: &Path, out: &Path) {
    let mut c = Command::new("qemu-img");
    c.args([
        "convert",
        "--object",
        SECRET,
        "--image-opts",
        &opts(img),
        "-O",
        "raw",
    ])
    .arg(out);
    run(&mut c);
}

#[test]
fn qemu_written_images_read_exactly_for_each_cipher() {
    let dir = tempfile::tempdir().unwrap();
    let rand = random_file(dir.path());
    for (name, extra) in [
        ("default", ""),
        ("xts128-sha1", ",encrypt.cipher-alg=aes-128,encrypt.hash-alg=sha1"),
        ("xts256-sha512", ",encrypt.hash-alg=sha512"),
        ("cbc-essiv", ",encrypt.cipher-alg=aes-256,encrypt.cipher-mode=cbc,encrypt.ivgen-alg=essiv,encrypt.ivgen-hash-alg=sha256"),
        ("cbc128-plain64", ",encrypt.cipher-alg=aes-128,encrypt.cipher-mode=cbc,encrypt.ivgen-alg=plain64"),
        ("xts-plain", ",encrypt.ivgen-alg=plain"),
        ("xts-md5", ",encrypt.hash-alg=md5"),
        ("cbc-essiv-md5-ripemd160", ",encrypt.cipher-alg=aes-128,encrypt.cipher-mode=cbc,encrypt.ivgen-alg=essiv,encrypt.ivgen-hash-alg=md5,encrypt.hash-alg=ripemd160"),
        ("twofish256-xts", ",encrypt.cipher-alg=twofish-256"),
        ("serpent128-xts", ",encrypt.cipher-alg=serpent-128"),
        ("serpent192-xts-plain", ",encrypt.cipher-alg=serpent-192,encrypt.ivgen-alg=plain"),
        ("twofish128-cbc-essiv", ",encrypt.cipher-alg=twofish-128,encrypt.cipher-mode=cbc,encrypt.ivgen-alg=essiv"),
        ("cast5-cbc-plain64", ",encrypt.cipher-alg=cast5-128,encrypt.cipher-mode=cbc,encrypt.ivgen-alg=plain64"),
        ("cast5-cbc-essiv-md5", ",encrypt.cipher-alg=cast5-128,encrypt.cipher-mode=cbc,encrypt.ivgen-alg=essiv,encrypt.ivgen-hash-alg=md5"),
    ] {
        let img = dir.path().join(format!("{name}.qcow2"));
        create(&img, "4M", extra);
        qemu_fill(&img, &rand);
        let (a, b) = (dir.path().join("a.raw"), dir.path().join("b.raw"));
        convert_qemu(&img, &a);
        let o = opts(&img);
        let out = ours(&["convert", "--object", SECRET, "--image-opts", &o, b.to_str().unwrap()]);
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(
            std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(),
            "{name}: our read differs from QEMU's"
        );
    }
}

#[test]
fn our_writes_read_back_by_qemu() {
    let dir = tempfile::tempdir().unwrap();
    let rand = random_file(dir.path());
    let img = dir.path().join("enc.qcow2");
    let plain = dir.path().join("plain.qcow2");
    create(&img, "8M", "");
    qemu_img(&["create", "-q", "-f", "qcow2", plain.to_str().unwrap(), "8M"]);
    let mut cmds = qemu_fill(&img, &rand);
    cmds.extend(
        [
            // Overwrites of QEMU's clusters, new partial clusters (COW of encrypted
            // zeros), a write across clusters, write-zeroes of part of a cluster.
            "write -P 0xcd 8k 4k".to_string(),
            "write -P 0x77 5M 64k".into(),
            "write -P 0x42 2097664 1k".into(),
            "write -P 0x99 6287360 72k".into(),
            "write -z 1052672 4k".into(),
            "write -P 0x31 3M 512".into(),
        ]
        .iter()
        .cloned(),
    );
    our_io(&img, &cmds[6..]);
    // The same commands on a plain image, by QEMU alone.
    let mut c = Command::new("qemu-io");
    c.args(["-f", "qcow2"]);
    for x in &cmds {
        c.arg("-c").arg(x);
    }
    run(c.arg(&plain));
    let e = opts(&img);
    luks::qemu_same(&e, &luks::opts(&plain, None));
    luks::qemu_check_clean(&e);
}

#[test]
fn wrong_or_missing_key_is_refused_and_nothing_written() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("enc.qcow2");
    create(&img, "4M", "");
    qemu_io(&img, &["write -P 0xab 0 64k".into()]);
    let before = std::fs::read(&img).unwrap();
    let o = opts(&img);
    let out = ours(&[
        "io",
        "--object",
        "secret,id=sec0,data=wrong",
        "--image-opts",
        &o,
        "-c",
        "write -P 1 0 4k",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid password"));
    let out = ours(&["io", img.to_str().unwrap(), "-c", "write -P 1 0 4k"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("key is needed"));
    assert!(std::fs::read(&img).unwrap() == before, "image changed");
    // Compression is refused too, as QEMU refuses it.
    let out = ours(&[
        "io",
        "--object",
        SECRET,
        "--image-opts",
        &o,
        "-c",
        "write -c 0 64k",
    ]);
    assert!(
        !out.status.success() || String::from_utf8_lossy(&out.stdout).contains("not supported")
    );
}

#[test]
fn info_shows_the_luks_header_as_qemu_img() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("enc.qcow2");
    create(
        &img,
        "4M",
        ",encrypt.cipher-mode=cbc,encrypt.ivgen-alg=essiv",
    );
    let q: serde_json::Value =
        serde_json::from_slice(&qemu_img(&["info", "--output=json", img.to_str().unwrap()]).stdout)
            .unwrap();
    let out = ours(&["info", "--output=json", img.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let o: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let p = "/format-specific/data/encrypt";
    assert_eq!(o.pointer(p), q.pointer(p));
    assert_eq!(o["encrypted"], q["encrypted"]);
}

#[test]
fn legacy_aes_names_qemu_img_convert() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("aes.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", img.to_str().unwrap(), "1M"]);
    let mut b = std::fs::read(&img).unwrap();
    b[32..36].copy_from_slice(&1u32.to_be_bytes()); // crypt_method: AES
    std::fs::write(&img, b).unwrap();
    let out = ours(&["info", img.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("qemu-img convert"));
}
