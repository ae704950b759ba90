//! A plan's commit: the L2 words its parts leave, recorded in the dirty metadata, and the
//! clusters they replace freed through the ordered write-back.

use super::parts::{Action, AllocCursor, Part};
use crate::chain::Chain;
use crate::error::Result;
use crate::format::ClusterMapping;
use crate::image::owner::alloc::Allocation;
use crate::image::owner::discards::FreeKind;
use crate::image::owner::l2::L2Update;
use crate::image::owner::Owner;
use crate::io::BlockDevice;
use crate::types::HostRange;
use smallvec::SmallVec;

impl<D: BlockDevice> Chain<D> {
    /// Records a finished plan in the dirty metadata. Caller holds the lock. The parts
    /// lie in one L2 slice (a chunk): it is made dirty once, if anything changes.
    pub(super) async fn commit(
        &self,
        q: &Owner<'_, D>,
        parts: &[Part],
        allocs: &[Allocation],
    ) -> Result<()> {
        let mut cursor = AllocCursor::new(allocs);
        let changes = parts
            .iter()
            .any(|p| p.new_words(&q.geometry(), &mut cursor).is_some());
        if let (true, Some(p)) = (changes, parts.first()) {
            q.dirty_slice_for(p.cluster).await?;
        }
        let mut cursor = AllocCursor::new(allocs);
        let mut updates: SmallVec<[L2Update; 16]> = SmallVec::new();
        for p in parts {
            if let Some((entry, bitmap)) = p.new_words(&q.geometry(), &mut cursor) {
                updates.push(L2Update {
                    off: p.cluster,
                    entry,
                    bitmap,
                });
            }
        }
        // The entries change together (one look-up of the slice), then what they no longer
        // reference is freed, after their write-back (rule 2).
        q.set_l2_entries(&updates)?;
        for p in parts {
            // (An allocating part always changes its entry.)
            if let Action::Alloc { old, .. } = p.action {
                let cs = q.geometry().cluster_size();
                match old {
                    ClusterMapping::Data { host, .. } => {
                        q.free_later(HostRange::new(host, cs), FreeKind::Other)
                    }
                    ClusterMapping::Zero { host: Some(h) } => {
                        q.free_later(HostRange::new(h, cs), FreeKind::Other)
                    }
                    ClusterMapping::Compressed(d) => q.free_later(d.sectors(), FreeKind::Other),
                    _ => {}
                }
            }
        }
        Ok(())
    }
}
