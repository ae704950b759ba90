//! RPC parameters, decoded once into structs that `write_config_json` writes back, so
//! `save_config` round-trips.

use qcow2_engine::create::{CreateOptions, Preallocation};
use qcow2_engine::crypto::LuksParams;
use qcow2_engine::format::header::CompressionType;
use qcow2_engine::ring::RingConfig;
use qcow2_engine::OpenOptions;
use serde::{Deserialize, Serialize};

fn is_false(b: &bool) -> bool {
    !*b
}

/// `bdev_qcow2_create` parameters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateParams {
    /// Name of the qcow2 bdev to create.
    pub name: String,
    /// The bdev holding the image.
    pub base_bdev: String,
    /// The bdev holding the backing image (raw, or another qcow2 bdev), required when the
    /// image names a backing file. Never a path: backing images are bdevs named by the operator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backing_bdev: Option<String>,
    /// Serve read-only: every channel reads its own replica, and the base bdev is claimed
    /// shared read-only. Default `false`, as in QEMU: the image is opened writable (a dirty
    /// image is repaired first, a corrupt one refused), the base bdev is claimed as its only
    /// writer, and every request runs on the creating thread, the image's metadata owner.
    #[serde(default, skip_serializing_if = "is_false")]
    pub read_only: bool,
    /// Bytes of L2 slice cache per channel (default: the whole image's L2, at most 32 MiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub l2_cache_size: Option<u64>,
    /// L2 slice size in bytes (power of two, 512 up to the cluster size; default 4096).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub l2_slice_size: Option<u64>,
    /// Ways per set of the slice cache (1..=64, default 8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_ways: Option<usize>,
    /// Read-ahead on sequential streams, per channel (default `true`): guest data into the
    /// channel's prefetch ring (read ahead of each stream, served by a copy), and the next L2
    /// slice of a stream into its cache before the stream gets there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefetch: Option<bool>,
    /// Bytes of prefetch ring per channel, DMA memory allocated when the channel is created
    /// (a multiple of 128 KiB; default 5 MiB, `RingConfig::default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefetch_ring_size: Option<u64>,
    /// Most bytes one stream reads ahead (a multiple of 128 KiB, at most 8 MiB; default
    /// 1 MiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefetch_max_window: Option<u64>,
    /// Lay each L2 slice's data clusters out on the base in guest order, in a region of
    /// the base reserved for the slice (default `false`: clusters are appended in the order
    /// they are first written, as QEMU does). A slice then filled in any order or by
    /// several cores is linear (one extent: fewer base I/Os, no entry loads); random
    /// first writes get slower (scattered over the base instead of appended).
    #[serde(default, skip_serializing_if = "is_false")]
    pub ordered_layout: bool,
    /// Bytes a first write into an image without a backing file takes at once when the
    /// base reads zeros there (a zeroed tail): the aligned group of unallocated clusters
    /// around it, so later first writes into the group are overwrites (default 65536; at
    /// most the cluster size, e.g. 0: one cluster per first write, as QEMU does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alloc_granule: Option<u64>,
    /// Leave the rest of a new cluster that a first write covers only partly (16 KiB or
    /// more of it) to the base's WRITE_ZEROES, as QEMU does, rather than write the whole
    /// cluster from a zeroed buffer. Default: on where the base is an NVMe bdev, whose
    /// Write Zeroes command moves no data; `true`: on any base whose module zeroes itself
    /// (never SPDK's emulation with zero-buffer writes); `false`: off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zero_offload: Option<bool>,
    /// On an image that records no zeroed tail (one `qemu-img` made, say): zero the base
    /// past every cluster in use ahead of the allocator, in large Write Zeroes (a 64th of
    /// the base at a time, 64 MiB at most), so that a first write into a new cluster writes
    /// the guest's bytes alone rather than the whole cluster. Nothing is recorded in the
    /// image. Default: on where the base is an NVMe bdev; `true`: on any base whose module
    /// zeroes itself (an AIO bdev created with `fallocate`; never SPDK's emulation);
    /// `false`: off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zero_ahead: Option<bool>,
    /// Unmap on the base the clusters a guest unmap (or a write-zeroes with unmap) frees,
    /// once the metadata that freed them is on stable storage, where the base unmaps
    /// (a thin lvol gives its clusters back). QEMU's `pass-discard-request`; default `true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pass_discard_request: Option<bool>,
    /// The same for the clusters a snapshot's deletion frees (QEMU's
    /// `pass-discard-snapshot`; default `true`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pass_discard_snapshot: Option<bool>,
    /// The same for clusters freed otherwise: copied-on-write clusters, old tables, aborted
    /// allocations (QEMU's `pass-discard-other`; default `false`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pass_discard_other: Option<bool>,
    /// The bdev's UUID (SPDK's form, 8-4-4-4-12 hex digits), which an NVMe-oF namespace
    /// takes as its NGUID and UUID. Default: derived from the base bdev's UUID and the
    /// bdev's name, the same on every start (`node/identity.rs`); `save_config` writes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// Warn in the log once the image's end on the base passes this percentage of the
    /// base's size (a thin lvol or a file filling up: grow it before writes fail with
    /// ENOSPC), as QEMU's write threshold does on a host offset; again after the base is
    /// resized. 0: off; default 90. `bdev_qcow2_get_stats` reports the space either way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub space_warn_percent: Option<u8>,
    /// Bytes of the read cache of the backing bdev's data shared by every qcow2 bdev that
    /// names the same backing bdev, on every core (a golden image under many overlays is
    /// read once for all of them). Memory is taken as the cache fills, in 64 KiB granules.
    /// The first bdev that reads a backing bdev sizes its cache; 0: this bdev reads the
    /// backing bdev past it. Memory is taken as the cache fills, and only while two bdevs
    /// or more share the backing bdev (one alone reads past it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backing_cache_size: Option<u64>,
    /// The name of the key in SPDK's keyring (`keyring_file_add_key`) whose bytes are the
    /// passphrase of an encrypted (LUKS) image, as QEMU's `encrypt.key-secret` names a
    /// secret. Required for an encrypted image, refused for a plain one. `save_config`
    /// writes the name, never the key (the keyring's own config is saved before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

