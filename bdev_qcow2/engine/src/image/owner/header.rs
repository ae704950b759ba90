//! The header on the owner: the corrupt bit, the dirty bit (lazy refcounts), and the
//! zeroed tail, each written as the first sector whole through the header writer's copy.
//!
//! Invariants: the dirty bit is set and stable before metadata that relies on it reaches
//! the device; the zeroed tail on disk lies past every cluster written, so it is raised
//! (written and flushed) before clusters at or past it are taken.

use super::Owner;
use crate::error::{corrupt, Error, Field, Result};
use crate::format::header::ZeroedTail;
use crate::io::{BlockDevice, BufSlice, IoBuffer};
use crate::meta::zeroed_tail::Raise;

/// The least step by which the zeroed tail is raised (see `raise_zeroed_tail`).
const ZEROED_TAIL_STEP_MIN: u64 = 1 << 20;
/// The most a tail zeroed ahead is raised by at once: one write-zeroes, which the
/// allocator waits for (NVMe may write the zeros).
const ZERO_AHEAD_STEP_MAX: u64 = 64 << 20;

impl<D: BlockDevice> Owner<'_, D> {
    /// Sets the corrupt bit on disk (best effort) after an inconsistency was detected, and
    /// returns the error to fail the request with.
    ///
    /// Boxed: callers await it only on corruption, and their own futures (the write path's
    /// included, allocated per request) stay small.
    pub(crate) fn mark_corrupt(
        &self,
        field: Field,
        value: u64,
        reason: &'static str,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Error> + '_>> {
        Box::pin(self.mark_corrupt_inner(field, value, reason))
    }

    async fn mark_corrupt_inner(&self, field: Field, value: u64, reason: &'static str) -> Error {
        tracing::error!("qcow2: marking image corrupt: {field}: {reason} ({value:#x})");
        let sector = self.meta().st_mut().header.mark_corrupt();
        let buf = self.exec.alloc_buf(self.dev, sector.len());
        buf.copy_in(0, &sector);
        let _ = self.exec.write(self.dev, 0, BufSlice::whole(buf)).await;
        let _ = self.exec.flush(self.dev).await;
        self.header.borrow_mut().header.incompatible_features |=
            crate::format::header::incompat::CORRUPT;
        corrupt(field, value, reason)
    }

    /// Writes the header copy (the first sector).
    pub(crate) async fn write_header(&self) -> Result<()> {
        let sector = self.meta().st_mut().header.take_for_write();
        let buf = self.exec.alloc_buf(self.dev, sector.len());
        buf.copy_in(0, &sector);
        self.exec.write(self.dev, 0, BufSlice::whole(buf)).await
    }

    /// Sets the dirty bit on disk (and makes it stable) before metadata that relies on it.
    pub(crate) async fn set_dirty_bit(&self) -> Result<()> {
        let m = self.meta();
        if m.st().header.dirty_bit_on_disk() {
            return Ok(());
        }
        m.st_mut().header.set_dirty_bit();
        self.write_header().await?;
        self.exec.flush(self.dev).await?;
        m.st_mut().header.dirty_bit_written();
        Ok(())
    }

    /// Whether clusters below `end_cluster` may be written as things stand: they lie below
    /// the zeroed tail (always, without one).
    pub(crate) fn below_zeroed_tail(&self, end_cluster: u64) -> bool {
        let tail = self.meta().st().tail.first_cluster(self.geo.cluster_bits);
        tail.is_none_or(|t| end_cluster <= t)
    }

    /// Raises the zeroed tail to at least cluster `end_cluster` unless it lies there
    /// already: called before clusters below `end_cluster` are taken, so that nothing is
    /// ever written at or past the tail. A recorded tail is raised on disk (the first
    /// sector written alone, then flushed), so that whatever a crash keeps, the claim
    /// covers nothing written; a tail zeroed ahead zeroes the device up to its new start.
    /// It moves in steps of a 64th of the device (1 MiB at least; zeroing, 64 MiB at
    /// most). Caller holds the metadata lock.
    pub(crate) async fn raise_zeroed_tail(&self, end_cluster: u64) -> Result<()> {
        if self.below_zeroed_tail(end_cluster) {
            return Ok(());
        }
        let m = self.meta();
        let cs = self.geo.cluster_size();
        let bits = self.geo.cluster_bits;
        let dev_end = self.device_size.get().div_ceil(cs) * cs;
        let zeroing = m.st().tail.zeroes_ahead();
        let mut step = (dev_end / 64).max(ZEROED_TAIL_STEP_MIN);
        if zeroing {
            step = step.min(ZERO_AHEAD_STEP_MAX);
        }
        let from = ((end_cluster << bits) + step).div_ceil(cs) * cs;
        let from = from.min(dev_end.max(end_cluster << bits));
        let Some(raise) = m.st().tail.raise_to(from) else {
            return Ok(());
        };
        match raise {
            Raise::Record(tail) => {
                let sector = m.st_mut().header.raise_zeroed_tail(tail);
                let buf = self.exec.alloc_buf(self.dev, sector.len());
                buf.copy_in(0, &sector);
                self.exec.write(self.dev, 0, BufSlice::whole(buf)).await?;
                self.exec.flush(self.dev).await?;
            }
            Raise::Zero { from: old, to } => {
                // Inside the device only: past its end nothing can be taken anyway.
                let to_dev = to.min(self.device_size.get());
                if to_dev > old {
                    if let Err(e) = self.exec.write_zeroes(self.dev, old, to_dev - old).await {
                        tracing::warn!(
                            "qcow2: zeroing ahead of the allocator failed ({e}); first writes \
                             into new clusters write them whole from now on"
                        );
                        m.st_mut().stop_zero_ahead(dev_end >> bits);
                        return Ok(());
                    }
                }
                m.st_mut().stats.zeroed_ahead_bytes += to_dev.saturating_sub(old);
            }
        }
        let mut st = m.st_mut();
        st.tail.moved_to(from);
        st.stats.zeroed_tail_raises += 1;
        Ok(())
    }

    /// At a clean close: the zeroed tail goes back to where the clusters ever allocated end
    /// (nothing was written past them), so that the next open finds every cluster past
    /// them fresh. Caller holds the metadata lock, every write has completed.
    pub(crate) async fn lower_zeroed_tail(&self) -> Result<()> {
        let m = self.meta();
        let cs = self.geo.cluster_size();
        let lowered = {
            let mut st = m.st_mut();
            let end = st.alloc.fresh_from() * cs;
            match st.tail.recorded() {
                Some(z) if end < z.from => {
                    st.header.lower_zeroed_tail(ZeroedTail {
                        from: end,
                        at: z.at,
                    });
                    Some(end)
                }
                _ => None,
            }
        };
        if let Some(end) = lowered {
            self.write_header().await?;
            self.exec.flush(self.dev).await?;
            m.st_mut().tail.moved_to(end);
        }
        Ok(())
    }
}
