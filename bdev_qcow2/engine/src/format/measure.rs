//! What a fully allocated image takes (QEMU's `qcow2_calc_prealloc_size`): `qcow2 measure`
//! reports it, and the owner zeroing ahead by punching bounds its first punch by it.

/// Bytes of refcount table and blocks that count `clusters` clusters and themselves
/// (QEMU's `qcow2_refcount_metadata_size`: the fixed point).
pub fn refcount_metadata_size(clusters: u64, cluster_size: u64, refcount_order: u32) -> u64 {
    let per_table_cluster = cluster_size / 8;
    let per_block = (cluster_size * 8) >> refcount_order;
    let (mut table, mut blocks, mut n) = (0u64, 0u64, 0u64);
    loop {
        let last = n;
        blocks = (clusters + table + blocks).div_ceil(per_block);
        table = blocks.div_ceil(per_table_cluster);
        n = clusters + blocks + table;
        if n == last {
            return (blocks + table) * cluster_size;
        }
    }
}

/// Bytes a fully allocated qcow2 image of `size` bytes takes: the header cluster, every
/// L2 and L1 table, the refcount metadata covering them and every data cluster (QEMU's
/// `qcow2_calc_prealloc_size`; no snapshots, bitmaps nor encryption header).
pub fn prealloc_size(size: u64, cluster_size: u64, refcount_order: u32, extended_l2: bool) -> u64 {
    let aligned = size.div_ceil(cluster_size) * cluster_size;
    let l2e = if extended_l2 { 16 } else { 8 };
    let mut meta = cluster_size;
    let nl2e = (aligned / cluster_size).div_ceil(cluster_size / l2e) * (cluster_size / l2e);
    meta += nl2e * l2e;
    let nl1e = (nl2e * l2e / cluster_size).div_ceil(cluster_size / 8) * (cluster_size / 8);
    meta += nl1e * 8;
    meta += refcount_metadata_size(
        (meta + aligned) / cluster_size,
        cluster_size,
        refcount_order,
    );
    meta + aligned
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Figures `qemu-img measure` printed for the same inputs (QEMU 10.0).
    #[test]
    fn qemu_figures() {
        assert_eq!(prealloc_size(1 << 30, 65536, 4, false), 1074135040);
        assert_eq!(prealloc_size(4 << 20, 65536, 4, false), 4521984);
    }
}
