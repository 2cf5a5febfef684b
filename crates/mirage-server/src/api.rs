//! Request and response bodies of the OpenAI-compatible endpoints, and the
//! checks that turn a request into a generation job.

use mirage_runtime::{GenerateParams, SamplingParams, StopReason};
use mirage_tokenizer::ChatMessage;
use serde::{Deserialize, Serialize};

use crate::error::ApiError;
use crate::structured::{self, ChatStructure, EmbeddingEncoding, EmbeddingInput};
use crate::unsupported::{self, Endpoint};

/// `stop`: one string or a list of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    /// One stop string.
    One(String),
    /// Several stop strings.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the token counts (it is sent anyway; the
    /// flag only makes it a separate chunk with no choices, as OpenAI does).
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// One part of a multi-part message content.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// Part type; only `text` is served.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

/// Message content: a string or a list of parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Typed parts.
    Parts(Vec<ContentPart>),
}

/// One chat message of a request.
#[derive(Debug, Clone, Deserialize)]
pub struct MessageIn {
    /// `system`, `user`, `assistant`, `developer` or `tool`.
    pub role: String,
    /// The text (null for an assistant turn without text).
    #[serde(default)]
    pub content: Option<Content>,
}

/// The sampling fields both endpoints share, as OpenAI names them plus
/// `top_k`, `min_p` and `repetition_penalty`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Knobs {
    /// Most new tokens.
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// Newer name of `max_tokens` (chat).
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    /// 0..=2; 0 is greedy. Default 1.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus mass, (0, 1].
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Keep the k most likely tokens; 0 disables.
    #[serde(default)]
    pub top_k: Option<u64>,
    /// Relative probability floor, [0, 1].
    #[serde(default)]
    pub min_p: Option<f32>,
    /// Up to 4 stop strings.
    #[serde(default)]
    pub stop: Option<StopField>,
    /// Seed of the random draw.
    #[serde(default)]
    pub seed: Option<i64>,
    /// -2..=2.
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// -2..=2.
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// CTRL-style repetition penalty (> 0; 1 disables).
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Choices per prompt; only 1 is served.
    #[serde(default)]
    pub n: Option<u64>,
}

/// `POST /v1/chat/completions` (which other fields are accepted, ignored
/// or refused: [`crate::unsupported`]; `model` is ignored, the server holds
/// one model).
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<MessageIn>,
    /// Sampling fields (read by [`parse_request`] from the same body).
    #[serde(skip)]
    pub knobs: Knobs,
}

/// `prompt` of a completion: text or token ids, alone or in a list of one.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    /// A string.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// A list of strings.
    Texts(Vec<String>),
    /// A list of token id lists.
    TokenLists(Vec<Vec<u32>>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: PromptField,
    /// Echo the prompt before the completion.
    #[serde(default)]
    pub echo: Option<bool>,
    /// Sampling fields (read by [`parse_request`] from the same body).
    #[serde(skip)]
    pub knobs: Knobs,
}

/// What to run: the prompt in one of its forms.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Chat messages, rendered with the model's template.
    Chat(Vec<ChatMessage>),
    /// Chat messages with tools, tool calls or tool results, as the
    /// template reads them ([`structured::template_messages`]), and the
    /// tools the prompt shows.
    ChatJson {
        /// The messages.
        messages: serde_json::Value,
        /// The tools (`None`: none shown).
        tools: Option<serde_json::Value>,
    },
    /// Raw text (tokenized with BOS where the model wants it).
    Text(String),
    /// Token ids as given.
    Tokens(Vec<u32>),
}

fn from_value<T: for<'de> Deserialize<'de>>(value: serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let param = (path != ".").then_some(path.as_str());
        let at = param.map(|p| format!(" at `{p}`")).unwrap_or_default();
        ApiError::invalid(format!("Invalid request body{at}: {inner}"), param)
            .with_code("invalid_type")
    })
}

/// A request with its shared sampling fields.
pub trait WithKnobs: for<'de> Deserialize<'de> {
    /// Which endpoint's fields it has.
    const ENDPOINT: Endpoint;
    /// Where the sampling fields go.
    fn knobs_mut(&mut self) -> &mut Knobs;
}

impl WithKnobs for ChatRequest {
    const ENDPOINT: Endpoint = Endpoint::Chat;
    fn knobs_mut(&mut self) -> &mut Knobs {
        &mut self.knobs
    }
}

impl WithKnobs for CompletionRequest {
    const ENDPOINT: Endpoint = Endpoint::Completion;
    fn knobs_mut(&mut self) -> &mut Knobs {
        &mut self.knobs
    }
}

