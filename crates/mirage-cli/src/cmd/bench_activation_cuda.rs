//! `mirage-cli bench --backend cuda --sparsity 0.25,0.4,0.5`: CUDA decode
//! speed under activation sparsity against MIRAGE's own dense CUDA path, in
//! one process and on one loaded model: the [`ActivationCudaBackend`]
//! without thresholds runs the dense backend's kernels launch for launch
//! (the original GGUF's weights), and with a sparsity's thresholds the
//! channel-major kernels. Every round decodes the same prompt densely and
//! at each sparsity; the table shows per configuration the median decode
//! tok/s over rounds, its ratio to dense in the same round, the weight
//! bytes one decode token reads (the sparse kernels' own count of the
//! active channels and groups), the effective bandwidth, the share of the
//! sparse matrices' bytes skipped, and from one decode step launched op by
//! op between events the mat-vecs' device time and the bandwidth it means
//! for those bytes.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use mirage::cuda::{ActivationCudaBackend, CudaBackend};
use mirage_artifact::activation::format::ActivationArtifact;
use mirage_artifact::activation::{Proj, SparsityTarget};
use mirage_gguf::GgufFile;
use mirage_runtime::backend::Backend;
use mirage_runtime::Model;

use super::bench::BenchArgs;
use super::bench_activation::{decode, default_artifact, median, random_prompt};

