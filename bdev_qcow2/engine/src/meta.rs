//! The metadata owner's state for writes: dirty L2 slices and refcount blocks, the cluster
//! allocator, deferred frees, and the ordered write-back that keeps every crash state
//! consistent (ARCHITECTURE.md §7).
//!
//! Ordering is expressed as phases of one write-back, each a dependency of the next:
//! 1. refcount blocks (increments; new blocks are self-describing) — then a flush, then the
//!    refcount-table entries of new blocks — then a flush. That flush also makes every data
//!    write completed so far stable, so (rule 3) no L2 entry can reach the device before the
//!    data it points at.
//! 2. L2 slices (new tables whole) — then a flush — then L1 entries of new tables — flush.
//! 3. Frees: references removed by phase 2 are now stable, so the refcount decrements are
//!    applied and written — flush — and only then may the allocator reuse those clusters.
//! 4. The header, when a table moved.
//!
//! Every metadata mutation runs under `lock`, so a write-back sees a consistent set.

use crate::error::{corrupt, Error, Field, Result};
use crate::exec::{AsyncLock, Exec, WaitQueue};
use crate::format::header::ZeroedTail;
use crate::format::refcount::{entries_per_block, get_refcount, set_refcount};
use crate::format::{ImageHeader, L1Entry, L2Entry};
use crate::image::{read_bytes, Qcow2};
use crate::io::{BlockDevice, BufSlice, IoBuffer, SECTOR};
use crate::types::GuestOffset;
use std::cell::{Ref, RefCell};
use std::collections::{BTreeMap, BTreeSet};

/// Least time between two attempts to advance the grace period (`reclaim_graced`).
const ADVANCE_INTERVAL: std::time::Duration = std::time::Duration::from_micros(100);

/// Hash maps and sets of the owner's state: looked up on every allocating write, so with a
/// fast hasher (foldhash: seeded per process, far cheaper than SipHash on u64 keys).
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
type HashSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

/// Dirty metadata beyond which a commit writes back on its own (bounded memory).
const WRITEBACK_THRESHOLD_BYTES: u64 = 8 << 20;
/// How long dirty metadata must stay unchanged, waiting for a flush, before the owner
/// writes it back on its own ([`Qcow2::background_writeback_due`]): while the owner holds a
/// slice dirty, every core sends it the writes into that slice's clusters, even overwrites.
pub const BACKGROUND_WRITEBACK_INTERVAL: std::time::Duration = std::time::Duration::from_millis(10);
/// How long a failed background write-back waits before the next attempt.
const BACKGROUND_RETRY_DELAY: std::time::Duration = std::time::Duration::from_secs(1);

/// How many used clusters past the allocation hint an allocation planned on the spot
/// ([`Qcow2::alloc_clusters_now`]) skips before it leaves the search to the slow path.
const NOW_SCAN: u64 = 64;

/// Largest data region reserved at once for a run of guest clusters (see
/// [`Qcow2::alloc_data`]): a whole L2 slice up to this size, a part of one beyond.
const MAX_REGION_BYTES: u64 = 64 << 20;

/// The least step by which the zeroed tail is raised (see `raise_zeroed_tail`).
const ZEROED_TAIL_STEP_MIN: u64 = 1 << 20;

/// Host clusters reserved for the data clusters of one run of guest clusters (a slice, or
/// a part of one: [`MAX_REGION_BYTES`]): guest cluster `first + i` goes to host cluster
/// `start + i`, whatever order the guest writes them in. Kept in memory while the image
/// is open; after a reopen, a slice with data gets its region back from where that data
/// lies (`region_of_data`). With
/// `OpenOptions::ordered_layout` on devices that cannot grow only (see
/// [`Qcow2::alloc_data`]), where no cluster is fresh.
#[derive(Clone, Copy)]
pub(crate) struct Region {
    /// First host cluster; 0 when no region could be reserved (the data goes anywhere).
    pub start: u64,
    /// Clusters reserved.
    pub len: u64,
}

/// Owner-side mutable state.
pub(crate) struct MetaState {
    /// Dirty L2 slices by slice id (authoritative; the cache holds replicas). A hash map:
    /// every allocating write looks its slice up (a B-tree walk was a chain of cache
    /// misses); the write-back sorts the ids.
    pub dirty_l2: HashMap<u64, Vec<u64>>,
    /// Slices taken by the write-back in progress, until their write completes (still
    /// newer than the device).
    pub writing_l2: HashMap<u64, Vec<u64>>,
    /// Dirty-slice counts per epoch slot (when the image is shared with other cores).
    pub epochs: crate::coherency::OwnerEpochs,
    /// Dirty refcount blocks by host offset (authoritative).
    pub dirty_rc: BTreeMap<u64, Vec<u8>>,
    /// L1 indices changed since the last write-back.
    pub dirty_l1: BTreeSet<u64>,
    /// Refcount-table indices changed since the last write-back.
    pub dirty_rt: BTreeSet<u64>,
    /// Host byte ranges whose reference was removed in not-yet-stable metadata.
    pub pending_frees: Vec<(u64, u64)>,
    /// Clusters whose refcount dropped to 0 but is not yet stable: not reusable.
    pub unstable_frees: HashSet<u64>,
    /// Freed clusters (stable) waiting for a grace period before reuse, by the generation
    /// they were freed in (shared images: a core may still use the old mapping).
    pub graced: std::collections::VecDeque<(u64, Vec<u64>)>,
    /// The same clusters, for the allocator.
    pub graced_set: HashSet<u64>,
    /// When the owner last tried to advance the grace period (see `reclaim_graced`).
    pub last_advance: Option<std::time::Instant>,
    /// Since when the dirty metadata has not changed, and its signature then (clusters
    /// allocated, dirty L2 slices, dirty refcount blocks): [`Qcow2::background_writeback_due`].
    pub quiet: Option<(std::time::Instant, (u64, usize, usize))>,
    /// A background write-back task is running.
    pub background_running: bool,
    /// Where the next free-cluster search starts.
    pub alloc_hint: u64,
    /// Data regions by region index (guest cluster / region length): see [`Region`].
    pub regions: HashMap<u64, Region>,
    /// First host cluster → end of every reserved region, for the allocator to keep
    /// other clusters out of them.
    pub region_ends: BTreeMap<u64, u64>,
    /// Where the search for the next region starts.
    pub region_top: u64,
    /// How many times the refcount table grew since open: an allocation that scanned for
    /// free clusters while it grew starts over (the new table may lie on its candidates).
    pub rt_grows: u64,
    /// Clusters at or past this index were never written since open (they read as zeros).
    pub fresh_from: u64,
    /// Guest clusters with an allocation in flight (writers of the same cluster wait).
    pub inflight: Inflight,
    /// The first sector of the image as on disk; header updates patch it.
    pub sector0: Vec<u8>,
    /// Whether `sector0` must be written.
    pub header_dirty: bool,
    /// `sector0` as last written: the zeroed tail is raised by writing it with nothing
    /// else changed.
    pub sector0_disk: Vec<u8>,
    /// The zeroed tail as on disk ([`ZeroedTail`]), when the image has one and this writer
    /// keeps it: nothing is written at or past `from` before `from` is raised past it.
    pub zeroed_tail: Option<ZeroedTail>,
    /// Whether we set the dirty bit on disk (lazy refcounts) and must clear it.
    pub dirty_bit_on_disk: bool,
    /// Cluster indices of refcount blocks and active L2 tables (overlap check).
    pub meta_clusters: HashSet<u64>,
    /// Counters ([`Qcow2::owner_stats`]).
    pub stats: OwnerStats,
}

impl MetaState {
    /// Notes clusters `start..start + count` taken: whether they are fresh (never written:
    /// at or past every cluster taken before), and they are not fresh any more.
    fn take_fresh(&mut self, start: u64, count: u64) -> bool {
        let fresh = start >= self.fresh_from;
        self.fresh_from = self.fresh_from.max(start + count);
        fresh
    }

    /// The first cluster of the zeroed tail (`None`: no tail is kept): clusters below it may
    /// be written.
    fn zeroed_tail_cluster(&self, cluster_bits: u32) -> Option<u64> {
        self.zeroed_tail.map(|z| z.from >> cluster_bits)
    }

    /// What changes whenever metadata is allocated or newly dirtied (the quiet write-back's
    /// test that nothing happened).
    fn change_signature(&self) -> (u64, usize, usize) {
        (
            self.stats.clusters_allocated,
            self.dirty_l2.len(),
            self.dirty_rc.len(),
        )
    }
}

/// Counters of the metadata owner (writable image).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct OwnerStats {
    /// Host clusters allocated (data, L2 tables, refcount blocks).
    pub clusters_allocated: u64,
    /// Writes that change metadata (allocating ones, extended-L2 bitmaps, zero flags)
    /// planned on the spot, without a planning task (their metadata was in memory and the
    /// metadata lock free).
    pub writes_planned_now: u64,
    /// L2 slices written back to the device.
    pub l2_slices_written: u64,
    /// Metadata write-back passes (refcounts, flush, L2 slices, L1; on FLUSH, on close
    /// and when the dirty metadata passes its threshold).
    pub writebacks: u64,
    /// Times the zeroed tail was raised on disk ([`ZeroedTail`]).
    pub zeroed_tail_raises: u64,
}

