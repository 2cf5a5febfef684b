//! [`SparseCudaBackend`]: the superblock (page-major, sparse FFN) backend on
//! CUDA. Every op but the FFN is [`CudaBackend`]'s, on the same context and
//! stream; the FFN runs the fused page kernel of `cuda/superblock.cu` (or
//! `cuda/superblock_q2k.cu`, per [`PageFormat`]) over a
//! per-layer active page list that lives in device memory, written either
//! once (all pages, a prefix by hotness, a forced random subset) or per
//! token by the BVH traversal of `cuda/route.cu` (routed mode). No op of a
//! decode step reads anything back to the host, so the whole sparse step,
//! routing included, is recorded and replayed as one CUDA graph by
//! [`CudaBackend`]'s `Backend::step`.
//!
//! This module is a child of `backend` so that its launches go through
//! `CudaBackend::launch` (and so into the recorded graph) without widening
//! `CudaBackend`'s API: the sparse kernels are loaded into the same function
//! table at construction.
//!
//! The fused kernel's gate/up/SwiGLU phase and its down phase are two
//! launches of the same kernel (`phases` 1 then 2, same grid): the kernel
//! boundary is the barrier between them.

use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUevent_flags, CUfunction_attribute};
use cudarc::driver::CudaSlice;
use mirage_artifact::Artifact;
use mirage_gguf::quant;
use mirage_gguf::GgmlType;
use mirage_route::{Bvh, BvhNode, BvhPrim, RouterData};
use mirage_runtime::backend::{
    AttentionParams, Backend, HostMatrix, QkNorm, StepInputs, TokenSlot,
};
use mirage_runtime::kv_cache::KvSpec;
use mirage_runtime::{Result, RuntimeError};

use super::{
    bad, drv, Arg, CudaActivations, CudaBackend, CudaKvCache, CudaMatrix, CudaVector, MemKind,
    PrefetchSite,
};
use crate::superblock::{
    ffn_partials_len, nvfp4_page_bytes, q8_0_page_bytes, split_q8_0_page, Nvfp4Pages, SparseError,
    PAGE_CHANNELS,
};
use crate::superblock_q2k::{join_q2k_rows, q2k_page_bytes, Q2kPages, Q2K_BLOCK, Q2K_MAX_D};
use crate::{module, CudaError};

/// Sources of the sparse backend's module: NVFP4 helpers, the fused FFNs
/// (Q8_0 and NVFP4, then Q2_K), the router.
pub(crate) const SOURCE: &str = concat!(
    include_str!("../../../cuda/pdl.cu"),
    "\n",
    include_str!("../../../cuda/norm.cu"),
    "\n",
    include_str!("../../../cuda/nvfp4.cu"),
    "\n",
    include_str!("../../../cuda/superblock.cu"),
    "\n",
    include_str!("../../../cuda/superblock_q2k.cu"),
    "\n",
    include_str!("../../../cuda/route.cu")
);
/// Every kernel of [`SOURCE`] the backend loads.
pub(crate) const KERNELS: &[&str] = &[
    "superblock_ffn_q8s",
    "superblock_ffn_nvfp4",
    "superblock_ffn_q2k",
    "route_bvh",
];

/// Arguments of the fused Q8_0 FFN as `launch_ffn` passes them
/// (`SB_Q8S_PARAMS`, `part_ch`, the folded norm's three); the crate's
/// `nvrtc_check` test holds the kernel's PTX parameter list to it.
pub(crate) const Q8_FFN_ARGS: usize = 18;
/// Arguments of `route_bvh` as `launch_route` passes them (the router's 16,
/// then the folded norm's weights, eps and output); `nvrtc_check` holds the
/// kernel's PTX parameter list to it, `launch_route` its argument list.
pub(crate) const ROUTE_ARGS: usize = 19;
/// Arguments of the other fused FFN kernels: `SB_Q8S_PARAMS` (14; Q2_K's
/// are the same) and NVFP4's three tensor scales on top.
pub(crate) const FFN_KERNEL_ARGS: usize = 14;

/// Where a kernel takes the RMSNorm before it (`CudaBackend::fold_norm`):
/// the fused Q8_0 FFN (`superblock_ffn_q8s`: x at 4, d at 3, then after
/// `part_ch` (14) the folded norm's weights, eps and output) and the router
/// (`route_bvh`: x at 0, d at 1, the norm's three after `count` (15));
/// `None` for the other kernels.
fn ffn_norm_slots(kernel: &str) -> Option<crate::backend::NormSlots> {
    use crate::backend::NormSlots;
    match kernel {
        "route_bvh" => Some(NormSlots {
            x: 0,
            width: 1,
            nw: 16,
        }),
        "superblock_ffn_q8s" => Some(NormSlots {
            x: 4,
            width: 3,
            nw: 15,
        }),
        _ => None,
    }
}

/// `(accumulate, y)` argument positions of the fused FFN kernels as
/// `launch_ffn` passes them (NVFP4's three tensor scales come before x), so
/// that a recorded step folds the residual add after the FFN into its last
/// phase (`y = FFN + residual`, `CudaBackend::fold_epilogue`); `None` for the
/// router kernels.
fn ffn_accumulate_slots(kernel: &str) -> Option<(usize, usize)> {
    if kernel == "superblock_ffn_nvfp4" {
        Some((11, 15))
    } else if kernel.starts_with("superblock_ffn_") {
        Some((8, 12))
    } else {
        None
    }
}

/// Threads per block of the fused FFN (`SB_THREADS`) and the router.
const FFN_THREADS: u32 = 256;
pub(crate) const ROUTE_THREADS: u32 = 512;

/// Largest router (leaf primitives = pages x slices) that `route_bvh` tests
/// primitive by primitive (one thread each, a few rounds of 512) instead of
/// walking the BVH: with the heavily overlapping boxes of real routers the
/// walk visits nearly every leaf anyway, serially (see cuda/route.cu).
pub const ROUTE_SCAN_MAX_PRIMS: usize = 8192;

/// How `route_bvh` finds the boxes that hold each slice point. Every choice
/// gives the same sets (the CPU's); they differ only in speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RouteTraversal {
    /// Scan up to [`ROUTE_SCAN_MAX_PRIMS`] primitives, walk the BVH above.
    #[default]
    Auto,
    /// Test every leaf primitive, one thread each.
    Scan,
    /// Walk the BVH, one thread per slice.
    Bvh,
}

impl RouteTraversal {
    pub(crate) fn scans(self, n_prims: usize) -> bool {
        match self {
            RouteTraversal::Auto => n_prims <= ROUTE_SCAN_MAX_PRIMS,
            RouteTraversal::Scan => true,
            RouteTraversal::Bvh => false,
        }
    }
}

/// Channels per phase-2 part of the fused Q8_0 FFN at least (its `part_ch`
/// argument): 128 at widths up to 1024, where few parts per output chunk
/// leave the last block of a chunk fewer partials to add; no floor above.
fn q8_part_ch(d_model: usize) -> usize {
    if d_model <= 1024 {
        128
    } else {
        0
    }
}

/// Which pages the sparse FFN runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SparsePages {
    /// Every stored page (must equal the dense FFN up to rounding).
    All,
    /// The first `k` pages of every layer (trunk first, then by hotness):
    /// prefix slicing.
    Prefix(usize),
    /// The first `ceil(fraction * n_pages)` pages of every layer.
    Fraction(f32),
    /// A random subset of `ceil(fraction * n_pages)` pages per layer
    /// (ascending ids), fixed by `seed`.
    Random {
        /// Share of pages kept.
        fraction: f32,
        /// Seed of the subset.
        seed: u64,
    },
    /// Trunk + the artifact BVH router's candidates, routed on the device
    /// per token and layer.
    Routed {
        /// Box inflation (the artifact's `default_margin` is calibrated).
        margin: f32,
        /// Primitive scan or BVH walk (same sets).
        traversal: RouteTraversal,
    },
}

