//! The owner's dirty metadata: L2 slices, refcount blocks, L1 and refcount-table entries
//! changed in memory and not yet written back.
//!
//! Invariant: a dirty copy is authoritative (newer than the device and than any cache
//! replica) until its write completes; a slice taken by a write-back stays readable here
//! (`writing`) until then, and every slice that becomes dirty or clean on a shared image
//! moves its epoch ([`OwnerEpochs`]) in the same call.

use super::{HashMap, Shared};
use crate::coherency::{OwnerEpochs, SliceChange};
use std::collections::{BTreeMap, BTreeSet};

/// Dirty metadata of the owner (see the module doc).
#[derive(Default)]
pub(crate) struct DirtyMetadata {
    /// Dirty L2 slices by slice id. A hash map: every allocating write looks its slice up;
    /// the write-back sorts the ids.
    l2: HashMap<u64, Vec<u64>>,
    /// Slices taken by the write-back in progress, until their write completes.
    writing_l2: HashMap<u64, Vec<u64>>,
    /// Dirty-slice counts per epoch slot (when the image is shared with other cores).
    epochs: OwnerEpochs,
    /// Dirty refcount blocks by host offset.
    rc: BTreeMap<u64, Vec<u8>>,
    /// L1 indices changed since the last write-back.
    l1: BTreeSet<u64>,
    /// L1 indices a write-back at the bound took with its slices (window.rs), until it
    /// writes them or another write-back takes them first.
    l1_window: BTreeSet<u64>,
    /// Refcount-table indices changed since the last write-back.
    rt: BTreeSet<u64>,
}

impl DirtyMetadata {
    // ----- L2 slices ----------------------------------------------------------------

    /// The dirty copy of slice `key` (not one being written back).
    #[inline]
    pub(crate) fn slice(&self, key: u64) -> Option<&Vec<u64>> {
        self.l2.get(&key)
    }
    /// Whether slice `key` is dirty.
    #[inline]
    pub(crate) fn has_slice(&self, key: u64) -> bool {
        self.l2.contains_key(&key)
    }
    /// Whether slice `key` is being written back.
    pub(crate) fn is_writing(&self, key: u64) -> bool {
        self.writing_l2.contains_key(&key)
    }
    /// A copy of slice `key`, dirty or being written back.
    pub(crate) fn slice_copy(&self, key: u64) -> Option<Vec<u64>> {
        self.l2
            .get(&key)
            .or_else(|| self.writing_l2.get(&key))
            .cloned()
    }
    /// Makes slice `key` dirty with `words` (replacing a dirty copy), which changed its
    /// content as `change` says: its epoch goes odd when it was clean, moves on when it was
    /// dirty already.
    pub(crate) fn put_slice(
        &mut self,
        key: u64,
        words: Vec<u64>,
        shared: Option<&Shared>,
        change: SliceChange,
    ) {
        let was_clean = self.l2.insert(key, words).is_none();
        if let Some(sh) = shared {
            if was_clean {
                self.epochs.dirtied(sh, key, change);
            } else {
                self.epochs.changed(sh, key, change);
            }
        }
    }
    /// Changes the dirty slice `key` with `f`, which says how (its epoch moves on, and its
    /// count of removals when `f` removed something); false when it is not dirty (nothing
    /// changed).
    pub(crate) fn change_slice(
        &mut self,
        key: u64,
        shared: Option<&Shared>,
        f: impl FnOnce(&mut [u64]) -> SliceChange,
    ) -> bool {
        let Some(b) = self.l2.get_mut(&key) else {
            return false;
        };
        let change = f(b);
        if let Some(sh) = shared {
            self.epochs.changed(sh, key, change);
        }
        true
    }
    /// Dirty L2 slices.
    pub(crate) fn slices(&self) -> usize {
        self.l2.len()
    }
    /// Whether any L2 slice or L1 entry is dirty.
    pub(crate) fn has_l2_or_l1(&self) -> bool {
        !self.l2.is_empty() || !self.l1.is_empty() || !self.l1_window.is_empty()
    }
    /// Whether a write-back's slices are being written (only a write-back at the bound
    /// writes without the metadata lock).
    pub(crate) fn writing_any(&self) -> bool {
        !self.writing_l2.is_empty()
    }
    /// On [`share`](crate::Qcow2::share): every slice held here (dirty or being written)
    /// goes odd in the new shared state.
    pub(crate) fn publish_to(&mut self, shared: &Shared) {
        let keys: Vec<u64> = self
            .l2
            .keys()
            .chain(self.writing_l2.keys())
            .copied()
            .collect();
        for k in keys {
            // No core has a copy yet.
            self.epochs.dirtied(shared, k, SliceChange::Adds);
        }
    }

