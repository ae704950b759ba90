//! Model check of the cross-core coherency protocol (ARCHITECTURE.md §6) with `loom`, on the real
//! [`Shared`] / [`OwnerEpochs`] of the engine (their atomics are loom's under `--cfg loom`).
//!
//! Run with:
//! `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=/tmp/loom-target cargo test -p qcow2_engine --test loom_epochs --release`
//!
//! The model: the owner thread runs a script of metadata operations exactly in the order
//! the owner does them (`image/owner/dirty.rs` and the rest of `image/owner/`: dirty →
//! change in memory → epoch bump → acknowledgement; write-back: take the dirty set, write
//! the device, mark the slice clean), and between every step answers pending core requests like
//! `Qcow2::slice_for_core`. A slice's content is a
//! version number; the "device" holds it in two words written one after the other (a
//! non-atomic slice write, torn while in progress). Core threads run the miss path of
//! `Replica::load_slice` (cached replica valid for the current epoch; odd epoch → ask
//! the owner; even or `Clean` → read L1 and the device, then re-check the epoch) with a
//! per-core replica cache.
//!
//! Invariant: a core request that starts after observing the acknowledgement of version `v`
//! of a slice never uses a version older than `v`, never a torn slice, and never the
//! garbage a freshly allocated L2 table holds on the device before its first write-back.
//!
//! Overwrites (`Req::Overwrite`) follow the engine's `Qcow2::kept_overwrite`: a copy older
//! than the epoch still serves an in-place overwrite while the slot's count of removals is
//! the copy's. The owner's `Modify` only adds mappings; its `Remove` unmaps the cluster the
//! cores overwrite (a discard). Invariant: an overwrite submitted after a removal was
//! acknowledged never goes in place through a version that still maps the cluster.
//!
//! Broken variants of the owner or the core (acknowledging before the epoch bump, skipping
//! the re-check, publishing an L1 entry before the new table's slices are odd, a removal
//! counted as an addition, a core keeping an older copy without comparing the removals)
//! must be caught: they run under `#[should_panic]`.

#![cfg(loom)]
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::{Arc, Condvar, Mutex};
use loom::thread;
use qcow2_engine::coherency::{OwnerEpochs, Shared, SliceChange, SliceReply, SliceStamp};

/// What a freshly allocated cluster holds before anything is written to it.
const GARBAGE: u64 = 0xdead;
/// A slice read while its two words disagreed.
const TORN: u64 = 0x7042;
/// Miss-path attempts before a core gives up (EAGAIN in the engine, no violation).
const MAX_ATTEMPTS: usize = 3;

/// Deliberate protocol violations, to prove the model finds them.
#[derive(Clone, Copy, Default)]
struct Faults {
    /// The owner acknowledges a change before bumping the epoch.
    ack_before_bump: bool,
    /// The core keeps a device read without re-checking the epoch.
    skip_recheck: bool,
    /// The owner publishes a new L1 entry before the new table's slices go odd.
    l1_before_dirty: bool,
    /// The owner counts a removal as an addition (no bump of the slot's removals).
    removal_as_addition: bool,
    /// The core overwrites through any older copy, without comparing the removals.
    kept_ignores_removals: bool,
}

/// A core's guest request.
#[derive(Clone, Copy, Debug)]
enum Req {
    /// A read of the slice (through `Core::load`).
    Read(u64),
    /// An overwrite of the slice's one cluster (through an older copy while no removal
    /// happened since, else `Core::load`).
    Overwrite(u64),
}

/// A script of reads.
fn reads(keys: &[u64]) -> Vec<Req> {
    keys.iter().map(|&k| Req::Read(k)).collect()
}

struct World {
    shared: Shared,
    /// On-disk slices by location (L1 value): two words, written one after the other.
    dev: Vec<[AtomicU64; 2]>,
    /// Per key: the last acknowledged version.
    acked: Vec<AtomicU64>,
    /// Per key: the first version in which the cores' cluster is unmapped (u64::MAX: none);
    /// stored before that version exists anywhere.
    unmapped_from: Vec<AtomicU64>,
    /// Per key: 1 once a removal was acknowledged.
    removal_acked: Vec<AtomicU64>,
    /// The message queues between the cores and the owner (blocking, no spinning).
    mail: Mutex<Mailbox>,
    mail_cv: Condvar,
    faults: Faults,
}

