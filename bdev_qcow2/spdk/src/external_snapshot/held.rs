//! What an external snapshot's steps hold between them, each in the state that names its
//! step (`State` in the parent): the new base, the overlay once open, and what a failure
//! must release; and where the bdev's I/O pause stands.

use super::prepare::Encrypt;
use crate::device::SpdkDevice;
use crate::ffi::bdev::Desc;
use qcow2_engine::create::CreateOptions;
use qcow2_engine::image::UnlockedKey;
use qcow2_engine::{Exec, Qcow2};
use std::time::Instant;

/// The new base before the overlay is formatted on it: claimed as its writer.
pub(super) struct NewBase {
    pub(super) desc: Desc,
    /// How the overlay of an encrypted image is encrypted (its format takes it).
    pub(super) encrypt: Option<Encrypt>,
}

/// What `Format` starts from: the overlay's options (from the old image), the new base,
/// and the old image's key (encrypted images).
pub(super) struct ToFormat {
    pub(super) opts: CreateOptions,
    pub(super) base: NewBase,
    pub(super) old_key: Option<UnlockedKey>,
}

/// The overlay, formatted and open on the new base on a poller of its own, from `Format`
/// until `Switch` puts it under the node.
pub(super) struct Overlay {
    // (Dropped in this order, before the base's descriptor closes: `Held::release`.)
    pub(super) image: Qcow2<SpdkDevice>,
    /// Its executor: device 0 is the new base.
    pub(super) exec: Exec<SpdkDevice>,
    pub(super) new_base: Desc,
    /// The keys the overlay and the old image were unlocked with (encrypted images): the
    /// bdevs over them take them without deriving them again, with I/O paused.
    pub(super) key: Option<UnlockedKey>,
    pub(super) old_key: Option<UnlockedKey>,
}

/// What a failing switch still holds, released by `Fail`: the bdev serves its old image
/// as before.
pub(super) enum Held {
    Nothing,
    /// The new base, claimed.
    Base(Desc),
    Overlay(Box<Overlay>),
}

impl Held {
    /// Closes what is held: the overlay and its executor first, then the new base.
    pub(super) fn release(self) {
        match self {
            Held::Nothing => {}
            Held::Base(d) => d.close(),
            Held::Overlay(ov) => {
                let Overlay {
                    image,
                    exec,
                    new_base,
                    ..
                } = *ov;
                drop(image);
                drop(exec);
                new_base.close();
            }
        }
    }
}

/// The pause of a switch's bdev: asked for at `Quiesce`, held once SPDK quiesced the bdev,
/// over (with how long it lasted) once `Resume` let requests go on.
#[derive(Clone, Copy, Debug)]
pub(super) enum Pause {
    /// Not asked for yet.
    NotAsked,
    /// Asked for at this instant; SPDK has not quiesced the bdev yet (or refused).
    Asked(Instant),
    /// The bdev is quiesced since the quiesce asked for at this instant.
    Held(Instant),
    /// Over: I/O paused this many microseconds.
    Over(u64),
}

impl Pause {
    /// Microseconds I/O paused, once over (0 before).
    pub(super) fn us(self) -> u64 {
        match self {
            Pause::Over(us) => us,
            _ => 0,
        }
    }
}
