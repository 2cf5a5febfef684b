//! A model file through everything that loads it: hyperparameters and their
//! check against the tensor table, the tokenizer (encode, decode), the chat
//! template (compile, render), the engine on the CPU backend (weights,
//! KV cache) and one forward pass. Every failure must be an error.

use std::sync::Arc;

use mirage_gguf::synth::TinyModel;
use mirage_gguf::{GgufFile, ModelHparams, Value};
use mirage_runtime::{CpuBackend, Engine, EngineOptions};
use mirage_tokenizer::{ChatMessage, ChatTemplate, Tokenizer};

use crate::{Rng, Target};

pub fn target() -> Target {
    Target {
        name: "gguf_model",
        about: "model load: hparams vs tensors, tokenizer, chat template, engine, one forward pass",
        seeds,
        run,
        mutate: Some(mutate),
        dictionary: &[b"blk.", b"llama.", b"tokenizer.ggml.", b"{{", b"}}", b"{%", b"%}"],
        max_len: 1 << 16,
    }
}

fn tiny() -> TinyModel {
    crate::structure::tiny_model()
}

fn seeds() -> Vec<Vec<u8>> {
    let with = |edit: &dyn Fn(&mut mirage_gguf::Metadata)| {
        let mut w = tiny().writer().unwrap();
        edit(w.metadata_mut());
        let mut out = Vec::new();
        w.write_to(&mut out).unwrap();
        out
    };
    vec![
        with(&|_| {}),
        with(&|md| {
            md.insert("llama.rope.scaling.type", Value::String("yarn".into()));
            md.insert("llama.rope.scaling.factor", Value::F32(4.0));
        }),
        with(&|md| {
            md.remove("tokenizer.chat_template");
        }),
        TinyModel {
            n_layer: 1,
            chat_template: Some("{% for m in messages %}{{ m.role ~ ': ' ~ m.content|trim }}\n{% endfor %}".into()),
            ..tiny()
        }
        .to_bytes()
        .unwrap(),
    ]
}

fn mutate(data: &mut Vec<u8>, rng: &mut Rng) {
    let before = data.clone();
    if !crate::structure::mutate_gguf(data, rng) {
        *data = before;
        crate::mutate::havoc(data, &[], &[], 1 << 16, rng);
    }
}

fn run(data: &[u8]) {
    let Ok(f) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    let f = Arc::new(f);
    if let Ok(hp) = ModelHparams::from_metadata(&f) {
        let _ = hp.tensor_mismatches(&f);
    }
    let chat = [ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "hi")];
    let text = "Hi <|im_start|>there 123 ÿ\u{1F600}";
    let options = EngineOptions {
        threads: 1,
        n_ctx: 16,
        n_batch: 4,
        ..EngineOptions::default()
    };
    match Engine::from_file(f.clone(), CpuBackend::new(1).expect("1 thread"), options) {
        Ok(engine) => {
            if let Ok(ids) = engine.encode(text, true) {
                let _ = engine.tokenizer().decode(&ids, false);
            }
            let _ = engine.render_chat(&chat);
            if let Ok(mut s) = engine.session() {
                let vocab = engine.model().config().vocab_size as u32;
                let _ = s.feed(&[0, 1, vocab.saturating_sub(1)]);
                let _ = s.feed(&[vocab]);
            }
        }
        // What the engine did not get to.
        Err(_) => {
            if let Ok(tok) = Tokenizer::from_gguf(&f) {
                if let Ok(ids) = tok.encode(text, true, true) {
                    let _ = tok.decode(&ids, false);
                }
                let _ = tok.decode(&[0, 1, u32::MAX], true);
            }
            if let Ok(t) = ChatTemplate::from_gguf(&f) {
                let _ = t.render(&chat, true);
            }
        }
    }
}
