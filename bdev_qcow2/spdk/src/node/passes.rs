//! The passes of a backing bdev's leave and return over a node's channels
//! (`for_each_channel`, `hotplug.rs`) against the node's teardown: SPDK refuses to
//! unregister an io_device while an iteration over it is outstanding (it logs and never
//! calls back, so the bdev's deletion would never finish and its base and backing bdevs
//! stay claimed). A node destructed during a pass (deleted, or its base hot-removed) is
//! unregistered when the pass ends.
//!
//! A pass starts, and a teardown takes its node out of the registry, under the registry's
//! lock: a teardown either sees the pass or the pass never finds the node.

use crate::ffi::node::NodeKey;
use crate::types::Registered;
use std::sync::{Mutex, MutexGuard};

struct Pass {
    key: NodeKey,
    /// Passes under way over the node's channels.
    count: usize,
    /// The node, destructed meanwhile: unregistered once the last pass ends.
    destructed: Option<Registered>,
}

static PASSES: Mutex<Vec<Pass>> = Mutex::new(Vec::new());

fn passes() -> MutexGuard<'static, Vec<Pass>> {
    PASSES.lock().unwrap_or_else(|e| e.into_inner())
}

/// A pass over node `key`'s channels starts (the caller holds the registry's lock and
/// found the node there).
pub(super) fn started(key: NodeKey) {
    let mut p = passes();
    match p.iter_mut().find(|p| p.key == key) {
        Some(p) => p.count += 1,
        None => p.push(Pass {
            key,
            count: 1,
            destructed: None,
        }),
    }
}

/// A pass over node `key`'s channels ended: the node if it was destructed meanwhile and
/// no other pass is under way (the caller unregisters it and does nothing else with it).
pub(super) fn ended(key: NodeKey) -> Option<Registered> {
    let mut p = passes();
    let i = p.iter().position(|p| p.key == key)?;
    p[i].count -= 1;
    if p[i].count > 0 {
        return None;
    }
    p.swap_remove(i).destructed
}

/// Teardown of node `key`, taken out of the registry under its lock (still held): the node
/// to unregister now, or `None` when a pass is under way (unregistered when it ends).
pub(super) fn unless_passing(key: NodeKey, node: Registered) -> Option<Registered> {
    let mut p = passes();
    match p.iter_mut().find(|p| p.key == key) {
        Some(p) => {
            tracing::info!("qcow2 bdev deleted while its channels take or leave its backing bdev: unregistered once they are done");
            p.destructed = Some(node);
            None
        }
        None => Some(node),
    }
}
