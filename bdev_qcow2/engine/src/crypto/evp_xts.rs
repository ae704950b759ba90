//! XTS over whole 512-byte sectors with OpenSSL's AES-ECB doing the AES: EVP's own XTS
//! needs its IV reset per sector (the format's data unit), and that reset
//! (`EVP_CipherInit_ex`) costs about a third of a sector's time; an ECB context needs no
//! reset, so a whole request goes through AES in one update. Per chunk of sectors: their
//! IVs through AES-k2 in one update (the first tweak of each), then `data ^ tweak` into a
//! scratch buffer, AES-k1 over all of it in one update, and `^ tweak` back into the data.
//! Tweaks are `T·α^j` in GF(2^128) (IEEE 1619, little endian); no ciphertext stealing
//! (sectors are whole blocks).

use super::spec::SECTOR_BYTES;
use openssl::cipher::CipherRef;
use openssl::cipher_ctx::CipherCtx;

const BLOCKS: usize = SECTOR_BYTES / 16;
/// Sectors per AES update: 8 KiB of data, scratch and tweaks stay in L1.
const CHUNK: usize = 16;
const _: () = assert!(CHUNK.is_multiple_of(LANES));

/// Three ECB contexts keyed once (k1 to encrypt, k1 to decrypt, k2 for the tweaks) and the
/// scratch they run through.
pub(super) struct EcbXts {
    k1e: CipherCtx,
    k1d: CipherCtx,
    k2: CipherCtx,
    /// `data ^ tweak`; the IVs. (Each a block longer: EVP wants room for one.)
    a: Vec<u8>,
    /// AES output; the first tweaks.
    b: Vec<u8>,
    /// Every block's tweak, as bytes.
    t: Vec<u8>,
}

fn ctx(c: &CipherRef, key: &[u8], enc: bool) -> Option<CipherCtx> {
    let mut x = CipherCtx::new().ok()?;
    if enc {
        x.encrypt_init(Some(c), Some(key), None).ok()?;
    } else {
        x.decrypt_init(Some(c), Some(key), None).ok()?;
    }
    x.set_padding(false);
    Some(x)
}

fn copy(src: &CipherCtx) -> Option<CipherCtx> {
    let mut x = CipherCtx::new().ok()?;
    x.copy(src).ok()?;
    Some(x)
}

/// One block's tweak as two little-endian halves, times α in GF(2^128) (IEEE 1619): a
/// shift left by one bit, 0x87 folded into the low byte when the top bit falls out.
#[derive(Clone, Copy)]
struct Tweak {
    lo: u64,
    hi: u64,
}

impl Tweak {
    #[inline(always)]
    fn of(b: &[u8]) -> Tweak {
        Tweak {
            lo: read64(b, 0),
            hi: read64(b, 8),
        }
    }

    #[inline(always)]
    fn times_alpha(self) -> Tweak {
        let carry = (self.hi >> 63).wrapping_neg() & 0x87;
        Tweak {
            lo: (self.lo << 1) ^ carry,
            hi: (self.hi << 1) | (self.lo >> 63),
        }
    }
}

#[inline(always)]
fn read64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

#[inline(always)]
fn write64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Sectors whose tweak chains run side by side (each step depends on the last).
const LANES: usize = 4;

/// `L` sectors on their way into AES: each block of `d` XORed with its tweak into `a`, the
/// tweak kept in `t` for the way back; `first` holds each sector's first tweak. One pass:
/// the tweaks are made where they are used, the chains of the `L` sectors interleaved.
#[inline(always)]
fn whiten<const L: usize>(d: &[u8], a: &mut [u8], t: &mut [u8], first: &[u8]) {
    let n = L * SECTOR_BYTES;
    let (d, a, t) = (&d[..n], &mut a[..n], &mut t[..n]);
    let mut cur = [Tweak { lo: 0, hi: 0 }; L];
    for (k, c) in cur.iter_mut().enumerate() {
        *c = Tweak::of(&first[16 * k..16 * k + 16]);
    }
    for j in 0..BLOCKS {
        for (k, c) in cur.iter_mut().enumerate() {
            let at = k * SECTOR_BYTES + j * 16;
            write64(a, at, read64(d, at) ^ c.lo);
            write64(a, at + 8, read64(d, at + 8) ^ c.hi);
            write64(t, at, c.lo);
            write64(t, at + 8, c.hi);
            *c = c.times_alpha();
        }
    }
}

