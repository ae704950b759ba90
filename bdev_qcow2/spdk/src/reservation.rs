//! Where a core replica's first write stands in the owner's reservation protocol (#48),
//! as its bdev_io carries it between its channel and the md thread (in its context,
//! `io_ctx.rs`). The bdev_io is the message each way, so the protocol allocates nothing:
//!
//! 1. channel → owner, [`Reservation::Ask`]: plan this write without touching its data
//!    ([`Chain::reserve_write`](qcow2_engine::Chain::reserve_write));
//! 2. owner → channel, [`Reservation::Answer`], when the core writes the data
//!    ([`Reserved::Write`], [`Reserved::InPlace`]): the channel writes it through its own
//!    base channel. When the owner needs more than the guest's bytes ([`Reserved::Data`])
//!    or did not plan it ([`Reserved::Send`]), it runs the write at once with the
//!    bdev_io's own iovecs (the data the tool's core would send) and the request comes
//!    back as [`Reservation::Release`];
//! 3. channel → owner, [`Reservation::Written`]: the owner commits the ticket's L2 entries,
//!    or frees its clusters if the data write failed, and completes the request as any
//!    forwarded one.

use qcow2_engine::types::HostOffset;
use qcow2_engine::{GraceEntry, Reserved, Ticket};

/// A first write's step in the reservation protocol ([`Reservation::None`] for every
/// other request).
#[derive(Debug, Default)]
pub enum Reservation {
    /// Not in the protocol (or past it: its end is a forwarded request's).
    #[default]
    None,
    /// On its way to the owner, which plans it; `entry` is the channel's grace period,
    /// held until the request no longer uses a mapping the owner gave (the owner passes
    /// it back).
    Ask(GraceEntry),
    /// The owner's answer, on its way back to the channel with the channel's `entry`.
    Answer(CoreWrite, GraceEntry),
    /// The channel writes the data of `ticket`.
    Writing(Ticket),
    /// The channel's data write of `ticket` ended: the owner commits it (or frees it).
    Written(Ticket, DataWrite),
    /// The owner ran the write itself: the channel ends its grace period `entry` and
    /// completes it with the status it carries.
    Release(GraceEntry),
}

/// What the owner answers a core that writes the data itself.
#[derive(Debug, PartialEq, Eq)]
pub enum CoreWrite {
    /// An overwrite by now: written at `host`, complete once written.
    InPlace(HostOffset),
    /// Written at `host`, then handed back for the owner to commit `ticket`.
    Write(Ticket, HostOffset),
}

impl CoreWrite {
    /// The core's part of the engine's answer: `Err` gives back the answers the owner
    /// runs itself ([`Reserved::Data`], [`Reserved::Send`]).
    pub fn of(answer: Reserved) -> Result<CoreWrite, Reserved> {
        match answer {
            Reserved::InPlace { host } => Ok(CoreWrite::InPlace(host)),
            Reserved::Write { ticket, host } => Ok(CoreWrite::Write(ticket, host)),
            other => Err(other),
        }
    }
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
