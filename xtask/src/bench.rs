//! `cargo xtask bench cpu`: MIRAGE's CPU engine against llama.cpp's
//! `llama-bench` on the same GGUF files, the same thread count and the same
//! test shapes, in one run.
//!
//! - Models: the given GGUF (default SmolLM2-135M Q4_1 as shipped) and a
//!   Q8_0 re-quantization of it made with `mirage-cli quantize` (cached under
//!   target/bench/).
//! - llama.cpp: `scripts/build_llamacpp.sh` builds `llama-bench` under
//!   target/llamacpp/ (once); it runs as `llama-bench -m FILE -p PP -n TG
//!   -t N -r REPS -o json`, and the median of its `samples_ts` is taken.
//! - MIRAGE runs in this process (xtask is built in release): `pp`: one
//!   prefill of PP prompt tokens into an empty f16 KV cache (llama-bench's
//!   default cache type), logits of the last token only; `tg`: TG single-token
//!   decode steps from an empty cache, each feeding the previous argmax. One
//!   warm-up run, then the median of REPS timed runs, as llama-bench does.
//!
//! The two engines share the machine in turn, never at once. A loaded
//! machine (load average above the core count) makes both numbers noise, so
//! the load is printed with the table.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use mirage_runtime::{Engine, EngineOptions, KvDtype};

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

#[derive(Debug, Args)]
struct CpuArgs {
    /// GGUF model (default: models/smollm2-135m-instruct-q4_1.gguf). A Q8_0
    /// re-quantization of it is benchmarked too unless --no-q8.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Threads for both engines (default: one per logical CPU).
    #[arg(long)]
    threads: Option<usize>,
    /// Prompt tokens of the prefill test.
    #[arg(long, default_value_t = 128)]
    pp: usize,
    /// Generated tokens of the decode test.
    #[arg(long, default_value_t = 128)]
    tg: usize,
    /// Timed repetitions per test (the median is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Skip the Q8_0 re-quantized model.
    #[arg(long)]
    no_q8: bool,
    /// Run MIRAGE only (no llama.cpp build or run).
    #[arg(long)]
    no_llamacpp: bool,
}

/// One (model, test) measurement.
struct Row {
    model: String,
    test: String,
    mirage: f64,
    llamacpp: Option<f64>,
}

/// Runs `cargo xtask bench ...`.
pub fn run(args: &BenchArgs, root: &Path) -> anyhow::Result<()> {
    match &args.target {
        BenchTarget::Cpu(a) => bench_cpu(a, root),
    }
}

