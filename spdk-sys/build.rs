//! Provides the bindings to SPDK's public headers, from an installed SPDK when there is one
//! and from the committed copy (`src/bindings.rs`) when there is not.
//!
//! Where SPDK is looked for, in order:
//! 1. `SPDK_DIR`: an install prefix (`$SPDK_DIR/include`, `$SPDK_DIR/lib`) or a built source
//!    tree (`$SPDK_DIR/include`, `$SPDK_DIR/build/lib`);
//! 2. `pkg-config spdk_bdev` (its include and lib directories).
//!
//! When found: bindgen runs over `wrapper.h` with a narrow allowlist and writes
//! `$OUT_DIR/bindings.rs`, which the crate uses (the test `tests/bindings.rs` checks it equals
//! the committed copy byte for byte); `shim.c` is compiled, SPDK's libraries are linked, the
//! crate is built with `cfg(spdk)`, and dependents see `DEP_SPDK_FOUND=1`,
//! `DEP_SPDK_INCLUDE`, `DEP_SPDK_LIBDIR` and `DEP_SPDK_EXTRA_LIBS` (libraries to link with
//! `--no-as-needed` into executables).
//!
//! When not found (or `SPDK_SYS_DISABLE=1`): the committed `src/bindings.rs` is used, so every
//! crate above compiles and is linted all the same; nothing is linked and no shim is compiled
//! (it needs the headers), `cfg(spdk)` is not set and dependents see `DEP_SPDK_FOUND=0`.
//! Whatever calls into SPDK then leaves its symbols undefined: fine in a shared library,
//! and an executable links only if nothing it keeps calls into SPDK.
//!
//! Either way `cfg(spdk_channel_size)` says whether the bindings in use state
//! `SPDK_IO_CHANNEL_STRUCT_SIZE`.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The libraries a preloaded bdev module needs: the host binary has them loaded already,
/// linking them again (dynamically) resolves to the very same copies.
const LIBS: &[&str] = &[
    "spdk_bdev",
    "spdk_thread",
    "spdk_json",
    "spdk_jsonrpc",
    "spdk_rpc",
    "spdk_log",
    "spdk_util",
    "spdk_keyring",
    "spdk_env_dpdk",
];

/// Functions bound (everything else in the headers is left out).
const FUNCTIONS: &[&str] = &[
    "spdk_bdev_open_ext",
    "spdk_bdev_close",
    "spdk_bdev_desc_get_bdev",
    "spdk_bdev_get_io_channel",
    "spdk_bdev_read_blocks",
    "spdk_bdev_readv_blocks",
    "spdk_bdev_write_blocks",
    "spdk_bdev_writev_blocks",
    "spdk_bdev_flush_blocks",
    "spdk_bdev_write_zeroes_blocks",
    "spdk_bdev_unmap_blocks",
    "spdk_bdev_free_io",
    "spdk_bdev_get_by_name",
    "spdk_bdev_get_name",
    "spdk_bdev_get_module_name",
    "spdk_bdev_get_block_size",
    "spdk_bdev_get_num_blocks",
    "spdk_bdev_get_buf_align",
    "spdk_bdev_get_uuid",
    "spdk_bdev_io_type_supported",
    "spdk_bdev_register",
    "spdk_bdev_unregister",
    "spdk_bdev_unregister_by_name",
    "spdk_bdev_notify_blockcnt_change",
    "spdk_bdev_quiesce",
    "spdk_bdev_unquiesce",
    "spdk_bdev_destruct_done",
    "spdk_bdev_io_complete",
    "spdk_bdev_io_complete_nvme_status",
    "spdk_bdev_io_get_buf",
    "spdk_bdev_io_get_thread",
    "spdk_bdev_io_get_io_channel",
    "spdk_bdev_queue_io_wait",
    "spdk_bdev_module_claim_bdev_desc",
    "spdk_bdev_module_release_bdev",
    "spdk_bdev_module_examine_done",
    "spdk_io_device_register",
    "spdk_io_device_unregister",
    "spdk_get_io_channel",
    "spdk_put_io_channel",
    "spdk_for_each_channel",
    "spdk_for_each_channel_continue",
    "spdk_io_channel_iter_get_channel",
    "spdk_io_channel_iter_get_ctx",
    "spdk_io_channel_iter_get_io_device",
    "spdk_poller_register_named",
    "spdk_poller_unregister",
    "spdk_poller_pause",
    "spdk_poller_resume",
    "spdk_get_thread",
    "spdk_thread_send_msg",
    "spdk_thread_get_name",
    "spdk_thread_get_id",
    "spdk_json_write_val_raw",
    "spdk_json_write_name",
    "spdk_jsonrpc_begin_result",
    "spdk_jsonrpc_end_result",
    "spdk_jsonrpc_send_error_response",
    "spdk_rpc_register_method",
    "spdk_log",
    "spdk_log_get_flag",
    "spdk_log_get_print_level",
    "spdk_dma_zmalloc",
    "spdk_dma_free",
    "spdk_uuid_parse",
    "spdk_uuid_fmt_lower",
    "spdk_uuid_generate_sha1",
    "spdk_keyring_get_key",
    "spdk_keyring_put_key",
    "spdk_key_get_key",
    "spdk_sys_.*",
];

