//! The sparse FFN's pages on the host (no GPU needed): one layer's FFN as
//! page-major pages of a [`PageFormat`], in the layouts the fused kernels
//! read (`cuda/superblock.cu`, `cuda/superblock_q2k.cu`).
//!
//! A page is 128 FFN channels stored contiguously: their gate rows, their up
//! rows and the matching columns of `W_down` as rows (`down_t`, the
//! artifact's transposed down slice). Every format stores a matrix of `R`
//! rows by `d` as a few row-major planes (its "split" layout: the same bytes
//! as its blocks, grouped by field), and a page is each plane of gate, up
//! and down_t in turn:
//!
//! | format | planes (bytes a row) | bytes a page |
//! |---|---|---|
//! | split Q8_0 | quants `d`, f16 scales `d / 16` | `408 d` |
//! | NVFP4 | E2M1 codes `d / 2`, E4M3 scales `d / 16` (+ one f32 tensor scale a matrix) | `216 d` |
//! | split Q2_K | quants `d / 4`, permuted scales `d / 16`, d/dmin words `d / 64` | `126 d` |
//!
//! so one packer ([`Pages::from_split`]), one channel permutation
//! ([`Pages::permuted`]) and one decoder serve all three; a format only
//! says how a matrix becomes planes ([`PageFormat::encode_rows`]) and back.
//! Block sizes come from mirage-gguf's type table.

use crate::options::PageFormat;
use mirage_gguf::quant::{self, Nvfp4Error, Nvfp4Tensor, QuantError};
use mirage_gguf::GgmlType;

/// FFN channels per page (as in the artifact format).
pub const PAGE_CHANNELS: usize = mirage_artifact::PAGE_CHANNELS;

