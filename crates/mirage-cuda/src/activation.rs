//! [`ActivationCudaBackend`]: activation sparsity on CUDA. Every op but the
//! seven projections of a layer and the lm head is the inner
//! [`CudaBackend`]'s, on the same context, stream and launch recorder.
//!
//! Per product and input row, the active channels are those with
//! `|x_i| >= thr_i` (the matrix's per-channel thresholds from the activation
//! artifact, the CPU `ActivationBackend`'s rule; none set: every channel).
//! - One row (decode) of a matrix with thresholds: `cuda/activation.cu`
//!   over the matrix's channel-major copy from the artifact; the scoring,
//!   the compaction of the active channels and the product run on the
//!   device inside the step's CUDA graph (nothing is read back). Q, K and
//!   V (gate and up) of one type share a launch; down scores the SwiGLU
//!   output it computes from gate and up itself.
//! - A prompt batch with thresholds: the dense kernels on the input with
//!   the inactive channels zeroed (`act_mask`), as the CPU path runs it.
//! - No thresholds: the inner backend's dense op, launch for launch (the
//!   "dense" row of a benchmark is this backend without thresholds).
//!
//! Device memory: the dense weights (prompt batches, matrices without
//! thresholds) and the channel-major copies of the projections and the
//! head, about twice the model.

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::CudaSlice;
use mirage_artifact::activation::format::ActivationArtifact;
use mirage_artifact::activation::{matrix_index, Proj};
use mirage_gguf::quant::channel_major::ChannelMajorLayout;
use mirage_gguf::GgmlType;
use mirage_runtime::backend::{
    AttentionParams, Backend, HostMatrix, QkNorm, StepInputs, TokenSlot,
};
use mirage_runtime::kv_cache::KvSpec;
use mirage_runtime::kv_pages::KvPruning;
use mirage_runtime::Result;

use crate::backend::{bad, drv, CudaActivations, CudaBackend, MemKind};
use crate::launch::{ActMatVec, Launch, Work};
use crate::{module, CudaError, CudaFfn, CudaKvCache, CudaMatrix, CudaVector};

/// Arguments of the `act_mv_*` kernels (`ACT_KERNEL` in cuda/activation.cu);
/// `checks::nvrtc_check` holds the PTX to it.
#[cfg(test)]
pub(crate) const ACT_ARGS: usize = 32;

/// Most channels one block of `act_mv_*` scores (`ACT_MAX_CH`).
const MAX_BLOCK_CHANNELS: usize = 2048;

/// Tile counters per matrix slot of a launch (tiles of a matrix at most).
const COUNTERS_PER_SLOT: usize = 4096;

/// Every kernel of the activation module.
pub(crate) fn kernel_names() -> Vec<String> {
    let mut v: Vec<String> = CM_TYPES
        .iter()
        .map(|t| format!("act_mv_{}", t.name()))
        .collect();
    v.push("act_mask".into());
    v
}

/// The types the channel-major layout (and so the kernels) take.
const CM_TYPES: [GgmlType; 8] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// Bytes per output of a scale record and of a super-block header (the
/// layout's scheme), for the bytes-read count.
fn record_header_bytes(ty: GgmlType) -> (usize, usize) {
    match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 => (4, 0),
        GgmlType::Q4_K | GgmlType::Q5_K => (2, 4),
        GgmlType::Q6_K => (1, 2),
        _ => (2, 0),
    }
}

/// Splits of the input channels for a launch of `tiles` blocks per split:
/// about two blocks per SM, at most [`MAX_BLOCK_CHANNELS`] channels and at
/// least one scale group per block. Returns (splits, groups per block).
pub fn split_for(cols: usize, group: usize, tiles: usize, sm_count: usize) -> (usize, usize) {
    let n_groups = (cols / group).max(1);
    let min_split = cols.div_ceil(MAX_BLOCK_CHANNELS).max(1);
    let want = (2 * sm_count).div_ceil(tiles.max(1));
    let split = want.max(min_split).min(n_groups);
    let gpb = n_groups.div_ceil(split);
    (n_groups.div_ceil(gpb), gpb)
}

