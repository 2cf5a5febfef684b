//! Quantization codecs (dequantize, quantize, dot products) for every
//! [`crate::GgmlType`].
//!
//! Block layouts are byte-for-byte ggml's (`block_q4_0`, `block_q4_K`, ...;
//! sizes in [`crate::types`]), and the quantizers follow ggml's reference
//! `quantize_row_*_ref` (`make_qx_quants`, `make_q3_quants`,
//! `make_qkx2_quants`, `nearest_int`) so that the bytes they write match
//! llama.cpp's. Dequantizers do the same float operations in the same order
//! as ggml (and as the `gguf` Python package), so their output is bit-exact.
//!
//! Dot products pair a weight type with the activation encoding returned by
//! [`vec_dot_type`] (ggml's pairing: Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for
//! Q4_1/Q5_1, Q8_K for the K-quants, F32 for the float types). Every pair has
//! a scalar kernel; the hot ones also have an AVX2+FMA kernel chosen at run
//! time. Both accumulate each block's products in integers (exact); they
//! differ only in the order in which per-block float partial sums are added,
//! so their results agree to float rounding (~1e-6 relative), not bit for bit.
//!
//! Design rules: the checked entry points ([`dequantize`], [`quantize`],
//! [`vec_dot`]) validate lengths and return [`QuantError`], never panic; the
//! inner-loop entry point [`dot_fn`] returns an unchecked kernel whose
//! contract the caller upholds once per matrix, not once per row.

// Codec loops mirror ggml's index arithmetic (element e of block i, scale
// e/16, ...); iterator rewrites would hide the correspondence.
#![allow(clippy::needless_range_loop)]

pub mod channel_major;
mod float;
mod gemm;
mod gemm_q8_0;
#[cfg(target_arch = "x86_64")]
mod gemm_q8_0_x86;
mod gemm_q8_k;
#[cfg(target_arch = "x86_64")]
mod gemm_q8_k_x86;
mod kquants;
mod legacy;
#[cfg(all(target_arch = "x86_64", mirage_avx512))]
#[allow(clippy::incompatible_msrv)] // gated on the compiler version (build.rs)
mod matvec_x86;
pub mod nvfp4;
mod rows;
mod util;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod quantize_x86;

use crate::types::GgmlType;

pub use gemm::{gemm_input_type, pack_rows, packed_bytes, GemmFn, GemmIsa, MatvecFn};
pub use gemm_q8_0::{pack_q8_0_rows, packed_q8_0_bytes, PACKED_BLOCK_BYTES, Q8_0_TOKEN_GROUP};
pub use gemm_q8_k::{pack_q8_k_rows, packed_q8_k_bytes, K_TOKEN_GROUP, PACKED_SB_BYTES};
pub use nvfp4::{Nvfp4Error, Nvfp4Tensor, NVFP4_ARTIFACT_TAG, NVFP4_BLOCK_SIZE};
pub use rows::{dot_rows_fn, scalar_dot_rows_fn, DotRowsFn, DOT_ROWS};
pub use util::prefetch_ahead;

/// Why a codec call was refused.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
pub enum QuantError {
    /// The operation has no implementation for this type.
    #[error("{op} is not supported for {ty}")]
    UnsupportedType {
        /// The tensor type asked for.
        ty: GgmlType,
        /// The operation (`"dequantize"`, `"quantize"`, `"vec_dot"`).
        op: &'static str,
    },
    /// A buffer's length does not match the element count.
    #[error("{ty}: {what} holds {got}, expected {expected}")]
    LengthMismatch {
        /// The tensor type whose layout fixes the expected length.
        ty: GgmlType,
        /// Which buffer (`"src bytes"`, `"dst bytes"`, `"weights bytes"`, ...).
        what: &'static str,
        /// The length the element count requires.
        expected: usize,
        /// The length passed in.
        got: usize,
    },
    /// The element count is not a whole number of blocks.
    #[error("{ty}: {n} elements is not a multiple of the block size {block_size}")]
    NotBlockMultiple {
        /// The tensor type.
        ty: GgmlType,
        /// The element count asked for.
        n: usize,
        /// Elements per block of `ty`.
        block_size: usize,
    },
}

