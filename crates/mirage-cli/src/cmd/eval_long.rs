//! `mirage-cli eval-long`: long-context fidelity and speed of KV-page
//! pruning (pruned vs full decode attention), measured in one run.
//!
//! For each context length `N`: the first `N` tokens of the text are
//! prefilled (full attention) except the last `--ppl-tokens`, which are then
//! decoded one at a time twice from the same cache, once with full attention
//! and once with the pruned selection. That gives the final-logit cosine,
//! the perplexity of both over those tokens, and decode ms/token of both at
//! the same positions. Then a needle ("The secret code is NNNN.") is put at
//! several depths of an `N`-token haystack and the model is asked for it;
//! the greedy answers of full and pruned attention are compared.
//!
//! Runs on the CPU (`--backend cpu`, the default) or the CUDA backend
//! (`--backend cuda --device N`, in a build with the `cuda` feature). One
//! KV cache made with the pruning rule serves both decodes: the selection
//! is switched off and on between them with `Backend::kv_set_pruning`
//! (page summaries stay up to date while it is off).

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use mirage_gguf::GgufFile;
use mirage_runtime::backend::{Backend, TokenSlot};
use mirage_runtime::kv_pages::PageSelector;
use mirage_runtime::model::Scratch;
use mirage_runtime::{KvDtype, KvPruning, Model};
use mirage_tokenizer::Tokenizer;

/// The backend `eval-long` runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvalBackend {
    /// The CPU backend.
    Cpu,
    /// The CUDA backend (needs the `cuda` feature and a GPU).
    Cuda,
}

impl EvalBackend {
    fn as_str(self) -> &'static str {
        match self {
            EvalBackend::Cpu => "cpu",
            EvalBackend::Cuda => "cuda",
        }
    }
}

impl FromStr for EvalBackend {
    type Err = String;
    fn from_str(s: &str) -> Result<EvalBackend, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(EvalBackend::Cpu),
            "cuda" => Ok(EvalBackend::Cuda),
            _ => Err(format!("unknown backend `{s}` (expected cpu or cuda)")),
        }
    }
}

/// Arguments of `eval-long`.
#[derive(Debug, Args)]
pub struct EvalLongArgs {
    /// GGUF model file.
    #[arg(long)]
    model: PathBuf,
    /// Backend: `cpu` or `cuda` (a build with the `cuda` feature and a GPU).
    #[arg(long, default_value = "cpu")]
    backend: EvalBackend,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Long text file (tokenized once; needs at least the largest `--ctx` tokens).
    #[arg(long)]
    text: PathBuf,
    /// Context lengths in tokens, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "2048")]
    ctx: Vec<usize>,
    /// Pages chosen by their q·k upper bound, besides sinks and recent pages.
    #[arg(long, default_value_t = 8)]
    top_pages: usize,
    /// At least this percentage of the context's pages among the top pages (a budget that grows with
    /// the context; 0: fixed).
    #[arg(long, default_value_t = 0)]
    top_percent: usize,
    /// Positions per KV page.
    #[arg(long, default_value_t = 64)]
    page: usize,
    /// Always-attended pages at the start.
    #[arg(long, default_value_t = 1)]
    sink_pages: usize,
    /// Always-attended most recent pages.
    #[arg(long, default_value_t = 2)]
    recent_pages: usize,
    /// First layers left dense (every position attended).
    #[arg(long, default_value_t = 0)]
    dense_layers: usize,
    /// Tokens at the end of each context scored (perplexity) and timed.
    #[arg(long, default_value_t = 32)]
    ppl_tokens: usize,
    /// Needle depths (fractions of the haystack), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0.1,0.5,0.9")]
    needle_depths: Vec<f64>,
    /// Skip the needle check (it costs one full prefill per depth).
    #[arg(long)]
    no_needles: bool,
    /// Store the KV cache as f16 (cpu and cuda).
    #[arg(long)]
    kv_f16: bool,
    /// How the CPU finds the top pages: `flat` (every candidate page's bound)
    /// or `bvh` (branch and bound over groups of 16 pages); the same pages
    /// either way, the bounds computed are reported. CUDA always scans flat.
    #[arg(long, default_value = "flat", value_parser = ["flat", "bvh"])]
    page_selector: String,
    /// CPU worker threads (0: one per CPU).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Print the result as JSON on stdout.
    #[arg(long)]
    json: bool,
}

