//! The HTTP surface: routes, authentication, request counting, and the
//! OpenAI response shapes (JSON and server-sent events).

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{MatchedPath, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use tokio::sync::mpsc;

use crate::access::{self, HostPolicy, OriginPolicy};
use crate::api::{self, Checked, Prompt, Usage};
use crate::body::{ApiBody, BodyLimits};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::scheduler::{Job, JobEvent, ModelInfo, Work};
use crate::structured::{self, TokenPieces};
use mirage_grammar::{parse_tool_calls, GrammarCompiler, ToolCallStream, ToolStreamEvent};
use mirage_runtime::TokenLogprob;

/// State shared by every handler.
pub struct AppState {
    /// Queue into the scheduler.
    pub jobs: mpsc::Sender<Job>,
    /// The loaded model.
    pub info: ModelInfo,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Required bearer token, when set.
    pub api_key: Option<String>,
    /// Set on the first shutdown signal: new work is refused.
    pub shutting_down: AtomicBool,
    /// Size and time limits of request bodies.
    pub body_limits: BodyLimits,
    /// `Host` names the server answers to.
    pub hosts: HostPolicy,
    /// Browser origins that may call the server (`--cors`).
    pub origins: OriginPolicy,
    /// The CORS layer when `--cors` lists origins.
    pub cors: Option<tower_http::cors::CorsLayer>,
    /// Request counter (ids, default seeds).
    pub counter: AtomicU64,
}

const CHAT_PAGE: &str = include_str!("../static/index.html");
const MARKDOWN_JS: &str = include_str!("../static/markdown.js");

/// The application router. Checks run in this order: `Host` and `Origin`
/// ([`access`]), CORS when on, the API key (on `/v1/*` and `/metrics`),
/// then the handler, which reads the body ([`crate::body`]).
pub fn router(state: Arc<AppState>) -> Router {
    let keyed = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    let mut app = Router::new()
        .merge(keyed)
        .route("/", get(|| async { Html(CHAT_PAGE) }))
        .route(
            "/markdown.js",
            get(|| async {
                (
                    [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
                    MARKDOWN_JS,
                )
            }),
        )
        .route("/health", get(health))
        .fallback(|req: Request| async move { ApiError::not_found(req.uri().path()) })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() });
    if let Some(cors) = state.cors.clone() {
        app = app.layer(cors);
    }
    app.layer(middleware::from_fn_with_state(
        state.clone(),
        access::check_host_and_origin,
    ))
    .layer(middleware::from_fn_with_state(
        state.clone(),
        count_requests,
    ))
    .with_state(state)
}

async fn count_requests(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let resp = next.run(req).await;
    st.metrics.count_request(&path, resp.status().as_u16());
    resp
}

async fn require_key(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        // Compare every byte so the time does not tell how much matched.
        let ok = given.is_some_and(|g| {
            g.len() == key.len()
                && g.bytes()
                    .zip(key.bytes())
                    .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                    == 0
        });
        if !ok {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl AppState {
    fn next_id(&self) -> u64 {
        self.counter.fetch_add(1, Ordering::Relaxed)
    }

    /// Seconds a rejected client should wait: the queue's share of the
    /// mean request time, 1..=60.
    fn retry_after(&self) -> u64 {
        let m = &self.metrics;
        let queued = m.queue_depth.load(Ordering::Relaxed).max(1) as f64;
        let mean = m.request_latency.mean().unwrap_or(1.0);
        (queued * mean / m.max_batch.max(1) as f64)
            .ceil()
            .clamp(1.0, 60.0) as u64
    }

    fn fresh_seed(&self) -> u64 {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        t ^ self.next_id().wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }

    /// Queues a job: its event channel.
    fn queue(&self, work: Work) -> Result<mpsc::UnboundedReceiver<JobEvent>, ApiError> {
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(ApiError::shutting_down());
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let job = Job {
            work,
            events: tx,
            arrived: Instant::now(),
        };
        self.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.jobs.try_send(job) {
            self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
            return Err(match e {
                mpsc::error::TrySendError::Full(_) => {
                    self.metrics.rejected.fetch_add(1, Ordering::Relaxed);
                    ApiError::queue_full(self.retry_after())
                }
                mpsc::error::TrySendError::Closed(_) => ApiError::shutting_down(),
            });
        }
        Ok(rx)
    }

    /// Queues a generation and waits until it holds a sequence slot.
    async fn submit(
        &self,
        prompt: Prompt,
        checked: &Checked,
    ) -> Result<mpsc::UnboundedReceiver<JobEvent>, ApiError> {
        let mut rx = self.queue(Work::Generate {
            prompt,
            params: checked.params.clone(),
        })?;
        match rx.recv().await {
            Some(JobEvent::Started { .. }) => Ok(rx),
            Some(JobEvent::Failed(e)) => Err(e),
            Some(other) => Err(ApiError::internal(format!(
                "scheduler answered {other:?} before starting"
            ))),
            None => Err(ApiError::shutting_down()),
        }
    }

    /// The grammar compiler, or why this model has none.
    fn grammars(&self, param: &str) -> Result<&GrammarCompiler, ApiError> {
        self.info.grammars.as_deref().map_err(|why| {
            ApiError::invalid(
                format!("This model cannot constrain its output: {why}"),
                Some(param),
            )
        })
    }
}

/// A whole generation.
struct Collected {
    text: String,
    logprobs: Vec<TokenLogprob>,
    finish: &'static str,
    usage: Usage,
}

/// Collects a whole generation.
async fn collect(mut rx: mpsc::UnboundedReceiver<JobEvent>) -> Result<Collected, ApiError> {
    let mut text = String::new();
    let mut logprobs = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            JobEvent::Text(t) => text.push_str(&t),
            JobEvent::Logprob(l) => logprobs.push(l),
            JobEvent::Done {
                reason,
                prompt_tokens,
                completion_tokens,
            } => {
                return Ok(Collected {
                    text,
                    logprobs,
                    finish: api::finish_reason(reason),
                    usage: Usage::new(prompt_tokens, completion_tokens),
                })
            }
            JobEvent::Failed(e) => return Err(e),
            JobEvent::Started { .. } | JobEvent::Embeddings { .. } => {}
        }
    }
    Err(ApiError::internal(
        "the scheduler stopped before the generation ended",
    ))
}

