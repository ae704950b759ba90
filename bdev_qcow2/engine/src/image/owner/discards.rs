//! Discards of freed host clusters: the device gets their space back (a hole punched in a
//! file, an unmapped range of a thin bdev), under QEMU's three switches
//! (`pass-discard-request`, `-snapshot`, `-other`: [`PassDiscard`]).
//!
//! Invariant (ARCHITECTURE.md §7 rule 2, carried to discards): a cluster is discarded only
//! where it could be reused — its refcount decrement stable (so the removal of its last
//! reference before it) and, on a shared image, the cores' grace period over — so no crash
//! state has metadata naming a discarded cluster, and no request in flight reads one. From
//! its free until its discard completed a queued cluster is out of the allocator's reach
//! (held like an unstable one), so a cluster handed out again is never discarded after.
//!
//! Clusters freed together (between two points where the frees became stable: an
//! *epoch*) share their fate, so adjacent ones of an epoch are merged into one run and a
//! run's first cluster tells whether the whole run may go.

use super::Owner;
use crate::image::OpenOptions;
use crate::io::BlockDevice;
use std::cell::Cell;
use std::collections::BTreeMap;

/// Most runs queued at once (bounded memory, about 32 bytes each); clusters freed past it
/// are freed without a discard (the device keeps their space; the image loses nothing).
const MAX_QUEUED_RUNS: usize = 16384;

/// Runs issued to the device at once.
const DISCARDS_IN_FLIGHT: usize = 32;

/// Why a cluster was freed: which switch decides its discard (QEMU's discard types).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FreeKind {
    /// A guest discard or write-zeroes with unmap.
    Request,
    /// A snapshot deleted, created over or applied.
    Snapshot,
    /// Anything else: a copied-on-write cluster, an old table, an aborted allocation.
    Other,
}

/// Which frees are discarded on the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PassDiscard {
    request: bool,
    snapshot: bool,
    other: bool,
}

impl PassDiscard {
    /// The switches of `opts`, all off on a device that cannot discard.
    pub(crate) fn new(opts: &OpenOptions, device_discards: bool) -> Self {
        PassDiscard {
            request: device_discards && opts.pass_discard_request,
            snapshot: device_discards && opts.pass_discard_snapshot,
            other: device_discards && opts.pass_discard_other,
        }
    }
    /// Whether a free of `kind` is discarded.
    fn passes(&self, kind: FreeKind) -> bool {
        match kind {
            FreeKind::Request => self.request,
            FreeKind::Snapshot => self.snapshot,
            FreeKind::Other => self.other,
        }
    }
}

/// A run of queued clusters.
#[derive(Clone, Copy, Debug)]
struct Run {
    len: u64,
    epoch: u64,
    /// Handed to the device (still held until [`DiscardQueue::done`]).
    issued: bool,
}

/// The freed clusters waiting for (or undergoing) their discard (see the module doc).
#[derive(Debug, Default)]
pub(crate) struct DiscardQueue {
    pass: PassDiscard,
    /// First cluster → its run.
    runs: BTreeMap<u64, Run>,
    /// The epoch clusters freed now belong to.
    epoch: u64,
    /// Clusters freed while the queue was full (never discarded).
    skipped: u64,
}

impl DiscardQueue {
    /// An empty queue discarding what `pass` lets through.
    pub(crate) fn new(pass: PassDiscard) -> Self {
        DiscardQueue {
            pass,
            ..Default::default()
        }
    }

    /// Host cluster `c`'s refcount dropped to 0 (not stable yet) for `kind`: queues it if
    /// its switch is on and the queue has room.
    pub(crate) fn freed(&mut self, c: u64, kind: FreeKind) {
        if !self.pass.passes(kind) {
            return;
        }
        let epoch = self.epoch;
        let before = self.runs.range(..=c).next_back().map(|(&s, r)| (s, *r));
        if let Some((s, r)) = before {
            if c < s + r.len {
                return; // queued already
            }
            if s + r.len == c && r.epoch == epoch && !r.issued {
                let mut len = r.len + 1;
                if let Some(next) = self.runs.get(&(c + 1)).copied() {
                    if next.epoch == epoch && !next.issued {
                        self.runs.remove(&(c + 1));
                        len += next.len;
                    }
                }
                if let Some(run) = self.runs.get_mut(&s) {
                    run.len = len;
                }
                return;
            }
        }
        if let Some(next) = self.runs.get(&(c + 1)).copied() {
            if next.epoch == epoch && !next.issued {
                self.runs.remove(&(c + 1));
                self.runs.insert(
                    c,
                    Run {
                        len: next.len + 1,
                        ..next
                    },
                );
                return;
            }
        }
        if self.runs.len() >= MAX_QUEUED_RUNS {
            self.skipped += 1;
            return;
        }
        self.runs.insert(
            c,
            Run {
                len: 1,
                epoch,
                issued: false,
            },
        );
    }

    /// The frees so far became stable together: later ones start a new epoch.
    pub(crate) fn seal(&mut self) {
        self.epoch += 1;
    }

    /// Whether no cluster is queued.
    pub(crate) fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// Whether host cluster `c` is queued (or being discarded).
    pub(crate) fn holds(&self, c: u64) -> bool {
        self.runs
            .range(..=c)
            .next_back()
            .is_some_and(|(&s, r)| c < s + r.len)
    }

