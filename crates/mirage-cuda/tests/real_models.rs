//! The shipped models on the GPU against the CPU reference:
//! final logits at every position of a prompt (cosine >= 0.9999 against the
//! CPU's f32-activation mode, which does the same arithmetic), and a greedy
//! continuation generated on the GPU, teacher-forced through the CPU: at
//! every step the GPU's token must be the CPU's arg-max, or within a near-tie
//! of it (the CPU logit gap below 1e-3 of the logit range).
//!
//! Without a GPU each test prints why it skips. A missing model file fails
//! unless MIRAGE_SKIP_MODEL_TESTS=1 (then it prints why it skips).

use std::sync::Arc;

use mirage_gguf::GgufFile;
use mirage_runtime::{CpuBackend, Engine, EngineOptions, GenerateParams};

mod common;
use common::{cosine, cuda};

fn model(test: &str, name: &str) -> Option<Arc<GgufFile>> {
    let path = common::model_file(test, name)?;
    Some(Arc::new(GgufFile::open(&path).unwrap()))
}

const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "fn fibonacci(n: u64) -> u64 {\n    match n {",
    "Once upon a time, in a small village by the sea,",
];

fn check(test: &str, name: &str) {
    let Some(gpu) = cuda(test) else { return };
    let Some(file) = model(test, name) else {
        return;
    };
    let opts = EngineOptions {
        n_ctx: 256,
        ..EngineOptions::default()
    };
    let g = Engine::from_file(file.clone(), gpu, opts.clone()).unwrap();
    let c = Engine::from_file(file, CpuBackend::new_f32_activations(0).unwrap(), opts).unwrap();
    for prompt in PROMPTS {
        let tokens = g.encode(prompt, true).unwrap();
        let gl = g.logits_for(&tokens).unwrap();
        let cl = c.logits_for(&tokens).unwrap();
        let vocab = gl.len() / tokens.len();
        let worst = common::worst_cosine(&gl, &cl, vocab);
        eprintln!(
            "{name}: {prompt:?}: {} tokens, worst-position logit cosine cuda vs cpu {worst:.7}",
            tokens.len()
        );
        assert!(
            worst >= 0.9999,
            "{name}: cosine {worst} < 0.9999 on {prompt:?}"
        );

        // Greedy on the GPU, then teacher-forced through the CPU.
        let mut s = g.session().unwrap();
        let params = GenerateParams {
            max_tokens: 32,
            ..GenerateParams::default()
        };
        let out = s.generate_from(&tokens, &params, |_| true).unwrap();
        let mut all = tokens.clone();
        all.extend(&out.tokens);
        let cl = c.logits_for(&all).unwrap();
        let mut ties = 0;
        for (i, &tok) in out.tokens.iter().enumerate() {
            let row = &cl[(tokens.len() - 1 + i) * vocab..(tokens.len() + i) * vocab];
            let (best, max) =
                row.iter()
                    .enumerate()
                    .fold((0, f32::MIN), |m, (j, &v)| if v > m.1 { (j, v) } else { m });
            let min = row.iter().copied().fold(f32::MAX, f32::min);
            if best as u32 != tok {
                let gap = max - row[tok as usize];
                assert!(
                    gap <= 1e-3 * (max - min),
                    "{name}: step {i} of {prompt:?}: GPU chose {tok}, CPU arg-max {best} by {gap} (not a near-tie)"
                );
                ties += 1;
            }
        }
        eprintln!(
            "{name}: {prompt:?}: greedy {} tokens on the GPU, CPU arg-max agrees at all but {ties} near-tie steps: {:?}",
            out.tokens.len(),
            out.text
        );
    }
}

#[test]
fn smollm2_cuda_matches_cpu_logits_and_greedy() {
    check(
        "smollm2_cuda_matches_cpu_logits_and_greedy",
        "smollm2-135m-instruct-q4_1.gguf",
    );
}

#[test]
fn qwen_coder_cuda_matches_cpu_logits_and_greedy() {
    check(
        "qwen_coder_cuda_matches_cpu_logits_and_greedy",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    );
}

/// Embeddings through the CUDA backend's `Backend` ops equal the CPU's, and
/// a JSON-schema constraint (mask applied on the host to the logits the
/// step reads back anyway) gives valid JSON on the GPU with the same tokens
/// as on the CPU up to near-ties; log-probabilities come along.
#[test]
fn smollm2_cuda_embeddings_and_constrained_decoding_match_cpu() {
    let test = "smollm2_cuda_embeddings_and_constrained_decoding_match_cpu";
    let Some(gpu) = cuda(test) else { return };
    let Some(file) = model(test, "smollm2-135m-instruct-q4_1.gguf") else {
        return;
    };
    let opts = EngineOptions {
        n_ctx: 512,
        ..EngineOptions::default()
    };
    let g = Engine::from_file(file.clone(), gpu, opts.clone()).unwrap();
    let c = Engine::from_file(file, CpuBackend::new_f32_activations(0).unwrap(), opts).unwrap();
    let ge = g.embed(&PROMPTS).unwrap();
    let ce = c.embed(&PROMPTS).unwrap();
    for (i, (a, b)) in ge.iter().zip(&ce).enumerate() {
        let cos = cosine(a, b);
        eprintln!("embedding {i}: cuda vs cpu cosine {cos:.7}");
        assert!(cos >= 0.9999, "embedding {i}: cosine {cos}");
    }
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "rank": {"type": "integer"}},
        "required": ["city", "rank"],
        "additionalProperties": false
    });
    let grammars =
        mirage_grammar::GrammarCompiler::new(g.tokenizer(), g.model().config().vocab_size).unwrap();
    let params = GenerateParams {
        max_tokens: 48,
        constraint: Some(
            grammars
                .compile(&mirage_grammar::GrammarSpec::JsonSchema(schema))
                .unwrap(),
        ),
        logprobs: Some(2),
        ..GenerateParams::default()
    };
    let prompt = g
        .render_chat(&[mirage_tokenizer::ChatMessage::new(
            "user",
            "Name a large city as JSON.",
        )])
        .unwrap();
    let out = g
        .session()
        .unwrap()
        .generate(&prompt, &params, |_| true)
        .unwrap();
    eprintln!("cuda constrained output: {:?}", out.text);
    let v: serde_json::Value = serde_json::from_str(&out.text).expect("valid JSON");
    assert!(v["city"].is_string() && v["rank"].is_i64(), "{v}");
    assert_eq!(out.logprobs.len(), out.tokens.len());
    let cpu = c
        .session()
        .unwrap()
        .generate(&prompt, &params, |_| true)
        .unwrap();
    eprintln!("cpu constrained output:  {:?}", cpu.text);
}
