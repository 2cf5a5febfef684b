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
    /// List what can be fetched and what is on disk instead of fetching (as `list-models`).
    #[arg(long)]
    pub list: bool,
    /// With --list: hash the files on disk (sha256, seconds per GB) to say "verified".
    #[arg(long, requires = "list")]
    pub verify: bool,
}

/// Arguments of `mirage-cli list-models`.
#[derive(Debug, clap::Args)]
pub struct ListArgs {
    /// Folder the models are cached in (default: $MIRAGE_MODELS_DIR or ./models).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Hash the files on disk (sha256, seconds per GB) to say "verified" rather than "size matches".
    #[arg(long)]
    pub verify: bool,
    /// Print JSON (one object per model) instead of a table.
    #[arg(long)]
    pub json: bool,
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

/// What is on disk for one known model.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum OnDisk {
    /// No file at the model's path.
    Missing,
    /// A file of the expected size (not hashed).
    SizeMatches,
    /// A file of another size (a partial or stale copy): `fetch-models` replaces it.
    WrongSize {
        /// Its size in bytes.
        size: u64,
    },
    /// Hashed: size and sha256 match.
    Verified,
    /// Hashed: the sha256 differs (`fetch-models` replaces it).
    WrongChecksum,
}

impl OnDisk {
    fn describe(&self) -> String {
        match self {
            OnDisk::Missing => "missing".into(),
            OnDisk::SizeMatches => "present (size matches)".into(),
            OnDisk::WrongSize { size } => format!("present, wrong size ({size} bytes)"),
            OnDisk::Verified => "verified (sha256)".into(),
            OnDisk::WrongChecksum => "present, sha256 differs".into(),
        }
    }
}

/// Looks at `spec`'s file in `dir`; hashes it only when `verify` (a size
/// check costs nothing, a hash reads the whole file).
pub fn on_disk(spec: &ModelSpec, dir: &Path, verify: bool) -> anyhow::Result<OnDisk> {
    let path = dir.join(spec.file_name);
    let meta = match std::fs::metadata(&path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(OnDisk::Missing),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    if meta.len() != spec.size {
        return Ok(OnDisk::WrongSize { size: meta.len() });
    }
    if !verify {
        return Ok(OnDisk::SizeMatches);
    }
    let bar = super::progress::bar("sha256", spec.size);
    bar.set_message(spec.id);
    let digest = mirage_fetch::sha256_file(&path, &mut |ev| {
        if let mirage_fetch::FetchEvent::Bytes { done } = ev {
            bar.set_position(done);
        }
    })?;
    bar.finish_and_clear();
    Ok(if digest == spec.sha256 {
        OnDisk::Verified
    } else {
        OnDisk::WrongChecksum
    })
}

fn size_text(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

/// Runs `list-models` (and `fetch-models --list`).
pub fn list(args: ListArgs) -> anyhow::Result<()> {
    let dir = args.dir.unwrap_or_else(mirage_fetch::default_models_dir);
    let mut rows = Vec::new();
    for spec in MODELS {
        rows.push((spec, on_disk(spec, &dir, args.verify)?));
    }
    if args.json {
        let json: Vec<_> = rows
            .iter()
            .map(|(spec, disk)| {
                serde_json::json!({
                    "id": spec.id,
                    "file": spec.file_name,
                    "size": spec.size,
                    "sha256": spec.sha256,
                    "default": spec.by_default,
                    "path": dir.join(spec.file_name).display().to_string(),
                    "on_disk": disk,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&json)?);
        return Ok(());
    }
    println!("models folder: {}", dir.display());
    println!(
        "{:<20} {:>10}  {:<8} {:<26} file",
        "id", "size", "fetched", "on disk"
    );
    for (spec, disk) in &rows {
        println!(
            "{:<20} {:>10}  {:<8} {:<26} {}",
            spec.id,
            size_text(spec.size),
            if spec.by_default {
                "default"
            } else {
                "by name"
            },
            disk.describe(),
            dir.join(spec.file_name).display()
        );
    }
    println!("fetch with `mirage-cli fetch-models --only ID[,ID...]` (or `--only all`)");
    Ok(())
}

/// Runs `fetch-models`.
pub fn run(args: FetchArgs) -> anyhow::Result<()> {
    if args.list {
        return list(ListArgs {
            dir: args.dir,
            verify: args.verify,
            json: false,
        });
    }
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
