//! The gemma3 graph, generic over a [`Backend`].
//!
//! Per layer:
//! `h = x + n_post_attn(Wo attn(rope(n_q(Wq n(x))), rope(n_k(Wk n(x))), Wv n(x)))`,
//! `x' = h + n_post_ffn(down(gelu_tanh(gate n'(h)) * up n'(h)))`; the input is the token
//! embedding times `sqrt(n_embd)`, the output the final norm and the tied lm head, soft-capped when
//! the file says so. Every norm is a plain RMSNorm: llama.cpp's converter already stored Gemma's
//! `1 + w` weights.
//!
//! Attention alternates: five sliding-window layers (each query sees the last
//! `attention.sliding_window` positions, RoPE base 10,000 or `rope.freq_base_swa`) then one
//! global layer (every position, `rope.freq_base` and the file's RoPE scaling), unless
//! `attention.sliding_window_pattern` gives another period or a per-layer list. Scores are scaled
//! by `1/sqrt(head_dim)` (`query_pre_attn_scalar = head_dim`), except for the 62-layer 27B model,
//! which uses `1/sqrt(n_embd / n_head)`: the rule llama.cpp and Google's reference code apply,
//! since the GGUF does not store the scalar.

use mirage_gguf::{GgufFile, ModelHparams, Value};

use crate::backend::{
    AttentionOptions, AttentionParams, Backend, FfnActivation, QkNorm, TokenSlot,
};
use crate::error::{Result, RuntimeError};
use crate::model::{FfnInputObserver, ModelConfig, Scratch, TensorSource};
use crate::rope::RopeScaling;

/// RoPE base of the sliding-window layers when the file does not give one.
const LOCAL_ROPE_BASE: f32 = 10_000.0;

/// Every how many layers a global one comes when the file does not say.
const DEFAULT_PATTERN: usize = 6;

/// What gemma3 adds to [`ModelConfig`].
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3Config {
    /// Whether layer `l` uses sliding-window attention.
    pub sliding: Vec<bool>,
    /// Positions a sliding-window layer sees (`None`: every layer is global).
    pub sliding_window: Option<usize>,
    /// RoPE base of the sliding-window layers.
    pub local_rope_base: f32,
    /// Factor on `q·k`.
    pub attention_scale: f32,
    /// Factor on the token embeddings (`sqrt(n_embd)`).
    pub embedding_scale: f32,
    /// Final logits become `cap * tanh(logits / cap)`.
    pub final_logit_softcap: Option<f32>,
}

impl Gemma3Config {
    /// Reads the gemma3-specific keys of `file`.
    pub fn from_file(file: &GgufFile, hp: &ModelHparams) -> Result<Gemma3Config> {
        let md = file.metadata();
        let bad = |key: &str, reason: String| {
            RuntimeError::InvalidArgument(format!("gemma3 metadata `{key}`: {reason}"))
        };
        let pattern_key = "gemma3.attention.sliding_window_pattern";
        let sliding = match (hp.sliding_window, md.get(pattern_key)) {
            (None, _) => vec![false; hp.n_layer],
            (Some(_), Some(Value::Array(a))) => {
                let flags: Option<Vec<bool>> = a.values.iter().map(Value::as_bool).collect();
                let flags =
                    flags.ok_or_else(|| bad(pattern_key, "not an array of bools".into()))?;
                if flags.len() != hp.n_layer {
                    return Err(bad(
                        pattern_key,
                        format!("{} flags for {} layers", flags.len(), hp.n_layer),
                    ));
                }
                flags
            }
            (Some(_), other) => {
                let period = match other {
                    None => DEFAULT_PATTERN,
                    Some(v) => v
                        .as_u64()
                        .and_then(|p| usize::try_from(p).ok())
                        .ok_or_else(|| bad(pattern_key, "not a layer count".into()))?,
                };
                // llama.cpp: period 0 makes every layer sliding; else the last of each period
                // is global.
                (0..hp.n_layer)
                    .map(|l| period == 0 || l % period < period - 1)
                    .collect()
            }
        };
        let base_key = "gemma3.rope.freq_base_swa";
        let local_rope_base = match md.get(base_key) {
            None => LOCAL_ROPE_BASE,
            Some(v) => v
                .as_f32()
                .filter(|b| b.is_finite() && *b > 0.0)
                .ok_or_else(|| bad(base_key, "not a positive number".into()))?,
        };
        let scalar = if hp.n_layer == 62 {
            (hp.n_embd / hp.n_head) as f32
        } else {
            hp.head_dim as f32
        };
        Ok(Gemma3Config {
            sliding,
            sliding_window: hp.sliding_window,
            local_rope_base,
            attention_scale: 1.0 / scalar.sqrt(),
            embedding_scale: (hp.n_embd as f32).sqrt(),
            final_logit_softcap: hp.final_logit_softcapping,
        })
    }

    /// The attention parameters and options of layer `l`.
    fn layer_attention(&self, c: &ModelConfig, l: usize) -> (AttentionParams, AttentionOptions) {
        let mut params = c.attention_params();
        let sliding = self.sliding[l];
        if sliding {
            params.rope_freq_base = self.local_rope_base;
            params.rope_scaling = RopeScaling::none();
        }
        let options = AttentionOptions {
            scale: Some(self.attention_scale),
            sliding_window: if sliding { self.sliding_window } else { None },
        };
        (params, options)
    }
}

