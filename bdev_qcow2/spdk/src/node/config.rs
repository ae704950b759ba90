//! What `save_config` writes for a node (`write_config_json`).

use super::Node;
use crate::params::CreateParams;
use crate::registry;
use serde_json::json;

/// The create calls that `write_config_json` saves for `node`. SPDK saves bdevs in the
/// order they registered, each followed by its own settings (histogram, QoS). An external
/// snapshot registers the old image's read-only bdev after the bdev that now reads through
/// it, so each bdev here also saves, before its own create, those of the qcow2 bdevs its
/// backing chain reaches that registered after it (deepest first), and such a bdev saves
/// nothing at its own place: a reload then creates the backing bdev first.
pub fn config_json(node: &Node) -> Vec<serde_json::Value> {
    let reg = registry::lock();
    // Each bdev's create as it would be saved: without `backing_bdev` once a stream dropped
    // the backing reference (the image no longer names a backing file).
    let order: Vec<(&str, CreateParams)> = reg
        .nodes
        .iter()
        .map(|(n, r)| (n.as_str(), r.node().saved_params()))
        .collect();
    let mine = node.saved_params();
    let me = &mine.name;
    if carrier(&order, me).is_some() {
        return Vec::new();
    }
    let mut calls = Vec::new();
    let mut next = mine.backing_bdev.clone();
    // Bounded by the number of bdevs (a chain never loops, but a hostile config could).
    for _ in 0..order.len() {
        let Some(b) = next else { break };
        let Some((_, p)) = order.iter().find(|(n, _)| *n == b) else {
            break;
        };
        if carrier(&order, &b) == Some(me.as_str()) {
            calls.push(json!({ "method": "bdev_qcow2_create", "params": p }));
        }
        next = p.backing_bdev.clone();
    }
    calls.reverse();
    calls.push(json!({ "method": "bdev_qcow2_create", "params": mine }));
    calls
}

/// The bdev that saves the create of `name` with its own (see [`config_json`]): the topmost
/// of the bdevs reading through it that registered before it, if any.
fn carrier<'a>(order: &[(&'a str, CreateParams)], name: &str) -> Option<&'a str> {
    let pos = |n: &str| order.iter().position(|(x, _)| *x == n);
    let mine = pos(name)?;
    let mut found = None;
    let mut cur = name.to_owned();
    for _ in 0..order.len() {
        let Some((user, _)) = order
            .iter()
            .find(|(_, p)| p.backing_bdev.as_deref() == Some(cur.as_str()))
        else {
            break;
        };
        if pos(user).is_some_and(|u| u < mine) {
            found = Some(*user);
        }
        cur = (*user).to_owned();
    }
    found
}
