//! Whether read-ahead can pay on this base at all ([`SyncProbe`]): a base whose reads are
//! over as soon as their submission returns (a file in the page cache or on tmpfs, read by
//! a kernel copy inside the submitting call) has no latency for the ring to hide, and every
//! byte the ring serves costs a second copy there.

use std::time::Duration;

/// Read-aheads timed per verdict.
pub const SAMPLE: u32 = 16;

/// A base is synchronous when the quickest read-ahead of a sample completed in less than
/// this many times the quickest submission of the sample.
pub const RATIO: u32 = 2;

/// Read-aheads withheld on a synchronous base before the probe looks again (1 GiB of
/// 128 KiB chunks): a base can change (a page cache that stops holding the file), and one
/// look costs one sample of read-aheads.
pub const RECHECK: u32 = 8192;

/// Times the ring's read-aheads on one core: how long each one's submission took (the
/// time the base spent inside it) against how long until it completed. Every [`SAMPLE`]
/// read-aheads it gives a verdict; once the quickest completion came within [`RATIO`]
/// times the quickest submission, the base is synchronous, and read-aheads are withheld
/// until [`RECHECK`] of them were, when a new sample decides again. The quickest of each,
/// not means: under a deep queue a completion waits for the
/// host's other work before it is seen, and a preempted core makes a submission look long;
/// the quickest is the one that waited least.
#[derive(Debug, Default)]
pub struct SyncProbe {
    on: bool,
    fills: u32,
    submit: Option<Duration>,
    latency: Option<Duration>,
    synchronous: bool,
    /// Read-aheads withheld since the base was found synchronous.
    withheld: u32,
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
        self.synchronous
    }

    /// Whether the base was found synchronous (at the last verdict).
    pub fn synchronous(&self) -> bool {
        self.synchronous
    }

    /// Whether a read-ahead is withheld: the base is synchronous. Every [`RECHECK`]-th is
    /// let through instead, and the read-aheads from there on are timed for a new verdict.
    pub fn withholds(&mut self) -> bool {
        if !self.synchronous {
            return false;
        }
        self.withheld += 1;
        if self.withheld < RECHECK {
            return true;
        }
        self.withheld = 0;
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
    fn a_synchronous_base_is_looked_at_again_after_recheck_withheld_read_aheads() {
        let mut p = SyncProbe::default();
        p.turn_on();
        let sample = |p: &mut SyncProbe, submit: u32, latency: u32| {
            (0..SAMPLE).fold(false, |_, _| p.record(submit * US, latency * US))
        };
        assert!(sample(&mut p, 20, 23));
        for i in 1..RECHECK {
            assert!(p.withholds(), "withheld {i}");
        }
        // The RECHECK-th goes out, timed again.
        assert!(!p.withholds() && p.is_on() && !p.synchronous());
        // Still synchronous: found again, withheld again.
        assert!(sample(&mut p, 20, 23));
        assert!(p.withholds());
        for _ in 1..RECHECK {
            p.withholds();
        }
        // Now a device (the page cache let the file go): read-ahead stays on.
        assert!(!sample(&mut p, 25, 130));
        assert!(!p.synchronous() && p.is_on());
        assert!((0..2 * RECHECK).all(|_| !p.withholds()));
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
