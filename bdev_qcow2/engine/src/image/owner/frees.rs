//! Deferred frees: references removed in metadata that is not stable yet, clusters whose
//! refcount dropped to 0 in such metadata, (on a shared image) freed clusters waiting
//! for a grace period, and freed clusters waiting for their discard ([`super::discards`]).
//!
//! Invariant (ARCHITECTURE.md §7 rule 2, and §6 on grace periods): a cluster named here is
//! out of the allocator's reach — its refcount decrement is not stable, or a core may still
//! hold its old mapping, or its discard is not done — until [`Frees::reclaim`] (and
//! [`Frees::discarded`] for a discarded one) gives it back.
//!
//! Frees on the owner: a removed reference is dropped only once the metadata that removed
//! it is stable (rule 2), and on a shared image the cluster waits a grace period more
//! before reuse (a request that resolved the old mapping may still be in flight on another
//! core).

use super::alloc::Allocation;
use super::discards::{DiscardQueue, FreeKind, PassDiscard};
use super::HashSet;
use super::Owner;
use crate::error::Result;
use crate::io::BlockDevice;
use crate::types::HostRange;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Least time between two attempts to advance the grace period.
const ADVANCE_INTERVAL: Duration = Duration::from_micros(100);

/// Deferred frees (see the module doc).
#[derive(Default)]
pub(crate) struct Frees {
    /// Host byte ranges whose reference was removed in not-yet-stable metadata, and why.
    pending: Vec<(HostRange, FreeKind)>,
    /// Pending frees a write-back at the bound took with its slices (window.rs).
    window: Vec<(HostRange, FreeKind)>,
    /// Clusters whose refcount dropped to 0 but is not yet stable.
    unstable: HashSet<u64>,
    /// Freed clusters (stable) waiting for a grace period before reuse, by the generation
    /// they were freed in.
    graced: VecDeque<(u64, Vec<u64>)>,
    /// The same clusters, for the allocator.
    graced_set: HashSet<u64>,
    /// When the owner last tried to advance the grace period.
    last_advance: Option<Instant>,
    /// Freed clusters to discard on the device.
    discards: DiscardQueue,
}

impl Frees {
    /// No deferred free; freed clusters are discarded as `pass` says.
    pub(crate) fn new(pass: PassDiscard) -> Self {
        Frees {
            discards: DiscardQueue::new(pass),
            ..Default::default()
        }
    }
    /// The reference to host bytes `range` was removed in dirty metadata, for `kind`.
    pub(crate) fn free_later(&mut self, range: HostRange, kind: FreeKind) {
        self.pending.push((range, kind));
    }
    /// Takes the pending frees: the metadata that removed them is stable now (those a
    /// write-back at the bound took and has not applied included).
    pub(crate) fn take_pending(&mut self) -> Vec<(HostRange, FreeKind)> {
        let mut v = std::mem::take(&mut self.window);
        v.append(&mut self.pending);
        v
    }
    /// A write-back at the bound takes the pending frees with its slices.
    pub(crate) fn take_pending_window(&mut self) {
        let mut p = std::mem::take(&mut self.pending);
        self.window.append(&mut p);
    }
    /// The frees the write-back at the bound took and no other write-back took since: its
    /// slices are stable, it applies them now.
    pub(crate) fn end_window(&mut self) -> Vec<(HostRange, FreeKind)> {
        std::mem::take(&mut self.window)
    }
    /// Frees taken and not applied (a write failed): pending again, first.
    pub(crate) fn restore_pending(&mut self, mut frees: Vec<(HostRange, FreeKind)>) {
        frees.append(&mut self.pending);
        self.pending = frees;
    }
    /// Host cluster `c`'s refcount dropped to 0 in metadata not yet stable, freed for
    /// `kind` (queued for a discard if its switch is on).
    pub(crate) fn unstable(&mut self, c: u64, kind: FreeKind) {
        self.unstable.insert(c);
        self.discards.freed(c, kind);
    }
    /// Whether no refcount drop waits to become stable.
    pub(crate) fn none_unstable(&self) -> bool {
        self.unstable.is_empty()
    }
    /// Whether no cluster is held (unstable or in a grace period): the allocator may skip
    /// asking [`holds`](Self::holds).
    pub(crate) fn holds_none(&self) -> bool {
        self.unstable.is_empty() && self.graced_set.is_empty() && self.discards.is_empty()
    }
    /// Whether host cluster `c` is held out of the allocator's reach.
    #[inline]
    pub(crate) fn holds(&self, c: u64) -> bool {
        let held = |set: &HashSet<u64>| !set.is_empty() && set.contains(&c);
        held(&self.unstable)
            || held(&self.graced_set)
            || (!self.discards.is_empty() && self.discards.holds(c))
    }
    /// Whether no freed cluster waits for its discard.
    pub(crate) fn discards_empty(&self) -> bool {
        self.discards.is_empty()
    }
    /// The queued runs (first cluster, count) that may be discarded now: their frees are
    /// stable and past any grace period. They stay held until [`discarded`](Self::discarded).
    pub(crate) fn take_ready_discards(&mut self) -> Vec<(u64, u64)> {
        let (unstable, graced) = (&self.unstable, &self.graced_set);
        self.discards
            .take_ready(|c| unstable.contains(&c) || graced.contains(&c))
    }
    /// The runs `issued` were discarded: their clusters are free. Returns the lowest.
    pub(crate) fn discarded(&mut self, issued: &[(u64, u64)]) -> Option<u64> {
        self.discards.done(issued)
    }
    /// The device cannot discard: nothing more is queued.
    pub(crate) fn stop_discards(&mut self) {
        self.discards.stop();
    }
    /// Clusters freed without a discard because the queue was full.
    pub(crate) fn discards_skipped(&self) -> u64 {
        self.discards.skipped()
    }
    /// The unstable drops are stable now: on an image of one core (`grace` `None`) they
    /// are free at once; on a shared one they wait from the generation `grace` gives on.
    pub(crate) fn stabilized(&mut self, grace: Option<impl FnOnce() -> u64>) {
        self.discards.seal();
        match grace {
            None => self.unstable.clear(),
            Some(now) => {
                let batch: Vec<u64> = self.unstable.drain().collect();
                if !batch.is_empty() {
                    self.graced_set.extend(batch.iter().copied());
                    self.graced.push_back((now(), batch));
                }
            }
        }
    }
    /// Whether any cluster waits for a grace period.
    pub(crate) fn any_graced(&self) -> bool {
        !self.graced.is_empty()
    }
    /// Whether to try to advance the grace period now (noting the attempt): always without
    /// asymmetric fences (`costly` false), else at most once per interval, however many
    /// allocations ask meanwhile.
    pub(crate) fn advance_due(&mut self, now: Instant, costly: bool) -> bool {
        let due = !costly
            || self
                .last_advance
                .is_none_or(|t| now.duration_since(t) >= ADVANCE_INTERVAL);
        if due {
            self.last_advance = Some(now);
        }
        due
    }
    /// Releases the clusters whose grace period is over at generation `g`; returns the
    /// lowest one released.
    pub(crate) fn reclaim(&mut self, g: u64) -> Option<u64> {
        let mut lowest: Option<u64> = None;
        while self.graced.front().is_some_and(|(tag, _)| tag + 2 <= g) {
            if let Some((_, batch)) = self.graced.pop_front() {
                for c in batch {
                    self.graced_set.remove(&c);
                    lowest = Some(lowest.map_or(c, |l| l.min(c)));
                }
            }
        }
        lowest
    }
}

