//! A whole model decoded with NVFP4 pages, every page active: the test model
//! on the CPU, then the sparse CUDA backend against the dense one with NVFP4
//! weights.

use std::sync::Arc;

use mirage_artifact::metrics::cosine;
use mirage_artifact::{Artifact, SparseMode, SuperblockBackend};
use mirage_cuda::{
    CudaBackend, CudaOptions, PageFormat, PageSource, SparseCudaBackend, SparsePages, WeightFormat,
};
use mirage_gguf::{GgmlType, GgufFile, GgufWriter, Metadata, Value};
use mirage_runtime::backend::{Backend, TokenSlot};
use mirage_runtime::kv_cache::KvDtype;
use mirage_runtime::{CpuBackend, Model};
use rand::Rng;

use crate::common::{cuda_with, rng};
use crate::fixture::{
    artifact_from, exact_nvfp4_weights, q8, random_perm, LayerW, D, N_FF, N_LAYER, N_PAGES,
};

/// A llama model around `layers`' FFNs (stored F32), random Q8_0 attention
/// (4 heads, 2 KV heads of 64), Q8_0 embedding and lm head, vocab 384.
fn model_with_ffn(layers: &[LayerW], r: &mut impl Rng) -> Arc<GgufFile> {
    let (vocab, n_head, n_head_kv, hd) = (384usize, 4usize, 2usize, 64usize);
    let mut md = Metadata::new();
    md.insert("general.architecture", Value::String("llama".into()));
    md.insert("llama.block_count", Value::U32(layers.len() as u32));
    md.insert("llama.context_length", Value::U32(256));
    md.insert("llama.embedding_length", Value::U32(D as u32));
    md.insert("llama.feed_forward_length", Value::U32(N_FF as u32));
    md.insert("llama.attention.head_count", Value::U32(n_head as u32));
    md.insert(
        "llama.attention.head_count_kv",
        Value::U32(n_head_kv as u32),
    );
    md.insert("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5));
    md.insert("llama.rope.freq_base", Value::F32(10000.0));
    md.insert("llama.vocab_size", Value::U32(vocab as u32));
    let mut w = GgufWriter::new(md);
    let add = |w: &mut GgufWriter, name: String, ty: GgmlType, dims: Vec<u64>, v: &[f32]| {
        let bytes = match ty {
            GgmlType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            _ => q8(v, dims[0] as usize),
        };
        w.add_tensor(name, dims, ty, bytes).unwrap();
    };
    let mut rand_mat = |rows: usize, cols: usize, scale: f32| -> Vec<f32> {
        (0..rows * cols)
            .map(|_| (r.random_range(-1.0f32..1.0) + r.random_range(-1.0f32..1.0)) * scale)
            .collect()
    };
    let s = 1.0 / (D as f32).sqrt();
    let (q_dim, kv_dim) = (n_head * hd, n_head_kv * hd);
    let emb = rand_mat(vocab, D, 1.0);
    let out = rand_mat(vocab, D, 0.1);
    let mut attn = Vec::new();
    for _ in layers {
        attn.push([
            rand_mat(q_dim, D, 3.0 * s),
            rand_mat(kv_dim, D, 3.0 * s),
            rand_mat(kv_dim, D, s),
            rand_mat(D, q_dim, s),
        ]);
    }
    let (q8t, f32t) = (GgmlType::Q8_0, GgmlType::F32);
    let dims = |rows: usize, cols: usize| vec![cols as u64, rows as u64];
    for (name, m) in [("token_embd.weight", &emb), ("output.weight", &out)] {
        add(&mut w, name.into(), q8t, dims(vocab, D), m);
    }
    add(
        &mut w,
        "output_norm.weight".into(),
        GgmlType::F32,
        vec![D as u64],
        &vec![1.0; D],
    );
    for (l, (lw, a)) in layers.iter().zip(&attn).enumerate() {
        let shapes = [(q_dim, D), (kv_dim, D), (kv_dim, D), (D, q_dim)];
        let names = ["attn_q", "attn_k", "attn_v", "attn_output"];
        for ((nm, (rows, cols)), m) in names.into_iter().zip(shapes).zip(a) {
            let name = format!("blk.{l}.{nm}.weight");
            add(&mut w, name, q8t, dims(rows, cols), m);
        }
        let ffn = [
            ("ffn_gate", N_FF, D, &lw.gate),
            ("ffn_up", N_FF, D, &lw.up),
            ("ffn_down", D, N_FF, &lw.down),
        ];
        for (nm, rows, cols, m) in ffn {
            let name = format!("blk.{l}.{nm}.weight");
            add(&mut w, name, f32t, dims(rows, cols), m);
        }
        for nm in ["attn_norm", "ffn_norm"] {
            let v: Vec<f32> = (0..D)
                .map(|i| 1.0 + 0.2 * ((i * 7 + l) % 5) as f32 / 5.0)
                .collect();
            let name = format!("blk.{l}.{nm}.weight");
            add(&mut w, name, f32t, vec![D as u64], &v);
        }
    }
    let mut bytes = Vec::new();
    w.write_to(&mut bytes).unwrap();
    Arc::new(GgufFile::from_bytes(bytes).unwrap())
}

/// Greedy decode of `steps` tokens after a 12-token prompt (one sequence):
/// every step's logits and argmax. With `force`, the inputs after the prompt
/// are those tokens (teacher forcing).
fn greedy<B: Backend>(
    model: &Model<B>,
    steps: usize,
    force: Option<&[u32]>,
) -> (Vec<Vec<f32>>, Vec<u32>) {
    let vocab = model.config().vocab_size;
    let n_prompt = 12;
    let mut cache = model
        .new_kv_cache(n_prompt + steps + 1, 1, KvDtype::F32)
        .unwrap();
    let mut scratch = model.new_scratch();
    let mut logits = Vec::new();
    let prompt: Vec<u32> = (0..n_prompt)
        .map(|i| ((i * 37 + 5) % vocab) as u32)
        .collect();
    let slots: Vec<TokenSlot> = (0..n_prompt).map(|pos| TokenSlot { seq: 0, pos }).collect();
    model
        .forward(
            &prompt,
            &slots,
            &[n_prompt - 1],
            &mut cache,
            &mut scratch,
            &mut logits,
        )
        .unwrap();
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32
    };
    let mut tok = argmax(&logits);
    let (mut all, mut toks) = (Vec::new(), Vec::new());
    for i in 0..steps {
        let slot = [TokenSlot {
            seq: 0,
            pos: n_prompt + i,
        }];
        model
            .forward(&[tok], &slot, &[0], &mut cache, &mut scratch, &mut logits)
            .unwrap();
        let best = argmax(&logits);
        toks.push(best);
        all.push(logits.clone());
        tok = force.map_or(best, |f| f[i]);
    }
    (all, toks)
}

