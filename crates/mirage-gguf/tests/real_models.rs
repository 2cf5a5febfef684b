//! The reader, writer and hparams on the two real models, checked against
//! the view of the `gguf` Python package (fixtures from
//! scripts/gen_format_fixtures.py).

use std::path::PathBuf;

use mirage_gguf::{Arch, GgmlType, GgufFile, GgufWriter, Value};
use serde_json::Value as Json;
use sha2::{Digest, Sha256};

const SMOLLM: &str = "smollm2-135m-instruct-q4_1.gguf";
const QWEN: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

/// The model's path, or `None` (after saying why) when
/// MIRAGE_SKIP_MODEL_TESTS=1; a missing model without that is a failure.
fn model(name: &str) -> Option<PathBuf> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(name);
    if path.exists() {
        return Some(path);
    }
    if std::env::var("MIRAGE_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!(
            "skipping: {} missing and MIRAGE_SKIP_MODEL_TESTS=1",
            path.display()
        );
        return None;
    }
    panic!("{} missing: run `cargo xtask fetch-models`", path.display());
}

fn fixture(name: &str) -> Json {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run scripts/gen_format_fixtures.py",
            path.display()
        )
    });
    serde_json::from_str(&text).unwrap()
}

fn strings_sha256<'a>(items: impl IntoIterator<Item = &'a str>) -> String {
    let mut h = Sha256::new();
    for s in items {
        h.update((s.len() as u64).to_le_bytes());
        h.update(s.as_bytes());
    }
    format!("{:x}", h.finalize())
}

fn ints_sha256(items: impl IntoIterator<Item = i64>) -> String {
    let mut h = Sha256::new();
    for x in items {
        h.update(x.to_le_bytes());
    }
    format!("{:x}", h.finalize())
}

fn scalar_matches(v: &Value, want: &Json) -> bool {
    match v {
        Value::String(s) => want.as_str() == Some(s),
        Value::Bool(b) => want.as_bool() == Some(*b),
        Value::F32(_) | Value::F64(_) => want.as_f64() == v.as_f64(),
        _ => want.as_i64() == v.as_i64(),
    }
}

/// Everything the Python reader sees, our reader sees identically.
fn compare_with_python(name: &str) {
    let Some(path) = model(name) else { return };
    let f = GgufFile::open(&path).unwrap();
    let want = fixture(&format!("{name}.json"));
    assert_eq!(
        f.len(),
        want["file_len"].as_u64().unwrap(),
        "file length (wrong model version?)"
    );
    assert_eq!(f.version() as u64, want["version"].as_u64().unwrap());
    assert_eq!(f.alignment(), want["alignment"].as_u64().unwrap());
    assert_eq!(f.data_offset(), want["data_offset"].as_u64().unwrap());
    assert_eq!(f.metadata().len() as u64, want["n_kv"].as_u64().unwrap());
    assert_eq!(
        f.tensors().len() as u64,
        want["n_tensors"].as_u64().unwrap()
    );

    let order: Vec<&str> = f.metadata().iter().map(|(k, _)| k).collect();
    let want_order: Vec<&str> = want["key_order"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap())
        .collect();
    assert_eq!(order, want_order, "metadata key order");

    for (key, w) in want["scalars"].as_object().unwrap() {
        let v = f
            .metadata()
            .get(key)
            .unwrap_or_else(|| panic!("missing {key}"));
        assert_eq!(
            v.value_type().id() as u64,
            w["type"].as_u64().unwrap(),
            "{key} type"
        );
        assert!(
            scalar_matches(v, &w["value"]),
            "{key}: ours {v:?}, python {}",
            w["value"]
        );
    }
    for (key, w) in want["arrays"].as_object().unwrap() {
        let a = f
            .metadata()
            .get_array(key)
            .unwrap_or_else(|| panic!("missing array {key}"));
        assert_eq!(
            a.elem_type.id() as u64,
            w["elem_type"].as_u64().unwrap(),
            "{key} elem type"
        );
        assert_eq!(
            a.values.len() as u64,
            w["len"].as_u64().unwrap(),
            "{key} length"
        );
        if let Some(strings) = f.metadata().get_str_array(key) {
            let first: Vec<&str> = w["first"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_str().unwrap())
                .collect();
            let last: Vec<&str> = w["last"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_str().unwrap())
                .collect();
            assert_eq!(&strings[..first.len()], &first[..], "{key} first entries");
            assert_eq!(
                &strings[strings.len() - last.len()..],
                &last[..],
                "{key} last entries"
            );
            assert_eq!(
                strings_sha256(strings.iter().copied()),
                w["sha256"].as_str().unwrap(),
                "{key} hash"
            );
        } else if let Some(h) = w.get("sha256") {
            let ints: Vec<i64> = a.values.iter().map(|v| v.as_i64().unwrap()).collect();
            assert_eq!(ints_sha256(ints), h.as_str().unwrap(), "{key} hash");
        }
    }

    let want_tensors = want["tensors"].as_array().unwrap();
    for (t, w) in f.tensors().iter().zip(want_tensors) {
        assert_eq!(t.name, w["name"].as_str().unwrap());
        assert_eq!(
            t.ty.id() as u64,
            w["type"].as_u64().unwrap(),
            "{} type",
            t.name
        );
        let dims: Vec<u64> = w["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(t.dims, dims, "{} dims", t.name);
        assert_eq!(t.offset, w["offset"].as_u64().unwrap(), "{} offset", t.name);
        assert_eq!(
            t.n_bytes(),
            w["n_bytes"].as_u64().unwrap(),
            "{} bytes",
            t.name
        );
        let view = f.tensor(&t.name).unwrap();
        assert_eq!(view.data.len() as u64, t.n_bytes());
        assert_eq!(
            view.data.as_ptr() as usize - f.as_bytes().as_ptr() as usize,
            (f.data_offset() + t.offset) as usize
        );
    }
}

#[test]
fn smollm2_matches_python_gguf_reader() {
    compare_with_python(SMOLLM);
}

#[test]
fn qwen_matches_python_gguf_reader() {
    compare_with_python(QWEN);
}

#[test]
fn smollm2_hparams() {
    let Some(path) = model(SMOLLM) else { return };
    let f = GgufFile::open(path).unwrap();
    let hp = f.hparams().unwrap();
    assert_eq!(hp.arch, Arch::Llama);
    assert_eq!((hp.n_layer, hp.n_embd, hp.n_ff), (30, 576, 1536));
    assert_eq!(
        (hp.n_head, hp.n_head_kv, hp.head_dim, hp.rope_dim),
        (9, 3, 64, 64)
    );
    assert_eq!(hp.vocab_size, 49152);
    assert_eq!(hp.n_ctx_train, 8192);
    assert_eq!(hp.rope_freq_base, 100_000.0);
    assert_eq!(hp.rms_norm_eps, 1e-5);
    assert!(hp.rope_scaling.is_none());
    // SmolLM2 has no output.weight: the LM head is the embedding.
    assert!(hp.tied_embeddings);
    assert!(f.tensor("output.weight").is_none());
    assert!(!hp.attn_qkv_bias && !hp.attn_qk_norm);
    assert_eq!(f.tensors().len(), 272);
    let embd = f.tensor("token_embd.weight").unwrap();
    assert_eq!(embd.info.ty, GgmlType::Q8_0);
    assert_eq!(embd.info.dims, [576, 49152]);
}

#[test]
fn qwen_hparams() {
    let Some(path) = model(QWEN) else { return };
    let f = GgufFile::open(path).unwrap();
    let hp = f.hparams().unwrap();
    assert_eq!(hp.arch, Arch::Qwen2);
    assert_eq!((hp.n_layer, hp.n_embd, hp.n_ff), (24, 896, 4864));
    assert_eq!((hp.n_head, hp.n_head_kv, hp.head_dim), (14, 2, 64));
    assert_eq!(hp.vocab_size, 151_936);
    assert_eq!(hp.n_ctx_train, 32768);
    assert_eq!(hp.rope_freq_base, 1_000_000.0);
    assert_eq!(hp.rms_norm_eps, 1e-6);
    // MODELS.md says "tied lm head", but this file carries its own Q8_0
    // output.weight (token_embd is Q5_0), as the Python reader confirms.
    assert!(!hp.tied_embeddings);
    assert_eq!(f.tensor("output.weight").unwrap().info.ty, GgmlType::Q8_0);
    assert_eq!(
        f.tensor("token_embd.weight").unwrap().info.ty,
        GgmlType::Q5_0
    );
    assert!(hp.attn_qkv_bias && !hp.attn_qk_norm);
    assert_eq!(f.tensors().len(), 291);
    // Every one of the 151,936 tokens comes back, not a truncated preview.
    let tokens = f.metadata().get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 151_936);
    assert_eq!(tokens[0], "!");
    assert_eq!(
        f.metadata()
            .get_i32_array("tokenizer.ggml.token_type")
            .unwrap()
            .len(),
        151_936
    );
    assert_eq!(
        f.metadata().get_u64("tokenizer.ggml.eos_token_id"),
        Some(151_645)
    );
}