/// The default of [`CreateParams::backing_cache_size`].
pub const DEFAULT_BACKING_CACHE_SIZE: u64 = 256 << 20;

/// The default of [`CreateParams::space_warn_percent`].
pub const DEFAULT_SPACE_WARN_PERCENT: u8 = 90;

impl CreateParams {
    /// Checks ranges the engine does not (names, sizes); returns the reason if invalid.
    pub fn validate(&self) -> Result<(), String> {
        if self.name.is_empty() || self.base_bdev.is_empty() {
            return Err("name and base_bdev must not be empty".into());
        }
        if self.name.contains('\0') {
            return Err("name contains NUL".into());
        }
        if self
            .key
            .as_ref()
            .is_some_and(|k| k.is_empty() || k.contains('\0'))
        {
            return Err("key must be the name of a key in SPDK's keyring".into());
        }
        if self.name == self.base_bdev || Some(&self.name) == self.backing_bdev.as_ref() {
            return Err("name must differ from base_bdev and backing_bdev".into());
        }
        if let Some(s) = self.l2_slice_size {
            if !s.is_power_of_two() || !(512..=(2 << 20)).contains(&s) {
                return Err(format!(
                    "l2_slice_size {s}: must be a power of two from 512 to 2097152"
                ));
            }
        }
        if let Some(w) = self.cache_ways {
            if !(1..=64).contains(&w) {
                return Err(format!("cache_ways {w}: must be 1 to 64"));
            }
        }
        if let Some(c) = self.l2_cache_size {
            if c > 4 << 30 {
                return Err(format!("l2_cache_size {c}: at most 4 GiB"));
            }
        }
        if let Some(g) = self.alloc_granule {
            if g > 2 << 20 {
                return Err(format!("alloc_granule {g}: at most 2 MiB"));
            }
        }
        if let Some(p) = self.space_warn_percent {
            if p > 100 {
                return Err(format!("space_warn_percent {p}: at most 100"));
            }
        }
        if let Some(c) = self.backing_cache_size {
            if c > 64 << 30 {
                return Err(format!("backing_cache_size {c}: at most 64 GiB"));
            }
        }
        if let Some(r) = self.prefetch_ring_size {
            if r > 1 << 30 {
                return Err(format!("prefetch_ring_size {r}: at most 1 GiB"));
            }
        }
        self.ring_sizes()
            .validate()
            .map_err(|e| format!("prefetch_ring_size / prefetch_max_window: {e}"))
    }

