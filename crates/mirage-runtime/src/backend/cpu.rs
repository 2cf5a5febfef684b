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

use mirage_gguf::quant::{self, DotFn, DotRowsFn, GemmFn, MatvecFn, DOT_ROWS};
use mirage_gguf::GgmlType;
use rayon::prelude::*;

use super::{
    AttentionOptions, AttentionParams, Backend, FfnActivation, HostMatrix, QkNorm, SharedBytes,
    TokenSlot,
};
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
    dot_rows: DotRowsFn,
    /// Weights with a SIMD GEMM kernel: batches of [`GEMM_MIN_TOKENS`] or
    /// more rows go through it on packed activations.
    gemm: Option<GemmFn>,
    /// Weights with a SIMD matrix-vector kernel (decode).
    matvec: Option<MatvecFn>,
    /// Exact mode: dequantize each row once per call and dot it in f32.
    f32_activations: bool,
    /// Deterministic mode: every (weight row, activation row) pair by the
    /// one-row kernel `dot`, whatever the batch (see [`CpuMatrix::rows_dots`]).
    deterministic: bool,
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

    /// `out[a] = W_r · act_a` for the `out.len()` activation rows of `act`.
    ///
    /// Quantized activations go through the multi-row kernel [`DOT_ROWS`]
    /// rows at a time (the weight row is unpacked once per group, and stays
    /// in L1 across groups). In exact mode the row is dequantized once into
    /// `deq` and dotted with every f32 activation row.
    ///
    /// `bytes` is `self.data.as_slice()`, looked up once per task by the
    /// caller (it goes through a trait object).
    fn row_dots(
        &self,
        bytes: &[u8],
        r: usize,
        act: &ActRows<'_>,
        out: &mut [f32],
        deq: &mut Vec<f32>,
    ) {
        let (wr, cols) = (
            &bytes[r * self.row_bytes..(r + 1) * self.row_bytes],
            self.cols,
        );
        match *act {
            ActRows::Quantized { data, row_bytes } if out.len() == 1 => {
                // Decode: one activation row.
                // SAFETY: as below.
                out[0] = unsafe { (self.dot)(cols, wr, &data[..row_bytes]) };
            }
            ActRows::Quantized { data, row_bytes } => {
                let mut groups = out.chunks_exact_mut(DOT_ROWS);
                let mut a = 0;
                for o in &mut groups {
                    let o: &mut [f32; DOT_ROWS] =
                        o.try_into().expect("chunks_exact_mut yields DOT_ROWS");
                    // SAFETY: make_matrix checked that rows hold `cols`
                    // elements of self.ty; quantize_rows wrote `cols`
                    // elements of vec_dot_type(self.ty) per activation row,
                    // `row_bytes` apart.
                    unsafe { (self.dot_rows)(cols, wr, &data[a * row_bytes..], row_bytes, o) };
                    a += DOT_ROWS;
                }
                for o in groups.into_remainder() {
                    // SAFETY: as above, one row.
                    *o = unsafe { (self.dot)(cols, wr, &data[a * row_bytes..(a + 1) * row_bytes]) };
                    a += 1;
                }
            }
            ActRows::Packed(_) => out.fill(f32::NAN), // unreachable: rows_dots takes this case
            ActRows::F32(x) => {
                deq.resize(cols, 0.0);
                if quant::dequantize(self.ty, wr, deq).is_err() {
                    // Unreachable: shapes were checked at upload.
                    out.fill(f32::NAN);
                    return;
                }
                let w = f32_bytes(deq);
                for (a, o) in out.iter_mut().enumerate() {
                    // SAFETY: both sides hold `cols` f32 values; the F32
                    // kernel reads them unaligned.
                    *o = unsafe { (self.dot)(cols, w, f32_bytes(&x[a * cols..(a + 1) * cols])) };
                }
            }
        }
    }
}

