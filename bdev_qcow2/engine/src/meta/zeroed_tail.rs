//! The zeroed tail as this writer keeps it: past `from` the device reads as zeros, and
//! clusters there are fresh (a first write into one writes the guest's bytes alone).
//!
//! Two kinds, one rule for the allocator (nothing is taken at or past `from` before the
//! tail is raised past it):
//! - **recorded** ([`ZeroedTail`], bdev_qcow2's header extension): the claim is on disk,
//!   so raising it writes and flushes the first sector before anything is written past
//!   the old `from`, whatever a crash keeps;
//! - **zeroed ahead** (`OpenOptions::zero_ahead`): nothing is on disk; the device between
//!   `from` and the device's end holds whatever it held, and raising the tail zeroes the
//!   device up to the new `from` first. It starts past every cluster in use at open, so
//!   it only ever zeroes clusters that nothing references.

use crate::format::header::ZeroedTail;
use crate::io::SECTOR;

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
