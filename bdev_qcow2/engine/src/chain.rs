//! A backing chain served on one core, composed of parts that each own their state and
//! its operations — the disk (`disk.rs`: layers, depth, size, bitmaps, the range check),
//! the request counters (`counters.rs`), read-ahead of L2 slices
//! ([`ReadAhead`](crate::prefetch::ReadAhead)), the prefetch ring
//! ([`ChainRing`](crate::ring::ChainRing)) — and the guest read path over the layers
//! (here). [`Chain::plan`] (`plan.rs`) decides each guest request through them.

use crate::error::{Error, Result};
use crate::exec::{join_all, DevId, Exec, GraceEntry};
use crate::format::ClusterMapping;
use crate::image::Qcow2;
use crate::io::{BlockDevice, BufSlice, DeviceOp, SECTOR};
use crate::limits::MAX_BACKING_DEPTH;
use crate::route::Role;
use crate::types::GuestOffset;
use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;

mod below;
mod counters;
mod disk;
mod index;
mod loads;
mod ring;
mod zip;

pub use counters::{Counters, ReadStats, RequestStats};
pub use disk::{Disk, Layer};

pub(crate) use crate::ring::compressed::ZipPart;

/// A read planned from cached metadata ([`Chain::plan_fast`]): the chain's reused scratch,
/// cleared for each plan, so that planning allocates nothing once the lists have grown.
pub(crate) struct FastPlan {
    /// Data runs, one device read each.
    pub(crate) runs: Vec<Run>,
    /// Ranges of the guest buffer that read as zeros: (offset, length).
    pub(crate) zeros: Vec<(usize, usize)>,
    /// Compressed parts, for a ring fill to read and decompress (`ring/compressed.rs`).
    pub(crate) zips: Vec<ZipPart>,
}

impl FastPlan {
    /// Empty lists with room for a typical request.
    fn new() -> Self {
        FastPlan {
            runs: Vec::with_capacity(64),
            zeros: Vec::with_capacity(64),
            zips: Vec::new(),
        }
    }

    /// Empties it for a new plan; `zips`: the compressed parts too (only a plan that may
    /// hold them has any).
    #[inline(always)]
    fn clear(&mut self, zips: bool) {
        self.runs.clear();
        self.zeros.clear();
        if zips {
            self.zips.clear();
        }
    }

    /// Adds data run `r`, extending the last run when `r` continues it on the same device.
    #[inline(always)]
    fn push_run(&mut self, r: Run) {
        match self.runs.last_mut() {
            Some(l)
                if l.dev == r.dev
                    && l.host + l.len as u64 == r.host
                    && l.buf_off + l.len == r.buf_off =>
            {
                l.len += r.len
            }
            _ => self.runs.push(r),
        }
    }

    /// Adds `len` bytes of zeros at `buf_off` of the guest buffer.
    #[inline(always)]
    fn push_zeros(&mut self, buf_off: usize, len: usize) {
        self.zeros.push((buf_off, len));
    }
}

type BoxFut = Pin<Box<dyn Future<Output = Result<()>>>>;

/// Why the fast path could not plan a read ([`Chain::plan_layer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unplanned {
    /// The slice of layer `layer` covering guest offset `offset` is not cached.
    Slice {
        /// The layer (below [`MAX_BACKING_DEPTH`]; two bytes keep the result in two
        /// registers on the guest's fast path).
        layer: u16,
        /// A guest offset in the slice.
        offset: u64,
    },
    /// A compressed cluster (the fast path reads none; a ring fill may, see
    /// `ring/compressed.rs`).
    Compressed,
    /// Every record that fills a ring chunk holding compressed clusters is busy: the
    /// one whose end (its internal payload) frees one first.
    Busy(u32),
    /// Anything else: an invalid entry, compressed bytes no record can take.
    Other,
}

const _: () = assert!(MAX_BACKING_DEPTH <= u16::MAX as usize);

/// A data run planned by the fast path: device, host offset, offset in the guest buffer,
/// length.
#[derive(Clone, Copy)]
pub(crate) struct Run {
    pub(crate) dev: DevId,
    pub(crate) host: u64,
    pub(crate) buf_off: usize,
    pub(crate) len: usize,
}

