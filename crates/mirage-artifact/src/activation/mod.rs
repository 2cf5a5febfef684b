//! Activation sparsity: per token, the input channels of every projection
//! of a layer (Q, K, V, O, gate, up, down) whose score falls below that
//! matrix's calibrated threshold are skipped, and their weights are never
//! read.
//!
//! - Scores ([`Criterion`]): `|x_i|` (TEAL) or `|x_i| * ||W[:, i]||`
//!   (WINA); the input of `down` is the SwiGLU output `h`. Either way a
//!   matrix keeps channel `i` when `|x_i| >= thr_i`, with per-channel
//!   thresholds `thr_i = tau / ||W[:, i]||` (WINA) or `tau` (TEAL), so the
//!   runtime test is the same.
//! - Thresholds ([`fit`]): per matrix, the quantiles of its calibration
//!   scores; a sparsity `s` of a matrix is the threshold that skips that
//!   share of its calibration scores.
//! - Allocation ([`fit`]): which sparsity each matrix gets for a model-wide
//!   target (the parameter-weighted mean): TEAL's block-wise greedy, or the
//!   allocation across layers by measured sensitivity. A [`format::Plan`]
//!   stores the per-matrix sparsities for a grid of targets, with the
//!   calibration perplexity of each.
//! - Storage ([`format`]): every projection in the channel-major layout of
//!   `mirage_gguf::quant::channel_major` (the codes of one input channel
//!   contiguous, every code and scale of the source kept), in a versioned,
//!   checksummed artifact of its own kind.
//! - Execution ([`backend::ActivationBackend`]): the runtime's `Backend`
//!   with the projections replaced; a decode row runs the channel-major
//!   kernels over the active channels only, a batch runs the dense kernels
//!   on masked inputs (the same arithmetic up to activation rounding).

pub mod backend;
pub mod build;
pub mod fit;
pub mod format;
pub mod graph;

use std::fmt;
use std::str::FromStr;

/// The projections of a layer that activation sparsity applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Proj {
    /// Attention query.
    Q,
    /// Attention key.
    K,
    /// Attention value.
    V,
    /// Attention output.
    O,
    /// FFN gate.
    Gate,
    /// FFN up.
    Up,
    /// FFN down (input: the SwiGLU output).
    Down,
}

impl Proj {
    /// All, in layer order.
    pub const ALL: [Proj; 7] = [
        Proj::Q,
        Proj::K,
        Proj::V,
        Proj::O,
        Proj::Gate,
        Proj::Up,
        Proj::Down,
    ];

    /// Index in [`Proj::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Short name (`q`, `k`, ..., `down`).
    pub fn name(self) -> &'static str {
        match self {
            Proj::Q => "q",
            Proj::K => "k",
            Proj::V => "v",
            Proj::O => "o",
            Proj::Gate => "gate",
            Proj::Up => "up",
            Proj::Down => "down",
        }
    }

    /// The GGUF tensor of layer `l`.
    pub fn tensor(self, l: usize) -> String {
        let t = match self {
            Proj::Q => "attn_q",
            Proj::K => "attn_k",
            Proj::V => "attn_v",
            Proj::O => "attn_output",
            Proj::Gate => "ffn_gate",
            Proj::Up => "ffn_up",
            Proj::Down => "ffn_down",
        };
        format!("blk.{l}.{t}.weight")
    }

    /// `(layer, proj)` of a GGUF tensor name, when it is one of these.
    pub fn parse_tensor(name: &str) -> Option<(usize, Proj)> {
        let rest = name.strip_prefix("blk.")?;
        let (l, _) = rest.split_once('.')?;
        let l: usize = l.parse().ok()?;
        Proj::ALL
            .into_iter()
            .find(|p| p.tensor(l) == name)
            .map(|p| (l, p))
    }
}

/// Index of matrix `(layer, proj)` in per-matrix tables (`layer * 7 + proj`).
pub fn matrix_index(layer: usize, proj: Proj) -> usize {
    layer * Proj::ALL.len() + proj.index()
}

/// How a channel's score is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Criterion {
    /// `|x_i|` (TEAL).
    Teal,
    /// `|x_i| * ||W[:, i]||` (WINA).
    Wina,
}

impl Criterion {
    /// Both.
    pub const ALL: [Criterion; 2] = [Criterion::Teal, Criterion::Wina];

    /// The name users type.
    pub fn name(self) -> &'static str {
        match self {
            Criterion::Teal => "teal",
            Criterion::Wina => "wina",
        }
    }
}

impl fmt::Display for Criterion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Criterion {
    type Err = String;
    fn from_str(s: &str) -> Result<Criterion, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "teal" => Ok(Criterion::Teal),
            "wina" => Ok(Criterion::Wina),
            other => Err(format!(
                "unknown criterion `{other}` (expected teal or wina)"
            )),
        }
    }
}

/// What a user asks for: a fixed model-wide sparsity, or the highest one
/// whose calibration perplexity stays within a budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SparsityTarget {
    /// This share of the projections' weights skipped, in `[0, 1)`.
    Fixed(f32),
    /// The highest stored target whose calibration perplexity rises at most
    /// this fraction over dense (0.01 = 1 %).
    MaxPplIncrease(f32),
}

impl SparsityTarget {
    /// Checks the numbers: a fixed sparsity in `[0, 1)`, a budget `>= 0`.
    pub fn validate(self) -> crate::Result<SparsityTarget> {
        match self {
            SparsityTarget::Fixed(s) if !(0.0..1.0).contains(&s) => {
                Err(crate::ArtifactError::InvalidArgument(format!(
                    "sparsity {s} is outside [0, 1): it is the share of weights skipped"
                )))
            }
            SparsityTarget::MaxPplIncrease(b) if !(b >= 0.0 && b.is_finite()) => {
                Err(crate::ArtifactError::InvalidArgument(format!(
                    "perplexity budget {b} must be a finite increase >= 0 (0.01 = 1 %)"
                )))
            }
            t => Ok(t),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_names_round_trip() {
        for l in [0usize, 7, 27] {
            for p in Proj::ALL {
                assert_eq!(Proj::parse_tensor(&p.tensor(l)), Some((l, p)));
            }
        }
        assert_eq!(Proj::parse_tensor("token_embd.weight"), None);
        assert_eq!(Proj::parse_tensor("blk.3.attn_norm.weight"), None);
        assert_eq!(Proj::parse_tensor("blk.x.attn_q.weight"), None);
    }

    #[test]
    fn sparsity_targets_are_checked() {
        assert!(SparsityTarget::Fixed(0.0).validate().is_ok());
        assert!(SparsityTarget::Fixed(0.99).validate().is_ok());
        for bad in [1.0f32, -0.1, f32::NAN, 1.5] {
            let e = SparsityTarget::Fixed(bad)
                .validate()
                .unwrap_err()
                .to_string();
            assert!(e.contains("outside [0, 1)"), "{e}");
        }
        assert!(SparsityTarget::MaxPplIncrease(-0.01).validate().is_err());
        assert!(SparsityTarget::MaxPplIncrease(0.03).validate().is_ok());
        assert_eq!("WINA".parse::<Criterion>(), Ok(Criterion::Wina));
        assert!("magnitude".parse::<Criterion>().is_err());
    }
}