/// Runs the CUDA activation-sparsity bench.
pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    for &s in &args.sparsity {
        SparsityTarget::Fixed(s).validate()?;
    }
    super::generate::check_model(&args.model)?;
    let path = args
        .artifact
        .clone()
        .unwrap_or_else(|| default_artifact(&args.model));
    let artifact = ActivationArtifact::open(&path).with_context(|| {
        format!(
            "loading the activation artifact {} (build it with `cargo xtask build-artifacts --mode activation --model {}`)",
            path.display(),
            args.model.display()
        )
    })?;
    let file = Arc::new(
        GgufFile::open(&args.model).with_context(|| format!("opening {}", args.model.display()))?,
    );
    artifact.check_source_sha256(&mirage_artifact::format::sha256_hex(file.as_bytes()))?;
    let spec = super::bench::spec(args)?;
    let inner =
        CudaBackend::with_options(args.device, &spec.cuda).context("starting the CUDA backend")?;
    let device = inner.device_name().to_string();
    let copy_bw = inner.copy_bandwidth(256 << 20, 10)?;
    let backend = ActivationCudaBackend::new(inner, artifact.clone())?;
    let model = Model::load(file.clone(), backend)?;
    let n_layer = artifact.meta().n_layer;
    let n_mat = n_layer * Proj::ALL.len() + 1;
    let weight_bytes = super::bench::weight_bytes_per_token(&file);
    // Source bytes per matrix index (the head last).
    let src_bytes: Vec<u64> = (0..n_layer)
        .flat_map(|l| Proj::ALL.into_iter().map(move |p| p.tensor(l)))
        .chain(std::iter::once(artifact.meta().head_tensor.clone()))
        .map(|n| file.tensor_info(&n).map_or(0, |t| t.n_bytes()))
        .collect();
    let cm_bytes: Vec<u64> = artifact
        .matrices()
        .iter()
        .map(|e| e.layout.bytes() as u64)
        .collect();
    let toks = match &args.sparsity_text {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let tok = mirage_tokenizer::Tokenizer::from_gguf(&file)?;
            let mut t = tok.encode(&text, true, true)?;
            t.truncate(args.prompt.max(1));
            t
        }
        None => random_prompt(args.prompt.max(1), model.config().vocab_size.max(2)),
    };
    let prompt_from = args.sparsity_text.as_ref().map_or_else(
        || "random tokens".to_string(),
        |p: &PathBuf| p.display().to_string(),
    );
    let gen = args.gen.max(1);
    let plan = args.sparsity_plan.as_deref();
    let mut configs: Vec<(String, Vec<Option<Vec<f32>>>)> =
        vec![("dense".into(), vec![None; n_mat])];
    for &s in &args.sparsity {
        let r = artifact.resolve(plan, SparsityTarget::Fixed(s))?;
        let crit = artifact
            .plan(&r.plan)
            .map(|(m, _)| m.criterion)
            .ok_or_else(|| anyhow::anyhow!("no plan `{}` in the artifact", r.plan))?;
        configs.push((
            format!("{} @ {s:.2}", r.plan),
            artifact.thresholds(crit, &r.per_matrix),
        ));
    }
    eprintln!(
        "bench: {} on {device} | prompt {} tokens of {prompt_from} + {gen} decode tokens | {} rounds",
        args.model.display(),
        toks.len(),
        args.rounds
    );
    let b = model.backend();
    // Warm-up: every configuration once (graphs captured, clocks up).
    for (_, thr) in &configs {
        b.set_thresholds(thr.clone())?;
        decode(&model, &toks[..toks.len().min(8)], 4, &|| {})?;
    }
    let n = configs.len();
    let (mut speed, mut ratio) = (vec![Vec::new(); n], vec![Vec::new(); n]);
    let mut bytes = vec![weight_bytes as f64; n];
    let mut skipped = vec![0.0f64; n];
    for _round in 0..args.rounds.max(1) {
        let mut dense_tps = f64::NAN;
        for (c, (_, thr)) in configs.iter().enumerate() {
            b.set_thresholds(thr.clone())?;
            let tps = decode(&model, &toks, gen, &|| {
                let _ = b.take_stats();
            })?;
            let st = b.take_stats()?;
            if st.kernel_bytes > 0 {
                let sparse: Vec<usize> = (0..n_mat).filter(|&m| thr[m].is_some()).collect();
                let src: u64 = sparse.iter().map(|&m| src_bytes[m]).sum();
                let cm: u64 = sparse.iter().map(|&m| cm_bytes[m]).sum();
                let per_tok = st.kernel_bytes as f64 / gen as f64;
                bytes[c] = weight_bytes as f64 - src as f64 + per_tok;
                skipped[c] = 1.0 - per_tok / cm.max(1) as f64;
            }
            if c == 0 {
                dense_tps = tps;
            }
            speed[c].push(tps);
            ratio[c].push(tps / dense_tps);
        }
    }
    // One decode step per configuration launched op by op between events:
    // the mat-vecs' device time, against the weight bytes a token reads.
    let mut mv_us = vec![f64::NAN; n];
    for (c, (_, thr)) in configs.iter().enumerate() {
        b.set_thresholds(thr.clone())?;
        decode(&model, &toks[..toks.len().min(8)], 2, &|| {
            b.inner().profile_next_step()
        })?;
        if let Some(p) = b.inner().take_step_profile() {
            mv_us[c] = p.matvec_us;
        }
    }
    println!(
        "model {} | cuda, {device} ({}) | prompt {} tokens ({prompt_from}) + decode {gen} tokens, {} rounds | copy bandwidth {:.0} GB/s",
        args.model.display(),
        b.name(),
        toks.len(),
        args.rounds.max(1),
        copy_bw / 1e9
    );
    println!(
        "{:<34} {:>9} {:>8} {:>12} {:>9} {:>10} {:>9} {:>8} {:>10}",
        "config",
        "tok/s",
        "x dense",
        "MiB/token",
        "GB/s",
        "% copy bw",
        "skipped",
        "mv us",
        "mv % copy"
    );
    for (c, (name, _)) in configs.iter().enumerate() {
        let tps = median(&mut speed[c]);
        let gbs = bytes[c] * tps / 1e9;
        println!(
            "{:<34} {:>9.1} {:>8.3} {:>12.1} {:>9.0} {:>10.1} {:>9.3} {:>8.0} {:>10.1}",
            name,
            tps,
            median(&mut ratio[c]),
            bytes[c] / (1 << 20) as f64,
            gbs,
            100.0 * gbs * 1e9 / copy_bw,
            skipped[c],
            mv_us[c],
            100.0 * bytes[c] / (mv_us[c] * 1e-6) / copy_bw
        );
    }
    Ok(())
}
