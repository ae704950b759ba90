//! A qcow2 bdev's UUID: the identity its consumers keep (an NVMe-oF namespace takes its
//! NGUID and UUID from it, a host finds its disk by them). The create call's `uuid`, or one
//! derived as SPDK's passthru derives its own — a SHA-1 UUID in a namespace of ours over the
//! base bdev's UUID — so the same config gives the same UUID on every start. The bdev's name
//! is hashed too: read-only bdevs may share a base, and an external snapshot's read-only
//! bdev sits on the base its bdev was created on. Either way `save_config` writes the UUID,
//! so a restart from saved config keeps it even where the base's UUID or this derivation
//! changed.

use crate::ffi::bdev::{self, Desc};
use crate::ffi::uuid::Uuid;
use crate::params::CreateParams;

/// The namespace of the UUIDs derived here (a random UUID, fixed: changing it changes
/// every derived UUID).
const NAMESPACE: &str = "2d53f847-81d9-47ba-8738-52242e06e82f";

/// Checks a `uuid` parameter (`what` names it in the reason) and puts it in SPDK's
/// lower-case form. `Err`: the reason it is refused — not a UUID as SPDK reads one, or the
/// null UUID (SPDK would put a random one in its place).
pub fn check(uuid: &mut Option<String>, what: &str) -> Result<(), String> {
    let Some(text) = uuid.as_deref() else {
        return Ok(());
    };
    let u = Uuid::parse(text).ok_or_else(|| {
        format!("{what} '{text}' is not a UUID (8-4-4-4-12 hex digits, as 6f1c9a2e-3b4d-4e5f-8a9b-0c1d2e3f4a5b)")
    })?;
    if u.is_null() {
        return Err(format!("{what}: the null UUID names no bdev"));
    }
    *uuid = Some(u.to_string());
    Ok(())
}

/// The UUID of the bdev `p` creates over the open base `base`: `p.uuid` (already
/// [`check`]ed), else derived from the base's UUID and `p.name` (from the base's name where
/// its UUID is null). `Err`: an errno and the reason, when the UUID cannot be had
/// (`EINVAL`) or another bdev has it as its UUID or name (`EEXIST`).
pub fn resolve(p: &CreateParams, base: &Desc) -> Result<Uuid, (i32, String)> {
    let uuid = match &p.uuid {
        Some(text) => Uuid::parse(text),
        None => derive(base, &p.name),
    }
    .ok_or_else(|| {
        (
            libc::EINVAL,
            "SPDK could not read or derive the bdev's UUID".into(),
        )
    })?;
    let text = uuid.to_string();
    if bdev::exists(&text) {
        return Err((
            libc::EEXIST,
            format!("UUID {text} is already a bdev's UUID (or name): give another with uuid"),
        ));
    }
    Ok(uuid)
}

/// The derived UUID: the base's UUID (or, when null, its name and a NUL), then the name.
fn derive(base: &Desc, name: &str) -> Option<Uuid> {
    let ns = Uuid::parse(NAMESPACE)?;
    let b = base.uuid();
    let mut input = if b.is_null() {
        let mut v = base.name().into_bytes();
        v.push(0);
        v
    } else {
        b.bytes().to_vec()
    };
    input.extend_from_slice(name.as_bytes());
    Uuid::sha1(ns, &input)
}
