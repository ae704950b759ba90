//! Persistent dirty bitmaps on the owner (its record of them while the image is open for
//! writing, [`KeptBitmaps`]: the directory as on disk, and for each bitmap it loaded, where
//! its table and data were), kept as QEMU keeps them: loaded when the image opens for
//! writing and marked `in_use` on disk before any guest write, recorded in memory by every
//! core ([`DirtyBitmaps`]), stored at a clean close with `in_use` cleared.
//! An image that was not closed keeps `in_use`: QEMU then treats the bitmap as
//! inconsistent (a backup that relies on it refuses, instead of missing data).
//!
//! Bitmaps already `in_use` at open are left as they are. Disabled bitmaps (no `auto`
//! flag) record nothing, but are loaded and stored too: their size follows the disk's.
//!
//! Store order (a crash at any point leaves a consistent image, bitmaps at worst `in_use`):
//! 1. new data clusters and a new table for each bitmap that changed, written, and their
//!    refcounts written and flushed (the write-back);
//! 2. the directory's entries take the new tables, still `in_use`; flushed;
//! 3. the `in_use` flags go (each a 4-byte field: one sector write cannot tear it);
//!    flushed;
//! 4. the old tables and data are freed.
//!
//! Invariant: `dir` is the directory as last written; every bitmap it loaded has its
//! `in_use` flag set there until the owner stored it.

use super::discards::FreeKind;
use super::Owner;
use crate::dirty_bitmaps::{self, Bits, DirtyBitmaps};
use crate::error::{corrupt, invalid, Error, Field, Result};
use crate::exec::read_bytes;
use crate::format::be::get_u64;
use crate::format::bitmaps::{
    self, data_bytes, BitmapEntry, FLAG_IN_USE, TABLE_ALL_ONES, TABLE_OFFSET_MASK,
};
use crate::io::{BlockDevice, BufSlice, IoBuffer, SECTOR};
use crate::limits::MAX_BITMAP_MEMORY;
use crate::types::{HostOffset, HostRange};
use std::sync::Arc;

/// A bitmap the owner loaded (or added).
pub(crate) struct Loaded {
    /// Its entry in [`KeptBitmaps::entries`].
    pub(crate) entry: usize,
    /// Its slot in [`KeptBitmaps::bits`].
    pub(crate) slot: usize,
    /// The host clusters its data was in when loaded (or last stored).
    pub(crate) data_clusters: Vec<u64>,
}

/// The image's persistent bitmaps (see the module doc); kept by the owner of every
/// version 3 image open for writing, with none (so that bitmaps can be added).
pub(crate) struct KeptBitmaps {
    /// Host offset of the directory (0: none).
    pub(crate) dir_offset: u64,
    /// The directory's bytes (its size in the header extension).
    pub(crate) dir: Vec<u8>,
    /// Its entries (positions, tables and flags as in `dir`).
    pub(crate) entries: Vec<BitmapEntry>,
    /// The bitmaps loaded, in the order of `bits`.
    pub(crate) loaded: Vec<Loaded>,
    /// Their bits, shared with every core.
    pub(crate) bits: Arc<DirtyBitmaps>,
}

impl KeptBitmaps {
    /// The names of the loaded bitmaps that record guest writes.
    pub(crate) fn enabled_names(&self) -> Vec<String> {
        self.loaded
            .iter()
            .filter(|l| self.entries[l.entry].auto())
            .map(|l| self.entries[l.entry].name.clone())
            .collect()
    }
}

