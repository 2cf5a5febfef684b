//! The superblock CPU backend: the runtime's [`Backend`] with exactly one op
//! replaced — the FFN runs from the artifact's page-major pages, computing
//! the trunk plus the candidate pages only (the skipped pages' weights are
//! never read). Everything else delegates to [`CpuBackend`].
//!
//! Modes ([`SparseMode`]): every stored page; a prefix of `k` pages (the
//! contiguous prefix run with the same per-page dense kernel: no routing);
//! the BVH router at a margin; the low-rank predictor at a threshold; and the
//! oracle (computes every page, keeps the oracle set: a reference, not a
//! speed path).

use std::sync::{Arc, Mutex, RwLock};

use mirage_gguf::quant::{self, DotFn};
use mirage_gguf::GgmlType;
use mirage_route::{CpuBvh, Router};
use mirage_runtime::backend::cpu::{CpuActivations, CpuMatrix};
use mirage_runtime::backend::HostMatrix;
use mirage_runtime::kv_cache::KvCache;
use mirage_runtime::{Backend, CpuBackend, RuntimeError};
use rayon::prelude::*;

use crate::error::{ArtifactError, Result};
use crate::ffn::{axpy, silu};
use crate::fit::predictor_scores;
use crate::format::{Artifact, PAGE_CHANNELS};
use crate::metrics::{largest_pages, oracle_useful_set, ORACLE_COSINE};
use crate::prefix::pages_for_fraction;

/// Which pages the FFN runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SparseMode {
    /// Every stored page.
    All,
    /// The first `k` pages (trunk first, then by hotness).
    Prefix(usize),
    /// Trunk + pages the BVH router selects with this margin.
    Bvh {
        /// Box inflation in std units of each slice axis.
        margin: f32,
    },
    /// Trunk + pages whose predictor score reaches this threshold.
    Predictor {
        /// Score threshold.
        threshold: f32,
    },
    /// The oracle useful set (computes every page first).
    Oracle,
    /// The `ceil(fraction * groups)` groups of `group_channels` channels
    /// (consecutive in the artifact's order) with the largest outputs, per
    /// token and layer (computes every page first; the trunk gets no
    /// preference). With whole pages (`group_channels` = [`PAGE_CHANNELS`])
    /// it is the fidelity a router that knew each page's output could reach
    /// at this active fraction, an upper bound to compare routers with;
    /// smaller groups ask what finer pages would keep. The active count is
    /// the pages with at least one channel kept.
    OracleTop {
        /// Share of the layer's groups kept, in (0, 1].
        fraction: f32,
        /// Channels a group: a divisor of [`PAGE_CHANNELS`].
        group_channels: u16,
    },
}

/// Decides the active pages of one token at one layer (all modes but the
/// oracle, which needs the page outputs).
pub struct PageSelector {
    artifact: Arc<Artifact>,
    mode: SparseMode,
    bvhs: Vec<Mutex<CpuBvh>>,
}

impl std::fmt::Debug for PageSelector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PageSelector({:?})", self.mode)
    }
}

impl PageSelector {
    /// Builds the per-layer routers the mode needs (BVH built once here).
    pub fn new(artifact: Arc<Artifact>, mode: SparseMode) -> Result<PageSelector> {
        if let SparseMode::OracleTop {
            fraction,
            group_channels,
        } = mode
        {
            if !(fraction > 0.0 && fraction <= 1.0) {
                return Err(ArtifactError::InvalidArgument(format!(
                    "oracle-top fraction {fraction} is not in (0, 1]"
                )));
            }
            if group_channels == 0 || !PAGE_CHANNELS.is_multiple_of(group_channels as usize) {
                return Err(ArtifactError::InvalidArgument(format!(
                    "oracle-top group of {group_channels} channels does not divide a page of {PAGE_CHANNELS}"
                )));
            }
        }
        let bvhs = match mode {
            SparseMode::Bvh { margin } => (0..artifact.meta().n_layer)
                .map(|l| {
                    Ok(Mutex::new(CpuBvh::new(
                        &artifact.router_with_margin(l, margin),
                    )?))
                })
                .collect::<Result<_>>()?,
            _ => Vec::new(),
        };
        Ok(PageSelector {
            artifact,
            mode,
            bvhs,
        })
    }

    /// The mode.
    pub fn mode(&self) -> SparseMode {
        self.mode
    }