/// The model of `nvfp4_all_pages_decode_matches_dense_nvfp4`: FFN weights
/// from `exact_nvfp4_weights`, an artifact over them with a random channel
/// order and every page kept.
fn nvfp4_model() -> (Arc<Artifact>, Arc<GgufFile>) {
    let mut r = rng(31);
    let layers: Vec<LayerW> = (0..N_LAYER)
        .map(|_| LayerW {
            gate: exact_nvfp4_weights(&mut r, N_FF, D, 1.0 / 64.0),
            up: exact_nvfp4_weights(&mut r, N_FF, D, 1.0 / 64.0),
            down: exact_nvfp4_weights(&mut r, D, N_FF, 1.0 / 128.0),
        })
        .collect();
    let perms: Vec<Vec<u32>> = (0..N_LAYER).map(|_| random_perm(&mut r, N_FF)).collect();
    let art = artifact_from(&layers, &perms, N_PAGES, &mut r);
    (art, model_with_ffn(&layers, &mut r))
}

/// The GPU test's model on the CPU (no GPU needed): it loads and decodes,
/// and the CPU superblock backend over its permuted artifact (all pages)
/// follows the dense CPU decode (the artifact's pages are Q8_0 of the
/// permuted FFN: a wrong channel order would break this).
#[test]
fn nvfp4_test_model_decodes_on_the_cpu() {
    let (art, file) = nvfp4_model();
    let dense = Model::load(file.clone(), CpuBackend::new_f32_activations(1).unwrap()).unwrap();
    let sb = SuperblockBackend::new(
        CpuBackend::new_f32_activations(1).unwrap(),
        art,
        SparseMode::All,
    )
    .unwrap()
    .with_f32_activations();
    let sparse = Model::load(file, sb).unwrap();
    let (ld, td) = greedy(&dense, 4, None);
    let (ls, _) = greedy(&sparse, 4, Some(&td));
    let vocab = dense.config().vocab_size;
    assert!(ld
        .iter()
        .all(|l| l.len() == vocab && l.iter().all(|v| v.is_finite())));
    let worst = ld
        .iter()
        .zip(&ls)
        .map(|(a, b)| cosine(a, b))
        .fold(1.0f64, f64::min);
    let distinct = td.iter().collect::<std::collections::BTreeSet<_>>().len();
    eprintln!(
        "CPU: superblock (Q8_0 artifact pages) vs dense f32 worst cosine {worst:.6}, tokens {td:?}"
    );
    assert!(worst >= 0.999, "cosine {worst}");
    assert!(
        distinct >= 2,
        "the model should not repeat one token: {td:?}"
    );
}

