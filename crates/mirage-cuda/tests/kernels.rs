//! Each CUDA kernel against an independent f64 reference or the CPU backend
//! on random data, and the whole model against the CPU backend on real
//! weights. Without a GPU (or without the `cuda` feature) every test prints
//! why it skips and passes; on a GPU machine a missing run-time compiler or a
//! kernel that does not compile fails.

use std::sync::Arc;

use mirage_cuda::{CudaBackend, CudaOptions};
use mirage_gguf::{GgmlType, GgufFile};
use mirage_runtime::backend::cpu::CpuActivations;
use mirage_runtime::backend::{AttentionParams, Backend, HostMatrix, QkNorm, TokenSlot};
use mirage_runtime::kv_cache::{KvDtype, KvSpec};
use mirage_runtime::ops::RopeMode;
use mirage_runtime::{CpuBackend, Model};

mod common;
use common::{
    cosine, cuda, cuda_with, dequantized, device_matmul, matvec_bound, matvec_reference, randn,
    rel_err, require_cuda_tests, rng, worst_cosine, Tiny,
};

/// A matrix of the kernel tests.
fn host_matrix(ty: GgmlType, rows: usize, cols: usize, values: &[f32]) -> HostMatrix {
    common::host_matrix(&format!("test.{ty}"), ty, rows, cols, values)
}

/// The model of the whole-model tests: mixed weight types, no biases.
fn tiny_model() -> Arc<GgufFile> {
    Tiny {
        arch: "llama",
        embd: GgmlType::F16,
        types: [
            GgmlType::Q8_0,
            GgmlType::Q8_0,
            GgmlType::Q4_1,
            GgmlType::Q5_K,
            GgmlType::Q4_K,
            GgmlType::Q2_K,
        ],
        bias: false,
    }
    .build(21)
}

/// Every weight type of the file format (all of ggml's but the activation
/// types Q8_1 and Q8_K).
fn types() -> impl Iterator<Item = GgmlType> {
    GgmlType::ALL
        .into_iter()
        .filter(|t| !matches!(t, GgmlType::Q8_1 | GgmlType::Q8_K))
}

#[test]
fn matvec_and_embed_every_type_match_f64_reference() {
    let Some(gpu) = cuda("matvec_and_embed_every_type_match_f64_reference") else {
        return;
    };
    let mut r = rng(1);
    // 1280 columns: five K-quant super-blocks, forty legacy blocks; 77 rows
    // leaves a partly filled last thread block.
    let (rows, cols, n_act) = (77usize, 1280usize, 3usize);
    for ty in types() {
        let values = randn(&mut r, rows * cols);
        let hm = host_matrix(ty, rows, cols, &values);
        let w = dequantized(&hm);
        let x = randn(&mut r, n_act * cols);
        let want = matvec_reference(&w, &x, rows, cols, n_act);
        let dm = gpu.upload_matrix(&hm).unwrap();
        let dx = gpu.upload_activations(n_act, cols, &x).unwrap();
        let mut dy = gpu.new_activations();
        gpu.matmul(&dm, &dx, &mut dy).unwrap();
        let mut got = Vec::new();
        assert_eq!(gpu.read(&dy, &mut got).unwrap(), (n_act, rows));
        let e = rel_err(&got, &want);
        assert!(e < matvec_bound(ty), "{ty}: matvec relative error {e}");

        let tokens = [5u32, 0, 76, 5];
        let mut de = gpu.new_activations();
        gpu.embed(&dm, &tokens, &mut de).unwrap();
        gpu.read(&de, &mut got).unwrap();
        let want: Vec<f32> = tokens
            .iter()
            .flat_map(|&t| w[t as usize * cols..(t as usize + 1) * cols].to_vec())
            .collect();
        // Not bit-exact: the device may fuse `d * q + m` into one FMA.
        let ee = rel_err(&got, &want);
        assert!(
            ee < 1e-6,
            "{ty}: embedding rows differ from the CPU dequantizer: {ee}"
        );
        eprintln!("{ty}: matvec rel err {e:.2e}, embedding rel err {ee:.2e}");
    }
    assert!(gpu
        .embed(
            &gpu.upload_matrix(&host_matrix(GgmlType::Q8_0, 4, 32, &[0.5; 128]))
                .unwrap(),
            &[4],
            &mut gpu.new_activations()
        )
        .is_err());
}

