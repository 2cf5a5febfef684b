//! The runtime: the [`Backend`] trait, the CPU backend, the model graph
//! (llama, qwen2, qwen3), the KV cache and sampling, and the high-level
//! [`Engine`]/[`Session`] API that frontends use.
//!
//! Libraries never print; errors are [`RuntimeError`].
#![deny(missing_docs)]

pub mod attention_pruned;
pub mod backend;
pub mod batch;
pub mod convert;
pub mod engine;
pub mod error;
pub mod kv_cache;
pub mod kv_pages;
pub mod memory;
pub mod model;
pub mod observe;
pub mod ops;
pub mod perplexity;
pub mod rope;
pub mod sampling;

pub use backend::cpu::CpuBackend;
pub use backend::{Backend, TokenSlot};
pub use engine::{
    Engine, EngineOptions, GenerateParams, Generation, GenerationStats, Session, StopReason,
};
pub use error::{Result, RuntimeError};
pub use kv_cache::{KvCache, KvDtype};
pub use kv_pages::KvPruning;
pub use model::{Model, ModelConfig};
pub use sampling::{Sampler, SamplingParams, StopStrings};
