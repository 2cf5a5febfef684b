//! [`CudaBackend`]: the runtime's [`Backend`] on one CUDA device.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::cublas::CudaBlas;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr};
use mirage_gguf::quant;
use mirage_gguf::GgmlType;
use mirage_runtime::backend::{
    AttentionParams, Backend, HostMatrix, QkNorm, StepInputs, TokenSlot,
};
use mirage_runtime::kv_cache::{KvDtype, KvSpec};
use mirage_runtime::kv_pages::KvPruning;
use mirage_runtime::ops::RopeMode;
use mirage_runtime::{Result, RuntimeError};

use crate::{
    module, CudaError, GraphStats, MatvecGrid, MemoryStats, PrefetchSites, PreloadParts,
    WeightFormat,
};

/// Whether switch `key` is set to `1` / `on` (a start-up setting that is
/// off unless asked for).
fn env_on(key: &str) -> bool {
    std::env::var(key).is_ok_and(|v| v == "1" || v == "on")
}

/// Whether switch `key` is set to `0` / `off` (a start-up setting that is
/// on unless turned off).
fn env_off(key: &str) -> bool {
    std::env::var(key).is_ok_and(|v| v == "0" || v == "off")
}

fn drv(e: cudarc::driver::DriverError) -> RuntimeError {
    CudaError::Driver(e.to_string()).into()
}

fn bad(msg: impl Into<String>) -> RuntimeError {
    RuntimeError::InvalidArgument(msg.into())
}

/// Types with a split layout.
const REPACKABLE: &[GgmlType] = &[
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_0,
    GgmlType::Q6_K,
];

fn repack_bit(ty: GgmlType) -> u32 {
    REPACKABLE
        .iter()
        .position(|&t| t == ty)
        .map_or(0, |i| 1 << i)
}

/// `MIRAGE_CUDA_SPLIT`: comma-separated type names (`q8_0,q4_k,q5_0`), or
/// `none`; unknown names are ignored.
fn repack_mask_from_names(v: &str) -> u32 {
    v.split(',')
        .filter_map(|n| {
            REPACKABLE
                .iter()
                .find(|t| t.to_string().eq_ignore_ascii_case(n.trim()))
        })
        .fold(0, |m, &t| m | repack_bit(t))
}

/// Ggml Q6_K super-blocks (210 bytes: ql 128, qh 64, scales 16, f16 d) in
/// the split layout: every ql, then every qh, then every scales, then every d.
fn split_q6_k_rows(ggml: &[u8]) -> Vec<u8> {
    let n = ggml.len() / 210;
    let mut out = vec![0u8; n * 210];
    let (ql, rest) = out.split_at_mut(n * 128);
    let (qh, rest) = rest.split_at_mut(n * 64);
    let (sc, d) = rest.split_at_mut(n * 16);
    for (i, blk) in ggml.chunks_exact(210).enumerate() {
        ql[i * 128..(i + 1) * 128].copy_from_slice(&blk[..128]);
        qh[i * 64..(i + 1) * 64].copy_from_slice(&blk[128..192]);
        sc[i * 16..(i + 1) * 16].copy_from_slice(&blk[192..208]);
        d[i * 2..(i + 1) * 2].copy_from_slice(&blk[208..]);
    }
    out
}

/// Ggml Q5_0 blocks (22 bytes: f16 d, 32-bit qh, 16 quant bytes) in the
/// split layout: every block's quants, then every qh word, then every d.
fn split_q5_0_rows(ggml: &[u8]) -> Vec<u8> {
    let n = ggml.len() / 22;
    let mut out = vec![0u8; n * 22];
    let (qs, rest) = out.split_at_mut(n * 16);
    let (qh, d) = rest.split_at_mut(n * 4);
    for (i, blk) in ggml.chunks_exact(22).enumerate() {
        d[i * 2..i * 2 + 2].copy_from_slice(&blk[..2]);
        qh[i * 4..i * 4 + 4].copy_from_slice(&blk[2..6]);
        qs[i * 16..i * 16 + 16].copy_from_slice(&blk[6..]);
    }
    out
}

/// Ggml Q4_K rows (whole 144-byte super-blocks) in the split layout: every
/// super-block's 128 quant bytes in order, then every super-block's 16
/// header bytes (d, dmin, packed scales) in order. Row r's quants start at
/// `r * cols / 2`, its headers at `rows * cols / 2 + r * cols / 16`.
fn split_q4_k_rows(ggml: &[u8]) -> Vec<u8> {
    let n = ggml.len() / 144;
    let mut out = vec![0u8; n * 144];
    let (qs, head) = out.split_at_mut(n * 128);
    for (i, blk) in ggml.chunks_exact(144).enumerate() {
        qs[i * 128..(i + 1) * 128].copy_from_slice(&blk[16..]);
        head[i * 16..(i + 1) * 16].copy_from_slice(&blk[..16]);
    }
    out
}

/// Kernel-name suffix of a weight type the mat-vec and embedding kernels
/// read; `None` for types they do not (yet) decode.
fn kernel_suffix(ty: GgmlType) -> Option<&'static str> {
    use GgmlType::*;
    Some(match ty {
        F32 => "f32",
        F16 => "f16",
        BF16 => "bf16",
        Q4_0 => "q4_0",
        Q4_1 => "q4_1",
        Q5_0 => "q5_0",
        Q5_1 => "q5_1",
        Q8_0 => "q8_0",
        Q2_K => "q2_k",
        Q3_K => "q3_k",
        Q4_K => "q4_k",
        Q5_K => "q5_k",
        Q6_K => "q6_k",
        Q8_1 | Q8_K => return None,
    })
}

const SUFFIXES: &[&str] = &[
    "f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k",
    "q6_k",
];
/// Kernel-name suffixes of the repacked layouts (fast path only).
const REPACKED_SUFFIXES: &[&str] = &["q8_0s", "q4_ks", "q5_0s", "q6_ks", "nvfp4"];
const OTHER_KERNELS: &[&str] = &[
    "embed_q8_0s",
    "embed_q4_ks",
    "embed_q5_0s",
    "embed_q6_ks",
    "embed_nvfp4",
    "dequant_f16_q8_0s",
    "dequant_f16_q4_ks",
    "dequant_f16_q5_0s",
    "dequant_f16_q6_ks",
    "dequant_f16_nvfp4",
    "rms_norm",
    "add_bias",
    "add_inplace",
    "swiglu",
    "gather_rows",
    "rope_store_f32",
    "rope_store_f16",
    "attend_part_f32",
    "attend_part_f16",
    "attend_prefill_f32",
    "attend_prefill_f16",
    "attend_combine",
    "attend_fused_f32",
    "attend_fused_f16",
    "attend_rope_f32",
    "attn_block_q8s_f32",
    "attn_block_q8s_f16",
    "attend_rope_pre_f32",
    "attend_rope_pre_f16",
    "attend_rope_f16",
    "argmax_rows",
    "f32_to_f16",
    "page_bounds_f32",
    "page_bounds_f16",
    "page_bounds_rows_f32",
    "page_bounds_rows_f16",
    "page_keys",
    "select_pages",
    "attend_pages_part_f32",
    "attend_pages_part_f16",
    "attend_pages_combine",
    "l2_prefetch",
];

/// Every kernel of the dense module (`module::DENSE_SOURCE`) the backend
/// loads, by name. Built once per backend (the names are leaked: the
/// backend's index keys are `&'static str`).
pub(crate) fn kernel_names() -> Vec<&'static str> {
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    SUFFIXES
        .iter()
        .flat_map(|s| {
            [
                leak(format!("matvec_{s}")),
                leak(format!("embed_{s}")),
                leak(format!("dequant_f16_{s}")),
            ]
        })
        .chain(
            SUFFIXES
                .iter()
                .chain(REPACKED_SUFFIXES)
                .flat_map(|s| [leak(format!("mv3_{s}")), leak(format!("ffn_{s}"))]),
        )
        .chain(REPACKED_SUFFIXES.iter().flat_map(|s| {
            SPLIT_K[1..]
                .iter()
                .map(move |k| leak(format!("mv3_{s}_k{k}")))
        }))
        .chain(VARIANT_SUFFIXES.iter().flat_map(|s| {
            (2..2 + VARIANT_ROWS.len()).flat_map(move |v| {
                [leak(format!("ffn_{s}_v{v}"))]
                    .into_iter()
                    .chain(SPLIT_K.iter().map(move |&k| {
                        leak(if k == 1 {
                            format!("mv3_{s}_v{v}")
                        } else {
                            format!("mv3_{s}_v{v}_k{k}")
                        })
                    }))
            })
        }))
        // v2's split Q8_0 mat-vecs with the preload (v2p) and on a
        // persistent grid (v2g), at every split.
        .chain(["v2p", "v2g"].into_iter().flat_map(|v| {
            ["", "_k2", "_k4", "_k8"].map(move |k| leak(format!("mv3_q8_0s_{v}{k}")))
        }))
        .chain([leak("ffn_q8_0s_v2p".to_string())])
        .chain(OTHER_KERNELS.iter().copied())
        .collect()
}

/// u32 counters of the attention block kernel's buffer (`ATTB_SYNC` =
/// n_head + 2 n_head_kv + 2 of them a launch; layers run one after another,
/// so one buffer serves all).
const ATTN_BLOCK_SYNC_WORDS: usize = 1024;

/// Threads of an `l2_prefetch` block.
const PREFETCH_THREADS: u32 = 256;

/// Threads of an attention block (`ATT_THREADS` in dense.cu): the largest
/// head_dim the kernel takes.
const ATTEND_THREADS: u32 = 256;

/// An attention block plan with what the driver reports for the kernel it
/// loaded: registers a thread and static shared memory (the JIT's answer,
/// which the occupancy follows, may differ from an offline ptxas's).
#[derive(Debug, Clone, Copy)]
struct AttnBlockPlanned {
    plan: crate::attn_block::AttnBlockPlan,
    regs: i32,
    static_smem: usize,
}

/// Keys per attention split the host plans for at least: the splits of a
/// cache are `n_ctx / this` (capped by `ATTEND_TARGET_BLOCKS`), and the
/// kernels spread each row's positions over them (dense.cu's `att_chunk`,
/// whose floor `MIRAGE_ATT_MIN_KEYS` is the same number). 16 by default;
/// `MIRAGE_CUDA_ATT_KEYS=n` sets both, and `0` restores the previous
/// schedule (64 here, fixed chunks in the kernels) for A/B runs.
fn attend_min_chunk() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| match module::attention_min_keys_setting() {
        Some(0) => 64,
        Some(n) => n,
        None => 16,
    })
}

/// Attention splits are added while the grid has fewer blocks than this (so
/// that a decode step of a few heads still fills the device); a prefill of
/// many rows gets one split per (row, head).
const ATTEND_TARGET_BLOCKS: usize = 1024;

/// Batches of at most this many rows are recorded and replayed as a CUDA
/// graph (decode steps); larger ones (prefill) launch op by op.
const GRAPH_MAX_ROWS: usize = 16;

/// Query rows per block of the tiled prefill attention (`PF_ROWS`), its
/// threads per block (`PF_THREADS`) and the largest head size it takes
/// (`PF_MAX_HD`; a multiple of 16), in cuda/dense.cu.
const PREFILL_ROWS: usize = 16;
const PREFILL_THREADS: u32 = 256;
const PREFILL_MAX_HEAD_DIM: usize = 128;

/// Recorded graphs kept (e.g. decode at two batch sizes, or two sessions).
const GRAPH_CACHE: usize = 4;

/// Batches of more rows than this multiply through cuBLAS on tensor cores
/// (weights dequantized to f16 tile by tile); smaller ones use the mat-vec.
const GEMM_MIN_ROWS: usize = 17;

/// Bytes of the f16 weight tile of the GEMM path (bounds its workspace).
const GEMM_TILE_BYTES: usize = 32 << 20;

/// Warps (weight rows) per mat-vec thread block.
const MATVEC_WARPS: u32 = 8;

/// Arguments of an `mv3_*` launch (`MV3_PARAMS` in dense.cu); the last four
/// (`nx, nw, neps, nout`) fold a pending RMSNorm into it.
pub(crate) const MV3_ARGS: usize = 23;

/// Arguments of an `ffn_*` launch (`FFN_PARAMS`), the last four as above.
pub(crate) const FFN_ARGS: usize = 13;
/// Arguments of `attn_block_q8s_*` (`ATTB_PARAMS` in dense.cu), and the
/// positions of O's rows, the residual stream and the tail norm's three.
pub(crate) const ATTN_BLOCK_ARGS: usize = 47;
const ATTB_COLS: usize = 6;
const ATTB_ROWS_O: usize = 35;
const ATTB_RES: usize = 39;
const ATTB_TAIL_NORM: usize = 41;

/// Widest row a norm can be folded into the next mat-vec (its normalized
/// row sits in shared memory, under the 48 KiB a launch gets without
/// opting in, with the kernels' static reduction buffer).
const FUSED_NORM_MAX_WIDTH: usize = 10 * 1024;

/// Warps per block of the fast-path kernels (`FAST_WARPS` in dense.cu).
const FAST_WARPS: usize = 8;

/// Weight rows per warp of the repacked-layout kernels (`FAST_ROWS`).
const FAST_ROWS: usize = 4;

/// Column splits of the split-K repacked mat-vecs (`mv3_<suffix>_k<S>` in
/// dense.cu; 1 is the one-warp-per-row kernel).
const SPLIT_K: [usize; 4] = [1, 2, 4, 8];

/// The split-K rule picks the smallest split whose grid has at least this
/// many blocks per SM (a single block of 8 warps per SM leaves too few
/// loads in flight to stream a matrix at the copy rate).
const SPLIT_K_BLOCKS_PER_SM: usize = 3;

/// Shortest column slice (elements) a split-K warp is given.
const SPLIT_K_MIN_SLICE: usize = 128;

/// Layouts with mat-vec variants (`mv3_<suffix>_v<N>[_k<S>]`,
/// `ffn_<suffix>_v<N>` in dense.cu; `MIRAGE_CUDA_MV`, `set_matvec_variant`).
const VARIANT_SUFFIXES: &[&str] = &["q8_0s", "q4_ks"];

/// Default mat-vec variant of the split Q8_0 / Q4_K layouts: v2 (16-byte
/// loads, 4 rows per warp). Chosen from the H200 run of 2026-12-03
/// (`scripts/h200-matvec.sh`, docs/BENCHMARKS.md): whole-model decode of the
/// 7B shape, two passes, v1 / v2 / v3 / v4 / v5 = 197-199 / 227-228 /
/// 186-187 / 198-209 / 192-193 tok/s (Q8_0) and 150-151 / 236-241 / 188-193
/// / 187-192 / 202 tok/s (Q4_K).
const DEFAULT_MATVEC_VARIANT: usize = 2;

/// Weight rows per warp of mat-vec variant N at index N - 2 (v2..v5:
/// `MVV<N>_NR` in dense.cu); v1 is the default kernels (`FAST_ROWS`).
const VARIANT_ROWS: [usize; 4] = [4, 2, 2, 2];

/// How a matrix's bytes are laid out on the device.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Layout {
    /// The file's ggml blocks.
    Ggml,
    /// Split Q8_0: all quants `[rows][cols]`, then all f16 scales (see
    /// `superblock::split_q8_0_rows`).
    Q8Split,
    /// Split Q4_K: all super-blocks' 128 quant bytes `[rows][cols/2]`, then
    /// their 16 header bytes (d, dmin, packed scales) `[rows][cols/256][16]`.
    Q4KSplit,
    /// Split Q5_0: all blocks' 16 quant bytes `[rows][cols/2]`, then their
    /// 32-bit high-bit words `[rows][cols/32]`, then their f16 scales.
    Q5Split,
    /// Split Q6_K: all super-blocks' 128 ql bytes `[rows][cols/2]`, then
    /// their 64 qh bytes, then their 16 scales, then their f16 d.
    Q6KSplit,
    /// NVFP4 (the CPU codec's): packed codes `[rows][cols/2]`, then E4M3
    /// scales `[rows][cols/16]`, and this tensor scale.
    Nvfp4 { tensor_scale: f32 },
}

/// A weight matrix on the device, in its ggml encoding.
#[derive(Debug)]
pub struct CudaMatrix {
    name: String,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    layout: Layout,
    data: CudaSlice<u8>,
}

impl CudaMatrix {
    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Element type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }
    /// Whether the matrix was requantized to NVFP4 at upload.
    pub fn is_nvfp4(&self) -> bool {
        matches!(self.layout, Layout::Nvfp4 { .. })
    }
    /// Whether the matrix sits in a repacked layout (split Q8_0 or NVFP4)
    /// that only the fast-path kernels read.
    pub fn is_repacked(&self) -> bool {
        self.layout != Layout::Ggml
    }
    /// Suffix of the fast-path kernels (`mv3_*`, `ffn_*`) that read it.
    fn fast_suffix(&self) -> Option<&'static str> {
        match self.layout {
            Layout::Ggml => kernel_suffix(self.ty),
            Layout::Q8Split => Some("q8_0s"),
            Layout::Q4KSplit => Some("q4_ks"),
            Layout::Q5Split => Some("q5_0s"),
            Layout::Q6KSplit => Some("q6_ks"),
            Layout::Nvfp4 { .. } => Some("nvfp4"),
        }
    }
    /// Weight rows per block of the fast-path mat-vec.
    fn fast_rows_per_block(&self) -> usize {
        match self.layout {
            Layout::Ggml => FAST_WARPS,
            _ => FAST_WARPS * FAST_ROWS,
        }
    }
    fn tensor_scale(&self) -> f32 {
        match self.layout {
            Layout::Nvfp4 { tensor_scale } => tensor_scale,
            _ => 0.0,
        }
    }
}

