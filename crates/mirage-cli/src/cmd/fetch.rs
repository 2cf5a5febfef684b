//! `mirage-cli fetch-models`: the same fetch `cargo xtask fetch-models` runs
//! (both call `mirage-fetch`), plus [`fetch_if_known_and_missing`] for
//! commands that load a model.

use std::path::{Path, PathBuf};

use anyhow::Context;
use mirage_fetch::progress::FetchProgress;
use mirage_fetch::{FetchOutcome, ModelSpec, MODELS};

/// Arguments of `mirage-cli fetch-models`.
#[derive(Debug, clap::Args)]
pub struct FetchArgs {
    /// Fetch only these models (comma-separated ids, or `all`); without it the
    /// default set: smollm2 and qwen2.5-coder.
    #[arg(long)]
    pub only: Option<String>,
    /// Folder the models are cached in (default: $MIRAGE_MODELS_DIR or ./models).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// Makes sure `spec` is in `dir` (fetching it when missing or stale) and
/// returns its path, drawing progress on stderr.
pub fn ensure(spec: &ModelSpec, dir: &Path) -> anyhow::Result<(PathBuf, FetchOutcome)> {
    let mut progress = FetchProgress::new(spec.id);
    mirage_fetch::ensure_model(spec, dir, &mut |ev| progress.handle(ev))
        .with_context(|| format!("fetching {} into {}", spec.id, dir.display()))
}

/// Makes sure a model path a command is about to load exists: when `path` is
/// missing and its file name is one of the known models (the default
/// `models/smollm2-135m-instruct-q4_1.gguf`, say), that model is fetched into
/// the path's folder first. Returns whether a fetch happened. A present file
/// is used as is, without re-hashing it (`fetch-models` verifies), so
/// start-up stays instant; an unknown missing file is left for the caller to
/// report.
// Used by `generate`/`chat`/`perplexity` before loading their `--model`.
#[allow(dead_code)]
pub fn fetch_if_known_and_missing(path: &Path) -> anyhow::Result<bool> {
    if path.exists() {
        return Ok(false);
    }
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return Ok(false);
    };
    let Some(spec) = MODELS.iter().find(|m| m.file_name == name) else {
        return Ok(false);
    };
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    tracing::info!("{} is missing: fetching {}", path.display(), spec.id);
    ensure(spec, &dir)?;
    Ok(true)
}

/// Runs `fetch-models`.
pub fn run(args: FetchArgs) -> anyhow::Result<()> {
    let dir = args.dir.unwrap_or_else(mirage_fetch::default_models_dir);
    for spec in mirage_fetch::select_models(args.only.as_deref())? {
        let (path, outcome) = ensure(spec, &dir)?;
        let what = match outcome {
            FetchOutcome::AlreadyPresent => "up to date",
            FetchOutcome::Fetched => "fetched",
            FetchOutcome::Replaced => "replaced",
        };
        println!("{:<14} {what:<10} {}", spec.id, path.display());
    }
    Ok(())
}
