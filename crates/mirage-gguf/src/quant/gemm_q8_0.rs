//! Q8_0, Q5_0 and Q4_0 weights times many Q8_0 activation rows (prompt
//! prefill): a tiled matrix-matrix kernel.
//!
//! The single- and 4-row dot kernels spend most of their instructions on
//! per-(weight block, token) bookkeeping: widening the 32 products of one
//! block to i32, converting them to f32 and scaling them, for every pair.
//! Here the activations are first repacked so that one 256-bit vector holds
//! the same 4 consecutive quants of [`Q8_0_TOKEN_GROUP`] (8) tokens
//! ([`pack_q8_0_rows`]). A weight block is decoded once per row tile into
//! 32 signed codes (Q8_0 as stored, Q5_0 `q - 16`, Q4_0 `q - 8`) and its
//! 4-byte chunks are broadcast and multiplied with that vector, so one
//! `vpdpbusd` (or its AVX2 emulation) adds a 4-element partial dot product
//! to each of 8 tokens' running sums, and after the block's 8 chunks each
//! i32 lane holds that token's exact block sum. The conversion to f32 and
//! the scale multiply are then done once per (weight block, 8 tokens)
//! instead of once per (weight block, token), and a register tile of up to
//! 4 weight rows x 2 token groups shares every load.
//!
//! Packed block (one 32-element block of 8 tokens, [`PACKED_BLOCK_BYTES`]):
//! bytes 0..32 the 8 tokens' scales as f32 (the block's f16 `d`, widened
//! exactly); 32..64 the 8 tokens' `-128 * sum(qs)` as i32 (the correction
//! the unsigned-times-signed VNNI product needs, see below); 64..320 the
//! quants, chunk `c` (elements `4c..4c+4`) of token `t` at `64 + 32c + 4t`.
//! Group `g` (tokens `8g..8g+8`) holds its `cols / 32` blocks contiguously;
//! lanes past the last token are zero (scale 0, so they add nothing).
//!
//! Kernels (all compute `out[i * n + t] = W_i . act_t`, in
//! [`super::gemm_q8_0_x86`] for x86):
//! - scalar: the reference: each token's Q8_0 row is read back out of the
//!   packed layout and dotted by the scalar `vec_dot`.
//! - AVX2: `|w| x sign(a, w)` through `maddubs`/`madd` (ggml's trick).
//! - AVX-512 VNNI (256-bit, AVX512VL): `vpdpbusd` needs one unsigned operand,
//!   so the weight codes are biased to `w + 128` once per tile and the
//!   accumulator starts at the packed `-128 * sum(a)`:
//!   `sum((w + 128) a) - 128 sum(a) = sum(w a)`, exactly.
//!
//! The SIMD kernels form each block's product sum exactly in i32, like the
//! scalar one; they accumulate `isum * (dw * da)` with FMA in 8 lanes, so
//! they agree with the scalar kernel to float rounding (about 1e-6
//! relative), not bit for bit. Activation quants must lie in -127..=127 (the
//! Q8_0 quantizer's range; AVX2's `sign` trick cannot negate -128).

use super::gemm::{GemmFn, GemmIsa, MatvecFn};
use super::util::f16_at;
use super::{row_bytes, QuantError};
use crate::types::GgmlType;

/// Tokens interleaved in one packed activation group.
pub const Q8_0_TOKEN_GROUP: usize = 8;
/// Bytes of one packed block (32 elements of [`Q8_0_TOKEN_GROUP`] tokens).
pub const PACKED_BLOCK_BYTES: usize = 320;

