//! The shadow commit: changes of references that touch refcounts and the active tables at
//! once (internal snapshots) made visible by one header sector write.
//!
//! A refcount and the L2 entry whose COPIED flag depends on it live in different clusters,
//! so no order of in-place writes keeps every crash state consistent (QEMU's check counts a
//! COPIED flag that disagrees with "refcount is 1" as corruption in both directions).
//! Instead the new state is built beside the old one: copies of the refcount blocks whose
//! counts change, a new refcount table naming them (blocks that do not change are shared),
//! and whatever new tables the caller wrote (an active L1, L2 copies, a snapshot table).
//! Every new cluster is taken from the old structure (refcount 0 there, then 1, written in
//! place: a leak if the commit never happens). When all of it is stable, one write of the
//! header's first sector switches `l1_size`, `l1_table_offset`, `refcount_table_offset`,
//! `refcount_table_clusters`, `nb_snapshots` and `snapshots_offset` (all in its first 72
//! bytes) at once, and a flush makes the switch stable. A crash before it leaves the old
//! image with leaks; after it, the new one, where the replaced refcount blocks, the old
//! refcount table and whatever the caller gave back count 0.
//!
//! Invariants: the planned changes ([`Deltas`]) are relative to the refcounts on disk when
//! the commit starts writing (the caller wrote everything dirty back and holds the metadata
//! lock throughout); the in-memory state switches without an await after the switch is
//! stable, so no task on the owner sees half of it.

use super::HashMap;
use super::{words_to_bytes, Owner};
use crate::error::{corrupt, Error, Field, Result};
use crate::format::refcount::{get_refcount, set_refcount};
use crate::io::{BlockDevice, BufSlice, IoBuffer};
use crate::limits::MAX_SHADOW_DELTA_BYTES;
use crate::types::HostRange;
use std::collections::{BTreeMap, BTreeSet};

/// Planned refcount changes, by refcount-table index and entry within its block (a block's
/// worth of counters for each block a change touches; bounded by
/// [`MAX_SHADOW_DELTA_BYTES`]).
pub(crate) struct Deltas {
    per_block: u64,
    blocks: HashMap<u64, Vec<i32>>,
}

impl Deltas {
    /// No change yet, for refcount blocks of `per_block` entries.
    pub(crate) fn new(per_block: u64) -> Self {
        Deltas {
            per_block,
            blocks: HashMap::default(),
        }
    }

    /// Adds `d` to the planned change of host cluster `c`.
    pub(crate) fn add(&mut self, c: u64, d: i64) -> Result<()> {
        let r = c / self.per_block;
        if !self.blocks.contains_key(&r)
            && (self.blocks.len() as u64 + 1) * self.per_block * 4 > MAX_SHADOW_DELTA_BYTES
        {
            return Err(Error::Refused(format!(
                "the operation changes refcounts in more than {} refcount blocks (over {} MiB \
                 of planned changes)",
                self.blocks.len(),
                MAX_SHADOW_DELTA_BYTES >> 20
            )));
        }
        let per = self.per_block as usize;
        let v = self.blocks.entry(r).or_insert_with(|| vec![0; per]);
        let e = &mut v[(c % self.per_block) as usize];
        *e = i32::try_from(i64::from(*e) + d)
            .map_err(|_| corrupt(Field::RefcountBlockEntry, c, "refcount change out of range"))?;
        Ok(())
    }

    /// Adds `d` to every cluster of host bytes `r`.
    pub(crate) fn add_range(&mut self, r: HostRange, d: i64, cluster_bits: u32) -> Result<()> {
        for c in r.clusters(cluster_bits) {
            self.add(c, d)?;
        }
        Ok(())
    }

    /// The planned change of host cluster `c`.
    pub(crate) fn get(&self, c: u64) -> i64 {
        self.blocks
            .get(&(c / self.per_block))
            .map_or(0, |v| i64::from(v[(c % self.per_block) as usize]))
    }
}

/// The header fields a shadow commit switches besides the refcount table.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct HeaderSwitch {
    /// New active L1 table: (offset, entries).
    pub l1: Option<(u64, u32)>,
    /// New snapshot table: (offset, count).
    pub snapshots: Option<(u64, u32)>,
    /// New virtual size.
    pub size: Option<u64>,
}

