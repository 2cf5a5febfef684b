//! The high-level API: load a model file into an [`Engine`] (tokenizer,
//! chat template, weights on a backend), open a [`Session`] (KV cache and
//! buffers), generate text with a callback per piece of text.
//!
//! ```no_run
//! use mirage_runtime::{Engine, EngineOptions, GenerateParams};
//! let engine = Engine::load("models/smollm2-135m-instruct-q4_1.gguf", EngineOptions::default())?;
//! let mut session = engine.session()?;
//! let out = session.generate("The capital of France is", &GenerateParams::default(), |piece| {
//!     print!("{piece}");
//!     true // keep going
//! })?;
//! eprintln!("\n{:.1} tok/s", out.stats.decode_tok_s());
//! # Ok::<(), mirage_runtime::RuntimeError>(())
//! ```

use std::path::Path;
use std::sync::Arc;

use mirage_gguf::{FileMemory, GgufFile};
use mirage_tokenizer::{ChatMessage, ChatTemplate, Tokenizer};

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, TokenSlot};
use crate::constraint::{Constraint, ConstraintState, TokenMask};
use crate::error::{Result, RuntimeError};
use crate::kv_cache::KvDtype;
use crate::model::{Model, Scratch};
use crate::sampling::{Sampler, SamplingParams, TokenLogprob};

fn tok_err(e: mirage_tokenizer::TokenizerError) -> RuntimeError {
    RuntimeError::Tokenizer(e.to_string())
}

/// How to build an [`Engine`] and its sessions.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineOptions {
    /// CPU worker threads (0: one per logical CPU).
    pub threads: usize,
    /// Positions per session (0: the training context, capped at 4096). At
    /// most the training context, or the context the file's RoPE scaling
    /// extends it to ([`crate::ModelConfig::max_context`]); a session's KV
    /// cache must also fit the memory available ([`crate::memory`]).
    pub n_ctx: usize,
    /// KV cache element type.
    pub kv_dtype: KvDtype,
    /// Most tokens per forward pass during prefill.
    pub n_batch: usize,
    /// Decode attention over selected KV pages only (see
    /// [`crate::kv_pages`]); `None`: every position. Prefill always attends
    /// every position. Backends without pruned attention refuse it.
    pub kv_pruning: Option<crate::kv_pages::KvPruning>,
    /// Batch-invariant (deterministic) arithmetic: every row of a forward
    /// pass goes through the same kernels in the same order whatever else
    /// is in the batch and however a prompt is split into chunks, so a
    /// sequence's logits are the same bits alone, in a session, or batched
    /// with other requests (its greedy or seeded tokens follow). It costs
    /// speed (no multi-row kernels). The backend must honour it: one that
    /// cannot refuses it at load ([`RuntimeError::Unsupported`]); it does
    /// not combine with `kv_pruning` (a one-row prompt chunk is pruned like
    /// a decode step, so chunking would change the result).
    pub deterministic: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            threads: 0,
            n_ctx: 0,
            kv_dtype: KvDtype::F32,
            n_batch: 256,
            kv_pruning: None,
            deterministic: false,
        }
    }
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    /// Most new tokens.
    pub max_tokens: usize,
    /// Sampler settings.
    pub sampling: SamplingParams,
    /// Generation stops before the first occurrence of any of these.
    pub stop: Vec<String>,
    /// Only tokens this allows are sampled (a grammar or JSON schema from
    /// `mirage-grammar`); end-of-generation only where it may end.
    pub constraint: Option<Arc<dyn Constraint>>,
    /// Report each generated token's log-probability with this many most
    /// likely alternatives (0..=20; see [`token_logprob`]); `None`: none.
    pub logprobs: Option<usize>,
}

impl GenerateParams {
    /// Refuses sampling parameters out of range ([`SamplingParams::validate`]).
    pub fn validate(&self) -> Result<()> {
        self.sampling.validate()
    }
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_tokens: 128,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            constraint: None,
            logprobs: None,
        }
    }
}

impl PartialEq for GenerateParams {
    /// Constraints compare by identity (the same compiled grammar).
    fn eq(&self, other: &Self) -> bool {
        self.max_tokens == other.max_tokens
            && self.sampling == other.sampling
            && self.stop == other.stop
            && self.logprobs == other.logprobs
            && match (&self.constraint, &other.constraint) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            }
    }
}