    /// The prefetch ring's sizes asked for (defaults where not given).
    fn ring_sizes(&self) -> RingConfig {
        let d = RingConfig::default();
        RingConfig {
            ring_bytes: self.prefetch_ring_size.unwrap_or(d.ring_bytes),
            max_window: self.prefetch_max_window.unwrap_or(d.max_window),
        }
    }

    /// Each channel's prefetch ring (`None`: `prefetch` is off).
    pub fn ring_config(&self) -> Option<RingConfig> {
        self.prefetch_on().then(|| self.ring_sizes())
    }

    /// The share of the base the image's end may reach before a warning (`None`: off).
    pub fn space_warn_percent(&self) -> Option<u8> {
        match self
            .space_warn_percent
            .unwrap_or(DEFAULT_SPACE_WARN_PERCENT)
        {
            0 => None,
            p => Some(p),
        }
    }

    /// Bytes of the shared read cache of the backing bdev (0: none).
    pub fn backing_cache_bytes(&self) -> u64 {
        self.backing_cache_size
            .unwrap_or(DEFAULT_BACKING_CACHE_SIZE)
    }

    /// Whether read-ahead is on (`prefetch`, default true).
    pub fn prefetch_on(&self) -> bool {
        self.prefetch.unwrap_or(true)
    }

    /// Engine options for opening the image (read-only; the owner of a writable bdev sets
    /// `writable`).
    pub fn open_options(&self) -> OpenOptions {
        let d = OpenOptions::default();
        OpenOptions {
            l2_cache_bytes: self.l2_cache_size,
            l2_slice_bytes: self.l2_slice_size.unwrap_or(d.l2_slice_bytes),
            cache_ways: self.cache_ways.unwrap_or(d.cache_ways),
            ordered_layout: self.ordered_layout,
            alloc_granule: self.alloc_granule.unwrap_or(d.alloc_granule),
            pass_discard_request: self.pass_discard_request.unwrap_or(d.pass_discard_request),
            pass_discard_snapshot: self
                .pass_discard_snapshot
                .unwrap_or(d.pass_discard_snapshot),
            pass_discard_other: self.pass_discard_other.unwrap_or(d.pass_discard_other),
            ..d
        }
    }
}

/// `bdev_qcow2_format` parameters (the `qemu-img create -f qcow2 -o …` options).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FormatParams {
    /// The bdev to write the fresh image on (everything on it is lost).
    pub base_bdev: String,
    /// Virtual size in bytes (rounded up to 512). Required, as with qemu-img, unless
    /// `backing_bdev` is given: then the backing bdev's size.
    #[serde(default)]
    pub size: Option<u64>,
    /// Make the image an overlay of this bdev (raw, or a qcow2 bdev): its name is recorded
    /// as the backing file, with format `qcow2` when it is a qcow2 bdev and `raw`
    /// otherwise, as `qemu-img create -b NAME -F FMT` records them.
    #[serde(default)]
    pub backing_bdev: Option<String>,
    /// Cluster size in bytes (power of two, 512 B – 2 MiB; default 65536).
    #[serde(default)]
    pub cluster_size: Option<u64>,
    /// Extended L2 entries (subclusters; clusters of at least 16 KiB).
    #[serde(default)]
    pub extended_l2: Option<bool>,
    /// Refcount width in bits (power of two, 1–64; default 16).
    #[serde(default)]
    pub refcount_bits: Option<u64>,
    /// `"1.1"` (v3, default) or `"0.10"` (v2).
    #[serde(default)]
    pub compat: Option<String>,
    /// Lazy refcounts (compat 1.1 only).
    #[serde(default)]
    pub lazy_refcounts: Option<bool>,
    /// `"zlib"` (default) or `"zstd"`.
    #[serde(default)]
    pub compression_type: Option<String>,
    /// `"off"` (default), `"metadata"` (every cluster allocated and mapped as a preallocated
    /// zero cluster: nothing of the base's old contents shows) or `"full"` (every cluster
    /// allocated and written with zeros: a fully allocated image).
    #[serde(default)]
    pub preallocation: Option<String>,
    /// Zero the base first and record in the image that it reads as zeros past the
    /// metadata (bdev_qcow2's zeroed tail, an autoclear feature QEMU voids when it writes):
    /// first writes into new clusters then write the guest's bytes alone, not whole
    /// clusters. Default: on a malloc or NVMe base (zeroing them is cheap and allocates
    /// nothing) when the image is compat 1.1. With `true` on any base (SPDK emulates Write
    /// Zeroes where the base lacks it).
    #[serde(default)]
    pub zero_base: Option<bool>,
    /// Encrypt the image (LUKS, `aes-256-xts-plain64` with `sha256`, as `qemu-img create -o
    /// encrypt.format=luks` does by default) with the passphrase held by this key of SPDK's
    /// keyring (`keyring_file_add_key`).
    #[serde(default)]
    pub key: Option<String>,
    /// Milliseconds the key slot's PBKDF2 is calibrated to take (QEMU's
    /// `encrypt.iter-time`; default 2000).
    #[serde(default)]
    pub encrypt_iter_time_ms: Option<u32>,
}

