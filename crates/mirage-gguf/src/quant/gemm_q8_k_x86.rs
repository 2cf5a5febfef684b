//! The AVX2 and AVX-512 VNNI kernels of the K-quant GEMM (layouts and the
//! exactness argument in [`super::gemm_q8_k`]).
//!
//! Loop nest of one call (one task's contiguous weight rows):
//! - row panels of [`MB`] rows, and in each K pieces of [`KC`]
//!   super-blocks: the panel's piece is unpacked once into a stack scratch
//!   of [`UnpackedSb`] (56 KiB, L2-resident);
//! - then for every pair of token groups (16 tokens; their packed piece,
//!   20 KiB, stays in L1) every register tile of 4 rows runs over the
//!   piece, adding to `out` (loaded back when the piece is not the first).
//!   The weight chunk is the broadcast operand, so `vpdpbusd` takes it
//!   straight from memory (`{1to8}`).
//!
//! So the weights are read from memory and unpacked once per batch, the
//! activations once per row panel, and each broadcast weight chunk and
//! each activation vector feeds several `vpdpbusd`s from registers.

use std::arch::x86_64::*;

use super::gemm_q8_k::{
    i16_pair, UnpackedSb, B16_AT, B32_AT, D_AT, K_TOKEN_GROUP, PACKED_SB_BYTES, QS_AT,
};
use crate::types::QK_K;

/// Rows per panel: unpacked once per K piece, then reused by every token.
const MB: usize = 32;
/// Super-blocks per K piece.
const KC: usize = 4;

/// Which K-quant a kernel reads (a const parameter of the generic code).
pub(crate) const Q4K: u8 = 0;
pub(crate) const Q5K: u8 = 1;
pub(crate) const Q6K: u8 = 2;

const fn block_bytes(kind: u8) -> usize {
    match kind {
        Q4K => 144,
        Q5K => 176,
        _ => 210,
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fp16(p: *const u8) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([*p, *p.add(1)])).to_f32()
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn srl16(v: __m256i, count: i32) -> __m256i {
    _mm256_srl_epi16(v, _mm_cvtsi32_si128(count))
}

/// The sum of the unsigned bytes of 64-bit quarters `first..first + n` of `v`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn byte_sum(v: __m256i, first: usize, n: usize) -> i32 {
    let mut q = [0u64; 4];
    _mm256_storeu_si256(
        q.as_mut_ptr() as *mut __m256i,
        _mm256_sad_epu8(v, _mm256_setzero_si256()),
    );
    q[first..first + n].iter().sum::<u64>() as i32
}

/// Unpacks one Q4_K (`FIVE` false) or Q5_K super-block at `x` into `u`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_q45_k<const FIVE: bool>(x: *const u8, u: *mut UnpackedSb) {
    let qs_at = if FIVE { 48 } else { 16 };
    let (m4, m1) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(1));
    let hbits = if FIVE {
        load(x.add(16))
    } else {
        _mm256_setzero_si256()
    };
    let codes = (*u).codes.as_mut_ptr();
    for c in 0..4 {
        let bits = load(x.add(qs_at + 32 * c));
        let mut lo = _mm256_and_si256(bits, m4);
        let mut hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
        if FIVE {
            let b0 = _mm256_and_si256(srl16(hbits, (2 * c) as i32), m1);
            let b1 = _mm256_and_si256(srl16(hbits, (2 * c + 1) as i32), m1);
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(b0, 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(b1, 4));
        }
        _mm256_storeu_si256(codes.add(64 * c) as *mut __m256i, lo);
        _mm256_storeu_si256(codes.add(64 * c + 32) as *mut __m256i, hi);
        (*u).corr[2 * c] = -128 * byte_sum(lo, 0, 4);
        (*u).corr[2 * c + 1] = -128 * byte_sum(hi, 0, 4);
    }
    // ggml's utmp shuffle: bytes 0..8 the 6-bit scales, 8..16 the mins.
    let sm: [u8; 16] = std::mem::transmute(super::avx2::scales_mins_k4(x.add(4)));
    for j in 0..8 {
        (*u).scales[j] = sm[j] as i32;
    }
    for q in 0..4 {
        (*u).mins[q] = i16_pair(sm[8 + 2 * q] as i32, sm[9 + 2 * q] as i32);
    }
    (*u).d = fp16(x);
    (*u).dmin = fp16(x.add(2));
}

