//! AVX-512 VNNI matrix-vector kernels (decode) for Q4_K, Q5_K and Q6_K
//! weights against one Q8_K activation row, and for Q5_0 and Q4_0 weights
//! against one Q8_0 row.
//!
//! Decode reads every weight byte once per token, so it runs at memory
//! bandwidth only if unpacking a super-block costs well under fetching it.
//! The single-row AVX2 kernels reduce each super-block's integer sum
//! horizontally and combine it with the scales in scalar code, about 90
//! instructions per Q4_K block, about 16 GB/s on one Zen 4 core; these
//! keep everything in lanes: per 32-code run one `maddubs` (codes times
//! quants, i16 pair sums, exact) and one `vpdpwssd` by the run's scale
//! spread over the lanes (one `vpshufb`); the scales and mins come out of
//! their 12 packed bytes in a few vector operations; and each super-block
//! adds its integer sums times `d * dy` (and the mins term times `dmin *
//! dy`) to float lanes with one FMA each, reduced once per row. About 25
//! GB/s per core on Q4_K.
//!
//! Each block's integer sums are exact; the float accumulation in 8 lanes
//! differs from the scalar kernel's order, so results agree with it to
//! float rounding (about 2e-7 relative), like the 32-element block types'
//! kernels. Rows are read front to back, and each block asks for the bytes
//! [`super::util::PREFETCH_AHEAD`] further on (the hardware prefetchers
//! alone left one thread at half the read bandwidth on an Intel Xeon VM).

use std::arch::x86_64::*;

use super::util::prefetch_ahead_of;

