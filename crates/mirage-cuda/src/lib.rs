//! The CUDA backends of the MIRAGE runtime.
//!
//! [`CudaBackend`] implements [`mirage_runtime::Backend`]: weights are
//! uploaded once in the layout their kernels read and every op of a decode
//! or prefill step runs on the device (embedding lookup, RMSNorm, quantized
//! mat-vecs, bias and residual adds, RoPE with the KV-cache write, attention
//! over a device KV cache, SwiGLU, lm head, argmax); a decode step runs as
//! one CUDA graph. [`SparseCudaBackend`] wraps it and runs the FFN from
//! page-major pages (Q8_0, NVFP4 or Q2_K) with the page router on the
//! device. [`ActivationCudaBackend`] wraps it and runs the FFN's decode
//! rows over only the input channels an activation artifact's thresholds
//! keep.
//!
//! Kernels live in `cuda/*.cu` at the workspace root and are compiled at run
//! time by NVRTC for the device's compute capability; the PTX is cached on
//! disk per device architecture and source hash (see [`module`]). Run-time
//! compilation was chosen over nvcc ahead of time so that the crate builds
//! with no CUDA toolkit at all (cudarc loads `libcuda` and `libnvrtc`
//! dynamically) and each GPU gets code for its own architecture.
//!
//! Without the `cuda` cargo feature the crate builds only its option types
//! ([`options`]) and [`CudaError`], so a frontend can name and parse them in
//! every build. With it, a machine without `libcuda` gets
//! [`CudaError::DriverNotFound`]; nothing panics.
//!
//! What a user may choose is [`CudaOptions`] (and, for the sparse backend,
//! its [`PageFormat`] and [`SparsePages`] mode); everything else is the one
//! measured path.
#![deny(missing_docs)]

mod error;
pub use error::CudaError;

/// The GPU channel-major layout of the activation-sparse kernels, built
/// from an activation artifact's matrices (host code, every build).
pub mod asp_layout;

#[cfg(feature = "cuda")]
mod activation;
#[cfg(feature = "cuda")]
mod attention;
#[cfg(feature = "cuda")]
mod backend;
#[cfg(all(test, feature = "cuda"))]
mod checks;
#[cfg(feature = "cuda")]
mod fusion;
#[cfg(feature = "cuda")]
mod graph;
/// Decode attention over selected KV pages driven stand-alone (page boxes,
/// selection and split-K on the device), for the kernels' own tests.
#[cfg(feature = "cuda")]
pub mod kv_pruning;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
mod matvec;
#[cfg(feature = "cuda")]
pub mod module;
/// The sparse CUDA backend and its page formats.
#[cfg(feature = "cuda")]
pub mod sparse;
#[cfg(feature = "cuda")]
mod weights;

#[cfg(feature = "cuda")]
pub use activation::{ActivationCudaBackend, AspFfn, FfnBytes};
#[cfg(feature = "cuda")]
pub use attention::CudaKvCache;
#[cfg(feature = "cuda")]
pub use backend::{CudaActivations, CudaBackend};
#[cfg(feature = "cuda")]
pub use sparse::{
    layer_pages, pages_for_fraction, random_subset, OpTimes, PageSource, Pages, SparseCudaBackend,
    SparseFfn,
};
#[cfg(feature = "cuda")]
pub use weights::{CudaFfn, CudaMatrix, CudaVector};

pub mod options;
pub use options::{
    op_class, CudaOptions, GraphStats, MemoryStats, OpClass, PageFormat, RouteTraversal,
    SparsePages, StepProfile, WeightFormat, ROUTE_SCAN_MAX_PRIMS,
};

/// Threads of an `rms_norm` block (norm.cu's row function gives the same
/// bits wherever it runs at this count).
#[cfg(feature = "cuda")]
pub(crate) const NORM_THREADS: u32 = backend::NORM_THREADS;

/// Whether this build has the CUDA backend compiled in.
pub const COMPILED_WITH_CUDA: bool = cfg!(feature = "cuda");
