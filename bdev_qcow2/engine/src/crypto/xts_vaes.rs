//! XTS over whole 512-byte sectors on a CPU with AVX-512 and VAES, in any build: the
//! `vaes_xts` crate checks the CPU at run time and runs each sector in one pass (tweaks in
//! AVX-512, AES with VAES, four blocks a register). Its round keys are immutable, so one
//! keyed cipher serves every thread, with no per-thread state and no lock.

/// Sectors whose IVs are made in one call (the crate runs AES-k2 over four at a time).
const CHUNK: usize = 16;

/// XTS-AES-128 or -256 with VAES and AVX-512.
pub(super) struct VaesXts(vaes_xts::Xts);

impl VaesXts {
    /// `key` both halves (32 or 64 bytes); `None` on a CPU without AES-NI, VAES and
    /// AVX-512 (F, BW), or for a key of another length.
    pub(super) fn new(key: &[u8]) -> Option<Self> {
        vaes_xts::Xts::new(key).map(VaesXts)
    }

    /// Encrypts (`enc`) or decrypts `data` (whole sectors) in place; `iv(i, out)` writes
    /// the IVs of its sectors `i`, `i + 1`, … into `out`.
    pub(super) fn run(&self, data: &mut [u8], iv: &dyn Fn(u64, &mut [[u8; 16]]), enc: bool) {
        for (c, chunk) in data.chunks_mut(CHUNK * vaes_xts::SECTOR_BYTES).enumerate() {
            let n = chunk.len() / vaes_xts::SECTOR_BYTES;
            let mut ivs = [[0u8; 16]; CHUNK];
            iv((c * CHUNK) as u64, &mut ivs[..n]);
            self.0.run(chunk, &ivs[..n], enc);
        }
    }
}
