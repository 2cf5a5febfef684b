//! The runtime: the [`Backend`] trait, the CPU backend, the model graphs
//! (llama, qwen2, qwen3; gemma3), the KV cache and sampling, and the high-level
//! [`Engine`]/[`Session`] API that frontends use.
//!
//! Libraries never print; errors are [`RuntimeError`].
#![deny(missing_docs)]

pub mod attention_pruned;
pub mod backend;
pub mod batch;
pub mod constraint;
pub mod convert;
pub mod engine;
pub mod error;
pub mod gemma3;
pub mod generate;
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
pub use constraint::{Constraint, ConstraintError, ConstraintState, TokenMask};
pub use engine::{
    Engine, EngineOptions, GenerateParams, Generation, GenerationStats, Session, StopReason,
};
pub use error::{Result, RuntimeError};
pub use generate::{TokenPiece, TokenStream};
pub use kv_cache::{KvCache, KvDtype};
pub use kv_pages::KvPruning;
pub use model::{Model, ModelConfig};
pub use sampling::{
    token_logprob, Sampler, SamplingParams, StopStrings, TokenLogprob, MAX_TOP_LOGPROBS,
};
