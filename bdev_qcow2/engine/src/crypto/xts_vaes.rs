//! XTS over whole 512-byte sectors on a CPU with AVX-512 and VAES, in a build for such CPUs
//! (`target_feature` `vaes` and `avx512f` at compile time): the AES by RustCrypto's `aes`
//! 0.9 (its VAES-512 backend, four blocks per instruction; with the features known at
//! compile time its batches inline, 16.6 GB/s of AES-256 here; with its run-time detection
//! they do not, 7.1 GB/s, below OpenSSL's AES-NI, so other builds keep `evp_xts.rs`), the
//! tweak work in AVX-512 through `pulp` (safe wrappers: the `V4` token proves the CPU has
//! them, so this crate stays without `unsafe`). Per group of four sectors (2 KiB, in L1):
//! `data ^= T` in place while the tweaks go to a stack buffer, AES in place in the data, then
//! `data ^= T` again (a request shorter than a group makes its tweaks again instead). No scratch copy of the data, no per-thread state: the keyed ciphers
//! are immutable, shared by every thread.
//!
//! A register holds four consecutive blocks' tweaks `[T·α^j … T·α^(j+3)]`; four registers
//! cover sixteen blocks, each stepping by `α^16`: a two-byte shift of each 128-bit lane, the
//! 16 bits shifted out folded back in as `x^128 = x^7 + x^2 + x + 1` (IEEE 1619, little
//! endian).

use super::spec::SECTOR_BYTES;
use aes_vaes::cipher::array::Array;
use aes_vaes::cipher::{BlockCipherDecrypt, BlockCipherEncrypt, KeyInit};
use aes_vaes::{Aes128, Aes128Enc, Aes256, Aes256Enc, Block};
use core::arch::x86_64::{__m128i, __m512i};
use pulp::x86::V4;
use pulp::NullaryFnOnce;

/// Sectors per AES call: 2 KiB, 128 blocks (two of the VAES backend's 64-block batches).
const GROUP: usize = 4;
/// Sectors whose first tweaks go through AES-k2 in one call.
const CHUNK: usize = 16;
const _: () = assert!(CHUNK.is_multiple_of(GROUP));

/// The two keyed halves, data (`k1`, both directions) and tweak (`k2`, encryption only).
enum Keys {
    A128 { k1: Aes128, k2: Aes128Enc },
    A256 { k1: Aes256, k2: Aes256Enc },
}

/// XTS-AES-128 or -256 with VAES and AVX-512.
pub(super) struct VaesXts {
    keys: Keys,
    v4: V4,
}

/// A group's tweaks, on a cache line (64-byte accesses never straddle two).
#[repr(align(64))]
struct Tweaks([u8; GROUP * SECTOR_BYTES]);

#[inline(always)]
fn load(b: &[u8]) -> __m512i {
    let mut w = [0u8; 64];
    w.copy_from_slice(&b[..64]);
    pulp::cast(w)
}

#[inline(always)]
fn store(b: &mut [u8], v: __m512i) {
    b[..64].copy_from_slice(&pulp::cast::<__m512i, [u8; 64]>(v));
}

/// `r · (x^7 + x^2 + x + 1)` carry-less, for `r` below 2^57 in each 64-bit lane: the bits
/// shifted out of a lane folded back into its low end.
#[inline(always)]
fn fold(s: V4, r: __m512i) -> __m512i {
    let a = s.avx512f;
    let r3 = a._mm512_ternarylogic_epi64::<0x96>(
        r,
        a._mm512_slli_epi64::<1>(r),
        a._mm512_slli_epi64::<2>(r),
    );
    a._mm512_xor_si512(r3, a._mm512_slli_epi64::<7>(r))
}

/// Each 128-bit lane times `α^K` for a small constant `K` (`R` = 64 - `K`).
macro_rules! times_alpha_k {
    ($name:ident, $k:literal, $r:literal) => {
        #[inline(always)]
        fn $name(s: V4, x: __m512i) -> __m512i {
            let (a, b) = (s.avx512f, s.avx512bw);
            let c = a._mm512_srli_epi64::<$r>(x);
            // The low half's top bits into the high half; the high half's fold back.
            let up =
                a._mm512_xor_si512(a._mm512_slli_epi64::<$k>(x), b._mm512_bslli_epi128::<8>(c));
            a._mm512_xor_si512(up, fold(s, b._mm512_bsrli_epi128::<8>(c)))
        }
    };
}
times_alpha_k!(times_alpha4, 4, 60);
times_alpha_k!(times_alpha8, 8, 56);
times_alpha_k!(times_alpha12, 12, 52);