impl<D: BlockDevice> Owner<'_, D> {
    /// At open for writing: loads every bitmap not already `in_use`, and marks them
    /// `in_use` on disk (flushed) before the image takes any write. `None` for a version 2
    /// image (which cannot have any). A directory or table QEMU would refuse is an error.
    pub(crate) async fn load_bitmaps(&self) -> Result<Option<Arc<DirtyBitmaps>>> {
        if self.header.borrow().header.version < 3 {
            return Ok(None);
        }
        let Some(ext) = self.header.borrow().extensions.bitmaps.clone() else {
            return Ok(Some(self.keep_bitmaps(KeptBitmaps {
                dir_offset: 0,
                dir: Vec::new(),
                entries: Vec::new(),
                loaded: Vec::new(),
                bits: Arc::new(DirtyBitmaps::new(Vec::new())),
            })));
        };
        let cs = self.geo.cluster_size();
        if ext.directory_offset.saturating_add(ext.directory_size) > self.device_size.get() {
            return Err(invalid(
                Field::BitmapsExtension,
                ext.directory_offset,
                "bitmap directory extends past the end of the device",
            ));
        }
        let mut dir = read_bytes(
            &self.exec,
            self.dev,
            ext.directory_offset,
            ext.directory_size,
        )
        .await?;
        let mut entries = bitmaps::parse_directory(&dir, ext.nb_bitmaps, cs, self.size())
            .map_err(|why| invalid(Field::BitmapsExtension, ext.directory_offset, why))?;
        let size = self.size();
        let memory: u64 = entries
            .iter()
            .filter(|e| !e.in_use())
            .map(|e| dirty_bitmaps::memory_for(size.div_ceil(1 << e.granularity_bits)))
            .sum();
        if memory > MAX_BITMAP_MEMORY {
            return Err(too_much_memory(memory));
        }
        // What a store rewrites or frees must be the bitmaps' own: the directory's clusters
        // and each table's and data cluster, referenced once (a hostile image could name an
        // L2 table, or one cluster twice).
        let bits_c = self.geo.cluster_bits;
        let mut owned = super::HashSet::default();
        let dir_clusters = ext.directory_offset >> bits_c
            ..(ext.directory_offset + ext.directory_size).div_ceil(cs);
        self.own(&mut owned, dir_clusters).await?;
        let mut loaded = Vec::new();
        let mut bits = Vec::new();
        for (i, e) in entries.iter().enumerate().filter(|(_, e)| !e.in_use()) {
            let (data, data_clusters) = self.read_bitmap(e).await?;
            let table = e.table_offset >> bits_c
                ..(e.table_offset + u64::from(e.table_size) * 8).div_ceil(cs);
            self.own(&mut owned, table.chain(data_clusters.iter().copied()))
                .await?;
            let granules = size.div_ceil(1 << e.granularity_bits);
            bits.push(Bits::new(e.granularity_bits, &data, granules, e.auto()));
            loaded.push(Loaded {
                entry: i,
                slot: loaded.len(),
                data_clusters,
            });
        }
        for l in &loaded {
            let e = &mut entries[l.entry];
            e.flags |= FLAG_IN_USE;
            bitmaps::set_flags(&mut dir, e, e.flags);
        }
        if !loaded.is_empty() {
            // Written back in whole sectors, inside its clusters: a file QEMU left ending
            // inside them grows to cover them.
            let dir_end = ext.directory_offset + ext.directory_size.div_ceil(SECTOR) * SECTOR;
            if dir_end > self.device_size.get() {
                self.note_allocated(dir_end.div_ceil(cs))?;
            }
            self.write_directory(ext.directory_offset, &dir).await?;
            self.exec.flush(self.dev).await?;
        }
        Ok(Some(self.keep_bitmaps(KeptBitmaps {
            dir_offset: ext.directory_offset,
            dir,
            entries,
            loaded,
            bits: Arc::new(DirtyBitmaps::new(bits)),
        })))
    }

    /// The owner keeps `kept`; returns the bits every core shares.
    fn keep_bitmaps(&self, kept: KeptBitmaps) -> Arc<DirtyBitmaps> {
        let bits = kept.bits.clone();
        self.meta().st_mut().bitmaps = Some(kept);
        bits
    }
}

