//! `libbdev_qcow2.so`: an SPDK bdev module serving qcow2 images stored on other bdevs.
//!
//! Load it into an unmodified SPDK application with `LD_PRELOAD`; it registers the bdev
//! module `qcow2` and the RPCs `bdev_qcow2_create`, `bdev_qcow2_format`, `bdev_qcow2_delete`
//! and `bdev_qcow2_get_stats`. Threading follows `DESIGN.md`: the thread that creates a bdev
//! reads and validates its image (the metadata owner); every SPDK thread that opens a
//! channel gets its own engine executor, replica of the image and base channels, driven by
//! a per-channel poller; the data path takes no lock and allocates nothing on a cache hit.
//!
//! Everything SPDK-specific is compiled only when `spdk-sys` found an installed SPDK
//! (`cfg(spdk)`); otherwise the library is empty and the workspace still builds.

#![cfg_attr(not(spdk), allow(dead_code, unused_imports))]

pub mod params;

#[cfg(spdk)]
mod channel;
#[cfg(spdk)]
pub mod device;
#[cfg(spdk)]
mod direct;
#[cfg(spdk)]
mod engine_host;
#[cfg(spdk)]
pub mod ffi;
#[cfg(spdk)]
mod format;
#[cfg(spdk)]
mod io_ctx;
#[cfg(spdk)]
mod logging;
#[cfg(spdk)]
pub mod module;
#[cfg(spdk)]
mod node;
#[cfg(spdk)]
mod owner;
#[cfg(spdk)]
mod registry;
#[cfg(spdk)]
pub mod rpc;