#[derive(Default)]
struct Mailbox {
    /// Core → owner: (core, key).
    requests: Vec<(usize, u64)>,
    /// Owner → core: the answer to that core's request.
    replies: Vec<Option<SliceReply>>,
    /// Cores that finished their script.
    done: usize,
}

/// Initial state: `total_slices` sizes the epoch array (1 makes every key share a slot);
/// `l1[key]` is the location of key's table (0: unallocated); `dev[loc]` the version
/// stored at location `loc`.
fn world(total_slices: u64, l1: &[u64], dev: &[u64], cores: usize, faults: Faults) -> Arc<World> {
    Arc::new(World {
        shared: Shared::new(total_slices, l1, 1 << 30, 64),
        dev: dev
            .iter()
            .map(|&v| [AtomicU64::new(v), AtomicU64::new(v)])
            .collect(),
        acked: l1.iter().map(|_| AtomicU64::new(0)).collect(),
        unmapped_from: l1.iter().map(|_| AtomicU64::new(u64::MAX)).collect(),
        removal_acked: l1.iter().map(|_| AtomicU64::new(0)).collect(),
        mail: Mutex::new(Mailbox {
            replies: vec![None; cores],
            ..Default::default()
        }),
        mail_cv: Condvar::new(),
        faults,
    })
}

/// The metadata owner (single-threaded, like the owner's core).
struct Owner {
    w: Arc<World>,
    ep: OwnerEpochs,
    /// Current version of each slice (what a read must see once acknowledged).
    version: Vec<u64>,
    /// The owner's dirty and writing slices (`image/owner/dirty.rs`): the version each holds.
    dirty: Vec<Option<u64>>,
    writing: Vec<Option<u64>>,
    /// Table location of each key (the owner's own L1).
    loc: Vec<u64>,
}

#[derive(Clone, Copy, Debug)]
enum Step {
    /// `dirty_slice_for` + `set_l2_words` (an allocation: only adds) + acknowledgement of
    /// the guest write.
    Modify(u64),
    /// The same for a discard of the cores' cluster: a removal.
    Remove(u64),
    /// `ensure_l2`: a new table at location `loc` (zeroed in memory: version 1), its slice
    /// dirty, then the L1 entry published.
    AllocTable(u64, u64),
    /// Write-back phase 2 begins: every dirty slice moves to `writing`.
    WbStart,
    /// One word of the slice's device write.
    WbWord(u64, usize),
    /// The slice's device write completed.
    WbDone(u64),
}

impl Owner {
    fn new(w: &Arc<World>, versions: &[u64], l1: &[u64]) -> Self {
        Owner {
            w: w.clone(),
            ep: OwnerEpochs::default(),
            version: versions.to_vec(),
            dirty: vec![None; versions.len()],
            writing: vec![None; versions.len()],
            loc: l1.to_vec(),
        }
    }

    /// `Qcow2::slice_for_core`.
    fn slice_for_core(&self, key: u64) -> SliceReply {
        let k = key as usize;
        let stamp = self.w.shared.stamp(key);
        match self.dirty[k].or(self.writing[k]) {
            Some(v) => SliceReply::Copy {
                words: vec![v],
                stamp,
            },
            None => SliceReply::Clean { stamp },
        }
    }

    /// Answers the pending requests.
    fn serve(&mut self) {
        let w = self.w.clone();
        let mut mail = w.mail.lock().unwrap();
        let reqs = std::mem::take(&mut mail.requests);
        let any = !reqs.is_empty();
        for (core, key) in reqs {
            mail.replies[core] = Some(self.slice_for_core(key));
        }
        if any {
            w.mail_cv.notify_all();
        }
    }

