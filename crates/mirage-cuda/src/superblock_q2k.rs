//! Q2_K pages for the fused superblock FFN: the host packer [`Q2kPages`] of
//! the pages `superblock_ffn_q2k` (`cuda/superblock_q2k.cu`) reads, with the
//! contract of the Q8_0 and NVFP4 kernels.
//!
//! Device layout ("split Q2_K", documented at the top of
//! `cuda/superblock_q2k.cu`): a matrix of `R` rows by `d` (`d % 256 == 0`)
//! is its ggml `block_q2_K` bytes regrouped into
//! `[quants R x d/4][scales R x d/16][dm R x d/64]`: each block's `qs[64]`
//! verbatim, its `scales[16]` permuted so the four scale bytes a 64-weight
//! quarter of the block needs are one aligned `u32` ([`q2k_scale_slot`]),
//! and its `d`/`dmin` f16 pair as one `u32`. Same 84 bytes per 256 weights
//! as ggml. A page (128 channels) is
//! `[gate q][up q][down_t q][gate scales][up scales][down_t scales][gate dm][up dm][down_t dm]`,
//! [`q2k_page_bytes`] = `126 * d` bytes.
//!
//! Gate and up rows of a Q2_K GGUF are taken verbatim; `down_t` (column `c`
//! of `W_down` as row `c`) has its blocks along `d_model`, so `W_down` is
//! dequantized, transposed and quantized to Q2_K with mirage-gguf's
//! quantizer (ggml's `quantize_row_q2_K_ref`).

use mirage_gguf::quant;
use mirage_gguf::tensor::TensorView;
use mirage_gguf::GgmlType;

use crate::superblock::{
    dequantize_parallel, dequantize_transposed, ffn_matrix_dims, SparseError, PAGE_CHANNELS,
};

/// Weights per Q2_K super-block.
pub const Q2K_BLOCK: usize = 256;
/// Bytes per Q2_K super-block (ggml `block_q2_K`).
const Q2K_BYTES: usize = 84;
/// Largest `d_model` the kernel takes: it keeps the 16-weight sums of x
/// (`d / 16` floats) in its 4 KiB reduction tile (`Q2_MAX_D`).
pub const Q2K_MAX_D: usize = 16384;

fn invalid(msg: impl Into<String>) -> SparseError {
    SparseError::InvalidArgument(msg.into())
}

fn check_d(d: usize) -> Result<(), SparseError> {
    if d == 0 || d % Q2K_BLOCK != 0 || d > Q2K_MAX_D {
        return Err(invalid(format!(
            "Q2_K pages need d_model a positive multiple of {Q2K_BLOCK} up to {Q2K_MAX_D}, got {d}"
        )));
    }
    Ok(())
}

/// Bytes of one Q2_K page of `d_model`: three 128-row matrices of
/// `d_model / 256` blocks of 84 bytes (`126 * d_model`).
pub fn q2k_page_bytes(d_model: usize) -> usize {
    3 * PAGE_CHANNELS * d_model / Q2K_BLOCK * Q2K_BYTES
}

/// Where byte `i` (0..16) of a ggml `block_q2_K`'s `scales[16]` goes in the
/// split layout's 16 scale bytes of that block: `4 u + j` for
/// `i = 8 (u >> 1) + 2 j + (u & 1)` (quarter `u` of the block, bit pair `j`).
pub fn q2k_scale_slot(i: usize) -> usize {
    let (h, j, hi) = (i / 8, (i % 8) / 2, i % 2);
    4 * (2 * h + hi) + j
}

/// Regroups `rows` ggml Q2_K rows of `d` weights into the split layout
/// `[quants rows x d/4][scales rows x d/16][dm rows x d/64]`.
pub fn split_q2k_rows(ggml: &[u8], rows: usize, d: usize) -> Result<Vec<u8>, SparseError> {
    check_d(d)?;
    let blocks = rows * d / Q2K_BLOCK;
    if ggml.len() != blocks * Q2K_BYTES {
        return Err(invalid(format!(
            "{rows} Q2_K rows of {d} need {} bytes, got {}",
            blocks * Q2K_BYTES,
            ggml.len()
        )));
    }
    let mut out = vec![0u8; ggml.len()];
    let (quants, rest) = out.split_at_mut(blocks * 64);
    let (scales, dm) = rest.split_at_mut(blocks * 16);
    for (b, block) in ggml.chunks_exact(Q2K_BYTES).enumerate() {
        quants[64 * b..64 * b + 64].copy_from_slice(&block[16..80]);
        for (i, &s) in block[..16].iter().enumerate() {
            scales[16 * b + q2k_scale_slot(i)] = s;
        }
        dm[4 * b..4 * b + 4].copy_from_slice(&block[80..84]);
    }
    Ok(out)
}

