//! Where a node's backing bdev is in its hot-removal and return (ARCHITECTURE.md §15,
//! "Degraded mode"): a small state machine the md thread drives, with no SPDK in it, so its
//! rules are tested on their own.
//!
//! - `Present`: the descriptor is open and every core reads through it.
//! - `Leaving`: SPDK said the bdev is going; every core is switching its device of it to
//!   a missing one (reads fail) and draining what it had in flight. Channels created now are
//!   built missing. The descriptor closes when the last core has drained.
//! - `Missing`: the descriptor is closed; reads that need the bdev fail. A bdev registered
//!   under its name with the same size and no stricter alignment is opened again.
//! - `Returning`: the new descriptor is open; every core is taking a device of it.
//!
//! A removal while returning waits for the return to finish, then leaves again; a bdev
//! that comes back while the old one is still leaving is looked at once it has left.
//!
//! A backing bdev missing when the node is created starts `Missing` with its size not
//! known: the first bdev of its name is taken whatever its size (the chain's backing layer
//! has the image's virtual size, and reads past a bdev's end read zeros); later returns
//! must have the size it had.

/// The phase of the backing bdev of one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Open, read through.
    Present,
    /// Hot-removed: the cores are leaving it.
    Leaving,
    /// Gone: reads that need it fail.
    Missing,
    /// Back and open: the cores are taking it.
    Returning,
}

impl Phase {
    /// The name `bdev_get_bdevs` and `bdev_qcow2_get_stats` show.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Present => "present",
            Phase::Leaving => "leaving",
            Phase::Missing => "missing",
            Phase::Returning => "returning",
        }
    }
}

/// What a returning bdev must be like to be read in place of the one that left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Size in bytes: the chain's backing layer has this size.
    pub size: u64,
    /// Buffer alignment it needs: the bdev registered asking for at most this much.
    pub align: usize,
}

/// The backing bdev's state (see the module's documentation).
#[derive(Debug, Clone)]
pub struct Link {
    phase: Phase,
    /// Bumped at each return: a core whose device was opened under this generation has
    /// already taken the current descriptor.
    generation: u64,
    shape: Shape,
    /// Removed again while returning.
    removed_again: bool,
    /// A bdev of its name appeared while the old one was leaving.
    appeared_meanwhile: bool,
    /// The bdev's size is known (it was open once): a returning bdev must have it.
    size_known: bool,
}

impl Link {
    /// A backing bdev of `shape`, open.
    pub fn present(shape: Shape) -> Link {
        Link {
            phase: Phase::Present,
            generation: 1,
            shape,
            removed_again: false,
            appeared_meanwhile: false,
            size_known: true,
        }
    }

    /// A backing bdev missing when the node was created: `shape` is what the node asks of
    /// it, its size the image's virtual size (any size is taken when it first appears).
    pub fn missing(shape: Shape) -> Link {
        Link {
            phase: Phase::Missing,
            generation: 0,
            size_known: false,
            ..Link::present(shape)
        }
    }

    /// Its phase.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Whether cores read through the descriptor open now (`Present`, or `Returning`: a
    /// channel built meanwhile takes the returning bdev at once).
    pub fn readable(&self) -> bool {
        matches!(self.phase, Phase::Present | Phase::Returning)
    }

    /// The generation of the descriptor open now (meaningful while `Present` or
    /// `Returning`).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// What the bdev was when it left.
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// SPDK reports the bdev removed: `true` when the cores must leave it now.
    pub fn removed(&mut self) -> bool {
        match self.phase {
            Phase::Present => {
                self.phase = Phase::Leaving;
                true
            }
            Phase::Returning => {
                self.removed_again = true;
                false
            }
            Phase::Leaving | Phase::Missing => false,
        }
    }

    /// Every core left and drained (the descriptor is to be closed now): `true` when a bdev
    /// of its name appeared meanwhile and should be looked at.
    pub fn left(&mut self) -> bool {
        debug_assert_eq!(self.phase, Phase::Leaving);
        self.phase = Phase::Missing;
        std::mem::take(&mut self.appeared_meanwhile)
    }

    /// A bdev of its name was registered, of shape `found`: `Ok(true)` to open it now,
    /// `Ok(false)` when there is nothing to do (yet), `Err` when it cannot stand in for the
    /// one that left (a message saying why).
    pub fn appeared(&mut self, found: Shape) -> Result<bool, String> {
        match self.phase {
            Phase::Missing => {
                if self.size_known && found.size != self.shape.size {
                    return Err(format!(
                        "it has {} bytes where the backing bdev that left had {}",
                        found.size, self.shape.size
                    ));
                }
                if found.align > self.shape.align {
                    return Err(format!(
                        "it needs {}-byte aligned buffers, more than the {} the bdev was \
                         registered with",
                        found.align, self.shape.align
                    ));
                }
                if !std::mem::replace(&mut self.size_known, true) {
                    self.shape.size = found.size;
                }
                Ok(true)
            }
            Phase::Leaving => {
                self.appeared_meanwhile = true;
                Ok(false)
            }
            Phase::Present | Phase::Returning => Ok(false),
        }
    }

