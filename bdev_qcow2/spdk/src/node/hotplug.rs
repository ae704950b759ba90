//! A backing bdev hot-removed and back (ARCHITECTURE.md §15, degraded mode), driven on
//! each node's md thread (where its descriptors were opened and close):
//!
//! 1. SPDK reports the removal to each descriptor: the node's phase goes to `Leaving`
//!    (channels created from now on build a missing device), the owner and then every
//!    channel, on its own thread, switch their device of the bdev to a missing one
//!    (reads that need it fail; what is in flight drains);
//! 2. once none drains any more, the descriptor closes (SPDK waits for that to let the
//!    bdev go) and the node is `Missing`;
//! 3. a bdev registered under the same name (our examine) is opened and claimed again if it
//!    has the same size and no stricter alignment, with the shared cache of *that* bdev
//!    (keyed by its UUID: another bdev reusing the name never hits the old one's granules);
//!    the owner and every channel take a device of it, and reads go through again.
//!
//! A node created while its backing bdev did not exist starts at 3 (`Missing`, any size
//! taken the first time). A node deleted while a pass over its channels runs is
//! unregistered when the pass ends (`passes.rs`).

use super::{later, open, passes};
use crate::backing_state::{Phase, Shape};
use crate::examine_hold::ExamineHold;
use crate::ffi::bdev::{self, OpenMode};
use crate::ffi::node::NodeKey;
use crate::ffi::sys;
use crate::ffi::thread::{self, Poll, Polled, PollerSlot, Thread};
use crate::registry;
use crate::types::{ChannelIter, Registered};
use std::os::raw::c_int;
use std::time::Instant;

/// SPDK reports bdev `name` removed: every node reading it as its backing bdev leaves it,
/// on its md thread.
pub fn removed(name: &str) {
    for (key, md) in users(name, false) {
        on(md, move || leave(key));
    }
}

/// A bdev called `name` was registered: every node missing it as its backing bdev (created
/// without it, or it was removed) opens it again, on its md thread; `hold` keeps the
/// bdev's examine open until every core of theirs reads it.
pub fn appeared(name: &str, hold: &ExamineHold) {
    let until = Instant::now() + later::CLAIM_WAIT;
    for (key, md) in users(name, true) {
        let hold = hold.clone();
        on(md, move || reopen(key, until, Some(hold)));
    }
}

/// The nodes whose backing bdev is `name` (`missing`: only those that lost it), with their
/// md threads. A node whose stream dropped the backing reference lets the bdev go when it
/// is removed (its descriptor is still open) but needs it no more. A node that reads a deep
/// chain's layers (`below.rs`) leaves the backing bdev when any of them goes, and does not
/// read it again (the layers under a returning bdev may be others: re-create the overlay).
fn users(name: &str, missing: bool) -> Vec<(NodeKey, Thread)> {
    registry::lock()
        .nodes
        .iter()
        .filter(|(_, r)| {
            let n = r.node();
            let p = if missing {
                n.saved_params()
            } else {
                n.params()
            };
            let named = p.backing_bdev.as_deref() == Some(name);
            if missing && named && n.flattened() {
                tracing::warn!(
                    "qcow2 bdev {}: a bdev named {name} was registered; the deep chain under \
                     its backing bdev is not read again (re-create the bdev)",
                    n.name()
                );
                return false;
            }
            if !missing && n.below_reads(name) {
                return n.backing_phase().is_some();
            }
            named
                && n.backing_phase()
                    .is_some_and(|p| !missing || matches!(p, Phase::Leaving | Phase::Missing))
        })
        .filter_map(|(_, r)| Some((r.key(), r.node().md_thread()?)))
        .collect()
}

fn on(md: Thread, f: impl FnOnce() + Send + 'static) {
    if let Err(e) = md.exec(f) {
        tracing::error!(
            "cannot reach a qcow2 bdev's md thread ({e}): its backing bdev is not followed"
        );
    }
}