impl<D: BlockDevice> Owner<'_, D> {
    /// Commits refcount changes `deltas` with the header fields `switch` (see the module
    /// doc): copies of the refcount blocks that change, a new refcount table, one header
    /// write. Everything `switch` names must be written already (it is flushed here before
    /// the header). Returns the host clusters whose refcount went to 0 (free once the
    /// caller, who installs the rest of the new state in memory without an await, hands
    /// them to the frees). Caller holds the metadata lock.
    pub(crate) async fn commit_shadow(
        &self,
        deltas: &Deltas,
        switch: HeaderSwitch,
    ) -> Result<Vec<u64>> {
        let m = self.meta();
        let bits = self.geo.cluster_bits;
        let per = self.per_block();
        let order = self.header.borrow().header.refcount_order;
        // Clusters for the block copies and the table, taken from the old structure. Taking
        // them may create refcount blocks or grow the table (in place, crash-safe as
        // always), so the set of blocks to copy is recomputed until what was taken fits.
        let mut pool: Vec<u64> = Vec::new();
        let mut rt_run: Option<(u64, u64)> = None;
        let mut surplus: Vec<u64> = Vec::new();
        let (set, mut extra, rt_clusters) = loop {
            // The clusters taken so far count 1 on disk (a leak until the switch); the
            // switch's flush below makes them stable before the header names them.
            self.writeback_mode(true).await?;
            let (rt_off, rt_clusters) = {
                let h = self.header.borrow();
                (
                    h.header.refcount_table_offset,
                    u64::from(h.header.refcount_table_clusters),
                )
            };
            // Changes that are not the caller's: the old table and unused clusters go.
            let mut extra: BTreeMap<u64, i64> = BTreeMap::new();
            for c in (rt_off >> bits)..(rt_off >> bits) + rt_clusters {
                *extra.entry(c).or_default() -= 1;
            }
            for &c in &surplus {
                *extra.entry(c).or_default() -= 1;
            }
            let mut set: BTreeSet<u64> = deltas.blocks.keys().copied().collect();
            set.extend(extra.keys().map(|c| c / per));
            // A replaced block's own cluster is freed: its counting block changes too.
            loop {
                let mut grew = false;
                for r in set.clone() {
                    let b = self.block_cluster(r)?;
                    grew |= set.insert(b / per);
                }
                if !grew {
                    break;
                }
            }
            let mut took = false;
            if rt_run.is_none_or(|(_, n)| n != rt_clusters) {
                if let Some((first, n)) = rt_run.take() {
                    surplus.extend(first..first + n);
                }
                let a = self.alloc_run(rt_clusters).await?;
                rt_run = Some((a.first.0, rt_clusters));
                took = true;
            }
            let need = set.len();
            while pool.len() < need {
                pool.push(self.alloc_clusters(1).await?.first.0);
                took = true;
            }
            if took {
                // Taking them may have changed the old structure: look again.
                continue;
            }
            if pool.len() > need {
                surplus.extend(pool.drain(need..));
                continue;
            }
            break (set, extra, rt_clusters);
        };
        // Each replaced block is freed; the block counting it (perhaps another) is in `set`.
        for &r in &set {
            *extra.entry(self.block_cluster(r)?).or_default() -= 1;
        }
        let Some((rt_first, _)) = rt_run else {
            return Err(corrupt(
                Field::RefcountTableOffset,
                0,
                "no new refcount table",
            ));
        };
        // The new blocks: the old contents with the changes, each in its new cluster.
        let mut table: Vec<u64> = self.refcount_table.borrow().clone();
        table.resize(((rt_clusters << bits) / 8) as usize, 0);
        let mut freed = Vec::new();
        let mut old_blocks = Vec::with_capacity(set.len());
        for (&r, &at) in set.iter().zip(&pool) {
            let old = self.block_cluster(r)? << bits;
            self.load_rc_block(old).await?;
            let mut bytes = self.with_rc_block(old, |b| b.to_vec());
            for i in 0..per {
                let c = r * per + i;
                let d = deltas.get(c) + extra.get(&c).copied().unwrap_or(0);
                if d == 0 {
                    continue;
                }
                let was = get_refcount(&bytes, order, i);
                let now = was.checked_add_signed(d).ok_or_else(|| {
                    corrupt(Field::RefcountBlockEntry, c, "refcount would go below 0")
                })?;
                set_refcount(&mut bytes, order, i, now)?;
                if was > 0 && now == 0 {
                    freed.push(c);
                }
            }
            let buf = self.exec.alloc_buf(self.dev, bytes.len());
            buf.copy_in(0, &bytes);
            self.exec
                .write(self.dev, at << bits, BufSlice::whole(buf))
                .await?;
            table[r as usize] = at << bits;
            old_blocks.push(old);
        }
        let mut tbytes = vec![0u8; (rt_clusters << bits) as usize];
        words_to_bytes(&table, &mut tbytes);
        let buf = self.exec.alloc_buf(self.dev, tbytes.len());
        buf.copy_in(0, &tbytes);
        self.exec
            .write(self.dev, rt_first << bits, BufSlice::whole(buf))
            .await?;
        if let Some(sh) = self.published() {
            for c in pool.iter().copied().chain(rt_first..rt_first + rt_clusters) {
                sh.set_meta_cluster(c);
            }
        }
        // Everything the new header names is stable before it (rules 1 and 4).
        self.exec.flush(self.dev).await?;
        let before = {
            let h = self.header.borrow();
            let hh = &h.header;
            (
                (hh.l1_table_offset, hh.l1_size),
                (hh.snapshots_offset, hh.nb_snapshots),
                hh.size,
                (hh.refcount_table_offset, hh.refcount_table_clusters),
            )
        };
        let rt_new = (rt_first << bits, rt_clusters as u32);
        set_header(&mut m.st_mut().header, switch, rt_new);
        let written = match self.write_header().await {
            Ok(()) => self.exec.flush(self.dev).await,
            Err(e) => Err(e),
        };
        if let Err(e) = written {
            // The old header stays the one the owner writes next.
            let old = HeaderSwitch {
                l1: Some(before.0),
                snapshots: Some(before.1),
                size: Some(before.2),
            };
            set_header(&mut m.st_mut().header, old, before.3);
            return Err(e);
        }
        // The switch is stable: the refcount side of the new state, in memory.
        {
            let mut h = self.header.borrow_mut();
            let hh = &mut h.header;
            hh.refcount_table_offset = rt_new.0;
            hh.refcount_table_clusters = rt_new.1;
            if let Some((off, n)) = switch.l1 {
                hh.l1_table_offset = off;
                hh.l1_size = n;
            }
            if let Some((off, n)) = switch.snapshots {
                hh.snapshots_offset = off;
                hh.nb_snapshots = n;
            }
            if let Some(s) = switch.size {
                hh.size = s;
            }
        }
        *self.refcount_table.borrow_mut() = table;
        let mut cache = self.rc_cache.borrow_mut();
        for b in old_blocks {
            cache.invalidate(b);
        }
        Ok(freed)
    }

    /// The host cluster of the refcount block at refcount-table index `r` (which must
    /// exist: every cluster a change touches has a refcount above 0).
    fn block_cluster(&self, r: u64) -> Result<u64> {
        let per = self.per_block();
        match self.rc_locate(r * per)? {
            Some((block, _)) => Ok(block >> self.geo.cluster_bits),
            None => Err(corrupt(
                Field::RefcountTableEntry,
                r,
                "a refcount change for clusters without a refcount block",
            )),
        }
    }
}

/// Sets the header writer's copy to the switched fields and refcount table `rt`.
fn set_header(w: &mut super::header::HeaderCopies, s: HeaderSwitch, rt: (u64, u32)) {
    w.set_refcount_table(rt.0, rt.1);
    if let Some((off, n)) = s.l1 {
        w.set_l1_table(off, n);
    }
    if let Some((off, n)) = s.snapshots {
        w.set_snapshot_table(off, n);
    }
    if let Some(size) = s.size {
        w.set_size(size);
    }
}
