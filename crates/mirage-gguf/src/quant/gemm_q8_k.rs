//! K-quant weights (Q4_K, Q5_K, Q6_K) times many Q8_K activation rows
//! (prompt prefill): the packed activation layout, the scalar reference and
//! the tile loop shared by the SIMD kernels of [`super::gemm_q8_k_x86`].
//!
//! The single-row kernels spend most of their instructions unpacking each
//! weight super-block (nibbles, 6-bit scales and mins) and reducing its
//! products horizontally, once per (super-block, token). Here a panel of
//! weight rows is unpacked once per batch into plain bytes
//! ([`UnpackedSb`]: 256 codes, the integer sub-block scales and the min
//! pairs, `d`, `dmin`), and the activations are repacked so that one
//! 256-bit vector holds the same 4 consecutive quants of
//! [`K_TOKEN_GROUP`] (8) tokens, biased to `q + 128` (unsigned). A
//! broadcast 4-byte chunk of codes (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63
//! before its -32: small non-negative, so valid as the signed operand)
//! times that vector adds a 4-element partial sum to each of 8 tokens'
//! lanes in one `vpdpbusd` whose broadcast is folded into the instruction
//! (or `maddubs` + `madd` on AVX2, whose pair sums, at most 2 * 255 * 63,
//! do not saturate). Each sub-block's accumulator starts at
//! `-128 * sum(codes)` (per row, from the unpacking), which removes the
//! bias exactly: `sum((q + 128) c) - 128 sum(c) = sum(q c)`.
//!
//! Exactness: per (row, token, super-block) the kernels form the same
//! integers as the scalar `vec_dot` — `isum = sum_j sc_j * S_j` with `S_j`
//! a sub-block's code-times-quant sum (`vpmulld` by the broadcast scale),
//! the min term `sum_j m_j * bsum_j` (`vpdpwssd` on i16 pairs), and for
//! Q6_K the `-32` offset as `-32 * sum_j sc_j * bsum_j` — then combine them
//! with the per-token `d` in the scalar kernel's float expression, adding to
//! each token's running sum in super-block order. So every result equals
//! the scalar `vec_dot` of that row and token bit for bit, whatever the
//! batch size and tile (the single-token kernels of
//! [`super::matvec_x86`] add in float lanes instead, for speed).
//!
//! Packed super-block of a group of 8 tokens ([`PACKED_SB_BYTES`]):
//! bytes 0..32 the 8 tokens' `d` (f32); 32..160 four vectors, vector `q`
//! lane `t` = token t's (bsum32 of sub-block 2q, bsum32 of 2q+1) as two i16
//! (the 32-element sums Q4_K/Q5_K's mins multiply); 160..416 eight vectors,
//! vector `p` lane `t` = (bsum16 2p, bsum16 2p+1) (Q6_K's 16-element
//! groups); 416..2464 the quants plus 128, chunk `c` (elements `4c..4c+4`)
//! of token `t` at `416 + 32c + 4t`. Group `g` holds its `cols / 256` super-blocks
//! contiguously; lanes past the last token are zero.

use super::{row_bytes, QuantError};
use crate::types::{GgmlType, QK_K};

/// Tokens interleaved in one packed activation group.
pub const K_TOKEN_GROUP: usize = 8;
/// Bytes of one packed super-block (256 elements of [`K_TOKEN_GROUP`] tokens).
pub const PACKED_SB_BYTES: usize = 2464;

pub(crate) const Q8K_BYTES: usize = 292;
pub(crate) const D_AT: usize = 0;
pub(crate) const B32_AT: usize = 32;
pub(crate) const B16_AT: usize = 160;
pub(crate) const QS_AT: usize = 416;

/// Bytes that [`pack_q8_k_rows`] writes for `n_tokens` rows of `cols`.
pub fn packed_q8_k_bytes(n_tokens: usize, cols: usize) -> Result<usize, QuantError> {
    row_bytes(GgmlType::Q8_K, cols)?;
    Ok(n_tokens.div_ceil(K_TOKEN_GROUP) * (cols / QK_K) * PACKED_SB_BYTES)
}