/// A matrix's channel-major copy on the device.
#[derive(Debug)]
struct ChannelMajorDev {
    layout: ChannelMajorLayout,
    data: CudaSlice<u8>,
}

/// The sparse side of a matrix: its index among the sparsified matrices
/// (`layer * 7 + proj`, the head last) and its channel-major copy.
#[derive(Debug)]
pub struct SparseSide {
    index: Option<usize>,
    cm: Option<ChannelMajorDev>,
}

/// A weight matrix: the dense form and, for projections and the head, the
/// sparse side.
#[derive(Debug)]
pub struct ActCudaMatrix {
    dense: CudaMatrix,
    sparse: SparseSide,
}

/// One layer's FFN: the dense op and the three projections' sparse sides.
#[derive(Debug)]
pub struct ActCudaFfn {
    dense: CudaFfn,
    gate: SparseSide,
    up: SparseSide,
    down: SparseSide,
}

/// Device buffers the sparse ops share (one stream: used in order). A
/// buffer that grows keeps its old allocation alive in `retired`, so a
/// launch recorded earlier in the same step still points at memory.
#[derive(Default)]
struct ActScratch {
    partials: Option<CudaSlice<f32>>,
    counters: Option<CudaSlice<u32>>,
    stats: Option<CudaSlice<u64>>,
    masked: CudaActivations,
    gate: CudaActivations,
    up: CudaActivations,
    hidden: CudaActivations,
    retired: Vec<CudaSlice<f32>>,
}

/// Decode-kernel counters since the last [`ActivationCudaBackend::take_stats`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ActivationStats {
    /// Per matrix index: (active channels, scale groups with one) summed
    /// over the decode rows.
    pub active: Vec<(u64, u64)>,
    /// Weight bytes the sparse decode kernels read (runs of active
    /// channels, records of active groups, every super-block header).
    pub kernel_bytes: u64,
}

/// The activation-sparsity CUDA backend. See the module doc.
pub struct ActivationCudaBackend {
    inner: CudaBackend,
    artifact: Arc<ActivationArtifact>,
    n_layer: usize,
    thresholds: Mutex<Vec<Option<CudaSlice<f32>>>>,
    /// Layouts by matrix index (for the bytes-read count).
    layouts: Mutex<Vec<Option<ChannelMajorLayout>>>,
    scratch: Mutex<ActScratch>,
    /// Widest matrix input uploaded (the masked buffer's row).
    max_cols: Mutex<usize>,
}

impl std::fmt::Debug for ActivationCudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ActivationCudaBackend {{ {:?} }}", self.inner)
    }
}

/// One matrix of a sparse launch.
struct Job<'a> {
    cm: &'a ChannelMajorDev,
    thr: u64,
    y: u64,
    index: usize,
}

