//! `mirage-cli eval --sparsity 0.25,0.4,0.5 --artifact M.activation.mirage`:
//! fidelity of activation sparsity on held-out text, per plan (criterion and
//! allocation) and sparsity, against MIRAGE's own dense path on the source
//! GGUF: perplexity, its change, the mean logit cosine and top-1 agreement
//! (against the same path at sparsity 0, exact f32).
//! A first row measures the repacked model itself at sparsity 0 through the
//! decode kernels (token by token, on the first `--repack-tokens`
//! positions) against the dense path and against exact f32 arithmetic.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use mirage_artifact::activation::backend::ActivationBackend;
use mirage_artifact::activation::format::ActivationArtifact;
use mirage_artifact::activation::{Criterion, Proj, SparsityTarget};
use mirage_artifact::metrics::{cosine, nll};
use mirage_gguf::GgufFile;
use mirage_runtime::{Backend, CpuBackend, Engine, EngineOptions, KvDtype, Model, TokenSlot};
use serde_json::json;

/// The activation-sparsity options of `eval`.
#[derive(Debug, Args)]
pub struct ActivationEvalArgs {
    /// Evaluate activation sparsity at these model-wide sparsities (comma-separated, each in [0, 1)), with
    /// --artifact an activation artifact (`cargo xtask build-artifacts --mode activation`).
    #[arg(long, value_delimiter = ',')]
    pub sparsity: Vec<f32>,
    /// Only the plans of these criteria (teal, wina; comma-separated). Default: every plan.
    #[arg(long, value_delimiter = ',')]
    pub criterion: Vec<Criterion>,
    /// Only these plans (e.g. teal/block-greedy,wina/layer-sensitivity). Default: every plan.
    #[arg(long, value_delimiter = ',')]
    pub plan: Vec<String>,
    /// Positions decoded token by token for the repacked model's own row.
    #[arg(long = "repack-tokens", default_value_t = 96)]
    pub repack_tokens: usize,
}

struct Scored {
    ppl: f64,
    cosine: f64,
    top1: f64,
}

fn argmax(v: &[f32]) -> usize {
    let mut b = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[b] {
            b = i;
        }
    }
    b
}

fn score(logits: &[f32], dense: &[f32], tokens: &[u32], vocab: usize) -> Scored {
    let n = tokens.len();
    let (mut cs, mut agree, mut nl) = (0f64, 0usize, 0f64);
    for i in 0..n {
        let (a, b) = (
            &logits[i * vocab..(i + 1) * vocab],
            &dense[i * vocab..(i + 1) * vocab],
        );
        cs += cosine(a, b);
        agree += (argmax(a) == argmax(b)) as usize;
        if i + 1 < n {
            nl += nll(a, tokens[i + 1] as usize);
        }
    }
    Scored {
        ppl: (nl / (n - 1).max(1) as f64).exp(),
        cosine: cs / n as f64,
        top1: agree as f64 / n as f64,
    }
}

fn decode_logits<B: Backend>(model: &Model<B>, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
    let mut cache = model.new_kv_cache(tokens.len(), 1, KvDtype::F32)?;
    let mut s = model.new_scratch();
    let (mut all, mut out) = (Vec::new(), Vec::new());
    for (pos, &t) in tokens.iter().enumerate() {
        model.forward(
            &[t],
            &[TokenSlot { seq: 0, pos }],
            &[0],
            &mut cache,
            &mut s,
            &mut out,
        )?;
        all.extend_from_slice(&out);
    }
    Ok(all)
}

