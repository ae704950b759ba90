//! Model check of the prefetch ring's coherency with writes (ARCHITECTURE.md §6,
//! prefetched data) with `loom`, on the real [`WriteGens`] (its atomics are loom's under
//! `--cfg loom`).
//!
//! Run with:
//! `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=/tmp/loom-target cargo test -p qcow2_engine --test loom_ring --release`
//!
//! The model: one region of the guest disk. A writer core writes it, in place or through
//! a new mapping (data to a new host location, then the mapping published, as the owner
//! commits an allocation or a COW), bumps the region's generation and then acknowledges.
//! A reader core reads the region ahead into its ring the way `Chain::ring_read` does
//! (record the generation, resolve the mapping, read the device) and later serves a read
//! from the ring only while the generation holds.
//!
//! A read that reaches the chunk while its read-ahead is in flight waits for it
//! (`Lookup::Wait`): when the read-ahead completes, the waiting read is copied from it only
//! while the generation still holds, else read from the base (the mapping and the device
//! as they are then). The model lets that read arrive before or after the read-ahead's
//! device read.
//!
//! A read whose rest spans two chunks, both filling, waits for both read-aheads: each
//! chunk's generation is read again when its read-ahead completes, and the read is served
//! from the ring only if both held, else its whole rest is read from the base. The model
//! has the writer write either chunk.
//!
//! Invariant: a read submitted after the writer's acknowledgement (it observed it) is
//! never served the old data from the ring, waiting or not.
//!
//! A write skips its bump where no read-ahead watches its zone: the model runs
//! `WriteGens::record` and `written` with `fence(SeqCst)` for each half of the asymmetric
//! fence pair they use. A third core watches the same zone first, and may unwatch it and
//! sweep it, while the reader core's read-ahead watches it.
//!
//! Broken variants — bumping before the data reached the device, bumping before the new
//! mapping is published, recording the generation after the read-ahead, recording it
//! without watching the zone, watching a zone another core is still arming without a
//! barrier, a watch left out of the image's word (which a write tests before its zone's),
//! sweeping a watched zone, serving the
//! reads waiting on a read-ahead without checking the generation when it completes,
//! serving a read that waited for two chunks on the first chunk's check alone — must be
//! caught: they run under `#[should_panic]`.

#![cfg(loom)]
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use loom::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;
use qcow2_engine::ring::{Watch, WriteGens};

/// The region's guest offset and a write's length.
const OFF: u64 = 0;
const LEN: u64 = 4096;
/// Old and new contents.
const OLD: u64 = 1;
const NEW: u64 = 2;

#[derive(Clone, Copy, Default)]
struct Faults {
    /// The writer bumps the generation before its data reaches the device.
    bump_before_data: bool,
    /// The writer bumps the generation before it publishes its new mapping.
    bump_before_mapping: bool,
    /// The read-ahead records the generation after its device read.
    record_after_read: bool,
    /// Reads waiting on a read-ahead are served when it completes, generation unchecked.
    wake_unchecked: bool,
    /// A read waiting for two chunks is served on its first chunk's check alone.
    first_chunk_only: bool,
    /// The read-ahead reads the generation without marking its zone watched (so a write
    /// there skips its bump).
    record_unwatched: bool,
    /// A read-ahead that finds its zone watched skips the barrier, though the core that
    /// watched first may still be in it.
    record_trusting: bool,
    /// The sweep clears zones that are still watched.
    sweep_watched: bool,
    /// The read-ahead's watch counts in its zone but not in the image's word (which a
    /// write tests first).
    record_zone_only: bool,
}

/// The read-ahead's record of the generation, as `Chain::ring_read` takes it, and its
/// watch on the zone (kept while its data may be served).
fn record(w: &World) -> (u32, Option<Watch>) {
    if w.faults.record_unwatched {
        (w.gens.current(OFF), None)
    } else if w.faults.record_zone_only {
        let (g, watch) = w.gens.record_zone_only(OFF);
        (g, Some(watch))
    } else if w.faults.record_trusting {
        let (g, watch) = w.gens.record_trusting(OFF);
        (g, Some(watch))
    } else {
        let (g, watch) = w.gens.record(OFF);
        (g, Some(watch))
    }
}

struct World {
    gens: WriteGens,
    /// Host locations 0 (the old cluster) and 1 (a new one, holding garbage at first).
    dev: [AtomicU64; 2],
    /// The region's mapping: which location holds its data.
    map: AtomicU64,
    /// The writer's acknowledgement, as the guest sees it.
    acked: AtomicBool,
    faults: Faults,
}

impl World {
    /// The region holding OLD at location 0 (location 1 garbage), mapped to location 0,
    /// nothing acknowledged, no generation moved.
    fn new(faults: Faults) -> Arc<World> {
        Arc::new(World {
            gens: WriteGens::new(),
            dev: [AtomicU64::new(OLD), AtomicU64::new(0xdead)],
            map: AtomicU64::new(0),
            acked: AtomicBool::new(false),
            faults,
        })
    }
}

