//! What structured output adds to a request and to its answer, read from
//! and written as OpenAI's JSON: `response_format`, `tools` /
//! `tool_choice` / `parallel_tool_calls`, `logprobs` / `top_logprobs`,
//! tool and assistant-tool-call messages, and `/v1/embeddings` input and
//! output. The routes call these; the grammar work is `mirage-grammar`'s.

use std::sync::Arc;

use mirage_grammar::{tool_call_grammar, GrammarCompiler, GrammarSpec, ToolCall, ToolChoice};
use mirage_runtime::{Constraint, TokenLogprob, MAX_TOP_LOGPROBS};
use mirage_tokenizer::Tokenizer;
use serde_json::{json, Value};

use crate::error::ApiError;

/// The structured-output fields of a chat request, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatStructure {
    /// `response_format` as a grammar (`None`: free text).
    pub response_format: Option<GrammarSpec>,
    /// `tools`, as given (an array of `{"type": "function", "function"}`).
    pub tools: Option<Value>,
    /// `tool_choice` (default `auto` with tools, `none` without).
    pub tool_choice: ToolChoice,
    /// `parallel_tool_calls` (default true).
    pub parallel_tool_calls: bool,
    /// Alternatives per token when `logprobs` is true (`top_logprobs`, 0
    /// by default); `None` when log-probabilities were not asked for.
    pub logprobs: Option<usize>,
}

fn invalid(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::invalid(message, Some(param))
}

/// Reads `response_format`, `tools`, `tool_choice`,
/// `parallel_tool_calls`, `logprobs` and `top_logprobs` of a chat request.
pub fn chat_structure(body: &Value) -> Result<ChatStructure, ApiError> {
    let response_format = match body.get("response_format") {
        None | Some(Value::Null) => None,
        Some(rf) => match rf.get("type").and_then(Value::as_str) {
            Some("text") => None,
            Some("json_object") => Some(GrammarSpec::JsonObject),
            Some("json_schema") => {
                let js = rf.get("json_schema").ok_or_else(|| {
                    invalid(
                        "`json_schema` is required with type json_schema",
                        "response_format.json_schema",
                    )
                })?;
                // `strict` or not, the output is held to the schema: the grammar
                // is the schema, there is no looser mode.
                match js.get("schema") {
                    Some(s) if s.is_object() || s.is_boolean() => {
                        Some(GrammarSpec::JsonSchema(s.clone()))
                    }
                    Some(_) => {
                        return Err(invalid(
                            "`schema` must be a JSON schema object",
                            "response_format.json_schema.schema",
                        ))
                    }
                    None => Some(GrammarSpec::JsonSchema(json!({}))),
                }
            }
            other => {
                return Err(invalid(
                    format!(
                    "response_format type {other:?} is not one of text, json_object, json_schema"
                ),
                    "response_format.type",
                ))
            }
        },
    };
    let tools = match body.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(list)) => {
            for (i, t) in list.iter().enumerate() {
                if t.get("type").and_then(Value::as_str) != Some("function") {
                    return Err(invalid(
                        "only tools of type `function` are supported",
                        &format!("tools[{i}].type"),
                    ));
                }
                let name = t["function"]["name"].as_str().unwrap_or("");
                if name.is_empty()
                    || !name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
                {
                    return Err(invalid(
                        "a function needs a name of letters, digits, `_` and `-`",
                        &format!("tools[{i}].function.name"),
                    ));
                }
            }
            (!list.is_empty()).then(|| Value::Array(list.clone()))
        }
        Some(_) => return Err(invalid("`tools` must be an array", "tools")),
    };
    let tool_choice = match body.get("tool_choice") {
        None | Some(Value::Null) => {
            if tools.is_some() {
                ToolChoice::Auto
            } else {
                ToolChoice::None
            }
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => return Err(invalid(format!("tool_choice {s:?} is not none, auto or required"), "tool_choice")),
        },
        Some(v) => match v["function"]["name"].as_str() {
            Some(n) if v["type"] == "function" => ToolChoice::Named(n.to_string()),
            _ => {
                return Err(invalid(
                    "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    "tool_choice",
                ))
            }
        },
    };
    if matches!(tool_choice, ToolChoice::Required | ToolChoice::Named(_)) {
        let Some(t) = &tools else {
            return Err(invalid("tool_choice needs `tools`", "tool_choice"));
        };
        if let ToolChoice::Named(n) = &tool_choice {
            if !t
                .as_array()
                .into_iter()
                .flatten()
                .any(|x| x["function"]["name"] == n.as_str())
            {
                return Err(invalid(
                    format!("tool_choice names `{n}`, which is not in `tools`"),
                    "tool_choice",
                ));
            }
        }
        if response_format.is_some() {
            return Err(invalid(
                "response_format cannot be combined with a forced tool call",
                "response_format",
            ));
        }
    }
    let parallel_tool_calls = match body.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(invalid(
                "`parallel_tool_calls` must be a boolean",
                "parallel_tool_calls",
            ))
        }
    };
    let want = match body.get("logprobs") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(invalid("`logprobs` must be a boolean", "logprobs")),
    };
    let top = match body.get("top_logprobs") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(n) if n as usize <= MAX_TOP_LOGPROBS => Some(n as usize),
            _ => {
                return Err(invalid(
                    format!("`top_logprobs` must be an integer from 0 to {MAX_TOP_LOGPROBS}"),
                    "top_logprobs",
                ))
            }
        },
    };
    if top.is_some_and(|n| n > 0) && !want {
        return Err(invalid(
            "`top_logprobs` needs `logprobs: true`",
            "top_logprobs",
        ));
    }
    Ok(ChatStructure {
        response_format,
        tools,
        tool_choice,
        parallel_tool_calls,
        logprobs: want.then(|| top.unwrap_or(0)),
    })
}

