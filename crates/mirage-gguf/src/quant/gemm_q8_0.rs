//! Q8_0 weights times many Q8_0 activation rows (prompt prefill): a tiled
//! matrix-matrix kernel.
//!
//! The single- and 4-row dot kernels spend most of their instructions on
//! per-(weight block, token) bookkeeping: widening the 32 products of one
//! block to i32, converting them to f32 and scaling them, for every pair.
//! Here the activations are first repacked so that one 256-bit vector holds
//! the same 4 consecutive quants of [`Q8_0_TOKEN_GROUP`] (8) tokens
//! ([`pack_q8_0_rows`]). A weight block's 4-byte chunk is then broadcast and
//! multiplied with that vector, so one `vpdpbusd` (or its AVX2 emulation)
//! adds a 4-element partial dot product to each of 8 tokens' running sums,
//! and after the block's 8 chunks each i32 lane holds that token's exact
//! block sum. The conversion to f32 and the scale multiply are then done once
//! per (weight block, 8 tokens) instead of once per (weight block, token),
//! and a register tile of up to 4 weight rows x 2 token groups shares every
//! load.
//!
//! Packed block (one 32-element block of 8 tokens, [`PACKED_BLOCK_BYTES`]):
//! bytes 0..32 the 8 tokens' scales as f32 (the block's f16 `d`, widened
//! exactly); 32..64 the 8 tokens' `-128 * sum(qs)` as i32 (the correction
//! the unsigned-times-signed VNNI product needs, see below); 64..320 the
//! quants, chunk `c` (elements `4c..4c+4`) of token `t` at `64 + 32c + 4t`.
//! Group `g` (tokens `8g..8g+8`) holds its `cols / 32` blocks contiguously;
//! lanes past the last token are zero (scale 0, so they add nothing).
//!
//! Kernels (all compute `out[i * n + t] = W_i . act_t`):
//! - scalar: the reference. Per (row, token) it adds the block products in
//!   the order and with the float operations of the scalar `vec_dot`
//!   (`sum += isum as f32 * (dw * da)`), so it is bit-identical to it.
//! - AVX2: `|w| x sign(a, w)` through `maddubs`/`madd` (ggml's trick).
//! - AVX-512 VNNI (256-bit, AVX512VL): `vpdpbusd` needs one unsigned operand,
//!   so the weight bytes are biased to `w + 128` once per tile and the
//!   accumulator starts at the packed `-128 * sum(a)`:
//!   `sum((w + 128) a) - 128 sum(a) = sum(w a)`, exactly.
//!
//! The SIMD kernels form each block's product sum exactly in i32, like the
//! scalar one; they accumulate `isum * (dw * da)` with FMA in 8 lanes, so
//! they agree with the scalar kernel to float rounding (about 1e-6
//! relative), not bit for bit. Activation quants must lie in -127..=127 (the
//! Q8_0 quantizer's range; AVX2's `sign` trick cannot negate -128).

use super::util::f16_at;
use super::{row_bytes, QuantError};
use crate::types::GgmlType;

/// Tokens interleaved in one packed activation group.
pub const Q8_0_TOKEN_GROUP: usize = 8;
/// Bytes of one packed block (32 elements of [`Q8_0_TOKEN_GROUP`] tokens).
pub const PACKED_BLOCK_BYTES: usize = 320;

const QK: usize = 32;
const Q8_0_BYTES: usize = 34;
const SCALES_AT: usize = 0;
const CORR_AT: usize = 32;
const QS_AT: usize = 64;

/// Bytes that [`pack_q8_0_rows`] writes for `n_tokens` rows of `cols`.
pub fn packed_q8_0_bytes(n_tokens: usize, cols: usize) -> Result<usize, QuantError> {
    row_bytes(GgmlType::Q8_0, cols)?;
    Ok(n_tokens.div_ceil(Q8_0_TOKEN_GROUP) * (cols / QK) * PACKED_BLOCK_BYTES)
}

