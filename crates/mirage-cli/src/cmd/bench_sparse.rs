//! `mirage-cli bench --artifact FILE | --synthetic-pages`: dense vs sparse
//! (superblock) decode on CUDA in one run.
//!
//! The dense CUDA backend decodes first. Then the sparse backend
//! ([`mirage::cuda::SparseCudaBackend`]) decodes the same prompt once per
//! forced page fraction (`--active`, the first pages by hotness: prefix
//! slicing through the fused page kernel) and, with `--routed`, with the
//! artifact's BVH router on the device. Per mode: decode tok/s and the
//! speed-up over dense, the median step, one layer's routing and FFN device
//! time (event-timed outside the graph, on a random input) and what is left
//! for the rest of the step, and the weight bytes a token reads (non-FFN
//! tensors + active pages). Every backend comes from `mirage::load_model`.
//!
//! With `--prefix-dense on` (default) each forced fraction below 1 is also
//! decoded as a dense model cut to its first pages
//! ([`mirage_artifact::prefix_slice`], in the artifact's page order or the
//! source order for synthetic pages) on a fresh dense backend: the prefix
//! slice through the dense kernels, the second baseline (`prefix X% dense`
//! rows).
//!
//! `--synthetic-pages` builds pages from the model's own FFN matrices
//! (128 consecutive channels per page, no calibration, no router): for
//! synthetic shapes such as `cargo xtask synth-model --like qwen2.5-7b`,
//! forced fractions only.
//!
//! `--page-format nvfp4` stores the pages as weight-only NVFP4 (requantized
//! at load from the model's gate/up/down, same page order) and runs
//! `superblock_ffn_nvfp4`; `--page-format q2_k` stores them as split Q2_K
//! (the GGUF's Q2_K gate/up rows verbatim, other types and the transposed
//! `W_down` quantized to Q2_K at load, same page order; `d_model` a multiple
//! of 256, checked before the dense run) and runs `superblock_ffn_q2k`; the
//! default `q8_0` runs `superblock_ffn_q8s`. The bytes per token count the
//! chosen format's pages. `--weights nvfp4`
//! requantizes the other matrices of both the dense and the sparse backend
//! (the dense FFN too), as in the plain bench.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use mirage::cuda::{RouteTraversal, SparsePages};
use mirage::{CudaPages, LoadedModel, PageFormat, WeightFormat};
use mirage_gguf::GgufFile;
use mirage_runtime::backend::Backend;
use mirage_runtime::{KvDtype, Model, TokenSlot};

use super::bench::{argmax, bench_prompt, BenchArgs};

/// One row of the table.
#[derive(Debug, serde::Serialize)]
struct Row {
    mode: String,
    /// Page encoding of the sparse FFN (`None` for dense).
    page_format: Option<String>,
    /// Encoding of the other matrices (`native` or `nvfp4`).
    weights: String,
    active_share: f64,
    decode_tok_s: f64,
    speedup: f64,
    step_ms: f64,
    route_us_layer: f64,
    ffn_us_layer: f64,
    rest_ms: f64,
    mib_per_token: f64,
}

struct Decode {
    tok_s: f64,
    median_ms: f64,
    /// Mean over steps of the summed active pages of every layer (sparse).
    mean_active_pages: Option<f64>,
}

