//! The AVX2 and AVX-512 VNNI kernels of the GEMM over packed Q8_0
//! activations (layout and method in [`super::gemm_q8_0`]), for Q8_0, Q5_0
//! and Q4_0 weights: a weight block is decoded once per row tile into 32
//! signed codes (`q - 16` for Q5_0, `q - 8` for Q4_0) and its f16 scale,
//! after which the three types share one inner loop.

use std::arch::x86_64::*;

use super::avx2::{bytes_from_bits_32, nibbles_32};
use super::gemm_q8_0::{
    CORR_AT, PACKED_BLOCK_BYTES, Q8_0_BYTES, Q8_0_TOKEN_GROUP, QK, QS_AT, SCALES_AT,
};
use super::util::{prefetch_ahead, prefetch_ahead_of};
use crate::types::GgmlType;

/// Weight rows per register tile.
const RM: usize = 4;
/// Blocks per K piece: the tile's weight scratch (RM rows x KC blocks x
/// 32 bytes = 8 KiB) lives on the stack and in L1. Longer rows are
/// done in pieces whose results are added to `out`.
const KC: usize = 64;

const Q5_0: u32 = GgmlType::Q5_0 as u32;
const Q4_0: u32 = GgmlType::Q4_0 as u32;

/// Bytes of one block of the weight type `T` (Q8_0, Q5_0 or Q4_0).
const fn block_bytes(t: u32) -> usize {
    match t {
        Q5_0 => 22,
        Q4_0 => 18,
        _ => Q8_0_BYTES,
    }
}

/// The 32 signed codes of the weight block at `src` (its f16 scale is at
/// byte 0 for all three types).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode<const T: u32>(src: *const u8) -> __m256i {
    match T {
        Q5_0 => {
            // 0xf0 where the fifth bit is clear: nibble | 0xf0 = nibble - 16.
            let hi = _mm256_andnot_si256(
                bytes_from_bits_32(src.add(2)),
                _mm256_set1_epi8(0xf0u8 as i8),
            );
            _mm256_or_si256(nibbles_32(src.add(6)), hi)
        }
        Q4_0 => _mm256_sub_epi8(nibbles_32(src.add(2)), _mm256_set1_epi8(8)),
        _ => _mm256_loadu_si256(src.add(2) as *const __m256i),
    }
}