impl CpuMatrix {
    /// `out[i * n + a] = W_{r0 + i} · act_a` for `i < out.len() / n`, the
    /// `n` activation rows of `act`: one GEMM call on packed activations,
    /// else [`CpuMatrix::row_dots`] per row.
    fn rows_dots(
        &self,
        bytes: &[u8],
        r0: usize,
        act: &ActRows<'_>,
        n: usize,
        out: &mut [f32],
        deq: &mut Vec<f32>,
    ) {
        let rows = out.len() / n;
        if self.deterministic {
            if let ActRows::Quantized { data, row_bytes } = *act {
                // Deterministic mode: every pair by the one-row kernel, so a
                // row's result does not depend on the batch (the multi-row,
                // GEMM and matrix-vector kernels sum in other orders). The
                // weight row stays in L1 across the activation rows.
                for (i, o) in out.chunks_exact_mut(n).enumerate() {
                    let r = r0 + i;
                    let wr = &bytes[r * self.row_bytes..(r + 1) * self.row_bytes];
                    for (a, o) in o.iter_mut().enumerate() {
                        // SAFETY: as in row_dots.
                        *o = unsafe {
                            (self.dot)(self.cols, wr, &data[a * row_bytes..(a + 1) * row_bytes])
                        };
                    }
                }
                return;
            }
            // Exact mode (f32 rows) is one dot per pair already.
        }
        match (*act, self.gemm) {
            (ActRows::Packed(packed), Some(gemm)) => {
                let w = &bytes[r0 * self.row_bytes..(r0 + rows) * self.row_bytes];
                // SAFETY: make_matrix checked that rows hold `cols`
                // elements of self.ty and took `gemm` for self.ty; encode
                // packed `n` rows of `cols` for self.ty with pack_rows;
                // `out` holds rows * n.
                unsafe { gemm(self.cols, w, rows, packed, n, out) };
            }
            (ActRows::Packed(_), None) => out.fill(f32::NAN), // unreachable: encode packs only for gemm
            (ActRows::Quantized { data, row_bytes }, _) if n == 1 && self.matvec.is_some() => {
                let w = &bytes[r0 * self.row_bytes..(r0 + rows) * self.row_bytes];
                if let Some(matvec) = self.matvec {
                    // SAFETY: as for gemm; `data` holds one row of `cols`
                    // in vec_dot_type(self.ty) written by quantize_rows.
                    unsafe { matvec(self.cols, w, rows, &data[..row_bytes], out) };
                }
            }
            _ => {
                for (i, o) in out.chunks_exact_mut(n).enumerate() {
                    self.row_dots(bytes, r0 + i, act, o, deq);
                }
            }
        }
    }
}

/// Batches of at least this many activation rows use the GEMM kernels
/// (they pad to groups of 8 tokens; below 2 the matrix-vector kernel wins).
const GEMM_MIN_TOKENS: usize = 2;

