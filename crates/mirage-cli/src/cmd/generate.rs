//! `mirage-cli generate`: stream a continuation of a prompt to stdout.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use mirage::{
    Backend, BackendChoice, Engine, EngineOptions, LoadSpec, SparseMode, WeightMemory, WithEngine,
};
use mirage_grammar::{GrammarCompiler, GrammarSpec};
use mirage_runtime::{GenerateParams, KvDtype, KvPruning, SamplingParams};
use mirage_tokenizer::ChatMessage;

/// The model used when `--model` is not given.
pub const DEFAULT_MODEL: &str = "models/smollm2-135m-instruct-q4_1.gguf";

/// Model, backend and engine options shared by generate, chat and perplexity.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// GGUF model file.
    #[arg(short = 'm', long, default_value = DEFAULT_MODEL)]
    pub model: PathBuf,
    /// Backend: cpu, cuda, or auto (CUDA when built in and a GPU answers, else CPU; CPU with --artifact).
    #[arg(long, default_value = "auto")]
    pub backend: BackendChoice,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Run the FFN sparsely from this page-major artifact (the CPU superblock backend, or the sparse CUDA
    /// backend with --backend cuda; BVH router at its default margin).
    #[arg(long)]
    pub artifact: Option<PathBuf>,
    /// With --artifact: BVH router margin in std units (default: the artifact's; `mirage-cli eval` finds
    /// the smallest that meets the fidelity gates).
    #[arg(long, requires = "artifact")]
    pub margin: Option<f32>,
    /// Worker threads (0: one per CPU; more than the CPUs this process may use is refused).
    #[arg(short = 't', long, default_value_t = 0, value_parser = parse_threads)]
    pub threads: usize,
    /// Context size in tokens: KV-cache positions (0: the model's training context, at most 4096; for
    /// perplexity the window length, default 512). At most the training context (or what the file's
    /// RoPE scaling extends it to), and the cache must fit the memory available.
    #[arg(short = 'c', long = "ctx-size", alias = "ctx", default_value_t = 0)]
    pub ctx_size: usize,
    /// Store the KV cache as f16 instead of f32.
    #[arg(long)]
    pub kv_f16: bool,
    /// Store the KV cache as ggml Q8_0 blocks (about a quarter of f32; CPU and CUDA backends).
    #[arg(long, conflicts_with = "kv_f16")]
    pub kv_q8: bool,
    /// Decode attention over selected KV pages only: `default`, `all`, or key=number pairs over the default
    /// (`page=64,sinks=1,recent=2,top=8,top_percent=0,dense=0`; top_percent: a budget growing with the
    /// context), e.g. `--kv-prune page=16,sinks=4,recent=8,top=32,top_percent=20`. CPU and CUDA backends; on CUDA it
    /// measured slower than full attention at 32k (which runs on tensor cores there; docs/BENCHMARKS.md).
    #[arg(long)]
    pub kv_prune: Option<KvPruning>,
    /// Activation sparsity (CPU; with --backend cuda only the FFN goes sparse): skip this share of the projections' weights per token (e.g. 0.4), or
    /// `auto` with --max-ppl-increase; reads `<model>.activation.mirage` unless --artifact names the
    /// activation artifact (`cargo xtask build-artifacts --mode activation`).
    #[arg(long, conflicts_with = "margin")]
    pub sparsity: Option<String>,
    /// With --sparsity auto: the highest sparsity whose calibration perplexity rises at most this much (1%).
    #[arg(long, requires = "sparsity")]
    pub max_ppl_increase: Option<String>,
    /// With --sparsity: the artifact's plan (criterion/allocation); default: the plan of lowest calibration
    /// perplexity at that sparsity (with auto: the plan reaching the highest sparsity within the budget).
    #[arg(long, requires = "sparsity")]
    pub sparsity_plan: Option<String>,
    /// Batch-invariant arithmetic: the same logits bits as `mirage-server --deterministic` gives this prompt,
    /// alone or batched (slower; CPU backend, which `auto` then picks).
    #[arg(long)]
    pub deterministic: bool,
    /// Map the model file (and artifact) instead of reading it into memory: an instant start and pages
    /// shared with other processes, but the CPU decode reads the weights through 4 KiB pages (on a
    /// 2-vCPU Xeon VM the 1.5B model decoded 1.3-1.7x slower so). Default: read into huge-page memory on
    /// the CPU when it fits.
    #[arg(long)]
    pub mmap: bool,
}

impl ModelArgs {
    /// What the shared loader (`mirage::load`) needs.
    pub fn spec(&self) -> LoadSpec {
        let options = EngineOptions {
            threads: self.threads,
            n_ctx: self.ctx_size,
            kv_dtype: match (self.kv_f16, self.kv_q8) {
                (true, _) => KvDtype::F16,
                (_, true) => KvDtype::Q8_0,
                _ => KvDtype::F32,
            },
            kv_pruning: self.kv_prune,
            deterministic: self.deterministic,
            ..EngineOptions::default()
        };
        let mut spec = LoadSpec::new(&self.model)
            .backend(self.backend)
            .options(options)
            .memory(WeightMemory::mapped_if(self.mmap));
        spec.cuda_device = self.device;
        if let Some(a) = &self.artifact {
            spec = spec.artifact(a, self.margin.map(|margin| SparseMode::Bvh { margin }));
        }
        spec
    }

