//! Typed model hyperparameters for the architectures MIRAGE runs (llama,
//! qwen2, qwen3, gemma3), read from `{arch}.*` metadata keys.

use crate::error::GgufError;
use crate::metadata::{Metadata, Value};
use crate::reader::GgufFile;

/// A model architecture MIRAGE has a graph for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    /// llama (also SmolLM2, Mistral-style dense models).
    Llama,
    /// qwen2 / Qwen2.5: llama plus q/k/v biases.
    Qwen2,
    /// qwen3: llama plus per-head RMS norm of q and k (QK-norm), no biases.
    Qwen3,
    /// gemma3: GeGLU FFN, QK-norm, norms after attention and FFN too, scaled embeddings, and
    /// sliding-window attention in five of every six layers.
    Gemma3,
}

impl Arch {
    /// Parses `general.architecture`.
    pub fn from_name(name: &str) -> Option<Arch> {
        match name {
            "llama" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            "gemma3" => Some(Arch::Gemma3),
            _ => None,
        }
    }

    /// The name used as the metadata key prefix.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
        }
    }
}

/// The RoPE scaling kind (`{arch}.rope.scaling.type`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScalingType {
    /// Position interpolation.
    Linear,
    /// YaRN.
    Yarn,
    /// Llama-3 style frequency-dependent scaling.
    Llama3,
    /// Any other type string present in the file.
    Other,
}

/// RoPE scaling parameters, present only when the file declares a scaling
/// type other than `none`.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeScaling {
    /// The kind.
    pub kind: RopeScalingType,
    /// The type string as written in the file.
    pub type_name: String,
    /// `{arch}.rope.scaling.factor` (1.0 if absent).
    pub factor: f32,
    /// `{arch}.rope.scaling.original_context_length`, if present.
    pub original_context_length: Option<u64>,
}

/// Typed hyperparameters of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelHparams {
    /// The architecture.
    pub arch: Arch,
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// Model width (d_model).
    pub n_embd: usize,
    /// FFN intermediate width.
    pub n_ff: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (GQA); equals `n_head` when the key is absent.
    pub n_head_kv: usize,
    /// Per-head key/query width (`attention.key_length`, else n_embd/n_head).
    pub head_dim: usize,
    /// Per-head value width (`attention.value_length`, else `head_dim`).
    pub head_dim_v: usize,
    /// Rotated dims per head (`rope.dimension_count`, else `head_dim`).
    pub rope_dim: usize,
    /// Training context length.
    pub n_ctx_train: usize,
    /// Vocabulary size (tokenizer tokens array length, else `{arch}.vocab_size`,
    /// else the embedding tensor's row count).
    pub vocab_size: usize,
    /// RoPE base frequency (10000 when absent, as in llama.cpp).
    pub rope_freq_base: f32,
    /// RoPE scaling, if the file declares one.
    pub rope_scaling: Option<RopeScaling>,
    /// RMS norm epsilon.
    pub rms_norm_eps: f32,
    /// Whether the LM head reuses the token embedding (no `output.weight`).
    pub tied_embeddings: bool,
    /// Whether attention q/k/v projections carry biases (qwen2).
    pub attn_qkv_bias: bool,
    /// Whether q and k get a per-head RMS norm (qwen3).
    pub attn_qk_norm: bool,
    /// Positions a sliding-window attention layer sees, itself included
    /// (`attention.sliding_window`; gemma3).
    pub sliding_window: Option<usize>,
    /// Final logits become `cap * tanh(logits / cap)` (`final_logit_softcapping`).
    pub final_logit_softcapping: Option<f32>,
}

fn type_name(v: &Value) -> &'static str {
    v.value_type().name()
}

struct Keys<'a> {
    md: &'a Metadata,
    prefix: &'static str,
}

