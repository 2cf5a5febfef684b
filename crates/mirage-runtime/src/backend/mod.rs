//! The [`Backend`] trait: the seam where compute devices plug in.
//!
//! Design rules (after wgpu-hal's `Api`, candle's `BackendStorage` and burn's
//! `Backend`):
//! - A backend owns its memory through associated types ([`Backend::Matrix`],
//!   [`Backend::Activations`], [`Backend::KvCache`], ...). The model graph in
//!   [`crate::model`] only moves handles around; it never reads device memory
//!   except through [`Backend::read`].
//! - Weights are uploaded once, in their quantized form ([`HostMatrix`] carries
//!   the raw ggml blocks). The CPU backend keeps them memory-mapped; a GPU
//!   backend copies them to the device; nothing is expanded to f32 whole.
//! - Every op works on a batch of token rows. A [`TokenSlot`] per row says
//!   which sequence (KV-cache slot) and position it belongs to, so the same
//!   call is a prefill of `n` tokens of one sequence, a decode step of a batch
//!   of sequences, or a mix of both.
//! - The FFN is one op with its own weight type ([`Backend::Ffn`]), built from
//!   the gate/up/down matrices by [`Backend::upload_ffn`]. The superblock-sparse
//!   and NVFP4 backends replace exactly that op (and may repack the weights
//!   page-major at upload), leaving attention and the rest untouched.
//! - CPU ([`cpu::CpuBackend`]) is the always-built reference implementation.
//!
//! The trait is deliberately small: ops that a device fuses anyway (q/k norm,
//! RoPE, the KV-cache write and the attention itself) are one call.
//! [`Backend::step`] brackets the ops of one forward pass with its per-row
//! inputs ([`StepInputs`]), so that a GPU backend can copy them to the device
//! once and replay a recorded pass (a CUDA graph) instead of launching every
//! op; the CPU backend keeps the default, which just runs the ops.

pub mod cpu;
mod forward;

use std::sync::Arc;

use crate::error::Result;
use crate::kv_cache::KvSpec;
use crate::ops::RopeMode;
use mirage_gguf::GgmlType;

/// How [`crate::RuntimeError::Unsupported`] names the deterministic mode.
pub const DETERMINISTIC_FEATURE: &str = "deterministic (batch-invariant) mode";

/// Which sequence and position a row of a batch belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenSlot {
    /// KV-cache sequence slot.
    pub seq: usize,
    /// Position in that sequence (0-based).
    pub pos: usize,
}

/// The per-row inputs of one forward pass (see [`Backend::step`]).
#[derive(Debug, Clone, Copy)]
pub struct StepInputs<'a> {
    /// Token id of each row.
    pub tokens: &'a [u32],
    /// Sequence slot and position of each row.
    pub slots: &'a [TokenSlot],
    /// Rows whose logits the pass computes, in order.
    pub logits_rows: &'a [usize],
}

/// Something that owns bytes that stay put while it is alive (a memory map,
/// a parsed GGUF file, a `Vec`).
pub trait ByteOwner: Send + Sync {
    /// The owned bytes.
    fn bytes(&self) -> &[u8];
}

impl ByteOwner for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

impl ByteOwner for mirage_gguf::GgufFile {
    fn bytes(&self) -> &[u8] {
        self.as_bytes()
    }
}

/// A shared, immutable byte range of a [`ByteOwner`] (zero-copy view of a
/// tensor inside a memory-mapped model file).
#[derive(Clone)]
pub struct SharedBytes {
    owner: Arc<dyn ByteOwner>,
    start: usize,
    len: usize,
}

impl std::fmt::Debug for SharedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedBytes({}..{})", self.start, self.start + self.len)
    }
}

impl SharedBytes {
    /// The range `start..start + len` of `owner`; `None` when out of bounds.
    pub fn new(owner: Arc<dyn ByteOwner>, start: usize, len: usize) -> Option<SharedBytes> {
        let end = start.checked_add(len)?;
        (end <= owner.bytes().len()).then_some(SharedBytes { owner, start, len })
    }

