//! Batched matrix products over packed activations (prompt prefill) and
//! matrix-vector kernels (decode), by weight type and instruction set.
//!
//! A GEMM reads its activations quantized once per batch into the block
//! format ggml pairs with the weight type — Q8_0 for Q8_0/Q5_0/Q4_0
//! weights ([`super::gemm_q8_0`]), Q8_K for Q4_K/Q5_K/Q6_K
//! ([`super::gemm_q8_k`]) — and repacked so that one vector holds the same
//! four quants of 8 tokens ([`pack_rows`]). Every kernel computes
//! `out[i * n_tokens + t] = weights row i . token t` over a contiguous run
//! of weight rows, so a thread pool splits a matrix by rows.
//!
//! Instruction sets are chosen at run time ([`GemmIsa::best`]); each type
//! has a scalar reference kernel the SIMD ones are tested against.

use super::{check_len, row_bytes, QuantError};
use crate::types::GgmlType;

/// An unchecked GEMM kernel: `(cols, weights, rows, packed, n_tokens,
/// out)`, writing `out[i * n_tokens + t] = weights row i . token t` for
/// `i < rows`, `t < n_tokens`.
///
/// # Safety
/// `cols` is a multiple of the weight type's block size; `weights` holds
/// `rows` contiguous rows of `cols` of the kernel's weight type; `packed`
/// holds [`packed_bytes`]`(ty, n_tokens, cols)` bytes written by
/// [`pack_rows`]; `out` holds at least `rows * n_tokens` values. The CPU
/// supports the kernel's features (guaranteed by [`GemmIsa::gemm_kernel`]).
pub type GemmFn = unsafe fn(
    cols: usize,
    weights: &[u8],
    rows: usize,
    packed: &[u8],
    n_tokens: usize,
    out: &mut [f32],
);

/// An unchecked matrix-vector kernel: `(cols, weights, rows, act, out)`,
/// writing `out[i] = weights row i . act` for `i < rows`, where `act` is one
/// row of `cols` in the weight type's [`super::vec_dot_type`] (decode).
///
/// # Safety
/// `cols` is a multiple of the weight type's block size; `weights` holds
/// `rows` contiguous rows of `cols`, `act` one activation row, `out` at
/// least `rows` values; Q8_0 activation quants lie in -127..=127 (the
/// quantizer's range). The CPU supports the kernel's features (guaranteed
/// by [`GemmIsa::matvec_kernel`]).
pub type MatvecFn =
    unsafe fn(cols: usize, weights: &[u8], rows: usize, act: &[u8], out: &mut [f32]);

/// The instruction sets GEMM and matrix-vector kernels exist for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmIsa {
    /// Portable reference.
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 VNNI on 256-bit vectors (AVX512F + AVX512VL + AVX512BW +
    /// AVX512_VNNI).
    Avx512Vnni,
}

/// The activation block format a GEMM of weight type `ty` reads (`None`:
/// no GEMM kernel for `ty`).
pub fn gemm_input_type(ty: GgmlType) -> Option<GgmlType> {
    use GgmlType::*;
    match ty {
        Q8_0 | Q5_0 | Q4_0 => Some(Q8_0),
        Q4_K | Q5_K | Q6_K => Some(Q8_K),
        _ => None,
    }
}

impl GemmIsa {
    /// Every instruction set, slowest first.
    pub const ALL: [GemmIsa; 3] = [GemmIsa::Scalar, GemmIsa::Avx2, GemmIsa::Avx512Vnni];

