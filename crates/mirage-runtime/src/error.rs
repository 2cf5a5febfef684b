//! The runtime's error type.

use mirage_gguf::GgmlType;

/// Why a runtime call failed.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The model file could not be read or parsed.
    #[error("model file: {0}")]
    Gguf(#[from] mirage_gguf::GgufError),
    /// A quantization codec refused its input.
    #[error("quantization codec: {0}")]
    Quant(#[from] mirage_gguf::quant::QuantError),
    /// The tokenizer could not be built or failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A tensor the architecture needs is not in the file.
    #[error("tensor `{0}` is missing from the model file")]
    MissingTensor(String),
    /// A tensor has an unexpected shape.
    #[error("tensor `{name}` has dims {got:?}, expected {expected:?}")]
    BadShape {
        /// Tensor name.
        name: String,
        /// Dims found (ggml order).
        got: Vec<u64>,
        /// Dims expected (ggml order).
        expected: Vec<u64>,
    },
    /// The backend cannot run tensors of this type.
    #[error("backend `{backend}` does not support {ty} tensors ({what})")]
    UnsupportedType {
        /// Backend name.
        backend: String,
        /// The tensor type.
        ty: GgmlType,
        /// Which tensor or operation.
        what: String,
    },
    /// The backend cannot do what the model or the options need (an operation of
    /// the model's graph, a mode it does not implement); never silently ignored.
    #[error("backend `{backend}` does not implement {what}")]
    Unsupported {
        /// Backend name.
        backend: String,
        /// The operation or mode (and what needs it).
        what: String,
    },
    /// The sequence does not fit in the KV cache.
    #[error("context is full ({n_ctx} positions)")]
    ContextFull {
        /// Positions per sequence in the cache.
        n_ctx: usize,
    },
    /// A context longer than the model was trained on (and its RoPE scaling
    /// extends it to).
    #[error("context of {n_ctx} positions exceeds {limit}: {why}")]
    ContextTooLarge {
        /// Positions asked for.
        n_ctx: usize,
        /// The most the model allows.
        limit: usize,
        /// Where the limit comes from.
        why: String,
    },
    /// A buffer larger than the memory available (see [`crate::memory`]).
    #[error("{what} needs {}, but only {} of memory is available", crate::memory::human_bytes(*needed), crate::memory::human_bytes(*available))]
    OutOfMemory {
        /// What the buffer is, with its shape.
        what: String,
        /// Bytes it needs.
        needed: u64,
        /// Bytes available (0 when the allocator refused without the system saying).
        available: u64,
    },
    /// A caller passed something out of range or inconsistent.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A compute device (GPU backend) failed: driver, compiler or launch error.
    #[error("backend `{backend}`: {message}")]
    Device {
        /// Backend name.
        backend: String,
        /// What the device layer reported.
        message: String,
    },
    /// A generation constraint (grammar, JSON schema) failed to start or
    /// refused a token.
    #[error("constraint: {0}")]
    Constraint(#[from] crate::constraint::ConstraintError),
    /// File-system error.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

/// Shorthand for results of this crate.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
