//! A golden image's device as one core sees it through the shared read cache: reads are
//! served from the cache where it holds their granules, fill it where nobody does, and
//! wait where another core (or read) is filling; every other operation, and every read
//! without a cache, goes straight to the device. Where the host lends it a buffer over a
//! slot's memory ([`InPlace`]), a fill reads the granule straight into the slot.

use super::cache::{Fill, Lookup, SharedReadCache};
use super::lent::LentGranule;
use crate::io::{BlockDevice, BufSlice, Busy, DeviceError, DeviceOp, IoBuffer};
use std::collections::VecDeque;
use std::sync::Arc;

/// Tags of this wrapper's own fills on the device (the engine's tags are slab indexes,
/// far below).
const FILL_TAG: u64 = 1 << 63;

/// Whether `tag`, completed by the device under a [`CachedDevice`], is one of the
/// wrapper's own fills: a host that takes the device's completions before
/// [`poll`](BlockDevice::poll) (SPDK's completion callback) leaves these to it.
#[inline(always)]
pub fn is_fill_tag(tag: u64) -> bool {
    tag & FILL_TAG != 0
}

/// A device, optionally reading through a [`SharedReadCache`].
pub struct CachedDevice<D: BlockDevice> {
    inner: D,
    cache: Option<Arc<SharedReadCache>>,
    /// Reads waiting for granules to be filled (here or on another core).
    waiting: Vec<Waiting<D::Buf>>,
    /// This core's fills in flight (granule, buffer), by the low bits of their tag.
    fills: slab::Slab<(u64, Pending<D::Buf>)>,
    /// How the host reads fills into slots in place, if it can.
    in_place: Option<InPlace<D>>,
    /// Fills the device refused as busy, to submit again.
    unsent: VecDeque<(u64, DeviceOp<D::Buf>)>,
    /// Granules whose fill failed here since the last poll: reads waiting for them go to
    /// the device themselves.
    failed: Vec<u64>,
    /// Completions of reads served here, reported at the next poll.
    done: VecDeque<(u64, Result<(), DeviceError>)>,
    /// Any of `fills`, `unsent`, `waiting`, `done` may be non-empty: set wherever they
    /// grow outside a poll, recomputed at the end of each poll. The executor asks
    /// [`has_own_work`](BlockDevice::has_own_work) after every completion; a lone
    /// overlay's device answers it with this one load.
    queued: bool,
}

/// How a host reads a fill straight into a slot's memory: a buffer of its device over a
/// [`LentGranule`], and the loan back out of that buffer once the device completed it.
pub struct InPlace<D: BlockDevice> {
    /// A buffer over the lent memory (`Err`: the device cannot read into it, e.g. it is
    /// not aligned or not DMA memory; the fill reads into a buffer of its own).
    pub lend: fn(&D, LentGranule) -> Result<D::Buf, LentGranule>,
    /// The loan back from the buffer (`None`: another handle of it is still about; the
    /// loan is dropped with the last one and the slot is empty again).
    pub take_back: fn(D::Buf) -> Option<LentGranule>,
}

/// A fill in flight: into a buffer of its own (stored at completion), or in place.
enum Pending<B> {
    Copy(Fill, B),
    InPlace(B),
}

struct Waiting<B> {
    tag: u64,
    offset: u64,
    buf: BufSlice<B>,
}

/// What serving a read from the cache came to.
enum Served {
    /// Every byte copied.
    All,
    /// Some granules are being filled (by this read's fills or others').
    Pending,
    /// The cache cannot take it: read the device.
    Bypass,
}

impl<D: BlockDevice> CachedDevice<D> {
    /// `inner` without a cache: every operation goes straight to it.
    pub fn plain(inner: D) -> CachedDevice<D> {
        CachedDevice::new(inner, None)
    }

    /// `inner`, its reads served through `cache` (shared with every other reader of the
    /// same golden image) while two readers or more hold it as
    /// [`Sharer`](super::Sharer)s.
    pub fn new(inner: D, cache: Option<Arc<SharedReadCache>>) -> CachedDevice<D> {
        CachedDevice {
            inner,
            cache,
            waiting: Vec::new(),
            fills: slab::Slab::new(),
            in_place: None,
            unsent: VecDeque::new(),
            failed: Vec::new(),
            done: VecDeque::new(),
            queued: false,
        }
    }

    /// Fills read into the slots in place where `in_place` lends a buffer over them.
    pub fn with_in_place(mut self, in_place: InPlace<D>) -> CachedDevice<D> {
        self.in_place = Some(in_place);
        self
    }

    /// The device.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// The device, to change.
    pub fn inner_mut(&mut self) -> &mut D {
        &mut self.inner
    }

    /// The cache its reads go through, if any.
    pub fn cache(&self) -> Option<&Arc<SharedReadCache>> {
        self.cache.as_ref()
    }