/// The inverse of [`split_q2k_rows`]: ggml Q2_K rows again.
pub fn join_q2k_rows(split: &[u8], rows: usize, d: usize) -> Result<Vec<u8>, SparseError> {
    check_d(d)?;
    let blocks = rows * d / Q2K_BLOCK;
    if split.len() != blocks * Q2K_BYTES {
        return Err(invalid(format!(
            "{rows} split Q2_K rows of {d} are {} bytes, got {}",
            blocks * Q2K_BYTES,
            split.len()
        )));
    }
    let (quants, rest) = split.split_at(blocks * 64);
    let (scales, dm) = rest.split_at(blocks * 16);
    let mut out = vec![0u8; split.len()];
    for (b, block) in out.chunks_exact_mut(Q2K_BYTES).enumerate() {
        for i in 0..16 {
            block[i] = scales[16 * b + q2k_scale_slot(i)];
        }
        block[16..80].copy_from_slice(&quants[64 * b..64 * b + 64]);
        block[80..84].copy_from_slice(&dm[4 * b..4 * b + 4]);
    }
    Ok(out)
}

/// Quantizes `values` (rows of `d`) to ggml Q2_K rows on up to `threads`
/// threads (mirage-gguf's quantizer, row by row: the same bytes as one call).
pub fn quantize_q2k_rows(values: &[f32], d: usize, threads: usize) -> Result<Vec<u8>, SparseError> {
    check_d(d)?;
    if values.len() % d != 0 {
        return Err(invalid(format!(
            "{} values are not rows of {d}",
            values.len()
        )));
    }
    let rows = values.len() / d;
    let rb = d / Q2K_BLOCK * Q2K_BYTES;
    let mut out = vec![0u8; rows * rb];
    let per = rows.div_ceil(threads.clamp(1, rows.max(1))).max(1);
    std::thread::scope(|s| -> Result<(), SparseError> {
        let jobs: Vec<_> = values
            .chunks(per * d)
            .zip(out.chunks_mut(per * rb))
            .map(|(src, dst)| s.spawn(move || quant::quantize(GgmlType::Q2_K, src, dst)))
            .collect();
        for j in jobs {
            j.join().unwrap_or_else(|e| std::panic::resume_unwind(e))?;
        }
        Ok(())
    })?;
    Ok(out)
}

fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// One layer's FFN as page-major Q2_K pages on the host, in the device
/// layout of `superblock_ffn_q2k`: page `p` holds channels
/// `128 p .. 128 p + 127` of gate, up and `down_t`, each matrix in the split
/// Q2_K layout (see the module docs). If `n_ff` is not a multiple of 128 the
/// last page is padded with zero rows (d = dmin = 0: weights 0).
#[derive(Debug, Clone, PartialEq)]
pub struct Q2kPages {
    d_model: usize,
    n_ff: usize,
    n_pages: usize,
    bytes: Vec<u8>,
}

impl Q2kPages {
    /// Packs three ggml Q2_K matrices of `n_ff` rows by `d_model` (row-major
    /// ggml rows, as a GGUF stores `ffn_gate`/`ffn_up`): gate, up and the
    /// transposed down (`down_t`, row `c` = column `c` of `W_down`).
    pub fn from_q2k_rows(
        d_model: usize,
        n_ff: usize,
        gate: &[u8],
        up: &[u8],
        down_t: &[u8],
    ) -> Result<Q2kPages, SparseError> {
        check_d(d_model)?;
        if n_ff == 0 {
            return Err(invalid("an FFN needs at least one channel"));
        }
        let rb = d_model / Q2K_BLOCK * Q2K_BYTES;
        for (name, m) in [("gate", gate), ("up", up), ("down_t", down_t)] {
            if m.len() != n_ff * rb {
                return Err(invalid(format!(
                    "Q2_K {name}: {n_ff} rows of {d_model} are {} bytes, got {}",
                    n_ff * rb,
                    m.len()
                )));
            }
        }
        let n_pages = n_ff.div_ceil(PAGE_CHANNELS);
        let pb = q2k_page_bytes(d_model);
        // Per matrix in a page: quants, scales and dm spans.
        let (mq, ms, mm) = (
            PAGE_CHANNELS * d_model / 4,
            PAGE_CHANNELS * d_model / 16,
            PAGE_CHANNELS * d_model / 64,
        );
        let mut bytes = vec![0u8; n_pages * pb];
        for (p, page) in bytes.chunks_exact_mut(pb).enumerate() {
            let rows = p * PAGE_CHANNELS..((p + 1) * PAGE_CHANNELS).min(n_ff);
            let n = rows.len();
            // Row counts below 128 split to the same per-row strides: copy
            // the n rows' spans and leave the padding rows zero.
            let (rq, rs, rm) = (d_model / 4, d_model / 16, d_model / 64);
            for (k, m) in [gate, up, down_t].into_iter().enumerate() {
                let split = split_q2k_rows(&m[rows.start * rb..rows.end * rb], n, d_model)?;
                let (sq, rest) = split.split_at(n * rq);
                let (ss, sm) = rest.split_at(n * rs);
                page[k * mq..k * mq + n * rq].copy_from_slice(sq);
                let at = 3 * mq + k * ms;
                page[at..at + n * rs].copy_from_slice(ss);
                let at = 3 * mq + 3 * ms + k * mm;
                page[at..at + n * rm].copy_from_slice(sm);
            }
        }
        Ok(Q2kPages {
            d_model,
            n_ff,
            n_pages,
            bytes,
        })
    }

