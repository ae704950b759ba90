//! The direct path's memo of L2 slices ([`SliceMemo`]): a direct-mapped table in front of
//! the set-associative slice cache that maps a request inside one slice in a few compares.

use crate::coherency::{stamp_of, Shared, SliceStamp};
use crate::exec::DevId;
#[cfg(loom)]
use loom::sync::atomic::AtomicU64;
use std::cell::{Cell, OnceCell};
use std::rc::Rc;
#[cfg(not(loom))]
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// The most slots a [`SliceMemo`] has (a power of two): 4,096 slices map 128 GiB with
/// 64 KiB clusters and 4 KiB slices.
pub const MEMO_MAX_SLOTS: usize = 4096;

/// [`MemoSlot::meta_gen`] of a slice not known clear of metadata.
pub const MEMO_NO_META_GEN: u64 = u64::MAX;

/// Key of an empty slot.
const EMPTY_KEY: u64 = u64::MAX;

/// Tag in [`MemoSlot::host`] of a mapped slice: its clusters are in the row of the map
/// that starts at the low 32 bits (a linear slice's start on the device is below 2^63).
const MAPPED: u64 = 1 << 63;

/// A word of a mapped row that does not answer (no plain COPIED data the memo can map).
const NO_WORD: i32 = i32::MIN;

/// A mapped slice replaces a slot held by another slice only at every this-many-th
/// attempt: building a map decodes a whole slice, which slices that share slots would
/// otherwise repeat on every request.
const MAPPED_EVICT_EVERY: u32 = 64;

/// A direct-mapped memo in front of the L2 slice cache, for the direct path. A slot holds
/// one slice, the epoch it was read under, and either
/// - for a **linear** slice (see [`LinearSlice`](crate::format::entries::LinearSlice)):
///   where its clusters start on the device — a hit is one load and two compares;
/// - for any other slice (**mapped**): a row of the memo's map, one word per entry: for
///   an entry that is plain COPIED data inside the device (and, on a writable core
///   replica, not metadata), its host cluster less its index in the slice, so that the
///   host offset is the word times the cluster size plus the request's offset in the
///   slice; [`NO_WORD`] for the rest — a hit loads that word too.
///
/// Both answer a request that lies inside one slice (a mapped slice: inside one cluster
/// whose word answers) where the set-associative look-up hashes the key, reads the slot,
/// the summary, the LRU clock and the entry, decodes it and writes the rank back. As many
/// slots in use as the slice cache holds slices (a power of two, at most
/// [`MEMO_MAX_SLOTS`]; the table has that many, 32 bytes each, so a deep chain's small
/// layers keep small tables); the map is allocated the first time a mapped slice is
/// remembered (4 bytes per entry of every slot in use: half what the slice cache takes
/// for as many slices).
///
/// Its entries are copies, valid on their own: on a core replica the epoch check is the same
/// one the slice cache makes (ARCHITECTURE.md §6), and the owner (whose epochs are fixed)
/// forgets a slice or patches its row whenever it changes or re-caches it
/// (`Qcow2::set_l2_words`, `Qcow2::cache_slice`), and an entry leaves when its slice leaves
/// the cache (`Qcow2::cache_slice`): the memo is a faster look-up of what the cache holds,
/// never more.
pub struct SliceMemo {
    /// The slots in use (a power of two): an image with a small cache (a deep chain's
    /// layer: thousands per thread) keeps a small table.
    slots: Box<[Cell<MemoSlot>]>,
    /// Slots in use less one (below [`MEMO_MAX_SLOTS`]).
    mask: usize,
    /// Entries per slice: the length of a row of `map`.
    entries: usize,
    /// log2 of the cluster size.
    cluster_bits: u32,
    /// One row of words per slot in use, for mapped slices.
    map: OnceCell<Box<[Cell<i32>]>>,
    /// Attempts to remember a mapped slice in a slot another slice holds.
    conflicts: Cell<u32>,
    hits: Cell<u64>,
    /// Overwrites answered through a copy older than the slot's epoch.
    kept: Cell<u64>,
}

