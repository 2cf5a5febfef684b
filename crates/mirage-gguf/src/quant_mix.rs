//! Which ggml type each tensor of a model gets when it is quantized the way
//! llama.cpp's `llama-quantize` does it.
//!
//! Two kinds of [`Target`]:
//! - a [`Preset`] (`q4_k_m`, `q5_k_m`, `q6_k`, `q8_0`): llama.cpp's
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
//! llama.cpp finds "the layer" of an `attn_v` or `ffn_down` tensor by
//! counting those tensors as it visits them, and the visiting order has
//! changed between its versions: [`LayerOrder`] says which order to count in.
//!
//! Which tensors are weight matrices also follows llama.cpp: names ending
//! in `weight` with at least two dimensions, except norms, MoE router
//! inputs, positional and token-type embeddings and a few small per-arch
//! tensors; everything else is copied unchanged.
//!
//! This is our own code from the rules above (checked against the tensor
//! types of real Q4_K_M files in the tests), not a port.

use std::collections::HashMap;
use std::fmt;

use crate::{GgmlType, GgufError, TensorDecl, TensorInfo};

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
    /// Every preset.
    pub const ALL: [Preset; 4] = [Preset::Q4KM, Preset::Q5KM, Preset::Q6K, Preset::Q8_0];

    /// Its name as llama-quantize takes it (`q4_k_m`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Preset::Q4KM => "q4_k_m",
            Preset::Q5KM => "q5_k_m",
            Preset::Q6K => "q6_k",
            Preset::Q8_0 => "q8_0",
        }
    }

    /// The type most weight matrices get.
    pub fn base(self) -> GgmlType {
        match self {
            Preset::Q4KM => GgmlType::Q4_K,
            Preset::Q5KM => GgmlType::Q5_K,
            Preset::Q6K => GgmlType::Q6_K,
            Preset::Q8_0 => GgmlType::Q8_0,
        }
    }

    /// `general.file_type` (`llama_ftype`).
    pub fn file_type(self) -> u32 {
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

/// The `general.file_type` (llama.cpp `llama_ftype`) of a file whose weights
/// are mostly `ty`; `None` for types that are not weight formats (Q8_1, Q8_K).
/// Pure K-quant files get the `_S` ("small", mostly that type) variants.
pub fn file_type_of(ty: GgmlType) -> Option<u32> {
    use GgmlType::*;
    Some(match ty {
        F32 => 0,
        F16 => 1,
        Q4_0 => 2,
        Q4_1 => 3,
        Q8_0 => 7,
        Q5_0 => 8,
        Q5_1 => 9,
        Q2_K => 10,
        Q3_K => 11,
        Q4_K => 14,
        Q5_K => 16,
        Q6_K => 18,
        BF16 => 32,
        Q8_1 | Q8_K => return None,
    })
}

/// What a model is quantized to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// A llama.cpp mix.
    Preset(Preset),
    /// One type for every weight matrix.
    Single(GgmlType),
}

impl Target {
    /// Parses a preset or weight type name as llama-quantize takes it
    /// (case-insensitive); the error lists what exists.
    pub fn parse(s: &str) -> Result<Target, GgufError> {
        let lower = s.trim().to_ascii_lowercase();
        if let Some(p) = Preset::ALL.iter().find(|p| p.name() == lower) {
            return Ok(Target::Preset(*p));
        }
        let activation_format = match GgmlType::from_name(&lower) {
            Some(ty) if file_type_of(ty).is_some() => return Ok(Target::Single(ty)),
            other => other,
        };
        Err(GgufError::UnknownQuantTarget {
            asked: s.to_string(),
            activation_format,
        })
    }

    /// `general.file_type` of the result; `None` for a single type that is
    /// no weight format (Q8_1, Q8_K), which [`Target::parse`] refuses.
    pub fn file_type(self) -> Option<u32> {
        match self {
            Target::Preset(p) => Some(p.file_type()),
            Target::Single(ty) => file_type_of(ty),
        }
    }

    /// Its name as [`Target::parse`] takes it.
    pub fn name(self) -> &'static str {
        match self {
            Target::Preset(p) => p.name(),
            Target::Single(ty) => ty.name(),
        }
    }
}

/// `" (Q8_K is an activation format, not a weight type)"` for a type name
/// that is no weight format, else nothing: part of
/// [`GgufError::UnknownQuantTarget`]'s message.
pub(crate) fn activation_format_note(ty: &Option<GgmlType>) -> String {
    ty.map_or(String::new(), |ty| {
        format!(" ({ty} is an activation format, not a weight type)")
    })
}

/// The preset names, comma-separated.
pub(crate) fn preset_names() -> String {
    let names: Vec<_> = Preset::ALL.iter().map(|p| p.name()).collect();
    names.join(", ")
}

