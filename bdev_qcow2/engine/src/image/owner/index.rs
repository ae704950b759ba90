//! The owner's index of the clusters of refcount blocks and active L2 tables, for the
//! overlap check (ARCHITECTURE.md §7 rule 6: no data write lands on metadata).
//!
//! Invariant: every cluster holding a refcount block or an active L2 table is in the index
//! from the moment it is allocated as such until its refcount drops to 0.

use super::HashSet;

/// The index (see the module doc).
#[derive(Default)]
pub(crate) struct MetadataIndex {
    clusters: HashSet<u64>,
    /// No indexed cluster lies above this one (it is not lowered on removal): a first
    /// write's run taken past every table, the common case, needs no look-up (#48).
    highest: u64,
}

impl MetadataIndex {
    /// Replaces the index by `clusters` (at open, from the refcount table and L1).
    pub(crate) fn reset(&mut self, clusters: HashSet<u64>) {
        self.highest = clusters.iter().copied().max().unwrap_or(0);
        self.clusters = clusters;
    }
    /// Host cluster `c` holds metadata now.
    pub(crate) fn insert(&mut self, c: u64) {
        self.highest = self.highest.max(c);
        self.clusters.insert(c);
    }
    /// Host cluster `c` is free now.
    pub(crate) fn remove(&mut self, c: u64) {
        self.clusters.remove(&c);
    }
    /// Whether host cluster `c` holds metadata.
    #[inline]
    pub(crate) fn contains(&self, c: u64) -> bool {
        c <= self.highest && self.clusters.contains(&c)
    }
    /// Whether any host cluster of `first..=last` holds metadata.
    #[inline]
    pub(crate) fn any_in(&self, first: u64, last: u64) -> bool {
        first <= self.highest && (first..=last.min(self.highest)).any(|c| self.contains(c))
    }
    /// Every indexed cluster.
    pub(crate) fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.clusters.iter().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::MetadataIndex;

    #[test]
    fn a_range_past_the_highest_cluster_needs_no_look_up_and_removal_keeps_the_bound() {
        let mut ix = MetadataIndex::default();
        assert!(!ix.contains(0) && !ix.any_in(0, u64::MAX));
        ix.insert(7);
        ix.insert(3);
        assert!(ix.contains(3) && ix.contains(7) && !ix.contains(5));
        assert!(ix.any_in(0, 3) && ix.any_in(4, 100) && !ix.any_in(4, 6) && !ix.any_in(8, 9));
        ix.remove(7);
        assert!(!ix.contains(7) && !ix.any_in(4, 100) && ix.any_in(3, 3));
        ix.reset([10, 2].into_iter().collect());
        assert!(ix.any_in(10, 10) && !ix.any_in(11, u64::MAX) && !ix.contains(3));
    }
}
