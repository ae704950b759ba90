//! Making the LUKS1 header area of a new encrypted image, as QEMU's `crypto/block-luks.c`
//! makes it for `qemu-img create -o encrypt.format=luks`: a random master key, its
//! PBKDF2 digest, one active key slot (slot 0) holding the master key AF-split into 4000
//! stripes and encrypted with PBKDF2 of the secret, seven inactive slots, each slot's key
//! material 4 KiB aligned after the 4 KiB header sector run, the payload right after.
//! PBKDF2 iterations are calibrated from `iter-time` as QEMU does (the slot's for the whole
//! time, the digest's for an eighth of it, 1000 at least), and capped at what we open.
//!
//! The work (two calibrations and the PBKDF2 runs) takes about `iter-time` and a quarter:
//! a caller with a reactor runs [`build_luks_area`] off it. What it returns holds no secret
//! (only key material encrypted by the slot key); the master key, the slot key and the AF
//! stripes are zeroized when dropped.
//!
//! ```no_run
//! use qcow2_engine::crypto::luks_build::{build_luks_area, LuksParams};
//! let mut p = LuksParams::default(); // aes-256-xts-plain64, sha256, 2000 ms
//! p.set("cipher-alg", "aes-128").unwrap();
//! let area = build_luks_area(&p, b"passphrase").unwrap();
//! // `CreateOptions { encryption: Some(area), .. }` formats an encrypted image with it.
//! ```

use super::cipher::{CipherAlg, CipherSpec, Mode, SectorCipher, SECTOR_BYTES};
use super::hash::HashAlg;
use super::luks::{diffuse, LUKS_HEADER_BYTES, LUKS_MAGIC, LUKS_SLOTS, LUKS_STRIPES};
use crate::error::{Error, Result};
use crate::limits::MAX_LUKS_ITERATIONS;
use std::time::Duration;
#[cfg(not(target_os = "linux"))]
use std::time::Instant;
use zeroize::Zeroizing;

/// QEMU's floor of the iterations of a key slot and of the master key digest.
pub const MIN_ITERATIONS: u32 = 1000;
/// QEMU's default `iter-time`, in milliseconds.
pub const DEFAULT_ITER_TIME_MS: u64 = 2000;
/// Key material starts here and is aligned to it, in sectors (QEMU: 4096 bytes).
const SLOT_ALIGN_SECTORS: usize = 4096 / SECTOR_BYTES;
const SLOT_ACTIVE: u32 = 0x00AC_71F3;
const SLOT_INACTIVE: u32 = 0x0000_DEAD;

/// IV generator of `encrypt.ivgen-alg`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IvGenAlg {
    /// `plain`
    Plain,
    /// `plain64` (the default)
    Plain64,
    /// `essiv` (its hash: `ivgen-hash-alg`, default sha256)
    Essiv,
}

/// What `qemu-img create -o encrypt.*` (QAPI `QCryptoBlockCreateOptionsLUKS`) chooses,
/// with QEMU's defaults: aes-256, xts, plain64, sha256, iter-time 2000 ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LuksParams {
    /// `cipher-alg`: aes-128/192/256, twofish-128/192/256, serpent-128/192/256, cast5-128.
    pub cipher_alg: CipherAlg,
    /// `cipher-mode`: xts or cbc.
    pub cipher_mode: Mode,
    /// `ivgen-alg`.
    pub ivgen_alg: IvGenAlg,
    /// `ivgen-hash-alg` (recorded with any generator, as QEMU; used by essiv only).
    pub ivgen_hash_alg: Option<HashAlg>,
    /// `hash-alg`: PBKDF2's and the AF splitter's hash.
    pub hash_alg: HashAlg,
    /// `iter-time`: milliseconds of PBKDF2 a key slot is calibrated to.
    pub iter_time_ms: u64,
}