/// A constraint's per-generation state and the mask it fills each step.
pub(crate) struct ActiveConstraint {
    state: Box<dyn ConstraintState>,
    mask: TokenMask,
}

impl ActiveConstraint {
    /// Starts `params`' constraint, if any, for logits of `vocab` tokens.
    pub(crate) fn start(params: &GenerateParams, vocab: usize) -> Result<Option<ActiveConstraint>> {
        params
            .constraint
            .as_ref()
            .map(|c| {
                Ok(ActiveConstraint {
                    state: c.start().map_err(RuntimeError::Constraint)?,
                    mask: TokenMask::new(vocab),
                })
            })
            .transpose()
    }

    /// The mask for the next sample.
    pub(crate) fn mask(&mut self) -> Result<&TokenMask> {
        self.mask.clear();
        self.state
            .fill_mask(&mut self.mask)
            .map_err(RuntimeError::Constraint)?;
        Ok(&self.mask)
    }

    /// Advances past a sampled token that is not end-of-generation.
    pub(crate) fn accept(&mut self, token: u32) -> Result<()> {
        self.state.accept(token).map_err(RuntimeError::Constraint)
    }
}

/// Samples the next token under an optional constraint: `None` when the
/// constraint allows nothing (the generation must end).
pub(crate) fn sample_next(
    sampler: &mut Sampler,
    logits: &[f32],
    history: &[u32],
    constraint: Option<&mut ActiveConstraint>,
) -> Result<Option<u32>> {
    match constraint {
        None => Ok(Some(sampler.sample(logits, history))),
        Some(c) => {
            let mask = c.mask()?;
            Ok(sampler.sample_masked(logits, history, Some(mask)))
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The model produced an end-of-generation token.
    EndOfGeneration,
    /// `max_tokens` were generated.
    MaxTokens,
    /// A stop string appeared.
    StopString,
    /// The callback asked to stop.
    Callback,
    /// The KV cache is full.
    ContextFull,
}

/// Counts and timings of one generation.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationStats {
    /// Tokens run through the model before the first sample (new ones only:
    /// a prefix already in the cache is not counted).
    pub prompt_tokens: usize,
    /// Tokens sampled.
    pub generated_tokens: usize,
    /// Decode forward passes (one per generated token except the last).
    pub decode_steps: usize,
    /// Seconds of the prompt forward passes.
    pub prompt_secs: f64,
    /// Seconds of the decode forward passes and sampling.
    pub decode_secs: f64,
    /// Why it stopped.
    pub stop_reason: StopReason,
}

impl GenerationStats {
    /// Prompt tokens per second.
    pub fn prompt_tok_s(&self) -> f64 {
        if self.prompt_secs > 0.0 {
            self.prompt_tokens as f64 / self.prompt_secs
        } else {
            0.0
        }
    }
    /// Decode steps per second.
    pub fn decode_tok_s(&self) -> f64 {
        if self.decode_secs > 0.0 {
            self.decode_steps as f64 / self.decode_secs
        } else {
            0.0
        }
    }
}

/// The result of [`Session::generate`].
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// The generated text (stop string excluded).
    pub text: String,
    /// The generated token ids (end-of-generation token excluded). The
    /// session's cache holds all of them, except the last one when a stop
    /// string or the callback ended generation.
    pub tokens: Vec<u32>,
    /// Counts and timings.
    pub stats: GenerationStats,
    /// One entry per token of `tokens` when [`GenerateParams::logprobs`]
    /// asked for them, else empty.
    pub logprobs: Vec<TokenLogprob>,
}

/// A loaded model with its tokenizer, ready to open sessions.
pub struct Engine<B: Backend = CpuBackend> {
    model: Model<B>,
    tokenizer: Tokenizer,
    /// The compiled template, or why there is none (missing from the file,
    /// or present and broken: said as such when a chat is rendered).
    chat_template: std::result::Result<ChatTemplate, String>,
    options: EngineOptions,
    n_ctx: usize,
    /// How the model file's bytes are held.
    file_memory: FileMemory,
}