impl<D: BlockDevice> Owner<'_, D> {
    /// Drops the references of host bytes `range` (removed for `kind`) once the metadata
    /// that removed them is stable.
    pub(crate) fn free_later(&self, range: HostRange, kind: FreeKind) {
        self.meta().st_mut().frees.free_later(range, kind);
    }

    /// The refcount drops waiting to become stable are stable: the clusters may be reused —
    /// at once on an image of one core; after a grace period when cores share it.
    pub(crate) fn release_unstable(&self) {
        let grace = self.published().map(|sh| || sh.grace.now());
        if self.published().is_none() && !self.meta().st().frees.none_unstable() {
            // Free at once, before the allocator can hand them out.
            self.bump_reuse();
        }
        self.meta().st_mut().frees.stabilized(grace);
        self.reclaim_graced();
    }

    /// Releases the graced clusters whose grace period is over (advancing it if it can).
    pub(crate) fn reclaim_graced(&self) {
        let Some(sh) = self.published() else {
            return;
        };
        let m = self.meta();
        if !m.st().frees.any_graced() {
            return;
        }
        // An attempt costs a process-wide barrier with the asymmetric fences (system call
        // and interrupts on the cores' CPUs): at most one per interval, however many
        // allocations ask meanwhile; freed clusters wait that much longer.
        let now = std::time::Instant::now();
        let costly = crate::coherency::fences::asymmetric();
        let attempt = m.st_mut().frees.advance_due(now, costly);
        let g = if attempt {
            sh.grace.try_advance()
        } else {
            sh.grace.now()
        };
        let mut st = m.st_mut();
        if let Some(lowest) = st.frees.reclaim(g) {
            drop(st);
            self.bump_reuse();
            m.st_mut().alloc.freed(lowest);
        }
    }

    /// Frees clusters that were allocated but never referenced (an aborted allocation).
    pub(crate) async fn free_unreferenced(&self, a: Allocation) -> Result<()> {
        for c in a.first.0..a.end().0 {
            self.update_refcount(c, -1).await?;
            self.meta().st_mut().frees.unstable(c, FreeKind::Other);
        }
        Ok(())
    }
}
