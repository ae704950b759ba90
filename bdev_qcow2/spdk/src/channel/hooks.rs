//! SPDK's calls on a channel outside a request: its creation, release and teardown
//! (`ffi/io_channel.rs`), the owner's side of the channels, resets and the counters'
//! collection.

use super::{complete_forwarded, send_ask, Ask, Channel, ChannelStats};
use crate::ffi::io_channel::Channels;
use crate::ffi::sys;
use crate::node::Node;
use crate::owner;
use crate::types::{BdevIo, ChannelIter, Qcow2Bdev};
use std::ffi::c_int;
use std::sync::atomic::Ordering;

impl Drop for Channel {
    fn drop(&mut self) {
        let s = self.stats();
        if let Ok(mut r) = self.retired.lock() {
            r.add(&s);
        }
        // Release the base channels (and any other engine state) before the node may
        // close the descriptors they belong to.
        self.chain.take();
        self.opened.borrow_mut().take();
        self.direct = None;
        self.driver.release();
        self.live.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Channel {
    /// SPDK put the channel (`destroy_cb`): whether the state can go now; else its poll
    /// finishes it once idle (a channel can go away while its replica is still being
    /// opened).
    pub fn release(&self) -> bool {
        self.closing.set(true);
        self.wake();
        self.idle()
    }
}

/// SPDK's calls on our channels (`ffi/io_channel.rs`): a channel state is built from one
/// view of the node that no switch changes meanwhile (`Node::new_channel`).
impl Channels for Qcow2Bdev {
    /// A writable node's channel whose core replica cannot be built (its base bdev gives
    /// this thread no I/O channel: out of memory, or the kernel's `fs.aio-max-nr` reached)
    /// falls back to forwarding every request to the owner: slower, but it serves the
    /// node's current image. Failing instead would, during an external snapshot, leave the
    /// channel on its old state, whose replica writes in place into what is now the
    /// read-only snapshot.
    fn create_channel(node: &Node) -> Result<Box<Channel>, i32> {
        match node.new_channel(Channel::create) {
            // (Not for a node being torn down, which has no base: nothing to forward to.)
            Err(e) if e != libc::ENODEV && node.writable() => {
                let thread = crate::ffi::thread::current_name();
                tracing::warn!(
                    "qcow2 bdev {}: no core replica on thread {thread} (errno {e}); its \
                     requests go to the metadata thread",
                    node.name()
                );
                node.new_channel(|src| Channel::create(src.forward_only()))
            }
            r => r,
        }
    }

    fn release_channel(c: &Channel) -> bool {
        c.release()
    }
}

/// What the owner needs of the channels: its answers to their slice requests go back as
/// [`Ask`]s, and the requests it ran complete on their channels.
impl owner::ChannelSide for Qcow2Bdev {
    type Ask = Ask;

    fn send_ask(a: Box<Ask>) {
        send_ask(a)
    }

    fn complete_forwarded(io: BdevIo) {
        complete_forwarded(io)
    }
}

/// A reset visits every channel and moves on once that channel has no request in flight.
pub(super) fn reset_step(it: ChannelIter, _io: &mut BdevIo) {
    it.with_channel(|c, it| {
        if c.outstanding() == 0 {
            it.next(0);
        } else {
            c.reset_waiters.borrow_mut().push(it);
            c.wake();
        }
    });
}

pub(super) fn reset_done(io: BdevIo, status: c_int) {
    io.complete(if status == 0 {
        sys::SPDK_BDEV_IO_STATUS_SUCCESS
    } else {
        sys::SPDK_BDEV_IO_STATUS_FAILED
    });
}

/// Collects a channel's counters during a `for_each_channel` (see `rpc.rs`).
pub fn stats_step(it: ChannelIter, acc: &mut Vec<ChannelStats>) {
    it.with_channel(|c, it| {
        acc.push(c.stats());
        it.next(0);
    });
}
