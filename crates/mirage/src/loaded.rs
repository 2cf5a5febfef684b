//! One engine type whatever the backend: [`LoadedEngine`] picks the backend
//! at run time ([`BackendChoice`]) and hides it behind boxed dispatch, so a
//! program that embeds MIRAGE writes no generic code. Its sessions own what
//! they need (an `Arc` of the engine), so they move into threads and async
//! tasks; a generation is a callback, an iterator ([`LoadedStream`]), or an
//! async `Stream` (feature `async`).
//!
//! The cost of the dispatch is one virtual call per token step (the
//! forward pass inside stays statically dispatched); code that wants the
//! concrete backend type uses [`crate::load`] with a [`crate::WithEngine`]
//! visitor instead.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use mirage_grammar::{GrammarCompiler, GrammarSpec};
use mirage_runtime::{
    Backend, Constraint, Engine, GenerateParams, Generation, Session, TokenPiece, TokenStream,
};
use mirage_tokenizer::{ChatMessage, ChatTemplate, Tokenizer};

use crate::error::Result;
use crate::{build, BackendChoice, Built, LoadSpec};

type RuntimeResult<T> = mirage_runtime::Result<T>;

/// What every engine does, object-safe.
trait DynEngine: Send + Sync {
    fn backend_name(&self) -> String;
    fn n_ctx(&self) -> usize;
    fn logits_vocab(&self) -> usize;
    fn tokenizer(&self) -> &Tokenizer;
    fn chat_template(&self) -> Option<&ChatTemplate>;
    fn render_chat(&self, messages: &[ChatMessage]) -> RuntimeResult<String>;
    fn encode(&self, text: &str, add_special: bool) -> RuntimeResult<Vec<u32>>;
    fn embed_tokens(&self, inputs: &[Vec<u32>]) -> RuntimeResult<Vec<Vec<f32>>>;
    fn session(self: Arc<Self>) -> RuntimeResult<Box<dyn DynSession>>;
}

impl<B: Backend + 'static> DynEngine for Engine<B> {
    fn backend_name(&self) -> String {
        Engine::backend_name(self)
    }
    fn n_ctx(&self) -> usize {
        Engine::n_ctx(self)
    }
    fn logits_vocab(&self) -> usize {
        self.model().config().vocab_size
    }
    fn tokenizer(&self) -> &Tokenizer {
        Engine::tokenizer(self)
    }
    fn chat_template(&self) -> Option<&ChatTemplate> {
        Engine::chat_template(self)
    }
    fn render_chat(&self, messages: &[ChatMessage]) -> RuntimeResult<String> {
        Engine::render_chat(self, messages)
    }
    fn encode(&self, text: &str, add_special: bool) -> RuntimeResult<Vec<u32>> {
        Engine::encode(self, text, add_special)
    }
    fn embed_tokens(&self, inputs: &[Vec<u32>]) -> RuntimeResult<Vec<Vec<f32>>> {
        Engine::embed_tokens(self, inputs)
    }
    fn session(self: Arc<Self>) -> RuntimeResult<Box<dyn DynSession>> {
        Ok(Box::new(Engine::shared_session(&self)?))
    }
}

