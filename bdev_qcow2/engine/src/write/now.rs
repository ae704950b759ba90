//! A metadata-changing write planned on the spot ([`Chain::plan_now`]) when everything it
//! needs is in memory, with the clusters taken ahead of it (`OpenOptions::alloc_granule`),
//! and the small task that writes its data and commits it.

use super::parts::{action_for, Action, Allocs, Part, Parts};
use super::top;
use crate::chain::Chain;
use crate::error::Result;
use crate::exec::GraceEntry;
use crate::format::ClusterMapping;
use crate::image::owner::Owner;
use crate::image::Qcow2;
use crate::io::{BlockDevice, BufSlice};
use crate::types::GuestOffset;
use std::rc::Rc;

impl<D: BlockDevice> Chain<D> {
    /// The aligned group of guest clusters `first..end` that a first write of guest
    /// clusters `g..g + n` (`parts`, every one unallocated) takes at once under
    /// `OpenOptions::alloc_granule`, with the plan that takes it: the write's own parts and,
    /// in guest order between them, a part of nothing for every other cluster of the group
    /// that is unallocated (no backing file: it reads as zeros, as the fresh cluster taken
    /// for it does). Clusters of the group allocated already are left alone, so that a group
    /// one write could not take whole (an allocation in flight, the zeroed tail in the way,
    /// a new L2 table) is taken by the next first write into it. `None` when the group is no
    /// larger than the write, crosses its slice or the disk's end, has an allocation in
    /// flight or nothing else to take. Returns the first and last guest cluster of the plan
    /// with it.
    fn granule_run(
        &self,
        q: &Owner<'_, D>,
        parts: &[Part],
        g: u64,
        n: u64,
    ) -> Option<(u64, u64, Parts)> {
        let per = q.meta().granule_clusters();
        let geo = q.geometry();
        if per <= 1 || geo.extended_l2() || self.layers().len() > 1 || parts.len() as u64 != n {
            return None;
        }
        let unwritten = |p: &Part| {
            matches!(
                p.action,
                Action::Alloc {
                    old: ClusterMapping::Unallocated { host: None },
                    ..
                }
            )
        };
        if !parts.iter().all(unwritten) {
            return None;
        }
        let bits = geo.cluster_bits;
        let g0 = g & !(per - 1);
        let end = (g + n)
            .next_multiple_of(per)
            .min(q.size().div_ceil(geo.cluster_size()));
        let slice = |c: u64| geo.slice_id(GuestOffset(c << bits));
        // Graced clusters come back before the look at freshness, as `alloc_clusters_now`
        // would bring them back: they lower the allocation hint below the fresh clusters.
        q.reclaim_graced();
        if end <= g0 + n || slice(g0) != slice(end - 1) || q.meta().inflight_any(g0, end - 1) {
            return None;
        }
        let mut all = Parts::with_capacity((end - g0) as usize);
        let mut own = parts.iter();
        // The group's entries in one look-up of its slice (checked above to hold it).
        let whole = q.with_entries_now(GuestOffset(g0 << bits), |entries| {
            let entries = entries.get(..(end - g0) as usize)?;
            for (c, e) in (g0..end).zip(entries) {
                if (g..g + n).contains(&c) {
                    all.extend(own.next().copied());
                } else if *e == 0 {
                    let at = c << bits;
                    all.push(Part::new(at, at, at, Action::UNWRITTEN));
                }
            }
            Some(())
        });
        whole??;
        let take = all.len() as u64;
        // The clusters marked in flight, from the plan's first part to its last (what
        // `finish_chunk` unmarks); allocated ones between them only wait a little.
        let first = all.first().map(|p| geo.guest_cluster(p.cluster))?;
        let last = all.last().map(|p| geo.guest_cluster(p.cluster))?;
        (take > n && q.next_run_fresh(take)).then_some((first, last, all))
    }

