//! Building an activation-sparsity artifact from a GGUF model and a
//! calibration text: repack the projections channel-major, record every
//! projection's inputs on the calibration tokens, fit score quantiles, run
//! TEAL's block-wise greedy per layer and criterion, measure each layer's
//! sensitivity, tabulate the plans and the calibration perplexity of the
//! default plan at every target. `cargo xtask build-artifacts --mode
//! activation` is its frontend.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use mirage_gguf::quant::{self, channel_major};
use mirage_gguf::GgufFile;
use mirage_runtime::backend::cpu::CpuActivations;
use mirage_runtime::backend::TokenSlot;
use mirage_runtime::{Backend, CpuBackend};
use rayon::prelude::*;

use super::backend::ActivationBackend;
use super::fit::{
    block_greedy, block_greedy_rows, mean_kl, mean_nll, path_at, sensitivity_rows, thresholds_row,
    uniform_rows, GreedyOptions, PathPoint,
};
use super::format::{
    write_bytes, ActivationContents, ActivationMeta, Allocation, PlanMeta, PlanTable,
};
use super::graph::{projection, Graph};
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
    /// Calibration tokens whose projection inputs give the quantiles.
    pub calib_tokens: usize,
    /// Of those, the first positions each layer's greedy search runs on.
    pub greedy_tokens: usize,
    /// Calibration tokens the sensitivities and perplexities are measured on.
    pub ppl_tokens: usize,
    /// The greedy search.
    pub greedy: GreedyOptions,
    /// Model-wide targets of the plans' rows (ascending, from 0).
    pub targets: Vec<f32>,
    /// Layer sparsity at which sensitivities are measured.
    pub kappa_at: f32,
    /// CPU threads (0: all).
    pub threads: usize,
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
            kappa_at: 0.5,
            threads: 0,
        }
    }
}

/// The default plan: WINA scores, layers' shares by sensitivity.
pub const DEFAULT_PLAN: &str = "wina/layer-sensitivity";