impl FormatParams {
    /// The engine's create options, or the reason the parameters are invalid (the engine
    /// checks the combinations).
    pub fn create_options(&self) -> Result<CreateOptions, String> {
        let d = CreateOptions::default();
        if self.base_bdev.is_empty() || self.base_bdev.contains('\0') {
            return Err("base_bdev must be a bdev name".into());
        }
        let size = match self.size {
            Some(s) if s > 0 => s,
            _ => return Err("size must be given (bytes) and non-zero".into()),
        };
        if self.backing_bdev.as_deref() == Some(self.base_bdev.as_str()) {
            return Err("backing_bdev must differ from base_bdev".into());
        }
        if self.backing_bdev.is_some() && self.preallocation.as_deref().unwrap_or("off") != "off" {
            return Err("preallocation of an overlay (backing_bdev) is not supported".into());
        }
        let log2 = |what: &str, v: u64| {
            if v.is_power_of_two() {
                Ok(v.ilog2())
            } else {
                Err(format!("{what} {v}: must be a power of two"))
            }
        };
        Ok(CreateOptions {
            size,
            cluster_bits: match self.cluster_size {
                Some(c) => log2("cluster_size", c)?,
                None => d.cluster_bits,
            },
            version: match self.compat.as_deref() {
                None | Some("1.1") | Some("v3") => 3,
                Some("0.10") | Some("v2") => 2,
                Some(c) => return Err(format!("compat {c}: must be 1.1 or 0.10")),
            },
            refcount_order: match self.refcount_bits {
                Some(b) => log2("refcount_bits", b)?,
                None => d.refcount_order,
            },
            extended_l2: self.extended_l2.unwrap_or(false),
            lazy_refcounts: self.lazy_refcounts.unwrap_or(false),
            compression_type: match self.compression_type.as_deref() {
                None | Some("zlib") => CompressionType::Zlib,
                Some("zstd") => CompressionType::Zstd,
                Some(c) => return Err(format!("compression_type {c}: must be zlib or zstd")),
            },
            backing_file: None,
            backing_format: None,
            // `format` decides, from `zero_base` and the base.
            zeroed_tail: false,
            encryption: None,
        })
    }

    /// The LUKS choices of an encrypted image (`None`: no `key`, a plain image), or why
    /// the parameters do not go together.
    pub fn luks_params(&self) -> Result<Option<LuksParams>, String> {
        let Some(k) = &self.key else {
            if self.encrypt_iter_time_ms.is_some() {
                return Err("encrypt_iter_time_ms is for an encrypted image (key)".into());
            }
            return Ok(None);
        };
        if k.is_empty() || k.contains('\0') {
            return Err("key must be the name of a key in SPDK's keyring".into());
        }
        if self.preallocation.as_deref().unwrap_or("off") != "off" {
            return Err("preallocation of an encrypted image (key) is not supported".into());
        }
        if self.zero_base == Some(true) {
            return Err(
                "zero_base with key: zeros on the base are not the cipher text of zeros".into(),
            );
        }
        let mut p = LuksParams::default();
        if let Some(ms) = self.encrypt_iter_time_ms {
            p.set("iter-time", &ms.to_string())
                .map_err(|e| format!("encrypt_iter_time_ms {ms}: {e}"))?;
        }
        Ok(Some(p))
    }

