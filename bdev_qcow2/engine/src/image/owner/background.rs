//! The background write-back and its timer: dirty metadata that stays unchanged, waiting
//! for a flush, is written back by the owner on its own.
//!
//! Invariant: at most one background write-back runs; one is due only when the dirty
//! metadata's change signature stayed the same, with no allocation in flight, for the
//! current quiet interval as the owner's poll loop saw it (after a failure, for
//! [`BACKGROUND_RETRY_DELAY`] more). The interval starts at
//! [`BACKGROUND_WRITEBACK_INTERVAL`] and doubles, up to [`BACKGROUND_WRITEBACK_MAX`], each
//! time allocations resume within [`BACKGROUND_WRITEBACK_MAX`] of a write-back's end (the
//! pause was a dip in a stream of allocations, e.g. a throttled disk holding the guest's
//! writes back, not the end of it); a write-back followed by a longer quiet starts it over.
//!
//! A quiet is what the poll loop observed (#48): allocations waiting for their data writes
//! are a stream, not a pause, and a gap between two checks longer than
//! [`MAX_OBSERVED_GAP`] is the owner's thread not running (descheduled on a loaded
//! machine), which counts for that much only. Without both, first writes into a fresh
//! image on a shared machine started a write-back of thousands of slices under the metadata
//! lock every few hundred milliseconds, stalling every allocating write meanwhile.

use super::Owner;
use crate::error::Result;
use crate::io::BlockDevice;
use std::time::{Duration, Instant};

/// How long dirty metadata must stay unchanged, waiting for a flush, before the owner
/// writes it back on its own (at first, and again after a long quiet): while the owner
/// holds a slice dirty, every core sends it the writes into that slice's clusters it does
/// not see allocated in its copy.
pub const BACKGROUND_WRITEBACK_INTERVAL: Duration = Duration::from_millis(10);
/// The longest quiet interval: where allocations keep resuming soon after each write-back,
/// each write-back costs the disk more than the cores gain (a disk that limits its I/Os
/// per second pauses the guest's writes every few milliseconds).
pub const BACKGROUND_WRITEBACK_MAX: Duration = Duration::from_secs(1);
/// How long a failed background write-back waits before the next attempt.
const BACKGROUND_RETRY_DELAY: Duration = Duration::from_secs(1);
/// The most one gap between two checks adds to a quiet: a poll loop checks every few
/// microseconds (SPDK: every 16 polls), so a longer gap is time the owner did not run.
pub(crate) const MAX_OBSERVED_GAP: Duration = Duration::from_millis(1);

/// What changes whenever metadata is allocated or newly dirtied: (clusters allocated,
/// dirty L2 slices, dirty refcount blocks).
pub(crate) type ChangeSignature = (u64, usize, usize);

/// A quiet in progress: the signature it keeps, how much of it the loop observed, and
/// when it last checked.
#[derive(Clone, Copy)]
struct Quiet {
    sig: ChangeSignature,
    observed: Duration,
    last: Instant,
}

/// The timer's state (see the module doc).
pub(crate) struct BackgroundTimer {
    /// The quiet in progress, if the dirty metadata has not changed since the last check.
    quiet: Option<Quiet>,
    /// After a failed write-back: no next one before this.
    retry_at: Option<Instant>,
    /// A background write-back task is running.
    running: bool,
    /// How long the metadata must stay unchanged before the next write-back.
    interval: Duration,
    /// When the last successful write-back ended, until the metadata is next dirtied.
    ended: Option<Instant>,
}

impl Default for BackgroundTimer {
    fn default() -> Self {
        BackgroundTimer {
            quiet: None,
            retry_at: None,
            running: false,
            interval: BACKGROUND_WRITEBACK_INTERVAL,
            ended: None,
        }
    }
}

/// What the owner's metadata is doing when the timer is asked ([`BackgroundTimer::due`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Activity {
    /// Nothing is dirty.
    Clean,
    /// Something is dirty and an allocation is in flight: a stream, not a pause.
    Allocating,
    /// Something is dirty and nothing is in flight.
    DirtyAndIdle,
}

impl Activity {
    /// The activity of metadata that is `dirty` or not, with an allocation in flight or not.
    pub(crate) fn of(dirty: bool, allocating: bool) -> Activity {
        match (dirty, allocating) {
            (false, _) => Activity::Clean,
            (true, true) => Activity::Allocating,
            (true, false) => Activity::DirtyAndIdle,
        }
    }
}

