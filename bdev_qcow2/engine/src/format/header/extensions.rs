//! The header extensions (between the fixed header and the backing file name): their
//! types, decoded and validated into [`Extensions`], and encoded back; the feature names
//! table.

use super::{autoclear, Header};
use crate::error::{invalid, Field, Result};
use crate::format::be::{get_u32, get_u64, put_u32, put_u64};
use crate::limits::*;

/// Header extension type codes.
pub mod ext_type {
    /// End of the extension area.
    pub const END: u32 = 0;
    /// Backing file format name.
    pub const BACKING_FORMAT: u32 = 0xe279_2aca;
    /// Feature name table.
    pub const FEATURE_NAME_TABLE: u32 = 0x6803_f857;
    /// Persistent bitmaps.
    pub const BITMAPS: u32 = 0x2385_2875;
    /// Full disk encryption header pointer.
    pub const ENCRYPTION: u32 = 0x0537_be77;
    /// External data file name.
    pub const EXTERNAL_DATA_FILE: u32 = 0x4441_5441;
    /// bdev_qcow2's zeroed tail (8 bytes: the offset it starts at), valid only with
    /// [`autoclear::ZEROED_TAIL`](super::autoclear::ZEROED_TAIL). "zero" in ASCII.
    pub const ZEROED_TAIL: u32 = 0x7a65_726f;
}

/// One entry of the feature name table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeatureName {
    /// 0 incompatible, 1 compatible, 2 autoclear.
    pub kind: u8,
    /// Bit number.
    pub bit: u8,
    /// Name (up to 46 bytes).
    pub name: String,
}

/// The bitmaps extension (parsed and preserved; bitmaps themselves are not interpreted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitmapsExt {
    /// Number of bitmaps in the directory.
    pub nb_bitmaps: u32,
    /// Size of the bitmap directory in bytes.
    pub directory_size: u64,
    /// Host offset of the bitmap directory.
    pub directory_offset: u64,
}

/// bdev_qcow2's zeroed-tail extension: every byte of the device at or past `from` reads
/// as zeros, so a first write into a cluster there needs no zeros written around it. Made
/// by a format that zeroed the device; its writer raises `from` (written and flushed)
/// before it writes at or past it, and sets it back to its last allocated cluster when it
/// closes. Valid only while [`autoclear::ZEROED_TAIL`] is set: QEMU, and any other writer
/// that does not know the bit, clears it when it opens the image for writing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZeroedTail {
    /// Device offset where the zeros start.
    pub from: u64,
    /// Where `from` lies in cluster 0 (the writer patches it in place); encoding puts the
    /// extension first, right after the header.
    pub at: u64,
}

/// Header extensions, in the order they matter to us; unknown ones are kept verbatim.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Extensions {
    /// The zeroed tail, if present and valid (its autoclear bit set).
    pub zeroed_tail: Option<ZeroedTail>,
    /// Backing file format name ("qcow2", "raw").
    pub backing_format: Option<String>,
    /// Feature name table entries.
    pub feature_names: Vec<FeatureName>,
    /// Bitmaps extension, if present and valid (autoclear bit set).
    pub bitmaps: Option<BitmapsExt>,
    /// External data file name.
    pub external_data_file: Option<String>,
    /// Encryption header (offset, length), refused at open.
    pub encryption: Option<(u64, u64)>,
    /// Extensions we do not know: (type, data), preserved.
    pub unknown: Vec<(u32, Vec<u8>)>,
}

pub(super) fn feature_label(names: &[FeatureName], kind: u8, bit: u32) -> String {
    names
        .iter()
        .find(|f| f.kind == kind && u32::from(f.bit) == bit)
        .map(|f| format!("'{}' (bit {bit})", f.name))
        .unwrap_or_else(|| format!("unknown feature bit {bit}"))
}