/// A mapped row of [`SliceMemo`] to carry over to a newer copy of its slice: taken by
/// [`SliceMemo::mapped_row`], used once by [`SliceMemo::carry_mapped`].
#[derive(Debug)]
pub struct MappedRow {
    key: u64,
    host: u64,
}

#[derive(Clone, Copy, Debug)]
struct MemoSlot {
    key: u64,
    /// A linear slice's first host offset, or [`MAPPED`] with the start of its row.
    host: u64,
    /// The epoch and the count of removals the slice's copy was taken under
    /// (ARCHITECTURE.md §6): on a writable core replica an overwrite may use it while the
    /// count holds, even when the epoch moved on (additions only).
    taken: SliceStamp,
    /// On a writable core replica: the metadata bitmap's generation under which no host
    /// cluster the slot answers for was metadata (`Shared::meta_range_clear`);
    /// [`MEMO_NO_META_GEN`] otherwise.
    meta_gen: u64,
}

const MEMO_EMPTY: MemoSlot = MemoSlot {
    key: EMPTY_KEY,
    host: 0,
    taken: SliceStamp::OWNER,
    meta_gen: MEMO_NO_META_GEN,
};

/// The word of entry `index` whose host cluster is `host` (0: none the memo answers for);
/// clusters from 2^31 on are not answered (the word is signed).
#[inline]
fn word(index: usize, host: u32) -> i32 {
    match (i32::try_from(host), i32::try_from(index)) {
        (Ok(h), Ok(i)) if h != 0 => h - i,
        _ => NO_WORD,
    }
}

/// Host cluster `host` as a row's highest-cluster word (`NO_WORD` for 0, which answers
/// nothing; clusters past `i32::MAX` are never answered either).
#[inline]
fn host_word(host: u32) -> i32 {
    match i32::try_from(host) {
        Ok(h) if h != 0 => h,
        _ => NO_WORD,
    }
}

impl SliceMemo {
    /// A memo of `slots` rounded up to a power of two, between 1 and [`MEMO_MAX_SLOTS`], for
    /// slices of `entries` entries of clusters of `1 << cluster_bits` bytes.
    pub fn new(slots: usize, entries: usize, cluster_bits: u32) -> Self {
        let n = slots.clamp(1, MEMO_MAX_SLOTS).next_power_of_two();
        SliceMemo {
            slots: (0..n).map(|_| Cell::new(MEMO_EMPTY)).collect(),
            mask: n - 1,
            entries,
            cluster_bits,
            map: OnceCell::new(),
            conflicts: Cell::new(0),
            hits: Cell::new(0),
            kept: Cell::new(0),
        }
    }

    /// Number of slots in use.
    pub fn slots(&self) -> usize {
        self.mask + 1
    }

    #[inline(always)]
    fn index(&self, key: u64) -> usize {
        key as usize & self.mask
    }

    #[inline(always)]
    fn slot(&self, key: u64) -> &Cell<MemoSlot> {
        &self.slots[self.index(key)]
    }

    /// Where the `len` bytes at `within` (bytes from the start of slice `key`, inside the
    /// slice) lie on the device, if the memo knows the slice under `epoch` and can answer
    /// for that range (counted as a hit). Every read the memo answers runs this and
    /// nothing else of the memo: slot, compares and answer are written out here.
    #[inline(always)]
    pub fn extent(&self, key: u64, epoch: u32, within: u64, len: u64) -> Option<u64> {
        let s = self.slots[key as usize & self.mask].get();
        if s.key != key || s.taken.epoch() != epoch {
            return None;
        }
        let host = self.answer(s.host, within, len)?;
        self.hits.set(self.hits.get() + 1);
        Some(host)
    }

    /// For an in-place write on a writable core replica: where the memo answers for the
    /// range while the slot's count of removals is still the one `stamp`, the slot's
    /// current stamp, has (its epoch may have moved by additions only: what the copy shows
    /// as COPIED data still is, §6; such answers are counted, [`kept`](Self::kept)) and no
    /// cluster the slot answers for was metadata under metadata generation `meta_gen` (the
    /// current one). Written out as [`extent`](Self::extent) is.
    #[inline(always)]
    pub fn extent_overwrite(
        &self,
        key: u64,
        stamp: SliceStamp,
        meta_gen: u64,
        within: u64,
        len: u64,
    ) -> Option<u64> {
        let s = self.slots[key as usize & self.mask].get();
        if s.key != key || s.meta_gen != meta_gen {
            return None;
        }
        // Taken under the current stamp (most often): one compare for both halves.
        if s.taken != stamp {
            return self.extent_kept(s.host, s.taken, stamp.removals(), (within, len));
        }
        let host = self.answer(s.host, within, len)?;
        self.hits.set(self.hits.get() + 1);
        Some(host)
    }