/// Q4_K rows of 32 super-blocks and more take the column split across
/// blocks (`mvx_q4_ks_x*`, the partials summed by each tile's last block):
/// the f64 reference at 1 and 3 activation rows, 300 rows (a partly filled
/// last tile), rows of 33 and 74 super-blocks (some splits hold empty
/// slices), and the same bits when run again (the tile counters reset).
#[test]
fn long_q4_k_rows_split_across_blocks_match_f64_reference() {
    let Some(gpu) = cuda("long_q4_k_rows_split_across_blocks_match_f64_reference") else {
        return;
    };
    let mut r = rng(4);
    let rows = 300usize;
    for cols in [33 * 256usize, 74 * 256] {
        let values = randn(&mut r, rows * cols);
        let hm = host_matrix(GgmlType::Q4_K, rows, cols, &values);
        let w = dequantized(&hm);
        let dm = gpu.upload_matrix(&hm).unwrap();
        for n_act in [1usize, 3] {
            let x = randn(&mut r, n_act * cols);
            let want = matvec_reference(&w, &x, rows, cols, n_act);
            let dx = gpu.upload_activations(n_act, cols, &x).unwrap();
            let mut runs = Vec::new();
            for _ in 0..2 {
                let mut dy = gpu.new_activations();
                gpu.matmul(&dm, &dx, &mut dy).unwrap();
                let mut got = Vec::new();
                assert_eq!(gpu.read(&dy, &mut got).unwrap(), (n_act, rows));
                runs.push(got);
            }
            let e = rel_err(&runs[0], &want);
            eprintln!("Q4_K {rows} x {cols}, {n_act} rows: matvec rel err {e:.2e}");
            assert!(
                e < matvec_bound(GgmlType::Q4_K),
                "{cols} columns, {n_act} rows: rel err {e}"
            );
            assert_eq!(
                runs[0], runs[1],
                "{cols} columns, {n_act} rows: a second run differs"
            );
        }
    }
}

#[test]
fn norm_bias_residual_select_and_argmax_match_cpu() {
    let Some(gpu) = cuda("norm_bias_residual_select_and_argmax_match_cpu") else {
        return;
    };
    let cpu = CpuBackend::new(1).unwrap();
    let mut r = rng(2);
    let (rows, width) = (5usize, 576usize);
    let x = randn(&mut r, rows * width);
    let y = randn(&mut r, rows * width);
    let w = randn(&mut r, width);
    let bias = randn(&mut r, width);
    let (cw, gw) = (
        cpu.upload_vector(&w).unwrap(),
        gpu.upload_vector(&w).unwrap(),
    );
    let (cb, gb) = (
        cpu.upload_vector(&bias).unwrap(),
        gpu.upload_vector(&bias).unwrap(),
    );
    let mut cx = CpuActivations::from_vec(rows, width, x.clone()).unwrap();
    let cy = CpuActivations::from_vec(rows, width, y.clone()).unwrap();
    let mut gx = gpu.upload_activations(rows, width, &x).unwrap();
    let gy = gpu.upload_activations(rows, width, &y).unwrap();
    let (mut cn, mut gn) = (cpu.new_activations(), gpu.new_activations());
    cpu.rms_norm(&cx, &cw, 1e-5, &mut cn).unwrap();
    gpu.rms_norm(&gx, &gw, 1e-5, &mut gn).unwrap();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    cpu.read(&cn, &mut a).unwrap();
    gpu.read(&gn, &mut b).unwrap();
    assert!(rel_err(&b, &a) < 1e-6, "rms_norm {}", rel_err(&b, &a));
    cpu.add_bias(&mut cx, &cb).unwrap();
    gpu.add_bias(&mut gx, &gb).unwrap();
    cpu.add(&mut cx, &cy).unwrap();
    gpu.add(&mut gx, &gy).unwrap();
    cpu.read(&cx, &mut a).unwrap();
    gpu.read(&gx, &mut b).unwrap();
    assert_eq!(a, b, "bias + residual");
    let (mut cs, mut gs) = (cpu.new_activations(), gpu.new_activations());
    cpu.select_rows(&cx, &[4, 1], &mut cs).unwrap();
    gpu.select_rows(&gx, &[4, 1], &mut gs).unwrap();
    cpu.read(&cs, &mut a).unwrap();
    gpu.read(&gs, &mut b).unwrap();
    assert_eq!(a, b, "select_rows");
    let idx = gpu.argmax(&gx).unwrap();
    cpu.read(&cx, &mut a).unwrap();
    for (row, &i) in idx.iter().enumerate() {
        let rowv = &a[row * width..(row + 1) * width];
        let best = rowv
            .iter()
            .enumerate()
            .fold(0, |bi, (j, v)| if *v > rowv[bi] { j } else { bi });
        assert_eq!(i as usize, best, "argmax row {row}");
    }
}

