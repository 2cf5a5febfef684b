//! Plain f32 reference ops shared by the CPU backend and the tests: RMSNorm,
//! RoPE (interleaved and NEOX), softmax, SwiGLU and single-head attention.
//!
//! These are written for clarity first; they run on rows of at most a few
//! thousand elements, so the hot cost of a forward pass is in the quantized
//! matrix products, not here.

/// How RoPE pairs the elements of a head vector.
///
/// llama.cpp picks this per architecture (`llama_model_rope_type`): the llama
/// arch uses [`RopeMode::Normal`] (its converter permutes Q/K rows so that the
/// GGUF expects interleaved pairs), qwen2 and qwen3 use [`RopeMode::Neox`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeMode {
    /// ggml mode 0: rotate adjacent pairs `(x[2i], x[2i+1])`.
    Normal,
    /// ggml NEOX mode: rotate `(x[i], x[i + d/2])`.
    Neox,
}

/// `out = x / rms(x) * weight`, with `rms(x) = sqrt(mean(x^2) + eps)`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert_eq!(x.len(), weight.len());
    debug_assert_eq!(x.len(), out.len());
    // Accumulate in f64: rows of a few thousand elements lose a few ulps in f32.
    let sum_sq: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let scale = 1.0 / ((sum_sq / x.len() as f64) + eps as f64).sqrt();
    let scale = scale as f32;
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * scale * w;
    }
}

/// In-place [`rms_norm`].
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let sum_sq: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let scale = (1.0 / ((sum_sq / x.len() as f64) + eps as f64).sqrt()) as f32;
    for (v, &w) in x.iter_mut().zip(weight) {
        *v = *v * scale * w;
    }
}

/// Precomputed rotary angles for one position: `cos`/`sin` of
/// `pos * base^(-2i/d)` for `i` in `0..d/2`.
#[derive(Debug, Clone)]
pub struct RopeAngles {
    /// Cosines, one per rotated pair.
    pub cos: Vec<f32>,
    /// Sines, one per rotated pair.
    pub sin: Vec<f32>,
}

impl RopeAngles {
    /// Angles for `pos` with `head_dim` rotated dimensions and base `freq_base`.
    pub fn new(pos: usize, head_dim: usize, freq_base: f32) -> RopeAngles {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(half);
        let mut sin = Vec::with_capacity(half);
        for i in 0..half {
            // f64 so that long positions keep their phase; the references
            // (HF and ggml) compute in f32 and agree to ~1e-6 here.
            let inv_freq = (freq_base as f64).powf(-2.0 * i as f64 / head_dim as f64);
            let theta = pos as f64 * inv_freq;
            cos.push(theta.cos() as f32);
            sin.push(theta.sin() as f32);
        }
        RopeAngles { cos, sin }
    }
}

/// Rotates one head vector in place.
pub fn rope_in_place(x: &mut [f32], angles: &RopeAngles, mode: RopeMode) {
    let half = x.len() / 2;
    debug_assert_eq!(angles.cos.len(), half);
    match mode {
        RopeMode::Normal => {
            for i in 0..half {
                let (c, s) = (angles.cos[i], angles.sin[i]);
                let (a, b) = (x[2 * i], x[2 * i + 1]);
                x[2 * i] = a * c - b * s;
                x[2 * i + 1] = a * s + b * c;
            }
        }
        RopeMode::Neox => {
            for i in 0..half {
                let (c, s) = (angles.cos[i], angles.sin[i]);
                let (a, b) = (x[i], x[i + half]);
                x[i] = a * c - b * s;
                x[i + half] = a * s + b * c;
            }
        }
    }
}

/// Numerically stable softmax in place. An empty slice is left alone.
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return;
    }
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `x * sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `out[i] = silu(gate[i]) * up[i]`.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = silu(g) * u;
    }
}

/// GELU with the tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`
/// (PyTorch's `gelu(approximate="tanh")`, ggml's `gelu`).
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x)).tanh())
}

/// `out = gelu_tanh(gate) * up` elementwise (GeGLU).
pub fn geglu_tanh(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = gelu_tanh(g) * u;
    }
}

/// Dot product of two f32 slices (auto-vectorised: eight independent sums).
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 8];
    let chunks = n / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for i in chunks * 8..n {
        sum += a[i] * b[i];
    }
    sum
}

/// `y += alpha * x`.
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += alpha * x;
    }
}

