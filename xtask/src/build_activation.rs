//! `cargo xtask build-artifacts --mode activation`: the activation-sparsity
//! artifact (channel-major projections, thresholds, allocation plans) with
//! progress bars and a summary.

use std::time::Instant;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use mirage_artifact::activation::build::{build_activation, ActivationBuildOptions};
use mirage_artifact::activation::fit::GreedyOptions;
use mirage_artifact::activation::format::ActivationArtifact;
use mirage_artifact::activation::SparsityTarget;
use mirage_artifact::BuildEvent;

use crate::build_artifacts::BuildArtifactsArgs;

/// Where the activation artifact of `model` goes by default.
pub fn default_path(model: &std::path::Path) -> std::path::PathBuf {
    model.with_extension("activation.mirage")
}

/// The default calibration text: the system Python's argparse.py (the
/// newest /usr/lib/python3.*), else Debian's GPL-3. Measured on the shipped
/// models, code calibrates better than the GPL: the models have the GPL by
/// heart (calibration perplexity 1.54 on the 1.5B against 4.95 on held-out
/// Python), so perplexity on it says little about held-out text.
fn default_calib() -> std::path::PathBuf {
    let mut found: Vec<std::path::PathBuf> = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3."))
        .map(|e| e.path().join("argparse.py"))
        .filter(|p| p.is_file())
        .collect();
    // python3.9 < python3.11: order by the minor version, not by name.
    found.sort_by_key(|p| {
        p.parent()
            .and_then(|d| d.file_name())
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("python3."))
            .and_then(|m| m.parse::<u32>().ok())
    });
    found
        .pop()
        .unwrap_or_else(|| crate::build_artifacts::GPL3.into())
}

/// Runs the activation build.
pub fn run(args: &BuildArtifactsArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let calib = args.calib.clone().unwrap_or_else(default_calib);
    let calib_text =
        std::fs::read_to_string(&calib).with_context(|| format!("reading {}", calib.display()))?;
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| default_path(&args.model));
    let opts = ActivationBuildOptions {
        calib_name: calib.display().to_string(),
        calib_text,
        calib_tokens: args.calib_tokens,
        greedy_tokens: args.greedy_tokens,
        ppl_tokens: args.ppl_tokens,
        greedy: GreedyOptions {
            step: args.greedy_step,
            ..GreedyOptions::default()
        },
        threads: args.threads,
        statistics_only: args.statistics_only,
        ..ActivationBuildOptions::default()
    };
    let style =
        ProgressStyle::with_template("{prefix:>13} [{bar:40}] {pos}/{len} {elapsed} eta {eta}")
            .expect("template")
            .progress_chars("=> ");
    let mut bar: Option<ProgressBar> = None;
    let built = build_activation(&args.model, &opts, &mut |ev| match ev {
        BuildEvent::Stage { name, total } => {
            if let Some(b) = bar.take() {
                b.finish();
            }
            bar = Some(
                ProgressBar::new(total as u64)
                    .with_style(style.clone())
                    .with_prefix(name),
            );
        }
        BuildEvent::Step => {
            if let Some(b) = &bar {
                b.inc(1);
            }
        }
    })
    .with_context(|| {
        format!(
            "building an activation artifact from {}",
            args.model.display()
        )
    })?;
    if let Some(b) = bar.take() {
        b.finish();
    }
    mirage_artifact::format::write_atomic(&out, &built.bytes)?;
    let loaded = ActivationArtifact::open(&out).context("validating the written artifact")?;
    let m = loaded.meta();
    println!(
        "model {} ({}), {} layers; projections and head {:.1} MiB in the source, {:.1} MiB channel-major ({:+.2} %)",
        m.source_name,
        m.arch,
        m.n_layer,
        built.source_bytes as f64 / (1 << 20) as f64,
        built.repacked_bytes as f64 / (1 << 20) as f64,
        100.0 * (built.repacked_bytes as f64 / built.source_bytes as f64 - 1.0)
    );
    println!(
        "calibration: {} ({} tokens for the statistics, {} for sensitivities and perplexity), dense calibration ppl {:.4}",
        m.calib_name, m.calib_tokens, m.ppl_tokens, m.dense_calib_ppl
    );
    let n = built.kappa.len();
    if n > 0 {
        println!(
            "sensitivity (KL per unit of error energy) per layer: q k v o gate up down; head {:.3e}",
            built.kappa[n - 1]
        );
    }
    for l in (0..m.n_layer).filter(|_| n > 0) {
        let k = &built.kappa[l * 7..l * 7 + 7];
        println!(
            "  layer {l:>2}: {}",
            k.iter()
                .map(|v| format!("{v:.2e}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    for (name, ppl) in &built.plan_ppl {
        if ppl.iter().skip(1).all(|p| p.is_nan()) {
            continue;
        }
        let (pm, _) = loaded.plan(name).expect("built plan");
        println!(
            "plan {name}{}: calibration perplexity per target",
            if *name == m.default_plan {
                " (the default on ties)"
            } else {
                ""
            }
        );
        for (s, p) in pm.targets.iter().zip(ppl) {
            println!(
                "  {s:.2}  {p:.4} ({:+.2} %)",
                100.0 * (*p as f64 / m.dense_calib_ppl - 1.0)
            );
        }
    }
    for budget in [0.01f32, 0.03] {
        match loaded.resolve(None, SparsityTarget::MaxPplIncrease(budget)) {
            Ok(r) => println!(
                "  --sparsity auto --max-ppl-increase {}% picks {:.2} ({})",
                100.0 * budget,
                r.sparsity,
                r.plan
            ),
            Err(e) => println!("  --max-ppl-increase {}%: {e}", 100.0 * budget),
        }
    }
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
