//! [`CudaBackend`]: the runtime's [`Backend`] on one CUDA device, one
//! stream, kernels compiled by NVRTC. The ops live by concern in `weights`
//! (upload, embedding), `matvec` (products), `attention` (KV cache and
//! attention) and `graph` (the recorder and graph replay of decode steps,
//! with `fusion`); this file holds the device, the kernel table, the device
//! buffers and the trait impl that ties them together.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    ValidAsZeroBits,
};
use mirage_runtime::backend::{
    AttentionParams, Backend, HostMatrix, QkNorm, StepInputs, TokenSlot,
};
use mirage_runtime::kv_cache::KvSpec;
use mirage_runtime::kv_pages::KvPruning;
use mirage_runtime::{Result, RuntimeError};

use crate::attention::CudaKvCache;
use crate::fusion::PendingNorm;
use crate::graph::StepState;
use crate::launch::{Arg, Launch, Work};
use crate::matvec::SPLIT_K;
use crate::weights::{CudaFfn, CudaMatrix, CudaVector, GGML_TYPES, REPACKED_SUFFIXES};
use crate::{module, CudaError, CudaOptions, MemoryStats, WeightFormat};

pub(crate) fn drv(e: cudarc::driver::DriverError) -> RuntimeError {
    CudaError::Driver(e.to_string()).into()
}

pub(crate) fn bad(msg: impl Into<String>) -> RuntimeError {
    RuntimeError::InvalidArgument(msg.into())
}

/// Threads of an `rms_norm` block, and of the mat-vec blocks that fold the
/// norm in (norm.cu's row function gives the same bits at the same count).
pub(crate) const NORM_THREADS: u32 = 256;

/// Widest row a norm can be folded into the next mat-vec (its normalized
/// row sits in shared memory, under the 48 KiB a launch gets without
/// opting in, with the kernels' static reduction buffer).
const FUSED_NORM_MAX_WIDTH: usize = 10 * 1024;

/// The kernels a backend launches, by name, from the modules loaded on its
/// context (the dense module at start, the sparse one when a sparse backend
/// wraps it).
pub(crate) struct Kernels {
    pub functions: Vec<CudaFunction>,
    /// Whether each function waits on its prerequisite grid
    /// (`module::waits_on_prerequisite`): only those are launched with
    /// programmatic stream serialization.
    pub waits: Vec<bool>,
    /// Each function's kernel name.
    pub names: Vec<String>,
    /// Each function's parameters as its PTX declares them: every launch is
    /// checked against them (a pointer passed where an int is expected, or
    /// the reverse, would otherwise run and write through garbage).
    pub params: Vec<Vec<module::ParamKind>>,
    index: HashMap<String, usize>,
}

/// Kernels whose blocks may take more than the default 48 KB of dynamic
/// shared memory: the tensor-core mat-vecs (activation planes of wide rows)
/// the prefill products and the tensor-core decode attention (their rings
/// of stages).
const LARGE_SMEM_KERNEL_PREFIXES: &[&str] = &[
    "mv3_q4_ks",
    "mvx_q4_ks",
    "ffn_q4_ks",
    "mv3_q6_ks",
    "mvx_q6_ks",
    "ffn_q6_ks",
    "mmq_",
    "attend_split_mma",
    "attend_pages_mma",
];

impl Kernels {
    /// Lets the kernels whose names start with one of `prefixes` take up to
    /// `optin` bytes of shared memory a block (less their static share).
    fn opt_in_smem(&self, prefixes: &[&str], optin: usize) -> std::result::Result<(), CudaError> {
        use cudarc::driver::sys::CUfunction_attribute as A;
        for (f, name) in self.functions.iter().zip(&self.names) {
            if !prefixes.iter().any(|p| name.starts_with(p)) {
                continue;
            }
            let d =
                |e: cudarc::driver::DriverError| CudaError::Driver(format!("kernel {name}: {e}"));
            let fixed = f
                .get_attribute(A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
                .map_err(d)?;
            let dynamic = (optin as i32 - fixed).max(0);
            f.set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic)
                .map_err(d)?;
        }
        Ok(())
    }

