//! Space the image takes on its device, for an operator watching a thin or fixed-size
//! base fill up: the clusters in use and where the image ends, counted from the
//! refcounts on demand ([`Owner::space_usage`]); and a threshold on the image's end (as
//! QEMU's `block-set-write-threshold` on a host offset) that warns once when an allocation
//! first takes a cluster past it ([`SpaceWatch`]).
//!
//! The count reads each refcount block under the metadata lock (its dirty copy, else the
//! cached or stored block, without filling the cache), so a write-back in flight is never
//! half seen; allocating writes wait at most one block read at a time.

use super::Owner;
use crate::error::Result;
use crate::exec::read_bytes;
use crate::format::refcount::{entries_per_block, get_refcount};
use crate::io::BlockDevice;

/// What the image takes of its device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SpaceUsage {
    /// Bytes of host clusters in use (refcount above zero): data, metadata, snapshots.
    pub allocated_bytes: u64,
    /// The end of the last cluster in use: what a file holding the image must be long.
    pub image_end_bytes: u64,
    /// The device's size now.
    pub device_bytes: u64,
}

impl SpaceUsage {
    /// Bytes the image can still take: the device's size less the clusters in use (the
    /// allocator reuses free clusters below the end before it grows the image).
    pub fn free_bytes(&self) -> u64 {
        self.device_bytes.saturating_sub(self.allocated_bytes)
    }
}

/// The highest cluster end the image reached and the threshold it is watched against.
#[derive(Debug, Default)]
pub(crate) struct SpaceWatch {
    /// The highest end (bytes) of a cluster taken since open, or counted by
    /// [`Owner::space_usage`].
    high_water: u64,
    /// Warn when `high_water` passes this (bytes); `None`: not watched.
    threshold: Option<u64>,
    /// The warning was given for the threshold as it is.
    warned: bool,
}

impl SpaceWatch {
    /// Clusters up to `end` bytes are in use: returns the threshold when this passes it for
    /// the first time (the caller warns).
    pub(crate) fn reached(&mut self, end: u64) -> Option<u64> {
        self.high_water = self.high_water.max(end);
        self.check()
    }

    /// Watches the image's end against `threshold` bytes from now on (`None`: stops), and
    /// returns it when the image already ends past it (the caller warns).
    pub(crate) fn set_threshold(&mut self, threshold: Option<u64>) -> Option<u64> {
        if self.threshold != threshold {
            self.threshold = threshold;
            self.warned = false;
        }
        self.check()
    }

    /// Whether the image's end passed the threshold.
    pub(crate) fn exceeded(&self) -> bool {
        self.threshold.is_some_and(|t| self.high_water > t)
    }

    fn check(&mut self) -> Option<u64> {
        if self.warned || !self.exceeded() {
            return None;
        }
        self.warned = true;
        self.threshold
    }
}

impl<D: BlockDevice> Owner<'_, D> {
    /// Counts the clusters in use and the image's end from the refcounts (every block
    /// read once; see the module doc).
    pub(crate) async fn space_usage(&self) -> Result<SpaceUsage> {
        let (bits, order) = {
            let h = self.header.borrow();
            (h.header.cluster_bits, h.header.refcount_order)
        };
        let cs = 1u64 << bits;
        let per_block = entries_per_block(bits, order);
        let m = self.meta();
        let (mut used, mut end) = (0u64, 0u64);
        let mut r = 0usize;
        loop {
            let _g = m.lock().lock().await;
            // The table may grow between blocks: its length is read each time.
            let Some(&block) = self.refcount_table.borrow().get(r) else {
                break;
            };
            let first = r as u64 * per_block;
            r += 1;
            if block == 0 {
                continue;
            }
            let count = |b: &[u8]| {
                let (mut n, mut last) = (0u64, None);
                for i in 0..per_block {
                    if get_refcount(b, order, i) != 0 {
                        n += 1;
                        last = Some(i);
                    }
                }
                (n, last)
            };
            let counted = if let Some(b) = m.dirty_rc_ref(block) {
                count(&b)
            } else {
                let cached = {
                    let cache = self.rc_cache.borrow();
                    cache.probe(block, 0).map(|h| count(cache.block(h.way)))
                };
                match cached {
                    Some(c) => c,
                    None => count(&read_bytes(&self.exec, self.dev, block, cs).await?),
                }
            };
            used += counted.0;
            if let Some(last) = counted.1 {
                end = (first + last + 1) * cs;
            }
        }
        let usage = SpaceUsage {
            allocated_bytes: used * cs,
            image_end_bytes: end,
            device_bytes: self.exec.device_size(self.dev),
        };
        let crossed = m.st_mut().space.reached(end);
        if let Some(t) = crossed {
            self.warn_space(end, t);
        }
        Ok(usage)
    }

    /// Watches the image's end against `threshold` bytes (`None`: stops watching).
    pub(crate) fn set_space_threshold(&self, threshold: Option<u64>) {
        let crossed = self.meta().st_mut().space.set_threshold(threshold);
        if let Some(t) = crossed {
            let end = self.meta().st().space.high_water;
            self.warn_space(end, t);
        }
    }

    /// Clusters up to `end_cluster` are in use now (every allocation passes here).
    pub(crate) fn space_reached(&self, end_cluster: u64) {
        let end = end_cluster << self.geo.cluster_bits;
        let crossed = self.meta().st_mut().space.reached(end);
        if let Some(t) = crossed {
            self.warn_space(end, t);
        }
    }

    #[cold]
    fn warn_space(&self, end: u64, threshold: u64) {
        tracing::warn!(
            "qcow2 image end reached {end} bytes, past the space threshold of {threshold} \
             bytes of its {} byte base: grow the base before it fills (writes that need a \
             new cluster then fail with ENOSPC)",
            self.exec.device_size(self.dev)
        );
    }
}
