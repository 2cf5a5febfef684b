//! The fields of a request body, by endpoint: those the server implements,
//! those it accepts and ignores because they only label a request, and
//! those of the OpenAI API it does not implement ([`UNSUPPORTED`]), which
//! are refused with `400 unsupported_parameter` naming the field unless
//! they carry their "off" value. Any other field is refused with `400
//! unknown_parameter`, as OpenAI does: a request is never answered as if a
//! field had been honoured when it was not.
//!
//! Implementing a field means deleting its row from [`UNSUPPORTED`] and
//! adding it to the endpoint's implemented list.

use serde_json::Value;

use crate::error::ApiError;

/// Where a field lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// The body of `POST /v1/chat/completions`.
    Chat,
    /// The body of `POST /v1/completions`.
    Completion,
    /// One object of a chat request's `messages`.
    Message,
    /// The body of `POST /v1/embeddings`.
    Embedding,
}

/// Fields the server implements.
fn implemented(e: Endpoint) -> &'static [&'static str] {
    const SAMPLING: &[&str] = &[
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "stream",
        "stream_options",
        "n",
    ];
    match e {
        Endpoint::Chat => {
            const CHAT: &[&str] = &[
                "messages",
                "max_completion_tokens",
                "response_format",
                "tools",
                "tool_choice",
                "parallel_tool_calls",
                "logprobs",
                "top_logprobs",
            ];
            const ALL: [&str; 21] = concat_fields(SAMPLING, CHAT);
            &ALL
        }
        Endpoint::Completion => {
            const COMPLETION: &[&str] = &["prompt", "echo", "logprobs"];
            const ALL: [&str; 16] = concat_fields(SAMPLING, COMPLETION);
            &ALL
        }
        Endpoint::Message => &["role", "content", "tool_calls", "tool_call_id"],
        Endpoint::Embedding => &["input", "encoding_format"],
    }
}

const fn concat_fields<const N: usize>(
    a: &[&'static str],
    b: &[&'static str],
) -> [&'static str; N] {
    assert!(a.len() + b.len() == N, "field list length");
    let mut out = [""; N];
    let mut i = 0;
    while i < a.len() {
        out[i] = a[i];
        i += 1;
    }
    let mut j = 0;
    while j < b.len() {
        out[i + j] = b[j];
        j += 1;
    }
    out
}

/// Fields accepted and ignored: they label a request (or pick among models
/// when there is only one) and change nothing in the answer.
fn ignored(e: Endpoint) -> &'static [&'static str] {
    match e {
        // `model`: the server holds one model and answers with its id.
        Endpoint::Chat => &[
            "model",
            "user",
            "metadata",
            "safety_identifier",
            "prompt_cache_key",
            "service_tier",
        ],
        Endpoint::Completion | Endpoint::Embedding => &["model", "user"],
        Endpoint::Message => &[],
    }
}

/// A field of the OpenAI API the server does not implement.
#[derive(Debug)]
pub struct Unsupported {
    /// The field.
    pub field: &'static str,
    /// Where it lives.
    pub endpoints: &'static [Endpoint],
    /// What it asks for, in the error message.
    pub what: &'static str,
    /// Values that ask for what the server does anyway (accepted).
    pub off: fn(&Value) -> bool,
    /// Those values, in the error message.
    pub off_text: &'static str,
}

fn null(v: &Value) -> bool {
    v.is_null()
}
fn null_or_false(v: &Value) -> bool {
    v.is_null() || *v == Value::Bool(false)
}
fn null_or_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::String(s) => s.is_empty(),
        _ => false,
    }
}
fn null_or_none(v: &Value) -> bool {
    v.is_null() || v.as_str() == Some("none")
}
fn null_or_one(v: &Value) -> bool {
    v.is_null() || v.as_u64() == Some(1)
}
fn null_or_text_modality(v: &Value) -> bool {
    v.is_null()
        || v.as_array()
            .is_some_and(|a| a.len() == 1 && a[0].as_str() == Some("text"))
}

