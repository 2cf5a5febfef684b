//! Fitting activation sparsity on calibration text: score quantiles per
//! matrix, TEAL's block-wise greedy, and the allocations of a model-wide
//! target over the matrices.
//!
//! - [`quantile_tables`]: per matrix and criterion, the sorted calibration
//!   scores at [`QUANTILE_LEVELS`] + 1 levels (the threshold that skips a
//!   given share of them).
//! - [`block_greedy`]: TEAL's algorithm for one layer. Starting from
//!   every projection dense, each step tries raising each projection's
//!   sparsity by `step / w_p` (`w_p`: its parameters relative to the query's,
//!   so that every candidate removes the same number of weights), runs the
//!   layer on its calibration inputs with the candidate thresholds, and keeps
//!   the candidate with the least block-output error (mean over the last
//!   quarter of the positions of the L2 norm of the difference to the dense
//!   block output). The path records, per step, the block's
//!   parameter-weighted sparsity, the seven sparsities and the error.
//! - Allocations: [`uniform_rows`] (every matrix at the target),
//!   [`block_greedy_rows`] (TEAL: every layer at the target, the
//!   projections as its greedy path has them there) and
//!   [`sensitivity_rows`] (the layers' shares of the target chosen to
//!   minimise `sum_l kappa_l * E_l(s_l)^2`, where `E_l` is layer `l`'s
//!   greedy-path error and `kappa_l` its measured sensitivity: the mean KL
//!   divergence of the model's next-token distribution when layer `l` alone
//!   runs at a reference sparsity, over `E_l` there squared; a small
//!   perturbation of a layer's output moves the loss quadratically).

use mirage_runtime::backend::cpu::CpuActivations;
use mirage_runtime::backend::TokenSlot;
use mirage_runtime::{Backend, ModelConfig};

use super::backend::{ActivationBackend, Recording};
use super::format::{thresholds_for, MatrixScores, QUANTILE_LEVELS};
use super::graph::Graph;
use super::{matrix_index, Criterion, Proj};
use crate::error::{ArtifactError, Result};

/// Parameters of each projection of one layer, in [`Proj::ALL`] order.
pub fn param_counts(c: &ModelConfig) -> [f64; 7] {
    let (d, q, kv, ff) = (
        c.n_embd as f64,
        (c.n_head * c.head_dim) as f64,
        (c.n_head_kv * c.head_dim) as f64,
        c.n_ff as f64,
    );
    [d * q, d * kv, d * kv, q * d, d * ff, d * ff, ff * d]
}

/// Parameter-weighted mean of a layer's seven sparsities.
pub fn effective(sp: &[f32; 7], w: &[f64; 7]) -> f32 {
    let tot: f64 = w.iter().sum();
    (sp.iter().zip(w).map(|(s, w)| *s as f64 * w).sum::<f64>() / tot) as f32
}

/// Quantile tables of every matrix from its recorded inputs (`rows x cols`
/// each) and column norms.
pub fn quantile_tables(recording: &Recording, col_norms: &[Vec<f32>]) -> Result<Vec<MatrixScores>> {
    let mut out = Vec::with_capacity(col_norms.len());
    for (m, norms) in col_norms.iter().enumerate() {
        let x = recording.get(m).map(|v| v.as_slice()).unwrap_or(&[]);
        let cols = norms.len();
        if cols == 0 || x.is_empty() || x.len() % cols != 0 {
            return Err(ArtifactError::InvalidArgument(format!(
                "matrix {m}: {} recorded values for {cols} columns",
                x.len()
            )));
        }
        let table = |score: &dyn Fn(usize, f32) -> f32| -> Vec<f32> {
            let mut v: Vec<f32> = x
                .iter()
                .enumerate()
                .map(|(k, &a)| score(k % cols, a))
                .collect();
            v.sort_unstable_by(|a, b| a.total_cmp(b));
            (0..=QUANTILE_LEVELS)
                .map(|k| {
                    let pos = (k * (v.len() - 1)) / QUANTILE_LEVELS;
                    v[pos]
                })
                .collect()
        };
        let teal = table(&|_, a| a.abs());
        let wina = table(&|i, a| a.abs() * norms[i]);
        out.push(MatrixScores {
            col_norms: norms.clone(),
            quantiles: [teal, wina],
        });
    }
    Ok(out)
}

/// One point of a layer's greedy path.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PathPoint {
    /// Parameter-weighted sparsity of the layer.
    pub eff: f32,
    /// Sparsity of each projection ([`Proj::ALL`] order).
    pub sp: [f32; 7],
    /// Block-output error there.
    pub err: f32,
}