/// An f32 vector on the device.
#[derive(Debug)]
pub struct CudaVector {
    len: usize,
    data: CudaSlice<f32>,
}

/// One layer's FFN on the device.
#[derive(Debug)]
pub struct CudaFfn {
    gate: CudaMatrix,
    up: CudaMatrix,
    down: CudaMatrix,
}

/// A `[rows, width]` f32 buffer on the device, reused across steps (it only
/// grows).
#[derive(Debug, Default)]
pub struct CudaActivations {
    rows: usize,
    width: usize,
    buf: Option<CudaSlice<f32>>,
}

impl CudaActivations {
    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Row width.
    pub fn width(&self) -> usize {
        self.width
    }
}

/// The KV cache on the device: per layer, `[n_seq, n_head_kv, n_ctx,
/// head_dim]` keys and values, f32 or f16 (`spec.dtype`), and, for a cache
/// made by `new_kv_cache_pruned(spec, Some(..))`, the page key boxes its
/// decode attention chooses pages by.
#[derive(Debug)]
pub struct CudaKvCache {
    spec: KvSpec,
    k: Vec<CudaSlice<u8>>,
    v: Vec<CudaSlice<u8>>,
    pages: Option<KvPageBoxes>,
}

impl CudaKvCache {
    /// The page selection its decode attention uses, if any (`None` also
    /// while [`Backend::kv_set_pruning`] has switched it off).
    pub fn kv_pruning(&self) -> Option<&KvPruning> {
        self.pages.as_ref().filter(|p| p.active).map(|p| &p.cfg)
    }
}

/// Per-layer page boxes of a pruned cache: kmin / kmax `[n_seq, n_head_kv,
/// max_pages, head_dim]` f32 (attention_pruned.cu). A box is rewritten from
/// the cached keys every time a step writes a position of its page, so it
/// always covers exactly the positions `0..=pos` of the row that reads it
/// (the CPU's `PageSummaries` after the same writes and truncations).
/// Boxes are refreshed whether or not the selection is `active`, so
/// switching it back on (`Backend::kv_set_pruning`) is exact.
#[derive(Debug)]
struct KvPageBoxes {
    cfg: KvPruning,
    /// Whether decode rows attend the selected pages (`false`: every
    /// position, boxes still maintained).
    active: bool,
    max_pages: usize,
    kmin: Vec<CudaSlice<f32>>,
    kmax: Vec<CudaSlice<f32>>,
}

#[derive(Default)]
struct Scratch {
    gate: CudaActivations,
    up: CudaActivations,
    hidden: CudaActivations,
    /// Attention split partials `[rows, n_head, n_split, head_dim + 2]`.
    attn_part: CudaActivations,
    /// `attend_fused`'s arrival counters, one per (row, head); zero between
    /// launches.
    attn_count: Option<CudaSlice<u32>>,
    /// The attention block kernel's counters (`ATTN_BLOCK_SYNC_WORDS`, zero
    /// between launches); allocated once, so recorded graphs keep it.
    attn_sync: Option<CudaSlice<u32>>,
    /// Last uploaded token slots (seq, pos pairs) and their device copy:
    /// every layer of a step passes the same slots (ops outside a step).
    slots_host: Vec<i32>,
    slots_dev: Option<CudaSlice<i32>>,
    indices: Option<CudaSlice<u32>>,
    /// f16 copies of a GEMM's activations and of one weight tile.
    gemm_x: Option<CudaSlice<u16>>,
    gemm_w: Option<CudaSlice<u16>>,
    /// Pruned attention: page keys `[rows, n_head, max_pages]`, chosen pages
    /// `[rows, n_head, max_sel]`, their counts, split partials.
    prune_keys: Option<CudaSlice<u32>>,
    prune_sel: Option<CudaSlice<i32>>,
    prune_nsel: Option<CudaSlice<i32>>,
    prune_part: Option<CudaSlice<f32>>,
}

/// One kernel argument, kept by value so that a recorded step can be
/// compared with the next one and launched later.
#[derive(Debug, Clone, Copy)]
enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

impl PartialEq for Arg {
    fn eq(&self, other: &Arg) -> bool {
        match (self, other) {
            (Arg::Ptr(a), Arg::Ptr(b)) => a == b,
            (Arg::I32(a), Arg::I32(b)) => a == b,
            (Arg::I64(a), Arg::I64(b)) => a == b,
            // Bit equality: the graph must launch exactly these bits.
            (Arg::F32(a), Arg::F32(b)) => a.to_bits() == b.to_bits(),
            _ => false,
        }
    }
}

/// One kernel launch: kernel index, grid, block, dynamic shared memory, args.
#[derive(Debug, Clone, PartialEq)]
struct Launch {
    kernel: usize,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    smem: u32,
    args: Vec<Arg>,
    /// A cooperative launch (the cooperative launch attribute: every block
    /// resident, so the kernel may have a grid barrier); never programmatic.
    cooperative: bool,
    /// Blocks per thread-block cluster along x (1: no cluster launch).
    cluster: u32,
}

/// How [`CudaBackend::launch_how`] launches beyond grid, block and
/// arguments (the default: an ordinary launch).
#[derive(Debug, Clone, Copy, Default)]
struct LaunchHow {
    /// Cooperatively (every block resident).
    cooperative: bool,
    /// Blocks per thread-block cluster along x (0 or 1: none).
    cluster: u32,
    /// Whose fold setting lets a pending RMSNorm fold into this launch
    /// (`None`: the kernel's own; e.g. the router's for a routed FFN whose
    /// router is skipped).
    fold: Option<NormFoldGate>,
}

/// A captured step and the launches it replays.
struct RecordedGraph {
    launches: Vec<Launch>,
    graph: CudaGraph,
}

// SAFETY: a CUDA graph may be used from any thread as long as calls on it are
// serialised; it lives inside `CudaBackend::step_state`'s mutex.
unsafe impl Send for RecordedGraph {}

/// Inputs of the step in progress, already on the device at `base`: token
/// ids at `base`, (seq, pos) pairs at `base + 4 n`, logits rows at
/// `base + 12 n` (i32 each).
struct Staged {
    tokens: Vec<u32>,
    slots: Vec<TokenSlot>,
    rows: Vec<usize>,
    base: u64,
}

#[derive(Default)]
struct StepState {
    staged: Option<Staged>,
    /// Launches of the step in progress when it is being recorded.
    recording: Option<Vec<Launch>>,
    host: Vec<i32>,
    inputs_dev: Option<CudaSlice<i32>>,
    /// Most recently used first.
    graphs: Vec<RecordedGraph>,
    stats: GraphStats,
    /// An RMSNorm of the step being recorded that was not launched: the
    /// next launch folds it in when it is a fast mat-vec reading its
    /// output, else it is launched first.
    pending_norm: Option<PendingNorm>,
    /// Weight regions `(address, bytes)` the runtime said a later op reads
    /// (`Backend::prefetch`), waiting for the op that issues them
    /// (`CudaBackend::emit_prefetch`).
    pending_prefetch: Vec<(u64, usize)>,
}

/// One of [`PrefetchSites`]: which op is issuing the pending regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PrefetchSite {
    Attention,
    Ffn,
}

/// Argument positions of a kernel that can take the RMSNorm before it
/// (`add_function`): `x` its input (replaced by the norm's input), `width`
/// the row width (an `I32` that must equal the norm's), `nw` the first of
/// three arguments `(weights, eps, out)` that are null/0 when not folded.
/// Such a kernel takes one row. `gate`: the switch that allows the fold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NormSlots {
    pub(crate) x: usize,
    pub(crate) width: usize,
    pub(crate) nw: usize,
    pub(crate) gate: NormFoldGate,
}

/// Which switch allows folding the RMSNorm into a kernel with `NormSlots`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NormFoldGate {
    /// The fused sparse FFN (`MIRAGE_SPARSE_FOLD_NORM=1`, off by default).
    SparseFfn,
    /// The router before a routed sparse FFN (`MIRAGE_SPARSE_ROUTE_NORM=0`
    /// turns it off; on by default).
    Router,
}

/// `out = rms_norm(x) * w` over `rows` rows of `width`, not yet launched.
#[derive(Debug, Clone, Copy)]
struct PendingNorm {
    x: u64,
    w: u64,
    eps: f32,
    rows: usize,
    width: usize,
    out: u64,
}

impl PendingNorm {
    fn launch(&self, kernel: usize) -> Launch {
        Launch {
            kernel,
            grid: (self.rows as u32, 1, 1),
            block: (256, 1, 1),
            smem: 0,
            cooperative: false,
            cluster: 1,
            args: vec![
                Arg::Ptr(self.x),
                Arg::Ptr(self.w),
                Arg::F32(self.eps),
                Arg::I32(self.width as i32),
                Arg::Ptr(self.out),
            ],
        }
    }
}

/// Folds `pn` into `l` through `slots` (one row, the norm's output is
/// `l`'s input, same width, nothing folded yet): `l` then reads the norm's
/// input and normalizes it itself, writing the norm's output as well.
fn fold_norm_at(slots: NormSlots, pn: &PendingNorm, l: &mut Launch) -> bool {
    let last = slots.x.max(slots.width).max(slots.nw + 2);
    if pn.rows != 1
        || l.args.len() <= last
        || l.args[slots.x] != Arg::Ptr(pn.out)
        || l.args[slots.width] != Arg::I32(pn.width as i32)
        || l.args[slots.nw] != Arg::Ptr(0)
    {
        return false;
    }
    l.args[slots.x] = Arg::Ptr(pn.x);
    l.args[slots.nw] = Arg::Ptr(pn.w);
    l.args[slots.nw + 1] = Arg::F32(pn.eps);
    l.args[slots.nw + 2] = Arg::Ptr(pn.out);
    true
}

/// The CUDA backend: one device, one stream, kernels compiled by NVRTC.
///
/// A forward pass of at most `GRAPH_MAX_ROWS` rows (a decode step) run
/// through [`Backend::step`] is recorded (every launch with its arguments,
/// nothing launched) and compared with the passes captured before: the same
/// launches replay that CUDA graph, new ones are captured into a new graph.
/// Per-token inputs (token ids, (seq, pos) slots, logits rows) are copied
/// once per step into a fixed device buffer that the kernels read, and the
/// attention grid depends on the cache size only, so a decode step at any
/// position is the same graph. Larger passes (prefill) launch op by op and
/// multiply through cuBLAS on tensor cores.
pub struct CudaBackend {
    // First, so that recorded graphs are destroyed before the module whose
    // kernels they launch is unloaded.
    step_state: Mutex<StepState>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: Vec<CudaFunction>,
    /// Whether each entry of `functions` waits on its prerequisite grid
    /// (`module::waits_on_prerequisite`): only those are launched with
    /// programmatic stream serialization.
    waits: Vec<bool>,
    /// Per entry of `functions`: `(accumulate, y)` argument positions of a
    /// kernel whose output can take the residual add (`y = sum + y` when
    /// accumulate is 1: the sparse backend's fused FFN), for
    /// `fold_epilogue`; `None` for the others (mat-vecs fold through their
    /// own `res` argument).
    accumulate_slots: Vec<Option<(usize, usize)>>,
    /// Per entry of `functions`: where a kernel added after start takes a
    /// folded RMSNorm (`NormSlots`; the sparse backend's fused Q8_0 FFN
    /// variants), for `fold_norm`; `None` for the others (the dense module's
    /// mat-vecs are known by name).
    norm_slots: Vec<Option<NormSlots>>,
    /// Fold the RMSNorm before a sparse FFN into its phase 1
    /// (`MIRAGE_SPARSE_FOLD_NORM=1` at start; off by default until measured
    /// on a GPU).
    fold_ffn_norm: std::sync::atomic::AtomicBool,
    /// Fold the RMSNorm before a routed sparse FFN into the router's launch
    /// (`route_bvh`; `MIRAGE_SPARSE_ROUTE_NORM=0` at start turns it off).
    fold_route_norm: std::sync::atomic::AtomicBool,
    /// Decode attention as one launch (`attend_fused_*`, default;
    /// `MIRAGE_CUDA_ATTN_FUSE=0` turns it off at start, `set_fused_attention`)
    /// or as `attend_part_*` + `attend_combine`.
    fused_attention: std::sync::atomic::AtomicBool,
    /// Decode rows' RoPE and KV store folded into the one-launch attention
    /// (`attend_rope_*`, default; `MIRAGE_CUDA_ROPE_FUSE=0` at start or
    /// `set_rope_in_attention(false)` keeps `rope_store_*` as its own launch).
    rope_in_attention: std::sync::atomic::AtomicBool,
    /// Q/K/V, the decode attention and O of a one-row recorded step as one
    /// launch (`attn_block_q8s_*`, `fuse_attention_blocks`;
    /// `MIRAGE_CUDA_ATTN_BLOCK=1` at start, `set_attention_block`). Off by
    /// default: measured slower at the 7B shape (NOTES, seventeenth session).
    attention_block: std::sync::atomic::AtomicBool,
    /// Whether the attention block's plan may copy O rows ahead
    /// (`MIRAGE_CUDA_ATTN_BLOCK_COPY=0` at start: no, so the grid is the
    /// blocks resident at the vector's shared memory alone: an A/B of
    /// occupancy against copying).
    attention_block_copy: bool,
    /// The attention block kernels' launch plans by kernel (index into
    /// `functions`: the f16 and f32 cache kernels differ in registers and
    /// static shared memory, and each needs its own dynamic shared memory
    /// attribute set) and shape; a driver occupancy query each, asked once.
    attention_block_plans:
        Mutex<HashMap<(usize, crate::attn_block::AttnBlockShape), AttnBlockPlanned>>,
    /// Largest dynamic shared memory a block may opt into.
    max_dynamic_smem: usize,
    /// Most blocks of an attention block launch (0: as many as fit).
    attention_block_grid: std::sync::atomic::AtomicUsize,
    /// Whether the residual add after a sparse FFN folds into the FFN's
    /// last phase in a recorded step (`MIRAGE_SPARSE_FOLD_ADD=0` at start
    /// keeps the separate `add_inplace`).
    fold_ffn_add: bool,
    /// Programmatic dependent launch on (sm_90+, default; `MIRAGE_CUDA_PDL=0`
    /// turns it off at start, `set_pdl`).
    pdl: std::sync::atomic::AtomicBool,
    /// `PrefetchSites::bits` of the cross-op weight prefetch.
    cross_prefetch: std::sync::atomic::AtomicU8,
    /// `PreloadParts::bits`: which kernels read what does not depend on
    /// the previous kernel before their PDL wait (the v2 split Q8_0
    /// mat-vecs and FFN gate/up `*_v2p`, the decode attention
    /// `attend_rope_pre_*`). `MIRAGE_CUDA_PRELOAD` at start, `set_preload`.
    preload: std::sync::atomic::AtomicU8,
    /// `MatvecGrid::bits`: when the v2 split Q8_0 mat-vecs run on a
    /// persistent grid (`mv3_*_v2g*`, `mv3_grid` in dense.cu).
    /// `MIRAGE_CUDA_MV_GRID` at start, `set_matvec_grid`.
    matvec_grid: std::sync::atomic::AtomicU8,
    /// L2 bytes of the device: one prefetch launch asks for at most half.
    l2_bytes: usize,
    /// Kernel name of each entry of `functions`.
    functions_names: Vec<&'static str>,
    kernel_index: HashMap<&'static str, usize>,
    blas: Option<CudaBlas>,
    device_name: String,
    compute_capability: (i32, i32),
    ptx_from_cache: bool,
    graphs_enabled: std::sync::atomic::AtomicBool,
    gemm_enabled: std::sync::atomic::AtomicBool,
    gemm_tile_bytes: std::sync::atomic::AtomicUsize,
    fast_decode: std::sync::atomic::AtomicBool,
    fuse_norm: std::sync::atomic::AtomicBool,
    /// Bit set of the types repacked to a split layout at upload
    /// (`repack_bit`).
    repacked_types: std::sync::atomic::AtomicU32,
    nvfp4_weights: std::sync::atomic::AtomicBool,
    /// Streaming multiprocessors of the device (the split-K rule's target).
    sm_count: usize,
    /// `resident_blocks` answers by (kernel index, threads).
    resident: Mutex<HashMap<(usize, u32), usize>>,
    /// Column split of the repacked mat-vecs: 0 = by the rule, else forced
    /// (`MIRAGE_CUDA_SPLITK` at start, `set_split_k`).
    split_k: std::sync::atomic::AtomicUsize,
    /// Mat-vec variant of the split Q8_0 / Q4_K layouts: 1 = the first
    /// kernels, 2..=5 = `mv3_<suffix>_v<N>` (`MIRAGE_CUDA_MV` at start,
    /// `set_matvec_variant`; default `DEFAULT_MATVEC_VARIANT`).
    matvec_variant: std::sync::atomic::AtomicUsize,
    /// Prefill batches of one sequence's consecutive positions attend
    /// through the tiled kernel (`attend_prefill_*`, default) or row by row
    /// like decode (`MIRAGE_CUDA_PREFILL_ATTN=0`, `set_tiled_prefill_attention`).
    tiled_prefill: std::sync::atomic::AtomicBool,
    scratch: Mutex<Scratch>,
    mem: Mutex<MemoryStats>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaBackend {{ device: {:?}, sm_{}{} }}",
            self.device_name, self.compute_capability.0, self.compute_capability.1
        )
    }
}

