//! The ring's configuration (its size, how far a stream may read ahead) and its counters.

use super::{CHUNK, MAX_WINDOW_CHUNKS};

/// The ring's size and how far a stream may read ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingConfig {
    /// Bytes of buffers (a multiple of [`CHUNK`], at least one chunk): the memory the ring
    /// takes per core.
    pub ring_bytes: u64,
    /// Most bytes one stream reads ahead of itself (a multiple of [`CHUNK`], at most
    /// [`MAX_WINDOW_CHUNKS`] chunks).
    pub max_window: u64,
}

impl Default for RingConfig {
    /// 5 MiB of buffers, 1 MiB of window: room for four streams at their largest window,
    /// each holding the chunk it reads, the window, and the chunk it is about to enter.
    fn default() -> Self {
        RingConfig {
            ring_bytes: 5 << 20,
            max_window: 1 << 20,
        }
    }
}

impl RingConfig {
    /// Checks the sizes; returns why they are refused.
    pub fn validate(&self) -> Result<(), &'static str> {
        if self.ring_bytes < CHUNK || !self.ring_bytes.is_multiple_of(CHUNK) {
            return Err("ring size must be a positive multiple of 128 KiB");
        }
        if self.ring_bytes / CHUNK > u16::MAX as u64 {
            return Err("ring size above 8 GiB");
        }
        if self.max_window < CHUNK || !self.max_window.is_multiple_of(CHUNK) {
            return Err("maximum window must be a positive multiple of 128 KiB");
        }
        if self.max_window / CHUNK > MAX_WINDOW_CHUNKS as u64 {
            return Err("maximum window above 8 MiB");
        }
        Ok(())
    }

    pub(crate) fn slots(&self) -> usize {
        (self.ring_bytes / CHUNK) as usize
    }

    pub(super) fn max_window_chunks(&self) -> u32 {
        (self.max_window / CHUNK) as u32
    }
}

/// Counters of one core's ring.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RingStats {
    /// Sequential streams detected (a stream counts once, when it starts reading ahead).
    pub streams: u64,
    /// Read-ahead I/Os issued (one per chunk; a chunk's base reads follow its mapping).
    pub readahead_ios: u64,
    /// Bytes read ahead into the ring (chunks whose read-ahead completed).
    pub bytes_read_ahead: u64,
    /// Bytes of guest reads served from the ring.
    pub bytes_served: u64,
    /// Guest reads served from the ring (those that waited included).
    pub reads_served: u64,
    /// Guest reads the ring served a first part of (not all, not none), the rest read
    /// from the base ([`Lookup::Partial`]) or waited for ([`Lookup::Wait`]).
    pub reads_partial: u64,
    /// Of those, the reads whose rest waited for read-aheads in flight (the others' rest
    /// was read from the base at once).
    pub partial_waited: u64,
    /// Guest reads that waited for a chunk's read-ahead in flight ([`Lookup::Wait`]).
    pub reads_waited: u64,
    /// Of those, the reads sent to the base when it completed: it failed, or a write
    /// made the chunk unusable while it filled.
    pub waited_to_base: u64,
    /// Bytes read ahead and dropped without serving any read.
    pub bytes_evicted_unread: u64,
    /// Chunks found written since they were read ahead (a write on any core).
    pub invalidated: u64,
    /// Read-aheads whose chunk held compressed clusters, issued without a task (their
    /// clusters decompressed into the ring as their reads ended).
    pub compressed_fills: u64,
    /// Read-aheads that ran as a task: a chunk whose mapping the cached metadata could
    /// not plan (a slice no record could load, compressed bytes no record could take).
    pub readahead_tasks: u64,
    /// Times a core's ring stopped reading ahead because its base proved synchronous: its
    /// reads were over as soon as their submission returned, so read-ahead hid no
    /// latency and cost a second copy ([`SyncProbe`](super::probe::SyncProbe); it looks
    /// again after [`RECHECK`](super::probe::RECHECK)).
    pub synchronous_base: u64,
}

impl RingStats {
    /// What was counted since `before` (an earlier reading of the same counters).
    pub fn since(&self, before: &RingStats) -> RingStats {
        RingStats {
            streams: self.streams - before.streams,
            readahead_ios: self.readahead_ios - before.readahead_ios,
            bytes_read_ahead: self.bytes_read_ahead - before.bytes_read_ahead,
            bytes_served: self.bytes_served - before.bytes_served,
            reads_served: self.reads_served - before.reads_served,
            reads_partial: self.reads_partial - before.reads_partial,
            partial_waited: self.partial_waited - before.partial_waited,
            reads_waited: self.reads_waited - before.reads_waited,
            waited_to_base: self.waited_to_base - before.waited_to_base,
            bytes_evicted_unread: self.bytes_evicted_unread - before.bytes_evicted_unread,
            invalidated: self.invalidated - before.invalidated,
            compressed_fills: self.compressed_fills - before.compressed_fills,
            readahead_tasks: self.readahead_tasks - before.readahead_tasks,
            synchronous_base: self.synchronous_base - before.synchronous_base,
        }
    }

    /// The counters of two cores together.
    pub fn add(&mut self, o: &RingStats) {
        self.streams += o.streams;
        self.readahead_ios += o.readahead_ios;
        self.bytes_read_ahead += o.bytes_read_ahead;
        self.bytes_served += o.bytes_served;
        self.reads_served += o.reads_served;
        self.reads_partial += o.reads_partial;
        self.partial_waited += o.partial_waited;
        self.reads_waited += o.reads_waited;
        self.waited_to_base += o.waited_to_base;
        self.bytes_evicted_unread += o.bytes_evicted_unread;
        self.invalidated += o.invalidated;
        self.compressed_fills += o.compressed_fills;
        self.readahead_tasks += o.readahead_tasks;
        self.synchronous_base += o.synchronous_base;
    }
}
