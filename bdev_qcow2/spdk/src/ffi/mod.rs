//! Safe(r) wrappers over SPDK, one file per concept. Every other module of the crate goes
//! through these; raw `spdk_sys` calls stay here.

pub mod base;
pub mod bdev;
pub mod bdev_io;
pub mod dma;
pub mod io_channel;
pub mod json;
pub mod log;
pub mod module;
pub mod node;
pub mod rpc;
pub mod thread;

pub use spdk_sys as sys;
