//! The CPU backend: the always-built reference implementation.
//!
//! Matrix products run straight on the quantized ggml blocks: each
//! activation row is quantized once into the weight's `vec_dot_type`, then
//! every weight row is dotted with it by the SIMD kernel of
//! [`mirage_gguf::quant::dot_fn`]. Weight rows are split into chunks over a
//! rayon pool; for a batch of rows (prefill) each weight row is dotted with
//! all activation rows while it is hot in L1, so weights are read once per
//! batch, not once per token. Gate and up of the FFN are computed in one
//! pass (same rows, same quantized input) with SwiGLU fused in.
//!
//! Scratch buffers live in the backend and in [`CpuActivations`] and are
//! reused between steps, so a decode step allocates (almost) nothing.

use std::sync::{Mutex, MutexGuard};

use mirage_gguf::quant::{self, DotFn};
use mirage_gguf::GgmlType;
use rayon::prelude::*;

use super::{AttentionParams, Backend, HostMatrix, QkNorm, SharedBytes, TokenSlot};
use crate::error::{Result, RuntimeError};
use crate::kv_cache::{KvCache, KvSpec};
use crate::ops;

/// A quantized weight matrix, memory-mapped (zero copy).
#[derive(Debug)]
pub struct CpuMatrix {
    name: String,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    act_ty: GgmlType,
    dot: DotFn,
    data: SharedBytes,
}

impl CpuMatrix {
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
    fn row(&self, r: usize) -> &[u8] {
        &self.data.as_slice()[r * self.row_bytes..(r + 1) * self.row_bytes]
    }
}

/// One layer's FFN on the CPU.
#[derive(Debug)]
pub struct CpuFfn {
    gate: CpuMatrix,
    up: CpuMatrix,
    down: CpuMatrix,
}

/// A row-major `[rows, width]` f32 buffer whose allocation is reused.
#[derive(Debug, Default, Clone)]
pub struct CpuActivations {
    rows: usize,
    width: usize,
    data: Vec<f32>,
}

impl CpuActivations {
    /// A buffer holding `data` as `rows` rows.
    pub fn from_vec(rows: usize, width: usize, data: Vec<f32>) -> Result<CpuActivations> {
        if rows.checked_mul(width) != Some(data.len()) {
            return Err(RuntimeError::InvalidArgument("activation data does not match its shape".into()));
        }
        Ok(CpuActivations { rows, width, data })
    }
    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Row width.
    pub fn width(&self) -> usize {
        self.width
    }
    /// All rows.
    pub fn data(&self) -> &[f32] {
        &self.data[..self.rows * self.width]
    }
    /// One row.
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.width..(r + 1) * self.width]
    }
    fn reshape(&mut self, rows: usize, width: usize) {
        self.rows = rows;
        self.width = width;
        self.data.resize(rows * width, 0.0);
    }
    fn data_mut(&mut self) -> &mut [f32] {
        let n = self.rows * self.width;
        &mut self.data[..n]
    }
}

#[derive(Default)]
struct Scratch {
    act_q: Vec<u8>,
    hidden: Vec<f32>,
    hidden_q: Vec<u8>,
    transposed: Vec<f32>,
    rope_cos: Vec<f32>,
    rope_sin: Vec<f32>,
    rope_key: (usize, u32, usize),
    act_by_type: Vec<(GgmlType, usize, Vec<u8>)>,
}

/// The CPU backend. Holds its own rayon pool so that `--threads` is honoured
/// without touching the global pool.
pub struct CpuBackend {
    pool: rayon::ThreadPool,
    threads: usize,
    f32_activations: bool,
    scratch: Mutex<Scratch>,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CpuBackend {{ threads: {} }}", self.threads)
    }
}

