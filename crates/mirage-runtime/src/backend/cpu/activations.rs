//! The CPU backend's activation buffers.

use crate::error::{Result, RuntimeError};

/// A row-major `[rows, width]` f32 buffer whose allocation is reused.
#[derive(Debug, Default, Clone)]
pub struct CpuActivations {
    pub(super) rows: usize,
    pub(super) width: usize,
    pub(super) data: Vec<f32>,
}

impl CpuActivations {
    /// A buffer holding `data` as `rows` rows.
    pub fn from_vec(rows: usize, width: usize, data: Vec<f32>) -> Result<CpuActivations> {
        if rows.checked_mul(width) != Some(data.len()) {
            return Err(RuntimeError::InvalidArgument(
                "activation data does not match its shape".into(),
            ));
        }
        Ok(CpuActivations { rows, width, data })
    }
    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Row width.
    pub fn width(&self) -> usize {
        self.width
    }
    /// All rows.
    pub fn data(&self) -> &[f32] {
        &self.data[..self.rows * self.width]
    }
    /// One row.
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.width..(r + 1) * self.width]
    }
    /// Sets the shape, keeping the allocation (new elements are 0, old ones
    /// keep their values).
    pub fn reshape(&mut self, rows: usize, width: usize) {
        self.rows = rows;
        self.width = width;
        self.data.resize(rows * width, 0.0);
    }
    /// All rows, for writing.
    pub fn data_mut(&mut self) -> &mut [f32] {
        let n = self.rows * self.width;
        &mut self.data[..n]
    }
}
