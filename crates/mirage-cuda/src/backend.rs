//! [`CudaBackend`]: the runtime's [`Backend`] on one CUDA device.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use mirage_gguf::quant;
use mirage_gguf::GgmlType;
use mirage_runtime::backend::{AttentionParams, Backend, HostMatrix, QkNorm, TokenSlot};
use mirage_runtime::kv_cache::{KvDtype, KvSpec};
use mirage_runtime::ops::RopeMode;
use mirage_runtime::{Result, RuntimeError};

use crate::{module, CudaError, MemoryStats};

fn drv(e: cudarc::driver::DriverError) -> RuntimeError {
    CudaError::Driver(e.to_string()).into()
}

fn bad(msg: impl Into<String>) -> RuntimeError {
    RuntimeError::InvalidArgument(msg.into())
}

/// Kernel-name suffix of a weight type the mat-vec and embedding kernels
/// read; `None` for types they do not (yet) decode.
fn kernel_suffix(ty: GgmlType) -> Option<&'static str> {
    use GgmlType::*;
    Some(match ty {
        F32 => "f32",
        F16 => "f16",
        BF16 => "bf16",
        Q4_0 => "q4_0",
        Q4_1 => "q4_1",
        Q5_0 => "q5_0",
        Q5_1 => "q5_1",
        Q8_0 => "q8_0",
        Q2_K => "q2_k",
        Q4_K => "q4_k",
        Q5_K => "q5_k",
        Q6_K => "q6_k",
        Q3_K | Q8_1 | Q8_K => return None,
    })
}

const SUFFIXES: &[&str] = &[
    "f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q4_k", "q5_k", "q6_k",
];
const OTHER_KERNELS: &[&str] = &[
    "rms_norm",
    "add_bias",
    "add_inplace",
    "swiglu",
    "gather_rows",
    "rope_store",
    "attend",
    "argmax_rows",
];

/// Threads of an attention block (a multiple of every supported head_dim).
const ATTEND_THREADS: u32 = 512;

/// Warps (weight rows) per mat-vec thread block.
const MATVEC_WARPS: u32 = 8;

/// A weight matrix on the device, in its ggml encoding.
#[derive(Debug)]
pub struct CudaMatrix {
    name: String,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: CudaSlice<u8>,
}

impl CudaMatrix {
    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Element type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.rows * self.row_bytes
    }
}

/// An f32 vector on the device.
#[derive(Debug)]
pub struct CudaVector {
    len: usize,
    data: CudaSlice<f32>,
}

/// One layer's FFN on the device.
#[derive(Debug)]
pub struct CudaFfn {
    gate: CudaMatrix,
    up: CudaMatrix,
    down: CudaMatrix,
}