/// `logprobs` of a legacy completion request (an integer 0..=20; OpenAI
/// allows 5).
pub fn completion_logprobs(body: &Value) -> Result<Option<usize>, ApiError> {
    match body.get("logprobs") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n as usize <= MAX_TOP_LOGPROBS => Ok(Some(n as usize)),
            _ => Err(invalid(
                format!("`logprobs` must be an integer from 0 to {MAX_TOP_LOGPROBS}"),
                "logprobs",
            )),
        },
    }
}

impl ChatStructure {
    /// The grammar the request needs: the forced tool call, else the
    /// response format.
    pub fn constraint(
        &self,
        compiler: &GrammarCompiler,
    ) -> Result<Option<Arc<dyn Constraint>>, ApiError> {
        let spec = match &self.tools {
            Some(tools) => tool_call_grammar(tools, &self.tool_choice, self.parallel_tool_calls)
                .map_err(|e| invalid(e.to_string(), "tools"))?,
            None => None,
        };
        let (spec, param) = match spec {
            Some(s) => (Some(s), "tools"),
            None => (self.response_format.clone(), "response_format"),
        };
        spec.map(|s| {
            compiler
                .compile(&s)
                .map(|g| g as Arc<dyn Constraint>)
                .map_err(|e| invalid(e.to_string(), param))
        })
        .transpose()
    }

    /// The tools the prompt shows the model (none for `tool_choice: none`,
    /// as the model must not call them).
    pub fn prompt_tools(&self) -> Option<&Value> {
        self.tools
            .as_ref()
            .filter(|_| self.tool_choice != ToolChoice::None)
    }

    /// Whether the reply is parsed for tool calls.
    pub fn parses_tool_calls(&self) -> bool {
        self.tools.is_some() && self.tool_choice != ToolChoice::None
    }
}

