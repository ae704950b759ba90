//! The zeroed tail as the owner keeps it, raises and lowers it: past `from` the device
//! reads as zeros, and clusters there are fresh (a first write into one writes the guest's
//! bytes alone).
//!
//! Two kinds, one rule for the allocator (nothing is taken at or past `from` before the
//! tail is raised past it):
//! - **recorded** ([`ZeroedTail`], bdev_qcow2's header extension): the claim is on disk,
//!   so raising it writes and flushes the first sector before anything is written past
//!   the old `from`, whatever a crash keeps;
//! - **zeroed ahead** (`OpenOptions::zero_ahead`): nothing is on disk; the device between
//!   `from` and the device's end holds whatever it held, and raising the tail zeroes the
//!   device up to the new `from` first (a punched hole where the device's discard leaves
//!   zeros, `BlockDevice::discard_zeroes`; else a write-zeroes). It starts past every cluster in use at open, so
//!   it only ever zeroes clusters that nothing references.

use super::Owner;
use crate::error::Result;
use crate::format::header::ZeroedTail;
use crate::format::measure::prealloc_size;
use crate::io::{BlockDevice, BufSlice, IoBuffer, SECTOR};

/// The zeroed tail kept by the owner, if any.
#[derive(Clone, Copy)]
pub(crate) enum TailKeeper {
    /// No tail: only clusters past a growing device's end are fresh.
    None,
    /// The image's own claim, in the first sector where the header writer patches it.
    Recorded(ZeroedTail),
    /// Zeroed by this writer, up to (excluding) byte `from`; unknown past it.
    ZeroedAhead { from: u64 },
}

/// How a tail is raised (see the module doc).
pub(crate) enum Raise {
    /// Patch and write the first sector, then flush.
    Record(ZeroedTail),
    /// Zero the device from `from` to `to` (bytes).
    Zero { from: u64, to: u64 },
}

impl TailKeeper {
    /// The tail of `tail` as decoded at open, kept when it lies in the first sector.
    pub(crate) fn new(tail: Option<ZeroedTail>) -> Self {
        match tail.filter(|z| z.at + 8 <= SECTOR) {
            Some(z) => TailKeeper::Recorded(z),
            None => TailKeeper::None,
        }
    }
    /// A tail this writer zeroes ahead of the allocator, from byte `from` on.
    pub(crate) fn zeroed_ahead(from: u64) -> Self {
        TailKeeper::ZeroedAhead { from }
    }
    /// The recorded claim, if the image has one kept.
    pub(crate) fn recorded(&self) -> Option<ZeroedTail> {
        match self {
            TailKeeper::Recorded(z) => Some(*z),
            _ => None,
        }
    }
    /// Whether this writer zeroes the device ahead of the allocator.
    pub(crate) fn zeroes_ahead(&self) -> bool {
        matches!(self, TailKeeper::ZeroedAhead { .. })
    }
    /// Where the tail starts (bytes), if there is one.
    pub(crate) fn from(&self) -> Option<u64> {
        match self {
            TailKeeper::None => None,
            TailKeeper::Recorded(z) => Some(z.from),
            TailKeeper::ZeroedAhead { from } => Some(*from),
        }
    }
    /// The first cluster of the zeroed tail (`None`: no tail is kept): clusters below it
    /// may be written.
    #[inline]
    pub(crate) fn first_cluster(&self, cluster_bits: u32) -> Option<u64> {
        self.from().map(|f| f >> cluster_bits)
    }
    /// What raising the tail to `to` (bytes, past `from`) takes.
    pub(crate) fn raise_to(&self, to: u64) -> Option<Raise> {
        match *self {
            TailKeeper::None => None,
            TailKeeper::Recorded(z) => Some(Raise::Record(ZeroedTail { from: to, at: z.at })),
            TailKeeper::ZeroedAhead { from } => Some(Raise::Zero { from, to }),
        }
    }
    /// The tail starts at `from` now (on disk, for a recorded one).
    pub(crate) fn moved_to(&mut self, from: u64) {
        match self {
            TailKeeper::None => {}
            TailKeeper::Recorded(z) => z.from = from,
            TailKeeper::ZeroedAhead { from: f } => *f = from,
        }
    }
    /// The tail is given up (zeroing failed): nothing past `from` is known any more.
    pub(crate) fn drop_tail(&mut self) {
        *self = TailKeeper::None;
    }
}

/// The least step by which the zeroed tail is raised (see `raise_zeroed_tail`).
const ZEROED_TAIL_STEP_MIN: u64 = 1 << 20;
/// The most a tail zeroed ahead is raised by at once: one write-zeroes, which the
/// allocator waits for (NVMe may write the zeros).
const ZERO_AHEAD_STEP_MAX: u64 = 64 << 20;

impl<D: BlockDevice> Owner<'_, D> {
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
    /// most); punching, the first step reaches as far as the image fully allocated ends
    /// (never past the device's end). Caller holds the metadata lock.
    pub(crate) async fn raise_zeroed_tail(&self, end_cluster: u64) -> Result<()> {
        if self.below_zeroed_tail(end_cluster) {
            return Ok(());
        }
        let m = self.meta();
        let cs = self.geo.cluster_size();
        let bits = self.geo.cluster_bits;
        let dev_end = self.device_size.get().div_ceil(cs) * cs;
        let zeroing = m.st().tail.zeroes_ahead();
        let punch = zeroing && self.exec.with_device(self.dev, |d| d.discard_zeroes());
        let mut step = (dev_end / 64).max(ZEROED_TAIL_STEP_MIN);
        if zeroing {
            step = step.min(ZERO_AHEAD_STEP_MAX);
        }
        let mut from = ((end_cluster << bits) + step).div_ceil(cs) * cs;
        if punch {
            // A punch costs no space, but on ext4 it waits for every direct I/O in flight
            // on the file (`inode_dio_wait`: the queue drains once per punch). So the
            // first punch covers all the image can need without snapshots or bitmaps, and
            // no more: the device past it keeps its bytes (#48). Write Zeroes may move
            // data: bounded steps.
            from = from.max(self.fully_allocated_end());
        }
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
                    // A punched hole reads zeros and takes no space: the cheapest zeros.
                    let zeroed = if punch {
                        self.exec.discard(self.dev, old, to_dev - old).await
                    } else {
                        self.exec.write_zeroes(self.dev, old, to_dev - old).await
                    };
                    if let Err(e) = zeroed {
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

    /// Where the image ends fully allocated (bytes, whole clusters): header, tables,
    /// refcounts and every data cluster of its virtual size.
    fn fully_allocated_end(&self) -> u64 {
        let h = self.header.borrow();
        let cs = self.geo.cluster_size();
        let need = prealloc_size(
            h.header.size,
            cs,
            h.header.refcount_order,
            self.geo.extended_l2(),
        );
        need.div_ceil(cs) * cs
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
