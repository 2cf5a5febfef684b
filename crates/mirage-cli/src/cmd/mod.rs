//! One module per subcommand. Each exposes a `clap::Args` struct and
//! `pub fn run(args) -> anyhow::Result<()>`; `main.rs` only dispatches.

pub mod fetch;
pub mod inspect;
pub mod quantize;