    /// [`extent_overwrite`](Self::extent_overwrite) through a slot whose copy was `taken`
    /// under an older epoch (its `host` word): it answers while the count of removals is
    /// still `removals`.
    #[cold]
    #[inline(never)]
    fn extent_kept(
        &self,
        host: u64,
        taken: SliceStamp,
        removals: u32,
        (within, len): (u64, u64),
    ) -> Option<u64> {
        if taken.removals() != removals {
            return None;
        }
        let host = self.answer(host, within, len)?;
        self.hits.set(self.hits.get() + 1);
        self.kept.set(self.kept.get() + 1);
        Some(host)
    }

    /// What a slot whose `host` word is this answers for the range at `within`: a linear
    /// slice's start plus `within`, or its mapped row's word ([`mapped`](Self::mapped)).
    #[inline(always)]
    fn answer(&self, host: u64, within: u64, len: u64) -> Option<u64> {
        match host & MAPPED {
            0 => Some(host + within),
            _ => self.mapped(host as u32 as usize, within, len),
        }
    }

    /// A mapped slice's answer for the range at `within`, from the row starting at word
    /// `row`: inside one cluster whose word answers.
    #[inline(always)]
    fn mapped(&self, row: usize, within: u64, len: u64) -> Option<u64> {
        let bits = self.cluster_bits;
        let index = within >> bits;
        if (within + len).wrapping_sub(1) >> bits != index {
            return None;
        }
        let w = self.map.get()?.get(row + index as usize)?.get();
        // The word is the host cluster less `index`: times the cluster size, plus
        // `within`, is the host cluster's offset plus the offset in it.
        (w != NO_WORD).then(|| ((i64::from(w) << bits) as u64).wrapping_add(within))
    }

    /// Remembers that linear slice `key`, read under `stamp` (with the slot's
    /// count when the copy was taken), starts at `host`; `meta_gen`: the metadata
    /// generation under which none of its clusters was metadata (a writable core replica),
    /// else [`MEMO_NO_META_GEN`].
    pub fn remember(&self, key: u64, host: u64, stamp: SliceStamp, meta_gen: u64) {
        // (Past 2^63 it would read as a mapped slot; no device is that large.)
        if host & MAPPED != 0 {
            return self.forget(key);
        }
        self.slot(key).set(MemoSlot {
            key,
            host,
            taken: stamp,
            meta_gen,
        });
    }

    /// Whether to [`remember_mapped`](Self::remember_mapped) slice `key`, cached under
    /// `epoch`, now that the metadata generation is `meta_gen`: not when the slot holds it
    /// already under both (a request the memo could not answer would rebuild the same
    /// row); yes when the slot is empty or holds `key` under older ones, or when another
    /// slice has held it against enough attempts (which are counted).
    pub fn takes_mapped(&self, key: u64, epoch: u32, meta_gen: u64) -> bool {
        let held = self.slot(key).get();
        if held.key == key {
            return held.taken.epoch() != epoch || held.meta_gen != meta_gen;
        }
        if held.key == EMPTY_KEY {
            return true;
        }
        let n = self.conflicts.get().wrapping_add(1);
        self.conflicts.set(n);
        n.is_multiple_of(MAPPED_EVICT_EVERY)
    }

