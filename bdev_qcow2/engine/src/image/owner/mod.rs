//! The metadata owner's operations: allocation, refcounts, L2 tables, deferred frees, the
//! header and the ordered write-back ([`writeback`], ARCHITECTURE.md §7).
//!
//! They are methods of [`Owner`], a view of an image open for writing together with its
//! owner state ([`Meta`]): obtained once, at an entry point, by [`Qcow2::owner`] (which
//! fails with `ReadOnly` on a read-only image or a core replica), so that an operation that
//! needs the owner cannot be called without one. The state itself lives in
//! [`crate::meta`], below the image; these operations build on the image (`Owner`
//! dereferences to it; a child module of the image, they reach its private fields), and
//! nothing below calls them.
//!
//! - [`alloc`]: host clusters for data and metadata, data regions;
//! - [`bitmaps`]: persistent dirty bitmaps, loaded at open and stored at close;
//! - [`refcount`]: refcount changes, new refcount blocks, a larger refcount table;
//! - [`l2`]: dirty L2 slices, new or copied L2 tables;
//! - [`frees`]: frees after the metadata that removed a reference is stable;
//! - [`header`]: the corrupt and dirty bits, the zeroed tail;
//! - [`resize`]: growing and shrinking the virtual disk;
//! - [`shadow`]: changes of refcounts and active tables switched by one header write;
//! - [`snapshot`]: internal snapshots (create, delete, apply);
//! - [`stream`]: dropping the backing reference after a stream;
//! - [`writeback`]: the ordered write-back, flush and close.

pub(crate) mod alloc;
pub(crate) mod bitmaps;
pub(crate) mod frees;
pub(crate) mod header;
pub(crate) mod l2;
pub(crate) mod refcount;
pub(crate) mod resize;
pub(crate) mod shadow;
pub(crate) mod snapshot;
pub(crate) mod stream;
pub(crate) mod writeback;

use crate::error::{Error, Result};
use crate::image::Qcow2;
use crate::io::BlockDevice;
use crate::meta::Meta;

/// An image in its role of metadata owner: the image and its owner state (see the module
/// doc). Copied freely (two references).
pub(crate) struct Owner<'a, D: BlockDevice> {
    q: &'a Qcow2<D>,
    m: &'a Meta<D>,
}

impl<D: BlockDevice> Clone for Owner<'_, D> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<D: BlockDevice> Copy for Owner<'_, D> {}

impl<'a, D: BlockDevice> std::ops::Deref for Owner<'a, D> {
    type Target = Qcow2<D>;
    #[inline]
    fn deref(&self) -> &Qcow2<D> {
        self.q
    }
}

impl<'a, D: BlockDevice> Owner<'a, D> {
    /// The owner state.
    #[inline]
    pub(crate) fn meta(&self) -> &'a Meta<D> {
        self.m
    }
}

impl<D: BlockDevice> Qcow2<D> {
    /// This image as the metadata owner, or `ReadOnly` (opened read-only, or a core
    /// replica: its writes that change metadata go to the owner).
    #[inline]
    pub(crate) fn owner(&self) -> Result<Owner<'_, D>> {
        match self.meta_state() {
            Some(m) => Ok(Owner { q: self, m }),
            None => Err(Error::ReadOnly),
        }
    }

    /// Whether the owner should write its dirty metadata back now without a guest flush
    /// (see [`Owner::background_writeback_due`]); false unless this is the owner.
    pub fn background_writeback_due(&self) -> bool {
        self.owner().is_ok_and(|o| o.background_writeback_due())
    }

    /// Whether dirty L2 or L1 metadata waits for a background write-back (the owner's poll
    /// loop must keep asking [`background_writeback_due`](Self::background_writeback_due)
    /// while it does); false unless this is the owner.
    pub fn background_writeback_pending(&self) -> bool {
        self.owner().is_ok_and(|o| o.background_writeback_pending())
    }

    /// Writes the dirty metadata back in dependency order without flushing the device
    /// (see [`Owner::background_writeback`]); `ReadOnly` unless this is the owner.
    pub async fn background_writeback(&self) -> Result<()> {
        self.owner()?.background_writeback().await
    }

    /// Writes everything back (refcounts included, even with lazy refcounts), clears the
    /// dirty bit and flushes: the image is clean on disk when this returns. `ReadOnly`
    /// unless this is the owner.
    pub async fn close(&self) -> Result<()> {
        self.owner()?.close().await
    }

    /// Resizes the virtual disk to `new_size` bytes (see [`Owner::resize`]; shrinking
    /// needs `shrink` and an empty cut-off range) and returns the old size. Prefer
    /// [`Chain::resize`](crate::Chain::resize), which also keeps the chain's size and a
    /// backing image's data out of the new range. `ReadOnly` unless this is the owner.
    pub async fn resize(&self, new_size: u64, shrink: bool) -> Result<u64> {
        self.owner()?.resize(new_size, shrink).await
    }

    /// Creates internal snapshot `name` (see [`Owner::snapshot_create`]); returns its
    /// table entry. `ReadOnly` unless this is the owner.
    pub async fn snapshot_create(
        &self,
        name: &str,
        when: snapshot::SnapshotTime,
    ) -> Result<crate::format::Snapshot> {
        self.owner()?.snapshot_create(name, when).await
    }

    /// Deletes the internal snapshot with id or name `which`; returns its table entry.
    /// `ReadOnly` unless this is the owner.
    pub async fn snapshot_delete(&self, which: &str) -> Result<crate::format::Snapshot> {
        self.owner()?.snapshot_delete(which).await
    }

    /// Makes the internal snapshot with id or name `which` the active disk (offline only).
    /// Prefer [`Chain::snapshot_apply`](crate::Chain::snapshot_apply), which keeps the
    /// chain's size. `ReadOnly` unless this is the owner.
    pub async fn snapshot_apply(&self, which: &str) -> Result<()> {
        self.owner()?.snapshot_apply(which).await
    }

    /// The persistent bitmaps this owner keeps up to date (loaded at open): each one's name
    /// and whether it is enabled (records writes). Empty on a read-only image or a core.
    pub fn kept_bitmaps(&self) -> Vec<(String, bool)> {
        let Ok(o) = self.owner() else {
            return Vec::new();
        };
        let st = o.meta().st();
        st.bitmaps.as_ref().map_or_else(Vec::new, |k| {
            k.loaded
                .iter()
                .map(|l| {
                    let e = &k.entries[l.entry];
                    (e.name.clone(), e.auto())
                })
                .collect()
        })
    }

    /// Guest flush: every write completed before it is stable when this returns.
    /// `ReadOnly` unless this is the owner.
    pub async fn flush(&self) -> Result<()> {
        self.owner()?.flush().await
    }
}

/// Big-endian bytes of table words `words` into `out`.
pub(crate) fn words_to_bytes(words: &[u64], out: &mut [u8]) {
    for (c, w) in out.chunks_exact_mut(8).zip(words) {
        c.copy_from_slice(&w.to_be_bytes());
    }
}