    /// Whether this CPU runs the instruction set.
    pub fn available(self) -> bool {
        match self {
            GemmIsa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            GemmIsa::Avx2 => super::avx2::available(),
            #[cfg(all(target_arch = "x86_64", mirage_avx512))]
            GemmIsa::Avx512Vnni => {
                super::avx2::available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[allow(unreachable_patterns)] // every arm is there on x86_64 with mirage_avx512
            _ => false,
        }
    }

    /// The fastest instruction set this CPU runs.
    pub fn best() -> GemmIsa {
        GemmIsa::ALL
            .into_iter()
            .rev()
            .find(|k| k.available())
            .unwrap_or(GemmIsa::Scalar)
    }

    /// The GEMM kernel for weight type `ty`, if there is one and this CPU
    /// runs it.
    pub fn gemm_kernel(self, ty: GgmlType) -> Option<GemmFn> {
        if !self.available() {
            return None;
        }
        match gemm_input_type(ty)? {
            GgmlType::Q8_0 => super::gemm_q8_0::kernel(self, ty),
            _ => kquant_kernel(self, ty),
        }
    }

    /// The matrix-vector kernel for weight type `ty`, if there is one and
    /// this CPU runs it.
    pub fn matvec_kernel(self, ty: GgmlType) -> Option<MatvecFn> {
        if !self.available() {
            return None;
        }
        use GgmlType::*;
        match (self, ty) {
            #[cfg(all(target_arch = "x86_64", mirage_avx512))]
            (GemmIsa::Avx512Vnni, Q5_0) => Some(super::matvec_x86::matvec_q5_0::<true>),
            #[cfg(all(target_arch = "x86_64", mirage_avx512))]
            (GemmIsa::Avx512Vnni, Q4_0) => Some(super::matvec_x86::matvec_q5_0::<false>),
            (_, Q8_0 | Q5_0 | Q4_0) => super::gemm_q8_0::matvec_kernel(self, ty),
            #[cfg(all(target_arch = "x86_64", mirage_avx512))]
            (GemmIsa::Avx512Vnni, Q4_K) => Some(super::matvec_x86::matvec_q45_k::<false>),
            #[cfg(all(target_arch = "x86_64", mirage_avx512))]
            (GemmIsa::Avx512Vnni, Q5_K) => Some(super::matvec_x86::matvec_q45_k::<true>),
            #[cfg(all(target_arch = "x86_64", mirage_avx512))]
            (GemmIsa::Avx512Vnni, Q6_K) => Some(super::matvec_x86::matvec_q6_k),
            _ => None,
        }
    }

    /// Checked call: `out[i * n_tokens + t] = weights row i . token t`.
    /// `weights` must hold exactly `rows` rows of `cols` of `ty`, `packed`
    /// the output of [`pack_rows`] for `ty`, `n_tokens` and `cols`, and
    /// `out` exactly `rows * n_tokens` values.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        self,
        ty: GgmlType,
        cols: usize,
        weights: &[u8],
        rows: usize,
        packed: &[u8],
        n_tokens: usize,
        out: &mut [f32],
    ) -> Result<(), QuantError> {
        check_len(
            ty,
            "weights bytes",
            row_bytes(ty, cols)? * rows,
            weights.len(),
        )?;
        check_len(
            ty,
            "packed activation bytes",
            packed_bytes(ty, n_tokens, cols)?,
            packed.len(),
        )?;
        check_len(ty, "output values", rows * n_tokens, out.len())?;
        let kernel = self.gemm_kernel(ty).ok_or(QuantError::UnsupportedType {
            ty,
            op: "gemm on this CPU",
        })?;
        // SAFETY: every length checked above; gemm_kernel() only answers
        // for kernels this CPU runs.
        unsafe { kernel(cols, weights, rows, packed, n_tokens, out) };
        Ok(())
    }

    /// Checked call: `out[i] = weights row i . act` for one activation row
    /// `act` of `cols` in [`super::vec_dot_type`]`(ty)`. `weights` must hold
    /// exactly `rows` rows and `out` `rows` values.
    pub fn matvec(
        self,
        ty: GgmlType,
        cols: usize,
        weights: &[u8],
        rows: usize,
        act: &[u8],
        out: &mut [f32],
    ) -> Result<(), QuantError> {
        check_len(
            ty,
            "weights bytes",
            row_bytes(ty, cols)? * rows,
            weights.len(),
        )?;
        let act_ty = super::vec_dot_type(ty);
        check_len(
            act_ty,
            "activation bytes",
            row_bytes(act_ty, cols)?,
            act.len(),
        )?;
        check_len(ty, "output values", rows, out.len())?;
        let kernel = self.matvec_kernel(ty).ok_or(QuantError::UnsupportedType {
            ty,
            op: "matvec on this CPU",
        })?;
        // SAFETY: lengths checked above; matvec_kernel() only answers for
        // kernels this CPU runs.
        unsafe { kernel(cols, weights, rows, act, out) };
        Ok(())
    }
}

