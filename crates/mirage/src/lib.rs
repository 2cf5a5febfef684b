//! MIRAGE for Rust programs: one dependency that re-exports the runtime, the
//! GGUF reader and the tokenizer, and **the** place where a user's choices
//! (model file, optional page-major artifact or CUDA pages, backend, backend
//! and engine options) turn into a running backend: an [`Engine`] through
//! [`load`], or a bare [`Model`] through [`load_model`] for code that drives
//! forward passes itself (benchmarks, evaluations). `mirage-cli`,
//! `mirage-server` and any other frontend load through them, so
//! `--backend cpu|cuda|auto` and `--artifact` mean the same everywhere.
//!
//! Which backend a [`LoadSpec`] gets:
//!
//! | backend | artifact | CUDA pages | backend type |
//! | --- | --- | --- | --- |
//! | cpu | - | - | [`CpuBackend`] |
//! | cpu, auto | yes | - | the CPU superblock backend ([`artifact::SuperblockBackend`]) |
//! | cuda, auto | - | - | [`cuda::CudaBackend`] (auto: when a GPU answers, else the CPU) |
//! | cuda | yes or no | yes, or an artifact | [`cuda::SparseCudaBackend`] (pages from the artifact, or synthetic pages from the model's own FFN) |
//! | cpu (with `sparsity`) | an activation artifact | - | [`artifact::activation::backend::ActivationBackend`] |
//! | cuda, auto (with `sparsity`) | an activation artifact | - | [`cuda::ActivationCudaBackend`] (auto: when a GPU answers, else the CPU) |
//!
//! For most programs [`LoadedEngine`] is the whole API: one engine type
//! whatever backend was picked, sessions that own what they need (they move
//! into threads and async tasks), generation as a callback, an iterator or
//! (feature `async`) a `Stream`, grammars and embeddings, and one [`Error`]:
//!
//! ```no_run
//! use mirage::{BackendChoice, GenerateParams, LoadedEngine};
//! let engine = LoadedEngine::load("models/smollm2-135m-instruct-q4_1.gguf", BackendChoice::Auto)?;
//! for piece in engine.session()?.stream("The capital of France is", &GenerateParams::default())? {
//!     print!("{}", piece?.text);
//! }
//! # Ok::<(), mirage::Error>(())
//! ```
//!
//! The engine's backend is a type parameter (`Engine<B>`), chosen at run
//! time. [`load`] hands the engine to a [`WithEngine`] visitor whose `run`
//! is generic over the backend, so the caller's code is compiled once per
//! backend and the hot path stays statically dispatched (no boxing):
//!
//! ```no_run
//! use mirage::{Backend, BackendChoice, Engine, GenerateParams, LoadSpec, WithEngine};
//!
//! struct Complete<'a>(&'a str);
//! impl WithEngine for Complete<'_> {
//!     type Out = Result<String, mirage::RuntimeError>;
//!     fn run<B: Backend>(self, engine: Engine<B>) -> Self::Out {
//!         let out = engine.session()?.generate(self.0, &GenerateParams::default(), |_| true)?;
//!         Ok(out.text)
//!     }
//! }
//!
//! let spec = LoadSpec::new("models/smollm2-135m-instruct-q4_1.gguf").backend(BackendChoice::Auto);
//! let text = mirage::load(&spec, Complete("The capital of France is"))??;
//! println!("{text}");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

#[cfg(feature = "async")]
mod async_stream;
mod error;
mod loaded;

#[cfg(feature = "async")]
pub use async_stream::AsyncTokenStream;
pub use error::{Error, Result};
pub use loaded::{LoadedEngine, LoadedSession, LoadedStream};

pub use mirage_artifact as artifact;
pub use mirage_cuda as cuda;
pub use mirage_gguf as gguf;
pub use mirage_grammar as grammar;
pub use mirage_runtime as runtime;
pub use mirage_tokenizer as tokenizer;

pub use mirage_artifact::activation::{Criterion, SparsityTarget};
pub use mirage_artifact::SparseMode;
pub use mirage_cuda::{CudaOptions, PageFormat, SparsePages, WeightFormat};
pub use mirage_grammar::{GrammarError, GrammarSpec};
pub use mirage_runtime::{
    Backend, CpuBackend, Engine, EngineOptions, GenerateParams, Generation, GenerationStats,
    KvDtype, Model, RuntimeError, SamplingParams, Session, StopReason, TokenLogprob, TokenPiece,
};
pub use mirage_tokenizer::{ChatMessage, TokenizerError};

use mirage_artifact::activation::backend::ActivationBackend;
use mirage_artifact::{Artifact, SuperblockBackend};
#[cfg(feature = "cuda")]
use mirage_cuda::{
    ActivationCudaBackend, CudaBackend, PageSource, RouteTraversal, SparseCudaBackend,
};
use mirage_gguf::{FileMemory, GgufFile};

/// Whether this build has the CUDA backend compiled in (the `cuda` feature).
pub const COMPILED_WITH_CUDA: bool = mirage_cuda::COMPILED_WITH_CUDA;

