//! Changes of the persistent bitmaps an owner keeps, as `qemu-img bitmap --enable,
//! --disable, --clear, --merge` make them: to the bits and flags in memory
//! ([`KeptBitmaps`](super::bitmaps::KeptBitmaps)), under the metadata lock. Nothing is
//! written here: the close stores them in the order `bitmaps.rs` keeps (new tables and
//! data stable, then the directory, then the `in_use` flags cleared), so a crash before
//! it leaves the bitmaps `in_use` (inconsistent), never half changed.
//!
//! Adding and removing bitmaps (which change the directory's size and the header's
//! bitmaps extension) are in `bitmap_dir.rs`.

use super::Owner;
use crate::error::{Error, Result};
use crate::format::bitmaps::{self, FLAG_AUTO};
use crate::image::Qcow2;
use crate::io::BlockDevice;

/// A change to one persistent bitmap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BitmapChange {
    /// Start recording guest writes (set the `auto` flag).
    Enable,
    /// Stop recording them (clear `auto`).
    Disable,
    /// Clear every bit.
    Clear,
    /// Set every bit another bitmap has set (of the same disk size; any granularity).
    Merge(BitmapBits),
}

/// One bitmap's bits as stored (bit `i` is bit `i % 8` of byte `i / 8`, one per granule).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitmapBits {
    /// log2 of the bytes one bit stands for.
    pub granularity_bits: u8,
    /// The size of the disk the bits describe.
    pub disk_size: u64,
    /// The bits (at least one per granule of the disk).
    pub data: Vec<u8>,
}

pub(super) fn not_found(name: &str) -> Error {
    Error::Refused(format!("Dirty bitmap '{name}' not found"))
}

fn inconsistent(name: &str) -> Error {
    Error::Refused(format!(
        "Bitmap '{name}' is inconsistent and cannot be used\nTry block-dirty-bitmap-remove to \
         delete this bitmap from disk"
    ))
}

impl<D: BlockDevice> Owner<'_, D> {
    /// Makes `change` to the kept bitmap `name` (stored at close). Refused when the image
    /// has no bitmap of that name, when it is `in_use` (left inconsistent by a process
    /// that did not close the image), or when a merge's source describes a disk of
    /// another size (as QEMU refuses it).
    pub(crate) async fn change_bitmap(&self, name: &str, change: BitmapChange) -> Result<()> {
        let m = self.meta();
        let _g = m.lock().lock().await;
        let size = self.size();
        let mut st = m.st_mut();
        let Some(kept) = st.bitmaps.as_mut() else {
            // A version 2 image: no bitmaps.
            return Err(not_found(name));
        };
        let Some(entry) = kept.entries.iter().position(|e| e.name == name) else {
            return Err(not_found(name));
        };
        let Some(l) = kept.loaded.iter().find(|l| l.entry == entry) else {
            return Err(inconsistent(name));
        };
        let slot = l.slot;
        let Some(bits) = kept.bits.get(slot) else {
            return Err(inconsistent(name));
        };
        match change {
            BitmapChange::Enable | BitmapChange::Disable => {
                let on = change == BitmapChange::Enable;
                let e = &mut kept.entries[entry];
                e.flags = if on {
                    e.flags | FLAG_AUTO
                } else {
                    e.flags & !FLAG_AUTO
                };
                bitmaps::set_flags(&mut kept.dir, e, e.flags);
                kept.bits.set_enabled(slot, on);
            }
            BitmapChange::Clear => bits.clear_all(),
            BitmapChange::Merge(src) => {
                if src.disk_size != size {
                    return Err(Error::Refused(
                        "Bitmaps are incompatible and can't be merged".into(),
                    ));
                }
                bits.merge(src.granularity_bits, &src.data, size);
            }
        }
        Ok(())
    }

    /// The bits of kept bitmap `name` as they are now.
    fn kept_bits(&self, name: &str) -> Option<Result<BitmapBits>> {
        let st = self.meta().st();
        let kept = st.bitmaps.as_ref()?;
        let entry = kept.entries.iter().position(|e| e.name == name)?;
        let Some(l) = kept.loaded.iter().find(|l| l.entry == entry) else {
            return Some(Err(inconsistent(name)));
        };
        let e = &kept.entries[entry];
        let size = self.size();
        let len = bitmaps::data_bytes(size, e.granularity_bits);
        Some(Ok(BitmapBits {
            granularity_bits: e.granularity_bits,
            disk_size: size,
            data: kept.bits.get(l.slot)?.data(len as usize),
        }))
    }
}

impl<D: BlockDevice> Qcow2<D> {
    /// Makes `change` to persistent bitmap `name` (see [`Owner::change_bitmap`]); stored
    /// at [`close`](Self::close). `ReadOnly` unless this is the owner.
    pub async fn change_bitmap(&self, name: &str, change: BitmapChange) -> Result<()> {
        self.owner()?.change_bitmap(name, change).await
    }

    /// The bits of persistent bitmap `name`: as kept in memory on the owner, else as
    /// stored. Refused when there is no such bitmap or it is `in_use`.
    pub async fn bitmap_bits(&self, name: &str) -> Result<BitmapBits> {
        if let Ok(o) = self.owner() {
            if let Some(r) = o.kept_bits(name) {
                return r;
            }
        }
        let dir = self.bitmap_directory().await?;
        let e = dir
            .iter()
            .find(|e| e.name == name)
            .ok_or_else(|| not_found(name))?;
        if e.in_use() {
            return Err(inconsistent(name));
        }
        let (data, _) = self.read_bitmap(e).await?;
        Ok(BitmapBits {
            granularity_bits: e.granularity_bits,
            disk_size: self.size(),
            data,
        })
    }
}
