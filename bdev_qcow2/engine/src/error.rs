//! The engine's one error type.
//!
//! Every failure caused by image contents names the on-disk field it came from
//! ([`Field`]), so an operator can tell what is wrong with a hostile or damaged image.

use std::fmt;

/// An on-disk field (or structure) of a qcow2 image, named in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum Field {
    Magic,
    Version,
    BackingFileOffset,
    BackingFileSize,
    BackingFileName,
    ClusterBits,
    Size,
    CryptMethod,
    L1Size,
    L1TableOffset,
    RefcountTableOffset,
    RefcountTableClusters,
    NbSnapshots,
    SnapshotsOffset,
    IncompatibleFeatures,
    CompatibleFeatures,
    AutoclearFeatures,
    RefcountOrder,
    HeaderLength,
    CompressionType,
    HeaderExtension,
    BackingFormatExtension,
    FeatureNameTable,
    BitmapsExtension,
    ExternalDataFileExtension,
    EncryptionExtension,
    LuksHeader,
    SnapshotTable,
    SnapshotL1Table,
    L1Entry,
    L2Entry,
    SubclusterBitmap,
    RefcountTableEntry,
    RefcountBlockEntry,
    CompressedDescriptor,
    CompressedData,
    BackingChain,
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Field::Magic => "magic",
            Field::Version => "version",
            Field::BackingFileOffset => "backing_file_offset",
            Field::BackingFileSize => "backing_file_size",
            Field::BackingFileName => "backing file name",
            Field::ClusterBits => "cluster_bits",
            Field::Size => "size",
            Field::CryptMethod => "crypt_method",
            Field::L1Size => "l1_size",
            Field::L1TableOffset => "l1_table_offset",
            Field::RefcountTableOffset => "refcount_table_offset",
            Field::RefcountTableClusters => "refcount_table_clusters",
            Field::NbSnapshots => "nb_snapshots",
            Field::SnapshotsOffset => "snapshots_offset",
            Field::IncompatibleFeatures => "incompatible_features",
            Field::CompatibleFeatures => "compatible_features",
            Field::AutoclearFeatures => "autoclear_features",
            Field::RefcountOrder => "refcount_order",
            Field::HeaderLength => "header_length",
            Field::CompressionType => "compression_type",
            Field::HeaderExtension => "header extension",
            Field::BackingFormatExtension => "backing format extension",
            Field::FeatureNameTable => "feature name table extension",
            Field::BitmapsExtension => "bitmaps extension",
            Field::ExternalDataFileExtension => "external data file extension",
            Field::EncryptionExtension => "full disk encryption extension",
            Field::LuksHeader => "LUKS header",
            Field::SnapshotTable => "snapshot table",
            Field::SnapshotL1Table => "snapshot L1 table",
            Field::L1Entry => "L1 entry",
            Field::L2Entry => "L2 entry",
            Field::SubclusterBitmap => "subcluster bitmap",
            Field::RefcountTableEntry => "refcount table entry",
            Field::RefcountBlockEntry => "refcount block entry",
            Field::CompressedDescriptor => "compressed cluster descriptor",
            Field::CompressedData => "compressed cluster data",
            Field::BackingChain => "backing chain",
        };
        f.write_str(s)
    }
}

/// Errors returned by the engine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The first four bytes are not `QFI\xfb`.
    #[error("not a qcow2 image (magic {0:#010x})")]
    NotQcow2(u32),
    /// A version other than 2 or 3.
    #[error("unsupported qcow2 version {0}")]
    UnsupportedVersion(u32),
    /// A field of the image holds a value that is invalid or exceeds a limit.
    #[error("invalid {field}: {reason} (value {value:#x})")]
    InvalidField {
        /// The on-disk field.
        field: Field,
        /// The offending value (or the most relevant number).
        value: u64,
        /// Why it is refused.
        reason: &'static str,
    },
    /// The image needs a feature this implementation does not have.
    #[error("unsupported feature: {0}")]
    UnsupportedFeature(String),
    /// Metadata found inconsistent while serving I/O; the request fails with EIO.
    #[error("image is corrupt: {field}: {reason} (value {value:#x})")]
    Corrupt {
        /// The on-disk structure that is inconsistent.
        field: Field,
        /// The offending value (usually an entry or an offset).
        value: u64,
        /// What is wrong.
        reason: &'static str,
    },
    /// The image names a backing file but the operator did not allow backing files.
    #[error(
        "image has backing file '{0}' but backing files are not allowed (use --allow-backing)"
    )]
    BackingNotAllowed(String),
    /// The backing chain is refused (loop, too deep, missing format).
    #[error("backing chain: {0}")]
    BackingChain(String),
    /// A guest request is out of range or not aligned.
    #[error("invalid request: {0}")]
    InvalidRequest(&'static str),
    /// An operation on the image (resize, snapshot) is refused as asked; the message says
    /// why and what would be accepted.
    #[error("{0}")]
    Refused(String),
    /// The image is opened read-only.
    #[error("image is read-only")]
    ReadOnly,
    /// The image has the corrupt bit set: it opens read-only only, until repaired.
    #[error("image is marked corrupt (corrupt bit set): it can be opened read-only only; `qcow2 check -r all` repairs it")]
    MarkedCorrupt,
    /// The image is encrypted and no key was given to open it.
    #[error("image is encrypted: a key is needed (encrypt.key-secret)")]
    KeyRequired,
    /// The key given opens none of the image's key slots.
    #[error("invalid password: the key opens no key slot of the image's LUKS header")]
    WrongKey,
    /// The device failed an I/O (errno).
    #[error("device I/O error: {}", errno_name(*.0))]
    Io(i32),
}

impl Error {
    /// The errno a host should report for this error (EIO for corruption, etc.).
    pub fn errno(&self) -> i32 {
        match self {
            Error::Io(e) => *e,
            Error::InvalidRequest(_) | Error::Refused(_) => 22, // EINVAL
            Error::ReadOnly | Error::MarkedCorrupt => 30,       // EROFS
            Error::KeyRequired | Error::WrongKey => 1,          // EPERM
            Error::UnsupportedFeature(_) => 95,                 // EOPNOTSUPP
            _ => 5,                                             // EIO
        }
    }

    /// The field an error names, if any.
    pub fn field(&self) -> Option<Field> {
        match self {
            Error::NotQcow2(_) => Some(Field::Magic),
            Error::UnsupportedVersion(_) => Some(Field::Version),
            Error::InvalidField { field, .. } | Error::Corrupt { field, .. } => Some(*field),
            Error::BackingNotAllowed(_) | Error::BackingChain(_) => Some(Field::BackingChain),
            _ => None,
        }
    }
}

fn errno_name(e: i32) -> String {
    match e {
        5 => "EIO".into(),
        28 => "ENOSPC".into(),
        12 => "ENOMEM".into(),
        22 => "EINVAL".into(),
        _ => format!("errno {e}"),
    }
}

/// Shorthand used by the parsers.
pub(crate) fn invalid(field: Field, value: u64, reason: &'static str) -> Error {
    Error::InvalidField {
        field,
        value,
        reason,
    }
}

/// Shorthand for runtime metadata corruption.
pub(crate) fn corrupt(field: Field, value: u64, reason: &'static str) -> Error {
    Error::Corrupt {
        field,
        value,
        reason,
    }
}

/// The engine's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