/// Types and constants bound besides those the functions pull in.
const TYPES: &[&str] = &[
    "spdk_bdev_io_type",
    "spdk_bdev_io_status",
    "spdk_bdev_event_type",
    "spdk_bdev_claim_type",
    "spdk_log_level",
    "spdk_json_val",
    "spdk_json_val_type",
    "spdk_bdev_module",
    "spdk_bdev_fn_table",
    "spdk_bdev_io_wait_entry",
    "spdk_nvme_status_code_type",
    "spdk_nvme_generic_command_status_code",
];
const VARS: &[&str] = &[
    "SPDK_RPC_RUNTIME",
    "SPDK_RPC_STARTUP",
    "SPDK_JSONRPC_ERROR_.*",
    "SPDK_IO_CHANNEL_STRUCT_SIZE",
    "SPDK_UUID_STRING_LEN",
];

struct Found {
    include: PathBuf,
    libdir: PathBuf,
    /// Further libraries the SPDK libraries need but do not record (SPDK's shared
    /// `libspdk_env_dpdk` leaves DPDK's `rte_*` libraries and system libraries such as
    /// OpenSSL to the application, per `spdk_env_dpdk.pc` and `spdk_syslibs.pc`): linked, so
    /// that executables (test binaries) link; a preloaded module finds them loaded already.
    extra_libs: Vec<String>,
}

fn from_spdk_dir(dir: &Path) -> Option<Found> {
    let include = dir.join("include");
    if !include.join("spdk/bdev_module.h").exists() {
        println!(
            "cargo:warning=SPDK_DIR={} has no include/spdk/bdev_module.h",
            dir.display()
        );
        return None;
    }
    let libdir = [dir.join("build/lib"), dir.join("lib")]
        .into_iter()
        .find(|d| d.join("libspdk_bdev.so").exists() || d.join("libspdk_bdev.a").exists())?;
    Some(Found {
        include,
        libdir,
        extra_libs: Vec::new(),
    })
}

fn pkg_config_var(args: &[&str]) -> Option<String> {
    let out = Command::new("pkg-config").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn from_pkg_config() -> Option<Found> {
    // `--exists` first: a missing module is the common "no SPDK here" case.
    pkg_config_var(&["--exists", "spdk_bdev"])?;
    let flags = |arg: &str, prefix: &str| -> Vec<PathBuf> {
        pkg_config_var(&[arg, "spdk_bdev"])
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|f| f.strip_prefix(prefix).map(PathBuf::from))
            .collect()
    };
    // The compiler's default directories come last (pkg-config omits them from its output).
    let mut includes = flags("--cflags-only-I", "-I");
    includes.extend(["/usr/local/include", "/usr/include"].map(PathBuf::from));
    let mut libdirs = flags("--libs-only-L", "-L");
    libdirs.extend(
        [
            "/usr/local/lib",
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
        ]
        .map(PathBuf::from),
    );
    let include = includes
        .into_iter()
        .find(|d| d.join("spdk/bdev_module.h").exists())?;
    let libdir = libdirs
        .into_iter()
        .find(|d| d.join("libspdk_bdev.so").exists())?;
    let extra_libs = pkg_config_var(&["--libs-only-l", "spdk_env_dpdk", "spdk_syslibs"])
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|f| f.strip_prefix("-l"))
        .filter(|l| !l.starts_with("spdk_"))
        .map(String::from)
        .collect();
    Some(Found {
        include,
        libdir,
        extra_libs,
    })
}

/// The first line of the bindings file: what made it and how to refresh the committed copy.
fn header_line(include: &Path) -> String {
    format!(
        "// @generated by spdk-sys/build.rs (bindgen, no doc comments) from the headers of SPDK \
         {}; refresh the committed copy with `SPDK_SYS_BLESS=1 cargo test -p spdk-sys`.\n",
        spdk_version(include)
    )
}

/// `major.minor[.patch][suffix]` from `spdk/version.h`, as SPDK spells its releases.
fn spdk_version(include: &Path) -> String {
    let text = std::fs::read_to_string(include.join("spdk/version.h")).unwrap_or_default();
    let define = |name: &str| -> Option<String> {
        text.lines()
            .find_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
                ["#define", n, value, ..] if n == name => Some(value.trim_matches('"').to_string()),
                _ => None,
            })
    };
    let (Some(major), Some(minor)) = (define("SPDK_VERSION_MAJOR"), define("SPDK_VERSION_MINOR"))
    else {
        return "(unknown version)".to_string();
    };
    let minor = format!("{minor:0>2}");
    let patch = define("SPDK_VERSION_PATCH").filter(|p| p != "0");
    let suffix = define("SPDK_VERSION_SUFFIX").unwrap_or_default();
    match patch {
        Some(p) => format!("v{major}.{minor}.{p}{suffix}"),
        None => format!("v{major}.{minor}{suffix}"),
    }
}

