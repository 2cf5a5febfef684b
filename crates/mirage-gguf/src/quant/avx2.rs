//! AVX2+FMA(+F16C) dot kernels for x86_64, chosen at run time.
//!
//! Shapes follow ggml's `ggml_vec_dot_*` AVX2 kernels: nibbles are widened
//! with one shift and mask, signed×signed 8-bit products go through the
//! `sign_epi8` trick into `maddubs`, and the K-quant scales are applied with
//! `madd_epi16` on the pair sums. Two deliberate differences:
//! - K-quant kernels reduce each super-block's products to one exact i32 and
//!   combine it with the float scales in the same scalar expression as the
//!   scalar kernels, so results are bit-identical to them (the horizontal sum
//!   costs little against 256 elements).
//! - 32-element block kernels keep ggml's 8-lane float accumulators (two,
//!   alternating between blocks, to hide FMA latency; a
//!   horizontal sum per 32 elements would cost ~30%), so they agree with the
//!   scalar kernels to float rounding only.
//!
//! Every kernel here is `unsafe`: it reads through raw pointers within the
//! lengths [`super::DotFn`]'s contract guarantees, and needs the CPU features
//! [`available`] checks.

use std::arch::x86_64::*;

use crate::types::{GgmlType, QK_K};

/// Whether this CPU runs the kernels here.
pub(crate) fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// The AVX2 kernel for `ty`. Callers check [`available`] first.
pub(crate) fn dot_fn(ty: GgmlType) -> Option<super::DotFn> {
    use GgmlType::*;
    Some(match ty {
        F32 => dot_f32,
        F16 => dot_f16,
        BF16 => dot_bf16,
        Q4_0 => dot_q4_0_q8_0,
        Q4_1 => dot_q4_1_q8_1,
        Q5_0 => dot_q5_0_q8_0,
        Q5_1 => dot_q5_1_q8_1,
        Q8_0 => dot_q8_0_q8_0,
        Q8_1 => dot_q8_1_q8_1,
        Q2_K => dot_q2_k_q8_k,
        Q3_K => dot_q3_k_q8_k,
        Q4_K => dot_q4_k_q8_k,
        Q5_K => dot_q5_k_q8_k,
        Q6_K => dot_q6_k_q8_k,
        Q8_K => dot_q8_k_q8_k,
    })
}

// ------------------------------------------------------------------ helpers

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fp16(p: *const u8) -> f32 {
    let bits = u16::from_le_bytes([*p, *p.add(1)]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn read_f32(p: *const u8) -> f32 {
    (p as *const f32).read_unaligned()
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    _mm_cvtsi128_si32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load256(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// 32 nibbles of 16 bytes: low nibbles in bytes 0..16, high in 16..32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn nibbles_32(p: *const u8) -> __m256i {
    let tmp = _mm_loadu_si128(p as *const __m128i);
    let both = _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
}

/// Byte i = 0xff where bit i of the little-endian u32 at `p` is set.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn bytes_from_bits_32(p: *const u8) -> __m256i {
    let x32 = (p as *const u32).read_unaligned();
    let shuf = _mm256_set_epi64x(
        0x0303030303030303,
        0x0202020202020202,
        0x0101010101010101,
        0x0000000000000000,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x32 as i32), shuf);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
}

/// Shift each 16-bit lane right by a run-time count.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn srl16(v: __m256i, count: i32) -> __m256i {
    _mm256_srl_epi16(v, _mm_cvtsi32_si128(count))
}

/// Pairwise i32 sums of signed x × signed y bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mul_sum_i8_pairs(x: __m256i, y: __m256i) -> __m256i {
    let ax = _mm256_sign_epi8(x, x);
    let sy = _mm256_sign_epi8(y, x);
    _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
}

/// Pairwise i32 sums of unsigned x × signed y bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mul_sum_u8_i8_pairs(x: __m256i, y: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1))
}

// --------------------------------------------------------------- float dots

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_float(
    n: usize,
    w: &[u8],
    a: &[u8],
    load: impl Fn(*const u8, usize) -> __m256,
    scalar: fn(usize, &[u8], &[u8]) -> f32,
    wsize: usize,
) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr() as *const f32);
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (k, acc) in acc.iter_mut().enumerate() {
            let j = i + 8 * k;
            *acc = _mm256_fmadd_ps(load(wp, j), _mm256_loadu_ps(ap.add(j)), *acc);
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(load(wp, i), _mm256_loadu_ps(ap.add(i)), acc[0]);
        i += 8;
    }
    let mut sum = hsum_ps(_mm256_add_ps(
        _mm256_add_ps(acc[0], acc[1]),
        _mm256_add_ps(acc[2], acc[3]),
    ));
    if i < n {
        sum += scalar(n - i, &w[i * wsize..], &a[i * 4..]);
    }
    sum
}