/// An image and its backing chain, served on one core: a small struct of parts.
///
/// `repr(C)`: the parts every request reads come first, together.
#[repr(C)]
pub struct Chain<D: BlockDevice> {
    exec: Exec<D>,
    /// The executor's grace counters, for this chain's entries ([`GraceLane`](crate::exec::GraceLane)).
    grace: crate::exec::GraceLane,
    /// The layers and what the guest sees of them.
    pub(crate) disk: Disk<D>,
    /// Where this chain's requests that change metadata run ([`Chain::plan`]).
    pub(crate) role: Role,
    /// The top image's memo as the plan asks it (one that answers nothing over a raw top
    /// layer: no `Option` tested on every request).
    pub(crate) memo: crate::memo::MemoView,
    /// Request counters: plain cells, bumped on every request.
    pub(crate) counters: Counters,
    /// Read-ahead of L2 slices: its stream detector and counters.
    pub(crate) readahead: crate::prefetch::ReadAhead,
    /// The prefetch ring, its stream table and its compressed fills.
    pub(crate) ring: crate::ring::ChainRing<D::Buf>,
    /// Reused plan storage of the fast path (no allocation per request).
    scratch: RefCell<FastPlan>,
    /// Which backing layer holds each part of the disk, learnt as reads walk a deep chain
    /// (`chain/index.rs`); `None` for a chain of one or two layers.
    index: Option<index::LayerIndex>,
    /// Where the executor reports the ends of this chain's own requests (ring read-aheads,
    /// slice loads): added when first needed, removed with the chain.
    pub(crate) sink: std::cell::OnceCell<crate::exec::OwnedSink<D>>,
    /// Slices loaded without a task ([`Chain::load_slice_ahead`]).
    pub(crate) loads: RefCell<crate::slice_load::SliceLoads<D::Buf>>,
    /// Owner: first writes planned for cores that write their data themselves.
    pub(crate) reservations: crate::write::tickets::Reservations,
}

impl<D: BlockDevice> Chain<D> {
    /// Builds a chain from its layers, top first. Refuses more than
    /// [`MAX_BACKING_DEPTH`](crate::limits::MAX_BACKING_DEPTH) layers.
    pub fn new(exec: &Exec<D>, layers: Vec<Layer<D>>) -> Result<Rc<Self>> {
        let disk = Disk::new(layers)?;
        let top = &disk.layers()[0];
        let coverage = match top {
            Layer::Qcow2(q) => Some(q.geometry().slice_coverage()),
            Layer::Raw { .. } => None,
        };
        let role = match top {
            Layer::Raw { .. } => Role::Owner,
            Layer::Qcow2(q) => q.plan_role(),
        };
        let index = index::LayerIndex::new(disk.layers(), disk.size());
        let readahead = crate::prefetch::ReadAhead::new(coverage);
        let memo = match top {
            Layer::Qcow2(q) => q.memo_view(readahead.tail_from()),
            Layer::Raw { .. } => crate::memo::MemoView::answering_nothing(),
        };
        Ok(Rc::new(Chain {
            grace: exec.grace_lane(),
            index,
            role,
            memo,
            readahead,
            exec: exec.clone(),
            disk,
            scratch: RefCell::new(FastPlan::new()),
            counters: Counters::default(),
            ring: Default::default(),
            sink: std::cell::OnceCell::new(),
            loads: RefCell::default(),
            reservations: Default::default(),
        }))
    }

    /// The disk: layers, depth, size, bitmaps, the range check.
    #[inline(always)]
    pub fn disk(&self) -> &Disk<D> {
        &self.disk
    }

    /// The layers the chain reads through, top first ([`Disk::layers`]).
    #[inline(always)]
    pub fn layers(&self) -> &[Layer<D>] {
        self.disk.layers()
    }

    /// Virtual size of the top image ([`Disk::size`]).
    #[inline(always)]
    pub fn size(&self) -> u64 {
        self.disk.size()
    }

    /// Bytes the layer index of a deep chain holds so far (`chain/index.rs`): 2 per unit
    /// read through the backing layers, in chunks of 32 KiB; 0 for a chain of one or two
    /// images.
    pub fn layer_index_bytes(&self) -> usize {
        self.index.as_ref().map_or(0, |ix| ix.bytes())
    }

    /// The executor.
    pub fn exec(&self) -> &Exec<D> {
        &self.exec
    }

    /// A guest request of this chain starts: its grace entry, through the chain's lane
    /// ([`Exec::guest_enter`]).
    #[inline(always)]
    pub(crate) fn guest_enter(&self) -> crate::GraceEntry {
        self.exec.guest_enter_on(&self.grace)
    }

