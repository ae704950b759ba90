//! Model check of the shared read cache's slot protocol (ARCHITECTURE.md §15) with `loom`,
//! on the real [`SharedReadCache`] (its atomics are loom's under `--cfg loom`) over granule
//! memory that is a loom `UnsafeCell`: loom fails the run if a store into a slot's bytes
//! and a load of them are not ordered by happens-before — what a host's plain (DMA) memory
//! relies on (`spdk/src/ffi/granule.rs`).
//!
//! Run with:
//! `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=/tmp/loom-target cargo test -p qcow2_engine --test loom_golden --release`
//!
//! The models: a reader pins a cached granule and copies it out while a filler replaces a
//! slot of the same (full) set with another granule; a reader looks a granule up while
//! a filler claims, fills and publishes it; and the same with the fill read in place: the
//! filler lends the slot's memory to a device (another thread) that writes it and hands
//! the loan back, then publishes it. Invariant: a hit copies exactly the bytes its
//! granule was filled with, and loom sees no unordered access to a slot's bytes.
//!
//! Broken variants — a claim that takes a slot readers pin, a publish without release —
//! must be caught: they run under `#[should_panic]`.

#![cfg(loom)]
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::thread;
use qcow2_engine::golden::{
    Broken, Exclusive, GranuleMemory, Lookup, Shared, SharedReadCache, WAYS,
};
use std::sync::Arc;

const GRANULE: u32 = 4096;

/// A granule's first word in a loom cell (the rest of a granule is never read here).
struct Cell(UnsafeCell<u64>);

// SAFETY: every access goes through the cell's `with`/`with_mut`, which loom checks.
unsafe impl Sync for Cell {}

impl Cell {
    fn alloc(_len: usize) -> Box<dyn GranuleMemory> {
        Box::new(Cell(UnsafeCell::new(0)))
    }
}

impl GranuleMemory for Cell {
    fn store(&self, _: &Exclusive, off: usize, src: &[u8]) {
        assert_eq!(off, 0);
        let v = u64::from_ne_bytes(src[..8].try_into().unwrap());
        // SAFETY: loom checks that no other access to the cell is concurrent.
        self.0.with_mut(|p| unsafe { *p = v });
    }

    fn load(&self, _: &Shared, off: usize, dst: &mut [u8]) {
        assert_eq!(off, 0);
        // SAFETY: as in `store`.
        let v = self.0.with(|p| unsafe { *p });
        dst[..8].copy_from_slice(&v.to_ne_bytes());
    }
}

fn bytes(v: u64) -> Vec<u8> {
    let mut b = vec![0u8; GRANULE as usize];
    b[..8].copy_from_slice(&v.to_ne_bytes());
    b
}

fn cache(broken: Broken) -> Arc<SharedReadCache> {
    SharedReadCache::new_broken(
        WAYS as u64 * u64::from(GRANULE),
        GRANULE,
        Cell::alloc,
        broken,
    )
    .expect("one set")
}

/// How a filler fills the slot it claimed for granule `g` (with `g + 1`).
#[derive(Clone, Copy)]
enum FillBy {
    /// `publish` copies the bytes in.
    Copy,
    /// Read in place: the slot's memory lent, stored through the loan's proof, published
    /// after.
    InPlace,
}

/// A cache of one set holding granules `gs`, each filled with its value (`g + 1`).
fn cache_holding(broken: Broken, gs: std::ops::Range<u64>) -> Arc<SharedReadCache> {
    let c = cache(broken);
    for g in gs {
        c.claim(g).expect("an empty slot").publish(&bytes(g + 1));
    }
    c
}

/// A fill read in place by a "device" thread: the slot's memory lent to it, it stores
/// the granule through the loan's proof and hands the loan back; published after.
fn fill_in_place(c: &Arc<SharedReadCache>, g: u64) {
    let lent = c.claim(g).expect("the empty slot").lend();
    let device = thread::spawn(move || {
        let (mem, proof) = lent.memory();
        mem.store(proof, 0, &bytes(g + 1));
        lent
    });
    device.join().unwrap().publish();
}

