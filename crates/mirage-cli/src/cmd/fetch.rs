//! `mirage-cli fetch-models`: the same fetch `cargo xtask fetch-models` runs
//! (both call `mirage-fetch`), plus [`resolve_model`] for commands whose
//! `--model` is optional.

use std::path::{Path, PathBuf};

use anyhow::Context;
use mirage_fetch::progress::FetchProgress;
use mirage_fetch::{FetchOutcome, ModelSpec, MODELS};

/// Arguments of `mirage-cli fetch-models`.
#[derive(Debug, clap::Args)]
pub struct FetchArgs {
    /// Fetch only this model: smollm2 or qwen2.5-coder.
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

/// The model a command should load: `explicit` when given, else the default
/// model in the default models folder, fetched first if it is missing. A
/// present default model is used without re-hashing it (that is what
/// `fetch-models` is for), so start-up stays instant.
// Used by `generate`/`chat`/`perplexity` (no --model means the default model).
#[allow(dead_code)]
pub fn resolve_model(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(path) = explicit {
        return Ok(path.to_path_buf());
    }
    let spec = &mirage_fetch::DEFAULT_MODEL;
    let dir = mirage_fetch::default_models_dir();
    let path = dir.join(spec.file_name);
    if path.is_file() {
        return Ok(path);
    }
    tracing::info!("no --model given and {} is missing: fetching it", path.display());
    Ok(ensure(spec, &dir)?.0)
}

/// Runs `fetch-models`.
pub fn run(args: FetchArgs) -> anyhow::Result<()> {
    let dir = args.dir.unwrap_or_else(mirage_fetch::default_models_dir);
    let specs: Vec<&ModelSpec> = match args.only.as_deref() {
        None => MODELS.iter().collect(),
        Some(id) => vec![mirage_fetch::find_model(id).with_context(|| {
            let ids: Vec<&str> = MODELS.iter().map(|m| m.id).collect();
            format!("unknown model {id:?}; known: {}", ids.join(", "))
        })?],
    };
    for spec in specs {
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