    /// [`plan_chunk`](Self::plan_chunk) on the spot, for a write of guest bytes `[start, end)` inside
    /// one L2 slice that changes metadata (allocation, an extended-L2 bitmap, a zero flag),
    /// when everything it needs is in memory: the metadata lock free (no plan, commit or
    /// write-back under way), no allocation in flight on its clusters, its L2 table
    /// writable (or none yet, and a cluster for it found without I/O: the new table is
    /// made here), its slice dirty or cached, no cluster in place already, the clusters to
    /// allocate consecutive (one run of host clusters, found without I/O). Then, as
    /// [`lock_clusters`](Self::lock_clusters) and `plan` would, marks the clusters in
    /// flight, takes the new clusters and returns the plan; else `Ok(None)`, having changed
    /// nothing but perhaps made that new table, as the task would have (the task runs the
    /// write as usual, and reports any corruption). An error is the allocation's (the
    /// device cannot hold the new cluster): the write fails with it, as it would in the
    /// task.
    ///
    /// Nothing awaits between the checks and the changes, so holding the lock would change
    /// nothing; skipping the task's lock, planning futures and slice look-ups is the point:
    /// a first write into a fresh image then costs little more than an overwrite.
    pub(super) fn plan_now(
        &self,
        q: &Qcow2<D>,
        start: u64,
        end: u64,
    ) -> Result<Option<(Parts, Allocs)>> {
        let Ok(o) = q.owner() else {
            return Ok(None);
        };
        let (q, m) = (&o, o.meta());
        let geo = q.geometry();
        let cs = geo.cluster_size();
        let (first, last) = (start / cs, (end - 1) / cs);
        if m.lock().is_locked()
            || geo.slice_id(GuestOffset(start)) != geo.slice_id(GuestOffset(end - 1))
            || m.inflight_any(first, last)
            || q.allocates_by_region()
        {
            return Ok(None);
        }
        // A fresh image's first writes mostly land where no L2 table is yet: one made here
        // spares them the task (and a core's write the data sent to the owner, #48).
        // (An error here, a corrupt L1 entry, is the task's to report.)
        if !matches!(q.ensure_l2_now(GuestOffset(start)), Ok(true)) {
            return Ok(None);
        }
        let mut parts = Parts::new();
        // The allocating parts' guest clusters: one run (first, count), as one allocation.
        let mut allocating: Option<(u64, u64)> = None;
        let mut pos = start;
        while pos < end {
            let cluster = pos & !(cs - 1);
            let b = end.min(cluster + cs);
            let Some((entry, bitmap)) = q.l2_words_now(GuestOffset(cluster)) else {
                return Ok(None);
            };
            let Ok(action) = action_for(q, entry, bitmap) else {
                return Ok(None);
            };
            match action {
                // In place: the direct path's (which refused it) or the task's.
                Action::InPlace { .. } => return Ok(None),
                Action::Alloc { .. } => match &mut allocating {
                    None => allocating = Some((cluster / cs, 1)),
                    Some((g, n)) if *g + *n == cluster / cs => *n += 1,
                    Some(_) => return Ok(None),
                },
                // A bitmap or zero-flag change in place. Rule 6 as in `plan` (the task
                // marks the image corrupt).
                Action::SubclusterInPlace { host, .. } | Action::Rewrite { host, .. } => {
                    if q.overlaps_metadata(geo.host_cluster_offset(geo.host_cluster(host)), cs) {
                        return Ok(None);
                    }
                }
            }
            parts.push(Part::new(cluster, pos, b, action));
            pos = b;
        }
        let mut allocs = Allocs::new();
        let (mut first, mut last) = (first, last);
        if let Some((g, n)) = allocating {
            let granule = self.granule_run(q, &parts, g, n);
            let run = match &granule {
                Some((_, _, all)) => q.alloc_clusters_now(all.len() as u64)?,
                None => None,
            };
            match (granule, run) {
                (Some((g_first, g_last, all)), Some(run)) => {
                    // The other unallocated clusters of the group join the plan as first
                    // writes of nothing: their entries map the run, and fresh clusters
                    // read zeros.
                    m.st_mut().stats.clusters_taken_ahead += all.len() as u64 - n;
                    parts = all;
                    (first, last) = (g_first, g_last);
                    allocs.push(run);
                }
                _ => {
                    let Some(run) = q.alloc_clusters_now(n)? else {
                        return Ok(None);
                    };
                    allocs.push(run);
                }
            }
        }
        let mut st = m.st_mut();
        st.alloc.inflight_mut().mark(first, last);
        st.stats.writes_planned_now += 1;
        Ok(Some((parts, allocs)))
    }

    /// The task of a guest write [`plan_now`](Self::plan_now) planned (`tag`, entered with
    /// `entry`): its data, then [`finish_chunk`](Self::finish_chunk), then completion.
    /// Data that is the guest's alone, on consecutive host bytes (whole new clusters, or
    /// part of one that reads as zeros), is one device write awaited in place; anything
    /// else (COW data) goes through [`write_data`](Self::write_data), boxed. One async fn
    /// with nothing nested but the I/O and the commit, so that the task's future stays
    /// small (within the allocator's per-thread cache: ~1 KiB).
    pub(super) async fn planned_task(
        self: Rc<Self>,
        tag: u64,
        entry: GraceEntry,
        start: GuestOffset,
        (parts, allocs): (Parts, Allocs),
        data: BufSlice<D::Buf>,
    ) {
        let r = match top(&self).and_then(|q| q.owner()) {
            Ok(o) => {
                let q = &o;
                let res = match self.guest_only_run(q, &parts, &allocs) {
                    Some(h) => self.exec().write(q.data_dev(), h.0, data).await,
                    None => Box::pin(self.write_data(q, start, &parts, &allocs, Some(data))).await,
                };
                self.finish_chunk(q, &parts, &allocs, res).await
            }
            Err(e) => Err(e),
        };
        self.exec().complete_entered(tag, r, entry);
    }
}
