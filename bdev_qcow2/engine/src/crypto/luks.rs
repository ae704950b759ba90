//! The LUKS1 header QEMU writes into a qcow2 image's clusters (`crypto/block-luks.c`, the
//! LUKS on-disk format 1.2.1): decoded and validated with bounded work, then unlocked with
//! a secret — PBKDF2 of a key slot, the anti-forensic merge, the master key's digest.

use super::cipher::{CipherSpec, SectorCipher, SECTOR_BYTES};
use super::hash::HashAlg;
use crate::error::{invalid, Error, Field, Result};
use crate::limits::{MAX_LUKS_ITERATIONS, MAX_LUKS_ITERATIONS_TOTAL};
use zeroize::Zeroizing;

/// `LUKS\xba\xbe`.
pub const LUKS_MAGIC: [u8; 6] = *b"LUKS\xba\xbe";
/// Bytes of the fixed header (before key material).
pub const LUKS_HEADER_BYTES: usize = 592;
/// Key slots of a LUKS1 header.
pub const LUKS_SLOTS: usize = 8;
/// Anti-forensic stripes of a key slot (the spec's and QEMU's only value).
pub const LUKS_STRIPES: u32 = 4000;
const SLOT_ACTIVE: u32 = 0x00AC_71F3;
const SLOT_INACTIVE: u32 = 0x0000_DEAD;
const DIGEST_LEN: usize = 20;
const SALT_LEN: usize = 32;

/// One key slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySlot {
    /// Whether it holds a key.
    pub active: bool,
    /// PBKDF2 iterations.
    pub iterations: u32,
    /// PBKDF2 salt.
    pub salt: [u8; SALT_LEN],
    /// Start of its key material, in 512-byte sectors from the header's start.
    pub key_offset: u32,
    /// Anti-forensic stripes.
    pub stripes: u32,
}

/// A decoded, validated LUKS1 header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LuksHeader {
    /// `cipher_name` (`aes`).
    pub cipher_name: String,
    /// `cipher_mode` (`xts-plain64`).
    pub cipher_mode: String,
    /// `hash_spec` (`sha256`).
    pub hash: HashAlg,
    /// The cipher they describe.
    pub cipher: CipherSpec,
    /// `payload_offset`, in sectors (QEMU's qcow2 ignores it: data is where L2 says).
    pub payload_offset: u32,
    /// `key_bytes`: the master key's length.
    pub key_bytes: u32,
    /// The master key's PBKDF2 digest, salt and iterations.
    pub mk_digest: [u8; DIGEST_LEN],
    /// See `mk_digest`.
    pub mk_salt: [u8; SALT_LEN],
    /// See `mk_digest`.
    pub mk_iterations: u32,
    /// The UUID as text.
    pub uuid: String,
    /// The key slots.
    pub slots: Vec<KeySlot>,
}

fn be32(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_be_bytes(w)
}

/// A NUL-padded text field.
fn text(b: &[u8]) -> Result<String> {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    std::str::from_utf8(&b[..end])
        .map(str::to_owned)
        .map_err(|_| bad(0, "text field is not UTF-8"))
}

fn bad(value: u64, reason: &'static str) -> Error {
    invalid(Field::LuksHeader, value, reason)
}