/// Repacks `n_tokens` Q8_0 rows of `cols` elements (row `t` at byte
/// `t * row_stride` of `rows`) into the interleaved layout the GEMM kernels
/// read (see the module docs). `dst` must hold exactly
/// [`packed_q8_0_bytes`]`(n_tokens, cols)` bytes.
pub fn pack_q8_0_rows(
    rows: &[u8],
    row_stride: usize,
    n_tokens: usize,
    cols: usize,
    dst: &mut [u8],
) -> Result<(), QuantError> {
    let rb = row_bytes(GgmlType::Q8_0, cols)?;
    let ty = GgmlType::Q8_0;
    if n_tokens > 0 {
        if row_stride < rb {
            return Err(QuantError::LengthMismatch {
                ty,
                what: "activation row stride",
                expected: rb,
                got: row_stride,
            });
        }
        let need = (n_tokens - 1) * row_stride + rb;
        if rows.len() < need {
            return Err(QuantError::LengthMismatch {
                ty,
                what: "activation rows bytes",
                expected: need,
                got: rows.len(),
            });
        }
    }
    let bytes = packed_q8_0_bytes(n_tokens, cols)?;
    if dst.len() != bytes {
        return Err(QuantError::LengthMismatch {
            ty,
            what: "packed activation bytes",
            expected: bytes,
            got: dst.len(),
        });
    }
    let nb = cols / QK;
    // Every byte of a full group is written below; only a last partial
    // group has lanes to clear.
    if n_tokens % Q8_0_TOKEN_GROUP != 0 {
        let last = n_tokens / Q8_0_TOKEN_GROUP * nb * PACKED_BLOCK_BYTES;
        dst[last..].fill(0);
    }
    for t in 0..n_tokens {
        let (g, lane) = (t / Q8_0_TOKEN_GROUP, t % Q8_0_TOKEN_GROUP);
        let row = &rows[t * row_stride..t * row_stride + rb];
        for (k, b) in row.chunks_exact(Q8_0_BYTES).enumerate() {
            let p =
                &mut dst[(g * nb + k) * PACKED_BLOCK_BYTES..(g * nb + k + 1) * PACKED_BLOCK_BYTES];
            let at = SCALES_AT + 4 * lane;
            p[at..at + 4].copy_from_slice(&f16_at(b, 0).to_le_bytes());
            let sum: i32 = b[2..].iter().map(|&q| q as i8 as i32).sum();
            let at = CORR_AT + 4 * lane;
            p[at..at + 4].copy_from_slice(&(-128 * sum).to_le_bytes());
            for c in 0..QK / 4 {
                let at = QS_AT + 32 * c + 4 * lane;
                p[at..at + 4].copy_from_slice(&b[2 + 4 * c..6 + 4 * c]);
            }
        }
    }
    Ok(())
}

/// An unchecked Q8_0 GEMM kernel:
/// `(cols, weights, rows, packed, n_tokens, out)`, writing
/// `out[i * n_tokens + t] = weights row i . token t` for `i < rows`,
/// `t < n_tokens`.
///
/// # Safety
/// `cols` is a multiple of 32; `weights` holds `rows` Q8_0 rows of `cols`
/// (contiguous); `packed` holds [`packed_q8_0_bytes`]`(n_tokens, cols)` bytes
/// written by [`pack_q8_0_rows`]; `out` holds at least `rows * n_tokens`
/// values. The CPU supports the kernel's features (guaranteed by
/// [`Q8_0Gemm::kernel`]).
pub type Q8_0GemmFn = unsafe fn(
    cols: usize,
    weights: &[u8],
    rows: usize,
    packed: &[u8],
    n_tokens: usize,
    out: &mut [f32],
);

/// An unchecked Q8_0 matrix-vector kernel: `(cols, weights, rows, act,
/// out)`, writing `out[i] = weights row i . act` for `i < rows`, where `act`
/// is one Q8_0 row of `cols` (decode).
///
/// # Safety
/// `cols` is a multiple of 32; `weights` holds `rows` contiguous Q8_0 rows
/// of `cols`, `act` one, `out` at least `rows` values; activation quants
/// lie in -127..=127. The CPU supports the kernel's features (guaranteed by
/// [`Q8_0Gemm::matvec_kernel`]).
pub type Q8_0MatvecFn =
    unsafe fn(cols: usize, weights: &[u8], rows: usize, act: &[u8], out: &mut [f32]);

/// The instruction sets a Q8_0 GEMM kernel exists for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Q8_0Gemm {
    /// Portable reference (bit-identical to the scalar `vec_dot`).
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 VNNI on 256-bit vectors (AVX512F + AVX512VL + AVX512_VNNI).
    Avx512Vnni,
}

