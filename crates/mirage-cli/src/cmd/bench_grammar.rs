//! `mirage-cli bench-grammar`: decode speed with a JSON schema against
//! unconstrained decoding of the same model in the same process (CPU),
//! and the cost of one grammar mask.
//!
//! Each round generates greedily from the same chat prompts twice, once
//! free and once under the schema, alternating so that both see the same
//! machine load; decode tok/s counts decode steps over their seconds
//! (forward pass, sampling and, when constrained, the mask). The mask cost
//! is then measured alone by replaying the constrained outputs through a
//! fresh matcher.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use mirage_grammar::{GrammarCompiler, GrammarSpec};
use mirage_runtime::{Engine, EngineOptions, GenerateParams, TokenMask};
use mirage_tokenizer::ChatMessage;

/// Arguments of `mirage-cli bench-grammar`.
#[derive(Debug, Args)]
pub struct BenchGrammarArgs {
    /// GGUF model file.
    #[arg(long, default_value = super::generate::DEFAULT_MODEL)]
    pub model: PathBuf,
    /// JSON schema file (default: a record with strings, an integer, an
    /// enum and an array).
    #[arg(long = "json-schema")]
    pub json_schema: Option<PathBuf>,
    /// Rounds (each: every prompt free, then constrained).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Most tokens per generation.
    #[arg(long = "max-tokens", default_value_t = 96)]
    pub max_tokens: usize,
    /// CPU worker threads (0: one per CPU).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

const PROMPTS: [&str; 3] = [
    "Describe a fictional person as JSON: name, age, city, role and hobbies.",
    "Give me a JSON record for a software engineer who lives in Lisbon.",
    "Invent a character for a story and return it as JSON.",
];

fn default_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "city": {"type": "string"},
            "role": {"enum": ["engineer", "artist", "teacher", "doctor", "other"]},
            "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 4}
        },
        "required": ["name", "age", "city", "role", "hobbies"],
        "additionalProperties": false
    })
}

/// Runs `bench-grammar`.
pub fn run(args: BenchGrammarArgs) -> anyhow::Result<()> {
    super::generate::check_model(&args.model)?;
    let engine = Engine::load(
        &args.model,
        EngineOptions {
            threads: args.threads,
            n_ctx: 1024,
            ..Default::default()
        },
    )
    .with_context(|| format!("loading {}", args.model.display()))?;
    let schema = match &args.json_schema {
        Some(p) => serde_json::from_str(
            &std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
        )
        .with_context(|| format!("{} is not JSON", p.display()))?,
        None => default_schema(),
    };
    let vocab = engine.model().config().vocab_size;
    let t = Instant::now();
    let compiler = GrammarCompiler::new(engine.tokenizer(), vocab)?;
    let index_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let grammar = compiler.compile(&GrammarSpec::JsonSchema(schema))?;
    let compile_ms = t.elapsed().as_secs_f64() * 1e3;
    let prompts: Vec<String> = PROMPTS
        .iter()
        .map(|p| engine.render_chat(&[ChatMessage::new("user", *p)]))
        .collect::<Result<_, _>>()?;
    let free = GenerateParams {
        max_tokens: args.max_tokens,
        ..Default::default()
    };
    let constrained = GenerateParams {
        constraint: Some(grammar.clone()),
        ..free.clone()
    };
    let mut session = engine.session()?;
    // (steps, seconds) per mode.
    let (mut free_run, mut json_run) = ((0usize, 0.0f64), (0usize, 0.0f64));
    let mut outputs = Vec::new();
    let (mut valid, mut cut) = (0usize, 0usize);
    for _ in 0..args.rounds.max(1) {
        for prompt in &prompts {
            for (params, acc) in [(&free, &mut free_run), (&constrained, &mut json_run)] {
                session.reset();
                let out = session.generate(prompt, params, |_| true)?;
                acc.0 += out.stats.decode_steps;
                acc.1 += out.stats.decode_secs;
                if params.constraint.is_some() {
                    valid += serde_json::from_str::<serde_json::Value>(&out.text).is_ok() as usize;
                    cut +=
                        (out.stats.stop_reason == mirage_runtime::StopReason::MaxTokens) as usize;
                    outputs.push(out.tokens);
                }
            }
        }
    }
    // The mask alone, replayed over the constrained outputs.
    let mut mask = TokenMask::new(vocab);
    let (mut masks, mut mask_secs, mut mask_max) = (0usize, 0.0f64, 0.0f64);
    for tokens in &outputs {
        let mut state = mirage_runtime::Constraint::start(&*grammar)?;
        for &tok in tokens {
            mask.clear();
            let t = Instant::now();
            state.fill_mask(&mut mask)?;
            let s = t.elapsed().as_secs_f64();
            state.accept(tok)?;
            masks += 1;
            mask_secs += s;
            mask_max = mask_max.max(s);
        }
    }
    let rate = |(steps, secs): (usize, f64)| if secs > 0.0 { steps as f64 / secs } else { 0.0 };
    let (free_tok_s, json_tok_s) = (rate(free_run), rate(json_run));
    let ratio = if free_tok_s > 0.0 {
        json_tok_s / free_tok_s
    } else {
        0.0
    };
    let mask_mean_us = if masks > 0 {
        mask_secs / masks as f64 * 1e6
    } else {
        0.0
    };
    let model = args
        .model
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    if args.json {
        let json = serde_json::json!({
            "model": model,
            "vocab": vocab,
            "free_decode_tok_s": free_tok_s,
            "json_decode_tok_s": json_tok_s,
            "ratio": ratio,
            "free_steps": free_run.0,
            "json_steps": json_run.0,
            "json_outputs": outputs.len(),
            "json_outputs_valid": valid,
            "json_outputs_cut_at_max_tokens": cut,
            "mask_us_mean": mask_mean_us,
            "mask_us_max": mask_max * 1e6,
            "vocab_index_ms": index_ms,
            "schema_compile_ms": compile_ms,
        });
        println!("{}", serde_json::to_string(&json)?);
    } else {
        println!(
            "model: {model} (vocabulary {vocab}), {} rounds x {} prompts, greedy, CPU",
            args.rounds.max(1),
            prompts.len()
        );
        println!("| decode | tok/s | steps |");
        println!("|---|---:|---:|");
        println!("| unconstrained | {free_tok_s:.1} | {} |", free_run.0);
        println!("| JSON schema | {json_tok_s:.1} | {} |", json_run.0);
        println!("ratio (schema / unconstrained): {ratio:.3}");
        println!(
            "valid JSON outputs: {valid} of {} ({cut} cut off at --max-tokens)",
            outputs.len()
        );
        println!(
            "mask: {mask_mean_us:.0} us mean, {:.0} us max over {masks} tokens; vocabulary index {index_ms:.0} ms, schema compile {compile_ms:.1} ms",
            mask_max * 1e6
        );
    }
    Ok(())
}
