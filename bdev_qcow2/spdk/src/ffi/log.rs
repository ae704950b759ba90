//! SPDK's log: levels, the module's log flag, and writing a line.

use super::sys;
use std::ffi::{c_int, CStr};

/// The log flag the module registers (`--logflag vbdev_qcow2` enables debug output).
pub const FLAG: &CStr = c"vbdev_qcow2";

/// Whether the module's log flag is on.
pub fn flag_enabled() -> bool {
    // SAFETY: `FLAG` is a valid C string; the flag is registered by our shim at load.
    unsafe { sys::spdk_log_get_flag(FLAG.as_ptr()) }
}

/// SPDK's current print level (messages above it are not shown).
pub fn print_level() -> sys::spdk_log_level {
    // SAFETY: no arguments.
    unsafe { sys::spdk_log_get_print_level() }
}

/// Writes one message to SPDK's log at `level`, attributed to `file:line` in `func`.
pub fn write(level: sys::spdk_log_level, file: &CStr, line: u32, func: &CStr, msg: &CStr) {
    // SAFETY: all strings are valid C strings; the format consumes exactly one `%s`.
    unsafe {
        sys::spdk_log(
            level,
            file.as_ptr(),
            c_int::try_from(line).unwrap_or(0),
            func.as_ptr(),
            c"%s\n".as_ptr(),
            msg.as_ptr(),
        )
    }
}
