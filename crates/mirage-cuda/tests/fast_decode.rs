//! The decode mat-vecs in their launch forms (Q/K/V in one launch, the
//! fused gate/up/SwiGLU, the column splits, the persistent grid, NVFP4
//! weights) against f64 / CPU references, and the fusions of a recorded
//! decode step (norms, biases and residual adds folded into the mat-vecs)
//! against the same model launched op by op. Without a GPU (or without the
//! `cuda` feature) every test prints why it skips and passes.

use mirage_cuda::{CudaBackend, CudaOptions, WeightFormat};
use mirage_gguf::quant::Nvfp4Tensor;
use mirage_gguf::writer::GgufWriter;
use mirage_gguf::{GgmlType, GgufFile};
use mirage_runtime::backend::{Backend, HostMatrix};
use mirage_runtime::kv_cache::KvDtype;
use mirage_runtime::{CpuBackend, Model};

mod common;
use common::{
    bits_differ, cosine, cuda, cuda_with, dequantized, greedy_run, host_matrix, matvec_bound,
    matvec_reference, randn, random_matrix, rel_err, rng, worst_cosine, Greedy, Tiny,
};

/// Q/K/V sets of `matmul_many_equals_separate_matmuls` (row length a whole
/// number of 256-element K-quant blocks).
const QKV_SETS: [[GgmlType; 3]; 4] = [
    [GgmlType::Q8_0; 3],
    [GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q6_K],
    [GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q5_0],
    [GgmlType::F16; 3],
];
const QKV_COLS: usize = 512;
const QKV_ROWS: [usize; 3] = [320, 64, 40];

/// (gate/up, down) types and (d, n_ff) of `fused_ffn_matches_f64`.
const FFN_PAIRS: [(GgmlType, GgmlType); 5] = [
    (GgmlType::Q8_0, GgmlType::Q8_0),
    (GgmlType::Q4_K, GgmlType::Q6_K),
    (GgmlType::Q5_0, GgmlType::Q8_0),
    (GgmlType::Q4_1, GgmlType::Q4_1),
    (GgmlType::Q6_K, GgmlType::Q6_K),
];
const FFN_DIMS: (usize, usize) = (256, 768);

/// Weight types (q, k, v, o, gate/up, down) of the biased models decoded in
/// graphs and op by op: every repacked layout and a ggml-layout one.
const LAYER_MIXES: [[GgmlType; 6]; 3] = [
    [GgmlType::Q8_0; 6],
    [
        GgmlType::Q4_K,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q5_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ],
    [
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q5_0,
        GgmlType::Q6_K,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
    ],
];

/// Odd shapes: rows not a multiple of a block's rows or of a warp's,
/// row lengths not a multiple of the 128-element chunk.
const SHAPES: &[(usize, usize)] = &[(1, 256), (5, 288), (37, 96), (130, 512), (67, 1056)];

/// Options with the prefill GEMM off (every batch through the mat-vecs).
fn matvec_only(weights: WeightFormat) -> CudaOptions {
    CudaOptions {
        weights,
        prefill_gemm: false,
        ..CudaOptions::default()
    }
}

fn read(gpu: &CudaBackend, a: &<CudaBackend as Backend>::Activations) -> Vec<f32> {
    let mut v = Vec::new();
    gpu.read(a, &mut v).unwrap();
    v
}

/// y = W x for every row of x, on the device.
fn product(
    gpu: &CudaBackend,
    w: &<CudaBackend as Backend>::Matrix,
    x: &<CudaBackend as Backend>::Activations,
) -> Vec<f32> {
    let mut y = gpu.new_activations();
    gpu.matmul(w, x, &mut y).unwrap();
    read(gpu, &y)
}

