//! MIRAGE's FFN page router.
//!
//! Given one token's FFN input at one layer, the router projects it to one 3-D
//! point per slice (`z_s = P_s x`); every page owns one axis-aligned box per
//! slice, and a page is a *candidate* when the number of its slice boxes that
//! contain the slice point reaches the page's threshold.
//!
//! Design rules:
//! - [`RouterData`] is the input (boxes, thresholds, projection) with a
//!   documented little-endian byte layout that the artifact builder writes.
//! - One [`Router`] trait; [`BruteForce`] is the reference, [`CpuBvh`] the
//!   always-built fast path, [`WgpuRouter`] (feature `wgpu`) and
//!   [`VulkanRtRouter`] (feature `vulkan-rt`) the GPU paths. Without their
//!   feature the GPU types still exist and their constructors return
//!   [`Unavailable::NotBuilt`], so cfg attributes do not spread to callers.
//! - All routers return identical [`CandidateSet`]s: the exact test is the
//!   closed point-in-box test in slice-local coordinates (see [`bvh`]).
//! - GPU state (buffers, acceleration structures) is built once per router
//!   load, never per query batch.
//! - The library never prints: [`best_available`] returns why each faster
//!   path was skipped, and the caller logs it once.
#![deny(missing_docs)]

pub mod bvh;
mod cpu;
pub mod data;
pub mod synth;

#[cfg(feature = "vulkan-rt")]
mod vk_rt;
#[cfg(not(feature = "vulkan-rt"))]
#[path = "vk_rt_dummy.rs"]
mod vk_rt;
#[cfg(feature = "wgpu")]
mod wgpu_router;
#[cfg(not(feature = "wgpu"))]
#[path = "wgpu_dummy.rs"]
mod wgpu_router;

pub use bvh::{Bvh, BvhNode, BvhPrim};
pub use cpu::{BruteForce, CpuBvh};
pub use data::{slice_dot, Aabb, RouterData, DOT_LANES, MAX_SLICES};
pub use vk_rt::{ExportedMemory, InteropExports, InteropRequest, VulkanRtRouter};
pub use wgpu_router::{WgpuOptions, WgpuRouter};

/// Why a router path cannot run here.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    /// The crate was built without the cargo feature this path needs.
    #[error("mirage-route was built without the `{0}` feature")]
    NotBuilt(&'static str),
    /// The Vulkan loader (libvulkan.so.1) could not be loaded or created no instance.
    #[error("no Vulkan loader/instance: {0}")]
    NoVulkan(String),
    /// No GPU adapter or device was found.
    #[error("no GPU adapter found: {0}")]
    NoAdapter(String),
    /// Only software adapters (for example Mesa's llvmpipe/lavapipe) exist and
    /// the caller did not allow them.
    #[error("only a software adapter is present ({0}); a CPU traversal is faster")]
    SoftwareAdapterOnly(String),
    /// Devices exist, but none exposes `VK_KHR_ray_tracing_pipeline` (and the
    /// acceleration-structure extensions it needs).
    #[error("no Vulkan device supports VK_KHR_ray_tracing_pipeline (devices: {0})")]
    NoRayTracing(String),
    /// The committed SPIR-V is missing or was rejected by the driver.
    #[error("shader rejected: {0}")]
    Shader(String),
    /// CUDA interop was asked for, but no ray-tracing device can export its
    /// memory and timeline semaphores as opaque fds (or none has the UUID of
    /// the CUDA device).
    #[error("no Vulkan CUDA-interop: {0}")]
    NoInterop(String),
}

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    /// The router data is malformed.
    #[error("invalid router data: {0}")]
    InvalidData(String),
    /// A query batch has the wrong shape.
    #[error("invalid query: {0}")]
    InvalidInput(String),
    /// The requested path cannot run here.
    #[error("{kind} router unavailable: {reason}")]
    Unavailable {
        /// Which path.
        kind: RouterKind,
        /// Why.
        reason: Unavailable,
    },
    /// A device call failed after the router was created.
    #[error("GPU error in {kind} router: {message}")]
    Device {
        /// Which path.
        kind: RouterKind,
        /// What failed.
        message: String,
    },
}

/// The router implementations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RouterKind {
    /// [`BruteForce`].
    BruteForce,
    /// [`CpuBvh`].
    CpuBvh,
    /// [`WgpuRouter`].
    Wgpu,
    /// [`VulkanRtRouter`].
    VulkanRt,
}

impl std::fmt::Display for RouterKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RouterKind::BruteForce => "brute-force",
            RouterKind::CpuBvh => "cpu-bvh",
            RouterKind::Wgpu => "wgpu",
            RouterKind::VulkanRt => "vulkan-rt",
        })
    }
}

