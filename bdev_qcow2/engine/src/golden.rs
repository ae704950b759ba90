//! Golden images shared by many overlays: one read cache of the golden image's data for
//! every overlay on every core that reads it ([`SharedReadCache`]), and the device
//! wrapper through which each core's chain reads it ([`CachedDevice`]).
//!
//! The golden image is read-only wherever it is shared (hosts refuse a writable one), so a
//! cached granule is valid until its slot is replaced: no coherency beyond that.

mod cache;
mod device;
mod lent;
mod memory;

#[cfg(loom)]
pub use cache::Broken;
pub use cache::{CacheStats, Fill, Lookup, Pin, SharedReadCache, Sharer, DEFAULT_GRANULE, WAYS};
pub use device::{is_fill_tag, CachedDevice, InPlace};
pub use lent::LentGranule;
pub use memory::{AtomicWords, Exclusive, GranuleAlloc, GranuleMemory, Shared};
