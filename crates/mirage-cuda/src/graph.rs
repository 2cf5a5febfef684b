//! The launch recorder and graph replay of [`CudaBackend`]: a forward pass
//! of at most [`GRAPH_MAX_ROWS`] rows run through `Backend::step` (a decode
//! step) is recorded (every launch with its arguments, nothing launched),
//! fused (`fusion`), and compared with the passes captured before: the same
//! launches replay that CUDA graph, new ones are captured into a new graph.
//! Per-token inputs (token ids, (seq, pos) slots, logits rows) are copied
//! once per step into a fixed device buffer that the kernels read, and the
//! attention grid depends on the cache size only, so a decode step at any
//! position is the same graph. Larger passes (prefill) launch op by op.

use std::sync::MutexGuard;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice};
use mirage_runtime::backend::{StepInputs, TokenSlot};
use mirage_runtime::Result;

use crate::backend::{bad, drv, CudaBackend, MemKind};
use crate::fusion::{fold_epilogue, fold_norm, PendingNorm};
use crate::launch::{launch_ex, Launch};
use crate::{op_class, GraphStats, OpClass, StepProfile};

/// Batches of at most this many rows are recorded and replayed as a CUDA
/// graph (decode steps); larger ones (prefill) launch op by op.
pub(crate) const GRAPH_MAX_ROWS: usize = 16;

/// Recorded graphs kept (e.g. decode at two batch sizes, or two sessions,
/// each at a short context and past it: the decode attention's short form
/// is another launch sequence).
const GRAPH_CACHE: usize = 8;

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
pub(crate) struct Staged {
    pub tokens: Vec<u32>,
    pub slots: Vec<TokenSlot>,
    pub rows: Vec<usize>,
    pub base: u64,
}

#[derive(Default)]
pub(crate) struct StepState {
    pub staged: Option<Staged>,
    /// Launches of the step in progress when it is being recorded.
    pub recording: Option<Vec<Launch>>,
    host: Vec<i32>,
    inputs_dev: Option<CudaSlice<i32>>,
    /// Most recently used first.
    graphs: Vec<RecordedGraph>,
    pub stats: GraphStats,
    /// An RMSNorm of the step being recorded that was not launched: the
    /// next launch takes it in when it can (`fusion::fold_norm`), else it is
    /// launched first.
    pub pending_norm: Option<PendingNorm>,
    /// The next recorded step is launched op by op with events
    /// (`profile_next_step`), its times kept in `profile`.
    profile_next: bool,
    profile: Option<StepProfile>,
}

impl CudaBackend {
    pub(crate) fn step_state(&self) -> MutexGuard<'_, StepState> {
        self.step_state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a step is being recorded.
    pub(crate) fn recording(&self) -> bool {
        self.step_state().recording.is_some()
    }

    /// Runs `l`, or appends it to the step being recorded (folding a
    /// pending norm into it where it can).
    pub(crate) fn push_launch(&self, mut l: Launch) -> Result<()> {
        let mut st = self.step_state();
        let st = &mut *st;
        if let Some(rec) = st.recording.as_mut() {
            if let Some(pn) = st.pending_norm.take() {
                if !fold_norm(&pn, &mut l) {
                    rec.push(pn.launch(self.kernels.index("rms_norm")?));
                }
            }
            rec.push(l);
            return Ok(());
        }
        self.launch_now(&l)
    }

    /// Records `pn` as the step's pending norm (launching a previous one
    /// that nothing took); `false` when no step is being recorded.
    pub(crate) fn defer_norm(&self, pn: PendingNorm) -> Result<bool> {
        let mut st = self.step_state();
        let st = &mut *st;
        let Some(rec) = st.recording.as_mut() else {
            return Ok(false);
        };
        if let Some(prev) = st.pending_norm.replace(pn) {
            rec.push(prev.launch(self.kernels.index("rms_norm")?));
        }
        Ok(true)
    }

    /// Folds `extra += target` (`res`) or a bias into the recorded launch
    /// that wrote `target` (`fusion::fold_epilogue`); `false` outside a
    /// recorded step or where it cannot.
    pub(crate) fn fold_into_producer(
        &self,
        target: u64,
        n_rows: usize,
        extra: u64,
        res: bool,
    ) -> bool {
        let mut st = self.step_state();
        let st = &mut *st;
        let pending = st.pending_norm;
        match st.recording.as_mut() {
            Some(rec) => fold_epilogue(rec, pending.as_ref(), target, n_rows, extra, res),
            None => false,
        }
    }

