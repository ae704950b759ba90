//! A plan's data phase: where each part writes (its cluster, with the COW data around
//! the guest's) and the device writes, COW merged in, zero COW areas not read.

use super::parts::{Action, AllocCursor, NewCluster, Part};
use crate::chain::{read_layer, Chain};
use crate::error::{Field, Result};
use crate::format::ClusterMapping;
use crate::image::owner::alloc::Allocation;
use crate::image::owner::Owner;
use crate::image::Qcow2;
use crate::io::{BlockDevice, BufSlice, IoBuffer};
use crate::types::{ClusterSpan, GuestOffset, HostOffset};
use std::rc::Rc;

/// The fewest bytes of zeros around a partial first write that a device which zeroes
/// cheaply is asked to zero itself (up to two `WriteZeroes` beside the data write); below
/// this, one write of the (sub)cluster from a zeroed buffer costs less than the extra
/// operations (on a malloc bdev, an operation costs about as much as copying 8 KiB).
const ZEROES_OFFLOAD_MIN: u64 = 16 << 10;

impl<D: BlockDevice> Chain<D> {
    /// Whether guest bytes of `old` (the mapping of the guest cluster starting at
    /// `cluster`) in this layer read as zeros without looking at data.
    fn reads_zero(&self, old: &ClusterMapping, cluster: GuestOffset) -> bool {
        match old {
            ClusterMapping::Zero { .. } => true,
            ClusterMapping::Unallocated { .. } => {
                self.layers().get(1).is_none_or(|b| cluster.0 >= b.size())
            }
            _ => false,
        }
    }

    /// Where part `p` of a plan writes: (host offset of its cluster, the span of the
    /// cluster written, which is `p.written` or more when it needs COW data around the
    /// guest's). An allocating part takes the next cluster of `allocs`.
    pub(super) fn part_range(
        &self,
        q: &Qcow2<D>,
        p: &Part,
        allocs: &mut AllocCursor<'_>,
    ) -> (HostOffset, ClusterSpan) {
        let geo = q.geometry();
        let whole = ClusterSpan::whole(geo.cluster_size());
        let sc = geo.subcluster_size();
        match p.action {
            Action::InPlace { host } => (host, p.written),
            Action::Rewrite { host, .. } => (host, whole),
            Action::SubclusterInPlace { host, .. } => (host, p.written.round_out(sc)),
            Action::Alloc { old, .. } => {
                let NewCluster { host: h, fresh } = allocs.next_cluster(&geo);
                if geo.extended_l2() {
                    if matches!(
                        old,
                        ClusterMapping::Data { .. } | ClusterMapping::Compressed(_)
                    ) {
                        // A shared or compressed cluster: copy all of it.
                        (h, whole)
                    } else {
                        (h, p.written.round_out(sc))
                    }
                } else if fresh && !q.encrypted() && self.reads_zero(&old, p.cluster) {
                    (h, p.written)
                } else {
                    (h, whole)
                }
            }
        }
    }