/// How the pages are encoded on the device (and so which fused kernel runs
/// the FFN). Chosen before the layers are uploaded
/// ([`SparseCudaBackend::set_page_format`]); the active lists, routing and
/// modes do not depend on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PageFormat {
    /// Split Q8_0 (`superblock_ffn_q8s`): artifact pages as stored (other
    /// types requantized to Q8_0), synthetic pages from the model's FFN.
    #[default]
    Q8_0,
    /// Weight-only NVFP4 (`superblock_ffn_nvfp4`, [`Nvfp4Pages`]): the
    /// model's own gate/up/down requantized at upload (one tensor scale per
    /// layer matrix), in the same channel order as the Q8_0 pages (the
    /// artifact's permutation, or 128 consecutive channels for synthetic
    /// pages). 216 bytes per `d_model` a page, 53 % of Q8_0.
    Nvfp4,
    /// Split Q2_K (`superblock_ffn_q2k`, [`Q2kPages`]): the model's own
    /// gate/up/down as ggml Q2_K at upload (Q2_K gate/up rows copied
    /// verbatim, other types requantized; `W_down` dequantized, transposed
    /// and quantized), in the same channel order as the Q8_0 pages. 126
    /// bytes per `d_model` a page, 33 % of Q8_0. Needs `d_model` a multiple
    /// of 256 (one Q2_K super-block) up to 16384.
    Q2K,
}

impl PageFormat {
    /// Every format (a layer's upload sizes the shared scratch for each
    /// format's grid).
    pub const ALL: [PageFormat; 3] = [PageFormat::Q8_0, PageFormat::Nvfp4, PageFormat::Q2K];

    /// `q8_0`, `nvfp4` or `q2_k`.
    pub fn name(self) -> &'static str {
        match self {
            PageFormat::Q8_0 => "q8_0",
            PageFormat::Nvfp4 => "nvfp4",
            PageFormat::Q2K => "q2_k",
        }
    }

    /// Device bytes of one page of `d_model`.
    pub fn page_bytes(self, d_model: usize) -> usize {
        match self {
            PageFormat::Q8_0 => q8_0_page_bytes(d_model),
            PageFormat::Nvfp4 => nvfp4_page_bytes(d_model),
            PageFormat::Q2K => q2k_page_bytes(d_model),
        }
    }

    /// The fused FFN kernel over pages of this format.
    fn kernel(self) -> &'static str {
        match self {
            PageFormat::Q8_0 => "superblock_ffn_q8s",
            PageFormat::Nvfp4 => "superblock_ffn_nvfp4",
            PageFormat::Q2K => "superblock_ffn_q2k",
        }
    }

    /// Whether pages of this format can hold a model of width `d_model`
    /// (checked by `upload_ffn` before any page is built). Q8_0 and NVFP4
    /// need a positive multiple of 32 ([`RuntimeError::InvalidArgument`]);
    /// Q2_K a positive multiple of 256 up to 16384, else
    /// [`RuntimeError::UnsupportedType`] with type Q2_K, naming the width
    /// (Qwen2.5 0.5B's 896 is 3.5 super-blocks).
    pub fn check_d_model(self, d_model: usize) -> Result<()> {
        match self {
            PageFormat::Q8_0 | PageFormat::Nvfp4 => {
                if d_model == 0 || d_model % 32 != 0 {
                    return Err(rt(format!(
                        "d_model {d_model} is not a positive multiple of 32 ({self} pages)"
                    )));
                }
            }
            PageFormat::Q2K => {
                if d_model == 0 || d_model % Q2K_BLOCK != 0 || d_model > Q2K_MAX_D {
                    return Err(RuntimeError::UnsupportedType {
                        backend: "superblock-cuda".into(),
                        ty: GgmlType::Q2_K,
                        what: format!(
                            "page format q2_k: d_model {d_model} is not a positive multiple of \
                             {Q2K_BLOCK} (one Q2_K super-block) up to {Q2K_MAX_D}; \
                             use page format q8_0 or nvfp4 for this model"
                        ),
                    });
                }
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for PageFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for PageFormat {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<PageFormat, String> {
        match s.to_ascii_lowercase().as_str() {
            "q8_0" | "q8" => Ok(PageFormat::Q8_0),
            "nvfp4" => Ok(PageFormat::Nvfp4),
            "q2_k" | "q2k" => Ok(PageFormat::Q2K),
            other => Err(format!(
                "page format `{other}`: expected q8_0, nvfp4 or q2_k"
            )),
        }
    }
}

/// Where the pages come from.
#[derive(Clone)]
pub enum PageSource {
    /// A `.mirage` artifact (pages, router).
    Artifact(Arc<Artifact>),
    /// Built at `upload_ffn` from the model's own FFN matrices, 128
    /// consecutive channels per page, no permutation and no router (forced
    /// fractions only): for synthetic shapes that have no artifact.
    Synthetic,
}

/// One layer's BVH router on the device.
struct DeviceRouter {
    slices: usize,
    pages: usize,
    n_nodes: usize,
    n_prims: usize,
    proj: CudaSlice<f32>,
    offsets: CudaSlice<f32>,
    nodes: CudaSlice<u8>,
    prims: CudaSlice<u8>,
    thresholds: CudaSlice<u32>,
}

/// Dynamic shared memory for one `route_bvh` launch (cuda/route.cu): the hit
/// masks (rounded up to 16 bytes), then, while the total stays under the
/// 48 KiB a launch gets without opting in, a copy of `x` and then of the BVH
/// nodes (32 bytes each). The kernel reads the size it was given and stages
/// what fits; the result is the same either way.
pub(crate) fn route_smem_bytes(n_pages: usize, d_model: usize, n_nodes: usize) -> u32 {
    const LIMIT: usize = 47 * 1024; // 48 KiB less the kernel's static arrays
    let masks = (4 * n_pages).div_ceil(16) * 16;
    let with_x = masks + 4 * d_model;
    let with_nodes = with_x + 32 * n_nodes;
    let bytes = if with_nodes <= LIMIT {
        with_nodes
    } else if with_x <= LIMIT {
        with_x
    } else {
        masks
    };
    bytes as u32
}

/// One layer's device state, owned by the backend (mode changes rewrite the
/// active lists of every layer).
struct LayerDev {
    d_model: usize,
    n_pages: usize,
    n_trunk: usize,
    pages: CudaSlice<u8>,
    /// Encoding of `pages` (the backend's format when it was uploaded).
    format: PageFormat,
    /// Bytes of one page in `pages`.
    page_bytes: usize,
    /// NVFP4 tensor scales of gate, up and down (unused for Q8_0 and Q2_K).
    tensor_scales: [f32; 3],
    /// Grid of both phase launches of `format`'s kernel: its resident
    /// blocks (occupancy at `d_model * 4` bytes of shared memory).
    grid: u32,
    ids: CudaSlice<u32>,
    count: CudaSlice<i32>,
    router: Option<DeviceRouter>,
    /// Margin `router` was built with.
    router_margin: Option<f32>,
}

/// Scratch shared by every layer's FFN (one stream: layers run in order).
/// Sized at upload time, before any step records pointers into it.
#[derive(Default)]
struct FfnScratch {
    hbuf: Option<CudaSlice<f32>>,
    partials: Option<CudaSlice<f32>>,
    counters: Option<CudaSlice<u32>>,
}

/// Handle of one layer's sparse FFN.
#[derive(Debug)]
pub struct SparseFfn {
    layer: usize,
}

/// Device time of one layer's sparse FFN ops (event-timed, outside graphs).
#[derive(Debug, Clone, Copy, Default)]
pub struct OpTimes {
    /// Routing kernel, microseconds (0 when the mode does not route).
    pub route_us: f64,
    /// The two FFN launches, microseconds.
    pub ffn_us: f64,
}

/// The sparse CUDA backend. See the module doc.
pub struct SparseCudaBackend {
    inner: CudaBackend,
    source: PageSource,
    mode: Mutex<SparsePages>,
    layers: Mutex<Vec<Option<LayerDev>>>,
    scratch: Mutex<FfnScratch>,
    format: Mutex<PageFormat>,
    multiprocessors: u32,
    /// Routed mode through the Vulkan ray-tracing router instead of
    /// route.cu (feature `vulkan-interop`; [`Self::set_vulkan_router`]).
    #[cfg(feature = "vulkan-interop")]
    vulkan: Mutex<Option<VulkanRouting>>,
}

/// The Vulkan RT routers of the routed mode, one per uploaded layer, fed
/// and read on the backend's own stream through CUDA–Vulkan interop
/// (`crate::vk_interop`): projection into the exported points buffer,
/// timeline semaphores around one queued Vulkan submission, compaction into
/// the layer's active list. The submission is a host call per routing, so a
/// step that routes this way runs eagerly (no CUDA graph).
#[cfg(feature = "vulkan-interop")]
struct VulkanRouting {
    dev: crate::vk_interop::RouteDevice,
    layers: Vec<Option<crate::vk_interop::VkInteropRouter>>,
    margin: f32,
    /// Routing through these routers now (off: route.cu, routers kept).
    active: bool,
}

impl std::fmt::Debug for SparseCudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SparseCudaBackend {{ {:?}, mode: {:?}, pages: {} }}",
            self.inner,
            self.mode(),
            self.page_format()
        )
    }
}

