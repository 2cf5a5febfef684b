//! Host-side packing of the sparse FFN's pages (no GPU needed): split Q8_0
//! pages (`superblock_ffn_q8s` in `cuda/superblock.cu`) and NVFP4 pages
//! (`superblock_ffn_nvfp4`).
//!
//! A page is 128 FFN channels stored contiguously (page-major, as
//! `mirage_artifact::pack::pack_page` writes them): the gate and up rows of
//! its channels and the matching columns of `W_down` as rows (`down_t`).
//!
//! Split Q8_0: the ggml Q8_0 blocks of a matrix are split into all quants
//! first (`[rows][d]` int8) and all f16 block scales after (`[rows][d/32]`):
//! the same 34 bytes per 32 weights, but a warp's 16-byte loads cover whole
//! 128-byte lines. A page is
//! `[gate q][up q][down_t q][gate scales][up scales][down_t scales]`, one
//! contiguous span (see the comment at the top of `cuda/superblock.cu`).
//!
//! NVFP4 pages: [`Nvfp4Pages`] packs a layer's gate, up and transposed down
//! matrices with the CPU codec (from f32 or requantized from the GGUF's
//! matrices, one tensor scale per layer matrix) into
//! `[gate codes][up codes][down_t codes][gate scales][up scales][down_t scales]`
//! per page.

use mirage_gguf::quant::{self, Nvfp4Error, Nvfp4Tensor, QuantError};
use mirage_gguf::tensor::TensorView;
use mirage_gguf::GgmlType;

use crate::CudaError;

/// FFN channels per page (as in the artifact format).
pub const PAGE_CHANNELS: usize = 128;

/// Ggml Q8_0: weights per block and bytes per block.
const Q8_BLOCK: usize = 32;
const Q8_BYTES: usize = 34;

/// Why a sparse-path call was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum SparseError {
    /// The device, driver or compiler failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// Bad shapes or lengths from the caller.
    #[error("sparse kernels: {0}")]
    InvalidArgument(String),
    /// A ggml quantization helper refused its input.
    #[error(transparent)]
    Quant(#[from] QuantError),
    /// The NVFP4 codec refused its input.
    #[error(transparent)]
    Nvfp4(#[from] Nvfp4Error),
}

fn invalid(msg: impl Into<String>) -> SparseError {
    SparseError::InvalidArgument(msg.into())
}

/// Splits `rows` ggml Q8_0 rows of `d` weights (`rows * d / 32 * 34` bytes)
/// into the split-Q8_0 layout: all quants, then all f16 scales.
pub fn split_q8_0_rows(ggml: &[u8], rows: usize, d: usize) -> Result<Vec<u8>, SparseError> {
    if d == 0 || d % Q8_BLOCK != 0 {
        return Err(invalid(format!(
            "Q8_0 row length {d} is not a positive multiple of {Q8_BLOCK}"
        )));
    }
    let blocks = rows * d / Q8_BLOCK;
    if ggml.len() != blocks * Q8_BYTES {
        return Err(invalid(format!(
            "{rows} Q8_0 rows of {d} need {} bytes, got {}",
            blocks * Q8_BYTES,
            ggml.len()
        )));
    }
    let mut out = vec![0u8; ggml.len()];
    let (quants, scales) = out.split_at_mut(rows * d);
    for (b, block) in ggml.chunks_exact(Q8_BYTES).enumerate() {
        scales[2 * b..2 * b + 2].copy_from_slice(&block[..2]);
        quants[b * Q8_BLOCK..(b + 1) * Q8_BLOCK].copy_from_slice(&block[2..]);
    }
    Ok(out)
}

/// Bytes of one Q8_0 page of `d_model` (three 128-row matrices).
pub fn q8_0_page_bytes(d_model: usize) -> usize {
    3 * PAGE_CHANNELS * d_model / Q8_BLOCK * Q8_BYTES
}

/// `(d_model, n_ff)` of a layer's GGUF `ffn_gate`, `ffn_up` (`[d_model,
/// n_ff]`) and `ffn_down` (`[n_ff, d_model]`), or an error naming the
/// mismatch: the page packers' shape check.
pub(crate) fn ffn_matrix_dims(
    gate: &TensorView<'_>,
    up: &TensorView<'_>,
    down: &TensorView<'_>,
) -> Result<(usize, usize), SparseError> {
    let dims = |v: &TensorView<'_>| -> Result<(usize, usize), SparseError> {
        match v.dims() {
            [a, b] => Ok((*a as usize, *b as usize)),
            other => Err(invalid(format!(
                "{} has dims {other:?}, not a matrix",
                v.name()
            ))),
        }
    };
    let (d_model, n_ff) = dims(gate)?;
    if dims(up)? != (d_model, n_ff) || dims(down)? != (n_ff, d_model) {
        return Err(invalid(format!(
            "FFN matrices {:?} / {:?} / {:?} do not match gate [{d_model}, {n_ff}]",
            up.dims(),
            down.dims(),
            gate.dims()
        )));
    }
    Ok((d_model, n_ff))
}

