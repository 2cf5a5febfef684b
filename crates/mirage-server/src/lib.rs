//! `mirage-server`'s library: an OpenAI-compatible HTTP server for GGUF
//! models with continuous batching, Prometheus metrics and a chat page at
//! `/`. The binary (`src/main.rs`) parses flags and wires these together;
//! the request checks are pure functions here so that tests and fuzzers can
//! call them without a model ([`fuzz_request`]).
#![deny(missing_docs)]

pub mod access;
pub mod api;
pub mod body;
pub mod conn;
pub mod error;
pub mod metrics;
pub mod routes;
pub mod scheduler;
pub mod structured;
pub mod unsupported;

/// Fuzz target "JSON body to a validated request": runs `bytes` through
/// the checks of both generation endpoints exactly as the handlers do
/// ([`api::validate_chat`], [`api::validate_completion`]) and checks what
/// comes out: a request either validates, within the context, or is
/// refused with a 4xx whose body is the OpenAI error JSON. The same for
/// the embeddings endpoint ([`api::validate_embeddings`]). Panics only when
/// that does not hold (or when a check panics), which is what a fuzzer
/// looks for.
pub fn fuzz_request(bytes: &[u8]) {
    const N_CTX: usize = 512;
    let refused = |e: &error::ApiError| {
        assert!(e.status.is_client_error(), "{e:?}");
        let v: serde_json::Value =
            serde_json::from_str(&e.body_json()).expect("error body is JSON");
        assert!(v["error"]["message"].is_string(), "{v}");
        assert!(v["error"]["type"].is_string(), "{v}");
    };
    let budget = |c: &api::Checked| {
        assert!(c.params.max_tokens < N_CTX, "{:?}", c.params);
        let s = &c.params.sampling;
        assert!((0.0..=2.0).contains(&s.temperature), "{s:?}");
        assert!(s.top_p > 0.0 && s.top_p <= 1.0, "{s:?}");
        assert!(c.params.stop.len() <= 4);
    };
    match api::validate_chat(bytes, N_CTX, 7) {
        Ok(v) => {
            assert!(!v.messages.is_empty());
            budget(&v.checked);
        }
        Err(e) => refused(&e),
    }
    match api::validate_completion(bytes, N_CTX, 7) {
        Ok(v) => {
            match &v.prompt {
                api::Prompt::Text(t) => assert!(!t.is_empty()),
                api::Prompt::Tokens(t) => assert!(!t.is_empty()),
                api::Prompt::Chat(_) | api::Prompt::ChatJson { .. } => {
                    panic!("a completion became a chat")
                }
            }
            budget(&v.checked);
        }
        Err(e) => refused(&e),
    }
    match api::validate_embeddings(bytes, 8) {
        Ok((structured::EmbeddingInput::Texts(t), _)) => {
            assert!(!t.is_empty() && t.len() <= 8 && t.iter().all(|s| !s.is_empty()))
        }
        Ok((structured::EmbeddingInput::Tokens(t), _)) => {
            assert!(!t.is_empty() && t.len() <= 8 && t.iter().all(|s| !s.is_empty()))
        }
        Err(e) => refused(&e),
    }
}
