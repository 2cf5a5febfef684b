//! `mirage-cli bench`: prompt and decode speed of a model on a backend, with
//! the memory-bandwidth ceiling measured in the same run.
//!
//! Prompt tokens are pseudo-random ids (speed does not depend on the text);
//! decoding is greedy from the prompt's last logits. Decode speed is reported
//! next to the bytes one token reads — the weights (every `blk.*` tensor, the
//! final norm and the lm head; one embedding row is negligible) and the KV
//! cache rows its attention reads (every position, every layer; fewer with
//! `--kv-prune`, which this does not count) — and the achieved read
//! bandwidth as a share of a device-to-device copy (CUDA) or a memcpy with the engine's thread count (CPU)
//! measured by the same process, counting the copy's bytes read plus
//! written.
//!
//! `--depth D1,D2,..` (llama-bench's `-d`): decode after a context of D
//! tokens instead of after the prompt, one row per depth. One cache serves
//! every depth: each depth's context is the prefill of the positions from
//! the previous depth on (in `--ubatch` chunks, timed as "fill"), then
//! `--gen` decode steps are timed. On CUDA one more decode step is then run
//! op by op between events (`CudaBackend::profile_next_step`) for the time
//! per op class: mat-vec, attention, the rest.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use mirage::cuda::StepProfile;
use mirage::{BackendChoice, CudaOptions, LoadSpec, LoadedModel, WeightMemory};
use mirage_gguf::GgufFile;
use mirage_runtime::backend::Backend;
use mirage_runtime::{KvDtype, KvPruning, Model, TokenSlot};

