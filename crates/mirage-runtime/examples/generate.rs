//! Generate text with the library in a dozen lines (what `mirage-cli generate` does).
//!
//! `cargo run --release -p mirage-runtime --example generate -- [MODEL] [PROMPT]`
use mirage_runtime::{Engine, EngineOptions, GenerateParams};
use std::io::Write;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let model = args
        .next()
        .unwrap_or_else(|| "models/smollm2-135m-instruct-q4_1.gguf".into());
    let prompt = args
        .next()
        .unwrap_or_else(|| "The capital of France is".into());
    let engine = Engine::load(model, EngineOptions::default())?;
    let mut session = engine.session()?;
    let params = GenerateParams {
        max_tokens: 64,
        ..Default::default()
    };
    let out = session.generate(&prompt, &params, |piece| {
        print!("{piece}");
        std::io::stdout().flush().is_ok()
    })?;
    eprintln!(
        "\n[{} tokens, {:.1} tok/s decode]",
        out.stats.generated_tokens,
        out.stats.decode_tok_s()
    );
    Ok(())
}