/// Super-blocks whose activation terms are computed per piece (stack
/// arrays); longer rows go in pieces.
const MVK: usize = 64;

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn load(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// The sum of `v`'s eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
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

/// `SPREAD_PAIRS[k]` (for `_mm256_shuffle_epi8` on a vector whose two
/// 128-bit halves hold the same eight i16 scales): i16 lane `2k` into the
/// low half's lanes, lane `2k + 1` into the high half's (a Q6_K run's two
/// 16-element sub-blocks).
const SPREAD_PAIRS: [__m256i; 4] = {
    let mut t = [[0u8; 32]; 4];
    let mut k = 0;
    while k < 4 {
        let mut i = 0;
        while i < 16 {
            t[k][i] = (4 * k + i % 2) as u8;
            t[k][16 + i] = (4 * k + 2 + i % 2) as u8;
            i += 1;
        }
        k += 1;
    }
    // SAFETY: [u8; 32] and __m256i have the same size, any bits are valid.
    unsafe { std::mem::transmute::<[[u8; 32]; 4], [__m256i; 4]>(t) }
};

/// The eight 6-bit scales (bytes 0..8) and mins (bytes 8..16) of the
/// Q4_K/Q5_K block at `x` (ggml's `get_scale_min_k4` for every sub-block),
/// unpacked from its 12 scale bytes with a few vector operations instead of
/// ggml's scalar `utmp` shuffle.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn scales_mins(x: *const u8) -> __m128i {
    // Bytes 4..20 of the block: the 12 scale bytes q[0..12], then codes.
    let v = _mm_loadu_si128(x.add(4) as *const __m128i);
    // Scales j < 4: q[j] & 63, j >= 4: q[j + 4] & 15 | (q[j - 4] >> 6) << 4;
    // mins j < 4: q[j + 4] & 63, j >= 4: q[j + 4] >> 4 | (q[j] >> 6) << 4.
    let a = _mm_shuffle_epi8(
        v,
        _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11),
    );
    let low = _mm_or_si128(
        _mm_and_si128(
            a,
            _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0),
        ),
        _mm_and_si128(
            _mm_srli_epi16(a, 4),
            _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15),
        ),
    );
    let top = _mm_shuffle_epi8(
        v,
        _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7),
    );
    // (byte & 0xc0) >> 2 within each byte: the 16-bit shift moves no set
    // bit across a byte boundary.
    let high = _mm_srli_epi16(_mm_and_si128(top, _mm_set1_epi8(0xc0u8 as i8)), 2);
    _mm_or_si128(low, high)
}

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
    // Opaque to the compiler, so that each spread stays one `vpshufb`
    // (it would rewrite a known constant mask as two shuffles).
    let spread = std::hint::black_box(SPREAD);
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
            // Lanes of `sum d dy isum` and of `sum dmin dy summs`.
            let mut facc = _mm256_setzero_ps();
            let mut macc = _mm_setzero_ps();
            for k in 0..kc {
                let x = x0.add(k * bs);
                let y = ap.add((k0 + k) * 292);
                prefetch_ahead_of(x, bs);
                let sm = scales_mins(x);
                // The eight scales as i16 in both 128-bit halves.
                let sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
                let mins = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
                let msum = _mm_madd_epi16(mins, _mm_loadu_si128(b32[k].as_ptr() as *const __m128i));
                let hbits = if FIVE {
                    load(x.add(16))
                } else {
                    _mm256_setzero_si256()
                };
                let (mut acc, mut acc1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                for c in 0..4 {
                    let bits = load(x.add(qs_at + 32 * c));
                    let mut lo = _mm256_and_si256(bits, m4);
                    let mut hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
                    if FIVE {
                        let b0 = _mm256_and_si256(
                            _mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * c as i32)),
                            m1,
                        );
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
                    acc = _mm256_dpwssd_epi32(acc, pl, _mm256_shuffle_epi8(sc, spread[2 * c]));
                    acc1 =
                        _mm256_dpwssd_epi32(acc1, ph, _mm256_shuffle_epi8(sc, spread[2 * c + 1]));
                }
                // (d, dmin) times dy, then both terms into their lanes.
                let dd = _mm_mul_ps(
                    _mm_cvtph_ps(_mm_cvtsi32_si128((x as *const i32).read_unaligned())),
                    _mm_set1_ps(dy[k]),
                );
                facc = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(_mm256_add_epi32(acc, acc1)),
                    _mm256_broadcastss_ps(dd),
                    facc,
                );
                macc = _mm_fmadd_ps(
                    _mm_cvtepi32_ps(msum),
                    _mm_permute_ps(dd, 0b01_01_01_01),
                    macc,
                );
            }
            let m = _mm_add_ps(macc, _mm_movehl_ps(macc, macc));
            let v = hsum_ps(facc) - _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
            *o = if k0 == 0 { v } else { *o + v };
        }
        k0 += kc;
    }
}

/// Q6_K weights; see the module docs. Per 32-code run the i16 pair sums
/// cover two 16-element sub-blocks (lanes 0..8 and 8..16), which meet their
/// two scales in one `vpdpwssd` (the scale pair spread by one `vpshufb`);
/// the `-32` offset is `-32 * sum_j sc_j * bsum_j` through one `madd`.
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
    let pairs = std::hint::black_box(SPREAD_PAIRS);
    for r in 0..rows {
        let x0 = wp.add(r * rb);
        let mut facc = _mm256_setzero_ps();
        for k in 0..nsb {
            let x = x0.add(k * BS);
            let y = ap.add(k * 292);
            prefetch_ahead_of(x, BS);
            let sc8 = _mm_loadu_si128(x.add(192) as *const __m128i);
            let sc16 = _mm256_cvtepi8_epi16(sc8);
            // Scales 0..8 and 8..16 as i16, each in both 128-bit halves.
            let sc_lo = _mm256_permute2x128_si256(sc16, sc16, 0x00);
            let sc_hi = _mm256_permute2x128_si256(sc16, sc16, 0x11);
            let off = _mm256_madd_epi16(sc16, load(y.add(260)));
            let mut acc = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_setzero_si256(), off), 5);
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
                let src = if h == 0 { sc_lo } else { sc_hi };
                for (kk, q) in q.into_iter().enumerate() {
                    // Codes at most 63: pair sums at most 2 * 63 * 128.
                    let p = _mm256_maddubs_epi16(q, load(y.add(4 + 128 * h + 32 * kk)));
                    acc = _mm256_dpwssd_epi32(acc, p, _mm256_shuffle_epi8(src, pairs[kk]));
                }
            }
            let dd = _mm_cvtph_ps(_mm_cvtsi32_si128(
                (x.add(208) as *const u16).read_unaligned() as i32,
            ));
            let dd = _mm_mul_ss(dd, _mm_set_ss((y as *const f32).read_unaligned()));
            facc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_broadcastss_ps(dd), facc);
        }
        out[r] = hsum_ps(facc);
    }
}

