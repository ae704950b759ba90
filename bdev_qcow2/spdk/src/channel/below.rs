//! A channel's part in a deep chain of qcow2 bdevs (`node/below.rs`): a device of every
//! layer's base bdev (and of the raw bottom) on this thread, and the layers' images opened
//! on them, all at once, while the replica of the top opens. The chain is built from both
//! (`try_ready`); reads wait in the queue meanwhile.

use super::Channel;
use crate::device::SpdkDevice;
use crate::node::Below;
use qcow2_engine::{DevId, Layer};

impl Channel {
    /// Adds a device of each layer of `below` to this channel's executor and starts
    /// opening their images (into `self.below_opened`). Returns the devices, for the
    /// backing slot (they leave with the backing bdev); `Err`: SPDK gave no I/O channel.
    pub(super) fn open_below(&self, below: &Below) -> Result<Vec<DevId>, i32> {
        let devs = below
            .open(self.exec(), &self.below_opened)
            .ok_or(libc::ENOMEM)?;
        for &id in &devs {
            self.driver.attach(id, self);
        }
        self.below_wait.set(true);
        Ok(devs)
    }

    /// The layers under the top, once every image is open: `None` while some still open
    /// (or when the channel reads no deep chain: see `below_wait`).
    pub(super) fn take_below(&self) -> Option<qcow2_engine::Result<Vec<Layer<SpdkDevice>>>> {
        self.below_opened.borrow_mut().take()
    }

    /// Whether the chain waits for layers under the top that are not open yet.
    pub(super) fn below_pending(&self) -> bool {
        self.below_wait.get() && self.below_opened.borrow().is_none()
    }
}
