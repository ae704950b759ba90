//! The background write-back's timer: dirty metadata that stays unchanged, waiting for a
//! flush, is written back by the owner on its own.
//!
//! Invariant: at most one background write-back runs; one is due only when the dirty
//! metadata's change signature stayed the same for [`BACKGROUND_WRITEBACK_INTERVAL`]
//! (after a failure, for [`BACKGROUND_RETRY_DELAY`] more).

use std::time::{Duration, Instant};

/// How long dirty metadata must stay unchanged, waiting for a flush, before the owner
/// writes it back on its own: while the owner holds a slice dirty, every core sends it the
/// writes into that slice's clusters, even overwrites.
pub const BACKGROUND_WRITEBACK_INTERVAL: Duration = Duration::from_millis(10);
/// How long a failed background write-back waits before the next attempt.
const BACKGROUND_RETRY_DELAY: Duration = Duration::from_secs(1);

/// What changes whenever metadata is allocated or newly dirtied: (clusters allocated,
/// dirty L2 slices, dirty refcount blocks).
pub(crate) type ChangeSignature = (u64, usize, usize);

/// The timer's state (see the module doc).
#[derive(Default)]
pub(crate) struct BackgroundTimer {
    /// Since when the dirty metadata has not changed, and its signature then.
    quiet: Option<(Instant, ChangeSignature)>,
    /// A background write-back task is running.
    running: bool,
}

impl BackgroundTimer {
    /// Whether a background write-back is due, with `dirty` telling whether anything is
    /// dirty and `sig` the change signature now. Reads the clock only when something is
    /// dirty and none is running.
    pub(crate) fn due(&mut self, dirty: bool, sig: ChangeSignature) -> bool {
        if self.running || !dirty {
            self.quiet = None;
            return false;
        }
        let now = Instant::now();
        match self.quiet {
            Some((since, s)) if s == sig => {
                now.duration_since(since) >= BACKGROUND_WRITEBACK_INTERVAL
            }
            _ => {
                self.quiet = Some((now, sig));
                false
            }
        }
    }
    /// A background write-back starts.
    pub(crate) fn start(&mut self) {
        self.running = true;
        self.quiet = None;
    }
    /// It ended; `failed` with the signature then: the next attempt waits longer (a
    /// failing device must not be retried, and logged, a hundred times a second).
    pub(crate) fn finish(&mut self, failed: Option<ChangeSignature>) {
        self.running = false;
        if let Some(sig) = failed {
            self.quiet = Some((Instant::now() + BACKGROUND_RETRY_DELAY, sig));
        }
    }
}