/// `ws` as one `matmul_many` launch, then `ws[0]` alone: every output.
fn three_and_one(
    gpu: &CudaBackend,
    ws: &[<CudaBackend as Backend>::Matrix],
    x: &<CudaBackend as Backend>::Activations,
) -> Vec<Vec<f32>> {
    let (mut a, mut b, mut c) = (
        gpu.new_activations(),
        gpu.new_activations(),
        gpu.new_activations(),
    );
    gpu.matmul_many(&[&ws[0], &ws[1], &ws[2]], x, &mut [&mut a, &mut b, &mut c])
        .unwrap();
    vec![
        read(gpu, &a),
        read(gpu, &b),
        read(gpu, &c),
        product(gpu, &ws[0], x),
    ]
}

/// The f64 FFN `down (silu(gate x) * (up x))` of `n_act` rows of `x`
/// (`d` wide; gate and up `ff x d`, down `d x ff`).
fn ffn_reference(
    [g, u, dn]: [&[f32]; 3],
    x: &[f32],
    d: usize,
    ff: usize,
    n_act: usize,
) -> Vec<f32> {
    let (hg, hu) = (
        matvec_reference(g, x, ff, d, n_act),
        matvec_reference(u, x, ff, d, n_act),
    );
    let h: Vec<f32> = hg
        .iter()
        .zip(&hu)
        .map(|(&a, &b)| (a as f64 / (1.0 + (-a as f64).exp()) * b as f64) as f32)
        .collect();
    matvec_reference(dn, &h, d, ff, n_act)
}

/// Q, K, V as one launch equal three separate mat-vecs and the f64
/// reference, for sets of one layout and mixed sets (which run per layout).
#[test]
fn matmul_many_equals_separate_matmuls() {
    let Some(gpu) = cuda_with(
        "matmul_many_equals_separate_matmuls",
        &matvec_only(WeightFormat::Native),
    ) else {
        return;
    };
    let mut r = rng(11);
    let cols = QKV_COLS;
    for set in QKV_SETS {
        let hms: Vec<HostMatrix> = set
            .iter()
            .zip(QKV_ROWS)
            .map(|(&ty, n)| random_matrix("blk.0.attn.weight", ty, n, cols, &mut r))
            .collect();
        let ws: Vec<_> = hms.iter().map(|m| gpu.upload_matrix(m).unwrap()).collect();
        for n_act in [1usize, 2] {
            let x = randn(&mut r, n_act * cols);
            let dx = gpu.upload_activations(n_act, cols, &x).unwrap();
            let got = three_and_one(&gpu, &ws, &dx);
            for (i, (m, w)) in hms.iter().zip(&ws).enumerate() {
                let want = matvec_reference(&dequantized(m), &x, m.rows, cols, n_act);
                let e = rel_err(&got[i], &want);
                assert!(
                    e < matvec_bound(m.ty),
                    "{set:?} n_act {n_act}: output {i} vs f64 rel err {e}"
                );
                let e = rel_err(&got[i], &product(&gpu, w, &dx));
                assert!(
                    e < 1e-6,
                    "{set:?} n_act {n_act}: output {i} vs alone rel err {e}"
                );
            }
        }
    }
}

/// gate + up + SwiGLU in one kernel, then down, equal an f64 FFN on the
/// dequantized weights, per type pair (mixed pairs run unfused).
#[test]
fn fused_ffn_matches_f64() {
    let Some(gpu) = cuda_with("fused_ffn_matches_f64", &matvec_only(WeightFormat::Native)) else {
        return;
    };
    let mut r = rng(13);
    let (d, ff) = FFN_DIMS;
    for (tg, td) in FFN_PAIRS {
        let g = random_matrix("blk.0.ffn_gate.weight", tg, ff, d, &mut r);
        let u = random_matrix("blk.0.ffn_up.weight", tg, ff, d, &mut r);
        let dn = host_matrix("blk.0.ffn_down.weight", td, d, ff, &randn(&mut r, ff * d));
        let f = gpu.upload_ffn(0, &g, &u, &dn).unwrap();
        let (wg, wu, wd) = (dequantized(&g), dequantized(&u), dequantized(&dn));
        for n_act in [1usize, 3] {
            let x = randn(&mut r, n_act * d);
            let dx = gpu.upload_activations(n_act, d, &x).unwrap();
            let mut y = gpu.new_activations();
            gpu.ffn(&f, &dx, &mut y).unwrap();
            let want = ffn_reference([&wg, &wu, &wd], &x, d, ff, n_act);
            let e = rel_err(&read(&gpu, &y), &want);
            eprintln!("ffn {tg}/{td} n_act {n_act}: vs f64 rel err {e:.2e}");
            let bound = matvec_bound(tg).max(matvec_bound(td));
            assert!(e < bound, "ffn {tg}/{td} n_act {n_act}: rel err {e}");
        }
    }
}