    /// Launches `l` now, with programmatic stream serialization when its
    /// kernel waits on its prerequisite grid and the device has PDL.
    pub(crate) fn launch_now(&self, l: &Launch) -> Result<()> {
        let programmatic = self.kernels.waits[l.kernel] && self.pdl;
        let args = l.work.args();
        crate::launch::check_args(&self.kernels.params[l.kernel], &args)
            .map_err(|e| bad(format!("kernel {}: {e}", self.kernels.names[l.kernel])))?;
        // SAFETY: every call site builds the kernel's argument list (typed
        // launches write it in the kernel's order) over device buffers of
        // this backend, after checking the shapes; the function belongs to
        // this context and the stream to it too.
        unsafe {
            launch_ex(
                &self.kernels.functions[l.kernel],
                &self.stream,
                l.grid,
                l.block,
                l.smem,
                &args,
                programmatic,
            )
        }
        .map_err(drv)
    }

    /// The step's inputs to the device, then `pass` recorded (and replayed
    /// or captured) or run op by op: `Backend::step`.
    pub(crate) fn run_step<R>(
        &self,
        inputs: &StepInputs<'_>,
        pass: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
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
            if (self.graphs() || st.profile_next) && n <= GRAPH_MAX_ROWS {
                let hint = st.graphs.first().map_or(0, |g| g.launches.len());
                st.recording = Some(Vec::with_capacity(hint));
            } else {
                st.stats.eager += 1;
            }
        }
        let out = pass();
        let mut st = self.step_state();
        st.staged = None;
        if let Some(pn) = st.pending_norm.take() {
            let k = self.kernels.index("rms_norm")?;
            if let Some(rec) = st.recording.as_mut() {
                rec.push(pn.launch(k));
            }
        }
        let launches = st.recording.take();
        let out = out?;
        if let Some(launches) = launches {
            self.run_recorded(&mut st, launches)?;
        }
        Ok(out)
    }

    /// The device address of a staged step input, chosen by `check` from
    /// the step in progress (`None` when its inputs are not the op's).
    pub(crate) fn staged(&self, check: impl FnOnce(&Staged) -> Option<u64>) -> Result<Option<u64>> {
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

    /// Replays the graph recorded with exactly `launches`, or captures one
    /// (or, for a profiled step, launches them one by one between events).
    fn run_recorded(&self, st: &mut StepState, launches: Vec<Launch>) -> Result<()> {
        if std::mem::take(&mut st.profile_next) {
            st.profile = Some(self.profile_launches(&launches)?);
            st.stats.eager += 1;
            return Ok(());
        }
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

    /// The launches of one step, each between two events on the stream:
    /// their device times summed by op class (waits for the device).
    fn profile_launches(&self, launches: &[Launch]) -> Result<StepProfile> {
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let events = (0..=launches.len())
            .map(|_| self.ctx.new_event(flags).map_err(drv))
            .collect::<Result<Vec<_>>>()?;
        events[0].record(&self.stream).map_err(drv)?;
        for (l, e) in launches.iter().zip(&events[1..]) {
            self.launch_now(l)?;
            e.record(&self.stream).map_err(drv)?;
        }
        events[launches.len()].synchronize().map_err(drv)?;
        let mut p = StepProfile {
            launches: launches.len(),
            ..StepProfile::default()
        };
        for (l, w) in launches.iter().zip(events.windows(2)) {
            let us = w[0].elapsed_ms(&w[1]).map_err(drv)? as f64 * 1e3;
            match op_class(&self.kernels.names[l.kernel]) {
                OpClass::MatVec => p.matvec_us += us,
                OpClass::Attention => p.attention_us += us,
                OpClass::Other => p.other_us += us,
            }
        }
        Ok(p)
    }

    /// Profiles the next decode step (a forward pass of at most
    /// [`GRAPH_MAX_ROWS`] rows): its launches, fused as a recorded step's
    /// are, run one by one between events instead of as a graph (the same
    /// results); [`CudaBackend::take_step_profile`] then returns the times.
    pub fn profile_next_step(&self) {
        self.step_state().profile_next = true;
    }

    /// The times of the step profiled since the last call, if one ran.
    pub fn take_step_profile(&self) -> Option<StepProfile> {
        self.step_state().profile.take()
    }

    /// How steps ran so far (captured, replayed, op by op).
    pub fn graph_stats(&self) -> GraphStats {
        self.step_state().stats
    }

    /// Kernel launches of the most recently replayed or captured decode
    /// graph (0 when none): what the fusions save shows here.
    pub fn last_graph_launches(&self) -> usize {
        self.step_state()
            .graphs
            .first()
            .map_or(0, |g| g.launches.len())
    }
}