    /// Loads `names` of `module` (whose PTX is `ptx`).
    pub fn load(
        &mut self,
        module: &Arc<CudaModule>,
        ptx: &str,
        names: &[String],
    ) -> std::result::Result<(), CudaError> {
        for name in names {
            let f = module
                .load_function(name)
                .map_err(|e| CudaError::Driver(format!("kernel {name}: {e}")))?;
            self.index.insert(name.clone(), self.functions.len());
            self.functions.push(f);
            self.waits.push(module::waits_on_prerequisite(ptx, name));
            self.params
                .push(module::param_kinds(ptx, name).unwrap_or_default());
            self.names.push(name.clone());
        }
        Ok(())
    }

    /// The index of kernel `name`.
    pub fn index(&self, name: &str) -> Result<usize> {
        self.index
            .get(name)
            .copied()
            .ok_or_else(|| bad(format!("no kernel `{name}`")))
    }
}

/// Every kernel of the dense module (`module::DENSE_SOURCE`) the backend
/// loads.
pub(crate) fn kernel_names() -> Vec<String> {
    let mut names = Vec::new();
    let ggml = GGML_TYPES.map(|t| crate::weights::ggml_suffix(t).expect("a kernel type"));
    for s in ggml.iter().chain(&REPACKED_SUFFIXES) {
        for k in ["mv3", "ffn", "embed", "dequant_f16"] {
            names.push(format!("{k}_{s}"));
        }
    }
    for s in REPACKED_SUFFIXES.iter().copied().chain(["q8_0s_grid"]) {
        for k in &SPLIT_K[1..] {
            names.push(format!("mv3_{s}_k{k}"));
        }
    }
    for s in ["q4_ks", "q6_ks"] {
        for k in &SPLIT_K[1..] {
            names.push(format!("ffn_{s}_k{k}"));
        }
        for k in crate::matvec::XSPLIT {
            names.push(format!("mvx_{s}_x{k}"));
        }
    }
    names.push("mv3_q8_0s_grid".into());
    names.push("rope_table".into());
    for s in crate::matvec::MMQ_SUFFIXES {
        for t in crate::matvec::MMQ_TILES {
            names.push(format!("mmq_{s}_t{t}"));
        }
    }
    for kv in ["f32", "f16", "q8_0"] {
        for k in [
            "rope_store",
            "page_bounds",
            "page_bounds_rows",
            "attend_pages_part",
        ] {
            names.push(format!("{k}_{kv}"));
        }
        for hd in crate::attention::PREFILL_HEAD_DIMS {
            names.push(format!("attend_prefill_{kv}_d{hd}"));
        }
        for hd in crate::attention::SPLIT_HEAD_DIMS {
            for k in ["attend_split", "attend_split_rope"] {
                names.push(format!("{k}_{kv}_d{hd}"));
            }
        }
    }
    for hd in crate::attention::MMA_HEAD_DIMS {
        for kv in ["f16", "q8_0"] {
            names.push(format!("attend_split_mma_{kv}_d{hd}"));
            names.push(format!("attend_pages_mma_{kv}_d{hd}"));
        }
    }
    for k in [
        "rms_norm",
        "add_bias",
        "add_inplace",
        "swiglu",
        "gather_rows",
        "argmax_rows",
        "f32_to_f16",
        "quantize_q8",
        "page_keys",
        "select_pages",
        "union_pages",
        "attend_combine",
        "attend_prefill_combine",
    ] {
        names.push(k.into());
    }
    names
}