    fn step(&mut self, s: Step) {
        let sh = &self.w.shared;
        let f = self.w.faults;
        match s {
            Step::Modify(key) | Step::Remove(key) => {
                let k = key as usize;
                let v = self.version[k] + 1;
                let removes = matches!(s, Step::Remove(_));
                if removes {
                    self.w.unmapped_from[k].store(v, Ordering::SeqCst);
                }
                if f.ack_before_bump {
                    self.version[k] = v;
                    self.w.acked[k].store(v, Ordering::Release);
                }
                // dirty_slice_for: the slice becomes dirty (content unchanged) ...
                if self.dirty[k].is_none() {
                    self.dirty[k] = Some(self.writing[k].unwrap_or(self.version[k]));
                    self.ep.dirtied(sh, key, SliceChange::Adds);
                }
                // ... set_l2_words: changed in memory, then the epoch moves (and the count
                // of removals, for a removal) ...
                self.version[k] = v;
                self.dirty[k] = Some(v);
                let change = match removes && !f.removal_as_addition {
                    true => SliceChange::Removes,
                    false => SliceChange::Adds,
                };
                self.ep.changed(sh, key, change);
                // ... and only then the guest request is acknowledged.
                self.w.acked[k].store(v, Ordering::Release);
                if removes {
                    self.w.removal_acked[k].store(1, Ordering::Release);
                }
            }
            Step::AllocTable(key, loc) => {
                let k = key as usize;
                self.loc[k] = loc;
                if f.l1_before_dirty {
                    sh.set_l1(k, loc);
                }
                self.version[k] = 1;
                if self.dirty[k].replace(1).is_none() {
                    self.ep.dirtied(sh, key, SliceChange::Removes);
                } else {
                    self.ep.changed(sh, key, SliceChange::Removes);
                }
                if !f.l1_before_dirty {
                    sh.set_l1(k, loc);
                }
            }
            Step::WbStart => {
                for k in 0..self.dirty.len() {
                    assert!(self.writing[k].is_none(), "model: one write-back at a time");
                    self.writing[k] = self.dirty[k].take();
                }
            }
            Step::WbWord(key, word) => {
                let k = key as usize;
                let v = self.writing[k].expect("model: write-back of a clean slice");
                self.w.dev[self.loc[k] as usize][word].store(v, Ordering::Release);
            }
            Step::WbDone(key) => {
                let k = key as usize;
                assert!(self.writing[k].take().is_some());
                self.ep.cleaned(sh, key);
            }
        }
    }

    /// Runs `script`, answering core requests between steps, then until every core is done.
    fn run(mut self, script: &[Step], cores: usize) {
        for &s in script {
            self.step(s);
            self.serve();
        }
        let w = self.w.clone();
        let mut mail = w.mail.lock().unwrap();
        loop {
            let reqs = std::mem::take(&mut mail.requests);
            if !reqs.is_empty() {
                for (core, key) in reqs {
                    mail.replies[core] = Some(self.slice_for_core(key));
                }
                w.mail_cv.notify_all();
            }
            if mail.done == cores {
                return;
            }
            mail = w.mail_cv.wait(mail).unwrap();
        }
    }
}

/// A core replica: its cache of (stamp, version) per key.
struct Core {
    w: Arc<World>,
    id: usize,
    cache: Vec<Option<(SliceStamp, u64)>>,
}

impl Core {
    fn ask(&self, key: u64) -> SliceReply {
        let mut mail = self.w.mail.lock().unwrap();
        mail.requests.push((self.id, key));
        self.w.mail_cv.notify_all();
        loop {
            if let Some(r) = mail.replies[self.id].take() {
                return r;
            }
            mail = self.w.mail_cv.wait(mail).unwrap();
        }
    }

    /// `Replica::load_slice`: the version of `key` this request uses (`None`: gave up).
    fn load(&mut self, key: u64) -> Option<u64> {
        let sh = &self.w.shared;
        let k = key as usize;
        for _ in 0..MAX_ATTEMPTS {
            let mut stamp = sh.stamp(key);
            if let Some((st, v)) = self.cache[k] {
                if st.epoch() == stamp.epoch() {
                    return Some(v);
                }
            }
            if stamp.epoch() & 1 == 1 {
                match self.ask(key) {
                    SliceReply::Copy { words, stamp } => {
                        self.cache[k] = Some((stamp, words[0]));
                        return Some(words[0]);
                    }
                    SliceReply::Clean { stamp: st } => stamp = st,
                    SliceReply::Retry => continue,
                }
            }
            // L1 after the epoch; an unallocated table is used without a re-check.
            let loc = sh.l1(k) as usize;
            if loc == 0 {
                return Some(0);
            }
            let a = self.w.dev[loc][0].load(Ordering::Acquire);
            let b = self.w.dev[loc][1].load(Ordering::Acquire);
            let v = if a == b { a } else { TORN };
            if !self.w.faults.skip_recheck && sh.epoch(key) != stamp.epoch() {
                continue;
            }
            self.cache[k] = Some((stamp, v));
            return Some(v);
        }
        None
    }

