//! The llama-family graph one layer at a time, over any `Backend`: what
//! calibration needs and the runtime's `Model` does not expose (run layer
//! `l` alone on stored inputs, read the residual stream between layers).
//! The op sequence is `mirage_runtime::model`'s, op for op; a test checks
//! that the two give the same logits.

use std::sync::Arc;

use mirage_gguf::{quant, GgufFile};
use mirage_runtime::backend::{
    AttentionParams, Backend, ByteOwner, HostMatrix, QkNorm, SharedBytes, TokenSlot,
};
use mirage_runtime::kv_cache::{KvDtype, KvSpec};
use mirage_runtime::{ModelConfig, RuntimeError};

use super::Proj;
use crate::error::Result;

struct LayerWeights<B: Backend> {
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

/// Activation buffers of one pass.
pub struct GraphScratch<B: Backend> {
    xn: B::Activations,
    q: B::Activations,
    k: B::Activations,
    v: B::Activations,
    att: B::Activations,
    proj: B::Activations,
    logits: B::Activations,
}

/// A model as separately callable layers.
pub struct Graph<B: Backend> {
    backend: B,
    config: ModelConfig,
    attn: AttentionParams,
    tok_embd: B::Matrix,
    output: Option<B::Matrix>,
    output_norm: B::Vector,
    layers: Vec<LayerWeights<B>>,
}

fn host(file: &Arc<GgufFile>, name: &str, cols: usize, rows: usize) -> Result<HostMatrix> {
    let info = file
        .tensor_info(name)
        .ok_or_else(|| RuntimeError::MissingTensor(name.into()))?;
    if info.dims != [cols as u64, rows as u64] {
        return Err(RuntimeError::BadShape {
            name: name.into(),
            got: info.dims.clone(),
            expected: vec![cols as u64, rows as u64],
        }
        .into());
    }
    let start = (file.data_offset() + info.offset) as usize;
    let owner: Arc<dyn ByteOwner> = file.clone();
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

fn vector(file: &GgufFile, name: &str, len: usize) -> Result<Vec<f32>> {
    let t = file
        .tensor(name)
        .ok_or_else(|| RuntimeError::MissingTensor(name.into()))?;
    if t.info.n_elements() != len as u64 {
        return Err(RuntimeError::BadShape {
            name: name.into(),
            got: t.info.dims.clone(),
            expected: vec![len as u64],
        }
        .into());
    }
    let mut v = vec![0f32; len];
    quant::dequantize(t.info.ty, t.data, &mut v)?;
    Ok(v)
}

/// The host form of projection `p` of layer `l` (`[rows, cols]`).
pub fn projection(file: &Arc<GgufFile>, c: &ModelConfig, l: usize, p: Proj) -> Result<HostMatrix> {
    let (d, q_dim, kv_dim) = (c.n_embd, c.n_head * c.head_dim, c.n_head_kv * c.head_dim);
    let (cols, rows) = match p {
        Proj::Q => (d, q_dim),
        Proj::K | Proj::V => (d, kv_dim),
        Proj::O => (q_dim, d),
        Proj::Gate | Proj::Up => (d, c.n_ff),
        Proj::Down => (c.n_ff, d),
    };
    host(file, &p.tensor(l), cols, rows)
}

/// The host form of the lm head (`output.weight`, else the tied
/// `token_embd.weight`; `[vocab, n_embd]`).
pub fn head_matrix(file: &Arc<GgufFile>, c: &ModelConfig) -> Result<HostMatrix> {
    let name = if file.tensor_info("output.weight").is_some() {
        "output.weight"
    } else {
        "token_embd.weight"
    };
    let rows = file
        .tensor_info(name)
        .ok_or_else(|| RuntimeError::MissingTensor(name.into()))?
        .n_rows() as usize;
    host(file, name, c.n_embd, rows)
}

impl<B: Backend> Graph<B> {
    /// Uploads every weight of `file` to `backend`.
    pub fn load(file: &Arc<GgufFile>, backend: B) -> Result<Graph<B>> {
        let mut config = ModelConfig::from_hparams(&file.hparams()?)?;
        if let Some(t) = file
            .tensor_info("output.weight")
            .or_else(|| file.tensor_info("token_embd.weight"))
        {
            if t.dims.len() == 2 {
                config.vocab_size = t.dims[1] as usize;
            }
        }
        let c = config.clone();
        let (d, q_dim, kv_dim) = (c.n_embd, c.n_head * c.head_dim, c.n_head_kv * c.head_dim);
        let n_embd_rows = file
            .tensor_info("token_embd.weight")
            .map_or(0, |t| t.n_rows() as usize);
        let tok_embd = backend.upload_matrix(&host(file, "token_embd.weight", d, n_embd_rows)?)?;
        let output = match file.tensor_info("output.weight") {
            Some(_) => {
                Some(backend.upload_matrix(&host(file, "output.weight", d, c.vocab_size)?)?)
            }
            None => None,
        };
        let output_norm = backend.upload_vector(&vector(file, "output_norm.weight", d)?)?;
        let mut layers = Vec::with_capacity(c.n_layer);
        for l in 0..c.n_layer {
            let n = |s: &str| format!("blk.{l}.{s}");
            let vec = |s: &str, len| -> Result<B::Vector> {
                Ok(backend.upload_vector(&vector(file, &n(s), len)?)?)
            };
            let mat = |p| -> Result<B::Matrix> {
                Ok(backend.upload_matrix(&projection(file, &c, l, p)?)?)
            };
            let bias = if file.tensor_info(&n("attn_q.bias")).is_some() {
                Some([
                    vec("attn_q.bias", q_dim)?,
                    vec("attn_k.bias", kv_dim)?,
                    vec("attn_v.bias", kv_dim)?,
                ])
            } else {
                None
            };
            let qk_norm = if file.tensor_info(&n("attn_q_norm.weight")).is_some() {
                Some([
                    vec("attn_q_norm.weight", c.head_dim)?,
                    vec("attn_k_norm.weight", c.head_dim)?,
                ])
            } else {
                None
            };
            let ffn = backend.upload_ffn(
                l,
                &projection(file, &c, l, Proj::Gate)?,
                &projection(file, &c, l, Proj::Up)?,
                &projection(file, &c, l, Proj::Down)?,
            )?;
            layers.push(LayerWeights {
                attn_norm: vec("attn_norm.weight", d)?,
                wq: mat(Proj::Q)?,
                wk: mat(Proj::K)?,
                wv: mat(Proj::V)?,
                wo: mat(Proj::O)?,
                bias,
                qk_norm,
                ffn_norm: vec("ffn_norm.weight", d)?,
                ffn,
            });
        }
        let attn = config.attention_params();
        Ok(Graph {
            backend,
            config,
            attn,
            tok_embd,
            output,
            output_norm,
            layers,
        })
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }
    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Fresh buffers.
    pub fn scratch(&self) -> GraphScratch<B> {
        let b = &self.backend;
        GraphScratch {
            xn: b.new_activations(),
            q: b.new_activations(),
            k: b.new_activations(),
            v: b.new_activations(),
            att: b.new_activations(),
            proj: b.new_activations(),
            logits: b.new_activations(),
        }
    }

    /// A KV cache for one sequence of `n_ctx` positions (f32).
    pub fn new_cache(&self, n_ctx: usize) -> Result<B::KvCache> {
        let c = &self.config;
        Ok(self.backend.new_kv_cache(KvSpec {
            n_layer: c.n_layer,
            n_head_kv: c.n_head_kv,
            head_dim: c.head_dim,
            n_ctx: n_ctx.max(1),
            n_seq: 1,
            dtype: KvDtype::F32,
        })?)
    }

    /// The embedding rows of `tokens`.
    pub fn embed(&self, tokens: &[u32], x: &mut B::Activations) -> Result<()> {
        Ok(self.backend.embed(&self.tok_embd, tokens, x)?)
    }

    /// Layer `l` on the residual stream `x` (rows at `slots`), in place.
    pub fn layer(
        &self,
        l: usize,
        x: &mut B::Activations,
        slots: &[TokenSlot],
        cache: &mut B::KvCache,
        s: &mut GraphScratch<B>,
    ) -> Result<()> {
        let b = &self.backend;
        let eps = self.config.rms_norm_eps;
        let layer = &self.layers[l];
        b.rms_norm(x, &layer.attn_norm, eps, &mut s.xn)?;
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
            l, &self.attn, &mut s.q, &mut s.k, &s.v, qk_norm, slots, cache, &mut s.att,
        )?;
        b.matmul(&layer.wo, &s.att, &mut s.proj)?;
        b.add(x, &s.proj)?;
        b.rms_norm(x, &layer.ffn_norm, eps, &mut s.xn)?;
        b.ffn(&layer.ffn, &s.xn, &mut s.proj)?;
        b.add(x, &s.proj)?;
        Ok(())
    }

    /// Logits of every row of the final residual stream `x`.
    pub fn logits(
        &self,
        x: &B::Activations,
        s: &mut GraphScratch<B>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let b = &self.backend;
        b.rms_norm(x, &self.output_norm, self.config.rms_norm_eps, &mut s.xn)?;
        b.matmul(
            self.output.as_ref().unwrap_or(&self.tok_embd),
            &s.xn,
            &mut s.logits,
        )?;
        b.read(&s.logits, out)?;
        Ok(())
    }

    /// Logits at every position of `tokens` run as one sequence, `n_batch`
    /// positions per pass.
    pub fn logits_all(&self, tokens: &[u32], n_batch: usize) -> Result<Vec<f32>> {
        let mut cache = self.new_cache(tokens.len())?;
        let mut s = self.scratch();
        let mut x = self.backend.new_activations();
        let (mut all, mut out) = (Vec::new(), Vec::new());
        for (ci, chunk) in tokens.chunks(n_batch.max(1)).enumerate() {
            let slots: Vec<TokenSlot> = (0..chunk.len())
                .map(|i| TokenSlot {
                    seq: 0,
                    pos: ci * n_batch.max(1) + i,
                })
                .collect();
            self.backend.run(|| -> Result<()> {
                self.embed(chunk, &mut x)?;
                for l in 0..self.layers.len() {
                    self.layer(l, &mut x, &slots, &mut cache, &mut s)?;
                }
                self.logits(&x, &mut s, &mut out)
            })?;
            all.extend_from_slice(&out);
        }
        Ok(all)
    }
}