    /// The returning bdev is open: the cores take it under the returned generation.
    pub fn opened(&mut self) -> u64 {
        debug_assert_eq!(self.phase, Phase::Missing);
        self.phase = Phase::Returning;
        self.generation += 1;
        self.generation
    }

    /// Every core took the returning bdev: `true` when it was removed meanwhile and the
    /// cores must leave it again (the phase is then `Leaving`).
    pub fn joined(&mut self) -> bool {
        debug_assert_eq!(self.phase, Phase::Returning);
        if std::mem::take(&mut self.removed_again) {
            self.phase = Phase::Leaving;
            return true;
        }
        self.phase = Phase::Present;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: Shape = Shape {
        size: 1 << 30,
        align: 4096,
    };

    #[test]
    fn removal_leaves_then_closes_and_a_return_of_the_same_shape_reopens() {
        let mut l = Link::present(SHAPE);
        assert!(l.removed());
        assert_eq!(l.phase(), Phase::Leaving);
        // A second event (another descriptor of the same bdev) changes nothing.
        assert!(!l.removed());
        assert!(!l.left());
        assert_eq!(l.phase(), Phase::Missing);
        assert_eq!(l.appeared(SHAPE), Ok(true));
        let g = l.opened();
        assert_eq!(g, 2);
        assert_eq!(l.phase(), Phase::Returning);
        assert!(!l.joined());
        assert_eq!(l.phase(), Phase::Present);
        assert_eq!(l.generation(), 2);
    }

    #[test]
    fn a_bdev_of_another_size_or_stricter_alignment_is_refused() {
        let mut l = Link::present(SHAPE);
        l.removed();
        l.left();
        let bigger = Shape {
            size: SHAPE.size * 2,
            ..SHAPE
        };
        assert!(l.appeared(bigger).unwrap_err().contains("bytes"));
        let stricter = Shape {
            align: 1 << 16,
            ..SHAPE
        };
        assert!(l.appeared(stricter).unwrap_err().contains("aligned"));
        assert_eq!(l.phase(), Phase::Missing);
        // A looser alignment is fine.
        let looser = Shape { align: 1, ..SHAPE };
        assert_eq!(l.appeared(looser), Ok(true));
    }

    #[test]
    fn a_return_while_leaving_is_looked_at_once_left() {
        let mut l = Link::present(SHAPE);
        l.removed();
        assert_eq!(l.appeared(SHAPE), Ok(false));
        assert!(l.left());
        // Only once.
        l.appeared(SHAPE).unwrap();
        l.opened();
        l.joined();
        l.removed();
        assert!(!l.left());
    }

    #[test]
    fn a_removal_while_returning_leaves_again_once_joined() {
        let mut l = Link::present(SHAPE);
        l.removed();
        l.left();
        l.opened();
        assert!(!l.removed());
        assert_eq!(l.phase(), Phase::Returning);
        assert!(l.joined());
        assert_eq!(l.phase(), Phase::Leaving);
        assert!(!l.left());
        assert_eq!(l.phase(), Phase::Missing);
    }

    #[test]
    fn a_bdev_missing_at_creation_is_taken_at_any_size_once_then_must_keep_it() {
        let mut l = Link::missing(SHAPE);
        assert_eq!(l.phase(), Phase::Missing);
        assert!(!l.readable());
        let stricter = Shape {
            align: 1 << 16,
            ..SHAPE
        };
        assert!(l.appeared(stricter).unwrap_err().contains("aligned"));
        let smaller = Shape {
            size: SHAPE.size / 2,
            ..SHAPE
        };
        assert_eq!(l.appeared(smaller), Ok(true));
        assert_eq!(l.opened(), 1);
        assert!(!l.joined());
        assert_eq!(l.phase(), Phase::Present);
        assert_eq!(l.shape(), smaller);
        l.removed();
        l.left();
        assert!(l.appeared(SHAPE).unwrap_err().contains("bytes"));
        assert_eq!(l.appeared(smaller), Ok(true));
    }

    #[test]
    fn nothing_happens_to_a_present_bdev_that_appears_again() {
        let mut l = Link::present(SHAPE);
        assert_eq!(l.appeared(SHAPE), Ok(false));
        assert_eq!(l.phase(), Phase::Present);
        assert_eq!(l.generation(), 1);
    }
}