/// Which backend runs the model, as a user names it (`cpu`, `cuda`, `auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// The CPU backend (always built).
    Cpu,
    /// The CUDA backend; an error when it is not built or no GPU answers.
    Cuda,
    /// CUDA when it is compiled in and a GPU answers, else the CPU (and
    /// the CPU for an artifact, whose superblock backend runs on the CPU).
    #[default]
    Auto,
}

impl BackendChoice {
    /// The name users type.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendChoice::Cpu => "cpu",
            BackendChoice::Cuda => "cuda",
            BackendChoice::Auto => "auto",
        }
    }
}

impl fmt::Display for BackendChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A backend name that is not `cpu`, `cuda` or `auto`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown backend `{0}` (expected cpu, cuda or auto)")]
pub struct UnknownBackend(pub String);

impl FromStr for BackendChoice {
    type Err = UnknownBackend;
    fn from_str(s: &str) -> Result<BackendChoice, UnknownBackend> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(BackendChoice::Cpu),
            "cuda" => Ok(BackendChoice::Cuda),
            "auto" => Ok(BackendChoice::Auto),
            _ => Err(UnknownBackend(s.to_string())),
        }
    }
}

/// A page-major artifact to run the FFN from, and how many of its pages.
#[derive(Debug, Clone, PartialEq)]
pub struct ArtifactSpec {
    /// The `.mirage` file.
    pub path: PathBuf,
    /// Which pages run; `None`: the BVH router at the artifact's default margin.
    pub mode: Option<SparseMode>,
}

/// Activation sparsity: skip each projection's input channels below its
/// calibrated threshold, at a model-wide sparsity or within a perplexity
/// budget, from an activation artifact (`cargo xtask build-artifacts --mode
/// activation`). CPU only for now.
#[derive(Debug, Clone, PartialEq)]
pub struct SparsitySpec {
    /// A fixed sparsity in `[0, 1)` or a calibration-perplexity budget.
    pub target: SparsityTarget,
    /// The artifact's plan (criterion/allocation); `None`: chosen per target
    /// on the calibration text (`ActivationArtifact::resolve`).
    pub plan: Option<String>,
    /// The activation artifact; `None`: [`LoadSpec::artifact`]'s path, else
    /// `<model>.activation.mirage` beside the model.
    pub artifact: Option<PathBuf>,
}

impl SparsitySpec {
    /// `target` from the artifact beside the model, no plan named.
    pub fn new(target: SparsityTarget) -> SparsitySpec {
        SparsitySpec {
            target,
            plan: None,
            artifact: None,
        }
    }

    /// Parses what a user types: `--sparsity 0.4`, or `--sparsity auto`
    /// with `--max-ppl-increase 1%` (a percentage, or a fraction without
    /// `%`).
    pub fn parse(sparsity: &str, max_ppl_increase: Option<&str>) -> Result<SparsitySpec, String> {
        let target = match (sparsity.trim(), max_ppl_increase) {
            ("auto", Some(b)) => {
                let b = b.trim();
                let v = match b.strip_suffix('%') {
                    Some(p) => p.trim().parse::<f32>().map(|x| x / 100.0),
                    None => b.parse::<f32>(),
                }
                .map_err(|_| format!("--max-ppl-increase `{b}`: expected a percentage like 1% or a fraction like 0.01"))?;
                SparsityTarget::MaxPplIncrease(v)
            }
            ("auto", None) => {
                return Err("--sparsity auto needs --max-ppl-increase (e.g. 1%)".into())
            }
            (s, None) => {
                SparsityTarget::Fixed(s.parse::<f32>().map_err(|_| {
                    format!("--sparsity `{s}`: expected a number in [0, 1) or `auto`")
                })?)
            }
            (_, Some(_)) => return Err("--max-ppl-increase goes with --sparsity auto".into()),
        };
        target.validate().map_err(|e| e.to_string())?;
        Ok(SparsitySpec::new(target))
    }
}

/// The FFN of a CUDA run from page-major pages ([`cuda::SparseCudaBackend`]).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CudaPages {
    /// How the pages are encoded on the device.
    pub format: PageFormat,
    /// Which pages run. `None`: the artifact's mode ([`ArtifactSpec::mode`],
    /// by default its BVH router at the calibrated margin); synthetic pages
    /// need one of the forced modes (they have no router).
    pub mode: Option<SparsePages>,
}

/// How the model file (and an artifact) are held in memory while they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightMemory {
    /// Read into huge-page memory for the CPU backends when the file fits in
    /// the memory available ([`FileMemory::resident_if_it_fits`]); mapped for
    /// CUDA, which copies the weights to the device.
    #[default]
    Auto,
    /// Always a memory map of the file (instant start, pages shared with
    /// other processes; the CPU decode is slower through 4 KiB pages).
    Mapped,
    /// Always read into memory (huge pages where the kernel gives them).
    Resident,
}

