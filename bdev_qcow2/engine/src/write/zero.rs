//! Write-zeroes and discard: whole clusters (or subclusters) through metadata only,
//! partial ones written as data (write-zeroes) or left alone (discard).

use super::top;
use crate::chain::Chain;
use crate::error::Result;
use crate::format::{ClusterMapping, L2Entry, SubclusterBitmap};
use crate::image::owner::discards::FreeKind;
use crate::image::Qcow2;
use crate::io::BlockDevice;
use crate::types::{ClusterSpan, GuestOffset, HostOffset, HostRange};
use std::rc::Rc;

/// Kinds of zeroing requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ZeroKind {
    /// write-zeroes keeping allocation (unless `unmap`).
    WriteZeroes { unmap: bool },
    /// discard: free where possible, zero flag where a backing image would show through.
    Discard,
    /// QEMU's full discard (`bdrv_make_empty`): the whole cluster becomes unallocated,
    /// whatever it held, so the disk reads from the backing chain there.
    Empty,
}

impl<D: BlockDevice> Chain<D> {
    /// Writes zeros over `[offset, offset+len)`: whole clusters (or subclusters) through
    /// metadata only, partial ones as data.
    pub async fn write_zeroes(self: &Rc<Self>, offset: u64, len: u64, unmap: bool) -> Result<()> {
        self.zero_range(offset, len, ZeroKind::WriteZeroes { unmap })
            .await
    }

    /// Discards `[offset, offset+len)`: whole clusters are freed (or get the zero flag when a
    /// backing image would otherwise show through); partial clusters are left alone.
    pub async fn discard(self: &Rc<Self>, offset: u64, len: u64) -> Result<()> {
        self.zero_range(offset, len, ZeroKind::Discard).await
    }

    /// Empties the top image, as QEMU's `bdrv_make_empty` after a commit: every cluster
    /// becomes unallocated (its host space freed, as a snapshot's: `pass-discard-snapshot`),
    /// so the disk reads what the backing chain holds, or zeros without one. The virtual
    /// size stays; the last cluster counts as whole even when the disk ends inside it.
    pub async fn make_empty(self: &Rc<Self>) -> Result<()> {
        let q = top(self)?;
        let cs = q.geometry().cluster_size();
        let size = self.size();
        let mut pos = 0;
        while pos < size {
            let (m, n) = q.extent(pos, size).await?;
            if let ClusterMapping::Unallocated { host: None } = m {
                pos += n.max(1);
                continue;
            }
            let cluster = pos & !(cs - 1);
            let span = ClusterSpan::new(0, cs);
            // (Never refused: emptying covers the whole cluster.)
            self.zero_cluster_metadata(q, GuestOffset(cluster), span, ZeroKind::Empty)
                .await?;
            pos = cluster + cs;
        }
        Ok(())
    }

