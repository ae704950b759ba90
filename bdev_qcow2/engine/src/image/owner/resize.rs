//! Resizing the virtual disk on the owner: growing it (a larger L1 table when the new size
//! needs one; refcount blocks and the refcount table grow on demand as the new table's
//! clusters are taken) and shrinking it when the range cut off holds no data.
//!
//! Crash safety: the old header keeps describing the old disk until one sector write
//! switches to the new one. Before it, the new L1 table is written whole and flushed, and
//! the refcounts of its clusters are stable (rule 1 and rule 4 of ARCHITECTURE.md §7); the
//! old table is freed only after the header naming the new one is stable. A crash at any
//! point leaves the old disk or the new one, with at most the new table's clusters leaked.

use super::discards::FreeKind;
use super::{words_to_bytes, Owner};
use crate::error::{Error, Result};
use crate::format::{ClusterMapping, L1Entry};
use crate::io::{BlockDevice, BufSlice, IoBuffer};
use crate::limits::{MAX_L1_ENTRIES, MAX_VIRTUAL_SIZE};
use crate::types::{HostOffset, HostRange};

use super::alloc::Allocation;

impl<D: BlockDevice> Owner<'_, D> {
    /// Resizes the virtual disk to `new_size` bytes (a multiple of 512). Shrinking needs
    /// `shrink` and is refused when any cluster wholly past the new end holds data or has
    /// a host cluster, or has an allocation in flight ([`Error::Refused`]). Returns the
    /// old size. Takes the metadata lock; every metadata change made before is written
    /// back first.
    pub(crate) async fn resize(&self, new_size: u64, shrink: bool) -> Result<u64> {
        if !new_size.is_multiple_of(512) || new_size == 0 || new_size > MAX_VIRTUAL_SIZE {
            return Err(Error::Refused(format!(
                "new size {new_size} must be a positive multiple of 512 up to 2 EiB"
            )));
        }
        let m = self.meta();
        let _g = m.lock().lock().await;
        let old_size = self.size();
        if new_size == old_size {
            return Ok(old_size);
        }
        if new_size < old_size {
            if !shrink {
                return Err(Error::Refused(format!(
                    "use --shrink to shrink the disk from {old_size} to {new_size} bytes"
                )));
            }
            self.check_cut_off_is_empty(new_size, old_size).await?;
        }
        self.resize_bitmaps(new_size)?;
        // Everything dirty goes to the device first, in order: the L1 table copied below
        // is then the one on disk, and the header written below carries no other change.
        self.writeback_locked().await?;
        let need = new_size.div_ceil(self.geo.l1_entry_coverage());
        let have = self.l1.borrow().len() as u64;
        let old_table = if need > have {
            self.grow_l1(need).await?
        } else {
            None
        };
        self.header.borrow_mut().header.size = new_size;
        m.st_mut().header.set_size(new_size);
        self.write_header().await?;
        self.exec.flush(self.dev).await?;
        // The header naming the new table is stable: the old one may go (rule 2: a later
        // write-back frees it).
        if let Some(old) = old_table {
            m.st_mut().frees.free_later(old, FreeKind::Other);
        }
        if let Some(sh) = self.published() {
            sh.set_virtual_size(new_size);
        }
        Ok(old_size)
    }

    /// Refuses a shrink to `new_size` when a cluster wholly past it holds anything but
    /// zeros without a host cluster (or nothing at all), or has an allocation in flight.
    async fn check_cut_off_is_empty(&self, new_size: u64, old_size: u64) -> Result<()> {
        let cs = self.geo.cluster_size();
        let from = new_size.div_ceil(cs) * cs;
        if self
            .meta()
            .st()
            .alloc
            .inflight()
            .any_from(from >> self.geo.cluster_bits)
        {
            return Err(Error::Refused(
                "a write past the new end is in flight; retry the shrink".into(),
            ));
        }
        let mut pos = from;
        while pos < old_size {
            let (m, n) = self.extent(pos, old_size).await?;
            let holds = match m {
                ClusterMapping::Data { .. } | ClusterMapping::Compressed(_) => true,
                ClusterMapping::Zero { host } | ClusterMapping::Unallocated { host } => {
                    host.is_some()
                }
            };
            if holds {
                return Err(Error::Refused(format!(
                    "cannot shrink to {new_size} bytes: guest offset {pos} past it holds data \
                     (discard it first)"
                )));
            }
            pos += n.max(1);
        }
        Ok(())
    }

    /// Moves the L1 table to a new place with `entries` entries (the old ones, then
    /// zeros): the new table is written and flushed with the refcounts of its clusters,
    /// then the header copy names it. Returns the old table's clusters, which the caller
    /// frees once it wrote the header. Caller holds the metadata lock and has written every
    /// dirty change back (no L1 entry is dirty).
    async fn grow_l1(&self, entries: u64) -> Result<Option<HostRange>> {
        if entries > MAX_L1_ENTRIES {
            return Err(Error::Refused(format!(
                "the new size needs {entries} L1 entries, more than the {MAX_L1_ENTRIES} an \
                 image may have"
            )));
        }
        if let Some(sh) = self.published() {
            if entries > sh.l1_len() as u64 {
                return Err(Error::Refused(format!(
                    "online growth is limited to {} L1 entries for this image (the room \
                     published at open); close it and grow it offline",
                    sh.l1_len()
                )));
            }
        }
        let cs = self.geo.cluster_size();
        let bits = self.geo.cluster_bits;
        let clusters = (entries * 8).div_ceil(cs);
        let table = self.alloc_run(clusters).await?;
        let new_off = table.first.0 << bits;
        if self.overlaps_metadata(HostOffset(new_off), clusters << bits) {
            return Err(self
                .mark_corrupt(
                    crate::error::Field::L1TableOffset,
                    new_off,
                    "new L1 table would overlap metadata",
                )
                .await);
        }
        // Rule 1: the refcounts of the new table's clusters are stable before the header
        // can name it.
        self.writeback_locked().await?;
        let mut words: Vec<u64> = self.l1.borrow().iter().map(|e| e.0).collect();
        words.resize(entries as usize, 0);
        let mut bytes = vec![0u8; (clusters << bits) as usize];
        words_to_bytes(&words, &mut bytes);
        let buf = self.exec.alloc_buf(self.dev, bytes.len());
        buf.copy_in(0, &bytes);
        self.exec
            .write(self.dev, new_off, BufSlice::whole(buf))
            .await?;
        self.exec.flush(self.dev).await?;
        if let Some(sh) = self.published() {
            for c in table.first.0..table.end().0 {
                sh.set_meta_cluster(c);
            }
        }
        let (old_off, old_entries) = {
            let h = self.header.borrow();
            (h.header.l1_table_offset, u64::from(h.header.l1_size))
        };
        {
            let mut h = self.header.borrow_mut();
            h.header.l1_table_offset = new_off;
            h.header.l1_size = entries as u32;
        }
        self.meta()
            .st_mut()
            .header
            .set_l1_table(new_off, entries as u32);
        self.l1.borrow_mut().resize(entries as usize, L1Entry(0));
        Ok((old_entries > 0)
            .then(|| HostRange::new(HostOffset(old_off), (old_entries * 8).div_ceil(cs) * cs)))
    }

    /// Exactly `n` consecutive host clusters, refcounts 1 (dirty). Shorter free runs the
    /// allocator finds on the way are held until a long enough one is found, then given
    /// back, so that each search starts past them. A refcount block lies at the first
    /// cluster of the range it covers, so a run longer than a block's range exists only
    /// where the blocks were placed elsewhere: after [`MAX_SHORT_RUNS`] short runs the
    /// search gives up ([`Error::Refused`]) rather than walk the device.
    pub(crate) async fn alloc_run(&self, n: u64) -> Result<Allocation> {
        let mut short: Vec<Allocation> = Vec::new();
        let found = loop {
            if short.len() >= MAX_SHORT_RUNS {
                break Err(Error::Refused(format!(
                    "found no run of {n} free clusters for the new L1 table; with these \
                     clusters and refcount width the table cannot grow that far"
                )));
            }
            match self.alloc_clusters(n).await {
                Ok(a) if a.count == n => break Ok(a),
                Ok(a) => short.push(a),
                Err(e) => break Err(e),
            }
        };
        for a in short {
            self.free_unreferenced(a).await?;
        }
        found
    }
}

/// How many free runs too short for a new L1 table [`Owner::alloc_run`] passes over.
const MAX_SHORT_RUNS: usize = 16;
