//! The owner's record of the image's persistent bitmaps while it is open for writing: the
//! directory as on disk, and for each bitmap it loaded, where its table and data were
//! (`image::owner::bitmaps` loads and stores them).
//!
//! Invariant: `dir` is the directory as last written; every bitmap it loaded has its
//! `in_use` flag set there until the owner stored it.

use crate::dirty_bitmaps::DirtyBitmaps;
use crate::format::bitmaps::BitmapEntry;
use std::sync::Arc;

/// A bitmap the owner loaded.
pub(crate) struct Loaded {
    /// Its entry in [`KeptBitmaps::entries`].
    pub(crate) entry: usize,
    /// The host clusters its data was in when loaded (or last stored).
    pub(crate) data_clusters: Vec<u64>,
}

/// The image's persistent bitmaps (see the module doc).
pub(crate) struct KeptBitmaps {
    /// Host offset of the directory.
    pub(crate) dir_offset: u64,
    /// The directory's bytes, whole sectors.
    pub(crate) dir: Vec<u8>,
    /// Its entries (positions, tables and flags as in `dir`).
    pub(crate) entries: Vec<BitmapEntry>,
    /// The bitmaps loaded, in the order of `bits`.
    pub(crate) loaded: Vec<Loaded>,
    /// Their bits, shared with every core.
    pub(crate) bits: Arc<DirtyBitmaps>,
}

impl KeptBitmaps {
    /// The names of the loaded bitmaps that record guest writes.
    pub(crate) fn enabled_names(&self) -> Vec<String> {
        self.loaded
            .iter()
            .filter(|l| self.entries[l.entry].auto())
            .map(|l| self.entries[l.entry].name.clone())
            .collect()
    }
}