impl WeightMemory {
    /// `Mapped` when a user asked for a map (`--mmap`), else `Auto`.
    pub fn mapped_if(mmap: bool) -> WeightMemory {
        if mmap {
            WeightMemory::Mapped
        } else {
            WeightMemory::Auto
        }
    }

    /// What a file of `len` bytes gets on a CPU backend (`cpu`) or not.
    pub fn for_backend(self, cpu: bool, len: u64) -> FileMemory {
        match self {
            WeightMemory::Mapped => FileMemory::Mapped,
            WeightMemory::Resident => FileMemory::Resident,
            WeightMemory::Auto if cpu => FileMemory::resident_if_it_fits(len),
            WeightMemory::Auto => FileMemory::Mapped,
        }
    }

    /// [`WeightMemory::for_backend`] for the file at `path` (an unreadable
    /// file is mapped: opening it reports the error).
    pub fn for_file(self, cpu: bool, path: &Path) -> FileMemory {
        let len = std::fs::metadata(path).map_or(u64::MAX, |m| m.len());
        self.for_backend(cpu, len)
    }
}

/// Everything [`load`] needs.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadSpec {
    /// The GGUF model file.
    pub model: PathBuf,
    /// Run the FFN sparsely from this artifact (built from `model`).
    pub artifact: Option<ArtifactSpec>,
    /// The backend to run on.
    pub backend: BackendChoice,
    /// CUDA device ordinal.
    pub cuda_device: usize,
    /// What the CUDA backend may be told (graphs, weight encoding, prefill
    /// GEMM); ignored on the CPU.
    pub cuda: CudaOptions,
    /// Run the FFN on CUDA from pages: the artifact's when one is given,
    /// else synthetic pages built from the model's own FFN matrices (128
    /// consecutive channels each). Needs the `cuda` backend; an artifact on
    /// the `cuda` backend takes the default ([`CudaPages::default`]).
    pub cuda_pages: Option<CudaPages>,
    /// Threads, context, KV type, prompt chunk.
    pub options: EngineOptions,
    /// Run every projection under activation sparsity.
    pub sparsity: Option<SparsitySpec>,
    /// How the model file and the artifact are held in memory.
    pub memory: WeightMemory,
}

impl LoadSpec {
    /// `model` on the [`BackendChoice::Auto`] backend with default options.
    pub fn new(model: impl Into<PathBuf>) -> LoadSpec {
        LoadSpec {
            model: model.into(),
            artifact: None,
            backend: BackendChoice::Auto,
            cuda_device: 0,
            cuda: CudaOptions::default(),
            cuda_pages: None,
            options: EngineOptions::default(),
            sparsity: None,
            memory: WeightMemory::Auto,
        }
    }

    /// With the model file and artifact held in memory this way.
    pub fn memory(mut self, memory: WeightMemory) -> LoadSpec {
        self.memory = memory;
        self
    }

    /// With activation sparsity.
    pub fn sparsity(mut self, sparsity: SparsitySpec) -> LoadSpec {
        self.sparsity = Some(sparsity);
        self
    }

    /// With this backend choice.
    pub fn backend(mut self, backend: BackendChoice) -> LoadSpec {
        self.backend = backend;
        self
    }

    /// With this artifact (and sparse mode; `None`: the artifact's default BVH margin).
    pub fn artifact(mut self, path: impl Into<PathBuf>, mode: Option<SparseMode>) -> LoadSpec {
        self.artifact = Some(ArtifactSpec {
            path: path.into(),
            mode,
        });
        self
    }

    /// With these engine options.
    pub fn options(mut self, options: EngineOptions) -> LoadSpec {
        self.options = options;
        self
    }

    /// With these CUDA backend options.
    pub fn cuda(mut self, cuda: CudaOptions) -> LoadSpec {
        self.cuda = cuda;
        self
    }

    /// With the FFN on CUDA from pages (see [`LoadSpec::cuda_pages`]).
    pub fn cuda_pages(mut self, pages: CudaPages) -> LoadSpec {
        self.cuda_pages = Some(pages);
        self
    }
}