/// Parses a request body: refuses fields the server does not implement
/// (see [`crate::unsupported`]), then reads its own fields, then the
/// sampling fields from the same object (two passes instead of
/// `#[serde(flatten)]`, which would hide the name of a field of the wrong
/// type).
pub fn parse_request<T: WithKnobs>(body: &[u8]) -> Result<T, ApiError> {
    parse_request_value(body).map(|(r, _)| r)
}

/// [`parse_request`], also giving back the body as JSON (for the
/// structured-output fields, read by [`crate::structured`]).
pub fn parse_request_value<T: WithKnobs>(body: &[u8]) -> Result<(T, serde_json::Value), ApiError> {
    let value: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(
            format!("We could not parse the JSON body of your request: {e}"),
            None,
        )
        .with_code("invalid_json")
    })?;
    let Some(object) = value.as_object() else {
        return Err(
            ApiError::invalid("The request body must be a JSON object.", None)
                .with_code("invalid_type"),
        );
    };
    unsupported::check_request(object, T::ENDPOINT)?;
    let knobs: Knobs = from_value(value.clone())?;
    let mut req: T = from_value(value.clone())?;
    *req.knobs_mut() = knobs;
    Ok((req, value))
}

fn check_range(name: &str, v: Option<f32>, lo: f32, hi: f32) -> Result<(), ApiError> {
    match v {
        Some(x) if !(x.is_finite() && x >= lo && x <= hi) => Err(ApiError::invalid(
            format!("`{name}` must be between {lo} and {hi}, got {x}."),
            Some(name),
        )
        .with_code("invalid_value")),
        _ => Ok(()),
    }
}

/// What a request asks for, checked: sampling, stop strings, token limit.
#[derive(Debug, Clone)]
pub struct Checked {
    /// Generation settings; `max_tokens` is 0 when the request left it to
    /// the room the prompt leaves in the context.
    pub params: GenerateParams,
    /// Stream server-sent events.
    pub stream: bool,
    /// Send usage as a separate last chunk.
    pub include_usage: bool,
}

/// Checks the shared fields against the context size `n_ctx`.
/// `default_max_tokens` applies when the request leaves it out (None: the
/// room the prompt leaves).
pub fn check_knobs(
    k: &Knobs,
    n_ctx: usize,
    default_max_tokens: Option<usize>,
    fresh_seed: u64,
) -> Result<Checked, ApiError> {
    check_range("temperature", k.temperature, 0.0, 2.0)?;
    check_range("top_p", k.top_p, 0.0, 1.0)?;
    if k.top_p == Some(0.0) {
        return Err(
            ApiError::invalid("`top_p` must be greater than 0.", Some("top_p"))
                .with_code("invalid_value"),
        );
    }
    check_range("min_p", k.min_p, 0.0, 1.0)?;
    check_range("presence_penalty", k.presence_penalty, -2.0, 2.0)?;
    check_range("frequency_penalty", k.frequency_penalty, -2.0, 2.0)?;
    check_range("repetition_penalty", k.repetition_penalty, 0.01, 10.0)?;
    if let Some(n) = k.n {
        if n != 1 {
            return Err(ApiError::invalid("Only `n` = 1 is supported.", Some("n"))
                .with_code("invalid_value"));
        }
    }
    let stop = match &k.stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s.clone()],
        Some(StopField::Many(v)) => v.clone(),
    };
    if stop.len() > 4 {
        return Err(
            ApiError::invalid("`stop` takes at most 4 sequences.", Some("stop"))
                .with_code("invalid_value"),
        );
    }
    let (max_field, max_value) = match (k.max_completion_tokens, k.max_tokens) {
        (Some(m), _) => ("max_completion_tokens", Some(m)),
        (None, m) => ("max_tokens", m),
    };
    let max_tokens = match max_value {
        Some(0) => return Err(ApiError::invalid(format!("`{max_field}` must be at least 1."), Some(max_field)).with_code("invalid_value")),
        Some(m) if m >= n_ctx as u64 => {
            return Err(ApiError::invalid(
                format!("`{max_field}` is {m}, but this model's context holds {n_ctx} tokens (prompt included)."),
                Some(max_field),
            )
            .with_code("context_length_exceeded"))
        }
        Some(m) => m as usize,
        None => default_max_tokens.unwrap_or(0),
    };
    let temperature = k.temperature.unwrap_or(1.0);
    let sampling = SamplingParams {
        temperature,
        top_k: k.top_k.unwrap_or(0).min(u32::MAX as u64) as usize,
        top_p: k.top_p.unwrap_or(1.0),
        min_p: k.min_p.unwrap_or(0.0),
        repeat_penalty: k.repetition_penalty.unwrap_or(1.0),
        presence_penalty: k.presence_penalty.unwrap_or(0.0),
        frequency_penalty: k.frequency_penalty.unwrap_or(0.0),
        penalty_last_n: 64,
        seed: k.seed.map(|s| s as u64).unwrap_or(fresh_seed),
    };
    let stream = k.stream.unwrap_or(false);
    let include_usage = stream
        && k.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
    Ok(Checked {
        params: GenerateParams {
            max_tokens,
            sampling,
            stop,
            ..GenerateParams::default()
        },
        stream,
        include_usage,
    })
}

