//! What both fence modes must give the grace periods alike (`fences.rs`, `fences_refused.rs`).

use qcow2_engine::coherency::Grace;

/// A request entered at generation 0 blocks the second advance until it exits; returns the
/// member slot used.
pub fn entered_request_holds_the_second_advance(g: &Grace) -> usize {
    let Some(slot) = g.register() else {
        panic!("no member slot left")
    };
    let p = g.enter(slot);
    assert_eq!(g.try_advance(), 1);
    assert_eq!(g.try_advance(), 1, "the request of generation 0 holds it");
    g.exit(slot, p);
    assert_eq!(g.try_advance(), 2);
    slot
}
