//! Look-ups from cached metadata: a guest offset's mapping from the slice cache, and the
//! memo of linear and mapped slices in front of it (ARCHITECTURE.md §4), with the
//! metadata checks a core's overwrite needs.

use super::role::ImageRole;
use super::{Qcow2, Touch};
use crate::coherency::{Shared, SliceStamp};
use crate::error::{corrupt, Field, Result};
use crate::format::{ClusterMapping, L1Entry, L2Entry, SubclusterBitmap};
use crate::io::BlockDevice;
use crate::memo::{MemoView, MEMO_NO_META_GEN};
use crate::types::{GuestOffset, SUBCLUSTERS};

/// What the slice cache alone says of a range asked as one device extent
/// ([`Qcow2::cached_extent_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CachedExtent {
    /// One device extent, starting at this host byte.
    Host(u64),
    /// No extent for an in-place write, and the general look-up would find none either:
    /// the range lies in one cluster of a current slice whose standard entry has no host
    /// cluster (unallocated, or zero) or, when COPIED was asked for, is not COPIED.
    NotInPlace,
    /// The cache alone does not tell: the caller asks the general look-up.
    Unknown,
}

/// What a cached look-up wants of a range's clusters ([`Qcow2::cached_extent_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wanted {
    /// Plain data to read.
    Data,
    /// Plain data to overwrite in place: COPIED clusters only.
    CopiedData,
}

/// Whether a cached look-up asks the memo of slices before the slice cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MemoFirst {
    /// Ask it.
    Ask,
    /// Skip it: the caller has just asked it.
    Skip,
}

impl<D: BlockDevice> Qcow2<D> {
    /// The host offset of the L2 table covering `off`, or `None` if unallocated.
    pub(crate) fn l2_table(&self, off: GuestOffset) -> Result<Option<crate::types::HostOffset>> {
        let idx = self.geo.l1_index(off) as usize;
        let e = match self.core_shared() {
            Some(s) if idx < s.l1_len() => {
                let raw = s.l1(idx);
                // The owner grows the device before it publishes an entry pointing there.
                self.sync_core();
                Some(L1Entry(raw))
            }
            Some(_) => None,
            None => self.l1.borrow().get(idx).copied(),
        }
        .ok_or_else(|| corrupt(Field::L1Entry, idx as u64, "L1 index beyond the L1 table"))?;
        e.l2_table(self.geo.cluster_size(), self.device_size.get())
    }

    /// Interprets the (sub)cluster at `off` from its slice `block`; returns the mapping and
    /// the guest offset where that (sub)cluster ends.
    pub(crate) fn resolve(&self, block: &[u64], off: GuestOffset) -> Result<(ClusterMapping, u64)> {
        let ctx = self.ctx.get();
        let i = self.geo.index_in_slice(off) as usize;
        let cs = self.geo.cluster_size();
        let cluster_start = off.0 & !(cs - 1);
        if self.geo.extended_l2() {
            let sc_size = cs / SUBCLUSTERS;
            let sc = self.geo.offset_in_cluster(off.0) / sc_size;
            let m = L2Entry(block[2 * i]).subcluster_mapping(
                SubclusterBitmap(block[2 * i + 1]),
                sc,
                &ctx,
            )?;
            // A compressed cluster is one unit, whatever its subclusters.
            let end = match m {
                ClusterMapping::Compressed(_) => cluster_start + cs,
                _ => cluster_start + (sc + 1) * sc_size,
            };
            Ok((m, end))
        } else {
            Ok((L2Entry(block[i]).mapping(&ctx)?, cluster_start + cs))
        }
    }

    /// Mapping of the (sub)cluster at `off` if its slice is cached (fast path; touches the
    /// LRU and counts a hit). `Ok(None)` on a cache miss. Returns the mapping and its end.
    pub fn resolve_cached(&self, off: GuestOffset) -> Result<Option<(ClusterMapping, u64)>> {
        self.resolve_cached_as(off, Touch::Yes)
    }

