//! The dirty ranges of a persistent bitmap as QEMU sees them: `qemu-nbd` exports the
//! bitmap and `qemu-img map` reads it back (with `x-dirty-bitmap`, a dirty range reads as
//! one without data). Shared by the tool's and the SPDK module's tests (`#[path]`).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The dirty ranges (start, length) of persistent bitmap `name` of qcow2 image `img`.
pub fn dirty_ranges(img: &Path, name: &str) -> Vec<(u64, u64)> {
    let path = |p: &Path| p.to_str().expect("utf-8 path").to_string();
    let sock = img.with_extension(format!("{name}.sock"));
    let _ = std::fs::remove_file(&sock);
    let mut nbd = Command::new("qemu-nbd")
        .args([
            "-r",
            "-f",
            "qcow2",
            "-B",
            name,
            "-k",
            &path(&sock),
            &path(img),
        ])
        .stdout(Stdio::null())
        .spawn()
        .expect("qemu-nbd");
    let t0 = Instant::now();
    while !sock.exists() {
        if let Ok(Some(st)) = nbd.try_wait() {
            panic!("qemu-nbd exited: {st}");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "qemu-nbd did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let opts = format!(
        "driver=nbd,server.type=unix,server.path={},x-dirty-bitmap=qemu:dirty-bitmap:{name}",
        path(&sock)
    );
    let out = Command::new("qemu-img")
        .args(["map", "--output=json", "--image-opts", &opts])
        .output()
        .expect("qemu-img");
    let _ = nbd.kill();
    let _ = nbd.wait();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for e in v.as_array().expect("a list") {
        if e["data"].as_bool() != Some(false) {
            continue;
        }
        let (start, len) = (
            e["start"].as_u64().unwrap_or(0),
            e["length"].as_u64().unwrap_or(0),
        );
        match ranges.last_mut() {
            Some(l) if l.0 + l.1 == start => l.1 += len,
            _ => ranges.push((start, len)),
        }
    }
    ranges
}