/// Unpacks one Q6_K super-block at `x` into `u` (codes 0..=63, the -32
/// left to the kernel).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_q6_k(x: *const u8, u: *mut UnpackedSb) {
    let (m4, m3) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(3));
    let codes = (*u).codes.as_mut_ptr();
    for h in 0..2 {
        let b1 = load(x.add(64 * h));
        let b2 = load(x.add(64 * h + 32));
        let hb = load(x.add(128 + 32 * h));
        let lows = [
            _mm256_and_si256(b1, m4),
            _mm256_and_si256(b2, m4),
            _mm256_and_si256(_mm256_srli_epi16(b1, 4), m4),
            _mm256_and_si256(_mm256_srli_epi16(b2, 4), m4),
        ];
        for (k, low) in lows.into_iter().enumerate() {
            let high = _mm256_and_si256(srl16(hb, 2 * k as i32), m3);
            let q = _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
            _mm256_storeu_si256(codes.add(128 * h + 32 * k) as *mut __m256i, q);
            let j = 8 * h + 2 * k;
            (*u).corr[j] = -128 * byte_sum(q, 0, 2);
            (*u).corr[j + 1] = -128 * byte_sum(q, 2, 2);
        }
    }
    let sc = |j: usize| *x.add(192 + j) as i8 as i32;
    for j in 0..16 {
        (*u).scales[j] = sc(j);
    }
    for p in 0..8 {
        (*u).mins[p] = i16_pair(sc(2 * p), sc(2 * p + 1));
    }
    (*u).d = fp16(x.add(208));
    (*u).dmin = 0.0;
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack<const KIND: u8>(x: *const u8, u: *mut UnpackedSb) {
    match KIND {
        Q4K => unpack_q45_k::<false>(x, u),
        Q5K => unpack_q45_k::<true>(x, u),
        _ => unpack_q6_k(x, u),
    }
}

