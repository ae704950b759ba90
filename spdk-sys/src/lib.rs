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
