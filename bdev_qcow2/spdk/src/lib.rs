//! `libbdev_qcow2.so`: an SPDK bdev module serving qcow2 images stored on other bdevs.
//!
//! Load it into an unmodified SPDK application with `LD_PRELOAD`; it registers the bdev
//! module `qcow2` and the RPCs `bdev_qcow2_create`, `bdev_qcow2_format`, `bdev_qcow2_delete`,
//! `bdev_qcow2_get_stats`, `bdev_qcow2_resize`, `bdev_qcow2_snapshot_create`,
//! `bdev_qcow2_snapshot_delete`, `bdev_qcow2_snapshot_list`, `bdev_qcow2_snapshot_external`,
//! `bdev_qcow2_overlay_create` and `bdev_qcow2_stream`. Threading follows `ARCHITECTURE.md`: the thread that creates a bdev
//! reads and validates its image (the metadata owner); every SPDK thread that opens a
//! channel gets its own engine executor, replica of the image and base channels, driven by
//! a per-channel poller; the data path takes no lock and allocates nothing on a cache hit.
//!
//! The crate compiles on every machine: `spdk-sys` supplies bindings generated from the
//! installed SPDK, or its committed copy where there is none, so all of this code is
//! type-checked and linted either way. Only with SPDK (`cfg(spdk)`) is the registration shim
//! (`src/ffi/register.c`) compiled and are SPDK's libraries linked; without it
//! `libbdev_qcow2.so` registers nothing and its calls into SPDK stay undefined symbols.
//!
//! `unsafe` lives in `ffi` alone (ARCHITECTURE.md, "Unsafe code").

#![deny(unsafe_code)]

pub mod params;

mod backing_slot;
pub mod backing_state;
mod channel;
pub mod device;
mod direct;
mod engine_host;
mod examine_channel;
mod examine_hold;
mod external_snapshot;
#[allow(unsafe_code)]
pub mod ffi;
mod format;
mod golden;
mod io_ctx;
mod lifecycle_busy;
mod lifecycle_rpc;
mod logging;
pub mod module;
mod node;
mod offthread;
mod overlay;
mod owner;
mod registry;
mod reservation;
pub mod rpc;
mod stats;
mod status;
mod stream_rpc;
mod types;
