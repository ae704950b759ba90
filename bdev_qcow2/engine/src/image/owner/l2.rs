//! L2 tables on the owner: making a slice dirty, changing its entries (the dirty copy and
//! the cache replica together), and new or copied (COPIED) tables.
//!
//! Invariant: an entry changes only in a dirty slice, and the owner's cache replica of that
//! slice (with its linear summary) changes in the same call; a new table's slices are dirty
//! (odd) before the L1 entry pointing at it is published (ARCHITECTURE.md §6).

use super::discards::FreeKind;
use super::Owner;
use crate::coherency::{SliceChange, SliceStamp};
use crate::error::{corrupt, Field, Result};
use crate::exec::read_bytes;
use crate::format::entries::{CopiedFlag, L1Entry, L2Entry, SubclusterBitmap};
use crate::image::Qcow2;
use crate::io::BlockDevice;
use crate::types::{GuestOffset, HostCluster, HostOffset, HostRange};

impl<D: BlockDevice> Qcow2<D> {
    /// Where the owner's dirty copy of `off`'s L2 entry lies in memory, if the slice is
    /// dirty: a prefetch hint like [`entry_hint`](Self::entry_hint), never dereferenced.
    /// `None` on any image but the owner.
    pub fn dirty_entry_hint(&self, off: GuestOffset) -> Option<*const u64> {
        let st = self.meta_state()?.try_st()?;
        let b = st.dirty.slice(self.geo.slice_id(off))?;
        let i = self.geo.index_in_slice(off) as usize * if self.geo.extended_l2() { 2 } else { 1 };
        b.get(i).map(|e| e as *const u64)
    }

    /// On the owner: caches the slice of `off` from its dirty copy when the cache does not
    /// hold it and `off`'s entry is plain data (COPIED too when `copied`: what a write in
    /// place needs), so that the direct path finds it (a new table's slices are not cached
    /// as the table is made, `new_l2_table`). True when it cached the slice.
    pub(crate) fn cache_dirty_for_direct(&self, off: GuestOffset, copied: bool) -> bool {
        let Some(st) = self.meta_state().and_then(|m| m.try_st()) else {
            return false;
        };
        let key = self.geo.slice_id(off);
        let Some(b) = st.dirty.slice(key) else {
            return false;
        };
        // An unallocated or zero cluster is engine work all the same.
        let (entry, _) = self.words_in(b, off);
        let ctx = self.ctx.get();
        let usable = entry
            .plain_data(ctx.cluster_bits, ctx.device_size)
            .is_some_and(|(_, c)| c || !copied);
        if !usable || self.l2_cache.borrow().peek(key).is_some() {
            return false;
        }
        self.cache_slice(key, SliceStamp::OWNER, |w| w.copy_from_slice(b));
        true
    }

    /// `off`'s L2 words (entry, and bitmap with extended L2, else empty) in slice words `b`.
    fn words_in(&self, b: &[u64], off: GuestOffset) -> (L2Entry, SubclusterBitmap) {
        let i = self.geo.index_in_slice(off) as usize;
        if self.geo.extended_l2() {
            (L2Entry(b[2 * i]), SubclusterBitmap(b[2 * i + 1]))
        } else {
            (L2Entry(b[i]), SubclusterBitmap(0))
        }
    }
}