/// On the md thread: SPDK said the backing bdev is going.
fn leave(key: NodeKey) {
    let reg = registry::lock();
    let Some(r) = reg.by_key(key) else { return };
    if !r.node().backing_removed() {
        return;
    }
    tracing::warn!(
        "qcow2 bdev {}: backing bdev {} was removed: reads that need it fail until it returns",
        r.node().name(),
        r.node().params().backing_bdev.unwrap_or_default()
    );
    start_leaving(r, key);
}

/// The owner and every channel leave the backing bdev; the descriptor closes once none
/// drains any more ([`Closer`]).
fn start_leaving(r: &Registered, key: NodeKey) {
    if let Some(o) = r.owner_here() {
        o.backing_leave();
    }
    passes::started(key);
    r.for_each_channel(key, leave_step, left);
}

fn leave_step(it: ChannelIter, _: &mut NodeKey) {
    it.with_channel(|ch, it| {
        ch.backing_leave();
        it.next(0);
    });
}

fn left(key: NodeKey, _: c_int) {
    if let Some(gone) = passes::ended(key) {
        // Deleted meanwhile: its teardown closes the descriptor.
        return gone.unregister_device();
    }
    let c = Box::new(Closer {
        key,
        poller: PollerSlot::default(),
    });
    if thread::start_task(c, c"qcow2_backing").is_err() {
        tracing::error!("no poller to close a removed backing bdev: it stays open");
    }
}

/// Waits on the md thread until no channel (nor the owner) drains operations to the bdev
/// that left, then closes its descriptor.
struct Closer {
    key: NodeKey,
    poller: PollerSlot,
}

impl Polled for Closer {
    fn slot(&self) -> &PollerSlot {
        &self.poller
    }

    fn poll(&self) -> Poll {
        let reg = registry::lock();
        // Gone: its teardown closes the descriptor (after every channel, so drained).
        let Some(r) = reg.by_key(self.key) else {
            return Poll::Done;
        };
        let owner_draining = r.owner_here().is_some_and(|o| o.backing_settle());
        if r.node().backing_pending() == 0 && !owner_draining {
            Poll::Done
        } else {
            Poll::Idle
        }
    }

    fn finish(self: Box<Self>) {
        closed(self.key);
    }
}

fn closed(key: NodeKey) {
    let reg = registry::lock();
    let Some(r) = reg.by_key(key) else { return };
    let n = r.node();
    let name = n.params().backing_bdev.unwrap_or_default();
    let (desc, again) = n.backing_left();
    if let Some(d) = desc {
        d.close();
    }
    if let Some(b) = n.take_below() {
        b.close();
    }
    tracing::warn!(
        "qcow2 bdev {}: backing bdev {name} released; it is read again once a bdev of that \
         name and size is registered",
        n.name()
    );
    drop(reg);
    if again && bdev::exists(&name) {
        reopen(key, Instant::now() + later::CLAIM_WAIT, None);
    }
}

