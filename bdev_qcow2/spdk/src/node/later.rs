//! A claim SPDK refused for a moment (another module's examine holds the bdev), tried again
//! shortly on the same thread: one task poller that waits, then hands its state on (also
//! the examine's channel hold, let go after a while).

use crate::ffi::thread::{self, Poll, Polled, PollerSlot};
use std::ffi::CStr;
use std::time::{Duration, Instant};

/// How long a claim SPDK refuses (`EPERM`) is tried again: another module's examine of a
/// bdev just registered holds it open for writing for a moment (lvol's does), as when a
/// saved config creates a qcow2 bdev over one it has just created, or a golden bdev returns.
pub(super) const CLAIM_WAIT: Duration = Duration::from_secs(2);
/// How long a refused claim waits before it is tried again.
pub(super) const CLAIM_RETRY: Duration = Duration::from_millis(10);

struct Later<S: 'static> {
    at: Instant,
    state: S,
    then: fn(S),
    poller: PollerSlot,
}

impl<S: 'static> Polled for Later<S> {
    fn slot(&self) -> &PollerSlot {
        &self.poller
    }

    fn poll(&self) -> Poll {
        if Instant::now() < self.at {
            Poll::Idle
        } else {
            Poll::Done
        }
    }

    fn finish(self: Box<Self>) {
        let l = *self;
        (l.then)(l.state)
    }
}

/// Runs `then(state)` on this thread once [`CLAIM_RETRY`] has passed; `Err(state)` when no
/// poller could be registered.
pub(super) fn retry_claim<S: 'static>(name: &CStr, state: S, then: fn(S)) -> Result<(), S> {
    after(CLAIM_RETRY, name, state, then)
}

/// Runs `then(state)` on this thread once `delay` has passed; `Err(state)` when no poller
/// could be registered.
pub(crate) fn after<S: 'static>(
    delay: Duration,
    name: &CStr,
    state: S,
    then: fn(S),
) -> Result<(), S> {
    let l = Box::new(Later {
        at: Instant::now() + delay,
        state,
        then,
        poller: PollerSlot::default(),
    });
    thread::start_task(l, name).map(|_| ()).map_err(|l| l.state)
}