    /// A guest request submitted now.
    fn request(&mut self, req: Req) {
        match req {
            Req::Read(key) => self.read(key),
            Req::Overwrite(key) => self.overwrite(key),
        }
    }

    /// `Qcow2::kept_overwrite`, else `Core::load`: an overwrite of `key`'s cluster submitted
    /// now must not go in place through a version that still maps it once its removal was
    /// acknowledged.
    fn overwrite(&mut self, key: u64) {
        let k = key as usize;
        let removed = self.w.removal_acked[k].load(Ordering::Acquire) == 1;
        let now = self.w.shared.stamp(key);
        let version = match self.cache[k] {
            Some((st, v)) if st.epoch() == now.epoch() => Some(v),
            // An older copy, no removal since: the kept overwrite.
            Some((st, v))
                if self.w.faults.kept_ignores_removals || st.removals() == now.removals() =>
            {
                Some(v)
            }
            _ => self.load(key),
        };
        if let Some(v) = version {
            let mapped =
                v != GARBAGE && v != TORN && v < self.w.unmapped_from[k].load(Ordering::Acquire);
            assert!(
                !(mapped && removed),
                "coherency violation: core {} overwrote slice {key}'s cluster in place through version {v} after its removal was acknowledged",
                self.id
            );
        }
    }

    /// A guest read of `key` submitted now: it must see at least the acknowledged version.
    fn read(&mut self, key: u64) {
        let min = self.w.acked[key as usize].load(Ordering::Acquire);
        if let Some(v) = self.load(key) {
            assert!(
                v != GARBAGE && v != TORN && v >= min,
                "coherency violation: core {} used version {v:#x} of slice {key} after the ack of {min}",
                self.id
            );
        }
    }
}

/// Runs one model: the owner on the main thread, one core thread per script in `cores`.
struct Scenario {
    total_slices: u64,
    l1: Vec<u64>,
    dev: Vec<u64>,
    /// Initial slice versions (must match the device for allocated keys).
    versions: Vec<u64>,
    owner: Vec<Step>,
    cores: Vec<Vec<Req>>,
    faults: Faults,
}

fn check(s: Scenario, preemptions: usize) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(preemptions);
    let s = std::sync::Arc::new(s);
    b.check(move || {
        let n = s.cores.len();
        let w = world(s.total_slices, &s.l1, &s.dev, n, s.faults);
        let handles: Vec<_> = s
            .cores
            .iter()
            .enumerate()
            .map(|(id, script)| {
                let w = w.clone();
                let script = script.clone();
                thread::spawn(move || {
                    let mut c = Core {
                        cache: vec![None; w.acked.len()],
                        w,
                        id,
                    };
                    for req in script {
                        c.request(req);
                    }
                    c.w.mail.lock().unwrap().done += 1;
                    c.w.mail_cv.notify_all();
                })
            })
            .collect();
        Owner::new(&w, &s.versions, &s.l1).run(&s.owner, n);
        for h in handles {
            h.join().unwrap();
        }
    });
}

use Step::*;

/// A change, then its write-back in two device words; the core misses during the write.
fn writeback_scenario(faults: Faults) -> Scenario {
    Scenario {
        total_slices: 1,
        l1: vec![1],
        dev: vec![GARBAGE, 1],
        versions: vec![1],
        owner: vec![Modify(0), WbStart, WbWord(0, 0), WbWord(0, 1), WbDone(0)],
        cores: vec![reads(&[0, 0])],
        faults,
    }
}

#[test]
fn miss_during_writeback() {
    check(writeback_scenario(Faults::default()), 3);
}

