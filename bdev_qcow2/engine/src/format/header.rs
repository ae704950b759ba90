//! The qcow2 header (cluster 0): fixed fields, header extensions and the backing file name.
//!
//! Decoding validates every field against the spec (QEMU `docs/interop/qcow2.rst`) and the
//! limits in [`crate::limits`]; each failure is an [`Error`] naming the field.

use super::be::{get_u32, get_u64, put_u32, put_u64};
use crate::error::{invalid, Error, Field, Result};
use crate::limits::*;

mod extensions;

use extensions::{decode_extensions, encode_extensions, feature_label};
pub use extensions::{
    default_feature_names, ext_type, BitmapsExt, Extensions, FeatureName, ZeroedTail,
};

/// `crypt_method` of a LUKS-encrypted image.
pub const CRYPT_LUKS: u32 = 2;
/// `QFI\xfb`.
pub const MAGIC: u32 = 0x5146_49fb;
/// Length of the version 2 header.
pub const V2_HEADER_LEN: u32 = 72;
/// Smallest version 3 header.
pub const V3_MIN_HEADER_LEN: u32 = 104;
/// Length of the version 3 header QEMU writes (with the compression type byte, padded).
pub const V3_HEADER_LEN: u32 = 112;

/// Incompatible feature bits.
pub mod incompat {
    /// Refcounts may be stale (lazy refcounts); repair before writing.
    pub const DIRTY: u64 = 1 << 0;
    /// Metadata is known to be corrupt; open read-only.
    pub const CORRUPT: u64 = 1 << 1;
    /// Guest data lives in an external data file.
    pub const EXTERNAL_DATA_FILE: u64 = 1 << 2;
    /// The compression_type field is not zlib.
    pub const COMPRESSION_TYPE: u64 = 1 << 3;
    /// L2 entries are 128-bit extended entries with subclusters.
    pub const EXTENDED_L2: u64 = 1 << 4;
    /// Every bit this implementation knows.
    pub const KNOWN: u64 = DIRTY | CORRUPT | EXTERNAL_DATA_FILE | COMPRESSION_TYPE | EXTENDED_L2;
}

/// Compatible feature bits.
pub mod compat {
    /// Refcount updates may be deferred; the dirty bit guards them.
    pub const LAZY_REFCOUNTS: u64 = 1 << 0;
}

/// Autoclear feature bits.
pub mod autoclear {
    /// The bitmaps extension is consistent.
    pub const BITMAPS: u64 = 1 << 0;
    /// The external data file is a valid raw image.
    pub const RAW_EXTERNAL: u64 = 1 << 1;
    /// bdev_qcow2's zeroed tail ([`ZeroedTail`](super::ZeroedTail)): the device reads
    /// zeros past the offset its extension records. Not one of QEMU's bits: the top bit,
    /// far from those the specification assigns in order. Any writer that does not know it
    /// clears it before writing (the autoclear rule), which makes the claim void.
    pub const ZEROED_TAIL: u64 = 1 << 63;
}

/// Compression algorithms (the `compression_type` field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CompressionType {
    /// Raw deflate (zlib without header), window 4 KiB, as QEMU writes it.
    #[default]
    Zlib,
    /// Zstandard frames.
    Zstd,
}

impl CompressionType {
    /// The name `qemu-img info` prints.
    pub fn name(&self) -> &'static str {
        match self {
            CompressionType::Zlib => "zlib",
            CompressionType::Zstd => "zstd",
        }
    }
}

/// The fixed header fields, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// 2 or 3.
    pub version: u32,
    /// Offset of the backing file name in cluster 0 (0: none).
    pub backing_file_offset: u64,
    /// Length of the backing file name.
    pub backing_file_size: u32,
    /// log2 of the cluster size.
    pub cluster_bits: u32,
    /// Virtual disk size in bytes.
    pub size: u64,
    /// 0, or [`CRYPT_LUKS`] (1, legacy AES, is refused).
    pub crypt_method: u32,
    /// Entries in the active L1 table.
    pub l1_size: u32,
    /// Host offset of the active L1 table.
    pub l1_table_offset: u64,
    /// Host offset of the refcount table.
    pub refcount_table_offset: u64,
    /// Size of the refcount table in clusters.
    pub refcount_table_clusters: u32,
    /// Number of internal snapshots.
    pub nb_snapshots: u32,
    /// Host offset of the snapshot table.
    pub snapshots_offset: u64,
    /// Incompatible feature bits (v3).
    pub incompatible_features: u64,
    /// Compatible feature bits (v3).
    pub compatible_features: u64,
    /// Autoclear feature bits (v3).
    pub autoclear_features: u64,
    /// log2 of the refcount width in bits (v2: 4).
    pub refcount_order: u32,
    /// Header length in bytes (v2: 72).
    pub header_length: u32,
    /// Compression algorithm (byte 104 when header_length > 104).
    pub compression_type: CompressionType,
    /// Header bytes past the fields we know (preserved on rewrite).
    pub unknown_tail: Vec<u8>,
}