impl EcbXts {
    /// `ecb` is AES-ECB of one key half's size; `key` both halves.
    pub(super) fn new(ecb: &CipherRef, key: &[u8]) -> Option<Self> {
        let (k1, k2) = key.split_at(key.len() / 2);
        if ecb.key_length() != k1.len() {
            return None;
        }
        Some(Self::with(
            ctx(ecb, k1, true)?,
            ctx(ecb, k1, false)?,
            ctx(ecb, k2, true)?,
        ))
    }

    fn with(k1e: CipherCtx, k1d: CipherCtx, k2: CipherCtx) -> Self {
        EcbXts {
            k1e,
            k1d,
            k2,
            a: vec![0; CHUNK * SECTOR_BYTES + 16],
            b: vec![0; CHUNK * SECTOR_BYTES + 16],
            t: vec![0; CHUNK * SECTOR_BYTES],
        }
    }

    /// The `n` sectors of `data` XORed with their tweaks into `a` (the tweaks into `t`),
    /// from their first tweaks in `b`: [`LANES`] sectors at a time, the rest one by one.
    fn whiten_all(&mut self, data: &[u8], n: usize) {
        let mut s = 0;
        while s + LANES <= n {
            let at = s * SECTOR_BYTES;
            whiten::<LANES>(
                &data[at..],
                &mut self.a[at..],
                &mut self.t[at..],
                &self.b[16 * s..],
            );
            s += LANES;
        }
        for s in s..n {
            let at = s * SECTOR_BYTES;
            whiten::<1>(
                &data[at..],
                &mut self.a[at..],
                &mut self.t[at..],
                &self.b[16 * s..],
            );
        }
    }

    /// Another with the same keyed state, for another thread.
    pub(super) fn dup(&self) -> Option<Self> {
        Some(Self::with(
            copy(&self.k1e)?,
            copy(&self.k1d)?,
            copy(&self.k2)?,
        ))
    }

    /// Encrypts (`enc`) or decrypts `data` (whole sectors) in place, the IV of its sector
    /// `i` being `iv(i)`. Returns how many sectors it did: all, unless OpenSSL failed
    /// (then the rest is untouched, for the caller to finish).
    pub(super) fn run(
        &mut self,
        data: &mut [u8],
        iv: &dyn Fn(u64) -> [u8; 16],
        enc: bool,
    ) -> usize {
        let mut done = 0;
        for chunk in data.chunks_mut(CHUNK * SECTOR_BYTES) {
            if !self.chunk(chunk, done as u64, iv, enc) {
                break;
            }
            done += chunk.len() / SECTOR_BYTES;
        }
        done
    }

    fn chunk(
        &mut self,
        data: &mut [u8],
        first: u64,
        iv: &dyn Fn(u64) -> [u8; 16],
        enc: bool,
    ) -> bool {
        let n = data.len() / SECTOR_BYTES;
        let len = n * SECTOR_BYTES;
        // The first tweak of each sector: its IV through AES-k2.
        for (i, b) in self.a[..16 * n].chunks_exact_mut(16).enumerate() {
            b.copy_from_slice(&iv(first + i as u64));
        }
        if !matches!(
            self.k2.cipher_update(&self.a[..16 * n], Some(&mut self.b[..16 * n + 16])),
            Ok(x) if x == 16 * n
        ) {
            return false;
        }
        self.whiten_all(data, n);
        let k1 = if enc { &mut self.k1e } else { &mut self.k1d };
        if !matches!(
            k1.cipher_update(&self.a[..len], Some(&mut self.b[..len + 16])),
            Ok(x) if x == len
        ) {
            return false;
        }
        // Byte-wise XORs of equal slices: the compiler vectorizes them.
        let out = data[..len].iter_mut().zip(&self.b[..len]);
        for ((d, b), t) in out.zip(&self.t[..len]) {
            *d = b ^ t;
        }
        true
    }
}
