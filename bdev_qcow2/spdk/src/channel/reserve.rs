//! A core replica's side of its first writes (`reservation.rs`): the channel sends the
//! write to the owner for a reservation, writes the data where the owner answers through
//! its own base channel, and hands the ticket back for the owner to commit. So the md
//! thread plans and commits first writes but writes none of the data a core can write,
//! and a channel runs the engine's answer as our reactor does (`tool/src/reactor.rs`).

use super::Channel;
use crate::ffi::thread::Thread;
use crate::reservation::{CoreWrite, DataWrite, Reservation};
use crate::types::BdevIo;
use qcow2_engine::exec::Outcome;
use qcow2_engine::types::HostOffset;
use qcow2_engine::{GraceEntry, Op};

/// Who writes the data of a channel's first writes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum FirstWrites {
    /// The owner, with the whole request: a channel on the md thread's core (a round trip
    /// for the reservation would buy no parallelism there), or one without a replica.
    Owner,
    /// This channel, where the owner reserved (the protocol below).
    Core,
}

impl Channel {
    /// A write the replica's plan gave the owner ([`Step::Owner`](qcow2_engine::Step)
    /// with `op`): sent to `md` for the owner to reserve its clusters, with this core in
    /// its grace period until the data is written (no cluster the owner frees meanwhile is
    /// reused under it).
    pub(super) fn reserve(&self, md: Thread, mut io: BdevIo, op: Op) {
        let entry = self.exec().guest_enter();
        io.ctx_mut().set_reservation(Reservation::Ask(entry));
        self.forward(md, io, op);
    }

    /// A first write back from the owner (`complete_forwarded`): with its answer, the
    /// channel writes the data; run by the owner, it ends its grace period and completes.
    pub(super) fn reservation_back(&self, mut io: BdevIo) {
        match io.ctx_mut().take_reservation() {
            // An overwrite by now: complete once written, as one on this core.
            // The owner holds the slice dirty: its copy is loaded here for the next ones.
            Reservation::Answer(CoreWrite::InPlace(host), entry) => {
                let offset = io.extent().0;
                self.write_reserved(io, host, entry);
                if let Some(chain) = self.chain.get() {
                    chain.answered_in_place(offset);
                }
            }
            Reservation::Answer(CoreWrite::Write(ticket, host), entry) => {
                io.ctx_mut().set_reservation(Reservation::Writing(ticket));
                self.write_reserved(io, host, entry)
            }
            Reservation::Release(entry) => {
                self.exec().guest_exit(entry);
                let status = io.ctx().status();
                self.finish_status(io, status)
            }
            // Nothing else comes back (the owner finishes what it committed).
            _ => self.reservation_failed(io),
        }
    }

    /// Writes request `io`'s data at `host` through this channel's base (one device
    /// operation, not a task); `Host::request_done` hears of it.
    fn write_reserved(&self, io: BdevIo, host: HostOffset, entry: GraceEntry) {
        let Some(chain) = self.chain.get() else {
            // (A channel reserves only through its replica's plan.) Its ticket goes back.
            self.exec().guest_exit(entry);
            let e = qcow2_engine::Error::InvalidRequest("a reserved write without a replica");
            return self.reserved_written(io, Outcome::Done(Err(e)));
        };
        self.driver
            .submit_grant(io, |tag, buf| chain.write_reserved(tag, host, buf, entry));
    }

    /// The data write of a reservation (`Reservation::Writing`) ended with `outcome`: its
    /// ticket goes back to the owner, which commits it (or frees its clusters) and
    /// completes the request.
    pub(super) fn reserved_written(&self, mut io: BdevIo, outcome: Outcome) {
        let written = match outcome {
            Outcome::Done(Ok(())) => DataWrite::Done,
            Outcome::Done(Err(e)) => {
                tracing::debug!("a first write's data failed: {e}");
                DataWrite::Failed(e.errno())
            }
            Outcome::ToOwner => DataWrite::Failed(libc::EIO),
        };
        match (io.ctx_mut().take_reservation(), self.forward_to) {
            (Reservation::Writing(ticket), Some(md)) => {
                io.ctx_mut()
                    .set_reservation(Reservation::Written(ticket, written));
                self.forward(md, io, Op::Write)
            }
            // An overwrite (`Reserved::InPlace`) whose write could not start.
            _ => self.reservation_failed(io),
        }
    }

    /// A first write out of its protocol's order (a bug, not an input): failed.
    #[cold]
    fn reservation_failed(&self, io: BdevIo) {
        tracing::error!("a first write out of the reservation protocol's order");
        self.finish(io, false)
    }
}
