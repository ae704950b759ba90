//! The owner's index of the clusters of refcount blocks and active L2 tables, for the
//! overlap check (ARCHITECTURE.md §7 rule 6: no data write lands on metadata).
//!
//! Invariant: every cluster holding a refcount block or an active L2 table is in the index
//! from the moment it is allocated as such until its refcount drops to 0.

use super::HashSet;

/// The index (see the module doc).
#[derive(Default)]
pub(crate) struct MetadataIndex(HashSet<u64>);

impl MetadataIndex {
    /// Replaces the index by `clusters` (at open, from the refcount table and L1).
    pub(crate) fn reset(&mut self, clusters: HashSet<u64>) {
        self.0 = clusters;
    }
    /// Host cluster `c` holds metadata now.
    pub(crate) fn insert(&mut self, c: u64) {
        self.0.insert(c);
    }
    /// Host cluster `c` is free now.
    pub(crate) fn remove(&mut self, c: u64) {
        self.0.remove(&c);
    }
    /// Whether host cluster `c` holds metadata.
    #[inline]
    pub(crate) fn contains(&self, c: u64) -> bool {
        self.0.contains(&c)
    }
    /// Every indexed cluster.
    pub(crate) fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.0.iter().copied()
    }
}