    /// [`ModelArgs::spec`] with `--sparsity` applied (a clear error for bad values).
    pub fn load_spec(&self) -> anyhow::Result<LoadSpec> {
        let mut spec = self.spec();
        if let Some(s) = &self.sparsity {
            let mut sp = mirage::SparsitySpec::parse(s, self.max_ppl_increase.as_deref())
                .map_err(anyhow::Error::msg)?;
            sp.plan = self.sparsity_plan.clone();
            spec = spec.sparsity(sp);
        }
        Ok(spec)
    }

    /// Loads the engine on the chosen backend (fetching the default model
    /// when it is missing) and runs `visitor` with it.
    pub fn with_engine<T, V: WithEngine<Out = anyhow::Result<T>>>(
        &self,
        visitor: V,
    ) -> anyhow::Result<T> {
        check_model(&self.model)?;
        let spinner = super::progress::spinner(format!("loading {}", self.model.display()));
        let started = std::time::Instant::now();
        let loaded = Loaded {
            inner: visitor,
            spinner: &spinner,
            started,
        };
        let out = mirage::load(&self.load_spec()?, loaded)
            .with_context(|| format!("loading {}", self.model.display()));
        spinner.finish_and_clear();
        out?
    }
}

/// A visitor that stops the loading spinner once the engine is ready and
/// then runs the command's own visitor.
struct Loaded<'a, V> {
    inner: V,
    spinner: &'a indicatif::ProgressBar,
    started: std::time::Instant,
}

impl<V: WithEngine> WithEngine for Loaded<'_, V> {
    type Out = V::Out;
    fn run<B: Backend>(self, engine: Engine<B>) -> V::Out {
        self.spinner.finish_and_clear();
        tracing::info!(
            "loaded on {} in {:.1} s (weights {})",
            engine.backend_name(),
            self.started.elapsed().as_secs_f64(),
            engine.file_memory().as_str()
        );
        self.inner.run(engine)
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
    /// Most new tokens (llama.cpp: -n, --n-predict).
    #[arg(
        short = 'n',
        long = "max-tokens",
        alias = "n-predict",
        default_value_t = 128
    )]
    pub max_tokens: usize,
    /// Temperature (0: greedy; finite, >= 0).
    #[arg(long, default_value_t = 0.8, value_parser = sampling_parser(|p, v| p.temperature = v))]
    pub temp: f32,
    /// Top-k (0: off).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    /// Top-p (1: off; in (0, 1]).
    #[arg(long = "top-p", default_value_t = 0.95, value_parser = sampling_parser(|p, v| p.top_p = v))]
    pub top_p: f32,
    /// Min-p (0: off; in [0, 1]).
    #[arg(long = "min-p", default_value_t = 0.05, value_parser = sampling_parser(|p, v| p.min_p = v))]
    pub min_p: f32,
    /// Repetition penalty (1: off; > 0).
    #[arg(long = "repeat-penalty", default_value_t = 1.0, value_parser = sampling_parser(|p, v| p.repeat_penalty = v))]
    pub repeat_penalty: f32,
    /// Presence penalty (0: off).
    #[arg(long = "presence-penalty", default_value_t = 0.0, value_parser = sampling_parser(|p, v| p.presence_penalty = v))]
    pub presence_penalty: f32,
    /// Frequency penalty (0: off).
    #[arg(long = "frequency-penalty", default_value_t = 0.0, value_parser = sampling_parser(|p, v| p.frequency_penalty = v))]
    pub frequency_penalty: f32,
    /// Random seed.
    #[arg(short = 's', long, default_value_t = 42)]
    pub seed: u64,
    /// Stop before this string (repeatable).
    #[arg(long = "stop")]
    pub stop: Vec<String>,
}

/// A clap parser for one sampling field that applies the library's own
/// range check ([`SamplingParams::validate`]), so the CLI and the library
/// refuse the same values with the same words.
fn sampling_parser(
    set: fn(&mut SamplingParams, f32),
) -> impl Fn(&str) -> Result<f32, String> + Clone + Send + Sync + 'static {
    move |s: &str| {
        let v: f32 = s.trim().parse().map_err(|e| format!("{e}"))?;
        let mut p = SamplingParams::default();
        set(&mut p, v);
        match p.validate() {
            Ok(()) => Ok(v),
            Err(mirage_runtime::RuntimeError::InvalidArgument(m)) => Err(m),
            Err(e) => Err(e.to_string()),
        }
    }
}

