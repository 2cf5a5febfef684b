//! Router and predictor fitting on calibration points, and the routing
//! decisions both make (shared by evaluation and the superblock backend).

use mirage_route::{Aabb, RouterData};

use crate::ffn::dot;
use crate::linalg::{principal_components, ridge_least_squares};

/// What [`fit_layer_router`] returns.
#[derive(Debug, Clone)]
pub struct FittedRouter {
    /// Router data with tight boxes (margin 0).
    pub router: RouterData,
    /// Per slice and axis: std of the calibration points (the margin unit).
    pub margin_scale: Vec<f32>,
    /// Predictor feature projection (`rank` rows of `d_model`).
    pub predictor_proj: Vec<f32>,
    /// Predictor weights, per page `rank + 1`.
    pub predictor_weights: Vec<f32>,
}

/// Fits one layer's router and predictor.
///
/// `x`: FFN inputs of the fit tokens (`n * d`); `useful[t]`: oracle pages of
/// token `t`; pages `0..n_trunk` are the trunk (threshold 0, always on).
pub fn fit_layer_router(
    x: &[f32],
    d: usize,
    useful: &[Vec<usize>],
    n_pages: usize,
    n_trunk: usize,
    slices: usize,
    rank: usize,
) -> FittedRouter {
    let n = useful.len();
    let k = (3 * slices).max(rank);
    let (comps, _mean) = principal_components(x, d, k, 30);
    let projection = comps[..3 * slices * d].to_vec();
    let predictor_proj = comps[..rank * d].to_vec();
    // Slice points of every fit token.
    let mut pts = vec![[0f32; 3]; n * slices];
    for t in 0..n {
        let xt = &x[t * d..(t + 1) * d];
        for s in 0..slices {
            for a in 0..3 {
                pts[t * slices + s][a] = dot(&projection[(s * 3 + a) * d..(s * 3 + a + 1) * d], xt);
            }
        }
    }
    let mut margin_scale = vec![0f32; slices * 3];
    for s in 0..slices {
        for a in 0..3 {
            let m = (0..n).map(|t| pts[t * slices + s][a] as f64).sum::<f64>() / n.max(1) as f64;
            let v = (0..n)
                .map(|t| (pts[t * slices + s][a] as f64 - m).powi(2))
                .sum::<f64>()
                / n.max(1) as f64;
            margin_scale[s * 3 + a] = v.sqrt() as f32;
        }
    }
    let mut boxes = vec![Aabb::empty(); n_pages * slices];
    for (t, pages) in useful.iter().enumerate() {
        for &p in pages {
            for s in 0..slices {
                let z = pts[t * slices + s];
                boxes[p * slices + s] = boxes[p * slices + s].union(&Aabb::new(z, z));
            }
        }
    }
    // A page never useful on calibration text gets a point box at the
    // origin: it is a candidate only once the margin grows around it.
    for b in boxes.iter_mut() {
        if b.min[0].is_nan() || b.min[0] > b.max[0] {
            *b = Aabb::new([0.0; 3], [0.0; 3]);
        }
    }
    let thresholds = (0..n_pages)
        .map(|p| if p < n_trunk { 0 } else { slices as u32 })
        .collect();
    let router = RouterData {
        slices,
        boxes,
        thresholds,
        d_model: d,
        projection,
    };
    // Predictor: features = [V x, 1], targets = oracle membership.
    let f = rank + 1;
    let mut feats = vec![0f64; n * f];
    let mut targets = vec![0f64; n * n_pages];
    for t in 0..n {
        let xt = &x[t * d..(t + 1) * d];
        for r in 0..rank {
            feats[t * f + r] = dot(&predictor_proj[r * d..(r + 1) * d], xt) as f64;
        }
        feats[t * f + rank] = 1.0;
        for &p in &useful[t] {
            targets[t * n_pages + p] = 1.0;
        }
    }
    let w = ridge_least_squares(&feats, f, &targets, n_pages, 1e-4);
    FittedRouter {
        router,
        margin_scale,
        predictor_proj,
        predictor_weights: w.iter().map(|v| *v as f32).collect(),
    }
}

/// Predictor scores of one FFN input (one per page).
pub fn predictor_scores(
    proj: &[f32],
    weights: &[f32],
    rank: usize,
    d: usize,
    x: &[f32],
    out: &mut Vec<f32>,
) {
    let z: Vec<f32> = (0..rank)
        .map(|r| dot(&proj[r * d..(r + 1) * d], x))
        .collect();
    let pages = weights.len() / (rank + 1);
    out.clear();
    for p in 0..pages {
        let w = &weights[p * (rank + 1)..(p + 1) * (rank + 1)];
        out.push(dot(&w[..rank], &z) + w[rank]);
    }
}