impl Default for LuksParams {
    fn default() -> Self {
        LuksParams {
            cipher_alg: CipherAlg::Aes256,
            cipher_mode: Mode::Xts,
            ivgen_alg: IvGenAlg::Plain64,
            ivgen_hash_alg: None,
            hash_alg: HashAlg::Sha256,
            iter_time_ms: DEFAULT_ITER_TIME_MS,
        }
    }
}

fn refused<T>(msg: String) -> Result<T> {
    Err(Error::Refused(msg))
}

fn hash(v: &str) -> Result<HashAlg> {
    HashAlg::parse(v).map_or_else(
        || {
            refused(format!(
                "Hash algorithm {v} not supported (sha1, sha224, sha256, sha384, sha512)"
            ))
        },
        Ok,
    )
}

impl LuksParams {
    /// Sets one option by its QEMU name without the `encrypt.` prefix (`cipher-alg`,
    /// `cipher-mode`, `ivgen-alg`, `ivgen-hash-alg`, `hash-alg`, `iter-time`), so that a
    /// command line or an RPC takes QEMU's names and values. Anything else is refused.
    pub fn set(&mut self, name: &str, value: &str) -> Result<()> {
        match name {
            "cipher-alg" => {
                self.cipher_alg = match CipherAlg::parse(value) {
                    Some(a) => a,
                    None => {
                        let all: Vec<&str> = CipherAlg::ALL.iter().map(|a| a.name()).collect();
                        return refused(format!(
                            "Cipher algorithm {value} not supported ({})",
                            all.join(", ")
                        ));
                    }
                }
            }
            "cipher-mode" => {
                self.cipher_mode = match value {
                    "xts" => Mode::Xts,
                    "cbc" => Mode::Cbc,
                    _ => return refused(format!("Cipher mode {value} not supported (xts, cbc)")),
                }
            }
            "ivgen-alg" => {
                self.ivgen_alg = match value {
                    "plain" => IvGenAlg::Plain,
                    "plain64" => IvGenAlg::Plain64,
                    "essiv" => IvGenAlg::Essiv,
                    _ => {
                        return refused(format!(
                            "IV generator {value} not supported (plain, plain64, essiv)"
                        ))
                    }
                }
            }
            "ivgen-hash-alg" => self.ivgen_hash_alg = Some(hash(value)?),
            "hash-alg" => self.hash_alg = hash(value)?,
            "iter-time" => {
                self.iter_time_ms = value.parse().map_err(|_| {
                    Error::Refused(format!("iter-time expects milliseconds (got '{value}')"))
                })?
            }
            _ => return refused(format!("encryption option '{name}' is not supported")),
        }
        Ok(())
    }

    /// The header's `cipher_mode` text, as QEMU writes it (`xts-plain64`,
    /// `cbc-essiv:sha256`; a hash given with plain(64) is recorded too).
    pub fn cipher_mode_text(&self) -> String {
        let mode = match self.cipher_mode {
            Mode::Xts => "xts",
            Mode::Cbc => "cbc",
        };
        let iv = match self.ivgen_alg {
            IvGenAlg::Plain => "plain",
            IvGenAlg::Plain64 => "plain64",
            IvGenAlg::Essiv => "essiv",
        };
        let h = match (self.ivgen_alg, self.ivgen_hash_alg) {
            (IvGenAlg::Essiv, None) => Some(HashAlg::Sha256),
            (_, h) => h,
        };
        match h {
            Some(h) => format!("{mode}-{iv}:{}", h.name()),
            None => format!("{mode}-{iv}"),
        }
    }

    /// The master key's length: the cipher's key's, twice for XTS.
    pub fn key_bytes(&self) -> usize {
        let one = self.cipher_alg.key_len();
        match self.cipher_mode {
            Mode::Xts => 2 * one,
            Mode::Cbc => one,
        }
    }