/// Guest clusters with an allocation in flight: a handful at a time, looked up by every
/// write the owner plans (hashed; an empty set answers without hashing).
#[derive(Debug, Default)]
pub struct Inflight(HashSet<u64>);

impl Inflight {
    /// Whether guest cluster `c` has an allocation in flight.
    #[inline]
    pub fn contains(&self, c: u64) -> bool {
        !self.0.is_empty() && self.0.contains(&c)
    }
    /// Whether any of guest clusters `first..=last` has one.
    pub fn any(&self, first: u64, last: u64) -> bool {
        !self.0.is_empty() && (first..=last).any(|c| self.0.contains(&c))
    }
    /// Marks guest clusters `first..=last`.
    pub fn mark(&mut self, first: u64, last: u64) {
        self.0.extend(first..=last);
    }
    /// Unmarks guest clusters `first..=last`.
    pub fn unmark(&mut self, first: u64, last: u64) {
        for c in first..=last {
            self.0.remove(&c);
        }
    }
}

/// The owner: lock, in-flight waiters and state.
pub struct Meta<D: BlockDevice> {
    pub(crate) lock: AsyncLock<D>,
    pub(crate) inflight_wait: WaitQueue<D>,
    pub(crate) st: RefCell<MetaState>,
    /// `OpenOptions::ordered_layout`.
    pub(crate) ordered_layout: bool,
}

impl<D: BlockDevice> Meta<D> {
    pub(crate) fn new(
        exec: &Exec<D>,
        header: &ImageHeader,
        c0: &[u8],
        device_size: u64,
        ordered_layout: bool,
    ) -> Self {
        let cs = header.cluster_size();
        let mut sector0 = vec![0u8; SECTOR as usize];
        let n = c0.len().min(sector0.len());
        sector0[..n].copy_from_slice(&c0[..n]);
        let end = device_size.div_ceil(cs);
        // Past a zeroed tail (in the first sector, where we keep it), clusters read as zeros
        // from the start.
        let zeroed_tail = header.extensions.zeroed_tail.filter(|z| z.at + 8 <= SECTOR);
        let fresh_from = zeroed_tail.map_or(end, |z| z.from.div_ceil(cs).min(end));
        Meta {
            lock: AsyncLock::new(exec),
            inflight_wait: WaitQueue::new(exec),
            ordered_layout,
            st: RefCell::new(MetaState {
                dirty_l2: HashMap::default(),
                writing_l2: HashMap::default(),
                epochs: Default::default(),
                dirty_rc: BTreeMap::new(),
                dirty_l1: BTreeSet::new(),
                dirty_rt: BTreeSet::new(),
                pending_frees: Vec::new(),
                unstable_frees: HashSet::default(),
                graced: Default::default(),
                graced_set: HashSet::default(),
                last_advance: None,
                quiet: None,
                background_running: false,
                alloc_hint: 0,
                regions: HashMap::default(),
                region_ends: BTreeMap::new(),
                region_top: 0,
                rt_grows: 0,
                fresh_from,
                inflight: Inflight::default(),
                sector0_disk: sector0.clone(),
                sector0,
                header_dirty: false,
                zeroed_tail,
                dirty_bit_on_disk: false,
                meta_clusters: HashSet::default(),
                stats: OwnerStats::default(),
            }),
        }
    }

    /// A copy of a dirty L2 slice (or one being written back), if the owner holds one.
    pub(crate) fn dirty_slice(&self, key: u64) -> Option<Vec<u64>> {
        let st = self.st.borrow();
        st.dirty_l2
            .get(&key)
            .or_else(|| st.writing_l2.get(&key))
            .cloned()
    }
    /// Whether refcount block `block` is dirty.
    pub(crate) fn has_dirty_rc(&self, block: u64) -> bool {
        self.st.borrow().dirty_rc.contains_key(&block)
    }
    /// The dirty copy of refcount block `block`.
    pub(crate) fn dirty_rc_ref(&self, block: u64) -> Option<Ref<'_, Vec<u8>>> {
        Ref::filter_map(self.st.borrow(), |s| s.dirty_rc.get(&block)).ok()
    }
}

fn words_to_bytes(words: &[u64], out: &mut [u8]) {
    for (c, w) in out.chunks_exact_mut(8).zip(words) {
        c.copy_from_slice(&w.to_be_bytes());
    }
}

impl<D: BlockDevice> Qcow2<D> {
    /// The owner state, or `ReadOnly`.
    pub(crate) fn meta(&self) -> Result<&Meta<D>> {
        self.meta.as_ref().ok_or(Error::ReadOnly)
    }

    fn cluster_bits(&self) -> u32 {
        self.geo.cluster_bits
    }

    fn per_block(&self) -> u64 {
        let h = self.header.borrow();
        entries_per_block(h.header.cluster_bits, h.header.refcount_order)
    }