#[test]
fn redirty_during_writeback() {
    check(
        Scenario {
            total_slices: 1,
            l1: vec![1],
            dev: vec![GARBAGE, 1],
            versions: vec![1],
            owner: vec![
                Modify(0),
                WbStart,
                WbWord(0, 0),
                Modify(0),
                WbWord(0, 1),
                WbDone(0),
            ],
            cores: vec![reads(&[0, 0])],
            faults: Faults::default(),
        },
        3,
    );
}

/// Keys 0 and 1 share the only epoch slot (`Shared::new(1, ..)`): a clean slice in an odd
/// slot is answered `Clean` and read from the device under the owner's epoch.
#[test]
fn two_slices_one_slot() {
    check(
        Scenario {
            total_slices: 1,
            l1: vec![1, 2],
            dev: vec![GARBAGE, 1, 1],
            versions: vec![1, 1],
            owner: vec![
                Modify(1),
                Modify(0),
                WbStart,
                WbWord(0, 0),
                WbWord(0, 1),
                WbDone(0),
                WbWord(1, 0),
                WbWord(1, 1),
                WbDone(1),
            ],
            cores: vec![reads(&[0, 1])],
            faults: Faults::default(),
        },
        2,
    );
}

/// Same slot: the neighbour changes while the first slice is being written back (the slot
/// stays odd across that write-back's completion, whose epoch does not move).
#[test]
fn slot_stays_odd_across_neighbour_writeback() {
    check(
        Scenario {
            total_slices: 1,
            l1: vec![1, 2],
            dev: vec![GARBAGE, 1, 1],
            versions: vec![1, 1],
            owner: vec![
                Modify(1),
                WbStart,
                Modify(0),
                WbWord(1, 0),
                WbWord(1, 1),
                WbDone(1),
            ],
            cores: vec![reads(&[1, 0, 1])],
            faults: Faults::default(),
        },
        2,
    );
}

fn new_table_scenario(faults: Faults) -> Scenario {
    Scenario {
        total_slices: 2,
        l1: vec![0, 0],
        dev: vec![GARBAGE, GARBAGE],
        versions: vec![0, 0],
        owner: vec![
            AllocTable(0, 1),
            Modify(0),
            WbStart,
            WbWord(0, 0),
            WbWord(0, 1),
            WbDone(0),
        ],
        cores: vec![reads(&[0, 0])],
        faults,
    }
}

/// A new L2 table: its slices go odd before `set_l1` publishes it, so a core that sees the
/// entry never keeps the garbage the new cluster holds on the device.
#[test]
fn new_table_published_after_odd() {
    check(new_table_scenario(Faults::default()), 3);
}

/// A core caches a replica, the owner changes the slice twice (the second time while the
/// first is written back); the core's later requests must see the changes they follow.
#[test]
fn cached_replica_across_changes() {
    check(
        Scenario {
            total_slices: 2,
            l1: vec![1, 2],
            dev: vec![GARBAGE, 1, 1],
            versions: vec![1, 1],
            owner: vec![
                Modify(0),
                WbStart,
                Modify(0),
                WbWord(0, 0),
                WbWord(0, 1),
                WbDone(0),
            ],
            cores: vec![reads(&[0, 0, 0])],
            faults: Faults::default(),
        },
        2,
    );
}

/// Two cores with their own replicas of one slice across a change and its write-back.
#[test]
fn two_cores_one_slice() {
    check(
        Scenario {
            total_slices: 1,
            l1: vec![1],
            dev: vec![GARBAGE, 1],
            versions: vec![1],
            owner: vec![Modify(0), WbStart, WbWord(0, 0), WbWord(0, 1), WbDone(0)],
            cores: vec![reads(&[0]), reads(&[0])],
            faults: Faults::default(),
        },
        1,
    );
}

/// A core reads the slice (its copy maps the cluster), then overwrites the cluster twice
/// while the owner adds a mapping, removes the cluster's and writes the slice back: the
/// first overwrite may go through the older copy, none after the removal's acknowledgement.
fn kept_scenario(faults: Faults) -> Scenario {
    Scenario {
        total_slices: 1,
        l1: vec![1],
        dev: vec![GARBAGE, 1],
        versions: vec![1],
        owner: vec![
            Modify(0),
            Remove(0),
            WbStart,
            WbWord(0, 0),
            WbWord(0, 1),
            WbDone(0),
        ],
        cores: vec![vec![Req::Read(0), Req::Overwrite(0), Req::Overwrite(0)]],
        faults,
    }
}

