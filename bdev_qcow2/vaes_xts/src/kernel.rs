//! The kernel: AES key expansion with AES-NI, XTS with VAES-512 (four blocks a register)
//! and the tweaks in AVX-512. Every function here is compiled for those features; the
//! intrinsics are safe to call from them, and `ffi` calls in once the CPU is checked.
//!
//! A register holds four consecutive blocks' tweaks `[T·α^j … T·α^(j+3)]`; a sector's 32
//! are eight registers, the first four from its first tweak `T`, the other four those
//! times `α^16`: a two-byte shift of each 128-bit lane, the 16 bits shifted out folded back
//! in as `x^128 = x^7 + x^2 + x + 1` (IEEE 1619, little endian).

use crate::schedule::Schedule;
use crate::SECTOR_BYTES;
use core::arch::x86_64::*;

type Z = __m512i;

#[inline(always)]
fn load(b: &[u8]) -> Z {
    bytemuck::pod_read_unaligned(&b[..64])
}

#[inline(always)]
fn store(b: &mut [u8], v: Z) {
    b[..64].copy_from_slice(bytemuck::bytes_of(&v));
}

#[target_feature(enable = "aes")]
#[inline]
fn m128(b: [u8; 16]) -> __m128i {
    bytemuck::cast(b)
}

/// One step of the key expansion: `a` with each word XORed into the next, XOR `b` (the
/// `aeskeygenassist` word, already broadcast).
#[target_feature(enable = "aes")]
#[inline]
fn step(a: __m128i, b: __m128i) -> __m128i {
    let a = _mm_xor_si128(a, _mm_slli_si128::<4>(a));
    let a = _mm_xor_si128(a, _mm_slli_si128::<4>(a));
    let a = _mm_xor_si128(a, _mm_slli_si128::<4>(a));
    _mm_xor_si128(a, b)
}

/// The encryption and decryption (equivalent inverse cipher) round keys of a 16- or
/// 32-byte AES key.
#[target_feature(enable = "aes")]
pub(crate) fn expand(key: &[u8]) -> Option<(Schedule, Schedule)> {
    let mut k = [_mm_setzero_si128(); 15];
    macro_rules! r128 {
        ($i:literal, $rcon:literal) => {
            k[$i] = step(
                k[$i - 1],
                _mm_shuffle_epi32::<0xff>(_mm_aeskeygenassist_si128::<$rcon>(k[$i - 1])),
            )
        };
    }
    // AES-256: even keys from the one two back and the odd one before, with the round
    // constant; odd keys from the one two back and the even one before, without.
    macro_rules! r256 {
        ($i:literal, $rcon:literal) => {
            k[$i] = step(
                k[$i - 2],
                _mm_shuffle_epi32::<0xff>(_mm_aeskeygenassist_si128::<$rcon>(k[$i - 1])),
            );
        };
        ($i:literal) => {
            k[$i] = step(
                k[$i - 2],
                _mm_shuffle_epi32::<0xaa>(_mm_aeskeygenassist_si128::<0>(k[$i - 1])),
            );
        };
    }
    let word = |b: &[u8]| -> Option<[u8; 16]> { b.try_into().ok() };
    let rounds = match key.len() {
        16 => {
            k[0] = m128(word(key)?);
            r128!(1, 0x01);
            r128!(2, 0x02);
            r128!(3, 0x04);
            r128!(4, 0x08);
            r128!(5, 0x10);
            r128!(6, 0x20);
            r128!(7, 0x40);
            r128!(8, 0x80);
            r128!(9, 0x1b);
            r128!(10, 0x36);
            10
        }
        32 => {
            k[0] = m128(word(&key[..16])?);
            k[1] = m128(word(&key[16..])?);
            r256!(2, 0x01);
            r256!(3);
            r256!(4, 0x02);
            r256!(5);
            r256!(6, 0x04);
            r256!(7);
            r256!(8, 0x08);
            r256!(9);
            r256!(10, 0x10);
            r256!(11);
            r256!(12, 0x20);
            r256!(13);
            r256!(14, 0x40);
            14
        }
        _ => return None,
    };
    let mut enc = Schedule::zeroed(rounds);
    let mut dec = Schedule::zeroed(rounds);
    for (i, x) in k.iter().enumerate().take(rounds + 1) {
        enc.set(i, bytemuck::cast(*x));
        // The inverse cipher's keys: reversed, the inner ones through InvMixColumns.
        let d = if i == 0 || i == rounds {
            *x
        } else {
            _mm_aesimc_si128(*x)
        };
        dec.set(rounds - i, bytemuck::cast(d));
    }
    k = [_mm_setzero_si128(); 15];
    std::hint::black_box(&k);
    Some((enc, dec))
}

