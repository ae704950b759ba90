//! A host's device of the backing bdev (a channel's or the owner's), as the bdev is
//! hot-removed and comes back (ARCHITECTURE.md §15, degraded mode). Only the host's own
//! thread touches it: the md thread drives the node's phase and visits each channel on its
//! thread (`for_each_channel`), so the swap needs no lock on the data path.

use crate::engine_host::Host;
use crate::ffi::bdev::Desc;
use qcow2_engine::golden::SharedReadCache;
use qcow2_engine::DevId;
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// One host's device of the backing bdev.
pub struct BackingSlot {
    /// The device in the host's executor (`None`: the host reads no backing bdev, or reads
    /// a deep chain's `layers` in its place).
    dev: Option<DevId>,
    /// The devices of a deep chain's layers under the backing bdev (`node/below.rs`): they
    /// leave with it, and never come back.
    layers: Vec<DevId>,
    /// The generation of the descriptor the device reads (0: the bdev is gone).
    generation: Cell<u64>,
    /// Operations to the bdev that left are still in flight.
    draining: Cell<bool>,
    /// The node's count of hosts still draining (the descriptor closes at 0); `None` for
    /// the owner, which the md thread asks directly.
    pending: Option<Arc<AtomicUsize>>,
}

impl BackingSlot {
    /// The slot of device `dev` (if any), reading the descriptor of `generation` (0: built
    /// missing), counted in `pending` while it drains.
    pub fn new(
        dev: Option<DevId>,
        generation: u64,
        pending: Option<Arc<AtomicUsize>>,
    ) -> BackingSlot {
        BackingSlot {
            dev,
            layers: Vec::new(),
            generation: Cell::new(generation),
            draining: Cell::new(false),
            pending,
        }
    }

    /// The slot of a host reading a deep chain's layers `layers` in place of the backing
    /// bdev (generation `generation`), counted in `pending` while they drain.
    pub fn layers(
        layers: Vec<DevId>,
        generation: u64,
        pending: Option<Arc<AtomicUsize>>,
    ) -> BackingSlot {
        let mut s = BackingSlot::new(None, generation, pending);
        s.layers = layers;
        s
    }

    /// The devices of the backing bdev (or of the layers read in its place).
    fn devs(&self) -> impl Iterator<Item = DevId> + '_ {
        self.dev.iter().chain(self.layers.iter()).copied()
    }

    /// The device, if the host reads a backing bdev.
    pub fn dev(&self) -> Option<DevId> {
        self.dev
    }

    /// Whether operations to a bdev that left are still in flight (the host's poller keeps
    /// running and calls [`settle`](Self::settle)).
    pub fn draining(&self) -> bool {
        self.draining.get()
    }

    /// The bdev is going: later operations fail at once (reads that need it, and copies
    /// on write from it), the shared cache is let go, and what is in flight drains.
    pub fn leave<H: Host>(&self, host: &H) {
        if self.dev.is_none() && self.layers.is_empty() {
            return;
        }
        self.generation.set(0);
        let mut still = false;
        for dev in self.devs() {
            still |= host.driver().run(|| {
                host.driver().exec().with_device(dev, |d| {
                    d.inner_mut().leave();
                    d.set_cache(None);
                    d.inner_mut().settle()
                })
            });
        }
        if still && !self.draining.replace(true) {
            if let Some(p) = &self.pending {
                p.fetch_add(1, Ordering::AcqRel);
            }
        }
    }

    /// From the host's poller while [`draining`](Self::draining): puts the channels of the
    /// bdev that left once their operations are done. Returns whether any is still
    /// draining.
    pub fn settle<H: Host>(&self, host: &H) -> bool {
        if !self.draining.get() {
            return false;
        }
        let mut still = false;
        for dev in self.devs() {
            still |= host
                .driver()
                .exec()
                .with_device(dev, |d| d.inner_mut().settle());
        }
        if !still {
            self.undrain();
        }
        still
    }

    fn undrain(&self) {
        if self.draining.replace(false) {
            if let Some(p) = &self.pending {
                p.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// The bdev came back as `desc` (generation `generation`), read through `cache`: the
    /// device reads it from now on. A host already on that generation (built after the
    /// return) is left alone.
    pub fn join<H: Host>(
        &self,
        host: &H,
        desc: &Desc,
        cache: Option<&Arc<SharedReadCache>>,
        generation: u64,
    ) {
        let Some(dev) = self.dev else { return };
        if self.generation.get() == generation {
            return;
        }
        let d = host.driver();
        let joined = d.exec().with_device(dev, |dv| {
            if !dv.inner_mut().join(desc) {
                return false;
            }
            dv.set_cache(cache.cloned());
            true
        });
        if !joined {
            tracing::error!(
                "no I/O channel of the returning backing bdev {}",
                desc.name()
            );
            return;
        }
        self.generation.set(generation);
        d.attach(dev, host);
    }
}

impl Drop for BackingSlot {
    fn drop(&mut self) {
        // A host is freed only once idle, with nothing in flight (its device drained).
        self.undrain();
    }
}