fn kquant_kernel(isa: GemmIsa, ty: GgmlType) -> Option<GemmFn> {
    use super::gemm_q8_k::gemm_scalar;
    #[cfg(target_arch = "x86_64")]
    use super::gemm_q8_k_x86 as x86;
    use GgmlType::*;
    Some(match (isa, ty) {
        (GemmIsa::Scalar, Q4_K) => gemm_scalar::<{ Q4_K as u32 }>,
        (GemmIsa::Scalar, Q5_K) => gemm_scalar::<{ Q5_K as u32 }>,
        (GemmIsa::Scalar, Q6_K) => gemm_scalar::<{ Q6_K as u32 }>,
        #[cfg(target_arch = "x86_64")]
        (GemmIsa::Avx2, Q4_K) => x86::avx2::gemm::<{ x86::Q4K }>,
        #[cfg(target_arch = "x86_64")]
        (GemmIsa::Avx2, Q5_K) => x86::avx2::gemm::<{ x86::Q5K }>,
        #[cfg(target_arch = "x86_64")]
        (GemmIsa::Avx2, Q6_K) => x86::avx2::gemm::<{ x86::Q6K }>,
        #[cfg(all(target_arch = "x86_64", mirage_avx512))]
        (GemmIsa::Avx512Vnni, Q4_K) => x86::vnni::gemm::<{ x86::Q4K }>,
        #[cfg(all(target_arch = "x86_64", mirage_avx512))]
        (GemmIsa::Avx512Vnni, Q5_K) => x86::vnni::gemm::<{ x86::Q5K }>,
        #[cfg(all(target_arch = "x86_64", mirage_avx512))]
        (GemmIsa::Avx512Vnni, Q6_K) => x86::vnni::gemm::<{ x86::Q6K }>,
        _ => return None,
    })
}

/// Bytes that [`pack_rows`] writes for `n_tokens` rows of `cols` for a
/// GEMM of weight type `ty`.
pub fn packed_bytes(ty: GgmlType, n_tokens: usize, cols: usize) -> Result<usize, QuantError> {
    match gemm_input_type(ty) {
        Some(GgmlType::Q8_0) => super::gemm_q8_0::packed_q8_0_bytes(n_tokens, cols),
        Some(_) => super::gemm_q8_k::packed_q8_k_bytes(n_tokens, cols),
        None => Err(QuantError::UnsupportedType { ty, op: "gemm" }),
    }
}

/// Repacks `n_tokens` activation rows of `cols` for a GEMM of weight type
/// `ty`: rows in [`gemm_input_type`]`(ty)`, row `t` at byte
/// `t * row_stride` of `rows`. `dst` must hold exactly
/// [`packed_bytes`]`(ty, n_tokens, cols)` bytes.
pub fn pack_rows(
    ty: GgmlType,
    rows: &[u8],
    row_stride: usize,
    n_tokens: usize,
    cols: usize,
    dst: &mut [u8],
) -> Result<(), QuantError> {
    match gemm_input_type(ty) {
        Some(GgmlType::Q8_0) => {
            super::gemm_q8_0::pack_q8_0_rows(rows, row_stride, n_tokens, cols, dst)
        }
        Some(_) => super::gemm_q8_k::pack_q8_k_rows(rows, row_stride, n_tokens, cols, dst),
        None => Err(QuantError::UnsupportedType { ty, op: "gemm" }),
    }
}

/// Checks that `rows` holds `n_tokens` rows of `rb` bytes, `row_stride`
/// apart, of activation type `ty`.
pub(crate) fn check_rows(
    ty: GgmlType,
    rows: &[u8],
    row_stride: usize,
    n_tokens: usize,
    rb: usize,
) -> Result<(), QuantError> {
    if n_tokens == 0 {
        return Ok(());
    }
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
    Ok(())
}
