//! The command line a llama.cpp user expects: short flags that mean what the
//! long ones do, prompts from stdin and files, chat that shifts its context,
//! bench repetitions, quantize presets and its refusal to overwrite its
//! input, and the model list. Tiny synthetic models
//! (`mirage_gguf::synth::TinyModel`) where no real weights are needed; the
//! quantize presets are also checked against real Q4_K_M files made by
//! llama.cpp and read back with the `gguf` Python package.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use mirage_gguf::synth::{fill_random, TinyModel};
use mirage_gguf::GgmlType;

fn cli(args: &[&str]) -> Output {
    cli_stdin(args, None)
}

fn cli_stdin(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_mirage-cli"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run mirage-cli");
    let mut pipe = child.stdin.take().unwrap();
    if let Some(text) = stdin {
        pipe.write_all(text.as_bytes()).unwrap();
    }
    drop(pipe);
    child.wait_with_output().unwrap()
}

fn ok(out: &Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn tiny(dir: &Path) -> PathBuf {
    let path = dir.join("tiny.gguf");
    TinyModel::default()
        .writer()
        .unwrap()
        .write_to_path(&path)
        .unwrap();
    path
}

fn models_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models")
}

/// Everything after the first `|` of generate's stats line is timing; the
/// text and token counts before it must agree.
fn generate_result(out: &Output) -> (String, String) {
    let text = ok(out, "generate");
    let err = stderr(out);
    let stats = err
        .lines()
        .find(|l| l.starts_with("prompt:"))
        .unwrap_or_else(|| panic!("no stats line in {err}"));
    let counts: Vec<&str> = stats
        .split('|')
        .map(|part| part.split(',').next().unwrap().trim())
        .collect();
    (text, counts.join(" | "))
}

#[test]
fn short_flags_mean_what_the_long_ones_do() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let m = model.to_str().unwrap();
    let long = cli(&[
        "generate",
        "--model",
        m,
        "--prompt",
        "hello",
        "--max-tokens",
        "5",
        "--seed",
        "7",
        "--temp",
        "1",
        "--threads",
        "1",
        "--ctx-size",
        "64",
    ]);
    let short = cli(&[
        "generate", "-m", m, "-p", "hello", "-n", "5", "-s", "7", "--temp", "1", "-t", "1", "-c",
        "64",
    ]);
    let (long_text, long_stats) = generate_result(&long);
    assert_eq!(
        generate_result(&short),
        (long_text.clone(), long_stats.clone())
    );
    assert!(long_stats.contains("decode: 5 tokens") || long_stats.contains("EndOfGeneration"));
    // -n changes the count, -s the sample: the aliases are not ignored.
    let fewer = cli(&[
        "generate", "-m", m, "-p", "hello", "-n", "2", "-s", "7", "--temp", "1",
    ]);
    assert!(generate_result(&fewer).1.contains("decode: 2 tokens"));
    let reseeded = cli(&[
        "generate", "-m", m, "-p", "hello", "-n", "5", "-s", "8", "--temp", "1", "-c", "64",
    ]);
    assert_ne!(generate_result(&reseeded).0, long_text);

    // One context flag: -c, --ctx-size and the old --ctx all refuse the same
    // too-large context with the same words.
    let errors: Vec<String> = ["-c", "--ctx-size", "--ctx"]
        .iter()
        .map(|flag| {
            let out = cli(&["generate", "-m", m, "-p", "hi", "-n", "1", flag, "100000"]);
            assert!(!out.status.success());
            stderr(&out)
        })
        .collect();
    assert!(errors[0].contains("100000"), "{}", errors[0]);
    assert_eq!(errors[0], errors[1]);
    assert_eq!(errors[0], errors[2]);
    // -t is --threads, with its range check.
    let a = stderr(&cli(&["generate", "-m", m, "-p", "hi", "-t", "100000"]));
    let b = stderr(&cli(&[
        "generate",
        "-m",
        m,
        "-p",
        "hi",
        "--threads",
        "100000",
    ]));
    assert!(a.contains("100000 threads"), "{a}");
    assert_eq!(a.replace("-t <THREADS>", "--threads <THREADS>"), b);
}

