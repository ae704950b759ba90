//! The asymmetric grace-period fences (`coherency::fences`) with a host-supplied barrier.
//! The mode is per process, so this binary holds one test (`fences_refused.rs` holds the
//! fallback).

mod fences_common;

use qcow2_engine::coherency::{fences, Grace};
use std::sync::atomic::{fence, AtomicUsize, Ordering};

static CALLS: AtomicUsize = AtomicUsize::new(0);

/// Stands for membarrier: counts its calls (a full fence is what it must at least give).
fn counting_barrier() -> bool {
    CALLS.fetch_add(1, Ordering::SeqCst);
    fence(Ordering::SeqCst);
    true
}

#[test]
fn an_installed_barrier_runs_before_every_advance_attempt() {
    // Installed before any Grace exists: taken (after one trial call).
    assert!(fences::install(counting_barrier));
    assert!(fences::asymmetric());
    assert_eq!(
        CALLS.load(Ordering::SeqCst),
        1,
        "tried once when the mode was fixed"
    );

    let g = Grace::default();
    // As with full fences.
    let slot = fences_common::entered_request_holds_the_second_advance(&g);
    assert_eq!(
        CALLS.load(Ordering::SeqCst),
        4,
        "one barrier per advance attempt"
    );
    // Entries and exits never call it.
    for _ in 0..100 {
        let p = g.enter(slot);
        g.exit(slot, p);
    }
    assert_eq!(CALLS.load(Ordering::SeqCst), 4);

    // Installing again changes nothing.
    assert!(fences::install(|| false));
    assert!(fences::asymmetric());
}