impl<B: Backend> std::fmt::Debug for Engine<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("model", &self.model)
            .field("n_ctx", &self.n_ctx)
            .finish()
    }
}

impl Engine<CpuBackend> {
    /// Loads a GGUF model onto the CPU backend.
    pub fn load(path: impl AsRef<Path>, options: EngineOptions) -> Result<Engine<CpuBackend>> {
        let backend = CpuBackend::new(options.threads)?;
        Engine::load_with_backend(path, backend, options)
    }
}

impl<B: Backend> Engine<B> {
    /// Loads a GGUF model onto `backend`.
    pub fn load_with_backend(
        path: impl AsRef<Path>,
        backend: B,
        options: EngineOptions,
    ) -> Result<Engine<B>> {
        let file = Arc::new(GgufFile::open(path)?);
        Engine::from_file(file, backend, options)
    }

    /// Builds an engine from an opened GGUF file.
    pub fn from_file(
        file: Arc<GgufFile>,
        mut backend: B,
        options: EngineOptions,
    ) -> Result<Engine<B>> {
        if options.deterministic && options.kv_pruning.is_some() {
            return Err(RuntimeError::InvalidArgument(
                "deterministic mode does not combine with KV-page pruning (a one-row prompt \
                 chunk is pruned like a decode step, so results would depend on the batch)"
                    .into(),
            ));
        }
        // Before any upload: the backend picks its kernels per matrix.
        backend.set_deterministic(options.deterministic)?;
        let tokenizer = Tokenizer::from_gguf(&file).map_err(tok_err)?;
        let chat_template = ChatTemplate::from_gguf(&file).map_err(|e| match e {
            mirage_tokenizer::TokenizerError::MissingKey(_) => {
                "the model has no chat template".to_string()
            }
            e => e.to_string(),
        });
        let file_memory = file.memory();
        let model = Model::load(file, backend)?;
        let train = model.config().n_ctx_train.max(1);
        let n_ctx = if options.n_ctx == 0 {
            train.min(4096)
        } else {
            options.n_ctx
        };
        // Before any cache is sized by it.
        model.config().check_context(n_ctx)?;
        Ok(Engine {
            model,
            tokenizer,
            chat_template,
            options,
            n_ctx,
            file_memory,
        })
    }

    /// How the model file's bytes are held: mapped, or read into memory
    /// (see [`mirage_gguf::resident`]).
    pub fn file_memory(&self) -> FileMemory {
        self.file_memory
    }

    /// The model.
    pub fn model(&self) -> &Model<B> {
        &self.model
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The chat template, when the file has one that compiles.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref().ok()
    }

    /// Why there is no chat template: missing from the file, or present but
    /// not compiling (the template error).
    pub fn chat_template_error(&self) -> Option<&str> {
        self.chat_template.as_ref().err().map(String::as_str)
    }

    /// Positions per session.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// The options it was built with.
    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    /// Name of the backend.
    pub fn backend_name(&self) -> String {
        self.model.backend().name()
    }

