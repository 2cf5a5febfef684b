//! Helpers shared by the CUDA integration tests (each test file is its own
//! crate and includes this module with `mod common;`).
#![allow(dead_code)] // not every test file uses every helper

use std::sync::Arc;

use mirage_cuda::{CudaBackend, CudaError, CudaOptions};
use mirage_gguf::{quant, GgmlType, GgufFile, GgufWriter, Metadata, Value};
use mirage_runtime::backend::{Backend, HostMatrix, SharedBytes, TokenSlot};
use mirage_runtime::kv_cache::KvDtype;
use mirage_runtime::{KvPruning, Model};
use rand::{Rng, SeedableRng};

/// The CUDA backend on device 0, or `None` after printing why the test
/// skips (no `cuda` feature, no driver, no device). With
/// `MIRAGE_REQUIRE_CUDA_TESTS=1` (set by the GPU benchmark runner) skipping
/// is a failure. A device that is present but fails to start always fails.
pub fn cuda(test: &str) -> Option<CudaBackend> {
    cuda_with(test, &CudaOptions::default())
}

/// [`cuda`] with these options.
pub fn cuda_with(test: &str, options: &CudaOptions) -> Option<CudaBackend> {
    match CudaBackend::with_options(0, options) {
        Ok(b) => Some(b),
        Err(
            e @ (CudaError::NotCompiledWithCuda
            | CudaError::DriverNotFound
            | CudaError::NoDevice { .. }),
        ) => {
            assert!(
                !require_cuda_tests(),
                "{test}: MIRAGE_REQUIRE_CUDA_TESTS=1 but no CUDA device: {e}"
            );
            eprintln!("{test}: skipped, no CUDA device here: {e}");
            None
        }
        Err(e) => panic!("{test}: CUDA device present but the backend failed to start: {e}"),
    }
}

/// Whether the GPU tests must run (`MIRAGE_REQUIRE_CUDA_TESTS=1`).
pub fn require_cuda_tests() -> bool {
    std::env::var("MIRAGE_REQUIRE_CUDA_TESTS").as_deref() == Ok("1")
}

/// A seeded generator (tests are reproducible).
pub fn rng(seed: u64) -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(seed)
}

/// `n` values in (-2, 2), triangular around 0.
pub fn randn(r: &mut impl Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| r.random_range(-1.0f32..1.0) + r.random_range(-1.0f32..1.0))
        .collect()
}

/// How many elements of `a` and `b` differ in their bits (the bit-equality
/// tests print it; a length mismatch counts the missing elements too).
pub fn bits_differ(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count()
        + a.len().abs_diff(b.len())
}

/// Where the real models are: `MIRAGE_MODELS_DIR`, or models/ at the
/// workspace root (what `cargo xtask fetch-models` fills).
pub fn models_dir() -> std::path::PathBuf {
    std::env::var_os("MIRAGE_MODELS_DIR")
        .map(Into::into)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models"))
}

/// `path` when that model file exists; else `None` after printing why
/// `test` skips, which only `MIRAGE_SKIP_MODEL_TESTS=1` allows (otherwise
/// a missing model fails the test, as on CI and the GPU machine).
pub fn model_path(test: &str, path: std::path::PathBuf) -> Option<std::path::PathBuf> {
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var("MIRAGE_SKIP_MODEL_TESTS").as_deref() == Ok("1"),
        "{test}: {} is missing: run `cargo xtask fetch-models` (or set MIRAGE_SKIP_MODEL_TESTS=1 to skip)",
        path.display()
    );
    eprintln!(
        "{test}: skipped, {} missing (MIRAGE_SKIP_MODEL_TESTS=1)",
        path.display()
    );
    None
}

/// Real model `name` in [`models_dir`] (see [`model_path`]).
pub fn model_file(test: &str, name: &str) -> Option<std::path::PathBuf> {
    model_path(test, models_dir().join(name))
}

