//! A chain's prefetch ring as one part ([`ChainRing`]): whether it is on, the stream table
//! every read looks at ([`Hot`]), the ring itself with its buffer ([`RingHost`], once the
//! host turned it on), the image's write generations and the records of compressed fills.
//! The chain issues the read-aheads the ring hands out (`chain/ring.rs`); everything that
//! only reads or changes this state is here.

use super::compressed::ZipFills;
use super::host::RingHost;
use super::{Hot, Passes, RingConfig, RingStats, RingWait, WriteGens};
use crate::io::{BufSlice, IoBuffer};
use std::cell::{OnceCell, RefCell};
use std::sync::Arc;
use std::time::Duration;

/// A chain's prefetch ring ([`Chain::ring`](crate::Chain::ring)). `repr(C)`: what every
/// read looks at first.
#[repr(C)]
pub struct ChainRing<B> {
    /// The stream table as every read sees it (a random read goes no further), with
    /// whether the ring is on.
    hot: Hot,
    /// The ring, once the host turned it on.
    host: RefCell<Option<RingHost<B>>>,
    /// The image's write generations, while the ring is on.
    gens: OnceCell<Arc<WriteGens>>,
    /// Ring chunks holding compressed clusters filled without a task
    /// (`ring/compressed.rs`).
    zips: RefCell<ZipFills<B>>,
}

impl<B> Default for ChainRing<B> {
    fn default() -> Self {
        ChainRing {
            hot: Hot::default(),
            host: RefCell::new(None),
            gens: OnceCell::new(),
            zips: RefCell::default(),
        }
    }
}

impl<B: IoBuffer> ChainRing<B> {
    /// Turns the ring on with `cfg` for a disk of `disk_size` bytes under the image's
    /// write generations `gens`; `buf` allocates its buffer (`cfg.ring_bytes`) once the
    /// configuration is accepted. Refuses a configuration [`RingConfig::validate`]
    /// refuses, and a second call.
    pub(crate) fn enable(
        &self,
        cfg: RingConfig,
        disk_size: u64,
        gens: Arc<WriteGens>,
        buf: impl FnOnce(usize) -> B,
    ) -> Result<(), &'static str> {
        cfg.validate()?;
        let mut slot = self.host.borrow_mut();
        if slot.is_some() {
            return Err("prefetch ring already on");
        }
        let buf = buf(cfg.ring_bytes as usize);
        let _ = self.gens.set(gens.clone());
        *slot = Some(RingHost::new(cfg, disk_size, buf, gens));
        self.hot.turn_on();
        Ok(())
    }

    /// Stops reading ahead once this core's read-aheads show a synchronous base: reads
    /// over as soon as their submission returns, where read-ahead hides no latency and
    /// costs a second copy ([`SyncProbe`](super::probe::SyncProbe)). For hosts on real
    /// devices: an in-memory test device would look synchronous and turn read-ahead off.
    pub fn probe_base(&self) {
        if let Some(rh) = self.host.borrow_mut().as_mut() {
            rh.probe_base();
        }
    }

    /// Whether the ring is on.
    #[inline(always)]
    pub fn is_on(&self) -> bool {
        self.hot.is_on()
    }

    /// Whether the ring has something to do with a read of `len` bytes at `offset`
    /// ([`Hot::passes`]: not when it is off, for a read that continues nothing or starts a
    /// stream on the hot half, or one of a stream the ring turned off for good).
    #[inline(always)]
    pub fn passes(&self, offset: u64, len: u64) -> Passes {
        self.hot.passes(offset, len)
    }

    /// The image's write generations, when the ring is on.
    pub fn write_gens(&self) -> Option<&Arc<WriteGens>> {
        self.gens.get()
    }

    /// A guest write, write-zeroes or discard of `len` bytes at `offset`, run on any path
    /// of any core of this image, is about to complete (successfully or not): makes every
    /// core's prefetched data of those bytes unusable. Hosts call it before they report
    /// the completion; a no-op while the ring is off.
    #[inline(always)]
    pub fn written(&self, offset: u64, len: u64) {
        if let Some(g) = self.gens.get() {
            g.written(offset, len);
        }
    }

    /// On the image's owner, from its poll loop (as often as it polls): every
    /// [`SWEEP_EVERY`](crate::ring::zones::SWEEP_EVERY), clears the zones no read-ahead
    /// watches any more ([`Zones::sweep`](crate::ring::Zones::sweep)), so that writes there
    /// skip their generation bump again once every reader has left. Returns whether it
    /// swept.
    pub fn tick_zones(&self) -> bool {
        let Ok(mut guard) = self.host.try_borrow_mut() else {
            return false;
        };
        guard.as_mut().is_some_and(RingHost::tick_zones)
    }

    /// Sets how often [`tick_zones`](Self::tick_zones) sweeps (default
    /// [`SWEEP_EVERY`](crate::ring::zones::SWEEP_EVERY)): a stress test sweeps often, to
    /// race sweeps with the rings.
    pub fn set_sweep_every(&self, every: Duration) {
        if let Some(rh) = self.host.borrow_mut().as_mut() {
            rh.set_sweep_every(every);
        }
    }

    /// The ring's counters (`None` while it is off).
    pub fn stats(&self) -> Option<RingStats> {
        self.host.borrow().as_ref().map(RingHost::stats)
    }

    /// The ring's configuration (`None` while it is off).
    pub fn config(&self) -> Option<RingConfig> {
        self.host.borrow().as_ref().map(RingHost::config)
    }

    /// Queues a read the ring answered [`RingServed::Wait`](super::RingServed::Wait) (at
    /// once: before the host returns to its poller) under `tag`, with `buf`, the read's
    /// whole buffer: the engine completes `tag` when the rest of it is copied from the ring
    /// or read from the base.
    pub fn wait(&self, wait: RingWait, tag: u64, buf: BufSlice<B>) {
        let mut guard = self.host.borrow_mut();
        let Some(rh) = guard.as_mut() else {
            unreachable!("a ring that answered Wait stays on");
        };
        rh.wait(wait, tag, buf);
    }

    /// The stream table.
    #[inline(always)]
    pub(crate) fn hot(&self) -> &Hot {
        &self.hot
    }

    /// The ring itself, for the chain that issues its read-aheads.
    #[inline(always)]
    pub(crate) fn host(&self) -> &RefCell<Option<RingHost<B>>> {
        &self.host
    }

    /// The records of compressed fills.
    #[inline(always)]
    pub(crate) fn zips(&self) -> &RefCell<ZipFills<B>> {
        &self.zips
    }
}