    /// [`resolve_cached`](Self::resolve_cached), touching the LRU and counting a hit as
    /// `touch` says: a look-up that plans an in-place write counts only an entry it can use.
    pub(crate) fn resolve_cached_as(
        &self,
        off: GuestOffset,
        touch: Touch,
    ) -> Result<Option<(ClusterMapping, u64)>> {
        // A core's device size is synced where it matters: after loading an L1 entry
        // (`l2_table`) and before caching a slice, so every cached entry fits in it.
        let Some(_) = self.l2_table(off)? else {
            return Ok(Some((
                ClusterMapping::Unallocated { host: None },
                self.l1_entry_end(off),
            )));
        };
        let key = self.geo.slice_id(off);
        let epoch = self.cur_epoch(key);
        let mut cache = self.l2_cache.borrow_mut();
        let Some(hit) = cache.probe(key, epoch) else {
            return Ok(None);
        };
        let way = hit.way;
        if !self.geo.extended_l2() {
            let ctx = self.ctx.get();
            let i = self.geo.index_in_slice(off);
            // A linear slice gives the mapping without loading the entry.
            let data = match cache.aux(way).linear.host(i, ctx.cluster_bits) {
                Some(h) if h + (1 << ctx.cluster_bits) <= ctx.device_size => Some((h, true)),
                _ => L2Entry(cache.block(way)[i as usize])
                    .plain_data(ctx.cluster_bits, ctx.device_size),
            };
            if touch == Touch::Yes || (touch == Touch::IfCopied && data.is_some_and(|d| d.1)) {
                cache.touch(hit);
            }
            if let Some((host, copied)) = data {
                let cs = self.geo.cluster_size();
                return Ok(Some((
                    ClusterMapping::Data {
                        host: crate::types::HostOffset(host),
                        copied,
                    },
                    (off.0 & !(cs - 1)) + cs,
                )));
            }
            return self.resolve(cache.block(way), off).map(Some);
        }
        let r = self.resolve(cache.block(way), off)?;
        if touch == Touch::Yes
            || (touch == Touch::IfCopied
                && matches!(r.0, ClusterMapping::Data { copied: true, .. }))
        {
            cache.touch(hit);
        }
        Ok(Some(r))
    }

    /// The host offset of `[off, off + len)` (non-empty) when its mapping is one device
    /// extent that the cache alone gives, without the general look-up's decoding: the range
    /// lies in one cached slice that is valid now, and either the slice is linear (every
    /// entry plain COPIED data in consecutive host clusters, `LinearSlice`: any range
    /// inside it; with `memo`, asked of the memo of slices first) or the range lies
    /// in one cluster whose entry is plain data (COPIED when [`Wanted::CopiedData`], as an in-place write
    /// needs; with extended L2, every subcluster the range touches allocated data). The
    /// clusters lie inside the device. Touches the LRU and counts a hit only then.
    ///
    /// [`CachedExtent::NotInPlace`] when the range lies in one cluster of a current slice
    /// whose standard entry has no host cluster (unallocated, or zero) or, for
    /// [`Wanted::CopiedData`], is
    /// not COPIED: no in-place plan exists there, and the general look-up would find the
    /// same. [`CachedExtent::Unknown`] sends the caller to the general look-up, which also
    /// handles everything
    /// this skips: unallocated L2 tables, zero, compressed entries, unallocated or zero
    /// subclusters, a device size this core has not synced yet. (No L1 check is needed: a
    /// slice is cached only from an allocated table, and the owner makes a table's slices
    /// odd, or drops them from its own cache, before it changes the L1 entry; see
    /// `coherency`.) [`MemoFirst::Skip`]: for a caller that has just asked the memo
    /// ([`memo_extent`](Self::memo_extent)).
    #[inline(always)]
    pub(crate) fn cached_extent_with(
        &self,
        off: u64,
        len: u64,
        wanted: Wanted,
        memo: MemoFirst,
    ) -> CachedExtent {
        let Some((key, within)) = self.geo.in_one_slice(off, len) else {
            return CachedExtent::Unknown;
        };
        let epoch = self.cur_epoch(key);
        // A slice remembered under the current epoch: the clusters it answers for are
        // COPIED data inside the device (checked when remembered).
        if let Some(host) = (memo == MemoFirst::Ask)
            .then(|| self.memo.extent(key, epoch, within, len))
            .flatten()
        {
            return CachedExtent::Host(host);
        }
        self.cached_extent_in_cache(off, len, wanted, (key, within), epoch)
    }

    /// On a writable core replica, for the memo: the metadata generation under which none
    /// of the `len` bytes of host clusters at `first` was metadata (read before the bitmap,
    /// so a cluster marked meanwhile moves it), else [`MEMO_NO_META_GEN`].
    pub(super) fn slice_clear_of_metadata(&self, first: u64, len: u64) -> u64 {
        let Some(sh) = self.writable_core_shared() else {
            return MEMO_NO_META_GEN;
        };
        let g = sh.meta_gen();
        let bits = self.ctx.get().cluster_bits;
        if sh.meta_range_clear(first >> bits, len >> bits) {
            g
        } else {
            MEMO_NO_META_GEN
        }
    }