    /// [`Exec::guest_enter_light`] through the chain's lane.
    #[inline(always)]
    pub(crate) fn guest_enter_light(&self) -> Option<crate::GraceEntry> {
        self.exec.guest_enter_light_on(&self.grace)
    }

    /// The chain's request counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Starts a guest read of `buf.len` bytes at `offset`; its completion is reported with
    /// `tag` by [`Exec::poll`]. Offset and length must be multiples of 512 and inside the
    /// disk (otherwise the request completes with [`Error::InvalidRequest`]).
    ///
    /// When every L2 slice involved is cached and the range holds only data clusters and
    /// zeros, the device reads are submitted directly (no task, no allocation); otherwise a
    /// slow-path task does the work.
    pub(crate) fn submit_read(self: &Rc<Self>, tag: u64, offset: u64, buf: BufSlice<D::Buf>) {
        if let Err(e) = self.disk.check_range(offset, buf.len as u64) {
            return self.exec.complete(tag, Err(e));
        }
        // Before resolving anything: a cluster freed meanwhile is not reused until this
        // request is over (shared images; see `coherency::Grace`).
        let entry = self.guest_enter();
        let Err(entry) = self.try_fast_read(tag, offset, &buf, entry) else {
            self.counters.fast_read();
            return;
        };
        self.counters.slow_read();
        let chain = self.clone();
        self.exec.spawn(async move {
            let r = read_layer(chain.clone(), 0, offset, buf).await;
            chain.exec.complete_entered(tag, r, entry);
        });
    }

    /// Overwrites this core replica routed in place through a copy of their slice taken
    /// before the owner's latest changes to it, which only added mappings (ARCHITECTURE.md
    /// §6): what a core keeps instead of sending to the owner while the slice is dirty.
    pub fn kept_overwrites(&self) -> u64 {
        let memo = match self.layers().first() {
            Some(Layer::Qcow2(q)) => q.memo_kept_overwrites(),
            _ => 0,
        };
        self.counters.kept_overwrites() + memo
    }

    /// The fast path: plans the request from cached slices only; hands `entry` back
    /// (having changed nothing but LRU/hit counters) when a slow path is needed.
    fn try_fast_read(
        &self,
        tag: u64,
        offset: u64,
        buf: &BufSlice<D::Buf>,
        entry: GraceEntry,
    ) -> Result<(), GraceEntry> {
        self.try_fast_read_as(tag, offset, buf, entry, false)
            .map_err(|(_, entry)| entry)
    }

    /// [`try_fast_read`](Self::try_fast_read) of a guest request (`internal` false) or of
    /// the engine's own (a read-ahead into the ring: its end goes to the executor's
    /// internal sink under token `tag`). Nothing submitted when it fails: why it did, and
    /// `entry` back.
    pub(crate) fn try_fast_read_as(
        &self,
        tag: u64,
        offset: u64,
        buf: &BufSlice<D::Buf>,
        entry: GraceEntry,
        internal: bool,
    ) -> Result<(), (Unplanned, GraceEntry)> {
        let plan = match self.plan_fast::<false>(offset, buf) {
            Ok(plan) => plan,
            Err(e) => return Err((e, entry)),
        };
        let runs = &plan.runs;
        if let [r] = runs.as_slice() {
            self.exec.request_single_as(
                tag,
                entry,
                internal,
                r.dev,
                DeviceOp::Read {
                    offset: r.host,
                    buf: buf.sub(r.buf_off, r.len),
                },
            );
            return Ok(());
        }
        let req = self.exec.request_begin_as(tag, entry, internal);
        for r in runs.iter() {
            self.exec.request_op(
                req,
                r.dev,
                DeviceOp::Read {
                    offset: r.host,
                    buf: buf.sub(r.buf_off, r.len),
                },
            );
        }
        self.exec.request_arm(req);
        Ok(())
    }