/// Generates one ISA's kernels: `$dot4(acc, a, w)` adds, per i32 lane, the
/// products of 4 biased (unsigned) quants `a` and 4 code bytes `w`;
/// `$dot2(acc, x, y)` the products of two i16 pairs. `$rm` x `$rn` is the
/// register tile (rows x token groups), bounded by the vector registers.
macro_rules! kquant_gemm {
    ($feat:literal, rm = $rm:literal, rn = $rn:literal, $dot4:ident, $dot2:ident) => {
        /// Rows `0..M` x token groups `0..N` of a tile over the `kc`
        /// super-blocks of a piece. `ub` is the tile's first row in the
        /// panel scratch (row m, super-block k at `ub + m * KC + k`),
        /// `blk0` the first group's first packed super-block of the piece,
        /// `gstride` the bytes between groups, `out` the tile's output
        /// (row m, token t at `out + m * n + t`, t counted from the first
        /// group's first token `t0`).
        #[target_feature(enable = $feat)]
        #[inline]
        #[allow(clippy::too_many_arguments)]
        unsafe fn tile<const M: usize, const N: usize, const KIND: u8>(
            ub: *const UnpackedSb,
            kc: usize,
            blk0: *const u8,
            gstride: usize,
            first: bool,
            out: *mut f32,
            n: usize,
            t0: usize,
        ) {
            let q6 = KIND == Q6K;
            let mut valid = [0usize; N];
            for j in 0..N {
                valid[j] = (n - (t0 + j * K_TOKEN_GROUP)).min(K_TOKEN_GROUP);
            }
            let mut facc = [[_mm256_setzero_ps(); N]; M];
            if !first {
                for m in 0..M {
                    for j in 0..N {
                        let src = out.add(m * n + t0 + j * K_TOKEN_GROUP);
                        facc[m][j] = if valid[j] == K_TOKEN_GROUP {
                            _mm256_loadu_ps(src)
                        } else {
                            let mut lanes = [0f32; K_TOKEN_GROUP];
                            for l in 0..valid[j] {
                                lanes[l] = *src.add(l);
                            }
                            _mm256_loadu_ps(lanes.as_ptr())
                        };
                    }
                }
            }
            let (subs, chunks) = if q6 { (16, 4) } else { (8, 8) };
            let (pairs, pairs_at) = if q6 { (8, B16_AT) } else { (4, B32_AT) };
            for k in 0..kc {
                let mut blk = [blk0; N];
                for j in 0..N {
                    blk[j] = blk0.add(j * gstride + k * PACKED_SB_BYTES);
                }
                let mut w = [ub; M];
                for m in 0..M {
                    w[m] = ub.add(m * KC + k);
                }
                let mut isum = [[_mm256_setzero_si256(); N]; M];
                for s in 0..subs {
                    let mut iacc = [[_mm256_setzero_si256(); N]; M];
                    for m in 0..M {
                        let c0 = _mm256_set1_epi32((*w[m]).corr[s]);
                        for j in 0..N {
                            iacc[m][j] = c0;
                        }
                    }
                    for c in 0..chunks {
                        let cc = s * chunks + c;
                        let mut av = [_mm256_setzero_si256(); N];
                        for j in 0..N {
                            av[j] = load(blk[j].add(QS_AT + 32 * cc));
                        }
                        for m in 0..M {
                            let wb = _mm256_set1_epi32(
                                ((*w[m]).codes.as_ptr().add(4 * cc) as *const i32).read_unaligned(),
                            );
                            for j in 0..N {
                                iacc[m][j] = $dot4(iacc[m][j], av[j], wb);
                            }
                        }
                    }
                    for m in 0..M {
                        let sc = _mm256_set1_epi32((*w[m]).scales[s]);
                        for j in 0..N {
                            isum[m][j] =
                                _mm256_add_epi32(isum[m][j], _mm256_mullo_epi32(iacc[m][j], sc));
                        }
                    }
                }
                let mut msum = [[_mm256_setzero_si256(); N]; M];
                for p in 0..pairs {
                    let mut bv = [_mm256_setzero_si256(); N];
                    for j in 0..N {
                        bv[j] = load(blk[j].add(pairs_at + 32 * p));
                    }
                    for m in 0..M {
                        let mp = _mm256_set1_epi32((*w[m]).mins[p]);
                        for j in 0..N {
                            msum[m][j] = $dot2(msum[m][j], mp, bv[j]);
                        }
                    }
                }
                for j in 0..N {
                    let da = _mm256_loadu_ps(blk[j].add(D_AT) as *const f32);
                    for m in 0..M {
                        let dd = _mm256_mul_ps(da, _mm256_set1_ps((*w[m]).d));
                        // The scalar kernels' expressions, operation for
                        // operation (no FMA), so the sums are identical.
                        let t = if q6 {
                            let isum =
                                _mm256_sub_epi32(isum[m][j], _mm256_slli_epi32(msum[m][j], 5));
                            _mm256_mul_ps(dd, _mm256_cvtepi32_ps(isum))
                        } else {
                            let dm = _mm256_mul_ps(da, _mm256_set1_ps((*w[m]).dmin));
                            _mm256_sub_ps(
                                _mm256_mul_ps(dd, _mm256_cvtepi32_ps(isum[m][j])),
                                _mm256_mul_ps(dm, _mm256_cvtepi32_ps(msum[m][j])),
                            )
                        };
                        facc[m][j] = _mm256_add_ps(facc[m][j], t);
                    }
                }
            }
            for m in 0..M {
                for j in 0..N {
                    let dst = out.add(m * n + t0 + j * K_TOKEN_GROUP);
                    if valid[j] == K_TOKEN_GROUP {
                        _mm256_storeu_ps(dst, facc[m][j]);
                    } else {
                        let mut lanes = [0f32; K_TOKEN_GROUP];
                        _mm256_storeu_ps(lanes.as_mut_ptr(), facc[m][j]);
                        for l in 0..valid[j] {
                            *dst.add(l) = lanes[l];
                        }
                    }
                }
            }
        }

        /// One task's rows; see the module docs for the loop nest.
        ///
        /// # Safety
        /// [`super::super::GemmFn`]'s contract for a K-quant of kind `KIND`.
        #[target_feature(enable = $feat)]
        pub(crate) unsafe fn gemm<const KIND: u8>(
            cols: usize,
            w: &[u8],
            rows: usize,
            packed: &[u8],
            n: usize,
            out: &mut [f32],
        ) {
            let bs = block_bytes(KIND);
            let nsb = cols / QK_K;
            if nsb == 0 {
                out[..rows * n].fill(0.0);
                return;
            }
            let wrow = nsb * bs;
            let groups = n.div_ceil(K_TOKEN_GROUP);
            let gstride = nsb * PACKED_SB_BYTES;
            let mut scratch = [UnpackedSb::ZERO; MB * KC];
            let (wp, pp, op) = (w.as_ptr(), packed.as_ptr(), out.as_mut_ptr());
            let mut r0 = 0;
            while r0 < rows {
                let mb = (rows - r0).min(MB);
                let mut k0 = 0;
                while k0 < nsb {
                    let kc = (nsb - k0).min(KC);
                    for m in 0..mb {
                        for k in 0..kc {
                            unpack::<KIND>(
                                wp.add((r0 + m) * wrow + (k0 + k) * bs),
                                scratch.as_mut_ptr().add(m * KC + k),
                            );
                        }
                    }
                    let mut g = 0;
                    while g < groups {
                        // Whole register tiles of token groups, then one
                        // group at a time.
                        let ng = if groups - g >= $rn { $rn } else { 1 };
                        let blk0 = pp.add(g * gstride + k0 * PACKED_SB_BYTES);
                        let t0 = g * K_TOKEN_GROUP;
                        let mut m0 = 0;
                        while m0 < mb {
                            let mm = (mb - m0).min($rm);
                            let ub = scratch.as_ptr().add(m0 * KC);
                            let o = op.add((r0 + m0) * n);
                            let f = k0 == 0;
                            macro_rules! go {
                                ($m:expr, $n:expr) => {
                                    tile::<{ $m }, { $n }, KIND>(ub, kc, blk0, gstride, f, o, n, t0)
                                };
                            }
                            match (mm, ng == 1) {
                                (1, true) => go!(1, 1),
                                (2, true) => go!(2, 1),
                                (3, true) => go!(3, 1),
                                (_, true) => go!($rm, 1),
                                (1, false) => go!(1, $rn),
                                (2, false) => go!(2, $rn),
                                (3, false) => go!(3, $rn),
                                (_, false) => go!($rm, $rn),
                            }
                            m0 += $rm;
                        }
                        g += ng;
                    }
                    k0 += kc;
                }
                r0 += MB;
            }
        }
    };
}

