//! The CPU backend: the always-built reference implementation.
//!
//! Matrix products run straight on the quantized ggml blocks: each
//! activation row is quantized once into the weight's `vec_dot_type`, then
//! every weight row is dotted with it by the SIMD kernels of
//! [`mirage_gguf::quant`]. Weight rows are split into chunks over a rayon
//! pool. For a batch of rows (prefill) each weight row is dotted with 4
//! activation rows per call of the multi-row kernel
//! ([`mirage_gguf::quant::dot_rows_fn`]), which unpacks each weight block
//! once per 4 tokens; the row stays in L1 across the groups, so weights are
//! read from memory once per batch, not once per token. The types of the
//! llama.cpp Q4_K_M / Q5_K_M mixes (Q4_K, Q5_K, Q6_K, Q8_0, Q5_0, Q4_0) go
//! further (when the CPU has AVX2, best with AVX-512 VNNI): a batch's
//! activations are quantized (Q8_K or Q8_0) and packed once per product,
//! 8 tokens per pool task ([`mirage_gguf::quant::pack_rows`]), and each
//! task runs the tiled GEMM kernel ([`mirage_gguf::quant::GemmIsa`]) over
//! its contiguous weight rows; a single token goes through the type's
//! matrix-vector kernel where there is one. Row chunks are multiples of 8
//! (the kernels' row tiles). Gate and up of the
//! FFN are computed in one pass (same rows, same quantized input) with
//! SwiGLU fused in.
//!
//! Exact mode ([`CpuBackend::new_f32_activations`]) keeps activations in
//! f32 and dequantizes each weight row once per product, then dots it with
//! every token row in f32: what HF transformers computes on the dequantized
//! GGUF, at prefill cost close to the quantized path's.
//!
//! Deterministic mode ([`Backend::set_deterministic`]) computes every
//! (weight row, activation row) pair with the one-row kernel, so a row's
//! result is the same bits whatever else is in the batch; activations,
//! attention and norms are per row anyway.
//!
//! Scratch buffers live in the backend, in per-worker thread locals and in
//! [`CpuActivations`], and are reused between steps, so a decode step
//! allocates (almost) nothing.

use std::sync::{Mutex, MutexGuard};

use mirage_gguf::quant;
use mirage_gguf::GgmlType;
use rayon::prelude::*;

use super::{
    AttentionOptions, AttentionParams, Backend, FfnActivation, HostMatrix, InputShape, QkNorm,
    TokenSlot,
};
use crate::error::{Result, RuntimeError};
use crate::kv_cache::{KvCache, KvSpec};
use crate::ops;

mod activations;
mod matrix;
mod parallel;
mod rope_table;
#[cfg(test)]
mod tests;

pub use activations::CpuActivations;
pub use matrix::{CpuFfn, CpuMatrix};

use matrix::ActRows;
use parallel::{matmul_rows, pack_rows, quantize_rows, transpose_par, ROW_SCRATCH};
use rope_table::{rope_table, RopeTable};

#[derive(Default)]
struct Scratch {
    act_q: Vec<u8>,
    hidden: Vec<f32>,
    hidden_q: Vec<u8>,
    transposed: Vec<f32>,
    rope_tables: Vec<RopeTable>,
    /// Encodings of one input for `matmul_many`: (type, packed for the
    /// GEMM kernel, row bytes or 0 when free, bytes).
    act_by_type: Vec<(GgmlType, bool, usize, Vec<u8>)>,
    /// Staging of the FFN's down product (`hidden`/`transposed` hold its input).
    down_staging: Vec<f32>,
}

/// The CPU backend. Holds its own rayon pool so that `--threads` is honoured
/// without touching the global pool.
pub struct CpuBackend {
    pool: rayon::ThreadPool,
    threads: usize,
    f32_activations: bool,
    deterministic: bool,
    scratch: Mutex<Scratch>,
    /// Held by the thread that runs a forward pass in the pool (see
    /// [`Backend::run`]).
    pass: Mutex<()>,
    /// KV-page pruning of decode attention (off when `None`).
    kv_pruning: Option<crate::kv_pages::KvPruning>,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CpuBackend {{ threads: {} }}", self.threads)
    }
}

