//! The guest write path: in-place writes, allocating writes as two-phase plans (plan under
//! the metadata lock → data I/O without it → commit or abort under the lock), write-zeroes,
//! discard and flush.
//!
//! Allocating writes merge the COW head and tail with the guest data into one device write,
//! and skip COW areas that read as zero when the new cluster was never written (it reads
//! zero already). With extended L2 only the touched subclusters are written. Writers of a
//! guest cluster with an allocation in flight wait for it to commit, so overlapping
//! allocations are ordered.
//!
//! One concern per child module: `in_place` (the one-extent check and the fast path),
//! `now` (a plan made on the spot), `chunk` (the two-phase plan), `parts` (what a plan is
//! made of), `data` (its device writes, COW merged in), `commit`, `reserve` (a core's first write whose
//! data the core writes), `zero` (write-zeroes and discard), `background` (the owner's quiet write-back).

use crate::chain::{Chain, Layer};
use crate::error::{Error, Result};
use crate::image::Qcow2;
use crate::io::{BlockDevice, BufSlice};
use crate::types::GuestOffset;
use std::rc::Rc;

mod background;
mod chunk;
mod commit;
mod data;
mod in_place;
mod now;
mod parts;
mod reserve;
pub(crate) mod tickets;
mod zero;

pub(crate) use in_place::WriteExtent;
pub use reserve::{Reserved, Ticket};

/// The chain's top image when it is a writable qcow2 image; [`Error::ReadOnly`] otherwise.
fn top<D: BlockDevice>(chain: &Chain<D>) -> Result<&Qcow2<D>> {
    match &chain.layers()[0] {
        Layer::Qcow2(q) if q.is_writable() => Ok(q),
        _ => Err(Error::ReadOnly),
    }
}

impl<D: BlockDevice> Chain<D> {
    /// Starts a guest write; completion is reported with `tag` by [`crate::Exec::poll`].
    /// A write into allocated clusters whose refcount is 1, with their L2 slice cached, is
    /// submitted directly (no task, no metadata); anything else runs as a slow-path task.
    pub(crate) fn submit_write(self: &Rc<Self>, tag: u64, offset: u64, buf: BufSlice<D::Buf>) {
        self.start_write(tag, offset, buf, true);
    }

    /// [`submit_write`](Self::submit_write) for a write known not in place: a core replica
    /// routed it here as [`WriteRoute::Owner`](crate::route::WriteRoute::Owner)
    /// `{ slow: true }`, or this chain's own route found it so. Runs the slow path without
    /// planning a fast-path write first (it would not find one; the slow path handles it
    /// if it could).
    pub(crate) fn submit_write_slow(self: &Rc<Self>, tag: u64, offset: u64, buf: BufSlice<D::Buf>) {
        self.start_write(tag, offset, buf, false);
    }

    fn start_write(self: &Rc<Self>, tag: u64, offset: u64, buf: BufSlice<D::Buf>, fast: bool) {
        if let Err(e) = top(self).and_then(|_| self.disk.check_range(offset, buf.len as u64)) {
            return self.exec().complete(tag, Err(e));
        }
        self.disk.note_change(offset, buf.len as u64);
        let mut entry = self.guest_enter();
        if fast {
            match self.try_fast_write(tag, offset, &buf, entry) {
                Ok(()) => return,
                Err(back) => entry = back,
            }
        }
        let chain = self.clone();
        if let Ok(q) = top(self) {
            match self.plan_now(q, offset, offset + buf.len as u64) {
                Ok(Some(planned)) => {
                    let fut = chain.planned_task(tag, entry, GuestOffset(offset), planned, buf);
                    return self.exec().spawn(fut);
                }
                Ok(None) => {}
                Err(e) => return self.exec().complete_entered(tag, Err(e), entry),
            }
        }
        self.exec().spawn(async move {
            let r = chain.write(offset, buf).await;
            chain.exec().complete_entered(tag, r, entry);
        });
    }

    /// Starts a write-zeroes (`unmap`: the clusters may be deallocated).
    pub(crate) fn submit_write_zeroes(
        self: &Rc<Self>,
        tag: u64,
        offset: u64,
        len: u64,
        unmap: bool,
    ) {
        let chain = self.clone();
        self.exec().spawn(async move {
            let r = chain.write_zeroes(offset, len, unmap).await;
            chain.exec().complete(tag, r);
        });
    }