/// Q5_0 (`FIVE`) or Q4_0 weights against one Q8_0 row. Codes stay
/// unsigned (Q5_0: the nibble plus 16 where the fifth bit is set, that bit
/// spread to bytes by `vpmovm2b`; Q4_0: the nibble) and meet the quants in
/// one `vpdpbusd` whose accumulator starts at the lanes' `-16` (`-8`) times
/// their quant sums (per activation block, computed once per call), so
/// each lane ends at its exact 4-element sum of `(q - 16) y`; then one FMA
/// per block by `dw * da` into float lanes. Equal to the scalar dot to
/// float rounding.
///
/// # Safety
/// [`super::MatvecFn`]'s contract for Q5_0/Q4_0 weights; the CPU has
/// AVX512BW (checked with the rest by `GemmIsa::available`).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni,avx512bw")]
pub(crate) unsafe fn matvec_q5_0<const FIVE: bool>(
    cols: usize,
    w: &[u8],
    rows: usize,
    act: &[u8],
    out: &mut [f32],
) {
    const MVB: usize = 256;
    let bs = if FIVE { 22 } else { 18 };
    let qs_at = if FIVE { 6 } else { 2 };
    let nb = cols / 32;
    if nb == 0 {
        out[..rows].fill(0.0);
        return;
    }
    let rb = nb * bs;
    let (wp, ap) = (w.as_ptr(), act.as_ptr());
    let m4 = _mm_set1_epi8(0x0f);
    let bit4 = _mm256_set1_epi8(0x10);
    let offset = _mm256_set1_epi8(if FIVE { 16 } else { 8 });
    // Per activation block: the lanes' -offset * quant sums and the scale.
    let mut corr = [_mm256_setzero_si256(); MVB];
    let mut da = [0f32; MVB];
    let mut k0 = 0;
    while k0 < nb {
        let kc = (nb - k0).min(MVB);
        for k in 0..kc {
            let y = ap.add((k0 + k) * 34);
            let s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), offset, load(y.add(2)));
            corr[k] = _mm256_sub_epi32(_mm256_setzero_si256(), s);
            da[k] = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                (y as *const u16).read_unaligned() as i32,
            )));
        }
        for (r, o) in out.iter_mut().enumerate().take(rows) {
            let x0 = wp.add(r * rb + k0 * bs);
            let mut facc = _mm256_setzero_ps();
            for k in 0..kc {
                let x = x0.add(k * bs);
                let y = ap.add((k0 + k) * 34);
                prefetch_ahead_of(x, bs);
                let packed = _mm_loadu_si128(x.add(qs_at) as *const __m128i);
                let nib = _mm256_set_m128i(
                    _mm_and_si128(_mm_srli_epi16(packed, 4), m4),
                    _mm_and_si128(packed, m4),
                );
                let q = if FIVE {
                    let qh = (x.add(2) as *const u32).read_unaligned();
                    _mm256_or_si256(nib, _mm256_and_si256(_mm256_movm_epi8(qh), bit4))
                } else {
                    nib
                };
                let p = _mm256_dpbusd_epi32(corr[k], q, load(y.add(2)));
                let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                    (x as *const u16).read_unaligned() as i32,
                ))) * da[k];
                facc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d), facc);
            }
            let v = hsum_ps(facc);
            *o = if k0 == 0 { v } else { *o + v };
        }
        k0 += kc;
    }
}
