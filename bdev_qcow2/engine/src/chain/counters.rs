//! A chain's request counters: plain cells, bumped by the plan and the paths it starts, on
//! the chain's one core; read by the hosts' statistics.

use std::cell::Cell;

/// Counters of the read path.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReadStats {
    /// Guest reads served entirely on the fast path (cached metadata, plain data/zeros).
    pub fast_reads: u64,
    /// Guest reads that needed a slow path (miss, compressed, backing).
    pub slow_reads: u64,
}

/// A chain's per-request counters ([`Counters::requests`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RequestStats {
    /// Writes a core replica served in place (direct, or after loading a slice).
    pub writes_here: u64,
    /// Requests this core sent to the metadata owner.
    pub to_owner: u64,
    /// Reads the prefetch ring served whole.
    pub ring_served: u64,
}

/// The counters of one chain ([`Chain::counters`](crate::Chain::counters)).
#[derive(Debug, Default)]
pub struct Counters {
    fast_reads: Cell<u64>,
    slow_reads: Cell<u64>,
    /// Overwrites a core replica routed in place through a copy of their slice older than
    /// the slot's epoch (see [`Chain::kept_overwrites`](crate::Chain::kept_overwrites)).
    kept_overwrites: Cell<u64>,
    writes_here: Cell<u64>,
    to_owner: Cell<u64>,
    ring_served: Cell<u64>,
}

#[inline(always)]
fn bump(c: &Cell<u64>) {
    c.set(c.get() + 1);
}

impl Counters {
    /// Read-path counters.
    pub fn reads(&self) -> ReadStats {
        ReadStats {
            fast_reads: self.fast_reads.get(),
            slow_reads: self.slow_reads.get(),
        }
    }

    /// Per-request counters of the plan.
    pub fn requests(&self) -> RequestStats {
        RequestStats {
            writes_here: self.writes_here.get(),
            to_owner: self.to_owner.get(),
            ring_served: self.ring_served.get(),
        }
    }

    /// Overwrites kept on this core by the chain's own route (the memo's are the image's).
    pub(crate) fn kept_overwrites(&self) -> u64 {
        self.kept_overwrites.get()
    }

    /// A read on the fast path: granted the direct path, or planned from cached slices.
    #[inline(always)]
    pub(crate) fn fast_read(&self) {
        bump(&self.fast_reads);
    }

    /// A read that needed the slow path (a task).
    #[inline(always)]
    pub(crate) fn slow_read(&self) {
        bump(&self.slow_reads);
    }

    /// An overwrite kept on a core replica through an older copy of its slice.
    #[inline(always)]
    pub(crate) fn kept_overwrite(&self) {
        bump(&self.kept_overwrites);
    }

    /// A core replica served a write in place.
    #[inline(always)]
    pub(crate) fn wrote_here(&self) {
        bump(&self.writes_here);
    }

    /// A request goes to the metadata owner.
    pub(crate) fn sent_to_owner(&self) {
        bump(&self.to_owner);
    }

    /// The prefetch ring served a read whole.
    pub(crate) fn served_from_ring(&self) {
        bump(&self.ring_served);
    }
}