fn run(remap: bool, faults: Faults) {
    loom::model(move || {
        let w = World::new(faults);
        let writer = {
            let w = w.clone();
            thread::spawn(move || {
                let f = w.faults;
                if f.bump_before_data {
                    w.gens.written(OFF, LEN);
                }
                let loc = if remap { 1 } else { 0 };
                // The device write completed (its completion reached this core).
                w.dev[loc].store(NEW, Ordering::Relaxed);
                if f.bump_before_mapping {
                    w.gens.written(OFF, LEN);
                }
                if remap {
                    w.map.store(1, Ordering::Release);
                }
                if !f.bump_before_data && !f.bump_before_mapping {
                    w.gens.written(OFF, LEN);
                }
                w.acked.store(true, Ordering::Release);
            })
        };
        // The reader core: a read-ahead, then a guest read served from the ring.
        let f = w.faults;
        let mut rec = if f.record_after_read {
            None
        } else {
            Some(record(&w))
        };
        let loc = w.map.load(Ordering::Acquire) as usize;
        let data = w.dev[loc].load(Ordering::Relaxed);
        if rec.is_none() {
            rec = Some(record(&w));
        }
        let gen = rec.as_ref().map(|r| r.0);
        // The guest read: submitted after it observed the acknowledgement, or not.
        let after_ack = w.acked.load(Ordering::Acquire);
        if Some(w.gens.current(OFF)) == gen {
            assert_ne!(data, 0xdead, "garbage of a new cluster served");
            if after_ack {
                assert_eq!(
                    data, NEW,
                    "a read after the write's acknowledgement got old data"
                );
            }
        }
        writer.join().unwrap();
    });
}

/// A guest read that arrives while the read-ahead fills (before its device read when
/// `early`, after it otherwise) and waits for it, as `Chain::ring_filled` serves it.
fn run_waiting(remap: bool, early: bool, faults: Faults) {
    loom::model(move || {
        let w = World::new(faults);
        let writer = {
            let w = w.clone();
            thread::spawn(move || {
                let loc = if remap { 1 } else { 0 };
                w.dev[loc].store(NEW, Ordering::Relaxed);
                if remap {
                    w.map.store(1, Ordering::Release);
                }
                w.gens.written(OFF, LEN);
                w.acked.store(true, Ordering::Release);
            })
        };
        // The read-ahead starts: the generation recorded, then the mapping resolved and
        // the device read; the guest read arrives and waits in between or after.
        let (gen, _watch) = w.gens.record(OFF);
        let mut after_ack = false;
        if early {
            after_ack = w.acked.load(Ordering::Acquire);
        }
        let loc = w.map.load(Ordering::Acquire) as usize;
        let data = w.dev[loc].load(Ordering::Relaxed);
        if !early {
            after_ack = w.acked.load(Ordering::Acquire);
        }
        // The read-ahead completes: the waiting read is served from it or sent to the base.
        let served = if w.faults.wake_unchecked || w.gens.current(OFF) == gen {
            data
        } else {
            let loc = w.map.load(Ordering::Acquire) as usize;
            w.dev[loc].load(Ordering::Relaxed)
        };
        assert_ne!(served, 0xdead, "garbage of a new cluster served");
        if after_ack {
            assert_eq!(
                served, NEW,
                "a waiting read submitted after the write's acknowledgement got old data"
            );
        }
        writer.join().unwrap();
    });
}

/// The second chunk's offset (its own generation region).
const CHUNK: u64 = qcow2_engine::ring::CHUNK;

/// A guest read whose rest spans chunks 0 and 1, both filling, arriving before or after
/// the read-aheads' device reads (`early`), waits for both, as `Chain::ring_filled`
/// serves it; the writer writes chunk `written` (its region holds OLD, then NEW).
fn run_waiting_two(written: u64, remap: bool, early: bool, faults: Faults) {
    loom::model(move || {
        let w = World::new(faults);
        let at = written * CHUNK;
        let writer = {
            let w = w.clone();
            thread::spawn(move || {
                let loc = if remap { 1 } else { 0 };
                w.dev[loc].store(NEW, Ordering::Relaxed);
                if remap {
                    w.map.store(1, Ordering::Release);
                }
                w.gens.written(at, LEN);
                w.acked.store(true, Ordering::Release);
            })
        };
        // Both read-aheads start: generations recorded, then the device reads (of the
        // written chunk through its mapping; the other chunk holds what it always held).
        let (r0, r1) = (w.gens.record(0), w.gens.record(CHUNK));
        let gens = [r0.0, r1.0];
        let mut after_ack = false;
        if early {
            after_ack = w.acked.load(Ordering::Acquire);
        }
        let loc = w.map.load(Ordering::Acquire) as usize;
        let data = w.dev[loc].load(Ordering::Relaxed);
        if !early {
            after_ack = w.acked.load(Ordering::Acquire);
        }
        // Each read-ahead completes, its chunk's generation read again: the read is
        // served from the ring if both held, else its whole rest from the base.
        let checked = if w.faults.first_chunk_only { 1 } else { 2 };
        let usable = (0..checked).all(|c| w.gens.current(c as u64 * CHUNK) == gens[c]);
        let served = if usable {
            data
        } else {
            let loc = w.map.load(Ordering::Acquire) as usize;
            w.dev[loc].load(Ordering::Relaxed)
        };
        assert_ne!(served, 0xdead, "garbage of a new cluster served");
        if after_ack {
            assert_eq!(
                served, NEW,
                "a read waiting for two chunks, submitted after the write's acknowledgement, \
                 got old data"
            );
        }
        writer.join().unwrap();
    });
}