pub(super) fn decode_extensions(c0: &[u8], start: u64, end: u64, h: &Header) -> Result<Extensions> {
    let mut ext = Extensions::default();
    let mut off = start;
    loop {
        if off + 8 > end {
            // An unterminated chain that runs into the backing file name or the cluster end.
            if off == end && h.version == 2 && start == end {
                return Ok(ext);
            }
            return Err(invalid(
                Field::HeaderExtension,
                off,
                "extension chain is not terminated",
            ));
        }
        let typ = get_u32(c0, off as usize);
        let len = u64::from(get_u32(c0, off as usize + 4));
        if typ == ext_type::END {
            return Ok(ext);
        }
        let data_start = off + 8;
        let data_end = data_start
            .checked_add(len)
            .filter(|e| *e <= end)
            .ok_or_else(|| {
                invalid(
                    Field::HeaderExtension,
                    u64::from(typ),
                    "extension length runs past the extension area",
                )
            })?;
        let data = &c0[data_start as usize..data_end as usize];
        match typ {
            ext_type::BACKING_FORMAT => {
                if len >= 16 {
                    return Err(invalid(
                        Field::BackingFormatExtension,
                        len,
                        "backing format name is 16 bytes or longer",
                    ));
                }
                let s = std::str::from_utf8(data)
                    .map_err(|_| invalid(Field::BackingFormatExtension, len, "not valid UTF-8"))?;
                ext.backing_format = Some(s.trim_end_matches('\0').to_string());
            }
            ext_type::FEATURE_NAME_TABLE => {
                if len % 48 != 0 {
                    return Err(invalid(
                        Field::FeatureNameTable,
                        len,
                        "length not a multiple of 48",
                    ));
                }
                for e in data.chunks_exact(48) {
                    let raw = &e[2..48];
                    let n = raw.iter().position(|b| *b == 0).unwrap_or(raw.len());
                    ext.feature_names.push(FeatureName {
                        kind: e[0],
                        bit: e[1],
                        name: String::from_utf8_lossy(&raw[..n]).into_owned(),
                    });
                }
            }
            ext_type::BITMAPS => {
                if len != 24 {
                    return Err(invalid(Field::BitmapsExtension, len, "length is not 24"));
                }
                let nb = get_u32(data, 0);
                let reserved = get_u32(data, 4);
                let dsize = get_u64(data, 8);
                let doff = get_u64(data, 16);
                // Without the autoclear bit the extension is stale: QEMU ignores it, and so do we
                // (it is still preserved verbatim).
                if h.autoclear_features & autoclear::BITMAPS != 0 {
                    if reserved != 0 {
                        return Err(invalid(
                            Field::BitmapsExtension,
                            reserved.into(),
                            "reserved field is not zero",
                        ));
                    }
                    if nb == 0 || u64::from(nb) > MAX_BITMAPS {
                        return Err(invalid(
                            Field::BitmapsExtension,
                            nb.into(),
                            "bad number of bitmaps",
                        ));
                    }
                    if dsize == 0 || dsize > MAX_BITMAP_DIRECTORY_BYTES {
                        return Err(invalid(
                            Field::BitmapsExtension,
                            dsize,
                            "bad bitmap directory size",
                        ));
                    }
                    if !doff.is_multiple_of(1u64 << h.cluster_bits) || doff == 0 {
                        return Err(invalid(
                            Field::BitmapsExtension,
                            doff,
                            "bitmap directory offset not aligned to a cluster",
                        ));
                    }
                    ext.bitmaps = Some(BitmapsExt {
                        nb_bitmaps: nb,
                        directory_size: dsize,
                        directory_offset: doff,
                    });
                } else {
                    ext.unknown.push((typ, data.to_vec()));
                }
            }
            ext_type::ZEROED_TAIL
                if len == 8 && h.autoclear_features & autoclear::ZEROED_TAIL != 0 =>
            {
                // Without the bit (or with a length we never write) the claim is void; the
                // extension is kept verbatim like any unknown one.
                ext.zeroed_tail = Some(ZeroedTail {
                    from: get_u64(data, 0),
                    at: data_start,
                });
            }
            ext_type::EXTERNAL_DATA_FILE => {
                let s = std::str::from_utf8(data).map_err(|_| {
                    invalid(Field::ExternalDataFileExtension, len, "not valid UTF-8")
                })?;
                ext.external_data_file = Some(s.trim_end_matches('\0').to_string());
            }
            ext_type::ENCRYPTION => {
                if len != 16 {
                    return Err(invalid(Field::EncryptionExtension, len, "length is not 16"));
                }
                ext.encryption = Some((get_u64(data, 0), get_u64(data, 8)));
            }
            _ => ext.unknown.push((typ, data.to_vec())),
        }
        // Data is padded to a multiple of 8.
        off = data_start + len.div_ceil(8) * 8;
    }
}

pub(super) fn push_ext(out: &mut Vec<u8>, typ: u32, data: &[u8]) {
    out.extend_from_slice(&typ.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out.resize(out.len().div_ceil(8) * 8, 0);
}

pub(super) fn encode_extensions(ext: &Extensions, out: &mut Vec<u8>) {
    // First, so that it lies in the header's first sector (which header updates rewrite).
    if let Some(z) = ext.zeroed_tail {
        push_ext(out, ext_type::ZEROED_TAIL, &z.from.to_be_bytes());
    }
    if let Some(f) = &ext.backing_format {
        push_ext(out, ext_type::BACKING_FORMAT, f.as_bytes());
    }
    if let Some(f) = &ext.external_data_file {
        push_ext(out, ext_type::EXTERNAL_DATA_FILE, f.as_bytes());
    }
    if let Some((o, l)) = ext.encryption {
        let mut d = [0u8; 16];
        put_u64(&mut d, 0, o);
        put_u64(&mut d, 8, l);
        push_ext(out, ext_type::ENCRYPTION, &d);
    }
    if let Some(b) = &ext.bitmaps {
        let mut d = [0u8; 24];
        put_u32(&mut d, 0, b.nb_bitmaps);
        put_u64(&mut d, 8, b.directory_size);
        put_u64(&mut d, 16, b.directory_offset);
        push_ext(out, ext_type::BITMAPS, &d);
    }
    for (t, d) in &ext.unknown {
        push_ext(out, *t, d);
    }
    if !ext.feature_names.is_empty() {
        let mut d = Vec::with_capacity(ext.feature_names.len() * 48);
        for f in &ext.feature_names {
            let mut e = [0u8; 48];
            e[0] = f.kind;
            e[1] = f.bit;
            let n = f.name.len().min(46);
            e[2..2 + n].copy_from_slice(&f.name.as_bytes()[..n]);
            d.extend_from_slice(&e);
        }
        push_ext(out, ext_type::FEATURE_NAME_TABLE, &d);
    }
    push_ext(out, ext_type::END, &[]);
}

/// The feature name table QEMU writes into every v3 image.
pub fn default_feature_names() -> Vec<FeatureName> {
    let f = |kind, bit, name: &str| FeatureName {
        kind,
        bit,
        name: name.to_string(),
    };
    vec![
        f(0, 0, "dirty bit"),
        f(0, 1, "corrupt bit"),
        f(0, 2, "external data file"),
        f(0, 3, "compression type"),
        f(0, 4, "extended L2 entries"),
        f(1, 0, "lazy refcounts"),
        f(2, 0, "bitmaps"),
        f(2, 1, "raw external data"),
    ]
}