/// Arguments of `mirage-cli bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// GGUF model file.
    #[arg(short = 'm', long)]
    pub model: PathBuf,
    /// `cpu` or `cuda`.
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Prompt tokens (llama-bench's -p).
    #[arg(short = 'p', long, default_value_t = 512)]
    pub prompt: usize,
    /// Prompt tokens per forward pass (llama.cpp's `n_ubatch`, also 512 by
    /// default): a longer prompt runs in chunks, which bounds the
    /// activation workspace; 0 = the whole prompt as one batch.
    #[arg(long, default_value_t = 512)]
    pub ubatch: usize,
    /// Tokens to decode after the prompt (llama-bench's -n).
    #[arg(short = 'n', long, default_value_t = 128)]
    pub gen: usize,
    /// Decode after a context of this many tokens (comma-separated, one
    /// row each; llama-bench's `-d`), instead of after `--prompt` tokens.
    #[arg(short = 'd', long, value_delimiter = ',')]
    pub depth: Vec<usize>,
    /// CPU worker threads (0: one per CPU).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// KV cache element type: `f32`, `f16` or `q8_0` (ggml's blocks of 32
    /// codes and an f16 scale, as llama-bench's `-ctk q8_0 -ctv q8_0`).
    #[arg(long, default_value = "f32")]
    pub kv: String,
    /// Decode attention over selected KV pages only (cpu and cuda), as
    /// generate's `--kv-prune`: `default`, `all`, or key=number pairs, e.g.
    /// `page=16,sinks=4,recent=8,top=32,top_percent=20`. The prompt still
    /// attends every position. On CUDA it measured slower than full attention
    /// at 32k (which runs on tensor cores there).
    #[arg(long)]
    pub kv_prune: Option<KvPruning>,
    /// CUDA: record decode steps as CUDA graphs (`on`) or launch op by op
    /// (`off`, for debugging: the same results).
    #[arg(long, default_value = "on")]
    pub cuda_graphs: String,
    /// CUDA: multiply prompt batches on tensor cores (`on`: int8 products
    /// from the quantized blocks, cuBLAS for the other weight types) or with
    /// the mat-vec kernels (`off`).
    #[arg(long, default_value = "on")]
    pub cuda_gemm: String,
    /// CUDA: weight encoding on the device, `native` (the file's) or
    /// `nvfp4` (attention and FFN matrices requantized at upload).
    #[arg(long, default_value = "native")]
    pub weights: mirage::WeightFormat,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// CPU: compare with llama.cpp in the same run: this `llama-bench`
    /// binary (default, when the flag has no value:
    /// target/llamacpp/build/bin/llama-bench, built by
    /// scripts/build_llamacpp.sh) and MIRAGE alternate on llama-bench's
    /// tests (`--pp` sizes, `--gen` decode steps, f16 KV cache), `--reps`
    /// times; prints tok/s of both, their ratio and decode's share of the
    /// copy bandwidth.
    #[arg(long, value_name = "LLAMA_BENCH", num_args = 0..=1, default_missing_value = "target/llamacpp/build/bin/llama-bench")]
    pub llamacpp: Option<PathBuf>,
    /// With --llamacpp: prompt sizes of the prefill tests, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "128,512")]
    pub pp: Vec<usize>,
    /// Repetitions: the speeds are reported as mean ± sample standard deviation (default 1; with
    /// --llamacpp, alternating repetitions whose medians are reported, default 3).
    #[arg(short = 'r', long, alias = "repetitions")]
    pub reps: Option<usize>,
    /// Sparse decode (CUDA): the model's `.mirage` artifact; runs dense vs
    /// sparse in one process (see `bench_sparse`).
    #[arg(long)]
    pub artifact: Option<PathBuf>,
    /// Sparse decode: FFN page fractions to force (first pages by hotness),
    /// comma-separated; default 1.0,0.75,0.5,0.35,0.25.
    #[arg(long, value_delimiter = ',')]
    pub active: Vec<f32>,
    /// Sparse decode: also decode with the artifact's BVH router on the device.
    #[arg(long)]
    pub routed: bool,
    /// Sparse decode without an artifact: pages built from the model's FFN
    /// matrices, 128 consecutive channels each (synthetic shapes; forced
    /// fractions only).
    #[arg(long)]
    pub synthetic_pages: bool,
    /// Sparse decode: encoding of the FFN pages. `q8_0` (default): split
    /// Q8_0, fused kernel `superblock_ffn_q8s`. `nvfp4`: weight-only NVFP4
    /// (E2M1 codes, an E4M3 scale per 16 weights, one f32 scale per layer
    /// matrix; 53 % of the Q8_0 bytes) requantized at load from the model's
    /// gate/up/down in the same page order, fused kernel
    /// `superblock_ffn_nvfp4`. `q2_k`: split Q2_K (ggml Q2_K blocks, 2.625
    /// bits a weight, 33 % of the Q8_0 bytes; the GGUF's Q2_K gate/up rows
    /// verbatim, other types and the transposed down quantized to Q2_K at
    /// load; d_model must be a multiple of 256), fused kernel
    /// `superblock_ffn_q2k`. MiB/tok counts the chosen format's page bytes.
    /// Only with --artifact or --synthetic-pages.
    #[arg(long)]
    pub page_format: Option<mirage::PageFormat>,
    /// Sparse decode: also decode each forced fraction below 1 as a dense
    /// model cut to those pages (`prefix X% dense` rows: the prefix slice
    /// through the dense kernels, the second baseline; gate/up rows copied,
    /// down columns copied or, in an artifact's order, re-encoded in Q8_0).
    #[arg(long, default_value = "on")]
    pub prefix_dense: String,
    /// Activation sparsity (CPU, or CUDA: only the FFN sparse): decode at these model-wide sparsities (comma-separated) beside the
    /// dense path in the same process, from the activation artifact (--artifact, default
    /// `<model>.activation.mirage`).
    #[arg(long, value_delimiter = ',')]
    pub sparsity: Vec<f32>,
    /// Activation sparsity: the artifact's plan (default: per sparsity, the plan of lowest calibration
    /// perplexity).
    #[arg(long)]
    pub sparsity_plan: Option<String>,
    /// Activation sparsity: the prompt is this text's first --prompt tokens (held-out text, so that the
    /// channels skipped are those of real text; default: /usr/lib/python3.11/textwrap.py when present,
    /// else random tokens).
    #[arg(long)]
    pub sparsity_text: Option<PathBuf>,
    /// Activation sparsity: rounds of dense + every sparsity, alternating.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Map the model file (and artifact) instead of reading it into memory: an instant start and pages
    /// shared with other processes, but the CPU decode reads the weights through 4 KiB pages (on a
    /// 2-vCPU Xeon VM the 1.5B model decoded 1.3-1.7x slower so). Default: read into huge-page memory on
    /// the CPU when it fits.
    #[arg(long)]
    pub mmap: bool,
}