#[test]
fn attention_prefill_then_decode_matches_cpu() {
    let Some(gpu) = cuda("attention_prefill_then_decode_matches_cpu") else {
        return;
    };
    let cpu = CpuBackend::new(1).unwrap();
    let mut r = rng(3);
    // Both decode paths: RoPE and the KV store inside the attention launch
    // (decode rows without the per-head norm; q is rotated on chip and its
    // buffer left as it was, which the Backend contract allows) and the
    // separate rope_store launch (with the norm, and prefill rows; it
    // rotates q in place, checked below).
    for (mode, with_norm, n_head, n_head_kv, hd) in [
        (RopeMode::Normal, false, 9, 3, 64),
        (RopeMode::Neox, true, 14, 2, 64),
        (RopeMode::Neox, false, 4, 4, 128),
    ] {
        let p = AttentionParams {
            n_head,
            n_head_kv,
            head_dim: hd,
            rope_mode: mode,
            rope_freq_base: 10000.0,
            rope_scaling: Default::default(),
            norm_eps: 1e-6,
        };
        let spec = KvSpec {
            n_layer: 2,
            n_head_kv,
            head_dim: hd,
            n_ctx: 40,
            n_seq: 2,
            dtype: KvDtype::F32,
        };
        let (mut cc, mut gc) = (
            cpu.new_kv_cache(spec).unwrap(),
            gpu.new_kv_cache(spec).unwrap(),
        );
        let nq: Vec<f32> = randn(&mut r, hd);
        let nk: Vec<f32> = randn(&mut r, hd);
        let (cqn, ckn) = (
            cpu.upload_vector(&nq).unwrap(),
            cpu.upload_vector(&nk).unwrap(),
        );
        let (gqn, gkn) = (
            gpu.upload_vector(&nq).unwrap(),
            gpu.upload_vector(&nk).unwrap(),
        );
        // A prefill of 7 rows of sequence 1, then three decode steps of one
        // row: each step reads the keys and values the one before stored.
        let steps: Vec<Vec<TokenSlot>> = vec![
            (0..7).map(|pos| TokenSlot { seq: 1, pos }).collect(),
            vec![TokenSlot { seq: 1, pos: 7 }],
            vec![TokenSlot { seq: 1, pos: 8 }],
            vec![TokenSlot { seq: 1, pos: 9 }],
        ];
        for slots in &steps {
            let n = slots.len();
            let cn = with_norm.then_some(QkNorm { q: &cqn, k: &ckn });
            let gn = with_norm.then_some(QkNorm { q: &gqn, k: &gkn });
            let [a, b, cq, gq] = attend_both(
                (&cpu, &mut cc, cn),
                (&gpu, &mut gc, gn),
                &mut r,
                1,
                &p,
                slots,
            );
            let e = rel_err(&b, &a);
            assert!(
                e < 1e-5,
                "{mode:?} norm={with_norm} heads {n_head}/{n_head_kv} rows {n}: attention rel err {e}"
            );
            if with_norm {
                assert!(rel_err(&gq, &cq) < 1e-5, "rotated q differs");
            }
        }
    }
}

