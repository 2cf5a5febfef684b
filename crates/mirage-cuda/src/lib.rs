//! The CUDA backend of the MIRAGE runtime.
//!
//! [`CudaBackend`] implements [`mirage_runtime::Backend`]: weights are
//! uploaded once in their ggml encoding and every op of a decode or prefill
//! step runs on the device (embedding lookup, RMSNorm, quantized mat-vec
//! straight on the ggml blocks, bias and residual adds, RoPE with the KV-cache
//! write, attention over a device KV cache, SwiGLU, lm head, argmax).
//!
//! Kernels live in `cuda/*.cu` at the workspace root and are compiled at run
//! time by NVRTC for the device's compute capability; the PTX is cached on
//! disk per device architecture and source hash (see [`module`]). Run-time
//! compilation was chosen over nvcc ahead of time so that the crate builds
//! with no CUDA toolkit at all (cudarc loads `libcuda` and `libnvrtc`
//! dynamically) and each GPU gets code for its own architecture.
//!
//! Without the `cuda` cargo feature the crate builds a stand-in whose
//! constructor returns [`CudaError::NotCompiledWithCuda`]. With it, a machine
//! without `libcuda` gets [`CudaError::DriverNotFound`]; nothing panics.
#![deny(missing_docs)]

mod error;
pub use error::CudaError;

#[cfg(feature = "cuda")]
mod backend;
/// Decode attention over selected KV pages (page boxes, selection and
/// split-K on the device).
#[cfg(feature = "cuda")]
pub mod kv_pruning;
#[cfg(feature = "cuda")]
pub mod module;
#[cfg(feature = "cuda")]
pub use backend::sparse_backend::{
    nvfp4_layer_pages, pages_for_fraction, q2k_layer_pages, random_subset, OpTimes, PageFormat,
    PageSource, RouteTraversal, SparseCudaBackend, SparseFfn, SparsePages, ROUTE_SCAN_MAX_PRIMS,
};
#[cfg(feature = "cuda")]
pub use backend::{CudaActivations, CudaBackend, CudaFfn, CudaKvCache, CudaMatrix, CudaVector};

pub mod nvfp4;
pub mod superblock;
pub mod superblock_q2k;
/// Routing through the Vulkan ray-tracing router with CUDA–Vulkan interop
/// (exported memory and timeline semaphores), and route.cu on its own
/// context for comparison.
#[cfg(feature = "vulkan-interop")]
pub mod vk_interop;

#[cfg(not(feature = "cuda"))]
mod dummy;
#[cfg(not(feature = "cuda"))]
pub use dummy::{CudaActivations, CudaBackend, CudaFfn, CudaKvCache, CudaMatrix, CudaVector};

/// Device memory the backend holds, by purpose (bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Weight matrices and vectors.
    pub weights: usize,
    /// KV caches.
    pub kv_cache: usize,
    /// Activation buffers and scratch (high-water mark; they are reused).
    pub workspace: usize,
    /// Highest total of the three seen so far.
    pub peak: usize,
}

/// How forward passes ran on the backend since it started (see
/// `CudaBackend::graph_stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Steps captured into a new CUDA graph.
    pub captures: u64,
    /// Steps that replayed a captured graph.
    pub replays: u64,
    /// Steps launched op by op (too many rows, or graphs off).
    pub eager: u64,
}

/// The encoding weight matrices are uploaded in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// The file's own quantization (Q8_0 repacked to the split layout when
    /// the fast decode path is on).
    #[default]
    Native,
    /// Every attention and FFN matrix requantized to NVFP4 at upload with
    /// the CPU codec (weight-only: activations stay f32). The embedding
    /// table and the lm head keep their own type.
    Nvfp4,
}

/// Whether this build has the CUDA backend compiled in.
pub const COMPILED_WITH_CUDA: bool = cfg!(feature = "cuda");
