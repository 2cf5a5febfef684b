//! `cargo xtask build-artifacts`: builds a page-major MIRAGE artifact from a
//! GGUF model and a calibration text (see docs/ARTIFACT.md), with progress
//! bars and a summary table.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use mirage_artifact::budget::parse_size;
use mirage_artifact::{build, BuildEvent, BuildOptions};
use mirage_gguf::GgmlType;

/// Arguments of `cargo xtask build-artifacts`.
#[derive(Debug, clap::Args)]
pub struct BuildArtifactsArgs {
    /// The source GGUF model.
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// Calibration text; keep evaluation text disjoint. Default: pages mode
    /// /usr/share/common-licenses/GPL-3; activation mode the system Python's argparse.py
    /// (/usr/lib/python3.*/argparse.py: code, which the models have not memorized as they have the
    /// GPL, so its perplexities predict held-out text), else GPL-3.
    #[arg(long)]
    pub(crate) calib: Option<PathBuf>,
    /// Output file (default: next to the model, `<stem>.mirage`).
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
    /// Page quantization: q8_0 or q2_k (q2_k falls back to q8_0 where d_model % 256 != 0).
    #[arg(long, default_value = "q8_0")]
    quant: String,
    /// Size budget of the artifact (e.g. 7.2GiB, 300MB): the solver picks pages and quant per layer.
    #[arg(long)]
    budget: Option<String>,
    /// Most calibration tokens.
    #[arg(long, default_value_t = 2048)]
    pub(crate) max_tokens: usize,
    /// Router slices (3-D points per token).
    #[arg(long, default_value_t = 4)]
    slices: usize,
    /// Rank of the predictor baseline.
    #[arg(long, default_value_t = 16)]
    rank: usize,
    /// Oracle frequency at which a page joins the always-on trunk.
    #[arg(long, default_value_t = 0.9)]
    trunk_freq: f32,
    /// CPU threads (0: all).
    #[arg(long, default_value_t = 0)]
    pub(crate) threads: usize,
    /// `pages` (page-major FFN pages and router) or `activation` (every projection channel-major, with
    /// thresholds and allocation plans for `--sparsity`).
    #[arg(long, default_value = "pages", value_parser = ["pages", "activation"])]
    mode: String,
    /// Activation mode: calibration tokens whose projection inputs give the thresholds.
    #[arg(long, default_value_t = 512)]
    pub(crate) calib_tokens: usize,
    /// Activation mode: positions each layer's greedy search runs on.
    #[arg(long, default_value_t = 64)]
    pub(crate) greedy_tokens: usize,
    /// Activation mode: calibration tokens the sensitivities and perplexities are measured on.
    #[arg(long, default_value_t = 256)]
    pub(crate) ppl_tokens: usize,
    /// Activation mode: layer sparsity one step of TEAL's greedy search (the baseline plan) adds.
    #[arg(long, default_value_t = 0.05)]
    pub(crate) greedy_step: f32,
    /// Activation mode: thresholds from the calibration statistics alone (uniform plans; no
    /// sensitivities, greedy search or sparse perplexities). For speed measurements on synthetic
    /// models, whose fidelity means nothing: seconds instead of minutes on a 7B shape.
    #[arg(long)]
    pub(crate) statistics_only: bool,
}

/// Debian's GPL-3 text (base-files: on every Debian machine).
pub(crate) const GPL3: &str = "/usr/share/common-licenses/GPL-3";

/// Runs the task.
pub fn run(args: &BuildArtifactsArgs, _root: &Path) -> anyhow::Result<()> {
    if args.mode == "activation" {
        return crate::build_activation::run(args);
    }
    let started = Instant::now();
    let quant = match args.quant.to_ascii_lowercase().as_str() {
        "q8_0" => GgmlType::Q8_0,
        "q2_k" => GgmlType::Q2_K,
        q => anyhow::bail!("--quant {q}: expected q8_0 or q2_k"),
    };
    let calib = args.calib.clone().unwrap_or_else(|| PathBuf::from(GPL3));
    let calib_text =
        std::fs::read_to_string(&calib).with_context(|| format!("reading {}", calib.display()))?;
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| args.model.with_extension("mirage"));
    let opts = BuildOptions {
        calib_name: calib.display().to_string(),
        calib_text,
        max_calib_tokens: args.max_tokens,
        quant,
        slices: args.slices,
        predictor_rank: args.rank,
        trunk_freq: args.trunk_freq,
        budget_bytes: args.budget.as_deref().map(parse_size).transpose()?,
        threads: args.threads,
        ..BuildOptions::default()
    };
    let style =
        ProgressStyle::with_template("{prefix:>13} [{bar:40}] {pos}/{len} {elapsed} eta {eta}")
            .expect("template")
            .progress_chars("=> ");
    let mut bar: Option<ProgressBar> = None;
    let built = build(&args.model, &opts, &mut |ev| match ev {
        BuildEvent::Stage { name, total } => {
            if let Some(b) = bar.take() {
                b.finish();
            }
            let b = ProgressBar::new(total as u64)
                .with_style(style.clone())
                .with_prefix(name);
            bar = Some(b);
        }
        BuildEvent::Step => {
            if let Some(b) = &bar {
                b.inc(1);
            }
        }
    })
    .with_context(|| format!("building an artifact from {}", args.model.display()))?;
    if let Some(b) = bar.take() {
        b.finish();
    }
    mirage_artifact::format::write_atomic(&out, &built.bytes)?;
    // Load it back: the loader validates every section.
    let loaded =
        mirage_artifact::Artifact::open(&out).context("validating the written artifact")?;
    let m = loaded.meta();
    for n in &built.notes {
        println!("note: {n}");
    }
    if let Some(plan) = &built.plan {
        println!(
            "budget plan ({} bytes budget, {} bytes upper bound):",
            plan.budget, plan.total_bytes
        );
        for (l, p) in plan.layers.iter().enumerate() {
            println!(
                "  layer {l:>2}: {:>3} pages  {:<5} est. loss {:.5}",
                p.pages,
                p.quant.name(),
                p.est_loss
            );
        }
    }
    println!("layer  pages  trunk  routed  quant  oracle/token  bytes");
    for (l, s) in built.layers.iter().enumerate() {
        println!(
            "{l:>5}  {:>2}/{:<2}  {:>5}  {:>6}  {:<5}  {:>12.2}  {}",
            s.pages,
            s.source_pages,
            s.trunk,
            s.pages - s.trunk,
            s.quant.name(),
            s.mean_oracle_pages,
            s.page_bytes
        );
    }
    println!(
        "model {} ({}), {} layers, d_model {}, n_ff {} = {} pages/layer",
        m.source_name,
        m.arch,
        m.n_layer,
        m.d_model,
        m.n_ff,
        m.n_ff / m.page_channels
    );
    println!(
        "calibration: {} ({} tokens, {} fit / {} validation), sha256 {}",
        m.calib_name,
        m.calib_tokens,
        m.fit_tokens,
        m.calib_tokens - m.fit_tokens,
        &m.calib_sha256[..16]
    );
    println!(
        "defaults from validation tokens: BVH margin {} (recall {:.4}), predictor threshold {} (recall {:.4})",
        m.default_margin, built.validation_bvh_recall, m.default_predictor_threshold, built.validation_predictor_recall
    );
    for (stage, secs) in &built.timings {
        println!("  {stage:<13} {secs:>7.1} s");
    }
    println!(
        "wrote {} ({:.1} MiB) in {:.1} s",
        out.display(),
        built.bytes.len() as f64 / (1024.0 * 1024.0),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