/// An unchecked dot-product kernel: `(n, weights, activations) -> f32`.
///
/// # Safety
/// The caller guarantees that `n` is a multiple of the weight type's block
/// size, that `weights` holds at least `n` elements of the weight type and
/// `activations` at least `n` elements of [`vec_dot_type`] of it. The CPU
/// features the kernel needs are guaranteed by [`dot_fn`], which only hands
/// out kernels the running CPU supports.
pub type DotFn = unsafe fn(n: usize, weights: &[u8], act: &[u8]) -> f32;

/// Bytes that `n` elements of `ty` occupy, checking the block multiple.
pub fn row_bytes(ty: GgmlType, n: usize) -> Result<usize, QuantError> {
    let block_size = ty.block_size();
    if !n.is_multiple_of(block_size) {
        return Err(QuantError::NotBlockMultiple { ty, n, block_size });
    }
    Ok(n / block_size * ty.type_size())
}

fn check_len(
    ty: GgmlType,
    what: &'static str,
    expected: usize,
    got: usize,
) -> Result<(), QuantError> {
    if expected != got {
        return Err(QuantError::LengthMismatch {
            ty,
            what,
            expected,
            got,
        });
    }
    Ok(())
}

/// Decodes `dst.len()` elements of type `ty` from `src` into `dst`.
///
/// `src` must hold exactly the bytes of `dst.len()` elements. The result is
/// bit-identical to ggml's `dequantize_row_*` and gguf-py's `dequantize`.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    let bytes = row_bytes(ty, dst.len())?;
    check_len(ty, "src bytes", bytes, src.len())?;
    use GgmlType::*;
    match ty {
        F32 => float::dequantize_f32(src, dst),
        F16 => float::dequantize_f16(src, dst),
        BF16 => float::dequantize_bf16(src, dst),
        Q4_0 => legacy::dequantize_q4_0(src, dst),
        Q4_1 => legacy::dequantize_q4_1(src, dst),
        Q5_0 => legacy::dequantize_q5_0(src, dst),
        Q5_1 => legacy::dequantize_q5_1(src, dst),
        Q8_0 => legacy::dequantize_q8_0(src, dst),
        Q8_1 => legacy::dequantize_q8_1(src, dst),
        Q2_K => kquants::dequantize_q2_k(src, dst),
        Q3_K => kquants::dequantize_q3_k(src, dst),
        Q4_K => kquants::dequantize_q4_k(src, dst),
        Q5_K => kquants::dequantize_q5_k(src, dst),
        Q6_K => kquants::dequantize_q6_k(src, dst),
        Q8_K => kquants::dequantize_q8_k(src, dst),
    }
    Ok(())
}

/// Encodes `src` as type `ty` into `dst` with ggml's reference quantizer.
///
/// `dst` must hold exactly the bytes of `src.len()` elements. Every type is
/// supported (the float types are plain conversions with round-to-nearest-even).
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    let bytes = row_bytes(ty, src.len())?;
    check_len(ty, "dst bytes", bytes, dst.len())?;
    use GgmlType::*;
    match ty {
        F32 => float::quantize_f32(src, dst),
        F16 => float::quantize_f16(src, dst),
        BF16 => float::quantize_bf16(src, dst),
        Q4_0 => legacy::quantize_q4_0(src, dst),
        Q4_1 => legacy::quantize_q4_1(src, dst),
        Q5_0 => legacy::quantize_q5_0(src, dst),
        Q5_1 => legacy::quantize_q5_1(src, dst),
        // SAFETY (all three): available() checked; lengths checked above.
        #[cfg(target_arch = "x86_64")]
        Q8_0 if avx2::available() => unsafe { quantize_x86::quantize_q8_0(src, dst) },
        #[cfg(target_arch = "x86_64")]
        Q8_1 if avx2::available() => unsafe { quantize_x86::quantize_q8_1(src, dst) },
        #[cfg(target_arch = "x86_64")]
        Q8_K if avx2::available() => unsafe { quantize_x86::quantize_q8_k(src, dst) },
        Q8_0 => legacy::quantize_q8_0(src, dst),
        Q8_1 => legacy::quantize_q8_1(src, dst),
        Q2_K => kquants::quantize_q2_k(src, dst),
        Q3_K => kquants::quantize_q3_k(src, dst),
        Q4_K => kquants::quantize_q4_k(src, dst),
        Q5_K => kquants::quantize_q5_k(src, dst),
        Q6_K => kquants::quantize_q6_k(src, dst),
        Q8_K => kquants::quantize_q8_k(src, dst),
    }
    Ok(())
}

