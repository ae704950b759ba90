//! The keyed cipher: the AES round keys of both XTS halves.

use crate::ffi::Cpu;
use crate::schedule::Schedule;

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
