//! Opening the bdevs a node reads (base, backing): open, claim, check the block size;
//! `E` hears of their events (`hotplug.rs`).

use super::BLOCK_SIZE;
use crate::ffi::bdev::{BdevEvents, Desc, OpenMode};
use crate::ffi::sys;

pub(super) fn strerror(e: i32) -> String {
    std::io::Error::from_raw_os_error(e).to_string()
}

/// Opens and claims `name` for our module: shared read-only, or (`ReadWrite`) as its only
/// writer.
pub(super) fn open_claimed<E: BdevEvents>(
    name: &str,
    role: &str,
    mode: OpenMode,
) -> Result<Desc, (i32, String)> {
    let write = mode == OpenMode::ReadWrite;
    let d = Desc::open::<E>(name, mode).map_err(|e| {
        (
            e,
            format!(
                "cannot open {role} bdev {name}{}: {}",
                if write { " for writing" } else { "" },
                strerror(e)
            ),
        )
    })?;
    let kind = if write {
        sys::SPDK_BDEV_CLAIM_READ_MANY_WRITE_ONE
    } else {
        sys::SPDK_BDEV_CLAIM_READ_MANY_WRITE_NONE
    };
    if let Err(e) = d.claim(kind) {
        d.close();
        return Err((
            e,
            format!(
                "cannot claim {role} bdev {name} (claimed by another module?): {}",
                strerror(e)
            ),
        ));
    }
    if d.block_size() != BLOCK_SIZE {
        let bs = d.block_size();
        d.close();
        return Err((
            libc::EINVAL,
            format!("{role} bdev {name} has {bs}-byte blocks; only {BLOCK_SIZE}-byte blocks are supported"),
        ));
    }
    Ok(d)
}

/// Opens `name` (our `role` bdev) read-only without claiming it (the claim follows).
pub(super) fn open_unclaimed<E: BdevEvents>(name: &str, role: &str) -> Result<Desc, (i32, String)> {
    let d = Desc::open::<E>(name, OpenMode::ReadOnly).map_err(|e| {
        (
            e,
            format!("cannot open {role} bdev {name}: {}", strerror(e)),
        )
    })?;
    if d.block_size() != BLOCK_SIZE {
        d.close();
        return Err((
            libc::EINVAL,
            format!("{role} bdev {name}: only {BLOCK_SIZE}-byte blocks are supported"),
        ));
    }
    Ok(d)
}
