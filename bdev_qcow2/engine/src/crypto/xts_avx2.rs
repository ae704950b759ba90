//! The tweak work of our XTS over AES-ECB (`evp_xts.rs`) in AVX2: per block `T·α^j` and the
//! two XORs around the AES. In portable Rust (SSE2 at most, the baseline of x86-64) that
//! work cost as much as the AES itself; here it is about a third of it. `pulp` compiles
//! these loops for AVX2 and checks the CPU at run time; its wrappers of the intrinsics are
//! safe (the `V3` token proves the CPU has them), so this crate stays without `unsafe`.
//!
//! A register holds two consecutive blocks' tweaks `[T·α^j, T·α^(j+1)]`; four of them
//! cover eight blocks, and each steps by `α^8`: a one-byte shift of each 128-bit lane, the
//! byte shifted out folded back in as `x^128 = x^7 + x^2 + x + 1` (IEEE 1619, little
//! endian).

use super::spec::SECTOR_BYTES;
use core::arch::x86_64::{__m128i, __m256i};
use pulp::x86::V3;
use pulp::NullaryFnOnce;

/// A CPU with AVX2, proven once.
#[derive(Clone, Copy)]
pub(super) struct Avx2(V3);

#[inline(always)]
fn load(b: &[u8]) -> __m256i {
    let mut w = [0u8; 32];
    w.copy_from_slice(&b[..32]);
    pulp::cast(w)
}

#[inline(always)]
fn store(b: &mut [u8], v: __m256i) {
    b[..32].copy_from_slice(&pulp::cast::<__m256i, [u8; 32]>(v));
}

/// Each 128-bit lane times `α^K` for a small `K` (`R` = 64 - `K`): the first tweaks of a
/// sector, all from its first pair at once rather than a chain.
macro_rules! times_alpha_k {
    ($name:ident, $k:literal, $r:literal) => {
        #[inline(always)]
        fn $name(s: V3, x: __m256i) -> __m256i {
            let a = s.avx2;
            let c = a._mm256_srli_epi64::<$r>(x);
            // The low half's top bits into the high half; the high half's fold back.
            let up =
                a._mm256_xor_si256(a._mm256_slli_epi64::<$k>(x), a._mm256_bslli_epi128::<8>(c));
            let r = a._mm256_bsrli_epi128::<8>(c);
            let red = a._mm256_xor_si256(
                a._mm256_xor_si256(r, a._mm256_slli_epi64::<1>(r)),
                a._mm256_xor_si256(a._mm256_slli_epi64::<2>(r), a._mm256_slli_epi64::<7>(r)),
            );
            a._mm256_xor_si256(up, red)
        }
    };
}
times_alpha_k!(times_alpha1, 1, 63);
times_alpha_k!(times_alpha2, 2, 62);
times_alpha_k!(times_alpha4, 4, 60);
times_alpha_k!(times_alpha6, 6, 58);

/// The tweaks of a sector's first eight blocks, `[T, T·α]` … `[T·α^6, T·α^7]`.
#[inline(always)]
fn first_eight(s: V3, first: &[u8]) -> [__m256i; 4] {
    let a = s.avx2;
    let mut w = [0u8; 16];
    w.copy_from_slice(&first[..16]);
    let t = a._mm256_broadcastsi128_si256(pulp::cast::<[u8; 16], __m128i>(w));
    let v0 = a._mm256_blend_epi32::<0xF0>(t, times_alpha1(s, t));
    [
        v0,
        times_alpha2(s, v0),
        times_alpha4(s, v0),
        times_alpha6(s, v0),
    ]
}

/// Each 128-bit lane times `α^8`.
#[inline(always)]
fn times_alpha8(s: V3, x: __m256i) -> __m256i {
    let a = s.avx2;
    // The byte shifted out (bits 120..127) lands in the low byte; times 0x87 carry-less
    // (at most 15 bits: no second reduction).
    let top = a._mm256_bsrli_epi128::<15>(x);
    let red = a._mm256_xor_si256(
        a._mm256_xor_si256(top, a._mm256_slli_epi64::<1>(top)),
        a._mm256_xor_si256(a._mm256_slli_epi64::<2>(top), a._mm256_slli_epi64::<7>(top)),
    );
    a._mm256_xor_si256(a._mm256_bslli_epi128::<1>(x), red)
}

/// Pass one: `out = inp ^ T` and `t = T` per block, each sector's chain from its first
/// tweak in `first`.
struct Whiten<'a> {
    s: V3,
    inp: &'a [u8],
    out: &'a mut [u8],
    t: &'a mut [u8],
    first: &'a [u8],
}

impl NullaryFnOnce for Whiten<'_> {
    type Output = ();

    #[inline(always)]
    fn call(self) {
        let a = self.s.avx2;
        let sectors = self
            .inp
            .chunks_exact(SECTOR_BYTES)
            .zip(self.out.chunks_exact_mut(SECTOR_BYTES))
            .zip(self.t.chunks_exact_mut(SECTOR_BYTES))
            .zip(self.first.chunks_exact(16));
        for (((i, o), t), f) in sectors {
            let mut v = first_eight(self.s, f);
            // Eight blocks (128 bytes) a round, the four chains side by side.
            let rounds = i.chunks_exact(128).zip(o.chunks_exact_mut(128));
            for ((ic, oc), tc) in rounds.zip(t.chunks_exact_mut(128)) {
                for (r, x) in v.iter_mut().enumerate() {
                    let at = 32 * r;
                    store(&mut oc[at..], a._mm256_xor_si256(load(&ic[at..]), *x));
                    store(&mut tc[at..], *x);
                    *x = times_alpha8(self.s, *x);
                }
            }
        }
    }
}

/// Pass two: `data = aes ^ t`.
struct Unwhiten<'a> {
    s: V3,
    data: &'a mut [u8],
    aes: &'a [u8],
    t: &'a [u8],
}

impl NullaryFnOnce for Unwhiten<'_> {
    type Output = ();

    #[inline(always)]
    fn call(self) {
        let a = self.s.avx2;
        let blocks = self
            .data
            .chunks_exact_mut(32)
            .zip(self.aes.chunks_exact(32));
        for ((d, x), t) in blocks.zip(self.t.chunks_exact(32)) {
            store(d, a._mm256_xor_si256(load(x), load(t)));
        }
    }
}

impl Avx2 {
    /// `Some` on a CPU with AVX2.
    pub(super) fn detect() -> Option<Self> {
        V3::try_new().map(Avx2)
    }

    /// For whole sectors: `out = inp ^ T` and `t = T` for every block, sector `k`'s first
    /// tweak being `first[16k..16k + 16]` (its IV through AES-k2).
    pub(super) fn whiten(self, inp: &[u8], out: &mut [u8], t: &mut [u8], first: &[u8]) {
        let s = self.0;
        s.vectorize(Whiten {
            s,
            inp,
            out,
            t,
            first,
        });
    }

    /// `data = aes ^ t` (equal lengths, whole sectors).
    pub(super) fn unwhiten(self, data: &mut [u8], aes: &[u8], t: &[u8]) {
        let s = self.0;
        s.vectorize(Unwhiten { s, data, aes, t });
    }
}