    /// Brings slice `key`'s mapped row, remembered under `stamp` but an older
    /// metadata generation, to generation `meta_gen` (read before the bitmap) without
    /// decoding its slice again: every word whose host cluster `is_meta` now stops
    /// answering. Clusters only ever become metadata, so the rest still holds.
    /// `marked_min(since)`: the lowest cluster marked since generation `since`, when known;
    /// a row whose every host cluster lies below it is kept without a look at its words.
    /// False when the slot holds no such row (the caller remembers the slice afresh).
    pub fn revalidate_mapped(
        &self,
        key: u64,
        stamp: SliceStamp,
        meta_gen: u64,
        is_meta: impl Fn(u64) -> bool,
        marked_min: impl Fn(u64) -> Option<u64>,
    ) -> bool {
        let s = self.slot(key).get();
        if s.key != key || s.host & MAPPED == 0 || s.taken != stamp || s.meta_gen == meta_gen {
            return false;
        }
        let start = s.host as u32 as usize;
        let Some(map) = self.map.get() else {
            return false;
        };
        let (Some(row), Some(top)) = (
            map.get(start..start + self.entries),
            map.get(start + self.entries),
        ) else {
            return false;
        };
        // Every cluster marked since lies above every cluster the row answers for (the
        // common case: new tables and blocks go where the image grows): nothing to drop.
        if top.get() == NO_WORD || marked_min(s.meta_gen).is_some_and(|m| m > top.get() as u64) {
            self.slot(key).set(MemoSlot { meta_gen, ..s });
            return true;
        }
        for (i, w) in row.iter().enumerate() {
            let v = w.get();
            if v != NO_WORD && is_meta((i64::from(v) + i as i64) as u64) {
                w.set(NO_WORD);
            }
        }
        self.slot(key).set(MemoSlot { meta_gen, ..s });
        true
    }

    /// Remembers slice `key`, read under `stamp`, as mapped: `hosts` gives the host cluster
    /// of each entry in order (0: the memo does not answer for it; at most as many as a
    /// slice has entries, the rest 0); `meta_gen` as for [`remember`](Self::remember).
    pub fn remember_mapped(
        &self,
        key: u64,
        stamp: SliceStamp,
        meta_gen: u64,
        hosts: impl Iterator<Item = u32>,
    ) {
        let map = self.map.get_or_init(|| {
            (0..self.slots() * self.stride())
                .map(|_| Cell::new(NO_WORD))
                .collect()
        });
        let start = self.index(key) * self.stride();
        let (Some(row), Some(top), Ok(tag)) = (
            map.get(start..start + self.entries),
            map.get(start + self.entries),
            u32::try_from(start),
        ) else {
            return;
        };
        let mut hosts = hosts.fuse();
        let mut hi = NO_WORD;
        for (i, w) in row.iter().enumerate() {
            let h = hosts.next().unwrap_or(0);
            w.set(word(i, h));
            hi = hi.max(host_word(h));
        }
        top.set(hi);
        self.slot(key).set(MemoSlot {
            key,
            host: MAPPED | u64::from(tag),
            taken: stamp,
            meta_gen,
        });
    }

    /// Entry `index` of slice `key` changed to host cluster `host` (0: the memo does not
    /// answer for it): a mapped slice's row takes the new word, so a slice that changes
    /// with every allocation is not decoded again for each request; a linear slice (whose
    /// start no longer tells) or another slice's slot is forgotten.
    pub fn patch_mapped(&self, key: u64, index: usize, host: u32) {
        let slot = self.slot(key);
        let held = slot.get();
        if held.key != key {
            return;
        }
        let patched = held.host & MAPPED != 0 && self.patch_at(held.host, index, host);
        if !patched {
            slot.set(MEMO_EMPTY);
        }
    }

    /// Entry `index` of the row at tag `host` (a slot's) takes host cluster `host`, and the
    /// row's highest host cluster follows; false when the row has no such entry.
    fn patch_at(&self, tag: u64, index: usize, host: u32) -> bool {
        let start = tag as u32 as usize;
        let Some(map) = self.map.get().filter(|_| index < self.entries) else {
            return false;
        };
        let (Some(w), Some(top)) = (map.get(start + index), map.get(start + self.entries)) else {
            return false;
        };
        w.set(word(index, host));
        top.set(top.get().max(host_word(host)));
        true
    }

    /// Words per row of the map: the slice's entries and the row's highest host cluster.
    fn stride(&self) -> usize {
        self.entries + 1
    }

