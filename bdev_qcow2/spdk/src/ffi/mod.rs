//! Safe(r) wrappers over SPDK, one file per concept. Every other module of the crate goes
//! through these; raw `spdk_sys` calls stay here. They depend on the bindings only: where
//! SPDK calls back into the module (requests, channels, nodes, the module's hooks), they
//! are generic over the traits the module implements for its marker type
//! ([`types::BdevTypes`] and the per-concept traits built on it), and the symbols
//! `register.c` registers are defined where the module invokes this layer's macros
//! (`bdev_module!`, `rpc_entry!`).

pub mod base;
pub mod bdev;
pub mod bdev_io;
mod channel_ref;
pub mod dma;
pub mod dma_mem;
pub mod granule;
pub mod io_channel;
pub mod iov;
pub mod json;
pub mod keyring;
pub mod log;
pub mod module;
pub mod node;
pub mod rpc;
mod rw;
pub mod sink;
pub mod thread;
pub mod types;
pub mod uuid;

pub use spdk_sys as sys;
