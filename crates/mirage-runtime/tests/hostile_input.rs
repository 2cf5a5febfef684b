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
