//! XTS-AES-128/256 over whole 512-byte sectors (IEEE 1619, as dm-crypt and QEMU's LUKS use
//! it) with VAES and AVX-512, for any build: the CPU is checked at run time, once, when a
//! key is set ([`Xts::new`] is `None` on a CPU without them, or off x86-64).
//!
//! Why a crate of its own: calling a `#[target_feature]` function from code compiled
//! without those features needs `unsafe`, which the engine forbids. Here that call is the
//! only `unsafe` (`ffi/`: a [`ffi::Cpu`] exists only once the CPU has been checked); the
//! kernel itself is safe Rust over `core::arch`'s intrinsics, each in a function with the
//! features enabled, so the whole sector loop compiles for them and inlines (RustCrypto's
//! `aes` 0.9 run-time-detected VAES backend does not inline its batches into its callers,
//! and runs AES-256 at under half this speed).
//!
//! One pass per sector, as OpenSSL's assembly does: its 32 tweaks made in eight 512-bit
//! registers, each block XORed with its tweak and the first round key at once, the rounds,
//! and the tweak folded into the last round key.

#![deny(unsafe_code)]

#[cfg(target_arch = "x86_64")]
mod ffi;
#[cfg(target_arch = "x86_64")]
mod kernel;
#[cfg(target_arch = "x86_64")]
mod keys;
#[cfg(target_arch = "x86_64")]
mod schedule;
#[cfg(test)]
mod tests;

/// The bytes of a sector, XTS's data unit here.
pub const SECTOR_BYTES: usize = 512;

/// A keyed XTS-AES cipher on a CPU with VAES and AVX-512. Immutable: one may serve every
/// thread. Its round keys are cleared when it is dropped.
pub struct Xts {
    #[cfg(target_arch = "x86_64")]
    inner: keys::Keyed,
}

impl std::fmt::Debug for Xts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Xts(..)")
    }
}

impl Xts {
    /// Keys XTS with `key`, both halves (32 bytes: AES-128, 64: AES-256); `None` on a CPU
    /// without AES-NI, VAES and AVX-512 (F, BW), or for a key of another length.
    pub fn new(key: &[u8]) -> Option<Xts> {
        #[cfg(target_arch = "x86_64")]
        {
            let cpu = ffi::Cpu::detect()?;
            keys::Keyed::new(cpu, key).map(|inner| Xts { inner })
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = key;
            None
        }
    }

    /// Encrypts (`enc`) or decrypts `data` in place, sector `i` (512 bytes) with the IV
    /// `ivs[i]` (before AES-k2: the sector's number, as `plain64` makes it). Sectors beyond
    /// `ivs` and a partial last sector are left as they are.
    pub fn run(&self, data: &mut [u8], ivs: &[[u8; 16]], enc: bool) {
        #[cfg(target_arch = "x86_64")]
        self.inner.run(data, ivs, enc);
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (data, ivs, enc);
    }
}
