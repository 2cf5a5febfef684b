//! `mirage-cli bench --sparsity 0.4,0.5`: CPU decode speed under activation
//! sparsity against MIRAGE's own dense path on the original GGUF, in one
//! process: every round decodes the same prompt densely and at each
//! sparsity, one after the other, so that machine load hits them alike;
//! the table shows per configuration the median over rounds of decode tok/s,
//! its ratio to dense in the same round (median of the per-round ratios),
//! the weight bytes one decode token reads and the sparsity achieved.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use mirage_artifact::activation::backend::ActivationBackend;
use mirage_artifact::activation::format::ActivationArtifact;
use mirage_artifact::activation::SparsityTarget;
use mirage_gguf::GgufFile;
use mirage_runtime::backend::Backend;
use mirage_runtime::{CpuBackend, KvDtype, Model, TokenSlot};

use super::bench::{argmax, bench_prompt, BenchArgs};

/// The default activation artifact of a model: `<model>.activation.mirage`.
pub fn default_artifact(model: &Path) -> PathBuf {
    model.with_extension("activation.mirage")
}

/// The held-out text the prompt comes from by default.
const DEFAULT_TEXT: &str = "/usr/lib/python3.11/textwrap.py";

fn load_avg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// Prefills `prompt`, calls `after_prefill`, then decodes `gen` tokens
/// greedily; returns decode tok/s.
pub(super) fn decode<B: Backend>(
    model: &Model<B>,
    prompt: &[u32],
    gen: usize,
    after_prefill: &dyn Fn(),
) -> anyhow::Result<f64> {
    let n = prompt.len();
    let mut cache = model.new_kv_cache(n + gen + 1, 1, KvDtype::F32)?;
    let mut s = model.new_scratch();
    let mut logits = Vec::new();
    let slots: Vec<TokenSlot> = (0..n).map(|pos| TokenSlot { seq: 0, pos }).collect();
    model.forward(prompt, &slots, &[n - 1], &mut cache, &mut s, &mut logits)?;
    let mut tok = argmax(&logits);
    after_prefill();
    let t = Instant::now();
    for i in 0..gen {
        let slot = TokenSlot { seq: 0, pos: n + i };
        model.forward(&[tok], &[slot], &[0], &mut cache, &mut s, &mut logits)?;
        tok = argmax(&logits);
    }
    Ok(gen as f64 / t.elapsed().as_secs_f64())
}

pub(super) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The prompt of an activation bench: the first `--prompt` tokens of
/// `--sparsity-text` (default [`DEFAULT_TEXT`] when present), else random
/// tokens; and where they came from.
pub(super) fn prompt(
    args: &BenchArgs,
    file: &GgufFile,
    vocab: usize,
) -> anyhow::Result<(Vec<u32>, String)> {
    let text_path = args
        .sparsity_text
        .clone()
        .or_else(|| Some(PathBuf::from(DEFAULT_TEXT)).filter(|p| p.exists()));
    Ok(match &text_path {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let tok = mirage_tokenizer::Tokenizer::from_gguf(file)?;
            let mut t = tok.encode(&text, true, true)?;
            t.truncate(args.prompt.max(1));
            if t.is_empty() {
                bail!("{} gives no tokens", p.display());
            }
            (t, p.display().to_string())
        }
        None => (
            bench_prompt(vocab, args.prompt.max(1)),
            "random tokens".to_string(),
        ),
    })
}

/// The sparsities checked, the activation artifact (`--artifact` or the
/// model's default) and the model it was built from, its sha256 checked:
/// what both the CPU and the CUDA sparsity benches start from.
pub(super) fn open_inputs(
    args: &BenchArgs,
) -> anyhow::Result<(Arc<ActivationArtifact>, Arc<GgufFile>)> {
    for &s in &args.sparsity {
        SparsityTarget::Fixed(s).validate()?;
    }
    super::generate::check_model(&args.model)?;
    let path = args
        .artifact
        .clone()
        .unwrap_or_else(|| default_artifact(&args.model));
    let cpu = args.backend != "cuda";
    let memory = mirage::WeightMemory::mapped_if(args.mmap).for_file(cpu, &path);
    let artifact = ActivationArtifact::open_with(&path, memory).with_context(|| {
        format!(
            "loading the activation artifact {} (build it with `cargo xtask build-artifacts --mode activation --model {}`)",
            path.display(),
            args.model.display()
        )
    })?;
    let file = Arc::new(super::bench::open_model(&args.model, args.mmap, cpu)?);
    artifact.check_source_sha256(&mirage_artifact::format::sha256_hex(file.as_bytes()))?;
    Ok((artifact, file))
}

