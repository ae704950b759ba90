//! The sector cipher through OpenSSL's EVP (AES-NI, VAES: what `openssl speed` measures),
//! keyed ONCE per key. XTS runs as our XTS over EVP's AES-ECB (`evp_xts.rs`: no per-sector
//! IV reset); CBC through EVP's CBC, where each 512-byte sector only resets the IV
//! (`EVP_CipherInit_ex` without cipher or key: no key schedule) and runs one update. A
//! context is mutable state: one [`EvpCtx`] per thread ([`EvpCtx::dup`] copies the keyed
//! state, not the key).

use super::evp_xts::EcbXts;
use super::spec::{CipherAlg, Mode, SECTOR_BYTES};
use openssl::cipher::{Cipher, CipherRef};
use openssl::cipher_ctx::CipherCtx;

/// A keyed cipher for one thread.
pub(super) enum EvpCtx {
    /// XTS over AES-ECB.
    Xts(Box<EcbXts>),
    /// CBC: one context per direction (AES's key schedules differ per direction).
    Cbc { enc: CipherCtx, dec: CipherCtx },
}

impl EvpCtx {
    /// Keys `mode` over `alg` with `key`; `None` where OpenSSL does not serve the
    /// cipher (XTS over AES-192: OpenSSL has no XTS-AES-192 context to check against, and
    /// IEEE 1619 none at all; every cipher but AES, which RustCrypto runs).
    pub(super) fn new(mode: Mode, alg: CipherAlg, key: &[u8]) -> Option<Self> {
        match (mode, alg) {
            (Mode::Xts, CipherAlg::Aes128) => Some(Self::Xts(Box::new(EcbXts::new(
                Cipher::aes_128_ecb(),
                key,
            )?))),
            (Mode::Xts, CipherAlg::Aes192) => None,
            (Mode::Xts, CipherAlg::Aes256) => Some(Self::Xts(Box::new(EcbXts::new(
                Cipher::aes_256_ecb(),
                key,
            )?))),
            (Mode::Cbc, CipherAlg::Aes128) => cbc(Cipher::aes_128_cbc(), key),
            (Mode::Cbc, CipherAlg::Aes192) => cbc(Cipher::aes_192_cbc(), key),
            (Mode::Cbc, CipherAlg::Aes256) => cbc(Cipher::aes_256_cbc(), key),
            _ => None,
        }
    }

    /// Another with the same keyed state (`EVP_CIPHER_CTX_copy`), for another thread.
    pub(super) fn dup(&self) -> Option<Self> {
        match self {
            Self::Xts(x) => Some(Self::Xts(Box::new(x.dup()?))),
            Self::Cbc { enc, dec } => Some(Self::Cbc {
                enc: copy(enc)?,
                dec: copy(dec)?,
            }),
        }
    }

    /// Encrypts (`enc`) or decrypts `data` (whole sectors) in place; `iv(i, out)` writes
    /// the IVs of its sectors `i`, `i + 1`, … into `out`. Returns how many sectors it did:
    /// all, unless OpenSSL failed (not expected once keyed; the rest is untouched, for the
    /// caller to finish).
    pub(super) fn run(
        &mut self,
        data: &mut [u8],
        iv: &dyn Fn(u64, &mut [[u8; 16]]),
        enc: bool,
    ) -> usize {
        match self {
            Self::Xts(x) => x.run(data, iv, enc),
            Self::Cbc { enc: e, dec: d } => {
                let ctx = if enc { e } else { d };
                for (i, s) in data.chunks_exact_mut(SECTOR_BYTES).enumerate() {
                    let mut b = [[0u8; 16]];
                    iv(i as u64, &mut b);
                    if !cbc_sector(ctx, s, &b[0], enc) {
                        return i;
                    }
                }
                data.len() / SECTOR_BYTES
            }
        }
    }
}

fn cbc(c: &CipherRef, key: &[u8]) -> Option<EvpCtx> {
    if c.key_length() != key.len() {
        return None;
    }
    let mut enc = CipherCtx::new().ok()?;
    enc.encrypt_init(Some(c), Some(key), None).ok()?;
    let mut dec = CipherCtx::new().ok()?;
    dec.decrypt_init(Some(c), Some(key), None).ok()?;
    // Sectors are whole blocks: no padding, and a decrypt keeps no block back.
    enc.set_padding(false);
    dec.set_padding(false);
    Some(EvpCtx::Cbc { enc, dec })
}

fn copy(src: &CipherCtx) -> Option<CipherCtx> {
    let mut x = CipherCtx::new().ok()?;
    x.copy(src).ok()?;
    Some(x)
}

/// One sector through CBC: the IV reset, then one update.
fn cbc_sector(ctx: &mut CipherCtx, s: &mut [u8], iv: &[u8; 16], enc: bool) -> bool {
    let init = if enc {
        ctx.encrypt_init(None, None, Some(iv))
    } else {
        ctx.decrypt_init(None, None, Some(iv))
    };
    if init.is_err() {
        return false;
    }
    // EVP wants a block of room past the input, even without padding.
    let mut room = [0u8; SECTOR_BYTES + 16];
    room[..SECTOR_BYTES].copy_from_slice(s);
    let ok = matches!(
        ctx.cipher_update_inplace(&mut room, SECTOR_BYTES),
        Ok(SECTOR_BYTES)
    );
    if ok {
        s.copy_from_slice(&room[..SECTOR_BYTES]);
    }
    ok
}
