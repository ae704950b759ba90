//! `bdev_qcow2_overlay_create`: a new overlay in one call, as `bdev_lvol_clone_bdev` makes
//! an lvol clone of any read-only bdev — formats an empty image on `base_bdev` whose
//! backing file is `backing_bdev` (its name and format recorded as `qemu-img create -b -F`
//! records them), then serves it as the bdev `name` reading through `backing_bdev`. The
//! bdev is then an ordinary qcow2 bdev: `save_config` writes its `bdev_qcow2_create`,
//! which opens the image again.

use crate::ffi::rpc::{Params, Request, INVALID_PARAMS};
use crate::params::{CreateParams, FormatParams};
use crate::rpc::decode;
use crate::{format, node};
use serde::Deserialize;
use serde_json::json;

const METHOD: &str = "bdev_qcow2_overlay_create";

crate::rpc_entry!(bdev_qcow2_rpc_overlay_create => overlay_create);

/// `bdev_qcow2_overlay_create` parameters.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OverlayParams {
    /// Name of the qcow2 bdev to create.
    pub name: String,
    /// The bdev to format the overlay on (everything on it is lost).
    pub base_bdev: String,
    /// The bdev the overlay reads what it does not hold from (raw, or a qcow2 bdev).
    pub backing_bdev: String,
    /// Virtual size in bytes (default: the backing bdev's).
    #[serde(default)]
    pub size: Option<u64>,
    /// Cluster size in bytes (default 65536).
    #[serde(default)]
    pub cluster_size: Option<u64>,
    /// Extended L2 entries (subclusters).
    #[serde(default)]
    pub extended_l2: Option<bool>,
    /// The bdev's UUID (default: derived as `bdev_qcow2_create` derives it).
    #[serde(default)]
    pub uuid: Option<String>,
    /// Bytes of the backing bdev's shared read cache (as `bdev_qcow2_create`'s).
    #[serde(default)]
    pub backing_cache_size: Option<u64>,
    /// Encrypt the overlay with the passphrase held by this key of SPDK's keyring (as
    /// `bdev_qcow2_format`'s `key`; the bdev is then created with it).
    #[serde(default)]
    pub key: Option<String>,
    /// As `bdev_qcow2_format`'s.
    #[serde(default)]
    pub encrypt_iter_time_ms: Option<u32>,
}

/// `bdev_qcow2_overlay_create`: answers the new bdev's name.
pub fn overlay_create(req: Request, params: Params) {
    let Some((req, p)) = decode::<OverlayParams>(req, params, METHOD) else {
        return;
    };
    let mut create: CreateParams = match serde_json::from_value(json!({
        "name": p.name,
        "base_bdev": p.base_bdev,
        "backing_bdev": p.backing_bdev,
        "uuid": p.uuid,
        "backing_cache_size": p.backing_cache_size,
        "key": p.key,
    })) {
        Ok(c) => c,
        Err(e) => return req.error(INVALID_PARAMS, &format!("{METHOD}: {e}")),
    };
    if let Err(m) = create
        .validate()
        .and_then(|()| node::check_uuid(&mut create.uuid, "uuid"))
    {
        return req.error(INVALID_PARAMS, &format!("{METHOD}: {m}"));
    }
    // Refused before anything is written on the base.
    if crate::registry::lock().knows(&p.name) || crate::ffi::bdev::exists(&p.name) {
        return req.errno(libc::EEXIST, &format!("bdev {} already exists", p.name));
    }
    let fmt: FormatParams = match serde_json::from_value(json!({
        "base_bdev": p.base_bdev,
        "backing_bdev": p.backing_bdev,
        "size": p.size,
        "cluster_size": p.cluster_size,
        "extended_l2": p.extended_l2,
        "key": p.key,
        "encrypt_iter_time_ms": p.encrypt_iter_time_ms,
    })) {
        Ok(f) => f,
        Err(e) => return req.error(INVALID_PARAMS, &format!("{METHOD}: {e}")),
    };
    format::format(
        fmt,
        Box::new(move |r| {
            if let Err((e, m)) = r {
                return req.errno(e, &format!("{METHOD}: formatting the overlay: {m}"));
            }
            node::create(
                create,
                Box::new(move |r| match r {
                    Ok(name) => req.result(&json!(name)),
                    Err((e, m)) => req.errno(e, &format!("{METHOD}: {m}")),
                }),
            );
        }),
    );
}
