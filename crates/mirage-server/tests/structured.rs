//! End-to-end tests of structured output on the `mirage-server` binary
//! with SmolLM2: `response_format` (json_schema, json_object), tool calls
//! (`tools` / `tool_choice`, tool messages, streamed tool-call deltas),
//! `logprobs` / `top_logprobs` on both generation endpoints, streaming
//! too, and `/v1/embeddings`. The log-probabilities are checked against a
//! log-softmax computed here from the engine's logits, the embeddings
//! against `Engine::embed`.

mod common;

use base64::Engine as _;
use common::*;
use mirage_runtime::{Engine, EngineOptions};
use serde_json::{json, Value};

fn chat(srv: &Server, body: Value) -> Response {
    srv.post("/v1/chat/completions", &body)
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// The content deltas, tool-call deltas, logprob entries and finish
/// reason of a streamed chat answer.
struct Streamed {
    content: String,
    calls: Vec<Value>,
    logprobs: Vec<Value>,
    finish: Option<String>,
}

fn streamed(r: &Response) -> Streamed {
    assert_eq!(r.status, 200, "{}", r.body);
    let mut s = Streamed {
        content: String::new(),
        calls: Vec::new(),
        logprobs: Vec::new(),
        finish: None,
    };
    let events = r.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        for c in v["choices"].as_array().unwrap() {
            if let Some(t) = c["delta"]["content"].as_str() {
                s.content.push_str(t);
            }
            for call in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
                s.calls.push(call.clone());
            }
            for l in c["logprobs"]["content"].as_array().into_iter().flatten() {
                s.logprobs.push(l.clone());
            }
            if let Some(f) = c["finish_reason"].as_str() {
                s.finish = Some(f.to_string());
            }
        }
    }
    s
}

const PERSON: &str = r#"{"type": "object",
    "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0},
                   "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": false}"#;

/// What the schema asks for, checked by hand.
fn is_person(v: &Value) -> bool {
    let Some(o) = v.as_object() else { return false };
    o.len() == 3
        && o["name"].as_str().is_some_and(|n| n.chars().count() <= 30)
        && o["age"].as_u64().is_some()
        && o["tags"].as_array().is_some_and(|t| {
            t.len() <= 3
                && t.iter()
                    .all(|x| ["a", "b", "c"].contains(&x.as_str().unwrap_or("")))
        })
}

#[test]
fn response_format_holds_output_to_the_schema() {
    let Some(model) = model() else { return };
    let srv = Server::start(&model, &[]);
    let schema: Value = serde_json::from_str(PERSON).unwrap();
    let format = json!({"type": "json_schema", "json_schema": {"name": "person", "strict": true, "schema": schema}});
    for (i, prompt) in [
        "Describe a teacher from Oslo.",
        "Who wrote Hamlet?",
        "Write a poem about the sea.",
    ]
    .iter()
    .enumerate()
    {
        let r = chat(
            &srv,
            json!({"messages": user(prompt), "max_tokens": 80, "temperature": if i == 0 { 0.0 } else { 0.8 },
                   "seed": i, "response_format": format}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let j = r.json();
        let text = j["choices"][0]["message"]["content"].as_str().unwrap();
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(is_person(&v), "{text}");
        assert_eq!(j["choices"][0]["finish_reason"], "stop");
    }
    // Streaming gives the same greedy text.
    let body = json!({"messages": user("Describe a teacher from Oslo."), "max_tokens": 80, "temperature": 0,
                      "response_format": format});
    let whole = chat(&srv, body.clone()).json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let mut sb = body;
    sb["stream"] = json!(true);
    assert_eq!(streamed(&chat(&srv, sb)).content, whole);
    // json_object: any object.
    let r = chat(
        &srv,
        json!({"messages": user("Give me a JSON object with the name and age of a cat."), "max_tokens": 200,
               "temperature": 0, "response_format": {"type": "json_object"}}),
    );
    let j = r.json();
    let text = j["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        serde_json::from_str::<Value>(text).unwrap().is_object(),
        "{text}"
    );
    // A schema the compiler refuses, and a malformed format, are 400s naming the field.
    for (format, param) in [
        (
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]}}}),
            "response_format",
        ),
        (json!({"type": "yaml"}), "response_format.type"),
    ] {
        let r = chat(
            &srv,
            json!({"messages": user("hi"), "max_tokens": 4, "response_format": format}),
        );
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.error()["param"], param, "{}", r.body);
    }
    assert!(srv.terminate().success());
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
         "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                        "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
         "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                        "required": ["city"], "additionalProperties": false}}}
    ])
}

