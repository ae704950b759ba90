//! Malformed images (ARCHITECTURE.md §9): one test per field, and per distinct bad value of it.
//!
//! Every test starts from [`fixture`], a small valid qcow2 v3 image written byte by byte
//! (each header field commented with its offset, independent of the engine's encoder),
//! mutates one thing, and asserts the specific error: the variant *and* the field it names.
//! Open-time problems are `Error::InvalidField` (or `NotQcow2`, `UnsupportedVersion`,
//! `UnsupportedFeature`); metadata found bad while serving a read is `Error::Corrupt`
//! (EIO) and must never lead to a device write. Two generated tests mutate every header
//! byte and every byte of the metadata entries and require "error or success, never a
//! panic".
//!
//! The image is opened the way a host does: an [`Exec`] over an in-memory [`MemDevice`],
//! [`Qcow2::open`], a one-layer [`Chain`], and [`Chain::read`] through [`Exec::block_on`].

use qcow2_engine::format::refcount::{
    get_refcount, max_refcount, refcount_block_offset, set_refcount,
};
use qcow2_engine::format::CompressionType;
use qcow2_engine::io::{BufSlice, HeapBuf};
use qcow2_engine::limits::{MAX_BACKING_DEPTH, MAX_L1_ENTRIES, MAX_SNAPSHOTS};
use qcow2_engine::testing::MemDevice;
use qcow2_engine::types::HostOffset;
use qcow2_engine::{Chain, Error, Exec, Field, Layer, OpenOptions, Qcow2};

// ---------------------------------------------------------------------------------------
// The fixture
// ---------------------------------------------------------------------------------------

/// log2 of the fixture's cluster size (64 KiB, QEMU's default).
const CLUSTER_BITS: u32 = 16;
/// The fixture's cluster size.
const CS: u64 = 1 << CLUSTER_BITS;
/// Virtual disk size: 1 MiB (16 guest clusters, one L1 entry).
const VIRTUAL_SIZE: u64 = 1 << 20;

// Host layout of the default fixture, one cluster each.
/// Cluster 1: the active L1 table.
const L1_OFF: u64 = CS;
/// Cluster 2: the refcount table.
const RT_OFF: u64 = 2 * CS;
/// Cluster 3: refcount block 0.
const RB_OFF: u64 = 3 * CS;
/// Cluster 4: the L2 table of guest [0, 512 MiB).
const L2_OFF: u64 = 4 * CS;
/// Cluster 5: the data cluster of guest cluster 0.
const DATA_OFF: u64 = 5 * CS;
/// Cluster 6: the snapshot table (only with `Spec::snapshot`).
const SNAP_OFF: u64 = 6 * CS;
/// Cluster 7: the snapshot's own L1 table (only with `Spec::snapshot`).
const SNAP_L1_OFF: u64 = 7 * CS;

// Header field offsets (QEMU docs/interop/qcow2.rst).
const H_MAGIC: u64 = 0;
const H_VERSION: u64 = 4;
const H_BACKING_FILE_OFFSET: u64 = 8;
const H_BACKING_FILE_SIZE: u64 = 16;
const H_CLUSTER_BITS: u64 = 20;
const H_SIZE: u64 = 24;
const H_CRYPT_METHOD: u64 = 32;
const H_L1_SIZE: u64 = 36;
const H_L1_TABLE_OFFSET: u64 = 40;
const H_REFCOUNT_TABLE_OFFSET: u64 = 48;
const H_REFCOUNT_TABLE_CLUSTERS: u64 = 56;
const H_NB_SNAPSHOTS: u64 = 60;
const H_SNAPSHOTS_OFFSET: u64 = 64;
const H_INCOMPATIBLE: u64 = 72;
const H_AUTOCLEAR: u64 = 88;
const H_REFCOUNT_ORDER: u64 = 96;
const H_HEADER_LENGTH: u64 = 100;
const H_COMPRESSION_TYPE: u64 = 104;

/// Where the default fixture's first header extension (the feature name table) starts.
const EXT_OFF: u64 = 112;
/// Where the default fixture's end-of-extensions marker sits: after the feature name
/// table's 8-byte extension header and its 8 entries of 48 bytes.
const END_EXT_OFF: u64 = EXT_OFF + 8 + 8 * 48;

// Header extension types.
const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
const EXT_FEATURE_NAME_TABLE: u32 = 0x6803_f857;
const EXT_BITMAPS: u32 = 0x2385_2875;
const EXT_ENCRYPTION: u32 = 0x0537_be77;

// Incompatible feature bits.
const INCOMPAT_DIRTY: u64 = 1 << 0;
const INCOMPAT_CORRUPT: u64 = 1 << 1;
const INCOMPAT_EXTERNAL_DATA_FILE: u64 = 1 << 2;
const INCOMPAT_COMPRESSION_TYPE: u64 = 1 << 3;
const INCOMPAT_EXTENDED_L2: u64 = 1 << 4;

// L1/L2 entry bits.
const COPIED: u64 = 1 << 63;
const COMPRESSED: u64 = 1 << 62;
const ZERO: u64 = 1;

/// What to build; `Spec::default()` is the fixture.
#[derive(Clone)]
struct Spec {
    /// 2 or 3.
    version: u32,
    /// log2 of the cluster size.
    cluster_bits: u32,
    /// 128-bit L2 entries with subcluster bitmaps (needs cluster_bits >= 14).
    extended_l2: bool,
    /// zstd instead of zlib (sets the compression type bit and byte 104).
    zstd: bool,
    /// Backing file name and, optionally, its format (backing format extension).
    backing: Option<(&'static str, Option<&'static str>)>,
    /// Extra header extensions `(type, data)`, placed before the feature name table.
    extra_exts: Vec<(u32, Vec<u8>)>,
    /// Feature name table entries `(kind, bit, name)`; empty: no table.
    feature_names: Vec<(u8, u8, &'static str)>,
    /// One internal snapshot sharing the L2 table and the data cluster.
    snapshot: bool,
}

/// The feature name table QEMU writes into every v3 image.
fn qemu_feature_names() -> Vec<(u8, u8, &'static str)> {
    vec![
        (0, 0, "dirty bit"),
        (0, 1, "corrupt bit"),
        (0, 2, "external data file"),
        (0, 3, "compression type"),
        (0, 4, "extended L2 entries"),
        (1, 0, "lazy refcounts"),
        (2, 0, "bitmaps"),
        (2, 1, "raw external data"),
    ]
}

impl Default for Spec {
    fn default() -> Self {
        Spec {
            version: 3,
            cluster_bits: CLUSTER_BITS,
            extended_l2: false,
            zstd: false,
            backing: None,
            extra_exts: Vec::new(),
            feature_names: qemu_feature_names(),
            snapshot: false,
        }
    }
}

fn put16(img: &mut [u8], off: u64, v: u16) {
    img[off as usize..off as usize + 2].copy_from_slice(&v.to_be_bytes());
}
fn put32(img: &mut [u8], off: u64, v: u32) {
    img[off as usize..off as usize + 4].copy_from_slice(&v.to_be_bytes());
}
fn put64(img: &mut [u8], off: u64, v: u64) {
    img[off as usize..off as usize + 8].copy_from_slice(&v.to_be_bytes());
}
fn get64(img: &[u8], off: u64) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&img[off as usize..off as usize + 8]);
    u64::from_be_bytes(a)
}