/// Settings of the greedy search.
#[derive(Debug, Clone, Copy)]
pub struct GreedyOptions {
    /// Parameter-weighted sparsity one step adds to the layer.
    pub step: f32,
    /// The path stops at this layer sparsity.
    pub max_sparsity: f32,
    /// Share of the positions (the last ones) the error is measured on.
    pub last_fraction: f32,
}

impl Default for GreedyOptions {
    fn default() -> Self {
        GreedyOptions {
            step: 0.025,
            max_sparsity: 0.85,
            last_fraction: 0.25,
        }
    }
}

/// The highest sparsity a single matrix is given.
pub const MAX_MATRIX_SPARSITY: f32 = 0.99;

fn set_layer(
    backend: &ActivationBackend,
    scores: &[MatrixScores],
    criterion: Criterion,
    l: usize,
    sp: &[f32; 7],
) {
    for p in Proj::ALL {
        let s = &scores[matrix_index(l, p)];
        backend.set_matrix_thresholds(l, p, thresholds_for(s, criterion, sp[p.index()]));
    }
}

/// Runs layer `l` of `graph` on `x_in` (`n x d`, one sequence from position
/// 0) and returns the output rows.
fn run_layer(
    graph: &Graph<ActivationBackend>,
    l: usize,
    x_in: &[f32],
    d: usize,
) -> Result<Vec<f32>> {
    let n = x_in.len() / d;
    let slots: Vec<TokenSlot> = (0..n).map(|pos| TokenSlot { seq: 0, pos }).collect();
    let mut cache = graph.new_cache(n)?;
    let mut s = graph.scratch();
    let mut x = CpuActivations::from_vec(n, d, x_in.to_vec())?;
    graph
        .backend()
        .run(|| graph.layer(l, &mut x, &slots, &mut cache, &mut s))?;
    Ok(x.data().to_vec())
}

fn block_error(a: &[f32], b: &[f32], d: usize, first_row: usize) -> f32 {
    let rows = a.len() / d;
    let mut sum = 0f64;
    for r in first_row..rows {
        let e: f64 = a[r * d..(r + 1) * d]
            .iter()
            .zip(&b[r * d..(r + 1) * d])
            .map(|(x, y)| ((x - y) as f64).powi(2))
            .sum();
        sum += e.sqrt();
    }
    (sum / (rows - first_row).max(1) as f64) as f32
}

/// TEAL's block-wise greedy path of layer `l` (see the module doc), on the
/// layer's calibration inputs `x_in` (`n x d`). Leaves the layer dense.
pub fn block_greedy(
    graph: &Graph<ActivationBackend>,
    scores: &[MatrixScores],
    criterion: Criterion,
    l: usize,
    x_in: &[f32],
    opts: &GreedyOptions,
) -> Result<Vec<PathPoint>> {
    let c = graph.config();
    let d = c.n_embd;
    let backend = graph.backend();
    let w = param_counts(c);
    let w_q = w[0];
    let total_rel: f64 = w.iter().map(|x| x / w_q).sum();
    let base = opts.step as f64 * total_rel;
    let first_row = ((x_in.len() / d) as f32 * (1.0 - opts.last_fraction)) as usize;
    let mut sp = [0f32; 7];
    set_layer(backend, scores, criterion, l, &sp);
    let dense = run_layer(graph, l, x_in, d)?;
    let mut path = vec![PathPoint {
        eff: 0.0,
        sp,
        err: 0.0,
    }];
    while effective(&sp, &w) < opts.max_sparsity {
        let mut best: Option<(f32, usize, f32)> = None;
        for p in Proj::ALL {
            let i = p.index();
            if sp[i] >= MAX_MATRIX_SPARSITY {
                continue;
            }
            let step = (base / (w[i] / w_q)) as f32;
            let mut cand = sp;
            cand[i] = (sp[i] + step).min(MAX_MATRIX_SPARSITY);
            set_layer(backend, scores, criterion, l, &cand);
            let out = run_layer(graph, l, x_in, d)?;
            let err = block_error(&out, &dense, d, first_row);
            if best.is_none_or(|b| err < b.0) {
                best = Some((err, i, cand[i]));
            }
        }
        let Some((err, i, v)) = best else { break };
        sp[i] = v;
        path.push(PathPoint {
            eff: effective(&sp, &w),
            sp,
            err,
        });
    }
    set_layer(backend, scores, criterion, l, &[0.0; 7]);
    Ok(path)
}