impl<D: BlockDevice> crate::image::Qcow2<D> {
    /// Bitmap `e`'s data for the disk's size (the clusters of the table entries the disk
    /// needs: fewer than the table has when the disk shrank) and every host cluster its
    /// table names (all freed when a new table replaces it).
    pub(crate) async fn read_bitmap(&self, e: &BitmapEntry) -> Result<(Vec<u8>, Vec<u64>)> {
        let cs = self.geo.cluster_size();
        let dev_size = self.device_size.get();
        let needed = data_bytes(self.size(), e.granularity_bits).div_ceil(cs);
        let table_bytes = u64::from(e.table_size) * 8;
        if e.table_offset.saturating_add(table_bytes) > dev_size {
            return Err(invalid(
                Field::BitmapsExtension,
                e.table_offset,
                "bitmap table extends past the end of the device",
            ));
        }
        let table = read_bytes(&self.exec, self.dev, e.table_offset, table_bytes).await?;
        let mut data = Vec::with_capacity((needed * cs) as usize);
        let mut clusters = Vec::new();
        for (i, t) in table.chunks_exact(8).map(|w| get_u64(w, 0)).enumerate() {
            if !bitmaps::table_entry_ok(t, cs) {
                return Err(invalid(
                    Field::BitmapsExtension,
                    t,
                    "invalid bitmap table entry",
                ));
            }
            let off = t & TABLE_OFFSET_MASK;
            if off >= dev_size {
                return Err(invalid(
                    Field::BitmapsExtension,
                    off,
                    "bitmap data past the end of the device",
                ));
            }
            if off != 0 {
                clusters.push(off >> self.geo.cluster_bits);
            }
            if i as u64 >= needed {
                continue;
            }
            if off == 0 {
                let fill = if t & TABLE_ALL_ONES != 0 { 0xff } else { 0 };
                data.resize(data.len() + cs as usize, fill);
                continue;
            }
            // A file may end inside the last cluster: the rest reads as zeros.
            let mut c = read_bytes(&self.exec, self.dev, off, cs.min(dev_size - off)).await?;
            c.resize(cs as usize, 0);
            data.extend(c);
        }
        Ok((data, clusters))
    }
}