/// Why [`load`] could not produce an engine.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// `--backend cuda` in a build without the `cuda` feature.
    #[error("backend `cuda`: this program was built without the `cuda` feature; rebuild with --features cuda")]
    CudaNotBuilt,
    /// The CUDA backend is built but could not start (no driver, no device, ...).
    #[error("backend `cuda`: no usable GPU: {0}")]
    CudaUnavailable(Box<mirage_cuda::CudaError>),
    /// CUDA pages were asked for on another backend.
    #[error("the FFN from CUDA pages needs backend `cuda`, but backend `{0}` was asked for")]
    PagesBackend(BackendChoice),
    /// A sparse mode the CUDA pages cannot run (they have no predictor or
    /// oracle; synthetic pages no router either).
    #[error("CUDA pages: {0}")]
    PagesMode(String),
    // The wrapped errors below are part of the message, not `source()`, so a
    // frontend printing the whole chain does not repeat them.
    /// The artifact file could not be read or is not a valid artifact.
    #[error("{}", artifact_message(path, error))]
    Artifact {
        /// The artifact file.
        path: PathBuf,
        /// What is wrong.
        error: Box<mirage_artifact::ArtifactError>,
    },
    /// The artifact was built from another model.
    #[error("artifact {artifact} does not belong to model {model}: {error}")]
    ArtifactMismatch {
        /// The artifact file.
        artifact: PathBuf,
        /// The model file.
        model: PathBuf,
        /// The hashes.
        error: Box<mirage_artifact::ArtifactError>,
    },
    /// The model file could not be opened or parsed.
    #[error("model {path}: {error}")]
    Model {
        /// The model file.
        path: PathBuf,
        /// What is wrong.
        error: Box<mirage_gguf::GgufError>,
    },
    /// Activation sparsity cannot be had as asked (a target above the
    /// artifact's, a budget no stored sparsity meets, another backend).
    #[error("activation sparsity from {artifact}: {reason}")]
    Sparsity {
        /// The activation artifact.
        artifact: PathBuf,
        /// Why.
        reason: String,
    },
    /// Building the engine failed (unsupported architecture, device memory, ...).
    #[error("loading {path} on backend {backend}: {error}")]
    Engine {
        /// The model file.
        path: PathBuf,
        /// The backend's name.
        backend: String,
        /// What failed.
        error: Box<RuntimeError>,
    },
}

fn artifact_message(path: &Path, e: &mirage_artifact::ArtifactError) -> String {
    match e {
        // Already names the file.
        mirage_artifact::ArtifactError::Io { .. } => format!("artifact {e}"),
        _ => format!("artifact {}: {e}", path.display()),
    }
}

/// Code that runs with an engine of whichever backend [`load`] picked.
/// `run` is generic, so it is compiled once per backend type.
pub trait WithEngine {
    /// What `run` returns.
    type Out;
    /// Runs with the loaded engine.
    fn run<B: Backend>(self, engine: Engine<B>) -> Self::Out;
}

/// Code that runs with a bare model of whichever backend [`load_model`]
/// picked (see [`LoadedModel::run`]).
pub trait WithModel {
    /// What `run` returns.
    type Out;
    /// Runs with the loaded model.
    fn run<B: Backend>(self, model: Model<B>) -> Self::Out;
}

/// A model on the backend a [`LoadSpec`] resolved to, for code that drives
/// its forward passes itself (no tokenizer needed: synthetic shapes load
/// too). The variant names the backend, so a caller can reach what only
/// that backend has (device name, graph and memory statistics, page modes).
pub enum LoadedModel {
    /// The CPU backend.
    Cpu(Model<CpuBackend>),
    /// The CPU superblock backend over an artifact.
    SuperblockCpu(Model<SuperblockBackend>),
    /// The CUDA backend.
    #[cfg(feature = "cuda")]
    Cuda(Model<CudaBackend>),
    /// The sparse CUDA backend over pages.
    #[cfg(feature = "cuda")]
    SparseCuda(Model<SparseCudaBackend>),
}

impl LoadedModel {
    /// Runs `visitor` with the model, whatever its backend.
    pub fn run<V: WithModel>(self, visitor: V) -> V::Out {
        match self {
            LoadedModel::Cpu(m) => visitor.run(m),
            LoadedModel::SuperblockCpu(m) => visitor.run(m),
            #[cfg(feature = "cuda")]
            LoadedModel::Cuda(m) => visitor.run(m),
            #[cfg(feature = "cuda")]
            LoadedModel::SparseCuda(m) => visitor.run(m),
        }
    }
}

/// The backend a spec resolved to, started, before the model is loaded.
enum Started {
    Cpu(CpuBackend),
    SuperblockCpu(Box<SuperblockBackend>),
    #[cfg(feature = "cuda")]
    Cuda(Box<CudaBackend>),
    #[cfg(feature = "cuda")]
    SparseCuda(Box<SparseCudaBackend>),
}

/// The backend [`BackendChoice`] resolves to on this machine, before the
/// model is loaded.
enum Resolved {
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda(Box<CudaBackend>),
}

#[cfg(feature = "cuda")]
fn start_cuda(device: usize, options: &CudaOptions) -> Result<CudaBackend, LoadError> {
    CudaBackend::with_options(device, options).map_err(|e| LoadError::CudaUnavailable(Box::new(e)))
}

#[cfg(not(feature = "cuda"))]
fn start_cuda(
    _device: usize,
    _options: &CudaOptions,
) -> Result<std::convert::Infallible, LoadError> {
    Err(LoadError::CudaNotBuilt)
}

