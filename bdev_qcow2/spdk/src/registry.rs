//! What the module knows about across threads: bdevs waiting for their base bdev, creations
//! in progress, and registered nodes. Control path only (RPCs, examine, destruct): a mutex is
//! fine here; the data path never touches it.

use crate::ffi::node::NodeKey;
use crate::owner::Owner;
use crate::params::CreateParams;
use crate::types::Registered;
use std::sync::{Mutex, MutexGuard};

/// The module's bookkeeping.
#[derive(Default)]
pub struct Registry {
    /// Creations waiting for their base (or backing) bdev to appear.
    pub pending: Vec<CreateParams>,
    /// Names whose creation is in progress (image being read).
    pub creating: Vec<String>,
    /// Registered bdevs (teardown takes each out before it frees the node).
    pub nodes: Vec<(String, Registered)>,
}

impl Registry {
    /// Whether `name` is taken by a pending, in-progress or registered qcow2 bdev.
    pub fn knows(&self, name: &str) -> bool {
        self.pending.iter().any(|p| p.name == name)
            || self.creating.iter().any(|n| n == name)
            || self.nodes.iter().any(|(n, _)| n == name)
    }

    /// The registered node called `name`.
    pub fn node(&self, name: &str) -> Option<&Registered> {
        self.nodes.iter().find(|(n, _)| n == name).map(|(_, r)| r)
    }

    /// The registered, writable node `name` and its owner, for a control-path RPC on the
    /// node's md thread; or the errno and message to answer with.
    pub fn writable(&self, name: &str) -> Result<(&Registered, &Owner), (i32, String)> {
        let node = self
            .node(name)
            .ok_or_else(|| (libc::ENODEV, format!("no qcow2 bdev named {name}")))?;
        let owner = node.owner_here().ok_or_else(|| {
            (
                libc::EROFS,
                format!("{name}: read-only, or this RPC does not run on its md thread"),
            )
        })?;
        Ok((node, owner))
    }

    /// The registered node `key`.
    pub fn by_key(&self, key: NodeKey) -> Option<&Registered> {
        self.nodes
            .iter()
            .find(|(_, r)| r.key() == key)
            .map(|(_, r)| r)
    }

    /// Takes node `key` out of the registry (the first step of its teardown).
    pub fn take(&mut self, key: NodeKey) -> Option<Registered> {
        let i = self.nodes.iter().position(|(_, r)| r.key() == key)?;
        Some(self.nodes.remove(i).1)
    }
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    pending: Vec::new(),
    creating: Vec::new(),
    nodes: Vec::new(),
});

/// Locks the registry (a poisoned lock is recovered: the data stays consistent because every
/// update is a single push/remove).
pub fn lock() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}
