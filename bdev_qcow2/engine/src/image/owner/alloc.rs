//! Host clusters for the owner: free-cluster searches (through the refcounts, kept clear
//! of deferred frees, metadata and reserved data regions), and allocations planned on the
//! spot without I/O (data regions for the ordered layout: `regions.rs`); and the
//! allocator's state they change: where the next search starts, which clusters were never
//! written since open (fresh: they read as zeros), and the guest clusters with an
//! allocation in flight.
//!
//! Invariants: a cluster is taken only with refcount 0, not held by a deferred free, not
//! metadata; the zeroed tail is raised past a cluster before it is taken; the device grows
//! to cover a taken cluster before anything may point at it, and an allocation the device
//! cannot hold takes nothing. Every cluster at or past `fresh_from` was never taken since
//! open (so a cluster counts as fresh only when it is at or past every cluster taken before
//! it); `rt_grows` only increases, so a search that saw it change knows the refcount table
//! moved under it.

use super::Owner;
use crate::error::{corrupt, Error, Field, Result};
use crate::format::refcount::{get_refcount, set_refcount};

use crate::io::BlockDevice;
use crate::types::{HostCluster, HostOffset};

/// The allocator's state (see the module doc).
pub(crate) struct AllocState {
    /// Where the next free-cluster search starts.
    hint: u64,
    /// How many times the refcount table grew since open.
    rt_grows: u64,
    /// Clusters at or past this index were never written since open.
    fresh_from: u64,
    /// Guest clusters with an allocation in flight (writers of the same cluster wait).
    inflight: Inflight,
}

impl AllocState {
    /// The state at open: nothing taken, clusters from `fresh_from` on read as zeros.
    pub(crate) fn new(fresh_from: u64) -> Self {
        AllocState {
            hint: 0,
            rt_grows: 0,
            fresh_from,
            inflight: Inflight::default(),
        }
    }

    /// Where the next free-cluster search starts.
    pub(crate) fn hint(&self) -> u64 {
        self.hint
    }
    /// Clusters up to `end` (exclusive) were just taken: the next search starts there.
    pub(crate) fn taken_up_to(&mut self, end: u64) {
        self.hint = end;
    }
    /// Cluster `c` became free: the next search starts there at the latest.
    pub(crate) fn freed(&mut self, c: u64) {
        if c < self.hint {
            self.hint = c;
        }
    }

    /// Notes clusters `start..start + count` taken: returns whether they are fresh (never
    /// written: at or past every cluster taken before), and they are not fresh any more.
    pub(crate) fn take_fresh(&mut self, start: u64, count: u64) -> bool {
        let fresh = start >= self.fresh_from;
        self.fresh_from = self.fresh_from.max(start + count);
        fresh
    }
    /// Clusters below `end` were written (a new refcount table and its blocks): none of
    /// them is fresh any more.
    pub(crate) fn written_below(&mut self, end: u64) {
        self.fresh_from = self.fresh_from.max(end);
    }
    /// The first cluster never taken since open.
    pub(crate) fn fresh_from(&self) -> u64 {
        self.fresh_from
    }

    /// How many times the refcount table grew since open.
    pub(crate) fn rt_grows(&self) -> u64 {
        self.rt_grows
    }
    /// The refcount table is about to grow (a search running meanwhile starts over).
    pub(crate) fn rt_growing(&mut self) {
        self.rt_grows += 1;
    }

    /// The guest clusters with an allocation in flight.
    #[inline]
    pub(crate) fn inflight(&self) -> &Inflight {
        &self.inflight
    }
    /// The same, to mark or unmark.
    pub(crate) fn inflight_mut(&mut self) -> &mut Inflight {
        &mut self.inflight
    }
}

/// Guest clusters with an allocation in flight: a handful of runs at a time (one per
/// planned write, a group of clusters taken ahead being one run), looked up by every
/// write the owner plans. Runs never overlap: a writer marks only clusters none marks.
#[derive(Debug, Default)]
pub struct Inflight(Vec<(u64, u64)>);

