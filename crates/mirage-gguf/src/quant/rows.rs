//! Multi-row dot products: one weight row against [`DOT_ROWS`] activation
//! rows at once, for batched matrix products (prompt prefill).
//!
//! A single-row kernel re-reads and re-unpacks each weight block for every
//! token; the multi-row kernels unpack it once and pair it with the same
//! block of every activation row, which is where prefill gets its speed
//! over decode. Types without a dedicated kernel get a wrapper that calls
//! the single-row kernel per activation row, so [`dot_rows_fn`] answers for
//! every type [`super::dot_fn`] answers for.

use crate::types::GgmlType;

/// Activation rows per multi-row call.
pub const DOT_ROWS: usize = 4;

/// An unchecked multi-row kernel: `out[j] = weights · act[j * act_row_bytes..]`
/// for `j < DOT_ROWS`.
///
/// # Safety
/// As [`super::DotFn`] for each of the [`DOT_ROWS`] activation rows:
/// `n` is a multiple of the weight type's block size, `weights` holds `n`
/// elements of the weight type, and `act` holds `DOT_ROWS` rows of `n`
/// elements of [`super::vec_dot_type`] of it, row `j` starting at byte
/// `j * act_row_bytes`.
pub type DotRowsFn = unsafe fn(
    n: usize,
    weights: &[u8],
    act: &[u8],
    act_row_bytes: usize,
    out: &mut [f32; DOT_ROWS],
);

/// Calls the single-row kernel of `ty` (SIMD when `SIMD`) once per row.
///
/// # Safety
/// [`DotRowsFn`]'s contract.
unsafe fn rows_via_single<const T: u32, const SIMD: bool>(
    n: usize,
    weights: &[u8],
    act: &[u8],
    act_row_bytes: usize,
    out: &mut [f32; DOT_ROWS],
) {
    let kernel = GgmlType::from_id(T).and_then(|ty| {
        if SIMD {
            super::dot_fn(ty)
        } else {
            super::scalar_dot_fn(ty)
        }
    });
    for (j, o) in out.iter_mut().enumerate() {
        *o = match kernel {
            // SAFETY: the caller upholds DotFn's contract for every row.
            Some(k) => unsafe { k(n, weights, &act[j * act_row_bytes..]) },
            None => f32::NAN,
        };
    }
}

fn via_single<const SIMD: bool>(ty: GgmlType) -> DotRowsFn {
    use GgmlType::*;
    match ty {
        F32 => rows_via_single::<{ F32 as u32 }, SIMD>,
        F16 => rows_via_single::<{ F16 as u32 }, SIMD>,
        BF16 => rows_via_single::<{ BF16 as u32 }, SIMD>,
        Q4_0 => rows_via_single::<{ Q4_0 as u32 }, SIMD>,
        Q4_1 => rows_via_single::<{ Q4_1 as u32 }, SIMD>,
        Q5_0 => rows_via_single::<{ Q5_0 as u32 }, SIMD>,
        Q5_1 => rows_via_single::<{ Q5_1 as u32 }, SIMD>,
        Q8_0 => rows_via_single::<{ Q8_0 as u32 }, SIMD>,
        Q8_1 => rows_via_single::<{ Q8_1 as u32 }, SIMD>,
        Q2_K => rows_via_single::<{ Q2_K as u32 }, SIMD>,
        Q3_K => rows_via_single::<{ Q3_K as u32 }, SIMD>,
        Q4_K => rows_via_single::<{ Q4_K as u32 }, SIMD>,
        Q5_K => rows_via_single::<{ Q5_K as u32 }, SIMD>,
        Q6_K => rows_via_single::<{ Q6_K as u32 }, SIMD>,
        Q8_K => rows_via_single::<{ Q8_K as u32 }, SIMD>,
    }
}

/// The portable multi-row kernel of `ty`: the scalar single-row kernel per
/// activation row (the reference the SIMD multi-row kernels are tested
/// against).
pub fn scalar_dot_rows_fn(ty: GgmlType) -> DotRowsFn {
    via_single::<false>(ty)
}

/// The fastest multi-row kernel of `ty` on this CPU: a dedicated AVX2
/// kernel for the 32-element block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0),
/// else the fastest single-row kernel once per activation row. See
/// [`DotRowsFn`] for the contract.
pub fn dot_rows_fn(ty: GgmlType) -> DotRowsFn {
    #[cfg(target_arch = "x86_64")]
    {
        if super::avx2::available() {
            if let Some(k) = super::avx2::dot_rows_fn(ty) {
                return k;
            }
        }
    }
    via_single::<true>(ty)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{quantize, row_bytes, vec_dot, vec_dot_type};

    /// Deterministic values in about [-2, 2] (an LCG; no dependency).
    fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            })
            .collect()
    }

    #[test]
    fn multi_row_kernels_equal_single_row_dots() {
        use GgmlType::*;
        for ty in [
            F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
        ] {
            for n in [256usize, 512, 1536] {
                let act_ty = vec_dot_type(ty);
                let (wb, ab) = (row_bytes(ty, n).unwrap(), row_bytes(act_ty, n).unwrap());
                let mut w = vec![0u8; wb];
                quantize(ty, &values(ty as u64 * 31 + n as u64, n), &mut w).unwrap();
                // Activation rows with a gap after each, so a kernel that
                // ignores the stride reads the wrong bytes.
                let stride = ab + 7;
                let mut act = vec![0u8; stride * DOT_ROWS];
                for j in 0..DOT_ROWS {
                    let x = values(1000 + j as u64 * 7 + n as u64, n);
                    quantize(act_ty, &x, &mut act[j * stride..j * stride + ab]).unwrap();
                }
                for (which, kernel) in [
                    ("fastest", dot_rows_fn(ty)),
                    ("scalar", scalar_dot_rows_fn(ty)),
                ] {
                    let mut out = [0f32; DOT_ROWS];
                    // SAFETY: lengths built above to the contract.
                    unsafe { kernel(n, &w, &act, stride, &mut out) };
                    for j in 0..DOT_ROWS {
                        let single = vec_dot(ty, n, &w, &act[j * stride..j * stride + ab]).unwrap();
                        let tol = 1e-5 * single.abs().max(n as f32 * 0.05);
                        assert!(
                            (out[j] - single).abs() <= tol,
                            "{ty} n={n} {which} row {j}: {} vs single {single}",
                            out[j]
                        );
                    }
                }
            }
        }
    }
}