/// On the md thread: a bdev of the backing bdev's name appeared (its examine held by
/// `hold` until every core reads it, or this gives up).
fn reopen(key: NodeKey, until: Instant, hold: Option<ExamineHold>) {
    let reg = registry::lock();
    let Some(r) = reg.by_key(key) else { return };
    let n = r.node();
    match n.backing_phase() {
        Some(Phase::Missing) => {}
        Some(Phase::Leaving) => {
            // Looked at once the old one has left.
            let _ = n.backing_appeared(Shape { size: 0, align: 0 });
            return;
        }
        _ => return,
    }
    let name = n.params().backing_bdev.unwrap_or_default();
    let desc = match open::open_claimed::<BaseEvents>(&name, "backing", OpenMode::ReadOnly) {
        Ok(d) => d,
        Err((e, m)) => {
            drop(reg);
            if e == libc::EPERM && Instant::now() < until {
                return retry(key, until, hold);
            }
            return tracing::error!("backing bdev {name} is back but cannot be read: {m}");
        }
    };
    let shape = Shape {
        size: desc.size(),
        align: desc.buf_align(),
    };
    match n.backing_appeared(shape) {
        Ok(true) => {}
        Ok(false) => return desc.close(),
        Err(m) => {
            tracing::error!(
                "qcow2 bdev {}: a bdev named {name} was registered, but {m}: not read",
                n.name()
            );
            return desc.close();
        }
    }
    // The cache of this bdev (its UUID): never the granules of the one that left, unless
    // it is the same bdev.
    let cache = crate::golden::cache_for(&desc, n.params().backing_cache_bytes());
    n.backing_opened(desc, cache);
    if let Some(o) = r.owner_here() {
        n.with_backing(|d, c, g| o.backing_join(d, c, g));
    }
    passes::started(key);
    r.for_each_channel((key, hold), join_step, joined);
}

fn join_step(it: ChannelIter, (key, _): &mut (NodeKey, Option<ExamineHold>)) {
    let key = *key;
    it.with_channel(|ch, it| {
        if let Some(r) = registry::lock().by_key(key) {
            r.node().with_backing(|d, c, g| ch.backing_join(d, c, g));
        }
        it.next(0);
    });
}

fn joined((key, _hold): (NodeKey, Option<ExamineHold>), _: c_int) {
    if let Some(gone) = passes::ended(key) {
        return gone.unregister_device();
    }
    let reg = registry::lock();
    let Some(r) = reg.by_key(key) else { return };
    if r.node().backing_joined() {
        // Removed again meanwhile.
        return start_leaving(r, key);
    }
    tracing::info!(
        "qcow2 bdev {}: backing bdev {} is back: reads go through it again",
        r.node().name(),
        r.node().params().backing_bdev.unwrap_or_default()
    );
}

/// Tries a refused claim again shortly.
fn retry(key: NodeKey, until: Instant, hold: Option<ExamineHold>) {
    let state = (key, until, hold);
    if later::retry_claim(c"qcow2_backing", state, |(k, u, h)| reopen(k, u, h)).is_err() {
        tracing::error!("no poller to claim a returning backing bdev again");
    }
}

/// Events of base and backing bdevs.
pub(super) struct BaseEvents;

impl bdev::BdevEvents for BaseEvents {
    /// Hot remove of a base bdev: unregister every node on it (its I/O completes, then
    /// destruct closes the descriptors, which lets the base go). Hot remove of a backing
    /// bdev: the nodes reading it go on without it until it returns (`hotplug.rs`).
    fn event(ty: sys::spdk_bdev_event_type, name: &str) {
        if ty == sys::SPDK_BDEV_EVENT_RESIZE {
            // Sizes are read live (`BaseIo::num_blocks`): allocations that failed for room
            // succeed from now on.
            tracing::info!(
                "bdev {name} was resized: qcow2 images on it may grow into the new size"
            );
            // Their space thresholds follow the new size.
            let reg = registry::lock();
            for (_, r) in reg.nodes.iter() {
                if r.node().params().base_bdev == name {
                    if let Some(o) = r.owner_here() {
                        o.watch_space();
                    }
                }
            }
            return;
        }
        if ty != sys::SPDK_BDEV_EVENT_REMOVE {
            tracing::info!("bdev {name}: event {ty} ignored");
            return;
        }
        let victims: Vec<String> = registry::lock()
            .nodes
            .iter()
            .filter(|(_, r)| r.node().params().base_bdev == name)
            .map(|(n, _)| n.clone())
            .collect();
        removed(name);
        for v in victims {
            tracing::warn!("bdev {name} is going away: unregistering the qcow2 bdev on it");
            // A second unregistration (a delete already under way) is refused by SPDK.
            let _ = bdev::unregister_by_name(&v, |_| {});
        }
    }
}
