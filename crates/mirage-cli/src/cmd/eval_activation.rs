//! `mirage-cli eval --sparsity 0.25,0.4,0.5 --artifact M.activation.mirage`:
//! fidelity of activation sparsity on held-out text, per plan (criterion and
//! allocation) and sparsity, against MIRAGE's own dense path on the source
//! GGUF (the same quantized kernels, the same batch): perplexity, its change,
//! the mean logit cosine and top-1 agreement, and the sparsity achieved on
//! this text (the share of the projections' and the head's bytes skipped).
//! The rows run the batch path (the dense kernels on the masked inputs);
//! `--decode-tokens N` also runs the first N positions token by token
//! through the channel-major decode kernels and compares. A first row
//! measures the repacked model itself at sparsity 0 through the decode
//! kernels against the dense path, and both against the same weights with
//! f32 activations.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use mirage_artifact::activation::backend::{ActivationBackend, SparseStats};
use mirage_artifact::activation::format::{ActivationArtifact, ResolvedSparsity};
use mirage_artifact::activation::{Criterion, SparsityTarget};
use mirage_artifact::metrics::{cosine, nll};
use mirage_gguf::GgufFile;
use mirage_runtime::{Backend, CpuBackend, KvDtype, Model, TokenSlot};
use serde_json::json;

use super::bench::argmax;

/// The `--plan` word for the artifact's own choice (no plan named).
const DEFAULT_PLAN: &str = "default";

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
    /// Only these plans (e.g. teal/block-greedy,wina/sensitivity+head; `default`: what an unnamed plan
    /// runs, the plan chosen per sparsity by calibration perplexity). Default: every plan and `default`.
    #[arg(long, value_delimiter = ',')]
    pub plan: Vec<String>,
    /// Positions decoded token by token for the repacked model's own row.
    #[arg(long = "repack-tokens", default_value_t = 96)]
    pub repack_tokens: usize,
    /// Also decode the first N positions of every row through the channel-major kernels.
    #[arg(long = "decode-tokens", default_value_t = 0)]
    pub decode_tokens: usize,
}

