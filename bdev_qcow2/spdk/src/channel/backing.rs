//! A channel's part in its backing bdev's hot-removal and return (ARCHITECTURE.md §15,
//! degraded mode): the md thread visits the channel on its own thread, which swaps its
//! device of the bdev (`BackingSlot`); requests on the channel never take a lock for it.

use super::Channel;
use crate::device::BaseDevice;
use crate::ffi::bdev::Desc;
use crate::node::Gone;
use qcow2_engine::golden::{CachedDevice, SharedReadCache};
use qcow2_engine::DevId;
use std::sync::Arc;

/// Adds to `ch`'s executor a device standing in for a backing bdev that is gone `g`.
pub(super) fn add_missing(ch: &Channel, g: Gone) -> DevId {
    let dev = BaseDevice::missing(g.size(), g.align(), g.may_cache());
    ch.exec().add_device(CachedDevice::plain(dev))
}

impl Channel {
    /// The backing bdev is going: this channel's reads that need it fail from now on, and
    /// its operations in flight drain (the poller keeps running until they have).
    pub fn backing_leave(&self) {
        self.backing.leave(self);
        self.wake();
    }

    /// The backing bdev came back as `desc` (generation `generation`, read through
    /// `cache`): this channel reads it again.
    pub fn backing_join(&self, desc: &Desc, cache: Option<&Arc<SharedReadCache>>, generation: u64) {
        self.backing.join(self, desc, cache, generation);
        self.wake();
    }
}
