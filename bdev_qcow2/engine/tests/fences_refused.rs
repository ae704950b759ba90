//! The grace-period fences fall back to full fences on both sides when the host's barrier
//! fails, and the mode never changes once fixed (one test: the mode is per process).

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
    let g = Grace::default();
    let slot = g.register().expect("a member slot");
    let p = g.enter(slot);
    assert_eq!(g.try_advance(), 1);
    assert_eq!(g.try_advance(), 1);
    g.exit(slot, p);
    assert_eq!(g.try_advance(), 2);
}
