//! Where a repair puts the refcount structures it creates: new refcount blocks and, when
//! the table is too small to point at them, a new refcount table.
//!
//! A device that grows takes them past the end of the image, as before. A fixed-size device
//! (a bdev, a block device) cannot: there they go into clusters no reference uses, found in
//! the expected-refcount array the check built — holes among the clusters below the device
//! end. Either way the new structures must describe themselves, so a placement is repeated
//! until every cluster it takes lies in a range whose refcount block is present or placed.

use std::collections::BTreeSet;

/// The refcount table's geometry and which of its blocks a repair can keep.
pub(super) struct Geometry<'a> {
    /// Bytes per cluster.
    pub cluster_size: u64,
    /// Refcount entries per refcount block.
    pub per_block: u64,
    /// Entries of the current refcount table.
    pub table_len: u64,
    /// Whether refcount-table index `i` names a block the repair keeps.
    pub present: &'a dyn Fn(u64) -> bool,
}

impl Geometry<'_> {
    /// Clusters a new table needs to hold index `max_index`, or 0 when the current table
    /// already does.
    fn table_clusters(&self, max_index: u64) -> u64 {
        if max_index < self.table_len {
            0
        } else {
            ((max_index + 1) * 8).div_ceil(self.cluster_size)
        }
    }

    /// Adds to `want` the index of every block that must describe one of `clusters` and
    /// is not kept; returns whether `want` grew.
    fn cover(&self, want: &mut BTreeSet<u64>, clusters: impl Iterator<Item = u64>) -> bool {
        let mut grew = false;
        for c in clusters {
            let b = c / self.per_block;
            if !(self.present)(b) && want.insert(b) {
                grew = true;
            }
        }
        grew
    }
}

/// Where the new structures go, in host clusters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Layout {
    /// First cluster of the new refcount table and its length in clusters; length 0 when
    /// the current table stays.
    pub table: (u64, u64),
    /// New refcount blocks: (refcount-table index, host cluster), by index.
    pub blocks: Vec<(u64, u64)>,
}

impl Layout {
    /// Every cluster the layout takes.
    pub fn clusters(&self) -> impl Iterator<Item = u64> + '_ {
        let (start, len) = self.table;
        (start..start + len).chain(self.blocks.iter().map(|&(_, c)| c))
    }
}

/// Places the blocks of `need` (and those the placement itself needs) past `end`, the
/// first cluster after the image: the table first when it must grow, then the blocks.
pub(super) fn past_the_end(end: u64, need: &BTreeSet<u64>, g: &Geometry<'_>) -> Layout {
    let mut want = need.clone();
    loop {
        let t = g.table_clusters(want.last().copied().unwrap_or(0));
        let layout = Layout {
            table: (end, t),
            blocks: want
                .iter()
                .enumerate()
                .map(|(j, &b)| (b, end + t + j as u64))
                .collect(),
        };
        if !g.cover(&mut want, layout.clusters()) {
            return layout;
        }
    }
}

/// Places the blocks of `need` (and those the placement itself needs) in clusters below
/// `usable` for which `free` holds, lowest first: the table (when it must grow) in the
/// first run long enough, then each block in the next free cluster. Returns `None` when
/// the free clusters do not suffice.
pub(super) fn in_holes(
    usable: u64,
    free: &dyn Fn(u64) -> bool,
    need: &BTreeSet<u64>,
    g: &Geometry<'_>,
) -> Option<Layout> {
    let mut want = need.clone();
    loop {
        let t = g.table_clusters(want.last().copied().unwrap_or(0));
        let table = if t > 0 {
            (free_run(usable, free, t)?, t)
        } else {
            (0, 0)
        };
        let in_table = |c: u64| (table.0..table.0 + table.1).contains(&c);
        let mut blocks = Vec::with_capacity(want.len());
        let mut c = 0;
        for &b in &want {
            while c < usable && (!free(c) || in_table(c)) {
                c += 1;
            }
            if c >= usable {
                return None;
            }
            blocks.push((b, c));
            c += 1;
        }
        let layout = Layout { table, blocks };
        if !g.cover(&mut want, layout.clusters()) {
            return Some(layout);
        }
    }
}

