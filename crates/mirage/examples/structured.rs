//! Structured output: the answer is held to a JSON schema by a grammar
//! mask on every sampled token, so it always parses.
//!
//! `cargo run --release -p mirage --example structured -- models/smollm2-135m-instruct-q4_1.gguf "Describe a teacher from Oslo."`
use mirage::{BackendChoice, ChatMessage, GenerateParams, GrammarSpec, LoadedEngine};
use serde_json::json;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let model = args
        .next()
        .ok_or("usage: structured MODEL.gguf [REQUEST]")?;
    let request = args
        .next()
        .unwrap_or_else(|| "Describe a teacher from Oslo.".into());

    let engine = LoadedEngine::load(&model, BackendChoice::Auto)?;
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0},
            "city": {"type": "string", "maxLength": 40}
        },
        "required": ["name", "age", "city"],
        "additionalProperties": false
    });
    let params = GenerateParams {
        max_tokens: 96,
        constraint: Some(engine.grammar(&GrammarSpec::JsonSchema(schema))?),
        ..Default::default()
    };
    let prompt = engine.render_chat(&[ChatMessage::new(
        "user",
        format!("{request} Answer in JSON."),
    )])?;
    let context = engine.encode(&prompt, true)?;
    let out = engine
        .session()?
        .generate_from(&context, &params, |_| true)?;
    let value: serde_json::Value = serde_json::from_str(&out.text)?;
    println!("{}", serde_json::to_string_pretty(&value)?);
    println!("name: {}, age: {}", value["name"], value["age"]);
    Ok(())
}
