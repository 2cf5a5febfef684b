//! `mirage-cli bench`: prompt and decode speed of a model on a backend, with
//! the memory-bandwidth ceiling measured in the same run.
//!
//! Prompt tokens are pseudo-random ids (speed does not depend on the text);
//! decoding is greedy from the prompt's last logits. Decode speed is reported
//! next to the weight bytes one token reads (every `blk.*` tensor, the final
//! norm and the lm head; one embedding row is negligible) and the achieved
//! weight-read bandwidth as a share of a device-to-device copy (CUDA) or a
//! memcpy (CPU) measured by the same process, counting the copy's bytes read
//! plus written.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use mirage::{BackendChoice, CudaOptions, LoadSpec, LoadedModel};
use mirage_gguf::GgufFile;
use mirage_runtime::backend::Backend;
use mirage_runtime::{KvDtype, KvPruning, Model, TokenSlot};

/// Arguments of `mirage-cli bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// GGUF model file.
    #[arg(long)]
    pub model: PathBuf,
    /// `cpu` or `cuda`.
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Prompt tokens.
    #[arg(long, default_value_t = 512)]
    pub prompt: usize,
    /// Prompt tokens per forward pass (llama.cpp's `n_ubatch`, also 512 by
    /// default): a longer prompt runs in chunks, which bounds the
    /// activation workspace; 0 = the whole prompt as one batch.
    #[arg(long, default_value_t = 512)]
    pub ubatch: usize,
    /// Tokens to decode after the prompt.
    #[arg(long, default_value_t = 128)]
    pub gen: usize,
    /// CPU worker threads (0: one per CPU).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// KV cache element type: `f32` or `f16`.
    #[arg(long, default_value = "f32")]
    pub kv: String,
    /// Decode attention over selected KV pages only (cpu and cuda), as
    /// generate's `--kv-prune`: `default`, `all`, or key=number pairs, e.g.
    /// `page=16,sinks=4,recent=8,top=32,top_percent=20`. The prompt still
    /// attends every position.
    #[arg(long)]
    pub kv_prune: Option<KvPruning>,
    /// CUDA: record decode steps as CUDA graphs (`on`) or launch op by op
    /// (`off`, for debugging: the same results).
    #[arg(long, default_value = "on")]
    pub cuda_graphs: String,
    /// CUDA: multiply prompt batches through cuBLAS on tensor cores (`on`)
    /// or with the mat-vec kernels (`off`).
    #[arg(long, default_value = "on")]
    pub cuda_gemm: String,
    /// CUDA: weight encoding on the device, `native` (the file's) or
    /// `nvfp4` (attention and FFN matrices requantized at upload).
    #[arg(long, default_value = "native")]
    pub weights: mirage::WeightFormat,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
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
    /// Activation sparsity (CPU): decode at these model-wide sparsities (comma-separated) beside the
    /// dense path in the same process, from the activation artifact (--artifact, default
    /// `<model>.activation.mirage`).
    #[arg(long, value_delimiter = ',')]
    pub sparsity: Vec<f32>,
    /// Activation sparsity: the artifact's plan (default: its default plan).
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
    Ok(spec)
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
    let file = Arc::new(
        GgufFile::open(&args.model).with_context(|| format!("opening {}", args.model.display()))?,
    );
    let weight_bytes = weight_bytes_per_token(&file);
    let kv = match args.kv.as_str() {
        "f32" => KvDtype::F32,
        "f16" => KvDtype::F16,
        other => bail!("--kv takes `f32` or `f16`, not `{other}`"),
    };
    let report = match mirage::load_model(&spec(&args)?, Some(file))? {
        LoadedModel::Cpu(model) => {
            let device = format!("cpu ({} threads)", model.backend().threads());
            let copy = host_copy_bandwidth(256 << 20, 5);
            let mut r = measure(&model, &args, kv, weight_bytes, copy, device)?;
            r.backend = "cpu".into();
            r
        }
        #[cfg(feature = "cuda")]
        LoadedModel::Cuda(model) => {
            let b = model.backend();
            let (major, minor) = b.compute_capability();
            let device = format!("{} (sm_{major}{minor})", b.device_name());
            let copy = b.copy_bandwidth(1 << 30, 10)?;
            let mut r = measure(&model, &args, kv, weight_bytes, copy, device)?;
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

/// memcpy bandwidth (read + written bytes per second), median of `iters`.
fn host_copy_bandwidth(bytes: usize, iters: usize) -> f64 {
    let src: Vec<u8> = (0..bytes).map(|i| (i * 31 + 7) as u8).collect();
    let mut dst = vec![0u8; bytes];
    let mut times = Vec::new();
    for _ in 0..iters + 1 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
        times.push(t.elapsed().as_secs_f64());
    }
    times.remove(0);
    times.sort_by(|a, b| a.total_cmp(b));
    2.0 * bytes as f64 / times[times.len() / 2]
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

fn measure<B: Backend>(
    model: &Model<B>,
    args: &BenchArgs,
    kv: KvDtype,
    weight_bytes: u64,
    copy_bytes_s: f64,
    device: String,
) -> anyhow::Result<BenchReport> {
    let n_prompt = args.prompt.max(1);
    let prompt = bench_prompt(model.config().vocab_size, n_prompt);
    let n_ctx = n_prompt + args.gen + 1;
    let mut logits = Vec::new();
    let mut scratch = model.new_scratch();
    // Warm-up in a throw-away cache: a prefill of 32 rows (large enough to
    // take the CUDA backend's GEMM path, so cuBLAS's one-time set-up is not
    // timed) and two decode steps.
    {
        let n_warm = 32.min(n_prompt);
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
    let slots: Vec<TokenSlot> = (0..n_prompt).map(|pos| TokenSlot { seq: 0, pos }).collect();
    let ubatch = if args.ubatch == 0 {
        n_prompt
    } else {
        args.ubatch.min(n_prompt)
    };
    let t = Instant::now();
    // `forward` reads the logits back, so the clock stops after the device is done.
    for (chunk, chunk_slots) in prompt.chunks(ubatch).zip(slots.chunks(ubatch)) {
        model.forward(
            chunk,
            chunk_slots,
            &[chunk.len() - 1],
            &mut cache,
            &mut scratch,
            &mut logits,
        )?;
    }
    let prompt_s = t.elapsed().as_secs_f64();
    let mut tok = argmax(&logits);
    let mut first_tokens = vec![tok];
    let mut step_times = Vec::with_capacity(args.gen);
    let t_all = Instant::now();
    for i in 0..args.gen {
        let t = Instant::now();
        model.forward(
            &[tok],
            &[TokenSlot {
                seq: 0,
                pos: n_prompt + i,
            }],
            &[0],
            &mut cache,
            &mut scratch,
            &mut logits,
        )?;
        tok = argmax(&logits);
        step_times.push(t.elapsed().as_secs_f64());
        if first_tokens.len() < 16 {
            first_tokens.push(tok);
        }
    }
    let decode_s = t_all.elapsed().as_secs_f64();
    step_times.sort_by(|a, b| a.total_cmp(b));
    let median = step_times
        .get(step_times.len() / 2)
        .copied()
        .unwrap_or(f64::NAN);
    let decode_tok_s = args.gen as f64 / decode_s;
    let achieved = weight_bytes as f64 * decode_tok_s;
    Ok(BenchReport {
        model: args.model.display().to_string(),
        backend: String::new(),
        device,
        prompt_tokens: n_prompt,
        prompt_ubatch: ubatch,
        gen_tokens: args.gen,
        prompt_tok_s: n_prompt as f64 / prompt_s,
        decode_tok_s,
        decode_ms_median: median * 1e3,
        weight_bytes_per_token: weight_bytes,
        achieved_gb_s: achieved / 1e9,
        copy_gb_s: copy_bytes_s / 1e9,
        share_of_copy: achieved / copy_bytes_s,
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
        first_tokens,
    })
}

/// `--kv-prune` settings spelled out (the syntax it parses).
fn prune_spec(p: &KvPruning) -> String {
    format!(
        "page={},sinks={},recent={},top={},top_percent={},dense={}",
        p.page, p.sink_pages, p.recent_pages, p.top_pages, p.top_percent, p.dense_layers
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
    println!(
        "prompt           {} tokens, {:.1} tok/s",
        r.prompt_tokens, r.prompt_tok_s
    );
    println!(
        "decode           {} tokens, {:.1} tok/s (median step {:.3} ms)",
        r.gen_tokens, r.decode_tok_s, r.decode_ms_median
    );
    println!(
        "weights / token  {:.1} MiB",
        r.weight_bytes_per_token as f64 / (1 << 20) as f64
    );
    println!(
        "achieved         {:.1} GB/s = {:.1}% of copy {:.1} GB/s",
        r.achieved_gb_s,
        100.0 * r.share_of_copy,
        r.copy_gb_s
    );
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
            if gm { "on (cuBLAS)" } else { "off (mat-vec)" }
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