struct Runner<'a, B: Backend> {
    model: &'a Model<B>,
    cache: B::KvCache,
    scratch: Scratch<B>,
    pruning: KvPruning,
}

impl<B: Backend> Runner<'_, B> {
    /// Prefills `tokens` at positions `from..` with full attention (prefill rows are never pruned).
    fn prefill(&mut self, tokens: &[u32], from: usize) -> anyhow::Result<()> {
        let mut logits = Vec::new();
        for (c, chunk) in tokens.chunks(512).enumerate() {
            let slots: Vec<TokenSlot> = (0..chunk.len())
                .map(|i| TokenSlot {
                    seq: 0,
                    pos: from + c * 512 + i,
                })
                .collect();
            self.model.forward(
                chunk,
                &slots,
                &[],
                &mut self.cache,
                &mut self.scratch,
                &mut logits,
            )?;
        }
        Ok(())
    }

    /// One decode step: logits of `token` at `pos` and the seconds it took.
    /// The time covers the device work on a GPU too: `forward` copies the
    /// logits back to the host (`Backend::read`, which on CUDA waits for the
    /// stream), so it returns only once the step has finished.
    fn step(&mut self, token: u32, pos: usize) -> anyhow::Result<(Vec<f32>, f64)> {
        let mut logits = Vec::new();
        let t = Instant::now();
        self.model.forward(
            &[token],
            &[TokenSlot { seq: 0, pos }],
            &[0],
            &mut self.cache,
            &mut self.scratch,
            &mut logits,
        )?;
        Ok((logits, t.elapsed().as_secs_f64()))
    }

    /// Switches decode attention between the pruned selection and every position.
    fn set_pruned(&mut self, on: bool) -> anyhow::Result<()> {
        self.model
            .backend()
            .kv_set_pruning(&mut self.cache, if on { Some(self.pruning) } else { None })?;
        Ok(())
    }

    /// Drops every cached position from `pos` on (0: the whole sequence).
    fn truncate(&mut self, pos: usize) {
        self.model.backend().kv_truncate(&mut self.cache, 0, pos);
    }
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0.0f64, 0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        ab += *x as f64 * *y as f64;
        aa += *x as f64 * *x as f64;
        bb += *y as f64 * *y as f64;
    }
    ab / (aa.sqrt() * bb.sqrt()).max(f64::MIN_POSITIVE)
}

fn nll(logits: &[f32], target: u32) -> f64 {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = logits.iter().map(|&l| (l as f64 - m).exp()).sum();
    m + z.ln() - logits[target as usize] as f64
}

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i as u32)
}

/// Fidelity and speed over the last tokens of one context.
#[derive(Debug, serde::Serialize)]
struct ContextResult {
    n_ctx: usize,
    pages: usize,
    pages_attended: usize,
    final_logit_cosine: f64,
    min_logit_cosine: f64,
    same_argmax_fraction: f64,
    ppl_full: f64,
    ppl_pruned: f64,
    ppl_delta_pct: f64,
    decode_ms_full: f64,
    decode_ms_pruned: f64,
    speedup: f64,
    needles: Vec<NeedleResult>,
}

#[derive(Debug, serde::Serialize)]
struct NeedleResult {
    depth: f64,
    code: String,
    answer_full: String,
    answer_pruned: String,
    found_full: bool,
    found_pruned: bool,
}

/// Greedy answer of up to `n` tokens after `prompt` (its last token decoded, the rest already cached).
fn greedy<B: Backend>(
    r: &mut Runner<'_, B>,
    tok: &Tokenizer,
    last: u32,
    pos: usize,
    n: usize,
) -> anyhow::Result<String> {
    let mut out = Vec::new();
    let mut t = last;
    for i in 0..n {
        let (logits, _) = r.step(t, pos + i)?;
        t = argmax(&logits);
        if tok.is_eog(t) {
            break;
        }
        out.push(t);
    }
    tok.decode(&out, true).map_err(|e| anyhow::anyhow!("{e}"))
}

