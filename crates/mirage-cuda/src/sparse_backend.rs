//! [`SparseCudaBackend`]: the superblock (page-major, sparse FFN) backend on
//! CUDA. Every op but the FFN is [`CudaBackend`]'s, on the same context and
//! stream; the FFN runs the fused page kernel of `cuda/superblock.cu` over a
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
//! The fused kernel has a grid barrier between its gate/up/SwiGLU phase and
//! its down phase, which needs a cooperative launch; the graph recorder
//! launches ordinary kernels, so here the two phases are two launches of the
//! same kernel (`phases` 1 then 2, same grid): the kernel boundary is the
//! barrier. It costs one more launch per layer inside the graph.

use std::sync::atomic::{AtomicU32, Ordering};
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
};
use crate::superblock::{q8_0_page_bytes, split_q8_0_page, PAGE_CHANNELS};
use crate::{module, CudaError};

/// Sources of the sparse backend's module: NVFP4 helpers, the fused FFN,
/// the router.
const SOURCE: &str = concat!(
    include_str!("../../../cuda/nvfp4.cu"),
    "\n",
    include_str!("../../../cuda/superblock.cu"),
    "\n",
    include_str!("../../../cuda/route.cu")
);
const KERNELS: &[&str] = &["superblock_ffn_q8s", "route_bvh", "set_active_prefix"];
/// Threads per block of the fused FFN (`SB_THREADS`) and the router.
const FFN_THREADS: u32 = 256;
const ROUTE_THREADS: u32 = 256;

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
        /// Project x onto the slice axes in the CPU's exact summation order
        /// (bit-identical points, slower), else a warp reduction.
        exact_projection: bool,
    },
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
    grid: AtomicU32,
    multiprocessors: u32,
}

impl std::fmt::Debug for SparseCudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SparseCudaBackend {{ {:?}, mode: {:?} }}",
            self.inner,
            self.mode()
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

