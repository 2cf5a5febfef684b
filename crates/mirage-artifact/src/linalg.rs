//! The little dense linear algebra the router and predictor fits need:
//! principal components (subspace iteration) and ridge least squares
//! (Cholesky). Deterministic: fixed start vectors, fixed loop orders.

/// The top `k` principal directions of `x` (`n` rows of `d`), as `k` rows of
/// `d` (unit length, orthogonal), largest variance first; and the mean.
pub fn principal_components(
    x: &[f32],
    d: usize,
    k: usize,
    iterations: usize,
) -> (Vec<f32>, Vec<f32>) {
    let n = x.len().checked_div(d).unwrap_or(0);
    let mut mean = vec![0f64; d];
    for r in 0..n {
        for (m, v) in mean.iter_mut().zip(&x[r * d..(r + 1) * d]) {
            *m += *v as f64;
        }
    }
    mean.iter_mut().for_each(|m| *m /= n.max(1) as f64);
    // Covariance d x d (f64, upper then mirrored).
    let mut cov = vec![0f64; d * d];
    let mut c = vec![0f64; d];
    for r in 0..n {
        for (j, cj) in c.iter_mut().enumerate() {
            *cj = x[r * d + j] as f64 - mean[j];
        }
        for i in 0..d {
            let ci = c[i];
            let row = &mut cov[i * d..(i + 1) * d];
            for j in i..d {
                row[j] += ci * c[j];
            }
        }
    }
    for i in 0..d {
        for j in 0..i {
            cov[i * d + j] = cov[j * d + i];
        }
    }
    // Subspace iteration from a fixed pseudo-random start.
    let k = k.min(d);
    let mut q = vec![0f64; k * d];
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for v in q.iter_mut() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        *v = (state >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
    }
    orthonormalize(&mut q, d);
    let mut z = vec![0f64; k * d];
    for _ in 0..iterations {
        for a in 0..k {
            let qa = &q[a * d..(a + 1) * d];
            for i in 0..d {
                z[a * d + i] = cov[i * d..(i + 1) * d]
                    .iter()
                    .zip(qa)
                    .map(|(c, v)| c * v)
                    .sum();
            }
        }
        std::mem::swap(&mut q, &mut z);
        orthonormalize(&mut q, d);
    }
    // Order by Rayleigh quotient (variance), largest first.
    let mut order: Vec<(f64, usize)> = (0..k)
        .map(|a| {
            let qa = &q[a * d..(a + 1) * d];
            let var: f64 = (0..d)
                .map(|i| {
                    qa[i]
                        * cov[i * d..(i + 1) * d]
                            .iter()
                            .zip(qa)
                            .map(|(c, v)| c * v)
                            .sum::<f64>()
                })
                .sum();
            (var, a)
        })
        .collect();
    order.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
    let comps = order
        .iter()
        .flat_map(|&(_, a)| q[a * d..(a + 1) * d].iter().map(|v| *v as f32))
        .collect();
    (comps, mean.iter().map(|m| *m as f32).collect())
}

/// Modified Gram-Schmidt on the rows of `q` (rows of length `d`).
fn orthonormalize(q: &mut [f64], d: usize) {
    let k = q.len() / d;
    for a in 0..k {
        for b in 0..a {
            let dotp: f64 = (0..d).map(|i| q[a * d + i] * q[b * d + i]).sum();
            for i in 0..d {
                q[a * d + i] -= dotp * q[b * d + i];
            }
        }
        let norm: f64 = (0..d)
            .map(|i| q[a * d + i] * q[a * d + i])
            .sum::<f64>()
            .sqrt();
        let inv = if norm > 0.0 { 1.0 / norm } else { 0.0 };
        for i in 0..d {
            q[a * d + i] *= inv;
        }
    }
}

/// Ridge least squares: `W` (`outputs x f`) minimising `|F W^T - Y|^2 +
/// lambda |W|^2`, with `F` `n x f` features and `Y` `n x outputs` targets.
pub fn ridge_least_squares(
    features: &[f64],
    f: usize,
    targets: &[f64],
    outputs: usize,
    lambda: f64,
) -> Vec<f64> {
    let n = features.len().checked_div(f).unwrap_or(0);
    let mut a = vec![0f64; f * f];
    let mut b = vec![0f64; f * outputs];
    for r in 0..n {
        let fr = &features[r * f..(r + 1) * f];
        let yr = &targets[r * outputs..(r + 1) * outputs];
        for i in 0..f {
            for j in 0..f {
                a[i * f + j] += fr[i] * fr[j];
            }
            for o in 0..outputs {
                b[i * outputs + o] += fr[i] * yr[o];
            }
        }
    }
    let trace: f64 = (0..f).map(|i| a[i * f + i]).sum::<f64>() / f.max(1) as f64;
    for i in 0..f {
        a[i * f + i] += lambda * trace.max(1e-12);
    }
    // Cholesky A = L L^T.
    let mut l = vec![0f64; f * f];
    for i in 0..f {
        for j in 0..=i {
            let s: f64 = a[i * f + j] - (0..j).map(|k| l[i * f + k] * l[j * f + k]).sum::<f64>();
            l[i * f + j] = if i == j {
                s.max(1e-300).sqrt()
            } else {
                s / l[j * f + j]
            };
        }
    }
    let mut w = vec![0f64; outputs * f];
    for o in 0..outputs {
        let mut y: Vec<f64> = (0..f).map(|i| b[i * outputs + o]).collect();
        for i in 0..f {
            y[i] = (y[i] - (0..i).map(|k| l[i * f + k] * y[k]).sum::<f64>()) / l[i * f + i];
        }
        for i in (0..f).rev() {
            y[i] = (y[i] - (i + 1..f).map(|k| l[k * f + i] * y[k]).sum::<f64>()) / l[i * f + i];
        }
        w[o * f..(o + 1) * f].copy_from_slice(&y);
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pca_finds_dominant_axis() {
        // Points spread along (1, 1, 0)/sqrt2 with small noise on z.
        let mut x = Vec::new();
        for i in 0..200 {
            let t = (i as f32 - 100.0) / 10.0;
            x.extend_from_slice(&[t, t, ((i * 7) % 5) as f32 * 0.01]);
        }
        let (c, _) = principal_components(&x, 3, 1, 50);
        let s = std::f32::consts::FRAC_1_SQRT_2;
        assert!(
            (c[0].abs() - s).abs() < 1e-4 && (c[1].abs() - s).abs() < 1e-4 && c[2].abs() < 1e-3,
            "{c:?}"
        );
    }

    #[test]
    fn least_squares_recovers_linear_map() {
        let mut f = Vec::new();
        let mut y = Vec::new();
        for i in 0..50 {
            let a = i as f64 * 0.1;
            let b = ((i * 13) % 7) as f64;
            f.extend_from_slice(&[a, b, 1.0]);
            y.push(2.0 * a - 3.0 * b + 0.5);
        }
        let w = ridge_least_squares(&f, 3, &y, 1, 0.0);
        assert!(
            (w[0] - 2.0).abs() < 1e-6 && (w[1] + 3.0).abs() < 1e-6 && (w[2] - 0.5).abs() < 1e-6,
            "{w:?}"
        );
    }
}