fn resolve(spec: &LoadSpec) -> Result<Resolved, LoadError> {
    let artifact = spec.artifact.as_ref().map(|a| a.path.as_path());
    let pages = spec.cuda_pages.is_some();
    match (spec.backend, artifact) {
        (BackendChoice::Cpu, _) if pages => Err(LoadError::PagesBackend(BackendChoice::Cpu)),
        (BackendChoice::Auto, None) if spec.options.deterministic && !pages => {
            tracing::info!(
                backend = "cpu",
                "backend auto: cpu (deterministic mode runs on the CPU backend)"
            );
            Ok(Resolved::Cpu)
        }
        (BackendChoice::Cpu, _) => Ok(Resolved::Cpu),
        (BackendChoice::Cuda, _) => {
            #[allow(clippy::useless_conversion, unreachable_code)]
            let b = start_cuda(spec.cuda_device, &spec.cuda)?;
            #[cfg(feature = "cuda")]
            return Ok(Resolved::Cuda(Box::new(b)));
            #[cfg(not(feature = "cuda"))]
            match b {}
        }
        (BackendChoice::Auto, Some(a)) if !pages => {
            tracing::info!(backend = "cpu", artifact = %a.display(), "backend auto: cpu (an artifact runs on the CPU superblock backend unless CUDA pages are asked for)");
            Ok(Resolved::Cpu)
        }
        (BackendChoice::Auto, _) => match start_cuda(spec.cuda_device, &spec.cuda) {
            #[cfg(feature = "cuda")]
            Ok(b) => {
                tracing::info!(
                    backend = "cuda",
                    device = b.device_name(),
                    "backend auto: cuda"
                );
                Ok(Resolved::Cuda(Box::new(b)))
            }
            #[cfg(not(feature = "cuda"))]
            Ok(b) => match b {},
            Err(_) if pages => Err(LoadError::PagesBackend(BackendChoice::Auto)),
            Err(e) => {
                tracing::info!(backend = "cpu", reason = %e, "backend auto: cpu");
                Ok(Resolved::Cpu)
            }
        },
    }
}

/// Opens the artifact of `spec` (if any) and checks it belongs to `file`.
fn open_artifact(
    spec: &LoadSpec,
    file: &GgufFile,
    cpu: bool,
) -> Result<Option<Arc<Artifact>>, LoadError> {
    let Some(a) = &spec.artifact else {
        return Ok(None);
    };
    let memory = spec.memory.for_file(cpu, &a.path);
    let artifact = Artifact::open_with(&a.path, memory).map_err(|error| LoadError::Artifact {
        path: a.path.clone(),
        error: Box::new(error),
    })?;
    artifact
        .check_source(file)
        .map_err(|error| LoadError::ArtifactMismatch {
            artifact: a.path.clone(),
            model: spec.model.clone(),
            error: Box::new(error),
        })?;
    Ok(Some(artifact))
}

/// The CUDA pages' mode: `pages.mode`, else the artifact's (its BVH router
/// at `mode`'s margin or the calibrated one).
#[cfg(feature = "cuda")]
fn pages_mode(
    pages: &CudaPages,
    artifact: Option<&Artifact>,
    mode: Option<SparseMode>,
) -> Result<SparsePages, LoadError> {
    if let Some(m) = pages.mode {
        return Ok(m);
    }
    let Some(a) = artifact else {
        return Err(LoadError::PagesMode(
            "synthetic pages have no router: pass a mode (all, a prefix or a fraction)".into(),
        ));
    };
    match mode.unwrap_or(SparseMode::Bvh {
        margin: a.meta().default_margin,
    }) {
        SparseMode::All => Ok(SparsePages::All),
        SparseMode::Prefix(k) => Ok(SparsePages::Prefix(k)),
        SparseMode::Bvh { margin } => Ok(SparsePages::Routed {
            margin,
            traversal: RouteTraversal::Auto,
        }),
        other => Err(LoadError::PagesMode(format!(
            "mode {other:?} runs on the CPU superblock backend only"
        ))),
    }
}

/// Starts the backend `spec` resolved to for `file`.
fn start(spec: &LoadSpec, file: &GgufFile, resolved: Resolved) -> Result<Started, LoadError> {
    let engine_err = |backend: &str| {
        let path = spec.model.clone();
        let backend = backend.to_string();
        move |error| LoadError::Engine {
            path,
            backend,
            error: Box::new(error),
        }
    };
    let artifact = open_artifact(spec, file, matches!(resolved, Resolved::Cpu))?;
    match resolved {
        Resolved::Cpu => {
            let cpu = CpuBackend::new(spec.options.threads).map_err(engine_err("cpu"))?;
            let Some(artifact) = artifact else {
                return Ok(Started::Cpu(cpu));
            };
            let a = spec.artifact.as_ref().expect("opened above");
            let mode = a.mode.unwrap_or(SparseMode::Bvh {
                margin: artifact.meta().default_margin,
            });
            let b = SuperblockBackend::new(cpu, artifact, mode).map_err(|error| {
                LoadError::Artifact {
                    path: a.path.clone(),
                    error: Box::new(error),
                }
            })?;
            Ok(Started::SuperblockCpu(Box::new(b)))
        }
        #[cfg(feature = "cuda")]
        Resolved::Cuda(b) => {
            let pages = match (spec.cuda_pages, &artifact) {
                (Some(p), _) => p,
                (None, Some(_)) => CudaPages::default(),
                (None, None) => return Ok(Started::Cuda(b)),
            };
            let mode = pages_mode(
                &pages,
                artifact.as_deref(),
                spec.artifact.as_ref().and_then(|a| a.mode),
            )?;
            let source = artifact.map_or(PageSource::Synthetic, PageSource::Artifact);
            let sb = SparseCudaBackend::new(*b, source, mode)
                .map_err(|e| LoadError::PagesMode(e.to_string()))?;
            sb.set_page_format(pages.format)
                .map_err(|e| LoadError::PagesMode(e.to_string()))?;
            Ok(Started::SparseCuda(Box::new(sb)))
        }
    }
}

