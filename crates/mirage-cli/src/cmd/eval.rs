//! `mirage-cli eval`: fidelity of an artifact's sparse FFN on held-out text.
//!
//! Router metrics (recall, rejection, active pages per token) are computed
//! on the dense model's FFN inputs for the BVH router (margin sweep), the
//! low-rank predictor (threshold sweep) and the oracle; then, for the
//! cheapest setting of each that meets the recall gate, the superblock
//! backend runs the whole text and its logits are compared with dense
//! (cosine, top-1 agreement, perplexity). `--oracle-top` adds runs at fixed
//! active fractions with each token's largest-output pages: the bound on
//! any router over these pages. Metric definitions: `mirage_artifact::metrics`.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use mirage_artifact::build::{MARGIN_GRID, THRESHOLD_GRID};
use mirage_artifact::ffn::FfnF32;
use mirage_artifact::metrics::{self, cosine, COSINE_GATE, ORACLE_COSINE, RECALL_GATE};
use mirage_artifact::pack::unpack_pages;
use mirage_artifact::superblock::PageSelector;
use mirage_artifact::{pages_for_fraction, Artifact, SparseMode, PAGE_CHANNELS};
use mirage_gguf::GgufFile;
use mirage_runtime::backend::TokenSlot;
use mirage_runtime::observe::observe_ffn_inputs;
use mirage_runtime::{Backend, KvDtype, Model};
use rayon::prelude::*;
use serde_json::json;

/// Arguments of `eval`.
#[derive(Debug, Args)]
pub struct EvalArgs {
    /// The artifact (from `cargo xtask build-artifacts`; with --sparsity, an activation artifact).
    #[arg(long)]
    artifact: PathBuf,
    /// Held-out text (must not overlap the calibration text).
    #[arg(short = 'f', long, alias = "file")]
    text: PathBuf,
    /// The source GGUF (default: models/<name recorded in the artifact>).
    #[arg(short = 'm', long)]
    model: Option<PathBuf>,
    /// Most tokens of the text to evaluate.
    #[arg(long = "max-tokens", default_value_t = 512)]
    max_tokens: usize,
    /// Worker threads (0: all).
    #[arg(short = 't', long, default_value_t = 0)]
    threads: usize,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
    /// Most full sparse runs per router while searching the cheapest setting that meets the cosine gate.
    #[arg(long = "max-fidelity-runs", default_value_t = 4)]
    max_fidelity_runs: usize,
    /// Write SVG charts (recall vs rejection, active fraction per layer) here.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Also run these fixed active fractions (comma-separated, each in (0, 1]) with each token's
    /// largest-output pages, e.g. 0.75,0.5: the fidelity a router that knew every page's output
    /// could reach there, the bound on what any router can do with these pages.
    #[arg(long = "oracle-top", value_delimiter = ',')]
    oracle_top: Vec<f32>,
    /// Also run each --oracle-top fraction over groups of this many channels instead of whole pages
    /// (comma-separated divisors of 128, e.g. 1,8): what finer pages would keep.
    #[arg(
        long = "oracle-top-groups",
        value_delimiter = ',',
        requires = "oracle_top"
    )]
    oracle_top_groups: Vec<u16>,
    #[command(flatten)]
    activation: super::eval_activation::ActivationEvalArgs,
}

/// Group sizes (channels) at which `--oracle-top` also measures how much of
/// each layer's FFN output the largest-output groups keep: single channels
/// up to whole pages, to tell a dense FFN from pages that are too coarse.
const GROUP_CHANNELS: [usize; 4] = [1, 8, 32, PAGE_CHANNELS];

/// One token's page sets at one layer, from every page's output.
struct TokenOracle {
    /// Per oracle mode (the oracle, then each `--oracle-top` fraction), its pages.
    picked: Vec<Vec<usize>>,
    /// Per [`GROUP_CHANNELS`] size, per fraction: the layer's FFN output
    /// cosine with the largest-output groups kept.
    kept: Vec<Vec<f64>>,
}

/// Router metrics of one setting over all tokens and layers.
#[derive(Debug, Clone)]
struct Sweep {
    label: String,
    mode: SparseMode,
    recall: f64,
    rejection: f64,
    active_fraction: f64,
    /// Per layer: (recall, rejection, active counts per token).
    layers: Vec<(f64, f64, Vec<f64>)>,
}

