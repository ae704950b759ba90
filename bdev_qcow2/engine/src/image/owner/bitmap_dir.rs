//! Adding and removing persistent bitmaps (`qemu-img bitmap --add | --remove`): the
//! directory grows or shrinks, and the header's bitmaps extension (with the autoclear bit
//! that validates it) follows it, or goes with the last bitmap. Checks and messages as
//! QEMU's (`block_dirty_bitmap_add`, `qcow2_co_can_store_new_dirty_bitmap`).
//!
//! Order (a crash at any point leaves an image `qemu-img check` accepts, at worst with
//! leaked clusters):
//! 1. a new bitmap's table (all zeros: no bit set) and the new directory are written to
//!    clusters of their own; then every refcount is written back and flushed;
//! 2. one write of the header's first sector points at the new directory (or drops the
//!    extension and the autoclear bit); flushed;
//! 3. the old directory's clusters, and a removed bitmap's table and data, are freed (made
//!    stable by the next write-back).
//!
//! A bitmap added is `in_use` on disk while the image stays open, like every bitmap the
//! owner keeps, and is stored at close; it records guest writes from the moment it is
//! added (its bits join the slots every core marks).

use super::bitmap_change::not_found;
use super::bitmaps::Loaded;
use super::discards::FreeKind;
use super::Owner;
use crate::dirty_bitmaps::{self, Bits};
use crate::error::{Error, Result};
use crate::exec::read_bytes;
use crate::format::be::get_u64;
use crate::format::bitmaps::{
    self, data_bytes, BitmapEntry, FLAG_AUTO, FLAG_IN_USE, MAX_NAME_SIZE, MAX_PHYS_SIZE,
    MAX_TABLE_SIZE, TABLE_OFFSET_MASK,
};
use crate::format::header::{autoclear, BitmapsExt};
use crate::image::Qcow2;
use crate::io::BlockDevice;
use crate::limits::{MAX_BITMAPS, MAX_BITMAP_DIRECTORY_BYTES, MAX_BITMAP_MEMORY};
use crate::types::{HostOffset, HostRange};

/// QEMU's default granularity: the cluster size, within 4 KiB ..= 64 KiB
/// (`bdrv_get_default_bitmap_granularity`).
pub fn default_granularity(cluster_size: u64) -> u32 {
    cluster_size.clamp(4096, 65536) as u32
}

fn cannot_store(name: &str, why: &str) -> Error {
    Error::Refused(format!("Can't make bitmap '{name}' persistent: {why}"))
}