fn sse_json(v: &serde_json::Value) -> Result<Event, Infallible> {
    Ok(Event::default().data(v.to_string()))
}

/// Turns a generation's events into the chunks of one endpoint's stream.
trait Chunker: Send + 'static {
    /// Chunks for a piece of text (none while text is held back).
    fn text(&mut self, text: &str) -> Vec<serde_json::Value>;
    /// Keeps a token's log-probability for the next chunk.
    fn logprob(&mut self, l: TokenLogprob);
    /// The last chunks, the one with `finish_reason` last.
    fn finish(&mut self, finish: &'static str, usage: Usage) -> Vec<serde_json::Value>;
    /// The separate usage chunk (`stream_options.include_usage`).
    fn usage_only(&self, usage: Usage) -> serde_json::Value;
}

/// Builds the event stream of a generation.
fn sse_stream(
    mut rx: mpsc::UnboundedReceiver<JobEvent>,
    first: Option<serde_json::Value>,
    include_usage: bool,
    mut chunker: impl Chunker,
) -> Response {
    let stream = async_stream::stream! {
        if let Some(first) = first {
            yield sse_json(&first);
        }
        while let Some(ev) = rx.recv().await {
            match ev {
                JobEvent::Text(t) => {
                    for c in chunker.text(&t) {
                        yield sse_json(&c);
                    }
                }
                JobEvent::Logprob(l) => chunker.logprob(l),
                JobEvent::Done { reason, prompt_tokens, completion_tokens } => {
                    let usage = Usage::new(prompt_tokens, completion_tokens);
                    for c in chunker.finish(api::finish_reason(reason), usage) {
                        yield sse_json(&c);
                    }
                    if include_usage {
                        yield sse_json(&chunker.usage_only(usage));
                    }
                    break;
                }
                JobEvent::Failed(e) => {
                    yield Ok(Event::default().data(e.body_json()));
                    break;
                }
                JobEvent::Started { .. } | JobEvent::Embeddings { .. } => {}
            }
        }
        yield Ok(Event::default().data("[DONE]"));
    };
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

/// The chunks of a chat stream: content deltas, tool-call deltas (each
/// call whole, once its block closes) and log-probabilities riding on the
/// next chunk.
struct ChatChunker {
    id: String,
    created: u64,
    model: String,
    pieces: Arc<TokenPieces>,
    /// Parses tool calls out of the text (when the request has tools).
    tools: Option<ToolCallStream>,
    /// Log-probabilities asked for.
    logprobs: bool,
    pending: Vec<TokenLogprob>,
}

impl ChatChunker {
    fn chunk(
        &mut self,
        delta: serde_json::Value,
        finish: Option<&str>,
        usage: Option<Usage>,
    ) -> serde_json::Value {
        let logprobs = if self.logprobs && !self.pending.is_empty() {
            let v = structured::chat_logprobs(&self.pieces, &self.pending);
            self.pending.clear();
            v
        } else {
            serde_json::Value::Null
        };
        let mut v = json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "system_fingerprint": "mirage",
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        });
        if let Some(u) = usage {
            v["usage"] = json!(u);
        }
        v
    }

    fn tool_events(&mut self, events: Vec<ToolStreamEvent>) -> Vec<serde_json::Value> {
        let mut out = Vec::new();
        for ev in events {
            let delta = match ev {
                ToolStreamEvent::Content(t) => json!({"content": t}),
                ToolStreamEvent::Call(c) => {
                    let index = self.tools.as_ref().map_or(1, |t| t.calls()) - 1;
                    json!({"tool_calls": [structured::tool_call_json(&self.id, index, &c, true)]})
                }
            };
            out.push(self.chunk(delta, None, None));
        }
        out
    }
}

