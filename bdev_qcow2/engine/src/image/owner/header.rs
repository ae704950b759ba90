//! The owner's copies of the image's first sector: the one it changes and the one last
//! written, and whether the dirty bit it set is on disk.
//!
//! Invariant: every header change goes through the copy here, by the format's setters
//! ([`HeaderSector`]), and reaches the device only as a whole sector; `on_disk` is always
//! what the last write put there, so a write of it alone (raising the zeroed tail) changes
//! nothing else.
//!
//! The header on the owner: the corrupt bit and the dirty bit (lazy refcounts), each
//! written as the first sector whole through the copy here (the zeroed tail, written the
//! same way: `zeroed_tail.rs`).
//!
//! Invariant: the dirty bit is set and stable before metadata that relies on it reaches
//! the device.

use super::Owner;
use crate::error::{corrupt, Error, Field, Result};
use crate::format::header::{BitmapsExt, ZeroedTail};
use crate::format::HeaderSector;
use crate::io::{BlockDevice, BufSlice, IoBuffer, SECTOR};

/// The header writer's state (see the module doc).
pub(crate) struct HeaderCopies {
    /// The first sector as the owner wants it on disk.
    sector0: HeaderSector,
    /// Whether `sector0` must be written.
    dirty: bool,
    /// `sector0` as last written.
    on_disk: HeaderSector,
    /// Whether the owner set the dirty bit on disk (lazy refcounts) and must clear it.
    dirty_bit_on_disk: bool,
}

impl HeaderCopies {
    /// The copies at open, from cluster 0 `c0` as read.
    pub(crate) fn new(c0: &[u8]) -> Self {
        let sector0 = HeaderSector::from_cluster0(c0);
        HeaderCopies {
            on_disk: sector0.clone(),
            sector0,
            dirty: false,
            dirty_bit_on_disk: false,
        }
    }

    /// Whether the header copy must be written.
    pub(crate) fn is_dirty(&self) -> bool {
        self.dirty
    }
    /// The sector to write now: it is the one on disk once written.
    pub(crate) fn take_for_write(&mut self) -> Vec<u8> {
        self.dirty = false;
        self.on_disk = self.sector0.clone();
        self.sector0.bytes().to_vec()
    }

    /// The corrupt bit set (version 3: a version 2 header has no feature bits); returns
    /// the sector to write at once.
    pub(crate) fn mark_corrupt(&mut self) -> Vec<u8> {
        self.sector0.set_corrupt();
        self.on_disk = self.sector0.clone();
        self.sector0.bytes().to_vec()
    }

    /// Whether the dirty bit the owner set is on disk.
    pub(crate) fn dirty_bit_on_disk(&self) -> bool {
        self.dirty_bit_on_disk
    }
    /// Sets the dirty bit in the copy, to be written and flushed before metadata that
    /// relies on it ([`dirty_bit_written`](Self::dirty_bit_written) then).
    pub(crate) fn set_dirty_bit(&mut self) {
        self.sector0.set_dirty(true);
    }
    /// The dirty bit is stable on disk.
    pub(crate) fn dirty_bit_written(&mut self) {
        self.dirty_bit_on_disk = true;
    }
    /// Every refcount is stable: the dirty bit goes (the header is dirty).
    pub(crate) fn clear_dirty_bit(&mut self) {
        self.sector0.set_dirty(false);
        self.dirty = true;
        self.dirty_bit_on_disk = false;
    }

    /// The refcount table moved to `offset`, `clusters` long (the header is dirty).
    pub(crate) fn set_refcount_table(&mut self, offset: u64, clusters: u32) {
        self.sector0.set_refcount_table(offset, clusters);
        self.dirty = true;
    }

    /// The L1 table moved to `offset`, `size` entries long (the header is dirty).
    pub(crate) fn set_l1_table(&mut self, offset: u64, size: u32) {
        self.sector0.set_l1_table(offset, size);
        self.dirty = true;
    }

    /// The virtual disk size is `bytes` (the header is dirty).
    pub(crate) fn set_size(&mut self, bytes: u64) {
        self.sector0.set_size(bytes);
        self.dirty = true;
    }

    /// The snapshot table moved to `offset` and holds `count` snapshots (the header is
    /// dirty).
    pub(crate) fn set_snapshot_table(&mut self, offset: u64, count: u32) {
        self.sector0.set_snapshot_table(offset, count);
        self.dirty = true;
    }

    /// The backing file reference dropped (see [`HeaderSector::clear_backing`]; `rest` is
    /// cluster 0 past the first sector as on disk); returns whether the backing format
    /// extension went too. The header is dirty.
    pub(crate) fn clear_backing(&mut self, rest: &[u8]) -> bool {
        self.dirty = true;
        self.sector0.clear_backing(rest)
    }

    /// Whether the bitmaps extension `ext` would fit (see
    /// [`HeaderSector::set_bitmaps_ext`]; `rest` is cluster 0 past the first sector).
    pub(crate) fn bitmaps_ext_fits(
        &self,
        rest: &[u8],
        ext: Option<&BitmapsExt>,
    ) -> std::result::Result<(), &'static str> {
        self.sector0.clone().set_bitmaps_ext(rest, ext)
    }
    /// The bitmaps extension becomes `ext` (see [`HeaderSector::set_bitmaps_ext`]); the
    /// header is dirty. Returns where the backing file name is now.
    pub(crate) fn set_bitmaps_ext(
        &mut self,
        rest: &[u8],
        ext: Option<&BitmapsExt>,
    ) -> std::result::Result<u64, &'static str> {
        self.sector0.set_bitmaps_ext(rest, ext)?;
        self.dirty = true;
        Ok(self.sector0.backing_file_offset())
    }

    /// The zeroed tail raised to `tail`: in the copy and in the one on disk, which is
    /// returned to be written alone.
    pub(crate) fn raise_zeroed_tail(&mut self, tail: ZeroedTail) -> Vec<u8> {
        self.sector0.set_zeroed_tail(tail);
        self.on_disk.set_zeroed_tail(tail);
        self.on_disk.bytes().to_vec()
    }
    /// The zeroed tail lowered to `tail` (the header is dirty).
    pub(crate) fn lower_zeroed_tail(&mut self, tail: ZeroedTail) {
        self.sector0.set_zeroed_tail(tail);
        self.dirty = true;
    }
}

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

    /// Cluster 0 past its first sector, as on disk (the extension list may run into it).
    pub(crate) async fn header_rest(&self) -> Result<Vec<u8>> {
        let cs = self.geo.cluster_size() as usize;
        let buf = self.exec.alloc_buf(self.dev, cs);
        self.exec
            .read(self.dev, 0, BufSlice::whole(buf.clone()))
            .await?;
        let mut c0 = vec![0u8; cs];
        buf.copy_out(0, &mut c0);
        Ok(c0.split_off(SECTOR as usize))
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
}