#[test]
fn waiting_for_two_chunks_either_written() {
    for written in [0, 1] {
        for remap in [false, true] {
            run_waiting_two(written, remap, true, Faults::default());
            run_waiting_two(written, remap, false, Faults::default());
        }
    }
}

#[test]
#[should_panic(expected = "old data")]
fn broken_two_chunk_waiters_served_on_the_first_chunk_check_alone_are_caught() {
    // The second chunk is written after its read-ahead took the old bytes.
    run_waiting_two(
        1,
        false,
        false,
        Faults {
            first_chunk_only: true,
            ..Default::default()
        },
    );
}

#[test]
fn waiting_read_in_place_overwrite() {
    run_waiting(false, true, Faults::default());
    run_waiting(false, false, Faults::default());
}

#[test]
fn waiting_read_write_through_a_new_mapping() {
    run_waiting(true, true, Faults::default());
    run_waiting(true, false, Faults::default());
}

#[test]
#[should_panic(expected = "old data")]
fn broken_waiters_served_without_the_generation_check_are_caught() {
    // The read arrives after the read-ahead's device read took the old bytes.
    run_waiting(
        false,
        false,
        Faults {
            wake_unchecked: true,
            ..Default::default()
        },
    );
}

#[test]
fn in_place_overwrite() {
    run(false, Faults::default());
}

#[test]
fn write_through_a_new_mapping() {
    run(true, Faults::default());
}

#[test]
#[should_panic(expected = "old data")]
fn broken_bump_before_data_is_caught() {
    run(
        false,
        Faults {
            bump_before_data: true,
            ..Default::default()
        },
    );
}

#[test]
#[should_panic(expected = "old data")]
fn broken_bump_before_mapping_is_caught() {
    run(
        true,
        Faults {
            bump_before_mapping: true,
            ..Default::default()
        },
    );
}

#[test]
#[should_panic(expected = "old data")]
fn broken_record_without_watching_the_zone_is_caught() {
    run(
        false,
        Faults {
            record_unwatched: true,
            ..Faults::default()
        },
    );
}

#[test]
#[should_panic(expected = "old data")]
fn broken_watch_left_out_of_the_image_word_is_caught() {
    run(
        false,
        Faults {
            record_zone_only: true,
            ..Faults::default()
        },
    );
}

#[test]
#[should_panic(expected = "old data")]
fn broken_record_after_read_is_caught() {
    run(
        false,
        Faults {
            record_after_read: true,
            ..Default::default()
        },
    );
}

/// Three cores: besides the writer, a core whose read-ahead watches the zone first (and,
/// when `leaves`, unwatches it and sweeps at once), and the reader core, whose read-ahead
/// watches the same zone, maybe while the first is still in its barrier, and then serves a
/// read from the ring.
/// Preemptions the three-core model explores per execution.
const PREEMPTIONS: usize = 3;

fn run_watchers(leaves: bool, faults: Faults) {
    // Three threads: bounded preemptions keep the search to seconds (every broken variant
    // is still caught within the bound).
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(PREEMPTIONS);
    b.check(move || {
        let w = World::new(faults);
        let writer = {
            let w = w.clone();
            thread::spawn(move || {
                w.dev[0].store(NEW, Ordering::Relaxed);
                w.gens.written(OFF, LEN);
                w.acked.store(true, Ordering::Release);
            })
        };
        let first = {
            let w = w.clone();
            thread::spawn(move || {
                let r = record(&w);
                if leaves {
                    drop(r);
                    if w.faults.sweep_watched {
                        w.gens.zones().sweep_all();
                    } else {
                        w.gens.zones().sweep();
                    }
                }
            })
        };
        let (gen, _watch) = record(&w);
        let data = w.dev[0].load(Ordering::Relaxed);
        let after_ack = w.acked.load(Ordering::Acquire);
        if w.gens.current(OFF) == gen && after_ack {
            assert_eq!(
                data, NEW,
                "a read after the write's acknowledgement got old data"
            );
        }
        writer.join().unwrap();
        first.join().unwrap();
    });
}

#[test]
fn a_zone_watched_by_two_cores() {
    run_watchers(false, Faults::default());
}

#[test]
fn a_zone_unwatched_and_swept_while_another_core_watches_it() {
    run_watchers(true, Faults::default());
}

#[test]
#[should_panic(expected = "old data")]
fn broken_watch_trusting_a_zone_still_arming_is_caught() {
    run_watchers(
        false,
        Faults {
            record_trusting: true,
            ..Faults::default()
        },
    );
}

#[test]
#[should_panic(expected = "old data")]
fn broken_sweep_of_a_watched_zone_is_caught() {
    run_watchers(
        true,
        Faults {
            sweep_watched: true,
            ..Faults::default()
        },
    );
}
