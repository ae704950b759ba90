//! `qcow2_engine`: a host-agnostic qcow2 engine.
//!
//! Pure Rust, no `unsafe`, no SPDK and no OS I/O: the host (the SPDK module or the
//! standalone io_uring host) supplies a polled [`io::BlockDevice`] and drives an
//! [`exec::Exec`] per core. See `DESIGN.md` for the architecture.
//!
//! - [`format`]: on-disk structures (decode, encode, validate);
//! - [`types`]: offsets and cluster geometry;
//! - [`cache`]: the set-associative slice cache;
//! - [`image`]: an open image (header, tables, caches);
//! - [`meta`]: the metadata owner's state; `image::owner`: its operations (allocation,
//!   ordered write-back), built on the image;
//! - [`chain`]: backing chains and the guest read path;
//! - [`exec`], [`io`]: the executor and device seams.
#![forbid(unsafe_code)]

pub mod cache;
pub mod chain;
pub mod check;
pub mod coherency;
pub mod compress;
pub mod compressed_write;
pub mod create;
pub mod error;
pub mod exec;
pub mod format;
#[cfg(any(test, feature = "testing"))]
pub mod fuzzing;
pub mod image;
pub mod io;
pub mod limits;
pub mod meta;
pub mod prefetch;
pub mod rng;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod types;
pub mod write;

pub use chain::{Chain, Direct, Layer, WriteRoute};
pub use error::{Error, Field, Result};
pub use exec::{DevId, Exec};
pub use image::{CoreSeed, CoreSlice, OpenOptions, OwnerLink, Qcow2};
