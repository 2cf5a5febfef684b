//! Another Rust program running a model through `mirage`: on a CUDA GPU when
//! one answers, else on the CPU.
//!
//! `cargo run --release -p mirage --example complete -- models/smollm2-135m-instruct-q4_1.gguf "The capital of France is"`
use mirage::{Backend, Engine, GenerateParams, LoadSpec, WithEngine};

struct Complete(String);

impl WithEngine for Complete {
    type Out = Result<String, mirage::RuntimeError>;
    fn run<B: Backend>(self, engine: Engine<B>) -> Self::Out {
        let out = engine
            .session()?
            .generate(&self.0, &GenerateParams::default(), |_| true)?;
        Ok(format!(
            "[{}] {}{}",
            engine.backend_name(),
            self.0,
            out.text
        ))
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let model = args.next().ok_or("usage: complete MODEL.gguf [PROMPT]")?;
    let prompt = args
        .next()
        .unwrap_or_else(|| "The capital of France is".into());
    println!(
        "{}",
        mirage::load(&LoadSpec::new(model), Complete(prompt))??
    );
    Ok(())
}
