//! Building an activation-sparsity artifact from a GGUF model and a
//! calibration text: repack the projections and the lm head channel-major,
//! record their inputs on the calibration tokens layer by layer (score
//! quantiles and error curves per matrix), measure the matrices'
//! sensitivities, run TEAL's block-wise greedy (the baseline), tabulate the
//! plans and the calibration perplexity of our plans at every target, and
//! pick the default. `cargo xtask build-artifacts --mode activation` is its
//! frontend.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use mirage_gguf::quant::{self, channel_major};
use mirage_gguf::GgufFile;
use mirage_runtime::backend::cpu::CpuActivations;
use mirage_runtime::backend::{HostMatrix, TokenSlot};
use mirage_runtime::{Backend, CpuBackend};
use rayon::prelude::*;

use super::backend::{ActivationBackend, Slot};
use super::fit::{
    block_greedy, block_greedy_rows, fit_kappa, head_index, matrix_stats, mean_kl, mean_nll,
    sensitivity_rows, skipping_pays, thresholds_row, uniform_rows, CriterionStats, GreedyOptions,
    PathPoint,
};
use super::format::{
    write_bytes, ActivationContents, ActivationMeta, Allocation, MatrixScores, PlanMeta, PlanTable,
};
use super::graph::{head_matrix, projection, Graph};
use super::{matrix_index, Criterion, Proj};
use crate::build::BuildEvent;
use crate::error::{ArtifactError, Result};
use crate::format::sha256_hex;

/// Settings of an activation build.
#[derive(Debug, Clone)]
pub struct ActivationBuildOptions {
    /// Name of the calibration text (recorded).
    pub calib_name: String,
    /// The calibration text.
    pub calib_text: String,
    /// Calibration tokens whose projection inputs give the statistics.
    pub calib_tokens: usize,
    /// Of those, the first positions each layer's greedy search runs on.
    pub greedy_tokens: usize,
    /// Calibration tokens the sensitivities and perplexities are measured on.
    pub ppl_tokens: usize,
    /// The greedy search (TEAL's allocation).
    pub greedy: GreedyOptions,
    /// Model-wide targets of the plans' rows (ascending, from 0).
    pub targets: Vec<f32>,
    /// Sparsity at which sensitivities are measured.
    pub kappa_at: f32,
    /// CPU threads (0: all).
    pub threads: usize,
    /// Thresholds from the calibration statistics alone: the uniform plans
    /// only, no sensitivities, greedy search or sparse perplexities (the
    /// dense perplexity comes from the calibration pass itself). For speed
    /// measurements on models whose fidelity does not matter (synthetic
    /// weights): seconds instead of minutes on a 7B model.
    pub statistics_only: bool,
}

impl Default for ActivationBuildOptions {
    fn default() -> Self {
        ActivationBuildOptions {
            calib_name: String::new(),
            calib_text: String::new(),
            calib_tokens: 512,
            greedy_tokens: 64,
            ppl_tokens: 256,
            greedy: GreedyOptions::default(),
            targets: (0..=16).map(|k| k as f32 * 0.05).collect(),
            kappa_at: 0.4,
            threads: 0,
            statistics_only: false,
        }
    }
}