/// Everything cluster 0 describes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageHeader {
    /// Fixed fields.
    pub header: Header,
    /// Header extensions.
    pub extensions: Extensions,
    /// Backing file name as stored (never opened unless the operator allows it).
    pub backing_file: Option<String>,
}

/// Bytes of the image needed before [`ImageHeader::decode`] can find the cluster size.
pub const PEEK_LEN: usize = 512;

/// Reads `cluster_bits` from the first bytes of an image after checking magic and version,
/// so a caller knows how much of cluster 0 to read.
pub fn peek_cluster_bits(buf: &[u8]) -> Result<u32> {
    if buf.len() < V2_HEADER_LEN as usize {
        return Err(invalid(
            Field::HeaderLength,
            buf.len() as u64,
            "image shorter than a header",
        ));
    }
    let magic = get_u32(buf, 0);
    if magic != MAGIC {
        return Err(Error::NotQcow2(magic));
    }
    let version = get_u32(buf, 4);
    if version != 2 && version != 3 {
        return Err(Error::UnsupportedVersion(version));
    }
    let cluster_bits = get_u32(buf, 20);
    if !(MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS).contains(&cluster_bits) {
        return Err(invalid(
            Field::ClusterBits,
            cluster_bits.into(),
            "must be 9..=21 (512 B – 2 MiB)",
        ));
    }
    Ok(cluster_bits)
}

impl ImageHeader {
    /// Decodes and validates cluster 0.
    ///
    /// `buf` holds the start of the image: at least one cluster, or the whole image when it
    /// is shorter. `device_size` is the size of the device holding the image; every table
    /// must lie inside it. Returns the header, or the first invalid field found.
    pub fn decode(buf: &[u8], device_size: u64) -> Result<ImageHeader> {
        let cluster_bits = peek_cluster_bits(buf)?;
        let cluster_size = 1u64 << cluster_bits;
        let version = get_u32(buf, 4);
        let mut h = Header {
            version,
            backing_file_offset: get_u64(buf, 8),
            backing_file_size: get_u32(buf, 16),
            cluster_bits,
            size: get_u64(buf, 24),
            crypt_method: get_u32(buf, 32),
            l1_size: get_u32(buf, 36),
            l1_table_offset: get_u64(buf, 40),
            refcount_table_offset: get_u64(buf, 48),
            refcount_table_clusters: get_u32(buf, 56),
            nb_snapshots: get_u32(buf, 60),
            snapshots_offset: get_u64(buf, 64),
            incompatible_features: 0,
            compatible_features: 0,
            autoclear_features: 0,
            refcount_order: 4,
            header_length: V2_HEADER_LEN,
            compression_type: CompressionType::Zlib,
            unknown_tail: Vec::new(),
        };
        // The whole of cluster 0 that we have (the image may be shorter than a cluster).
        let c0 = &buf[..buf.len().min(cluster_size as usize)];
        if version == 3 {
            if c0.len() < V3_MIN_HEADER_LEN as usize {
                return Err(invalid(
                    Field::HeaderLength,
                    c0.len() as u64,
                    "image shorter than a v3 header",
                ));
            }
            h.incompatible_features = get_u64(buf, 72);
            h.compatible_features = get_u64(buf, 80);
            h.autoclear_features = get_u64(buf, 88);
            h.refcount_order = get_u32(buf, 96);
            h.header_length = get_u32(buf, 100);
            let hl = u64::from(h.header_length);
            if hl < u64::from(V3_MIN_HEADER_LEN) {
                return Err(invalid(Field::HeaderLength, hl, "shorter than 104 bytes"));
            }
            if hl % 8 != 0 {
                return Err(invalid(Field::HeaderLength, hl, "not a multiple of 8"));
            }
            if hl > cluster_size {
                return Err(invalid(Field::HeaderLength, hl, "larger than a cluster"));
            }
            if hl > c0.len() as u64 {
                return Err(invalid(
                    Field::HeaderLength,
                    hl,
                    "past the end of the image",
                ));
            }
            if hl > 104 {
                h.compression_type = match c0[104] {
                    0 => CompressionType::Zlib,
                    1 => CompressionType::Zstd,
                    t => {
                        return Err(invalid(
                            Field::CompressionType,
                            t.into(),
                            "unknown compression type",
                        ))
                    }
                };
            }
            if hl > u64::from(V3_HEADER_LEN) {
                h.unknown_tail = c0[V3_HEADER_LEN as usize..hl as usize].to_vec();
            }
        }

        // Header extensions end where the backing file name starts, or at the cluster end.
        let ext_start = u64::from(h.header_length);
        let ext_end = if h.backing_file_offset != 0 {
            h.backing_file_offset
        } else {
            cluster_size
        };
        // Backing file name.
        let backing_file = if h.backing_file_offset != 0 {
            let off = h.backing_file_offset;
            let len = u64::from(h.backing_file_size);
            if off >= cluster_size {
                return Err(invalid(
                    Field::BackingFileOffset,
                    off,
                    "past the first cluster",
                ));
            }
            if off < ext_start {
                return Err(invalid(
                    Field::BackingFileOffset,
                    off,
                    "overlaps the header",
                ));
            }
            if len > MAX_BACKING_FILE_NAME {
                return Err(invalid(
                    Field::BackingFileSize,
                    len,
                    "longer than 1023 bytes",
                ));
            }
            if off + len > cluster_size || off + len > c0.len() as u64 {
                return Err(invalid(
                    Field::BackingFileSize,
                    len,
                    "name runs past the first cluster",
                ));
            }
            if len == 0 {
                None
            } else {
                let raw = &c0[off as usize..(off + len) as usize];
                let name = std::str::from_utf8(raw)
                    .map_err(|_| invalid(Field::BackingFileName, len, "not valid UTF-8"))?;
                if name.contains('\0') {
                    return Err(invalid(Field::BackingFileName, len, "contains a NUL byte"));
                }
                Some(name.to_string())
            }
        } else {
            None
        };
        let ext_end = ext_end.min(c0.len() as u64);
        let extensions = decode_extensions(c0, ext_start, ext_end, &h)?;

        let ih = ImageHeader {
            header: h,
            extensions,
            backing_file,
        };
        ih.validate(device_size)?;
        Ok(ih)
    }

