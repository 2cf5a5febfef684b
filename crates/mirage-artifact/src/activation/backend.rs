//! [`ActivationBackend`]: the runtime's `Backend` with the seven projections
//! of every layer run under activation sparsity. Everything else (embedding,
//! norms, attention, the lm head) is the wrapped [`CpuBackend`]'s.
//!
//! Per product and input row, the active channels are those with
//! `|x_i| >= thr_i` (the matrix's per-channel thresholds; none set: every
//! channel; gate and up read the FFN input, down the SwiGLU output). The
//! lm head counts as one more matrix (its input: the final norm's output).
//! Then:
//! - one row (decode) with the matrix in an activation artifact and
//!   thresholds set: the channel-major integer kernels over the active
//!   channels only, tiles (and, for matrices with few tiles, group ranges)
//!   spread over the pool; the bytes of skipped channels are never touched;
//! - one row without thresholds: the row-major kernels of the source,
//!   which read every channel faster;
//! - otherwise (a prompt batch, or no artifact, as during calibration): the
//!   dense kernels of the source matrix on the input with the inactive
//!   channels zeroed — the same product up to the activation rounding
//!   (exactly it with an exact-f32 inner backend).
//!
//! It also records the (unmasked) inputs of the projections and the head
//! when asked ([`ActivationBackend::start_recording`]): calibration
//! reads them this way, through the same graph that runs it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use mirage_gguf::quant::channel_major::{
    ActiveChannels, ChannelMajorKernel, ChannelMajorLayout, TileKernel,
};
use mirage_runtime::backend::cpu::{CpuActivations, CpuFfn, CpuMatrix};
use mirage_runtime::backend::HostMatrix;
use mirage_runtime::kv_cache::KvCache;
use mirage_runtime::{Backend, CpuBackend, RuntimeError};
use rayon::prelude::*;

use super::format::ActivationArtifact;
use super::{matrix_index, Proj};

type RtResult<T> = mirage_runtime::Result<T>;

/// What [`ActivationBackend::start_recording`] keeps per layer, in
/// [`Slot::ALL`] order: the distinct inputs of the projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// Input of Q, K and V (the attention norm's output).
    AttnIn,
    /// Input of O (the attention output).
    AttnOut,
    /// Input of gate and up (the FFN norm's output).
    FfnIn,
    /// Input of down (the SwiGLU output).
    FfnHidden,
}

impl Slot {
    /// All, in recording order.
    pub const ALL: [Slot; 4] = [Slot::AttnIn, Slot::AttnOut, Slot::FfnIn, Slot::FfnHidden];
    /// The slot holding projection `p`'s input.
    pub fn input_of(p: Proj) -> Slot {
        match p {
            Proj::Q | Proj::K | Proj::V => Slot::AttnIn,
            Proj::O => Slot::AttnOut,
            Proj::Gate | Proj::Up => Slot::FfnIn,
            Proj::Down => Slot::FfnHidden,
        }
    }
    /// Index in recordings: `layer * 4 + slot`.
    pub fn index(self, layer: usize) -> usize {
        layer * Slot::ALL.len() + self as usize
    }
    /// Index in recordings of the lm head's input (after every layer's).
    pub fn head_index(n_layer: usize) -> usize {
        n_layer * Slot::ALL.len()
    }
}

/// Recorded rows per [`Slot::index`] (the head's input last).
pub type Recording = Vec<Vec<f32>>;

/// A projection's channel-major copy in the artifact.
#[derive(Debug, Clone, Copy)]
struct ChannelMajor {
    layout: ChannelMajorLayout,
    offset: usize,
    kernel: TileKernel,
}

/// Which sparsified matrix a weight is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MatrixId {
    /// Projection `p` of layer `l`.
    Proj(usize, Proj),
    /// The lm head.
    Head,
}

/// A weight matrix: the source's dense form (prompt batches, and the
/// matrices activation sparsity does not touch) and, for the projections
/// and the head, its identity and channel-major copy.
#[derive(Debug)]
pub struct ActMatrix {
    dense: CpuMatrix,
    host: HostMatrix,
    id: Option<MatrixId>,
    /// Matrix index (`layer * 7 + proj`; the head after the projections).
    index: Option<usize>,
    cm: Option<ChannelMajor>,
}