const CHAT: &[Endpoint] = &[Endpoint::Chat];
const COMPLETION: &[Endpoint] = &[Endpoint::Completion];
const BOTH: &[Endpoint] = &[Endpoint::Chat, Endpoint::Completion];
const MESSAGE: &[Endpoint] = &[Endpoint::Message];
const EMBEDDING: &[Endpoint] = &[Endpoint::Embedding];

/// The refused fields, one row each.
pub const UNSUPPORTED: &[Unsupported] = &[
    Unsupported {
        field: "functions",
        endpoints: CHAT,
        what: "function calling",
        off: null_or_empty,
        off_text: "an empty list",
    },
    Unsupported {
        field: "function_call",
        endpoints: CHAT,
        what: "function calling",
        off: null_or_none,
        off_text: "\"none\"",
    },
    Unsupported {
        field: "logit_bias",
        endpoints: BOTH,
        what: "logit bias",
        off: null_or_empty,
        off_text: "an empty object",
    },
    Unsupported {
        field: "best_of",
        endpoints: COMPLETION,
        what: "best-of sampling",
        off: null_or_one,
        off_text: "1",
    },
    Unsupported {
        field: "suffix",
        endpoints: COMPLETION,
        what: "insertion after a suffix",
        off: null_or_empty,
        off_text: "an empty string",
    },
    Unsupported {
        field: "modalities",
        endpoints: CHAT,
        what: "output other than text",
        off: null_or_text_modality,
        off_text: "[\"text\"]",
    },
    Unsupported {
        field: "audio",
        endpoints: CHAT,
        what: "audio output",
        off: null,
        off_text: "null",
    },
    Unsupported {
        field: "prediction",
        endpoints: CHAT,
        what: "predicted outputs",
        off: null,
        off_text: "null",
    },
    Unsupported {
        field: "reasoning_effort",
        endpoints: CHAT,
        what: "reasoning models",
        off: null,
        off_text: "null",
    },
    Unsupported {
        field: "verbosity",
        endpoints: CHAT,
        what: "verbosity control",
        off: null,
        off_text: "null",
    },
    Unsupported {
        field: "web_search_options",
        endpoints: CHAT,
        what: "web search",
        off: null,
        off_text: "null",
    },
    Unsupported {
        field: "store",
        endpoints: CHAT,
        what: "stored completions",
        off: null_or_false,
        off_text: "false",
    },
    Unsupported {
        field: "dimensions",
        endpoints: EMBEDDING,
        what: "shortened embeddings",
        off: null,
        off_text: "null",
    },
    Unsupported {
        field: "name",
        endpoints: MESSAGE,
        what: "participant names",
        off: null_or_empty,
        off_text: "an empty string",
    },
    Unsupported {
        field: "function_call",
        endpoints: MESSAGE,
        what: "function calling",
        off: null,
        off_text: "null",
    },
    Unsupported {
        field: "audio",
        endpoints: MESSAGE,
        what: "audio input",
        off: null,
        off_text: "null",
    },
    Unsupported {
        field: "refusal",
        endpoints: MESSAGE,
        what: "refusals",
        off: null_or_empty,
        off_text: "null",
    },
];

/// Checks the fields of one JSON object of kind `endpoint`; `prefix` goes
/// before each field's name in `param` (`messages[2].`).
pub fn check_fields(
    object: &serde_json::Map<String, Value>,
    endpoint: Endpoint,
    prefix: &str,
) -> Result<(), ApiError> {
    for (key, value) in object {
        let key = key.as_str();
        if implemented(endpoint).contains(&key) || ignored(endpoint).contains(&key) {
            continue;
        }
        let param = format!("{prefix}{key}");
        match UNSUPPORTED
            .iter()
            .find(|u| u.field == key && u.endpoints.contains(&endpoint))
        {
            Some(u) if (u.off)(value) => {}
            Some(u) => return Err(ApiError::unsupported_parameter(&param, u.what, u.off_text)),
            None => return Err(ApiError::unknown_parameter(&param)),
        }
    }
    Ok(())
}