    async fn zero_range(self: &Rc<Self>, offset: u64, len: u64, kind: ZeroKind) -> Result<()> {
        let q = top(self)?;
        self.disk.check_range(offset, len)?;
        self.disk.note_change(offset, len);
        let geo = q.geometry();
        let cs = geo.cluster_size();
        let gran = geo.subcluster_size();
        let v3 = q.l2_context().v3;
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let cluster = pos & !(cs - 1);
            let b = end.min(cluster + cs);
            let whole_units = if geo.extended_l2() {
                (pos.div_ceil(gran) * gran, b / gran * gran)
            } else if pos == cluster && b == cluster + cs {
                (pos, b)
            } else {
                (pos, pos)
            };
            // Version 2 has no zero flag: only a discard with nothing underneath can go
            // through metadata (the cluster becomes unallocated and reads as zeros).
            let no_backing = self.layers().get(1).is_none_or(|l| cluster >= l.size());
            let metadata_ok =
                whole_units.0 < whole_units.1 && (v3 || (kind == ZeroKind::Discard && no_backing));
            if !metadata_ok {
                if let ZeroKind::WriteZeroes { .. } = kind {
                    self.write_chunk(q, pos, b, None).await?;
                }
                pos = b;
                continue;
            }
            // Partial head/tail subclusters of write-zeroes are written as data.
            if let ZeroKind::WriteZeroes { .. } = kind {
                if pos < whole_units.0 {
                    self.write_chunk(q, pos, whole_units.0, None).await?;
                }
                if whole_units.1 < b {
                    self.write_chunk(q, whole_units.1, b, None).await?;
                }
            }
            let span = ClusterSpan::new(whole_units.0 - cluster, whole_units.1 - cluster);
            let done = self
                .zero_cluster_metadata(q, GuestOffset(cluster), span, kind)
                .await?;
            // Part of a compressed cluster (extended L2): written as data like QEMU, which
            // cannot zero it partially; a discard leaves it alone.
            if !done {
                if let ZeroKind::WriteZeroes { .. } = kind {
                    self.write_chunk(q, whole_units.0, whole_units.1, None)
                        .await?;
                }
            }
            pos = b;
        }
        Ok(())
    }

    /// Zeroes/discards `span` (whole subclusters, or the whole cluster) of the guest
    /// cluster starting at `cluster` through its L2 entry. `Ok(false)` when metadata cannot
    /// do it: `span` is part of a compressed cluster of an extended L2 image.
    async fn zero_cluster_metadata(
        &self,
        q: &Qcow2<D>,
        cluster: GuestOffset,
        span: ClusterSpan,
        kind: ZeroKind,
    ) -> Result<bool> {
        let geo = q.geometry();
        let cs = geo.cluster_size();
        let c = geo.guest_cluster(cluster);
        let o = q.owner()?;
        let q = &o;
        let guard = self.lock_clusters(q, c, c).await;
        let r = async {
            let has_backing = self.layers().get(1).is_some_and(|l| cluster.0 < l.size());
            let (entry, bitmap) = q.l2_words(cluster).await?;
            let ctx = q.l2_context();
            let old = if geo.extended_l2() {
                match entry.subcluster_mapping(bitmap, 0, &ctx)? {
                    m @ ClusterMapping::Compressed(_) => Some(m),
                    _ => None,
                }
            } else {
                Some(entry.mapping(&ctx)?)
            };
            // The new words, and the host bytes to free once they are stable.
            let (new_entry, new_bitmap, free): (_, _, Option<HostRange>) = if kind
                == ZeroKind::Empty
            {
                let free = match old {
                    // Extended L2: the entry's host cluster, whatever its subclusters say.
                    None => Some(entry.host_bits())
                        .filter(|h| *h != 0)
                        .map(|h| HostRange::new(HostOffset(h), cs)),
                    Some(ClusterMapping::Data { host, .. })
                    | Some(ClusterMapping::Zero { host: Some(host) })
                    | Some(ClusterMapping::Unallocated { host: Some(host) }) => {
                        Some(HostRange::new(host, cs))
                    }
                    Some(ClusterMapping::Compressed(d)) => Some(d.sectors()),
                    Some(_) => None,
                };
                (L2Entry::UNALLOCATED, SubclusterBitmap::NONE, free)
            } else if let (true, Some(ClusterMapping::Compressed(d))) = (geo.extended_l2(), old) {
                // Only whole: the cluster is freed and reads as zeros (as QEMU).
                if span.whole_unit_mask(geo.subcluster_size()) != u32::MAX {
                    return Ok(false);
                }
                let zero = if has_backing || kind != ZeroKind::Discard {
                    u32::MAX
                } else {
                    0
                };
                (
                    L2Entry::UNALLOCATED,
                    SubclusterBitmap::new(0, zero),
                    Some(d.sectors()),
                )
            } else if geo.extended_l2() {
                let sc = geo.subcluster_size();
                let t = span.whole_unit_mask(sc);
                let host = entry.host_bits();
                let all = t == u32::MAX;
                let unmap = matches!(
                    kind,
                    ZeroKind::Discard | ZeroKind::WriteZeroes { unmap: true }
                );
                if all && unmap && host != 0 {
                    let zero = if has_backing || kind != ZeroKind::Discard {
                        u32::MAX
                    } else {
                        0
                    };
                    (
                        L2Entry::UNALLOCATED,
                        SubclusterBitmap::new(0, zero),
                        Some(HostRange::new(HostOffset(host), cs)),
                    )
                } else if kind == ZeroKind::Discard && !has_backing {
                    (
                        entry,
                        SubclusterBitmap::new(bitmap.alloc_mask() & !t, bitmap.zero_mask() & !t),
                        None,
                    )
                } else {
                    (
                        entry,
                        SubclusterBitmap::new(bitmap.alloc_mask() & !t, bitmap.zero_mask() | t),
                        None,
                    )
                }
            } else {
                let old = old.unwrap_or(ClusterMapping::Unallocated { host: None });
                let unmap = matches!(
                    kind,
                    ZeroKind::Discard | ZeroKind::WriteZeroes { unmap: true }
                );
                let free = match old {
                    ClusterMapping::Data { host, copied } if unmap || !copied => {
                        Some(HostRange::new(host, cs))
                    }
                    ClusterMapping::Zero { host: Some(h) } if unmap || !entry.is_copied() => {
                        Some(HostRange::new(h, cs))
                    }
                    ClusterMapping::Compressed(d) => Some(d.sectors()),
                    _ => None,
                };
                let keep_host = match (free, old) {
                    (None, ClusterMapping::Data { host, .. }) => Some(host),
                    (None, ClusterMapping::Zero { host: Some(h) }) => Some(h),
                    _ => None,
                };
                let ne = match (kind, keep_host) {
                    (_, Some(h)) => L2Entry::copied_zero(h),
                    (ZeroKind::Discard, None) if !has_backing => L2Entry::UNALLOCATED,
                    _ => L2Entry::ZERO,
                };
                (ne, SubclusterBitmap::NONE, free)
            };
            if new_entry == entry && new_bitmap == bitmap {
                return Ok(true);
            }
            if q.l2_table(cluster)?.is_none() {
                if new_entry == L2Entry::UNALLOCATED && new_bitmap == SubclusterBitmap::NONE {
                    return Ok(true);
                }
                q.ensure_l2(cluster).await?;
            } else if !q.l1_copied(cluster) {
                q.ensure_l2(cluster).await?;
            }
            q.dirty_slice_for(cluster).await?;
            q.set_l2_words(cluster, new_entry, new_bitmap)?;
            if let Some(r) = free {
                let why = if kind == ZeroKind::Empty {
                    FreeKind::Snapshot
                } else {
                    FreeKind::Request
                };
                q.free_later(r, why);
            }
            q.maybe_writeback_locked().await.map(|()| true)
        }
        .await;
        drop(guard);
        self.unmark_clusters(q, c, c);
        r
    }
}
