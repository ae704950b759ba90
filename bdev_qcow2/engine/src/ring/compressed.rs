//! Ring read-aheads whose chunk holds compressed clusters, without a task. Per chain, a
//! few records, allocated the first time a chunk needs one, each with a buffer (DMA
//! memory on SPDK) for the compressed bytes of one chunk; and one decompressor state,
//! reset per cluster. A fill is one engine request (`Exec::request_begin_as` under the
//! chain's internal sink): the chunk's plain data straight into the ring slot, each
//! compressed cluster's covering sectors into the record's buffer (clusters written one
//! after the other, as `qemu-img convert -c` writes them, share one read). Its end comes
//! back to the chain (`chain/zip.rs`), which hands it to [`ZipFills::finish`]: that
//! decompresses each cluster from the record straight
//! into the slot (a part of a cluster: from the cluster the layer decompressed last, or
//! decoded into its place first, `LastCluster`; then its part copied in), then hands
//! the fill to `ring_filled`. A part of the cluster its layer decompressed last is copied
//! into the slot when the fill is issued, and reads nothing. With clusters larger than a
//! chunk, one big record (a cluster's bytes) takes the stream a record cannot: the first
//! chunk of such a cluster reads and decompresses it, the next chunks (waiting for the big
//! record meanwhile) take their parts of it. After that first use nothing on this path
//! allocates. A chunk no record can take (a stream longer than a cluster: a hostile
//! image) is left to the caller, which runs it as a task; a chunk that finds every record
//! it needs busy waits for the next to end, as a read-ahead waits for a slice load.

use super::CHUNK;
use crate::compress::Decompressor;
use crate::exec::DevId;
use crate::format::CompressedDescriptor;
use crate::image::Qcow2;
use crate::io::{BlockDevice, BufSlice, IoBuffer, SECTOR};

/// One device read of a compressed fill's payload ([`ZipFills::reads`]).
pub(crate) struct PayloadRead<B> {
    /// The device.
    pub(crate) dev: DevId,
    /// Its host offset there.
    pub(crate) host: u64,
    /// Where it goes in the record's buffer.
    pub(crate) dst: BufSlice<B>,
}

/// The bit of an internal token's payload that names a compressed fill's record (the
/// others: a ring slot, or a slice load's bit).
pub(crate) const ZIP_BIT: u32 = 1 << 30;
/// Records per chain: chunks holding compressed clusters in flight at once — a stream's
/// default window (1 MiB, eight chunks). With four, a 4 KiB QD1 reader over a 50 µs base
/// lost 4-9% to its chunks waiting for a record (`qcow2 perf`).
const RECORDS: usize = 8;
/// Bytes of a record's buffer: a chunk's compressed clusters are smaller than the chunk
/// (QEMU keeps a cluster compressed only if it shrinks), plus each one's sectors around.
const ZIP_BYTES: usize = CHUNK as usize + (64 << 10);
/// Compressed clusters one chunk holds at most (clusters of 512 bytes).
const MAX_PARTS: usize = (CHUNK / SECTOR) as usize;

/// A compressed cluster's part of a ring fill, as the chain's fast path plans it
/// (`Chain::plan_fast`): its layer and descriptor, where the part starts in the cluster,
/// where it goes in the buffer, and its length.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ZipPart {
    pub(crate) layer: u16,
    pub(crate) desc: CompressedDescriptor,
    pub(crate) in_cluster: usize,
    pub(crate) buf_off: usize,
    pub(crate) len: usize,
}

/// What the compressed fills need of a chain: the qcow2 image of each layer.
pub(crate) trait ZipLayers<D: BlockDevice> {
    /// The image of layer `layer`; `None` for a raw layer or past the chain.
    fn zip_layer(&self, layer: usize) -> Option<&Qcow2<D>>;
}

/// Why a fill was not issued ([`ZipFills::take`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ZipRefused {
    /// Every record it could take is busy: the one whose end (its payload) frees one first.
    Busy(u32),
    /// No record can take its compressed bytes (or a part's layer is not qcow2): a task
    /// must do it.
    Unfit,
}

/// One compressed cluster's part of a fill: its layer, where its compressed bytes start in
/// the record's buffer and how many, where the part starts in the cluster, where it goes in
/// the slot and how long it is.
#[derive(Clone, Copy)]
struct Part {
    layer: u16,
    /// Where its stream lies on the layer's device, and the layer's reuse generation when
    /// the fill was issued (the kept cluster's name, `LastCluster`).
    stream: u64,
    gen: u64,
    at: usize,
    len: usize,
    in_cluster: usize,
    dst_off: usize,
    n: usize,
}

/// A fill in flight.
struct Record<B> {
    busy: bool,
    slot: u16,
    /// The slot's bytes.
    dst: Option<BufSlice<B>>,
    buf: B,
    parts: Vec<Part>,
    /// Bytes of `buf`.
    bytes: usize,
}

