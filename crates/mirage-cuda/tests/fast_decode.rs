//! The fast decode path (split-Q8_0 repacking, `mv3_*` multi-matrix mat-vec,
//! fused gate/up/SwiGLU, NVFP4 weights) against the first version's kernels
//! (`set_fast_decode(false)`, ggml layout) and against f64 / CPU references.
//! Without a GPU (or without the `cuda` feature) every test prints why it
//! skips and passes.

use std::sync::Arc;

use mirage_cuda::{CudaBackend, MatvecGrid, PrefetchSites, PreloadParts, WeightFormat};
use mirage_gguf::quant::Nvfp4Tensor;
use mirage_gguf::writer::GgufWriter;
use mirage_gguf::{quant, GgmlType, GgufFile};
use mirage_runtime::backend::{Backend, HostMatrix, SharedBytes};
use mirage_runtime::kv_cache::KvDtype;
use mirage_runtime::{CpuBackend, Model};
use rand::Rng;

mod common;
use common::{bits_differ, cuda, randn, rng};

fn host_matrix(name: &str, ty: GgmlType, rows: usize, cols: usize, values: &[f32]) -> HostMatrix {
    let rb = quant::row_bytes(ty, cols).unwrap();
    let mut data = vec![0u8; rb * rows];
    for r in 0..rows {
        quant::quantize(
            ty,
            &values[r * cols..(r + 1) * cols],
            &mut data[r * rb..(r + 1) * rb],
        )
        .unwrap();
    }
    HostMatrix {
        name: name.into(),
        ty,
        rows,
        cols,
        data: SharedBytes::from_vec(data),
    }
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    assert!(got.iter().all(|v| v.is_finite()), "non-finite output");
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| ((*a - *b) as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

const TYPES: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

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

/// (gate/up, down) types and (d, n_ff) of `fused_ffn_equals_unfused`.
const FFN_PAIRS: [(GgmlType, GgmlType); 5] = [
    (GgmlType::Q8_0, GgmlType::Q8_0),
    (GgmlType::Q4_K, GgmlType::Q6_K),
    (GgmlType::Q5_0, GgmlType::Q8_0),
    (GgmlType::Q4_1, GgmlType::Q4_1),
    (GgmlType::Q6_K, GgmlType::Q6_K),
];
const FFN_DIMS: (usize, usize) = (256, 768);

/// Weight types (q, k, v, o, gate/up, down) of the tiny biased models.
const LAYER_MIXES: [[GgmlType; 6]; 2] = [
    [GgmlType::Q8_0; 6],
    [
        GgmlType::Q4_K,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q5_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ],
];
const NORM_MIX: [GgmlType; 6] = [
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_0,
    GgmlType::Q6_K,
    GgmlType::Q4_K,
    GgmlType::Q8_0,
];

/// Odd shapes: rows not a multiple of the 32 rows of a split-Q8_0 block or
/// the 4 rows of a warp, row lengths not a multiple of the 128-element chunk.
const SHAPES: &[(usize, usize)] = &[(1, 256), (5, 288), (37, 96), (130, 512), (67, 1056)];

fn read(gpu: &CudaBackend, a: &<CudaBackend as Backend>::Activations) -> Vec<f32> {
    let mut v = Vec::new();
    gpu.read(a, &mut v).unwrap();
    v
}

/// y = W x for `n_act` rows, on the device.
fn product(
    gpu: &CudaBackend,
    w: &<CudaBackend as Backend>::Matrix,
    x: &<CudaBackend as Backend>::Activations,
) -> Vec<f32> {
    let mut y = gpu.new_activations();
    gpu.matmul(w, x, &mut y).unwrap();
    read(gpu, &y)
}

/// f64 reference of y = W x on the dequantized weights.
fn reference(w: &[f32], x: &[f32], rows: usize, cols: usize, n_act: usize) -> Vec<f32> {
    let mut y = vec![0f32; n_act * rows];
    for a in 0..n_act {
        for r in 0..rows {
            let s: f64 = (0..cols)
                .map(|k| w[r * cols + k] as f64 * x[a * cols + k] as f64)
                .sum();
            y[a * rows + r] = s as f32;
        }
    }
    y
}

/// Every type and odd shapes: the fast mat-vec (mv3_* on the ggml blocks,
/// or the split-Q8_0 kernel) equals the first version's matvec_* (bit for
/// bit where the summation order is the same, else to 1e-6), both match the
/// f64 reference, and the embedding of a repacked table equals the old one.
#[test]
fn fast_matvec_and_embed_equal_old_path_every_type_and_odd_shapes() {
    let Some(gpu) = cuda("fast_matvec_and_embed_equal_old_path_every_type_and_odd_shapes") else {
        return;
    };
    gpu.set_prefill_gemm(false);
    let mut r = rng(7);
    for &ty in TYPES {
        for &(rows, cols) in SHAPES {
            if cols % ty.block_size() != 0 {
                continue;
            }
            let values = randn(&mut r, rows * cols);
            let hm = host_matrix("blk.0.test.weight", ty, rows, cols, &values);
            let mut deq = vec![0f32; rows * cols];
            quant::dequantize(ty, hm.data.as_slice(), &mut deq).unwrap();
            gpu.set_fast_decode(false);
            let old = gpu.upload_matrix(&hm).unwrap();
            gpu.set_fast_decode(true);
            let new = gpu.upload_matrix(&hm).unwrap();
            assert_eq!(
                new.is_repacked(),
                matches!(
                    ty,
                    GgmlType::Q8_0 | GgmlType::Q4_K | GgmlType::Q5_0 | GgmlType::Q6_K
                ),
                "{ty}: repacking"
            );
            for n_act in [1usize, 3] {
                let x = randn(&mut r, n_act * cols);
                let dx = gpu.upload_activations(n_act, cols, &x).unwrap();
                gpu.set_fast_decode(false);
                let y_old = product(&gpu, &old, &dx);
                gpu.set_fast_decode(true);
                let y_new = product(&gpu, &new, &dx);
                let y_new_ggml = product(&gpu, &old, &dx);
                let want = reference(&deq, &x, rows, cols, n_act);
                let e_ref = rel_err(&y_new, &want);
                let e_old = rel_err(&y_new, &y_old);
                assert!(
                    e_ref < 1e-5,
                    "{ty} {rows}x{cols} n_act {n_act}: fast vs f64 rel err {e_ref}"
                );
                assert!(
                    e_old < 1e-5,
                    "{ty} {rows}x{cols} n_act {n_act}: fast vs old rel err {e_old}"
                );
                // mv3 on ggml blocks runs the old loop in the old order
                // (equal up to the compiler's FMA contraction choices).
                let e_ggml = rel_err(&y_new_ggml, &y_old);
                assert!(
                    e_ggml < 1e-6,
                    "{ty} {rows}x{cols}: mv3 on ggml blocks vs matvec rel err {e_ggml}"
                );
            }
            // Embedding rows of the repacked table == the old ones.
            let tokens: Vec<u32> = vec![0, (rows - 1) as u32, (rows / 2) as u32];
            let (mut eo, mut en) = (gpu.new_activations(), gpu.new_activations());
            gpu.embed(&old, &tokens, &mut eo).unwrap();
            gpu.embed(&new, &tokens, &mut en).unwrap();
            let e = rel_err(&read(&gpu, &en), &read(&gpu, &eo));
            assert!(
                e < 1e-6,
                "{ty}: embedding rows of the repacked table differ: rel err {e}"
            );
        }
        eprintln!(
            "{ty}: fast mat-vec == old path over {} shapes",
            SHAPES.len()
        );
    }
}

/// Q, K, V as one launch (same kernel: one mv3; mixed: runs) == three
/// separate old mat-vecs.
#[test]
fn matmul_many_equals_separate_matmuls() {
    let Some(gpu) = cuda("matmul_many_equals_separate_matmuls") else {
        return;
    };
    gpu.set_prefill_gemm(false);
    let mut r = rng(11);
    let cols = QKV_COLS;
    for set in QKV_SETS {
        let rows = QKV_ROWS;
        let hms: Vec<HostMatrix> = set
            .iter()
            .zip(rows)
            .map(|(&ty, n)| host_matrix("blk.0.attn.weight", ty, n, cols, &randn(&mut r, n * cols)))
            .collect();
        for n_act in [1usize, 2] {
            let x = randn(&mut r, n_act * cols);
            let dx = gpu.upload_activations(n_act, cols, &x).unwrap();
            gpu.set_fast_decode(false);
            let old: Vec<_> = hms.iter().map(|m| gpu.upload_matrix(m).unwrap()).collect();
            let want: Vec<Vec<f32>> = old.iter().map(|w| product(&gpu, w, &dx)).collect();
            gpu.set_fast_decode(true);
            let new: Vec<_> = hms.iter().map(|m| gpu.upload_matrix(m).unwrap()).collect();
            let (mut a, mut b, mut c) = (
                gpu.new_activations(),
                gpu.new_activations(),
                gpu.new_activations(),
            );
            gpu.matmul_many(
                &[&new[0], &new[1], &new[2]],
                &dx,
                &mut [&mut a, &mut b, &mut c],
            )
            .unwrap();
            for (i, got) in [read(&gpu, &a), read(&gpu, &b), read(&gpu, &c)]
                .iter()
                .enumerate()
            {
                let e = rel_err(got, &want[i]);
                assert!(e < 1e-5, "{set:?} n_act {n_act}: output {i} rel err {e}");
            }
        }
    }
}

/// gate + up + SwiGLU in one kernel == the old three launches, per type
/// pair (mixed pairs take the unfused path and must agree too).
#[test]
fn fused_ffn_equals_unfused() {
    let Some(gpu) = cuda("fused_ffn_equals_unfused") else {
        return;
    };
    gpu.set_prefill_gemm(false);
    let mut r = rng(13);
    let (d, ff) = FFN_DIMS;
    for (tg, td) in FFN_PAIRS {
        let g = host_matrix("blk.0.ffn_gate.weight", tg, ff, d, &randn(&mut r, ff * d));
        let u = host_matrix("blk.0.ffn_up.weight", tg, ff, d, &randn(&mut r, ff * d));
        let dn = host_matrix("blk.0.ffn_down.weight", td, d, ff, &randn(&mut r, ff * d));
        for n_act in [1usize, 3] {
            let x = randn(&mut r, n_act * d);
            let dx = gpu.upload_activations(n_act, d, &x).unwrap();
            gpu.set_fast_decode(false);
            let f_old = gpu.upload_ffn(0, &g, &u, &dn).unwrap();
            let mut yo = gpu.new_activations();
            gpu.ffn(&f_old, &dx, &mut yo).unwrap();
            gpu.set_fast_decode(true);
            let f_new = gpu.upload_ffn(0, &g, &u, &dn).unwrap();
            let mut yn = gpu.new_activations();
            gpu.ffn(&f_new, &dx, &mut yn).unwrap();
            let e = rel_err(&read(&gpu, &yn), &read(&gpu, &yo));
            eprintln!("ffn {tg}/{td} n_act {n_act}: fused vs unfused rel err {e:.2e}");
            assert!(e < 1e-5, "ffn {tg}/{td} n_act {n_act}: rel err {e}");
        }
    }
}

/// NVFP4 weights: mat-vec (1 and 3 rows), fused FFN, embedding and the GEMM
/// prefill path against the CPU codec's dequantized values.
#[test]
fn nvfp4_matvec_ffn_embed_gemm_match_cpu_codec() {
    let Some(gpu) = cuda("nvfp4_matvec_ffn_embed_gemm_match_cpu_codec") else {
        return;
    };
    gpu.set_prefill_gemm(false);
    gpu.set_weight_format(WeightFormat::Nvfp4);
    let mut r = rng(17);
    for &(rows, cols) in SHAPES {
        for ty in [GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::F32] {
            if cols % ty.block_size() != 0 {
                continue;
            }
            let hm = host_matrix(
                "blk.0.attn_q.weight",
                ty,
                rows,
                cols,
                &randn(&mut r, rows * cols),
            );
            let t = Nvfp4Tensor::requantize(ty, hm.data.as_slice(), &[cols as u64, rows as u64])
                .unwrap();
            let deq = t.dequantize().unwrap();
            let w = gpu.upload_matrix(&hm).unwrap();
            assert!(w.is_nvfp4());
            assert_eq!(w.bytes(), rows * cols / 2 + rows * cols / 16);
            for n_act in [1usize, 3] {
                let x = randn(&mut r, n_act * cols);
                let dx = gpu.upload_activations(n_act, cols, &x).unwrap();
                let e = rel_err(
                    &product(&gpu, &w, &dx),
                    &reference(&deq, &x, rows, cols, n_act),
                );
                assert!(
                    e < 1e-5,
                    "nvfp4 from {ty} {rows}x{cols} n_act {n_act}: rel err {e}"
                );
            }
            let tokens: Vec<u32> = vec![(rows - 1) as u32, 0];
            let mut e = gpu.new_activations();
            gpu.embed(&w, &tokens, &mut e).unwrap();
            let mut want = Vec::new();
            for &t in &tokens {
                want.extend_from_slice(&deq[t as usize * cols..(t as usize + 1) * cols]);
            }
            assert_eq!(read(&gpu, &e), want, "nvfp4 embedding rows");
        }
    }
    // Tables keep their type.
    let hm = host_matrix(
        "token_embd.weight",
        GgmlType::Q8_0,
        64,
        256,
        &randn(&mut r, 64 * 256),
    );
    assert!(!gpu.upload_matrix(&hm).unwrap().is_nvfp4());
    // Fused FFN on NVFP4 == unfused on the same NVFP4 matrices.
    let (d, ff) = (256usize, 352usize);
    let g = host_matrix(
        "blk.0.ffn_gate.weight",
        GgmlType::Q8_0,
        ff,
        d,
        &randn(&mut r, ff * d),
    );
    let u = host_matrix(
        "blk.0.ffn_up.weight",
        GgmlType::Q8_0,
        ff,
        d,
        &randn(&mut r, ff * d),
    );
    let dn = host_matrix(
        "blk.0.ffn_down.weight",
        GgmlType::Q8_0,
        d,
        ff,
        &randn(&mut r, ff * d),
    );
    let f = gpu.upload_ffn(0, &g, &u, &dn).unwrap();
    let x = randn(&mut r, 2 * d);
    let dx = gpu.upload_activations(2, d, &x).unwrap();
    let (mut y1, mut y2) = (gpu.new_activations(), gpu.new_activations());
    gpu.ffn(&f, &dx, &mut y1).unwrap();
    gpu.set_fast_decode(false); // repacked matrices still take the fast kernels, unfused
    gpu.ffn(&f, &dx, &mut y2).unwrap();
    gpu.set_fast_decode(true);
    let e = rel_err(&read(&gpu, &y1), &read(&gpu, &y2));
    assert!(e < 1e-5, "nvfp4 ffn fused vs unfused rel err {e}");
    // GEMM prefill on repacked layouts vs the mat-vec.
    if gpu.set_prefill_gemm(true) {
        for (fmt, ty) in [
            (WeightFormat::Nvfp4, GgmlType::Q8_0),
            (WeightFormat::Native, GgmlType::Q8_0),
            (WeightFormat::Native, GgmlType::Q4_K),
            (WeightFormat::Native, GgmlType::Q5_0),
            (WeightFormat::Native, GgmlType::Q6_K),
        ] {
            gpu.set_weight_format(fmt);
            let (rows, cols, n_act) = (300usize, 512usize, 24usize);
            let hm = host_matrix(
                "blk.0.attn_q.weight",
                ty,
                rows,
                cols,
                &randn(&mut r, rows * cols),
            );
            let w = gpu.upload_matrix(&hm).unwrap();
            assert!(w.is_repacked());
            let x = randn(&mut r, n_act * cols);
            let dx = gpu.upload_activations(n_act, cols, &x).unwrap();
            let a = product(&gpu, &w, &dx);
            gpu.set_prefill_gemm(false);
            let b = product(&gpu, &w, &dx);
            gpu.set_prefill_gemm(true);
            let e = rel_err(&a, &b);
            eprintln!("{fmt:?} {ty}: GEMM on the repacked layout vs mat-vec rel err {e:.2e}");
            assert!(e < 5e-3, "{fmt:?} {ty}: GEMM vs mat-vec rel err {e}");
        }
    }
}

/// SmolLM2 with NVFP4 weights on the GPU against the CPU (f32 activations)
/// running the SAME rounded weights (each attention/FFN matrix replaced by
/// its NVFP4 round trip, stored as F32): cosine >= 0.9999 at every
/// position. Fidelity vs the file's own weights is printed and bounded
/// loosely (NVFP4 is a second, 4-bit rounding of a Q4_1 model).
#[test]
fn nvfp4_smollm2_logits_match_cpu_on_rounded_weights() {
    let Some(gpu) = cuda("nvfp4_smollm2_logits_match_cpu_on_rounded_weights") else {
        return;
    };
    let Some(path) = common::model_file(
        "nvfp4_smollm2_logits_match_cpu_on_rounded_weights",
        "smollm2-135m-instruct-q4_1.gguf",
    ) else {
        return;
    };
    gpu.set_weight_format(WeightFormat::Nvfp4);
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let mut w = GgufWriter::new(file.metadata().clone());
    for view in file.tensor_views() {
        let (name, dims, ty) = (&view.info.name, &view.info.dims, view.info.ty);
        if dims.len() == 2 && name != "token_embd.weight" && name != "output.weight" {
            let t = Nvfp4Tensor::requantize(ty, view.data, dims).unwrap();
            let bytes: Vec<u8> = t
                .dequantize()
                .unwrap()
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
    let rounded = Arc::new(GgufFile::from_bytes(buf).unwrap());
    let tokens: Vec<u32> = vec![1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 378, 3458, 5248];
    let g = Model::load(file.clone(), gpu)
        .unwrap()
        .logits_all(&tokens, KvDtype::F32)
        .unwrap();
    let vocab = g.len() / tokens.len();
    let worst = |c: &[f32]| {
        (0..tokens.len())
            .map(|t| {
                cosine(
                    &g[t * vocab..(t + 1) * vocab],
                    &c[t * vocab..(t + 1) * vocab],
                )
            })
            .fold(1.0f64, f64::min)
    };
    let c_rounded = Model::load(rounded, CpuBackend::new_f32_activations(0).unwrap())
        .unwrap()
        .logits_all(&tokens, KvDtype::F32)
        .unwrap();
    let c_file = Model::load(file, CpuBackend::new_f32_activations(0).unwrap())
        .unwrap()
        .logits_all(&tokens, KvDtype::F32)
        .unwrap();
    let (wr, wf) = (worst(&c_rounded), worst(&c_file));
    let last = cosine(&g[g.len() - vocab..], &c_file[c_file.len() - vocab..]);
    eprintln!(
        "smollm2 NVFP4 cuda: worst-position cosine vs CPU on the same rounded weights {wr:.7}; \
         fidelity vs the Q4_1 file on the CPU: final {last:.5}, worst position {wf:.5}"
    );
    assert!(
        wr >= 0.9999,
        "NVFP4 kernels vs CPU on the same weights: cosine {wr}"
    );
    assert!(
        wf >= 0.9,
        "NVFP4 fidelity vs the file collapsed: cosine {wf}"
    );
}

/// A random llama-shaped model with Q/K/V biases (2 layers, GQA 4/2,
/// head_dim 64) written as GGUF in memory; `types` = (q, k, v, o, gate/up,
/// down).
fn tiny_model_with_bias(types: [GgmlType; 6]) -> Arc<GgufFile> {
    use mirage_gguf::{Metadata, Value};
    let (d, ff, vocab, n_layer) = (256usize, 512usize, 384usize, 2usize);
    let (n_head, n_head_kv, hd) = (4usize, 2usize, 64usize);
    let mut md = Metadata::new();
    md.insert("general.architecture", Value::String("llama".into()));
    md.insert("llama.block_count", Value::U32(n_layer as u32));
    md.insert("llama.context_length", Value::U32(4096));
    md.insert("llama.embedding_length", Value::U32(d as u32));
    md.insert("llama.feed_forward_length", Value::U32(ff as u32));
    md.insert("llama.attention.head_count", Value::U32(n_head as u32));
    md.insert(
        "llama.attention.head_count_kv",
        Value::U32(n_head_kv as u32),
    );
    md.insert("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5));
    md.insert("llama.rope.freq_base", Value::F32(10000.0));
    md.insert("llama.vocab_size", Value::U32(vocab as u32));
    let mut r = rng(23);
    let mut w = GgufWriter::new(md);
    let mut mat =
        |w: &mut GgufWriter, name: String, ty: GgmlType, rows: usize, cols: usize, scale: f32| {
            let v: Vec<f32> = randn(&mut r, rows * cols)
                .iter()
                .map(|x| x * scale)
                .collect();
            let m = host_matrix(&name, ty, rows, cols, &v);
            w.add_tensor(
                name,
                vec![cols as u64, rows as u64],
                ty,
                m.data.as_slice().to_vec(),
            )
            .unwrap();
        };
    mat(
        &mut w,
        "token_embd.weight".into(),
        GgmlType::Q8_0,
        vocab,
        d,
        1.0,
    );
    mat(
        &mut w,
        "output.weight".into(),
        GgmlType::Q6_K,
        vocab,
        d,
        0.1,
    );
    let (q_dim, kv_dim) = (n_head * hd, n_head_kv * hd);
    let s = 1.0 / (d as f32).sqrt();
    for l in 0..n_layer {
        mat(
            &mut w,
            format!("blk.{l}.attn_q.weight"),
            types[0],
            q_dim,
            d,
            3.0 * s,
        );
        mat(
            &mut w,
            format!("blk.{l}.attn_k.weight"),
            types[1],
            kv_dim,
            d,
            3.0 * s,
        );
        mat(
            &mut w,
            format!("blk.{l}.attn_v.weight"),
            types[2],
            kv_dim,
            d,
            s,
        );
        mat(
            &mut w,
            format!("blk.{l}.attn_output.weight"),
            types[3],
            d,
            q_dim,
            s,
        );
        mat(
            &mut w,
            format!("blk.{l}.ffn_gate.weight"),
            types[4],
            ff,
            d,
            s,
        );
        mat(&mut w, format!("blk.{l}.ffn_up.weight"), types[4], ff, d, s);
        mat(
            &mut w,
            format!("blk.{l}.ffn_down.weight"),
            types[5],
            d,
            ff,
            1.0 / (ff as f32).sqrt(),
        );
    }
    let mut r = rng(29);
    let vec = |w: &mut GgufWriter, name: String, v: Vec<f32>| {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        w.add_tensor(name, vec![v.len() as u64], GgmlType::F32, bytes)
            .unwrap();
    };
    vec(&mut w, "output_norm.weight".into(), vec![1.0; d]);
    for l in 0..n_layer {
        for nm in ["attn_norm", "ffn_norm"] {
            let v = (0..d)
                .map(|_| 1.0 + 0.2 * r.random_range(-1.0f32..1.0))
                .collect();
            vec(&mut w, format!("blk.{l}.{nm}.weight"), v);
        }
        for (nm, n) in [("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)] {
            let v = (0..n).map(|_| 0.5 * r.random_range(-1.0f32..1.0)).collect();
            vec(&mut w, format!("blk.{l}.{nm}.bias"), v);
        }
    }
    let mut out = Vec::new();
    w.write_to(&mut out).unwrap();
    Arc::new(GgufFile::from_bytes(out).unwrap())
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decode of `steps` tokens after a 20-token prompt per sequence
/// (`batch` sequences decoded together): every step's logits and tokens.
/// With `force`, the inputs after the prompt are those tokens instead
/// (teacher forcing, so that two numerically different paths are compared
/// on the same inputs even where a near-tie flips an argmax).
fn greedy_run(
    model: &Model<CudaBackend>,
    batch: usize,
    steps: usize,
    force: Option<&[u32]>,
) -> (Vec<f32>, Vec<u32>) {
    greedy_run_kv(model, batch, steps, force, KvDtype::F32)
}

/// `greedy_run` with a KV cache of `kv`.
fn greedy_run_kv(
    model: &Model<CudaBackend>,
    batch: usize,
    steps: usize,
    force: Option<&[u32]>,
    kv: KvDtype,
) -> (Vec<f32>, Vec<u32>) {
    use mirage_runtime::backend::TokenSlot;
    let vocab = model.config().vocab_size;
    let prompt_len = 20;
    let mut cache = model
        .new_kv_cache(prompt_len + steps + 1, batch, kv)
        .unwrap();
    let mut scratch = model.new_scratch();
    let mut logits = Vec::new();
    let mut last = Vec::new();
    for seq in 0..batch {
        let prompt: Vec<u32> = (0..prompt_len)
            .map(|i| ((i * 37 + 5 + seq * 101) % vocab) as u32)
            .collect();
        let slots: Vec<TokenSlot> = (0..prompt_len).map(|pos| TokenSlot { seq, pos }).collect();
        model
            .forward(
                &prompt,
                &slots,
                &[prompt_len - 1],
                &mut cache,
                &mut scratch,
                &mut logits,
            )
            .unwrap();
        last.push(argmax(&logits));
    }
    let (mut all, mut toks) = (Vec::new(), Vec::new());
    for i in 0..steps {
        let slots: Vec<TokenSlot> = (0..batch)
            .map(|seq| TokenSlot {
                seq,
                pos: prompt_len + i,
            })
            .collect();
        let rows: Vec<usize> = (0..batch).collect();
        model
            .forward(&last, &slots, &rows, &mut cache, &mut scratch, &mut logits)
            .unwrap();
        for (b, t) in last.iter_mut().enumerate() {
            let best = argmax(&logits[b * vocab..(b + 1) * vocab]);
            toks.push(best);
            *t = force.map_or(best, |f| f[i * batch + b]);
        }
        all.extend_from_slice(&logits);
    }
    (all, toks)
}

/// The whole fused layer: a model with Q/K/V biases decoded with the fast
/// path in CUDA graphs (Q/K/V in one launch, bias and residual adds folded
/// into the mat-vecs, fused gate/up/SwiGLU, split-Q8_0) against the old
/// path op by op, teacher-forced on the old path's greedy tokens: logits
/// cosine >= 0.99999 at every step, batch 1 and 2 (token agreement is
/// printed and must be >= 90 %); the graph is replayed. Then the NVFP4 model
/// in graphs (folded epilogues) against NVFP4 op by op (unfolded).
#[test]
fn fused_layer_graph_decode_equals_old_path() {
    let Some(probe) = cuda("fused_layer_graph_decode_equals_old_path") else {
        return;
    };
    drop(probe);
    for types in LAYER_MIXES {
        let file = tiny_model_with_bias(types);
        let old = {
            let b = CudaBackend::new(0).unwrap();
            b.set_fast_decode(false);
            b.set_graphs(false);
            Model::load(file.clone(), b).unwrap()
        };
        let new = {
            let b = CudaBackend::new(0).unwrap();
            b.set_graphs(true);
            Model::load(file.clone(), b).unwrap()
        };
        let vocab = old.config().vocab_size;
        for batch in [1usize, 2] {
            let (lo, to) = greedy_run(&old, batch, 16, None);
            let before = new.backend().graph_stats();
            let (ln, tn) = greedy_run(&new, batch, 16, Some(&to));
            let after = new.backend().graph_stats();
            let worst = lo
                .chunks(vocab)
                .zip(ln.chunks(vocab))
                .map(|(a, b)| cosine(a, b))
                .fold(1.0f64, f64::min);
            let agree = to.iter().zip(&tn).filter(|(a, b)| a == b).count() as f64 / to.len() as f64;
            eprintln!(
                "{types:?} batch {batch}: fast+graphs vs old eager worst step cosine {worst:.9}, \
                 argmax agreement {agree:.3}, replays {}",
                after.replays - before.replays
            );
            assert!(
                agree >= 0.9,
                "{types:?} batch {batch}: argmax agreement {agree}"
            );
            assert!(worst >= 0.99999, "{types:?} batch {batch}: cosine {worst}");
            assert!(after.replays - before.replays >= 14, "graph not replayed");
        }
        let nv = |graphs: bool| {
            let b = CudaBackend::new(0).unwrap();
            b.set_weight_format(WeightFormat::Nvfp4);
            b.set_graphs(graphs);
            Model::load(file.clone(), b).unwrap()
        };
        let (a, ta) = greedy_run(&nv(false), 2, 12, None);
        let (b, tb) = greedy_run(&nv(true), 2, 12, None);
        let worst = a
            .chunks(vocab)
            .zip(b.chunks(vocab))
            .map(|(x, y)| cosine(x, y))
            .fold(1.0f64, f64::min);
        eprintln!("{types:?}: NVFP4 graphs vs NVFP4 op by op worst step cosine {worst:.9}");
        assert_eq!(
            ta, tb,
            "{types:?}: NVFP4 greedy tokens differ graphs vs eager"
        );
        assert!(worst >= 0.99999, "{types:?}: NVFP4 graph cosine {worst}");
    }
}

/// RMSNorm folded into the next mat-vec of a recorded step (the default)
/// against the same fast path with the norm launched on its own
/// (`set_fuse_norm(false)`): same arithmetic, so same tokens and logits
/// (cosine >= 0.999999) at every step, batch 1 and 2, split-Q8_0/Q4_K and
/// ggml-layout kernels.
#[test]
fn folded_norm_equals_separate_norm() {
    let Some(probe) = cuda("folded_norm_equals_separate_norm") else {
        return;
    };
    drop(probe);
    let file = tiny_model_with_bias(NORM_MIX);
    let load = |fuse: bool| {
        let b = CudaBackend::new(0).unwrap();
        b.set_graphs(true);
        b.set_fuse_norm(fuse);
        Model::load(file.clone(), b).unwrap()
    };
    let (on, off) = (load(true), load(false));
    let vocab = on.config().vocab_size;
    for batch in [1usize, 2] {
        let (a, ta) = greedy_run(&off, batch, 12, None);
        let (b, tb) = greedy_run(&on, batch, 12, None);
        let worst = a
            .chunks(vocab)
            .zip(b.chunks(vocab))
            .map(|(x, y)| cosine(x, y))
            .fold(1.0f64, f64::min);
        eprintln!("batch {batch}: folded norm vs separate norm worst step cosine {worst:.9}");
        assert_eq!(ta, tb, "batch {batch}: greedy tokens differ");
        assert!(worst >= 0.999999, "batch {batch}: cosine {worst}");
    }
}

/// The GPU tests' fixtures are valid without a GPU (so that a shape a type
/// cannot hold fails here, not on the device): every matrix they quantize,
/// and the tiny biased models run on the CPU backend with finite logits.
#[test]
fn fixtures_build_and_run_on_cpu() {
    let mut r = rng(1);
    for set in QKV_SETS {
        for (&ty, n) in set.iter().zip(QKV_ROWS) {
            host_matrix("m", ty, n, QKV_COLS, &randn(&mut r, n * QKV_COLS));
        }
    }
    let (d, ff) = FFN_DIMS;
    for (tg, td) in FFN_PAIRS {
        host_matrix("g", tg, ff, d, &randn(&mut r, ff * d));
        host_matrix("d", td, d, ff, &randn(&mut r, ff * d));
    }
    for types in LAYER_MIXES.iter().chain([&NORM_MIX]) {
        let model = Model::load(
            tiny_model_with_bias(*types),
            CpuBackend::new_f32_activations(1).unwrap(),
        )
        .unwrap();
        let logits = model.logits_all(&[1, 2, 3], KvDtype::F32).unwrap();
        assert!(
            !logits.is_empty() && logits.iter().all(|v| v.is_finite()),
            "{types:?}"
        );
    }
}

/// `set_repacked_types` picks which types take a split layout (one layout
/// can be left out on its own); the fast path still runs the others.
#[test]
fn repacked_types_switch_per_type() {
    let Some(gpu) = cuda("repacked_types_switch_per_type") else {
        return;
    };
    let mut r = rng(37);
    gpu.set_repacked_types(&[GgmlType::Q4_K]);
    for (ty, want) in [
        (GgmlType::Q8_0, false),
        (GgmlType::Q4_K, true),
        (GgmlType::Q5_0, false),
    ] {
        let hm = host_matrix("blk.0.x.weight", ty, 40, 512, &randn(&mut r, 40 * 512));
        assert_eq!(gpu.upload_matrix(&hm).unwrap().is_repacked(), want, "{ty}");
    }
    gpu.set_repacked_types(&[
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q5_0,
        GgmlType::Q6_K,
    ]);
    let hm = host_matrix(
        "blk.0.x.weight",
        GgmlType::Q5_0,
        40,
        512,
        &randn(&mut r, 40 * 512),
    );
    assert!(gpu.upload_matrix(&hm).unwrap().is_repacked());
}

/// The split-K mat-vecs (`mv3_<layout>_k2/4/8`: a row's columns cut into 2,
/// 4 or 8 slices summed in order through shared memory) equal the
/// one-warp-per-row kernel to 1e-6 and the f64 reference to 1e-5, for every
/// repacked layout and NVFP4, on shapes whose columns do not divide evenly
/// into slices (a slice may be short or empty), one to three activation
/// rows, and Q/K/V as one launch; the automatic rule matches too, and a
/// split outside 0/1/2/4/8 is refused.
#[test]
fn split_k_matvec_equals_unsplit_every_layout() {
    let Some(gpu) = cuda("split_k_matvec_equals_unsplit_every_layout") else {
        return;
    };
    gpu.set_prefill_gemm(false);
    gpu.set_fast_decode(true);
    assert!(gpu.set_split_k(3).is_err(), "split 3 accepted");
    let mut r = rng(23);
    // (rows, cols): cols in whole 256-element blocks; 7 and 9 blocks do not
    // split evenly in 2/4/8, 1 block leaves most slices empty.
    let shapes: &[(usize, usize)] = &[(37, 256 * 9), (130, 256 * 7), (8, 256), (300, 256 * 14)];
    let layouts: &[(&str, GgmlType, WeightFormat)] = &[
        ("q8_0s", GgmlType::Q8_0, WeightFormat::Native),
        ("q4_ks", GgmlType::Q4_K, WeightFormat::Native),
        ("q5_0s", GgmlType::Q5_0, WeightFormat::Native),
        ("q6_ks", GgmlType::Q6_K, WeightFormat::Native),
        ("nvfp4", GgmlType::Q8_0, WeightFormat::Nvfp4),
    ];
    for &(label, ty, fmt) in layouts {
        gpu.set_weight_format(fmt);
        for &(rows, cols) in shapes {
            let hms: Vec<HostMatrix> = [rows, 24, 40]
                .iter()
                .map(|&n| host_matrix("blk.0.attn_q.weight", ty, n, cols, &randn(&mut r, n * cols)))
                .collect();
            let deq: Vec<f32> = if fmt == WeightFormat::Nvfp4 {
                Nvfp4Tensor::requantize(ty, hms[0].data.as_slice(), &[cols as u64, rows as u64])
                    .unwrap()
                    .dequantize()
                    .unwrap()
            } else {
                let mut d = vec![0f32; rows * cols];
                quant::dequantize(ty, hms[0].data.as_slice(), &mut d).unwrap();
                d
            };
            let ws: Vec<_> = hms.iter().map(|m| gpu.upload_matrix(m).unwrap()).collect();
            assert!(ws[0].is_repacked(), "{label}: not repacked");
            for n_act in [1usize, 3] {
                let x = randn(&mut r, n_act * cols);
                let dx = gpu.upload_activations(n_act, cols, &x).unwrap();
                let want = reference(&deq, &x, rows, cols, n_act);
                let mut base: Option<Vec<Vec<f32>>> = None;
                for k in [1usize, 2, 4, 8, 0] {
                    gpu.set_split_k(k).unwrap();
                    let got = product(&gpu, &ws[0], &dx);
                    let e = rel_err(&got, &want);
                    assert!(
                        e < 1e-5,
                        "{label} {rows}x{cols} n_act {n_act} split {k}: vs f64 rel err {e}"
                    );
                    let (mut a, mut b, mut c) = (
                        gpu.new_activations(),
                        gpu.new_activations(),
                        gpu.new_activations(),
                    );
                    gpu.matmul_many(
                        &[&ws[0], &ws[1], &ws[2]],
                        &dx,
                        &mut [&mut a, &mut b, &mut c],
                    )
                    .unwrap();
                    let three = vec![read(&gpu, &a), read(&gpu, &b), read(&gpu, &c)];
                    match &base {
                        None => base = Some(three),
                        Some(b0) => {
                            for (i, (g, w)) in three.iter().zip(b0).enumerate() {
                                let e = rel_err(g, w);
                                assert!(
                                    e < 1e-6,
                                    "{label} {rows}x{cols} n_act {n_act} split {k}: output {i} vs split 1 rel err {e}"
                                );
                            }
                        }
                    }
                }
            }
        }
        eprintln!(
            "{label}: split-K 2/4/8 and the rule == split 1 over {} shapes",
            shapes.len()
        );
    }
    gpu.set_split_k(0).unwrap();
    gpu.set_weight_format(WeightFormat::Native);
}

/// Mat-vec variants of the split Q8_0 / Q4_K layouts (`set_matvec_variant`
/// 2..=5, `MIRAGE_CUDA_MV`): for every variant, every split-K setting (1, 2,
/// 4, 8 and the rule) and both layouts, on shapes whose rows are not a
/// multiple of any variant's rows per block and whose columns run from one
/// super-block to several thousand, with 1 and 3 activation rows:
/// `matmul` equals the f64 reference (rel err < 1e-5) and variant 1 (the
/// default kernels, < 1e-6; all variants keep f32 activations), `matmul_many`
/// over three matrices equals variant 1's, and the fused FFN (gate/up/SwiGLU
/// kernel of the variant, down through the variant's mv3) equals variant
/// 1's. Values outside 1..=5 are refused.
#[test]
fn matvec_variants_equal_reference_and_v1() {
    let Some(gpu) = cuda("matvec_variants_equal_reference_and_v1") else {
        return;
    };
    gpu.set_prefill_gemm(false);
    gpu.set_fast_decode(true);
    assert!(gpu.set_matvec_variant(0).is_err(), "variant 0 accepted");
    assert!(gpu.set_matvec_variant(6).is_err(), "variant 6 accepted");
    let mut r = rng(41);
    let shapes: &[(usize, usize)] = &[
        (37, 256),
        (5, 256 * 3),
        (130, 256 * 7),
        (67, 256 * 9),
        (300, 256 * 14),
        (19, 256 * 19),
    ];
    let (mut worst_ref, mut worst_v1) = (0f64, 0f64);
    for ty in [GgmlType::Q8_0, GgmlType::Q4_K] {
        for &(rows, cols) in shapes {
            let hms: Vec<HostMatrix> = [rows, 24, 41]
                .iter()
                .map(|&n| host_matrix("blk.0.attn_q.weight", ty, n, cols, &randn(&mut r, n * cols)))
                .collect();
            let mut deq = vec![0f32; rows * cols];
            quant::dequantize(ty, hms[0].data.as_slice(), &mut deq).unwrap();
            let ws: Vec<_> = hms.iter().map(|m| gpu.upload_matrix(m).unwrap()).collect();
            assert!(ws[0].is_repacked(), "{ty}: not repacked");
            for n_act in [1usize, 3] {
                let x = randn(&mut r, n_act * cols);
                let dx = gpu.upload_activations(n_act, cols, &x).unwrap();
                let want = reference(&deq, &x, rows, cols, n_act);
                let many = |gpu: &CudaBackend| {
                    let (mut a, mut b, mut c) = (
                        gpu.new_activations(),
                        gpu.new_activations(),
                        gpu.new_activations(),
                    );
                    gpu.matmul_many(
                        &[&ws[0], &ws[1], &ws[2]],
                        &dx,
                        &mut [&mut a, &mut b, &mut c],
                    )
                    .unwrap();
                    vec![read(gpu, &a), read(gpu, &b), read(gpu, &c)]
                };
                gpu.set_matvec_variant(1).unwrap();
                gpu.set_split_k(1).unwrap();
                let base = product(&gpu, &ws[0], &dx);
                let base_many = many(&gpu);
                for v in 2..=5usize {
                    gpu.set_matvec_variant(v).unwrap();
                    for k in [1usize, 2, 4, 8, 0] {
                        gpu.set_split_k(k).unwrap();
                        let got = product(&gpu, &ws[0], &dx);
                        let (e_ref, e_v1) = (rel_err(&got, &want), rel_err(&got, &base));
                        worst_ref = worst_ref.max(e_ref);
                        worst_v1 = worst_v1.max(e_v1);
                        let what = format!("{ty} {rows}x{cols} n_act {n_act} v{v} split {k}");
                        assert!(e_ref < 1e-5, "{what}: vs f64 rel err {e_ref}");
                        assert!(e_v1 < 1e-6, "{what}: vs v1 rel err {e_v1}");
                        let got_many = many(&gpu);
                        for (i, (g, w)) in got_many.iter().zip(&base_many).enumerate() {
                            let e = rel_err(g, w);
                            assert!(e < 1e-6, "{what}: matmul_many output {i} vs v1 rel err {e}");
                        }
                        if v == 2 && ty == GgmlType::Q8_0 {
                            // v2p: the same loads and sums, the first ones
                            // before the PDL wait: the same bits.
                            gpu.set_preload(PreloadParts::ALL);
                            let pre = product(&gpu, &ws[0], &dx);
                            let pre_many = many(&gpu);
                            gpu.set_preload(PreloadParts::NONE);
                            assert_eq!(bits_differ(&pre, &got), 0, "{what}: preload changed bits");
                            for (i, (p, g)) in pre_many.iter().zip(&got_many).enumerate() {
                                assert_eq!(
                                    bits_differ(p, g),
                                    0,
                                    "{what}: preload, matmul_many output {i}"
                                );
                            }
                            // v2g: the same row groups on a persistent
                            // grid: the same bits.
                            gpu.set_matvec_grid(MatvecGrid::Always);
                            let grid = product(&gpu, &ws[0], &dx);
                            let grid_many = many(&gpu);
                            gpu.set_matvec_grid(MatvecGrid::Off);
                            assert_eq!(bits_differ(&grid, &got), 0, "{what}: grid changed bits");
                            for (i, (p, g)) in grid_many.iter().zip(&got_many).enumerate() {
                                assert_eq!(
                                    bits_differ(p, g),
                                    0,
                                    "{what}: grid, matmul_many output {i}"
                                );
                            }
                        }
                    }
                }
            }
        }
        // Fused FFN: n_ff an odd number of 32-element blocks (down in Q8_0;
        // every down kernel needs whole blocks, so no n_ff leaves a partial
        // 8- or 16-channel block: mv3's tail rows are tested above) or a
        // whole number of super-blocks (1280: down of the same type).
        for &(d, ff) in &[(256usize, 1312usize), (768, 1280), (2304, 352)] {
            let g = host_matrix("blk.0.ffn_gate.weight", ty, ff, d, &randn(&mut r, ff * d));
            let u = host_matrix("blk.0.ffn_up.weight", ty, ff, d, &randn(&mut r, ff * d));
            let dn_ty = if ff % 256 == 0 { ty } else { GgmlType::Q8_0 };
            let dn = host_matrix(
                "blk.0.ffn_down.weight",
                dn_ty,
                d,
                ff,
                &randn(&mut r, ff * d),
            );
            let f = gpu.upload_ffn(0, &g, &u, &dn).unwrap();
            for n_act in [1usize, 3] {
                let x = randn(&mut r, n_act * d);
                let dx = gpu.upload_activations(n_act, d, &x).unwrap();
                gpu.set_matvec_variant(1).unwrap();
                gpu.set_split_k(0).unwrap();
                let mut yb = gpu.new_activations();
                gpu.ffn(&f, &dx, &mut yb).unwrap();
                let base = read(&gpu, &yb);
                for v in 2..=5usize {
                    gpu.set_matvec_variant(v).unwrap();
                    for k in [1usize, 0] {
                        gpu.set_split_k(k).unwrap();
                        let mut y = gpu.new_activations();
                        gpu.ffn(&f, &dx, &mut y).unwrap();
                        let got = read(&gpu, &y);
                        let e = rel_err(&got, &base);
                        worst_v1 = worst_v1.max(e);
                        assert!(
                            e < 1e-6,
                            "ffn {ty} {d}x{ff} n_act {n_act} v{v} split {k}: vs v1 rel err {e}"
                        );
                        if v == 2 && ty == GgmlType::Q8_0 {
                            gpu.set_preload(PreloadParts::ALL);
                            let mut yp = gpu.new_activations();
                            gpu.ffn(&f, &dx, &mut yp).unwrap();
                            gpu.set_preload(PreloadParts::NONE);
                            assert_eq!(
                                bits_differ(&read(&gpu, &yp), &got),
                                0,
                                "ffn {ty} {d}x{ff} n_act {n_act} split {k}: preload changed bits"
                            );
                        }
                    }
                }
            }
        }
        eprintln!(
            "{ty}: mat-vec variants 2..5 == f64 and v1 (v2 with the preload bit-equal) over {} shapes and 3 FFNs",
            shapes.len()
        );
    }
    eprintln!("mat-vec variants: worst rel err vs f64 {worst_ref:.2e}, vs v1 {worst_v1:.2e}");
    gpu.set_matvec_variant(1).unwrap();
    gpu.set_split_k(0).unwrap();
}

/// A whole tiny model (Q/K/V biases, folded epilogues and norms, fused FFN)
/// decoded greedily in CUDA graphs with each mat-vec variant against the
/// default kernels (variant 1) in graphs, teacher-forced on variant 1's
/// tokens: logits cosine >= 0.999999 at every step, argmax agreement >= 90 %
/// (printed), batch 1 and 2, for an all-Q8_0 model and a Q4_K mix; the
/// graph is replayed.
#[test]
fn matvec_variants_graph_decode_equals_v1() {
    let Some(probe) = cuda("matvec_variants_graph_decode_equals_v1") else {
        return;
    };
    drop(probe);
    for types in [LAYER_MIXES[0], LAYER_MIXES[1], NORM_MIX] {
        let file = tiny_model_with_bias(types);
        let load = |v: usize| {
            let b = CudaBackend::new(0).unwrap();
            b.set_graphs(true);
            b.set_matvec_variant(v).unwrap();
            Model::load(file.clone(), b).unwrap()
        };
        let base = load(1);
        let vocab = base.config().vocab_size;
        for batch in [1usize, 2] {
            let (lb, tb) = greedy_run(&base, batch, 16, None);
            for v in 2..=5usize {
                let m = load(v);
                let before = m.backend().graph_stats();
                let (lv, tv) = greedy_run(&m, batch, 16, Some(&tb));
                let after = m.backend().graph_stats();
                let worst = lb
                    .chunks(vocab)
                    .zip(lv.chunks(vocab))
                    .map(|(a, b)| cosine(a, b))
                    .fold(1.0f64, f64::min);
                let agree =
                    tb.iter().zip(&tv).filter(|(a, b)| a == b).count() as f64 / tb.len() as f64;
                eprintln!(
                    "{types:?} batch {batch} v{v}: vs v1 worst step cosine {worst:.9}, argmax agreement {agree:.3}, replays {}",
                    after.replays - before.replays
                );
                assert!(
                    agree >= 0.9,
                    "{types:?} batch {batch} v{v}: agreement {agree}"
                );
                assert!(
                    worst >= 0.999999,
                    "{types:?} batch {batch} v{v}: cosine {worst}"
                );
                assert!(after.replays - before.replays >= 14, "graph not replayed");
            }
        }
    }
}

/// Programmatic dependent launch (sm_90+: kernels start behind the previous
/// one's drain and prefetch their weight rows into L2 before waiting on it)
/// changes when work starts, never what is computed: a tiny model decoded
/// greedily in CUDA graphs with PDL on equals PDL off bit for bit (logits
/// and tokens), every mat-vec variant, batch 1 and 2, Q8_0 and Q4_K mixes.
/// On a device without PDL it checks that `set_pdl(true)` stays off.
#[test]
fn pdl_decode_equals_serialized_decode() {
    let Some(probe) = cuda("pdl_decode_equals_serialized_decode") else {
        return;
    };
    let has_pdl = probe.compute_capability().0 >= 9;
    drop(probe);
    for types in [LAYER_MIXES[0], LAYER_MIXES[1], NORM_MIX] {
        let file = tiny_model_with_bias(types);
        for v in 1..=5usize {
            let load = |pdl: bool| {
                let b = CudaBackend::new(0).unwrap();
                b.set_graphs(true);
                b.set_matvec_variant(v).unwrap();
                b.set_pdl(pdl);
                assert_eq!(b.pdl(), pdl && has_pdl, "set_pdl({pdl})");
                Model::load(file.clone(), b).unwrap()
            };
            let (off, on) = (load(false), load(true));
            for batch in [1usize, 2] {
                let (lo, to) = greedy_run(&off, batch, 12, None);
                let (ln, tn) = greedy_run(&on, batch, 12, None);
                let differ = bits_differ(&lo, &ln);
                eprintln!(
                    "{types:?} v{v} batch {batch}: PDL {} vs off: {differ} of {} logits differ",
                    if has_pdl { "on" } else { "(unsupported)" },
                    lo.len()
                );
                assert_eq!(to, tn, "{types:?} v{v} batch {batch}: tokens differ");
                assert_eq!(differ, 0, "{types:?} v{v} batch {batch}: logits differ");
            }
        }
    }
}

/// Greedy decodes of the tiny model in two layer mixes (`LAYER_MIXES[0]`
/// and `NORM_MIX`; 60 steps after a 20-token prompt, batch 1 and 2, in
/// graphs and op by op, a KV cache of each of `kvs`) on two backends that
/// differ only in `set(backend, false)` / `set(backend, true)`: the tokens
/// must be equal and the logits the same bits. Returns each graph run's
/// case and the two graphs' launch counts (off, on).
fn switch_keeps_bits(
    label: &str,
    kvs: &[KvDtype],
    set: impl Fn(&CudaBackend, bool),
) -> Vec<(String, usize, usize)> {
    let mut graph_launches = Vec::new();
    for types in [LAYER_MIXES[0], NORM_MIX] {
        let file = tiny_model_with_bias(types);
        for graphs in [true, false] {
            let load = |on: bool| {
                let b = CudaBackend::new(0).unwrap();
                b.set_graphs(graphs);
                set(&b, on);
                Model::load(file.clone(), b).unwrap()
            };
            let (off, on) = (load(false), load(true));
            for &kv in kvs {
                for batch in [1usize, 2] {
                    let (lf, tf) = greedy_run_kv(&off, batch, 60, None, kv);
                    let (ln, tn) = greedy_run_kv(&on, batch, 60, None, kv);
                    let differ = bits_differ(&lf, &ln);
                    let launches = (
                        off.backend().last_graph_launches(),
                        on.backend().last_graph_launches(),
                    );
                    let what = format!("{types:?} graphs {graphs} {kv:?} batch {batch}");
                    eprintln!(
                        "{what}: {label}: {differ} of {} logits differ; graph launches {} vs {}",
                        lf.len(),
                        launches.0,
                        launches.1
                    );
                    assert_eq!(tf, tn, "{what}: tokens");
                    assert_eq!(differ, 0, "{what}: logits");
                    if graphs {
                        graph_launches.push((what, launches.0, launches.1));
                    }
                }
            }
        }
    }
    graph_launches
}

/// The decode attention as one launch (`attend_fused_*`: the last split of
/// each head merges the partials) against `attend_part_*` + `attend_combine`:
/// the same arithmetic, so the same bits, over 60 greedy steps after a
/// 20-token prompt (positions past 64, so two splits of the 81-position
/// cache hold keys and the merge has more than one partial), batch 1 and 2,
/// in graphs and op by op.
#[test]
fn fused_attention_equals_part_and_combine() {
    let Some(probe) = cuda("fused_attention_equals_part_and_combine") else {
        return;
    };
    drop(probe);
    switch_keeps_bits("fused vs two launches", &[KvDtype::F32], |b, on| {
        b.set_fused_attention(on)
    });
}

/// The decode rows' RoPE and KV store folded into the one-launch attention
/// (`attend_rope_*`) against `rope_store_*` then `attend_fused_*`: the same
/// rotation and the same values per key, so the same bits, over 60 greedy
/// steps after a 20-token prompt (the new key in the second split too),
/// batch 1 and 2 (two sequences), f32 and f16 caches, in graphs and op by op;
/// a folded graph has one launch fewer per layer (2 layers).
#[test]
fn rope_in_attention_equals_rope_store() {
    let Some(probe) = cuda("rope_in_attention_equals_rope_store") else {
        return;
    };
    drop(probe);
    let label = "RoPE in the attention vs rope_store";
    let kvs = [KvDtype::F32, KvDtype::F16];
    for (what, apart, folded) in switch_keeps_bits(label, &kvs, |b, on| b.set_rope_in_attention(on))
    {
        assert_eq!(apart, folded + 2, "{what}: launches per graph");
    }
}

/// The preload (`set_preload`: the v2 split Q8_0 mat-vecs' first weights
/// and the decode attention's position, RoPE angle and first keys and
/// values read before the PDL wait) changes when things are loaded, not
/// what is computed: bit-equal greedy decodes with it on and off, in graphs
/// and op by op, f32 and f16 caches, with the same launches per graph.
#[test]
fn preload_keeps_bits() {
    let Some(probe) = cuda("preload_keeps_bits") else {
        return;
    };
    drop(probe);
    let kvs = [KvDtype::F32, KvDtype::F16];
    for (what, off, on) in switch_keeps_bits("preload on vs off", &kvs, |b, on| {
        b.set_preload(if on {
            PreloadParts::ALL
        } else {
            PreloadParts::NONE
        })
    }) {
        assert_eq!(on, off, "{what}: launches per graph");
    }
}

/// The persistent-grid mat-vec over more row groups than the device holds
/// blocks (20000 rows: 625 groups of 32 at split 1, 1250 at split 2,
/// against ~2 resident blocks per SM), so each block takes several: the same
/// bits as the one-block-per-group v2 kernel at every split, one and three
/// activation rows, and three matrices in one launch.
#[test]
fn matvec_grid_covers_tall_matrices() {
    let Some(gpu) = cuda("matvec_grid_covers_tall_matrices") else {
        return;
    };
    gpu.set_prefill_gemm(false);
    gpu.set_fast_decode(true);
    let mut r = rng(43);
    let cols = 512;
    let ws: Vec<_> = [20000usize, 4099, 777]
        .iter()
        .map(|&n| {
            let m = host_matrix(
                "blk.0.ffn_down.weight",
                GgmlType::Q8_0,
                n,
                cols,
                &randn(&mut r, n * cols),
            );
            gpu.upload_matrix(&m).unwrap()
        })
        .collect();
    for n_act in [1usize, 3] {
        let dx = gpu
            .upload_activations(n_act, cols, &randn(&mut r, n_act * cols))
            .unwrap();
        let run = |gpu: &CudaBackend| {
            let mut ys = [
                gpu.new_activations(),
                gpu.new_activations(),
                gpu.new_activations(),
            ];
            let [a, b, c] = &mut ys;
            gpu.matmul_many(&[&ws[0], &ws[1], &ws[2]], &dx, &mut [a, b, c])
                .unwrap();
            let mut out = product(gpu, &ws[0], &dx);
            for y in &ys {
                out.extend(read(gpu, y));
            }
            out
        };
        for split in [1usize, 2, 4, 8] {
            gpu.set_split_k(split).unwrap();
            gpu.set_matvec_grid(MatvecGrid::Off);
            let v2 = run(&gpu);
            gpu.set_matvec_grid(MatvecGrid::Always);
            let v2g = run(&gpu);
            gpu.set_matvec_grid(MatvecGrid::Off);
            let differ = bits_differ(&v2, &v2g);
            eprintln!(
                "split {split} n_act {n_act}: grid vs v2: {differ} of {} differ",
                v2.len()
            );
            assert_eq!(differ, 0, "split {split} n_act {n_act}");
        }
    }
    gpu.set_split_k(0).unwrap();
}

/// The persistent-grid mat-vecs (`set_matvec_grid`: `mv3_*_v2g*`, at most
/// the resident blocks, each taking several row groups) change which block
/// computes a row, not how: bit-equal greedy decodes with the switch on and
/// off, in graphs and op by op, with the same launches per graph.
#[test]
fn matvec_grid_keeps_bits() {
    let Some(probe) = cuda("matvec_grid_keeps_bits") else {
        return;
    };
    drop(probe);
    let kvs = [KvDtype::F32];
    for (what, off, on) in switch_keeps_bits("mat-vec grid on vs off", &kvs, |b, on| {
        b.set_matvec_grid(if on {
            MatvecGrid::Always
        } else {
            MatvecGrid::Off
        })
    }) {
        assert_eq!(on, off, "{what}: launches per graph");
    }
}

/// The cross-op weight prefetch (`Backend::prefetch` hints: the output
/// projection's weights issued into L2 while the attention runs, the next
/// layer's Q/K/V or the lm head between the FFN's halves) changes what is
/// in the cache, never what is computed: 60 greedy steps after a 20-token
/// prompt, batch 1 and 2, in graphs and op by op, with both sites on equal
/// both off bit for bit; a recorded graph has one `l2_prefetch` launch more
/// per site and layer (2 layers: 4 with both sites, 2 with the attention's
/// alone).
#[test]
fn cross_op_prefetch_keeps_bits() {
    let Some(probe) = cuda("cross_op_prefetch_keeps_bits") else {
        return;
    };
    drop(probe);
    let attn_only = PrefetchSites {
        attention: true,
        ffn: false,
    };
    for (sites, extra) in [(PrefetchSites::ALL, 4), (attn_only, 2)] {
        let label = format!("prefetch at {sites:?} vs none");
        let kvs = [KvDtype::F32];
        for (what, off, on) in switch_keeps_bits(&label, &kvs, |b, on| {
            b.set_cross_prefetch(if on { sites } else { PrefetchSites::NONE })
        }) {
            assert_eq!(on, off + extra, "{what}: launches per graph");
        }
    }
}

/// Q/K/V, the decode attention and O of each layer as one persistent launch
/// (`set_attention_block`: `attn_block_q8s_*`, blocks waiting on one
/// another's counters instead of kernel boundaries) run the same items with
/// the same code: bit-equal greedy decodes with it on and off, f32 and f16
/// caches, batch 1 and 2, in graphs and op by op. Where a step has the
/// pattern (the all-Q8_0 mix, one row, recorded) each layer's three launches
/// become one (2 layers: 4 fewer); elsewhere nothing changes. Then, f16
/// cache only, with the grid capped at 3 blocks, so that blocks take several
/// tiles and attention items each and wait on the others' (three O tiles a
/// block copied in ahead).
#[test]
fn attention_block_keeps_bits() {
    let Some(probe) = cuda("attention_block_keeps_bits") else {
        return;
    };
    drop(probe);
    let fused_mix = format!("{:?}", LAYER_MIXES[0]);
    let all = [KvDtype::F32, KvDtype::F16];
    for (cap, kvs) in [(None, &all[..]), (Some(3), &all[1..])] {
        let label = format!("attention block (grid cap {cap:?}) vs three launches");
        for (what, off, on) in switch_keeps_bits(&label, kvs, |b, on| {
            b.set_attention_block(on);
            b.set_attention_block_grid(cap);
        }) {
            let fused = what.starts_with(&fused_mix) && what.ends_with("batch 1");
            let want = if fused { off - 4 } else { off };
            assert_eq!(on, want, "{what}: launches per graph");
        }
    }
}
