//! Tensor descriptors and zero-copy views of tensor data.

use crate::error::GgufError;
use crate::GgmlType;

/// One tensor info record of a GGUF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name (`blk.0.ffn_up.weight`, ...).
    pub name: String,
    /// Dims in ggml order: `dims[0]` is the contiguous row length, so a
    /// PyTorch `[out, in]` weight has `dims == [in, out]`.
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Offset of the data relative to the start of the data section
    /// ([`crate::GgufFile::data_offset`]).
    pub offset: u64,
}

impl TensorInfo {
    /// Number of elements. The reader has checked that this does not
    /// overflow for every tensor it returns; saturates otherwise.
    pub fn n_elements(&self) -> u64 {
        self.dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .unwrap_or(u64::MAX)
    }

    /// Number of data bytes (whole blocks of `ty`). The reader has checked it
    /// for every tensor it returns; saturates for unchecked infos.
    pub fn n_bytes(&self) -> u64 {
        let n = self.n_elements();
        let bs = self.ty.block_size() as u64;
        (n / bs).saturating_mul(self.ty.type_size() as u64)
    }

    /// Length of one row (`dims[0]`), 1 for a scalar.
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows (product of `dims[1..]`; saturates like
    /// [`TensorInfo::n_elements`]).
    pub fn n_rows(&self) -> u64 {
        self.dims
            .iter()
            .skip(1)
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .unwrap_or(u64::MAX)
    }

    /// Bytes per row, for types whose rows are whole blocks.
    pub fn row_bytes(&self) -> u64 {
        (self.row_len() / self.ty.block_size() as u64).saturating_mul(self.ty.type_size() as u64)
    }
}

/// A tensor's info and its data, borrowed from the file (no copy).
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    /// The tensor's info record.
    pub info: &'a TensorInfo,
    /// Exactly `info.n_bytes()` bytes of data.
    pub data: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// The tensor's name.
    pub fn name(&self) -> &'a str {
        &self.info.name
    }

    /// The element type.
    pub fn ty(&self) -> GgmlType {
        self.info.ty
    }

    /// The dims, ggml order.
    pub fn dims(&self) -> &'a [u64] {
        &self.info.dims
    }

    /// Dequantizes the whole tensor to f32 (row-major in ggml order: row
    /// `r` is `out[r * dims[0]..(r + 1) * dims[0]]`), through
    /// [`crate::quant::dequantize`].
    pub fn to_f32(&self) -> Result<Vec<f32>, GgufError> {
        let n_elements = self.info.n_elements();
        let n = usize::try_from(n_elements).map_err(|_| GgufError::TooLarge {
            name: self.info.name.clone(),
            n_elements,
        })?;
        // Up to 16x the tensor's bytes (F32 from 2-bit blocks): a refused
        // allocation is an error, not an abort.
        let too_large = || GgufError::TooLarge {
            name: self.info.name.clone(),
            n_elements,
        };
        let mut out = Vec::new();
        out.try_reserve_exact(n).map_err(|_| too_large())?;
        out.resize(n, 0f32);
        crate::quant::dequantize(self.info.ty, self.data, &mut out).map_err(|source| {
            GgufError::Dequantize {
                name: self.info.name.clone(),
                source,
            }
        })?;
        Ok(out)
    }
}
