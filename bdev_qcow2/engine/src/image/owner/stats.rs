//! The owner's counters, reported by [`Qcow2::owner_stats`](crate::Qcow2::owner_stats).
//! They only count: nothing reads them to decide anything but the background write-back's
//! change signature (clusters allocated).

/// Counters of the metadata owner (writable image).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct OwnerStats {
    /// Host clusters allocated (data, L2 tables, refcount blocks).
    pub clusters_allocated: u64,
    /// Writes that change metadata (allocating ones, extended-L2 bitmaps, zero flags)
    /// planned on the spot, without a planning task (their metadata was in memory and the
    /// metadata lock free).
    pub writes_planned_now: u64,
    /// Of those, first writes of core replicas whose data the core wrote itself
    /// ([`Chain::reserve_write`](crate::Chain::reserve_write)).
    pub first_writes_by_cores: u64,
    /// Clusters first writes took with their group and left unwritten, reading zeros
    /// (`OpenOptions::alloc_granule`).
    pub clusters_taken_ahead: u64,
    /// L2 slices written back to the device.
    pub l2_slices_written: u64,
    /// Metadata write-back passes (refcounts, flush, L2 slices, L1; on FLUSH, on close
    /// and when the dirty metadata passes its threshold).
    pub writebacks: u64,
    /// Of those, write-backs at the dirty bound that released the metadata lock while
    /// their L2 slices were written.
    pub writebacks_at_bound: u64,
    /// Clusters allocated while such a write-back wrote its slices (allocating writes that
    /// did not wait for it).
    pub clusters_allocated_during_writeback: u64,
    /// Times the zeroed tail was raised: on disk ([`ZeroedTail`](crate::format::header::ZeroedTail)),
    /// or by zeroing the device ahead of the allocator (`OpenOptions::zero_ahead`).
    pub zeroed_tail_raises: u64,
    /// Bytes of the device zeroed ahead of the allocator (`OpenOptions::zero_ahead`).
    pub zeroed_ahead_bytes: u64,
    /// Runs of freed clusters discarded on the device (`OpenOptions::pass_discard_*`).
    pub discards: u64,
    /// Discards the device failed (the space stays; nothing is lost).
    pub discards_failed: u64,
    /// Bytes of freed clusters handed to the device's discard.
    pub bytes_discarded: u64,
    /// Clusters freed without a discard because the queue of discards was full.
    pub discards_skipped: u64,
}