    /// Takes ownership of a buffer.
    pub fn from_vec(v: Vec<u8>) -> SharedBytes {
        let len = v.len();
        SharedBytes {
            owner: Arc::new(v),
            start: 0,
            len,
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.owner.bytes()[self.start..self.start + self.len]
    }
}

/// A weight matrix on the host in its ggml encoding: `rows` rows of `cols`
/// elements of type `ty`, row-major (ggml dims `[cols, rows]`).
#[derive(Debug, Clone)]
pub struct HostMatrix {
    /// Tensor name, for error messages.
    pub name: String,
    /// Element type.
    pub ty: GgmlType,
    /// Output features (rows).
    pub rows: usize,
    /// Input features (row length).
    pub cols: usize,
    /// The raw blocks: `rows * row_bytes(ty, cols)` bytes.
    pub data: SharedBytes,
}

/// Shape and numerics of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionParams {
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_head`).
    pub n_head_kv: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// RoPE pairing.
    pub rope_mode: RopeMode,
    /// RoPE base frequency.
    pub rope_freq_base: f32,
    /// RoPE frequency scaling (backends that cannot apply it refuse it).
    pub rope_scaling: crate::rope::RopeScaling,
    /// Epsilon of the per-head q/k RMSNorm (qwen3).
    pub norm_eps: f32,
}

/// The rows and width of one attention input (q, k or v) of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputShape {
    /// Token rows.
    pub rows: usize,
    /// Elements a row.
    pub width: usize,
}

impl AttentionParams {
    /// The checks every backend makes before it attends a batch, with the
    /// errors it returns: the query heads group evenly over the KV heads,
    /// `head_dim` is even (RoPE turns pairs), q, k and v hold one row per
    /// slot of their heads' width, the cache holds layer `layer` with this
    /// layer's KV heads and head size, and every slot fits the cache
    /// (`ContextFull` past its positions).
    pub fn check_batch(
        &self,
        q: InputShape,
        k: InputShape,
        v: InputShape,
        slots: &[TokenSlot],
        cache: &KvSpec,
        layer: usize,
    ) -> Result<()> {
        use crate::error::RuntimeError;
        let hd = self.head_dim;
        if self.n_head_kv == 0
            || !self.n_head.is_multiple_of(self.n_head_kv)
            || !hd.is_multiple_of(2)
        {
            return Err(RuntimeError::InvalidArgument(format!(
                "bad attention shape {self:?}"
            )));
        }
        let n = slots.len();
        if q.rows != n
            || k.rows != n
            || v.rows != n
            || q.width != self.n_head * hd
            || k.width != self.n_head_kv * hd
            || v.width != k.width
        {
            return Err(RuntimeError::InvalidArgument(
                "attention inputs do not match the batch".into(),
            ));
        }
        if cache.head_dim != hd || cache.n_head_kv != self.n_head_kv || layer >= cache.n_layer {
            return Err(RuntimeError::InvalidArgument(
                "KV cache shape does not match the layer".into(),
            ));
        }
        if slots.iter().any(|s| s.pos >= cache.n_ctx) {
            return Err(RuntimeError::ContextFull { n_ctx: cache.n_ctx });
        }
        if let Some(s) = slots.iter().find(|s| s.seq >= cache.n_seq) {
            return Err(RuntimeError::InvalidArgument(format!(
                "sequence slot {} >= {}",
                s.seq, cache.n_seq
            )));
        }
        Ok(())
    }
}

/// The activation of a gated FFN: `down(act(gate x) * up x)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FfnActivation {
    /// SiLU (SwiGLU: llama, qwen).
    #[default]
    Silu,
    /// GELU with the tanh approximation (GeGLU: gemma).
    GeluTanh,
}

/// What a layer's attention computes beyond [`Backend::attention`]'s default
/// (gemma's sliding windows and query scaling). The default value is that
/// default attention.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AttentionOptions {
    /// The factor on `q·k` (default `1/sqrt(head_dim)`).
    pub scale: Option<f32>,
    /// Each query attends only to the last `window` positions of its
    /// sequence, itself included (`None`: every position).
    pub sliding_window: Option<usize>,
}

/// Per-head RMSNorm weights of q and k applied before RoPE (qwen3's QK-norm).
#[derive(Debug, Clone, Copy)]
pub struct QkNorm<'a, V> {
    /// Weight of the query norm (`head_dim`).
    pub q: &'a V,
    /// Weight of the key norm (`head_dim`).
    pub k: &'a V,
}