fn eval_context<B: Backend>(
    r: &mut Runner<'_, B>,
    tok: &Tokenizer,
    text_tokens: &[u32],
    n: usize,
    args: &EvalLongArgs,
) -> anyhow::Result<ContextResult> {
    let p = args.ppl_tokens.clamp(2, n / 2);
    let tokens = &text_tokens[..n];
    let head = n - p;
    r.truncate(0);
    r.set_pruned(false)?;
    r.prefill(&tokens[..head], 0)?;
    // Decode tokens head..n: logits at step i predict token head+i+1.
    let run = |r: &mut Runner<'_, B>, pruned: bool| -> anyhow::Result<(Vec<Vec<f32>>, f64)> {
        r.truncate(head);
        r.set_pruned(pruned)?;
        let (mut all, mut secs) = (Vec::new(), 0.0);
        for i in 0..p {
            let (l, s) = r.step(tokens[head + i], head + i)?;
            secs += s;
            all.push(l);
        }
        Ok((all, secs))
    };
    // Warm both paths once (page faults, allocator; on CUDA the capture of
    // each path's decode graph) before timing.
    run(r, false)?;
    run(r, true)?;
    let (full, t_full) = run(r, false)?;
    let (pruned, t_pruned) = run(r, true)?;
    let scored = p - 1;
    let mean = |ls: &[Vec<f32>]| {
        (0..scored)
            .map(|i| nll(&ls[i], tokens[head + i + 1]))
            .sum::<f64>()
            / scored as f64
    };
    let (ppl_full, ppl_pruned) = (mean(&full).exp(), mean(&pruned).exp());
    let cos: Vec<f64> = full
        .iter()
        .zip(&pruned)
        .map(|(a, b)| cosine(a, b))
        .collect();
    let same = full
        .iter()
        .zip(&pruned)
        .filter(|(a, b)| argmax(a) == argmax(b))
        .count();
    let pages = n.div_ceil(args.page);
    let mut needles = Vec::new();
    let depths: &[f64] = if args.no_needles {
        &[]
    } else {
        &args.needle_depths
    };
    for (i, &depth) in depths.iter().enumerate() {
        needles.push(needle(
            r,
            tok,
            text_tokens,
            n,
            depth,
            1000 + (n as u64 * 7919 + i as u64 * 104_729) % 9000,
        )?);
    }
    Ok(ContextResult {
        n_ctx: n,
        pages,
        pages_attended: pages.min(r.pruning.max_selected_for(pages)),
        final_logit_cosine: *cos.last().unwrap_or(&f64::NAN),
        min_logit_cosine: cos.iter().copied().fold(f64::INFINITY, f64::min),
        same_argmax_fraction: same as f64 / p as f64,
        ppl_full,
        ppl_pruned,
        ppl_delta_pct: (ppl_pruned / ppl_full - 1.0) * 100.0,
        decode_ms_full: t_full * 1e3 / p as f64,
        decode_ms_pruned: t_pruned * 1e3 / p as f64,
        speedup: t_full / t_pruned,
        needles,
    })
}

fn needle<B: Backend>(
    r: &mut Runner<'_, B>,
    tok: &Tokenizer,
    text_tokens: &[u32],
    n: usize,
    depth: f64,
    code: u64,
) -> anyhow::Result<NeedleResult> {
    let enc = |s: &str| {
        tok.encode(s, false, false)
            .map_err(|e| anyhow::anyhow!("{e}"))
    };
    let needle = enc(&format!("\nThe secret code is {code}.\n"))?;
    let question = enc("\n\nQuestion: What is the secret code mentioned in the text above?\nAnswer: The secret code is")?;
    let hay = n.saturating_sub(needle.len() + question.len() + 8);
    let at = ((hay as f64 * depth) as usize).min(hay);
    let mut prompt: Vec<u32> = Vec::with_capacity(n);
    prompt.extend_from_slice(&text_tokens[..at]);
    prompt.extend_from_slice(&needle);
    prompt.extend_from_slice(&text_tokens[at..hay]);
    prompt.extend_from_slice(&question);
    let last = prompt.len() - 1;
    r.truncate(0);
    r.set_pruned(false)?;
    r.prefill(&prompt[..last], 0)?;
    let answer_full = greedy(r, tok, prompt[last], last, 6)?;
    r.truncate(last);
    r.set_pruned(true)?;
    let answer_pruned = greedy(r, tok, prompt[last], last, 6)?;
    let code = code.to_string();
    Ok(NeedleResult {
        depth,
        found_full: answer_full.contains(&code),
        found_pruned: answer_pruned.contains(&code),
        code,
        answer_full,
        answer_pruned,
    })
}