/// Why pages could not be built.
#[derive(Debug, thiserror::Error)]
pub enum PageError {
    /// Bad shapes or lengths from the caller.
    #[error("sparse pages: {0}")]
    InvalidArgument(String),
    /// A ggml quantization helper refused its input.
    #[error(transparent)]
    Quant(#[from] QuantError),
    /// The NVFP4 codec refused its input.
    #[error(transparent)]
    Nvfp4(#[from] Nvfp4Error),
}

fn invalid(msg: impl Into<String>) -> PageError {
    PageError::InvalidArgument(msg.into())
}

/// Largest `d_model` of Q2_K pages: the kernel keeps the 16-weight sums of
/// x (`d / 16` floats) in its 4 KiB reduction tile (`Q2_MAX_D`).
pub const Q2K_MAX_D: usize = 16384;

impl PageFormat {
    /// The fused FFN kernel over pages of this format.
    pub(crate) fn kernel(self) -> &'static str {
        match self {
            PageFormat::Q8_0 => "superblock_ffn_q8s",
            PageFormat::Nvfp4 => "superblock_ffn_nvfp4",
            PageFormat::Q2K => "superblock_ffn_q2k",
        }
    }

    /// Bytes a row of `d` takes in each plane of the split layout.
    pub fn plane_widths(self, d: usize) -> Vec<usize> {
        match self {
            PageFormat::Q8_0 => vec![d, d / 16],
            PageFormat::Nvfp4 => vec![d / 2, d / 16],
            PageFormat::Q2K => vec![d / 4, d / 16, d / 64],
        }
    }

    /// Device bytes of one page of `d_model`.
    pub fn page_bytes(self, d_model: usize) -> usize {
        3 * PAGE_CHANNELS * self.plane_widths(d_model).iter().sum::<usize>()
    }

    /// Whether pages of this format can hold a model of width `d_model`:
    /// Q8_0 and NVFP4 need a positive multiple of 32, Q2_K a positive
    /// multiple of 256 up to [`Q2K_MAX_D`] (Qwen2.5 0.5B's 896 is 3.5
    /// super-blocks). The message names the width and the other formats.
    pub fn check_d_model(self, d_model: usize) -> Result<(), PageError> {
        let (step, max) = match self {
            PageFormat::Q8_0 | PageFormat::Nvfp4 => (32, usize::MAX),
            PageFormat::Q2K => (GgmlType::Q2_K.block_size(), Q2K_MAX_D),
        };
        if d_model == 0 || !d_model.is_multiple_of(step) || d_model > max {
            let hint = if self == PageFormat::Q2K {
                " (one Q2_K super-block); use page format q8_0 or nvfp4 for this model"
            } else {
                ""
            };
            return Err(invalid(format!(
                "page format {self}: d_model {d_model} is not a positive multiple of {step}{}{hint}",
                if max < usize::MAX {
                    format!(" up to {max}")
                } else {
                    String::new()
                }
            )));
        }
        Ok(())
    }

    /// `rows` rows of `d` in this format's split layout (its planes one
    /// after another), and the tensor scale (NVFP4; 0 for the others), from
    /// ggml rows of type `ty` as a GGUF stores them. Q8_0 rows into Q8_0
    /// pages and Q2_K rows into Q2_K pages keep their bytes; anything else
    /// is dequantized and quantized (NVFP4: the codec's requantization, one
    /// tensor scale for the whole matrix).
    pub fn encode_rows(
        self,
        ty: GgmlType,
        data: &[u8],
        rows: usize,
        d: usize,
        threads: usize,
    ) -> Result<(Vec<u8>, f32), PageError> {
        self.check_d_model(d)?;
        match self {
            PageFormat::Nvfp4 => {
                let dims = [d as u64, rows as u64];
                let t = Nvfp4Tensor::requantize_parallel(ty, data, &dims, threads)?;
                let mut v = t.packed;
                v.extend_from_slice(&t.block_scales);
                Ok((v, t.tensor_scale))
            }
            PageFormat::Q8_0 | PageFormat::Q2K => {
                let block = if self == PageFormat::Q8_0 {
                    GgmlType::Q8_0
                } else {
                    GgmlType::Q2_K
                };
                let ggml = if ty == block {
                    data.to_vec()
                } else {
                    let w = dequantize_parallel(ty, data, rows, d, threads)?;
                    quantize_rows(block, &w, d, threads)?
                };
                Ok((self.split_ggml(&ggml, rows, d)?, 0.0))
            }
        }
    }

    /// [`PageFormat::encode_rows`] of f32 rows (NVFP4: the codec's
    /// quantization of the whole matrix).
    pub fn encode_f32(
        self,
        values: &[f32],
        d: usize,
        threads: usize,
    ) -> Result<(Vec<u8>, f32), PageError> {
        self.check_d_model(d)?;
        if !values.len().is_multiple_of(d) {
            return Err(invalid(format!(
                "{} values are not rows of {d}",
                values.len()
            )));
        }
        let rows = values.len() / d;
        if self == PageFormat::Nvfp4 {
            let t = Nvfp4Tensor::quantize(values, &[d as u64, rows as u64])?;
            let mut v = t.packed;
            v.extend_from_slice(&t.block_scales);
            return Ok((v, t.tensor_scale));
        }
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.encode_rows(GgmlType::F32, &bytes, rows, d, threads)
    }

    /// Ggml rows of this format's block type (Q8_0, Q2_K) in its split
    /// layout.
    fn split_ggml(self, ggml: &[u8], rows: usize, d: usize) -> Result<Vec<u8>, PageError> {
        match self {
            PageFormat::Q8_0 => split_q8_0_rows(ggml, rows, d),
            PageFormat::Q2K => split_q2k_rows(ggml, rows, d),
            PageFormat::Nvfp4 => Err(invalid("NVFP4 has no ggml rows")),
        }
    }

    /// `rows` rows of the split layout `split` (tensor scale `ts`) as f32.
    pub fn decode_rows(
        self,
        split: &[u8],
        rows: usize,
        d: usize,
        ts: f32,
    ) -> Result<Vec<f32>, PageError> {
        let mut out = vec![0f32; rows * d];
        match self {
            PageFormat::Nvfp4 => {
                let (codes, scales) = split.split_at(rows * d / 2);
                quant::nvfp4::dequantize_into(ts, scales, codes, &mut out)?;
            }
            PageFormat::Q8_0 => {
                quant::dequantize(GgmlType::Q8_0, &join_q8_0_rows(split, rows, d)?, &mut out)?
            }
            PageFormat::Q2K => {
                quant::dequantize(GgmlType::Q2_K, &join_q2k_rows(split, rows, d)?, &mut out)?
            }
        }
        Ok(out)
    }
}

/// One layer's FFN as page-major pages of one format on the host: page `p`
/// holds channels `128 p .. 128 p + 127`; if `n_ff` is not a multiple of 128
/// the last page is padded with zero rows (those channels add nothing).
#[derive(Debug, Clone, PartialEq)]
pub struct Pages {
    format: PageFormat,
    d_model: usize,
    n_ff: usize,
    n_pages: usize,
    tensor_scales: [f32; 3],
    bytes: Vec<u8>,
}

impl Pages {
    /// Packs gate, up and down_t, each `n_ff` rows of `d_model` in the
    /// format's split layout with its tensor scale (`encode_rows`).
    pub fn from_split(
        format: PageFormat,
        d_model: usize,
        n_ff: usize,
        mats: [(&[u8], f32); 3],
    ) -> Result<Pages, PageError> {
        format.check_d_model(d_model)?;
        if n_ff == 0 {
            return Err(invalid("an FFN needs at least one channel"));
        }
        let widths = format.plane_widths(d_model);
        let row_bytes: usize = widths.iter().sum();
        for (name, (m, _)) in ["gate", "up", "down_t"].iter().zip(&mats) {
            if m.len() != n_ff * row_bytes {
                return Err(invalid(format!(
                    "{format} {name}: {n_ff} rows of {d_model} are {} bytes, got {}",
                    n_ff * row_bytes,
                    m.len()
                )));
            }
        }
        let n_pages = n_ff.div_ceil(PAGE_CHANNELS);
        let pb = format.page_bytes(d_model);
        let mut bytes = vec![0u8; n_pages * pb];
        for (p, page) in bytes.chunks_exact_mut(pb).enumerate() {
            let rows = p * PAGE_CHANNELS..((p + 1) * PAGE_CHANNELS).min(n_ff);
            let (mut at, mut plane_at) = (0, 0);
            for &w in &widths {
                for (m, _) in &mats {
                    let src = &m[plane_at + rows.start * w..plane_at + rows.end * w];
                    page[at..at + src.len()].copy_from_slice(src);
                    at += PAGE_CHANNELS * w;
                }
                plane_at += n_ff * w;
            }
        }
        Ok(Pages {
            format,
            d_model,
            n_ff,
            n_pages,
            tensor_scales: mats.map(|(_, ts)| ts),
            bytes,
        })
    }