impl Keys<'_> {
    fn key(&self, suffix: &str) -> String {
        format!("{}.{}", self.prefix, suffix)
    }

    fn opt_usize(&self, suffix: &str) -> Result<Option<usize>, GgufError> {
        let key = self.key(suffix);
        match self.md.get(&key) {
            None => Ok(None),
            Some(v) => match v.as_u64().and_then(|x| usize::try_from(x).ok()) {
                Some(x) => Ok(Some(x)),
                None => Err(GgufError::WrongType {
                    key,
                    found: type_name(v),
                    expected: "non-negative integer",
                }),
            },
        }
    }

    fn usize(&self, suffix: &str) -> Result<usize, GgufError> {
        self.opt_usize(suffix)?
            .ok_or_else(|| GgufError::MissingKey {
                key: self.key(suffix),
            })
    }

    fn opt_f32(&self, suffix: &str) -> Result<Option<f32>, GgufError> {
        let key = self.key(suffix);
        match self.md.get(&key) {
            None => Ok(None),
            Some(v) => v.as_f32().map(Some).ok_or(GgufError::WrongType {
                key,
                found: type_name(v),
                expected: "float",
            }),
        }
    }
}

fn nonzero(key: &str, v: usize) -> Result<usize, GgufError> {
    if v == 0 {
        Err(GgufError::BadHparam {
            key: key.into(),
            reason: "must be > 0".into(),
        })
    } else {
        Ok(v)
    }
}

/// At most this many tensor mismatches are listed (the rest are counted).
const MAX_LISTED_MISMATCHES: usize = 16;

impl ModelHparams {
    /// Reads the hyperparameters of a parsed file and checks them against
    /// its tensor table ([`ModelHparams::tensor_mismatches`]): what every
    /// loader calls before it sizes anything by them.
    pub fn from_gguf(file: &GgufFile) -> Result<ModelHparams, GgufError> {
        let hp = ModelHparams::from_metadata(file)?;
        let problems = hp.tensor_mismatches(file);
        if let Some(first) = problems.first() {
            return Err(GgufError::HparamsMismatch {
                first: first.clone(),
                more: problems.len() - 1,
            });
        }
        Ok(hp)
    }

    /// Reads the hyperparameters from the `{arch}.*` keys alone (plus which
    /// optional tensors exist), without checking them against the tensor
    /// shapes: for reports such as `inspect`. Nothing may be sized by them
    /// before [`ModelHparams::tensor_mismatches`] came back empty.
    pub fn from_metadata(file: &GgufFile) -> Result<ModelHparams, GgufError> {
        let md = file.metadata();
        let arch_name =
            md.get_str("general.architecture")
                .ok_or_else(|| GgufError::MissingKey {
                    key: "general.architecture".into(),
                })?;
        let arch = Arch::from_name(arch_name).ok_or_else(|| GgufError::UnsupportedArch {
            arch: arch_name.to_owned(),
        })?;
        let k = Keys {
            md,
            prefix: arch.name(),
        };

        let n_layer = nonzero("block_count", k.usize("block_count")?)?;
        let n_embd = nonzero("embedding_length", k.usize("embedding_length")?)?;
        let n_ff = nonzero("feed_forward_length", k.usize("feed_forward_length")?)?;
        let n_head = nonzero("attention.head_count", k.usize("attention.head_count")?)?;
        let n_head_kv = k.opt_usize("attention.head_count_kv")?.unwrap_or(n_head);
        if n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(GgufError::BadHparam {
                key: k.key("attention.head_count_kv"),
                reason: format!("{n_head_kv} does not divide head_count {n_head}"),
            });
        }
        let head_dim = match k.opt_usize("attention.key_length")? {
            Some(d) => nonzero("attention.key_length", d)?,
            None => {
                if n_embd % n_head != 0 {
                    return Err(GgufError::BadHparam {
                        key: k.key("embedding_length"),
                        reason: format!("{n_embd} not divisible by head_count {n_head}"),
                    });
                }
                n_embd / n_head
            }
        };
        let head_dim_v = k.opt_usize("attention.value_length")?.unwrap_or(head_dim);
        let rope_dim = k.opt_usize("rope.dimension_count")?.unwrap_or(head_dim);
        let n_ctx_train = nonzero("context_length", k.usize("context_length")?)?;
        for (what, n) in [("query", n_head), ("key/value", n_head_kv)] {
            if n.checked_mul(head_dim).is_none() {
                return Err(GgufError::BadHparam {
                    key: k.key("attention.head_count"),
                    reason: format!("{what} width {n} x head_dim {head_dim} overflows"),
                });
            }
        }
        let rms_norm_eps = k
            .opt_f32("attention.layer_norm_rms_epsilon")?
            .ok_or_else(|| GgufError::MissingKey {
                key: k.key("attention.layer_norm_rms_epsilon"),
            })?;
        let rope_freq_base = k.opt_f32("rope.freq_base")?.unwrap_or(10_000.0);