/// Attention of one query head over `n` cached positions stored row-major
/// (`keys[j*d..(j+1)*d]`). `scores` needs `n` elements; `out` gets `d`.
///
/// [`attention_scores`], softmax, then [`attention_weighted_sum`] into a
/// zeroed `out`. Prefill and decode both come here, so a prompt fed at once
/// and the same prompt fed token by token attend identically.
pub fn attend_f32(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    n: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    attention_scores(q, keys, n, scale, scores);
    softmax_in_place(&mut scores[..n]);
    out.fill(0.0);
    attention_weighted_sum(&scores[..n], values, n, out);
}

/// [`attend_f32`] in portable loops only (the reference for the SIMD one).
pub fn attend_f32_portable(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    n: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let d = q.len();
    for j in 0..n {
        scores[j] = dot_f32(q, &keys[j * d..(j + 1) * d]) * scale;
    }
    softmax_in_place(&mut scores[..n]);
    out.fill(0.0);
    for j in 0..n {
        axpy(scores[j], &values[j * d..(j + 1) * d], out);
    }
}

/// Whether the AVX2+FMA(+F16C) attention pieces run for head size `d`
/// (the default build targets baseline x86-64, where the portable loops
/// compile to scalar code).
#[inline]
fn simd_attention(d: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        d.is_multiple_of(8)
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = d;
        false
    }
}

/// A key/value cache element the attention kernels read: f32, or f16
/// widened on load (exactly, so both give the same results on the same
/// values).
pub trait KvElement: Copy + Send + Sync + 'static {
    /// The value as f32 (exact).
    fn widen(self) -> f32;
    /// The AVX2+FMA+F16C score kernel for this element type.
    ///
    /// # Safety
    /// As `simd::scores_f32`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn simd_scores(q: &[f32], keys: &[Self], n: usize, scale: f32, scores: &mut [f32]);
    /// The AVX2+FMA+F16C weighted-sum kernel for this element type.
    ///
    /// # Safety
    /// As `simd::weighted_sum_f32`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn simd_weighted_sum(p: &[f32], values: &[Self], n: usize, out: &mut [f32]);
}

impl KvElement for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn simd_scores(q: &[f32], keys: &[f32], n: usize, scale: f32, scores: &mut [f32]) {
        simd::scores_f32(q, keys, n, scale, scores)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn simd_weighted_sum(p: &[f32], values: &[f32], n: usize, out: &mut [f32]) {
        simd::weighted_sum_f32(p, values, n, out)
    }
}

impl KvElement for half::f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn simd_scores(q: &[f32], keys: &[half::f16], n: usize, scale: f32, scores: &mut [f32]) {
        simd::scores_f16(q, keys, n, scale, scores)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn simd_weighted_sum(p: &[f32], values: &[half::f16], n: usize, out: &mut [f32]) {
        simd::weighted_sum_f16(p, values, n, out)
    }
}

/// `scores[j] = (q · keys_j) * scale` for `j < n` (`d = q.len()`). Each
/// score depends only on its own key, never on `n` or on which keys share
/// a SIMD step, so any split of the keys into calls gives the same scores.
pub fn attention_scores<T: KvElement>(
    q: &[f32],
    keys: &[T],
    n: usize,
    scale: f32,
    scores: &mut [f32],
) {
    let d = q.len();
    assert!(
        keys.len() >= n * d && scores.len() >= n,
        "attention_scores: short buffers"
    );
    #[cfg(target_arch = "x86_64")]
    if simd_attention(d) {
        // SAFETY: AVX2+FMA+F16C present, d % 8 == 0, lengths asserted above.
        return unsafe { T::simd_scores(q, keys, n, scale, scores) };
    }
    let mut row = vec![0f32; d];
    for j in 0..n {
        for (r, k) in row.iter_mut().zip(&keys[j * d..(j + 1) * d]) {
            *r = k.widen();
        }
        scores[j] = dot_f32(q, &row) * scale;
    }
}

/// `out += sum_j p[j] * values_j` for `j < n` (`d = out.len()`), adding the
/// keys in order: a split of the keys into consecutive calls gives the
/// same result as one call.
pub fn attention_weighted_sum<T: KvElement>(p: &[f32], values: &[T], n: usize, out: &mut [f32]) {
    let d = out.len();
    assert!(
        values.len() >= n * d && p.len() >= n,
        "attention_weighted_sum: short buffers"
    );
    #[cfg(target_arch = "x86_64")]
    if simd_attention(d) {
        // SAFETY: AVX2+FMA+F16C present, d % 8 == 0, lengths asserted above.
        return unsafe { T::simd_weighted_sum(p, values, n, out) };
    }
    for j in 0..n {
        for (o, v) in out.iter_mut().zip(&values[j * d..(j + 1) * d]) {
            *o += p[j] * v.widen();
        }
    }
}