/// Messages as the chat template reads them: content parts joined, and
/// each assistant tool call's `arguments` string parsed to the object
/// templates print (`tojson`).
pub fn template_messages(messages: &Value) -> Result<Value, ApiError> {
    let list = messages
        .as_array()
        .ok_or_else(|| invalid("`messages` must be an array", "messages"))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let role = m["role"]
            .as_str()
            .ok_or_else(|| invalid("a message needs a role", &format!("messages[{i}].role")))?;
        let content = match &m["content"] {
            Value::Null => Value::Null,
            Value::String(s) => Value::String(s.clone()),
            Value::Array(parts) => Value::String(
                parts
                    .iter()
                    .filter_map(|p| p["text"].as_str())
                    .collect::<Vec<_>>()
                    .join(""),
            ),
            _ => {
                return Err(invalid(
                    "content must be a string or a list of parts",
                    &format!("messages[{i}].content"),
                ))
            }
        };
        let role = if role == "developer" { "system" } else { role };
        let mut msg = json!({"role": role, "content": content});
        if let Some(calls) = m.get("tool_calls").and_then(Value::as_array) {
            let mut parsed = Vec::new();
            for (j, c) in calls.iter().enumerate() {
                let f = &c["function"];
                let args = match &f["arguments"] {
                    Value::String(s) => serde_json::from_str(s).map_err(|_| {
                        invalid(
                            "tool call arguments are not JSON",
                            &format!("messages[{i}].tool_calls[{j}].function.arguments"),
                        )
                    })?,
                    Value::Null => json!({}),
                    v => v.clone(),
                };
                parsed.push(json!({"type": "function", "id": c["id"], "function": {"name": f["name"], "arguments": args}}));
            }
            msg["tool_calls"] = Value::Array(parsed);
        }
        if role == "tool" {
            if let Some(id) = m.get("tool_call_id") {
                msg["tool_call_id"] = id.clone();
            }
        } else if role != "system" && role != "user" && role != "assistant" {
            return Err(invalid(
                format!("unknown role {role:?}"),
                &format!("messages[{i}].role"),
            ));
        }
        out.push(msg);
    }
    Ok(Value::Array(out))
}

/// The bytes of every token of the vocabulary, copied once from the
/// tokenizer (which stays on the scheduler thread) so that handlers can
/// write log-probability answers.
#[derive(Debug, Default)]
pub struct TokenPieces {
    bytes: Vec<u8>,
    ends: Vec<usize>,
}

impl TokenPieces {
    /// Copies `tokenizer`'s pieces.
    pub fn new(tokenizer: &Tokenizer) -> TokenPieces {
        let n = tokenizer.vocab_size();
        let mut bytes = Vec::new();
        let mut ends = Vec::with_capacity(n);
        for id in 0..n as u32 {
            bytes.extend_from_slice(tokenizer.token_to_piece(id));
            ends.push(bytes.len());
        }
        TokenPieces { bytes, ends }
    }

    /// The bytes of token `id` (empty past the vocabulary).
    pub fn piece(&self, id: u32) -> &[u8] {
        let i = id as usize;
        match self.ends.get(i) {
            Some(&end) => {
                let start = if i == 0 { 0 } else { self.ends[i - 1] };
                &self.bytes[start..end]
            }
            None => &[],
        }
    }
}

fn token_entry(pieces: &TokenPieces, id: u32, logprob: f32) -> Value {
    let bytes = pieces.piece(id);
    json!({
        "token": String::from_utf8_lossy(bytes),
        "logprob": logprob,
        "bytes": bytes,
    })
}

