//! L2 slices read from the device and cached (the owner's dirty copy winning over the
//! device, a core's copy stamped with the epoch it was read under), extents resolved
//! through them, and compressed clusters read.

use super::{be_words, Qcow2, SliceSummary};
use crate::coherency::SliceStamp;
use crate::error::{corrupt, Field, Result};
use crate::exec::read_bytes;
use crate::format::{ClusterMapping, L2Entry, LinearSlice};
use crate::io::{BlockDevice, BufSlice, IoBuffer};
use crate::memo::{MappedRow, MEMO_NO_META_GEN};
use crate::types::GuestOffset;

impl<D: BlockDevice> Qcow2<D> {
    pub(super) fn l1_entry_end(&self, off: GuestOffset) -> u64 {
        let cov = self.geo.l1_entry_coverage();
        (off.0 / cov + 1).saturating_mul(cov)
    }

    /// Loads the slice covering `off` into the cache if needed and returns its way (valid
    /// until the next await). `None` when the L2 table is unallocated (nothing to load).
    pub(crate) async fn load_slice(&self, off: GuestOffset) -> Result<Option<usize>> {
        if let Some(r) = self.replica_side() {
            return r.load_slice(off).await;
        }
        let Some(l2) = self.l2_table(off)? else {
            return Ok(None);
        };
        let key = self.geo.slice_id(off);
        if let Some(w) = self.l2_cache.borrow_mut().lookup(key, 0) {
            return Ok(Some(w));
        }
        // The owner's dirty copy is newer than the device.
        if let Some(m) = self.meta_state() {
            if let Some(words) = m.dirty_slice(key) {
                return Ok(Some(self.cache_slice(key, SliceStamp::OWNER, |b| {
                    b.copy_from_slice(&words)
                })));
            }
        }
        let raw = self.read_slice_raw(l2, off).await?;
        // A write-back may have dirtied it meanwhile: the dirty copy wins.
        if let Some(m) = self.meta_state() {
            if let Some(words) = m.dirty_slice(key) {
                return Ok(Some(self.cache_slice(key, SliceStamp::OWNER, |b| {
                    b.copy_from_slice(&words)
                })));
            }
        }
        let w = self.cache_slice(key, SliceStamp::OWNER, |block| {
            for (dst, w) in block.iter_mut().zip(be_words(&raw)) {
                *dst = w;
            }
        });
        Ok(Some(w))
    }

    /// Core replica: caches `words` of slice `key` (the owner's copy, or what the device
    /// holds), taken under `stamp`. When the memo holds a mapped row built from the copy
    /// cached now, the row is carried over to the new copy with only the entries that
    /// differ decoded: while the owner fills a slice a core takes a new copy every few
    /// dozen allocations, and decoding all of its entries each time cost more than the rest
    /// of the requests' work.
    pub(super) fn cache_slice_carrying(
        &self,
        key: u64,
        stamp: SliceStamp,
        words: impl ExactSizeIterator<Item = u64> + Clone,
    ) -> usize {
        let carried = if self.geo.extended_l2() {
            None
        } else {
            self.carry_memo_row(key, words.clone())
        };
        let w = self.cache_slice(key, stamp, |b| {
            for (dst, w) in b.iter_mut().zip(words) {
                *dst = w;
            }
        });
        if let Some((row, meta_gen)) = carried {
            self.memo.carry_mapped(row, stamp, meta_gen);
        }
        w
    }

    /// The memo's mapped row of slice `key`, patched to `words` (standard L2), with the
    /// metadata generation it holds under; `None` when the memo holds no row built from
    /// the cached copy (or the row cannot take the patch).
    pub(super) fn carry_memo_row(
        &self,
        key: u64,
        words: impl ExactSizeIterator<Item = u64>,
    ) -> Option<(MappedRow, u64)> {
        let meta_gen = self
            .writable_core_shared()
            .map_or(MEMO_NO_META_GEN, |sh| sh.meta_gen());
        let cache = self.l2_cache.borrow();
        let way = cache.peek(key)?;
        let epoch = cache.peek_epoch(key)?;
        let row = self.memo.mapped_row(
            key,
            SliceStamp::of(epoch, cache.aux(way).removals),
            meta_gen,
        )?;
        let old = cache.block(way);
        if old.len() != words.len() {
            return None;
        }
        for (i, (&a, b)) in old.iter().zip(words).enumerate() {
            if a != b && !self.memo.patch_row(&row, i, self.memo_word(L2Entry(b))) {
                return None;
            }
        }
        Some((row, meta_gen))
    }