/// One gemma3 block's weights.
pub(crate) struct Layer<B: Backend> {
    attn_norm: B::Vector,
    wq: B::Matrix,
    wk: B::Matrix,
    wv: B::Matrix,
    wo: B::Matrix,
    q_norm: B::Vector,
    k_norm: B::Vector,
    post_attn_norm: B::Vector,
    ffn_norm: B::Vector,
    ffn: B::Ffn,
    post_ffn_norm: B::Vector,
}

/// Uploads the blocks of a gemma3 file.
pub(crate) fn load_layers<B: Backend>(
    src: &TensorSource,
    backend: &B,
    c: &ModelConfig,
) -> Result<Vec<Layer<B>>> {
    let (d, q_dim, kv_dim) = (c.n_embd, c.n_head * c.head_dim, c.n_head_kv * c.head_dim);
    (0..c.n_layer)
        .map(|l| {
            let n = |s: &str| format!("blk.{l}.{s}");
            let mat =
                |s: &str, cols, rows| backend.upload_matrix(&src.matrix(&n(s), cols, rows)?);
            let vec = |s: &str, len| backend.upload_vector(&src.vector(&n(s), len)?);
            Ok(Layer {
                // The FFN first: a backend without GeGLU refuses here, before the big uploads.
                ffn: backend.upload_ffn_with(
                    l,
                    FfnActivation::GeluTanh,
                    &src.matrix(&n("ffn_gate.weight"), d, c.n_ff)?,
                    &src.matrix(&n("ffn_up.weight"), d, c.n_ff)?,
                    &src.matrix(&n("ffn_down.weight"), c.n_ff, d)?,
                )?,
                attn_norm: vec("attn_norm.weight", d)?,
                wq: mat("attn_q.weight", d, q_dim)?,
                wk: mat("attn_k.weight", d, kv_dim)?,
                wv: mat("attn_v.weight", d, kv_dim)?,
                wo: mat("attn_output.weight", q_dim, d)?,
                q_norm: vec("attn_q_norm.weight", c.head_dim)?,
                k_norm: vec("attn_k_norm.weight", c.head_dim)?,
                post_attn_norm: vec("post_attention_norm.weight", d)?,
                ffn_norm: vec("ffn_norm.weight", d)?,
                post_ffn_norm: vec("post_ffw_norm.weight", d)?,
            })
        })
        .collect()
}

/// The weights outside the blocks, borrowed from the model.
pub(crate) struct Head<'a, B: Backend> {
    pub(crate) tok_embd: &'a B::Matrix,
    pub(crate) output_norm: &'a B::Vector,
    pub(crate) lm_head: &'a B::Matrix,
}

/// Every op of a gemma3 forward pass up to the lm head (its output stays in
/// `s.logits`), or with `hidden_out` up to the output norm of every row (in
/// `s.xn`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn pass<B: Backend>(
    b: &B,
    c: &ModelConfig,
    g: &Gemma3Config,
    head: &Head<'_, B>,
    layers: &[Layer<B>],
    tokens: &[u32],
    slots: &[TokenSlot],
    logits_rows: &[usize],
    cache: &mut B::KvCache,
    s: &mut Scratch<B>,
    mut observer: Option<FfnInputObserver<'_>>,
    hidden_out: bool,
) -> Result<()> {
    let mut observed = Vec::new();
    let eps = c.rms_norm_eps;
    b.embed(head.tok_embd, tokens, &mut s.x)?;
    b.scale(&mut s.x, g.embedding_scale)?;
    for (l, layer) in layers.iter().enumerate() {
        let (params, options) = g.layer_attention(c, l);
        b.rms_norm(&s.x, &layer.attn_norm, eps, &mut s.xn)?;
        b.matmul_many(
            &[&layer.wq, &layer.wk, &layer.wv],
            &s.xn,
            &mut [&mut s.q, &mut s.k, &mut s.v],
        )?;
        let qk_norm = QkNorm {
            q: &layer.q_norm,
            k: &layer.k_norm,
        };
        b.attention_with(
            l,
            &params,
            &options,
            &mut s.q,
            &mut s.k,
            &s.v,
            Some(qk_norm),
            slots,
            cache,
            &mut s.att,
        )?;
        b.matmul(&layer.wo, &s.att, &mut s.proj)?;
        b.rms_norm(&s.proj, &layer.post_attn_norm, eps, &mut s.xn)?;
        b.add(&mut s.x, &s.xn)?;
        b.rms_norm(&s.x, &layer.ffn_norm, eps, &mut s.xn)?;
        if let Some(obs) = observer.as_mut() {
            b.read(&s.xn, &mut observed)?;
            obs(l, &observed);
        }
        b.ffn(&layer.ffn, &s.xn, &mut s.proj)?;
        b.rms_norm(&s.proj, &layer.post_ffn_norm, eps, &mut s.xn)?;
        b.add(&mut s.x, &s.xn)?;
    }
    if hidden_out {
        // Every row's final-normed hidden state, no lm head.
        b.rms_norm(&s.x, head.output_norm, eps, &mut s.xn)?;
        return Ok(());
    }
    if logits_rows.is_empty() {
        return Ok(());
    }
    b.select_rows(&s.x, logits_rows, &mut s.picked)?;
    b.rms_norm(&s.picked, head.output_norm, eps, &mut s.xn)?;
    b.matmul(head.lm_head, &s.xn, &mut s.logits)?;
    if let Some(cap) = g.final_logit_softcap {
        b.softcap(&mut s.logits, cap)?;
    }
    Ok(())
}