/// What one bench run measured.
#[derive(Debug, serde::Serialize)]
struct BenchReport {
    model: String,
    backend: String,
    device: String,
    prompt_tokens: usize,
    prompt_ubatch: usize,
    gen_tokens: usize,
    prompt_tok_s: f64,
    decode_tok_s: f64,
    /// Runs the speeds are the mean of.
    repetitions: usize,
    /// Sample standard deviations of the speeds (more than one run).
    prompt_tok_s_sd: Option<f64>,
    decode_tok_s_sd: Option<f64>,
    decode_ms_median: f64,
    weight_bytes_per_token: u64,
    achieved_gb_s: f64,
    copy_gb_s: f64,
    share_of_copy: f64,
    peak_device_bytes: Option<usize>,
    weights_bytes: Option<usize>,
    kv_cache_bytes: Option<usize>,
    workspace_bytes: Option<usize>,
    kv_dtype: String,
    kv_prune: Option<String>,
    cuda_graphs: Option<bool>,
    cuda_gemm: Option<bool>,
    cuda_pdl: Option<bool>,
    weight_format: Option<String>,
    graph_captures: Option<u64>,
    graph_replays: Option<u64>,
    eager_steps: Option<u64>,
    first_tokens: Vec<u32>,
    /// Bytes of KV cache one decode step reads, averaged over the steps.
    kv_bytes_per_token: u64,
    /// Device time per op class of one decode step (CUDA).
    profile: Option<ProfileReport>,
    /// One row per decode context (`--depth`; without it, the prompt
    /// length): the fields above repeat the first row.
    runs: Vec<DepthRun>,
}

/// Decode after a context of `depth` tokens.
#[derive(Debug, Clone, serde::Serialize)]
struct DepthRun {
    depth: usize,
    /// Positions prefilled for this row (from the previous row's depth on)
    /// and their speed.
    fill_tokens: usize,
    fill_tok_s: f64,
    gen_tokens: usize,
    decode_tok_s: f64,
    decode_ms_median: f64,
    weight_bytes_per_token: u64,
    kv_bytes_per_token: u64,
    achieved_gb_s: f64,
    share_of_copy: f64,
    profile: Option<ProfileReport>,
    first_tokens: Vec<u32>,
}

/// `StepProfile` of one decode step, in microseconds and shares.
#[derive(Debug, Clone, Copy, serde::Serialize)]
struct ProfileReport {
    matvec_us: f64,
    attention_us: f64,
    other_us: f64,
    launches: usize,
    matvec_share: f64,
    attention_share: f64,
    other_share: f64,
}

impl From<StepProfile> for ProfileReport {
    fn from(p: StepProfile) -> ProfileReport {
        let t = p.total_us().max(f64::MIN_POSITIVE);
        ProfileReport {
            matvec_us: p.matvec_us,
            attention_us: p.attention_us,
            other_us: p.other_us,
            launches: p.launches,
            matvec_share: p.matvec_us / t,
            attention_share: p.attention_us / t,
            other_share: p.other_us / t,
        }
    }
}

/// Arms and reads the backend's per-op-class profile of one decode step.
struct Profiler<'a> {
    arm: &'a dyn Fn(),
    take: &'a dyn Fn() -> Option<StepProfile>,
}

pub(crate) fn on_off(what: &str, v: &str) -> anyhow::Result<bool> {
    match v {
        "on" => Ok(true),
        "off" => Ok(false),
        other => bail!("--{what} takes `on` or `off`, not `{other}`"),
    }
}

