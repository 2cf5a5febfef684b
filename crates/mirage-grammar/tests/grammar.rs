//! Grammars against the real SmolLM2 and Qwen2.5 vocabularies: what the
//! masks allow, that special tokens never match grammar text, that
//! end-of-generation comes only where the grammar may end, and a real
//! greedy generation under a JSON schema.

use std::path::PathBuf;
use std::sync::Arc;

use mirage_grammar::{GrammarCompiler, GrammarSpec};
use mirage_runtime::{Constraint, Engine, EngineOptions, GenerateParams, StopReason, TokenMask};
use mirage_tokenizer::{TokenType, Tokenizer};

fn model_path(name: &str) -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(name);
    if p.exists() {
        return Some(p);
    }
    if std::env::var("MIRAGE_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!(
            "skipping: {} is missing and MIRAGE_SKIP_MODEL_TESTS=1",
            p.display()
        );
        return None;
    }
    panic!(
        "{} is missing: run `cargo xtask fetch-models` (or set MIRAGE_SKIP_MODEL_TESTS=1)",
        p.display()
    );
}

const SMOLLM2: &str = "smollm2-135m-instruct-q4_1.gguf";
const QWEN: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

fn tokenizer(name: &str) -> Option<Tokenizer> {
    let file = mirage_gguf::GgufFile::open(model_path(name)?).unwrap();
    Some(Tokenizer::from_gguf(&file).unwrap())
}

/// Feeds `text` token by token (our BPE encoding) through `grammar`,
/// checking each token against the mask; returns whether the whole text
/// was allowed and whether end-of-generation is allowed after it.
fn run_text(
    tok: &Tokenizer,
    grammar: &Arc<mirage_grammar::Grammar>,
    vocab: usize,
    text: &str,
) -> (bool, bool) {
    let mut state = grammar.start().unwrap();
    let mut mask = TokenMask::new(vocab);
    for id in tok.encode(text, false, false).unwrap() {
        mask.clear();
        state.fill_mask(&mut mask).unwrap();
        if !mask.is_allowed(id) {
            return (false, false);
        }
        state.accept(id).unwrap();
    }
    mask.clear();
    state.fill_mask(&mut mask).unwrap();
    (true, tok.eog_ids().iter().all(|&e| mask.is_allowed(e)))
}

