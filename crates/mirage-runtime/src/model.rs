//! The transformer graph of the llama family (llama, qwen2, qwen3), generic
//! over a [`Backend`], and the [`Model`] that also holds the other
//! architectures' graphs ([`crate::gemma3`]), one pass each.
//!
//! One block per layer:
//! `h = x + Wo attn(rope(norm_qk(Wq n(x) + bq)), rope(norm_qk(Wk n(x) + bk)), Wv n(x) + bv)`,
//! `x' = h + ffn(n'(h))`; then the final norm and the lm head (`output.weight`,
//! or `token_embd.weight` when the embeddings are tied).

use std::sync::Arc;

use mirage_gguf::{quant, Arch, GgmlType, GgufFile, ModelHparams};

use crate::backend::{
    AttentionParams, Backend, ByteOwner, HostMatrix, QkNorm, SharedBytes, StepInputs, TokenSlot,
};
use crate::error::{Result, RuntimeError};
use crate::kv_cache::{KvDtype, KvSpec};
use crate::ops::RopeMode;
use crate::rope::RopeScaling;

/// Shape and numerics of a model, from its GGUF hyperparameters.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Architecture.
    pub arch: Arch,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// FFN intermediate size.
    pub n_ff: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads.
    pub n_head_kv: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Vocabulary size (rows of the lm head).
    pub vocab_size: usize,
    /// Context length the model was trained with.
    pub n_ctx_train: usize,
    /// RoPE base frequency.
    pub rope_freq_base: f32,
    /// RoPE pairing of this architecture.
    pub rope_mode: RopeMode,
    /// RoPE frequency scaling the file declares (context extension).
    pub rope_scaling: RopeScaling,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
}

impl ModelConfig {
    /// Derives the config from GGUF hyperparameters; refuses what the graph
    /// does not implement (partial rotary, llama3/unknown RoPE scaling, v
    /// heads of another size).
    pub fn from_hparams(hp: &ModelHparams) -> Result<ModelConfig> {
        let unsupported =
            |what: String| RuntimeError::InvalidArgument(format!("unsupported model: {what}"));
        if hp.rope_dim != hp.head_dim {
            return Err(unsupported(format!(
                "partial rotary ({} of {})",
                hp.rope_dim, hp.head_dim
            )));
        }
        if hp.head_dim_v != hp.head_dim {
            return Err(unsupported("value heads of a different size".into()));
        }
        let rope_scaling = RopeScaling::from_hparams(hp)?;
        if hp.n_head_kv == 0 || !hp.n_head.is_multiple_of(hp.n_head_kv) {
            return Err(unsupported(format!(
                "{} heads over {} KV heads",
                hp.n_head, hp.n_head_kv
            )));
        }
        let rope_mode = match hp.arch {
            // llama.cpp: LLM_ARCH_LLAMA -> LLAMA_ROPE_TYPE_NORM; QWEN2/QWEN3 -> NEOX.
            Arch::Llama => RopeMode::Normal,
            Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma3 => RopeMode::Neox,
        };
        Ok(ModelConfig {
            arch: hp.arch,
            n_layer: hp.n_layer,
            n_embd: hp.n_embd,
            n_ff: hp.n_ff,
            n_head: hp.n_head,
            n_head_kv: hp.n_head_kv,
            head_dim: hp.head_dim,
            vocab_size: hp.vocab_size,
            n_ctx_train: hp.n_ctx_train,
            rope_freq_base: hp.rope_freq_base,
            rope_mode,
            rope_scaling,
            rms_norm_eps: hp.rms_norm_eps,
        })
    }

    /// The longest context this model may run: its training context, or,
    /// when the file declares RoPE scaling, the context the scaling
    /// extends to (`factor` times the original context, itself the training
    /// context unless the file names another), whichever is longer.
    pub fn max_context(&self) -> usize {
        let r = &self.rope_scaling;
        if r.kind == crate::rope::RopeScalingKind::None {
            return self.n_ctx_train;
        }
        let base = if r.original_context_length > 0 {
            r.original_context_length
        } else {
            self.n_ctx_train
        };
        let scaled = (base as f64 * r.factor as f64).min(usize::MAX as f64) as usize;
        self.n_ctx_train.max(scaled)
    }