/// Repacks `n_tokens` Q8_K rows of `cols` elements (row `t` at byte
/// `t * row_stride` of `rows`) into the interleaved layout the GEMM kernels
/// read (see the module docs). `dst` must hold exactly
/// [`packed_q8_k_bytes`]`(n_tokens, cols)` bytes.
pub fn pack_q8_k_rows(
    rows: &[u8],
    row_stride: usize,
    n_tokens: usize,
    cols: usize,
    dst: &mut [u8],
) -> Result<(), QuantError> {
    let ty = GgmlType::Q8_K;
    let rb = row_bytes(ty, cols)?;
    super::gemm::check_rows(ty, rows, row_stride, n_tokens, rb)?;
    let bytes = packed_q8_k_bytes(n_tokens, cols)?;
    super::check_len(ty, "packed activation bytes", bytes, dst.len())?;
    let nsb = cols / QK_K;
    if !n_tokens.is_multiple_of(K_TOKEN_GROUP) {
        let last = n_tokens / K_TOKEN_GROUP * nsb * PACKED_SB_BYTES;
        dst[last..].fill(0);
    }
    for t in 0..n_tokens {
        let (g, lane) = (t / K_TOKEN_GROUP, t % K_TOKEN_GROUP);
        let row = &rows[t * row_stride..t * row_stride + rb];
        for (k, b) in row.chunks_exact(Q8K_BYTES).enumerate() {
            let p = &mut dst[(g * nsb + k) * PACKED_SB_BYTES..(g * nsb + k + 1) * PACKED_SB_BYTES];
            p[D_AT + 4 * lane..D_AT + 4 * lane + 4].copy_from_slice(&b[0..4]);
            let bsum16 = |j: usize| i16::from_le_bytes([b[260 + 2 * j], b[261 + 2 * j]]);
            for q in 0..4 {
                // Sums of 32 codes of -128..=127 fit i16.
                let lo = bsum16(4 * q) + bsum16(4 * q + 1);
                let hi = bsum16(4 * q + 2) + bsum16(4 * q + 3);
                let at = B32_AT + 32 * q + 4 * lane;
                p[at..at + 2].copy_from_slice(&lo.to_le_bytes());
                p[at + 2..at + 4].copy_from_slice(&hi.to_le_bytes());
            }
            let at = B16_AT + 4 * lane;
            for pr in 0..8 {
                p[at + 32 * pr..at + 32 * pr + 4].copy_from_slice(&b[260 + 4 * pr..264 + 4 * pr]);
            }
            for c in 0..QK_K / 4 {
                let at = QS_AT + 32 * c + 4 * lane;
                for e in 0..4 {
                    p[at + e] = b[4 + 4 * c + e] ^ 0x80;
                }
            }
        }
    }
    Ok(())
}

/// Token `t`'s Q8_K row of `nsb` super-blocks, read back out of a packed
/// buffer (the scalar reference kernel's input).
fn unpack_token(packed: &[u8], nsb: usize, t: usize, row: &mut [u8]) {
    let (g, lane) = (t / K_TOKEN_GROUP, t % K_TOKEN_GROUP);
    for k in 0..nsb {
        let p = &packed[(g * nsb + k) * PACKED_SB_BYTES..(g * nsb + k + 1) * PACKED_SB_BYTES];
        let b = &mut row[k * Q8K_BYTES..(k + 1) * Q8K_BYTES];
        b[0..4].copy_from_slice(&p[D_AT + 4 * lane..D_AT + 4 * lane + 4]);
        for c in 0..QK_K / 4 {
            let at = QS_AT + 32 * c + 4 * lane;
            for e in 0..4 {
                b[4 + 4 * c + e] = p[at + e] ^ 0x80;
            }
        }
        for pr in 0..8 {
            let at = B16_AT + 32 * pr + 4 * lane;
            b[260 + 4 * pr..264 + 4 * pr].copy_from_slice(&p[at..at + 4]);
        }
    }
}

/// The reference kernel for the K-quant `ty`: each token's Q8_K row is read
/// back out of the packed layout and dotted with every weight row by the
/// scalar `vec_dot` (which the SIMD kernels equal bit for bit).
///
/// # Safety
/// [`super::GemmFn`]'s contract (slices are indexed checked).
pub(crate) unsafe fn gemm_scalar<const T: u32>(
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
    let nsb = cols / QK_K;
    let wrow = nsb * ty.type_size();
    let mut act = vec![0u8; nsb * Q8K_BYTES];
    for t in 0..n {
        unpack_token(packed, nsb, t, &mut act);
        for i in 0..rows {
            // SAFETY: lengths per the contract; the scalar kernel needs no
            // CPU feature.
            out[i * n + t] = unsafe { dot(cols, &w[i * wrow..(i + 1) * wrow], &act) };
        }
    }
}