    /// Reads go through `cache` from now on (`None`: straight to the device): the golden
    /// bdev left, or came back as another bdev (another cache). Reads waiting for granules
    /// of the old cache go to the device; this core's fills in flight still publish into
    /// the old cache what the old bdev held.
    pub fn set_cache(&mut self, cache: Option<Arc<SharedReadCache>>) {
        for w in std::mem::take(&mut self.waiting) {
            self.bypass(w.tag, w.offset, w.buf);
        }
        self.failed.clear();
        self.cache = cache;
    }

    /// Copies what the cache holds of a read into its buffer and starts fills for what it
    /// does not.
    fn serve(&mut self, offset: u64, buf: &BufSlice<D::Buf>) -> Served {
        let Some(cache) = self.cache.clone() else {
            return Served::Bypass;
        };
        let g = u64::from(cache.granule());
        let end = offset + buf.len as u64;
        let mut pending = false;
        let mut pos = offset;
        while pos < end {
            let granule = pos / g;
            let within = pos % g;
            let n = (g - within).min(end - pos);
            if self.failed.contains(&granule) {
                return Served::Bypass;
            }
            match cache.pin(granule) {
                // One copy, straight into the request's memory where the host lends it.
                Lookup::Hit(pin) => {
                    buf.with_bytes_mut((pos - offset) as usize, n as usize, &mut |dst| {
                        pin.copy_out(within as usize, dst)
                    })
                }
                Lookup::Filling => pending = true,
                Lookup::Miss => match cache.claim(granule) {
                    Some(fill) => {
                        self.start_fill(fill);
                        pending = true;
                    }
                    // Filled meanwhile, or being filled: look again at the next poll.
                    None if matches!(cache.pin(granule), Lookup::Hit(_) | Lookup::Filling) => {
                        pending = true
                    }
                    None => return Served::Bypass,
                },
            }
            pos += n;
        }
        match pending {
            true => Served::Pending,
            false => Served::All,
        }
    }

    fn start_fill(&mut self, fill: Fill) {
        let (granule, (offset, len)) = (fill.granule(), fill.device_range());
        let lent = match &self.in_place {
            Some(p) => (p.lend)(&self.inner, fill.lend()).map_err(LentGranule::into_fill),
            None => Err(fill),
        };
        let (buf, pending) = match lent {
            Ok(buf) => (buf.clone(), Pending::InPlace(buf)),
            Err(fill) => {
                let buf = self.inner.alloc_buf(len);
                (buf.clone(), Pending::Copy(fill, buf))
            }
        };
        let op = DeviceOp::Read {
            offset,
            buf: BufSlice::whole(buf),
        };
        let tag = FILL_TAG | self.fills.insert((granule, pending)) as u64;
        self.submit_fill(tag, op);
    }

    fn submit_fill(&mut self, tag: u64, op: DeviceOp<D::Buf>) {
        if !self.unsent.is_empty() {
            return self.unsent.push_back((tag, op));
        }
        if let Err(Busy(op, tag)) = self.inner.submit(op, tag) {
            self.unsent.push_back((tag, op));
        }
    }

    fn fill_done(&mut self, tag: u64, res: Result<(), DeviceError>) {
        let key = (tag & !FILL_TAG) as usize;
        let Some((granule, pending)) = self.fills.try_remove(key) else {
            return;
        };
        match (res, pending) {
            (Ok(()), Pending::Copy(fill, buf)) => {
                let mut fill = Some(fill);
                buf.with_bytes_mut(0, buf.len(), &mut |bytes| {
                    if let Some(f) = fill.take() {
                        f.publish(bytes)
                    }
                });
            }
            (Ok(()), Pending::InPlace(buf)) => {
                let take_back = self.in_place.as_ref().map(|p| p.take_back);
                match take_back.and_then(|t| t(buf)) {
                    // The device wrote every byte and holds the buffer no more.
                    Some(lent) => lent.publish(),
                    None => self.failed.push(granule),
                }
            }
            // Dropped: the slot is empty again (an in-place loan with its buffer's last
            // handle); the reads that waited here read the device.
            (Err(_), _) => self.failed.push(granule),
        }
    }

    /// Serves the waiting reads that can be served now.
    fn retry_waiting(&mut self) {
        let mut i = 0;
        while i < self.waiting.len() {
            let (offset, buf) = (self.waiting[i].offset, self.waiting[i].buf.clone());
            match self.serve(offset, &buf) {
                Served::All => {
                    let w = self.waiting.swap_remove(i);
                    self.done.push_back((w.tag, Ok(())));
                }
                Served::Pending => i += 1,
                Served::Bypass => {
                    let w = self.waiting.swap_remove(i);
                    self.bypass(w.tag, w.offset, w.buf);
                }
            }
        }
        self.failed.clear();
    }