#[test]
fn kept_overwrites_until_a_removal() {
    check(kept_scenario(Faults::default()), 3);
}

/// The same with the removal in a neighbour sharing the slot: a removal anywhere in the
/// slot ends the older copies of every slice in it (only false misses).
#[test]
fn kept_overwrites_with_a_neighbour_in_the_slot() {
    check(
        Scenario {
            total_slices: 1,
            l1: vec![1, 2],
            dev: vec![GARBAGE, 1, 1],
            versions: vec![1, 1],
            owner: vec![Modify(1), Remove(0), Modify(1)],
            cores: vec![vec![
                Req::Read(0),
                Req::Overwrite(0),
                Req::Read(1),
                Req::Overwrite(0),
            ]],
            faults: Faults::default(),
        },
        2,
    );
}

// ----- the model has teeth -------------------------------------------------------------

#[test]
#[should_panic(expected = "coherency violation")]
fn broken_ack_before_bump_is_caught() {
    check(
        Scenario {
            total_slices: 1,
            l1: vec![1],
            dev: vec![GARBAGE, 1],
            versions: vec![1],
            owner: vec![Modify(0)],
            cores: vec![reads(&[0, 0])],
            faults: Faults {
                ack_before_bump: true,
                ..Default::default()
            },
        },
        2,
    );
}

#[test]
#[should_panic(expected = "coherency violation")]
fn broken_no_recheck_is_caught() {
    check(
        writeback_scenario(Faults {
            skip_recheck: true,
            ..Default::default()
        }),
        2,
    );
}

#[test]
#[should_panic(expected = "coherency violation")]
fn broken_l1_before_dirty_is_caught() {
    check(
        new_table_scenario(Faults {
            l1_before_dirty: true,
            ..Default::default()
        }),
        2,
    );
}

#[test]
#[should_panic(expected = "coherency violation")]
fn broken_removal_counted_as_addition_is_caught() {
    check(
        kept_scenario(Faults {
            removal_as_addition: true,
            ..Default::default()
        }),
        2,
    );
}

#[test]
#[should_panic(expected = "coherency violation")]
fn broken_kept_copy_without_the_removal_check_is_caught() {
    check(
        kept_scenario(Faults {
            kept_ignores_removals: true,
            ..Default::default()
        }),
        2,
    );
}

// ----- grace periods before freed clusters are reused -------------------------------------
//
// The real `Grace` of `Shared`: a core thread runs guest requests the way the engine's read path
// does (`enter` before resolving anything, then the slice epoch, then the mapping: a cached
// replica valid for that epoch, or the published one read under a seqlock check), "uses"
// the host cluster, and exits. The owner removes the mapping (COW: guest cluster 0 moves
// from host cluster 1 to host cluster 2) the way the owner does (slice dirtied → changed in
// memory → epoch bump; write-back → cleaned), tags the freed cluster with `grace.now()` when
// the free is stable (`release_unstable`), and reuses it once `try_advance()` reached
// tag + 2 (`reclaim_graced`).
//
// Invariant: no request uses a host cluster after the owner reused it. Both sides check it
// with read-modify-writes (which always see the latest value, also in loom): a request
// marks the cluster in use and then checks that it was not reused; the owner marks it
// reused and then checks that no request is using it.
//
// The real code orders a request's entry before its later loads, and the owner's changes
// before its counter scan, with an asymmetric fence pair (`coherency::fences`): a compiler
// fence after the core's counter store, a process-wide barrier (membarrier) before the
// owner's scan; without membarrier, `fence(SeqCst)` on both sides. Together they act as a
// `fence(SeqCst)` at each of the two places, and loom can model neither membarrier nor
// SeqCst loads and stores (it treats those as AcqRel, see its README); so under loom the
// pair is a no-op and the model places `fence(SeqCst)` at exactly those two places (the
// variant without them is refuted by loom: the ordering is load-bearing). Everything else,
// including stale reads of the global generation (the ABA case), is explored as loom does.

/// Host clusters: 1 is mapped at first and freed by the owner, 2 replaces it.
const OLD: usize = 1;
const NEW: usize = 2;