impl Inflight {
    /// Whether guest cluster `c` has an allocation in flight.
    #[inline]
    pub fn contains(&self, c: u64) -> bool {
        self.any(c, c)
    }
    /// Whether any of guest clusters `first..=last` has one.
    #[inline]
    pub fn any(&self, first: u64, last: u64) -> bool {
        self.0.iter().any(|&(a, b)| a <= last && first <= b)
    }
    /// Whether no guest cluster has one.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// Whether any guest cluster at or past `first` has one.
    pub fn any_from(&self, first: u64) -> bool {
        self.0.iter().any(|&(_, b)| b >= first)
    }
    /// Marks guest clusters `first..=last`.
    pub fn mark(&mut self, first: u64, last: u64) {
        debug_assert!(!self.any(first, last), "{first}..={last} marked twice");
        self.0.push((first, last));
    }
    /// Unmarks guest clusters `first..=last` (what is left of a run around them stays).
    pub fn unmark(&mut self, first: u64, last: u64) {
        let mut i = 0;
        while i < self.0.len() {
            let (a, b) = self.0[i];
            if a > last || b < first {
                i += 1;
                continue;
            }
            self.0.swap_remove(i);
            if a < first {
                self.0.push((a, first - 1));
            }
            if b > last {
                self.0.push((last + 1, b));
            }
        }
    }
}

/// How many used clusters past the allocation hint an allocation planned on the spot
/// ([`Owner::alloc_clusters_now`]) skips before it leaves the search to the slow path.
const NOW_SCAN: u64 = 64;

/// Host clusters an allocator took: `count` consecutive clusters from `first` (at least
/// one), their refcounts 1 in the dirty metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Allocation {
    /// The first cluster taken.
    pub first: HostCluster,
    /// How many.
    pub count: u64,
    /// Never written since open: they read as zeros.
    pub fresh: bool,
}

impl Allocation {
    /// The `i`-th cluster taken (`i < count`).
    #[inline]
    pub(crate) fn nth(&self, i: u64) -> HostCluster {
        self.first.plus(i)
    }
    /// The cluster past the last one taken.
    pub(crate) fn end(&self) -> HostCluster {
        self.first.plus(self.count)
    }
}

