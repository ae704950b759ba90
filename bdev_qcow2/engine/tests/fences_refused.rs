//! The grace-period fences fall back to full fences on both sides when the host's barrier
//! fails, and the mode never changes once fixed (one test: the mode is per process).

mod fences_common;

use qcow2_engine::coherency::{fences, Grace};

#[test]
fn a_refused_barrier_leaves_full_fences_for_good() {
    assert!(
        !fences::install(|| false),
        "a barrier that fails is not used"
    );
    assert!(!fences::asymmetric());
    // Fixed: a working barrier offered later is not taken either (cores already entering
    // with full fences and the owner must agree).
    assert!(!fences::install(|| true));
    assert!(!fences::asymmetric());
    fences_common::entered_request_holds_the_second_advance(&Grace::default());
}