    /// A layer's GGUF FFN matrices (`(type, bytes)` as the file stores them:
    /// gate and up `n_ff` rows of `d_model`, down `d_model` rows of `n_ff`)
    /// as pages, on up to `threads` threads: gate and up through
    /// `encode_rows`, down dequantized, transposed (`down_t`) and encoded
    /// (NVFP4: its tensor scale is that of requantizing `W_down` itself).
    pub fn from_gguf_parts(
        format: PageFormat,
        d_model: usize,
        n_ff: usize,
        gate: (GgmlType, &[u8]),
        up: (GgmlType, &[u8]),
        down: (GgmlType, &[u8]),
        threads: usize,
    ) -> Result<Pages, PageError> {
        format.check_d_model(d_model)?;
        let g = format.encode_rows(gate.0, gate.1, n_ff, d_model, threads)?;
        let u = format.encode_rows(up.0, up.1, n_ff, d_model, threads)?;
        // W_down is [d_model][n_ff]; down_t[c][r] = W_down[r][c].
        let t = dequantize_transposed(down.0, down.1, d_model, n_ff, threads)?;
        let t_bytes: Vec<u8> = t.iter().flat_map(|v| v.to_le_bytes()).collect();
        drop(t);
        let dt = format.encode_rows(GgmlType::F32, &t_bytes, n_ff, d_model, threads)?;
        Self::from_split(
            format,
            d_model,
            n_ff,
            [(&g.0, g.1), (&u.0, u.1), (&dt.0, dt.1)],
        )
    }

