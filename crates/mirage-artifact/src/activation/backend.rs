//! [`ActivationBackend`]: the runtime's `Backend` with the seven projections
//! of every layer run under activation sparsity. Everything else (embedding,
//! norms, attention, the lm head) is the wrapped [`CpuBackend`]'s.
//!
//! Per product and input row, the active channels are those with
//! `|x_i| >= thr_i` (the matrix's per-channel thresholds; none set: every
//! channel). Then:
//! - one row (decode) with the matrix in an activation artifact: the
//!   channel-major tile kernels over the active channels only, tiles (and
//!   for matrices with few tiles, group ranges) spread over the pool; the
//!   bytes of skipped channels are never touched;
//! - otherwise (a prompt batch, or no artifact, as during calibration): the
//!   dense kernels of the source matrix on the input with the inactive
//!   channels zeroed — the same product up to the dense path's activation
//!   rounding.
//!
//! It also records the (unmasked) input of every projection when asked
//! ([`ActivationBackend::start_recording`]): calibration reads its inputs
//! this way, through the same graph that runs it.

use std::sync::{Arc, Mutex, RwLock};

use mirage_gguf::quant::channel_major::{
    self, ActiveChannels, ChannelMajorKernel, ChannelMajorLayout, TileKernel,
};
use mirage_runtime::backend::cpu::{CpuActivations, CpuFfn, CpuMatrix};
use mirage_runtime::backend::{AttentionParams, HostMatrix, QkNorm, TokenSlot};
use mirage_runtime::kv_cache::{KvCache, KvSpec};
use mirage_runtime::{Backend, CpuBackend, RuntimeError};
use rayon::prelude::*;

use super::format::ActivationArtifact;
use super::{matrix_index, Proj};

type RtResult<T> = mirage_runtime::Result<T>;

/// A projection's channel-major copy in the artifact.
#[derive(Debug, Clone, Copy)]
struct ChannelMajor {
    layout: ChannelMajorLayout,
    offset: usize,
    kernel: TileKernel,
}

/// A weight matrix: the source's dense form (prompt batches, and the
/// matrices activation sparsity does not touch) and, for projections, its
/// index and channel-major copy.
#[derive(Debug)]
pub struct ActMatrix {
    dense: CpuMatrix,
    id: Option<usize>,
    cm: Option<ChannelMajor>,
}

/// One layer's FFN: the dense op for unmasked batches, and the three
/// projections.
#[derive(Debug)]
pub struct ActFfn {
    dense: CpuFfn,
    gate: ActMatrix,
    up: ActMatrix,
    down: ActMatrix,
}

/// Counters of the sparse products since the last [`ActivationBackend::take_stats`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SparseStats {
    /// Per matrix index (`layer * 7 + proj`): (active channels, input rows).
    pub active: Vec<(u64, u64)>,
    /// Weight bytes the channel-major kernels read.
    pub kernel_bytes: u64,
    /// Rows the kernels ran (decode rows times projections).
    pub kernel_rows: u64,
}

#[derive(Default)]
struct Scratch {
    active: Vec<ActiveChannels>,
    parts: Vec<f32>,
    masked: Vec<f32>,
}

/// Inputs recorded per matrix index: rows of the matrix's input width.
pub type Recording = Vec<Vec<f32>>;

/// The activation-sparsity backend. See the module doc.
pub struct ActivationBackend {
    inner: CpuBackend,
    artifact: Option<Arc<ActivationArtifact>>,
    n_layer: usize,
    family: ChannelMajorKernel,
    thresholds: RwLock<Vec<Option<Arc<Vec<f32>>>>>,
    recording: Mutex<Option<Recording>>,
    scratch: Mutex<Scratch>,
    stats: Mutex<SparseStats>,
}

impl std::fmt::Debug for ActivationBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ActivationBackend {{ artifact: {}, kernels: {} }}",
            self.artifact.is_some(),
            self.family.name()
        )
    }
}

fn invalid(msg: String) -> RuntimeError {
    RuntimeError::InvalidArgument(msg)
}

impl ActivationBackend {
    /// A backend for a model of `n_layer` layers: decode rows run the
    /// channel-major kernels of `artifact` (when given), everything else
    /// `inner`'s dense kernels. No thresholds: every channel is active.
    pub fn new(
        inner: CpuBackend,
        artifact: Option<Arc<ActivationArtifact>>,
        n_layer: usize,
    ) -> ActivationBackend {
        ActivationBackend {
            inner,
            artifact,
            n_layer,
            family: ChannelMajorKernel::best(),
            thresholds: RwLock::new(vec![None; n_layer * Proj::ALL.len()]),
            recording: Mutex::new(None),
            scratch: Mutex::new(Scratch::default()),
            stats: Mutex::new(SparseStats::default()),
        }
    }

