//! `mirage-cli quantize IN OUT --type TYPE`.

use std::path::PathBuf;

/// Arguments of `mirage-cli quantize`.
#[derive(Debug, clap::Args)]
pub struct QuantizeArgs {
    /// The source GGUF file.
    pub input: PathBuf,
    /// Where to write the re-quantized GGUF file.
    pub output: PathBuf,
    /// Target type for the weight tensors (q8_0, q4_0, q4_1, q5_0, q2_k, q4_k, q6_k, ...).
    #[arg(long = "type", short = 't')]
    pub ty: String,
}

/// Runs `quantize`.
pub fn run(args: QuantizeArgs) -> anyhow::Result<()> {
    anyhow::bail!("quantize to {}: not implemented yet", args.ty)
}
