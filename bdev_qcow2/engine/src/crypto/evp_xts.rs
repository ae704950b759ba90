//! XTS over whole 512-byte sectors with OpenSSL's AES-ECB doing the AES: EVP's own XTS
//! needs its IV reset per sector (the format's data unit), and that reset
//! (`EVP_CipherInit_ex`) costs about a third of a sector's time; an ECB context needs no
//! reset, so a whole request goes through AES in one update. Per chunk of sectors: their
//! IVs through AES-k2 in one update (the first tweak of each), then `data ^ tweak` into a
//! scratch buffer, AES-k1 over all of it in one update, and `^ tweak` back into the data.
//! Tweaks are `T·α^j` in GF(2^128) (IEEE 1619, little endian); no ciphertext stealing
//! (sectors are whole blocks). On a CPU with AVX2 the tweaks and the XORs run in AVX2
//! (`xts_avx2.rs`: the first pass writes the tweaks and `data ^ tweak` at once, AES-k1
//! runs in place); elsewhere in portable Rust.

use super::spec::SECTOR_BYTES;
use super::xts::times_alpha;
#[cfg(target_arch = "x86_64")]
use super::xts_avx2::Avx2;
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
    a: Scratch,
    /// AES output; the first tweaks.
    b: Scratch,
    /// Every block's tweak, as bytes.
    t: Scratch,
    /// The AVX2 passes, where the CPU has them.
    #[cfg(target_arch = "x86_64")]
    avx2: Option<Avx2>,
}

/// A buffer starting on a cache line: the AVX2 passes' 32-byte accesses then never
/// straddle two lines (such a split access costs another, about 15 % of those passes).
struct Scratch {
    buf: Vec<u8>,
    at: usize,
}

impl Scratch {
    fn new(len: usize) -> Self {
        let buf = vec![0; len + 64];
        let at = buf.as_ptr().align_offset(64).min(64);
        Scratch { buf, at }
    }

    fn get(&mut self) -> &mut [u8] {
        let len = self.buf.len() - 64;
        &mut self.buf[self.at..self.at + len]
    }
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

#[inline(always)]
fn load(b: &[u8]) -> u128 {
    let mut w = [0u8; 16];
    w.copy_from_slice(b);
    u128::from_le_bytes(w)
}

/// Sectors whose tweak chains run side by side (each step depends on the last).
const LANES: usize = 4;

/// Every block's tweak of `n` sectors into `t`, from their first tweaks in `first`: the
/// chains of [`LANES`] sectors interleaved, so that their steps overlap (the portable path).
fn tweaks(first: &[u8], t: &mut [u8], n: usize) {
    for g in (0..n).step_by(LANES) {
        let mut cur = [0u128; LANES];
        for (k, c) in cur.iter_mut().enumerate().take(n - g) {
            *c = load(&first[16 * (g + k)..16 * (g + k + 1)]);
        }
        // Lanes past `n` compute zeros into room `t` has (CHUNK is a multiple of LANES).
        for j in 0..BLOCKS {
            for (k, c) in cur.iter_mut().enumerate() {
                let at = ((g + k) * BLOCKS + j) * 16;
                t[at..at + 16].copy_from_slice(&c.to_le_bytes());
                *c = times_alpha(*c);
            }
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
            a: Scratch::new(CHUNK * SECTOR_BYTES + 16),
            b: Scratch::new(CHUNK * SECTOR_BYTES + 16),
            t: Scratch::new(CHUNK * SECTOR_BYTES),
            #[cfg(target_arch = "x86_64")]
            avx2: Avx2::detect(),
        }
    }

    /// Runs the portable passes even where AVX2 is present (the tests check both).
    #[cfg(test)]
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    pub(super) fn portable(mut self) -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            self.avx2 = None;
        }
        self
    }

    /// Another with the same keyed state, for another thread.
    pub(super) fn dup(&self) -> Option<Self> {
        Some(Self::with(
            copy(&self.k1e)?,
            copy(&self.k1d)?,
            copy(&self.k2)?,
        ))
    }

    /// Encrypts (`enc`) or decrypts `data` (whole sectors) in place; `iv(i, out)` writes
    /// the IVs of its sectors `i`, `i + 1`, … into `out`. Returns how many sectors it did:
    /// all, unless OpenSSL failed (then the rest is untouched, for the caller to finish).
    pub(super) fn run(
        &mut self,
        data: &mut [u8],
        iv: &dyn Fn(u64, &mut [[u8; 16]]),
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
        iv: &dyn Fn(u64, &mut [[u8; 16]]),
        enc: bool,
    ) -> bool {
        let n = data.len() / SECTOR_BYTES;
        let len = n * SECTOR_BYTES;
        let (a, b, t) = (self.a.get(), self.b.get(), self.t.get());
        // The first tweak of each sector: its IV through AES-k2.
        iv(first, a[..16 * n].as_chunks_mut::<16>().0);
        if !matches!(
            self.k2.cipher_update(&a[..16 * n], Some(&mut b[..16 * n + 16])),
            Ok(x) if x == 16 * n
        ) {
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        if let Some(avx2) = self.avx2 {
            let (a, t) = (&mut a[..len + 16], &mut t[..len]);
            avx2.whiten(&data[..len], &mut a[..len], t, &b[..16 * n]);
            let k1 = if enc { &mut self.k1e } else { &mut self.k1d };
            // In place: `a` has the block of room EVP wants.
            if !matches!(k1.cipher_update_inplace(a, len), Ok(x) if x == len) {
                return false;
            }
            avx2.unwhiten(&mut data[..len], &a[..len], t);
            return true;
        }
        tweaks(&b[..16 * n], t, n);
        // Byte-wise XORs of equal slices: the compiler vectorizes them.
        for ((a, d), t) in a[..len].iter_mut().zip(&data[..len]).zip(&t[..len]) {
            *a = d ^ t;
        }
        let k1 = if enc { &mut self.k1e } else { &mut self.k1d };
        if !matches!(
            k1.cipher_update(&a[..len], Some(&mut b[..len + 16])),
            Ok(x) if x == len
        ) {
            return false;
        }
        for ((d, b), t) in data[..len].iter_mut().zip(&b[..len]).zip(&t[..len]) {
            *d = b ^ t;
        }
        true
    }
}
