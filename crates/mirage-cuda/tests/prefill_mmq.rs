//! The prefill products on int8 tensor cores (`mmq_*`, cuda/mmq.cu) on the
//! GPU: each split layout and tile against an f64 reference on random
//! blocks, and a whole prefill against the batch-1 decode path. Without a
//! GPU (or without the `cuda` feature) every test prints why it skips and
//! passes.

use mirage_cuda::{CudaBackend, CudaOptions};
use mirage_gguf::GgmlType;
use mirage_runtime::backend::{Backend, TokenSlot};
use mirage_runtime::kv_cache::KvDtype;
use mirage_runtime::Model;

mod common;
use common::{
    argmax, cosine, cuda_with, dequantized, device_matmul, host_matrix, matvec_reference, randn,
    rel_err, rng, Tiny,
};

/// `x` through 8-bit blocks of 32 and back, as `quantize_q8` does it: d =
/// max|x| / 127 and q = round-half-even(x / d), both in f32.
fn q8_roundtrip(x: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for b in x.chunks(32) {
        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        out.extend(b.iter().map(|&v| {
            let q = if amax == 0.0 {
                0.0
            } else {
                (v / d).round_ties_even()
            };
            q * d
        }));
    }
    out
}

/// Every layout `mmq_*` reads (Q8_0 and Q5_0, uploaded in their split
/// layouts) in a product of this shape, which must take the `tile` tile,
/// against an f64 product of the dequantized weights and the 8-bit-rounded
/// activations (the kernel's own inputs: only the summation order
/// differs), and against the exact activations (the 8-bit rounding costs
/// ~0.5 % there).
fn every_layout_matches_f64_reference(
    test: &str,
    gpu: &CudaBackend,
    (rows, cols, n_act): (usize, usize, usize),
    tile: usize,
) {
    assert_eq!(
        gpu.mmq_tile(rows, n_act).unwrap(),
        tile,
        "{test}: {rows} x {n_act} does not take the {tile} tile"
    );
    let mut r = rng(77);
    for ty in [GgmlType::Q8_0, GgmlType::Q5_0] {
        let hm = host_matrix(
            &format!("test.{ty}"),
            ty,
            rows,
            cols,
            &randn(&mut r, rows * cols),
        );
        let w = dequantized(&hm);
        let x = randn(&mut r, n_act * cols);
        let dm = gpu.upload_matrix(&hm).unwrap();
        assert!(dm.is_repacked(), "{ty}: not uploaded in its split layout");
        let got = device_matmul(gpu, &dm, &x, n_act, rows);
        let exact_inputs = matvec_reference(&w, &q8_roundtrip(&x), rows, cols, n_act);
        let e = rel_err(&got, &exact_inputs);
        let e_f32 = rel_err(&got, &matvec_reference(&w, &x, rows, cols, n_act));
        eprintln!(
            "{ty}: mmq vs f64 on its 8-bit inputs (tile {tile}, {rows} x {cols} times {n_act}) rel err \
             {e:.2e}; vs f32 activations {e_f32:.2e}"
        );
        assert!(e < 1e-5, "{ty}: mmq vs f64 reference rel err {e}");
        assert!(
            e_f32 < 2e-2,
            "{ty}: mmq vs f32-activation reference rel err {e_f32}"
        );
    }
}

/// The 64 tile: 300 rows and 70 activation rows leave partial tiles of
/// both; 512 columns are four stages (the ring has two buffers).
#[test]
fn mmq_every_layout_matches_f64_reference() {
    let test = "mmq_every_layout_matches_f64_reference";
    let Some(gpu) = cuda_with(test, &CudaOptions::default()) else {
        return;
    };
    every_layout_matches_f64_reference(test, &gpu, (300, 512, 70), 64);
}

/// The 128 tile: the fewest rows (128 k + 37, a partial tile) that take it
/// beside 549 activation rows (a partial tile) on this device; 640 columns
/// are five stages (the ring has three buffers).
#[test]
fn mmq_wide_tile_matches_f64_reference() {
    let test = "mmq_wide_tile_matches_f64_reference";
    let Some(gpu) = cuda_with(test, &CudaOptions::default()) else {
        return;
    };
    let n_act = 549;
    let rows = (1..=64)
        .map(|k| 128 * k + 37)
        .find(|&rows| gpu.mmq_tile(rows, n_act).unwrap() == 128)
        .expect("no shape of up to 8229 rows takes the 128 tile");
    every_layout_matches_f64_reference(test, &gpu, (rows, 640, n_act), 128);
}