/// Runs the activation-sparsity evaluation.
#[allow(clippy::too_many_arguments)]
pub fn run(
    artifact_path: &Path,
    text_path: &Path,
    model: Option<PathBuf>,
    max_tokens: usize,
    threads: usize,
    as_json: bool,
    a: &ActivationEvalArgs,
) -> anyhow::Result<()> {
    for &s in &a.sparsity {
        SparsityTarget::Fixed(s).validate()?;
    }
    let artifact = ActivationArtifact::open(artifact_path)
        .with_context(|| format!("loading {}", artifact_path.display()))?;
    let meta = artifact.meta().clone();
    let model_path = model.unwrap_or_else(|| PathBuf::from("models").join(&meta.source_name));
    super::generate::check_model(&model_path)?;
    let file = Arc::new(GgufFile::open(&model_path)?);
    artifact.check_source_sha256(&mirage_artifact::format::sha256_hex(file.as_bytes()))?;
    let text = std::fs::read_to_string(text_path)
        .with_context(|| format!("reading {}", text_path.display()))?;
    if mirage_artifact::format::sha256_hex(text.as_bytes()) == meta.calib_sha256 {
        bail!(
            "{} is the calibration text; evaluate on held-out text",
            text_path.display()
        );
    }
    let opts = EngineOptions {
        threads,
        ..EngineOptions::default()
    };
    let dense = Engine::from_file(file.clone(), CpuBackend::new(threads)?, opts)?;
    let mut tokens = dense.encode(&text, true)?;
    tokens.truncate(max_tokens.min(dense.n_ctx()));
    if tokens.len() < 2 {
        bail!("the text gives fewer than 2 tokens");
    }
    let vocab = dense.model().config().vocab_size;
    let n_layer = meta.n_layer;
    eprintln!(
        "eval: {} tokens of {} (held out; calibration was {})",
        tokens.len(),
        text_path.display(),
        meta.calib_name
    );
    let dense_logits = dense.model().logits_all(&tokens, KvDtype::F32)?;
    let d = score(&dense_logits, &dense_logits, &tokens, vocab);
    let sparse = Model::load(
        file.clone(),
        ActivationBackend::new(CpuBackend::new(threads)?, Some(artifact.clone()), n_layer),
    )?;
    // Whole-text runs: the batch path in f32 (dense kernels on the masked
    // input, no activation rounding), which computes what the decode kernels
    // compute; its sparsity-0 run is the reference the rows' changes are
    // measured against, so they show the cost of the skipped channels alone.
    let masked = Model::load(
        file.clone(),
        ActivationBackend::new(CpuBackend::new_f32_activations(threads)?, None, n_layer),
    )?;
    let exact_logits = masked.logits_all(&tokens, KvDtype::F32)?;
    let x = score(&exact_logits, &exact_logits, &tokens, vocab);
    let params: Vec<f64> = {
        let w = mirage_artifact::activation::fit::param_counts(sparse.config());
        (0..n_layer).flat_map(|_| w).collect()
    };

    // The repacked model at sparsity 0, through the decode kernels.
    let k = a.repack_tokens.clamp(2, tokens.len());
    let head = &tokens[..k];
    let t0 = Instant::now();
    let repacked = decode_logits(&sparse, head)?;
    let dense_head = decode_logits(dense.model(), head)?;
    let exact = Model::load(file.clone(), CpuBackend::new_f32_activations(threads)?)?;
    let exact_head = exact.logits_all(head, KvDtype::F32)?;
    drop(exact);
    let r_vs_dense = score(&repacked, &dense_head, head, vocab);
    let r_vs_exact = score(&repacked, &exact_head, head, vocab);
    let d_head = score(&dense_head, &dense_head, head, vocab);
    let x_head = score(&exact_head, &dense_head, head, vocab);
    let repack_s = t0.elapsed().as_secs_f64();

    let plans: Vec<(String, Criterion)> = meta
        .plans
        .iter()
        .filter(|p| a.criterion.is_empty() || a.criterion.contains(&p.criterion))
        .filter(|p| a.plan.is_empty() || a.plan.contains(&p.name))
        .map(|p| (p.name.clone(), p.criterion))
        .collect();
    if plans.is_empty() {
        bail!(
            "no plan matches (the artifact has {})",
            meta.plans
                .iter()
                .map(|p| p.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let mut rows = Vec::new();
    for (name, crit) in &plans {
        for &s in &a.sparsity {
            let r = artifact.resolve(Some(name), SparsityTarget::Fixed(s))?;
            masked
                .backend()
                .set_thresholds(artifact.thresholds(*crit, &r.per_matrix))?;
            masked.backend().take_stats();
            let lg = masked.logits_all(&tokens, KvDtype::F32)?;
            let st = masked.backend().take_stats();
            // Achieved sparsity on this text, parameter-weighted.
            let mut kept = 0f64;
            let mut tot = 0f64;
            for (m, (act, n)) in st.active.iter().enumerate() {
                if *n == 0 {
                    continue;
                }
                let cols = artifact
                    .matrix(m / Proj::ALL.len(), Proj::ALL[m % Proj::ALL.len()])
                    .map_or(1, |e| e.layout.cols()) as f64;
                kept += params[m] * (*act as f64 / *n as f64) / cols;
                tot += params[m];
            }
            let achieved = if tot > 0.0 { 1.0 - kept / tot } else { 0.0 };
            let sc = score(&lg, &exact_logits, &tokens, vocab);
            rows.push((name.clone(), s, achieved, sc));
        }
    }
    sparse
        .backend()
        .set_thresholds(vec![None; n_layer * Proj::ALL.len()])?;

    if as_json {
        let out = json!({
            "model": meta.source_name, "text": text_path.display().to_string(), "tokens": tokens.len(),
            "calibration": meta.calib_name, "dense_ppl": d.ppl, "exact_f32_ppl": x.ppl,
            "repacked": {
                "tokens": k, "ppl": r_vs_dense.ppl, "dense_ppl": d_head.ppl, "exact_f32_ppl": x_head.ppl,
                "cosine_vs_dense": r_vs_dense.cosine, "top1_vs_dense": r_vs_dense.top1,
                "cosine_vs_exact_f32": r_vs_exact.cosine, "top1_vs_exact_f32": r_vs_exact.top1,
            },
            "rows": rows.iter().map(|(p, s, ach, sc)| json!({
                "plan": p, "sparsity": s, "achieved": ach, "ppl": sc.ppl,
                "delta_ppl": sc.ppl / x.ppl - 1.0, "cosine": sc.cosine, "top1": sc.top1,
            })).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "model {} | held-out {} ({} tokens) | dense ppl {:.4} (own dense path), {:.4} (exact f32: the rows' reference)",
        meta.source_name,
        text_path.display(),
        tokens.len(),
        d.ppl,
        x.ppl
    );
    println!(
        "repacked model at sparsity 0 (decode kernels, first {k} tokens, {repack_s:.1} s): ppl {:.4} vs dense {:.4} ({:+.3} %), exact f32 {:.4}; logit cosine {:.6} vs dense, {:.6} vs exact f32; top-1 {:.4} vs dense",
        r_vs_dense.ppl,
        d_head.ppl,
        100.0 * (r_vs_dense.ppl / d_head.ppl - 1.0),
        x_head.ppl,
        r_vs_dense.cosine,
        r_vs_exact.cosine,
        r_vs_dense.top1
    );
    println!(
        "{:<26} {:>8} {:>8} {:>10} {:>8} {:>9} {:>7}",
        "plan", "sparsity", "achieved", "ppl", "dppl %", "cosine", "top-1"
    );
    for (p, s, ach, sc) in &rows {
        println!(
            "{:<26} {:>8.2} {:>8.3} {:>10.4} {:>+8.2} {:>9.5} {:>7.4}",
            p,
            s,
            ach,
            sc.ppl,
            100.0 * (sc.ppl / x.ppl - 1.0),
            sc.cosine,
            sc.top1
        );
    }
    Ok(())
}
