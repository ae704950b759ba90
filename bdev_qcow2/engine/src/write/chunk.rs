//! The two-phase plan of a write inside one L2 slice (a chunk): under the metadata lock,
//! mark its clusters in flight and plan each one (allocating what it needs) → data
//! without the lock → commit or abort under the lock ([`Chain::finish_chunk`]).

use super::parts::{action_for, Action, Allocs, Part, Parts};
use crate::chain::Chain;
use crate::error::{Field, Result};
use crate::image::owner::alloc::Allocation;
use crate::image::owner::Owner;
use crate::image::Qcow2;
use crate::io::{BlockDevice, BufSlice};
use crate::types::GuestOffset;
use std::rc::Rc;

impl<D: BlockDevice> Chain<D> {
    /// Takes the metadata lock once no cluster of `[first, last]` has an allocation in
    /// flight, and marks them in flight.
    pub(crate) async fn lock_clusters<'q>(
        &self,
        q: &Owner<'q, D>,
        first: u64,
        last: u64,
    ) -> crate::exec::LockGuard<'q, D> {
        let m = q.meta();
        loop {
            let g = m.lock().lock().await;
            let busy = m.inflight_any(first, last);
            if !busy {
                m.st_mut().alloc.inflight_mut().mark(first, last);
                return g;
            }
            drop(g);
            m.wait_inflight().await;
        }
    }

    pub(crate) fn unmark_clusters(&self, q: &Owner<'_, D>, first: u64, last: u64) {
        q.meta().end_inflight(first, last);
    }

    /// Writes guest bytes `[start, end)` (inside one L2 slice); `data` is `None` for zeros.
    pub(super) async fn write_chunk(
        self: &Rc<Self>,
        q: &Qcow2<D>,
        start: u64,
        end: u64,
        data: Option<BufSlice<D::Buf>>,
    ) -> Result<()> {
        let o = q.owner()?;
        let cs = q.geometry().cluster_size();
        let (first, last) = (start / cs, (end - 1) / cs);
        let guard = self.lock_clusters(&o, first, last).await;
        let planned = self.plan_chunk(&o, start, end).await;
        let (parts, allocs) = match planned {
            Ok(p) => p,
            Err(e) => {
                drop(guard);
                self.unmark_clusters(&o, first, last);
                return Err(e);
            }
        };
        drop(guard);
        // Data phase, without the lock.
        let res = self
            .write_data(&o, GuestOffset(start), &parts, &allocs, data)
            .await;
        self.finish_chunk(&o, &parts, &allocs, res).await
    }

    /// The end of a planned chunk after its data phase (`res`): under the metadata lock,
    /// commits the plan (or frees its new clusters), lets waiting writers of its clusters
    /// go, then writes metadata back if enough is dirty.
    pub(super) async fn finish_chunk(
        &self,
        q: &Owner<'_, D>,
        parts: &[Part],
        allocs: &[Allocation],
        res: Result<()>,
    ) -> Result<()> {
        let geo = q.geometry();
        let (first, last) = match (parts.first(), parts.last()) {
            (Some(a), Some(b)) => (geo.guest_cluster(a.cluster), geo.guest_cluster(b.cluster)),
            _ => return res,
        };
        let guard = q.meta().lock().lock().await;
        let r = match res {
            Ok(()) => self.commit(q, parts, allocs).await,
            Err(e) => {
                for &a in allocs {
                    // Boxed: rare, and the write path's per-request future stays small.
                    let _ = Box::pin(q.free_unreferenced(a)).await;
                }
                Err(e)
            }
        };
        let over_bound = r.is_ok() && q.over_bound();
        drop(guard);
        self.unmark_clusters(q, first, last);
        if over_bound {
            // Boxed: rare, and the write path's per-request future stays small. It takes
            // the lock itself and lets allocations run while its slices are written.
            Box::pin(q.writeback_at_bound()).await?;
        }
        r
    }

    /// Decides the action for each guest cluster of `[start, end)` and allocates what is
    /// needed (refcounts and L2 tables, in the dirty metadata). Returns the parts and, per
    /// allocated run, its [`Allocation`]. Caller holds the lock.
    async fn plan_chunk(&self, q: &Owner<'_, D>, start: u64, end: u64) -> Result<(Parts, Allocs)> {
        let geo = q.geometry();
        let cs = geo.cluster_size();
        let mut parts = Parts::new();
        let mut pos = start;
        while pos < end {
            let cluster = pos & !(cs - 1);
            let b = end.min(cluster + cs);
            let (entry, bitmap) = q.l2_words(GuestOffset(cluster)).await?;
            let action = action_for(q, entry, bitmap)?;
            parts.push(Part::new(cluster, pos, b, action));
            pos = b;
        }
        // Rule 6: an entry pointing into the image's own metadata is corruption; never
        // write through it.
        for p in &parts {
            let host = match p.action {
                Action::InPlace { host }
                | Action::Rewrite { host, .. }
                | Action::SubclusterInPlace { host, .. } => host,
                Action::Alloc { .. } => continue,
            };
            if q.overlaps_metadata(geo.host_cluster_offset(geo.host_cluster(host)), cs) {
                return Err(q
                    .mark_corrupt(Field::L2Entry, host.0, "L2 entry points into metadata")
                    .await);
            }
        }
        let need = parts
            .iter()
            .filter(|p| matches!(p.action, Action::Alloc { .. }))
            .count() as u64;
        let mut allocs = Allocs::new();
        if need > 0
            || parts.iter().any(|p| {
                matches!(
                    p.action,
                    Action::SubclusterInPlace { .. } | Action::Rewrite { .. }
                )
            })
        {
            q.ensure_l2(GuestOffset(start)).await?;
        }
        // The allocating parts' guest clusters, in order; each run of consecutive ones gets
        // host clusters where the allocator places that run (`alloc_data`).
        let mut guest = parts
            .iter()
            .filter(|p| matches!(p.action, Action::Alloc { .. }))
            .map(|p| geo.guest_cluster(p.cluster))
            .peekable();
        while let Some(g) = guest.next() {
            let mut run = 1;
            while guest.next_if_eq(&(g + run)).is_some() {
                run += 1;
            }
            let mut done = 0;
            while done < run {
                let a = match q.alloc_data(g + done, run - done).await {
                    Ok(a) => a,
                    Err(e) => {
                        for &a in &allocs {
                            let _ = q.free_unreferenced(a).await;
                        }
                        return Err(e);
                    }
                };
                allocs.push(a);
                done += a.count;
            }
        }
        Ok((parts, allocs))
    }
}
