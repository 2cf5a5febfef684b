//! `xtask synth-model` end to end: a tiny-shape file with the real Qwen
//! tokenizer, read back by our GGUF reader, by the `gguf` Python package
//! (an independent reader), and run by the CPU engine.

use std::path::{Path, PathBuf};
use std::process::Command;

use mirage_gguf::{GgmlType, GgufFile};
use mirage_runtime::{Engine, EngineOptions};

fn qwen() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    if p.exists() {
        return Some(p);
    }
    if std::env::var("MIRAGE_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!(
            "skipping: {} is missing and MIRAGE_SKIP_MODEL_TESTS=1",
            p.display()
        );
        return None;
    }
    panic!("{} is missing: run `cargo xtask fetch-models`", p.display());
}

fn synth(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .arg("synth-model")
        .args(args)
        .output()
        .expect("run xtask");
    assert!(
        out.status.success(),
        "xtask synth-model {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn python_json(script: &str, path: &Path) -> serde_json::Value {
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(path)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "python: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

const GGUF_PY: &str = r#"
import json, sys
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
r = GGUFReader(sys.argv[1])
tensors = {t.name: {"shape": [int(x) for x in t.shape], "type": t.tensor_type.name} for t in r.tensors}
f = r.fields
def scalar(k):
    v = f[k].parts[f[k].data[0]]
    return v.tobytes().decode() if f[k].types[0].name == "STRING" else v.tolist()[0]
stats = {}
for t in r.tensors:
    if t.name in ("blk.1.ffn_down.weight", "blk.0.attn_q.weight", "token_embd.weight", "blk.0.attn_norm.weight"):
        w = dequantize(t.data, t.tensor_type).astype(np.float64)
        stats[t.name] = {"std": float(w.std()), "mean": float(w.mean()), "zeros": int((w == 0).sum())}
print(json.dumps({
    "tensors": tensors,
    "arch": scalar("general.architecture"),
    "n_embd": scalar("qwen2.embedding_length"),
    "n_tokens": len(f["tokenizer.ggml.tokens"].data),
    "last_token": f["tokenizer.ggml.tokens"].parts[f["tokenizer.ggml.tokens"].data[-1]].tobytes().decode(),
    "stats": stats,
}))
"#;

#[test]
fn tiny_synth_model_reads_back_everywhere_and_runs() {
    let Some(qwen) = qwen() else { return };
    let dir = tempfile::tempdir().unwrap();
    // The tokenizer-only stand-in carries what synth-model needs from the Qwen file.
    let tok = dir.path().join("tok.gguf");
    synth(&[
        "--tokenizer-only",
        "--tokenizer-from",
        qwen.to_str().unwrap(),
        "--out",
        tok.to_str().unwrap(),
    ]);
    let tok_file = GgufFile::open(&tok).unwrap();
    assert!(tok_file.tensors().is_empty());
    assert!(std::fs::metadata(&tok).unwrap().len() < 8_000_000);

    let out = dir.path().join("tiny.gguf");
    let printed = synth(&[
        "--like",
        "tiny",
        "--quant",
        "q4_k",
        "--seed",
        "3",
        "--tokenizer-from",
        tok.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(printed.contains("tiny"), "{printed}");
    // Written under a temporary name, renamed when done: nothing else left.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");

    // Our reader: hyperparameters, shapes, types.
    let file = GgufFile::open(&out).unwrap();
    let hp = mirage_gguf::ModelHparams::from_gguf(&file).unwrap();
    assert_eq!(
        (hp.n_embd, hp.n_ff, hp.n_layer, hp.n_head, hp.n_head_kv),
        (256, 512, 2, 4, 2)
    );
    let t = |name: &str| {
        file.tensor_info(name)
            .unwrap_or_else(|| panic!("no {name}"))
            .clone()
    };
    assert_eq!(
        (t("token_embd.weight").dims, t("token_embd.weight").ty),
        (vec![256, 151936], GgmlType::Q4_K)
    );
    assert_eq!(
        (t("output.weight").dims, t("output.weight").ty),
        (vec![256, 151936], GgmlType::Q4_K)
    );
    assert_eq!(
        (t("blk.1.attn_k.weight").dims, t("blk.1.attn_k.weight").ty),
        (vec![256, 128], GgmlType::Q4_K)
    );
    assert_eq!(
        (t("blk.1.attn_k.bias").dims, t("blk.1.attn_k.bias").ty),
        (vec![128], GgmlType::F32)
    );
    assert_eq!((t("blk.0.ffn_down.weight").dims), vec![512, 256]);
    assert_eq!(file.tensors().len(), 1 + 2 * 12 + 2);

    // The gguf package reads the same file, and dequantizes our random
    // blocks to non-zero weights with std 1/sqrt(row length).
    let py = python_json(GGUF_PY, &out);
    assert_eq!(py["arch"], "qwen2");
    assert_eq!(py["n_embd"], 256);
    assert_eq!(py["n_tokens"], 151936);
    assert_eq!(
        py["tensors"].as_object().unwrap().len(),
        file.tensors().len()
    );
    for info in file.tensors() {
        let p = &py["tensors"][&info.name];
        let shape: Vec<u64> = p["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(shape, info.dims, "{}", info.name);
        assert_eq!(
            p["type"].as_str().unwrap().to_lowercase(),
            info.ty.name().to_lowercase(),
            "{}",
            info.name
        );
    }
    for (name, row) in [
        ("blk.1.ffn_down.weight", 512.0f64),
        ("blk.0.attn_q.weight", 256.0),
        ("token_embd.weight", 256.0),
    ] {
        let s = &py["stats"][name];
        let want = 1.0 / row.sqrt();
        let std = s["std"].as_f64().unwrap();
        assert!(
            (std - want).abs() < 0.03 * want,
            "{name}: std {std}, want {want}"
        );
        assert!(
            s["mean"].as_f64().unwrap().abs() < 0.05 * want,
            "{name}: {s}"
        );
        assert_eq!(s["zeros"], 0, "{name}");
    }
    let norm = &py["stats"]["blk.0.attn_norm.weight"];
    assert!(
        (norm["mean"].as_f64().unwrap() - 1.0).abs() < 0.01,
        "{norm}"
    );

    // The real tokenizer: the same ids as the Qwen file's.
    let real = mirage_tokenizer::Tokenizer::from_gguf(&GgufFile::open(&qwen).unwrap()).unwrap();
    let ours = mirage_tokenizer::Tokenizer::from_gguf(&file).unwrap();
    let text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)";
    assert_eq!(
        ours.encode(text, false, true).unwrap(),
        real.encode(text, false, true).unwrap()
    );

    // The CPU engine runs a forward pass with finite, non-constant logits.
    let engine = Engine::load(
        &out,
        EngineOptions {
            threads: 2,
            n_ctx: 64,
            ..EngineOptions::default()
        },
    )
    .unwrap();
    let tokens = engine.encode("The capital of France is", false).unwrap();
    let logits = engine.logits_for(&tokens).unwrap();
    assert_eq!(logits.len(), tokens.len() * 151936);
    assert!(logits.iter().all(|x| x.is_finite()));
    let last = &logits[logits.len() - 151936..];
    let mean = last.iter().map(|&x| x as f64).sum::<f64>() / last.len() as f64;
    let std =
        (last.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / last.len() as f64).sqrt();
    assert!(std > 0.1 && std < 100.0, "logit std {std}");

    // Deterministic: the same seed gives the same bytes, another seed others.
    let again = dir.path().join("again.gguf");
    let args = |seed: &'static str, path: &Path| -> Vec<String> {
        [
            "--like",
            "tiny",
            "--quant",
            "q4_k",
            "--seed",
            seed,
            "--tokenizer-from",
            tok.to_str().unwrap(),
            "--out",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([path.to_str().unwrap().to_string()])
        .collect()
    };
    let run = |a: Vec<String>| synth(&a.iter().map(String::as_str).collect::<Vec<_>>());
    run(args("3", &again));
    assert!(
        std::fs::read(&again).unwrap() == std::fs::read(&out).unwrap(),
        "same seed, different bytes"
    );
    run(args("4", &again));
    assert!(
        std::fs::read(&again).unwrap() != std::fs::read(&out).unwrap(),
        "another seed, same bytes"
    );
}

#[test]
fn bad_arguments_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.gguf");
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_xtask"))
            .arg("synth-model")
            .args(args)
            .output()
            .unwrap()
    };
    let o = run(&[
        "--like",
        "qwen2.5-3b",
        "--tokenizer-from",
        "/nonexistent.gguf",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("/nonexistent.gguf"));
    let o = run(&["--out", out.to_str().unwrap()]);
    assert!(!o.status.success(), "--like is required");
    assert!(!out.exists());
}

/// `--quant q4_k_m`: llama.cpp's mix on the tiny shape (the last of its two
/// layers gets more bits: attn_v and ffn_down in Q6_K, and so does the
/// output). The gguf package reads the types and dequantizes the Q6_K
/// blocks to non-zero weights of the asked std.
#[test]
fn tiny_q4_k_m_synth_model_has_llama_cpps_mix() {
    let Some(qwen) = qwen() else { return };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tiny-q4_k_m.gguf");
    let printed = synth(&[
        "--like",
        "tiny",
        "--quant",
        "q4_k_m",
        "--tokenizer-from",
        qwen.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(printed.contains("Q4_K_M"), "{printed}");
    let py = python_json(GGUF_PY, &out);
    let ty = |name: &str| py["tensors"][name]["type"].as_str().unwrap().to_string();
    for (name, want) in [
        ("token_embd.weight", "Q4_K"),
        ("output.weight", "Q6_K"),
        ("blk.0.attn_v.weight", "Q4_K"),
        ("blk.1.attn_v.weight", "Q6_K"),
        ("blk.0.ffn_down.weight", "Q4_K"),
        ("blk.1.ffn_down.weight", "Q6_K"),
        ("blk.1.ffn_up.weight", "Q4_K"),
    ] {
        assert_eq!(ty(name), want, "{name}");
    }
    let s = &py["stats"]["blk.1.ffn_down.weight"];
    let want = 1.0 / 512f64.sqrt();
    let std = s["std"].as_f64().unwrap();
    assert!(
        (std - want).abs() < 0.03 * want,
        "Q6_K std {std}, want {want}"
    );
    assert!(s["mean"].as_f64().unwrap().abs() < 0.05 * want, "{s}");
    assert_eq!(s["zeros"], 0, "{s}");
}