/// What a build produced.
#[derive(Debug, Clone)]
pub struct ActivationBuildOutput {
    /// The file's bytes.
    pub bytes: Vec<u8>,
    /// Its META.
    pub meta: ActivationMeta,
    /// Bytes of the source's projections and of their channel-major form.
    pub source_projection_bytes: u64,
    /// Bytes of the channel-major projections.
    pub repacked_bytes: u64,
    /// Per layer and criterion: the greedy path.
    pub paths: Vec<Vec<Vec<PathPoint>>>,
    /// Per layer: the measured sensitivity.
    pub kappa: Vec<f64>,
    /// Seconds per stage.
    pub timings: Vec<(&'static str, f64)>,
}

fn plan_name(c: Criterion, a: Allocation) -> String {
    format!("{}/{}", c.name(), a.name())
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
    let need = opts.calib_tokens.max(opts.ppl_tokens);
    if tokens.len() < need.min(64) || opts.greedy_tokens < 8 {
        return Err(ArtifactError::InvalidArgument(format!(
            "the calibration text gives {} tokens; at least {} are needed",
            tokens.len(),
            need.min(64)
        )));
    }
    tokens.truncate(need);
    let n_calib = opts.calib_tokens.min(tokens.len());
    let n_ppl = opts.ppl_tokens.min(tokens.len());
    let n_greedy = opts.greedy_tokens.min(n_calib);

    let cpu = CpuBackend::new(opts.threads)?;
    let config = mirage_runtime::ModelConfig::from_hparams(&file.hparams()?)?;
    let n_layer = config.n_layer;
    let backend = ActivationBackend::new(cpu, None, n_layer);
    let graph = Graph::load(&file, backend)?;
    let config = graph.config().clone();
    let d = config.n_embd;

    // 1. Repack every projection; column norms of the dequantized source.
    let n_mat = n_layer * Proj::ALL.len();
    progress(BuildEvent::Stage {
        name: "repack",
        total: n_mat,
    });
    let ids: Vec<(usize, Proj)> = (0..n_layer)
        .flat_map(|l| Proj::ALL.into_iter().map(move |p| (l, p)))
        .collect();
    let repacked: Vec<Result<(channel_major::ChannelMajorLayout, Vec<u8>, Vec<f32>, u64)>> =
        graph.backend().run(|| {
            ids.par_iter()
                .map(|&(l, p)| {
                    let h = projection(&file, &config, l, p)?;
                    let layout = channel_major::ChannelMajorLayout::new(h.ty, h.rows, h.cols)
                        .map_err(|e| {
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
                    let norms = sq.iter().map(|s| s.sqrt() as f32).collect();
                    Ok((layout, cm, norms, src.len() as u64))
                })
                .collect()
        });
    let mut matrices = Vec::with_capacity(n_mat);
    let mut norms = Vec::with_capacity(n_mat);
    let (mut src_bytes, mut cm_bytes) = (0u64, 0u64);
    for r in repacked {
        let (layout, cm, n, sb) = r?;
        src_bytes += sb;
        cm_bytes += cm.len() as u64;
        matrices.push((layout, cm));
        norms.push(n);
        progress(BuildEvent::Step);
    }
    timings.push(("repack", t0.elapsed().as_secs_f64()));

    // 2. Record the projections' inputs; keep each layer's block input.
    let t1 = Instant::now();
    progress(BuildEvent::Stage {
        name: "calibrate",
        total: n_layer,
    });
    let backend = graph.backend();
    let mut block_inputs: Vec<Vec<f32>> = Vec::with_capacity(n_layer);
    {
        let slots: Vec<TokenSlot> = (0..n_calib).map(|pos| TokenSlot { seq: 0, pos }).collect();
        let mut cache = graph.new_cache(n_calib)?;
        let mut s = graph.scratch();
        let mut x = CpuActivations::default();
        backend.start_recording();
        backend.run(|| graph.embed(&tokens[..n_calib], &mut x))?;
        for l in 0..n_layer {
            block_inputs.push(x.data()[..n_greedy * d].to_vec());
            backend.run(|| graph.layer(l, &mut x, &slots, &mut cache, &mut s))?;
            progress(BuildEvent::Step);
        }
    }
    let recording = backend.take_recording();
    let scores = super::fit::quantile_tables(&recording, &norms)?;
    drop(recording);
    timings.push(("calibrate", t1.elapsed().as_secs_f64()));

    // 3. Greedy paths, per criterion and layer.
    let t2 = Instant::now();
    let mut paths: Vec<Vec<Vec<PathPoint>>> = vec![Vec::new(); n_layer];
    for c in Criterion::ALL {
        progress(BuildEvent::Stage {
            name: if c == Criterion::Teal {
                "greedy (teal)"
            } else {
                "greedy (wina)"
            },
            total: n_layer,
        });
        for (l, x_in) in block_inputs.iter().enumerate() {
            paths[l].push(block_greedy(&graph, &scores, c, l, x_in, &opts.greedy)?);
            progress(BuildEvent::Step);
        }
    }
    timings.push(("greedy", t2.elapsed().as_secs_f64()));

    // 4. Sensitivities (WINA paths), dense reference logits.
    let t3 = Instant::now();
    let ppl_toks = &tokens[..n_ppl];
    let vocab = config.vocab_size;
    let logits = |row: Option<&[f32]>, c: Criterion| -> Result<Vec<f32>> {
        let thr = match row {
            Some(r) => thresholds_row(&scores, c, r),
            None => vec![None; n_mat],
        };
        backend.set_thresholds(thr)?;
        let out = graph.logits_all(ppl_toks, n_ppl);
        backend.set_thresholds(vec![None; n_mat])?;
        out
    };
    let dense_logits = logits(None, Criterion::Teal)?;
    let dense_ppl = mean_nll(&dense_logits, ppl_toks, vocab).exp();
    progress(BuildEvent::Stage {
        name: "sensitivity",
        total: n_layer,
    });
    let wina = Criterion::ALL
        .iter()
        .position(|&c| c == Criterion::Wina)
        .expect("in ALL");
    let mut kappa = Vec::with_capacity(n_layer);
    for l in 0..n_layer {
        let pt = path_at(&paths[l][wina], opts.kappa_at);
        let mut row = vec![0f32; n_mat];
        for p in Proj::ALL {
            row[matrix_index(l, p)] = pt.sp[p.index()];
        }
        let kl = mean_kl(&dense_logits, &logits(Some(&row), Criterion::Wina)?, vocab);
        kappa.push(kl.max(1e-12) / (pt.err as f64).powi(2).max(1e-12));
        progress(BuildEvent::Step);
    }
    timings.push(("sensitivity", t3.elapsed().as_secs_f64()));

    // 5. Plans; the default plan's calibration perplexity per target.
    let t4 = Instant::now();
    let targets = &opts.targets;
    let mut plan_metas = Vec::new();
    let mut tables = Vec::new();
    for c in Criterion::ALL {
        let ci = Criterion::ALL.iter().position(|&x| x == c).expect("in ALL");
        let layer_paths: Vec<Vec<PathPoint>> = paths.iter().map(|p| p[ci].clone()).collect();
        for a in [
            Allocation::Uniform,
            Allocation::BlockGreedy,
            Allocation::LayerSensitivity,
        ] {
            let rows = match a {
                Allocation::Uniform => uniform_rows(n_layer, targets),
                Allocation::BlockGreedy => block_greedy_rows(&layer_paths, targets),
                Allocation::LayerSensitivity => sensitivity_rows(&layer_paths, &kappa, targets),
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
    }
    let di = plan_metas
        .iter()
        .position(|p| p.name == DEFAULT_PLAN)
        .expect("the default plan is built");
    progress(BuildEvent::Stage {
        name: "calib ppl",
        total: targets.len(),
    });
    for r in 0..targets.len() {
        let ppl = if r == 0 {
            dense_ppl
        } else {
            let lg = logits(Some(&tables[di].rows[r].clone()), Criterion::Wina)?;
            mean_nll(&lg, ppl_toks, vocab).exp()
        };
        tables[di].ppl[r] = ppl as f32;
        progress(BuildEvent::Step);
    }
    timings.push(("calib ppl", t4.elapsed().as_secs_f64()));

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
        source_sha256,
        calib_name: opts.calib_name.clone(),
        calib_sha256: sha256_hex(opts.calib_text.as_bytes()),
        calib_tokens: n_calib,
        ppl_tokens: n_ppl,
        dense_calib_ppl: dense_ppl,
        plans: plan_metas,
        default_plan: DEFAULT_PLAN.into(),
    };
    let contents = ActivationContents {
        meta: meta.clone(),
        scores,
        plans: tables,
    };
    let bytes = write_bytes(&contents, &matrices)?;
    Ok(ActivationBuildOutput {
        bytes,
        meta,
        source_projection_bytes: src_bytes,
        repacked_bytes: cm_bytes,
        paths,
        kappa,
        timings,
    })
}
