//! Unit tests of the direct path's memo: slots, hits and conflicts, linear and mapped slices.

use super::*;

#[test]
fn linear_slices_sizes_epochs_and_metadata_generations() {
    assert_eq!(SliceMemo::new(0, 8, 16).slots(), 1);
    assert_eq!(SliceMemo::new(5, 8, 16).slots(), 8);
    assert_eq!(SliceMemo::new(usize::MAX, 8, 16).slots(), MEMO_MAX_SLOTS);
    let m = SliceMemo::new(16, 8, 16);
    assert_eq!(m.extent(3, 0, 0, 512), None);
    m.remember(3, 1 << 20, SliceStamp::of(4, 2), 9);
    assert_eq!(m.extent(3, 4, 0, 512), Some(1 << 20));
    assert_eq!(m.extent(3, 4, 70_000, 512), Some((1 << 20) + 70_000));
    assert_eq!(m.extent(3, 5, 0, 512), None, "another epoch");
    assert_eq!(
        m.extent(19, 4, 0, 512),
        None,
        "another key in the same slot"
    );
    // An overwrite goes by the count of removals (2) alone: the epoch moves with
    // every addition (ARCHITECTURE.md §6).
    assert_eq!(
        m.extent_overwrite(3, SliceStamp::of(5, 2), 9, 0, 512),
        Some(1 << 20)
    );
    assert_eq!(m.kept(), 1, "through an older copy");
    assert_eq!(
        m.extent_overwrite(3, SliceStamp::of(7, 3), 9, 0, 512),
        None,
        "a removal since"
    );
    assert_eq!(
        m.extent_overwrite(3, SliceStamp::of(4, 2), 10, 0, 512),
        None,
        "metadata marked since"
    );
    assert_eq!(m.hits(), 3);
    // A slot holds one key: the later one wins; forgetting another key leaves it.
    m.remember(19, 2 << 20, SliceStamp::of(4, 0), MEMO_NO_META_GEN);
    assert_eq!(m.extent(3, 4, 0, 512), None);
    m.forget(3);
    assert_eq!(m.extent(19, 4, 0, 512), Some(2 << 20));
    assert_eq!(
        m.extent_overwrite(19, SliceStamp::of(4, 0), 9, 0, 512),
        None,
        "not known clear of metadata"
    );
    m.forget(19);
    assert_eq!(m.extent(19, 4, 0, 512), None);
}

#[test]
fn mapped_slices_answer_inside_one_cluster_with_a_host() {
    // 8 entries of 64 KiB clusters; entry 2 has no host cluster the memo answers for.
    let m = SliceMemo::new(4, 8, 16);
    let hosts = [7u32, 3, 0, 12, 5, 6, 9, 8];
    m.remember_mapped(1, SliceStamp::of(6, 1), 11, hosts.into_iter());
    let c = 1u64 << 16;
    assert_eq!(m.extent(1, 6, 0, 4096), Some(7 * c));
    assert_eq!(m.extent(1, 6, c + 512, 512), Some(3 * c + 512));
    assert_eq!(m.extent(1, 6, 3 * c + c - 512, 512), Some(12 * c + c - 512));
    assert_eq!(m.extent(1, 6, 2 * c, 512), None, "no host cluster");
    assert_eq!(m.extent(1, 6, c - 512, 1024), None, "across two clusters");
    assert_eq!(m.extent(1, 8, 0, 512), None, "another epoch");
    assert_eq!(
        m.extent_overwrite(1, SliceStamp::of(6, 1), 11, 4 * c, 4096),
        Some(5 * c)
    );
    assert_eq!(m.kept(), 0, "the current copy");
    assert_eq!(
        m.extent_overwrite(1, SliceStamp::of(6, 1), 11, 2 * c, 512),
        None,
        "no host cluster"
    );
    assert_eq!(
        m.extent_overwrite(1, SliceStamp::of(8, 2), 11, 4 * c, 4096),
        None,
        "a removal"
    );
    assert_eq!(
        m.extent_overwrite(1, SliceStamp::of(6, 1), 12, 4 * c, 4096),
        None
    );
    // A linear slice in the same slot replaces it, and a mapped one the linear one.
    m.remember(5, 1 << 30, SliceStamp::of(6, 0), MEMO_NO_META_GEN);
    assert_eq!(m.extent(1, 6, 0, 512), None);
    assert_eq!(m.extent(5, 6, c, 512), Some((1 << 30) + c));
    m.remember_mapped(
        5,
        SliceStamp::of(6, 0),
        MEMO_NO_META_GEN,
        [1u32, 2].into_iter(),
    );
    assert_eq!(m.extent(5, 6, c, 512), Some(2 * c));
    assert_eq!(m.extent(5, 6, 2 * c, 512), None, "rows are padded with 0");
    m.forget(5);
    assert_eq!(m.extent(5, 6, c, 512), None);
}