    /// Caches slice `key` read under `stamp` (`fill` writes its words) with its summary
    /// ([`SliceSummary`]); returns the way. Every L2 slice enters the cache here.
    pub(crate) fn cache_slice(
        &self,
        key: u64,
        stamp: SliceStamp,
        fill: impl FnOnce(&mut [u64]),
    ) -> usize {
        self.memo.forget(key);
        let mut cache = self.l2_cache.borrow_mut();
        let (w, evicted) = cache.insert_evicting(key, stamp.epoch(), fill);
        if let Some(old) = evicted {
            self.memo.forget(old);
        }
        let linear = LinearSlice::of(
            cache.block(w),
            self.ctx.get().cluster_bits,
            self.geo.extended_l2(),
        );
        cache.set_aux(
            w,
            SliceSummary {
                linear,
                removals: stamp.removals(),
            },
        );
        w
    }

    pub(super) async fn read_slice_raw(
        &self,
        l2: crate::types::HostOffset,
        off: GuestOffset,
    ) -> Result<Vec<u8>> {
        let host = self.geo.slice_host_offset(l2, off);
        let slice_bytes = 1usize << self.geo.slice_bits;
        let buf = self.exec.alloc_buf(self.dev, slice_bytes);
        self.exec
            .read(self.dev, host.0, BufSlice::whole(buf.clone()))
            .await?;
        let mut raw = vec![0u8; slice_bytes];
        buf.copy_out(0, &mut raw);
        Ok(raw)
    }

    /// Describes guest bytes starting at `off` (< `end`): the mapping of the first
    /// (sub)cluster and how many bytes from `off` share it (same kind; for data, contiguous
    /// host offsets), not crossing a slice boundary. Loads the slice on a miss.
    pub async fn extent(&self, off: u64, end: u64) -> Result<(ClusterMapping, u64)> {
        let go = GuestOffset(off);
        let Some(way) = self.load_slice(go).await? else {
            let e = self.l1_entry_end(go).min(end);
            return Ok((ClusterMapping::Unallocated { host: None }, e - off));
        };
        let slice_end = (off / self.geo.slice_coverage() + 1) * self.geo.slice_coverage();
        let stop = end.min(slice_end);
        let cache = self.l2_cache.borrow();
        let block = cache.block(way);
        let (first, mut pos) = self.resolve(block, go)?;
        while pos < stop {
            let (next, next_end) = self.resolve(block, GuestOffset(pos))?;
            // `first` describes the (sub)cluster that starts at `first_start` (<= `off`).
            let first_start = off & !(self.geo.subcluster_size() - 1);
            if !first.continues_with(&next, pos - first_start) {
                break;
            }
            pos = next_end;
        }
        Ok((first, pos.min(stop) - off))
    }

    /// Copies `dst.len` bytes at `in_cluster` of compressed cluster `d` into `dst`: from the
    /// cluster this core decompressed last when it is that one, else read and decompressed
    /// (and kept in its place).
    pub async fn read_compressed_part(
        &self,
        d: crate::format::CompressedDescriptor,
        in_cluster: usize,
        dst: &BufSlice<D::Buf>,
    ) -> Result<()> {
        let part = |c: &[u8]| -> Result<()> {
            let bytes = c.get(in_cluster..in_cluster + dst.len).ok_or_else(|| {
                corrupt(Field::CompressedData, d.offset.0, "part past its cluster")
            })?;
            dst.copy_in(0, bytes);
            Ok(())
        };
        // Read before the stream's bytes: a reuse meanwhile leaves the kept cluster unused.
        let gen = self.reuse_gen();
        if let Some(c) = self.last_compressed.borrow().get(d.offset.0, d.len, gen) {
            return part(c);
        }
        let input = read_bytes(&self.exec, self.dev, d.offset.0, d.len).await?;
        let ct = self.compression_type();
        // Nothing awaits while they are borrowed.
        let mut last = self.last_compressed.borrow_mut();
        let mut dec = self.decompressor.borrow_mut();
        let cs = self.geo.cluster_size() as usize;
        part(last.fill((d.offset.0, d.len, gen), cs, |out| {
            dec.decompress(ct, &input, out)
        })?)
    }
}
