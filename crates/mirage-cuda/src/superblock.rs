//! The sparse path on the GPU: the fused superblock FFN over page-major
//! Q8_0 pages (`cuda/superblock.cu`) and the weight-only mat-vecs it is
//! measured against (split Q8_0 here, NVFP4 in [`crate::nvfp4`]).
//!
//! Issue #7's lesson is that a scattered sparse FFN loses to the dense one;
//! what can win is coarse 128-channel pages stored contiguously (page-major,
//! as `mirage_artifact::pack::pack_page` writes them), one fused kernel per
//! FFN and no host round trip. [`SparseDevice::ffn_q8`] is that kernel, one
//! cooperative launch: the active page ids and their count live in device
//! memory (a router kernel can write them); phase 1 computes every active
//! channel's gate and up rows and SwiGLU (h stays in L2), a grid barrier,
//! then phase 2 streams the down slices with each block owning 128 outputs
//! of a share of the channels, so an output receives a handful of block
//! partials (not one per page or per block). Those are added with atomics
//! into `y`, or deterministically: the last block to finish an output chunk
//! sums its partials in a fixed order.
//!
//! Device layout ("split Q8_0"): the ggml Q8_0 blocks of a matrix are split
//! into all quants first (`[rows][d]` int8, 4-byte aligned) and all f16 block
//! scales after (`[rows][d/32]`): the same 34 bytes per 32 weights, but a
//! warp's 32-bit loads cover whole 128-byte lines and each lane's float4 of x
//! is conflict-free in shared memory. A page is
//! `[gate q][up q][down_t q][gate scales][up scales][down_t scales]`, one
//! contiguous span (see the comment at the top of `cuda/superblock.cu`).
//!
//! NVFP4 pages (issue #8): [`Nvfp4Pages`] packs a layer's gate, up and
//! transposed down matrices with the CPU codec (from f32 or requantized from
//! the GGUF's matrices, one tensor scale per layer matrix) into
//! `[gate codes][up codes][down_t codes][gate scales][up scales][down_t scales]`
//! per page; [`SparseDevice::ffn_nvfp4`] runs `superblock_ffn_nvfp4` on them,
//! the same contract as the Q8_0 kernel, as one cooperative launch or as the
//! two phase launches a graph records ([`FfnLaunch`]).
//!
//! Faster versions of the Q8_0 kernel are variants of one CUDA template
//! (`superblock_ffn_q8s_v<n>`, listed in [`Q8_FFN_VARIANTS`]) that
//! [`SparseDevice::ffn_q8_with`] runs with a phase-2 part size
//! (`part_ch`) and either launch mode; `ffn_q8` keeps the first version.
//!
//! The host-side repacking ([`split_q8_0_rows`], [`split_q8_0_page`],
//! [`Nvfp4Pages`]) is plain Rust and builds without the `cuda` feature.

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

/// One variant of the fused Q8_0 FFN kernel: `superblock_ffn_q8s_v<index>`
/// in `cuda/superblock.cu` (the arguments of `superblock_ffn_q8s` plus an
/// `int part_ch` and the folded norm's three last), each at its own register
/// cap and occupancy (so each has its own grid).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Q8FfnVariant {
    /// `N` of `superblock_ffn_q8s_v<N>`.
    pub index: usize,
    /// The kernel's name.
    pub kernel: &'static str,
    /// What it changes against the first version (v0), in a few words.
    pub about: &'static str,
    /// The single-pass kernel (`sb_ffn_q8s_local`): each block reduces its
    /// own channels' down products into one d-wide partial, so the atomic
    /// reduction needs no second launch (its phase 2 does nothing) and may
    /// start from `y` as it is (`accumulate` false: the kernel zeroes `y`).
    /// `d_model` at most [`SINGLE_PASS_MAX_D`]; `part_ch` is ignored.
    pub single_pass: bool,
    /// The kernel reads the pages' down slice tiled ([`tile_q8s_down`]):
    /// its pages must be uploaded that way. `part_ch` and the reduction
    /// mode are ignored (the output is always reproducible).
    pub tiled_down: bool,
    /// Phase 2 is [`Q8S_C2_KERNEL`]: the split-K items finished inside a
    /// thread-block cluster (its own launch, clusters of
    /// [`q8s_c2_cluster`] blocks). `part_ch` is ignored; the ordered bits
    /// depend on the cluster size alone.
    pub cluster_down: bool,
}

/// Dynamic shared memory of the tiled variants' phase-2 launch
/// ([`Q8FfnVariant::tiled_down`]): `SB_T2_MAX_BATCHES` batch buffers of
/// `SB_T2_BATCH_BYTES` (cuda/superblock.cu), the copy engine's ring. With
/// less the kernel writes NaN.
pub const Q8S_T2_SMEM: usize = 8 * 4 * (32 * 128 + 2 * 128 + 4 * 128);

/// The kernel the tiled variants' phase 2 runs as (the variants' own
/// kernel does phase 1): [`Q8S_T2_THREADS`] threads a block,
/// [`Q8S_T2_SMEM`] bytes of dynamic shared memory, [`q8s_t2_grid`] blocks,
/// the variants' arguments.
pub const Q8S_T2_KERNEL: &str = "superblock_ffn_q8s_t2";

/// Threads of a [`Q8S_T2_KERNEL`] block (`SB_T2_THREADS`).
pub const Q8S_T2_THREADS: u32 = 1024;

/// Blocks of a [`Q8S_T2_KERNEL`] launch at `d_model`: one per row block of
/// R outputs, R = 32, 16 or 8, the largest that still gives 96 row blocks
/// (`SB_T2_MIN_BLOCKS`; the kernel's own rule, keep them in step). Any
/// grid gives the same bits; this one gives every block one row block.
pub fn q8s_t2_grid(d_model: usize) -> u32 {
    let r = if d_model / 32 >= 96 {
        32
    } else if d_model / 16 >= 96 {
        16
    } else {
        8
    };
    (d_model / r).max(1) as u32
}

/// The kernel the cluster-finished variants' phase 2 runs as
/// ([`Q8FfnVariant::cluster_down`]): the variants' arguments, 256 threads
/// a block, no dynamic shared memory, launched in clusters of K
/// blocks (grid = clusters x K).
pub const Q8S_C2_KERNEL: &str = "superblock_ffn_q8s_c2";

/// Most blocks a [`Q8S_C2_KERNEL`] cluster may have (`SB_C2_MAX_CLUSTER`:
/// the non-portable limit of the H100/H200; with more the kernel writes
/// NaN).
pub const Q8S_C2_MAX_CLUSTER: u32 = 16;

