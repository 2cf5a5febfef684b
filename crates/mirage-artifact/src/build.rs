//! The builder: calibration, page formation, router/predictor fitting,
//! budget plan, packing, serialization. [`build`] is the whole pipeline;
//! `cargo xtask build-artifacts` is its frontend.

use std::sync::Arc;
use std::time::Instant;

use mirage_gguf::{quant, GgmlType, GgufFile};
use mirage_runtime::observe::observe_ffn_inputs;
use mirage_runtime::{CpuBackend, Engine, EngineOptions, KvDtype};
use rayon::prelude::*;

use crate::budget::{solve_budget, BudgetLayer, BudgetPlan};
use crate::error::{ArtifactError, Result};
use crate::ffn::{axpy, FfnF32};
use crate::fit::{fit_layer_router, predictor_scores};
use crate::format::{page_stride, sha256_hex, write_bytes, ArtifactMeta, LayerData, PAGE_CHANNELS};
use crate::metrics::{oracle_useful_set, ORACLE_COSINE, RECALL_GATE};
use crate::pack::{effective_quant, pack_page};

/// Builder settings.
#[derive(Debug, Clone)]
pub struct BuildOptions {
    /// Name of the calibration text (recorded in the artifact).
    pub calib_name: String,
    /// The calibration text.
    pub calib_text: String,
    /// Most calibration tokens to run.
    pub max_calib_tokens: usize,
    /// Page quantization (K-quants fall back to Q8_0 where d_model % 256 != 0).
    pub quant: GgmlType,
    /// Router slices.
    pub slices: usize,
    /// Predictor rank.
    pub predictor_rank: usize,
    /// A page whose oracle frequency reaches this joins the trunk.
    pub trunk_freq: f32,
    /// Share of calibration tokens held out to choose the default margin and
    /// predictor threshold.
    pub validation_fraction: f32,
    /// Size budget of the artifact file in bytes (None: keep every page).
    pub budget_bytes: Option<u64>,
    /// CPU threads of the calibration forward pass (0: all).
    pub threads: usize,
}

impl Default for BuildOptions {
    fn default() -> Self {
        BuildOptions {
            calib_name: String::new(),
            calib_text: String::new(),
            max_calib_tokens: 2048,
            quant: GgmlType::Q8_0,
            slices: 4,
            predictor_rank: 16,
            trunk_freq: 0.9,
            validation_fraction: 0.2,
            budget_bytes: None,
            threads: 0,
        }
    }
}

/// Progress of a build, for frontends to draw.
#[derive(Debug, Clone, PartialEq)]
pub enum BuildEvent {
    /// A stage started (`total` steps).
    Stage {
        /// Stage name.
        name: &'static str,
        /// Steps it has.
        total: usize,
    },
    /// One step of the current stage finished.
    Step,
}

/// One layer's line in the summary.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerSummary {
    /// Pages stored.
    pub pages: usize,
    /// Trunk pages.
    pub trunk: usize,
    /// Pages of the source model.
    pub source_pages: usize,
    /// Quantization.
    pub quant: GgmlType,
    /// Bytes of packed pages (with alignment).
    pub page_bytes: usize,
    /// Mean oracle set size on calibration tokens.
    pub mean_oracle_pages: f64,
}