/// The model of the real-model sparse tests: `MIRAGE_SPARSE_MODEL`, by
/// default SmolLM2 in [`models_dir`] (see [`model_path`]).
pub fn sparse_model(test: &str) -> Option<std::path::PathBuf> {
    let model = std::env::var_os("MIRAGE_SPARSE_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| models_dir().join("smollm2-135m-instruct-q4_1.gguf"));
    model_path(test, model)
}

/// The artifact of the real-model sparse tests: `MIRAGE_SPARSE_ARTIFACT`,
/// or a small one of `model` built here ([`build_artifact`]).
pub fn sparse_artifact(model: &std::path::Path) -> std::sync::Arc<mirage_artifact::Artifact> {
    match std::env::var_os("MIRAGE_SPARSE_ARTIFACT") {
        Some(p) => mirage_artifact::Artifact::open(&p).expect("MIRAGE_SPARSE_ARTIFACT"),
        None => build_artifact(model),
    }
}

/// A small artifact of `model` built here (Apache-2.0 text, 64 calibration
/// tokens): enough for routed-mode tests when no artifact is given.
pub fn build_artifact(model: &std::path::Path) -> std::sync::Arc<mirage_artifact::Artifact> {
    let text: String = std::fs::read_to_string("/usr/share/common-licenses/Apache-2.0")
        .map(|t| t.chars().take(1200).collect())
        .unwrap_or_else(|_| "The quick brown fox jumps over the lazy dog. ".repeat(30));
    let opts = mirage_artifact::BuildOptions {
        calib_name: "Apache-2.0 (first 1200 chars)".into(),
        calib_text: text,
        max_calib_tokens: 64,
        threads: 2,
        ..mirage_artifact::BuildOptions::default()
    };
    let built = mirage_artifact::build(model, &opts, &mut |_| {}).expect("artifact build");
    mirage_artifact::Artifact::from_bytes(built.bytes).unwrap()
}

/// `values` (`rows` x `cols`) quantized to `ty`, as the runtime hands a
/// matrix to a backend.
pub fn host_matrix(
    name: &str,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    values: &[f32],
) -> HostMatrix {
    let rb = quant::row_bytes(ty, cols).unwrap();
    let mut data = vec![0u8; rb * rows];
    for (r, row) in data.chunks_mut(rb).enumerate() {
        quant::quantize(ty, &values[r * cols..(r + 1) * cols], row).unwrap();
    }
    HostMatrix {
        name: name.into(),
        ty,
        rows,
        cols,
        data: SharedBytes::from_vec(data),
    }
}

/// A `rows x cols` matrix of [`randn`] values quantized to `ty`.
pub fn random_matrix(
    name: &str,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    r: &mut impl Rng,
) -> HostMatrix {
    host_matrix(name, ty, rows, cols, &randn(r, rows * cols))
}

/// The values `m` holds.
pub fn dequantized(m: &HostMatrix) -> Vec<f32> {
    let mut out = vec![0.0f32; m.rows * m.cols];
    quant::dequantize(m.ty, m.data.as_slice(), &mut out).unwrap();
    out
}

/// Relative error a decode mat-vec of `ty` may show against an f64 product
/// with exact activations: 1e-5 (f32 arithmetic), and 1e-4 for split Q4_K
/// and Q6_K, which multiply on int8 tensor cores with the activations
/// rounded to 16 bits per 32-element block (2^-15 of the block's largest
/// value; 1.6e-5 to 7.6e-5 measured on these random rows, H100).
pub fn matvec_bound(ty: mirage_gguf::GgmlType) -> f64 {
    if matches!(
        ty,
        mirage_gguf::GgmlType::Q4_K | mirage_gguf::GgmlType::Q6_K
    ) {
        1e-4
    } else {
        1e-5
    }
}

/// `|got - want| / |want|` (2-norms); every value of `got` finite.
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    assert!(got.iter().all(|v| v.is_finite()), "non-finite output");
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| ((*a - *b) as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// Cosine similarity in f64.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// The least cosine over the rows of `width` of `a` and `b` (per position
/// or per step logits).
pub fn worst_cosine(a: &[f32], b: &[f32], width: usize) -> f64 {
    assert_eq!(a.len(), b.len());
    a.chunks(width)
        .zip(b.chunks(width))
        .map(|(x, y)| cosine(x, y))
        .fold(1.0f64, f64::min)
}

/// Index of the first largest value.
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// `W x` on the device for the `n_act` rows of `x` (one `matmul`, so a
/// batch takes the prefill products), read back as `n_act` rows of
/// `rows` outputs.
pub fn device_matmul(
    b: &CudaBackend,
    w: &mirage_cuda::CudaMatrix,
    x: &[f32],
    n_act: usize,
    rows: usize,
) -> Vec<f32> {
    let dx = b.upload_activations(n_act, x.len() / n_act, x).unwrap();
    let mut dy = b.new_activations();
    b.matmul(w, &dx, &mut dy).unwrap();
    let mut out = Vec::new();
    assert_eq!(b.read(&dy, &mut out).unwrap(), (n_act, rows));
    out
}

/// f64 reference of `y = W x` for `n_act` rows of `x`.
pub fn matvec_reference(w: &[f32], x: &[f32], rows: usize, cols: usize, n_act: usize) -> Vec<f32> {
    let mut y = vec![0f32; n_act * rows];
    for a in 0..n_act {
        for r in 0..rows {
            let s: f64 = (0..cols)
                .map(|k| w[r * cols + k] as f64 * x[a * cols + k] as f64)
                .sum();
            y[a * rows + r] = s as f32;
        }
    }
    y
}

/// A random model of the GPU tests (2 layers, d 256, FFN 512, 4 heads and
/// 2 KV heads of 64, vocab 384) written as GGUF in memory.
pub struct Tiny {
    /// `llama` or `qwen2` (its norm epsilon and RoPE base).
    pub arch: &'static str,
    /// Embedding table type (the lm head is Q6_K).
    pub embd: GgmlType,
    /// Types of q, k, v, o, gate and up, down.
    pub types: [GgmlType; 6],
    /// Q/K/V biases.
    pub bias: bool,
}

impl Tiny {
    /// Every matrix Q8_0, with biases (qwen2).
    pub const Q8_BIASED: Tiny = Tiny {
        arch: "qwen2",
        embd: GgmlType::Q8_0,
        types: [GgmlType::Q8_0; 6],
        bias: true,
    };

    /// The model's GGUF bytes, weights drawn from `seed`.
    pub fn build(&self, seed: u64) -> Arc<GgufFile> {
        self.build_with_ffn(seed, 512)
    }

    /// [`Tiny::build`] with an FFN of `ff` channels (a multiple of 256).
    pub fn build_with_ffn(&self, seed: u64, ff: usize) -> Arc<GgufFile> {
        let (d, vocab, n_layer) = (256usize, 384usize, 2usize);
        let (n_head, n_head_kv, hd) = (4usize, 2usize, 64usize);
        let arch = self.arch;
        let qwen = arch == "qwen2";
        let mut md = Metadata::new();
        md.insert("general.architecture", Value::String(arch.into()));
        let key = |k: &str| format!("{arch}.{k}");
        md.insert(key("block_count"), Value::U32(n_layer as u32));
        md.insert(key("context_length"), Value::U32(4096));
        md.insert(key("embedding_length"), Value::U32(d as u32));
        md.insert(key("feed_forward_length"), Value::U32(ff as u32));
        md.insert(key("attention.head_count"), Value::U32(n_head as u32));
        md.insert(key("attention.head_count_kv"), Value::U32(n_head_kv as u32));
        let (eps, base) = if qwen { (1e-6, 1e6) } else { (1e-5, 1e4) };
        md.insert(key("attention.layer_norm_rms_epsilon"), Value::F32(eps));
        md.insert(key("rope.freq_base"), Value::F32(base));
        md.insert(key("vocab_size"), Value::U32(vocab as u32));
        let mut r = rng(seed);
        let mut w = GgufWriter::new(md);
        let mut mat = |w: &mut GgufWriter,
                       name: String,
                       ty: GgmlType,
                       rows: usize,
                       cols: usize,
                       scale: f32| {
            let v: Vec<f32> = randn(&mut r, rows * cols)
                .iter()
                .map(|x| x * scale)
                .collect();
            let m = host_matrix(&name, ty, rows, cols, &v);
            w.add_tensor(
                name,
                vec![cols as u64, rows as u64],
                ty,
                m.data.as_slice().to_vec(),
            )
            .unwrap();
        };
        mat(&mut w, "token_embd.weight".into(), self.embd, vocab, d, 1.0);
        mat(
            &mut w,
            "output.weight".into(),
            GgmlType::Q6_K,
            vocab,
            d,
            0.1,
        );
        let (q_dim, kv_dim) = (n_head * hd, n_head_kv * hd);
        let s = 1.0 / (d as f32).sqrt();
        let t = self.types;
        for l in 0..n_layer {
            let shapes = [
                ("attn_q", t[0], q_dim, d, 3.0 * s),
                ("attn_k", t[1], kv_dim, d, 3.0 * s),
                ("attn_v", t[2], kv_dim, d, s),
                ("attn_output", t[3], d, q_dim, s),
                ("ffn_gate", t[4], ff, d, s),
                ("ffn_up", t[4], ff, d, s),
                ("ffn_down", t[5], d, ff, 1.0 / (ff as f32).sqrt()),
            ];
            for (nm, ty, rows, cols, scale) in shapes {
                mat(
                    &mut w,
                    format!("blk.{l}.{nm}.weight"),
                    ty,
                    rows,
                    cols,
                    scale,
                );
            }
        }
        let mut r = rng(seed + 1);
        let vec = |w: &mut GgufWriter, name: String, v: Vec<f32>| {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            w.add_tensor(name, vec![v.len() as u64], GgmlType::F32, bytes)
                .unwrap();
        };
        vec(&mut w, "output_norm.weight".into(), vec![1.0; d]);
        for l in 0..n_layer {
            for nm in ["attn_norm", "ffn_norm"] {
                let v = (0..d)
                    .map(|_| 1.0 + 0.2 * r.random_range(-1.0f32..1.0))
                    .collect();
                vec(&mut w, format!("blk.{l}.{nm}.weight"), v);
            }
            if self.bias {
                for (nm, n) in [("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)] {
                    let v = (0..n).map(|_| 0.5 * r.random_range(-1.0f32..1.0)).collect();
                    vec(&mut w, format!("blk.{l}.{nm}.bias"), v);
                }
            }
        }
        let mut out = Vec::new();
        w.write_to(&mut out).unwrap();
        Arc::new(GgufFile::from_bytes(out).unwrap())
    }
}

/// The prompt of the real-model logit tests (SmolLM2's tokenizer).
pub const SMOLLM2_PROMPT: [u32; 12] =
    [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 378, 3458, 5248];

/// The logits of every position of `tokens` on `backend` (f32 KV cache).
pub fn logits<B: Backend>(file: Arc<GgufFile>, backend: B, tokens: &[u32]) -> Vec<f32> {
    Model::load(file, backend)
        .unwrap()
        .logits_all(tokens, KvDtype::F32)
        .unwrap()
}

/// The prompt of sequence `seq`.
pub fn prompt(seq: usize, len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 37 + 5 + seq * 101 + i * i % 13) % vocab) as u32)
        .collect()
}