/// `spec.model`, opened for a CPU backend (`cpu`) or not.
fn open_model(spec: &LoadSpec, cpu: bool) -> Result<Arc<GgufFile>, LoadError> {
    let memory = spec.memory.for_file(cpu, &spec.model);
    let file = GgufFile::open_with(&spec.model, memory);
    if let Ok(f) = &file {
        tracing::debug!(
            memory = f.memory().as_str(),
            "model file {}",
            spec.model.display()
        );
    }
    file.map(Arc::new).map_err(|error| LoadError::Model {
        path: spec.model.clone(),
        error: Box::new(error),
    })
}

/// An engine on the backend a spec resolved to, before it is handed to a
/// [`WithEngine`] visitor ([`load`]) or boxed ([`LoadedEngine`]).
pub(crate) enum Built {
    Cpu(Engine<CpuBackend>),
    SuperblockCpu(Engine<SuperblockBackend>),
    ActivationCpu(Engine<ActivationBackend>),
    #[cfg(feature = "cuda")]
    ActivationCuda(Engine<ActivationCudaBackend>),
    #[cfg(feature = "cuda")]
    Cuda(Engine<CudaBackend>),
    #[cfg(feature = "cuda")]
    SparseCuda(Engine<SparseCudaBackend>),
}

impl Built {
    fn run<V: WithEngine>(self, visitor: V) -> V::Out {
        match self {
            Built::Cpu(e) => visitor.run(e),
            Built::SuperblockCpu(e) => visitor.run(e),
            Built::ActivationCpu(e) => visitor.run(e),
            #[cfg(feature = "cuda")]
            Built::ActivationCuda(e) => visitor.run(e),
            #[cfg(feature = "cuda")]
            Built::Cuda(e) => visitor.run(e),
            #[cfg(feature = "cuda")]
            Built::SparseCuda(e) => visitor.run(e),
        }
    }
}

/// Loads `spec.model` (with `spec.artifact` or `spec.cuda_pages` when given)
/// on the backend `spec.backend` resolves to (the table in the crate
/// documentation), and runs `visitor` with the engine.
///
/// An artifact must have been built from this very model file (its sha256
/// and its shape are checked).
pub fn load<V: WithEngine>(spec: &LoadSpec, visitor: V) -> Result<V::Out, LoadError> {
    Ok(build(spec)?.run(visitor))
}

/// The engine [`load`] runs a visitor with.
pub(crate) fn build(spec: &LoadSpec) -> Result<Built, LoadError> {
    if let Some(sp) = &spec.sparsity {
        return load_sparse(spec, sp);
    }
    let resolved = resolve(spec)?;
    let file = open_model(spec, matches!(resolved, Resolved::Cpu))?;
    let engine = |backend: &str, e: RuntimeError| LoadError::Engine {
        path: spec.model.clone(),
        backend: backend.to_string(),
        error: Box::new(e),
    };
    let opts = spec.options.clone();
    Ok(match start(spec, &file, resolved)? {
        Started::Cpu(b) => {
            Built::Cpu(Engine::from_file(file, b, opts).map_err(|e| engine("cpu", e))?)
        }
        Started::SuperblockCpu(b) => Built::SuperblockCpu(
            Engine::from_file(file, *b, opts).map_err(|e| engine("superblock-cpu", e))?,
        ),
        #[cfg(feature = "cuda")]
        Started::Cuda(b) => match Engine::from_file(file.clone(), *b, opts.clone()) {
            Ok(e) => Built::Cuda(e),
            // `auto` falls back to the CPU for a graph the CUDA backend lacks (gemma3).
            Err(RuntimeError::Unsupported { what, .. }) if spec.backend == BackendChoice::Auto => {
                tracing::info!(backend = "cpu", reason = %what, "backend auto: cpu (the cuda backend does not run this model)");
                let cpu = CpuBackend::new(spec.options.threads).map_err(|e| engine("cpu", e))?;
                Built::Cpu(Engine::from_file(file, cpu, opts).map_err(|e| engine("cpu", e))?)
            }
            Err(e) => return Err(engine("cuda", e)),
        },
        #[cfg(feature = "cuda")]
        Started::SparseCuda(b) => Built::SparseCuda(
            Engine::from_file(file, *b, opts).map_err(|e| engine("superblock-cuda", e))?,
        ),
    })
}

