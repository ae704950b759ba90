//! The bdev module `qcow2`: its descriptor (registered at load time by the shim), init/fini,
//! and `examine_config`, which completes creations deferred until their base bdev appears.

use crate::ffi::bdev;
use crate::ffi::sys;
use crate::{logging, node, registry};
use std::cell::{Cell, UnsafeCell};
use std::ffi::c_int;
use std::rc::Rc;

/// The module descriptor SPDK links into its module list (it writes its own bookkeeping
/// into the `internal` fields, hence the cell).
#[repr(transparent)]
pub struct ModuleCell(UnsafeCell<sys::spdk_bdev_module>);

// SAFETY: SPDK serializes its accesses to module descriptors (its own spinlock and the app
// thread); Rust code only takes the address.
unsafe impl Sync for ModuleCell {}

/// The `qcow2` bdev module, registered by `SPDK_BDEV_MODULE_REGISTER` in `register.c`.
#[no_mangle]
pub static BDEV_QCOW2_MODULE: ModuleCell = ModuleCell(UnsafeCell::new(sys::spdk_bdev_module {
    module_init: Some(module_init),
    module_fini: Some(module_fini),
    name: c"qcow2".as_ptr(),
    get_ctx_size: Some(get_ctx_size),
    examine_config: Some(examine_config),
    // SAFETY: the remaining members are optional callbacks (zero is `None`), flags (false)
    // and SPDK's internal bookkeeping, which `spdk_bdev_module_list_add` initializes.
    ..unsafe { std::mem::zeroed() }
}));

/// Our module, for claims and bdev registration.
pub fn module_ptr() -> *mut sys::spdk_bdev_module {
    BDEV_QCOW2_MODULE.0.get()
}

unsafe extern "C" fn module_init() -> c_int {
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

unsafe extern "C" fn module_fini() {
    registry::lock().pending.clear();
}

unsafe extern "C" fn get_ctx_size() -> c_int {
    // Each bdev_io's module area: its queue link and the per-I/O context (`io_ctx.rs`).
    crate::ffi::bdev_io::DRIVER_CTX_SIZE as c_int
}

/// A bdev appeared: start every pending creation whose base (and backing) bdevs now all
/// exist. The examine stays open until they finish, so `bdev_wait_for_examine` (and apps
/// starting I/O after their config loaded) see the qcow2 bdevs.
unsafe extern "C" fn examine_config(_bdev: *mut sys::spdk_bdev) {
    let ready: Vec<_> = {
        let mut reg = registry::lock();
        let (ready, waiting) = std::mem::take(&mut reg.pending).into_iter().partition(|p| {
            bdev::exists(&p.base_bdev) && p.backing_bdev.as_deref().is_none_or(bdev::exists)
        });
        reg.pending = waiting;
        ready
    };
    if ready.is_empty() {
        // SAFETY: our registered module; one examine_done per examine_config.
        unsafe { sys::spdk_bdev_module_examine_done(module_ptr()) };
        return;
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
                    // SAFETY: as above; the last creation started by this examine ended.
                    unsafe { sys::spdk_bdev_module_examine_done(module_ptr()) };
                }
            }),
        );
    }
}