fn rt(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::InvalidArgument(format!("sparse cuda: {e}"))
}

/// Rows of a ggml matrix as f32 (any type the CPU dequantizer knows).
fn dequant_rows(m: &HostMatrix, r0: usize, n: usize, out: &mut [f32]) -> Result<()> {
    let rb = quant::row_bytes(m.ty, m.cols).map_err(rt)?;
    let data: &[u8] = m.data.as_slice();
    for r in 0..n {
        quant::dequantize(
            m.ty,
            &data[(r0 + r) * rb..(r0 + r + 1) * rb],
            &mut out[r * m.cols..(r + 1) * m.cols],
        )
        .map_err(rt)?;
    }
    Ok(())
}

/// `rows` f32 rows of `d` as ggml Q8_0.
fn q8_rows(v: &[f32], rows: usize, d: usize) -> Result<Vec<u8>> {
    let rb = quant::row_bytes(GgmlType::Q8_0, d).map_err(rt)?;
    let mut out = vec![0u8; rows * rb];
    for r in 0..rows {
        quant::quantize(
            GgmlType::Q8_0,
            &v[r * d..(r + 1) * d],
            &mut out[r * rb..(r + 1) * rb],
        )
        .map_err(rt)?;
    }
    Ok(out)
}

/// Every page of a model FFN (page p = channels `128 p .. 128 p + 128`) in
/// the artifact's `pack_page` layout, Q8_0: gate rows, up rows, down columns
/// as rows; channels past `n_ff` are zero. `down` is dequantized once, and
/// the pages are built on all CPUs (a 7B layer is 68 M down weights).
fn synthetic_pages(gate: &HostMatrix, up: &HostMatrix, down: &HostMatrix) -> Result<Vec<Vec<u8>>> {
    let d = gate.cols;
    let n_ff = gate.rows;
    let n_pages = n_ff.div_ceil(PAGE_CHANNELS);
    let mut down_f = vec![0f32; d * n_ff];
    dequant_rows(down, 0, d, &mut down_f)?;
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(n_pages)
        .max(1);
    let per = n_pages.div_ceil(threads);
    let down_f = &down_f;
    let one = move |p: usize| -> Result<Vec<u8>> {
        let c0 = p * PAGE_CHANNELS;
        let n = PAGE_CHANNELS.min(n_ff - c0);
        let rb = quant::row_bytes(GgmlType::Q8_0, d).map_err(rt)?;
        let mut page = Vec::with_capacity(3 * PAGE_CHANNELS * rb);
        for m in [gate, up] {
            if m.ty == GgmlType::Q8_0 && n == PAGE_CHANNELS {
                page.extend_from_slice(&m.data.as_slice()[c0 * rb..(c0 + n) * rb]);
            } else {
                let mut f = vec![0f32; PAGE_CHANNELS * d];
                dequant_rows(m, c0, n, &mut f)?;
                page.extend_from_slice(&q8_rows(&f, PAGE_CHANNELS, d)?);
            }
        }
        let mut dt = vec![0f32; PAGE_CHANNELS * d];
        for j in 0..d {
            let row = &down_f[j * n_ff..(j + 1) * n_ff];
            for i in 0..n {
                dt[i * d + j] = row[c0 + i];
            }
        }
        page.extend_from_slice(&q8_rows(&dt, PAGE_CHANNELS, d)?);
        Ok(page)
    };
    let parts: Vec<Result<Vec<Vec<u8>>>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                sc.spawn(move || {
                    ((t * per)..((t + 1) * per).min(n_pages))
                        .map(one)
                        .collect::<Result<Vec<_>>>()
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(rt("a page-building thread panicked")))
            })
            .collect()
    });
    let mut out = Vec::with_capacity(n_pages);
    for p in parts {
        out.extend(p?);
    }
    Ok(out)
}

/// An artifact page re-encoded as Q8_0 (identity for Q8_0 pages).
fn artifact_page_q8(artifact: &Artifact, layer: usize, p: usize) -> Result<Vec<u8>> {
    let ld = artifact.layer(layer);
    let d = artifact.meta().d_model;
    let page = artifact.page(layer, p);
    if ld.quant == GgmlType::Q8_0 {
        return Ok(page.to_vec());
    }
    let rb = quant::row_bytes(ld.quant, d).map_err(rt)?;
    let mut f = vec![0f32; 3 * PAGE_CHANNELS * d];
    for r in 0..3 * PAGE_CHANNELS {
        quant::dequantize(
            ld.quant,
            &page[r * rb..(r + 1) * rb],
            &mut f[r * d..(r + 1) * d],
        )
        .map_err(rt)?;
    }
    q8_rows(&f, 3 * PAGE_CHANNELS, d)
}

/// Refuses a model layer whose FFN does not match the artifact's.
fn check_artifact_layer(a: &Artifact, layer: usize, d: usize, n_ff: usize) -> Result<()> {
    let m = a.meta();
    if layer >= m.n_layer || m.d_model != d || m.n_ff != n_ff {
        return Err(rt(format!(
            "model layer {layer} FFN [{n_ff}x{d}] does not match the artifact ({} layers, n_ff {}, d_model {})",
            m.n_layer, m.n_ff, m.d_model
        )));
    }
    Ok(())
}

/// A page-major packer whose page is planes of rows: each plane holds
/// gate, up and `down_t` (in that order) as 128 rows of a fixed width, so a
/// channel's bytes can be moved to another page and slot without
/// requantizing. What [`layer_pages`] builds from the model's FFN and lays
/// out in the artifact's channel order, for [`PageFormat::Nvfp4`]
/// (planes: codes, block scales) and [`PageFormat::Q2K`] (quants, scales,
/// d/dmin words).
trait PlanePages: Sized {
    /// The page format these pages are.
    const FORMAT: PageFormat;
    /// Packs a layer's FFN (ggml `(type, bytes)` as the GGUF stores them).
    fn pack(
        d_model: usize,
        n_ff: usize,
        gate: (GgmlType, &[u8]),
        up: (GgmlType, &[u8]),
        down: (GgmlType, &[u8]),
        threads: usize,
    ) -> std::result::Result<Self, SparseError>;
    /// `(d_model, n_ff)`.
    fn shape(&self) -> (usize, usize);
    /// All pages, page-major.
    fn all_bytes(&self) -> &[u8];
    /// Bytes of one row in each plane of a page, in page order.
    fn plane_widths(d_model: usize) -> Vec<usize>;
    /// Pages of `n` channels (whole pages) in `self`'s format and tensor
    /// scales from `rows[m][s]`: the `n` rows of matrix `m` (gate, up,
    /// `down_t`) in plane `s`, row-major.
    fn with_planes(
        &self,
        n: usize,
        rows: [Vec<Vec<u8>>; 3],
    ) -> std::result::Result<Self, SparseError>;
}

