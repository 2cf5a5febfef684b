//! `mirage-cli fetch-models`: the same fetch `cargo xtask fetch-models` runs.

use std::path::PathBuf;

/// Arguments of `mirage-cli fetch-models`.
#[derive(Debug, clap::Args)]
pub struct FetchArgs {
    /// Fetch only this model (smollm2 or qwen2.5-coder).
    #[arg(long)]
    pub only: Option<String>,
    /// Folder the models are cached in.
    #[arg(long, default_value = "models")]
    pub dir: PathBuf,
}

/// Runs `fetch-models`.
pub fn run(args: FetchArgs) -> anyhow::Result<()> {
    anyhow::bail!("fetch-models into {}: not implemented yet", args.dir.display())
}
