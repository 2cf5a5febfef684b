//! The sparse CUDA backend (`SparseCudaBackend`) on a small artifact built
//! here (random FFN whose Q8_0 encoding is exact in both orientations, random
//! BVH router data): all pages vs the dense CUDA FFN, the device routing vs
//! the CPU PageSelector, the forced and routed modes vs the CPU superblock
//! backend and an f64 reference, and the routed FFN replayed from a CUDA
//! graph. With SmolLM2 present, a real artifact end to end against the CPU
//! superblock backend. NVFP4 pages (`PageFormat::Nvfp4`): their packing in
//! the artifact's channel order (CPU), every mode vs f64 on the decoded
//! pages, and a whole model decoded with all pages vs the dense backend's
//! NVFP4 weights. Q2_K pages (`PageFormat::Q2K`): their packing in the
//! artifact's channel order and the d_model check (CPU), every mode vs f64
//! on the decoded pages. Without a GPU each test prints why it skips and
//! passes; with MIRAGE_REQUIRE_CUDA_TESTS=1 a missing GPU fails them.
//!
//! One test binary (benches/gpu/ runs the GPU suites by binary name), its
//! modules by concern: `fixture` (the shared artifact and helpers), `modes`,
//! `graph`, `formats` and `nvfp4_model`.
#![cfg(feature = "cuda")]

#[path = "../common/mod.rs"]
mod common;
mod fixture;
mod formats;
mod graph;
mod modes;
mod nvfp4_model;