/// NVFP4 weights: mat-vec (1 and 3 rows), the fused FFN, embedding rows and
/// the GEMM prefill path against the CPU codec's dequantized values; the
/// embedding table keeps its type.
#[test]
fn nvfp4_matvec_ffn_embed_gemm_match_cpu_codec() {
    let test = "nvfp4_matvec_ffn_embed_gemm_match_cpu_codec";
    let Some(gpu) = cuda_with(test, &matvec_only(WeightFormat::Nvfp4)) else {
        return;
    };
    let mut r = rng(17);
    let nvfp4 = |hm: &HostMatrix| {
        Nvfp4Tensor::requantize(hm.ty, hm.data.as_slice(), &[hm.cols as u64, hm.rows as u64])
            .unwrap()
            .dequantize()
            .unwrap()
    };
    for &(rows, cols) in SHAPES {
        for ty in [GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::F32] {
            if cols % ty.block_size() != 0 {
                continue;
            }
            let hm = random_matrix("blk.0.attn_q.weight", ty, rows, cols, &mut r);
            let deq = nvfp4(&hm);
            let w = gpu.upload_matrix(&hm).unwrap();
            assert!(w.is_nvfp4());
            assert_eq!(w.bytes(), rows * cols / 2 + rows * cols / 16);
            for n_act in [1usize, 3] {
                let x = randn(&mut r, n_act * cols);
                let dx = gpu.upload_activations(n_act, cols, &x).unwrap();
                let e = rel_err(
                    &product(&gpu, &w, &dx),
                    &matvec_reference(&deq, &x, rows, cols, n_act),
                );
                assert!(
                    e < 1e-5,
                    "nvfp4 from {ty} {rows}x{cols} n_act {n_act}: rel err {e}"
                );
            }
            let tokens: Vec<u32> = vec![(rows - 1) as u32, 0];
            let mut e = gpu.new_activations();
            gpu.embed(&w, &tokens, &mut e).unwrap();
            let want: Vec<f32> = tokens
                .iter()
                .flat_map(|&t| deq[t as usize * cols..(t as usize + 1) * cols].to_vec())
                .collect();
            assert_eq!(read(&gpu, &e), want, "nvfp4 embedding rows");
        }
    }
    let table = random_matrix("token_embd.weight", GgmlType::Q8_0, 64, 256, &mut r);
    assert!(!gpu.upload_matrix(&table).unwrap().is_nvfp4());
    let (d, ff) = (256usize, 352usize);
    let mats: Vec<HostMatrix> = [("gate", ff, d), ("up", ff, d), ("down", d, ff)]
        .iter()
        .map(|&(nm, rows, cols)| {
            let name = format!("blk.0.ffn_{nm}.weight");
            random_matrix(&name, GgmlType::Q8_0, rows, cols, &mut r)
        })
        .collect();
    let f = gpu.upload_ffn(0, &mats[0], &mats[1], &mats[2]).unwrap();
    let x = randn(&mut r, 2 * d);
    let dx = gpu.upload_activations(2, d, &x).unwrap();
    let mut y = gpu.new_activations();
    gpu.ffn(&f, &dx, &mut y).unwrap();
    let w = [nvfp4(&mats[0]), nvfp4(&mats[1]), nvfp4(&mats[2])];
    let e = rel_err(
        &read(&gpu, &y),
        &ffn_reference([&w[0], &w[1], &w[2]], &x, d, ff, 2),
    );
    assert!(e < 1e-5, "nvfp4 ffn vs f64 rel err {e}");
    // The GEMM prefill on the repacked layouts against the mat-vec.
    for (fmt, ty) in [
        (WeightFormat::Nvfp4, GgmlType::Q8_0),
        (WeightFormat::Native, GgmlType::Q8_0),
        (WeightFormat::Native, GgmlType::Q4_K),
        (WeightFormat::Native, GgmlType::Q5_0),
        (WeightFormat::Native, GgmlType::Q6_K),
    ] {
        let gemm = CudaBackend::with_options(
            0,
            &CudaOptions {
                weights: fmt,
                ..CudaOptions::default()
            },
        )
        .unwrap();
        let Some(plain) = cuda_with(test, &matvec_only(fmt)) else {
            return;
        };
        if !gemm.prefill_gemm() {
            assert!(!common::require_cuda_tests(), "cuBLAS did not load");
            eprintln!("{test}: GEMM part skipped, cuBLAS did not load");
            return;
        }
        let (rows, cols, n_act) = (300usize, 512usize, 24usize);
        let hm = random_matrix("blk.0.attn_q.weight", ty, rows, cols, &mut r);
        let x = randn(&mut r, n_act * cols);
        let run = |b: &CudaBackend| {
            let w = b.upload_matrix(&hm).unwrap();
            assert!(w.is_repacked());
            product(b, &w, &b.upload_activations(n_act, cols, &x).unwrap())
        };
        let e = rel_err(&run(&gemm), &run(&plain));
        eprintln!("{fmt} {ty}: GEMM on the repacked layout vs mat-vec rel err {e:.2e}");
        // NVFP4 goes through f16 tiles (~1e-3); the split layouts through
        // int8 products on 8-bit activations (~5e-3 on random data; their
        // exact check is prefill_mmq.rs's).
        let bound = if fmt == WeightFormat::Nvfp4 {
            5e-3
        } else {
            2e-2
        };
        assert!(e < bound, "{fmt} {ty}: GEMM vs mat-vec rel err {e}");
    }
}

