//! The activation-sparse CUDA backend against the CPU activation backend
//! (mirage-artifact's `ActivationBackend`, an independent implementation:
//! its own channel-major kernels on the host) on the same artifact,
//! thresholds and tokens, on small random models (Q8_0, and Q4_K / Q6_K
//! projections): every decode step's logits at cosine >= 0.9999 and the
//! same greedy tokens over 32 steps, with about 40 % of every projection's
//! input channels skipped; with every channel kept, the sparse kernels give
//! the dense CUDA path's logits. Skips (printing why) without a GPU.

mod common;

use std::sync::Arc;

use common::{cosine, Greedy, Tiny};
use mirage_artifact::activation::backend::{ActivationBackend, Slot};
use mirage_artifact::activation::format::{
    write_bytes, ActivationArtifact, ActivationContents, ActivationMeta, Allocation, MatrixScores,
    PlanMeta, PlanTable, QUANTILE_LEVELS,
};
use mirage_artifact::activation::graph::{head_matrix, projection};
use mirage_artifact::activation::{matrix_index, Criterion, Proj};
use mirage_cuda::ActivationCudaBackend;
use mirage_gguf::quant::channel_major::{repack, ChannelMajorLayout};
use mirage_gguf::{GgmlType, GgufFile};
use mirage_runtime::kv_cache::KvDtype;
use mirage_runtime::{CpuBackend, Model, ModelConfig};

/// An activation artifact of `file` holding only what the backends read:
/// every projection and the head channel-major (scores and the one plan
/// are placeholders; the tests set thresholds directly).
fn artifact(file: &Arc<GgufFile>) -> Arc<ActivationArtifact> {
    let c = ModelConfig::from_hparams(&file.hparams().unwrap()).unwrap();
    let mut hosts: Vec<_> = (0..c.n_layer)
        .flat_map(|l| Proj::ALL.into_iter().map(move |p| (l, p)))
        .map(|(l, p)| projection(file, &c, l, p).unwrap())
        .collect();
    hosts.push(head_matrix(file, &c).unwrap());
    let matrices: Vec<(ChannelMajorLayout, Vec<u8>)> = hosts
        .iter()
        .map(|h| {
            let l = ChannelMajorLayout::new(h.ty, h.rows, h.cols).unwrap();
            let mut cm = vec![0u8; l.bytes()];
            repack(&l, h.data.as_slice(), &mut cm).unwrap();
            (l, cm)
        })
        .collect();
    let n = matrices.len();
    let ramp: Vec<f32> = (0..=QUANTILE_LEVELS).map(|k| k as f32).collect();
    let scores = hosts
        .iter()
        .map(|h| MatrixScores {
            col_norms: vec![1.0; h.cols],
            quantiles: [ramp.clone(), ramp.clone()],
        })
        .collect();
    let meta = ActivationMeta {
        kind: "activation".into(),
        arch: "qwen2".into(),
        n_layer: c.n_layer,
        d_model: c.n_embd,
        n_ff: c.n_ff,
        source_name: "tiny.gguf".into(),
        head_tensor: hosts[n - 1].name.clone(),
        source_sha256: mirage_artifact::format::sha256_hex(file.as_bytes()),
        calib_name: "none".into(),
        calib_sha256: mirage_artifact::format::sha256_hex(b""),
        calib_tokens: 0,
        ppl_tokens: 0,
        dense_calib_ppl: 1.0,
        plans: vec![PlanMeta {
            name: "teal/uniform".into(),
            criterion: Criterion::Teal,
            allocation: Allocation::Uniform,
            targets: vec![0.0],
        }],
        default_plan: "teal/uniform".into(),
    };
    let contents = ActivationContents {
        meta,
        scores,
        plans: vec![PlanTable {
            rows: vec![vec![0.0; n]],
            ppl: vec![1.0],
        }],
    };
    ActivationArtifact::from_bytes(write_bytes(&contents, &matrices).unwrap()).unwrap()
}

/// TEAL thresholds that skip `sparsity` of every projection's inputs on
/// the prompt (recorded by the CPU backend); the head dense.
fn thresholds(file: &Arc<GgufFile>, prompt: &[u32], sparsity: f32) -> Vec<Option<Vec<f32>>> {
    let c = ModelConfig::from_hparams(&file.hparams().unwrap()).unwrap();
    let b = ActivationBackend::new(CpuBackend::new(0).unwrap(), None, c.n_layer);
    b.start_recording();
    let model = Model::load(file.clone(), b).unwrap();
    model.logits_all(prompt, KvDtype::F32).unwrap();
    let rec = model.backend().take_recording();
    let mut thr = vec![None; c.n_layer * Proj::ALL.len() + 1];
    for l in 0..c.n_layer {
        for p in Proj::ALL {
            let mut v: Vec<f32> = rec[Slot::input_of(p).index(l)]
                .iter()
                .map(|x| x.abs())
                .collect();
            assert!(!v.is_empty(), "nothing recorded for layer {l} {p:?}");
            let width = match p {
                Proj::O => c.n_head * c.head_dim,
                Proj::Down => c.n_ff,
                _ => c.n_embd,
            };
            v.sort_by(|a, b| a.total_cmp(b));
            let tau = v[(sparsity * v.len() as f32) as usize];
            thr[matrix_index(l, p)] = Some(vec![tau; width]);
        }
    }
    thr
}

