//! Internal snapshots on the owner: create, delete, apply (go to), in the snapshot table
//! format of the qcow2 specification, so that QEMU reads and changes ours and we theirs.
//!
//! Reference counting follows the specification (and QEMU): every L1 table (the active one
//! and each snapshot's) counts one reference to each L2 table it names, and one reference,
//! through that table, to each host cluster the table's entries name. An entry (L1 or L2)
//! of the active tables has COPIED set exactly when its cluster's refcount is 1; in a
//! snapshot's tables COPIED means nothing (the specification says so, and QEMU's check
//! looks at the active tables only).
//!
//! Crash safety: each operation is one shadow commit ([`super::shadow`]). The refcounts
//! change in copies of the refcount blocks, and the active tables change in copies too:
//! a new active L1 table, and a new L2 table for each one whose COPIED flags change. One
//! header sector write then switches the active L1, the refcount table and the snapshot
//! table together, so every crash state is the old image or the new one, with at most
//! leaks, and no COPIED flag ever disagrees with the refcounts the header names.
//! - Create: the snapshot takes over the active L1 table and its L2 tables as they are on
//!   disk. The new active L1 names, for each L2 table with a COPIED data entry, a copy
//!   with COPIED cleared (refcount 1, so its L1 entry has COPIED), and shares the other
//!   tables (refcount + 1, no COPIED). Every cluster the disk references gets + 1.
//! - Delete: the snapshot's references go (− 1 each, so what only it held is free at
//!   once), its L1 table and the old snapshot table too; the active L2 tables whose data
//!   clusters are back to refcount 1 are copied with COPIED set (the old ones freed), and
//!   a new active L1 names them (only when an entry changes).
//! - Apply: the snapshot's references + 1, the active disk's − 1, and a new active L1
//!   built from the snapshot's as above.
//!
//! On a shared image, after the switch, the new L1 entries are published to the cores
//! with the epochs of their slices moved (odd before, even after), so no core keeps using
//! a replica of a table that stopped being active: a replaced table is freed only after
//! a grace period, for requests that resolved through it before.

use super::discards::FreeKind;
use super::shadow::{Deltas, HeaderSwitch};
use super::{words_to_bytes, Owner};
use crate::error::{corrupt, Error, Field, Result};
use crate::exec::read_bytes;
use crate::format::entries::{CopiedFlag, L1Entry, L2Entry};
use crate::format::snapshot::{encode_snapshots, Snapshot};
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

/// What becomes of the active L1 table the header names when a new one replaces it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OldL1 {
    /// A new snapshot keeps it (create): always replaced, never freed.
    Kept,
    /// Freed when replaced; replaced only when an entry changes (delete).
    FreedIfChanged,
    /// Always replaced and freed (apply).
    Replaced,
}