    /// Uses this kernel family (tests and benchmarks; the default is the
    /// fastest the CPU runs). Applies to matrices uploaded afterwards.
    pub fn with_kernels(mut self, family: ChannelMajorKernel) -> ActivationBackend {
        self.family = family;
        self
    }

    /// The wrapped CPU backend.
    pub fn inner(&self) -> &CpuBackend {
        &self.inner
    }

    /// The artifact whose channel-major matrices decode rows read.
    pub fn artifact(&self) -> Option<&Arc<ActivationArtifact>> {
        self.artifact.as_ref()
    }

    /// Sets every matrix's per-channel thresholds (`None`: dense), indexed
    /// by [`matrix_index`]; each vector holds the matrix's input width.
    pub fn set_thresholds(&self, thresholds: Vec<Option<Vec<f32>>>) -> crate::Result<()> {
        if thresholds.len() != self.n_layer * Proj::ALL.len() {
            return Err(crate::ArtifactError::InvalidArgument(format!(
                "{} threshold entries for {} layers",
                thresholds.len(),
                self.n_layer
            )));
        }
        let mut t = self.thresholds.write().unwrap_or_else(|e| e.into_inner());
        *t = thresholds.into_iter().map(|v| v.map(Arc::new)).collect();
        Ok(())
    }

    /// Sets the thresholds of one matrix (`None`: dense).
    pub fn set_matrix_thresholds(&self, layer: usize, proj: Proj, thr: Option<Vec<f32>>) {
        let mut t = self.thresholds.write().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = t.get_mut(matrix_index(layer, proj)) {
            *slot = thr.map(Arc::new);
        }
    }

    /// Starts recording every projection's input rows (cleared).
    pub fn start_recording(&self) {
        *self.recording.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(vec![Vec::new(); self.n_layer * Proj::ALL.len()]);
    }

    /// Stops recording and returns the rows recorded per matrix index.
    pub fn take_recording(&self) -> Recording {
        self.recording
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_default()
    }

    /// The counters since the last call (cleared).
    pub fn take_stats(&self) -> SparseStats {
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::take(&mut *s)
    }

    fn make(&self, m: &HostMatrix, id: Option<(usize, Proj)>) -> RtResult<ActMatrix> {
        let dense = self.inner.upload_matrix(m)?;
        let (id, cm) = match id {
            None => (None, None),
            Some((l, p)) => {
                let idx = matrix_index(l, p);
                if l >= self.n_layer {
                    return Err(invalid(format!(
                        "{}: layer {l} beyond the backend's {} layers",
                        m.name, self.n_layer
                    )));
                }
                let cm = match &self.artifact {
                    None => None,
                    Some(a) => {
                        let e = a.matrix(l, p).ok_or_else(|| {
                            invalid(format!("{}: not in the activation artifact", m.name))
                        })?;
                        if e.layout.rows() != m.rows
                            || e.layout.cols() != m.cols
                            || e.layout.ty() != m.ty
                        {
                            return Err(invalid(format!(
                                "{}: the artifact holds a {}x{} {} matrix, the model a {}x{} {}",
                                m.name,
                                e.layout.rows(),
                                e.layout.cols(),
                                e.layout.ty(),
                                m.rows,
                                m.cols,
                                m.ty
                            )));
                        }
                        let kernel = self.family.kernel(m.ty).ok_or_else(|| {
                            invalid(format!(
                                "{}: no {} channel-major kernel for {}",
                                m.name,
                                self.family.name(),
                                m.ty
                            ))
                        })?;
                        Some(ChannelMajor {
                            layout: e.layout,
                            offset: e.offset,
                            kernel,
                        })
                    }
                };
                (Some(idx), cm)
            }
        };
        Ok(ActMatrix { dense, id, cm })
    }

    fn threshold_of(&self, w: &ActMatrix) -> Option<Arc<Vec<f32>>> {
        let t = self.thresholds.read().unwrap_or_else(|e| e.into_inner());
        w.id.and_then(|i| t.get(i).cloned().flatten())
    }

