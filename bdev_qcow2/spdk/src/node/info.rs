//! What `dump_info_json` says about a bdev's image: read from its header when the bdev
//! was created (or switched to another image), and again from the metadata owner's image
//! at each call on the md thread, so that a resize, a snapshot or a stream shows at once.

use crate::device::Zeroing;
use crate::owner::Owner;
use crate::params::CreateParams;
use qcow2_engine::io::BlockDevice;
use qcow2_engine::{Layer, Qcow2};
use serde::Serialize;

/// What `dump_info_json` says about the image.
#[derive(Debug, Clone, Serialize)]
pub struct ImageInfo {
    /// Virtual disk size in bytes.
    pub virtual_size: u64,
    /// Cluster size in bytes.
    pub cluster_size: u64,
    /// qcow2 version (2 or 3).
    pub version: u32,
    /// `0.10` (v2) or `1.1` (v3), as qemu-img calls them.
    pub compat: &'static str,
    /// Backing file name recorded in the image (informational: never opened).
    pub backing_file: Option<String>,
    /// Backing format recorded in the image.
    pub backing_format: Option<String>,
    /// Compression type of compressed clusters.
    pub compression_type: &'static str,
    /// Extended L2 entries (subclusters).
    pub extended_l2: bool,
    /// Refcount width in bits.
    pub refcount_bits: u32,
    /// Lazy refcounts enabled.
    pub lazy_refcounts: bool,
    /// The corrupt bit is set.
    pub corrupt: bool,
    /// The dirty bit is set (lazy refcounts: refcounts on the device may be stale).
    pub dirty: bool,
    /// The internal snapshots.
    pub snapshots: Vec<SnapshotInfo>,
    /// Raw feature bitmaps.
    pub incompatible_features: u64,
    /// Raw feature bitmaps.
    pub compatible_features: u64,
    /// Raw feature bitmaps.
    pub autoclear_features: u64,
    /// The bdev holding the image.
    pub base_bdev: String,
    /// The bdev holding the backing image, if any.
    pub backing_bdev: Option<String>,
    /// Whether the bdev refuses writes (`read_only` of the create call).
    pub read_only: bool,
    /// Whether partial first writes leave their zeros to the base's WRITE_ZEROES (the
    /// `zero_offload` of the create call, or its default for this base).
    pub zero_offload: bool,
    /// Whether the base is zeroed ahead of the allocator (the `zero_ahead` of the create
    /// call, or its default for this base; only where the image records no zeroed tail).
    pub zero_ahead: bool,
    /// The persistent dirty bitmaps the bdev keeps (QEMU's incremental backup): `in_use`
    /// while the bdev is open, stored at its deletion.
    pub persistent_bitmaps: Vec<PersistentBitmap>,
    /// An encrypted image's LUKS cipher and the keyring key that unlocked it (absent: a
    /// plain image).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub encryption: Option<EncryptionInfo>,
    /// The zeroing asked for on this base (what the image allows is read again each time).
    #[serde(skip)]
    zeroing: Zeroing,
}

/// An internal snapshot of [`ImageInfo`].
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotInfo {
    /// Its unique id.
    pub id: String,
    /// Its name.
    pub name: String,
}

/// A persistent bitmap of [`ImageInfo`].
#[derive(Debug, Clone, Serialize)]
pub struct PersistentBitmap {
    /// Its name.
    pub name: String,
    /// Whether it records the bdev's writes (QEMU's `auto` flag).
    pub enabled: bool,
}

/// The encryption of [`ImageInfo`], as the LUKS header names it (`qemu-img info`'s
/// `encrypt` fields).
#[derive(Debug, Clone, Serialize)]
pub struct EncryptionInfo {
    /// Always `luks`.
    pub format: &'static str,
    /// `cipher-alg`'s cipher (`aes`).
    pub cipher_name: String,
    /// `xts-plain64` and the like.
    pub cipher_mode: String,
    /// The master key's length in bits.
    pub key_bits: u32,
    /// PBKDF2's hash.
    pub hash: &'static str,
    /// The name of the keyring key (never its bytes).
    pub key: Option<String>,
}

impl ImageInfo {
    /// What image `q` says now, served with the create call `p` on a base zeroed as `z`.
    pub(crate) fn of<D: BlockDevice>(q: &Qcow2<D>, p: &CreateParams, z: Zeroing) -> ImageInfo {
        let h = q.header();
        ImageInfo {
            virtual_size: q.size(),
            cluster_size: h.cluster_size(),
            version: h.header.version,
            compat: if h.header.version >= 3 { "1.1" } else { "0.10" },
            backing_file: h.backing_file.clone(),
            backing_format: h.extensions.backing_format.clone(),
            compression_type: h.header.compression_type.name(),
            extended_l2: h.extended_l2(),
            refcount_bits: h.refcount_bits(),
            lazy_refcounts: h.lazy_refcounts(),
            corrupt: h.is_corrupt(),
            dirty: q.dirty_bit(),
            snapshots: q
                .snapshots()
                .into_iter()
                .map(|s| SnapshotInfo {
                    id: s.id,
                    name: s.name,
                })
                .collect(),
            incompatible_features: h.header.incompatible_features,
            compatible_features: h.header.compatible_features,
            autoclear_features: h.header.autoclear_features,
            base_bdev: p.base_bdev.clone(),
            backing_bdev: p.backing_bdev.clone(),
            read_only: p.read_only,
            zero_offload: z.offload && !p.read_only,
            zero_ahead: z.ahead && q.zeroing_ahead(),
            persistent_bitmaps: q
                .kept_bitmaps()
                .into_iter()
                .map(|(name, enabled)| PersistentBitmap { name, enabled })
                .collect(),
            encryption: q.luks().map(|l| {
                let h = l.header();
                EncryptionInfo {
                    format: "luks",
                    cipher_name: h.cipher_name.clone(),
                    cipher_mode: h.cipher_mode.clone(),
                    key_bits: h.key_bytes * 8,
                    hash: h.hash.name(),
                    key: p.key.clone(),
                }
            }),
            zeroing: z,
        }
    }

    /// The image as `owner` (the metadata owner, on its md thread) has it now, served with
    /// the create call `p` as `save_config` would write it; this one if the owner's chain
    /// has no qcow2 layer on top (it always has).
    pub(crate) fn now(&self, owner: &Owner, p: &CreateParams) -> ImageInfo {
        match owner.chain().layers().first() {
            Some(Layer::Qcow2(q)) => ImageInfo::of(q, p, self.zeroing),
            _ => self.clone(),
        }
    }
}
