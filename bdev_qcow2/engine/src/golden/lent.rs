//! A claimed slot's memory lent to the host, so that a fill reads the granule from the
//! golden image straight into the slot (one copy fewer than reading into a buffer of its
//! own and storing that).
//!
//! The loan carries the slot's [`Exclusive`]: while it lives, nothing else reads or writes
//! the slot's bytes (no reader pins a slot being filled, no claim takes it), so the host's
//! device may write them. [`publish`](LentGranule::publish) consumes it, so no write can
//! follow the publish; dropped unpublished (the read failed, or a handle of it was still
//! about), the slot is empty again, as a dropped [`Fill`] leaves it.

use super::cache::Fill;
use super::memory::{Exclusive, GranuleMemory};

/// A slot being filled, its memory lent out ([`Fill::lend`]).
#[derive(Debug)]
#[must_use = "a lent granule must be published or dropped"]
pub struct LentGranule {
    fill: Fill,
    proof: Exclusive,
}

impl Fill {
    /// Lends the slot's memory for the host to read the granule into in place; publish it
    /// with [`LentGranule::publish`] once every byte is there.
    pub fn lend(self) -> LentGranule {
        LentGranule {
            fill: self,
            // Claimed with no pin on it, not yet published: this fill alone touches it.
            proof: Exclusive::new(),
        }
    }
}

impl LentGranule {
    /// The slot's memory and the proof that only the holder touches it.
    pub fn memory(&self) -> (&dyn GranuleMemory, &Exclusive) {
        (self.fill.memory(), &self.proof)
    }

    /// The granule being filled.
    pub fn granule(&self) -> u64 {
        self.fill.granule()
    }

    /// Where the granule is on the device (byte offset) and its length.
    pub fn device_range(&self) -> (u64, usize) {
        self.fill.device_range()
    }

    /// The fill back, its memory no longer lent (the host cannot read into it).
    pub fn into_fill(self) -> Fill {
        self.fill
    }

    /// Makes the granule ready for every reader: the host wrote all of its bytes.
    pub fn publish(self) {
        // The writes are over: the proof ends here, before the publish's release.
        let LentGranule { fill, proof: _ } = self;
        fill.publish_stored(true);
    }
}