impl<D: BlockDevice> Owner<'_, D> {
    /// Grows the device size entries may point at (clusters we allocated), and the device
    /// itself so that it covers them whole: another core may write the part of a new
    /// cluster this one did not (a file must not end inside it, or the owner's channel
    /// would trim that write away). Fixed-size devices refuse with ENOSPC.
    pub(crate) fn note_allocated(&self, end_cluster: u64) -> Result<()> {
        let end = end_cluster << self.geo.cluster_bits;
        if end > self.device_size.get() {
            self.exec
                .with_device(self.dev, |d| d.ensure_size(end))
                .map_err(|e| Error::Io(e.0))?;
            self.device_size.set(end);
            let mut ctx = self.ctx.get();
            ctx.device_size = end;
            self.ctx.set(ctx);
            if let Some(sh) = self.published() {
                sh.set_device_size(end);
            }
        }
        self.space_reached(end_cluster);
        Ok(())
    }

    /// Allocates up to `n` contiguous free host clusters (at least one): refcounts become
    /// 1 (dirty). Returns them, `fresh` when they were never written since open and read as
    /// zeros.
    ///
    /// Data regions (on a device that cannot grow) are kept clear: only when nothing else
    /// in the device is free does a second pass take clusters inside them (and then, as
    /// without regions, past the end).
    pub(crate) async fn alloc_clusters(&self, n: u64) -> Result<Allocation> {
        if let Some(r) = self.alloc_clusters_now(n)? {
            return Ok(r);
        }
        let m = self.meta();
        self.reclaim_graced();
        let (start, count) = loop {
            let grows = m.st().alloc.rt_grows();
            let (start, count) = self.find_free_run(n).await?;
            // Checking a cluster past the refcount table's reach grows the table, and the
            // new table goes where it finds room: perhaps on the run found before.
            if m.st().alloc.rt_grows() == grows {
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
    pub(crate) fn alloc_clusters_now(&self, n: u64) -> Result<Option<Allocation>> {
        let m = self.meta();
        if m.st().regions.has_regions() {
            return Ok(None);
        }
        self.reclaim_graced();
        // Clusters past the zeroed tail wait for the tail to be raised (I/O).
        let tail = m.st().tail.first_cluster(self.geo.cluster_bits);
        let limit = self.alloc_limit().min(tail.unwrap_or(u64::MAX));
        let hint = m.st().alloc.hint().max(1);
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
        if !self.run_is_free_now(start + 1, n - 1)? {
            return Ok(None);
        }
        let mut c = start;
        while c < start + n {
            // Checked free and loaded above, nothing ran since.
            let Some((block, idx)) = self.rc_locate(c)? else {
                return Err(corrupt(
                    Field::RefcountBlockEntry,
                    c,
                    "refcount block vanished",
                ));
            };
            let count = (self.per_block() - idx).min(start + n - c);
            self.take_loaded_refcounts(block, idx, count, c)?;
            c += count;
        }
        self.allocated(start, n).map(Some)
    }

    /// Whether the `n` host clusters from `first` on are all free for the allocator now
    /// (as [`cluster_is_free_now`](Self::cluster_is_free_now) of each; false as well when
    /// a refcount block is not in memory): one look-up per refcount block and one overlap
    /// check for the run, not one of each per cluster, since a first write at small
    /// clusters takes a granule of them (#48).
    fn run_is_free_now(&self, first: u64, n: u64) -> Result<bool> {
        if n == 0 {
            return Ok(true);
        }
        {
            let st = self.meta().st();
            if !st.frees.holds_none() && (first..first + n).any(|c| st.frees.holds(c)) {
                return Ok(false);
            }
        }
        let cs = self.geo.cluster_size();
        if self.overlaps_metadata(self.geo.host_cluster_offset(HostCluster(first)), n * cs) {
            return Ok(false);
        }
        let order = self.header.borrow().header.refcount_order;
        let mut c = first;
        while c < first + n {
            let Some((block, idx)) = self.rc_locate(c)? else {
                return Ok(false);
            };
            let count = (self.per_block() - idx).min(first + n - c);
            let all_free = |b: &[u8]| (idx..idx + count).all(|i| get_refcount(b, order, i) == 0);
            // The dirty copy wins over the cache (as in `with_rc_block`).
            let free = match self.meta().st().dirty.rc(block) {
                Some(b) => all_free(b),
                None => {
                    let mut cache = self.rc_cache.borrow_mut();
                    match cache.lookup(block, 0) {
                        Some(w) => all_free(cache.block(w)),
                        None => false,
                    }
                }
            };
            if !free {
                return Ok(false);
            }
            c += count;
        }
        Ok(true)
    }

    /// Whether [`alloc_clusters_now`](Self::alloc_clusters_now) of `n` clusters would take
    /// fresh ones (they read as zeros without being written) that the device holds or
    /// grows to hold: what a first write needs to take more clusters than it writes
    /// (`OpenOptions::alloc_granule`).
    pub(crate) fn next_run_fresh(&self, n: u64) -> bool {
        let st = self.meta().st();
        let hint = st.alloc.hint().max(1);
        if hint < st.alloc.fresh_from() || st.regions.has_regions() {
            return false;
        }
        let end = (hint + NOW_SCAN + n) << self.geo.cluster_bits;
        end <= self.device_size.get() || self.exec.with_device(self.dev, |d| d.can_grow())
    }

    /// The bookkeeping of clusters `start..start + count` just taken: device size first
    /// (a device that cannot hold them fails the allocation, and their refcounts go back
    /// to 0: nothing is taken), then allocation hint, counters, freshness. Returns what
    /// the allocators return.
    fn allocated(&self, start: u64, count: u64) -> Result<Allocation> {
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
            let mut st = self.meta().st_mut();
            st.alloc.taken_up_to(start + count);
            st.stats.clusters_allocated += count;
            st.alloc.take_fresh(start, count)
        };
        Ok(Allocation {
            first: HostCluster(start),
            count,
            fresh,
        })
    }

    /// The first run of up to `n` free host clusters from the allocation hint (see
    /// [`alloc_clusters`](Self::alloc_clusters)), not taken yet: (first cluster, count).
    async fn find_free_run(&self, n: u64) -> Result<(u64, u64)> {
        let m = self.meta();
        let hint = m.st().alloc.hint().max(1);
        let mut c = hint;
        let limit = self.alloc_limit();
        let mut keep_out = m.st().regions.has_regions();
        // Regions exist only on devices that cannot grow: the first pass stays inside.
        let inside = (self.device_size.get() >> self.geo.cluster_bits).min(limit);
        let start = loop {
            if (keep_out && c >= inside) || c > limit {
                if keep_out {
                    // Below the hint everything but the regions' free slots is in use.
                    keep_out = false;
                    let first_region = m.st().regions.first_region_start();
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
    pub(super) async fn take_clusters(&self, start: u64, count: u64) -> Result<()> {
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

    /// One past the last host cluster in use: counted by a refcount, or holding the
    /// image's own tables (counted too, unless the image is inconsistent). Reads refcount
    /// blocks from the top of the refcount table down to the first that counts a cluster:
    /// one, as a rule.
    async fn used_end(&self) -> Result<u64> {
        let bits = self.geo.cluster_bits;
        let mut end = 1;
        self.any_static_metadata(|start, bytes| {
            end = end.max((start + bytes).div_ceil(1 << bits));
            false
        });
        end = end.max(self.table_clusters().into_iter().max().map_or(0, |c| c + 1));
        let order = self.header.borrow().header.refcount_order;
        let per_block = self.per_block();
        let top = self.refcount_table.borrow().len() as u64;
        for r in (0..top).rev() {
            let Some((block, _)) = self.rc_locate(r * per_block)? else {
                continue;
            };
            self.load_rc_block(block).await?;
            let last = self.with_rc_block(block, |b| {
                (0..per_block)
                    .rev()
                    .find(|&i| get_refcount(b, order, i) != 0)
            });
            if let Some(i) = last {
                return Ok(end.max(r * per_block + i + 1));
            }
        }
        Ok(end)
    }

    /// Starts zeroing ahead of the allocator (`OpenOptions::zero_ahead`), past every
    /// cluster in use; at open, before anything is taken, on a device that cannot grow and
    /// an image without a zeroed tail of its own.
    pub(crate) async fn start_zero_ahead(&self) -> Result<()> {
        let m = self.meta();
        let can_grow = self.exec.with_device(self.dev, |d| d.can_grow());
        if can_grow || m.st().tail.from().is_some() {
            return Ok(());
        }
        let end = self.used_end().await?;
        m.st_mut().start_zero_ahead(end, self.geo.cluster_bits);
        Ok(())
    }

    /// The last cluster index (exclusive bound) the allocator may hand out.
    fn alloc_limit(&self) -> u64 {
        self.device_size
            .get()
            .saturating_add(crate::limits::MAX_ALLOC_PAST_END)
            >> self.geo.cluster_bits
    }

    /// The first of host clusters `c..c + len` that [`cluster_is_free`] would refuse, if
    /// any: as many checks, made a refcount block at a time where it can (a region's
    /// reservation checks a whole slice of clusters), and a missing refcount block means
    /// free clusters without creating it (a grown refcount table is placed with this: its
    /// new blocks then cover such clusters).
    ///
    /// [`cluster_is_free`]: Self::cluster_is_free
    pub(crate) async fn first_busy(&self, c: u64, len: u64) -> Result<Option<u64>> {
        let m = self.meta();
        let sets_empty = m.st().frees.holds_none();
        let bits = self.geo.cluster_bits;
        let order = self.header.borrow().header.refcount_order;
        if !sets_empty || self.overlaps_metadata(HostOffset(c << bits), len << bits) {
            let cs = self.geo.cluster_size();
            for x in c..c + len {
                let unstable = m.st().frees.holds(x);
                if unstable || self.overlaps_metadata(HostOffset(x << bits), cs) {
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
    pub(super) async fn cluster_is_free(&self, c: u64) -> Result<bool> {
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
        if self.excluded_from_alloc(c) {
            return Ok(Some(false));
        }
        let Some((block, idx)) = self.rc_locate(c)? else {
            return Ok(None);
        };
        let order = self.header.borrow().header.refcount_order;
        if let Some(b) = self.meta().st_mut().dirty.rc_mut(block) {
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
        if self.meta().st().frees.holds(c) {
            return true;
        }
        self.overlaps_metadata(
            self.geo.host_cluster_offset(HostCluster(c)),
            self.geo.cluster_size(),
        )
    }

    /// [`cluster_is_free`](Self::cluster_is_free) from memory: `None` when the answer
    /// needs its refcount block loaded or created.
    fn cluster_is_free_now(&self, c: u64) -> Result<Option<bool>> {
        if self.excluded_from_alloc(c) {
            return Ok(Some(false));
        }
        let Some((block, idx)) = self.rc_locate(c)? else {
            return Ok(None);
        };
        let order = self.header.borrow().header.refcount_order;
        // The dirty copy wins over the cache (as in `with_rc_block`).
        if let Some(b) = self.meta().st().dirty.rc(block) {
            return Ok(Some(get_refcount(b, order, idx) == 0));
        }
        let mut cache = self.rc_cache.borrow_mut();
        Ok(cache
            .lookup(block, 0)
            .map(|w| get_refcount(cache.block(w), order, idx) == 0))
    }
}

#[cfg(test)]
mod tests {
    use super::Inflight;

    #[test]
    fn inflight_runs_answer_by_cluster_and_unmark_in_part() {
        let mut f = Inflight::default();
        assert!(!f.contains(0) && !f.any(0, u64::MAX) && !f.any_from(0));
        f.mark(16, 31);
        f.mark(40, 40);
        assert!(f.contains(16) && f.contains(31) && f.contains(40));
        assert!(!f.contains(15) && !f.contains(32) && !f.contains(39));
        assert!(f.any(0, 16) && f.any(31, 35) && !f.any(32, 39));
        assert!(f.any_from(40) && !f.any_from(41));
        // Part of a run: the rest stays marked.
        f.unmark(20, 23);
        assert!(f.contains(19) && !f.contains(20) && !f.contains(23) && f.contains(24));
        f.unmark(0, 100);
        assert!(!f.any(0, u64::MAX));
    }
}
