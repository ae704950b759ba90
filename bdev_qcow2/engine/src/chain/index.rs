//! The layer index of a deep chain: for each unit of the guest disk, how far down the
//! backing layers a read of it may skip ([`LayerIndex`]), learnt as reads walk the chain.
//!
//! Only the backing layers (1 and below) are indexed: they are read-only, so what is learnt
//! about them stays true while the chain reads them (the top is writable and is always
//! asked first; a stream drops the backing layers as a whole, `Disk::detach_backing`, after
//! which the index is never asked again). A unit is the smallest allocation granule
//! ((sub)cluster) of any backing layer, so each backing layer maps a unit uniformly.
//!
//! An entry `k` says: layers `1..k` all leave the whole unit unallocated, and each covers
//! it (its size reaches the unit's end); a read of the unit may start at layer `k`. With
//! [`TERMINAL`], layer `k` is also where the walk ends (data, zeros, compressed, a raw
//! layer, the bottom, or a layer whose end falls in the unit): the read goes to layer `k`
//! and nowhere else. Entries only grow, so a stale read of one is merely less informed.

use super::disk::Layer;
use crate::io::BlockDevice;
use std::cell::{Cell, OnceCell};

/// Entry flag: the walk ends at the entry's layer.
const TERMINAL: u16 = 0x8000;

/// Units per chunk of entries (allocated on first record: 32 KiB of entries).
const CHUNK_BITS: u32 = 14;

/// Most chunks one index addresses (its chunk table: 1 MiB of empty cells at most); units
/// past them are not indexed (their reads walk).
const MAX_CHUNKS: u64 = 1 << 16;

/// Most chunks one index allocates, per chain and core: 64 MiB of entries (4 TiB of guest
/// disk read through the backing layers at 64 KiB clusters). Past it, reads walk.
const MAX_ALLOCATED_CHUNKS: usize = 2048;

/// Chains this shallow keep no index: their one backing layer is the walk.
const MIN_INDEXED_DEPTH: usize = 3;

/// The entries of `1 << CHUNK_BITS` units, allocated on the chunk's first record.
type Chunk = OnceCell<Box<[Cell<u16>]>>;

/// What the index knows of one unit ([`LayerIndex::get`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Known {
    /// A read of the unit goes to this layer alone.
    Ends(usize),
    /// A read of the unit may start its walk at this layer (1: nothing known yet).
    From(usize),
}

/// Which backing layer a read of each guest unit goes to (see the module docs).
pub(crate) struct LayerIndex {
    unit_bits: u32,
    chunks: Box<[Chunk]>,
    allocated: Cell<usize>,
}

impl LayerIndex {
    /// The index of a chain of `layers` (top first) whose guest disk is `size` bytes;
    /// `None` when the chain is too shallow to need one.
    pub(crate) fn new<D: BlockDevice>(layers: &[Layer<D>], size: u64) -> Option<Self> {
        if layers.len() < MIN_INDEXED_DEPTH {
            return None;
        }
        let unit_bits = layers[1..]
            .iter()
            .filter_map(|l| match l {
                Layer::Qcow2(q) => Some(q.geometry().subcluster_size().ilog2()),
                Layer::Raw { .. } => None,
            })
            .min()?;
        let units = size.div_ceil(1 << unit_bits);
        let chunks = units.div_ceil(1 << CHUNK_BITS).min(MAX_CHUNKS) as usize;
        Some(LayerIndex {
            unit_bits,
            chunks: (0..chunks).map(|_| OnceCell::new()).collect(),
            allocated: Cell::new(0),
        })
    }

    /// The guest offset where the unit holding `off` ends.
    #[inline(always)]
    pub(crate) fn unit_end(&self, off: u64) -> u64 {
        ((off >> self.unit_bits) + 1) << self.unit_bits
    }

    /// The entry cell of the unit holding `off`, if its chunk exists.
    #[inline(always)]
    fn cell(&self, off: u64) -> Option<&Cell<u16>> {
        let unit = off >> self.unit_bits;
        let chunk = self.chunks.get((unit >> CHUNK_BITS) as usize)?.get()?;
        chunk.get((unit & ((1 << CHUNK_BITS) - 1)) as usize)
    }

    /// What is known of the unit holding `off`.
    #[inline(always)]
    pub(crate) fn get(&self, off: u64) -> Known {
        match self.cell(off).map_or(0, Cell::get) {
            e if e & TERMINAL != 0 => Known::Ends((e & !TERMINAL) as usize),
            e => Known::From((e as usize).max(1)),
        }
    }

    /// Learns that a read of the unit holding `off` may start at layer `layer`, and ends
    /// there when `ends`. Never lowers what is known; allocates the unit's chunk on its
    /// first record (while under the memory bound; otherwise nothing is recorded).
    pub(crate) fn record(&self, off: u64, layer: usize, ends: bool) {
        let Ok(l) = u16::try_from(layer) else {
            return;
        };
        if l >= TERMINAL {
            return;
        }
        let e = if ends { l | TERMINAL } else { l };
        let unit = off >> self.unit_bits;
        let Some(slot) = self.chunks.get((unit >> CHUNK_BITS) as usize) else {
            return;
        };
        let chunk = match slot.get() {
            Some(c) => c,
            None if self.allocated.get() < MAX_ALLOCATED_CHUNKS => {
                self.allocated.set(self.allocated.get() + 1);
                slot.get_or_init(|| (0..1 << CHUNK_BITS).map(|_| Cell::new(0)).collect())
            }
            None => return,
        };
        let cell = &chunk[(unit & ((1 << CHUNK_BITS) - 1)) as usize];
        let old = cell.get();
        if old & TERMINAL == 0 && (ends || l > old) {
            cell.set(e);
        }
    }

    /// Bytes of entries allocated so far.
    pub(crate) fn bytes(&self) -> usize {
        self.allocated.get() << (CHUNK_BITS + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index(unit_bits: u32, chunks: usize) -> LayerIndex {
        LayerIndex {
            unit_bits,
            chunks: (0..chunks).map(|_| OnceCell::new()).collect(),
            allocated: Cell::new(0),
        }
    }

    #[test]
    fn entries_only_grow() {
        let ix = index(16, 2);
        assert_eq!(ix.get(5 << 16), Known::From(1));
        ix.record(5 << 16, 7, false);
        assert_eq!(ix.get((5 << 16) + 100), Known::From(7));
        ix.record(5 << 16, 3, false);
        assert_eq!(ix.get(5 << 16), Known::From(7));
        ix.record(5 << 16, 900, true);
        assert_eq!(ix.get(5 << 16), Known::Ends(900));
        ix.record(5 << 16, 1000, true);
        assert_eq!(ix.get(5 << 16), Known::Ends(900));
        assert_eq!(ix.get(6 << 16), Known::From(1));
        assert_eq!(ix.bytes(), 32 << 10);
    }

    #[test]
    fn past_the_table_nothing_is_known() {
        let ix = index(9, 1);
        let past = 1u64 << (9 + CHUNK_BITS);
        ix.record(past, 4, true);
        assert_eq!(ix.get(past), Known::From(1));
        assert_eq!(ix.unit_end(past + 1), past + 512);
    }
}