#[test]
fn perplexity_takes_f_and_c_like_llama_perplexity() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let text = dir.path().join("text.txt");
    std::fs::write(
        &text,
        "the quick brown fox jumps over the lazy dog. ".repeat(8),
    )
    .unwrap();
    let (m, t) = (model.to_str().unwrap(), text.to_str().unwrap());
    let run = |args: &[&str]| -> serde_json::Value {
        let mut all = vec!["perplexity", "--json"];
        all.extend_from_slice(args);
        serde_json::from_str(&ok(&cli(&all), "perplexity")).unwrap()
    };
    let long = run(&["--model", m, "--text", t, "--ctx-size", "64"]);
    let short = run(&["-m", m, "-f", t, "-c", "64"]);
    let old = run(&["--model", m, "--text", t, "--ctx", "64"]);
    assert_eq!(long["n_ctx"], 64);
    assert_eq!(long["n_chunks"], 5, "{long}");
    for r in [&short, &old] {
        assert_eq!(r["ppl"], long["ppl"]);
        assert_eq!(r["n_ctx"], long["n_ctx"]);
    }
    // Without -c the window is llama-perplexity's 512, more than this model was trained on.
    let out = cli(&["perplexity", "-m", m, "-f", t]);
    assert!(
        stderr(&out).contains("context of 512 positions"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn the_prompt_comes_from_stdin_or_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let m = model.to_str().unwrap();
    let prompt = "a prompt with\ntwo lines";
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, prompt).unwrap();
    let common = ["generate", "-m", m, "-n", "4", "--temp", "0"];
    let with = |extra: &[&str], stdin: Option<&str>| {
        let mut args = common.to_vec();
        args.extend_from_slice(extra);
        generate_result(&cli_stdin(&args, stdin))
    };
    let inline = with(&["-p", prompt], None);
    assert_eq!(with(&["-p", "-"], Some(prompt)), inline);
    assert_eq!(with(&["--prompt", "-"], Some(prompt)), inline);
    assert_eq!(with(&["-f", file.to_str().unwrap()], None), inline);
    // The prompt really went in: 23 bytes, one token each in this vocabulary.
    assert!(inline.1.starts_with("prompt: 23 tokens"), "{}", inline.1);

    // Both, or neither, is a usage error; a missing file names itself.
    let both = cli(&["generate", "-m", m, "-p", "x", "-f", file.to_str().unwrap()]);
    assert_eq!(both.status.code(), Some(2));
    assert!(stderr(&cli(&["generate", "-m", m])).contains("--prompt"));
    let missing = cli(&["generate", "-m", m, "-f", "/nonexistent/prompt.txt"]);
    assert!(stderr(&missing).contains("/nonexistent/prompt.txt"));
}

#[test]
fn chat_shifts_the_context_and_keeps_the_system_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let lines = "the first message, long enough\nthe second message, also long\nthe third message here\nthe fourth message here\n";
    let out = cli_stdin(
        &[
            "chat",
            "-m",
            model.to_str().unwrap(),
            "--system",
            "Be brief.",
            "-c",
            "96",
            "-n",
            "4",
            "--temp",
            "0",
            "-vv",
        ],
        Some(lines),
    );
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("context is full"), "{err}");
    let shift = err
        .find("context shift: dropped the")
        .unwrap_or_else(|| panic!("no context shift in {err}"));
    assert!(err[shift..].contains("kept the system prompt"), "{err}");
    // Every prompt after the shift still starts with the system prompt and fits.
    let prompts: Vec<&str> = err[shift..]
        .lines()
        .filter_map(|l| l.split("DEBUG prompt: ").nth(1))
        .collect();
    assert!(!prompts.is_empty(), "{err}");
    for p in &prompts {
        assert!(p.contains("roles: system, user"), "{p}");
        let n: usize = p.split(' ').next().unwrap().parse().unwrap();
        assert!(n + 4 <= 96, "{p}");
    }
    // Four replies: no turn was lost to the shift.
    assert_eq!(err.matches(" tokens, prompt ").count(), 4, "{err}");
}