    /// Refuses a context longer than [`ModelConfig::max_context`], naming
    /// both and where the limit comes from.
    pub fn check_context(&self, n_ctx: usize) -> Result<()> {
        let limit = self.max_context();
        if n_ctx <= limit {
            return Ok(());
        }
        let r = &self.rope_scaling;
        let why = if r.kind == crate::rope::RopeScalingKind::None {
            format!(
                "the model was trained on {} positions ({}.context_length) and declares no RoPE scaling",
                self.n_ctx_train,
                self.arch.name()
            )
        } else {
            format!(
                "the model was trained on {} positions and its {:?} RoPE scaling by {} extends that to {limit}",
                self.n_ctx_train, r.kind, r.factor
            )
        };
        Err(RuntimeError::ContextTooLarge { n_ctx, limit, why })
    }

    /// The attention parameters every layer shares.
    pub fn attention_params(&self) -> AttentionParams {
        AttentionParams {
            n_head: self.n_head,
            n_head_kv: self.n_head_kv,
            head_dim: self.head_dim,
            rope_mode: self.rope_mode,
            rope_freq_base: self.rope_freq_base,
            rope_scaling: self.rope_scaling,
            norm_eps: self.rms_norm_eps,
        }
    }
}

struct Layer<B: Backend> {
    attn_norm: B::Vector,
    wq: B::Matrix,
    wk: B::Matrix,
    wv: B::Matrix,
    wo: B::Matrix,
    bias: Option<[B::Vector; 3]>,
    qk_norm: Option<[B::Vector; 2]>,
    ffn_norm: B::Vector,
    ffn: B::Ffn,
}

/// A callback given `(layer, ffn_input_rows)` during a forward pass.
pub type FfnInputObserver<'a> = &'a mut dyn FnMut(usize, &[f32]);

/// Reusable activation buffers of a forward pass (one set per session).
pub struct Scratch<B: Backend> {
    pub(crate) x: B::Activations,
    pub(crate) xn: B::Activations,
    pub(crate) q: B::Activations,
    pub(crate) k: B::Activations,
    pub(crate) v: B::Activations,
    pub(crate) att: B::Activations,
    pub(crate) proj: B::Activations,
    pub(crate) picked: B::Activations,
    pub(crate) logits: B::Activations,
}

/// The blocks of a model, in the layout of its architecture's graph.
enum Blocks<B: Backend> {
    /// llama, qwen2, qwen3: [`Model::pass`].
    Llama(Vec<Layer<B>>),
    /// gemma3: [`crate::gemma3::pass`].
    Gemma3(crate::gemma3::Gemma3Config, Vec<crate::gemma3::Layer<B>>),
}

/// A loaded model: weights uploaded to a backend, plus the graph.
pub struct Model<B: Backend> {
    config: ModelConfig,
    backend: B,
    tok_embd: B::Matrix,
    output: Option<B::Matrix>,
    output_norm: B::Vector,
    blocks: Blocks<B>,
}

impl<B: Backend> std::fmt::Debug for Model<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("config", &self.config)
            .field("backend", &self.backend.name())
            .finish()
    }
}

/// Reads tensors of a GGUF file as [`HostMatrix`] views and f32 vectors.
pub(crate) struct TensorSource {
    file: Arc<GgufFile>,
}

impl TensorSource {
    pub(crate) fn matrix(&self, name: &str, cols: usize, rows: usize) -> Result<HostMatrix> {
        let info = self
            .file
            .tensor_info(name)
            .ok_or_else(|| RuntimeError::MissingTensor(name.into()))?;
        if info.dims != [cols as u64, rows as u64] {
            return Err(RuntimeError::BadShape {
                name: name.into(),
                got: info.dims.clone(),
                expected: vec![cols as u64, rows as u64],
            });
        }
        let start = (self.file.data_offset() + info.offset) as usize;
        let owner: Arc<dyn ByteOwner> = self.file.clone();
        let data = SharedBytes::new(owner, start, info.n_bytes() as usize)
            .ok_or_else(|| RuntimeError::InvalidArgument(format!("{name}: data out of bounds")))?;
        Ok(HostMatrix {
            name: name.into(),
            ty: info.ty,
            rows,
            cols,
            data,
        })
    }

    pub(crate) fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let t = self
            .file
            .tensor(name)
            .ok_or_else(|| RuntimeError::MissingTensor(name.into()))?;
        if t.info.n_elements() != len as u64 {
            return Err(RuntimeError::BadShape {
                name: name.into(),
                got: t.info.dims.clone(),
                expected: vec![len as u64],
            });
        }
        let mut v = vec![0.0f32; len];
        quant::dequantize(t.info.ty, t.data, &mut v)?;
        Ok(v)
    }

    fn has(&self, name: &str) -> bool {
        self.file.tensor_info(name).is_some()
    }
}