/// What a build produced.
#[derive(Debug, Clone)]
pub struct ActivationBuildOutput {
    /// The file's bytes.
    pub bytes: Vec<u8>,
    /// Its META.
    pub meta: ActivationMeta,
    /// Bytes of the source's matrices (projections and head).
    pub source_bytes: u64,
    /// Bytes of their channel-major form.
    pub repacked_bytes: u64,
    /// Per layer: TEAL's greedy path.
    pub paths: Vec<Vec<PathPoint>>,
    /// Per matrix (the head last): the measured sensitivity.
    pub kappa: Vec<f64>,
    /// Per plan: (name, calibration perplexity per target; NaN: not measured).
    pub plan_ppl: Vec<(String, Vec<f32>)>,
    /// Seconds per stage.
    pub timings: Vec<(&'static str, f64)>,
}

fn plan_name(c: Criterion, a: Allocation) -> String {
    format!("{}/{}", c.name(), a.name())
}

/// The criteria's statistics of one matrix as stored (quantiles) and as
/// allocation uses them (error curves).
fn scores_of(norms: Vec<f32>, st: Vec<CriterionStats>) -> (MatrixScores, [Vec<f64>; 2]) {
    let [a, b]: [CriterionStats; 2] = st.try_into().expect("two criteria");
    (
        MatrixScores {
            col_norms: norms,
            quantiles: [a.quantiles, b.quantiles],
        },
        [a.error, b.error],
    )
}

/// Repacks one matrix; its column norms (of the dequantized source).
fn repack(h: &HostMatrix) -> Result<(channel_major::ChannelMajorLayout, Vec<u8>, Vec<f32>)> {
    let layout =
        channel_major::ChannelMajorLayout::new(h.ty, h.rows, h.cols).map_err(|e| {
            ArtifactError::InvalidArgument(format!(
                "{}: {e} (the channel-major layout takes Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K)",
                h.name
            ))
        })?;
    let src = h.data.as_slice();
    let mut cm = vec![0u8; layout.bytes()];
    channel_major::repack(&layout, src, &mut cm)?;
    let mut row = vec![0f32; h.cols];
    let rb = quant::row_bytes(h.ty, h.cols)?;
    let mut sq = vec![0f64; h.cols];
    for r in 0..h.rows {
        quant::dequantize(h.ty, &src[r * rb..(r + 1) * rb], &mut row)?;
        for (s, v) in sq.iter_mut().zip(&row) {
            *s += (*v as f64) * (*v as f64);
        }
    }
    Ok((layout, cm, sq.iter().map(|s| s.sqrt() as f32).collect()))
}

/// Builds an activation artifact for the model at `model_path`.
pub fn build_activation(
    model_path: &Path,
    opts: &ActivationBuildOptions,
    progress: &mut dyn FnMut(BuildEvent),
) -> Result<ActivationBuildOutput> {
    if opts.targets.first() != Some(&0.0)
        || opts.targets.windows(2).any(|w| w[1] <= w[0])
        || opts.targets.iter().any(|t| !(0.0..1.0).contains(t))
    {
        return Err(ArtifactError::InvalidArgument(
            "targets must rise from 0 and stay below 1".into(),
        ));
    }
    let mut timings = Vec::new();
    let t0 = Instant::now();
    let file = Arc::new(GgufFile::open(model_path)?);
    let source_sha256 = sha256_hex(file.as_bytes());
    let tokenizer = mirage_tokenizer::Tokenizer::from_gguf(&file)
        .map_err(|e| ArtifactError::InvalidArgument(format!("tokenizer: {e}")))?;
    let mut tokens = tokenizer
        .encode(&opts.calib_text, true, true)
        .map_err(|e| ArtifactError::InvalidArgument(format!("tokenizing: {e}")))?;
    let need = if opts.statistics_only {
        opts.calib_tokens
    } else {
        opts.calib_tokens.max(opts.ppl_tokens)
    };
    if tokens.len() < need.min(64) || tokens.len() < 2 || opts.greedy_tokens < 8 {
        return Err(ArtifactError::InvalidArgument(format!(
            "the calibration text gives {} tokens; at least {} are needed",
            tokens.len(),
            need.min(64)
        )));
    }
    tokens.truncate(need);
    let n_calib = opts.calib_tokens.min(tokens.len());
    let n_ppl = if opts.statistics_only {
        n_calib
    } else {
        opts.ppl_tokens.min(tokens.len())
    };
    let n_greedy = opts.greedy_tokens.min(n_calib);

    let cpu = CpuBackend::new(opts.threads)?;
    let config = mirage_runtime::ModelConfig::from_hparams(&file.hparams()?)?;
    let n_layer = config.n_layer;
    let backend = ActivationBackend::new(cpu, None, n_layer);
    let graph = Graph::load(&file, backend)?;
    let config = graph.config().clone();
    let d = config.n_embd;
    let n_mat = n_layer * Proj::ALL.len() + 1;
    let head = head_index(n_layer);

    // 1. Repack every projection and the head; column norms.
    progress(BuildEvent::Stage {
        name: "repack",
        total: n_mat,
    });
    let head_host = head_matrix(&file, &config)?;
    let hosts: Vec<HostMatrix> = (0..n_layer)
        .flat_map(|l| Proj::ALL.into_iter().map(move |p| (l, p)))
        .map(|(l, p)| projection(&file, &config, l, p))
        .chain(std::iter::once(Ok(head_host.clone())))
        .collect::<Result<_>>()?;
    let repacked: Vec<Result<_>> = graph
        .backend()
        .run(|| hosts.par_iter().map(repack).collect());
    let mut matrices = Vec::with_capacity(n_mat);
    let mut norms = Vec::with_capacity(n_mat);
    let (mut src_bytes, mut cm_bytes) = (0u64, 0u64);
    let bytes: Vec<f64> = hosts
        .iter()
        .map(|h| h.data.as_slice().len() as f64)
        .collect();
    for (r, h) in repacked.into_iter().zip(&hosts) {
        let (layout, cm, n) = r?;
        src_bytes += h.data.as_slice().len() as u64;
        cm_bytes += cm.len() as u64;
        matrices.push((layout, cm));
        norms.push(n);
        progress(BuildEvent::Step);
    }
    drop(hosts);
    timings.push(("repack", t0.elapsed().as_secs_f64()));

    // 2. Record the inputs layer by layer; statistics per matrix; each
    // layer's block input kept for the greedy search.
    let t1 = Instant::now();
    progress(BuildEvent::Stage {
        name: "calibrate",
        total: n_layer + 1,
    });
    let backend = graph.backend();
    let mut block_inputs: Vec<Vec<f32>> = Vec::with_capacity(n_layer);
    let mut scores: Vec<Option<MatrixScores>> = vec![None; n_mat];
    let mut errors: Vec<[Vec<f64>; 2]> = vec![[Vec::new(), Vec::new()]; n_mat];
    let mut calib_logits = Vec::new();
    {
        let slots: Vec<TokenSlot> = (0..n_calib).map(|pos| TokenSlot { seq: 0, pos }).collect();
        let mut cache = graph.new_cache(n_calib)?;
        let mut s = graph.scratch();
        let mut x = CpuActivations::default();
        backend.start_recording();
        backend.run(|| graph.embed(&tokens[..n_calib], &mut x))?;
        let mut stats_of = |rec: &[Vec<f32>], ms: Vec<(usize, usize)>| -> Result<()> {
            let done: Vec<(usize, Vec<CriterionStats>)> = backend.run(|| {
                ms.par_iter()
                    .map(|&(m, slot)| (m, matrix_stats(&rec[slot], &norms[m])))
                    .collect()
            });
            for (m, st) in done {
                if rec[ms.iter().find(|x| x.0 == m).expect("listed").1].is_empty() {
                    return Err(ArtifactError::InvalidArgument(format!(
                        "matrix {m}: nothing recorded"
                    )));
                }
                let (sc, er) = scores_of(norms[m].clone(), st);
                scores[m] = Some(sc);
                errors[m] = er;
            }
            Ok(())
        };
        for l in 0..n_layer {
            block_inputs.push(x.data()[..n_greedy * d].to_vec());
            backend.run(|| graph.layer(l, &mut x, &slots, &mut cache, &mut s))?;
            let rec = backend.take_recording();
            let ms = Proj::ALL
                .iter()
                .map(|&p| (matrix_index(l, p), Slot::input_of(p).index(l)))
                .collect();
            stats_of(&rec, ms)?;
            progress(BuildEvent::Step);
        }
        backend.run(|| graph.logits(&x, &mut s, &mut calib_logits))?;
        let rec = backend.take_recording();
        stats_of(&rec, vec![(head, Slot::head_index(n_layer))])?;
        progress(BuildEvent::Step);
        backend.stop_recording();
    }
    let scores: Vec<MatrixScores> = scores
        .into_iter()
        .map(|s| {
            s.ok_or_else(|| ArtifactError::InvalidArgument("a matrix got no statistics".into()))
        })
        .collect::<Result<_>>()?;
    timings.push(("calibrate", t1.elapsed().as_secs_f64()));

    if opts.statistics_only {
        let dense_ppl = mean_nll(&calib_logits, &tokens[..n_calib], config.vocab_size).exp();
        let (plan_metas, tables) = uniform_plans(&bytes, &opts.targets, dense_ppl);
        return finish(Finish {
            file: &file,
            model_path,
            opts,
            config: &config,
            head_name: &head_host.name,
            source_sha256,
            n_calib,
            n_ppl,
            dense_ppl,
            plan_metas,
            tables,
            default: 0,
            scores,
            matrices,
            src_bytes,
            cm_bytes,
            paths: Vec::new(),
            kappa: Vec::new(),
            timings,
        });
    }
    drop(calib_logits);
    // 3. Sensitivities: KL of the next-token distribution with each layer,
    // each projection kind and the head sparsified alone at `kappa_at`.
    let t2 = Instant::now();
    let ppl_toks = &tokens[..n_ppl];
    let vocab = config.vocab_size;
    let logits = |row: Option<&[f32]>, c: Criterion, toks: &[u32]| -> Result<Vec<f32>> {
        let thr = match row {
            Some(r) => thresholds_row(&scores, c, r),
            None => vec![None; n_mat],
        };
        backend.set_thresholds(thr)?;
        let out = graph.logits_all(toks, toks.len());
        backend.set_thresholds(vec![None; n_mat])?;
        out
    };
    let dense_logits = logits(None, Criterion::Teal, ppl_toks)?;
    let dense_ppl = mean_nll(&dense_logits, ppl_toks, vocab).exp();
    let n_sens = (n_ppl / 2).max(2);
    let sens_toks = &ppl_toks[..n_sens];
    let sens_dense = &dense_logits[..n_sens * vocab];
    progress(BuildEvent::Stage {
        name: "sensitivity",
        total: n_layer + 8,
    });
    let ka = opts.kappa_at;
    let kl_of = |pick: &dyn Fn(usize) -> bool| -> Result<f64> {
        let row: Vec<f32> = (0..n_mat).map(|m| if pick(m) { ka } else { 0.0 }).collect();
        Ok(mean_kl(
            sens_dense,
            &logits(Some(&row), Criterion::Teal, sens_toks)?,
            vocab,
        ))
    };
    let mut kl_layer = Vec::with_capacity(n_layer);
    for l in 0..n_layer {
        kl_layer.push(kl_of(&|m| m < head && m / 7 == l)?);
        progress(BuildEvent::Step);
    }
    let mut kl_proj = [0f64; 7];
    for (p, k) in kl_proj.iter_mut().enumerate() {
        *k = kl_of(&|m| m < head && m % 7 == p)?;
        progress(BuildEvent::Step);
    }
    let kl_head = kl_of(&|m| m == head)?;
    progress(BuildEvent::Step);
    let teal = Criterion::ALL
        .iter()
        .position(|&c| c == Criterion::Teal)
        .expect("in ALL");
    let e_ref: Vec<f64> = errors
        .iter()
        .map(|e| super::fit::error_at(&e[teal], ka))
        .collect();
    let kappa = fit_kappa(&e_ref, &kl_layer, &kl_proj, kl_head);
    timings.push(("sensitivity", t2.elapsed().as_secs_f64()));

    // 4. TEAL's block-wise greedy per layer (the baseline allocation).
    let t3 = Instant::now();
    progress(BuildEvent::Stage {
        name: "greedy (teal)",
        total: n_layer,
    });
    let mut paths = Vec::with_capacity(n_layer);
    for (l, x_in) in block_inputs.iter().enumerate() {
        paths.push(block_greedy(
            &graph,
            &scores,
            Criterion::Teal,
            l,
            x_in,
            &opts.greedy,
        )?);
        progress(BuildEvent::Step);
    }
    drop(block_inputs);
    timings.push(("greedy", t3.elapsed().as_secs_f64()));

    // 5. Plans; the calibration perplexity of ours at every target.
    let t4 = Instant::now();
    let targets = &opts.targets;
    let mut plan_metas = Vec::new();
    let mut tables = Vec::new();
    let plans: [(Criterion, Allocation); 7] = [
        (Criterion::Teal, Allocation::Uniform),
        (Criterion::Wina, Allocation::Uniform),
        (Criterion::Teal, Allocation::BlockGreedy),
        (Criterion::Teal, Allocation::Sensitivity),
        (Criterion::Wina, Allocation::Sensitivity),
        (Criterion::Teal, Allocation::SensitivityHead),
        (Criterion::Wina, Allocation::SensitivityHead),
    ];
    // Our allocations skip channels only where that saves time.
    let pays: Vec<bool> = matrices.iter().map(|(l, _)| skipping_pays(l)).collect();
    let mut pays_no_head = pays.clone();
    pays_no_head[head] = false;
    for (c, a) in plans {
        let ci = Criterion::ALL.iter().position(|&x| x == c).expect("in ALL");
        let curves: Vec<&[f64]> = errors.iter().map(|e| e[ci].as_slice()).collect();
        let rows = match a {
            Allocation::Uniform => uniform_rows(&bytes, targets),
            Allocation::BlockGreedy => block_greedy_rows(&paths, &bytes, targets),
            Allocation::Sensitivity => {
                sensitivity_rows(&bytes, &curves, &kappa, targets, &pays_no_head)
            }
            Allocation::SensitivityHead => {
                sensitivity_rows(&bytes, &curves, &kappa, targets, &pays)
            }
        };
        plan_metas.push(PlanMeta {
            name: plan_name(c, a),
            criterion: c,
            allocation: a,
            targets: targets.clone(),
        });
        tables.push(PlanTable {
            ppl: vec![f32::NAN; rows.len()],
            rows,
        });
    }
    let ours: Vec<usize> = plan_metas
        .iter()
        .enumerate()
        .filter(|(_, p)| p.allocation == Allocation::SensitivityHead)
        .map(|(i, _)| i)
        .collect();
    progress(BuildEvent::Stage {
        name: "calib ppl",
        total: ours.len() * targets.len(),
    });
    for &pi in &ours {
        let c = plan_metas[pi].criterion;
        for r in 0..targets.len() {
            let ppl = if r == 0 {
                dense_ppl
            } else {
                let lg = logits(Some(&tables[pi].rows[r].clone()), c, ppl_toks)?;
                mean_nll(&lg, ppl_toks, vocab).exp()
            };
            tables[pi].ppl[r] = ppl as f32;
            progress(BuildEvent::Step);
        }
    }
    // The default plan (what an unnamed plan runs where the measured plans
    // tie or none is measured): of our plans, the one with the lower mean
    // calibration perplexity over the targets up to 0.5.
    let mean_ppl = |pi: usize| -> f64 {
        let v: Vec<f64> = targets
            .iter()
            .zip(&tables[pi].ppl)
            .filter(|(t, _)| **t <= 0.5 + 1e-6)
            .map(|(_, p)| *p as f64)
            .collect();
        v.iter().sum::<f64>() / v.len().max(1) as f64
    };
    let default = *ours
        .iter()
        .min_by(|a, b| mean_ppl(**a).total_cmp(&mean_ppl(**b)))
        .expect("two plans of ours");
    timings.push(("calib ppl", t4.elapsed().as_secs_f64()));

    finish(Finish {
        file: &file,
        model_path,
        opts,
        config: &config,
        head_name: &head_host.name,
        source_sha256,
        n_calib,
        n_ppl,
        dense_ppl,
        plan_metas,
        tables,
        default,
        scores,
        matrices,
        src_bytes,
        cm_bytes,
        paths,
        kappa,
        timings,
    })
}

/// The uniform plans (TEAL's and WINA's criterion), perplexity measured at
/// 0 only.
fn uniform_plans(
    bytes: &[f64],
    targets: &[f32],
    dense_ppl: f64,
) -> (Vec<PlanMeta>, Vec<PlanTable>) {
    let (mut metas, mut tables) = (Vec::new(), Vec::new());
    for c in [Criterion::Teal, Criterion::Wina] {
        let rows = uniform_rows(bytes, targets);
        let mut ppl = vec![f32::NAN; rows.len()];
        ppl[0] = dense_ppl as f32;
        metas.push(PlanMeta {
            name: plan_name(c, Allocation::Uniform),
            criterion: c,
            allocation: Allocation::Uniform,
            targets: targets.to_vec(),
        });
        tables.push(PlanTable { ppl, rows });
    }
    (metas, tables)
}

/// What the last stage writes the artifact from.
struct Finish<'a> {
    file: &'a GgufFile,
    model_path: &'a Path,
    opts: &'a ActivationBuildOptions,
    config: &'a mirage_runtime::ModelConfig,
    head_name: &'a str,
    source_sha256: String,
    n_calib: usize,
    n_ppl: usize,
    dense_ppl: f64,
    plan_metas: Vec<PlanMeta>,
    tables: Vec<PlanTable>,
    default: usize,
    scores: Vec<MatrixScores>,
    matrices: Vec<(channel_major::ChannelMajorLayout, Vec<u8>)>,
    src_bytes: u64,
    cm_bytes: u64,
    paths: Vec<Vec<PathPoint>>,
    kappa: Vec<f64>,
    timings: Vec<(&'static str, f64)>,
}

fn finish(f: Finish<'_>) -> Result<ActivationBuildOutput> {
    let Finish {
        file,
        model_path,
        opts,
        config,
        head_name,
        source_sha256,
        n_calib,
        n_ppl,
        dense_ppl,
        plan_metas,
        tables,
        default,
        scores,
        matrices,
        src_bytes,
        cm_bytes,
        paths,
        kappa,
        timings,
    } = f;
    let n_layer = config.n_layer;
    let d = config.n_embd;
    let meta = ActivationMeta {
        kind: "activation".into(),
        arch: file
            .hparams()
            .map(|h| format!("{:?}", h.arch).to_lowercase())
            .unwrap_or_default(),
        n_layer,
        d_model: d,
        n_ff: config.n_ff,
        source_name: model_path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        head_tensor: head_name.to_string(),
        source_sha256,
        calib_name: opts.calib_name.clone(),
        calib_sha256: sha256_hex(opts.calib_text.as_bytes()),
        calib_tokens: n_calib,
        ppl_tokens: n_ppl,
        dense_calib_ppl: dense_ppl,
        default_plan: plan_metas[default].name.clone(),
        plans: plan_metas,
    };
    let plan_ppl = meta
        .plans
        .iter()
        .zip(&tables)
        .map(|(p, t)| (p.name.clone(), t.ppl.clone()))
        .collect();
    let contents = ActivationContents {
        meta: meta.clone(),
        scores,
        plans: tables,
    };
    let bytes = write_bytes(&contents, &matrices)?;
    Ok(ActivationBuildOutput {
        bytes,
        meta,
        source_bytes: src_bytes,
        repacked_bytes: cm_bytes,
        paths,
        kappa,
        plan_ppl,
        timings,
    })
}
