//! The owner's side of a core replica's first write (`reservation.rs`): it answers where
//! the core writes the data, commits what the core wrote, or runs the plan with the data
//! the core sent. The engine decides every step ([`Chain::reserve_write`],
//! [`Chain::commit_reserved`], [`Chain::run_reserved`]); this only carries the bdev_io.

use super::{done, Owner};
use crate::reservation::Reservation;
use crate::status::Status;
use crate::types::BdevIo;
#[cfg(doc)]
use qcow2_engine::Chain;

impl Owner {
    /// Serves forwarded request `io`, a first write in the reservation protocol (its
    /// context says which step). On the md thread, inside the engine.
    pub(super) fn serve_reservation(&self, mut io: BdevIo) {
        let c = &self.chain;
        match io.ctx_mut().take_reservation() {
            Reservation::Ask(entry) => {
                let answer = c.reserve_write(io.offset_bytes(), io.len_bytes());
                io.ctx_mut()
                    .set_reservation(Reservation::Answer(answer, entry));
                done(io, Status::Success);
            }
            // Completed as a forwarded request: back to its channel, which finishes it.
            Reservation::Written(ticket, written) => self.driver.submit_no_data(io, |tag, _, _| {
                c.commit_reserved(ticket, tag, written.result())
            }),
            Reservation::Data(ticket) => self
                .driver
                .submit(io, |tag, _, buf| c.run_reserved(ticket, tag, buf)),
            // Only a channel holds these: nothing was planned here for this request.
            r @ (Reservation::None | Reservation::Answer(..) | Reservation::Writing(_)) => {
                tracing::error!("a first write reached the owner out of its protocol: {r:?}");
                done(io, Status::Failed);
            }
        }
    }
}
