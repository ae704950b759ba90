//! Safe wrappers over the few libc calls the tool makes that std does not wrap.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

fn check(r: libc::c_int) -> io::Result<()> {
    if r == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// An open-file-description lock command (`fcntl`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OfdLockCmd {
    /// `F_OFD_SETLK`: takes (never waits) or releases the lock described.
    Set,
    /// `F_OFD_GETLK`: overwrites the description with a conflicting lock, or sets its
    /// type to `F_UNLCK` if there is none.
    Get,
}

/// `fcntl(fd, F_OFD_SETLK | F_OFD_GETLK, fl)`.
pub fn ofd_lock(fd: BorrowedFd<'_>, cmd: OfdLockCmd, fl: &mut libc::flock) -> io::Result<()> {
    let cmd = match cmd {
        OfdLockCmd::Set => libc::F_OFD_SETLK,
        OfdLockCmd::Get => libc::F_OFD_GETLK,
    };
    // SAFETY: `fd` is an open descriptor borrowed for the call; `fl` is a valid, writable
    // `struct flock` that outlives it, which F_OFD_SETLK only reads and F_OFD_GETLK
    // overwrites in place.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), cmd, fl as *mut libc::flock) })
}

/// The soft and hard limits on open files (`getrlimit(RLIMIT_NOFILE)`).
pub fn nofile_limit() -> io::Result<libc::rlimit> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable `struct rlimit` that outlives the call.
    check(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) })?;
    Ok(lim)
}

/// Sets the limits on open files (`setrlimit(RLIMIT_NOFILE)`).
pub fn set_nofile_limit(lim: &libc::rlimit) -> io::Result<()> {
    // SAFETY: `lim` is a valid, initialised `struct rlimit` that outlives the call.
    check(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, lim) })
}

/// Allocates the blocks of `len` bytes from `offset` (`posix_fallocate`).
pub fn posix_fallocate(
    fd: BorrowedFd<'_>,
    offset: libc::off_t,
    len: libc::off_t,
) -> io::Result<()> {
    // SAFETY: `fd` is an open descriptor for the call's duration; posix_fallocate only
    // allocates blocks for the range and returns an errno.
    match unsafe { libc::posix_fallocate(fd.as_raw_fd(), offset, len) } {
        0 => Ok(()),
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

/// The size of a block device in bytes (`ioctl(BLKGETSIZE64)`).
pub fn block_device_size(fd: BorrowedFd<'_>) -> io::Result<u64> {
    // BLKGETSIZE64 = _IOR(0x12, 114, size_t)
    const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
    let mut size: u64 = 0;
    // SAFETY: `fd` is open for the call; the ioctl writes one u64 into `size`, alive and
    // writable for the call.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) })?;
    Ok(size)
}

/// The type (magic number) of the file system holding `fd` (`fstatfs`'s `f_type`).
pub fn fs_type(fd: BorrowedFd<'_>) -> io::Result<i64> {
    // SAFETY: `statfs` is a plain C struct that `fstatfs` fills; all-zero is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open for the call; `st` is writable and alive.
    check(unsafe { libc::fstatfs(fd.as_raw_fd(), &mut st) })?;
    Ok(st.f_type as i64)
}

/// Where `lseek` with `whence` (`SEEK_DATA` or `SEEK_HOLE`) from `pos` lands.
fn seek(fd: BorrowedFd<'_>, pos: u64, whence: libc::c_int) -> io::Result<u64> {
    let pos =
        libc::off_t::try_from(pos).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: lseek on a descriptor open for the call has no memory effects.
    let r = unsafe { libc::lseek(fd.as_raw_fd(), pos, whence) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r as u64)
}

/// The start of the first data at or after `pos` (`SEEK_DATA`; ENXIO if none).
pub fn seek_data(fd: BorrowedFd<'_>, pos: u64) -> io::Result<u64> {
    seek(fd, pos, libc::SEEK_DATA)
}

/// The start of the first hole at or after `pos` (`SEEK_HOLE`; the end of file counts).
pub fn seek_hole(fd: BorrowedFd<'_>, pos: u64) -> io::Result<u64> {
    seek(fd, pos, libc::SEEK_HOLE)
}

/// A hint to the CPU to load the cache line at `p` into its caches (no effect on other
/// architectures).
#[inline]
pub fn prefetch_line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults, whatever the address; SSE is part of x86_64.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