impl PlanePages for Nvfp4Pages {
    const FORMAT: PageFormat = PageFormat::Nvfp4;
    fn pack(
        d_model: usize,
        n_ff: usize,
        gate: (GgmlType, &[u8]),
        up: (GgmlType, &[u8]),
        down: (GgmlType, &[u8]),
        threads: usize,
    ) -> std::result::Result<Self, SparseError> {
        Nvfp4Pages::from_gguf_parts(d_model, n_ff, gate, up, down, threads)
    }
    fn shape(&self) -> (usize, usize) {
        (self.d_model(), self.n_ff())
    }
    fn all_bytes(&self) -> &[u8] {
        self.bytes()
    }
    fn plane_widths(d: usize) -> Vec<usize> {
        vec![d / 2, d / 16]
    }
    fn with_planes(
        &self,
        n: usize,
        rows: [Vec<Vec<u8>>; 3],
    ) -> std::result::Result<Self, SparseError> {
        let d = self.d_model();
        let t: Vec<quant::Nvfp4Tensor> = rows
            .into_iter()
            .zip(self.tensor_scales())
            .map(|(planes, tensor_scale)| {
                let [packed, block_scales]: [Vec<u8>; 2] = planes.try_into().map_err(|_| {
                    SparseError::InvalidArgument("NVFP4 pages have 2 planes".into())
                })?;
                Ok(quant::Nvfp4Tensor {
                    dims: vec![d as u64, n as u64],
                    tensor_scale,
                    block_scales,
                    packed,
                })
            })
            .collect::<std::result::Result<_, SparseError>>()?;
        Nvfp4Pages::from_tensors(&t[0], &t[1], &t[2])
    }
}

impl PlanePages for Q2kPages {
    const FORMAT: PageFormat = PageFormat::Q2K;
    fn pack(
        d_model: usize,
        n_ff: usize,
        gate: (GgmlType, &[u8]),
        up: (GgmlType, &[u8]),
        down: (GgmlType, &[u8]),
        threads: usize,
    ) -> std::result::Result<Self, SparseError> {
        Q2kPages::from_gguf_parts(d_model, n_ff, gate, up, down, threads)
    }
    fn shape(&self) -> (usize, usize) {
        (self.d_model(), self.n_ff())
    }
    fn all_bytes(&self) -> &[u8] {
        self.bytes()
    }
    fn plane_widths(d: usize) -> Vec<usize> {
        vec![d / 4, d / 16, d / 64]
    }
    fn with_planes(
        &self,
        n: usize,
        rows: [Vec<Vec<u8>>; 3],
    ) -> std::result::Result<Self, SparseError> {
        // A matrix's planes, concatenated, are its split Q2_K rows: back to
        // ggml rows for the packer (a byte shuffle, no requantization).
        let d = self.d_model();
        let [g, u, dt] = rows.map(|planes| join_q2k_rows(&planes.concat(), n, d));
        Q2kPages::from_q2k_rows(d, n, &g?, &u?, &dt?)
    }
}

/// The pages of format `P` [`SparseCudaBackend`] uploads for `layer`, built
/// on the host (no device needed): the model's gate, up and down (any ggml
/// type) packed as whole layer matrices ([`PlanePages::pack`]), then laid
/// out in the Q8_0 path's channel order: stored channel `k` is the
/// artifact's `perm[k]` ([`PageSource::Artifact`]: only its kept pages), or
/// channel `k` itself ([`PageSource::Synthetic`]; a last partial page is
/// zero-padded).
fn layer_pages<P: PlanePages>(
    source: &PageSource,
    layer: usize,
    gate: &HostMatrix,
    up: &HostMatrix,
    down: &HostMatrix,
) -> Result<P> {
    let (d, n_ff) = (gate.cols, gate.rows);
    if up.rows != n_ff || up.cols != d || down.rows != d || down.cols != n_ff {
        return Err(rt(format!(
            "layer {layer}: FFN shapes gate {}x{}, up {}x{}, down {}x{} do not fit",
            gate.rows, gate.cols, up.rows, up.cols, down.rows, down.cols
        )));
    }
    P::FORMAT.check_d_model(d)?;
    if let PageSource::Artifact(a) = source {
        check_artifact_layer(a, layer, d, n_ff)?;
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let all = P::pack(
        d,
        n_ff,
        (gate.ty, gate.data.as_slice()),
        (up.ty, up.data.as_slice()),
        (down.ty, down.data.as_slice()),
        threads,
    )
    .map_err(|e| rt(format!("layer {layer}: {} pages: {e}", P::FORMAT)))?;
    match source {
        PageSource::Synthetic => Ok(all),
        PageSource::Artifact(a) => {
            permute_pages(&all, &a.layer(layer).perm).map_err(|e| rt(format!("layer {layer}: {e}")))
        }
    }
}

/// `all`'s channels in the order `perm` (stored channel `k` = `all`'s
/// channel `perm[k]`; `perm.len()` a multiple of 128), tensor scales kept:
/// each channel's row bytes are moved plane by plane, nothing is
/// requantized.
fn permute_pages<P: PlanePages>(all: &P, perm: &[u32]) -> Result<P> {
    let (d, n_ff) = all.shape();
    let widths = P::plane_widths(d);
    let pb = P::FORMAT.page_bytes(d);
    debug_assert_eq!(3 * PAGE_CHANNELS * widths.iter().sum::<usize>(), pb);
    let n = perm.len();
    if n == 0 || n % PAGE_CHANNELS != 0 {
        return Err(rt(format!(
            "a channel order of {n} channels is not whole pages of {PAGE_CHANNELS}"
        )));
    }
    let mut rows: [Vec<Vec<u8>>; 3] =
        std::array::from_fn(|_| widths.iter().map(|w| Vec::with_capacity(n * w)).collect());
    for &c in perm {
        let c = c as usize;
        if c >= n_ff {
            return Err(rt(format!("channel {c} is past the FFN's {n_ff} channels")));
        }
        let p = c / PAGE_CHANNELS;
        let page = &all.all_bytes()[p * pb..(p + 1) * pb];
        let mut plane = 0;
        for (s, &w) in widths.iter().enumerate() {
            for (m, rm) in rows.iter_mut().enumerate() {
                let at = plane + (m * PAGE_CHANNELS + c % PAGE_CHANNELS) * w;
                rm[s].extend_from_slice(&page[at..at + w]);
            }
            plane += 3 * PAGE_CHANNELS * w;
        }
    }
    all.with_planes(n, rows).map_err(rt)
}

/// The NVFP4 pages [`SparseCudaBackend`] uploads for `layer` under
/// [`PageFormat::Nvfp4`], built on the host (no device needed): the model's
/// gate, up and down (any ggml type) requantized as whole layer matrices
/// ([`Nvfp4Pages::from_gguf_parts`]: one tensor scale per matrix, the down
/// scale that of `W_down`; gate and up bit-identical to what the dense
/// backend's NVFP4 weights hold), then laid out in the Q8_0 path's channel
/// order: stored channel `k` is the artifact's `perm[k]`
/// ([`PageSource::Artifact`]: only its kept pages), or channel `k` itself
/// ([`PageSource::Synthetic`]; a last partial page is zero-padded).
pub fn nvfp4_layer_pages(
    source: &PageSource,
    layer: usize,
    gate: &HostMatrix,
    up: &HostMatrix,
    down: &HostMatrix,
) -> Result<Nvfp4Pages> {
    layer_pages(source, layer, gate, up, down)
}

/// The Q2_K pages [`SparseCudaBackend`] uploads for `layer` under
/// [`PageFormat::Q2K`], built on the host (no device needed):
/// [`Q2kPages::from_gguf_parts`] on the model's gate, up and down (Q2_K
/// gate/up rows copied verbatim, other types quantized to Q2_K; `W_down`
/// dequantized, transposed and quantized along `d_model`), then laid out in
/// the channel order of [`nvfp4_layer_pages`] (the artifact's `perm`, kept
/// pages only; or identity). `d_model` must be a multiple of 256 up to 16384
/// ([`PageFormat::check_d_model`]).
pub fn q2k_layer_pages(
    source: &PageSource,
    layer: usize,
    gate: &HostMatrix,
    up: &HostMatrix,
    down: &HostMatrix,
) -> Result<Q2kPages> {
    layer_pages(source, layer, gate, up, down)
}

pub(crate) fn as_bytes_nodes(v: &[BvhNode]) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 * v.len());
    for n in v {
        for x in n.min {
            out.extend_from_slice(&x.to_le_bytes());
        }
        out.extend_from_slice(&n.left_or_first.to_le_bytes());
        for x in n.max {
            out.extend_from_slice(&x.to_le_bytes());
        }
        out.extend_from_slice(&n.count.to_le_bytes());
    }
    out
}

pub(crate) fn as_bytes_prims(v: &[BvhPrim]) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 * v.len());
    for n in v {
        for x in n.min {
            out.extend_from_slice(&x.to_le_bytes());
        }
        out.extend_from_slice(&n.page.to_le_bytes());
        for x in n.max {
            out.extend_from_slice(&x.to_le_bytes());
        }
        out.extend_from_slice(&n.slice.to_le_bytes());
    }
    out
}

