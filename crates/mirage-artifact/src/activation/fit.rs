//! Fitting activation sparsity on calibration text: score statistics per
//! matrix, TEAL's block-wise greedy, and the allocations of a model-wide
//! target over the matrices.
//!
//! Matrices are the seven projections of every layer (index `layer * 7 +
//! proj`) and, last, the lm head ([`head_index`]). A model-wide sparsity is
//! the share of the bytes of all of them that a decode step skips: the
//! quantity decode speed follows.
//!
//! - [`matrix_stats`]: per matrix and criterion, the calibration score at
//!   [`QUANTILE_LEVELS`] + 1 levels (the threshold that skips a given share
//!   of them) and the error curve `E(s)`: the mean per token of the output
//!   error energy `sum (x_i ||W[:, i]||)^2` of the channels that threshold
//!   skips (what the product loses, to first order, when columns are about
//!   orthogonal).
//! - [`block_greedy`]: TEAL's algorithm for one layer (the baseline). From
//!   every projection dense, each step tries raising each projection's
//!   sparsity by `step / w_p` (`w_p`: its parameters relative to the
//!   query's, so that every candidate removes the same number of weights),
//!   runs the layer on its calibration inputs with the candidate thresholds,
//!   and keeps the candidate with the least block-output error (mean over the
//!   last positions of the L2 norm of the difference to the dense output).
//! - Allocations: [`uniform_rows`] (every projection at the same sparsity),
//!   [`block_greedy_rows`] (TEAL: every layer at the same sparsity, its
//!   projections as its greedy path has them there) and
//!   [`sensitivity_rows`] (ours: every matrix's sparsity chosen to minimise
//!   `sum_m kappa_m E_m(s_m)` for the bytes skipped, where `kappa_m` is the
//!   matrix's measured sensitivity, the mean KL divergence of the model's
//!   next-token distribution per unit of error energy, fitted by
//!   [`fit_kappa`] from a few calibration passes), over the matrices whose
//!   channel runs are long enough for skipping to save time
//!   ([`skipping_pays`]).

use mirage_runtime::backend::cpu::CpuActivations;
use mirage_runtime::backend::TokenSlot;
use mirage_runtime::{Backend, ModelConfig};

use super::backend::ActivationBackend;
use super::format::{thresholds_for, MatrixScores, QUANTILE_LEVELS};
use super::graph::Graph;
use super::{matrix_index, Criterion, Proj};
use crate::error::Result;
use mirage_gguf::quant::channel_major::ChannelMajorLayout;

/// Index of the lm head in per-matrix tables of a model of `n_layer`
/// layers (after the projections).
pub fn head_index(n_layer: usize) -> usize {
    n_layer * Proj::ALL.len()
}

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

/// Byte-weighted sparsity of a row of per-matrix sparsities.
pub fn byte_sparsity(row: &[f32], bytes: &[f64]) -> f64 {
    let tot: f64 = bytes.iter().sum();
    row.iter()
        .zip(bytes)
        .map(|(s, b)| *s as f64 * b)
        .sum::<f64>()
        / tot.max(1.0)
}

/// One criterion's statistics of one matrix's calibration inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct CriterionStats {
    /// The score at sparsity `k / QUANTILE_LEVELS`.
    pub quantiles: Vec<f32>,
    /// The mean per token of the skipped channels' error energy at
    /// sparsity `k / QUANTILE_LEVELS`.
    pub error: Vec<f64>,
}

