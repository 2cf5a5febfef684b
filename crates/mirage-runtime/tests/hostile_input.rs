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

fn sampling(
    edit: impl FnOnce(&mut mirage_runtime::SamplingParams),
) -> mirage_runtime::SamplingParams {
    let mut p = mirage_runtime::SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.05,
        ..mirage_runtime::SamplingParams::default()
    };
    edit(&mut p);
    p
}

#[test]
fn sampling_parameters_out_of_range_are_refused_naming_the_field() {
    use mirage_runtime::SamplingParams as S;
    assert!(S::default().validate().is_ok());
    assert!(sampling(|_| {}).validate().is_ok());
    assert!(sampling(|p| p.temperature = 0.0).validate().is_ok());
    assert!(sampling(|p| p.top_p = 1.0).validate().is_ok());
    type Edit = fn(&mut S);
    let cases: [(&str, Edit); 14] = [
        ("temperature", |p| p.temperature = f32::NAN),
        ("temperature", |p| p.temperature = -1.0),
        ("temperature", |p| p.temperature = f32::INFINITY),
        ("top_p", |p| p.top_p = 5.0),
        ("top_p", |p| p.top_p = 0.0),
        ("top_p", |p| p.top_p = f32::NAN),
        ("min_p", |p| p.min_p = -0.1),
        ("min_p", |p| p.min_p = 1.5),
        ("repeat_penalty", |p| p.repeat_penalty = 0.0),
        ("repeat_penalty", |p| p.repeat_penalty = f32::NAN),
        ("presence_penalty", |p| p.presence_penalty = f32::INFINITY),
        ("frequency_penalty", |p| p.frequency_penalty = f32::NAN),
        ("presence_penalty", |p| p.presence_penalty = -1e9),
        ("frequency_penalty", |p| p.frequency_penalty = 1e9),
    ];
    for (field, edit) in cases {
        let p = sampling(edit);
        let msg = p
            .validate()
            .expect_err(&format!("{p:?} accepted"))
            .to_string();
        assert!(msg.contains(field), "{field}: {msg}");
    }
}

#[test]
fn generation_and_batching_refuse_bad_sampling_parameters() {
    let engine = Engine::from_file(tiny(|_| {}), cpu(), options(256)).unwrap();
    let params = mirage_runtime::GenerateParams {
        sampling: sampling(|p| p.temperature = f32::NAN),
        ..mirage_runtime::GenerateParams::default()
    };
    let mut s = engine.session().unwrap();
    let e = s.generate("hi", &params, |_| true).unwrap_err().to_string();
    assert!(e.contains("temperature"), "{e}");
    assert!(s.tokens().is_empty(), "nothing ran");
    let mut b = mirage_runtime::batch::Batcher::new(&engine, 2, 64).unwrap();
    let e = b.add(vec![1, 2, 3], &params).unwrap_err().to_string();
    assert!(e.contains("temperature"), "{e}");
    assert_eq!(b.active(), 0);
}

#[test]
fn more_threads_than_cpus_are_refused_naming_both() {
    let cpus = std::thread::available_parallelism().unwrap().get();
    let e = CpuBackend::new(cpus + 1).unwrap_err().to_string();
    assert!(
        e.contains(&(cpus + 1).to_string()) && e.contains(&cpus.to_string()),
        "{e}"
    );
    assert_eq!(CpuBackend::new(cpus).unwrap().threads(), cpus);
    assert_eq!(CpuBackend::new(0).unwrap().threads(), cpus);
}

#[test]
fn a_broken_chat_template_is_reported_as_broken_not_as_missing() {
    let chat = [mirage_tokenizer::ChatMessage::new("user", "hi")];
    let broken = TinyModel {
        chat_template: Some("{% for m in messages %}{{ m.content }".into()),
        ..TinyModel::default()
    };
    let engine = Engine::from_file(tiny_with(&broken, |_| {}), cpu(), options(256)).unwrap();
    assert!(engine.chat_template().is_none());
    let e = engine.render_chat(&chat).unwrap_err().to_string();
    assert!(
        e.contains("chat template error") && e.contains("syntax error"),
        "{e}"
    );
    assert!(!e.contains("no chat template"), "{e}");

    let none = TinyModel {
        chat_template: None,
        ..TinyModel::default()
    };
    let engine = Engine::from_file(tiny_with(&none, |_| {}), cpu(), options(256)).unwrap();
    let e = engine.render_chat(&chat).unwrap_err().to_string();
    assert!(e.contains("no chat template"), "{e}");

    // A template in the file that doubles a string forty times.
    let doubling = TinyModel {
        chat_template: Some("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}".into()),
        ..TinyModel::default()
    };
    let engine = Engine::from_file(tiny_with(&doubling, |_| {}), cpu(), options(256)).unwrap();
    let e = engine.render_chat(&chat).unwrap_err().to_string();
    assert!(
        e.contains("chat template error") && e.contains("limit"),
        "{e}"
    );
}