    /// Grows the device size entries may point at (clusters we allocated), and the device
    /// itself so that it covers them whole: another core may write the part of a new
    /// cluster this one did not (a file must not end inside it, or the owner's channel
    /// would trim that write away). Fixed-size devices refuse with ENOSPC.
    fn note_allocated(&self, end_cluster: u64) -> Result<()> {
        let end = end_cluster << self.cluster_bits();
        if end > self.device_size.get() {
            self.exec
                .with_device(self.dev, |d| d.ensure_size(end))
                .map_err(|e| Error::Io(e.0))?;
            self.device_size.set(end);
            let mut ctx = self.ctx.get();
            ctx.device_size = end;
            self.ctx.set(ctx);
            if let Some(sh) = &self.shared {
                sh.set_device_size(end);
            }
        }
        Ok(())
    }

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
                u64::from(hh.refcount_table_clusters) << self.cluster_bits(),
            )
            || (hh.nb_snapshots > 0 && f(hh.snapshots_offset, cs))
            || self
                .snapshots
                .iter()
                .any(|s| f(s.l1_table_offset, u64::from(s.l1_size) * 8))
    }

    /// Clusters of refcount blocks and active L2 tables, from the refcount table and L1.
    pub(crate) fn table_clusters(&self) -> HashSet<u64> {
        let cs = self.geo.cluster_size();
        let mut set = HashSet::default();
        for e in self.refcount_table.borrow().iter() {
            if *e != 0 && e % cs == 0 {
                set.insert(e >> self.cluster_bits());
            }
        }
        for e in self.l1.borrow().iter() {
            if let Ok(Some(t)) = e.l2_table(cs, u64::MAX) {
                set.insert(t.0 >> self.cluster_bits());
            }
        }
        set
    }

    /// Whether host bytes `[off, off+len)` overlap the image's own metadata (header, L1,
    /// refcount table and blocks, active L2 tables, snapshot table and snapshot L1s).
    pub(crate) fn overlaps_metadata(&self, off: u64, len: u64) -> bool {
        // The cores' bitmap marks every metadata cluster (and some that were, never
        // cleared): a range it marks nowhere is not metadata, in a bit test per cluster.
        if let Some(sh) = &self.shared {
            let bits = self.cluster_bits();
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
        if let Some(m) = &self.meta {
            let st = m.st.borrow();
            let first = off >> self.cluster_bits();
            let last = (off + len.max(1) - 1) >> self.cluster_bits();
            if (first..=last).any(|c| st.meta_clusters.contains(&c)) {
                return true;
            }
        }
        false
    }

    /// Records the clusters of refcount blocks and L2 tables for the overlap check.
    pub(crate) fn index_metadata(&self) {
        let Some(m) = &self.meta else { return };
        m.st.borrow_mut().meta_clusters = self.table_clusters();
    }

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
        if let Some(m) = &self.meta {
            let sector = {
                let mut st = m.st.borrow_mut();
                let v = crate::format::be::get_u64(&st.sector0, 72)
                    | crate::format::header::incompat::CORRUPT;
                if crate::format::be::get_u32(&st.sector0, 4) == 3 {
                    crate::format::be::put_u64(&mut st.sector0, 72, v);
                }
                st.sector0_disk = st.sector0.clone();
                st.sector0.clone()
            };
            let buf = self.exec.alloc_buf(self.dev, sector.len());
            buf.copy_in(0, &sector);
            let _ = self.exec.write(self.dev, 0, BufSlice::whole(buf)).await;
            let _ = self.exec.flush(self.dev).await;
            self.header.borrow_mut().header.incompatible_features |=
                crate::format::header::incompat::CORRUPT;
        }
        corrupt(field, value, reason)
    }

    // ----- L2 -----------------------------------------------------------------------

    /// Makes the slice holding `off`'s L2 entry dirty (loading it if needed). The L2 table
    /// must exist (see [`ensure_l2`](Self::ensure_l2)).
    pub(crate) async fn dirty_slice_for(&self, off: GuestOffset) -> Result<()> {
        let m = self.meta()?;
        let key = self.geo.slice_id(off);
        if m.st.borrow().dirty_l2.contains_key(&key) {
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
        if m.st.borrow().dirty_l2.contains_key(&key) {
            return Ok(());
        }
        let cache = self.l2_cache.borrow();
        let mut st = m.st.borrow_mut();
        let st = &mut *st;
        st.dirty_l2.insert(key, cache.block(w).to_vec());
        if let Some(s) = &self.shared {
            st.epochs.dirtied(s, key);
        }
        Ok(())
    }

    /// Where the owner's dirty copy of `off`'s L2 entry lies in memory, if the slice is
    /// dirty: a prefetch hint like [`entry_hint`](Self::entry_hint), never dereferenced.
    pub fn dirty_entry_hint(&self, off: GuestOffset) -> Option<*const u64> {
        let m = self.meta.as_ref()?;
        let st = m.st.try_borrow().ok()?;
        let b = st.dirty_l2.get(&self.geo.slice_id(off))?;
        let i = self.geo.index_in_slice(off) as usize * if self.geo.extended_l2 { 2 } else { 1 };
        b.get(i).map(|e| e as *const u64)
    }

    /// Reads the raw L2 words of `off`'s entry (`(entry, bitmap)`; bitmap 0 without
    /// extended L2). The slice must be dirty or cached.
    pub(crate) async fn l2_words(&self, off: GuestOffset) -> Result<(u64, u64)> {
        let Some(way) = self.load_slice(off).await? else {
            return Ok((0, 0));
        };
        let key = self.geo.slice_id(off);
        if let Some(m) = &self.meta {
            if let Some(b) = m.st.borrow().dirty_l2.get(&key) {
                return Ok(self.words_in(b, off));
            }
        }
        let cache = self.l2_cache.borrow();
        Ok(self.words_in(cache.block(way), off))
    }

    /// `off`'s L2 words (entry, and bitmap with extended L2, else 0) in slice words `b`.
    fn words_in(&self, b: &[u64], off: GuestOffset) -> (u64, u64) {
        let i = self.geo.index_in_slice(off) as usize;
        if self.geo.extended_l2 {
            (b[2 * i], b[2 * i + 1])
        } else {
            (b[i], 0)
        }
    }

    /// [`l2_words`](Self::l2_words) from memory, on the owner: `None` when the slice is
    /// neither dirty nor cached, or is being written back.
    pub(crate) fn l2_words_now(&self, off: GuestOffset) -> Option<(u64, u64)> {
        let key = self.geo.slice_id(off);
        let st = self.meta.as_ref()?.st.borrow();
        if let Some(b) = st.dirty_l2.get(&key) {
            return Some(self.words_in(b, off));
        }
        if st.writing_l2.contains_key(&key) {
            return None;
        }
        let mut cache = self.l2_cache.borrow_mut();
        let w = cache.lookup(key, 0)?;
        Some(self.words_in(cache.block(w), off))
    }

    /// Sets `off`'s L2 entry (and bitmap with extended L2) in the dirty slice and the
    /// cache replica. [`dirty_slice_for`](Self::dirty_slice_for) must have run.
    pub(crate) fn set_l2_words(&self, off: GuestOffset, entry: u64, bitmap: u64) -> Result<()> {
        let m = self.meta()?;
        let key = self.geo.slice_id(off);
        let i = self.geo.index_in_slice(off) as usize;
        // The direct path must not use what it remembered of the slice before the change.
        self.memo.forget(key);
        let ext = self.geo.extended_l2;
        let put = |b: &mut [u64]| {
            if ext {
                b[2 * i] = entry;
                b[2 * i + 1] = bitmap;
            } else {
                b[i] = entry;
            }
        };
        {
            let mut st = m.st.borrow_mut();
            let st = &mut *st;
            let b = st
                .dirty_l2
                .get_mut(&key)
                .ok_or_else(|| corrupt(Field::L2Entry, key, "L2 slice not dirty"))?;
            put(b);
            if let Some(s) = &self.shared {
                st.epochs.changed(s, key);
            }
        }
        let mut cache = self.l2_cache.borrow_mut();
        if let Some(w) = cache.probe(key, 0).map(|h| h.way) {
            let old = if ext {
                (cache.block(w)[2 * i], cache.block(w)[2 * i + 1])
            } else {
                (cache.block(w)[i], 0)
            };
            put(cache.block_mut(w));
            let new = (entry, if ext { bitmap } else { 0 });
            let mut lin = cache.aux(w);
            lin.changed(i, old, new, cache.block(w), self.cluster_bits(), ext);
            cache.set_aux(w, lin);
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
    ) -> Result<std::result::Result<(), (u64, Option<crate::types::HostOffset>)>> {
        self.meta()?;
        let idx = self.geo.l1_index(off);
        let e = self.l1.borrow()[idx as usize];
        let old = e.l2_table(self.geo.cluster_size(), self.device_size.get())?;
        Ok(if old.is_some() && e.is_copied() {
            Ok(())
        } else {
            Err((idx, old))
        })
    }

    /// Allocates a new L2 table for L1 index `idx` (a copy of `old`, or zeros), dirty in
    /// memory, and points the L1 entry at it. Caller holds the lock.
    async fn new_l2_table(&self, idx: u64, old: Option<crate::types::HostOffset>) -> Result<()> {
        let m = self.meta()?;
        let cs = self.geo.cluster_size();
        let (start, _, _) = self.alloc_clusters(1).await?;
        let new = start << self.cluster_bits();
        let words_per_table = (cs / 8) as usize;
        let content: Vec<u64> = match old {
            Some(t) => {
                let raw = read_bytes(&self.exec, self.dev, t.0, cs).await?;
                // The active L1 no longer references the old table once L1 is stable.
                m.st.borrow_mut().pending_frees.push((t.0, cs));
                raw.chunks_exact(8)
                    .map(|c| u64::from_be_bytes(c.try_into().unwrap_or([0; 8])))
                    .collect()
            }
            None => vec![0; words_per_table],
        };
        let slice_words = ((1u64 << self.geo.slice_bits) / 8) as usize;
        let first_slice = idx * self.geo.slices_per_l2();
        {
            let mut st = m.st.borrow_mut();
            let st = &mut *st;
            for (s, chunk) in content.chunks(slice_words).enumerate() {
                let key = first_slice + s as u64;
                if st.dirty_l2.insert(key, chunk.to_vec()).is_none() {
                    if let Some(sh) = &self.shared {
                        st.epochs.dirtied(sh, key);
                    }
                } else if let Some(sh) = &self.shared {
                    st.epochs.changed(sh, key);
                }
            }
            st.dirty_l1.insert(idx);
            st.meta_clusters.insert(start);
            if let Some(sh) = &self.shared {
                sh.set_meta_cluster(start);
            }
        }
        // The owner's cache holds the new table's slices too (what it held of the old one
        // is replaced): its look-ups (the direct path's among them) find them at once.
        for (s, chunk) in content.chunks(slice_words).enumerate() {
            self.cache_slice(first_slice + s as u64, 0, |b| b.copy_from_slice(chunk));
        }
        let entry = L1Entry::new(crate::types::HostOffset(new), true);
        self.l1.borrow_mut()[idx as usize] = entry;
        // Published after the new table's slices went odd (ARCHITECTURE.md §6).
        if let Some(sh) = &self.shared {
            sh.set_l1(idx as usize, entry.0);
        }
        Ok(())
    }

    // ----- refcounts and allocation --------------------------------------------------

    /// Adds `delta` to the refcount of host cluster `cluster` (in the dirty copy). Never
    /// wraps: a refcount that would leave its range is corruption.
    pub(crate) async fn update_refcount(&self, cluster: u64, delta: i64) -> Result<u64> {
        let (block, idx) = self.ensure_rc_block(cluster).await?;
        self.load_rc_block(block).await?;
        self.update_loaded_refcount(block, idx, cluster, delta)
    }

    /// [`update_refcount`](Self::update_refcount) of host cluster `cluster` at index `idx`
    /// of refcount block `block`, which is dirty or cached (no await since it was loaded).
    fn update_loaded_refcount(
        &self,
        block: u64,
        idx: u64,
        cluster: u64,
        delta: i64,
    ) -> Result<u64> {
        let m = self.meta()?;
        let order = self.header.borrow().header.refcount_order;
        let mut st = m.st.borrow_mut();
        let b = match st.dirty_rc.entry(block) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(v) => {
                let bytes = {
                    let cache = self.rc_cache.borrow();
                    let w = cache.probe(block, 0).map(|h| h.way).ok_or_else(|| {
                        corrupt(
                            Field::RefcountBlockEntry,
                            block,
                            "refcount block evicted while in use",
                        )
                    })?;
                    cache.block(w).to_vec()
                };
                self.rc_cache.borrow_mut().invalidate(block);
                v.insert(bytes)
            }
        };
        let old = get_refcount(b, order, idx);
        let new = if delta >= 0 {
            old.checked_add(delta as u64)
        } else {
            old.checked_sub(delta.unsigned_abs())
        }
        .ok_or_else(|| corrupt(Field::RefcountBlockEntry, cluster, "refcount would wrap"))?;
        set_refcount(b, order, idx, new)?;
        Ok(new)
    }

    /// The refcount block covering host cluster `cluster`, allocating a self-describing
    /// block (placed at the first cluster of the range it covers) and growing the refcount
    /// table when needed. Returns (block offset, index within block).
    async fn ensure_rc_block(&self, cluster: u64) -> Result<(u64, u64)> {
        if let Some(loc) = self.rc_locate(cluster)? {
            return Ok(loc);
        }
        let m = self.meta()?;
        let per_block = self.per_block();
        let r = cluster / per_block;
        if r >= self.refcount_table.borrow().len() as u64 {
            Box::pin(self.grow_refcount_table(r + 1)).await?;
            if let Some(loc) = self.rc_locate(cluster)? {
                return Ok(loc);
            }
        }
        let b = r * per_block;
        let cs = self.geo.cluster_size();
        if self.overlaps_metadata(b << self.cluster_bits(), cs) {
            return Err(self
                .mark_corrupt(
                    Field::RefcountTableEntry,
                    b,
                    "new refcount block would overlap metadata",
                )
                .await);
        }
        // No zeroed tail to raise here: the block lies at the start of the range it covers,
        // at or before the cluster whose allocation asked for it, and that allocation raises
        // the tail past itself before anything is written (the block waits for a write-back).
        let order = self.header.borrow().header.refcount_order;
        let mut bytes = vec![0u8; cs as usize];
        set_refcount(&mut bytes, order, 0, 1)?;
        {
            let mut st = m.st.borrow_mut();
            st.dirty_rc.insert(b << self.cluster_bits(), bytes);
            st.dirty_rt.insert(r);
            st.meta_clusters.insert(b);
            if let Some(sh) = &self.shared {
                sh.set_meta_cluster(b);
            }
            st.take_fresh(b, 1);
        }
        self.refcount_table.borrow_mut()[r as usize] = b << self.cluster_bits();
        self.note_allocated(b + 1)?;
        Ok((b << self.cluster_bits(), cluster % per_block))
    }

    /// Replaces the refcount table by a larger one holding at least `min_entries`: the new
    /// table and the refcount blocks covering it are placed past every allocated cluster,
    /// written and flushed, then the header points at them, then the old table is freed.
    async fn grow_refcount_table(&self, min_entries: u64) -> Result<()> {
        let m = self.meta()?;
        let cs = self.geo.cluster_size();
        let bits = self.cluster_bits();
        let per_block = self.per_block();
        let order = self.header.borrow().header.refcount_order;
        let old: Vec<u64> = self.refcount_table.borrow().clone();
        let (old_off, old_clusters) = {
            let h = self.header.borrow();
            (
                h.header.refcount_table_offset,
                u64::from(h.header.refcount_table_clusters),
            )
        };
        // First make every pending refcount change stable in the old layout.
        self.writeback_mode(true).await?;
        m.st.borrow_mut().rt_grows += 1;
        // Past every allocated cluster on a device that grows; on one that cannot (a bdev),
        // the first free run inside it that holds the table and its new blocks.
        let dev_end = self.device_size.get() / cs;
        let can_grow = self.exec.with_device(self.dev, |d| d.can_grow());
        let mut start = if can_grow {
            m.st.borrow()
                .fresh_from
                .max(self.device_size.get().div_ceil(cs))
        } else {
            m.st.borrow().alloc_hint.max(1)
        };
        let mut wrapped = false;
        let (start, entries, table_clusters, missing) = loop {
            let mut entries = min_entries.max(old.len() as u64 * 2).max(cs / 8);
            let mut extra = 0u64;
            let (table_clusters, missing) = loop {
                let table_clusters = (entries * 8).div_ceil(cs);
                let end = start + table_clusters + extra;
                let (lo, hi) = (start / per_block, (end - 1) / per_block);
                if hi >= entries {
                    entries = hi + 1;
                    continue;
                }
                let missing: Vec<u64> = (lo..=hi)
                    .filter(|r| old.get(*r as usize).is_none_or(|e| *e == 0))
                    .collect();
                if missing.len() as u64 == extra {
                    break (table_clusters, missing);
                }
                extra = missing.len() as u64;
            };
            if can_grow {
                break (start, entries, table_clusters, missing);
            }
            let len = table_clusters + missing.len() as u64;
            if start + len > dev_end {
                if !wrapped {
                    // Nothing past the hint: look below it once.
                    wrapped = true;
                    start = 1;
                    continue;
                }
                return Err(Error::Io(28)); // ENOSPC
            }
            match self.first_busy(start, len).await? {
                None => break (start, entries, table_clusters, missing),
                Some(c) => start = c + 1,
            }
        };
        if table_clusters << bits > crate::limits::MAX_REFCOUNT_TABLE_BYTES {
            return Err(Error::UnsupportedFeature(
                "refcount table would exceed 8 MiB".into(),
            ));
        }
        let end = start + table_clusters + missing.len() as u64;
        self.raise_zeroed_tail(end).await?;
        let mut table = old.clone();
        table.resize(entries as usize, 0);
        // New blocks, right after the new table; each counts the new clusters in its range.
        for (i, r) in missing.iter().enumerate() {
            let at = start + table_clusters + i as u64;
            table[*r as usize] = at << bits;
            let mut bytes = vec![0u8; cs as usize];
            for c in (r * per_block).max(start)..((r + 1) * per_block).min(end) {
                set_refcount(&mut bytes, order, c % per_block, 1)?;
            }
            let buf = self.exec.alloc_buf(self.dev, cs as usize);
            buf.copy_in(0, &bytes);
            self.exec
                .write(self.dev, at << bits, BufSlice::whole(buf))
                .await?;
            m.st.borrow_mut().meta_clusters.insert(at);
            if let Some(sh) = &self.shared {
                sh.set_meta_cluster(at);
            }
        }
        self.note_allocated(end)?;
        // Existing blocks covering part of the new area count it too.
        *self.refcount_table.borrow_mut() = table.clone();
        for c in start..end {
            let r = c / per_block;
            if !missing.contains(&r) {
                self.update_refcount(c, 1).await?;
            }
        }
        // Write those blocks, then the new table, then flush.
        self.write_dirty_rc().await?;
        let mut tbytes = vec![0u8; (table_clusters << bits) as usize];
        words_to_bytes(&table, &mut tbytes);
        let buf = self.exec.alloc_buf(self.dev, tbytes.len());
        buf.copy_in(0, &tbytes);
        self.exec
            .write(self.dev, start << bits, BufSlice::whole(buf))
            .await?;
        self.exec.flush(self.dev).await?;
        if let Some(sh) = &self.shared {
            for c in start..start + table_clusters {
                sh.set_meta_cluster(c);
            }
        }
        // Then the header.
        {
            let mut h = self.header.borrow_mut();
            h.header.refcount_table_offset = start << bits;
            h.header.refcount_table_clusters = table_clusters as u32;
            let mut st = m.st.borrow_mut();
            crate::format::be::put_u64(&mut st.sector0, 48, start << bits);
            crate::format::be::put_u32(&mut st.sector0, 56, table_clusters as u32);
            st.header_dirty = true;
            st.dirty_rt.clear();
            st.fresh_from = st.fresh_from.max(end);
        }
        self.write_header().await?;
        self.exec.flush(self.dev).await?;
        // Finally the old table's clusters are free.
        m.st.borrow_mut()
            .pending_frees
            .push((old_off, old_clusters << bits));
        Ok(())
    }

    /// Allocates up to `n` contiguous free host clusters (at least one): refcounts become
    /// 1 (dirty). Returns (first cluster, count, fresh) where `fresh` means the clusters were
    /// never written since open and read as zeros.
    ///
    /// Data regions ([`Region`], on a device that cannot grow) are kept clear: only when
    /// nothing else in the device is free does a second pass take clusters inside them
    /// (and then, as without regions, past the end).
    pub(crate) async fn alloc_clusters(&self, n: u64) -> Result<(u64, u64, bool)> {
        if let Some(r) = self.alloc_clusters_now(n)? {
            return Ok(r);
        }
        let m = self.meta()?;
        self.reclaim_graced();
        let (start, count) = loop {
            let grows = m.st.borrow().rt_grows;
            let (start, count) = self.find_free_run(n).await?;
            // Checking a cluster past the refcount table's reach grows the table, and the
            // new table goes where it finds room: perhaps on the run found before.
            if m.st.borrow().rt_grows == grows {
                break (start, count);
            }
        };
        self.raise_zeroed_tail(start + count).await?;
        self.take_clusters(start, count).await?;
        self.allocated(start, count)
    }

    /// [`alloc_clusters`](Self::alloc_clusters) of exactly `n` clusters without I/O, for a
    /// write planned on the spot: `None`, having changed nothing, when the first free run
    /// from the allocation hint is shorter than `n`, is not found among the next
    /// [`NOW_SCAN`] clusters, or needs a refcount block loaded or created, or when data
    /// regions are kept clear. The caller holds the metadata lock or knows it is free.
    pub(crate) fn alloc_clusters_now(&self, n: u64) -> Result<Option<(u64, u64, bool)>> {
        let m = self.meta()?;
        if !m.st.borrow().region_ends.is_empty() {
            return Ok(None);
        }
        self.reclaim_graced();
        // Clusters past the zeroed tail wait for the tail to be raised (I/O).
        let tail = m.st.borrow().zeroed_tail_cluster(self.cluster_bits());
        let limit = self.alloc_limit().min(tail.unwrap_or(u64::MAX));
        let hint = m.st.borrow().alloc_hint.max(1);
        if n == 1 {
            // One cluster (the common first write): check and take in one look-up.
            for c in hint..(hint + NOW_SCAN).min(limit) {
                match self.take_if_free_now(c)? {
                    Some(true) => return self.allocated(c, 1).map(Some),
                    Some(false) => {}
                    None => return Ok(None),
                }
            }
            return Ok(None);
        }
        let mut start = hint;
        loop {
            if start >= hint + NOW_SCAN || start + n > limit {
                return Ok(None);
            }
            match self.cluster_is_free_now(start)? {
                Some(true) => break,
                Some(false) => start += 1,
                None => return Ok(None),
            }
        }
        for c in start + 1..start + n {
            if self.cluster_is_free_now(c)? != Some(true) {
                return Ok(None);
            }
        }
        for c in start..start + n {
            // Checked free and loaded above, nothing ran since.
            let Some((block, idx)) = self.rc_locate(c)? else {
                return Err(corrupt(
                    Field::RefcountBlockEntry,
                    c,
                    "refcount block vanished",
                ));
            };
            if self.update_loaded_refcount(block, idx, c, 1)? != 1 {
                return Err(corrupt(
                    Field::RefcountBlockEntry,
                    c,
                    "allocated cluster already in use",
                ));
            }
        }
        self.allocated(start, n).map(Some)
    }

    /// The bookkeeping of clusters `start..start + count` just taken: device size first
    /// (a device that cannot hold them fails the allocation, and their refcounts go back
    /// to 0: nothing is taken), then allocation hint, counters, freshness. Returns what
    /// the allocators return.
    fn allocated(&self, start: u64, count: u64) -> Result<(u64, u64, bool)> {
        let m = self.meta()?;
        if let Err(e) = self.note_allocated(start + count) {
            for c in start..start + count {
                // Their blocks are dirty (just taken from them).
                if let Ok(Some((block, idx))) = self.rc_locate(c) {
                    self.update_loaded_refcount(block, idx, c, -1)?;
                }
            }
            return Err(e);
        }
        let fresh = {
            let mut st = m.st.borrow_mut();
            st.alloc_hint = start + count;
            st.stats.clusters_allocated += count;
            st.take_fresh(start, count)
        };
        Ok((start, count, fresh))
    }

    /// The first run of up to `n` free host clusters from the allocation hint (see
    /// [`alloc_clusters`](Self::alloc_clusters)), not taken yet: (first cluster, count).
    async fn find_free_run(&self, n: u64) -> Result<(u64, u64)> {
        let m = self.meta()?;
        let hint = m.st.borrow().alloc_hint.max(1);
        let mut c = hint;
        let limit = self.alloc_limit();
        let mut keep_out = !m.st.borrow().region_ends.is_empty();
        // Regions exist only on devices that cannot grow: the first pass stays inside.
        let inside = (self.device_size.get() >> self.cluster_bits()).min(limit);
        let start = loop {
            if (keep_out && c >= inside) || c > limit {
                if keep_out {
                    // Below the hint everything but the regions' free slots is in use.
                    keep_out = false;
                    let first_region = m.st.borrow().region_ends.keys().next().copied();
                    c = first_region.map_or(hint, |r| r.min(hint));
                    continue;
                }
                return Err(corrupt(
                    Field::RefcountBlockEntry,
                    c,
                    "no free cluster up to 256 MiB past the end of the device (leaked refcounts: run `qcow2 check -r leaks`)",
                ));
            }
            if keep_out {
                if let Some(end) = self.region_end_at(c) {
                    c = end;
                    continue;
                }
            }
            if self.cluster_is_free(c).await? {
                break c;
            }
            c += 1;
        };
        let mut count = 1;
        while count < n
            && !(keep_out
                && (start + count >= inside || self.region_end_at(start + count).is_some()))
            && self.cluster_is_free(start + count).await?
        {
            count += 1;
        }
        Ok((start, count))
    }

    /// Sets the refcounts of free clusters `start..start + count` to 1 (dirty); one that
    /// was not 0 is corruption.
    async fn take_clusters(&self, start: u64, count: u64) -> Result<()> {
        for i in 0..count {
            let rc = self.update_refcount(start + i, 1).await?;
            if rc != 1 {
                return Err(self
                    .mark_corrupt(
                        Field::RefcountBlockEntry,
                        start + i,
                        "allocated cluster already in use",
                    )
                    .await);
            }
        }
        Ok(())
    }

    /// The last cluster index (exclusive bound) the allocator may hand out.
    fn alloc_limit(&self) -> u64 {
        self.device_size
            .get()
            .saturating_add(crate::limits::MAX_ALLOC_PAST_END)
            >> self.cluster_bits()
    }

    /// The end of the reserved region holding host cluster `c`, if any.
    fn region_end_at(&self, c: u64) -> Option<u64> {
        let m = self.meta().ok()?;
        let st = m.st.borrow();
        let (_, &end) = st.region_ends.range(..=c).next_back()?;
        (c < end).then_some(end)
    }

    /// Guest clusters per data region.
    fn region_len(&self) -> u64 {
        self.geo
            .slice_entries()
            .min((MAX_REGION_BYTES >> self.cluster_bits()).max(1))
    }

    /// Allocates host clusters for the data of guest clusters `g..g + n` (consecutive, in
    /// one L2 slice, each needing a new cluster): where their region puts them, so that
    /// guest clusters written in any order, by any number of streams, lie in guest order
    /// on the host (a slice filled so is linear: `LinearSlice`; sequential reads are
    /// sequential on the device), else wherever [`alloc_clusters`](Self::alloc_clusters)
    /// finds room. Returns (first host cluster, count, fresh) like `alloc_clusters`; the
    /// count may be less than `n`.
    ///
    /// Only with `OpenOptions::ordered_layout`, and on a device that cannot grow (a bdev,
    /// a block device), whose whole size is the image's to use: on a file, a region would
    /// make it jump ahead by up to a region for one write (sparsely, but visibly), and
    /// appending already lays out a single stream in order. Off by default: random first
    /// writes scattered over regions are slower than appended ones (4 KiB clusters on a
    /// malloc bdev: 0.85×), while a slice filled by several streams is linear with it.
    pub(crate) async fn alloc_data(&self, g: u64, n: u64) -> Result<(u64, u64, bool)> {
        if !self.allocates_by_region()? {
            return self.alloc_clusters(n).await;
        }
        match self.alloc_in_region(g, n).await? {
            Some(r) => Ok(r),
            None => self.alloc_clusters(n).await,
        }
    }

    /// Whether [`alloc_data`](Self::alloc_data) places data by regions (ordered layout on
    /// a device that cannot grow) rather than where `alloc_clusters` finds room.
    pub(crate) fn allocates_by_region(&self) -> Result<bool> {
        Ok(self.meta()?.ordered_layout && !self.exec.with_device(self.dev, |d| d.can_grow()))
    }

    async fn alloc_in_region(&self, g: u64, n: u64) -> Result<Option<(u64, u64, bool)>> {
        let m = self.meta()?;
        self.reclaim_graced();
        let per = self.region_len();
        let idx = g / per;
        let known = m.st.borrow().regions.get(&idx).map(|r| (r.start, r.len));
        let (start, len) = match known {
            Some(r) => r,
            // Boxed: a reservation is rare, and the write path's future stays small.
            None => Box::pin(self.reserve_region(idx)).await?,
        };
        let slot = g % per;
        if slot >= len {
            return Ok(None);
        }
        let goal = start + slot;
        let n = n.min(len - slot);
        let count = loop {
            let grows = m.st.borrow().rt_grows;
            let mut count = 0;
            while count < n && self.cluster_is_free(goal + count).await? {
                count += 1;
            }
            // As in `alloc_clusters`: a table that grew meanwhile may lie on the run.
            if m.st.borrow().rt_grows == grows {
                break count;
            }
        };
        if count == 0 {
            return Ok(None);
        }
        self.raise_zeroed_tail(goal + count).await?;
        self.take_clusters(goal, count).await?;
        // Inside the device (the region is): nothing to grow.
        self.note_allocated(goal + count)?;
        let mut st = m.st.borrow_mut();
        st.stats.clusters_allocated += count;
        // Regions fill out of order: a cluster below the last one taken counts as written.
        Ok(Some((goal, count, st.take_fresh(goal, count))))
    }

    /// Reserves the host clusters of region `idx` (see [`Region`]): where its data already
    /// lies, else the first run of clusters free for all of it at or after the last region
    /// and the allocation hint, searched for a bounded distance, inside the device. Records and returns (start,
    /// length); length 0 when there is no such run (the region's data then goes wherever
    /// the allocator finds room, for as long as the image stays open).
    async fn reserve_region(&self, idx: u64) -> Result<(u64, u64)> {
        let m = self.meta()?;
        let per = self.region_len();
        let total = self.size().div_ceil(self.geo.cluster_size());
        let len = per.min(total.saturating_sub(idx * per));
        // Inside the device, which cannot grow (see `alloc_data`): looking further would
        // only make refcount blocks for clusters it cannot use.
        let end = self.device_size.get() >> self.cluster_bits();
        let found = 'search: {
            if len == 0 {
                break 'search None;
            }
            // Data the slice already has (written before a reopen) says where its region
            // was: keep it there.
            if let Some(c) = self.region_of_data(idx * per, len).await? {
                break 'search Some(c);
            }
            let mut c = {
                let st = m.st.borrow();
                st.alloc_hint.max(st.region_top).max(1)
            };
            // Bounded: a fragmented image gets no region rather than a long scan.
            let mut budget = 4 * len + 64;
            loop {
                if c.saturating_add(len) > end || budget == 0 {
                    break 'search None;
                }
                if let Some(past) = self.region_end_at(c) {
                    c = past;
                    continue;
                }
                if let Some((&next, _)) = m.st.borrow().region_ends.range(c..c + len).next() {
                    // Another region starts inside the candidate run: skip past it.
                    c = next;
                    continue;
                }
                budget = budget.saturating_sub(len);
                match self.first_busy(c, len).await? {
                    Some(busy) => c = busy + 1,
                    None => break 'search Some(c),
                }
            }
        };
        let mut st = m.st.borrow_mut();
        let region = match found {
            Some(c) => {
                st.region_top = c + len;
                st.region_ends.insert(c, c + len);
                Region { start: c, len }
            }
            None => Region { start: 0, len: 0 },
        };
        st.regions.insert(idx, region);
        Ok((region.start, region.len))
    }

    /// Where the region of guest clusters `g0..g0 + len` (inside one slice) starts when its
    /// first data cluster (a plain data entry, `L2Entry::plain_data`) is taken to be in
    /// its slot, as the ordered layout put it before the image was reopened: `None` when the
    /// clusters have no data yet, or that region would leave the device or overlap another.
    async fn region_of_data(&self, g0: u64, len: u64) -> Result<Option<u64>> {
        let bits = self.cluster_bits();
        let off = GuestOffset(g0 << bits);
        let Some(way) = self.load_slice(off).await? else {
            return Ok(None);
        };
        let (key, i0) = (
            self.geo.slice_id(off),
            self.geo.index_in_slice(off) as usize,
        );
        let step = if self.geo.extended_l2 { 2 } else { 1 };
        let first = |words: &[u64]| {
            (0..len as usize).find_map(|k| {
                let e = L2Entry(*words.get((i0 + k) * step)?);
                let (host, _) = e.plain_data(bits, u64::MAX)?;
                Some((host >> bits).checked_sub(k as u64))
            })
        };
        let m = self.meta()?;
        let found = match m.st.borrow().dirty_l2.get(&key) {
            Some(words) => first(words),
            None => first(self.l2_cache.borrow().block(way)),
        };
        let Some(Some(start)) = found else {
            return Ok(None);
        };
        let end = self.device_size.get() >> bits;
        let st = m.st.borrow();
        let clash = st
            .region_ends
            .range(..start + len)
            .next_back()
            .is_some_and(|(_, &e)| e > start);
        Ok((start > 0 && start + len <= end && !clash).then_some(start))
    }

    /// The first of host clusters `c..c + len` that [`cluster_is_free`] would refuse, if
    /// any: as many checks, made a refcount block at a time where it can (a region's
    /// reservation checks a whole slice of clusters), and a missing refcount block means
    /// free clusters without creating it (a grown refcount table is placed with this: its
    /// new blocks then cover such clusters).
    ///
    /// [`cluster_is_free`]: Self::cluster_is_free
    async fn first_busy(&self, c: u64, len: u64) -> Result<Option<u64>> {
        let m = self.meta()?;
        let sets_empty = {
            let st = m.st.borrow();
            st.unstable_frees.is_empty() && st.graced_set.is_empty()
        };
        let bits = self.cluster_bits();
        let order = self.header.borrow().header.refcount_order;
        if !sets_empty || self.overlaps_metadata(c << bits, len << bits) {
            let cs = self.geo.cluster_size();
            for x in c..c + len {
                let unstable = {
                    let st = m.st.borrow();
                    st.unstable_frees.contains(&x) || st.graced_set.contains(&x)
                };
                if unstable || self.overlaps_metadata(x << bits, cs) {
                    return Ok(Some(x));
                }
                if let Some((block, idx)) = self.rc_locate(x)? {
                    self.load_rc_block(block).await?;
                    if self.with_rc_block(block, |b| get_refcount(b, order, idx)) != 0 {
                        return Ok(Some(x));
                    }
                }
            }
            return Ok(None);
        }
        let per_block = self.per_block();
        let mut x = c;
        while x < c + len {
            let n = (per_block - x % per_block).min(c + len - x);
            if let Some((block, idx)) = self.rc_locate(x)? {
                self.load_rc_block(block).await?;
                let busy = self.with_rc_block(block, |b| {
                    (0..n).find(|&k| get_refcount(b, order, idx + k) != 0)
                });
                if let Some(k) = busy {
                    return Ok(Some(x + k));
                }
            }
            x += n;
        }
        Ok(None)
    }

    /// Whether host cluster `c` may be allocated: refcount 0, not freed-but-unstable, not
    /// metadata.
    async fn cluster_is_free(&self, c: u64) -> Result<bool> {
        if let Some(free) = self.cluster_is_free_now(c)? {
            return Ok(free);
        }
        let order = self.header.borrow().header.refcount_order;
        let (block, idx) = self.ensure_rc_block(c).await?;
        self.load_rc_block(block).await?;
        Ok(self.with_rc_block(block, |b| get_refcount(b, order, idx)) == 0)
    }

    /// Takes host cluster `c` (refcount 0 → 1) if it is free, from memory: `Some(true)`
    /// taken, `Some(false)` not free, `None` (nothing changed) when the answer needs its
    /// refcount block loaded or created. As [`cluster_is_free_now`](Self::cluster_is_free_now)
    /// then [`update_loaded_refcount`](Self::update_loaded_refcount), with one look-up of a
    /// dirty block.
    fn take_if_free_now(&self, c: u64) -> Result<Option<bool>> {
        let m = self.meta()?;
        if self.excluded_from_alloc(c) {
            return Ok(Some(false));
        }
        let Some((block, idx)) = self.rc_locate(c)? else {
            return Ok(None);
        };
        let order = self.header.borrow().header.refcount_order;
        if let Some(b) = m.st.borrow_mut().dirty_rc.get_mut(&block) {
            if get_refcount(b, order, idx) != 0 {
                return Ok(Some(false));
            }
            set_refcount(b, order, idx, 1)?;
            return Ok(Some(true));
        }
        let free = {
            let mut cache = self.rc_cache.borrow_mut();
            let Some(w) = cache.lookup(block, 0) else {
                return Ok(None);
            };
            get_refcount(cache.block(w), order, idx) == 0
        };
        if !free {
            return Ok(Some(false));
        }
        self.update_loaded_refcount(block, idx, c, 1)?;
        Ok(Some(true))
    }

    /// Whether host cluster `c` is out of the allocator's reach whatever its refcount says:
    /// freed but not stable yet, in a grace period, or metadata.
    fn excluded_from_alloc(&self, c: u64) -> bool {
        if let Ok(m) = self.meta() {
            let st = m.st.borrow();
            let held = |set: &HashSet<u64>| !set.is_empty() && set.contains(&c);
            if held(&st.unstable_frees) || held(&st.graced_set) {
                return true;
            }
        }
        self.overlaps_metadata(c << self.cluster_bits(), self.geo.cluster_size())
    }

    /// [`cluster_is_free`](Self::cluster_is_free) from memory: `None` when the answer
    /// needs its refcount block loaded or created.
    fn cluster_is_free_now(&self, c: u64) -> Result<Option<bool>> {
        let m = self.meta()?;
        if self.excluded_from_alloc(c) {
            return Ok(Some(false));
        }
        let Some((block, idx)) = self.rc_locate(c)? else {
            return Ok(None);
        };
        let order = self.header.borrow().header.refcount_order;
        // The dirty copy wins over the cache (as in `with_rc_block`).
        if let Some(b) = m.st.borrow().dirty_rc.get(&block) {
            return Ok(Some(get_refcount(b, order, idx) == 0));
        }
        let mut cache = self.rc_cache.borrow_mut();
        Ok(cache
            .lookup(block, 0)
            .map(|w| get_refcount(cache.block(w), order, idx) == 0))
    }

    /// Drops the references of host bytes `[off, off+len)` once the metadata that removed
    /// them is stable (rule 2).
    pub(crate) fn free_later(&self, off: u64, len: u64) -> Result<()> {
        self.meta()?.st.borrow_mut().pending_frees.push((off, len));
        Ok(())
    }

    /// The decrements of `unstable_frees` are stable: the clusters may be reused — at once
    /// on an image of one core; after a grace period when cores share it (a request that
    /// resolved the old mapping may still be in flight on another core).
    fn release_unstable(&self) {
        let Ok(m) = self.meta() else { return };
        {
            let mut guard = m.st.borrow_mut();
            let st = &mut *guard;
            match &self.shared {
                None => st.unstable_frees.clear(),
                Some(sh) => {
                    let batch: Vec<u64> = st.unstable_frees.drain().collect();
                    if !batch.is_empty() {
                        st.graced_set.extend(batch.iter().copied());
                        st.graced.push_back((sh.grace.now(), batch));
                    }
                }
            }
        }
        self.reclaim_graced();
    }

    /// Releases the graced clusters whose grace period is over (advancing it if it can).
    pub(crate) fn reclaim_graced(&self) {
        let (Ok(m), Some(sh)) = (self.meta(), &self.shared) else {
            return;
        };
        if m.st.borrow().graced.is_empty() {
            return;
        }
        // An attempt costs a process-wide barrier with the asymmetric fences (system call
        // and interrupts on the cores' CPUs): at most one per ADVANCE_INTERVAL, however
        // many allocations ask meanwhile; freed clusters wait that much longer.
        let now = std::time::Instant::now();
        let attempt = !crate::coherency::fences::asymmetric()
            || m.st
                .borrow()
                .last_advance
                .is_none_or(|t| now.duration_since(t) >= ADVANCE_INTERVAL);
        let g = if attempt {
            m.st.borrow_mut().last_advance = Some(now);
            sh.grace.try_advance()
        } else {
            sh.grace.now()
        };
        let mut st = m.st.borrow_mut();
        while st.graced.front().is_some_and(|(tag, _)| tag + 2 <= g) {
            if let Some((_, batch)) = st.graced.pop_front() {
                for c in batch {
                    st.graced_set.remove(&c);
                    if c < st.alloc_hint {
                        st.alloc_hint = c;
                    }
                }
            }
        }
    }

    /// Frees clusters that were allocated but never referenced (an aborted allocation).
    pub(crate) async fn free_unreferenced(&self, start: u64, count: u64) -> Result<()> {
        let m = self.meta()?;
        for c in start..start + count {
            self.update_refcount(c, -1).await?;
            m.st.borrow_mut().unstable_frees.insert(c);
        }
        Ok(())
    }

    // ----- write-back ----------------------------------------------------------------

    async fn write_dirty_rc(&self) -> Result<bool> {
        let m = self.meta()?;
        let blocks: Vec<(u64, Vec<u8>)> = std::mem::take(&mut m.st.borrow_mut().dirty_rc)
            .into_iter()
            .collect();
        if blocks.is_empty() {
            return Ok(false);
        }
        for (off, bytes) in &blocks {
            if !self.is_metadata_cluster(*off) {
                return Err(self
                    .mark_corrupt(
                        Field::RefcountTableEntry,
                        *off,
                        "refcount block write outside known blocks",
                    )
                    .await);
            }
            let buf = self.exec.alloc_buf(self.dev, bytes.len());
            buf.copy_in(0, bytes);
            if let Err(e) = self.exec.write(self.dev, *off, BufSlice::whole(buf)).await {
                // Keep everything dirty so nothing is lost; the caller fails the request.
                let mut st = m.st.borrow_mut();
                for (o, b) in blocks {
                    st.dirty_rc.entry(o).or_insert(b);
                }
                return Err(e);
            }
        }
        let mut cache = self.rc_cache.borrow_mut();
        for (off, bytes) in blocks {
            cache.insert_with(off, 0, |b| b.copy_from_slice(&bytes));
        }
        Ok(true)
    }

    fn is_metadata_cluster(&self, off: u64) -> bool {
        self.meta.as_ref().is_some_and(|m| {
            m.st.borrow()
                .meta_clusters
                .contains(&(off >> self.cluster_bits()))
        })
    }

    /// Writes the sectors of a table (`words` at host `table_off`) holding `indices`.
    async fn write_table_sectors(
        &self,
        table_off: u64,
        words: &[u64],
        indices: &BTreeSet<u64>,
    ) -> Result<()> {
        let per_sector = SECTOR / 8;
        let sectors: BTreeSet<u64> = indices.iter().map(|i| i / per_sector).collect();
        for s in sectors {
            let first = (s * per_sector) as usize;
            let mut bytes = vec![0u8; SECTOR as usize];
            let end = (first + per_sector as usize).min(words.len());
            words_to_bytes(&words[first..end], &mut bytes);
            let buf = self.exec.alloc_buf(self.dev, bytes.len());
            buf.copy_in(0, &bytes);
            self.exec
                .write(self.dev, table_off + s * SECTOR, BufSlice::whole(buf))
                .await?;
        }
        Ok(())
    }

    async fn write_header(&self) -> Result<()> {
        let m = self.meta()?;
        let sector = {
            let mut st = m.st.borrow_mut();
            st.header_dirty = false;
            st.sector0_disk = st.sector0.clone();
            st.sector0.clone()
        };
        let buf = self.exec.alloc_buf(self.dev, sector.len());
        buf.copy_in(0, &sector);
        self.exec.write(self.dev, 0, BufSlice::whole(buf)).await
    }

    /// Whether clusters below `end_cluster` may be written as things stand: they lie below
    /// the zeroed tail (always, without one).
    pub(crate) fn below_zeroed_tail(&self, end_cluster: u64) -> Result<bool> {
        let m = self.meta()?;
        let tail = m.st.borrow().zeroed_tail_cluster(self.cluster_bits());
        Ok(tail.is_none_or(|t| end_cluster <= t))
    }

    /// Raises the zeroed tail on disk to at least cluster `end_cluster` (the first sector
    /// written alone, then flushed) unless it lies there already: called before clusters
    /// below `end_cluster` are taken, so that nothing is ever written at or past the tail
    /// on disk, whatever a crash keeps. It moves in steps of a 64th of the device (1 MiB
    /// at least): 64 rewrites while the image fills the device. Caller holds the metadata
    /// lock.
    async fn raise_zeroed_tail(&self, end_cluster: u64) -> Result<()> {
        if self.below_zeroed_tail(end_cluster)? {
            return Ok(());
        }
        let m = self.meta()?;
        let cs = self.geo.cluster_size();
        let dev_end = self.device_size.get().div_ceil(cs) * cs;
        let step = (dev_end / 64).max(ZEROED_TAIL_STEP_MIN);
        let from = ((end_cluster << self.cluster_bits()) + step).div_ceil(cs) * cs;
        let from = from.min(dev_end.max(end_cluster << self.cluster_bits()));
        let sector = {
            let mut st = m.st.borrow_mut();
            let Some(z) = st.zeroed_tail else {
                return Ok(());
            };
            crate::format::be::put_u64(&mut st.sector0, z.at as usize, from);
            crate::format::be::put_u64(&mut st.sector0_disk, z.at as usize, from);
            st.sector0_disk.clone()
        };
        let buf = self.exec.alloc_buf(self.dev, sector.len());
        buf.copy_in(0, &sector);
        self.exec.write(self.dev, 0, BufSlice::whole(buf)).await?;
        self.exec.flush(self.dev).await?;
        let mut st = m.st.borrow_mut();
        if let Some(z) = st.zeroed_tail.as_mut() {
            z.from = from;
        }
        st.stats.zeroed_tail_raises += 1;
        Ok(())
    }

    /// At a clean close: the zeroed tail goes back to where the clusters ever allocated end
    /// (nothing was written past them), so that the next open finds every cluster past
    /// them fresh. Caller holds the metadata lock, every write has completed.
    async fn lower_zeroed_tail(&self) -> Result<()> {
        let m = self.meta()?;
        let cs = self.geo.cluster_size();
        let lowered = {
            let mut st = m.st.borrow_mut();
            let end = st.fresh_from * cs;
            match st.zeroed_tail {
                Some(z) if end < z.from => {
                    crate::format::be::put_u64(&mut st.sector0, z.at as usize, end);
                    st.header_dirty = true;
                    Some(end)
                }
                _ => None,
            }
        };
        if let Some(end) = lowered {
            self.write_header().await?;
            self.exec.flush(self.dev).await?;
            if let Some(z) = m.st.borrow_mut().zeroed_tail.as_mut() {
                z.from = end;
            }
        }
        Ok(())
    }

    /// Writes all dirty metadata in dependency order (see the module doc). The caller holds
    /// the metadata lock. On error, whatever was not written stays dirty.
    pub(crate) async fn writeback_locked(&self) -> Result<()> {
        self.writeback_mode(false).await
    }

    /// Sets the dirty bit on disk (and makes it stable) before metadata that relies on it.
    async fn set_dirty_bit(&self) -> Result<()> {
        let m = self.meta()?;
        if m.st.borrow().dirty_bit_on_disk {
            return Ok(());
        }
        {
            let mut st = m.st.borrow_mut();
            let v = crate::format::be::get_u64(&st.sector0, 72)
                | crate::format::header::incompat::DIRTY;
            crate::format::be::put_u64(&mut st.sector0, 72, v);
        }
        self.write_header().await?;
        self.exec.flush(self.dev).await?;
        m.st.borrow_mut().dirty_bit_on_disk = true;
        Ok(())
    }

    /// Write-back; with lazy refcounts (and not `full`), refcount blocks stay in memory and
    /// the dirty bit, set and stable first, tells a later open to rebuild them (rule 7).
    async fn writeback_mode(&self, full: bool) -> Result<()> {
        let m = self.meta()?;
        m.st.borrow_mut().stats.writebacks += 1;
        let lazy = !full && self.header.borrow().lazy_refcounts();
        let (has_l2, rt_dirty) = {
            let st = m.st.borrow();
            (
                !st.dirty_l2.is_empty() || !st.dirty_l1.is_empty(),
                !st.dirty_rt.is_empty(),
            )
        };
        // Phase 1: refcounts (and the data written so far) before any L2/L1 reference.
        let wrote_rc = if lazy && !rt_dirty {
            if has_l2 && !m.st.borrow().dirty_rc.is_empty() {
                self.set_dirty_bit().await?;
            }
            false
        } else {
            self.write_dirty_rc().await?
        };
        if rt_dirty {
            self.exec.flush(self.dev).await?;
            let rt_dirty = std::mem::take(&mut m.st.borrow_mut().dirty_rt);
            let table = self.refcount_table.borrow().clone();
            let off = self.header.borrow().header.refcount_table_offset;
            if let Err(e) = self.write_table_sectors(off, &table, &rt_dirty).await {
                m.st.borrow_mut().dirty_rt.extend(rt_dirty);
                return Err(e);
            }
        }
        if wrote_rc || has_l2 || rt_dirty {
            self.exec.flush(self.dev).await?;
        }
        // Phase 2: L2 slices, then L1 entries of new tables.
        if has_l2 {
            // The slices move to `writing_l2` (still served from there) until their write
            // completes; only then may a core read them from the device (epoch even).
            let keys: Vec<u64> = {
                let mut st = m.st.borrow_mut();
                let taken = std::mem::take(&mut st.dirty_l2);
                let mut keys: Vec<u64> = taken.keys().copied().collect();
                // In device order (slices of one table next to each other).
                keys.sort_unstable();
                st.writing_l2 = taken;
                keys
            };
            let slice_bytes = 1usize << self.geo.slice_bits;
            for (i, key) in keys.iter().enumerate() {
                let key = *key;
                let goff = GuestOffset(key * self.geo.slice_coverage());
                let r = match self.l2_table(goff) {
                    Ok(Some(t)) => {
                        let host = self.geo.slice_host_offset(t, goff);
                        if !self.is_metadata_cluster(host.0) {
                            Err(self
                                .mark_corrupt(
                                    Field::L1Entry,
                                    host.0,
                                    "L2 write outside known L2 tables",
                                )
                                .await)
                        } else {
                            let buf = self.exec.alloc_buf(self.dev, slice_bytes);
                            let mut bytes = vec![0u8; slice_bytes];
                            if let Some(words) = m.st.borrow().writing_l2.get(&key) {
                                words_to_bytes(words, &mut bytes);
                            }
                            buf.copy_in(0, &bytes);
                            self.exec
                                .write(self.dev, host.0, BufSlice::whole(buf))
                                .await
                        }
                    }
                    Ok(None) => Err(corrupt(
                        Field::L1Entry,
                        key,
                        "dirty slice without an L2 table",
                    )),
                    Err(e) => Err(e),
                };
                let mut st = m.st.borrow_mut();
                let st = &mut *st;
                if let Err(e) = r {
                    // Back to dirty; a newer dirty copy (changed meanwhile) wins.
                    for k in keys.into_iter().skip(i) {
                        if let Some(w) = st.writing_l2.remove(&k) {
                            match st.dirty_l2.entry(k) {
                                std::collections::hash_map::Entry::Occupied(_) => {
                                    if let Some(sh) = &self.shared {
                                        st.epochs.cleaned(sh, k);
                                    }
                                }
                                std::collections::hash_map::Entry::Vacant(v) => {
                                    v.insert(w);
                                }
                            }
                        }
                    }
                    return Err(e);
                }
                let written = st.writing_l2.remove(&key);
                st.stats.l2_slices_written += 1;
                if let Some(sh) = &self.shared {
                    st.epochs.cleaned(sh, key);
                }
                // A slice only the dirty set held (a new table's) stays in memory, in the
                // cache, unless a newer dirty copy exists (then that one is written later).
                if let Some(words) = written {
                    if !st.dirty_l2.contains_key(&key)
                        && self.l2_cache.borrow().probe(key, 0).is_none()
                    {
                        self.cache_slice(key, 0, |b| b.copy_from_slice(&words));
                    }
                }
            }
            let l1_dirty = std::mem::take(&mut m.st.borrow_mut().dirty_l1);
            if !l1_dirty.is_empty() {
                self.exec.flush(self.dev).await?;
                let words: Vec<u64> = self.l1.borrow().iter().map(|e| e.0).collect();
                let off = self.header.borrow().header.l1_table_offset;
                if let Err(e) = self.write_table_sectors(off, &words, &l1_dirty).await {
                    m.st.borrow_mut().dirty_l1.extend(l1_dirty);
                    return Err(e);
                }
            }
            self.exec.flush(self.dev).await?;
        }
        // Phase 3: frees whose removal is now stable.
        let frees = std::mem::take(&mut m.st.borrow_mut().pending_frees);
        if lazy && !frees.is_empty() {
            // Decrements stay in memory with the other lazy refcounts; the clusters are not
            // reused until a full write-back made them stable.
            let bits = self.cluster_bits();
            for (off, len) in &frees {
                for c in (off >> bits)..((off + len).div_ceil(1 << bits)) {
                    if self.update_refcount(c, -1).await? == 0 {
                        let mut st = m.st.borrow_mut();
                        st.unstable_frees.insert(c);
                        st.meta_clusters.remove(&c);
                    }
                }
            }
        } else if !frees.is_empty() || (!lazy && !m.st.borrow().unstable_frees.is_empty()) {
            let bits = self.cluster_bits();
            for (off, len) in &frees {
                for c in (off >> bits)..((off + len).div_ceil(1 << bits)) {
                    let new = self.update_refcount(c, -1).await?;
                    if new == 0 {
                        m.st.borrow_mut().unstable_frees.insert(c);
                        let mut st = m.st.borrow_mut();
                        st.meta_clusters.remove(&c);
                        if c < st.alloc_hint {
                            st.alloc_hint = c;
                        }
                    }
                }
            }
            self.write_dirty_rc().await?;
            self.exec.flush(self.dev).await?;
            self.release_unstable();
        }
        if full && m.st.borrow().dirty_bit_on_disk {
            // Every refcount is stable now: the dirty bit can go.
            {
                let mut st = m.st.borrow_mut();
                let v = crate::format::be::get_u64(&st.sector0, 72)
                    & !crate::format::header::incompat::DIRTY;
                crate::format::be::put_u64(&mut st.sector0, 72, v);
                st.header_dirty = true;
                st.dirty_bit_on_disk = false;
            }
        }
        if m.st.borrow().header_dirty {
            self.write_header().await?;
            self.exec.flush(self.dev).await?;
        }
        Ok(())
    }

    /// Whether the owner should write its dirty metadata back now without a guest flush:
    /// something is dirty, no background write-back is running, and nothing was allocated
    /// or newly dirtied for [`BACKGROUND_WRITEBACK_INTERVAL`] (a write-back holds the
    /// metadata lock, so it waits for allocations to pause rather than stall them). Cheap
    /// when nothing is dirty (no clock read). A host's owner loop asks this and then runs
    /// [`background_writeback`](Self::background_writeback).
    pub fn background_writeback_due(&self) -> bool {
        let Ok(m) = self.meta() else {
            return false;
        };
        let mut st = m.st.borrow_mut();
        if st.background_running || (st.dirty_l2.is_empty() && st.dirty_l1.is_empty()) {
            st.quiet = None;
            return false;
        }
        let sig = st.change_signature();
        let now = std::time::Instant::now();
        match st.quiet {
            Some((since, s)) if s == sig => {
                now.duration_since(since) >= BACKGROUND_WRITEBACK_INTERVAL
            }
            _ => {
                st.quiet = Some((now, sig));
                false
            }
        }
    }

    /// Writes the dirty metadata back in dependency order, as a flush does but without
    /// flushing the device (no guest write becomes stable through it): the owner's dirty
    /// slices become clean, so the cores serve overwrites into them on their own again.
    pub async fn background_writeback(&self) -> Result<()> {
        let m = self.meta()?;
        {
            let mut st = m.st.borrow_mut();
            st.background_running = true;
            st.quiet = None;
        }
        let r = {
            let _g = m.lock.lock().await;
            self.writeback_locked().await
        };
        let mut st = m.st.borrow_mut();
        st.background_running = false;
        if r.is_err() {
            // What failed stays dirty for the next flush, which reports it; the next
            // background attempt waits a second rather than the interval (a failing device
            // must not be retried, and logged, a hundred times a second).
            let sig = st.change_signature();
            st.quiet = Some((std::time::Instant::now() + BACKGROUND_RETRY_DELAY, sig));
        }
        r
    }

    /// Writes back when the dirty set has grown past the threshold (memory bound).
    pub(crate) async fn maybe_writeback_locked(&self) -> Result<()> {
        let m = self.meta()?;
        let dirty = {
            let st = m.st.borrow();
            st.dirty_l2.len() as u64 * (1u64 << self.geo.slice_bits)
                + st.dirty_rc.len() as u64 * self.geo.cluster_size()
        };
        if dirty > WRITEBACK_THRESHOLD_BYTES {
            // Boxed: rare, and the write path's per-request future stays small.
            Box::pin(self.writeback_locked()).await?;
        }
        Ok(())
    }

    /// Writes everything back (refcounts included, even with lazy refcounts), clears the
    /// dirty bit and flushes: the image is clean on disk when this returns.
    pub async fn close(&self) -> Result<()> {
        let m = self.meta()?;
        let _g = m.lock.lock().await;
        self.writeback_mode(true).await?;
        self.exec.flush(self.dev).await?;
        self.lower_zeroed_tail().await
    }

    /// Guest flush: every write completed before it is stable when this returns.
    pub async fn flush(&self) -> Result<()> {
        let m = self.meta()?;
        let _g = m.lock.lock().await;
        self.writeback_locked().await?;
        self.exec.flush(self.dev).await
    }
}