/// One backend's side of [`attend_both`]: the backend, its cache, its
/// per-head q/k norm.
type Side<'a, B> = (
    &'a B,
    &'a mut <B as Backend>::KvCache,
    Option<QkNorm<'a, <B as Backend>::Vector>>,
);

/// One attention call of `layer` on the CPU and the GPU with the same random
/// q, k and v for `slots`: the CPU's and the GPU's output, then their q
/// after the call (rotated in place where RoPE runs on its own).
fn attend_both(
    (cpu, cc, cn): Side<'_, CpuBackend>,
    (gpu, gc, gn): Side<'_, CudaBackend>,
    r: &mut rand::rngs::StdRng,
    layer: usize,
    p: &AttentionParams,
    slots: &[TokenSlot],
) -> [Vec<f32>; 4] {
    let (n, hq, hkv) = (slots.len(), p.n_head * p.head_dim, p.n_head_kv * p.head_dim);
    let (q, k, v) = (randn(r, n * hq), randn(r, n * hkv), randn(r, n * hkv));
    let mut cq = CpuActivations::from_vec(n, hq, q.clone()).unwrap();
    let mut ck = CpuActivations::from_vec(n, hkv, k.clone()).unwrap();
    let cv = CpuActivations::from_vec(n, hkv, v.clone()).unwrap();
    let mut gq = gpu.upload_activations(n, hq, &q).unwrap();
    let mut gk = gpu.upload_activations(n, hkv, &k).unwrap();
    let gv = gpu.upload_activations(n, hkv, &v).unwrap();
    let (mut co, mut go) = (cpu.new_activations(), gpu.new_activations());
    cpu.attention(layer, p, &mut cq, &mut ck, &cv, cn, slots, cc, &mut co)
        .unwrap();
    gpu.attention(layer, p, &mut gq, &mut gk, &gv, gn, slots, gc, &mut go)
        .unwrap();
    let mut out: [Vec<f32>; 4] = Default::default();
    cpu.read(&co, &mut out[0]).unwrap();
    gpu.read(&go, &mut out[1]).unwrap();
    cpu.read(&cq, &mut out[2]).unwrap();
    gpu.read(&gq, &mut out[3]).unwrap();
    out
}

#[test]
fn ffn_matches_cpu_f32_activations() {
    let Some(gpu) = cuda("ffn_matches_cpu_f32_activations") else {
        return;
    };
    let cpu = CpuBackend::new_f32_activations(1).unwrap();
    let mut r = rng(4);
    let (d, ff, n) = (512usize, 1536usize, 2usize);
    for (tg, td) in [
        (GgmlType::Q4_K, GgmlType::Q6_K),
        (GgmlType::Q4_1, GgmlType::Q8_0),
        (GgmlType::Q2_K, GgmlType::Q5_0),
    ] {
        let gate = host_matrix(tg, ff, d, &randn(&mut r, ff * d));
        let up = host_matrix(tg, ff, d, &randn(&mut r, ff * d));
        let down = host_matrix(td, d, ff, &randn(&mut r, d * ff));
        let x = randn(&mut r, n * d);
        let cf = cpu.upload_ffn(0, &gate, &up, &down).unwrap();
        let gf = gpu.upload_ffn(0, &gate, &up, &down).unwrap();
        let (mut co, mut go) = (cpu.new_activations(), gpu.new_activations());
        cpu.ffn(
            &cf,
            &CpuActivations::from_vec(n, d, x.clone()).unwrap(),
            &mut co,
        )
        .unwrap();
        gpu.ffn(&gf, &gpu.upload_activations(n, d, &x).unwrap(), &mut go)
            .unwrap();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        cpu.read(&co, &mut a).unwrap();
        gpu.read(&go, &mut b).unwrap();
        let e = rel_err(&b, &a);
        assert!(e < 1e-4, "{tg}/{td}: ffn rel err {e}");
    }
}

