//! `qcow2_engine`: a host-agnostic qcow2 engine.
//!
//! Pure Rust, no `unsafe`, no SPDK and no OS I/O: the host (the SPDK module or the
//! standalone io_uring host) supplies a polled [`io::BlockDevice`] and drives an
//! [`exec::Exec`] per core. See `docs/ARCHITECTURE.md` for the architecture.
//!
//! - [`format`]: on-disk structures (decode, encode, validate);
//! - [`types`]: offsets and cluster geometry;
//! - [`cache`]: the set-associative slice cache;
//! - [`image`]: an open image (header, tables, caches);
//! - `image::owner`: the metadata owner, its state and operations (allocation, ordered
//!   write-back) one concern per module, built on the image; [`meta`] its public types;
//! - [`chain`]: backing chains and the guest read path;
//! - [`plan`]: the one decision per guest request ([`Chain::plan`]) and the steps a host
//!   takes ([`Step`], [`Chain::start`]);
//! - [`route`]: what routing a guest request decides (the direct grant, read and write
//!   routes);
//! - [`exec`], [`io`]: the executor and device seams.
#![forbid(unsafe_code)]

pub mod cache;
pub mod chain;
pub mod check;
pub mod coherency;
pub mod compress;
pub mod compressed_write;
pub mod create;
pub mod crypto;
mod direct;
mod dirty_bitmaps;
pub mod error;
pub mod exec;
pub mod format;
#[cfg(any(test, feature = "testing"))]
pub mod fuzzing;
pub mod golden;
pub mod image;
pub mod io;
mod lifecycle;
pub mod limits;
pub mod memo;
pub mod meta;
pub mod overlay;
pub mod plan;
pub mod prefetch;
mod readahead;
pub mod ring;
pub mod rng;
pub mod route;
mod slice_load;
pub mod stream;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod types;
pub mod write;

pub use chain::{Chain, Layer};
pub use error::{Error, Field, Result};
pub use exec::{DevId, Exec, GraceEntry};
pub use image::{
    BitmapBits, BitmapChange, CoreSeed, CoreSlice, OpenOptions, OwnerLink, Qcow2, ReadOnlySeed,
    SnapshotTime, SpaceUsage,
};
pub use plan::{FastWrite, Op, Request, RequestStats, Step, Task};
pub use route::{Grant, GuestRange, ReadRoute, Role, WriteRoute};
pub use write::{Reserved, Ticket};