/// The activation artifact [`load`] reads for `spec`.
pub fn activation_artifact_path(spec: &LoadSpec) -> PathBuf {
    spec.sparsity
        .as_ref()
        .and_then(|s| s.artifact.clone())
        .or_else(|| spec.artifact.as_ref().map(|a| a.path.clone()))
        .unwrap_or_else(|| spec.model.with_extension("activation.mirage"))
}

fn load_sparse(spec: &LoadSpec, sp: &SparsitySpec) -> Result<Built, LoadError> {
    use mirage_artifact::activation::format::ActivationArtifact;
    let path = activation_artifact_path(spec);
    let refuse = |reason: String| LoadError::Sparsity {
        artifact: path.clone(),
        reason,
    };
    // CUDA when asked for, or (auto) when a GPU answers; else the CPU.
    let cuda = match spec.backend {
        BackendChoice::Cpu => None,
        BackendChoice::Cuda => Some(start_cuda(spec.cuda_device, &spec.cuda)?),
        BackendChoice::Auto => match start_cuda(spec.cuda_device, &spec.cuda) {
            Ok(b) => Some(b),
            Err(e) => {
                tracing::info!(backend = "cpu", reason = %e, "activation sparsity, backend auto: cpu");
                None
            }
        },
    };
    let memory = spec.memory.for_file(cuda.is_none(), &path);
    let artifact =
        ActivationArtifact::open_with(&path, memory).map_err(|error| LoadError::Artifact {
            path: path.clone(),
            error: Box::new(error),
        })?;
    let file = open_model(spec, cuda.is_none())?;
    artifact
        .check_source_sha256(&mirage_artifact::format::sha256_hex(file.as_bytes()))
        .map_err(|error| LoadError::ArtifactMismatch {
            artifact: path.clone(),
            model: spec.model.clone(),
            error: Box::new(error),
        })?;
    let r = artifact
        .resolve(sp.plan.as_deref(), sp.target)
        .map_err(|e| refuse(e.to_string()))?;
    let criterion = artifact
        .plan(&r.plan)
        .map(|(m, _)| m.criterion)
        .ok_or_else(|| refuse(format!("no plan `{}`", r.plan)))?;
    let label = format!("{} @ {:.2}, {}", r.plan, r.sparsity, r.choice.describe());
    tracing::info!(
        plan = %r.plan,
        choice = r.choice.describe(),
        sparsity = r.sparsity,
        calib_ppl_increase_percent = 100.0 * (r.calib_ppl / r.dense_calib_ppl - 1.0),
        "activation sparsity: {:.2} of the projections' weights skipped per token (plan {}, {}; calibration perplexity {:+.2} %)",
        r.sparsity,
        r.plan,
        r.choice.describe(),
        100.0 * (r.calib_ppl / r.dense_calib_ppl - 1.0)
    );
    let engine_err = |backend: &'static str| {
        let model = spec.model.clone();
        move |error| LoadError::Engine {
            path: model,
            backend: backend.into(),
            error: Box::new(error),
        }
    };
    let n_layer = artifact.meta().n_layer;
    let thresholds = artifact.thresholds(criterion, &r.per_matrix);
    #[allow(unreachable_code, clippy::needless_return)]
    if let Some(b) = cuda {
        #[cfg(feature = "cuda")]
        {
            tracing::info!(
                "activation sparsity on CUDA: gate, up and down take their thresholds; Q/K/V/O and the head run dense"
            );
            let backend = ActivationCudaBackend::new(b, artifact)
                .map_err(|e| LoadError::CudaUnavailable(Box::new(e)))?;
            backend
                .set_thresholds(thresholds)
                .map_err(|e| refuse(e.to_string()))?;
            return Engine::from_file(file, backend, spec.options.clone())
                .map(Built::ActivationCuda)
                .map_err(engine_err("activation-sparse-cuda"));
        }
        #[cfg(not(feature = "cuda"))]
        match b {}
    }
    let cpu = CpuBackend::new(spec.options.threads).map_err(engine_err("activation-sparse-cpu"))?;
    let backend = ActivationBackend::new(cpu, Some(artifact), n_layer).with_label(label);
    backend
        .set_thresholds(thresholds)
        .map_err(|e| refuse(e.to_string()))?;
    Engine::from_file(file, backend, spec.options.clone())
        .map(Built::ActivationCpu)
        .map_err(engine_err("activation-sparse-cpu"))
}