    /// Quantizes f32 matrices of `n_ff` rows by `d_model` (gate, up and the
    /// transposed down, row-major) to Q2_K (mirage-gguf's quantizer, on all
    /// CPUs) and packs them.
    pub fn from_f32(
        d_model: usize,
        gate: &[f32],
        up: &[f32],
        down_t: &[f32],
    ) -> Result<Q2kPages, SparseError> {
        check_d(d_model)?;
        let n = gate.len();
        if n % d_model != 0 || up.len() != n || down_t.len() != n {
            return Err(invalid(format!(
                "gate, up and down_t must be the same rows of {d_model}: {} / {} / {} values",
                gate.len(),
                up.len(),
                down_t.len()
            )));
        }
        let t = default_threads();
        Self::from_q2k_rows(
            d_model,
            n / d_model,
            &quantize_q2k_rows(gate, d_model, t)?,
            &quantize_q2k_rows(up, d_model, t)?,
            &quantize_q2k_rows(down_t, d_model, t)?,
        )
    }

    /// Packs a layer's GGUF FFN matrices (`(type, bytes)` as the file stores
    /// them: gate and up `n_ff` rows of `d_model`, down `d_model` rows of
    /// `n_ff`), on up to `threads` threads. Q2_K gate and up rows are copied
    /// verbatim, other types dequantized and quantized to Q2_K; down is
    /// always dequantized, transposed and quantized.
    pub fn from_gguf_parts(
        d_model: usize,
        n_ff: usize,
        gate: (GgmlType, &[u8]),
        up: (GgmlType, &[u8]),
        down: (GgmlType, &[u8]),
        threads: usize,
    ) -> Result<Q2kPages, SparseError> {
        check_d(d_model)?;
        let rows_q2k = |(ty, data): (GgmlType, &[u8])| -> Result<Vec<u8>, SparseError> {
            if ty == GgmlType::Q2_K {
                return Ok(data.to_vec());
            }
            let w = dequantize_parallel(ty, data, n_ff, d_model, threads)?;
            quantize_q2k_rows(&w, d_model, threads)
        };
        let g = rows_q2k(gate)?;
        let u = rows_q2k(up)?;
        // W_down is [d_model][n_ff]; down_t[c][r] = W_down[r][c].
        let t = dequantize_transposed(down.0, down.1, d_model, n_ff, threads)?;
        let dt = quantize_q2k_rows(&t, d_model, threads)?;
        Self::from_q2k_rows(d_model, n_ff, &g, &u, &dt)
    }

    /// [`Q2kPages::from_gguf_parts`] on tensors read from a GGUF file
    /// (`ffn_gate`, `ffn_up`, `ffn_down` of one layer).
    pub fn from_gguf(
        gate: &TensorView<'_>,
        up: &TensorView<'_>,
        down: &TensorView<'_>,
        threads: usize,
    ) -> Result<Q2kPages, SparseError> {
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
    /// All pages, page-major (`n_pages * q2k_page_bytes(d_model)` bytes).
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
    /// Page `p`'s bytes.
    pub fn page(&self, p: usize) -> &[u8] {
        let pb = q2k_page_bytes(self.d_model);
        &self.bytes[p * pb..(p + 1) * pb]
    }

    /// Decodes page `p` (ggml rows reassembled, then mirage-gguf's Q2_K
    /// dequantizer): gate, up and down_t, each `128 x d_model` f32
    /// row-major (padding rows decode to zeros).
    pub fn dequantize_page(&self, p: usize) -> Result<[Vec<f32>; 3], SparseError> {
        let d = self.d_model;
        let page = self.page(p);
        let (mq, ms, mm) = (
            PAGE_CHANNELS * d / 4,
            PAGE_CHANNELS * d / 16,
            PAGE_CHANNELS * d / 64,
        );
        let mut out: [Vec<f32>; 3] = std::array::from_fn(|_| vec![0f32; PAGE_CHANNELS * d]);
        for (k, dst) in out.iter_mut().enumerate() {
            let split = [
                &page[k * mq..(k + 1) * mq],
                &page[3 * mq + k * ms..3 * mq + (k + 1) * ms],
                &page[3 * mq + 3 * ms + k * mm..3 * mq + 3 * ms + (k + 1) * mm],
            ]
            .concat();
            let rows = join_q2k_rows(&split, PAGE_CHANNELS, d)?;
            quant::dequantize(GgmlType::Q2_K, &rows, dst)?;
        }
        Ok(out)
    }
}
