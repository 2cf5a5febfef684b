//! Which ggml type each tensor gets under `mirage-cli quantize --type T`.
//!
//! Two kinds of target:
//! - a preset (`q4_k_m`, `q5_k_m`, `q6_k`, `q8_0`): llama.cpp's
//!   `llama_model_quantize` mix for that `llama_ftype` (its
//!   `llama_tensor_get_type`, dense non-Falcon models):
//!   - `output.weight` (or `token_embd.weight` when the model has no
//!     `output.weight`, i.e. ties them): Q6_K, or Q8_0 when its rows do not
//!     fit the base type's block (Q8_0 stays Q8_0);
//!   - `attn_v.weight` and `ffn_down` under q4_k_m / q5_k_m: Q6_K in the
//!     layers `use_more_bits` picks (the first and last eighth, and every
//!     third layer between), the base type elsewhere;
//!   - `attn_qkv.weight` (fused): Q5_K under q4_k_m, Q6_K under q5_k_m;
//!   - every other weight matrix, `token_embd.weight` included: the base
//!     type (Q4_K, Q5_K, Q6_K, Q8_0).
//! - a single ggml type (`q4_0`, `q4_k`, `f16`, ...): every weight matrix in
//!   that type (llama-quantize's `--pure`).
//!
//! Either way a row length that is not a multiple of the chosen type's block
//! falls back as llama.cpp does (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0,
//! then F16 when even that does not fit; for a single type Q2_K/Q3_K ->
//! Q5_0, where llama.cpp picks IQ4_NL, which MIRAGE does not implement), and
//! a tensor with no fitting type is kept as it is.
//!
//! Which tensors are weight matrices also follows llama.cpp: names ending
//! in `weight` with at least two dimensions, except norms, MoE router
//! inputs, positional and token-type embeddings and a few small per-arch
//! tensors; everything else is copied unchanged.
//!
//! This is our own code from the rules above (checked against the tensor
//! types of real Q4_K_M files in the tests), not a port.

use std::collections::HashMap;

use anyhow::bail;
use mirage_gguf::{GgmlType, TensorInfo};

/// One of llama.cpp's mixed presets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// `LLAMA_FTYPE_MOSTLY_Q4_K_M`.
    Q4KM,
    /// `LLAMA_FTYPE_MOSTLY_Q5_K_M`.
    Q5KM,
    /// `LLAMA_FTYPE_MOSTLY_Q6_K`.
    Q6K,
    /// `LLAMA_FTYPE_MOSTLY_Q8_0`.
    Q8_0,
}

impl Preset {
    const ALL: [Preset; 4] = [Preset::Q4KM, Preset::Q5KM, Preset::Q6K, Preset::Q8_0];

    fn name(self) -> &'static str {
        match self {
            Preset::Q4KM => "q4_k_m",
            Preset::Q5KM => "q5_k_m",
            Preset::Q6K => "q6_k",
            Preset::Q8_0 => "q8_0",
        }
    }

    /// The type most weight matrices get.
    fn base(self) -> GgmlType {
        match self {
            Preset::Q4KM => GgmlType::Q4_K,
            Preset::Q5KM => GgmlType::Q5_K,
            Preset::Q6K => GgmlType::Q6_K,
            Preset::Q8_0 => GgmlType::Q8_0,
        }
    }

    /// `general.file_type` (`llama_ftype`).
    fn file_type(self) -> u32 {
        match self {
            Preset::Q4KM => 15,
            Preset::Q5KM => 17,
            Preset::Q6K => 18,
            Preset::Q8_0 => 7,
        }
    }

    /// Whether `attn_v` and `ffn_down` get Q6_K in the layers `use_more_bits` picks.
    fn more_bits_in_some_layers(self) -> bool {
        matches!(self, Preset::Q4KM | Preset::Q5KM)
    }
}

/// What `--type` asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// A llama.cpp mix.
    Preset(Preset),
    /// One type for every weight matrix.
    Single(GgmlType),
}

impl Target {
    /// Parses `--type` (case-insensitive); the error lists what exists.
    pub fn parse(s: &str) -> anyhow::Result<Target> {
        let lower = s.trim().to_ascii_lowercase();
        if let Some(p) = Preset::ALL.iter().find(|p| p.name() == lower) {
            return Ok(Target::Preset(*p));
        }
        let activation_only = match GgmlType::from_name(&lower) {
            Some(ty) if super::file_type_of(ty).is_some() => return Ok(Target::Single(ty)),
            Some(ty) => format!(" ({ty} is an activation format, not a weight type)"),
            None => String::new(),
        };
        let presets: Vec<_> = Preset::ALL.iter().map(|p| p.name()).collect();
        let singles: Vec<_> = GgmlType::ALL
            .iter()
            .filter(|t| super::file_type_of(**t).is_some())
            .filter(|t| !presets.contains(&t.name()))
            .map(|t| t.name())
            .collect();
        bail!(
            "unknown type {s:?}{activation_only}: presets (llama.cpp's mixes) {}; single types {}",
            presets.join(", "),
            singles.join(", ")
        )
    }