/// Checks a request body (a JSON object) of `endpoint`, and each message of
/// a chat request.
pub fn check_request(
    body: &serde_json::Map<String, Value>,
    endpoint: Endpoint,
) -> Result<(), ApiError> {
    check_fields(body, endpoint, "")?;
    if endpoint == Endpoint::Chat {
        if let Some(Value::Array(messages)) = body.get("messages") {
            for (i, m) in messages.iter().enumerate() {
                if let Value::Object(m) = m {
                    check_fields(m, Endpoint::Message, &format!("messages[{i}]."))?;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(v: Value, e: Endpoint) -> Result<(), ApiError> {
        check_request(v.as_object().unwrap(), e)
    }

    #[test]
    fn every_refused_field_is_named_and_its_off_value_passes() {
        let msg = json!([{"role": "user", "content": "hi"}]);
        let cases: &[(&str, Value, Value)] = &[
            ("functions", json!([{"name": "f"}]), json!([])),
            ("function_call", json!("auto"), json!("none")),
            ("logit_bias", json!({"50256": -100}), json!({})),
            ("store", json!(true), json!(false)),
            ("modalities", json!(["text", "audio"]), json!(["text"])),
        ];
        for (field, on, off) in cases {
            let mut body = json!({"messages": msg});
            body[*field] = on.clone();
            let e = check(body.clone(), Endpoint::Chat).unwrap_err();
            assert_eq!(e.status.as_u16(), 400);
            assert_eq!(e.kind, "invalid_request_error");
            assert_eq!(e.code, Some("unsupported_parameter"), "{field}");
            assert_eq!(e.param.as_deref(), Some(*field));
            body[*field] = off.clone();
            check(body.clone(), Endpoint::Chat).unwrap();
            body[*field] = Value::Null;
            check(body, Endpoint::Chat).unwrap();
        }
        let e = check(json!({"prompt": "x", "best_of": 2}), Endpoint::Completion).unwrap_err();
        assert_eq!(
            (e.code, e.param.as_deref()),
            (Some("unsupported_parameter"), Some("best_of"))
        );
        check(json!({"prompt": "x", "logprobs": 2}), Endpoint::Completion).unwrap();
        let e = check(json!({"input": "x", "dimensions": 8}), Endpoint::Embedding).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("dimensions"));
        check(
            json!({"input": "x", "model": "m", "encoding_format": "float"}),
            Endpoint::Embedding,
        )
        .unwrap();
        let e = check(
            json!({"prompt": "x", "suffix": "end"}),
            Endpoint::Completion,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("suffix"));
        check(
            json!({"prompt": "x", "best_of": 1, "model": "m", "user": "u"}),
            Endpoint::Completion,
        )
        .unwrap();
    }

    #[test]
    fn message_fields_and_unknown_fields_are_refused() {
        let e = check(
            json!({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b",
                   "name": "bot"}]}),
            Endpoint::Chat,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[1].name"));
        assert_eq!(e.code, Some("unsupported_parameter"));
        let e = check(json!({"messages": [], "mirostat": 2}), Endpoint::Chat).unwrap_err();
        assert_eq!(
            (e.code, e.param.as_deref()),
            (Some("unknown_parameter"), Some("mirostat"))
        );
        // A chat-only field on the completions endpoint is unknown there.
        let e = check(json!({"prompt": "x", "messages": []}), Endpoint::Completion).unwrap_err();
        assert_eq!(e.code, Some("unknown_parameter"));
        check(
            json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "c1"}]},
                   {"role": "tool", "content": "42", "tool_call_id": "c1"}],
                   "tools": [], "tool_choice": "auto", "response_format": {"type": "json_object"},
                   "logprobs": true, "top_logprobs": 2,
                   "parallel_tool_calls": false, "metadata": {"k": "v"}}),
            Endpoint::Chat,
        )
        .unwrap();
    }
}