unsafe fn dot_f32(n: usize, w: &[u8], a: &[u8]) -> f32 {
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn inner(n: usize, w: &[u8], a: &[u8]) -> f32 {
        dot_float(
            n,
            w,
            a,
            |p, j| _mm256_loadu_ps((p as *const f32).add(j)),
            super::float::dot_f32_scalar,
            4,
        )
    }
    inner(n, w, a)
}

unsafe fn dot_f16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn inner(n: usize, w: &[u8], a: &[u8]) -> f32 {
        dot_float(
            n,
            w,
            a,
            |p, j| _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * j) as *const __m128i)),
            super::float::dot_f16_scalar,
            2,
        )
    }
    inner(n, w, a)
}

unsafe fn dot_bf16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn inner(n: usize, w: &[u8], a: &[u8]) -> f32 {
        dot_float(
            n,
            w,
            a,
            |p, j| {
                let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(2 * j) as *const __m128i));
                _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
            },
            super::float::dot_bf16_scalar,
            2,
        )
    }
    inner(n, w, a)
}

// ------------------------------------------------------- 32-element blocks

/// Runs `$block` (which reads block index `$i` and yields the f32 scale
/// product, the i32 pair sums and the min term) over `$nb` blocks with two
/// independent accumulators, so consecutive blocks' FMAs do not wait on each
/// other's latency.
macro_rules! two_chain_blocks {
    ($nb:expr, |$i:ident| $block:expr) => {{
        let nb = $nb;
        let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let (mut min0, mut min1) = (0f32, 0f32);
        let mut $i = 0usize;
        while $i + 2 <= nb {
            let (d, p, m): (f32, __m256i, f32) = $block;
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(p), acc0);
            min0 += m;
            $i += 1;
            let (d, p, m): (f32, __m256i, f32) = $block;
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(p), acc1);
            min1 += m;
            $i += 1;
        }
        if $i < nb {
            let (d, p, m): (f32, __m256i, f32) = $block;
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(p), acc0);
            min0 += m;
        }
        hsum_ps(_mm256_add_ps(acc0, acc1)) + (min0 + min1)
    }};
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q8_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    two_chain_blocks!(n / 32, |i| {
        let (x, y) = (wp.add(34 * i), ap.add(34 * i));
        let p = mul_sum_i8_pairs(load256(x.add(2)), load256(y.add(2)));
        (fp16(x) * fp16(y), p, 0.0)
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q8_1_q8_1(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    two_chain_blocks!(n / 32, |i| {
        let (x, y) = (wp.add(36 * i), ap.add(36 * i));
        let p = mul_sum_i8_pairs(load256(x.add(4)), load256(y.add(4)));
        (fp16(x) * fp16(y), p, 0.0)
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    two_chain_blocks!(n / 32, |i| {
        let (x, y) = (wp.add(18 * i), ap.add(34 * i));
        let q = _mm256_sub_epi8(nibbles_32(x.add(2)), _mm256_set1_epi8(8));
        (
            fp16(x) * fp16(y),
            mul_sum_i8_pairs(q, load256(y.add(2))),
            0.0,
        )
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q5_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    two_chain_blocks!(n / 32, |i| {
        let (x, y) = (wp.add(22 * i), ap.add(34 * i));
        // (q | h<<4) - 16 == q | 0xf0 (as i8) where h is clear, q where set.
        let hi = _mm256_andnot_si256(bytes_from_bits_32(x.add(2)), _mm256_set1_epi8(0xf0u8 as i8));
        let q = _mm256_or_si256(nibbles_32(x.add(6)), hi);
        (
            fp16(x) * fp16(y),
            mul_sum_i8_pairs(q, load256(y.add(2))),
            0.0,
        )
    })
}

/// `(dx * dy, mx * sy)` of a Q4_1/Q5_1 block (f16 `d`, `m` at `x`) and a
/// Q8_1 block (f16 `d`, `s` at `y`): both pairs widened by one `cvtph`
/// each and multiplied at once; the same products as four scalar
/// conversions, for about half the instructions (decode is bound by them).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scale_min_products(x: *const u8, y: *const u8) -> (f32, f32) {
    let xs = _mm_cvtph_ps(_mm_cvtsi32_si128((x as *const i32).read_unaligned()));
    let ys = _mm_cvtph_ps(_mm_cvtsi32_si128((y as *const i32).read_unaligned()));
    let pr = _mm_mul_ps(xs, ys);
    (_mm_cvtss_f32(pr), _mm_cvtss_f32(_mm_movehdup_ps(pr)))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_1_q8_1(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    two_chain_blocks!(n / 32, |i| {
        let (x, y) = (wp.add(20 * i), ap.add(36 * i));
        let p = mul_sum_u8_i8_pairs(nibbles_32(x.add(4)), load256(y.add(4)));
        let (d, m) = scale_min_products(x, y);
        (d, p, m)
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q5_1_q8_1(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    two_chain_blocks!(n / 32, |i| {
        let (x, y) = (wp.add(24 * i), ap.add(36 * i));
        let hi = _mm256_and_si256(bytes_from_bits_32(x.add(4)), _mm256_set1_epi8(0x10));
        let q = _mm256_or_si256(nibbles_32(x.add(8)), hi);
        let p = mul_sum_u8_i8_pairs(q, load256(y.add(4)));
        let (d, m) = scale_min_products(x, y);
        (d, p, m)
    })
}

// ---------------------------------------------------------------- K-quants

const Q8K: usize = 292;

/// ggml's `utmp` unpacking of Q4_K/Q5_K's 12 packed bytes: the eight 6-bit
/// scales in bytes 0..8, the eight 6-bit mins in bytes 8..16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn scales_mins_k4(p: *const u8) -> [u32; 4] {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let w = |i: usize| (p.add(4 * i) as *const u32).read_unaligned();
    let (u0, u1, u2) = (w(0), w(1), w(2));
    [
        u0 & KMASK1,
        (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4),
        u1 & KMASK1,
        ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4),
    ]
}

/// i16 lane `l` (0..8) of the low 128-bit half, in all 16 lanes of `v`
/// (whose two halves are equal).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn broadcast_i16(v: __m256i, l: usize) -> __m256i {
    let b = (2 * l) as i8;
    _mm256_shuffle_epi8(v, _mm256_set1_epi16(((b as i16 + 1) << 8) | b as i16))
}

/// `PAIR_SHUF[p]` picks i16 lane 2p of a 128-bit half into bytes 0..16 and
/// lane 2p+1 into bytes 16..32 (for `_mm256_shuffle_epi8`).
const PAIR_SHUF: [[u8; 32]; 4] = {
    let mut t = [[0u8; 32]; 4];
    let mut p = 0;
    while p < 4 {
        let mut i = 0;
        while i < 16 {
            t[p][i] = (4 * p + i % 2) as u8;
            t[p][16 + i] = (4 * p + 2 + i % 2) as u8;
            i += 1;
        }
        p += 1;
    }
    t
};

/// The 16 per-group scales of a K-quant block, widened to i16 and ready to
/// be spread over pair sums: group g's scale for the first 16 elements of a
/// 32-element run, group g+1's for the rest.
struct GroupScales {
    /// Scales 0..8 in both 128-bit halves.
    low: __m256i,
    /// Scales 8..16 in both 128-bit halves.
    high: __m256i,
}

impl GroupScales {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn new(scales16: __m256i) -> GroupScales {
        GroupScales {
            low: _mm256_permute2x128_si256(scales16, scales16, 0x00),
            high: _mm256_permute2x128_si256(scales16, scales16, 0x11),
        }
    }

    /// i16 vector: scale `g` in bytes 0..16, scale `g + 1` in 16..32 (g even).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pair(&self, g: usize) -> __m256i {
        let src = if g < 8 { self.low } else { self.high };
        let mask = _mm256_loadu_si256(PAIR_SHUF[(g % 8) / 2].as_ptr() as *const __m256i);
        _mm256_shuffle_epi8(src, mask)
    }
}

/// Σ over 32 elements of scale(group) × q × y, with unsigned codes `q`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scaled_u8_i8(q: __m256i, y: *const u8, scales: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(q, load256(y)), scales)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q2_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let mask = _mm256_set1_epi8(3);
    let mut sum = 0f32;
    for i in 0..n / QK_K {
        let (x, y) = (wp.add(84 * i), ap.add(Q8K * i));
        let packed = _mm_loadu_si128(x as *const __m128i);
        let mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(
            _mm_srli_epi16(packed, 4),
            _mm_set1_epi8(0x0f),
        ));
        let scales = GroupScales::new(_mm256_cvtepu8_epi16(_mm_and_si128(
            packed,
            _mm_set1_epi8(0x0f),
        )));
        let summs = hsum_epi32(_mm256_madd_epi16(mins16, load256(y.add(260))));
        let mut acc = _mm256_setzero_si256();
        for h in 0..2 {
            let bits = load256(x.add(16 + 32 * h));
            for k in 0..4 {
                let q = _mm256_and_si256(srl16(bits, 2 * k as i32), mask);
                let sc = scales.pair(8 * h + 2 * k);
                acc = _mm256_add_epi32(acc, scaled_u8_i8(q, y.add(4 + 128 * h + 32 * k), sc));
            }
        }
        let isum = hsum_epi32(acc);
        let dy = read_f32(y);
        sum += dy * fp16(x.add(80)) * isum as f32 - dy * fp16(x.add(82)) * summs as f32;
    }
    sum
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q3_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let (m3, m1) = (_mm256_set1_epi8(3), _mm256_set1_epi8(1));
    let mut sum = 0f32;
    for i in 0..n / QK_K {
        let (x, y) = (wp.add(110 * i), ap.add(Q8K * i));
        let scales = super::kquants::scales_q3_k(std::slice::from_raw_parts(x, 110));
        // codes are (low | h<<2) - 4: fold the -4 into the group sums,
        // -4 * Σ_j scale_j * bsum_j, computed in one madd.
        let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(scales.as_ptr() as *const __m128i));
        let bsums = load256(y.add(260));
        let offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bsums), 2);
        let groups = GroupScales::new(sc16);
        let hbits = load256(x);
        let mut acc = _mm256_setzero_si256();
        for h in 0..2 {
            let bits = load256(x.add(32 + 32 * h));
            for k in 0..4 {
                let low = _mm256_and_si256(srl16(bits, 2 * k as i32), m3);
                let hb = _mm256_and_si256(srl16(hbits, (4 * h + k) as i32), m1);
                let q = _mm256_or_si256(low, _mm256_slli_epi16(hb, 2));
                let sc = groups.pair(8 * h + 2 * k);
                acc = _mm256_add_epi32(acc, scaled_u8_i8(q, y.add(4 + 128 * h + 32 * k), sc));
            }
        }
        let isum = hsum_epi32(_mm256_sub_epi32(acc, offset));
        sum += read_f32(y) * fp16(x.add(108)) * isum as f32;
    }
    sum
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q45_k(n: usize, w: &[u8], a: &[u8], five_bit: bool) -> f32 {
    let (size, qs_at) = if five_bit { (176, 48) } else { (144, 16) };
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let (m4, m1) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(1));
    let mut sum = 0f32;
    for i in 0..n / QK_K {
        let (x, y) = (wp.add(size * i), ap.add(Q8K * i));
        // ggml's utmp shuffle: bytes 0..8 = the 6-bit scales, 8..16 = mins.
        let sm = scales_mins_k4(x.add(4));
        let sm16 = _mm256_cvtepu8_epi16(_mm_loadu_si128(sm.as_ptr() as *const __m128i));
        let bsums = load256(y.add(260));
        let pair_bsums = _mm_hadd_epi16(
            _mm256_castsi256_si128(bsums),
            _mm256_extracti128_si256(bsums, 1),
        );
        let mins = _mm_madd_epi16(_mm256_extracti128_si256(sm16, 1), pair_bsums);
        let mins = _mm_add_epi32(mins, _mm_shuffle_epi32(mins, 0b01_00_11_10));
        let mins = _mm_add_epi32(mins, _mm_shuffle_epi32(mins, 0b10_11_00_01));
        let summs = _mm_cvtsi128_si32(mins);
        let scales = _mm256_permute2x128_si256(sm16, sm16, 0x00);
        let hbits = if five_bit {
            load256(x.add(16))
        } else {
            _mm256_setzero_si256()
        };
        let mut acc = _mm256_setzero_si256();
        for c in 0..4 {
            let bits = load256(x.add(qs_at + 32 * c));
            let mut ql = _mm256_and_si256(bits, m4);
            let mut qh = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
            if five_bit {
                let b0 = _mm256_and_si256(srl16(hbits, (2 * c) as i32), m1);
                let b1 = _mm256_and_si256(srl16(hbits, (2 * c + 1) as i32), m1);
                ql = _mm256_or_si256(ql, _mm256_slli_epi16(b0, 4));
                qh = _mm256_or_si256(qh, _mm256_slli_epi16(b1, 4));
            }
            let pl = scaled_u8_i8(ql, y.add(4 + 64 * c), broadcast_i16(scales, 2 * c));
            let ph = scaled_u8_i8(qh, y.add(4 + 64 * c + 32), broadcast_i16(scales, 2 * c + 1));
            acc = _mm256_add_epi32(acc, _mm256_add_epi32(pl, ph));
        }
        let isum = hsum_epi32(acc);
        let dy = read_f32(y);
        sum += dy * fp16(x) * isum as f32 - dy * fp16(x.add(2)) * summs as f32;
    }
    sum
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_q45_k(n, w, a, false)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q5_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_q45_k(n, w, a, true)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q6_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let (m4, m3) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(3));
    let m32 = _mm256_set1_epi8(32);
    let mut sum = 0f32;
    for i in 0..n / QK_K {
        let (x, y) = (wp.add(210 * i), ap.add(Q8K * i));
        let groups = GroupScales::new(_mm256_cvtepi8_epi16(_mm_loadu_si128(
            x.add(192) as *const __m128i
        )));
        let mut acc = _mm256_setzero_si256();
        for h in 0..2 {
            let b1 = load256(x.add(64 * h));
            let b2 = load256(x.add(64 * h + 32));
            let hb = load256(x.add(128 + 32 * h));
            let lows = [
                _mm256_and_si256(b1, m4),
                _mm256_and_si256(b2, m4),
                _mm256_and_si256(_mm256_srli_epi16(b1, 4), m4),
                _mm256_and_si256(_mm256_srli_epi16(b2, 4), m4),
            ];
            for (k, low) in lows.into_iter().enumerate() {
                let high = _mm256_and_si256(srl16(hb, 2 * k as i32), m3);
                let q = _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
                let yk = y.add(4 + 128 * h + 32 * k);
                let y8 = load256(yk);
                // (q - 32)·y == q·y - 32·y, both pair sums fit i16.
                let p =
                    _mm256_sub_epi16(_mm256_maddubs_epi16(q, y8), _mm256_maddubs_epi16(m32, y8));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, groups.pair(8 * h + 2 * k)));
            }
        }
        let isum = hsum_epi32(acc);
        sum += read_f32(y) * fp16(x.add(208)) * isum as f32;
    }
    sum
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q8_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let mut sum = 0f32;
    for i in 0..n / QK_K {
        let (x, y) = (wp.add(Q8K * i), ap.add(Q8K * i));
        let mut acc = _mm256_setzero_si256();
        for c in 0..8 {
            acc = _mm256_add_epi32(
                acc,
                mul_sum_i8_pairs(load256(x.add(4 + 32 * c)), load256(y.add(4 + 32 * c))),
            );
        }
        let isum = hsum_epi32(acc);
        sum += read_f32(y) * read_f32(x) * isum as f32;
    }
    sum
}

