//! The last step of an external snapshot: read-only claims on the old base (for the
//! read-only bdev) and on the read-only bdev (for the overlay), retried while other modules
//! examine the new bdev.

use crate::ffi::thread::{self, Poll, Polled, PollerSlot};
use crate::node::Under;
use crate::registry;
use std::time::Instant;

/// Claims the old base for the read-only bdev now that no writer holds it, and the
/// read-only bdev for the overlay (as `bdev_qcow2_create` claims its backing bdev). Other
/// modules examine the new bdev meanwhile, some with a descriptor open for writing, which a
/// read-only claim cannot coexist with: each claim is tried again on every poll for a while.
struct ClaimSnapshot {
    /// The overlay's bdev and the read-only bdev.
    name: String,
    snap: String,
    /// Which of the two claims (old base, read-only bdev) are still to take.
    left: std::cell::Cell<[bool; 2]>,
    /// The next try (SPDK logs each refusal) and the last.
    next: std::cell::Cell<Instant>,
    until: Instant,
    poller: PollerSlot,
}

/// How long [`ClaimSnapshot`] keeps trying, and how often.
const CLAIM_FOR: std::time::Duration = std::time::Duration::from_secs(5);
const CLAIM_EVERY: std::time::Duration = std::time::Duration::from_millis(5);

impl Polled for ClaimSnapshot {
    fn slot(&self) -> &PollerSlot {
        &self.poller
    }

    fn poll(&self) -> Poll {
        let now = Instant::now();
        if now < self.next.get() {
            return Poll::Idle;
        }
        self.next.set(now + CLAIM_EVERY);
        let reg = registry::lock();
        // The old base (the read-only bdev's), then the read-only bdev (the overlay's
        // backing).
        let claims = [(&self.snap, Under::Base), (&self.name, Under::Backing)];
        let mut left = self.left.get();
        let late = Instant::now() > self.until;
        for (i, (name, which)) in claims.into_iter().enumerate() {
            if !left[i] {
                continue;
            }
            match reg.node(name).and_then(|n| n.node().claim_read_only(which)) {
                None | Some(Ok(())) => left[i] = false,
                Some(Err((e, bdev))) if late => {
                    tracing::warn!("bdev_qcow2_snapshot_external: cannot claim bdev {bdev} read-only (errno {e})");
                    left[i] = false;
                }
                Some(Err(_)) => {}
            }
        }
        self.left.set(left);
        if left == [false, false] {
            Poll::Done
        } else {
            Poll::Idle
        }
    }
}

pub(super) fn claim_snapshot(name: &str, snap: &str) {
    let job = Box::new(ClaimSnapshot {
        name: name.to_owned(),
        snap: snap.to_owned(),
        left: std::cell::Cell::new([true, true]),
        next: std::cell::Cell::new(Instant::now()),
        until: Instant::now() + CLAIM_FOR,
        poller: PollerSlot::default(),
    });
    if thread::start_task(job, c"qcow2_claim").is_err() {
        tracing::warn!(
            "bdev_qcow2_snapshot_external: no poller to claim {snap}: it stays unclaimed"
        );
    }
}