/// `r · (x^7 + x^2 + x + 1)` carry-less, for `r` below 2^57 in each 64-bit lane: the bits
/// shifted out of a lane folded back into its low end.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn fold(r: Z) -> Z {
    let r3 =
        _mm512_ternarylogic_epi64::<0x96>(r, _mm512_slli_epi64::<1>(r), _mm512_slli_epi64::<2>(r));
    _mm512_xor_si512(r3, _mm512_slli_epi64::<7>(r))
}

/// Each 128-bit lane times `α^K` for a small constant `K` (`R` = 64 - `K`).
macro_rules! times_alpha_k {
    ($name:ident, $k:literal, $r:literal) => {
        #[target_feature(enable = "avx512f,avx512bw")]
        #[inline]
        fn $name(x: Z) -> Z {
            let c = _mm512_srli_epi64::<$r>(x);
            // The low half's top bits into the high half; the high half's fold back.
            let up = _mm512_xor_si512(_mm512_slli_epi64::<$k>(x), _mm512_bslli_epi128::<8>(c));
            _mm512_xor_si512(up, fold(_mm512_bsrli_epi128::<8>(c)))
        }
    };
}
times_alpha_k!(times_alpha4, 4, 60);
times_alpha_k!(times_alpha8, 8, 56);
times_alpha_k!(times_alpha12, 12, 52);

/// Each 128-bit lane times `α^16`: two bytes up, the 16 bits shifted out folded back.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn times_alpha16(x: Z) -> Z {
    let top = _mm512_bsrli_epi128::<14>(x);
    _mm512_xor_si512(_mm512_bslli_epi128::<2>(x), fold(top))
}

/// A sector's 32 tweaks from its first, `x` (in every lane).
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn tweaks(x: Z) -> [Z; 8] {
    // Lane L times α^L: a 128-bit shift by L bits, in 64-bit halves.
    let c = _mm512_srlv_epi64(x, _mm512_set_epi64(61, 61, 62, 62, 63, 63, 64, 64));
    let up = _mm512_xor_si512(
        _mm512_sllv_epi64(x, _mm512_set_epi64(3, 3, 2, 2, 1, 1, 0, 0)),
        _mm512_bslli_epi128::<8>(c),
    );
    let t0 = _mm512_xor_si512(up, fold(_mm512_bsrli_epi128::<8>(c)));
    let (t1, t2, t3) = (times_alpha4(t0), times_alpha8(t0), times_alpha12(t0));
    [
        t0,
        t1,
        t2,
        t3,
        times_alpha16(t0),
        times_alpha16(t1),
        times_alpha16(t2),
        times_alpha16(t3),
    ]
}

/// A schedule's round keys, each in all four lanes.
#[target_feature(enable = "avx512f")]
#[inline]
fn broadcast(s: &Schedule) -> [Z; 15] {
    let mut k = [_mm512_setzero_si512(); 15];
    for (i, z) in k.iter_mut().enumerate().take(s.rounds() + 1) {
        *z = _mm512_broadcast_i32x4(bytemuck::cast(s.key(i)));
    }
    k
}

