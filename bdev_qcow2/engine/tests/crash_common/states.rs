//! Crash states of a recorded operation, and what `qemu-img check` says of them (shared by
//! `crash_lifecycle.rs` and `crash_bitmap_dir.rs`).

#![allow(dead_code, clippy::unwrap_used)] // each test crate uses its own subset

use qcow2_engine::testing::{LoggedOp, Rng};
use std::process::Command;

/// Every crash state of the writes `log` made on top of `initial`: at each flush boundary,
/// and random subsets of the writes up to the next flush. Calls `verify(label, image)`.
pub fn for_each_crash_state(
    initial: &[u8],
    log: &[LoggedOp],
    subsets: usize,
    seed: u64,
    mut verify: impl FnMut(&str, Vec<u8>),
) -> usize {
    let mut rng = Rng(seed | 1);
    let mut boundaries = vec![0];
    boundaries.extend(
        log.iter()
            .enumerate()
            .filter(|(_, e)| matches!(e, LoggedOp::Flush))
            .map(|(i, _)| i + 1),
    );
    let mut states = 0;
    for &p in &boundaries {
        let next = log[p..]
            .iter()
            .position(|e| matches!(e, LoggedOp::Flush))
            .map_or(log.len(), |q| p + q);
        for subset in 0..=subsets {
            if subset > 0 && next == p {
                break;
            }
            let mut img = initial.to_vec();
            let mut replay = |e: &LoggedOp| replay_op(&mut img, e);
            log[..p].iter().for_each(&mut replay);
            if subset > 0 {
                for e in &log[p..next] {
                    if rng.below(2) == 0 {
                        replay(e);
                    }
                }
            }
            states += 1;
            verify(&format!("log {p} subset {subset}"), img);
        }
    }
    states
}

/// Applies logged operation `e` to image bytes `img`: a write, or a file's new length
/// (which survives like a write: kept or not until a flush).
pub fn replay_op(img: &mut Vec<u8>, e: &LoggedOp) {
    match e {
        LoggedOp::Write(off, data) => {
            let end = *off as usize + data.len();
            if img.len() < end {
                img.resize(end, 0);
            }
            img[*off as usize..end].copy_from_slice(data);
        }
        LoggedOp::Grow(len) => {
            if img.len() < *len as usize {
                img.resize(*len as usize, 0);
            }
        }
        LoggedOp::Discard(..) | LoggedOp::Flush => {}
    }
}

/// `qemu-img check` accepts the image (no corruption; leaks allowed).
pub fn qemu_accepts(label: &str, img: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("crash.qcow2");
    std::fs::write(&path, img).unwrap();
    let out = Command::new("qemu-img")
        .args(["check", "-f", "qcow2"])
        .arg(&path)
        .output()
        .unwrap();
    let code = out.status.code().unwrap_or(-1);
    assert!(
        code == 0 || code == 3,
        "crash state {label}: qemu-img check {code}\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `qemu-img check` finds nothing at all (exit 0: not even a leak).
pub fn qemu_clean(label: &str, img: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("clean.qcow2");
    std::fs::write(&path, img).unwrap();
    let out = Command::new("qemu-img")
        .args(["check", "-f", "qcow2"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{label}: qemu-img check {:?}\n{}{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn say_states(what: &str, n: usize) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{what}: {n} crash states checked");
}
