//! The cluster allocator's state: where the next search starts, which clusters were never
//! written since open (fresh: they read as zeros), the data regions reserved for runs of
//! guest clusters (ordered layout), and the guest clusters with an allocation in flight.
//!
//! Invariants: every cluster at or past `fresh_from` was never taken since open (so a
//! cluster counts as fresh only when it is at or past every cluster taken before it);
//! reserved regions never overlap each other; `rt_grows` only increases, so a search that
//! saw it change knows the refcount table moved under it.

use super::HashMap;
use std::collections::BTreeMap;

/// Host clusters reserved for the data clusters of one run of guest clusters (a slice, or
/// a part of one): guest cluster `first + i` goes to host cluster `start + i`, whatever
/// order the guest writes them in. Kept in memory while the image is open; after a
/// reopen, a slice with data gets its region back from where that data lies. Only with
/// `OpenOptions::ordered_layout` on devices that cannot grow, where no cluster is fresh.
#[derive(Clone, Copy)]
pub(crate) struct Region {
    /// First host cluster; 0 when no region could be reserved (the data goes anywhere).
    pub start: u64,
    /// Clusters reserved.
    pub len: u64,
}

/// The allocator's state (see the module doc).
pub(crate) struct AllocState {
    /// Where the next free-cluster search starts.
    hint: u64,
    /// Data regions by region index (guest cluster / region length).
    regions: HashMap<u64, Region>,
    /// First host cluster → end of every reserved region, for the allocator to keep
    /// other clusters out of them.
    region_ends: BTreeMap<u64, u64>,
    /// Where the search for the next region starts.
    region_top: u64,
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
            regions: HashMap::default(),
            region_ends: BTreeMap::new(),
            region_top: 0,
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

    /// Whether any data region is reserved.
    #[inline]
    pub(crate) fn has_regions(&self) -> bool {
        !self.region_ends.is_empty()
    }
    /// The first host cluster of the lowest reserved region.
    pub(crate) fn first_region_start(&self) -> Option<u64> {
        self.region_ends.keys().next().copied()
    }
    /// The end of the reserved region holding host cluster `c`, if any.
    pub(crate) fn region_end_at(&self, c: u64) -> Option<u64> {
        let (_, &end) = self.region_ends.range(..=c).next_back()?;
        (c < end).then_some(end)
    }
    /// The start of a reserved region inside host clusters `c..c + len`, if any.
    pub(crate) fn region_starting_in(&self, c: u64, len: u64) -> Option<u64> {
        self.region_ends.range(c..c + len).next().map(|(&s, _)| s)
    }
    /// Whether host clusters `start..start + len` overlap the reserved region that starts
    /// last below their end.
    pub(crate) fn clashes_with_region(&self, start: u64, len: u64) -> bool {
        self.region_ends
            .range(..start + len)
            .next_back()
            .is_some_and(|(_, &e)| e > start)
    }
    /// Where the search for the next region starts (with the allocation hint).
    pub(crate) fn region_top(&self) -> u64 {
        self.region_top
    }
    /// The region of index `idx`, if reserved (or found impossible) before.
    pub(crate) fn region(&self, idx: u64) -> Option<Region> {
        self.regions.get(&idx).copied()
    }
    /// Records region `idx`: `len` clusters from `start`, or none (`start` `None`: its data
    /// goes wherever the allocator finds room). Returns it.
    pub(crate) fn reserve_region(&mut self, idx: u64, start: Option<u64>, len: u64) -> Region {
        let region = match start {
            Some(c) => {
                self.region_top = c + len;
                self.region_ends.insert(c, c + len);
                Region { start: c, len }
            }
            None => Region { start: 0, len: 0 },
        };
        self.regions.insert(idx, region);
        region
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
