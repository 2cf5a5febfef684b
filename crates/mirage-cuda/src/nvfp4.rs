//! NVFP4 weight-only mat-vec on the device (`matvec_nvfp4` in
//! `cuda/nvfp4.cu`).
//!
//! The matrix is uploaded in the CPU codec's own layout
//! ([`mirage_gguf::quant::Nvfp4Tensor`]: E2M1 codes two per byte, low nibble
//! first; one E4M3 scale per 16 elements; one f32 tensor scale), unchanged:
//! `[rows][cols/2]` packed bytes and `[rows][cols/16]` scale bytes are
//! already what coalesced 32-bit warp loads want. `x` and `y` are f32.
//!
//! Decode on the device: each lane's 32-bit word (8 codes) goes through two
//! PRMT byte-table lookups per 4 codes (doubled E2M1 values 64 ± v as bytes),
//! then each byte becomes a float with one PRMT into the mantissa of 2^23
//! and one FADD; the E4M3 scale is its 7 bits shifted into the f32 exponent
//! field times 2^120. No conversion-unit instructions.

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

#[cfg(feature = "cuda")]
pub use device::*;

#[cfg(feature = "cuda")]
mod device {
    use cudarc::driver::CudaSlice;
    use mirage_gguf::quant::Nvfp4Tensor;

    use super::nvfp4_shape;
    use crate::superblock::{drv, SparseDevice, SparseError};

    /// An NVFP4 matrix on the device, in the CPU codec's layout.
    #[derive(Debug)]
    pub struct Nvfp4Matrix {
        rows: usize,
        cols: usize,
        tensor_scale: f32,
        packed: CudaSlice<u8>,
        scales: CudaSlice<u8>,
    }

    impl Nvfp4Matrix {
        /// Output features.
        pub fn rows(&self) -> usize {
            self.rows
        }
        /// Input features.
        pub fn cols(&self) -> usize {
            self.cols
        }
        /// Bytes one mat-vec reads (codes + block scales).
        pub fn bytes(&self) -> usize {
            self.packed.len() + self.scales.len()
        }
    }

    impl SparseDevice {
        /// Uploads an NVFP4 matrix (`dims[0]` = cols, the rest = rows).
        pub fn upload_nvfp4(&self, t: &Nvfp4Tensor) -> Result<Nvfp4Matrix, SparseError> {
            let (rows, cols) = nvfp4_shape(t)?;
            let packed = self.stream().clone_htod(&t.packed).map_err(drv)?;
            let scales = self.stream().clone_htod(&t.block_scales).map_err(drv)?;
            Ok(Nvfp4Matrix {
                rows,
                cols,
                tensor_scale: t.tensor_scale,
                packed,
                scales,
            })
        }

        /// `y = W x` (`x`: `cols` floats, `y`: `rows` floats).
        pub fn matvec_nvfp4(
            &self,
            w: &Nvfp4Matrix,
            x: &CudaSlice<f32>,
            y: &mut CudaSlice<f32>,
        ) -> Result<(), SparseError> {
            if x.len() < w.cols || y.len() < w.rows {
                return Err(SparseError::InvalidArgument(format!(
                    "matvec_nvfp4: x holds {}, y {}; the matrix is {}x{}",
                    x.len(),
                    y.len(),
                    w.rows,
                    w.cols
                )));
            }
            let (pp, ps, px, py) = (
                self.ptr(&w.packed),
                self.ptr(&w.scales),
                self.ptr(x),
                self.ptr(y),
            );
            self.launch_matvec_nvfp4(pp, ps, w.tensor_scale, w.rows, w.cols, px, py)
        }
    }
}
