//! Property tests of the on-disk formats: encode → decode round trips of the header, the
//! snapshot table, compressed descriptors and refcount entries, and "never panics, and
//! what is accepted is in range" for arbitrary entries and mutated headers.
//!
//! Decoding validates tables against the device, so generated headers place every table
//! at a cluster-aligned offset well inside [`DEVICE_SIZE`].

use super::entries::{compressed_entry, ClusterMapping, L1Entry, L2Context, L2Entry};
use super::entries::{LinearSlice, SubclusterBitmap, COMPRESSED, COPIED, FULL_BITMAP, ZERO};
use super::header::{autoclear, ext_type, incompat, BitmapsExt, FeatureName};
use super::header::{CompressionType, Extensions, Header, ImageHeader, ZeroedTail};
use super::refcount::{entries_per_block, get_refcount, max_refcount, set_refcount};
use super::snapshot::{decode_snapshots, encode_snapshots, Snapshot, SnapshotDecode};
use crate::error::{Error, Field};
use crate::limits::{
    MAX_BITMAPS, MAX_BITMAP_DIRECTORY_BYTES, MAX_L1_ENTRIES, MAX_REFCOUNT_TABLE_BYTES,
    MAX_SNAPSHOTS, MAX_SNAPSHOT_EXTRA_DATA, MAX_VIRTUAL_SIZE,
};
use crate::types::SUBCLUSTERS;
use proptest::prelude::*;

/// Device size given to the decoders: large enough for every generated table.
const DEVICE_SIZE: u64 = 1 << 62;

/// Printable ASCII (no NUL, valid UTF-8) of `min..=max` bytes.
fn ascii(min: usize, max: usize) -> impl Strategy<Value = String> {
    proptest::collection::vec(0x20u8..0x7f, min..=max)
        .prop_map(|v| v.into_iter().map(char::from).collect())
}

/// Header extension types the decoder interprets (never generated as "unknown").
const KNOWN_EXTS: [u32; 6] = [
    ext_type::END,
    ext_type::BACKING_FORMAT,
    ext_type::FEATURE_NAME_TABLE,
    ext_type::BITMAPS,
    ext_type::ENCRYPTION,
    ext_type::EXTERNAL_DATA_FILE,
];

/// The random choices behind one header (see [`make_header`]).
#[derive(Debug, Clone)]
struct HeaderSeed {
    v3: bool,
    cluster_bits: u32,
    extended_l2: bool,
    zstd: bool,
    dirty: bool,
    corrupt: bool,
    compatible: u64,
    autoclear: u64,
    refcount_order: u32,
    size: u64,
    l1_extra: u64,
    l1_at_zero: bool,
    clusters: (u64, u64, u64),
    rt_clusters: u64,
    nb_snapshots: u32,
    tail: Vec<u64>,
    backing_format: Option<String>,
    external_data_file: Option<String>,
    bitmaps: Option<(u32, u64, u64)>,
    feature_names: Vec<(u8, u8, String)>,
    unknown: Vec<(u32, Vec<u8>)>,
    backing_file: Option<String>,
}

fn header_seed() -> impl Strategy<Value = HeaderSeed> {
    let geometry = (
        any::<bool>(),
        9u32..=21,
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        0u32..=6,
    );
    let features = (any::<u64>(), any::<u64>());
    let tables = (
        any::<u64>(),
        0u64..16,
        any::<bool>(),
        (1u64..1 << 20, 1u64..1 << 20, 1u64..1 << 20),
        any::<u64>(),
        prop_oneof![Just(0u32), 1u32..=16, Just(MAX_SNAPSHOTS as u32)],
    );
    let extensions = (
        proptest::collection::vec(any::<u64>(), 0..=4),
        proptest::option::of(ascii(0, 15)),
        proptest::option::of(ascii(0, 32)),
        proptest::option::of((
            1u32..=MAX_BITMAPS as u32,
            1u64..=MAX_BITMAP_DIRECTORY_BYTES,
            1u64..1 << 20,
        )),
        proptest::collection::vec((0u8..=2, any::<u8>(), ascii(0, 46)), 0..=4),
        proptest::collection::vec(
            (
                any::<u32>().prop_filter("unknown type", |t| !KNOWN_EXTS.contains(t)),
                proptest::collection::vec(any::<u8>(), 0..=32),
            ),
            0..=2,
        ),
        proptest::option::of(ascii(1, 1023)),
    );
    (geometry, features, tables, extensions).prop_map(
        |(
            (v3, cluster_bits, extended_l2, zstd, dirty, corrupt, refcount_order),
            (compatible, autoclear),
            (size, l1_extra, l1_at_zero, clusters, rt_clusters, nb_snapshots),
            (tail, backing_format, external_data_file, bitmaps, feature_names, unknown, backing),
        )| HeaderSeed {
            v3,
            cluster_bits,
            extended_l2,
            zstd,
            dirty,
            corrupt,
            compatible,
            autoclear,
            refcount_order,
            size,
            l1_extra,
            l1_at_zero,
            clusters,
            rt_clusters,
            nb_snapshots,
            tail,
            backing_format,
            external_data_file,
            bitmaps,
            feature_names,
            unknown,
            backing_file: backing,
        },
    )
}

