//! The sector cipher of a LUKS payload: AES, Twofish or Serpent in XTS or CBC mode, or
//! CAST5 in CBC, keyed by the master key, with the IV of each 512-byte sector from its
//! number (`plain`, `plain64`, `essiv`), as QEMU's `crypto/block-luks.c` and its IV
//! generators compute them (an IV is a block long: 8 bytes for CAST5).
//!
//! One dispatch: on a CPU with AVX-512 and VAES (checked at run time), XTS over AES-128/256
//! runs in the `vaes_xts` crate (`xts_vaes.rs`: immutable, shared by all threads);
//! elsewhere OpenSSL's EVP (`evp.rs`) runs every AES cipher it serves, keyed once per key
//! (XTS as our XTS over EVP's AES-ECB, `evp_xts.rs`); RustCrypto (`soft.rs`) runs XTS over
//! AES-192, which OpenSSL lacks, and Twofish, Serpent and CAST5, and is the reference the
//! tests check the others against.
//! An EVP context is mutable: a [`SectorWorker`] owns one per thread (an executor's view,
//! one per core, lock-free); [`SectorCipher::encrypt`]/[`decrypt`](SectorCipher::decrypt) through
//! a shared `&SectorCipher` borrow contexts from a small pool under a mutex.

use super::evp::EvpCtx;
use super::soft::{keyed, Soft};
pub use super::spec::{CipherAlg, CipherSpec, IvGen, Mode, SECTOR_BYTES};
use super::xts_vaes::VaesXts;
use super::CryptoError;
use aes::cipher::BlockEncrypt;
use aes::{Aes128, Aes192, Aes256};
use cast5::Cast5;
use serpent::Serpent;
use std::sync::{Arc, Mutex, MutexGuard};
use twofish::Twofish;

enum Iv {
    Plain,
    Plain64,
    Essiv128(Box<Aes128>),
    Essiv192(Box<Aes192>),
    Essiv256(Box<Aes256>),
    EssivTwofish(Box<Twofish>),
    EssivSerpent(Box<Serpent>),
    EssivCast5(Box<Cast5>),
}

/// Which implementation runs a cipher's sectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// XTS with VAES, the tweaks in AVX-512 (the `vaes_xts` crate, on x86-64 CPUs with both,
    /// checked at run time); where the CPU lacks them, [`Backend::OpenSsl`] runs instead.
    Vaes,
    /// OpenSSL's EVP.
    OpenSsl,
    /// RustCrypto's `aes` with our XTS and the `cbc` crate.
    RustCrypto,
}

/// EVP contexts for callers through a shared reference: a keyed template and the free ones.
struct EvpPool {
    template: EvpCtx,
    free: Vec<EvpCtx>,
}

/// Contexts kept for reuse; more threads at once each key a copy and drop it after.
const POOL_MAX: usize = 8;

/// A keyed sector cipher. Its key schedules are cleared when it is dropped (RustCrypto's
/// with the `aes` crate's `zeroize` feature; OpenSSL's with `OPENSSL_clear_free` when a
/// context is freed); the key it was made from is not kept.
pub struct SectorCipher {
    /// XTS with VAES, where the CPU has it: it runs every sector.
    vaes: Option<Box<VaesXts>>,
    /// Sectors OpenSSL serves; `None`: RustCrypto runs them all.
    evp: Option<Mutex<EvpPool>>,
    /// RustCrypto, keyed too: where EVP is absent or fails.
    soft: Soft,
    iv: Iv,
}

impl std::fmt::Debug for SectorCipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SectorCipher({:?})", self.backend())
    }
}

impl SectorCipher {
    /// Keys `spec` with `key` (its [`CipherSpec::key_bytes`] long): the fastest backend
    /// that serves the cipher (VAES, then OpenSSL, then RustCrypto).
    pub fn new(spec: &CipherSpec, key: &[u8]) -> Result<Self, CryptoError> {
        Self::with_backend(spec, key, Backend::Vaes)
    }

