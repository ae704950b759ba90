//! Internal snapshots on the owner: create, delete, apply (go to), in the snapshot table
//! format of the qcow2 specification, so that QEMU reads and changes ours and we theirs.
//!
//! Reference counting follows the specification (and QEMU): every L1 table (the active one
//! and each snapshot's) counts one reference to each L2 table it names, and one reference,
//! through that table, to each host cluster the table's entries name. An entry (L1 or L2)
//! of the active tables has COPIED set exactly when its cluster's refcount is 1.
//!
//! Ordering (ARCHITECTURE.md §7): a snapshot becomes visible with one header sector write
//! (snapshot count and table offset). Before it, the raised refcounts are stable, then the
//! active tables with COPIED cleared, then the snapshot's L1 copy and the new snapshot
//! table; so a crash before that write leaves the old image with leaked clusters (and, for
//! the moment between the refcounts and the cleared flags, COPIED flags that disagree with
//! the raised refcounts, which `qemu-img check -r all` corrects and which are safe: the
//! extra references are leaks). Deleting removes the snapshot from the table first (one
//! header write), then gives its references back through the ordered frees; the COPIED
//! flags of clusters back to refcount 1 are set last.

use super::{words_to_bytes, Owner};
use crate::error::{corrupt, Error, Field, Result};
use crate::exec::read_bytes;
use crate::format::snapshot::{encode_snapshots, Snapshot};
use crate::format::{L1Entry, L2Entry};
use crate::io::{BlockDevice, BufSlice, IoBuffer};
use crate::limits::{MAX_SNAPSHOTS, MAX_SNAPSHOT_TABLE_BYTES};
use crate::types::{GuestOffset, HostOffset, HostRange};

/// The COPIED bit of L1 and L2 entries.
const COPIED: u64 = crate::format::entries::COPIED;

/// When a snapshot was taken: seconds and nanoseconds since the Unix epoch (the host's
/// clock; the engine reads none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SnapshotTime {
    /// Seconds.
    pub sec: u32,
    /// Nanoseconds.
    pub nsec: u32,
}