    /// `general.file_type` of the result.
    pub fn file_type(self) -> u32 {
        match self {
            Target::Preset(p) => p.file_type(),
            Target::Single(ty) => super::file_type_of(ty).expect("parse checked it"),
        }
    }

    /// Its name as `--type` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Target::Preset(p) => p.name(),
            Target::Single(ty) => ty.name(),
        }
    }
}

/// What happens to one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// Copied unchanged (not a weight matrix, already the chosen type, or no type fits its rows).
    Keep,
    /// Re-quantized to this type.
    Convert(GgmlType),
}

/// Whether llama.cpp quantizes a tensor of this name and shape at all.
pub fn is_weight_matrix(info: &TensorInfo) -> bool {
    const NEVER: [&str; 10] = [
        "_norm.weight",
        "ffn_gate_inp.weight",
        "altup",
        "laurel",
        "per_layer_model_proj",
        "ssm_conv1d.weight",
        "shortconv.conv.weight",
        "time_mix_",
        "attn_rel_b.weight",
        "position_embd.weight",
    ];
    info.dims.len() >= 2
        && info.name.ends_with("weight")
        && info.name != "token_types.weight"
        && !NEVER.iter().any(|n| info.name.contains(n))
}

/// The layer of a `blk.N.` tensor; -1 for the others (llama.cpp's sort key).
fn layer_of(name: &str) -> i64 {
    name.strip_prefix("blk.")
        .and_then(|rest| rest.split('.').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(-1)
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers and
/// every third one between.
fn use_more_bits(i_layer: usize, n_layers: usize) -> bool {
    let (i, n) = (i_layer as i64, n_layers as i64);
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// The type llama.cpp falls back to when a row does not fit `ty`'s block.
fn fallback(ty: GgmlType, single: bool) -> Option<GgmlType> {
    use GgmlType::*;
    match ty {
        Q2_K | Q3_K if single => Some(Q5_0),
        Q4_K => Some(Q5_0),
        Q5_K => Some(Q5_1),
        Q6_K => Some(Q8_0),
        _ => None,
    }
}

/// The plan for every tensor of a model (in the file's order), with a note
/// for each tensor whose rows forced a fallback.
pub fn plan_model(
    tensors: &[TensorInfo],
    n_layer: usize,
    target: Target,
) -> Vec<(Plan, Option<String>)> {
    // llama.cpp visits tensors sorted by (layer, name) and counts attn_v and
    // ffn_down as it goes; the count is the tensor's rank in that order.
    let mut order: Vec<usize> = (0..tensors.len())
        .filter(|&i| is_weight_matrix(&tensors[i]))
        .collect();
    order.sort_by(|&a, &b| {
        let (ta, tb) = (&tensors[a].name, &tensors[b].name);
        (layer_of(ta), ta).cmp(&(layer_of(tb), tb))
    });
    let rank = |pattern: &dyn Fn(&str) -> bool| -> HashMap<usize, usize> {
        order
            .iter()
            .filter(|&&i| pattern(&tensors[i].name))
            .enumerate()
            .map(|(rank, &i)| (i, rank))
            .collect()
    };
    let is_v = |n: &str| n.contains("attn_v.weight");
    let v_rank = rank(&is_v);
    let n_attention_wv = tensors
        .iter()
        .filter(|t| {
            is_v(&t.name)
                || t.name.contains("attn_qkv.weight")
                || t.name.contains("attn_kv_b.weight")
        })
        .count();
    let down_rank = rank(&|n: &str| n.contains("ffn_down"));
    let has_output = tensors.iter().any(|t| t.name == "output.weight");

    tensors
        .iter()
        .enumerate()
        .map(|(i, info)| {
            if !is_weight_matrix(info) {
                return (Plan::Keep, None);
            }
            let chosen = match target {
                Target::Single(ty) => ty,
                Target::Preset(p) => preset_type(p, info, has_output, |what| match what {
                    Counter::AttnV => v_rank.get(&i).map(|&r| (r, n_attention_wv)),
                    Counter::FfnDown => down_rank.get(&i).map(|&r| (r, n_layer)),
                }),
            };
            fit(info, chosen, matches!(target, Target::Single(_)))
        })
        .collect()
}

/// The per-layer counters llama.cpp keeps.
enum Counter {
    AttnV,
    FfnDown,
}

/// The preset's type for one weight matrix, before the block-fit fallback.
/// `position` gives the tensor's (rank, count) for a counter.
fn preset_type(
    p: Preset,
    info: &TensorInfo,
    has_output: bool,
    position: impl Fn(Counter) -> Option<(usize, usize)>,
) -> GgmlType {
    let base = p.base();
    let name = info.name.as_str();
    let more_bits = |c: Counter| {
        p.more_bits_in_some_layers() && position(c).is_some_and(|(i, n)| use_more_bits(i, n))
    };
    if name == "output.weight" || (!has_output && name == "token_embd.weight") {
        if info.row_len() % base.block_size() as u64 != 0 {
            GgmlType::Q8_0
        } else if base != GgmlType::Q8_0 {
            GgmlType::Q6_K
        } else {
            base
        }
    } else if name == "token_embd.weight" {
        base
    } else if name.contains("attn_v.weight") {
        if more_bits(Counter::AttnV) {
            GgmlType::Q6_K
        } else {
            base
        }
    } else if name.contains("ffn_down") {
        if more_bits(Counter::FfnDown) {
            GgmlType::Q6_K
        } else {
            base
        }
    } else if name.contains("attn_qkv.weight") {
        match p {
            Preset::Q4KM => GgmlType::Q5_K,
            Preset::Q5KM => GgmlType::Q6_K,
            _ => base,
        }
    } else {
        base
    }
}

/// `chosen`, or its fallback when the rows do not fit its block; `Keep`
/// when it is the tensor's type already or nothing fits.
fn fit(info: &TensorInfo, chosen: GgmlType, single: bool) -> (Plan, Option<String>) {
    let row = info.row_len();
    let fits = |ty: GgmlType| row % ty.block_size() as u64 == 0;
    let (ty, note) = if fits(chosen) {
        (chosen, None)
    } else {
        let fb = fallback(chosen, single)
            .map(|fb| {
                if fits(fb) || single {
                    fb
                } else {
                    GgmlType::F16
                }
            })
            .filter(|fb| fits(*fb));
        match fb {
            Some(fb) => {
                let why = format!(
                    "row length {row} is not a multiple of {chosen}'s block of {}: {fb} instead",
                    chosen.block_size()
                );
                (fb, Some(why))
            }
            None => {
                let why = format!(
                    "row length {row} fits no block of {chosen}: kept as {}",
                    info.ty
                );
                return (Plan::Keep, Some(why));
            }
        }
    };
    if ty == info.ty {
        (Plan::Keep, note)
    } else {
        (Plan::Convert(ty), note)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str, dims: &[u64], ty: GgmlType) -> TensorInfo {
        TensorInfo {
            name: name.into(),
            dims: dims.to_vec(),
            ty,
            offset: 0,
        }
    }

    fn single(t: &TensorInfo, ty: GgmlType) -> (Plan, Option<String>) {
        plan_model(std::slice::from_ref(t), 1, Target::Single(ty))
            .pop()
            .unwrap()
    }

    #[test]
    fn single_types_follow_llama_cpp_fallbacks() {
        use GgmlType::*;
        let w = info("blk.0.ffn_up.weight", &[576, 1536], Q4_1);
        assert_eq!(single(&w, Q8_0).0, Plan::Convert(Q8_0));
        // 576 is not a multiple of 256: Q4_K falls back to Q5_0, Q6_K to Q8_0.
        let (p, note) = single(&w, Q4_K);
        assert_eq!(p, Plan::Convert(Q5_0));
        assert!(note.unwrap().contains("576"));
        assert_eq!(single(&w, Q6_K).0, Plan::Convert(Q8_0));
        // 1536 is: ffn_down takes the K-quant.
        let down = info("blk.0.ffn_down.weight", &[1536, 576], Q4_1);
        assert_eq!(single(&down, Q4_K), (Plan::Convert(Q4_K), None));
        // Norms and 1-D tensors stay as they are.
        assert_eq!(
            single(&info("blk.0.attn_norm.weight", &[576], F32), Q8_0).0,
            Plan::Keep
        );
        assert_eq!(
            single(&info("blk.0.attn_q.bias", &[896], F32), Q8_0).0,
            Plan::Keep
        );
        // Already the target type: copied verbatim.
        assert_eq!(
            single(&info("token_embd.weight", &[576, 49152], Q8_0), Q8_0).0,
            Plan::Keep
        );
        // A row that fits no block at all is kept.
        let odd = info("odd.weight", &[100, 4], F32);
        assert_eq!(single(&odd, Q4_0).0, Plan::Keep);
    }

    #[test]
    fn use_more_bits_matches_llama_cpp_for_24_layers() {
        let picked: Vec<usize> = (0..24).filter(|&i| use_more_bits(i, 24)).collect();
        // n/8 = 3, 7n/8 = 21: layers 0-2, 21-23 and every third from 5.
        assert_eq!(picked, [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]);
    }

    #[test]
    fn unknown_types_list_the_valid_ones() {
        let err = Target::parse("q4_k_xl").unwrap_err().to_string();
        for name in ["q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0", "f16"] {
            assert!(err.contains(name), "{name} missing from {err}");
        }
        assert_eq!(
            Target::parse("Q4_K_M").unwrap(),
            Target::Preset(Preset::Q4KM)
        );
        assert_eq!(
            Target::parse("q4_k").unwrap(),
            Target::Single(GgmlType::Q4_K)
        );
        assert!(Target::parse("q8_k").is_err());
    }
}
