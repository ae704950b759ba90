//! Data regions for the ordered layout (`OpenOptions::ordered_layout`, on a device that
//! cannot grow): host clusters reserved per run of guest clusters (a slice, or a part of
//! one), so that guest clusters written in any order lie in guest order on the host. The
//! reserved regions as the owner keeps them, and their reservation and use.
//!
//! Invariant: reserved regions never overlap each other; the allocator keeps other
//! clusters out of them until nothing else is free.

use super::alloc::Allocation;
use super::{HashMap, Owner};
use crate::error::Result;
use crate::format::L2Entry;
use crate::io::BlockDevice;
use crate::types::{GuestOffset, HostCluster};
use std::collections::BTreeMap;

/// Largest data region reserved at once for a run of guest clusters (see
/// [`Owner::alloc_data`]): a whole L2 slice up to this size, a part of one beyond.
const MAX_REGION_BYTES: u64 = 64 << 20;

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

/// The reserved regions (see the module doc).
#[derive(Default)]
pub(crate) struct DataRegions {
    /// Data regions by region index (guest cluster / region length).
    regions: HashMap<u64, Region>,
    /// First host cluster → end of every reserved region, for the allocator to keep
    /// other clusters out of them.
    region_ends: BTreeMap<u64, u64>,
    /// Where the search for the next region starts.
    region_top: u64,
}

impl DataRegions {
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
}

impl<D: BlockDevice> Owner<'_, D> {
    /// The end of the reserved region holding host cluster `c`, if any.
    pub(super) fn region_end_at(&self, c: u64) -> Option<u64> {
        self.meta().st().regions.region_end_at(c)
    }

    /// Guest clusters per data region.
    fn region_len(&self) -> u64 {
        self.geo
            .slice_entries()
            .min((MAX_REGION_BYTES >> self.geo.cluster_bits).max(1))
    }

    /// Allocates host clusters for the data of guest clusters `g..g + n` (consecutive, in
    /// one L2 slice, each needing a new cluster): where their region puts them, so that
    /// guest clusters written in any order, by any number of streams, lie in guest order
    /// on the host (a slice filled so is linear: `LinearSlice`; sequential reads are
    /// sequential on the device), else wherever [`alloc_clusters`](Self::alloc_clusters)
    /// finds room. Returns them like `alloc_clusters`; the count may be less than `n`.
    ///
    /// Only with `OpenOptions::ordered_layout`, and on a device that cannot grow (a bdev,
    /// a block device), whose whole size is the image's to use: on a file, a region would
    /// make it jump ahead by up to a region for one write (sparsely, but visibly), and
    /// appending already lays out a single stream in order. Off by default: random first
    /// writes scattered over regions are slower than appended ones, while a slice filled
    /// by several streams is linear with it.
    pub(crate) async fn alloc_data(&self, g: u64, n: u64) -> Result<Allocation> {
        if !self.allocates_by_region() {
            return self.alloc_clusters(n).await;
        }
        match self.alloc_in_region(g, n).await? {
            Some(r) => Ok(r),
            None => self.alloc_clusters(n).await,
        }
    }

    /// Whether [`alloc_data`](Self::alloc_data) places data by regions (ordered layout on
    /// a device that cannot grow) rather than where `alloc_clusters` finds room.
    pub(crate) fn allocates_by_region(&self) -> bool {
        self.meta().ordered_layout() && !self.exec.with_device(self.dev, |d| d.can_grow())
    }

    async fn alloc_in_region(&self, g: u64, n: u64) -> Result<Option<Allocation>> {
        let m = self.meta();
        self.reclaim_graced();
        let per = self.region_len();
        let idx = g / per;
        let known = m.st().regions.region(idx).map(|r| (r.start, r.len));
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
            let grows = m.st().alloc.rt_grows();
            let mut count = 0;
            while count < n && self.cluster_is_free(goal + count).await? {
                count += 1;
            }
            // As in `alloc_clusters`: a table that grew meanwhile may lie on the run.
            if m.st().alloc.rt_grows() == grows {
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
        let mut st = m.st_mut();
        st.stats.clusters_allocated += count;
        // Regions fill out of order: a cluster below the last one taken counts as written.
        Ok(Some(Allocation {
            first: HostCluster(goal),
            count,
            fresh: st.alloc.take_fresh(goal, count),
        }))
    }

    /// Reserves the host clusters of region `idx`: where its data already lies, else the
    /// first run of clusters free for all of it at or after the last region and the
    /// allocation hint, searched for a bounded distance, inside the device. Records and
    /// returns (start, length); length 0 when there is no such run (the region's data then
    /// goes wherever the allocator finds room, for as long as the image stays open).
    async fn reserve_region(&self, idx: u64) -> Result<(u64, u64)> {
        let m = self.meta();
        let per = self.region_len();
        let total = self.size().div_ceil(self.geo.cluster_size());
        let len = per.min(total.saturating_sub(idx * per));
        // Inside the device, which cannot grow (see `alloc_data`): looking further would
        // only make refcount blocks for clusters it cannot use.
        let end = self.device_size.get() >> self.geo.cluster_bits;
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
                let st = m.st();
                st.alloc.hint().max(st.regions.region_top()).max(1)
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
                let next = m.st().regions.region_starting_in(c, len);
                if let Some(next) = next {
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
        let region = m.st_mut().regions.reserve_region(idx, found, len);
        Ok((region.start, region.len))
    }

    /// Where the region of guest clusters `g0..g0 + len` (inside one slice) starts when its
    /// first data cluster (a plain data entry, `L2Entry::plain_data`) is taken to be in
    /// its slot, as the ordered layout put it before the image was reopened: `None` when the
    /// clusters have no data yet, or that region would leave the device or overlap another.
    async fn region_of_data(&self, g0: u64, len: u64) -> Result<Option<u64>> {
        let bits = self.geo.cluster_bits;
        let off = GuestOffset(g0 << bits);
        let Some(way) = self.load_slice(off).await? else {
            return Ok(None);
        };
        let (key, i0) = (
            self.geo.slice_id(off),
            self.geo.index_in_slice(off) as usize,
        );
        let step = if self.geo.extended_l2() { 2 } else { 1 };
        let first = |words: &[u64]| {
            (0..len as usize).find_map(|k| {
                let e = L2Entry(*words.get((i0 + k) * step)?);
                let (host, _) = e.plain_data(bits, u64::MAX)?;
                Some((host >> bits).checked_sub(k as u64))
            })
        };
        let m = self.meta();
        let found = match m.st().dirty.slice(key) {
            Some(words) => first(words),
            None => first(self.l2_cache.borrow().block(way)),
        };
        let Some(Some(start)) = found else {
            return Ok(None);
        };
        let end = self.device_size.get() >> bits;
        let clash = m.st().regions.clashes_with_region(start, len);
        Ok((start > 0 && start + len <= end && !clash).then_some(start))
    }
}
