//! The owner's bookkeeping of dirty slices per epoch slot, moving the slots' epochs in
//! [`Shared`] as slices become dirty, change and become clean.

use super::{Shared, SliceChange};

/// The owner's bookkeeping of dirty slices per slot (not shared: only the owner runs it).
#[derive(Debug, Default)]
pub struct OwnerEpochs {
    counts: std::collections::HashMap<usize, u32>,
}

impl OwnerEpochs {
    /// A slice of `key` became dirty (or another copy of it is being written back), its
    /// content changed as `change` says ([`SliceChange::Adds`] when it did not change).
    pub fn dirtied(&mut self, shared: &Shared, key: u64, change: SliceChange) {
        let slot = shared.slot(key);
        let n = self.counts.entry(slot).or_insert(0);
        if *n == 0 {
            shared.owner_open(slot, change);
        } else {
            shared.owner_changed(slot, change);
        }
        *n += 1;
    }

    /// A dirty slice of `key` changed as `change` says.
    pub fn changed(&mut self, shared: &Shared, key: u64, change: SliceChange) {
        let slot = shared.slot(key);
        debug_assert!(self.counts.get(&slot).copied().unwrap_or(0) > 0);
        shared.owner_changed(slot, change);
    }

    /// One dirty instance of `key` is gone (written back, or merged away).
    pub fn cleaned(&mut self, shared: &Shared, key: u64) {
        let slot = shared.slot(key);
        let Some(n) = self.counts.get_mut(&slot) else {
            debug_assert!(false, "cleaned a slice that was not dirty");
            return;
        };
        *n -= 1;
        if *n == 0 {
            self.counts.remove(&slot);
            shared.owner_close(slot);
        }
    }

    /// Number of slots currently odd.
    pub fn open_slots(&self) -> usize {
        self.counts.len()
    }
}
