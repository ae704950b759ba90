//! The bdev module `qcow2` (its descriptor is in `ffi/module.rs`): init/fini, and
//! `examine_config`, which completes creations deferred until their base bdev appears.

use crate::ffi::{bdev, module};
use crate::{logging, node, registry};
use std::cell::Cell;
use std::rc::Rc;

/// `module_init`: logging, and the grace periods' fences.
pub fn init() -> i32 {
    logging::init();
    // Before any image is shared between threads (the mode is fixed then).
    let fences = if qcow2_engine::coherency::fences::install_membarrier() {
        "asymmetric (membarrier)"
    } else {
        "full fences (membarrier unavailable)"
    };
    tracing::info!("bdev module qcow2 loaded; grace-period fences: {fences}");
    0
}

/// `module_fini`: forgets the creations still waiting.
pub fn fini() {
    registry::lock().pending.clear();
}

/// `examine_config` (a bdev appeared): start every pending creation whose base (and backing)
/// bdevs now all exist. The examine stays open until they finish, so `bdev_wait_for_examine`
/// (and apps starting I/O after their config loaded) see the qcow2 bdevs.
pub fn examine_config() {
    let ready: Vec<_> = {
        let mut reg = registry::lock();
        let (ready, waiting) = std::mem::take(&mut reg.pending).into_iter().partition(|p| {
            bdev::exists(&p.base_bdev) && p.backing_bdev.as_deref().is_none_or(bdev::exists)
        });
        reg.pending = waiting;
        ready
    };
    if ready.is_empty() {
        return module::examine_done();
    }
    let left = Rc::new(Cell::new(ready.len()));
    for p in ready {
        tracing::info!("base bdev {} appeared: creating {}", p.base_bdev, p.name);
        let left = left.clone();
        node::create(
            p,
            Box::new(move |r| {
                if let Err((_, m)) = r {
                    tracing::error!("deferred bdev_qcow2_create failed: {m}");
                }
                left.set(left.get() - 1);
                if left.get() == 0 {
                    // The last creation started by this examine ended.
                    module::examine_done();
                }
            }),
        );
    }
}