/// The single weight type names that are no preset's name, comma-separated.
pub(crate) fn single_type_names() -> String {
    let names: Vec<_> = GgmlType::ALL
        .iter()
        .filter(|t| file_type_of(**t).is_some())
        .filter(|t| !Preset::ALL.iter().any(|p| p.name() == t.name()))
        .map(|t| t.name())
        .collect();
    names.join(", ")
}

/// The order in which `attn_v` and `ffn_down` tensors are counted to find
/// their layer for `use_more_bits`: the rank of a tensor among those of its
/// kind in this order is the layer llama.cpp gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerOrder {
    /// Sorted by the layer index parsed from `blk.N.` (tensors outside the
    /// blocks first), then by name: current llama.cpp, which sorts the
    /// tensors this way before quantizing, so the count is the layer itself.
    LayerIndex,
    /// Sorted by name as a string, so `blk.10` comes between `blk.1` and
    /// `blk.2`: the order the shipped Qwen2.5-Coder Q4_K_M files hold their
    /// layers in, which the llama.cpp that made them counted in.
    Name,
}

/// What happens to one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// Copied unchanged (not a weight matrix, already the chosen type, or no type fits its rows).
    Keep,
    /// Re-quantized to this type.
    Convert(GgmlType),
}

/// Why a weight matrix does not get the type its target chose: its rows
/// are not a whole number of that type's blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// `used` instead of `chosen`.
    Substituted {
        /// Values in one row.
        row_len: u64,
        /// The type the target chose.
        chosen: GgmlType,
        /// The fallback whose block fits.
        used: GgmlType,
    },
    /// No fallback fits either: the tensor keeps its type.
    NoneFits {
        /// Values in one row.
        row_len: u64,
        /// The type the target chose.
        chosen: GgmlType,
        /// The tensor's own type, kept.
        kept: GgmlType,
    },
}

impl fmt::Display for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Fallback::Substituted {
                row_len,
                chosen,
                used,
            } => write!(
                f,
                "row length {row_len} is not a multiple of {chosen}'s block of {}: {used} instead",
                chosen.block_size()
            ),
            Fallback::NoneFits {
                row_len,
                chosen,
                kept,
            } => write!(
                f,
                "row length {row_len} fits no block of {chosen}: kept as {kept}"
            ),
        }
    }
}

/// What the planner reads of a tensor: an entry of a tensor table, read
/// from a file ([`TensorInfo`]) or about to be written ([`TensorDecl`]).
pub trait TensorEntry {
    /// The tensor's name (`blk.0.ffn_up.weight`, ...).
    fn name(&self) -> &str;
    /// Dims in ggml order (`dims[0]` is the row length).
    fn dims(&self) -> &[u64];
    /// Its element type now.
    fn ty(&self) -> GgmlType;
    /// Length of one row (`dims[0]`), 1 for a scalar.
    fn row_len(&self) -> u64 {
        self.dims().first().copied().unwrap_or(1)
    }
}

impl TensorEntry for TensorInfo {
    fn name(&self) -> &str {
        &self.name
    }
    fn dims(&self) -> &[u64] {
        &self.dims
    }
    fn ty(&self) -> GgmlType {
        self.ty
    }
}

impl TensorEntry for TensorDecl {
    fn name(&self) -> &str {
        &self.name
    }
    fn dims(&self) -> &[u64] {
        &self.dims
    }
    fn ty(&self) -> GgmlType {
        self.ty
    }
}