/// Runs the activation-sparsity bench.
pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    if args.backend == "cuda" {
        #[cfg(feature = "cuda")]
        return super::bench_activation_cuda::run(args);
        #[cfg(not(feature = "cuda"))]
        bail!("--backend cuda --sparsity needs the CUDA backend: build mirage-cli with --features cuda");
    }
    if args.backend != "cpu" {
        bail!("--sparsity benches the CPU or the CUDA kernels: use --backend cpu or cuda");
    }
    let (artifact, file) = open_inputs(args)?;
    let n_layer = artifact.meta().n_layer;
    let dense = Model::load(file.clone(), CpuBackend::new(args.threads)?)?;
    let sparse_backend = ActivationBackend::new(
        CpuBackend::new(args.threads)?,
        Some(artifact.clone()),
        n_layer,
    );
    let threads = sparse_backend.inner().threads();
    let kernels = sparse_backend.name();
    let sparse = Model::load(file.clone(), sparse_backend)?;
    let weight_bytes = super::bench::weight_bytes_per_token(&file);
    let (toks, prompt_from) = prompt(args, &file, dense.config().vocab_size)?;
    let gen = args.gen.max(1);
    let plan = args.sparsity_plan.as_deref();
    // Configurations: dense, then each sparsity (thresholds of the plan's
    // resolved per-matrix sparsities).
    let mut configs: Vec<(String, Option<Vec<Option<Vec<f32>>>>)> = vec![("dense".into(), None)];
    for &s in &args.sparsity {
        let r = artifact.resolve(plan, SparsityTarget::Fixed(s))?;
        let crit = artifact
            .plan(&r.plan)
            .map(|(m, _)| m.criterion)
            .ok_or_else(|| anyhow::anyhow!("no plan `{}` in the artifact", r.plan))?;
        // An unnamed plan is chosen per sparsity: the label says which.
        let label = match plan {
            Some(_) => format!("{} @ {s:.2}", r.plan),
            None => format!("default: {} @ {s:.2}", r.plan),
        };
        configs.push((label, Some(artifact.thresholds(crit, &r.per_matrix))));
    }
    let load0 = load_avg();
    eprintln!(
        "bench: {} | prompt {} tokens of {prompt_from} + {} decode tokens | {} rounds | {} threads | load {}",
        args.model.display(),
        toks.len(),
        gen,
        args.rounds,
        threads,
        load0
    );
    // Warm-up: one short decode each (page in the weights).
    decode(&dense, &toks[..toks.len().min(8)], 2, &|| {})?;
    decode(&sparse, &toks[..toks.len().min(8)], 2, &|| {})?;
    let mut speed: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    let mut ratio: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    let mut bytes: Vec<f64> = vec![weight_bytes as f64; configs.len()];
    let mut achieved: Vec<f64> = vec![0.0; configs.len()];
    let mut loads = Vec::new();
    for _round in 0..args.rounds.max(1) {
        loads.push(load_avg());
        let mut dense_tps = f64::NAN;
        for (c, (_, thr)) in configs.iter().enumerate() {
            let tps = match thr {
                None => decode(&dense, &toks, gen, &|| {})?,
                Some(t) => {
                    sparse.backend().set_thresholds(t.clone())?;
                    let tps = decode(&sparse, &toks, gen, &|| {
                        sparse.backend().take_stats();
                    })?;
                    let st = sparse.backend().take_stats();
                    if st.kernel_rows > 0 {
                        // The decode steps' bytes and channels.
                        // The dense bytes less those of the products the
                        // channel-major kernels ran, plus what they read.
                        let per_tok = st.kernel_bytes as f64 / gen as f64;
                        let replaced = st.replaced_bytes as f64 / gen as f64;
                        bytes[c] = weight_bytes as f64 - replaced + per_tok;
                        achieved[c] = super::eval_activation::achieved_sparsity(&artifact, &st);
                    }
                    tps
                }
            };
            if c == 0 {
                dense_tps = tps;
            }
            speed[c].push(tps);
            ratio[c].push(tps / dense_tps);
        }
    }
    let load1 = load_avg();
    println!(
        "model {} | cpu, {} threads, {} | prompt {} tokens ({prompt_from}) + decode {} tokens, {} rounds | load (1/5/15 min) before {} after {}; at each round: {}",
        args.model.display(),
        threads,
        kernels,
        toks.len(),
        gen,
        args.rounds.max(1),
        load0,
        load1,
        loads
            .iter()
            .map(|l| l.split_whitespace().next().unwrap_or("?").to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "{:<40} {:>9} {:>8} {:>12} {:>9}",
        "config", "tok/s", "x dense", "MiB/token", "achieved"
    );
    for (c, (name, _)) in configs.iter().enumerate() {
        println!(
            "{:<40} {:>9.2} {:>8.3} {:>12.1} {:>9.3}",
            name,
            median(&mut speed[c]),
            median(&mut ratio[c]),
            bytes[c] / (1 << 20) as f64,
            achieved[c]
        );
    }
    Ok(())
}
