//! The CPU runtime against independent references (see
//! tests/fixtures/reference/FORMAT.md): HF transformers running the same
//! GGUF files in f32 (SmolLM2 llama-arch, Qwen2.5-Coder qwen2-arch), and a
//! tiny random Qwen3 checkpoint converted here from safetensors.

mod common;
use common::{cosine, model_path};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use mirage_gguf::GgufFile;
use mirage_runtime::{CpuBackend, Engine, EngineOptions, KvDtype, Model};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/reference")
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(
        &std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn read_f16(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bytes
        .chunks_exact(2)
        .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect()
}

fn argmax(x: &[f32]) -> u32 {
    mirage_runtime::sampling::greedy(x)
}

fn log_sum_exp(x: &[f32]) -> f64 {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    m + x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln()
}

/// A near-tie in the reference: `other` is within `rel` (relative) of `top1`.
fn near_tie(top1: f32, other: f32, rel: f32) -> bool {
    (top1 - other).abs() < rel * top1.abs().max(1.0)
}

/// How strict a comparison is.
///
/// Exact mode (f32 activations, weights dequantized row by row) computes
/// what the reference computes, so it is held to the brief's gates: final
/// logits cosine >= 0.999 and the same top-1 at every position of every
/// prompt; a swap is accepted only where the reference's own top-1/top-2
/// gap is below 1e-3 relative (none occurs on the fixtures).
///
/// The default path quantizes activations (Q8_0/Q8_1/Q8_K, as llama.cpp
/// does) and the reference does not: logits differ by quantization noise
/// and candidates the reference rates within ~2% of each other may swap.
/// That noise is chaotic in the summation order: on SmolLM2 `list` the
/// last-logits cosine is 0.99745 with the AVX2 kernels and 0.99587 with the
/// scalar kernels (same integer block sums, floats added in another order),
/// every other prompt of both models 0.9998–0.99997. The thresholds are set
/// below that spread, not at the brief's 0.999, which exact mode meets.
struct Mode {
    f32_activations: bool,
    min_cosine: f64,
    max_logprob_diff: f64,
    /// Relative reference gap under which a swapped top-1 (or greedy step)
    /// is accepted.
    tie: f32,
    /// Check greedy continuations by incremental decoding through the KV
    /// cache (true) or by one teacher-forced pass over prompt + reference
    /// continuation (false; identical up to the first divergence, which is
    /// where the check stops, and far cheaper in exact mode).
    greedy_by_decode: bool,
}

const QUANTIZED: Mode = Mode {
    f32_activations: false,
    min_cosine: 0.995,
    max_logprob_diff: 2.0,
    tie: 2e-2,
    greedy_by_decode: true,
};
const EXACT: Mode = Mode {
    f32_activations: true,
    min_cosine: 0.999,
    max_logprob_diff: 1e-3,
    tie: 1e-3,
    greedy_by_decode: false,
};

fn check_real_model(dir: &str, mode: &Mode) {
    let refdir = fixtures().join(dir);
    let reference = read_json(&refdir.join("reference.json"));
    let Some(path) = model_path(reference["model_file"].as_str().unwrap()) else {
        return;
    };
    let options = EngineOptions {
        n_ctx: 512,
        ..Default::default()
    };
    let engine = if mode.f32_activations {
        Engine::load_with_backend(&path, CpuBackend::new_f32_activations(0).unwrap(), options)
            .unwrap()
    } else {
        Engine::load(&path, options).unwrap()
    };
    let vocab = reference["vocab_size"].as_u64().unwrap() as usize;
    assert_eq!(engine.model().config().vocab_size, vocab, "lm head rows");
    let prompts = reference["prompts"].as_array().unwrap();
    assert!(prompts.len() >= 5, "need >= 5 prompts");
    for p in prompts {
        let name = p["name"].as_str().unwrap();
        let ids = u32s(&p["token_ids"]);
        // Our tokenizer must agree with HF's on the prompt (parse_special on).
        let ours = engine.encode(p["text"].as_str().unwrap(), false).unwrap();
        assert_eq!(ours, ids, "{dir}/{name}: tokenization differs from HF");
        let logits = engine.logits_for(&ids).unwrap();
        assert_eq!(logits.len(), ids.len() * vocab);
        let (mut worst_lp, mut worst_at, mut ties) = (0.0f64, 0, 0);
        for (i, (top5, top5_l)) in p["top5_ids"]
            .as_array()
            .unwrap()
            .iter()
            .zip(p["top5_logits"].as_array().unwrap())
            .enumerate()
        {
            let (top5, top5_l) = (u32s(top5), f32s(top5_l));
            let row = &logits[i * vocab..(i + 1) * vocab];
            let got = argmax(row);
            if got != top5[0] {
                // Accept only a swap among candidates the reference itself
                // rates within `tie` (relative) of its top-1.
                let ok = top5
                    .iter()
                    .zip(&top5_l)
                    .any(|(&t, &l)| t == got && near_tie(top5_l[0], l, mode.tie));
                assert!(
                    ok,
                    "{dir}/{name} position {i}: top-1 {got}, reference {top5:?} {top5_l:?}"
                );
                ties += 1;
            }
            // Log-probabilities of the reference top-5 (shift-invariant).
            let lse = log_sum_exp(row);
            let ref_lse = p["logsumexp"][i].as_f64().unwrap();
            for (&t, &l) in top5.iter().zip(&top5_l) {
                let d = ((row[t as usize] as f64 - lse) - (l as f64 - ref_lse)).abs();
                if d > worst_lp {
                    (worst_lp, worst_at) = (d, i);
                }
            }
        }
        let last = read_f16(&refdir.join(p["last_logits_file"].as_str().unwrap()));
        let cos = cosine(&logits[(ids.len() - 1) * vocab..], &last);
        eprintln!("{dir}/{name}: {} positions, last-logits cosine {cos:.6}, worst top-5 log-prob diff {worst_lp:.2e} at {worst_at}, near-tie flips {ties}", ids.len());
        assert!(cos >= mode.min_cosine, "{dir}/{name}: cosine {cos}");
        assert!(
            worst_lp < mode.max_logprob_diff,
            "{dir}/{name}: log-prob diff {worst_lp}"
        );

        if let Some(g) = p.get("greedy").filter(|g| !g.is_null()) {
            if mode.greedy_by_decode {
                check_greedy(&engine, dir, name, &ids, g, mode.tie);
            } else {
                check_greedy_teacher_forced(&engine, dir, name, &ids, g, mode.tie);
            }
        }
    }
}

fn check_greedy(engine: &Engine, dir: &str, name: &str, prompt: &[u32], g: &Value, tie: f32) {
    let want = u32s(&g["ids"]);
    let top2: Vec<Vec<f32>> = g["top2_logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(f32s)
        .collect();
    let mut session = engine.session().unwrap();
    let mut logits = session.feed(prompt).unwrap().to_vec();
    for (s, &w) in want.iter().enumerate() {
        let got = argmax(&logits);
        if got != w {
            assert!(
                near_tie(top2[s][0], top2[s][1], tie),
                "{dir}/{name}: greedy step {s} gave {got}, reference {w} (margin {:?})",
                top2[s]
            );
            eprintln!(
                "{dir}/{name}: greedy diverges at step {s} at a near-tie {:?}",
                top2[s]
            );
            return;
        }
        logits = session.feed(&[got]).unwrap().to_vec();
    }
    eprintln!("{dir}/{name}: greedy {} tokens identical", want.len());
}

/// Greedy check by one forward pass over prompt + the reference's 64
/// tokens: step `s`'s logits are row `prompt.len() - 1 + s`. Up to the first
/// divergence this is exactly greedy decoding; the check stops there.
fn check_greedy_teacher_forced(
    engine: &Engine,
    dir: &str,
    name: &str,
    prompt: &[u32],
    g: &Value,
    tie: f32,
) {
    let want = u32s(&g["ids"]);
    let top2: Vec<Vec<f32>> = g["top2_logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(f32s)
        .collect();
    let mut seq = prompt.to_vec();
    seq.extend_from_slice(&want[..want.len() - 1]);
    let logits = engine.logits_for(&seq).unwrap();
    let vocab = logits.len() / seq.len();
    for (s, &w) in want.iter().enumerate() {
        let row = prompt.len() - 1 + s;
        let got = argmax(&logits[row * vocab..(row + 1) * vocab]);
        if got != w {
            assert!(
                near_tie(top2[s][0], top2[s][1], tie),
                "{dir}/{name}: greedy step {s} gave {got}, reference {w} (margin {:?})",
                top2[s]
            );
            eprintln!(
                "{dir}/{name}: greedy diverges at step {s} at a near-tie {:?}",
                top2[s]
            );
            return;
        }
    }
    eprintln!("{dir}/{name}: greedy {} tokens identical", want.len());
}

#[test]
fn smollm2_matches_transformers() {
    check_real_model("smollm2", &QUANTIZED);
}

#[test]
fn qwen2_matches_transformers() {
    check_real_model("qwen2", &QUANTIZED);
}

/// With f32 activations the graph must reproduce the reference to
/// rounding: any RoPE, norm, GQA or lm-head mistake shows here. These are
/// the brief's gates, on all 5 prompts of each model.
#[test]
fn smollm2_f32_activations_reproduce_transformers_exactly() {
    check_real_model("smollm2", &EXACT);
}

#[test]
fn qwen2_f32_activations_reproduce_transformers_exactly() {
    check_real_model("qwen2", &EXACT);
}

#[test]
fn qwen3_tiny_converted_from_safetensors_matches_transformers() {
    let dir = fixtures().join("qwen3_tiny");
    let reference = read_json(&dir.join("reference.json"));
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("qwen3_tiny.gguf");
    mirage_runtime::convert::safetensors_to_gguf(
        &dir.join("model.safetensors"),
        &dir.join("config.json"),
        &gguf,
    )
    .unwrap();
    let file = Arc::new(GgufFile::open(&gguf).unwrap());
    let model = Model::load(file, CpuBackend::new(2).unwrap()).unwrap();
    assert_eq!(model.config().arch, mirage_gguf::Arch::Qwen3);
    let vocab = reference["vocab_size"].as_u64().unwrap() as usize;
    let all = std::fs::read(dir.join(reference["logits_file"].as_str().unwrap())).unwrap();
    for seq in reference["sequences"].as_array().unwrap() {
        let ids = u32s(&seq["token_ids"]);
        let off = seq["logits_offset_bytes"].as_u64().unwrap() as usize;
        let want: Vec<f32> = all[off..off + ids.len() * vocab * 4]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let got = model.logits_all(&ids, dtype).unwrap();
            let max_abs = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            let tol = if dtype == KvDtype::F32 { 1e-4 } else { 5e-3 };
            assert!(
                max_abs < tol,
                "qwen3 tiny {dtype:?}: max |dlogit| {max_abs}"
            );
            for (i, &a) in u32s(&seq["argmax"]).iter().enumerate() {
                assert_eq!(argmax(&got[i * vocab..(i + 1) * vocab]), a, "position {i}");
            }
            eprintln!(
                "qwen3 tiny, {} positions, {dtype:?} cache: max |dlogit| {max_abs:.2e}",
                ids.len()
            );
        }
    }
}

#[test]
fn batched_prefill_equals_token_by_token_decode() {
    // The same logits whether a prompt runs as one batch or one token at a
    // time through the KV cache (checks causal masking and cache indexing).
    let dir = fixtures().join("qwen3_tiny");
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("m.gguf");
    mirage_runtime::convert::safetensors_to_gguf(
        &dir.join("model.safetensors"),
        &dir.join("config.json"),
        &gguf,
    )
    .unwrap();
    let model = Model::load(
        Arc::new(GgufFile::open(&gguf).unwrap()),
        CpuBackend::new(2).unwrap(),
    )
    .unwrap();
    let ids: Vec<u32> = (0..20).map(|i| (i * 37 + 11) % 256).collect();
    let batch = model.logits_all(&ids, KvDtype::F32).unwrap();
    let vocab = model.config().vocab_size;
    let mut cache = model.new_kv_cache(32, 2, KvDtype::F32).unwrap();
    let mut scratch = model.new_scratch();
    let mut out = Vec::new();
    for (pos, &t) in ids.iter().enumerate() {
        // Sequence 1, so slot indexing is exercised too.
        let slot = [mirage_runtime::TokenSlot { seq: 1, pos }];
        model
            .forward(&[t], &slot, &[0], &mut cache, &mut scratch, &mut out)
            .unwrap();
        let want = &batch[pos * vocab..(pos + 1) * vocab];
        let d = out
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(d < 1e-4, "position {pos}: {d}");
    }
}

#[test]
fn session_generation_streams_stops_and_is_seeded() {
    let Some(path) = model_path("smollm2-135m-instruct-q4_1.gguf") else {
        return;
    };
    let engine = Engine::load(
        &path,
        EngineOptions {
            n_ctx: 256,
            ..Default::default()
        },
    )
    .unwrap();
    let sampling = mirage_runtime::SamplingParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: 7,
        ..Default::default()
    };
    let params = mirage_runtime::GenerateParams {
        max_tokens: 24,
        sampling,
        stop: vec![],
        ..Default::default()
    };
    let run = |params: &mirage_runtime::GenerateParams| {
        let mut session = engine.session().unwrap();
        let mut streamed = String::new();
        let out = session
            .generate("Once upon a time", params, |p| {
                streamed.push_str(p);
                true
            })
            .unwrap();
        assert_eq!(streamed, out.text, "streamed pieces add up to the text");
        // The last sample is not fed when a stop string or the callback ended it.
        let unfed = matches!(
            out.stats.stop_reason,
            mirage_runtime::StopReason::StopString | mirage_runtime::StopReason::Callback
        ) as usize;
        assert_eq!(
            session.tokens().len() + unfed,
            engine.encode("Once upon a time", true).unwrap().len() + out.tokens.len()
        );
        out
    };
    let a = run(&params);
    assert_eq!(a.tokens.len(), 24);
    assert_eq!(a.stats.stop_reason, mirage_runtime::StopReason::MaxTokens);
    assert_eq!(run(&params).tokens, a.tokens, "same seed, same tokens");
    // Stop at a string taken from the middle of the first run's text.
    let words: Vec<&str> = a.text.split_whitespace().collect();
    let stop = words[words.len() / 2].to_string();
    let b = run(&mirage_runtime::GenerateParams {
        stop: vec![stop.clone()],
        ..params.clone()
    });
    assert_eq!(b.stats.stop_reason, mirage_runtime::StopReason::StopString);
    assert!(
        !b.text.contains(&stop) && a.text.starts_with(&b.text),
        "{:?} / {:?} / {stop:?}",
        b.text,
        a.text
    );
}

/// Embeddings: the final hidden state `Model::hidden_states` returns is the
/// one the reference's logits come from (lm head times our hidden state
/// against transformers' last logits, SmolLM2's head being its Q8_0
/// embedding matrix), `Engine::embed_tokens` is its L2-normalised mean over
/// the tokens, and batching several inputs into one pass changes nothing.
#[test]
fn embeddings_pool_the_hidden_state_the_reference_logits_come_from() {
    let refdir = fixtures().join("smollm2");
    let reference = read_json(&refdir.join("reference.json"));
    let Some(path) = model_path(reference["model_file"].as_str().unwrap()) else {
        return;
    };
    assert!(reference["lm_head_is_token_embd"].as_bool().unwrap());
    let engine = Engine::load(
        &path,
        EngineOptions {
            n_ctx: 512,
            ..Default::default()
        },
    )
    .unwrap();
    let model = engine.model();
    let (d, vocab) = (model.config().n_embd, model.config().vocab_size);
    let file = GgufFile::open(&path).unwrap();
    let head = file.tensor("token_embd.weight").unwrap();
    let row_bytes = head.data.len() / vocab;
    let mut w = vec![0.0f32; d];
    let prompts = reference["prompts"].as_array().unwrap();
    let inputs: Vec<Vec<u32>> = prompts.iter().map(|p| u32s(&p["token_ids"])).collect();
    let mut expected = Vec::new();
    for (p, ids) in prompts.iter().zip(&inputs) {
        let mut cache = model.new_kv_cache(ids.len(), 1, KvDtype::F32).unwrap();
        let mut scratch = model.new_scratch();
        let slots: Vec<_> = (0..ids.len())
            .map(|pos| mirage_runtime::TokenSlot { seq: 0, pos })
            .collect();
        let mut hidden = Vec::new();
        model
            .hidden_states(ids, &slots, &mut cache, &mut scratch, &mut hidden)
            .unwrap();
        assert_eq!(hidden.len(), ids.len() * d);
        let last = &hidden[(ids.len() - 1) * d..];
        let logits: Vec<f32> = (0..vocab)
            .map(|r| {
                mirage_gguf::quant::dequantize(
                    head.info.ty,
                    &head.data[r * row_bytes..(r + 1) * row_bytes],
                    &mut w,
                )
                .unwrap();
                w.iter().zip(last).map(|(a, b)| a * b).sum()
            })
            .collect();
        let refl = read_f16(&refdir.join(p["last_logits_file"].as_str().unwrap()));
        let cos = cosine(&logits, &refl);
        assert!(cos >= 0.995, "{}: head(hidden) cosine {cos}", p["name"]);
        let mut mean = vec![0.0f64; d];
        for row in hidden.chunks_exact(d) {
            for (m, &h) in mean.iter_mut().zip(row) {
                *m += h as f64 / ids.len() as f64;
            }
        }
        let norm = mean.iter().map(|x| x * x).sum::<f64>().sqrt();
        expected.push(mean.iter().map(|x| (x / norm) as f32).collect::<Vec<f32>>());
    }
    let batched = engine.embed_tokens(&inputs).unwrap();
    assert_eq!(batched.len(), inputs.len());
    for (i, (got, want)) in batched.iter().zip(&expected).enumerate() {
        let n2: f32 = got.iter().map(|x| x * x).sum();
        assert!((n2 - 1.0).abs() < 1e-4, "input {i}: |e|^2 = {n2}");
        let cos = cosine(got, want);
        assert!(cos > 0.9999, "input {i}: batched vs alone cosine {cos}");
    }
    // Text in, the same vectors out; empty input is refused.
    let texts: Vec<&str> = prompts
        .iter()
        .map(|p| p["text"].as_str().unwrap())
        .collect();
    let from_text = engine.embed(&texts[..2]).unwrap();
    assert!(cosine(&from_text[1], &batched[1]) > 0.9999);
    assert!(engine.embed(&[""]).is_err());
}

/// The token stream yields what `generate` returns, piece by piece; a
/// shared session owns its engine and runs in another thread; a stream
/// dropped early leaves the session as a callback returning `false` does.
#[test]
fn token_streams_and_shared_sessions_generate_what_generate_does() {
    let Some(path) = model_path("smollm2-135m-instruct-q4_1.gguf") else {
        return;
    };
    let engine = Arc::new(
        Engine::load(
            &path,
            EngineOptions {
                n_ctx: 256,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let params = mirage_runtime::GenerateParams {
        max_tokens: 20,
        stop: vec!["\n\n".into()],
        logprobs: Some(1),
        ..Default::default()
    };
    let whole = engine
        .session()
        .unwrap()
        .generate("The three primary colors are", &params, |_| true)
        .unwrap();
    let shared = Engine::shared_session(&engine).unwrap();
    let p = params.clone();
    let (pieces, generation, session_tokens) = std::thread::spawn(move || {
        let mut stream = shared.stream("The three primary colors are", &p).unwrap();
        let pieces: Vec<_> = stream.by_ref().map(|p| p.unwrap()).collect();
        let (session, generation) = stream.finish();
        (pieces, generation, session.tokens().len())
    })
    .join()
    .unwrap();
    let text: String = pieces.iter().map(|p| p.text.as_str()).collect();
    let tokens: Vec<u32> = pieces.iter().filter_map(|p| p.token).collect();
    assert_eq!(text, whole.text);
    assert_eq!(tokens, whole.tokens);
    assert_eq!(generation.text, whole.text);
    assert_eq!(generation.stats.stop_reason, whole.stats.stop_reason);
    assert_eq!(generation.logprobs, whole.logprobs);
    assert!(pieces
        .iter()
        .filter(|p| p.token.is_some())
        .all(|p| p.logprob.is_some()));
    let prompt_len = engine
        .encode("The three primary colors are", true)
        .unwrap()
        .len();
    let unfed = (whole.stats.stop_reason == mirage_runtime::StopReason::StopString) as usize;
    assert_eq!(session_tokens + unfed, prompt_len + whole.tokens.len());
    // Three pieces, then drop: the third token is sampled but never fed.
    let mut stream = engine.session().unwrap().stream("Hello", &params).unwrap();
    for _ in 0..3 {
        stream.next().unwrap().unwrap();
    }
    let (session, early) = stream.finish();
    assert_eq!(
        early.stats.stop_reason,
        mirage_runtime::StopReason::Callback
    );
    assert_eq!(early.tokens.len(), 3);
    assert_eq!(
        session.tokens().len(),
        engine.encode("Hello", true).unwrap().len() + 2
    );
}
