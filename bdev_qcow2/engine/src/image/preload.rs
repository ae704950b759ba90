//! A slice loaded without a task ([`Chain`](crate::Chain)'s slice loads, `slice_load.rs`):
//! the decisions of [`Qcow2::load_slice`] before and after its device read, so that the
//! read itself can go out as the engine's own request into a preallocated buffer. The
//! same rules: the owner's dirty copy wins over the device; a core replica keeps what it
//! read only if the slot's epoch did not move meanwhile (ARCHITECTURE.md §6), and asks the
//! owner (a task) for a slice the owner holds dirty.

use super::{be_words, Qcow2};
use crate::coherency::SliceStamp;
use crate::io::BlockDevice;
use crate::types::GuestOffset;

/// What loading the slice covering an offset takes ([`Qcow2::preload_begin`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Preload {
    /// Nothing: it is cached under the current epoch, or there is no L2 table there (it
    /// reads as unallocated).
    Nothing,
    /// Read the slice's bytes at `host` of the image's device, then
    /// [`preload_end`](Qcow2::preload_end) with `stamp`.
    Read {
        /// Device offset of the slice.
        host: u64,
        /// What the copy is taken under.
        stamp: SliceStamp,
    },
    /// Not without a task: the owner holds it dirty (a core asks for its copy by message;
    /// on the owner the copy is taken from its dirty state), or the L1 entry is corrupt
    /// (the task reports it).
    Task,
}

impl<D: BlockDevice> Qcow2<D> {
    /// Bytes of one L2 slice: what a slice load reads.
    pub(crate) fn slice_bytes(&self) -> usize {
        1 << self.geo.slice_bits
    }

    /// The image's device.
    pub(crate) fn device(&self) -> crate::exec::DevId {
        self.dev
    }

    /// How to load the slice covering `off` (see [`Preload`]).
    pub(crate) fn preload_begin(&self, off: GuestOffset) -> Preload {
        let key = self.geo.slice_id(off);
        if self.slice_is_current(off) {
            return Preload::Nothing;
        }
        let stamp = match self.core_shared() {
            Some(sh) => {
                let stamp = sh.stamp(key);
                if stamp.epoch() & 1 == 1 {
                    return Preload::Task;
                }
                stamp
            }
            None => SliceStamp::OWNER,
        };
        let l2 = match self.l2_table(off) {
            Ok(Some(l2)) => l2,
            Ok(None) => return Preload::Nothing,
            Err(_) => return Preload::Task,
        };
        if self
            .meta_state()
            .is_some_and(|m| m.st().dirty.has_slice(key))
        {
            return Preload::Task;
        }
        Preload::Read {
            host: self.geo.slice_host_offset(l2, off).0,
            stamp,
        }
    }

    /// The slice covering `off` was read (`raw`, its bytes on the device) as
    /// [`preload_begin`](Self::preload_begin) said, under `stamp`: caches it. False when a
    /// core's copy is stale (the slot's epoch moved meanwhile) and nothing was cached.
    /// A copy cached meanwhile (by a task) is kept: it is at least as new.
    pub(crate) fn preload_end(&self, off: GuestOffset, stamp: SliceStamp, raw: &[u8]) -> bool {
        let key = self.geo.slice_id(off);
        if let Some(sh) = self.core_shared() {
            // An unchanged epoch means no removal either (a removal moves both).
            if sh.epoch(key) != stamp.epoch() {
                return false;
            }
            if !self.slice_is_current(off) {
                // Entries may point where the owner grew the device before it wrote them.
                self.sync_core();
                self.cache_slice_carrying(key, stamp, be_words(raw));
            }
            return true;
        }
        if self.slice_is_current(off) {
            return true;
        }
        // A write-back may have dirtied it meanwhile: the dirty copy wins.
        if let Some(words) = self.meta_state().and_then(|m| m.dirty_slice(key)) {
            self.cache_slice(key, SliceStamp::OWNER, |b| b.copy_from_slice(&words));
            return true;
        }
        self.cache_slice(key, SliceStamp::OWNER, |block| {
            for (dst, w) in block.iter_mut().zip(be_words(raw)) {
                *dst = w;
            }
        });
        true
    }
}
