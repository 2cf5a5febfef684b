//! The persistent decode path: a recorded decode step (the launches the
//! graph path would capture, its fusions applied) run as ONE launch of
//! `decode_persistent` (cuda/persistent.cu). Every block of every launch
//! becomes a task; the schedule (`schedule`) orders them by counters in
//! device memory; each task runs the body of its kernel (the same device
//! function the kernel's thin wrapper calls, cuda/task_prelude.cu says how
//! it is redirected), so the numbers are the graph path's.
//!
//! Chosen at load with [`crate::DecodeMode`]. A step with a launch whose
//! kernel has no task kind here (a sparse FFN, the pruned attention, f32 KV,
//! NVFP4 weights, ggml-layout mat-vecs of the types no layout repacks, a
//! separate SwiGLU) runs as a graph instead, counted in
//! `GraphStats::captures`/`replays`, not `persistent`.
//!
//! Hangs cannot hang the caller: every wait on the device gives up after
//! [`DEVICE_TIMEOUT_NS`] (the launch then ends, with the failing task in its
//! status words), and the host waits for the step at most
//! [`HOST_TIMEOUT`]; either gives [`CudaError::PersistentStall`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice};
use mirage_runtime::Result;

use crate::backend::{drv, CudaBackend};
use crate::launch::{Arg, Launch, Work};
use crate::schedule::{simulate, Access, Range, Schedule, StageSpec};
use crate::{module, CudaError};

/// Threads of a persistent block (`TASK_THREADS`): no task may be wider.
pub(crate) const TASK_THREADS: u32 = 256;

/// Argument slots of a stage (`TASK_ARGS`).
const TASK_ARGS: usize = 24;

/// Bytes of a `TaskStage`: six u32 then the slots.
const STAGE_BYTES: usize = 24 + 8 * TASK_ARGS;

/// A task gives up waiting after this long (a decode step takes
/// milliseconds; a lost dependency would otherwise spin forever).
pub(crate) const DEVICE_TIMEOUT_NS: u64 = 2_000_000_000;

/// The host gives up on a step after this long.
pub(crate) const HOST_TIMEOUT: Duration = Duration::from_secs(10);

/// Persistent steps kept (as graphs are: two batch sizes, two sessions).
const PLAN_CACHE: usize = 4;

/// Task kinds (`TK_*` in cuda/persistent.cu; a test checks the numbers).
pub(crate) const TASK_KINDS: [(&str, u32); 23] = [
    ("TK_MV3_Q8S", 1),
    ("TK_MV3_Q8S_GRID", 2),
    ("TK_MV3_Q4KS", 3),
    ("TK_MV3_Q5S", 4),
    ("TK_MV3_Q6KS", 5),
    ("TK_FFN_Q8S", 6),
    ("TK_FFN_Q4KS", 7),
    ("TK_FFN_Q5S", 8),
    ("TK_FFN_Q6KS", 9),
    ("TK_EMBED_Q8S", 10),
    ("TK_EMBED_Q4KS", 11),
    ("TK_EMBED_Q5S", 12),
    ("TK_EMBED_Q6KS", 13),
    ("TK_EMBED_GGML", 14),
    ("TK_RMS_NORM", 15),
    ("TK_ARGMAX", 16),
    ("TK_ATTEND_SPLIT_F16", 17),
    ("TK_ATTEND_SPLIT_ROPE_F16", 18),
    ("TK_ATTEND_COMBINE", 19),
    ("TK_ROPE_STORE_F16", 20),
    ("TK_GATHER_ROWS", 21),
    ("TK_ADD_INPLACE", 22),
    ("TK_ADD_BIAS", 23),
];

fn kind(name: &str) -> u32 {
    TASK_KINDS
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(0, |&(_, k)| k)
}

/// The ggml type id of a ggml-layout kernel suffix (`GGML_TYPES`).
fn ggml_id(suffix: &str) -> Option<u32> {
    crate::weights::GGML_TYPES
        .iter()
        .find(|&&t| crate::weights::ggml_suffix(t) == Some(suffix))
        .map(|t| t.id())
}