    /// Plans `buf.len` bytes at `offset` from cached metadata into the chain's plan, as the
    /// fast path reads them, with `ZIP` compressed clusters included (in the plan's `zips`,
    /// for a ring fill to read and decompress: `ring/compressed.rs`); the zeros are
    /// written into `buf` already. Nothing submitted.
    #[inline(always)]
    pub(crate) fn plan_fast<const ZIP: bool>(
        &self,
        offset: u64,
        buf: &BufSlice<D::Buf>,
    ) -> Result<std::cell::RefMut<'_, FastPlan>, Unplanned> {
        let mut scratch = self.scratch.borrow_mut();
        scratch.clear(ZIP);
        self.plan_layer::<ZIP>(0, offset, buf.len, 0, &mut scratch)?;
        for &(o, n) in scratch.zeros.iter() {
            buf.sub(o, n).zero();
        }
        Ok(scratch)
    }

    /// Plans, from cached metadata, `len` bytes at `offset` of layer `idx` into the buffer
    /// at `buf_off`, into `plan`, as `read_layer` reads them: past the layer's end zeros,
    /// data runs on its device, zeros, unallocated clusters from the layer below (or zeros
    /// at the bottom), and with `ZIP` compressed clusters (without, they fail it).
    /// Fails, nothing planned that counts, when a slice is not cached, a cluster is
    /// compressed (without `ZIP`). From the top
    /// layer (guest reads and read-aheads alike) this follows the mapping down the chain:
    /// the top slice was current under its epoch, so no write to its unallocated clusters
    /// completed before the read, and backing layers never change (a stream detaches them
    /// first).
    fn plan_layer<const ZIP: bool>(
        &self,
        idx: usize,
        offset: u64,
        len: usize,
        buf_off: usize,
        plan: &mut FastPlan,
    ) -> Result<(), Unplanned> {
        let Some(layer) = self.disk.layer(idx) else {
            return Err(Unplanned::Other);
        };
        let inside = (offset + len as u64)
            .min(layer.size())
            .saturating_sub(offset) as usize;
        if inside < len {
            plan.push_zeros(buf_off + inside, len - inside);
        }
        if inside == 0 {
            return Ok(());
        }
        let q = match layer {
            Layer::Raw { dev, .. } => {
                // Device I/O stays sector aligned: a layer (a raw file) ending inside a
                // sector has that sector read whole, the device reading zeros past its
                // end, as `read_layer` reads it.
                let whole = (inside as u64).next_multiple_of(SECTOR) as usize;
                plan.push_run(Run {
                    dev: *dev,
                    host: offset,
                    buf_off,
                    len: whole.min(len),
                });
                return Ok(());
            }
            Layer::Qcow2(q) => q,
        };
        let end = offset + inside as u64;
        let mut pos = offset;
        while pos < end {
            let (m, m_end) = match q.resolve_cached(GuestOffset(pos)) {
                Ok(Some(hit)) => hit,
                Ok(None) => {
                    return Err(Unplanned::Slice {
                        layer: idx as u16,
                        offset: pos,
                    })
                }
                Err(_) => return Err(Unplanned::Other),
            };
            let n = (m_end.min(end) - pos) as usize;
            let at = buf_off + (pos - offset) as usize;
            match m {
                ClusterMapping::Data { host, .. } => {
                    let host = host.0 + (pos & (q.geometry().subcluster_size() - 1));
                    plan.push_run(Run {
                        dev: q.data_dev(),
                        host,
                        buf_off: at,
                        len: n,
                    });
                }
                ClusterMapping::Zero { .. } => plan.push_zeros(at, n),
                ClusterMapping::Unallocated { .. } if self.disk.reads_below(idx) => {
                    match &self.index {
                        Some(ix) if idx == 0 => self.plan_below::<ZIP>(ix, pos, n, at, plan)?,
                        _ => self.plan_layer::<ZIP>(idx + 1, pos, n, at, plan)?,
                    }
                }
                ClusterMapping::Unallocated { .. } => plan.push_zeros(at, n),
                ClusterMapping::Compressed(desc) if ZIP => plan.zips.push(ZipPart {
                    layer: idx as u16,
                    desc,
                    in_cluster: (pos & (q.geometry().cluster_size() - 1)) as usize,
                    buf_off: at,
                    len: n,
                }),
                ClusterMapping::Compressed(_) => return Err(Unplanned::Compressed),
            }
            pos += n as u64;
        }
        Ok(())
    }

    /// Reads `buf.len` bytes at `offset` and waits for them (for tasks and tools).
    pub async fn read(self: &Rc<Self>, offset: u64, buf: BufSlice<D::Buf>) -> Result<()> {
        self.disk.check_range(offset, buf.len as u64)?;
        read_layer(self.clone(), 0, offset, buf).await
    }

    /// Allocation status of guest bytes at `offset` in layer `layer` alone: the mapping of
    /// the first (sub)cluster and how many bytes from `offset` (up to `end`) share it.
    /// Raw layers report data at the same offset.
    pub async fn block_status(
        &self,
        layer: usize,
        offset: u64,
        end: u64,
    ) -> Result<(ClusterMapping, u64)> {
        match &self.layers()[layer] {
            Layer::Qcow2(q) => q.extent(offset, end).await,
            Layer::Raw { .. } => Ok((
                ClusterMapping::Data {
                    host: crate::types::HostOffset(offset),
                    copied: true,
                },
                end - offset,
            )),
        }
    }
}

