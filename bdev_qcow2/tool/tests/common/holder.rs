//! Processes that hold an image open, for the tests of locking: qemu-io waiting on its
//! stdin, seen holding its lock bytes in /proc/locks before a test goes on.

#![allow(dead_code)] // each test crate uses its own subset

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::s;

/// QEMU's lock byte held by every opener that writes (`RAW_LOCK_PERM_BASE` + write).
pub const WRITER_BYTE: u64 = 101;
/// The lock byte held by every opener that reads (+ consistent read).
pub const READER_BYTE: u64 = 100;

/// Whether some open file description holds a lock over `byte` of `path` (/proc/locks).
pub fn byte_locked(path: &Path, byte: u64) -> bool {
    let ino = std::fs::metadata(path).expect("stat").ino();
    let locks = std::fs::read_to_string("/proc/locks").expect("/proc/locks");
    locks.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        // "N: OFDLCK ADVISORY READ -1 MAJ:MIN:INO START END"
        f.len() >= 8
            && f[5].rsplit(':').next() == Some(&ino.to_string())
            && f[6].parse::<u64>().is_ok_and(|a| a <= byte)
            && (f[7] == "EOF" || f[7].parse::<u64>().is_ok_and(|b| b >= byte))
    })
}

/// Waits (at most 20 s) until `byte` of `path` is locked: the holder has opened it.
pub fn wait_locked(path: &Path, byte: u64, holder: &mut Child) {
    let t0 = Instant::now();
    while !byte_locked(path, byte) {
        if let Ok(Some(st)) = holder.try_wait() {
            panic!("the holder exited ({st}) before locking {}", path.display());
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "byte {byte} of {} never locked",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// qemu-io with the image open (`-r`: read-only) and waiting on its stdin; closing the
/// stdin ends it.
pub struct QemuHolder {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl QemuHolder {
    pub fn open(img: &Path, read_only: bool) -> QemuHolder {
        let mut c = Command::new("qemu-io");
        if read_only {
            c.arg("-r");
        }
        let mut child = c
            .args(["-f", "qcow2", s(img)])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn qemu-io");
        let stdin = child.stdin.take();
        let byte = if read_only { READER_BYTE } else { WRITER_BYTE };
        wait_locked(img, byte, &mut child);
        QemuHolder { child, stdin }
    }

    /// Closes qemu-io's stdin and waits for it to exit.
    pub fn close(mut self) {
        drop(self.stdin.take());
        let st = self.child.wait().expect("wait qemu-io");
        assert!(st.success(), "qemu-io holder: {st}");
    }
}