fn worst_step_cosine(a: &[f32], b: &[f32], vocab: usize) -> f64 {
    a.chunks(vocab)
        .zip(b.chunks(vocab))
        .map(|(x, y)| cosine(x, y))
        .fold(1.0, f64::min)
}

fn cuda_backend(test: &str, a: &Arc<ActivationArtifact>) -> Option<ActivationCudaBackend> {
    let b = common::cuda(test)?;
    Some(ActivationCudaBackend::new(b, a.clone()).unwrap())
}

fn compare_with_cpu(test: &str, tiny: &Tiny) {
    let file = tiny.build(7);
    let a = artifact(&file);
    let Some(gpu) = cuda_backend(test, &a) else {
        return;
    };
    let vocab = 384;
    let g = Greedy {
        prompt: 20,
        steps: 32,
        ..Greedy::default()
    };
    let thr = thresholds(&file, &common::prompt(0, g.prompt, vocab), 0.4);
    let n_layer = a.meta().n_layer;
    let cpu = ActivationBackend::new(CpuBackend::new(0).unwrap(), Some(a.clone()), n_layer);
    cpu.set_thresholds(thr.clone()).unwrap();
    let cpu = Model::load(file.clone(), cpu).unwrap();
    let (want, toks) = common::greedy_run(&cpu, g);
    gpu.set_thresholds(thr).unwrap();
    let gpu = Model::load(file.clone(), gpu).unwrap();
    gpu.backend().take_stats().unwrap();
    // Teacher-forced on the CPU's tokens: both paths see the same inputs.
    let (got, gtoks) = common::greedy_run(
        &gpu,
        Greedy {
            force: Some(&toks),
            ..g
        },
    );
    let st = gpu.backend().take_stats().unwrap();
    let worst = worst_step_cosine(&got, &want, vocab);
    eprintln!(
        "{test}: worst step cosine {worst:.6} over {} steps",
        g.steps
    );
    assert!(worst >= 0.9999, "{test}: worst step cosine {worst}");
    assert_eq!(gtoks, toks, "{test}: greedy tokens differ");
    // The kernels did skip: per projection, the kept share near 0.6.
    let c = ModelConfig::from_hparams(&file.hparams().unwrap()).unwrap();
    for l in 0..n_layer {
        for p in Proj::ALL {
            let (act, _) = st.active[matrix_index(l, p)];
            let width = match p {
                Proj::O => c.n_head * c.head_dim,
                Proj::Down => c.n_ff,
                _ => c.n_embd,
            };
            let kept = act as f64 / (width * g.steps) as f64;
            assert!(
                (0.2..0.9).contains(&kept),
                "{test}: layer {l} {p:?} kept {kept:.3} of its channels"
            );
        }
    }
    assert!(st.kernel_bytes > 0);
}

#[test]
fn q8_0_sparse_decode_matches_the_cpu_activation_backend() {
    compare_with_cpu("q8_0_sparse_decode", &Tiny::Q8_BIASED);
}

#[test]
fn k_quant_sparse_decode_matches_the_cpu_activation_backend() {
    let tiny = Tiny {
        arch: "qwen2",
        embd: GgmlType::Q8_0,
        types: [
            GgmlType::Q4_K,
            GgmlType::Q4_K,
            GgmlType::Q6_K,
            GgmlType::Q4_K,
            GgmlType::Q4_K,
            GgmlType::Q6_K,
        ],
        bias: true,
    };
    compare_with_cpu("k_quant_sparse_decode", &tiny);
}

/// Every channel kept (thresholds 0): the channel-major kernels give the
/// dense CUDA path's logits.
#[test]
fn keeping_every_channel_gives_the_dense_logits() {
    let file = Tiny::Q8_BIASED.build(3);
    let a = artifact(&file);
    let Some(gpu) = cuda_backend("keep_all", &a) else {
        return;
    };
    let g = Greedy {
        steps: 8,
        ..Greedy::default()
    };
    let gpu = Model::load(file.clone(), gpu).unwrap();
    let (dense, toks) = common::greedy_run(&gpu, g);
    let n = a.meta().n_layer * Proj::ALL.len() + 1;
    let mut all: Vec<Option<Vec<f32>>> = vec![None; n];
    let c = ModelConfig::from_hparams(&file.hparams().unwrap()).unwrap();
    for l in 0..c.n_layer {
        for p in Proj::ALL {
            let width = match p {
                Proj::O => c.n_head * c.head_dim,
                Proj::Down => c.n_ff,
                _ => c.n_embd,
            };
            all[matrix_index(l, p)] = Some(vec![0.0; width]);
        }
    }
    gpu.backend().set_thresholds(all).unwrap();
    let (sparse, stoks) = common::greedy_run(
        &gpu,
        Greedy {
            force: Some(&toks),
            ..g
        },
    );
    let worst = worst_step_cosine(&sparse, &dense, 384);
    eprintln!("keep_all: worst step cosine {worst:.7}");
    assert!(worst >= 0.99999, "keep_all: worst step cosine {worst}");
    assert_eq!(stoks, toks);
}