    /// The preallocation to run after formatting (`None`: off), or why the value is invalid.
    pub fn preallocation(&self) -> Result<Option<Preallocation>, String> {
        match self.preallocation.as_deref() {
            None | Some("off") => Ok(None),
            // A bdev may hold anything: the clusters must not show it (`format` says
            // otherwise once it zeroed the base).
            Some("metadata") => Ok(Some(Preallocation::Metadata {
                device_reads_zeros: false,
            })),
            Some("full") => Ok(Some(Preallocation::Full)),
            Some(p) => Err(format!("preallocation {p}: must be off, metadata or full")),
        }
    }
}

/// `bdev_qcow2_delete` parameters.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeleteParams {
    /// The qcow2 bdev (or pending creation) to delete.
    pub name: String,
}

/// `bdev_qcow2_resize` parameters.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResizeParams {
    /// The qcow2 bdev.
    pub name: String,
    /// The new virtual size in bytes (a multiple of 512).
    pub size: u64,
}

/// `bdev_qcow2_stream` parameters.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamParams {
    /// The qcow2 bdev.
    pub name: String,
    /// Bytes per second copied at most (0 or absent: no limit).
    #[serde(default)]
    pub rate_limit: u64,
}

/// `bdev_qcow2_snapshot_create` and `bdev_qcow2_snapshot_delete` parameters.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotParams {
    /// The qcow2 bdev.
    pub name: String,
    /// The snapshot's name (create), or its id or name (delete).
    pub snapshot: String,
}

/// `bdev_qcow2_snapshot_list` parameters.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotListParams {
    /// The qcow2 bdev.
    pub name: String,
}