/// A `rows x cols` ggml matrix dequantized to f32 on up to `threads`
/// threads (bands of whole rows), with its size checked against the type.
pub(crate) fn dequantize_parallel(
    ty: GgmlType,
    data: &[u8],
    rows: usize,
    cols: usize,
    threads: usize,
) -> Result<Vec<f32>, SparseError> {
    let n = rows
        .checked_mul(cols)
        .ok_or_else(|| invalid(format!("{rows} x {cols} overflows")))?;
    let row_bytes = ty
        .bytes_for(cols as u64)
        .ok_or_else(|| invalid(format!("{cols} columns are not whole {ty:?} blocks")))?
        as usize;
    if Some(data.len()) != rows.checked_mul(row_bytes) {
        return Err(invalid(format!(
            "{} bytes for {rows} x {cols} {ty:?} (want {row_bytes} per row)",
            data.len(),
        )));
    }
    let band = rows.div_ceil(threads.clamp(1, rows.max(1))).max(1);
    let mut w = vec![0f32; n];
    if n == 0 {
        return Ok(w);
    }
    std::thread::scope(|sc| -> Result<(), SparseError> {
        let jobs: Vec<_> = data
            .chunks(band * row_bytes)
            .zip(w.chunks_mut(band * cols))
            .map(|(src, dst)| sc.spawn(move || quant::dequantize(ty, src, dst)))
            .collect();
        for j in jobs {
            j.join().unwrap_or_else(|e| std::panic::resume_unwind(e))?;
        }
        Ok(())
    })?;
    Ok(w)
}

/// A `rows x cols` ggml matrix dequantized and transposed (`cols x rows`
/// f32, `t[c][r] = w[r][c]`), on up to `threads` threads
/// ([`dequantize_parallel`], then each thread writes a band of output rows
/// in 64 x 64 tiles, both sides in cache). The page packers need W_down's
/// columns as rows; single-threaded this was most of the load time of a 7B
/// model's NVFP4 / Q2_K pages.
pub(crate) fn dequantize_transposed(
    ty: GgmlType,
    data: &[u8],
    rows: usize,
    cols: usize,
    threads: usize,
) -> Result<Vec<f32>, SparseError> {
    let w = dequantize_parallel(ty, data, rows, cols, threads)?;
    let n = w.len();
    let threads = threads.clamp(1, cols.max(1));
    let mut t = vec![0f32; n];
    if n == 0 {
        return Ok(t);
    }
    const TILE: usize = 64;
    let out_band = cols.div_ceil(threads).div_ceil(TILE).max(1) * TILE;
    std::thread::scope(|sc| {
        for (i, dst) in t.chunks_mut(out_band * rows).enumerate() {
            let w = &w;
            sc.spawn(move || {
                let c_begin = i * out_band;
                let c_end = (c_begin + out_band).min(cols);
                for r0 in (0..rows).step_by(TILE) {
                    for c0 in (c_begin..c_end).step_by(TILE) {
                        for r in r0..(r0 + TILE).min(rows) {
                            for c in c0..(c0 + TILE).min(c_end) {
                                dst[(c - c_begin) * rows + r] = w[r * cols + c];
                            }
                        }
                    }
                }
            });
        }
    });
    Ok(t)
}