#[derive(Clone, Copy, Default)]
struct GraceFaults {
    /// The owner reuses at tag + 1 instead of tag + 2.
    reuse_at_tag_plus_one: bool,
    /// The request enters after it resolved the mapping.
    enter_after_resolve: bool,
    /// Without the fences that stand for the asymmetric pair (`coherency::fences`).
    no_seqcst_fences: bool,
}

struct GraceWorld {
    shared: Shared,
    /// The published mapping of guest cluster 0 (what a core reads on a replica miss).
    mapping: AtomicU64,
    /// Per host cluster: the owner reused it.
    reused: [AtomicU64; 3],
    /// Per host cluster: requests in the middle of their device operation on it.
    using: [AtomicU64; 3],
    faults: GraceFaults,
}

impl GraceWorld {
    /// Where the real code's asymmetric fence pair orders a store before a later load.
    fn seqcst_point(&self) {
        if !self.faults.no_seqcst_fences {
            loom::sync::atomic::fence(Ordering::SeqCst);
        }
    }
}

struct GraceScenario {
    /// Generations the owner advances before it removes the mapping.
    pre_advances: usize,
    /// `try_advance` calls the owner makes after tagging (yielding after one that is blocked).
    rounds: usize,
    /// Guest requests the core runs.
    requests: usize,
    faults: GraceFaults,
}

/// One guest request of the core (slot `slot`) with its replica cache `(epoch, host)`.
fn grace_request(w: &GraceWorld, slot: usize, cache: &mut Option<(u32, u64)>) {
    let sh = &w.shared;
    let mut parity = None;
    if !w.faults.enter_after_resolve {
        parity = Some(sh.grace().enter(slot));
        w.seqcst_point();
    }
    // resolve_cached / Replica::load_slice: the epoch, then the replica or a checked read.
    let epoch = sh.epoch(0);
    let host = match *cache {
        Some((e, h)) if e == epoch => Some(h),
        _ => {
            let h = w.mapping.load(Ordering::SeqCst);
            if sh.epoch(0) != epoch {
                None // moved during the read: EAGAIN, nothing used
            } else {
                if epoch & 1 == 0 {
                    *cache = Some((epoch, h));
                }
                Some(h)
            }
        }
    };
    let parity = match parity {
        Some(p) => p,
        None => {
            let p = sh.grace().enter(slot);
            w.seqcst_point();
            p
        }
    };
    if let Some(h) = host {
        let h = h as usize;
        // The device operation on host cluster `h`.
        w.using[h].fetch_add(1, Ordering::SeqCst);
        assert_eq!(
            w.reused[h].fetch_add(0, Ordering::SeqCst),
            0,
            "grace violation: a request used host cluster {h} after the owner reused it"
        );
        w.using[h].fetch_sub(1, Ordering::SeqCst);
    }
    sh.grace().exit(slot, parity);
}

/// The owner (a member, without requests of its own here): removes the mapping, then
/// reclaims the freed cluster.
fn grace_owner(w: &GraceWorld, mut ep: OwnerEpochs, s: &GraceScenario) {
    let sh = &w.shared;
    for _ in 0..s.pre_advances {
        sh.grace().try_advance();
    }
    // COW of guest cluster 0: dirty slice, changed in memory, epoch bump (before the ack).
    ep.dirtied(sh, 0, SliceChange::Adds);
    w.mapping.store(NEW as u64, Ordering::SeqCst);
    ep.changed(sh, 0, SliceChange::Removes);
    // Write-back and flush: the slice is clean, the free of OLD is stable.
    ep.cleaned(sh, 0);
    // release_unstable: tag the batch (no fence: the owner is the generation's only
    // writer, so it reads its own latest value).
    let tag = sh.grace().now();
    let need = if w.faults.reuse_at_tag_plus_one { 1 } else { 2 };
    let mut g = tag;
    for _ in 0..s.rounds {
        // reclaim_graced: try_advance starts with the heavy half of the pair.
        w.seqcst_point();
        let now = sh.grace().try_advance();
        if now >= tag + need {
            w.reused[OLD].fetch_add(1, Ordering::SeqCst);
            assert_eq!(
                w.using[OLD].fetch_add(0, Ordering::SeqCst),
                0,
                "grace violation: the owner reused host cluster {OLD} while a request used it"
            );
            return;
        }
        // Blocked by a request: let the core run (yielding after a successful advance
        // too would hide the schedules where the owner advances twice in a row).
        if now == g {
            thread::yield_now();
        }
        g = now;
    }
}

