//! Unit tests of the coherency protocol's pieces.

use super::*;

#[test]
fn epochs_follow_dirty_instances() {
    let s = Shared::new(16, &[0; 2], 1 << 20, 64);
    let mut o = OwnerEpochs::default();
    assert_eq!(s.epoch(3), 0);
    o.dirtied(&s, 3, SliceChange::Adds);
    assert_eq!(s.epoch(3), 1);
    o.changed(&s, 3, SliceChange::Adds);
    assert_eq!(s.epoch(3), 3);
    // Re-dirtied while the first copy is written back.
    o.dirtied(&s, 3, SliceChange::Adds);
    assert_eq!(s.epoch(3), 5);
    o.cleaned(&s, 3);
    assert_eq!(s.epoch(3) & 1, 1, "still dirty");
    o.cleaned(&s, 3);
    assert_eq!(s.epoch(3), 6);
    assert_eq!(o.open_slots(), 0);
    assert_eq!(s.stamp(3).removals(), 0, "additions count no removal");
}

#[test]
fn removals_are_counted_apart_from_additions() {
    let s = Shared::new(16, &[0; 2], 1 << 20, 64);
    let mut o = OwnerEpochs::default();
    o.dirtied(&s, 5, SliceChange::Removes);
    assert_eq!((s.stamp(5).epoch(), s.stamp(5).removals()), (1, 1));
    o.changed(&s, 5, SliceChange::Adds);
    assert_eq!((s.stamp(5).epoch(), s.stamp(5).removals()), (3, 1));
    o.changed(&s, 5, SliceChange::Removes);
    assert_eq!((s.stamp(5).epoch(), s.stamp(5).removals()), (5, 2));
    o.cleaned(&s, 5);
    assert_eq!((s.stamp(5).epoch(), s.stamp(5).removals()), (6, 2));
    assert_eq!(s.stamp(4), SliceStamp::default(), "other slots untouched");
}

#[test]
fn the_metadata_log_gives_the_lowest_mark_while_it_holds_them_all() {
    let s = Shared::new(1, &[], 0, 1 << 20);
    let g0 = s.meta_gen();
    s.set_meta_cluster(500);
    s.set_meta_cluster(300);
    s.set_meta_cluster(900);
    let g3 = s.meta_gen();
    assert_eq!(s.meta_marked_min(g0, g3), Some(300));
    assert_eq!(s.meta_marked_min(g0 + 2, g3), Some(900));
    assert_eq!(
        s.meta_marked_min(g3, g3),
        Some(u64::MAX),
        "nothing marked since"
    );
    for c in 0..META_LOG as u64 {
        s.set_meta_cluster(1000 + c);
    }
    assert_eq!(
        s.meta_marked_min(g0, g3),
        None,
        "the log moved past g0's marks"
    );
    let g = s.meta_gen();
    assert_eq!(
        s.meta_marked_min(g - 2, g),
        Some(1000 + META_LOG as u64 - 2)
    );
}

#[test]
fn metadata_ranges_and_their_generation() {
    // 200 clusters of bitmap (4 words).
    let s = Shared::new(1, &[], 0, 200);
    assert!(s.meta_range_clear(0, 256), "nothing marked yet");
    let g0 = s.meta_gen();
    s.set_meta_cluster(70);
    assert_ne!(s.meta_gen(), g0, "a mark moves the generation");
    // Ranges around cluster 70, inside one word and across words.
    assert!(s.meta_range_clear(0, 70));
    assert!(!s.meta_range_clear(0, 71));
    assert!(!s.meta_range_clear(70, 1));
    assert!(s.meta_range_clear(71, 100));
    assert!(!s.meta_range_clear(60, 11));
    assert!(!s.meta_range_clear(64, 64));
    assert!(s.meta_range_clear(128, 64));
    assert!(s.meta_range_clear(5, 0), "an empty range");
    // Past the bitmap counts as metadata, as for one cluster.
    assert!(!s.meta_range_clear(250, 10));
    assert!(!s.meta_range_clear(u64::MAX - 1, 5));
}

