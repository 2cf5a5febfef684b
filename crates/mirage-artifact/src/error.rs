//! The crate's error type.

use mirage_gguf::GgmlType;

/// Why building, loading or running an artifact failed.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file does not start with the artifact magic.
    #[error("not a MIRAGE artifact (bad magic)")]
    BadMagic,
    /// The file's format version is not one this reader knows.
    #[error("artifact format version {found}, this reader knows {supported}: rebuild it with this version's `cargo xtask build-artifacts`")]
    UnsupportedVersion {
        /// Version in the file.
        found: u32,
        /// Version this code reads.
        supported: u32,
    },
    /// The file is an artifact of the other kind.
    #[error("this is {found}, but {expected} was expected")]
    WrongKind {
        /// What the file is.
        found: &'static str,
        /// What the caller needs.
        expected: &'static str,
    },
    /// The file is shorter than its header or section table says.
    #[error("artifact truncated: {what} needs {need} bytes, the file has {have}")]
    Truncated {
        /// Which part.
        what: String,
        /// Bytes needed.
        need: u64,
        /// Bytes present.
        have: u64,
    },
    /// A section's (or the header's) sha256 does not match its bytes.
    #[error("artifact corrupted: checksum of {section} does not match")]
    ChecksumMismatch {
        /// Which section (or `header`).
        section: String,
    },
    /// The bytes are well-checksummed but inconsistent.
    #[error("malformed artifact: {0}")]
    Malformed(String),
    /// The artifact was built from a different model file.
    #[error("artifact was built from a GGUF with sha256 {expected}, this model's is {found}")]
    SourceMismatch {
        /// sha256 recorded in the artifact.
        expected: String,
        /// sha256 of the model offered.
        found: String,
    },
    /// A quantization type cannot hold a page of this model.
    #[error("{ty} cannot pack rows of {d_model} values (block size {block})")]
    QuantUnsupported {
        /// The type asked for.
        ty: GgmlType,
        /// Row length.
        d_model: usize,
        /// The type's block size.
        block: usize,
    },
    /// The budget is below the smallest artifact that can be built.
    #[error("budget of {budget} bytes is impossible: the smallest artifact that fits needs {min_bytes} bytes")]
    BudgetTooSmall {
        /// Asked budget.
        budget: u64,
        /// Smallest size that would fit.
        min_bytes: u64,
    },
    /// An argument is out of range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A codec call failed.
    #[error(transparent)]
    Quant(#[from] mirage_gguf::quant::QuantError),
    /// The GGUF file is unusable.
    #[error(transparent)]
    Gguf(#[from] mirage_gguf::GgufError),
    /// The runtime failed (calibration forward pass, ...).
    #[error(transparent)]
    Runtime(#[from] mirage_runtime::RuntimeError),
    /// Router data was rejected.
    #[error(transparent)]
    Route(#[from] mirage_route::RouteError),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, ArtifactError>;

impl ArtifactError {
    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        ArtifactError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}
