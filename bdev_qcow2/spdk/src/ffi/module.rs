//! The bdev module's descriptor and the calls SPDK makes on it. The descriptor is a
//! `#[no_mangle]` static that `register.c` links into SPDK's module list at load time; the
//! module defines it with [`bdev_module!`](crate::bdev_module), next to its hooks
//! ([`ModuleHooks`]), and this file reaches it by that symbol.

use super::bdev_io::{driver_ctx_size, Requests};
use super::sys;
use std::cell::UnsafeCell;
use std::ffi::{c_int, CStr};

/// The module descriptor SPDK links into its module list (it writes its own bookkeeping
/// into the `internal` fields, hence the cell).
#[repr(transparent)]
pub struct ModuleCell(UnsafeCell<sys::spdk_bdev_module>);

// SAFETY: SPDK serializes its accesses to module descriptors (its own spinlock and the app
// thread); Rust code only takes the address.
unsafe impl Sync for ModuleCell {}

/// What SPDK's calls on the module do.
pub trait ModuleHooks {
    /// `module_init`; returns 0 or a negative errno.
    fn init() -> i32;
    /// `module_fini`.
    fn fini();
    /// `examine_config` (bdev `name` appeared); ends with one [`examine_done`].
    fn examine_config(name: &str);
}

impl ModuleCell {
    /// The descriptor of module `name`: SPDK's calls go to `H`, and its bdev_ios carry the
    /// driver area of `M`'s requests.
    pub const fn new<H: ModuleHooks, M: Requests>(name: &'static CStr) -> ModuleCell {
        ModuleCell(UnsafeCell::new(sys::spdk_bdev_module {
            module_init: Some(module_init::<H>),
            module_fini: Some(module_fini::<H>),
            name: name.as_ptr(),
            get_ctx_size: Some(get_ctx_size::<M>),
            examine_config: Some(examine_config::<H>),
            // SAFETY: the remaining members are optional callbacks (zero is `None`), flags
            // (false) and SPDK's internal bookkeeping, which `spdk_bdev_module_list_add`
            // initializes.
            ..unsafe { std::mem::zeroed() }
        }))
    }
}

/// Defines the module descriptor `BDEV_QCOW2_MODULE` that `register.c` registers (with
/// `SPDK_BDEV_MODULE_REGISTER`), named `$name`, its calls going to `$hooks` and its
/// requests being `$types`'.
#[macro_export]
macro_rules! bdev_module {
    ($name:expr, $hooks:ty, $types:ty) => {
        /// The bdev module, registered by `SPDK_BDEV_MODULE_REGISTER` in `register.c`.
        // Expanded at the crate root, outside `ffi`, but written here.
        #[allow(unsafe_code)]
        #[no_mangle]
        pub static BDEV_QCOW2_MODULE: $crate::ffi::module::ModuleCell =
            $crate::ffi::module::ModuleCell::new::<$hooks, $types>($name);
    };
}

extern "C" {
    /// The descriptor [`bdev_module!`](crate::bdev_module) defines.
    #[link_name = "BDEV_QCOW2_MODULE"]
    static MODULE: ModuleCell;
}

/// Our module, for claims and bdev registration (registered at load time).
pub fn module_ptr() -> *mut sys::spdk_bdev_module {
    // SAFETY: the descriptor is a static defined once by `bdev_module!` (the crate invokes
    // it); only its address is taken here.
    unsafe { MODULE.0.get() }
}

unsafe extern "C" fn module_init<H: ModuleHooks>() -> c_int {
    H::init()
}

unsafe extern "C" fn module_fini<H: ModuleHooks>() {
    H::fini()
}

unsafe extern "C" fn get_ctx_size<M: Requests>() -> c_int {
    // Each bdev_io's module area: its queue link, its recorded channel and the per-I/O
    // context.
    driver_ctx_size::<M>() as c_int
}

unsafe extern "C" fn examine_config<H: ModuleHooks>(bdev: *mut sys::spdk_bdev) {
    // SAFETY: SPDK examines a registered bdev; its name is a valid C string, read at once.
    let name = unsafe { CStr::from_ptr(sys::spdk_bdev_get_name(bdev)) }.to_string_lossy();
    H::examine_config(&name)
}

/// Tells SPDK that one `examine_config` call of ours is over.
pub fn examine_done() {
    // SAFETY: our registered module; the caller pairs it with one examine_config.
    unsafe { sys::spdk_bdev_module_examine_done(module_ptr()) }
}
