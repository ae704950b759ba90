//! Writing compressed clusters (`qcow2 convert -c`, and later a compress-on-write RPC).
//!
//! One whole guest cluster is compressed and stored in newly allocated host clusters, then
//! its L2 entry becomes a compressed descriptor. It follows the same plan → data → commit
//! order as allocating writes (ARCHITECTURE.md §7): under the metadata lock the L2 table is made
//! writable and the host space allocated (refcounts dirty); the compressed bytes are written
//! without the lock; the L2 entry is set under the lock again, so the ordered write-back
//! makes the refcount stable before the entry and the data stable before the entry.
//!
//! Simplification: every compressed cluster gets host clusters of its own (it starts at a
//! host cluster boundary); QEMU packs several compressed clusters into one host cluster.
//! The image stays valid (refcount 1 per host cluster), only less compact.

use crate::chain::{Chain, Layer};
use crate::error::{Error, Field, Result};
use crate::format::entries::compressed_entry;
use crate::format::{L2Entry, SubclusterBitmap};
use crate::image::Qcow2;
use crate::io::{BlockDevice, BufSlice, IoBuffer, SECTOR};
use crate::types::GuestOffset;
use std::rc::Rc;

fn top<D: BlockDevice>(chain: &Chain<D>) -> Result<&Qcow2<D>> {
    match &chain.layers()[0] {
        Layer::Qcow2(q) if q.is_writable() => Ok(q),
        _ => Err(Error::ReadOnly),
    }
}

impl<D: BlockDevice> Chain<D> {
    /// Writes one guest cluster compressed. `offset` must be cluster-aligned and `data` one
    /// whole cluster, or shorter only for the last cluster of a disk whose size is not a
    /// multiple of the cluster size (it is padded with zeros, like QEMU). The cluster must
    /// be unallocated in the top image.
    ///
    /// Returns `Ok(())` once the write completed (durable after [`Chain::flush`]). When
    /// compression does not make the cluster smaller, or when the cluster is already allocated, the data is written by an ordinary
    /// [`Chain::write`] instead.
    pub async fn write_compressed(self: &Rc<Self>, offset: u64, data: &[u8]) -> Result<()> {
        let q = top(self)?;
        if q.encrypted() {
            // QEMU neither writes nor decrypts compressed clusters of an encrypted image.
            return Err(Error::Refused(
                "compression and encryption are not supported at the same time".into(),
            ));
        }
        let geo = q.geometry();
        let cs = geo.cluster_size();
        let len = data.len() as u64;
        if !offset.is_multiple_of(cs) || len == 0 || len > cs || !len.is_multiple_of(SECTOR) {
            return Err(Error::InvalidRequest(
                "compressed write must cover one aligned cluster",
            ));
        }
        if offset.checked_add(len).is_none_or(|e| e > self.size()) {
            return Err(Error::InvalidRequest("request past the end of the disk"));
        }
        if len < cs && offset + len != self.size() {
            return Err(Error::InvalidRequest(
                "only the last cluster of the disk may be partial",
            ));
        }
        let plain = |chain: Rc<Self>| async move {
            let buf = chain.exec().alloc_buf(q.dev(), data.len());
            buf.copy_in(0, data);
            chain.write(offset, BufSlice::whole(buf)).await
        };
        let mut cluster = data.to_vec();
        cluster.resize(cs as usize, 0);
        let ct = q.header().header.compression_type;
        let Some(mut comp) = crate::compress::compress(ct, &cluster) else {
            return plain(self.clone()).await;
        };
        let comp_len = comp.len() as u64;
        comp.resize(comp.len().div_ceil(SECTOR as usize) * SECTOR as usize, 0);

        // Plan, under the lock, once no allocation of this guest cluster is in flight.
        let o = q.owner()?;
        let q = &o;
        let m = o.meta();
        let c = offset / cs;
        let guard = loop {
            let g = m.lock().lock().await;
            if !m.st().alloc.inflight().contains(c) {
                m.st_mut().alloc.inflight_mut().mark(c, c);
                break g;
            }
            drop(g);
            m.wait_inflight().await;
        };
        let unmark = || m.end_inflight(c, c);
        let planned = async {
            let (entry, _) = q.l2_words(GuestOffset(offset)).await?;
            if entry != L2Entry::UNALLOCATED {
                return Ok(None);
            }
            q.ensure_l2(GuestOffset(offset)).await?;
            let n = (comp.len() as u64).div_ceil(cs);
            let a = q.alloc_clusters(n).await?;
            if a.count < n {
                q.free_unreferenced(a).await?;
                return Err(Error::InvalidRequest(
                    "no contiguous host space for a compressed cluster",
                ));
            }
            Ok(Some(a))
        }
        .await;
        drop(guard);
        let alloc = match planned {
            Ok(Some(a)) => a,
            Ok(None) => {
                unmark();
                return plain(self.clone()).await;
            }
            Err(e) => {
                unmark();
                return Err(e);
            }
        };
        let host = geo.host_cluster_offset(alloc.first);

        // Data, without the lock.
        let res = if q.overlaps_metadata(host, comp.len() as u64) {
            Err(q
                .mark_corrupt(
                    Field::L2Entry,
                    host.0,
                    "compressed data would overlap metadata",
                )
                .await)
        } else {
            let buf = self.exec().alloc_buf(q.dev(), comp.len());
            buf.copy_in(0, &comp);
            self.exec()
                .write(q.dev(), host.0, BufSlice::whole(buf))
                .await
        };

        // Commit (or give the clusters back), under the lock.
        let guard = m.lock().lock().await;
        let r = match res {
            Ok(()) => {
                async {
                    q.dirty_slice_for(GuestOffset(offset)).await?;
                    let e = compressed_entry(geo.cluster_bits, host.0, comp_len);
                    q.set_l2_words(GuestOffset(offset), e, SubclusterBitmap::NONE)?;
                    q.maybe_writeback_locked().await
                }
                .await
            }
            Err(e) => {
                let _ = q.free_unreferenced(alloc).await;
                Err(e)
            }
        };
        drop(guard);
        unmark();
        r
    }
}