#[test]
fn bench_repetitions_report_mean_and_deviation() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let m = model.to_str().unwrap();
    let text = ok(
        &cli(&[
            "bench", "-m", m, "-p", "16", "-n", "4", "-r", "3", "-t", "1",
        ]),
        "bench",
    );
    let prompt = text.lines().find(|l| l.starts_with("prompt ")).unwrap();
    let decode = text.lines().find(|l| l.starts_with("decode ")).unwrap();
    for line in [prompt, decode] {
        assert!(line.contains(" ± ") && line.contains("(3 runs)"), "{line}");
    }
    assert!(prompt.contains("16 tokens"), "{prompt}");
    assert!(decode.contains("4 tokens"), "{decode}");
    let json: serde_json::Value = serde_json::from_str(&ok(
        &cli(&[
            "bench", "--model", m, "--prompt", "16", "--gen", "4", "--reps", "2", "--json",
        ]),
        "bench --json",
    ))
    .unwrap();
    assert_eq!(json["repetitions"], 2);
    assert!(json["decode_tok_s_sd"].as_f64().unwrap() >= 0.0);
    assert!(json["prompt_tok_s_sd"].as_f64().unwrap() >= 0.0);
    // One run has no spread to report.
    let one = ok(&cli(&["bench", "-m", m, "-p", "8", "-n", "2"]), "bench");
    assert!(!one.contains('±'), "{one}");
}

/// A tiny llama model whose matrices fit K-quant blocks (width 256) except
/// ffn_down (rows of 320), with 8 layers and optionally its own output matrix.
fn quantizable_model(dir: &Path, with_output: bool) -> PathBuf {
    let tm = TinyModel {
        n_layer: 8,
        n_embd: 256,
        n_ff: 320,
        n_head: 4,
        n_head_kv: 2,
        ..TinyModel::default()
    };
    let mut w = tm.writer().unwrap();
    if with_output {
        let n = 256 * tm.vocab_size();
        let mut data = vec![0u8; n * 4];
        fill_random(GgmlType::F32, 0.05, 99, &mut data).unwrap();
        w.add_tensor(
            "output.weight",
            vec![256, tm.vocab_size() as u64],
            GgmlType::F32,
            data,
        )
        .unwrap();
    }
    let path = dir.join(if with_output {
        "untied.gguf"
    } else {
        "tied.gguf"
    });
    w.write_to_path(&path).unwrap();
    path
}

/// Tensor name -> type name, and general.file_type, read by the `gguf` package.
fn gguf_py_types(path: &Path) -> (std::collections::BTreeMap<String, String>, u64) {
    let out = Command::new("python3")
        .arg("-c")
        .arg(
            r#"
import sys, json, gguf
r = gguf.GGUFReader(sys.argv[1])
print(json.dumps({"types": {t.name: t.tensor_type.name for t in r.tensors},
                  "file_type": int(r.fields["general.file_type"].parts[-1][0])}))
"#,
        )
        .arg(path)
        .output()
        .expect("python3 with the gguf package (pip install gguf)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let types = v["types"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
        .collect();
    (types, v["file_type"].as_u64().unwrap())
}

/// What llama.cpp's `llama_tensor_get_type` gives each tensor of
/// [`quantizable_model`] under `preset`, spelled out by hand from its rules:
/// use_more_bits(i, 8) picks layers 0, 3, 6 and 7; rows of 320 do not fit
/// a K-quant block, so ffn_down falls back (Q4_K -> Q5_0, Q5_K -> Q5_1,
/// Q6_K -> Q8_0).
fn expected_type(preset: &str, name: &str, with_output: bool) -> &'static str {
    let base = match preset {
        "q4_k_m" => "Q4_K",
        "q5_k_m" => "Q5_K",
        "q6_k" => "Q6_K",
        _ => "Q8_0",
    };
    let mixed = matches!(preset, "q4_k_m" | "q5_k_m");
    let layer: Option<usize> = name
        .strip_prefix("blk.")
        .and_then(|r| r.split('.').next())
        .and_then(|n| n.parse().ok());
    let more_bits = mixed && matches!(layer, Some(0 | 3 | 6 | 7));
    if name.ends_with("_norm.weight") {
        return "F32";
    }
    let is_output = name == "output.weight" || (!with_output && name == "token_embd.weight");
    if is_output {
        return if base == "Q8_0" { "Q8_0" } else { "Q6_K" };
    }
    if name.contains("ffn_down") {
        let chosen = if more_bits { "Q6_K" } else { base };
        return match chosen {
            "Q4_K" => "Q5_0",
            "Q5_K" => "Q5_1",
            _ => "Q8_0",
        };
    }
    if name.contains("attn_v") && more_bits {
        return "Q6_K";
    }
    base
}

