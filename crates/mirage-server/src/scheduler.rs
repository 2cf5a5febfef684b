//! The scheduler thread: owns the engine and a [`Batcher`], admits queued
//! jobs between decode steps (continuous batching), streams text back to
//! each job's channel and frees the sequence of a job whose receiver is
//! gone (client disconnected).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mirage::{Backend, Engine, LoadSpec, WithEngine};
use mirage_grammar::GrammarCompiler;
use mirage_runtime::batch::{Batcher, SeqEvent};
use mirage_runtime::{GenerateParams, StopReason, TokenLogprob};
use tokio::sync::mpsc;

use crate::api::Prompt;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::structured::{EmbeddingInput, TokenPieces};

/// What the scheduler tells a job's handler.
#[derive(Debug)]
pub enum JobEvent {
    /// The job holds a sequence slot; its prompt has this many tokens.
    Started {
        /// Prompt tokens.
        prompt_tokens: usize,
    },
    /// Generated text.
    Text(String),
    /// The log-probability of the next generated token (before the text
    /// it completes), when the job asked for them.
    Logprob(TokenLogprob),
    /// The vectors of an embedding job, in input order.
    Embeddings {
        /// One unit vector per input.
        vectors: Vec<Vec<f32>>,
        /// Tokens over all inputs.
        prompt_tokens: usize,
    },
    /// Generation ended.
    Done {
        /// Why.
        reason: StopReason,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Generated tokens.
        completion_tokens: usize,
    },
    /// The job could not run (before `Started`) or the engine failed.
    Failed(ApiError),
}

/// What a job asks the engine for.
#[derive(Debug)]
pub enum Work {
    /// A generation.
    Generate {
        /// The prompt.
        prompt: Prompt,
        /// Settings; `max_tokens` 0 means "the room the prompt leaves".
        params: GenerateParams,
    },
    /// Embeddings of the inputs (run between decode steps, whole).
    Embed(EmbeddingInput),
}

/// One request for the scheduler.
#[derive(Debug)]
pub struct Job {
    /// What to do.
    pub work: Work,
    /// Where events go; dropped by the handler when the client leaves.
    pub events: mpsc::UnboundedSender<JobEvent>,
    /// When the request arrived.
    pub arrived: Instant,
}

/// Facts about the loaded model, for /v1/models and request checks.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The model id clients see (file stem).
    pub id: String,
    /// Positions per sequence.
    pub n_ctx: usize,
    /// Backend name (`cpu`, `cuda`, `superblock-cpu`).
    pub backend: String,
    /// The artifact file's name, when the FFN runs from one.
    pub artifact: Option<String>,
    /// Whether chat requests can be rendered.
    pub has_chat_template: bool,
    /// Compiles response formats and tool-call grammars for this
    /// vocabulary; `Err`: why the model cannot have them.
    pub grammars: Result<Arc<GrammarCompiler>, String>,
    /// Token bytes, for log-probability answers.
    pub pieces: Arc<TokenPieces>,
    /// Unix seconds when it was loaded.
    pub created: u64,
}

/// How to start the scheduler.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Model, artifact, backend choice and engine options (threads,
    /// context, prompt chunk), for the shared loader.
    pub load: LoadSpec,
    /// Concurrent sequences.
    pub max_batch: usize,
}