/// Fidelity of one full sparse run.
#[derive(Debug, Clone)]
struct Fidelity {
    cosine: f64,
    top1: f64,
    ppl: f64,
    active_fraction: f64,
}

fn run_logits<B: Backend>(
    model: &Model<B>,
    tokens: &[u32],
    n_batch: usize,
) -> anyhow::Result<Vec<f32>> {
    let mut cache = model.new_kv_cache(tokens.len(), 1, KvDtype::F32)?;
    let mut scratch = model.new_scratch();
    let mut all = Vec::new();
    let mut logits = Vec::new();
    for (ci, chunk) in tokens.chunks(n_batch).enumerate() {
        let slots: Vec<TokenSlot> = (0..chunk.len())
            .map(|i| TokenSlot {
                seq: 0,
                pos: ci * n_batch + i,
            })
            .collect();
        let rows: Vec<usize> = (0..chunk.len()).collect();
        model.forward(chunk, &slots, &rows, &mut cache, &mut scratch, &mut logits)?;
        all.extend_from_slice(&logits);
    }
    Ok(all)
}

fn ppl(logits: &[f32], tokens: &[u32], vocab: usize) -> f64 {
    let n = tokens.len() - 1;
    let s: f64 = (0..n)
        .map(|i| metrics::nll(&logits[i * vocab..(i + 1) * vocab], tokens[i + 1] as usize))
        .sum();
    (s / n as f64).exp()
}