    /// Write-back, phase 2 begins: the dirty slices move to the writing set (still served
    /// from there). Returns their ids in device order.
    pub(crate) fn begin_slice_writeback(&mut self) -> Vec<u64> {
        let taken = std::mem::take(&mut self.l2);
        let mut keys: Vec<u64> = taken.keys().copied().collect();
        // Slices of one table next to each other.
        keys.sort_unstable();
        self.writing_l2 = taken;
        keys
    }
    /// The words of slice `key` being written back.
    pub(crate) fn writing(&self, key: u64) -> Option<&Vec<u64>> {
        self.writing_l2.get(&key)
    }
    /// Slice `key`'s write completed: it is clean (epoch even) unless dirtied again
    /// meanwhile. Returns the words written.
    pub(crate) fn slice_written(&mut self, key: u64, shared: Option<&Shared>) -> Option<Vec<u64>> {
        let written = self.writing_l2.remove(&key);
        if let Some(sh) = shared {
            self.epochs.cleaned(sh, key);
        }
        written
    }
    /// A write-back failed: slices `keys` not written go back to dirty; a newer dirty copy
    /// (changed meanwhile) wins.
    pub(crate) fn slices_not_written(
        &mut self,
        keys: impl Iterator<Item = u64>,
        shared: Option<&Shared>,
    ) {
        for k in keys {
            if let Some(w) = self.writing_l2.remove(&k) {
                match self.l2.entry(k) {
                    std::collections::hash_map::Entry::Occupied(_) => {
                        if let Some(sh) = shared {
                            self.epochs.cleaned(sh, k);
                        }
                    }
                    std::collections::hash_map::Entry::Vacant(v) => {
                        v.insert(w);
                    }
                }
            }
        }
    }

    /// A shadow commit is about to publish L1 entries naming other L2 tables for slices
    /// `keys` (the same entries, COPIED flags changed): their epochs go odd (or move on),
    /// as for a slice that becomes dirty, so that no core keeps a replica of the old table;
    /// a removal too (COPIED changes and the table moves), so that no core keeps
    /// overwriting through an older copy either (§6).
    /// [`tables_moved`](Self::tables_moved) follows once the entries are published.
    pub(crate) fn tables_moving(&mut self, keys: &[u64], shared: &Shared) {
        for &k in keys {
            self.epochs.dirtied(shared, k, SliceChange::Removes);
        }
    }
    /// The new L1 entries of slices `keys` are published: their epochs become even again
    /// unless other slices of a slot are dirty (two steps past the value before
    /// [`tables_moving`](Self::tables_moving)).
    pub(crate) fn tables_moved(&mut self, keys: &[u64], shared: &Shared) {
        for &k in keys {
            self.epochs.cleaned(shared, k);
        }
    }

    // ----- refcount blocks ----------------------------------------------------------