// ------------------------------------------------- multi-row (prefill) dots

/// The 4-row AVX2 kernel for `ty` (one weight row against 4 activation
/// rows), for the 32-element block types; `None` for the others. Callers
/// check [`available`] first.
pub(crate) fn dot_rows_fn(ty: GgmlType) -> Option<super::DotRowsFn> {
    use GgmlType::*;
    Some(match ty {
        Q4_0 => dot4_q4_0_q8_0,
        Q4_1 => dot4_q4_1_q8_1,
        Q5_0 => dot4_q5_0_q8_0,
        Q5_1 => dot4_q5_1_q8_1,
        Q8_0 => dot4_q8_0_q8_0,
        _ => return None,
    })
}

/// Decodes each 32-element weight block once (`$decode` reads block pointer
/// `$x` and yields its scale, its minimum and the 32 quants) and pairs it
/// with the same block of 4 activation rows, so the weight bytes are read
/// and unpacked once per 4 tokens instead of once per token. The 4 rows'
/// f16 scale (and, for Q8_1, block sum) pairs are widened by one `cvtph`
/// and scaled by one multiply: lane `2j` is row j's `dw * dy`, lane `2j+1`
/// its `mw * sy`, accumulated in `mins`. Per row these are the single-row
/// kernels' float operations (one accumulator instead of two), so results
/// agree with them to float rounding.
macro_rules! four_rows_blocks {
    ($n:expr, $w:expr, $a:expr, $stride:expr, $out:expr,
     wsize = $wsz:expr, asize = $asz:expr, aqs = $aoff:expr, mins = $has_min:expr,
     $mul:ident, |$x:ident| $decode:expr) => {{
        let (wp, ap) = ($w.as_ptr(), $a.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut mins = _mm256_setzero_ps();
        let lane = [
            _mm256_set1_epi32(0),
            _mm256_set1_epi32(2),
            _mm256_set1_epi32(4),
            _mm256_set1_epi32(6),
        ];
        for i in 0..$n / 32 {
            let $x = wp.add($wsz * i);
            let (dw, mw, q): (f32, f32, __m256i) = $decode;
            let y0 = ap.add($asz * i);
            let rd = |j: usize| (y0.add(j * $stride) as *const i32).read_unaligned();
            // Q8_0 rows have no sum: their odd lanes hold quant bytes,
            // which are scaled by mw = 0 and never read.
            let halves = _mm_set_epi32(rd(3), rd(2), rd(1), rd(0));
            let scaled = _mm256_mul_ps(
                _mm256_cvtph_ps(halves),
                _mm256_set_ps(mw, dw, mw, dw, mw, dw, mw, dw),
            );
            if $has_min {
                mins = _mm256_add_ps(mins, scaled);
            }
            for j in 0..4 {
                let p = $mul(q, load256(y0.add(j * $stride + $aoff)));
                let d = _mm256_permutevar8x32_ps(scaled, lane[j]);
                acc[j] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc[j]);
            }
        }
        let mut m = [0f32; 8];
        _mm256_storeu_ps(m.as_mut_ptr(), mins);
        for j in 0..4 {
            $out[j] = hsum_ps(acc[j]) + if $has_min { m[2 * j + 1] } else { 0.0 };
        }
    }};
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot4_q8_0_q8_0(n: usize, w: &[u8], a: &[u8], stride: usize, out: &mut [f32; 4]) {
    four_rows_blocks!(
        n,
        w,
        a,
        stride,
        out,
        wsize = 34,
        asize = 34,
        aqs = 2,
        mins = false,
        mul_sum_i8_pairs,
        |x| (fp16(x), 0.0, load256(x.add(2)))
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot4_q4_0_q8_0(n: usize, w: &[u8], a: &[u8], stride: usize, out: &mut [f32; 4]) {
    four_rows_blocks!(
        n,
        w,
        a,
        stride,
        out,
        wsize = 18,
        asize = 34,
        aqs = 2,
        mins = false,
        mul_sum_i8_pairs,
        |x| (
            fp16(x),
            0.0,
            _mm256_sub_epi8(nibbles_32(x.add(2)), _mm256_set1_epi8(8))
        )
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot4_q5_0_q8_0(n: usize, w: &[u8], a: &[u8], stride: usize, out: &mut [f32; 4]) {
    four_rows_blocks!(
        n,
        w,
        a,
        stride,
        out,
        wsize = 22,
        asize = 34,
        aqs = 2,
        mins = false,
        mul_sum_i8_pairs,
        |x| {
            let hi =
                _mm256_andnot_si256(bytes_from_bits_32(x.add(2)), _mm256_set1_epi8(0xf0u8 as i8));
            (fp16(x), 0.0, _mm256_or_si256(nibbles_32(x.add(6)), hi))
        }
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot4_q4_1_q8_1(n: usize, w: &[u8], a: &[u8], stride: usize, out: &mut [f32; 4]) {
    four_rows_blocks!(
        n,
        w,
        a,
        stride,
        out,
        wsize = 20,
        asize = 36,
        aqs = 4,
        mins = true,
        mul_sum_u8_i8_pairs,
        |x| (fp16(x), fp16(x.add(2)), nibbles_32(x.add(4)))
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot4_q5_1_q8_1(n: usize, w: &[u8], a: &[u8], stride: usize, out: &mut [f32; 4]) {
    four_rows_blocks!(
        n,
        w,
        a,
        stride,
        out,
        wsize = 24,
        asize = 36,
        aqs = 4,
        mins = true,
        mul_sum_u8_i8_pairs,
        |x| {
            let hi = _mm256_and_si256(bytes_from_bits_32(x.add(4)), _mm256_set1_epi8(0x10));
            (
                fp16(x),
                fp16(x.add(2)),
                _mm256_or_si256(nibbles_32(x.add(8)), hi),
            )
        }
    )
}
