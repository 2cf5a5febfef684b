//! AVX2 activation quantizers (Q8_0, Q8_1, Q8_K), bit-identical to the
//! scalar ones in [`super::legacy`] and [`super::kquants`]: a prefill
//! quantizes every activation row of every matrix product, so these are on
//! the prompt's critical path.
//!
//! Every function here is `unsafe`: it needs the CPU features
//! [`super::avx2::available`] checks.

use std::arch::x86_64::*;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    _mm_cvtsi128_si32(s)
}

/// The codes of one 32-value Q8_0/Q8_1 block at `x` into `qs`, and `(d,
/// sum of codes)`: bit-identical to the scalar `quantize_8bit` (ggml's
/// `quantize_row_q8_0_ref`). `roundf` (half away from zero) is emulated
/// exactly: truncate, then step one away from zero where the dropped
/// fraction (exact for these magnitudes) is at least one half. NaN codes
/// become 0 and out-of-range ones saturate, as Rust's `as i8` does.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_block_8bit(x: *const f32, qs: *mut u8) -> (f32, i32) {
    let sign = _mm256_set1_ps(-0.0);
    let v = [
        _mm256_loadu_ps(x),
        _mm256_loadu_ps(x.add(8)),
        _mm256_loadu_ps(x.add(16)),
        _mm256_loadu_ps(x.add(24)),
    ];
    // max_ps returns its second operand when either is NaN: NaN inputs are
    // skipped, as f32::max skips them in the scalar fold.
    let mut m = _mm256_setzero_ps();
    for vi in v {
        m = _mm256_max_ps(_mm256_andnot_ps(sign, vi), m);
    }
    let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let vid = _mm256_set1_ps(id);
    let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
    let (lo, hi) = (_mm256_set1_ps(-128.0), _mm256_set1_ps(127.0));
    let mut q = [_mm256_setzero_si256(); 4];
    for (qi, vi) in q.iter_mut().zip(v) {
        let p = _mm256_mul_ps(vi, vid);
        let t = _mm256_round_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(p, t));
        let step = _mm256_or_ps(_mm256_and_ps(p, sign), one);
        let r = _mm256_add_ps(
            t,
            _mm256_and_ps(_mm256_cmp_ps(frac, half, _CMP_GE_OQ), step),
        );
        let r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
        let r = _mm256_and_ps(r, _mm256_cmp_ps(p, p, _CMP_ORD_Q));
        *qi = _mm256_cvtps_epi32(r);
    }
    let sum = hsum_epi32(_mm256_add_epi32(
        _mm256_add_epi32(q[0], q[1]),
        _mm256_add_epi32(q[2], q[3]),
    ));
    // packs interleave 128-bit halves; the permute restores element order.
    let w = _mm256_packs_epi16(
        _mm256_packs_epi32(q[0], q[1]),
        _mm256_packs_epi32(q[2], q[3]),
    );
    let w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(qs as *mut __m256i, w);
    (d, sum)
}

/// AVX2 `quantize_q8_0`, bit-identical to the scalar one. Lengths as
/// [`super::quantize`] checks them.
///
/// # Safety
/// [`available`] must hold.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_0(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(32).zip(dst.chunks_exact_mut(34)) {
        let (d, _) = quantize_block_8bit(x.as_ptr(), b.as_mut_ptr().add(2));
        b[..2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
    }
}

/// AVX2 `quantize_q8_1`, bit-identical to the scalar one.
///
/// # Safety
/// [`available`] must hold.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_1(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(32).zip(dst.chunks_exact_mut(36)) {
        let (d, sum) = quantize_block_8bit(x.as_ptr(), b.as_mut_ptr().add(4));
        b[..2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
        b[2..4].copy_from_slice(&half::f16::from_f32(sum as f32 * d).to_bits().to_le_bytes());
    }
}