pub(crate) const QK: usize = 32;
pub(crate) const Q8_0_BYTES: usize = 34;
pub(crate) const SCALES_AT: usize = 0;
pub(crate) const CORR_AT: usize = 32;
pub(crate) const QS_AT: usize = 64;

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
    let ty = GgmlType::Q8_0;
    let rb = row_bytes(ty, cols)?;
    super::gemm::check_rows(ty, rows, row_stride, n_tokens, rb)?;
    let bytes = packed_q8_0_bytes(n_tokens, cols)?;
    super::check_len(ty, "packed activation bytes", bytes, dst.len())?;
    let nb = cols / QK;
    // Every byte of a full group is written below; only a last partial
    // group has lanes to clear.
    if !n_tokens.is_multiple_of(Q8_0_TOKEN_GROUP) {
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

/// Token `t`'s Q8_0 row of `nb` blocks, read back out of a packed buffer.
/// The packed scale is the f16 widened exactly, so narrowing restores it.
fn unpack_token(packed: &[u8], nb: usize, t: usize, row: &mut [u8]) {
    let (g, lane) = (t / Q8_0_TOKEN_GROUP, t % Q8_0_TOKEN_GROUP);
    for k in 0..nb {
        let p = &packed[(g * nb + k) * PACKED_BLOCK_BYTES..(g * nb + k + 1) * PACKED_BLOCK_BYTES];
        let b = &mut row[k * Q8_0_BYTES..(k + 1) * Q8_0_BYTES];
        let at = SCALES_AT + 4 * lane;
        let d = f32::from_le_bytes([p[at], p[at + 1], p[at + 2], p[at + 3]]);
        b[0..2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
        for c in 0..QK / 4 {
            let at = QS_AT + 32 * c + 4 * lane;
            b[2 + 4 * c..6 + 4 * c].copy_from_slice(&p[at..at + 4]);
        }
    }
}

/// The reference kernel for weight type `T` (Q8_0, Q5_0 or Q4_0): each
/// token's Q8_0 row is read back out of the packed layout and dotted with
/// every weight row by the scalar `vec_dot`.
///
/// # Safety
/// [`GemmFn`]'s contract (slices are indexed checked).
unsafe fn gemm_scalar<const T: u32>(
    cols: usize,
    w: &[u8],
    rows: usize,
    packed: &[u8],
    n: usize,
    out: &mut [f32],
) {
    let Some(ty) = GgmlType::from_id(T) else {
        return;
    };
    let Some(dot) = super::scalar_dot_fn(ty) else {
        return;
    };
    let nb = cols / QK;
    let wrow = nb * ty.type_size();
    let mut act = vec![0u8; nb * Q8_0_BYTES];
    for t in 0..n {
        unpack_token(packed, nb, t, &mut act);
        for i in 0..rows {
            // SAFETY: lengths per the contract; scalar kernels need no
            // CPU feature.
            out[i * n + t] = unsafe { dot(cols, &w[i * wrow..(i + 1) * wrow], &act) };
        }
    }
}

/// Per-row scalar `vec_dot` (the reference).
///
/// # Safety
/// [`MatvecFn`]'s contract (slices are indexed checked).
unsafe fn matvec_scalar(cols: usize, w: &[u8], rows: usize, act: &[u8], out: &mut [f32]) {
    let rb = cols / QK * Q8_0_BYTES;
    for i in 0..rows {
        out[i] = super::legacy::dot_q8_0_q8_0(cols, &w[i * rb..(i + 1) * rb], act);
    }
}

/// The GEMM kernel of `isa` for weight type `ty` (Q8_0, Q5_0 or Q4_0).
/// The caller checked that the CPU runs `isa`.
pub(crate) fn kernel(isa: GemmIsa, ty: GgmlType) -> Option<GemmFn> {
    #[cfg(target_arch = "x86_64")]
    use super::gemm_q8_0_x86 as x86;
    use GgmlType::*;
    Some(match (isa, ty) {
        (GemmIsa::Scalar, Q8_0) => gemm_scalar::<{ Q8_0 as u32 }>,
        (GemmIsa::Scalar, Q5_0) => gemm_scalar::<{ Q5_0 as u32 }>,
        (GemmIsa::Scalar, Q4_0) => gemm_scalar::<{ Q4_0 as u32 }>,
        #[cfg(target_arch = "x86_64")]
        (GemmIsa::Avx2, Q8_0) => x86::gemm_avx2::<{ Q8_0 as u32 }>,
        #[cfg(target_arch = "x86_64")]
        (GemmIsa::Avx2, Q5_0) => x86::gemm_avx2::<{ Q5_0 as u32 }>,
        #[cfg(target_arch = "x86_64")]
        (GemmIsa::Avx2, Q4_0) => x86::gemm_avx2::<{ Q4_0 as u32 }>,
        #[cfg(all(target_arch = "x86_64", mirage_avx512))]
        (GemmIsa::Avx512Vnni, Q8_0) => x86::vnni::gemm_vnni::<{ Q8_0 as u32 }>,
        #[cfg(all(target_arch = "x86_64", mirage_avx512))]
        (GemmIsa::Avx512Vnni, Q5_0) => x86::vnni::gemm_vnni::<{ Q5_0 as u32 }>,
        #[cfg(all(target_arch = "x86_64", mirage_avx512))]
        (GemmIsa::Avx512Vnni, Q4_0) => x86::vnni::gemm_vnni::<{ Q4_0 as u32 }>,
        _ => return None,
    })
}

/// The matrix-vector kernel of `isa` for weight type `ty` (Q8_0, Q5_0 or
/// Q4_0; the scalar and AVX2 Q8_0 ones call the single-row `vec_dot`
/// kernels per row, the other types have only the VNNI one). The caller
/// checked that the CPU runs `isa`.
pub(crate) fn matvec_kernel(isa: GemmIsa, ty: GgmlType) -> Option<MatvecFn> {
    #[cfg(target_arch = "x86_64")]
    use super::gemm_q8_0_x86 as x86;
    use GgmlType::*;
    Some(match (isa, ty) {
        (GemmIsa::Scalar, Q8_0) => matvec_scalar,
        #[cfg(target_arch = "x86_64")]
        (GemmIsa::Avx2, Q8_0) => x86::matvec_avx2,
        #[cfg(all(target_arch = "x86_64", mirage_avx512))]
        (GemmIsa::Avx512Vnni, Q8_0) => x86::vnni::matvec_vnni::<{ Q8_0 as u32 }>,
        #[cfg(all(target_arch = "x86_64", mirage_avx512))]
        (GemmIsa::Avx512Vnni, Q5_0) => x86::vnni::matvec_vnni::<{ Q5_0 as u32 }>,
        #[cfg(all(target_arch = "x86_64", mirage_avx512))]
        (GemmIsa::Avx512Vnni, Q4_0) => x86::vnni::matvec_vnni::<{ Q4_0 as u32 }>,
        _ => return None,
    })
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
        weight_rows(GgmlType::Q8_0, seed, rows, cols)
    }

    fn weight_rows(ty: GgmlType, seed: u64, rows: usize, cols: usize) -> Vec<u8> {
        let rb = row_bytes(ty, cols).unwrap();
        let mut out = vec![0u8; rows * rb];
        for r in 0..rows {
            quantize(
                ty,
                &values(seed * 1000 + r as u64, cols),
                &mut out[r * rb..(r + 1) * rb],
            )
            .unwrap();
        }
        out
    }

    #[test]
    fn every_kernel_equals_the_scalar_dot_on_odd_shapes() {
        let kernels: Vec<GemmIsa> = GemmIsa::ALL.into_iter().filter(|k| k.available()).collect();
        assert!(kernels.contains(&GemmIsa::Scalar));
        for ty in [GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::Q4_0] {
            let bs = ty.type_size();
            // Rows not a multiple of the 4-row tile, tokens 1..=19 (partial
            // groups and an odd group count), cols across the 64-block K piece.
            for (rows, cols) in [(1usize, 32usize), (3, 96), (5, 256), (7, 2080), (9, 4128)] {
                let rb = row_bytes(GgmlType::Q8_0, cols).unwrap();
                let wrb = row_bytes(ty, cols).unwrap();
                let w = weight_rows(ty, rows as u64 + cols as u64, rows, cols);
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
                        k.gemm(ty, cols, &w, rows, &packed, n, &mut out).unwrap();
                        for i in 0..rows {
                            for t in 0..n {
                                let wr = &w[i * wrb..(i + 1) * wrb];
                                let ar = &a[t * rb..(t + 1) * rb];
                                let reference = vec_dot_scalar(ty, cols, wr, ar).unwrap();
                                let got = out[i * n + t];
                                if k == GemmIsa::Scalar {
                                    assert_eq!(
                                        got.to_bits(),
                                        reference.to_bits(),
                                        "scalar {ty} {rows}x{cols} n={n} ({i},{t})"
                                    );
                                } else {
                                    // Sum of |block terms| bounds the rounding
                                    // of any summation order.
                                    let mag: f32 = wr
                                        .chunks_exact(bs)
                                        .zip(ar.chunks_exact(34))
                                        .map(|(x, y)| vec_dot_scalar(ty, 32, x, y).unwrap().abs())
                                        .sum();
                                    let tol = 2e-6 * mag + 1e-6;
                                    assert!(
                                        (got - reference).abs() <= tol,
                                        "{k:?} {ty} {rows}x{cols} n={n} ({i},{t}): {got} vs {reference} (tol {tol})"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_matvec_kernel_equals_the_scalar_dot_on_odd_shapes() {
        for ty in [GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::Q4_0] {
            let bs = ty.type_size();
            // Block counts around the 8-block step, cols across the 128-block piece.
            for (rows, cols) in [
                (1usize, 32usize),
                (7, 96),
                (8, 64),
                (13, 288),
                (24, 4128),
                (17, 8224),
            ] {
                let rb = row_bytes(ty, cols).unwrap();
                let w = weight_rows(ty, rows as u64 * 3 + cols as u64, rows, cols);
                let a = q8_rows(5 + cols as u64, 1, cols);
                for k in GemmIsa::ALL.into_iter().filter(|k| k.available()) {
                    if k.matvec_kernel(ty).is_none() {
                        continue;
                    }
                    let mut out = vec![f32::NAN; rows];
                    k.matvec(ty, cols, &w, rows, &a, &mut out).unwrap();
                    for i in 0..rows {
                        let wr = &w[i * rb..(i + 1) * rb];
                        let reference = vec_dot_scalar(ty, cols, wr, &a).unwrap();
                        let mag: f32 = wr
                            .chunks_exact(bs)
                            .zip(a.chunks_exact(34))
                            .map(|(x, y)| vec_dot_scalar(ty, 32, x, y).unwrap().abs())
                            .sum();
                        let tol = if k == GemmIsa::Scalar {
                            0.0
                        } else {
                            2e-6 * mag + 1e-6
                        };
                        assert!(
                            (out[i] - reference).abs() <= tol,
                            "{k:?} {ty} {rows}x{cols} row {i}: {} vs {reference}",
                            out[i]
                        );
                    }
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
        for k in GemmIsa::ALL.into_iter().filter(|k| k.available()) {
            for t in 0..3 {
                let mut mv = vec![0f32; 9];
                k.matvec(
                    GgmlType::Q8_0,
                    cols,
                    &w,
                    9,
                    &a[t * 68..(t + 1) * 68],
                    &mut mv,
                )
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
            k.gemm(GgmlType::Q8_0, cols, &w[..2 * 68], 2, &packed, 3, &mut out)
                .unwrap();
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
        let k = GemmIsa::Scalar;
        let w = q8_rows(1, 2, 64);
        let packed = vec![0u8; packed_q8_0_bytes(3, 64).unwrap()];
        let mut out = vec![0f32; 6];
        assert!(k
            .gemm(GgmlType::Q8_0, 64, &w[1..], 2, &packed, 3, &mut out)
            .is_err());
        assert!(k
            .gemm(GgmlType::Q8_0, 64, &w, 2, &packed[1..], 3, &mut out)
            .is_err());
        assert!(k
            .gemm(GgmlType::Q8_0, 64, &w, 2, &packed, 3, &mut out[1..])
            .is_err());
        assert!(k
            .gemm(GgmlType::Q8_0, 48, &w, 2, &packed, 3, &mut out)
            .is_err());
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