/// Final logits of the real SmolLM2 on the GPU against the CPU reference in
/// its f32-activation mode (the same arithmetic: dequantized weights times
/// f32 activations) and in its default q8-activation mode.
#[test]
fn smollm2_logits_match_cpu() {
    let Some(gpu) = cuda("smollm2_logits_match_cpu") else {
        return;
    };
    let Some(path) = common::model_file(
        "smollm2_logits_match_cpu",
        "smollm2-135m-instruct-q4_1.gguf",
    ) else {
        return;
    };
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let tokens = common::SMOLLM2_PROMPT;
    let g = common::logits(file.clone(), gpu, &tokens);
    let vocab = g.len() / tokens.len();
    for (label, cpu) in [
        ("f32-act", CpuBackend::new_f32_activations(0).unwrap()),
        ("q8-act", CpuBackend::new(0).unwrap()),
    ] {
        let c = common::logits(file.clone(), cpu, &tokens);
        let worst = worst_cosine(&g, &c, vocab);
        let last = cosine(&g[g.len() - vocab..], &c[c.len() - vocab..]);
        eprintln!(
            "smollm2 cuda vs cpu {label}: final-logit cosine {last:.7}, worst position {worst:.7}"
        );
        if label == "f32-act" {
            assert!(worst >= 0.9999, "cosine {worst} < 0.9999");
        } else {
            assert!(last >= 0.999, "cosine vs q8 CPU {last} < 0.999");
        }
    }
}

/// Split-K attention over a long context (several splits per head), with
/// the KV cache in f32, f16 and q8_0, against the CPU backend with the same
/// cache type: a prefill of 300 rows, then decode steps past 600.
/// Long prefill chunks and decode rows against the CPU, f32 and f16 caches,
/// with the prefill kernel on tensor cores (`attend_prefill_*`: batches of
/// one sequence's consecutive positions) and without it (row by row, the
/// split-K decode kernel), for head sizes 128 and 64 (GQA 4:1 and 7:1) and
/// chunks that are not multiples of the kernel's 64-row tile.
#[test]
fn attention_long_context_splits_match_cpu_every_cache_type() {
    let Some(gpu) = cuda("attention_long_context_splits_match_cpu_every_cache_type") else {
        return;
    };
    let cpu = CpuBackend::new(0).unwrap();
    let mut r = rng(11);
    for (n_head, n_head_kv, hd) in [(8, 2, 128), (14, 2, 64)] {
        let p = AttentionParams {
            n_head,
            n_head_kv,
            head_dim: hd,
            rope_mode: RopeMode::Neox,
            rope_freq_base: 10000.0,
            rope_scaling: Default::default(),
            norm_eps: 1e-6,
        };
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8_0] {
            {
                let spec = KvSpec {
                    n_layer: 1,
                    n_head_kv,
                    head_dim: hd,
                    n_ctx: 700,
                    n_seq: 1,
                    dtype,
                };
                let (mut cc, mut gc) = (
                    cpu.new_kv_cache(spec).unwrap(),
                    gpu.new_kv_cache(spec).unwrap(),
                );
                let mut steps: Vec<Vec<TokenSlot>> =
                    vec![(0..300).map(|pos| TokenSlot { seq: 0, pos }).collect()];
                // Fill 300..637 in chunks (the last of 37 rows), then decode single rows.
                for (a, b) in [(300, 400), (400, 500), (500, 600), (600, 637)] {
                    steps.push((a..b).map(|pos| TokenSlot { seq: 0, pos }).collect());
                }
                for pos in [637, 638, 699] {
                    steps.push(vec![TokenSlot { seq: 0, pos }]);
                }
                for slots in &steps {
                    let n = slots.len();
                    let [a, b, _, _] = attend_both(
                        (&cpu, &mut cc, None),
                        (&gpu, &mut gc, None),
                        &mut r,
                        0,
                        &p,
                        slots,
                    );
                    let e = rel_err(&b, &a);
                    eprintln!(
                        "long attention hd {hd} {dtype:?} rows {n} from pos {}: rel err {e:.2e}",
                        slots[0].pos
                    );
                    // Chunks of 16 rows and more run on f16 tensor cores
                    // (f16 queries and probabilities: a few 1e-4). A q8_0
                    // cache's decode split on tensor cores multiplies each
                    // key and value as f16(q * d), one rounding (at most
                    // 2^-11 of it) the CPU's f32 q * d does not make.
                    let bound = if n >= 16 {
                        2e-3
                    } else if dtype == KvDtype::Q8_0 {
                        3e-4
                    } else {
                        1e-4
                    };
                    assert!(
                        e < bound,
                        "hd {hd} {dtype:?} rows {n} at {}: attention rel err {e}",
                        slots[0].pos
                    );
                }
            }
        }
    }
}