/// Runs `eval-long`.
pub fn run(args: EvalLongArgs) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.text)
        .with_context(|| format!("reading {}", args.text.display()))?;
    let file = Arc::new(
        GgufFile::open(&args.model).with_context(|| format!("opening {}", args.model.display()))?,
    );
    let tok = Tokenizer::from_gguf(&file).map_err(|e| anyhow::anyhow!("{e}"))?;
    let pruning = KvPruning {
        page: args.page,
        sink_pages: args.sink_pages,
        recent_pages: args.recent_pages,
        top_pages: args.top_pages,
        top_percent: args.top_percent,
        dense_layers: args.dense_layers,
    };
    pruning.validate()?;
    let backend = match args.backend {
        EvalBackend::Cpu => mirage::BackendChoice::Cpu,
        EvalBackend::Cuda => mirage::BackendChoice::Cuda,
    };
    let mut spec = mirage::LoadSpec::new(&args.model).backend(backend);
    spec.cuda_device = args.device;
    spec.options.threads = args.threads;
    if args.backend == EvalBackend::Cuda && args.page_selector != "flat" {
        bail!("--page-selector {}: the CUDA backend chooses pages with a flat scan (one pass over every page's bound, then a radix select)", args.page_selector);
    }
    match mirage::load_model(&spec, Some(file))? {
        mirage::LoadedModel::Cpu(model) => {
            let threads = model.backend().threads();
            let device = format!("cpu ({threads} threads)");
            let selector = if args.page_selector == "bvh" {
                PageSelector::Bvh
            } else {
                PageSelector::Flat
            };
            let hooks = CacheHooks {
                configure: |c: &mut mirage_runtime::KvCache| Ok(c.set_page_selector(selector)?),
                stats: |c: &mirage_runtime::KvCache| {
                    c.selection_stats().map(|s| {
                        let (queries, evaluated, flat) = s.get();
                        serde_json::json!({ "selector": args.page_selector, "pruned_queries": queries, "bounds_evaluated": evaluated, "bounds_flat_scan": flat })
                    })
                },
            };
            evaluate(
                &args,
                &model,
                &tok,
                &text,
                pruning,
                &device,
                serde_json::json!(threads),
                |_| None,
                hooks,
            )
        }
        #[cfg(feature = "cuda")]
        mirage::LoadedModel::Cuda(model) => {
            let b = model.backend();
            let (major, minor) = b.compute_capability();
            let device = format!(
                "{} (sm_{major}{minor}, device {})",
                b.device_name(),
                args.device
            );
            evaluate(
                &args,
                &model,
                &tok,
                &text,
                pruning,
                &device,
                serde_json::Value::Null,
                |b: &mirage::cuda::CudaBackend| {
                    let (g, m) = (b.graph_stats(), b.memory_stats());
                    Some(serde_json::json!({
                        "graphs": b.graphs(),
                        "graph_captures": g.captures,
                        "graph_replays": g.replays,
                        "eager_steps": g.eager,
                        "kv_cache_bytes": m.kv_cache,
                        "peak_device_bytes": m.peak,
                    }))
                },
                CacheHooks {
                    configure: |_: &mut _| Ok(()),
                    stats: |_: &_| None,
                },
            )
        }
        _ => unreachable!("a dense spec loads a dense backend"),
    }
}

/// Backend-specific handling of the cache: set-up after it is made, and the
/// page-selection cost to report (CPU: the selector and its bound counts).
struct CacheHooks<C, S> {
    configure: C,
    stats: S,
}