    /// The payload cipher these options make; refused when QEMU refuses them (XTS over
    /// CAST5's 8-byte blocks; essiv with a hash whose digest is no key length of the
    /// cipher: sha1, sha384, sha512, and all but md5 for CAST5) or fails on them
    /// (aes-192-cbc, twofish-192-cbc, serpent-192-cbc).
    pub fn cipher_spec(&self) -> Result<CipherSpec> {
        if self.cipher_mode == Mode::Xts && self.cipher_alg.block_len() != 16 {
            return refused(format!(
                "cipher {} not supported in mode xts (its blocks are {} bytes; use cbc)",
                self.cipher_alg.name(),
                self.cipher_alg.block_len()
            ));
        }
        if !(self.key_bytes() * LUKS_STRIPES as usize).is_multiple_of(SECTOR_BYTES) {
            // aes-192-cbc: QEMU encrypts key material by whole sectors and aborts on it.
            return refused(format!(
                "cipher {}-{} not supported: its key material is not whole sectors, which \
                 QEMU cannot create or open",
                self.cipher_alg.name(),
                self.cipher_mode_text()
            ));
        }
        let family = self.cipher_alg.family();
        CipherSpec::parse(family, &self.cipher_mode_text(), self.key_bytes()).map_or_else(
            || {
                let keys = match self.cipher_alg {
                    CipherAlg::Cast5 => "md5",
                    _ => "md5, sha256",
                };
                refused(format!(
                    "cipher mode '{}' not supported with {}: essiv needs an ivgen-hash-alg \
                     whose digest is as long as a {family} key ({keys})",
                    self.cipher_mode_text(),
                    self.cipher_alg.name()
                ))
            },
            Ok,
        )
    }

    /// Bytes of the header area these options make (`payload-offset`): the header, then
    /// eight 4 KiB aligned key material areas.
    pub fn area_bytes(&self) -> usize {
        area_layout(self.key_bytes()).1 * SECTOR_BYTES
    }
}

/// (sectors of one slot's key material area, sectors of the whole area).
fn area_layout(key_bytes: usize) -> (usize, usize) {
    let material = key_bytes * LUKS_STRIPES as usize;
    let slot = material
        .div_ceil(SECTOR_BYTES)
        .next_multiple_of(SLOT_ALIGN_SECTORS);
    (slot, SLOT_ALIGN_SECTORS + slot * LUKS_SLOTS)
}

/// A built LUKS header area: the bytes to place at the image's encryption offset, whose
/// length the encryption header extension records. Holds no secret.
#[derive(Clone, PartialEq, Eq)]
pub struct LuksArea {
    bytes: Vec<u8>,
}

impl LuksArea {
    /// The area's bytes (header, key slots, key material).
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
    /// Its length in bytes (a multiple of 512).
    pub fn len(&self) -> u64 {
        self.bytes.len() as u64
    }
    /// Never empty; for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

impl std::fmt::Debug for LuksArea {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LuksArea({} bytes)", self.bytes.len())
    }
}

/// Random bytes from the operating system's CSPRNG.
fn os_random(out: &mut [u8]) -> Result<()> {
    getrandom::fill(out).map_err(|e| Error::Refused(format!("no random numbers: {e}")))
}

/// Builds the header area of a new image encrypted as `p` says, whose one key slot
/// `secret` (the bytes of QEMU's secret object) opens. Refused for options QEMU refuses,
/// and for a secret QEMU could not use (not UTF-8, or with a NUL byte).
pub fn build_luks_area(p: &LuksParams, secret: &[u8]) -> Result<LuksArea> {
    build_with_master(p, secret).map(|(area, _)| area)
}

