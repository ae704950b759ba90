//! On-disk structures: decode, encode, validate. Bytes in, typed values out; no I/O.

pub mod be;
pub mod bitmaps;
pub mod entries;
pub mod header;
pub mod header_sector;
pub mod measure;
pub mod refcount;
pub mod snapshot;

pub use entries::{
    ClusterMapping, CompressedDescriptor, CopiedFlag, L1Entry, L2Context, L2Entry, LinearSlice,
    SubclusterBitmap,
};
pub use header::{CompressionType, Extensions, Header, ImageHeader};
pub use header_sector::{HeaderPatch, HeaderSector};
pub use snapshot::Snapshot;

#[cfg(test)]
mod tests;