/// A progress bar for one stage of `eval` on stderr (hidden when stderr is
/// not a terminal).
fn stage_bar(name: &str, total: usize) -> ProgressBar {
    let style = ProgressStyle::with_template(
        "{prefix:>15} [{bar:40}] {pos}/{len} {elapsed} eta {eta} {msg}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    ProgressBar::new(total as u64)
        .with_style(style)
        .with_prefix(name.to_string())
}

/// Runs `eval`.
pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    if !args.activation.sparsity.is_empty() {
        return super::eval_activation::run(
            &args.artifact,
            &args.text,
            args.model.clone(),
            args.max_tokens,
            args.threads,
            args.json,
            &args.activation,
        );
    }
    if let Some(f) = args.oracle_top.iter().find(|f| !(**f > 0.0 && **f <= 1.0)) {
        bail!("--oracle-top {f}: each fraction must be in (0, 1]");
    }
    if let Some(g) = args
        .oracle_top_groups
        .iter()
        .find(|&&g| g == 0 || !PAGE_CHANNELS.is_multiple_of(g as usize))
    {
        bail!("--oracle-top-groups {g}: each group must divide a page of {PAGE_CHANNELS} channels");
    }
    let artifact = Artifact::open(&args.artifact)
        .with_context(|| format!("loading {}", args.artifact.display()))?;
    let meta = artifact.meta().clone();
    let model_path = args
        .model
        .clone()
        .unwrap_or_else(|| PathBuf::from("models").join(&meta.source_name));
    super::generate::check_model(&model_path)?;
    let file = Arc::new(GgufFile::open(&model_path)?);
    artifact.check_source(&file)?;
    let text = std::fs::read_to_string(&args.text)
        .with_context(|| format!("reading {}", args.text.display()))?;
    if mirage_artifact::format::sha256_hex(text.as_bytes()) == meta.calib_sha256 {
        bail!(
            "{} is the calibration text; evaluate on held-out text",
            args.text.display()
        );
    }
    let mut spec = mirage::LoadSpec::new(&model_path).backend(mirage::BackendChoice::Cpu);
    spec.options.threads = args.threads;
    let mirage::LoadedModel::Cpu(dense) = mirage::load_model(&spec, Some(file.clone()))? else {
        unreachable!("backend cpu without an artifact loads the CPU backend")
    };
    let tok = mirage_tokenizer::Tokenizer::from_gguf(&file).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut tokens = tok
        .encode(&text, true, true)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    // The engine's default context: the training context, at most 4096.
    tokens.truncate(
        args.max_tokens
            .min(dense.config().n_ctx_train.clamp(1, 4096)),
    );
    if tokens.len() < 2 {
        bail!("the text gives fewer than 2 tokens");
    }
    let (n, d, n_layer) = (tokens.len(), meta.d_model, meta.n_layer);
    let vocab = dense.config().vocab_size;
    eprintln!(
        "eval: {} tokens of {}, {} layers",
        n,
        args.text.display(),
        n_layer
    );

    // Dense pass: FFN inputs and logits.
    let mut xs: Vec<Vec<f32>> = vec![Vec::with_capacity(n * d); n_layer];
    let mut dense_logits = Vec::with_capacity(n * vocab);
    let bar = stage_bar("dense pass", n.div_ceil(128));
    observe_ffn_inputs(
        &dense,
        &tokens,
        128,
        KvDtype::F32,
        &mut |l, _, x| xs[l].extend_from_slice(x),
        &mut |_, lg| {
            dense_logits.extend_from_slice(lg);
            bar.inc(1);
        },
    )?;
    bar.finish();
    drop(dense);

    // The modes that pick from every page's output: the oracle, then each
    // --oracle-top fraction over whole pages. Their sets, per mode, layer
    // and token, come from the selector the backend uses.
    let oracle_modes: Vec<SparseMode> = std::iter::once(SparseMode::Oracle)
        .chain(
            args.oracle_top
                .iter()
                .map(|&fraction| SparseMode::OracleTop {
                    fraction,
                    group_channels: PAGE_CHANNELS as u16,
                }),
        )
        .collect();
    let oracle_selectors: Vec<PageSelector> = oracle_modes
        .iter()
        .map(|&m| PageSelector::new(artifact.clone(), m))
        .collect::<Result<_, _>>()?;
    let mut picked: Vec<Vec<Vec<Vec<usize>>>> =
        vec![Vec::with_capacity(n_layer); oracle_modes.len()];
    // Per group size, per fraction: (sum of per-layer FFN output cosines, count >= ORACLE_COSINE).
    let mut granularity = vec![vec![(0f64, 0usize); args.oracle_top.len()]; GROUP_CHANNELS.len()];
    let bar = stage_bar("oracle sets", n_layer);
    for (l, x) in xs.iter().enumerate() {
        let ld = artifact.layer(l);
        let pages: Vec<&[u8]> = (0..ld.n_pages).map(|p| artifact.page(l, p)).collect();
        let ffn: FfnF32 = unpack_pages(&pages, ld.quant, d)?;
        let sets: Vec<TokenOracle> = (0..n)
            .into_par_iter()
            .map(|t| {
                let mut h = vec![0f32; ffn.n_ff];
                ffn.hidden(&x[t * d..(t + 1) * d], &mut h);
                let mut c = vec![0f32; ld.n_pages * d];
                ffn.page_contributions(&h, PAGE_CHANNELS, &mut c);
                let picked = oracle_selectors
                    .iter()
                    .map(|sel| sel.pick_from_outputs(&c, d).unwrap_or_default())
                    .collect();
                // The same bound at finer groups of channels (artifact order).
                let kept: Vec<Vec<f64>> = if args.oracle_top.is_empty() {
                    Vec::new()
                } else {
                    GROUP_CHANNELS
                        .iter()
                        .map(|&g| {
                            let groups = ffn.n_ff / g;
                            let counts: Vec<usize> = args
                                .oracle_top
                                .iter()
                                .map(|&f| pages_for_fraction(f, groups))
                                .collect();
                            if g == PAGE_CHANNELS {
                                return metrics::largest_pages_cosines(&c, d, &counts);
                            }
                            let mut cg = vec![0f32; groups * d];
                            ffn.page_contributions(&h, g, &mut cg);
                            metrics::largest_pages_cosines(&cg, d, &counts)
                        })
                        .collect()
                };
                TokenOracle { picked, kept }
            })
            .collect();
        for (i, per_mode) in picked.iter_mut().enumerate() {
            per_mode.push(sets.iter().map(|s| s.picked[i].clone()).collect());
        }
        for s in &sets {
            for (acc, cos) in granularity
                .iter_mut()
                .flatten()
                .zip(s.kept.iter().flatten())
            {
                acc.0 += cos;
                acc.1 += (*cos >= ORACLE_COSINE) as usize;
            }
        }
        bar.inc(1);
    }
    bar.finish();
    let total_pages: usize = (0..n_layer).map(|l| artifact.layer(l).n_pages).sum();
    let routed_pages: usize = (0..n_layer)
        .map(|l| artifact.layer(l).n_pages - artifact.layer(l).n_trunk)
        .sum();

    // Sweeps.
    let oracle = &picked[0];
    // `sets`: the mode's pages per layer and token when its selector needs
    // every page's output (the oracle modes).
    let sweep = |label: String,
                 mode: SparseMode,
                 sets: Option<&Vec<Vec<Vec<usize>>>>|
     -> anyhow::Result<Sweep> {
        let sel = PageSelector::new(artifact.clone(), mode)?;
        let mut layers = Vec::with_capacity(n_layer);
        let (mut rec, mut routed_cands, mut act) = (0f64, 0f64, 0f64);
        for l in 0..n_layer {
            let ld = artifact.layer(l);
            let (mut lr, mut lj) = (0f64, 0f64);
            let mut counts = Vec::with_capacity(n);
            for t in 0..n {
                let active = match sel.select(l, &xs[l][t * d..(t + 1) * d])? {
                    Some(a) => a,
                    None => sets.context("an oracle mode without its sets")?[l][t].clone(),
                };
                let mut on = vec![false; ld.n_pages];
                active.iter().for_each(|&p| on[p] = true);
                lr += metrics::recall(&oracle[l][t], |p| on[p]);
                let routed = active.iter().filter(|&&p| p >= ld.n_trunk).count();
                lj += metrics::rejection(routed, ld.n_pages - ld.n_trunk);
                routed_cands += routed as f64;
                counts.push(active.len() as f64);
                act += active.len() as f64;
            }
            rec += lr;
            // Layers without routed pages have no rejection to report.
            let lrej = if ld.n_pages > ld.n_trunk {
                lj / n as f64
            } else {
                f64::NAN
            };
            layers.push((lr / n as f64, lrej, counts));
        }
        let tl = (n * n_layer) as f64;
        // Rejection pooled over the routed pages of all layers (trunk excluded).
        let rejection = metrics::rejection(routed_cands as usize, n * routed_pages);
        Ok(Sweep {
            label,
            mode,
            recall: rec / tl,
            rejection,
            active_fraction: act / (n * total_pages) as f64,
            layers,
        })
    };
    let oracle_sweep = sweep("oracle".into(), SparseMode::Oracle, Some(oracle))?;
    let top_sweeps: Vec<Sweep> = args
        .oracle_top
        .iter()
        .enumerate()
        .map(|(i, &fraction)| {
            sweep(
                format!("oracle top {}%", fraction * 100.0),
                oracle_modes[i + 1],
                Some(&picked[i + 1]),
            )
        })
        .collect::<anyhow::Result<_>>()?;
    let bvh: Vec<Sweep> = MARGIN_GRID
        .iter()
        .map(|&m| {
            sweep(
                format!("bvh margin {m}"),
                SparseMode::Bvh { margin: m },
                None,
            )
        })
        .collect::<anyhow::Result<_>>()?;
    let pred: Vec<Sweep> = THRESHOLD_GRID
        .iter()
        .map(|&t| {
            sweep(
                format!("predictor threshold {t}"),
                SparseMode::Predictor { threshold: t },
                None,
            )
        })
        .collect::<anyhow::Result<_>>()?;

    // Fidelity of full sparse runs.
    let mirage::LoadedModel::SuperblockCpu(sparse) = mirage::load_model(
        &spec.artifact(&args.artifact, Some(SparseMode::All)),
        Some(file),
    )?
    else {
        unreachable!("backend cpu with an artifact loads the superblock backend")
    };
    let dense_ppl = ppl(&dense_logits, &tokens, vocab);
    // At most: all pages, the oracle, the oracle-top runs, and each router's bisection.
    let most_runs = 2
        + args.oracle_top.len() * (1 + args.oracle_top_groups.len())
        + 2 * args.max_fidelity_runs.max(1);
    let fbar = stage_bar("fidelity runs", most_runs);
    let fidelity = |mode: SparseMode| -> anyhow::Result<Fidelity> {
        fbar.set_message(format!("{mode:?}"));
        sparse.backend().set_mode(mode)?;
        sparse.backend().take_active_counts();
        let lg = run_logits(&sparse, &tokens, 128)?;
        let counts = sparse.backend().take_active_counts();
        let active: f64 = counts.iter().flatten().map(|&c| c as f64).sum();
        let (mut cs, mut top) = (0f64, 0usize);
        for t in 0..n {
            let (a, b) = (
                &dense_logits[t * vocab..(t + 1) * vocab],
                &lg[t * vocab..(t + 1) * vocab],
            );
            cs += cosine(a, b);
            top += (metrics::argmax(a) == metrics::argmax(b)) as usize;
        }
        fbar.inc(1);
        Ok(Fidelity {
            cosine: cs / n as f64,
            top1: top as f64 / n as f64,
            ppl: ppl(&lg, &tokens, vocab),
            active_fraction: active / (n * total_pages) as f64,
        })
    };
    let all_pages = fidelity(SparseMode::All)?;
    let oracle_fid = fidelity(SparseMode::Oracle)?;
    let top_fids: Vec<Fidelity> = top_sweeps
        .iter()
        .map(|s| fidelity(s.mode))
        .collect::<anyhow::Result<_>>()?;
    // (group channels, fraction, fidelity); the active fraction is of the pages with a kept channel.
    let mut group_fids: Vec<(u16, f32, Fidelity)> = Vec::new();
    for &group_channels in &args.oracle_top_groups {
        for &fraction in &args.oracle_top {
            group_fids.push((
                group_channels,
                fraction,
                fidelity(SparseMode::OracleTop {
                    fraction,
                    group_channels,
                })?,
            ));
        }
    }
    // The cheapest setting meeting recall that also meets the cosine gate:
    // bisection over the recall-passing settings sorted by active fraction
    // (cosine grows with the active set), at most `max_fidelity_runs` runs.
    let pick = |sweeps: &[Sweep]| -> anyhow::Result<Option<(Sweep, Fidelity)>> {
        let mut ok: Vec<&Sweep> = sweeps.iter().filter(|s| s.recall >= RECALL_GATE).collect();
        ok.sort_by(|a, b| a.active_fraction.total_cmp(&b.active_fraction));
        let Some(last) = ok.last() else {
            return Ok(None);
        };
        let f = fidelity(last.mode)?;
        if f.cosine < COSINE_GATE {
            return Ok(Some(((*last).clone(), f)));
        }
        let mut best = ((*last).clone(), f);
        let (mut lo, mut hi) = (0usize, ok.len() - 1);
        let mut runs = 1;
        while lo < hi && runs < args.max_fidelity_runs {
            let mid = (lo + hi) / 2;
            let f = fidelity(ok[mid].mode)?;
            runs += 1;
            if f.cosine >= COSINE_GATE {
                best = (ok[mid].clone(), f);
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        Ok(Some(best))
    };
    let bvh_pick = pick(&bvh)?;
    let pred_pick = pick(&pred)?;
    fbar.set_length(fbar.position());
    fbar.finish_with_message("done");

    let fid_json = |f: &Fidelity| json!({"logit_cosine": f.cosine, "top1_agreement": f.top1, "ppl": f.ppl, "ppl_delta": f.ppl - dense_ppl, "active_fraction_measured": f.active_fraction});
    let sweep_json = |s: &Sweep| {
        json!({
            "label": s.label, "recall": s.recall, "rejection": s.rejection, "active_fraction": s.active_fraction,
            "per_layer": s.layers.iter().map(|(r, j, c)| json!({"recall": r, "rejection": j, "active_mean": metrics::mean(c), "active_p50": metrics::quantile(c, 0.5), "active_p99": metrics::quantile(c, 0.99)})).collect::<Vec<_>>(),
        })
    };
    let pick_json = |p: &Option<(Sweep, Fidelity)>| match p {
        Some((s, f)) => {
            json!({"setting": sweep_json(s), "fidelity": fid_json(f), "meets_gates": s.recall >= RECALL_GATE && f.cosine >= COSINE_GATE})
        }
        None => json!(null),
    };
    let report = json!({
        "artifact": args.artifact.display().to_string(), "model": meta.source_name, "text": args.text.display().to_string(),
        "tokens": n, "pages_total": total_pages, "pages_routed": routed_pages, "dense_ppl": dense_ppl,
        "all_pages": fid_json(&all_pages),
        "oracle": {"setting": sweep_json(&oracle_sweep), "fidelity": fid_json(&oracle_fid)},
        "oracle_top_layer_cosine": GROUP_CHANNELS.iter().zip(&granularity).map(|(g, per)| json!({
            "group_channels": g,
            "per_fraction": args.oracle_top.iter().zip(per).map(|(f, (sum, ok))| json!({"fraction": f, "mean_cosine": sum / (n * n_layer) as f64, "share_at_oracle_cosine": *ok as f64 / (n * n_layer) as f64})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "oracle_top_groups": group_fids.iter().map(|(g, fr, f)| json!({"group_channels": g, "fraction": fr, "fidelity": fid_json(f), "meets_cosine_gate": f.cosine >= COSINE_GATE})).collect::<Vec<_>>(),
        "oracle_top": top_sweeps.iter().zip(&top_fids).map(|(s, f)| json!({"setting": sweep_json(s), "fidelity": fid_json(f), "meets_cosine_gate": f.cosine >= COSINE_GATE})).collect::<Vec<_>>(),
        "bvh": pick_json(&bvh_pick), "predictor": pick_json(&pred_pick),
        "bvh_sweep": bvh.iter().map(|s| json!({"label": s.label, "recall": s.recall, "rejection": s.rejection, "active_fraction": s.active_fraction})).collect::<Vec<_>>(),
        "predictor_sweep": pred.iter().map(|s| json!({"label": s.label, "recall": s.recall, "rejection": s.rejection, "active_fraction": s.active_fraction})).collect::<Vec<_>>(),
    });
    if let Some(dir) = &args.plot {
        std::fs::create_dir_all(dir)?;
        write_plots(
            dir,
            &bvh,
            &pred,
            bvh_pick.as_ref().map(|p| &p.0),
            &oracle_sweep,
        )?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "{} on {} ({} tokens), {} pages ({} routed); dense ppl {:.3}",
        meta.source_name,
        args.text.display(),
        n,
        total_pages,
        routed_pages,
        dense_ppl
    );
    println!(
        "{:<28} {:>8} {:>9} {:>8} {:>9} {:>7} {:>8} {:>9}",
        "router", "recall", "rejection", "active", "cosine", "top1", "ppl", "Δppl"
    );
    let row = |name: &str, s: Option<&Sweep>, f: &Fidelity| {
        let (r, j) = s.map_or((f64::NAN, f64::NAN), |s| (s.recall, s.rejection));
        println!(
            "{name:<28} {:>8} {:>9} {:>8.4} {:>9.5} {:>7.4} {:>8.3} {:>+9.3}",
            or_dash(r),
            or_dash(j),
            f.active_fraction,
            f.cosine,
            f.top1,
            f.ppl,
            f.ppl - dense_ppl
        );
    };
    row("all pages (Q8_0 repack)", None, &all_pages);
    row("oracle", Some(&oracle_sweep), &oracle_fid);
    for (s, f) in top_sweeps.iter().zip(&top_fids) {
        row(&s.label, Some(s), f);
    }
    for (g, fraction, f) in &group_fids {
        row(
            &format!("oracle top {}% of {g}-ch", fraction * 100.0),
            None,
            f,
        );
    }
    if !group_fids.is_empty() {
        println!("(\"of N-ch\": the fraction counts groups of N channels; active = pages with a kept channel)");
    }
    match &bvh_pick {
        Some((s, f)) => row(&s.label, Some(s), f),
        None => println!("bvh: no margin reaches recall {RECALL_GATE}"),
    }
    match &pred_pick {
        Some((s, f)) => row(&s.label, Some(s), f),
        None => println!("predictor: no threshold reaches recall {RECALL_GATE}"),
    }
    if !args.oracle_top.is_empty() {
        println!(
            "largest-output groups kept, per layer (offline): mean FFN output cosine vs all pages [share of token-layers >= {ORACLE_COSINE}]"
        );
        print!("  {:<10}", "kept");
        for g in GROUP_CHANNELS {
            print!(" {:>20}", format!("{g}-channel groups"));
        }
        println!();
        for (i, f) in args.oracle_top.iter().enumerate() {
            print!("  {:<10}", format!("{}%", f * 100.0));
            for per in &granularity {
                let (sum, ok) = per[i];
                let tl = (n * n_layer) as f64;
                print!(
                    " {:>20}",
                    format!("{:.5} [{:.3}]", sum / tl, ok as f64 / tl)
                );
            }
            println!();
        }
    }
    println!("sweeps (offline, dense FFN inputs):");
    for s in bvh.iter().chain(&pred) {
        println!(
            "  {:<28} recall {:.4} rejection {:.4} active {:.4}",
            s.label, s.recall, s.rejection, s.active_fraction
        );
    }
    if let Some((s, _)) = &bvh_pick {
        println!(
            "per layer ({}): recall  rejection  active mean/p50/p99",
            s.label
        );
        for (l, (r, j, c)) in s.layers.iter().enumerate() {
            println!(
                "  {l:>3}  {:>6}  {:>9}  {:.2}/{}/{}",
                or_dash(*r),
                or_dash(*j),
                metrics::mean(c),
                metrics::quantile(c, 0.5),
                metrics::quantile(c, 0.99)
            );
        }
    }
    Ok(())
}

/// A table cell: four decimals, or "-" where the metric does not apply (a
/// router metric of the all-pages row, the rejection of a layer with no
/// routed pages), which the computation leaves as NaN.
fn or_dash(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else {
        format!("{v:.4}")
    }
}

/// Two small SVG charts, written by hand (no plotting dependency).
fn write_plots(
    dir: &std::path::Path,
    bvh: &[Sweep],
    pred: &[Sweep],
    picked: Option<&Sweep>,
    oracle: &Sweep,
) -> anyhow::Result<()> {
    let (w, h, m) = (640.0, 420.0, 50.0);
    let sx = |v: f64| m + v * (w - 2.0 * m);
    let sy = |v: f64, lo: f64| h - m - (v - lo) / (1.0 - lo) * (h - 2.0 * m);
    let lo = bvh
        .iter()
        .chain(pred)
        .map(|s| s.recall)
        .fold(1.0f64, f64::min)
        .clamp(0.0, 0.99);
    let mut svg = format!("<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}'><rect width='100%' height='100%' fill='white'/>\n");
    svg += &format!("<text x='{}' y='20' font-size='14'>useful-page recall vs rejection (margin / threshold sweep)</text>\n", m);
    svg += &format!("<line x1='{m}' y1='{}' x2='{}' y2='{}' stroke='black'/><line x1='{m}' y1='{m}' x2='{m}' y2='{}' stroke='black'/>\n", h - m, w - m, h - m, h - m);
    svg += &format!("<text x='{}' y='{}' font-size='12'>rejection 0..1</text><text x='5' y='{}' font-size='12'>recall {lo:.3}..1</text>\n", w / 2.0, h - 15.0, m - 10.0);
    let gate = sy(RECALL_GATE, lo);
    svg += &format!(
        "<line x1='{m}' y1='{gate}' x2='{}' y2='{gate}' stroke='gray' stroke-dasharray='4'/>\n",
        w - m
    );
    for (sweeps, color) in [(bvh, "blue"), (pred, "red")] {
        let pts: Vec<String> = sweeps
            .iter()
            .map(|s| format!("{:.1},{:.1}", sx(s.rejection), sy(s.recall, lo)))
            .collect();
        svg += &format!(
            "<polyline fill='none' stroke='{color}' points='{}'/>\n",
            pts.join(" ")
        );
    }
    svg += "<text x='60' y='40' fill='blue' font-size='12'>BVH router</text><text x='160' y='40' fill='red' font-size='12'>low-rank predictor</text></svg>\n";
    std::fs::write(dir.join("recall_vs_rejection.svg"), svg)?;
    let sel = picked.unwrap_or(oracle);
    let n = sel.layers.len().max(1) as f64;
    let bw = (w - 2.0 * m) / n;
    let max_pages = sel
        .layers
        .iter()
        .flat_map(|l| l.2.iter().copied())
        .fold(1.0f64, f64::max);
    let mut svg = format!("<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}'><rect width='100%' height='100%' fill='white'/>\n<text x='{m}' y='20' font-size='14'>active fraction per layer ({} in blue, oracle in gray)</text>\n", sel.label);
    for (i, (a, b)) in sel.layers.iter().zip(&oracle.layers).enumerate() {
        for (k, (c, color)) in [(&a.2, "blue"), (&b.2, "gray")].into_iter().enumerate() {
            let v = metrics::mean(c) / max_pages;
            let bh = v * (h - 2.0 * m);
            svg += &format!(
                "<rect x='{:.1}' y='{:.1}' width='{:.1}' height='{:.1}' fill='{color}'/>\n",
                m + i as f64 * bw + k as f64 * bw / 2.0,
                h - m - bh,
                bw / 2.0 - 1.0,
                bh
            );
        }
    }
    svg += "</svg>\n";
    std::fs::write(dir.join("active_per_layer.svg"), svg)?;
    Ok(())
}
