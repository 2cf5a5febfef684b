//! AVX-512 VNNI matrix-vector kernels (decode) for Q4_K, Q5_K and Q6_K
//! weights against one Q8_K activation row, bit-identical to the scalar
//! `vec_dot` of every row.
//!
//! Decode reads every weight byte once per token, so it runs at memory
//! bandwidth only if unpacking a super-block costs less than fetching it.
//! The single-row AVX2 kernels spend about 90 vector instructions per
//! Q4_K super-block (pair sums through `maddubs`/`madd`, scales shuffled
//! into place, a horizontal sum and the float expression per block); these
//! spend about 40: each 32-code run of unsigned codes meets its 32 quants
//! in one `vpdpbusd`, the eight runs' lanes are reduced by a `hadd` tree
//! into one vector (lane j = sub-block j's sum), one `vpmulld` applies the
//! eight scales, and eight super-blocks' vectors (four lanes of scaled
//! sums beside four of mins times quant sums, one `madd`) are reduced the
//! same way so that the float expression runs once per 8 super-blocks, in
//! lanes. Each row's per-super-block terms are then added to its sum in
//! super-block order, as the scalar kernel does, so results are exact.
//! Rows are read front to back (the hardware prefetchers follow that).

use std::arch::x86_64::*;

/// Super-blocks whose activation terms are computed per piece (stack
/// arrays); longer rows go in pieces, each continuing the row's sum.
const MVK: usize = 64;

/// Lane `b` of the result: the sum of `v[b]`'s eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn reduce8(v: &[__m256i; 8]) -> __m256i {
    let h01 = _mm256_hadd_epi32(v[0], v[1]);
    let h23 = _mm256_hadd_epi32(v[2], v[3]);
    let h45 = _mm256_hadd_epi32(v[4], v[5]);
    let h67 = _mm256_hadd_epi32(v[6], v[7]);
    let h0123 = _mm256_hadd_epi32(h01, h23);
    let h4567 = _mm256_hadd_epi32(h45, h67);
    _mm256_add_epi32(
        _mm256_permute2x128_si256(h0123, h4567, 0x20),
        _mm256_permute2x128_si256(h0123, h4567, 0x31),
    )
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn load(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// The f32 values of eight f16 bit patterns held in the low halves of `v`'s
/// i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn f16_lanes(v: __m256i) -> __m256 {
    _mm256_cvtph_ps(_mm256_cvtepi32_epi16(v))
}

/// Adds `t[0..m]` to `sum` in order (the scalar kernel's summation).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn add_lanes(sum: f32, t: __m256, m: usize) -> f32 {
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), t);
    let mut s = sum;
    for &v in &lanes[..m] {
        s += v;
    }
    s
}

/// `SPREAD[j]` (for `_mm256_shuffle_epi8`) copies i16 lane `j` of each
/// 128-bit half into all eight lanes of that half.
const SPREAD: [__m256i; 8] = {
    let mut t = [[0u8; 32]; 8];
    let mut j = 0;
    while j < 8 {
        let mut i = 0;
        while i < 32 {
            t[j][i] = (2 * j + i % 2) as u8;
            i += 1;
        }
        j += 1;
    }
    // SAFETY: [u8; 32] and __m256i have the same size, any bits are valid.
    unsafe { std::mem::transmute::<[[u8; 32]; 8], [__m256i; 8]>(t) }
};