    /// Active pages (ascending) of FFN input `x` at `layer`; `None` for the
    /// oracle modes (they need every page's output: [`PageSelector::pick_from_outputs`]).
    pub fn select(&self, layer: usize, x: &[f32]) -> Result<Option<Vec<usize>>> {
        let ld = self.artifact.layer(layer);
        let n = ld.n_pages;
        Ok(Some(match self.mode {
            SparseMode::All => (0..n).collect(),
            // Every page is trunk: nothing to route (the same set).
            SparseMode::Bvh { .. } | SparseMode::Predictor { .. } if ld.n_trunk >= n => {
                (0..n).collect()
            }
            SparseMode::Prefix(k) => (0..k.min(n)).collect(),
            SparseMode::Bvh { .. } => {
                let mut pts = Vec::with_capacity(ld.router.slices);
                ld.router.project_into(x, &mut pts)?;
                let set = self.bvhs[layer]
                    .lock()
                    .map_err(|_| ArtifactError::InvalidArgument("router lock poisoned".into()))?
                    .route(&pts)?;
                (0..n)
                    .filter(|&p| p < ld.n_trunk || set.contains(0, p))
                    .collect()
            }
            SparseMode::Predictor { threshold } => {
                let mut s = Vec::new();
                let rank = self.artifact.meta().predictor_rank;
                predictor_scores(
                    &ld.predictor_proj,
                    &ld.predictor_weights,
                    rank,
                    x.len(),
                    x,
                    &mut s,
                );
                (0..n)
                    .filter(|&p| p < ld.n_trunk || s[p] >= threshold)
                    .collect()
            }
            SparseMode::Oracle | SparseMode::OracleTop { .. } => return Ok(None),
        }))
    }

    /// The oracle modes' pages (ascending) from every page's output
    /// (`contributions`: one `d_model` vector per page, or per group of
    /// `OracleTop`'s `group_channels`, and then the groups); `None` for the
    /// modes [`PageSelector::select`] answers.
    pub fn pick_from_outputs(&self, contributions: &[f32], d_model: usize) -> Option<Vec<usize>> {
        match self.mode {
            SparseMode::Oracle => Some(oracle_useful_set(contributions, d_model, ORACLE_COSINE)),
            SparseMode::OracleTop { fraction, .. } => {
                let groups = contributions.len() / d_model.max(1);
                Some(largest_pages(
                    contributions,
                    d_model,
                    pages_for_fraction(fraction, groups),
                ))
            }
            _ => None,
        }
    }
}

/// The FFN input one row's pages are multiplied with: quantized to the
/// rows' dot type (the fast CPU kernels) or f32 (`with_f32_activations`).
#[derive(Clone, Copy)]
enum FfnInput<'a> {
    Quantized(&'a [u8]),
    F32(&'a [f32]),
}

/// One layer's FFN handle: the layer index into the artifact.
#[derive(Debug)]
pub struct SuperFfn {
    layer: usize,
    quant: GgmlType,
    act_ty: GgmlType,
    dot: DotFn,
    row_bytes: usize,
}

/// The superblock backend. See the module doc.
pub struct SuperblockBackend {
    inner: CpuBackend,
    artifact: Arc<Artifact>,
    selector: RwLock<PageSelector>,
    active: Mutex<Vec<Vec<u16>>>,
    /// Gate/up dot products against f32 `x` (rows dequantized) instead of
    /// `x` quantized to the rows' dot type: the arithmetic of the CUDA fused
    /// kernel, for like-for-like comparisons (slower).
    f32_activations: bool,
}

impl std::fmt::Debug for SuperblockBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SuperblockBackend {{ artifact: {} }}",
            self.artifact.meta().source_name
        )
    }
}

fn rt(e: ArtifactError) -> RuntimeError {
    RuntimeError::InvalidArgument(format!("superblock: {e}"))
}

impl SuperblockBackend {
    /// A backend running `artifact`'s pages in `mode`, other ops on `inner`.
    pub fn new(
        inner: CpuBackend,
        artifact: Arc<Artifact>,
        mode: SparseMode,
    ) -> Result<SuperblockBackend> {
        let selector = RwLock::new(PageSelector::new(artifact.clone(), mode)?);
        let active = Mutex::new(vec![Vec::new(); artifact.meta().n_layer]);
        Ok(SuperblockBackend {
            inner,
            artifact,
            selector,
            active,
            f32_activations: false,
        })
    }

    /// Multiplies the pages' gate and up rows with `x` in f32 (each row
    /// dequantized) rather than with `x` quantized to Q8_0 (the dot kernels'
    /// input): what the CUDA fused superblock kernel computes. Over a whole
    /// model the Q8_0 rounding of `x` alone moves SmolLM2's last logits to a
    /// cosine of ~0.995 against the f32 path, so a reference for the GPU
    /// must not have it.
    pub fn with_f32_activations(mut self) -> SuperblockBackend {
        self.f32_activations = true;
        self
    }

    /// Switches the mode (rebuilds routers).
    pub fn set_mode(&self, mode: SparseMode) -> Result<()> {
        let s = PageSelector::new(self.artifact.clone(), mode)?;
        *self
            .selector
            .write()
            .map_err(|_| ArtifactError::InvalidArgument("lock poisoned".into()))? = s;
        Ok(())
    }

