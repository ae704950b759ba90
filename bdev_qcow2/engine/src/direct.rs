//! The direct path: where a guest request goes, decided from this replica's cached
//! metadata by one call per direction ([`Chain::route_read`], [`Chain::route_write`]), and
//! the submission of a granted request through the executor.
//!
//! A route asks the memo of slices first (a few compares), then, past it, the
//! slice cache. The request enters its grace period once, before anything is resolved;
//! a [`Grant`] carries the entry to the host, every other answer has left it.

use crate::chain::{Chain, Layer};
use crate::exec::{DevId, GraceEntry};
use crate::format::ClusterMapping;
use crate::image::{CachedExtent, CoreSlice, KeptCopy, MemoFirst, Qcow2, Wanted};
use crate::io::BlockDevice;
use crate::route::{GuestRange, Role};
use crate::types::{GuestOffset, HostOffset};
use crate::write::WriteExtent;

/// What a route found past the memo; `route_read` / `route_write` make it their route.
/// Apart from the public routes so that a memo hit's grant, built inline, keeps to
/// registers instead of sharing the out-of-line call's return slot.
pub(crate) enum PastMemo {
    /// One extent of a device (the request stays entered: its grant is made from this).
    Direct(DevId, HostOffset, GraceEntry),
    /// The engine path (the request left the grace period).
    Engine,
    /// The metadata owner, as [`WriteRoute::Owner`] (the request left the grace period).
    Owner { slow: bool },
    /// The engine path of a chain that runs its own writes, known not in place, as
    /// [`WriteDecision::EngineNotInPlace`] (the request left the grace period).
    NotInPlace,
}

/// Changes of a dirty slot after which a core's copy of a slice that does not show an
/// overwrite in place is fetched again (the engine path asks the owner for a copy, then
/// writes in place if it can) instead of sending the write to the owner: while an image
/// fills, the copy falls behind one allocation per change, and a fresh copy lets later
/// overwrites of what was allocated since stay on the core. One message pair, a slice copy
/// and a task per this many changes, at most: at 16 they cost more than the overwrites
/// they kept (fresh 4 KiB-cluster fill, instructions per request +6 % against sending
/// every write to the owner; at 64, -6 %).
const REFRESH_AFTER_CHANGES: u32 = 64;

/// Where the slices of a write that is not one cached extent send it
/// ([`Chain::route_unplanned`]).
enum SliceRoute {
    /// Not a writable core replica (the owner, or an image of one core): walk the clusters.
    NotCore,
    /// Every slice current in this core's cache: walk the clusters; what is not in place
    /// is the owner's work.
    Current,
    /// To the owner, as [`WriteRoute::Owner`] `{ slow }`: a slice has no L2 table yet
    /// (`slow: true`), or changed since this core cached it and the owner holds it dirty
    /// (`slow: false`: it may well be in place by now; unless this core's older copy still
    /// answers, [`Qcow2::kept_overwrite`]).
    Owner { slow: bool },
    /// A slice is not cached here: this replica's engine path loads it.
    Load,
}

impl<D: BlockDevice> Chain<D> {
    /// [`route_read`](Self::route_read) past the memo, for a request entered with
    /// `entry`: the slice cache (out of line: the memo's path stays small).
    #[inline(never)]
    pub(crate) fn route_read_past_memo(&self, range: GuestRange, entry: GraceEntry) -> PastMemo {
        let (offset, len) = (range.offset().0, range.len());
        let mut found = match range.is_empty() {
            true => None,
            false => self.plan_direct_read(offset, len),
        };
        // (Only the owner caches from its dirty copy: a core replica, or a read-only
        // image's channel, reading through to a backing layer asks nothing more.)
        let owner = match self.layers().first() {
            Some(Layer::Qcow2(q)) if q.is_writable() => Some(q),
            _ => None,
        };
        if let (None, false, Some(q)) = (found, range.is_empty(), owner) {
            // The owner: a new table's slices are cached only once a request needs them.
            if q.cache_dirty_for_direct(GuestOffset(offset), false) {
                found = self.plan_direct_read(offset, len);
            }
        }
        match found {
            Some((dev, host)) => PastMemo::Direct(dev, HostOffset(host), entry),
            None => {
                self.exec().guest_exit(entry);
                PastMemo::Engine
            }
        }
    }

    /// [`route_write`](Self::route_write) past the memo of overwrites, for a request
    /// entered with `entry` (out of line: the memo's path stays small).
    #[inline(never)]
    pub(crate) fn route_write_past_memo(&self, range: GuestRange, entry: GraceEntry) -> PastMemo {
        if range.is_empty() {
            // The engine path completes it.
            self.exec().guest_exit(entry);
            return PastMemo::Engine;
        }
        // The memo of overwrites answers only on a writable core replica, which asked it;
        // elsewhere (the owner) the memo of slices still stands for the cache.
        let memo = match self.role {
            Role::Replica => MemoFirst::Skip,
            Role::Owner | Role::ReadOnly => MemoFirst::Ask,
        };
        let (offset, len) = (range.offset().0, range.len());
        match self.plan_write_extent_with(offset, len, memo) {
            WriteExtent::One(dev, host) => PastMemo::Direct(dev, host, entry),
            other => self.route_unplanned(range, entry, other),
        }
    }