    /// On a writable core replica: where an in-place write of `[off, off + len)` goes, when
    /// the memo knows its linear slice under the current epoch and no cluster of that slice
    /// has been metadata since it looked (ARCHITECTURE.md §9: the plan `plan_write_extent` makes
    /// through the cache, with its metadata check, in a few compares).
    #[inline(always)]
    pub(crate) fn memo_overwrite(&self, off: u64, len: u64) -> Option<u64> {
        let sh = self.writable_core_shared()?;
        let (key, within) = self.geo.in_one_slice(off, len)?;
        let now = sh.stamp(key);
        self.memo
            .extent_overwrite(key, now, sh.meta_gen(), within, len)
    }

    /// The view of this image's memo its chain's requests ask (`Chain::plan`): checked
    /// against a core replica's slice epochs (epoch 0 elsewhere, as
    /// [`cached_extent_with`](Self::cached_extent_with) checks it), answering overwrites on
    /// a writable core replica ([`memo_overwrite`](Self::memo_overwrite)); read-ahead's
    /// tail of a slice starts at `tail_from`.
    pub(crate) fn memo_view(&self, tail_from: u64) -> MemoView {
        MemoView::new(
            self.memo.clone(),
            match &self.role {
                ImageRole::Replica(c) => Some(c.shared.clone()),
                _ => None,
            },
            self.writable_core_shared().is_some(),
            self.data_dev,
            self.geo.slice_coverage(),
            tail_from,
        )
    }

    /// [`cached_extent_with`](Self::cached_extent_with) past the memo, for the range at
    /// `within` in slice `key`: the slice cache (out of line, so that the memo's hit stays
    /// small).
    #[inline(never)]
    pub(super) fn cached_extent_in_cache(
        &self,
        off: u64,
        len: u64,
        wanted: Wanted,
        (key, within): (u64, u64),
        epoch: u32,
    ) -> CachedExtent {
        let coverage = self.geo.slice_coverage();
        let Ok(mut cache) = self.l2_cache.try_borrow_mut() else {
            return CachedExtent::Unknown;
        };
        let Some(hit) = cache.probe(key, epoch) else {
            return CachedExtent::Unknown;
        };
        let way = hit.way;
        let ctx = self.ctx.get();
        let cs = 1u64 << ctx.cluster_bits;
        let host = match cache.aux(way).linear.host(0, ctx.cluster_bits) {
            Some(first) => {
                let host = first + within;
                // Every cluster the range touches ends inside the device (the general path
                // checks each cluster the same way).
                if (host + len).next_multiple_of(cs) > ctx.device_size {
                    return CachedExtent::Unknown;
                }
                // The whole slice inside the device: every request within it passes the
                // check above.
                if first
                    .checked_add(coverage)
                    .is_some_and(|e| e <= ctx.device_size)
                {
                    let meta_gen = self.slice_clear_of_metadata(first, coverage);
                    let removals = cache.aux(way).removals;
                    self.memo
                        .remember(key, first, SliceStamp::of(epoch, removals), meta_gen);
                }
                host
            }
            _ => {
                if !self.geo.extended_l2() {
                    let meta_gen = self
                        .writable_core_shared()
                        .map_or(MEMO_NO_META_GEN, |sh| sh.meta_gen());
                    let removals = cache.aux(way).removals;
                    let stamp = SliceStamp::of(epoch, removals);
                    self.refresh_mapped(key, stamp, meta_gen, cache.block(way));
                }
                let in_cluster = off & (cs - 1);
                if in_cluster + len > cs {
                    return CachedExtent::Unknown;
                }
                let i = self.geo.index_in_slice(GuestOffset(off)) as usize;
                let block = cache.block(way);
                let entry = if self.geo.extended_l2() {
                    // The entry's host offset holds the whole cluster; the subclusters the
                    // range touches must all be allocated data.
                    let sc = self.geo.subcluster_size();
                    let (Some(&e), Some(&bitmap)) = (block.get(2 * i), block.get(2 * i + 1)) else {
                        return CachedExtent::Unknown;
                    };
                    if !SubclusterBitmap(bitmap)
                        .all_data(in_cluster / sc, (in_cluster + len - 1) / sc)
                    {
                        return CachedExtent::Unknown;
                    }
                    L2Entry(e)
                } else {
                    let Some(&e) = block.get(i) else {
                        return CachedExtent::Unknown;
                    };
                    L2Entry(e)
                };
                match entry.plain_data(ctx.cluster_bits, ctx.device_size) {
                    Some((h, c)) if c || wanted == Wanted::Data => h + in_cluster,
                    // Not COPIED: the general look-up agrees.
                    Some(_) => return CachedExtent::NotInPlace,
                    // No host cluster (standard L2): unallocated or zero, for everyone.
                    None if !self.geo.extended_l2() && entry.host_bits() == 0 => {
                        return CachedExtent::NotInPlace
                    }
                    None => return CachedExtent::Unknown,
                }
            }
        };
        cache.touch_fresh(hit);
        CachedExtent::Host(host)
    }