/// A valid header from `s` (without its backing file name: see [`with_backing_file`]).
fn make_header(s: &HeaderSeed) -> ImageHeader {
    let cb = s.cluster_bits;
    let cs = 1u64 << cb;
    // Version 2 has none of the v3 fields; extended L2 needs 16 KiB clusters.
    let extended_l2 = s.v3 && s.extended_l2 && cb >= 14;
    let zstd = s.v3 && s.zstd;
    let l2_bits = cb - if extended_l2 { 4 } else { 3 };
    let l1_coverage = 1u64 << (cb + l2_bits);
    let max_size = MAX_VIRTUAL_SIZE.min(l1_coverage * MAX_L1_ENTRIES);
    let size = s.size % (max_size + 1);
    let l1_size = (size.div_ceil(l1_coverage) + s.l1_extra).min(MAX_L1_ENTRIES);
    let (l1_cluster, rt_cluster, snap_cluster) = s.clusters;
    // An empty L1 table may sit at offset 0 (QEMU writes that for 0-byte disks).
    let l1_table_offset = if l1_size == 0 && s.l1_at_zero {
        0
    } else {
        l1_cluster * cs
    };
    let mut incompatible = 0;
    if s.v3 {
        incompatible |= if s.dirty { incompat::DIRTY } else { 0 };
        incompatible |= if s.corrupt { incompat::CORRUPT } else { 0 };
        incompatible |= if extended_l2 {
            incompat::EXTENDED_L2
        } else {
            0
        };
        incompatible |= if zstd { incompat::COMPRESSION_TYPE } else { 0 };
    }
    // The bitmaps extension is only meaningful (and only decoded as such) with the
    // autoclear bit; version 2 has no autoclear field.
    let bitmaps = s
        .bitmaps
        .filter(|_| s.v3)
        .map(|(nb_bitmaps, directory_size, dir_cluster)| BitmapsExt {
            nb_bitmaps,
            directory_size,
            directory_offset: dir_cluster * cs,
        });
    let autoclear = match (s.v3, bitmaps.is_some()) {
        (false, _) => 0,
        (true, true) => s.autoclear | autoclear::BITMAPS,
        (true, false) => s.autoclear & !autoclear::BITMAPS,
    };
    let unknown_tail: Vec<u8> = if s.v3 {
        s.tail.iter().flat_map(|w| w.to_be_bytes()).collect()
    } else {
        Vec::new()
    };
    let header = Header {
        version: if s.v3 { 3 } else { 2 },
        backing_file_offset: 0,
        backing_file_size: 0,
        cluster_bits: cb,
        size,
        crypt_method: 0,
        l1_size: l1_size as u32,
        l1_table_offset,
        refcount_table_offset: rt_cluster * cs,
        refcount_table_clusters: (1 + s.rt_clusters % (MAX_REFCOUNT_TABLE_BYTES >> cb)) as u32,
        nb_snapshots: s.nb_snapshots,
        snapshots_offset: if s.nb_snapshots > 0 {
            snap_cluster * cs
        } else {
            0
        },
        incompatible_features: incompatible,
        compatible_features: if s.v3 { s.compatible } else { 0 },
        autoclear_features: autoclear,
        refcount_order: if s.v3 { s.refcount_order } else { 4 },
        header_length: if s.v3 {
            112 + unknown_tail.len() as u32
        } else {
            72
        },
        compression_type: if zstd {
            CompressionType::Zstd
        } else {
            CompressionType::Zlib
        },
        unknown_tail,
    };
    // The zeroed tail, like the bitmaps, decodes only with its autoclear bit; encoded
    // first, right after the header.
    let zeroed_tail = (autoclear & autoclear::ZEROED_TAIL != 0).then(|| ZeroedTail {
        from: rt_cluster * cs,
        at: u64::from(header.header_length) + 8,
    });
    let extensions = Extensions {
        zeroed_tail,
        backing_format: s.backing_format.clone(),
        feature_names: s
            .feature_names
            .iter()
            .map(|(kind, bit, name)| FeatureName {
                kind: *kind,
                bit: *bit,
                name: name.clone(),
            })
            .collect(),
        bitmaps,
        external_data_file: s.external_data_file.clone(),
        encryption: None,
        unknown: s.unknown.clone(),
    };
    ImageHeader {
        header,
        extensions,
        backing_file: None,
    }
}