#[test]
fn a_mapped_row_is_carried_to_a_newer_copy_only_from_the_copy_it_was_built_from() {
    let m = SliceMemo::new(4, 8, 16);
    let c = 1u64 << 16;
    m.remember_mapped(1, SliceStamp::of(5, 2), 9, [7u32, 0, 9].into_iter());
    assert!(
        m.mapped_row(1, SliceStamp::of(7, 2), 9).is_none(),
        "another copy"
    );
    assert!(
        m.mapped_row(1, SliceStamp::of(5, 3), 9).is_none(),
        "another count of removals"
    );
    assert!(
        m.mapped_row(1, SliceStamp::of(5, 2), 10).is_none(),
        "the bitmap moved"
    );
    assert!(
        m.mapped_row(5, SliceStamp::of(5, 2), 9).is_none(),
        "another key in the slot"
    );
    let row = m
        .mapped_row(1, SliceStamp::of(5, 2), 9)
        .expect("the row of copy (5, 2)");
    assert!(m.patch_row(&row, 1, 4));
    assert!(!m.patch_row(&row, 8, 4), "past the row");
    // The cache forgets the slice while it takes the new copy; the row comes back.
    m.forget(1);
    m.carry_mapped(row, SliceStamp::of(9, 2), 9);
    assert_eq!(m.extent(1, 5, c, 512), None, "the old copy's epoch");
    assert_eq!(m.extent(1, 9, c + 512, 512), Some(4 * c + 512), "patched");
    assert_eq!(m.extent(1, 9, 2 * c, 512), Some(9 * c), "kept");
    assert_eq!(m.extent(1, 9, 0, 512), Some(7 * c));
    // A linear slot is no row to carry.
    m.remember(2, 1 << 30, SliceStamp::of(6, 0), MEMO_NO_META_GEN);
    assert!(m
        .mapped_row(2, SliceStamp::of(6, 0), MEMO_NO_META_GEN)
        .is_none());
}

#[test]
fn a_new_metadata_generation_revalidates_a_mapped_row_in_place() {
    let m = SliceMemo::new(4, 8, 16);
    let c = 1u64 << 16;
    m.remember_mapped(1, SliceStamp::of(5, 2), 9, [7u32, 0, 9, 10].into_iter());
    assert!(
        !m.revalidate_mapped(1, SliceStamp::of(5, 2), 9, |_| true, |_| None),
        "same generation"
    );
    assert!(
        !m.revalidate_mapped(1, SliceStamp::of(7, 2), 10, |_| true, |_| None),
        "another copy"
    );
    assert!(
        !m.revalidate_mapped(1, SliceStamp::of(5, 3), 10, |_| true, |_| None),
        "a removal"
    );
    // Cluster 9 became metadata under generation 10; the log says only that the
    // lowest cluster marked since 9 is 9 (not above the row's highest, 10): the row's
    // words are checked.
    assert!(m.revalidate_mapped(
        1,
        SliceStamp::of(5, 2),
        10,
        |h| h == 9,
        |since| {
            assert_eq!(since, 9);
            Some(9)
        }
    ));
    assert_eq!(
        m.extent_overwrite(1, SliceStamp::of(5, 2), 9, 0, 512),
        None,
        "old generation"
    );
    assert_eq!(
        m.extent_overwrite(1, SliceStamp::of(5, 2), 10, 0, 512),
        Some(7 * c)
    );
    assert_eq!(
        m.extent_overwrite(1, SliceStamp::of(5, 2), 10, 2 * c, 512),
        None,
        "metadata now"
    );
    assert_eq!(
        m.extent_overwrite(1, SliceStamp::of(5, 2), 10, 3 * c, 512),
        Some(10 * c)
    );
}