/// A `[rows, width]` f32 buffer on the device, reused across steps (it only
/// grows).
#[derive(Debug, Default)]
pub struct CudaActivations {
    rows: usize,
    width: usize,
    buf: Option<CudaSlice<f32>>,
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

/// The KV cache on the device: per layer, `[n_seq, n_head_kv, n_ctx,
/// head_dim]` f32 keys and values.
#[derive(Debug)]
pub struct CudaKvCache {
    spec: KvSpec,
    k: Vec<CudaSlice<f32>>,
    v: Vec<CudaSlice<f32>>,
}

#[derive(Default)]
struct Scratch {
    gate: CudaActivations,
    up: CudaActivations,
    hidden: CudaActivations,
    /// Last uploaded token slots (seq, pos pairs) and their device copy:
    /// every layer of a step passes the same slots.
    slots_host: Vec<i32>,
    slots_dev: Option<CudaSlice<i32>>,
    indices: Option<CudaSlice<u32>>,
}

/// The CUDA backend: one device, one stream, kernels compiled by NVRTC.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: HashMap<&'static str, CudaFunction>,
    device_name: String,
    compute_capability: (i32, i32),
    ptx_from_cache: bool,
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

enum MemKind {
    Weights,
    Kv,
    Workspace,
}

impl CudaBackend {
    /// Opens device `ordinal`: loads the driver, compiles (or loads from the
    /// cache) the kernels. Typed errors when the driver, NVRTC or the device
    /// is missing.
    pub fn new(ordinal: usize) -> Result<CudaBackend, CudaError> {
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
        let stream = ctx.default_stream();
        let device_name = ctx.name().map_err(d)?;
        let cc = ctx.compute_capability().map_err(d)?;
        let (ptx, ptx_from_cache) = module::ptx_for("dense", module::DENSE_SOURCE, cc.0, cc.1)?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(d)?;
        let mut kernels = HashMap::new();
        let names: Vec<&'static str> = SUFFIXES
            .iter()
            .flat_map(|s| {
                [
                    &*Box::leak(format!("matvec_{s}").into_boxed_str()),
                    &*Box::leak(format!("embed_{s}").into_boxed_str()),
                ]
            })
            .chain(OTHER_KERNELS.iter().copied())
            .collect();
        for name in names {
            kernels.insert(name, module.load_function(name).map_err(d)?);
        }
        Ok(CudaBackend {
            ctx,
            stream,
            kernels,
            device_name,
            compute_capability: cc,
            ptx_from_cache,
            scratch: Mutex::new(Scratch::default()),
            mem: Mutex::new(MemoryStats::default()),
        })
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

    /// Device-to-device copy bandwidth in bytes per second, counting bytes
    /// read plus bytes written (the ceiling for a memory-bound decode), as
    /// the median of `iters` copies of `bytes` bytes timed with events.
    pub fn copy_bandwidth(&self, bytes: usize, iters: usize) -> Result<f64> {
        let n = bytes / 4;
        let src = self.stream.alloc_zeros::<f32>(n).map_err(drv)?;
        let mut dst = self.stream.alloc_zeros::<f32>(n).map_err(drv)?;
        let mut times = Vec::with_capacity(iters);
        for i in 0..iters + 2 {
            let start = self
                .ctx
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(drv)?;
            let end = self
                .ctx
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(drv)?;
            start.record(&self.stream).map_err(drv)?;
            self.stream.memcpy_dtod(&src, &mut dst).map_err(drv)?;
            end.record(&self.stream).map_err(drv)?;
            end.synchronize().map_err(drv)?;
            if i >= 2 {
                times.push(start.elapsed_ms(&end).map_err(drv)? as f64 / 1e3);
            }
        }
        times.sort_by(|a, b| a.total_cmp(b));
        let t = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
        Ok(2.0 * (n * 4) as f64 / t)
    }

    /// `out[r]` = index of the largest element of row `r` of `x`, computed on
    /// the device (only the indices travel to the host).
    pub fn argmax(&self, x: &CudaActivations) -> Result<Vec<u32>> {
        let buf = x
            .buf
            .as_ref()
            .ok_or_else(|| bad("argmax of an empty buffer"))?;
        let mut idx = self.stream.alloc_zeros::<u32>(x.rows.max(1)).map_err(drv)?;
        let f = self.kernel("argmax_rows")?;
        let cfg = LaunchConfig {
            grid_dim: (x.rows as u32, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        let (px, pi) = (self.ptr(buf), self.ptr(&idx));
        let width = x.width as i32;
        let mut b = self.stream.launch_builder(f);
        b.arg(&px).arg(&width).arg(&pi);
        // SAFETY: argument types match the kernel's signature.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        let mut out = vec![0u32; x.rows];
        self.stream
            .memcpy_dtoh(&idx.slice(0..x.rows), &mut out)
            .map_err(drv)?;
        let _ = &mut idx;
        Ok(out)
    }

    /// A device buffer holding `data` as `rows` rows of `width` floats.
    pub fn upload_activations(
        &self,
        rows: usize,
        width: usize,
        data: &[f32],
    ) -> Result<CudaActivations> {
        if rows.checked_mul(width) != Some(data.len()) {
            return Err(bad("activation data does not match its shape"));
        }
        let mut a = CudaActivations::default();
        self.reshape(&mut a, rows, width)?;
        if !data.is_empty() {
            let buf = a.buf.as_mut().expect("reshape allocates");
            self.stream
                .memcpy_htod(data, &mut buf.slice_mut(0..data.len()))
                .map_err(drv)?;
        }
        Ok(a)
    }

    fn kernel(&self, name: &str) -> Result<&CudaFunction> {
        self.kernels
            .get(name)
            .ok_or_else(|| bad(format!("no kernel `{name}`")))
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        // Event tracking is off (one stream), so the guard has nothing to do.
        let (p, _guard) = s.device_ptr(&self.stream);
        p
    }

    fn account(&self, kind: MemKind, bytes: usize) {
        let mut m = self.mem.lock().unwrap_or_else(|e| e.into_inner());
        match kind {
            MemKind::Weights => m.weights += bytes,
            MemKind::Kv => m.kv_cache += bytes,
            MemKind::Workspace => m.workspace += bytes,
        }
        m.peak = m.peak.max(m.weights + m.kv_cache + m.workspace);
    }

    fn scratch(&self) -> MutexGuard<'_, Scratch> {
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets the shape of `a`, growing its buffer when needed; returns its
    /// device pointer.
    fn reshape(&self, a: &mut CudaActivations, rows: usize, width: usize) -> Result<u64> {
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

    fn act_ptr(&self, a: &CudaActivations) -> Result<u64> {
        a.buf
            .as_ref()
            .map(|b| self.ptr(b))
            .ok_or_else(|| bad("activation buffer used before it was written"))
    }

    fn upload_u32(&self, slot: &mut Option<CudaSlice<u32>>, v: &[u32]) -> Result<u64> {
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

    fn matvec(&self, w: &CudaMatrix, x: u64, n_act: usize, y: u64) -> Result<()> {
        let suffix = kernel_suffix(w.ty).ok_or_else(|| RuntimeError::UnsupportedType {
            backend: "cuda".into(),
            ty: w.ty,
            what: w.name.clone(),
        })?;
        let f = self.kernel(&format!("matvec_{suffix}"))?;
        let cfg = LaunchConfig {
            grid_dim: ((w.rows as u32).div_ceil(MATVEC_WARPS), n_act as u32, 1),
            block_dim: (32 * MATVEC_WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (pw, rb, rows, cols) = (
            self.ptr(&w.data),
            w.row_bytes as i64,
            w.rows as i32,
            w.cols as i32,
        );
        let mut b = self.stream.launch_builder(f);
        b.arg(&pw).arg(&rb).arg(&rows).arg(&cols).arg(&x).arg(&y);
        // SAFETY: argument types match the kernel; x holds n_act * cols and y
        // n_act * rows floats (callers reshape first).
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }

    fn elementwise(&self, name: &str, n: usize, args: &[u64], width: Option<i32>) -> Result<()> {
        let f = self.kernel(name)?;
        let cfg = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let n = n as i64;
        let mut b = self.stream.launch_builder(f);
        for a in args {
            b.arg(a);
        }
        if let Some(w) = &width {
            b.arg(w);
        }
        b.arg(&n);
        // SAFETY: each caller passes the kernel's pointer arguments in order.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }

    fn upload_host_matrix(&self, m: &HostMatrix) -> Result<CudaMatrix> {
        let row_bytes = quant::row_bytes(m.ty, m.cols)?;
        let bytes = m.data.as_slice();
        if bytes.len() != row_bytes * m.rows {
            return Err(bad(format!(
                "{}: {} bytes for {}x{} {}",
                m.name,
                bytes.len(),
                m.rows,
                m.cols,
                m.ty
            )));
        }
        if kernel_suffix(m.ty).is_none() {
            return Err(RuntimeError::UnsupportedType {
                backend: "cuda".into(),
                ty: m.ty,
                what: m.name.clone(),
            });
        }
        if m.cols % 32 != 0 {
            return Err(bad(format!(
                "{}: row length {} is not a multiple of 32",
                m.name, m.cols
            )));
        }
        let data = self.stream.clone_htod(bytes).map_err(drv)?;
        self.account(MemKind::Weights, bytes.len());
        Ok(CudaMatrix {
            name: m.name.clone(),
            ty: m.ty,
            rows: m.rows,
            cols: m.cols,
            row_bytes,
            data,
        })
    }

    fn slots_ptr(&self, s: &mut Scratch, slots: &[TokenSlot]) -> Result<u64> {
        let host: Vec<i32> = slots
            .iter()
            .flat_map(|t| [t.seq as i32, t.pos as i32])
            .collect();
        let reuse = s.slots_dev.is_some() && s.slots_host == host;
        if !reuse {
            if s.slots_dev.as_ref().is_none_or(|d| d.len() < host.len()) {
                s.slots_dev = Some(
                    self.stream
                        .alloc_zeros::<i32>(host.len().next_power_of_two())
                        .map_err(drv)?,
                );
            }
            let d = s.slots_dev.as_mut().expect("allocated above");
            self.stream
                .memcpy_htod(&host, &mut d.slice_mut(0..host.len()))
                .map_err(drv)?;
            s.slots_host = host;
        }
        Ok(self.ptr(s.slots_dev.as_ref().expect("set above")))
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

    fn upload_matrix(&self, m: &HostMatrix) -> Result<CudaMatrix> {
        self.upload_host_matrix(m)
    }

    fn upload_vector(&self, v: &[f32]) -> Result<CudaVector> {
        let data = self.stream.clone_htod(v).map_err(drv)?;
        self.account(MemKind::Weights, v.len() * 4);
        Ok(CudaVector { len: v.len(), data })
    }

    fn upload_ffn(
        &self,
        _layer: usize,
        gate: &HostMatrix,
        up: &HostMatrix,
        down: &HostMatrix,
    ) -> Result<CudaFfn> {
        if gate.rows != up.rows
            || gate.cols != up.cols
            || down.cols != gate.rows
            || down.rows != gate.cols
        {
            return Err(bad(format!(
                "FFN shapes disagree: gate {}x{}, up {}x{}, down {}x{}",
                gate.rows, gate.cols, up.rows, up.cols, down.rows, down.cols
            )));
        }
        Ok(CudaFfn {
            gate: self.upload_host_matrix(gate)?,
            up: self.upload_host_matrix(up)?,
            down: self.upload_host_matrix(down)?,
        })
    }

    fn new_kv_cache(&self, spec: KvSpec) -> Result<CudaKvCache> {
        if spec.dtype != KvDtype::F32 {
            return Err(bad(
                "the cuda backend keeps its KV cache in f32 only (f16 is not implemented yet)",
            ));
        }
        if spec.head_dim == 0 || spec.n_ctx == 0 || spec.n_seq == 0 {
            return Err(bad(format!("empty KV cache shape {spec:?}")));
        }
        let per_layer = spec
            .n_seq
            .checked_mul(spec.n_head_kv)
            .and_then(|x| x.checked_mul(spec.n_ctx))
            .and_then(|x| x.checked_mul(spec.head_dim))
            .ok_or_else(|| bad("KV cache size overflows"))?;
        let mut k = Vec::with_capacity(spec.n_layer);
        let mut v = Vec::with_capacity(spec.n_layer);
        for _ in 0..spec.n_layer {
            k.push(self.stream.alloc_zeros::<f32>(per_layer).map_err(drv)?);
            v.push(self.stream.alloc_zeros::<f32>(per_layer).map_err(drv)?);
        }
        self.account(MemKind::Kv, 2 * spec.n_layer * per_layer * 4);
        Ok(CudaKvCache { spec, k, v })
    }

    fn kv_truncate(&self, _cache: &mut CudaKvCache, _seq: usize, _pos: usize) {
        // Attention reads positions 0..=pos of each query row, so stale
        // entries past a truncation are never read before being rewritten.
    }

    fn new_activations(&self) -> CudaActivations {
        CudaActivations::default()
    }

    fn embed(&self, table: &CudaMatrix, tokens: &[u32], out: &mut CudaActivations) -> Result<()> {
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= table.rows) {
            return Err(bad(format!("token id {t} >= vocabulary {}", table.rows)));
        }
        let suffix = kernel_suffix(table.ty).ok_or_else(|| RuntimeError::UnsupportedType {
            backend: "cuda".into(),
            ty: table.ty,
            what: table.name.clone(),
        })?;
        let po = self.reshape(out, tokens.len(), table.cols)?;
        let mut s = self.scratch();
        let pt = self.upload_u32(&mut s.indices, tokens)?;
        let f = self.kernel(&format!("embed_{suffix}"))?;
        let cfg = LaunchConfig {
            grid_dim: (tokens.len() as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (pw, rb, nr, cols) = (
            self.ptr(&table.data),
            table.row_bytes as i64,
            table.rows as i32,
            table.cols as i32,
        );
        let mut b = self.stream.launch_builder(f);
        b.arg(&pw).arg(&rb).arg(&nr).arg(&cols).arg(&pt).arg(&po);
        // SAFETY: argument types match; token ids checked above.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
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
        let pw = self.ptr(&weight.data);
        let width = x.width as i32;
        let f = self.kernel("rms_norm")?;
        let cfg = LaunchConfig {
            grid_dim: (x.rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(f);
        b.arg(&px).arg(&pw).arg(&eps).arg(&width).arg(&po);
        // SAFETY: argument types match the kernel.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
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

    fn add_bias(&self, x: &mut CudaActivations, bias: &CudaVector) -> Result<()> {
        if bias.len != x.width {
            return Err(bad("bias width"));
        }
        let px = self.act_ptr(x)?;
        self.elementwise(
            "add_bias",
            x.rows * x.width,
            &[px, self.ptr(&bias.data)],
            Some(x.width as i32),
        )
    }

    fn add(&self, acc: &mut CudaActivations, x: &CudaActivations) -> Result<()> {
        if acc.rows != x.rows || acc.width != x.width {
            return Err(bad("residual shapes differ"));
        }
        let (pa, px) = (self.act_ptr(acc)?, self.act_ptr(x)?);
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
        let hd = p.head_dim;
        let n = slots.len();
        if p.n_head_kv == 0
            || p.n_head % p.n_head_kv != 0
            || hd % 64 != 0
            || hd > ATTEND_THREADS as usize
        {
            return Err(bad(format!("attention shape {p:?} (the cuda kernels need head_dim a multiple of 64, at most 512)")));
        }
        if q.rows != n
            || k.rows != n
            || v.rows != n
            || q.width != p.n_head * hd
            || k.width != p.n_head_kv * hd
            || v.width != k.width
        {
            return Err(bad("attention inputs do not match the batch"));
        }
        let spec = cache.spec;
        if spec.head_dim != hd || spec.n_head_kv != p.n_head_kv || layer >= spec.n_layer {
            return Err(bad("KV cache shape does not match the layer"));
        }
        let max_pos = slots.iter().map(|s| s.pos).max().unwrap_or(0);
        if max_pos >= spec.n_ctx {
            return Err(RuntimeError::ContextFull { n_ctx: spec.n_ctx });
        }
        if let Some(s) = slots.iter().find(|s| s.seq >= spec.n_seq) {
            return Err(bad(format!("sequence slot {} >= {}", s.seq, spec.n_seq)));
        }
        let smem = (max_pos + 1 + hd + ATTEND_THREADS as usize) * 4;
        if smem > 48 * 1024 {
            return Err(bad(format!(
                "position {max_pos}: the cuda attention kernel holds at most {} scores",
                48 * 1024 / 4 - hd - ATTEND_THREADS as usize
            )));
        }
        let mut s = self.scratch();
        let pslots = self.slots_ptr(&mut s, slots)?;
        drop(s);
        let (pq, pk, pv) = (self.act_ptr(q)?, self.act_ptr(k)?, self.act_ptr(v)?);
        let (pqn, pkn) = match &qk_norm {
            Some(nm) => (self.ptr(&nm.q.data), self.ptr(&nm.k.data)),
            None => (0u64, 0u64),
        };
        let (pkc, pvc) = (self.ptr(&cache.k[layer]), self.ptr(&cache.v[layer]));
        let (nh, nkv, hdi, neox) = (
            p.n_head as i32,
            p.n_head_kv as i32,
            hd as i32,
            (p.rope_mode == RopeMode::Neox) as i32,
        );
        let (base, eps, n_ctx) = (p.rope_freq_base, p.norm_eps, spec.n_ctx as i32);
        {
            let f = self.kernel("rope_store")?;
            let cfg = LaunchConfig {
                grid_dim: (n as u32, (p.n_head + p.n_head_kv) as u32, 1),
                block_dim: ((hd / 2) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self.stream.launch_builder(f);
            b.arg(&pq)
                .arg(&pk)
                .arg(&pv)
                .arg(&pslots)
                .arg(&nh)
                .arg(&nkv)
                .arg(&hdi)
                .arg(&neox)
                .arg(&base);
            b.arg(&pqn)
                .arg(&pkn)
                .arg(&eps)
                .arg(&pkc)
                .arg(&pvc)
                .arg(&n_ctx);
            // SAFETY: argument types match; shapes and slots checked above.
            unsafe { b.launch(cfg) }.map_err(drv)?;
        }
        let po = self.reshape(out, n, p.n_head * hd)?;
        let scale = 1.0 / (hd as f32).sqrt();
        let f = self.kernel("attend")?;
        let cfg = LaunchConfig {
            grid_dim: (n as u32, p.n_head as u32, 1),
            block_dim: (ATTEND_THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let mut b = self.stream.launch_builder(f);
        b.arg(&pq)
            .arg(&pkc)
            .arg(&pvc)
            .arg(&pslots)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hdi)
            .arg(&n_ctx)
            .arg(&scale)
            .arg(&po);
        // SAFETY: as above; dynamic shared memory sized for max_pos + 1 scores.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }

    fn ffn(&self, f: &CudaFfn, x: &CudaActivations, out: &mut CudaActivations) -> Result<()> {
        if x.width != f.gate.cols {
            return Err(bad(format!(
                "ffn input width {} != {}",
                x.width, f.gate.cols
            )));
        }
        let n = x.rows;
        let n_ff = f.gate.rows;
        let px = self.act_ptr(x)?;
        let mut s = self.scratch();
        let s = &mut *s;
        let pg = self.reshape(&mut s.gate, n, n_ff)?;
        let pu = self.reshape(&mut s.up, n, n_ff)?;
        let ph = self.reshape(&mut s.hidden, n, n_ff)?;
        self.matvec(&f.gate, px, n, pg)?;
        self.matvec(&f.up, px, n, pu)?;
        self.elementwise("swiglu", n * n_ff, &[pg, pu, ph], None)?;
        let po = self.reshape(out, n, f.down.rows)?;
        self.matvec(&f.down, ph, n, po)
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
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let mut s = self.scratch();
        let pi = self.upload_u32(&mut s.indices, &idx)?;
        let f = self.kernel("gather_rows")?;
        let cfg = LaunchConfig {
            grid_dim: (rows.len() as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let width = x.width as i32;
        let mut b = self.stream.launch_builder(f);
        b.arg(&px).arg(&pi).arg(&width).arg(&po);
        // SAFETY: argument types match; rows checked above.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
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