impl ActivationCudaBackend {
    /// Wraps `inner` (its context, stream and launch recorder) and loads the
    /// activation kernels into it; decode rows of matrices with thresholds
    /// read `artifact`'s channel-major copies. No thresholds: dense.
    pub fn new(
        mut inner: CudaBackend,
        artifact: Arc<ActivationArtifact>,
    ) -> std::result::Result<ActivationCudaBackend, CudaError> {
        let cc = inner.compute_capability();
        let (ptx, _) = module::ptx_for("activation", module::ACTIVATION_SOURCE, cc.0, cc.1)?;
        let m = inner
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx.clone()))
            .map_err(|e| CudaError::Driver(e.to_string()))?;
        inner.kernels.load(&m, &ptx, &kernel_names())?;
        let n_layer = artifact.meta().n_layer;
        let n_mat = n_layer * Proj::ALL.len() + 1;
        let d = |e: cudarc::driver::DriverError| CudaError::Driver(e.to_string());
        let scratch = ActScratch {
            counters: Some(
                inner
                    .stream
                    .alloc_zeros::<u32>(3 * COUNTERS_PER_SLOT)
                    .map_err(d)?,
            ),
            stats: Some(inner.stream.alloc_zeros::<u64>(2 * n_mat).map_err(d)?),
            ..ActScratch::default()
        };
        Ok(ActivationCudaBackend {
            inner,
            artifact,
            n_layer,
            thresholds: Mutex::new((0..n_mat).map(|_| None).collect()),
            layouts: Mutex::new(vec![None; n_mat]),
            scratch: Mutex::new(scratch),
            max_cols: Mutex::new(0),
        })
    }

    /// The dense backend every other op runs on.
    pub fn inner(&self) -> &CudaBackend {
        &self.inner
    }

    /// The artifact the channel-major copies come from.
    pub fn artifact(&self) -> &Arc<ActivationArtifact> {
        &self.artifact
    }

    fn scratch(&self) -> MutexGuard<'_, ActScratch> {
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets every matrix's per-channel thresholds (`None`: dense), indexed
    /// by `matrix_index`, the head last (as the CPU backend's
    /// `set_thresholds`). Not inside a step.
    pub fn set_thresholds(&self, thresholds: Vec<Option<Vec<f32>>>) -> Result<()> {
        let n_mat = self.n_layer * Proj::ALL.len() + 1;
        if thresholds.len() != n_mat {
            return Err(bad(format!(
                "{} threshold entries for {} layers and the head",
                thresholds.len(),
                self.n_layer
            )));
        }
        let mut dev = Vec::with_capacity(n_mat);
        for t in thresholds {
            dev.push(match t {
                Some(v) => Some(self.inner.stream.clone_htod(&v).map_err(drv)?),
                None => None,
            });
        }
        // Let queued work that reads the old thresholds finish first.
        self.inner.synchronize()?;
        *self.thresholds.lock().unwrap_or_else(|e| e.into_inner()) = dev;
        Ok(())
    }

    /// The decode kernels' counters since the last call (cleared; waits
    /// for the device).
    pub fn take_stats(&self) -> Result<ActivationStats> {
        let mut s = self.scratch();
        let buf = s.stats.as_mut().ok_or_else(|| bad("no stats buffer"))?;
        let mut host = vec![0u64; buf.len()];
        self.inner
            .stream
            .memcpy_dtoh(&*buf, host.as_mut_slice())
            .map_err(drv)?;
        self.inner.stream.memset_zeros(buf).map_err(drv)?;
        self.inner.synchronize()?;
        let layouts = self.layouts.lock().unwrap_or_else(|e| e.into_inner());
        let mut st = ActivationStats::default();
        for (m, c) in host.chunks(2).enumerate() {
            st.active.push((c[0], c[1]));
            if let Some(Some(l)) = layouts.get(m) {
                if c[0] == 0 {
                    continue;
                }
                let (rec, hdr) = record_header_bytes(l.ty());
                // Headers counted per active group, a super-block's share each.
                let per_group = rec as f64 + (hdr * l.group()) as f64 / l.superblock() as f64;
                st.kernel_bytes += (l.rows() as f64
                    * (c[0] as f64 * l.bits() as f64 / 8.0 + c[1] as f64 * per_group))
                    as u64;
            }
        }
        Ok(st)
    }

    fn make_side(&self, m: &HostMatrix, index: Option<usize>) -> Result<SparseSide> {
        let Some(index) = index else {
            return Ok(SparseSide {
                index: None,
                cm: None,
            });
        };
        {
            let mut mc = self.max_cols.lock().unwrap_or_else(|e| e.into_inner());
            *mc = (*mc).max(m.cols);
        }
        let a = &self.artifact;
        let head = head_index(self.n_layer);
        let e = if index == head {
            Some(a.head())
        } else {
            a.matrix(index / Proj::ALL.len(), Proj::ALL[index % Proj::ALL.len()])
        }
        .ok_or_else(|| bad(format!("{}: not in the activation artifact", m.name)))?;
        let l = e.layout;
        if l.rows() != m.rows || l.cols() != m.cols || l.ty() != m.ty {
            return Err(bad(format!(
                "{}: the artifact holds a {}x{} {} matrix, the model a {}x{} {}",
                m.name,
                l.rows(),
                l.cols(),
                l.ty(),
                m.rows,
                m.cols,
                m.ty
            )));
        }
        if !CM_TYPES.contains(&l.ty()) {
            return Err(bad(format!(
                "{}: no channel-major kernel for {}",
                m.name,
                l.ty()
            )));
        }
        let bytes = a
            .bytes()
            .get(e.offset..e.offset + l.bytes())
            .ok_or_else(|| bad(format!("{}: outside the artifact", m.name)))?;
        let data = self.inner.stream.clone_htod(bytes).map_err(drv)?;
        self.inner.account(MemKind::Weights, bytes.len());
        self.layouts.lock().unwrap_or_else(|e| e.into_inner())[index] = Some(l);
        Ok(SparseSide {
            index: Some(index),
            cm: Some(ChannelMajorDev { layout: l, data }),
        })
    }

    fn thr_ptr(&self, side: &SparseSide) -> Option<u64> {
        let t = self.thresholds.lock().unwrap_or_else(|e| e.into_inner());
        side.index
            .and_then(|i| t.get(i))
            .and_then(|s| s.as_ref())
            .map(|s| self.inner.ptr(s))
    }

    /// The decode job of `side` (thresholds set and a channel-major copy).
    fn job<'a>(&self, side: &'a SparseSide, y: u64) -> Option<Job<'a>> {
        let thr = self.thr_ptr(side)?;
        Some(Job {
            cm: side.cm.as_ref()?,
            thr,
            y,
            index: side.index?,
        })
    }

    /// Grows `slot` to `n` floats, keeping the old buffer alive.
    fn grow(
        &self,
        s: &mut ActScratch,
        which: fn(&mut ActScratch) -> &mut Option<CudaSlice<f32>>,
        n: usize,
    ) -> Result<u64> {
        let cap = which(s).as_ref().map_or(0, |b| b.len());
        if cap < n.max(1) {
            let want = n.max(1).next_power_of_two();
            let new = self.inner.stream.alloc_zeros::<f32>(want).map_err(drv)?;
            self.inner.account(MemKind::Workspace, (want - cap) * 4);
            if let Some(old) = which(s).replace(new) {
                s.retired.push(old);
            }
        }
        Ok(self.inner.ptr(which(s).as_ref().expect("allocated above")))
    }

    /// `y_k = W_k x` over the active channels, for jobs of one type whose
    /// matrix indices are consecutive; `up`: the input is silu(x) * up.
    fn launch_sparse(&self, jobs: &[Job<'_>], cols: usize, px: u64, up: u64) -> Result<()> {
        let first = jobs.first().ok_or_else(|| bad("an empty sparse launch"))?;
        let ty = first.cm.layout.ty();
        let group = first.cm.layout.group();
        if jobs.len() > 3
            || jobs.iter().enumerate().any(|(k, j)| {
                j.cm.layout.ty() != ty || j.cm.layout.cols() != cols || j.index != first.index + k
            })
        {
            return Err(bad(
                "a sparse launch takes up to three matrices of one type and input",
            ));
        }
        let tiles: Vec<usize> = jobs.iter().map(|j| j.cm.layout.n_tiles()).collect();
        let max_tiles = *tiles.iter().max().expect("non-empty");
        if max_tiles > COUNTERS_PER_SLOT {
            return Err(bad("a matrix with more tiles than the kernel counts"));
        }
        let (n_split, gpb) = split_for(cols, group, tiles.iter().sum(), self.inner.sm_count);
        let prow = jobs
            .iter()
            .map(|j| j.cm.layout.rows())
            .max()
            .expect("non-empty");
        let threads = jobs
            .iter()
            .map(|j| j.cm.layout.tile() / 8)
            .max()
            .expect("non-empty")
            .next_multiple_of(32)
            .clamp(32, 256) as u32;
        let mut s = self.scratch();
        let partials = if n_split > 1 {
            self.grow(&mut s, |s| &mut s.partials, jobs.len() * n_split * prow)?
        } else {
            0
        };
        let counters = self
            .inner
            .ptr(s.counters.as_ref().expect("allocated at start"));
        let stats = self
            .inner
            .ptr(s.stats.as_ref().expect("allocated at start"))
            + 16 * first.index as u64;
        drop(s);
        let slot = |k: usize| jobs.get(k).unwrap_or(first);
        let work = ActMatVec {
            n: jobs.len(),
            data: [0, 1, 2].map(|k| self.inner.ptr(&slot(k).cm.data)),
            thr: [0, 1, 2].map(|k| slot(k).thr),
            y: [0, 1, 2].map(|k| slot(k).y),
            rows: [0, 1, 2].map(|k| slot(k).cm.layout.rows() as i32),
            tile: [0, 1, 2].map(|k| slot(k).cm.layout.tile() as i32),
            cols: cols as i32,
            x: px,
            up,
            gpb: gpb as i32,
            partials,
            prow: prow as i32,
            counters,
            ctr_stride: COUNTERS_PER_SLOT as i32,
            stats,
            bias: [0; 3],
            res: 0,
            norm: None,
        };
        self.inner.push_launch(Launch {
            kernel: self.inner.kernels.index(&format!("act_mv_{}", ty.name()))?,
            grid: (max_tiles as u32, n_split as u32, jobs.len() as u32),
            block: (threads, 1, 1),
            smem: 0,
            work: Work::ActMatVec(work),
        })
    }

    /// Jobs in runs the kernel takes in one launch (same type, consecutive
    /// matrices, at most three), each launched.
    fn launch_runs(&self, jobs: &[Job<'_>], cols: usize, px: u64, up: u64) -> Result<()> {
        let mut i = 0;
        while i < jobs.len() {
            let mut j = i + 1;
            while j < jobs.len()
                && j - i < 3
                && jobs[j].cm.layout.ty() == jobs[i].cm.layout.ty()
                && jobs[j].index == jobs[j - 1].index + 1
            {
                j += 1;
            }
            self.launch_sparse(&jobs[i..j], cols, px, up)?;
            i = j;
        }
        Ok(())
    }

    /// `out = W (x with the channels below `thr` zeroed)`, or `W x` without
    /// thresholds: a prompt batch (the dense kernels, as the CPU path).
    fn dense_or_masked(
        &self,
        w: &CudaMatrix,
        side: &SparseSide,
        x: &CudaActivations,
        out: &mut CudaActivations,
    ) -> Result<()> {
        let Some(thr) = self.thr_ptr(side) else {
            return self.inner.matmul(w, x, out);
        };
        let mut m = std::mem::take(&mut self.scratch().masked);
        let r = (|| -> Result<()> {
            let px = self.inner.act_ptr(x)?;
            // Sized for the widest input, so that it never grows (and moves)
            // inside a step whose launches already point at it.
            let max_cols = *self.max_cols.lock().unwrap_or_else(|e| e.into_inner());
            let pm = self.inner.reshape(&mut m, x.rows, max_cols.max(x.width))?;
            m.width = x.width;
            let n = x.rows * x.width;
            self.inner
                .elementwise("act_mask", n, &[px, thr, pm], Some(x.width as i32))?;
            self.inner.matmul(w, &m, out)
        })();
        self.scratch().masked = m;
        r
    }
}

/// Index of the lm head among the sparsified matrices.
fn head_index(n_layer: usize) -> usize {
    n_layer * Proj::ALL.len()
}

impl Backend for ActivationCudaBackend {
    type Matrix = ActCudaMatrix;
    type Vector = CudaVector;
    type Ffn = ActCudaFfn;
    type Activations = CudaActivations;
    type KvCache = CudaKvCache;

    fn name(&self) -> String {
        "activation-sparse-cuda".into()
    }

    fn step<R>(&self, inputs: &StepInputs<'_>, pass: impl FnOnce() -> Result<R>) -> Result<R> {
        self.inner.step(inputs, pass)
    }

    fn upload_matrix(&self, m: &HostMatrix) -> Result<ActCudaMatrix> {
        let head = head_index(self.n_layer);
        let index = match Proj::parse_tensor(&m.name) {
            Some((l, _)) if l >= self.n_layer => {
                return Err(bad(format!(
                    "{}: layer {l} beyond the artifact's {} layers",
                    m.name, self.n_layer
                )))
            }
            Some((l, p)) => Some(matrix_index(l, p)),
            None if m.name == self.artifact.meta().head_tensor => Some(head),
            None => None,
        };
        Ok(ActCudaMatrix {
            dense: self.inner.upload_matrix(m)?,
            sparse: self.make_side(m, index)?,
        })
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
    ) -> Result<ActCudaFfn> {
        if layer >= self.n_layer {
            return Err(bad(format!(
                "FFN of layer {layer} beyond the artifact's {} layers",
                self.n_layer
            )));
        }
        Ok(ActCudaFfn {
            dense: self.inner.upload_ffn(layer, gate, up, down)?,
            gate: self.make_side(gate, Some(matrix_index(layer, Proj::Gate)))?,
            up: self.make_side(up, Some(matrix_index(layer, Proj::Up)))?,
            down: self.make_side(down, Some(matrix_index(layer, Proj::Down)))?,
        })
    }

    fn new_kv_cache(&self, spec: KvSpec) -> Result<CudaKvCache> {
        self.inner.new_kv_cache(spec)
    }

    fn new_kv_cache_pruned(&self, spec: KvSpec, pruning: Option<KvPruning>) -> Result<CudaKvCache> {
        self.inner.new_kv_cache_pruned(spec, pruning)
    }

    fn kv_set_pruning(&self, cache: &mut CudaKvCache, pruning: Option<KvPruning>) -> Result<()> {
        self.inner.kv_set_pruning(cache, pruning)
    }

    fn kv_truncate(&self, cache: &mut CudaKvCache, seq: usize, pos: usize) {
        self.inner.kv_truncate(cache, seq, pos)
    }

    fn new_activations(&self) -> CudaActivations {
        self.inner.new_activations()
    }

    fn embed(
        &self,
        table: &ActCudaMatrix,
        tokens: &[u32],
        out: &mut CudaActivations,
    ) -> Result<()> {
        self.inner.embed(&table.dense, tokens, out)
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

    fn matmul(
        &self,
        w: &ActCudaMatrix,
        x: &CudaActivations,
        out: &mut CudaActivations,
    ) -> Result<()> {
        if x.width != w.dense.cols {
            return Err(bad(format!(
                "{}: input width {} != {}",
                w.dense.name, x.width, w.dense.cols
            )));
        }
        if x.rows == 1 {
            let px = self.inner.act_ptr(x)?;
            let py = self.inner.reshape(out, 1, w.dense.rows)?;
            if let Some(job) = self.job(&w.sparse, py) {
                return self.launch_sparse(&[job], x.width, px, 0);
            }
        }
        self.dense_or_masked(&w.dense, &w.sparse, x, out)
    }

    fn matmul_many(
        &self,
        ws: &[&ActCudaMatrix],
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
        if ws.iter().all(|w| self.thr_ptr(&w.sparse).is_none()) {
            let dense: Vec<&CudaMatrix> = ws.iter().map(|w| &w.dense).collect();
            return self.inner.matmul_many(&dense, x, outs);
        }
        if x.rows == 1 && ws.iter().all(|w| w.dense.cols == x.width) {
            let px = self.inner.act_ptr(x)?;
            let mut jobs = Vec::new();
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                let py = self.inner.reshape(out, 1, w.dense.rows)?;
                match self.job(&w.sparse, py) {
                    Some(j) => jobs.push(j),
                    None => {
                        self.launch_runs(&jobs, x.width, px, 0)?;
                        jobs.clear();
                        self.dense_or_masked(&w.dense, &w.sparse, x, out)?;
                    }
                }
            }
            return self.launch_runs(&jobs, x.width, px, 0);
        }
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.matmul(w, x, out)?;
        }
        Ok(())
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
        p: &AttentionParams,
        q: &mut CudaActivations,
        k: &mut CudaActivations,
        v: &CudaActivations,
        qk_norm: Option<QkNorm<'_, CudaVector>>,
        slots: &[TokenSlot],
        cache: &mut CudaKvCache,
        out: &mut CudaActivations,
    ) -> Result<()> {
        self.inner
            .attention(layer, p, q, k, v, qk_norm, slots, cache, out)
    }

    fn ffn(&self, f: &ActCudaFfn, x: &CudaActivations, out: &mut CudaActivations) -> Result<()> {
        let (d, n_ff) = (f.dense.gate.cols, f.dense.gate.rows);
        if x.width != d {
            return Err(bad(format!("ffn input width {} != {d}", x.width)));
        }
        let (tg, tu, td) = (
            self.thr_ptr(&f.gate),
            self.thr_ptr(&f.up),
            self.thr_ptr(&f.down),
        );
        if tg.is_none() && tu.is_none() && td.is_none() {
            return self.inner.ffn(&f.dense, x, out);
        }
        let (mut g, mut u, mut h) = {
            let mut s = self.scratch();
            (
                std::mem::take(&mut s.gate),
                std::mem::take(&mut s.up),
                std::mem::take(&mut s.hidden),
            )
        };
        let r = (|| -> Result<()> {
            let n = x.rows;
            let pg = self.inner.reshape(&mut g, n, n_ff)?;
            let pu = self.inner.reshape(&mut u, n, n_ff)?;
            if n == 1 {
                let px = self.inner.act_ptr(x)?;
                let jobs: Vec<Job<'_>> = [self.job(&f.gate, pg), self.job(&f.up, pu)]
                    .into_iter()
                    .flatten()
                    .collect();
                self.launch_runs(&jobs, d, px, 0)?;
                if self.job(&f.gate, pg).is_none() {
                    self.inner.matmul(&f.dense.gate, x, &mut g)?;
                }
                if self.job(&f.up, pu).is_none() {
                    self.inner.matmul(&f.dense.up, x, &mut u)?;
                }
                let po = self.inner.reshape(out, 1, d)?;
                if let Some(job) = self.job(&f.down, po) {
                    // Down scores and multiplies silu(gate) * up itself.
                    return self.launch_sparse(&[job], n_ff, pg, pu);
                }
            } else {
                self.dense_or_masked(&f.dense.gate, &f.gate, x, &mut g)?;
                self.dense_or_masked(&f.dense.up, &f.up, x, &mut u)?;
            }
            let ph = self.inner.reshape(&mut h, n, n_ff)?;
            self.inner
                .elementwise("swiglu", n * n_ff, &[pg, pu, ph], None)?;
            self.dense_or_masked(&f.dense.down, &f.down, &h, out)
        })();
        let mut s = self.scratch();
        s.gate = g;
        s.up = u;
        s.hidden = h;
        r
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