#[test]
fn a_row_below_every_cluster_marked_since_is_kept_without_a_look() {
    let m = SliceMemo::new(4, 8, 16);
    let c = 1u64 << 16;
    m.remember_mapped(1, SliceStamp::of(5, 2), 9, [7u32, 0, 9, 10].into_iter());
    // Marks since 9 all at 11 or above: the row stands (`is_meta` is not asked).
    assert!(m.revalidate_mapped(
        1,
        SliceStamp::of(5, 2),
        10,
        |_| panic!("looked"),
        |_| Some(11)
    ));
    assert_eq!(
        m.extent_overwrite(1, SliceStamp::of(5, 2), 10, 3 * c, 512),
        Some(10 * c)
    );
    // A patch raises the row's highest cluster: a mark at 11 is looked at now.
    m.patch_mapped(1, 1, 11);
    assert!(m.revalidate_mapped(1, SliceStamp::of(5, 2), 11, |h| h == 11, |_| Some(11)));
    assert_eq!(
        m.extent_overwrite(1, SliceStamp::of(5, 2), 11, c, 512),
        None,
        "metadata now"
    );
    assert_eq!(
        m.extent_overwrite(1, SliceStamp::of(5, 2), 11, 3 * c, 512),
        Some(10 * c)
    );
    // The log no longer holds every mark: the words are checked.
    assert!(m.revalidate_mapped(1, SliceStamp::of(5, 2), 12, |h| h == 7, |_| None));
    assert_eq!(
        m.extent_overwrite(1, SliceStamp::of(5, 2), 12, 0, 512),
        None
    );
    assert_eq!(
        m.extent_overwrite(1, SliceStamp::of(5, 2), 12, 3 * c, 512),
        Some(10 * c)
    );
}

#[test]
fn a_changed_entry_patches_a_mapped_row_and_drops_a_linear_slot() {
    let m = SliceMemo::new(4, 8, 16);
    let c = 1u64 << 16;
    m.remember_mapped(
        1,
        SliceStamp::of(6, 0),
        MEMO_NO_META_GEN,
        [7u32, 0, 9].into_iter(),
    );
    // An allocation: the entry gains a host; a discard: it loses it.
    m.patch_mapped(1, 1, 4);
    assert_eq!(m.extent(1, 6, c + 512, 512), Some(4 * c + 512));
    m.patch_mapped(1, 0, 0);
    assert_eq!(m.extent(1, 6, 0, 512), None);
    assert_eq!(m.extent(1, 6, 2 * c, 512), Some(9 * c), "others kept");
    // Another key in the slot, or an index past the row: nothing answers wrongly.
    m.patch_mapped(5, 2, 3);
    assert_eq!(m.extent(1, 6, 2 * c, 512), Some(9 * c));
    m.patch_mapped(1, 8, 3);
    assert_eq!(m.extent(1, 6, 2 * c, 512), None, "forgotten");
    // A linear slice's start no longer tells where a changed entry lies.
    m.remember(2, 1 << 30, SliceStamp::of(6, 0), MEMO_NO_META_GEN);
    m.patch_mapped(2, 3, 12);
    assert_eq!(m.extent(2, 6, 0, 512), None);
}

