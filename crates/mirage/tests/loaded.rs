//! The facade's one engine type on the real SmolLM2 model: it generates
//! what the runtime's CPU engine generates (greedy), as a callback, an
//! iterator and (feature `async`) a `Stream`; its sessions move into
//! threads; grammars, embeddings and errors go through it.

use std::path::PathBuf;

use mirage::{
    BackendChoice, Engine, EngineOptions, Error, GenerateParams, GrammarSpec, LoadError,
    LoadedEngine, LoadedSession, SamplingParams,
};

fn model_path() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/smollm2-135m-instruct-q4_1.gguf");
    if p.exists() {
        return Some(p);
    }
    if std::env::var("MIRAGE_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!(
            "skipping: {} is missing and MIRAGE_SKIP_MODEL_TESTS=1",
            p.display()
        );
        return None;
    }
    panic!("{} is missing: run `cargo xtask fetch-models`", p.display());
}

fn greedy(max_tokens: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        sampling: SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        ..Default::default()
    }
}

const PROMPT: &str = "The capital of France is";

#[test]
fn one_engine_type_generates_streams_and_moves_into_threads() {
    let Some(path) = model_path() else { return };
    let engine = LoadedEngine::load(&path, BackendChoice::Cpu).unwrap();
    assert_eq!(engine.backend_name(), "cpu");
    let params = greedy(12);
    // The runtime's own CPU engine is the reference.
    let reference = Engine::load(&path, EngineOptions::default())
        .unwrap()
        .session()
        .unwrap()
        .generate(PROMPT, &params, |_| true)
        .unwrap();
    let mut session = engine.session().unwrap();
    let mut seen = String::new();
    let out = session
        .generate(PROMPT, &params, |t| {
            seen.push_str(t);
            true
        })
        .unwrap();
    assert_eq!(out.text, reference.text);
    assert_eq!(seen, out.text);
    assert_eq!(out.tokens, reference.tokens);

    // The iterator: same pieces, and the session comes back with the conversation.
    let stream = engine.session().unwrap().stream(PROMPT, &params).unwrap();
    let mut pieces = Vec::new();
    let mut stream = stream;
    for p in stream.by_ref() {
        pieces.push(p.unwrap());
    }
    let (session2, generation) = stream.finish();
    let text: String = pieces.iter().map(|p| p.text.as_str()).collect();
    assert_eq!(text, reference.text);
    assert_eq!(generation.tokens, reference.tokens);
    assert!(session2.tokens().len() >= engine.encode(PROMPT, true).unwrap().len());

    // Sessions and streams own what they need: they move into threads.
    fn owned<T: Send + 'static>(_: &T) {}
    owned(&session2);
    owned(&engine);
    // Four at once on one engine: the CPU backend runs one pass in its pool
    // at a time (passes from several threads used to deadlock there).
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let s: LoadedSession = engine.session().unwrap();
            let p = params.clone();
            std::thread::spawn(move || {
                let mut s = s;
                s.generate(PROMPT, &p, |_| true).unwrap().text
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), reference.text);
    }
}

#[test]
fn grammars_embeddings_and_errors_go_through_the_facade() {
    let Some(path) = model_path() else { return };
    let engine = LoadedEngine::load(&path, BackendChoice::Cpu).unwrap();
    let schema = serde_json::json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                                    "required": ["city"], "additionalProperties": false});
    let params = GenerateParams {
        constraint: Some(engine.grammar(&GrammarSpec::JsonSchema(schema)).unwrap()),
        ..greedy(40)
    };
    let out = engine
        .session()
        .unwrap()
        .generate("Paris is a city. As JSON:", &params, |_| true)
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&out.text).unwrap();
    assert!(v["city"].is_string(), "{}", out.text);
    let e = engine
        .grammar(&GrammarSpec::Gbnf("root ::= (".into()))
        .unwrap_err();
    assert!(matches!(e, Error::Grammar(_)), "{e:?}");

    let texts = ["a cat on a mat", "a cat on a rug", "tax deadlines"];
    let vs = engine.embed(&texts).unwrap();
    let reference = Engine::load(&path, EngineOptions::default())
        .unwrap()
        .embed(&texts)
        .unwrap();
    for (v, r) in vs.iter().zip(&reference) {
        let norm: f32 = v.iter().map(|x| x * x).sum();
        assert!((norm - 1.0).abs() < 1e-4);
        assert_eq!(v, r);
    }

    let e = LoadedEngine::load("no/such/model.gguf", BackendChoice::Cpu).unwrap_err();
    assert!(matches!(e, Error::Load(LoadError::Model { .. })), "{e:?}");
    assert!(e.to_string().contains("no/such/model.gguf"), "{e}");
}

#[cfg(feature = "async")]
#[test]
fn a_generation_is_an_async_stream() {
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake};

    /// Polls `stream` to its end on this thread, parking between wakes.
    fn collect<S: futures_core::Stream + Unpin>(mut stream: S) -> Vec<S::Item> {
        struct Unpark(std::thread::Thread);
        impl Wake for Unpark {
            fn wake(self: Arc<Self>) {
                self.0.unpark();
            }
        }
        let waker = Arc::new(Unpark(std::thread::current())).into();
        let mut cx = Context::from_waker(&waker);
        let mut out = Vec::new();
        loop {
            match Pin::new(&mut stream).poll_next(&mut cx) {
                Poll::Ready(Some(x)) => out.push(x),
                Poll::Ready(None) => return out,
                Poll::Pending => std::thread::park(),
            }
        }
    }

    let Some(path) = model_path() else { return };
    let engine = LoadedEngine::load(&path, BackendChoice::Cpu).unwrap();
    let params = greedy(12);
    let reference = engine
        .session()
        .unwrap()
        .generate(PROMPT, &params, |_| true)
        .unwrap();
    let mut stream = engine
        .session()
        .unwrap()
        .stream(PROMPT, &params)
        .unwrap()
        .into_async();
    let pieces = collect(&mut stream);
    let text: String = pieces.into_iter().map(|p| p.unwrap().text).collect();
    assert_eq!(text, reference.text);
    let (_session, generation) = stream.finish();
    assert_eq!(generation.tokens, reference.tokens);
}