impl<D: BlockDevice> Owner<'_, D> {
    /// Creates internal snapshot `name` of the disk as it is when the metadata lock is
    /// taken (every write completed before is in it). Returns the new table entry.
    /// Refused when the name is already an id or name of another snapshot, or the table
    /// is full.
    pub(crate) async fn snapshot_create(&self, name: &str, when: SnapshotTime) -> Result<Snapshot> {
        if name.is_empty() || name.len() > u16::MAX as usize {
            return Err(Error::Refused("a snapshot needs a name".into()));
        }
        let m = self.meta();
        let _g = m.lock().lock().await;
        let snaps = self.snapshots.borrow().clone();
        if snaps.iter().any(|s| s.name == name || s.id == name) {
            return Err(Error::Refused(format!("snapshot '{name}' already exists")));
        }
        if snaps.len() as u64 >= MAX_SNAPSHOTS {
            return Err(Error::Refused("the snapshot table is full".into()));
        }
        // Everything dirty first: the tables walked below are the ones on disk.
        self.writeback_locked().await?;
        let l1: Vec<u64> = self.l1.borrow().iter().map(|e| e.0).collect();
        for r in self.references(&l1).await? {
            for c in r.clusters(self.geo.cluster_bits) {
                self.update_refcount(c, 1).await?;
            }
        }
        self.clear_active_copied(&l1).await?;
        // The snapshot's L1 table: the active one, without COPIED.
        let snap_l1: Vec<u64> = l1.iter().map(|e| e & !COPIED).collect();
        let l1_off = self.write_new_table(&snap_l1).await?;
        // Refcounts (rule 1), then the active tables without COPIED, stable.
        self.writeback_locked().await?;
        self.exec.flush(self.dev).await?;
        let size = self.size();
        let id = next_id(&snaps);
        let mut extra = Vec::with_capacity(16);
        extra.extend_from_slice(&0u64.to_be_bytes()); // vm_state_size_large
        extra.extend_from_slice(&size.to_be_bytes()); // disk_size
        let snap = Snapshot {
            l1_table_offset: l1_off,
            l1_size: snap_l1.len() as u32,
            id,
            name: name.to_string(),
            date_sec: when.sec,
            date_nsec: when.nsec,
            vm_clock_nsec: 0,
            vm_state_size: 0,
            extra_data: extra,
        };
        let mut table = snaps;
        table.push(snap.clone());
        self.commit_snapshot_table(table).await?;
        Ok(snap)
    }

    /// Deletes the snapshot whose id or name is `which` (ids first, as QEMU looks them up)
    /// and gives back what only it referenced. Returns the removed entry.
    pub(crate) async fn snapshot_delete(&self, which: &str) -> Result<Snapshot> {
        let m = self.meta();
        let _g = m.lock().lock().await;
        let mut table = self.snapshots.borrow().clone();
        let i = find(&table, which)?;
        let snap = table.remove(i);
        self.writeback_locked().await?;
        let l1 = self.read_l1(&snap).await?;
        let refs = self.references(&l1).await?;
        // The snapshot disappears first (one header write); only then are its references
        // given back (rule 2), through the ordered frees.
        self.commit_snapshot_table(table).await?;
        {
            let mut st = m.st_mut();
            for r in refs {
                st.frees.free_later(r);
            }
            let cs = self.geo.cluster_size();
            st.frees.free_later(HostRange::new(
                HostOffset(snap.l1_table_offset),
                (u64::from(snap.l1_size) * 8).div_ceil(cs) * cs,
            ));
        }
        self.writeback_locked().await?;
        self.exec.flush(self.dev).await?;
        self.fix_active_copied().await?;
        self.writeback_locked().await?;
        self.exec.flush(self.dev).await?;
        Ok(snap)
    }

    /// Makes the snapshot whose id or name is `which` the active disk (its L1 table copied
    /// to a new place, its size taken), giving back what only the old active disk
    /// referenced. For an image nobody else serves (offline): the cores' replicas would
    /// not follow the new L1 table.
    pub(crate) async fn snapshot_apply(&self, which: &str) -> Result<()> {
        if self.shared.is_some() {
            return Err(Error::Refused(
                "applying a snapshot is done offline, on an image nobody else serves".into(),
            ));
        }
        let m = self.meta();
        let _g = m.lock().lock().await;
        let table = self.snapshots.borrow().clone();
        let snap = table[find(&table, which)?].clone();
        self.writeback_locked().await?;
        let new_l1 = self.read_l1(&snap).await?;
        let old_l1: Vec<u64> = self.l1.borrow().iter().map(|e| e.0).collect();
        // The new active tables' references first (stable before the header names them).
        for r in self.references(&new_l1).await? {
            for c in r.clusters(self.geo.cluster_bits) {
                self.update_refcount(c, 1).await?;
            }
        }
        let old_refs = self.references(&old_l1).await?;
        let active: Vec<u64> = new_l1.iter().map(|e| e & !COPIED).collect();
        let off = self.write_new_table(&active).await?;
        self.writeback_locked().await?;
        self.exec.flush(self.dev).await?;
        let size = snap.disk_size().unwrap_or_else(|| self.size());
        let (old_off, old_len) = {
            let h = self.header.borrow();
            (h.header.l1_table_offset, u64::from(h.header.l1_size))
        };
        {
            let mut h = self.header.borrow_mut();
            h.header.l1_table_offset = off;
            h.header.l1_size = active.len() as u32;
            h.header.size = size;
            let mut st = m.st_mut();
            st.header.set_l1_table(off, active.len() as u32);
            st.header.set_size(size);
        }
        self.write_header().await?;
        self.exec.flush(self.dev).await?;
        *self.l1.borrow_mut() = active.iter().map(|&e| L1Entry(e)).collect();
        self.l2_cache.borrow_mut().clear();
        self.memo.forget_all();
        self.index_metadata();
        {
            let cs = self.geo.cluster_size();
            let mut st = m.st_mut();
            for r in old_refs {
                st.frees.free_later(r);
            }
            st.frees.free_later(HostRange::new(
                HostOffset(old_off),
                (old_len * 8).div_ceil(cs) * cs,
            ));
        }
        self.writeback_locked().await?;
        self.exec.flush(self.dev).await?;
        self.fix_active_copied().await?;
        self.writeback_locked().await?;
        self.exec.flush(self.dev).await
    }

    /// The host ranges L1 table `l1` references: each L2 table, and each cluster (or
    /// compressed stream) each table's entries name, read from the device (the caller wrote
    /// every dirty change back).
    async fn references(&self, l1: &[u64]) -> Result<Vec<HostRange>> {
        let cs = self.geo.cluster_size();
        let ds = self.device_size.get();
        let bits = self.geo.cluster_bits;
        let step = if self.geo.extended_l2 { 2 } else { 1 };
        let mut out = Vec::new();
        for &e in l1 {
            let Some(t) = L1Entry(e).l2_table(cs, ds)? else {
                continue;
            };
            out.push(HostRange::new(t, cs));
            let raw = read_bytes(&self.exec, self.dev, t.0, cs).await?;
            for w in raw.chunks_exact(8 * step) {
                let mut b = [0u8; 8];
                b.copy_from_slice(&w[..8]);
                let entry = L2Entry(u64::from_be_bytes(b));
                if entry.is_compressed() {
                    out.push(entry.compressed(bits, ds)?.sectors());
                } else if entry.host_bits() != 0 {
                    let h = entry.host_bits() & !(cs - 1);
                    if h + cs > ds {
                        return Err(corrupt(
                            Field::L2Entry,
                            entry.0,
                            "cluster past the device end",
                        ));
                    }
                    out.push(HostRange::new(HostOffset(h), cs));
                }
            }
        }
        Ok(out)
    }

    /// Clears COPIED in every entry of the active tables `l1` names (their clusters are
    /// shared with a snapshot from now on), in the dirty metadata. On a shared image this
    /// bumps the slices' epochs, so no core writes in place into them any longer.
    async fn clear_active_copied(&self, l1: &[u64]) -> Result<()> {
        let cs = self.geo.cluster_size();
        let ds = self.device_size.get();
        let cov = self.geo.l1_entry_coverage();
        let per_slice = self.geo.slice_coverage();
        let entries = (1u64 << self.geo.slice_bits) / if self.geo.extended_l2 { 16 } else { 8 };
        for (idx, &e) in l1.iter().enumerate() {
            if L1Entry(e).l2_table(cs, ds)?.is_none() {
                continue;
            }
            let base = idx as u64 * cov;
            let mut slice = base;
            while slice < base + cov {
                self.dirty_slice_for(GuestOffset(slice)).await?;
                for i in 0..entries {
                    let off = GuestOffset(slice + i * cs);
                    let (entry, bitmap) = self.l2_words(off).await?;
                    if entry.is_copied() {
                        self.set_l2_words(off, L2Entry(entry.0 & !COPIED), bitmap)?;
                    }
                }
                slice += per_slice;
            }
            let cleared = L1Entry(e & !COPIED);
            self.l1.borrow_mut()[idx] = cleared;
            self.meta().st_mut().dirty.dirty_l1(idx as u64);
            if let Some(sh) = &self.shared {
                sh.set_l1(idx, cleared.0);
            }
        }
        Ok(())
    }

    /// Sets COPIED on every entry of the active tables whose cluster's refcount is 1 (and
    /// clears it elsewhere), after references went away.
    async fn fix_active_copied(&self) -> Result<()> {
        let cs = self.geo.cluster_size();
        let ds = self.device_size.get();
        let cov = self.geo.l1_entry_coverage();
        let per_slice = self.geo.slice_coverage();
        let entries = (1u64 << self.geo.slice_bits) / if self.geo.extended_l2 { 16 } else { 8 };
        let l1: Vec<u64> = self.l1.borrow().iter().map(|e| e.0).collect();
        for (idx, &e) in l1.iter().enumerate() {
            let Some(t) = L1Entry(e).l2_table(cs, ds)? else {
                continue;
            };
            let sole = self.refcount(t.0).await? == 1;
            if sole != L1Entry(e).is_copied() {
                let fixed = L1Entry::new(t, sole);
                self.l1.borrow_mut()[idx] = fixed;
                self.meta().st_mut().dirty.dirty_l1(idx as u64);
            }
            if !sole {
                // A table shared with a snapshot is not changed in place: its clusters are
                // shared too, and its entries have no COPIED.
                continue;
            }
            let base = idx as u64 * cov;
            let mut slice = base;
            while slice < base + cov {
                for i in 0..entries {
                    let off = GuestOffset(slice + i * cs);
                    let (entry, bitmap) = self.l2_words(off).await?;
                    if entry.is_compressed() || entry.host_bits() == 0 {
                        continue;
                    }
                    let one = self.refcount(entry.host_bits() & !(cs - 1)).await? == 1;
                    if one != entry.is_copied() {
                        self.dirty_slice_for(off).await?;
                        let w = if one {
                            entry.0 | COPIED
                        } else {
                            entry.0 & !COPIED
                        };
                        self.set_l2_words(off, L2Entry(w), bitmap)?;
                    }
                }
                slice += per_slice;
            }
        }
        Ok(())
    }

    /// Writes `words` as a new table in freshly taken clusters (flushed by the caller's
    /// next write-back); returns its offset.
    async fn write_new_table(&self, words: &[u64]) -> Result<u64> {
        let cs = self.geo.cluster_size();
        let bytes_len = (words.len() as u64 * 8).max(8).div_ceil(cs) * cs;
        let mut bytes = vec![0u8; bytes_len as usize];
        words_to_bytes(words, &mut bytes);
        self.write_new_bytes(&bytes).await
    }

    /// Writes `bytes` (a whole number of clusters) into freshly taken clusters; returns
    /// their offset. Marks them as metadata for the overlap check.
    async fn write_new_bytes(&self, bytes: &[u8]) -> Result<u64> {
        let cs = self.geo.cluster_size();
        let n = (bytes.len() as u64).div_ceil(cs);
        let a = self.alloc_run(n).await?;
        let off = a.first.0 << self.geo.cluster_bits;
        let buf = self.exec.alloc_buf(self.dev, bytes.len());
        buf.copy_in(0, bytes);
        self.exec.write(self.dev, off, BufSlice::whole(buf)).await?;
        let mut st = self.meta().st_mut();
        for c in a.first.0..a.end().0 {
            st.index.insert(c);
            if let Some(sh) = &self.shared {
                sh.set_meta_cluster(c);
            }
        }
        Ok(off)
    }

    /// Writes `table` as the new snapshot table and switches the header to it (count and
    /// offset in one sector write), then frees the old table. Everything the new entries
    /// name must be stable already.
    async fn commit_snapshot_table(&self, table: Vec<Snapshot>) -> Result<()> {
        let m = self.meta();
        let cs = self.geo.cluster_size();
        let bytes = encode_snapshots(&table);
        if bytes.len() as u64 > MAX_SNAPSHOT_TABLE_BYTES {
            return Err(Error::Refused(
                "the snapshot table would exceed 64 MiB".into(),
            ));
        }
        let (old_off, old_count) = {
            let h = self.header.borrow();
            (h.header.snapshots_offset, h.header.nb_snapshots)
        };
        let old_len = encode_snapshots(&self.snapshots.borrow()).len() as u64;
        let off = if table.is_empty() {
            0
        } else {
            let mut padded = bytes.clone();
            padded.resize((bytes.len() as u64).div_ceil(cs) as usize * cs as usize, 0);
            // Its refcounts stable before the header names it (rule 1).
            let off = self.write_new_bytes(&padded).await?;
            self.writeback_locked().await?;
            self.exec.flush(self.dev).await?;
            off
        };
        {
            let mut h = self.header.borrow_mut();
            h.header.snapshots_offset = off;
            h.header.nb_snapshots = table.len() as u32;
            m.st_mut()
                .header
                .set_snapshot_table(off, table.len() as u32);
        }
        self.write_header().await?;
        self.exec.flush(self.dev).await?;
        *self.snapshots.borrow_mut() = table;
        if old_count > 0 && old_off != 0 {
            m.st_mut().frees.free_later(HostRange::new(
                HostOffset(old_off),
                old_len.max(1).div_ceil(cs) * cs,
            ));
        }
        Ok(())
    }

    /// The L1 table of `snap`, read from the device.
    async fn read_l1(&self, snap: &Snapshot) -> Result<Vec<u64>> {
        let raw = read_bytes(
            &self.exec,
            self.dev,
            snap.l1_table_offset,
            u64::from(snap.l1_size) * 8,
        )
        .await?;
        Ok(raw
            .chunks_exact(8)
            .map(|c| {
                let mut b = [0u8; 8];
                b.copy_from_slice(c);
                u64::from_be_bytes(b)
            })
            .collect())
    }
}

/// The index in `table` of the snapshot whose id, else name, is `which`.
fn find(table: &[Snapshot], which: &str) -> Result<usize> {
    table
        .iter()
        .position(|s| s.id == which)
        .or_else(|| table.iter().position(|s| s.name == which))
        .ok_or_else(|| Error::Refused(format!("no snapshot with id or name '{which}'")))
}

/// The id of a new snapshot: one more than the largest numeric id, as QEMU numbers them.
fn next_id(table: &[Snapshot]) -> String {
    let max = table
        .iter()
        .filter_map(|s| s.id.parse::<u64>().ok())
        .max()
        .unwrap_or(0);
    (max + 1).to_string()
}