/// A whole model decoded by the sparse backend with NVFP4 pages, every page
/// active, against the dense CUDA backend with NVFP4 weights (both with the
/// other matrices in NVFP4 too), greedy steps teacher-forced on the dense
/// tokens: last-logit cosine >= 0.9999 at every step. The FFN weights are
/// NVFP4-exact in both orientations (`exact_nvfp4_weights`), so the dense
/// W_down and the pages' W_downᵀ hold the same values and only the order of
/// the float sums differs; the artifact permutes the channels. The sparse
/// steps replay a CUDA graph.
#[test]
fn nvfp4_all_pages_decode_matches_dense_nvfp4() {
    let nvfp4 = CudaOptions {
        weights: WeightFormat::Nvfp4,
        ..CudaOptions::default()
    };
    let Some(dense_b) = cuda_with("nvfp4_all_pages_decode_matches_dense_nvfp4", &nvfp4) else {
        return;
    };
    let (art, file) = nvfp4_model();
    let dense = Model::load(file.clone(), dense_b).unwrap();
    let inner = CudaBackend::with_options(0, &nvfp4).unwrap();
    let sb = SparseCudaBackend::new(inner, PageSource::Artifact(art), SparsePages::All).unwrap();
    sb.set_page_format(PageFormat::Nvfp4).unwrap();
    let sparse = Model::load(file, sb).unwrap();
    let b = sparse.backend();
    assert_eq!(b.page_format(), PageFormat::Nvfp4);
    assert_eq!(
        b.page_shape(),
        vec![(N_PAGES, PageFormat::Nvfp4.page_bytes(D)); N_LAYER]
    );
    let steps = 8;
    let (ld, td) = greedy(&dense, steps, None);
    let before = b.inner().graph_stats();
    let (ls, ts) = greedy(&sparse, steps, Some(&td));
    let after = b.inner().graph_stats();
    let cos: Vec<f64> = ld.iter().zip(&ls).map(|(a, b)| cosine(a, b)).collect();
    let worst = cos.iter().copied().fold(1.0f64, f64::min);
    let agree = td.iter().zip(&ts).filter(|(a, b)| a == b).count();
    eprintln!(
        "NVFP4 sparse (all pages) vs dense NVFP4: per-step last-logit cosine {cos:.7?}, \
         worst {worst:.9}, argmax agreement {agree}/{steps}, graph replays {}",
        after.replays - before.replays
    );
    assert!(worst >= 0.9999, "worst step cosine {worst}");
    assert!(agree + 1 >= steps, "argmax agreement {agree}/{steps}");
    assert!(
        after.replays - before.replays >= steps as u64 - 2,
        "decode steps did not replay a graph: {before:?} -> {after:?}"
    );
}
