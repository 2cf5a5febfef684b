//! `mirage-cli generate`: stream a continuation of a prompt to stdout.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use mirage_runtime::{Engine, EngineOptions, GenerateParams, KvDtype, SamplingParams};
use mirage_tokenizer::ChatMessage;

/// The model used when `--model` is not given.
pub const DEFAULT_MODEL: &str = "models/smollm2-135m-instruct-q4_1.gguf";

/// Model and engine options shared by generate, chat and perplexity.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// GGUF model file.
    #[arg(long, default_value = DEFAULT_MODEL)]
    pub model: PathBuf,
    /// Worker threads (0: one per CPU).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// KV-cache positions (0: the model's training context, at most 4096).
    #[arg(long = "ctx-size", default_value_t = 0)]
    pub ctx_size: usize,
    /// Store the KV cache as f16 instead of f32.
    #[arg(long)]
    pub kv_f16: bool,
}

impl ModelArgs {
    /// Loads the engine, with a helpful message when the model is missing.
    pub fn load(&self) -> anyhow::Result<Engine> {
        check_model(&self.model)?;
        let options = EngineOptions {
            threads: self.threads,
            n_ctx: self.ctx_size,
            kv_dtype: if self.kv_f16 { KvDtype::F16 } else { KvDtype::F32 },
            ..EngineOptions::default()
        };
        Engine::load(&self.model, options).with_context(|| format!("loading {}", self.model.display()))
    }
}

/// Fetches `path` when it is a known model that is missing (the default
/// model on a fresh machine); fails with the fetch hint when it still does
/// not exist.
pub fn check_model(path: &Path) -> anyhow::Result<()> {
    super::fetch::fetch_if_known_and_missing(path)
        .with_context(|| format!("fetching the missing model {}", path.display()))?;
    if !path.exists() {
        bail!(
            "model file {} not found: run `cargo xtask fetch-models` (or `mirage-cli fetch-models`) to download it",
            path.display()
        );
    }
    Ok(())
}

/// Sampling options shared by generate and chat.
#[derive(Debug, Args)]
pub struct SamplingArgs {
    /// Most new tokens.
    #[arg(long = "max-tokens", default_value_t = 128)]
    pub max_tokens: usize,
    /// Temperature (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    pub temp: f32,
    /// Top-k (0: off).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    /// Top-p (1: off).
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    /// Min-p (0: off).
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    /// Repetition penalty (1: off).
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Presence penalty (0: off).
    #[arg(long = "presence-penalty", default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Frequency penalty (0: off).
    #[arg(long = "frequency-penalty", default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Random seed.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Stop before this string (repeatable).
    #[arg(long = "stop")]
    pub stop: Vec<String>,
}

impl SamplingArgs {
    /// The library's parameters.
    pub fn params(&self) -> GenerateParams {
        GenerateParams {
            max_tokens: self.max_tokens,
            sampling: SamplingParams {
                temperature: self.temp,
                top_k: self.top_k,
                top_p: self.top_p,
                min_p: self.min_p,
                repeat_penalty: self.repeat_penalty,
                presence_penalty: self.presence_penalty,
                frequency_penalty: self.frequency_penalty,
                seed: self.seed,
                ..SamplingParams::default()
            },
            stop: self.stop.clone(),
        }
    }
}

/// Arguments of `generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt.
    #[arg(long)]
    prompt: String,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// Write {prompt_tokens, generated_tokens, prompt_tok_s, decode_tok_s, backend} here.
    #[arg(long = "stats-json")]
    stats_json: Option<PathBuf>,
    /// Run the FFN sparsely from this page-major artifact (BVH router at its default margin).
    #[arg(long)]
    artifact: Option<PathBuf>,
    /// With --artifact: BVH router margin in std units (default: the artifact's; `mirage-cli eval` finds
    /// the smallest that meets the fidelity gates).
    #[arg(long)]
    margin: Option<f32>,
}

/// Runs `generate`.
pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    match &args.artifact {
        None => generate_with(&args.model.load()?, &args),
        Some(path) => {
            use mirage_artifact::{Artifact, SparseMode, SuperblockBackend};
            check_model(&args.model.model)?;
            let artifact = Artifact::open(path).with_context(|| format!("loading {}", path.display()))?;
            let file = std::sync::Arc::new(mirage_gguf::GgufFile::open(&args.model.model)?);
            artifact.check_source_sha256(&mirage_artifact::format::sha256_hex(file.as_bytes()))?;
            let mode = SparseMode::Bvh { margin: args.margin.unwrap_or(artifact.meta().default_margin) };
            let backend = SuperblockBackend::new(mirage_runtime::CpuBackend::new(args.model.threads)?, artifact, mode)?;
            let options = EngineOptions {
                threads: args.model.threads,
                n_ctx: args.model.ctx_size,
                kv_dtype: if args.model.kv_f16 { KvDtype::F16 } else { KvDtype::F32 },
                ..EngineOptions::default()
            };
            generate_with(&Engine::from_file(file, backend, options)?, &args)
        }
    }
}

fn generate_with<B: mirage_runtime::Backend>(engine: &Engine<B>, args: &GenerateArgs) -> anyhow::Result<()> {
    let prompt = if args.chat {
        engine.render_chat(&[ChatMessage::new("user", args.prompt.as_str())])?
    } else {
        args.prompt.clone()
    };
    let mut session = engine.session()?;
    let mut stdout = std::io::stdout().lock();
    let out = session.generate(&prompt, &args.sampling.params(), |piece| {
        stdout.write_all(piece.as_bytes()).and_then(|_| stdout.flush()).is_ok()
    })?;
    writeln!(stdout)?;
    let s = &out.stats;
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | decode: {} tokens, {:.1} tok/s | stop: {:?} | backend: {}",
        s.prompt_tokens,
        s.prompt_tok_s(),
        s.generated_tokens,
        s.decode_tok_s(),
        s.stop_reason,
        engine.backend_name()
    );
    if let Some(path) = &args.stats_json {
        let json = serde_json::json!({
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "prompt_tok_s": s.prompt_tok_s(),
            "decode_tok_s": s.decode_tok_s(),
            "backend": engine.backend_name(),
        });
        std::fs::write(path, serde_json::to_string_pretty(&json)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