/// A chain's compressed fills (see the module documentation).
pub(crate) struct ZipFills<B> {
    /// Allocated the first time a chunk holds a compressed cluster.
    recs: Vec<Record<B>>,
    /// The record taken after the last one taken: the first to end of those busy.
    next: usize,
    dec: Decompressor,
    /// A part's compressed bytes, copied out of the record's buffer.
    input: Vec<u8>,
    /// The reads of the fill being issued: device, host offset, offset in the record's
    /// buffer, length.
    reads: Vec<(DevId, u64, usize, usize)>,
}

impl<B> Default for ZipFills<B> {
    fn default() -> Self {
        ZipFills {
            recs: Vec::new(),
            next: 0,
            dec: Decompressor::default(),
            input: Vec::new(),
            reads: Vec::new(),
        }
    }
}

impl<B: IoBuffer> ZipFills<B> {
    /// Whether the records are allocated.
    pub(crate) fn has_records(&self) -> bool {
        !self.recs.is_empty()
    }

    /// Allocates the records (their buffers from `alloc`, given a length), the
    /// decompressor's buffers and the read list, once; with layers whose clusters
    /// (`cluster` bytes at most) are larger than a chunk, the big record too.
    pub(crate) fn allocate(&mut self, cluster: usize, alloc: impl Fn(usize) -> B) {
        // A cluster's stream is smaller than the cluster (QEMU keeps a cluster compressed
        // only if it shrinks), plus the sectors around it.
        let big = (cluster > CHUNK as usize).then_some(cluster + 2 * SECTOR as usize);
        let record = |bytes| Record {
            busy: false,
            slot: 0,
            dst: None,
            buf: alloc(bytes),
            parts: Vec::with_capacity(MAX_PARTS),
            bytes,
        };
        self.recs = (0..RECORDS).map(|_| record(ZIP_BYTES)).collect();
        self.recs.extend(big.map(record));
        self.input = vec![0; big.unwrap_or(0).max(ZIP_BYTES)];
        self.reads = Vec::with_capacity(MAX_PARTS);
    }

    /// Lays the compressed `parts` of a fill of ring slot `slot` into `dst` out in a free
    /// record's buffer and takes it; returns its payload, under which the fill's request
    /// (its data runs into `dst` and the record's [`reads`](Self::reads)) reports its end.
    /// A part of the cluster its layer decompressed last is copied into `dst` at once and
    /// reads nothing. Parts whose streams a record cannot take (clusters larger than a
    /// chunk, the first chunk of each) take the big record, one at a time: the chunks of
    /// the same cluster that wait for it then find that cluster decompressed.
    pub(crate) fn take<D: BlockDevice<Buf = B>>(
        &mut self,
        layers: &impl ZipLayers<D>,
        parts: &[ZipPart],
        slot: u16,
        dst: &BufSlice<B>,
    ) -> Result<u32, ZipRefused> {
        let ZipFills {
            recs, next, reads, ..
        } = self;
        let Some(i) = (0..RECORDS)
            .map(|k| (*next + k) % RECORDS)
            .find(|&i| recs.get(i).is_some_and(|r| !r.busy))
        else {
            return Err(ZipRefused::Busy(ZIP_BIT | *next as u32));
        };
        let i = match layout(layers, &mut recs[i], reads, parts, dst) {
            Ok(()) => i,
            Err(ZipRefused::Unfit) if recs.len() > RECORDS => {
                let big = &mut recs[RECORDS];
                if big.busy {
                    return Err(ZipRefused::Busy(ZIP_BIT | RECORDS as u32));
                }
                layout(layers, big, reads, parts, dst)?;
                RECORDS
            }
            Err(e) => return Err(e),
        };
        let rec = &mut recs[i];
        rec.busy = true;
        rec.slot = slot;
        rec.dst = Some(dst.clone());
        if i < RECORDS {
            *next = (i + 1) % RECORDS;
        }
        Ok(ZIP_BIT | i as u32)
    }