/// The tiny model on the GPU (split-K attention, graphs) against the CPU
/// f32-activation reference; the prompt batch through cuBLAS against the
/// mat-vec path; f16 and q8_0 KV caches against f32 and against the CPU's
/// cache of the same type.
#[test]
fn tiny_model_prefill_gemm_and_f16_cache_match() {
    let test = "tiny_model_prefill_gemm_and_f16_cache_match";
    let no_gemm = CudaOptions {
        prefill_gemm: false,
        ..CudaOptions::default()
    };
    let (Some(gemm), Some(plain)) = (cuda(test), cuda_with(test, &no_gemm)) else {
        return;
    };
    let file = tiny_model();
    let (model, plain) = (
        Model::load(file.clone(), gemm).unwrap(),
        Model::load(file.clone(), plain).unwrap(),
    );
    let vocab = model.config().vocab_size;
    let tokens: Vec<u32> = (0..40).map(|i| ((i * 53 + 7) % vocab) as u32).collect();
    let worst = |a: &[f32], b: &[f32]| worst_cosine(a, b, vocab);
    let cpu = Model::load(file.clone(), CpuBackend::new_f32_activations(0).unwrap()).unwrap();
    let reference = cpu.logits_all(&tokens, KvDtype::F32).unwrap();
    let matvec = plain.logits_all(&tokens, KvDtype::F32).unwrap();
    let c = worst(&matvec, &reference);
    eprintln!("tiny model cuda mat-vec vs cpu f32-act: worst position cosine {c:.7}");
    assert!(c >= 0.9999, "cuda vs cpu cosine {c}");
    if model.backend().prefill_gemm() {
        let gemm = model.logits_all(&tokens, KvDtype::F32).unwrap();
        let c = worst(&gemm, &matvec);
        eprintln!("tiny model prefill on tensor cores vs mat-vec: worst position cosine {c:.7}");
        // Int8 activations in the Q8_0 and Q5_0 products (see prefill_mmq.rs).
        assert!(c >= 0.999, "gemm vs matvec cosine {c}");
    } else if require_cuda_tests() {
        panic!("cuBLAS did not load, so the prefill GEMM path was not tested");
    } else {
        eprintln!("prefill GEMM part skipped: cuBLAS did not load");
    }
    let f16 = model.logits_all(&tokens, KvDtype::F16).unwrap();
    let f32 = model.logits_all(&tokens, KvDtype::F32).unwrap();
    let c = worst(&f16, &f32);
    eprintln!("tiny model f16 KV vs f32 KV: worst position cosine {c:.7}");
    assert!(c >= 0.999, "f16 cache cosine {c}");
    let cpu16 = cpu.logits_all(&tokens, KvDtype::F16).unwrap();
    let c = worst(&f16, &cpu16);
    eprintln!("tiny model f16 KV cuda vs cpu f16 KV: worst position cosine {c:.7}");
    // The CUDA prefill's int8 activations (as above), not the f16 cache.
    assert!(c >= 0.999, "f16 cache cuda vs cpu cosine {c}");
    let q8 = model.logits_all(&tokens, KvDtype::Q8_0).unwrap();
    let c = worst(&q8, &f32);
    eprintln!("tiny model q8_0 KV vs f32 KV: worst position cosine {c:.7}");
    assert!(c >= 0.999, "q8_0 cache cosine {c}");
    let cpu8 = cpu.logits_all(&tokens, KvDtype::Q8_0).unwrap();
    let c = worst(&q8, &cpu8);
    eprintln!("tiny model q8_0 KV cuda vs cpu q8_0 KV: worst position cosine {c:.7}");
    assert!(c >= 0.999, "q8_0 cache cuda vs cpu cosine {c}");
}