/// Activation rows as a matrix product consumes them.
#[derive(Clone, Copy)]
enum ActRows<'a> {
    /// Rows quantized into the weight's `vec_dot_type`, `row_bytes` apart.
    Quantized { data: &'a [u8], row_bytes: usize },
    /// Rows quantized and repacked for the matrix's GEMM kernel
    /// ([`quant::pack_rows`]).
    Packed(&'a [u8]),
    /// Plain f32 rows of `cols` (exact mode).
    F32(&'a [f32]),
}

/// The bytes of an f32 slice (what the F32 dot kernel takes).
fn f32_bytes(x: &[f32]) -> &[u8] {
    // SAFETY: any initialised f32 is 4 initialised bytes; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) }
}

thread_local! {
    /// Per-worker scratch of [`CpuMatrix::row_dots`] (a dequantized row) and
    /// of the fused FFN (gate and up results of one weight row), reused so
    /// that the parallel loops allocate nothing per task.
    static ROW_SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
    /// Per-worker staging of [`pack_rows`]: one token group quantized
    /// before it is packed.
    static PACK_STAGING: std::cell::RefCell<Vec<u8>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// One layer's FFN on the CPU.
#[derive(Debug)]
pub struct CpuFfn {
    gate: CpuMatrix,
    up: CpuMatrix,
    down: CpuMatrix,
    activation: FfnActivation,
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
            return Err(RuntimeError::InvalidArgument(
                "activation data does not match its shape".into(),
            ));
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
    /// Sets the shape, keeping the allocation (new elements are 0, old ones
    /// keep their values).
    pub fn reshape(&mut self, rows: usize, width: usize) {
        self.rows = rows;
        self.width = width;
        self.data.resize(rows * width, 0.0);
    }
    /// All rows, for writing.
    pub fn data_mut(&mut self) -> &mut [f32] {
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
    rope_tables: Vec<RopeTable>,
    /// Encodings of one input for `matmul_many`: (type, packed for the
    /// GEMM kernel, row bytes or 0 when free, bytes).
    act_by_type: Vec<(GgmlType, bool, usize, Vec<u8>)>,
    /// Staging of the FFN's down product (`hidden`/`transposed` hold its input).
    down_staging: Vec<f32>,
}

/// cos/sin of every rotary pair for positions `0..n_pos` of one RoPE
/// configuration.
struct RopeTable {
    head_dim: usize,
    base_bits: u32,
    scaling: crate::rope::RopeScaling,
    n_pos: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// The table of `p`'s RoPE configuration covering `0..=max_pos`, built (or
/// grown) on demand; at most a few configurations are kept.
fn rope_table<'a>(
    tables: &'a mut Vec<RopeTable>,
    p: &AttentionParams,
    n_ctx: usize,
    max_pos: usize,
) -> &'a RopeTable {
    const KEPT: usize = 4;
    let hd = p.head_dim;
    let found = tables.iter().position(|t| {
        t.head_dim == hd && t.base_bits == p.rope_freq_base.to_bits() && t.scaling == p.rope_scaling
    });
    let i = match found {
        Some(i) if tables[i].n_pos > max_pos => return &tables[i],
        Some(i) => i,
        None => {
            if tables.len() == KEPT {
                tables.remove(0);
            }
            tables.push(RopeTable {
                head_dim: hd,
                base_bits: p.rope_freq_base.to_bits(),
                scaling: p.rope_scaling,
                n_pos: 0,
                cos: Vec::new(),
                sin: Vec::new(),
            });
            tables.len() - 1
        }
    };
    let n_pos = (max_pos + 1)
        .next_power_of_two()
        .max(64)
        .min(n_ctx.max(max_pos + 1));
    let t = &mut tables[i];
    t.cos.clear();
    t.sin.clear();
    let inv_freqs = p.rope_scaling.inv_freqs(hd, p.rope_freq_base);
    let mscale = p.rope_scaling.mscale();
    for pos in 0..n_pos {
        let a = crate::rope::angles(pos, &inv_freqs, mscale);
        t.cos.extend_from_slice(&a.cos);
        t.sin.extend_from_slice(&a.sin);
    }
    t.n_pos = n_pos;
    t
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
            (
                GgmlType::F32,
                quant::dot_fn(GgmlType::F32).ok_or_else(|| unsupported("no f32 dot kernel"))?,
            )
        } else {
            (
                quant::vec_dot_type(m.ty),
                quant::dot_fn(m.ty).ok_or_else(|| unsupported("no dot kernel"))?,
            )
        };
        quant::row_bytes(act_ty, m.cols)
            .map_err(|_| unsupported("row length not a block multiple"))?;
        Ok(CpuMatrix {
            name: m.name.clone(),
            ty: m.ty,
            rows: m.rows,
            cols: m.cols,
            row_bytes,
            act_ty,
            dot,
            dot_rows: quant::dot_rows_fn(m.ty),
            gemm: match quant::GemmIsa::best() {
                quant::GemmIsa::Scalar => None,
                _ if self.f32_activations => None,
                best => best.gemm_kernel(m.ty),
            },
            matvec: match quant::GemmIsa::best() {
                quant::GemmIsa::Scalar => None,
                _ if self.f32_activations => None,
                best => best.matvec_kernel(m.ty),
            },
            f32_activations: self.f32_activations,
            deterministic: self.deterministic,
            data: m.data.clone(),
        })
    }

    /// The activation rows `x` (`n` rows of `cols`) as `w` consumes them,
    /// quantized (and packed for its GEMM kernel) into `buf` on the pool
    /// unless `w` runs in exact mode.
    fn encode<'a>(
        pool: &rayon::ThreadPool,
        w: &CpuMatrix,
        x: &'a [f32],
        n: usize,
        buf: &'a mut Vec<u8>,
    ) -> Result<ActRows<'a>> {
        if w.f32_activations {
            return Ok(ActRows::F32(x));
        }
        if CpuBackend::packs(w, n) {
            pack_rows(pool, w.ty, x, n, w.cols, buf)?;
            return Ok(ActRows::Packed(buf));
        }
        let row_bytes = quantize_rows(pool, w.act_ty, x, n, w.cols, buf)?;
        Ok(ActRows::Quantized {
            data: buf,
            row_bytes,
        })
    }

    /// Whether `n` activation rows for `w` are packed for its GEMM kernel.
    fn packs(w: &CpuMatrix, n: usize) -> bool {
        w.gemm.is_some() && !w.deterministic && n >= GEMM_MIN_TOKENS
    }
}

/// Rows per parallel task of [`quantize_rows`]; fewer rows are quantized
/// on the calling thread (a decode step's one row costs less than a task).
const QUANTIZE_TASK_ROWS: usize = 8;