    fn recording_on(&self) -> bool {
        self.recording
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    fn record(&self, w: &ActMatrix, x: &[f32]) {
        if let Some(id) = w.id {
            if let Some(rec) = self
                .recording
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_mut()
            {
                rec[id].extend_from_slice(x);
            }
        }
    }

    /// Whether `w` needs this backend's own path (else the inner dense op).
    fn touched(&self, w: &ActMatrix, rows: usize) -> bool {
        w.id.is_some()
            && ((rows == 1 && w.cm.is_some())
                || self.recording_on()
                || self.threshold_of(w).is_some())
    }

    /// `outs[m] = W_m x_m` for one input row per job, by the channel-major
    /// kernels over each job's active channels; one parallel loop over all
    /// jobs' tiles.
    fn sparse_products(
        &self,
        jobs: &[(&ActMatrix, &[f32])],
        outs: &mut [Vec<f32>],
    ) -> RtResult<()> {
        let artifact = self
            .artifact
            .as_ref()
            .ok_or_else(|| invalid("channel-major product without an artifact".into()))?;
        let bytes = artifact.bytes();
        let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let s = &mut *s;
        while s.active.len() < jobs.len() {
            s.active.push(ActiveChannels::default());
        }
        let mut kernel_bytes = 0u64;
        let mut counts = Vec::with_capacity(jobs.len());
        for (j, (w, x)) in jobs.iter().enumerate() {
            let cm =
                w.cm.as_ref()
                    .ok_or_else(|| invalid("no channel-major copy".into()))?;
            let group = cm.layout.group();
            match self.threshold_of(w) {
                Some(thr) => s.active[j].fill(x, group, |i, v| v.abs() >= thr[i]),
                None => s.active[j].fill(x, group, |_, _| true),
            }
            kernel_bytes += cm.layout.bytes_read(&s.active[j]) as u64;
            counts.push(s.active[j].len() as u64);
        }
        // Tasks: (job, tile, group range). Matrices with few tiles are split
        // along their groups so that every thread gets work.
        let threads = self.inner.threads().max(1);
        let total_tiles: usize = jobs
            .iter()
            .map(|(w, _)| w.cm.map_or(0, |c| c.layout.n_tiles()))
            .sum();
        let mut tasks: Vec<(usize, usize, usize, usize)> = Vec::new();
        for (j, (w, _)) in jobs.iter().enumerate() {
            let l = w.cm.expect("checked above").layout;
            let want = (4 * threads).div_ceil(total_tiles.max(1));
            let split = want.clamp(1, (l.n_groups() / 8).max(1));
            for t in 0..l.n_tiles() {
                for k in 0..split {
                    let g0 = l.n_groups() * k / split;
                    let g1 = l.n_groups() * (k + 1) / split;
                    tasks.push((j, t, g0, g1));
                }
            }
        }
        const STRIDE: usize = channel_major::MAX_TILE;
        s.parts.resize(tasks.len() * STRIDE, 0.0);
        let active = &s.active;
        s.parts
            .par_chunks_mut(STRIDE)
            .zip(tasks.par_iter())
            .for_each(|(part, &(j, t, g0, g1))| {
                let cm = jobs[j].0.cm.expect("checked above");
                let tile = cm.layout.tile();
                let data = &bytes[cm.offset..cm.offset + cm.layout.bytes()];
                // SAFETY: the layout was validated against the artifact's
                // bytes at load; t < n_tiles and g0..g1 within n_groups by
                // construction; `active[j]` was built with the layout's group
                // over the matrix's input width (checked below by the caller's
                // width check); the kernel comes from `family.kernel`.
                unsafe { (cm.kernel)(&cm.layout, data, t, g0..g1, &active[j], &mut part[..tile]) };
            });
        for (o, (w, _)) in outs.iter_mut().zip(jobs) {
            o.clear();
            o.resize(w.cm.expect("checked above").layout.rows(), 0.0);
        }
        for (part, &(j, t, _, _)) in s.parts.chunks(STRIDE).zip(&tasks) {
            let tile = jobs[j].0.cm.expect("checked above").layout.tile();
            for (y, p) in outs[j][t * tile..(t + 1) * tile].iter_mut().zip(part) {
                *y += p;
            }
        }
        let mut st = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        if st.active.is_empty() {
            st.active = vec![(0, 0); self.n_layer * Proj::ALL.len()];
        }
        for ((w, _), c) in jobs.iter().zip(counts) {
            if let Some(e) = w.id.and_then(|i| st.active.get_mut(i)) {
                e.0 += c;
                e.1 += 1;
            }
        }
        st.kernel_bytes += kernel_bytes;
        st.kernel_rows += jobs.len() as u64;
        Ok(())
    }

    /// `out = W (x with inactive channels zeroed)` through the dense kernels.
    fn masked_product(
        &self,
        w: &ActMatrix,
        x: &CpuActivations,
        out: &mut CpuActivations,
    ) -> RtResult<()> {
        if x.width() != w.dense.cols() {
            return Err(invalid(format!(
                "input width {} != {}",
                x.width(),
                w.dense.cols()
            )));
        }
        self.record(w, x.data());
        let Some(thr) = self.threshold_of(w) else {
            return self.inner.matmul(&w.dense, x, out);
        };
        let mut masked = {
            let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
            std::mem::take(&mut s.masked)
        };
        masked.clear();
        masked.extend_from_slice(x.data());
        let width = x.width();
        let mut kept = 0u64;
        for row in masked.chunks_mut(width) {
            for (v, t) in row.iter_mut().zip(thr.iter()) {
                if v.abs() < *t {
                    *v = 0.0;
                } else {
                    kept += 1;
                }
            }
        }
        {
            let mut st = self.stats.lock().unwrap_or_else(|e| e.into_inner());
            if st.active.is_empty() {
                st.active = vec![(0, 0); self.n_layer * Proj::ALL.len()];
            }
            if let Some(e) = w.id.and_then(|i| st.active.get_mut(i)) {
                e.0 += kept;
                e.1 += x.rows() as u64;
            }
        }
        let xm = CpuActivations::from_vec(x.rows(), width, masked)?;
        let r = self.inner.matmul(&w.dense, &xm, out);
        let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        s.masked = xm.data().to_vec();
        r
    }

    fn one_row_sparse(&self, ws: &[&ActMatrix], x: &CpuActivations) -> bool {
        x.rows() == 1 && ws.iter().all(|w| w.cm.is_some() && w.id.is_some())
    }
}

impl Backend for ActivationBackend {
    type Matrix = ActMatrix;
    type Vector = Vec<f32>;
    type Ffn = ActFfn;
    type Activations = CpuActivations;
    type KvCache = KvCache;

