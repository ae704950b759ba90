//! The sector cipher through OpenSSL's EVP (AES-NI, VAES: what `openssl speed` measures).
//! A pair of contexts, one keyed to encrypt and one to decrypt, is keyed ONCE; each
//! 512-byte sector then only resets the IV (`EVP_CipherInit_ex` without cipher or key:
//! no key schedule) and runs one update over the sector. A context is mutable state: one
//! pair per thread ([`EvpPair::dup`] copies the keyed state, not the key).

use super::cipher::{AesBits, Mode, SECTOR_BYTES};
use openssl::cipher::{Cipher, CipherRef};
use openssl::cipher_ctx::CipherCtx;

/// Two keyed contexts: encrypt and decrypt (AES's key schedules differ per direction).
pub(super) struct EvpPair {
    enc: CipherCtx,
    dec: CipherCtx,
    mode: Mode,
}

fn cipher(mode: Mode, bits: AesBits) -> Option<&'static CipherRef> {
    Some(match (mode, bits) {
        (Mode::Xts, AesBits::B128) => Cipher::aes_128_xts(),
        // OpenSSL has no XTS over AES-192 (nor has IEEE 1619): RustCrypto serves it.
        (Mode::Xts, AesBits::B192) => return None,
        (Mode::Xts, AesBits::B256) => Cipher::aes_256_xts(),
        (Mode::Cbc, AesBits::B128) => Cipher::aes_128_cbc(),
        (Mode::Cbc, AesBits::B192) => Cipher::aes_192_cbc(),
        (Mode::Cbc, AesBits::B256) => Cipher::aes_256_cbc(),
    })
}

impl EvpPair {
    /// Keys both directions with `key`; `None` where OpenSSL does not serve the cipher
    /// (XTS over AES-192) or refuses the key (OpenSSL 3 refuses XTS keys whose halves are
    /// equal, which QEMU accepts: the caller falls back to RustCrypto).
    pub(super) fn new(mode: Mode, bits: AesBits, key: &[u8]) -> Option<Self> {
        let c = cipher(mode, bits)?;
        if c.key_length() != key.len() {
            return None;
        }
        let mut enc = CipherCtx::new().ok()?;
        enc.encrypt_init(Some(c), Some(key), None).ok()?;
        let mut dec = CipherCtx::new().ok()?;
        dec.decrypt_init(Some(c), Some(key), None).ok()?;
        // Sectors are whole blocks: no padding, and a CBC decrypt keeps no block back.
        enc.set_padding(false);
        dec.set_padding(false);
        Some(EvpPair { enc, dec, mode })
    }

    /// Another pair with the same keyed state (`EVP_CIPHER_CTX_copy`), for another thread.
    pub(super) fn dup(&self) -> Option<Self> {
        let mut enc = CipherCtx::new().ok()?;
        enc.copy(&self.enc).ok()?;
        let mut dec = CipherCtx::new().ok()?;
        dec.copy(&self.dec).ok()?;
        Some(EvpPair {
            enc,
            dec,
            mode: self.mode,
        })
    }

    /// Encrypts (`enc`) or decrypts one 512-byte sector in place with IV `iv`. `false`
    /// when OpenSSL failed (not expected once keyed): the caller runs RustCrypto instead.
    pub(super) fn sector(&mut self, s: &mut [u8], iv: &[u8; 16], enc: bool) -> bool {
        debug_assert_eq!(s.len(), SECTOR_BYTES);
        let ctx = if enc { &mut self.enc } else { &mut self.dec };
        let init = if enc {
            ctx.encrypt_init(None, None, Some(iv))
        } else {
            ctx.decrypt_init(None, None, Some(iv))
        };
        if init.is_err() {
            return false;
        }
        match self.mode {
            // XTS is a stream to EVP (block size 1): it runs in place.
            Mode::Xts => matches!(ctx.cipher_update_inplace(s, SECTOR_BYTES), Ok(SECTOR_BYTES)),
            // CBC wants a block of room past the input, even without padding.
            Mode::Cbc => {
                let mut room = [0u8; SECTOR_BYTES + 16];
                room[..SECTOR_BYTES].copy_from_slice(s);
                let ok = matches!(
                    ctx.cipher_update_inplace(&mut room, SECTOR_BYTES),
                    Ok(SECTOR_BYTES)
                );
                s.copy_from_slice(&room[..SECTOR_BYTES]);
                ok
            }
        }
    }
}