/// Quantizes each of `n` rows of `x` (width `cols`) into `ty`, into `dst`,
/// [`QUANTIZE_TASK_ROWS`] rows per pool task.
fn quantize_rows(
    pool: &rayon::ThreadPool,
    ty: GgmlType,
    x: &[f32],
    n: usize,
    cols: usize,
    dst: &mut Vec<u8>,
) -> Result<usize> {
    let rb = quant::row_bytes(ty, cols)?;
    dst.resize(rb * n, 0);
    let quantize = |x: &[f32], dst: &mut [u8]| -> Result<()> {
        for (xr, dr) in x.chunks_exact(cols).zip(dst.chunks_exact_mut(rb)) {
            quant::quantize(ty, xr, dr)?;
        }
        Ok(())
    };
    if n <= QUANTIZE_TASK_ROWS {
        quantize(&x[..n * cols], dst)?;
    } else {
        pool.install(|| {
            dst.par_chunks_mut(QUANTIZE_TASK_ROWS * rb)
                .zip(x[..n * cols].par_chunks(QUANTIZE_TASK_ROWS * cols))
                .try_for_each(|(d, x)| quantize(x, d))
        })?;
    }
    Ok(rb)
}

/// Quantizes `n` rows of `x` into the GEMM input type of weight type `ty`
/// and packs them for its GEMM kernel into `dst`: one pool task per packed
/// token group (each group's bytes are contiguous), staged per worker.
fn pack_rows(
    pool: &rayon::ThreadPool,
    ty: GgmlType,
    x: &[f32],
    n: usize,
    cols: usize,
    dst: &mut Vec<u8>,
) -> Result<()> {
    let act_ty = quant::gemm_input_type(ty).ok_or(RuntimeError::UnsupportedType {
        backend: "cpu".into(),
        ty,
        what: "no GEMM kernel".into(),
    })?;
    let rb = quant::row_bytes(act_ty, cols)?;
    let group = quant::K_TOKEN_GROUP;
    dst.resize(quant::packed_bytes(ty, n, cols)?, 0);
    let group_bytes = quant::packed_bytes(ty, group, cols)?;
    if group_bytes == 0 {
        return Ok(());
    }
    let pack_group = |g: usize, out: &mut [u8]| -> Result<()> {
        let rows = &x[g * group * cols..((g + 1) * group).min(n) * cols];
        let m = rows.len() / cols;
        PACK_STAGING.with_borrow_mut(|staging| -> Result<()> {
            staging.resize(rb * m, 0);
            for (xr, dr) in rows.chunks_exact(cols).zip(staging.chunks_exact_mut(rb)) {
                quant::quantize(act_ty, xr, dr)?;
            }
            quant::pack_rows(ty, staging, rb, m, cols, out)?;
            Ok(())
        })
    };
    pool.install(|| {
        dst.par_chunks_mut(group_bytes)
            .enumerate()
            .try_for_each(|(g, out)| pack_group(g, out))
    })
}

/// `out[a * w.rows + r] = w_r · act_a` for `n_act` activation rows.
///
/// Weight rows are split into chunks over the pool; each task produces its
/// rows' dots with every activation row into `transposed` (weight-row
/// major, so each task owns a contiguous block), scattered to `out` after.
/// With one activation row the two layouts coincide and `out` is written
/// directly.
fn matmul_rows(
    pool: &rayon::ThreadPool,
    chunk: usize,
    w: &CpuMatrix,
    act: &ActRows<'_>,
    n_act: usize,
    out: &mut [f32],
    transposed: &mut Vec<f32>,
) {
    let dst: &mut [f32] = if n_act == 1 {
        out
    } else {
        transposed.resize(w.rows * n_act, 0.0);
        transposed
    };
    pool.install(|| {
        dst.par_chunks_mut(chunk * n_act)
            .enumerate()
            .for_each(|(ci, o)| {
                let bytes = w.data.as_slice();
                ROW_SCRATCH.with_borrow_mut(|(deq, _, _)| {
                    w.rows_dots(bytes, ci * chunk, act, n_act, o, deq)
                })
            })
    });
    if n_act > 1 {
        transpose_par(pool, transposed, w.rows, n_act, out);
    }
}

/// `dst[a * rows + r] = src[r * cols + a]` (`src` is `[rows, cols]`).
///
/// Eight source rows at a time, so that each destination write is a run of
/// 8 consecutive floats: a row-at-a-time loop writes every element to a
/// different cache line (`rows` apart) and was ~5% of a Q8_0 prefill; this
/// is 2-5x faster on the prefill shapes.
fn transpose_into(src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) {
    transpose_rows_of(src, rows, cols, 0, &mut dst[..rows * cols]);
}