impl ActMatrix {
    fn index(&self) -> Option<usize> {
        self.index
    }
}

/// One layer's FFN: the dense op for unmasked batches, and the three
/// projections.
#[derive(Debug)]
pub struct ActFfn {
    layer: usize,
    dense: CpuFfn,
    gate: ActMatrix,
    up: ActMatrix,
    down: ActMatrix,
}

/// Counters of the sparse products since the last [`ActivationBackend::take_stats`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SparseStats {
    /// Per matrix index (`layer * 7 + proj`, then the lm head): (active
    /// channels, input rows).
    pub active: Vec<(u64, u64)>,
    /// Weight bytes the decode kernels read.
    pub kernel_bytes: u64,
    /// Bytes of the source (row-major) matrices those kernels stood in for:
    /// what the dense path would have read for the same products (matrices
    /// without thresholds run the dense path and count in neither).
    pub replaced_bytes: u64,
    /// Input rows the decode kernels ran (decode rows times projections).
    pub kernel_rows: u64,
}

/// One parallel task: outputs of tile `t` of job `j` over groups `g0..g1`,
/// into `parts[slot * MAX_TILE ..]`.
#[derive(Debug, Clone, Copy)]
struct Task {
    j: u16,
    t: u16,
    g0: u32,
    g1: u32,
}

#[derive(Default)]
struct Scratch {
    active: Vec<ActiveChannels>,
    tasks: Vec<Task>,
    parts: Vec<f32>,
    counts: Vec<u32>,
    masked: Vec<f32>,
    gate: CpuActivations,
    up: CpuActivations,
    hidden: Vec<f32>,
}

/// Sparsity settings: per-matrix thresholds.
#[derive(Debug, Default)]
struct Settings {
    thresholds: Vec<Option<Arc<[f32]>>>,
}

/// The activation-sparsity backend. See the module doc.
pub struct ActivationBackend {
    inner: CpuBackend,
    artifact: Option<Arc<ActivationArtifact>>,
    n_layer: usize,
    family: ChannelMajorKernel,
    /// What runs (plan and sparsity), for [`Backend::name`].
    label: Option<String>,
    settings: RwLock<Arc<Settings>>,
    recording_on: AtomicBool,
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

/// Tasks per thread of one parallel product (load balance against the
/// cost of a task).
const TASKS_PER_THREAD: usize = 3;

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
            label: None,
            settings: RwLock::new(Arc::new(Settings {
                thresholds: vec![None; n_layer * Proj::ALL.len() + 1],
            })),
            recording_on: AtomicBool::new(false),
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

