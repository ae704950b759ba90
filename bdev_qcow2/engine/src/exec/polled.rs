//! Which devices a poll visits: every device that may complete something. A chain of a
//! thousand images has a thousand devices, of which a read uses one or two; visiting all
//! of them on every poll would make depth cost on the data path.
//!
//! A device that completes only what the executor submitted to it
//! ([`BlockDevice::completes_only_submitted`](crate::io::BlockDevice::completes_only_submitted))
//! is visited only while it has operations outstanding; any other is visited always.

/// The devices to visit, and what each has outstanding.
#[derive(Default)]
pub(super) struct Polled {
    /// Per device: operations submitted and not yet completed (tracked devices).
    outstanding: Vec<u32>,
    /// Per device: whether it is tracked.
    tracked: Vec<bool>,
    /// Devices visited on every poll: the untracked ones, then the tracked ones with
    /// operations outstanding (from `untracked` on).
    visit: Vec<usize>,
    untracked: usize,
}

impl Polled {
    /// Adds device `dev` (the next index), tracked or not.
    pub(super) fn add(&mut self, dev: usize, tracked: bool) {
        debug_assert_eq!(dev, self.tracked.len());
        self.outstanding.push(0);
        self.tracked.push(tracked);
        if !tracked {
            self.visit.insert(self.untracked, dev);
            self.untracked += 1;
        }
    }

    /// An operation was submitted to `dev`.
    #[inline(always)]
    pub(super) fn submitted(&mut self, dev: usize) {
        if !self.tracked[dev] {
            return;
        }
        if self.outstanding[dev] == 0 {
            self.visit.push(dev);
        }
        self.outstanding[dev] += 1;
    }

    /// The devices visited on every poll (positions `0..untracked().len()` of the visit).
    #[inline(always)]
    pub(super) fn untracked(&self) -> &[usize] {
        &self.visit[..self.untracked]
    }

    /// Every device a poll visits now.
    #[inline(always)]
    pub(super) fn visited(&self) -> &[usize] {
        &self.visit
    }

    /// The device to visit at position `i` of this poll, if any.
    #[inline(always)]
    pub(super) fn at(&self, i: usize) -> Option<usize> {
        self.visit.get(i).copied()
    }

    /// Device `visit[i]` completed `n` operations; returns the position of the next device
    /// to visit (a device with nothing outstanding left is dropped from the list).
    #[inline(always)]
    pub(super) fn completed(&mut self, i: usize, n: u32) -> usize {
        let dev = self.visit[i];
        if !self.tracked[dev] {
            return i + 1;
        }
        let left = self.outstanding[dev].saturating_sub(n);
        self.outstanding[dev] = left;
        if left == 0 {
            self.visit.swap_remove(i);
            i
        } else {
            i + 1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_busy_tracked_devices_are_visited() {
        let mut p = Polled::default();
        p.add(0, true);
        p.add(1, false);
        p.add(2, true);
        assert_eq!(p.at(0), Some(1));
        assert_eq!(p.at(1), None);
        assert_eq!(p.untracked(), &[1]);
        p.submitted(2);
        p.submitted(2);
        p.submitted(0);
        assert_eq!((p.at(0), p.at(1), p.at(2)), (Some(1), Some(2), Some(0)));
        assert_eq!(p.completed(0, 0), 1);
        assert_eq!(p.completed(1, 1), 2);
        assert_eq!(p.completed(2, 1), 2);
        assert_eq!((p.at(1), p.at(2)), (Some(2), None));
        assert_eq!(p.completed(1, 1), 1);
        assert_eq!(p.at(1), None);
    }
}