/// The chat messages of a request, checked.
pub fn chat_messages(messages: &[MessageIn]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(
            ApiError::invalid("`messages` must not be empty.", Some("messages"))
                .with_code("invalid_value"),
        );
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let role = match m.role.as_str() {
            "developer" => "system",
            r @ ("system" | "user" | "assistant" | "tool") => r,
            other => {
                return Err(ApiError::invalid(
                    format!("Unknown role `{other}` in messages[{i}]."),
                    Some(&format!("messages[{i}].role")),
                )
                .with_code("invalid_value"))
            }
        };
        let content = match &m.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut s = String::new();
                for (j, p) in parts.iter().enumerate() {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => s.push_str(t),
                        _ => {
                            return Err(ApiError::invalid(
                                format!("Only text content parts are supported (messages[{i}].content[{j}])."),
                                Some(&format!("messages[{i}].content[{j}]")),
                            )
                            .with_code("invalid_value"))
                        }
                    }
                }
                s
            }
        };
        out.push(ChatMessage::new(role, content));
    }
    Ok(out)
}

/// The prompt of a completion request, checked.
pub fn completion_prompt(p: &PromptField) -> Result<Prompt, ApiError> {
    let one = |n: usize| -> Result<(), ApiError> {
        if n == 1 {
            Ok(())
        } else {
            Err(ApiError::invalid(
                "Exactly one prompt per request is supported.",
                Some("prompt"),
            )
            .with_code("invalid_value"))
        }
    };
    let prompt = match p {
        PromptField::Text(s) => Prompt::Text(s.clone()),
        PromptField::Tokens(t) => Prompt::Tokens(t.clone()),
        PromptField::Texts(v) => {
            one(v.len())?;
            Prompt::Text(v[0].clone())
        }
        PromptField::TokenLists(v) => {
            one(v.len())?;
            Prompt::Tokens(v[0].clone())
        }
    };
    match &prompt {
        Prompt::Text(s) if s.is_empty() => Err(ApiError::invalid(
            "`prompt` must not be empty.",
            Some("prompt"),
        )
        .with_code("invalid_value")),
        Prompt::Tokens(t) if t.is_empty() => Err(ApiError::invalid(
            "`prompt` must not be empty.",
            Some("prompt"),
        )
        .with_code("invalid_value")),
        _ => Ok(prompt),
    }
}

/// A chat request, parsed and checked (everything but what needs the
/// model: the chat template and the tokenizer).
#[derive(Debug, Clone)]
pub struct ValidChat {
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Response format, tools, log-probabilities.
    pub structure: ChatStructure,
    /// The messages as the template reads them when tools, tool calls or
    /// tool results take part (rendered with `render_json`); `None`: a
    /// plain conversation.
    pub template_messages: Option<serde_json::Value>,
    /// Sampling, stop strings, token limit, streaming; `params.logprobs`
    /// set, `params.constraint` left to the handler (it needs the model's
    /// vocabulary).
    pub checked: Checked,
}

/// Parses and checks the body of `POST /v1/chat/completions` for a
/// context of `n_ctx` positions; `fresh_seed` is the seed when the request
/// has none.
pub fn validate_chat(body: &[u8], n_ctx: usize, fresh_seed: u64) -> Result<ValidChat, ApiError> {
    let (req, value): (ChatRequest, _) = parse_request_value(body)?;
    let messages = chat_messages(&req.messages)?;
    let structure = structured::chat_structure(&value)?;
    let with_tools = structure.prompt_tools().is_some()
        || req.messages.iter().any(|m| m.role == "tool")
        || value["messages"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|m| m.get("tool_calls").is_some_and(|t| !t.is_null()));
    let template_messages = if with_tools {
        Some(structured::template_messages(&value["messages"])?)
    } else {
        None
    };
    let mut checked = check_knobs(&req.knobs, n_ctx, None, fresh_seed)?;
    checked.params.logprobs = structure.logprobs;
    Ok(ValidChat {
        messages,
        structure,
        template_messages,
        checked,
    })
}