/// Reads `buf.len` bytes at `offset` from layer `idx` downwards.
pub(crate) fn read_layer<D: BlockDevice>(
    chain: Rc<Chain<D>>,
    idx: usize,
    offset: u64,
    buf: BufSlice<D::Buf>,
) -> BoxFut {
    Box::pin(async move {
        let len = buf.len as u64;
        let Some(layer) = chain.disk.layer(idx) else {
            return Err(Error::BackingChain("no such layer".into()));
        };
        let size = layer.size();
        // Past the end of a (backing) layer the disk reads as zeros.
        if offset >= size {
            buf.zero();
            return Ok(());
        }
        if offset + len > size {
            let inside = (size - offset) as usize;
            buf.sub(inside, buf.len - inside).zero();
        }
        let avail = (len.min(size - offset)) as usize;
        match layer {
            Layer::Raw { dev, .. } => {
                // Keep device I/O sector aligned; a partial last sector reads zeros past EOF.
                let n = (avail as u64).div_ceil(SECTOR) as usize * SECTOR as usize;
                let n = n.min(buf.len);
                chain.exec.read(*dev, offset, buf.sub(0, n)).await
            }
            Layer::Qcow2(q) => read_qcow2(&chain, idx, q, offset, buf.sub(0, avail)).await,
        }
    })
}

async fn read_qcow2<D: BlockDevice>(
    chain: &Rc<Chain<D>>,
    idx: usize,
    q: &Qcow2<D>,
    offset: u64,
    buf: BufSlice<D::Buf>,
) -> Result<()> {
    let end = offset + buf.len as u64;
    let mut futs: Vec<BoxFut> = Vec::new();
    let mut run: Option<(u64, u64, u64)> = None; // (host, guest, len)
    let flush = |run: &mut Option<(u64, u64, u64)>, futs: &mut Vec<BoxFut>| {
        if let Some((host, guest, len)) = run.take() {
            let sub = buf.sub((guest - offset) as usize, len as usize);
            futs.push(Box::pin(chain.exec.read(q.data_dev(), host, sub)));
        }
    };
    let mut pos = offset;
    while pos < end {
        let (m, n) = q.extent(pos, end).await?;
        match m {
            ClusterMapping::Data { host, .. } => {
                // `host` is the start of the (sub)cluster holding `pos`.
                let host = host.0 + (pos & (q.geometry().subcluster_size() - 1));
                match &mut run {
                    Some((h, g, l)) if *h + *l == host && *g + *l == pos => *l += n,
                    _ => {
                        flush(&mut run, &mut futs);
                        run = Some((host, pos, n));
                    }
                }
            }
            ClusterMapping::Zero { .. } => {
                flush(&mut run, &mut futs);
                buf.sub((pos - offset) as usize, n as usize).zero();
            }
            ClusterMapping::Unallocated { .. } => {
                flush(&mut run, &mut futs);
                let sub = buf.sub((pos - offset) as usize, n as usize);
                if chain.disk.reads_below(idx) && idx == 0 {
                    futs.push(below::read_below(chain.clone(), pos, sub));
                } else if chain.disk.reads_below(idx) {
                    futs.push(read_layer(chain.clone(), idx + 1, pos, sub));
                } else {
                    sub.zero();
                }
            }
            ClusterMapping::Compressed(d) => {
                flush(&mut run, &mut futs);
                let cs = q.geometry().cluster_size();
                let in_cluster = (pos & (cs - 1)) as usize;
                let sub = buf.sub((pos - offset) as usize, n as usize);
                let chain = chain.clone();
                futs.push(Box::pin(async move {
                    let Some(Layer::Qcow2(q)) = chain.disk.layer(idx) else {
                        return Ok(());
                    };
                    q.read_compressed_part(d, in_cluster, &sub).await
                }));
            }
        }
        pos += n;
    }
    flush(&mut run, &mut futs);
    join_all(futs).await
}