    /// Starts a discard.
    pub(crate) fn submit_discard(self: &Rc<Self>, tag: u64, offset: u64, len: u64) {
        let chain = self.clone();
        self.exec().spawn(async move {
            let r = chain.discard(offset, len).await;
            chain.exec().complete(tag, r);
        });
    }

    /// Starts a guest flush.
    pub(crate) fn submit_flush(self: &Rc<Self>, tag: u64) {
        let chain = self.clone();
        self.exec().spawn(async move {
            let r = chain.flush().await;
            chain.exec().complete(tag, r);
        });
    }

    /// On a core replica of a shared image ([`Qcow2::from_seed`]): runs the write here when
    /// it is an in-place write (the fast path, or after loading the slices it needs into
    /// this core's cache). Otherwise the request ends as
    /// [`Outcome::ToOwner`](crate::exec::Outcome::ToOwner), having changed nothing: the
    /// host then sends it to the metadata owner.
    pub(crate) fn submit_write_local(
        self: &Rc<Self>,
        tag: u64,
        offset: u64,
        buf: BufSlice<D::Buf>,
    ) {
        if let Err(e) = self.disk.check_range(offset, buf.len as u64) {
            return self.exec().complete(tag, Err(e));
        }
        self.disk.note_change(offset, buf.len as u64);
        let entry = match self.try_fast_write(tag, offset, &buf, self.guest_enter()) {
            Ok(()) => return self.counters.wrote_here(),
            Err(entry) => entry,
        };
        let chain = self.clone();
        self.exec().spawn(async move {
            let exec = chain.exec();
            if let Layer::Qcow2(q) = &chain.layers()[0] {
                let cov = q.geometry().slice_coverage();
                let end = offset + buf.len as u64;
                let mut pos = offset;
                while pos < end {
                    match q.load_slice(GuestOffset(pos)).await {
                        Ok(Some(_)) => {}
                        // No L2 table: an allocation, for the owner.
                        Ok(None) => {
                            chain.counters.sent_to_owner();
                            return exec.hand_to_owner(tag, entry);
                        }
                        Err(e) => return exec.complete_entered(tag, Err(e), entry),
                    }
                    pos = (pos / cov + 1) * cov;
                }
            }
            match chain.try_fast_write(tag, offset, &buf, entry) {
                Ok(()) => chain.counters.wrote_here(),
                Err(entry) => {
                    chain.counters.sent_to_owner();
                    exec.hand_to_owner(tag, entry);
                }
            }
        });
    }

    /// On a core replica of a shared image ([`Qcow2::from_seed`]): starts the write here if
    /// it is an in-place write (fast path) and returns true; returns false, having changed
    /// nothing, when the write must go to the metadata owner (allocation, COW, anything
    /// else), where the host sends it.
    pub fn try_submit_write(
        self: &Rc<Self>,
        tag: u64,
        offset: u64,
        buf: &BufSlice<D::Buf>,
    ) -> bool {
        if self.disk.check_range(offset, buf.len as u64).is_err() {
            return false;
        }
        self.disk.note_change(offset, buf.len as u64);
        match self.try_fast_write(tag, offset, buf, self.guest_enter()) {
            Ok(()) => true,
            Err(entry) => {
                self.exec().guest_exit(entry);
                false
            }
        }
    }

    /// Writes `buf` at `offset` and waits for it (acknowledged, not yet durable: see
    /// [`flush`](Self::flush)).
    pub async fn write(self: &Rc<Self>, offset: u64, buf: BufSlice<D::Buf>) -> Result<()> {
        let q = top(self)?;
        self.disk.check_range(offset, buf.len as u64)?;
        self.disk.note_change(offset, buf.len as u64);
        let end = offset + buf.len as u64;
        let cov = q.geometry().slice_coverage();
        let mut pos = offset;
        while pos < end {
            let chunk_end = end.min((pos / cov + 1) * cov);
            let sub = buf.sub((pos - offset) as usize, (chunk_end - pos) as usize);
            self.write_chunk(q, pos, chunk_end, Some(sub)).await?;
            pos = chunk_end;
        }
        Ok(())
    }

    /// Guest flush: all writes completed before it are durable when it returns.
    pub async fn flush(self: &Rc<Self>) -> Result<()> {
        top(self)?.flush().await
    }

    /// Flushes everything, refcounts included, and clears the dirty bit (lazy refcounts):
    /// call before dropping a writable chain.
    pub async fn close(self: &Rc<Self>) -> Result<()> {
        top(self)?.close().await
    }
}