    /// Keys `spec` with `key`, on `prefer` where it serves the cipher, else on the next
    /// (VAES, OpenSSL, RustCrypto; RustCrypto serves all: the reference of the tests and
    /// the benchmark).
    pub fn with_backend(
        spec: &CipherSpec,
        key: &[u8],
        prefer: Backend,
    ) -> Result<Self, CryptoError> {
        if key.len() != spec.key_bytes() {
            return Err(CryptoError::Key);
        }
        let soft = Soft::new(spec.mode, spec.alg, key)?;
        let vaes = match (prefer, spec.mode, spec.alg) {
            (Backend::Vaes, Mode::Xts, CipherAlg::Aes128 | CipherAlg::Aes256) => {
                VaesXts::new(key).map(Box::new)
            }
            _ => None,
        };
        let fast = vaes.is_some();
        let evp = match prefer {
            _ if fast => None,
            Backend::Vaes | Backend::OpenSsl => {
                EvpCtx::new(spec.mode, spec.alg, key).map(|template| {
                    Mutex::new(EvpPool {
                        template,
                        free: Vec::new(),
                    })
                })
            }
            Backend::RustCrypto => None,
        };
        let iv = match spec.ivgen {
            IvGen::Plain => Iv::Plain,
            IvGen::Plain64 => Iv::Plain64,
            IvGen::Essiv(h) => {
                // QEMU hashes the whole key (both halves for XTS); the ESSIV cipher is
                // the family's whose key is the whole digest.
                let mut salt = h.digest(key);
                let iv = essiv_keyed(spec.essiv_alg(), &salt);
                zeroize::Zeroize::zeroize(&mut salt);
                iv?
            }
        };
        Ok(SectorCipher {
            vaes,
            evp,
            soft,
            iv,
        })
    }

    /// The implementation that runs this cipher's sectors.
    pub fn backend(&self) -> Backend {
        if self.vaes.is_some() {
            return Backend::Vaes;
        }
        match self.evp {
            Some(_) => Backend::OpenSsl,
            None => Backend::RustCrypto,
        }
    }

    /// A worker of this cipher for one thread: it owns its own keyed EVP contexts, so its
    /// sectors take no lock.
    pub fn worker(self: &Arc<Self>) -> SectorWorker {
        SectorWorker {
            ctx: self.take_ctx(),
            cipher: self.clone(),
        }
    }

    /// The IVs of sectors `sector`, `sector + 1`, … into `out`, written where they are used
    /// (one call per run of sectors; built on the stack and copied, as two 8-byte stores
    /// read back as one 16-byte load, they stalled the store forwarding of every sector).
    fn ivs(&self, sector: u64, out: &mut [[u8; 16]]) {
        let numbers = out.iter_mut().zip((0u64..).map(|i| sector.wrapping_add(i)));
        match &self.iv {
            Iv::Plain => numbers.for_each(|(b, s)| *b = u128::from(s as u32).to_le_bytes()),
            Iv::Plain64 => numbers.for_each(|(b, s)| *b = u128::from(s).to_le_bytes()),
            Iv::Essiv128(c) => numbers.for_each(|(b, s)| essiv(c.as_ref(), s, b)),
            Iv::Essiv192(c) => numbers.for_each(|(b, s)| essiv(c.as_ref(), s, b)),
            Iv::Essiv256(c) => numbers.for_each(|(b, s)| essiv(c.as_ref(), s, b)),
            Iv::EssivTwofish(c) => numbers.for_each(|(b, s)| essiv(c.as_ref(), s, b)),
            Iv::EssivSerpent(c) => numbers.for_each(|(b, s)| essiv(c.as_ref(), s, b)),
            Iv::EssivCast5(c) => numbers.for_each(|(b, s)| essiv(c.as_ref(), s, b)),
        }
    }

    /// Encrypts `data` (whole sectors) in place; its first sector is number `sector`.
    pub fn encrypt(&self, sector: u64, data: &mut [u8]) {
        self.run_shared(sector, data, true)
    }

    /// Decrypts `data` (whole sectors) in place; its first sector is number `sector`.
    pub fn decrypt(&self, sector: u64, data: &mut [u8]) {
        self.run_shared(sector, data, false)
    }

