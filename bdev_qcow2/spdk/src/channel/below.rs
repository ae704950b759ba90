//! A channel's part in a deep chain of qcow2 bdevs (`node/below.rs`): a device of every
//! layer's base bdev (and of the raw bottom) on this thread, and the layers' images opened
//! on them, all at once, while the replica of the top opens. The chain is built from both
//! (`try_ready`); reads wait in the queue meanwhile.

use super::Channel;
use crate::device::SpdkDevice;
use crate::node::Below;
use qcow2_engine::{DevId, Layer, Qcow2};
use std::cell::RefCell;
use std::rc::Rc;

/// The layers under the top once opened (`None`: still opening).
pub(super) type OpenedBelow = Rc<RefCell<Option<qcow2_engine::Result<Vec<Layer<SpdkDevice>>>>>>;

/// Where the layers' opens put their images, and how many are still opening.
struct Opening {
    images: Vec<Option<Qcow2<SpdkDevice>>>,
    left: usize,
    failed: Option<qcow2_engine::Error>,
    bottom: Option<(DevId, u64)>,
}

impl Channel {
    /// Adds a device of each layer of `below` to this channel's executor and starts
    /// opening their images (into `self.below_opened`). Returns the devices, for the
    /// backing slot (they leave with the backing bdev); `Err`: SPDK gave no I/O channel.
    pub(super) fn open_below(&self, below: &Below) -> Result<Vec<DevId>, i32> {
        let exec = self.exec();
        let mut devs = Vec::with_capacity(below.depth());
        let descs = below.layers().iter().map(|l| &l.desc).chain(below.bottom());
        for desc in descs {
            let d = crate::device::open_layer(desc).ok_or(libc::ENOMEM)?;
            let id = exec.add_device(d);
            // SAFETY: the channel state is boxed and owns the executor that owns the device.
            unsafe { self.driver.attach(id, self) };
            devs.push(id);
        }
        let n = below.layers().len();
        let bottom = below.bottom().map(|_| {
            let d = devs[n];
            (d, exec.device_size(d))
        });
        let state = Rc::new(RefCell::new(Opening {
            images: (0..n).map(|_| None).collect(),
            left: n,
            failed: None,
            bottom,
        }));
        self.below_wait.set(true);
        if n == 0 {
            *self.below_opened.borrow_mut() = Some(state.borrow_mut().finish());
            return Ok(devs);
        }
        for (i, l) in below.layers().iter().enumerate() {
            let (e2, st, out) = (exec.clone(), state.clone(), self.below_opened.clone());
            let (dev, opts, key) = (devs[i], l.opts, l.key.clone());
            exec.spawn(async move {
                let r = Qcow2::open(&e2, dev, opts).await.and_then(|q| {
                    if let Some(k) = &key {
                        q.unlock_with(k)?;
                    }
                    Ok(q)
                });
                let mut s = st.borrow_mut();
                match r {
                    Ok(q) => s.images[i] = Some(q),
                    Err(e) => {
                        s.failed.get_or_insert(e);
                    }
                }
                s.left -= 1;
                if s.left == 0 {
                    *out.borrow_mut() = Some(s.finish());
                }
            });
        }
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

impl Opening {
    /// The layers, top first, the raw bottom last; or the first error.
    fn finish(&mut self) -> qcow2_engine::Result<Vec<Layer<SpdkDevice>>> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        let mut layers: Vec<_> = self
            .images
            .drain(..)
            .flatten()
            .map(|q| Layer::Qcow2(Box::new(q)))
            .collect();
        if let Some((dev, size)) = self.bottom {
            layers.push(Layer::Raw { dev, size });
        }
        Ok(layers)
    }
}