/// Gives `h` the seed's backing file name, cut to what fits in cluster 0 after the
/// extensions (the encoder places it there). `None` when not even one byte fits. When the
/// feature name table leaves no room even for one byte, the encoder leaves the table out
/// and the name gets the room instead.
fn with_backing_file(mut h: ImageHeader, name: &Option<String>) -> ImageHeader {
    let Some(name) = name else { return h };
    // Where the encoder puts a name: probe with a one-byte name.
    h.backing_file = Some("x".into());
    let Ok(probe) = h.encode() else {
        h.backing_file = None;
        return h;
    };
    let name_off = super::be::get_u64(&probe, 8);
    let room = (h.cluster_size() - name_off) as usize;
    h.backing_file = Some(name[..name.len().min(room)].to_string());
    h
}

/// The case proptest once found (`proptest-regressions/format/tests.txt`): with 512-byte
/// clusters, the header and the extensions including four empty feature names fill cluster
/// 0 exactly. Without a backing file name the table is kept; with a 172-byte name the
/// encoder leaves the optional table out (the name then starts at byte 312), and
/// everything else round trips.
#[test]
fn header_512_byte_cluster_long_backing_file_leaves_out_feature_names() {
    let mut seed = HeaderSeed {
        v3: true,
        cluster_bits: 9,
        extended_l2: false,
        zstd: false,
        dirty: false,
        corrupt: false,
        compatible: 0,
        autoclear: 0,
        refcount_order: 0,
        size: 0,
        l1_extra: 0,
        l1_at_zero: false,
        clusters: (1, 1, 1),
        rt_clusters: 0,
        nb_snapshots: 0,
        tail: vec![0, 0],
        backing_format: Some(" ".repeat(9)),
        external_data_file: Some(" ".repeat(25)),
        bitmaps: Some((1, 1, 1)),
        feature_names: vec![(0, 0, String::new()); 4],
        unknown: vec![
            (
                1,
                vec![
                    0, 12, 77, 29, 124, 114, 199, 25, 203, 190, 208, 176, 226, 191, 41, 196, 196,
                    150, 152, 4, 106, 127, 135, 251, 37,
                ],
            ),
            (
                1825716464,
                vec![
                    102, 43, 10, 54, 0, 165, 86, 158, 223, 184, 179, 194, 174, 99, 200, 230, 51, 0,
                    94, 72, 249, 181, 208, 72, 219,
                ],
            ),
        ],
        backing_file: None,
    };

    // No name: 128 header bytes + 384 extension bytes = 512, the table just fits.
    let h = make_header(&seed);
    let bytes = h.encode().expect("fits exactly");
    assert_eq!(ImageHeader::decode(&bytes, DEVICE_SIZE), Ok(h.clone()));
    assert!(feature_table_fits(&h));

    seed.backing_file = Some(
        "P**(@xnB(?UQ0}qi`[k^_qA#MjvD-3]\"9MYScR|9$l-v`v?4\"&#h,&]Xh4[Vsm5A~wNlscMS6?mh[rMl*x%%ei#*|,h6avws;Cq+Sz,St9CUS`<q=h+Pi_PEJ4B-h%gr2`3phpDR,OYK%*J<MME2$m{'laTT>DRix~>Pk# Op<}4"
            .to_string(),
    );
    let h = with_backing_file(make_header(&seed), &seed.backing_file);
    assert_eq!(h.backing_file.as_ref().map(String::len), Some(172));
    assert!(!feature_table_fits(&h));
    let bytes = h.encode().expect("fits without the feature name table");
    let decoded = ImageHeader::decode(&bytes, DEVICE_SIZE).expect("decodes");
    assert!(decoded.extensions.feature_names.is_empty());
    let mut want = h.clone();
    want.extensions.feature_names.clear();
    want.header.backing_file_offset = 312;
    want.header.backing_file_size = 172;
    assert_eq!(decoded, want);
    assert_eq!(want.encode(), Ok(bytes));
}

/// Whether cluster 0 has room for `h`'s feature name table next to the header, the other
/// extensions and the backing file name. The table is optional, so the encoder leaves it out
/// when it does not fit; measured here by walking the extension chain of `h` encoded
/// without the table.
fn feature_table_fits(h: &ImageHeader) -> bool {
    let mut bare = h.clone();
    bare.extensions.feature_names.clear();
    let Ok(bytes) = bare.encode() else {
        return false;
    };
    let mut off = if h.header.version == 3 {
        super::be::get_u32(&bytes, 100) as usize
    } else {
        72
    };
    loop {
        let typ = super::be::get_u32(&bytes, off);
        let len = super::be::get_u32(&bytes, off + 4) as usize;
        off += 8 + len.div_ceil(8) * 8;
        if typ == ext_type::END {
            break;
        }
    }
    let table = 8 + 48 * h.extensions.feature_names.len();
    let name = h.backing_file.as_ref().map_or(0, String::len);
    off + table + name <= bytes.len()
}