    /// Brings the memo's mapped row of slice `key` (cached under `stamp` with entries
    /// `block`) to metadata generation `meta_gen`: in place when it holds the row under an
    /// older generation (a new L2 table or refcount block moves the generation, dozens of
    /// times in a fill, and each move would otherwise decode every slice again), else
    /// afresh when [`SliceMemo::takes_mapped`] says so.
    pub(super) fn refresh_mapped(&self, key: u64, stamp: SliceStamp, meta_gen: u64, block: &[u64]) {
        let sh = self.writable_core_shared();
        let is_meta = |c: u64| sh.is_some_and(|sh| sh.is_meta_cluster(c));
        let marked_min = |since: u64| sh.and_then(|sh| sh.meta_marked_min(since, meta_gen));
        if !self
            .memo
            .revalidate_mapped(key, stamp, meta_gen, is_meta, marked_min)
            && self.memo.takes_mapped(key, stamp.epoch(), meta_gen)
        {
            self.remember_mapped(key, stamp, meta_gen, block);
        }
    }

    /// Remembers slice `key`, a standard (not extended) slice that is not linear, cached
    /// under `epoch` with entries `block`, in the memo as mapped: the host cluster of each
    /// entry that is plain COPIED data inside the device and, on a writable core replica,
    /// not metadata under `meta_gen`, the bitmap's generation read before (as for a linear
    /// slice).
    #[inline(never)]
    pub(super) fn remember_mapped(
        &self,
        key: u64,
        stamp: SliceStamp,
        meta_gen: u64,
        block: &[u64],
    ) {
        // One decode per entry, the context and the bitmap read once: a slice that changes
        // under a fill is remembered again for every new copy.
        let ctx = self.ctx.get();
        let core = self.writable_core_shared();
        let hosts = block
            .iter()
            .map(|&e| memo_word_in(ctx.cluster_bits, ctx.device_size, core, L2Entry(e)));
        self.memo.remember_mapped(key, stamp, meta_gen, hosts);
    }

    /// A standard L2 entry's word in a mapped memo row: its host cluster when it is plain
    /// COPIED data inside the device and, on a writable core replica, not metadata; else 0.
    pub(crate) fn memo_word(&self, e: L2Entry) -> u32 {
        let ctx = self.ctx.get();
        memo_word_in(
            ctx.cluster_bits,
            ctx.device_size,
            self.writable_core_shared(),
            e,
        )
    }

    /// Where this replica's cached L2 entry for `off` lies in memory, if its slice is cached
    /// (under any epoch) and not linear (a linear one resolves without the entry): a host
    /// may prefetch it before starting the request, so the load in
    /// [`resolve_cached`](Self::resolve_cached) does not stall. A hint only: nothing is
    /// validated, and the pointer must not be dereferenced.
    pub fn entry_hint(&self, off: GuestOffset) -> Option<*const u64> {
        let cache = self.l2_cache.try_borrow().ok()?;
        let way = cache.peek(self.geo.slice_id(off))?;
        // A linear slice is resolved without loading the entry: nothing to prefetch.
        if cache
            .aux(way)
            .linear
            .host(0, self.geo.cluster_bits)
            .is_some()
        {
            return None;
        }
        let i = self.geo.index_in_slice(off) as usize * if self.geo.extended_l2() { 2 } else { 1 };
        cache.block(way).get(i).map(|e| e as *const u64)
    }

    /// Whether this replica holds the slice covering `off` under its current epoch (no
    /// counters, no LRU update): read-ahead skips such a slice.
    pub fn slice_is_current(&self, off: GuestOffset) -> bool {
        let key = self.geo.slice_id(off);
        let epoch = self.cur_epoch(key);
        self.l2_cache
            .try_borrow()
            .is_ok_and(|c| c.peek_epoch(key) == Some(epoch))
    }
}

/// [`Qcow2::memo_word`] with the image's cluster bits, device size and (on a writable core
/// replica) metadata bitmap given.
#[inline(always)]
pub(super) fn memo_word_in(bits: u32, device_size: u64, core: Option<&Shared>, e: L2Entry) -> u32 {
    let Some((h, true)) = e.plain_data(bits, device_size) else {
        return 0;
    };
    let cluster = h >> bits;
    match u32::try_from(cluster) {
        Ok(c) if core.is_none_or(|sh| !sh.is_meta_cluster(cluster)) => c,
        _ => 0,
    }
}