/// Handle of the running scheduler thread.
pub struct Scheduler {
    /// Model facts.
    pub info: ModelInfo,
    /// Set to cancel everything in flight (second stage of shutdown).
    pub cancel_all: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Scheduler {
    /// Loads the model on a new thread and starts serving `jobs`.
    pub fn start(
        cfg: SchedulerConfig,
        jobs: mpsc::Receiver<Job>,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Scheduler> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<ModelInfo, String>>();
        let cancel_all = Arc::new(AtomicBool::new(false));
        let cancel = cancel_all.clone();
        let thread = std::thread::Builder::new()
            .name("mirage-scheduler".into())
            .spawn(move || {
                let serve = Serve {
                    cfg: &cfg,
                    ready: ready_tx.clone(),
                    jobs,
                    metrics: &metrics,
                    cancel: &cancel,
                };
                if let Err(e) = mirage::load(&cfg.load, serve) {
                    let _ = ready_tx.send(Err(e.to_string()));
                }
            })?;
        match ready_rx.recv() {
            Ok(Ok(info)) => Ok(Scheduler {
                info,
                cancel_all,
                thread,
            }),
            Ok(Err(e)) => Err(anyhow::anyhow!(e)),
            Err(_) => Err(anyhow::anyhow!(
                "the scheduler thread died while loading the model"
            )),
        }
    }

    /// Waits for the thread to end (after every job sender is dropped).
    pub fn join(self) {
        let _ = self.thread.join();
    }
}

/// The scheduler's work once the shared loader has built the engine on
/// whichever backend was chosen (compiled once per backend type).
struct Serve<'a> {
    cfg: &'a SchedulerConfig,
    ready: std::sync::mpsc::Sender<Result<ModelInfo, String>>,
    jobs: mpsc::Receiver<Job>,
    metrics: &'a Metrics,
    cancel: &'a AtomicBool,
}

impl WithEngine for Serve<'_> {
    type Out = ();
    fn run<B: Backend>(self, engine: Engine<B>) {
        let cfg = self.cfg;
        let id = cfg
            .load
            .model
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let info = ModelInfo {
            id,
            n_ctx: engine.n_ctx(),
            backend: engine.backend_name(),
            artifact: cfg.load.artifact.as_ref().map(|a| {
                a.path
                    .file_name()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default()
            }),
            has_chat_template: engine.chat_template().is_some(),
            grammars: GrammarCompiler::new(engine.tokenizer(), engine.model().config().vocab_size)
                .map(Arc::new)
                .map_err(|e| e.to_string()),
            pieces: Arc::new(TokenPieces::new(engine.tokenizer())),
            created,
        };
        let batcher = match Batcher::new(&engine, cfg.max_batch, cfg.load.options.n_batch) {
            Ok(b) => b,
            Err(e) => {
                let _ = self.ready.send(Err(format!(
                    "KV cache for {} sequences: {e}",
                    cfg.max_batch
                )));
                return;
            }
        };
        let _ = self.ready.send(Ok(info));
        run(&engine, batcher, self.jobs, self.metrics, self.cancel);
    }
}

struct Running {
    events: mpsc::UnboundedSender<JobEvent>,
    arrived: Instant,
    first_text: bool,
}

fn tokenize<B: Backend>(engine: &Engine<B>, prompt: &Prompt) -> Result<Vec<u32>, ApiError> {
    let vocab = engine.model().config().vocab_size;
    match prompt {
        Prompt::Chat(messages) => {
            let text = engine
                .render_chat(messages)
                .map_err(|e| ApiError::invalid(format!("Chat template: {e}"), Some("messages")))?;
            engine
                .encode(&text, true)
                .map_err(|e| ApiError::invalid(format!("Tokenizer: {e}"), Some("messages")))
        }
        Prompt::ChatJson { messages, tools } => {
            let template = engine.chat_template().ok_or_else(|| {
                ApiError::invalid("This model has no chat template.", Some("messages"))
            })?;
            let text = template
                .render_json(messages, tools.as_ref(), true)
                .map_err(|e| ApiError::invalid(format!("Chat template: {e}"), Some("messages")))?;
            engine
                .encode(&text, true)
                .map_err(|e| ApiError::invalid(format!("Tokenizer: {e}"), Some("messages")))
        }
        Prompt::Text(text) => engine
            .encode(text, true)
            .map_err(|e| ApiError::invalid(format!("Tokenizer: {e}"), Some("prompt"))),
        Prompt::Tokens(t) => match t.iter().find(|&&id| id as usize >= vocab) {
            Some(bad) => Err(ApiError::invalid(
                format!("Token id {bad} is outside the vocabulary ({vocab})."),
                Some("prompt"),
            )),
            None => Ok(t.clone()),
        },
    }
}

/// Tokens per second over a sliding window of recent steps.
struct Throughput {
    window: VecDeque<(Instant, usize)>,
}

