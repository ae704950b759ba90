//! Resource bounds: what an image may make us allocate or compute.
//!
//! Each limit is a named constant with its reason. An image that asks for more is
//! refused at open with an error naming the field.

/// Largest L1 table we load, in entries (32 MiB of table, as QEMU's `QCOW_MAX_L1_SIZE`).
/// With 2 MiB clusters that addresses far more than any real disk.
pub const MAX_L1_ENTRIES: u64 = 32 * 1024 * 1024 / 8;

/// Largest refcount table, in bytes (QEMU's `QCOW_MAX_REFTABLE_SIZE`, 8 MiB).
pub const MAX_REFCOUNT_TABLE_BYTES: u64 = 8 * 1024 * 1024;

/// Most internal snapshots an image may list (QEMU's `QCOW_MAX_SNAPSHOTS`).
pub const MAX_SNAPSHOTS: u64 = 65536;

/// Largest snapshot table we read, in bytes (QEMU caps it at 64 MiB as well).
pub const MAX_SNAPSHOT_TABLE_BYTES: u64 = 64 * 1024 * 1024;

/// Largest per-snapshot extra data (the spec allows any size; QEMU refuses > 1024).
pub const MAX_SNAPSHOT_EXTRA_DATA: u64 = 1024;

/// Longest backing file name (QEMU refuses > 1023 bytes).
pub const MAX_BACKING_FILE_NAME: u64 = 1023;

/// Most images in a backing chain we open, the top one included: chains of daily
/// snapshots reach a thousand images; this leaves room for a decade of them while a loop
/// (caught by name before) or a runaway chain still ends. A layer index fits in 16 bits
/// (the fast path's `Unplanned::Slice`, the layer index's entries use 15), and each layer
/// costs an open file and its per-image memory (README, "backing chain").
pub const MAX_BACKING_DEPTH: usize = 4096;

/// Largest virtual size: 2^61 bytes (2 EiB), well below overflow of any offset arithmetic.
pub const MAX_VIRTUAL_SIZE: u64 = 1 << 61;

/// Most persistent bitmaps an image may declare (QEMU's limit).
pub const MAX_BITMAPS: u64 = 65535;

/// Largest bitmap directory (QEMU's limit, 64 MiB).
pub const MAX_BITMAP_DIRECTORY_BYTES: u64 = 64 * 1024 * 1024;

/// Most memory the persistent bitmaps of one image open for writing may take (their bits
/// and the index of their segments): 256 MiB, a thousand bitmaps of small disks or one of
/// a 128 TiB disk at 64 KiB granules.
pub const MAX_BITMAP_MEMORY: u64 = 256 << 20;

/// Smallest and largest cluster_bits accepted (512 B – 2 MiB).
pub const MIN_CLUSTER_BITS: u32 = 9;
/// See [`MIN_CLUSTER_BITS`].
pub const MAX_CLUSTER_BITS: u32 = 21;

/// Extended L2 needs subclusters of at least 512 bytes: 32 subclusters of a 16 KiB cluster.
pub const MIN_CLUSTER_BITS_EXTENDED_L2: u32 = 14;

/// How far past the end of the device the cluster allocator looks for a free cluster, in
/// bytes. Clusters past the end hold no data; non-zero refcounts there are leaks (a crash
/// while appending leaves a few). Refcounts claiming everything further out are hostile or
/// broken: without this bound one write could scan 2^35 clusters (hours) and grow the
/// device by terabytes. Such a write fails with EIO; `qcow2 check -r leaks` repairs it.
pub const MAX_ALLOC_PAST_END: u64 = 256 << 20;

/// Largest slice cache we build for one image, in bytes (a misconfiguration guard).
pub const MAX_CACHE_BYTES: u64 = 4 << 30;

/// Most memory one shadow commit (snapshot create, delete, apply) may hold for its planned
/// refcount changes, in bytes: 4 bytes per refcount entry of each refcount block a change
/// touches (256 MiB: 2 TiB of referenced data with 64 KiB clusters and 16-bit refcounts).
/// Larger operations are refused rather than let an image make us allocate without bound.
pub const MAX_SHADOW_DELTA_BYTES: u64 = 256 << 20;

/// Most PBKDF2 iterations one LUKS key slot (or the master key's digest) may ask for:
/// 2^26, about 15 s of SHA-256 on one core of the machine this was measured on, where
/// QEMU's default `iter-time` of 2 s gives 8.8 million (7.6× fewer), so an image made on a
/// machine up to 7× faster still opens; more is a header made to burn CPU at open.
pub const MAX_LUKS_ITERATIONS: u32 = 1 << 26;

/// Most PBKDF2 iterations of all active key slots and the digest together: 2^27, what a
/// wrong key costs at worst (every slot tried), about 30 s there.
pub const MAX_LUKS_ITERATIONS_TOTAL: u64 = 1 << 27;

/// Largest LUKS header area we read at open: 16 MiB (QEMU's: 2 MiB, 8 slots of 4000
/// stripes of a 64-byte key).
pub const MAX_LUKS_HEADER_BYTES: u64 = 16 << 20;