/// [`build_luks_area`], with the master key the area holds (zeroized when dropped): the
/// image made with it opens without deriving the key from the secret again.
pub(crate) fn build_with_master(
    p: &LuksParams,
    secret: &[u8],
) -> Result<(LuksArea, Zeroizing<Vec<u8>>)> {
    let spec = p.cipher_spec()?;
    if std::str::from_utf8(secret).is_err() || secret.contains(&0) {
        return refused("the secret must be UTF-8 text without NUL bytes (QEMU's rule)".into());
    }
    let kb = p.key_bytes();
    let mut master = Zeroizing::new(vec![0u8; kb]);
    os_random(&mut master)?;
    let slot_iters = iterations(p.hash_alg, kb, p.iter_time_ms, 1)?;
    let mk_iters = iterations(p.hash_alg, 20, p.iter_time_ms, 8)?;
    let mut err = None;
    let bytes = assemble(
        &Assembly {
            cipher_mode: &p.cipher_mode_text(),
            spec,
            hash: p.hash_alg,
            master_key: &master,
            secret,
            slot_iterations: slot_iters,
            mk_iterations: mk_iters,
        },
        &mut |b| {
            if let Err(e) = os_random(b) {
                err = Some(e);
            }
        },
    );
    match err {
        Some(e) => Err(e),
        None => Ok((LuksArea { bytes }, master)),
    }
}

/// PBKDF2 iterations of `hash` giving `out_len` bytes that take `iter_time_ms` / `divisor`
/// here, as QEMU counts them (rate measured, scaled; at least [`MIN_ITERATIONS`]), capped at
/// [`MAX_LUKS_ITERATIONS`] so that the image opens here too.
fn iterations(hash: HashAlg, out_len: usize, iter_time_ms: u64, divisor: u64) -> Result<u32> {
    let per_sec = iterations_per_second(hash, out_len)?;
    let n = u128::from(per_sec) * u128::from(iter_time_ms) / 1000 / u128::from(divisor);
    Ok(n.clamp(u128::from(MIN_ITERATIONS), u128::from(MAX_LUKS_ITERATIONS)) as u32)
}

/// How many PBKDF2 iterations of `hash` with an `out_len`-byte output run in a second:
/// runs grow tenfold until one takes 50 ms, then the rate is read from it.
fn iterations_per_second(hash: HashAlg, out_len: usize) -> Result<u64> {
    let mut salt = [0u8; 32];
    os_random(&mut salt)?;
    let mut out = Zeroizing::new(vec![0u8; out_len]);
    let mut n: u32 = 1 << 10;
    loop {
        let t = CpuClock::now();
        hash.pbkdf2(b"calibration", &salt, n, &mut out);
        let dt = t.elapsed();
        if dt >= Duration::from_millis(50) || n >= MAX_LUKS_ITERATIONS {
            let us = dt.as_micros().max(1);
            return Ok((u128::from(n) * 1_000_000 / us).min(u128::from(u64::MAX)) as u64);
        }
        n = n.saturating_mul(10).min(MAX_LUKS_ITERATIONS);
    }
}

/// The time this thread ran (QEMU counts the thread's CPU time, so that a busy machine
/// does not make for weak iteration counts); wall time where there is no such clock.
struct CpuClock(Duration);

impl CpuClock {
    fn read() -> Duration {
        #[cfg(target_os = "linux")]
        {
            let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
            Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
        }
        #[cfg(not(target_os = "linux"))]
        {
            static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
            START.get_or_init(Instant::now).elapsed()
        }
    }
    fn now() -> Self {
        CpuClock(Self::read())
    }
    fn elapsed(&self) -> Duration {
        Self::read().saturating_sub(self.0)
    }
}

/// Everything of a header area but its randomness.
pub(crate) struct Assembly<'a> {
    /// `cipher_mode` as written (`xts-plain64`).
    pub cipher_mode: &'a str,
    /// The cipher it names (with the key length).
    pub spec: CipherSpec,
    /// `hash_spec`.
    pub hash: HashAlg,
    /// The master key.
    pub master_key: &'a [u8],
    /// The secret of slot 0.
    pub secret: &'a [u8],
    /// PBKDF2 iterations of slot 0.
    pub slot_iterations: u32,
    /// PBKDF2 iterations of the master key digest.
    pub mk_iterations: u32,
}