/// Loads a model as [`load`] does, as a bare [`Model`] (no tokenizer
/// needed): `file` when given (a model already in memory, such as a cut
/// of `spec.model`), else `spec.model`.
pub fn load_model(spec: &LoadSpec, file: Option<Arc<GgufFile>>) -> Result<LoadedModel, LoadError> {
    if spec.sparsity.is_some() {
        return Err(LoadError::Sparsity {
            artifact: activation_artifact_path(spec),
            reason: "a bare model does not run activation sparsity; load an engine (`load`)".into(),
        });
    }
    let resolved = resolve(spec)?;
    let file = match file {
        Some(f) => f,
        None => open_model(spec, matches!(resolved, Resolved::Cpu))?,
    };
    let model = |backend: &str, e: RuntimeError| LoadError::Engine {
        path: spec.model.clone(),
        backend: backend.to_string(),
        error: Box::new(e),
    };
    Ok(match start(spec, &file, resolved)? {
        Started::Cpu(b) => LoadedModel::Cpu(Model::load(file, b).map_err(|e| model("cpu", e))?),
        Started::SuperblockCpu(b) => LoadedModel::SuperblockCpu(
            Model::load(file, *b).map_err(|e| model("superblock-cpu", e))?,
        ),
        #[cfg(feature = "cuda")]
        Started::Cuda(b) => LoadedModel::Cuda(Model::load(file, *b).map_err(|e| model("cuda", e))?),
        #[cfg(feature = "cuda")]
        Started::SparseCuda(b) => {
            LoadedModel::SparseCuda(Model::load(file, *b).map_err(|e| model("superblock-cuda", e))?)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparsity_options_parse_with_clear_errors() {
        assert_eq!(
            SparsitySpec::parse("0.4", None).unwrap().target,
            SparsityTarget::Fixed(0.4)
        );
        assert_eq!(
            SparsitySpec::parse("auto", Some("1%")).unwrap().target,
            SparsityTarget::MaxPplIncrease(0.01)
        );
        assert_eq!(
            SparsitySpec::parse("auto", Some("0.03")).unwrap().target,
            SparsityTarget::MaxPplIncrease(0.03)
        );
        for (s, b, want) in [
            ("1.0", None, "outside [0, 1)"),
            ("-0.2", None, "outside [0, 1)"),
            ("lots", None, "expected a number in [0, 1) or `auto`"),
            ("auto", None, "needs --max-ppl-increase"),
            ("auto", Some("x%"), "expected a percentage"),
            ("auto", Some("-1%"), "finite increase >= 0"),
            ("0.3", Some("1%"), "goes with --sparsity auto"),
        ] {
            let e = SparsitySpec::parse(s, b).unwrap_err();
            assert!(e.contains(want), "{s} {b:?}: {e}");
        }
    }

    #[test]
    fn backend_names_parse_and_print() {
        for c in [BackendChoice::Cpu, BackendChoice::Cuda, BackendChoice::Auto] {
            assert_eq!(c.as_str().parse::<BackendChoice>().unwrap(), c);
            assert_eq!(
                c.to_string()
                    .to_uppercase()
                    .parse::<BackendChoice>()
                    .unwrap(),
                c
            );
        }
        assert_eq!(BackendChoice::default(), BackendChoice::Auto);
        let e = "vulkan".parse::<BackendChoice>().unwrap_err();
        assert!(
            e.to_string().contains("`vulkan`") && e.to_string().contains("cpu, cuda or auto"),
            "{e}"
        );
    }

    #[test]
    fn cuda_pages_need_the_cuda_backend() {
        let spec = LoadSpec::new("m.gguf")
            .backend(BackendChoice::Cpu)
            .cuda_pages(CudaPages::default());
        let Err(e) = resolve(&spec) else {
            panic!("cpu + CUDA pages resolved")
        };
        assert!(e.to_string().contains("needs backend `cuda`"), "{e}");
        // auto with an artifact is the CPU, whatever the machine has.
        let spec = LoadSpec::new("m.gguf").artifact("x.mirage", None);
        assert!(matches!(resolve(&spec), Ok(Resolved::Cpu)));
    }

    #[test]
    fn auto_with_deterministic_mode_is_the_cpu() {
        let mut spec = LoadSpec::new("m.gguf");
        spec.options.deterministic = true;
        assert!(matches!(resolve(&spec), Ok(Resolved::Cpu)));
    }

    #[test]
    fn cuda_without_a_gpu_is_a_clear_error_and_auto_falls_back() {
        match start_cuda(0, &CudaOptions::default()) {
            Ok(_) => eprintln!("a GPU answered: the no-GPU error path cannot be checked here"),
            Err(e) => {
                let msg = e.to_string();
                if COMPILED_WITH_CUDA {
                    assert!(matches!(e, LoadError::CudaUnavailable(_)), "{e:?}");
                    assert!(msg.contains("no usable GPU"), "{msg}");
                } else {
                    assert!(matches!(e, LoadError::CudaNotBuilt), "{e:?}");
                    assert!(
                        msg.contains(
                            "built without the `cuda` feature; rebuild with --features cuda"
                        ),
                        "{msg}"
                    );
                }
                assert!(matches!(
                    resolve(&LoadSpec::new("m.gguf")),
                    Ok(Resolved::Cpu)
                ));
                assert!(resolve(&LoadSpec::new("m.gguf").backend(BackendChoice::Cuda)).is_err());
            }
        }
    }
}