/// One prompt of `n` tokens prefilled in one batch (the int8 tensor-core
/// products, the prefill attention on f16 tensor cores) against the same
/// tokens fed one at a time (the batch-1 decode path: mat-vecs on f32
/// activations): per-position logits cosine and arg-max; then greedy decode
/// from the decode path's cache, its tokens teacher-forced through the
/// prefill path's cache: at every step the same arg-max, or a near-tie
/// (within 1e-2 of the logit range, on random weights' flat logits).
fn prefill_matches_decode(test: &str, file: std::sync::Arc<mirage_gguf::GgufFile>) {
    let Some(gpu) = cuda_with(test, &CudaOptions::default()) else {
        return;
    };
    let model = Model::load(file, gpu).unwrap();
    let vocab = model.config().vocab_size;
    let (n, steps) = (64usize, 64usize);
    let tokens: Vec<u32> = (0..n).map(|i| ((i * 53 + 7) % vocab) as u32).collect();
    let slot = |pos| TokenSlot { seq: 0, pos };
    // Prefill: one batch, every position's logits.
    let mut pc = model.new_kv_cache(n + steps + 1, 1, KvDtype::F16).unwrap();
    let mut ps = model.new_scratch();
    let mut batch = Vec::new();
    let slots: Vec<TokenSlot> = (0..n).map(slot).collect();
    let rows: Vec<usize> = (0..n).collect();
    model
        .forward(&tokens, &slots, &rows, &mut pc, &mut ps, &mut batch)
        .unwrap();
    // Decode: the same tokens one at a time.
    let mut dc = model.new_kv_cache(n + steps + 1, 1, KvDtype::F16).unwrap();
    let mut ds = model.new_scratch();
    let (mut one, mut step) = (Vec::new(), Vec::new());
    for (i, &t) in tokens.iter().enumerate() {
        model
            .forward(&[t], &[slot(i)], &[0], &mut dc, &mut ds, &mut step)
            .unwrap();
        one.extend_from_slice(&step);
    }
    let mut worst = 1.0f64;
    let mut same_argmax = 0;
    for p in 0..n {
        let (a, b) = (
            &batch[p * vocab..(p + 1) * vocab],
            &one[p * vocab..(p + 1) * vocab],
        );
        worst = worst.min(cosine(a, b));
        same_argmax += usize::from(argmax(a) == argmax(b));
    }
    // Greedy from both caches, the decode path's tokens fed to both.
    let (mut dl, mut pl) = (step.clone(), batch[(n - 1) * vocab..].to_vec());
    let (mut worst_step, mut exact, mut ties) = (1.0f64, 0, 0);
    for i in 0..steps {
        let want = argmax(&dl);
        let got = argmax(&pl);
        if got == want {
            exact += 1;
        } else {
            let max = dl[want as usize];
            let min = dl.iter().copied().fold(f32::MAX, f32::min);
            let gap = max - dl[got as usize];
            assert!(
                gap <= 1e-2 * (max - min),
                "{test}: step {i}: prefill path chose {got}, decode path {want} by {gap} (not a near-tie)"
            );
            ties += 1;
        }
        let pos = n + i;
        model
            .forward(&[want], &[slot(pos)], &[0], &mut dc, &mut ds, &mut dl)
            .unwrap();
        model
            .forward(&[want], &[slot(pos)], &[0], &mut pc, &mut ps, &mut pl)
            .unwrap();
        worst_step = worst_step.min(cosine(&dl, &pl));
    }
    eprintln!(
        "{test}: prefill (tensor cores) vs batch-1 decode: worst position cosine {worst:.7}, \
         same arg-max at {same_argmax}/{n} positions; {steps} greedy steps after: worst cosine \
         {worst_step:.7}, same tokens {exact}, near-ties {ties}"
    );
    // The activations of the batch are rounded to 8 bits per 32 values
    // (as llama.cpp's MMQ does): each product is off by ~5e-3 of its size
    // (`mmq_every_layout_matches_f64_reference`), and on random weights
    // that compounds to a cosine of ~0.9992 over a model's layers (measured
    // on an H100), so the bound is 1e-3 rather than the decode path's 1e-5.
    assert!(worst >= 0.999, "prefill vs decode cosine {worst}");
    assert!(
        worst_step >= 0.999,
        "decode after prefill vs after decode: cosine {worst_step}"
    );
}

/// Qwen2-shaped, every matrix Q8_0 with Q/K/V biases, Q6_K lm head.
#[test]
fn prefill_q8_0_matches_decode() {
    prefill_matches_decode("prefill_q8_0_matches_decode", Tiny::Q8_BIASED.build(5));
}

/// The Q4_K_M mix: Q4_K, Q5_0 keys, Q6_K values, down and lm head.
#[test]
fn prefill_q4_k_mix_matches_decode() {
    let tiny = Tiny {
        arch: "qwen2",
        embd: GgmlType::Q4_K,
        types: [
            GgmlType::Q4_K,
            GgmlType::Q5_0,
            GgmlType::Q6_K,
            GgmlType::Q4_K,
            GgmlType::Q4_K,
            GgmlType::Q6_K,
        ],
        bias: true,
    };
    prefill_matches_decode("prefill_q4_k_mix_matches_decode", tiny.build(9));
}

/// The products really take the tensor-core path here: a backend with the
/// option off multiplies the same batch through the mat-vecs, and the two
/// differ by the 8-bit rounding (not bit for bit), while agreeing closely.
#[test]
fn mmq_path_is_taken_for_batches() {
    let test = "mmq_path_is_taken_for_batches";
    let off = CudaOptions {
        prefill_gemm: false,
        ..CudaOptions::default()
    };
    let (Some(on), Some(off)) = (
        cuda_with(test, &CudaOptions::default()),
        cuda_with(test, &off),
    ) else {
        return;
    };
    let (rows, cols, n_act) = (128usize, 256usize, 33usize);
    let mut r = rng(3);
    let hm = host_matrix(
        "test.q8_0",
        GgmlType::Q8_0,
        rows,
        cols,
        &randn(&mut r, rows * cols),
    );
    let x = randn(&mut r, n_act * cols);
    let run = |b: &CudaBackend| device_matmul(b, &b.upload_matrix(&hm).unwrap(), &x, n_act, rows);
    let (a, b) = (run(&on), run(&off));
    let e = rel_err(&a, &b);
    eprintln!("{test}: tensor-core vs mat-vec rel err {e:.2e}");
    assert!(
        e > 1e-6,
        "the batch did not take the int8 path (bit-identical to the mat-vec)"
    );
    assert!(e < 2e-2, "int8 path vs mat-vec rel err {e}");
}