impl CpuBackend {
    /// A backend with `threads` worker threads (0: one per logical CPU).
    pub fn new(threads: usize) -> Result<CpuBackend> {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
        } else {
            threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("mirage-cpu-{i}"))
            .build()
            .map_err(|e| RuntimeError::InvalidArgument(format!("cannot start {threads} threads: {e}")))?;
        Ok(CpuBackend { pool, threads, f32_activations: false, scratch: Mutex::new(Scratch::default()) })
    }

    /// A backend that keeps activations in f32 and dequantizes each weight
    /// row before its dot product. Much slower; it computes what HF
    /// transformers computes on dequantized weights, so tests can separate
    /// graph errors from activation-quantization noise.
    pub fn new_f32_activations(threads: usize) -> Result<CpuBackend> {
        let mut b = CpuBackend::new(threads)?;
        b.f32_activations = true;
        Ok(b)
    }

    /// Worker threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    fn scratch(&self) -> MutexGuard<'_, Scratch> {
        // A panic in another op poisons the lock; the scratch is plain
        // buffers, so the data is still usable.
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rows per parallel task: a few tasks per thread for load balance, but
    /// not so small that task overhead shows.
    fn chunk_rows(&self, rows: usize) -> usize {
        rows.div_ceil(self.threads * 4).max(4)
    }

    fn make_matrix(&self, m: &HostMatrix) -> Result<CpuMatrix> {
        let unsupported = |what: &str| RuntimeError::UnsupportedType {
            backend: "cpu".into(),
            ty: m.ty,
            what: format!("{}: {what}", m.name),
        };
        let row_bytes = quant::row_bytes(m.ty, m.cols)?;
        if m.data.as_slice().len() != row_bytes * m.rows {
            return Err(RuntimeError::InvalidArgument(format!(
                "{}: {} bytes for {}x{} {}",
                m.name,
                m.data.as_slice().len(),
                m.rows,
                m.cols,
                m.ty
            )));
        }
        let (act_ty, dot) = if self.f32_activations {
            (GgmlType::F32, dequantizing_dot_fn(m.ty))
        } else {
            (quant::vec_dot_type(m.ty), quant::dot_fn(m.ty).ok_or_else(|| unsupported("no dot kernel"))?)
        };
        quant::row_bytes(act_ty, m.cols).map_err(|_| unsupported("row length not a block multiple"))?;
        Ok(CpuMatrix {
            name: m.name.clone(),
            ty: m.ty,
            rows: m.rows,
            cols: m.cols,
            row_bytes,
            act_ty,
            dot,
            data: m.data.clone(),
        })
    }
}

