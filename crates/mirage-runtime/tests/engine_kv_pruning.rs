//! KV pruning as an engine option: `EngineOptions::kv_pruning` reaches the
//! caches of sessions and batchers, and the `--kv-prune` syntax parses.

mod common;
use common::model_path;
use std::path::PathBuf;

use mirage_runtime::{Engine, EngineOptions, KvPruning};

#[test]
fn kv_prune_syntax() {
    assert_eq!(
        "default".parse::<KvPruning>().unwrap(),
        KvPruning::default()
    );
    assert_eq!(
        "all".parse::<KvPruning>().unwrap(),
        KvPruning::all_pages(64)
    );
    let c: KvPruning = "top=16, dense=2,page=32".parse().unwrap();
    assert_eq!(
        c,
        KvPruning {
            page: 32,
            top_pages: 16,
            dense_layers: 2,
            ..KvPruning::default()
        }
    );
    let grows: KvPruning = "top_percent=25".parse().unwrap();
    assert_eq!(
        (grows.top_for(10), grows.top_for(100), grows.top_for(101)),
        (8, 25, 26)
    );
    assert_eq!(grows.max_selected_for(512), 1 + 2 + 128);
    for bad in ["top", "top=x", "pages=3", "page=0", "top_percent=101"] {
        assert!(bad.parse::<KvPruning>().is_err(), "{bad} accepted");
    }
}

/// Logits after feeding `prompt` then one more token, one session of an
/// engine with `pruning`.
fn last_logits(path: &PathBuf, pruning: Option<KvPruning>, prompt: &[u32], next: u32) -> Vec<f32> {
    let opts = EngineOptions {
        threads: 2,
        n_ctx: 512,
        kv_pruning: pruning,
        ..EngineOptions::default()
    };
    let engine = Engine::load(path, opts).unwrap();
    let mut s = engine.session().unwrap();
    s.feed(prompt).unwrap();
    s.feed(&[next]).unwrap().to_vec()
}

#[test]
fn engine_option_reaches_the_session_cache() {
    let Some(path) = model_path("smollm2-135m-instruct-q4_1.gguf") else {
        return;
    };
    let engine = Engine::load(
        &path,
        EngineOptions {
            threads: 2,
            n_ctx: 512,
            ..EngineOptions::default()
        },
    )
    .unwrap();
    let text = include_str!("../src/engine.rs");
    let mut prompt = engine.encode(text, false).unwrap();
    prompt.truncate(300);
    drop(engine);
    let full = last_logits(&path, None, &prompt, 42);
    // Every page selected: the page path, same numbers as full attention.
    let all = last_logits(&path, Some(KvPruning::all_pages(16)), &prompt, 42);
    assert_eq!(full, all, "every page selected must equal full attention");
    // Only the newest 16-position page: a different computation, so the
    // option really reached the cache the decode step used.
    let tight = KvPruning {
        page: 16,
        sink_pages: 0,
        recent_pages: 1,
        top_pages: 0,
        top_percent: 0,
        dense_layers: 0,
    };
    let pruned = last_logits(&path, Some(tight), &prompt, 42);
    let max_diff = full
        .iter()
        .zip(&pruned)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        max_diff > 1e-2,
        "a 16-position window left the logits unchanged ({max_diff})"
    );
}
