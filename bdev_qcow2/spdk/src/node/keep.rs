//! A read-only qcow2 bdev over another one keeps its own channel on its md thread for its
//! life (ARCHITECTURE.md §15, "Chains of qcow2 bdevs"). Each channel of such a bdev opens
//! its image and a channel of its base bdev (an AIO bdev: `io_setup`, and `io_destroy`,
//! which waits for an RCU grace period, when put), and reads what its image does not hold
//! through its backing bdev's channel, taken on first use. SPDK's examine of every new
//! bdev of a chain reads it through a channel it takes and puts: without this, each
//! examine built and tore down a channel of every bdev below (a chain of D loaded in
//! O(D²) channels, 34 s at D = 100, almost all of it waiting in `io_destroy`). Kept, the
//! channels of the chain on the md thread are built once, and an examine's read goes down
//! the chain through them.

use super::Node;
use crate::ffi::io_channel::Kept;
use crate::registry::Registry;

/// Whether a read-only bdev over backing bdev `backing` keeps its channel: when that is a
/// read-only qcow2 bdev of ours (a link of a chain).
pub fn keeps(reg: &Registry, read_only: bool, backing: Option<&str>) -> bool {
    read_only && backing.is_some_and(|b| super::below::is_link(reg, b))
}

impl Node {
    /// Marks a node that keeps its channel (before it registers: SPDK's examines may build
    /// channels meanwhile). Its channels on the md thread copy its image from the seed its
    /// creation took and take its base bdev's channel on first use: a layer of a chain
    /// whose own image nothing reads there holds no channel of its base (an AIO bdev's is a
    /// kernel AIO context, polled on every pass of the thread, whose `io_destroy` waits an
    /// RCU grace period: 1,000 of them took half of the core in polls).
    pub fn with_link(mut self, keeps: bool) -> Node {
        self.link = keeps;
        self
    }

    /// Holds `kept`, the node's channel on the md thread, until teardown.
    pub fn set_kept(&self, kept: Option<Kept>) {
        *self.kept.lock().unwrap_or_else(|e| e.into_inner()) = kept;
    }

    /// Teardown: puts the kept channel back (on the md thread), so that the io_device can
    /// finish unregistering.
    pub fn release_kept(&self) {
        drop(self.kept.lock().unwrap_or_else(|e| e.into_inner()).take());
    }
}