    fn name(&self) -> String {
        if self.artifact.is_some() {
            format!("activation-sparse-cpu ({})", self.family.name())
        } else {
            "activation-masked-cpu".into()
        }
    }
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.inner.run(f)
    }
    fn upload_matrix(&self, m: &HostMatrix) -> RtResult<ActMatrix> {
        self.make(m, Proj::parse_tensor(&m.name))
    }
    fn upload_vector(&self, v: &[f32]) -> RtResult<Vec<f32>> {
        self.inner.upload_vector(v)
    }
    fn upload_ffn(
        &self,
        layer: usize,
        gate: &HostMatrix,
        up: &HostMatrix,
        down: &HostMatrix,
    ) -> RtResult<ActFfn> {
        Ok(ActFfn {
            dense: self.inner.upload_ffn(layer, gate, up, down)?,
            gate: self.make(gate, Some((layer, Proj::Gate)))?,
            up: self.make(up, Some((layer, Proj::Up)))?,
            down: self.make(down, Some((layer, Proj::Down)))?,
        })
    }
    fn new_kv_cache(&self, spec: KvSpec) -> RtResult<KvCache> {
        self.inner.new_kv_cache(spec)
    }
    fn new_kv_cache_pruned(
        &self,
        spec: KvSpec,
        pruning: Option<mirage_runtime::KvPruning>,
    ) -> RtResult<KvCache> {
        self.inner.new_kv_cache_pruned(spec, pruning)
    }
    fn kv_set_pruning(
        &self,
        cache: &mut KvCache,
        pruning: Option<mirage_runtime::KvPruning>,
    ) -> RtResult<()> {
        self.inner.kv_set_pruning(cache, pruning)
    }
    fn kv_truncate(&self, cache: &mut KvCache, seq: usize, pos: usize) {
        self.inner.kv_truncate(cache, seq, pos)
    }
    fn new_activations(&self) -> CpuActivations {
        self.inner.new_activations()
    }
    fn embed(&self, table: &ActMatrix, tokens: &[u32], out: &mut CpuActivations) -> RtResult<()> {
        self.inner.embed(&table.dense, tokens, out)
    }
    fn rms_norm(
        &self,
        x: &CpuActivations,
        weight: &Vec<f32>,
        eps: f32,
        out: &mut CpuActivations,
    ) -> RtResult<()> {
        self.inner.rms_norm(x, weight, eps, out)
    }
    fn matmul(&self, w: &ActMatrix, x: &CpuActivations, out: &mut CpuActivations) -> RtResult<()> {
        if !self.touched(w, x.rows()) {
            return self.inner.matmul(&w.dense, x, out);
        }
        if self.one_row_sparse(&[w], x) {
            if x.width() != w.dense.cols() {
                return Err(invalid(format!(
                    "input width {} != {}",
                    x.width(),
                    w.dense.cols()
                )));
            }
            self.record(w, x.data());
            let mut o = vec![Vec::new()];
            self.sparse_products(&[(w, x.row(0))], &mut o)?;
            let rows = o[0].len();
            *out = CpuActivations::from_vec(1, rows, o.pop().unwrap_or_default())?;
            return Ok(());
        }
        self.masked_product(w, x, out)
    }
    fn matmul_many(
        &self,
        ws: &[&ActMatrix],
        x: &CpuActivations,
        outs: &mut [&mut CpuActivations],
    ) -> RtResult<()> {
        if ws.len() != outs.len() {
            return Err(invalid("matmul_many: one output per matrix".into()));
        }
        if !ws.iter().any(|w| self.touched(w, x.rows())) {
            let dense: Vec<&CpuMatrix> = ws.iter().map(|w| &w.dense).collect();
            return self.inner.matmul_many(&dense, x, outs);
        }
        if self.one_row_sparse(ws, x) {
            if let Some(w) = ws.iter().find(|w| w.dense.cols() != x.width()) {
                return Err(invalid(format!(
                    "input width {} != {}",
                    x.width(),
                    w.dense.cols()
                )));
            }
            for w in ws {
                self.record(w, x.data());
            }
            let jobs: Vec<(&ActMatrix, &[f32])> = ws.iter().map(|w| (*w, x.row(0))).collect();
            let mut o = vec![Vec::new(); ws.len()];
            self.sparse_products(&jobs, &mut o)?;
            for (out, v) in outs.iter_mut().zip(o) {
                let rows = v.len();
                **out = CpuActivations::from_vec(1, rows, v)?;
            }
            return Ok(());
        }
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.masked_product(w, x, out)?;
        }
        Ok(())
    }
    fn add_bias(&self, x: &mut CpuActivations, bias: &Vec<f32>) -> RtResult<()> {
        self.inner.add_bias(x, bias)
    }
    fn add(&self, acc: &mut CpuActivations, x: &CpuActivations) -> RtResult<()> {
        self.inner.add(acc, x)
    }
    fn attention(
        &self,
        layer: usize,
        params: &AttentionParams,
        q: &mut CpuActivations,
        k: &mut CpuActivations,
        v: &CpuActivations,
        qk_norm: Option<QkNorm<'_, Vec<f32>>>,
        slots: &[TokenSlot],
        cache: &mut KvCache,
        out: &mut CpuActivations,
    ) -> RtResult<()> {
        self.inner
            .attention(layer, params, q, k, v, qk_norm, slots, cache, out)
    }
    fn ffn(&self, f: &ActFfn, x: &CpuActivations, out: &mut CpuActivations) -> RtResult<()> {
        let n = x.rows();
        let any = [&f.gate, &f.up, &f.down].iter().any(|w| self.touched(w, n));
        if !any {
            return self.inner.ffn(&f.dense, x, out);
        }
        if x.width() != f.gate.dense.cols() {
            return Err(invalid(format!(
                "ffn input width {} != {}",
                x.width(),
                f.gate.dense.cols()
            )));
        }
        let n_ff = f.gate.dense.rows();
        let mut h = vec![0f32; n * n_ff];
        if self.one_row_sparse(&[&f.gate, &f.up, &f.down], x) {
            self.record(&f.gate, x.data());
            self.record(&f.up, x.data());
            let mut gu = vec![Vec::new(), Vec::new()];
            self.sparse_products(&[(&f.gate, x.row(0)), (&f.up, x.row(0))], &mut gu)?;
            mirage_runtime::ops::swiglu(&gu[0], &gu[1], &mut h);
            self.record(&f.down, &h);
            let mut d = vec![Vec::new()];
            self.sparse_products(&[(&f.down, &h)], &mut d)?;
            let rows = d[0].len();
            *out = CpuActivations::from_vec(1, rows, d.pop().unwrap_or_default())?;
            return Ok(());
        }
        let (mut g, mut u) = (CpuActivations::default(), CpuActivations::default());
        self.masked_product(&f.gate, x, &mut g)?;
        self.masked_product(&f.up, x, &mut u)?;
        mirage_runtime::ops::swiglu(g.data(), u.data(), &mut h);
        let h = CpuActivations::from_vec(n, n_ff, h)?;
        self.masked_product(&f.down, &h, out)
    }
    fn select_rows(
        &self,
        x: &CpuActivations,
        rows: &[usize],
        out: &mut CpuActivations,
    ) -> RtResult<()> {
        self.inner.select_rows(x, rows, out)
    }
    fn read(&self, x: &CpuActivations, out: &mut Vec<f32>) -> RtResult<(usize, usize)> {
        self.inner.read(x, out)
    }
}
