//! A plan's commit: the L2 words its parts leave, recorded in the dirty metadata, and the
//! clusters they replace freed through the ordered write-back.

use super::parts::{Action, AllocCursor, Part};
use crate::chain::Chain;
use crate::error::Result;
use crate::format::ClusterMapping;
use crate::image::owner::alloc::Allocation;
use crate::image::owner::discards::FreeKind;
use crate::image::owner::Owner;
use crate::io::BlockDevice;
use crate::types::HostRange;

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
        for p in parts {
            let Some((entry, bitmap)) = p.new_words(&q.geometry(), &mut cursor) else {
                continue;
            };
            q.set_l2_words(p.cluster, entry, bitmap)?;
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
