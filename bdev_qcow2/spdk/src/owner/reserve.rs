//! The owner's side of a core replica's first write (`reservation.rs`): it answers where
//! the core writes the data, or runs the write itself when the engine needs the data
//! (the bdev_io carries it: nothing to send back for), and commits what the core wrote.
//! The engine decides every step ([`Chain::reserve_write`], [`Chain::commit_reserved`],
//! [`Chain::run_reserved`]); this only carries the bdev_io.

use super::{done, Owner};
use crate::reservation::{CoreWrite, Reservation};
use crate::status::Status;
use crate::types::BdevIo;
#[cfg(doc)]
use qcow2_engine::Chain;
use qcow2_engine::Reserved;

impl Owner {
    /// Serves forwarded request `io`, a first write in the reservation protocol (its
    /// context says which step). On the md thread, inside the engine.
    pub(super) fn serve_reservation(&self, mut io: BdevIo) {
        let c = &self.chain;
        match io.ctx_mut().take_reservation() {
            Reservation::Ask(entry) => {
                let answer = c.reserve_write(io.offset_bytes(), io.len_bytes());
                match CoreWrite::of(answer) {
                    Ok(w) => {
                        io.ctx_mut().set_reservation(Reservation::Answer(w, entry));
                        done(io, Status::Success);
                    }
                    // Completed as any forwarded request, then the channel ends `entry`.
                    Err(Reserved::Data(ticket)) => {
                        io.ctx_mut().set_reservation(Reservation::Release(entry));
                        self.driver
                            .submit(io, |tag, _, buf| c.run_reserved(ticket, tag, buf));
                    }
                    Err(_) => {
                        io.ctx_mut().set_reservation(Reservation::Release(entry));
                        self.run_op(io);
                    }
                }
            }
            // Completed as a forwarded request: back to its channel, which finishes it.
            Reservation::Written(ticket, written) => self.driver.submit_no_data(io, |tag, _, _| {
                c.commit_reserved(ticket, tag, written.result())
            }),
            // Only a channel holds these: nothing was planned here for this request.
            r @ (Reservation::None
            | Reservation::Answer(..)
            | Reservation::Writing(_)
            | Reservation::Release(_)) => {
                tracing::error!("a first write reached the owner out of its protocol: {r:?}");
                done(io, Status::Failed);
            }
        }
    }
}