/// Rewriting a model unchanged through the writer (atomically, to a path)
/// reproduces the file byte for byte.
fn rewrite_identical(name: &str) {
    let Some(path) = model(name) else { return };
    let f = GgufFile::open(&path).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join(name);
    let n = GgufWriter::from_gguf(&f).write_to_path(&out).unwrap();
    assert_eq!(n, f.len());
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        leftovers.len(),
        1,
        "temporary file left behind: {leftovers:?}"
    );
    let copy = GgufFile::open(&out).unwrap();
    let (a, b) = (f.as_bytes(), copy.as_bytes());
    assert_eq!(a.len(), b.len());
    if let Some(i) = (0..a.len())
        .step_by(1 << 20)
        .find(|&i| a[i..(i + (1 << 20)).min(a.len())] != b[i..(i + (1 << 20)).min(b.len())])
    {
        let j = (i..a.len()).find(|&j| a[j] != b[j]).unwrap();
        panic!("rewrite of {name} differs first at byte {j}");
    }
}

#[test]
fn smollm2_rewrite_is_byte_identical() {
    rewrite_identical(SMOLLM);
}

#[test]
fn qwen_rewrite_is_byte_identical() {
    rewrite_identical(QWEN);
}

#[test]
fn gemma3_hparams() {
    let Some(path) = model("gemma-3-270m-q4_k_m.gguf") else {
        return;
    };
    let f = GgufFile::open(path).unwrap();
    let hp = f.hparams().unwrap();
    assert_eq!(hp.arch, Arch::Gemma3);
    assert_eq!((hp.n_layer, hp.n_embd, hp.n_ff), (18, 640, 2048));
    // Heads wider than n_embd / n_head: key_length is read, not derived.
    assert_eq!(
        (hp.n_head, hp.n_head_kv, hp.head_dim, hp.head_dim_v),
        (4, 1, 256, 256)
    );
    assert_eq!(hp.vocab_size, 262_144);
    assert_eq!(hp.n_ctx_train, 32768);
    assert_eq!(hp.rope_freq_base, 1_000_000.0);
    assert_eq!(hp.sliding_window, Some(512));
    assert_eq!(hp.final_logit_softcapping, None);
    assert!(hp.tied_embeddings && hp.attn_qk_norm && !hp.attn_qkv_bias);
    assert!(f.tensor("blk.0.post_ffw_norm.weight").is_some());
}
