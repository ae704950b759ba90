//! The disk a chain serves: its layers, how many of them it reads through, its virtual
//! size and the top image's persistent bitmaps; the one check of a guest range.
//!
//! Layer 0 is the image the guest sees; layer `i + 1` is the backing image of layer `i`
//! (qcow2 or raw). Backing devices are chosen by the host (named bdevs in SPDK, files the
//! operator allowed in the tool); the engine never opens anything by a name found in an image.

use crate::error::{Error, Result};
use crate::exec::DevId;
use crate::image::Qcow2;
use crate::io::BlockDevice;
use crate::limits::MAX_BACKING_DEPTH;
use crate::route::GuestRange;
use crate::types::GuestOffset;
use std::cell::Cell;
use std::sync::Arc;

/// One layer of a chain.
pub enum Layer<D: BlockDevice> {
    /// A qcow2 image.
    Qcow2(Box<Qcow2<D>>),
    /// A raw image: guest offset = device offset; its size is the device size.
    Raw {
        /// The device.
        dev: DevId,
        /// Virtual size (the device size).
        size: u64,
    },
}

impl<D: BlockDevice> Layer<D> {
    /// Virtual size of this layer.
    pub fn size(&self) -> u64 {
        match self {
            Layer::Qcow2(q) => q.size(),
            Layer::Raw { size, .. } => *size,
        }
    }

    /// The layer's device.
    pub fn dev(&self) -> DevId {
        match self {
            Layer::Qcow2(q) => q.dev(),
            Layer::Raw { dev, .. } => *dev,
        }
    }
}

/// A chain's layers and what the guest sees of them ([`Chain::disk`](crate::Chain::disk)).
pub struct Disk<D: BlockDevice> {
    layers: Vec<Layer<D>>,
    /// How many of `layers` the chain reads through: all of them, until a stream drops the
    /// backing reference ([`detach_backing`](Self::detach_backing)); then 1, and nothing
    /// below the top is read again (the devices stay until the chain goes, for requests
    /// already past them).
    depth: Cell<usize>,
    /// Virtual size of the top image: changes only by a resize (on the owner's chain, by
    /// [`Chain::resize`](crate::Chain::resize); on a core's, when a request past it finds a
    /// larger size published).
    size: Cell<u64>,
    /// The top image's persistent bitmaps, which every change of the disk marks
    /// ([`note_change`](Self::note_change)); a set that never records where the top layer
    /// has none (no `Option` tested on every write).
    dirty_bitmaps: Arc<crate::dirty_bitmaps::DirtyBitmaps>,
}

impl<D: BlockDevice> Disk<D> {
    /// The disk of `layers`, top first. Refuses none and more than [`MAX_BACKING_DEPTH`].
    pub(crate) fn new(layers: Vec<Layer<D>>) -> Result<Self> {
        if layers.is_empty() {
            return Err(Error::BackingChain(
                "a chain needs at least one image".into(),
            ));
        }
        if layers.len() > MAX_BACKING_DEPTH {
            return Err(Error::BackingChain(format!(
                "backing chain deeper than {MAX_BACKING_DEPTH} images"
            )));
        }
        let dirty_bitmaps = match &layers[0] {
            Layer::Qcow2(q) => q.dirty_bitmaps().cloned(),
            Layer::Raw { .. } => None,
        }
        .unwrap_or_else(|| Arc::new(crate::dirty_bitmaps::DirtyBitmaps::never_recording()));
        Ok(Disk {
            size: Cell::new(layers[0].size()),
            depth: Cell::new(layers.len()),
            layers,
            dirty_bitmaps,
        })
    }

    /// The layers the chain reads through, top first.
    #[inline(always)]
    pub fn layers(&self) -> &[Layer<D>] {
        &self.layers[..self.depth.get()]
    }

    /// Layer `idx` whatever the depth: a request resolved before the backing layers were
    /// detached still reads them.
    #[inline(always)]
    pub(crate) fn layer(&self, idx: usize) -> Option<&Layer<D>> {
        self.layers.get(idx)
    }