trait DynSession: Send {
    fn tokens(&self) -> &[u32];
    fn reset(&mut self);
    fn generate_from(
        &mut self,
        context: &[u32],
        params: &GenerateParams,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> RuntimeResult<Generation>;
    fn stream_from(
        self: Box<Self>,
        context: &[u32],
        params: &GenerateParams,
    ) -> RuntimeResult<Box<dyn DynStream>>;
}

impl<B: Backend + 'static> DynSession for Session<'static, B> {
    fn tokens(&self) -> &[u32] {
        Session::tokens(self)
    }
    fn reset(&mut self) {
        Session::reset(self)
    }
    fn generate_from(
        &mut self,
        context: &[u32],
        params: &GenerateParams,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> RuntimeResult<Generation> {
        Session::generate_from(self, context, params, on_text)
    }
    fn stream_from(
        self: Box<Self>,
        context: &[u32],
        params: &GenerateParams,
    ) -> RuntimeResult<Box<dyn DynStream>> {
        Ok(Box::new(Session::stream_from(*self, context, params)?))
    }
}

trait DynStream: Send {
    fn next_piece(&mut self) -> Option<RuntimeResult<TokenPiece>>;
    fn finish(self: Box<Self>) -> (Box<dyn DynSession>, Generation);
}

impl<B: Backend + 'static> DynStream for TokenStream<'static, B> {
    fn next_piece(&mut self) -> Option<RuntimeResult<TokenPiece>> {
        self.next()
    }
    fn finish(self: Box<Self>) -> (Box<dyn DynSession>, Generation) {
        let (session, generation) = TokenStream::finish(*self);
        (Box::new(session), generation)
    }
}

/// A loaded model on whichever backend was picked, with its tokenizer and
/// chat template. Cloning is cheap (an `Arc`); clones share the model.
///
/// ```no_run
/// use mirage::{BackendChoice, GenerateParams, LoadedEngine};
/// let engine = LoadedEngine::load("models/smollm2-135m-instruct-q4_1.gguf", BackendChoice::Auto)?;
/// let mut session = engine.session()?;
/// let out = session.generate("The capital of France is", &GenerateParams::default(), |_| true)?;
/// println!("[{}] {}", engine.backend_name(), out.text);
/// # Ok::<(), mirage::Error>(())
/// ```
#[derive(Clone)]
pub struct LoadedEngine {
    inner: Arc<dyn DynEngine>,
    grammars: Arc<OnceLock<Arc<GrammarCompiler>>>,
}

impl std::fmt::Debug for LoadedEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedEngine")
            .field("backend", &self.inner.backend_name())
            .field("n_ctx", &self.inner.n_ctx())
            .finish_non_exhaustive()
    }
}

impl LoadedEngine {
    /// Loads the GGUF model at `path` on `backend` (`Auto`: CUDA when it is
    /// compiled in and a GPU answers, else the CPU) with default options.
    pub fn load(path: impl AsRef<Path>, backend: BackendChoice) -> Result<LoadedEngine> {
        LoadedEngine::from_spec(&LoadSpec::new(path.as_ref()).backend(backend))
    }

    /// Loads what `spec` names (artifact, options, CUDA settings: see
    /// [`LoadSpec`]).
    pub fn from_spec(spec: &LoadSpec) -> Result<LoadedEngine> {
        let inner: Arc<dyn DynEngine> = match build(spec)? {
            Built::Cpu(e) => Arc::new(e),
            Built::SuperblockCpu(e) => Arc::new(e),
            Built::ActivationCpu(e) => Arc::new(e),
            #[cfg(feature = "cuda")]
            Built::ActivationCuda(e) => Arc::new(e),
            #[cfg(feature = "cuda")]
            Built::Cuda(e) => Arc::new(e),
            #[cfg(feature = "cuda")]
            Built::SparseCuda(e) => Arc::new(e),
        };
        Ok(LoadedEngine {
            inner,
            grammars: Arc::new(OnceLock::new()),
        })
    }

    /// The backend's name (`cpu`, `cuda`, `superblock-cpu`, ...).
    pub fn backend_name(&self) -> String {
        self.inner.backend_name()
    }

    /// Positions per session.
    pub fn n_ctx(&self) -> usize {
        self.inner.n_ctx()
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        self.inner.tokenizer()
    }

    /// The chat template, when the model has one that compiles.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.inner.chat_template()
    }

    /// Renders `messages` with the chat template, ending with the
    /// assistant's turn.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String> {
        Ok(self.inner.render_chat(messages)?)
    }

    /// Token ids of `text` (with BOS and the like when `add_special`).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        Ok(self.inner.encode(text, add_special)?)
    }

    /// One unit vector per input: the final hidden state (after the output
    /// norm) averaged over the input's tokens, then normalised, as
    /// llama.cpp's `--embedding` with mean pooling.
    pub fn embed<S: AsRef<str>>(&self, inputs: &[S]) -> Result<Vec<Vec<f32>>> {
        let tokens = inputs
            .iter()
            .map(|t| self.inner.encode(t.as_ref(), true))
            .collect::<RuntimeResult<Vec<_>>>()?;
        Ok(self.inner.embed_tokens(&tokens)?)
    }

    /// A new, empty session. It holds the engine through an `Arc`, so it is
    /// `'static` and `Send`: it moves into threads and async tasks.
    pub fn session(&self) -> Result<LoadedSession> {
        Ok(LoadedSession {
            inner: Some(self.inner.clone().session()?),
            engine: self.inner.clone(),
        })
    }

    /// Compiles a grammar or JSON schema against this model's vocabulary,
    /// for [`GenerateParams::constraint`] (the vocabulary index is built on
    /// first use and kept).
    pub fn grammar(&self, spec: &GrammarSpec) -> Result<Arc<dyn Constraint>> {
        let compiler = match self.grammars.get() {
            Some(c) => c.clone(),
            None => {
                let c = Arc::new(GrammarCompiler::new(
                    self.inner.tokenizer(),
                    self.inner.logits_vocab(),
                )?);
                self.grammars.get_or_init(|| c).clone()
            }
        };
        Ok(compiler.compile(spec)?)
    }
}

