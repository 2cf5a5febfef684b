//! MIRAGE for Rust programs: one dependency that re-exports the runtime, the
//! GGUF reader and the tokenizer, and **the** place where a user's choices
//! (model file, optional page-major artifact, backend, engine options) turn
//! into a running [`Engine`]. `mirage-cli`, `mirage-server` and any other
//! frontend load through [`load`], so `--backend cpu|cuda|auto` and
//! `--artifact` mean the same everywhere.
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

pub use mirage_artifact as artifact;
pub use mirage_cuda as cuda;
pub use mirage_gguf as gguf;
pub use mirage_runtime as runtime;
pub use mirage_tokenizer as tokenizer;

pub use mirage_artifact::SparseMode;
pub use mirage_runtime::{
    Backend, CpuBackend, Engine, EngineOptions, GenerateParams, Generation, GenerationStats,
    KvDtype, RuntimeError, SamplingParams, Session, StopReason,
};

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
    /// Threads, context, KV type, prompt chunk.
    pub options: EngineOptions,
}

impl LoadSpec {
    /// `model` on the [`BackendChoice::Auto`] backend with default options.
    pub fn new(model: impl Into<PathBuf>) -> LoadSpec {
        LoadSpec {
            model: model.into(),
            artifact: None,
            backend: BackendChoice::Auto,
            cuda_device: 0,
            options: EngineOptions::default(),
        }
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
    /// An artifact was asked for on a backend that cannot run it.
    #[error(
        "artifact {artifact} needs the CPU superblock backend, but backend `{backend}` was asked for \
         (artifacts run on the CPU only; use --backend cpu or auto)"
    )]
    ArtifactBackend {
        /// The artifact file.
        artifact: PathBuf,
        /// The backend asked for.
        backend: BackendChoice,
    },
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

/// The backend [`BackendChoice`] resolves to on this machine, before the
/// model is loaded.
enum Resolved {
    Cpu,
    Cuda(Box<mirage_cuda::CudaBackend>),
}

fn start_cuda(device: usize) -> Result<mirage_cuda::CudaBackend, LoadError> {
    if !COMPILED_WITH_CUDA {
        return Err(LoadError::CudaNotBuilt);
    }
    mirage_cuda::CudaBackend::new(device).map_err(|e| LoadError::CudaUnavailable(Box::new(e)))
}

fn resolve(
    choice: BackendChoice,
    artifact: Option<&Path>,
    device: usize,
) -> Result<Resolved, LoadError> {
    match (choice, artifact) {
        (BackendChoice::Cpu, _) => Ok(Resolved::Cpu),
        (BackendChoice::Cuda, Some(a)) => Err(LoadError::ArtifactBackend {
            artifact: a.to_path_buf(),
            backend: BackendChoice::Cuda,
        }),
        (BackendChoice::Cuda, None) => start_cuda(device).map(|b| Resolved::Cuda(Box::new(b))),
        (BackendChoice::Auto, Some(a)) => {
            tracing::info!(backend = "cpu", artifact = %a.display(), "backend auto: cpu (the artifact's superblock backend runs on the CPU)");
            Ok(Resolved::Cpu)
        }
        (BackendChoice::Auto, None) => match start_cuda(device) {
            Ok(b) => {
                tracing::info!(
                    backend = "cuda",
                    device = b.device_name(),
                    "backend auto: cuda"
                );
                Ok(Resolved::Cuda(Box::new(b)))
            }
            Err(e) => {
                tracing::info!(backend = "cpu", reason = %e, "backend auto: cpu");
                Ok(Resolved::Cpu)
            }
        },
    }
}

/// Loads `spec.model` (with `spec.artifact` when given) on the backend
/// `spec.backend` resolves to, and runs `visitor` with the engine.
///
/// An artifact runs on the CPU superblock backend: with `auto` that is what
/// is picked, with `cuda` it is [`LoadError::ArtifactBackend`]. The artifact
/// must have been built from this very model file (its sha256 and its META shape are checked).
pub fn load<V: WithEngine>(spec: &LoadSpec, visitor: V) -> Result<V::Out, LoadError> {
    let engine_err = |backend: &str| {
        let path = spec.model.clone();
        let backend = backend.to_string();
        move |error| LoadError::Engine {
            path,
            backend,
            error: Box::new(error),
        }
    };
    let resolved = resolve(
        spec.backend,
        spec.artifact.as_ref().map(|a| a.path.as_path()),
        spec.cuda_device,
    )?;
    let open_model = || {
        mirage_gguf::GgufFile::open(&spec.model)
            .map(Arc::new)
            .map_err(|error| LoadError::Model {
                path: spec.model.clone(),
                error: Box::new(error),
            })
    };
    match (resolved, &spec.artifact) {
        (Resolved::Cpu, None) => {
            let backend = CpuBackend::new(spec.options.threads).map_err(engine_err("cpu"))?;
            let engine = Engine::from_file(open_model()?, backend, spec.options.clone())
                .map_err(engine_err("cpu"))?;
            Ok(visitor.run(engine))
        }
        (Resolved::Cuda(backend), None) => {
            let engine = Engine::from_file(open_model()?, *backend, spec.options.clone())
                .map_err(engine_err("cuda"))?;
            Ok(visitor.run(engine))
        }
        (Resolved::Cpu, Some(a)) => {
            use mirage_artifact::{Artifact, SuperblockBackend};
            let artifact = Artifact::open(&a.path).map_err(|error| LoadError::Artifact {
                path: a.path.clone(),
                error: Box::new(error),
            })?;
            let file = open_model()?;
            artifact
                .check_source(&file)
                .map_err(|error| LoadError::ArtifactMismatch {
                    artifact: a.path.clone(),
                    model: spec.model.clone(),
                    error: Box::new(error),
                })?;
            let mode = a.mode.unwrap_or(SparseMode::Bvh {
                margin: artifact.meta().default_margin,
            });
            let cpu =
                CpuBackend::new(spec.options.threads).map_err(engine_err("superblock-cpu"))?;
            let backend = SuperblockBackend::new(cpu, artifact, mode).map_err(|error| {
                LoadError::Artifact {
                    path: a.path.clone(),
                    error: Box::new(error),
                }
            })?;
            let engine = Engine::from_file(file, backend, spec.options.clone())
                .map_err(engine_err("superblock-cpu"))?;
            Ok(visitor.run(engine))
        }
        (Resolved::Cuda(_), Some(a)) => {
            // `resolve` never pairs an artifact with CUDA; kept as an error, not a panic.
            Err(LoadError::ArtifactBackend {
                artifact: a.path.clone(),
                backend: spec.backend,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn cuda_with_an_artifact_is_refused_naming_both() {
        let r = resolve(BackendChoice::Cuda, Some(Path::new("x.mirage")), 0);
        let Err(e) = r else {
            panic!("cuda + artifact resolved")
        };
        let msg = e.to_string();
        assert!(
            msg.contains("x.mirage") && msg.contains("`cuda`") && msg.contains("CPU"),
            "{msg}"
        );
        // auto with an artifact is the CPU, whatever the machine has.
        assert!(matches!(
            resolve(BackendChoice::Auto, Some(Path::new("x.mirage")), 0),
            Ok(Resolved::Cpu)
        ));
    }

    #[test]
    fn cuda_without_a_gpu_is_a_clear_error_and_auto_falls_back() {
        match start_cuda(0) {
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
                    resolve(BackendChoice::Auto, None, 0),
                    Ok(Resolved::Cpu)
                ));
                assert!(resolve(BackendChoice::Cuda, None, 0).is_err());
            }
        }
    }
}