impl Chunker for ChatChunker {
    fn text(&mut self, text: &str) -> Vec<serde_json::Value> {
        match self.tools.as_mut() {
            Some(t) => {
                let events = t.push(text);
                self.tool_events(events)
            }
            None => vec![self.chunk(json!({"content": text}), None, None)],
        }
    }

    fn logprob(&mut self, l: TokenLogprob) {
        self.pending.push(l);
    }

    fn finish(&mut self, finish: &'static str, usage: Usage) -> Vec<serde_json::Value> {
        let mut out = Vec::new();
        let mut finish = finish;
        if let Some(t) = self.tools.as_mut() {
            let events = t.finish();
            out = self.tool_events(events);
            if self.tools.as_ref().is_some_and(|t| t.calls() > 0) {
                finish = "tool_calls";
            }
        }
        out.push(self.chunk(json!({}), Some(finish), Some(usage)));
        out
    }

    fn usage_only(&self, usage: Usage) -> serde_json::Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
               "system_fingerprint": "mirage", "choices": [], "usage": usage})
    }
}

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    ApiBody(body): ApiBody,
) -> Result<Response, ApiError> {
    let api::ValidChat {
        messages,
        structure,
        template_messages,
        mut checked,
    } = api::validate_chat(&body, st.info.n_ctx, st.fresh_seed())?;
    if !st.info.has_chat_template {
        return Err(ApiError::invalid(
            "This model has no chat template; use /v1/completions.",
            Some("messages"),
        ));
    }
    if structure.response_format.is_some() || structure.parses_tool_calls() {
        let param = if structure.tools.is_some() {
            "tools"
        } else {
            "response_format"
        };
        checked.params.constraint = structure.constraint(st.grammars(param)?)?;
    }
    let prompt = match template_messages {
        Some(messages) => Prompt::ChatJson {
            messages,
            tools: structure.prompt_tools().cloned(),
        },
        None => Prompt::Chat(messages),
    };
    let rx = st.submit(prompt, &checked).await?;
    let id = format!("chatcmpl-{}", st.next_id());
    let created = now_secs();
    let model = st.info.id.clone();
    if checked.stream {
        let mut chunker = ChatChunker {
            id,
            created,
            model,
            pieces: st.info.pieces.clone(),
            tools: structure.parses_tool_calls().then(ToolCallStream::default),
            logprobs: structure.logprobs.is_some(),
            pending: Vec::new(),
        };
        let first = chunker.chunk(json!({"role": "assistant", "content": ""}), None, None);
        return Ok(sse_stream(rx, Some(first), checked.include_usage, chunker));
    }
    let c = collect(rx).await?;
    let logprobs = match structure.logprobs {
        Some(_) => structured::chat_logprobs(&st.info.pieces, &c.logprobs),
        None => serde_json::Value::Null,
    };
    let mut finish = c.finish;
    let message = if structure.parses_tool_calls() {
        let (content, calls) = parse_tool_calls(&c.text);
        if calls.is_empty() {
            json!({"role": "assistant", "content": content})
        } else {
            finish = "tool_calls";
            json!({"role": "assistant", "content": (!content.is_empty()).then_some(content),
                   "tool_calls": structured::tool_calls_json(&id, &calls)})
        }
    } else {
        json!({"role": "assistant", "content": c.text})
    };
    Ok(Json(json!({
        "id": id, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": "mirage",
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
        "usage": c.usage,
    }))
    .into_response())
}

/// The chunks of a legacy completion stream.
struct CompletionChunker {
    id: String,
    created: u64,
    model: String,
    pieces: Arc<TokenPieces>,
    logprobs: bool,
    pending: Vec<TokenLogprob>,
    /// Bytes of text sent so far (`text_offset` of the next token).
    offset: usize,
}

