//! Builds the module's registration shim when `spdk-sys` found SPDK, and sets `cfg(spdk)`.
//!
//! The shim (`src/ffi/register.c`) holds only SPDK's constructor-based registration macros
//! (bdev module, RPC methods, log flag), which Rust cannot express; everything they register
//! is defined in Rust. It needs SPDK's headers, so without SPDK it is left out: the Rust code
//! still compiles in full (against `spdk-sys`'s committed bindings), but the library then
//! registers nothing and nothing of SPDK is linked. `cfg(spdk)` tells the tests whether SPDK
//! applications can be run.

use std::env;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(spdk)");
    println!("cargo:rerun-if-changed=src/ffi/register.c");
    let found = env::var("DEP_SPDK_FOUND").is_ok_and(|v| v == "1");
    if !found {
        return;
    }
    let Ok(include) = env::var("DEP_SPDK_INCLUDE") else {
        panic!("spdk-sys found SPDK but exported no include directory");
    };
    // The tests compile C against the same headers (look-alike modules for the check script).
    println!("cargo:rustc-env=BDEV_QCOW2_SPDK_INCLUDE={include}");
    cc::Build::new()
        .file("src/ffi/register.c")
        .include(&include)
        .warnings(true)
        // Nothing references the constructors: keep the whole object in the cdylib.
        .link_lib_modifier("+whole-archive")
        .compile("bdev_qcow2_register");
    // Libraries SPDK's shared libraries need but do not record (DPDK, OpenSSL, …): linked
    // into every artifact so test executables load; a preloaded module finds them loaded.
    let extra = env::var("DEP_SPDK_EXTRA_LIBS").unwrap_or_default();
    if !extra.is_empty() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        for l in extra.split(',') {
            println!("cargo:rustc-link-arg=-l{l}");
        }
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
    println!("cargo:rustc-cfg=spdk");
}
