//! The budget solver: per layer, how many pages to keep (prefix slicing:
//! the coldest routed pages go first) and which quantization, so that the
//! artifact file fits a byte budget while losing as little measured
//! calibration fidelity as possible.
//!
//! Loss model, from calibration: dropping page `p` of a layer loses its mean
//! energy share `E|W_down,p h_p|^2 / |y|^2`; quantizing a layer to `q` costs
//! its measured relative squared weight error. Greedy: repeatedly take the
//! move (drop one page, or step one layer down the quant ladder) with the
//! least loss per byte saved, until the file fits.

use mirage_gguf::GgmlType;

use crate::error::{ArtifactError, Result};
use crate::format::{page_stride, PAGE_ALIGN};

/// Calibration facts the solver needs about one layer.
#[derive(Debug, Clone)]
pub struct BudgetLayer {
    /// Per page (stored order), mean energy share on calibration tokens.
    pub page_energy: Vec<f64>,
    /// The quant ladder (largest first) with each type's relative error.
    pub quant_err: Vec<(GgmlType, f64)>,
}

/// One layer of a plan.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanLayer {
    /// Pages kept.
    pub pages: usize,
    /// Quantization.
    pub quant: GgmlType,
    /// Estimated loss (energy share dropped + quant error).
    pub est_loss: f64,
}

/// The solver's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetPlan {
    /// Per layer.
    pub layers: Vec<PlanLayer>,
    /// Upper bound of the file size of this plan.
    pub total_bytes: u64,
    /// The budget asked for.
    pub budget: u64,
}

fn align(n: u64) -> u64 {
    n.div_ceil(PAGE_ALIGN as u64) * PAGE_ALIGN as u64
}

/// Upper bound of every byte of an artifact except the packed pages.
pub fn fixed_bytes(
    n_layer: usize,
    d: usize,
    n_ff: usize,
    pages: usize,
    slices: usize,
    rank: usize,
) -> u64 {
    let (l, d, f, p, s, r) = (
        n_layer as u64,
        d as u64,
        n_ff as u64,
        pages as u64,
        slices as u64,
        rank as u64,
    );
    let header = align(96 + 6 * 64);
    let meta = align(4096);
    let layers = align(l * (32 + 4 * f + 4 * p));
    let router = align(l * (8 + 24 + 4 * p + 24 * p * s + 12 * s * d + 12 * s));
    let predict = align(l * (8 + 4 * r * d + 4 * p * (r + 1)));
    let calib = align(l * 8 * f);
    header + meta + layers + router + predict + calib + PAGE_ALIGN as u64
}

/// Solves for a plan that fits `budget` bytes, or says how small it can go.
pub fn solve_budget(
    layers: &[BudgetLayer],
    d: usize,
    n_ff: usize,
    slices: usize,
    rank: usize,
    budget: u64,
) -> Result<BudgetPlan> {
    let n_pages = layers.first().map_or(0, |l| l.page_energy.len());
    let fixed = fixed_bytes(layers.len(), d, n_ff, n_pages, slices, rank);
    let stride = |q: GgmlType| -> Result<u64> { Ok(page_stride(q, d)? as u64) };
    let mut min = fixed;
    for l in layers {
        let q = l.quant_err.last().map(|x| x.0).unwrap_or(GgmlType::Q8_0);
        min += stride(q)?;
    }
    if budget < min {
        return Err(ArtifactError::BudgetTooSmall {
            budget,
            min_bytes: min,
        });
    }
    // State: (pages kept, index on the ladder).
    let mut state: Vec<(usize, usize)> = layers.iter().map(|l| (l.page_energy.len(), 0)).collect();
    let total = |state: &[(usize, usize)]| -> Result<u64> {
        let mut t = fixed;
        for (l, &(k, qi)) in layers.iter().zip(state) {
            t += k as u64 * stride(l.quant_err[qi].0)?;
        }
        Ok(t)
    };
    let mut size = total(&state)?;
    while size > budget {
        let mut best: Option<(f64, usize, bool)> = None;
        for (i, (l, &(k, qi))) in layers.iter().zip(&state).enumerate() {
            let s = stride(l.quant_err[qi].0)?;
            if k > 1 {
                let cost = l.page_energy[k - 1] / s as f64;
                if best.is_none_or(|b| cost < b.0) {
                    best = Some((cost, i, false));
                }
            }
            if qi + 1 < l.quant_err.len() {
                let saved = k as u64 * (s - stride(l.quant_err[qi + 1].0)?);
                if saved > 0 {
                    let cost = (l.quant_err[qi + 1].1 - l.quant_err[qi].1).max(0.0) / saved as f64;
                    if best.is_none_or(|b| cost < b.0) {
                        best = Some((cost, i, true));
                    }
                }
            }
        }
        let Some((_, i, is_quant)) = best else {
            return Err(ArtifactError::BudgetTooSmall {
                budget,
                min_bytes: min,
            });
        };
        if is_quant {
            state[i].1 += 1;
        } else {
            state[i].0 -= 1;
        }
        size = total(&state)?;
    }
    let plan_layers = layers
        .iter()
        .zip(&state)
        .map(|(l, &(k, qi))| PlanLayer {
            pages: k,
            quant: l.quant_err[qi].0,
            est_loss: l.page_energy[k..].iter().sum::<f64>() + l.quant_err[qi].1,
        })
        .collect();
    Ok(BudgetPlan {
        layers: plan_layers,
        total_bytes: size,
        budget,
    })
}

/// Parses sizes like `7.2GiB`, `300MB`, `512MiB`, `1000000`.
pub fn parse_size(s: &str) -> Result<u64> {
    let s = s.trim();
    let split = s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| ArtifactError::InvalidArgument(format!("bad size {s:?}")))?;
    let mul = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024.0 * 1024.0,
        "g" | "gb" => 1e9,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        u => {
            return Err(ArtifactError::InvalidArgument(format!(
                "unknown size unit {u:?}"
            )))
        }
    };
    if v.is_nan() || v < 0.0 {
        return Err(ArtifactError::InvalidArgument(format!("bad size {s:?}")));
    }
    Ok((v * mul) as u64)
}
