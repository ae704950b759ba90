//! Core replicas of a shared image (ARCHITECTURE.md §6): sharing an image
//! ([`Qcow2::share`]), seeding and building a core's replica, the owner's answers to a
//! core's slice requests, and the [`Replica`] view with the seqlock miss path and the
//! overwrites a core keeps through an older copy of a slice.

use super::role::ImageRole;
use super::{
    be_words, CoreSeed, CoreSide, CoreSlice, KeptCopy, OpenOptions, OwnerLink, Qcow2, Replica,
};
use crate::coherency::{Shared, SliceReply, SliceStamp};
use crate::error::{Error, Result};
use crate::exec::{DevId, Exec, JoinRefused, Joiner, WaitQueue};
use crate::format::{L2Context, L2Entry, SubclusterBitmap};
use crate::io::BlockDevice;
use crate::types::GuestOffset;
use std::cell::{Cell, RefCell};
use std::sync::Arc;

impl<D: BlockDevice> Qcow2<D> {
    /// A read-only replica of this image for another core: the header, L1 and refcount
    /// table validated here are copied (nothing is re-read), with empty caches sized by
    /// `opts`, doing I/O on `dev` (that core's channel to the same device) through `exec`.
    ///
    /// A replica must not be used while this image is open for writing: it does not see the
    /// owner's later metadata changes (per-core coherency is the epoch protocol's job).
    pub fn replica(&self, exec: &Exec<D>, dev: DevId, opts: OpenOptions) -> Result<Self> {
        Self::from_ro_seed(&self.ro_seed(), exec, dev, opts)
    }

    /// Publishes this image's metadata to other cores (ARCHITECTURE.md §6) and returns the shared
    /// state; later calls return the same. From now on every metadata change bumps the
    /// epochs the core replicas validate against. Call on the owner's core.
    pub fn share(&mut self) -> Arc<Shared> {
        if let Some(s) = self.shared() {
            return s.clone();
        }
        let cs = self.geo.cluster_size();
        let l1: Vec<u64> = self.l1.borrow().iter().map(|e| e.0).collect();
        let total_slices = (l1.len() as u64).max(1) * self.geo.slices_per_l2();
        // Metadata can grow to about the disk size plus its tables; the margin keeps
        // in-place writes local for every cluster a sane image will have.
        let max_clusters = self
            .device_size
            .get()
            .saturating_add(self.size())
            .saturating_add(self.size() / 8)
            .div_ceil(cs)
            .saturating_add(1024);
        let shared = Arc::new(Shared::new(
            total_slices,
            &l1,
            self.device_size.get(),
            max_clusters,
        ));
        // Every metadata cluster: header, tables, snapshot tables (as the owner's overlap
        // check knows them), refcount blocks and L2 tables.
        let bits = self.geo.cluster_bits;
        self.any_static_metadata(|off, len| {
            if len > 0 {
                for c in (off >> bits)..=((off + len - 1) >> bits) {
                    shared.set_meta_cluster(c);
                }
            }
            false
        });
        for c in self.table_clusters() {
            shared.set_meta_cluster(c);
        }
        if let Some(m) = self.meta_state() {
            let mut st = m.st_mut();
            for c in st.index.iter() {
                shared.set_meta_cluster(c);
            }
            st.dirty.publish_to(&shared);
        }
        // The owner's own requests take part in grace periods too (its fast paths race
        // with its own discards like a core's do).
        // The first member of a new image's grace periods: this fails only for an executor
        // that is already another shared image's, whose entries would not hold back this
        // image's frees (a host's bug, which must not become a silent reuse).
        assert_eq!(
            self.exec.join_grace(shared.clone(), Joiner::Owner),
            Ok(()),
            "the owner's executor already takes part in another image's grace periods"
        );
        shared.set_virtual_size(self.size());
        self.role.publish(shared.clone());
        // Its generation is `Shared`'s from now on: what was kept under the owner's own is
        // not comparable.
        *self.last_compressed.borrow_mut() = Default::default();
        shared
    }

