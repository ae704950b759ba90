//! The keyed cipher: the AES round keys of both XTS halves, cleared when dropped.

use crate::ffi::Cpu;
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

/// Both halves of an XTS key: the data key `k1` (both directions), the tweak key `k2`
/// (encryption only).
pub(crate) struct Keyed {
    cpu: Cpu,
    k1_enc: Schedule,
    k1_dec: Schedule,
    k2_enc: Schedule,
}

impl Keyed {
    /// `key` both halves, 32 or 64 bytes.
    pub(crate) fn new(cpu: Cpu, key: &[u8]) -> Option<Keyed> {
        if key.len() != 32 && key.len() != 64 {
            return None;
        }
        let (k1, k2) = key.split_at(key.len() / 2);
        let (k1_enc, k1_dec) = cpu.expand(k1)?;
        let (k2_enc, _) = cpu.expand(k2)?;
        Some(Keyed {
            cpu,
            k1_enc,
            k1_dec,
            k2_enc,
        })
    }

    pub(crate) fn run(&self, data: &mut [u8], ivs: &[[u8; 16]], enc: bool) {
        let k1 = if enc { &self.k1_enc } else { &self.k1_dec };
        self.cpu.xts(k1, &self.k2_enc, data, ivs, enc);
    }
}
