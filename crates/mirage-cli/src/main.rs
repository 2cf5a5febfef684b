//! `mirage-cli`: the thin command-line frontend over MIRAGE's libraries.
//!
//! Every subcommand lives in its own module under `cmd/` and exposes two
//! things: a `clap::Args` struct and `fn run(args) -> anyhow::Result<()>`.
//! Adding a command is one module, one variant in [`Command`] and one arm in
//! [`Command::run`]. Libraries never print; this binary does.

mod cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// MIRAGE: run, inspect and convert GGUF language models.
#[derive(Debug, Parser)]
#[command(name = "mirage-cli", version, about, long_about = None)]
struct Cli {
    /// More log output (-v: debug, -vv: trace). RUST_LOG, when set, wins.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,

    #[command(subcommand)]
    command: Command,
}

/// The subcommands, one module each under `cmd/`.
#[derive(Debug, Subcommand)]
enum Command {
    /// Show a GGUF file's architecture, hyperparameters, tokenizer and tensors.
    Inspect(cmd::inspect::InspectArgs),
    /// Re-quantize a GGUF file's weight tensors to another ggml type.
    Quantize(cmd::quantize::QuantizeArgs),
    /// Download, verify (sha256) and cache the known models under models/.
    FetchModels(cmd::fetch::FetchArgs),
    /// Generate a continuation of a prompt (streams to stdout).
    Generate(cmd::generate::GenerateArgs),
    /// Interactive chat with the model's chat template.
    Chat(cmd::chat::ChatArgs),
    /// Perplexity of a text file, as llama-perplexity computes it.
    Perplexity(cmd::perplexity::PerplexityArgs),
    /// Prompt and decode speed on a backend, against a copy-bandwidth ceiling.
    Bench(cmd::bench::BenchArgs),
    /// Decode speed under a JSON schema against unconstrained decoding (CPU, same run), and the mask cost.
    BenchGrammar(cmd::bench_grammar::BenchGrammarArgs),
    /// Fidelity of an artifact's sparse FFN (BVH router, predictor, oracle) on held-out text.
    Eval(cmd::eval::EvalArgs),
    /// Long-context fidelity and speed of KV-page pruning (pruned vs full attention).
    EvalLong(cmd::eval_long::EvalLongArgs),
}

impl Command {
    fn run(self) -> anyhow::Result<()> {
        match self {
            Command::Inspect(args) => cmd::inspect::run(args),
            Command::Quantize(args) => cmd::quantize::run(args),
            Command::FetchModels(args) => cmd::fetch::run(args),
            Command::Generate(args) => cmd::generate::run(args),
            Command::Chat(args) => cmd::chat::run(args),
            Command::Perplexity(args) => cmd::perplexity::run(args),
            Command::Bench(args) => cmd::bench::run(args),
            Command::BenchGrammar(args) => cmd::bench_grammar::run(args),
            Command::Eval(args) => cmd::eval::run(args),
            Command::EvalLong(args) => cmd::eval_long::run(args),
        }
    }
}

/// Logs go to stderr so that stdout stays clean for generated text and JSON.
fn init_tracing(verbose: u8) {
    use tracing_subscriber::EnvFilter;
    let default = match verbose {
        0 => "warn,mirage=info",
        1 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    // `try_init` so that a second initialisation (tests) is not fatal.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.verbose);
    match cli.command.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // `{:#}` prints the whole context chain on one line: "a: b: c".
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
