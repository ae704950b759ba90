//! First writes whose data a core replica writes itself (#48). The owner plans a core's
//! first write on the spot ([`Chain::plan_now`]: clusters taken, refcounts raised in the
//! dirty metadata, the clusters marked in flight) and, when the write's data is the guest's
//! alone on consecutive host bytes, hands the core that host offset instead of taking the
//! data: the core writes it through its own channel, then hands the ticket back, and the
//! owner commits the L2 entries only then. So a core's first writes cost the owner's
//! device nothing, and the order of §7 holds as when the owner writes the data itself:
//!
//! - refcounts before L2: raised at the plan, written back (phase 1) before any slice;
//! - data before L2: the entries are committed after the core's write completed, so the
//!   write-back's phase-1 flush that precedes their slice covers the data;
//! - nobody reads the new cluster early: until the commit the owner's slice (and so every
//!   core's copy) still shows the old entry, and the clusters in flight make other writers
//!   of them wait (`lock_clusters`), discard and write-zeroes included;
//! - a failed data write frees the clusters (`finish_chunk`), as the owner's own would.
//!
//! A crash between the core's data write and the commit leaks the clusters taken, as a
//! crash between the owner's data write and its commit does. The protocol is three calls
//! a host wires to its messages: [`Chain::reserve_write`] (owner), [`Chain::write_reserved`]
//! (core), [`Chain::commit_reserved`] or [`Chain::run_reserved`] (owner).
//!
//! A write the core sent while the owner held its slice dirty may be an overwrite by the
//! time the owner looks (another first write took the cluster): the owner answers where
//! it lies ([`Reserved::InPlace`]) and the core writes it there and completes, as an
//! overwrite through its own copy would. The core entered the grace period before it sent
//! the request (§6), so a cluster the owner frees after answering is not reused before the
//! core's write completed.

use super::parts::{AllocCursor, Allocs, Parts};
use super::tickets::Plan;
pub use super::tickets::Ticket;
use super::top;
use crate::chain::{Chain, Layer};
use crate::error::Result;
use crate::exec::GraceEntry;
use crate::image::owner::Owner;
use crate::io::{BlockDevice, BufSlice, DeviceOp};
use crate::types::{GuestOffset, HostOffset};
use std::rc::Rc;

/// The owner's answer to a core's first write ([`Chain::reserve_write`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Reserved {
    /// An overwrite: the core writes the request's bytes at `host` with
    /// [`Chain::write_reserved`] and completes it; nothing goes back to the owner.
    InPlace {
        /// Where the request's first byte lies on the image's data device.
        host: HostOffset,
    },
    /// The core writes the request's bytes at `host` with [`Chain::write_reserved`], then
    /// hands the ticket back with the result ([`Chain::commit_reserved`]).
    Write {
        /// The owner's handle.
        ticket: Ticket,
        /// Where the request's first byte goes on the image's data device.
        host: HostOffset,
    },
    /// Planned, but the data needs more than the guest's bytes (COW around them, zeros to
    /// write): the host sends the data, and the owner runs the plan
    /// ([`Chain::run_reserved`]).
    Data(Ticket),
    /// Not planned (metadata to load first, an allocation in flight on the clusters, the
    /// lock taken, an overwrite by now, an error to report): the host sends the request
    /// with its data as any other.
    Send,
}

impl<D: BlockDevice> Chain<D> {
    /// Owner: plans a core's write of `len` bytes at `offset` that the core's plan sent
    /// here ([`Step::Owner`](crate::Step::Owner) with [`Op::Write`](crate::Op::Write) or
    /// [`Op::WriteNotInPlace`](crate::Op::WriteNotInPlace)), without its data; the core
    /// entered the grace period before sending it and stays in it until its write
    /// completes. See [`Reserved`] for what the host does with the answer. Changes nothing
    /// when it answers [`Reserved::Send`] or [`Reserved::InPlace`].
    pub fn reserve_write(&self, offset: u64, len: u64) -> Reserved {
        let Ok(q) = top(self) else {
            return Reserved::Send;
        };
        if len == 0 || self.disk.check_range(offset, len).is_err() {
            return Reserved::Send;
        }
        // In place by now: where the owner's own direct path would write it.
        if let crate::route::WriteDecision::Direct(grant) = self.decide_write(offset, len) {
            let (dev, host) = (grant.dev(), grant.host());
            grant.finish(self.exec());
            if dev == q.data_dev() {
                return Reserved::InPlace { host };
            }
            return Reserved::Send;
        }
        self.disk.note_change(offset, len);
        let entry = self.guest_enter();
        let (parts, allocs) = match self.plan_now(q, offset, offset + len) {
            Ok(Some(planned)) => planned,
            Ok(None) | Err(_) => {
                self.exec().guest_exit(entry);
                return Reserved::Send;
            }
        };
        let host = q.owner().ok().and_then(|o| {
            let run = self.guest_only_run(&o, &parts, &allocs);
            if run.is_some() {
                o.meta().st_mut().stats.first_writes_by_cores += 1;
            }
            run
        });
        let plan = Plan {
            entry,
            start: GuestOffset(offset),
            parts,
            allocs,
        };
        let ticket = self.reservations.insert(plan);
        match host {
            Some(host) => Reserved::Write { ticket, host },
            None => Reserved::Data(ticket),
        }
    }