/// A `[rows, width]` f32 buffer on the device, reused across steps (it only
/// grows).
#[derive(Debug, Default)]
pub struct CudaActivations {
    pub(crate) rows: usize,
    pub(crate) width: usize,
    pub(crate) buf: Option<CudaSlice<f32>>,
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

/// Device buffers the ops reuse from call to call.
#[derive(Default)]
pub(crate) struct Scratch {
    pub gate: CudaActivations,
    pub up: CudaActivations,
    pub hidden: CudaActivations,
    /// Attention split partials `[rows, n_head, n_split, head_dim + 2]`.
    pub attn_part: CudaActivations,
    /// Prefill attention split partials `[n_split, rows, n_head, head_dim +
    /// 2]`.
    pub prefill_part: Option<CudaSlice<f32>>,
    /// Last uploaded token slots (seq, pos pairs) and their device copy:
    /// every layer of a step passes the same slots (ops outside a step).
    pub slots_host: Vec<i32>,
    pub slots_dev: Option<CudaSlice<i32>>,
    pub indices: Option<CudaSlice<u32>>,
    /// f16 copies of a GEMM's activations and of one weight tile.
    pub gemm_x: Option<CudaSlice<u16>>,
    /// A prefill product's activations in 8-bit blocks: int8 quants, then
    /// an f32 scale per 32 values.
    pub mmq_x: Option<CudaSlice<u8>>,
    pub gemm_w: Option<CudaSlice<u16>>,
    /// Pruned attention: page keys `[rows, n_head, max_pages]`, chosen pages
    /// `[rows, n_head, max_sel]`, their counts, split partials, and for its
    /// tensor-core form the union of a KV head's pages (`union_pages`:
    /// pages and head masks `[rows, n_head_kv, max_pages]` each, then the
    /// counts `[rows, n_head_kv]`).
    pub prune_keys: Option<CudaSlice<u32>>,
    pub prune_sel: Option<CudaSlice<i32>>,
    pub prune_nsel: Option<CudaSlice<i32>>,
    pub prune_part: Option<CudaSlice<f32>>,
    pub prune_union: Option<CudaSlice<u32>>,
    /// Split-across-blocks mat-vecs (`launch::XSplit`): partial sums and
    /// tile counters (zero between launches).
    pub xsplit_part: Option<CudaSlice<f32>>,
    pub xsplit_ctr: Option<CudaSlice<u32>>,
}

pub(crate) enum MemKind {
    Weights,
    Kv,
    Workspace,
}

/// The CUDA backend: one device, one stream, kernels compiled by NVRTC.
/// Decode steps run as CUDA graphs (`graph`); prefill batches launch op by
/// op and multiply on tensor cores (int8 `mmq_*` from the split layouts,
/// cuBLAS on f16 tiles for the other layouts).
pub struct CudaBackend {
    // First, so that recorded graphs are destroyed before the module whose
    // kernels they launch is unloaded.
    pub(crate) step_state: Mutex<StepState>,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) kernels: Kernels,
    /// Programmatic dependent launch (the device has it: compute
    /// capability 9.0 and up).
    pub(crate) pdl: bool,
    graphs: std::sync::atomic::AtomicBool,
    weights: WeightFormat,
    pub(crate) gemm_tile_bytes: usize,
    /// `CudaOptions::prefill_gemm`.
    pub(crate) prefill_gemm: bool,
    pub(crate) blas: Option<CudaBlas>,
    device_name: String,
    compute_capability: (i32, i32),
    ptx_from_cache: bool,
    /// Streaming multiprocessors of the device.
    pub(crate) sm_count: usize,
    /// Shared memory a block may take when its kernel opts in (the
    /// tensor-core mat-vecs and the larger `mmq_*` tiles do, at load).
    pub(crate) smem_optin: usize,
    /// The largest `mmq_*` tile edge whose ring fits the device's shared
    /// memory (`matvec::MMQ_TILES`).
    pub(crate) mmq_max_tile: usize,
    /// `resident_blocks` answers by (kernel index, threads, dynamic shared
    /// memory).
    pub(crate) resident: Mutex<HashMap<(usize, u32, u32), usize>>,
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

impl CudaBackend {
    /// Opens device `ordinal` with the default options.
    pub fn new(ordinal: usize) -> std::result::Result<CudaBackend, CudaError> {
        Self::with_options(ordinal, &CudaOptions::default())
    }