/// The activation encoding a weight of type `ty` is dotted with (ggml's
/// `vec_dot_type`): Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1 (its stored
/// block sum folds the weight minimum in), Q8_K for the K-quants, F32 for
/// F32/F16/BF16. Q8_1 weights are dotted with Q8_1.
pub fn vec_dot_type(ty: GgmlType) -> GgmlType {
    use GgmlType::*;
    match ty {
        F32 | F16 | BF16 => F32,
        Q4_0 | Q5_0 | Q8_0 => Q8_0,
        Q4_1 | Q5_1 | Q8_1 => Q8_1,
        Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K => Q8_K,
    }
}

fn check_dot(ty: GgmlType, n: usize, weights: &[u8], act: &[u8]) -> Result<(), QuantError> {
    check_len(ty, "weights bytes", row_bytes(ty, n)?, weights.len())?;
    let act_ty = vec_dot_type(ty);
    check_len(act_ty, "activation bytes", row_bytes(act_ty, n)?, act.len())
}

/// The dot product of `n` weights of type `ty` with `n` activations encoded
/// as [`vec_dot_type`]`(ty)`, using the fastest kernel the CPU supports.
///
/// Lengths must match exactly; see [`dot_fn`] for the unchecked kernel.
pub fn vec_dot(ty: GgmlType, n: usize, weights: &[u8], act: &[u8]) -> Result<f32, QuantError> {
    check_dot(ty, n, weights, act)?;
    let kernel = dot_fn(ty).ok_or(QuantError::UnsupportedType { ty, op: "vec_dot" })?;
    // SAFETY: lengths checked above; dot_fn only returns kernels this CPU runs.
    Ok(unsafe { kernel(n, weights, act) })
}

/// [`vec_dot`] with the portable scalar kernel (the reference the SIMD
/// kernels are tested against).
pub fn vec_dot_scalar(
    ty: GgmlType,
    n: usize,
    weights: &[u8],
    act: &[u8],
) -> Result<f32, QuantError> {
    check_dot(ty, n, weights, act)?;
    let kernel = scalar_dot_fn(ty).ok_or(QuantError::UnsupportedType { ty, op: "vec_dot" })?;
    // SAFETY: lengths checked above; scalar kernels need no CPU feature.
    Ok(unsafe { kernel(n, weights, act) })
}

/// The portable scalar kernel for weight type `ty` (`None` if there is none).
pub fn scalar_dot_fn(ty: GgmlType) -> Option<DotFn> {
    use GgmlType::*;
    Some(match ty {
        F32 => float::dot_f32_scalar,
        F16 => float::dot_f16_scalar,
        BF16 => float::dot_bf16_scalar,
        Q4_0 => legacy::dot_q4_0_q8_0,
        Q4_1 => legacy::dot_q4_1_q8_1,
        Q5_0 => legacy::dot_q5_0_q8_0,
        Q5_1 => legacy::dot_q5_1_q8_1,
        Q8_0 => legacy::dot_q8_0_q8_0,
        Q8_1 => legacy::dot_q8_1_q8_1,
        Q2_K => kquants::dot_q2_k_q8_k,
        Q3_K => kquants::dot_q3_k_q8_k,
        Q4_K => kquants::dot_q4_k_q8_k,
        Q5_K => kquants::dot_q5_k_q8_k,
        Q6_K => kquants::dot_q6_k_q8_k,
        Q8_K => kquants::dot_q8_k_q8_k,
    })
}

/// The SIMD kernel for weight type `ty` when this CPU supports one (AVX2+FMA
/// on x86_64), else `None`.
pub fn simd_dot_fn(ty: GgmlType) -> Option<DotFn> {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2::available() {
            return avx2::dot_fn(ty);
        }
    }
    let _ = ty;
    None
}

/// The fastest dot kernel for weight type `ty` on this CPU: the SIMD kernel
/// when there is one, else the scalar one. Look it up once per matrix and
/// call it per row; see [`DotFn`] for the contract.
pub fn dot_fn(ty: GgmlType) -> Option<DotFn> {
    simd_dot_fn(ty).or_else(|| scalar_dot_fn(ty))
}