/// A chat choice's `logprobs`: `{"content": [{token, logprob, bytes,
/// top_logprobs: [...]}, ...]}`.
pub fn chat_logprobs(pieces: &TokenPieces, entries: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut v = token_entry(pieces, e.token, e.logprob);
            v["top_logprobs"] = e
                .top
                .iter()
                .map(|&(t, l)| token_entry(pieces, t, l))
                .collect();
            v
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// A legacy completion choice's `logprobs`: parallel `tokens`,
/// `token_logprobs`, `top_logprobs` (token text to log-probability) and
/// `text_offset` (bytes into the choice's text, from `offset`).
pub fn completion_logprobs_json(
    pieces: &TokenPieces,
    entries: &[TokenLogprob],
    offset: usize,
) -> Value {
    let mut at = offset;
    let (mut tokens, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for e in entries {
        let text = String::from_utf8_lossy(pieces.piece(e.token)).into_owned();
        offsets.push(at);
        at += text.len();
        tokens.push(text);
        lps.push(e.logprob);
        let mut top = serde_json::Map::new();
        for &(t, l) in &e.top {
            top.entry(String::from_utf8_lossy(pieces.piece(t)).into_owned())
                .or_insert(json!(l));
        }
        tops.push(Value::Object(top));
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

/// The `tool_calls` of an assistant message; ids are `call_<request>_<i>`.
pub fn tool_calls_json(request_id: &str, calls: &[ToolCall]) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| tool_call_json(request_id, i, c, false))
        .collect()
}

/// One tool call, or its streamed delta (with `index`).
pub fn tool_call_json(request_id: &str, index: usize, call: &ToolCall, delta: bool) -> Value {
    let mut v = json!({
        "id": format!("call_{request_id}_{index}"),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    });
    if delta {
        v["index"] = json!(index);
    }
    v
}

/// `/v1/embeddings` input: texts, or already tokenized inputs.
#[derive(Debug, Clone, PartialEq)]
pub enum EmbeddingInput {
    /// Strings to tokenize.
    Texts(Vec<String>),
    /// Token ids.
    Tokens(Vec<Vec<u32>>),
}

/// How `/v1/embeddings` writes each vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EmbeddingEncoding {
    /// A JSON array of numbers.
    #[default]
    Float,
    /// The little-endian `f32` bytes in base64 (what the `openai` Python
    /// client asks for by default).
    Base64,
}

/// Reads `encoding_format` of an embeddings request.
pub fn embedding_encoding(body: &Value) -> Result<EmbeddingEncoding, ApiError> {
    match body.get("encoding_format") {
        None | Some(Value::Null) => Ok(EmbeddingEncoding::Float),
        Some(Value::String(f)) if f == "float" => Ok(EmbeddingEncoding::Float),
        Some(Value::String(f)) if f == "base64" => Ok(EmbeddingEncoding::Base64),
        Some(f) => Err(invalid(
            format!("encoding_format {f} is not float or base64"),
            "encoding_format",
        )),
    }
}

/// Reads `input` (a string, strings, token ids, or lists of token ids) of
/// an embeddings request.
pub fn embedding_input(body: &Value, max_inputs: usize) -> Result<EmbeddingInput, ApiError> {
    embedding_encoding(body)?;
    let ids = |v: &Value| -> Option<Vec<u32>> {
        v.as_array()?
            .iter()
            .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect()
    };
    let input = match body.get("input") {
        Some(Value::String(s)) => EmbeddingInput::Texts(vec![s.clone()]),
        Some(Value::Array(a)) if a.iter().all(Value::is_string) && !a.is_empty() => {
            EmbeddingInput::Texts(
                a.iter()
                    .map(|s| s.as_str().unwrap_or("").to_string())
                    .collect(),
            )
        }
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_number) => {
            EmbeddingInput::Tokens(vec![ids(&Value::Array(a.clone()))
                .ok_or_else(|| invalid("token ids must be u32", "input"))?])
        }
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_array) => {
            EmbeddingInput::Tokens(
                a.iter()
                    .map(|x| ids(x).ok_or_else(|| invalid("token ids must be u32", "input")))
                    .collect::<Result<_, _>>()?,
            )
        }
        _ => {
            return Err(invalid(
                "`input` must be a string, an array of strings, or token ids",
                "input",
            ))
        }
    };
    let n = match &input {
        EmbeddingInput::Texts(t) => t.len(),
        EmbeddingInput::Tokens(t) => t.len(),
    };
    if n > max_inputs {
        return Err(invalid(
            format!("at most {max_inputs} inputs per request"),
            "input",
        ));
    }
    let empty = match &input {
        EmbeddingInput::Texts(t) => t.iter().any(String::is_empty),
        EmbeddingInput::Tokens(t) => t.iter().any(Vec::is_empty),
    };
    if empty {
        return Err(invalid("an input is empty", "input"));
    }
    Ok(input)
}

