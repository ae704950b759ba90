//! A planned write's parts: what the write does to each guest cluster ([`Action`]), the
//! parts of a plan ([`Part`]) and the host clusters it allocated, handed out in order
//! ([`AllocCursor`]).

use crate::error::Result;
use crate::format::{ClusterMapping, L2Entry, SubclusterBitmap};
use crate::image::owner::alloc::Allocation;
use crate::image::Qcow2;
use crate::io::BlockDevice;
use crate::types::{ClusterSpan, Geometry, GuestOffset, HostOffset};
use smallvec::SmallVec;

/// What a write does to one guest cluster. `host` is always where the cluster starts on
/// the device; `entry` and `bitmap` are its L2 words as the plan found them.
#[derive(Debug, Clone, Copy)]
pub(super) enum Action {
    /// Data goes to `host`, no metadata change.
    InPlace { host: HostOffset },
    /// Extended L2, cluster allocated and COPIED: data to `host`, then the bitmap changes.
    SubclusterInPlace {
        host: HostOffset,
        entry: L2Entry,
        bitmap: SubclusterBitmap,
    },
    /// A preallocated zero cluster (COPIED): rewrite the whole cluster, clear the zero flag.
    Rewrite { host: HostOffset, entry: L2Entry },
    /// Needs a new cluster; `old` is what it replaces (freed after commit when shared).
    Alloc {
        bitmap: SubclusterBitmap,
        old: ClusterMapping,
    },
}

impl Action {
    /// A cluster a first write takes with its group (`OpenOptions::alloc_granule`) but does
    /// not write: unallocated, reading zeros, as its fresh new cluster does.
    pub(super) const UNWRITTEN: Action = Action::Alloc {
        bitmap: SubclusterBitmap::NONE,
        old: ClusterMapping::Unallocated { host: None },
    };
}

/// One guest cluster of a write.
#[derive(Debug, Clone, Copy)]
pub(super) struct Part {
    /// The guest offset where the cluster starts.
    pub(super) cluster: GuestOffset,
    /// The guest's bytes within the cluster; what the plan writes around them is COW data
    /// ([`Chain::part_range`]).
    pub(super) written: ClusterSpan,
    /// What the write does to the cluster.
    pub(super) action: Action,
}

impl Part {
    /// The part of guest bytes `[pos, end)`, which lie in the cluster starting at `cluster`.
    #[inline(always)]
    pub(super) fn new(cluster: u64, pos: u64, end: u64, action: Action) -> Part {
        let cluster = GuestOffset(cluster);
        Part {
            cluster,
            written: ClusterSpan::of_guest(cluster, GuestOffset(pos), GuestOffset(end)),
            action,
        }
    }

    /// The guest offset of byte `at` of the cluster.
    #[inline(always)]
    pub(super) fn guest(&self, at: u64) -> GuestOffset {
        self.cluster.plus(at)
    }

    /// The L2 words (entry, bitmap) this part of a finished plan leaves, `None` when they
    /// stay as they are. An allocating part takes the next cluster of `allocs`.
    pub(super) fn new_words(
        &self,
        geo: &Geometry,
        allocs: &mut AllocCursor<'_>,
    ) -> Option<(L2Entry, SubclusterBitmap)> {
        let sc = geo.subcluster_size();
        let touched = || self.written.unit_mask(sc);
        match self.action {
            Action::InPlace { .. } => None,
            Action::Rewrite { host, entry } => {
                Some((entry.written_at(host), SubclusterBitmap::NONE))
            }
            Action::SubclusterInPlace { entry, bitmap, .. } => {
                let t = touched();
                let nb = SubclusterBitmap::new(bitmap.alloc_mask() | t, bitmap.zero_mask() & !t);
                (nb != bitmap).then_some((entry, nb))
            }
            Action::Alloc { bitmap, old } => {
                let h = allocs.next_cluster(geo).host;
                let nb = if geo.extended_l2() {
                    // A copied shared cluster keeps its allocated subclusters; a compressed
                    // one is copied whole, every subcluster allocated (as QEMU).
                    let old_alloc = match old {
                        ClusterMapping::Data { .. } => bitmap.alloc_mask(),
                        ClusterMapping::Compressed(_) => u32::MAX,
                        _ => 0,
                    };
                    let t = touched();
                    SubclusterBitmap::new(old_alloc | t, bitmap.zero_mask() & !t)
                } else {
                    SubclusterBitmap::NONE
                };
                Some((L2Entry::copied_data(h), nb))
            }
        }
    }
}

/// The parts of a plan, and its allocated runs of host clusters: inline for requests of up
/// to two clusters, so the common write allocates nothing for them.
pub(super) type Parts = SmallVec<[Part; 2]>;

pub(super) type Allocs = SmallVec<[Allocation; 2]>;

/// The host clusters of a plan's allocations, handed out in order to its allocating parts
/// (the `i`-th allocating part takes the `i`-th cluster of the runs).
pub(super) struct AllocCursor<'a> {
    allocs: &'a [Allocation],
    taken: u64,
}

/// A host cluster a plan allocated for one of its parts ([`AllocCursor::next_cluster`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct NewCluster {
    /// Where the cluster starts on the device.
    pub(super) host: HostOffset,
    /// Never written since open: it reads as zeros.
    pub(super) fresh: bool,
}

impl<'a> AllocCursor<'a> {
    /// A cursor at the first cluster of `allocs`.
    pub(super) fn new(allocs: &'a [Allocation]) -> Self {
        AllocCursor { allocs, taken: 0 }
    }

    /// The host cluster of the next allocating part (host offset 0, not fresh, past the
    /// last one allocated, which a plan never asks for).
    pub(super) fn next_cluster(&mut self, geo: &Geometry) -> NewCluster {
        let mut i = self.taken;
        self.taken += 1;
        for a in self.allocs {
            if i < a.count {
                return NewCluster {
                    host: geo.host_cluster_offset(a.nth(i)),
                    fresh: a.fresh,
                };
            }
            i -= a.count;
        }
        NewCluster {
            host: HostOffset(0),
            fresh: false,
        }
    }
}

/// What a write does to a guest cluster whose L2 words are `(entry, bitmap)` (see
/// [`Action`]); an invalid entry is corruption.
pub(super) fn action_for<D: BlockDevice>(
    q: &Qcow2<D>,
    entry: L2Entry,
    bitmap: SubclusterBitmap,
) -> Result<Action> {
    let geo = q.geometry();
    let ctx = q.l2_context();
    Ok(if geo.extended_l2() {
        // Validate (reserved bits, bitmap consistency) through the mapping decoder.
        if let old @ ClusterMapping::Compressed(_) = entry.subcluster_mapping(bitmap, 0, &ctx)? {
            // Copied whole into a new cluster ([`Part::new_words`]).
            return Ok(Action::Alloc { bitmap, old });
        }
        let host = entry.host_bits();
        if host != 0 && entry.is_copied() {
            Action::SubclusterInPlace {
                host: HostOffset(host),
                entry,
                bitmap,
            }
        } else {
            let old = if host != 0 {
                ClusterMapping::Data {
                    host: HostOffset(host),
                    copied: false,
                }
            } else {
                ClusterMapping::Unallocated { host: None }
            };
            Action::Alloc { bitmap, old }
        }
    } else {
        match entry.mapping(&ctx)? {
            ClusterMapping::Data { host, copied: true } => Action::InPlace { host },
            ClusterMapping::Zero { host: Some(h) } if entry.is_copied() => {
                Action::Rewrite { host: h, entry }
            }
            old => Action::Alloc { bitmap, old },
        }
    })
}