/// What the shared loader (`mirage::load_model`) needs for `args`' dense
/// run: backend, device and the CUDA options the flags set.
pub(crate) fn spec(args: &BenchArgs) -> anyhow::Result<LoadSpec> {
    let backend: BackendChoice = args.backend.parse()?;
    let mut spec = LoadSpec::new(&args.model)
        .backend(backend)
        .cuda(CudaOptions {
            graphs: on_off("cuda-graphs", &args.cuda_graphs)?,
            prefill_gemm: on_off("cuda-gemm", &args.cuda_gemm)?,
            weights: args.weights,
            ..CudaOptions::default()
        });
    spec.cuda_device = args.device;
    spec.options.threads = args.threads;
    spec.memory = WeightMemory::mapped_if(args.mmap);
    Ok(spec)
}

/// `path` held in memory as `--mmap` and the backend (`cpu` or not) say.
pub(super) fn open_model(path: &Path, mmap: bool, cpu: bool) -> anyhow::Result<GgufFile> {
    let memory = WeightMemory::mapped_if(mmap).for_file(cpu, path);
    GgufFile::open_with(path, memory).with_context(|| format!("opening {}", path.display()))
}

/// Runs `mirage-cli bench`.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    if !args.sparsity.is_empty() {
        return super::bench_activation::run(&args);
    }
    if args.page_format.is_some() && args.artifact.is_none() && !args.synthetic_pages {
        bail!("--page-format selects the sparse FFN's page encoding: pass --artifact FILE or --synthetic-pages with it");
    }
    if args.artifact.is_some() || args.synthetic_pages {
        #[cfg(feature = "cuda")]
        return super::bench_sparse::run(&args);
        #[cfg(not(feature = "cuda"))]
        bail!("the sparse bench needs the CUDA backend: build mirage-cli with --features cuda");
    }
    super::generate::check_model(&args.model)?;
    if let Some(bin) = &args.llamacpp {
        if args.backend != "cpu" {
            bail!("--llamacpp compares the CPU backend: pass --backend cpu");
        }
        let report = super::bench_peer::compare(&super::bench_peer::PeerArgs {
            model: &args.model,
            llama_bench: bin,
            threads: args.threads,
            pp: &args.pp,
            tg: args.gen,
            reps: args.reps.unwrap_or(3),
            mmap: args.mmap,
        })?;
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            super::bench_peer::print_report(&report);
        }
        return Ok(());
    }
    let file = Arc::new(open_model(&args.model, args.mmap, args.backend != "cuda")?);
    let weight_bytes = weight_bytes_per_token(&file);
    let kv = match args.kv.as_str() {
        "f32" => KvDtype::F32,
        "f16" => KvDtype::F16,
        "q8_0" => KvDtype::Q8_0,
        other => bail!("--kv takes `f32`, `f16` or `q8_0`, not `{other}`"),
    };
    let spec = spec(&args)?;
    let loading = format!("loading {}", args.model.display());
    let loaded = super::progress::during(loading, || mirage::load_model(&spec, Some(file)))?;
    let report = match loaded {
        LoadedModel::Cpu(model) => {
            let device = format!("cpu ({} threads)", model.backend().threads());
            // The machine's copy rate with the engine's thread count.
            let copy =
                super::bench_peer::threaded_copy_bandwidth(256 << 20, 5, model.backend().threads());
            let mut r = measure_repeated(&model, &args, kv, weight_bytes, copy, device, None)?;
            r.backend = "cpu".into();
            r
        }
        #[cfg(feature = "cuda")]
        LoadedModel::Cuda(model) => {
            let b = model.backend();
            let (major, minor) = b.compute_capability();
            let device = format!("{} (sm_{major}{minor})", b.device_name());
            let copy = b.copy_bandwidth(1 << 30, 10)?;
            let (arm, take) = (|| b.profile_next_step(), || b.take_step_profile());
            let profiler = Profiler {
                arm: &arm,
                take: &take,
            };
            let mut r = measure_repeated(
                &model,
                &args,
                kv,
                weight_bytes,
                copy,
                device,
                Some(profiler),
            )?;
            let (m, g) = (b.memory_stats(), b.graph_stats());
            r.backend = "cuda".into();
            r.cuda_graphs = Some(b.graphs());
            r.cuda_gemm = Some(b.prefill_gemm());
            r.cuda_pdl = Some(b.pdl());
            r.weight_format = Some(b.weight_format().to_string());
            r.graph_captures = Some(g.captures);
            r.graph_replays = Some(g.replays);
            r.eager_steps = Some(g.eager);
            r.peak_device_bytes = Some(m.peak);
            r.weights_bytes = Some(m.weights);
            r.kv_cache_bytes = Some(m.kv_cache);
            r.workspace_bytes = Some(m.workspace);
            r
        }
        _ => unreachable!("a dense spec loads a dense backend"),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

pub(crate) fn weight_bytes_per_token(file: &GgufFile) -> u64 {
    let has_output = file.tensor_info("output.weight").is_some();
    file.tensors()
        .iter()
        .filter(|t| {
            t.name.starts_with("blk.")
                || t.name == "output.weight"
                || t.name == "output_norm.weight"
                || (!has_output && t.name == "token_embd.weight")
        })
        .map(|t| t.n_bytes())
        .sum()
}

/// Index of the first largest value.
pub(crate) fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// The benchmark prompt: `n` pseudo-random token ids below `vocab` (a
/// fixed LCG, so every backend and run decodes the same tokens).
pub(crate) fn bench_prompt(vocab: usize, n: usize) -> Vec<u32> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % (vocab.max(2).min(32000) as u64 - 1) + 1) as u32
        })
        .collect()
}