/// The in-memory fixture of the GPU model tests is a valid model (runs
/// everywhere, so a broken fixture shows up without a GPU).
#[test]
fn tiny_model_fixture_runs_on_cpu() {
    let model = Model::load(tiny_model(), CpuBackend::new(1).unwrap()).unwrap();
    let logits = model.logits_all(&[1, 2, 3, 4], KvDtype::F32).unwrap();
    assert_eq!(logits.len(), 4 * model.config().vocab_size);
    assert!(logits.iter().all(|v| v.is_finite()));
    let spread = logits.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(
        spread > 1e-3,
        "logits all ~0: the fixture's weights are degenerate"
    );
}

/// The prefill GEMM path (the split layouts on int8 tensor cores; the
/// others dequantized to f16 on the device, cuBLAS f16 x f16 -> f32)
/// against the mat-vec path for every weight type, in one weight tile and
/// in tiles of 48 rows (300 rows: six tiles, the last one partial).
#[test]
fn prefill_gemm_every_type_matches_matvec() {
    let test = "prefill_gemm_every_type_matches_matvec";
    let (rows, cols, n_act) = (300usize, 512usize, 40usize);
    let with = |prefill_gemm: bool, gemm_tile_bytes: usize| CudaOptions {
        prefill_gemm,
        gemm_tile_bytes,
        ..CudaOptions::default()
    };
    let (Some(plain), Some(one_tile), Some(tiles)) = (
        cuda_with(test, &with(false, 32 << 20)),
        cuda_with(test, &with(true, 32 << 20)),
        cuda_with(test, &with(true, 48 * 2 * cols)),
    ) else {
        return;
    };
    if !one_tile.prefill_gemm() {
        assert!(!require_cuda_tests(), "cuBLAS did not load");
        eprintln!("{test}: skipped, cuBLAS did not load");
        return;
    }
    let mut r = rng(31);
    for ty in types() {
        let hm = host_matrix(ty, rows, cols, &randn(&mut r, rows * cols));
        let x = randn(&mut r, n_act * cols);
        let run =
            |b: &CudaBackend| device_matmul(b, &b.upload_matrix(&hm).unwrap(), &x, n_act, rows);
        let want = run(&plain);
        for (what, b) in [("one tile", &one_tile), ("tiles of 48 rows", &tiles)] {
            // f16 activations (and f16 copies of F32/BF16 weights): ~1e-3;
            // the split layouts' int8 products on 8-bit activations: ~5e-3
            // (their exact check is prefill_mmq.rs's).
            let int8 = matches!(
                ty,
                GgmlType::Q8_0 | GgmlType::Q4_K | GgmlType::Q5_0 | GgmlType::Q6_K
            );
            let e = rel_err(&run(b), &want);
            eprintln!("{ty}: prefill GEMM ({what}) vs mat-vec rel err {e:.2e}");
            let bound = if int8 { 2e-2 } else { 5e-3 };
            assert!(e < bound, "{ty} {what}: GEMM rel err {e}");
        }
    }
}
