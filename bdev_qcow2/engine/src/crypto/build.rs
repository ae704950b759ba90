//! Building a LUKS1 header area as QEMU lays it out (slots 4 KiB aligned after the
//! header), for tests and fuzz seeds: the inverse of `luks.rs` (AF split, key slot
//! encryption, master key digest). Randomness is the caller's bytes: not for real keys.

use super::cipher::{CipherSpec, SectorCipher, SECTOR_BYTES};
use super::hash::HashAlg;
use super::luks::{LUKS_HEADER_BYTES, LUKS_MAGIC, LUKS_SLOTS, LUKS_STRIPES};

/// What to build.
pub struct LuksBuild<'a> {
    /// `cipher_name`, `cipher_mode`.
    pub cipher: (&'a str, &'a str),
    /// `hash_spec`.
    pub hash: HashAlg,
    /// The master key (its length is `key_bytes`).
    pub master_key: &'a [u8],
    /// The secret of slot 0 (the only active slot).
    pub secret: &'a [u8],
    /// PBKDF2 iterations of slot 0 and of the digest.
    pub iterations: u32,
    /// Filler for salts and the AF stripes.
    pub seed: u64,
}

fn fill(seed: &mut u64, out: &mut [u8]) {
    for b in out {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *b = (*seed >> 56) as u8;
    }
}

/// The header area's bytes.
pub fn build(p: &LuksBuild<'_>) -> Vec<u8> {
    let kb = p.master_key.len();
    let material = kb * LUKS_STRIPES as usize;
    let slot_sectors = material.div_ceil(SECTOR_BYTES).next_multiple_of(8);
    let first = 8usize;
    let total = (first + LUKS_SLOTS * slot_sectors) * SECTOR_BYTES;
    let mut area = vec![0u8; total];
    let mut seed = p.seed;
    let h = &mut area[..LUKS_HEADER_BYTES];
    h[..6].copy_from_slice(&LUKS_MAGIC);
    h[6..8].copy_from_slice(&1u16.to_be_bytes());
    h[8..8 + p.cipher.0.len()].copy_from_slice(p.cipher.0.as_bytes());
    h[40..40 + p.cipher.1.len()].copy_from_slice(p.cipher.1.as_bytes());
    h[72..72 + p.hash.name().len()].copy_from_slice(p.hash.name().as_bytes());
    h[104..108].copy_from_slice(&((total / SECTOR_BYTES) as u32).to_be_bytes());
    h[108..112].copy_from_slice(&(kb as u32).to_be_bytes());
    fill(&mut seed, &mut h[132..164]);
    let mk_salt = h[132..164].to_vec();
    let mut digest = [0u8; 20];
    p.hash
        .pbkdf2(p.master_key, &mk_salt, p.iterations, &mut digest);
    h[112..132].copy_from_slice(&digest);
    h[164..168].copy_from_slice(&p.iterations.to_be_bytes());
    h[168..204].copy_from_slice(b"00000000-0000-4000-8000-000000000000");
    for i in 0..LUKS_SLOTS {
        let s = &mut h[208 + 48 * i..208 + 48 * (i + 1)];
        let active: u32 = if i == 0 { 0x00AC_71F3 } else { 0x0000_DEAD };
        s[..4].copy_from_slice(&active.to_be_bytes());
        s[4..8].copy_from_slice(&(if i == 0 { p.iterations } else { 0 }).to_be_bytes());
        let off = (first + i * slot_sectors) as u32;
        s[40..44].copy_from_slice(&off.to_be_bytes());
        s[44..48].copy_from_slice(&LUKS_STRIPES.to_be_bytes());
    }
    let mut salt = [0u8; 32];
    fill(&mut seed, &mut salt);
    area[208 + 8..208 + 40].copy_from_slice(&salt);
    // Slot 0: AF split of the master key, encrypted with PBKDF2 of the secret.
    let mut split = vec![0u8; slot_sectors * SECTOR_BYTES];
    fill(&mut seed, &mut split[..material - kb]);
    let mut d = vec![0u8; kb];
    for s in split[..material - kb].chunks_exact(kb) {
        for (a, b) in d.iter_mut().zip(s) {
            *a ^= b;
        }
        super::luks::diffuse(p.hash, &mut d);
    }
    for (i, b) in split[material - kb..material].iter_mut().enumerate() {
        *b = d[i] ^ p.master_key[i];
    }
    let mut slot_key = vec![0u8; kb];
    p.hash.pbkdf2(p.secret, &salt, p.iterations, &mut slot_key);
    let spec = CipherSpec::parse(p.cipher.0, p.cipher.1, kb);
    if let Some(c) = spec.and_then(|s| SectorCipher::new(&s, &slot_key).ok()) {
        c.encrypt(0, &mut split);
    }
    let at = first * SECTOR_BYTES;
    area[at..at + slot_sectors * SECTOR_BYTES].copy_from_slice(&split);
    area
}