/// The module source for head size `head_dim`: the prelude, the dense
/// kernels, the task loop.
pub fn persistent_source(head_dim: usize) -> String {
    format!(
        "#define TASK_HEAD_DIM {head_dim}\n{}",
        module::PERSISTENT_SOURCE
    )
}

/// `(kind, variant)` of the task that runs a block of kernel `name` in the
/// module compiled for `head_dim`; `None` when no task kind runs it.
pub(crate) fn task_kind(name: &str, head_dim: usize) -> Option<(u32, u32)> {
    let split = |rest: &str| -> Option<u32> {
        match rest {
            "" => Some(1),
            "_k2" => Some(2),
            "_k4" => Some(4),
            "_k8" => Some(8),
            _ => None,
        }
    };
    if let Some(rest) = name.strip_prefix("mv3_") {
        for (suffix, k) in [
            ("q8_0s_grid", "TK_MV3_Q8S_GRID"),
            ("q8_0s", "TK_MV3_Q8S"),
            ("q4_ks", "TK_MV3_Q4KS"),
            ("q5_0s", "TK_MV3_Q5S"),
            ("q6_ks", "TK_MV3_Q6KS"),
        ] {
            if let Some(r) = rest.strip_prefix(suffix) {
                if let Some(s) = split(r) {
                    return Some((kind(k), s));
                }
            }
        }
        // ggml-layout mat-vecs (types no layout repacks) stay graph steps.
        return None;
    }
    for (prefix, family) in [("ffn_", "FFN"), ("embed_", "EMBED")] {
        if let Some(rest) = name.strip_prefix(prefix) {
            let k = match rest {
                "q8_0s" => "Q8S",
                "q4_ks" => "Q4KS",
                "q5_0s" => "Q5S",
                "q6_ks" => "Q6KS",
                other if family == "EMBED" => {
                    return ggml_id(other).map(|id| (kind("TK_EMBED_GGML"), id));
                }
                _ => return None,
            };
            return Some((kind(&format!("TK_{family}_{k}")), 0));
        }
    }
    let k = match name {
        "rms_norm" => "TK_RMS_NORM",
        "argmax_rows" => "TK_ARGMAX",
        "attend_combine" => "TK_ATTEND_COMBINE",
        "rope_store_f16" => "TK_ROPE_STORE_F16",
        "gather_rows" => "TK_GATHER_ROWS",
        "add_inplace" => "TK_ADD_INPLACE",
        "add_bias" => "TK_ADD_BIAS",
        _ if name == format!("attend_split_f16_d{head_dim}") => "TK_ATTEND_SPLIT_F16",
        _ if name == format!("attend_split_rope_f16_d{head_dim}") => "TK_ATTEND_SPLIT_ROPE_F16",
        _ => return None,
    };
    Some((kind(k), 0))
}

/// The head size of the step's split attention (`attend_split*_f16_dN`),
/// if it has one.
pub(crate) fn step_head_dim(names: &[&str]) -> Option<usize> {
    names.iter().find_map(|n| {
        let rest = n
            .strip_prefix("attend_split_rope_f16_d")
            .or_else(|| n.strip_prefix("attend_split_f16_d"))?;
        rest.parse().ok()
    })
}

/// What a launch reads and writes of the step's activations (weights
/// left out): exact ranges for the mat-vecs, whose shapes the typed
/// launch carries; anything else is `Access::Everything`.
pub(crate) fn access(l: &Launch) -> Access {
    let batch = l.grid.1.max(1) as u64;
    let f = |n: i32| 4 * n.max(0) as u64 * batch;
    match &l.work {
        Work::MatVec(m) => {
            let mut reads = vec![];
            let mut writes = vec![];
            match m.norm {
                Some(n) => {
                    reads.push(Range::new(n.x, f(m.cols)));
                    writes.push(Range::new(n.out, f(m.cols)));
                }
                None => reads.push(Range::new(m.x, f(m.cols))),
            }
            for i in 0..3 {
                if m.rows[i] > 0 {
                    writes.push(Range::new(m.y[i], f(m.rows[i])));
                    if m.bias[i] != 0 {
                        reads.push(Range::new(m.bias[i], 4 * m.rows[i] as u64));
                    }
                }
            }
            if m.res != 0 {
                reads.push(Range::new(m.res, f(m.rows[0])));
                writes.push(Range::new(m.res, f(m.rows[0])));
            }
            Access::Ranges { reads, writes }
        }
        Work::GateUp(g) => {
            let mut reads = vec![];
            let mut writes = vec![Range::new(g.h, f(g.rows))];
            match g.norm {
                Some(n) => {
                    reads.push(Range::new(n.x, f(g.cols)));
                    writes.push(Range::new(n.out, f(g.cols)));
                }
                None => reads.push(Range::new(g.x, f(g.cols))),
            }
            Access::Ranges { reads, writes }
        }
        _ => Access::Everything,
    }
}