#[test]
fn masks_follow_the_grammar_and_keep_special_tokens_out() {
    for name in [SMOLLM2, QWEN] {
        let Some(tok) = tokenizer(name) else { return };
        let vocab = tok.vocab_size() + 7; // padded lm head rows, as Qwen has
        let compiler = GrammarCompiler::new(&tok, vocab).unwrap();
        let schema = serde_json::json!({
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": false
        });
        let g = compiler.compile(&GrammarSpec::JsonSchema(schema)).unwrap();
        assert_eq!(
            run_text(&tok, &g, vocab, r#"{"name": "Ann", "age": 41}"#),
            (true, true),
            "{name}"
        );
        // A prefix is allowed but may not end; wrong keys are refused.
        assert_eq!(
            run_text(&tok, &g, vocab, r#"{"name": "Ann""#),
            (true, false),
            "{name}"
        );
        assert!(!run_text(&tok, &g, vocab, r#"{"nome": "Ann"}"#).0, "{name}");
        assert!(!run_text(&tok, &g, vocab, r#"{"name": 5}"#).0, "{name}");

        // Inside a string every text token may come, but no special token,
        // even one whose text a grammar string could spell, and no EOG.
        let any = compiler
            .compile(&GrammarSpec::Regex("(.|\n)*".into()))
            .unwrap();
        let mut state = any.start().unwrap();
        let mut mask = TokenMask::new(vocab);
        state.fill_mask(&mut mask).unwrap();
        let control: Vec<u32> = (0..tok.vocab_size() as u32)
            .filter(|&id| tok.token_type(id) == Some(TokenType::Control))
            .collect();
        assert!(!control.is_empty());
        for &id in &control {
            assert!(
                !mask.is_allowed(id) || tok.is_eog(id),
                "{name}: control token {id} allowed"
            );
        }
        for id in tok.vocab_size()..vocab {
            assert!(
                !mask.is_allowed(id as u32),
                "{name}: padding id {id} allowed"
            );
        }
        let im_end = tok.token_id("<|im_end|>").expect("a ChatML vocabulary");
        let spelled = compiler
            .compile(&GrammarSpec::Lark("start: \"<|im_end|>\"".into()))
            .unwrap();
        let mut state = spelled.start().unwrap();
        mask.clear();
        state.fill_mask(&mut mask).unwrap();
        assert!(
            !mask.is_allowed(im_end),
            "{name}: grammar text matched a special token"
        );
        assert!(mask.is_allowed(tok.encode("<", false, false).unwrap()[0]));
    }
}

#[test]
fn gbnf_grammars_constrain_like_their_lark_translation() {
    let Some(tok) = tokenizer(SMOLLM2) else {
        return;
    };
    let vocab = tok.vocab_size();
    let compiler = GrammarCompiler::new(&tok, vocab).unwrap();
    let g = compiler
        .compile(&GrammarSpec::Gbnf(
            r#"
root   ::= answer " because " reason "."
answer ::= "yes" | "no"
reason ::= [a-z ]{3,40}
"#
            .into(),
        ))
        .unwrap();
    assert_eq!(
        run_text(&tok, &g, vocab, "yes because it rains."),
        (true, true)
    );
    assert_eq!(run_text(&tok, &g, vocab, "no because it"), (true, false));
    assert!(!run_text(&tok, &g, vocab, "maybe because").0);
    assert!(!run_text(&tok, &g, vocab, "yes because IT.").0);
    let bad = compiler
        .compile(&GrammarSpec::Gbnf("root ::= missing".into()))
        .unwrap_err();
    assert!(
        bad.to_string().contains("undefined rule `missing`"),
        "{bad}"
    );
    let bad = compiler
        .compile(&GrammarSpec::JsonSchema(serde_json::json!({"type": "wat"})))
        .unwrap_err();
    assert!(
        matches!(bad, mirage_grammar::GrammarError::Invalid(_)),
        "{bad}"
    );
}

#[test]
fn greedy_generation_under_a_json_schema_is_valid_json() {
    let Some(path) = model_path(SMOLLM2) else {
        return;
    };
    let engine = Engine::load(
        path,
        EngineOptions {
            n_ctx: 512,
            ..Default::default()
        },
    )
    .unwrap();
    let compiler =
        GrammarCompiler::new(engine.tokenizer(), engine.model().config().vocab_size).unwrap();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "country": {"type": "string", "maxLength": 24},
            "population": {"type": "integer", "minimum": 0}
        },
        "required": ["city", "country", "population"],
        "additionalProperties": false
    });
    let grammar = compiler.compile(&GrammarSpec::JsonSchema(schema)).unwrap();
    let params = GenerateParams {
        max_tokens: 96,
        constraint: Some(grammar),
        logprobs: Some(3),
        ..Default::default()
    };
    let prompt = engine
        .render_chat(&[mirage_tokenizer::ChatMessage::new(
            "user",
            "Describe Paris as JSON with city, country and population.",
        )])
        .unwrap();
    let mut session = engine.session().unwrap();
    let out = session.generate(&prompt, &params, |_| true).unwrap();
    assert_eq!(
        out.stats.stop_reason,
        StopReason::EndOfGeneration,
        "{}",
        out.text
    );
    let v: serde_json::Value =
        serde_json::from_str(&out.text).unwrap_or_else(|e| panic!("{e}: {}", out.text));
    let obj = v.as_object().unwrap();
    assert_eq!(obj.len(), 3, "{v}");
    assert!(obj["city"].is_string() && obj["country"].is_string(), "{v}");
    assert!(obj["population"].as_u64().is_some(), "{v}");
    assert_eq!(out.logprobs.len(), out.tokens.len());
    for (lp, &t) in out.logprobs.iter().zip(&out.tokens) {
        assert_eq!(lp.token, t);
        assert!(lp.logprob <= 0.0 && lp.top.len() == 3);
        assert!(
            lp.top[0].1 >= lp.logprob - 1e-5,
            "top-1 is at least the chosen token"
        );
    }
}

#[test]
fn batched_sequences_keep_their_own_grammar_and_logprobs() {
    use mirage_runtime::batch::{Batcher, SeqEvent};
    let Some(path) = model_path(SMOLLM2) else {
        return;
    };
    let engine = Engine::load(
        path,
        EngineOptions {
            n_ctx: 512,
            ..Default::default()
        },
    )
    .unwrap();
    let compiler =
        GrammarCompiler::new(engine.tokenizer(), engine.model().config().vocab_size).unwrap();
    let grammar = compiler
        .compile(&GrammarSpec::Gbnf(
            r#"root ::= "The answer is " ("yes" | "no") "." "#.into(),
        ))
        .unwrap();
    let prompt = engine
        .render_chat(&[mirage_tokenizer::ChatMessage::new(
            "user",
            "Is the sky blue?",
        )])
        .unwrap();
    let ids = engine.encode(&prompt, true).unwrap();
    let constrained = GenerateParams {
        max_tokens: 32,
        constraint: Some(grammar),
        logprobs: Some(2),
        ..Default::default()
    };
    let free = GenerateParams {
        max_tokens: 8,
        ..Default::default()
    };
    // Alone, through a session.
    let alone = engine
        .session()
        .unwrap()
        .generate_from(&ids, &constrained, |_| true)
        .unwrap();
    assert!(
        alone.text == "The answer is yes." || alone.text == "The answer is no.",
        "{}",
        alone.text
    );
    // In a batch beside a free sequence.
    let mut batcher = Batcher::new(&engine, 2, 64).unwrap();
    let a = batcher.add(ids.clone(), &constrained).unwrap();
    let b = batcher.add(ids.clone(), &free).unwrap();
    let (mut texts, mut lps, mut done) = (vec![String::new(); 2], vec![Vec::new(); 2], 0);
    let mut events = Vec::new();
    while done < 2 {
        batcher.step(&mut events).unwrap();
        for ev in events.drain(..) {
            match ev {
                SeqEvent::Text { slot, text } => texts[slot].push_str(&text),
                SeqEvent::Logprob { slot, logprob } => lps[slot].push(logprob),
                SeqEvent::Finished {
                    slot,
                    reason,
                    completion_tokens,
                    ..
                } => {
                    done += 1;
                    if slot == a {
                        assert_eq!(reason, StopReason::EndOfGeneration);
                        assert_eq!(completion_tokens, lps[a].len());
                    }
                }
            }
        }
    }
    assert_eq!(texts[a], alone.text);
    // Same tokens; the values agree up to the batch's other summation order.
    assert_eq!(lps[a].len(), alone.logprobs.len());
    for (x, y) in lps[a].iter().zip(&alone.logprobs) {
        assert_eq!((x.token, x.top.len()), (y.token, 2));
        assert!((x.logprob - y.logprob).abs() < 0.2, "{x:?} vs {y:?}");
    }
    assert!(lps[b].is_empty(), "not asked for");
    assert!(!texts[b].is_empty());
}

#[test]
fn required_tool_choice_yields_a_parsable_call() {
    use mirage_grammar::{parse_tool_calls, tool_call_grammar, ToolChoice};
    let Some(path) = model_path(SMOLLM2) else {
        return;
    };
    let engine = Engine::load(
        path,
        EngineOptions {
            n_ctx: 1024,
            ..Default::default()
        },
    )
    .unwrap();
    let compiler =
        GrammarCompiler::new(engine.tokenizer(), engine.model().config().vocab_size).unwrap();
    let tools = serde_json::json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
         "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                        "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "description": "Time in a city",
         "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                        "required": ["city"], "additionalProperties": false}}}
    ]);
    let messages =
        serde_json::json!([{"role": "user", "content": "What is the weather in Paris?"}]);
    let prompt = engine
        .chat_template()
        .unwrap()
        .render_json(&messages, Some(&tools), true)
        .unwrap();
    for (choice, parallel) in [
        (ToolChoice::Required, false),
        (ToolChoice::Named("get_time".into()), true),
    ] {
        let spec = tool_call_grammar(&tools, &choice, parallel)
            .unwrap()
            .unwrap();
        let params = GenerateParams {
            max_tokens: 80,
            constraint: Some(compiler.compile(&spec).unwrap()),
            ..Default::default()
        };
        let out = engine
            .session()
            .unwrap()
            .generate(&prompt, &params, |_| true)
            .unwrap();
        let (content, calls) = parse_tool_calls(&out.text);
        assert!(content.is_empty(), "{choice:?}: {:?}", out.text);
        assert!(!calls.is_empty(), "{choice:?}: {:?}", out.text);
        if !parallel {
            assert_eq!(calls.len(), 1, "{:?}", out.text);
        }
        for c in &calls {
            if let ToolChoice::Named(n) = &choice {
                assert_eq!(&c.name, n);
            }
            assert!(c.name == "get_weather" || c.name == "get_time", "{c:?}");
            let args: serde_json::Value = serde_json::from_str(&c.arguments).unwrap();
            assert!(args["city"].is_string(), "{c:?}");
        }
    }
}