/// Whether llama.cpp quantizes a tensor of this name and shape at all.
pub fn is_weight_matrix<T: TensorEntry + ?Sized>(tensor: &T) -> bool {
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
    let name = tensor.name();
    tensor.dims().len() >= 2
        && name.ends_with("weight")
        && name != "token_types.weight"
        && !NEVER.iter().any(|n| name.contains(n))
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

/// The plan for every tensor of a model (in the given order), with the
/// reason for each weight matrix whose rows forced a fallback. `n_layer` is
/// the model's block count; `order` the order llama.cpp counts layers in.
pub fn plan_model<T: TensorEntry>(
    tensors: &[T],
    n_layer: usize,
    target: Target,
    order: LayerOrder,
) -> Vec<(Plan, Option<Fallback>)> {
    // llama.cpp visits the weight matrices in `order` and counts attn_v and
    // ffn_down as it goes; the count is the tensor's rank in that order.
    let mut visited: Vec<usize> = (0..tensors.len())
        .filter(|&i| is_weight_matrix(&tensors[i]))
        .collect();
    visited.sort_by(|&a, &b| {
        let (ta, tb) = (tensors[a].name(), tensors[b].name());
        match order {
            LayerOrder::LayerIndex => (layer_of(ta), ta).cmp(&(layer_of(tb), tb)),
            LayerOrder::Name => ta.cmp(tb),
        }
    });
    let rank = |pattern: &dyn Fn(&str) -> bool| -> HashMap<usize, usize> {
        visited
            .iter()
            .filter(|&&i| pattern(tensors[i].name()))
            .enumerate()
            .map(|(rank, &i)| (i, rank))
            .collect()
    };
    let is_v = |n: &str| n.contains("attn_v.weight");
    let v_rank = rank(&is_v);
    let n_attention_wv = tensors
        .iter()
        .filter(|t| {
            let n = t.name();
            is_v(n) || n.contains("attn_qkv.weight") || n.contains("attn_kv_b.weight")
        })
        .count();
    let down_rank = rank(&|n: &str| n.contains("ffn_down"));
    let has_output = tensors.iter().any(|t| t.name() == "output.weight");

    tensors
        .iter()
        .enumerate()
        .map(|(i, tensor)| {
            if !is_weight_matrix(tensor) {
                return (Plan::Keep, None);
            }
            let chosen = match target {
                Target::Single(ty) => ty,
                Target::Preset(p) => preset_type(p, tensor, has_output, |what| match what {
                    Counter::AttnV => v_rank.get(&i).map(|&r| (r, n_attention_wv)),
                    Counter::FfnDown => down_rank.get(&i).map(|&r| (r, n_layer)),
                }),
            };
            fit(tensor, chosen, matches!(target, Target::Single(_)))
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
fn preset_type<T: TensorEntry + ?Sized>(
    p: Preset,
    tensor: &T,
    has_output: bool,
    position: impl Fn(Counter) -> Option<(usize, usize)>,
) -> GgmlType {
    let base = p.base();
    let name = tensor.name();
    let more_bits = |c: Counter| {
        p.more_bits_in_some_layers() && position(c).is_some_and(|(i, n)| use_more_bits(i, n))
    };
    if name == "output.weight" || (!has_output && name == "token_embd.weight") {
        if !tensor.row_len().is_multiple_of(base.block_size() as u64) {
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
fn fit<T: TensorEntry + ?Sized>(
    tensor: &T,
    chosen: GgmlType,
    single: bool,
) -> (Plan, Option<Fallback>) {
    let row_len = tensor.row_len();
    let fits = |ty: GgmlType| row_len.is_multiple_of(ty.block_size() as u64);
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
            Some(used) => (
                used,
                Some(Fallback::Substituted {
                    row_len,
                    chosen,
                    used,
                }),
            ),
            None => {
                let why = Fallback::NoneFits {
                    row_len,
                    chosen,
                    kept: tensor.ty(),
                };
                return (Plan::Keep, Some(why));
            }
        }
    };
    if ty == tensor.ty() {
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

    fn single(t: &TensorInfo, ty: GgmlType) -> (Plan, Option<Fallback>) {
        plan_model(
            std::slice::from_ref(t),
            1,
            Target::Single(ty),
            LayerOrder::LayerIndex,
        )
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
        assert_eq!(
            note.unwrap().to_string(),
            "row length 576 is not a multiple of Q4_K's block of 256: Q5_0 instead"
        );
        assert_eq!(single(&w, Q6_K).0, Plan::Convert(Q8_0));
        // Q2_K stands in Q5_0 for llama.cpp's IQ4_NL.
        assert_eq!(single(&w, Q2_K).0, Plan::Convert(Q5_0));
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
        // A row that fits no block at all is kept, and the note says so.
        let odd = info("odd.weight", &[100, 4], F32);
        let (p, note) = single(&odd, Q4_0);
        assert_eq!(p, Plan::Keep);
        assert_eq!(
            note.unwrap().to_string(),
            "row length 100 fits no block of Q4_0: kept as F32"
        );
    }

    #[test]
    fn use_more_bits_matches_llama_cpp_for_24_layers() {
        let picked: Vec<usize> = (0..24).filter(|&i| use_more_bits(i, 24)).collect();
        // n/8 = 3, 7n/8 = 21: layers 0-2, 21-23 and every third from 5.
        assert_eq!(picked, [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]);
    }

    /// The tensors of a Qwen2.5-0.5B-shaped model of `n_layer` layers, in
    /// numeric layer order: what the planner sees of a file.
    fn qwen_like(n_layer: usize) -> Vec<TensorDecl> {
        let decl = |name: String, dims: &[u64]| TensorDecl {
            name,
            dims: dims.to_vec(),
            ty: GgmlType::F32,
        };
        let mut out = vec![decl("token_embd.weight".into(), &[896, 151936])];
        for l in 0..n_layer {
            out.push(decl(format!("blk.{l}.attn_norm.weight"), &[896]));
            out.push(decl(format!("blk.{l}.attn_v.weight"), &[896, 128]));
            out.push(decl(format!("blk.{l}.attn_v.bias"), &[128]));
            out.push(decl(format!("blk.{l}.ffn_down.weight"), &[4864, 896]));
            out.push(decl(format!("blk.{l}.ffn_up.weight"), &[896, 4864]));
        }
        out.push(decl("output.weight".into(), &[896, 151936]));
        out
    }

    /// The layers whose `kind` tensor gets more than the base type.
    fn more_bits_layers(
        tensors: &[TensorDecl],
        plans: &[(Plan, Option<Fallback>)],
        kind: &str,
        base: GgmlType,
    ) -> Vec<usize> {
        tensors
            .iter()
            .zip(plans)
            .filter(|(t, _)| t.name.ends_with(kind))
            .filter(|(_, (p, _))| !matches!(p, Plan::Convert(ty) if *ty == base))
            .map(|(t, _)| layer_of(&t.name) as usize)
            .collect()
    }

    /// Counting by layer index gives `use_more_bits`' layers themselves;
    /// counting by name gives the layers the shipped Qwen2.5-Coder-0.5B
    /// Q4_K_M file has in Q6_K (its Q8_0 fallback for attn_v's rows of 896).
    #[test]
    fn the_layer_order_decides_which_layers_get_more_bits() {
        let tensors = qwen_like(24);
        let preset = Target::Preset(Preset::Q4KM);
        let by_index = plan_model(&tensors, 24, preset, LayerOrder::LayerIndex);
        let by_name = plan_model(&tensors, 24, preset, LayerOrder::Name);
        let index_layers = [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23];
        let name_layers = [0, 1, 3, 6, 7, 8, 9, 10, 13, 16, 19, 21];
        for (plans, layers) in [(&by_index, index_layers), (&by_name, name_layers)] {
            // attn_v's rows of 896 fall back from Q4_K to Q5_0, from Q6_K to Q8_0.
            assert_eq!(
                more_bits_layers(&tensors, plans, "attn_v.weight", GgmlType::Q5_0),
                layers
            );
            assert_eq!(
                more_bits_layers(&tensors, plans, "ffn_down.weight", GgmlType::Q4_K),
                layers
            );
            assert_eq!(
                more_bits_layers(&tensors, plans, "ffn_up.weight", GgmlType::Q5_0),
                [] as [usize; 0]
            );
        }
        let ty = |plans: &[(Plan, Option<Fallback>)], name: &str| {
            let i = tensors.iter().position(|t| t.name == name).unwrap();
            plans[i]
        };
        assert_eq!(
            ty(&by_name, "blk.3.attn_v.weight"),
            (
                Plan::Convert(GgmlType::Q8_0),
                Some(Fallback::Substituted {
                    row_len: 896,
                    chosen: GgmlType::Q6_K,
                    used: GgmlType::Q8_0
                })
            )
        );
        assert_eq!(
            ty(&by_name, "blk.3.ffn_down.weight"),
            (Plan::Convert(GgmlType::Q6_K), None)
        );
        // The output's rows do not fit Q4_K: Q8_0 at once, not through Q6_K.
        assert_eq!(
            ty(&by_index, "output.weight"),
            (Plan::Convert(GgmlType::Q8_0), None)
        );
        assert_eq!(
            ty(&by_index, "token_embd.weight").0,
            Plan::Convert(GgmlType::Q5_0)
        );
        assert_eq!(ty(&by_index, "blk.0.attn_v.bias"), (Plan::Keep, None));
    }

    /// Without `output.weight` the embedding is the output and takes its type.
    #[test]
    fn a_tied_embedding_gets_the_output_type() {
        let tensors = [
            info("token_embd.weight", &[1024, 100], GgmlType::F16),
            info("blk.0.ffn_up.weight", &[1024, 2048], GgmlType::F16),
        ];
        for (preset, embd) in [
            (Preset::Q4KM, GgmlType::Q6_K),
            (Preset::Q8_0, GgmlType::Q8_0),
        ] {
            let plans = plan_model(&tensors, 1, Target::Preset(preset), LayerOrder::LayerIndex);
            assert_eq!(plans[0], (Plan::Convert(embd), None));
            assert_eq!(plans[1], (Plan::Convert(preset.base()), None));
        }
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
        let err = Target::parse("q8_k").unwrap_err();
        assert!(
            matches!(
                err,
                GgufError::UnknownQuantTarget {
                    activation_format: Some(GgmlType::Q8_K),
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .contains("(Q8_K is an activation format, not a weight type)"),
            "{err}"
        );
        assert_eq!(Target::Single(GgmlType::Q8_K).file_type(), None);
        assert_eq!(Target::Preset(Preset::Q4KM).file_type(), Some(15));
        assert_eq!(Target::Single(GgmlType::Q4_K).file_type(), Some(14));
    }
}