impl Throughput {
    fn record(&mut self, now: Instant, tokens: usize) -> f64 {
        self.window.push_back((now, tokens));
        while self
            .window
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > Duration::from_secs(5))
        {
            self.window.pop_front();
        }
        let first = self.window.front().map(|(t, _)| *t).unwrap_or(now);
        let secs = now.duration_since(first).as_secs_f64().max(1e-3);
        let total: usize = self.window.iter().skip(1).map(|(_, n)| n).sum();
        if self.window.len() < 2 {
            0.0
        } else {
            total as f64 / secs
        }
    }
}

/// Runs an embedding job whole: tokenizes (with BOS where the model wants
/// it), refuses inputs longer than the context, embeds.
fn embed<B: Backend>(engine: &Engine<B>, input: &EmbeddingInput) -> Result<JobEvent, ApiError> {
    let tokens = match input {
        EmbeddingInput::Texts(texts) => texts
            .iter()
            .map(|t| engine.encode(t, true))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ApiError::invalid(format!("Tokenizer: {e}"), Some("input")))?,
        EmbeddingInput::Tokens(t) => t.clone(),
    };
    let vocab = engine.model().config().vocab_size;
    let n_ctx = engine.n_ctx();
    for (i, t) in tokens.iter().enumerate() {
        if let Some(bad) = t.iter().find(|&&id| id as usize >= vocab) {
            return Err(ApiError::invalid(
                format!("input[{i}]: token id {bad} is outside the vocabulary ({vocab})."),
                Some("input"),
            ));
        }
        if t.len() > n_ctx {
            return Err(ApiError::invalid(
                format!(
                    "input[{i}] has {} tokens; this model's context holds {n_ctx}.",
                    t.len()
                ),
                Some("input"),
            )
            .with_code("context_length_exceeded"));
        }
    }
    let vectors = engine
        .embed_tokens(&tokens)
        .map_err(|e| ApiError::internal(format!("engine: {e}")))?;
    Ok(JobEvent::Embeddings {
        vectors,
        prompt_tokens: tokens.iter().map(Vec::len).sum(),
    })
}