#[test]
fn quantize_presets_give_llama_cpp_types_per_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("q4_k_m", false, 15),
        ("q4_k_m", true, 15),
        ("q5_k_m", true, 17),
        ("q6_k", false, 18),
        ("q8_0", true, 7),
    ];
    for (preset, with_output, file_type) in cases {
        let src = quantizable_model(dir.path(), with_output);
        let out = dir.path().join(format!("{preset}-{with_output}.gguf"));
        let stdout = ok(
            &cli(&[
                "quantize",
                src.to_str().unwrap(),
                out.to_str().unwrap(),
                preset,
                "-t",
                "2",
            ]),
            "quantize",
        );
        assert!(stdout.contains("weight matrices by type"), "{stdout}");
        let (types, ft) = gguf_py_types(&out);
        assert_eq!(ft, file_type, "{preset}");
        assert_eq!(types.len(), 8 * 9 + 2 + usize::from(with_output));
        for (name, ty) in &types {
            assert_eq!(
                ty,
                expected_type(preset, name, with_output),
                "{preset} (output matrix: {with_output}): {name}"
            );
        }
    }
}

/// `quantize --dry-run`'s types, tensor by tensor: (name, from, to).
fn dry_run(model: &Path, preset: &str) -> Vec<(String, String, String)> {
    let text = ok(
        &cli(&[
            "quantize",
            model.to_str().unwrap(),
            "/nonexistent/out.gguf",
            preset,
            "--dry-run",
        ]),
        "quantize --dry-run",
    );
    text.lines()
        .map(|l| {
            let (name, rest) = l.split_once(": ").unwrap();
            let mut words = rest.split_whitespace();
            let from = words.next().unwrap().to_string();
            assert_eq!(words.next(), Some("->"));
            (name.to_string(), from, words.next().unwrap().to_string())
        })
        .collect()
}

#[test]
fn q4_k_m_reproduces_real_q4_k_m_files() {
    // Gemma-3-270M Q4_K_M was made by a current llama.cpp: every tensor keeps its type.
    let gemma = models_dir().join("gemma-3-270m-q4_k_m.gguf");
    if gemma.is_file() {
        for (name, from, to) in dry_run(&gemma, "q4_k_m") {
            assert_eq!(from, to, "gemma3 {name}");
        }
    } else {
        eprintln!(
            "gemma3 part skipped: {} is not fetched (`mirage-cli fetch-models --only gemma3-270m`)",
            gemma.display()
        );
    }
    // Qwen2.5-Coder-0.5B Q4_K_M (fetched by default) was made by an older llama.cpp that
    // counted layers in the file's order (blk.0, blk.1, blk.10, ...) rather than by
    // number: the same number of attn_v and ffn_down tensors get Q6_K (Q8_0 for attn_v,
    // whose rows of 896 do not fit Q6_K), in other layers; every other tensor is equal.
    let qwen = models_dir().join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    assert!(
        qwen.is_file(),
        "{} is missing: run `cargo xtask fetch-models`",
        qwen.display()
    );
    let plan = dry_run(&qwen, "q4_k_m");
    assert_eq!(plan.len(), 291);
    let count = |kind: &str, ty: &str, pick: fn(&(String, String, String)) -> &String| {
        plan.iter()
            .filter(|t| t.0.contains(kind) && pick(t) == ty)
            .count()
    };
    for (kind, ty) in [("ffn_down", "Q6_K"), ("attn_v", "Q8_0")] {
        let file = count(kind, ty, |t| &t.1);
        assert_eq!(file, 12, "{kind} {ty} in the file");
        assert_eq!(count(kind, ty, |t| &t.2), file, "{kind} {ty} planned");
    }
    for (name, from, to) in &plan {
        if !name.contains("ffn_down") && !name.contains("attn_v") {
            assert_eq!(from, to, "qwen2 {name}");
        }
    }
}