/// Each 128-bit lane times `α^16`: two bytes up, the 16 bits shifted out folded back.
#[inline(always)]
fn times_alpha16(s: V4, x: __m512i) -> __m512i {
    let b = s.avx512bw;
    let top = b._mm512_bsrli_epi128::<14>(x);
    s.avx512f
        ._mm512_xor_si512(b._mm512_bslli_epi128::<2>(x), fold(s, top))
}

/// The tweaks of a sector's first sixteen blocks, from its first tweak `t`.
#[inline(always)]
fn first_sixteen(s: V4, t: &[u8]) -> [__m512i; 4] {
    let (a, b) = (s.avx512f, s.avx512bw);
    let mut w = [0u8; 16];
    w.copy_from_slice(&t[..16]);
    let x = a._mm512_broadcast_i32x4(pulp::cast::<[u8; 16], __m128i>(w));
    // Lane L times α^L: a 128-bit shift by L bits, in 64-bit halves.
    let c = a._mm512_srlv_epi64(x, a._mm512_set_epi64(61, 61, 62, 62, 63, 63, 64, 64));
    let up = a._mm512_xor_si512(
        a._mm512_sllv_epi64(x, a._mm512_set_epi64(3, 3, 2, 2, 1, 1, 0, 0)),
        b._mm512_bslli_epi128::<8>(c),
    );
    let v0 = a._mm512_xor_si512(up, fold(s, b._mm512_bsrli_epi128::<8>(c)));
    [
        v0,
        times_alpha4(s, v0),
        times_alpha8(s, v0),
        times_alpha12(s, v0),
    ]
}

/// `data ^= T` per block of one sector, its chain from its first tweak `first`, and `t = T`
/// when given (the group's tweak buffer, which pass two XORs back; without one, as for a
/// request shorter than a group, pass two makes the tweaks again).
#[inline(always)]
fn whiten_sector(
    s: V4,
    d: &mut [u8; SECTOR_BYTES],
    mut t: Option<&mut [u8; SECTOR_BYTES]>,
    first: &[u8; 16],
) {
    let a = s.avx512f;
    let mut v = first_sixteen(s, first);
    // Sixteen blocks (256 bytes) a round, the four chains side by side.
    for half in [0, 256] {
        if half > 0 {
            for x in v.iter_mut() {
                *x = times_alpha16(s, *x);
            }
        }
        for (i, x) in v.iter().enumerate() {
            let o = half + i * 64;
            let w = a._mm512_xor_si512(load(&d[o..]), *x);
            store(&mut d[o..], w);
            if let Some(t) = t.as_deref_mut() {
                store(&mut t[o..], *x);
            }
        }
    }
}

/// Pass one (and, without a tweak buffer, pass two): `data ^= T` per block, each sector's
/// chain from its first tweak in `first`, keeping `T` in `t` when given.
struct Whiten<'a> {
    s: V4,
    data: &'a mut [u8],
    t: Option<&'a mut [u8]>,
    first: &'a [u8],
}

impl NullaryFnOnce for Whiten<'_> {
    type Output = ();

    #[inline(always)]
    fn call(self) {
        let s = self.s;
        let sectors = self.data.as_chunks_mut::<SECTOR_BYTES>().0.iter_mut();
        let first = self.first.as_chunks::<16>().0;
        // One loop per case, each with the test of `t` compiled out.
        match self.t {
            Some(t) => {
                let t = t.as_chunks_mut::<SECTOR_BYTES>().0.iter_mut();
                for ((d, t), f) in sectors.zip(t).zip(first) {
                    whiten_sector(s, d, Some(t), f);
                }
            }
            None => {
                for (d, f) in sectors.zip(first) {
                    whiten_sector(s, d, None, f);
                }
            }
        }
    }
}