impl<B: Backend> Model<B> {
    /// Uploads every weight of `file` to `backend` (zero-copy on the CPU).
    pub fn load(file: Arc<GgufFile>, backend: B) -> Result<Model<B>> {
        let hparams = file.hparams()?;
        let mut config = ModelConfig::from_hparams(&hparams)?;
        // The lm head's rows are the vocabulary the logits cover (Qwen pads
        // its tensor past the tokenizer's list).
        if let Some(t) = file
            .tensor_info("output.weight")
            .or_else(|| file.tensor_info("token_embd.weight"))
        {
            if t.dims.len() == 2 {
                config.vocab_size = t.dims[1] as usize;
            }
        }
        let src = TensorSource { file };
        let c = &config;
        let (d, q_dim, kv_dim) = (c.n_embd, c.n_head * c.head_dim, c.n_head_kv * c.head_dim);
        let n_embd_rows = src
            .file
            .tensor_info("token_embd.weight")
            .map_or(0, |t| t.n_rows() as usize);
        let tok_embd =
            backend.upload_matrix(&src.matrix("token_embd.weight", d, n_embd_rows)?)?;
        let output = if src.has("output.weight") {
            Some(backend.upload_matrix(&src.matrix("output.weight", d, c.vocab_size)?)?)
        } else {
            None
        };
        let output_norm = backend.upload_vector(&src.vector("output_norm.weight", d)?)?;
        if c.arch == Arch::Gemma3 {
            let gemma = crate::gemma3::Gemma3Config::from_file(&src.file, &hparams)?;
            let layers = crate::gemma3::load_layers(&src, &backend, c)?;
            return Ok(Model {
                config,
                backend,
                tok_embd,
                output,
                output_norm,
                blocks: Blocks::Gemma3(gemma, layers),
            });
        }
        let mut layers = Vec::with_capacity(c.n_layer);
        for l in 0..c.n_layer {
            let n = |s: &str| format!("blk.{l}.{s}");
            let mat = |s: &str, cols, rows| -> Result<B::Matrix> {
                backend.upload_matrix(&src.matrix(&n(s), cols, rows)?)
            };
            let vec = |s: &str, len| -> Result<B::Vector> {
                backend.upload_vector(&src.vector(&n(s), len)?)
            };
            let bias = if src.has(&n("attn_q.bias")) {
                Some([
                    vec("attn_q.bias", q_dim)?,
                    vec("attn_k.bias", kv_dim)?,
                    vec("attn_v.bias", kv_dim)?,
                ])
            } else {
                None
            };
            let qk_norm = if src.has(&n("attn_q_norm.weight")) {
                Some([
                    vec("attn_q_norm.weight", c.head_dim)?,
                    vec("attn_k_norm.weight", c.head_dim)?,
                ])
            } else if c.arch == Arch::Qwen3 {
                return Err(RuntimeError::MissingTensor(n("attn_q_norm.weight")));
            } else {
                None
            };
            let ffn = backend.upload_ffn(
                l,
                &src.matrix(&n("ffn_gate.weight"), d, c.n_ff)?,
                &src.matrix(&n("ffn_up.weight"), d, c.n_ff)?,
                &src.matrix(&n("ffn_down.weight"), c.n_ff, d)?,
            )?;
            layers.push(Layer {
                attn_norm: vec("attn_norm.weight", d)?,
                wq: mat("attn_q.weight", d, q_dim)?,
                wk: mat("attn_k.weight", d, kv_dim)?,
                wv: mat("attn_v.weight", d, kv_dim)?,
                wo: mat("attn_output.weight", q_dim, d)?,
                bias,
                qk_norm,
                ffn_norm: vec("ffn_norm.weight", d)?,
                ffn,
            });
        }
        Ok(Model {
            config,
            backend,
            tok_embd,
            output,
            output_norm,
            blocks: Blocks::Llama(layers),
        })
    }

    /// Logits at every position of `tokens` run as one sequence from an
    /// empty cache (`tokens.len() * vocab_size` floats).
    pub fn logits_all(&self, tokens: &[u32], kv_dtype: KvDtype) -> Result<Vec<f32>> {
        let mut cache = self.new_kv_cache(tokens.len().max(1), 1, kv_dtype)?;
        let mut scratch = self.new_scratch();
        let slots: Vec<TokenSlot> = (0..tokens.len())
            .map(|pos| TokenSlot { seq: 0, pos })
            .collect();
        let rows: Vec<usize> = (0..tokens.len()).collect();
        let mut logits = Vec::new();
        self.forward(tokens, &slots, &rows, &mut cache, &mut scratch, &mut logits)?;
        Ok(logits)
    }

    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The backend it runs on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// A KV cache for `n_seq` sequences of up to `n_ctx` positions.
    pub fn new_kv_cache(&self, n_ctx: usize, n_seq: usize, dtype: KvDtype) -> Result<B::KvCache> {
        let c = &self.config;
        self.backend.new_kv_cache(KvSpec {
            n_layer: c.n_layer,
            n_head_kv: c.n_head_kv,
            head_dim: c.head_dim,
            n_ctx,
            n_seq,
            dtype,
        })
    }