#[test]
fn quantize_refuses_to_overwrite_its_input() {
    let dir = tempfile::tempdir().unwrap();
    let src = tiny(dir.path());
    let before = std::fs::read(&src).unwrap();
    let s = src.to_str().unwrap();
    let dotted = dir.path().join(".").join("tiny.gguf");
    let link = dir.path().join("link.gguf");
    std::os::unix::fs::symlink(&src, &link).unwrap();
    let hard = dir.path().join("hard.gguf");
    std::fs::hard_link(&src, &hard).unwrap();
    for out in [src.clone(), dotted, link, hard] {
        let run = cli(&["quantize", s, out.to_str().unwrap(), "q8_0"]);
        assert_eq!(run.status.code(), Some(1));
        let err = stderr(&run);
        assert!(err.contains("refusing to overwrite the input"), "{err}");
    }
    assert_eq!(std::fs::read(&src).unwrap(), before);
    // An unknown type names the valid ones.
    let err = stderr(&cli(&["quantize", s, "/tmp/never.gguf", "q4_k_xl"]));
    assert!(err.contains("q4_k_m") && err.contains("q8_0"), "{err}");
}

#[test]
fn list_models_says_what_is_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // smollm2: the real file (linked) -> verified when hashed; qwen2.5-coder: a file of
    // the right size but wrong bytes; gemma3-270m: a truncated copy; the rest missing.
    let smollm2 = models_dir().join("smollm2-135m-instruct-q4_1.gguf");
    assert!(smollm2.is_file(), "{} is missing", smollm2.display());
    std::os::unix::fs::symlink(&smollm2, d.join("smollm2-135m-instruct-q4_1.gguf")).unwrap();
    let f = std::fs::File::create(d.join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")).unwrap();
    f.set_len(491_400_064).unwrap();
    std::fs::write(d.join("gemma-3-270m-q4_k_m.gguf"), b"partial").unwrap();

    let listed = ok(&cli(&["list-models", "--dir", d.to_str().unwrap()]), "list");
    let row = |text: &str, id: &str| -> String {
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(id))
            .unwrap_or_else(|| panic!("no {id} row in {text}"))
            .to_string()
    };
    assert!(row(&listed, "smollm2").contains("present (size matches)"));
    assert!(row(&listed, "smollm2").contains("93.8 MiB"));
    assert!(row(&listed, "qwen2.5-coder").contains("present (size matches)"));
    assert!(row(&listed, "gemma3-270m").contains("wrong size (7 bytes)"));
    assert!(row(&listed, "qwen2.5-coder-1.5b").contains("missing"));
    assert!(row(&listed, "qwen2.5-coder-1.5b").contains("1.04 GiB"));
    // fetch-models --list prints the same.
    let same = ok(
        &cli(&["fetch-models", "--list", "--dir", d.to_str().unwrap()]),
        "fetch-models --list",
    );
    assert_eq!(same, listed);

    // Hashing tells a real file from one of the right size.
    let verified = ok(
        &cli(&["list-models", "--verify", "--dir", d.to_str().unwrap()]),
        "list --verify",
    );
    assert!(row(&verified, "smollm2").contains("verified (sha256)"));
    assert!(row(&verified, "qwen2.5-coder").contains("sha256 differs"));
    let json: serde_json::Value = serde_json::from_str(&ok(
        &cli(&["list-models", "--json", "--dir", d.to_str().unwrap()]),
        "list --json",
    ))
    .unwrap();
    assert_eq!(json[0]["id"], "smollm2");
    assert_eq!(json[0]["size"], 98_362_432);
    assert_eq!(json[0]["on_disk"]["state"], "size_matches");
    assert_eq!(json[3]["on_disk"]["state"], "wrong_size");
}