/// Every context of `args` on `model`; prints the table or JSON.
#[allow(clippy::too_many_arguments)]
fn evaluate<B: Backend, C, S>(
    args: &EvalLongArgs,
    model: &Model<B>,
    tok: &Tokenizer,
    text: &str,
    pruning: KvPruning,
    device: &str,
    threads: serde_json::Value,
    backend_stats: impl Fn(&B) -> Option<serde_json::Value>,
    hooks: CacheHooks<C, S>,
) -> anyhow::Result<()>
where
    C: Fn(&mut B::KvCache) -> anyhow::Result<()>,
    S: Fn(&B::KvCache) -> Option<serde_json::Value>,
{
    let n_ctx_train = model.config().n_ctx_train;
    let max_ctx = args.ctx.iter().copied().max().unwrap_or(0);
    if max_ctx < 64 {
        bail!("--ctx needs lengths of at least 64 tokens");
    }
    if max_ctx > n_ctx_train {
        eprintln!("warning: --ctx {max_ctx} exceeds the model's trained context {n_ctx_train}");
    }
    let mut text_tokens = tok
        .encode(text, tok.add_bos(), false)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    if text_tokens.len() < max_ctx {
        bail!(
            "{} has {} tokens, fewer than --ctx {max_ctx}",
            args.text.display(),
            text_tokens.len()
        );
    }
    text_tokens.truncate(max_ctx);
    let dtype = if args.kv_f16 {
        KvDtype::F16
    } else {
        KvDtype::F32
    };
    // One cache keeps the page summaries; the selection is toggled per run.
    let mut cache = model.new_kv_cache_pruned(max_ctx + 16, 1, dtype, Some(pruning))?;
    (hooks.configure)(&mut cache)?;
    let scratch = model.new_scratch();
    let mut runner = Runner {
        model,
        cache,
        scratch,
        pruning,
    };
    let backend = args.backend.as_str();
    eprintln!("eval-long on {backend}: {device}");
    let mut results = Vec::new();
    for &n in &args.ctx {
        let start = Instant::now();
        let r = eval_context(&mut runner, tok, &text_tokens, n, args)?;
        eprintln!(
            "ctx {n}: cos {:.5} ppl {:.3} -> {:.3} ({:+.2}%) decode {:.1} -> {:.1} ms/tok, needles full {}/{} pruned {}/{} ({:.0} s)",
            r.final_logit_cosine,
            r.ppl_full,
            r.ppl_pruned,
            r.ppl_delta_pct,
            r.decode_ms_full,
            r.decode_ms_pruned,
            r.needles.iter().filter(|x| x.found_full).count(),
            r.needles.len(),
            r.needles.iter().filter(|x| x.found_pruned).count(),
            r.needles.len(),
            start.elapsed().as_secs_f64()
        );
        results.push(r);
    }
    let kv_dtype = if args.kv_f16 { "f16" } else { "f32" };
    if args.json {
        let mut json = serde_json::json!({
            "model": args.model.display().to_string(),
            "text": args.text.display().to_string(),
            "backend": backend,
            "device": device,
            "n_ctx_train": n_ctx_train,
            "pruning": { "page": pruning.page, "sink_pages": pruning.sink_pages, "recent_pages": pruning.recent_pages, "top_pages": pruning.top_pages, "top_percent": pruning.top_percent, "dense_layers": pruning.dense_layers },
            "kv_dtype": kv_dtype,
            "threads": threads,
            "ppl_tokens": args.ppl_tokens,
            "results": results,
        });
        if let Some(stats) = backend_stats(model.backend()) {
            json[backend] = stats;
        }
        if let Some(sel) = (hooks.stats)(&runner.cache) {
            json["page_selection"] = sel;
        }
        println!("{}", serde_json::to_string_pretty(&json)?);
    } else {
        println!("backend: {backend}, device: {device}, KV {kv_dtype}");
        println!();
        println!("| ctx | pages attended | final-logit cos | min cos | same top-1 | PPL full | PPL pruned | ΔPPL | needles full | needles pruned | ms/tok full | ms/tok pruned | speedup |");
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for r in &results {
            let nf = r.needles.iter().filter(|x| x.found_full).count();
            let np = r.needles.iter().filter(|x| x.found_pruned).count();
            let agree = r
                .needles
                .iter()
                .filter(|x| x.answer_full == x.answer_pruned)
                .count();
            println!(
                "| {} | {}/{} | {:.5} | {:.5} | {:.0}% | {:.3} | {:.3} | {:+.2}% | {nf}/{} | {np}/{} ({agree} same text) | {:.1} | {:.1} | {:.2}x |",
                r.n_ctx,
                r.pages_attended,
                r.pages,
                r.final_logit_cosine,
                r.min_logit_cosine,
                r.same_argmax_fraction * 100.0,
                r.ppl_full,
                r.ppl_pruned,
                r.ppl_delta_pct,
                r.needles.len(),
                r.needles.len(),
                r.decode_ms_full,
                r.decode_ms_pruned,
                r.speedup
            );
        }
        if let Some(sel) = (hooks.stats)(&runner.cache) {
            let n = |k: &str| sel[k].as_u64().unwrap_or(0);
            let (q, e, f) = (
                n("pruned_queries"),
                n("bounds_evaluated"),
                n("bounds_flat_scan"),
            );
            println!(
                "page selection ({}): {q} pruned queries, {e} page/group bounds computed, a flat scan computes {f} ({:.2}x)",
                args.page_selector,
                f as f64 / e.max(1) as f64
            );
        }
    }
    Ok(())
}