fn decode<B: Backend>(
    model: &Model<B>,
    n_prompt: usize,
    n_gen: usize,
    mut after_step: impl FnMut() -> anyhow::Result<Option<usize>>,
) -> anyhow::Result<Decode> {
    let prompt = bench_prompt(model.config().vocab_size, n_prompt);
    let kv = KvDtype::F16;
    let mut cache = model.new_kv_cache(n_prompt + n_gen + 4, 1, kv)?;
    let mut scratch = model.new_scratch();
    let mut logits = Vec::new();
    let slots: Vec<TokenSlot> = (0..n_prompt).map(|pos| TokenSlot { seq: 0, pos }).collect();
    model.forward(
        &prompt,
        &slots,
        &[n_prompt - 1],
        &mut cache,
        &mut scratch,
        &mut logits,
    )?;
    let mut tok = argmax(&logits);
    // Two warm-up steps (graph capture) at the next positions, then timed.
    let mut pos = n_prompt;
    for _ in 0..2 {
        model.forward(
            &[tok],
            &[TokenSlot { seq: 0, pos }],
            &[0],
            &mut cache,
            &mut scratch,
            &mut logits,
        )?;
        tok = argmax(&logits);
        pos += 1;
    }
    let mut times = Vec::with_capacity(n_gen);
    let mut active_sum = 0usize;
    let mut active_n = 0usize;
    let t_all = Instant::now();
    let mut stats_s = 0.0;
    for _ in 0..n_gen.saturating_sub(2) {
        let t = Instant::now();
        model.forward(
            &[tok],
            &[TokenSlot { seq: 0, pos }],
            &[0],
            &mut cache,
            &mut scratch,
            &mut logits,
        )?;
        tok = argmax(&logits);
        times.push(t.elapsed().as_secs_f64());
        pos += 1;
        let ts = Instant::now();
        if let Some(a) = after_step()? {
            active_sum += a;
            active_n += 1;
        }
        stats_s += ts.elapsed().as_secs_f64();
    }
    let total = t_all.elapsed().as_secs_f64() - stats_s;
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(Decode {
        tok_s: times.len() as f64 / total,
        median_ms: times.get(times.len() / 2).copied().unwrap_or(f64::NAN) * 1e3,
        mean_active_pages: (active_n > 0).then(|| active_sum as f64 / active_n as f64),
    })
}

/// The dense model of `spec` (optionally cut to `file`), or why not.
fn dense_model(
    spec: &mirage::LoadSpec,
    file: Arc<GgufFile>,
) -> anyhow::Result<Model<mirage::cuda::CudaBackend>> {
    match mirage::load_model(spec, Some(file))? {
        LoadedModel::Cuda(m) => Ok(m),
        _ => bail!("--artifact / --synthetic-pages bench the CUDA backends: pass --backend cuda"),
    }
}

