//! What a channel's chain reads under the top image ([`Underneath`]): the backing bdev, a
//! deep chain of qcow2 bdevs (`node/below.rs`: a device of every layer's base bdev, and of
//! the raw bottom, on this thread, and the layers' images opened on them all at once while
//! the replica of the top opens), or nothing once a stream dropped the backing reference.
//! The chain is built from it (`try_ready`); reads wait in the queue meanwhile.

use super::Channel;
use crate::device::SpdkDevice;
use crate::node::{Below, OpenedBelow};
use qcow2_engine::{DevId, Layer};
use std::cell::RefCell;
use std::rc::Rc;

/// What a channel's chain reads under the top image.
pub(super) enum Underneath {
    /// The backing bdev, if the image has one, as a raw layer (a qcow2 backing image is
    /// another of our bdevs).
    Backing,
    /// A deep chain's layers, opening beside the replica into this slot (`None` while
    /// some still open).
    Layers(OpenedBelow),
    /// Nothing: a stream dropped the backing reference (the image names no backing file).
    Detached,
}

/// The layers under the top, as the chain is built: `Err` when a layer failed to open.
pub(super) type LayersBelow = qcow2_engine::Result<Vec<Layer<SpdkDevice>>>;

impl Channel {
    /// Adds a device of each layer of `below` to this channel's executor and starts
    /// opening their images; the chain reads them under the top. Returns the devices, for
    /// the backing slot (they leave with the backing bdev); `Err`: SPDK gave no I/O
    /// channel.
    pub(super) fn open_below(&self, below: &Below) -> Result<Vec<DevId>, i32> {
        let opened: OpenedBelow = Rc::new(RefCell::new(None));
        let devs = below.open(self.exec(), &opened).ok_or(libc::ENOMEM)?;
        for &id in &devs {
            self.driver.attach(id, self);
        }
        *self.under.borrow_mut() = Underneath::Layers(opened);
        Ok(devs)
    }

    /// The layers the chain reads under the top image, once they can be had: `None` while
    /// a deep chain's layers still open.
    pub(super) fn layers_below(&self) -> Option<LayersBelow> {
        match &*self.under.borrow() {
            Underneath::Layers(opened) => opened.borrow_mut().take(),
            Underneath::Detached => Some(Ok(Vec::new())),
            Underneath::Backing => Some(Ok(self
                .backing
                .dev()
                .map(|dev| Layer::Raw {
                    dev,
                    size: self.exec().device_size(dev),
                })
                .into_iter()
                .collect())),
        }
    }

    /// Whether the chain waits for a deep chain's layers that are not open yet.
    pub(super) fn below_pending(&self) -> bool {
        match &*self.under.borrow() {
            Underneath::Layers(opened) => opened.borrow().is_none(),
            Underneath::Backing | Underneath::Detached => false,
        }
    }
}
