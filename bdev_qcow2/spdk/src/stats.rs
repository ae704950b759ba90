//! The counters of a bdev's channels (`bdev_qcow2_get_stats`), kept apart from the
//! channels so that the node can keep those of its channels already gone.

use qcow2_engine::ring::RingStats;
use serde::Serialize;

/// Counters of one channel (`bdev_qcow2_get_stats`).
#[derive(Debug, Default, Clone, Serialize)]
pub struct ChannelStats {
    /// The SPDK thread of the channel.
    pub thread: String,
    /// L2 slice cache lookups that hit.
    pub l2_cache_hits: u64,
    /// ... that missed.
    pub l2_cache_misses: u64,
    /// Valid slices replaced.
    pub l2_cache_evictions: u64,
    /// Reads served on the fast path (cached metadata, one base I/O per contiguous run).
    pub fast_reads: u64,
    /// Reads that needed a slow path (slice miss, compressed, backing).
    pub slow_reads: u64,
    /// Guest requests run as engine tasks (slow paths, write zeroes/unmap/flush, direct
    /// grants the base refused as busy). A warm read of an encrypted image is not one: its
    /// grant on the decrypting view is one device operation of the executor.
    pub engine_tasks: u64,
    /// Guest requests completed (every type).
    pub completed: u64,
    /// ... completed with an error.
    pub errors: u64,
    /// ... of them because the image needed room the base does not have (NVMe Capacity
    /// Exceeded; they succeed again once the base grows).
    pub no_space_errors: u64,
    /// Base submissions refused as busy (-ENOMEM) and retried.
    pub busy_retries: u64,
    /// Writes served in place on this thread (writable bdevs).
    pub local_writes: u64,
    /// Requests sent to the metadata owner (writable bdevs).
    pub forwarded: u64,
    /// Overwrites served in place through a copy of their L2 slice older than the owner's
    /// latest changes, which only added mappings (writable bdevs; part of `local_writes`
    /// when served).
    pub kept_overwrites: u64,
    /// Read-ahead: sequential streams detected.
    pub prefetch_streams: u64,
    /// Read-ahead: slice loads started ahead of a stream.
    pub prefetch_issued: u64,
    /// Read-ahead: ... that put a slice into the cache.
    pub prefetch_loaded: u64,
    /// Read-ahead: slices loaded ahead that their stream then reached.
    pub prefetch_hits: u64,
    /// Prefetch ring: sequential streams that read ahead.
    pub ring_streams: u64,
    /// Prefetch ring: read-ahead I/Os issued (one per 128 KiB chunk).
    pub ring_readahead_ios: u64,
    /// Prefetch ring: bytes read ahead.
    pub ring_bytes_read_ahead: u64,
    /// Prefetch ring: bytes of reads served from the ring.
    pub ring_bytes_served: u64,
    /// Prefetch ring: reads served from the ring.
    pub ring_reads_served: u64,
    /// Prefetch ring: reads it served a first part of (the rest read or waited for).
    pub ring_reads_partial: u64,
    /// Prefetch ring: of those, reads whose rest waited for read-aheads in flight (the
    /// others' rest was read from the base at once).
    pub ring_partial_waited: u64,
    /// Prefetch ring: reads that waited for a read-ahead in flight.
    pub ring_reads_waited: u64,
    /// Prefetch ring: of those, reads sent to the base (the read-ahead failed, or a write
    /// made its chunk unusable while it filled).
    pub ring_waited_to_base: u64,
    /// Prefetch ring: bytes read ahead and dropped unread.
    pub ring_bytes_evicted_unread: u64,
    /// Prefetch ring: chunks a write (on any thread) made unusable.
    pub ring_invalidated: u64,
    /// Prefetch ring: read-aheads of chunks holding compressed clusters, without a task.
    pub ring_compressed_fills: u64,
    /// Prefetch ring: read-aheads that ran as a task.
    pub ring_readahead_tasks: u64,
    /// Prefetch ring: times a ring stopped reading ahead because its base proved
    /// synchronous (reads over as their submission returned: read-ahead only added a copy;
    /// a stopped ring looks again after 10 s).
    pub ring_synchronous_base: u64,
}

impl ChannelStats {
    /// Adds `o` into `self` (for totals).
    pub fn add(&mut self, o: &ChannelStats) {
        self.l2_cache_hits += o.l2_cache_hits;
        self.l2_cache_misses += o.l2_cache_misses;
        self.l2_cache_evictions += o.l2_cache_evictions;
        self.fast_reads += o.fast_reads;
        self.slow_reads += o.slow_reads;
        self.engine_tasks += o.engine_tasks;
        self.completed += o.completed;
        self.errors += o.errors;
        self.no_space_errors += o.no_space_errors;
        self.busy_retries += o.busy_retries;
        self.local_writes += o.local_writes;
        self.forwarded += o.forwarded;
        self.kept_overwrites += o.kept_overwrites;
        self.prefetch_streams += o.prefetch_streams;
        self.prefetch_issued += o.prefetch_issued;
        self.prefetch_loaded += o.prefetch_loaded;
        self.prefetch_hits += o.prefetch_hits;
        self.add_ring(&o.ring_stats());
    }

    /// The prefetch ring counters as the engine counts them.
    pub fn ring_stats(&self) -> RingStats {
        RingStats {
            streams: self.ring_streams,
            readahead_ios: self.ring_readahead_ios,
            bytes_read_ahead: self.ring_bytes_read_ahead,
            bytes_served: self.ring_bytes_served,
            reads_served: self.ring_reads_served,
            reads_partial: self.ring_reads_partial,
            partial_waited: self.ring_partial_waited,
            reads_waited: self.ring_reads_waited,
            waited_to_base: self.ring_waited_to_base,
            bytes_evicted_unread: self.ring_bytes_evicted_unread,
            invalidated: self.ring_invalidated,
            compressed_fills: self.ring_compressed_fills,
            readahead_tasks: self.ring_readahead_tasks,
            synchronous_base: self.ring_synchronous_base,
        }
    }

    /// Adds an engine's prefetch ring counters.
    pub fn add_ring(&mut self, r: &RingStats) {
        self.ring_streams += r.streams;
        self.ring_readahead_ios += r.readahead_ios;
        self.ring_bytes_read_ahead += r.bytes_read_ahead;
        self.ring_bytes_served += r.bytes_served;
        self.ring_reads_served += r.reads_served;
        self.ring_reads_partial += r.reads_partial;
        self.ring_partial_waited += r.partial_waited;
        self.ring_reads_waited += r.reads_waited;
        self.ring_waited_to_base += r.waited_to_base;
        self.ring_bytes_evicted_unread += r.bytes_evicted_unread;
        self.ring_invalidated += r.invalidated;
        self.ring_compressed_fills += r.compressed_fills;
        self.ring_readahead_tasks += r.readahead_tasks;
        self.ring_synchronous_base += r.synchronous_base;
    }
}