/// Generates one ISA's GEMM: `$prep` maps a weight block's 32 quant
/// bytes to what the broadcast operand wants, `$init` gives the i32
/// accumulator's start for a packed block, `$dot` adds one broadcast
/// 4-byte weight chunk times one packed 8-token chunk. `$rn` is the
/// number of token groups per register tile (bounded by the registers).
macro_rules! tiled_gemm {
    ($name:ident, $feat:literal, rn = $rn:literal, $prep:ident, $init:ident, $dot:ident) => {
        /// See [`super::super::GemmFn`]; `T` is the weight type (Q8_0,
        /// Q5_0 or Q4_0).
        ///
        /// # Safety
        /// [`super::super::GemmFn`]'s contract.
        #[target_feature(enable = $feat)]
        pub(crate) unsafe fn $name<const T: u32>(
            cols: usize,
            w: &[u8],
            rows: usize,
            packed: &[u8],
            n: usize,
            out: &mut [f32],
        ) {
            #[target_feature(enable = $feat)]
            #[inline]
            unsafe fn row_tile<const T: u32, const M: usize>(
                nb: usize,
                w: *const u8,
                packed: *const u8,
                n: usize,
                out: *mut f32,
            ) {
                let bs = block_bytes(T);
                let wrow = nb * bs;
                let groups = n.div_ceil(Q8_0_TOKEN_GROUP);
                let mut wq = [0u8; RM * KC * QK];
                let mut dw = [0f32; RM * KC];
                let mut k0 = 0;
                while k0 < nb {
                    let kc = (nb - k0).min(KC);
                    // Row by row (front to back, as the prefetchers
                    // expect), while the next tile's rows are fetched:
                    // the group loop below is long enough to hide it.
                    if k0 == 0 {
                        // wrapping_add: past the last tile this points
                        // outside the matrix; a prefetch never faults.
                        let next = w.wrapping_add(M * wrow);
                        let mut off = 0;
                        while off < RM * wrow {
                            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(off) as *const i8);
                            off += 64;
                        }
                    }
                    for m in 0..M {
                        for k in 0..kc {
                            let src = w.add(m * wrow + (k0 + k) * bs);
                            dw[k * RM + m] =
                                half::f16::from_bits(u16::from_le_bytes([*src, *src.add(1)]))
                                    .to_f32();
                            let q = decode::<T>(src);
                            _mm256_storeu_si256(
                                wq.as_mut_ptr().add((k * RM + m) * QK) as *mut __m256i,
                                $prep(q),
                            );
                        }
                    }
                    let mut g = 0;
                    while groups - g >= $rn {
                        tile::<M, $rn>(nb, k0, kc, &wq, &dw, packed, g, n, out);
                        g += $rn;
                    }
                    while g < groups {
                        tile::<M, 1>(nb, k0, kc, &wq, &dw, packed, g, n, out);
                        g += 1;
                    }
                    k0 += kc;
                }
            }

            /// Rows `0..M` of the tile x token groups `g..g + N`, over
            /// blocks `k0..k0 + kc`; adds to `out` unless `k0 == 0`.
            #[target_feature(enable = $feat)]
            #[inline]
            #[allow(clippy::too_many_arguments)]
            unsafe fn tile<const M: usize, const N: usize>(
                nb: usize,
                k0: usize,
                kc: usize,
                wq: &[u8; RM * KC * QK],
                dw: &[f32; RM * KC],
                packed: *const u8,
                g: usize,
                n: usize,
                out: *mut f32,
            ) {
                let mut facc = [[_mm256_setzero_ps(); N]; M];
                for k in 0..kc {
                    let mut blk = [packed; N];
                    for j in 0..N {
                        blk[j] = packed.add(((g + j) * nb + k0 + k) * PACKED_BLOCK_BYTES);
                    }
                    let mut iacc = [[_mm256_setzero_si256(); N]; M];
                    for j in 0..N {
                        let init = $init(blk[j].add(CORR_AT));
                        for m in 0..M {
                            iacc[m][j] = init;
                        }
                    }
                    let wk = wq.as_ptr().add(k * RM * QK);
                    for c in 0..QK / 4 {
                        let mut av = [_mm256_setzero_si256(); N];
                        for j in 0..N {
                            av[j] =
                                _mm256_loadu_si256(blk[j].add(QS_AT + 32 * c) as *const __m256i);
                        }
                        for m in 0..M {
                            let wb = _mm256_set1_epi32(
                                (wk.add(m * QK + 4 * c) as *const i32).read_unaligned(),
                            );
                            for j in 0..N {
                                iacc[m][j] = $dot(iacc[m][j], wb, av[j]);
                            }
                        }
                    }
                    for j in 0..N {
                        let da = _mm256_loadu_ps(blk[j].add(SCALES_AT) as *const f32);
                        for m in 0..M {
                            let d = _mm256_mul_ps(_mm256_set1_ps(dw[k * RM + m]), da);
                            facc[m][j] =
                                _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[m][j]), d, facc[m][j]);
                        }
                    }
                }
                for m in 0..M {
                    for j in 0..N {
                        let t0 = (g + j) * Q8_0_TOKEN_GROUP;
                        let dst = out.add(m * n + t0);
                        let valid = (n - t0).min(Q8_0_TOKEN_GROUP);
                        if valid == Q8_0_TOKEN_GROUP {
                            let v = if k0 == 0 {
                                facc[m][j]
                            } else {
                                _mm256_add_ps(_mm256_loadu_ps(dst), facc[m][j])
                            };
                            _mm256_storeu_ps(dst, v);
                        } else {
                            let mut lanes = [0f32; Q8_0_TOKEN_GROUP];
                            _mm256_storeu_ps(lanes.as_mut_ptr(), facc[m][j]);
                            for (l, &v) in lanes.iter().enumerate().take(valid) {
                                if k0 == 0 {
                                    *dst.add(l) = v;
                                } else {
                                    *dst.add(l) += v;
                                }
                            }
                        }
                    }
                }
            }

            let nb = cols / QK;
            if nb == 0 {
                out[..rows * n].fill(0.0);
                return;
            }
            let wrow = nb * block_bytes(T);
            let (wp, pp, op) = (w.as_ptr(), packed.as_ptr(), out.as_mut_ptr());
            let mut r = 0;
            while r < rows {
                let (wr, or) = (wp.add(r * wrow), op.add(r * n));
                match rows - r {
                    1 => row_tile::<T, 1>(nb, wr, pp, n, or),
                    2 => row_tile::<T, 2>(nb, wr, pp, n, or),
                    3 => row_tile::<T, 3>(nb, wr, pp, n, or),
                    _ => row_tile::<T, RM>(nb, wr, pp, n, or),
                }
                r += RM;
            }
        }
    };
}