    /// The device reads of the fill [`take`](Self::take) just laid out under `payload`.
    pub(crate) fn reads(&self, payload: u32) -> impl Iterator<Item = PayloadRead<B>> + '_ {
        let buf = &self.recs[(payload & !ZIP_BIT) as usize].buf;
        self.reads
            .iter()
            .map(move |&(dev, host, off, len)| PayloadRead {
                dev,
                host,
                dst: BufSlice {
                    buf: buf.clone(),
                    off,
                    len,
                },
            })
    }

    /// The device reads of fill `payload` ended (`ok`): frees its record and decompresses
    /// each of its clusters into the ring slot (a cluster that does not decode to exactly
    /// one cluster fails the fill: its reads go to the base, which reports the error).
    /// Returns the slot and whether its data is in; `None` when no such fill is in flight.
    pub(crate) fn finish<D: BlockDevice<Buf = B>>(
        &mut self,
        layers: &impl ZipLayers<D>,
        payload: u32,
        ok: bool,
    ) -> Option<(u16, bool)> {
        let ZipFills {
            recs, dec, input, ..
        } = self;
        let rec = recs
            .get_mut((payload & !ZIP_BIT) as usize)
            .filter(|r| r.busy)?;
        rec.busy = false;
        let slot = rec.slot;
        let mut ok = ok;
        match rec.dst.take() {
            Some(dst) if ok => {
                for p in &rec.parts {
                    let Some(q) = layers.zip_layer(p.layer as usize) else {
                        ok = false;
                        break;
                    };
                    let cs = q.geometry().cluster_size() as usize;
                    let ct = q.compression_type();
                    if p.in_cluster == 0 && p.n == cs {
                        // A whole cluster: decoded from the record straight into the slot.
                        let d = &dst;
                        match d.buf.decompress_into(
                            d.off + p.dst_off,
                            cs,
                            &rec.buf,
                            p.at,
                            p.len,
                            dec,
                            ct,
                        ) {
                            Some(Ok(())) => continue,
                            Some(Err(_)) => {
                                ok = false;
                                break;
                            }
                            None => {}
                        }
                    }
                    // A part: from the cluster the layer decompressed last when it is this
                    // one (a cluster larger than a chunk is decompressed once, not once per
                    // chunk), else decompressed into its place.
                    let (Some(inp), Ok(mut last)) =
                        (input.get_mut(..p.len), q.last_compressed().try_borrow_mut())
                    else {
                        ok = false;
                        break;
                    };
                    let key = (p.stream, p.len as u64);
                    let cluster = last.get_or_fill(key, (q.reuse_gen(), p.gen), cs, |out| {
                        // Decoded from the record where it is, else from a copy.
                        let r = rec.buf.decompress_to(p.at, p.len, dec, ct, out);
                        r.unwrap_or_else(|| {
                            rec.buf.copy_out(p.at, inp);
                            dec.decompress(ct, inp, out)
                        })
                    });
                    let Ok(cluster) = cluster else {
                        ok = false;
                        break;
                    };
                    let Some(part) = cluster.get(p.in_cluster..p.in_cluster + p.n) else {
                        ok = false;
                        break;
                    };
                    dst.copy_in(p.dst_off, part);
                }
            }
            _ => ok = false,
        }
        Some((slot, ok))
    }
}

/// Lays `parts` out in record `rec`'s buffer (its parts, and the device reads in
/// `reads`), copying at once the parts of each layer's kept cluster into `dst`;
/// [`ZipRefused::Unfit`] when the streams do not fit.
fn layout<D: BlockDevice>(
    layers: &impl ZipLayers<D>,
    rec: &mut Record<D::Buf>,
    reads: &mut Vec<(DevId, u64, usize, usize)>,
    parts: &[ZipPart],
    dst: &BufSlice<D::Buf>,
) -> Result<(), ZipRefused> {
    rec.parts.clear();
    reads.clear();
    let cap = rec.bytes;
    let mut used = 0usize;
    for p in parts {
        let Some(q) = layers.zip_layer(p.layer as usize) else {
            return Err(ZipRefused::Unfit);
        };
        let start = p.desc.offset.0;
        let gen = q.reuse_gen();
        // A part of the cluster its layer decompressed last: copied now, nothing read.
        let kept = q.last_compressed().try_borrow().is_ok_and(|last| {
            last.get(start, p.desc.len, gen)
                .and_then(|c| c.get(p.in_cluster..p.in_cluster + p.len))
                .map(|part| dst.copy_in(p.buf_off, part))
                .is_some()
        });
        if kept {
            continue;
        }
        // The sectors that hold the compressed bytes (which need not start or end on
        // one).
        let lo = start & !(SECTOR - 1);
        let hi = start
            .checked_add(p.desc.len)
            .and_then(|e| e.checked_next_multiple_of(SECTOR))
            .ok_or(ZipRefused::Unfit)?;
        let dev = q.dev();
        let at = match reads.last_mut() {
            // Continues (or overlaps) the last read on the same device: extend it.
            Some((d, h, b, l)) if *d == dev && lo >= *h && lo <= *h + *l as u64 => {
                let end = *h + *l as u64;
                let grow = hi.saturating_sub(end);
                if grow > (cap - used) as u64 {
                    return Err(ZipRefused::Unfit);
                }
                *l += grow as usize;
                used += grow as usize;
                *b + (start - *h) as usize
            }
            _ => {
                let l = hi - lo;
                if l > (cap - used) as u64 {
                    return Err(ZipRefused::Unfit);
                }
                reads.push((dev, lo, used, l as usize));
                used += l as usize;
                used - l as usize + (start - lo) as usize
            }
        };
        rec.parts.push(Part {
            layer: p.layer,
            stream: start,
            gen,
            at,
            len: p.desc.len as usize,
            in_cluster: p.in_cluster,
            dst_off: p.buf_off,
            n: p.len,
        });
    }
    Ok(())
}
