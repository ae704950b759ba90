//! The RPC methods `bdev_qcow2_create`, `bdev_qcow2_format`, `bdev_qcow2_delete` and
//! `bdev_qcow2_get_stats` (the life-cycle ones are in `lifecycle_rpc.rs`)
//! (registered by `register.c`; entry points declared here with `rpc_entry!`). Parameters are decoded into
//! the structs of `params.rs`.

use crate::channel::{self, ChannelStats};
use crate::ffi::bdev;
use crate::ffi::node::NodeKey;
use crate::ffi::rpc::{Params, Request, INVALID_PARAMS};
use crate::node;
use crate::params::{CreateParams, DeleteParams, FormatParams, StatsParams};
use crate::registry;
use crate::types::ChannelIter;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use std::ffi::c_int;

crate::rpc_entry!(bdev_qcow2_rpc_create => create);
crate::rpc_entry!(bdev_qcow2_rpc_format => format);
crate::rpc_entry!(bdev_qcow2_rpc_delete => delete);
crate::rpc_entry!(bdev_qcow2_rpc_get_stats => get_stats);

/// Decodes `params` into `T`, or answers the request with the reason and returns `None`.
pub(crate) fn decode<T: DeserializeOwned>(
    req: Request,
    params: Params,
    method: &str,
) -> Option<(Request, T)> {
    let v = match params {
        Ok(Value::Null) => json!({}),
        Ok(v) => v,
        Err(e) => {
            req.error(INVALID_PARAMS, &format!("{method}: {e}"));
            return None;
        }
    };
    match serde_json::from_value(v) {
        Ok(t) => Some((req, t)),
        Err(e) => {
            req.error(INVALID_PARAMS, &format!("{method}: {e}"));
            None
        }
    }
}

/// `bdev_qcow2_create`.
pub fn create(req: Request, params: Params) {
    let Some((req, mut p)) = decode::<CreateParams>(req, params, "bdev_qcow2_create") else {
        return;
    };
    if let Err(m) = p
        .validate()
        .and_then(|()| node::check_uuid(&mut p.uuid, "uuid"))
    {
        return req.error(INVALID_PARAMS, &format!("bdev_qcow2_create: {m}"));
    }
    // (A missing backing bdev does not defer it: the bdev is created degraded and reads
    // through it once it appears, as SPDK's lvol esnap clones do.)
    let missing: Vec<&str> = std::iter::once(p.base_bdev.as_str())
        .filter(|b| !bdev::exists(b))
        .collect();
    if !missing.is_empty() {
        // Deferred: completed by examine_config when the base appears (this is what makes
        // a saved config load whatever the order of its create calls).
        let mut reg = registry::lock();
        if reg.knows(&p.name) || bdev::exists(&p.name) {
            drop(reg);
            return req.errno(libc::EEXIST, &format!("bdev {} already exists", p.name));
        }
        tracing::info!(
            "bdev_qcow2_create {}: waiting for bdev {} to appear",
            p.name,
            missing.join(", ")
        );
        let name = p.name.clone();
        reg.pending.push(p);
        drop(reg);
        return req.result(&json!(name));
    }
    node::create(
        p,
        Box::new(move |r| match r {
            Ok(name) => req.result(&json!(name)),
            Err((e, m)) => req.errno(e, &m),
        }),
    );
}

/// `bdev_qcow2_format`: answers `true` once the image is written and flushed.
pub fn format(req: Request, params: Params) {
    let Some((req, p)) = decode::<FormatParams>(req, params, "bdev_qcow2_format") else {
        return;
    };
    // (With a backing bdev the size may come from it: checked once it is known.)
    if let (None, Err(m)) = (&p.backing_bdev, p.create_options()) {
        return req.error(INVALID_PARAMS, &format!("bdev_qcow2_format: {m}"));
    }
    crate::format::format(
        p,
        Box::new(move |r| match r {
            Ok(()) => req.result(&json!(true)),
            Err((e, m)) => req.errno(e, &m),
        }),
    );
}