/// Cluster size K of a [`Q8S_C2_KERNEL`] launch at `d_model` when
/// `resident_blocks` blocks fit the device at once and its clusters may
/// have `max_cluster` blocks: the parts per output chunk v10 would use
/// (resident blocks / 128-wide output chunks), within 1..=`max_cluster`
/// (and [`Q8S_C2_MAX_CLUSTER`]). At the 7B shape on the H200 (396
/// resident, 28 chunks) K = 14, v10's split.
pub fn q8s_c2_cluster(d_model: usize, resident_blocks: u32, max_cluster: u32) -> u32 {
    let n_chunks = d_model.div_ceil(128).max(1) as u32;
    (resident_blocks / n_chunks).clamp(1, max_cluster.clamp(1, Q8S_C2_MAX_CLUSTER))
}

/// Widest `d_model` the single-pass variants take (`SB_LOCAL_MAX_D`: one
/// 16-output piece per thread).
pub const SINGLE_PASS_MAX_D: usize = 4096;

/// The fused Q8_0 FFN variants, in the order of `cuda/superblock.cu`'s
/// variant list (keep the two in step). v0 with `part_ch` 0 is
/// `superblock_ffn_q8s`, the first version, bit for bit.
pub const Q8_FFN_VARIANTS: [Q8FfnVariant; 16] = [
    q8v(
        0,
        "first version (4 B loads, grid-stride channels), 5 blocks/SM",
    ),
    q8v(1, "v0 + batched finish"),
    q8v(
        2,
        "16 B loads, p1 8 x 16 B a lane and row, p2 8 quads, 2 blocks/SM",
    ),
    q8v(3, "16 B, p1 4 x 16 B, p2 4 quads, 3 blocks/SM"),
    q8v(4, "16 B, p1 2 x 16 B, p2 4 quads, 4 blocks/SM"),
    q8v(5, "16 B, p1 1 x 16 B, p2 2 quads, 5 blocks/SM"),
    q8v(6, "v3 + phase 1 prefetches the down_t rows into L2"),
    q8v(7, "v4 + phase 1 prefetches the down_t rows into L2"),
    q8v(
        8,
        "single pass (block-local partial), 4 x 16 B, 2 blocks/SM",
    ),
    q8v(
        9,
        "single pass (block-local partial), 2 x 16 B, 3 blocks/SM",
    ),
    q8v(10, "v3 + balanced phase 1 (row rounds)"),
    q8v(11, "v4 + balanced phase 1 (row rounds)"),
    q8v(12, "v10 + p2 5 quads"),
    q8v(13, "v10 + p2 6 quads"),
    q8v(
        14,
        "v10 + p2 output-stationary over the tiled down slice (bulk copies)",
    ),
    q8v(15, "v10 + p2 ordered finish in a thread-block cluster"),
];

const fn q8v(index: usize, about: &'static str) -> Q8FfnVariant {
    const NAMES: [&str; 16] = [
        "superblock_ffn_q8s_v0",
        "superblock_ffn_q8s_v1",
        "superblock_ffn_q8s_v2",
        "superblock_ffn_q8s_v3",
        "superblock_ffn_q8s_v4",
        "superblock_ffn_q8s_v5",
        "superblock_ffn_q8s_v6",
        "superblock_ffn_q8s_v7",
        "superblock_ffn_q8s_v8",
        "superblock_ffn_q8s_v9",
        "superblock_ffn_q8s_v10",
        "superblock_ffn_q8s_v11",
        "superblock_ffn_q8s_v12",
        "superblock_ffn_q8s_v13",
        "superblock_ffn_q8s_v14",
        "superblock_ffn_q8s_v15",
    ];
    Q8FfnVariant {
        index,
        kernel: NAMES[index],
        about,
        single_pass: matches!(index, 8 | 9),
        tiled_down: index == 14,
        cluster_down: index == 15,
    }
}

/// Floats of the ordered reduction's partial buffer of the fused FFN
/// kernels (every kernel and variant, any `part_ch`) launched with `grid`
/// blocks at `d_model`: `grid * d_model` (the single-pass variants keep one
/// d-wide partial per block; the others use the first
/// `(grid / n_chunks) * d_model`, `n_chunks` the 128-wide output chunks).
pub fn ffn_partials_len(grid: u32, d_model: usize) -> usize {
    (grid as usize).max(1) * d_model
}

