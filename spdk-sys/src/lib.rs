//! Raw bindings to SPDK: its public headers only, through a narrow allowlist (see `build.rs`),
//! plus `spdk_sys_*` symbols for the static inline functions Rust cannot call directly
//! (`shim.c`).
//!
//! The bindings always exist: generated from the installed SPDK when `build.rs` finds one
//! (`cfg(spdk)`, and then SPDK's libraries and the shim are linked), else the committed
//! `src/bindings.rs`, so that the crates above compile and are linted on any machine. Without
//! SPDK nothing is linked: whatever calls these functions builds, but only a shared library
//! loaded into an SPDK application (or an executable that keeps no such call) links.

#[allow(
    non_upper_case_globals,
    non_camel_case_types,
    non_snake_case,
    dead_code,
    missing_docs,
    unsafe_op_in_unsafe_fn,
    unnecessary_transmutes,
    improper_ctypes,
    clippy::all,
    clippy::pedantic,
    clippy::undocumented_unsafe_blocks
)]
mod bindings {
    // `build.rs` points this at the freshly generated file or at the committed copy.
    include!(env!("SPDK_SYS_BINDINGS"));
}

pub use bindings::*;

/// Whether this build found SPDK (and so links its libraries and the shim).
pub const FOUND: bool = cfg!(spdk);

/// `spdk_io_channel_get_ctx`: a static inline in SPDK's header, so computed here from the
/// channel struct's size the header states (`SPDK_IO_CHANNEL_STRUCT_SIZE`), or through the
/// shim where an older header does not state it.
///
/// # Safety
/// `ch` must be a live I/O channel.
#[inline]
pub unsafe fn io_channel_get_ctx(ch: *mut spdk_io_channel) -> *mut std::ffi::c_void {
    #[cfg(spdk_channel_size)]
    // SAFETY: the context area follows the channel struct (per the contract, `ch` is live).
    return unsafe {
        ch.cast::<u8>()
            .add(SPDK_IO_CHANNEL_STRUCT_SIZE as usize)
            .cast()
    };
    #[cfg(not(spdk_channel_size))]
    // SAFETY: per the contract.
    unsafe {
        spdk_sys_io_channel_get_ctx(ch)
    }
}