    /// [`route_write`](Self::route_write) for a write that is not one cached extent
    /// (out of line: the in-place case stays small). On a core replica the state of the
    /// write's slices comes first: the cluster-by-cluster walk can only find an in-place
    /// plan where every slice is current here, and a write into a slice the owner is
    /// filling (the common case while an image fills) goes there without one.
    #[inline(never)]
    fn route_unplanned(&self, range: GuestRange, entry: GraceEntry, e: WriteExtent) -> PastMemo {
        let (offset, len) = (range.offset().0, range.len());
        let mut slices = self.slices_need_owner(offset, len);
        if let (SliceRoute::Owner { slow: false } | SliceRoute::Load, Some(Layer::Qcow2(q))) =
            (&slices, self.layers().first())
        {
            // This core's copy of the slice is older than the epoch (or not cached): it may
            // still answer an overwrite, since additions do not count as removals (§6).
            match q.kept_overwrite(offset, len) {
                KeptCopy::Host(h) => {
                    self.counters.kept_overwrite();
                    return PastMemo::Direct(q.data_dev(), HostOffset(h), entry);
                }
                KeptCopy::NotInPlace { changes } if changes >= REFRESH_AFTER_CHANGES => {
                    slices = SliceRoute::Load;
                }
                KeptCopy::NotInPlace { .. } | KeptCopy::Unusable => {}
            }
        }
        let current = match slices {
            SliceRoute::Owner { slow } => {
                self.exec().guest_exit(entry);
                return PastMemo::Owner { slow };
            }
            SliceRoute::Load => {
                self.exec().guest_exit(entry);
                return PastMemo::Engine;
            }
            SliceRoute::Current => true,
            SliceRoute::NotCore => false,
        };
        let mut planned = self.single_write_extent(offset, len, e);
        if let (None, false, Some(Layer::Qcow2(q))) = (&planned, current, self.layers().first()) {
            // The owner: a new table's slices are cached only once an overwrite needs them.
            if q.cache_dirty_for_direct(GuestOffset(offset), true) {
                planned = self.walk_single_write(offset, len);
            }
        }
        if let Some((dev, Some(host))) = planned {
            return PastMemo::Direct(dev, host, entry);
        }
        self.exec().guest_exit(entry);
        match planned {
            // Allocation, COW, zero clusters: the owner's work.
            None if current => PastMemo::Owner { slow: true },
            // This chain runs its own writes: its task need not plan this one again.
            None => PastMemo::NotInPlace,
            Some(_) => PastMemo::Engine,
        }
    }

    /// The slice half of [`route_write`](Self::route_write)'s owner test.
    fn slices_need_owner(&self, offset: u64, len: u64) -> SliceRoute {
        let Layer::Qcow2(q) = &self.layers()[0] else {
            return SliceRoute::NotCore;
        };
        let cov = q.geometry().slice_coverage();
        let end = offset.saturating_add(len).min(self.size());
        let mut pos = offset;
        let mut all_valid = true;
        while pos < end {
            match q.core_slice_state(GuestOffset(pos)) {
                None => return SliceRoute::NotCore,
                Some(CoreSlice::StaleDirty) => return SliceRoute::Owner { slow: false },
                // Asking for the owner's copy first would cost a round trip, and a 4 KiB
                // copy, before the write goes there all the same unless it is an
                // overwrite, which the owner answers in place (#48).
                Some(CoreSlice::Dirty) => return SliceRoute::Owner { slow: false },
                // No L2 table yet: only the owner can allocate one.
                Some(CoreSlice::Missing) if matches!(q.l2_table(GuestOffset(pos)), Ok(None)) => {
                    return SliceRoute::Owner { slow: true }
                }
                Some(CoreSlice::Missing) => all_valid = false,
                Some(CoreSlice::Valid) => {}
            }
            pos = (pos / cov + 1) * cov;
        }
        if all_valid {
            SliceRoute::Current
        } else {
            SliceRoute::Load
        }
    }

    /// One contiguous data extent for a read, from cached slices only (the caller asked
    /// the memo of slices already).
    #[inline(always)]
    fn plan_direct_read(&self, offset: u64, len: u64) -> Option<(DevId, u64)> {
        let q = match &self.layers()[0] {
            Layer::Raw { dev, .. } => return Some((*dev, offset)),
            Layer::Qcow2(q) => q,
        };
        if let CachedExtent::Host(h) =
            q.cached_extent_with(offset, len, Wanted::Data, MemoFirst::Skip)
        {
            return Some((q.data_dev(), h));
        }
        Self::walk_direct_read(q, offset, len)
    }

    /// [`plan_direct_read`](Self::plan_direct_read) for a range `cached_extent_with` does not
    /// answer: cluster by cluster, while the (sub)clusters follow each other on the device.
    #[inline(never)]
    fn walk_direct_read(q: &Qcow2<D>, offset: u64, len: u64) -> Option<(DevId, u64)> {
        let end = offset + len;
        let mut pos = offset;
        let mut start = None;
        let mut next_host = 0;
        while pos < end {
            let Ok(Some((ClusterMapping::Data { host, .. }, m_end))) =
                q.resolve_cached(GuestOffset(pos))
            else {
                return None;
            };
            // `host` is the start of the (sub)cluster holding `pos`.
            let h = host.0 + (pos & (q.geometry().subcluster_size() - 1));
            match start {
                None => start = Some(h),
                Some(_) if h == next_host => {}
                Some(_) => return None,
            }
            let n = m_end.min(end) - pos;
            next_host = h + n;
            pos += n;
        }
        start.map(|h| (q.data_dev(), h))
    }
}