/// Bytes of KV cache a decode step at position `pos` reads: keys and
/// values of positions `0..=pos` in every layer.
fn kv_bytes_at(model_cfg: &mirage_runtime::ModelConfig, kv: KvDtype, pos: usize) -> u64 {
    let values = (2 * model_cfg.n_layer * model_cfg.n_head_kv * model_cfg.head_dim) as u64
        * (pos as u64 + 1);
    kv.bytes_for(values).unwrap_or(u64::MAX)
}

/// Mean and sample standard deviation (n - 1 in the denominator, as
/// llama-bench reports it); no deviation for a single value.
pub(crate) fn mean_sd(xs: &[f64]) -> (f64, Option<f64>) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    if xs.len() < 2 {
        return (mean, None);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, Some(var.sqrt()))
}

/// [`measure`] `--reps` times on the same model; the speeds are the means,
/// with their standard deviations, the rest is the last run's.
fn measure_repeated<B: Backend>(
    model: &Model<B>,
    args: &BenchArgs,
    kv: KvDtype,
    weight_bytes: u64,
    copy_bytes_s: f64,
    device: String,
    profiler: Option<Profiler<'_>>,
) -> anyhow::Result<BenchReport> {
    let reps = args.reps.unwrap_or(1);
    if reps == 0 {
        bail!("--reps must be at least 1");
    }
    let mut runs = Vec::with_capacity(reps);
    for rep in 0..reps {
        // The op-class profile is taken once, in the last repetition.
        let last = rep + 1 == reps;
        let profile = profiler.as_ref().filter(|_| last).map(|p| Profiler {
            arm: p.arm,
            take: p.take,
        });
        runs.push(measure(
            model,
            args,
            kv,
            weight_bytes,
            copy_bytes_s,
            device.clone(),
            profile,
        )?);
    }
    // Every depth's decode speed is the mean over the repetitions too.
    let depth_decode: Vec<f64> = (0..runs[0].runs.len())
        .map(|j| {
            mean_sd(
                &runs
                    .iter()
                    .map(|r| r.runs[j].decode_tok_s)
                    .collect::<Vec<_>>(),
            )
            .0
        })
        .collect();
    let speeds = |f: fn(&BenchReport) -> f64| mean_sd(&runs.iter().map(f).collect::<Vec<_>>());
    let (prompt, prompt_sd) = speeds(|r| r.prompt_tok_s);
    let (decode, decode_sd) = speeds(|r| r.decode_tok_s);
    let mut r = runs.pop().expect("at least one run");
    for (run, &tok_s) in r.runs.iter_mut().zip(&depth_decode) {
        let achieved = (run.weight_bytes_per_token + run.kv_bytes_per_token) as f64 * tok_s;
        run.decode_tok_s = tok_s;
        run.achieved_gb_s = achieved / 1e9;
        run.share_of_copy = achieved / copy_bytes_s;
    }
    let achieved = (weight_bytes + r.kv_bytes_per_token) as f64 * decode;
    r.prompt_tok_s = prompt;
    r.decode_tok_s = decode;
    r.achieved_gb_s = achieved / 1e9;
    r.share_of_copy = achieved / copy_bytes_s;
    r.repetitions = reps;
    r.prompt_tok_s_sd = prompt_sd;
    r.decode_tok_s_sd = decode_sd;
    Ok(r)
}