/// Candidate pages of a batch of queries: one bitset of `pages` bits per query.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CandidateSet {
    /// Number of queries.
    pub queries: usize,
    /// Number of pages (bits per query).
    pub pages: usize,
    /// `u32` words per query (`pages.div_ceil(32)`).
    pub words_per_query: usize,
    /// `bits[q * words_per_query + page / 32]` bit `page % 32` is set for candidates.
    pub bits: Vec<u32>,
}

impl CandidateSet {
    /// An empty set for `queries` queries over `pages` pages.
    pub fn new(queries: usize, pages: usize) -> Self {
        let words_per_query = pages.div_ceil(32);
        Self {
            queries,
            pages,
            words_per_query,
            bits: vec![0; queries * words_per_query],
        }
    }

    /// Marks `page` a candidate of query `q`.
    #[inline]
    pub fn insert(&mut self, q: usize, page: usize) {
        self.bits[q * self.words_per_query + page / 32] |= 1 << (page % 32);
    }

    /// Whether `page` is a candidate of query `q`.
    #[inline]
    pub fn contains(&self, q: usize, page: usize) -> bool {
        self.bits[q * self.words_per_query + page / 32] & (1 << (page % 32)) != 0
    }

    /// The candidate pages of query `q`, ascending.
    pub fn pages_of(&self, q: usize) -> Vec<usize> {
        (0..self.pages).filter(|&p| self.contains(q, p)).collect()
    }

    /// Total number of (query, page) candidates.
    pub fn total(&self) -> usize {
        self.bits.iter().map(|w| w.count_ones() as usize).sum()
    }
}

/// A page router: maps a batch of queries to candidate sets.
///
/// `points` holds `queries * slices` slice-local points, query-major
/// (`points[q * slices + s]` is query `q`'s point in slice `s`). Every
/// implementation returns exactly the set [`BruteForce`] returns.
pub trait Router {
    /// Which implementation this is.
    fn kind(&self) -> RouterKind;
    /// Routes a batch.
    fn route(&mut self, points: &[[f32; 3]]) -> Result<CandidateSet, RouteError>;
}

/// Checks the batch shape and returns the number of queries.
pub(crate) fn check_points(points: &[[f32; 3]], slices: usize) -> Result<usize, RouteError> {
    if slices == 0 || !points.len().is_multiple_of(slices) {
        return Err(RouteError::InvalidInput(format!(
            "{} points is not a whole number of queries of {slices} slices",
            points.len()
        )));
    }
    Ok(points.len() / slices)
}

/// Routes `points` (`slices` a query) `chunk` queries at a time through
/// `route_chunk(points, bits)`, which writes the chunk's rows of the
/// candidate bitset: the loop the GPU routers share (their buffers hold
/// `chunk` queries).
#[cfg(any(feature = "wgpu", feature = "vulkan-rt"))]
pub(crate) fn route_in_chunks(
    points: &[[f32; 3]],
    slices: usize,
    pages: usize,
    chunk: usize,
    mut route_chunk: impl FnMut(&[[f32; 3]], &mut [u32]) -> Result<(), RouteError>,
) -> Result<CandidateSet, RouteError> {
    let queries = check_points(points, slices)?;
    let mut out = CandidateSet::new(queries, pages);
    let words = out.words_per_query;
    let chunk = chunk.max(1);
    let mut q0 = 0;
    while q0 < queries {
        let n = chunk.min(queries - q0);
        route_chunk(
            &points[q0 * slices..(q0 + n) * slices],
            &mut out.bits[q0 * words..(q0 + n) * words],
        )?;
        q0 += n;
    }
    Ok(out)
}

/// The router [`best_available`] picked, and why faster paths were skipped.
pub struct Selection {
    /// The chosen router.
    pub router: Box<dyn Router + Send>,
    /// Faster paths that were tried and skipped, fastest first, with the reason
    /// (the caller logs these once).
    pub skipped: Vec<(RouterKind, RouteError)>,
}

/// Picks the fastest router that runs here: Vulkan RT, then wgpu on a hardware
/// adapter, then the CPU BVH (always available for valid data).
pub fn best_available(data: &RouterData) -> Result<Selection, RouteError> {
    let mut skipped = Vec::new();
    match VulkanRtRouter::new(data) {
        Ok(r) => {
            return Ok(Selection {
                router: Box::new(r),
                skipped,
            })
        }
        Err(e @ RouteError::Unavailable { .. }) | Err(e @ RouteError::Device { .. }) => {
            skipped.push((RouterKind::VulkanRt, e))
        }
        Err(e) => return Err(e),
    }
    match WgpuRouter::new(
        data,
        WgpuOptions {
            allow_software: false,
        },
    ) {
        Ok(r) => {
            return Ok(Selection {
                router: Box::new(r),
                skipped,
            })
        }
        Err(e @ RouteError::Unavailable { .. }) | Err(e @ RouteError::Device { .. }) => {
            skipped.push((RouterKind::Wgpu, e))
        }
        Err(e) => return Err(e),
    }
    Ok(Selection {
        router: Box::new(CpuBvh::new(data)?),
        skipped,
    })
}
