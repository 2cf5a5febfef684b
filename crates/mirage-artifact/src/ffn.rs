//! A reference FFN in f32 (dequantized weights) that exposes what the dense
//! kernel hides: the hidden activations `h` and each page's contribution
//! `W_down,p h_p` to the output. Calibration, the oracle and the page
//! formation test run on it.

use mirage_gguf::{quant, GgufFile};

use crate::error::{ArtifactError, Result};

/// One layer's FFN weights in f32; `down_t` is `W_down` transposed so that
/// channel `i` owns row `i` of all three matrices.
#[derive(Debug, Clone, PartialEq)]
pub struct FfnF32 {
    /// Hidden size.
    pub d_model: usize,
    /// FFN channels.
    pub n_ff: usize,
    /// `[n_ff, d_model]`.
    pub gate: Vec<f32>,
    /// `[n_ff, d_model]`.
    pub up: Vec<f32>,
    /// `[n_ff, d_model]` (`W_down` transposed).
    pub down_t: Vec<f32>,
}

/// `a · b` with eight independent accumulators (vectorizes; fixed order, so
/// deterministic).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut s = (acc[0] + acc[4]) + (acc[1] + acc[5]) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `y += a * x`.
#[inline]
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// SiLU.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn dequant_matrix(file: &GgufFile, name: &str, cols: usize, rows: usize) -> Result<Vec<f32>> {
    let t = file
        .tensor(name)
        .ok_or_else(|| ArtifactError::Malformed(format!("model has no tensor {name}")))?;
    if t.dims() != [cols as u64, rows as u64] {
        return Err(ArtifactError::Malformed(format!(
            "{name}: dims {:?}, expected [{cols}, {rows}]",
            t.dims()
        )));
    }
    let mut v = vec![0f32; cols * rows];
    quant::dequantize(t.ty(), t.data, &mut v)?;
    Ok(v)
}

impl FfnF32 {
    /// Dequantizes layer `layer`'s FFN of a GGUF model.
    pub fn from_gguf(file: &GgufFile, layer: usize, d_model: usize, n_ff: usize) -> Result<FfnF32> {
        let n = |s: &str| format!("blk.{layer}.{s}");
        let gate = dequant_matrix(file, &n("ffn_gate.weight"), d_model, n_ff)?;
        let up = dequant_matrix(file, &n("ffn_up.weight"), d_model, n_ff)?;
        let down = dequant_matrix(file, &n("ffn_down.weight"), n_ff, d_model)?;
        let mut down_t = vec![0f32; n_ff * d_model];
        for j in 0..d_model {
            for i in 0..n_ff {
                down_t[i * d_model + j] = down[j * n_ff + i];
            }
        }
        Ok(FfnF32 {
            d_model,
            n_ff,
            gate,
            up,
            down_t,
        })
    }

    /// Hidden activations `h = silu(W_gate x) * (W_up x)` (`n_ff` values).
    pub fn hidden(&self, x: &[f32], h: &mut [f32]) {
        let d = self.d_model;
        for (i, h) in h.iter_mut().enumerate().take(self.n_ff) {
            let g = dot(&self.gate[i * d..(i + 1) * d], x);
            let u = dot(&self.up[i * d..(i + 1) * d], x);
            *h = silu(g) * u;
        }
    }

    /// Page contributions `W_down,p h_p`, page-major (`pages * d_model`),
    /// where page `p` is channels `p * page_channels ..` in the current order.
    pub fn page_contributions(&self, h: &[f32], page_channels: usize, out: &mut [f32]) {
        let d = self.d_model;
        out.fill(0.0);
        for (i, &hi) in h.iter().enumerate().take(self.n_ff) {
            let p = i / page_channels;
            axpy(
                &mut out[p * d..(p + 1) * d],
                hi,
                &self.down_t[i * d..(i + 1) * d],
            );
        }
    }

    /// The FFN output `W_down h`.
    pub fn output(&self, h: &[f32]) -> Vec<f32> {
        let d = self.d_model;
        let mut y = vec![0f32; d];
        for (i, &hi) in h.iter().enumerate().take(self.n_ff) {
            axpy(&mut y, hi, &self.down_t[i * d..(i + 1) * d]);
        }
        y
    }

    /// The same FFN with its channels reordered: new channel `k` is old
    /// channel `perm[k]` (gate rows, up rows and down columns move together).
    pub fn permuted(&self, perm: &[usize]) -> FfnF32 {
        let d = self.d_model;
        let take = |m: &[f32]| -> Vec<f32> {
            perm.iter()
                .flat_map(|&i| m[i * d..(i + 1) * d].iter().copied())
                .collect()
        };
        FfnF32 {
            d_model: d,
            n_ff: perm.len(),
            gate: take(&self.gate),
            up: take(&self.up),
            down_t: take(&self.down_t),
        }
    }
}
