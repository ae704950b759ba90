//! Frees on the owner: a removed reference is dropped only once the metadata that removed
//! it is stable (rule 2), and on a shared image the cluster waits a grace period more
//! before reuse (a request that resolved the old mapping may still be in flight on another
//! core).

use super::alloc::Allocation;
use super::Owner;
use crate::error::Result;
use crate::io::BlockDevice;
use crate::types::HostRange;

impl<D: BlockDevice> Owner<'_, D> {
    /// Drops the references of host bytes `range` once the metadata that removed them is
    /// stable.
    pub(crate) fn free_later(&self, range: HostRange) {
        self.meta().st_mut().frees.free_later(range);
    }

    /// The refcount drops waiting to become stable are stable: the clusters may be reused —
    /// at once on an image of one core; after a grace period when cores share it.
    pub(crate) fn release_unstable(&self) {
        let grace = self.shared.as_ref().map(|sh| || sh.grace.now());
        if self.shared.is_none() && !self.meta().st().frees.none_unstable() {
            // Free at once, before the allocator can hand them out.
            self.bump_reuse();
        }
        self.meta().st_mut().frees.stabilized(grace);
        self.reclaim_graced();
    }

    /// Releases the graced clusters whose grace period is over (advancing it if it can).
    pub(crate) fn reclaim_graced(&self) {
        let Some(sh) = &self.shared else {
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
            self.meta().st_mut().frees.unstable(c);
        }
        Ok(())
    }
}