    /// Tokenizes `text`, parsing special tokens; `add_special` adds BOS/EOS
    /// where the model asks for them.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.tokenizer
            .encode(text, add_special, true)
            .map_err(tok_err)
    }

    /// Renders `messages` with the chat template, ending with the assistant
    /// prompt.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String> {
        let t = self
            .chat_template
            .as_ref()
            .map_err(|why| RuntimeError::Tokenizer(why.clone()))?;
        t.render(messages, true).map_err(tok_err)
    }

    /// A new session with an empty KV cache of [`Engine::n_ctx`] positions.
    pub fn session(&self) -> Result<Session<'_, B>> {
        self.session_with(EngineRef::Borrowed(self))
    }

    /// A session that shares `engine` instead of borrowing it: it owns
    /// what it needs, so it can move into another thread or an async task
    /// (`std::thread::spawn(move || session.generate(..))`).
    pub fn shared_session(engine: &Arc<Engine<B>>) -> Result<Session<'static, B>>
    where
        B: 'static,
    {
        engine.session_with(EngineRef::Shared(engine.clone()))
    }

    fn session_with<'e>(&self, engine: EngineRef<'e, B>) -> Result<Session<'e, B>> {
        Ok(Session {
            cache: self.model.new_kv_cache_pruned(
                self.n_ctx,
                1,
                self.options.kv_dtype,
                self.options.kv_pruning,
            )?,
            scratch: self.model.new_scratch(),
            tokens: Vec::new(),
            logits: Vec::new(),
            engine,
        })
    }

    /// One embedding per input text: the final hidden state (after the
    /// output norm) mean-pooled over the text's tokens and scaled to unit
    /// L2 norm, as llama-server computes it with `--embedding` (mean
    /// pooling, Euclidean normalisation). Texts are tokenized with the
    /// model's BOS/EOS settings and run together, several sequences per
    /// forward pass.
    pub fn embed<S: AsRef<str>>(&self, inputs: &[S]) -> Result<Vec<Vec<f32>>> {
        let tokens = inputs
            .iter()
            .map(|t| self.encode(t.as_ref(), true))
            .collect::<Result<Vec<_>>>()?;
        self.embed_tokens(&tokens)
    }

    /// [`Engine::embed`] of already tokenized inputs.
    pub fn embed_tokens(&self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        /// Sequences that share one cache and its forward passes.
        const GROUP: usize = 16;
        for (i, t) in inputs.iter().enumerate() {
            if t.is_empty() {
                return Err(RuntimeError::InvalidArgument(format!(
                    "input {i} has no tokens to embed"
                )));
            }
            if t.len() > self.n_ctx {
                return Err(RuntimeError::ContextFull { n_ctx: self.n_ctx });
            }
        }
        let d = self.model.config().n_embd;
        let n_batch = self.options.n_batch.max(1);
        let mut out = Vec::with_capacity(inputs.len());
        let mut scratch = self.model.new_scratch();
        let mut hidden = Vec::new();
        for group in inputs.chunks(GROUP) {
            let longest = group.iter().map(Vec::len).max().unwrap_or(1);
            let mut cache = self
                .model
                .new_kv_cache(longest, group.len(), self.options.kv_dtype)?;
            let rows: Vec<(u32, TokenSlot)> = group
                .iter()
                .enumerate()
                .flat_map(|(seq, t)| {
                    t.iter()
                        .enumerate()
                        .map(move |(pos, &tok)| (tok, TokenSlot { seq, pos }))
                })
                .collect();
            let mut sums = vec![vec![0.0f64; d]; group.len()];
            for chunk in rows.chunks(n_batch) {
                let tokens: Vec<u32> = chunk.iter().map(|r| r.0).collect();
                let slots: Vec<TokenSlot> = chunk.iter().map(|r| r.1).collect();
                self.model
                    .hidden_states(&tokens, &slots, &mut cache, &mut scratch, &mut hidden)?;
                if hidden.len() != chunk.len() * d {
                    return Err(RuntimeError::InvalidArgument(format!(
                        "backend returned {} hidden values for {} rows of {d}",
                        hidden.len(),
                        chunk.len()
                    )));
                }
                for (slot, row) in slots.iter().zip(hidden.chunks_exact(d)) {
                    for (acc, &h) in sums[slot.seq].iter_mut().zip(row) {
                        *acc += h as f64;
                    }
                }
            }
            for (sum, t) in sums.into_iter().zip(group) {
                let mean: Vec<f64> = sum.into_iter().map(|x| x / t.len() as f64).collect();
                let norm = mean.iter().map(|x| x * x).sum::<f64>().sqrt();
                let scale = if norm > 0.0 { 1.0 / norm } else { 0.0 };
                out.push(mean.into_iter().map(|x| (x * scale) as f32).collect());
            }
        }
        Ok(out)
    }

    /// Logits at every position of `tokens` (`tokens.len() * vocab` floats,
    /// row-major), run from an empty cache in one batch. For tests and
    /// perplexity.
    pub fn logits_for(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.model.logits_all(tokens, self.options.kv_dtype)
    }
}

/// How a [`Session`] holds its engine: borrowed, or shared through an
/// `Arc` so that the session owns what it needs (`Session<'static, B>`,
/// which moves into threads and async tasks).
pub(crate) enum EngineRef<'e, B: Backend> {
    Borrowed(&'e Engine<B>),
    Shared(Arc<Engine<B>>),
}

