//! [`SparseCudaBackend`]: the superblock (page-major, sparse FFN) backend on
//! CUDA. Every op but the FFN is its inner [`CudaBackend`]'s, on the same
//! context, stream and launch recorder; the FFN runs the fused page kernel
//! of the page format (`pages`: Q8_0, NVFP4 or Q2_K pages, `cuda/superblock*.cu`)
//! over a per-layer active page list that lives in device memory, written
//! either once (all pages, a prefix by hotness, a forced random subset) or
//! per token by the BVH traversal of `cuda/route.cu` (`router`; routed
//! mode). No op of a decode step reads anything back to the host, so the
//! whole sparse step, routing included, is recorded and replayed as one CUDA
//! graph.
//!
//! The fused kernel's gate/up/SwiGLU phase and its down phase are two
//! launches of the same kernel (`phases` 1 then 2, same grid): the kernel
//! boundary is the barrier between them.

pub mod pages;
mod router;

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::CudaSlice;
use mirage_artifact::Artifact;
use mirage_gguf::GgmlType;
use mirage_runtime::backend::{Backend, HostMatrix};
use mirage_runtime::{Result, RuntimeError};

use crate::backend::{bad, drv, CudaActivations, CudaBackend, MemKind};
use crate::launch::{Arg, Launch, SparseFfn as FfnWork, Work};
pub use crate::options::{PageFormat, RouteTraversal, SparsePages};
use crate::{module, CudaError, CudaKvCache, CudaMatrix, CudaVector};
pub use pages::{PageError, Pages, PAGE_CHANNELS};
use router::{DeviceRouter, LayerList};

/// Every kernel of the sparse module (`module::SPARSE_SOURCE`) the backend
/// loads.
pub(crate) const KERNELS: [&str; 4] = [
    "superblock_ffn_q8s",
    "superblock_ffn_nvfp4",
    "superblock_ffn_q2k",
    "route_bvh",
];

/// Arguments of the fused Q8_0 FFN (`SB_Q8S_PARAMS`, `part_ch`, the folded
/// norm's three); `checks::nvrtc_check` holds the kernel's PTX parameter
/// list to it.
#[cfg(test)]
pub(crate) const Q8_FFN_ARGS: usize = 18;
/// Arguments of the other fused FFN kernels: `SB_Q8S_PARAMS` (14; Q2_K's
/// are the same) and NVFP4's three tensor scales on top.
#[cfg(test)]
pub(crate) const FFN_KERNEL_ARGS: usize = 14;
#[cfg(test)]
pub(crate) use router::ROUTE_ARGS;

/// Threads per block of the fused FFN (`SB_THREADS`).
const FFN_THREADS: u32 = 256;

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

