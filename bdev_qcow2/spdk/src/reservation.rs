//! Where a core replica's first write stands in the owner's reservation protocol (#48),
//! as its bdev_io carries it between its channel and the md thread (in its context,
//! `io_ctx.rs`). The bdev_io is the message each way, so the protocol allocates nothing:
//!
//! 1. channel → owner, [`Reservation::Ask`]: plan this write without its data
//!    ([`Chain::reserve_write`](qcow2_engine::Chain::reserve_write));
//! 2. owner → channel, [`Reservation::Answer`]: the engine's [`Reserved`];
//! 3. the channel writes the data through its own base channel ([`Reserved::Write`],
//!    [`Reserved::InPlace`]), or sends it back with its data ([`Reserved::Data`] as
//!    [`Reservation::Data`], [`Reserved::Send`] as a plain forwarded write);
//! 4. channel → owner, [`Reservation::Written`]: the owner commits the ticket's L2 entries,
//!    or frees its clusters if the data write failed, and completes the request as any
//!    forwarded one.

use qcow2_engine::{GraceEntry, Reserved, Ticket};

/// A first write's step in the reservation protocol ([`Reservation::None`] for every
/// other request).
#[derive(Debug, Default)]
pub enum Reservation {
    /// Not in the protocol (or its owner's part has begun: its end is a forwarded
    /// request's).
    #[default]
    None,
    /// On its way to the owner, which plans it without its data; `entry` is the channel's
    /// grace period, held until its data write completes (the owner passes it back).
    Ask(GraceEntry),
    /// The owner's answer, on its way back to the channel with the channel's `entry`.
    Answer(Reserved, GraceEntry),
    /// The channel writes the data of `ticket`.
    Writing(Ticket),
    /// The channel's data write of `ticket` ended: the owner commits it (or frees it).
    Written(Ticket, DataWrite),
    /// The owner runs the plan of `ticket` with the request's own data.
    Data(Ticket),
}

/// How a channel's data write into reserved clusters ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataWrite {
    /// The data is on the device.
    Done,
    /// The device failed it with this errno: the owner frees the clusters.
    Failed(i32),
}

impl DataWrite {
    /// The engine's result of the write, for
    /// [`Chain::commit_reserved`](qcow2_engine::Chain::commit_reserved).
    pub fn result(self) -> qcow2_engine::Result<()> {
        match self {
            DataWrite::Done => Ok(()),
            DataWrite::Failed(errno) => Err(qcow2_engine::Error::Io(errno)),
        }
    }
}
