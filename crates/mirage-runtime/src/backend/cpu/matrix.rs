//! The CPU backend's weights: a quantized matrix and the dot products over
//! its rows ([`CpuMatrix`]), an FFN's three matrices ([`CpuFfn`]), and how a
//! matrix is made from host bytes and how activation rows are encoded for it.

use mirage_gguf::quant::{self, DotFn, DotRowsFn, GemmFn, MatvecFn, DOT_ROWS};
use mirage_gguf::GgmlType;

use super::parallel::{pack_rows, quantize_rows};
use super::CpuBackend;
use crate::backend::{FfnActivation, HostMatrix, SharedBytes};
use crate::error::{Result, RuntimeError};

/// A quantized weight matrix, memory-mapped (zero copy).
#[derive(Debug)]
pub struct CpuMatrix {
    pub(super) name: String,
    pub(super) ty: GgmlType,
    pub(super) rows: usize,
    pub(super) cols: usize,
    row_bytes: usize,
    pub(super) act_ty: GgmlType,
    dot: DotFn,
    dot_rows: DotRowsFn,
    /// Weights with a SIMD GEMM kernel: batches of [`GEMM_MIN_TOKENS`] or
    /// more rows go through it on packed activations.
    gemm: Option<GemmFn>,
    /// Weights with a SIMD matrix-vector kernel (decode).
    matvec: Option<MatvecFn>,
    /// Exact mode: dequantize each row once per call and dot it in f32.
    pub(super) f32_activations: bool,
    /// Deterministic mode: every (weight row, activation row) pair by the
    /// one-row kernel `dot`, whatever the batch (see [`CpuMatrix::rows_dots`]).
    deterministic: bool,
    pub(super) data: SharedBytes,
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
    pub(super) fn row(&self, r: usize) -> &[u8] {
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
                // Decode: one activation row. The rows stream front to
                // back, as in the mat-vec kernels: ask for those ahead.
                quant::prefetch_ahead(wr);
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
    pub(super) fn rows_dots(
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
pub(super) enum ActRows<'a> {
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

/// One layer's FFN on the CPU.
#[derive(Debug)]
pub struct CpuFfn {
    pub(super) gate: CpuMatrix,
    pub(super) up: CpuMatrix,
    pub(super) down: CpuMatrix,
    pub(super) activation: FfnActivation,
}

impl CpuBackend {
    pub(super) fn make_matrix(&self, m: &HostMatrix) -> Result<CpuMatrix> {
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
    pub(super) fn encode<'a>(
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
    pub(super) fn packs(w: &CpuMatrix, n: usize) -> bool {
        w.gemm.is_some() && !w.deterministic && n >= GEMM_MIN_TOKENS
    }
}