enum MemKind {
    Weights,
    Kv,
    Workspace,
}

impl CudaBackend {
    /// Opens device `ordinal`: loads the driver, compiles (or loads from the
    /// cache) the kernels. Typed errors when the driver, NVRTC or the device
    /// is missing.
    pub fn new(ordinal: usize) -> Result<CudaBackend, CudaError> {
        // SAFETY: only probes whether the shared library can be opened; the
        // calls below would panic inside cudarc without it.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::DriverNotFound);
        }
        let d = |e: cudarc::driver::DriverError| CudaError::Driver(e.to_string());
        cudarc::driver::result::init().map_err(d)?;
        let count = CudaContext::device_count().map_err(d)?.max(0) as usize;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(d)?;
        // One stream, so the per-slice events cudarc records for
        // cross-stream safety are pure overhead.
        // SAFETY: nothing has been allocated on this context yet.
        unsafe { ctx.disable_event_tracking() };
        // A stream of its own: the legacy default stream cannot be captured.
        let stream = ctx.new_stream().map_err(d)?;
        let device_name = ctx.name().map_err(d)?;
        let cc = ctx.compute_capability().map_err(d)?;
        let sm_count = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(d)?
            .max(1) as usize;
        let l2_bytes = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
            .map_err(d)?
            .max(0) as usize;
        let max_dynamic_smem = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(d)?
            .max(0) as usize;
        let source = module::with_env_defines(module::DENSE_SOURCE);
        let (ptx, ptx_from_cache) = module::ptx_for("dense", &source, cc.0, cc.1)?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx.clone()))
            .map_err(d)?;
        let mut functions = Vec::new();
        let mut waits = Vec::new();
        let mut accumulate_slots = Vec::new();
        let mut norm_slots = Vec::new();
        let mut kernel_index = HashMap::new();
        let names = kernel_names();
        for &name in &names {
            kernel_index.insert(name, functions.len());
            functions.push(module.load_function(name).map_err(d)?);
            waits.push(module::waits_on_prerequisite(&ptx, name));
            accumulate_slots.push(None);
            norm_slots.push(None);
        }
        // cuBLAS is optional: without the library prefill uses the mat-vec.
        // SAFETY: only probes whether the shared library can be opened.
        let blas = if unsafe { cudarc::cublas::sys::is_culib_present() } {
            CudaBlas::new(stream.clone()).ok()
        } else {
            None
        };
        Ok(CudaBackend {
            ctx,
            stream,
            functions,
            waits,
            accumulate_slots,
            norm_slots,
            fold_ffn_norm: env_on("MIRAGE_SPARSE_FOLD_NORM").into(),
            fold_route_norm: (!env_off("MIRAGE_SPARSE_ROUTE_NORM")).into(),
            pdl: (cc.0 >= 9 && !env_off("MIRAGE_CUDA_PDL")).into(),
            cross_prefetch: PrefetchSites::from_env().bits().into(),
            preload: PreloadParts::from_env()
                .unwrap_or(PreloadParts::NONE)
                .bits()
                .into(),
            matvec_grid: MatvecGrid::from_env().bits().into(),
            l2_bytes,
            fused_attention: (!env_off("MIRAGE_CUDA_ATTN_FUSE")).into(),
            rope_in_attention: (!env_off("MIRAGE_CUDA_ROPE_FUSE")).into(),
            attention_block: crate::attn_block::attention_block_at_start().into(),
            attention_block_copy: !env_off("MIRAGE_CUDA_ATTN_BLOCK_COPY"),
            attention_block_plans: Mutex::new(HashMap::new()),
            max_dynamic_smem,
            attention_block_grid: 0.into(),
            fold_ffn_add: !env_off("MIRAGE_SPARSE_FOLD_ADD"),
            functions_names: names,
            kernel_index,
            gemm_enabled: (!env_off("MIRAGE_CUDA_GEMM") && blas.is_some()).into(),
            gemm_tile_bytes: GEMM_TILE_BYTES.into(),
            blas,
            device_name,
            compute_capability: cc,
            ptx_from_cache,
            graphs_enabled: (!env_off("MIRAGE_CUDA_GRAPHS")).into(),
            fast_decode: (!env_off("MIRAGE_CUDA_FAST")).into(),
            fuse_norm: (!env_off("MIRAGE_CUDA_FUSE_NORM")).into(),
            repacked_types: std::env::var("MIRAGE_CUDA_SPLIT")
                .map_or(REPACKABLE.iter().fold(0, |m, &t| m | repack_bit(t)), |v| {
                    repack_mask_from_names(&v)
                })
                .into(),
            nvfp4_weights: std::env::var("MIRAGE_CUDA_WEIGHTS")
                .is_ok_and(|v| v.eq_ignore_ascii_case("nvfp4"))
                .into(),
            sm_count,
            resident: Mutex::new(HashMap::new()),
            split_k: std::env::var("MIRAGE_CUDA_SPLITK")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .filter(|k| SPLIT_K.contains(k))
                .unwrap_or(0)
                .into(),
            matvec_variant: std::env::var("MIRAGE_CUDA_MV")
                .ok()
                .and_then(|v| v.trim_start_matches(['v', 'V']).parse::<usize>().ok())
                .filter(|v| (1..=1 + VARIANT_ROWS.len()).contains(v))
                .unwrap_or(DEFAULT_MATVEC_VARIANT)
                .into(),
            tiled_prefill: (std::env::var("MIRAGE_CUDA_PREFILL_ATTN").as_deref() != Ok("0")).into(),
            scratch: Mutex::new(Scratch::default()),
            step_state: Mutex::new(StepState::default()),
            mem: Mutex::new(MemoryStats::default()),
        })
    }

    /// Records decode steps as CUDA graphs (default; `MIRAGE_CUDA_GRAPHS=0`
    /// turns it off at start) or launches every op (`false`).
    pub fn set_graphs(&self, on: bool) {
        self.graphs_enabled
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Turns the fast decode path on (default; `MIRAGE_CUDA_FAST=0` turns it
    /// off at start) or off: Q8_0 matrices uploaded afterwards are repacked
    /// to the split layout, Q/K/V products of one input run as one launch
    /// and the FFN's gate, up and SwiGLU as one kernel. Off, uploads keep the
    /// ggml blocks and every op runs the first version's kernels. Matrices
    /// already uploaded keep their layout (repacked ones always take the
    /// fast kernels).
    pub fn set_fast_decode(&self, on: bool) {
        self.fast_decode
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// The weight types repacked to a split layout at upload while the fast
    /// path is on (default Q8_0, Q4_K, Q5_0 and Q6_K; `MIRAGE_CUDA_SPLIT=q8_0,q4_k`
    /// or `none` at start). Others keep their ggml blocks (read by the fast
    /// path's ggml-layout kernels). A switch per layout, so that one kernel
    /// found wrong on a device can be left out alone.
    pub fn set_repacked_types(&self, types: &[GgmlType]) {
        let mask = types.iter().fold(0, |m, &t| m | repack_bit(t));
        self.repacked_types
            .store(mask, std::sync::atomic::Ordering::Relaxed);
    }

    fn repacks(&self, ty: GgmlType) -> bool {
        self.fast_decode()
            && self
                .repacked_types
                .load(std::sync::atomic::Ordering::Relaxed)
                & repack_bit(ty)
                != 0
    }

    /// Forces the column split of the repacked mat-vecs (1, 2, 4 or 8;
    /// `MIRAGE_CUDA_SPLITK=N` at start) or returns it to the rule (0, the
    /// default): the smallest split giving at least 3 blocks per SM with
    /// column slices of at least 128 elements. Other values are refused.
    pub fn set_split_k(&self, k: usize) -> Result<(), CudaError> {
        if k != 0 && !SPLIT_K.contains(&k) {
            return Err(CudaError::Setting(format!(
                "split-K {k}: expected 0 (automatic), 1, 2, 4 or 8"
            )));
        }
        self.split_k.store(k, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Picks the mat-vec kernels of the split Q8_0 and split Q4_K layouts:
    /// 1 (the first kernels), or variant 2 (the default) to 5 of `cuda/dense.cu`
    /// (16-byte loads; v2 4 rows per warp, v3 and v4 2 rows per warp with
    /// more or fewer loads in flight, v5 v4's shape software-pipelined);
    /// `MIRAGE_CUDA_MV=v1|v2|v3|v4|v5` at start. Applies to launches recorded or made afterwards (a recorded
    /// graph keeps its kernels until the step's launches change). Other
    /// values are refused.
    pub fn set_matvec_variant(&self, v: usize) -> Result<(), CudaError> {
        if !(1..=1 + VARIANT_ROWS.len()).contains(&v) {
            return Err(CudaError::Setting(format!(
                "mat-vec variant {v}: expected 1 to {}",
                1 + VARIANT_ROWS.len()
            )));
        }
        self.matvec_variant
            .store(v, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Which kernels read what they can before waiting on the previous
    /// kernel: see [`PreloadParts`] (`MIRAGE_CUDA_PRELOAD` at start;
    /// default none). A grid resident while the previous kernel runs (PDL)
    /// then starts computing the moment its input lands. The same bits;
    /// applies to launches recorded afterwards.
    pub fn set_preload(&self, parts: PreloadParts) {
        self.preload
            .store(parts.bits(), std::sync::atomic::Ordering::Relaxed);
    }

    /// Which kernels preload.
    pub fn preload(&self) -> PreloadParts {
        PreloadParts::from_bits(self.preload.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// When the v2 split Q8_0 mat-vecs (Q/K/V, output projection, down,
    /// head) run on a persistent grid: see [`MatvecGrid`] (default `Auto`).
    /// The same loads and sums per row: the same bits. The preload's
    /// mat-vec part, when on, takes precedence. Applies to launches recorded
    /// afterwards.
    pub fn set_matvec_grid(&self, grid: MatvecGrid) {
        self.matvec_grid
            .store(grid.bits(), std::sync::atomic::Ordering::Relaxed);
    }

    /// When the v2 split Q8_0 mat-vecs run on a persistent grid.
    pub fn matvec_grid(&self) -> MatvecGrid {
        MatvecGrid::from_bits(self.matvec_grid.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Blocks of `kernel` (a block of `threads`, no dynamic shared memory)
    /// resident on the whole device at once. Asked of the driver once per
    /// kernel and kept: the decode path runs on the host every step (the
    /// step is recorded, then its graph replayed), and a driver query per
    /// mat-vec launch would cost the host more than the grid saves.
    fn resident_blocks(&self, kernel: &str, threads: u32) -> Result<usize> {
        let i = *self
            .kernel_index
            .get(kernel)
            .ok_or_else(|| bad(format!("no kernel `{kernel}`")))?;
        let mut known = self.resident.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&n) = known.get(&(i, threads)) {
            return Ok(n);
        }
        let per_sm = self.functions[i]
            .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
            .map_err(drv)?;
        let n = per_sm.max(1) as usize * self.sm_count;
        known.insert((i, threads), n);
        Ok(n)
    }

    /// Kernel-name suffix of a variant for a matrix in this layout: `_v<N>`,
    /// `_v2p` for v2 over split Q8_0 when `preload` (this kernel's part of
    /// the preload is on), or empty for the default kernels.
    fn variant_suffix(layout: Layout, variant: Option<(usize, usize)>, preload: bool) -> String {
        match variant {
            Some((2, _)) if layout == Layout::Q8Split && preload => "_v2p".into(),
            Some((v, _)) => format!("_v{v}"),
            None => String::new(),
        }
    }

    /// Attends prefill batches (one sequence, consecutive positions, at
    /// least 16 rows, head size <= 128) with the tiled kernel, which streams
    /// each key and value once per 16 query rows (`true`, the default), or
    /// row by row with the split-K decode kernel (`false`; also
    /// `MIRAGE_CUDA_PREFILL_ATTN=0` at start).
    pub fn set_tiled_prefill_attention(&self, on: bool) {
        self.tiled_prefill
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether prefill batches use the tiled attention kernel.
    pub fn tiled_prefill_attention(&self) -> bool {
        self.tiled_prefill
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The mat-vec variant of the split Q8_0 / Q4_K layouts (1 = the first
    /// kernels; 2 is the default).
    pub fn matvec_variant(&self) -> usize {
        self.matvec_variant
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Variant (> 1) and its rows per warp for a matrix in this layout, or
    /// `None` for the default kernels.
    fn variant_for(&self, layout: Layout) -> Option<(usize, usize)> {
        let v = self.matvec_variant();
        (v > 1 && matches!(layout, Layout::Q8Split | Layout::Q4KSplit))
            .then(|| (v, VARIANT_ROWS[v - 2]))
    }

    /// Column split for a repacked mat-vec over matrices of these row
    /// counts and `cols` columns.
    fn split_k_for(&self, rows: &[usize], cols: usize) -> usize {
        let forced = self.split_k.load(std::sync::atomic::Ordering::Relaxed);
        if forced != 0 {
            return forced;
        }
        let blocks = |k: usize| -> usize {
            let per_block = FAST_WARPS / k * FAST_ROWS;
            rows.iter().map(|r| r.div_ceil(per_block)).sum()
        };
        let target = SPLIT_K_BLOCKS_PER_SM * self.sm_count;
        let mut best = 1;
        for &k in &SPLIT_K {
            if k > 1 && cols / k < SPLIT_K_MIN_SLICE {
                break;
            }
            best = k;
            if blocks(k) >= target {
                break;
            }
        }
        best
    }

    /// Whether the fast decode path is on.
    pub fn fast_decode(&self) -> bool {
        self.fast_decode.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets the encoding of matrices uploaded afterwards (default
    /// [`WeightFormat::Native`]; `MIRAGE_CUDA_WEIGHTS=nvfp4` picks NVFP4 at
    /// start).
    pub fn set_weight_format(&self, f: WeightFormat) {
        self.nvfp4_weights.store(
            f == WeightFormat::Nvfp4,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// The encoding of matrices uploaded from now on.
    pub fn weight_format(&self) -> WeightFormat {
        if self
            .nvfp4_weights
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            WeightFormat::Nvfp4
        } else {
            WeightFormat::Native
        }
    }

    /// Whether decode steps are recorded as CUDA graphs.
    pub fn graphs(&self) -> bool {
        self.graphs_enabled
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Multiplies batches of more than 16 rows through cuBLAS (default when
    /// the library loads; `MIRAGE_CUDA_GEMM=0` turns it off at start) or
    /// with the mat-vec kernel (`false`). Returns whether it is on.
    pub fn set_prefill_gemm(&self, on: bool) -> bool {
        let on = on && self.blas.is_some();
        self.gemm_enabled
            .store(on, std::sync::atomic::Ordering::Relaxed);
        on
    }

    /// Sets the size of the f16 weight tile of the GEMM path (default 32
    /// MiB; at least 16 rows). Tests use small tiles to cover the tiling.
    pub fn set_gemm_tile_bytes(&self, bytes: usize) {
        self.gemm_tile_bytes
            .store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether large batches multiply through cuBLAS.
    pub fn prefill_gemm(&self) -> bool {
        self.gemm_enabled.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How steps ran so far (captured, replayed, op by op).
    pub fn graph_stats(&self) -> GraphStats {
        self.step_state().stats
    }

    /// The device's name as the driver reports it.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// Compute capability (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// Whether the kernels' PTX came from the on-disk cache.
    pub fn ptx_from_cache(&self) -> bool {
        self.ptx_from_cache
    }

    /// Device memory held, by purpose.
    pub fn memory_stats(&self) -> MemoryStats {
        *self.mem.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Free and total device memory, as the driver reports them.
    pub fn device_memory(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(drv)
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(drv)
    }

    /// Device-to-device copy bandwidth in bytes per second, counting bytes
    /// read plus bytes written (the ceiling for a memory-bound decode), as
    /// the median of `iters` copies of `bytes` bytes timed with events.
    pub fn copy_bandwidth(&self, bytes: usize, iters: usize) -> Result<f64> {
        let n = bytes / 4;
        let src = self.stream.alloc_zeros::<f32>(n).map_err(drv)?;
        let mut dst = self.stream.alloc_zeros::<f32>(n).map_err(drv)?;
        let mut times = Vec::with_capacity(iters);
        for i in 0..iters + 2 {
            let start = self
                .ctx
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(drv)?;
            let end = self
                .ctx
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(drv)?;
            start.record(&self.stream).map_err(drv)?;
            self.stream.memcpy_dtod(&src, &mut dst).map_err(drv)?;
            end.record(&self.stream).map_err(drv)?;
            end.synchronize().map_err(drv)?;
            if i >= 2 {
                times.push(start.elapsed_ms(&end).map_err(drv)? as f64 / 1e3);
            }
        }
        times.sort_by(|a, b| a.total_cmp(b));
        let t = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
        Ok(2.0 * (n * 4) as f64 / t)
    }

    /// `out[r]` = index of the largest element of row `r` of `x`, computed on
    /// the device (only the indices travel to the host).
    pub fn argmax(&self, x: &CudaActivations) -> Result<Vec<u32>> {
        let buf = x
            .buf
            .as_ref()
            .ok_or_else(|| bad("argmax of an empty buffer"))?;
        let mut idx = self.stream.alloc_zeros::<u32>(x.rows.max(1)).map_err(drv)?;
        let (px, pi) = (self.ptr(buf), self.ptr(&idx));
        self.launch(
            "argmax_rows",
            (x.rows as u32, 1, 1),
            (1024, 1, 1),
            0,
            vec![Arg::Ptr(px), Arg::I32(x.width as i32), Arg::Ptr(pi)],
        )?;
        let mut out = vec![0u32; x.rows];
        self.stream
            .memcpy_dtoh(&idx.slice(0..x.rows), &mut out)
            .map_err(drv)?;
        let _ = &mut idx;
        Ok(out)
    }

    /// A device buffer holding `data` as `rows` rows of `width` floats.
    pub fn upload_activations(
        &self,
        rows: usize,
        width: usize,
        data: &[f32],
    ) -> Result<CudaActivations> {
        if rows.checked_mul(width) != Some(data.len()) {
            return Err(bad("activation data does not match its shape"));
        }
        let mut a = CudaActivations::default();
        self.reshape(&mut a, rows, width)?;
        if !data.is_empty() {
            let buf = a.buf.as_mut().expect("reshape allocates");
            self.stream
                .memcpy_htod(data, &mut buf.slice_mut(0..data.len()))
                .map_err(drv)?;
        }
        Ok(a)
    }

    fn step_state(&self) -> MutexGuard<'_, StepState> {
        self.step_state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Launches `kernel`, or appends the launch to the step being recorded.
    fn launch(
        &self,
        kernel: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: Vec<Arg>,
    ) -> Result<()> {
        self.launch_how(kernel, grid, block, smem, args, LaunchHow::default())
    }

    /// `launch` as `how` says: cooperatively (the grid must fit the device
    /// at once; a recorded step captures it as a cooperative node), in
    /// thread-block clusters (`grid.0` a multiple of the cluster), or with a
    /// pending RMSNorm folding in under another kernel's fold setting.
    fn launch_how(
        &self,
        kernel: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: Vec<Arg>,
        how: LaunchHow,
    ) -> Result<()> {
        let kernel = *self
            .kernel_index
            .get(kernel)
            .ok_or_else(|| bad(format!("no kernel `{kernel}`")))?;
        let cluster = how.cluster.max(1);
        if grid.0 % cluster != 0 {
            return Err(bad(format!(
                "a grid of {} blocks is not whole clusters of {cluster}",
                grid.0
            )));
        }
        let l = Launch {
            kernel,
            grid,
            block,
            smem,
            args,
            cooperative: how.cooperative,
            cluster,
        };
        self.push_launch(l, how.fold)
    }

    /// Runs `l`, or appends it to the step being recorded (folding a
    /// pending norm into it where it can; `gate`: whose fold setting
    /// decides, `None` for the kernel's own).
    fn push_launch(&self, l: Launch, gate: Option<NormFoldGate>) -> Result<()> {
        let mut st = self.step_state();
        let st = &mut *st;
        if let Some(rec) = st.recording.as_mut() {
            let mut l = l;
            if let Some(pn) = st.pending_norm.take() {
                if !self.fold_norm(&pn, &mut l, gate) {
                    rec.push(pn.launch(self.kernel_index["rms_norm"]));
                }
            }
            rec.push(l);
            return Ok(());
        }
        self.launch_now(&l)
    }

    /// Folds `pn` into `l` when `l` is a fast mat-vec (`mv3_*`, `ffn_*`)
    /// over exactly the norm's output rows with no norm folded yet, or a
    /// sparse kernel with norm slots whose fold setting (`gate`, else its
    /// own) is on.
    fn fold_norm(&self, pn: &PendingNorm, l: &mut Launch, gate: Option<NormFoldGate>) -> bool {
        if let Some(Some(slots)) = self.norm_slots.get(l.kernel) {
            let allowed = match gate.unwrap_or(slots.gate) {
                NormFoldGate::SparseFfn => &self.fold_ffn_norm,
                NormFoldGate::Router => &self.fold_route_norm,
            };
            return allowed.load(std::sync::atomic::Ordering::Relaxed)
                && fold_norm_at(*slots, pn, l);
        }
        let Some(name) = self.functions_names.get(l.kernel) else {
            return false;
        };
        let (x_at, norm_at) = if name.starts_with("mv3_") && l.args.len() == MV3_ARGS {
            (8, 19)
        } else if name.starts_with("ffn_") && l.args.len() == FFN_ARGS {
            (5, 9)
        } else {
            return false;
        };
        let cols = if x_at == 8 { l.args[7] } else { l.args[4] };
        if l.args[x_at] != Arg::Ptr(pn.out)
            || cols != Arg::I32(pn.width as i32)
            || l.grid.1 as usize != pn.rows
            || l.smem != 0
            || l.args[norm_at] != Arg::Ptr(0)
        {
            return false;
        }
        l.args[norm_at] = Arg::Ptr(pn.x);
        l.args[norm_at + 1] = Arg::Ptr(pn.w);
        l.args[norm_at + 2] = Arg::F32(pn.eps);
        l.args[norm_at + 3] = Arg::Ptr(pn.out);
        l.smem = (pn.width * 4) as u32;
        true
    }

    /// Turns folding RMSNorm into the next mat-vec of a recorded step on
    /// (default with the fast path; `MIRAGE_CUDA_FUSE_NORM=0` turns it off
    /// at start) or off.
    pub fn set_fuse_norm(&self, on: bool) {
        self.fuse_norm
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether norms are folded into the next mat-vec of a recorded step.
    pub fn fuse_norm(&self) -> bool {
        self.fast_decode() && self.fuse_norm.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Turns programmatic dependent launch on (only where the device has it:
    /// compute capability 9.0 and up) or off. Kernels whose PTX waits on
    /// their prerequisite grid are then launched with programmatic stream
    /// serialization, so their blocks start (and prefetch weights) while the
    /// previous kernel drains; results are the same bits either way.
    pub fn set_pdl(&self, on: bool) {
        self.pdl.store(
            on && self.compute_capability.0 >= 9,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Runs the split-K decode attention and its combine as one launch
    /// (`true`, default) or as two (`false`); the results are the same bits.
    pub fn set_fused_attention(&self, on: bool) {
        self.fused_attention
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Runs Q/K/V, the decode attention and O of each layer of a one-row
    /// recorded step as one launch (`attn_block_q8s_*`, the same bits) where
    /// the step has them in the form it replaces (split Q8_0 v2 mat-vecs,
    /// `attend_rope_*`; `fuse_attention_blocks`), or as three (`false`,
    /// default; `MIRAGE_CUDA_ATTN_BLOCK=1` at start turns it on).
    pub fn set_attention_block(&self, on: bool) {
        self.attention_block
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// At most `blocks` blocks for each attention block launch (`None`: as
    /// many as are resident): a test's way to make each block take several
    /// tiles and attention items.
    pub fn set_attention_block_grid(&self, blocks: Option<usize>) {
        self.attention_block_grid
            .store(blocks.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
    }

    /// The attention block launches planned so far, one line each (shape and
    /// plan: grid, O tiles copied ahead a block, shared memory), for a
    /// bench to say what ran.
    pub fn attention_block_plans(&self) -> Vec<String> {
        let plans = self
            .attention_block_plans
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut lines: Vec<String> = plans
            .iter()
            .map(|((k, s), planned)| {
                let AttnBlockPlanned { plan: p, regs, static_smem } = planned;
                let refused = p.refused.map_or(String::new(), |(smem, per)| {
                    format!(" (at {smem} B the driver admitted {per} an SM)")
                });
                format!(
                    "{} d {} (Q/K/V rows {:?}, split {}; O {}x{}, split {}): {} blocks, {} O tiles a block ahead, {} B shared; {regs} registers, {static_smem} B static{refused}",
                    self.functions_names[*k], s.cols, s.rows_qkv, s.s_qkv, s.rows_o, s.cols_o, s.s_o, p.grid, p.o_pre, p.smem
                )
            })
            .collect();
        lines.sort();
        lines
    }

    /// Whether `set_attention_block` is on.
    pub fn attention_block(&self) -> bool {
        self.attention_block
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the decode attention and its combine run as one launch.
    pub fn fused_attention(&self) -> bool {
        self.fused_attention
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Folds the decode rows' RoPE and KV-cache store into the one-launch
    /// attention (`true`, default) or keeps them a launch of their own; the
    /// results are the same bits. Applies where the attention runs as one
    /// launch, without a per-head q/k norm or KV-page pruning, and every row
    /// of the batch is in its own sequence.
    pub fn set_rope_in_attention(&self, on: bool) {
        self.rope_in_attention
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Kernel launches of the most recently replayed or captured decode
    /// graph (0 when none): what the fusions save shows here.
    pub fn last_graph_launches(&self) -> usize {
        self.step_state()
            .graphs
            .first()
            .map_or(0, |g| g.launches.len())
    }

    /// Whether programmatic dependent launch is on.
    pub fn pdl(&self) -> bool {
        self.pdl.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Where recorded decode steps issue the weights the runtime hints
    /// (`Backend::prefetch`) into L2: see [`PrefetchSites`]. Results are the
    /// same bits either way; each site adds one `l2_prefetch` launch per
    /// layer to the graph.
    pub fn set_cross_prefetch(&self, sites: PrefetchSites) {
        self.cross_prefetch
            .store(sites.bits(), std::sync::atomic::Ordering::Relaxed);
    }

    /// Where the cross-op weight prefetch is issued.
    pub fn cross_prefetch(&self) -> PrefetchSites {
        PrefetchSites::from_bits(
            self.cross_prefetch
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// Keeps `regions` (`(address, bytes)` of weights a later op reads) for
    /// the next `emit_prefetch`, replacing any not issued. Only in a step
    /// being recorded: a prefill reads its weights at once.
    fn hint_prefetch(&self, regions: &[(u64, usize)]) {
        let mut st = self.step_state();
        if st.recording.is_some() {
            st.pending_prefetch.clear();
            st.pending_prefetch.extend_from_slice(regions);
        }
    }

    /// Appends one `l2_prefetch` launch of the pending regions to the step
    /// being recorded when `site` is on (its first three regions, at most
    /// half the L2 in all, the rest of a larger region left out); drops
    /// them either way. Straight into the recording: a pending norm stays
    /// pending for the kernel it folds into.
    pub(crate) fn emit_prefetch(&self, site: PrefetchSite) {
        let sites = self.cross_prefetch();
        let on = match site {
            PrefetchSite::Attention => sites.attention,
            PrefetchSite::Ffn => sites.ffn,
        };
        let mut st = self.step_state();
        let st = &mut *st;
        let regions = std::mem::take(&mut st.pending_prefetch);
        let Some(rec) = st.recording.as_mut() else {
            return;
        };
        if !on || regions.is_empty() {
            return;
        }
        let mut budget = self.l2_bytes / 2;
        let mut args = Vec::with_capacity(6);
        let mut lines = 0;
        for &(p, n) in regions.iter().take(3) {
            let n = n.min(budget);
            budget -= n;
            lines += n.div_ceil(128);
            args.extend([Arg::Ptr(p), Arg::I64(n as i64)]);
        }
        while args.len() < 6 {
            args.extend([Arg::Ptr(0), Arg::I64(0)]);
        }
        if lines == 0 {
            return;
        }
        // About four lines a thread, at most one block per SM.
        let blocks = lines
            .div_ceil(PREFETCH_THREADS as usize * 4)
            .clamp(1, self.sm_count);
        rec.push(Launch {
            kernel: self.kernel_index["l2_prefetch"],
            grid: (blocks as u32, 1, 1),
            block: (PREFETCH_THREADS, 1, 1),
            smem: 0,
            args,
            cooperative: false,
            cluster: 1,
        });
    }

    /// Adds kernel `name` of a module loaded on this context (the sparse
    /// backend's); `ptx` is that module's, to learn whether it waits;
    /// `accumulate` the `(accumulate, y)` argument positions when the
    /// kernel's output can take the next residual add (`fold_epilogue`).
    pub(crate) fn add_function(
        &mut self,
        name: &'static str,
        f: CudaFunction,
        ptx: &str,
        accumulate: Option<(usize, usize)>,
        norm: Option<NormSlots>,
    ) {
        self.kernel_index.insert(name, self.functions.len());
        self.functions.push(f);
        self.functions_names.push(name);
        self.waits.push(module::waits_on_prerequisite(ptx, name));
        self.accumulate_slots.push(accumulate);
        self.norm_slots.push(norm);
    }

    /// Turns folding the RMSNorm before a sparse FFN into the FFN's phase 1
    /// on or off (`MIRAGE_SPARSE_FOLD_NORM=1` turns it on at start; off by
    /// default). Takes effect for steps recorded afterwards; needs
    /// [`fuse_norm`](Self::fuse_norm) on as well.
    pub fn set_fold_ffn_norm(&self, on: bool) {
        self.fold_ffn_norm
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Turns folding the RMSNorm before a routed sparse FFN into the
    /// router's launch on or off (on by default; `MIRAGE_SPARSE_ROUTE_NORM=0`
    /// turns it off at start). Takes effect for steps recorded afterwards;
    /// needs [`fuse_norm`](Self::fuse_norm) on as well.
    pub fn set_fold_route_norm(&self, on: bool) {
        self.fold_route_norm
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the RMSNorm before a routed sparse FFN folds into the router.
    pub fn fold_route_norm(&self) -> bool {
        self.fold_route_norm
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Launches `l` now, through `cuLaunchKernelEx` (`cluster::launch_ex`):
    /// with programmatic stream serialization when its kernel waits on its
    /// prerequisite grid and PDL is on (never for a cooperative launch), in
    /// its clusters, cooperatively when it is.
    fn launch_now(&self, l: &Launch) -> Result<()> {
        let mut params: Vec<*mut std::ffi::c_void> = l
            .args
            .iter()
            .map(|a| match a {
                Arg::Ptr(v) => v as *const u64 as *mut std::ffi::c_void,
                Arg::I32(v) => v as *const i32 as *mut std::ffi::c_void,
                Arg::I64(v) => v as *const i64 as *mut std::ffi::c_void,
                Arg::F32(v) => v as *const f32 as *mut std::ffi::c_void,
            })
            .collect();
        let mode = crate::cluster::LaunchMode {
            cluster: l.cluster,
            programmatic: self.waits[l.kernel] && self.pdl() && !l.cooperative,
            cooperative: l.cooperative,
        };
        // SAFETY: `params` points at the argument values in `l.args`, which
        // outlive the call, in the order of the kernel's signature (every
        // call site passes the kernel's argument list, pointers as u64, and
        // checks the shapes first); the function belongs to this context
        // and the stream to it too; a clustered launch's grid is whole
        // clusters (launch_how); a cooperative launch's caller sizes the
        // grid to the resident blocks.
        unsafe {
            crate::cluster::launch_ex(
                &self.functions[l.kernel],
                &self.stream,
                l.grid,
                l.block,
                l.smem,
                &mut params,
                mode,
            )
        }
        .map_err(drv)
    }

    fn recording(&self) -> bool {
        self.step_state().recording.is_some()
    }

    /// The device address of staged step input `what` (0 tokens, 1 slots,
    /// 2 logits rows) when a step is in progress and its inputs equal `eq`.
    fn staged(&self, check: impl FnOnce(&Staged) -> Option<u64>) -> Result<Option<u64>> {
        let st = self.step_state();
        match &st.staged {
            Some(s) => match check(s) {
                Some(p) => Ok(Some(p)),
                None if st.recording.is_some() => Err(bad(
                    "an op inside a recorded step got inputs other than the step's",
                )),
                None => Ok(None),
            },
            None => Ok(None),
        }
    }

    /// Replays the graph recorded with exactly `launches`, or captures one.
    fn run_recorded(&self, st: &mut StepState, launches: Vec<Launch>) -> Result<()> {
        if let Some(i) = st.graphs.iter().position(|g| g.launches == launches) {
            st.graphs[i].graph.launch().map_err(drv)?;
            let g = st.graphs.remove(i);
            st.graphs.insert(0, g);
            st.stats.replays += 1;
            return Ok(());
        }
        if st.graphs.len() >= GRAPH_CACHE {
            // The oldest graph may still be queued: let it finish first.
            self.stream.synchronize().map_err(drv)?;
            st.graphs.truncate(GRAPH_CACHE - 1);
        }
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv)?;
        let mut launched = Ok(());
        for l in &launches {
            launched = self.launch_now(l);
            if launched.is_err() {
                break;
            }
        }
        // End the capture whatever happened, so that the stream is usable.
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0));
        launched?;
        let graph = graph
            .map_err(drv)?
            .ok_or_else(|| bad("stream capture returned no graph"))?;
        graph.launch().map_err(drv)?;
        st.stats.captures += 1;
        st.graphs.insert(0, RecordedGraph { launches, graph });
        Ok(())
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        // Event tracking is off (one stream), so the guard has nothing to do.
        let (p, _guard) = s.device_ptr(&self.stream);
        p
    }

    fn account(&self, kind: MemKind, bytes: usize) {
        let mut m = self.mem.lock().unwrap_or_else(|e| e.into_inner());
        match kind {
            MemKind::Weights => m.weights += bytes,
            MemKind::Kv => m.kv_cache += bytes,
            MemKind::Workspace => m.workspace += bytes,
        }
        m.peak = m.peak.max(m.weights + m.kv_cache + m.workspace);
    }

    fn scratch(&self) -> MutexGuard<'_, Scratch> {
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets the shape of `a`, growing its buffer when needed; returns its
    /// device pointer.
    fn reshape(&self, a: &mut CudaActivations, rows: usize, width: usize) -> Result<u64> {
        let n = rows
            .checked_mul(width)
            .ok_or_else(|| bad("activation shape overflows"))?
            .max(1);
        let cap = a.buf.as_ref().map_or(0, |b| b.len());
        if cap < n {
            // Round up so that a growing prefill does not reallocate every call.
            let want = n.next_power_of_two();
            a.buf = Some(self.stream.alloc_zeros::<f32>(want).map_err(drv)?);
            self.account(MemKind::Workspace, (want - cap) * 4);
        }
        a.rows = rows;
        a.width = width;
        Ok(self.ptr(a.buf.as_ref().expect("allocated above")))
    }

    fn act_ptr(&self, a: &CudaActivations) -> Result<u64> {
        a.buf
            .as_ref()
            .map(|b| self.ptr(b))
            .ok_or_else(|| bad("activation buffer used before it was written"))
    }

    fn upload_u32(&self, slot: &mut Option<CudaSlice<u32>>, v: &[u32]) -> Result<u64> {
        if slot.as_ref().is_none_or(|s| s.len() < v.len()) {
            *slot = Some(
                self.stream
                    .alloc_zeros::<u32>(v.len().next_power_of_two())
                    .map_err(drv)?,
            );
        }
        let s = slot.as_mut().expect("allocated above");
        self.stream
            .memcpy_htod(v, &mut s.slice_mut(0..v.len()))
            .map_err(drv)?;
        Ok(self.ptr(s))
    }

    /// Whether a product over `n_act` activation rows goes through cuBLAS.
    fn use_gemm(&self, n_act: usize) -> bool {
        n_act >= GEMM_MIN_ROWS && self.prefill_gemm() && !self.recording()
    }

    fn matvec(&self, w: &CudaMatrix, x: u64, n_act: usize, y: u64) -> Result<()> {
        let suffix = w
            .fast_suffix()
            .ok_or_else(|| RuntimeError::UnsupportedType {
                backend: "cuda".into(),
                ty: w.ty,
                what: w.name.clone(),
            })?;
        if self.use_gemm(n_act) {
            return self.gemm(w, suffix, x, n_act, y);
        }
        if w.layout != Layout::Ggml || self.fast_decode() {
            return self.mv3(&[w], x, n_act, &[y]);
        }
        self.launch(
            &format!("matvec_{suffix}"),
            ((w.rows as u32).div_ceil(MATVEC_WARPS), n_act as u32, 1),
            (32 * MATVEC_WARPS, 1, 1),
            0,
            vec![
                Arg::Ptr(self.ptr(&w.data)),
                Arg::I64(w.row_bytes as i64),
                Arg::I32(w.rows as i32),
                Arg::I32(w.cols as i32),
                Arg::Ptr(x),
                Arg::Ptr(y),
            ],
        )
    }

    /// `ys[i][a, :] = ws[i] x[a, :]` for 1 to 3 matrices of one kernel
    /// suffix and row length, in one launch of `mv3_*` (its blocks are cut
    /// between the matrices by their row counts).
    fn mv3(&self, ws: &[&CudaMatrix], x: u64, n_act: usize, ys: &[u64]) -> Result<()> {
        if ws.is_empty() || ws.len() > 3 || ws.len() != ys.len() {
            return Err(bad("mv3 takes 1 to 3 matrices with one output each"));
        }
        let w0 = ws[0];
        let suffix = w0
            .fast_suffix()
            .ok_or_else(|| RuntimeError::UnsupportedType {
                backend: "cuda".into(),
                ty: w0.ty,
                what: w0.name.clone(),
            })?;
        if ws
            .iter()
            .any(|w| w.fast_suffix() != Some(suffix) || w.cols != w0.cols)
        {
            return Err(bad("mv3 matrices differ in layout or row length"));
        }
        let variant = self.variant_for(w0.layout);
        // Rows per warp of the kernel (variants: VARIANT_ROWS).
        let nr = variant.map_or(FAST_ROWS, |(_, nr)| nr);
        let split = if w0.layout == Layout::Ggml {
            1
        } else {
            // The rule counts blocks of FAST_ROWS rows per warp: scale the
            // row counts so that it sees the variant's block count.
            let rows: Vec<usize> = ws.iter().map(|w| w.rows * FAST_ROWS / nr).collect();
            self.split_k_for(&rows, w0.cols)
        };
        let per_block = match variant {
            Some(_) => FAST_WARPS * nr / split,
            None => w0.fast_rows_per_block() / split,
        };
        let mut args_w = [Arg::Ptr(self.ptr(&w0.data)); 3];
        let mut args_rows = [Arg::I32(0); 3];
        let mut args_y = [Arg::Ptr(ys[0]); 3];
        let mut args_ts = [Arg::F32(0.0); 3];
        let mut blocks = 0usize;
        for (i, (w, &y)) in ws.iter().zip(ys).enumerate() {
            args_w[i] = Arg::Ptr(self.ptr(&w.data));
            args_rows[i] = Arg::I32(w.rows as i32);
            args_y[i] = Arg::Ptr(y);
            args_ts[i] = Arg::F32(w.tensor_scale());
            blocks += w.rows.div_ceil(per_block);
        }
        let mut args = Vec::with_capacity(14);
        args.extend(args_w);
        args.extend(args_rows);
        args.push(Arg::I64(w0.row_bytes as i64));
        args.push(Arg::I32(w0.cols as i32));
        args.push(Arg::Ptr(x));
        args.extend(args_y);
        args.extend(args_ts);
        // Epilogues (bias0..2, res): none; `fold_epilogue` may set them.
        args.extend([Arg::Ptr(0); 4]);
        // Folded norm (nx, nw, neps, nout): none; `fold_norm` may set it.
        args.extend([Arg::Ptr(0), Arg::Ptr(0), Arg::F32(0.0), Arg::Ptr(0)]);
        let v = Self::variant_suffix(w0.layout, variant, self.preload().matvec);
        let k = if split == 1 {
            String::new()
        } else {
            format!("_k{split}")
        };
        let mut kernel = format!("mv3_{suffix}{v}{k}");
        let grid = self.matvec_grid();
        if v == "_v2" && w0.layout == Layout::Q8Split && grid != MatvecGrid::Off {
            let grid_kernel = format!("mv3_{suffix}_v2g{k}");
            let resident = self.resident_blocks(&grid_kernel, (32 * FAST_WARPS) as u32)?;
            if grid.applies(w0.cols, blocks, resident) {
                // Grid-stride over the same row groups: no more blocks than fit.
                kernel = grid_kernel;
                blocks = blocks.min(resident);
            }
        }
        self.launch(
            &kernel,
            (blocks as u32, n_act as u32, 1),
            ((32 * FAST_WARPS) as u32, 1, 1),
            0,
            args,
        )
    }

    /// Folds an elementwise op on `target` (the output of a recorded `mv3_*`
    /// launch) into that launch as an epilogue: a bias (`res` false: sets
    /// `bias_m` of the matrix whose output is `target`) or a residual add
    /// (`res` true: sets `res` = `extra`, only for a single-matrix launch).
    /// Only while a step is being recorded, and only when no launch after
    /// the producer touches `target` or `extra`. Returns whether it folded.
    fn fold_epilogue(&self, target: u64, n_rows: usize, extra: u64, res: bool) -> bool {
        if !self.fast_decode() {
            return false;
        }
        let mut st = self.step_state();
        // A norm not yet launched must read its input before the op it
        // precedes in program order; folding into an earlier launch would
        // change what it reads.
        if st
            .pending_norm
            .is_some_and(|p| [p.x, p.out].iter().any(|&q| q == target || q == extra))
        {
            return false;
        }
        let Some(rec) = st.recording.as_mut() else {
            return false;
        };
        let touches = |l: &Launch| {
            l.args
                .iter()
                .any(|a| matches!(a, Arg::Ptr(p) if *p == target || *p == extra))
        };
        for i in (0..rec.len()).rev() {
            let l = &rec[i];
            // A kernel that adds onto its output (the sparse FFN's last
            // phase, one row): y becomes the residual stream, accumulate 1
            // (`y = FFN + y`, the same add as add_inplace's). Its own output
            // buffer is then not written; the pass reads it only for this add.
            if let Some(Some((acc_at, y_at))) = self.accumulate_slots.get(l.kernel) {
                let (acc_at, y_at) = (*acc_at, *y_at);
                if res
                    && n_rows == 1
                    && self.fold_ffn_add
                    && l.args.get(y_at) == Some(&Arg::Ptr(target))
                    && l.args.get(acc_at) == Some(&Arg::I32(0))
                    && !l.args[..y_at].contains(&Arg::Ptr(extra))
                {
                    rec[i].args[y_at] = Arg::Ptr(extra);
                    rec[i].args[acc_at] = Arg::I32(1);
                    return true;
                }
            }
            let is_mv3 = self
                .functions_names
                .get(l.kernel)
                .is_some_and(|n| n.starts_with("mv3_"));
            if is_mv3 && l.args.len() == MV3_ARGS && l.grid.1 as usize == n_rows {
                // y0..2 at 9..12, rows0..2 at 3..6, bias0..2 at 15..18, res 18.
                let m = (0..3).find(|&m| {
                    l.args[9 + m] == Arg::Ptr(target) && !matches!(l.args[3 + m], Arg::I32(0))
                });
                if let Some(m) = m {
                    let single =
                        matches!(l.args[4], Arg::I32(0)) && matches!(l.args[5], Arg::I32(0));
                    let slot = if res { 18 } else { 15 + m };
                    // The residual must not be the launch's own input
                    // (other warps still read it).
                    let reads_extra = l.args[8] == Arg::Ptr(extra) || l.args[19] == Arg::Ptr(extra);
                    if (res && (m != 0 || !single || reads_extra))
                        || rec[i].args[slot] != Arg::Ptr(0)
                    {
                        return false;
                    }
                    rec[i].args[slot] = Arg::Ptr(extra);
                    return true;
                }
            }
            if touches(l) {
                return false;
            }
        }
        false
    }

    /// Replaces each run of three launches of a one-row recorded step that
    /// the attention block kernel covers -- `mv3_q8_0s_v2*` over Q, K and V
    /// (norm folded or not, biases), `attend_rope_<kv>` over their outputs,
    /// `mv3_q8_0s_v2*` over O reading the attention output (residual folded
    /// or not) -- with one `attn_block_q8s_<kv>` launch that runs the same
    /// items with the same code (cuda/dense.cu; the same bits). Anything
    /// else is left as it is.
    fn fuse_attention_blocks(&self, launches: Vec<Launch>) -> Result<Vec<Launch>> {
        let split_of = |l: &Launch| -> Option<usize> {
            let name = self.functions_names.get(l.kernel)?;
            let rest = ["mv3_q8_0s_v2g", "mv3_q8_0s_v2p", "mv3_q8_0s_v2"]
                .iter()
                .find_map(|p| name.strip_prefix(p))?;
            let s = match rest {
                "" => 1,
                _ => rest.strip_prefix("_k")?.parse().ok()?,
            };
            (l.args.len() == MV3_ARGS && l.grid.1 == 1 && SPLIT_K.contains(&s)).then_some(s)
        };
        let int = |a: &Arg| match a {
            Arg::I32(v) => *v as usize,
            _ => 0,
        };
        let mut out = Vec::with_capacity(launches.len());
        let mut i = 0;
        while i < launches.len() {
            if i + 2 < launches.len() {
                if let Some(mut fused) =
                    self.attention_block_of(&launches[i..i + 3], &split_of, &int)?
                {
                    i += 3;
                    // The RMSNorm of the residual stream right after (the
                    // sparse FFN's: its phase 1 does not fold it) runs in
                    // the block's last block out.
                    if let Some(norm) = launches.get(i).filter(|n| self.tail_norm_of(&fused, n)) {
                        fused.args[ATTB_TAIL_NORM..ATTB_TAIL_NORM + 3].copy_from_slice(&[
                            norm.args[1],
                            norm.args[2],
                            norm.args[4],
                        ]);
                        i += 1;
                    }
                    out.push(fused);
                    continue;
                }
            }
            out.push(launches[i].clone());
            i += 1;
        }
        Ok(out)
    }

    /// Whether `norm` is one row of `rms_norm` over the residual stream that
    /// the attention block `fused` writes (its O launch's residual), as wide.
    fn tail_norm_of(&self, fused: &Launch, norm: &Launch) -> bool {
        self.functions_names.get(norm.kernel) == Some(&"rms_norm")
            && norm.grid == (1, 1, 1)
            && norm.args.len() == 5
            && fused.args[ATTB_RES] != Arg::Ptr(0)
            && norm.args[0] == fused.args[ATTB_RES]
            && norm.args[3] == fused.args[ATTB_ROWS_O]
            && fused.args[ATTB_COLS] == fused.args[ATTB_ROWS_O]
            && norm.args[4] != fused.args[ATTB_RES]
    }

    /// The `attn_block_q8s_*` launch for `ls` = [Q/K/V, attention, O], or
    /// `None` when they are not that pattern (see `fuse_attention_blocks`).
    fn attention_block_of(
        &self,
        ls: &[Launch],
        split_of: &dyn Fn(&Launch) -> Option<usize>,
        int: &dyn Fn(&Arg) -> usize,
    ) -> Result<Option<Launch>> {
        let (a, b, c) = (&ls[0], &ls[1], &ls[2]);
        let (Some(s_qkv), Some(s_o)) = (split_of(a), split_of(c)) else {
            return Ok(None);
        };
        let kv = match self.functions_names.get(b.kernel) {
            Some(&"attend_rope_f16") => "f16",
            Some(&"attend_rope_f32") => "f32",
            _ => return Ok(None),
        };
        // Q/K/V: three matrices, no residual. attend_rope (one row) reads
        // their outputs; O: one matrix over the attention output, no norm.
        let qkv = int(&a.args[4]) > 0 && int(&a.args[5]) > 0 && a.args[18] == Arg::Ptr(0);
        let att = b.grid.0 == 1
            && b.args.len() == 17
            && b.args[0] == a.args[9]
            && b.args[13] == a.args[10]
            && b.args[14] == a.args[11];
        let o = int(&c.args[4]) == 0
            && int(&c.args[5]) == 0
            && c.args[8] == b.args[12]
            && c.args[19] == Arg::Ptr(0);
        if !(qkv && att && o) {
            return Ok(None);
        }
        let (n_head, n_head_kv) = (int(&b.args[4]), int(&b.args[5]));
        let words = crate::attn_block::sync_words(n_head, n_head_kv);
        if words > ATTN_BLOCK_SYNC_WORDS {
            return Ok(None);
        }
        let kernel = format!("attn_block_q8s_{kv}");
        let k = *self
            .kernel_index
            .get(kernel.as_str())
            .ok_or_else(|| bad(format!("no kernel `{kernel}`")))?;
        // The plans are keyed by the kernel and the device's opt-in limit;
        // the kernel's static shared memory comes off it when a plan is
        // made (below).
        let shape = crate::attn_block::AttnBlockShape {
            cols: int(&a.args[7]),
            rows_qkv: [int(&a.args[3]), int(&a.args[4]), int(&a.args[5])],
            s_qkv,
            s_o,
            rows_o: int(&c.args[3]),
            cols_o: int(&c.args[7]),
            att_items: n_head * b.grid.2 as usize,
            sm_count: self.sm_count,
            max_dynamic_smem: self.max_dynamic_smem,
            max_grid: match self
                .attention_block_grid
                .load(std::sync::atomic::Ordering::Relaxed)
            {
                0 => None,
                n => Some(n),
            },
            bulk_copies: self.compute_capability.0 >= 9 && self.attention_block_copy,
        };
        let plan = {
            let mut plans = self
                .attention_block_plans
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            match plans.get(&(k, shape)) {
                Some(p) => p.plan,
                None => {
                    let f = &self.functions[k];
                    // Static plus dynamic shared memory may not pass the
                    // opt-in limit.
                    let static_smem = f.shared_size_bytes().map_err(drv)?.max(0) as usize;
                    let regs = f.num_regs().map_err(drv)?;
                    let planned = crate::attn_block::AttnBlockShape {
                        max_dynamic_smem: shape.max_dynamic_smem.saturating_sub(static_smem),
                        ..shape
                    };
                    f.set_attribute(
                        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        planned.max_dynamic_smem as i32,
                    )
                    .map_err(drv)?;
                    let p = planned
                        .plan(|smem| {
                            f.occupancy_max_active_blocks_per_multiprocessor(
                                ATTEND_THREADS,
                                smem,
                                None,
                            )
                            .map(|n| n as usize)
                            .map_err(|e| e.to_string())
                        })
                        .map_err(bad)?;
                    plans.insert(
                        (k, shape),
                        AttnBlockPlanned {
                            plan: p,
                            regs,
                            static_smem,
                        },
                    );
                    p
                }
            }
        };
        let sync = {
            let mut s = self.scratch();
            if s.attn_sync.is_none() {
                s.attn_sync = Some(
                    self.stream
                        .alloc_zeros::<u32>(ATTN_BLOCK_SYNC_WORDS)
                        .map_err(drv)?,
                );
                self.account(MemKind::Workspace, ATTN_BLOCK_SYNC_WORDS * 4);
            }
            self.ptr(s.attn_sync.as_ref().expect("allocated above"))
        };
        let mut args = Vec::with_capacity(ATTN_BLOCK_ARGS);
        args.extend_from_slice(&a.args[0..6]); // W0..2, rows0..2
        args.push(a.args[7]); // cols
        args.extend_from_slice(&a.args[8..12]); // x, y0..2
        args.extend_from_slice(&a.args[15..18]); // bias0..2
        args.extend_from_slice(&a.args[19..23]); // nx, nw, neps, nout
        args.push(Arg::I32(s_qkv as i32));
        args.extend_from_slice(&b.args[1..13]); // kc .. out
        args.extend_from_slice(&b.args[15..17]); // neox, freq_base
        args.push(Arg::I32(b.grid.2 as i32)); // n_split
        args.push(c.args[0]); // Wo
        args.push(c.args[3]); // rows_o
        args.push(c.args[7]); // cols_o
        args.push(c.args[9]); // yo
        args.push(c.args[15]); // bo
        args.push(c.args[18]); // res
        args.push(Arg::I32(s_o as i32));
        // The tail norm (tw, teps, tout): none; fuse_attention_blocks may set it.
        args.extend([Arg::Ptr(0), Arg::F32(0.0), Arg::Ptr(0)]);
        args.push(Arg::Ptr(sync));
        args.push(Arg::I32(plan.o_pre as i32));
        args.push(Arg::I32(plan.vec_floats as i32));
        debug_assert_eq!(args.len(), ATTN_BLOCK_ARGS);
        Ok(Some(Launch {
            kernel: k,
            grid: (plan.grid as u32, 1, 1),
            block: (ATTEND_THREADS, 1, 1),
            smem: plan.smem as u32,
            args,
            cooperative: false,
            cluster: 1,
        }))
    }

    /// `h[a, r] = silu(gate[r] . x[a]) * (up[r] . x[a])` in one launch;
    /// `None` (nothing launched) when gate and up are read by different
    /// kernels.
    fn ffn_gate_up(&self, f: &CudaFfn, x: u64, n_act: usize, h: u64) -> Result<Option<()>> {
        let (g, u) = (&f.gate, &f.up);
        let suffix = match (g.fast_suffix(), u.fast_suffix()) {
            (Some(a), Some(b)) if a == b && g.row_bytes == u.row_bytes => a,
            _ => return Ok(None),
        };
        let variant = self.variant_for(g.layout);
        let per_block = match (g.layout, variant) {
            (Layout::Ggml, _) => FAST_WARPS,
            (_, Some((_, nr))) => FAST_WARPS * nr / 2,
            _ => FAST_WARPS * FAST_ROWS / 2,
        };
        let v = Self::variant_suffix(g.layout, variant, self.preload().ffn);
        self.launch(
            &format!("ffn_{suffix}{v}"),
            (g.rows.div_ceil(per_block) as u32, n_act as u32, 1),
            ((32 * FAST_WARPS) as u32, 1, 1),
            0,
            vec![
                Arg::Ptr(self.ptr(&g.data)),
                Arg::Ptr(self.ptr(&u.data)),
                Arg::I32(g.rows as i32),
                Arg::I64(g.row_bytes as i64),
                Arg::I32(g.cols as i32),
                Arg::Ptr(x),
                Arg::Ptr(h),
                Arg::F32(g.tensor_scale()),
                Arg::F32(u.tensor_scale()),
                Arg::Ptr(0),
                Arg::Ptr(0),
                Arg::F32(0.0),
                Arg::Ptr(0),
            ],
        )?;
        Ok(Some(()))
    }

    /// `y[a, r] = W[r, :] . x[a, :]` on tensor cores: the activations go to
    /// f16 once, the weight is dequantized to f16 in tiles of rows that fit
    /// `GEMM_TILE_BYTES`, and each tile is one cuBLAS GemmEx (f16 inputs,
    /// f32 accumulation and output) writing its columns of `y`.
    fn gemm(&self, w: &CudaMatrix, suffix: &str, x: u64, n_act: usize, y: u64) -> Result<()> {
        let blas = self
            .blas
            .as_ref()
            .ok_or_else(|| bad("cuBLAS is not loaded"))?;
        let (rows, cols) = (w.rows, w.cols);
        let tile_bytes = self
            .gemm_tile_bytes
            .load(std::sync::atomic::Ordering::Relaxed);
        let tile_rows = (tile_bytes / (2 * cols)).max(16) / 16 * 16;
        let tile_rows = tile_rows.min(rows);
        let (px, pw) = {
            let mut s = self.scratch();
            let s = &mut *s;
            (
                self.grow_u16(&mut s.gemm_x, n_act * cols)?,
                self.grow_u16(&mut s.gemm_w, tile_rows * cols)?,
            )
        };
        let n = (n_act * cols) as i64;
        self.launch(
            "f32_to_f16",
            ((n as u64).div_ceil(256) as u32, 1, 1),
            (256, 1, 1),
            0,
            vec![Arg::Ptr(x), Arg::Ptr(px), Arg::I64(n)],
        )?;
        let dq = format!("dequant_f16_{suffix}");
        let (alpha, beta) = (1.0f32, 0.0f32);
        let mut r0 = 0;
        while r0 < rows {
            let rc = tile_rows.min(rows - r0);
            let pdata = Arg::Ptr(self.ptr(&w.data));
            let args = match w.layout {
                Layout::Ggml => vec![
                    pdata,
                    Arg::I64(w.row_bytes as i64),
                    Arg::I32(cols as i32),
                    Arg::I32(r0 as i32),
                    Arg::Ptr(pw),
                ],
                Layout::Q8Split | Layout::Q4KSplit | Layout::Q5Split | Layout::Q6KSplit => vec![
                    pdata,
                    Arg::I32(rows as i32),
                    Arg::I32(cols as i32),
                    Arg::I32(r0 as i32),
                    Arg::Ptr(pw),
                ],
                Layout::Nvfp4 { tensor_scale } => vec![
                    pdata,
                    Arg::I32(rows as i32),
                    Arg::I32(cols as i32),
                    Arg::F32(tensor_scale),
                    Arg::I32(r0 as i32),
                    Arg::Ptr(pw),
                ],
            };
            self.launch(&dq, (rc as u32, 1, 1), (128, 1, 1), 0, args)?;
            // Column-major view: Y^T (rows x n_act, ld rows) = W_tile (cols x
            // rc, transposed) times X^T (cols x n_act).
            use cudarc::cublas::sys::{
                cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType,
            };
            // SAFETY: the pointers hold rc * cols and n_act * cols halves and
            // n_act * rows floats; the handle runs on self.stream.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *blas.handle(),
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    rc as i32,
                    n_act as i32,
                    cols as i32,
                    (&alpha) as *const f32 as *const _,
                    pw as *const _,
                    cudaDataType::CUDA_R_16F,
                    cols as i32,
                    px as *const _,
                    cudaDataType::CUDA_R_16F,
                    cols as i32,
                    (&beta) as *const f32 as *const _,
                    (y + 4 * r0 as u64) as *mut _,
                    cudaDataType::CUDA_R_32F,
                    rows as i32,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| RuntimeError::from(CudaError::Driver(format!("cuBLAS GemmEx: {e:?}"))))?;
            r0 += rc;
        }
        Ok(())
    }

    /// Grows an f16 scratch buffer to `n` elements; returns its address.
    fn grow_u16(&self, slot: &mut Option<CudaSlice<u16>>, n: usize) -> Result<u64> {
        let cap = slot.as_ref().map_or(0, |b| b.len());
        if cap < n {
            let want = n.next_power_of_two();
            *slot = Some(self.stream.alloc_zeros::<u16>(want).map_err(drv)?);
            self.account(MemKind::Workspace, (want - cap) * 2);
        }
        Ok(self.ptr(slot.as_ref().expect("allocated above")))
    }

    fn elementwise(&self, name: &str, n: usize, args: &[u64], width: Option<i32>) -> Result<()> {
        let mut a: Vec<Arg> = args.iter().map(|&p| Arg::Ptr(p)).collect();
        if let Some(w) = width {
            a.push(Arg::I32(w));
        }
        a.push(Arg::I64(n as i64));
        self.launch(name, ((n as u32).div_ceil(256), 1, 1), (256, 1, 1), 0, a)
    }

    fn upload_host_matrix(&self, m: &HostMatrix) -> Result<CudaMatrix> {
        let row_bytes = quant::row_bytes(m.ty, m.cols)?;
        let bytes = m.data.as_slice();
        if bytes.len() != row_bytes * m.rows {
            return Err(bad(format!(
                "{}: {} bytes for {}x{} {}",
                m.name,
                bytes.len(),
                m.rows,
                m.cols,
                m.ty
            )));
        }
        if kernel_suffix(m.ty).is_none() {
            return Err(RuntimeError::UnsupportedType {
                backend: "cuda".into(),
                ty: m.ty,
                what: m.name.clone(),
            });
        }
        if m.cols % 32 != 0 {
            return Err(bad(format!(
                "{}: row length {} is not a multiple of 32",
                m.name, m.cols
            )));
        }
        // The embedding table and the lm head keep their type under NVFP4
        // (they set the logits' fidelity and are read once per token).
        let is_table = m.name == "token_embd.weight" || m.name == "output.weight";
        let repacked;
        let (layout, upload): (Layout, &[u8]) =
            if self.weight_format() == WeightFormat::Nvfp4 && !is_table {
                let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
                let t = quant::Nvfp4Tensor::requantize_parallel(
                    m.ty,
                    bytes,
                    &[m.cols as u64, m.rows as u64],
                    threads,
                )
                .map_err(|e| bad(format!("{}: NVFP4 requantization: {e}", m.name)))?;
                let mut v = t.packed;
                v.extend_from_slice(&t.block_scales);
                repacked = v;
                (
                    Layout::Nvfp4 {
                        tensor_scale: t.tensor_scale,
                    },
                    &repacked,
                )
            } else if m.ty == GgmlType::Q8_0 && self.repacks(m.ty) {
                repacked = crate::superblock::split_q8_0_rows(bytes, m.rows, m.cols)
                    .map_err(|e| bad(format!("{}: {e}", m.name)))?;
                (Layout::Q8Split, &repacked)
            } else if m.ty == GgmlType::Q4_K && self.repacks(m.ty) {
                repacked = split_q4_k_rows(bytes);
                (Layout::Q4KSplit, &repacked)
            } else if m.ty == GgmlType::Q5_0 && self.repacks(m.ty) {
                repacked = split_q5_0_rows(bytes);
                (Layout::Q5Split, &repacked)
            } else if m.ty == GgmlType::Q6_K && self.repacks(m.ty) {
                repacked = split_q6_k_rows(bytes);
                (Layout::Q6KSplit, &repacked)
            } else {
                (Layout::Ggml, bytes)
            };
        let data = self.stream.clone_htod(upload).map_err(drv)?;
        self.account(MemKind::Weights, upload.len());
        Ok(CudaMatrix {
            name: m.name.clone(),
            ty: m.ty,
            rows: m.rows,
            cols: m.cols,
            row_bytes,
            layout,
            data,
        })
    }

    fn slots_ptr(&self, s: &mut Scratch, slots: &[TokenSlot]) -> Result<u64> {
        let host: Vec<i32> = slots
            .iter()
            .flat_map(|t| [t.seq as i32, t.pos as i32])
            .collect();
        let reuse = s.slots_dev.is_some() && s.slots_host == host;
        if !reuse {
            if s.slots_dev.as_ref().is_none_or(|d| d.len() < host.len()) {
                s.slots_dev = Some(
                    self.stream
                        .alloc_zeros::<i32>(host.len().next_power_of_two())
                        .map_err(drv)?,
                );
            }
            let d = s.slots_dev.as_mut().expect("allocated above");
            self.stream
                .memcpy_htod(&host, &mut d.slice_mut(0..host.len()))
                .map_err(drv)?;
            s.slots_host = host;
        }
        Ok(self.ptr(s.slots_dev.as_ref().expect("set above")))
    }
}

/// Device addresses the pruned attention of one layer reads and writes.
struct PrunedPtrs {
    q: u64,
    kc: u64,
    vc: u64,
    slots: u64,
    out: u64,
}

impl CudaBackend {
    /// Grows a scratch slot to `n` elements at least; its device address.
    fn grow_scratch<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        slot: &mut Option<CudaSlice<T>>,
        n: usize,
    ) -> Result<u64> {
        let cap = slot.as_ref().map_or(0, |s| s.len());
        if cap < n.max(1) {
            let want = n.max(1).next_power_of_two();
            *slot = Some(self.stream.alloc_zeros::<T>(want).map_err(drv)?);
            self.account(MemKind::Workspace, (want - cap) * std::mem::size_of::<T>());
        }
        Ok(self.ptr(slot.as_ref().expect("allocated above")))
    }

    /// Rewrites the boxes of the pages the batch `slots` wrote in `layer`
    /// (after rope_store). Inside a recorded step (and for small batches)
    /// one launch reads the positions from device memory; a large eager
    /// batch (prefill) launches per sequence over its range of pages.
    #[allow(clippy::too_many_arguments)]
    fn refresh_page_boxes(
        &self,
        pages: &KvPageBoxes,
        layer: usize,
        slots: &[TokenSlot],
        pslots: u64,
        pkc: u64,
        kv: &str,
        spec: &KvSpec,
    ) -> Result<()> {
        let (pmin, pmax) = (self.ptr(&pages.kmin[layer]), self.ptr(&pages.kmax[layer]));
        let page = pages.cfg.page.min(spec.n_ctx) as i32;
        let (nkv, hd, n_ctx, maxp) = (
            spec.n_head_kv as i32,
            spec.head_dim as i32,
            spec.n_ctx as i32,
            pages.max_pages as i32,
        );
        let n = slots.len();
        if n == 0 {
            return Ok(());
        }
        if n <= GRAPH_MAX_ROWS || self.recording() {
            return self.launch(
                &format!("page_bounds_rows_{kv}"),
                (n as u32, spec.n_head_kv as u32, 1),
                (spec.head_dim as u32, 1, 1),
                0,
                vec![
                    Arg::Ptr(pkc),
                    Arg::Ptr(pslots),
                    Arg::I32(n as i32),
                    Arg::I32(nkv),
                    Arg::I32(hd),
                    Arg::I32(n_ctx),
                    Arg::I32(page),
                    Arg::I32(maxp),
                    Arg::Ptr(pmin),
                    Arg::Ptr(pmax),
                ],
            );
        }
        let mut ranges: std::collections::BTreeMap<usize, (usize, usize)> = Default::default();
        for s in slots {
            let r = ranges.entry(s.seq).or_insert((s.pos, s.pos));
            r.0 = r.0.min(s.pos);
            r.1 = r.1.max(s.pos);
        }
        let page = page as usize;
        for (seq, (lo, hi)) in ranges {
            let (p0, last) = (lo / page, hi / page);
            self.launch(
                &format!("page_bounds_{kv}"),
                ((last - p0 + 1) as u32, spec.n_head_kv as u32, 1),
                (spec.head_dim as u32, 1, 1),
                0,
                vec![
                    Arg::Ptr(pkc),
                    Arg::I32(seq as i32),
                    Arg::I32(nkv),
                    Arg::I32(hd),
                    Arg::I32(n_ctx),
                    Arg::I32(page as i32),
                    Arg::I32(p0 as i32),
                    Arg::I32(hi as i32 + 1),
                    Arg::I32(maxp),
                    Arg::Ptr(pmin),
                    Arg::Ptr(pmax),
                ],
            )?;
        }
        Ok(())
    }

    /// Attention of rows `row_base .. row_base + rows` (of a batch of
    /// `n_rows`) over the pages the cache's rule selects: page keys, radix
    /// select, split-K over the chosen pages, combine (attention_pruned.cu).
    /// Every grid depends on the batch and the cache size only; the
    /// positions are read from `ptrs.slots` on the device.
    #[allow(clippy::too_many_arguments)]
    fn attend_pages(
        &self,
        pages: &KvPageBoxes,
        layer: usize,
        p: &AttentionParams,
        kv: &str,
        spec: &KvSpec,
        ptrs: &PrunedPtrs,
        n_rows: usize,
        row_base: usize,
        rows: usize,
        only_decode: bool,
    ) -> Result<()> {
        let cfg = &pages.cfg;
        let hd = p.head_dim;
        let max_pages = pages.max_pages;
        let max_sel = cfg.max_selected_for(max_pages).min(max_pages).max(1);
        let n_split = max_sel
            .min((ATTEND_TARGET_BLOCKS / (rows * p.n_head)).max(1))
            .max(1);
        let heads = rows * p.n_head;
        let (pkeys, psel, pnsel, ppart) = {
            let mut s = self.scratch();
            let s = &mut *s;
            (
                self.grow_scratch(&mut s.prune_keys, heads * max_pages)?,
                self.grow_scratch(&mut s.prune_sel, heads * max_sel)?,
                self.grow_scratch(&mut s.prune_nsel, heads)?,
                self.grow_scratch(&mut s.prune_part, heads * n_split * (hd + 2))?,
            )
        };
        let clamp = |x: usize| x.min(i32::MAX as usize) as i32;
        let (pmin, pmax) = (self.ptr(&pages.kmin[layer]), self.ptr(&pages.kmax[layer]));
        let (nh, nkv, hdi, n_ctx, page, maxp) = (
            p.n_head as i32,
            p.n_head_kv as i32,
            hd as i32,
            spec.n_ctx as i32,
            cfg.page.min(spec.n_ctx) as i32,
            max_pages as i32,
        );
        let (sinks, recent) = (clamp(cfg.sink_pages), clamp(cfg.recent_pages));
        let (od, nr, rb) = (only_decode as i32, n_rows as i32, row_base as i32);
        self.launch(
            "page_keys",
            (
                rows as u32,
                p.n_head as u32,
                max_pages.div_ceil(crate::kv_pruning::KEY_THREADS as usize) as u32,
            ),
            (crate::kv_pruning::KEY_THREADS, 1, 1),
            0,
            vec![
                Arg::Ptr(ptrs.q),
                Arg::Ptr(ptrs.slots),
                Arg::Ptr(pmin),
                Arg::Ptr(pmax),
                Arg::I32(nh),
                Arg::I32(nkv),
                Arg::I32(hdi),
                Arg::I32(page),
                Arg::I32(maxp),
                Arg::I32(sinks),
                Arg::I32(recent),
                Arg::I32(od),
                Arg::I32(nr),
                Arg::I32(rb),
                Arg::Ptr(pkeys),
            ],
        )?;
        self.launch(
            "select_pages",
            (rows as u32, p.n_head as u32, 1),
            (crate::kv_pruning::SEL_THREADS, 1, 1),
            0,
            vec![
                Arg::Ptr(pkeys),
                Arg::Ptr(ptrs.slots),
                Arg::I32(nh),
                Arg::I32(page),
                Arg::I32(maxp),
                Arg::I32(sinks),
                Arg::I32(recent),
                Arg::I32(clamp(cfg.top_pages)),
                Arg::I32(clamp(cfg.top_percent)),
                Arg::I32(max_sel as i32),
                Arg::I32(od),
                Arg::I32(nr),
                Arg::I32(rb),
                Arg::Ptr(psel),
                Arg::Ptr(pnsel),
            ],
        )?;
        self.launch(
            &format!("attend_pages_part_{kv}"),
            (rows as u32, p.n_head as u32, n_split as u32),
            (ATTEND_THREADS, 1, 1),
            0,
            vec![
                Arg::Ptr(ptrs.q),
                Arg::Ptr(ptrs.kc),
                Arg::Ptr(ptrs.vc),
                Arg::Ptr(ptrs.slots),
                Arg::Ptr(psel),
                Arg::Ptr(pnsel),
                Arg::I32(nh),
                Arg::I32(nkv),
                Arg::I32(hdi),
                Arg::I32(n_ctx),
                Arg::I32(page),
                Arg::I32(max_sel as i32),
                Arg::I32(od),
                Arg::I32(nr),
                Arg::I32(rb),
                Arg::F32(1.0 / (hd as f32).sqrt()),
                Arg::Ptr(ppart),
            ],
        )?;
        self.launch(
            "attend_pages_combine",
            (rows as u32, p.n_head as u32, 1),
            (hd as u32, 1, 1),
            0,
            vec![
                Arg::Ptr(ppart),
                Arg::Ptr(ptrs.slots),
                Arg::I32(nh),
                Arg::I32(hdi),
                Arg::I32(n_split as i32),
                Arg::I32(od),
                Arg::I32(nr),
                Arg::I32(rb),
                Arg::Ptr(ptrs.out),
            ],
        )
    }
}

impl Backend for CudaBackend {
    type Matrix = CudaMatrix;
    type Vector = CudaVector;
    type Ffn = CudaFfn;
    type Activations = CudaActivations;
    type KvCache = CudaKvCache;

    fn name(&self) -> String {
        "cuda".into()
    }

    fn step<R>(&self, inputs: &StepInputs<'_>, pass: impl FnOnce() -> Result<R>) -> Result<R> {
        let n = inputs.tokens.len();
        {
            let mut st = self.step_state();
            let st = &mut *st;
            if st.staged.is_some() {
                return Err(bad("a step started inside another step"));
            }
            st.host.clear();
            st.host.extend(inputs.tokens.iter().map(|&t| t as i32));
            st.host.extend(
                inputs
                    .slots
                    .iter()
                    .flat_map(|t| [t.seq as i32, t.pos as i32]),
            );
            st.host.extend(inputs.logits_rows.iter().map(|&r| r as i32));
            let len = st.host.len().max(1);
            if st.inputs_dev.as_ref().is_none_or(|d| d.len() < len) {
                let cap = st.inputs_dev.as_ref().map_or(0, |d| d.len());
                let want = len.next_power_of_two().max(64);
                st.inputs_dev = Some(self.stream.alloc_zeros::<i32>(want).map_err(drv)?);
                self.account(MemKind::Workspace, (want - cap) * 4);
            }
            let dev = st.inputs_dev.as_mut().expect("allocated above");
            if !st.host.is_empty() {
                // The one host-to-device copy of the step, queued before its
                // launches (or its graph).
                self.stream
                    .memcpy_htod(&st.host, &mut dev.slice_mut(0..st.host.len()))
                    .map_err(drv)?;
            }
            let base = self.ptr(dev);
            st.staged = Some(Staged {
                tokens: inputs.tokens.to_vec(),
                slots: inputs.slots.to_vec(),
                rows: inputs.logits_rows.to_vec(),
                base,
            });
            if self.graphs() && n <= GRAPH_MAX_ROWS {
                let hint = st.graphs.first().map_or(0, |g| g.launches.len());
                st.recording = Some(Vec::with_capacity(hint));
            } else {
                st.stats.eager += 1;
            }
        }
        let out = pass();
        let mut st = self.step_state();
        st.staged = None;
        // A hint no op issued does not outlive its pass.
        st.pending_prefetch.clear();
        if let Some(pn) = st.pending_norm.take() {
            let k = self.kernel_index["rms_norm"];
            if let Some(rec) = st.recording.as_mut() {
                rec.push(pn.launch(k));
            }
        }
        let launches = st.recording.take();
        let out = out?;
        if let Some(launches) = launches {
            let launches = if self.attention_block() {
                self.fuse_attention_blocks(launches)?
            } else {
                launches
            };
            self.run_recorded(&mut st, launches)?;
        }
        Ok(out)
    }

    fn upload_matrix(&self, m: &HostMatrix) -> Result<CudaMatrix> {
        self.upload_host_matrix(m)
    }

    fn upload_vector(&self, v: &[f32]) -> Result<CudaVector> {
        let data = self.stream.clone_htod(v).map_err(drv)?;
        self.account(MemKind::Weights, v.len() * 4);
        Ok(CudaVector { len: v.len(), data })
    }

    fn upload_ffn(
        &self,
        _layer: usize,
        gate: &HostMatrix,
        up: &HostMatrix,
        down: &HostMatrix,
    ) -> Result<CudaFfn> {
        if gate.rows != up.rows
            || gate.cols != up.cols
            || down.cols != gate.rows
            || down.rows != gate.cols
        {
            return Err(bad(format!(
                "FFN shapes disagree: gate {}x{}, up {}x{}, down {}x{}",
                gate.rows, gate.cols, up.rows, up.cols, down.rows, down.cols
            )));
        }
        Ok(CudaFfn {
            gate: self.upload_host_matrix(gate)?,
            up: self.upload_host_matrix(up)?,
            down: self.upload_host_matrix(down)?,
        })
    }

    fn new_kv_cache(&self, spec: KvSpec) -> Result<CudaKvCache> {
        if spec.head_dim == 0 || spec.n_ctx == 0 || spec.n_seq == 0 {
            return Err(bad(format!("empty KV cache shape {spec:?}")));
        }
        if spec.dtype == KvDtype::Q8_0 {
            return Err(bad("a q8_0 KV cache has no CUDA kernels (use f16)"));
        }
        let per_layer = spec
            .n_seq
            .checked_mul(spec.n_head_kv)
            .and_then(|x| x.checked_mul(spec.n_ctx))
            .and_then(|x| x.checked_mul(spec.head_dim))
            .and_then(|x| {
                x.checked_mul(match spec.dtype {
                    KvDtype::F32 => 4,
                    // q8_0 is refused above.
                    KvDtype::F16 | KvDtype::Q8_0 => 2,
                })
            })
            .ok_or_else(|| bad("KV cache size overflows"))?;
        // Refused with both sizes named, before the first of 2 x n_layer
        // allocations (a failed one would say only "out of memory").
        let needed = (per_layer as u64).saturating_mul(2 * spec.n_layer as u64);
        let (free, _) = self.device_memory()?;
        if needed > free as u64 {
            return Err(mirage_runtime::RuntimeError::OutOfMemory {
                what: format!("{} on the GPU", spec.describe()),
                needed,
                available: free as u64,
            });
        }
        let mut k = Vec::with_capacity(spec.n_layer);
        let mut v = Vec::with_capacity(spec.n_layer);
        for _ in 0..spec.n_layer {
            k.push(self.stream.alloc_zeros::<u8>(per_layer).map_err(drv)?);
            v.push(self.stream.alloc_zeros::<u8>(per_layer).map_err(drv)?);
        }
        self.account(MemKind::Kv, 2 * spec.n_layer * per_layer);
        Ok(CudaKvCache {
            spec,
            k,
            v,
            pages: None,
        })
    }

    fn new_kv_cache_pruned(&self, spec: KvSpec, pruning: Option<KvPruning>) -> Result<CudaKvCache> {
        let mut cache = self.new_kv_cache(spec)?;
        let Some(cfg) = pruning else {
            return Ok(cache);
        };
        cfg.validate()?;
        let max_pages = spec.n_ctx.div_ceil(cfg.page);
        let per_layer = spec
            .n_seq
            .checked_mul(spec.n_head_kv)
            .and_then(|x| x.checked_mul(max_pages))
            .and_then(|x| x.checked_mul(spec.head_dim))
            .filter(|&x| x <= i32::MAX as usize)
            .ok_or_else(|| bad("KV page boxes size overflows"))?;
        let (mut kmin, mut kmax) = (Vec::new(), Vec::new());
        for _ in 0..spec.n_layer {
            kmin.push(
                self.stream
                    .alloc_zeros::<f32>(per_layer.max(1))
                    .map_err(drv)?,
            );
            kmax.push(
                self.stream
                    .alloc_zeros::<f32>(per_layer.max(1))
                    .map_err(drv)?,
            );
        }
        self.account(MemKind::Kv, 2 * spec.n_layer * per_layer * 4);
        cache.pages = Some(KvPageBoxes {
            cfg,
            active: true,
            max_pages,
            kmin,
            kmax,
        });
        Ok(cache)
    }

    fn kv_set_pruning(&self, cache: &mut CudaKvCache, pruning: Option<KvPruning>) -> Result<()> {
        let Some(cfg) = pruning else {
            // Full attention from the next step; the boxes keep being
            // refreshed on every write.
            if let Some(pages) = &mut cache.pages {
                pages.active = false;
            }
            return Ok(());
        };
        cfg.validate()?;
        let Some(pages) = &mut cache.pages else {
            return Err(bad(
                "this CUDA KV cache keeps no page boxes: make it with new_kv_cache_pruned(spec, Some(..)) to switch pruning on",
            ));
        };
        if cfg.page != pages.cfg.page {
            return Err(bad(format!(
                "KV page size {} differs from the {} the cache's page boxes were made with",
                cfg.page, pages.cfg.page
            )));
        }
        // Same page size, so the same boxes and max_pages. The other fields
        // only enter the selection kernels' arguments and the scratch sizes,
        // both computed from `cfg` at every launch; a changed launch list
        // is recorded as another graph (`run_recorded` compares launches).
        pages.cfg = cfg;
        pages.active = true;
        Ok(())
    }

    fn kv_truncate(&self, _cache: &mut CudaKvCache, _seq: usize, _pos: usize) {
        // Attention reads positions 0..=pos of each query row, so stale
        // entries past a truncation are never read before being rewritten.
        // Page boxes need nothing either: every write recomputes the box of
        // its page from the cached positions 0..=pos (the page cut by the
        // truncation included), and pages past a row's position are never
        // read.
    }

    fn new_activations(&self) -> CudaActivations {
        CudaActivations::default()
    }

    fn embed(&self, table: &CudaMatrix, tokens: &[u32], out: &mut CudaActivations) -> Result<()> {
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= table.rows) {
            return Err(bad(format!("token id {t} >= vocabulary {}", table.rows)));
        }
        let suffix = kernel_suffix(table.ty).ok_or_else(|| RuntimeError::UnsupportedType {
            backend: "cuda".into(),
            ty: table.ty,
            what: table.name.clone(),
        })?;
        let po = self.reshape(out, tokens.len(), table.cols)?;
        let pt = match self.staged(|s| (s.tokens == tokens).then_some(s.base))? {
            Some(p) => p,
            None => {
                let mut s = self.scratch();
                self.upload_u32(&mut s.indices, tokens)?
            }
        };
        let pw = Arg::Ptr(self.ptr(&table.data));
        let (rows, cols) = (Arg::I32(table.rows as i32), Arg::I32(table.cols as i32));
        let (kernel, args) = match table.layout {
            Layout::Ggml => (
                format!("embed_{suffix}"),
                vec![
                    pw,
                    Arg::I64(table.row_bytes as i64),
                    rows,
                    cols,
                    Arg::Ptr(pt),
                    Arg::Ptr(po),
                ],
            ),
            Layout::Q8Split => (
                "embed_q8_0s".to_string(),
                vec![pw, rows, cols, Arg::Ptr(pt), Arg::Ptr(po)],
            ),
            Layout::Q4KSplit => (
                "embed_q4_ks".to_string(),
                vec![pw, rows, cols, Arg::Ptr(pt), Arg::Ptr(po)],
            ),
            Layout::Q5Split => (
                "embed_q5_0s".to_string(),
                vec![pw, rows, cols, Arg::Ptr(pt), Arg::Ptr(po)],
            ),
            Layout::Q6KSplit => (
                "embed_q6_ks".to_string(),
                vec![pw, rows, cols, Arg::Ptr(pt), Arg::Ptr(po)],
            ),
            Layout::Nvfp4 { tensor_scale } => (
                "embed_nvfp4".to_string(),
                vec![
                    pw,
                    rows,
                    cols,
                    Arg::F32(tensor_scale),
                    Arg::Ptr(pt),
                    Arg::Ptr(po),
                ],
            ),
        };
        self.launch(&kernel, (tokens.len() as u32, 1, 1), (128, 1, 1), 0, args)
    }

    fn rms_norm(
        &self,
        x: &CudaActivations,
        weight: &CudaVector,
        eps: f32,
        out: &mut CudaActivations,
    ) -> Result<()> {
        if weight.len != x.width {
            return Err(bad("norm weight width"));
        }
        let px = self.act_ptr(x)?;
        let po = self.reshape(out, x.rows, x.width)?;
        if self.fuse_norm() && x.width <= FUSED_NORM_MAX_WIDTH && px != po {
            let mut st = self.step_state();
            if st.recording.is_some() {
                let pn = PendingNorm {
                    x: px,
                    w: self.ptr(&weight.data),
                    eps,
                    rows: x.rows,
                    width: x.width,
                    out: po,
                };
                if let Some(prev) = st.pending_norm.replace(pn) {
                    let k = self.kernel_index["rms_norm"];
                    st.recording
                        .as_mut()
                        .expect("checked above")
                        .push(prev.launch(k));
                }
                return Ok(());
            }
        }
        self.launch(
            "rms_norm",
            (x.rows as u32, 1, 1),
            (256, 1, 1),
            0,
            vec![
                Arg::Ptr(px),
                Arg::Ptr(self.ptr(&weight.data)),
                Arg::F32(eps),
                Arg::I32(x.width as i32),
                Arg::Ptr(po),
            ],
        )
    }

    fn matmul(&self, w: &CudaMatrix, x: &CudaActivations, out: &mut CudaActivations) -> Result<()> {
        if x.width != w.cols {
            return Err(bad(format!(
                "{}: input width {} != {}",
                w.name, x.width, w.cols
            )));
        }
        let px = self.act_ptr(x)?;
        let py = self.reshape(out, x.rows, w.rows)?;
        self.matvec(w, px, x.rows, py)
    }

    fn matmul_many(
        &self,
        ws: &[&CudaMatrix],
        x: &CudaActivations,
        outs: &mut [&mut CudaActivations],
    ) -> Result<()> {
        if ws.len() != outs.len() {
            return Err(bad(format!(
                "{} matrices for {} outputs",
                ws.len(),
                outs.len()
            )));
        }
        if !self.fast_decode() || self.use_gemm(x.rows) {
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                self.matmul(w, x, out)?;
            }
            return Ok(());
        }
        if let Some(w) = ws.iter().find(|w| w.cols != x.width) {
            return Err(bad(format!(
                "{}: input width {} != {}",
                w.name, x.width, w.cols
            )));
        }
        let px = self.act_ptr(x)?;
        let mut ys = Vec::with_capacity(ws.len());
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            ys.push(self.reshape(out, x.rows, w.rows)?);
        }
        // Runs of up to three matrices read by the same kernel share a launch.
        let mut i = 0;
        while i < ws.len() {
            let mut j = i + 1;
            while j < ws.len() && j - i < 3 && ws[j].fast_suffix() == ws[i].fast_suffix() {
                j += 1;
            }
            self.mv3(&ws[i..j], px, x.rows, &ys[i..j])?;
            i = j;
        }
        Ok(())
    }

    fn add_bias(&self, x: &mut CudaActivations, bias: &CudaVector) -> Result<()> {
        if bias.len != x.width {
            return Err(bad("bias width"));
        }
        let px = self.act_ptr(x)?;
        if self.fold_epilogue(px, x.rows, self.ptr(&bias.data), false) {
            return Ok(());
        }
        self.elementwise(
            "add_bias",
            x.rows * x.width,
            &[px, self.ptr(&bias.data)],
            Some(x.width as i32),
        )
    }

    fn add(&self, acc: &mut CudaActivations, x: &CudaActivations) -> Result<()> {
        if acc.rows != x.rows || acc.width != x.width {
            return Err(bad("residual shapes differ"));
        }
        let (pa, px) = (self.act_ptr(acc)?, self.act_ptr(x)?);
        if pa != px && self.fold_epilogue(px, x.rows, pa, true) {
            return Ok(());
        }
        self.elementwise("add_inplace", acc.rows * acc.width, &[pa, px], None)
    }

    fn attention(
        &self,
        layer: usize,
        p: &AttentionParams,
        q: &mut CudaActivations,
        k: &mut CudaActivations,
        v: &CudaActivations,
        qk_norm: Option<QkNorm<'_, CudaVector>>,
        slots: &[TokenSlot],
        cache: &mut CudaKvCache,
        out: &mut CudaActivations,
    ) -> Result<()> {
        // The output projection's weights (hinted by the runtime) stream
        // into L2 while the attention reads only the cache.
        self.emit_prefetch(PrefetchSite::Attention);
        let hd = p.head_dim;
        let n = slots.len();
        if p.n_head_kv == 0
            || p.n_head % p.n_head_kv != 0
            || hd % 64 != 0
            || hd > ATTEND_THREADS as usize
        {
            return Err(bad(format!(
                "attention shape {p:?} (the cuda kernels need head_dim a multiple of 64, at most {ATTEND_THREADS})"
            )));
        }
        if q.rows != n
            || k.rows != n
            || v.rows != n
            || q.width != p.n_head * hd
            || k.width != p.n_head_kv * hd
            || v.width != k.width
        {
            return Err(bad("attention inputs do not match the batch"));
        }
        let spec = cache.spec;
        if spec.head_dim != hd || spec.n_head_kv != p.n_head_kv || layer >= spec.n_layer {
            return Err(bad("KV cache shape does not match the layer"));
        }
        let max_pos = slots.iter().map(|s| s.pos).max().unwrap_or(0);
        if max_pos >= spec.n_ctx {
            return Err(RuntimeError::ContextFull { n_ctx: spec.n_ctx });
        }
        if let Some(s) = slots.iter().find(|s| s.seq >= spec.n_seq) {
            return Err(bad(format!("sequence slot {} >= {}", s.seq, spec.n_seq)));
        }
        // The split count depends on the batch and the cache size only, so a
        // recorded decode step replays at every position.
        let n_split = spec
            .n_ctx
            .div_ceil(attend_min_chunk())
            .min((ATTEND_TARGET_BLOCKS / (n * p.n_head)).max(1))
            .max(1);
        let chunk = spec.n_ctx.div_ceil(n_split);
        let pslots = match self
            .staged(|s| (s.slots == slots).then_some(s.base + 4 * s.tokens.len() as u64))?
        {
            Some(p) => p,
            None => {
                let mut s = self.scratch();
                self.slots_ptr(&mut s, slots)?
            }
        };
        let ppart = {
            let mut s = self.scratch();
            self.reshape(&mut s.attn_part, n * p.n_head * n_split, hd + 2)?
        };
        let (pq, pk, pv) = (self.act_ptr(q)?, self.act_ptr(k)?, self.act_ptr(v)?);
        let (pqn, pkn) = match &qk_norm {
            Some(nm) => (self.ptr(&nm.q.data), self.ptr(&nm.k.data)),
            None => (0u64, 0u64),
        };
        let (pkc, pvc) = (self.ptr(&cache.k[layer]), self.ptr(&cache.v[layer]));
        let kv = match spec.dtype {
            KvDtype::F32 => "f32",
            // new_kv_cache refuses q8_0.
            KvDtype::F16 | KvDtype::Q8_0 => "f16",
        };
        let (nh, nkv, hdi, n_ctx) = (
            p.n_head as i32,
            p.n_head_kv as i32,
            hd as i32,
            spec.n_ctx as i32,
        );
        if !p.rope_scaling.is_none() {
            // rope_store computes the unscaled angles on the device.
            return Err(bad(format!(
                "RoPE scaling {:?} is not implemented on CUDA",
                p.rope_scaling.kind
            )));
        }
        // The RoPE and KV store fold into the one-launch attention (the
        // same bits) when nothing else reads the cache in between (no page
        // boxes), there is no per-head q/k norm and no row attends another
        // row's new key (each row in its own sequence).
        let rope_in_attention = self
            .rope_in_attention
            .load(std::sync::atomic::Ordering::Relaxed)
            && self.fused_attention()
            && qk_norm.is_none()
            && cache.pages.is_none()
            && slots
                .iter()
                .enumerate()
                .all(|(i, a)| slots[..i].iter().all(|b| b.seq != a.seq));
        let neox = (p.rope_mode == RopeMode::Neox) as i32;
        if !rope_in_attention {
            self.launch(
                &format!("rope_store_{kv}"),
                (n as u32, (p.n_head + p.n_head_kv) as u32, 1),
                ((hd / 2) as u32, 1, 1),
                0,
                vec![
                    Arg::Ptr(pq),
                    Arg::Ptr(pk),
                    Arg::Ptr(pv),
                    Arg::Ptr(pslots),
                    Arg::I32(nh),
                    Arg::I32(nkv),
                    Arg::I32(hdi),
                    Arg::I32(neox),
                    Arg::F32(p.rope_freq_base),
                    Arg::Ptr(pqn),
                    Arg::Ptr(pkn),
                    Arg::F32(p.norm_eps),
                    Arg::Ptr(pkc),
                    Arg::Ptr(pvc),
                    Arg::I32(n_ctx),
                ],
            )?;
        }
        let po = self.reshape(out, n, p.n_head * hd)?;
        let scale = 1.0 / (hd as f32).sqrt();
        // KV-page pruning: the boxes of the pages this batch wrote, then
        // which rows attend selected pages only — decode rows, the only row
        // of their sequence, as on the CPU (attention_pruned::decode_rows).
        // `Some(false)`: every row; `Some(true)`: a mixed batch, the kernels
        // skip rows that share their sequence; those attend every position.
        let mut pruned = None;
        if let Some(pages) = &cache.pages {
            // Refreshed even while the selection is off, so that switching
            // it back on finds exact boxes.
            self.refresh_page_boxes(pages, layer, slots, pslots, pkc, kv, &spec)?;
            if pages.active && layer >= pages.cfg.dense_layers {
                let decode = mirage_runtime::attention_pruned::decode_rows(slots);
                if decode.iter().all(|&d| d) {
                    pruned = Some(false);
                } else if decode.iter().any(|&d| d) {
                    pruned = Some(true);
                }
            }
        }
        // A prefill batch of one sequence's consecutive positions: the tiled
        // kernel reads each key once per 16 query rows, not once per row.
        let tiled = pruned != Some(false)
            && n >= PREFILL_ROWS
            && hd <= PREFILL_MAX_HEAD_DIM
            && hd % 16 == 0
            && self.tiled_prefill_attention()
            && slots
                .windows(2)
                .all(|w| w[1].seq == w[0].seq && w[1].pos == w[0].pos + 1);
        if tiled {
            self.launch(
                &format!("attend_prefill_{kv}"),
                (n.div_ceil(PREFILL_ROWS) as u32, p.n_head as u32, 1),
                (PREFILL_THREADS, 1, 1),
                0,
                vec![
                    Arg::Ptr(pq),
                    Arg::Ptr(pkc),
                    Arg::Ptr(pvc),
                    Arg::Ptr(pslots),
                    Arg::I32(n as i32),
                    Arg::I32(nh),
                    Arg::I32(nkv),
                    Arg::I32(hdi),
                    Arg::I32(n_ctx),
                    Arg::F32(scale),
                    Arg::Ptr(po),
                ],
            )?;
        }
        // attend_part's arguments; attend_fused takes its counters and the
        // output after them, attend_rope those and its RoPE inputs.
        let part_args = || {
            vec![
                Arg::Ptr(pq),
                Arg::Ptr(pkc),
                Arg::Ptr(pvc),
                Arg::Ptr(pslots),
                Arg::I32(nh),
                Arg::I32(nkv),
                Arg::I32(hdi),
                Arg::I32(n_ctx),
                Arg::I32(chunk as i32),
                Arg::F32(scale),
                Arg::Ptr(ppart),
            ]
        };
        if pruned != Some(false) && !tiled && self.fused_attention() {
            // attend_part and attend_combine in one launch (the same bits).
            let pcount = {
                let mut s = self.scratch();
                self.grow_scratch(&mut s.attn_count, n * p.n_head)?
            };
            let mut args = part_args();
            args.extend([Arg::Ptr(pcount), Arg::Ptr(po)]);
            let kernel = if rope_in_attention {
                // attend_rope: then the unrotated k and v, mode and base.
                args.extend([
                    Arg::Ptr(pk),
                    Arg::Ptr(pv),
                    Arg::I32(neox),
                    Arg::F32(p.rope_freq_base),
                ]);
                // With the preload on, the variant that reads the position,
                // its RoPE angle and the first keys and values before its
                // PDL wait (the same bits).
                let pre = if self.preload().attention { "_pre" } else { "" };
                format!("attend_rope{pre}_{kv}")
            } else {
                format!("attend_fused_{kv}")
            };
            self.launch(
                &kernel,
                (n as u32, p.n_head as u32, n_split as u32),
                (ATTEND_THREADS, 1, 1),
                0,
                args,
            )?;
        } else if pruned != Some(false) && !tiled {
            self.launch(
                &format!("attend_part_{kv}"),
                (n as u32, p.n_head as u32, n_split as u32),
                (ATTEND_THREADS, 1, 1),
                0,
                part_args(),
            )?;
            self.launch(
                "attend_combine",
                (n as u32, p.n_head as u32, 1),
                (hd as u32, 1, 1),
                0,
                vec![
                    Arg::Ptr(ppart),
                    Arg::Ptr(pslots),
                    Arg::I32(nh),
                    Arg::I32(hdi),
                    Arg::I32(n_split as i32),
                    Arg::I32(chunk as i32),
                    Arg::Ptr(po),
                ],
            )?;
        }
        if let (Some(only_decode), Some(pages)) = (pruned, &cache.pages) {
            let ptrs = PrunedPtrs {
                q: pq,
                kc: pkc,
                vc: pvc,
                slots: pslots,
                out: po,
            };
            if only_decode && n > GRAPH_MAX_ROWS {
                // A large mixed batch (never recorded): one launch per decode
                // row, so that the scratch is sized for one row, not the
                // whole prefill.
                let decode = mirage_runtime::attention_pruned::decode_rows(slots);
                for (row, _) in decode.iter().enumerate().filter(|(_, &d)| d) {
                    self.attend_pages(pages, layer, p, kv, &spec, &ptrs, n, row, 1, false)?;
                }
            } else {
                self.attend_pages(pages, layer, p, kv, &spec, &ptrs, n, 0, n, only_decode)?;
            }
        }
        Ok(())
    }

    fn ffn(&self, f: &CudaFfn, x: &CudaActivations, out: &mut CudaActivations) -> Result<()> {
        if x.width != f.gate.cols {
            return Err(bad(format!(
                "ffn input width {} != {}",
                x.width, f.gate.cols
            )));
        }
        let n = x.rows;
        let n_ff = f.gate.rows;
        let px = self.act_ptr(x)?;
        // The scratch lock is released before the products: the GEMM path
        // takes it again for its f16 buffers.
        let (pg, pu, ph) = {
            let mut s = self.scratch();
            let s = &mut *s;
            (
                self.reshape(&mut s.gate, n, n_ff)?,
                self.reshape(&mut s.up, n, n_ff)?,
                self.reshape(&mut s.hidden, n, n_ff)?,
            )
        };
        let fused = if self.fast_decode() && !self.use_gemm(n) {
            self.ffn_gate_up(f, px, n, ph)?
        } else {
            None
        };
        if fused.is_none() {
            self.matvec(&f.gate, px, n, pg)?;
            self.matvec(&f.up, px, n, pu)?;
            self.elementwise("swiglu", n * n_ff, &[pg, pu, ph], None)?;
        }
        // The next layer's Q/K/V weights (hinted by the runtime) while the
        // down projection runs.
        self.emit_prefetch(PrefetchSite::Ffn);
        let po = self.reshape(out, n, f.down.rows)?;
        self.matvec(&f.down, ph, n, po)
    }

    fn select_rows(
        &self,
        x: &CudaActivations,
        rows: &[usize],
        out: &mut CudaActivations,
    ) -> Result<()> {
        if let Some(&r) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(bad(format!("row {r} >= {}", x.rows)));
        }
        let px = self.act_ptr(x)?;
        let po = self.reshape(out, rows.len(), x.width)?;
        if rows.is_empty() {
            return Ok(());
        }
        let pi = match self
            .staged(|s| (s.rows == rows).then_some(s.base + 12 * s.tokens.len() as u64))?
        {
            Some(p) => p,
            None => {
                let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
                let mut s = self.scratch();
                self.upload_u32(&mut s.indices, &idx)?
            }
        };
        self.launch(
            "gather_rows",
            (rows.len() as u32, 1, 1),
            (256, 1, 1),
            0,
            vec![
                Arg::Ptr(px),
                Arg::Ptr(pi),
                Arg::I32(x.width as i32),
                Arg::Ptr(po),
            ],
        )
    }

    fn prefetch(&self, ws: &[&CudaMatrix]) -> Result<()> {
        let regions: Vec<(u64, usize)> =
            ws.iter().map(|m| (self.ptr(&m.data), m.bytes())).collect();
        self.hint_prefetch(&regions);
        Ok(())
    }

    fn read(&self, x: &CudaActivations, out: &mut Vec<f32>) -> Result<(usize, usize)> {
        let n = x.rows * x.width;
        out.clear();
        out.resize(n, 0.0);
        if n > 0 {
            let buf = x
                .buf
                .as_ref()
                .ok_or_else(|| bad("read of an unwritten buffer"))?;
            self.stream
                .memcpy_dtoh(&buf.slice(0..n), out.as_mut_slice())
                .map_err(drv)?;
            self.stream.synchronize().map_err(drv)?;
        }
        Ok((x.rows, x.width))
    }
}

// The sparse (superblock) backend: a child module so that its launches go
// through this backend's launch/graph recorder without widening its API.
#[path = "sparse_backend.rs"]
pub mod sparse_backend;
