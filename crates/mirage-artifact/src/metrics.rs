//! The metrics of ../shared/DESIGN.md ("Metrics"), defined once here and used
//! by the builder, the superblock backend, `mirage-cli eval` and the tests.
//!
//! - oracle useful set: per token and layer, the fewest pages, taken in
//!   decreasing order of contribution norm `||W_down,p h_p||`, whose sum
//!   reproduces the dense FFN output to cosine >= [`ORACLE_COSINE`].
//! - largest pages at a fixed count ([`largest_pages`]): the first `k` pages
//!   of the same order, the set a router that knew every page's output would
//!   keep at a fixed active fraction.
//! - useful-page recall: `|active ∩ oracle| / |oracle|` (1 when the oracle is
//!   empty), averaged over tokens and layers. Active = trunk ∪ candidates.
//! - rejection: `1 - |routed candidates| / |routed pages|`.
//! - fidelity: final-logit cosine vs dense, top-1 agreement, perplexity.

/// Cosine the oracle set must reach against the dense FFN output.
pub const ORACLE_COSINE: f64 = 0.999;
/// Recall gate.
pub const RECALL_GATE: f64 = 0.995;
/// Final-logit cosine gate.
pub const COSINE_GATE: f64 = 0.996;

/// Cosine similarity of two vectors, in f64 (1 when both are zero, 0 when
/// exactly one is).
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (*x as f64, *y as f64);
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    if aa == 0.0 && bb == 0.0 {
        1.0
    } else if aa == 0.0 || bb == 0.0 {
        0.0
    } else {
        ab / (aa.sqrt() * bb.sqrt())
    }
}

/// Pages in decreasing order of contribution norm `||W_down,p h_p||`
/// (ties: lower index first), with the f64 sum of all contributions.
/// `contributions` holds one `d_model` vector per page, page-major.
fn pages_by_norm(contributions: &[f32], d_model: usize) -> (Vec<usize>, Vec<f64>) {
    let pages = contributions.len() / d_model;
    let mut total = vec![0f64; d_model];
    let mut norms = Vec::with_capacity(pages);
    for (p, page) in contributions.chunks_exact(d_model).enumerate() {
        let mut n = 0f64;
        for (t, v) in total.iter_mut().zip(page) {
            *t += *v as f64;
            n += (*v as f64) * (*v as f64);
        }
        norms.push((n, p));
    }
    norms.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    (norms.into_iter().map(|(_, p)| p).collect(), total)
}

/// Cosine of `partial` against `total` (whose squared norm is `tt` > 0);
/// `None` for a zero `partial`.
fn cosine_to_total(partial: &[f64], total: &[f64], tt: f64) -> Option<f64> {
    let (mut pt, mut pp) = (0f64, 0f64);
    for (s, t) in partial.iter().zip(total) {
        pt += s * t;
        pp += s * s;
    }
    (pp > 0.0).then(|| pt / (pp.sqrt() * tt.sqrt()))
}

/// The oracle useful set of one token at one layer.
///
/// `contributions` holds one `d_model` vector per page (`W_down,p h_p`),
/// page-major. Pages are taken by decreasing norm (ties: lower index first)
/// until their sum reaches cosine >= `target` against the sum of all pages.
/// Returns the chosen pages, ascending.
pub fn oracle_useful_set(contributions: &[f32], d_model: usize, target: f64) -> Vec<usize> {
    if d_model == 0 {
        return Vec::new();
    }
    let (order, total) = pages_by_norm(contributions, d_model);
    let page = |p: usize| &contributions[p * d_model..(p + 1) * d_model];
    let tt: f64 = total.iter().map(|v| v * v).sum();
    if tt == 0.0 {
        return Vec::new();
    }
    let mut partial = vec![0f64; d_model];
    let mut chosen = Vec::new();
    for p in order {
        for (s, v) in partial.iter_mut().zip(page(p)) {
            *s += *v as f64;
        }
        chosen.push(p);
        if cosine_to_total(&partial, &total, tt).is_some_and(|c| c >= target) {
            break;
        }
    }
    chosen.sort_unstable();
    chosen
}

/// The `k` pages with the largest contribution norms (the oracle's order,
/// ties: lower index first), ascending: the set a router that knew every
/// page's output would pick at a fixed budget of `k` pages.
pub fn largest_pages(contributions: &[f32], d_model: usize, k: usize) -> Vec<usize> {
    if d_model == 0 {
        return Vec::new();
    }
    let (mut order, _) = pages_by_norm(contributions, d_model);
    order.truncate(k);
    order.sort_unstable();
    order
}