/// A launch as a stage: its task kind, threads per task and argument
/// slots; `None` when no task runs it (its kernel, a block shape other
/// than `(n, 1, 1)` with n a multiple of 32 up to [`TASK_THREADS`], or
/// too many arguments).
pub(crate) fn stage_of(l: &Launch, name: &str, head_dim: usize) -> Option<[u8; STAGE_BYTES]> {
    let (kind, variant) = task_kind(name, head_dim)?;
    // argmax_rows gives the same index at any block size (max, then the
    // lowest index among equal values): its 1024 become 256.
    let threads = if name == "argmax_rows" {
        l.block.0.min(TASK_THREADS)
    } else {
        l.block.0
    };
    if l.block.1 != 1
        || l.block.2 != 1
        || threads == 0
        || threads % 32 != 0
        || threads > TASK_THREADS
    {
        return None;
    }
    let args = l.work.args();
    if args.len() > TASK_ARGS {
        return None;
    }
    let mut out = [0u8; STAGE_BYTES];
    let head = [kind, variant, threads, l.grid.0, l.grid.1, l.grid.2];
    for (i, v) in head.iter().enumerate() {
        out[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
    }
    for (i, a) in args.iter().enumerate() {
        let v: u64 = match *a {
            Arg::Ptr(p) => p,
            Arg::I32(v) => v as u32 as u64,
            Arg::I64(v) => v as u64,
            Arg::F32(v) => v.to_bits() as u64,
        };
        out[24 + 8 * i..32 + 8 * i].copy_from_slice(&v.to_le_bytes());
    }
    Some(out)
}

/// Blocks of a persistent launch: as many as are resident at once, at most
/// one per task.
fn grid_for(sched: &Schedule, per_sm: usize, sm_count: usize) -> u32 {
    (per_sm * sm_count).min(sched.n_tasks as usize).max(1) as u32
}

/// A recorded step's tables on the device, and its counters.
struct Plan {
    launches: Vec<Launch>,
    n_tasks: u32,
    tasks: CudaSlice<u32>,
    waits: CudaSlice<u32>,
    stages: CudaSlice<u8>,
    /// One per stage, zero at the start; never reset.
    counters: CudaSlice<u32>,
    /// Steps run so far (the next one passes generation + 1).
    generation: u32,
    grid: u32,
    smem: u32,
}

// SAFETY: device buffers used only under `CudaBackend::step_state`'s mutex.
unsafe impl Send for Plan {}

/// The persistent module of one head size and the plans run with it.
pub(crate) struct PersistentState {
    head_dim: usize,
    _module: Arc<CudaModule>,
    function: CudaFunction,
    status: CudaSlice<u32>,
    plans: Vec<Plan>,
}

// SAFETY: as `Plan`.
unsafe impl Send for PersistentState {}

impl CudaBackend {
    /// Runs the recorded step `launches` as one persistent launch; `Ok(false)`
    /// (nothing run) when a launch has no task kind.
    pub(crate) fn run_persistent(
        &self,
        state: &mut Option<PersistentState>,
        launches: &[Launch],
    ) -> Result<bool> {
        let names: Vec<&str> = launches
            .iter()
            .map(|l| self.kernels.names[l.kernel].as_str())
            .collect();
        let head_dim = step_head_dim(&names).unwrap_or(128);
        let mut stages = Vec::with_capacity(launches.len());
        for (l, n) in launches.iter().zip(&names) {
            match stage_of(l, n, head_dim) {
                Some(s) => stages.push(s),
                None => return Ok(false),
            }
        }
        if state.as_ref().is_none_or(|s| s.head_dim != head_dim) {
            *state = Some(self.load_persistent(head_dim)?);
        }
        let st = state.as_mut().expect("loaded above");
        let i = match st.plans.iter().position(|p| p.launches == launches) {
            Some(i) => i,
            None => {
                let plan = self.plan(st, launches, &stages)?;
                if st.plans.len() >= PLAN_CACHE {
                    st.plans.pop();
                }
                st.plans.insert(0, plan);
                0
            }
        };
        let mut plan = st.plans.remove(i);
        match self.launch_plan(st, &mut plan) {
            Ok(()) => {
                st.plans.insert(0, plan);
                Ok(true)
            }
            Err(e) => {
                // The plan's counters are off now: it is dropped, and the
                // status cleared for the next one.
                self.stream.memset_zeros(&mut st.status).map_err(drv)?;
                Err(e)
            }
        }
    }

    fn load_persistent(&self, head_dim: usize) -> Result<PersistentState> {
        let (major, minor) = self.compute_capability();
        let (ptx, _) = module::ptx_for(
            &format!("persistent_d{head_dim}"),
            &persistent_source(head_dim),
            major,
            minor,
        )?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(drv)?;
        let function = module
            .load_function("decode_persistent")
            .map_err(|e| CudaError::Driver(format!("kernel decode_persistent: {e}")))?;
        let status = self.stream.alloc_zeros::<u32>(4).map_err(drv)?;
        Ok(PersistentState {
            head_dim,
            _module: module,
            function,
            status,
            plans: Vec::new(),
        })
    }

    fn plan(
        &self,
        st: &PersistentState,
        launches: &[Launch],
        stages: &[[u8; STAGE_BYTES]],
    ) -> Result<Plan> {
        let specs: Vec<StageSpec> = launches
            .iter()
            .map(|l| StageSpec {
                tasks: l.grid.0 * l.grid.1 * l.grid.2,
                access: access(l),
            })
            .collect();
        let sched = Schedule::build(&specs).map_err(|e| CudaError::Schedule(e.to_string()))?;
        let (tasks, waits) = sched.device_tables();
        let smem = launches.iter().map(|l| l.smem).max().unwrap_or(0);
        if smem > 48 * 1024 {
            st.function
                .set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
                .map_err(drv)?;
        }
        let per_sm = st
            .function
            .occupancy_max_active_blocks_per_multiprocessor(TASK_THREADS, smem as usize, None)
            .map_err(drv)? as usize;
        if per_sm == 0 {
            return Err(CudaError::Schedule(format!(
                "no persistent block fits an SM with {smem} bytes of shared memory"
            ))
            .into());
        }
        // Every block resident at once (invariant 3 of `schedule`); the
        // cooperative launch refuses a grid that is not.
        let grid = grid_for(&sched, per_sm, self.sm_count);
        // The schedule run once on the host as the device will (every block
        // in list order, counters as targets): a step that would stall or
        // race is refused here rather than launched.
        simulate(&sched, &specs, grid as usize, 2, |_| 0)
            .map_err(|e| CudaError::Schedule(e.to_string()))?;
        let flat_tasks: Vec<u32> = tasks.iter().flatten().copied().collect();
        let flat_waits: Vec<u32> = if waits.is_empty() {
            vec![0, 0]
        } else {
            waits.iter().flatten().copied().collect()
        };
        let flat_stages: Vec<u8> = stages.iter().flatten().copied().collect();
        let up32 = |v: &[u32]| self.stream.clone_htod(v).map_err(drv);
        Ok(Plan {
            launches: launches.to_vec(),
            n_tasks: sched.n_tasks,
            tasks: up32(&flat_tasks)?,
            waits: up32(&flat_waits)?,
            stages: self.stream.clone_htod(&flat_stages).map_err(drv)?,
            counters: self
                .stream
                .alloc_zeros::<u32>(sched.stages.len())
                .map_err(drv)?,
            generation: 0,
            grid,
            smem,
        })
    }

    /// One step: the launch, then the wait (bounded) and its status.
    fn launch_plan(&self, st: &PersistentState, plan: &mut Plan) -> Result<()> {
        plan.generation = plan.generation.wrapping_add(1);
        let generation = plan.generation;
        let args = [
            Arg::Ptr(self.ptr(&plan.tasks)),
            Arg::I32(plan.n_tasks as i32),
            Arg::Ptr(self.ptr(&plan.waits)),
            Arg::Ptr(self.ptr(&plan.stages)),
            Arg::Ptr(self.ptr(&plan.counters)),
            Arg::I32(generation as i32),
            Arg::I64(DEVICE_TIMEOUT_NS as i64),
            Arg::Ptr(self.ptr(&st.status)),
        ];
        // SAFETY: the argument list is decode_persistent's (pointers to
        // this plan's buffers, which outlive the wait below).
        unsafe { launch_cooperative(&st.function, &self.stream, plan.grid, plan.smem, &args) }
            .map_err(drv)?;
        let done = self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(drv)?;
        done.record(&self.stream).map_err(drv)?;
        let start = Instant::now();
        while !done.try_is_complete().map_err(drv)? {
            if start.elapsed() > HOST_TIMEOUT {
                return Err(CudaError::PersistentStall {
                    task: u32::MAX,
                    stage: u32::MAX,
                    waiting_on: u32::MAX,
                    what: "the step did not finish within the host's timeout".into(),
                }
                .into());
            }
            std::thread::yield_now();
        }
        let mut status = [0u32; 4];
        self.stream
            .memcpy_dtoh(&st.status, &mut status)
            .map_err(drv)?;
        match status[0] {
            0 => Ok(()),
            code => Err(CudaError::PersistentStall {
                task: status[1],
                stage: status[2],
                waiting_on: status[3],
                what: match code {
                    1 => "a dependency was not met within the device's timeout".into(),
                    2 => "a task body ran without waiting on its dependencies".into(),
                    c => format!("status {c}"),
                },
            }
            .into()),
        }
    }
}

/// Launches `f` cooperatively (the driver refuses a grid whose blocks are
/// not all resident at once) with `TASK_THREADS` threads a block.
///
/// # Safety
/// As `launch::launch_ex`.
unsafe fn launch_cooperative(
    f: &CudaFunction,
    stream: &cudarc::driver::CudaStream,
    grid: u32,
    smem: u32,
    args: &[Arg],
) -> std::result::Result<(), cudarc::driver::DriverError> {
    let mut params: Vec<*mut std::ffi::c_void> = args
        .iter()
        .map(|a| match a {
            Arg::Ptr(v) => v as *const u64 as *mut std::ffi::c_void,
            Arg::I32(v) => v as *const i32 as *mut std::ffi::c_void,
            Arg::I64(v) => v as *const i64 as *mut std::ffi::c_void,
            Arg::F32(v) => v as *const f32 as *mut std::ffi::c_void,
        })
        .collect();
    stream.context().bind_to_thread()?;
    // SAFETY: a plain C union of integers; zero is valid for every member.
    let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
    value.cooperative = 1;
    let mut attrs = [sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE,
        pad: [0; 4],
        value,
    }];
    let cfg = sys::CUlaunchConfig {
        gridDimX: grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: TASK_THREADS,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: stream.cu_stream(),
        attrs: attrs.as_mut_ptr(),
        numAttrs: 1,
    };
    // SAFETY: the caller's contract; `params` points at `args`' values.
    unsafe {
        sys::cuLaunchKernelEx(
            &cfg,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::{MatVec, NormFold, F32};

    /// The task kinds here are persistent.cu's `#define TK_*` lines.
    #[test]
    fn task_kinds_match_the_kernel_source() {
        let src = include_str!("../../../cuda/persistent.cu");
        let defined: Vec<(String, u32)> = src
            .lines()
            .filter_map(|l| {
                let mut it = l.strip_prefix("#define TK_")?.split_whitespace();
                Some((format!("TK_{}", it.next()?), it.next()?.parse().ok()?))
            })
            .collect();
        let ours: Vec<(String, u32)> = TASK_KINDS
            .iter()
            .map(|&(n, k)| (n.to_string(), k))
            .collect();
        assert_eq!(defined, ours);
    }

    /// Every kernel a Q8_0 or Q4_K_M decode step launches (f16 KV, RoPE
    /// folded into the attention, or not) has a kind; the others have none.
    #[test]
    fn decode_kernels_map_to_task_kinds() {
        for (name, kind, variant) in [
            ("mv3_q8_0s", 1, 1),
            ("mv3_q8_0s_k4", 1, 4),
            ("mv3_q8_0s_grid_k2", 2, 2),
            ("mv3_q4_ks_k8", 3, 8),
            ("mv3_q6_ks", 5, 1),
            ("ffn_q8_0s", 6, 0),
            ("ffn_q6_ks", 9, 0),
            ("embed_q8_0s", 10, 0),
            ("embed_q6_k", 14, 14),
            ("embed_f16", 14, 1),
            ("rms_norm", 15, 0),
            ("argmax_rows", 16, 0),
            ("attend_split_f16_d64", 17, 0),
            ("attend_split_rope_f16_d64", 18, 0),
            ("attend_combine", 19, 0),
            ("rope_store_f16", 20, 0),
            ("gather_rows", 21, 0),
            ("add_inplace", 22, 0),
        ] {
            assert_eq!(task_kind(name, 64), Some((kind, variant)), "{name}");
        }
        for name in [
            "mv3_nvfp4",
            "mv3_q8_0s_k3",
            "mv3_q4_1",
            "mv3_q6_k",
            "ffn_q4_k",
            "embed_nvfp4",
            "attend_split_rope_f16_d128",
            "attend_split_f32_d64",
            "rope_store_f32",
            "superblock_ffn_q8s",
            "swiglu",
        ] {
            assert_eq!(task_kind(name, 64), None, "{name}");
        }
        assert_eq!(
            step_head_dim(&["rms_norm", "attend_split_rope_f16_d128"]),
            Some(128)
        );
    }

    fn mv(norm: bool) -> Launch {
        Launch {
            kernel: 0,
            grid: (10, 1, 1),
            block: (256, 1, 1),
            smem: 0,
            work: Work::MatVec(MatVec {
                w: [1, 2, 0],
                rows: [64, 32, 0],
                row_bytes: 0,
                cols: 128,
                x: 1000,
                y: [2000, 3000, 0],
                tensor_scale: [F32(0.0); 3],
                bias: [0, 4000, 0],
                res: 0,
                norm: norm.then_some(NormFold {
                    x: 5000,
                    w: 9,
                    eps: F32(1e-6),
                    out: 1000,
                }),
            }),
        }
    }

    /// A stage holds the kind, the block shape and the kernel's argument
    /// list in 8-byte slots; the access ranges are the mat-vec's.
    #[test]
    fn stages_hold_the_launch() {
        let l = mv(true);
        let s = stage_of(&l, "mv3_q8_0s_k2", 64).unwrap();
        let u32_at = |i: usize| u32::from_le_bytes(s[4 * i..4 * i + 4].try_into().unwrap());
        let slot = |i: usize| u64::from_le_bytes(s[24 + 8 * i..32 + 8 * i].try_into().unwrap());
        assert_eq!(
            (u32_at(0), u32_at(1), u32_at(2), u32_at(3)),
            (1, 2, 256, 10)
        );
        assert_eq!(slot(3), 64, "rows0");
        assert_eq!(slot(8), 1000, "x");
        assert_eq!(slot(19), 5000, "the folded norm's input");
        assert_eq!(slot(21), 1e-6f32.to_bits() as u64);
        let Access::Ranges { reads, writes } = access(&l) else {
            panic!("a mat-vec's access is known")
        };
        assert_eq!(reads, vec![Range::new(5000, 512), Range::new(4000, 128)]);
        assert_eq!(
            writes,
            vec![
                Range::new(1000, 512),
                Range::new(2000, 256),
                Range::new(3000, 128)
            ]
        );
        let mut wide = mv(false);
        wide.block.0 = 512;
        assert!(stage_of(&wide, "mv3_q8_0s", 64).is_none());
        let mut argmax = mv(false);
        argmax.block.0 = 1024;
        argmax.work = Work::Plain(vec![Arg::Ptr(1), Arg::I32(5), Arg::Ptr(2)]);
        let s = stage_of(&argmax, "argmax_rows", 64).unwrap();
        assert_eq!(u32::from_le_bytes(s[8..12].try_into().unwrap()), 256);
        assert_eq!(access(&argmax), Access::Everything);
    }
}
