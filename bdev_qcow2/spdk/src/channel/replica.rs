//! Where a channel's replica of the image stands ([`ReplicaState`]) and how it becomes
//! ready: once the image is open, the chain is built over it (with the backing bdev, or a
//! deep chain's layers below) and the reads that waited for it are submitted.

use super::Channel;
use qcow2_engine::{Chain, Layer};

/// Where a channel's replica of the image stands (once built, its chain is the
/// channel's `chain`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ReplicaState {
    /// None on this channel: a writable bdev's channel on its md thread (or without a seed
    /// to build one from), whose owner serves every request.
    None,
    /// Being opened (its result lands in `opened`), or opened and waiting for the layers
    /// below it.
    Opening,
    /// Built: the channel serves on its chain.
    Ready,
    /// A writable bdev's replica could not be built: everything goes to the owner.
    ForwardOnly,
    /// Opening the image failed (a read-only bdev): its reads fail.
    Failed,
}

impl Channel {
    /// Once the replica is open: builds the chain (the backing bdev, if any, is a raw layer:
    /// a qcow2 backing image is another of our bdevs; or, over a deep chain of them, the
    /// layers under it, `channel/below.rs`) and submits the queued reads.
    pub(super) fn try_ready(&self) {
        if self.replica.get() != ReplicaState::Opening
            || self.below_pending()
            || self.opened.borrow().is_none()
        {
            return;
        }
        // (Both there: checked just above.)
        let (Some(r), Some(below)) = (self.opened.borrow_mut().take(), self.layers_below()) else {
            return;
        };
        let chain = self.driver.run(|| {
            r.and_then(|q| {
                let mut layers = vec![Layer::Qcow2(Box::new(q))];
                layers.extend(below?);
                Chain::new(self.exec(), layers)
            })
        });
        match chain {
            Ok(c) => {
                c.prefetch().set_on(self.prefetch);
                if let Some((cfg, gens)) = &self.ring {
                    // Its buffer is DMA memory of the base, allocated once, here.
                    match c.enable_ring(*cfg, gens.clone()) {
                        Ok(()) => c.ring().probe_base(),
                        Err(e) => {
                            tracing::warn!(
                                "channel on {}: no prefetch ring ({e})",
                                self.thread_name
                            )
                        }
                    }
                }
                let _ = self.chain.set(c);
                self.replica.set(ReplicaState::Ready);
            }
            Err(e) if self.forward_to.is_some() => {
                // A writable bdev's replica could not be built (e.g. more threads than
                // grace-period slots): this channel sends everything to the owner instead.
                tracing::warn!(
                    "channel on {}: no replica ({e}); its requests go to the metadata owner",
                    self.thread_name
                );
                self.replica.set(ReplicaState::ForwardOnly);
            }
            Err(e) => {
                tracing::error!(
                    "channel on {}: opening the image failed: {e}",
                    self.thread_name
                );
                self.replica.set(ReplicaState::Failed);
            }
        }
        let queued = std::mem::take(&mut *self.queued.borrow_mut());
        for io in queued {
            self.read_replica(io);
        }
    }

    /// Whether this channel serves requests on its own replica (read-only bdevs, and
    /// writable bdevs away from the md thread).
    pub(super) fn has_replica(&self) -> bool {
        match self.replica.get() {
            ReplicaState::Ready | ReplicaState::Failed => true,
            // (Still opening: reads go to the owner until the open's result is in.)
            ReplicaState::Opening => self.opened.borrow().is_some(),
            ReplicaState::None | ReplicaState::ForwardOnly => false,
        }
    }
}
