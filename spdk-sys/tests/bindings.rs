//! The committed bindings (`src/bindings.rs`, used where no SPDK is installed) are what
//! bindgen makes of the installed SPDK's headers today: a change of SPDK or of the allowlist
//! that is not committed fails here. Without SPDK this prints `SKIPPED:` and passes.

use std::io::Write as _;
use std::path::Path;

/// Prints a line that test capture does not swallow (cargo shows it even on success).
fn say(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{msg}");
}

#[test]
fn committed_bindings_match_installed_spdk() {
    // `cfg(spdk)` (set by build.rs for every target of this crate) rather than
    // `spdk_sys::FOUND`: this test must not link SPDK's libraries, which need DPDK's.
    if !cfg!(spdk) {
        say("SKIPPED: SPDK not installed (or SPDK_SYS_DISABLE=1): the committed bindings were not compared with fresh ones");
        return;
    }
    // With SPDK found, build.rs generated this file and the crate was built from it.
    let fresh_path = Path::new(env!("SPDK_SYS_BINDINGS"));
    let committed_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/bindings.rs");
    let fresh = std::fs::read(fresh_path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", fresh_path.display()));
    let committed = std::fs::read(&committed_path).unwrap_or_default();
    if fresh == committed {
        return;
    }
    if std::env::var_os("SPDK_SYS_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&committed_path, &fresh)
            .unwrap_or_else(|e| panic!("writing {}: {e}", committed_path.display()));
        say(&format!(
            "refreshed {} from the installed SPDK: review and commit it",
            committed_path.display()
        ));
        return;
    }
    let line = first_difference(&fresh, &committed);
    panic!(
        "{} differs from the bindings generated from the installed SPDK ({}), first at line \
         {line}. If the new SPDK or allowlist is intended, refresh the committed copy with \
         `SPDK_SYS_BLESS=1 cargo test -p spdk-sys --test bindings` (or copy the generated file \
         over it), then review and commit it.",
        committed_path.display(),
        fresh_path.display(),
    );
}

/// The 1-based number of the first line where `a` and `b` differ.
fn first_difference(a: &[u8], b: &[u8]) -> usize {
    let at = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    1 + a[..at].iter().filter(|&&c| c == b'\n').count()
}