/// A hit on `g` copies out its value (`g + 1`), if `g` is cached.
fn read(c: &SharedReadCache, g: u64) {
    if let Lookup::Hit(pin) = c.pin(g) {
        let mut b = [0u8; 8];
        pin.copy_out(0, &mut b);
        assert_eq!(
            u64::from_ne_bytes(b),
            g + 1,
            "granule {g} read another's bytes"
        );
    }
}

/// A full set; a reader pins granule 0 and copies it out while a filler replaces a slot
/// with granule 100 (`FillBy::InPlace`: stored on the filler's own thread). The filler
/// starts once the pin is taken (a flag, so that the model needs no preemption inside the
/// reader to reach the window; both copies race unless the protocol orders them).
fn replace_under_a_reader(broken: Broken, by: FillBy) {
    loom::model(move || {
        let c = cache_holding(broken, 0..WAYS as u64);
        let pinned = Arc::new(AtomicBool::new(false));
        let f = {
            let (c, pinned) = (c.clone(), pinned.clone());
            thread::spawn(move || {
                while !pinned.load(Ordering::Acquire) {
                    thread::yield_now();
                }
                // The clock hand starts at granule 0's slot.
                if let Some(f) = c.claim(100) {
                    match by {
                        FillBy::InPlace => {
                            let lent = f.lend();
                            let (mem, proof) = lent.memory();
                            mem.store(proof, 0, &bytes(101));
                            lent.publish();
                        }
                        FillBy::Copy => f.publish(&bytes(101)),
                    }
                }
            })
        };
        let Lookup::Hit(pin) = c.pin(0) else {
            panic!("granule 0 is cached")
        };
        pinned.store(true, Ordering::Release);
        let mut b = [0u8; 8];
        pin.copy_out(0, &mut b);
        assert_eq!(u64::from_ne_bytes(b), 1, "granule 0 read another's bytes");
        drop(pin);
        f.join().unwrap();
        read(&c, 0);
        read(&c, 100);
    });
}

/// A reader looks granule 5 up while a filler fills it into the set's one empty slot
/// (`FillBy::InPlace`: read in place by a device thread, [`fill_in_place`]).
fn read_while_filled(broken: Broken, by: FillBy) {
    loom::model(move || {
        let c = cache_holding(broken, 10..10 + WAYS as u64 - 1);
        let r = {
            let c = c.clone();
            thread::spawn(move || read(&c, 5))
        };
        match by {
            FillBy::Copy => c.claim(5).expect("the empty slot").publish(&bytes(6)),
            FillBy::InPlace => fill_in_place(&c, 5),
        }
        r.join().unwrap();
    });
}

#[test]
fn a_pinned_slot_is_never_replaced() {
    replace_under_a_reader(Broken::default(), FillBy::Copy);
}

#[test]
fn a_pinned_slot_is_never_replaced_in_place() {
    replace_under_a_reader(Broken::default(), FillBy::InPlace);
}

#[test]
fn a_hit_sees_its_fill() {
    read_while_filled(Broken::default(), FillBy::Copy);
}

#[test]
#[should_panic]
fn broken_claim_of_a_pinned_slot_is_caught() {
    replace_under_a_reader(
        Broken {
            claim_pinned: true,
            ..Broken::default()
        },
        FillBy::Copy,
    );
}

#[test]
#[should_panic]
fn broken_claim_of_a_pinned_slot_in_place_is_caught() {
    replace_under_a_reader(
        Broken {
            claim_pinned: true,
            ..Broken::default()
        },
        FillBy::InPlace,
    );
}

#[test]
#[should_panic]
fn broken_publish_without_release_is_caught() {
    read_while_filled(
        Broken {
            relaxed_publish: true,
            ..Broken::default()
        },
        FillBy::Copy,
    );
}

#[test]
fn a_hit_sees_its_fill_read_in_place() {
    read_while_filled(Broken::default(), FillBy::InPlace);
}

#[test]
#[should_panic]
fn broken_publish_in_place_without_release_is_caught() {
    read_while_filled(
        Broken {
            relaxed_publish: true,
            ..Broken::default()
        },
        FillBy::InPlace,
    );
}