/// A compute device that runs the model graph. See the module doc for the
/// design rules.
pub trait Backend: Send + Sync {
    /// A weight matrix resident on the device in its quantized form.
    type Matrix: Send + Sync;
    /// A small f32 vector (norm weights, biases).
    type Vector: Send + Sync;
    /// One layer's FFN weights (gate, up, down), in the backend's layout.
    type Ffn: Send + Sync;
    /// A `[rows, width]` f32 activation buffer; ops set the shape of outputs.
    type Activations: Send;
    /// The key/value cache of every layer and sequence slot.
    type KvCache: Send;

    /// Short name (`cpu`, `cuda`, ...), for logs and stats.
    fn name(&self) -> String;

    /// Runs a whole forward pass in the backend's execution context (the
    /// CPU backend's thread pool, so that the ops' parallel loops do not
    /// each hand work across threads). The default just calls `f`.
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R
    where
        Self: Sized,
    {
        f()
    }

    /// Runs `pass`: the ops of one forward pass over the batch `inputs`
    /// (embedding to lm head, not the final [`Backend::read`]). Inside it,
    /// [`Backend::embed`], [`Backend::attention`] and [`Backend::select_rows`]
    /// receive exactly `inputs.tokens`, `inputs.slots` and
    /// `inputs.logits_rows`. A backend may copy these to the device once
    /// before the ops run and record the ops' launches, replaying a recorded
    /// pass when a later one launches the same work with other inputs (CUDA
    /// graphs: a decode step then costs one launch). The default just runs
    /// `pass`.
    fn step<R>(&self, inputs: &StepInputs<'_>, pass: impl FnOnce() -> Result<R>) -> Result<R>
    where
        Self: Sized,
    {
        let _ = inputs;
        pass()
    }

    /// Turns batch-invariant arithmetic on or off (see
    /// [`crate::EngineOptions::deterministic`]): with `on`, every row of a
    /// forward pass must come out the same bits whatever the other rows of
    /// the batch are and however a sequence's tokens are split into passes.
    /// Called once, before any upload. The default accepts `false` and
    /// refuses `true` with [`crate::RuntimeError::Unsupported`]: a backend
    /// honours the mode only by implementing this.
    fn set_deterministic(&mut self, on: bool) -> Result<()> {
        if on {
            Err(crate::error::RuntimeError::Unsupported {
                backend: self.name(),
                what: DETERMINISTIC_FEATURE.to_string(),
            })
        } else {
            Ok(())
        }
    }
    /// Uploads a weight matrix once, keeping its quantization.
    fn upload_matrix(&self, m: &HostMatrix) -> Result<Self::Matrix>;
    /// Uploads an f32 vector.
    fn upload_vector(&self, v: &[f32]) -> Result<Self::Vector>;
    /// Uploads the FFN of layer `layer`: `gate` and `up` are `[n_ff, n_embd]`,
    /// `down` is `[n_embd, n_ff]`.
    fn upload_ffn(
        &self,
        layer: usize,
        gate: &HostMatrix,
        up: &HostMatrix,
        down: &HostMatrix,
    ) -> Result<Self::Ffn>;
    /// [`Backend::upload_ffn`] for an FFN with the given activation. The
    /// default uploads a SiLU FFN and refuses any other activation with
    /// [`crate::RuntimeError::Unsupported`], so a model that needs one fails at
    /// load time on backends that do not implement it.
    fn upload_ffn_with(
        &self,
        layer: usize,
        activation: FfnActivation,
        gate: &HostMatrix,
        up: &HostMatrix,
        down: &HostMatrix,
    ) -> Result<Self::Ffn> {
        match activation {
            FfnActivation::Silu => self.upload_ffn(layer, gate, up, down),
            FfnActivation::GeluTanh => Err(self.unsupported("the GELU (tanh) FFN of gemma models")),
        }
    }
    /// A KV cache of the given shape.
    fn new_kv_cache(&self, spec: KvSpec) -> Result<Self::KvCache>;
    /// A KV cache whose decode attention reads only the KV pages `pruning`
    /// selects (see [`crate::kv_pages`]); `None` is [`Backend::new_kv_cache`].
    /// Backends without pruned attention refuse `Some` (never a silent full
    /// attention: the caller asked for a different computation).
    fn new_kv_cache_pruned(
        &self,
        spec: KvSpec,
        pruning: Option<crate::kv_pages::KvPruning>,
    ) -> Result<Self::KvCache> {
        match pruning {
            None => self.new_kv_cache(spec),
            Some(_) => Err(crate::error::RuntimeError::InvalidArgument(format!(
                "the {} backend does not prune KV pages",
                self.name()
            ))),
        }
    }
    /// Turns the KV-page selection of `cache` on (`Some`) or off (`None`:
    /// decode attention reads every position) between steps, e.g. to
    /// compare pruned and full decode over the same cached prefix. The
    /// cache keeps its page summaries up to date on every write while the
    /// selection is off, so switching it back on is exact. `Some` needs a
    /// cache made by [`Backend::new_kv_cache_pruned`] with `Some` rule of the
    /// same page size (the summaries depend on it); the rest of the rule
    /// (sinks, recent, top pages, dense layers) may change. `None` is
    /// accepted on any cache. The default (backends without pruned
    /// attention) accepts `None` and refuses `Some`, like
    /// [`Backend::new_kv_cache_pruned`].
    fn kv_set_pruning(
        &self,
        cache: &mut Self::KvCache,
        pruning: Option<crate::kv_pages::KvPruning>,
    ) -> Result<()> {
        let _ = cache;
        match pruning {
            None => Ok(()),
            Some(_) => Err(crate::error::RuntimeError::InvalidArgument(format!(
                "the {} backend does not prune KV pages",
                self.name()
            ))),
        }
    }
    /// Drops positions `pos..` of sequence `seq` from the cache.
    fn kv_truncate(&self, cache: &mut Self::KvCache, seq: usize, pos: usize);
    /// An empty activation buffer.
    fn new_activations(&self) -> Self::Activations;

    /// `out[r] = table[tokens[r]]` (rows of the embedding matrix, as f32).
    fn embed(
        &self,
        table: &Self::Matrix,
        tokens: &[u32],
        out: &mut Self::Activations,
    ) -> Result<()>;
    /// Row-wise RMSNorm: `out[r] = x[r] / rms(x[r]) * weight`.
    fn rms_norm(
        &self,
        x: &Self::Activations,
        weight: &Self::Vector,
        eps: f32,
        out: &mut Self::Activations,
    ) -> Result<()>;
    /// `out[r] = W x[r]` for every row (`W` is `[rows, cols]`).
    fn matmul(
        &self,
        w: &Self::Matrix,
        x: &Self::Activations,
        out: &mut Self::Activations,
    ) -> Result<()>;
    /// Several products of the same input (`outs[i][r] = ws[i] x[r]`), such
    /// as Q, K and V: a backend can quantize `x` once and run them as one
    /// launch. The default calls [`Backend::matmul`] for each.
    fn matmul_many(
        &self,
        ws: &[&Self::Matrix],
        x: &Self::Activations,
        outs: &mut [&mut Self::Activations],
    ) -> Result<()> {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.matmul(w, x, out)?;
        }
        Ok(())
    }
    /// `x[r] += bias` for every row.
    fn add_bias(&self, x: &mut Self::Activations, bias: &Self::Vector) -> Result<()>;
    /// `acc += x` (residual connection).
    fn add(&self, acc: &mut Self::Activations, x: &Self::Activations) -> Result<()>;
    /// Self-attention of a batch: applies the optional QK-norm and RoPE to
    /// `q` and `k`, stores `k` and `v` into `cache` at each row's slot, then
    /// attends each query row causally over positions `0..=pos` of its
    /// sequence. `out` gets `n_head * head_dim` per row. `q` and `k` are the
    /// backend's scratch: afterwards they may hold the rotated rows (the CPU
    /// backend rotates them in place) or what they held before (CUDA rotates
    /// decode rows on chip inside the attention launch); callers must not
    /// read them.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        layer: usize,
        params: &AttentionParams,
        q: &mut Self::Activations,
        k: &mut Self::Activations,
        v: &Self::Activations,
        qk_norm: Option<QkNorm<'_, Self::Vector>>,
        slots: &[TokenSlot],
        cache: &mut Self::KvCache,
        out: &mut Self::Activations,
    ) -> Result<()>;
    /// [`Backend::attention`] with [`AttentionOptions`]. The default runs
    /// [`Backend::attention`] for the default options and refuses any other
    /// with [`crate::RuntimeError::Unsupported`].
    #[allow(clippy::too_many_arguments)]
    fn attention_with(
        &self,
        layer: usize,
        params: &AttentionParams,
        options: &AttentionOptions,
        q: &mut Self::Activations,
        k: &mut Self::Activations,
        v: &Self::Activations,
        qk_norm: Option<QkNorm<'_, Self::Vector>>,
        slots: &[TokenSlot],
        cache: &mut Self::KvCache,
        out: &mut Self::Activations,
    ) -> Result<()> {
        if *options != AttentionOptions::default() {
            return Err(self.unsupported("sliding-window or rescaled attention (gemma models)"));
        }
        self.attention(layer, params, q, k, v, qk_norm, slots, cache, out)
    }
    /// `x *= factor` (gemma scales its embeddings). The default refuses.
    fn scale(&self, x: &mut Self::Activations, factor: f32) -> Result<()> {
        let _ = (x, factor);
        Err(self.unsupported("scaling activations (gemma models)"))
    }
    /// `x = cap * tanh(x / cap)` elementwise (logit soft-capping). The default
    /// refuses.
    fn softcap(&self, x: &mut Self::Activations, cap: f32) -> Result<()> {
        let _ = (x, cap);
        Err(self.unsupported("logit soft-capping"))
    }
    /// The error a default implementation returns for an op this backend
    /// lacks.
    fn unsupported(&self, what: &str) -> crate::error::RuntimeError {
        crate::error::RuntimeError::Unsupported {
            backend: self.name(),
            what: what.into(),
        }
    }
    /// The feed-forward block: `out[r] = down(act(gate x[r]) * up x[r])`, the
    /// activation chosen at upload (SiLU unless [`Backend::upload_ffn_with`]
    /// said otherwise).
    fn ffn(
        &self,
        ffn: &Self::Ffn,
        x: &Self::Activations,
        out: &mut Self::Activations,
    ) -> Result<()>;
    /// `out` = the listed rows of `x`, in that order.
    fn select_rows(
        &self,
        x: &Self::Activations,
        rows: &[usize],
        out: &mut Self::Activations,
    ) -> Result<()>;
    /// Copies `x` to the host as `rows * width` floats; returns `(rows, width)`.
    fn read(&self, x: &Self::Activations, out: &mut Vec<f32>) -> Result<(usize, usize)>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::RuntimeError;
    use crate::kv_cache::KvDtype;

    fn params(n_head: usize, n_head_kv: usize, head_dim: usize) -> AttentionParams {
        AttentionParams {
            n_head,
            n_head_kv,
            head_dim,
            rope_mode: RopeMode::Neox,
            rope_freq_base: 10000.0,
            rope_scaling: crate::rope::RopeScaling::none(),
            norm_eps: 1e-6,
        }
    }

    #[test]
    fn check_batch_names_each_bad_input() {
        let cache = KvSpec {
            n_layer: 2,
            n_head_kv: 2,
            head_dim: 8,
            n_ctx: 16,
            n_seq: 2,
            dtype: KvDtype::F32,
        };
        let shape = |rows, width| InputShape { rows, width };
        let slots = [TokenSlot { seq: 1, pos: 15 }];
        let check = |p: AttentionParams, q, k, slots: &[TokenSlot], layer| {
            p.check_batch(q, k, k, slots, &cache, layer)
        };
        let p = params(6, 2, 8);
        let (q, k) = (shape(1, 48), shape(1, 16));
        assert!(check(p, q, k, &slots, 1).is_ok());
        let msg = |r: Result<()>| match r {
            Err(RuntimeError::InvalidArgument(m)) => m,
            other => panic!("expected InvalidArgument, got {other:?}"),
        };
        assert!(msg(check(params(6, 4, 8), q, k, &slots, 1)).contains("bad attention shape"));
        assert!(msg(check(params(6, 2, 7), q, k, &slots, 1)).contains("bad attention shape"));
        assert!(msg(check(params(6, 0, 8), q, k, &slots, 1)).contains("bad attention shape"));
        assert!(msg(check(p, shape(2, 48), k, &slots, 1)).contains("do not match the batch"));
        assert!(msg(check(p, q, shape(1, 24), &slots, 1)).contains("do not match the batch"));
        assert!(msg(check(p, q, k, &slots, 2)).contains("KV cache shape"));
        assert!(msg(check(params(12, 4, 4), shape(1, 48), k, &slots, 0)).contains("KV cache shape"));
        let past = [TokenSlot { seq: 0, pos: 16 }];
        assert!(matches!(
            check(p, q, k, &past, 0),
            Err(RuntimeError::ContextFull { n_ctx: 16 })
        ));
        let seq = [TokenSlot { seq: 2, pos: 0 }];
        assert!(msg(check(p, q, k, &seq, 0)).contains("sequence slot 2 >= 2"));
    }
}
