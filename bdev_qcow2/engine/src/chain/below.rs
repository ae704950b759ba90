//! Reads below the top of a deep chain through its layer index (`index.rs`): a guest range
//! the top leaves unallocated goes straight to the backing layer the index names, so that
//! a read of a cluster only a deep layer holds costs what it costs in a chain of two once
//! it has been read. The walk that finds the layer is a loop (never a recursion per layer)
//! and teaches the index what it found.

use super::index::{Known, LayerIndex};
use super::{read_layer, BoxFut, Chain, FastPlan, Layer, Unplanned};
use crate::error::Result;
use crate::exec::join_all;
use crate::format::ClusterMapping;
use crate::io::{BlockDevice, BufSlice};
use crate::types::GuestOffset;
use std::rc::Rc;

/// Where a walk of the backing layers stopped for one unit: the layer, and whether the
/// read ends there (else: a slice of that layer is not cached; the read starts there).
type Found = (usize, bool);

impl<D: BlockDevice> Chain<D> {
    /// Plans, from cached metadata, `len` bytes at `offset` that the top leaves
    /// unallocated, into the buffer at `buf_off`: each run of units goes to the layer the
    /// index names, after a walk over cached slices where it names none yet.
    #[inline(always)]
    pub(super) fn plan_below<const ZIP: bool>(
        &self,
        ix: &LayerIndex,
        offset: u64,
        len: usize,
        buf_off: usize,
        plan: &mut FastPlan,
    ) -> Result<(), Unplanned> {
        let end = offset + len as u64;
        let mut pos = offset;
        while pos < end {
            let layer = match ix.get(pos) {
                Known::Ends(k) => k,
                Known::From(from) => {
                    let (k, ends) = self.walk_cached(from, pos, ix.unit_end(pos));
                    ix.record(pos, k, ends);
                    k
                }
            };
            let mut next = ix.unit_end(pos).min(end);
            while next < end && ix.get(next) == Known::Ends(layer) {
                next = ix.unit_end(next).min(end);
            }
            let at = buf_off + (pos - offset) as usize;
            self.plan_layer::<ZIP>(layer, pos, (next - pos) as usize, at, plan)?;
            pos = next;
        }
        Ok(())
    }

    /// Walks the backing layers from `from` down for the unit `[pos, unit_end)`, over
    /// cached slices only: where the walk ends, or the first layer whose slice is not
    /// cached (or whose entry is invalid: planning there reports it).
    fn walk_cached(&self, from: usize, pos: u64, unit_end: u64) -> Found {
        let mut idx = from;
        loop {
            let Some(layer) = self.disk.layer(idx) else {
                return (idx, false);
            };
            let q = match layer {
                Layer::Qcow2(q) if self.disk.reads_below(idx) && q.size() >= unit_end => q,
                _ => return (idx, true),
            };
            match q.resolve_cached(GuestOffset(pos)) {
                Ok(Some((ClusterMapping::Unallocated { .. }, _))) => idx += 1,
                Ok(Some(_)) => return (idx, true),
                Ok(None) | Err(_) => return (idx, false),
            }
        }
    }
}

/// [`Chain::walk_cached`] that loads the slices it needs: where the walk ends.
async fn walk<D: BlockDevice>(
    chain: &Chain<D>,
    from: usize,
    pos: u64,
    unit_end: u64,
) -> Result<usize> {
    let mut idx = from;
    loop {
        let q = match chain.disk.layer(idx) {
            Some(Layer::Qcow2(q)) if chain.disk.reads_below(idx) && q.size() >= unit_end => q,
            _ => return Ok(idx),
        };
        match q.extent(pos, unit_end).await?.0 {
            ClusterMapping::Unallocated { .. } => idx += 1,
            _ => return Ok(idx),
        }
    }
}

/// Reads `buf.len` bytes at `offset` that the top leaves unallocated from the backing
/// layers, each run of units from the layer the index names (found by a walk first where
/// it names none yet).
pub(super) fn read_below<D: BlockDevice>(
    chain: Rc<Chain<D>>,
    offset: u64,
    buf: BufSlice<D::Buf>,
) -> BoxFut {
    Box::pin(async move {
        let Some(ix) = chain.index.as_ref() else {
            return read_layer(chain.clone(), 1, offset, buf).await;
        };
        let end = offset + buf.len as u64;
        let mut futs: Vec<BoxFut> = Vec::new();
        let mut pos = offset;
        while pos < end {
            let layer = match ix.get(pos) {
                Known::Ends(k) => k,
                Known::From(from) => {
                    let k = walk(&chain, from, pos, ix.unit_end(pos)).await?;
                    ix.record(pos, k, true);
                    k
                }
            };
            let mut next = ix.unit_end(pos).min(end);
            while next < end && ix.get(next) == Known::Ends(layer) {
                next = ix.unit_end(next).min(end);
            }
            let sub = buf.sub((pos - offset) as usize, (next - pos) as usize);
            futs.push(read_layer(chain.clone(), layer, pos, sub));
            pos = next;
        }
        join_all(futs).await
    })
}
