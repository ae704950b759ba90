//! Whether read-ahead can pay on this base at all ([`SyncProbe`]): a base whose reads are
//! over as soon as their submission returns (a file in the page cache or on tmpfs, read by
//! a kernel copy inside the submitting call) has no latency for the ring to hide, and every
//! byte the ring serves costs a second copy there.

use std::time::{Duration, Instant};

/// Read-aheads timed per verdict.
pub const SAMPLE: u32 = 16;

/// A base is synchronous when the quickest read-ahead of a sample completed in less than
/// this many times the quickest submission of the sample.
pub const RATIO: u32 = 2;

/// How long a synchronous base goes without read-ahead before the probe looks again: a
/// base can change (a page cache that stops holding the file), and one look costs one
/// sample of read-aheads.
pub const RECHECK: Duration = Duration::from_secs(10);

/// Withheld read-aheads between two reads of the clock.
const WITHHELD_PER_CLOCK: u32 = 1024;

/// Times the ring's read-aheads on one core: how long each one's submission took (the
/// time the base spent inside it) against how long until it completed. Every [`SAMPLE`]
/// read-aheads it gives a verdict; once the quickest completion came within [`RATIO`]
/// times the quickest submission, the base is synchronous, and read-aheads are withheld
/// for [`RECHECK`], when a new sample decides again. The quickest of each, not means: under
/// a deep queue a completion waits for the host's other work before it is seen, and a
/// preempted core makes a submission look long; the quickest is the one that waited least.
#[derive(Debug)]
pub struct SyncProbe {
    on: bool,
    fills: u32,
    submit: Option<Duration>,
    latency: Option<Duration>,
    synchronous: bool,
    /// When the base was last found synchronous, and read-aheads withheld since.
    since: Option<Instant>,
    withheld: u32,
    recheck: Duration,
}

impl Default for SyncProbe {
    fn default() -> Self {
        SyncProbe {
            on: false,
            fills: 0,
            submit: None,
            latency: None,
            synchronous: false,
            since: None,
            withheld: 0,
            recheck: RECHECK,
        }
    }
}

impl SyncProbe {
    /// Starts timing (a probe that is not on records nothing and never finds the base
    /// synchronous: hosts whose test devices complete inside their submission keep the ring).
    pub fn turn_on(&mut self) {
        self.on = true;
    }

    /// Whether it is timing read-aheads.
    pub fn is_on(&self) -> bool {
        self.on && !self.synchronous
    }

    /// A read-ahead whose submission took `submit` completed `latency` after it was
    /// submitted. True when this made the base synchronous.
    pub fn record(&mut self, submit: Duration, latency: Duration) -> bool {
        if !self.is_on() {
            return false;
        }
        self.fills += 1;
        let least = |d: Option<Duration>, x: Duration| Some(d.map_or(x, |d| d.min(x)));
        self.submit = least(self.submit, submit);
        self.latency = least(self.latency, latency);
        if self.fills < SAMPLE {
            return false;
        }
        let (submit, latency) = (self.submit.take(), self.latency.take());
        self.fills = 0;
        self.synchronous = latency.unwrap_or_default() < submit.unwrap_or_default() * RATIO;
        if self.synchronous {
            self.since = Some(Instant::now());
            self.withheld = 0;
        }
        self.synchronous
    }

    /// Whether the base was found synchronous (at the last verdict).
    pub fn synchronous(&self) -> bool {
        self.synchronous
    }

    /// Whether a read-ahead is withheld: the base is synchronous. Once [`RECHECK`] has
    /// passed (looked at every so many withheld read-aheads, not on each), it lets this
    /// one through, and the read-aheads from there on are timed for a new verdict.
    pub fn withholds(&mut self) -> bool {
        if !self.synchronous {
            return false;
        }
        self.withheld += 1;
        if !self.withheld.is_multiple_of(WITHHELD_PER_CLOCK)
            || self.since.is_some_and(|t| t.elapsed() < self.recheck)
        {
            return true;
        }
        self.synchronous = false;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn a_base_that_completes_inside_its_submission_is_synchronous() {
        let mut p = SyncProbe::default();
        p.turn_on();
        for i in 1..SAMPLE {
            assert!(
                !p.record(20 * US, 23 * US),
                "no verdict before {SAMPLE} ({i})"
            );
        }
        assert!(p.record(20 * US, 23 * US));
        assert!(p.synchronous() && !p.is_on());
        assert!(!p.record(20 * US, 23 * US), "found once");
    }

    #[test]
    fn a_synchronous_base_is_looked_at_again_once_recheck_has_passed() {
        let mut p = SyncProbe::default();
        p.turn_on();
        let sample = |p: &mut SyncProbe, submit: u32, latency: u32| {
            (0..SAMPLE).fold(false, |_, _| p.record(submit * US, latency * US))
        };
        assert!(sample(&mut p, 20, 23));
        // Ten seconds have not passed: withheld, the clock read once per 1,024.
        assert!((0..3 * WITHHELD_PER_CLOCK).all(|_| p.withholds()));
        // Once they have, the next look lets one through, timed again.
        p.recheck = Duration::ZERO;
        let through = (1..=WITHHELD_PER_CLOCK).find(|_| !p.withholds());
        assert_eq!(through, Some(WITHHELD_PER_CLOCK));
        assert!(p.is_on() && !p.synchronous());
        // Still synchronous: found again, withheld again.
        assert!(sample(&mut p, 20, 23));
        assert!(p.withholds());
        while p.withholds() {}
        // Now a device (the page cache let the file go): read-ahead stays on.
        assert!(!sample(&mut p, 25, 130));
        assert!(!p.synchronous() && p.is_on());
        assert!((0..2 * WITHHELD_PER_CLOCK).all(|_| !p.withholds()));
    }

    #[test]
    fn a_synchronous_base_under_a_deep_queue_is_found_by_its_quickest_completion() {
        let mut p = SyncProbe::default();
        p.turn_on();
        // 20 us submissions whose completions wait behind the host's other requests.
        for i in 0..SAMPLE {
            let seen = if i == 5 { 24 } else { 60 + 10 * i };
            p.record(20 * US, seen * US);
        }
        assert!(p.synchronous());
    }

    #[test]
    fn a_device_whose_reads_outlast_their_submission_is_not() {
        let mut p = SyncProbe::default();
        p.turn_on();
        // A disk behind O_DIRECT: 25 us to submit, 130 us to complete; an NVMe namespace:
        // 2 us and 40 us. A few slow submissions (a preempted core) do not tip it.
        for round in 0..4 {
            for i in 0..SAMPLE {
                let (s, l) = match (round, i % 8) {
                    (0, _) => (25 * US, 130 * US),
                    (_, 0) => (200 * US, 210 * US),
                    _ => (2 * US, 40 * US),
                };
                assert!(!p.record(s, l));
            }
        }
        assert!(!p.synchronous() && p.is_on());
    }

    #[test]
    fn a_probe_not_turned_on_finds_nothing() {
        let mut p = SyncProbe::default();
        for _ in 0..2 * SAMPLE {
            assert!(!p.record(20 * US, 20 * US));
        }
        assert!(!p.synchronous());
    }
}
