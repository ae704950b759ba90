//! The round keys of one AES key in one direction, cleared when dropped.

use zeroize::Zeroize;

/// The round keys of one AES key in one direction (11 for AES-128, 15 for AES-256).
pub(crate) struct Schedule {
    keys: [[u8; 16]; 15],
    rounds: usize,
}

impl Schedule {
    /// An all-zero schedule of `rounds` rounds, for `kernel::expand` to fill.
    pub(crate) fn zeroed(rounds: usize) -> Schedule {
        Schedule {
            keys: [[0; 16]; 15],
            rounds,
        }
    }

    /// Round key `i` (0 ..= rounds).
    pub(crate) fn key(&self, i: usize) -> [u8; 16] {
        self.keys[i]
    }

    /// Sets round key `i`.
    pub(crate) fn set(&mut self, i: usize, k: [u8; 16]) {
        self.keys[i] = k;
    }

    /// 10 (AES-128) or 14 (AES-256).
    pub(crate) fn rounds(&self) -> usize {
        self.rounds
    }
}

impl Drop for Schedule {
    fn drop(&mut self) {
        self.keys.zeroize();
    }
}