/// A completion request, parsed and checked.
#[derive(Debug, Clone)]
pub struct ValidCompletion {
    /// The prompt.
    pub prompt: Prompt,
    /// The prompt text to send back before the completion (`echo`).
    pub echo: Option<String>,
    /// Sampling, stop strings, token limit, streaming.
    pub checked: Checked,
}

/// Parses and checks the body of `POST /v1/completions` (see
/// [`validate_chat`]).
pub fn validate_completion(
    body: &[u8],
    n_ctx: usize,
    fresh_seed: u64,
) -> Result<ValidCompletion, ApiError> {
    let (req, value): (CompletionRequest, _) = parse_request_value(body)?;
    let prompt = completion_prompt(&req.prompt)?;
    // OpenAI's legacy default is 16 new tokens.
    let mut checked = check_knobs(&req.knobs, n_ctx, Some(16), fresh_seed)?;
    checked.params.logprobs = structured::completion_logprobs(&value)?;
    let echo = match (&prompt, req.echo.unwrap_or(false)) {
        (Prompt::Text(t), true) => Some(t.clone()),
        (Prompt::Tokens(_), true) => {
            return Err(ApiError::invalid(
                "`echo` is supported for text prompts only.",
                Some("echo"),
            ))
        }
        _ => None,
    };
    Ok(ValidCompletion {
        prompt,
        echo,
        checked,
    })
}

/// Parses and checks the body of `POST /v1/embeddings` (at most
/// `max_inputs` inputs).
pub fn validate_embeddings(
    body: &[u8],
    max_inputs: usize,
) -> Result<(EmbeddingInput, EmbeddingEncoding), ApiError> {
    let value: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(
            format!("We could not parse the JSON body of your request: {e}"),
            None,
        )
        .with_code("invalid_json")
    })?;
    let Some(object) = value.as_object() else {
        return Err(
            ApiError::invalid("The request body must be a JSON object.", None)
                .with_code("invalid_type"),
        );
    };
    unsupported::check_request(object, Endpoint::Embedding)?;
    Ok((
        structured::embedding_input(&value, max_inputs)?,
        structured::embedding_encoding(&value)?,
    ))
}

/// OpenAI's `finish_reason` for a stop reason.
pub fn finish_reason(r: StopReason) -> &'static str {
    match r {
        StopReason::MaxTokens | StopReason::ContextFull => "length",
        StopReason::EndOfGeneration | StopReason::StopString | StopReason::Callback => "stop",
    }
}

/// Token counts of a response.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
}

impl Usage {
    /// Counts with their total.
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Usage {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrong_types_name_the_field() {
        let e = parse_request::<ChatRequest>(
            br#"{"messages":[{"role":"user","content":"hi"}],"temperature":"hot"}"#,
        )
        .unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        assert_eq!(e.param.as_deref(), Some("temperature"), "{e:?}");
        let e = parse_request::<ChatRequest>(br#"{"messages":[{"role":"user","content":"hi"}"#)
            .unwrap_err();
        assert_eq!(e.code, Some("invalid_json"));
        let e = parse_request::<ChatRequest>(br#"{"model":"x"}"#).unwrap_err();
        assert!(e.message.contains("messages"), "{e:?}");
        let e = parse_request::<ChatRequest>(
            br#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":-3}"#,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"), "{e:?}");
    }

    #[test]
    fn knobs_are_checked_against_the_context() {
        let k = Knobs {
            max_tokens: Some(5000),
            ..Default::default()
        };
        assert_eq!(
            check_knobs(&k, 2048, None, 1).unwrap_err().code,
            Some("context_length_exceeded")
        );
        let k = Knobs {
            temperature: Some(3.0),
            ..Default::default()
        };
        assert_eq!(
            check_knobs(&k, 2048, None, 1).unwrap_err().param.as_deref(),
            Some("temperature")
        );
        let k = Knobs {
            max_tokens: Some(7),
            temperature: Some(0.5),
            top_k: Some(40),
            min_p: Some(0.05),
            seed: Some(3),
            stop: Some(StopField::One("\n".into())),
            ..Default::default()
        };
        let c = check_knobs(&k, 2048, None, 1).unwrap();
        assert_eq!(c.params.max_tokens, 7);
        assert_eq!(c.params.sampling.top_k, 40);
        assert_eq!(c.params.sampling.seed, 3);
        assert_eq!(c.params.stop, vec!["\n".to_string()]);
    }
}