    /// A read while the cache is shared: served from it, waiting for its fills, or past
    /// it; every other operation goes to the device.
    #[inline(never)]
    fn submit_shared(&mut self, op: DeviceOp<D::Buf>, tag: u64) -> Result<(), Busy<D::Buf>> {
        self.queued = true;
        let DeviceOp::Read { offset, buf } = op else {
            return self.inner.submit(op, tag);
        };
        if buf.len == 0 {
            return self.inner.submit(DeviceOp::Read { offset, buf }, tag);
        }
        match self.serve(offset, &buf) {
            Served::All => self.done.push_back((tag, Ok(()))),
            Served::Pending => {
                if let Some(c) = &self.cache {
                    c.count_wait();
                }
                self.waiting.push(Waiting { tag, offset, buf })
            }
            Served::Bypass => {
                if let Some(c) = &self.cache {
                    c.count_bypass();
                }
                return self.inner.submit(DeviceOp::Read { offset, buf }, tag);
            }
        }
        Ok(())
    }

    fn bypass(&mut self, tag: u64, offset: u64, buf: BufSlice<D::Buf>) {
        self.queued = true;
        if let Some(c) = &self.cache {
            c.count_bypass();
        }
        if let Err(Busy(op, tag)) = self.inner.submit(DeviceOp::Read { offset, buf }, tag) {
            // Sent again with this core's fills (the device keeps their order).
            self.unsent.push_back((tag, op));
        }
    }

    /// [`BlockDevice::poll`] while the cache has work here: fills to send again or
    /// completing, reads waiting for granules or served.
    #[inline(never)]
    fn poll_queued(&mut self, done: &mut dyn FnMut(u64, Result<(), DeviceError>)) -> usize {
        while let Some((tag, op)) = self.unsent.pop_front() {
            if let Err(Busy(op, tag)) = self.inner.submit(op, tag) {
                self.unsent.push_front((tag, op));
                break;
            }
        }
        let mut mine = Vec::new();
        let mut n = self.inner.poll(&mut |tag, res| {
            if tag & FILL_TAG != 0 {
                mine.push((tag, res));
            } else {
                done(tag, res);
            }
        });
        for (tag, res) in mine {
            self.fill_done(tag, res);
            n += 1;
        }
        if !self.waiting.is_empty() {
            self.retry_waiting();
        }
        while let Some((tag, res)) = self.done.pop_front() {
            done(tag, res);
            n += 1;
        }
        self.queued = !(self.fills.is_empty()
            && self.unsent.is_empty()
            && self.waiting.is_empty()
            && self.done.is_empty());
        n
    }
}

impl<D: BlockDevice> BlockDevice for CachedDevice<D> {
    type Buf = D::Buf;

    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn alloc_buf(&mut self, len: usize) -> D::Buf {
        self.inner.alloc_buf(len)
    }

    #[inline(always)]
    fn submit(&mut self, op: DeviceOp<D::Buf>, tag: u64) -> Result<(), Busy<D::Buf>> {
        // Unshared (a lone overlay, a base bdev): the operation goes to the device as it
        // came, unmoved, at the cost of one load (PERFORMANCE.md §13).
        if self.cache.as_ref().is_some_and(|c| c.is_shared()) {
            return self.submit_shared(op, tag);
        }
        self.inner.submit(op, tag)
    }

    /// Inline: with nothing of the cache's in flight or waiting (`queued` clear: always so
    /// for a device without a cache or a lone reader of one), no fill can complete, and the
    /// poll is the device's own; the executor makes it on every pass while a request is out.
    #[inline]
    fn poll(&mut self, done: &mut dyn FnMut(u64, Result<(), DeviceError>)) -> usize {
        if !self.queued {
            return self.inner.poll(done);
        }
        self.poll_queued(done)
    }

    fn completes_only_submitted(&self) -> bool {
        // With a cache, its fills need polls with nothing of the executor's outstanding.
        self.cache.is_none() && self.inner.completes_only_submitted()
    }

    fn take_delivered(&mut self) -> u32 {
        self.inner.take_delivered()
    }

    fn may_have_own_work(&self) -> bool {
        self.cache.is_some() || self.inner.may_have_own_work()
    }

    #[inline]
    fn has_own_work(&self) -> bool {
        self.queued || self.inner.has_own_work()
    }

    #[inline]
    fn completions_announced(&self) -> bool {
        !self.queued && self.inner.completions_announced()
    }

    fn can_grow(&self) -> bool {
        self.inner.can_grow()
    }

    fn zeroes_cheaply(&self) -> bool {
        self.inner.zeroes_cheaply()
    }

    fn discards(&self) -> bool {
        self.inner.discards()
    }

    fn discard_zeroes(&self) -> bool {
        self.inner.discard_zeroes()
    }

    fn ensure_size(&mut self, size: u64) -> Result<(), DeviceError> {
        self.inner.ensure_size(size)
    }
}