    /// f32 matrices of `n_ff` rows by `d_model` (gate, up and the transposed
    /// down, row-major), each encoded as a whole, as pages.
    pub fn from_f32(
        format: PageFormat,
        d_model: usize,
        gate: &[f32],
        up: &[f32],
        down_t: &[f32],
    ) -> Result<Pages, PageError> {
        format.check_d_model(d_model)?;
        let n = gate.len();
        if !n.is_multiple_of(d_model) || up.len() != n || down_t.len() != n {
            return Err(invalid(format!(
                "gate, up and down_t must be the same rows of {d_model}: {} / {} / {} values",
                gate.len(),
                up.len(),
                down_t.len()
            )));
        }
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let [g, u, dt] = [gate, up, down_t].map(|m| format.encode_f32(m, d_model, threads));
        let (g, u, dt) = (g?, u?, dt?);
        Self::from_split(
            format,
            d_model,
            n / d_model,
            [(&g.0, g.1), (&u.0, u.1), (&dt.0, dt.1)],
        )
    }

    /// NVFP4 pages of three codec tensors of `n_ff` rows by `d_model`
    /// (`dims = [d_model, n_ff]`): gate, up and the transposed down.
    pub fn from_nvfp4(
        gate: &Nvfp4Tensor,
        up: &Nvfp4Tensor,
        down_t: &Nvfp4Tensor,
    ) -> Result<Pages, PageError> {
        let (n_ff, d_model) = nvfp4_shape(gate)?;
        for t in [up, down_t] {
            if nvfp4_shape(t)? != (n_ff, d_model) {
                return Err(invalid(format!(
                    "NVFP4 matrices of {:?} and ({n_ff}, {d_model}) rows x cols",
                    nvfp4_shape(t)?
                )));
            }
        }
        let split = [gate, up, down_t].map(|t| [&t.packed[..], &t.block_scales[..]].concat());
        Self::from_split(
            PageFormat::Nvfp4,
            d_model,
            n_ff,
            [
                (&split[0], gate.tensor_scale),
                (&split[1], up.tensor_scale),
                (&split[2], down_t.tensor_scale),
            ],
        )
    }

    /// The pages of channels `perm` (stored channel `k` = this FFN's channel
    /// `perm[k]`; `perm.len()` a multiple of 128), tensor scales kept: each
    /// channel's row bytes are moved plane by plane, nothing is re-encoded.
    pub fn permuted(&self, perm: &[u32]) -> Result<Pages, PageError> {
        let n = perm.len();
        if n == 0 || !n.is_multiple_of(PAGE_CHANNELS) {
            return Err(invalid(format!(
                "a channel order of {n} channels is not whole pages of {PAGE_CHANNELS}"
            )));
        }
        let widths = self.format.plane_widths(self.d_model);
        let mut mats: [Vec<u8>; 3] = Default::default();
        for (m, out) in mats.iter_mut().enumerate() {
            for (s, &w) in widths.iter().enumerate() {
                // Plane s of matrix m starts at this offset within a page.
                let at =
                    3 * PAGE_CHANNELS * widths[..s].iter().sum::<usize>() + m * PAGE_CHANNELS * w;
                for &c in perm {
                    let c = c as usize;
                    if c >= self.n_ff {
                        return Err(invalid(format!(
                            "channel {c} is past the FFN's {} channels",
                            self.n_ff
                        )));
                    }
                    let row = at + (c % PAGE_CHANNELS) * w;
                    out.extend_from_slice(&self.page(c / PAGE_CHANNELS)[row..row + w]);
                }
            }
        }
        let ts = self.tensor_scales;
        Self::from_split(
            self.format,
            self.d_model,
            n,
            [(&mats[0], ts[0]), (&mats[1], ts[1]), (&mats[2], ts[2])],
        )
    }

    /// Decodes page `p`: gate, up and down_t, each `128 x d_model` f32
    /// row-major (padding rows decode to zeros).
    pub fn dequantize_page(&self, p: usize) -> Result<[Vec<f32>; 3], PageError> {
        let widths = self.format.plane_widths(self.d_model);
        let page = self.page(p);
        let mut out: [Vec<f32>; 3] = Default::default();
        for (m, dst) in out.iter_mut().enumerate() {
            let mut split = Vec::with_capacity(PAGE_CHANNELS * widths.iter().sum::<usize>());
            let mut at = 0;
            for &w in &widths {
                split.extend_from_slice(&page[at + m * PAGE_CHANNELS * w..][..PAGE_CHANNELS * w]);
                at += 3 * PAGE_CHANNELS * w;
            }
            *dst = self.format.decode_rows(
                &split,
                PAGE_CHANNELS,
                self.d_model,
                self.tensor_scales[m],
            )?;
        }
        Ok(out)
    }

