//! Hostile and careless input to the runtime's load path: every case is a
//! typed error that names the problem, never an abort or a huge allocation.
//! The models are tiny synthetic ones (`mirage_gguf::synth::TinyModel`).

use std::sync::Arc;

use mirage_gguf::synth::TinyModel;
use mirage_gguf::{GgufFile, Metadata, Value};
use mirage_runtime::{CpuBackend, Engine, EngineOptions, Model};

fn tiny_with(model: &TinyModel, edit: impl FnOnce(&mut Metadata)) -> Arc<GgufFile> {
    let mut w = model.writer().unwrap();
    edit(w.metadata_mut());
    let mut out = Vec::new();
    w.write_to(&mut out).unwrap();
    Arc::new(GgufFile::from_bytes(out).unwrap())
}

fn tiny(edit: impl FnOnce(&mut Metadata)) -> Arc<GgufFile> {
    tiny_with(&TinyModel::default(), edit)
}

fn cpu() -> CpuBackend {
    CpuBackend::new(1).unwrap()
}

fn load_err(file: Arc<GgufFile>, options: EngineOptions) -> String {
    match Engine::from_file(file, cpu(), options) {
        Ok(_) => panic!("loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn the_tiny_model_loads_and_generates() {
    let engine = Engine::from_file(tiny(|_| {}), cpu(), EngineOptions::default()).unwrap();
    let mut s = engine.session().unwrap();
    let out = s
        .generate("hi", &mirage_runtime::GenerateParams::default(), |_| true)
        .unwrap();
    assert!(out.stats.generated_tokens > 0);
}

#[test]
fn a_huge_block_count_is_refused_before_any_allocation() {
    for n in [u32::MAX as u64, u64::MAX >> 1, 3] {
        let f = tiny(|md| {
            md.insert("llama.block_count", Value::U64(n));
        });
        let msg = load_err(f.clone(), EngineOptions::default());
        assert!(
            msg.contains("llama.block_count") && msg.contains(&n.to_string()),
            "{msg}"
        );
        assert!(Model::load(f, cpu()).is_err());
    }
}

#[test]
fn a_huge_feed_forward_length_is_refused() {
    let f = tiny(|md| {
        md.insert("llama.feed_forward_length", Value::U64(1 << 40));
    });
    let msg = load_err(f, EngineOptions::default());
    assert!(msg.contains("llama.feed_forward_length"), "{msg}");
}

fn options(n_ctx: usize) -> EngineOptions {
    EngineOptions {
        n_ctx,
        ..EngineOptions::default()
    }
}

#[test]
fn a_context_beyond_the_trained_one_is_refused_naming_both() {
    // TinyModel is trained on 256 positions.
    Engine::from_file(tiny(|_| {}), cpu(), options(256)).unwrap();
    let msg = load_err(tiny(|_| {}), options(1_000_000_000));
    assert!(msg.contains("1000000000") && msg.contains("256"), "{msg}");
    let msg = load_err(tiny(|_| {}), options(257));
    assert!(msg.contains("257") && msg.contains("256"), "{msg}");
}

#[test]
fn rope_scaling_in_the_file_extends_the_context_it_allows() {
    let scaled = || {
        tiny(|md| {
            md.insert("llama.rope.scaling.type", Value::String("linear".into()));
            md.insert("llama.rope.scaling.factor", Value::F32(4.0));
        })
    };
    let engine = Engine::from_file(scaled(), cpu(), options(1024)).unwrap();
    assert_eq!(engine.n_ctx(), 1024);
    let msg = load_err(scaled(), options(1025));
    assert!(
        msg.contains("1025") && msg.contains("1024") && msg.contains("RoPE"),
        "{msg}"
    );
}

#[test]
fn a_kv_cache_larger_than_memory_is_refused_naming_the_sizes() {
    let engine = Engine::from_file(tiny(|_| {}), cpu(), options(256)).unwrap();
    // 2 layers x 2 (K, V) x 16 floats x 256 positions x 4 bytes = 64 KiB a
    // sequence: 10^9 sequences need 65.5 TB.
    let e = match mirage_runtime::batch::Batcher::new(&engine, 1_000_000_000, 64) {
        Ok(_) => panic!("a 65 TB KV cache was allocated"),
        Err(e) => e,
    };
    let msg = e.to_string();
    assert!(
        matches!(e, mirage_runtime::RuntimeError::OutOfMemory { .. }),
        "{msg}"
    );
    assert!(msg.contains("KV cache") && msg.contains("65.5 TB"), "{msg}");
    // The model's own cache constructor (used beyond the engine, e.g. by
    // long-context evaluation) refuses a huge context the same way.
    let model = Model::load(tiny(|_| {}), cpu()).unwrap();
    let kv = mirage_runtime::KvDtype::F32;
    assert!(matches!(
        model.new_kv_cache(usize::MAX / 64, 1, kv),
        Err(mirage_runtime::RuntimeError::OutOfMemory { .. }
            | mirage_runtime::RuntimeError::InvalidArgument(_))
    ));
    assert!(matches!(
        model.new_kv_cache(1 << 40, 1, kv),
        Err(mirage_runtime::RuntimeError::OutOfMemory { .. })
    ));
}