#[test]
fn hashed_slots_stay_in_range() {
    let s = Shared::new(u64::MAX, &[], 0, u64::MAX);
    assert_eq!(s.slots() as u64, MAX_EPOCH_SLOTS);
    for k in [0, 1, MAX_EPOCH_SLOTS, u64::MAX, 1 << 40] {
        assert!(s.slot(k) < s.slots());
    }
    assert!(
        s.is_meta_cluster(u64::MAX),
        "past the bitmap counts as metadata"
    );
}

#[test]
fn grace_waits_for_the_previous_parity() {
    let g = Grace::default();
    let a = g.register().unwrap_or(0);
    let b = g.register().unwrap_or(1);
    assert_ne!(a, b);
    let p = g.enter(a); // a request at generation 0
    assert_eq!(g.try_advance(), 1, "parity of -1 is empty");
    assert_eq!(g.try_advance(), 1, "the request of generation 0 holds it");
    let q = g.enter(b); // generation 1
    g.exit(a, p);
    assert_eq!(g.try_advance(), 2);
    assert_eq!(g.try_advance(), 2, "the request of generation 1 holds it");
    g.exit(b, q);
    assert_eq!(g.try_advance(), 3);
    g.unregister(a);
    assert_eq!(g.register(), Some(a));
}

#[test]
fn owner_entries_hold_advances_like_cores() {
    // The owner's fence-free entry counts exactly like a core's: a request it entered
    // holds the generation two advances away until it exits.
    let g = Grace::default();
    let (owner, core) = (g.register().unwrap(), g.register().unwrap());
    let p = g.enter_owner(owner); // generation 0
    assert_eq!(g.try_advance(), 1);
    assert_eq!(
        g.try_advance(),
        1,
        "the owner's request of generation 0 holds it"
    );
    let q = g.enter(core); // generation 1
    g.exit(owner, p);
    assert_eq!(g.try_advance(), 2);
    let r = g.enter_owner(owner); // generation 2
    g.exit(core, q);
    assert_eq!(g.try_advance(), 3);
    assert_eq!(
        g.try_advance(),
        3,
        "the owner's request of generation 2 holds it"
    );
    g.exit(owner, r);
    assert_eq!(g.try_advance(), 4);
}

#[test]
fn grace_has_room_for_many_cores() {
    let g = Grace::default();
    let slots: Vec<usize> = (0..MAX_GRACE_MEMBERS)
        .filter_map(|_| g.register())
        .collect();
    assert_eq!(slots.len(), MAX_GRACE_MEMBERS);
    assert_eq!(g.register(), None, "all taken");
    let last = MAX_GRACE_MEMBERS - 1;
    let p = g.enter(last);
    assert_eq!(g.try_advance(), 1);
    assert_eq!(g.try_advance(), 1, "the member in the last word holds it");
    g.exit(last, p);
    assert_eq!(g.try_advance(), 2);
    g.unregister(200);
    assert_eq!(g.register(), Some(200));
}

#[test]
fn meta_bitmap() {
    let s = Shared::new(1, &[], 0, 1000);
    assert!(!s.is_meta_cluster(700));
    s.set_meta_cluster(700);
    assert!(s.is_meta_cluster(700));
    assert!(!s.is_meta_cluster(701));
    assert!(s.is_meta_cluster(64 * 16 + 1), "beyond the bitmap");
}

#[test]
fn members_enter_under_the_generation_the_owner_gives_them() {
    // Each member reads the parity it enters under from its own counters: the owner raises
    // it on every advance, and registration raises it to the current generation.
    let g = Grace::default();
    let a = g.register().unwrap();
    assert_eq!(g.try_advance(), 1);
    assert_eq!(g.try_advance(), 2);
    assert_eq!(g.try_advance(), 3);
    let b = g.register().unwrap();
    let p = g.enter(a);
    let q = g.enter(b);
    assert_eq!((p.bit(), q.bit()), (1, 1), "both under generation 3");
    assert_eq!(g.try_advance(), 4, "parity 0 is empty");
    assert_eq!(g.try_advance(), 4, "the requests of generation 3 hold it");
    g.exit(a, p);
    assert_eq!(g.try_advance(), 4, "b's request still holds it");
    g.exit(b, q);
    assert_eq!(g.try_advance(), 5);
    let r = g.enter(b);
    assert_eq!(r.bit(), 1, "raised to generation 5");
    g.exit(b, r);
}