    /// Validates the fixed fields against the spec, our limits and the device size.
    fn validate(&self, device_size: u64) -> Result<()> {
        let h = &self.header;
        let cluster_size = 1u64 << h.cluster_bits;
        let names = &self.extensions.feature_names;

        match (h.crypt_method, self.extensions.encryption) {
            (0, None) => {}
            (0, Some(_)) => {
                return Err(invalid(
                    Field::EncryptionExtension,
                    0,
                    "encryption header present without encryption",
                ))
            }
            (1, _) => {
                return Err(invalid(
                    Field::CryptMethod,
                    1,
                    "legacy AES encryption is insecure and not supported: \
                     `qemu-img convert` it to an unencrypted or LUKS-encrypted image",
                ))
            }
            (CRYPT_LUKS, None) => {
                return Err(invalid(
                    Field::EncryptionExtension,
                    0,
                    "LUKS encryption without its header extension",
                ))
            }
            (CRYPT_LUKS, Some((off, len))) => {
                if off == 0 || off % cluster_size != 0 {
                    return Err(invalid(
                        Field::EncryptionExtension,
                        off,
                        "LUKS header offset not cluster aligned",
                    ));
                }
                if len == 0 || len > crate::limits::MAX_LUKS_HEADER_BYTES {
                    return Err(invalid(
                        Field::EncryptionExtension,
                        len,
                        "LUKS header length",
                    ));
                }
                if off.checked_add(len).is_none_or(|e| e > device_size) {
                    return Err(invalid(
                        Field::EncryptionExtension,
                        off,
                        "LUKS header past the end of the device",
                    ));
                }
            }
            (m, _) => {
                return Err(invalid(
                    Field::CryptMethod,
                    m.into(),
                    "unknown encryption method",
                ))
            }
        }
        let unknown = h.incompatible_features & !incompat::KNOWN;
        if unknown != 0 {
            let bit = unknown.trailing_zeros();
            return Err(Error::UnsupportedFeature(format!(
                "incompatible feature {} is not supported (incompatible_features {:#x})",
                feature_label(names, 0, bit),
                h.incompatible_features
            )));
        }
        if h.incompatible_features & incompat::EXTERNAL_DATA_FILE != 0 {
            return Err(Error::UnsupportedFeature(format!(
                "incompatible feature {} is not supported yet (data file {:?})",
                feature_label(names, 0, 2),
                self.extensions.external_data_file.as_deref().unwrap_or("")
            )));
        }
        let ct_bit = h.incompatible_features & incompat::COMPRESSION_TYPE != 0;
        match (h.compression_type, ct_bit) {
            (CompressionType::Zlib, true) => {
                return Err(invalid(
                    Field::CompressionType,
                    0,
                    "compression type bit set with zlib",
                ))
            }
            (CompressionType::Zstd, false) => {
                return Err(invalid(
                    Field::CompressionType,
                    1,
                    "non-zlib compression without the compression type bit",
                ))
            }
            _ => {}
        }
        if h.refcount_order > 6 {
            return Err(invalid(
                Field::RefcountOrder,
                h.refcount_order.into(),
                "refcount width above 64 bits",
            ));
        }
        let extended_l2 = h.incompatible_features & incompat::EXTENDED_L2 != 0;
        if extended_l2 && h.cluster_bits < MIN_CLUSTER_BITS_EXTENDED_L2 {
            return Err(invalid(
                Field::ClusterBits,
                h.cluster_bits.into(),
                "extended L2 needs clusters of at least 16 KiB",
            ));
        }

        // Virtual size and the L1 table that must address it.
        if h.size > MAX_VIRTUAL_SIZE {
            return Err(invalid(
                Field::Size,
                h.size,
                "virtual size above 2^61 bytes",
            ));
        }
        let l2_bits = h.cluster_bits - if extended_l2 { 4 } else { 3 };
        let l1_needed = h.size.div_ceil(1u64 << (h.cluster_bits + l2_bits));
        if l1_needed > MAX_L1_ENTRIES {
            return Err(invalid(
                Field::Size,
                h.size,
                "needs an L1 table larger than 32 MiB",
            ));
        }
        let l1_size = u64::from(h.l1_size);
        if l1_size > MAX_L1_ENTRIES {
            return Err(invalid(
                Field::L1Size,
                l1_size,
                "L1 table larger than 32 MiB",
            ));
        }
        if l1_size < l1_needed {
            return Err(invalid(
                Field::L1Size,
                l1_size,
                "L1 table too small for the virtual size",
            ));
        }
        check_table(
            Field::L1TableOffset,
            h.l1_table_offset,
            l1_size * 8,
            cluster_size,
            device_size,
            l1_size == 0,
        )?;

        // Refcount table.
        let rt_clusters = u64::from(h.refcount_table_clusters);
        if rt_clusters == 0 {
            return Err(invalid(
                Field::RefcountTableClusters,
                0,
                "refcount table has no clusters",
            ));
        }
        let rt_bytes = rt_clusters << h.cluster_bits;
        if rt_bytes > MAX_REFCOUNT_TABLE_BYTES {
            return Err(invalid(
                Field::RefcountTableClusters,
                rt_clusters,
                "refcount table larger than 8 MiB",
            ));
        }
        check_table(
            Field::RefcountTableOffset,
            h.refcount_table_offset,
            rt_bytes,
            cluster_size,
            device_size,
            false,
        )?;

        // Snapshot table location (entries are validated when read).
        let nb = u64::from(h.nb_snapshots);
        if nb > MAX_SNAPSHOTS {
            return Err(invalid(Field::NbSnapshots, nb, "more than 65536 snapshots"));
        }
        if nb > 0 {
            // Each entry is at least 40 bytes; the table's real length is known only once read.
            check_table(
                Field::SnapshotsOffset,
                h.snapshots_offset,
                nb * 40,
                cluster_size,
                device_size,
                false,
            )?;
        }
        Ok(())
    }

