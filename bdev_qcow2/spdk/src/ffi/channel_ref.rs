//! A reference to an io_device's channel on this thread ([`ChannelRef`]), put back on drop.

use super::sys;

/// A reference to a channel of some io_device (a base bdev's channel), put back on drop.
/// Must be dropped on the thread that got it.
#[derive(Debug)]
pub struct ChannelRef(*mut sys::spdk_io_channel);

impl ChannelRef {
    /// Gets this thread's channel of the bdev open as `desc`; `None` if SPDK refused.
    ///
    /// # Safety
    /// `desc` is open (its owner keeps it open while the channel lives).
    pub(super) unsafe fn of_raw(desc: *mut sys::spdk_bdev_desc) -> Option<ChannelRef> {
        // SAFETY: per the contract; the call runs on an SPDK thread.
        let ch = unsafe { sys::spdk_bdev_get_io_channel(desc) };
        // (Not `then_some`: it builds its argument, whose drop would put back a null
        // channel, whether or not it is taken.)
        if ch.is_null() {
            None
        } else {
            Some(ChannelRef(ch))
        }
    }

    /// The raw channel (for I/O submission).
    pub fn raw(&self) -> *mut sys::spdk_io_channel {
        self.0
    }
}

impl Drop for ChannelRef {
    fn drop(&mut self) {
        // SAFETY: the reference was obtained on this thread and is put back once.
        unsafe { sys::spdk_put_io_channel(self.0) }
    }
}
