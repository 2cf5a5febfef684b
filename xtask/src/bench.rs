//! `cargo xtask bench cpu`: MIRAGE's CPU engine against llama.cpp's
//! `llama-bench` on the real models, one table from one run.
//!
//! - Models: the given GGUF files, or by default every one of SmolLM2-135M
//!   (Q4_1), Qwen2.5-Coder-0.5B and -1.5B (Q4_K_M) present in models/ (a
//!   missing one is named, with the fetch command).
//! - llama.cpp: `scripts/build_llamacpp.sh` builds `llama-bench` under
//!   target/llamacpp/ (once).
//! - Each model is measured by `mirage-cli bench --backend cpu --llamacpp
//!   BIN --json` (built here in release): the two engines alternate on
//!   llama-bench's tests — `ppN` prefills into an empty f16 KV cache, `tgN`
//!   decode steps from an empty cache — `--reps` times, and the medians,
//!   their ratio and decode's share of the machine's copy bandwidth (a
//!   memcpy with the same thread count, measured in that process) are
//!   reported with the load average around every repetition.
//!
//! A loaded machine (load average above the thread count) makes both
//! numbers noise, llama.cpp's (spinning worker threads) more than ours; the
//! table says so when it happens.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};

/// Arguments of `cargo xtask bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    target: BenchTarget,
}

#[derive(Debug, Subcommand)]
enum BenchTarget {
    /// MIRAGE CPU vs llama.cpp (llama-bench): prompt and decode tok/s and their ratio.
    Cpu(CpuArgs),
}

/// The default models (file names in models/ and the fetch ids).
const DEFAULT_MODELS: [(&str, &str); 3] = [
    ("smollm2-135m-instruct-q4_1.gguf", "smollm2"),
    ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen2.5-coder"),
    (
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "qwen2.5-coder-1.5b",
    ),
];

#[derive(Debug, Args)]
struct CpuArgs {
    /// GGUF models (repeatable; default: SmolLM2, Qwen2.5-Coder-0.5B and
    /// -1.5B from models/).
    #[arg(long)]
    model: Vec<PathBuf>,
    /// Threads for both engines (default: one per logical CPU).
    #[arg(long)]
    threads: Option<usize>,
    /// Prompt sizes of the prefill tests, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "128,512")]
    pp: Vec<usize>,
    /// Decode steps of the decode test.
    #[arg(long, default_value_t = 64)]
    tg: usize,
    /// Alternating repetitions per model (the median is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
}

/// Runs `cargo xtask bench ...`.
pub fn run(args: &BenchArgs, root: &Path) -> anyhow::Result<()> {
    match &args.target {
        BenchTarget::Cpu(a) => bench_cpu(a, root),
    }
}

