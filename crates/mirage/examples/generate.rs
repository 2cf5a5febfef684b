//! Generates a continuation, printing each piece as it comes: the backend is
//! picked at run time (a CUDA GPU when one answers, else the CPU) and the
//! generation is an iterator of pieces.
//!
//! `cargo run --release -p mirage --example generate -- models/smollm2-135m-instruct-q4_1.gguf "The capital of France is" 32`
use std::io::Write;

use mirage::{BackendChoice, GenerateParams, LoadedEngine, SamplingParams};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let model = args
        .next()
        .ok_or("usage: generate MODEL.gguf [PROMPT] [MAX_TOKENS]")?;
    let prompt = args
        .next()
        .unwrap_or_else(|| "The capital of France is".into());
    let max_tokens = args.next().map(|n| n.parse()).transpose()?.unwrap_or(32);

    let engine = LoadedEngine::load(&model, BackendChoice::Auto)?;
    let params = GenerateParams {
        max_tokens,
        sampling: SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut stream = engine.session()?.stream(&prompt, &params)?;
    print!("[{}] {prompt}", engine.backend_name());
    for piece in stream.by_ref() {
        print!("{}", piece?.text);
        std::io::stdout().flush()?;
    }
    let (_session, generation) = stream.finish();
    println!(
        "\n{} tokens, {:.1} tok/s, stopped: {:?}",
        generation.tokens.len(),
        generation.stats.decode_tok_s(),
        generation.stats.stop_reason
    );
    Ok(())
}