/// Q4_K (`FIVE` false) or Q5_K weights; see the module docs.
///
/// # Safety
/// [`super::MatvecFn`]'s contract for Q4_K/Q5_K weights.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub(crate) unsafe fn matvec_q45_k<const FIVE: bool>(
    cols: usize,
    w: &[u8],
    rows: usize,
    act: &[u8],
    out: &mut [f32],
) {
    let (bs, qs_at) = if FIVE { (176, 48) } else { (144, 16) };
    let nsb = cols / 256;
    if nsb == 0 {
        out[..rows].fill(0.0);
        return;
    }
    let rb = nsb * bs;
    let (wp, ap) = (w.as_ptr(), act.as_ptr());
    let (m4, m1) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(1));
    let mut dy = [0f32; MVK];
    // Per super-block the eight 32-element quant sums (the mins' partners),
    // as i16 (at most 32 * 128 in magnitude).
    let mut b32 = [[0i16; 8]; MVK];
    let mut k0 = 0;
    while k0 < nsb {
        let kc = (nsb - k0).min(MVK);
        for k in 0..kc {
            let y = ap.add((k0 + k) * 292);
            dy[k] = (y as *const f32).read_unaligned();
            let bsum = |j: usize| (y.add(260 + 2 * j) as *const i16).read_unaligned();
            for j in 0..8 {
                b32[k][j] = bsum(2 * j) + bsum(2 * j + 1);
            }
        }
        for (r, o) in out.iter_mut().enumerate().take(rows) {
            let x0 = wp.add(r * rb + k0 * bs);
            let mut sum = if k0 == 0 { 0.0 } else { *o };
            let mut k = 0;
            while k < kc {
                let m = (kc - k).min(8);
                // Per super-block b: lanes 0..4 sum to its isum (the
                // scaled code-times-quant sums), lanes 4..8 to its summs
                // (the mins times the quant sums).
                let mut p = [_mm256_setzero_si256(); 8];
                let mut dd = [0i32; 8];
                for b in 0..m {
                    let x = x0.add((k + b) * bs);
                    let y = ap.add((k0 + k + b) * 292);
                    let sm = super::avx2::scales_mins_k4(x.add(4));
                    let mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(
                        (sm[2] as u64 | (sm[3] as u64) << 32) as i64,
                    ));
                    let msum = _mm_madd_epi16(
                        mins,
                        _mm_loadu_si128(b32[k + b].as_ptr() as *const __m128i),
                    );
                    dd[b] = (x as *const i32).read_unaligned();
                    // The eight scales as i16 in both 128-bit halves.
                    let sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(
                        (sm[0] as u64 | (sm[1] as u64) << 32) as i64,
                    )));
                    let hbits = if FIVE {
                        load(x.add(16))
                    } else {
                        _mm256_setzero_si256()
                    };
                    let mut acc = _mm256_setzero_si256();
                    for c in 0..4 {
                        let bits = load(x.add(qs_at + 32 * c));
                        let mut lo = _mm256_and_si256(bits, m4);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
                        if FIVE {
                            let sh = _mm_cvtsi32_si128(2 * c as i32);
                            let b0 = _mm256_and_si256(_mm256_srl_epi16(hbits, sh), m1);
                            let b1 = _mm256_and_si256(
                                _mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * c as i32 + 1)),
                                m1,
                            );
                            lo = _mm256_or_si256(lo, _mm256_slli_epi16(b0, 4));
                            hi = _mm256_or_si256(hi, _mm256_slli_epi16(b1, 4));
                        }
                        // Pair sums of codes times quants (at most 2 * 31 *
                        // 128, exact in i16), times the sub-block's scale.
                        let pl = _mm256_maddubs_epi16(lo, load(y.add(4 + 64 * c)));
                        let ph = _mm256_maddubs_epi16(hi, load(y.add(36 + 64 * c)));
                        acc = _mm256_dpwssd_epi32(acc, pl, _mm256_shuffle_epi8(sc, SPREAD[2 * c]));
                        acc = _mm256_dpwssd_epi32(
                            acc,
                            ph,
                            _mm256_shuffle_epi8(sc, SPREAD[2 * c + 1]),
                        );
                    }
                    let isum4 = _mm_add_epi32(
                        _mm256_castsi256_si128(acc),
                        _mm256_extracti128_si256(acc, 1),
                    );
                    p[b] = _mm256_set_m128i(msum, isum4);
                }
                // Two hadd levels leave [isum 0..4 | summs 0..4] and
                // [isum 4..8 | summs 4..8].
                let lo =
                    _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
                let hi =
                    _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
                let isum = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo, hi, 0x20));
                let msum = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo, hi, 0x31));
                let g = _mm256_loadu_si256(dd.as_ptr() as *const __m256i);
                let d = f16_lanes(_mm256_and_si256(g, _mm256_set1_epi32(0xffff)));
                let dmin = f16_lanes(_mm256_srli_epi32(g, 16));
                let dyv = _mm256_loadu_ps(dy.as_ptr().add(k));
                // The scalar kernel's expression, lane by lane (no FMA).
                let t = _mm256_sub_ps(
                    _mm256_mul_ps(_mm256_mul_ps(dyv, d), isum),
                    _mm256_mul_ps(_mm256_mul_ps(dyv, dmin), msum),
                );
                sum = add_lanes(sum, t, m);
                k += m;
            }
            *o = sum;
        }
        k0 += kc;
    }
}

/// Byte order that puts Q6_K's scales as `[0 2 4 6 1 3 5 7]` then
/// `[8 10 12 14 9 11 13 15]`, the order of the sub-block sums after the
/// `hadd` tree.
const Q6_SCALE_ORDER: [u8; 16] = [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15];