    /// Per layer, the active page count of every token row run since the
    /// last call (cleared).
    pub fn take_active_counts(&self) -> Vec<Vec<u16>> {
        let mut a = self.active.lock().unwrap_or_else(|e| e.into_inner());
        let n = a.len();
        std::mem::replace(&mut *a, vec![Vec::new(); n])
    }

    /// The artifact.
    pub fn artifact(&self) -> &Arc<Artifact> {
        &self.artifact
    }

    /// Hidden activations of page `p` for the input `x` (`d` values).
    fn page_hidden(
        &self,
        f: &SuperFfn,
        p: usize,
        d: usize,
        x: FfnInput<'_>,
        h: &mut [f32],
    ) -> Result<()> {
        let page = self.artifact.page(f.layer, p);
        let rb = f.row_bytes;
        let xq = match x {
            FfnInput::Quantized(xq) => xq,
            FfnInput::F32(x) => {
                let (mut g, mut u) = (vec![0f32; d], vec![0f32; d]);
                for (i, h) in h.iter_mut().enumerate().take(PAGE_CHANNELS) {
                    quant::dequantize(f.quant, &page[i * rb..(i + 1) * rb], &mut g)?;
                    quant::dequantize(
                        f.quant,
                        &page[(PAGE_CHANNELS + i) * rb..(PAGE_CHANNELS + i + 1) * rb],
                        &mut u,
                    )?;
                    let dot = |w: &[f32]| w.iter().zip(x).map(|(a, b)| a * b).sum::<f32>();
                    *h = silu(dot(&g)) * dot(&u);
                }
                return Ok(());
            }
        };
        for (i, h) in h.iter_mut().enumerate().take(PAGE_CHANNELS) {
            let g_row = &page[i * rb..(i + 1) * rb];
            let u_row = &page[(PAGE_CHANNELS + i) * rb..(PAGE_CHANNELS + i + 1) * rb];
            // SAFETY: rows are row_bytes(quant, d) long (checked at load),
            // xq is encoded as vec_dot_type(quant) for d values.
            let (g, u) = unsafe { ((f.dot)(d, g_row, xq), (f.dot)(d, u_row, xq)) };
            *h = silu(g) * u;
        }
        Ok(())
    }

    /// `y += W_down,p h` over the page's `channels` (down rows with `h` = 0 skipped).
    fn page_down(
        &self,
        f: &SuperFfn,
        p: usize,
        channels: std::ops::Range<usize>,
        h: &[f32],
        y: &mut [f32],
        tmp: &mut [f32],
    ) -> Result<()> {
        let page = self.artifact.page(f.layer, p);
        let rb = f.row_bytes;
        for i in channels {
            let hi = h[i];
            if hi == 0.0 {
                continue;
            }
            let row = &page[(2 * PAGE_CHANNELS + i) * rb..(2 * PAGE_CHANNELS + i + 1) * rb];
            quant::dequantize(f.quant, row, tmp)?;
            axpy(y, hi, tmp);
        }
        Ok(())
    }

    /// FFN output of one row over `pages`.
    fn run_pages(
        &self,
        f: &SuperFfn,
        x: FfnInput<'_>,
        d: usize,
        pages: &[usize],
        parallel: bool,
    ) -> Result<Vec<f32>> {
        let one = |p: usize| -> Result<Vec<f32>> {
            let mut h = [0f32; PAGE_CHANNELS];
            self.page_hidden(f, p, d, x, &mut h)?;
            let mut y = vec![0f32; d];
            let mut tmp = vec![0f32; d];
            self.page_down(f, p, 0..PAGE_CHANNELS, &h, &mut y, &mut tmp)?;
            Ok(y)
        };
        let parts: Vec<Vec<f32>> = if parallel {
            pages.par_iter().map(|&p| one(p)).collect::<Result<_>>()?
        } else {
            pages.iter().map(|&p| one(p)).collect::<Result<_>>()?
        };
        let mut y = vec![0f32; d];
        for part in &parts {
            axpy(&mut y, 1.0, part);
        }
        Ok(y)
    }