    /// [`Model::new_kv_cache`] whose decode attention reads only the KV
    /// pages `pruning` selects (`None`: every position).
    pub fn new_kv_cache_pruned(
        &self,
        n_ctx: usize,
        n_seq: usize,
        dtype: KvDtype,
        pruning: Option<crate::kv_pages::KvPruning>,
    ) -> Result<B::KvCache> {
        let c = &self.config;
        let spec = KvSpec {
            n_layer: c.n_layer,
            n_head_kv: c.n_head_kv,
            head_dim: c.head_dim,
            n_ctx,
            n_seq,
            dtype,
        };
        self.backend.new_kv_cache_pruned(spec, pruning)
    }

    /// Fresh activation buffers.
    pub fn new_scratch(&self) -> Scratch<B> {
        let b = &self.backend;
        Scratch {
            x: b.new_activations(),
            xn: b.new_activations(),
            q: b.new_activations(),
            k: b.new_activations(),
            v: b.new_activations(),
            att: b.new_activations(),
            proj: b.new_activations(),
            picked: b.new_activations(),
            logits: b.new_activations(),
        }
    }

    /// Runs a batch of tokens (row `i` is `tokens[i]` at `slots[i]`) through
    /// the model, filling the KV cache, and writes the logits of the rows
    /// listed in `logits_rows` (in that order) to `logits`, `vocab_size`
    /// floats per row.
    pub fn forward(
        &self,
        tokens: &[u32],
        slots: &[TokenSlot],
        logits_rows: &[usize],
        cache: &mut B::KvCache,
        s: &mut Scratch<B>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        self.forward_observed(tokens, slots, logits_rows, cache, s, logits, None)
    }