/// Pages of `n` a forced fraction keeps (`ceil(fraction * n)`, at least
/// one): the artifact crate's rule, shared with its dense prefix slice.
pub use mirage_artifact::pages_for_fraction;

/// A sorted random subset of `k` of `0..n` (splitmix64 shuffle, seeded).
pub fn random_subset(n: usize, k: usize, seed: u64) -> Vec<u32> {
    let mut s = seed ^ 0x9E37_79B9_7F4A_7C15;
    let mut next = || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut v: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v.truncate(k.min(n));
    v.sort_unstable();
    v
}

impl SparseCudaBackend {
    /// Wraps `inner` (its context, stream and graph recorder) and loads the
    /// sparse kernels into it. `source` supplies the pages at `upload_ffn`.
    pub fn new(
        mut inner: CudaBackend,
        source: PageSource,
        mode: SparsePages,
    ) -> std::result::Result<SparseCudaBackend, CudaError> {
        let d = |e: cudarc::driver::DriverError| CudaError::Driver(e.to_string());
        let cc = inner.compute_capability;
        let (ptx, _) = module::ptx_for("sparse-backend", SOURCE, cc.0, cc.1)?;
        let m = inner
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx.clone()))
            .map_err(d)?;
        for &name in KERNELS {
            let f = m.load_function(name).map_err(d)?;
            inner.add_function(
                name,
                f,
                &ptx,
                ffn_accumulate_slots(name),
                ffn_norm_slots(name),
            );
        }
        let multiprocessors = inner
            .ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(d)?
            .max(1) as u32;
        if matches!(mode, SparsePages::Routed { .. }) && matches!(source, PageSource::Synthetic) {
            return Err(CudaError::Driver(
                "routed mode needs an artifact (synthetic pages have no router)".into(),
            ));
        }
        Ok(SparseCudaBackend {
            inner,
            source,
            mode: Mutex::new(mode),
            layers: Mutex::new(Vec::new()),
            scratch: Mutex::new(FfnScratch::default()),
            format: Mutex::new(PageFormat::default()),
            multiprocessors,
            #[cfg(feature = "vulkan-interop")]
            vulkan: Mutex::new(None),
        })
    }

    /// Routes the routed mode's tokens with the Vulkan ray-tracing router
    /// (`true`) or route.cu (`false`, the default); both give the same lists.
    /// Needs the routed mode and every layer uploaded. The first switch on
    /// (or one after a margin change) builds one Vulkan router per layer (a
    /// Vulkan device each) on the Vulkan device with this CUDA device's UUID;
    /// switching off keeps them. Switching on turns CUDA graphs off (each
    /// routing is one host `vkQueueSubmit`).
    #[cfg(feature = "vulkan-interop")]
    pub fn set_vulkan_router(&self, on: bool) -> Result<()> {
        // (pages, trunk) per layer, read before the lock: ffn() holds the
        // layers' lock while it takes the routers'.
        let shapes: Vec<Option<(usize, usize)>> = self
            .layers()
            .iter()
            .map(|l| l.as_ref().map(|l| (l.n_pages, l.n_trunk)))
            .collect();
        let mut slot = self.vulkan.lock().unwrap_or_else(|e| e.into_inner());
        let SparsePages::Routed { margin, .. } = self.mode() else {
            if on {
                return Err(rt("the Vulkan router needs the routed mode"));
            }
            if let Some(v) = slot.as_mut() {
                v.active = false;
            }
            return Ok(());
        };
        if let Some(v) = slot.as_mut().filter(|v| v.margin == margin || !on) {
            v.active = on;
            if on {
                self.inner.set_graphs(false);
            }
            return Ok(());
        }
        if !on {
            return Ok(());
        }
        let PageSource::Artifact(a) = &self.source else {
            return Err(rt("the Vulkan router needs an artifact"));
        };
        let vk = |e: crate::vk_interop::InteropError| rt(format!("Vulkan router: {e}"));
        let dev = crate::vk_interop::RouteDevice::on_stream(
            self.inner.ctx.clone(),
            self.inner.stream.clone(),
        )
        .map_err(|e| rt(format!("Vulkan router: {e}")))?;
        let mut layers = Vec::new();
        for (l, shape) in shapes.into_iter().enumerate() {
            layers.push(match shape {
                Some((n_pages, n_trunk)) => Some(
                    crate::vk_interop::VkInteropRouter::new(
                        &dev,
                        &a.router_with_margin(l, margin),
                        n_pages,
                        n_trunk,
                        1,
                    )
                    .map_err(vk)?,
                ),
                None => None,
            });
        }
        self.inner.set_graphs(false);
        *slot = Some(VulkanRouting {
            dev,
            layers,
            margin,
            active: true,
        });
        Ok(())
    }

    /// Routes row `px` of `layer` with its Vulkan router into the layer's
    /// list when the Vulkan router is on (`Ok(true)`); `Ok(false)`: route.cu.
    #[cfg(feature = "vulkan-interop")]
    fn route_vulkan(&self, layer: usize, ld: &LayerDev, px: u64, margin: f32) -> Result<bool> {
        let mut slot = self.vulkan.lock().unwrap_or_else(|e| e.into_inner());
        let Some(v) = slot.as_mut().filter(|v| v.active) else {
            return Ok(false);
        };
        if v.margin != margin {
            return Err(rt(format!(
                "the Vulkan routers were built for margin {}, the mode has {margin}: call set_vulkan_router again",
                v.margin
            )));
        }
        if self.inner.recording() {
            return Err(rt(
                "the Vulkan router cannot run inside a recorded CUDA graph (turn graphs off)",
            ));
        }
        let router = v
            .layers
            .get_mut(layer)
            .and_then(|r| r.as_mut())
            .ok_or_else(|| {
                rt(format!(
                    "layer {layer} has no Vulkan router (uploaded later?)"
                ))
            })?;
        let (ids, count) = (self.inner.ptr(&ld.ids), self.inner.ptr(&ld.count));
        // SAFETY: px is a row of d_model floats of an activation buffer on
        // this stream, ids / count the layer's list (n_pages slots, one
        // count), all owned by this backend and alive while its stream runs.
        unsafe { router.route_one_raw(&v.dev, px, ids, count) }
            .map_err(|e| rt(format!("Vulkan router, layer {layer}: {e}")))?;
        Ok(true)
    }

    #[cfg(not(feature = "vulkan-interop"))]
    fn route_vulkan(&self, _: usize, _: &LayerDev, _: u64, _: f32) -> Result<bool> {
        Ok(false)
    }

    /// Whether the routed mode launches `ld`'s router: some of its pages
    /// are routed (not trunk). A layer whose pages are all trunk (most
    /// layers of a small model at the fidelity gates) launches none: its
    /// active list is every page, written once, the list the router would
    /// return, and the RMSNorm before its FFN folds into the FFN's phase 1
    /// as it would have into the router.
    fn routes(&self, ld: &LayerDev) -> bool {
        ld.n_trunk < ld.n_pages
    }

    /// Routes `layer`'s FFN input at `px` (one row) when `ld` has pages to
    /// route ([`Self::routes`]); `false` when it launched nothing.
    fn route_layer(
        &self,
        layer: usize,
        ld: &LayerDev,
        px: u64,
        traversal: RouteTraversal,
        margin: f32,
    ) -> Result<bool> {
        if !self.routes(ld) {
            return Ok(false);
        }
        if !self.route_vulkan(layer, ld, px, margin)? {
            self.launch_route(ld, px, traversal)?;
        }
        Ok(true)
    }

    /// The routing an FFN launches before its pages: the routed mode's
    /// traversal and margin, `None` in the other modes.
    fn routing(&self) -> Option<(RouteTraversal, f32)> {
        match self.mode() {
            SparsePages::Routed { traversal, margin } => Some((traversal, margin)),
            _ => None,
        }
    }

    /// The dense backend every other op runs on.
    pub fn inner(&self) -> &CudaBackend {
        &self.inner
    }

    /// The current mode.
    pub fn mode(&self) -> SparsePages {
        *self.mode.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The encoding of the pages uploaded from now on.
    pub fn page_format(&self) -> PageFormat {
        *self.format.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Chooses the page encoding (default [`PageFormat::Q8_0`]). Only before
    /// any layer is uploaded (before `Model::load`): every layer of one
    /// backend uses one format.
    pub fn set_page_format(&self, format: PageFormat) -> Result<()> {
        if self.layers().iter().any(|l| l.is_some()) && format != self.page_format() {
            return Err(rt(format!(
                "the page format ({}) cannot change after layers are uploaded",
                self.page_format()
            )));
        }
        *self.format.lock().unwrap_or_else(|e| e.into_inner()) = format;
        Ok(())
    }

    fn layers(&self) -> std::sync::MutexGuard<'_, Vec<Option<LayerDev>>> {
        self.layers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Switches the mode: rewrites every uploaded layer's active list (forced
    /// modes) or builds the routers (routed). Not inside a step.
    pub fn set_mode(&self, mode: SparsePages) -> Result<()> {
        if matches!(mode, SparsePages::Routed { .. })
            && matches!(self.source, PageSource::Synthetic)
        {
            return Err(rt(
                "routed mode needs an artifact (synthetic pages have no router)",
            ));
        }
        let mut layers = self.layers();
        for (l, slot) in layers.iter_mut().enumerate() {
            if let Some(ld) = slot.as_mut() {
                self.apply_mode(l, ld, mode)?;
            }
        }
        *self.mode.lock().unwrap_or_else(|e| e.into_inner()) = mode;
        Ok(())
    }

    fn apply_mode(&self, layer: usize, ld: &mut LayerDev, mode: SparsePages) -> Result<()> {
        let n = ld.n_pages;
        let ids: Option<Vec<u32>> = match mode {
            SparsePages::All => Some((0..n as u32).collect()),
            SparsePages::Prefix(k) => Some((0..k.clamp(1, n) as u32).collect()),
            SparsePages::Fraction(f) => Some((0..pages_for_fraction(f, n) as u32).collect()),
            SparsePages::Random { fraction, seed } => Some(random_subset(
                n,
                pages_for_fraction(fraction, n),
                seed ^ layer as u64,
            )),
            SparsePages::Routed { margin, .. } => {
                if ld.router.is_none() || ld.router_margin != Some(margin) {
                    let PageSource::Artifact(a) = &self.source else {
                        return Err(rt("routed mode needs an artifact"));
                    };
                    let data = a.router_with_margin(layer, margin);
                    ld.router = Some(self.upload_router(&data, ld.d_model)?);
                    ld.router_margin = Some(margin);
                }
                // All trunk: the list is every page, routed or not
                // (route_layer skips the router unless told otherwise).
                (ld.n_trunk >= n).then(|| (0..n as u32).collect())
            }
        };
        if let Some(ids) = ids {
            let s = &self.inner.stream;
            s.memcpy_htod(&ids, &mut ld.ids.slice_mut(0..ids.len()))
                .map_err(drv)?;
            s.memcpy_htod(&[ids.len() as i32], &mut ld.count)
                .map_err(drv)?;
        }
        Ok(())
    }

    fn upload_router(&self, data: &RouterData, d_model: usize) -> Result<DeviceRouter> {
        if data.d_model != d_model {
            return Err(rt(format!(
                "router projects d_model {}, the layer has {d_model}",
                data.d_model
            )));
        }
        let bvh = Bvh::build(data).map_err(rt)?;
        let s = &self.inner.stream;
        let up_u8 = |v: &[u8]| -> Result<CudaSlice<u8>> {
            if v.is_empty() {
                s.alloc_zeros::<u8>(32).map_err(drv)
            } else {
                s.clone_htod(v).map_err(drv)
            }
        };
        let r = DeviceRouter {
            slices: data.slices,
            pages: data.pages(),
            n_nodes: bvh.nodes.len(),
            n_prims: bvh.prims.len(),
            proj: s.clone_htod(&data.projection).map_err(drv)?,
            offsets: s.clone_htod(&bvh.slice_offsets).map_err(drv)?,
            nodes: up_u8(&as_bytes_nodes(&bvh.nodes))?,
            prims: up_u8(&as_bytes_prims(&bvh.prims))?,
            thresholds: s.clone_htod(&data.thresholds).map_err(drv)?,
        };
        self.inner.account(
            MemKind::Weights,
            4 * data.projection.len() + 32 * (bvh.nodes.len() + bvh.prims.len()),
        );
        Ok(r)
    }

    /// Active page count of every uploaded layer as the device holds it now
    /// (synchronizes; for statistics, never inside a step).
    pub fn active_counts(&self) -> Result<Vec<usize>> {
        let layers = self.layers();
        let mut out = Vec::with_capacity(layers.len());
        for ld in layers.iter().flatten() {
            let v = self.inner.stream.clone_dtoh(&ld.count).map_err(drv)?;
            out.push(v[0].max(0) as usize);
        }
        Ok(out)
    }

    /// Active page ids of `layer` as the device holds them now (synchronizes).
    pub fn active_pages(&self, layer: usize) -> Result<Vec<u32>> {
        let layers = self.layers();
        let ld = layers
            .get(layer)
            .and_then(|l| l.as_ref())
            .ok_or_else(|| rt(format!("layer {layer} has no FFN uploaded")))?;
        let n = self.inner.stream.clone_dtoh(&ld.count).map_err(drv)?[0].max(0) as usize;
        let ids = self.inner.stream.clone_dtoh(&ld.ids).map_err(drv)?;
        Ok(ids[..n.min(ids.len())].to_vec())
    }

    /// Pages stored per uploaded layer, and bytes per page (device layout).
    pub fn page_shape(&self) -> Vec<(usize, usize)> {
        self.layers()
            .iter()
            .flatten()
            .map(|l| (l.n_pages, l.page_bytes))
            .collect()
    }

    /// Runs only the router of `layer` on `x` (one row of `d_model`): the
    /// active list is left on the device (read it with
    /// [`SparseCudaBackend::active_pages`]). For tests and timing.
    pub fn route_only(&self, layer: usize, x: &CudaActivations) -> Result<()> {
        let px = self.inner.act_ptr(x)?;
        let layers = self.layers();
        let ld = layers
            .get(layer)
            .and_then(|l| l.as_ref())
            .ok_or_else(|| rt(format!("layer {layer} has no FFN uploaded")))?;
        let SparsePages::Routed { traversal, margin } = self.mode() else {
            return Err(rt("route_only needs the routed mode"));
        };
        self.route_layer(layer, ld, px, traversal, margin)
            .map(|_| ())
    }

    fn launch_route(&self, ld: &LayerDev, px: u64, traversal: RouteTraversal) -> Result<()> {
        let r = ld.router.as_ref().ok_or_else(|| rt("router not built"))?;
        let p = |s: &CudaSlice<u8>| self.inner.ptr(s);
        let scan = traversal.scans(r.n_prims);
        let args = vec![
            Arg::Ptr(px),
            Arg::I32(ld.d_model as i32),
            Arg::Ptr(self.inner.ptr(&r.proj)),
            Arg::I32(r.slices as i32),
            Arg::Ptr(self.inner.ptr(&r.offsets)),
            Arg::Ptr(p(&r.nodes)),
            Arg::I32(r.n_nodes as i32),
            Arg::Ptr(p(&r.prims)),
            Arg::I32(r.n_prims as i32),
            Arg::I32(scan as i32),
            Arg::Ptr(self.inner.ptr(&r.thresholds)),
            Arg::I32(r.pages as i32),
            Arg::I32(ld.n_pages as i32),
            Arg::I32(ld.n_trunk as i32),
            Arg::Ptr(self.inner.ptr(&ld.ids)),
            Arg::Ptr(self.inner.ptr(&ld.count)),
            // The folded norm (weights, eps, output): none unless a
            // recorded step folds the norm before it in.
            Arg::Ptr(0),
            Arg::F32(0.0),
            Arg::Ptr(0),
        ];
        debug_assert_eq!(args.len(), ROUTE_ARGS);
        self.inner.launch_folding_norm(
            "route_bvh",
            (1, 1, 1),
            (ROUTE_THREADS, 1, 1),
            route_smem_bytes(ld.n_pages, ld.d_model, if scan { 0 } else { r.n_nodes }),
            args,
            true,
        )
    }

    /// Launches `ld`'s fused FFN on the row at `px` into `py` (phase 1,
    /// then phase 2); with `norm_as_router` a pending RMSNorm folds into
    /// phase 1 as it would have into the router (a routed layer that
    /// launched no router).
    fn launch_ffn(&self, ld: &LayerDev, px: u64, py: u64, norm_as_router: bool) -> Result<()> {
        let sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let (Some(h), Some(pa), Some(c)) = (&sc.hbuf, &sc.partials, &sc.counters) else {
            return Err(rt("FFN scratch not allocated"));
        };
        let d = ld.d_model;
        // The kernels take the same arguments but for NVFP4's three tensor
        // scales after d (Q2_K's are q8s's) and q8s's part_ch and folded
        // norm at the end.
        let args = |phase: i32| {
            let mut a = vec![
                Arg::Ptr(self.inner.ptr(&ld.pages)),
                Arg::I64(ld.page_bytes as i64),
                Arg::I32(ld.n_pages as i32),
                Arg::I32(d as i32),
            ];
            if ld.format == PageFormat::Nvfp4 {
                a.extend(ld.tensor_scales.map(Arg::F32));
            }
            a.extend([
                Arg::Ptr(px),
                Arg::Ptr(self.inner.ptr(&ld.ids)),
                Arg::Ptr(self.inner.ptr(&ld.count)),
                Arg::I32(ld.n_pages as i32),
                // accumulate: y = FFN(x); a recorded step may fold the
                // residual add in (y = FFN(x) + y).
                Arg::I32(0),
                Arg::Ptr(self.inner.ptr(h)),
                Arg::Ptr(self.inner.ptr(pa)),
                Arg::Ptr(self.inner.ptr(c)),
                Arg::Ptr(py),
                Arg::I32(phase),
            ]);
            if ld.format == PageFormat::Q8_0 {
                // part_ch, then the folded norm (weights, eps, out): none
                // unless a recorded step folds the norm before it in.
                a.extend([
                    Arg::I32(q8_part_ch(d) as i32),
                    Arg::Ptr(0),
                    Arg::F32(0.0),
                    Arg::Ptr(0),
                ]);
            }
            a
        };
        // Phase 2 reads no x: no dynamic shared memory. Same grid for both
        // (phase 2's split of the channels depends on it).
        let (k, g, b) = (
            ld.format.kernel(),
            (ld.grid.max(1), 1, 1),
            (FFN_THREADS, 1, 1),
        );
        let want = match ld.format {
            PageFormat::Q8_0 => Q8_FFN_ARGS,
            PageFormat::Nvfp4 => FFN_KERNEL_ARGS + 3,
            PageFormat::Q2K => FFN_KERNEL_ARGS,
        };
        let (phase1, phase2) = (args(1), args(2));
        if phase1.len() != want {
            return Err(rt(format!(
                "{k}: {} launch arguments, the kernel takes {want}",
                phase1.len()
            )));
        }
        // The residual fold patches these two arguments by position.
        if let Some((acc_at, y_at)) = ffn_accumulate_slots(k) {
            if phase2.get(acc_at) != Some(&Arg::I32(0)) || phase2.get(y_at) != Some(&Arg::Ptr(py)) {
                return Err(rt(format!(
                    "{k}: accumulate/y argument positions ({acc_at}, {y_at}) do not match the launch"
                )));
            }
        }
        self.inner
            .launch_folding_norm(k, g, b, (d * 4) as u32, phase1, norm_as_router)?;
        // The weights the runtime hinted (the next layer's Q/K/V) go into
        // L2 while phase 2 reads the active pages' down rows.
        self.inner.emit_prefetch(PrefetchSite::Ffn);
        self.inner.launch(k, g, b, 0, phase2)
    }

    /// Writes `data` (`rows * width` floats) into `a`, reusing its buffer
    /// when it is large enough (so a recorded step that reads `a` replays
    /// with the new values). Not inside a step.
    pub fn write_activations(
        &self,
        a: &mut CudaActivations,
        rows: usize,
        width: usize,
        data: &[f32],
    ) -> Result<()> {
        if rows.checked_mul(width) != Some(data.len()) {
            return Err(bad("activation data does not match its shape"));
        }
        self.inner.reshape(a, rows, width)?;
        if !data.is_empty() {
            let buf = a.buf.as_mut().ok_or_else(|| bad("reshape allocates"))?;
            self.inner
                .stream
                .memcpy_htod(data, &mut buf.slice_mut(0..data.len()))
                .map_err(drv)?;
        }
        Ok(())
    }

    /// Event-timed device time of `layer`'s routing and FFN on `x` (one
    /// row), median of `iters` runs each. Outside steps only.
    pub fn time_ops(&self, layer: usize, x: &CudaActivations, iters: usize) -> Result<OpTimes> {
        let px = self.inner.act_ptr(x)?;
        let mut y = CudaActivations::default();
        let layers = self.layers();
        let ld = layers
            .get(layer)
            .and_then(|l| l.as_ref())
            .ok_or_else(|| rt(format!("layer {layer} has no FFN uploaded")))?;
        let py = self.inner.reshape(&mut y, 1, ld.d_model)?;
        let routed = self.routing();
        let ctx = &self.inner.ctx;
        let stream = &self.inner.stream;
        let time = |f: &dyn Fn() -> Result<()>| -> Result<f64> {
            let mut v = Vec::with_capacity(iters);
            for i in 0..iters + 3 {
                let a = ctx
                    .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(drv)?;
                let b = ctx
                    .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(drv)?;
                a.record(stream).map_err(drv)?;
                f()?;
                b.record(stream).map_err(drv)?;
                b.synchronize().map_err(drv)?;
                if i >= 3 {
                    v.push(a.elapsed_ms(&b).map_err(drv)? as f64 * 1e3);
                }
            }
            v.sort_by(|a, b| a.total_cmp(b));
            Ok(v[v.len() / 2])
        };
        let route_us = match routed {
            Some((t, margin)) if self.routes(ld) => {
                time(&|| self.route_layer(layer, ld, px, t, margin).map(|_| ()))?
            }
            _ => 0.0,
        };
        let ffn_us = time(&|| self.launch_ffn(ld, px, py, false))?;
        Ok(OpTimes { route_us, ffn_us })
    }
}

impl Backend for SparseCudaBackend {
    type Matrix = CudaMatrix;
    type Vector = CudaVector;
    type Ffn = SparseFfn;
    type Activations = CudaActivations;
    type KvCache = CudaKvCache;

    fn name(&self) -> String {
        "superblock-cuda".into()
    }
    fn step<R>(&self, inputs: &StepInputs<'_>, pass: impl FnOnce() -> Result<R>) -> Result<R> {
        self.inner.step(inputs, pass)
    }
    fn upload_matrix(&self, m: &HostMatrix) -> Result<CudaMatrix> {
        self.inner.upload_matrix(m)
    }
    fn upload_vector(&self, v: &[f32]) -> Result<CudaVector> {
        self.inner.upload_vector(v)
    }
    fn upload_ffn(
        &self,
        layer: usize,
        gate: &HostMatrix,
        up: &HostMatrix,
        down: &HostMatrix,
    ) -> Result<SparseFfn> {
        let d = gate.cols;
        if up.rows != gate.rows || up.cols != d || down.rows != d || down.cols != gate.rows {
            return Err(rt(format!(
                "layer {layer}: FFN shapes gate {}x{}, up {}x{}, down {}x{} do not fit",
                gate.rows, gate.cols, up.rows, up.cols, down.rows, down.cols
            )));
        }
        let format = self.page_format();
        format.check_d_model(d)?;
        let n_trunk = match &self.source {
            PageSource::Artifact(a) => {
                check_artifact_layer(a, layer, d, gate.rows)?;
                a.layer(layer).n_trunk
            }
            PageSource::Synthetic => 0,
        };
        let (q8_flat, nv_pages, q2_pages);
        let (bytes, n_pages, tensor_scales): (&[u8], usize, [f32; 3]) = match format {
            PageFormat::Q8_0 => {
                let pages: Vec<Vec<u8>> = match &self.source {
                    PageSource::Artifact(a) => (0..a.layer(layer).n_pages)
                        .map(|p| artifact_page_q8(a, layer, p))
                        .collect::<Result<_>>()?,
                    PageSource::Synthetic => synthetic_pages(gate, up, down)?,
                };
                let mut flat = Vec::with_capacity(pages.len() * q8_0_page_bytes(d));
                for p in &pages {
                    flat.extend_from_slice(&split_q8_0_page(p, d).map_err(rt)?);
                }
                q8_flat = flat;
                (&q8_flat, pages.len(), [0.0; 3])
            }
            PageFormat::Nvfp4 => {
                nv_pages = nvfp4_layer_pages(&self.source, layer, gate, up, down)?;
                (
                    nv_pages.bytes(),
                    nv_pages.n_pages(),
                    nv_pages.tensor_scales(),
                )
            }
            PageFormat::Q2K => {
                q2_pages = q2k_layer_pages(&self.source, layer, gate, up, down)?;
                (q2_pages.bytes(), q2_pages.n_pages(), [0.0; 3])
            }
        };
        if n_pages == 0 {
            return Err(rt(format!("layer {layer} has no pages")));
        }
        let page_bytes = format.page_bytes(d);
        debug_assert_eq!(bytes.len(), n_pages * page_bytes);
        // Grids of every fused kernel that takes this width (each phase
        // launch of a layer uses its format's): every block resident. The
        // scratch covers any.
        let grid_of = |kernel: &str| -> Result<u32> {
            let f = &self.inner.functions[self.inner.kernel_index[kernel]];
            // Past 48 KiB of static plus dynamic shared memory a launch
            // needs the opt-in.
            let static_smem = f.shared_size_bytes().map_err(drv)?.max(0) as usize;
            if static_smem + d * 4 > 48 * 1024 {
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    (d * 4) as i32,
                )
                .map_err(drv)?;
            }
            let per_sm = f
                .occupancy_max_active_blocks_per_multiprocessor(FFN_THREADS, d * 4, None)
                .map_err(drv)?
                .max(1);
            Ok(per_sm * self.multiprocessors)
        };
        let mut grids = [0u32; PageFormat::ALL.len()];
        let mut grid = 0;
        for (g, f) in grids.iter_mut().zip(PageFormat::ALL) {
            if f.check_d_model(d).is_err() {
                continue;
            }
            *g = grid_of(f.kernel())?;
            if f == format {
                grid = *g;
            }
        }
        let s = &self.inner.stream;
        let dev_pages = s.clone_htod(bytes).map_err(drv)?;
        self.inner.account(MemKind::Weights, bytes.len());
        let mut ld = LayerDev {
            d_model: d,
            n_pages,
            n_trunk,
            pages: dev_pages,
            format,
            page_bytes,
            tensor_scales,
            grid,
            ids: s.alloc_zeros::<u32>(n_pages).map_err(drv)?,
            count: s.alloc_zeros::<i32>(1).map_err(drv)?,
            router: None,
            router_margin: None,
        };
        self.apply_mode(layer, &mut ld, self.mode())?;
        {
            let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
            let n_chunks = d.div_ceil(128);
            let partials = grids
                .iter()
                .map(|&g| ffn_partials_len(g, d))
                .max()
                .unwrap_or(d);
            let grow = |slot: &mut Option<CudaSlice<f32>>, n: usize| -> Result<()> {
                if slot.as_ref().is_none_or(|b| b.len() < n) {
                    *slot = Some(s.alloc_zeros::<f32>(n).map_err(drv)?);
                }
                Ok(())
            };
            grow(&mut sc.hbuf, n_pages * PAGE_CHANNELS)?;
            grow(&mut sc.partials, partials)?;
            if sc.counters.as_ref().is_none_or(|b| b.len() < n_chunks) {
                sc.counters = Some(s.alloc_zeros::<u32>(n_chunks).map_err(drv)?);
            }
        }
        let mut layers = self.layers();
        if layers.len() <= layer {
            layers.resize_with(layer + 1, || None);
        }
        layers[layer] = Some(ld);
        Ok(SparseFfn { layer })
    }
    fn new_kv_cache(&self, spec: KvSpec) -> Result<CudaKvCache> {
        self.inner.new_kv_cache(spec)
    }
    fn new_kv_cache_pruned(
        &self,
        spec: KvSpec,
        pruning: Option<mirage_runtime::KvPruning>,
    ) -> Result<CudaKvCache> {
        self.inner.new_kv_cache_pruned(spec, pruning)
    }
    fn kv_set_pruning(
        &self,
        cache: &mut CudaKvCache,
        pruning: Option<mirage_runtime::KvPruning>,
    ) -> Result<()> {
        self.inner.kv_set_pruning(cache, pruning)
    }
    fn kv_truncate(&self, cache: &mut CudaKvCache, seq: usize, pos: usize) {
        self.inner.kv_truncate(cache, seq, pos)
    }
    fn new_activations(&self) -> CudaActivations {
        self.inner.new_activations()
    }
    fn embed(&self, table: &CudaMatrix, tokens: &[u32], out: &mut CudaActivations) -> Result<()> {
        self.inner.embed(table, tokens, out)
    }
    fn rms_norm(
        &self,
        x: &CudaActivations,
        weight: &CudaVector,
        eps: f32,
        out: &mut CudaActivations,
    ) -> Result<()> {
        self.inner.rms_norm(x, weight, eps, out)
    }
    fn matmul(&self, w: &CudaMatrix, x: &CudaActivations, out: &mut CudaActivations) -> Result<()> {
        self.inner.matmul(w, x, out)
    }
    fn matmul_many(
        &self,
        ws: &[&CudaMatrix],
        x: &CudaActivations,
        outs: &mut [&mut CudaActivations],
    ) -> Result<()> {
        self.inner.matmul_many(ws, x, outs)
    }
    fn add_bias(&self, x: &mut CudaActivations, bias: &CudaVector) -> Result<()> {
        self.inner.add_bias(x, bias)
    }
    fn add(&self, acc: &mut CudaActivations, x: &CudaActivations) -> Result<()> {
        self.inner.add(acc, x)
    }
    fn attention(
        &self,
        layer: usize,
        params: &AttentionParams,
        q: &mut CudaActivations,
        k: &mut CudaActivations,
        v: &CudaActivations,
        qk_norm: Option<QkNorm<'_, CudaVector>>,
        slots: &[TokenSlot],
        cache: &mut CudaKvCache,
        out: &mut CudaActivations,
    ) -> Result<()> {
        self.inner
            .attention(layer, params, q, k, v, qk_norm, slots, cache, out)
    }
    fn ffn(&self, f: &SparseFfn, x: &CudaActivations, out: &mut CudaActivations) -> Result<()> {
        let layers = self.layers();
        let ld = layers
            .get(f.layer)
            .and_then(|l| l.as_ref())
            .ok_or_else(|| bad(format!("layer {} has no FFN uploaded", f.layer)))?;
        let d = ld.d_model;
        if x.width != d {
            return Err(bad(format!("ffn input width {} != {d}", x.width)));
        }
        let rows = x.rows;
        let px = self.inner.act_ptr(x)?;
        let py = self.inner.reshape(out, rows, d)?;
        let routed = self.routing();
        // One row at a time: the active list (and, routed, the routing) is
        // per token; the stream orders row r's FFN before row r + 1's routing
        // overwrites the list.
        for r in 0..rows {
            let off = (4 * r * d) as u64;
            // A routed layer without a router launch: the norm the router
            // would have taken folds into phase 1 under the router's setting.
            let norm_as_router = match routed {
                Some((t, margin)) => !self.route_layer(f.layer, ld, px + off, t, margin)?,
                None => false,
            };
            self.launch_ffn(ld, px + off, py + off, norm_as_router)?;
        }
        Ok(())
    }
    fn prefetch(&self, ws: &[&CudaMatrix]) -> Result<()> {
        self.inner.prefetch(ws)
    }
    fn select_rows(
        &self,
        x: &CudaActivations,
        rows: &[usize],
        out: &mut CudaActivations,
    ) -> Result<()> {
        self.inner.select_rows(x, rows, out)
    }
    fn read(&self, x: &CudaActivations, out: &mut Vec<f32>) -> Result<(usize, usize)> {
        self.inner.read(x, out)
    }
}
