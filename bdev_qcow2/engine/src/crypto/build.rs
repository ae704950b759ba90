//! Building a LUKS1 header area with chosen iterations and deterministic "randomness", for
//! tests and fuzz seeds: the real layout (`luks_build.rs`) fed by a seeded generator. Not
//! for real keys.

use super::cipher::CipherSpec;
use super::hash::HashAlg;
use super::luks_build::{assemble, Assembly};

/// What to build.
pub struct LuksBuild<'a> {
    /// `cipher_name` (`aes`, `twofish`, `serpent`, `cast5`), `cipher_mode`.
    pub cipher: (&'a str, &'a str),
    /// `hash_spec`.
    pub hash: HashAlg,
    /// The master key (its length is `key_bytes`).
    pub master_key: &'a [u8],
    /// The secret of slot 0 (the only active slot).
    pub secret: &'a [u8],
    /// PBKDF2 iterations of slot 0 and of the digest.
    pub iterations: u32,
    /// Seed of the salts, the AF stripes and the UUID.
    pub seed: u64,
}

/// The header area's bytes.
///
/// # Panics
/// On a cipher we do not implement (a test's mistake).
#[allow(clippy::expect_used)] // test support
pub fn build(p: &LuksBuild<'_>) -> Vec<u8> {
    let spec = CipherSpec::parse(p.cipher.0, p.cipher.1, p.master_key.len())
        .expect("a cipher we implement");
    let mut seed = p.seed;
    assemble(
        &Assembly {
            cipher_mode: p.cipher.1,
            spec,
            hash: p.hash,
            master_key: p.master_key,
            secret: p.secret,
            slot_iterations: p.iterations,
            mk_iterations: p.iterations,
        },
        &mut |out| {
            for b in out {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                *b = (seed >> 56) as u8;
            }
        },
    )
}