/// What a build produced.
#[derive(Debug, Clone)]
pub struct BuildOutput {
    /// The artifact file's bytes.
    pub bytes: Vec<u8>,
    /// Its META.
    pub meta: ArtifactMeta,
    /// Per layer.
    pub layers: Vec<LayerSummary>,
    /// Seconds per stage.
    pub timings: Vec<(&'static str, f64)>,
    /// Things the caller should tell the user (fallbacks).
    pub notes: Vec<String>,
    /// The budget plan, when a budget was given.
    pub plan: Option<BudgetPlan>,
    /// Mean recall of the default BVH margin on the validation tokens.
    pub validation_bvh_recall: f64,
    /// Mean recall of the default predictor threshold on the validation tokens.
    pub validation_predictor_recall: f64,
}

/// Margins (in std units) the builder tries on validation tokens.
pub const MARGIN_GRID: [f32; 12] = [0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0];
/// Predictor thresholds the builder tries, strictest first.
pub const THRESHOLD_GRID: [f32; 12] = [
    0.5, 0.4, 0.3, 0.2, 0.15, 0.1, 0.05, 0.02, 0.0, -0.05, -0.1, -0.3,
];

/// Quant types the budget solver may pick, largest first.
fn quant_ladder(d_model: usize) -> Vec<GgmlType> {
    [
        GgmlType::Q8_0,
        GgmlType::Q5_0,
        GgmlType::Q4_0,
        GgmlType::Q2_K,
    ]
    .into_iter()
    .filter(|t| d_model.is_multiple_of(t.block_size()))
    .collect()
}

/// Relative squared error of re-quantizing some rows to `ty`.
fn quant_error(rows: &[f32], d: usize, ty: GgmlType) -> Result<f64> {
    let rb = quant::row_bytes(ty, d)?;
    let mut q = vec![0u8; rb];
    let mut back = vec![0f32; d];
    let (mut err, mut tot) = (0f64, 0f64);
    for r in rows.chunks_exact(d) {
        quant::quantize(ty, r, &mut q)?;
        quant::dequantize(ty, &q, &mut back)?;
        for (a, b) in r.iter().zip(&back) {
            err += ((a - b) as f64).powi(2);
            tot += (*a as f64).powi(2);
        }
    }
    Ok(if tot > 0.0 { err / tot } else { 0.0 })
}

/// Groups channels into pages: hottest unassigned channel seeds a page,
/// which takes the unassigned channels whose activity (|h| times the down
/// column norm, over calibration tokens) is most correlated with the seed's.
/// Deterministic (ties: hotness order, then index).
pub fn form_pages(activity: &[f32], n_tokens: usize, n_ff: usize) -> Vec<usize> {
    // activity: channel-major [n_ff][n_tokens].
    let hot: Vec<f64> = (0..n_ff)
        .map(|i| {
            activity[i * n_tokens..(i + 1) * n_tokens]
                .iter()
                .map(|v| *v as f64)
                .sum()
        })
        .collect();
    let norms: Vec<f64> = (0..n_ff)
        .map(|i| {
            activity[i * n_tokens..(i + 1) * n_tokens]
                .iter()
                .map(|v| (*v as f64).powi(2))
                .sum::<f64>()
                .sqrt()
        })
        .collect();
    let mut order: Vec<usize> = (0..n_ff).collect();
    order.sort_by(|&a, &b| hot[b].total_cmp(&hot[a]).then(a.cmp(&b)));
    let mut assigned = vec![false; n_ff];
    let mut perm = Vec::with_capacity(n_ff);
    for &seed in &order {
        if assigned[seed] {
            continue;
        }
        let s = &activity[seed * n_tokens..(seed + 1) * n_tokens];
        let mut scored: Vec<(f64, usize, usize)> = order
            .iter()
            .enumerate()
            .filter(|(_, &c)| !assigned[c] && c != seed)
            .map(|(rank, &c)| {
                let a = &activity[c * n_tokens..(c + 1) * n_tokens];
                let dotp: f64 = a
                    .iter()
                    .zip(s)
                    .map(|(x, y)| (*x as f64) * (*y as f64))
                    .sum();
                let den = norms[c] * norms[seed];
                (if den > 0.0 { dotp / den } else { 0.0 }, rank, c)
            })
            .collect();
        scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut page = vec![seed];
        page.extend(scored.iter().take(PAGE_CHANNELS - 1).map(|x| x.2));
        // Within a page keep hotness order.
        page.sort_by(|&a, &b| hot[b].total_cmp(&hot[a]).then(a.cmp(&b)));
        for &c in &page {
            assigned[c] = true;
        }
        perm.extend(page);
    }
    perm
}

struct LayerCalib {
    perm: Vec<u32>,
    n_pages: usize,
    n_trunk: usize,
    page_freq: Vec<f32>,
    page_energy: Vec<f64>,
    quant_err: Vec<(GgmlType, f64)>,
    mean_oracle: f64,
    fitted: crate::fit::FittedRouter,
    channel_mean_abs: Vec<f32>,
    channel_oracle_freq: Vec<f32>,
    // Validation: per grid value, (recall sum, routed candidates), and count.
    val_margin: Vec<(f64, usize)>,
    val_threshold: Vec<(f64, usize)>,
    val_tokens: usize,
}

/// Runs the whole pipeline on a model file.
pub fn build(
    model_path: &std::path::Path,
    opts: &BuildOptions,
    progress: &mut dyn FnMut(BuildEvent),
) -> Result<BuildOutput> {
    let mut timings = Vec::new();
    let t0 = Instant::now();
    let file = Arc::new(GgufFile::open(model_path)?);
    let source_sha256 = sha256_hex(file.as_bytes());
    let hp = file.hparams()?;
    let (n_layer, d, n_ff) = (hp.n_layer, hp.n_embd, hp.n_ff);
    if n_ff % PAGE_CHANNELS != 0 {
        return Err(ArtifactError::InvalidArgument(format!(
            "n_ff {n_ff} is not a multiple of {PAGE_CHANNELS}"
        )));
    }
    if opts.slices == 0 || opts.slices > mirage_route::MAX_SLICES || opts.predictor_rank == 0 {
        return Err(ArtifactError::InvalidArgument(
            "slices must be 1..=32 and predictor rank > 0".into(),
        ));
    }
    let source_pages = n_ff / PAGE_CHANNELS;
    let mut notes = Vec::new();
    let quant = effective_quant(opts.quant, d);
    if quant != opts.quant {
        notes.push(format!(
            "{} needs d_model % {} == 0; d_model = {d}, so pages are packed as {} (llama.cpp's fallback)",
            opts.quant,
            opts.quant.block_size(),
            quant
        ));
    }
    // Refuse an impossible budget before the expensive part.
    if let Some(budget) = opts.budget_bytes {
        let ladder = quant_ladder(d);
        let smallest = *ladder.last().unwrap_or(&GgmlType::Q8_0);
        let min = crate::budget::fixed_bytes(
            n_layer,
            d,
            n_ff,
            source_pages,
            opts.slices,
            opts.predictor_rank,
        ) + n_layer as u64 * page_stride(smallest, d)? as u64;
        if budget < min {
            return Err(ArtifactError::BudgetTooSmall {
                budget,
                min_bytes: min,
            });
        }
    }
    timings.push(("load", t0.elapsed().as_secs_f64()));

    // 1. Calibration forward pass.
    let t1 = Instant::now();
    let engine = Engine::from_file(
        file.clone(),
        CpuBackend::new(opts.threads)?,
        EngineOptions {
            threads: opts.threads,
            ..EngineOptions::default()
        },
    )?;
    let mut tokens = engine.encode(&opts.calib_text, true)?;
    tokens.truncate(opts.max_calib_tokens.min(engine.n_ctx()));
    let n_tok = tokens.len();
    let n_val = ((n_tok as f32 * opts.validation_fraction) as usize).min(n_tok.saturating_sub(16));
    let n_fit = n_tok - n_val;
    if n_fit < 16 {
        return Err(ArtifactError::InvalidArgument(format!(
            "calibration text gives {n_tok} tokens; need at least 16"
        )));
    }
    let mut xs: Vec<Vec<f32>> = vec![Vec::with_capacity(n_tok * d); n_layer];
    let chunk = 128;
    progress(BuildEvent::Stage {
        name: "calibrate",
        total: n_tok.div_ceil(chunk),
    });
    observe_ffn_inputs(
        engine.model(),
        &tokens,
        chunk,
        KvDtype::F32,
        &mut |l, _first, x| xs[l].extend_from_slice(x),
        &mut |_, _| progress(BuildEvent::Step),
    )?;
    drop(engine);
    timings.push(("calibrate", t1.elapsed().as_secs_f64()));

    // 2-4. Per layer: page formation, oracle sets, router and predictor fit.
    let t2 = Instant::now();
    progress(BuildEvent::Stage {
        name: "pages+router",
        total: n_layer,
    });
    let mut calibs = Vec::with_capacity(n_layer);
    for (l, x) in xs.iter().enumerate() {
        calibs.push(calibrate_layer(&file, l, d, n_ff, x, n_tok, n_fit, opts)?);
        progress(BuildEvent::Step);
    }
    drop(xs);
    timings.push(("pages+router", t2.elapsed().as_secs_f64()));

    // Defaults chosen on the held-out calibration tokens.
    let pick = |vals: &dyn Fn(&LayerCalib) -> &Vec<(f64, usize)>, n: usize| -> (usize, f64) {
        let tot: usize = calibs.iter().map(|c| c.val_tokens).sum();
        let rec = |i: usize| calibs.iter().map(|c| vals(c)[i].0).sum::<f64>() / tot.max(1) as f64;
        (0..n)
            .find(|&i| rec(i) >= RECALL_GATE)
            .map(|i| (i, rec(i)))
            .unwrap_or((n - 1, rec(n - 1)))
    };
    let (mi, validation_bvh_recall) = pick(&|c| &c.val_margin, MARGIN_GRID.len());
    let (ti, validation_predictor_recall) = pick(&|c| &c.val_threshold, THRESHOLD_GRID.len());

    // Budget plan.
    let mut kept: Vec<(usize, GgmlType)> = calibs.iter().map(|c| (c.n_pages, quant)).collect();
    let plan = if let Some(budget) = opts.budget_bytes {
        let layers: Vec<BudgetLayer> = calibs
            .iter()
            .map(|c| BudgetLayer {
                page_energy: c.page_energy.clone(),
                quant_err: c.quant_err.clone(),
            })
            .collect();
        let plan = solve_budget(&layers, d, n_ff, opts.slices, opts.predictor_rank, budget)?;
        kept = plan.layers.iter().map(|p| (p.pages, p.quant)).collect();
        Some(plan)
    } else {
        None
    };

    // 5. Packing.
    let t3 = Instant::now();
    progress(BuildEvent::Stage {
        name: "pack",
        total: n_layer,
    });
    let mut layer_data = Vec::with_capacity(n_layer);
    let mut pages = Vec::with_capacity(n_layer);
    let mut summaries = Vec::with_capacity(n_layer);
    for (l, c) in calibs.into_iter().enumerate() {
        let (k, q) = kept[l];
        let perm: Vec<usize> = c.perm.iter().map(|&v| v as usize).collect();
        let ffn = FfnF32::from_gguf(&file, l, d, n_ff)?.permuted(&perm);
        let lp: Vec<Vec<u8>> = (0..k)
            .into_par_iter()
            .map(|p| pack_page(&ffn, p, q))
            .collect::<Result<_>>()?;
        pages.push(lp);
        let n_trunk = c.n_trunk.min(k);
        let mut router = c.fitted.router.clone();
        router.boxes.truncate(k * opts.slices);
        router.thresholds.truncate(k);
        for (p, t) in router.thresholds.iter_mut().enumerate() {
            *t = if p < n_trunk { 0 } else { opts.slices as u32 };
        }
        let r1 = opts.predictor_rank + 1;
        summaries.push(LayerSummary {
            pages: k,
            trunk: n_trunk,
            source_pages,
            quant: q,
            page_bytes: k * page_stride(q, d)?,
            mean_oracle_pages: c.mean_oracle,
        });
        layer_data.push(LayerData {
            n_pages: k,
            n_trunk,
            quant: q,
            perm: c.perm[..k * PAGE_CHANNELS].to_vec(),
            page_freq: c.page_freq[..k].to_vec(),
            router,
            margin_scale: c.fitted.margin_scale,
            predictor_proj: c.fitted.predictor_proj,
            predictor_weights: c.fitted.predictor_weights[..k * r1].to_vec(),
            channel_mean_abs: c.channel_mean_abs,
            channel_oracle_freq: c.channel_oracle_freq,
        });
        progress(BuildEvent::Step);
    }
    timings.push(("pack", t3.elapsed().as_secs_f64()));
    let meta = ArtifactMeta {
        arch: hp.arch.name().to_string(),
        n_layer,
        d_model: d,
        n_ff,
        page_channels: PAGE_CHANNELS,
        source_name: model_path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        source_sha256,
        calib_name: opts.calib_name.clone(),
        calib_sha256: sha256_hex(opts.calib_text.as_bytes()),
        calib_tokens: n_tok,
        fit_tokens: n_fit,
        slices: opts.slices,
        predictor_rank: opts.predictor_rank,
        oracle_cosine: ORACLE_COSINE,
        default_margin: MARGIN_GRID[mi],
        default_predictor_threshold: THRESHOLD_GRID[ti],
    };
    let t4 = Instant::now();
    let bytes = write_bytes(&meta, &layer_data, &pages)?;
    timings.push(("write", t4.elapsed().as_secs_f64()));
    Ok(BuildOutput {
        bytes,
        meta,
        layers: summaries,
        timings,
        notes,
        plan,
        validation_bvh_recall,
        validation_predictor_recall,
    })
}

#[allow(clippy::too_many_arguments)]
fn calibrate_layer(
    file: &GgufFile,
    l: usize,
    d: usize,
    n_ff: usize,
    x: &[f32],
    n_tok: usize,
    n_fit: usize,
    opts: &BuildOptions,
) -> Result<LayerCalib> {
    let n_pages = n_ff / PAGE_CHANNELS;
    let ffn = FfnF32::from_gguf(file, l, d, n_ff)?;
    // Hidden activations, token-major.
    let mut h = vec![0f32; n_tok * n_ff];
    h.par_chunks_mut(n_ff)
        .enumerate()
        .for_each(|(t, ht)| ffn.hidden(&x[t * d..(t + 1) * d], ht));
    let down_norm: Vec<f32> = (0..n_ff)
        .map(|i| {
            ffn.down_t[i * d..(i + 1) * d]
                .iter()
                .map(|v| v * v)
                .sum::<f32>()
                .sqrt()
        })
        .collect();
    let mut activity = vec![0f32; n_ff * n_tok];
    let mut channel_mean_abs = vec![0f32; n_ff];
    for t in 0..n_tok {
        for i in 0..n_ff {
            let a = h[t * n_ff + i].abs();
            activity[i * n_tok + t] = a * down_norm[i];
            channel_mean_abs[i] += a / n_tok as f32;
        }
    }
    // Pages are formed on the fit tokens only.
    let fit_activity: Vec<f32> = (0..n_ff)
        .flat_map(|i| activity[i * n_tok..i * n_tok + n_fit].iter().copied())
        .collect();
    let perm0 = form_pages(&fit_activity, n_fit, n_ff);
    drop(activity);
    let ffn0 = ffn.permuted(&perm0);
    // Oracle sets and per-page energy shares, per token.
    let per_token: Vec<(Vec<usize>, Vec<f64>)> = (0..n_tok)
        .into_par_iter()
        .map(|t| {
            let hp: Vec<f32> = perm0.iter().map(|&i| h[t * n_ff + i]).collect();
            let mut contrib = vec![0f32; n_pages * d];
            ffn0.page_contributions(&hp, PAGE_CHANNELS, &mut contrib);
            let mut y = vec![0f32; d];
            for p in 0..n_pages {
                axpy(&mut y, 1.0, &contrib[p * d..(p + 1) * d]);
            }
            let yy: f64 = y
                .iter()
                .map(|v| (*v as f64).powi(2))
                .sum::<f64>()
                .max(1e-30);
            let energy = (0..n_pages)
                .map(|p| {
                    contrib[p * d..(p + 1) * d]
                        .iter()
                        .map(|v| (*v as f64).powi(2))
                        .sum::<f64>()
                        / yy
                })
                .collect();
            (oracle_useful_set(&contrib, d, ORACLE_COSINE), energy)
        })
        .collect();
    drop(h);
    let mut freq0 = vec![0f64; n_pages];
    let mut energy0 = vec![0f64; n_pages];
    for (set, e) in &per_token[..n_fit] {
        for &p in set {
            freq0[p] += 1.0 / n_fit as f64;
        }
        for p in 0..n_pages {
            energy0[p] += e[p] / n_fit as f64;
        }
    }
    // Order pages by oracle frequency (prefix slicing), then energy.
    let mut page_order: Vec<usize> = (0..n_pages).collect();
    page_order.sort_by(|&a, &b| {
        freq0[b]
            .total_cmp(&freq0[a])
            .then(energy0[b].total_cmp(&energy0[a]))
            .then(a.cmp(&b))
    });
    let mut new_index = vec![0usize; n_pages];
    for (new, &old) in page_order.iter().enumerate() {
        new_index[old] = new;
    }
    let perm: Vec<u32> = page_order
        .iter()
        .flat_map(|&p| {
            perm0[p * PAGE_CHANNELS..(p + 1) * PAGE_CHANNELS]
                .iter()
                .map(|&c| c as u32)
        })
        .collect();
    let useful: Vec<Vec<usize>> = per_token
        .iter()
        .map(|(s, _)| {
            let mut v: Vec<usize> = s.iter().map(|&p| new_index[p]).collect();
            v.sort_unstable();
            v
        })
        .collect();
    let page_freq: Vec<f32> = page_order.iter().map(|&p| freq0[p] as f32).collect();
    let page_energy: Vec<f64> = page_order.iter().map(|&p| energy0[p]).collect();
    let n_trunk = page_freq
        .iter()
        .take_while(|&&f| f >= opts.trunk_freq)
        .count();
    let mut channel_oracle_freq = vec![0f32; n_ff];
    for (k, &c) in perm.iter().enumerate() {
        channel_oracle_freq[c as usize] = page_freq[k / PAGE_CHANNELS];
    }
    let mean_oracle = useful[..n_fit].iter().map(|s| s.len() as f64).sum::<f64>() / n_fit as f64;
    let fitted = fit_layer_router(
        &x[..n_fit * d],
        d,
        &useful[..n_fit],
        n_pages,
        n_trunk,
        opts.slices,
        opts.predictor_rank,
    );
    // Validation sweep.
    let mut val_margin = vec![(0f64, 0usize); MARGIN_GRID.len()];
    let mut val_threshold = vec![(0f64, 0usize); THRESHOLD_GRID.len()];
    let routers: Vec<mirage_route::RouterData> = MARGIN_GRID
        .iter()
        .map(|&m| {
            let mut r = fitted.router.clone();
            for (i, b) in r.boxes.iter_mut().enumerate() {
                for a in 0..3 {
                    let s = m * fitted.margin_scale[(i % opts.slices) * 3 + a];
                    b.min[a] -= s;
                    b.max[a] += s;
                }
            }
            r
        })
        .collect();
    let mut bvhs: Vec<mirage_route::CpuBvh> = routers
        .iter()
        .map(mirage_route::CpuBvh::new)
        .collect::<std::result::Result<_, _>>()?;
    let mut pts = Vec::new();
    let mut scores = Vec::new();
    for t in n_fit..n_tok {
        let xt = &x[t * d..(t + 1) * d];
        pts.clear();
        fitted.router.project_into(xt, &mut pts)?;
        for (g, bvh) in bvhs.iter_mut().enumerate() {
            use mirage_route::Router;
            let set = bvh.route(&pts)?;
            let r = crate::metrics::recall(&useful[t], |p| set.contains(0, p));
            val_margin[g].0 += r;
            val_margin[g].1 += (n_trunk..n_pages).filter(|&p| set.contains(0, p)).count();
        }
        predictor_scores(
            &fitted.predictor_proj,
            &fitted.predictor_weights,
            opts.predictor_rank,
            d,
            xt,
            &mut scores,
        );
        for (g, &tau) in THRESHOLD_GRID.iter().enumerate() {
            let on = |p: usize| p < n_trunk || scores[p] >= tau;
            val_threshold[g].0 += crate::metrics::recall(&useful[t], on);
            val_threshold[g].1 += (n_trunk..n_pages).filter(|&p| on(p)).count();
        }
    }
    let sample_rows = 8.min(n_ff);
    let mut rows = Vec::new();
    for m in [&ffn.gate, &ffn.up, &ffn.down_t] {
        rows.extend_from_slice(&m[..sample_rows * d]);
    }
    let quant_err = quant_ladder(d)
        .into_iter()
        .map(|t| quant_error(&rows, d, t).map(|e| (t, e)))
        .collect::<Result<_>>()?;
    Ok(LayerCalib {
        perm,
        n_pages,
        n_trunk,
        page_freq,
        page_energy,
        quant_err,
        mean_oracle,
        fitted,
        channel_mean_abs,
        channel_oracle_freq,
        val_margin,
        val_threshold,
        val_tokens: n_tok - n_fit,
    })
}
