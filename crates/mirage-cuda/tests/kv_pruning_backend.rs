//! KV-page pruning inside `CudaBackend`: a cache from
//! `new_kv_cache_pruned(spec, Some(..))` keeps page boxes on the device and
//! its decode rows attend the chosen pages inside the recorded decode graph.
//!
//! - every page selected equals the backend without pruning (graphs on);
//! - a real budget equals the CPU backend's pruned attention (same rule) at
//!   every decode step over a context of several hundred positions, and the
//!   graph replay equals op-by-op launches;
//! - mixed batches (a prefill chunk beside a decode row, small enough for a
//!   graph and too large for one) and a truncation equal the CPU.
//!
//! The CUDA models multiply prefill batches with the decode mat-vecs
//! (`CudaOptions::prefill_gemm` off): the int8 prefill products round their
//! activations to 8 bits, so the prompt's keys and values would differ from
//! the CPU's by more than the page choice tolerates (a page near the top-k
//! cut flips, and with it the step: cosine 0.94 against the CPU). The int8
//! prefill is held to the CPU by the prefill tests.
//!
//! Without a GPU each test prints why it skips; with
//! MIRAGE_REQUIRE_CUDA_TESTS=1 a missing GPU fails them.

use std::sync::Arc;

use mirage_cuda::{CudaBackend, CudaOptions};
use mirage_gguf::GgufFile;
use mirage_runtime::backend::{Backend, TokenSlot};
use mirage_runtime::kv_cache::KvDtype;
use mirage_runtime::{CpuBackend, KvPruning, Model};

mod common;
use common::{argmax, cosine, cuda, prompt, rel_err, worst_cosine, Greedy, Tiny};

/// The model of these tests: Q8_0 weights, Q/K/V biases (qwen2).
fn tiny_model() -> Arc<GgufFile> {
    Tiny::Q8_BIASED.build(41)
}

/// [`common::greedy_run`] of `steps` tokens after a `prompt_len`-token
/// prompt per sequence on a cache pruned with `pruning`.
fn greedy_run<B: Backend>(
    model: &Model<B>,
    pruning: Option<KvPruning>,
    kv: KvDtype,
    prompt_len: usize,
    batch: usize,
    steps: usize,
    force: Option<&[u32]>,
) -> (Vec<f32>, Vec<u32>) {
    common::greedy_run(
        model,
        Greedy {
            prompt: prompt_len,
            batch,
            steps,
            kv,
            pruning,
            force,
        },
    )
}

fn gpu_model(file: &Arc<GgufFile>, graphs: bool) -> Model<CudaBackend> {
    let options = CudaOptions {
        graphs,
        prefill_gemm: false,
        ..CudaOptions::default()
    };
    Model::load(
        file.clone(),
        CudaBackend::with_options(0, &options).unwrap(),
    )
    .unwrap()
}

fn cpu_model(file: &Arc<GgufFile>) -> Model<CpuBackend> {
    Model::load(file.clone(), CpuBackend::new_f32_activations(2).unwrap()).unwrap()
}

/// The budget of the real-selection tests: 16-position pages, 1 sink, 2
/// recent, 4 top pages (7 of ~28 pages at 440 positions), a budget that
/// grows by 10 % of the pages, the first layer dense in one variant.
fn budget(dense_layers: usize) -> KvPruning {
    KvPruning {
        page: 16,
        sink_pages: 1,
        recent_pages: 2,
        top_pages: 4,
        top_percent: 10,
        dense_layers,
    }
}

