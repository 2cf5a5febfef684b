//! MIRAGE's model-format layer: GGUF read/write over mmap, metadata, tensor
//! views, the ggml quantization codecs and safetensors import.
//!
//! This crate knows nothing about inference, routing or devices; every layer
//! above reads tensor types through [`GgmlType`] and the codecs in [`quant`].
//!
//! # Public surface
//!
//! - [`GgufFile`]: a parsed GGUF v2/v3 file that owns its bytes (a read-only
//!   memory map from [`GgufFile::open`], the file read into huge-page
//!   memory from [`GgufFile::open_with`] and [`FileMemory::Resident`] (the
//!   CPU decode's weights: [`resident`] says why), or a `Vec<u8>` from
//!   [`GgufFile::from_bytes`], same parser). [`GgufFile::metadata`] is the
//!   ordered key -> [`Value`] map ([`Metadata`]); [`GgufFile::tensors`] the
//!   [`TensorInfo`] records in file order (dims in ggml order: `dims[0]` is
//!   the contiguous row length; `offset` relative to
//!   [`GgufFile::data_offset`]); [`GgufFile::tensor`] a zero-copy
//!   [`TensorView`]; [`GgufFile::hparams`] the typed [`ModelHparams`] of a
//!   llama/qwen2/qwen3 model.
//! - [`GgufWriter`]: writes ordered metadata plus tensors (name, dims, type,
//!   bytes) as GGUF v3, to any `Write` or atomically to a path;
//!   [`GgufWriter::from_gguf`] rewrites a file unchanged, byte for byte.
//! - [`SafetensorsFile`]: a `.safetensors` file whose F32/F16/BF16 tensors come
//!   out as [`ImportedTensor`]s (dims reversed into ggml order), ready for a
//!   writer.
//! - [`quant_mix`]: the ggml type each tensor gets under one of llama.cpp's
//!   quantization presets or a single type, as `llama-quantize` picks it.
//! - [`GgufError`]: every error; parse errors carry the byte offset.
//!
//! The reader is our own rather than the `gguf-rs` crate: gguf-rs truncates
//! metadata arrays to 3 entries unless asked for more (the Qwen tokenizer
//! needs all 151,936), pulls CLI dependencies, and has no writer; ours keeps
//! file order so a rewrite is byte-identical, and is fuzzed.
//!
//! Hostile input never panics and never makes the reader allocate from a
//! length it has not checked against the bytes that remain.
//!
//! ```no_run
//! use mirage_gguf::GgufFile;
//! let f = GgufFile::open("models/smollm2-135m-instruct-q4_1.gguf")?;
//! let hp = f.hparams()?;
//! let tokens = f.metadata().get_str_array("tokenizer.ggml.tokens").unwrap();
//! let embd = f.tensor("token_embd.weight").unwrap();
//! assert_eq!(embd.info.dims, [hp.n_embd as u64, hp.vocab_size as u64]);
//! # let _ = tokens;
//! # Ok::<(), mirage_gguf::GgufError>(())
//! ```
#![deny(missing_docs)]

pub mod atomic;
pub mod error;
pub mod hparams;
pub mod metadata;
pub mod quant;
pub mod quant_mix;
pub mod reader;
pub mod resident;
pub mod safetensors;
pub mod synth;
pub mod tensor;
pub mod types;
pub mod writer;

pub use error::GgufError;
pub use hparams::{Arch, ModelHparams, RopeScaling, RopeScalingType};
pub use metadata::{Array, Metadata, Value, ValueType};
pub use reader::{GgufFile, DEFAULT_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_DIMS};
pub use resident::FileMemory;
pub use safetensors::{ImportedTensor, SafetensorsFile};
pub use tensor::{TensorInfo, TensorView};
pub use types::{GgmlType, QK_K};
pub use writer::{GgufStreamWriter, GgufWriter, TensorDecl, WriterTensor};