    /// What another core needs to build its replica ([`from_seed`](Self::from_seed)).
    /// [`share`](Self::share) must have run.
    pub fn core_seed(&self) -> Result<CoreSeed> {
        let shared = self.shared().cloned().ok_or(Error::InvalidRequest(
            "image not shared: call share() first",
        ))?;
        Ok(CoreSeed {
            header: self.header.borrow().clone(),
            geo: self.geo,
            ctx: self.ctx.get(),
            snapshots: self.snapshots.borrow().clone(),
            shared,
            writable: self.is_writable(),
            dirty_bitmaps: self.dirty_bitmaps.clone(),
            luks: self.luks.clone(),
        })
    }

    /// A core's replica of a shared image: its own slice cache sized by `opts`, I/O on `dev`
    /// through `exec`, metadata validated against the owner's epochs, dirty slices fetched
    /// through `link`. It serves reads (every kind) and in-place writes to COPIED clusters
    /// on its own; every other write goes to the owner (see
    /// [`Chain::try_submit_write`](crate::Chain::try_submit_write)).
    pub fn from_seed(
        seed: CoreSeed,
        exec: &Exec<D>,
        dev: DevId,
        opts: OpenOptions,
        link: Box<dyn OwnerLink>,
    ) -> Result<Self> {
        match exec.join_grace(seed.shared.clone(), Joiner::Core) {
            Ok(()) => {}
            Err(JoinRefused::SlotsTaken) => {
                return Err(Error::InvalidRequest(
                    "this core cannot take part in the image's grace periods (256 cores at \
                     most)",
                ))
            }
            Err(JoinRefused::OtherImage) => {
                return Err(Error::InvalidRequest(
                    "this core's executor takes part in another image's grace periods (one \
                     shared image per executor)",
                ))
            }
        }
        // Sized by the table, not by the room the owner keeps for it to grow online.
        let l1_len = seed.header.header.l1_size as usize;
        let caches = Self::new_caches(&seed.geo, l1_len, 0, &opts)?;
        // One reading for both: the owner may have grown the device since the seed was
        // taken, and `sync_core` only looks for changes from `device_size`.
        let device_size = seed.shared.device_size();
        let data_dev = super::encryption::data_view(exec, dev, seed.luks.as_ref());
        Ok(Qcow2 {
            exec: exec.clone(),
            dev,
            data_dev,
            luks: seed.luks,
            decompressor: RefCell::default(),
            last_compressed: RefCell::default(),
            reuse_local: Cell::new(0),
            device_size: Cell::new(device_size),
            header: RefCell::new(seed.header),
            geo: seed.geo,
            ctx: Cell::new(L2Context {
                device_size,
                ..seed.ctx
            }),
            l1: RefCell::new(Vec::new()),
            refcount_table: RefCell::new(Vec::new()),
            snapshots: RefCell::new(seed.snapshots),
            memo: caches.memo,
            l2_cache: RefCell::new(caches.l2),
            rc_cache: RefCell::new(caches.rc),
            role: ImageRole::Replica(CoreSide {
                shared: seed.shared,
                link,
                tickets: RefCell::new(slab::Slab::new()),
                wait: WaitQueue::new(exec),
                writable: seed.writable,
            }),
            dirty_bitmaps: seed.dirty_bitmaps,
        })
    }

    /// Owner: the answer to a core's [`OwnerLink::ask_slice`] (no I/O, no await).
    pub fn slice_for_core(&self, key: u64) -> SliceReply {
        let Some(shared) = self.shared() else {
            return SliceReply::Retry;
        };
        if let Some(m) = self.meta_state() {
            if let Some(words) = m.dirty_slice(key) {
                return SliceReply::Copy {
                    words,
                    stamp: shared.stamp(key),
                };
            }
        }
        SliceReply::Clean {
            stamp: shared.stamp(key),
        }
    }

    /// Core replica: hands over the owner's answer to ticket `ticket` (on this core).
    /// Nothing on any other image.
    pub fn deliver_slice(&self, ticket: u64, reply: SliceReply) {
        if let Some(r) = self.replica_side() {
            r.deliver(ticket, reply);
        }
    }