impl Q8_0Gemm {
    /// Every kernel, slowest first.
    pub const ALL: [Q8_0Gemm; 3] = [Q8_0Gemm::Scalar, Q8_0Gemm::Avx2, Q8_0Gemm::Avx512Vnni];

    /// Whether this CPU runs the kernel.
    pub fn available(self) -> bool {
        match self {
            Q8_0Gemm::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Q8_0Gemm::Avx2 => super::avx2::available(),
            #[cfg(all(target_arch = "x86_64", mirage_avx512))]
            Q8_0Gemm::Avx512Vnni => {
                super::avx2::available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[allow(unreachable_patterns)] // every arm is there on x86_64 with mirage_avx512
            _ => false,
        }
    }

    /// The fastest kernel this CPU runs.
    pub fn best() -> Q8_0Gemm {
        Q8_0Gemm::ALL
            .into_iter()
            .rev()
            .find(|k| k.available())
            .unwrap_or(Q8_0Gemm::Scalar)
    }

    /// The kernel, if this CPU runs it.
    pub fn kernel(self) -> Option<Q8_0GemmFn> {
        if !self.available() {
            return None;
        }
        Some(match self {
            Q8_0Gemm::Scalar => gemm_scalar,
            #[cfg(target_arch = "x86_64")]
            Q8_0Gemm::Avx2 => x86::gemm_avx2,
            #[cfg(all(target_arch = "x86_64", mirage_avx512))]
            Q8_0Gemm::Avx512Vnni => x86::vnni::gemm_vnni,
            #[allow(unreachable_patterns)] // every arm is there on x86_64 with mirage_avx512
            _ => return None,
        })
    }

    /// The matrix-vector kernel (one token, decode) of this instruction set,
    /// if this CPU runs it. The scalar and AVX2 ones call the single-row
    /// `vec_dot` kernels per row.
    pub fn matvec_kernel(self) -> Option<Q8_0MatvecFn> {
        if !self.available() {
            return None;
        }
        Some(match self {
            Q8_0Gemm::Scalar => matvec_scalar,
            #[cfg(target_arch = "x86_64")]
            Q8_0Gemm::Avx2 => x86::matvec_avx2,
            #[cfg(all(target_arch = "x86_64", mirage_avx512))]
            Q8_0Gemm::Avx512Vnni => x86::vnni::matvec_vnni,
            #[allow(unreachable_patterns)] // every arm is there on x86_64 with mirage_avx512
            _ => return None,
        })
    }

    /// Checked call: `out[i] = weights row i . act` for one Q8_0 row `act`
    /// of `cols`. `weights` must hold exactly `rows` rows and `out` `rows`
    /// values.
    pub fn matvec(
        self,
        cols: usize,
        weights: &[u8],
        rows: usize,
        act: &[u8],
        out: &mut [f32],
    ) -> Result<(), QuantError> {
        let ty = GgmlType::Q8_0;
        let rb = row_bytes(ty, cols)?;
        if weights.len() != rb * rows {
            return Err(QuantError::LengthMismatch {
                ty,
                what: "weights bytes",
                expected: rb * rows,
                got: weights.len(),
            });
        }
        if act.len() != rb {
            return Err(QuantError::LengthMismatch {
                ty,
                what: "activation bytes",
                expected: rb,
                got: act.len(),
            });
        }
        if out.len() != rows {
            return Err(QuantError::LengthMismatch {
                ty,
                what: "output values",
                expected: rows,
                got: out.len(),
            });
        }
        let kernel = self.matvec_kernel().ok_or(QuantError::UnsupportedType {
            ty,
            op: "q8_0 matvec on this CPU",
        })?;
        // SAFETY: lengths checked above; matvec_kernel() only answers for
        // kernels this CPU runs.
        unsafe { kernel(cols, weights, rows, act, out) };
        Ok(())
    }

    /// Checked call: `out[i * n_tokens + t] = weights row i . token t`.
    /// `weights` must hold exactly `rows` Q8_0 rows of `cols`, `packed` the
    /// output of [`pack_q8_0_rows`] for `n_tokens` and `cols`, and `out`
    /// exactly `rows * n_tokens` values.
    pub fn gemm(
        self,
        cols: usize,
        weights: &[u8],
        rows: usize,
        packed: &[u8],
        n_tokens: usize,
        out: &mut [f32],
    ) -> Result<(), QuantError> {
        let ty = GgmlType::Q8_0;
        let wb = row_bytes(ty, cols)? * rows;
        if weights.len() != wb {
            return Err(QuantError::LengthMismatch {
                ty,
                what: "weights bytes",
                expected: wb,
                got: weights.len(),
            });
        }
        let pb = packed_q8_0_bytes(n_tokens, cols)?;
        if packed.len() != pb {
            return Err(QuantError::LengthMismatch {
                ty,
                what: "packed activation bytes",
                expected: pb,
                got: packed.len(),
            });
        }
        if out.len() != rows * n_tokens {
            return Err(QuantError::LengthMismatch {
                ty,
                what: "output values",
                expected: rows * n_tokens,
                got: out.len(),
            });
        }
        let kernel = self.kernel().ok_or(QuantError::UnsupportedType {
            ty,
            op: "q8_0 gemm on this CPU",
        })?;
        // SAFETY: every length checked above; kernel() only answers for
        // kernels this CPU runs.
        unsafe { kernel(cols, weights, rows, packed, n_tokens, out) };
        Ok(())
    }
}

/// The reference kernel; see the module docs.
///
/// # Safety
/// [`Q8_0GemmFn`]'s contract (it indexes checked slices, so a broken
/// contract panics instead of reading out of bounds).
unsafe fn gemm_scalar(
    cols: usize,
    w: &[u8],
    rows: usize,
    packed: &[u8],
    n: usize,
    out: &mut [f32],
) {
    let nb = cols / QK;
    let wrow = nb * Q8_0_BYTES;
    for i in 0..rows {
        let row = &w[i * wrow..(i + 1) * wrow];
        for t in 0..n {
            let (g, lane) = (t / Q8_0_TOKEN_GROUP, t % Q8_0_TOKEN_GROUP);
            let mut sum = 0f32;
            for (k, b) in row.chunks_exact(Q8_0_BYTES).enumerate() {
                let p = &packed[(g * nb + k) * PACKED_BLOCK_BYTES..];
                let mut s = 0i32;
                for c in 0..QK / 4 {
                    for j in 0..4 {
                        let a = p[QS_AT + 32 * c + 4 * lane + j] as i8 as i32;
                        s += (b[2 + 4 * c + j] as i8 as i32) * a;
                    }
                }
                let at = SCALES_AT + 4 * lane;
                let da = f32::from_le_bytes([p[at], p[at + 1], p[at + 2], p[at + 3]]);
                sum += s as f32 * (f16_at(b, 0) * da);
            }
            out[i * n + t] = sum;
        }
    }
}

/// Per-row scalar `vec_dot` (the reference).
///
/// # Safety
/// [`Q8_0MatvecFn`]'s contract (slices are indexed checked).
unsafe fn matvec_scalar(cols: usize, w: &[u8], rows: usize, act: &[u8], out: &mut [f32]) {
    let rb = cols / QK * Q8_0_BYTES;
    for i in 0..rows {
        out[i] = super::legacy::dot_q8_0_q8_0(cols, &w[i * rb..(i + 1) * rb], act);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{CORR_AT, PACKED_BLOCK_BYTES, Q8_0_BYTES, Q8_0_TOKEN_GROUP, QK, QS_AT, SCALES_AT};

    /// Weight rows per register tile.
    const RM: usize = 4;
    /// Blocks per K piece: the tile's weight scratch (RM rows x KC blocks x
    /// 32 bytes = 8 KiB) lives on the stack and in L1. Longer rows are
    /// done in pieces whose results are added to `out`.
    const KC: usize = 64;

    /// Generates one ISA's GEMM: `$prep` maps a weight block's 32 quant
    /// bytes to what the broadcast operand wants, `$init` gives the i32
    /// accumulator's start for a packed block, `$dot` adds one broadcast
    /// 4-byte weight chunk times one packed 8-token chunk. `$rn` is the
    /// number of token groups per register tile (bounded by the registers).
    macro_rules! tiled_gemm {
        ($name:ident, $feat:literal, rn = $rn:literal, $prep:ident, $init:ident, $dot:ident) => {
            /// See [`super::Q8_0GemmFn`].
            ///
            /// # Safety
            /// [`super::Q8_0GemmFn`]'s contract.
            #[target_feature(enable = $feat)]
            pub(crate) unsafe fn $name(
                cols: usize,
                w: &[u8],
                rows: usize,
                packed: &[u8],
                n: usize,
                out: &mut [f32],
            ) {
                #[target_feature(enable = $feat)]
                #[inline]
                unsafe fn row_tile<const M: usize>(
                    nb: usize,
                    w: *const u8,
                    packed: *const u8,
                    n: usize,
                    out: *mut f32,
                ) {
                    let wrow = nb * Q8_0_BYTES;
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
                                let src = w.add(m * wrow + (k0 + k) * Q8_0_BYTES);
                                dw[k * RM + m] =
                                    half::f16::from_bits(u16::from_le_bytes([*src, *src.add(1)]))
                                        .to_f32();
                                let q = _mm256_loadu_si256(src.add(2) as *const __m256i);
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
                                av[j] = _mm256_loadu_si256(
                                    blk[j].add(QS_AT + 32 * c) as *const __m256i
                                );
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
                let wrow = nb * Q8_0_BYTES;
                let (wp, pp, op) = (w.as_ptr(), packed.as_ptr(), out.as_mut_ptr());
                let mut r = 0;
                while r < rows {
                    let (wr, or) = (wp.add(r * wrow), op.add(r * n));
                    match rows - r {
                        1 => row_tile::<1>(nb, wr, pp, n, or),
                        2 => row_tile::<2>(nb, wr, pp, n, or),
                        3 => row_tile::<3>(nb, wr, pp, n, or),
                        _ => row_tile::<RM>(nb, wr, pp, n, or),
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
    /// [`super::Q8_0MatvecFn`]'s contract.
    pub(super) unsafe fn matvec_avx2(
        cols: usize,
        w: &[u8],
        rows: usize,
        act: &[u8],
        out: &mut [f32],
    ) {
        let rb = cols / QK * Q8_0_BYTES;
        let dot =
            super::super::avx2::dot_fn(crate::GgmlType::Q8_0).expect("AVX2 has a Q8_0 kernel");
        for i in 0..rows {
            out[i] = dot(cols, &w[i * rb..(i + 1) * rb], act);
        }
    }

    /// Activation blocks whose scales and `-128 * sum` corrections are
    /// computed per piece (1 KiB of stack); longer rows go in pieces.
    /// The AVX-512 VNNI kernels: built only by Rust 1.89+ (where AVX-512
    /// intrinsics and target features are stable; build.rs sets
    /// `mirage_avx512`), so the crate keeps building on its older MSRV.
    #[cfg(mirage_avx512)]
    #[allow(clippy::incompatible_msrv)] // gated on the compiler version above
    pub(super) mod vnni {
        use std::arch::x86_64::*;

        use super::super::{
            CORR_AT, PACKED_BLOCK_BYTES, Q8_0_BYTES, Q8_0_TOKEN_GROUP, QK, QS_AT, SCALES_AT,
        };
        use super::{KC, RM};

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
        /// prefetchers follow that; a multi-row column order defeated them).
        ///
        /// # Safety
        /// [`super::Q8_0MatvecFn`]'s contract.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
        pub(crate) unsafe fn matvec_vnni(
            cols: usize,
            w: &[u8],
            rows: usize,
            act: &[u8],
            out: &mut [f32],
        ) {
            let nb = cols / QK;
            let rb = nb * Q8_0_BYTES;
            let (wp, ap) = (w.as_ptr(), act.as_ptr());
            let bias = _mm256_set1_epi8(0x80u8 as i8);
            // Lane b of a gather: the f16 `d` of block b, 34 bytes apart.
            let d_offsets = _mm256_setr_epi32(0, 34, 68, 102, 136, 170, 204, 238);
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
                    let x0 = wp.add(r * rb + k0 * Q8_0_BYTES);
                    let mut acc = _mm256_setzero_ps();
                    let mut k = 0;
                    while k < kc {
                        let m = (kc - k).min(8);
                        let x = x0.add(k * Q8_0_BYTES);
                        let mut p = [_mm256_setzero_si256(); 8];
                        for (b, p) in p.iter_mut().enumerate().take(m) {
                            let q = _mm256_loadu_si256(x.add(b * Q8_0_BYTES + 2) as *const __m256i);
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
                                d16[b] = u16::from_le_bytes([
                                    *x.add(b * Q8_0_BYTES),
                                    *x.add(b * Q8_0_BYTES + 1),
                                ]);
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{quantize, vec_dot_scalar};

    /// Deterministic values in about [-2, 2] with some larger outliers (an
    /// LCG; no dependency).
    fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|i| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let v = ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0;
                if i % 37 == 5 {
                    v * 9.0
                } else {
                    v
                }
            })
            .collect()
    }

    fn q8_rows(seed: u64, rows: usize, cols: usize) -> Vec<u8> {
        let rb = row_bytes(GgmlType::Q8_0, cols).unwrap();
        let mut out = vec![0u8; rows * rb];
        for r in 0..rows {
            quantize(
                GgmlType::Q8_0,
                &values(seed * 1000 + r as u64, cols),
                &mut out[r * rb..(r + 1) * rb],
            )
            .unwrap();
        }
        out
    }

    #[test]
    fn every_kernel_equals_the_scalar_dot_on_odd_shapes() {
        let kernels: Vec<Q8_0Gemm> = Q8_0Gemm::ALL
            .into_iter()
            .filter(|k| k.available())
            .collect();
        assert!(kernels.contains(&Q8_0Gemm::Scalar));
        // Rows not a multiple of the 4-row tile, tokens 1..=19 (partial
        // groups and an odd group count), cols across the 64-block K piece.
        for (rows, cols) in [(1usize, 32usize), (3, 96), (5, 256), (7, 2080), (9, 4128)] {
            let rb = row_bytes(GgmlType::Q8_0, cols).unwrap();
            let w = q8_rows(rows as u64 + cols as u64, rows, cols);
            for n in [1usize, 2, 7, 8, 9, 16, 17, 19] {
                // Activation rows with a gap after each, so packing that
                // ignores the stride reads the wrong bytes.
                let stride = rb + 5;
                let mut act = vec![0u8; stride * n];
                let a = q8_rows(77 + n as u64, n, cols);
                for t in 0..n {
                    act[t * stride..t * stride + rb].copy_from_slice(&a[t * rb..(t + 1) * rb]);
                }
                // Stale bytes (a reused buffer): packing must clear the
                // padding lanes it does not write.
                let mut packed = vec![0xabu8; packed_q8_0_bytes(n, cols).unwrap()];
                pack_q8_0_rows(&act, stride, n, cols, &mut packed).unwrap();
                for &k in &kernels {
                    let mut out = vec![f32::NAN; rows * n];
                    k.gemm(cols, &w, rows, &packed, n, &mut out).unwrap();
                    for i in 0..rows {
                        for t in 0..n {
                            let wr = &w[i * rb..(i + 1) * rb];
                            let ar = &a[t * rb..(t + 1) * rb];
                            let reference = vec_dot_scalar(GgmlType::Q8_0, cols, wr, ar).unwrap();
                            let got = out[i * n + t];
                            if k == Q8_0Gemm::Scalar {
                                assert_eq!(
                                    got.to_bits(),
                                    reference.to_bits(),
                                    "scalar {rows}x{cols} n={n} ({i},{t})"
                                );
                            } else {
                                // Sum of |block terms| bounds the rounding
                                // of any summation order.
                                let mag: f32 = wr
                                    .chunks_exact(34)
                                    .zip(ar.chunks_exact(34))
                                    .map(|(x, y)| {
                                        vec_dot_scalar(GgmlType::Q8_0, 32, x, y).unwrap().abs()
                                    })
                                    .sum();
                                let tol = 2e-6 * mag + 1e-6;
                                assert!(
                                    (got - reference).abs() <= tol,
                                    "{k:?} {rows}x{cols} n={n} ({i},{t}): {got} vs {reference} (tol {tol})"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_matvec_kernel_equals_the_scalar_dot_on_odd_shapes() {
        // Block counts around the 8-block step, cols across the 128-block piece.
        for (rows, cols) in [
            (1usize, 32usize),
            (7, 96),
            (8, 64),
            (13, 288),
            (24, 4128),
            (17, 8224),
        ] {
            let rb = row_bytes(GgmlType::Q8_0, cols).unwrap();
            let w = q8_rows(rows as u64 * 3 + cols as u64, rows, cols);
            let a = q8_rows(5 + cols as u64, 1, cols);
            for k in Q8_0Gemm::ALL.into_iter().filter(|k| k.available()) {
                let mut out = vec![f32::NAN; rows];
                k.matvec(cols, &w, rows, &a, &mut out).unwrap();
                for i in 0..rows {
                    let wr = &w[i * rb..(i + 1) * rb];
                    let reference = vec_dot_scalar(GgmlType::Q8_0, cols, wr, &a).unwrap();
                    let mag: f32 = wr
                        .chunks_exact(34)
                        .zip(a.chunks_exact(34))
                        .map(|(x, y)| vec_dot_scalar(GgmlType::Q8_0, 32, x, y).unwrap().abs())
                        .sum();
                    let tol = if k == Q8_0Gemm::Scalar {
                        0.0
                    } else {
                        2e-6 * mag + 1e-6
                    };
                    assert!(
                        (out[i] - reference).abs() <= tol,
                        "{k:?} {rows}x{cols} row {i}: {} vs {reference}",
                        out[i]
                    );
                }
            }
        }
    }

    #[test]
    fn extreme_quants_stay_exact() {
        // Weights at -128 (a legal i8 in a file, outside the quantizer's
        // range) and +127, activations at +-127: the biased VNNI operand
        // and the AVX2 sign trick must not overflow or saturate.
        let cols = 64;
        // 9 rows: the matrix-vector kernel's 8-row tile plus a tail row.
        let mut w = vec![0u8; 9 * 68];
        for (r, row) in w.chunks_exact_mut(68).enumerate() {
            for b in row.chunks_exact_mut(34) {
                b[..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
                for (j, q) in b[2..].iter_mut().enumerate() {
                    *q = if (j + r) % 2 == 0 { 0x80 } else { 127 };
                }
            }
        }
        let mut a = vec![0u8; 3 * 68];
        for (t, row) in a.chunks_exact_mut(68).enumerate() {
            for b in row.chunks_exact_mut(34) {
                b[..2].copy_from_slice(&half::f16::from_f32(0.25).to_bits().to_le_bytes());
                for (j, q) in b[2..].iter_mut().enumerate() {
                    *q = if (j + t) % 3 == 0 {
                        (-127i8) as u8
                    } else {
                        127
                    };
                }
            }
        }
        let mut packed = vec![0u8; packed_q8_0_bytes(3, cols).unwrap()];
        pack_q8_0_rows(&a, 68, 3, cols, &mut packed).unwrap();
        for k in Q8_0Gemm::ALL.into_iter().filter(|k| k.available()) {
            for t in 0..3 {
                let mut mv = vec![0f32; 9];
                k.matvec(cols, &w, 9, &a[t * 68..(t + 1) * 68], &mut mv)
                    .unwrap();
                for i in 0..9 {
                    let reference = vec_dot_scalar(
                        GgmlType::Q8_0,
                        cols,
                        &w[i * 68..(i + 1) * 68],
                        &a[t * 68..(t + 1) * 68],
                    )
                    .unwrap();
                    assert_eq!(mv[i], reference, "{k:?} matvec ({i},{t})");
                }
            }
            let mut out = vec![0f32; 6];
            k.gemm(cols, &w[..2 * 68], 2, &packed, 3, &mut out).unwrap();
            for i in 0..2 {
                for t in 0..3 {
                    let reference = vec_dot_scalar(
                        GgmlType::Q8_0,
                        cols,
                        &w[i * 68..(i + 1) * 68],
                        &a[t * 68..(t + 1) * 68],
                    )
                    .unwrap();
                    // Block sums are small integers times 0.125: exact in any order.
                    assert_eq!(out[i * 3 + t], reference, "{k:?} ({i},{t})");
                }
            }
        }
    }

    #[test]
    fn bad_lengths_are_errors() {
        let k = Q8_0Gemm::Scalar;
        let w = q8_rows(1, 2, 64);
        let packed = vec![0u8; packed_q8_0_bytes(3, 64).unwrap()];
        let mut out = vec![0f32; 6];
        assert!(k.gemm(64, &w[1..], 2, &packed, 3, &mut out).is_err());
        assert!(k.gemm(64, &w, 2, &packed[1..], 3, &mut out).is_err());
        assert!(k.gemm(64, &w, 2, &packed, 3, &mut out[1..]).is_err());
        assert!(k.gemm(48, &w, 2, &packed, 3, &mut out).is_err());
        let mut p = vec![0u8; packed.len()];
        assert!(
            pack_q8_0_rows(&w, 68, 3, 64, &mut p).is_err(),
            "too few rows"
        );
        assert!(
            pack_q8_0_rows(&w, 60, 2, 64, &mut p).is_err(),
            "stride below a row"
        );
    }
}
