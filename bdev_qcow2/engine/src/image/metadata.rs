//! Where the image's own metadata lies (the overlap check of every data write, §7 rule 6)
//! and its refcount blocks as cached on this core.

use super::owner;
use super::Qcow2;
use crate::error::Result;
use crate::exec::read_bytes;
use crate::format::refcount::{entries_per_block, get_refcount, refcount_block_offset};
use crate::io::BlockDevice;
use crate::types::HostOffset;

impl<D: BlockDevice> Qcow2<D> {
    /// Calls `f(offset, bytes)` for each metadata range the header and snapshot table
    /// name (header cluster, L1, refcount table, snapshot table, snapshot L1s) until it
    /// returns true; returns whether it did.
    pub(crate) fn any_static_metadata(&self, mut f: impl FnMut(u64, u64) -> bool) -> bool {
        let cs = self.geo.cluster_size();
        let h = self.header.borrow();
        let hh = &h.header;
        f(0, cs)
            || f(hh.l1_table_offset, u64::from(hh.l1_size) * 8)
            || f(
                hh.refcount_table_offset,
                u64::from(hh.refcount_table_clusters) << self.geo.cluster_bits,
            )
            || (hh.nb_snapshots > 0 && f(hh.snapshots_offset, cs))
            || self
                .snapshots
                .borrow()
                .iter()
                .any(|s| f(s.l1_table_offset, u64::from(s.l1_size) * 8))
    }

    /// Clusters of refcount blocks and active L2 tables, from the refcount table and L1.
    pub(crate) fn table_clusters(&self) -> owner::HashSet<u64> {
        let cs = self.geo.cluster_size();
        let mut set = owner::HashSet::default();
        for e in self.refcount_table.borrow().iter() {
            if *e != 0 && e % cs == 0 {
                set.insert(e >> self.geo.cluster_bits);
            }
        }
        for e in self.l1.borrow().iter() {
            if let Ok(Some(t)) = e.l2_table(cs, u64::MAX) {
                set.insert(t.0 >> self.geo.cluster_bits);
            }
        }
        set
    }

    /// Whether host bytes `[off, off+len)` overlap the image's own metadata (header, L1,
    /// refcount table and blocks, active L2 tables, snapshot table and snapshot L1s).
    pub(crate) fn overlaps_metadata(&self, off: HostOffset, len: u64) -> bool {
        let off = off.0;
        // The cores' bitmap marks every metadata cluster (and some that were, never
        // cleared): a range it marks nowhere is not metadata, in a bit test per cluster.
        if let Some(sh) = self.shared() {
            let bits = self.geo.cluster_bits;
            let (first, last) = (off >> bits, (off + len.max(1) - 1) >> bits);
            if (first..=last).all(|c| !sh.is_meta_cluster(c)) {
                return false;
            }
        }
        let hit = |start: u64, bytes: u64| {
            bytes > 0 && off < start.saturating_add(bytes) && start < off.saturating_add(len)
        };
        if self.any_static_metadata(hit) {
            return true;
        }
        if let Some(m) = self.meta_state() {
            let st = m.st();
            let first = off >> self.geo.cluster_bits;
            let last = (off + len.max(1) - 1) >> self.geo.cluster_bits;
            if st.index.any_in(first, last) {
                return true;
            }
        }
        false
    }

    /// Records the clusters of refcount blocks and L2 tables for the overlap check.
    pub(crate) fn index_metadata(&self) {
        let Some(m) = self.meta_state() else { return };
        m.st_mut().index.reset(self.table_clusters());
    }

    /// Refcount of the host cluster containing `host_off` (through the refcount block
    /// cache, or the owner's dirty copy).
    pub async fn refcount(&self, host_off: u64) -> Result<u64> {
        let order = self.header.borrow().header.refcount_order;
        let Some((block, idx)) = self.rc_locate(host_off >> self.geo.cluster_bits)? else {
            return Ok(0);
        };
        self.load_rc_block(block).await?;
        Ok(self.with_rc_block(block, |b| get_refcount(b, order, idx)))
    }

    /// Where the refcount of host cluster `cluster` lives: (block offset, index in block),
    /// or `None` when no refcount block covers it (refcount 0).
    pub(crate) fn rc_locate(&self, cluster: u64) -> Result<Option<(u64, u64)>> {
        let h = self.header.borrow();
        let per_block = entries_per_block(h.header.cluster_bits, h.header.refcount_order);
        let rt_index = cluster / per_block;
        let Some(&entry) = self.refcount_table.borrow().get(rt_index as usize) else {
            return Ok(None);
        };
        let Some(block) =
            refcount_block_offset(entry, self.geo.cluster_size(), self.device_size.get())?
        else {
            return Ok(None);
        };
        Ok(Some((block.0, cluster % per_block)))
    }

    /// Makes sure refcount block `block` is in the cache (or the owner's dirty set).
    pub(crate) async fn load_rc_block(&self, block: u64) -> Result<()> {
        if self.meta_state().is_some_and(|m| m.has_dirty_rc(block)) {
            return Ok(());
        }
        if self.rc_cache.borrow_mut().lookup(block, 0).is_some() {
            return Ok(());
        }
        let raw = read_bytes(&self.exec, self.dev, block, self.geo.cluster_size()).await?;
        // Another task may have dirtied it meanwhile: the dirty copy wins.
        if self.meta_state().is_some_and(|m| m.has_dirty_rc(block)) {
            return Ok(());
        }
        self.rc_cache
            .borrow_mut()
            .insert_with(block, 0, |b| b.copy_from_slice(&raw));
        Ok(())
    }

    /// Runs `f` on refcount block `block`, which [`load_rc_block`](Self::load_rc_block)
    /// just loaded (no await in between). The owner's dirty copy wins over the cache.
    pub(crate) fn with_rc_block<R>(&self, block: u64, f: impl FnOnce(&[u8]) -> R) -> R {
        if let Some(m) = self.meta_state() {
            if let Some(b) = m.dirty_rc_ref(block) {
                return f(&b);
            }
        }
        let cache = self.rc_cache.borrow();
        match cache.probe(block, 0) {
            Some(h) => f(cache.block(h.way)),
            None => f(&vec![0u8; self.geo.cluster_size() as usize]),
        }
    }
}