/// Floats of the ordered reduction's partial buffer of the fused FFN
/// kernels launched with `grid` blocks at `d_model`: one `d_model`-wide
/// partial per part of an output chunk, `grid / n_chunks` parts at most
/// (`n_chunks` the 128-wide output chunks).
pub fn ffn_partials_len(grid: u32, d_model: usize) -> usize {
    (grid as usize / d_model.div_ceil(128)).max(1) * d_model
}

/// Repacks one artifact page (`pack_page` layout, Q8_0: 128 gate rows, 128
/// up rows, 128 down_t rows, each a ggml Q8_0 row of `d_model`) into the
/// device page layout `[gate q][up q][down_t q][gate s][up s][down_t s]`.
pub fn split_q8_0_page(page: &[u8], d_model: usize) -> Result<Vec<u8>, SparseError> {
    let rb = quant::row_bytes(GgmlType::Q8_0, d_model)?;
    let mat = PAGE_CHANNELS * rb;
    if page.len() != 3 * mat {
        return Err(invalid(format!(
            "Q8_0 page of d_model {d_model} must be {} bytes, got {}",
            3 * mat,
            page.len()
        )));
    }
    let q = PAGE_CHANNELS * d_model;
    let s = PAGE_CHANNELS * d_model / Q8_BLOCK * 2;
    let mut out = vec![0u8; 3 * mat];
    for k in 0..3 {
        let split = split_q8_0_rows(&page[k * mat..(k + 1) * mat], PAGE_CHANNELS, d_model)?;
        out[k * q..(k + 1) * q].copy_from_slice(&split[..q]);
        out[3 * q + k * s..3 * q + (k + 1) * s].copy_from_slice(&split[q..]);
    }
    Ok(out)
}

/// NVFP4 elements per E4M3 block scale.
const NV_BLOCK: usize = 16;

/// Bytes of one NVFP4 page of `d_model`: three 128-row matrices of
/// `d_model / 2` code bytes and `d_model / 16` scale bytes a row.
pub fn nvfp4_page_bytes(d_model: usize) -> usize {
    3 * PAGE_CHANNELS * (d_model / 2 + d_model / NV_BLOCK)
}

/// One layer's FFN as page-major NVFP4 pages on the host, in the device
/// layout of `superblock_ffn_nvfp4` (`cuda/superblock.cu`): page `p` holds
/// channels `128 p .. 128 p + 127` as
/// `[gate codes 128 x d/2][up codes][down_t codes][gate scales 128 x d/16][up scales][down_t scales]`,
/// each row exactly the bytes of the CPU codec ([`Nvfp4Tensor`]: E2M1
/// codes, low nibble first, one E4M3 scale per 16 elements), plus one f32
/// tensor scale per layer matrix.
///
/// `down_t` row `c` is column `c` of `W_down` (the artifact's transposed
/// down slice), quantized along `d_model`: it is the codec's quantization of
/// `W_downᵀ`, whose tensor scale (the absolute maximum over the matrix) is
/// that of requantizing `W_down` itself; its block scales differ from
/// `W_down`'s (blocks run along the other axis). If `n_ff` is not a
/// multiple of 128 the last page is padded with zero rows (scale 0, code 0:
/// those channels add nothing).
#[derive(Debug, Clone, PartialEq)]
pub struct Nvfp4Pages {
    d_model: usize,
    n_ff: usize,
    n_pages: usize,
    tensor_scales: [f32; 3],
    bytes: Vec<u8>,
}