fn measure<B: Backend>(
    model: &Model<B>,
    args: &BenchArgs,
    kv: KvDtype,
    weight_bytes: u64,
    copy_bytes_s: f64,
    device: String,
    profiler: Option<Profiler<'_>>,
) -> anyhow::Result<BenchReport> {
    let depths = if args.depth.is_empty() {
        vec![args.prompt.max(1)]
    } else {
        args.depth.clone()
    };
    if depths.windows(2).any(|w| w[1] <= w[0]) {
        bail!("--depth takes increasing depths, not {depths:?}");
    }
    let max_depth = *depths.last().expect("at least one depth");
    let prompt = bench_prompt(model.config().vocab_size, max_depth.max(1));
    // The last depth's decode steps and the profiled step.
    let n_ctx = max_depth + args.gen + 2;
    let mut logits = Vec::new();
    let mut scratch = model.new_scratch();
    // Warm-up in a throw-away cache: a prefill of 32 rows (large enough to
    // take the CUDA backend's GEMM path, so its one-time set-up is not
    // timed) and two decode steps.
    {
        let n_warm = 32.min(prompt.len());
        let mut cache = model.new_kv_cache_pruned(n_warm + 2, 1, kv, args.kv_prune)?;
        let slots: Vec<TokenSlot> = (0..n_warm).map(|pos| TokenSlot { seq: 0, pos }).collect();
        model.forward(
            &prompt[..n_warm],
            &slots,
            &[n_warm - 1],
            &mut cache,
            &mut scratch,
            &mut logits,
        )?;
        for pos in n_warm..n_warm + 2 {
            model.forward(
                &[prompt[0]],
                &[TokenSlot { seq: 0, pos }],
                &[0],
                &mut cache,
                &mut scratch,
                &mut logits,
            )?;
        }
    }
    let mut cache = model.new_kv_cache_pruned(n_ctx, 1, kv, args.kv_prune)?;
    let ubatch = if args.ubatch == 0 {
        max_depth.max(1)
    } else {
        args.ubatch
    };
    let step = |tok: u32, pos: usize, cache: &mut _, scratch: &mut _, logits: &mut Vec<f32>| {
        model.forward(
            &[tok],
            &[TokenSlot { seq: 0, pos }],
            &[0],
            cache,
            scratch,
            logits,
        )
    };
    let mut runs = Vec::with_capacity(depths.len());
    let mut filled = 0;
    for &depth in &depths {
        // The context: positions filled..depth (the previous row's decode
        // steps are overwritten).
        let t = Instant::now();
        let mut start = filled;
        while start < depth {
            let end = (start + ubatch).min(depth);
            let slots: Vec<TokenSlot> = (start..end).map(|pos| TokenSlot { seq: 0, pos }).collect();
            // `forward` reads the logits back, so the clock stops after the
            // device is done.
            model.forward(
                &prompt[start..end],
                &slots,
                &[end - start - 1],
                &mut cache,
                &mut scratch,
                &mut logits,
            )?;
            start = end;
        }
        let fill_s = t.elapsed().as_secs_f64();
        let fill_tokens = depth - filled.min(depth);
        filled = depth;
        let mut tok = if depth == 0 {
            prompt[0]
        } else {
            argmax(&logits)
        };
        let mut first_tokens = vec![tok];
        let mut step_times = Vec::with_capacity(args.gen);
        let t_all = Instant::now();
        for i in 0..args.gen {
            let t = Instant::now();
            step(tok, depth + i, &mut cache, &mut scratch, &mut logits)?;
            tok = argmax(&logits);
            step_times.push(t.elapsed().as_secs_f64());
            if first_tokens.len() < 16 {
                first_tokens.push(tok);
            }
        }
        let decode_s = t_all.elapsed().as_secs_f64();
        let profile = match &profiler {
            Some(p) => {
                (p.arm)();
                step(tok, depth + args.gen, &mut cache, &mut scratch, &mut logits)?;
                (p.take)().map(ProfileReport::from)
            }
            None => None,
        };
        step_times.sort_by(|a, b| a.total_cmp(b));
        let median = step_times
            .get(step_times.len() / 2)
            .copied()
            .unwrap_or(f64::NAN);
        let decode_tok_s = args.gen as f64 / decode_s;
        let kv_bytes = (0..args.gen)
            .map(|i| kv_bytes_at(model.config(), kv, depth + i))
            .sum::<u64>()
            / args.gen.max(1) as u64;
        let achieved = (weight_bytes + kv_bytes) as f64 * decode_tok_s;
        runs.push(DepthRun {
            depth,
            fill_tokens,
            fill_tok_s: if fill_tokens == 0 {
                0.0
            } else {
                fill_tokens as f64 / fill_s
            },
            gen_tokens: args.gen,
            decode_tok_s,
            decode_ms_median: median * 1e3,
            weight_bytes_per_token: weight_bytes,
            kv_bytes_per_token: kv_bytes,
            achieved_gb_s: achieved / 1e9,
            share_of_copy: achieved / copy_bytes_s,
            profile,
            first_tokens,
        });
    }
    let first = runs[0].clone();
    Ok(BenchReport {
        model: args.model.display().to_string(),
        backend: String::new(),
        device,
        prompt_tokens: first.fill_tokens,
        prompt_ubatch: ubatch.min(max_depth.max(1)),
        gen_tokens: args.gen,
        prompt_tok_s: first.fill_tok_s,
        decode_tok_s: first.decode_tok_s,
        decode_ms_median: first.decode_ms_median,
        repetitions: 1,
        prompt_tok_s_sd: None,
        decode_tok_s_sd: None,
        weight_bytes_per_token: weight_bytes,
        achieved_gb_s: first.achieved_gb_s,
        copy_gb_s: copy_bytes_s / 1e9,
        share_of_copy: first.share_of_copy,
        peak_device_bytes: None,
        weights_bytes: None,
        kv_cache_bytes: None,
        workspace_bytes: None,
        kv_dtype: args.kv.clone(),
        kv_prune: args.kv_prune.as_ref().map(prune_spec),
        cuda_graphs: None,
        cuda_gemm: None,
        cuda_pdl: None,
        weight_format: None,
        graph_captures: None,
        graph_replays: None,
        eager_steps: None,
        first_tokens: first.first_tokens,
        kv_bytes_per_token: first.kv_bytes_per_token,
        profile: first.profile,
        runs,
    })
}