/// A conversation with a [`LoadedEngine`]: its KV cache and the tokens it
/// holds. Owns what it needs (`Send + 'static`).
pub struct LoadedSession {
    /// `None` only while a stream holds the session.
    inner: Option<Box<dyn DynSession>>,
    engine: Arc<dyn DynEngine>,
}

impl std::fmt::Debug for LoadedSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedSession")
            .field("tokens", &self.tokens().len())
            .finish_non_exhaustive()
    }
}

impl LoadedSession {
    fn inner(&mut self) -> &mut dyn DynSession {
        self.inner
            .as_deref_mut()
            .expect("a session is whole outside a stream")
    }

    /// The tokens in the cache.
    pub fn tokens(&self) -> &[u32] {
        self.inner.as_deref().map(|s| s.tokens()).unwrap_or(&[])
    }

    /// Forgets the conversation.
    pub fn reset(&mut self) {
        self.inner().reset()
    }

    /// The context for `prompt` after what the session holds (BOS when it
    /// is empty and the model wants one).
    fn context(&self, prompt: &str) -> Result<Vec<u32>> {
        let mut context = self.tokens().to_vec();
        context.extend(self.engine.encode(prompt, context.is_empty())?);
        Ok(context)
    }

    /// Appends `prompt` to the conversation and generates a continuation,
    /// streaming text to `on_text` (return `false` to stop).
    pub fn generate(
        &mut self,
        prompt: &str,
        params: &GenerateParams,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<Generation> {
        let context = self.context(prompt)?;
        self.generate_from(&context, params, &mut on_text)
    }

    /// Generates after exactly `context` (reusing the cached prefix).
    pub fn generate_from(
        &mut self,
        context: &[u32],
        params: &GenerateParams,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<Generation> {
        Ok(self.inner().generate_from(context, params, &mut on_text)?)
    }

    /// Appends `prompt` to the conversation and returns an iterator over the
    /// generated pieces; [`LoadedStream::finish`] gives the session back.
    pub fn stream(self, prompt: &str, params: &GenerateParams) -> Result<LoadedStream> {
        let context = self.context(prompt)?;
        self.stream_from(&context, params)
    }

    /// [`LoadedSession::stream`] after exactly `context`.
    pub fn stream_from(mut self, context: &[u32], params: &GenerateParams) -> Result<LoadedStream> {
        let session = self
            .inner
            .take()
            .expect("a session is whole outside a stream");
        Ok(LoadedStream {
            inner: session.stream_from(context, params)?,
            engine: self.engine.clone(),
        })
    }
}

/// The pieces of one generation, as an iterator (see
/// [`mirage_runtime::TokenPiece`]); `Send + 'static`. Dropping it early
/// stops the generation.
pub struct LoadedStream {
    inner: Box<dyn DynStream>,
    engine: Arc<dyn DynEngine>,
}

impl std::fmt::Debug for LoadedStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedStream").finish_non_exhaustive()
    }
}

impl Iterator for LoadedStream {
    type Item = Result<TokenPiece>;
    fn next(&mut self) -> Option<Result<TokenPiece>> {
        self.inner.next_piece().map(|r| r.map_err(Into::into))
    }
}

impl LoadedStream {
    /// Ends the generation where it stands and gives back the session,
    /// ready for the next turn, with the result.
    pub fn finish(self) -> (LoadedSession, Generation) {
        let (session, generation) = self.inner.finish();
        (
            LoadedSession {
                inner: Some(session),
                engine: self.engine,
            },
            generation,
        )
    }
}