/// Dequantizes `n` weights of type `T` and dots them with f32 activations.
///
/// # Safety
/// Same contract as [`DotFn`] with F32 activations.
unsafe fn dequantizing_dot<const T: u32>(n: usize, w: &[u8], act: &[u8]) -> f32 {
    thread_local! {
        static ROW: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let Some(ty) = GgmlType::from_id(T) else { return f32::NAN };
    let Ok(bytes) = quant::row_bytes(ty, n) else { return f32::NAN };
    ROW.with_borrow_mut(|row| {
        row.resize(n, 0.0);
        if quant::dequantize(ty, &w[..bytes], row).is_err() {
            return f32::NAN;
        }
        let mut sum = 0.0f64;
        for (x, a) in row.iter().zip(act.chunks_exact(4)) {
            sum += *x as f64 * f32::from_le_bytes([a[0], a[1], a[2], a[3]]) as f64;
        }
        sum as f32
    })
}

fn dequantizing_dot_fn(ty: GgmlType) -> DotFn {
    use GgmlType::*;
    match ty {
        F32 => dequantizing_dot::<{ F32 as u32 }>,
        F16 => dequantizing_dot::<{ F16 as u32 }>,
        BF16 => dequantizing_dot::<{ BF16 as u32 }>,
        Q4_0 => dequantizing_dot::<{ Q4_0 as u32 }>,
        Q4_1 => dequantizing_dot::<{ Q4_1 as u32 }>,
        Q5_0 => dequantizing_dot::<{ Q5_0 as u32 }>,
        Q5_1 => dequantizing_dot::<{ Q5_1 as u32 }>,
        Q8_0 => dequantizing_dot::<{ Q8_0 as u32 }>,
        Q8_1 => dequantizing_dot::<{ Q8_1 as u32 }>,
        Q2_K => dequantizing_dot::<{ Q2_K as u32 }>,
        Q3_K => dequantizing_dot::<{ Q3_K as u32 }>,
        Q4_K => dequantizing_dot::<{ Q4_K as u32 }>,
        Q5_K => dequantizing_dot::<{ Q5_K as u32 }>,
        Q6_K => dequantizing_dot::<{ Q6_K as u32 }>,
        Q8_K => dequantizing_dot::<{ Q8_K as u32 }>,
    }
}

/// Quantizes each of `n` rows of `x` (width `cols`) into `ty`, into `dst`.
fn quantize_rows(ty: GgmlType, x: &[f32], n: usize, cols: usize, dst: &mut Vec<u8>) -> Result<usize> {
    let rb = quant::row_bytes(ty, cols)?;
    dst.resize(rb * n, 0);
    for r in 0..n {
        quant::quantize(ty, &x[r * cols..(r + 1) * cols], &mut dst[r * rb..(r + 1) * rb])?;
    }
    Ok(rb)
}

/// `out[a * w.rows + r] = w_r . act_a` for `n_act` quantized activation rows.
#[allow(clippy::too_many_arguments)]
fn matmul_quantized(
    pool: &rayon::ThreadPool,
    chunk: usize,
    w: &CpuMatrix,
    act: &[u8],
    act_row_bytes: usize,
    n_act: usize,
    out: &mut [f32],
    transposed: &mut Vec<f32>,
) {
    let dot = w.dot;
    let cols = w.cols;
    if n_act == 1 {
        pool.install(|| {
            out.par_chunks_mut(chunk).enumerate().for_each(|(ci, o)| {
                let r0 = ci * chunk;
                for (i, o) in o.iter_mut().enumerate() {
                    // SAFETY: make_matrix checked that rows hold `cols`
                    // elements of w.ty and quantize_rows wrote `cols`
                    // elements of vec_dot_type(w.ty).
                    *o = unsafe { dot(cols, w.row(r0 + i), act) };
                }
            })
        });
        return;
    }
    transposed.resize(w.rows * n_act, 0.0);
    pool.install(|| {
        transposed.par_chunks_mut(chunk * n_act).enumerate().for_each(|(ci, o)| {
            let r0 = ci * chunk;
            for (i, o) in o.chunks_mut(n_act).enumerate() {
                let wr = w.row(r0 + i);
                for (a, o) in o.iter_mut().enumerate() {
                    // SAFETY: as above, per activation row.
                    *o = unsafe { dot(cols, wr, &act[a * act_row_bytes..(a + 1) * act_row_bytes]) };
                }
            }
        })
    });
    for r in 0..w.rows {
        for a in 0..n_act {
            out[a * w.rows + r] = transposed[r * n_act + a];
        }
    }
}

impl Backend for CpuBackend {
    type Matrix = CpuMatrix;
    type Vector = Vec<f32>;
    type Ffn = CpuFfn;
    type Activations = CpuActivations;
    type KvCache = KvCache;

    fn name(&self) -> String {
        "cpu".into()
    }

    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    fn upload_matrix(&self, m: &HostMatrix) -> Result<CpuMatrix> {
        self.make_matrix(m)
    }

    fn upload_vector(&self, v: &[f32]) -> Result<Vec<f32>> {
        Ok(v.to_vec())
    }

    fn upload_ffn(&self, _layer: usize, gate: &HostMatrix, up: &HostMatrix, down: &HostMatrix) -> Result<CpuFfn> {
        let (gate, up, down) = (self.make_matrix(gate)?, self.make_matrix(up)?, self.make_matrix(down)?);
        if gate.rows != up.rows || gate.cols != up.cols || down.cols != gate.rows || down.rows != gate.cols {
            return Err(RuntimeError::InvalidArgument(format!(
                "FFN shapes disagree: gate {}x{}, up {}x{}, down {}x{}",
                gate.rows, gate.cols, up.rows, up.cols, down.rows, down.cols
            )));
        }
        Ok(CpuFfn { gate, up, down })
    }

    fn new_kv_cache(&self, spec: KvSpec) -> Result<KvCache> {
        KvCache::new(spec)
    }

    fn kv_truncate(&self, cache: &mut KvCache, seq: usize, pos: usize) {
        cache.truncate(seq, pos);
    }

    fn new_activations(&self) -> CpuActivations {
        CpuActivations::default()
    }

    fn embed(&self, table: &CpuMatrix, tokens: &[u32], out: &mut CpuActivations) -> Result<()> {
        out.reshape(tokens.len(), table.cols);
        let cols = table.cols;
        for (r, &t) in tokens.iter().enumerate() {
            let t = t as usize;
            if t >= table.rows {
                return Err(RuntimeError::InvalidArgument(format!("token id {t} >= vocabulary {}", table.rows)));
            }
            quant::dequantize(table.ty, table.row(t), &mut out.data[r * cols..(r + 1) * cols])?;
        }
        Ok(())
    }

    fn rms_norm(&self, x: &CpuActivations, weight: &Vec<f32>, eps: f32, out: &mut CpuActivations) -> Result<()> {
        if weight.len() != x.width {
            return Err(RuntimeError::InvalidArgument("norm weight width".into()));
        }
        out.reshape(x.rows, x.width);
        for r in 0..x.rows {
            let w = x.width;
            ops::rms_norm(x.row(r), weight, eps, &mut out.data[r * w..(r + 1) * w]);
        }
        Ok(())
    }

    fn matmul(&self, w: &CpuMatrix, x: &CpuActivations, out: &mut CpuActivations) -> Result<()> {
        if x.width != w.cols {
            return Err(RuntimeError::InvalidArgument(format!("{}: input width {} != {}", w.name, x.width, w.cols)));
        }
        out.reshape(x.rows, w.rows);
        let mut s = self.scratch();
        let s = &mut *s;
        let rb = quantize_rows(w.act_ty, x.data(), x.rows, w.cols, &mut s.act_q)?;
        let chunk = self.chunk_rows(w.rows);
        matmul_quantized(&self.pool, chunk, w, &s.act_q, rb, x.rows, out.data_mut(), &mut s.transposed);
        Ok(())
    }

    fn matmul_many(&self, ws: &[&CpuMatrix], x: &CpuActivations, outs: &mut [&mut CpuActivations]) -> Result<()> {
        if ws.len() != outs.len() {
            return Err(RuntimeError::InvalidArgument("matmul_many: one output per matrix".into()));
        }
        if let Some(w) = ws.iter().find(|w| w.cols != x.width) {
            return Err(RuntimeError::InvalidArgument(format!("{}: input width {} != {}", w.name, x.width, w.cols)));
        }
        let n = x.rows;
        let mut s = self.scratch();
        let s = &mut *s;
        // One quantization of x per activation encoding in use.
        for e in s.act_by_type.iter_mut() {
            e.1 = 0;
        }
        let mut which = Vec::with_capacity(ws.len());
        for w in ws {
            let idx = match s.act_by_type.iter().position(|e| e.0 == w.act_ty && e.1 != 0) {
                Some(i) => i,
                None => {
                    let slot = match s.act_by_type.iter().position(|e| e.1 == 0) {
                        Some(i) => i,
                        None => {
                            s.act_by_type.push((w.act_ty, 0, Vec::new()));
                            s.act_by_type.len() - 1
                        }
                    };
                    let e = &mut s.act_by_type[slot];
                    e.0 = w.act_ty;
                    e.1 = quantize_rows(w.act_ty, x.data(), n, w.cols, &mut e.2)?;
                    slot
                }
            };
            which.push(idx);
        }
        // One parallel pass over the concatenated rows, written weight-row
        // major ([total_rows, n]) and scattered to the outputs after.
        let offsets: Vec<usize> = ws.iter().scan(0, |o, w| {
            let start = *o;
            *o += w.rows;
            Some(start)
        }).collect();
        let total: usize = ws.iter().map(|w| w.rows).sum();
        s.transposed.resize(total * n, 0.0);
        let chunk = self.chunk_rows(total);
        let acts = &s.act_by_type;
        self.pool.install(|| {
            s.transposed.par_chunks_mut(chunk * n).enumerate().for_each(|(ci, o)| {
                let r0 = ci * chunk;
                for (i, o) in o.chunks_mut(n).enumerate() {
                    let g = r0 + i;
                    let m = offsets.partition_point(|&off| off <= g) - 1;
                    let (w, e) = (ws[m], &acts[which[m]]);
                    let wr = w.row(g - offsets[m]);
                    for (a, o) in o.iter_mut().enumerate() {
                        // SAFETY: shapes checked at upload and above; each
                        // activation row is quantized as w's vec_dot_type.
                        *o = unsafe { (w.dot)(w.cols, wr, &e.2[a * e.1..(a + 1) * e.1]) };
                    }
                }
            })
        });
        for ((w, out), &off) in ws.iter().zip(outs.iter_mut()).zip(&offsets) {
            out.reshape(n, w.rows);
            let od = out.data_mut();
            for r in 0..w.rows {
                for a in 0..n {
                    od[a * w.rows + r] = s.transposed[(off + r) * n + a];
                }
            }
        }
        Ok(())
    }

    fn add_bias(&self, x: &mut CpuActivations, bias: &Vec<f32>) -> Result<()> {
        if bias.len() != x.width {
            return Err(RuntimeError::InvalidArgument("bias width".into()));
        }
        let w = x.width;
        for row in x.data_mut().chunks_mut(w) {
            for (v, b) in row.iter_mut().zip(bias) {
                *v += b;
            }
        }
        Ok(())
    }

    fn add(&self, acc: &mut CpuActivations, x: &CpuActivations) -> Result<()> {
        if acc.rows != x.rows || acc.width != x.width {
            return Err(RuntimeError::InvalidArgument("residual shapes differ".into()));
        }
        for (a, b) in acc.data_mut().iter_mut().zip(x.data()) {
            *a += b;
        }
        Ok(())
    }

    fn attention(
        &self,
        layer: usize,
        p: &AttentionParams,
        q: &mut CpuActivations,
        k: &mut CpuActivations,
        v: &CpuActivations,
        qk_norm: Option<QkNorm<'_, Vec<f32>>>,
        slots: &[TokenSlot],
        cache: &mut KvCache,
        out: &mut CpuActivations,
    ) -> Result<()> {
        let hd = p.head_dim;
        let n = slots.len();
        if p.n_head_kv == 0 || p.n_head % p.n_head_kv != 0 || hd % 2 != 0 {
            return Err(RuntimeError::InvalidArgument(format!("bad attention shape {p:?}")));
        }
        if q.rows != n || k.rows != n || v.rows != n || q.width != p.n_head * hd || k.width != p.n_head_kv * hd || v.width != k.width {
            return Err(RuntimeError::InvalidArgument("attention inputs do not match the batch".into()));
        }
        let spec = *cache.spec();
        if spec.head_dim != hd || spec.n_head_kv != p.n_head_kv {
            return Err(RuntimeError::InvalidArgument("KV cache shape does not match the layer".into()));
        }
        let max_pos = slots.iter().map(|s| s.pos).max().unwrap_or(0);
        if max_pos >= spec.n_ctx {
            return Err(RuntimeError::ContextFull { n_ctx: spec.n_ctx });
        }
        if let Some(s) = slots.iter().find(|s| s.seq >= spec.n_seq) {
            return Err(RuntimeError::InvalidArgument(format!("sequence slot {} >= {}", s.seq, spec.n_seq)));
        }
        let mut s = self.scratch();
        let s = &mut *s;
        // Rotary tables for positions 0..=max_pos, rebuilt only when the
        // shape changes or positions grow.
        let half = hd / 2;
        let key = (hd, p.rope_freq_base.to_bits(), 0);
        if s.rope_key.0 != key.0 || s.rope_key.1 != key.1 || s.rope_key.2 <= max_pos {
            let n_pos = (max_pos + 1).next_power_of_two().max(64).min(spec.n_ctx.max(max_pos + 1));
            s.rope_cos.clear();
            s.rope_sin.clear();
            for pos in 0..n_pos {
                let a = ops::RopeAngles::new(pos, hd, p.rope_freq_base);
                s.rope_cos.extend_from_slice(&a.cos);
                s.rope_sin.extend_from_slice(&a.sin);
            }
            s.rope_key = (hd, key.1, n_pos);
        }
        let mut angles = ops::RopeAngles { cos: vec![0.0; half], sin: vec![0.0; half] };
        let (qw, kw) = (q.width, k.width);
        for (i, slot) in slots.iter().enumerate() {
            angles.cos.copy_from_slice(&s.rope_cos[slot.pos * half..(slot.pos + 1) * half]);
            angles.sin.copy_from_slice(&s.rope_sin[slot.pos * half..(slot.pos + 1) * half]);
            for head in q.data[i * qw..(i + 1) * qw].chunks_mut(hd) {
                if let Some(n) = &qk_norm {
                    ops::rms_norm_in_place(head, n.q, p.norm_eps);
                }
                ops::rope_in_place(head, &angles, p.rope_mode);
            }
            for head in k.data[i * kw..(i + 1) * kw].chunks_mut(hd) {
                if let Some(n) = &qk_norm {
                    ops::rms_norm_in_place(head, n.k, p.norm_eps);
                }
                ops::rope_in_place(head, &angles, p.rope_mode);
            }
            cache.write(layer, slot.seq, slot.pos, k.row(i), v.row(i))?;
        }
        out.reshape(n, p.n_head * hd);
        let group = p.n_head / p.n_head_kv;
        let scale = 1.0 / (hd as f32).sqrt();
        let cache = &*cache;
        let q = &*q;
        self.pool.install(|| {
            out.data_mut().par_chunks_mut(hd).enumerate().for_each_init(
                || vec![0.0f32; max_pos + 1],
                |scores, (idx, o)| {
                    let (row, head) = (idx / p.n_head, idx % p.n_head);
                    let slot = slots[row];
                    let qh = &q.data[row * qw + head * hd..row * qw + (head + 1) * hd];
                    cache.attend(layer, slot.seq, head / group, slot.pos + 1, qh, scale, scores, o);
                },
            )
        });
        Ok(())
    }

    fn ffn(&self, f: &CpuFfn, x: &CpuActivations, out: &mut CpuActivations) -> Result<()> {
        let n_embd = f.gate.cols;
        if x.width != n_embd {
            return Err(RuntimeError::InvalidArgument(format!("ffn input width {} != {n_embd}", x.width)));
        }
        let n = x.rows;
        let n_ff = f.gate.rows;
        let mut s = self.scratch();
        let s = &mut *s;
        // Gate and up share their input; quantize it once when they share
        // the activation encoding (they do in every llama.cpp mix).
        let rb_g = quantize_rows(f.gate.act_ty, x.data(), n, n_embd, &mut s.act_q)?;
        let mut up_q = Vec::new();
        let (rb_u, up_act): (usize, &[u8]) = if f.up.act_ty == f.gate.act_ty {
            (rb_g, &s.act_q)
        } else {
            let rb = quantize_rows(f.up.act_ty, x.data(), n, n_embd, &mut up_q)?;
            (rb, &up_q)
        };
        let gate_act: &[u8] = &s.act_q;
        // hidden is [n_ff, n] (weight-row major) so that each task owns a
        // contiguous block; transposed below when n > 1.
        s.hidden.resize(n_ff * n, 0.0);
        let chunk = self.chunk_rows(n_ff);
        let (gd, ud) = (f.gate.dot, f.up.dot);
        self.pool.install(|| {
            s.hidden.par_chunks_mut(chunk * n).enumerate().for_each(|(ci, o)| {
                let r0 = ci * chunk;
                for (i, o) in o.chunks_mut(n).enumerate() {
                    let (gr, ur) = (f.gate.row(r0 + i), f.up.row(r0 + i));
                    for (a, o) in o.iter_mut().enumerate() {
                        // SAFETY: shapes checked at upload; activations
                        // quantized with each matrix's vec_dot_type.
                        let g = unsafe { gd(n_embd, gr, &gate_act[a * rb_g..(a + 1) * rb_g]) };
                        let u = unsafe { ud(n_embd, ur, &up_act[a * rb_u..(a + 1) * rb_u]) };
                        *o = ops::silu(g) * u;
                    }
                }
            })
        });
        let hidden_rows: &[f32] = if n == 1 {
            &s.hidden
        } else {
            s.transposed.resize(n_ff * n, 0.0);
            for j in 0..n_ff {
                for a in 0..n {
                    s.transposed[a * n_ff + j] = s.hidden[j * n + a];
                }
            }
            &s.transposed
        };
        let rb_d = quantize_rows(f.down.act_ty, hidden_rows, n, n_ff, &mut s.hidden_q)?;
        out.reshape(n, f.down.rows);
        let chunk = self.chunk_rows(f.down.rows);
        matmul_quantized(&self.pool, chunk, &f.down, &s.hidden_q, rb_d, n, out.data_mut(), &mut s.hidden);
        Ok(())
    }

    fn select_rows(&self, x: &CpuActivations, rows: &[usize], out: &mut CpuActivations) -> Result<()> {
        if let Some(&r) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(RuntimeError::InvalidArgument(format!("row {r} >= {}", x.rows)));
        }
        out.reshape(rows.len(), x.width);
        let w = x.width;
        for (i, &r) in rows.iter().enumerate() {
            out.data[i * w..(i + 1) * w].copy_from_slice(x.row(r));
        }
        Ok(())
    }

    fn read(&self, x: &CpuActivations, out: &mut Vec<f32>) -> Result<(usize, usize)> {
        out.clear();
        out.extend_from_slice(x.data());
        Ok((x.rows, x.width))
    }
}