/// `bdev_qcow2_delete`.
pub fn delete(req: Request, params: Params) {
    let Some((req, p)) = decode::<DeleteParams>(req, params, "bdev_qcow2_delete") else {
        return;
    };
    {
        let mut reg = registry::lock();
        if let Some(i) = reg.pending.iter().position(|c| c.name == p.name) {
            reg.pending.remove(i);
            drop(reg);
            tracing::info!("pending qcow2 bdev {} deleted", p.name);
            return req.result(&json!(true));
        }
        if reg.creating.contains(&p.name) {
            drop(reg);
            return req.errno(libc::EBUSY, &format!("bdev {} is being created", p.name));
        }
        if reg.node(&p.name).is_none() {
            drop(reg);
            return req.errno(libc::ENODEV, &format!("no qcow2 bdev named {}", p.name));
        }
        // An overlay reads through it (an external snapshot's old image): deleting it
        // would take the overlay down with it.
        let user = reg
            .nodes
            .iter()
            .find(|(_, r)| r.node().params().backing_bdev.as_deref() == Some(p.name.as_str()));
        if let Some((user, _)) = user {
            let m = format!(
                "bdev {} is the backing bdev of qcow2 bdev {user}: delete {user} first",
                p.name
            );
            drop(reg);
            return req.errno(libc::EBUSY, &m);
        }
    }
    let name = p.name.clone();
    let slot = std::rc::Rc::new(std::cell::Cell::new(Some(req)));
    let answer = slot.clone();
    let done = move |bdeverrno: c_int| {
        let Some(req) = answer.take() else { return };
        if bdeverrno == 0 {
            req.result(&json!(true));
        } else {
            req.errno(
                -bdeverrno,
                &std::io::Error::from_raw_os_error(-bdeverrno).to_string(),
            );
        }
    };
    if let Err(e) = bdev::unregister_by_name(&name, done) {
        if let Some(req) = slot.take() {
            req.errno(
                e,
                &format!(
                    "cannot delete {name}: {}",
                    std::io::Error::from_raw_os_error(e)
                ),
            );
        }
    }
}

/// Statistics collection over several nodes, one `for_each_channel` after the other.
struct Collect {
    req: Option<Request>,
    nodes: Vec<(String, NodeKey)>,
    next: usize,
    channels: Vec<ChannelStats>,
    out: Vec<Value>,
}

fn collect_step(it: ChannelIter, c: &mut Collect) {
    channel::stats_step(it, &mut c.channels);
}

fn collect_done(mut c: Collect, _status: c_int) {
    let channels = std::mem::take(&mut c.channels);
    let mut total = ChannelStats::default();
    for s in &channels {
        total.add(s);
    }
    total.thread = String::new();
    let (name, key) = c.nodes[c.next].clone();
    // Channels already gone count in the total too. The registry lock is held while the
    // node is used: a delete removes the node from the registry before anything frees it.
    let mut retired = Value::Null;
    let mut backing_cache = Value::Null;
    let mut backing_state = Value::Null;
    if let Some(n) = registry::lock().by_key(key) {
        let r = n.node().retired();
        total.add(&r);
        retired = serde_json::to_value(&r).unwrap_or(Value::Null);
        backing_cache = n.node().backing_cache_json().unwrap_or(Value::Null);
        backing_state = n
            .node()
            .backing_phase()
            .map_or(Value::Null, |p| p.name().into());
    }
    // The owner's counters, read only while the node is still registered (a delete
    // removes it first; the node and its owner are freed later, on the md thread) and only
    // on the md thread, the owner's own (the thread that ran the create: normally the app
    // thread, where RPCs run); otherwise `null`.
    let entry = json!({
        "name": name,
        "channels": channels,
        "retired_channels": retired,
        "total": total,
        "owner": Value::Null,
        "backing_cache": backing_cache,
        // "present", or degraded: "leaving", "missing", "returning" (null: no backing).
        "backing_state": backing_state,
    });
    let reg = registry::lock();
    let Some(o) = reg.by_key(key).and_then(|n| n.owner_here()) else {
        drop(reg);
        return collect_entry(c, entry);
    };
    let mut entry = entry;
    entry["owner"] = o.stats_json();
    // The space the image takes is counted from its refcounts by a job of the owner; the
    // collection goes on when it is done.
    o.space_json(move |space| {
        entry["owner"]["space"] = space;
        collect_entry(c, entry);
    });
}

/// The statistics of one node are complete: on to the next.
fn collect_entry(mut c: Collect, entry: Value) {
    c.out.push(entry);
    c.next += 1;
    collect_next(c);
}

fn collect_next(mut c: Collect) {
    if c.next == c.nodes.len() {
        if let Some(req) = c.req.take() {
            req.result(&Value::Array(std::mem::take(&mut c.out)));
        }
        return;
    }
    let key = c.nodes[c.next].1;
    let reg = registry::lock();
    // Still registered? (A delete may have raced the previous step.)
    let Some(node) = reg.by_key(key) else {
        drop(reg);
        c.next += 1;
        return collect_next(c);
    };
    // SPDK runs the steps and `collect_done` as messages, after the lock is released.
    node.for_each_channel(c, collect_step, collect_done);
}

/// `bdev_qcow2_get_stats`.
pub fn get_stats(req: Request, params: Params) {
    let Some((req, p)) = decode::<StatsParams>(req, params, "bdev_qcow2_get_stats") else {
        return;
    };
    let nodes: Vec<(String, NodeKey)> = {
        let reg = registry::lock();
        match &p.name {
            Some(n) => match reg.node(n) {
                Some(r) => vec![(n.clone(), r.key())],
                None => {
                    drop(reg);
                    return req.errno(libc::ENODEV, &format!("no qcow2 bdev named {n}"));
                }
            },
            None => reg
                .nodes
                .iter()
                .map(|(n, r)| (n.clone(), r.key()))
                .collect(),
        }
    };
    collect_next(Collect {
        req: Some(req),
        nodes,
        next: 0,
        channels: Vec::new(),
        out: Vec::new(),
    });
}