/// Destination rows `a0..a0 + dst.len() / rows` of [`transpose_into`]
/// (`dst` holds just those rows).
fn transpose_rows_of(src: &[f32], rows: usize, cols: usize, a0: usize, dst: &mut [f32]) {
    let a1 = a0 + dst.len() / rows;
    let mut r0 = 0;
    while r0 + 8 <= rows {
        let s = &src[r0 * cols..(r0 + 8) * cols];
        for a in a0..a1 {
            let d = &mut dst[(a - a0) * rows + r0..(a - a0) * rows + r0 + 8];
            for (i, d) in d.iter_mut().enumerate() {
                *d = s[i * cols + a];
            }
        }
        r0 += 8;
    }
    for r in r0..rows {
        for a in a0..a1 {
            dst[(a - a0) * rows + r] = src[r * cols + a];
        }
    }
}

/// [`transpose_into`] on the pool, [`TRANSPOSE_TASK`] destination rows per
/// task (a prefill's products and FFN hidden state are transposed after
/// every parallel pass; done on one thread they were a serial few percent).
fn transpose_par(pool: &rayon::ThreadPool, src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) {
    if cols < 2 * TRANSPOSE_TASK || rows == 0 {
        transpose_into(src, rows, cols, dst);
        return;
    }
    pool.install(|| {
        dst[..rows * cols]
            .par_chunks_mut(TRANSPOSE_TASK * rows)
            .enumerate()
            .for_each(|(i, d)| transpose_rows_of(src, rows, cols, i * TRANSPOSE_TASK, d))
    });
}