/// `--threads`: at most the CPUs this process may use (the CPU backend
/// refuses more; checked here so the mistake is a usage error).
pub fn parse_threads(s: &str) -> Result<usize, String> {
    let n: usize = s.trim().parse().map_err(|e| format!("{e}"))?;
    let cpus = std::thread::available_parallelism()
        .map(|c| c.get())
        .unwrap_or(1);
    if n > cpus {
        return Err(format!(
            "{n} threads, but this process may use {cpus} CPUs (0: one thread per CPU)"
        ));
    }
    Ok(n)
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
            ..GenerateParams::default()
        }
    }
}

/// Grammar options shared by generate and bench-grammar.
#[derive(Debug, Args)]
pub struct GrammarArgs {
    /// Constrain the output to this grammar: GBNF (llama.cpp's format, start
    /// rule `root`), or llguidance's Lark syntax when the file name ends in
    /// `.lark` (start rule `start`).
    #[arg(long, value_name = "FILE", conflicts_with = "json_schema")]
    pub grammar: Option<PathBuf>,
    /// Constrain the output to JSON matching this JSON schema (compact
    /// JSON: `", "` and `": "` separators, no other whitespace).
    #[arg(long = "json-schema", value_name = "FILE")]
    pub json_schema: Option<PathBuf>,
}

impl GrammarArgs {
    /// The grammar the files describe, if any.
    pub fn spec(&self) -> anyhow::Result<Option<GrammarSpec>> {
        let read = |p: &PathBuf| {
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
        };
        if let Some(p) = &self.grammar {
            let text = read(p)?;
            return Ok(Some(if p.extension().is_some_and(|e| e == "lark") {
                GrammarSpec::Lark(text)
            } else {
                GrammarSpec::Gbnf(text)
            }));
        }
        if let Some(p) = &self.json_schema {
            let schema = serde_json::from_str(&read(p)?)
                .with_context(|| format!("{} is not JSON", p.display()))?;
            return Ok(Some(GrammarSpec::JsonSchema(schema)));
        }
        Ok(None)
    }

    /// Compiles the grammar for `engine`'s vocabulary into `params`.
    pub fn apply<B: Backend>(
        &self,
        engine: &Engine<B>,
        params: &mut GenerateParams,
    ) -> anyhow::Result<()> {
        if let Some(spec) = self.spec()? {
            let compiler =
                GrammarCompiler::new(engine.tokenizer(), engine.model().config().vocab_size)?;
            let what = match (&self.grammar, &self.json_schema) {
                (Some(p), _) | (_, Some(p)) => p.display().to_string(),
                _ => String::new(),
            };
            params.constraint = Some(compiler.compile(&spec).with_context(|| what)?);
        }
        Ok(())
    }
}

/// Where the prompt comes from: `-p TEXT`, `-p -` (stdin) or `-f FILE`.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub struct PromptArgs {
    /// The prompt; `-` reads it from stdin.
    #[arg(short = 'p', long)]
    pub prompt: Option<String>,
    /// Read the prompt from this file.
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    pub prompt_file: Option<PathBuf>,
}

impl PromptArgs {
    /// The prompt text, read from stdin or the file when asked to.
    pub fn read(&self) -> anyhow::Result<String> {
        match (&self.prompt, &self.prompt_file) {
            (Some(p), _) if p == "-" => {
                let mut text = String::new();
                std::io::Read::read_to_string(&mut std::io::stdin().lock(), &mut text)
                    .context("reading the prompt from stdin")?;
                Ok(text)
            }
            (Some(p), _) => Ok(p.clone()),
            (None, Some(path)) => std::fs::read_to_string(path)
                .with_context(|| format!("reading the prompt from {}", path.display())),
            (None, None) => bail!("no prompt: pass -p TEXT, -p - (stdin) or -f FILE"),
        }
    }
}

/// Arguments of `generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    prompt: PromptArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    grammar: GrammarArgs,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// Write {prompt_tokens, generated_tokens, prompt_tok_s, decode_tok_s, backend} here.
    #[arg(long = "stats-json")]
    stats_json: Option<PathBuf>,
}

/// Runs `generate`.
pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    // Read the prompt first: a missing file is reported before a model loads.
    let prompt = args.prompt.read()?;
    args.model.with_engine(Generate(&args, &prompt))
}

struct Generate<'a>(&'a GenerateArgs, &'a str);

impl WithEngine for Generate<'_> {
    type Out = anyhow::Result<()>;
    fn run<B: Backend>(self, engine: Engine<B>) -> anyhow::Result<()> {
        generate_with(&engine, self.0, self.1)
    }
}

fn generate_with<B: Backend>(
    engine: &Engine<B>,
    args: &GenerateArgs,
    prompt: &str,
) -> anyhow::Result<()> {
    let prompt = if args.chat {
        engine.render_chat(&[ChatMessage::new("user", prompt)])?
    } else {
        prompt.to_string()
    };
    let mut params = args.sampling.params();
    args.grammar.apply(engine, &mut params)?;
    let mut session = engine.session()?;
    let mut stdout = std::io::stdout().lock();
    let out = session.generate(&prompt, &params, |piece| {
        stdout
            .write_all(piece.as_bytes())
            .and_then(|_| stdout.flush())
            .is_ok()
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
