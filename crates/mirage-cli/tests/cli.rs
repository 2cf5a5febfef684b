//! End-to-end tests of the `mirage-cli` binary on the real models, checked
//! against the `gguf` Python package (an independent reader and quantizer).
//!
//! Models come from the workspace's models/ folder (`cargo xtask
//! fetch-models`); without them these tests fail, unless
//! MIRAGE_SKIP_MODEL_TESTS=1, in which case they say why they skip.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const SMOLLM2: &str = "smollm2-135m-instruct-q4_1.gguf";
const QWEN: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

fn models_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models")
}

/// The model's path; `None` (with a message) only when skipping is asked for.
fn model(name: &str) -> Option<PathBuf> {
    let path = models_dir().join(name);
    if path.is_file() {
        return Some(path);
    }
    if std::env::var("MIRAGE_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!(
            "skipping: {} is missing and MIRAGE_SKIP_MODEL_TESTS=1",
            path.display()
        );
        return None;
    }
    panic!(
        "{} is missing: run `cargo xtask fetch-models`",
        path.display()
    );
}

fn cli(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mirage-cli"))
        .args(args)
        .output()
        .expect("run mirage-cli")
}

fn ok_stdout(args: &[&str]) -> String {
    let out = cli(args);
    assert!(
        out.status.success(),
        "mirage-cli {args:?} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

/// Runs a Python script (argv after it) and parses the JSON it prints.
fn python_json(script: &str, args: &[&str]) -> serde_json::Value {
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("python3 must be installed (tests compare against the `gguf` package)");
    assert!(
        out.status.success(),
        "python3 failed (needs `pip install gguf numpy`): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("python printed JSON")
}

fn inspect_json(path: &Path) -> serde_json::Value {
    let text = ok_stdout(&["inspect", "--json", path.to_str().unwrap()]);
    serde_json::from_str(&text).expect("inspect --json prints JSON")
}

#[test]
fn inspect_json_reports_qwen_shape() {
    let Some(path) = model(QWEN) else { return };
    let r = inspect_json(&path);
    assert_eq!(r["architecture"], "qwen2");
    assert_eq!(r["block_count"], 24);
    assert_eq!(r["embedding_length"], 896);
    assert_eq!(r["feed_forward_length"], 4864);
    assert_eq!(r["head_count"], 14);
    assert_eq!(r["head_count_kv"], 2);
    assert_eq!(r["tensor_count"], 291);
    assert_eq!(r["vocab_size"], 151936);
    assert_eq!(r["tokenizer"]["pre"], "qwen2");
    assert_eq!(r["tokenizer"]["has_chat_template"], true);
    assert_eq!(r["tensors"].as_array().unwrap().len(), 291);
    // Per-type byte totals add up to the tensor data and match the file.
    let per_type: u64 = r["bytes_per_type"]
        .as_object()
        .unwrap()
        .values()
        .map(|t| t["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(per_type, r["tensor_bytes"].as_u64().unwrap());
    assert!(r["tensor_bytes"].as_u64().unwrap() < r["file_size"].as_u64().unwrap());
}

#[test]
fn inspect_agrees_with_gguf_py() {
    let Some(path) = model(SMOLLM2) else { return };
    let r = inspect_json(&path);
    let py = python_json(
        r#"
import sys, json, gguf
r = gguf.GGUFReader(sys.argv[1])
f = r.fields
print(json.dumps({
  "tensors": [[t.name, t.tensor_type.name, [int(d) for d in t.shape], int(t.n_bytes)] for t in r.tensors],
  "block_count": int(f["llama.block_count"].parts[-1][0]),
  "vocab": len(f["tokenizer.ggml.tokens"].data),
}))
"#,
        &[path.to_str().unwrap()],
    );
    assert_eq!(r["block_count"], py["block_count"]);
    assert_eq!(r["vocab_size"], py["vocab"]);
    assert_eq!(r["tokenizer"]["vocab_size"], py["vocab"]);
    let ours = r["tensors"].as_array().unwrap();
    let theirs = py["tensors"].as_array().unwrap();
    assert_eq!(ours.len(), theirs.len());
    for (o, t) in ours.iter().zip(theirs) {
        assert_eq!(o["name"], t[0]);
        assert_eq!(o["type"], t[1]);
        assert_eq!(o["shape"], t[2], "{}", o["name"]);
        assert_eq!(o["bytes"], t[3], "{}", o["name"]);
    }
}

#[test]
fn inspect_rejects_a_file_that_is_not_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let bogus = dir.path().join("bogus.gguf");
    std::fs::write(&bogus, b"this is not a model at all").unwrap();
    let out = cli(&["inspect", bogus.to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.starts_with("error: reading"), "{stderr}");
    assert!(stderr.contains("magic"), "{stderr}");
}

/// Compares a re-quantized file with its source through gguf-py: names,
/// order, shapes and types, and per-tensor relative RMS error of the
/// dequantized values; Q8_0 tensors must also equal gguf-py's own Q8_0
/// quantization of the source byte for byte.
const COMPARE_PY: &str = r#"
import sys, json, numpy as np, gguf
src, out = gguf.GGUFReader(sys.argv[1]), gguf.GGUFReader(sys.argv[2])
by_name = {t.name: t for t in src.tensors}
Q8 = gguf.GGMLQuantizationType.Q8_0
res = {"names_in_order": [t.name for t in out.tensors] == [t.name for t in src.tensors],
       "file_type": int(out.fields["general.file_type"].parts[-1][0]),
       "types": {}, "max_rel_rmse": {}, "q8_0_identical": 0, "q8_0_differ": []}
for t in out.tensors:
    s = by_name[t.name]
    assert list(t.shape) == list(s.shape), t.name
    res["types"][t.name] = t.tensor_type.name
    x = gguf.quants.dequantize(s.data, s.tensor_type).astype(np.float64)
    y = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
    rel = float(np.sqrt(np.mean((x - y) ** 2)) / max(np.sqrt(np.mean(x ** 2)), 1e-30))
    k = t.tensor_type.name
    res["max_rel_rmse"][k] = max(res["max_rel_rmse"].get(k, 0.0), rel)
    if t.tensor_type == Q8 and s.tensor_type != Q8:
        ref = gguf.quants.quantize(x.astype(np.float32), Q8).reshape(-1).view(np.uint8)
        if np.array_equal(ref, np.asarray(t.data).reshape(-1).view(np.uint8)):
            res["q8_0_identical"] += 1
        else:
            res["q8_0_differ"].append(t.name)
print(json.dumps(res))
"#;

fn is_weight_matrix(name: &str) -> bool {
    name.ends_with(".weight") && !name.contains("norm")
}

#[test]
fn quantize_smollm2_to_q8_0_matches_gguf_py() {
    let Some(src) = model(SMOLLM2) else { return };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("smollm2-q8_0.gguf");
    let stdout = ok_stdout(&[
        "quantize",
        src.to_str().unwrap(),
        out.to_str().unwrap(),
        "--type",
        "q8_0",
    ]);
    assert!(
        stdout.contains("210 tensors converted Q4_1 -> Q8_0"),
        "{stdout}"
    );
    // Written via a temporary name: only the final file is left.
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(left.len(), 1);

    let r = python_json(COMPARE_PY, &[src.to_str().unwrap(), out.to_str().unwrap()]);
    assert_eq!(r["names_in_order"], true);
    assert_eq!(r["file_type"], 7, "general.file_type must say MOSTLY_Q8_0");
    let types = r["types"].as_object().unwrap();
    assert_eq!(types.len(), 272);
    for (name, ty) in types {
        // SmolLM2's matrices are all 2-D `.weight`s; norms are 1-D F32.
        let want = if is_weight_matrix(name) {
            "Q8_0"
        } else {
            "F32"
        };
        assert_eq!(ty, want, "{name}");
    }
    // 210 Q4_1 matrices re-quantized; token_embd was Q8_0 already and is copied.
    assert_eq!(r["q8_0_identical"], 210, "differ: {}", r["q8_0_differ"]);
    let q8_err = r["max_rel_rmse"]["Q8_0"].as_f64().unwrap();
    assert!(q8_err > 0.0 && q8_err < 0.01, "Q8_0 relative RMSE {q8_err}");
    assert_eq!(r["max_rel_rmse"]["F32"], 0.0);
}

#[test]
fn quantize_to_q4_k_falls_back_where_rows_do_not_fit() {
    let Some(src) = model(SMOLLM2) else { return };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("smollm2-q4_k.gguf");
    let stdout = ok_stdout(&[
        "quantize",
        src.to_str().unwrap(),
        out.to_str().unwrap(),
        "q4_k",
    ]);
    assert!(
        stdout.contains("row length 576 is not a multiple of Q4_K's block of 256"),
        "{stdout}"
    );

    let r = python_json(COMPARE_PY, &[src.to_str().unwrap(), out.to_str().unwrap()]);
    assert_eq!(r["file_type"], 14);
    let types = r["types"].as_object().unwrap();
    for (name, ty) in types {
        let want = if !is_weight_matrix(name) {
            "F32"
        } else if name.contains("ffn_down") {
            "Q4_K" // rows of 1536 = 6 x 256
        } else {
            "Q5_0" // rows of 576: llama.cpp's fallback for Q4_K
        };
        assert_eq!(ty, want, "{name}");
    }
    let err = &r["max_rel_rmse"];
    assert!(err["Q4_K"].as_f64().unwrap() < 0.05, "{err}");
    assert!(err["Q5_0"].as_f64().unwrap() < 0.08, "{err}");
}

#[test]
fn quantize_refuses_activation_only_types() {
    let dir = tempfile::tempdir().unwrap();
    let out = cli(&[
        "quantize",
        "in.gguf",
        dir.path().join("o").to_str().unwrap(),
        "q8_k",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("activation format"));
    let out = cli(&["quantize", "in.gguf", "o.gguf", "--type", "q9_9"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown type"));
}

#[test]
fn fetch_models_verifies_the_present_model_without_fetching() {
    let Some(path) = model(SMOLLM2) else { return };
    let dir = path.parent().unwrap().to_str().unwrap().to_string();
    let stdout = ok_stdout(&["fetch-models", "--only", "smollm2", "--dir", &dir]);
    assert!(stdout.contains("up to date"), "{stdout}");
}

#[test]
fn generate_reports_the_backend_it_ran_on_and_refuses_bad_choices() {
    let Some(smol) = model(SMOLLM2) else { return };
    let smol = smol.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let stats = dir.path().join("stats.json");
    let stats_s = stats.to_str().unwrap();
    let base = [
        "generate",
        "--model",
        smol,
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "4",
    ];
    let base = [
        &base[..],
        &[
            "--temp",
            "0",
            "--threads",
            "2",
            "--ctx-size",
            "64",
            "--stats-json",
            stats_s,
        ],
    ]
    .concat();
    let read_backend = || -> String {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
        v["backend"].as_str().unwrap().to_string()
    };
    let cpu_text = ok_stdout(&[&base[..], &["--backend", "cpu"]].concat());
    assert_eq!(read_backend(), "cpu");
    // auto: the CPU here unless a GPU answers; the greedy text is the same.
    let auto_text = ok_stdout(&base);
    let auto = read_backend();
    assert!(auto == "cpu" || auto == "cuda", "{auto}");
    if auto == "cpu" {
        assert_eq!(auto_text, cpu_text);
        // --backend cuda with no GPU (or no cuda feature) fails and says why.
        let out = cli(&[&base[..], &["--backend", "cuda"]].concat());
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("no usable GPU")
                || err.contains("built without the `cuda` feature; rebuild with --features cuda"),
            "{err}"
        );
    }
    let out = cli(&[&base[..], &["--backend", "tpu"]].concat());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown backend `tpu`"), "{err}");
    // --margin only means something with --artifact.
    assert!(!cli(&[&base[..], &["--margin", "1.0"]].concat())
        .status
        .success());
}

/// `bench --ubatch`: a prompt run in chunks fills the same KV cache as one
/// batch, so the greedy tokens decoded after it are the same; the JSON
/// names the chunk size.
#[test]
fn bench_prompt_in_ubatch_chunks_decodes_the_same_tokens() {
    let Some(smol) = model(SMOLLM2) else { return };
    let smol = smol.to_str().unwrap();
    let run = |ubatch: &str| -> serde_json::Value {
        let out = ok_stdout(&[
            "bench",
            "--model",
            smol,
            "--prompt",
            "70",
            "--gen",
            "6",
            "--threads",
            "2",
            "--ubatch",
            ubatch,
            "--json",
        ]);
        serde_json::from_str(&out).expect("bench --json prints JSON")
    };
    let whole = run("0");
    let chunked = run("32");
    assert_eq!(whole["prompt_ubatch"], 70);
    assert_eq!(chunked["prompt_ubatch"], 32);
    assert_eq!(chunked["prompt_tokens"], 70);
    assert_eq!(
        whole["first_tokens"], chunked["first_tokens"],
        "chunked prefill changed the decoded tokens"
    );
    assert!(!cli(&["bench", "--model", smol, "--ubatch", "x"])
        .status
        .success());
}

/// `bench --kv-prune`: every page selected decodes the tokens of full
/// attention; a real budget runs and is named in the JSON; a bad spec is
/// refused.
#[test]
fn bench_kv_prune_all_pages_decodes_the_same_tokens() {
    let Some(smol) = model(SMOLLM2) else { return };
    let smol = smol.to_str().unwrap();
    let run = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "bench",
            "--model",
            smol,
            "--prompt",
            "70",
            "--gen",
            "6",
            "--threads",
            "2",
            "--json",
        ];
        args.extend_from_slice(extra);
        serde_json::from_str(&ok_stdout(&args)).expect("bench --json prints JSON")
    };
    let full = run(&[]);
    let all = run(&["--kv-prune", "page=16,sinks=0,recent=0,top=1000"]);
    let pruned = run(&["--kv-prune", "page=16,sinks=1,recent=1,top=1"]);
    assert!(full["kv_prune"].is_null());
    assert_eq!(
        all["first_tokens"], full["first_tokens"],
        "every page selected changed the decoded tokens"
    );
    assert_eq!(
        pruned["kv_prune"],
        "page=16,sinks=1,recent=1,top=1,top_percent=0,dense=0"
    );
    assert_eq!(pruned["first_tokens"].as_array().map(|t| t.len()), Some(7));
    assert!(!cli(&["bench", "--model", smol, "--kv-prune", "page=0"])
        .status
        .success());
}

/// `eval-long --backend`: `cpu` runs and names the backend and device in its
/// JSON; `cuda` runs when a GPU answers, else fails saying why (no GPU, or a
/// build without the `cuda` feature); an unknown backend is refused by the
/// argument parser. None of them panics.
#[test]
fn eval_long_reports_its_backend_and_refuses_bad_choices() {
    let Some(smol) = model(SMOLLM2) else { return };
    let smol = smol.to_str().unwrap();
    let text = models_dir().join("../README.md");
    let text = text.to_str().unwrap();
    let base = [
        "eval-long",
        "--model",
        smol,
        "--text",
        text,
        "--ctx",
        "96",
        "--ppl-tokens",
        "4",
        "--page",
        "16",
    ];
    let base = [
        &base[..],
        &[
            "--top-pages",
            "1",
            "--recent-pages",
            "1",
            "--no-needles",
            "--threads",
            "2",
            "--json",
        ],
    ]
    .concat();
    let no_panic = |out: &Output| {
        assert!(
            !String::from_utf8_lossy(&out.stderr).contains("panicked"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        )
    };
    let cpu: serde_json::Value =
        serde_json::from_str(&ok_stdout(&[&base[..], &["--backend", "cpu"]].concat()))
            .expect("JSON");
    assert_eq!(cpu["backend"], "cpu");
    assert!(
        cpu["device"].as_str().unwrap().starts_with("cpu ("),
        "{}",
        cpu["device"]
    );
    assert_eq!(cpu["threads"], 2);
    assert_eq!(cpu["results"][0]["n_ctx"], 96);
    assert!(cpu["results"][0]["final_logit_cosine"].as_f64().unwrap() > 0.5);
    let out = cli(&[&base[..], &["--backend", "cuda"]].concat());
    no_panic(&out);
    if out.status.success() {
        let cuda: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(cuda["backend"], "cuda");
        assert!(
            cuda["cuda"]["graph_replays"].as_u64().unwrap() > 0,
            "{}",
            cuda["cuda"]
        );
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("no usable GPU")
                || err.contains("built without the `cuda` feature; rebuild with --features cuda"),
            "{err}"
        );
    }
    let out = cli(&[&base[..], &["--backend", "bogus"]].concat());
    no_panic(&out);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown backend `bogus` (expected cpu or cuda)"),
        "{err}"
    );
    // The BVH page selector: same results as the flat scan, its cost reported.
    let bvh: serde_json::Value = serde_json::from_str(&ok_stdout(
        &[&base[..], &["--backend", "cpu", "--page-selector", "bvh"]].concat(),
    ))
    .expect("JSON");
    assert_eq!(
        bvh["results"][0]["final_logit_cosine"], cpu["results"][0]["final_logit_cosine"],
        "selectors chose different pages"
    );
    let sel = &bvh["page_selection"];
    assert_eq!(sel["selector"], "bvh");
    assert!(sel["pruned_queries"].as_u64().unwrap() > 0, "{sel}");
    assert!(sel["bounds_flat_scan"].as_u64().unwrap() > 0, "{sel}");
    assert_eq!(
        cpu["page_selection"]["bounds_evaluated"], cpu["page_selection"]["bounds_flat_scan"],
        "flat scan counts"
    );
    let out = cli(&[&base[..], &["--backend", "cpu", "--page-selector", "tree"]].concat());
    no_panic(&out);
    assert!(!out.status.success(), "an unknown selector was accepted");
}

/// `eval` on an artifact built from SmolLM2 (64 calibration tokens of
/// Apache-2.0, evaluated on GFDL-1.3): the all-pages run stays next to dense,
/// the oracle's recall of itself is 1, a router setting is said to meet the
/// gates exactly when its numbers do, and the table prints "-" (never NaN)
/// where a metric does not apply (the all-pages row's router metrics).
#[test]
fn eval_reports_fidelity_of_a_built_artifact() {
    use mirage_artifact::metrics::{COSINE_GATE, RECALL_GATE};
    let Some(smol) = model(SMOLLM2) else { return };
    let calib: String = std::fs::read_to_string("/usr/share/common-licenses/Apache-2.0")
        .expect("Apache-2.0 (install base-files)")
        .chars()
        .take(1200)
        .collect();
    let opts = mirage_artifact::BuildOptions {
        calib_name: "Apache-2.0 (first 1200 chars)".into(),
        calib_text: calib,
        max_calib_tokens: 64,
        threads: 2,
        ..Default::default()
    };
    let built = mirage_artifact::build(&smol, &opts, &mut |_| {}).expect("build the artifact");
    let dir = tempfile::tempdir().unwrap();
    let artifact = dir.path().join("smol.mirage");
    std::fs::write(&artifact, &built.bytes).unwrap();
    let base = [
        "eval",
        "--artifact",
        artifact.to_str().unwrap(),
        "--model",
        smol.to_str().unwrap(),
        "--text",
        "/usr/share/common-licenses/GFDL-1.3",
        "--max-tokens",
        "48",
        "--threads",
        "2",
        "--max-fidelity-runs",
        "2",
    ];
    let j: serde_json::Value = serde_json::from_str(&ok_stdout(
        &[
            &base[..],
            &["--json", "--oracle-top", "0.5", "--oracle-top-groups", "1"],
        ]
        .concat(),
    ))
    .expect("JSON");
    let f = |v: &serde_json::Value| v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"));
    assert_eq!(j["tokens"], 48);
    let dense_ppl = f(&j["dense_ppl"]);
    assert!(
        dense_ppl.is_finite() && dense_ppl > 1.0,
        "dense ppl {dense_ppl}"
    );
    // Every page, repacked to Q8_0 from the Q4_1 source: close to dense.
    let all = &j["all_pages"];
    assert!(f(&all["logit_cosine"]) > 0.99, "all pages: {all}");
    assert!(
        (f(&all["active_fraction_measured"]) - 1.0).abs() < 1e-9,
        "all pages: {all}"
    );
    // The oracle against itself.
    let oracle = &j["oracle"];
    assert_eq!(f(&oracle["setting"]["recall"]), 1.0, "{oracle}");
    let active = f(&oracle["setting"]["active_fraction"]);
    assert!(active > 0.0 && active <= 1.0, "{oracle}");
    // (Each layer's oracle keeps its FFN output at cosine 0.999; over 30
    // layers and 48 tokens the logits measured 0.985.)
    assert!(f(&oracle["fidelity"]["logit_cosine"]) > 0.95, "{oracle}");
    for router in ["bvh", "predictor"] {
        let p = &j[router];
        if p.is_null() {
            continue;
        }
        let (recall, cos) = (
            f(&p["setting"]["recall"]),
            f(&p["fidelity"]["logit_cosine"]),
        );
        assert!(
            recall >= RECALL_GATE,
            "{router} picked below the recall gate: {p}"
        );
        assert_eq!(
            p["meets_gates"],
            recall >= RECALL_GATE && cos >= COSINE_GATE,
            "{router}: {p}"
        );
    }
    // --oracle-top 0.5: half of each layer's pages (rounded up), the largest outputs.
    let tops = j["oracle_top"]
        .as_array()
        .unwrap_or_else(|| panic!("oracle_top: {}", j["oracle_top"]));
    assert_eq!(tops.len(), 1, "{tops:?}");
    let half = &tops[0];
    let pages_total = f(&j["pages_total"]);
    let half_active = f(&half["fidelity"]["active_fraction_measured"]);
    assert!(
        (0.5..0.5 + 0.1).contains(&half_active),
        "oracle top 50%: {half}, of {pages_total} pages"
    );
    assert!(
        (f(&half["setting"]["active_fraction"]) - half_active).abs() < 1e-9,
        "{half}"
    );
    assert!(
        f(&half["fidelity"]["logit_cosine"]) < f(&all["logit_cosine"]),
        "half the pages cost nothing? {half}"
    );
    assert_eq!(
        half["meets_cosine_gate"],
        f(&half["fidelity"]["logit_cosine"]) >= COSINE_GATE,
        "{half}"
    );
    // Half of the single channels: one full run, fidelity between half the pages and all pages.
    let ch = &j["oracle_top_groups"][0];
    assert_eq!(
        (ch["group_channels"].as_u64(), f(&ch["fraction"])),
        (Some(1), 0.5),
        "{ch}"
    );
    let ch_cos = f(&ch["fidelity"]["logit_cosine"]);
    assert!(
        ch_cos > f(&half["fidelity"]["logit_cosine"]) && ch_cos < 1.0,
        "{ch} vs {half}"
    );
    assert!(
        f(&ch["fidelity"]["active_fraction_measured"]) >= half_active,
        "pages touched: {ch}"
    );
    // The per-layer bound at 1-, 8-, 32- and 128-channel groups, one fraction each.
    let groups = j["oracle_top_layer_cosine"]
        .as_array()
        .unwrap_or_else(|| panic!("{}", j["oracle_top_layer_cosine"]));
    assert_eq!(
        groups
            .iter()
            .map(|g| g["group_channels"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [1, 8, 32, 128]
    );
    for g in groups {
        let per = g["per_fraction"].as_array().unwrap();
        assert_eq!(per.len(), 1, "{g}");
        let (mean, share) = (
            f(&per[0]["mean_cosine"]),
            f(&per[0]["share_at_oracle_cosine"]),
        );
        assert!(
            mean > 0.0 && mean < 1.0 && (0.0..=1.0).contains(&share),
            "{g}"
        );
    }
    let sweep_len = j["bvh_sweep"].as_array().map(|a| a.len()).unwrap_or(0);
    assert!(sweep_len > 1, "bvh sweep: {}", j["bvh_sweep"]);
    let out = cli(&[&base[..], &["--oracle-top", "1.5"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--oracle-top 1.5") && err.contains("(0, 1]"),
        "{err}"
    );
    let out = cli(&[
        &base[..],
        &["--oracle-top", "0.5", "--oracle-top-groups", "48"],
    ]
    .concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--oracle-top-groups 48"),
        "{err}"
    );
    let table = ok_stdout(&base);
    assert!(!table.contains("NaN"), "{table}");
    let all_row = table
        .lines()
        .find(|l| l.starts_with("all pages"))
        .unwrap_or_else(|| panic!("{table}"));
    assert_eq!(all_row.split_whitespace().nth(4), Some("-"), "{all_row}");
}
