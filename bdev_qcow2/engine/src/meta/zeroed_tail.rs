//! The zeroed tail as this writer keeps it ([`ZeroedTail`]): past `from` the device reads
//! as zeros.
//!
//! Invariant: nothing is written at or past `from` before `from` is raised past it on disk
//! (the header writer's sector written and flushed), whatever a crash keeps.

use crate::format::header::ZeroedTail;
use crate::io::SECTOR;

/// The zeroed tail kept by the owner, if the image has one it can keep (recorded in the
/// first sector, where the header writer patches it).
#[derive(Clone, Copy)]
pub(crate) struct TailKeeper(Option<ZeroedTail>);

impl TailKeeper {
    /// The tail of `tail` as decoded at open, kept when it lies in the first sector.
    pub(crate) fn new(tail: Option<ZeroedTail>) -> Self {
        TailKeeper(tail.filter(|z| z.at + 8 <= SECTOR))
    }
    /// The tail as on disk, if kept.
    pub(crate) fn get(&self) -> Option<ZeroedTail> {
        self.0
    }
    /// The first cluster of the zeroed tail (`None`: no tail is kept): clusters below it
    /// may be written.
    #[inline]
    pub(crate) fn first_cluster(&self, cluster_bits: u32) -> Option<u64> {
        self.0.map(|z| z.from >> cluster_bits)
    }
    /// The tail on disk starts at `from` now.
    pub(crate) fn moved_to(&mut self, from: u64) {
        if let Some(z) = self.0.as_mut() {
            z.from = from;
        }
    }
}