    /// Whether a read in layer `idx` goes on to the layer below (else: zeros).
    #[inline(always)]
    pub(crate) fn reads_below(&self, idx: usize) -> bool {
        idx + 1 < self.depth.get()
    }

    /// The top image, when it is a qcow2 image: `layers[0]` whatever the depth (never 0),
    /// without the slice of [`layers`](Self::layers) (a request's route asks it first).
    #[inline(always)]
    pub(crate) fn top_qcow2(&self) -> Option<&Qcow2<D>> {
        match self.layers.first() {
            Some(Layer::Qcow2(q)) => Some(q),
            _ => None,
        }
    }

    /// Stops reading through the backing layers: the top image no longer names a backing
    /// file (a stream dropped it, ARCHITECTURE.md §13), or every cluster a backing layer
    /// could show is in the top image. Requests resolved from now on never reach a backing
    /// device; the devices themselves stay with the chain.
    pub fn detach_backing(&self) {
        self.depth.set(1);
    }

    /// Virtual size of the top image.
    #[inline(always)]
    pub fn size(&self) -> u64 {
        self.size.get()
    }

    /// Takes `size` as the top image's virtual size (after a resize).
    pub(crate) fn set_size(&self, size: u64) {
        self.size.set(size);
    }

    /// Whether a persistent bitmap records the writes ([`note_change`](Self::note_change)
    /// has work to do).
    #[inline(always)]
    pub(crate) fn marks_writes(&self) -> bool {
        self.dirty_bitmaps.recording()
    }

    /// [`check_range`](Self::check_range) against the size this chain holds, without its
    /// look at a size the owner published since (`None` for any range outside it).
    #[inline(always)]
    pub(crate) fn range_now(&self, offset: u64, len: u64) -> Option<GuestRange> {
        GuestRange::new(offset, len, self.size.get()).ok()
    }

    /// A write, write-zeroes or discard of `len` bytes at `offset` (inside the disk) is
    /// about to change it: the persistent bitmaps record it before it is submitted.
    #[inline(always)]
    pub(crate) fn note_change(&self, offset: u64, len: u64) {
        let b = &self.dirty_bitmaps;
        if b.recording() {
            b.mark(offset, len);
        }
    }

    /// The one check of a guest request's range: `len` bytes at `offset` are 512-byte
    /// aligned and inside the disk ([`Error::InvalidRequest`] otherwise). Every entry that
    /// takes a guest range asks it.
    #[inline(always)]
    pub fn check_range(&self, offset: u64, len: u64) -> Result<GuestRange> {
        match GuestRange::new(offset, len, self.size.get()) {
            Ok(r) => Ok(r),
            Err(e) => self.check_range_resized(offset, len, e),
        }
    }

    /// [`check_range`](Self::check_range) of a request that failed it: on a core of a
    /// shared image the owner may have grown the disk since, so the size it published is
    /// taken and the range checked again; otherwise `err`.
    #[cold]
    fn check_range_resized(&self, offset: u64, len: u64, err: Error) -> Result<GuestRange> {
        let Some(Layer::Qcow2(q)) = self.layers.first() else {
            return Err(err);
        };
        let published = q.shared().map_or(0, |s| s.virtual_size());
        if published == 0 || published == self.size.get() {
            return Err(err);
        }
        q.adopt_size(published);
        self.size.set(q.size());
        GuestRange::new(offset, len, self.size.get())
    }

    /// Where the top image's cached L2 entry for `offset` lies in memory (see
    /// [`Qcow2::entry_hint`]): for the host to prefetch before it plans the request.
    pub fn entry_hint(&self, offset: u64) -> Option<*const u64> {
        self.top_qcow2()?.entry_hint(GuestOffset(offset))
    }

    /// On the metadata owner: where its dirty copy of the L2 entry for `offset` lies, if
    /// the slice is dirty (see [`Qcow2::dirty_entry_hint`]); the slow write path reads it.
    pub fn dirty_entry_hint(&self, offset: u64) -> Option<*const u64> {
        self.top_qcow2()?.dirty_entry_hint(GuestOffset(offset))
    }
}