/// A snapshot whose L1 table is valid for `cluster_bits` on [`DEVICE_SIZE`].
fn snapshot(cluster_bits: u32) -> impl Strategy<Value = Snapshot> {
    (
        (0u64..1 << 20, 0u32..=MAX_L1_ENTRIES as u32),
        ascii(0, 64),
        ascii(0, 64),
        (any::<u32>(), any::<u32>(), any::<u64>(), any::<u32>()),
        proptest::collection::vec(any::<u8>(), 0..=MAX_SNAPSHOT_EXTRA_DATA as usize),
    )
        .prop_map(
            move |((l1_cluster, l1_size), id, name, (sec, nsec, clock, vmsize), extra)| {
                // A non-empty L1 table cannot sit at offset 0 (the header).
                let l1_cluster = if l1_size > 0 {
                    l1_cluster.max(1)
                } else {
                    l1_cluster
                };
                Snapshot {
                    l1_table_offset: l1_cluster << cluster_bits,
                    l1_size,
                    id,
                    name,
                    date_sec: sec,
                    date_nsec: nsec,
                    vm_clock_nsec: clock,
                    vm_state_size: vmsize,
                    extra_data: extra,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// decode(encode(h)) == h for valid headers of both versions, every cluster size,
    /// refcount width, extended L2, compression type, extensions and backing file name
    /// (less the optional feature name table when cluster 0 has no room for it); and
    /// encoding is stable (encode(decode(encode(h))) == encode(h)).
    #[test]
    fn header_encode_decode_roundtrip(seed in header_seed()) {
        let h = make_header(&seed);
        let h = with_backing_file(h, &seed.backing_file);
        // The extensions alone may not fit in a 512-byte cluster.
        let Ok(bytes) = h.encode() else {
            prop_assume!(false);
            return Ok(());
        };
        prop_assert_eq!(bytes.len() as u64, h.cluster_size());
        let decoded = ImageHeader::decode(&bytes, DEVICE_SIZE)
            .map_err(|e| TestCaseError::fail(format!("decode refused: {e}")))?;

        // The encoder chose where the backing file name goes: after the header and the
        // extensions (at least the 8-byte end marker), inside cluster 0.
        let mut want = h.clone();
        // The feature name table is optional: it is kept exactly when it fits.
        if !feature_table_fits(&h) {
            want.extensions.feature_names.clear();
        }
        match &h.backing_file {
            Some(name) => {
                let off = decoded.header.backing_file_offset;
                prop_assert!(off >= u64::from(decoded.header.header_length) + 8);
                prop_assert!(off + name.len() as u64 <= h.cluster_size());
                prop_assert_eq!(&bytes[off as usize..off as usize + name.len()], name.as_bytes());
                want.header.backing_file_offset = off;
                want.header.backing_file_size = name.len() as u32;
            }
            None => {
                prop_assert_eq!(decoded.header.backing_file_offset, 0);
                prop_assert_eq!(decoded.header.backing_file_size, 0);
            }
        }
        prop_assert_eq!(&decoded, &want);
        let again = decoded
            .encode()
            .map_err(|e| TestCaseError::fail(format!("re-encode refused: {e}")))?;
        prop_assert!(again == bytes, "re-encoding changed the bytes");
    }

    /// Mutating any bytes of a valid cluster 0 and decoding it against any device size
    /// never panics; whatever is accepted re-encodes.
    #[test]
    fn header_decode_of_mutated_bytes_never_panics(
        seed in header_seed(),
        mutations in proptest::collection::vec((0usize..1024, any::<u8>()), 1..=8),
        device_size in prop_oneof![Just(DEVICE_SIZE), Just(u64::MAX), 0u64..1 << 24],
        truncate in prop_oneof![Just(None), (0usize..1024).prop_map(Some)],
    ) {
        let h = with_backing_file(make_header(&seed), &seed.backing_file);
        let Ok(mut bytes) = h.encode() else {
            prop_assume!(false);
            return Ok(());
        };
        for (off, v) in mutations {
            let len = bytes.len();
            bytes[off % len] = v;
        }
        if let Some(n) = truncate {
            bytes.truncate(n);
        }
        if let Ok(d) = ImageHeader::decode(&bytes, device_size) {
            // What is accepted is in range.
            let h = &d.header;
            prop_assert!((9..=21).contains(&h.cluster_bits));
            prop_assert!(h.version == 2 || h.version == 3);
            prop_assert!(h.refcount_order <= 6 && h.crypt_method == 0);
            prop_assert!(h.size <= MAX_VIRTUAL_SIZE);
            prop_assert!(u64::from(h.l1_size) <= MAX_L1_ENTRIES);
            prop_assert_eq!(h.l1_table_offset % d.cluster_size(), 0);
            prop_assert_eq!(h.refcount_table_offset % d.cluster_size(), 0);
            prop_assert!(h.refcount_table_offset > 0);
            prop_assert!(u64::from(h.nb_snapshots) <= MAX_SNAPSHOTS);
            prop_assert!(h.incompatible_features & !incompat::KNOWN == 0);
            prop_assert!(d.backing_file.as_ref().is_none_or(|n| n.len() <= 1023));
        }
    }

    /// decode(encode(table)) == table, and any prefix of the table either asks for more
    /// bytes (never fewer than it has) or already holds every entry.
    #[test]
    fn snapshot_table_roundtrip(
        (cluster_bits, snaps) in (9u32..=21).prop_flat_map(|cb| {
            (Just(cb), proptest::collection::vec(snapshot(cb), 0..=6))
        }),
        cut in any::<prop::sample::Index>(),
    ) {
        let bytes = encode_snapshots(&snaps);
        prop_assert_eq!(bytes.len() % 8, 0);
        let nb = snaps.len() as u32;
        let cs = 1u64 << cluster_bits;
        prop_assert_eq!(
            decode_snapshots(&bytes, nb, cs, DEVICE_SIZE),
            Ok(SnapshotDecode::Done(snaps.clone()))
        );
        if !bytes.is_empty() {
            let cut = cut.index(bytes.len());
            match decode_snapshots(&bytes[..cut], nb, cs, DEVICE_SIZE) {
                Ok(SnapshotDecode::NeedBytes(n)) => {
                    prop_assert!(n as usize > cut && n as usize <= bytes.len(), "need {} at cut {}", n, cut);
                }
                Ok(SnapshotDecode::Done(got)) => prop_assert_eq!(got, snaps),
                Err(e) => prop_assert!(false, "prefix of a valid table refused: {}", e),
            }
        }
    }

    /// Arbitrary bytes as a snapshot table: an error, a request for more bytes within the
    /// table cap, or snapshots whose L1 tables lie inside the device. Never a panic.
    #[test]
    fn snapshot_decode_of_random_bytes_never_panics(
        bytes in proptest::collection::vec(any::<u8>(), 0..2048),
        nb in 0u32..=64,
        cluster_bits in 9u32..=21,
        device_size in 0u64..1 << 40,
    ) {
        let cs = 1u64 << cluster_bits;
        match decode_snapshots(&bytes, nb, cs, device_size) {
            Ok(SnapshotDecode::Done(snaps)) => {
                prop_assert_eq!(snaps.len(), nb as usize);
                for s in snaps {
                    prop_assert_eq!(s.l1_table_offset % cs, 0);
                    prop_assert!(s.l1_table_offset + u64::from(s.l1_size) * 8 <= device_size);
                    prop_assert!(s.extra_data.len() as u64 <= MAX_SNAPSHOT_EXTRA_DATA);
                }
            }
            Ok(SnapshotDecode::NeedBytes(n)) => prop_assert!(n as usize > bytes.len()),
            Err(e) => prop_assert!(
                matches!(
                    e,
                    Error::InvalidField { field: Field::SnapshotTable | Field::SnapshotL1Table, .. }
                ),
                "unexpected error {:?}",
                e
            ),
        }
    }

    /// compressed_entry → compressed() gives back the offset and covers exactly the
    /// sectors the stream touches, for every cluster size, offset and length that fit.
    #[test]
    fn compressed_descriptor_roundtrip(
        cluster_bits in 9u32..=21,
        offset_seed in any::<u64>(),
        len_seed in any::<u64>(),
    ) {
        let cs = 1u64 << cluster_bits;
        // Bits 0..x of the descriptor hold the offset.
        let x = 62 - (cluster_bits - 8);
        let offset = 1 + offset_seed % ((1u64 << x) - 1);
        let len = 1 + len_seed % cs;
        let e = compressed_entry(cluster_bits, offset, len);
        prop_assert!(e.is_compressed() && !e.is_copied());
        let d = e
            .compressed(cluster_bits, DEVICE_SIZE)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(d.offset.0, offset);
        prop_assert_eq!(d.offset.0 + d.len, (offset + len).div_ceil(512) * 512);
        prop_assert!(d.len >= len && d.len < len + 512);
        let ctx = L2Context { cluster_bits, v3: true, extended_l2: false, device_size: DEVICE_SIZE };
        prop_assert_eq!(e.mapping(&ctx), Ok(ClusterMapping::Compressed(d)));
        // The same descriptor on a device that ends a sector before the stream does.
        let end = (offset + len).div_ceil(512) * 512;
        let short = e.compressed(cluster_bits, end - 512);
        prop_assert!(
            matches!(short, Err(Error::Corrupt { field: Field::CompressedDescriptor, .. })),
            "descriptor past the device accepted: {:?}",
            short
        );
        prop_assert!(e.compressed(cluster_bits, end).is_ok());
    }

    /// Any 64-bit L1 entry: an error naming the L1 entry, unallocated, or an aligned L2
    /// table wholly inside the device.
    #[test]
    fn l1_entry_never_out_of_range(v in any::<u64>(), cluster_bits in 9u32..=21, device_size in any::<u64>()) {
        let cs = 1u64 << cluster_bits;
        match L1Entry(v).l2_table(cs, device_size) {
            Ok(Some(off)) => {
                prop_assert_eq!(off.0 % cs, 0);
                prop_assert!(off.0 > 0 && off.0.checked_add(cs).is_some_and(|e| e <= device_size));
            }
            Ok(None) => prop_assert_eq!(v & !COPIED & 0x00ff_ffff_ffff_fe00, 0),
            Err(e) => prop_assert_eq!(e.field(), Some(Field::L1Entry)),
        }
    }

    /// Any standard or extended L2 entry: an error naming the entry (or its bitmap or
    /// compressed descriptor), or a mapping whose host data starts inside the device.
    #[test]
    fn l2_entry_never_out_of_range(
        v in prop_oneof![any::<u64>(), any::<u64>().prop_map(|v| v & 0x00ff_ffff_ffff_fe00 | COPIED)],
        bitmap in any::<u64>(),
        sc in 0u64..SUBCLUSTERS,
        cluster_bits in 9u32..=21,
        v3 in any::<bool>(),
        extended in any::<bool>(),
        device_size in prop_oneof![any::<u64>().prop_map(|d| d >> 8), 0u64..1 << 32],
    ) {
        let cs = 1u64 << cluster_bits;
        let extended_l2 = extended && cluster_bits >= 14;
        let ctx = L2Context { cluster_bits, v3, extended_l2, device_size };
        let r = if extended_l2 {
            L2Entry(v).subcluster_mapping(SubclusterBitmap(bitmap), sc, &ctx)
        } else {
            L2Entry(v).mapping(&ctx)
        };
        match r {
            Ok(ClusterMapping::Data { host, .. }) => {
                // The (sub)cluster is aligned and its cluster starts inside the device (a
                // last cluster may be cut short: reads past the device end return zeros).
                let unit = if extended_l2 { cs / SUBCLUSTERS } else { cs };
                prop_assert_eq!(host.0 % unit, 0);
                let cluster = host.0 & !(cs - 1);
                prop_assert!(cluster > 0 && cluster < device_size);
            }
            Ok(ClusterMapping::Compressed(d)) => {
                prop_assert!(!extended_l2 || bitmap == 0);
                prop_assert!(d.offset.0 > 0);
                prop_assert!(d.offset.0 + d.len <= device_size.div_ceil(512) * 512);
            }
            Ok(_) => {}
            Err(e) => prop_assert!(matches!(
                e.field(),
                Some(Field::L2Entry | Field::SubclusterBitmap | Field::CompressedDescriptor)
            ), "{}", e),
        }
        // A compressed entry with a nonzero (reserved) bitmap is refused with extended L2.
        if extended_l2 && v & COMPRESSED != 0 && bitmap != 0 {
            prop_assert!(L2Entry(v).subcluster_mapping(SubclusterBitmap(bitmap), sc, &ctx).is_err());
        }
    }

    /// set_refcount then get_refcount gives the value back, for every width, and leaves
    /// every other entry of the block untouched; a value above the width is refused and
    /// changes nothing.
    #[test]
    fn refcount_get_set_roundtrip(
        order in 0u32..=6,
        cluster_bits in 9u32..=12,
        block_seed in proptest::collection::vec(any::<u8>(), 4096),
        index_seed in any::<u64>(),
        value_seed in any::<u64>(),
    ) {
        let cs = 1usize << cluster_bits;
        let mut block = block_seed[..cs].to_vec();
        let n = entries_per_block(cluster_bits, order);
        let index = index_seed % n;
        let max = max_refcount(order);
        let value = value_seed & max;
        let before: Vec<u64> = (0..n).map(|i| get_refcount(&block, order, i)).collect();
        prop_assert!(before.iter().all(|v| *v <= max));

        prop_assert_eq!(set_refcount(&mut block, order, index, value), Ok(()));
        for i in 0..n {
            let want = if i == index { value } else { before[i as usize] };
            prop_assert_eq!(get_refcount(&block, order, i), want, "entry {}", i);
        }

        if order < 6 {
            let saved = block.clone();
            let too_big = max + 1 + (value_seed >> (1 << order));
            let r = set_refcount(&mut block, order, index, too_big);
            prop_assert!(
                matches!(r, Err(Error::Corrupt { field: Field::RefcountBlockEntry, .. })),
                "{} stored in a {}-bit refcount: {:?}",
                too_big,
                1u32 << order,
                r
            );
            prop_assert!(block == saved, "a refused store changed the block");
        }
    }
}

#[test]
fn plain_data_agrees_with_mapping() {
    use crate::format::{ClusterMapping, L2Context, L2Entry};
    let ctx = L2Context {
        cluster_bits: 16,
        v3: true,
        extended_l2: false,
        device_size: 1 << 30,
    };
    let mut rng = crate::rng::Rng(0x1234_5678);
    let specials = [
        0u64,
        1,
        1 << 63,
        (1 << 63) | 0x10000,
        0x10000,
        0x10001,
        0x10200,
        (1 << 62) | 0x10000,
        (1 << 63) | (1 << 30),
        (1 << 63) | ((1 << 30) - 0x10000),
        0x0100_0000_0000_0000 | 0x10000,
    ];
    for i in 0..100_000u64 {
        let v = match specials.get(i as usize) {
            Some(&s) => s,
            None => {
                // Mostly plausible entries, some with random flag and reserved bits.
                let r = rng.next();
                let off = (r % (1 << 31)) & !0xffff;
                let flags =
                    rng.next() & 0xff00_0000_0000_01ff & (if i % 4 == 0 { !0 } else { 1 << 63 });
                off | flags
            }
        };
        let e = L2Entry(v);
        let fast = e.plain_data(ctx.cluster_bits, ctx.device_size);
        match (fast, e.mapping(&ctx)) {
            (Some((h, c)), Ok(ClusterMapping::Data { host, copied })) => {
                assert_eq!((h, c), (host.0, copied), "{v:#x}")
            }
            (Some(_), other) => panic!("{v:#x}: fast path accepted, mapping says {other:?}"),
            (None, Ok(ClusterMapping::Data { .. })) => panic!("{v:#x}: valid data refused"),
            (None, _) => {}
        }
    }
}

/// Whether every entry of `entries` is a plain COPIED data entry at `host(0) + i * cs`,
/// checked entry by entry (the definition [`LinearSlice`] summarises).
fn linear_by_definition(entries: &[u64], cluster_bits: u32) -> bool {
    let Some((h0, true)) = L2Entry(entries[0]).plain_data(cluster_bits, u64::MAX) else {
        return false;
    };
    entries.iter().enumerate().all(|(i, &e)| {
        e & !0x00ff_ffff_ffff_fe00 == entries[0] & !0x00ff_ffff_ffff_fe00
            && L2Entry(e).plain_data(cluster_bits, u64::MAX)
                == Some((h0 + ((i as u64) << cluster_bits), true))
    })
}

/// Asserts what the fast path relies on: a mapping from the summary is the entry's own.
fn assert_summary_agrees(lin: LinearSlice, entries: &[u64], cluster_bits: u32) {
    let linear = linear_by_definition(entries, cluster_bits);
    for (i, &e) in entries.iter().enumerate() {
        match lin.host(i as u64, cluster_bits) {
            Some(h) => assert_eq!(
                L2Entry(e).plain_data(cluster_bits, u64::MAX),
                Some((h, true)),
                "entry {i} = {e:#x}"
            ),
            None => assert!(!linear, "a linear slice not recognised"),
        }
    }
}

#[test]
fn linear_slice_recognises_consecutive_copied_clusters_only() {
    let cb = 16;
    let cs = 1u64 << cb;
    let linear: Vec<u64> = (0..512).map(|i| COPIED | (0x50_0000 + i * cs)).collect();
    let lin = LinearSlice::of(&linear, cb, false);
    assert_eq!(lin.host(0, cb), Some(0x50_0000));
    assert_eq!(lin.host(511, cb), Some(0x50_0000 + 511 * cs));
    assert_summary_agrees(lin, &linear, cb);
    let spoil: [(usize, u64); 7] = [
        (0, 0x50_0000),                               // not COPIED
        (0, 0),                                       // unallocated
        (7, 0),                                       // a hole
        (7, COPIED | (0x50_0000 + 8 * cs)),           // out of order
        (511, (COPIED | (0x50_0000 + 511 * cs)) | 1), // zero flag
        (3, COMPRESSED | (0x50_0000 + 3 * cs)),       // compressed
        (9, 0x50_0000 + 9 * cs),                      // shared with a snapshot
    ];
    for (i, v) in spoil {
        let mut e = linear.clone();
        e[i] = v;
        let lin = LinearSlice::of(&e, cb, false);
        assert_eq!(lin.host(1, cb), None, "entry {i} = {v:#x}");
        assert_summary_agrees(lin, &e, cb);
    }
    // A run that would leave the 56-bit offset field is never linear (the sum would carry
    // into the flag bits).
    let top = 0x00ff_ffff_ffff_0000u64 - 3 * cs;
    let e: Vec<u64> = (0..8).map(|i| COPIED | (top + i * cs)).collect();
    assert_eq!(LinearSlice::of(&e, cb, false).host(0, cb), None);
}

proptest! {
    /// Kept in step entry by entry (as the owner updates its cached slices), the summary
    /// equals one computed afresh, and every mapping it gives is the entry's own.
    #[test]
    fn linear_slice_kept_in_step_equals_recomputed(
        cb in 9u32..=21,
        base in 1u64..1 << 20,
        updates in proptest::collection::vec((0usize..64, 0u8..6), 0..200),
    ) {
        let n = 64;
        let at = |i: usize| COPIED | ((base + i as u64) << cb);
        let mut e: Vec<u64> = (0..n).map(at).collect();
        let mut lin = LinearSlice::of(&e, cb, false);
        for (i, kind) in updates {
            let new = match kind {
                0 | 1 => at(i),               // back in place
                2 => 0,                       // discarded
                3 => at(i) & !COPIED,         // shared
                4 => at((i + 1) % n),         // elsewhere
                _ => at(i) | 1,               // zero flag
            };
            let old = e[i];
            e[i] = new;
            lin.changed(i, (old, 0), (new, 0), &e, cb, false);
            prop_assert_eq!(lin, LinearSlice::of(&e, cb, false));
            assert_summary_agrees(lin, &e, cb);
        }
    }
}

/// Extended L2 words (entry, bitmap pairs) split into entries and bitmaps.
fn split_words(words: &[u64]) -> (Vec<u64>, Vec<u64>) {
    words.chunks_exact(2).map(|w| (w[0], w[1])).unzip()
}

proptest! {
    /// With extended L2 a slice is linear when its entries are, and every bitmap is
    /// [`FULL_BITMAP`] (every subcluster allocated data): kept in step entry by entry and
    /// bitmap by bitmap, the summary equals one computed afresh, and every mapping it gives
    /// is the entry's own, in a cluster allocated whole.
    #[test]
    fn extended_linear_slice_kept_in_step_equals_recomputed(
        cb in 14u32..=21,
        base in 1u64..1 << 20,
        updates in proptest::collection::vec((0usize..32, 0u8..7), 0..200),
    ) {
        let n = 32;
        let at = |i: usize| COPIED | ((base + i as u64) << cb);
        let mut w: Vec<u64> = (0..n).flat_map(|i| [at(i), FULL_BITMAP]).collect();
        let mut lin = LinearSlice::of(&w, cb, true);
        prop_assert!(lin.host(0, cb).is_some());
        for (i, kind) in updates {
            let (e, b) = (w[2 * i], w[2 * i + 1]);
            let new = match kind {
                0 | 1 => (at(i), FULL_BITMAP),                  // back in place, whole
                2 => (0, 0),                                    // discarded
                3 => (e, FULL_BITMAP & !(1 << (i % 32))),       // a subcluster unallocated
                4 => (e, (FULL_BITMAP >> 1) | (1u64 << 63)),    // the last one reads as zero
                5 => (at((i + 1) % n), b),                      // elsewhere
                _ => (at(i) & !COPIED, FULL_BITMAP),            // shared
            };
            w[2 * i] = new.0;
            w[2 * i + 1] = new.1;
            lin.changed(i, (e, b), new, &w, cb, true);
            prop_assert_eq!(lin, LinearSlice::of(&w, cb, true));
            let (entries, bitmaps) = split_words(&w);
            let whole = bitmaps.iter().all(|&b| b == FULL_BITMAP);
            for i in 0..n {
                if let Some(h) = lin.host(i as u64, cb) {
                    prop_assert_eq!(L2Entry(entries[i]).plain_data(cb, u64::MAX), Some((h, true)));
                    prop_assert_eq!(bitmaps[i], FULL_BITMAP);
                } else {
                    prop_assert!(!(whole && linear_by_definition(&entries, cb)), "not recognised");
                }
            }
        }
    }
}

#[test]
fn changes_that_only_add_keep_every_in_place_cluster() {
    let h = 0x5_0000u64;
    let none = SubclusterBitmap::NONE;
    let std = |old: u64, new: u64| {
        L2Entry::change_only_adds((L2Entry(old), none), (L2Entry(new), none), false)
    };
    // Additions: an allocation, a preallocated zero cluster written, COPIED set again.
    assert!(std(0, h | COPIED));
    assert!(std(ZERO, h | COPIED));
    assert!(std(h | COPIED | ZERO, h | COPIED));
    assert!(std(h, h | COPIED));
    assert!(std(h | COPIED, h | COPIED), "unchanged");
    // Removals: discard, zero flag, COPIED cleared (a snapshot), moved (COW), compressed.
    assert!(!std(h | COPIED, 0));
    assert!(!std(h | COPIED, ZERO));
    assert!(!std(h | COPIED, h | COPIED | ZERO));
    assert!(!std(h | COPIED, h));
    assert!(!std(h | COPIED, 0x9_0000 | COPIED));
    assert!(!std(h | COPIED, compressed_entry(16, 0x9_0000, 512).0));
    // Extended L2: subclusters gaining allocation add; losing it, or turning zero, removes.
    let ext = |old: (u32, u32), new: (u32, u32)| {
        L2Entry::change_only_adds(
            (L2Entry(h | COPIED), SubclusterBitmap::new(old.0, old.1)),
            (L2Entry(h | COPIED), SubclusterBitmap::new(new.0, new.1)),
            true,
        )
    };
    assert!(ext((0, 0), (0b1, 0)));
    assert!(ext((0b0011, 0), (0b0111, 0)));
    assert!(ext((0, 0b1), (0b1, 0)), "a zero subcluster written");
    assert!(!ext((0b0011, 0), (0b0001, 0)));
    assert!(!ext((0b0011, 0), (0b0001, 0b0010)));
    assert!(!L2Entry::change_only_adds(
        (L2Entry(h | COPIED), SubclusterBitmap::new(1, 0)),
        (L2Entry(0), SubclusterBitmap::new(0, u32::MAX)),
        true
    ));
}
