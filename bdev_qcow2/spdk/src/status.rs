//! How a guest request ends, as the module tells SPDK: done, failed, or failed for want of
//! room on the base. The last is its own status because an operator can cure it (grow the
//! base) and a guest can tell it apart: NVMe's Capacity Exceeded, which Linux hosts report
//! as `ENOSPC`; the front ends that only know success and failure see a failure.

use crate::ffi::bdev_io::BdevIo;
use crate::ffi::sys;
use crate::ffi::types::BdevTypes;

/// `ENOSPC`: the errno of a device (or allocation) out of room.
const ENOSPC: i32 = 28;

/// The end of a guest request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Done.
    Success,
    /// Failed (an I/O error, corruption, a refused request).
    Failed,
    /// Failed: the image needed room the base does not have.
    NoSpace,
}

impl Status {
    /// The status of an engine result.
    #[inline(always)]
    pub fn of(r: &qcow2_engine::Result<()>) -> Status {
        match r {
            Ok(()) => Status::Success,
            Err(e) if e.errno() == ENOSPC => Status::NoSpace,
            Err(_) => Status::Failed,
        }
    }

    /// Success or a plain failure (a child I/O's outcome).
    #[inline(always)]
    pub fn of_success(ok: bool) -> Status {
        if ok {
            Status::Success
        } else {
            Status::Failed
        }
    }

    /// Completes `io` with this status.
    #[inline(always)]
    pub fn complete<M: BdevTypes>(self, io: BdevIo<M>) {
        match self {
            Status::Success => io.complete(sys::SPDK_BDEV_IO_STATUS_SUCCESS),
            Status::Failed => io.complete(sys::SPDK_BDEV_IO_STATUS_FAILED),
            Status::NoSpace => io.complete_nvme(
                sys::SPDK_NVME_SCT_GENERIC,
                sys::SPDK_NVME_SC_CAPACITY_EXCEEDED,
            ),
        }
    }
}
