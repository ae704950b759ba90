//! The bdev module `qcow2`: its descriptor (`BDEV_QCOW2_MODULE`, which `register.c`
//! registers), init/fini, and `examine_config`, which completes creations deferred until
//! their base bdev appears. Also where the module's types are bound to the marker `ffi` is
//! instantiated with ([`Qcow2Bdev`]): the one module that names them all.

use crate::channel::Channel;
use crate::examine_hold::ExamineHold;
use crate::ffi::bdev;
use crate::ffi::module::ModuleHooks;
use crate::ffi::thread::Thread;
use crate::ffi::types::{BdevTypes, Closing};
use crate::io_ctx::IoCtx;
use crate::node::Node;
use crate::owner::{Owner, OwnerCounters};
use crate::types::{OwnerPtr, Qcow2Bdev};
use crate::{logging, node, registry};
use std::ffi::CStr;

crate::bdev_module!(c"qcow2", Hooks, Qcow2Bdev);

/// What `ffi` keeps for us: a request's context ([`IoCtx`]), a bdev ([`Node`]), a
/// channel's state ([`Channel`]) and a writable bdev's metadata owner ([`Owner`]).
impl BdevTypes for Qcow2Bdev {
    type Ctx = IoCtx;
    #[inline(always)]
    fn new_ctx() -> IoCtx {
        IoCtx::new()
    }
    type Node = Node;
    type Channel = Channel;
    type Owner = Owner;
    type OwnerCounters = OwnerCounters;
    const CHANNEL_POLLER: &'static CStr = c"qcow2_channel";

    #[inline(always)]
    fn owner(node: &Node) -> &OwnerPtr {
        node.owner()
    }

    fn md_thread(node: &Node) -> Option<Thread> {
        node.md_thread()
    }

    #[inline(always)]
    fn wake(owner: &Owner) {
        owner.wake()
    }

    fn close(owner: &Owner, token: Closing, then: impl FnOnce(OwnerCounters) + 'static) {
        owner.close(token, then)
    }
}

/// SPDK's calls on the module.
pub struct Hooks;

impl ModuleHooks for Hooks {
    fn init() -> i32 {
        init()
    }

    fn fini() {
        fini()
    }

    fn examine_config(name: &str) {
        examine_config(name)
    }
}

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

/// `examine_config` (bdev `name` appeared): qcow2 bdevs missing their backing bdev of that
/// name (created without it, or it was hot-removed) read it again (ARCHITECTURE.md §15,
/// degraded mode), and every pending creation whose base bdev now exists starts. The
/// examine stays open until they finish ([`ExamineHold`]), so `bdev_wait_for_examine`
/// (and apps starting I/O after their config loaded) see the qcow2 bdevs, reading through.
pub fn examine_config(name: &str) {
    // Before SPDK's examine_disk of it: that and a creation over it share one channel.
    crate::examine_channel::hold(name);
    let hold = ExamineHold::here();
    node::hotplug::appeared(name, &hold);
    let ready: Vec<_> = {
        let mut reg = registry::lock();
        let (ready, waiting) = std::mem::take(&mut reg.pending)
            .into_iter()
            .partition(|p| bdev::exists(&p.base_bdev));
        reg.pending = waiting;
        ready
    };
    for p in ready {
        tracing::info!("base bdev {} appeared: creating {}", p.base_bdev, p.name);
        let hold = hold.clone();
        node::create(
            p,
            Box::new(move |r| {
                if let Err((_, m)) = r {
                    tracing::error!("deferred bdev_qcow2_create failed: {m}");
                }
                drop(hold);
            }),
        );
    }
}
