//! What the module knows about across threads: bdevs waiting for their base bdev, creations
//! in progress, and registered nodes. Control path only (RPCs, examine, destruct): a mutex is
//! fine here; the data path never touches it.

use crate::node::Node;
use crate::params::CreateParams;
use std::sync::{Mutex, MutexGuard};

/// A registered node (owned by SPDK between `spdk_bdev_register` and destruct).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NodePtr(pub *mut Node);

// SAFETY: the pointer is only dereferenced on SPDK threads while the node is registered;
// the node's shared state is immutable after registration.
unsafe impl Send for NodePtr {}

/// The module's bookkeeping.
#[derive(Default)]
pub struct Registry {
    /// Creations waiting for their base (or backing) bdev to appear.
    pub pending: Vec<CreateParams>,
    /// Names whose creation is in progress (image being read).
    pub creating: Vec<String>,
    /// Registered bdevs.
    pub nodes: Vec<(String, NodePtr)>,
}

impl Registry {
    /// Whether `name` is taken by a pending, in-progress or registered qcow2 bdev.
    pub fn knows(&self, name: &str) -> bool {
        self.pending.iter().any(|p| p.name == name)
            || self.creating.iter().any(|n| n == name)
            || self.nodes.iter().any(|(n, _)| n == name)
    }

    /// The registered node called `name`.
    pub fn node(&self, name: &str) -> Option<NodePtr> {
        self.nodes.iter().find(|(n, _)| n == name).map(|(_, p)| *p)
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