    /// Opens device `ordinal`: loads the driver, compiles (or loads from the
    /// cache) the kernels. Typed errors when the driver, NVRTC or the device
    /// is missing.
    pub fn with_options(
        ordinal: usize,
        options: &CudaOptions,
    ) -> std::result::Result<CudaBackend, CudaError> {
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
        let smem_optin = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(d)?
            .max(0) as usize;
        let (ptx, ptx_from_cache) = module::ptx_for("dense", module::DENSE_SOURCE, cc.0, cc.1)?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx.clone()))
            .map_err(d)?;
        let mut kernels = Kernels {
            functions: Vec::new(),
            waits: Vec::new(),
            names: Vec::new(),
            params: Vec::new(),
            index: HashMap::new(),
        };
        kernels.load(&module, &ptx, &kernel_names())?;
        kernels.opt_in_smem(LARGE_SMEM_KERNEL_PREFIXES, smem_optin)?;
        let mmq_max_tile = crate::matvec::mmq_max_tile(smem_optin);
        // cuBLAS is optional: without the library prefill uses the mat-vec.
        // SAFETY: only probes whether the shared library can be opened.
        let blas = if options.prefill_gemm && unsafe { cudarc::cublas::sys::is_culib_present() } {
            CudaBlas::new(stream.clone()).ok()
        } else {
            None
        };
        Ok(CudaBackend {
            ctx,
            stream,
            kernels,
            pdl: cc.0 >= 9,
            graphs: options.graphs.into(),
            weights: options.weights,
            gemm_tile_bytes: options.gemm_tile_bytes.max(1),
            prefill_gemm: options.prefill_gemm,
            blas,
            device_name,
            compute_capability: cc,
            ptx_from_cache,
            sm_count,
            smem_optin,
            mmq_max_tile,
            resident: Mutex::new(HashMap::new()),
            scratch: Mutex::new(Scratch::default()),
            step_state: Mutex::new(StepState::default()),
            mem: Mutex::new(MemoryStats::default()),
        })
    }

    /// Records decode steps as CUDA graphs (`true`, the default) or
    /// launches every op as it comes (`false`, for debugging: the same
    /// results).
    pub fn set_graphs(&self, on: bool) {
        self.graphs.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether decode steps are recorded as CUDA graphs.
    pub fn graphs(&self) -> bool {
        self.graphs.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The encoding weight matrices are uploaded in.
    pub fn weight_format(&self) -> WeightFormat {
        self.weights
    }

    /// Whether batches of more than 16 rows multiply on tensor cores (the
    /// option on): the split layouts through the int8 products of
    /// `cuda/mmq.cu`, the other layouts through cuBLAS when the library
    /// loaded (else the mat-vec).
    pub fn prefill_gemm(&self) -> bool {
        self.prefill_gemm
    }

    /// Whether programmatic dependent launch is on (sm_90 and up).
    pub fn pdl(&self) -> bool {
        self.pdl
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

    /// Median device time of `f`'s launches in microseconds, over `iters`
    /// runs after three warm-up runs, each timed with events on the stream.
    pub(crate) fn median_us(&self, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
        let event = || {
            self.ctx
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(drv)
        };
        let mut times = Vec::with_capacity(iters);
        for i in 0..iters + 3 {
            let (start, end) = (event()?, event()?);
            start.record(&self.stream).map_err(drv)?;
            f()?;
            end.record(&self.stream).map_err(drv)?;
            end.synchronize().map_err(drv)?;
            if i >= 3 {
                times.push(start.elapsed_ms(&end).map_err(drv)? as f64 * 1e3);
            }
        }
        times.sort_by(|a, b| a.total_cmp(b));
        Ok(times.get(times.len() / 2).copied().unwrap_or(f64::NAN))
    }

    /// Device-to-device copy bandwidth in bytes per second, counting bytes
    /// read plus bytes written (the ceiling for a memory-bound decode), as
    /// the median of `iters` copies of `bytes` bytes timed with events.
    pub fn copy_bandwidth(&self, bytes: usize, iters: usize) -> Result<f64> {
        let n = bytes / 4;
        let src = self.stream.alloc_zeros::<f32>(n).map_err(drv)?;
        let mut dst = self.stream.alloc_zeros::<f32>(n).map_err(drv)?;
        let us = self.median_us(iters, || {
            self.stream.memcpy_dtod(&src, &mut dst).map_err(drv)
        })?;
        Ok(2.0 * (n * 4) as f64 / (us * 1e-6))
    }

    /// `out[r]` = index of the largest element of row `r` of `x`, computed on
    /// the device (only the indices travel to the host).
    pub fn argmax(&self, x: &CudaActivations) -> Result<Vec<u32>> {
        let buf = x
            .buf
            .as_ref()
            .ok_or_else(|| bad("argmax of an empty buffer"))?;
        let idx = self.stream.alloc_zeros::<u32>(x.rows.max(1)).map_err(drv)?;
        let (px, pi) = (self.ptr(buf), self.ptr(&idx));
        self.push_launch(Launch {
            kernel: self.kernels.index("argmax_rows")?,
            grid: (x.rows as u32, 1, 1),
            block: (1024, 1, 1),
            smem: 0,
            work: Work::Plain(vec![Arg::Ptr(px), Arg::I32(x.width as i32), Arg::Ptr(pi)]),
        })?;
        let mut out = vec![0u32; x.rows];
        self.stream
            .memcpy_dtoh(&idx.slice(0..x.rows), &mut out)
            .map_err(drv)?;
        Ok(out)
    }

    /// A device buffer holding `data` as `rows` rows of `width` floats.
    pub fn upload_activations(
        &self,
        rows: usize,
        width: usize,
        data: &[f32],
    ) -> Result<CudaActivations> {
        let mut a = CudaActivations::default();
        self.write_activations(&mut a, rows, width, data)?;
        Ok(a)
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
        self.reshape(a, rows, width)?;
        if !data.is_empty() {
            let buf = a.buf.as_mut().ok_or_else(|| bad("reshape allocates"))?;
            self.stream
                .memcpy_htod(data, &mut buf.slice_mut(0..data.len()))
                .map_err(drv)?;
        }
        Ok(())
    }

    pub(crate) fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        // Event tracking is off (one stream), so the guard has nothing to do.
        let (p, _guard) = s.device_ptr(&self.stream);
        p
    }

    pub(crate) fn account(&self, kind: MemKind, bytes: usize) {
        let mut m = self.mem.lock().unwrap_or_else(|e| e.into_inner());
        match kind {
            MemKind::Weights => m.weights += bytes,
            MemKind::Kv => m.kv_cache += bytes,
            MemKind::Workspace => m.workspace += bytes,
        }
        m.peak = m.peak.max(m.weights + m.kv_cache + m.workspace);
    }

    pub(crate) fn scratch(&self) -> MutexGuard<'_, Scratch> {
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets the shape of `a`, growing its buffer when needed; returns its
    /// device pointer.
    pub(crate) fn reshape(
        &self,
        a: &mut CudaActivations,
        rows: usize,
        width: usize,
    ) -> Result<u64> {
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

    pub(crate) fn act_ptr(&self, a: &CudaActivations) -> Result<u64> {
        a.buf
            .as_ref()
            .map(|b| self.ptr(b))
            .ok_or_else(|| bad("activation buffer used before it was written"))
    }

    /// Grows a scratch slot to `n` elements at least; its device address.
    pub(crate) fn grow_scratch<T: DeviceRepr + ValidAsZeroBits>(
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

    pub(crate) fn upload_u32(&self, slot: &mut Option<CudaSlice<u32>>, v: &[u32]) -> Result<u64> {
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

    /// An elementwise kernel over `n` elements: pointer arguments `args`,
    /// then the row width when given, then `n`.
    pub(crate) fn elementwise(
        &self,
        name: &str,
        n: usize,
        args: &[u64],
        width: Option<i32>,
    ) -> Result<()> {
        let mut a: Vec<Arg> = args.iter().map(|&p| Arg::Ptr(p)).collect();
        if let Some(w) = width {
            a.push(Arg::I32(w));
        }
        a.push(Arg::I64(n as i64));
        self.push_launch(Launch {
            kernel: self.kernels.index(name)?,
            grid: ((n as u32).div_ceil(256), 1, 1),
            block: (256, 1, 1),
            smem: 0,
            work: Work::Plain(a),
        })
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
        self.run_step(inputs, pass)
    }

    fn upload_matrix(&self, m: &HostMatrix) -> Result<CudaMatrix> {
        self.upload_host_matrix(m)
    }

    fn upload_vector(&self, v: &[f32]) -> Result<CudaVector> {
        self.upload_vector_f32(v)
    }

    fn upload_ffn(
        &self,
        _layer: usize,
        gate: &HostMatrix,
        up: &HostMatrix,
        down: &HostMatrix,
    ) -> Result<CudaFfn> {
        self.upload_ffn_matrices(gate, up, down)
    }

    fn new_kv_cache(&self, spec: KvSpec) -> Result<CudaKvCache> {
        self.new_cache(spec)
    }

    fn new_kv_cache_pruned(&self, spec: KvSpec, pruning: Option<KvPruning>) -> Result<CudaKvCache> {
        self.new_cache_pruned(spec, pruning)
    }

    fn kv_set_pruning(&self, cache: &mut CudaKvCache, pruning: Option<KvPruning>) -> Result<()> {
        self.set_cache_pruning(cache, pruning)
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
        self.embed_rows(table, tokens, out)
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
        let pn = PendingNorm {
            x: px,
            w: self.ptr(&weight.data),
            eps,
            rows: x.rows,
            width: x.width,
            out: po,
        };
        // In a recorded step the norm waits for the launch that reads its
        // output, which folds it in when it can.
        if x.width <= FUSED_NORM_MAX_WIDTH && px != po && self.defer_norm(pn)? {
            return Ok(());
        }
        self.push_launch(pn.launch(self.kernels.index("rms_norm")?))
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
        if self.use_gemm(x.rows) {
            return self.matvec_many(ws, px, x.rows, &ys);
        }
        // Runs of up to three matrices read by the same kernel share a launch.
        let mut i = 0;
        while i < ws.len() {
            let mut j = i + 1;
            while j < ws.len() && j - i < 3 && ws[j].suffix() == ws[i].suffix() {
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
        let pb = self.ptr(&bias.data);
        if self.fold_into_producer(px, x.rows, pb, false) {
            return Ok(());
        }
        self.elementwise(
            "add_bias",
            x.rows * x.width,
            &[px, pb],
            Some(x.width as i32),
        )
    }

    fn add(&self, acc: &mut CudaActivations, x: &CudaActivations) -> Result<()> {
        if acc.rows != x.rows || acc.width != x.width {
            return Err(bad("residual shapes differ"));
        }
        let (pa, px) = (self.act_ptr(acc)?, self.act_ptr(x)?);
        if pa != px && self.fold_into_producer(px, x.rows, pa, true) {
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
        self.attend(layer, p, q, k, v, qk_norm, slots, cache, out)
    }

    fn ffn(&self, f: &CudaFfn, x: &CudaActivations, out: &mut CudaActivations) -> Result<()> {
        if x.width != f.gate.cols {
            return Err(bad(format!(
                "ffn input width {} != {}",
                x.width, f.gate.cols
            )));
        }
        let px = self.act_ptr(x)?;
        let po = self.reshape(out, x.rows, f.down.rows)?;
        self.ffn_rows(f, px, x.rows, po)
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
        self.push_launch(Launch {
            kernel: self.kernels.index("gather_rows")?,
            grid: (rows.len() as u32, 1, 1),
            block: (256, 1, 1),
            smem: 0,
            work: Work::Plain(vec![
                Arg::Ptr(px),
                Arg::Ptr(pi),
                Arg::I32(x.width as i32),
                Arg::Ptr(po),
            ]),
        })
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
