//! The gemma3 graph on the real Gemma-3-270M Q4_K_M against llama.cpp (fixture written by
//! scripts/gen_gemma3_fixtures.py: llama.cpp on the CPU, flash attention off, f16 KV cache):
//! greedy continuations equal, llama.cpp's tokens MIRAGE's top choices (or near-ties) past the
//! 512-position sliding window, and the perplexity of a 1024-token window within 1 % (the whole
//! text's, a command in the docs, is within 0.5 %). Plus: a backend that implements only the
//! required ops refuses gemma3 at load time with a typed error.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use mirage_gguf::GgufFile;
use mirage_runtime::backend::cpu::{CpuActivations, CpuFfn, CpuMatrix};
use mirage_runtime::backend::{AttentionParams, HostMatrix, QkNorm};
use mirage_runtime::kv_cache::KvSpec;
use mirage_runtime::{
    Backend, CpuBackend, Engine, EngineOptions, GenerateParams, KvCache, KvDtype, Model,
    RuntimeError, TokenSlot,
};
use serde_json::Value;

const MODEL: &str = "gemma-3-270m-q4_k_m.gguf";

fn fixture() -> Value {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma3_llamacpp.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn gpl(bytes: Option<usize>) -> String {
    let data = std::fs::read("/usr/share/common-licenses/GPL-3")
        .expect("/usr/share/common-licenses/GPL-3 (Debian's base-files)");
    let n = bytes.unwrap_or(data.len()).min(data.len());
    String::from_utf8(data[..n].to_vec()).expect("ASCII")
}

fn engine() -> Option<Engine> {
    let path = common::model_path(MODEL)?;
    let options = EngineOptions {
        kv_dtype: KvDtype::F16,
        n_ctx: 1024,
        ..EngineOptions::default()
    };
    Some(Engine::load(path, options).expect("Gemma-3-270M loads"))
}

/// How far below MIRAGE's best logit llama.cpp's greedy token may be: the two differ in the
/// last bits (llama.cpp rounds q and the softmax weights to f16 and tabulates GELU in f16), which
/// decides near-ties; 0.05 is about 0.2 % of the logits' size here.
const NEAR_TIE: f32 = 0.3;

#[test]
fn greedy_continuations_and_perplexity_match_llama_cpp() {
    let Some(engine) = engine() else { return };
    let f = fixture();
    assert_eq!(engine.model().config().arch, mirage_gguf::Arch::Gemma3);
    for case in f["greedy"].as_array().expect("greedy cases") {
        let want = case["text"].as_str().unwrap();
        let n = case["n"].as_u64().unwrap() as usize;
        match case["prompt"].as_str() {
            // Short prompts: MIRAGE's own greedy decode gives llama.cpp's text.
            Some(prompt) => {
                let params = GenerateParams {
                    max_tokens: n,
                    ..GenerateParams::default()
                };
                let out = engine
                    .session()
                    .unwrap()
                    .generate(prompt, &params, |_| true)
                    .unwrap();
                assert_eq!(out.text, want, "prompt {prompt:?}");
            }
            // The long prompt's continuation has near-ties (llama.cpp's own flash-attention and
            // f32-cache settings give three different texts): every token llama.cpp chose must
            // be MIRAGE's top token or within NEAR_TIE of it, each position fed llama.cpp's text.
            None => {
                let bytes = case["prompt_gpl_bytes"].as_u64().unwrap() as usize;
                let prompt = engine.encode(&gpl(Some(bytes)), true).unwrap();
                assert!(prompt.len() > 600, "prompt of {} tokens", prompt.len());
                let cont = engine.tokenizer().encode(want, false, false).unwrap();
                assert_eq!(cont.len(), n, "{want:?}");
                let all: Vec<u32> = prompt.iter().chain(&cont).copied().collect();
                let model = engine.model();
                let slots: Vec<TokenSlot> = (0..all.len())
                    .map(|pos| TokenSlot { seq: 0, pos })
                    .collect();
                // Logits of the rows that predict the continuation only.
                let rows: Vec<usize> = (prompt.len() - 1..all.len() - 1).collect();
                let mut cache = model.new_kv_cache(all.len(), 1, KvDtype::F16).unwrap();
                let mut logits = Vec::new();
                model
                    .forward(
                        &all,
                        &slots,
                        &rows,
                        &mut cache,
                        &mut model.new_scratch(),
                        &mut logits,
                    )
                    .unwrap();
                let v = model.config().vocab_size;
                for (i, &t) in cont.iter().enumerate() {
                    let row = &logits[i * v..(i + 1) * v];
                    let best = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    assert!(
                        row[t as usize] >= best - NEAR_TIE,
                        "token {i} ({t}): logit {} vs best {best}",
                        row[t as usize]
                    );
                }
            }
        }
    }
    let p = &f["perplexity"];
    let ctx = p["ctx"].as_u64().unwrap() as usize;
    let report = mirage_runtime::perplexity::perplexity(
        &engine,
        &gpl(None),
        ctx,
        p["chunks"].as_u64().unwrap() as usize,
        |_, _, _| {},
    )
    .unwrap();
    // One window of 512 scored tokens: the two implementations' last-bit differences move a
    // single window's perplexity by up to about 1 % either way (window by window over this text,
    // MIRAGE against llama.cpp: -1.3 % to +1.1 % at ctx 512, -0.9 % to 0 % at ctx 1024), while
    // over the whole text they agree within 0.5 % at ctx 512, 1024 and 2048. So 1 % here; a wrong
    // graph is far off (without the sliding window this window's perplexity is 235).
    let want = p["ppl"].as_f64().unwrap();
    let rel = report.ppl / want - 1.0;
    println!(
        "perplexity {:.4} vs llama.cpp {want:.4} ({:+.2} %)",
        report.ppl,
        100.0 * rel
    );
    assert!(
        rel.abs() < 0.01,
        "perplexity {:.4} vs llama.cpp {want:.4} ({:+.2} %)",
        report.ppl,
        100.0 * rel
    );
}

/// A backend with only the ops every backend must have: the CPU's, delegated.
struct RequiredOpsOnly(CpuBackend);

impl Backend for RequiredOpsOnly {
    type Matrix = CpuMatrix;
    type Vector = Vec<f32>;
    type Ffn = CpuFfn;
    type Activations = CpuActivations;
    type KvCache = KvCache;

    fn name(&self) -> String {
        "required-ops-only".into()
    }
    fn upload_matrix(&self, m: &HostMatrix) -> mirage_runtime::Result<CpuMatrix> {
        self.0.upload_matrix(m)
    }
    fn upload_vector(&self, v: &[f32]) -> mirage_runtime::Result<Vec<f32>> {
        self.0.upload_vector(v)
    }
    fn upload_ffn(
        &self,
        layer: usize,
        gate: &HostMatrix,
        up: &HostMatrix,
        down: &HostMatrix,
    ) -> mirage_runtime::Result<CpuFfn> {
        self.0.upload_ffn(layer, gate, up, down)
    }
    fn new_kv_cache(&self, spec: KvSpec) -> mirage_runtime::Result<KvCache> {
        self.0.new_kv_cache(spec)
    }
    fn kv_truncate(&self, cache: &mut KvCache, seq: usize, pos: usize) {
        self.0.kv_truncate(cache, seq, pos)
    }
    fn new_activations(&self) -> CpuActivations {
        self.0.new_activations()
    }
    fn embed(
        &self,
        table: &CpuMatrix,
        tokens: &[u32],
        out: &mut CpuActivations,
    ) -> mirage_runtime::Result<()> {
        self.0.embed(table, tokens, out)
    }
    fn rms_norm(
        &self,
        x: &CpuActivations,
        weight: &Vec<f32>,
        eps: f32,
        out: &mut CpuActivations,
    ) -> mirage_runtime::Result<()> {
        self.0.rms_norm(x, weight, eps, out)
    }
    fn matmul(
        &self,
        w: &CpuMatrix,
        x: &CpuActivations,
        out: &mut CpuActivations,
    ) -> mirage_runtime::Result<()> {
        self.0.matmul(w, x, out)
    }
    fn add_bias(&self, x: &mut CpuActivations, bias: &Vec<f32>) -> mirage_runtime::Result<()> {
        self.0.add_bias(x, bias)
    }
    fn add(&self, acc: &mut CpuActivations, x: &CpuActivations) -> mirage_runtime::Result<()> {
        self.0.add(acc, x)
    }
    fn attention(
        &self,
        layer: usize,
        params: &AttentionParams,
        q: &mut CpuActivations,
        k: &mut CpuActivations,
        v: &CpuActivations,
        qk_norm: Option<QkNorm<'_, Vec<f32>>>,
        slots: &[TokenSlot],
        cache: &mut KvCache,
        out: &mut CpuActivations,
    ) -> mirage_runtime::Result<()> {
        self.0
            .attention(layer, params, q, k, v, qk_norm, slots, cache, out)
    }
    fn ffn(
        &self,
        ffn: &CpuFfn,
        x: &CpuActivations,
        out: &mut CpuActivations,
    ) -> mirage_runtime::Result<()> {
        self.0.ffn(ffn, x, out)
    }
    fn select_rows(
        &self,
        x: &CpuActivations,
        rows: &[usize],
        out: &mut CpuActivations,
    ) -> mirage_runtime::Result<()> {
        self.0.select_rows(x, rows, out)
    }
    fn read(
        &self,
        x: &CpuActivations,
        out: &mut Vec<f32>,
    ) -> mirage_runtime::Result<(usize, usize)> {
        self.0.read(x, out)
    }
}

#[test]
fn backends_without_gemma_ops_refuse_it_at_load() {
    let Some(path) = common::model_path(MODEL) else {
        return;
    };
    let file = Arc::new(GgufFile::open(path).unwrap());
    let backend = RequiredOpsOnly(CpuBackend::new(1).unwrap());
    match Model::load(file, backend) {
        Err(RuntimeError::Unsupported { backend, what }) => {
            assert_eq!(backend, "required-ops-only");
            assert!(what.contains("GELU"), "{what}");
        }
        Err(e) => panic!("expected RuntimeError::Unsupported, got {e}"),
        Ok(_) => panic!("a backend without the GELU FFN loaded gemma3"),
    }
}