fn run<B: Backend>(
    engine: &Engine<B>,
    mut batcher: Batcher<'_, B>,
    mut jobs: mpsc::Receiver<Job>,
    m: &Metrics,
    cancel_all: &AtomicBool,
) {
    let n_ctx = engine.n_ctx();
    let mut running: Vec<Option<Running>> = (0..batcher.capacity()).map(|_| None).collect();
    let mut events = Vec::new();
    let mut closed = false;
    let mut throughput = Throughput {
        window: VecDeque::new(),
    };
    let set_active = |b: &Batcher<'_, B>| {
        m.active_sequences
            .store(b.active() as i64, Ordering::Relaxed)
    };
    loop {
        // Admit queued jobs into free slots; block only when idle.
        while !closed && batcher.free_slots() > 0 {
            let job = if batcher.active() == 0 {
                match jobs.blocking_recv() {
                    Some(j) => j,
                    None => {
                        closed = true;
                        break;
                    }
                }
            } else {
                match jobs.try_recv() {
                    Ok(j) => j,
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        closed = true;
                        break;
                    }
                }
            };
            m.queue_depth.fetch_sub(1, Ordering::Relaxed);
            if job.events.is_closed() {
                // The client left while queued.
                m.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if cancel_all.load(Ordering::Relaxed) {
                let _ = job.events.send(JobEvent::Failed(ApiError::shutting_down()));
                continue;
            }
            let (job_prompt, job_params) = match job.work {
                Work::Generate { prompt, params } => (prompt, params),
                Work::Embed(input) => {
                    let ev = embed(engine, &input).unwrap_or_else(JobEvent::Failed);
                    let _ = job.events.send(ev);
                    continue;
                }
            };
            let prompt = match tokenize(engine, &job_prompt) {
                Ok(p) => p,
                Err(e) => {
                    let _ = job.events.send(JobEvent::Failed(e));
                    continue;
                }
            };
            let mut params = job_params;
            let room = n_ctx.saturating_sub(prompt.len());
            if params.max_tokens == 0 {
                params.max_tokens = room;
            }
            if prompt.len() + params.max_tokens > n_ctx || room == 0 {
                let e = ApiError::invalid(
                    format!(
                        "This model's maximum context length is {n_ctx} tokens. However, you requested {} tokens ({} in the prompt, {} for the completion).",
                        prompt.len() + params.max_tokens,
                        prompt.len(),
                        params.max_tokens
                    ),
                    Some(if matches!(job_prompt, Prompt::Chat(_) | Prompt::ChatJson { .. }) { "messages" } else { "prompt" }),
                )
                .with_code("context_length_exceeded");
                let _ = job.events.send(JobEvent::Failed(e));
                continue;
            }
            let prompt_tokens = prompt.len();
            match batcher.add(prompt, &params) {
                Ok(slot) => {
                    m.queue_wait.observe(job.arrived.elapsed().as_secs_f64());
                    m.prompt_tokens
                        .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
                    let _ = job.events.send(JobEvent::Started { prompt_tokens });
                    running[slot] = Some(Running {
                        events: job.events,
                        arrived: job.arrived,
                        first_text: false,
                    });
                }
                Err(e) => {
                    let _ = job
                        .events
                        .send(JobEvent::Failed(ApiError::invalid(e.to_string(), None)));
                }
            }
        }
        set_active(&batcher);
        if batcher.active() == 0 {
            if closed {
                break;
            }
            continue;
        }
        // Free the slots of clients that went away before spending a step on them.
        let stop_everything = cancel_all.load(Ordering::Relaxed);
        for (slot, r) in running.iter_mut().enumerate() {
            let gone = r.as_ref().is_some_and(|r| r.events.is_closed());
            if gone || (stop_everything && r.is_some()) {
                if let Some(r) = r.take() {
                    if !gone {
                        let _ = r.events.send(JobEvent::Failed(ApiError::shutting_down()));
                    }
                }
                batcher.cancel(slot);
                m.cancelled.fetch_add(1, Ordering::Relaxed);
            }
        }
        set_active(&batcher);
        if batcher.active() == 0 {
            continue;
        }
        events.clear();
        let stats = match batcher.step(&mut events) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!("forward pass failed: {e}");
                for (slot, r) in running.iter_mut().enumerate() {
                    if let Some(r) = r.take() {
                        let _ = r
                            .events
                            .send(JobEvent::Failed(ApiError::internal(format!("engine: {e}"))));
                        batcher.cancel(slot);
                    }
                }
                set_active(&batcher);
                continue;
            }
        };
        m.steps.fetch_add(1, Ordering::Relaxed);
        m.step_latency.observe(stats.secs);
        let tps = throughput.record(Instant::now(), stats.sampled);
        m.tokens_per_second.store(tps.to_bits(), Ordering::Relaxed);
        for ev in events.drain(..) {
            match ev {
                SeqEvent::Text { slot, text } => {
                    let Some(r) = running[slot].as_mut() else {
                        continue;
                    };
                    if !r.first_text {
                        r.first_text = true;
                        m.time_to_first_token
                            .observe(r.arrived.elapsed().as_secs_f64());
                    }
                    if r.events.send(JobEvent::Text(text)).is_err() {
                        running[slot] = None;
                        batcher.cancel(slot);
                        m.cancelled.fetch_add(1, Ordering::Relaxed);
                    }
                }
                SeqEvent::Logprob { slot, logprob } => {
                    if let Some(r) = running[slot].as_ref() {
                        let _ = r.events.send(JobEvent::Logprob(logprob));
                    }
                }
                SeqEvent::Finished {
                    slot,
                    reason,
                    prompt_tokens,
                    completion_tokens,
                } => {
                    m.completion_tokens
                        .fetch_add(completion_tokens as u64, Ordering::Relaxed);
                    if let Some(r) = running[slot].take() {
                        m.request_latency.observe(r.arrived.elapsed().as_secs_f64());
                        let _ = r.events.send(JobEvent::Done {
                            reason,
                            prompt_tokens,
                            completion_tokens,
                        });
                    }
                }
            }
        }
        set_active(&batcher);
    }
    m.active_sequences.store(0, Ordering::Relaxed);
}
