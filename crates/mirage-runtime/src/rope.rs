//! RoPE frequency scaling (context extension) as GGUF files declare it
//! (`{arch}.rope.scaling.type`, `.factor`, `.original_context_length`).
//!
//! Every supported scaling keeps the angle of pair `i` linear in the
//! position, `theta_i(p) = p * inv_freq_i`, and multiplies cos/sin by one
//! magnitude `mscale`; so a backend needs only a per-pair frequency table
//! ([`RopeScaling::inv_freqs`]) and [`RopeScaling::mscale`]:
//!
//! - linear (position interpolation): `inv_freq_i = base^(-2i/d) / factor`.
//! - YaRN, as llama.cpp's `rope_yarn` and transformers'
//!   `_compute_yarn_parameters` (beta_fast 32, beta_slow 1, ext_factor 1):
//!   pairs below the correction range keep their frequency (extrapolation),
//!   pairs above it are divided by `factor` (interpolation), a linear ramp in
//!   between; `mscale = 1 + 0.1 ln(factor)`.
//!
//! llama3-style scaling needs the `rope_freqs` tensor and is refused, as are
//! unknown types (a wrong rotation would give plausible-looking garbage).

use mirage_gguf::{ModelHparams, RopeScalingType};

use crate::error::{Result, RuntimeError};
use crate::ops::RopeAngles;

/// Which scaling rule.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum RopeScalingKind {
    /// Unscaled RoPE.
    #[default]
    None,
    /// Position interpolation: every frequency divided by the factor.
    Linear,
    /// YaRN ramp between extrapolated and interpolated frequencies.
    Yarn,
}

/// RoPE scaling parameters in the form the kernels use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeScaling {
    /// The rule.
    pub kind: RopeScalingKind,
    /// Context extension factor (`1 / freq_scale` in llama.cpp's terms).
    pub factor: f32,
    /// Context length the unscaled model was trained with (YaRN's correction
    /// range is computed from it).
    pub original_context_length: usize,
    /// YaRN: rotations per original context above which a pair extrapolates.
    pub beta_fast: f32,
    /// YaRN: rotations per original context below which a pair interpolates.
    pub beta_slow: f32,
}

impl Default for RopeScaling {
    fn default() -> Self {
        RopeScaling::none()
    }
}

impl RopeScaling {
    /// No scaling.
    pub const fn none() -> RopeScaling {
        RopeScaling {
            kind: RopeScalingKind::None,
            factor: 1.0,
            original_context_length: 0,
            beta_fast: 32.0,
            beta_slow: 1.0,
        }
    }

    /// Linear scaling by `factor`.
    pub fn linear(factor: f32) -> RopeScaling {
        RopeScaling {
            kind: RopeScalingKind::Linear,
            factor,
            ..RopeScaling::none()
        }
    }

    /// YaRN with `factor` over a model trained on `original_context_length`
    /// positions (llama.cpp's and transformers' default betas).
    pub fn yarn(factor: f32, original_context_length: usize) -> RopeScaling {
        RopeScaling {
            kind: RopeScalingKind::Yarn,
            factor,
            original_context_length,
            ..RopeScaling::none()
        }
    }

    /// The scaling a GGUF declares. A factor of 1 (or none) is no scaling;
    /// YaRN without `original_context_length` uses the training context, as
    /// llama.cpp does.
    pub fn from_hparams(hp: &ModelHparams) -> Result<RopeScaling> {
        let Some(s) = &hp.rope_scaling else {
            return Ok(RopeScaling::none());
        };
        if !(s.factor.is_finite() && s.factor > 0.0) {
            return Err(RuntimeError::InvalidArgument(format!(
                "RoPE scaling factor {} is not a positive number",
                s.factor
            )));
        }
        if s.factor == 1.0 {
            return Ok(RopeScaling::none());
        }
        match s.kind {
            RopeScalingType::Linear => Ok(RopeScaling::linear(s.factor)),
            RopeScalingType::Yarn => {
                let orig = s
                    .original_context_length
                    .map(|x| x as usize)
                    .unwrap_or(hp.n_ctx_train);
                if orig == 0 {
                    return Err(RuntimeError::InvalidArgument(
                        "YaRN needs an original context length > 0".into(),
                    ));
                }
                Ok(RopeScaling::yarn(s.factor, orig))
            }
            RopeScalingType::Llama3 | RopeScalingType::Other => Err(RuntimeError::InvalidArgument(
                format!("unsupported model: RoPE scaling `{}`", s.type_name),
            )),
        }
    }

    /// Whether this is unscaled RoPE.
    pub fn is_none(&self) -> bool {
        self.kind == RopeScalingKind::None
    }