/// The `/v1/embeddings` answer.
pub fn embeddings_json(
    model: &str,
    vectors: &[Vec<f32>],
    prompt_tokens: usize,
    encoding: EmbeddingEncoding,
) -> Value {
    use base64::Engine as _;
    let vector = |v: &Vec<f32>| match encoding {
        EmbeddingEncoding::Float => json!(v),
        EmbeddingEncoding::Base64 => {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            json!(base64::engine::general_purpose::STANDARD.encode(bytes))
        }
    };
    json!({
        "object": "list",
        "data": vectors.iter().enumerate().map(|(i, v)| json!({"object": "embedding", "index": i, "embedding": vector(v)})).collect::<Vec<_>>(),
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: Value) -> ApiError {
        chat_structure(&body).unwrap_err()
    }

    #[test]
    fn reads_response_format_tools_and_logprobs() {
        let s = chat_structure(&json!({})).unwrap();
        assert_eq!(
            (s.response_format, s.tool_choice, s.logprobs),
            (None, ToolChoice::None, None)
        );
        let s = chat_structure(&json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "strict": true, "schema": {"type": "object"}}},
            "logprobs": true, "top_logprobs": 3}))
        .unwrap();
        assert_eq!(
            s.response_format,
            Some(GrammarSpec::JsonSchema(json!({"type": "object"})))
        );
        assert_eq!(s.logprobs, Some(3));
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
        let s = chat_structure(&json!({"tools": tools})).unwrap();
        assert_eq!(s.tool_choice, ToolChoice::Auto);
        assert!(s.parses_tool_calls() && s.prompt_tools().is_some());
        let s = chat_structure(
            &json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}},
            "parallel_tool_calls": false}),
        )
        .unwrap();
        assert_eq!(
            (s.tool_choice, s.parallel_tool_calls),
            (ToolChoice::Named("f".into()), false)
        );
        let s = chat_structure(&json!({"tools": tools, "tool_choice": "none"})).unwrap();
        assert!(!s.parses_tool_calls() && s.prompt_tools().is_none());
    }

    #[test]
    fn refuses_what_it_cannot_serve_naming_the_field() {
        for (body, param) in [
            (
                json!({"response_format": {"type": "xml"}}),
                "response_format.type",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format.json_schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}),
                "response_format.json_schema.schema",
            ),
            (json!({"tools": [{"type": "retrieval"}]}), "tools[0].type"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
                "tools[0].function.name",
            ),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
                "tool_choice",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (json!({"top_logprobs": 2}), "top_logprobs"),
            (
                json!({"logprobs": true, "top_logprobs": 21}),
                "top_logprobs",
            ),
            (json!({"logprobs": 1}), "logprobs"),
        ] {
            let e = err(body.clone());
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e}");
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        }
        assert_eq!(
            completion_logprobs(&json!({"logprobs": 5})).unwrap(),
            Some(5)
        );
        assert!(completion_logprobs(&json!({"logprobs": true})).is_err());
    }

    #[test]
    fn template_messages_parse_tool_call_arguments() {
        let m = template_messages(&json!([
            {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}
        ]))
        .unwrap();
        assert_eq!(m[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(
            m[1]["tool_calls"][0]["function"]["arguments"],
            json!({"a": 1})
        );
        assert_eq!(m[2]["tool_call_id"], "c1");
        let e = template_messages(
            &json!([{"role": "assistant", "content": null, "tool_calls": [
            {"function": {"name": "f", "arguments": "{oops"}}]}]),
        )
        .unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].tool_calls[0].function.arguments")
        );
        assert!(template_messages(&json!([{"role": "wizard", "content": "x"}])).is_err());
    }

    #[test]
    fn embeddings_input_and_output() {
        assert_eq!(
            embedding_input(&json!({"input": "a"}), 8).unwrap(),
            EmbeddingInput::Texts(vec!["a".into()])
        );
        assert_eq!(
            embedding_input(&json!({"input": [[1, 2], [3]]}), 8).unwrap(),
            EmbeddingInput::Tokens(vec![vec![1, 2], vec![3]])
        );
        assert_eq!(
            embedding_input(&json!({"input": [5, 6]}), 8).unwrap(),
            EmbeddingInput::Tokens(vec![vec![5, 6]])
        );
        for bad in [
            json!({"input": ""}),
            json!({"input": []}),
            json!({"input": [1, "a"]}),
            json!({}),
            json!({"input": "a", "encoding_format": "int8"}),
            json!({"input": ["a", "b", "c"]}),
        ] {
            assert!(embedding_input(&bad, 2).is_err(), "{bad}");
        }
        let v = embeddings_json("m", &[vec![0.6, 0.8]], 3, EmbeddingEncoding::Float);
        assert_eq!(v["data"][0]["embedding"], json!([0.6f32, 0.8f32]));
        assert_eq!(v["usage"]["total_tokens"], 3);
        // 1.0f32 = 00 00 80 3f, 2.0f32 = 00 00 00 40 (little-endian).
        let v = embeddings_json("m", &[vec![1.0, 2.0]], 3, EmbeddingEncoding::Base64);
        assert_eq!(v["data"][0]["embedding"], "AACAPwAAAEA=");
        assert_eq!(
            embedding_encoding(&json!({"encoding_format": "base64"})).unwrap(),
            EmbeddingEncoding::Base64
        );
    }
}