/// Pass two: `data ^= t`.
struct Unwhiten<'a> {
    s: V4,
    data: &'a mut [u8],
    t: &'a [u8],
}

impl NullaryFnOnce for Unwhiten<'_> {
    type Output = ();

    #[inline(always)]
    fn call(self) {
        let a = self.s.avx512f;
        for (d, t) in self.data.chunks_exact_mut(64).zip(self.t.chunks_exact(64)) {
            store(d, a._mm512_xor_si512(load(d), load(t)));
        }
    }
}

/// `data` (whole blocks) as AES blocks, in place.
fn blocks(data: &mut [u8]) -> &mut [Block] {
    Array::cast_slice_from_core_mut(data.as_chunks_mut::<16>().0)
}

impl VaesXts {
    /// `key` both halves (32 or 64 bytes); `None` on a CPU without AVX-512 (F, BW, VL…),
    /// or a key of another length.
    pub(super) fn new(key: &[u8]) -> Option<Self> {
        let v4 = V4::try_new()?;
        let (k1, k2) = key.split_at(key.len() / 2);
        let keys = match k1.len() {
            16 => Keys::A128 {
                k1: Aes128::new_from_slice(k1).ok()?,
                k2: Aes128Enc::new_from_slice(k2).ok()?,
            },
            32 => Keys::A256 {
                k1: Aes256::new_from_slice(k1).ok()?,
                k2: Aes256Enc::new_from_slice(k2).ok()?,
            },
            _ => return None,
        };
        Some(VaesXts { keys, v4 })
    }

    /// Encrypts (`enc`) or decrypts `data` (whole sectors) in place; `iv(i, out)` writes
    /// the IVs of its sectors `i`, `i + 1`, … into `out`.
    pub(super) fn run(&self, data: &mut [u8], iv: &dyn Fn(u64, &mut [[u8; 16]]), enc: bool) {
        // Cleared only where used (`then_some` would clear it for every request).
        let mut t = if data.len() >= GROUP * SECTOR_BYTES {
            Some(Tweaks([0; GROUP * SECTOR_BYTES]))
        } else {
            None
        };
        for (c, chunk) in data.chunks_mut(CHUNK * SECTOR_BYTES).enumerate() {
            let n = chunk.len() / SECTOR_BYTES;
            // The first tweak of each sector: its IV through AES-k2.
            let mut first = [[0u8; 16]; CHUNK];
            iv((c * CHUNK) as u64, &mut first[..n]);
            let first_blocks = Array::cast_slice_from_core_mut(&mut first[..n]);
            match &self.keys {
                Keys::A128 { k2, .. } => k2.encrypt_blocks(first_blocks),
                Keys::A256 { k2, .. } => k2.encrypt_blocks(first_blocks),
            }
            let groups = chunk
                .chunks_mut(GROUP * SECTOR_BYTES)
                .zip(first[..n].chunks(GROUP));
            for (g, f) in groups {
                let (s, first, len) = (self.v4, f.as_flattened(), g.len());
                let Some(t) = t.as_mut() else {
                    let t = None;
                    s.vectorize(Whiten {
                        s,
                        data: g,
                        t,
                        first,
                    });
                    self.aes(blocks(g), enc);
                    let t = None;
                    s.vectorize(Whiten {
                        s,
                        data: g,
                        t,
                        first,
                    });
                    continue;
                };
                let t = &mut t.0[..len];
                s.vectorize(Whiten {
                    s,
                    data: g,
                    t: Some(&mut *t),
                    first,
                });
                self.aes(blocks(g), enc);
                s.vectorize(Unwhiten { s, data: g, t });
            }
        }
    }

    fn aes(&self, b: &mut [Block], enc: bool) {
        match (&self.keys, enc) {
            (Keys::A128 { k1, .. }, true) => k1.encrypt_blocks(b),
            (Keys::A128 { k1, .. }, false) => k1.decrypt_blocks(b),
            (Keys::A256 { k1, .. }, true) => k1.encrypt_blocks(b),
            (Keys::A256 { k1, .. }, false) => k1.decrypt_blocks(b),
        }
    }
}