    /// YaRN's correction range `[low, high]` of pair indices (llama.cpp's
    /// `ggml_rope_yarn_corr_dims`): floor/ceil of the pair whose wavelength
    /// fits `beta_fast` / `beta_slow` times into the original context.
    pub fn yarn_correction_range(&self, head_dim: usize, freq_base: f32) -> (f64, f64) {
        let d = head_dim as f64;
        let corr_dim = |n_rot: f64| {
            d * (self.original_context_length as f64 / (n_rot * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * (freq_base as f64).ln())
        };
        let low = corr_dim(self.beta_fast as f64).floor().max(0.0);
        let high = corr_dim(self.beta_slow as f64).ceil().min(d - 1.0);
        (low, high)
    }

    /// Angular frequency of each rotated pair (`head_dim / 2` values): the
    /// angle of pair `i` at position `p` is `p * inv_freqs[i]`.
    pub fn inv_freqs(&self, head_dim: usize, freq_base: f32) -> Vec<f64> {
        let half = head_dim / 2;
        let base = freq_base as f64;
        let freq_scale = 1.0 / self.factor as f64;
        let range = (self.kind == RopeScalingKind::Yarn)
            .then(|| self.yarn_correction_range(head_dim, freq_base));
        (0..half)
            .map(|i| {
                let extrap = base.powf(-2.0 * i as f64 / head_dim as f64);
                match self.kind {
                    RopeScalingKind::None => extrap,
                    RopeScalingKind::Linear => extrap * freq_scale,
                    RopeScalingKind::Yarn => {
                        let (low, high) = range.unwrap_or((0.0, 0.0));
                        let y = (i as f64 - low) / (high - low).max(0.001);
                        // 1: keep the original frequency; 0: interpolate.
                        let extrap_weight = 1.0 - y.clamp(0.0, 1.0);
                        extrap * freq_scale * (1.0 - extrap_weight) + extrap * extrap_weight
                    }
                }
            })
            .collect()
    }

    /// The factor cos and sin are multiplied by (YaRN's attention
    /// temperature `1 + 0.1 ln(factor)`; 1 otherwise).
    pub fn mscale(&self) -> f32 {
        match self.kind {
            RopeScalingKind::Yarn => 1.0 + 0.1 * self.factor.ln(),
            _ => 1.0,
        }
    }
}

/// cos/sin of one position from a table of [`RopeScaling::inv_freqs`], both
/// scaled by `mscale`. With the unscaled table and `mscale` 1 this is
/// exactly [`RopeAngles::new`] (same f64 arithmetic).
pub fn angles(pos: usize, inv_freqs: &[f64], mscale: f32) -> RopeAngles {
    let (mut cos, mut sin) = (
        Vec::with_capacity(inv_freqs.len()),
        Vec::with_capacity(inv_freqs.len()),
    );
    for &f in inv_freqs {
        let theta = pos as f64 * f;
        cos.push(theta.cos() as f32 * mscale);
        sin.push(theta.sin() as f32 * mscale);
    }
    RopeAngles { cos, sin }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Produced by `tests/fixtures/rope_scaling.py`, which transcribes
    /// transformers' `_compute_linear_scaling_rope_parameters` and
    /// `_compute_yarn_parameters` (modeling_rope_utils.py): head_dim 64,
    /// base 1e6, factor 4, original context 32768.
    const HF_LINEAR_INV_FREQ: &[f64] = &include!("../tests/fixtures/rope_linear_inv_freq.in");
    const HF_YARN_INV_FREQ: &[f64] = &include!("../tests/fixtures/rope_yarn_inv_freq.in");
    const HF_YARN_ATTENTION_FACTOR: f64 =
        include!("../tests/fixtures/rope_yarn_attention_factor.in");

    fn assert_close(got: &[f64], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-12 * w.abs().max(1e-30),
                "pair {i}: {g} vs {w}"
            );
        }
    }

    #[test]
    fn linear_matches_transformers() {
        assert_close(
            &RopeScaling::linear(4.0).inv_freqs(64, 1e6),
            HF_LINEAR_INV_FREQ,
        );
        assert_eq!(RopeScaling::linear(4.0).mscale(), 1.0);
    }

    #[test]
    fn yarn_matches_transformers() {
        let s = RopeScaling::yarn(4.0, 32768);
        assert_close(&s.inv_freqs(64, 1e6), HF_YARN_INV_FREQ);
        assert!((s.mscale() as f64 - HF_YARN_ATTENTION_FACTOR).abs() < 1e-6);
        // The ramp really mixes: the first pair keeps its frequency, the last
        // is interpolated.
        let plain = RopeScaling::none().inv_freqs(64, 1e6);
        let yarn = s.inv_freqs(64, 1e6);
        assert_eq!(yarn[0], plain[0]);
        assert!((yarn[31] - plain[31] / 4.0).abs() < 1e-18);
    }

    #[test]
    fn unscaled_angles_equal_the_plain_ones() {
        let f = RopeScaling::none().inv_freqs(64, 1e6);
        for pos in [0, 1, 77, 31999] {
            let (a, b) = (angles(pos, &f, 1.0), RopeAngles::new(pos, 64, 1e6));
            assert_eq!((a.cos, a.sin), (b.cos, b.sin));
        }
    }

    #[test]
    fn none_is_the_plain_rope_table() {
        let f = RopeScaling::none().inv_freqs(8, 10000.0);
        assert_eq!(
            f,
            vec![
                1.0,
                10000f64.powf(-0.25),
                10000f64.powf(-0.5),
                10000f64.powf(-0.75)
            ]
        );
    }
}
