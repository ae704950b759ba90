//! The bdev module's descriptor (linked into SPDK's list at load time by `register.c`) and
//! the calls SPDK makes on it, which go to `crate::module`.

use super::sys;
use std::cell::UnsafeCell;
use std::ffi::c_int;

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

/// Our module, for claims and bdev registration (registered at load time).
pub fn module_ptr() -> *mut sys::spdk_bdev_module {
    BDEV_QCOW2_MODULE.0.get()
}

unsafe extern "C" fn module_init() -> c_int {
    crate::module::init()
}

unsafe extern "C" fn module_fini() {
    crate::module::fini()
}

unsafe extern "C" fn get_ctx_size() -> c_int {
    // Each bdev_io's module area: its queue link and the per-I/O context (`io_ctx.rs`).
    super::bdev_io::DRIVER_CTX_SIZE as c_int
}

unsafe extern "C" fn examine_config(_bdev: *mut sys::spdk_bdev) {
    crate::module::examine_config()
}

/// Tells SPDK that one `examine_config` call of ours is over.
pub fn examine_done() {
    // SAFETY: our registered module; the caller pairs it with one examine_config.
    unsafe { sys::spdk_bdev_module_examine_done(module_ptr()) }
}