    /// Core replica: takes the owner's latest device size (entries may point further).
    pub(super) fn sync_core(&self) {
        if let Some(s) = self.core_shared() {
            let ds = s.device_size();
            if ds != self.device_size.get() {
                self.device_size.set(ds);
                let mut ctx = self.ctx.get();
                ctx.device_size = ds;
                self.ctx.set(ctx);
            }
        }
    }

    /// The epoch a cached copy of slice `key` must carry to be used now (0 on the owner:
    /// its cache is kept in step with its own changes).
    pub(super) fn cur_epoch(&self, key: u64) -> u32 {
        match self.core_shared() {
            Some(s) => s.epoch(key),
            None => 0,
        }
    }

    /// On a core replica: whether the owner holds the slice covering `off` dirty (odd
    /// epoch), so a copy would come from the owner by message. False on the owner.
    pub fn slice_dirty_elsewhere(&self, off: GuestOffset) -> bool {
        self.is_core_replica() && self.cur_epoch(self.geo.slice_id(off)) & 1 == 1
    }

    /// On a writable core replica: the state of this core's copy of the slice covering
    /// `off` (see [`Chain::route_write`](crate::Chain::route_write)); `None`
    /// on the owner and on read-only replicas.
    pub fn core_slice_state(&self, off: GuestOffset) -> Option<CoreSlice> {
        let sh = self.writable_core_shared()?;
        let key = self.geo.slice_id(off);
        let now = sh.epoch(key);
        Some(match self.l2_cache.borrow().peek_epoch(key) {
            Some(e) if e == now => CoreSlice::Valid,
            Some(_) if now & 1 == 1 => CoreSlice::StaleDirty,
            None if now & 1 == 1 => CoreSlice::Dirty,
            _ => CoreSlice::Missing,
        })
    }

    /// On a writable core replica whose copy of the slice of `[off, off + len)` is older
    /// than the slot's epoch: whether the copy still answers an in-place overwrite
    /// (ARCHITECTURE.md §6). It does while the slot's count of removals is the one the copy
    /// was taken under: every change since only added mappings, so each cluster the copy
    /// shows as COPIED data still is, at the same host offset, and the copy grants no
    /// overwrite a current copy would refuse. The range lies in one slice, in one cluster
    /// unless the copy is linear; its clusters lie inside the device and are not metadata
    /// now (the bitmap as for any in-place write). Touches the LRU and counts a hit only
    /// for [`KeptCopy::Host`].
    pub(crate) fn kept_overwrite(&self, off: u64, len: u64) -> KeptCopy {
        let (Some(sh), Some((key, within))) =
            (self.writable_core_shared(), self.geo.in_one_slice(off, len))
        else {
            return KeptCopy::Unusable;
        };
        // After the request's grace-period entry, like every look-up.
        let now = sh.stamp(key);
        let Ok(mut cache) = self.l2_cache.try_borrow_mut() else {
            return KeptCopy::Unusable;
        };
        let Some((hit, epoch)) = cache.probe_any(key) else {
            return KeptCopy::Unusable;
        };
        let summary = cache.aux(hit.way);
        if summary.removals != now.removals() {
            return KeptCopy::Unusable;
        }
        let not_in_place = KeptCopy::NotInPlace {
            changes: now.epoch().wrapping_sub(epoch) / 2,
        };
        let ctx = self.ctx.get();
        let cs = 1u64 << ctx.cluster_bits;
        let host = match summary.linear.host(0, ctx.cluster_bits) {
            Some(first) => first + within,
            None => {
                let in_cluster = off & (cs - 1);
                if in_cluster + len > cs {
                    return not_in_place;
                }
                let i = self.geo.index_in_slice(GuestOffset(off)) as usize;
                let block = cache.block(hit.way);
                let entry = if self.geo.extended_l2() {
                    let sc = self.geo.subcluster_size();
                    match (block.get(2 * i), block.get(2 * i + 1)) {
                        (Some(&e), Some(&bitmap))
                            if SubclusterBitmap(bitmap)
                                .all_data(in_cluster / sc, (in_cluster + len - 1) / sc) =>
                        {
                            L2Entry(e)
                        }
                        _ => return not_in_place,
                    }
                } else {
                    match block.get(i) {
                        Some(&e) => L2Entry(e),
                        None => return not_in_place,
                    }
                };
                match entry.plain_data(ctx.cluster_bits, ctx.device_size) {
                    Some((h, true)) => h + in_cluster,
                    _ => return not_in_place,
                }
            }
        };
        let bits = ctx.cluster_bits;
        if (host + len).next_multiple_of(cs) > ctx.device_size
            || ((host >> bits)..=((host + len - 1) >> bits)).any(|c| sh.is_meta_cluster(c))
        {
            return not_in_place;
        }
        // Later overwrites through this copy find it in the memo, under the same count of
        // removals (`memo_overwrite`), in a few compares.
        let stamp = SliceStamp::of(epoch, summary.removals);
        let coverage = self.geo.slice_coverage();
        match summary.linear.host(0, bits) {
            Some(first)
                if first
                    .checked_add(coverage)
                    .is_some_and(|e| e <= ctx.device_size) =>
            {
                let meta_gen = self.slice_clear_of_metadata(first, coverage);
                self.memo.remember(key, first, stamp, meta_gen);
            }
            None if !self.geo.extended_l2() => {
                let meta_gen = sh.meta_gen();
                self.refresh_mapped(key, stamp, meta_gen, cache.block(hit.way));
            }
            _ => {}
        }
        cache.touch_fresh(hit);
        KeptCopy::Host(host)
    }
}