    /// Names what runs (e.g. the plan and sparsity) in [`Backend::name`],
    /// which engines print beside their speeds.
    pub fn with_label(mut self, label: impl Into<String>) -> ActivationBackend {
        self.label = Some(label.into());
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

    fn settings(&self) -> Arc<Settings> {
        self.settings
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn update(&self, f: impl FnOnce(&mut Settings)) {
        let mut s = self.settings.write().unwrap_or_else(|e| e.into_inner());
        let mut next = Settings {
            thresholds: s.thresholds.clone(),
        };
        f(&mut next);
        *s = Arc::new(next);
    }

    /// Sets every matrix's per-channel thresholds (`None`: dense), indexed
    /// by [`matrix_index`], the head last; each vector holds the matrix's
    /// input width.
    pub fn set_thresholds(&self, thresholds: Vec<Option<Vec<f32>>>) -> crate::Result<()> {
        if thresholds.len() != self.n_layer * Proj::ALL.len() + 1 {
            return Err(crate::ArtifactError::InvalidArgument(format!(
                "{} threshold entries for {} layers and the head",
                thresholds.len(),
                self.n_layer
            )));
        }
        self.update(|s| s.thresholds = thresholds.into_iter().map(|v| v.map(Into::into)).collect());
        Ok(())
    }

    /// Sets the thresholds of one matrix (`None`: dense).
    pub fn set_matrix_thresholds(&self, layer: usize, proj: Proj, thr: Option<Vec<f32>>) {
        self.update(|s| {
            if let Some(slot) = s.thresholds.get_mut(matrix_index(layer, proj)) {
                *slot = thr.map(Into::into);
            }
        });
    }

    /// Sets the lm head's per-channel thresholds (`None`: dense).
    pub fn set_head_thresholds(&self, thr: Option<Vec<f32>>) {
        let h = super::fit::head_index(self.n_layer);
        self.update(|s| s.thresholds[h] = thr.map(Into::into));
    }

    /// Starts recording every layer's projection inputs and the head's
    /// (cleared).
    pub fn start_recording(&self) {
        *self.recording.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(vec![Vec::new(); Slot::head_index(self.n_layer) + 1]);
        self.recording_on.store(true, Ordering::Release);
    }

    /// Returns the rows recorded per [`Slot::index`] since the last call
    /// (cleared; recording goes on until [`Self::stop_recording`]).
    pub fn take_recording(&self) -> Recording {
        let mut r = self.recording.lock().unwrap_or_else(|e| e.into_inner());
        match r.as_mut() {
            Some(v) => v.iter_mut().map(std::mem::take).collect(),
            None => Vec::new(),
        }
    }

    /// Stops recording.
    pub fn stop_recording(&self) {
        self.recording_on.store(false, Ordering::Release);
        *self.recording.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// The counters since the last call (cleared).
    pub fn take_stats(&self) -> SparseStats {
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::take(&mut *s)
    }

    fn make(&self, m: &HostMatrix, id: Option<MatrixId>) -> RtResult<ActMatrix> {
        let dense = self.inner.upload_matrix(m)?;
        let index = match id {
            Some(MatrixId::Proj(l, _)) if l >= self.n_layer => {
                return Err(invalid(format!(
                    "{}: layer {l} beyond the backend's {} layers",
                    m.name, self.n_layer
                )))
            }
            Some(MatrixId::Proj(l, p)) => Some(matrix_index(l, p)),
            Some(MatrixId::Head) => Some(super::fit::head_index(self.n_layer)),
            None => None,
        };
        let cm = match (id, &self.artifact) {
            (Some(id), Some(a)) => {
                let e = match id {
                    MatrixId::Proj(l, p) => a.matrix(l, p),
                    MatrixId::Head => (a.meta().head_tensor == m.name).then(|| a.head()),
                }
                .ok_or_else(|| invalid(format!("{}: not in the activation artifact", m.name)))?;
                if e.layout.rows() != m.rows || e.layout.cols() != m.cols || e.layout.ty() != m.ty {
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
            _ => None,
        };
        Ok(ActMatrix {
            dense,
            host: m.clone(),
            id,
            index,
            cm,
        })
    }

    fn recording(&self) -> bool {
        self.recording_on.load(Ordering::Acquire)
    }

    fn record(&self, layer: usize, slot: Slot, x: &[f32]) {
        if !self.recording() {
            return;
        }
        if let Some(rec) = self
            .recording
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            if let Some(v) = rec.get_mut(slot.index(layer)) {
                v.extend_from_slice(x);
            }
        }
    }

    /// Records `x` as the input of `w` when `w` is the first matrix
    /// reading that slot (Q for Q/K/V, gate for gate/up; the head).
    fn record_input(&self, w: &ActMatrix, x: &[f32]) {
        match w.id {
            Some(MatrixId::Proj(l, p))
                if matches!(p, Proj::Q | Proj::O | Proj::Gate | Proj::Down) =>
            {
                self.record(l, Slot::input_of(p), x)
            }
            Some(MatrixId::Head) => {
                if !self.recording() {
                    return;
                }
                if let Some(rec) = self
                    .recording
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .as_mut()
                {
                    if let Some(v) = rec.get_mut(Slot::head_index(self.n_layer)) {
                        v.extend_from_slice(x);
                    }
                }
            }
            _ => {}
        }
    }

    fn add_active(
        &self,
        counts: impl Iterator<Item = (usize, u64, u64)>,
        bytes: u64,
        replaced: u64,
        rows: u64,
    ) {
        let mut st = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        if st.active.is_empty() {
            st.active = vec![(0, 0); super::fit::head_index(self.n_layer) + 1];
        }
        for (m, act, n) in counts {
            if let Some(e) = st.active.get_mut(m) {
                e.0 += act;
                e.1 += n;
            }
        }
        st.kernel_bytes += bytes;
        st.replaced_bytes += replaced;
        st.kernel_rows += rows;
    }

    /// `outs[k] = W_k x_k` for one input row per job: by the channel-major
    /// kernels over each job's active channels where the job has
    /// per-channel thresholds (one parallel loop over all such jobs'
    /// tiles), by the row-major kernels of the source where it has none
    /// (they read every channel faster, as in `matmul`).
    fn sparse_products(
        &self,
        jobs: &[(&ActMatrix, &[f32], Option<&[f32]>)],
        outs: &mut [&mut [f32]],
        s: &mut Scratch,
    ) -> RtResult<()> {
        if jobs.iter().any(|(_, _, thr)| thr.is_none()) {
            let (mut sparse, mut sparse_outs) = (Vec::new(), Vec::new());
            for (&(w, x, thr), out) in jobs.iter().zip(outs.iter_mut()) {
                match thr {
                    None => self.dense_row(w, x, out)?,
                    Some(_) => {
                        sparse.push((w, x, thr));
                        sparse_outs.push(&mut **out);
                    }
                }
            }
            if sparse.is_empty() {
                return Ok(());
            }
            return self.sparse_products(&sparse, &mut sparse_outs, s);
        }
        let artifact = self
            .artifact
            .as_ref()
            .ok_or_else(|| invalid("channel-major product without an artifact".into()))?;
        let bytes = artifact.bytes();
        while s.active.len() < jobs.len() {
            s.active.push(ActiveChannels::default());
        }
        let mut kernel_bytes = 0u64;
        let mut cms = Vec::with_capacity(jobs.len());
        for (k, (w, x, thr)) in jobs.iter().enumerate() {
            let cm =
                w.cm.ok_or_else(|| invalid(format!("{}: no channel-major copy", w.host.name)))?;
            if x.len() != cm.layout.cols() || outs[k].len() != cm.layout.rows() {
                return Err(invalid(format!(
                    "{}: input {} / output {} for a {}x{} matrix",
                    w.host.name,
                    x.len(),
                    outs[k].len(),
                    cm.layout.rows(),
                    cm.layout.cols()
                )));
            }
            let group = cm.layout.group();
            if let Some(t) = thr.filter(|t| t.len() != x.len()) {
                return Err(invalid(format!(
                    "{}: {} thresholds for {} input channels",
                    w.host.name,
                    t.len(),
                    x.len()
                )));
            }
            s.active[k].fill_above(x, group, *thr);
            kernel_bytes += cm.layout.bytes_read(&s.active[k]) as u64;
            cms.push(cm);
        }
        self.add_active(
            jobs.iter()
                .zip(&s.active)
                .filter_map(|((w, _, _), a)| w.index().map(|m| (m, a.len() as u64, 1))),
            kernel_bytes,
            jobs.iter()
                .map(|(w, _, _)| {
                    let h = &w.host;
                    (h.rows * h.cols / h.ty.block_size() * h.ty.type_size()) as u64
                })
                .sum(),
            jobs.len() as u64,
        );
        // Tasks: (job, tile, group range), group ranges cut at equal counts
        // of active channels so that the tasks cost about the same.
        let threads = self.inner.threads().max(1);
        let total_tiles: usize = cms.iter().map(|c| c.layout.n_tiles()).sum();
        let split = (TASKS_PER_THREAD * threads).div_ceil(total_tiles.max(1));
        s.tasks.clear();
        for (k, cm) in cms.iter().enumerate() {
            let l = cm.layout;
            let a = &s.active[k];
            let ng = l.n_groups();
            let parts = split.clamp(1, (ng / 4).max(1));
            s.counts.clear();
            let mut acc = 0u32;
            for g in 0..ng {
                acc += a.group_len(g) as u32;
                s.counts.push(acc);
            }
            let total = acc.max(1);
            let mut bounds = vec![0u32];
            for p in 1..parts {
                let want = total as u64 * p as u64 / parts as u64;
                let g = s.counts.partition_point(|&c| (c as u64) <= want) as u32;
                if g > *bounds.last().expect("non-empty") && (g as usize) < ng {
                    bounds.push(g);
                }
            }
            bounds.push(ng as u32);
            for t in 0..l.n_tiles() {
                for w in bounds.windows(2) {
                    s.tasks.push(Task {
                        j: k as u16,
                        t: t as u16,
                        g0: w[0],
                        g1: w[1],
                    });
                }
            }
        }
        const STRIDE: usize = mirage_gguf::quant::channel_major::MAX_TILE;
        s.parts.resize(s.tasks.len() * STRIDE, 0.0);
        let (tasks, active) = (&s.tasks, &s.active);
        let cms = &cms;
        self.inner.run(|| {
            s.parts
                .par_chunks_mut(STRIDE)
                .zip(tasks.par_iter())
                .with_max_len(1)
                .for_each(|(part, task)| {
                    let cm = &cms[task.j as usize];
                    let t = task.t as usize;
                    let r = cm.layout.tile_rows(t);
                    let data = &bytes[cm.offset..cm.offset + cm.layout.bytes()];
                    // SAFETY: the layout was validated against the artifact's
                    // bytes at load; t < n_tiles and g0..g1 within n_groups by
                    // construction; `active[j]` was built with the layout's
                    // group over the matrix's input width (checked above); the
                    // kernel comes from `family.kernel`.
                    unsafe {
                        (cm.kernel)(
                            &cm.layout,
                            data,
                            t,
                            task.g0 as usize..task.g1 as usize,
                            &active[task.j as usize],
                            &mut part[..r],
                        )
                    };
                })
        });
        for o in outs.iter_mut() {
            o.fill(0.0);
        }
        for (part, task) in s.parts.chunks(STRIDE).zip(tasks) {
            let cm = &cms[task.j as usize];
            let t = task.t as usize;
            let r = cm.layout.tile_rows(t);
            let at = t * cm.layout.tile();
            for (y, p) in outs[task.j as usize][at..at + r].iter_mut().zip(part) {
                *y += p;
            }
        }
        Ok(())
    }

    /// `out = W x` for one row through the row-major kernels of the source.
    fn dense_row(&self, w: &ActMatrix, x: &[f32], out: &mut [f32]) -> RtResult<()> {
        let xa = CpuActivations::from_vec(1, x.len(), x.to_vec())?;
        let mut o = CpuActivations::default();
        self.masked_product(w, None, &xa, &mut o)?;
        if o.data().len() != out.len() {
            return Err(invalid(format!(
                "{}: output {} for {} rows",
                w.host.name,
                out.len(),
                o.data().len()
            )));
        }
        out.copy_from_slice(o.data());
        Ok(())
    }

    /// `out = W (x with inactive channels zeroed)` through the dense kernels.
    fn masked_product(
        &self,
        w: &ActMatrix,
        thr: Option<&[f32]>,
        x: &CpuActivations,
        out: &mut CpuActivations,
    ) -> RtResult<()> {
        if x.width() != w.dense.cols() {
            return Err(invalid(format!(
                "{}: input width {} != {}",
                w.host.name,
                x.width(),
                w.dense.cols()
            )));
        }
        let Some(thr) = thr else {
            if let Some(m) = w.index() {
                let n = x.rows() as u64;
                self.add_active(std::iter::once((m, n * x.width() as u64, n)), 0, 0, 0);
            }
            return self.inner.matmul(&w.dense, x, out);
        };
        if thr.len() != x.width() {
            return Err(invalid(format!(
                "{}: {} thresholds for {} input channels",
                w.host.name,
                thr.len(),
                x.width()
            )));
        }
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
        if let Some(m) = w.index() {
            self.add_active(std::iter::once((m, kept, x.rows() as u64)), 0, 0, 0);
        }
        let xm = CpuActivations::from_vec(x.rows(), width, masked)?;
        let r = self.inner.matmul(&w.dense, &xm, out);
        let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        s.masked = xm.data().to_vec();
        r
    }

    fn decodes(&self, ws: &[&ActMatrix], x: &CpuActivations) -> bool {
        x.rows() == 1 && ws.iter().all(|w| w.cm.is_some() && w.id.is_some())
    }

    fn threshold<'a>(&self, st: &'a Settings, w: &ActMatrix) -> Option<&'a [f32]> {
        w.index()
            .and_then(|m| st.thresholds.get(m))
            .and_then(|t| t.as_deref())
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
            match &self.label {
                Some(l) => format!("activation-sparse-cpu ({}; {l})", self.family.name()),
                None => format!("activation-sparse-cpu ({})", self.family.name()),
            }
        } else {
            "activation-masked-cpu".into()
        }
    }
    fn upload_matrix(&self, m: &HostMatrix) -> RtResult<ActMatrix> {
        // The head: `output.weight`, else the tied embedding (which the
        // graph reads through `embed` as a table, and through `matmul` as
        // the head).
        let id = match Proj::parse_tensor(&m.name) {
            Some((l, p)) => Some(MatrixId::Proj(l, p)),
            None if m.name == "output.weight" => Some(MatrixId::Head),
            None if m.name == "token_embd.weight"
                && self
                    .artifact
                    .as_ref()
                    .is_none_or(|a| a.meta().head_tensor == m.name) =>
            {
                Some(MatrixId::Head)
            }
            None => None,
        };
        self.make(m, id)
    }
    fn upload_ffn(
        &self,
        layer: usize,
        gate: &HostMatrix,
        up: &HostMatrix,
        down: &HostMatrix,
    ) -> RtResult<ActFfn> {
        Ok(ActFfn {
            layer,
            dense: self.inner.upload_ffn(layer, gate, up, down)?,
            gate: self.make(gate, Some(MatrixId::Proj(layer, Proj::Gate)))?,
            up: self.make(up, Some(MatrixId::Proj(layer, Proj::Up)))?,
            down: self.make(down, Some(MatrixId::Proj(layer, Proj::Down)))?,
        })
    }
    mirage_runtime::forward_backend_ops!(inner);

    fn embed(&self, table: &ActMatrix, tokens: &[u32], out: &mut CpuActivations) -> RtResult<()> {
        self.inner.embed(&table.dense, tokens, out)
    }
    fn matmul(&self, w: &ActMatrix, x: &CpuActivations, out: &mut CpuActivations) -> RtResult<()> {
        if w.id.is_none() {
            return self.inner.matmul(&w.dense, x, out);
        }
        if x.width() != w.dense.cols() {
            return Err(invalid(format!(
                "{}: input width {} != {}",
                w.host.name,
                x.width(),
                w.dense.cols()
            )));
        }
        self.record_input(w, x.data());
        let st = self.settings();
        let thr = self.threshold(&st, w);
        // A matrix without thresholds reads every channel: the row-major
        // kernels over the source do that faster than the channel-major
        // ones (and round the activations as the dense path does).
        if thr.is_some() && self.decodes(&[w], x) {
            out.reshape(1, w.dense.rows());
            let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
            return self.sparse_products(&[(w, x.row(0), thr)], &mut [out.data_mut()], &mut s);
        }
        self.masked_product(w, thr, x, out)
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
        if ws.iter().any(|w| w.id.is_none()) {
            let dense: Vec<&CpuMatrix> = ws.iter().map(|w| &w.dense).collect();
            return self.inner.matmul_many(&dense, x, outs);
        }
        if let Some(w) = ws.iter().find(|w| w.dense.cols() != x.width()) {
            return Err(invalid(format!(
                "{}: input width {} != {}",
                w.host.name,
                x.width(),
                w.dense.cols()
            )));
        }
        if let Some(w) = ws.first() {
            self.record_input(w, x.data());
        }
        let st = self.settings();
        let any_thr = ws.iter().any(|w| self.threshold(&st, w).is_some());
        if any_thr && self.decodes(ws, x) {
            let jobs: Vec<(&ActMatrix, &[f32], Option<&[f32]>)> = ws
                .iter()
                .map(|w| (*w, x.row(0), self.threshold(&st, w)))
                .collect();
            let mut slices: Vec<&mut [f32]> = outs
                .iter_mut()
                .zip(ws)
                .map(|(o, w)| {
                    o.reshape(1, w.dense.rows());
                    o.data_mut()
                })
                .collect();
            let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
            return self.sparse_products(&jobs, &mut slices, &mut s);
        }
        if !any_thr && !self.recording() {
            let dense: Vec<&CpuMatrix> = ws.iter().map(|w| &w.dense).collect();
            for w in ws {
                if let Some(m) = w.index() {
                    let n = x.rows() as u64;
                    self.add_active(std::iter::once((m, n * x.width() as u64, n)), 0, 0, 0);
                }
            }
            return self.inner.matmul_many(&dense, x, outs);
        }
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.masked_product(w, self.threshold(&st, w), x, out)?;
        }
        Ok(())
    }
    fn ffn(&self, f: &ActFfn, x: &CpuActivations, out: &mut CpuActivations) -> RtResult<()> {
        if x.width() != f.gate.dense.cols() {
            return Err(invalid(format!(
                "ffn input width {} != {}",
                x.width(),
                f.gate.dense.cols()
            )));
        }
        let st = self.settings();
        let (tg, tu, td) = (
            self.threshold(&st, &f.gate),
            self.threshold(&st, &f.up),
            self.threshold(&st, &f.down),
        );
        self.record(f.layer, Slot::FfnIn, x.data());
        let decode = self.decodes(&[&f.gate, &f.up, &f.down], x);
        let n = x.rows();
        let n_ff = f.gate.dense.rows();
        if !self.recording() && tg.is_none() && tu.is_none() && td.is_none() {
            if let Some(m) = f.gate.index() {
                let nn = n as u64;
                self.add_active(
                    [
                        (m, nn * x.width() as u64, nn),
                        (m + 1, nn * x.width() as u64, nn),
                        (m + 2, nn * n_ff as u64, nn),
                    ]
                    .into_iter(),
                    0,
                    0,
                    0,
                );
            }
            return self.inner.ffn(&f.dense, x, out);
        }
        if decode {
            let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
            let s = &mut *guard;
            let (mut g, mut u) = (std::mem::take(&mut s.gate), std::mem::take(&mut s.up));
            g.reshape(1, n_ff);
            u.reshape(1, n_ff);
            let r = self.sparse_products(
                &[(&f.gate, x.row(0), tg), (&f.up, x.row(0), tu)],
                &mut [g.data_mut(), u.data_mut()],
                s,
            );
            let mut h = std::mem::take(&mut s.hidden);
            h.resize(n_ff, 0.0);
            mirage_runtime::ops::swiglu(g.data(), u.data(), &mut h);
            s.gate = g;
            s.up = u;
            r?;
            self.record(f.layer, Slot::FfnHidden, &h);
            out.reshape(1, f.down.dense.rows());
            let r = self.sparse_products(&[(&f.down, &h, td)], &mut [out.data_mut()], s);
            s.hidden = h;
            return r;
        }
        let (mut g, mut u) = (CpuActivations::default(), CpuActivations::default());
        self.masked_product(&f.gate, tg, x, &mut g)?;
        self.masked_product(&f.up, tu, x, &mut u)?;
        let mut h = vec![0f32; n * n_ff];
        mirage_runtime::ops::swiglu(g.data(), u.data(), &mut h);
        self.record(f.layer, Slot::FfnHidden, &h);
        let h = CpuActivations::from_vec(n, n_ff, h)?;
        self.masked_product(&f.down, td, &h, out)
    }
}
