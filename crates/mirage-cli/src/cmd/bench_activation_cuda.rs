//! `mirage-cli bench --backend cuda --sparsity 0,0.25,0.5`: CUDA decode
//! speed under activation sparsity against MIRAGE's own dense CUDA path, in
//! one process and on one loaded model. The [`ActivationCudaBackend`]
//! without thresholds runs the dense backend's FFN launch for launch; with
//! a sparsity's thresholds its FFN decode rows read only the active input
//! channels of gate, up and down (Q/K/V/O and the head stay dense on CUDA,
//! whatever the plan says of them). Every round decodes the same prompt
//! densely and at each sparsity, one after the other; the table shows per
//! configuration the median decode tok/s over rounds, the median of its
//! per-round ratio to dense, and, measured on untimed decode rows after the
//! rounds (the kernels' channel lists read back), the FFN weight bytes a
//! token reads, the share of the FFN's input channels kept and the whole
//! model's bytes per token.

use anyhow::Context;
use mirage::cuda::{ActivationCudaBackend, CudaBackend, StepProfile};
use mirage_artifact::activation::{Proj, SparsityTarget};
use mirage_runtime::backend::Backend;
use mirage_runtime::{KvDtype, Model, TokenSlot};

use super::bench::{argmax, BenchArgs};
use super::bench_activation::{decode, median, prompt};

/// Decode rows whose FFN bytes are averaged per configuration.
const BYTE_ROWS: usize = 8;

/// What the FFN of one decode token read, averaged over [`BYTE_ROWS`] rows,
/// and one more decode step's time per op class.
struct FfnRead {
    /// Weight bytes of gate, up and down read per token.
    bytes: f64,
    /// Active input channels over all of gate's, up's and down's.
    kept: f64,
    /// The step run launch by launch between events (no overlap, launch
    /// latency counted): where a configuration's time goes.
    profile: Option<StepProfile>,
}

/// Prefills `prompt`, then decodes [`BYTE_ROWS`] tokens greedily, reading
/// the last row's FFN bytes back after each (untimed: each read waits for
/// the device), then one profiled step. `ffn_dense` is what a layer run by
/// the dense kernels reads.
fn ffn_read(
    model: &Model<ActivationCudaBackend>,
    prompt: &[u32],
    ffn_dense: f64,
) -> anyhow::Result<FfnRead> {
    let n = prompt.len();
    let mut cache = model.new_kv_cache(n + BYTE_ROWS + 2, 1, KvDtype::F32)?;
    let mut s = model.new_scratch();
    let mut logits = Vec::new();
    let slots: Vec<TokenSlot> = (0..n).map(|pos| TokenSlot { seq: 0, pos }).collect();
    model.forward(prompt, &slots, &[n - 1], &mut cache, &mut s, &mut logits)?;
    let (mut bytes, mut kept) = (0.0, 0.0);
    for i in 0..BYTE_ROWS {
        let tok = argmax(&logits);
        let slot = TokenSlot { seq: 0, pos: n + i };
        model.forward(&[tok], &[slot], &[0], &mut cache, &mut s, &mut logits)?;
        let b = model.backend().last_row_ffn_bytes()?;
        if b.dense == 0 {
            // No layer ran the sparse kernels: the dense FFN, every channel.
            bytes += ffn_dense;
            kept += 1.0;
        } else {
            bytes += b.sparse as f64;
            kept += b.kept;
        }
    }
    let inner = model.backend().inner();
    inner.profile_next_step();
    let slot = TokenSlot {
        seq: 0,
        pos: n + BYTE_ROWS,
    };
    model.forward(
        &[argmax(&logits)],
        &[slot],
        &[0],
        &mut cache,
        &mut s,
        &mut logits,
    )?;
    Ok(FfnRead {
        bytes: bytes / BYTE_ROWS as f64,
        kept: kept / BYTE_ROWS as f64,
        profile: inner.take_step_profile(),
    })
}