impl<D: BlockDevice> Replica<'_, D> {
    /// Hands over the owner's answer to ticket `ticket` and wakes the waiting tasks.
    pub(super) fn deliver(&self, ticket: u64, reply: SliceReply) {
        if let Some(slot) = self.side.tickets.borrow_mut().get_mut(ticket as usize) {
            *slot = Some(reply);
        }
        self.side.wait.notify_all();
    }

    /// Asks the owner for slice `key` and waits for its answer.
    pub(super) async fn ask_owner(&self, key: u64) -> SliceReply {
        let side = self.side;
        let t = side.tickets.borrow_mut().insert(None);
        side.link.ask_slice(key, t as u64);
        loop {
            let got = side.tickets.borrow_mut().get_mut(t).and_then(Option::take);
            if let Some(r) = got {
                side.tickets.borrow_mut().remove(t);
                return r;
            }
            side.wait.wait().await;
        }
    }

    /// A core replica's miss (ARCHITECTURE.md §6): with an even epoch, read the slice from the
    /// device and keep it only if the epoch did not move meanwhile (seqlock); with an odd
    /// one, ask the owner for its copy.
    pub(super) async fn load_slice(&self, off: GuestOffset) -> Result<Option<usize>> {
        let (q, shared) = (self.q, &*self.side.shared);
        let key = q.geo.slice_id(off);
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            if attempts > 1000 {
                // EAGAIN: the slice kept changing under 1000 reads (the owner rewrites it
                // faster than this core can read it); the guest may retry.
                return Err(Error::Io(11));
            }
            let mut stamp = shared.stamp(key);
            if let Some(w) = q.l2_cache.borrow_mut().lookup(key, stamp.epoch()) {
                return Ok(Some(w));
            }
            if stamp.epoch() & 1 == 1 {
                match self.ask_owner(key).await {
                    SliceReply::Copy { words, stamp } => {
                        q.sync_core();
                        let w = q.cache_slice_carrying(key, stamp, words.iter().copied());
                        // Taken after this request began: valid for it whatever the epoch
                        // is now; the cache keeps it only while the epoch stays.
                        return Ok(Some(w));
                    }
                    SliceReply::Clean { stamp: s } => stamp = s,
                    SliceReply::Retry => continue,
                }
            }
            // The L1 entry is read after the epoch: a new table's slices are odd before
            // the owner publishes the entry that points at it.
            let Some(l2) = q.l2_table(off)? else {
                return Ok(None);
            };
            let raw = q.read_slice_raw(l2, off).await?;
            // An unchanged epoch means no removal either (a removal moves both).
            if shared.epoch(key) != stamp.epoch() {
                continue;
            }
            // Entries of the slice may point where the owner grew the device before it
            // wrote them.
            q.sync_core();
            return Ok(Some(q.cache_slice_carrying(key, stamp, be_words(&raw))));
        }
    }
}