fn bench_cpu(a: &CpuArgs, root: &Path) -> anyhow::Result<()> {
    if a.pp == 0 || a.tg == 0 || a.reps == 0 {
        bail!("--pp, --tg and --reps must be at least 1");
    }
    let threads = a.threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    let source = a
        .model
        .clone()
        .unwrap_or_else(|| root.join("models/smollm2-135m-instruct-q4_1.gguf"));
    if !source.exists() {
        bail!(
            "{} is missing: run `cargo xtask fetch-models`",
            source.display()
        );
    }
    let mut models = vec![source.clone()];
    if !a.no_q8 {
        models.push(requantized_q8_0(&source, root)?);
    }
    let llama_bench = if a.no_llamacpp {
        None
    } else {
        Some(llama_bench(root)?)
    };
    let load_before = load_average();

    let mut rows = Vec::new();
    for model in &models {
        let label = model_label(model);
        eprintln!(
            "MIRAGE    {label}: pp{} / tg{}, {threads} threads, {} reps",
            a.pp, a.tg, a.reps
        );
        let (pp, tg) = mirage_speeds(model, threads, a.pp, a.tg, a.reps)?;
        let (lpp, ltg) = match &llama_bench {
            Some(bin) => {
                eprintln!(
                    "llama.cpp {label}: llama-bench -p {} -n {} -t {threads} -r {}",
                    a.pp, a.tg, a.reps
                );
                let (p, t) = llamacpp_speeds(bin, model, threads, a.pp, a.tg, a.reps)?;
                (Some(p), Some(t))
            }
            None => (None, None),
        };
        rows.push(Row {
            model: label.clone(),
            test: format!("pp{}", a.pp),
            mirage: pp,
            llamacpp: lpp,
        });
        rows.push(Row {
            model: label,
            test: format!("tg{}", a.tg),
            mirage: tg,
            llamacpp: ltg,
        });
    }

    println!();
    println!("| model | test | MIRAGE tok/s | llama.cpp tok/s | MIRAGE / llama.cpp |");
    println!("|---|---|---:|---:|---:|");
    for r in &rows {
        let (l, ratio) = match r.llamacpp {
            Some(l) => (format!("{l:.1}"), format!("{:.2}x", r.mirage / l)),
            None => ("-".into(), "-".into()),
        };
        println!(
            "| {} | {} | {:.1} | {l} | {ratio} |",
            r.model, r.test, r.mirage
        );
    }
    println!();
    println!(
        "threads {threads}, median of {} runs each; load average before {} / after {} on {} logical CPUs{}",
        a.reps,
        load_before.map_or("?".into(), |l| format!("{l:.2}")),
        load_average().map_or("?".into(), |l| format!("{l:.2}")),
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        match load_before {
            Some(l) if l > threads as f64 => " (LOADED: numbers are not reliable)",
            _ => "",
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

/// The 1-minute load average (Linux), if readable.
fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// target/bench/<stem>-q8_0.gguf, made once with `mirage-cli quantize`.
fn requantized_q8_0(source: &Path, root: &Path) -> anyhow::Result<PathBuf> {
    let stem = model_label(source);
    let base = stem.rsplit_once('-').map_or(stem.as_str(), |(b, _)| b);
    let out = root.join("target/bench").join(format!("{base}-q8_0.gguf"));
    if out.exists() {
        return Ok(out);
    }
    std::fs::create_dir_all(out.parent().unwrap_or(root))?;
    eprintln!(
        "building mirage-cli to re-quantize {} to Q8_0",
        source.display()
    );
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["build", "--release", "--quiet", "-p", "mirage-cli"])
        .current_dir(root)
        .status()
        .context("running cargo build -p mirage-cli")?;
    if !status.success() {
        bail!("cargo build -p mirage-cli failed");
    }
    let status = Command::new(root.join("target/release/mirage-cli"))
        .arg("quantize")
        .arg(source)
        .arg(&out)
        .args(["--type", "q8_0"])
        .status()
        .context("running mirage-cli quantize")?;
    if !status.success() {
        bail!("mirage-cli quantize {} failed", source.display());
    }
    Ok(out)
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

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// MIRAGE's (prompt tok/s, decode tok/s), medians of `reps` after a warm-up.
fn mirage_speeds(
    model: &Path,
    threads: usize,
    pp: usize,
    tg: usize,
    reps: usize,
) -> anyhow::Result<(f64, f64)> {
    let options = EngineOptions {
        threads,
        n_ctx: pp.max(tg) + 8,
        kv_dtype: KvDtype::F16,
        ..EngineOptions::default()
    };
    let engine =
        Engine::load(model, options).with_context(|| format!("loading {}", model.display()))?;
    // Real text, repeated to length: the speed does not depend on the ids.
    let text =
        "The quick brown fox jumps over the lazy dog. Benchmarks measure what they measure. ";
    let mut prompt = engine.encode(&text.repeat(pp / 8 + 2), false)?;
    prompt.truncate(pp);
    if prompt.len() < pp {
        bail!("could not build a {pp}-token prompt");
    }
    let mut session = engine.session()?;
    let mut pp_speeds = Vec::new();
    for rep in 0..=reps {
        session.reset();
        let t = Instant::now();
        session.feed(&prompt)?;
        if rep > 0 {
            pp_speeds.push(pp as f64 / t.elapsed().as_secs_f64());
        }
    }
    let mut tg_speeds = Vec::new();
    for rep in 0..=reps {
        session.reset();
        let mut token = prompt[0];
        let t = Instant::now();
        for _ in 0..tg {
            let logits = session.feed(&[token])?;
            token = mirage_runtime::sampling::greedy(logits);
        }
        if rep > 0 {
            tg_speeds.push(tg as f64 / t.elapsed().as_secs_f64());
        }
    }
    Ok((median(pp_speeds), median(tg_speeds)))
}

/// llama-bench's (prompt tok/s, decode tok/s): medians of its samples.
fn llamacpp_speeds(
    bin: &Path,
    model: &Path,
    threads: usize,
    pp: usize,
    tg: usize,
    reps: usize,
) -> anyhow::Result<(f64, f64)> {
    let out = Command::new(bin)
        .arg("-m")
        .arg(model)
        .args([
            "-p",
            &pp.to_string(),
            "-n",
            &tg.to_string(),
            "-t",
            &threads.to_string(),
            "-r",
            &reps.to_string(),
            "-o",
            "json",
        ])
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    if !out.status.success() {
        bail!(
            "llama-bench failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let json: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("parsing llama-bench JSON")?;
    let tests = json
        .as_array()
        .context("llama-bench JSON is not an array")?;
    let speed = |prompt: bool| -> anyhow::Result<f64> {
        let t = tests
            .iter()
            .find(|t| {
                let (np, ng) = (
                    t["n_prompt"].as_u64().unwrap_or(0),
                    t["n_gen"].as_u64().unwrap_or(0),
                );
                if prompt {
                    np as usize == pp && ng == 0
                } else {
                    np == 0 && ng as usize == tg
                }
            })
            .with_context(|| {
                format!(
                    "llama-bench output has no {} test",
                    if prompt { "pp" } else { "tg" }
                )
            })?;
        let samples: Vec<f64> = t["samples_ts"]
            .as_array()
            .context("llama-bench test without samples_ts")?
            .iter()
            .filter_map(|v| v.as_f64())
            .collect();
        if samples.is_empty() {
            bail!("llama-bench test with empty samples_ts");
        }
        Ok(median(samples))
    };
    Ok((speed(true)?, speed(false)?))
}