    /// The encoding.
    pub fn format(&self) -> PageFormat {
        self.format
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
    /// Tensor scales of gate, up and down (NVFP4; 0 for the others).
    pub fn tensor_scales(&self) -> [f32; 3] {
        self.tensor_scales
    }
    /// All pages, page-major (`n_pages * page_bytes(d_model)` bytes).
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
    /// Page `p`'s bytes.
    pub fn page(&self, p: usize) -> &[u8] {
        let pb = self.format.page_bytes(self.d_model);
        &self.bytes[p * pb..(p + 1) * pb]
    }
}

/// Checks an NVFP4 tensor's shape and returns `(rows, cols)` (`dims[0]` is
/// the row length).
fn nvfp4_shape(t: &Nvfp4Tensor) -> Result<(usize, usize), PageError> {
    let cols = t.row_len();
    let n = t.n_elements();
    if cols == 0
        || !cols.is_multiple_of(16)
        || !n.is_multiple_of(cols)
        || t.block_scales.len() != n / 16
    {
        return Err(invalid(format!(
            "NVFP4 tensor with row length {cols}, {n} elements and {} block scales is not a matrix of 16-element blocks",
            t.block_scales.len()
        )));
    }
    if !(t.tensor_scale.is_finite() && t.tensor_scale >= 0.0) {
        return Err(invalid(format!(
            "NVFP4 tensor scale {} is not a finite non-negative number",
            t.tensor_scale
        )));
    }
    Ok((n / cols, cols))
}

/// Whole ggml blocks of `ty` regrouped field by field: each block is cut at
/// `fields` (byte lengths of its consecutive fields) and field `f` of every
/// block goes, block after block, to span `spans[f]` of the output (spans in
/// their own numbering, each `n_blocks * fields[f]` bytes); `bytes_of`
/// reorders a field's bytes as it is copied (`dst[i] = src[bytes_of(i)]`).
fn regroup(
    ty: GgmlType,
    ggml: &[u8],
    fields: &[usize],
    spans: &[usize],
    bytes_of: &dyn Fn(usize, usize) -> usize,
) -> Vec<u8> {
    let bytes = ty.type_size();
    let n = ggml.len() / bytes;
    let mut span_at = vec![0; fields.len()];
    let mut at = 0;
    for span in 0..fields.len() {
        let f = spans
            .iter()
            .position(|&s| s == span)
            .expect("a permutation");
        span_at[f] = at;
        at += n * fields[f];
    }
    let mut out = vec![0u8; n * bytes];
    for (b, blk) in ggml.chunks_exact(bytes).enumerate() {
        let mut off = 0;
        for (f, &len) in fields.iter().enumerate() {
            let dst = &mut out[span_at[f] + b * len..][..len];
            for (i, d) in dst.iter_mut().enumerate() {
                *d = blk[off + bytes_of(f, i)];
            }
            off += len;
        }
    }
    out
}

/// Checks that `data` is `rows` rows of `d` of `ty`.
fn check_rows(ty: GgmlType, data: &[u8], rows: usize, d: usize) -> Result<(), PageError> {
    let want = ty
        .bytes_for((rows * d) as u64)
        .filter(|_| d > 0 && d.is_multiple_of(ty.block_size()))
        .ok_or_else(|| {
            invalid(format!(
                "{ty} row length {d} is not a positive multiple of {}",
                ty.block_size()
            ))
        })?;
    if data.len() as u64 != want {
        return Err(invalid(format!(
            "{rows} {ty} rows of {d} need {want} bytes, got {}",
            data.len()
        )));
    }
    Ok(())
}

/// Splits `rows` ggml Q8_0 rows of `d` weights into the split-Q8_0 layout:
/// all quants, then all f16 scales.
pub fn split_q8_0_rows(ggml: &[u8], rows: usize, d: usize) -> Result<Vec<u8>, PageError> {
    check_rows(GgmlType::Q8_0, ggml, rows, d)?;
    Ok(regroup(GgmlType::Q8_0, ggml, &[2, 32], &[1, 0], &|_, i| i))
}

/// The inverse of [`split_q8_0_rows`]: ggml Q8_0 rows again.
fn join_q8_0_rows(split: &[u8], rows: usize, d: usize) -> Result<Vec<u8>, PageError> {
    check_rows(GgmlType::Q8_0, split, rows, d)?;
    let blocks = rows * d / 32;
    let (quants, scales) = split.split_at(rows * d);
    let mut out = vec![0u8; split.len()];
    for (b, block) in out.chunks_exact_mut(34).enumerate() {
        block[..2].copy_from_slice(&scales[2 * b..2 * b + 2]);
        block[2..].copy_from_slice(&quants[32 * b..32 * b + 32]);
    }
    debug_assert_eq!(out.len(), blocks * 34);
    Ok(out)
}

/// Where byte `i` (0..16) of a ggml `block_q2_K`'s `scales[16]` goes in the
/// split layout's 16 scale bytes of that block: `4 u + j` for
/// `i = 8 (u >> 1) + 2 j + (u & 1)` (quarter `u` of the block, bit pair `j`).
pub fn q2k_scale_slot(i: usize) -> usize {
    let (h, j, hi) = (i / 8, (i % 8) / 2, i % 2);
    4 * (2 * h + hi) + j
}

/// The scale byte of a ggml `block_q2_K` that split slot `s` holds (the
/// inverse of [`q2k_scale_slot`]).
fn q2k_slot_source(s: usize) -> usize {
    (0..16)
        .find(|&i| q2k_scale_slot(i) == s)
        .expect("a permutation")
}

/// Regroups `rows` ggml Q2_K rows of `d` weights into the split layout
/// `[quants rows x d/4][scales rows x d/16][dm rows x d/64]`: each block's
/// `qs[64]` verbatim, its `scales[16]` permuted ([`q2k_scale_slot`]), its
/// `d`/`dmin` pair as one u32.
pub fn split_q2k_rows(ggml: &[u8], rows: usize, d: usize) -> Result<Vec<u8>, PageError> {
    check_rows(GgmlType::Q2_K, ggml, rows, d)?;
    // Fields: scales[16], qs[64], d/dmin[4]; spans: quants, scales, dm.
    Ok(regroup(
        GgmlType::Q2_K,
        ggml,
        &[16, 64, 4],
        &[1, 0, 2],
        &|f, i| {
            if f == 0 {
                q2k_slot_source(i)
            } else {
                i
            }
        },
    ))
}

/// The inverse of [`split_q2k_rows`]: ggml Q2_K rows again.
pub fn join_q2k_rows(split: &[u8], rows: usize, d: usize) -> Result<Vec<u8>, PageError> {
    check_rows(GgmlType::Q2_K, split, rows, d)?;
    let blocks = rows * d / GgmlType::Q2_K.block_size();
    let (quants, rest) = split.split_at(blocks * 64);
    let (scales, dm) = rest.split_at(blocks * 16);
    let mut out = vec![0u8; split.len()];
    for (b, block) in out.chunks_exact_mut(GgmlType::Q2_K.type_size()).enumerate() {
        for i in 0..16 {
            block[i] = scales[16 * b + q2k_scale_slot(i)];
        }
        block[16..80].copy_from_slice(&quants[64 * b..64 * b + 64]);
        block[80..84].copy_from_slice(&dm[4 * b..4 * b + 4]);
    }
    Ok(out)
}

/// `values` (rows of `d`) quantized to ggml rows of `ty` on up to `threads`
/// threads (mirage-gguf's quantizer, row by row: the same bytes as one
/// call).
pub fn quantize_rows(
    ty: GgmlType,
    values: &[f32],
    d: usize,
    threads: usize,
) -> Result<Vec<u8>, PageError> {
    if d == 0 || !values.len().is_multiple_of(d) {
        return Err(invalid(format!(
            "{} values are not rows of {d}",
            values.len()
        )));
    }
    let rows = values.len() / d;
    let rb = quant::row_bytes(ty, d)?;
    let mut out = vec![0u8; rows * rb];
    let per = rows.div_ceil(threads.clamp(1, rows.max(1))).max(1);
    in_bands(values, per * d, &mut out, per * rb, |src, dst| {
        quant::quantize(ty, src, dst)
    })?;
    Ok(out)
}

/// `f(src band, dst band)` over matching bands of `src` (`src_band` items
/// each) and `dst` (`dst_band` each), one scoped thread a band; the first
/// error, or a thread's panic, is the caller's.
fn in_bands<S: Sync, D: Send, E: Send>(
    src: &[S],
    src_band: usize,
    dst: &mut [D],
    dst_band: usize,
    f: impl Fn(&[S], &mut [D]) -> Result<(), E> + Sync,
) -> Result<(), E> {
    std::thread::scope(|sc| {
        let f = &f;
        let jobs: Vec<_> = src
            .chunks(src_band)
            .zip(dst.chunks_mut(dst_band))
            .map(|(a, b)| sc.spawn(move || f(a, b)))
            .collect();
        jobs.into_iter()
            .try_for_each(|j| j.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
    })
}

/// A `rows x cols` ggml matrix dequantized to f32 on up to `threads`
/// threads (bands of whole rows), with its size checked against the type.
pub(crate) fn dequantize_parallel(
    ty: GgmlType,
    data: &[u8],
    rows: usize,
    cols: usize,
    threads: usize,
) -> Result<Vec<f32>, PageError> {
    check_rows(ty, data, rows, cols)?;
    let row_bytes = data.len() / rows.max(1);
    let band = rows.div_ceil(threads.clamp(1, rows.max(1))).max(1);
    let mut w = vec![0f32; rows * cols];
    if w.is_empty() {
        return Ok(w);
    }
    in_bands(data, band * row_bytes, &mut w, band * cols, |src, dst| {
        quant::dequantize(ty, src, dst)
    })?;
    Ok(w)
}

/// A `rows x cols` ggml matrix dequantized and transposed (`cols x rows`
/// f32, `t[c][r] = w[r][c]`), on up to `threads` threads
/// ([`dequantize_parallel`], then each thread writes a band of output rows
/// in 64 x 64 tiles, both sides in cache): the pages need W_down's columns
/// as rows.
pub(crate) fn dequantize_transposed(
    ty: GgmlType,
    data: &[u8],
    rows: usize,
    cols: usize,
    threads: usize,
) -> Result<Vec<f32>, PageError> {
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

#[cfg(test)]
mod tests {
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
            let q = quantize_rows(GgmlType::Q8_0, &w, cols, 3).unwrap();
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

    /// Every format's split layout goes back to the same rows, and the
    /// page sizes are the documented ones.
    #[test]
    fn split_layouts_round_trip_and_pages_have_their_sizes() {
        let d = 256;
        let w: Vec<f32> = (0..3 * d)
            .map(|i| ((i * 29 % 97) as f32 - 48.0) / 40.0)
            .collect();
        for ty in [GgmlType::Q8_0, GgmlType::Q2_K] {
            let rows = quantize_rows(ty, &w, d, 2).unwrap();
            let f = if ty == GgmlType::Q8_0 {
                PageFormat::Q8_0
            } else {
                PageFormat::Q2K
            };
            let split = f.split_ggml(&rows, 3, d).unwrap();
            let back = if ty == GgmlType::Q8_0 {
                join_q8_0_rows(&split, 3, d).unwrap()
            } else {
                join_q2k_rows(&split, 3, d).unwrap()
            };
            assert_eq!(back, rows, "{ty}");
        }
        assert_eq!(PageFormat::Q8_0.page_bytes(d), 408 * d);
        assert_eq!(PageFormat::Nvfp4.page_bytes(d), 216 * d);
        assert_eq!(PageFormat::Q2K.page_bytes(d), 126 * d);
        assert!(PageFormat::Q2K.check_d_model(896).is_err());
        assert!(PageFormat::Q8_0.check_d_model(896).is_ok());
        let mut slots: Vec<usize> = (0..16).map(q2k_scale_slot).collect();
        slots.sort_unstable();
        assert_eq!(slots, (0..16).collect::<Vec<_>>());
    }
}
