//! Image file locks, in the scheme of QEMU's file-posix driver, so that QEMU and this tool
//! keep each other out of an image the other is writing.
//!
//! QEMU's block layer has four permissions on a file (consistent read, write, write
//! unchanged, resize). Permission bit `i` owns two bytes of the file, used as shared
//! open-file-description (OFD) locks that never cover data QEMU reads or writes:
//! - byte 100 + i is held by every opener that *uses* the permission;
//! - byte 200 + i is held by every opener that does *not let others* use it.
//!
//! An opener first takes its own bytes, then tests, with an exclusive `F_OFD_GETLK` probe
//! (which ignores its own locks), byte 200 + i for every permission it uses and byte
//! 100 + i for every permission it does not share. A lock held there by another open file
//! description (another process, or another open of the same file) is a conflict and the
//! open fails. The locks belong to the open file description: closing the file (or the
//! process ending, however) releases them, so a refused open needs no cleanup beyond
//! dropping its file.

use crate::ffi::sys::{self, OfdLockCmd};
use std::fmt;
use std::io;
use std::os::fd::BorrowedFd;

/// First lock byte of the permissions an opener uses (QEMU's `RAW_LOCK_PERM_BASE`; libvirt
/// uses byte 0, QEMU leaves it room).
const PERM_BASE: i64 = 100;
/// First lock byte of the permissions an opener denies to others (`RAW_LOCK_SHARED_BASE`).
const SHARED_BASE: i64 = 200;

/// A set of QEMU block permissions (`BLK_PERM_*`); bit `i` owns lock bytes 100 + i and
/// 200 + i.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Perms(u8);

impl Perms {
    /// `BLK_PERM_CONSISTENT_READ`: reads see the data as written (nobody changes it
    /// behind the reader's back).
    pub const CONSISTENT_READ: Perms = Perms(1 << 0);
    /// `BLK_PERM_WRITE`: writes that change what the file reads.
    pub const WRITE: Perms = Perms(1 << 1);
    /// `BLK_PERM_WRITE_UNCHANGED`: writes that leave what the file reads unchanged.
    pub const WRITE_UNCHANGED: Perms = Perms(1 << 2);
    /// `BLK_PERM_RESIZE`: changing the file's length.
    pub const RESIZE: Perms = Perms(1 << 3);
    /// Every permission (`BLK_PERM_ALL`).
    pub const ALL: Perms = Perms(0b1111);
    /// No permission.
    pub const NONE: Perms = Perms(0);

    /// Both sets.
    pub const fn union(self, other: Perms) -> Perms {
        Perms(self.0 | other.0)
    }

    /// The permissions not in this set.
    pub const fn complement(self) -> Perms {
        Perms(!self.0 & Perms::ALL.0)
    }

    /// Whether every permission of `other` is in this set.
    pub const fn contains(self, other: Perms) -> bool {
        self.0 & other.0 == other.0
    }

    /// Each permission of the set alone, with its bit index (its lock bytes' offset from
    /// each base), lowest first.
    fn each(self) -> impl Iterator<Item = (i64, Perms)> {
        (0..4).filter_map(move |i| {
            let p = Perms(1 << i);
            self.contains(p).then_some((i64::from(i), p))
        })
    }

    /// QEMU's name of a single permission (as in its lock error messages).
    fn name(self) -> &'static str {
        match self {
            Perms::CONSISTENT_READ => "consistent read",
            Perms::WRITE => "write",
            Perms::WRITE_UNCHANGED => "write unchanged",
            Perms::RESIZE => "resize",
            _ => "permissions",
        }
    }
}

/// How a file is opened; decides the permissions taken and those left to others, as QEMU
/// derives them for the file under its format driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read-only, and nobody may change the file meanwhile: an image a command reads, and
    /// every backing file. QEMU's readers take the same, so readers coexist, and a writer
    /// (ours or QEMU's) is refused while one is open.
    Read,
    /// Read-only, letting others do anything (`-U`/`--force-share`, as qemu-img): takes
    /// no byte a writer tests, so it may read an image that is being changed.
    ReadForceShare,
    /// A qcow2 image opened for writing: its metadata changes even without guest writes,
    /// so it writes and resizes, and lets others only read (and write unchanged data).
    Write,
    /// The raw output of `convert -O raw`: written and resized, while (as qemu-img's raw
    /// convert target) nothing is denied to others.
    WriteRaw,
    /// A file being created (truncated and formatted): as QEMU's image creation, it
    /// writes and resizes and denies others only resizing.
    Create,
}

impl Access {
    /// (permissions taken, permissions shared with other openers).
    fn perms(self) -> (Perms, Perms) {
        let read_share = Perms::CONSISTENT_READ.union(Perms::WRITE_UNCHANGED);
        let write = Perms::CONSISTENT_READ
            .union(Perms::WRITE)
            .union(Perms::RESIZE);
        match self {
            Access::Read => (Perms::CONSISTENT_READ, read_share),
            Access::ReadForceShare => (Perms::CONSISTENT_READ, Perms::ALL),
            Access::Write => (write, read_share),
            Access::WriteRaw => (write, Perms::ALL),
            Access::Create => (
                Perms::WRITE.union(Perms::RESIZE),
                Perms::RESIZE.complement(),
            ),
        }
    }
}

