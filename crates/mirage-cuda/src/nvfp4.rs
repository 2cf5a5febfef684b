//! NVFP4 matrices as the device reads them: the CPU codec's own layout
//! ([`mirage_gguf::quant::Nvfp4Tensor`]: E2M1 codes two per byte, low nibble
//! first; one E4M3 scale per 16 elements; one f32 tensor scale), unchanged:
//! `[rows][cols/2]` packed bytes and `[rows][cols/16]` scale bytes are
//! already what coalesced warp loads want.
//!
//! Decode on the device (`cuda/nvfp4.cu`): each lane's 32-bit word (8 codes)
//! goes through two PRMT byte-table lookups per 4 codes (doubled E2M1 values
//! 64 ± v as bytes), then each byte becomes a float with one PRMT into the
//! mantissa of 2^23 and one FADD; the E4M3 scale is its 7 bits shifted into
//! the f32 exponent field times 2^120. No conversion-unit instructions.

use mirage_gguf::quant::Nvfp4Tensor;

use crate::superblock::SparseError;

/// Checks an NVFP4 tensor's shape and returns `(rows, cols)` (`dims[0]` is
/// the row length).
pub fn nvfp4_shape(t: &Nvfp4Tensor) -> Result<(usize, usize), SparseError> {
    let cols = t.row_len();
    let n = t.n_elements();
    if cols == 0 || cols % 16 != 0 || n % cols != 0 {
        return Err(SparseError::InvalidArgument(format!(
            "NVFP4 tensor with row length {cols} and {n} elements is not a matrix of 16-element blocks"
        )));
    }
    if t.block_scales.len() != n / 16 {
        return Err(SparseError::InvalidArgument(format!(
            "NVFP4 tensor has {} block scales for {n} elements",
            t.block_scales.len()
        )));
    }
    if !(t.tensor_scale.is_finite() && t.tensor_scale >= 0.0) {
        return Err(SparseError::InvalidArgument(format!(
            "NVFP4 tensor scale {} is not a finite non-negative number",
            t.tensor_scale
        )));
    }
    Ok((n / cols, cols))
}