/// Every page selected: the pruned path (boxes, keys, radix select,
/// split-K over pages) computes full attention, so the logits equal the
/// backend without pruning (another split of the same sums) at every decode
/// step, batch 1 and 2, f32, f16 and q8_0 KV, in CUDA graphs that are replayed:
/// rel err < 1e-5 with f32 KV (1.2e-6 measured on an H100) and < 3e-5 with
/// f16 KV (2e-6 to 1.3e-5 measured, depending on the prompt's cache): each
/// run writes its own decode rows' keys and values, and a value that the
/// other summation order moves across an f16 rounding boundary is stored
/// one f16 step (~5e-4 of it) apart. q8_0 KV (< 3e-4, not yet measured):
/// the unpruned split rounds each dequantized key and value to f16, the
/// pages' attention does not.
#[test]
fn every_page_selected_equals_unpruned_backend() {
    let Some(probe) = cuda("every_page_selected_equals_unpruned_backend") else {
        return;
    };
    drop(probe);
    let file = tiny_model();
    let model = gpu_model(&file, true);
    let vocab = model.config().vocab_size;
    for kv in [KvDtype::F32, KvDtype::F16, KvDtype::Q8_0] {
        for batch in [1usize, 2] {
            let (full, toks) = greedy_run(&model, None, kv, 150, batch, 24, None);
            let before = model.backend().graph_stats();
            let (all, _) = greedy_run(
                &model,
                Some(KvPruning::all_pages(16)),
                kv,
                150,
                batch,
                24,
                Some(&toks),
            );
            let after = model.backend().graph_stats();
            let worst = full
                .chunks(vocab)
                .zip(all.chunks(vocab))
                .map(|(a, b)| rel_err(b, a))
                .fold(0.0f64, f64::max);
            eprintln!(
                "{kv:?} batch {batch}: every page selected vs unpruned worst step rel err {worst:.2e}, replays {}",
                after.replays - before.replays
            );
            // q8_0: the unpruned split on tensor cores multiplies each key
            // and value as f16(q * d), the pages' attention as f32 q * d.
            let bound = match kv {
                KvDtype::F32 => 1e-5,
                KvDtype::F16 => 3e-5,
                KvDtype::Q8_0 => 3e-4,
            };
            assert!(worst < bound, "{kv:?} batch {batch}: rel err {worst}");
            assert!(
                after.replays - before.replays >= 20,
                "pruned decode graph not replayed: {before:?} -> {after:?}"
            );
        }
    }
}

/// A real budget: the CUDA backend's pruned decode (graphs on) against the
/// CPU backend's (same rule and cache type, f32 activations), f32 and f16
/// caches, teacher-forced on the CPU's
/// greedy tokens, over a 420-token prompt and 24 decode steps: logits
/// cosine at least 0.9999 at every step. The pruning really changes the
/// logits (against the unpruned GPU run), and graph replay equals op-by-op
/// launches (same greedy tokens, cosine at least 0.99999).
#[test]
fn pruned_cuda_decode_equals_pruned_cpu_decode() {
    let Some(probe) = cuda("pruned_cuda_decode_equals_pruned_cpu_decode") else {
        return;
    };
    drop(probe);
    let file = tiny_model();
    let cpu = cpu_model(&file);
    let gpu = gpu_model(&file, true);
    let eager = gpu_model(&file, false);
    let vocab = cpu.config().vocab_size;
    let (prompt_len, steps) = (420, 24);
    // f16 KV: the pages are attended on tensor cores (attend_pages_mma), f32
    // KV by attend_pages_part.
    for (dense, kv) in [(0usize, KvDtype::F32), (1, KvDtype::F32), (0, KvDtype::F16)] {
        let cfg = budget(dense);
        for batch in [1usize, 2] {
            let (want, toks) = greedy_run(&cpu, Some(cfg), kv, prompt_len, batch, steps, None);
            let before = gpu.backend().graph_stats();
            let (got, gtoks) =
                greedy_run(&gpu, Some(cfg), kv, prompt_len, batch, steps, Some(&toks));
            let after = gpu.backend().graph_stats();
            let (full, _) = greedy_run(&gpu, None, kv, prompt_len, batch, steps, Some(&toks));
            let (op, otoks) =
                greedy_run(&eager, Some(cfg), kv, prompt_len, batch, steps, Some(&toks));
            let worst = |a: &[f32], b: &[f32]| worst_cosine(a, b, vocab);
            let (vs_cpu, vs_full, vs_eager) =
                (worst(&got, &want), worst(&got, &full), worst(&got, &op));
            let agree =
                toks.iter().zip(&gtoks).filter(|(a, b)| a == b).count() as f64 / toks.len() as f64;
            eprintln!(
                "{kv:?} dense {dense} batch {batch}: cuda pruned vs cpu pruned worst step cosine {vs_cpu:.9} \
                 (argmax agreement {agree:.3}); vs cuda unpruned {vs_full:.6}; graph vs eager {vs_eager:.9}; replays {}",
                after.replays - before.replays
            );
            assert!(
                vs_cpu >= 0.9999,
                "dense {dense} batch {batch}: cosine vs CPU {vs_cpu}"
            );
            assert!(
                vs_full < 0.99999,
                "dense {dense} batch {batch}: pruning changed nothing ({vs_full})"
            );
            assert_eq!(
                gtoks, otoks,
                "dense {dense} batch {batch}: greedy tokens differ graph vs eager"
            );
            assert!(
                vs_eager >= 0.99999,
                "dense {dense} batch {batch}: graph vs eager cosine {vs_eager}"
            );
            assert!(
                after.replays - before.replays >= (steps - 2) as u64,
                "pruned decode graph not replayed: {before:?} -> {after:?}"
            );
        }
    }
}