    /// Slice `key`'s mapped row, when the memo holds it as remembered from the copy cached
    /// under `stamp` with metadata generation `meta_gen`: a newer copy of the
    /// slice can take the row over ([`carry_mapped`](Self::carry_mapped)) with only the
    /// entries that changed patched, instead of decoding every entry again.
    pub fn mapped_row(&self, key: u64, stamp: SliceStamp, meta_gen: u64) -> Option<MappedRow> {
        let s = self.slot(key).get();
        (s.key == key && s.host & MAPPED != 0 && s.taken == stamp && s.meta_gen == meta_gen)
            .then_some(MappedRow { key, host: s.host })
    }

    /// Entry `index` of `row` takes host cluster `host` (as
    /// [`patch_mapped`](Self::patch_mapped)); false when the row has no such entry (the row
    /// must not be carried over then).
    pub fn patch_row(&self, row: &MappedRow, index: usize, host: u32) -> bool {
        self.patch_at(row.host, index, host)
    }

    /// Remembers `row`'s slice again, now as read under `stamp`, once every
    /// entry in which the newer copy differs is patched ([`patch_row`](Self::patch_row))
    /// and nothing else was remembered since [`mapped_row`](Self::mapped_row) (the row's
    /// words are still the slice's even if the slot was forgotten meanwhile).
    pub fn carry_mapped(&self, row: MappedRow, stamp: SliceStamp, meta_gen: u64) {
        self.slot(row.key).set(MemoSlot {
            key: row.key,
            host: row.host,
            taken: stamp,
            meta_gen,
        });
    }

    /// Forgets every slice (the L1 table was replaced).
    pub fn forget_all(&self) {
        for slot in self.slots.iter() {
            slot.set(MEMO_EMPTY);
        }
    }

    /// Forgets slice `key` (it changed, or its cached copy is being replaced).
    #[inline]
    pub fn forget(&self, key: u64) {
        let slot = self.slot(key);
        if slot.get().key == key {
            slot.set(MEMO_EMPTY);
        }
    }

    /// Look-ups it answered.
    pub fn hits(&self) -> u64 {
        self.hits.get()
    }

    /// Overwrites it answered through a copy older than the slot's epoch (additions since).
    pub fn kept(&self) -> u64 {
        self.kept.get()
    }
}

/// Where a request lies in the slices of a [`MemoView`] ([`MemoView::spot`]): its slice,
/// its offset in it, and that offset plus its length.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Spot {
    key: u64,
    within: u64,
    end: u64,
}

/// The top image's memo as its chain's requests ask it (`Chain::plan`): what a memo hit
/// needs, held by the chain in one place, so that a direct request reaches the memo in one
/// step rather than through the chain's disk, its top image, the image's role and the
/// slice geometry — the memo itself (shared with the image, which fills and forgets it),
/// the shared state its answers are checked against (a core replica's slice epochs; the
/// owner keeps its own memo exact and a read-only image's never changes, both checked
/// under epoch 0), the slice geometry, the device its answers are on, and where
/// read-ahead's tail of a slice starts.
pub(crate) struct MemoView {
    memo: Rc<SliceMemo>,
    /// A core replica's slice epochs ([`Shared::epoch_words`]; none for the owner and a
    /// read-only image): a hit reads its slice's stamp here, without loading and testing
    /// `shared` first.
    epochs: Arc<[AtomicU64]>,
    /// A core replica's shared state (`None`: the owner, a read-only image).
    shared: Option<Arc<Shared>>,
    /// A writable core replica's shared state (its memo answers overwrites,
    /// [`overwrite`](Self::overwrite)); `None` elsewhere: one test per write, not two.
    writes: Option<Arc<Shared>>,
    dev: DevId,
    /// log2 of a slice's coverage (guest bytes), and the coverage less one.
    coverage_bits: u32,
    coverage_mask: u64,
    /// Read-ahead's tail: a request whose offset in its slice plus its length passes this
    /// ends in the tail (`ReadAhead::in_tail`).
    tail_from: u64,
}

impl MemoView {
    /// A view that answers nothing (a chain whose top layer is raw data): slices of one
    /// byte, so no request lies inside one (and every request ends in a tail), over an
    /// empty one-slot memo.
    pub(crate) fn answering_nothing() -> Self {
        MemoView::new(
            Rc::new(SliceMemo::new(1, 1, 9)),
            None,
            false,
            DevId(0),
            1,
            0,
        )
    }

