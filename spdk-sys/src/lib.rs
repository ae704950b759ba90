//! Raw bindings to an installed SPDK: its public headers only, through a narrow allowlist
//! (see `build.rs`), plus `spdk_sys_*` symbols for the static inline functions Rust cannot
//! call directly (`shim.c`).
//!
//! Built only when `build.rs` finds SPDK (`cfg(spdk)`); otherwise the crate is empty so the
//! workspace builds on machines without SPDK.

#[cfg(spdk)]
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
    include!(concat!(env!("OUT_DIR"), "/bindings.rs"));
}

#[cfg(spdk)]
pub use bindings::*;

/// Whether this build found SPDK (and so exports bindings).
pub const FOUND: bool = cfg!(spdk);

/// `spdk_io_channel_get_ctx`: a static inline in SPDK's header, so computed here from the
/// channel struct's size the header states (`SPDK_IO_CHANNEL_STRUCT_SIZE`), or through the
/// shim where an older header does not state it.
///
/// # Safety
/// `ch` must be a live I/O channel.
#[cfg(spdk)]
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
