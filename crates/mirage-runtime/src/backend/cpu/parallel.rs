//! The CPU backend's parallel loops on its rayon pool: activation rows
//! quantized and packed, a matrix's rows split into tasks, and the
//! transposes between weight-row-major and token-major results.

use mirage_gguf::quant;
use mirage_gguf::GgmlType;
use rayon::prelude::*;

use super::matrix::{ActRows, CpuMatrix};
use crate::error::{Result, RuntimeError};

thread_local! {
    /// Per-worker scratch of [`CpuMatrix::row_dots`] (a dequantized row) and
    /// of the fused FFN (gate and up results of one weight row), reused so
    /// that the parallel loops allocate nothing per task.
    pub(super) static ROW_SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
    /// Per-worker staging of [`pack_rows`]: one token group quantized
    /// before it is packed.
    static PACK_STAGING: std::cell::RefCell<Vec<u8>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Rows per parallel task of [`quantize_rows`]; fewer rows are quantized
/// on the calling thread (a decode step's one row costs less than a task).
const QUANTIZE_TASK_ROWS: usize = 8;

/// Quantizes each of `n` rows of `x` (width `cols`) into `ty`, into `dst`,
/// [`QUANTIZE_TASK_ROWS`] rows per pool task.
pub(super) fn quantize_rows(
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
pub(super) fn pack_rows(
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
pub(super) fn matmul_rows(
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
pub(super) fn transpose_par(
    pool: &rayon::ThreadPool,
    src: &[f32],
    rows: usize,
    cols: usize,
    dst: &mut [f32],
) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