/// Mixed batches and truncation against the CPU: sequence 0 is prefilled
/// with 300 tokens; then one step holds its decode row and a 7-token prompt
/// chunk of sequence 1 (8 rows: recorded as a graph, the kernels skip the
/// chunk's rows), one step its decode row and a 40-token chunk of sequence
/// 2 (eager, one pruned launch per decode row), three steps decode all three
/// together; then sequence 0 is truncated to 250 positions (a page cut in
/// two) and decodes 20 more tokens alone. Logits of every requested row:
/// cosine >= 0.9999 with the CPU backend's pruned attention.
#[test]
fn mixed_batches_and_truncation_equal_cpu() {
    let Some(probe) = cuda("mixed_batches_and_truncation_equal_cpu") else {
        return;
    };
    drop(probe);
    let file = tiny_model();
    let cpu = cpu_model(&file);
    let gpu = gpu_model(&file, true);
    let vocab = cpu.config().vocab_size;
    let cfg = budget(0);
    let n_ctx = 400;
    // (tokens, slots, logits rows) of every step.
    let mut steps: Vec<(Vec<u32>, Vec<TokenSlot>, Vec<usize>)> = Vec::new();
    let p0 = prompt(0, 300, vocab);
    steps.push((
        p0.clone(),
        (0..300).map(|pos| TokenSlot { seq: 0, pos }).collect(),
        vec![299],
    ));
    let tok = |i: usize| ((i * 53 + 11) % vocab) as u32;
    let p1 = prompt(1, 7, vocab);
    let mut t = vec![tok(0)];
    t.extend(&p1);
    let mut s = vec![TokenSlot { seq: 0, pos: 300 }];
    s.extend((0..7).map(|pos| TokenSlot { seq: 1, pos }));
    steps.push((t, s, vec![0, 7]));
    let p2 = prompt(2, 40, vocab);
    let mut t = p2.clone();
    t.push(tok(1));
    let mut s: Vec<TokenSlot> = (0..40).map(|pos| TokenSlot { seq: 2, pos }).collect();
    s.push(TokenSlot { seq: 0, pos: 301 });
    steps.push((t, s, vec![39, 40]));
    for i in 0..3 {
        steps.push((
            vec![tok(2 + 3 * i), tok(3 + 3 * i), tok(4 + 3 * i)],
            vec![
                TokenSlot {
                    seq: 0,
                    pos: 302 + i,
                },
                TokenSlot { seq: 1, pos: 7 + i },
                TokenSlot {
                    seq: 2,
                    pos: 40 + i,
                },
            ],
            vec![0, 1, 2],
        ));
    }
    let truncate_at = steps.len();
    for i in 0..20 {
        steps.push((
            vec![tok(20 + i)],
            vec![TokenSlot {
                seq: 0,
                pos: 250 + i,
            }],
            vec![0],
        ));
    }
    fn run<B: Backend>(
        model: &Model<B>,
        cfg: KvPruning,
        n_ctx: usize,
        steps: &[(Vec<u32>, Vec<TokenSlot>, Vec<usize>)],
        truncate_at: usize,
    ) -> Vec<Vec<f32>> {
        let mut cache = model
            .new_kv_cache_pruned(n_ctx, 3, KvDtype::F32, Some(cfg))
            .unwrap();
        let mut scratch = model.new_scratch();
        let mut out = Vec::new();
        for (i, (t, s, r)) in steps.iter().enumerate() {
            if i == truncate_at {
                model.backend().kv_truncate(&mut cache, 0, 250);
            }
            let mut logits = Vec::new();
            model
                .forward(t, s, r, &mut cache, &mut scratch, &mut logits)
                .unwrap();
            out.push(logits);
        }
        out
    }
    let want = run(&cpu, cfg, n_ctx, &steps, truncate_at);
    let got = run(&gpu, cfg, n_ctx, &steps, truncate_at);
    let mut worst = (1.0f64, 0usize);
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        for (x, y) in a.chunks(vocab).zip(b.chunks(vocab)) {
            let c = cosine(x, y);
            if c < worst.0 {
                worst = (c, i);
            }
        }
    }
    eprintln!(
        "mixed batches + truncation: cuda vs cpu worst cosine {:.9} (step {})",
        worst.0, worst.1
    );
    assert!(worst.0 >= 0.9999, "step {}: cosine {}", worst.1, worst.0);
}