/// `bdev_qcow2_get_stats` parameters.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatsParams {
    /// One bdev; all when absent.
    #[serde(default)]
    pub name: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_round_trips_with_defaults_left_out() {
        let p: CreateParams = serde_json::from_str(r#"{"name":"q0","base_bdev":"aio0"}"#).unwrap();
        assert!(!p.read_only);
        assert_eq!(
            serde_json::to_string(&p).unwrap(),
            r#"{"name":"q0","base_bdev":"aio0"}"#
        );
        let p: CreateParams = serde_json::from_str(
            r#"{"name":"q0","base_bdev":"aio0","backing_bdev":"b","read_only":true,"l2_cache_size":65536,"l2_slice_size":512,"cache_ways":4,"prefetch":true,"prefetch_ring_size":8388608,"prefetch_max_window":2097152,"ordered_layout":true,"alloc_granule":0,"zero_offload":false,"zero_ahead":true,"uuid":"0f8a3e2c-5b1d-4c6e-9a7f-1e2d3c4b5a69"}"#,
        )
        .unwrap();
        let back: CreateParams = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
        assert!(p.validate().is_ok());
        assert!(p.open_options().ordered_layout);
        assert_eq!(p.open_options().alloc_granule, 0);
        assert_eq!(
            p.ring_config(),
            Some(RingConfig {
                ring_bytes: 8 << 20,
                max_window: 2 << 20
            })
        );
        let off: CreateParams =
            serde_json::from_str(r#"{"name":"q0","base_bdev":"aio0","prefetch":false}"#).unwrap();
        assert_eq!(off.ring_config(), None);
    }

    #[test]
    fn format_options() {
        let p: FormatParams = serde_json::from_str(
            r#"{"base_bdev":"m0","size":1048576,"cluster_size":4096,"refcount_bits":1,"compat":"0.10","compression_type":"zstd"}"#,
        )
        .unwrap();
        let o = p.create_options().unwrap();
        assert_eq!((o.cluster_bits, o.refcount_order, o.version), (12, 0, 2));
        assert_eq!(o.compression_type, CompressionType::Zstd);
        let p: FormatParams =
            serde_json::from_str(r#"{"base_bdev":"m0","size":1,"cluster_size":3000}"#).unwrap();
        assert!(p.create_options().is_err());
        let pre = |v: &str| {
            serde_json::from_str::<FormatParams>(&format!(
                r#"{{"base_bdev":"m0","size":1,"preallocation":"{v}"}}"#
            ))
            .unwrap()
            .preallocation()
        };
        assert_eq!(pre("off"), Ok(None));
        assert_eq!(pre("full"), Ok(Some(Preallocation::Full)));
        assert_eq!(
            pre("metadata"),
            Ok(Some(Preallocation::Metadata {
                device_reads_zeros: false
            }))
        );
        assert!(pre("falloc").is_err());
        // No size: only an overlay takes one from its backing bdev (`format` fills it in).
        let p: FormatParams = serde_json::from_str(r#"{"base_bdev":"m0"}"#).unwrap();
        assert!(p.create_options().is_err());
        let overlay = |extra: &str| {
            serde_json::from_str::<FormatParams>(&format!(
                r#"{{"base_bdev":"m0","size":1048576,"backing_bdev":"g"{extra}}}"#
            ))
            .unwrap()
            .create_options()
        };
        assert!(overlay("").is_ok());
        assert!(overlay(r#","preallocation":"full""#).is_err());
        let p: FormatParams =
            serde_json::from_str(r#"{"base_bdev":"m0","size":1,"backing_bdev":"m0"}"#).unwrap();
        assert!(
            p.create_options().is_err(),
            "backing_bdev must differ from base_bdev"
        );
    }

    #[test]
    fn key_is_saved_by_name_and_format_checks_what_goes_with_it() {
        let p: CreateParams =
            serde_json::from_str(r#"{"name":"q0","base_bdev":"a","key":"k0"}"#).unwrap();
        assert_eq!(
            serde_json::to_string(&p).unwrap(),
            r#"{"name":"q0","base_bdev":"a","key":"k0"}"#
        );
        assert!(p.validate().is_ok());
        let p: CreateParams =
            serde_json::from_str(r#"{"name":"q0","base_bdev":"a","key":""}"#).unwrap();
        assert!(p.validate().is_err());
        let f = |extra: &str| {
            serde_json::from_str::<FormatParams>(&format!(
                r#"{{"base_bdev":"m0","size":1048576{extra}}}"#
            ))
            .unwrap()
            .luks_params()
        };
        assert_eq!(f(""), Ok(None));
        let l = f(r#","key":"k0","encrypt_iter_time_ms":10"#)
            .unwrap()
            .unwrap();
        assert_eq!(l.iter_time_ms, 10);
        assert_eq!(
            l,
            LuksParams {
                iter_time_ms: 10,
                ..LuksParams::default()
            }
        );
        assert!(f(r#","encrypt_iter_time_ms":10"#).is_err());
        assert!(f(r#","key":"k0","preallocation":"full""#).is_err());
        assert!(f(r#","key":"k0","zero_base":true"#).is_err());
        assert!(f(r#","key":"k0","zero_base":false"#).is_ok());
    }

    #[test]
    fn create_refuses_unknown_and_bad_values() {
        assert!(serde_json::from_str::<CreateParams>(
            r#"{"name":"q0","base_bdev":"aio0","filename":"/x"}"#
        )
        .is_err());
        let p: CreateParams =
            serde_json::from_str(r#"{"name":"q0","base_bdev":"aio0","l2_slice_size":1000}"#)
                .unwrap();
        assert!(p.validate().is_err());
        let p: CreateParams = serde_json::from_str(r#"{"name":"a","base_bdev":"a"}"#).unwrap();
        assert!(p.validate().is_err());
        for bad in [
            r#""prefetch_ring_size":100000"#,
            r#""prefetch_ring_size":0"#,
            r#""prefetch_max_window":16777216"#,
            r#""prefetch_ring_size":2147483648"#,
        ] {
            let p: CreateParams =
                serde_json::from_str(&format!(r#"{{"name":"q0","base_bdev":"a",{bad}}}"#)).unwrap();
            assert!(p.validate().is_err(), "{bad}");
        }
    }
}