/// Why a file could not be locked.
#[derive(Debug)]
pub enum LockFailure {
    /// Another opener holds a conflicting byte: it denies a permission this open uses
    /// (`shared == false`, QEMU's `Failed to get "write" lock`), or uses one this open
    /// denies (`shared == true`, `Failed to get shared "write" lock`).
    Conflict {
        /// The permission in conflict.
        perm: Perms,
        /// Whether the conflict is over a permission this open does not share.
        shared: bool,
    },
    /// The lock call failed (a file system without OFD locks, for one).
    Os {
        /// The lock byte concerned.
        byte: i64,
        /// The OS error.
        source: io::Error,
    },
}

impl LockFailure {
    /// Whether another opener is in the way (rather than the lock call failing).
    pub fn is_conflict(&self) -> bool {
        matches!(self, LockFailure::Conflict { .. })
    }
}

impl fmt::Display for LockFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockFailure::Conflict { perm, shared } => {
                let shared = if *shared { "shared " } else { "" };
                write!(f, "Failed to get {shared}\"{}\" lock", perm.name())
            }
            LockFailure::Os { byte, source } => write!(f, "Failed to lock byte {byte}: {source}"),
        }
    }
}

/// Takes the lock bytes of `access` on the open file `fd`, then checks that no other
/// opener conflicts. Returns `Ok` when the file may be used as `access` says (the locks
/// stay until the file is closed); otherwise the first failure, in QEMU's order (the
/// permissions this open uses, then those it denies). On failure the bytes already taken
/// stay held until the caller closes the file, which it must then do.
pub fn lock(fd: BorrowedFd<'_>, access: Access) -> Result<(), LockFailure> {
    let (perm, shared) = access.perms();
    let denied = shared.complement();
    let bytes = perm
        .each()
        .map(|(i, _)| PERM_BASE + i)
        .chain(denied.each().map(|(i, _)| SHARED_BASE + i));
    for byte in bytes {
        ofd_lock(fd, OfdLockCmd::Set, libc::F_RDLCK, byte, 1)
            .map_err(|source| LockFailure::Os { byte, source })?;
    }
    let probes = perm
        .each()
        .map(|(i, p)| (SHARED_BASE + i, p, false))
        .chain(denied.each().map(|(i, p)| (PERM_BASE + i, p, true)));
    for (byte, p, is_shared) in probes {
        let held = ofd_lock(fd, OfdLockCmd::Get, libc::F_WRLCK, byte, 1)
            .map_err(|source| LockFailure::Os { byte, source })?;
        if held {
            return Err(LockFailure::Conflict {
                perm: p,
                shared: is_shared,
            });
        }
    }
    Ok(())
}

/// Releases every lock byte this open file description holds (what [`lock`] took, with
/// any access). Nothing else is locked by this module, and a byte not held is no error;
/// a failure (which unlocking cannot meet on a valid descriptor) is ignored, as the close
/// that follows releases them anyway.
pub fn unlock(fd: BorrowedFd<'_>) {
    let len = SHARED_BASE + 4 - PERM_BASE;
    let _ = ofd_lock(fd, OfdLockCmd::Set, libc::F_UNLCK, PERM_BASE, len);
}

/// One OFD lock call on `len` bytes from `start`: `F_OFD_SETLK` takes (never waits) or,
/// with `F_UNLCK`, releases a lock of type `kind` (and returns false); `F_OFD_GETLK` asks
/// whether a lock of type `kind` would conflict with one another open file description
/// holds (returns true if so).
fn ofd_lock(
    fd: BorrowedFd<'_>,
    cmd: OfdLockCmd,
    kind: libc::c_int,
    start: i64,
    len: i64,
) -> io::Result<bool> {
    let mut fl = libc::flock {
        l_type: kind as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: start,
        l_len: len,
        // OFD locks require 0 here.
        l_pid: 0,
    };
    sys::ofd_lock(fd, cmd, &mut fl)?;
    Ok(cmd == OfdLockCmd::Get && fl.l_type != libc::F_UNLCK as libc::c_short)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn scratch() -> (tempfile::TempDir, std::path::PathBuf) {
        let d = tempfile::tempdir().expect("scratch dir");
        let p = d.path().join("img");
        std::fs::write(&p, [0u8; 4096]).expect("scratch file");
        (d, p)
    }

    fn open(p: &std::path::Path) -> std::fs::File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(p)
            .expect("open")
    }

    /// Two opens of one file conflict exactly as QEMU's openers do.
    #[test]
    fn openers_conflict_as_qemus() {
        let (_d, p) = scratch();
        let (a, b) = (open(&p), open(&p));
        lock(a.as_fd(), Access::Read).expect("first reader");
        lock(b.as_fd(), Access::Read).expect("readers coexist");
        let w = open(&p);
        match lock(w.as_fd(), Access::Write) {
            Err(LockFailure::Conflict { perm, shared }) => {
                assert_eq!((perm, shared), (Perms::WRITE, false));
            }
            r => panic!("a writer beside readers: {r:?}"),
        }
        drop((a, b, w));
        let w = open(&p);
        lock(w.as_fd(), Access::Write).expect("writer alone");
        let r = open(&p);
        let e = lock(r.as_fd(), Access::Read).expect_err("reader beside a writer");
        assert_eq!(e.to_string(), "Failed to get shared \"write\" lock");
        let u = open(&p);
        lock(u.as_fd(), Access::ReadForceShare).expect("-U reader beside a writer");
        // Released without closing: a reader gets in while the writer's file is open.
        unlock(w.as_fd());
        lock(r.as_fd(), Access::Read).expect("reader after the writer unlocked");
    }
}