    /// The view of `memo`, checked against `shared` (a core replica's, else `None`),
    /// answering overwrites when `writable`, its answers on `dev`, for slices of `coverage`
    /// guest bytes (a power of two) whose tail starts at `tail_from`.
    pub(crate) fn new(
        memo: Rc<SliceMemo>,
        shared: Option<Arc<Shared>>,
        writable: bool,
        dev: DevId,
        coverage: u64,
        tail_from: u64,
    ) -> Self {
        debug_assert!(coverage.is_power_of_two());
        MemoView {
            memo,
            epochs: shared
                .as_ref()
                .map_or_else(|| Arc::from([]), |s| s.epoch_words()),
            writes: shared.clone().filter(|_| writable),
            shared,
            dev,
            coverage_bits: coverage.trailing_zeros(),
            coverage_mask: coverage - 1,
            tail_from,
        }
    }

    /// The device the memo's answers are on.
    #[inline(always)]
    pub(crate) fn dev(&self) -> DevId {
        self.dev
    }

    /// Where a request of `len` bytes at guest byte `off` lies in this view's slices
    /// ([`Spot`]): worked out once per read, for the tail's test before its route and the
    /// memo's look-up in it.
    #[inline(always)]
    pub(crate) fn spot(&self, off: u64, len: u64) -> Spot {
        let within = off & self.coverage_mask;
        Spot {
            key: off >> self.coverage_bits,
            within,
            // (Past a valid range only for a request the route refuses before the memo.)
            end: within.wrapping_add(len),
        }
    }

    /// Whether the request at `spot` ends in its slice's tail, where read-ahead watches it
    /// (every request, over a raw top layer, whose slices are one byte).
    #[inline(always)]
    pub(crate) fn in_tail(&self, spot: Spot) -> bool {
        spot.end > self.tail_from
    }

    /// A read of `len` bytes at `spot` (of a valid range): where it lies on the device,
    /// when it lies inside one slice, the memo knows that slice under its current epoch
    /// and answers for the range (a hit, counted). Every read the memo answers runs this
    /// and [`SliceMemo::extent`], nothing else.
    #[inline(always)]
    pub(crate) fn read(&self, spot: Spot, len: u64) -> Option<u64> {
        if len == 0 || spot.end > self.coverage_mask + 1 {
            return None;
        }
        let key = spot.key;
        let epoch = match stamp_of(&self.epochs, key) {
            Some(now) => now.epoch(),
            None => self.epoch_hashed(key),
        };
        self.memo.extent(key, epoch, spot.within, len)
    }

    /// An in-place write of `len` bytes at guest byte `off` on a writable core replica:
    /// where it lies on the device and whether it ends in its slice's tail, when the memo
    /// answers for it under the slot's current count of removals and metadata generation
    /// ([`SliceMemo::extent_overwrite`], ARCHITECTURE.md §6); `None` elsewhere.
    #[inline(always)]
    pub(crate) fn overwrite(&self, off: u64, len: u64) -> Option<(u64, bool)> {
        let sh = self.writes.as_deref()?;
        // (As in `read`.)
        let within = off & self.coverage_mask;
        if len == 0 || within + len > self.coverage_mask + 1 {
            return None;
        }
        let key = off >> self.coverage_bits;
        // (Through the shared state, which the metadata generation needs anyway: the view's
        // own words would only add a branch here.)
        let now = sh.stamp(key);
        let host = self
            .memo
            .extent_overwrite(key, now, sh.meta_gen(), within, len)?;
        Some((host, within + len > self.tail_from))
    }

    /// The epoch of slice `key` when it is not its own slot in `epochs` (a large image's
    /// hashed slots), or 0 without a core replica's shared state (the owner's requests
    /// come here: inline).
    #[inline(always)]
    fn epoch_hashed(&self, key: u64) -> u32 {
        match &self.shared {
            Some(s) => s.stamp(key).epoch(),
            None => 0,
        }
    }
}

#[cfg(test)]
mod tests;