fn check_grace(s: GraceScenario, preemptions: usize) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(preemptions);
    let s = std::sync::Arc::new(s);
    b.check(move || {
        let w = Arc::new(GraceWorld {
            shared: Shared::new(1, &[1], 1 << 30, 64),
            mapping: AtomicU64::new(0),
            reused: Default::default(),
            using: Default::default(),
            faults: s.faults,
        });
        // Setup (before the threads): both members, a slice that was written back once
        // (epoch 2), the published mapping, and the core's replica of it under epoch 2. The
        // setup stores are SeqCst so that loom's SeqCst loads do not read the initial values.
        let owner_slot = w.shared.grace().register().unwrap();
        let core_slot = w.shared.grace().register().unwrap();
        assert_ne!(owner_slot, core_slot);
        let mut ep = OwnerEpochs::default();
        ep.dirtied(&w.shared, 0, SliceChange::Adds);
        ep.cleaned(&w.shared, 0);
        w.mapping.store(OLD as u64, Ordering::SeqCst);
        let epoch = w.shared.epoch(0);
        assert_eq!(epoch, 2);

        let core = {
            let w = w.clone();
            let requests = s.requests;
            thread::spawn(move || {
                let mut cache = Some((epoch, OLD as u64));
                for _ in 0..requests {
                    grace_request(&w, core_slot, &mut cache);
                }
            })
        };
        grace_owner(&w, ep, &s);
        core.join().unwrap();
    });
}

fn grace_scenario(pre_advances: usize, requests: usize, faults: GraceFaults) -> GraceScenario {
    GraceScenario {
        pre_advances,
        rounds: 3,
        requests,
        faults,
    }
}

/// One request with a cached replica against the removal and two advances.
#[test]
fn grace_one_request() {
    check_grace(grace_scenario(0, 1, GraceFaults::default()), 3);
}

/// Two requests of one core (the second one misses its replica or re-reads the mapping).
#[test]
fn grace_two_requests() {
    check_grace(grace_scenario(0, 2, GraceFaults::default()), 3);
}

/// The ABA case: the core's `enter` loads the generation, is preempted (or reads a stale
/// one), and the owner advances twice before the core's counter goes up; the free is tagged
/// at an odd generation (the stale parity is the previous one) ...
#[test]
fn grace_enter_races_two_advances_odd_tag() {
    check_grace(grace_scenario(1, 1, GraceFaults::default()), 3);
}

/// ... and at generation 2 (the stale parity equals the tag's: the counter lands in the
/// parity the owner checks second).
#[test]
fn grace_enter_races_two_advances_even_tag() {
    check_grace(
        GraceScenario {
            pre_advances: 2,
            rounds: 3,
            requests: 2,
            faults: GraceFaults::default(),
        },
        3,
    );
}

#[test]
#[should_panic(expected = "grace violation")]
fn broken_grace_reuse_at_tag_plus_one_is_caught() {
    check_grace(
        grace_scenario(
            0,
            1,
            GraceFaults {
                reuse_at_tag_plus_one: true,
                ..Default::default()
            },
        ),
        2,
    );
}

#[test]
#[should_panic(expected = "grace violation")]
fn broken_grace_enter_after_resolve_is_caught() {
    check_grace(
        grace_scenario(
            0,
            1,
            GraceFaults {
                enter_after_resolve: true,
                ..Default::default()
            },
        ),
        2,
    );
}

/// With only acquire/release between the counter and the epoch (what loom gives SeqCst
/// accesses), the owner may miss the core's counter while the core misses the new epoch.
#[test]
#[should_panic(expected = "grace violation")]
fn broken_grace_without_seqcst_is_caught() {
    check_grace(
        grace_scenario(
            0,
            1,
            GraceFaults {
                no_seqcst_fences: true,
                ..Default::default()
            },
        ),
        2,
    );
}