#[test]
fn mapped_words_hold_host_clusters_below_above_and_at_their_index() {
    // 2 MiB clusters, 16 entries: host clusters at, below and above their index, the
    // largest one a word holds (2^31 - 1), and one past it, which the memo leaves to
    // the cache.
    let bits = 21;
    let c = 1u64 << bits;
    let m = SliceMemo::new(2, 16, bits);
    let big = i32::MAX as u32;
    let hosts = [0u32, 1, 9, 3, 1 << 20, big, big + 1];
    m.remember_mapped(3, SliceStamp::of(1, 0), MEMO_NO_META_GEN, hosts.into_iter());
    assert_eq!(m.extent(3, 1, 0, 512), None, "no host");
    assert_eq!(
        m.extent(3, 1, c + 4096, 512),
        Some(c + 4096),
        "at its index"
    );
    assert_eq!(m.extent(3, 1, 2 * c, 4096), Some(9 * c));
    assert_eq!(m.extent(3, 1, 3 * c + c - 512, 512), Some(3 * c + c - 512));
    assert_eq!(m.extent(3, 1, 4 * c + 512, 512), Some((1 << 20) * c + 512));
    assert_eq!(m.extent(3, 1, 5 * c, 512), Some(u64::from(big) * c));
    assert_eq!(m.extent(3, 1, 6 * c, 512), None, "past 2^31 clusters");
    assert_eq!(
        m.extent(3, 1, 2 * c - 512, 1024),
        None,
        "across two clusters"
    );
    assert_eq!(m.extent(3, 1, 2 * c, 0), None, "empty");
    // A patched word is encoded the same way, in the row of its own slot.
    m.remember_mapped(
        2,
        SliceStamp::of(1, 0),
        MEMO_NO_META_GEN,
        [4u32].into_iter(),
    );
    m.patch_mapped(3, 6, 2);
    m.patch_mapped(3, 1, 0);
    assert_eq!(m.extent(3, 1, 6 * c + 512, 512), Some(2 * c + 512));
    assert_eq!(m.extent(3, 1, c, 512), None);
    assert_eq!(
        m.extent(2, 1, 512, 512),
        Some(4 * c + 512),
        "other row kept"
    );
}

#[test]
fn slots_in_use_wrap_below_the_table_and_forget_all_empties_them() {
    // 4 slots in use: keys 1 and 5 share one; a start on the device that would read
    // as a mapped slot is not remembered.
    let m = SliceMemo::new(4, 8, 16);
    m.remember(1, 4096, SliceStamp::of(0, 0), MEMO_NO_META_GEN);
    m.remember(6, 8192, SliceStamp::of(0, 0), MEMO_NO_META_GEN);
    assert_eq!(m.extent(1, 0, 0, 512), Some(4096));
    m.remember(5, 1 << 20, SliceStamp::of(0, 0), MEMO_NO_META_GEN);
    assert_eq!(m.extent(1, 0, 0, 512), None, "5 took the slot of 1");
    m.remember(5, MAPPED | 7, SliceStamp::of(0, 0), MEMO_NO_META_GEN);
    assert_eq!(m.extent(5, 0, 0, 512), None);
    m.forget_all();
    assert_eq!(m.extent(6, 0, 0, 512), None);
}

#[test]
fn a_held_slot_gives_way_to_mapped_slices_rarely() {
    let m = SliceMemo::new(1, 4, 16);
    assert!(m.takes_mapped(1, 0, 5), "empty");
    m.remember_mapped(1, SliceStamp::of(0, 0), 5, [1u32].into_iter());
    assert!(!m.takes_mapped(1, 0, 5), "held already");
    assert!(m.takes_mapped(1, 2, 5), "held under an older epoch");
    assert!(
        m.takes_mapped(1, 0, 6),
        "held under an older metadata generation"
    );
    let taken = (0..MAPPED_EVICT_EVERY * 4)
        .filter(|_| m.takes_mapped(2, 0, 5))
        .count();
    assert_eq!(taken, 4);
}

#[test]
fn the_view_of_a_raw_top_layer_answers_nothing() {
    let v = MemoView::answering_nothing();
    // No guest range (whole 512-byte blocks) lies inside one of its one-byte slices, and
    // every one ends in a tail (read-ahead watches every request over a raw layer).
    for (off, len) in [(0, 512), (0, 4096), (4096, 512), (1 << 30, 65536)] {
        assert_eq!(v.read(v.spot(off, len), len), None, "read {off}+{len}");
        assert!(v.in_tail(v.spot(off, len)), "tail {off}+{len}");
        assert_eq!(v.overwrite(off, len), None, "overwrite {off}+{len}");
    }
}