/// Lays the header area out as QEMU does; `fill` supplies the random bytes (salts, AF
/// stripes, UUID).
pub(crate) fn assemble(a: &Assembly<'_>, fill: &mut dyn FnMut(&mut [u8])) -> Vec<u8> {
    let kb = a.master_key.len();
    let material = kb * LUKS_STRIPES as usize;
    let (slot_sectors, total_sectors) = area_layout(kb);
    let mut area = vec![0u8; total_sectors * SECTOR_BYTES];
    let h = &mut area[..LUKS_HEADER_BYTES];
    h[..6].copy_from_slice(&LUKS_MAGIC);
    h[6..8].copy_from_slice(&1u16.to_be_bytes());
    put_text(&mut h[8..40], a.spec.alg.family());
    put_text(&mut h[40..72], a.cipher_mode);
    put_text(&mut h[72..104], a.hash.name());
    h[104..108].copy_from_slice(&(total_sectors as u32).to_be_bytes());
    h[108..112].copy_from_slice(&(kb as u32).to_be_bytes());
    let mut mk_salt = [0u8; 32];
    fill(&mut mk_salt);
    h[132..164].copy_from_slice(&mk_salt);
    let mut digest = [0u8; 20];
    a.hash
        .pbkdf2(a.master_key, &mk_salt, a.mk_iterations, &mut digest);
    h[112..132].copy_from_slice(&digest);
    h[164..168].copy_from_slice(&a.mk_iterations.to_be_bytes());
    put_text(&mut h[168..208], &uuid_v4(fill));
    let mut salt = [0u8; 32];
    fill(&mut salt);
    for i in 0..LUKS_SLOTS {
        let s = &mut h[208 + 48 * i..208 + 48 * (i + 1)];
        let (state, iters) = match i {
            0 => (SLOT_ACTIVE, a.slot_iterations),
            _ => (SLOT_INACTIVE, 0),
        };
        s[..4].copy_from_slice(&state.to_be_bytes());
        s[4..8].copy_from_slice(&iters.to_be_bytes());
        if i == 0 {
            s[8..40].copy_from_slice(&salt);
        }
        let off = (SLOT_ALIGN_SECTORS + i * slot_sectors) as u32;
        s[40..44].copy_from_slice(&off.to_be_bytes());
        s[44..48].copy_from_slice(&LUKS_STRIPES.to_be_bytes());
    }
    // Slot 0: the master key AF-split, encrypted (as sectors from 0) by PBKDF2 of the
    // secret, with the payload's cipher.
    let mut split = Zeroizing::new(vec![0u8; material.div_ceil(SECTOR_BYTES) * SECTOR_BYTES]);
    fill(&mut split[..material - kb]);
    let mut d = Zeroizing::new(vec![0u8; kb]);
    for s in split[..material - kb].chunks_exact(kb) {
        for (x, y) in d.iter_mut().zip(s) {
            *x ^= y;
        }
        diffuse(a.hash, &mut d);
    }
    for (i, b) in split[material - kb..material].iter_mut().enumerate() {
        *b = d[i] ^ a.master_key[i];
    }
    let mut slot_key = Zeroizing::new(vec![0u8; kb]);
    a.hash
        .pbkdf2(a.secret, &salt, a.slot_iterations, &mut slot_key);
    // The spec's key length is the master key's: keying cannot fail.
    if let Ok(c) = SectorCipher::new(&a.spec, &slot_key) {
        c.encrypt(0, &mut split);
    }
    let at = SLOT_ALIGN_SECTORS * SECTOR_BYTES;
    area[at..at + material].copy_from_slice(&split[..material]);
    area
}

fn put_text(field: &mut [u8], s: &str) {
    let n = s.len().min(field.len() - 1);
    field[..n].copy_from_slice(&s.as_bytes()[..n]);
}

/// A random (version 4) UUID as text.
fn uuid_v4(fill: &mut dyn FnMut(&mut [u8])) -> String {
    let mut u = [0u8; 16];
    fill(&mut u);
    u[6] = (u[6] & 0x0f) | 0x40;
    u[8] = (u[8] & 0x3f) | 0x80;
    let hex: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}
