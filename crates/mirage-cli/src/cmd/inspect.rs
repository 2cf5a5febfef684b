//! `mirage-cli inspect FILE [--json]`.

use std::path::PathBuf;

/// Arguments of `mirage-cli inspect`.
#[derive(Debug, clap::Args)]
pub struct InspectArgs {
    /// The GGUF file to describe.
    pub file: PathBuf,
    /// Print one JSON object (stable keys) instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// Runs `inspect`.
pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    anyhow::bail!("inspect {}: not implemented yet", args.file.display())
}