    /// Whether refcount block `block` is dirty.
    #[inline]
    pub(crate) fn has_rc(&self, block: u64) -> bool {
        self.rc.contains_key(&block)
    }
    /// The dirty copy of refcount block `block`.
    #[inline]
    pub(crate) fn rc(&self, block: u64) -> Option<&Vec<u8>> {
        self.rc.get(&block)
    }
    /// The dirty copy of refcount block `block`, to change.
    #[inline]
    pub(crate) fn rc_mut(&mut self, block: u64) -> Option<&mut Vec<u8>> {
        self.rc.get_mut(&block)
    }
    /// The dirty copy of refcount block `block`, made dirty from `load` (its clean bytes)
    /// when it is not.
    pub(crate) fn rc_or_load<E>(
        &mut self,
        block: u64,
        load: impl FnOnce() -> Result<Vec<u8>, E>,
    ) -> Result<&mut Vec<u8>, E> {
        Ok(match self.rc.entry(block) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(v) => v.insert(load()?),
        })
    }
    /// Makes refcount block `block` dirty with `bytes` (a new block).
    pub(crate) fn put_rc(&mut self, block: u64, bytes: Vec<u8>) {
        self.rc.insert(block, bytes);
    }
    /// Dirty refcount blocks.
    pub(crate) fn rc_blocks(&self) -> usize {
        self.rc.len()
    }
    /// Whether no refcount block is dirty.
    pub(crate) fn rc_is_empty(&self) -> bool {
        self.rc.is_empty()
    }
    /// Takes every dirty refcount block (by offset) for a write-back.
    pub(crate) fn take_rc(&mut self) -> Vec<(u64, Vec<u8>)> {
        std::mem::take(&mut self.rc).into_iter().collect()
    }
    /// Their write failed: the blocks are dirty again (a newer dirty copy wins).
    pub(crate) fn rc_not_written(&mut self, blocks: Vec<(u64, Vec<u8>)>) {
        for (o, b) in blocks {
            self.rc.entry(o).or_insert(b);
        }
    }

    // ----- L1 and refcount-table entries --------------------------------------------

    /// L1 entry `idx` changed.
    pub(crate) fn dirty_l1(&mut self, idx: u64) {
        self.l1.insert(idx);
    }
    /// Takes the changed L1 indices for a write-back (those a write-back at the bound
    /// took and has not written included).
    pub(crate) fn take_l1(&mut self) -> BTreeSet<u64> {
        let mut l1 = std::mem::take(&mut self.l1);
        l1.append(&mut self.l1_window);
        l1
    }
    /// A write-back at the bound takes the changed L1 indices with its slices; returns a
    /// copy of them.
    pub(crate) fn take_l1_window(&mut self) -> BTreeSet<u64> {
        let l1 = std::mem::take(&mut self.l1);
        self.l1_window.extend(l1.iter().copied());
        l1
    }
    /// The L1 indices the write-back at the bound took and no other write-back took since:
    /// it writes them now.
    pub(crate) fn end_l1_window(&mut self) -> BTreeSet<u64> {
        std::mem::take(&mut self.l1_window)
    }
    /// Their write failed: dirty again.
    pub(crate) fn l1_not_written(&mut self, l1: BTreeSet<u64>) {
        self.l1.extend(l1);
    }
    /// Refcount-table entry `idx` changed.
    pub(crate) fn dirty_rt(&mut self, idx: u64) {
        self.rt.insert(idx);
    }
    /// Whether a refcount-table entry is dirty.
    pub(crate) fn has_rt(&self) -> bool {
        !self.rt.is_empty()
    }
    /// Takes the changed refcount-table indices for a write-back.
    pub(crate) fn take_rt(&mut self) -> BTreeSet<u64> {
        std::mem::take(&mut self.rt)
    }
    /// Their write failed: dirty again.
    pub(crate) fn rt_not_written(&mut self, rt: BTreeSet<u64>) {
        self.rt.extend(rt);
    }
    /// A new refcount table was written whole: no entry of the old one is dirty.
    pub(crate) fn clear_rt(&mut self) {
        self.rt.clear();
    }
}