/// Appends one header extension: type, length, data padded to a multiple of 8.
fn push_ext(out: &mut Vec<u8>, typ: u32, data: &[u8]) {
    out.extend_from_slice(&typ.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out.resize(out.len().div_ceil(8) * 8, 0);
}

/// Byte `i` of the fixture's data cluster (guest cluster 0).
fn data_byte(i: u64) -> u8 {
    (i % 251) as u8 ^ 0x5a
}

/// The fixture: a valid 1 MiB qcow2 v3 image with 64 KiB clusters, six clusters long.
///
/// ```text
/// cluster 0  0x00000  header (112 bytes), feature name table extension, end marker
/// cluster 1  0x10000  L1 table, 1 entry      -> L2 table (COPIED)
/// cluster 2  0x20000  refcount table, 1 cluster: entry 0 -> refcount block
/// cluster 3  0x30000  refcount block, 16-bit refcounts: clusters 0..=5 have refcount 1
/// cluster 4  0x40000  L2 table: entry 0 -> data cluster (COPIED), the rest unallocated
/// cluster 5  0x50000  data of guest cluster 0 (pattern `data_byte`)
/// ```
fn fixture() -> Vec<u8> {
    build(&Spec::default())
}

/// Builds an image from `spec` (same layout as [`fixture`], scaled by the cluster size).
fn build(spec: &Spec) -> Vec<u8> {
    let cb = spec.cluster_bits;
    let cs = 1u64 << cb;
    let v3 = spec.version == 3;
    let nb_clusters = if spec.snapshot { 8 } else { 6 };
    let mut img = vec![0u8; (nb_clusters * cs) as usize];

    // Header extensions: backing format, extra ones, feature name table, end marker.
    let header_length: u32 = if v3 { 112 } else { 72 };
    let mut ext = Vec::new();
    if let Some((_, Some(fmt))) = spec.backing {
        push_ext(&mut ext, EXT_BACKING_FORMAT, fmt.as_bytes());
    }
    for (typ, data) in &spec.extra_exts {
        push_ext(&mut ext, *typ, data);
    }
    if !spec.feature_names.is_empty() {
        let mut table = Vec::new();
        for (kind, bit, name) in &spec.feature_names {
            let mut e = [0u8; 48];
            e[0] = *kind; // 0 incompatible, 1 compatible, 2 autoclear
            e[1] = *bit; // bit number
            e[2..2 + name.len()].copy_from_slice(name.as_bytes()); // NUL padded to 46 bytes
            table.extend_from_slice(&e);
        }
        push_ext(&mut ext, EXT_FEATURE_NAME_TABLE, &table);
    }
    push_ext(&mut ext, 0, &[]); // end of the extension area
    let ext_start = u64::from(header_length);
    let ext_end = ext_start + ext.len() as u64;
    assert!(ext_end <= cs, "fixture header does not fit in one cluster");
    img[ext_start as usize..ext_end as usize].copy_from_slice(&ext);

    // The backing file name follows the extensions (not NUL terminated).
    let (backing_file_offset, backing_file_size) = match spec.backing {
        Some((name, _)) => {
            img[ext_end as usize..ext_end as usize + name.len()].copy_from_slice(name.as_bytes());
            (ext_end, name.len() as u32)
        }
        None => (0, 0),
    };

    let mut incompatible = 0;
    if spec.extended_l2 {
        incompatible |= INCOMPAT_EXTENDED_L2;
    }
    if spec.zstd {
        incompatible |= INCOMPAT_COMPRESSION_TYPE;
    }
    let l2_bits = cb - if spec.extended_l2 { 4 } else { 3 };
    let l1_size = VIRTUAL_SIZE.div_ceil(1 << (cb + l2_bits)) as u32;
    let (l1, rt, rb, l2, data, snap, snap_l1) =
        (cs, 2 * cs, 3 * cs, 4 * cs, 5 * cs, 6 * cs, 7 * cs);

    // ---- Header (cluster 0) ----
    put32(&mut img, 0, 0x5146_49fb); //      0  magic "QFI\xfb"
    put32(&mut img, 4, spec.version); //     4  version
    put64(&mut img, 8, backing_file_offset); // 8  backing_file_offset (0: no backing file)
    put32(&mut img, 16, backing_file_size); // 16  backing_file_size
    put32(&mut img, 20, cb); //             20  cluster_bits
    put64(&mut img, 24, VIRTUAL_SIZE); //   24  size (virtual disk bytes)
    put32(&mut img, 32, 0); //              32  crypt_method (0: none)
    put32(&mut img, 36, l1_size); //        36  l1_size (entries)
    put64(&mut img, 40, l1); //             40  l1_table_offset
    put64(&mut img, 48, rt); //             48  refcount_table_offset
    put32(&mut img, 56, 1); //              56  refcount_table_clusters
    put32(&mut img, 60, u32::from(spec.snapshot)); // 60 nb_snapshots
    put64(&mut img, 64, if spec.snapshot { snap } else { 0 }); // 64 snapshots_offset
    if v3 {
        put64(&mut img, 72, incompatible); // 72  incompatible_features
        put64(&mut img, 80, 0); //          80  compatible_features
        put64(&mut img, 88, 0); //          88  autoclear_features
        put32(&mut img, 96, 4); //          96  refcount_order (16-bit refcounts)
        put32(&mut img, 100, header_length); // 100 header_length
        img[104] = u8::from(spec.zstd); // 104  compression_type (0 zlib, 1 zstd)
                                        // 105..112  padding to a multiple of 8
    }
    // v2 has no fields past 72: refcounts are 16 bits, the extensions start at 72.

    // With a snapshot, the L2 table and the data cluster are shared (refcount 2), so the
    // active entries must not carry COPIED.
    let copied = if spec.snapshot { 0 } else { COPIED };

    // ---- L1 table (cluster 1): entry 0 -> the L2 table ----
    put64(&mut img, l1, l2 | copied);

    // ---- Refcount table (cluster 2): entry 0 -> refcount block 0 ----
    put64(&mut img, rt, rb);

    // ---- Refcount block (cluster 3): one 16-bit big-endian refcount per host cluster ----
    for c in 0..nb_clusters {
        let shared = spec.snapshot && (c == 4 || c == 5);
        put16(&mut img, rb + 2 * c, if shared { 2 } else { 1 });
    }

    // ---- L2 table (cluster 4): entry 0 -> the data cluster ----
    if spec.extended_l2 {
        // 128-bit entries: descriptor, then the subcluster bitmap (bits 0..32 allocated,
        // bits 32..64 reads-as-zero): all 32 subclusters allocated.
        put64(&mut img, l2, data | copied);
        put64(&mut img, l2 + 8, 0x0000_0000_ffff_ffff);
    } else {
        put64(&mut img, l2, data | copied);
    }

    // ---- Data cluster (cluster 5) ----
    for i in 0..cs {
        img[(data + i) as usize] = data_byte(i);
    }

    // ---- Snapshot table (cluster 6) and the snapshot's L1 table (cluster 7) ----
    if spec.snapshot {
        let id = b"1";
        let name = b"snap-one";
        put64(&mut img, snap, snap_l1); //      +0  l1_table_offset
        put32(&mut img, snap + 8, l1_size); //  +8  l1_size
        put16(&mut img, snap + 12, id.len() as u16); // +12 id_str_size
        put16(&mut img, snap + 14, name.len() as u16); // +14 name_size
        put32(&mut img, snap + 16, 1_700_000_000); // +16 date_sec
        put32(&mut img, snap + 20, 0); //     +20 date_nsec
        put64(&mut img, snap + 24, 0); //     +24 vm_clock_nsec
        put32(&mut img, snap + 32, 0); //     +32 vm_state_size
        put32(&mut img, snap + 36, 24); //    +36 extra_data_size
        put64(&mut img, snap + 40, 0); //     +40 extra: vm_state_size_large
        put64(&mut img, snap + 48, VIRTUAL_SIZE); // +48 extra: disk_size
        put64(&mut img, snap + 56, u64::MAX); // +56 extra: icount (none)
        let p = (snap + 64) as usize;
        img[p..p + id.len()].copy_from_slice(id); //    +64 id
        img[p + id.len()..p + id.len() + name.len()].copy_from_slice(name); // name
        put64(&mut img, snap_l1, l2); // the snapshot's L1 entry 0 -> shared L2 table
    }
    img
}

// ---------------------------------------------------------------------------------------
// Opening and reading like a host
// ---------------------------------------------------------------------------------------

/// An image opened on its own executor.
struct Opened {
    exec: Exec<MemDevice>,
    mem: MemDevice,
    image: Qcow2<MemDevice>,
}

/// Opens `img` (a whole device) the way a host does.
fn open(img: Vec<u8>) -> Result<Opened, Error> {
    let exec = Exec::new();
    let mem = MemDevice::new(img);
    let dev = exec.add_device(mem.clone());
    let e = exec.clone();
    let image = exec.block_on(async move { Qcow2::open(&e, dev, OpenOptions::default()).await })?;
    Ok(Opened { exec, mem, image })
}

/// Opens `img`, failing the test if it is refused.
#[track_caller]
fn open_ok(img: Vec<u8>) -> Opened {
    open(img).unwrap_or_else(|e| panic!("image should open, got: {e}"))
}

/// Opens `img`, failing the test if it is accepted; returns the error.
#[track_caller]
fn open_err(img: Vec<u8>) -> Error {
    match open(img) {
        Ok(_) => panic!("image opened but should have been refused"),
        Err(e) => e,
    }
}

/// Largest prefix of the disk [`read_disk`] reads (generated variants may claim big disks).
const READ_CAP: u64 = 8 << 20;

/// Reads the guest disk through a one-layer chain: the whole disk, or its first
/// [`READ_CAP`] bytes and its last 64 KiB when it is bigger. Sizes are rounded down to
/// whole sectors (the chain refuses partial sectors).
fn read_disk(o: Opened) -> Result<Vec<u8>, Error> {
    let Opened { exec, image, .. } = o;
    let size = image.size() / 512 * 512;
    let chain = Chain::new(&exec, vec![Layer::Qcow2(image.into())])?;
    let mut ranges = vec![(0, size.min(READ_CAP))];
    if size > READ_CAP {
        ranges.push((size - (64 << 10), 64 << 10));
    }
    let mut out = Vec::new();
    for (off, len) in ranges {
        let buf = HeapBuf::new(len as usize);
        let (c, b) = (chain.clone(), buf.clone());
        exec.block_on(async move { c.read(off, BufSlice::whole(b)).await })?;
        out.extend_from_slice(&buf.to_vec());
    }
    Ok(out)
}

/// Refcounts of the host clusters at `host_offs`, through the image's refcount table.
fn refcounts(o: Opened, host_offs: Vec<u64>) -> Vec<Result<u64, Error>> {
    let Opened { exec, image, .. } = o;
    exec.block_on(async move {
        let mut out = Vec::with_capacity(host_offs.len());
        for off in host_offs {
            out.push(image.refcount(off).await);
        }
        out
    })
}

/// Refcount of the host cluster at `host_off`.
fn refcount_of(o: Opened, host_off: u64) -> Result<u64, Error> {
    refcounts(o, vec![host_off]).remove(0)
}

/// Asserts `e` is `InvalidField` naming `want`.
#[track_caller]
fn assert_invalid(e: Error, want: Field) {
    match e {
        Error::InvalidField { field, .. } if field == want => {
            assert_eq!(e.field(), Some(want));
        }
        other => panic!("expected InvalidField({want:?}), got {other:?}"),
    }
}

/// Asserts `e` is `Corrupt` naming `want`, reported to the guest as EIO.
#[track_caller]
fn assert_corrupt(e: Error, want: Field) {
    match e {
        Error::Corrupt { field, .. } if field == want => assert_eq!(e.errno(), 5, "EIO"),
        other => panic!("expected Corrupt({want:?}), got {other:?}"),
    }
}

/// Opens `img` (which must open), reads the whole disk, and asserts the read fails with
/// `Corrupt` naming `want` without writing anything to the device.
#[track_caller]
fn assert_read_corrupt(img: Vec<u8>, want: Field) {
    let o = open_ok(img);
    let mem = o.mem.clone();
    mem.0.borrow_mut().record = true;
    match read_disk(o) {
        Ok(_) => panic!("read succeeded, expected Corrupt({want:?})"),
        Err(e) => assert_corrupt(e, want),
    }
    assert!(
        mem.0.borrow().log.is_empty(),
        "a failed read wrote to the device"
    );
}

/// The expected guest contents of the fixture: the data cluster, then zeros.
fn expected_disk() -> Vec<u8> {
    let mut v = vec![0u8; VIRTUAL_SIZE as usize];
    for (i, b) in v.iter_mut().take(CS as usize).enumerate() {
        *b = data_byte(i as u64);
    }
    v
}

/// Sets header field `off` (u32) of `img`.
fn with32(mut img: Vec<u8>, off: u64, v: u32) -> Vec<u8> {
    put32(&mut img, off, v);
    img
}

/// Sets header field `off` (u64) of `img`.
fn with64(mut img: Vec<u8>, off: u64, v: u64) -> Vec<u8> {
    put64(&mut img, off, v);
    img
}

/// ORs incompatible feature bits into the fixture's header.
fn with_incompat(img: Vec<u8>, bits: u64) -> Vec<u8> {
    let cur = get64(&img, H_INCOMPATIBLE);
    with64(img, H_INCOMPATIBLE, cur | bits)
}

// ---------------------------------------------------------------------------------------
// The fixture itself
// ---------------------------------------------------------------------------------------

#[test]
fn fixture_opens_and_reads_back() {
    let o = open_ok(fixture());
    let h = o.image.header();
    assert_eq!(h.header.version, 3);
    assert_eq!(h.cluster_size(), CS);
    assert_eq!(o.image.size(), VIRTUAL_SIZE);
    assert!(!h.is_corrupt() && !h.is_dirty());
    assert_eq!(h.extensions.feature_names.len(), 8);
    assert_eq!(h.extensions.feature_names[2].name, "external data file");
    assert_eq!(h.backing_file, None);
    assert_eq!(h.header.compression_type, CompressionType::Zlib);
    assert!(o.image.snapshots().is_empty());
    drop(h);
    let mem = o.mem.clone();
    mem.0.borrow_mut().record = true;
    assert_eq!(read_disk(o).ok(), Some(expected_disk()));
    assert!(mem.0.borrow().log.is_empty(), "a read wrote to the device");
}

#[test]
fn fixture_refcounts_read_back() {
    for c in 0..6 {
        assert_eq!(
            refcount_of(open_ok(fixture()), c * CS),
            Ok(1),
            "cluster {c}"
        );
    }
    // Past the clusters in use, and past the refcount table's coverage: 0.
    assert_eq!(refcount_of(open_ok(fixture()), 6 * CS), Ok(0));
    assert_eq!(refcount_of(open_ok(fixture()), 1 << 50), Ok(0));
}

#[test]
fn fixture_variants_open_and_read_back() {
    let specs = [
        Spec {
            version: 2,
            feature_names: Vec::new(),
            ..Spec::default()
        },
        Spec {
            cluster_bits: 9,
            ..Spec::default()
        },
        Spec {
            cluster_bits: 21,
            ..Spec::default()
        },
        Spec {
            extended_l2: true,
            ..Spec::default()
        },
        Spec {
            cluster_bits: 14,
            extended_l2: true,
            ..Spec::default()
        },
        Spec {
            zstd: true,
            ..Spec::default()
        },
        Spec {
            backing: Some(("base.qcow2", Some("qcow2"))),
            ..Spec::default()
        },
        Spec {
            snapshot: true,
            ..Spec::default()
        },
    ];
    for spec in specs {
        let o = open_ok(build(&spec));
        let cs = 1usize << spec.cluster_bits;
        let got = read_disk(o).unwrap_or_else(|e| panic!("read failed: {e}"));
        let want: Vec<u8> = (0..VIRTUAL_SIZE)
            .map(|i| if i < cs as u64 { data_byte(i) } else { 0 })
            .collect();
        assert!(
            got == want,
            "cluster_bits {} read back wrong",
            spec.cluster_bits
        );
    }
}

// ---------------------------------------------------------------------------------------
// magic, version
// ---------------------------------------------------------------------------------------

#[test]
fn magic_qfi_nul_is_not_qcow2() {
    let mut img = fixture();
    img[3] = 0;
    assert_eq!(open_err(img), Error::NotQcow2(0x5146_4900));
}

#[test]
fn magic_zero_is_not_qcow2() {
    assert_eq!(open_err(with32(fixture(), H_MAGIC, 0)), Error::NotQcow2(0));
}

#[test]
fn magic_qcow1_style_is_not_qcow2() {
    // "QFI\xfa": off by one in the last byte.
    assert_eq!(
        open_err(with32(fixture(), H_MAGIC, 0x5146_49fa)),
        Error::NotQcow2(0x5146_49fa)
    );
}

#[test]
fn version_1_is_unsupported() {
    assert_eq!(
        open_err(with32(fixture(), H_VERSION, 1)),
        Error::UnsupportedVersion(1)
    );
}

#[test]
fn version_4_is_unsupported() {
    assert_eq!(
        open_err(with32(fixture(), H_VERSION, 4)),
        Error::UnsupportedVersion(4)
    );
}

#[test]
fn version_0_and_max_are_unsupported() {
    assert_eq!(
        open_err(with32(fixture(), H_VERSION, 0)),
        Error::UnsupportedVersion(0)
    );
    assert_eq!(
        open_err(with32(fixture(), H_VERSION, u32::MAX)),
        Error::UnsupportedVersion(u32::MAX)
    );
}

#[test]
fn device_shorter_than_a_header_is_refused() {
    let mut img = fixture();
    img.truncate(100);
    assert_invalid(open_err(img), Field::HeaderLength);
}

#[test]
fn image_truncated_after_cluster_0_is_refused() {
    // The header is intact but every table lies past the end of the device.
    let mut img = fixture();
    img.truncate(CS as usize);
    assert_invalid(open_err(img), Field::L1TableOffset);
}

// ---------------------------------------------------------------------------------------
// cluster_bits
// ---------------------------------------------------------------------------------------

#[test]
fn cluster_bits_8_is_refused() {
    assert_invalid(
        open_err(with32(fixture(), H_CLUSTER_BITS, 8)),
        Field::ClusterBits,
    );
}

#[test]
fn cluster_bits_22_is_refused() {
    assert_invalid(
        open_err(with32(fixture(), H_CLUSTER_BITS, 22)),
        Field::ClusterBits,
    );
}

#[test]
fn cluster_bits_that_would_overflow_a_shift_are_refused() {
    // Checked before any `1 << cluster_bits`.
    for bits in [0, 31, 32, 63, 64, 65, u32::MAX] {
        assert_invalid(
            open_err(with32(fixture(), H_CLUSTER_BITS, bits)),
            Field::ClusterBits,
        );
    }
}

#[test]
fn extended_l2_with_8k_clusters_is_refused() {
    let img = build(&Spec {
        extended_l2: true,
        ..Spec::default()
    });
    // Subclusters of 8 KiB / 32 = 256 bytes are below a sector.
    assert_invalid(
        open_err(with32(img, H_CLUSTER_BITS, 13)),
        Field::ClusterBits,
    );
}

// ---------------------------------------------------------------------------------------
// header_length
// ---------------------------------------------------------------------------------------

#[test]
fn header_length_96_is_refused() {
    assert_invalid(
        open_err(with32(fixture(), H_HEADER_LENGTH, 96)),
        Field::HeaderLength,
    );
}

#[test]
fn header_length_0_is_refused() {
    assert_invalid(
        open_err(with32(fixture(), H_HEADER_LENGTH, 0)),
        Field::HeaderLength,
    );
}

#[test]
fn header_length_105_is_refused() {
    assert_invalid(
        open_err(with32(fixture(), H_HEADER_LENGTH, 105)),
        Field::HeaderLength,
    );
}

#[test]
fn header_length_not_multiple_of_8_is_refused() {
    assert_invalid(
        open_err(with32(fixture(), H_HEADER_LENGTH, 116)),
        Field::HeaderLength,
    );
}

#[test]
fn header_length_larger_than_cluster_is_refused() {
    for hl in [CS as u32 + 8, u32::MAX - 7] {
        assert_invalid(
            open_err(with32(fixture(), H_HEADER_LENGTH, hl)),
            Field::HeaderLength,
        );
    }
}

#[test]
fn header_length_104_opens() {
    // The smallest v3 header: no compression_type byte, extensions start at 104 (where
    // the fixture has zeros: an end marker), so the feature name table is not seen.
    let o = open_ok(with32(fixture(), H_HEADER_LENGTH, 104));
    assert_eq!(o.image.header().header.header_length, 104);
    assert!(o.image.header().extensions.feature_names.is_empty());
    assert_eq!(read_disk(o).ok(), Some(expected_disk()));
}

// ---------------------------------------------------------------------------------------
// backing_file_offset / backing_file_size
// ---------------------------------------------------------------------------------------

fn backed() -> Vec<u8> {
    build(&Spec {
        backing: Some(("base.qcow2", Some("qcow2"))),
        ..Spec::default()
    })
}

#[test]
fn backing_file_fixture_opens() {
    let o = open_ok(backed());
    let h = o.image.header();
    assert_eq!(h.backing_file.as_deref(), Some("base.qcow2"));
    assert_eq!(h.extensions.backing_format.as_deref(), Some("qcow2"));
}

#[test]
fn backing_file_offset_past_first_cluster_is_refused() {
    assert_invalid(
        open_err(with64(backed(), H_BACKING_FILE_OFFSET, CS)),
        Field::BackingFileOffset,
    );
}

#[test]
fn backing_file_offset_huge_is_refused() {
    assert_invalid(
        open_err(with64(backed(), H_BACKING_FILE_OFFSET, u64::MAX)),
        Field::BackingFileOffset,
    );
}

#[test]
fn backing_file_offset_inside_header_is_refused() {
    assert_invalid(
        open_err(with64(backed(), H_BACKING_FILE_OFFSET, 16)),
        Field::BackingFileOffset,
    );
}

#[test]
fn backing_file_size_1024_is_refused() {
    assert_invalid(
        open_err(with32(backed(), H_BACKING_FILE_SIZE, 1024)),
        Field::BackingFileSize,
    );
}

#[test]
fn backing_file_size_max_is_refused() {
    assert_invalid(
        open_err(with32(backed(), H_BACKING_FILE_SIZE, u32::MAX)),
        Field::BackingFileSize,
    );
}

#[test]
fn backing_file_name_past_first_cluster_is_refused() {
    let img = with64(backed(), H_BACKING_FILE_OFFSET, CS - 8);
    assert_invalid(
        open_err(with32(img, H_BACKING_FILE_SIZE, 16)),
        Field::BackingFileSize,
    );
}

#[test]
fn backing_file_name_with_nul_or_bad_utf8_is_refused() {
    let off = get64(&backed(), H_BACKING_FILE_OFFSET) as usize;
    let mut img = backed();
    img[off + 4] = 0;
    assert_invalid(open_err(img), Field::BackingFileName);
    let mut img = backed();
    img[off + 4] = 0xff;
    assert_invalid(open_err(img), Field::BackingFileName);
}

#[test]
fn backing_format_extension_of_16_bytes_is_refused() {
    let img = build(&Spec {
        backing: Some(("base.img", Some("sixteen-bytes-16"))),
        ..Spec::default()
    });
    assert_invalid(open_err(img), Field::BackingFormatExtension);
}

#[test]
fn backing_format_extension_of_40_bytes_is_refused() {
    let img = build(&Spec {
        backing: Some(("base.img", Some("a-format-name-far-longer-than-16-bytes!!"))),
        ..Spec::default()
    });
    assert_invalid(open_err(img), Field::BackingFormatExtension);
}

#[test]
fn backing_format_extension_of_15_bytes_opens() {
    let img = build(&Spec {
        backing: Some(("base.img", Some("fifteen-bytes15"))),
        ..Spec::default()
    });
    let o = open_ok(img);
    assert_eq!(
        o.image.header().extensions.backing_format.as_deref(),
        Some("fifteen-bytes15")
    );
}

// ---------------------------------------------------------------------------------------
// Header extensions
// ---------------------------------------------------------------------------------------

#[test]
fn extension_length_past_the_area_is_refused() {
    // The feature name table's length field.
    for len in [u32::MAX - 7, CS as u32, (CS - EXT_OFF - 8) as u32 + 8] {
        assert_invalid(
            open_err(with32(fixture(), EXT_OFF + 4, len)),
            Field::HeaderExtension,
        );
    }
}

#[test]
fn extension_running_into_backing_file_name_is_refused() {
    // The backing format extension claims the bytes of the name that follows the area.
    let img = backed();
    let name_off = get64(&img, H_BACKING_FILE_OFFSET);
    // First extension of `backed()` is the backing format; make it 8 bytes longer than
    // the whole area.
    let len = (name_off - 112 - 8) as u32 + 8;
    assert_invalid(open_err(with32(img, 112 + 4, len)), Field::HeaderExtension);
}

#[test]
fn unterminated_extension_chain_is_refused() {
    // Replace the end marker with an unknown extension that runs exactly to the end of
    // cluster 0: the chain never ends.
    let mut img = fixture();
    put32(&mut img, END_EXT_OFF, 0x1234_5678);
    put32(&mut img, END_EXT_OFF + 4, (CS - END_EXT_OFF - 8) as u32);
    assert_invalid(open_err(img), Field::HeaderExtension);
}

#[test]
fn unterminated_extension_chain_before_backing_name_is_refused() {
    // The end marker sits right before the backing file name; make it an empty unknown
    // extension, so the chain runs into the name.
    let img = backed();
    let name_off = get64(&img, H_BACKING_FILE_OFFSET);
    assert_invalid(
        open_err(with32(img, name_off - 8, 0x1234_5678)),
        Field::HeaderExtension,
    );
}

#[test]
fn unknown_extension_is_preserved() {
    let img = build(&Spec {
        extra_exts: vec![(0x1234_5678, b"opaque".to_vec())],
        ..Spec::default()
    });
    let o = open_ok(img);
    assert_eq!(
        o.image.header().extensions.unknown,
        vec![(0x1234_5678, b"opaque".to_vec())]
    );
}

#[test]
fn feature_name_table_of_odd_length_is_refused() {
    assert_invalid(
        open_err(with32(fixture(), EXT_OFF + 4, 8 * 48 - 1)),
        Field::FeatureNameTable,
    );
}

/// The bitmaps extension data: nb_bitmaps, reserved, directory size, directory offset.
fn bitmaps_ext(nb: u32, reserved: u32, dir_size: u64, dir_off: u64) -> Vec<u8> {
    let mut d = vec![0u8; 24];
    put32(&mut d, 0, nb);
    put32(&mut d, 4, reserved);
    put64(&mut d, 8, dir_size);
    put64(&mut d, 16, dir_off);
    d
}

/// The fixture with a bitmaps extension and the autoclear bitmaps bit set.
fn with_bitmaps(data: Vec<u8>) -> Vec<u8> {
    let img = build(&Spec {
        extra_exts: vec![(EXT_BITMAPS, data)],
        ..Spec::default()
    });
    with64(img, H_AUTOCLEAR, 1)
}

#[test]
fn bitmaps_extension_valid_opens() {
    let o = open_ok(with_bitmaps(bitmaps_ext(1, 0, 512, 6 * CS)));
    let b = o.image.header().extensions.bitmaps.clone();
    assert_eq!(
        b.map(|b| (b.nb_bitmaps, b.directory_offset)),
        Some((1, 6 * CS))
    );
}

#[test]
fn bitmaps_extension_ignored_without_autoclear_bit() {
    // A stale extension (autoclear bit cleared by an old writer) is ignored, not refused.
    let img = build(&Spec {
        extra_exts: vec![(EXT_BITMAPS, bitmaps_ext(0, 0, 0, 7))],
        ..Spec::default()
    });
    let o = open_ok(img);
    assert_eq!(o.image.header().extensions.bitmaps, None);
}

#[test]
fn bitmaps_extension_of_wrong_length_is_refused() {
    for len in [0, 16, 23, 32] {
        let mut d = bitmaps_ext(1, 0, 512, 6 * CS);
        d.resize(len, 0);
        assert_invalid(open_err(with_bitmaps(d)), Field::BitmapsExtension);
    }
}

#[test]
fn bitmaps_extension_with_zero_bitmaps_is_refused() {
    assert_invalid(
        open_err(with_bitmaps(bitmaps_ext(0, 0, 512, 6 * CS))),
        Field::BitmapsExtension,
    );
}

#[test]
fn bitmaps_extension_with_too_many_bitmaps_is_refused() {
    assert_invalid(
        open_err(with_bitmaps(bitmaps_ext(65536, 0, 512, 6 * CS))),
        Field::BitmapsExtension,
    );
}

#[test]
fn bitmaps_extension_with_bad_directory_size_is_refused() {
    for size in [0, (64 << 20) + 1, u64::MAX] {
        assert_invalid(
            open_err(with_bitmaps(bitmaps_ext(1, 0, size, 6 * CS))),
            Field::BitmapsExtension,
        );
    }
}

#[test]
fn bitmaps_extension_with_unaligned_directory_is_refused() {
    for off in [6 * CS + 512, 0, u64::MAX] {
        assert_invalid(
            open_err(with_bitmaps(bitmaps_ext(1, 0, 512, off))),
            Field::BitmapsExtension,
        );
    }
}

#[test]
fn bitmaps_extension_with_reserved_field_is_refused() {
    assert_invalid(
        open_err(with_bitmaps(bitmaps_ext(1, 1, 512, 6 * CS))),
        Field::BitmapsExtension,
    );
}

#[test]
fn encryption_extension_is_refused() {
    let mut d = vec![0u8; 16];
    put64(&mut d, 0, 6 * CS);
    put64(&mut d, 8, 4096);
    let img = build(&Spec {
        extra_exts: vec![(EXT_ENCRYPTION, d)],
        ..Spec::default()
    });
    assert_invalid(open_err(img), Field::EncryptionExtension);
}

// ---------------------------------------------------------------------------------------
// Incompatible features, corrupt and dirty bits
// ---------------------------------------------------------------------------------------

#[test]
fn unknown_incompatible_bit_is_refused_by_its_table_name() {
    let mut names = qemu_feature_names();
    names.push((0, 9, "frobnicated clusters"));
    let img = build(&Spec {
        feature_names: names,
        ..Spec::default()
    });
    match open_err(with_incompat(img, 1 << 9)) {
        Error::UnsupportedFeature(msg) => {
            assert!(msg.contains("'frobnicated clusters' (bit 9)"), "{msg}")
        }
        other => panic!("expected UnsupportedFeature, got {other:?}"),
    }
}

#[test]
fn unknown_incompatible_bit_without_a_name_is_refused() {
    match open_err(with_incompat(fixture(), 1 << 63)) {
        Error::UnsupportedFeature(msg) => {
            assert!(msg.contains("unknown feature bit 63"), "{msg}")
        }
        other => panic!("expected UnsupportedFeature, got {other:?}"),
    }
}

#[test]
fn external_data_file_bit_is_refused_by_its_table_name() {
    match open_err(with_incompat(fixture(), INCOMPAT_EXTERNAL_DATA_FILE)) {
        Error::UnsupportedFeature(msg) => {
            assert!(msg.contains("'external data file' (bit 2)"), "{msg}")
        }
        other => panic!("expected UnsupportedFeature, got {other:?}"),
    }
}

#[test]
fn corrupt_bit_opens_read_only_and_is_reported() {
    // There is no write path yet: the image opens (for inspection and reads) and reports
    // the bit so a host refuses writes.
    let o = open_ok(with_incompat(fixture(), INCOMPAT_CORRUPT));
    assert!(o.image.header().is_corrupt());
    assert_eq!(read_disk(o).ok(), Some(expected_disk()));
}

#[test]
fn dirty_bit_opens_and_is_reported() {
    let o = open_ok(with_incompat(fixture(), INCOMPAT_DIRTY));
    assert!(o.image.header().is_dirty());
    assert!(!o.image.header().is_corrupt());
    assert_eq!(read_disk(o).ok(), Some(expected_disk()));
}

// ---------------------------------------------------------------------------------------
// compression_type, crypt_method, refcount_order
// ---------------------------------------------------------------------------------------

#[test]
fn compression_type_bit_with_zlib_is_refused() {
    assert_invalid(
        open_err(with_incompat(fixture(), INCOMPAT_COMPRESSION_TYPE)),
        Field::CompressionType,
    );
}

#[test]
fn compression_type_2_is_refused() {
    let mut img = with_incompat(fixture(), INCOMPAT_COMPRESSION_TYPE);
    img[H_COMPRESSION_TYPE as usize] = 2;
    match open_err(img) {
        e @ Error::InvalidField {
            field: Field::CompressionType,
            value: 2,
            ..
        } => assert_eq!(e.errno(), 5),
        other => panic!("expected InvalidField(CompressionType, 2), got {other:?}"),
    }
}

#[test]
fn compression_type_zstd_without_bit_is_refused() {
    let mut img = fixture();
    img[H_COMPRESSION_TYPE as usize] = 1;
    assert_invalid(open_err(img), Field::CompressionType);
}

#[test]
fn compression_type_zstd_with_bit_opens() {
    let o = open_ok(build(&Spec {
        zstd: true,
        ..Spec::default()
    }));
    assert_eq!(
        o.image.header().header.compression_type,
        CompressionType::Zstd
    );
}

#[test]
fn crypt_method_aes_is_refused() {
    assert_invalid(
        open_err(with32(fixture(), H_CRYPT_METHOD, 1)),
        Field::CryptMethod,
    );
}

#[test]
fn crypt_method_luks_without_its_extension_is_refused() {
    assert_invalid(
        open_err(with32(fixture(), H_CRYPT_METHOD, 2)),
        Field::EncryptionExtension,
    );
}

/// A LUKS image: crypt_method 2 and the extension pointing at `area` placed at cluster 6.
fn luks_image(area: &[u8], ext: Option<(u64, u64)>) -> Vec<u8> {
    let (off, len) = ext.unwrap_or((6 * CS, area.len() as u64));
    let mut d = vec![0u8; 16];
    put64(&mut d, 0, off);
    put64(&mut d, 8, len);
    let mut img = build(&Spec {
        extra_exts: vec![(EXT_ENCRYPTION, d)],
        ..Spec::default()
    });
    put32(&mut img, H_CRYPT_METHOD, 2);
    img.resize((6 * CS) as usize, 0);
    img.extend_from_slice(area);
    img
}

fn luks_area(iterations: u32) -> Vec<u8> {
    qcow2_engine::crypto::build::build(&qcow2_engine::crypto::build::LuksBuild {
        cipher: ("aes", "xts-plain64"),
        hash: qcow2_engine::crypto::hash::HashAlg::Sha256,
        master_key: &[1u8; 64],
        secret: b"pw",
        iterations,
        seed: 7,
    })
}

#[test]
fn luks_image_opens_locked_and_hostile_luks_areas_are_refused() {
    let area = luks_area(1000);
    let o = open_ok(luks_image(&area, None));
    assert!(o.image.encrypted() && !o.image.luks().unwrap().unlocked());
    let len = area.len() as u64;
    // The area: unaligned, empty, huge, past the device.
    for ext in [
        (6 * CS + 512, len),
        (6 * CS, 0),
        (6 * CS, 1 << 40),
        (6 * CS, len + CS),
        (u64::MAX - CS + 1, len),
    ] {
        assert_invalid(
            open_err(luks_image(&area, Some(ext))),
            Field::EncryptionExtension,
        );
    }
    // Its contents: garbage; iterations that would burn minutes of CPU at open.
    assert_invalid(
        open_err(luks_image(&vec![0xa5; area.len()], None)),
        Field::LuksHeader,
    );
    let mut burn = area.clone();
    burn[212..216].copy_from_slice(&u32::MAX.to_be_bytes()); // slot 0 iterations
    let t = std::time::Instant::now();
    assert_invalid(open_err(luks_image(&burn, None)), Field::LuksHeader);
    assert!(t.elapsed().as_secs() < 2);
}

#[test]
fn refcount_order_7_is_refused() {
    assert_invalid(
        open_err(with32(fixture(), H_REFCOUNT_ORDER, 7)),
        Field::RefcountOrder,
    );
}

#[test]
fn refcount_order_max_is_refused() {
    assert_invalid(
        open_err(with32(fixture(), H_REFCOUNT_ORDER, u32::MAX)),
        Field::RefcountOrder,
    );
}

#[test]
fn refcount_order_0_to_6_open() {
    for order in 0..=6 {
        let o = open_ok(with32(fixture(), H_REFCOUNT_ORDER, order));
        assert_eq!(o.image.header().refcount_bits(), 1 << order);
    }
}

// ---------------------------------------------------------------------------------------
// Refcount table
// ---------------------------------------------------------------------------------------

#[test]
fn refcount_table_of_0_clusters_is_refused() {
    assert_invalid(
        open_err(with32(fixture(), H_REFCOUNT_TABLE_CLUSTERS, 0)),
        Field::RefcountTableClusters,
    );
}

#[test]
fn refcount_table_huge_is_refused() {
    // 8 MiB + one cluster, and the largest count: both above the cap, never allocated.
    for n in [(8 << 20) / CS as u32 + 1, u32::MAX] {
        assert_invalid(
            open_err(with32(fixture(), H_REFCOUNT_TABLE_CLUSTERS, n)),
            Field::RefcountTableClusters,
        );
    }
}

#[test]
fn refcount_table_at_cap_but_past_device_is_refused() {
    assert_invalid(
        open_err(with32(
            fixture(),
            H_REFCOUNT_TABLE_CLUSTERS,
            (8 << 20) / CS as u32,
        )),
        Field::RefcountTableOffset,
    );
}

#[test]
fn refcount_table_offset_misaligned_is_refused() {
    assert_invalid(
        open_err(with64(fixture(), H_REFCOUNT_TABLE_OFFSET, RT_OFF + 512)),
        Field::RefcountTableOffset,
    );
}

#[test]
fn refcount_table_offset_zero_is_refused() {
    assert_invalid(
        open_err(with64(fixture(), H_REFCOUNT_TABLE_OFFSET, 0)),
        Field::RefcountTableOffset,
    );
}

#[test]
fn refcount_table_offset_past_end_is_refused() {
    assert_invalid(
        open_err(with64(fixture(), H_REFCOUNT_TABLE_OFFSET, 6 * CS)),
        Field::RefcountTableOffset,
    );
}

#[test]
fn refcount_table_offset_overflowing_is_refused() {
    assert_invalid(
        open_err(with64(
            fixture(),
            H_REFCOUNT_TABLE_OFFSET,
            u64::MAX - CS + 1,
        )),
        Field::RefcountTableOffset,
    );
}

// ---------------------------------------------------------------------------------------
// L1 table and size
// ---------------------------------------------------------------------------------------

#[test]
fn l1_size_max_is_refused() {
    assert_invalid(
        open_err(with32(fixture(), H_L1_SIZE, u32::MAX)),
        Field::L1Size,
    );
}

#[test]
fn l1_size_above_cap_is_refused() {
    assert_invalid(
        open_err(with32(fixture(), H_L1_SIZE, MAX_L1_ENTRIES as u32 + 1)),
        Field::L1Size,
    );
}

#[test]
fn l1_size_0_for_nonempty_disk_is_refused() {
    assert_invalid(open_err(with32(fixture(), H_L1_SIZE, 0)), Field::L1Size);
}

#[test]
fn l1_too_small_for_size_is_refused() {
    // One L1 entry covers 512 MiB with 64 KiB clusters.
    assert_invalid(
        open_err(with64(fixture(), H_SIZE, (512 << 20) + 512)),
        Field::L1Size,
    );
}

#[test]
fn l1_table_offset_misaligned_is_refused() {
    assert_invalid(
        open_err(with64(fixture(), H_L1_TABLE_OFFSET, L1_OFF + 8)),
        Field::L1TableOffset,
    );
}

#[test]
fn l1_table_offset_zero_is_refused() {
    assert_invalid(
        open_err(with64(fixture(), H_L1_TABLE_OFFSET, 0)),
        Field::L1TableOffset,
    );
}

#[test]
fn l1_table_offset_past_end_is_refused() {
    assert_invalid(
        open_err(with64(fixture(), H_L1_TABLE_OFFSET, 6 * CS)),
        Field::L1TableOffset,
    );
}

#[test]
fn l1_table_offset_overflowing_is_refused() {
    let img = with32(fixture(), H_L1_SIZE, 1 << 20);
    assert_invalid(
        open_err(with64(img, H_L1_TABLE_OFFSET, u64::MAX - CS + 1)),
        Field::L1TableOffset,
    );
}

#[test]
fn empty_l1_table_with_wild_offset_does_not_panic() {
    // A 0-byte disk needs no L1 table; its offset must still not make open do overflowing
    // arithmetic (regression: `read_bytes` rounded u64::MAX up to a sector and overflowed).
    let img = with64(fixture(), H_SIZE, 0);
    let img = with32(img, H_L1_SIZE, 0);
    assert_invalid(
        open_err(with64(img.clone(), H_L1_TABLE_OFFSET, u64::MAX)),
        Field::L1TableOffset,
    );
    // An aligned offset anywhere is fine for an empty table (QEMU writes such images).
    let o = open_ok(with64(img, H_L1_TABLE_OFFSET, u64::MAX - CS + 1));
    assert_eq!(o.image.size(), 0);
    assert_eq!(read_disk(o).ok(), Some(Vec::new()));
}

#[test]
fn size_max_is_refused() {
    assert_invalid(open_err(with64(fixture(), H_SIZE, u64::MAX)), Field::Size);
}

#[test]
fn size_above_2_pow_61_is_refused() {
    assert_invalid(
        open_err(with64(fixture(), H_SIZE, (1 << 61) + 512)),
        Field::Size,
    );
}

#[test]
fn size_beyond_what_l1_can_address_is_refused() {
    // 512-byte clusters: one L1 entry covers 32 KiB, a 32 MiB L1 table 128 GiB.
    let img = build(&Spec {
        cluster_bits: 9,
        ..Spec::default()
    });
    assert_invalid(open_err(with64(img, H_SIZE, 1 << 40)), Field::Size);
}

// ---------------------------------------------------------------------------------------
// Snapshot table
// ---------------------------------------------------------------------------------------

fn snapshotted() -> Vec<u8> {
    build(&Spec {
        snapshot: true,
        ..Spec::default()
    })
}

#[test]
fn snapshot_fixture_opens() {
    let o = open_ok(snapshotted());
    let s = o.image.snapshots();
    assert_eq!(s.len(), 1);
    assert_eq!((s[0].id.as_str(), s[0].name.as_str()), ("1", "snap-one"));
    assert_eq!(s[0].l1_table_offset, SNAP_L1_OFF);
    assert_eq!(s[0].disk_size(), Some(VIRTUAL_SIZE));
    assert_eq!(s[0].icount(), None);
    assert_eq!(read_disk(o).ok(), Some(expected_disk()));
}

#[test]
fn nb_snapshots_above_cap_is_refused() {
    for n in [MAX_SNAPSHOTS as u32 + 1, u32::MAX] {
        assert_invalid(
            open_err(with32(snapshotted(), H_NB_SNAPSHOTS, n)),
            Field::NbSnapshots,
        );
    }
}

#[test]
fn nb_snapshots_past_device_is_refused() {
    // 10000 entries of at least 40 bytes cannot fit in the two clusters left.
    assert_invalid(
        open_err(with32(snapshotted(), H_NB_SNAPSHOTS, 10000)),
        Field::SnapshotsOffset,
    );
}

#[test]
fn snapshots_offset_misaligned_is_refused() {
    assert_invalid(
        open_err(with64(snapshotted(), H_SNAPSHOTS_OFFSET, SNAP_OFF + 8)),
        Field::SnapshotsOffset,
    );
}

#[test]
fn snapshots_offset_zero_is_refused() {
    assert_invalid(
        open_err(with64(snapshotted(), H_SNAPSHOTS_OFFSET, 0)),
        Field::SnapshotsOffset,
    );
}

#[test]
fn snapshots_offset_past_end_is_refused() {
    for off in [8 * CS, u64::MAX - CS + 1] {
        assert_invalid(
            open_err(with64(snapshotted(), H_SNAPSHOTS_OFFSET, off)),
            Field::SnapshotsOffset,
        );
    }
}

#[test]
fn snapshot_extra_data_above_1024_is_refused() {
    assert_invalid(
        open_err(with32(snapshotted(), SNAP_OFF + 36, 1025)),
        Field::SnapshotTable,
    );
}

#[test]
fn snapshot_entry_past_device_end_is_refused() {
    // id and name of 64 KiB - 1 each run past the end of the 8-cluster image.
    let mut img = snapshotted();
    put16(&mut img, SNAP_OFF + 12, u16::MAX);
    put16(&mut img, SNAP_OFF + 14, u16::MAX);
    assert_invalid(open_err(img), Field::SnapshotTable);
}

#[test]
fn snapshot_l1_offset_misaligned_is_refused() {
    assert_invalid(
        open_err(with64(snapshotted(), SNAP_OFF, SNAP_L1_OFF + 512)),
        Field::SnapshotL1Table,
    );
}

#[test]
fn snapshot_l1_offset_zero_is_refused() {
    assert_invalid(
        open_err(with64(snapshotted(), SNAP_OFF, 0)),
        Field::SnapshotL1Table,
    );
}

#[test]
fn snapshot_l1_offset_past_end_is_refused() {
    for off in [8 * CS, u64::MAX - CS + 1] {
        assert_invalid(
            open_err(with64(snapshotted(), SNAP_OFF, off)),
            Field::SnapshotL1Table,
        );
    }
}

#[test]
fn snapshot_l1_size_huge_is_refused() {
    for n in [MAX_L1_ENTRIES as u32 + 1, u32::MAX] {
        assert_invalid(
            open_err(with32(snapshotted(), SNAP_OFF + 8, n)),
            Field::SnapshotL1Table,
        );
    }
}

// ---------------------------------------------------------------------------------------
// L1 and L2 entries (found while reading: Corrupt, EIO, no write)
// ---------------------------------------------------------------------------------------

fn with_l1_entry(v: u64) -> Vec<u8> {
    with64(fixture(), L1_OFF, v)
}

fn with_l2_entry(v: u64) -> Vec<u8> {
    with64(fixture(), L2_OFF, v)
}

#[test]
fn l1_entry_unaligned_is_corrupt() {
    assert_read_corrupt(with_l1_entry(COPIED | (L2_OFF + 512)), Field::L1Entry);
}

#[test]
fn l1_entry_low_reserved_bits_are_corrupt() {
    assert_read_corrupt(with_l1_entry(COPIED | L2_OFF | 1), Field::L1Entry);
}

#[test]
fn l1_entry_high_reserved_bits_are_corrupt() {
    assert_read_corrupt(with_l1_entry(COPIED | L2_OFF | (1 << 56)), Field::L1Entry);
    assert_read_corrupt(with_l1_entry(L2_OFF | COMPRESSED), Field::L1Entry);
}

#[test]
fn l1_entry_past_device_end_is_corrupt() {
    assert_read_corrupt(with_l1_entry(COPIED | (6 * CS)), Field::L1Entry);
    assert_read_corrupt(with_l1_entry(0x00ff_ffff_ffff_0000), Field::L1Entry);
}

#[test]
fn l1_entry_offset_zero_with_copied_is_corrupt() {
    assert_read_corrupt(with_l1_entry(COPIED), Field::L1Entry);
}

#[test]
fn l2_entry_unaligned_is_corrupt() {
    assert_read_corrupt(with_l2_entry(COPIED | (DATA_OFF + 512)), Field::L2Entry);
}

#[test]
fn l2_entry_reserved_bits_are_corrupt() {
    for bit in [1, 8, 56, 61] {
        assert_read_corrupt(
            with_l2_entry(COPIED | DATA_OFF | (1 << bit)),
            Field::L2Entry,
        );
    }
}

#[test]
fn l2_entry_past_device_end_is_corrupt() {
    assert_read_corrupt(with_l2_entry(COPIED | (6 * CS)), Field::L2Entry);
    assert_read_corrupt(with_l2_entry(0x00ff_ffff_ffff_0000), Field::L2Entry);
}

#[test]
fn l2_entry_offset_zero_with_copied_is_corrupt() {
    assert_read_corrupt(with_l2_entry(COPIED), Field::L2Entry);
}

#[test]
fn l2_zero_flag_reads_zeros_in_v3() {
    // Preallocated zero cluster: reads as zeros, the data on disk is not returned.
    let o = open_ok(with_l2_entry(COPIED | DATA_OFF | ZERO));
    assert_eq!(read_disk(o).ok(), Some(vec![0u8; VIRTUAL_SIZE as usize]));
}

#[test]
fn l2_zero_flag_in_v2_is_corrupt() {
    let spec = Spec {
        version: 2,
        feature_names: Vec::new(),
        ..Spec::default()
    };
    assert_read_corrupt(with64(build(&spec), L2_OFF, ZERO), Field::L2Entry);
    assert_read_corrupt(
        with64(build(&spec), L2_OFF, COPIED | DATA_OFF | ZERO),
        Field::L2Entry,
    );
}

fn extended() -> Vec<u8> {
    build(&Spec {
        extended_l2: true,
        ..Spec::default()
    })
}

#[test]
fn extended_l2_partial_bitmap_reads_back() {
    // Subclusters 0..16 allocated, 16..32 reads-as-zero: the second half reads zeros.
    let o = open_ok(with64(extended(), L2_OFF + 8, 0xffff_0000_0000_ffff));
    let got = read_disk(o).unwrap_or_else(|e| panic!("read failed: {e}"));
    let mut want = expected_disk();
    want[(CS / 2) as usize..CS as usize].fill(0);
    assert!(got == want);
}

#[test]
fn extended_l2_alloc_and_zero_bits_both_set_is_corrupt() {
    assert_read_corrupt(
        with64(extended(), L2_OFF + 8, 0x0000_0001_ffff_ffff),
        Field::SubclusterBitmap,
    );
}

#[test]
fn extended_l2_allocated_subclusters_without_cluster_is_corrupt() {
    let img = with64(extended(), L2_OFF, 0);
    assert_read_corrupt(with64(img, L2_OFF + 8, 1), Field::SubclusterBitmap);
}

/// Guest cluster 1 of an extended-L2 fixture stored compressed as `stream`, its
/// (reserved) subcluster bitmap `bitmap`.
fn extended_compressed(zstd: bool, stream: &[u8], bitmap: u64) -> Vec<u8> {
    let spec = Spec {
        extended_l2: true,
        zstd,
        ..Spec::default()
    };
    with64(with_compressed(&spec, stream), L2_OFF + 24, bitmap)
}

#[test]
fn extended_l2_compressed_cluster_reads_back() {
    // QEMU writes compressed clusters into extended-L2 images, their bitmap 0.
    for (zstd, ct) in [
        (false, CompressionType::Zlib),
        (true, CompressionType::Zstd),
    ] {
        let img = extended_compressed(zstd, &compress(ct, &cluster_1()), 0);
        let got = read_disk(open_ok(img)).unwrap_or_else(|e| panic!("{ct:?}: {e}"));
        let mut want = expected_disk();
        want[CS as usize..2 * CS as usize].copy_from_slice(&cluster_1());
        assert!(got == want, "{ct:?} cluster read back wrong");
    }
}

#[test]
fn extended_l2_compressed_entry_with_a_bitmap_is_corrupt() {
    // The bitmap of a compressed cluster is reserved (QEMU's check: "compressed cluster
    // with non-zero subcluster allocation bitmap").
    let stream = compress(CompressionType::Zlib, &cluster_1());
    for bitmap in [1, 1 << 31, 1 << 32, u64::MAX] {
        assert_read_corrupt(
            extended_compressed(false, &stream, bitmap),
            Field::SubclusterBitmap,
        );
    }
}

#[test]
fn extended_l2_zero_flag_is_reserved() {
    assert_read_corrupt(
        with64(extended(), L2_OFF, COPIED | DATA_OFF | ZERO),
        Field::L2Entry,
    );
}

#[test]
fn extended_l2_entry_unaligned_is_corrupt() {
    assert_read_corrupt(
        with64(extended(), L2_OFF, COPIED | (DATA_OFF + 2048)),
        Field::L2Entry,
    );
}

// ---------------------------------------------------------------------------------------
// Compressed clusters
// ---------------------------------------------------------------------------------------

/// A compressed cluster descriptor, encoded by hand from the spec: bits 0..x the host
/// offset, bits x..62 the number of 512-byte sectors after the first, bit 62 set.
fn compressed_descriptor(cluster_bits: u32, offset: u64, len: u64) -> u64 {
    let x = 62 - (cluster_bits - 8);
    let sectors = (offset + len).div_ceil(512) - offset / 512;
    COMPRESSED | ((sectors - 1) << x) | offset
}

/// Guest cluster 1 of the default fixture (or of `spec`), stored as `stream` at a
/// sector-unaligned offset after the last cluster (with extended L2, its bitmap 0);
/// returns the image.
fn with_compressed(spec: &Spec, stream: &[u8]) -> Vec<u8> {
    let mut img = build(spec);
    let off = img.len() as u64 + 100;
    img.resize(off as usize, 0);
    img.extend_from_slice(stream);
    img.resize(img.len().div_ceil(512) * 512, 0);
    let e = compressed_descriptor(spec.cluster_bits, off, stream.len() as u64);
    if spec.extended_l2 {
        put64(&mut img, L2_OFF + 16, e);
        put64(&mut img, L2_OFF + 24, 0);
    } else {
        put64(&mut img, L2_OFF + 8, e);
    }
    img
}

/// Guest cluster 1's contents in the compressed tests.
fn cluster_1() -> Vec<u8> {
    (0..CS).map(|i| (i / 300) as u8).collect()
}

fn compress(ct: CompressionType, data: &[u8]) -> Vec<u8> {
    qcow2_engine::compress::compress(ct, data).unwrap_or_else(|| panic!("test data must compress"))
}

#[test]
fn compressed_cluster_reads_back() {
    for (zstd, ct) in [
        (false, CompressionType::Zlib),
        (true, CompressionType::Zstd),
    ] {
        let spec = Spec {
            zstd,
            ..Spec::default()
        };
        let img = with_compressed(&spec, &compress(ct, &cluster_1()));
        let got = read_disk(open_ok(img)).unwrap_or_else(|e| panic!("{ct:?}: {e}"));
        let mut want = expected_disk();
        want[CS as usize..2 * CS as usize].copy_from_slice(&cluster_1());
        assert!(got == want, "{ct:?} cluster read back wrong");
    }
}

#[test]
fn compressed_garbage_stream_is_corrupt() {
    for zstd in [false, true] {
        let spec = Spec {
            zstd,
            ..Spec::default()
        };
        assert_read_corrupt(with_compressed(&spec, &[0xff; 700]), Field::CompressedData);
    }
}

#[test]
fn compressed_stream_shorter_than_cluster_is_corrupt() {
    for (zstd, ct) in [
        (false, CompressionType::Zlib),
        (true, CompressionType::Zstd),
    ] {
        let spec = Spec {
            zstd,
            ..Spec::default()
        };
        let stream = compress(ct, &cluster_1()[..(CS / 2) as usize]);
        assert_read_corrupt(with_compressed(&spec, &stream), Field::CompressedData);
    }
}

#[test]
fn compressed_stream_larger_than_cluster_is_corrupt() {
    // A stream that inflates to two clusters: decoding stops at one cluster (bounded
    // memory) and the cluster is refused.
    let two: Vec<u8> = cluster_1()
        .iter()
        .chain(cluster_1().iter())
        .copied()
        .collect();
    for (zstd, ct) in [
        (false, CompressionType::Zlib),
        (true, CompressionType::Zstd),
    ] {
        let spec = Spec {
            zstd,
            ..Spec::default()
        };
        assert_read_corrupt(
            with_compressed(&spec, &compress(ct, &two)),
            Field::CompressedData,
        );
    }
}

#[test]
fn compressed_descriptor_past_device_end_is_corrupt() {
    let img = fixture();
    // 128 sectors starting one cluster before the end of the 6-cluster image.
    let e = compressed_descriptor(CLUSTER_BITS, 5 * CS + 100, CS);
    assert_read_corrupt(
        with64(img.clone(), L2_OFF + 8, e),
        Field::CompressedDescriptor,
    );
    // An offset far past the end.
    let e = compressed_descriptor(CLUSTER_BITS, 1 << 40, 512);
    assert_read_corrupt(with64(img, L2_OFF + 8, e), Field::CompressedDescriptor);
}

#[test]
fn compressed_descriptor_with_copied_is_corrupt() {
    let e = COPIED | compressed_descriptor(CLUSTER_BITS, 5 * CS, 512);
    assert_read_corrupt(
        with64(fixture(), L2_OFF + 8, e),
        Field::CompressedDescriptor,
    );
}

#[test]
fn compressed_descriptor_at_offset_zero_is_corrupt() {
    let e = compressed_descriptor(CLUSTER_BITS, 0, 512);
    assert_read_corrupt(
        with64(fixture(), L2_OFF + 8, e),
        Field::CompressedDescriptor,
    );
}

// ---------------------------------------------------------------------------------------
// Refcount table and block entries
// ---------------------------------------------------------------------------------------

#[test]
fn refcount_table_entry_unaligned_is_corrupt() {
    let o = open_ok(with64(fixture(), RT_OFF, RB_OFF + 512));
    match refcount_of(o, 0) {
        Err(e) => assert_corrupt(e, Field::RefcountTableEntry),
        Ok(v) => panic!("refcount {v}, expected Corrupt"),
    }
}

#[test]
fn refcount_table_entry_reserved_bits_are_corrupt() {
    let o = open_ok(with64(fixture(), RT_OFF, RB_OFF | 1));
    match refcount_of(o, 0) {
        Err(e) => assert_corrupt(e, Field::RefcountTableEntry),
        Ok(v) => panic!("refcount {v}, expected Corrupt"),
    }
}

#[test]
fn refcount_table_entry_past_end_is_corrupt() {
    for entry in [6 * CS, u64::MAX - CS + 1] {
        let o = open_ok(with64(fixture(), RT_OFF, entry));
        match refcount_of(o, 0) {
            Err(e) => assert_corrupt(e, Field::RefcountTableEntry),
            Ok(v) => panic!("refcount {v}, expected Corrupt"),
        }
    }
}

#[test]
fn refcount_table_entry_zero_is_unallocated_not_a_block_at_0() {
    // Entry 0 means "no refcount block": the header cluster is never read as one.
    assert_eq!(refcount_block_offset(0, CS, 6 * CS), Ok(None));
    let o = open_ok(with64(fixture(), RT_OFF, 0));
    assert_eq!(refcount_of(o, 0), Ok(0));
}

#[test]
fn refcount_table_entry_pure_checks() {
    for (entry, why) in [
        (RB_OFF + 1, "reserved bit 0"),
        (RB_OFF + 0x100, "reserved bit 8"),
        (RB_OFF + 0x200, "unaligned"),
        (6 * CS, "past the device"),
        (u64::MAX - CS + 1, "overflowing"),
    ] {
        match refcount_block_offset(entry, CS, 6 * CS) {
            Err(e) => assert_corrupt(e, Field::RefcountTableEntry),
            Ok(v) => panic!("{why}: accepted as {v:?}"),
        }
    }
    assert_eq!(
        refcount_block_offset(RB_OFF, CS, 6 * CS),
        Ok(Some(HostOffset(RB_OFF)))
    );
}

#[test]
fn refcount_increment_past_max_is_refused_never_wraps() {
    for order in 0..=5u32 {
        let max = max_refcount(order);
        let mut block = vec![0u8; 512];
        set_refcount(&mut block, order, 3, max)
            .unwrap_or_else(|e| panic!("order {order}: max refused: {e}"));
        let before = block.clone();
        match set_refcount(&mut block, order, 3, max + 1) {
            Err(e) => assert_corrupt(e, Field::RefcountBlockEntry),
            Ok(()) => panic!("order {order}: {} stored", max + 1),
        }
        assert_eq!(
            block, before,
            "order {order}: block changed by a refused store"
        );
        assert_eq!(get_refcount(&block, order, 3), max);
    }
    // 64-bit refcounts: u64::MAX is the largest value, and it fits.
    let mut block = vec![0u8; 512];
    assert_eq!(set_refcount(&mut block, 6, 1, u64::MAX), Ok(()));
    assert_eq!(get_refcount(&block, 6, 1), u64::MAX);
}

// ---------------------------------------------------------------------------------------
// Backing chain
// ---------------------------------------------------------------------------------------

#[test]
fn backing_chain_deeper_than_cap_is_refused() {
    // Chains of daily snapshots reach a thousand images: those open.
    const _: () = assert!(MAX_BACKING_DEPTH >= 1000);
    let exec: Exec<MemDevice> = Exec::new();
    let layers = |n: usize| -> Vec<Layer<MemDevice>> {
        (0..n)
            .map(|_| Layer::Raw {
                dev: exec.add_device(MemDevice::new(vec![0u8; 4096])),
                size: 4096,
            })
            .collect()
    };
    assert!(Chain::new(&exec, layers(MAX_BACKING_DEPTH)).is_ok());
    match Chain::new(&exec, layers(MAX_BACKING_DEPTH + 1)) {
        Err(e @ Error::BackingChain(_)) => assert_eq!(e.field(), Some(Field::BackingChain)),
        Err(e) => panic!("expected BackingChain, got {e:?}"),
        Ok(_) => panic!("a chain of {} layers was accepted", MAX_BACKING_DEPTH + 1),
    }
    assert!(matches!(
        Chain::new(&exec, Vec::new()),
        Err(Error::BackingChain(_))
    ));
}

#[test]
fn backing_chain_of_an_image_over_itself_is_bounded() {
    // An image "backed by itself" (the host opened the same device twice): the chain is a
    // finite list, so the read terminates; unallocated clusters come from the lower copy.
    let exec: Exec<MemDevice> = Exec::new();
    let dev = exec.add_device(MemDevice::new(fixture()));
    let open_layer = || {
        let e = exec.clone();
        exec.block_on(async move { Qcow2::open(&e, dev, OpenOptions::default()).await })
            .unwrap_or_else(|e| panic!("open: {e}"))
    };
    let layers = vec![
        Layer::Qcow2(open_layer().into()),
        Layer::Qcow2(open_layer().into()),
    ];
    let chain = Chain::new(&exec, layers).unwrap_or_else(|e| panic!("chain: {e}"));
    let buf = HeapBuf::new(VIRTUAL_SIZE as usize);
    let (c, b) = (chain.clone(), buf.clone());
    let r = exec.block_on(async move { c.read(0, BufSlice::whole(b)).await });
    assert_eq!(r, Ok(()));
    assert!(buf.to_vec() == expected_disk());
}

// ---------------------------------------------------------------------------------------
// Generated variants
// ---------------------------------------------------------------------------------------

/// Opens `img` and, if it opens, reads the disk and the refcounts of its first clusters.
/// Returns whether it opened. Any outcome but a panic is acceptable.
fn exercise(img: Vec<u8>) -> bool {
    match open(img.clone()) {
        Ok(o) => {
            let _ = read_disk(o);
            if let Ok(o) = open(img) {
                let _ = refcounts(o, (0..8).map(|c| c * CS).collect());
            }
            true
        }
        Err(e) => {
            // Every error renders.
            let _ = e.to_string();
            false
        }
    }
}

/// Runs `exercise` on every mutation, catching panics; returns (opened, refused) counts
/// and fails listing every (offset, value) that panicked.
fn mutate_all(base: &[u8], offsets: impl Iterator<Item = u64>) -> (usize, usize) {
    let (mut opened, mut refused) = (0, 0);
    let mut panics = Vec::new();
    for off in offsets {
        for v in [0u8, 0xff, 1, 0x80] {
            let mut img = base.to_vec();
            img[off as usize] = v;
            match std::panic::catch_unwind(move || exercise(img)) {
                Ok(true) => opened += 1,
                Ok(false) => refused += 1,
                Err(_) => panics.push((off, v)),
            }
        }
    }
    assert!(
        panics.is_empty(),
        "panicked at (offset, value): {panics:x?}"
    );
    (opened, refused)
}

#[test]
fn generated_header_byte_mutations_never_panic() {
    for spec in [
        Spec::default(),
        Spec {
            extended_l2: true,
            ..Spec::default()
        },
        Spec {
            snapshot: true,
            backing: Some(("base.qcow2", Some("qcow2"))),
            ..Spec::default()
        },
    ] {
        let (opened, refused) = mutate_all(&build(&spec), 0..112);
        // Both outcomes occur: the test really exercises the parser and the read path.
        assert!(
            opened > 0 && refused > 0,
            "{opened} opened, {refused} refused"
        );
    }
}

#[test]
fn generated_metadata_entry_mutations_never_panic() {
    let l1 = L1_OFF..L1_OFF + 8;
    let rt = RT_OFF..RT_OFF + 8;
    let l2 = L2_OFF..L2_OFF + 16;
    let all = || l1.clone().chain(rt.clone()).chain(l2.clone());
    mutate_all(&fixture(), all());
    mutate_all(&extended(), all());
    let spec = Spec {
        snapshot: true,
        ..Spec::default()
    };
    mutate_all(&build(&spec), SNAP_OFF..SNAP_OFF + 72);
    // The extension area: type/length words of the feature name table and end marker.
    mutate_all(
        &fixture(),
        (EXT_OFF..EXT_OFF + 8).chain(END_EXT_OFF..END_EXT_OFF + 8),
    );
}