impl Nvfp4Pages {
    /// Packs three NVFP4 matrices of `n_ff` rows by `d_model` (`dims =
    /// [d_model, n_ff]`): gate, up and the transposed down (`down_t`).
    /// `d_model` must be a positive multiple of 32 (the kernel reads 32
    /// elements a lane).
    pub fn from_tensors(
        gate: &Nvfp4Tensor,
        up: &Nvfp4Tensor,
        down_t: &Nvfp4Tensor,
    ) -> Result<Nvfp4Pages, SparseError> {
        let (n_ff, d_model) = crate::nvfp4::nvfp4_shape(gate)?;
        if d_model % 32 != 0 {
            return Err(invalid(format!(
                "NVFP4 pages need d_model a multiple of 32, got {d_model}"
            )));
        }
        for (name, t) in [("up", up), ("down_t", down_t)] {
            if crate::nvfp4::nvfp4_shape(t)? != (n_ff, d_model) {
                return Err(invalid(format!(
                    "NVFP4 {name} matrix is {:?} rows x cols, gate is ({n_ff}, {d_model})",
                    crate::nvfp4::nvfp4_shape(t)?
                )));
            }
        }
        let n_pages = n_ff.div_ceil(PAGE_CHANNELS);
        let (rc, rs) = (d_model / 2, d_model / NV_BLOCK);
        let (mat, smat) = (PAGE_CHANNELS * rc, PAGE_CHANNELS * rs);
        let pb = nvfp4_page_bytes(d_model);
        let mut bytes = vec![0u8; n_pages * pb];
        for (p, page) in bytes.chunks_exact_mut(pb).enumerate() {
            let rows = p * PAGE_CHANNELS..((p + 1) * PAGE_CHANNELS).min(n_ff);
            let n = rows.len();
            let (codes, scales) = page.split_at_mut(3 * mat);
            for (k, t) in [gate, up, down_t].into_iter().enumerate() {
                codes[k * mat..k * mat + n * rc]
                    .copy_from_slice(&t.packed[rows.start * rc..rows.end * rc]);
                scales[k * smat..k * smat + n * rs]
                    .copy_from_slice(&t.block_scales[rows.start * rs..rows.end * rs]);
            }
        }
        Ok(Nvfp4Pages {
            d_model,
            n_ff,
            n_pages,
            tensor_scales: [gate.tensor_scale, up.tensor_scale, down_t.tensor_scale],
            bytes,
        })
    }

    /// Quantizes f32 matrices of `n_ff` rows by `d_model` (gate, up and the
    /// transposed down, row-major) with the codec, each matrix as a whole
    /// (one tensor scale per matrix), and packs them.
    pub fn from_f32(
        d_model: usize,
        gate: &[f32],
        up: &[f32],
        down_t: &[f32],
    ) -> Result<Nvfp4Pages, SparseError> {
        if d_model == 0 || gate.len() % d_model != 0 {
            return Err(invalid(format!(
                "{} gate values are not rows of {d_model}",
                gate.len()
            )));
        }
        let dims = [d_model as u64, (gate.len() / d_model) as u64];
        Self::from_tensors(
            &Nvfp4Tensor::quantize(gate, &dims)?,
            &Nvfp4Tensor::quantize(up, &dims)?,
            &Nvfp4Tensor::quantize(down_t, &dims)?,
        )
    }

    /// Requantizes a layer's GGUF FFN matrices (`(type, bytes)` as the file
    /// stores them: gate and up `n_ff` rows of `d_model`, down `d_model` rows
    /// of `n_ff`) with the codec on up to `threads` threads. Gate and up are
    /// exactly [`Nvfp4Tensor::requantize`]; down is dequantized, transposed
    /// and quantized (same tensor scale as requantizing `W_down`).
    pub fn from_gguf_parts(
        d_model: usize,
        n_ff: usize,
        gate: (GgmlType, &[u8]),
        up: (GgmlType, &[u8]),
        down: (GgmlType, &[u8]),
        threads: usize,
    ) -> Result<Nvfp4Pages, SparseError> {
        let dims = [d_model as u64, n_ff as u64];
        let g = Nvfp4Tensor::requantize_parallel(gate.0, gate.1, &dims, threads)?;
        let u = Nvfp4Tensor::requantize_parallel(up.0, up.1, &dims, threads)?;
        // W_down is [d_model][n_ff]; down_t[c][r] = W_down[r][c].
        let t = dequantize_transposed(down.0, down.1, d_model, n_ff, threads)?;
        let t_bytes: Vec<u8> = t.iter().flat_map(|v| v.to_le_bytes()).collect();
        drop(t);
        let dt = Nvfp4Tensor::requantize_parallel(GgmlType::F32, &t_bytes, &dims, threads)?;
        Self::from_tensors(&g, &u, &dt)
    }