impl<D: BlockDevice> Owner<'_, D> {
    /// Adds persistent bitmap `name` of `granularity` bytes (`None`: QEMU's default),
    /// enabled or not, with no bit set (see the module doc). Refused as QEMU refuses it.
    pub(crate) async fn add_bitmap(
        &self,
        name: &str,
        granularity: Option<u32>,
        enabled: bool,
    ) -> Result<()> {
        if name.is_empty() {
            return Err(Error::Refused("Bitmap name cannot be empty".into()));
        }
        let cs = self.geo.cluster_size();
        let g = match granularity {
            Some(g) if g < 512 || !g.is_power_of_two() => {
                return Err(Error::Refused(
                    "Granularity must be power of 2 and at least 512".into(),
                ))
            }
            Some(g) => g,
            None => default_granularity(cs),
        };
        let gbits = g.trailing_zeros() as u8;
        let m = self.meta();
        let _g = m.lock().lock().await;
        let size = self.size();
        let (old_dir, nb, memory) = {
            let st = m.st();
            let Some(kept) = st.bitmaps.as_ref() else {
                return Err(cannot_store(
                    name,
                    "Cannot store dirty bitmaps in qcow2 v2 files",
                ));
            };
            if kept.entries.iter().any(|e| e.name == name) {
                return Err(Error::Refused(format!("Bitmap already exists: {name}")));
            }
            let bytes = data_bytes(size, gbits);
            if bytes > MAX_PHYS_SIZE || bytes > MAX_TABLE_SIZE * cs {
                return Err(cannot_store(
                    name,
                    "Too much space will be occupied by the bitmap. Use larger granularity",
                ));
            }
            if name.len() > usize::from(MAX_NAME_SIZE) {
                return Err(cannot_store(
                    name,
                    "Name length exceeds maximum (1023 characters)",
                ));
            }
            if kept.entries.len() as u64 + 1 > MAX_BITMAPS {
                return Err(cannot_store(
                    name,
                    "Maximum number of persistent bitmaps is already reached",
                ));
            }
            let dir_len = kept.dir.len() + bitmaps::entry_size(name.len());
            if dir_len as u64 > MAX_BITMAP_DIRECTORY_BYTES {
                return Err(cannot_store(
                    name,
                    "Not enough space in the bitmap directory",
                ));
            }
            let memory =
                kept.bits.memory_for(size) + dirty_bitmaps::memory_for(size.div_ceil(u64::from(g)));
            (kept.dir.clone(), kept.entries.len() as u32, memory)
        };
        if memory > MAX_BITMAP_MEMORY {
            return Err(Error::Refused(format!(
                "the image's persistent bitmaps would need {} MiB of memory to be kept, more \
                 than the {} MiB allowed",
                memory >> 20,
                MAX_BITMAP_MEMORY >> 20
            )));
        }
        let rest = self.header_rest().await?;
        // The extension's room is checked before anything is written.
        let probe = BitmapsExt {
            nb_bitmaps: nb + 1,
            directory_size: 8,
            directory_offset: cs,
        };
        m.st()
            .header
            .bitmaps_ext_fits(&rest, Some(&probe))
            .map_err(|why| cannot_store(name, why))?;
        // Its bits first: it records every write from now on.
        let granules = size.div_ceil(u64::from(g));
        let slot = m
            .st()
            .bitmaps
            .as_ref()
            .and_then(|k| k.bits.add(Bits::new(gbits, &[], granules, enabled)));
        let Some(slot) = slot else {
            return Err(cannot_store(
                name,
                "too many bitmaps added since the image was opened: close and reopen it",
            ));
        };
        let r = self
            .write_added(name, gbits, enabled, old_dir, nb, &rest)
            .await;
        let mut st = m.st_mut();
        let Some(kept) = st.bitmaps.as_mut() else {
            return r.map(|_| ());
        };
        match r {
            Ok((entry, new_dir, dir_offset)) => {
                kept.dir = new_dir;
                kept.dir_offset = dir_offset;
                kept.entries.push(entry);
                kept.loaded.push(Loaded {
                    entry: kept.entries.len() - 1,
                    slot,
                    data_clusters: Vec::new(),
                });
                Ok(())
            }
            Err(e) => {
                kept.bits.retire(slot);
                Err(e)
            }
        }
    }

    /// Steps 1 and 2 of an add: the new entry, directory and its offset.
    async fn write_added(
        &self,
        name: &str,
        gbits: u8,
        enabled: bool,
        mut dir: Vec<u8>,
        nb: u32,
        rest: &[u8],
    ) -> Result<(BitmapEntry, Vec<u8>, u64)> {
        let cs = self.geo.cluster_size();
        let entries = data_bytes(self.size(), gbits).div_ceil(cs).max(1);
        let table = vec![0u8; ((entries * 8).div_ceil(cs) * cs) as usize];
        let table_offset = self.write_new_bytes(&table).await?;
        let flags = FLAG_IN_USE | if enabled { FLAG_AUTO } else { 0 };
        let pos = dir.len();
        dir.extend(bitmaps::encode_entry(
            table_offset,
            entries as u32,
            flags,
            gbits,
            name.as_bytes(),
        ));
        let dir_offset = match self.switch_directory(&dir, nb + 1, rest).await {
            Ok(off) => off,
            Err(e) => {
                self.free_later(
                    whole_clusters(table_offset, table.len() as u64, cs),
                    FreeKind::Other,
                );
                return Err(e);
            }
        };
        let entry = BitmapEntry {
            pos,
            table_offset,
            table_size: entries as u32,
            flags,
            granularity_bits: gbits,
            name: name.to_string(),
        };
        Ok((entry, dir, dir_offset))
    }

    /// Removes persistent bitmap `name` (enabled, disabled or `in_use`), freeing its table
    /// and data (see the module doc). Refused when there is none of that name.
    pub(crate) async fn remove_bitmap(&self, name: &str) -> Result<()> {
        let m = self.meta();
        let _g = m.lock().lock().await;
        let cs = self.geo.cluster_size();
        let (idx, e, dir, loaded, nb) = {
            let st = m.st();
            let kept = st.bitmaps.as_ref().ok_or_else(|| not_found(name))?;
            let idx = kept
                .entries
                .iter()
                .position(|e| e.name == name)
                .ok_or_else(|| not_found(name))?;
            let loaded = kept
                .loaded
                .iter()
                .find(|l| l.entry == idx)
                .map(|l| l.data_clusters.clone());
            let nb = kept.entries.len() as u32 - 1;
            (idx, kept.entries[idx].clone(), kept.dir.clone(), loaded, nb)
        };
        let table = whole_clusters(e.table_offset, u64::from(e.table_size) * 8, cs);
        let data = match loaded {
            Some(d) => Some(d),
            None => self.owned_clusters_of_in_use(&e).await,
        };
        let range = bitmaps::entry_range(&dir, &e);
        let removed = range.len();
        let mut new_dir = dir;
        new_dir.drain(range);
        let rest = self.header_rest().await?;
        let probe = (nb > 0).then_some(BitmapsExt {
            nb_bitmaps: nb,
            directory_size: 8,
            directory_offset: cs,
        });
        m.st()
            .header
            .bitmaps_ext_fits(&rest, probe.as_ref())
            .map_err(|why| Error::Refused(why.to_string()))?;
        let dir_offset = self.switch_directory(&new_dir, nb, &rest).await?;
        // 3. Its clusters: only those known to be its alone.
        if let Some(data) = data {
            self.free_later(table, FreeKind::Other);
            for c in data {
                self.free_later(
                    HostRange::new(HostOffset(c << self.geo.cluster_bits), cs),
                    FreeKind::Other,
                );
            }
        }
        let mut st = m.st_mut();
        let Some(kept) = st.bitmaps.as_mut() else {
            return Ok(());
        };
        kept.dir = new_dir;
        kept.dir_offset = dir_offset;
        kept.entries.remove(idx);
        for later in kept.entries.iter_mut().skip(idx) {
            later.pos -= removed;
        }
        if let Some(k) = kept.loaded.iter().position(|l| l.entry == idx) {
            let l = kept.loaded.remove(k);
            kept.bits.retire(l.slot);
        }
        for l in kept.loaded.iter_mut().filter(|l| l.entry > idx) {
            l.entry -= 1;
        }
        Ok(())
    }

    /// The data clusters of an `in_use` bitmap (not loaded at open), when its table reads
    /// and every cluster it names (and the table's own) is the bitmap's alone; `None`
    /// leaves them allocated (a leak, never a cluster freed that something else uses).
    async fn owned_clusters_of_in_use(&self, e: &BitmapEntry) -> Option<Vec<u64>> {
        let (bits_c, cs) = (self.geo.cluster_bits, self.geo.cluster_size());
        // Its table only (its data may be large, and is not needed).
        let raw = read_bytes(
            &self.exec,
            self.dev,
            e.table_offset,
            u64::from(e.table_size) * 8,
        )
        .await
        .ok()?;
        let mut data = Vec::new();
        for t in raw.chunks_exact(8).map(|w| get_u64(w, 0)) {
            if !bitmaps::table_entry_ok(t, cs) || t & TABLE_OFFSET_MASK >= self.device_size.get() {
                return None;
            }
            if t & TABLE_OFFSET_MASK != 0 {
                data.push((t & TABLE_OFFSET_MASK) >> bits_c);
            }
        }
        // Everything the other bitmaps and the directory hold.
        let mut owned = super::HashSet::default();
        {
            let st = self.meta().st();
            let kept = st.bitmaps.as_ref()?;
            if kept.dir_offset != 0 {
                let end = (kept.dir_offset + kept.dir.len() as u64).div_ceil(cs);
                owned.extend(kept.dir_offset >> bits_c..end);
            }
            for l in &kept.loaded {
                let o = &kept.entries[l.entry];
                let t = whole_clusters(o.table_offset, u64::from(o.table_size) * 8, cs);
                owned.extend(t.clusters(bits_c));
                owned.extend(l.data_clusters.iter().copied());
            }
        }
        let table = whole_clusters(e.table_offset, u64::from(e.table_size) * 8, cs);
        let all = table.clusters(bits_c).chain(data.iter().copied());
        if let Err(err) = self.own(&mut owned, all).await {
            tracing::warn!(
                "qcow2: bitmap '{}' removed, its clusters left allocated: {err}",
                e.name
            );
            return None;
        }
        Some(data)
    }

    /// Steps 1 (the directory) to 3 (the old one freed): the image switches to directory
    /// `dir` of `nb` entries (none when empty: the extension goes). Returns its offset.
    async fn switch_directory(&self, dir: &[u8], nb: u32, rest: &[u8]) -> Result<u64> {
        let cs = self.geo.cluster_size();
        let (old_offset, old_len) = self
            .meta()
            .st()
            .bitmaps
            .as_ref()
            .map_or((0, 0), |k| (k.dir_offset, k.dir.len() as u64));
        let ext = if dir.is_empty() {
            None
        } else {
            let mut padded = dir.to_vec();
            padded.resize(((dir.len() as u64).div_ceil(cs) * cs) as usize, 0);
            let off = self.write_new_bytes(&padded).await?;
            Some(BitmapsExt {
                nb_bitmaps: nb,
                directory_size: dir.len() as u64,
                directory_offset: off,
            })
        };
        // 1. What the header will point at, and its refcounts, stable first.
        self.writeback_mode(true).await?;
        self.exec.flush(self.dev).await?;
        // 2. One sector.
        let backing = self
            .meta()
            .st_mut()
            .header
            .set_bitmaps_ext(rest, ext.as_ref())
            .map_err(|why| Error::Refused(why.to_string()))?;
        self.write_header().await?;
        self.exec.flush(self.dev).await?;
        {
            let mut h = self.header.borrow_mut();
            h.header.backing_file_offset = backing;
            if ext.is_some() {
                h.header.autoclear_features |= autoclear::BITMAPS;
            } else {
                h.header.autoclear_features &= !autoclear::BITMAPS;
            }
            h.extensions.bitmaps = ext.clone();
        }
        // 3. The old directory.
        if old_offset != 0 {
            self.free_later(whole_clusters(old_offset, old_len, cs), FreeKind::Other);
        }
        Ok(ext.map_or(0, |e| e.directory_offset))
    }
}

/// The whole clusters `[offset, offset + len)` lies in.
fn whole_clusters(offset: u64, len: u64, cs: u64) -> HostRange {
    HostRange::new(HostOffset(offset), len.max(1).div_ceil(cs) * cs)
}

impl<D: BlockDevice> Qcow2<D> {
    /// Adds persistent bitmap `name` (see [`Owner::add_bitmap`]): `granularity` in bytes
    /// (`None`: QEMU's default for the cluster size), enabled (recording guest writes) or
    /// not. `ReadOnly` unless this is the owner.
    pub async fn add_bitmap(
        &self,
        name: &str,
        granularity: Option<u32>,
        enabled: bool,
    ) -> Result<()> {
        self.owner()?.add_bitmap(name, granularity, enabled).await
    }

    /// Removes persistent bitmap `name` (see [`Owner::remove_bitmap`]). `ReadOnly` unless
    /// this is the owner.
    pub async fn remove_bitmap(&self, name: &str) -> Result<()> {
        self.owner()?.remove_bitmap(name).await
    }
}