impl<D: BlockDevice> Owner<'_, D> {
    /// Adds `clusters` to `owned`, each of which must be a bitmap's alone: not in `owned`
    /// yet, not the image's other metadata, refcount 1.
    pub(crate) async fn own(
        &self,
        owned: &mut super::HashSet<u64>,
        clusters: impl Iterator<Item = u64>,
    ) -> Result<()> {
        let (bits, cs) = (self.geo.cluster_bits, self.geo.cluster_size());
        for c in clusters {
            let off = c << bits;
            if !owned.insert(c)
                || self.overlaps_metadata(HostOffset(off), cs)
                || self.refcount(off).await? != 1
            {
                return Err(corrupt(
                    Field::BitmapsExtension,
                    off,
                    "a bitmap cluster is shared with other data or metadata; run \
                     `qcow2 check -r all` or remove the bitmap",
                ));
            }
        }
        Ok(())
    }

    /// Writes the directory `dir` at `offset`, zeros to its last sector's end.
    pub(crate) async fn write_directory(&self, offset: u64, dir: &[u8]) -> Result<()> {
        let len = (dir.len() as u64).div_ceil(SECTOR) * SECTOR;
        let buf = self.exec.alloc_buf(self.dev, len as usize);
        let mut padded = dir.to_vec();
        padded.resize(len as usize, 0);
        buf.copy_in(0, &padded);
        self.exec
            .write(self.dev, offset, BufSlice::whole(buf))
            .await
    }

    /// At a clean close, with everything else written back: stores the bitmaps (see the
    /// module doc) and clears their `in_use` flags. Caller holds the metadata lock.
    pub(crate) async fn store_bitmaps(&self) -> Result<()> {
        let Some(mut kept) = self.meta().st_mut().bitmaps.take() else {
            return Ok(());
        };
        let r = self.store_kept(&mut kept).await;
        self.meta().st_mut().bitmaps = Some(kept);
        r
    }

    async fn store_kept(&self, kept: &mut KeptBitmaps) -> Result<()> {
        if kept.loaded.is_empty() {
            // Nothing in use to store (an image with no bitmaps, or only inconsistent ones).
            return Ok(());
        }
        let cs = self.geo.cluster_size();
        let size = self.size();
        kept.bits.clear_from(size);
        // 1. New tables for the bitmaps that changed, or whose size did.
        let mut old: Vec<HostRange> = Vec::new();
        let mut moved: Vec<(usize, u64, u32, Vec<u64>)> = Vec::new();
        for (k, l) in kept.loaded.iter().enumerate() {
            let e = &kept.entries[l.entry];
            let Some(bits) = kept.bits.get(l.slot) else {
                continue;
            };
            let len = data_bytes(size, e.granularity_bits);
            let entries = len.div_ceil(cs);
            if !bits.changed() && entries == u64::from(e.table_size) {
                continue;
            }
            let data = bits.data(len as usize);
            let mut table = vec![0u8; (entries * 8).div_ceil(cs) as usize * cs as usize];
            let mut clusters = Vec::new();
            for (i, chunk) in data.chunks(cs as usize).enumerate() {
                if chunk.iter().all(|&b| b == 0) {
                    continue;
                }
                let mut c = chunk.to_vec();
                c.resize(cs as usize, 0);
                let off = self.write_new_bytes(&c).await?;
                table[i * 8..i * 8 + 8].copy_from_slice(&off.to_be_bytes());
                clusters.push(off >> self.geo.cluster_bits);
            }
            let table_off = self.write_new_bytes(&table).await?;
            let table_size = u32::try_from(entries)
                .map_err(|_| Error::Refused(format!("bitmap '{}' too large", e.name)))?;
            moved.push((k, table_off, table_size, clusters));
        }
        if !moved.is_empty() {
            // Their refcounts (and the bytes just written) stable before the directory
            // names them.
            self.writeback_mode(true).await?;
            self.exec.flush(self.dev).await?;
            // 2. The directory takes the new tables, still in use.
            for (k, table_off, table_size, clusters) in &mut moved {
                let l = &mut kept.loaded[*k];
                let e = &mut kept.entries[l.entry];
                old.push(HostRange::new(
                    HostOffset(e.table_offset),
                    (u64::from(e.table_size) * 8).div_ceil(cs) * cs,
                ));
                old.extend(
                    std::mem::take(&mut l.data_clusters)
                        .into_iter()
                        .map(|c| HostRange::new(HostOffset(c << self.geo.cluster_bits), cs)),
                );
                bitmaps::set_table(&mut kept.dir, e, *table_off, *table_size);
                e.table_offset = *table_off;
                e.table_size = *table_size;
                l.data_clusters = std::mem::take(clusters);
                if let Some(b) = kept.bits.get(l.slot) {
                    b.stored();
                }
            }
            self.write_directory(kept.dir_offset, &kept.dir).await?;
            self.exec.flush(self.dev).await?;
        }
        // 3. Consistent again.
        for l in &kept.loaded {
            let e = &mut kept.entries[l.entry];
            e.flags &= !FLAG_IN_USE;
            bitmaps::set_flags(&mut kept.dir, e, e.flags);
        }
        self.write_directory(kept.dir_offset, &kept.dir).await?;
        self.exec.flush(self.dev).await?;
        // 4. What the old tables held (the caller's write-back makes the frees stable).
        for r in old {
            self.free_later(r, FreeKind::Other);
        }
        Ok(())
    }

    /// Refuses a change of the disk the enabled bitmaps cannot record (switching to a
    /// snapshot, as QEMU refuses it).
    pub(crate) fn refuse_with_enabled_bitmaps(&self, what: &str) -> Result<()> {
        let names = self
            .meta()
            .st()
            .bitmaps
            .as_ref()
            .map(KeptBitmaps::enabled_names)
            .unwrap_or_default();
        if names.is_empty() {
            return Ok(());
        }
        Err(Error::Refused(format!(
            "{what} is refused while the image has enabled persistent bitmaps ({}): \
             disable or remove them first (qemu-img bitmap --disable/--remove)",
            names.join(", ")
        )))
    }

    /// Before the disk's size becomes `new_size` (before any core may write past the old
    /// one): every loaded bitmap gets room for it, refused past what QEMU can hold; on a
    /// shrink, the bits past the new end go. The close stores tables of the new size.
    pub(crate) fn resize_bitmaps(&self, new_size: u64) -> Result<()> {
        let st = self.meta().st();
        let Some(kept) = &st.bitmaps else {
            return Ok(());
        };
        if let Some(slot) = kept.bits.too_small(new_size) {
            let name = kept
                .loaded
                .iter()
                .find(|l| l.slot == slot)
                .map_or("?", |l| kept.entries[l.entry].name.as_str());
            return Err(Error::Refused(format!(
                "persistent bitmap '{name}' cannot describe a disk of {new_size} bytes (QEMU's \
                 limit: 2^32 granules); remove it first"
            )));
        }
        let memory = kept.bits.memory_for(new_size);
        if memory > MAX_BITMAP_MEMORY {
            return Err(too_much_memory(memory));
        }
        kept.bits.cover(new_size);
        kept.bits.clear_from(new_size);
        Ok(())
    }
}

/// The refusal of bitmaps that would take `memory` bytes.
fn too_much_memory(memory: u64) -> Error {
    Error::Refused(format!(
        "the image's persistent bitmaps would need {} MiB of memory to be kept, more than the \
         {} MiB allowed: remove some (qemu-img bitmap --remove), or open the image read-only",
        memory >> 20,
        MAX_BITMAP_MEMORY >> 20
    ))
}
