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
use crate::scheduler::{Job, JobEvent, ModelInfo};

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

/// The application router. Checks run in this order: `Host` and `Origin`
/// ([`access`]), CORS when on, the API key (on `/v1/*` and `/metrics`),
/// then the handler, which reads the body ([`crate::body`]).
pub fn router(state: Arc<AppState>) -> Router {
    let keyed = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    let mut app = Router::new()
        .merge(keyed)
        .route("/", get(|| async { Html(CHAT_PAGE) }))
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

    /// Queues a job and waits until it holds a sequence slot.
    async fn submit(
        &self,
        prompt: Prompt,
        checked: &Checked,
    ) -> Result<(mpsc::UnboundedReceiver<JobEvent>, usize), ApiError> {
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(ApiError::shutting_down());
        }
        let (tx, mut rx) = mpsc::unbounded_channel();
        let job = Job {
            prompt,
            params: checked.params.clone(),
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
        match rx.recv().await {
            Some(JobEvent::Started { prompt_tokens }) => Ok((rx, prompt_tokens)),
            Some(JobEvent::Failed(e)) => Err(e),
            Some(other) => Err(ApiError::internal(format!(
                "scheduler answered {other:?} before starting"
            ))),
            None => Err(ApiError::shutting_down()),
        }
    }
}

/// Collects a whole generation.
async fn collect(
    mut rx: mpsc::UnboundedReceiver<JobEvent>,
    prompt_tokens: usize,
) -> Result<(String, &'static str, Usage), ApiError> {
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            JobEvent::Text(t) => text.push_str(&t),
            JobEvent::Done {
                reason,
                prompt_tokens,
                completion_tokens,
            } => {
                return Ok((
                    text,
                    api::finish_reason(reason),
                    Usage::new(prompt_tokens, completion_tokens),
                ))
            }
            JobEvent::Failed(e) => return Err(e),
            JobEvent::Started { .. } => {}
        }
    }
    let _ = prompt_tokens;
    Err(ApiError::internal(
        "the scheduler stopped before the generation ended",
    ))
}

fn sse_json(v: &serde_json::Value) -> Result<Event, Infallible> {
    Ok(Event::default().data(v.to_string()))
}

/// Builds the event stream of a generation; `chunk(text, finish, usage)`
/// shapes one chunk of the endpoint's kind.
fn sse_stream(
    mut rx: mpsc::UnboundedReceiver<JobEvent>,
    first: Option<serde_json::Value>,
    include_usage: bool,
    chunk: impl Fn(Option<&str>, Option<&str>, Option<Usage>) -> serde_json::Value + Send + 'static,
    usage_only: impl Fn(Usage) -> serde_json::Value + Send + 'static,
) -> Response {
    let stream = async_stream::stream! {
        if let Some(first) = first {
            yield sse_json(&first);
        }
        while let Some(ev) = rx.recv().await {
            match ev {
                JobEvent::Text(t) => yield sse_json(&chunk(Some(&t), None, None)),
                JobEvent::Done { reason, prompt_tokens, completion_tokens } => {
                    let usage = Usage::new(prompt_tokens, completion_tokens);
                    yield sse_json(&chunk(None, Some(api::finish_reason(reason)), Some(usage)));
                    if include_usage {
                        yield sse_json(&usage_only(usage));
                    }
                    break;
                }
                JobEvent::Failed(e) => {
                    yield Ok(Event::default().data(e.body_json()));
                    break;
                }
                JobEvent::Started { .. } => {}
            }
        }
        yield Ok(Event::default().data("[DONE]"));
    };
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    ApiBody(body): ApiBody,
) -> Result<Response, ApiError> {
    let api::ValidChat { messages, checked } =
        api::validate_chat(&body, st.info.n_ctx, st.fresh_seed())?;
    if !st.info.has_chat_template {
        return Err(ApiError::invalid(
            "This model has no chat template; use /v1/completions.",
            Some("messages"),
        ));
    }
    let (rx, prompt_tokens) = st.submit(Prompt::Chat(messages), &checked).await?;
    let id = format!("chatcmpl-{}", st.next_id());
    let created = now_secs();
    let model = st.info.id.clone();
    if checked.stream {
        let (id2, model2) = (id.clone(), model.clone());
        let head = move |delta: serde_json::Value, finish: Option<&str>, usage: Option<Usage>| {
            let mut v = json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": "mirage",
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
            });
            if let Some(u) = usage {
                v["usage"] = json!(u);
            }
            v
        };
        let first = head(json!({"role": "assistant", "content": ""}), None, None);
        let chunk = move |text: Option<&str>, finish: Option<&str>, usage: Option<Usage>| {
            let delta = match text {
                Some(t) => json!({"content": t}),
                None => json!({}),
            };
            head(delta, finish, usage)
        };
        let usage_only = move |u: Usage| {
            json!({"id": id2, "object": "chat.completion.chunk", "created": created, "model": model2,
                   "system_fingerprint": "mirage", "choices": [], "usage": u})
        };
        return Ok(sse_stream(
            rx,
            Some(first),
            checked.include_usage,
            chunk,
            usage_only,
        ));
    }
    let (text, finish, usage) = collect(rx, prompt_tokens).await?;
    Ok(Json(json!({
        "id": id, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": "mirage",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish}],
        "usage": usage,
    }))
    .into_response())
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
    let (rx, prompt_tokens) = st.submit(prompt, &checked).await?;
    let id = format!("cmpl-{}", st.next_id());
    let created = now_secs();
    let model = st.info.id.clone();
    if checked.stream {
        let (id2, model2) = (id.clone(), model.clone());
        let chunk = move |text: Option<&str>, finish: Option<&str>, usage: Option<Usage>| {
            let mut v = json!({
                "id": id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish}],
            });
            if let Some(u) = usage {
                v["usage"] = json!(u);
            }
            v
        };
        let first = echo.map(|e| chunk(Some(&e), None, None));
        let usage_only = move |u: Usage| json!({"id": id2, "object": "text_completion", "created": created, "model": model2, "choices": [], "usage": u});
        return Ok(sse_stream(
            rx,
            first,
            checked.include_usage,
            chunk,
            usage_only,
        ));
    }
    let (text, finish, usage) = collect(rx, prompt_tokens).await?;
    let text = match echo {
        Some(e) => e + &text,
        None => text,
    };
    Ok(Json(json!({
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
        "usage": usage,
    }))
    .into_response())
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