/// The path's point at layer sparsity `s` (linear between steps; past the
/// end, the last point).
pub fn path_at(path: &[PathPoint], s: f32) -> PathPoint {
    if s <= 0.0 || path.len() == 1 {
        return path[0];
    }
    let k = path.partition_point(|p| p.eff < s);
    if k >= path.len() {
        return *path.last().expect("non-empty");
    }
    let (a, b) = (path[k - 1], path[k]);
    let w = if b.eff > a.eff {
        (s - a.eff) / (b.eff - a.eff)
    } else {
        1.0
    };
    let mut sp = [0f32; 7];
    for i in 0..7 {
        sp[i] = a.sp[i] + w * (b.sp[i] - a.sp[i]);
    }
    PathPoint {
        eff: s,
        sp,
        err: a.err + w * (b.err - a.err),
    }
}

/// Every matrix at the target.
pub fn uniform_rows(n_layer: usize, targets: &[f32]) -> Vec<Vec<f32>> {
    targets
        .iter()
        .map(|&t| vec![t; n_layer * Proj::ALL.len()])
        .collect()
}

/// TEAL's allocation: every layer at the target, along its greedy path.
pub fn block_greedy_rows(paths: &[Vec<PathPoint>], targets: &[f32]) -> Vec<Vec<f32>> {
    targets
        .iter()
        .map(|&t| paths.iter().flat_map(|p| path_at(p, t).sp).collect())
        .collect()
}

/// The layers' shares of each target by least `sum_l kappa_l E_l(s_l)^2`
/// (marginal-cost greedy in steps of `delta`), each layer along its path.
pub fn sensitivity_rows(paths: &[Vec<PathPoint>], kappa: &[f64], targets: &[f32]) -> Vec<Vec<f32>> {
    const DELTA: f32 = 0.005;
    let n = paths.len();
    let cost = |l: usize, s: f32| kappa[l] * (path_at(&paths[l], s).err as f64).powi(2);
    let cap: Vec<f32> = paths
        .iter()
        .map(|p| p.last().map_or(0.0, |q| q.eff))
        .collect();
    let mut s = vec![0f32; n];
    let mut rows = Vec::with_capacity(targets.len());
    for &t in targets {
        while s.iter().sum::<f32>() / (n as f32) < t - 1e-6 {
            let best = (0..n)
                .filter(|&l| s[l] + DELTA <= cap[l] + 1e-6)
                .map(|l| (cost(l, s[l] + DELTA) - cost(l, s[l]), l))
                .min_by(|a, b| a.0.total_cmp(&b.0));
            match best {
                Some((_, l)) => s[l] += DELTA,
                None => break,
            }
        }
        rows.push((0..n).flat_map(|l| path_at(&paths[l], s[l]).sp).collect());
    }
    rows
}

/// Mean negative log-likelihood of `tokens` (next-token) from logits.
pub fn mean_nll(logits: &[f32], tokens: &[u32], vocab: usize) -> f64 {
    let n = tokens.len().saturating_sub(1);
    let s: f64 = (0..n)
        .map(|i| crate::metrics::nll(&logits[i * vocab..(i + 1) * vocab], tokens[i + 1] as usize))
        .sum();
    s / n.max(1) as f64
}

/// Mean KL(dense || sparse) of the next-token distributions.
pub fn mean_kl(dense: &[f32], sparse: &[f32], vocab: usize) -> f64 {
    let rows = dense.len() / vocab;
    let mut tot = 0f64;
    for r in 0..rows {
        let (a, b) = (
            &dense[r * vocab..(r + 1) * vocab],
            &sparse[r * vocab..(r + 1) * vocab],
        );
        let lse = |v: &[f32]| {
            let m = v.iter().fold(f32::NEG_INFINITY, |m, x| m.max(*x)) as f64;
            m + v.iter().map(|x| (*x as f64 - m).exp()).sum::<f64>().ln()
        };
        let (la, lb) = (lse(a), lse(b));
        tot += a
            .iter()
            .zip(b)
            .map(|(x, y)| {
                let pa = (*x as f64 - la).exp();
                pa * ((*x as f64 - la) - (*y as f64 - lb))
            })
            .sum::<f64>();
    }
    tot / rows.max(1) as f64
}

/// Per-channel thresholds of every matrix for the per-matrix sparsities `row`.
pub fn thresholds_row(
    scores: &[MatrixScores],
    criterion: Criterion,
    row: &[f32],
) -> Vec<Option<Vec<f32>>> {
    scores
        .iter()
        .zip(row)
        .map(|(s, &sp)| thresholds_for(s, criterion, sp))
        .collect()
}