    /// Core: writes `buf` at `host` (from [`Reserved::Write`] or [`Reserved::InPlace`]) on
    /// this core's data device, in the grace period `entry` entered before the request
    /// went to the owner; the executor reports `tag`'s outcome when the write completed.
    /// After a [`Reserved::Write`] the host then hands the ticket back to the owner with
    /// that result; after a [`Reserved::InPlace`] the request is complete.
    pub fn write_reserved(
        &self,
        tag: u64,
        host: HostOffset,
        buf: BufSlice<D::Buf>,
        entry: GraceEntry,
    ) {
        let exec = self.exec();
        let dev = match &self.layers()[0] {
            Layer::Qcow2(q) => q.data_dev(),
            Layer::Raw { .. } => {
                let e = crate::Error::InvalidRequest("a reserved write on a raw layer");
                return exec.complete_entered(tag, Err(e), entry);
            }
        };
        let op = DeviceOp::Write {
            offset: host.0,
            buf,
        };
        exec.request_single(tag, entry, dev, op);
    }

    /// Core: the owner answered a write at guest `offset` in place ([`Reserved::InPlace`]):
    /// when this core holds no copy of its slice (the owner holds it dirty, so the write
    /// went there without one), loads the owner's copy in the background, so the next
    /// overwrites into the slice are decided here (through the copy, even once it is
    /// stale: §6's kept overwrites) instead of each costing a round trip. A failure is
    /// left to a request that needs the slice. Nothing on the owner.
    pub fn answered_in_place(self: &Rc<Self>, offset: u64) {
        let Some(q) = self.disk.top_qcow2() else {
            return;
        };
        if q.core_slice_state(GuestOffset(offset)) != Some(crate::image::CoreSlice::Dirty) {
            return;
        }
        let chain = self.clone();
        self.exec().spawn(async move {
            if let Some(q) = chain.disk.top_qcow2() {
                let _ = q.load_slice(GuestOffset(offset)).await;
            }
        });
    }

    /// Owner: the core's data write of `ticket` ended with `written`: commits the plan's
    /// L2 entries (or, on an error, frees its clusters) and reports `tag` with the result.
    pub fn commit_reserved(self: &Rc<Self>, ticket: Ticket, tag: u64, written: Result<()>) {
        let Some(plan) = self.reservations.take(ticket) else {
            let e = crate::Error::InvalidRequest("no such reservation");
            return self.exec().complete(tag, Err(e));
        };
        let chain = self.clone();
        self.exec().spawn(async move {
            let Plan {
                entry,
                parts,
                allocs,
                ..
            } = plan;
            let r = match top(&chain).and_then(|q| q.owner()) {
                Ok(o) => chain.finish_chunk(&o, &parts, &allocs, written).await,
                Err(e) => Err(e),
            };
            chain.exec().complete_entered(tag, r, entry);
        });
    }

    /// Owner: runs the plan of `ticket` ([`Reserved::Data`]) with the request's data `buf`,
    /// as a write planned on the spot; reports `tag`.
    pub fn run_reserved(self: &Rc<Self>, ticket: Ticket, tag: u64, buf: BufSlice<D::Buf>) {
        let Some(plan) = self.reservations.take(ticket) else {
            let e = crate::Error::InvalidRequest("no such reservation");
            return self.exec().complete(tag, Err(e));
        };
        let Plan {
            entry,
            start,
            parts,
            allocs,
        } = plan;
        let fut = self
            .clone()
            .planned_task(tag, entry, start, (parts, allocs), buf);
        self.exec().spawn(fut);
    }

    /// Plans held for cores (their clusters in flight until handed back).
    pub fn reservations_held(&self) -> usize {
        self.reservations.len()
    }

    /// Where a plan's data goes when it is the guest's bytes alone, on consecutive host
    /// bytes (new clusters that read zeros around them, whole clusters, subclusters
    /// written whole): the host offset of the first byte. `None` when the plan needs COW
    /// or zeros written ([`write_data`](Self::write_data)).
    pub(super) fn guest_only_run(
        &self,
        q: &Owner<'_, D>,
        parts: &Parts,
        allocs: &Allocs,
    ) -> Option<HostOffset> {
        let mut cursor = AllocCursor::new(allocs);
        let mut start = None;
        let mut next: Option<HostOffset> = None;
        for p in parts {
            let (h, span) = self.part_range(q, p, &mut cursor);
            if span.is_empty() {
                // A cluster of the group that this write leaves alone.
                continue;
            }
            let at = h.plus(span.start());
            if span != p.written || next.is_some_and(|n| n != at) {
                return None;
            }
            start.get_or_insert(at);
            next = Some(at.plus(span.len()));
        }
        start
    }
}
