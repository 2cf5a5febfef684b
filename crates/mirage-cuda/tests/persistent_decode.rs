//! The persistent decode step (`DecodeMode::Persistent`: every decode step
//! one launch working through a task schedule) against the CUDA-graph step
//! of the same model: worst per-step logits cosine >= 0.99999 and the same
//! greedy tokens over 64 steps, every decode step run persistently. On the
//! test models (Q8_0, and the Q4_K/Q6_K/Q5_0 mix of a Q4_K_M file; f16 KV
//! cache) and, when `MIRAGE_PERSISTENT_MODELS` lists GGUF files
//! (comma-separated; the GPU script passes synthetic Qwen2.5-0.5B Q8_0 and
//! 7B Q4_K files), on those. Without a GPU every test prints why it skips
//! and passes.

use std::sync::Arc;

use mirage_cuda::{CudaBackend, CudaOptions, DecodeMode};
use mirage_gguf::{GgmlType, GgufFile};
use mirage_runtime::kv_cache::KvDtype;
use mirage_runtime::Model;

mod common;
use common::{bits_differ, cuda, greedy_run, worst_cosine, Greedy, Tiny};

const STEPS: usize = 64;

fn load(file: Arc<GgufFile>, decode: DecodeMode) -> Model<CudaBackend> {
    let options = CudaOptions {
        decode,
        ..CudaOptions::default()
    };
    Model::load(file, CudaBackend::with_options(0, &options).unwrap()).unwrap()
}

/// Decodes `file` both ways and checks the persistent path against the
/// graph path; `what` names the model in the messages.
fn compare(what: &str, file: Arc<GgufFile>, prompt: usize) {
    let graph = load(file.clone(), DecodeMode::Graph);
    let persistent = load(file, DecodeMode::Persistent);
    let vocab = graph.config().vocab_size;
    let g = Greedy {
        prompt,
        steps: STEPS,
        kv: KvDtype::F16,
        ..Greedy::default()
    };
    let (a, ta) = greedy_run(&graph, g);
    let before = persistent.backend().graph_stats();
    let t = std::time::Instant::now();
    let (b, tb) = greedy_run(&persistent, g);
    let after = persistent.backend().graph_stats();
    let worst = worst_cosine(&a, &b, vocab);
    eprintln!(
        "{what}: persistent vs graph worst step cosine {worst:.9}, {} of {} logits differ in bits, \
         {} persistent steps, {} graph steps ({:.1} s)",
        bits_differ(&a, &b),
        a.len(),
        after.persistent - before.persistent,
        (after.captures + after.replays) - (before.captures + before.replays),
        t.elapsed().as_secs_f64()
    );
    assert_eq!(ta, tb, "{what}: greedy tokens");
    assert!(worst >= 0.99999, "{what}: cosine {worst}");
    assert_eq!(
        after.persistent - before.persistent,
        STEPS as u64,
        "{what}: every decode step persistent"
    );
}

#[test]
fn persistent_steps_equal_graph_steps_on_test_models() {
    let test = "persistent_steps_equal_graph_steps_on_test_models";
    let Some(probe) = cuda(test) else {
        return;
    };
    drop(probe);
    let mixes = [
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
    for types in mixes {
        let file = Tiny {
            types,
            ..Tiny::Q8_BIASED
        }
        .build(29);
        compare(&format!("tiny {types:?}"), file, 20);
    }
}

#[test]
fn persistent_steps_equal_graph_steps_on_listed_models() {
    let test = "persistent_steps_equal_graph_steps_on_listed_models";
    let list = std::env::var("MIRAGE_PERSISTENT_MODELS").unwrap_or_default();
    if list.is_empty() {
        eprintln!("{test}: skipped, MIRAGE_PERSISTENT_MODELS lists no GGUF files");
        return;
    }
    let Some(probe) = cuda(test) else {
        return;
    };
    drop(probe);
    for path in list.split(',').filter(|p| !p.is_empty()) {
        let file = Arc::new(GgufFile::open(path).unwrap_or_else(|e| panic!("{path}: {e}")));
        compare(path, file, 20);
    }
}