impl<D: BlockDevice> Owner<'_, D> {
    /// Makes the slice holding `off`'s L2 entry dirty (loading it if needed). The L2 table
    /// must exist (see [`ensure_l2`](Self::ensure_l2)).
    pub(crate) async fn dirty_slice_for(&self, off: GuestOffset) -> Result<()> {
        let m = self.meta();
        let key = self.geo.slice_id(off);
        if m.st().dirty.has_slice(key) {
            return Ok(());
        }
        // Boxed: a slice becomes dirty once per write-back, and the write path's
        // per-request future stays small.
        let Some(w) = Box::pin(self.load_slice(off)).await? else {
            return Err(corrupt(
                Field::L1Entry,
                off.0,
                "no L2 table for a dirty slice",
            ));
        };
        if m.st().dirty.has_slice(key) {
            return Ok(());
        }
        let cache = self.l2_cache.borrow();
        // Dirty but unchanged: nothing removed.
        m.st_mut().dirty.put_slice(
            key,
            cache.block(w).to_vec(),
            self.published(),
            SliceChange::Adds,
        );
        Ok(())
    }

    /// Reads the L2 words of `off`'s entry, undecoded (`(entry, bitmap)`; bitmap 0 without
    /// extended L2). The slice must be dirty or cached.
    pub(crate) async fn l2_words(&self, off: GuestOffset) -> Result<(L2Entry, SubclusterBitmap)> {
        let key = self.geo.slice_id(off);
        // The dirty copy first: a new table's slices are not cached (`new_l2_table`).
        if let Some(b) = self.meta().st().dirty.slice(key) {
            return Ok(self.words_in(b, off));
        }
        let Some(way) = self.load_slice(off).await? else {
            return Ok((L2Entry::UNALLOCATED, SubclusterBitmap(0)));
        };
        if let Some(b) = self.meta().st().dirty.slice(key) {
            return Ok(self.words_in(b, off));
        }
        let cache = self.l2_cache.borrow();
        Ok(self.words_in(cache.block(way), off))
    }

    /// [`l2_words`](Self::l2_words) from memory: `None` when the slice is neither dirty nor
    /// cached, or is being written back.
    pub(crate) fn l2_words_now(&self, off: GuestOffset) -> Option<(L2Entry, SubclusterBitmap)> {
        let key = self.geo.slice_id(off);
        let st = self.meta().st();
        if let Some(b) = st.dirty.slice(key) {
            return Some(self.words_in(b, off));
        }
        if st.dirty.is_writing(key) {
            return None;
        }
        let mut cache = self.l2_cache.borrow_mut();
        let w = cache.lookup(key, 0)?;
        Some(self.words_in(cache.block(w), off))
    }

    /// `f` of the L2 entries of `off`'s slice, dirty or cached, from `off`'s on (standard
    /// L2 only; `None` with extended L2, or when [`l2_words_now`](Self::l2_words_now) would
    /// give `None`): one look-up for the entries of a run of clusters.
    pub(crate) fn with_entries_now<R>(
        &self,
        off: GuestOffset,
        f: impl FnOnce(&[u64]) -> R,
    ) -> Option<R> {
        if self.geo.extended_l2() {
            return None;
        }
        let key = self.geo.slice_id(off);
        let i = self.geo.index_in_slice(off) as usize;
        let st = self.meta().st();
        if let Some(b) = st.dirty.slice(key) {
            return b.get(i..).map(f);
        }
        if st.dirty.is_writing(key) {
            return None;
        }
        let mut cache = self.l2_cache.borrow_mut();
        let w = cache.lookup(key, 0)?;
        cache.block(w).get(i..).map(f)
    }

    /// Sets `off`'s L2 entry (and bitmap with extended L2) in the dirty slice and the
    /// cache replica. [`dirty_slice_for`](Self::dirty_slice_for) must have run.
    pub(crate) fn set_l2_words(
        &self,
        off: GuestOffset,
        entry: L2Entry,
        bitmap: SubclusterBitmap,
    ) -> Result<()> {
        self.set_l2_entries(&[L2Update { off, entry, bitmap }])
    }

    /// [`set_l2_words`](Self::set_l2_words) of each update, in order: one look-up of the
    /// dirty slice and of its cache replica per run of updates in one slice, not one per
    /// entry (a first write at small clusters maps a granule of them, #48).
    pub(crate) fn set_l2_entries(&self, updates: &[L2Update]) -> Result<()> {
        let mut rest = updates;
        while let Some(first) = rest.first() {
            let key = self.geo.slice_id(first.off);
            let n = rest
                .iter()
                .take_while(|u| self.geo.slice_id(u.off) == key)
                .count();
            let (run, next) = rest.split_at(n);
            self.set_in_slice(key, run)?;
            rest = next;
        }
        Ok(())
    }

    /// [`set_l2_entries`](Self::set_l2_entries) of updates all in slice `key`.
    fn set_in_slice(&self, key: u64, updates: &[L2Update]) -> Result<()> {
        let ext = self.geo.extended_l2();
        let index = |u: &L2Update| self.geo.index_in_slice(u.off) as usize;
        // The words an update leaves: its entry, and its bitmap with extended L2 (else 0).
        let words = |u: &L2Update| (u.entry.0, if ext { u.bitmap.0 } else { 0 });
        // The direct path must not use what it remembered of the slice before the change
        // (only standard slices are remembered as mapped).
        match ext {
            true => self.memo.forget(key),
            false => {
                for u in updates {
                    self.memo
                        .patch_mapped(key, index(u), self.memo_word(u.entry));
                }
            }
        }
        let get = |b: &[u64], i: usize| match ext {
            true => (b[2 * i], b[2 * i + 1]),
            false => (b[i], 0),
        };
        let put = |b: &mut [u64], i: usize, (entry, bitmap): (u64, u64)| {
            if ext {
                b[2 * i] = entry;
                b[2 * i + 1] = bitmap;
            } else {
                b[i] = entry;
            }
        };
        // A core may overwrite in place through an older copy of the slice only while
        // every change since it was taken kept what the copy shows in place (§6).
        let classify_and_put = |b: &mut [u64]| {
            let mut change = SliceChange::Adds;
            for u in updates {
                let i = index(u);
                let (old, new) = (get(b, i), words(u));
                put(b, i, new);
                let pair = |(e, m): (u64, u64)| (L2Entry(e), SubclusterBitmap(m));
                if !L2Entry::change_only_adds(pair(old), pair(new), ext) {
                    change = SliceChange::Removes;
                }
            }
            change
        };
        if !self
            .meta()
            .st_mut()
            .dirty
            .change_slice(key, self.published(), classify_and_put)
        {
            return Err(corrupt(Field::L2Entry, key, "L2 slice not dirty"));
        }
        let mut cache = self.l2_cache.borrow_mut();
        if let Some(w) = cache.probe(key, 0).map(|h| h.way) {
            let mut summary = cache.aux(w);
            for u in updates {
                let i = index(u);
                let (old, new) = (get(cache.block(w), i), words(u));
                put(cache.block_mut(w), i, new);
                summary
                    .linear
                    .changed(i, old, new, cache.block(w), self.geo.cluster_bits, ext);
            }
            cache.set_aux(w, summary);
        }
        Ok(())
    }

    /// Makes sure the L2 table covering `off` exists and is writable (COPIED): allocates a
    /// new one, or copies a table shared with a snapshot.
    pub(crate) async fn ensure_l2(&self, off: GuestOffset) -> Result<()> {
        let (idx, old) = match self.writable_l2(off)? {
            Ok(()) => return Ok(()),
            Err(x) => x,
        };
        // Boxed: a new table is rare, and the write path's per-request future stays small.
        Box::pin(self.new_l2_table(idx, old)).await
    }

    /// `Ok(())` when the L2 table covering `off` exists and is COPIED (writable in place),
    /// else `Err((L1 index, its current table))` for [`ensure_l2`](Self::ensure_l2).
    #[allow(clippy::type_complexity)]
    pub(crate) fn writable_l2(
        &self,
        off: GuestOffset,
    ) -> Result<std::result::Result<(), (u64, Option<HostOffset>)>> {
        let idx = self.geo.l1_index(off);
        let e = self.l1.borrow()[idx as usize];
        let old = e.l2_table(self.geo.cluster_size(), self.device_size.get())?;
        Ok(if old.is_some() && e.is_copied() {
            Ok(())
        } else {
            Err((idx, old))
        })
    }

    /// [`ensure_l2`](Self::ensure_l2) without I/O, for a write planned on the spot: when
    /// the L1 entry of `off` is empty and a cluster for the new table is found in memory,
    /// makes a zeroed table as `ensure_l2` would. Returns whether the table covering `off`
    /// exists and is writable now (`Ok(false)`: the write's task makes or copies it).
    /// Caller holds the lock or awaits nothing between its checks and this.
    pub(crate) fn ensure_l2_now(&self, off: GuestOffset) -> Result<bool> {
        let idx = match self.writable_l2(off)? {
            Ok(()) => return Ok(true),
            Err((idx, None)) => idx,
            // A table shared with a snapshot is read first: the task's.
            Err((_, Some(_))) => return Ok(false),
        };
        let Some(run) = self.alloc_clusters_now(1)? else {
            return Ok(false);
        };
        self.install_l2_table(idx, run.first, None);
        Ok(true)
    }

    /// Allocates a new L2 table for L1 index `idx` (a copy of `old`, or zeros), dirty in
    /// memory, and points the L1 entry at it. Caller holds the lock.
    async fn new_l2_table(&self, idx: u64, old: Option<HostOffset>) -> Result<()> {
        let m = self.meta();
        let cs = self.geo.cluster_size();
        let start = self.alloc_clusters(1).await?.first;
        // A copy of a shared table, else none: a new table is zeros, made per slice below.
        let copied: Option<Vec<u64>> = match old {
            Some(t) => {
                let raw = read_bytes(&self.exec, self.dev, t.0, cs).await?;
                // The active L1 no longer references the old table once L1 is stable.
                m.st_mut()
                    .frees
                    .free_later(HostRange::new(t, cs), FreeKind::Other);
                Some(
                    raw.chunks_exact(8)
                        .map(|c| u64::from_be_bytes(c.try_into().unwrap_or([0; 8])))
                        .collect(),
                )
            }
            None => None,
        };
        self.install_l2_table(idx, start, copied);
        Ok(())
    }

    /// Points L1 entry `idx` at the table in host cluster `start` (taken for it): its
    /// slices dirty in memory, `copied`'s words or zeros.
    fn install_l2_table(&self, idx: u64, start: HostCluster, copied: Option<Vec<u64>>) {
        let m = self.meta();
        let new = self.geo.host_cluster_offset(start);
        let slice_words = ((1u64 << self.geo.slice_bits) / 8) as usize;
        let slices = self.geo.slices_per_l2();
        let first_slice = idx * slices;
        {
            let mut st = m.st_mut();
            for s in 0..slices {
                let words = match &copied {
                    Some(c) => c[s as usize * slice_words..][..slice_words].to_vec(),
                    None => vec![0; slice_words],
                };
                // A new table replaces whatever a core may hold for these slices.
                st.dirty.put_slice(
                    first_slice + s,
                    words,
                    self.published(),
                    SliceChange::Removes,
                );
            }
            st.dirty.dirty_l1(idx);
            st.index.insert(start.0);
            if let Some(sh) = self.published() {
                sh.set_meta_cluster(start.0);
            }
        }
        match &copied {
            // The owner's cache holds a copied table's slices too (what it held of the old
            // one is replaced): its look-ups (the direct path's among them) find them at once.
            Some(c) => {
                for (s, chunk) in c.chunks(slice_words).enumerate() {
                    self.cache_slice(first_slice + s as u64, SliceStamp::OWNER, |b| {
                        b.copy_from_slice(chunk)
                    });
                }
            }
            // A new table's slices stay out of the cache until a look-up needs them
            // (`load_slice`, or the direct path's route: `cache_dirty_for_direct`): a fresh
            // image's random first writes never look them up, and filling a cache way
            // took most of a new table's cost (the first touch of its memory; #48).
            None => {
                let mut cache = self.l2_cache.borrow_mut();
                for s in 0..slices {
                    cache.invalidate(first_slice + s);
                    self.memo.forget(first_slice + s);
                }
            }
        }
        let entry = L1Entry::new(new, CopiedFlag::Set);
        self.l1.borrow_mut()[idx as usize] = entry;
        // Published after the new table's slices went odd (ARCHITECTURE.md §6).
        if let Some(sh) = self.published() {
            sh.set_l1(idx as usize, entry.0);
        }
    }
}

/// One L2 entry to set ([`Owner::set_l2_entries`]).
#[derive(Clone, Copy)]
pub(crate) struct L2Update {
    /// A guest offset in the entry's cluster.
    pub(crate) off: GuestOffset,
    /// The new entry.
    pub(crate) entry: L2Entry,
    /// The new subcluster bitmap (extended L2; ignored otherwise).
    pub(crate) bitmap: SubclusterBitmap,
}
