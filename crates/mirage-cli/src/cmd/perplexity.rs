//! `mirage-cli perplexity`: llama-perplexity's measure on a text file.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use mirage::{Backend, Engine, WithEngine};

use super::generate::ModelArgs;

/// Arguments of `perplexity`.
#[derive(Debug, Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Text file to score (llama-perplexity's -f).
    #[arg(short = 'f', long, alias = "file")]
    text: PathBuf,
    /// Evaluate at most this many windows (0: all).
    #[arg(long, default_value_t = 0)]
    chunks: usize,
    /// Print the result as JSON on stdout.
    #[arg(long)]
    json: bool,
}

/// The window when `--ctx-size` is not given (llama-perplexity's habit).
const DEFAULT_WINDOW: usize = 512;

/// Runs `perplexity`: windows of `--ctx-size` tokens (default 512), the
/// second half of each scored.
pub fn run(mut args: PerplexityArgs) -> anyhow::Result<()> {
    if args.model.ctx_size == 0 {
        args.model.ctx_size = DEFAULT_WINDOW;
    }
    let text = std::fs::read_to_string(&args.text)
        .with_context(|| format!("reading {}", args.text.display()))?;
    args.model.with_engine(Perplexity {
        args: &args,
        text: &text,
    })
}

struct Perplexity<'a> {
    args: &'a PerplexityArgs,
    text: &'a str,
}

impl WithEngine for Perplexity<'_> {
    type Out = anyhow::Result<()>;
    fn run<B: Backend>(self, engine: Engine<B>) -> anyhow::Result<()> {
        perplexity_with(&engine, self.args, self.text)
    }
}

fn perplexity_with<B: Backend>(
    engine: &Engine<B>,
    args: &PerplexityArgs,
    text: &str,
) -> anyhow::Result<()> {
    let start = std::time::Instant::now();
    let bar = super::progress::bar("perplexity", 0);
    let r = mirage_runtime::perplexity::perplexity(
        engine,
        text,
        args.model.ctx_size,
        args.chunks,
        |i, n, ppl| {
            bar.set_length(n as u64);
            bar.set_position(i as u64 + 1);
            bar.set_message(format!("PPL {ppl:.4}"));
            if bar.is_hidden() {
                tracing::info!("[{}/{}] running PPL {:.4}", i + 1, n, ppl);
            }
        },
    );
    bar.finish_and_clear();
    let r = r?;
    let secs = start.elapsed().as_secs_f64();
    if args.json {
        let json = serde_json::json!({
            "model": args.model.model.display().to_string(),
            "text": args.text.display().to_string(),
            "backend": engine.backend_name(),
            "ppl": r.ppl,
            "ppl_err": r.ppl_err,
            "mean_nll": r.mean_nll,
            "n_ctx": r.n_ctx,
            "n_chunks": r.n_chunks,
            "n_scored": r.n_scored,
            "n_tokens": r.n_tokens,
            "chunk_ppl": r.chunk_ppl,
            "seconds": secs,
        });
        println!("{}", serde_json::to_string_pretty(&json)?);
    } else {
        println!(
            "PPL = {:.4} +/- {:.5} ({} chunks of {} tokens, {} scored, {:.1} s)",
            r.ppl, r.ppl_err, r.n_chunks, r.n_ctx, r.n_scored, secs
        );
    }
    Ok(())
}