fn as_bytes_nodes(v: &[BvhNode]) -> Vec<u8> {
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

fn as_bytes_prims(v: &[BvhPrim]) -> Vec<u8> {
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

/// `ceil(fraction * n)`, at least 1 and at most n.
pub fn pages_for_fraction(fraction: f32, n: usize) -> usize {
    // The tolerance keeps 0.4 * 70 (28.000000298 in f32) at 28 pages.
    ((fraction.clamp(0.0, 1.0) as f64 * n as f64 - 1e-4).ceil() as usize).clamp(1, n.max(1))
}

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
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(d)?;
        for name in KERNELS {
            let f = m.load_function(name).map_err(d)?;
            inner.kernel_index.insert(name, inner.functions.len());
            inner.functions.push(f);
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
            grid: AtomicU32::new(0),
            multiprocessors,
        })
    }

    /// The dense backend every other op runs on.
    pub fn inner(&self) -> &CudaBackend {
        &self.inner
    }

    /// The current mode.
    pub fn mode(&self) -> SparsePages {
        *self.mode.lock().unwrap_or_else(|e| e.into_inner())
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
                None
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
            .map(|l| (l.n_pages, q8_0_page_bytes(l.d_model)))
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
        let SparsePages::Routed {
            exact_projection, ..
        } = self.mode()
        else {
            return Err(rt("route_only needs the routed mode"));
        };
        self.launch_route(ld, px, exact_projection)
    }

    fn launch_route(&self, ld: &LayerDev, px: u64, exact: bool) -> Result<()> {
        let r = ld.router.as_ref().ok_or_else(|| rt("router not built"))?;
        let p = |s: &CudaSlice<u8>| self.inner.ptr(s);
        self.inner.launch(
            "route_bvh",
            (1, 1, 1),
            (ROUTE_THREADS, 1, 1),
            route_smem_bytes(ld.n_pages, ld.d_model, r.n_nodes),
            vec![
                Arg::Ptr(px),
                Arg::I32(ld.d_model as i32),
                Arg::Ptr(self.inner.ptr(&r.proj)),
                Arg::I32(r.slices as i32),
                Arg::I32(exact as i32),
                Arg::Ptr(self.inner.ptr(&r.offsets)),
                Arg::Ptr(p(&r.nodes)),
                Arg::I32(r.n_nodes as i32),
                Arg::Ptr(p(&r.prims)),
                Arg::Ptr(self.inner.ptr(&r.thresholds)),
                Arg::I32(r.pages as i32),
                Arg::I32(ld.n_pages as i32),
                Arg::I32(ld.n_trunk as i32),
                Arg::Ptr(self.inner.ptr(&ld.ids)),
                Arg::Ptr(self.inner.ptr(&ld.count)),
            ],
        )
    }

    fn launch_ffn(&self, ld: &LayerDev, px: u64, py: u64) -> Result<()> {
        let sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let (Some(h), Some(pa), Some(c)) = (&sc.hbuf, &sc.partials, &sc.counters) else {
            return Err(rt("FFN scratch not allocated"));
        };
        let d = ld.d_model;
        let base = |phase: i32| {
            vec![
                Arg::Ptr(self.inner.ptr(&ld.pages)),
                Arg::I64(q8_0_page_bytes(d) as i64),
                Arg::I32(ld.n_pages as i32),
                Arg::I32(d as i32),
                Arg::Ptr(px),
                Arg::Ptr(self.inner.ptr(&ld.ids)),
                Arg::Ptr(self.inner.ptr(&ld.count)),
                Arg::I32(ld.n_pages as i32),
                Arg::I32(1), // ordered reduction: deterministic, y = FFN(x)
                Arg::I32(0),
                Arg::Ptr(self.inner.ptr(h)),
                Arg::Ptr(self.inner.ptr(pa)),
                Arg::Ptr(self.inner.ptr(c)),
                Arg::Ptr(py),
                Arg::I32(phase),
            ]
        };
        let g = (self.grid.load(Ordering::Relaxed).max(1), 1, 1);
        let b = (FFN_THREADS, 1, 1);
        self.inner
            .launch("superblock_ffn_q8s", g, b, (d * 4) as u32, base(1))?;
        self.inner.launch("superblock_ffn_q8s", g, b, 0, base(2))
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
        let routed = match self.mode() {
            SparsePages::Routed {
                exact_projection, ..
            } => Some(exact_projection),
            _ => None,
        };
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
            Some(exact) => time(&|| self.launch_route(ld, px, exact))?,
            None => 0.0,
        };
        let ffn_us = time(&|| self.launch_ffn(ld, px, py))?;
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
        if d == 0 || d % 32 != 0 {
            return Err(rt(format!(
                "d_model {d} is not a positive multiple of 32 (Q8_0 pages)"
            )));
        }
        let (pages, n_trunk): (Vec<Vec<u8>>, usize) = match &self.source {
            PageSource::Artifact(a) => {
                let m = a.meta();
                if layer >= m.n_layer || m.d_model != d || m.n_ff != gate.rows {
                    return Err(rt(format!(
                        "model layer {layer} FFN [{}x{d}] does not match the artifact ({} layers, n_ff {}, d_model {})",
                        gate.rows, m.n_layer, m.n_ff, m.d_model
                    )));
                }
                let ld = a.layer(layer);
                let pages = (0..ld.n_pages)
                    .map(|p| artifact_page_q8(a, layer, p))
                    .collect::<Result<_>>()?;
                (pages, ld.n_trunk)
            }
            PageSource::Synthetic => (synthetic_pages(gate, up, down)?, 0),
        };
        let n_pages = pages.len();
        if n_pages == 0 {
            return Err(rt(format!("layer {layer} has no pages")));
        }
        let mut flat = Vec::with_capacity(n_pages * q8_0_page_bytes(d));
        for p in &pages {
            flat.extend_from_slice(&split_q8_0_page(p, d).map_err(rt)?);
        }
        drop(pages);
        let s = &self.inner.stream;
        let dev_pages = s.clone_htod(&flat).map_err(drv)?;
        self.inner.account(MemKind::Weights, flat.len());
        let mut ld = LayerDev {
            d_model: d,
            n_pages,
            n_trunk,
            pages: dev_pages,
            ids: s.alloc_zeros::<u32>(n_pages).map_err(drv)?,
            count: s.alloc_zeros::<i32>(1).map_err(drv)?,
            router: None,
            router_margin: None,
        };
        self.apply_mode(layer, &mut ld, self.mode())?;
        // Grid of the fused kernel (both phases): every block resident.
        let ffn = &self.inner.functions[self.inner.kernel_index["superblock_ffn_q8s"]];
        if d * 4 > 48 * 1024 {
            ffn.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                (d * 4) as i32,
            )
            .map_err(drv)?;
        }
        let per_sm = ffn
            .occupancy_max_active_blocks_per_multiprocessor(FFN_THREADS, d * 4, None)
            .map_err(drv)?
            .max(1);
        let grid = per_sm * self.multiprocessors;
        {
            let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
            let n_chunks = d.div_ceil(128);
            let parts = (grid as usize / n_chunks).max(1);
            let grow = |slot: &mut Option<CudaSlice<f32>>, n: usize| -> Result<()> {
                if slot.as_ref().is_none_or(|b| b.len() < n) {
                    *slot = Some(s.alloc_zeros::<f32>(n).map_err(drv)?);
                }
                Ok(())
            };
            grow(&mut sc.hbuf, n_pages * PAGE_CHANNELS)?;
            grow(&mut sc.partials, parts * d)?;
            if sc.counters.as_ref().is_none_or(|b| b.len() < 2 + n_chunks) {
                sc.counters = Some(s.alloc_zeros::<u32>(2 + n_chunks).map_err(drv)?);
            }
        }
        // The same for every layer of one d_model; set at upload, before any
        // step records launches with it.
        self.grid.store(grid, Ordering::Relaxed);
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
        let routed = match self.mode() {
            SparsePages::Routed {
                exact_projection, ..
            } => Some(exact_projection),
            _ => None,
        };
        // One row at a time: the active list (and, routed, the routing) is
        // per token; the stream orders row r's FFN before row r + 1's routing
        // overwrites the list.
        for r in 0..rows {
            let off = (4 * r * d) as u64;
            if let Some(exact) = routed {
                self.launch_route(ld, px + off, exact)?;
            }
            self.launch_ffn(ld, px + off, py + off)?;
        }
        Ok(())
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