    /// The oracle modes: every page's output, split into groups of the
    /// mode's channels (whole pages for `Oracle`), the selector's groups kept
    /// and summed in index order. Returns the output and the pages with a
    /// kept channel.
    fn run_from_outputs(
        &self,
        f: &SuperFfn,
        sel: &PageSelector,
        x: FfnInput<'_>,
        d: usize,
    ) -> Result<(Vec<f32>, usize)> {
        let g = match sel.mode() {
            SparseMode::OracleTop { group_channels, .. } => group_channels as usize,
            _ => PAGE_CHANNELS,
        };
        let n = self.artifact.layer(f.layer).n_pages;
        let per_page = PAGE_CHANNELS / g;
        let contrib: Vec<Vec<f32>> = (0..n)
            .into_par_iter()
            .map(|p| {
                let mut h = [0f32; PAGE_CHANNELS];
                self.page_hidden(f, p, d, x, &mut h)?;
                let mut out = vec![0f32; per_page * d];
                let mut tmp = vec![0f32; d];
                for (k, y) in out.chunks_exact_mut(d).enumerate() {
                    self.page_down(f, p, k * g..(k + 1) * g, &h, y, &mut tmp)?;
                }
                Ok(out)
            })
            .collect::<Result<_>>()?;
        let flat = contrib.concat();
        let kept = sel.pick_from_outputs(&flat, d).ok_or_else(|| {
            ArtifactError::InvalidArgument(format!("{:?} selected no pages", sel.mode()))
        })?;
        let mut y = vec![0f32; d];
        let mut touched = vec![false; n];
        for &k in &kept {
            axpy(&mut y, 1.0, &flat[k * d..(k + 1) * d]);
            touched[k / per_page] = true;
        }
        Ok((y, touched.iter().filter(|&&t| t).count()))
    }

    fn ffn_row(
        &self,
        f: &SuperFfn,
        sel: &PageSelector,
        x: &[f32],
        parallel: bool,
    ) -> Result<(Vec<f32>, usize)> {
        let d = x.len();
        let mut xq = Vec::new();
        let input = if self.f32_activations {
            FfnInput::F32(x)
        } else {
            xq.resize(quant::row_bytes(f.act_ty, d)?, 0u8);
            quant::quantize(f.act_ty, x, &mut xq)?;
            FfnInput::Quantized(&xq)
        };
        match sel.select(f.layer, x)? {
            Some(pages) => Ok((self.run_pages(f, input, d, &pages, parallel)?, pages.len())),
            None => self.run_from_outputs(f, sel, input, d),
        }
    }
}

impl Backend for SuperblockBackend {
    type Matrix = CpuMatrix;
    type Vector = Vec<f32>;
    type Ffn = SuperFfn;
    type Activations = CpuActivations;
    type KvCache = KvCache;

    fn name(&self) -> String {
        "superblock-cpu".into()
    }
    // Everything but the FFN is the inner CPU backend's: attention, KV
    // caches and their page pruning included.
    mirage_runtime::forward_backend_ops!(inner, matrices);
    fn upload_ffn(
        &self,
        layer: usize,
        gate: &HostMatrix,
        _up: &HostMatrix,
        _down: &HostMatrix,
    ) -> mirage_runtime::Result<SuperFfn> {
        let meta = self.artifact.meta();
        if layer >= meta.n_layer || gate.rows != meta.n_ff || gate.cols != meta.d_model {
            return Err(RuntimeError::InvalidArgument(format!(
                "superblock: model layer {layer} FFN [{}x{}] does not match the artifact ({} layers, n_ff {}, d_model {})",
                gate.rows, gate.cols, meta.n_layer, meta.n_ff, meta.d_model
            )));
        }
        let quant = self.artifact.layer(layer).quant;
        let dot = quant::dot_fn(quant)
            .ok_or_else(|| RuntimeError::InvalidArgument(format!("no dot kernel for {quant}")))?;
        let row_bytes = quant::row_bytes(quant, meta.d_model).map_err(|e| rt(e.into()))?;
        Ok(SuperFfn {
            layer,
            quant,
            act_ty: quant::vec_dot_type(quant),
            dot,
            row_bytes,
        })
    }
    fn ffn(
        &self,
        f: &SuperFfn,
        x: &CpuActivations,
        out: &mut CpuActivations,
    ) -> mirage_runtime::Result<()> {
        let d = self.artifact.meta().d_model;
        if x.width() != d {
            return Err(RuntimeError::InvalidArgument(format!(
                "ffn input width {} != {d}",
                x.width()
            )));
        }
        let sel = self
            .selector
            .read()
            .map_err(|_| RuntimeError::InvalidArgument("lock poisoned".into()))?;
        let n = x.rows();
        let rows: Vec<(Vec<f32>, usize)> = if n == 1 {
            vec![self.ffn_row(f, &sel, x.row(0), true).map_err(rt)?]
        } else {
            (0..n)
                .into_par_iter()
                .map(|r| self.ffn_row(f, &sel, x.row(r), false))
                .collect::<Result<_>>()
                .map_err(rt)?
        };
        {
            let mut a = self.active.lock().unwrap_or_else(|e| e.into_inner());
            a[f.layer].extend(rows.iter().map(|r| r.1 as u16));
        }
        let data: Vec<f32> = rows.into_iter().flat_map(|r| r.0).collect();
        *out = CpuActivations::from_vec(n, d, data)?;
        Ok(())
    }
}