/// Destination rows (tokens) per task of [`transpose_par`].
const TRANSPOSE_TASK: usize = 16;

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
        let n = slots.len();
        if p.n_head_kv == 0 || p.n_head % p.n_head_kv != 0 || hd % 2 != 0 {
            return Err(RuntimeError::InvalidArgument(format!(
                "bad attention shape {p:?}"
            )));
        }
        if q.rows != n
            || k.rows != n
            || v.rows != n
            || q.width != p.n_head * hd
            || k.width != p.n_head_kv * hd
            || v.width != k.width
        {
            return Err(RuntimeError::InvalidArgument(
                "attention inputs do not match the batch".into(),
            ));
        }
        let spec = *cache.spec();
        if spec.head_dim != hd || spec.n_head_kv != p.n_head_kv {
            return Err(RuntimeError::InvalidArgument(
                "KV cache shape does not match the layer".into(),
            ));
        }
        let max_pos = slots.iter().map(|s| s.pos).max().unwrap_or(0);
        if max_pos >= spec.n_ctx {
            return Err(RuntimeError::ContextFull { n_ctx: spec.n_ctx });
        }
        if let Some(s) = slots.iter().find(|s| s.seq >= spec.n_seq) {
            return Err(RuntimeError::InvalidArgument(format!(
                "sequence slot {} >= {}",
                s.seq, spec.n_seq
            )));
        }
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
        out.reshape(n, p.n_head * hd);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{AttentionParams, SharedBytes, TokenSlot};
    use crate::kv_cache::{KvDtype, KvSpec};
    use crate::ops::RopeMode;

    /// Deterministic values in about [-1, 1] (an LCG).
    fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn q8_matrix(name: &str, seed: u64, rows: usize, cols: usize) -> HostMatrix {
        let mut data = vec![0u8; quant::row_bytes(GgmlType::Q8_0, cols).unwrap() * rows];
        quant::quantize(GgmlType::Q8_0, &values(seed, rows * cols), &mut data).unwrap();
        HostMatrix {
            name: name.into(),
            ty: GgmlType::Q8_0,
            rows,
            cols,
            data: SharedBytes::from_vec(data),
        }
    }

    fn acts(rows: usize, width: usize, seed: u64) -> CpuActivations {
        CpuActivations::from_vec(rows, width, values(seed, rows * width)).unwrap()
    }

    /// Largest |a - b| over the largest |b|.
    fn rel_err(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
    }

    fn quantized_matrix(ty: GgmlType, seed: u64, rows: usize, cols: usize) -> HostMatrix {
        let mut data = vec![0u8; quant::row_bytes(ty, cols).unwrap() * rows];
        quant::quantize(ty, &values(seed, rows * cols), &mut data).unwrap();
        HostMatrix {
            name: format!("w {ty}"),
            ty,
            rows,
            cols,
            data: SharedBytes::from_vec(data),
        }
    }

    /// Batched products (the GEMM kernels on packed activations) of every
    /// type of the llama.cpp Q4_K_M / Q5_K_M mixes equal the scalar
    /// reference dot of every (row, token) — bit for bit for the K-quants,
    /// to float rounding for the Q8_0-activation types — and the
    /// single-token products (matrix-vector kernels) equal it to float
    /// rounding; row counts are not multiples of the tiles, token counts
    /// not of the 8-token groups.
    #[test]
    fn batched_and_single_token_products_match_the_scalar_dot() {
        use GgmlType::*;
        let backend = CpuBackend::new(2).unwrap();
        for (ty, rows, cols) in [
            (Q8_0, 44usize, 96usize),
            (Q8_0, 37, 320),
            (Q5_0, 37, 320),
            (Q4_0, 19, 64),
            (Q4_K, 45, 512),
            (Q5_K, 33, 256),
            (Q6_K, 41, 768),
        ] {
            let host = quantized_matrix(ty, rows as u64, rows, cols);
            let w = backend.upload_matrix(&host).unwrap();
            let rb = quant::row_bytes(ty, cols).unwrap();
            let act_ty = quant::vec_dot_type(ty);
            let exact = matches!(ty, Q4_K | Q5_K | Q6_K);
            for n in [1usize, 2, 3, 8, 9, 17] {
                let x = acts(n, cols, 100 + n as u64);
                let mut out = CpuActivations::default();
                backend.matmul(&w, &x, &mut out).unwrap();
                let mut one = CpuActivations::default();
                let mut aq = vec![0u8; quant::row_bytes(act_ty, cols).unwrap()];
                for t in 0..n {
                    quant::quantize(act_ty, x.row(t), &mut aq).unwrap();
                    let reference: Vec<f32> = (0..rows)
                        .map(|r| {
                            quant::vec_dot_scalar(
                                ty,
                                cols,
                                &host.data.as_slice()[r * rb..(r + 1) * rb],
                                &aq,
                            )
                            .unwrap()
                        })
                        .collect();
                    let xt = CpuActivations::from_vec(1, cols, x.row(t).to_vec()).unwrap();
                    backend.matmul(&w, &xt, &mut one).unwrap();
                    if exact && n > 1 {
                        assert_eq!(
                            out.row(t),
                            &reference[..],
                            "{ty} {rows}x{cols} n={n} token {t}: batched"
                        );
                        let e = rel_err(one.row(0), &reference);
                        assert!(
                            e < 1e-5,
                            "{ty} {rows}x{cols} token {t}: single-token rel err {e}"
                        );
                    } else {
                        let e = rel_err(out.row(t), &reference);
                        assert!(
                            e < 1e-5,
                            "{ty} {rows}x{cols} n={n} token {t}: batched rel err {e}"
                        );
                        let e = rel_err(one.row(0), &reference);
                        assert!(
                            e < 1e-5,
                            "{ty} {rows}x{cols} token {t}: single-token rel err {e}"
                        );
                    }
                }
            }
        }
    }

    /// `matmul_many` splits its row chunks where one matrix ends; each
    /// output must equal that matrix's own `matmul` bit for bit (the
    /// kernels compute every (row, token) the same way whatever the tile).
    #[test]
    fn matmul_many_equals_separate_matmuls() {
        let backend = CpuBackend::new(2).unwrap();
        let cols = 128;
        let ws: Vec<CpuMatrix> = [(40usize, 1u64), (12, 2), (20, 3)]
            .iter()
            .map(|&(rows, seed)| {
                backend
                    .upload_matrix(&q8_matrix("w", seed, rows, cols))
                    .unwrap()
            })
            .collect();
        for n in [1usize, 5, 16] {
            let x = acts(n, cols, 7 + n as u64);
            let mut outs = vec![CpuActivations::default(); ws.len()];
            {
                let refs: Vec<&CpuMatrix> = ws.iter().collect();
                let mut out_refs: Vec<&mut CpuActivations> = outs.iter_mut().collect();
                backend.matmul_many(&refs, &x, &mut out_refs).unwrap();
            }
            for (w, many) in ws.iter().zip(&outs) {
                let mut single = CpuActivations::default();
                backend.matmul(w, &x, &mut single).unwrap();
                assert_eq!(many.data(), single.data(), "n={n}, {} rows", w.rows());
            }
        }
    }

    /// The fused FFN of a batch equals the FFN of each token alone (to
    /// float rounding, which can move an activation quantization step).
    #[test]
    fn batched_ffn_equals_per_token_ffn() {
        let backend = CpuBackend::new(2).unwrap();
        let (n_embd, n_ff) = (64usize, 96usize);
        let ffn = backend
            .upload_ffn(
                0,
                &q8_matrix("gate", 1, n_ff, n_embd),
                &q8_matrix("up", 2, n_ff, n_embd),
                &q8_matrix("down", 3, n_embd, n_ff),
            )
            .unwrap();
        let n = 11;
        let x = acts(n, n_embd, 42);
        let mut batched = CpuActivations::default();
        backend.ffn(&ffn, &x, &mut batched).unwrap();
        for t in 0..n {
            let xt = CpuActivations::from_vec(1, n_embd, x.row(t).to_vec()).unwrap();
            let mut one = CpuActivations::default();
            backend.ffn(&ffn, &xt, &mut one).unwrap();
            let e = rel_err(batched.row(t), one.row(0));
            assert!(e < 2e-2, "token {t}: rel err {e}");
        }
    }

    #[test]
    fn tiled_transpose_is_a_transpose() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for (rows, cols) in [(1usize, 1usize), (17, 33), (40, 5), (3, 100), (19, 71)] {
            let src: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
            let mut dst = vec![f32::NAN; rows * cols];
            transpose_into(&src, rows, cols, &mut dst);
            let mut par = vec![f32::NAN; rows * cols];
            transpose_par(&pool, &src, rows, cols, &mut par);
            assert_eq!(dst, par, "{rows}x{cols}: parallel");
            for r in 0..rows {
                for a in 0..cols {
                    assert_eq!(
                        dst[a * rows + r],
                        src[r * cols + a],
                        "{rows}x{cols} ({r},{a})"
                    );
                }
            }
        }
    }

    /// Prefill attention equals decoding the same tokens one at a time,
    /// bit for bit: both run the same f16 attention kernels, whose scores
    /// and sums do not depend on how many keys a call covers.
    #[test]
    fn prefill_attention_equals_token_by_token() {
        let backend = CpuBackend::new(2).unwrap();
        let p = AttentionParams {
            n_head: 4,
            n_head_kv: 2,
            head_dim: 16,
            rope_mode: RopeMode::Neox,
            rope_freq_base: 10000.0,
            rope_scaling: Default::default(),
            norm_eps: 1e-6,
        };
        let n = 7;
        let spec = KvSpec {
            n_layer: 1,
            n_head_kv: 2,
            head_dim: 16,
            n_ctx: 16,
            n_seq: 2,
            dtype: KvDtype::F16,
        };
        let (q0, k0, v0) = (acts(n, 64, 1), acts(n, 32, 2), acts(n, 32, 3));
        // Sequence 1 of the cache, so that the per-sequence offsets matter.
        let slots: Vec<TokenSlot> = (0..n).map(|pos| TokenSlot { seq: 1, pos }).collect();
        let mut cache = backend.new_kv_cache(spec).unwrap();
        let (mut q, mut k, mut out) = (q0.clone(), k0.clone(), CpuActivations::default());
        backend
            .attention(
                0, &p, &mut q, &mut k, &v0, None, &slots, &mut cache, &mut out,
            )
            .unwrap();
        let mut cache1 = backend.new_kv_cache(spec).unwrap();
        for t in 0..n {
            let row = |a: &CpuActivations| {
                CpuActivations::from_vec(1, a.width(), a.row(t).to_vec()).unwrap()
            };
            let (mut q, mut k, v) = (row(&q0), row(&k0), row(&v0));
            let mut o = CpuActivations::default();
            backend
                .attention(
                    0,
                    &p,
                    &mut q,
                    &mut k,
                    &v,
                    None,
                    &slots[t..t + 1],
                    &mut cache1,
                    &mut o,
                )
                .unwrap();
            assert_eq!(out.row(t), o.row(0), "token {t}");
        }
    }

    /// Sliding-window attention with a custom scale equals a softmax over
    /// exactly the window, computed by hand from the rotated q and k the
    /// call leaves behind; decoding token by token gives the same rows.
    #[test]
    fn sliding_window_attention_is_a_softmax_over_the_window() {
        let backend = CpuBackend::new(2).unwrap();
        let (hd, n, window, scale) = (16, 9, 3, 0.3f32);
        let p = AttentionParams {
            n_head: 2,
            n_head_kv: 1,
            head_dim: hd,
            rope_mode: RopeMode::Neox,
            rope_freq_base: 10000.0,
            rope_scaling: Default::default(),
            norm_eps: 1e-6,
        };
        let options = AttentionOptions {
            scale: Some(scale),
            sliding_window: Some(window),
        };
        let spec = KvSpec {
            n_layer: 1,
            n_head_kv: 1,
            head_dim: hd,
            n_ctx: 16,
            n_seq: 1,
            dtype: KvDtype::F32,
        };
        let (q0, k0, v) = (acts(n, 2 * hd, 4), acts(n, hd, 5), acts(n, hd, 6));
        let slots: Vec<TokenSlot> = (0..n).map(|pos| TokenSlot { seq: 0, pos }).collect();
        let mut cache = backend.new_kv_cache(spec).unwrap();
        let (mut q, mut k, mut out) = (q0.clone(), k0.clone(), CpuActivations::default());
        backend
            .attention_with(
                0, &p, &options, &mut q, &mut k, &v, None, &slots, &mut cache, &mut out,
            )
            .unwrap();
        for t in 0..n {
            for head in 0..2 {
                let qh = &q.row(t)[head * hd..(head + 1) * hd];
                let span = (t + 1).saturating_sub(window)..t + 1;
                let scores: Vec<f32> = span
                    .clone()
                    .map(|j| scale * ops::dot_f32(qh, k.row(j)))
                    .collect();
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f32 = weights.iter().sum();
                let mut want = vec![0.0f32; hd];
                for (w, j) in weights.iter().zip(span) {
                    for (o, x) in want.iter_mut().zip(v.row(j)) {
                        *o += w / total * x;
                    }
                }
                let got = &out.row(t)[head * hd..(head + 1) * hd];
                assert!(rel_err(got, &want) < 1e-5, "token {t} head {head}");
            }
        }
        let mut cache1 = backend.new_kv_cache(spec).unwrap();
        for t in 0..n {
            let row = |a: &CpuActivations| {
                CpuActivations::from_vec(1, a.width(), a.row(t).to_vec()).unwrap()
            };
            let (mut q, mut k, v) = (row(&q0), row(&k0), row(&v));
            let mut o = CpuActivations::default();
            backend
                .attention_with(
                    0,
                    &p,
                    &options,
                    &mut q,
                    &mut k,
                    &v,
                    None,
                    &slots[t..t + 1],
                    &mut cache1,
                    &mut o,
                )
                .unwrap();
            assert_eq!(out.row(t), o.row(0), "token {t}");
        }
    }

    #[test]
    fn geglu_ffn_and_softcap() {
        let backend = CpuBackend::new(2).unwrap();
        let (gate, up, down) = (
            q8_matrix("gate", 1, 64, 32),
            q8_matrix("up", 2, 64, 32),
            q8_matrix("down", 3, 32, 64),
        );
        let silu = backend.upload_ffn(0, &gate, &up, &down).unwrap();
        let gelu = backend
            .upload_ffn_with(0, FfnActivation::GeluTanh, &gate, &up, &down)
            .unwrap();
        let x = acts(3, 32, 7);
        let (mut a, mut b) = (CpuActivations::default(), CpuActivations::default());
        backend.ffn(&silu, &x, &mut a).unwrap();
        backend.ffn(&gelu, &x, &mut b).unwrap();
        assert!(rel_err(a.data(), b.data()) > 1e-3, "activation ignored");
        // The GELU FFN by hand: dequantized weights, f32 products.
        let deq = |m: &HostMatrix| {
            let mut w = vec![0.0f32; m.rows * m.cols];
            quant::dequantize(m.ty, m.data.as_slice(), &mut w).unwrap();
            w
        };
        let (wg, wu, wd) = (deq(&gate), deq(&up), deq(&down));
        for r in 0..3 {
            let xr = x.row(r);
            let h: Vec<f32> = (0..64)
                .map(|i| {
                    let g = ops::dot_f32(&wg[i * 32..(i + 1) * 32], xr);
                    let u = ops::dot_f32(&wu[i * 32..(i + 1) * 32], xr);
                    ops::gelu_tanh(g) * u
                })
                .collect();
            let want: Vec<f32> = (0..32)
                .map(|o| ops::dot_f32(&wd[o * 64..(o + 1) * 64], &h))
                .collect();
            // Q8_0 activations on the way: a quantization-sized tolerance.
            assert!(rel_err(b.row(r), &want) < 0.03, "row {r}");
        }
        let mut logits = CpuActivations::from_vec(1, 3, vec![-100.0, 0.5, 100.0]).unwrap();
        backend.softcap(&mut logits, 30.0).unwrap();
        let want = [
            -30.0 * (100.0f32 / 30.0).tanh(),
            30.0 * (0.5f32 / 30.0).tanh(),
            30.0 * (100.0f32 / 30.0).tanh(),
        ];
        assert!(rel_err(logits.data(), &want) < 1e-6);
        assert!(backend.softcap(&mut logits, 0.0).is_err());
    }
}