struct Scored {
    ppl: f64,
    cosine: f64,
    top1: f64,
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

/// The calibration perplexity's rise over dense where the plan runs (NaN:
/// not measured), what an unnamed plan is chosen by.
fn calib_increase(r: &ResolvedSparsity) -> f64 {
    r.calib_ppl / r.dense_calib_ppl - 1.0
}

/// Share of the bytes of every matrix (projections and head) the products
/// counted in `st` skipped.
pub fn achieved_sparsity(artifact: &ActivationArtifact, st: &SparseStats) -> f64 {
    let (mut skipped, mut tot) = (0f64, 0f64);
    for (e, (act, n)) in artifact.matrices().iter().zip(&st.active) {
        let b = e.layout.bytes() as f64;
        tot += b;
        if *n > 0 {
            skipped += b * (1.0 - *act as f64 / *n as f64 / e.layout.cols() as f64);
        }
    }
    if tot > 0.0 {
        skipped / tot
    } else {
        0.0
    }
}

/// Every `--plan` name is a plan of the artifact (`names`) or `default`: a
/// misspelled name is an error, not a filter that matches nothing, and it
/// is said before the long passes start.
fn check_plan_names(names: &[&str], asked: &[String]) -> anyhow::Result<()> {
    if let Some(bad) = asked
        .iter()
        .find(|p| p.as_str() != DEFAULT_PLAN && !names.contains(&p.as_str()))
    {
        bail!(
            "--plan {bad}: no such plan (there are {}, and `{DEFAULT_PLAN}`)",
            names.join(", ")
        );
    }
    Ok(())
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
    let names: Vec<&str> = meta.plans.iter().map(|p| p.name.as_str()).collect();
    check_plan_names(&names, &a.plan)
        .with_context(|| format!("the plans of {}", artifact_path.display()))?;
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
    let dense = Model::load(file.clone(), CpuBackend::new(threads)?)?;
    let tokenizer = mirage_tokenizer::Tokenizer::from_gguf(&file)?;
    let mut tokens = tokenizer.encode(&text, true, true)?;
    tokens.truncate(max_tokens.min(dense.config().n_ctx_train.max(2)));
    if tokens.len() < 2 {
        bail!("the text gives fewer than 2 tokens");
    }
    let vocab = dense.config().vocab_size;
    let n_layer = meta.n_layer;
    eprintln!(
        "eval: {} tokens of {} (held out; calibration was {})",
        tokens.len(),
        text_path.display(),
        meta.calib_name
    );
    let t0 = Instant::now();
    let dense_logits = dense.logits_all(&tokens, KvDtype::F32)?;
    let d = score(&dense_logits, &dense_logits, &tokens, vocab);
    eprintln!(
        "dense: ppl {:.4} ({:.1} s)",
        d.ppl,
        t0.elapsed().as_secs_f64()
    );
    // Batch rows: the dense kernels (the own dense path's) on masked inputs.
    let masked = Model::load(
        file.clone(),
        ActivationBackend::new(CpuBackend::new(threads)?, None, n_layer),
    )?;
    // Decode rows: the channel-major kernels of the artifact.
    let sparse = Model::load(
        file.clone(),
        ActivationBackend::new(CpuBackend::new(threads)?, Some(artifact.clone()), n_layer),
    )?;

    // The repacked model at sparsity 0, through the decode kernels.
    let k = a.repack_tokens.clamp(2, tokens.len());
    let head = &tokens[..k];
    let t0 = Instant::now();
    // Thresholds of 0 keep every channel but run the channel-major kernels
    // (a matrix without thresholds takes the row-major dense path).
    sparse.backend().set_thresholds(
        artifact
            .matrices()
            .iter()
            .map(|e| Some(vec![0.0; e.layout.cols()]))
            .collect(),
    )?;
    let repacked = decode_logits(&sparse, head)?;
    sparse
        .backend()
        .set_thresholds(vec![None; artifact.matrices().len()])?;
    let dense_head = decode_logits(&dense, head)?;
    let r_vs_dense = score(&repacked, &dense_head, head, vocab);
    let d_head = score(&dense_head, &dense_head, head, vocab);
    // Both decodes round their activations to 8 bits, but not in the same
    // groups (the dense products per block of their activation format, the
    // channel-major kernels per group of active channels): the same weights
    // with f32 activations are the reference that tells what each costs.
    let exact = Model::load(file.clone(), CpuBackend::new_f32_activations(threads)?)?;
    let exact_head = decode_logits(&exact, head)?;
    drop(exact);
    let e_head = score(&exact_head, &exact_head, head, vocab);
    let r_vs_exact = score(&repacked, &exact_head, head, vocab);
    let d_vs_exact = score(&dense_head, &exact_head, head, vocab);
    let repack_s = t0.elapsed().as_secs_f64();
    eprintln!("repacked model at sparsity 0: {repack_s:.1} s");

    // `None`: the artifact's own choice per sparsity (no plan named).
    let mut plans: Vec<Option<String>> = meta
        .plans
        .iter()
        .filter(|p| a.criterion.is_empty() || a.criterion.contains(&p.criterion))
        .filter(|p| a.plan.is_empty() || a.plan.contains(&p.name))
        .map(|p| Some(p.name.clone()))
        .collect();
    if a.plan.iter().any(|p| p == DEFAULT_PLAN) || (a.plan.is_empty() && a.criterion.is_empty()) {
        plans.push(None);
    }
    if plans.is_empty() {
        bail!(
            "no plan matches (the artifact has {}, and `{DEFAULT_PLAN}`)",
            meta.plans
                .iter()
                .map(|p| p.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let kd = a.decode_tokens.min(tokens.len());
    let mut rows = Vec::new();
    for plan in &plans {
        for &s in &a.sparsity {
            let t = Instant::now();
            let r = artifact.resolve(plan.as_deref(), SparsityTarget::Fixed(s))?;
            let crit = artifact
                .plan(&r.plan)
                .map(|(m, _)| m.criterion)
                .ok_or_else(|| anyhow::anyhow!("no plan `{}` in the artifact", r.plan))?;
            let name = match plan {
                Some(n) => n.clone(),
                None => format!("{DEFAULT_PLAN}: {}", r.plan),
            };
            let thr = artifact.thresholds(crit, &r.per_matrix);
            masked.backend().set_thresholds(thr.clone())?;
            masked.backend().take_stats();
            let lg = masked.logits_all(&tokens, KvDtype::F32)?;
            let achieved = achieved_sparsity(&artifact, &masked.backend().take_stats());
            let sc = score(&lg, &dense_logits, &tokens, vocab);
            let dec = if kd >= 2 {
                sparse.backend().set_thresholds(thr)?;
                sparse.backend().take_stats();
                let dl = decode_logits(&sparse, &tokens[..kd])?;
                let ach = achieved_sparsity(&artifact, &sparse.backend().take_stats());
                let vs_batch = score(&dl, &lg[..kd * vocab], &tokens[..kd], vocab);
                let batch = score(
                    &lg[..kd * vocab],
                    &dense_logits[..kd * vocab],
                    &tokens[..kd],
                    vocab,
                );
                let dd = score(
                    &dense_logits[..kd * vocab],
                    &dense_logits[..kd * vocab],
                    &tokens[..kd],
                    vocab,
                );
                Some((
                    ach,
                    vs_batch,
                    batch.ppl / dd.ppl - 1.0,
                    score(&dl, &dense_logits[..kd * vocab], &tokens[..kd], vocab).ppl / dd.ppl
                        - 1.0,
                ))
            } else {
                None
            };
            eprintln!(
                "{name} @ {s:.2}: ppl {:.4} ({:+.2} %), achieved {achieved:.3} ({:.1} s)",
                sc.ppl,
                100.0 * (sc.ppl / d.ppl - 1.0),
                t.elapsed().as_secs_f64()
            );
            rows.push((plan.is_none(), r, achieved, sc, dec));
        }
    }
    sparse
        .backend()
        .set_thresholds(vec![None; artifact.matrices().len()])?;

    if as_json {
        let out = json!({
            "model": meta.source_name, "text": text_path.display().to_string(), "tokens": tokens.len(),
            "calibration": meta.calib_name, "dense_ppl": d.ppl,
            "repacked": {
                "tokens": k, "ppl": r_vs_dense.ppl, "dense_ppl": d_head.ppl,
                "cosine_vs_dense": r_vs_dense.cosine, "top1_vs_dense": r_vs_dense.top1,
                "exact_ppl": e_head.ppl, "cosine_vs_exact": r_vs_exact.cosine,
                "dense_cosine_vs_exact": d_vs_exact.cosine,
            },
            "rows": rows.iter().map(|(default, r, ach, sc, dec)| json!({
                "plan": r.plan, "default": default, "sparsity": r.sparsity,
                "head_sparsity": r.per_matrix.last().copied().unwrap_or(0.0),
                "calib_delta_ppl": calib_increase(r), "achieved": ach, "ppl": sc.ppl,
                "delta_ppl": sc.ppl / d.ppl - 1.0, "cosine": sc.cosine, "top1": sc.top1,
                "decode": dec.as_ref().map(|(ach, vb, bd, dd)| json!({
                    "tokens": kd, "achieved": ach, "cosine_vs_batch": vb.cosine, "top1_vs_batch": vb.top1,
                    "delta_ppl_batch": bd, "delta_ppl_decode": dd,
                })),
            })).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "model {} | held-out {} ({} tokens) | own dense ppl {:.4} (batch, quantized activations)",
        meta.source_name,
        text_path.display(),
        tokens.len(),
        d.ppl,
    );
    println!(
        "repacked model at sparsity 0 (decode kernels, first {k} tokens, {repack_s:.1} s): ppl {:.4} vs dense decode {:.4} ({:+.3} %); logit cosine {:.6}, top-1 {:.4} vs dense",
        r_vs_dense.ppl,
        d_head.ppl,
        100.0 * (r_vs_dense.ppl / d_head.ppl - 1.0),
        r_vs_dense.cosine,
        r_vs_dense.top1
    );
    println!(
        "  against f32 activations (ppl {:.4}): repacked {:+.3} %, logit cosine {:.6}; dense decode {:+.3} %, logit cosine {:.6}",
        e_head.ppl,
        100.0 * (r_vs_dense.ppl / e_head.ppl - 1.0),
        r_vs_exact.cosine,
        100.0 * (d_head.ppl / e_head.ppl - 1.0),
        d_vs_exact.cosine
    );
    println!(
        "{:<32} {:>8} {:>8} {:>8} {:>8} {:>10} {:>8} {:>9} {:>7}",
        "plan", "sparsity", "head", "calib %", "achieved", "ppl", "dppl %", "cosine", "top-1"
    );
    for (default, r, ach, sc, dec) in &rows {
        let p = if *default {
            format!("{DEFAULT_PLAN}: {}", r.plan)
        } else {
            r.plan.clone()
        };
        println!(
            "{:<32} {:>8.2} {:>8.2} {:>+8.2} {:>8.3} {:>10.4} {:>+8.2} {:>9.5} {:>7.4}",
            p,
            r.sparsity,
            r.per_matrix.last().copied().unwrap_or(0.0),
            100.0 * calib_increase(r),
            ach,
            sc.ppl,
            100.0 * (sc.ppl / d.ppl - 1.0),
            sc.cosine,
            sc.top1
        );
        if let Some((ach, vb, bd, dd)) = dec {
            println!(
                "  decode kernels, first {kd} tokens: achieved {ach:.3}, cosine {:.5} / top-1 {:.4} vs the batch path; dppl {:+.2} % (decode) vs {:+.2} % (batch) there",
                vb.cosine,
                vb.top1,
                100.0 * dd,
                100.0 * bd
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_name_that_is_no_plan_is_refused_by_name() {
        let names = ["teal/block-greedy", "wina/sensitivity+head"];
        let asked = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(check_plan_names(&names, &asked(&[])).is_ok());
        assert!(check_plan_names(&names, &asked(&["default", "teal/block-greedy"])).is_ok());
        let e = check_plan_names(&names, &asked(&["default", "teal/block-gredy"]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("teal/block-gredy") && e.contains("wina/sensitivity+head"),
            "{e}"
        );
    }
}