    /// Issues the data writes of a plan: one device write per part (head and tail COW
    /// merged in), and one per run of consecutive new clusters written straight from the
    /// guest buffer when no COW data is needed. `data` holds the guest bytes from `start`
    /// (`None`: zeros).
    pub(super) async fn write_data(
        self: &Rc<Self>,
        q: &Owner<'_, D>,
        start: GuestOffset,
        parts: &[Part],
        allocs: &[Allocation],
        data: Option<BufSlice<D::Buf>>,
    ) -> Result<()> {
        let mut futs = Vec::new();
        // Pending direct run: (host start, guest start, len).
        let mut run: Option<(HostOffset, GuestOffset, u64)> = None;
        let mut cursor = AllocCursor::new(allocs);
        let exec = self.exec().clone();
        let dev = q.data_dev();
        // A cluster of a group taken ahead has no guest bytes (and may lie past them).
        let guest = |at: GuestOffset, len: u64| {
            data.as_ref()
                .filter(|_| len > 0)
                .map(|d| d.sub(at.since(start) as usize, len as usize))
        };
        // A direct run's data: the guest's bytes, or zeros.
        let run_buf = |g: GuestOffset, len: u64| {
            guest(g, len).unwrap_or_else(|| BufSlice::whole(exec.alloc_buf(dev, len as usize)))
        };
        let flush_run = |run: &mut Option<(HostOffset, GuestOffset, u64)>, futs: &mut Vec<_>| {
            if let Some((h, g, len)) = run.take() {
                futs.push(Box::pin(exec.write(dev, h.0, run_buf(g, len))));
            }
        };
        for p in parts {
            // `span` is what this part writes of its cluster, `w` the guest's part of it.
            let (host, span) = self.part_range(q, p, &mut cursor);
            let w = p.written;
            let host_off = host.plus(span.start());
            let len = span.len();
            let guest_at = p.guest(w.start());
            if len == 0 {
                // A cluster of the group taken ahead that reads zeros as it is.
                continue;
            }
            if span == w {
                // Guest data only: extend or start a direct run.
                match &mut run {
                    Some((h, g, l)) if h.plus(*l) == host_off && g.plus(*l) == guest_at => {
                        *l += len
                    }
                    _ => {
                        flush_run(&mut run, &mut futs);
                        run = Some((host_off, guest_at, len));
                    }
                }
                continue;
            }
            flush_run(&mut run, &mut futs);
            if q.overlaps_metadata(host_off, len) {
                return Err(q
                    .mark_corrupt(
                        Field::L2Entry,
                        host_off.0,
                        "data write would overlap metadata",
                    )
                    .await);
            }
            // COW data that reads as zeros needs no read (a first write into a new cluster
            // on a device that may hold old data: the cluster is written whole).
            let zero_cow = match p.action {
                Action::Rewrite { .. } => true,
                Action::Alloc { old, .. } => self.reads_zero(&old, p.cluster),
                Action::SubclusterInPlace { bitmap: b, .. } => {
                    // The COW data lies in the first and the last subcluster written: zeros
                    // where they are not allocated and read as zeros or no backing data.
                    let sc = q.geometry().subcluster_size();
                    let no_backing =
                        self.reads_zero(&ClusterMapping::Unallocated { host: None }, p.cluster);
                    // Whether the subcluster holding byte `at` of the cluster reads as zeros.
                    let zero = |at: u64| {
                        let i = at / sc;
                        !b.allocated(i) && (b.zero(i) || no_backing)
                    };
                    (span.start() == w.start() || zero(w.start()))
                        && (span.end() == w.end() || zero(w.end() - 1))
                }
                Action::InPlace { .. } => false,
            };
            if zero_cow
                && len - w.len() >= ZEROES_OFFLOAD_MIN
                && !q.encrypted()
                && exec.with_device(dev, |d| d.zeroes_cheaply())
            {
                // The device zeroes around the guest data itself (as QEMU does where zeroing
                // is cheap): the guest's bytes go from its own buffer, nothing bounces.
                let (head, tail) = (w.start() - span.start(), span.end() - w.end());
                match guest(guest_at, w.len()) {
                    Some(g) => {
                        if head > 0 {
                            futs.push(Box::pin(exec.write_zeroes(dev, host_off.0, head)));
                        }
                        futs.push(Box::pin(exec.write(dev, host_off.plus(head).0, g)));
                        if tail > 0 {
                            futs.push(Box::pin(exec.write_zeroes(
                                dev,
                                host_off.plus(len - tail).0,
                                tail,
                            )));
                        }
                    }
                    // The guest writes zeros too.
                    None => futs.push(Box::pin(exec.write_zeroes(dev, host_off.0, len))),
                }
                continue;
            }
            // Bounce: COW data around the guest data (zeroed: zeros need no read).
            let bounce = q.exec().alloc_buf(dev, len as usize);
            if !zero_cow {
                if span.start() < w.start() {
                    let b = BufSlice {
                        buf: bounce.clone(),
                        off: 0,
                        len: (w.start() - span.start()) as usize,
                    };
                    read_layer(self.clone(), 0, p.guest(span.start()).0, b).await?;
                }
                if w.end() < span.end() {
                    let b = BufSlice {
                        buf: bounce.clone(),
                        off: (w.end() - span.start()) as usize,
                        len: (span.end() - w.end()) as usize,
                    };
                    read_layer(self.clone(), 0, p.guest(w.end()).0, b).await?;
                }
            }
            if let Some(g) = guest(guest_at, w.len()) {
                let mut tmp = vec![0u8; g.len];
                g.copy_out(0, &mut tmp);
                bounce.copy_in((w.start() - span.start()) as usize, &tmp);
            }
            futs.push(Box::pin(q.exec().write(
                dev,
                host_off.0,
                BufSlice::whole(bounce),
            )));
        }
        if futs.is_empty() {
            // One device write (the common case): awaited in place, nothing boxed.
            return match run {
                Some((h, g, len)) => exec.write(dev, h.0, run_buf(g, len)).await,
                None => Ok(()),
            };
        }
        flush_run(&mut run, &mut futs);
        crate::exec::join_all(futs).await
    }
}