fn bench_cpu(a: &CpuArgs, root: &Path) -> anyhow::Result<()> {
    if a.pp.is_empty() || a.pp.contains(&0) || a.tg == 0 || a.reps == 0 {
        bail!("--pp sizes, --tg and --reps must be at least 1");
    }
    let threads = a.threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    let models: Vec<PathBuf> = if a.model.is_empty() {
        let mut found = Vec::new();
        for (file, id) in DEFAULT_MODELS {
            let p = root.join("models").join(file);
            if p.exists() {
                found.push(p);
            } else {
                eprintln!("skipping {file}: missing (cargo xtask fetch-models --only {id})");
            }
        }
        found
    } else {
        a.model.clone()
    };
    if models.is_empty() {
        bail!("no model to benchmark: run `cargo xtask fetch-models`");
    }
    for m in &models {
        if !m.exists() {
            bail!("{} is missing", m.display());
        }
    }
    let llama_bench = llama_bench(root)?;
    let cli = mirage_cli(root)?;
    let pp =
        a.pp.iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(",");

    let mut reports = Vec::new();
    for model in &models {
        eprintln!(
            "{}: MIRAGE and llama-bench alternating, pp {pp} / tg {}, {threads} threads, {} reps",
            model_label(model),
            a.tg,
            a.reps
        );
        let out = Command::new(&cli)
            .args(["bench", "--backend", "cpu", "--json", "--llamacpp"])
            .arg(&llama_bench)
            .arg("--model")
            .arg(model)
            .args([
                "--threads",
                &threads.to_string(),
                "--pp",
                &pp,
                "--gen",
                &a.tg.to_string(),
                "--reps",
                &a.reps.to_string(),
            ])
            .current_dir(root)
            .stderr(std::process::Stdio::inherit())
            .output()
            .context("running mirage-cli bench")?;
        if !out.status.success() {
            bail!("mirage-cli bench --llamacpp failed on {}", model.display());
        }
        let report: serde_json::Value =
            serde_json::from_slice(&out.stdout).context("parsing mirage-cli bench --json")?;
        reports.push((model_label(model), report));
    }

    println!();
    println!(
        "| model | test | MIRAGE tok/s | llama.cpp tok/s | MIRAGE / llama.cpp | decode share of copy (MIRAGE / llama.cpp) |"
    );
    println!("|---|---|---:|---:|---:|---:|");
    let mut loads = Vec::new();
    for (label, r) in &reports {
        let copy = r["copy_gb_s"].as_f64().unwrap_or(f64::NAN) * 1e9;
        let bytes = r["weight_bytes_per_token"].as_f64().unwrap_or(f64::NAN);
        for row in r["rows"].as_array().into_iter().flatten() {
            let test = row["test"].as_str().unwrap_or("?");
            let (m, l) = (
                row["mirage"].as_f64().unwrap_or(f64::NAN),
                row["llamacpp"].as_f64().unwrap_or(f64::NAN),
            );
            let share = if test.starts_with("tg") {
                format!(
                    "{:.0}% / {:.0}%",
                    100.0 * bytes * m / copy,
                    100.0 * bytes * l / copy
                )
            } else {
                "-".into()
            };
            println!(
                "| {label} | {test} | {m:.1} | {l:.1} | {:.2}x | {share} |",
                m / l
            );
        }
        loads.extend(
            r["load"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_f64()),
        );
    }
    println!();
    if let Some((_, r)) = reports.first() {
        println!(
            "threads {threads}, median of {} alternating runs per model; llama.cpp {} (llama-cpp-python sdist); copy bandwidth {:.1} GB/s (memcpy, {threads} threads, read + written)",
            a.reps,
            r["llamacpp_commit"].as_str().unwrap_or("?"),
            r["copy_gb_s"].as_f64().unwrap_or(f64::NAN)
        );
    }
    let max = loads.iter().copied().fold(f64::NAN, f64::max);
    println!(
        "load average (1 min) around the runs: {} on {} logical CPUs{}",
        loads
            .iter()
            .map(|l| format!("{l:.2}"))
            .collect::<Vec<_>>()
            .join(" "),
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        if max > threads as f64 {
            " (LOADED: numbers are not reliable)"
        } else {
            ""
        }
    );
    Ok(())
}

/// `smollm2-135m-instruct-q4_1.gguf` -> `smollm2-135m-instruct-q4_1`.
fn model_label(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

/// target/release/mirage-cli, built (release) here.
fn mirage_cli(root: &Path) -> anyhow::Result<PathBuf> {
    eprintln!("building mirage-cli (release)");
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["build", "--release", "--quiet", "-p", "mirage-cli"])
        .current_dir(root)
        .status()
        .context("running cargo build -p mirage-cli")?;
    if !status.success() {
        bail!("cargo build -p mirage-cli failed");
    }
    Ok(root.join("target/release/mirage-cli"))
}

/// target/llamacpp/build/bin/llama-bench, built by scripts/build_llamacpp.sh
/// when missing.
fn llama_bench(root: &Path) -> anyhow::Result<PathBuf> {
    let bin = root.join("target/llamacpp/build/bin/llama-bench");
    if bin.exists() {
        return Ok(bin);
    }
    eprintln!("building llama.cpp's llama-bench (scripts/build_llamacpp.sh; takes a while once)");
    let status = Command::new("bash")
        .arg(root.join("scripts/build_llamacpp.sh"))
        .current_dir(root)
        .status()
        .context("running scripts/build_llamacpp.sh")?;
    if !status.success() || !bin.exists() {
        bail!(
            "scripts/build_llamacpp.sh did not produce {}",
            bin.display()
        );
    }
    Ok(bin)
}