/// (name, arguments) of calls, checked for shape.
fn calls_of(calls: &[Value]) -> Vec<(String, String)> {
    calls
        .iter()
        .map(|c| {
            assert_eq!(c["type"], "function", "{c}");
            assert!(c["id"].as_str().is_some_and(|i| !i.is_empty()), "{c}");
            let args = c["function"]["arguments"].as_str().unwrap();
            let parsed: Value = serde_json::from_str(args).unwrap();
            assert!(parsed["city"].is_string(), "{args}");
            (
                c["function"]["name"].as_str().unwrap().to_string(),
                args.to_string(),
            )
        })
        .collect()
}

#[test]
fn tool_calls_round_trip_streaming_and_not() {
    let Some(model) = model() else { return };
    let srv = Server::start(&model, &[]);
    let q = user("What is the weather in Paris right now?");
    let ask = |choice: Value, stream: bool| {
        json!({"messages": q, "tools": tools(), "tool_choice": choice, "max_tokens": 80, "temperature": 0,
               "stream": stream})
    };
    // required: calls only, parsed, finish_reason tool_calls.
    let r = chat(&srv, ask(json!("required"), false));
    assert_eq!(r.status, 200, "{}", r.body);
    let j = r.json();
    let msg = &j["choices"][0]["message"];
    assert_eq!(j["choices"][0]["finish_reason"], "tool_calls", "{j}");
    assert!(msg["content"].is_null(), "{msg}");
    let calls = msg["tool_calls"].as_array().unwrap().clone();
    let parsed = calls_of(&calls);
    assert!(!parsed.is_empty());
    assert!(parsed
        .iter()
        .all(|(n, _)| n == "get_weather" || n == "get_time"));
    // Streaming: the same calls, as deltas with an index each.
    let s = streamed(&chat(&srv, ask(json!("required"), true)));
    assert_eq!(s.finish.as_deref(), Some("tool_calls"));
    assert_eq!(calls_of(&s.calls), parsed);
    for (i, c) in s.calls.iter().enumerate() {
        assert_eq!(c["index"], i, "{c}");
    }
    // A named function.
    let j = chat(
        &srv,
        ask(
            json!({"type": "function", "function": {"name": "get_time"}}),
            false,
        ),
    )
    .json();
    let named = calls_of(j["choices"][0]["message"]["tool_calls"].as_array().unwrap());
    assert!(
        !named.is_empty() && named.iter().all(|(n, _)| n == "get_time"),
        "{named:?}"
    );
    // The results go back as tool messages; the final answer is text.
    let mut messages = q.as_array().unwrap().clone();
    messages.push(json!({"role": "assistant", "content": null, "tool_calls": calls}));
    for c in &calls {
        messages.push(
            json!({"role": "tool", "tool_call_id": c["id"], "content": "{\"temperature_c\": 18}"}),
        );
    }
    let r = chat(
        &srv,
        json!({"messages": messages, "tools": tools(), "tool_choice": "none", "max_tokens": 32, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let j = r.json();
    let msg = &j["choices"][0]["message"];
    assert!(msg.get("tool_calls").is_none(), "{msg}");
    assert!(
        msg["content"]
            .as_str()
            .is_some_and(|t| !t.trim().is_empty()),
        "{msg}"
    );
    // Refusals name the field.
    for (body, param) in [
        (
            ask(
                json!({"type": "function", "function": {"name": "nope"}}),
                false,
            ),
            "tool_choice",
        ),
        (
            json!({"messages": q, "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}),
            "messages[0].tool_calls[0].function.arguments",
        ),
    ] {
        let r = chat(&srv, body);
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.error()["param"], param, "{}", r.body);
    }
    assert!(srv.terminate().success());
}

/// log-softmax of the row `logits`, at `token`.
fn log_softmax_at(logits: &[f32], token: usize) -> f64 {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    logits[token] as f64 - max - sum.ln()
}

#[test]
fn logprobs_match_the_logits_and_spell_the_text() {
    let Some(model) = model() else { return };
    let srv = Server::start(&model, &[]);
    // Chat, greedy: tokens spell the content, the chosen token is the top one.
    let body = json!({"messages": user("Name three colors."), "max_tokens": 12, "temperature": 0,
                      "logprobs": true, "top_logprobs": 4});
    let j = chat(&srv, body.clone()).json();
    let content = j["choices"][0]["message"]["content"].as_str().unwrap();
    let entries = j["choices"][0]["logprobs"]["content"].as_array().unwrap();
    let check = |content: &str, entries: &[Value]| {
        let spelled: String = entries
            .iter()
            .map(|e| e["token"].as_str().unwrap())
            .collect();
        assert_eq!(spelled, content);
        for e in entries {
            let lp = e["logprob"].as_f64().unwrap();
            let top = e["top_logprobs"].as_array().unwrap();
            assert_eq!(top.len(), 4, "{e}");
            assert!(lp <= 0.0);
            assert_eq!(top[0]["token"], e["token"], "{e}");
            assert!((top[0]["logprob"].as_f64().unwrap() - lp).abs() < 1e-6);
            assert!(top
                .windows(2)
                .all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()));
            let bytes: Vec<u8> = e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
                .collect();
            assert_eq!(bytes, e["token"].as_str().unwrap().as_bytes());
        }
    };
    check(content, entries);
    // Streaming: the same entries, spread over the chunks.
    let mut sb = body;
    sb["stream"] = json!(true);
    let s = streamed(&chat(&srv, sb));
    assert_eq!(s.content, content);
    check(&s.content, &s.logprobs);
    assert_eq!(&s.logprobs, entries);
    // Without `logprobs`, none.
    let j = chat(
        &srv,
        json!({"messages": user("Hi"), "max_tokens": 2, "temperature": 0}),
    )
    .json();
    assert!(j["choices"][0]["logprobs"].is_null());

    // Completions: the first token's log-probability is the log-softmax of
    // the prompt's last logits row, computed here.
    let prompt = "The capital of France is";
    let r = srv.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 3}),
    );
    let j = r.json();
    let lp = &j["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.concat(), j["choices"][0]["text"].as_str().unwrap());
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    let mut at = 0;
    for (t, o) in tokens.iter().zip(&offsets) {
        assert_eq!(*o, at);
        at += t.len() as u64;
    }
    let engine = Engine::load(
        &model,
        EngineOptions {
            n_ctx: 256,
            threads: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let ids = engine.encode(prompt, true).unwrap();
    let logits = engine.logits_for(&ids).unwrap();
    let vocab = logits.len() / ids.len();
    let last = &logits[(ids.len() - 1) * vocab..];
    let first = engine.encode(tokens[0], false).unwrap();
    assert_eq!(first.len(), 1, "{:?}", tokens[0]);
    let want = log_softmax_at(last, first[0] as usize);
    let got = lp["token_logprobs"][0].as_f64().unwrap();
    assert!((got - want).abs() < 1e-3, "server {got}, reference {want}");
    for (t, top) in tokens.iter().zip(lp["top_logprobs"].as_array().unwrap()) {
        let top = top.as_object().unwrap();
        assert_eq!(top.len(), 3);
        let best = top
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert_eq!(top[*t].as_f64(), Some(best), "{t:?} {top:?}");
    }
    // Streaming completion: the same tokens.
    let r = srv.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 3, "stream": true}),
    );
    let mut streamed_tokens = Vec::new();
    for e in r.events() {
        if e == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&e).unwrap();
        for t in v["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .into_iter()
            .flatten()
        {
            streamed_tokens.push(t.as_str().unwrap().to_string());
        }
    }
    assert_eq!(streamed_tokens, tokens);
    // Limits.
    for (path, body, param) in [
        (
            "/v1/chat/completions",
            json!({"messages": user("x"), "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user("x"), "top_logprobs": 2}),
            "top_logprobs",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": 21}),
            "logprobs",
        ),
    ] {
        let r = srv.post(path, &body);
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.error()["param"], param);
    }
    assert!(srv.terminate().success());
}

#[test]
fn embeddings_are_batched_normalised_means() {
    let Some(model) = model() else { return };
    let srv = Server::start(&model, &["--api-key", "k3y"]);
    let texts = [
        "The cat sat on the mat.",
        "A cat is sitting on a rug.",
        "Quarterly tax filing deadlines.",
    ];
    let post = |body: Value| {
        srv.request(
            "POST",
            "/v1/embeddings",
            &[
                ("Content-Type", "application/json"),
                ("Authorization", "Bearer k3y"),
            ],
            body.to_string().as_bytes(),
        )
    };
    // The API key applies.
    assert_eq!(
        srv.post("/v1/embeddings", &json!({"input": "x"})).status,
        401
    );
    let r = post(json!({"input": texts, "model": "any"}));
    assert_eq!(r.status, 200, "{}", r.body);
    let j = r.json();
    let data = j["data"].as_array().unwrap();
    assert_eq!(data.len(), 3);
    let vectors: Vec<Vec<f32>> = data
        .iter()
        .enumerate()
        .map(|(i, d)| {
            assert_eq!(d["index"], i);
            d["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();
    let engine = Engine::load(
        &model,
        EngineOptions {
            n_ctx: 256,
            threads: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let want = engine.embed(&texts).unwrap();
    let n_tokens: usize = texts
        .iter()
        .map(|t| engine.encode(t, true).unwrap().len())
        .sum();
    assert_eq!(j["usage"]["prompt_tokens"], n_tokens);
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    for (v, w) in vectors.iter().zip(&want) {
        assert_eq!(v.len(), engine.model().config().n_embd);
        assert!((dot(v, v) - 1.0).abs() < 1e-4);
        assert!(dot(v, w) > 0.9999, "server and engine disagree");
    }
    assert!(dot(&vectors[0], &vectors[1]) > dot(&vectors[0], &vectors[2]));
    // base64: the same floats, little-endian.
    let j = post(json!({"input": texts, "encoding_format": "base64"})).json();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(j["data"][0]["embedding"].as_str().unwrap())
        .unwrap();
    let decoded: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(decoded, vectors[0]);
    // Token ids, and refusals.
    let ids = engine.encode(texts[2], true).unwrap();
    let j = post(json!({"input": [ids]})).json();
    let v: Vec<f32> = j["data"][0]["embedding"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    // Alone, not in a batch of three: the CPU kernels' row grouping moves
    // the last bits.
    assert!(dot(&v, &vectors[2]) > 0.999);
    for (body, param) in [
        (json!({"input": ""}), "input"),
        (json!({"input": [[1, 2], []]}), "input"),
        (json!({"input": [4_000_000_000u64]}), "input"),
        (json!({"input": "x", "dimensions": 3}), "dimensions"),
        (
            json!({"input": "x", "encoding_format": "int8"}),
            "encoding_format",
        ),
        (json!({"input": "word ".repeat(1100)}), "input"),
    ] {
        let r = post(body.clone());
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.error()["param"], param, "{}", r.body);
    }
    assert!(srv.terminate().success());
}