// ------------------------------------------------------------- AVX2

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn keep(q: __m256i) -> __m256i {
    q
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn zero_init(_corr: *const u8) -> __m256i {
    _mm256_setzero_si256()
}

/// `acc + sum of 4 products` per i32 lane: `|w| x sign(a, w)` in
/// `maddubs` (pairs fit i16: |w| <= 128, |a| <= 127), then `madd` by 1.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot_avx2(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
    let p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
    _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
}

tiled_gemm!(
    gemm_avx2,
    "avx2,fma,f16c",
    rn = 1,
    keep,
    zero_init,
    dot_avx2
);

// ------------------------------------------------------ matrix-vector

/// Per-row AVX2 `vec_dot`.
///
/// # Safety
/// [`super::MatvecFn`]'s contract for Q8_0 weights.
pub(crate) unsafe fn matvec_avx2(cols: usize, w: &[u8], rows: usize, act: &[u8], out: &mut [f32]) {
    let rb = cols / QK * Q8_0_BYTES;
    let dot = super::avx2::dot_fn(GgmlType::Q8_0).expect("AVX2 has a Q8_0 kernel");
    for i in 0..rows {
        let row = &w[i * rb..(i + 1) * rb];
        prefetch_ahead(row);
        out[i] = dot(cols, row, act);
    }
}

/// The AVX-512 VNNI kernels: built only by Rust 1.89+ (where AVX-512
/// intrinsics and target features are stable; build.rs sets
/// `mirage_avx512`), so the crate keeps building on its older MSRV.
#[cfg(mirage_avx512)]
#[allow(clippy::incompatible_msrv)] // gated on the compiler version above
pub(crate) mod vnni {
    use super::*;

    // --------------------------------------------------- AVX-512 VNNI