/// Lane `j` (0..4) of `t` in every lane.
#[target_feature(enable = "avx512f")]
#[inline]
fn lane(t: Z, j: usize) -> Z {
    match j {
        0 => _mm512_shuffle_i64x2::<0x00>(t, t),
        1 => _mm512_shuffle_i64x2::<0x55>(t, t),
        2 => _mm512_shuffle_i64x2::<0xaa>(t, t),
        _ => _mm512_shuffle_i64x2::<0xff>(t, t),
    }
}

/// One sector in place: eight registers of four blocks, each XORed with its tweak and the
/// first round key in one instruction, the rounds side by side, the tweak folded into the
/// last round key (`aes*last` ends with an XOR of its key).
#[target_feature(enable = "avx512f,avx512bw,vaes")]
#[inline]
fn sector<const ENC: bool>(k: &[Z; 15], rounds: usize, d: &mut [u8; SECTOR_BYTES], first: Z) {
    let t = tweaks(first);
    let mut b = [_mm512_setzero_si512(); 8];
    for ((v, t), o) in b.iter_mut().zip(&t).zip((0..).step_by(64)) {
        *v = _mm512_ternarylogic_epi64::<0x96>(load(&d[o..]), *t, k[0]);
    }
    for r in &k[1..rounds] {
        for v in b.iter_mut() {
            *v = if ENC {
                _mm512_aesenc_epi128(*v, *r)
            } else {
                _mm512_aesdec_epi128(*v, *r)
            };
        }
    }
    for ((v, t), o) in b.iter().zip(&t).zip((0..).step_by(64)) {
        let last = _mm512_xor_si512(k[rounds], *t);
        let out = if ENC {
            _mm512_aesenclast_epi128(*v, last)
        } else {
            _mm512_aesdeclast_epi128(*v, last)
        };
        store(&mut d[o..], out);
    }
}

/// Sectors whose first tweaks are made together (four registers of AES-k2 side by side,
/// rather than one 14-round chain at a time in front of each group's sectors).
const BATCH: usize = 16;

/// XTS over `data`'s whole sectors, sector `i` with the IV `ivs[i]`; `k1` the data key's
/// schedule in the direction `ENC`, `k2` the tweak key's (encryption).
#[target_feature(enable = "aes,avx512f,avx512bw,vaes")]
pub(crate) fn xts<const ENC: bool>(
    k1: &Schedule,
    k2: &Schedule,
    data: &mut [u8],
    ivs: &[[u8; 16]],
) {
    let (rk1, rk2) = (broadcast(k1), broadcast(k2));
    let sectors = data.as_chunks_mut::<SECTOR_BYTES>().0;
    for (batch, iv) in sectors.chunks_mut(BATCH).zip(ivs.chunks(BATCH)) {
        // The batch's first tweaks: its IVs through AES-k2, four a register.
        let mut w = [0u8; BATCH * 16];
        w[..iv.len() * 16].copy_from_slice(iv.as_flattened());
        let first = encrypt16(&rk2, k2.rounds(), &w, iv.len().div_ceil(4));
        let groups = batch.chunks_mut(4).zip(first).zip(iv.chunks(4));
        for ((group, first), iv) in groups {
            for (j, d) in group.iter_mut().take(iv.len()).enumerate() {
                sector::<ENC>(&rk1, k1.rounds(), d, lane(first, j));
            }
        }
    }
}

/// The first `n` (1..=4) registers of `w` through AES (encryption), side by side.
#[target_feature(enable = "avx512f,vaes")]
#[inline]
fn encrypt16(k: &[Z; 15], rounds: usize, w: &[u8; BATCH * 16], n: usize) -> [Z; 4] {
    let mut x = [_mm512_setzero_si512(); 4];
    for (v, o) in x.iter_mut().zip((0..).step_by(64)).take(n) {
        *v = _mm512_xor_si512(load(&w[o..]), k[0]);
    }
    for r in &k[1..rounds] {
        for v in x.iter_mut().take(n) {
            *v = _mm512_aesenc_epi128(*v, *r);
        }
    }
    for v in x.iter_mut().take(n) {
        *v = _mm512_aesenclast_epi128(*v, k[rounds]);
    }
    x
}
