//! MIRAGE's model-format layer: GGUF read/write over mmap, metadata, tensor
//! views, the ggml quantization codecs and safetensors import.
//!
//! This crate knows nothing about inference, routing or devices; every layer
//! above reads tensor types through [`GgmlType`] and the codecs in [`quant`].
#![deny(missing_docs)]

pub mod quant;
pub mod types;

pub use types::{GgmlType, QK_K};