/// SmolLM2 with NVFP4 weights on the GPU against the CPU (f32 activations)
/// running the same rounded weights (each attention/FFN matrix replaced by
/// its NVFP4 round trip, stored as F32): cosine >= 0.9999 at every
/// position. Fidelity against the file's own weights: NVFP4 is a second
/// 4-bit rounding of a Q4_1 model, and this 135M model amplifies any such
/// rounding at a few positions (a Q4_0 round trip of the same matrices
/// drops one position's logit cosine to 0.04), so the bound is that
/// comparison: NVFP4's mean cosine to the file is at least the Q4_0 round
/// trip's.
#[test]
fn nvfp4_smollm2_logits_match_cpu_on_rounded_weights() {
    let test = "nvfp4_smollm2_logits_match_cpu_on_rounded_weights";
    let nvfp4 = CudaOptions {
        weights: WeightFormat::Nvfp4,
        ..CudaOptions::default()
    };
    let Some(gpu) = cuda_with(test, &nvfp4) else {
        return;
    };
    let Some(path) = common::model_file(test, "smollm2-135m-instruct-q4_1.gguf") else {
        return;
    };
    let file = std::sync::Arc::new(GgufFile::open(&path).unwrap());
    // The file with every attention/FFN matrix replaced by `round(matrix)`
    // (as F32).
    let rounded_with = |round: &dyn Fn(GgmlType, &[u8], &[u64]) -> Vec<f32>| {
        let mut w = GgufWriter::new(file.metadata().clone());
        for view in file.tensor_views() {
            let (name, dims, ty) = (&view.info.name, &view.info.dims, view.info.ty);
            if dims.len() == 2 && name != "token_embd.weight" && name != "output.weight" {
                let bytes: Vec<u8> = round(ty, view.data, dims)
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect();
                w.add_tensor(name.clone(), dims.clone(), GgmlType::F32, bytes)
                    .unwrap();
            } else {
                w.add_tensor(name.clone(), dims.clone(), ty, view.data)
                    .unwrap();
            }
        }
        let mut buf = Vec::new();
        w.write_to(&mut buf).unwrap();
        std::sync::Arc::new(GgufFile::from_bytes(buf).unwrap())
    };
    let rounded = rounded_with(&|ty, data, dims| {
        Nvfp4Tensor::requantize(ty, data, dims)
            .unwrap()
            .dequantize()
            .unwrap()
    });
    let q4_0 = rounded_with(&|ty, data, dims| {
        let n = dims.iter().product::<u64>() as usize;
        let mut x = vec![0f32; n];
        mirage_gguf::quant::dequantize(ty, data, &mut x).unwrap();
        let mut q = vec![0u8; n / GgmlType::Q4_0.block_size() * GgmlType::Q4_0.type_size()];
        mirage_gguf::quant::quantize(GgmlType::Q4_0, &x, &mut q).unwrap();
        mirage_gguf::quant::dequantize(GgmlType::Q4_0, &q, &mut x).unwrap();
        x
    });
    let tokens = common::SMOLLM2_PROMPT;
    let g = common::logits(file.clone(), gpu, &tokens);
    let vocab = g.len() / tokens.len();
    let cpu = |f| common::logits(f, CpuBackend::new_f32_activations(0).unwrap(), &tokens);
    let (c_rounded, c_file, c_q4_0) = (cpu(rounded), cpu(file), cpu(q4_0));
    let mean = |a: &[f32], b: &[f32]| {
        a.chunks(vocab)
            .zip(b.chunks(vocab))
            .map(|(x, y)| cosine(x, y))
            .sum::<f64>()
            / tokens.len() as f64
    };
    let wr = worst_cosine(&g, &c_rounded, vocab);
    let (nv, q4) = (mean(&g, &c_file), mean(&c_q4_0, &c_file));
    eprintln!(
        "smollm2 NVFP4 cuda: worst-position cosine vs CPU on the same rounded weights {wr:.7}; \
         mean cosine to the Q4_1 file {nv:.5} (worst {:.5}), a Q4_0 round trip's {q4:.5} (worst {:.5})",
        worst_cosine(&g, &c_file, vocab),
        worst_cosine(&c_q4_0, &c_file, vocab)
    );
    assert!(
        wr >= 0.9999,
        "NVFP4 kernels vs CPU on the same weights: cosine {wr}"
    );
    assert!(
        nv >= q4,
        "NVFP4 loses more than a Q4_0 round trip: mean cosine to the file {nv} < {q4}"
    );
}