/// First cluster of the lowest run of `len` free clusters below `usable`.
fn free_run(usable: u64, free: &dyn Fn(u64) -> bool, len: u64) -> Option<u64> {
    let mut start = 0;
    let mut c = 0;
    while c < usable {
        if !free(c) {
            start = c + 1;
        } else if c + 1 - start == len {
            return Some(start);
        }
        c += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry<'a>(table_len: u64, present: &'a dyn Fn(u64) -> bool) -> Geometry<'a> {
        // 512-byte clusters, 16-bit refcounts: 256 clusters per block, 64 entries per
        // table cluster.
        Geometry {
            cluster_size: 512,
            per_block: 256,
            table_len,
            present,
        }
    }

    #[test]
    fn holes_take_the_lowest_free_clusters() {
        let used: BTreeSet<u64> = [0, 1, 2, 4, 5].into();
        let free = |c: u64| !used.contains(&c);
        let present = |b: u64| b != 0;
        let g = geometry(64, &present);
        let l = in_holes(10, &free, &[0].into(), &g).expect("room");
        assert_eq!(
            l,
            Layout {
                table: (0, 0),
                blocks: vec![(0, 3)]
            }
        );
    }

    #[test]
    fn a_block_placed_in_a_range_without_one_needs_its_own() {
        // Blocks 0 and 1 are missing; only block 0's range holds data, but the only holes
        // lie in block 1's range, so block 1 must be created too.
        let free = |c: u64| c >= 256 + 10;
        let present = |_b: u64| false;
        let g = geometry(64, &present);
        let l = in_holes(600, &free, &[0].into(), &g).expect("room");
        assert_eq!(l.blocks, vec![(0, 266), (1, 267)]);
    }

    #[test]
    fn a_table_that_grows_takes_a_run_of_holes() {
        // One table cluster holds 64 entries; index 64 needs a two-cluster table, which
        // skips the single hole at 3 and takes 7..9; the block takes the hole at 3.
        let used: BTreeSet<u64> = [0, 1, 2, 4, 5, 6].into();
        let free = |c: u64| !used.contains(&c);
        let present = |b: u64| b == 0;
        let g = geometry(64, &present);
        let l = in_holes(64 * 256 + 10, &free, &[64].into(), &g).expect("room");
        assert_eq!(
            l,
            Layout {
                table: (7, 2),
                blocks: vec![(64, 3)]
            }
        );
    }

    #[test]
    fn no_room_is_none() {
        let free = |c: u64| c == 5;
        let present = |b: u64| b != 0 && b != 1;
        let g = geometry(64, &present);
        assert_eq!(in_holes(10, &free, &[0, 1].into(), &g), None);
        let none = |_c: u64| false;
        assert_eq!(in_holes(10, &none, &[0].into(), &g), None);
    }

    #[test]
    fn past_the_end_covers_itself() {
        // The image ends at cluster 300 (block 1's range), which has no block.
        let present = |_b: u64| false;
        let g = geometry(64, &present);
        let l = past_the_end(300, &[0].into(), &g);
        assert_eq!(
            l,
            Layout {
                table: (300, 0),
                blocks: vec![(0, 300), (1, 301)]
            }
        );
        // A block at cluster 16384 lies in the range of index 64, which a one-cluster
        // table cannot hold: the table grows to two clusters at the end, blocks after it.
        let l = past_the_end(64 * 256, &[63].into(), &g);
        assert_eq!(l.table, (64 * 256, 2));
        assert_eq!(l.blocks, vec![(63, 64 * 256 + 2), (64, 64 * 256 + 3)]);
    }
}