/// Runs bindgen over `wrapper.h` with the allowlist; the text of the bindings file.
fn generate(include: &Path) -> String {
    let mut b = bindgen::Builder::default()
        .header("wrapper.h")
        .clang_arg(format!("-I{}", include.display()))
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        // Formatted by a library pinned in Cargo.lock, not by whichever rustfmt is installed,
        // so that the same headers give the same bytes everywhere.
        .formatter(bindgen::Formatter::Prettyplease)
        .derive_default(true)
        .prepend_enum_name(false)
        .layout_tests(false)
        .generate_comments(false)
        .disable_header_comment();
    for f in FUNCTIONS {
        b = b.allowlist_function(f);
    }
    for t in TYPES {
        b = b.allowlist_type(t);
    }
    for v in VARS {
        b = b.allowlist_var(v);
    }
    let bindings = match b.generate() {
        Ok(b) => b,
        Err(e) => panic!("bindgen failed on SPDK's public headers: {e}"),
    };
    header_line(include) + &bindings.to_string()
}

/// Sets `cfg(spdk_channel_size)` when the bindings state the channel struct's size: a
/// channel's context is then found in Rust (as the header's static inline
/// `spdk_io_channel_get_ctx` does) instead of through a shim call on every request.
fn channel_size_cfg(bindings: &str) {
    if bindings.contains("pub const SPDK_IO_CHANNEL_STRUCT_SIZE:") {
        println!("cargo:rustc-cfg=spdk_channel_size");
    }
}

/// No SPDK here: the crate compiles the committed bindings and links nothing.
fn use_committed() {
    let Some(dir) = env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from) else {
        panic!("cargo did not set CARGO_MANIFEST_DIR");
    };
    let committed = dir.join("src/bindings.rs");
    println!("cargo:rerun-if-changed={}", committed.display());
    let text = match std::fs::read_to_string(&committed) {
        Ok(t) => t,
        Err(e) => panic!("reading {}: {e}", committed.display()),
    };
    println!("cargo:rustc-env=SPDK_SYS_BINDINGS={}", committed.display());
    channel_size_cfg(&text);
    println!("cargo:found=0");
}

fn main() {
    println!("cargo::rustc-check-cfg=cfg(spdk)");
    println!("cargo::rustc-check-cfg=cfg(spdk_channel_size)");
    println!("cargo:rerun-if-env-changed=SPDK_DIR");
    println!("cargo:rerun-if-env-changed=SPDK_SYS_DISABLE");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=shim.c");

    if env::var_os("SPDK_SYS_DISABLE").is_some_and(|v| v == "1") {
        println!(
            "cargo:warning=SPDK support disabled (SPDK_SYS_DISABLE=1): using the committed bindings, linking nothing"
        );
        use_committed();
        return;
    }
    let found = match env::var_os("SPDK_DIR") {
        Some(d) => from_spdk_dir(Path::new(&d)),
        None => from_pkg_config(),
    };
    let Some(found) = found else {
        println!(
            "cargo:warning=SPDK not found (SPDK_DIR, pkg-config spdk_bdev): using the committed bindings, linking nothing"
        );
        use_committed();
        return;
    };

    let Some(out) = env::var_os("OUT_DIR").map(PathBuf::from) else {
        panic!("cargo did not set OUT_DIR");
    };
    let bindings = generate(&found.include);
    let generated = out.join("bindings.rs");
    if let Err(e) = std::fs::write(&generated, &bindings) {
        panic!("writing {}: {e}", generated.display());
    }
    println!("cargo:rustc-env=SPDK_SYS_BINDINGS={}", generated.display());
    channel_size_cfg(&bindings);

    cc::Build::new()
        .file("shim.c")
        .include(&found.include)
        .include(".")
        .warnings(true)
        .compile("spdk_sys_shim");

    println!("cargo:rustc-link-search=native={}", found.libdir.display());
    for l in LIBS {
        println!("cargo:rustc-link-lib=dylib={l}");
    }
    // Nothing references these directly, so `--as-needed` would drop them: dependents link
    // them with `-Wl,--no-as-needed` (link arguments do not propagate, hence the metadata).
    println!("cargo:extra_libs={}", found.extra_libs.join(","));
    // This crate's own executables (`cargo build --all-targets` links a lib test even with
    // `test = false`, and `tests/bindings.rs`) need them too.
    if !found.extra_libs.is_empty() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        for l in &found.extra_libs {
            println!("cargo:rustc-link-arg=-l{l}");
        }
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
    println!("cargo:rustc-cfg=spdk");
    println!("cargo:found=1");
    println!("cargo:include={}", found.include.display());
    println!("cargo:libdir={}", found.libdir.display());
}