/// The fusions of a recorded decode step (Q/K/V in one launch, biases and
/// the residual adds folded into the mat-vecs, RMSNorms folded into the
/// next mat-vec, the fused FFN) against the same model launched op by op
/// (`graphs: false`, nothing folded): the same greedy tokens and logits
/// (cosine >= 0.99999) at every step, batch 1 and 2, for every layout mix
/// and NVFP4 weights; the graphs are replayed.
#[test]
fn recorded_step_fusions_equal_op_by_op_decode() {
    let test = "recorded_step_fusions_equal_op_by_op_decode";
    let Some(probe) = cuda(test) else {
        return;
    };
    drop(probe);
    for weights in [WeightFormat::Native, WeightFormat::Nvfp4] {
        for types in LAYER_MIXES {
            let file = Tiny {
                types,
                ..Tiny::Q8_BIASED
            }
            .build(23);
            let load = |graphs: bool| {
                let options = CudaOptions {
                    graphs,
                    weights,
                    ..CudaOptions::default()
                };
                Model::load(
                    file.clone(),
                    CudaBackend::with_options(0, &options).unwrap(),
                )
                .unwrap()
            };
            let (eager, recorded) = (load(false), load(true));
            let vocab = eager.config().vocab_size;
            for batch in [1usize, 2] {
                let g = Greedy {
                    batch,
                    steps: 12,
                    ..Greedy::default()
                };
                let (a, ta) = greedy_run(&eager, g);
                let before = recorded.backend().graph_stats();
                let (b, tb) = greedy_run(&recorded, g);
                let after = recorded.backend().graph_stats();
                let worst = worst_cosine(&a, &b, vocab);
                eprintln!(
                    "{weights} {types:?} batch {batch}: recorded vs op by op worst step cosine \
                     {worst:.9}, {} of {} logits differ in bits, replays {}",
                    bits_differ(&a, &b),
                    a.len(),
                    after.replays - before.replays
                );
                assert_eq!(ta, tb, "{weights} {types:?} batch {batch}: greedy tokens");
                assert!(
                    worst >= 0.99999,
                    "{weights} {types:?} batch {batch}: cosine {worst}"
                );
                assert!(after.replays - before.replays >= 10, "graph not replayed");
            }
        }
    }
}