/// Rewrites the down slice of split-Q8_0 device pages ([`split_q8_0_page`]'s
/// layout, `pages` a whole number of them) in place into the tiled layout
/// the variants with [`Q8FfnVariant::tiled_down`] read: the down quants as
/// `[d_model][128]` (row o: output o's quant of each of the page's
/// channels) instead of `[128][d_model]`, and the down scales as
/// `[d_model / 32][128]` instead of `[128][d_model / 32]`. The same bytes,
/// transposed, so a range of outputs is one contiguous span of a page.
pub fn tile_q8s_down(pages: &mut [u8], d_model: usize) -> Result<(), SparseError> {
    let page_bytes = q8_0_page_bytes(d_model);
    if d_model == 0 || d_model % Q8_BLOCK != 0 || pages.len() % page_bytes != 0 {
        return Err(invalid(format!(
            "{} bytes are not whole split-Q8_0 pages of d_model {d_model}",
            pages.len()
        )));
    }
    let (q, groups) = (PAGE_CHANNELS * d_model, d_model / Q8_BLOCK);
    let s = PAGE_CHANNELS * groups * 2;
    let mut tmp = vec![0u8; q];
    for page in pages.chunks_exact_mut(page_bytes) {
        let down_q = &mut page[2 * q..3 * q];
        for (c, row) in down_q.chunks_exact(d_model).enumerate() {
            for (o, &b) in row.iter().enumerate() {
                tmp[o * PAGE_CHANNELS + c] = b;
            }
        }
        down_q.copy_from_slice(&tmp);
        let down_s = &mut page[3 * q + 2 * s..3 * q + 3 * s];
        let t = &mut tmp[..s];
        for c in 0..PAGE_CHANNELS {
            for g in 0..groups {
                let (from, to) = (2 * (c * groups + g), 2 * (g * PAGE_CHANNELS + c));
                t[to..to + 2].copy_from_slice(&down_s[from..from + 2]);
            }
        }
        down_s.copy_from_slice(t);
    }
    Ok(())
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

#[cfg(feature = "cuda")]
pub use device::*;

#[cfg(feature = "cuda")]
mod device {
    use std::sync::Arc;

    use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
    use cudarc::driver::{
        CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
    };

    use super::{
        ffn_partials_len, invalid, nvfp4_page_bytes, q8_0_page_bytes, split_q8_0_page,
        split_q8_0_rows, tile_q8s_down, Nvfp4Pages, SparseError, Q8_FFN_VARIANTS,
    };
    use super::{
        q8s_t2_grid, PAGE_CHANNELS, Q8S_C2_KERNEL, Q8S_T2_KERNEL, Q8S_T2_SMEM, Q8S_T2_THREADS,
        Q8_BLOCK, SINGLE_PASS_MAX_D,
    };
    use crate::cluster::{launch_ex, LaunchMode};
    use crate::{module, CudaError};

    /// Sources of the sparse-path module, compiled as one NVRTC unit
    /// (`nvfp4.cu` holds the decode helpers `superblock.cu` uses).
    pub const SPARSE_SOURCE: &str = concat!(
        include_str!("../../../cuda/pdl.cu"),
        "\n",
        include_str!("../../../cuda/norm.cu"),
        "\n",
        include_str!("../../../cuda/nvfp4.cu"),
        "\n",
        include_str!("../../../cuda/superblock.cu"),
        "\n",
        include_str!("../../../cuda/superblock_q2k.cu")
    );

    /// The kernels of [`SPARSE_SOURCE`] `SparseDevice::new` loads besides
    /// the `Q8_FFN_VARIANTS` (a change there belongs here too: the
    /// crate's `nvrtc_check` test compiles the source and looks for each).
    #[cfg(test)]
    pub(crate) const SPARSE_KERNELS: &[&str] = &[
        "matvec_nvfp4",
        "matvec_q8s",
        "superblock_ffn_q8s",
        "superblock_ffn_nvfp4",
        "superblock_ffn_q2k",
    ];

    /// Threads of the mat-vec and FFN blocks (`NV_WARPS`/`SB_WARPS` * 32).
    const BLOCK: u32 = 256;
    /// Rows per warp of the mat-vecs (`NV_ROWS`, and 4 in `matvec_q8s`).
    const ROWS_PER_BLOCK: usize = 8 * 4;

    pub(crate) fn drv(e: cudarc::driver::DriverError) -> SparseError {
        SparseError::Cuda(CudaError::Driver(e.to_string()))
    }

    /// How the fused FFN reduces page contributions into `y`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Reduction {
        /// Each busy block adds its sum into `y` with atomics (one launch;
        /// the float order, hence the last bits, vary from run to run).
        Atomic,
        /// Block partials go to a buffer and the last block to finish an
        /// output chunk adds them in part order (bit-reproducible for a given
        /// grid).
        Ordered,
    }

    /// How the fused FFN's two phases are launched.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum FfnLaunch {
        /// One cooperative launch, a grid barrier between the phases
        /// (`phases = 3`).
        Cooperative,
        /// Two ordinary launches with the same grid, phase 1 then phase 2
        /// (the kernel boundary is the barrier): what a captured CUDA graph
        /// runs.
        TwoLaunches,
        /// Phase 1 alone (gate, up, SwiGLU into the scratch's h), one
        /// ordinary launch: for timing a phase.
        Phase1Only,
        /// Phase 2 alone (down and the reduction into `y`) over the h that
        /// the last phase 1 on this scratch left, one ordinary launch: for
        /// timing a phase.
        Phase2Only,
    }

    /// Which fused Q8_0 FFN kernel [`SparseDevice::ffn_q8_with`] runs and
    /// how. The default is what [`SparseDevice::ffn_q8`] runs today: the
    /// first version (`superblock_ffn_q8s`), one cooperative launch.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct FfnQ8Options {
        /// `None`: `superblock_ffn_q8s`; `Some(n)`: variant `n` of
        /// [`Q8_FFN_VARIANTS`] (`superblock_ffn_q8s_v<n>`).
        pub variant: Option<usize>,
        /// Variants only: at least this many active channels per phase-2
        /// part, `K = min(grid / n_chunks, max(channels / part_ch, 1))`
        /// parts per 128-output chunk (read on the device from the active
        /// count); 0 keeps `K = grid / n_chunks`.
        pub part_ch: u32,
        /// One cooperative launch or the two phase launches of a graph.
        pub launch: FfnLaunch,
        /// Cluster-finished variants only: `Some((clusters, k))` launches
        /// phase 2 as that many clusters of `k` blocks instead of the
        /// pages' [`Q8Pages::cluster_shape`] (`k` at most what the device
        /// takes for the kernel).
        pub cluster: Option<(u32, u32)>,
    }

    impl Default for FfnQ8Options {
        fn default() -> FfnQ8Options {
            FfnQ8Options {
                variant: None,
                part_ch: 0,
                launch: FfnLaunch::Cooperative,
                cluster: None,
            }
        }
    }

    /// The sparse-path kernels on one device: context, stream, functions.
    pub struct SparseDevice {
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        matvec_nvfp4: CudaFunction,
        matvec_q8s: CudaFunction,
        ffn_q8s: CudaFunction,
        /// `superblock_ffn_q8s_v<n>`, in [`Q8_FFN_VARIANTS`] order.
        ffn_q8s_variants: Vec<CudaFunction>,
        ffn_q8s_t2: CudaFunction,
        ffn_q8s_c2: CudaFunction,
        ffn_nvfp4: CudaFunction,
        /// `superblock_ffn_q2k` (launched from `crate::superblock_q2k`).
        pub(crate) ffn_q2k: CudaFunction,
        multiprocessors: u32,
        max_dynamic_smem: usize,
        device_name: String,
    }

    impl std::fmt::Debug for SparseDevice {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "SparseDevice {{ device: {:?} }}", self.device_name)
        }
    }

    /// A split-Q8_0 matrix on the device.
    #[derive(Debug)]
    pub struct Q8sMatrix {
        rows: usize,
        cols: usize,
        data: CudaSlice<u8>,
    }

    impl Q8sMatrix {
        /// Output features.
        pub fn rows(&self) -> usize {
            self.rows
        }
        /// Input features.
        pub fn cols(&self) -> usize {
            self.cols
        }
        /// Bytes on the device (what one mat-vec reads).
        pub fn bytes(&self) -> usize {
            self.data.len()
        }
    }

    /// One layer's FFN as page-major split-Q8_0 pages on the device.
    #[derive(Debug)]
    pub struct Q8Pages {
        d_model: usize,
        n_pages: usize,
        page_bytes: usize,
        grid: u32,
        /// Grid of each variant (its own occupancy), [`Q8_FFN_VARIANTS`] order.
        variant_grids: Vec<u32>,
        /// Grid and cluster size of the cluster-finished phase 2
        /// ([`Q8S_C2_KERNEL`]) at this `d_model`.
        c2_shape: (u32, u32),
        data: CudaSlice<u8>,
        /// The same pages with the down slice tiled ([`tile_q8s_down`]),
        /// for the variants that read it that way; `None` when uploaded
        /// by [`SparseDevice::upload_q8s_pages`] (bench bytes: those
        /// variants then read `data`).
        tiled: Option<CudaSlice<u8>>,
    }

    impl Q8Pages {
        /// Model width.
        pub fn d_model(&self) -> usize {
            self.d_model
        }
        /// Pages stored.
        pub fn n_pages(&self) -> usize {
            self.n_pages
        }
        /// Bytes per page (what the kernel reads for each active page).
        pub fn page_bytes(&self) -> usize {
            self.page_bytes
        }
        /// Grid of the fused kernel: every block resident (it is launched
        /// cooperatively and has a grid barrier).
        pub fn grid(&self) -> u32 {
            self.grid
        }
        /// Grid of variant `v` of [`Q8_FFN_VARIANTS`] (its resident
        /// blocks at this `d_model`), `None` past the list.
        pub fn variant_grid(&self, v: usize) -> Option<u32> {
            self.variant_grids.get(v).copied()
        }
        /// Grid and cluster size of the cluster-finished variants' phase
        /// 2 ([`super::Q8FfnVariant::cluster_down`]) at this `d_model`.
        pub fn cluster_shape(&self) -> (u32, u32) {
            self.c2_shape
        }
    }

    /// One layer's FFN as page-major NVFP4 pages on the device
    /// ([`Nvfp4Pages`]' layout) with its three tensor scales.
    #[derive(Debug)]
    pub struct DeviceNvfp4Pages {
        d_model: usize,
        n_pages: usize,
        page_bytes: usize,
        tensor_scales: [f32; 3],
        grid: u32,
        data: CudaSlice<u8>,
    }

    impl DeviceNvfp4Pages {
        /// Model width.
        pub fn d_model(&self) -> usize {
            self.d_model
        }
        /// Pages stored.
        pub fn n_pages(&self) -> usize {
            self.n_pages
        }
        /// Bytes per page (what the kernel reads for each active page).
        pub fn page_bytes(&self) -> usize {
            self.page_bytes
        }
        /// Tensor scales of gate, up and down.
        pub fn tensor_scales(&self) -> [f32; 3] {
            self.tensor_scales
        }
        /// Grid of the fused kernel: every block resident.
        pub fn grid(&self) -> u32 {
            self.grid
        }
    }

    /// What one fused-FFN launch runs over (kernel, pages, shapes).
    pub(crate) struct FfnTarget<'a> {
        pub(crate) func: &'a CudaFunction,
        pub(crate) name: &'a str,
        pub(crate) data: &'a CudaSlice<u8>,
        pub(crate) page_bytes: usize,
        pub(crate) n_pages: usize,
        pub(crate) d: usize,
        pub(crate) grid: u32,
        /// NVFP4 only: the tensor scales (kernel arguments after `d`).
        pub(crate) tensor_scales: Option<[f32; 3]>,
        /// Q8_0 variants only: `part_ch` (the kernel argument after `phases`).
        pub(crate) part_ch: Option<i32>,
        /// A single-pass variant (`Q8FfnVariant::single_pass`).
        pub(crate) single_pass: bool,
        /// The tiled or cluster-finished variants' phase 2 (they cannot
        /// run as one cooperative launch); `None`: phase 2 is `func` again.
        pub(crate) phase2: Option<Phase2Kernel<'a>>,
    }

    /// A fused FFN's phase 2 that is a kernel of its own: the variants'
    /// arguments, its own launch shape.
    #[derive(Clone, Copy)]
    pub(crate) struct Phase2Kernel<'a> {
        pub(crate) func: &'a CudaFunction,
        pub(crate) name: &'static str,
        pub(crate) grid: u32,
        pub(crate) block: u32,
        pub(crate) smem: u32,
        /// Blocks per cluster (1: no cluster launch).
        pub(crate) cluster: u32,
    }

    /// Active page ids and their count, both in device memory.
    #[derive(Debug)]
    pub struct ActivePages {
        ids: CudaSlice<u32>,
        count: CudaSlice<i32>,
        capacity: usize,
    }

    impl ActivePages {
        /// Largest number of ids it holds.
        pub fn capacity(&self) -> usize {
            self.capacity
        }
        /// The id buffer, for a device-side router to write into.
        pub fn ids_mut(&mut self) -> &mut CudaSlice<u32> {
            &mut self.ids
        }
        /// The count (one i32), for a device-side router to write into.
        pub fn count_mut(&mut self) -> &mut CudaSlice<i32> {
            &mut self.count
        }
    }

    /// Scratch of the fused FFN: h of the active channels, the block
    /// partials and the barrier/arrival counters (self-resetting, so one
    /// scratch serves any number of launches on one stream).
    #[derive(Debug, Default)]
    pub struct FfnScratch {
        hbuf: Option<CudaSlice<f32>>,
        partials: Option<CudaSlice<f32>>,
        counters: Option<CudaSlice<u32>>,
    }

    impl SparseDevice {
        /// Opens device `ordinal` and compiles (or loads from the PTX cache)
        /// the sparse-path kernels. Typed errors when the driver, NVRTC or
        /// the device is missing.
        pub fn new(ordinal: usize) -> Result<SparseDevice, SparseError> {
            // SAFETY: only probes whether the shared library can be opened.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err(CudaError::DriverNotFound.into());
            }
            cudarc::driver::result::init().map_err(drv)?;
            let count = CudaContext::device_count().map_err(drv)?.max(0) as usize;
            if ordinal >= count {
                return Err(CudaError::NoDevice { ordinal, count }.into());
            }
            let ctx = CudaContext::new(ordinal).map_err(drv)?;
            // One stream: cudarc's cross-stream event tracking is overhead.
            // SAFETY: nothing has been allocated through this handle yet.
            unsafe { ctx.disable_event_tracking() };
            // A created stream, not the legacy default one, so that the
            // launches can be captured into a CUDA graph (kernel-bench times
            // the fused FFN's two phase launches in graphs, as the backend
            // runs them).
            let stream = ctx.new_stream().map_err(drv)?;
            let device_name = ctx.name().map_err(drv)?;
            let cc = ctx.compute_capability().map_err(drv)?;
            // The compile-time switches the sparse backend takes too
            // (MIRAGE_CUDA_*; module::with_env_defines), so kernel-bench
            // can time them.
            let (ptx, _) = module::ptx_for(
                "sparse",
                &module::with_env_defines(SPARSE_SOURCE),
                cc.0,
                cc.1,
            )?;
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
                .map_err(drv)?;
            let load = |n: &str| module.load_function(n).map_err(drv);
            let multiprocessors = ctx
                .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .map_err(drv)?
                .max(1) as u32;
            let optin_smem = ctx
                .attribute(
                    CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                )
                .map_err(drv)?
                .max(48 * 1024) as usize;
            // The attribute below caps dynamic shared memory at the opt-in
            // maximum minus the kernel's static shared memory (4 KiB for
            // the FFN's reduction tile): keep 8 KiB aside for it (kernels
            // with more static shared memory get less, below).
            let max_dynamic_smem = optin_smem - 8 * 1024;
            let dev = SparseDevice {
                matvec_nvfp4: load("matvec_nvfp4")?,
                matvec_q8s: load("matvec_q8s")?,
                ffn_q8s: load("superblock_ffn_q8s")?,
                ffn_q8s_variants: Q8_FFN_VARIANTS
                    .iter()
                    .map(|v| load(v.kernel))
                    .collect::<Result<_, _>>()?,
                ffn_nvfp4: load("superblock_ffn_nvfp4")?,
                ffn_q2k: load("superblock_ffn_q2k")?,
                ffn_q8s_t2: load(Q8S_T2_KERNEL)?,
                ffn_q8s_c2: load(Q8S_C2_KERNEL)?,
                ctx,
                stream,
                multiprocessors,
                max_dynamic_smem,
                device_name,
            };
            // x (and the FFN's accumulator) live in dynamic shared memory:
            // allow the device's opt-in maximum beyond the default 48 KiB.
            for f in [
                &dev.matvec_nvfp4,
                &dev.matvec_q8s,
                &dev.ffn_q8s,
                &dev.ffn_nvfp4,
                &dev.ffn_q2k,
                &dev.ffn_q8s_t2,
                &dev.ffn_q8s_c2,
            ]
            .into_iter()
            .chain(&dev.ffn_q8s_variants)
            {
                let static_smem = f.shared_size_bytes().map_err(drv)?.max(0) as usize;
                let allow = max_dynamic_smem.min(optin_smem.saturating_sub(static_smem));
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    allow as i32,
                )
                .map_err(drv)?;
            }
            Ok(dev)
        }

        /// The device's name.
        pub fn device_name(&self) -> &str {
            &self.device_name
        }
        /// Streaming multiprocessors.
        pub fn multiprocessors(&self) -> u32 {
            self.multiprocessors
        }
        /// The context (for events and allocations by callers).
        pub fn context(&self) -> &Arc<CudaContext> {
            &self.ctx
        }
        /// The stream every launch goes to.
        pub fn stream(&self) -> &Arc<CudaStream> {
            &self.stream
        }

        pub(crate) fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
            // Event tracking is off (one stream): the guard has nothing to do.
            let (p, _guard) = s.device_ptr(&self.stream);
            p
        }

        pub(crate) fn check_smem(&self, bytes: usize, what: &str) -> Result<(), SparseError> {
            if bytes > self.max_dynamic_smem {
                return Err(invalid(format!(
                    "{what} needs {bytes} bytes of shared memory, the device allows {}",
                    self.max_dynamic_smem
                )));
            }
            Ok(())
        }

        /// Grid of a row-looping mat-vec: enough blocks to cover the rows,
        /// at most a few per multiprocessor (each block stages x once).
        pub(crate) fn matvec_grid(&self, rows: usize) -> u32 {
            let need = rows.div_ceil(ROWS_PER_BLOCK).max(1);
            need.min(self.multiprocessors as usize * 8) as u32
        }

        /// Copies `v` to a new device buffer.
        pub fn upload_f32(&self, v: &[f32]) -> Result<CudaSlice<f32>, SparseError> {
            self.stream.clone_htod(v).map_err(drv)
        }

        /// Copies a device buffer back (synchronizes).
        pub fn download_f32(&self, v: &CudaSlice<f32>) -> Result<Vec<f32>, SparseError> {
            self.stream.clone_dtoh(v).map_err(drv)
        }

        /// Uploads `rows` ggml Q8_0 rows of `cols` weights as a split-Q8_0
        /// matrix.
        pub fn upload_q8s(
            &self,
            ggml: &[u8],
            rows: usize,
            cols: usize,
        ) -> Result<Q8sMatrix, SparseError> {
            if rows == 0 {
                return Err(invalid("a matrix needs at least one row"));
            }
            let split = split_q8_0_rows(ggml, rows, cols)?;
            let data = self.stream.clone_htod(&split).map_err(drv)?;
            Ok(Q8sMatrix { rows, cols, data })
        }

        /// `y = W x` for a split-Q8_0 matrix (`x`: `cols` floats, `y`: `rows`).
        pub fn matvec_q8s(
            &self,
            w: &Q8sMatrix,
            x: &CudaSlice<f32>,
            y: &mut CudaSlice<f32>,
        ) -> Result<(), SparseError> {
            if x.len() < w.cols || y.len() < w.rows {
                return Err(invalid(format!(
                    "matvec_q8s: x holds {}, y {}; the matrix is {}x{}",
                    x.len(),
                    y.len(),
                    w.rows,
                    w.cols
                )));
            }
            let smem = w.cols * 4;
            self.check_smem(smem, "matvec_q8s")?;
            let cfg = LaunchConfig {
                grid_dim: (self.matvec_grid(w.rows), 1, 1),
                block_dim: (BLOCK, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            let (pw, px, py) = (self.ptr(&w.data), self.ptr(x), self.ptr(y));
            let (rows, cols) = (w.rows as i32, w.cols as i32);
            let mut b = self.stream.launch_builder(&self.matvec_q8s);
            b.arg(&pw).arg(&rows).arg(&cols).arg(&px).arg(&py);
            // SAFETY: argument types and order match the kernel; buffer
            // lengths were checked above.
            unsafe { b.launch(cfg) }.map_err(drv)?;
            Ok(())
        }

        /// Uploads one layer's FFN pages (each in the artifact's
        /// `pack_page` layout, Q8_0, `d_model` wide) page-major.
        pub fn upload_q8_0_pages(
            &self,
            d_model: usize,
            pages: &[&[u8]],
        ) -> Result<Q8Pages, SparseError> {
            let split: Vec<Vec<u8>> = pages
                .iter()
                .map(|p| split_q8_0_page(p, d_model))
                .collect::<Result<_, _>>()?;
            let mut flat: Vec<u8> = split.concat();
            let mut up = self.upload_q8s_pages(d_model, pages.len(), &flat)?;
            tile_q8s_down(&mut flat, d_model)?;
            up.tiled = Some(self.stream.clone_htod(&flat).map_err(drv)?);
            Ok(up)
        }

        /// Uploads pages already in the device layout (`n_pages` spans of
        /// [`q8_0_page_bytes`] each): the bench fills them with random bytes.
        /// The variants with a tiled down slice read these same bytes (no
        /// tiled copy is made: for timing only).
        pub fn upload_q8s_pages(
            &self,
            d_model: usize,
            n_pages: usize,
            device_layout: &[u8],
        ) -> Result<Q8Pages, SparseError> {
            if d_model == 0 || d_model % Q8_BLOCK != 0 {
                return Err(invalid(format!(
                    "d_model {d_model} is not a positive multiple of {Q8_BLOCK}"
                )));
            }
            let page_bytes = q8_0_page_bytes(d_model);
            if n_pages == 0 || device_layout.len() != n_pages * page_bytes {
                return Err(invalid(format!(
                    "{n_pages} pages of {page_bytes} bytes expected, got {} bytes",
                    device_layout.len()
                )));
            }
            let grid = self.ffn_grid(&self.ffn_q8s, d_model)?;
            let variant_grids = self
                .ffn_q8s_variants
                .iter()
                .map(|f| self.ffn_grid(f, d_model))
                .collect::<Result<_, _>>()?;
            let c2_shape = crate::cluster::q8s_c2_shape(
                &self.ffn_q8s_c2,
                &self.stream,
                d_model,
                BLOCK,
                self.multiprocessors,
            )
            .map_err(drv)?;
            let data = self.stream.clone_htod(device_layout).map_err(drv)?;
            Ok(Q8Pages {
                d_model,
                n_pages,
                page_bytes,
                grid,
                variant_grids,
                c2_shape,
                data,
                tiled: None,
            })
        }

        /// The fused FFN's grid: every block resident (the cooperative launch
        /// needs it), `d_model * 4` bytes of dynamic shared memory each.
        pub(crate) fn ffn_grid(
            &self,
            f: &CudaFunction,
            d_model: usize,
        ) -> Result<u32, SparseError> {
            let smem = d_model * 4;
            self.check_smem(smem, "the fused FFN")?;
            let per_sm = f
                .occupancy_max_active_blocks_per_multiprocessor(BLOCK, smem, None)
                .map_err(drv)?
                .max(1);
            Ok(per_sm * self.multiprocessors)
        }

        /// Uploads one layer's NVFP4 pages (see [`Nvfp4Pages`]).
        pub fn upload_nvfp4_pages(
            &self,
            pages: &Nvfp4Pages,
        ) -> Result<DeviceNvfp4Pages, SparseError> {
            let d_model = pages.d_model();
            let page_bytes = nvfp4_page_bytes(d_model);
            if pages.n_pages() == 0 || pages.bytes().len() != pages.n_pages() * page_bytes {
                return Err(invalid(format!(
                    "{} NVFP4 pages of {page_bytes} bytes expected, got {} bytes",
                    pages.n_pages(),
                    pages.bytes().len()
                )));
            }
            let grid = self.ffn_grid(&self.ffn_nvfp4, d_model)?;
            let data = self.stream.clone_htod(pages.bytes()).map_err(drv)?;
            Ok(DeviceNvfp4Pages {
                d_model,
                n_pages: pages.n_pages(),
                page_bytes,
                tensor_scales: pages.tensor_scales(),
                grid,
                data,
            })
        }

        /// A device list of active pages holding `ids` (at most `capacity`).
        pub fn new_active(&self, ids: &[u32], capacity: usize) -> Result<ActivePages, SparseError> {
            let mut a = ActivePages {
                ids: self
                    .stream
                    .alloc_zeros::<u32>(capacity.max(1))
                    .map_err(drv)?,
                count: self.stream.alloc_zeros::<i32>(1).map_err(drv)?,
                capacity,
            };
            self.set_active(&mut a, ids)?;
            Ok(a)
        }

        /// Writes `ids` into the device list (host to device only).
        pub fn set_active(&self, a: &mut ActivePages, ids: &[u32]) -> Result<(), SparseError> {
            if ids.len() > a.capacity {
                return Err(invalid(format!(
                    "{} active pages exceed the list's capacity {}",
                    ids.len(),
                    a.capacity
                )));
            }
            if !ids.is_empty() {
                self.stream
                    .memcpy_htod(ids, &mut a.ids.slice_mut(0..ids.len()))
                    .map_err(drv)?;
            }
            let n = [ids.len() as i32];
            self.stream.memcpy_htod(&n, &mut a.count).map_err(drv)?;
            Ok(())
        }

        /// The fused sparse FFN: `y += FFN(x)` over the active pages
        /// (`Reduction::Atomic`, which always accumulates: zero `y` first or
        /// pass the residual), or `y = FFN(x)` / `y += FFN(x)`
        /// (`Reduction::Ordered` with `accumulate` false / true). Ids at or
        /// past `n_pages` contribute nothing. One cooperative launch.
        #[allow(clippy::too_many_arguments)]
        pub fn ffn_q8(
            &self,
            pages: &Q8Pages,
            x: &CudaSlice<f32>,
            active: &ActivePages,
            reduction: Reduction,
            accumulate: bool,
            scratch: &mut FfnScratch,
            y: &mut CudaSlice<f32>,
        ) -> Result<(), SparseError> {
            self.ffn_q8_with(
                pages,
                x,
                active,
                reduction,
                accumulate,
                FfnQ8Options::default(),
                scratch,
                y,
            )
        }

        /// [`SparseDevice::ffn_q8`] with a kernel variant, a phase-2 part
        /// size and a launch mode ([`FfnQ8Options`]; its default is
        /// `ffn_q8`). Each variant runs with its own grid
        /// ([`Q8Pages::variant_grid`]); the scratch grows to fit it.
        #[allow(clippy::too_many_arguments)]
        pub fn ffn_q8_with(
            &self,
            pages: &Q8Pages,
            x: &CudaSlice<f32>,
            active: &ActivePages,
            reduction: Reduction,
            accumulate: bool,
            opts: FfnQ8Options,
            scratch: &mut FfnScratch,
            y: &mut CudaSlice<f32>,
        ) -> Result<(), SparseError> {
            let (func, grid, part_ch) = match opts.variant {
                None => (&self.ffn_q8s, pages.grid, None),
                Some(v) => {
                    let (Some(f), Some(g)) = (self.ffn_q8s_variants.get(v), pages.variant_grid(v))
                    else {
                        return Err(invalid(format!(
                            "fused Q8_0 FFN variant {v} does not exist (0..{})",
                            Q8_FFN_VARIANTS.len()
                        )));
                    };
                    (f, g, Some(opts.part_ch.min(i32::MAX as u32) as i32))
                }
            };
            let tiled = opts.variant.is_some_and(|v| Q8_FFN_VARIANTS[v].tiled_down);
            let clustered = opts
                .variant
                .is_some_and(|v| Q8_FFN_VARIANTS[v].cluster_down);
            let d = pages.d_model;
            let phase2 = if tiled {
                Some(Phase2Kernel {
                    func: &self.ffn_q8s_t2,
                    name: Q8S_T2_KERNEL,
                    grid: q8s_t2_grid(d),
                    block: Q8S_T2_THREADS,
                    smem: Q8S_T2_SMEM as u32,
                    cluster: 1,
                })
            } else if clustered {
                let (grid, cluster) = match opts.cluster {
                    Some((clusters, k)) if clusters > 0 && k > 0 => (clusters * k, k),
                    Some(c) => {
                        return Err(invalid(format!(
                            "a cluster shape of {c:?} (clusters, k) launches nothing"
                        )))
                    }
                    None => pages.c2_shape,
                };
                Some(Phase2Kernel {
                    func: &self.ffn_q8s_c2,
                    name: Q8S_C2_KERNEL,
                    grid,
                    block: BLOCK,
                    smem: 0,
                    cluster,
                })
            } else {
                None
            };
            let target = FfnTarget {
                func,
                name: "ffn_q8",
                data: match (&pages.tiled, tiled) {
                    (Some(t), true) => t,
                    _ => &pages.data,
                },
                page_bytes: pages.page_bytes,
                n_pages: pages.n_pages,
                d: pages.d_model,
                grid,
                tensor_scales: None,
                part_ch,
                single_pass: opts.variant.is_some_and(|v| Q8_FFN_VARIANTS[v].single_pass),
                phase2,
            };
            self.launch_ffn(
                &target,
                x,
                active,
                reduction,
                accumulate,
                opts.launch,
                scratch,
                y,
            )
        }

        /// The fused sparse FFN over NVFP4 pages (`superblock_ffn_nvfp4`):
        /// the contract of [`SparseDevice::ffn_q8`], launched as one
        /// cooperative launch or as the two phase launches a CUDA graph
        /// records (`launch`).
        #[allow(clippy::too_many_arguments)]
        pub fn ffn_nvfp4(
            &self,
            pages: &DeviceNvfp4Pages,
            x: &CudaSlice<f32>,
            active: &ActivePages,
            reduction: Reduction,
            accumulate: bool,
            launch: FfnLaunch,
            scratch: &mut FfnScratch,
            y: &mut CudaSlice<f32>,
        ) -> Result<(), SparseError> {
            let target = FfnTarget {
                func: &self.ffn_nvfp4,
                name: "ffn_nvfp4",
                data: &pages.data,
                page_bytes: pages.page_bytes,
                n_pages: pages.n_pages,
                d: pages.d_model,
                grid: pages.grid,
                tensor_scales: Some(pages.tensor_scales),
                part_ch: None,
                single_pass: false,
                phase2: None,
            };
            self.launch_ffn(
                &target, x, active, reduction, accumulate, launch, scratch, y,
            )
        }

        /// Checks the buffers, grows the scratch and launches a fused FFN
        /// kernel (both kernels share the argument list but for the NVFP4
        /// tensor scales after `d`).
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn launch_ffn(
            &self,
            t: &FfnTarget<'_>,
            x: &CudaSlice<f32>,
            active: &ActivePages,
            reduction: Reduction,
            accumulate: bool,
            launch: FfnLaunch,
            scratch: &mut FfnScratch,
            y: &mut CudaSlice<f32>,
        ) -> Result<(), SparseError> {
            let d = t.d;
            if x.len() < d || y.len() < d {
                return Err(invalid(format!(
                    "{}: x holds {}, y {}; d_model is {d}",
                    t.name,
                    x.len(),
                    y.len()
                )));
            }
            if reduction == Reduction::Atomic && !accumulate && !t.single_pass {
                return Err(invalid(
                    "the atomic reduction adds into y: zero y and pass accumulate = true",
                ));
            }
            if t.single_pass && d > SINGLE_PASS_MAX_D {
                return Err(invalid(format!(
                    "{}: the single-pass kernels take d_model up to {SINGLE_PASS_MAX_D}, not {d}",
                    t.name
                )));
            }
            let grid = t.grid;
            let n_chunks = d.div_ceil(128);
            let grow_f32 =
                |slot: &mut Option<CudaSlice<f32>>, n: usize| -> Result<(), SparseError> {
                    if slot.as_ref().is_none_or(|s| s.len() < n) {
                        *slot = Some(self.stream.alloc_zeros::<f32>(n).map_err(drv)?);
                    }
                    Ok(())
                };
            grow_f32(&mut scratch.hbuf, active.capacity.max(1) * PAGE_CHANNELS)?;
            grow_f32(&mut scratch.partials, ffn_partials_len(grid, d))?;
            if scratch
                .counters
                .as_ref()
                .is_none_or(|s| s.len() < 2 + n_chunks)
            {
                scratch.counters = Some(self.stream.alloc_zeros::<u32>(2 + n_chunks).map_err(drv)?);
            }
            let ph = scratch.hbuf.as_ref().map_or(0, |p| self.ptr(p));
            let pp = scratch.partials.as_ref().map_or(0, |p| self.ptr(p));
            let pc = scratch.counters.as_ref().map_or(0, |p| self.ptr(p));
            let (pw, px, pa, pn, py) = (
                self.ptr(t.data),
                self.ptr(x),
                self.ptr(&active.ids),
                self.ptr(&active.count),
                self.ptr(y),
            );
            let page_bytes = t.page_bytes as i64;
            let n_pages = t.n_pages as i32;
            let d32 = d as i32;
            let cap = active.capacity as i32;
            let mode: i32 = match reduction {
                Reduction::Atomic => 0,
                Reduction::Ordered => 1,
            };
            let acc = accumulate as i32;
            let ts = t.tensor_scales.unwrap_or_default();
            if let (FfnLaunch::Cooperative, Some(p2)) = (launch, t.phase2) {
                return Err(invalid(format!(
                    "{}: this variant's phase 2 is its own kernel ({}): it cannot run as one cooperative launch",
                    t.name, p2.name
                )));
            }
            let launches: &[(i32, u32)] = match launch {
                FfnLaunch::Cooperative => &[(3, (d * 4) as u32)],
                // Phase 2 alone reads no x: no dynamic shared memory.
                FfnLaunch::TwoLaunches => &[(1, (d * 4) as u32), (2, 0)],
                FfnLaunch::Phase1Only => &[(1, (d * 4) as u32)],
                FfnLaunch::Phase2Only => &[(2, 0)],
            };
            // The variants' folded-norm arguments (nw, neps, nout): none.
            let (no_norm_w, no_norm_eps, no_norm_out) = (0u64, 0f32, 0u64);
            for (phases, smem) in launches {
                let (func, grid, block, smem, cluster) = match (t.phase2, *phases) {
                    (Some(p2), 2) => (p2.func, p2.grid, p2.block, p2.smem, p2.cluster),
                    _ => (t.func, grid, BLOCK, *smem, 1),
                };
                fn arg<T>(v: &T) -> *mut std::ffi::c_void {
                    v as *const T as *mut std::ffi::c_void
                }
                let mut params = vec![arg(&pw), arg(&page_bytes), arg(&n_pages), arg(&d32)];
                if t.tensor_scales.is_some() {
                    params.extend([arg(&ts[0]), arg(&ts[1]), arg(&ts[2])]);
                }
                params.extend([
                    arg(&px),
                    arg(&pa),
                    arg(&pn),
                    arg(&cap),
                    arg(&mode),
                    arg(&acc),
                    arg(&ph),
                    arg(&pp),
                    arg(&pc),
                    arg(&py),
                    arg(phases),
                ]);
                if let Some(pc) = &t.part_ch {
                    params.extend([
                        arg(pc),
                        arg(&no_norm_w),
                        arg(&no_norm_eps),
                        arg(&no_norm_out),
                    ]);
                }
                let how = LaunchMode {
                    cluster,
                    cooperative: launch == FfnLaunch::Cooperative,
                    ..LaunchMode::PLAIN
                };
                // SAFETY: `params` points at values that outlive the call,
                // in the kernel's argument order and types
                // (superblock_ffn_q8s, superblock_ffn_q8s_v<n> / _t2 / _c2
                // with part_ch and the null norm (nw, neps, nout) after
                // phases, superblock_ffn_q2k (q8s's arguments), or
                // superblock_ffn_nvfp4 with the three tensor scales after
                // d); x and y hold d floats, hbuf capacity * 128, partials
                // (grid / n_chunks) * d, counters 2 + n_chunks; the kernel
                // clamps the count to the capacity and skips ids >= n_pages.
                // The grid is the resident block count: the cooperative
                // launch (phases 3) refuses otherwise, so the grid barrier
                // cannot deadlock; the phase launches have no grid barrier;
                // a cluster grid is a multiple of its cluster (q8s_c2_shape).
                unsafe {
                    launch_ex(
                        func,
                        &self.stream,
                        (grid, 1, 1),
                        (block, 1, 1),
                        smem,
                        &mut params,
                        how,
                    )
                }
                .map_err(drv)?;
            }
            Ok(())
        }

        /// Launches `matvec_nvfp4` (see [`crate::nvfp4`]).
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn launch_matvec_nvfp4(
            &self,
            packed: u64,
            scales: u64,
            tensor_scale: f32,
            rows: usize,
            cols: usize,
            x: u64,
            y: u64,
        ) -> Result<(), SparseError> {
            let smem = cols * 4;
            self.check_smem(smem, "matvec_nvfp4")?;
            let cfg = LaunchConfig {
                grid_dim: (self.matvec_grid(rows), 1, 1),
                block_dim: (BLOCK, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            let (r, c) = (rows as i32, cols as i32);
            let mut b = self.stream.launch_builder(&self.matvec_nvfp4);
            b.arg(&packed)
                .arg(&scales)
                .arg(&tensor_scale)
                .arg(&r)
                .arg(&c)
                .arg(&x)
                .arg(&y);
            // SAFETY: the caller passes device pointers of the sizes the
            // shapes imply (checked in crate::nvfp4).
            unsafe { b.launch(cfg) }.map_err(drv)?;
            Ok(())
        }
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

    /// The cluster size follows v10's parts per chunk within the device's
    /// and the kernel's limits.
    #[test]
    fn c2_cluster_size_is_v10s_split_within_the_limits() {
        // 7B on the H200: 396 resident blocks, 28 chunks -> v10's K = 14.
        assert_eq!(q8s_c2_cluster(3584, 396, 16), 14);
        // Portable clusters only: 8.
        assert_eq!(q8s_c2_cluster(3584, 396, 8), 8);
        // 0.5B (7 chunks): 56 parts would do, the kernel reads 16.
        assert_eq!(q8s_c2_cluster(896, 396, 32), Q8S_C2_MAX_CLUSTER);
        // Fewer resident blocks than chunks, or no clusters: 1.
        assert_eq!(q8s_c2_cluster(3584, 20, 16), 1);
        assert_eq!(q8s_c2_cluster(3584, 396, 0), 1);
        assert_eq!(q8s_c2_cluster(96, 396, 3), 3);
        assert!(Q8_FFN_VARIANTS.iter().filter(|v| v.cluster_down).count() == 1);
        assert!(Q8_FFN_VARIANTS[15].cluster_down && !Q8_FFN_VARIANTS[15].tiled_down);
    }

    /// The tiled down slice holds every down weight of the split layout at
    /// its transposed place (a weight = quant times its block's scale, as
    /// the kernels read them), leaves gate and up as they were, and rejects
    /// bytes that are not whole pages.
    #[test]
    fn tiled_down_slice_is_the_split_one_transposed() {
        for d in [32usize, 96, 896] {
            let n = 3;
            let pb = q8_0_page_bytes(d);
            let split: Vec<u8> = (0..n * pb).map(|i| (i * 131 % 251) as u8).collect();
            let mut tiled = split.clone();
            tile_q8s_down(&mut tiled, d).unwrap();
            let (q, g) = (PAGE_CHANNELS * d, d / Q8_BLOCK);
            let s = PAGE_CHANNELS * g * 2;
            for p in 0..n {
                let (a, b) = (&split[p * pb..(p + 1) * pb], &tiled[p * pb..(p + 1) * pb]);
                assert_eq!(
                    a[..2 * q],
                    b[..2 * q],
                    "d {d} page {p}: gate/up quants moved"
                );
                assert_eq!(
                    a[3 * q..3 * q + 2 * s],
                    b[3 * q..3 * q + 2 * s],
                    "d {d} page {p}: gate/up scales moved"
                );
                for c in 0..PAGE_CHANNELS {
                    for o in 0..d {
                        assert_eq!(
                            a[2 * q + c * d + o],
                            b[2 * q + o * PAGE_CHANNELS + c],
                            "d {d} page {p} ch {c} out {o}"
                        );
                        let sa = 3 * q + 2 * s + 2 * (c * g + o / Q8_BLOCK);
                        let sb = 3 * q + 2 * s + 2 * ((o / Q8_BLOCK) * PAGE_CHANNELS + c);
                        assert_eq!(
                            a[sa..sa + 2],
                            b[sb..sb + 2],
                            "d {d} page {p} ch {c} scale of out {o}"
                        );
                    }
                }
            }
        }
        let mut short = vec![0u8; q8_0_page_bytes(96) - 1];
        assert!(tile_q8s_down(&mut short, 96).is_err());
        assert!(tile_q8s_down(&mut [], 0).is_err());
    }
}