    /// Marks issued and returns (first cluster, count) of the runs whose first cluster
    /// `waiting` does not name (their frees are stable and past any grace period).
    pub(crate) fn take_ready(&mut self, waiting: impl Fn(u64) -> bool) -> Vec<(u64, u64)> {
        let mut ready = Vec::new();
        for (&s, r) in self.runs.iter_mut() {
            if !r.issued && !waiting(s) {
                r.issued = true;
                ready.push((s, r.len));
            }
        }
        ready
    }

    /// The runs of `issued` were discarded (or failed): the clusters are free for the
    /// allocator. Returns the lowest one.
    pub(crate) fn done(&mut self, issued: &[(u64, u64)]) -> Option<u64> {
        for (s, _) in issued {
            self.runs.remove(s);
        }
        issued.iter().map(|&(s, _)| s).min()
    }

    /// The device cannot discard after all: nothing more is queued.
    pub(crate) fn stop(&mut self) {
        self.pass = PassDiscard::default();
    }

    /// Clusters freed while the queue was full.
    pub(crate) fn skipped(&self) -> u64 {
        self.skipped
    }
}

impl<D: BlockDevice> Owner<'_, D> {
    /// Discards the queued clusters whose frees are stable (and, on a shared image, past
    /// the cores' grace period), then hands them to the allocator. A failed discard loses
    /// nothing (the device keeps the space); a device that answers "not supported" gets
    /// no more.
    pub(crate) async fn process_discards(&self) {
        let m = self.meta();
        if m.st().frees.discards_empty() {
            return;
        }
        self.reclaim_graced();
        let ready = m.st_mut().frees.take_ready_discards();
        if ready.is_empty() {
            return;
        }
        // The bytes of these clusters change now (see `reuse_gen`).
        self.bump_reuse();
        let bits = self.geo.cluster_bits;
        let failed = Cell::new(0u64);
        let unsupported = Cell::new(false);
        for group in ready.chunks(DISCARDS_IN_FLIGHT) {
            let futs: Vec<_> = group
                .iter()
                .map(|&(c, n)| {
                    let f = self.exec.discard(self.dev, c << bits, n << bits);
                    let (failed, unsupported) = (&failed, &unsupported);
                    async move {
                        if let Err(e) = f.await {
                            failed.set(failed.get() + 1);
                            if e.errno() == EOPNOTSUPP {
                                unsupported.set(true);
                            }
                        }
                        Ok(())
                    }
                })
                .collect();
            let _ = crate::exec::join_all(futs).await;
        }
        let mut st = m.st_mut();
        let lowest = st.frees.discarded(&ready);
        st.stats.discards += ready.len() as u64 - failed.get();
        st.stats.discards_failed += failed.get();
        st.stats.bytes_discarded += ready.iter().map(|&(_, n)| n << bits).sum::<u64>();
        if unsupported.get() {
            tracing::info!("qcow2: the device does not support discard; freed clusters stay");
            st.frees.stop_discards();
        }
        if let Some(c) = lowest {
            st.alloc.freed(c);
        }
    }
}

/// The errno of an operation the device does not support.
const EOPNOTSUPP: i32 = 95;

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> PassDiscard {
        PassDiscard {
            request: true,
            snapshot: true,
            other: true,
        }
    }

    #[test]
    fn adjacent_frees_of_one_epoch_merge_and_epochs_stay_apart() {
        let mut q = DiscardQueue::new(all());
        for c in [5, 3, 4, 7] {
            q.freed(c, FreeKind::Request);
        }
        q.seal();
        q.freed(6, FreeKind::Other);
        q.freed(8, FreeKind::Other);
        assert!(q.holds(3) && q.holds(5) && q.holds(6) && q.holds(8) && !q.holds(2));
        // Epoch 1's clusters (6, 8) are still waiting: only epoch 0's runs go.
        let ready = q.take_ready(|c| c == 6 || c == 8);
        assert_eq!(ready, vec![(3, 3), (7, 1)]);
        // Issued runs stay held until done, and nothing merges into them.
        assert!(q.holds(4) && q.take_ready(|_| false) == vec![(6, 1), (8, 1)]);
        assert_eq!(q.done(&ready), Some(3));
        assert!(!q.holds(4) && q.holds(6));
    }

    #[test]
    fn switches_choose_what_is_queued_and_a_full_queue_skips() {
        let opts = OpenOptions::default();
        let mut q = DiscardQueue::new(PassDiscard::new(&opts, true));
        q.freed(1, FreeKind::Other);
        q.freed(3, FreeKind::Snapshot);
        q.freed(5, FreeKind::Request);
        assert!(!q.holds(1) && q.holds(3) && q.holds(5));
        let mut off = DiscardQueue::new(PassDiscard::new(&opts, false));
        off.freed(3, FreeKind::Snapshot);
        assert!(off.is_empty());
        let mut full = DiscardQueue::new(all());
        for i in 0..=MAX_QUEUED_RUNS as u64 {
            full.freed(i * 2, FreeKind::Other);
        }
        assert_eq!(full.skipped(), 1);
        full.stop();
        full.freed(1, FreeKind::Other);
        assert!(!full.holds(1));
    }
}