    /// [`Model::forward`], calling `observer(layer, x)` with each layer's FFN
    /// input (after `ffn_norm`, `tokens.len() * n_embd` floats, row-major)
    /// before the FFN runs. With `None` it costs nothing (see
    /// [`crate::observe`]).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_observed(
        &self,
        tokens: &[u32],
        slots: &[TokenSlot],
        logits_rows: &[usize],
        cache: &mut B::KvCache,
        s: &mut Scratch<B>,
        logits: &mut Vec<f32>,
        observer: Option<FfnInputObserver<'_>>,
    ) -> Result<()> {
        if tokens.len() != slots.len() || tokens.is_empty() {
            return Err(RuntimeError::InvalidArgument(format!(
                "{} tokens for {} slots",
                tokens.len(),
                slots.len()
            )));
        }
        match observer {
            // An observer need not be Send, so it runs on the caller's thread.
            Some(obs) => {
                self.forward_inner(tokens, slots, logits_rows, cache, s, logits, Some(obs))
            }
            None => self
                .backend
                .run(|| self.forward_inner(tokens, slots, logits_rows, cache, s, logits, None)),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_inner(
        &self,
        tokens: &[u32],
        slots: &[TokenSlot],
        logits_rows: &[usize],
        cache: &mut B::KvCache,
        s: &mut Scratch<B>,
        logits: &mut Vec<f32>,
        observer: Option<FfnInputObserver<'_>>,
    ) -> Result<()> {
        logits.clear();
        match observer {
            // The observer reads activations in the middle of the pass, so
            // the pass cannot be recorded as one unit.
            Some(obs) => self.pass(tokens, slots, logits_rows, cache, s, Some(obs), false)?,
            None => {
                let inputs = StepInputs {
                    tokens,
                    slots,
                    logits_rows,
                };
                self.backend.step(&inputs, || {
                    self.pass(tokens, slots, logits_rows, cache, s, None, false)
                })?
            }
        }
        if !logits_rows.is_empty() {
            self.backend.read(&s.logits, logits)?;
        }
        Ok(())
    }

    /// The final hidden state of every row of `tokens` (after the output
    /// norm, before the lm head: `tokens.len() * n_embd` floats, row-major)
    /// into `hidden`; the keys and values go into `cache` at `slots` as in
    /// [`Model::forward`]. What embeddings are pooled from.
    pub fn hidden_states(
        &self,
        tokens: &[u32],
        slots: &[TokenSlot],
        cache: &mut B::KvCache,
        s: &mut Scratch<B>,
        hidden: &mut Vec<f32>,
    ) -> Result<()> {
        if tokens.len() != slots.len() || tokens.is_empty() {
            return Err(RuntimeError::InvalidArgument(format!(
                "{} tokens for {} slots",
                tokens.len(),
                slots.len()
            )));
        }
        self.backend.run(|| {
            let inputs = StepInputs {
                tokens,
                slots,
                logits_rows: &[],
            };
            self.backend.step(&inputs, || {
                self.pass(tokens, slots, &[], cache, s, None, true)
            })?;
            self.backend.read(&s.xn, hidden).map(|_| ())
        })
    }

    /// Every op of a forward pass up to the lm head (its output stays in
    /// `s.logits`), or with `hidden_out` up to the output norm of every row
    /// (in `s.xn`), through the graph of the model's architecture.
    #[allow(clippy::too_many_arguments)]
    fn pass(
        &self,
        tokens: &[u32],
        slots: &[TokenSlot],
        logits_rows: &[usize],
        cache: &mut B::KvCache,
        s: &mut Scratch<B>,
        observer: Option<FfnInputObserver<'_>>,
        hidden_out: bool,
    ) -> Result<()> {
        match &self.blocks {
            Blocks::Llama(layers) => self.llama_pass(
                layers,
                tokens,
                slots,
                logits_rows,
                cache,
                s,
                observer,
                hidden_out,
            ),
            Blocks::Gemma3(config, layers) => {
                let head = crate::gemma3::Head {
                    tok_embd: &self.tok_embd,
                    output_norm: &self.output_norm,
                    lm_head: self.output.as_ref().unwrap_or(&self.tok_embd),
                };
                crate::gemma3::pass(
                    &self.backend,
                    &self.config,
                    config,
                    &head,
                    layers,
                    tokens,
                    slots,
                    logits_rows,
                    cache,
                    s,
                    observer,
                    hidden_out,
                )
            }
        }
    }

    /// The llama-family pass.
    #[allow(clippy::too_many_arguments)]
    fn llama_pass(
        &self,
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
        let b = &self.backend;
        let c = &self.config;
        let ap = c.attention_params();
        let lm_head = self.output.as_ref().unwrap_or(&self.tok_embd);
        b.embed(&self.tok_embd, tokens, &mut s.x)?;
        for (l, layer) in layers.iter().enumerate() {
            b.rms_norm(&s.x, &layer.attn_norm, c.rms_norm_eps, &mut s.xn)?;
            b.matmul_many(
                &[&layer.wq, &layer.wk, &layer.wv],
                &s.xn,
                &mut [&mut s.q, &mut s.k, &mut s.v],
            )?;
            if let Some([bq, bk, bv]) = &layer.bias {
                b.add_bias(&mut s.q, bq)?;
                b.add_bias(&mut s.k, bk)?;
                b.add_bias(&mut s.v, bv)?;
            }
            let qk_norm = layer.qk_norm.as_ref().map(|[q, k]| QkNorm { q, k });
            b.attention(
                l, &ap, &mut s.q, &mut s.k, &s.v, qk_norm, slots, cache, &mut s.att,
            )?;
            b.matmul(&layer.wo, &s.att, &mut s.proj)?;
            b.add(&mut s.x, &s.proj)?;
            b.rms_norm(&s.x, &layer.ffn_norm, c.rms_norm_eps, &mut s.xn)?;
            if let Some(obs) = observer.as_mut() {
                b.read(&s.xn, &mut observed)?;
                obs(l, &observed);
            }
            b.ffn(&layer.ffn, &s.xn, &mut s.proj)?;
            b.add(&mut s.x, &s.proj)?;
        }
        if hidden_out {
            // Every row's final-normed hidden state, no lm head.
            b.rms_norm(&s.x, &self.output_norm, c.rms_norm_eps, &mut s.xn)?;
            return Ok(());
        }
        if logits_rows.is_empty() {
            return Ok(());
        }
        b.select_rows(&s.x, logits_rows, &mut s.picked)?;
        b.rms_norm(&s.picked, &self.output_norm, c.rms_norm_eps, &mut s.xn)?;
        b.matmul(lm_head, &s.xn, &mut s.logits)?;
        Ok(())
    }
}

/// The GGML type of the lm head (for stats and docs).
pub fn lm_head_type(file: &GgufFile) -> Option<GgmlType> {
    file.tensor_info("output.weight")
        .or_else(|| file.tensor_info("token_embd.weight"))
        .map(|t| t.ty)
}
