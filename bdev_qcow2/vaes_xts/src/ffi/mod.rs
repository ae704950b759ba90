//! The one `unsafe` of the crate: calling the kernel's `#[target_feature]` functions from
//! code compiled without those features, once the CPU has been checked.

#![allow(unsafe_code)]

use crate::kernel;
use crate::schedule::Schedule;

/// Proof that this CPU has AES-NI, VAES and AVX-512 F/BW (checked by `detect`, the only
/// way to make one).
#[derive(Clone, Copy)]
pub(crate) struct Cpu(());

impl Cpu {
    /// `Some` where the CPU has every feature the kernel is compiled for.
    pub(crate) fn detect() -> Option<Cpu> {
        let ok = std::is_x86_feature_detected!("aes")
            && std::is_x86_feature_detected!("vaes")
            && std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw");
        ok.then_some(Cpu(()))
    }

    /// The round keys of an AES key (16 or 32 bytes) for encryption and decryption.
    pub(crate) fn expand(self, key: &[u8]) -> Option<(Schedule, Schedule)> {
        // SAFETY: `expand` needs AES-NI (and SSE2, the x86-64 baseline); a `Cpu` exists only
        // once `detect` found it on this CPU.
        unsafe { kernel::expand(key) }
    }

    /// XTS over `data`'s whole sectors with the IVs `ivs` (see `Xts::run`).
    pub(crate) fn xts(
        self,
        k1: &Schedule,
        k2: &Schedule,
        data: &mut [u8],
        ivs: &[[u8; 16]],
        enc: bool,
    ) {
        // SAFETY: the kernel is compiled for AES-NI, VAES and AVX-512 F/BW; a `Cpu` exists
        // only once `detect` found all of them on this CPU. It touches only the slices given.
        unsafe {
            if enc {
                kernel::xts::<true>(k1, k2, data, ivs)
            } else {
                kernel::xts::<false>(k1, k2, data, ivs)
            }
        }
    }
}