impl<B: Backend> std::ops::Deref for EngineRef<'_, B> {
    type Target = Engine<B>;
    fn deref(&self) -> &Engine<B> {
        match self {
            EngineRef::Borrowed(e) => e,
            EngineRef::Shared(e) => e,
        }
    }
}

/// One conversation: a KV cache, buffers and the tokens it holds.
pub struct Session<'e, B: Backend = CpuBackend> {
    pub(crate) engine: EngineRef<'e, B>,
    pub(crate) cache: B::KvCache,
    pub(crate) scratch: Scratch<B>,
    pub(crate) tokens: Vec<u32>,
    pub(crate) logits: Vec<f32>,
}

impl<B: Backend> std::fmt::Debug for Session<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("tokens", &self.tokens.len())
            .finish()
    }
}

impl<'e, B: Backend> Session<'e, B> {
    /// The tokens in the cache, oldest first.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Forgets everything.
    pub fn reset(&mut self) {
        self.engine
            .model
            .backend()
            .kv_truncate(&mut self.cache, 0, 0);
        self.tokens.clear();
        self.logits.clear();
    }

    /// Runs `tokens` after the ones already in the cache (in batches of
    /// `n_batch`) and returns the logits after the last one.
    pub fn feed(&mut self, tokens: &[u32]) -> Result<&[f32]> {
        if tokens.is_empty() {
            return Err(RuntimeError::InvalidArgument("nothing to feed".into()));
        }
        if self.tokens.len() + tokens.len() > self.engine.n_ctx {
            return Err(RuntimeError::ContextFull {
                n_ctx: self.engine.n_ctx,
            });
        }
        let n_batch = self.engine.options.n_batch.max(1);
        for chunk in tokens.chunks(n_batch) {
            let start = self.tokens.len();
            let slots: Vec<TokenSlot> = (0..chunk.len())
                .map(|i| TokenSlot {
                    seq: 0,
                    pos: start + i,
                })
                .collect();
            self.engine.model.forward(
                chunk,
                &slots,
                &[chunk.len() - 1],
                &mut self.cache,
                &mut self.scratch,
                &mut self.logits,
            )?;
            self.tokens.extend_from_slice(chunk);
        }
        Ok(&self.logits)
    }

    /// Makes the cache hold exactly `tokens`, reusing the longest common
    /// prefix, and returns the logits after the last one.
    pub fn feed_context(&mut self, tokens: &[u32]) -> Result<&[f32]> {
        if tokens.is_empty() {
            return Err(RuntimeError::InvalidArgument("empty context".into()));
        }
        let common = self
            .tokens
            .iter()
            .zip(tokens)
            .take_while(|(a, b)| a == b)
            .count();
        // At least one token must run to produce logits.
        let keep = common.min(tokens.len() - 1);
        self.engine
            .model
            .backend()
            .kv_truncate(&mut self.cache, 0, keep);
        self.tokens.truncate(keep);
        self.feed(&tokens[keep..])
    }

    /// Appends `prompt` to the conversation (with BOS when the session is
    /// empty and the model wants one) and generates a continuation,
    /// streaming text to `on_text` (return `false` to stop).
    pub fn generate(
        &mut self,
        prompt: &str,
        params: &GenerateParams,
        on_text: impl FnMut(&str) -> bool,
    ) -> Result<Generation> {
        let mut context = self.tokens.clone();
        context.extend(self.engine.encode(prompt, self.tokens.is_empty())?);
        self.generate_from(&context, params, on_text)
    }

    /// Generates after exactly `context` (reusing the cached prefix),
    /// streaming text to `on_text` (return `false` to stop).
    pub fn generate_from(
        &mut self,
        context: &[u32],
        params: &GenerateParams,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<Generation> {
        let mut state = self.start_generation(context, params)?;
        while let Some(piece) = self.next_piece(&mut state)? {
            if !piece.text.is_empty() && !on_text(&piece.text) && piece.token.is_some() {
                state.stop_early(StopReason::Callback);
                break;
            }
        }
        Ok(state.finish())
    }
}