/// [`attend_f32`] over f16 keys and values, widened on load (no widened
/// copy): the same results as widening the rows first and calling
/// [`attend_f32`].
pub fn attend_f16(
    q: &[f32],
    keys: &[half::f16],
    values: &[half::f16],
    n: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    attention_scores(q, keys, n, scale, scores);
    softmax_in_place(&mut scores[..n]);
    out.fill(0.0);
    attention_weighted_sum(&scores[..n], values, n, out);
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// Generates the score and weighted-sum kernels for one element type;
    /// `$load8` widens 8 elements at a pointer to a `__m256`.
    macro_rules! attention_kernels {
        ($scores:ident, $wsum:ident, $t:ty, $load8:ident) => {
            /// Scores of 8 keys at a time: 8 independent FMA chains over the
            /// head, reduced together by `hadd` into one vector of 8 scores.
            /// A last partial group runs the same code with zero
            /// accumulators for the missing keys, so every key's reduction
            /// tree is the same.
            ///
            /// # Safety
            /// AVX2, FMA and F16C are present; `d = q.len()` is a multiple
            /// of 8; `keys` holds `n * d` values and `scores` `n`.
            #[target_feature(enable = "avx2,fma,f16c")]
            pub(super) unsafe fn $scores(
                q: &[f32],
                keys: &[$t],
                n: usize,
                scale: f32,
                scores: &mut [f32],
            ) {
                let d = q.len();
                let (qp, kp) = (q.as_ptr(), keys.as_ptr());
                let vscale = _mm256_set1_ps(scale);
                let mut j = 0;
                while j < n {
                    let m = (n - j).min(8);
                    let mut acc = [_mm256_setzero_ps(); 8];
                    let mut c = 0;
                    while c < d {
                        let qc = _mm256_loadu_ps(qp.add(c));
                        if m == 8 {
                            for (key, a) in acc.iter_mut().enumerate() {
                                *a = _mm256_fmadd_ps(qc, $load8(kp.add((j + key) * d + c)), *a);
                            }
                        } else {
                            for (key, a) in acc.iter_mut().enumerate().take(m) {
                                *a = _mm256_fmadd_ps(qc, $load8(kp.add((j + key) * d + c)), *a);
                            }
                        }
                        c += 8;
                    }
                    let h01 = _mm256_hadd_ps(acc[0], acc[1]);
                    let h23 = _mm256_hadd_ps(acc[2], acc[3]);
                    let h45 = _mm256_hadd_ps(acc[4], acc[5]);
                    let h67 = _mm256_hadd_ps(acc[6], acc[7]);
                    let h0123 = _mm256_hadd_ps(h01, h23);
                    let h4567 = _mm256_hadd_ps(h45, h67);
                    let sums = _mm256_add_ps(
                        _mm256_permute2f128_ps(h0123, h4567, 0x20),
                        _mm256_permute2f128_ps(h0123, h4567, 0x31),
                    );
                    let mut lanes = [0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_mul_ps(sums, vscale));
                    scores[j..j + m].copy_from_slice(&lanes[..m]);
                    j += m;
                }
            }

            /// The weighted value sum with the output held in registers, 64
            /// dimensions at a time, across all keys (one FMA per key and 8
            /// dimensions), keys in order.
            ///
            /// # Safety
            /// AVX2, FMA and F16C are present; `d = out.len()` is a multiple
            /// of 8; `values` holds `n * d` values and `p` `n`.
            #[target_feature(enable = "avx2,fma,f16c")]
            pub(super) unsafe fn $wsum(p: &[f32], values: &[$t], n: usize, out: &mut [f32]) {
                let d = out.len();
                let (vp, op) = (values.as_ptr(), out.as_mut_ptr());
                let mut b = 0;
                while b < d {
                    let w = ((d - b) / 8).min(8);
                    let mut acc = [_mm256_setzero_ps(); 8];
                    for (i, a) in acc.iter_mut().enumerate().take(w) {
                        *a = _mm256_loadu_ps(op.add(b + 8 * i));
                    }
                    if w == 8 {
                        for (j, &pj) in p.iter().enumerate().take(n) {
                            let s = _mm256_set1_ps(pj);
                            let v = vp.add(j * d + b);
                            for (i, a) in acc.iter_mut().enumerate() {
                                *a = _mm256_fmadd_ps(s, $load8(v.add(8 * i)), *a);
                            }
                        }
                    } else {
                        for (j, &pj) in p.iter().enumerate().take(n) {
                            let s = _mm256_set1_ps(pj);
                            let v = vp.add(j * d + b);
                            for (i, a) in acc.iter_mut().enumerate().take(w) {
                                *a = _mm256_fmadd_ps(s, $load8(v.add(8 * i)), *a);
                            }
                        }
                    }
                    for (i, a) in acc.iter().enumerate().take(w) {
                        _mm256_storeu_ps(op.add(b + 8 * i), *a);
                    }
                    b += 8 * w;
                }
            }
        };
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load8_f32(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load8_f16(p: *const half::f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    attention_kernels!(scores_f32, weighted_sum_f32, f32, load8_f32);
    attention_kernels!(scores_f16, weighted_sum_f16, half::f16, load8_f16);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simd_attention_matches_the_portable_loops() {
        let mut seed = 7u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        // d: one and several 64-wide output blocks, a 64 + 8 tail, and
        // 12 (not a multiple of 8: the portable path); n around 8.
        for d in [8usize, 64, 72, 128, 12] {
            for n in [1usize, 7, 8, 9, 33] {
                let q: Vec<f32> = (0..d).map(|_| next()).collect();
                let k: Vec<f32> = (0..n * d).map(|_| next() * 3.0).collect();
                let v: Vec<f32> = (0..n * d).map(|_| next()).collect();
                let (mut s1, mut s2) = (vec![0f32; n], vec![0f32; n]);
                let (mut o1, mut o2) = (vec![0f32; d], vec![0f32; d]);
                attend_f32(&q, &k, &v, n, 0.3, &mut s1, &mut o1);
                attend_f32_portable(&q, &k, &v, n, 0.3, &mut s2, &mut o2);
                for i in 0..d {
                    assert!(
                        (o1[i] - o2[i]).abs() <= 1e-5,
                        "d={d} n={n} dim {i}: {} vs {}",
                        o1[i],
                        o2[i]
                    );
                }
                // Split into two calls (as the KV-page path does): the
                // same scores and output bit for bit.
                let cut = n / 3;
                let (mut s3, mut o3) = (vec![0f32; n], vec![0f32; d]);
                attention_scores(&q, &k[..cut * d], cut, 0.3, &mut s3[..cut]);
                attention_scores(&q, &k[cut * d..], n - cut, 0.3, &mut s3[cut..]);
                softmax_in_place(&mut s3);
                attention_weighted_sum(&s3[..cut], &v[..cut * d], cut, &mut o3);
                attention_weighted_sum(&s3[cut..], &v[cut * d..], n - cut, &mut o3);
                assert_eq!(s3, s1, "d={d} n={n}: split scores");
                assert_eq!(o3, o1, "d={d} n={n}: split output");
                // f16 rows read directly equal the same rows widened first.
                let k16: Vec<half::f16> = k.iter().map(|&x| half::f16::from_f32(x)).collect();
                let v16: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
                let kw: Vec<f32> = k16.iter().map(|x| x.to_f32()).collect();
                let vw: Vec<f32> = v16.iter().map(|x| x.to_f32()).collect();
                let (mut s4, mut o4, mut s5, mut o5) =
                    (vec![0f32; n], vec![0f32; d], vec![0f32; n], vec![0f32; d]);
                attend_f16(&q, &k16, &v16, n, 0.3, &mut s4, &mut o4);
                attend_f32(&q, &kw, &vw, n, 0.3, &mut s5, &mut o5);
                assert_eq!(o4, o5, "d={d} n={n}: f16 direct vs widened");
            }
        }
    }

    #[test]
    fn rms_norm_matches_definition() {
        let x = [1.0f32, -2.0, 3.0, 0.5];
        let w = [1.0f32, 2.0, 0.5, 1.0];
        let mut out = [0.0f32; 4];
        rms_norm(&x, &w, 1e-5, &mut out);
        let ms = (1.0 + 4.0 + 9.0 + 0.25) / 4.0;
        let s = 1.0 / (ms + 1e-5f64).sqrt();
        for i in 0..4 {
            assert!((out[i] as f64 - x[i] as f64 * s * w[i] as f64).abs() < 1e-6);
        }
        let mut y = x;
        rms_norm_in_place(&mut y, &w, 1e-5);
        assert_eq!(y, out);
    }

    #[test]
    fn rope_modes_rotate_the_right_pairs() {
        let d = 8;
        let a = RopeAngles::new(3, d, 10000.0);
        let x: Vec<f32> = (0..d).map(|i| i as f32 + 1.0).collect();
        let mut n = x.clone();
        rope_in_place(&mut n, &a, RopeMode::Normal);
        let mut x2 = x.clone();
        rope_in_place(&mut x2, &a, RopeMode::Neox);
        // Pair 0 has frequency 1: angle = pos.
        let (c, s) = (3.0f32.cos(), 3.0f32.sin());
        assert!((n[0] - (1.0 * c - 2.0 * s)).abs() < 1e-5);
        assert!((n[1] - (1.0 * s + 2.0 * c)).abs() < 1e-5);
        assert!((x2[0] - (1.0 * c - 5.0 * s)).abs() < 1e-5);
        assert!((x2[4] - (1.0 * s + 5.0 * c)).abs() < 1e-5);
        // Rotation preserves the norm in both modes.
        let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>();
        assert!((norm(&n) - norm(&x)).abs() < 1e-3);
        assert!((norm(&x2) - norm(&x)).abs() < 1e-3);
        // Position 0 is the identity.
        let mut z = x.clone();
        rope_in_place(&mut z, &RopeAngles::new(0, d, 10000.0), RopeMode::Neox);
        assert_eq!(z, x);
    }

    #[test]
    fn rope_relative_property() {
        // <R(p) q, R(p') k> depends only on p - p'.
        let d = 16;
        let q: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin()).collect();
        let k: Vec<f32> = (0..d).map(|i| (i as f32 * 0.71).cos()).collect();
        for mode in [RopeMode::Normal, RopeMode::Neox] {
            let score = |pq: usize, pk: usize| {
                let mut a = q.clone();
                let mut b = k.clone();
                rope_in_place(&mut a, &RopeAngles::new(pq, d, 10000.0), mode);
                rope_in_place(&mut b, &RopeAngles::new(pk, d, 10000.0), mode);
                dot_f32(&a, &b)
            };
            assert!((score(7, 3) - score(14, 10)).abs() < 1e-4);
        }
    }

    #[test]
    fn softmax_sums_to_one_and_is_stable() {
        let mut x = [1000.0f32, 1001.0, 999.0];
        softmax_in_place(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[1] > x[0] && x[0] > x[2]);
    }

    #[test]
    fn attention_with_one_position_returns_its_value() {
        let q = [1.0f32, 2.0];
        let k = [0.5f32, 0.5];
        let v = [3.0f32, -1.0];
        let mut s = [0.0f32; 1];
        let mut out = [0.0f32; 2];
        attend_f32(&q, &k, &v, 1, 0.7, &mut s, &mut out);
        assert_eq!(out, v);
        // Two positions: weights follow softmax of the scaled scores.
        let k2 = [1.0f32, 0.0, 0.0, 1.0];
        let v2 = [1.0f32, 0.0, 0.0, 1.0];
        let mut s2 = [0.0f32; 2];
        attend_f32(&q, &k2, &v2, 2, 1.0, &mut s2, &mut out);
        let e = (2.0f32 - 1.0).exp();
        assert!((out[1] - e / (1.0 + e)).abs() < 1e-6);
    }

    #[test]
    fn gelu_tanh_matches_its_definition() {
        // The tanh-approximation formula evaluated in f64.
        for (x, want) in [
            (-3.0f32, -0.003_637_392),
            (-1.0, -0.158_808),
            (0.0, 0.0),
            (0.5, 0.345_714),
            (2.0, 1.954_598),
        ] {
            assert!(
                (gelu_tanh(x) - want).abs() < 1e-5,
                "gelu({x}) = {}",
                gelu_tanh(x)
            );
        }
        let mut o = [0.0f32; 2];
        geglu_tanh(&[2.0, -1.0], &[3.0, 2.0], &mut o);
        assert!((o[0] - 3.0 * 1.954_598).abs() < 1e-4 && (o[1] + 2.0 * 0.158_808).abs() < 1e-5);
    }

    #[test]
    fn swiglu_and_dot() {
        let mut o = [0.0f32; 2];
        swiglu(&[0.0, 2.0], &[5.0, 3.0], &mut o);
        assert_eq!(o[0], 0.0);
        assert!((o[1] - 3.0 * 2.0 / (1.0 + (-2.0f32).exp())).abs() < 1e-6);
        let a: Vec<f32> = (0..19).map(|i| i as f32).collect();
        assert_eq!(
            dot_f32(&a, &a),
            (0..19).map(|i| (i * i) as f32).sum::<f32>()
        );
    }
}