/// Runs the CUDA activation-sparsity bench.
pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let (artifact, file) = super::bench_activation::open_inputs(args)?;
    let spec = super::bench::spec(args)?;
    let inner = CudaBackend::with_options(args.device, &spec.cuda).with_context(|| {
        format!(
            "--backend cuda: starting the CUDA backend on device {}",
            args.device
        )
    })?;
    let device = inner.device_name().to_string();
    let copy_bw = inner.copy_bandwidth(256 << 20, 10)?;
    let backend = ActivationCudaBackend::new(inner, artifact.clone())?;
    let model = Model::load(file.clone(), backend)?;
    let n_layer = artifact.meta().n_layer;
    let weight_bytes = super::bench::weight_bytes_per_token(&file) as f64;
    // The FFN's bytes in the file: what the dense kernels read per token.
    let ffn_dense: f64 = (0..n_layer)
        .flat_map(|l| [Proj::Gate, Proj::Up, Proj::Down].map(|p| p.tensor(l)))
        .map(|n| file.tensor_info(&n).map_or(0, |t| t.n_bytes()) as f64)
        .sum();
    let (toks, prompt_from) = prompt(args, &file, model.config().vocab_size)?;
    let gen = args.gen.max(1);
    let plan = args.sparsity_plan.as_deref();
    // Configurations: dense (no thresholds), then each sparsity (the
    // thresholds of the plan's per-matrix sparsities; the backend takes
    // gate's, up's and down's).
    let n_mat = n_layer * Proj::ALL.len() + 1;
    let mut configs: Vec<(String, Vec<Option<Vec<f32>>>)> =
        vec![("dense".into(), vec![None; n_mat])];
    for &s in &args.sparsity {
        let r = artifact.resolve(plan, SparsityTarget::Fixed(s))?;
        let crit = artifact
            .plan(&r.plan)
            .map(|(m, _)| m.criterion)
            .ok_or_else(|| anyhow::anyhow!("no plan `{}` in the artifact", r.plan))?;
        configs.push((
            format!("sparse {s:.2} {}", r.plan),
            artifact.thresholds(crit, &r.per_matrix),
        ));
    }
    eprintln!(
        "bench: {} on {device} | prompt {} tokens of {prompt_from} + {gen} decode tokens | {} rounds",
        args.model.display(),
        toks.len(),
        args.rounds.max(1)
    );
    let b = model.backend();
    let short = &toks[..toks.len().min(8)];
    // Warm-up: every configuration once (graphs captured, clocks up).
    for (_, thr) in &configs {
        b.set_thresholds(thr.clone())?;
        decode(&model, short, 4, &|| {})?;
    }
    let n = configs.len();
    let (mut speed, mut ratio) = (vec![Vec::new(); n], vec![Vec::new(); n]);
    for _round in 0..args.rounds.max(1) {
        let mut dense_tps = f64::NAN;
        for (c, (_, thr)) in configs.iter().enumerate() {
            b.set_thresholds(thr.clone())?;
            let tps = decode(&model, &toks, gen, &|| {})?;
            if c == 0 {
                dense_tps = tps;
            }
            speed[c].push(tps);
            ratio[c].push(tps / dense_tps);
        }
    }
    let mut read = Vec::with_capacity(n);
    for (_, thr) in &configs {
        b.set_thresholds(thr.clone())?;
        read.push(ffn_read(&model, short, ffn_dense)?);
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
        "(sparse rows: only gate, up and down take thresholds on CUDA; `kept` is the measured share of their input channels, over {BYTE_ROWS} decode rows)"
    );
    println!(
        "{:<28} {:>9} {:>8} {:>12} {:>8} {:>7} {:>11} {:>9}",
        "config", "tok/s", "x dense", "FFN MiB/tok", "x FFN", "kept", "MiB/token", "GB/s"
    );
    for (c, (name, _)) in configs.iter().enumerate() {
        let tps = median(&mut speed[c]);
        let total = weight_bytes - ffn_dense + read[c].bytes;
        println!(
            "{:<28} {:>9.1} {:>8.3} {:>12.1} {:>8.3} {:>7.3} {:>11.1} {:>9.0}",
            name,
            tps,
            median(&mut ratio[c]),
            read[c].bytes / (1 << 20) as f64,
            read[c].bytes / ffn_dense.max(1.0),
            read[c].kept,
            total / (1 << 20) as f64,
            total * tps / 1e9
        );
    }
    println!("one decode step per configuration, launch by launch between events (launch latency counted, nothing overlapped):");
    for (c, (name, _)) in configs.iter().enumerate() {
        if let Some(p) = &read[c].profile {
            println!(
                "{name:<28} mat-vec {:.0} us, attention {:.0} us, other {:.0} us, {} launches",
                p.matvec_us, p.attention_us, p.other_us, p.launches
            );
        }
    }
    Ok(())
}