impl CpuBackend {
    /// A backend with `threads` worker threads (0: one per CPU this process
    /// may use, `std::thread::available_parallelism`); more than that is refused.
    pub fn new(threads: usize) -> Result<CpuBackend> {
        let cpus = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        // More workers than CPUs only take turns: refused rather than
        // silently slower (llama.cpp would run them).
        if threads > cpus {
            return Err(RuntimeError::InvalidArgument(format!(
                "{threads} threads asked for, but this process may use {cpus} CPUs (0: one thread per CPU)"
            )));
        }
        let threads = if threads == 0 { cpus } else { threads };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("mirage-cpu-{i}"))
            .build()
            .map_err(|e| {
                RuntimeError::InvalidArgument(format!("cannot start {threads} threads: {e}"))
            })?;
        Ok(CpuBackend {
            pool,
            threads,
            f32_activations: false,
            deterministic: false,
            scratch: Mutex::new(Scratch::default()),
            pass: Mutex::new(()),
            kv_pruning: None,
        })
    }

    /// A backend that keeps activations in f32 and dequantizes each weight
    /// row once per matrix product, dotting it with every token row in f32.
    /// It computes what HF transformers computes on the dequantized weights
    /// (so tests can separate graph errors from activation-quantization
    /// noise); prefill is a few times slower than the quantized path, decode
    /// much slower (a full dequantization per token).
    pub fn new_f32_activations(threads: usize) -> Result<CpuBackend> {
        let mut b = CpuBackend::new(threads)?;
        b.f32_activations = true;
        Ok(b)
    }

    /// Worker threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Prunes decode attention to the KV pages `cfg` selects (see
    /// [`crate::kv_pages`]); caches made afterwards keep page summaries.
    pub fn with_kv_pruning(mut self, cfg: crate::kv_pages::KvPruning) -> Result<CpuBackend> {
        cfg.validate()?;
        self.kv_pruning = Some(cfg);
        Ok(self)
    }

    fn scratch(&self) -> MutexGuard<'_, Scratch> {
        // A panic in another op poisons the lock; the scratch is plain
        // buffers, so the data is still usable.
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rows per parallel task: a few tasks per thread for load balance, but
    /// not so small that task overhead shows.
    fn chunk_rows(&self, rows: usize) -> usize {
        // A multiple of 8: the matrix-vector kernel's row tile (and twice
        // the GEMM kernel's).
        rows.div_ceil(self.threads * 4).max(8).next_multiple_of(8)
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
        // Already inside this pool (an op of a pass that holds the lock, such
        // as a wrapping backend's kernel): run in place, not lock again.
        if self.pool.current_thread_index().is_some() {
            return f();
        }
        // One pass in the pool at a time, taken on the caller's thread: the
        // ops hold the scratch lock across their parallel loops, and a
        // worker waiting in one of them may steal another session's whole
        // pass (rayon's work stealing) and block on the lock it holds.
        let _pass = self.pass.lock().unwrap_or_else(|e| e.into_inner());
        self.pool.install(f)
    }

    fn set_deterministic(&mut self, on: bool) -> Result<()> {
        self.deterministic = on;
        Ok(())
    }

    fn upload_matrix(&self, m: &HostMatrix) -> Result<CpuMatrix> {
        self.make_matrix(m)
    }

    fn upload_vector(&self, v: &[f32]) -> Result<Vec<f32>> {
        Ok(v.to_vec())
    }

    fn upload_ffn(
        &self,
        layer: usize,
        gate: &HostMatrix,
        up: &HostMatrix,
        down: &HostMatrix,
    ) -> Result<CpuFfn> {
        self.upload_ffn_with(layer, FfnActivation::Silu, gate, up, down)
    }

    fn upload_ffn_with(
        &self,
        _layer: usize,
        activation: FfnActivation,
        gate: &HostMatrix,
        up: &HostMatrix,
        down: &HostMatrix,
    ) -> Result<CpuFfn> {
        let (gate, up, down) = (
            self.make_matrix(gate)?,
            self.make_matrix(up)?,
            self.make_matrix(down)?,
        );
        if gate.rows != up.rows
            || gate.cols != up.cols
            || down.cols != gate.rows
            || down.rows != gate.cols
        {
            return Err(RuntimeError::InvalidArgument(format!(
                "FFN shapes disagree: gate {}x{}, up {}x{}, down {}x{}",
                gate.rows, gate.cols, up.rows, up.cols, down.rows, down.cols
            )));
        }
        Ok(CpuFfn {
            gate,
            up,
            down,
            activation,
        })
    }

    fn new_kv_cache(&self, spec: KvSpec) -> Result<KvCache> {
        let mut cache = KvCache::new(spec)?;
        if let Some(cfg) = self.kv_pruning {
            cache.enable_kv_pruning(cfg)?;
        }
        Ok(cache)
    }

    fn new_kv_cache_pruned(
        &self,
        spec: KvSpec,
        pruning: Option<crate::kv_pages::KvPruning>,
    ) -> Result<KvCache> {
        let mut cache = self.new_kv_cache(spec)?;
        if let Some(cfg) = pruning {
            cache.enable_kv_pruning(cfg)?;
        }
        Ok(cache)
    }

    fn kv_set_pruning(
        &self,
        cache: &mut KvCache,
        pruning: Option<crate::kv_pages::KvPruning>,
    ) -> Result<()> {
        // `None` on a cache without page summaries: already full attention.
        if pruning.is_none() && cache.page_summaries().is_none() {
            return Ok(());
        }
        cache.set_kv_pruning(pruning)
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
                return Err(RuntimeError::InvalidArgument(format!(
                    "token id {t} >= vocabulary {}",
                    table.rows
                )));
            }
            quant::dequantize(
                table.ty,
                table.row(t),
                &mut out.data[r * cols..(r + 1) * cols],
            )?;
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &CpuActivations,
        weight: &Vec<f32>,
        eps: f32,
        out: &mut CpuActivations,
    ) -> Result<()> {
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
            return Err(RuntimeError::InvalidArgument(format!(
                "{}: input width {} != {}",
                w.name, x.width, w.cols
            )));
        }
        out.reshape(x.rows, w.rows);
        let mut s = self.scratch();
        let s = &mut *s;
        let act = CpuBackend::encode(&self.pool, w, x.data(), x.rows, &mut s.act_q)?;
        let chunk = self.chunk_rows(w.rows);
        matmul_rows(
            &self.pool,
            chunk,
            w,
            &act,
            x.rows,
            out.data_mut(),
            &mut s.transposed,
        );
        Ok(())
    }

    fn matmul_many(
        &self,
        ws: &[&CpuMatrix],
        x: &CpuActivations,
        outs: &mut [&mut CpuActivations],
    ) -> Result<()> {
        if ws.len() != outs.len() {
            return Err(RuntimeError::InvalidArgument(
                "matmul_many: one output per matrix".into(),
            ));
        }
        if let Some(w) = ws.iter().find(|w| w.cols != x.width) {
            return Err(RuntimeError::InvalidArgument(format!(
                "{}: input width {} != {}",
                w.name, x.width, w.cols
            )));
        }
        let n = x.rows;
        let mut s = self.scratch();
        let s = &mut *s;
        // One quantization of x per activation encoding in use.
        for e in s.act_by_type.iter_mut() {
            e.2 = 0;
        }
        // Index into act_by_type per matrix; None: exact mode (f32 rows).
        let mut which: Vec<Option<usize>> = Vec::with_capacity(ws.len());
        for w in ws {
            if w.f32_activations {
                which.push(None);
                continue;
            }
            let packed = CpuBackend::packs(w, n);
            let idx = match s
                .act_by_type
                .iter()
                .position(|e| e.0 == w.act_ty && e.1 == packed && e.2 != 0)
            {
                Some(i) => i,
                None => {
                    let slot = match s.act_by_type.iter().position(|e| e.2 == 0) {
                        Some(i) => i,
                        None => {
                            s.act_by_type.push((w.act_ty, false, 0, Vec::new()));
                            s.act_by_type.len() - 1
                        }
                    };
                    let e = &mut s.act_by_type[slot];
                    e.0 = w.act_ty;
                    e.1 = packed;
                    e.2 = if packed {
                        pack_rows(&self.pool, w.ty, x.data(), n, w.cols, &mut e.3)?;
                        usize::MAX // in use; packed data has no row stride
                    } else {
                        quantize_rows(&self.pool, w.act_ty, x.data(), n, w.cols, &mut e.3)?
                    };
                    slot
                }
            };
            which.push(Some(idx));
        }
        let acts: Vec<ActRows<'_>> = which
            .iter()
            .map(|wh| match wh {
                Some(i) if s.act_by_type[*i].1 => ActRows::Packed(&s.act_by_type[*i].3),
                Some(i) => ActRows::Quantized {
                    data: &s.act_by_type[*i].3,
                    row_bytes: s.act_by_type[*i].2,
                },
                None => ActRows::F32(x.data()),
            })
            .collect();
        // One parallel pass over the concatenated rows, written weight-row
        // major ([total_rows, n]) and scattered to the outputs after.
        let offsets: Vec<usize> = ws
            .iter()
            .scan(0, |o, w| {
                let start = *o;
                *o += w.rows;
                Some(start)
            })
            .collect();
        let total: usize = ws.iter().map(|w| w.rows).sum();
        s.transposed.resize(total * n, 0.0);
        let chunk = self.chunk_rows(total);
        self.pool.install(|| {
            s.transposed
                .par_chunks_mut(chunk * n)
                .enumerate()
                .for_each(|(ci, mut o)| {
                    ROW_SCRATCH.with_borrow_mut(|(deq, _, _)| {
                        // The chunk's rows, split where one matrix ends.
                        let mut g = ci * chunk;
                        while !o.is_empty() {
                            let m = offsets.partition_point(|&off| off <= g) - 1;
                            let take = (offsets[m] + ws[m].rows - g).min(o.len() / n);
                            let (head, tail) = std::mem::take(&mut o).split_at_mut(take * n);
                            ws[m].rows_dots(
                                ws[m].data.as_slice(),
                                g - offsets[m],
                                &acts[m],
                                n,
                                head,
                                deq,
                            );
                            o = tail;
                            g += take;
                        }
                    })
                })
        });
        for ((w, out), &off) in ws.iter().zip(outs.iter_mut()).zip(&offsets) {
            out.reshape(n, w.rows);
            transpose_par(
                &self.pool,
                &s.transposed[off * n..(off + w.rows) * n],
                w.rows,
                n,
                out.data_mut(),
            );
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
            return Err(RuntimeError::InvalidArgument(
                "residual shapes differ".into(),
            ));
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
        let defaults = AttentionOptions::default();
        self.attention_with(layer, p, &defaults, q, k, v, qk_norm, slots, cache, out)
    }

    fn attention_with(
        &self,
        layer: usize,
        p: &AttentionParams,
        options: &AttentionOptions,
        q: &mut CpuActivations,
        k: &mut CpuActivations,
        v: &CpuActivations,
        qk_norm: Option<QkNorm<'_, Vec<f32>>>,
        slots: &[TokenSlot],
        cache: &mut KvCache,
        out: &mut CpuActivations,
    ) -> Result<()> {
        let hd = p.head_dim;
        if options.sliding_window == Some(0) {
            return Err(RuntimeError::InvalidArgument(
                "a sliding window of 0 positions".into(),
            ));
        }
        let shape = |a: &CpuActivations| InputShape {
            rows: a.rows,
            width: a.width,
        };
        let spec = *cache.spec();
        p.check_batch(shape(q), shape(k), shape(v), slots, &spec, layer)?;
        let max_pos = slots.iter().map(|s| s.pos).max().unwrap_or(0);
        let mut s = self.scratch();
        let s = &mut *s;
        // Rotary tables for positions 0..=max_pos, one per (head size, base,
        // scaling): models whose layers use two bases (gemma) keep both.
        let half = hd / 2;
        let table = rope_table(&mut s.rope_tables, p, spec.n_ctx, max_pos);
        let mut angles = ops::RopeAngles {
            cos: vec![0.0; half],
            sin: vec![0.0; half],
        };
        let (qw, kw) = (q.width, k.width);
        for (i, slot) in slots.iter().enumerate() {
            angles
                .cos
                .copy_from_slice(&table.cos[slot.pos * half..(slot.pos + 1) * half]);
            angles
                .sin
                .copy_from_slice(&table.sin[slot.pos * half..(slot.pos + 1) * half]);
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
        out.reshape(slots.len(), p.n_head * hd);
        let group = p.n_head / p.n_head_kv;
        let scale = options.scale.unwrap_or(1.0 / (hd as f32).sqrt());
        let window = options.sliding_window;
        let cache = &*cache;
        let q = &*q;
        let decode_row = crate::attention_pruned::decode_rows(slots);
        self.pool.install(|| {
            out.data_mut().par_chunks_mut(hd).enumerate().for_each_init(
                || vec![0.0f32; max_pos + 1],
                |scores, (idx, o)| {
                    let (row, head) = (idx / p.n_head, idx % p.n_head);
                    let slot = slots[row];
                    let qh = &q.data[row * qw + head * hd..row * qw + (head + 1) * hd];
                    if let Some(w) = window {
                        // A sliding-window layer reads only its window (never pruned).
                        let start = (slot.pos + 1).saturating_sub(w);
                        cache.attend_span(
                            layer,
                            slot.seq,
                            head / group,
                            start..slot.pos + 1,
                            qh,
                            scale,
                            scores,
                            o,
                        );
                        return;
                    }
                    cache.attend_maybe_pruned(
                        layer,
                        slot.seq,
                        head / group,
                        slot.pos + 1,
                        qh,
                        scale,
                        decode_row[row],
                        scores,
                        o,
                    );
                },
            )
        });
        Ok(())
    }

    fn ffn(&self, f: &CpuFfn, x: &CpuActivations, out: &mut CpuActivations) -> Result<()> {
        let n_embd = f.gate.cols;
        if x.width != n_embd {
            return Err(RuntimeError::InvalidArgument(format!(
                "ffn input width {} != {n_embd}",
                x.width
            )));
        }
        let n = x.rows;
        let n_ff = f.gate.rows;
        let mut s = self.scratch();
        let s = &mut *s;
        // Gate and up share their input; quantize it once when they share
        // the activation encoding (they do in every llama.cpp mix).
        let mut up_q = Vec::new();
        let gate_act = CpuBackend::encode(&self.pool, &f.gate, x.data(), n, &mut s.act_q)?;
        let same_encoding = f.up.act_ty == f.gate.act_ty
            && !f.up.f32_activations
            && CpuBackend::packs(&f.up, n) == CpuBackend::packs(&f.gate, n);
        let up_act = match gate_act {
            ActRows::Quantized { .. } | ActRows::Packed(_) if same_encoding => gate_act,
            _ => CpuBackend::encode(&self.pool, &f.up, x.data(), n, &mut up_q)?,
        };
        // hidden is [n_ff, n] (weight-row major) so that each task owns a
        // contiguous block; transposed below when n > 1.
        s.hidden.resize(n_ff * n, 0.0);
        let chunk = self.chunk_rows(n_ff);
        self.pool.install(|| {
            s.hidden
                .par_chunks_mut(chunk * n)
                .enumerate()
                .for_each(|(ci, o)| {
                    let (gate_bytes, up_bytes) = (f.gate.data.as_slice(), f.up.data.as_slice());
                    ROW_SCRATCH.with_borrow_mut(|(deq, g, u)| {
                        g.resize(o.len(), 0.0);
                        u.resize(o.len(), 0.0);
                        let r0 = ci * chunk;
                        f.gate.rows_dots(gate_bytes, r0, &gate_act, n, g, deq);
                        f.up.rows_dots(up_bytes, r0, &up_act, n, u, deq);
                        match f.activation {
                            FfnActivation::Silu => ops::swiglu(g, u, o),
                            FfnActivation::GeluTanh => ops::geglu_tanh(g, u, o),
                        }
                    })
                })
        });
        let hidden_rows: &[f32] = if n == 1 {
            &s.hidden
        } else {
            s.transposed.resize(n_ff * n, 0.0);
            transpose_par(&self.pool, &s.hidden, n_ff, n, &mut s.transposed);
            &s.transposed
        };
        out.reshape(n, f.down.rows);
        let down_act = CpuBackend::encode(&self.pool, &f.down, hidden_rows, n, &mut s.hidden_q)?;
        let chunk = self.chunk_rows(f.down.rows);
        let mut staging = std::mem::take(&mut s.down_staging);
        matmul_rows(
            &self.pool,
            chunk,
            &f.down,
            &down_act,
            n,
            out.data_mut(),
            &mut staging,
        );
        s.down_staging = staging;
        Ok(())
    }

    fn scale(&self, x: &mut CpuActivations, factor: f32) -> Result<()> {
        for v in x.data_mut() {
            *v *= factor;
        }
        Ok(())
    }

    fn softcap(&self, x: &mut CpuActivations, cap: f32) -> Result<()> {
        if !(cap.is_finite() && cap > 0.0) {
            return Err(RuntimeError::InvalidArgument(format!(
                "soft-cap {cap} is not a positive number"
            )));
        }
        for v in x.data_mut() {
            *v = cap * (*v / cap).tanh();
        }
        Ok(())
    }

    fn select_rows(
        &self,
        x: &CpuActivations,
        rows: &[usize],
        out: &mut CpuActivations,
    ) -> Result<()> {
        if let Some(&r) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(RuntimeError::InvalidArgument(format!(
                "row {r} >= {}",
                x.rows
            )));
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
