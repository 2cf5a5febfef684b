//! Hostile and careless input to `mirage-cli`: each case exits with status 1
//! and a one-line `error:` that names the problem (never a signal, never an
//! abort from a huge allocation). Models are tiny synthetic GGUFs written
//! here (`mirage_gguf::synth::TinyModel`), so no download is needed.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use mirage_gguf::synth::TinyModel;
use mirage_gguf::{Metadata, Value};

fn cli(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mirage-cli"))
        .args(args)
        .output()
        .expect("run mirage-cli")
}

fn write_tiny(dir: &Path, name: &str, edit: impl FnOnce(&mut Metadata)) -> PathBuf {
    let mut w = TinyModel::default().writer().unwrap();
    edit(w.metadata_mut());
    let path = dir.join(name);
    w.write_to_path(&path).unwrap();
    path
}

/// The run failed with exit status 1 and one `error:` line on stderr
/// containing every one of `needles`.
fn assert_clean_error(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "expected exit status 1, got {} (stderr: {stderr})",
        out.status
    );
    let line = stderr
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_else(|| panic!("no error line in {stderr}"));
    for n in needles {
        assert!(line.contains(n), "{n:?} missing from {line:?}");
    }
}

#[test]
fn a_huge_block_count_is_reported_by_inspect_and_refused_by_generate() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write_tiny(dir.path(), "blocks.gguf", |md| {
        md.insert("llama.block_count", Value::U32(u32::MAX));
    });
    let bad = bad.to_str().unwrap();
    let out = cli(&["inspect", "--json", bad]);
    assert!(out.status.success());
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["block_count"], u32::MAX as u64);
    let m = r["tensor_mismatches"]
        .as_array()
        .expect("tensor_mismatches");
    assert_eq!(m.len(), 1, "{m:?}");
    assert!(m[0].as_str().unwrap().contains("blk.2"), "{m:?}");
    let text = String::from_utf8(cli(&["inspect", bad]).stdout).unwrap();
    assert!(
        text.lines()
            .any(|l| l.contains("tensor mismatch:") && l.contains("llama.block_count")),
        "{text}"
    );

    for cmd in ["generate", "chat"] {
        let mut args = vec![cmd, "--model", bad, "--backend", "cpu"];
        if cmd == "generate" {
            args.extend(["--prompt", "hi", "--max-tokens", "2"]);
        }
        assert_clean_error(&cli(&args), &["llama.block_count", "4294967295"]);
    }

    // A consistent file reports no mismatch.
    let good = write_tiny(dir.path(), "good.gguf", |_| {});
    let out = cli(&["inspect", "--json", good.to_str().unwrap()]);
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["tensor_mismatches"], serde_json::json!([]));
}

#[test]
fn a_context_beyond_the_trained_one_is_refused_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let m = write_tiny(dir.path(), "tiny.gguf", |_| {});
    let m = m.to_str().unwrap();
    let args = [
        "generate",
        "--model",
        m,
        "--backend",
        "cpu",
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
    ];
    let mut big = args.to_vec();
    big.extend(["--ctx-size", "1000000000"]);
    assert_clean_error(&cli(&big), &["1000000000", "256", "context_length"]);
    let mut fits = args.to_vec();
    fits.extend(["--ctx-size", "256"]);
    let out = cli(&fits);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn sampling_and_thread_counts_out_of_range_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let m = write_tiny(dir.path(), "tiny.gguf", |_| {});
    let m = m.to_str().unwrap();
    let cpus = std::thread::available_parallelism().unwrap().get();
    let too_many = (cpus + 1).to_string();
    for (flag, value, needle) in [
        ("--temp", "nan", "temperature"),
        ("--temp=-1", "", "temperature"),
        ("--temp", "inf", "temperature"),
        ("--top-p", "5", "top_p"),
        ("--top-p", "0", "top_p"),
        ("--min-p", "2", "min_p"),
        ("--repeat-penalty", "0", "repeat_penalty"),
        ("--presence-penalty", "nan", "presence_penalty"),
        ("--threads", too_many.as_str(), "CPUs"),
    ] {
        let mut args = vec![
            "generate",
            "--model",
            m,
            "--backend",
            "cpu",
            "--prompt",
            "hi",
            flag,
        ];
        if !value.is_empty() {
            args.push(value);
        }
        let out = cli(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}: {stderr}");
        assert!(
            stderr.contains("error: invalid value") && stderr.contains(needle),
            "{flag} {value}: {stderr}"
        );
    }
    let out = cli(&[
        "generate",
        "--model",
        m,
        "--backend",
        "cpu",
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
        "--temp",
        "0",
        "--top-p",
        "1",
        "--threads",
        "1",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The real SmolLM2 model, or `None` (saying why) when model tests are skipped.
fn smollm2() -> Option<PathBuf> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/smollm2-135m-instruct-q4_1.gguf");
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

#[cfg(unix)]
#[test]
fn a_quantize_killed_midway_leaves_a_temporary_the_next_run_removes() {
    let Some(model) = smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q8.gguf");
    let args = [
        "quantize",
        model.to_str().unwrap(),
        out.to_str().unwrap(),
        "--type",
        "q8_0",
    ];
    let temporaries = || -> Vec<PathBuf> {
        std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with(".q8.gguf.tmp-")
            })
            .collect()
    };
    // SIGKILL while the output is being written (retried if a run finishes
    // between two polls).
    let mut killed_midway = false;
    for _ in 0..10 {
        let mut child = Command::new(env!("CARGO_BIN_EXE_mirage-cli"))
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut seen = false;
        while child.try_wait().unwrap().is_none() {
            if !temporaries().is_empty() {
                seen = true;
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let _ = child.kill();
        child.wait().unwrap();
        if seen && !out.exists() && !temporaries().is_empty() {
            killed_midway = true;
            break;
        }
        let _ = std::fs::remove_file(&out);
    }
    assert!(killed_midway, "never caught quantize while it wrote");
    let stale = temporaries();
    assert_eq!(stale.len(), 1, "{stale:?}");
    // The next run removes it and writes the output.
    let again = cli(&args);
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert!(temporaries().is_empty(), "left: {:?}", temporaries());
    assert!(out.is_file());
}

#[test]
fn a_broken_or_hostile_chat_template_is_a_template_error() {
    let dir = tempfile::tempdir().unwrap();
    for (name, template, needles) in [
        (
            "broken.gguf",
            "{% for m in messages %}{{ m.content }",
            &["chat template error", "syntax error"][..],
        ),
        (
            "doubling.gguf",
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
            &["chat template error", "limit"][..],
        ),
    ] {
        let m = write_tiny(dir.path(), name, |md| {
            md.insert("tokenizer.chat_template", Value::String(template.into()));
        });
        let out = cli(&[
            "generate", "--model", m.to_str().unwrap(), "--backend", "cpu", "--prompt", "hi",
            "--chat", "--max-tokens", "2",
        ]);
        assert_clean_error(&out, needles);
    }
}