impl BackgroundTimer {
    /// Whether a background write-back is due, given the metadata's `activity` and `sig`,
    /// its change signature now. Reads the clock only when something is dirty, nothing is
    /// in flight and no write-back is running.
    pub(crate) fn due(&mut self, activity: Activity, sig: ChangeSignature) -> bool {
        if self.running || activity != Activity::DirtyAndIdle {
            self.quiet = None;
            return false;
        }
        self.due_at(Instant::now(), sig)
    }

    /// [`due`](Self::due) at `now`, something being dirty, nothing in flight and no
    /// write-back running.
    fn due_at(&mut self, now: Instant, sig: ChangeSignature) -> bool {
        match &mut self.quiet {
            Some(q) if q.sig == sig => {
                q.observed += now.saturating_duration_since(q.last).min(MAX_OBSERVED_GAP);
                q.last = now;
                q.observed >= self.interval && self.retry_at.is_none_or(|t| now >= t)
            }
            _ => {
                // Dirtied again: how long after the last write-back tells a dip from a
                // pause.
                if let Some(ended) = self.ended.take() {
                    self.interval =
                        if now.saturating_duration_since(ended) < BACKGROUND_WRITEBACK_MAX {
                            (self.interval * 2).min(BACKGROUND_WRITEBACK_MAX)
                        } else {
                            BACKGROUND_WRITEBACK_INTERVAL
                        };
                }
                self.quiet = Some(Quiet {
                    sig,
                    observed: Duration::ZERO,
                    last: now,
                });
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
        self.finish_at(Instant::now(), failed);
    }

    /// [`finish`](Self::finish) at `now`.
    fn finish_at(&mut self, now: Instant, failed: Option<ChangeSignature>) {
        self.running = false;
        match failed {
            Some(sig) => {
                self.quiet = Some(Quiet {
                    sig,
                    observed: Duration::ZERO,
                    last: now,
                });
                self.retry_at = Some(now + BACKGROUND_RETRY_DELAY);
            }
            None => {
                self.ended = Some(now);
                self.retry_at = None;
            }
        }
    }

    /// The quiet interval the next write-back waits for.
    #[cfg(test)]
    fn interval(&self) -> Duration {
        self.interval
    }
}

impl<D: BlockDevice> Owner<'_, D> {
    /// Whether the owner should write its dirty metadata back now without a guest flush:
    /// something is dirty, no background write-back is running, and nothing was allocated
    /// or newly dirtied, nor in flight, for [`BACKGROUND_WRITEBACK_INTERVAL`] as the poll
    /// loop saw it (a write-back holds the metadata lock, so it waits for allocations to
    /// pause rather than stall them). Cheap
    /// when nothing is dirty (no clock read). A host's owner loop asks this and then runs
    /// [`background_writeback`](Self::background_writeback).
    ///
    /// [`BACKGROUND_WRITEBACK_INTERVAL`]: BACKGROUND_WRITEBACK_INTERVAL
    pub(crate) fn background_writeback_pending(&self) -> bool {
        self.meta().st().dirty.has_l2_or_l1()
    }

    pub(crate) fn background_writeback_due(&self) -> bool {
        let mut st = self.meta().st_mut();
        let sig = st.change_signature();
        let activity = Activity::of(st.dirty.has_l2_or_l1(), !st.alloc.inflight().is_empty());
        st.timer.due(activity, sig)
    }

    /// Writes the dirty metadata back in dependency order, as a flush does but without
    /// flushing the device (no guest write becomes stable through it): the owner's dirty
    /// slices become clean, so the cores serve overwrites into them on their own again.
    pub(crate) async fn background_writeback(&self) -> Result<()> {
        let m = self.meta();
        m.st_mut().timer.start();
        let r = {
            let _g = m.lock().lock().await;
            self.writeback_locked().await
        };
        let mut st = m.st_mut();
        // What failed stays dirty for the next flush, which reports it.
        let failed = r.is_err().then(|| st.change_signature());
        st.timer.finish(failed);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Dirties at `t`, stays quiet, and runs the write-back that becomes due: returns when
    /// it was due.
    fn dirty_then_written_back(
        tm: &mut BackgroundTimer,
        t: Instant,
        sig: ChangeSignature,
    ) -> Instant {
        assert!(!tm.due_at(t, sig), "a change starts the quiet interval");
        let mut now = t;
        while !tm.due_at(now, sig) {
            now += MS;
        }
        tm.start();
        tm.finish_at(now + MS, None);
        now
    }

    #[test]
    fn a_lasting_quiet_writes_back_after_the_shortest_interval() {
        let mut tm = BackgroundTimer::default();
        let t0 = Instant::now();
        let due = dirty_then_written_back(&mut tm, t0, (1, 1, 1));
        assert_eq!(due - t0, BACKGROUND_WRITEBACK_INTERVAL);
        // Dirtied again long after: the interval stays the shortest.
        let t1 = due + BACKGROUND_WRITEBACK_MAX * 2;
        let due = dirty_then_written_back(&mut tm, t1, (2, 1, 1));
        assert_eq!(due - t1, BACKGROUND_WRITEBACK_INTERVAL);
    }

    #[test]
    fn allocations_resuming_soon_after_each_write_back_double_the_interval_up_to_the_most() {
        let mut tm = BackgroundTimer::default();
        let mut t = Instant::now();
        let mut waits = Vec::new();
        for n in 0..10 {
            let due = dirty_then_written_back(&mut tm, t, (n, 1, 1));
            waits.push((due - t).as_millis());
            // Allocations resume 5 ms after the write-back.
            t = due + 5 * MS;
        }
        assert_eq!(waits, [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000]);
        // A quiet longer than the longest interval starts over.
        let due = dirty_then_written_back(&mut tm, t + BACKGROUND_WRITEBACK_MAX, (99, 1, 1));
        assert_eq!(
            due - (t + BACKGROUND_WRITEBACK_MAX),
            BACKGROUND_WRITEBACK_INTERVAL
        );
    }

    /// Checks every millisecond from `from` (excluded) until due: returns when.
    fn polled_until_due(tm: &mut BackgroundTimer, from: Instant, sig: ChangeSignature) -> Instant {
        let mut now = from;
        loop {
            now += MS;
            if tm.due_at(now, sig) {
                return now;
            }
        }
    }

    #[test]
    fn changes_while_quiet_restart_the_interval_and_leave_it_as_it_is() {
        let mut tm = BackgroundTimer::default();
        let t = Instant::now();
        assert!(!tm.due_at(t, (1, 1, 1)));
        for ms in 1..=9 {
            assert!(!tm.due_at(t + ms * MS, (1, 1, 1)));
        }
        assert!(
            !tm.due_at(t + 9 * MS, (2, 1, 1)),
            "an allocation restarts it"
        );
        assert_eq!(
            polled_until_due(&mut tm, t + 9 * MS, (2, 1, 1)),
            t + 19 * MS
        );
        assert_eq!(tm.interval(), BACKGROUND_WRITEBACK_INTERVAL);
    }

    #[test]
    fn a_gap_between_checks_counts_as_a_short_quiet_only() {
        let mut tm = BackgroundTimer::default();
        let t = Instant::now();
        assert!(!tm.due_at(t, (1, 1, 1)));
        // The owner did not run for 50 ms: it saw 1 ms of that.
        assert!(!tm.due_at(t + 50 * MS, (1, 1, 1)));
        assert_eq!(
            polled_until_due(&mut tm, t + 50 * MS, (1, 1, 1)),
            t + 59 * MS
        );
    }

    #[test]
    fn allocations_in_flight_are_no_quiet() {
        let mut tm = BackgroundTimer::default();
        let t = Instant::now();
        assert!(!tm.due_at(t, (1, 1, 1)));
        assert!(!tm.due_at(t + 9 * MS, (1, 1, 1)));
        // Every allocation waits for its data write: a stream, not a pause.
        assert!(!tm.due(Activity::Allocating, (1, 1, 1)));
        let now = Instant::now();
        assert!(!tm.due_at(now, (1, 1, 1)), "the quiet starts over");
        assert_eq!(polled_until_due(&mut tm, now, (1, 1, 1)), now + 10 * MS);
    }

    #[test]
    fn a_failed_write_back_waits_a_second_more_and_does_not_change_the_interval() {
        let mut tm = BackgroundTimer::default();
        let t = Instant::now();
        assert!(!tm.due_at(t, (1, 1, 1)));
        let due = polled_until_due(&mut tm, t, (1, 1, 1));
        assert_eq!(due, t + 10 * MS);
        tm.start();
        tm.finish_at(t + 11 * MS, Some((1, 1, 1)));
        let next = polled_until_due(&mut tm, t + 11 * MS, (1, 1, 1));
        assert_eq!(next, t + 11 * MS + BACKGROUND_RETRY_DELAY);
        assert_eq!(tm.interval(), BACKGROUND_WRITEBACK_INTERVAL);
    }

    #[test]
    fn nothing_dirty_or_a_write_back_running_is_never_due() {
        let mut tm = BackgroundTimer::default();
        assert_eq!(Activity::of(false, true), Activity::Clean);
        assert_eq!(Activity::of(true, true), Activity::Allocating);
        assert_eq!(Activity::of(true, false), Activity::DirtyAndIdle);
        assert!(!tm.due(Activity::Clean, (1, 1, 1)));
        tm.start();
        assert!(!tm.due(Activity::DirtyAndIdle, (1, 1, 1)));
    }
}