/// Q6_K weights; see the module docs. Per super-block the 16 sub-block
/// sums (16 elements each) come out of two `hadd` levels in the order of
/// [`Q6_SCALE_ORDER`], meet their scales in two `vpmulld`, and the `-32`
/// offset is `-32 * sum_j sc_j * bsum_j` through one `madd`.
///
/// # Safety
/// [`super::MatvecFn`]'s contract for Q6_K weights.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub(crate) unsafe fn matvec_q6_k(cols: usize, w: &[u8], rows: usize, act: &[u8], out: &mut [f32]) {
    const BS: usize = 210;
    let nsb = cols / 256;
    if nsb == 0 {
        out[..rows].fill(0.0);
        return;
    }
    let rb = nsb * BS;
    let (wp, ap) = (w.as_ptr(), act.as_ptr());
    let m4 = _mm256_set1_epi8(0x0f);
    let m30 = _mm256_set1_epi8(0x30);
    let order = _mm_loadu_si128(Q6_SCALE_ORDER.as_ptr() as *const __m128i);
    let mut dy = [0f32; MVK];
    let mut k0 = 0;
    while k0 < nsb {
        let kc = (nsb - k0).min(MVK);
        for k in 0..kc {
            dy[k] = (ap.add((k0 + k) * 292) as *const f32).read_unaligned();
        }
        for (r, o) in out.iter_mut().enumerate().take(rows) {
            let x0 = wp.add(r * rb + k0 * BS);
            let mut sum = if k0 == 0 { 0.0 } else { *o };
            let mut k = 0;
            while k < kc {
                let m = (kc - k).min(8);
                let mut p = [_mm256_setzero_si256(); 8];
                let mut dd = [0i32; 8];
                for b in 0..m {
                    let x = x0.add((k + b) * BS);
                    let y = ap.add((k0 + k + b) * 292);
                    dd[b] = (x.add(208) as *const u16).read_unaligned() as i32;
                    let z = _mm256_setzero_si256();
                    let mut runs = [z; 8];
                    for h in 0..2 {
                        let b1 = load(x.add(64 * h));
                        let b2 = load(x.add(64 * h + 32));
                        let hb = load(x.add(128 + 32 * h));
                        // Code = low nibble | the 2-bit plane k in bits 4..6.
                        let q = [
                            _mm256_or_si256(
                                _mm256_and_si256(b1, m4),
                                _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(b2, m4),
                                _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16(b1, 4), m4),
                                _mm256_and_si256(hb, m30),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16(b2, 4), m4),
                                _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30),
                            ),
                        ];
                        for (kk, q) in q.into_iter().enumerate() {
                            let at = 4 + 128 * h + 32 * kk;
                            runs[4 * h + kk] = _mm256_dpbusd_epi32(z, q, load(y.add(at)));
                        }
                    }
                    let a = _mm256_hadd_epi32(
                        _mm256_hadd_epi32(runs[0], runs[1]),
                        _mm256_hadd_epi32(runs[2], runs[3]),
                    );
                    let bb = _mm256_hadd_epi32(
                        _mm256_hadd_epi32(runs[4], runs[5]),
                        _mm256_hadd_epi32(runs[6], runs[7]),
                    );
                    let sc8 = _mm_loadu_si128(x.add(192) as *const __m128i);
                    let sco = _mm_shuffle_epi8(sc8, order);
                    let sa = _mm256_cvtepi8_epi32(sco);
                    let sb = _mm256_cvtepi8_epi32(_mm_srli_si128(sco, 8));
                    let off = _mm256_madd_epi16(_mm256_cvtepi8_epi16(sc8), load(y.add(260)));
                    p[b] = _mm256_sub_epi32(
                        _mm256_add_epi32(_mm256_mullo_epi32(a, sa), _mm256_mullo_epi32(bb, sb)),
                        _mm256_slli_epi32(off, 5),
                    );
                }
                let isum = _mm256_cvtepi32_ps(reduce8(&p));
                let d = f16_lanes(_mm256_loadu_si256(dd.as_ptr() as *const __m256i));
                let dyv = _mm256_loadu_ps(dy.as_ptr().add(k));
                let t = _mm256_mul_ps(_mm256_mul_ps(dyv, d), isum);
                sum = add_lanes(sum, t, m);
                k += m;
            }
            *o = sum;
        }
        k0 += kc;
    }
}