impl CompletionChunker {
    fn chunk(
        &mut self,
        text: &str,
        finish: Option<&str>,
        usage: Option<Usage>,
    ) -> serde_json::Value {
        let logprobs = if self.logprobs {
            let v = structured::completion_logprobs_json(&self.pieces, &self.pending, self.offset);
            self.pending.clear();
            v
        } else {
            serde_json::Value::Null
        };
        self.offset += text.len();
        let mut v = json!({
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        });
        if let Some(u) = usage {
            v["usage"] = json!(u);
        }
        v
    }
}

impl Chunker for CompletionChunker {
    fn text(&mut self, text: &str) -> Vec<serde_json::Value> {
        vec![self.chunk(text, None, None)]
    }

    fn logprob(&mut self, l: TokenLogprob) {
        self.pending.push(l);
    }

    fn finish(&mut self, finish: &'static str, usage: Usage) -> Vec<serde_json::Value> {
        vec![self.chunk("", Some(finish), Some(usage))]
    }

    fn usage_only(&self, usage: Usage) -> serde_json::Value {
        json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
               "choices": [], "usage": usage})
    }
}

async fn completions(
    State(st): State<Arc<AppState>>,
    ApiBody(body): ApiBody,
) -> Result<Response, ApiError> {
    let api::ValidCompletion {
        prompt,
        echo,
        checked,
    } = api::validate_completion(&body, st.info.n_ctx, st.fresh_seed())?;
    let rx = st.submit(prompt, &checked).await?;
    let id = format!("cmpl-{}", st.next_id());
    let created = now_secs();
    let model = st.info.id.clone();
    let want_logprobs = checked.params.logprobs.is_some();
    if checked.stream {
        let mut chunker = CompletionChunker {
            id,
            created,
            model,
            pieces: st.info.pieces.clone(),
            logprobs: want_logprobs,
            pending: Vec::new(),
            offset: 0,
        };
        let first = echo.map(|e| chunker.chunk(&e, None, None));
        return Ok(sse_stream(rx, first, checked.include_usage, chunker));
    }
    let c = collect(rx).await?;
    let offset = echo.as_ref().map_or(0, String::len);
    let text = match echo {
        Some(e) => e + &c.text,
        None => c.text,
    };
    let logprobs = if want_logprobs {
        structured::completion_logprobs_json(&st.info.pieces, &c.logprobs, offset)
    } else {
        serde_json::Value::Null
    };
    Ok(Json(json!({
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": c.finish}],
        "usage": c.usage,
    }))
    .into_response())
}

/// Most inputs of one `/v1/embeddings` request (they run whole between
/// decode steps).
pub const MAX_EMBEDDING_INPUTS: usize = 256;

async fn embeddings(
    State(st): State<Arc<AppState>>,
    ApiBody(body): ApiBody,
) -> Result<Response, ApiError> {
    let (input, encoding) = api::validate_embeddings(&body, MAX_EMBEDDING_INPUTS)?;
    let mut rx = st.queue(Work::Embed(input))?;
    match rx.recv().await {
        Some(JobEvent::Embeddings {
            vectors,
            prompt_tokens,
        }) => Ok(Json(structured::embeddings_json(
            &st.info.id,
            &vectors,
            prompt_tokens,
            encoding,
        ))
        .into_response()),
        Some(JobEvent::Failed(e)) => Err(e),
        Some(other) => Err(ApiError::internal(format!(
            "scheduler answered {other:?} to an embedding request"
        ))),
        None => Err(ApiError::shutting_down()),
    }
}

fn model_json(info: &ModelInfo) -> serde_json::Value {
    json!({"id": info.id, "object": "model", "created": info.created, "owned_by": "mirage",
           "context_length": info.n_ctx, "backend": info.backend, "artifact": info.artifact})
}

async fn list_models(State(st): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({"object": "list", "data": [model_json(&st.info)]}))
}

async fn get_model(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    if id == st.info.id {
        Ok(Json(model_json(&st.info)))
    } else {
        Err(ApiError {
            status: StatusCode::NOT_FOUND,
            param: Some("model".into()),
            ..ApiError::invalid(format!("The model `{id}` does not exist."), None)
                .with_code("model_not_found")
        })
    }
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    let m = &st.metrics;
    let down = st.shutting_down.load(Ordering::Relaxed);
    let body = json!({
        "status": if down { "shutting_down" } else { "ok" },
        "model": st.info.id,
        "active_sequences": m.active_sequences.load(Ordering::Relaxed),
        "queue_depth": m.queue_depth.load(Ordering::Relaxed),
        "max_batch": m.max_batch,
    });
    let status = if down {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    (status, Json(body)).into_response()
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let mut r = Response::new(Body::from(st.metrics.render()));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    r
}
