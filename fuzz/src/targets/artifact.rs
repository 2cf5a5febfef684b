//! Artifact bytes through the loader, then, when it loads, through
//! everything that uses it: its tables and pages, the check against the
//! model it was built from, and the superblock backend running a forward
//! pass of that model from its pages. The mutator edits one section (META
//! values, or section bytes) and recomputes the checksums, so mutants get
//! past them to the checks that follow.

use std::sync::{Arc, OnceLock};

use mirage_artifact::format::{assemble, sections};
use mirage_artifact::{build, Artifact, BuildOptions, SparseMode, SuperblockBackend};
use mirage_gguf::synth::TinyModel;
use mirage_gguf::GgufFile;
use mirage_runtime::{CpuBackend, Engine, EngineOptions};

use crate::{Rng, Target};

pub fn target() -> Target {
    Target {
        name: "artifact",
        about: "artifact load: META vs sections, tables, pages, source check, sparse forward pass",
        seeds: || vec![fixture().1.clone()],
        run,
        mutate: Some(mutate),
        dictionary: &[b"MIRAGEAF", b"MRRT"],
        max_len: 1 << 18,
    }
}

/// The tiny model the seed artifact was built from, and that artifact.
fn fixture() -> &'static (Arc<GgufFile>, Vec<u8>) {
    static FIXTURE: OnceLock<(Arc<GgufFile>, Vec<u8>)> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temporary folder");
        let path = dir.path().join("tiny.gguf");
        let model = TinyModel {
            n_ff: 256,
            ..TinyModel::default()
        };
        model.writer().unwrap().write_to_path(&path).unwrap();
        let options = BuildOptions {
            calib_name: "pangram".into(),
            calib_text: "The quick brown fox jumps over the lazy dog. ".repeat(8),
            max_calib_tokens: 96,
            slices: 2,
            predictor_rank: 4,
            threads: 1,
            ..BuildOptions::default()
        };
        let bytes = build(&path, &options, &mut |_| {}).expect("tiny artifact").bytes;
        let file = Arc::new(GgufFile::from_bytes(std::fs::read(&path).unwrap()).unwrap());
        (file, bytes)
    })
}

fn mutate(data: &mut Vec<u8>, rng: &mut Rng) {
    let Some((sha, bodies)) = sections(data) else {
        crate::mutate::havoc(data, &[], &[], 1 << 18, rng);
        return;
    };
    let mut bodies: Vec<Vec<u8>> = bodies.iter().map(|b| b.to_vec()).collect();
    let i = rng.below(bodies.len());
    if i == 0 && rng.one_in(2) {
        // META: one value replaced.
        if let Ok(serde_json::Value::Object(mut m)) = serde_json::from_slice(&bodies[0]) {
            let keys: Vec<String> = m.keys().cloned().collect();
            if !keys.is_empty() {
                let k = rng.pick(&keys).clone();
                let v = match rng.below(4) {
                    0 => serde_json::json!(rng.interesting()),
                    1 => serde_json::json!(rng.below(1000)),
                    2 => serde_json::json!(-1),
                    _ => serde_json::json!(rng.pick(&["", "llama", "qwen2", "x"])),
                };
                m.insert(k, v);
                bodies[0] = serde_json::to_vec(&m).unwrap();
            }
        }
    } else {
        // Other sections are u32/u64/f32 tables: write integers at aligned offsets too.
        let b = &mut bodies[i];
        if !b.is_empty() && rng.one_in(2) {
            let at = rng.below(b.len()) & !3;
            let v = rng.interesting().to_le_bytes();
            let end = (at + 4 * (1 + rng.below(2))).min(b.len());
            b[at..end].copy_from_slice(&v[..end - at]);
        } else {
            crate::mutate::havoc(b, &[], &[], 1 << 17, rng);
        }
    }
    let refs: Vec<&[u8]> = bodies.iter().map(|b| b.as_slice()).collect();
    *data = assemble(&sha, refs.try_into().expect("6 sections"));
}

fn run(data: &[u8]) {
    let Ok(a) = Artifact::from_bytes(data.to_vec()) else {
        return;
    };
    let m = a.meta().clone();
    for l in 0..m.n_layer {
        let ld = a.layer(l);
        for p in 0..ld.n_pages {
            std::hint::black_box(a.page(l, p).first());
        }
        std::hint::black_box(a.page_prefix(l, ld.n_pages).len());
        let _ = a.router_with_margin(l, m.default_margin);
    }
    let (model, _) = fixture();
    if a.check_source(model).is_err() {
        return;
    }
    // One sparse mode per input (chosen by its bytes): all pages, the BVH
    // router, or the predictor.
    let mode = match data.len() % 3 {
        0 => SparseMode::All,
        1 => SparseMode::Bvh {
            margin: m.default_margin,
        },
        _ => SparseMode::Predictor {
            threshold: m.default_predictor_threshold,
        },
    };
    let cpu = CpuBackend::new(1).expect("1 thread");
    let Ok(backend) = SuperblockBackend::new(cpu, a, mode) else {
        return;
    };
    let options = EngineOptions {
        threads: 1,
        n_ctx: 16,
        ..EngineOptions::default()
    };
    if let Ok(engine) = Engine::from_file(model.clone(), backend, options) {
        if let Ok(mut s) = engine.session() {
            let _ = s.feed(&[1, 2, 3]);
        }
    }
}