/// One weight super-block unpacked for the SIMD kernels: codes in element
/// order, the integer sub-block scales, the bias corrections, the i16 pairs
/// the activation block sums are multiplied by, and the two float factors.
///
/// - Q4_K/Q5_K: `scales[j]` (j < 8) the 6-bit scale of elements
///   `32j..32j+32`, `corr[j]` `-128 *` their codes' sum; `mins[q]` (q < 4)
///   = (m of 2q, m of 2q+1).
/// - Q6_K: `scales[j]` (j < 16) the i8 scale of elements `16j..16j+16`,
///   `corr[j]` likewise; `mins[p]` (p < 8) = (scale 2p, scale 2p+1), for
///   the `-32` offset.
#[repr(C, align(32))]
#[derive(Clone, Copy)]
pub(crate) struct UnpackedSb {
    pub codes: [u8; QK_K],
    pub scales: [i32; 16],
    pub corr: [i32; 16],
    pub mins: [i32; 8],
    pub d: f32,
    pub dmin: f32,
    pub pad: [u32; 6],
}

impl UnpackedSb {
    pub const ZERO: UnpackedSb = UnpackedSb {
        codes: [0; QK_K],
        scales: [0; 16],
        corr: [0; 16],
        mins: [0; 8],
        d: 0.0,
        dmin: 0.0,
        pad: [0; 6],
    };
}