/// AVX2 `quantize_q8_k`, bit-identical to the scalar one: codes
/// `nearest_int(iscale * x)` (`cvtps` rounds half to even like ggml's
/// `nearest_int` for these magnitudes) with `iscale = -127 / max`, `max`
/// the first value of largest magnitude, and the 16-element sums. A block
/// holding a NaN or an infinity goes through the scalar code, whose integer
/// tricks define what those become.
///
/// # Safety
/// [`super::avx2::available`] must hold; lengths as [`super::quantize`]
/// checks them.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_k(src: &[f32], dst: &mut [u8]) {
    let sign = _mm256_set1_ps(-0.0);
    let inf = _mm256_set1_ps(f32::INFINITY);
    let ones = _mm256_set1_epi8(1);
    let ones16 = _mm256_set1_epi16(1);
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (x, b) in src.chunks_exact(256).zip(dst.chunks_exact_mut(292)) {
        let xp = x.as_ptr();
        let mut amax = _mm256_setzero_ps();
        let mut finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        for i in 0..32 {
            let a = _mm256_andnot_ps(sign, _mm256_loadu_ps(xp.add(8 * i)));
            amax = _mm256_max_ps(amax, a);
            finite = _mm256_and_ps(finite, _mm256_cmp_ps(a, inf, _CMP_LT_OQ));
        }
        if _mm256_movemask_ps(finite) != 0xff {
            super::kquants::quantize_q8_k(x, b);
            continue;
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let am = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
        if am == 0.0 {
            b.fill(0);
            continue;
        }
        // The first value whose magnitude is the maximum (ggml's choice).
        let vam = _mm256_set1_ps(am);
        let mut max = am;
        for i in 0..32 {
            let a = _mm256_andnot_ps(sign, _mm256_loadu_ps(xp.add(8 * i)));
            let hit = _mm256_movemask_ps(_mm256_cmp_ps(a, vam, _CMP_EQ_OQ));
            if hit != 0 {
                max = x[8 * i + hit.trailing_zeros() as usize];
                break;
            }
        }
        let iscale = -127.0f32 / max;
        let vis = _mm256_set1_ps(iscale);
        let lim = _mm256_set1_epi32(127);
        let qs = b.as_mut_ptr().add(4);
        // Per 32 codes: the codes, and their 4-element sums (8 i32 lanes).
        let mut sums4 = [_mm256_setzero_si256(); 8];
        for (c, s4) in sums4.iter_mut().enumerate() {
            let mut q = [_mm256_setzero_si256(); 4];
            for (k, qk) in q.iter_mut().enumerate() {
                let p = _mm256_mul_ps(_mm256_loadu_ps(xp.add(32 * c + 8 * k)), vis);
                *qk = _mm256_min_epi32(_mm256_cvtps_epi32(p), lim);
            }
            let w = _mm256_packs_epi16(
                _mm256_packs_epi32(q[0], q[1]),
                _mm256_packs_epi32(q[2], q[3]),
            );
            let w = _mm256_permutevar8x32_epi32(w, order);
            _mm256_storeu_si256(qs.add(32 * c) as *mut __m256i, w);
            *s4 = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, w), ones16);
        }
        // hadd twice: lanes [c0 c1 c2 c3 | c0' c1' c2' c3'] = the sums of
        // elements 0..16 (unprimed) and 16..32 (primed) of four 32-runs.
        let quad = |a: &[__m256i]| {
            _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]))
        };
        let (lo, hi) = (quad(&sums4[0..4]), quad(&sums4[4..8]));
        // i16 [b0 b2 b4 b6 b8 b10 b12 b14 | b1 b3 ... b15], then interleaved.
        let p = _mm256_packs_epi32(lo, hi);
        let (even, odd) = (_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
        let bs = b.as_mut_ptr().add(260);
        _mm_storeu_si128(bs as *mut __m128i, _mm_unpacklo_epi16(even, odd));
        _mm_storeu_si128(bs.add(16) as *mut __m128i, _mm_unpackhi_epi16(even, odd));
        b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks that hit every rounding edge: exact halves (amax 127 makes
    /// x * id == x), values a hair on either side of them, zeros, NaN,
    /// infinities, subnormal maxima, and plain random values.
    fn tricky_blocks() -> Vec<f32> {
        let mut x = Vec::new();
        let halves: Vec<f32> = (0..32)
            .map(|j| {
                if j == 0 {
                    127.0
                } else {
                    (j as f32 - 16.0) + 0.5
                }
            })
            .collect();
        x.extend(&halves);
        x.extend(halves.iter().map(|v| {
            if *v == 127.0 {
                -127.0
            } else {
                f32::from_bits(v.to_bits() + 1)
            }
        }));
        x.extend(halves.iter().map(|v| {
            if *v == 127.0 {
                127.0
            } else {
                f32::from_bits(v.to_bits() - 1)
            }
        }));
        x.extend([0.0f32; 32]);
        let mut nan = vec![1.5f32; 32];
        nan[3] = f32::NAN;
        nan[7] = -3.0;
        x.extend(&nan);
        let mut inf = vec![0.25f32; 32];
        inf[9] = f32::INFINITY;
        inf[10] = -1.0;
        x.extend(&inf);
        let mut ninf = vec![-0.5f32; 32];
        ninf[0] = f32::NEG_INFINITY;
        x.extend(&ninf);
        x.extend(
            (0..32).map(|j| f32::from_bits(1 + j as u32 * 3) * if j % 2 == 0 { 1.0 } else { -1.0 }),
        );
        x.extend((0..32).map(|j| if j == 5 { 1e-39 } else { 0.0 }));
        let mut s = 12345u64;
        for _ in 0..64 * 32 {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            x.push(((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 7.3);
        }
        x
    }

    #[test]
    fn simd_activation_quantizers_are_bit_identical() {
        if !super::super::avx2::available() {
            eprintln!("skipping: this CPU has no AVX2+FMA+F16C");
            return;
        }
        let x = tricky_blocks();
        let nb = x.len() / 32;
        let (mut a, mut b) = (vec![0u8; nb * 34], vec![0u8; nb * 34]);
        super::super::legacy::quantize_q8_0(&x, &mut a);
        // SAFETY: available() checked above; lengths match.
        unsafe { quantize_q8_0(&x, &mut b) };
        for (i, (ba, bb)) in a.chunks(34).zip(b.chunks(34)).enumerate() {
            assert_eq!(ba, bb, "q8_0 block {i}");
        }
        let (mut a, mut b) = (vec![0u8; nb * 36], vec![0u8; nb * 36]);
        super::super::legacy::quantize_q8_1(&x, &mut a);
        // SAFETY: as above.
        unsafe { quantize_q8_1(&x, &mut b) };
        for (i, (ba, bb)) in a.chunks(36).zip(b.chunks(36)).enumerate() {
            assert_eq!(ba, bb, "q8_1 block {i}");
        }
        // Q8_K: 256-element blocks of the same values, plus blocks whose
        // largest magnitude appears twice with both signs (the first wins).
        let mut xk = x[..x.len() / 256 * 256].to_vec();
        let mut twice: Vec<f32> = (0..256).map(|j| (j as f32 * 0.37).sin()).collect();
        twice[17] = -3.0;
        twice[200] = 3.0;
        xk.extend(&twice);
        twice[17] = 3.0;
        twice[200] = -3.0;
        xk.extend(&twice);
        xk.extend([0.0f32; 256]);
        let nk = xk.len() / 256;
        let (mut a, mut b) = (vec![0u8; nk * 292], vec![0u8; nk * 292]);
        super::super::kquants::quantize_q8_k(&xk, &mut a);
        // SAFETY: as above.
        unsafe { quantize_q8_k(&xk, &mut b) };
        for (i, (ba, bb)) in a.chunks(292).zip(b.chunks(292)).enumerate() {
            assert_eq!(ba, bb, "q8_k block {i}");
        }
    }
}