/// Statistics of one matrix from its recorded inputs `x` (`rows x cols`,
/// row-major) and column norms, per criterion ([`Criterion::ALL`] order).
pub fn matrix_stats(x: &[f32], norms: &[f32]) -> Vec<CriterionStats> {
    let cols = norms.len().max(1);
    let rows = (x.len() / cols).max(1);
    Criterion::ALL
        .iter()
        .map(|&c| {
            let mut v: Vec<(f32, f32)> = x
                .iter()
                .enumerate()
                .map(|(k, &a)| {
                    let n = norms[k % cols];
                    let score = match c {
                        Criterion::Teal => a.abs(),
                        Criterion::Wina => a.abs() * n,
                    };
                    (score, (a * n) * (a * n))
                })
                .collect();
            v.sort_unstable_by(|a, b| a.0.total_cmp(&b.0));
            let mut quantiles = Vec::with_capacity(QUANTILE_LEVELS + 1);
            let mut error = Vec::with_capacity(QUANTILE_LEVELS + 1);
            let mut acc = 0f64;
            let mut at = 0usize;
            for k in 0..=QUANTILE_LEVELS {
                let pos = (k * v.len()) / QUANTILE_LEVELS;
                while at < pos {
                    acc += v[at].1 as f64;
                    at += 1;
                }
                quantiles.push(v[pos.min(v.len() - 1)].0);
                error.push(acc / rows as f64);
            }
            CriterionStats { quantiles, error }
        })
        .collect()
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
            step: 0.05,
            max_sparsity: 0.8,
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

/// The projection sparsity that skips `target` of all matrices' bytes when
/// the head stays dense.
fn projection_share(target: f32, bytes: &[f64]) -> f32 {
    let (n, tot) = (bytes.len() - 1, bytes.iter().sum::<f64>());
    let proj: f64 = bytes[..n].iter().sum();
    ((target as f64 * tot / proj.max(1.0)) as f32).min(MAX_MATRIX_SPARSITY)
}

/// Every projection at the sparsity that skips `target` of the bytes
/// (`bytes`: per matrix, the head last; the head stays dense).
pub fn uniform_rows(bytes: &[f64], targets: &[f32]) -> Vec<Vec<f32>> {
    let n = bytes.len() - 1;
    targets
        .iter()
        .map(|&t| {
            let mut row = vec![projection_share(t, bytes); n];
            row.push(0.0);
            row
        })
        .collect()
}

/// TEAL's allocation: every layer at the sparsity that skips `target` of the
/// bytes, along its greedy path (the head stays dense).
pub fn block_greedy_rows(
    paths: &[Vec<PathPoint>],
    bytes: &[f64],
    targets: &[f32],
) -> Vec<Vec<f32>> {
    targets
        .iter()
        .map(|&t| {
            let s = projection_share(t, bytes);
            let mut row: Vec<f32> = paths.iter().flat_map(|p| path_at(p, s).sp).collect();
            row.push(0.0);
            row
        })
        .collect()
}

/// Per matrix sensitivity `kappa` from KL divergences measured with groups
/// of matrices sparsified at one reference level: `kl_layer[l]` (all
/// projections of layer `l`), `kl_proj[p]` (projection `p` of every layer)
/// and `kl_head` (the head alone), with `e_ref[m]` each matrix's error
/// energy there. Fits `kappa_{l,p} = a_l * b_p` so that the predicted KL of
/// each group, `sum kappa_m E_m`, matches the measured one (alternating
/// scaling), and `kappa_head = kl_head / E_head`.
pub fn fit_kappa(e_ref: &[f64], kl_layer: &[f64], kl_proj: &[f64; 7], kl_head: f64) -> Vec<f64> {
    let nl = kl_layer.len();
    let e = |l: usize, p: usize| e_ref[l * 7 + p].max(1e-30);
    let (mut a, mut b) = (vec![1f64; nl], [1f64; 7]);
    for _ in 0..100 {
        for l in 0..nl {
            let pred: f64 = (0..7).map(|p| b[p] * e(l, p)).sum();
            a[l] = kl_layer[l].max(1e-12) / pred;
        }
        for p in 0..7 {
            let pred: f64 = (0..nl).map(|l| a[l] * e(l, p)).sum();
            b[p] = kl_proj[p].max(1e-12) / pred;
        }
    }
    let mut kappa: Vec<f64> = (0..nl * 7).map(|m| a[m / 7] * b[m % 7]).collect();
    kappa.push(kl_head.max(1e-12) / e_ref[nl * 7].max(1e-30));
    kappa
}

/// The error curve `E(s)` of a matrix at any sparsity (linear between
/// levels).
pub fn error_at(error: &[f64], s: f32) -> f64 {
    let levels = error.len() - 1;
    let x = (s.clamp(0.0, 1.0) as f64 * levels as f64).min(levels as f64);
    let k = (x.floor() as usize).min(levels - 1);
    let w = x - k as f64;
    error[k] + w * (error[k + 1] - error[k])
}

/// The shortest channel run (bytes of one input channel's codes in a tile)
/// worth skipping. Shorter runs read slower through the channel-major
/// kernels than the row-major source does, or gain little with half of
/// them skipped: one thread, out of cache, Q4_K with 1,536 outputs
/// (768-byte runs) ran 0.75–0.85x the dense mat-vec with every channel and
/// 0.91–1.12x with half; Q6_K with 1,536 (1,152-byte runs) 1.00x and
/// 1.38x; Q4_K with 8,960 (4,480) 1.06x and 1.68x (`channel_major_bench`).
/// The hardware prefetchers follow a run within its 4 KiB page, and a
/// short run ends before they have ramped up.
pub const MIN_SKIPPED_RUN: usize = 1024;

/// Whether skipping channels of a matrix of this layout saves time: its
/// channel runs are at least [`MIN_SKIPPED_RUN`] bytes. A matrix left at
/// sparsity 0 runs on the row-major kernels of the source.
pub fn skipping_pays(layout: &ChannelMajorLayout) -> bool {
    layout.run_bytes(layout.tile_rows(0)) >= MIN_SKIPPED_RUN
}

/// Our allocation: per matrix the sparsity minimising the predicted loss
/// `sum_m kappa_m E_m(s_m)` for each target share of the bytes skipped
/// (marginal greedy in steps of 1/200 of a matrix, cheapest predicted loss
/// per byte first; the rows rise with the targets). Only the matrices
/// with `movable[m]` are sparsified; where they cannot reach a target the
/// row stops at what they give.
pub fn sensitivity_rows(
    bytes: &[f64],
    error: &[&[f64]],
    kappa: &[f64],
    targets: &[f32],
    movable: &[bool],
) -> Vec<Vec<f32>> {
    const STEP: f32 = 1.0 / 200.0;
    let n = bytes.len();
    let tot: f64 = bytes.iter().sum();
    let cost = |m: usize, s: f32| kappa[m] * error_at(error[m], s);
    let movable = |m: usize| movable.get(m).copied().unwrap_or(false);
    let mut s = vec![0f32; n];
    let mut skipped = 0f64;
    // Marginal cost per byte of each matrix's next step.
    let next = |m: usize, s: &[f32]| -> f64 {
        if !movable(m) || s[m] + STEP > MAX_MATRIX_SPARSITY + 1e-6 || bytes[m] <= 0.0 {
            return f64::INFINITY;
        }
        (cost(m, s[m] + STEP) - cost(m, s[m])) / (STEP as f64 * bytes[m])
    };
    let mut marg: Vec<f64> = (0..n).map(|m| next(m, &s)).collect();
    let mut rows = Vec::with_capacity(targets.len());
    for &t in targets {
        while skipped < t as f64 * tot - 1e-9 {
            let Some((m, _)) = marg
                .iter()
                .enumerate()
                .filter(|(_, c)| c.is_finite())
                .min_by(|a, b| a.1.total_cmp(b.1))
            else {
                break;
            };
            s[m] += STEP;
            skipped += STEP as f64 * bytes[m];
            marg[m] = next(m, &s);
        }
        rows.push(s.clone());
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

/// Per-channel thresholds of every matrix (the head last) for the
/// per-matrix sparsities `row`.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_give_quantiles_and_a_rising_error_curve() {
        let cols = 4;
        let norms = vec![1.0f32, 2.0, 1.0, 0.5];
        let x: Vec<f32> = (0..400)
            .map(|k| ((k * 37 % 101) as f32 - 50.0) / 10.0)
            .collect();
        let st = matrix_stats(&x, &norms);
        for c in &st {
            assert_eq!(c.quantiles.len(), QUANTILE_LEVELS + 1);
            assert!(c.quantiles.windows(2).all(|w| w[0] <= w[1]));
            assert!(c.error.windows(2).all(|w| w[0] <= w[1]));
            assert_eq!(c.error[0], 0.0);
        }
        // All skipped: the whole error energy per token.
        let total: f64 = x
            .iter()
            .enumerate()
            .map(|(k, a)| ((a * norms[k % cols]) as f64).powi(2))
            .sum::<f64>()
            / (x.len() / cols) as f64;
        for c in &st {
            let last = *c.error.last().unwrap();
            assert!((last - total).abs() < 1e-6 * total, "{last} vs {total}");
        }
    }

    #[test]
    fn sensitivity_rows_meet_targets_and_prefer_cheap_bytes() {
        // Two equal matrices, the second 10x as sensitive; a head twice as big.
        let bytes = vec![100.0, 100.0, 200.0];
        let lin: Vec<f64> = (0..=QUANTILE_LEVELS)
            .map(|k| (k as f64 / QUANTILE_LEVELS as f64).powi(2))
            .collect();
        let errs = vec![&lin[..], &lin[..], &lin[..]];
        let kappa = vec![1.0, 10.0, 1.0];
        let targets = [0.0f32, 0.1, 0.2, 0.4];
        let rows = sensitivity_rows(&bytes, &errs, &kappa, &targets, &[true, true, false]);
        for (r, &t) in rows.iter().zip(&targets) {
            let got = byte_sparsity(r, &bytes);
            assert!((got - t as f64).abs() < 0.01, "{got} vs {t}");
            assert_eq!(r[2], 0.0, "the head stays dense");
            assert!(r[0] >= r[1], "the cheaper matrix goes first: {r:?}");
        }
        for w in rows.windows(2) {
            assert!(w[0].iter().zip(&w[1]).all(|(a, b)| a <= b), "rows rise");
        }
        let with_head = sensitivity_rows(&bytes, &errs, &kappa, &targets, &[true; 3]);
        assert!(with_head[3][2] > 0.0, "the head takes its share");
        // Only the first matrix movable: it alone meets the targets up to
        // its 100 of 400 bytes (0.99 of it at most), then the rows stop.
        let one = sensitivity_rows(&bytes, &errs, &kappa, &targets, &[true, false, false]);
        assert!(one.iter().all(|r| r[1] == 0.0 && r[2] == 0.0), "{one:?}");
        assert!((byte_sparsity(&one[1], &bytes) - 0.1).abs() < 0.01);
        assert!(
            (one[3][0] - MAX_MATRIX_SPARSITY).abs() < 1e-3,
            "{:?}",
            one[3]
        );
    }

    #[test]
    fn kappa_fit_reproduces_separable_sensitivities() {
        let nl = 3;
        let a = [1.0, 2.0, 0.5];
        let b = [1.0, 3.0, 1.0, 0.2, 1.0, 1.0, 4.0];
        let e: Vec<f64> = (0..nl * 7 + 1).map(|m| 1.0 + (m % 5) as f64).collect();
        let kl_layer: Vec<f64> = (0..nl)
            .map(|l| (0..7).map(|p| a[l] * b[p] * e[l * 7 + p]).sum())
            .collect();
        let mut kl_proj = [0f64; 7];
        for p in 0..7 {
            kl_proj[p] = (0..nl).map(|l| a[l] * b[p] * e[l * 7 + p]).sum();
        }
        let k = fit_kappa(&e, &kl_layer, &kl_proj, 2.0 * e[nl * 7]);
        for l in 0..nl {
            for p in 0..7 {
                let want = a[l] * b[p];
                assert!((k[l * 7 + p] - want).abs() < 1e-6 * want, "({l},{p})");
            }
        }
        assert!((k[nl * 7] - 2.0).abs() < 1e-9);
    }

    #[test]
    fn uniform_rows_skip_the_target_share_of_all_bytes() {
        let bytes = vec![10.0, 30.0, 60.0];
        let rows = uniform_rows(&bytes, &[0.0, 0.2]);
        assert_eq!(rows[0], vec![0.0, 0.0, 0.0]);
        assert!((byte_sparsity(&rows[1], &bytes) - 0.2).abs() < 1e-6);
        assert_eq!(rows[1][2], 0.0);
    }
}