/// One layer's device state, owned by the backend (mode changes rewrite the
/// active lists of every layer).
struct LayerDev {
    d_model: usize,
    n_pages: usize,
    n_trunk: usize,
    pages: CudaSlice<u8>,
    /// Encoding of `pages` (the backend's format when it was uploaded).
    format: PageFormat,
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

impl LayerDev {
    fn list(&self) -> LayerList<'_> {
        LayerList {
            ids: &self.ids,
            count: &self.count,
            n_pages: self.n_pages,
            n_trunk: self.n_trunk,
        }
    }
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

/// A page format's width check as the backend reports it: Q2_K's as
/// `UnsupportedType` (the model's width cannot be held in Q2_K pages).
fn check_width(format: PageFormat, d_model: usize) -> Result<()> {
    format.check_d_model(d_model).map_err(|e| match format {
        PageFormat::Q2K => RuntimeError::UnsupportedType {
            backend: "superblock-cuda".into(),
            ty: GgmlType::Q2_K,
            what: e.to_string(),
        },
        _ => rt(e),
    })
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

/// The pages of format `format` a [`SparseCudaBackend`] uploads for
/// `layer`, built on the host (no device needed), in the artifact's channel
/// order (stored channel `k` is its `perm[k]`, only its kept pages) or, for
/// [`PageSource::Synthetic`], the model's own (a last partial page
/// zero-padded). Q8_0 pages of an artifact are its stored pages (other
/// types re-encoded as Q8_0); the other formats are the model's gate, up
/// and down (any ggml type) encoded as whole layer matrices
/// ([`Pages::from_gguf_parts`]) and laid out in that order without
/// re-encoding.
pub fn layer_pages(
    format: PageFormat,
    source: &PageSource,
    layer: usize,
    gate: &HostMatrix,
    up: &HostMatrix,
    down: &HostMatrix,
) -> Result<Pages> {
    let (d, n_ff) = (gate.cols, gate.rows);
    if up.rows != n_ff || up.cols != d || down.rows != d || down.cols != n_ff {
        return Err(rt(format!(
            "layer {layer}: FFN shapes gate {}x{}, up {}x{}, down {}x{} do not fit",
            gate.rows, gate.cols, up.rows, up.cols, down.rows, down.cols
        )));
    }
    check_width(format, d)?;
    if let PageSource::Artifact(a) = source {
        check_artifact_layer(a, layer, d, n_ff)?;
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let what = |e: PageError| rt(format!("layer {layer}: {format} pages: {e}"));
    match (format, source) {
        (PageFormat::Q8_0, PageSource::Artifact(a)) => {
            // The stored pages as three matrices of ggml rows.
            let ld = a.layer(layer);
            let mat = quant_row_bytes(ld.quant, d)? * PAGE_CHANNELS;
            let mut mats: [Vec<u8>; 3] = Default::default();
            for p in 0..ld.n_pages {
                let page = a.page(layer, p);
                for (m, out) in mats.iter_mut().enumerate() {
                    out.extend_from_slice(&page[m * mat..(m + 1) * mat]);
                }
            }
            let n = ld.n_pages * PAGE_CHANNELS;
            let [g, u, dt] =
                mats.map(|m| PageFormat::Q8_0.encode_rows(ld.quant, &m, n, d, threads));
            let (g, u, dt) = (g.map_err(what)?, u.map_err(what)?, dt.map_err(what)?);
            Pages::from_split(
                PageFormat::Q8_0,
                d,
                n,
                [(&g.0, 0.0), (&u.0, 0.0), (&dt.0, 0.0)],
            )
            .map_err(what)
        }
        _ => {
            let all = Pages::from_gguf_parts(
                format,
                d,
                n_ff,
                (gate.ty, gate.data.as_slice()),
                (up.ty, up.data.as_slice()),
                (down.ty, down.data.as_slice()),
                threads,
            )
            .map_err(what)?;
            match source {
                PageSource::Synthetic => Ok(all),
                PageSource::Artifact(a) => all.permuted(&a.layer(layer).perm).map_err(what),
            }
        }
    }
}

fn quant_row_bytes(ty: GgmlType, d: usize) -> Result<usize> {
    Ok(mirage_gguf::quant::row_bytes(ty, d)?)
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
    /// Wraps `inner` (its context, stream and launch recorder) and loads the
    /// sparse kernels into it. `source` supplies the pages at `upload_ffn`.
    pub fn new(
        mut inner: CudaBackend,
        source: PageSource,
        mode: SparsePages,
    ) -> std::result::Result<SparseCudaBackend, CudaError> {
        if matches!(mode, SparsePages::Routed { .. }) && matches!(source, PageSource::Synthetic) {
            return Err(CudaError::Setting(
                "routed mode needs an artifact (synthetic pages have no router)".into(),
            ));
        }
        let cc = inner.compute_capability();
        let (ptx, _) = module::ptx_for("sparse", module::SPARSE_SOURCE, cc.0, cc.1)?;
        let m = inner
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx.clone()))
            .map_err(|e| CudaError::Driver(e.to_string()))?;
        let names: Vec<String> = KERNELS.iter().map(|k| k.to_string()).collect();
        inner.kernels.load(&m, &ptx, &names)?;
        Ok(SparseCudaBackend {
            inner,
            source,
            mode: Mutex::new(mode),
            layers: Mutex::new(Vec::new()),
            scratch: Mutex::new(FfnScratch::default()),
            format: Mutex::new(PageFormat::default()),
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

    fn layers(&self) -> MutexGuard<'_, Vec<Option<LayerDev>>> {
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
                    ld.router = Some(self.inner.upload_router(&data, ld.d_model)?);
                    ld.router_margin = Some(margin);
                }
                // All trunk: the list is every page, routed or not (the
                // layer launches no router, `routes`).
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
        let ld = layer_dev(&layers, layer)?;
        let n = self.inner.stream.clone_dtoh(&ld.count).map_err(drv)?[0].max(0) as usize;
        let ids = self.inner.stream.clone_dtoh(&ld.ids).map_err(drv)?;
        Ok(ids[..n.min(ids.len())].to_vec())
    }

    /// Pages stored per uploaded layer, and bytes per page (device layout).
    pub fn page_shape(&self) -> Vec<(usize, usize)> {
        self.layers()
            .iter()
            .flatten()
            .map(|l| (l.n_pages, l.format.page_bytes(l.d_model)))
            .collect()
    }

    /// The routed mode's traversal and margin; `None` in the other modes.
    fn routing(&self) -> Option<(RouteTraversal, f32)> {
        match self.mode() {
            SparsePages::Routed { traversal, margin } => Some((traversal, margin)),
            _ => None,
        }
    }

    /// Routes the row at `px` into `ld`'s list when the routed mode has a
    /// router to launch there: some of its pages are routed (not trunk). A
    /// layer whose pages are all trunk (most layers of a small model at the
    /// fidelity gates) launches none: its list is every page, written once,
    /// the list the router would return. Returns whether it launched.
    fn route_layer(&self, ld: &LayerDev, px: u64) -> Result<bool> {
        let Some((traversal, _)) = self.routing() else {
            return Ok(false);
        };
        if ld.n_trunk >= ld.n_pages {
            return Ok(false);
        }
        let r = ld.router.as_ref().ok_or_else(|| rt("router not built"))?;
        self.inner
            .launch_route(r, ld.list(), px, ld.d_model, traversal)?;
        Ok(true)
    }

    /// Runs only the router of `layer` on `x` (one row of `d_model`): the
    /// active list is left on the device (read it with
    /// [`SparseCudaBackend::active_pages`]). For tests and timing.
    pub fn route_only(&self, layer: usize, x: &CudaActivations) -> Result<()> {
        if self.routing().is_none() {
            return Err(rt("route_only needs the routed mode"));
        }
        let px = self.inner.act_ptr(x)?;
        let layers = self.layers();
        self.route_layer(layer_dev(&layers, layer)?, px).map(|_| ())
    }

    /// Launches `ld`'s fused FFN on the row at `px` into `py` (phase 1,
    /// then phase 2); with `takes_norm` a pending RMSNorm folds into phase
    /// 1 as it would have into the router (a routed layer that launched no
    /// router).
    fn launch_ffn(&self, ld: &LayerDev, px: u64, py: u64, takes_norm: bool) -> Result<()> {
        let sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let (Some(h), Some(pa), Some(c)) = (&sc.hbuf, &sc.partials, &sc.counters) else {
            return Err(rt("FFN scratch not allocated"));
        };
        let d = ld.d_model;
        let mut head = vec![
            Arg::Ptr(self.inner.ptr(&ld.pages)),
            Arg::I64(ld.format.page_bytes(d) as i64),
            Arg::I32(ld.n_pages as i32),
            Arg::I32(d as i32),
        ];
        if ld.format == PageFormat::Nvfp4 {
            head.extend(ld.tensor_scales.map(Arg::F32));
        }
        let work = |phase| FfnWork {
            head: head.clone(),
            d: d as i32,
            x: px,
            list: [
                Arg::Ptr(self.inner.ptr(&ld.ids)),
                Arg::Ptr(self.inner.ptr(&ld.count)),
                Arg::I32(ld.n_pages as i32),
            ],
            // y = FFN(x); a recorded step may fold the residual add in.
            accumulate: false,
            scratch: [self.inner.ptr(h), self.inner.ptr(pa), self.inner.ptr(c)],
            y: py,
            phase,
            q8: (ld.format == PageFormat::Q8_0).then(|| q8_part_ch(d) as i32),
            // Only the Q8_0 kernel takes a folded norm.
            takes_norm: takes_norm && phase == 1 && ld.format == PageFormat::Q8_0,
            norm: None,
        };
        let kernel = self.inner.kernels.index(ld.format.kernel())?;
        // Same grid for both (phase 2's split of the channels depends on
        // it); phase 2 reads no x: no dynamic shared memory.
        for (phase, smem) in [(1, (d * 4) as u32), (2, 0)] {
            self.inner.push_launch(Launch {
                kernel,
                grid: (ld.grid.max(1), 1, 1),
                block: (FFN_THREADS, 1, 1),
                smem,
                work: Work::SparseFfn(work(phase)),
            })?;
        }
        Ok(())
    }

    /// Event-timed device time of `layer`'s routing and FFN on `x` (one
    /// row), median of `iters` runs each. Outside steps only.
    pub fn time_ops(&self, layer: usize, x: &CudaActivations, iters: usize) -> Result<OpTimes> {
        let px = self.inner.act_ptr(x)?;
        let mut y = CudaActivations::default();
        let layers = self.layers();
        let ld = layer_dev(&layers, layer)?;
        let py = self.inner.reshape(&mut y, 1, ld.d_model)?;
        let route_us = if self.routing().is_some() && ld.n_trunk < ld.n_pages {
            self.inner
                .median_us(iters, || self.route_layer(ld, px).map(|_| ()))?
        } else {
            0.0
        };
        let ffn_us = self
            .inner
            .median_us(iters, || self.launch_ffn(ld, px, py, false))?;
        Ok(OpTimes { route_us, ffn_us })
    }
}

fn layer_dev(layers: &[Option<LayerDev>], layer: usize) -> Result<&LayerDev> {
    layers
        .get(layer)
        .and_then(|l| l.as_ref())
        .ok_or_else(|| rt(format!("layer {layer} has no FFN uploaded")))
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
    fn upload_ffn(
        &self,
        layer: usize,
        gate: &HostMatrix,
        up: &HostMatrix,
        down: &HostMatrix,
    ) -> Result<SparseFfn> {
        // The layer's pages, its list (in the current mode) and the shared
        // scratch.
        let d = gate.cols;
        let format = self.page_format();
        let pages = layer_pages(format, &self.source, layer, gate, up, down)?;
        let n_trunk = match &self.source {
            PageSource::Artifact(a) => a.layer(layer).n_trunk,
            PageSource::Synthetic => 0,
        };
        let n_pages = pages.n_pages();
        if n_pages == 0 {
            return Err(rt(format!("layer {layer} has no pages")));
        }
        // Grids of every fused kernel that takes this width (each phase
        // launch of a layer uses its format's): every block resident. The
        // scratch covers any.
        let grid_of = |f: PageFormat| -> Result<u32> {
            let k = &self.inner.kernels.functions[self.inner.kernels.index(f.kernel())?];
            // Past 48 KiB of static plus dynamic shared memory a launch
            // needs the opt-in.
            let static_smem = k.shared_size_bytes().map_err(drv)?.max(0) as usize;
            if static_smem + d * 4 > 48 * 1024 {
                k.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    (d * 4) as i32,
                )
                .map_err(drv)?;
            }
            let per_sm = k
                .occupancy_max_active_blocks_per_multiprocessor(FFN_THREADS, d * 4, None)
                .map_err(drv)?
                .max(1);
            Ok(per_sm * self.inner.sm_count as u32)
        };
        let mut grid = 0;
        let mut partials = d;
        for f in PageFormat::ALL {
            if f.check_d_model(d).is_err() {
                continue;
            }
            let g = grid_of(f)?;
            partials = partials.max((g as usize / d.div_ceil(128)).max(1) * d);
            if f == format {
                grid = g;
            }
        }
        let s = &self.inner.stream;
        let dev_pages = s.clone_htod(pages.bytes()).map_err(drv)?;
        self.inner.account(MemKind::Weights, pages.bytes().len());
        let mut ld = LayerDev {
            d_model: d,
            n_pages,
            n_trunk,
            pages: dev_pages,
            format,
            tensor_scales: pages.tensor_scales(),
            grid,
            ids: s.alloc_zeros::<u32>(n_pages).map_err(drv)?,
            count: s.alloc_zeros::<i32>(1).map_err(drv)?,
            router: None,
            router_margin: None,
        };
        self.apply_mode(layer, &mut ld, self.mode())?;
        {
            let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
            let grow_f32 = |slot: &mut Option<CudaSlice<f32>>, n: usize| -> Result<()> {
                if slot.as_ref().is_none_or(|b| b.len() < n) {
                    *slot = Some(s.alloc_zeros::<f32>(n).map_err(drv)?);
                }
                Ok(())
            };
            grow_f32(&mut sc.hbuf, n_pages * PAGE_CHANNELS)?;
            grow_f32(&mut sc.partials, partials)?;
            let n_chunks = d.div_ceil(128);
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
    mirage_runtime::forward_backend_ops!(inner, matrices);
    fn ffn(&self, f: &SparseFfn, x: &CudaActivations, out: &mut CudaActivations) -> Result<()> {
        let layers = self.layers();
        let ld = layer_dev(&layers, f.layer)?;
        let d = ld.d_model;
        if x.width != d {
            return Err(bad(format!("ffn input width {} != {d}", x.width)));
        }
        let px = self.inner.act_ptr(x)?;
        let py = self.inner.reshape(out, x.rows, d)?;
        // One row at a time: the active list (and, routed, the routing) is
        // per token; the stream orders row r's FFN before row r + 1's routing
        // overwrites the list.
        for r in 0..x.rows {
            let off = (4 * r * d) as u64;
            // A routed layer without a router launch: the norm the router
            // would have taken folds into phase 1.
            let routed = self.routing().is_some();
            let norm_into_ffn = routed && !self.route_layer(ld, px + off)?;
            self.launch_ffn(ld, px + off, py + off, norm_into_ffn)?;
        }
        Ok(())
    }
}
