//! How a writable bdev's replica asks the owner for slices it holds dirty: a boxed
//! [`Ask`] to the md thread and back (slow path only).

use super::Channel;
use crate::ffi::sink::HomeRef;
use crate::ffi::thread::{self, Homed};
use crate::owner;
use qcow2_engine::coherency::SliceReply;
use qcow2_engine::{Layer, OwnerLink};

/// How a writable bdev's replica reaches the owner for a slice it holds dirty: a boxed
/// [`Ask`] sent to the md thread and back (slow path only).
pub(super) struct SpdkLink {
    pub(super) owner: Homed<owner::Owner>,
    /// The channel, found once `ffi` started it (asks come only from its replica then).
    pub(super) chan: HomeRef<Channel>,
}

/// One slice request on its way to the owner (on its md thread) and back to the channel.
pub struct Ask {
    owner: Homed<owner::Owner>,
    chan: Homed<Channel>,
    key: u64,
    ticket: u64,
    reply: Option<SliceReply>,
}

impl OwnerLink for SpdkLink {
    fn ask_slice(&self, key: u64, ticket: u64) {
        let Some(chan) = self.chan.homed() else {
            tracing::error!("a slice asked for by a channel that is not running");
            return;
        };
        send_ask(Box::new(Ask {
            owner: self.owner.clone(),
            chan,
            key,
            ticket,
            reply: None,
        }));
    }
}

/// Sends `a` to the md thread (or back to its channel once answered); if SPDK's message pool
/// is empty, the sending side's poller sends it again ([`Channel::poll`],
/// [`Owner::defer_ask`](owner::Owner::defer_ask)).
pub fn send_ask(a: Box<Ask>) {
    let (owner, chan) = (a.owner.clone(), a.chan.clone());
    let to = if a.reply.is_none() {
        owner.home()
    } else {
        chan.home()
    };
    let Err(a) = to.send_boxed(a) else {
        return;
    };
    if a.reply.is_none() {
        // On the channel's thread: its poller sends it again.
        chan.get().unsent_asks.borrow_mut().push(a);
        chan.get().wake();
    } else {
        // On the md thread: the owner's poller sends the answer again.
        owner.get().defer_ask(a);
    }
}

impl thread::Message for Ask {
    /// On the md thread: the owner answers and the answer goes back; on the channel's thread:
    /// the replica gets it.
    fn arrive(mut self: Box<Ask>) {
        let Some(reply) = self.reply else {
            self.reply = Some(self.owner.get().slice_for_core(self.key));
            return send_ask(self);
        };
        let ch = self.chan.get();
        ch.wake();
        ch.driver.run(|| {
            if let Some(Layer::Qcow2(q)) = ch.chain.get().and_then(|c| c.layers().first()) {
                q.deliver_slice(self.ticket, reply);
            }
        });
    }
}