/// For each of `counts`, the cosine against the sum of all pages of the sum
/// of the `count` pages with the largest contribution norms (the oracle's
/// order): how much of one token's FFN output a fixed budget of pages keeps
/// at best. Pages as in [`oracle_useful_set`]; a zero output gives cosine 1.
pub fn largest_pages_cosines(contributions: &[f32], d_model: usize, counts: &[usize]) -> Vec<f64> {
    if d_model == 0 {
        return vec![1.0; counts.len()];
    }
    let (order, total) = pages_by_norm(contributions, d_model);
    let tt: f64 = total.iter().map(|v| v * v).sum();
    let mut want: Vec<(usize, usize)> = counts
        .iter()
        .copied()
        .enumerate()
        .map(|(i, k)| (k.min(order.len()), i))
        .collect();
    want.sort_unstable();
    let mut out = vec![1.0; counts.len()];
    let mut partial = vec![0f64; d_model];
    let mut taken = 0;
    for (k, i) in want {
        for &p in &order[taken..k] {
            for (s, v) in partial
                .iter_mut()
                .zip(&contributions[p * d_model..(p + 1) * d_model])
            {
                *s += *v as f64;
            }
        }
        taken = k;
        if tt > 0.0 {
            out[i] = cosine_to_total(&partial, &total, tt).unwrap_or(0.0);
        }
    }
    out
}

/// Useful-page recall of one token/layer: the share of `oracle` that
/// `is_active` accepts (1 for an empty oracle set).
pub fn recall(oracle: &[usize], is_active: impl Fn(usize) -> bool) -> f64 {
    if oracle.is_empty() {
        return 1.0;
    }
    oracle.iter().filter(|&&p| is_active(p)).count() as f64 / oracle.len() as f64
}

/// Rejection of one token/layer: `1 - routed_candidates / routed_pages`
/// (1 when there are no routed pages).
pub fn rejection(routed_candidates: usize, routed_pages: usize) -> f64 {
    if routed_pages == 0 {
        1.0
    } else {
        1.0 - routed_candidates as f64 / routed_pages as f64
    }
}

/// Index of the largest value (first on ties); `None` for an empty slice.
pub fn argmax(v: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in v.iter().enumerate() {
        if best.is_none_or(|(_, b)| x > b) {
            best = Some((i, x));
        }
    }
    best.map(|(i, _)| i)
}

/// Negative log-likelihood of `target` under the softmax of `logits`.
pub fn nll(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = logits
        .iter()
        .map(|&x| (x as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    lse - logits.get(target).copied().unwrap_or(f32::NEG_INFINITY) as f64
}

/// The `q`-quantile (0..=1, nearest rank) of `values`; 0 when empty.
pub fn quantile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q.clamp(0.0, 1.0) * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// Mean of `values`; 0 when empty.
pub fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oracle_takes_largest_pages_first() {
        // page 0 tiny, page 1 large, page 2 medium, 2-d.
        let c = [0.001, 0.0, 10.0, 0.0, 0.0, 1.0];
        assert_eq!(oracle_useful_set(&c, 2, 0.999), vec![1, 2]);
        assert_eq!(oracle_useful_set(&c, 2, 0.9), vec![1]);
        assert_eq!(oracle_useful_set(&[0.0; 4], 2, 0.999), Vec::<usize>::new());
    }

    #[test]
    fn largest_pages_keep_the_oracle_order_at_a_fixed_count() {
        // Norms: page 0 0.001, page 1 10, page 2 1, page 3 1 (tie with 2: lower index wins).
        let c = [0.001, 0.0, 10.0, 0.0, 0.0, 1.0, 1.0, 0.0];
        assert_eq!(largest_pages(&c, 2, 1), vec![1]);
        assert_eq!(largest_pages(&c, 2, 2), vec![1, 2]);
        assert_eq!(largest_pages(&c, 2, 3), vec![1, 2, 3]);
        assert_eq!(largest_pages(&c, 2, 9), vec![0, 1, 2, 3]);
        assert_eq!(largest_pages(&c, 2, 0), Vec::<usize>::new());
    }

    #[test]
    fn largest_pages_cosines_follow_the_kept_sum() {
        // Pages (2-d): [3, 0], [0, 4], [0, 0]; total [3, 4].
        let c = [3.0, 0.0, 0.0, 4.0, 0.0, 0.0];
        let got = largest_pages_cosines(&c, 2, &[3, 0, 1, 2, 7]);
        // 1 page keeps [0, 4]: cosine 4/5; 2 and more keep everything.
        let want = [1.0, 0.0, 0.8, 1.0, 1.0];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{got:?}");
        }
        assert_eq!(largest_pages_cosines(&[0.0; 4], 2, &[1]), vec![1.0]);
    }

    #[test]
    fn quantiles_and_recall() {
        assert_eq!(quantile(&[3.0, 1.0, 2.0, 4.0], 0.5), 2.0);
        assert_eq!(quantile(&[3.0, 1.0, 2.0, 4.0], 0.99), 4.0);
        assert_eq!(recall(&[1, 2, 3, 4], |p| p != 4), 0.75);
        assert!((rejection(1, 4) - 0.75).abs() < 1e-12);
        assert!((cosine(&[1.0, 0.0], &[1.0, 1.0]) - 0.5f64.sqrt()).abs() < 1e-12);
    }
}