        let rope_scaling = match md.get_str(&k.key("rope.scaling.type")) {
            None | Some("none") => None,
            Some(t) => Some(RopeScaling {
                kind: match t {
                    "linear" => RopeScalingType::Linear,
                    "yarn" => RopeScalingType::Yarn,
                    "llama3" => RopeScalingType::Llama3,
                    _ => RopeScalingType::Other,
                },
                type_name: t.to_owned(),
                factor: k.opt_f32("rope.scaling.factor")?.unwrap_or(1.0),
                original_context_length: k
                    .opt_usize("rope.scaling.original_context_length")?
                    .map(|x| x as u64),
            }),
        };

        let embd = file.tensor_info("token_embd.weight");
        let vocab_size = match md.array_len("tokenizer.ggml.tokens") {
            Some(n) => n,
            None => match k.opt_usize("vocab_size")? {
                Some(n) => n,
                None => match embd {
                    Some(t) if t.dims.len() == 2 => t.dims[1] as usize,
                    _ => {
                        return Err(GgufError::MissingKey {
                            key: "tokenizer.ggml.tokens".into(),
                        })
                    }
                },
            },
        };
        let vocab_size = nonzero("vocab_size", vocab_size)?;

        Ok(ModelHparams {
            arch,
            n_layer,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            head_dim_v,
            rope_dim,
            n_ctx_train,
            vocab_size,
            rope_freq_base,
            rope_scaling,
            rms_norm_eps,
            tied_embeddings: file.tensor_info("output.weight").is_none(),
            attn_qkv_bias: file.tensor_info("blk.0.attn_q.bias").is_some(),
            attn_qk_norm: file.tensor_info("blk.0.attn_q_norm.weight").is_some(),
            sliding_window: match k.opt_usize("attention.sliding_window")? {
                Some(w) => Some(nonzero("attention.sliding_window", w)?),
                None => None,
            },
            final_logit_softcapping: match k.opt_f32("final_logit_softcapping")? {
                Some(c) if !(c.is_finite() && c > 0.0) => {
                    return Err(GgufError::BadHparam {
                        key: k.key("final_logit_softcapping"),
                        reason: format!("{c} is not a positive number"),
                    })
                }
                c => c,
            },
        })
    }

    /// Every way the tensor table disagrees with these hyperparameters: a
    /// block below `block_count` that is missing (listing stops there, so a
    /// huge count costs one line), a block at or above it, a required tensor
    /// that is missing or whose dims differ from the ones `embedding_length`,
    /// `feed_forward_length`, the head counts, `head_dim` and the vocabulary
    /// give. Empty when the file is consistent. At most 16 lines, the last
    /// one counting the rest.
    pub fn tensor_mismatches(&self, file: &GgufFile) -> Vec<String> {
        let a = self.arch.name();
        let mut out = Vec::new();
        let (d, ff) = (self.n_embd as u64, self.n_ff as u64);
        let hd = self.head_dim as u64;
        // Checked in from_metadata: these products fit.
        let (q, kv) = (self.q_dim() as u64, self.kv_dim() as u64);
        let emb = format!("{a}.embedding_length={d}");
        let ffs = format!("{emb}, {a}.feed_forward_length={ff}");
        let hds = if file
            .metadata()
            .contains_key(&format!("{a}.attention.key_length"))
        {
            format!("head_dim {hd} ({a}.attention.key_length)")
        } else {
            format!("head_dim {hd} ({a}.embedding_length / {a}.attention.head_count)")
        };
        let qs = format!("{emb}, {a}.attention.head_count={} x {hds}", self.n_head);
        let kvs = format!(
            "{emb}, {a}.attention.head_count_kv={} x {hds}",
            self.n_head_kv
        );
        let check =
            |out: &mut Vec<String>, name: &str, want: &[u64], from: &str, required| match file
                .tensor_info(name)
            {
                None if required => out.push(format!("tensor {name} is missing")),
                None => {}
                Some(t) if t.dims != want => out.push(format!(
                    "tensor {name} has dims {:?}, but {from} give {want:?}",
                    t.dims
                )),
                Some(_) => {}
            };
        let vocab = self.vocab_size as u64;
        for (name, required) in [("token_embd.weight", true), ("output.weight", false)] {
            match file.tensor_info(name) {
                None if required => check(&mut out, name, &[d, vocab], &emb, true),
                None => {}
                Some(t) => {
                    let rows = t.dims.get(1).copied().unwrap_or(0);
                    let want = [d, rows.max(vocab)];
                    let from = format!("{emb} and a vocabulary of {vocab} tokens (at least)");
                    check(&mut out, name, &want, &from, true);
                }
            }
        }
        check(&mut out, "output_norm.weight", &[d], &emb, true);
        let layer_tensors: [(&str, Vec<u64>, &str, bool); 14] = [
            ("attn_norm.weight", vec![d], &emb, true),
            ("attn_q.weight", vec![d, q], &qs, true),
            ("attn_k.weight", vec![d, kv], &kvs, true),
            ("attn_v.weight", vec![d, kv], &kvs, true),
            ("attn_output.weight", vec![q, d], &qs, true),
            ("ffn_norm.weight", vec![d], &emb, true),
            ("ffn_gate.weight", vec![d, ff], &ffs, true),
            ("ffn_up.weight", vec![d, ff], &ffs, true),
            ("ffn_down.weight", vec![ff, d], &ffs, true),
            ("attn_q.bias", vec![q], &qs, false),
            ("attn_k.bias", vec![kv], &kvs, false),
            ("attn_v.bias", vec![kv], &kvs, false),
            ("attn_q_norm.weight", vec![hd], &hds, false),
            ("attn_k_norm.weight", vec![hd], &hds, false),
        ];
        // Blocks present in the file: 1 + the largest `blk.N.` index.
        let blocks_in_file = file
            .tensors()
            .iter()
            .filter_map(|t| {
                t.name
                    .strip_prefix("blk.")?
                    .split('.')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .max()
            .map_or(0, |m| m + 1);
        for l in 0..self.n_layer {
            let names: Vec<String> = layer_tensors
                .iter()
                .map(|(s, ..)| format!("blk.{l}.{s}"))
                .collect();
            if names.iter().all(|n| file.tensor_info(n).is_none()) {
                out.push(format!(
                    "{a}.block_count is {}, but the file has no blk.{l}.* tensors (it holds {blocks_in_file} blocks)",
                    self.n_layer
                ));
                break;
            }
            for (n, (_, want, from, required)) in names.iter().zip(&layer_tensors) {
                check(&mut out, n, want, from, *required);
            }
            if out.len() > MAX_LISTED_MISMATCHES {
                break;
            }
        }
        if blocks_in_file > self.n_layer as u64 {
            out.push(format!(
                "{a}.block_count is {}, but the file has tensors of block blk.{}",
                self.n_layer,
                blocks_in_file - 1
            ));
        }
        if out.len() > MAX_LISTED_MISMATCHES {
            let more = out.len() - (MAX_LISTED_MISMATCHES - 1);
            out.truncate(MAX_LISTED_MISMATCHES - 1);
            out.push(format!("... and {more} more"));
        }
        out
    }

    /// Query width: `n_head * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Key/value width: `n_head_kv * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
}