    /// Geometry of this image with the given slice size (clamped to the cluster size).
    pub fn geometry(&self, slice_bits: u32) -> crate::types::Geometry {
        let width = if self.extended_l2() {
            crate::types::L2EntryWidth::Extended
        } else {
            crate::types::L2EntryWidth::Standard
        };
        crate::types::Geometry::new(
            self.header.cluster_bits,
            width,
            slice_bits.clamp(9, self.header.cluster_bits),
        )
    }

    /// Cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        1 << self.header.cluster_bits
    }
    /// Whether L2 entries are extended (subclusters).
    pub fn extended_l2(&self) -> bool {
        self.header.incompatible_features & incompat::EXTENDED_L2 != 0
    }
    /// Refcount width in bits.
    pub fn refcount_bits(&self) -> u32 {
        1 << self.header.refcount_order
    }
    /// Whether the corrupt bit is set.
    pub fn is_corrupt(&self) -> bool {
        self.header.incompatible_features & incompat::CORRUPT != 0
    }
    /// Whether the dirty bit is set.
    pub fn is_dirty(&self) -> bool {
        self.header.incompatible_features & incompat::DIRTY != 0
    }
    /// Whether lazy refcounts are enabled.
    pub fn lazy_refcounts(&self) -> bool {
        self.header.compatible_features & compat::LAZY_REFCOUNTS != 0
    }

    /// Encodes cluster 0 (header, extensions, backing file name) into `cluster_size` bytes.
    ///
    /// The backing file name is placed after the extensions and `backing_file_offset` /
    /// `backing_file_size` are set accordingly; `header_length` is kept (at least 112 for v3).
    /// The feature name table is optional: when the whole does not fit in one cluster it is
    /// left out (so it does not round trip). Returns an error if the rest does not fit.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let h = &self.header;
        let cs = 1usize << h.cluster_bits;
        let mut out = vec![0u8; cs];
        let hl = if h.version == 3 {
            (h.header_length.max(V3_HEADER_LEN) as usize)
                .max(V3_HEADER_LEN as usize + h.unknown_tail.len())
        } else {
            V2_HEADER_LEN as usize
        };
        let mut exts = Vec::new();
        encode_extensions(&self.extensions, &mut exts);
        let name = self.backing_file.as_deref().unwrap_or("");
        if hl + exts.len() + name.len() > cs && !self.extensions.feature_names.is_empty() {
            // The feature name table only names bits for messages; the backing file name and
            // the other extensions matter more. QEMU leaves it out of small clusters too.
            let mut ext = self.extensions.clone();
            ext.feature_names.clear();
            exts.clear();
            encode_extensions(&ext, &mut exts);
        }
        let name_off = hl + exts.len();
        if name_off + name.len() > cs {
            return Err(invalid(
                Field::HeaderExtension,
                (name_off + name.len()) as u64,
                "header does not fit in one cluster",
            ));
        }
        put_u32(&mut out, 0, MAGIC);
        put_u32(&mut out, 4, h.version);
        if name.is_empty() {
            put_u64(&mut out, 8, 0);
            put_u32(&mut out, 16, 0);
        } else {
            put_u64(&mut out, 8, name_off as u64);
            put_u32(&mut out, 16, name.len() as u32);
        }
        put_u32(&mut out, 20, h.cluster_bits);
        put_u64(&mut out, 24, h.size);
        put_u32(&mut out, 32, h.crypt_method);
        put_u32(&mut out, 36, h.l1_size);
        put_u64(&mut out, 40, h.l1_table_offset);
        put_u64(&mut out, 48, h.refcount_table_offset);
        put_u32(&mut out, 56, h.refcount_table_clusters);
        put_u32(&mut out, 60, h.nb_snapshots);
        put_u64(&mut out, 64, h.snapshots_offset);
        if h.version == 3 {
            put_u64(&mut out, 72, h.incompatible_features);
            put_u64(&mut out, 80, h.compatible_features);
            put_u64(&mut out, 88, h.autoclear_features);
            put_u32(&mut out, 96, h.refcount_order);
            put_u32(&mut out, 100, hl as u32);
            out[104] = match h.compression_type {
                CompressionType::Zlib => 0,
                CompressionType::Zstd => 1,
            };
            out[V3_HEADER_LEN as usize..V3_HEADER_LEN as usize + h.unknown_tail.len()]
                .copy_from_slice(&h.unknown_tail);
        }
        out[hl..hl + exts.len()].copy_from_slice(&exts);
        out[name_off..name_off + name.len()].copy_from_slice(name.as_bytes());
        Ok(out)
    }
}

/// Checks that a table of `len` bytes at `off` is cluster aligned, does not overflow and lies
/// inside the device. `may_be_empty`: an empty table may have offset 0.
fn check_table(
    field: Field,
    off: u64,
    len: u64,
    cluster_size: u64,
    device_size: u64,
    may_be_empty: bool,
) -> Result<()> {
    // Even an empty table must be aligned (as QEMU requires): its offset is still used,
    // e.g. rounded to sectors for a zero-length read, which must not overflow.
    if !off.is_multiple_of(cluster_size) {
        return Err(invalid(field, off, "not aligned to a cluster"));
    }
    if may_be_empty && len == 0 {
        return Ok(());
    }
    if off == 0 {
        return Err(invalid(field, off, "overlaps the header"));
    }
    let end = off
        .checked_add(len)
        .ok_or_else(|| invalid(field, off, "table end overflows"))?;
    if end > device_size {
        return Err(invalid(
            field,
            off,
            "table extends past the end of the device",
        ));
    }
    Ok(())
}