/// FFN rows of 32 super-blocks and more (a 7B down row has 74) take the
/// Q4_K column split across blocks, the residual add folded into it: the
/// recorded decode equals the CPU backend with f32 activations on the same
/// inputs (the CPU's greedy tokens forced), batch 1 and 2. The prompt goes
/// through the decode mat-vecs too: the prefill GEMMs round activations to
/// 16 bits (worst step cosine 0.99983 with them, under the bound).
#[test]
fn long_q4_k_down_rows_decode_matches_cpu() {
    let test = "long_q4_k_down_rows_decode_matches_cpu";
    let Some(gpu) = cuda_with(test, &matvec_only(WeightFormat::Native)) else {
        return;
    };
    let q8 = GgmlType::Q8_0;
    let file = Tiny {
        types: [q8, q8, q8, q8, GgmlType::Q4_K, GgmlType::Q4_K],
        ..Tiny::Q8_BIASED
    }
    .build_with_ffn(29, 32 * 256);
    let cuda = Model::load(file.clone(), gpu).unwrap();
    let cpu = Model::load(file, CpuBackend::new_f32_activations(0).unwrap()).unwrap();
    let vocab = cpu.config().vocab_size;
    for batch in [1usize, 2] {
        let g = Greedy {
            batch,
            ..Greedy::default()
        };
        let (want, tokens) = greedy_run(&cpu, g);
        let (got, _) = greedy_run(
            &cuda,
            Greedy {
                force: Some(&tokens),
                ..g
            },
        );
        let worst = worst_cosine(&got, &want, vocab);
        eprintln!("batch {batch}: CUDA vs CPU worst step cosine {worst:.7}");
        assert!(worst >= 0.9999, "batch {batch}: cosine {worst}");
    }
}

/// The GPU tests' fixtures are valid without a GPU (a shape a type cannot
/// hold fails here, not on the device): every matrix they quantize, and the
/// biased models run on the CPU backend with finite logits.
#[test]
fn fixtures_build_and_run_on_cpu() {
    let mut r = rng(1);
    for set in QKV_SETS {
        for (&ty, n) in set.iter().zip(QKV_ROWS) {
            random_matrix("m", ty, n, QKV_COLS, &mut r);
        }
    }
    let (d, ff) = FFN_DIMS;
    for (tg, td) in FFN_PAIRS {
        random_matrix("g", tg, ff, d, &mut r);
        host_matrix("d", td, d, ff, &randn(&mut r, ff * d));
    }
    for types in LAYER_MIXES {
        let file = Tiny {
            types,
            ..Tiny::Q8_BIASED
        }
        .build(23);
        let model = Model::load(file, CpuBackend::new_f32_activations(1).unwrap()).unwrap();
        let logits = model.logits_all(&[1, 2, 3], KvDtype::F32).unwrap();
        assert!(
            !logits.is_empty() && logits.iter().all(|v| v.is_finite()),
            "{types:?}"
        );
    }
}