/// How [`greedy_run`] decodes.
#[derive(Clone, Copy)]
pub struct Greedy<'a> {
    /// Prompt tokens per sequence (each prefilled alone).
    pub prompt: usize,
    /// Sequences decoded together.
    pub batch: usize,
    /// Decode steps.
    pub steps: usize,
    /// KV cache type.
    pub kv: KvDtype,
    /// KV-page pruning of the cache.
    pub pruning: Option<KvPruning>,
    /// Teacher forcing: the inputs after the prompt are these tokens (step
    /// by step, `batch` a step), so two numerically different paths are
    /// compared on the same inputs.
    pub force: Option<&'a [u32]>,
}

impl Default for Greedy<'_> {
    fn default() -> Self {
        Greedy {
            prompt: 20,
            batch: 1,
            steps: 16,
            kv: KvDtype::F32,
            pruning: None,
            force: None,
        }
    }
}

/// Greedy decode as `g` says: every step's logits (all rows, concatenated)
/// and greedy tokens.
pub fn greedy_run<B: Backend>(model: &Model<B>, g: Greedy<'_>) -> (Vec<f32>, Vec<u32>) {
    let vocab = model.config().vocab_size;
    let mut cache = model
        .new_kv_cache_pruned(g.prompt + g.steps + 1, g.batch, g.kv, g.pruning)
        .unwrap();
    let mut scratch = model.new_scratch();
    let mut logits = Vec::new();
    let mut last = Vec::new();
    for seq in 0..g.batch {
        let p = prompt(seq, g.prompt, vocab);
        let slots: Vec<TokenSlot> = (0..g.prompt).map(|pos| TokenSlot { seq, pos }).collect();
        model
            .forward(
                &p,
                &slots,
                &[g.prompt - 1],
                &mut cache,
                &mut scratch,
                &mut logits,
            )
            .unwrap();
        last.push(argmax(&logits));
    }
    let (mut all, mut toks) = (Vec::new(), Vec::new());
    for i in 0..g.steps {
        let slots: Vec<TokenSlot> = (0..g.batch)
            .map(|seq| TokenSlot {
                seq,
                pos: g.prompt + i,
            })
            .collect();
        let rows: Vec<usize> = (0..g.batch).collect();
        model
            .forward(&last, &slots, &rows, &mut cache, &mut scratch, &mut logits)
            .unwrap();
        for (b, t) in last.iter_mut().enumerate() {
            let best = argmax(&logits[b * vocab..(b + 1) * vocab]);
            toks.push(best);
            *t = g.force.map_or(best, |f| f[i * g.batch + b]);
        }
        all.extend_from_slice(&logits);
    }
    (all, toks)
}