/// The fixture on the CPU alone (runs everywhere): the model loads, its
/// budget really prunes at 420 positions (logits differ from full
/// attention), and every page selected equals full attention.
#[test]
fn fixture_prunes_on_cpu() {
    let file = tiny_model();
    let cpu = cpu_model(&file);
    let vocab = cpu.config().vocab_size;
    let (full, toks) = greedy_run(&cpu, None, KvDtype::F32, 420, 1, 4, None);
    let (pruned, _) = greedy_run(&cpu, Some(budget(0)), KvDtype::F32, 420, 1, 4, Some(&toks));
    let (all, _) = greedy_run(
        &cpu,
        Some(KvPruning::all_pages(16)),
        KvDtype::F32,
        420,
        1,
        4,
        Some(&toks),
    );
    let worst = |a: &[f32], b: &[f32]| worst_cosine(a, b, vocab);
    let (p, a) = (worst(&full, &pruned), worst(&full, &all));
    eprintln!("cpu: pruned vs full worst cosine {p:.6}, every page vs full {a:.9}");
    assert!(p < 0.99999, "the budget prunes nothing ({p})");
    assert!(
        a > 0.999999,
        "every page selected differs from full attention ({a})"
    );
}

/// `Backend::kv_set_pruning` on one pruned cache (as `mirage-cli eval-long`
/// uses it): after one 420-token prefill, the same teacher-forced decode
/// runs with the selection off, on, and off again, truncating back to the
/// prompt in between. Off equals a cache made without pruning, on equals a
/// cache made with it (the boxes were refreshed while it was off), step by
/// step, cosine >= 0.99999, graphs on and replayed (the two launch lists
/// are two graphs). f32 KV with every layer pruned, f16 with the first
/// layer dense. `None` is accepted on a cache without boxes; `Some` is
/// refused there and with another page size.
#[test]
fn pruning_toggled_on_one_cache_equals_dedicated_caches() {
    let Some(probe) = cuda("pruning_toggled_on_one_cache_equals_dedicated_caches") else {
        return;
    };
    drop(probe);
    let file = tiny_model();
    let gpu = gpu_model(&file, true);
    let b = gpu.backend();
    let vocab = gpu.config().vocab_size;
    let (prompt_len, steps) = (420usize, 16usize);
    for (kv, cfg) in [(KvDtype::F32, budget(0)), (KvDtype::F16, budget(1))] {
        let (full, toks) = greedy_run(&gpu, None, kv, prompt_len, 1, steps, None);
        let (pruned, _) = greedy_run(&gpu, Some(cfg), kv, prompt_len, 1, steps, Some(&toks));
        let mut cache = gpu
            .new_kv_cache_pruned(prompt_len + steps + 1, 1, kv, Some(cfg))
            .unwrap();
        let mut scratch = gpu.new_scratch();
        let mut logits = Vec::new();
        let p = prompt(0, prompt_len, vocab);
        let slots: Vec<TokenSlot> = (0..prompt_len)
            .map(|pos| TokenSlot { seq: 0, pos })
            .collect();
        gpu.forward(
            &p,
            &slots,
            &[prompt_len - 1],
            &mut cache,
            &mut scratch,
            &mut logits,
        )
        .unwrap();
        // The inputs of greedy_run's teacher-forced decode.
        let mut inputs = vec![argmax(&logits)];
        inputs.extend_from_slice(&toks[..steps - 1]);
        let mut phase = |on: bool| -> Vec<f32> {
            b.kv_truncate(&mut cache, 0, prompt_len);
            b.kv_set_pruning(&mut cache, on.then_some(cfg)).unwrap();
            assert_eq!(cache.kv_pruning(), on.then_some(&cfg));
            let before = b.graph_stats();
            let mut all = Vec::new();
            for (i, &t) in inputs.iter().enumerate() {
                gpu.forward(
                    &[t],
                    &[TokenSlot {
                        seq: 0,
                        pos: prompt_len + i,
                    }],
                    &[0],
                    &mut cache,
                    &mut scratch,
                    &mut logits,
                )
                .unwrap();
                all.extend_from_slice(&logits);
            }
            let after = b.graph_stats();
            eprintln!(
                "{kv:?} pruning {on}: captures {}, replays {}",
                after.captures - before.captures,
                after.replays - before.replays
            );
            assert!(
                after.replays - before.replays >= (steps - 2) as u64,
                "{kv:?} pruning {on}: decode graph not replayed: {before:?} -> {after:?}"
            );
            all
        };
        let (off1, on, off2) = (phase(false), phase(true), phase(false));
        let worst = |a: &[f32], b: &[f32]| worst_cosine(a, b, vocab);
        let (c_off1, c_on, c_off2, c_prunes) = (
            worst(&off1, &full),
            worst(&on, &pruned),
            worst(&off2, &full),
            worst(&pruned, &full),
        );
        eprintln!(
            "{kv:?}: toggled off vs unpruned {c_off1:.9}, on vs pruned {c_on:.9}, off again vs unpruned {c_off2:.9}; pruned vs unpruned {c_prunes:.6}"
        );
        assert!(
            c_prunes < 0.99999,
            "{kv:?}: pruning changed nothing ({c_prunes})"
        );
        assert!(c_off1 >= 0.99999, "{kv:?}: off vs unpruned {c_off1}");
        assert!(c_on >= 0.99999, "{kv:?}: on vs pruned {c_on}");
        assert!(c_off2 >= 0.99999, "{kv:?}: off again vs unpruned {c_off2}");
        // Same page size, another budget: accepted; another page size: refused.
        b.kv_set_pruning(
            &mut cache,
            Some(KvPruning {
                top_pages: 6,
                ..cfg
            }),
        )
        .unwrap();
        let err = b
            .kv_set_pruning(&mut cache, Some(KvPruning { page: 32, ..cfg }))
            .unwrap_err();
        assert!(err.to_string().contains("page size"), "{err}");
    }
    let mut plain = gpu.new_kv_cache(64, 1, KvDtype::F32).unwrap();
    b.kv_set_pruning(&mut plain, None).unwrap();
    let err = b.kv_set_pruning(&mut plain, Some(budget(0))).unwrap_err();
    assert!(err.to_string().contains("no page boxes"), "{err}");
}