/// `--kv-prune` settings spelled out (the syntax it parses).
fn prune_spec(p: &KvPruning) -> String {
    format!(
        "page={},sinks={},recent={},top={},top_percent={},dense={}",
        p.page, p.sink_pages, p.recent_pages, p.top_pages, p.top_percent, p.dense_layers
    )
}

/// "mat-vec A us (a%), attention B us (b%), other C us (c%), N launches".
fn profile_line(p: &ProfileReport) -> String {
    format!(
        "mat-vec {:.0} us ({:.0}%), attention {:.0} us ({:.0}%), other {:.0} us ({:.0}%), {} launches",
        p.matvec_us,
        100.0 * p.matvec_share,
        p.attention_us,
        100.0 * p.attention_share,
        p.other_us,
        100.0 * p.other_share,
        p.launches
    )
}

fn print_table(r: &BenchReport) {
    let mib = |b: Option<usize>| {
        b.map_or("-".to_string(), |b| {
            format!("{:.1} MiB", b as f64 / (1 << 20) as f64)
        })
    };
    println!("model            {}", r.model);
    println!("backend          {} on {}", r.backend, r.device);
    // "12.3 ± 0.4 tok/s (5 runs)" with repetitions, "12.3 tok/s" without.
    let speed = |mean: f64, sd: Option<f64>| match sd {
        Some(sd) => format!("{mean:.1} ± {sd:.1} tok/s ({} runs)", r.repetitions),
        None => format!("{mean:.1} tok/s"),
    };
    println!(
        "prompt           {} tokens, {}",
        r.prompt_tokens,
        speed(r.prompt_tok_s, r.prompt_tok_s_sd)
    );
    println!(
        "decode           {} tokens, {} (median step {:.3} ms)",
        r.gen_tokens,
        speed(r.decode_tok_s, r.decode_tok_s_sd),
        r.decode_ms_median
    );
    println!(
        "read / token     {:.1} MiB weights + {:.1} MiB KV",
        r.weight_bytes_per_token as f64 / (1 << 20) as f64,
        r.kv_bytes_per_token as f64 / (1 << 20) as f64
    );
    println!(
        "achieved         {:.1} GB/s = {:.1}% of copy {:.1} GB/s",
        r.achieved_gb_s,
        100.0 * r.share_of_copy,
        r.copy_gb_s
    );
    if let Some(p) = &r.profile {
        println!("step by op class {}", profile_line(p));
    }
    if r.runs.len() > 1 || r.runs.first().is_some_and(|x| x.depth != r.prompt_tokens) {
        println!(
            "{:>8} {:>10} {:>10} {:>9} {:>8}  op classes (one step op by op)",
            "depth", "fill tok/s", "decode t/s", "KV MiB/t", "of copy"
        );
        for x in &r.runs {
            println!(
                "{:>8} {:>10.1} {:>10.1} {:>9.1} {:>7.1}%  {}",
                x.depth,
                x.fill_tok_s,
                x.decode_tok_s,
                x.kv_bytes_per_token as f64 / (1 << 20) as f64,
                100.0 * x.share_of_copy,
                x.profile.as_ref().map_or("-".into(), profile_line)
            );
        }
    }
    println!(
        "device memory    peak {} (weights {}, KV {}, workspace {})",
        mib(r.peak_device_bytes),
        mib(r.weights_bytes),
        mib(r.kv_cache_bytes),
        mib(r.workspace_bytes)
    );
    println!(
        "kv cache         {}, decode attention {}",
        r.kv_dtype,
        r.kv_prune
            .as_ref()
            .map_or("over every position".to_string(), |p| format!(
                "over selected pages ({p})"
            ))
    );
    if let (Some(gr), Some(gm)) = (r.cuda_graphs, r.cuda_gemm) {
        println!(
            "cuda             graphs {} ({} captured, {} replayed, {} op by op), prefill GEMM {}",
            if gr { "on" } else { "off" },
            r.graph_captures.unwrap_or(0),
            r.graph_replays.unwrap_or(0),
            r.eager_steps.unwrap_or(0),
            if gm {
                "on (tensor cores)"
            } else {
                "off (mat-vec)"
            }
        );
    }
    if let Some(w) = &r.weight_format {
        println!(
            "cuda weights     {w}, programmatic dependent launch {}",
            if r.cuda_pdl == Some(true) {
                "on"
            } else {
                "off"
            }
        );
    }
    println!("first tokens     {:?}", r.first_tokens);
}