/// Runs the sparse bench (see the module doc).
pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    if args.backend != "cuda" {
        bail!("--artifact / --synthetic-pages bench the CUDA sparse backend: pass --backend cuda");
    }
    if args.artifact.is_some() == args.synthetic_pages {
        bail!("pass exactly one of --artifact FILE and --synthetic-pages");
    }
    if args.routed && args.synthetic_pages {
        bail!("--routed needs an artifact (synthetic pages have no router)");
    }
    let format = args.page_format.unwrap_or_default();
    let weights = args.weights;
    let fractions = if args.active.is_empty() {
        vec![1.0, 0.75, 0.5, 0.35, 0.25]
    } else {
        args.active.clone()
    };
    if let Some(f) = fractions.iter().find(|f| !(**f > 0.0 && **f <= 1.0)) {
        bail!("--active fractions must be in (0, 1], got {f}");
    }
    let file = Arc::new(
        GgufFile::open(&args.model).with_context(|| format!("opening {}", args.model.display()))?,
    );
    // A page format that cannot hold the model's width fails now, not
    // after the dense run (q2_k needs d_model a multiple of 256).
    if let Some(t) = file.tensor_info("blk.0.ffn_gate.weight") {
        format
            .check_d_model(t.dims.first().copied().unwrap_or(0) as usize)
            .with_context(|| format!("--page-format {format} on {}", args.model.display()))?;
    }
    let is_ffn = |n: &str| {
        n.starts_with("blk.")
            && (n.ends_with("ffn_gate.weight")
                || n.ends_with("ffn_up.weight")
                || n.ends_with("ffn_down.weight"))
    };
    let has_output = file.tensor_info("output.weight").is_some();
    // Bytes a token reads of a tensor as the device holds it: with NVFP4
    // weights every matrix but the embedding table and the lm head is
    // requantized (half a byte a weight, a scale byte per 16, the f32 scale).
    let device_bytes = |t: &mirage_gguf::TensorInfo| -> u64 {
        let table = t.name == "token_embd.weight" || t.name == "output.weight";
        if weights == WeightFormat::Nvfp4 && !table && t.dims.len() == 2 {
            let n = t.n_elements();
            n / 2 + n / 16 + 4
        } else {
            t.n_bytes()
        }
    };
    // (non-FFN, FFN) bytes a token reads of a model.
    let token_bytes = |f: &GgufFile| -> (u64, u64) {
        let other = f
            .tensors()
            .iter()
            .filter(|t| {
                (t.name.starts_with("blk.") && !is_ffn(&t.name))
                    || t.name == "output.weight"
                    || t.name == "output_norm.weight"
                    || (!has_output && t.name == "token_embd.weight")
            })
            .map(device_bytes)
            .sum();
        let ffn = f
            .tensors()
            .iter()
            .filter(|t| is_ffn(&t.name))
            .map(device_bytes)
            .sum();
        (other, ffn)
    };
    let (other_bytes, ffn_bytes) = token_bytes(&file);
    let prefix_dense = super::bench::on_off("prefix-dense", &args.prefix_dense)?;
    let n_prompt = args.prompt.max(1);
    let n_gen = args.gen.max(4);
    let mib = |b: f64| b / (1u64 << 20) as f64;
    let mut rows = Vec::new();
    let dense_spec = super::bench::spec(args)?;
    // A row of a dense decode (`speedup` filled in once dense is known).
    let dense_row = |mode: String, active_share: f64, d: &Decode, bytes: u64| Row {
        mode,
        page_format: None,
        weights: weights.to_string(),
        active_share,
        decode_tok_s: d.tok_s,
        speedup: f64::NAN,
        step_ms: d.median_ms,
        route_us_layer: 0.0,
        ffn_us_layer: f64::NAN,
        rest_ms: f64::NAN,
        mib_per_token: mib(bytes as f64),
    };
    let (device, dense_tok_s) = {
        let model = dense_model(&dense_spec, file.clone())?;
        let d = decode(&model, n_prompt, n_gen, || Ok(None))?;
        rows.push(Row {
            speedup: 1.0,
            ..dense_row("dense".into(), 1.0, &d, other_bytes + ffn_bytes)
        });
        (model.backend().device_name().to_string(), d.tok_s)
    };
    let artifact = match &args.artifact {
        Some(p) => Some(
            mirage::artifact::Artifact::open(p)
                .with_context(|| format!("opening {}", p.display()))?,
        ),
        None => None,
    };

    // Prefix slices through the dense kernels: one model per fraction,
    // loaded after the previous one is dropped.
    if prefix_dense {
        for &f in fractions.iter().filter(|&&f| f < 1.0) {
            let order = match &artifact {
                Some(a) => mirage::artifact::ChannelOrder::Artifact(a),
                None => mirage::artifact::ChannelOrder::Source,
            };
            let cut = mirage::artifact::prefix_slice(&file, order, f)
                .with_context(|| format!("cutting the {:.0}% prefix slice", f * 100.0))?;
            let (other, ffn) = token_bytes(&cut.file);
            let model = dense_model(&dense_spec, Arc::new(cut.file))?;
            let d = decode(&model, n_prompt, n_gen, || Ok(None))?;
            let mode = format!(
                "prefix {:.0}% dense{}",
                f * 100.0,
                if cut.requantized_down {
                    " (q8 down)"
                } else {
                    ""
                }
            );
            let share = cut.pages as f64 / cut.total_pages.max(1) as f64;
            rows.push(Row {
                speedup: d.tok_s / dense_tok_s,
                ..dense_row(mode, share, &d, other + ffn)
            });
        }
    }

    // Sparse.
    let mut sparse_spec = dense_spec.clone().cuda_pages(CudaPages {
        format,
        mode: Some(SparsePages::All),
    });
    if let Some(p) = &args.artifact {
        sparse_spec = sparse_spec.artifact(p, None);
    }
    let t_load = Instant::now();
    let LoadedModel::SparseCuda(model) = mirage::load_model(&sparse_spec, Some(file.clone()))
        .context("starting the sparse backend")?
    else {
        bail!("the sparse spec did not load the sparse CUDA backend");
    };
    let load_s = t_load.elapsed().as_secs_f64();
    let b = model.backend();
    let shape = b.page_shape();
    let n_layer = shape.len();
    let total_pages: usize = shape.iter().map(|s| s.0).sum();
    let page_bytes = shape.first().map_or(0, |s| s.1);
    let d_model = model.config().n_embd;
    let probe_layer = n_layer / 2;
    // A random FFN input for the per-op timing (kernel time does not depend
    // on the values; the router's does, a little).
    let mut st = 0x9e37_79b9u64;
    let xs: Vec<f32> = (0..d_model)
        .map(|_| {
            st = st.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((st >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    let x = b.inner().upload_activations(1, d_model, &xs)?;
    let mut modes: Vec<(String, SparsePages)> = fractions
        .iter()
        .map(|&f| {
            (
                format!("sparse {:.0}%", f * 100.0),
                SparsePages::Fraction(f),
            )
        })
        .collect();
    if let (true, Some(a)) = (args.routed, &artifact) {
        let margin = a.meta().default_margin;
        let routed = SparsePages::Routed {
            margin,
            traversal: RouteTraversal::Auto,
        };
        modes.push((format!("routed (margin {margin})"), routed));
    }
    for (name, mode) in modes {
        b.set_mode(mode)?;
        let routed = matches!(mode, SparsePages::Routed { .. });
        let d = decode(&model, n_prompt, n_gen, || {
            if routed {
                Ok(Some(b.active_counts()?.iter().sum()))
            } else {
                Ok(None)
            }
        })?;
        let active_pages = match d.mean_active_pages {
            Some(a) => a,
            None => b.active_counts()?.iter().sum::<usize>() as f64,
        };
        if routed {
            // Route once on the probe input so that time_ops sees a typical list.
            b.route_only(probe_layer, &x)?;
        }
        let ops = b.time_ops(probe_layer, &x, 50)?;
        let ffn_bytes_tok = active_pages * page_bytes as f64;
        rows.push(Row {
            mode: name,
            page_format: Some(format.name().into()),
            weights: weights.to_string(),
            active_share: active_pages / total_pages.max(1) as f64,
            decode_tok_s: d.tok_s,
            speedup: d.tok_s / dense_tok_s,
            step_ms: d.median_ms,
            route_us_layer: ops.route_us,
            ffn_us_layer: ops.ffn_us,
            rest_ms: d.median_ms - n_layer as f64 * (ops.route_us + ops.ffn_us) / 1e3,
            mib_per_token: mib(other_bytes as f64 + ffn_bytes_tok),
        });
    }
    let g = b.inner().graph_stats();
    if args.json {
        for r in &rows {
            println!("{}", serde_json::to_string(r)?);
        }
    }
    println!(
        "model {} | {device} | {n_layer} layers, {} pages/layer of {:.2} MiB ({}) | weights {weights} | PDL {} | prompt {n_prompt}, decode {} timed steps | sparse load {load_s:.1} s | graphs: {} captured, {} replayed, {} eager",
        args.model.display(),
        total_pages / n_layer.max(1),
        mib(page_bytes as f64),
        match format {
            PageFormat::Q8_0 => "page format q8_0: split Q8_0, superblock_ffn_q8s",
            PageFormat::Nvfp4 => "page format nvfp4: weight-only NVFP4, superblock_ffn_nvfp4",
            PageFormat::Q2K => "page format q2_k: split Q2_K, superblock_ffn_q2k",
        },
        if b.inner().pdl() { "on" } else { "off" },
        n_gen.saturating_sub(2),
        g.captures,
        g.replays,
        g.eager
    );
    println!(
        "{:<22} {:>7} {:>9} {:>7} {:>8} {:>9} {:>9} {:>8} {:>9}",
        "mode", "active", "tok/s", "x dense", "step ms", "route us", "ffn us", "rest ms", "MiB/tok"
    );
    for r in &rows {
        println!(
            "{:<22} {:>6.1}% {:>9.1} {:>7.2} {:>8.3} {:>9.1} {:>9.1} {:>8.3} {:>9.1}",
            r.mode,
            r.active_share * 100.0,
            r.decode_tok_s,
            r.speedup,
            r.step_ms,
            r.route_us_layer,
            r.ffn_us_layer,
            r.rest_ms,
            r.mib_per_token
        );
    }
    Ok(())
}
