//! The owner's copies of the image's first sector: the one it changes and the one last
//! written, and whether the dirty bit it set is on disk.
//!
//! Invariant: every header change goes through the copy here, by the format's setters
//! ([`HeaderSector`]), and reaches the device only as a whole sector; `on_disk` is always
//! what the last write put there, so a write of it alone (raising the zeroed tail) changes
//! nothing else.

use crate::format::header::ZeroedTail;
use crate::format::HeaderSector;

/// The header writer's state (see the module doc).
pub(crate) struct HeaderCopies {
    /// The first sector as the owner wants it on disk.
    sector0: HeaderSector,
    /// Whether `sector0` must be written.
    dirty: bool,
    /// `sector0` as last written.
    on_disk: HeaderSector,
    /// Whether the owner set the dirty bit on disk (lazy refcounts) and must clear it.
    dirty_bit_on_disk: bool,
}

impl HeaderCopies {
    /// The copies at open, from cluster 0 `c0` as read.
    pub(crate) fn new(c0: &[u8]) -> Self {
        let sector0 = HeaderSector::from_cluster0(c0);
        HeaderCopies {
            on_disk: sector0.clone(),
            sector0,
            dirty: false,
            dirty_bit_on_disk: false,
        }
    }

    /// Whether the header copy must be written.
    pub(crate) fn is_dirty(&self) -> bool {
        self.dirty
    }
    /// The sector to write now: it is the one on disk once written.
    pub(crate) fn take_for_write(&mut self) -> Vec<u8> {
        self.dirty = false;
        self.on_disk = self.sector0.clone();
        self.sector0.bytes().to_vec()
    }

    /// The corrupt bit set (version 3: a version 2 header has no feature bits); returns
    /// the sector to write at once.
    pub(crate) fn mark_corrupt(&mut self) -> Vec<u8> {
        self.sector0.set_corrupt();
        self.on_disk = self.sector0.clone();
        self.sector0.bytes().to_vec()
    }

    /// Whether the dirty bit the owner set is on disk.
    pub(crate) fn dirty_bit_on_disk(&self) -> bool {
        self.dirty_bit_on_disk
    }
    /// Sets the dirty bit in the copy, to be written and flushed before metadata that
    /// relies on it ([`dirty_bit_written`](Self::dirty_bit_written) then).
    pub(crate) fn set_dirty_bit(&mut self) {
        self.sector0.set_dirty(true);
    }
    /// The dirty bit is stable on disk.
    pub(crate) fn dirty_bit_written(&mut self) {
        self.dirty_bit_on_disk = true;
    }
    /// Every refcount is stable: the dirty bit goes (the header is dirty).
    pub(crate) fn clear_dirty_bit(&mut self) {
        self.sector0.set_dirty(false);
        self.dirty = true;
        self.dirty_bit_on_disk = false;
    }

    /// The refcount table moved to `offset`, `clusters` long (the header is dirty).
    pub(crate) fn set_refcount_table(&mut self, offset: u64, clusters: u32) {
        self.sector0.set_refcount_table(offset, clusters);
        self.dirty = true;
    }

    /// The L1 table moved to `offset`, `size` entries long (the header is dirty).
    pub(crate) fn set_l1_table(&mut self, offset: u64, size: u32) {
        self.sector0.set_l1_table(offset, size);
        self.dirty = true;
    }

    /// The virtual disk size is `bytes` (the header is dirty).
    pub(crate) fn set_size(&mut self, bytes: u64) {
        self.sector0.set_size(bytes);
        self.dirty = true;
    }

    /// The snapshot table moved to `offset` and holds `count` snapshots (the header is
    /// dirty).
    pub(crate) fn set_snapshot_table(&mut self, offset: u64, count: u32) {
        self.sector0.set_snapshot_table(offset, count);
        self.dirty = true;
    }

    /// The backing file reference dropped (see [`HeaderSector::clear_backing`]; `rest` is
    /// cluster 0 past the first sector as on disk); returns whether the backing format
    /// extension went too. The header is dirty.
    pub(crate) fn clear_backing(&mut self, rest: &[u8]) -> bool {
        self.dirty = true;
        self.sector0.clear_backing(rest)
    }

    /// The zeroed tail raised to `tail`: in the copy and in the one on disk, which is
    /// returned to be written alone.
    pub(crate) fn raise_zeroed_tail(&mut self, tail: ZeroedTail) -> Vec<u8> {
        self.sector0.set_zeroed_tail(tail);
        self.on_disk.set_zeroed_tail(tail);
        self.on_disk.bytes().to_vec()
    }
    /// The zeroed tail lowered to `tail` (the header is dirty).
    pub(crate) fn lower_zeroed_tail(&mut self, tail: ZeroedTail) {
        self.sector0.set_zeroed_tail(tail);
        self.dirty = true;
    }
}