    /// `w + 128` as unsigned bytes (the `vpdpbusd` unsigned operand).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn bias_128(q: __m256i) -> __m256i {
        _mm256_xor_si256(q, _mm256_set1_epi8(0x80u8 as i8))
    }

    /// The packed `-128 * sum(a)` per token: with it as the start,
    /// `sum((w + 128) a)` ends at `sum(w a)`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn corr_init(corr: *const u8) -> __m256i {
        _mm256_loadu_si256(corr as *const __m256i)
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn dot_vnni(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, w, a)
    }

    tiled_gemm!(
        gemm_vnni,
        "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
        rn = 2,
        bias_128,
        corr_init,
        dot_vnni
    );

    const MV_KC: usize = 128;

    /// One row at a time, in steps of 8 blocks: each block biased to
    /// `w + 128` and multiplied with the activation block in one
    /// `vpdpbusd`, the eight 8-lane results reduced by `hadd` into one
    /// vector whose lane b is block b's exact sum, the activation's
    /// `-128 * sum(a)` per block added, then one convert and one FMA by the
    /// 8 blocks' `dw` (gathered, one `cvtph`) times their `da`. About 6
    /// vector ops per block against ~12 for the single-row kernel, whose
    /// per-block widening, convert and scalar scale products made decode
    /// compute-bound. Rows are read front to back (the hardware
    /// prefetchers follow that; a multi-row column order defeated them),
    /// each step asking for the bytes [`super::util::PREFETCH_AHEAD`]
    /// further on.
    ///
    /// # Safety
    /// [`super::super::MatvecFn`]'s contract.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    pub(crate) unsafe fn matvec_vnni<const T: u32>(
        cols: usize,
        w: &[u8],
        rows: usize,
        act: &[u8],
        out: &mut [f32],
    ) {
        let nb = cols / QK;
        if nb == 0 {
            out[..rows].fill(0.0);
            return;
        }
        let bs = block_bytes(T);
        let rb = nb * bs;
        let (wp, ap) = (w.as_ptr(), act.as_ptr());
        let bias = _mm256_set1_epi8(0x80u8 as i8);
        // Lane b of a gather: the f16 `d` of block b, `bs` bytes apart.
        let d_offsets = _mm256_mullo_epi32(
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            _mm256_set1_epi32(bs as i32),
        );
        let mut corr = [0i32; MV_KC];
        let mut da = [0f32; MV_KC];
        let mut k0 = 0;
        while k0 < nb {
            let kc = (nb - k0).min(MV_KC);
            for k in 0..kc {
                let y = ap.add((k0 + k) * Q8_0_BYTES);
                let s = _mm256_dpbusd_epi32(
                    _mm256_setzero_si256(),
                    bias,
                    _mm256_loadu_si256(y.add(2) as *const __m256i),
                );
                corr[k] = -hsum_i32(s);
                da[k] = half::f16::from_bits(u16::from_le_bytes([*y, *y.add(1)])).to_f32();
            }
            for r in 0..rows {
                let x0 = wp.add(r * rb + k0 * bs);
                let mut acc = _mm256_setzero_ps();
                let mut k = 0;
                while k < kc {
                    let m = (kc - k).min(8);
                    let x = x0.add(k * bs);
                    prefetch_ahead_of(x, m * bs);
                    let mut p = [_mm256_setzero_si256(); 8];
                    for (b, p) in p.iter_mut().enumerate().take(m) {
                        let q = decode::<T>(x.add(b * bs));
                        let a = _mm256_loadu_si256(
                            ap.add((k0 + k + b) * Q8_0_BYTES + 2) as *const __m256i
                        );
                        *p = _mm256_dpbusd_epi32(
                            _mm256_setzero_si256(),
                            _mm256_xor_si256(q, bias),
                            a,
                        );
                    }
                    let h01 = _mm256_hadd_epi32(p[0], p[1]);
                    let h23 = _mm256_hadd_epi32(p[2], p[3]);
                    let h45 = _mm256_hadd_epi32(p[4], p[5]);
                    let h67 = _mm256_hadd_epi32(p[6], p[7]);
                    let h0123 = _mm256_hadd_epi32(h01, h23);
                    let h4567 = _mm256_hadd_epi32(h45, h67);
                    let sums = _mm256_add_epi32(
                        _mm256_permute2x128_si256(h0123, h4567, 0x20),
                        _mm256_permute2x128_si256(h0123, h4567, 0x31),
                    );
                    let (dw, sums) = if m == 8 {
                        let g = _mm256_i32gather_epi32::<1>(x as *const i32, d_offsets);
                        let corr8 = _mm256_loadu_si256(corr.as_ptr().add(k) as *const __m256i);
                        (
                            _mm256_cvtph_ps(_mm256_cvtepi32_epi16(g)),
                            _mm256_add_epi32(sums, corr8),
                        )
                    } else {
                        // Tail: lanes past `m` get dw = 0 and no correction
                        // (their sums are 0), so they add nothing.
                        let mut d16 = [0u16; 8];
                        let mut c8 = [0i32; 8];
                        for b in 0..m {
                            d16[b] = u16::from_le_bytes([*x.add(b * bs), *x.add(b * bs + 1)]);
                            c8[b] = corr[k + b];
                        }
                        let corr8 = _mm256_loadu_si256(c8.as_ptr() as *const __m256i);
                        (
                            _mm256_cvtph_ps(_mm_loadu_si128(d16.as_ptr() as *const __m128i)),
                            _mm256_add_epi32(sums, corr8),
                        )
                    };
                    let d = _mm256_mul_ps(dw, _mm256_loadu_ps(da.as_ptr().add(k)));
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), d, acc);
                    k += m;
                }
                let v = hsum_ps(acc);
                if k0 == 0 {
                    out[r] = v;
                } else {
                    out[r] += v;
                }
            }
            k0 += kc;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn hsum_ps(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }
}