    fn pool(&self) -> Option<MutexGuard<'_, EvpPool>> {
        // The pool holds only contexts: a panic elsewhere leaves it usable.
        let m = self.evp.as_ref()?;
        Some(m.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn take_ctx(&self) -> Option<EvpCtx> {
        let mut pool = self.pool()?;
        match pool.free.pop() {
            Some(p) => Some(p),
            None => pool.template.dup(),
        }
    }

    fn run_shared(&self, first: u64, data: &mut [u8], enc: bool) {
        let mut ctx = self.take_ctx();
        self.run(ctx.as_mut(), first, data, enc);
        if let (Some(p), Some(mut pool)) = (ctx, self.pool()) {
            if pool.free.len() < POOL_MAX {
                pool.free.push(p);
            }
        }
    }

    fn run(&self, ctx: Option<&mut EvpCtx>, first: u64, data: &mut [u8], enc: bool) {
        debug_assert!(data.len().is_multiple_of(SECTOR_BYTES));
        let iv = |i: u64, out: &mut [[u8; 16]]| self.ivs(first.wrapping_add(i), out);
        if let Some(v) = &self.vaes {
            return v.run(data, &iv, enc);
        }
        let done = match ctx {
            Some(p) => p.run(data, &iv, enc),
            None => 0,
        };
        // What EVP did not do (all of it without EVP), RustCrypto does.
        let rest = data[done * SECTOR_BYTES..].chunks_exact_mut(SECTOR_BYTES);
        for (i, s) in rest.enumerate() {
            let mut b = [[0u8; 16]];
            iv((done + i) as u64, &mut b);
            self.soft.sector(s, b[0], enc);
        }
    }
}

/// A [`SectorCipher`] for one thread: its own keyed EVP contexts, used through `&mut`
/// without a lock (an executor's encrypted view holds one per core). `Send`, so it may
/// be made on one thread and moved to the one that uses it.
pub struct SectorWorker {
    cipher: Arc<SectorCipher>,
    ctx: Option<EvpCtx>,
}

impl std::fmt::Debug for SectorWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SectorWorker({:?})", self.cipher.backend())
    }
}

impl SectorWorker {
    /// Encrypts `data` (whole sectors) in place; its first sector is number `sector`.
    pub fn encrypt(&mut self, sector: u64, data: &mut [u8]) {
        self.cipher.run(self.ctx.as_mut(), sector, data, true)
    }

    /// Decrypts `data` (whole sectors) in place; its first sector is number `sector`.
    pub fn decrypt(&mut self, sector: u64, data: &mut [u8]) {
        self.cipher.run(self.ctx.as_mut(), sector, data, false)
    }

    /// The cipher it works for.
    pub fn cipher(&self) -> &Arc<SectorCipher> {
        &self.cipher
    }
}

/// The ESSIV cipher `alg` keyed with `salt` (the digest of the key).
fn essiv_keyed(alg: Option<CipherAlg>, salt: &[u8]) -> Result<Iv, CryptoError> {
    use CipherAlg as A;
    Ok(match alg.ok_or(CryptoError::Key)? {
        A::Aes128 => Iv::Essiv128(keyed(salt)?),
        A::Aes192 => Iv::Essiv192(keyed(salt)?),
        A::Aes256 => Iv::Essiv256(keyed(salt)?),
        A::Twofish128 | A::Twofish192 | A::Twofish256 => Iv::EssivTwofish(keyed(salt)?),
        A::Serpent128 | A::Serpent192 | A::Serpent256 => Iv::EssivSerpent(keyed(salt)?),
        A::Cast5 => Iv::EssivCast5(keyed(salt)?),
    })
}

/// ESSIV as QEMU's `ivgen-essiv.c`: the little-endian sector number, zero-padded to a
/// block, encrypted; the IV is that block (8 bytes for CAST5, zero-padded here).
fn essiv<C: BlockEncrypt>(c: &C, sector: u64, out: &mut [u8; 16]) {
    let mut b = aes::cipher::Block::<C>::default();
    let n = b.len().min(16);
    b[..8].copy_from_slice(&sector.to_le_bytes());
    c.encrypt_block(&mut b);
    out[..n].copy_from_slice(&b[..n]);
    // Empty for a 16-byte block: nothing added to AES.
    out[n..].fill(0);
}