/// A new state of the active disk and snapshot table, to commit in one header switch.
struct Change {
    /// The L1 entries the active disk will have (COPIED flags are recomputed).
    l1: Vec<u64>,
    /// Refcount changes of the references that come and go (not those of new tables).
    deltas: Deltas,
    /// The old active L1 table's fate.
    old_l1: OldL1,
    /// The new snapshot table.
    snapshots: Vec<Snapshot>,
    /// New virtual size, if it changes.
    size: Option<u64>,
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
        // Everything dirty first (refcounts too): the tables walked below are on disk.
        self.writeback_mode(true).await?;
        let l1: Vec<u64> = self.l1.borrow().iter().map(|e| e.0).collect();
        let mut deltas = Deltas::new(self.per_block());
        self.add_references(&l1, 1, &mut deltas).await?;
        let (l1_off, l1_size) = {
            let h = self.header.borrow();
            (h.header.l1_table_offset, h.header.l1_size)
        };
        let size = self.size();
        let mut extra = Vec::with_capacity(16);
        extra.extend_from_slice(&0u64.to_be_bytes()); // vm_state_size_large
        extra.extend_from_slice(&size.to_be_bytes()); // disk_size
                                                      // The snapshot's L1 table is the active one as it is on disk.
        let snap = Snapshot {
            l1_table_offset: l1_off,
            l1_size,
            id: next_id(&snaps),
            name: name.to_string(),
            date_sec: when.sec,
            date_nsec: when.nsec,
            vm_clock_nsec: 0,
            vm_state_size: 0,
            extra_data: extra,
        };
        let mut snapshots = snaps;
        snapshots.push(snap.clone());
        self.commit_change(Change {
            l1,
            deltas,
            old_l1: OldL1::Kept,
            snapshots,
            size: None,
        })
        .await?;
        Ok(snap)
    }

    /// Deletes the snapshot whose id or name is `which` (ids first, as QEMU looks them up)
    /// and gives back what only it referenced. Returns the removed entry.
    pub(crate) async fn snapshot_delete(&self, which: &str) -> Result<Snapshot> {
        let m = self.meta();
        let _g = m.lock().lock().await;
        let mut snapshots = self.snapshots.borrow().clone();
        let snap = snapshots.remove(find(&snapshots, which)?);
        self.writeback_mode(true).await?;
        let mut deltas = Deltas::new(self.per_block());
        self.add_references(&self.read_l1(&snap).await?, -1, &mut deltas)
            .await?;
        deltas.add_range(
            self.table_range(snap.l1_table_offset, snap.l1_size),
            -1,
            self.geo.cluster_bits,
        )?;
        let l1: Vec<u64> = self.l1.borrow().iter().map(|e| e.0).collect();
        self.commit_change(Change {
            l1,
            deltas,
            old_l1: OldL1::FreedIfChanged,
            snapshots,
            size: None,
        })
        .await?;
        Ok(snap)
    }

    /// Makes the snapshot whose id or name is `which` the active disk (its L1 table copied
    /// to a new place, its size taken), giving back what only the old active disk
    /// referenced. For an image nobody else serves (offline): the cores' virtual size and
    /// the guests' view would change under them.
    pub(crate) async fn snapshot_apply(&self, which: &str) -> Result<()> {
        if self.published().is_some() {
            return Err(Error::Refused(
                "applying a snapshot is done offline, on an image nobody else serves".into(),
            ));
        }
        self.refuse_with_enabled_bitmaps("switching to a snapshot")?;
        let m = self.meta();
        let _g = m.lock().lock().await;
        let snapshots = self.snapshots.borrow().clone();
        let snap = snapshots[find(&snapshots, which)?].clone();
        self.writeback_mode(true).await?;
        let new_l1 = self.read_l1(&snap).await?;
        let old_l1: Vec<u64> = self.l1.borrow().iter().map(|e| e.0).collect();
        let mut deltas = Deltas::new(self.per_block());
        self.add_references(&new_l1, 1, &mut deltas).await?;
        self.add_references(&old_l1, -1, &mut deltas).await?;
        let size = snap.disk_size().unwrap_or_else(|| self.size());
        self.commit_change(Change {
            l1: new_l1.iter().map(|e| e & !COPIED).collect(),
            deltas,
            old_l1: OldL1::Replaced,
            snapshots,
            size: Some(size),
        })
        .await
    }

    /// Host bytes of a table of `entries` 8-byte entries at `off`, whole clusters.
    fn table_range(&self, off: u64, entries: u32) -> HostRange {
        let cs = self.geo.cluster_size();
        HostRange::new(HostOffset(off), (u64::from(entries) * 8).div_ceil(cs) * cs)
    }

    /// Adds `d` to the planned refcount of every host range L1 table `l1` references: each
    /// L2 table, and each cluster (or compressed stream) each table's entries name, read
    /// from the device (the caller wrote every dirty change back).
    async fn add_references(&self, l1: &[u64], d: i64, deltas: &mut Deltas) -> Result<()> {
        let cs = self.geo.cluster_size();
        let ds = self.device_size.get();
        let bits = self.geo.cluster_bits;
        for &e in l1 {
            let Some(t) = L1Entry(e).l2_table(cs, ds)? else {
                continue;
            };
            deltas.add(t.0 >> bits, d)?;
            let raw = read_bytes(&self.exec, self.dev, t.0, cs).await?;
            for (entry, _) in self.entries(&raw) {
                if entry.is_compressed() {
                    deltas.add_range(entry.compressed(bits, ds)?.sectors(), d, bits)?;
                } else if let Some(c) = self.host_cluster(entry, ds)? {
                    deltas.add(c, d)?;
                }
            }
        }
        Ok(())
    }

    /// The L2 entries of table bytes `raw` with their word index (bitmaps skipped).
    fn entries<'b>(&self, raw: &'b [u8]) -> impl Iterator<Item = (L2Entry, usize)> + 'b {
        let step = if self.geo.extended_l2() { 2 } else { 1 };
        raw.chunks_exact(8 * step).enumerate().map(move |(i, w)| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&w[..8]);
            (L2Entry(u64::from_be_bytes(b)), i * step)
        })
    }

    /// The host cluster a standard L2 entry names (data, or zero with a host cluster).
    fn host_cluster(&self, entry: L2Entry, ds: u64) -> Result<Option<u64>> {
        let h = entry.host_bits() & !(self.geo.cluster_size() - 1);
        if entry.is_compressed() || h == 0 {
            return Ok(None);
        }
        if h + self.geo.cluster_size() > ds {
            return Err(corrupt(
                Field::L2Entry,
                entry.0,
                "cluster past the device end",
            ));
        }
        Ok(Some(h >> self.geo.cluster_bits))
    }

    /// The refcount host cluster `c`, which a table on disk references, will have: the one
    /// on disk plus the planned change. A referenced cluster counted 0 (now or then) is
    /// corruption: the allocator could hand it out.
    async fn planned(&self, c: u64, deltas: &Deltas) -> Result<i64> {
        let now = self.refcount(c << self.geo.cluster_bits).await?;
        let n = now as i64 + deltas.get(c);
        if now == 0 || n < 1 {
            return Err(corrupt(
                Field::RefcountBlockEntry,
                c,
                "a referenced cluster has no reference counted",
            ));
        }
        Ok(n)
    }

    /// Commits `change` (see the module doc): new L2 tables where COPIED flags change, a
    /// new active L1 table, a new snapshot table, the refcounts, one header switch; then
    /// the new state in memory and on the cores. Caller holds the metadata lock and wrote
    /// everything back.
    async fn commit_change(&self, change: Change) -> Result<()> {
        let Change {
            l1: candidate,
            mut deltas,
            old_l1,
            snapshots,
            size,
        } = change;
        let cs = self.geo.cluster_size();
        let ds = self.device_size.get();
        let bits = self.geo.cluster_bits;
        // The active tables as they will be: COPIED exactly where the planned refcount is 1.
        let mut words = Vec::with_capacity(candidate.len());
        let mut copies: Vec<(usize, Vec<u8>)> = Vec::new();
        for (idx, &e) in candidate.iter().enumerate() {
            let Some(t) = L1Entry(e).l2_table(cs, ds)? else {
                words.push(0);
                continue;
            };
            let mut raw = read_bytes(&self.exec, self.dev, t.0, cs).await?;
            let mut changed = false;
            let found: Vec<(L2Entry, usize)> = self.entries(&raw).collect();
            for (entry, w) in found {
                let Some(c) = self.host_cluster(entry, ds)? else {
                    continue;
                };
                let n = self.planned(c, &deltas).await?;
                if (n == 1) != entry.is_copied() {
                    let fixed = if n == 1 {
                        entry.0 | COPIED
                    } else {
                        entry.0 & !COPIED
                    };
                    raw[w * 8..w * 8 + 8].copy_from_slice(&fixed.to_be_bytes());
                    changed = true;
                }
            }
            if changed {
                // The table stays with whoever else names it; the active disk gets a copy
                // of its own (refcount 1: its L1 entry has COPIED).
                deltas.add(t.0 >> bits, -1)?;
                copies.push((idx, raw));
                words.push(0);
            } else {
                let n = self.planned(t.0 >> bits, &deltas).await?;
                words.push(L1Entry::new(t, CopiedFlag::for_refcount(n)).0);
            }
        }
        for (idx, raw) in &copies {
            let off = self.write_new_bytes(raw).await?;
            words[*idx] = L1Entry::new(HostOffset(off), CopiedFlag::Set).0;
        }
        let (old_off, old_size) = {
            let h = self.header.borrow();
            (h.header.l1_table_offset, h.header.l1_size)
        };
        let old_words: Vec<u64> = self.l1.borrow().iter().map(|e| e.0).collect();
        let replace = match old_l1 {
            OldL1::Kept | OldL1::Replaced => true,
            OldL1::FreedIfChanged => words != old_words,
        };
        let mut switch = HeaderSwitch {
            size,
            ..HeaderSwitch::default()
        };
        if replace {
            let off = self.write_new_table(&words).await?;
            switch.l1 = Some((off, words.len() as u32));
            if old_l1 != OldL1::Kept && old_size > 0 {
                deltas.add_range(self.table_range(old_off, old_size), -1, bits)?;
            }
        }
        // The snapshot table.
        let bytes = encode_snapshots(&snapshots);
        if bytes.len() as u64 > MAX_SNAPSHOT_TABLE_BYTES {
            return Err(Error::Refused(
                "the snapshot table would exceed 64 MiB".into(),
            ));
        }
        let (old_st, old_count) = {
            let h = self.header.borrow();
            (h.header.snapshots_offset, h.header.nb_snapshots)
        };
        if old_count > 0 && old_st != 0 {
            let old_len = encode_snapshots(&self.snapshots.borrow()).len() as u64;
            let r = HostRange::new(HostOffset(old_st), old_len.max(1).div_ceil(cs) * cs);
            deltas.add_range(r, -1, bits)?;
        }
        let st_off = if snapshots.is_empty() {
            0
        } else {
            let mut padded = bytes;
            padded.resize((padded.len() as u64).div_ceil(cs) as usize * cs as usize, 0);
            self.write_new_bytes(&padded).await?
        };
        switch.snapshots = Some((st_off, snapshots.len() as u32));
        let freed = self.commit_shadow(&deltas, switch).await?;
        // The switch is stable: the rest of the new state, in memory, without an await.
        *self.l1.borrow_mut() = words.iter().map(|&e| L1Entry(e)).collect();
        *self.snapshots.borrow_mut() = snapshots;
        self.l2_cache.borrow_mut().clear();
        self.memo.forget_all();
        self.index_metadata();
        if let Some(sh) = self.published() {
            self.publish_l1(sh, &old_words, &words);
        }
        let m = self.meta();
        {
            let mut st = m.st_mut();
            for c in freed {
                st.frees.unstable(c, FreeKind::Snapshot);
                st.alloc.freed(c);
            }
        }
        // Stable already (the switch): free after the cores' grace period.
        self.release_unstable();
        self.process_discards().await;
        Ok(())
    }

    /// Publishes the L1 entries that differ between `old` and `new` to the cores, with
    /// the epochs of their slices odd meanwhile and moved on after (ARCHITECTURE.md §6): a
    /// core that read a slice through an old entry fails its epoch check, and a replica
    /// it holds is dropped.
    fn publish_l1(&self, sh: &crate::coherency::Shared, old: &[u64], new: &[u64]) {
        let cov = self.geo.l1_entry_coverage();
        let per = self.geo.slice_coverage();
        let n = old.len().max(new.len());
        let changed: Vec<usize> = (0..n)
            .filter(|&i| old.get(i).copied().unwrap_or(0) != new.get(i).copied().unwrap_or(0))
            .collect();
        let mut keys = Vec::new();
        for &i in &changed {
            let base = i as u64 * cov;
            let mut s = base;
            while s < base + cov {
                keys.push(self.geo.slice_id(GuestOffset(s)));
                s += per;
            }
        }
        let m = self.meta();
        m.st_mut().dirty.tables_moving(&keys, sh);
        for &i in &changed {
            sh.set_l1(i, new.get(i).copied().unwrap_or(0));
        }
        m.st_mut().dirty.tables_moved(&keys, sh);
    }

    /// Writes `words` as a new table in freshly taken clusters; returns its offset.
    async fn write_new_table(&self, words: &[u64]) -> Result<u64> {
        let cs = self.geo.cluster_size();
        let bytes_len = (words.len() as u64 * 8).max(8).div_ceil(cs) * cs;
        let mut bytes = vec![0u8; bytes_len as usize];
        words_to_bytes(words, &mut bytes);
        self.write_new_bytes(&bytes).await
    }

    /// Writes `bytes` (a whole number of clusters) into freshly taken clusters; returns
    /// their offset. Marks them as metadata for the overlap check.
    pub(crate) async fn write_new_bytes(&self, bytes: &[u8]) -> Result<u64> {
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
            if let Some(sh) = self.published() {
                sh.set_meta_cluster(c);
            }
        }
        Ok(off)
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