/// Every repacked layout and NVFP4 on shapes whose column splits (the
/// split-K rule's 1, 2, 4 or 8 slices, whichever the device's SM count
/// picks for these row counts) do not divide evenly, one to three
/// activation rows, alone and as Q/K/V in one launch: the f64 reference to
/// 1e-5. Then the persistent grid of the split Q8_0 mat-vec over more row
/// groups than the device holds blocks (20000 rows of 2048).
#[test]
fn split_and_grid_matvecs_match_f64_every_layout() {
    let test = "split_and_grid_matvecs_match_f64_every_layout";
    let mut r = rng(23);
    // cols in whole 256-element blocks; 7 and 9 blocks do not split evenly
    // in 2/4/8, 1 block leaves most slices empty.
    let shapes: &[(usize, usize)] = &[(37, 256 * 9), (130, 256 * 7), (8, 256), (300, 256 * 14)];
    let layouts: &[(GgmlType, WeightFormat)] = &[
        (GgmlType::Q8_0, WeightFormat::Native),
        (GgmlType::Q4_K, WeightFormat::Native),
        (GgmlType::Q5_0, WeightFormat::Native),
        (GgmlType::Q6_K, WeightFormat::Native),
        (GgmlType::Q8_0, WeightFormat::Nvfp4),
    ];
    let check = |gpu: &CudaBackend,
                 hms: &[HostMatrix],
                 deq: &[f32],
                 what: &str,
                 r: &mut rand::rngs::StdRng| {
        let (rows, cols) = (hms[0].rows, hms[0].cols);
        let ws: Vec<_> = hms.iter().map(|m| gpu.upload_matrix(m).unwrap()).collect();
        assert!(ws[0].is_repacked(), "{what}: not repacked");
        for n_act in [1usize, 3] {
            let x = randn(r, n_act * cols);
            let dx = gpu.upload_activations(n_act, cols, &x).unwrap();
            let want = matvec_reference(deq, &x, rows, cols, n_act);
            let got = three_and_one(gpu, &ws, &dx);
            for out in [&got[0], &got[3]] {
                let e = rel_err(out, &want);
                assert!(
                    e < matvec_bound(hms[0].ty),
                    "{what} {rows}x{cols} n_act {n_act}: vs f64 rel err {e}"
                );
            }
        }
    };
    for &(ty, fmt) in layouts {
        let Some(gpu) = cuda_with(test, &matvec_only(fmt)) else {
            return;
        };
        for &(rows, cols) in shapes {
            let hms: Vec<HostMatrix> = [rows, 24, 40]
                .iter()
                .map(|&n| random_matrix("blk.0.attn_q.weight", ty, n, cols, &mut r))
                .collect();
            let deq = match fmt {
                WeightFormat::Nvfp4 => {
                    Nvfp4Tensor::requantize(ty, hms[0].data.as_slice(), &[cols as u64, rows as u64])
                        .unwrap()
                        .dequantize()
                        .unwrap()
                }
                WeightFormat::Native => dequantized(&hms[0]),
            };
            check(&gpu, &hms, &deq, &format!("{fmt} {ty}"), &mut r);
        }
    }
    let Some(gpu) = cuda_with(test, &matvec_only(WeightFormat::Native)) else {
        return;
    };
    let cols = 2048;
    let hms: Vec<HostMatrix> = [20000usize, 4099, 777]
        .iter()
        .map(|&n| random_matrix("blk.0.ffn_down.weight", GgmlType::Q8_0, n, cols, &mut r))
        .collect();
    check(&gpu, &hms, &dequantized(&hms[0]), "grid q8_0", &mut r);
}
