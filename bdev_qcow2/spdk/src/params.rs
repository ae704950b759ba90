//! RPC parameters, decoded once into structs that `write_config_json` writes back, so
//! `save_config` round-trips.

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
    /// Sequential read-ahead (not implemented yet; accepted and kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefetch: Option<bool>,
}

impl CreateParams {
    /// Checks ranges the engine does not (names, sizes); returns the reason if invalid.
    pub fn validate(&self) -> Result<(), String> {
        if self.name.is_empty() || self.base_bdev.is_empty() {
            return Err("name and base_bdev must not be empty".into());
        }
        if self.name.contains('\0') {
            return Err("name contains NUL".into());
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
        Ok(())
    }

    /// Engine options for opening the image (read-only; the owner of a writable bdev sets
    /// `writable`).
    pub fn open_options(&self) -> OpenOptions {
        let d = OpenOptions::default();
        OpenOptions {
            l2_cache_bytes: self.l2_cache_size,
            l2_slice_bytes: self.l2_slice_size.unwrap_or(d.l2_slice_bytes),
            cache_ways: self.cache_ways.unwrap_or(d.cache_ways),
            ..d
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
            r#"{"name":"q0","base_bdev":"aio0","backing_bdev":"b","read_only":true,"l2_cache_size":65536,"l2_slice_size":512,"cache_ways":4,"prefetch":true}"#,
        )
        .unwrap();
        let back: CreateParams = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
        assert!(p.validate().is_ok());
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
    }
}