impl LuksHeader {
    /// Decodes the header from `region`, the bytes of the image's LUKS header area (its
    /// length is the extension's), refusing anything QEMU refuses and every cost past our
    /// limits: iterations, key material outside the area, overlapping slots.
    pub fn parse(region: &[u8]) -> Result<Self> {
        let b = region
            .get(..LUKS_HEADER_BYTES)
            .ok_or_else(|| bad(region.len() as u64, "area shorter than a LUKS header"))?;
        if b[..6] != LUKS_MAGIC {
            return Err(bad(0, "not a LUKS header (magic)"));
        }
        let version = u16::from_be_bytes([b[6], b[7]]);
        if version != 1 {
            return Err(bad(version.into(), "LUKS version is not 1"));
        }
        let cipher_name = text(&b[8..40])?;
        let cipher_mode = text(&b[40..72])?;
        let hash_name = text(&b[72..104])?;
        let payload_offset = be32(b, 104);
        let key_bytes = be32(b, 108);
        let mut mk_digest = [0u8; DIGEST_LEN];
        mk_digest.copy_from_slice(&b[112..132]);
        let mut mk_salt = [0u8; SALT_LEN];
        mk_salt.copy_from_slice(&b[132..164]);
        let mk_iterations = be32(b, 164);
        let uuid = text(&b[168..208])?;
        let hash = HashAlg::parse(&hash_name)
            .ok_or_else(|| Error::UnsupportedFeature(format!("LUKS hash '{hash_name}'")))?;
        let cipher =
            CipherSpec::parse(&cipher_name, &cipher_mode, key_bytes as usize).ok_or_else(|| {
                Error::UnsupportedFeature(format!(
                    "LUKS cipher '{cipher_name}-{cipher_mode}' with a {key_bytes}-byte key"
                ))
            })?;
        if mk_iterations == 0 || mk_iterations > MAX_LUKS_ITERATIONS {
            return Err(bad(mk_iterations.into(), "master key digest iterations"));
        }
        let header_sectors = LUKS_HEADER_BYTES.div_ceil(SECTOR_BYTES) as u64;
        let material = u64::from(key_bytes) * u64::from(LUKS_STRIPES);
        let material_sectors = material.div_ceil(SECTOR_BYTES as u64);
        let mut slots = Vec::with_capacity(LUKS_SLOTS);
        let mut total = u64::from(mk_iterations);
        for i in 0..LUKS_SLOTS {
            let s = &b[208 + 48 * i..208 + 48 * (i + 1)];
            let active = match be32(s, 0) {
                SLOT_ACTIVE => true,
                SLOT_INACTIVE => false,
                v => return Err(bad(v.into(), "key slot state")),
            };
            let mut salt = [0u8; SALT_LEN];
            salt.copy_from_slice(&s[8..40]);
            let slot = KeySlot {
                active,
                iterations: be32(s, 4),
                salt,
                key_offset: be32(s, 40),
                stripes: be32(s, 44),
            };
            if slot.stripes != LUKS_STRIPES {
                return Err(bad(slot.stripes.into(), "key slot stripes is not 4000"));
            }
            let start = u64::from(slot.key_offset);
            if start < header_sectors {
                return Err(bad(start, "key slot overlaps the header"));
            }
            if (start + material_sectors) * SECTOR_BYTES as u64 > region.len() as u64 {
                return Err(bad(start, "key slot material outside the LUKS area"));
            }
            for (j, o) in slots.iter().enumerate() {
                let o: &KeySlot = o;
                let os = u64::from(o.key_offset);
                if start < os + material_sectors && os < start + material_sectors {
                    return Err(bad(j as u64, "key slots overlap"));
                }
            }
            if active {
                if slot.iterations == 0 || slot.iterations > MAX_LUKS_ITERATIONS {
                    return Err(bad(slot.iterations.into(), "key slot iterations"));
                }
                total += u64::from(slot.iterations);
            }
            slots.push(slot);
        }
        if total > MAX_LUKS_ITERATIONS_TOTAL {
            return Err(bad(total, "PBKDF2 iterations of all key slots"));
        }
        if !slots.iter().any(|s| s.active) {
            return Err(bad(0, "no active key slot"));
        }
        Ok(LuksHeader {
            cipher_name,
            cipher_mode,
            hash,
            cipher,
            payload_offset,
            key_bytes,
            mk_digest,
            mk_salt,
            mk_iterations,
            uuid,
            slots,
        })
    }

    /// The payload cipher keyed by the master key that `secret` unlocks in one of the
    /// active slots of `region` (the area [`parse`](Self::parse) read this header from).
    /// [`Error::WrongKey`] when no slot opens with it.
    pub fn unlock(&self, region: &[u8], secret: &[u8]) -> Result<SectorCipher> {
        let kb = self.key_bytes as usize;
        let material = kb * LUKS_STRIPES as usize;
        for slot in self.slots.iter().filter(|s| s.active) {
            let at = slot.key_offset as usize * SECTOR_BYTES;
            let Some(src) = region.get(at..at + material) else {
                return Err(bad(at as u64, "key slot material outside the LUKS area"));
            };
            // The slot's key: PBKDF2 of the secret.
            let mut slot_key = Zeroizing::new(vec![0u8; kb]);
            self.hash
                .pbkdf2(secret, &slot.salt, slot.iterations, &mut slot_key);
            let slot_cipher =
                SectorCipher::new(&self.cipher, &slot_key).map_err(|e| e.into_error())?;
            // Key material, decrypted as sectors numbered from 0 (as QEMU).
            let mut split =
                Zeroizing::new(vec![0u8; material.div_ceil(SECTOR_BYTES) * SECTOR_BYTES]);
            split[..material].copy_from_slice(src);
            slot_cipher.decrypt(0, &mut split);
            let mk = af_merge(self.hash, &split[..material], kb, LUKS_STRIPES as usize);
            let mut digest = Zeroizing::new([0u8; DIGEST_LEN]);
            self.hash
                .pbkdf2(&mk, &self.mk_salt, self.mk_iterations, &mut digest[..]);
            if *digest == self.mk_digest {
                return SectorCipher::new(&self.cipher, &mk).map_err(|e| e.into_error());
            }
        }
        Err(Error::WrongKey)
    }
}

/// The anti-forensic merge (LUKS AF): the key from its `stripes` diffused copies.
fn af_merge(hash: HashAlg, split: &[u8], len: usize, stripes: usize) -> Zeroizing<Vec<u8>> {
    let mut d = Zeroizing::new(vec![0u8; len]);
    for (i, s) in split.chunks_exact(len).enumerate() {
        for (a, b) in d.iter_mut().zip(s) {
            *a ^= b;
        }
        if i + 1 < stripes {
            diffuse(hash, &mut d);
        }
    }
    d
}

/// LUKS AF diffusion: each digest-sized piece replaced by the hash of (its index, it).
pub(super) fn diffuse(hash: HashAlg, d: &mut [u8]) {
    let n = hash.digest_len();
    for (i, piece) in d.chunks_mut(n).enumerate() {
        let mut h = Zeroizing::new(hash.digest_parts(&[&(i as u32).to_be_bytes(), piece]));
        let len = piece.len();
        piece.copy_from_slice(&h[..len]);
        zeroize::Zeroize::zeroize(&mut *h);
    }
}