/// The AVX2 kernels: `maddubs` (the codes are at most 63, so the i16 pair
/// sums of biased quants times codes, at most 2 * 255 * 63, never
/// saturate) and `madd` by 1.
pub(crate) mod avx2 {
    use super::*;

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dot4(acc: __m256i, a: __m256i, w: __m256i) -> __m256i {
        let p = _mm256_maddubs_epi16(a, w);
        _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dot2(acc: __m256i, x: __m256i, y: __m256i) -> __m256i {
        _mm256_add_epi32(acc, _mm256_madd_epi16(x, y))
    }

    kquant_gemm!("avx2,fma,f16c", rm = 2, rn = 2, dot4, dot2);
}

/// The AVX-512 VNNI kernels (256-bit vectors, AVX512VL): `vpdpbusd` and
/// `vpdpwssd`, and 32 vector registers for a 4 x 2 tile.
#[cfg(mirage_avx512)]
#[allow(clippy::incompatible_msrv)] // gated on the compiler version (build.rs)
pub(crate) mod vnni {
    use super::*;

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn dot4(acc: __m256i, a: __m256i, w: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, a, w)
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn dot2(acc: __m256i, x: __m256i, y: __m256i) -> __m256i {
        _mm256_dpwssd_epi32(acc, x, y)
    }

    kquant_gemm!(
        "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
        rm = 4,
        rn = 3,
        dot4,
        dot2
    );
}