/// `(lo, hi)` as the two i16 halves of an i32 lane (lo in the low half).
#[inline(always)]
pub(crate) fn i16_pair(lo: i32, hi: i32) -> i32 {
    ((lo as i16 as u16) as u32 | ((hi as i16 as u16) as u32) << 16) as i32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{quantize, vec_dot_scalar, GemmIsa};

    /// Deterministic values in about [-2, 2] with some larger outliers.
    pub(crate) fn values(seed: u64, n: usize) -> Vec<f32> {
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

    fn rows_of(ty: GgmlType, seed: u64, rows: usize, cols: usize) -> Vec<u8> {
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

    /// Random bytes: codes, scales and high bits the quantizer would not
    /// write (every 6-bit scale and min, Q6_K's negative scales), with
    /// finite f16 factors.
    fn random_blocks(ty: GgmlType, seed: u64, rows: usize, cols: usize) -> Vec<u8> {
        let rb = row_bytes(ty, cols).unwrap();
        let mut s = seed ^ 0x9e37_79b9_7f4a_7c15;
        let mut out: Vec<u8> = (0..rows * rb)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (s >> 56) as u8
            })
            .collect();
        let bs = ty.type_size();
        let f16s: &[usize] = match ty {
            GgmlType::Q6_K => &[208],
            _ => &[0, 2],
        };
        for (i, b) in out.chunks_exact_mut(bs).enumerate() {
            for (k, &at) in f16s.iter().enumerate() {
                let v =
                    0.001 * (1.0 + ((i * 7 + k * 3) % 11) as f32) * if k == 0 { 1.0 } else { -0.5 };
                b[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
            }
        }
        out
    }

    #[test]
    fn every_kernel_equals_the_scalar_dot_bit_for_bit() {
        use GgmlType::*;
        let isas: Vec<GemmIsa> = GemmIsa::ALL.into_iter().filter(|k| k.available()).collect();
        for ty in [Q4_K, Q5_K, Q6_K] {
            // Rows across the row tile and panel, tokens 1..=19 (partial
            // groups), super-blocks across the K piece.
            for (rows, cols) in [
                (1usize, 256usize),
                (3, 512),
                (7, 1536),
                (37, 2304),
                (9, 4864),
            ] {
                let rb = row_bytes(ty, cols).unwrap();
                for (which, w) in [
                    (
                        "quantized",
                        rows_of(ty, rows as u64 + cols as u64, rows, cols),
                    ),
                    (
                        "random",
                        random_blocks(ty, rows as u64 * 5 + cols as u64, rows, cols),
                    ),
                ] {
                    for n in [1usize, 2, 7, 8, 9, 16, 17, 19, 33] {
                        if n > 9 && cols > 2304 && which == "random" {
                            continue; // keeps the test fast; shapes covered above
                        }
                        let ab = row_bytes(Q8_K, cols).unwrap();
                        let stride = ab + 3;
                        let a = rows_of(Q8_K, 77 + n as u64, n, cols);
                        let mut act = vec![0u8; stride * n];
                        for t in 0..n {
                            act[t * stride..t * stride + ab]
                                .copy_from_slice(&a[t * ab..(t + 1) * ab]);
                        }
                        // Stale bytes: packing must clear the padding lanes.
                        let mut packed = vec![0xabu8; packed_q8_k_bytes(n, cols).unwrap()];
                        pack_q8_k_rows(&act, stride, n, cols, &mut packed).unwrap();
                        for &isa in &isas {
                            let mut out = vec![f32::NAN; rows * n];
                            isa.gemm(ty, cols, &w, rows, &packed, n, &mut out).unwrap();
                            for i in 0..rows {
                                for t in 0..n {
                                    let reference = vec_dot_scalar(
                                        ty,
                                        cols,
                                        &w[i * rb..(i + 1) * rb],
                                        &a[t * ab..(t + 1) * ab],
                                    )
                                    .unwrap();
                                    assert_eq!(
                                        out[i * n + t].to_bits(),
                                        reference.to_bits(),
                                        "{isa:?} {ty} {which} {rows}x{cols} n={n} ({i},{t}): {} vs {reference}",
                                        out[i * n + t]
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The sum of |block term| of a K-quant row dot: bounds the rounding of
    /// adding the block terms in any order.
    fn term_magnitude(ty: GgmlType, w: &[u8], a: &[u8]) -> f32 {
        w.chunks_exact(ty.type_size())
            .zip(a.chunks_exact(Q8K_BYTES))
            .map(|(x, y)| vec_dot_scalar(ty, QK_K, x, y).unwrap().abs())
            .sum()
    }

    #[test]
    fn every_matvec_kernel_equals_the_scalar_dot_to_rounding() {
        use GgmlType::*;
        for ty in [Q4_K, Q5_K, Q6_K] {
            // Super-block counts around the 64-block piece.
            for (rows, cols) in [
                (1usize, 256usize),
                (5, 1792),
                (3, 2304),
                (7, 4864),
                (2, 17408),
            ] {
                let rb = row_bytes(ty, cols).unwrap();
                for (which, w) in [
                    (
                        "quantized",
                        rows_of(ty, rows as u64 + cols as u64, rows, cols),
                    ),
                    (
                        "random",
                        random_blocks(ty, rows as u64 * 3 + cols as u64, rows, cols),
                    ),
                ] {
                    let a = rows_of(Q8_K, 5 + cols as u64, 1, cols);
                    for isa in GemmIsa::ALL.into_iter().filter(|k| k.available()) {
                        if isa.matvec_kernel(ty).is_none() {
                            continue;
                        }
                        let mut out = vec![f32::NAN; rows];
                        isa.matvec(ty, cols, &w, rows, &a, &mut out).unwrap();
                        for i in 0..rows {
                            let wr = &w[i * rb..(i + 1) * rb];
                            let reference = vec_dot_scalar(ty, cols, wr, &a).unwrap();
                            let tol = 1e-6 * term_magnitude(ty, wr, &a) + 1e-6;
                            assert!(
                                (out[i] - reference).abs() <= tol,
                                "{isa:?} {ty} {which} {rows}x{cols} row {i}: {} vs {reference} (tol {tol})",
                                out[i]
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn extreme_activations_stay_exact() {
        // Activation quants at -128 and 127 in every position (a Q8_K row
        // from a file, not our quantizer) against the largest codes.
        use GgmlType::*;
        let cols = 512;
        for ty in [Q4_K, Q5_K, Q6_K] {
            let rb = row_bytes(ty, cols).unwrap();
            let mut w = random_blocks(ty, 3, 5, cols);
            for b in w.chunks_exact_mut(ty.type_size()) {
                // All code bits set: the largest code of every element.
                match ty {
                    Q6_K => b[..192].fill(0xff),
                    Q5_K => b[16..].fill(0xff),
                    _ => b[16..].fill(0xff),
                }
            }
            let ab = row_bytes(Q8_K, cols).unwrap();
            let n = 3;
            let mut a = vec![0u8; n * ab];
            for (t, row) in a.chunks_exact_mut(ab).enumerate() {
                for b in row.chunks_exact_mut(Q8K_BYTES) {
                    b[0..4].copy_from_slice(&0.01f32.to_le_bytes());
                    for (j, q) in b[4..260].iter_mut().enumerate() {
                        *q = if (j + t) % 3 == 0 { 0x80 } else { 127 };
                    }
                    for j in 0..16 {
                        let s: i32 = b[4 + 16 * j..20 + 16 * j]
                            .iter()
                            .map(|&q| q as i8 as i32)
                            .sum();
                        b[260 + 2 * j..262 + 2 * j].copy_from_slice(&(s as i16).to_le_bytes());
                    }
                }
            }
            let mut packed = vec![0u8; packed_q8_k_bytes(n, cols).unwrap()];
            pack_q8_k_rows(&a, ab, n, cols, &mut packed).unwrap();
            for isa in GemmIsa::ALL.into_iter().filter(|k| k.available()) {
                if isa.matvec_kernel(ty).is_some() {
                    for t in 0..n {
                        let mut mv = vec![0f32; 5];
                        isa.matvec(ty, cols, &w, 5, &a[t * ab..(t + 1) * ab], &mut mv)
                            .unwrap();
                        for i in 0..5 {
                            let (wr, ar) = (&w[i * rb..(i + 1) * rb], &a[t * ab..(t + 1) * ab]);
                            let reference = vec_dot_scalar(ty, cols, wr, ar).unwrap();
                            let tol = 1e-6 * term_magnitude(ty, wr, ar) + 1e-6;
                            assert!(
                                (mv[i] - reference).abs() <= tol,
                                "{isa:?} {ty} matvec ({i},{t}): {} vs {reference}",
                                mv[i]
                            );
                        }
                    }
                }
                let mut out = vec![0f32; 5 * n];
                isa.gemm(ty, cols, &w, 5, &packed, n, &mut out).unwrap();
                for i in 0..5 {
                    for t in 0..n {
                        let reference = vec_dot_scalar(
                            ty,
                            cols,
                            &w[i * rb..(i + 1) * rb],
                            &a[t * ab..(t + 1) * ab],
                        )
                        .unwrap();
                        assert_eq!(
                            out[i * n + t].to_bits(),
                            reference.to_bits(),
                            "{isa:?} {ty} ({i},{t})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn empty_rows_give_zeros() {
        for ty in [
            GgmlType::Q4_K,
            GgmlType::Q6_K,
            GgmlType::Q5_0,
            GgmlType::Q8_0,
        ] {
            for isa in GemmIsa::ALL.into_iter().filter(|k| k.available()) {
                let mut out = vec![f32::NAN; 6];
                isa.gemm(ty, 0, &[], 2, &[], 3, &mut out).unwrap();
                assert_eq!(out, vec![0.0; 6], "{isa:?} {ty} gemm");
                if isa.matvec_kernel(ty).is_some() {
                    let mut out = vec![f32::NAN; 2];
                    isa.matvec(ty, 0, &[], 2, &[], &mut out).unwrap();
                    assert_eq!(out, vec![0.0; 2], "{isa:?} {ty} matvec");
                }
            }
        }
    }

    #[test]
    fn bad_lengths_are_errors() {
        let ty = GgmlType::Q4_K;
        let w = rows_of(ty, 1, 2, 256);
        let packed = vec![0u8; packed_q8_k_bytes(3, 256).unwrap()];
        let mut out = vec![0f32; 6];
        let isa = GemmIsa::Scalar;
        assert!(isa.gemm(ty, 256, &w[1..], 2, &packed, 3, &mut out).is_err());
        assert!(isa.gemm(ty, 256, &w, 2, &packed[1..], 3, &mut out).is_err());
        assert!(isa.gemm(ty, 256, &w, 2, &packed, 3, &mut out[1..]).is_err());
        assert!(isa.gemm(ty, 128, &w, 2, &packed, 3, &mut out).is_err());
        let a = rows_of(GgmlType::Q8_K, 2, 2, 256);
        let mut p = vec![0u8; packed.len()];
        assert!(
            pack_q8_k_rows(&a, 292, 3, 256, &mut p).is_err(),
            "too few rows"
        );
        assert!(
            pack_q8_k_rows(&a, 290, 2, 256, &mut p).is_err(),
            "stride below a row"
        );
    }
}