    /// [`Nvfp4Pages::from_gguf_parts`] on tensors read from a GGUF file
    /// (`ffn_gate`, `ffn_up`, `ffn_down` of one layer).
    pub fn from_gguf(
        gate: &TensorView<'_>,
        up: &TensorView<'_>,
        down: &TensorView<'_>,
        threads: usize,
    ) -> Result<Nvfp4Pages, SparseError> {
        let (d_model, n_ff) = ffn_matrix_dims(gate, up, down)?;
        Self::from_gguf_parts(
            d_model,
            n_ff,
            (gate.ty(), gate.data),
            (up.ty(), up.data),
            (down.ty(), down.data),
            threads,
        )
    }

    /// Model width.
    pub fn d_model(&self) -> usize {
        self.d_model
    }
    /// FFN channels (rows of each matrix; the last page may be padded).
    pub fn n_ff(&self) -> usize {
        self.n_ff
    }
    /// Pages.
    pub fn n_pages(&self) -> usize {
        self.n_pages
    }
    /// Tensor scales of gate, up and down.
    pub fn tensor_scales(&self) -> [f32; 3] {
        self.tensor_scales
    }
    /// All pages, page-major (`n_pages * nvfp4_page_bytes(d_model)` bytes).
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
    /// Page `p`'s bytes.
    pub fn page(&self, p: usize) -> &[u8] {
        let pb = nvfp4_page_bytes(self.d_model);
        &self.bytes[p * pb..(p + 1) * pb]
    }

    /// Decodes page `p` with the codec: gate, up and down_t, each `128 x
    /// d_model` f32 row-major (padding rows decode to zeros).
    pub fn dequantize_page(&self, p: usize) -> Result<[Vec<f32>; 3], SparseError> {
        let d = self.d_model;
        let page = self.page(p);
        let (mat, smat) = (PAGE_CHANNELS * d / 2, PAGE_CHANNELS * d / NV_BLOCK);
        let (codes, scales) = page.split_at(3 * mat);
        let mut out: [Vec<f32>; 3] = std::array::from_fn(|_| vec![0f32; PAGE_CHANNELS * d]);
        for (k, dst) in out.iter_mut().enumerate() {
            quant::nvfp4::dequantize_into(
                self.tensor_scales[k],
                &scales[k * smat..(k + 1) * smat],
                &codes[k * mat..(k + 1) * mat],
                dst,
            )?;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod dequantize_tests {
    use super::*;

    #[test]
    fn parallel_dequantize_and_transpose_equal_the_serial_codec() {
        // Odd shapes (bands and 64-wide tiles that do not divide them) and
        // more threads than rows or columns.
        for (rows, cols, threads) in [
            (3usize, 64usize, 1usize),
            (70, 96, 4),
            (129, 160, 7),
            (5, 32, 16),
        ] {
            let w: Vec<f32> = (0..rows * cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
                .collect();
            let mut q = vec![0u8; GgmlType::Q8_0.bytes_for((rows * cols) as u64).unwrap() as usize];
            quant::quantize(GgmlType::Q8_0, &w, &mut q).unwrap();
            let mut serial = vec![0f32; rows * cols];
            quant::dequantize(GgmlType::Q8_0, &q, &mut serial).unwrap();
            let par = dequantize_parallel(GgmlType::Q8_0, &q, rows, cols, threads).unwrap();
            assert_eq!(par, serial, "{rows} x {cols}, {threads} threads");
            let t = dequantize_transposed(GgmlType::Q8_0, &q, rows, cols, threads).unwrap();
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(
                        t[c * rows + r].to_bits(),
                        serial[r * cols + c].to_bits(),
                        "({r}, {c})"
                    );
                }
            }
        }
        // A length that does not match the shape is an error, not a panic.
        assert!(dequantize_parallel(GgmlType::Q8_0, &[0u8; 33], 1, 32, 2).is_err());
        assert!(dequantize_parallel(GgmlType::Q8_0, &[0u8; 34], 1, 31, 2).is_err());
    }
}
