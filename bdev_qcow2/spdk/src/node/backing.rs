//! The node's side of a backing bdev's hot-removal and return (ARCHITECTURE.md §15,
//! degraded mode): its phase ([`Link`](crate::backing_state::Link)), descriptor and shared
//! cache change together under the node's lock, on the md thread (`hotplug.rs` drives
//! them); channel creation on other threads reads them under the same lock.

use super::Node;
use crate::backing_state::{Phase, Shape};
use crate::ffi::bdev::Desc;
use qcow2_engine::golden::{SharedReadCache, Sharer};
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Node {
    /// Where the backing bdev is (`None`: the image has none).
    pub fn backing_phase(&self) -> Option<Phase> {
        self.current().link.as_ref().map(|l| l.phase())
    }

    /// SPDK reports the backing bdev removed: `true` when the cores must leave it now
    /// (new channels are built without it from here on).
    pub fn backing_removed(&self) -> bool {
        self.current().link.as_mut().is_some_and(|l| l.removed())
    }

    /// Channels still draining operations to the backing bdev that left.
    pub fn backing_pending(&self) -> usize {
        self.backing_pending.load(Ordering::Acquire)
    }

    /// Every core left the backing bdev and drained: its descriptor (to close on this, the
    /// md thread) and whether a bdev of its name appeared meanwhile. The shared cache is
    /// let go with it.
    pub fn backing_left(&self) -> (Option<Desc>, bool) {
        let mut c = self.current();
        let again = c.link.as_mut().is_some_and(|l| l.left());
        c.backing_cache = None;
        (c.backing.take(), again)
    }

    /// A stream dropped the backing bdev and every core left it: this bdev stops counting
    /// as a sharer of its cache (the overlays still reading it share it among themselves;
    /// one left alone reads past it).
    pub fn stream_left_backing(&self) {
        self.current().backing_cache = None;
    }

    /// A bdev of the backing bdev's name was registered, of shape `found` (see
    /// [`Link::appeared`](crate::backing_state::Link::appeared)).
    pub fn backing_appeared(&self, found: Shape) -> Result<bool, String> {
        match self.current().link.as_mut() {
            Some(l) => l.appeared(found),
            None => Ok(false),
        }
    }

    /// The returning backing bdev is open as `desc`, read through `cache`: the generation
    /// the cores take it under.
    pub fn backing_opened(&self, desc: Desc, cache: Option<Arc<SharedReadCache>>) -> u64 {
        let mut c = self.current();
        c.backing = Some(desc);
        c.backing_cache = cache.map(|c| c.share());
        c.link.as_mut().map_or(0, |l| l.opened())
    }

    /// Runs `f` with the backing descriptor, its cache and generation while cores read
    /// through it (present or returning).
    pub fn with_backing<R>(
        &self,
        f: impl FnOnce(&Desc, Option<&Arc<SharedReadCache>>, u64) -> R,
    ) -> Option<R> {
        let c = self.current();
        let l = c.link.as_ref().filter(|l| l.readable())?;
        let d = c.backing.as_ref()?;
        Some(f(
            d,
            c.backing_cache.as_ref().map(Sharer::cache),
            l.generation(),
        ))
    }

    /// Every core took the returning bdev: `true` when it was removed meanwhile (the cores
    /// must leave it again).
    pub fn backing_joined(&self) -> bool {
        self.current().link.as_mut().is_some_and(|l| l.joined())
    }
}
