//! Real-model checks: the tokenizer and chat templates built from the two GGUF files in models/ must
//! reproduce what Hugging Face transformers (an independent implementation, building its tokenizer
//! from the same GGUF) produced. Fixtures: scripts/gen_tokenizer_fixtures.py and
//! scripts/gen_chat_fixtures.py.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Instant;

use mirage_gguf::GgufFile;
use mirage_tokenizer::{ChatMessage, ChatTemplate, StreamDecoder, Tokenizer};
use serde_json::Value;
use sha2::{Digest, Sha256};

const MODELS: [&str; 2] = ["smollm2", "qwen2.5-coder"];

fn fixture(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn tokenizer_fixture() -> &'static Value {
    static F: OnceLock<Value> = OnceLock::new();
    F.get_or_init(|| fixture("tokenizer.json"))
}

/// The GGUF file of a fixture model, or `None` (with a printed reason) when model tests are skipped.
fn open_model(model: &str) -> Option<GgufFile> {
    let file = tokenizer_fixture()["models"][model]["file"]
        .as_str()
        .expect("fixture names the file");
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(file);
    if !path.exists() {
        if std::env::var("MIRAGE_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
            println!(
                "skipping: {} is missing and MIRAGE_SKIP_MODEL_TESTS=1",
                path.display()
            );
            return None;
        }
        panic!(
            "{} is missing: run `cargo xtask fetch-models`",
            path.display()
        );
    }
    Some(GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

/// One tokenizer per model for the whole test binary (building the Qwen vocabulary takes a moment).
fn tokenizer(model: &str) -> Option<&'static Tokenizer> {
    static TOKENIZERS: OnceLock<Vec<Option<Tokenizer>>> = OnceLock::new();
    let all = TOKENIZERS.get_or_init(|| {
        MODELS
            .iter()
            .map(|m| open_model(m).map(|f| Tokenizer::from_gguf(&f).expect("tokenizer from GGUF")))
            .collect()
    });
    let i = MODELS
        .iter()
        .position(|m| *m == model)
        .expect("known model");
    all[i].as_ref()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn ids_sha256(ids: &[u32]) -> String {
    let mut h = Sha256::new();
    for id in ids {
        h.update(id.to_le_bytes());
    }
    hex::encode(h.finalize())
}

fn gpl_text(bytes: usize) -> String {
    let path = "/usr/share/common-licenses/GPL-3";
    let data = std::fs::read(path)
        .unwrap_or_else(|e| panic!("{path}: {e} (it ships with Debian's base-files)"));
    String::from_utf8(data[..bytes.min(data.len())].to_vec()).expect("GPL-3 is ASCII")
}

#[test]
fn encodings_match_transformers() {
    for model in MODELS {
        let Some(tok) = tokenizer(model) else {
            continue;
        };
        let cases = tokenizer_fixture()["models"][model]["cases"]
            .as_array()
            .expect("cases");
        assert!(cases.len() >= 25, "fixture has too few cases");
        let mut failures = Vec::new();
        for case in cases {
            let text = case["text"].as_str().expect("text");
            let checks = [
                (
                    "parse_special",
                    ids_of(&case["ids"]),
                    tok.encode(text, false, true).unwrap(),
                ),
                (
                    "no parse_special",
                    ids_of(&case["ids_no_parse_special"]),
                    tok.encode(text, false, false).unwrap(),
                ),
                (
                    "add_special",
                    ids_of(&case["ids_add_special"]),
                    tok.encode(text, true, true).unwrap(),
                ),
            ];
            for (what, expected, got) in checks {
                if expected != got {
                    failures.push(format!(
                        "{model} {what} {text:?}:\n  expected {expected:?}\n  got      {got:?}"
                    ));
                }
            }
            let ids = ids_of(&case["ids"]);
            let decoded = tok.decode(&ids, false).unwrap();
            if decoded != case["decoded"].as_str().unwrap() || decoded != text {
                failures.push(format!("{model} decode {text:?} gave {decoded:?}"));
            }
            let skipped = tok.decode(&ids, true).unwrap();
            if skipped != case["decoded_skip_special"].as_str().unwrap() {
                failures.push(format!(
                    "{model} decode(skip_special) {text:?} gave {skipped:?}"
                ));
            }
            // Round trip through our own encoder too, without special parsing.
            let plain = tok.encode(text, false, false).unwrap();
            if tok.decode(&plain, false).unwrap() != text {
                failures.push(format!("{model} decode(encode(s)) != s for {text:?}"));
            }
        }
        assert!(
            failures.is_empty(),
            "{} mismatches:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
}

#[test]
fn gpl_20kb_matches_transformers() {
    let spec = &tokenizer_fixture()["gpl"];
    let text = gpl_text(spec["bytes"].as_u64().unwrap() as usize);
    for model in MODELS {
        let Some(tok) = tokenizer(model) else {
            continue;
        };
        let m = &tokenizer_fixture()["models"][model];
        let ids = tok.encode(&text, false, true).unwrap();
        let head = ids_of(&m["gpl_head"]);
        assert_eq!(
            &ids[..head.len().min(ids.len())],
            &head[..],
            "{model}: first ids differ"
        );
        assert_eq!(
            ids.len() as u64,
            m["gpl_len"].as_u64().unwrap(),
            "{model}: id count differs"
        );
        assert_eq!(
            ids_sha256(&ids),
            m["gpl_sha256"].as_str().unwrap(),
            "{model}: id hash differs"
        );
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            text,
            "{model}: round trip"
        );
    }
}

#[test]
fn special_token_metadata_matches() {
    for model in MODELS {
        let Some(tok) = tokenizer(model) else {
            continue;
        };
        let m = &tokenizer_fixture()["models"][model];
        assert_eq!(
            tok.vocab_size() as u64,
            m["vocab_size"].as_u64().unwrap(),
            "{model}"
        );
        assert_eq!(tok.bos().map(u64::from), m["bos"].as_u64(), "{model} bos");
        assert_eq!(tok.eos().map(u64::from), m["eos"].as_u64(), "{model} eos");
        assert_eq!(
            tok.padding().map(u64::from),
            m["pad"].as_u64(),
            "{model} pad"
        );
        assert!(
            !tok.add_bos(),
            "{model}: both models say add_bos_token = false"
        );
        let im_end = tok.token_id("<|im_end|>").expect("<|im_end|>");
        let endoftext = tok.token_id("<|endoftext|>").expect("<|endoftext|>");
        let im_start = tok.token_id("<|im_start|>").expect("<|im_start|>");
        assert!(tok.is_eog(im_end) && tok.is_eog(endoftext), "{model}");
        assert!(!tok.is_eog(im_start), "{model}");
        assert_eq!(tok.token_to_piece(im_end), b"<|im_end|>");
        assert_eq!(tok.token_str(im_end), Some("<|im_end|>"));
        assert!(tok.decode(&[tok.vocab_size() as u32], false).is_err());
    }
}

#[test]
fn stream_decoder_reassembles_split_characters() {
    for model in MODELS {
        let Some(tok) = tokenizer(model) else {
            continue;
        };
        for case in tokenizer_fixture()["models"][model]["cases"]
            .as_array()
            .unwrap()
        {
            let text = case["text"].as_str().unwrap();
            let ids = ids_of(&case["ids"]);
            let mut stream = StreamDecoder::new();
            let mut out = String::new();
            let mut split_seen = false;
            for &id in &ids {
                let part = stream.push_token(tok, id);
                split_seen |= stream.has_pending();
                assert!(
                    !part.contains('\u{FFFD}'),
                    "{model} {text:?}: partial char leaked"
                );
                out.push_str(&part);
            }
            out.push_str(&stream.finish());
            assert_eq!(out, text, "{model}");
            if text.contains('👨') {
                assert!(split_seen, "{model}: emoji tokens should split a character");
            }
        }
    }
}

#[test]
fn chat_templates_match_transformers() {
    let chat = fixture("chat.json");
    for model in MODELS {
        let Some(file) = open_model(model) else {
            continue;
        };
        let template = ChatTemplate::from_gguf(&file).expect("chat template");
        let tok = tokenizer(model).expect("model present");
        let cases = chat["models"][model]["cases"].as_array().expect("cases");
        assert!(cases.len() >= 6);
        for case in cases {
            let messages: Vec<ChatMessage> = case["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| {
                    ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap())
                })
                .collect();
            let add = case["add_generation_prompt"].as_bool().unwrap();
            let rendered = template.render(&messages, add).expect("render");
            assert_eq!(
                rendered,
                case["rendered"].as_str().unwrap(),
                "{model} {} add={add}",
                case["name"]
            );
            assert_eq!(
                tok.encode(&rendered, false, true).unwrap(),
                ids_of(&case["ids"]),
                "{model} ids"
            );
        }
    }
}

/// Tools, assistant tool calls and tool results through templates that render tools (Qwen2.5's),
/// against Python jinja2 in transformers' environment (scripts/gen_tool_chat_fixtures.py); and the
/// Hermes-style fallback for a template that does not (SmolLM2's).
#[test]
fn chat_templates_render_tools_like_transformers() {
    let fx = fixture("chat_tools.json");
    let tools = &fx["tools"];
    for (key, case) in fx["models"].as_object().unwrap() {
        let Some(file) = open_model(key) else {
            continue;
        };
        let template = ChatTemplate::from_gguf(&file).expect("chat template");
        assert!(template.supports_tools(), "{key}");
        for r in case["renderings"].as_array().unwrap() {
            let got = template
                .render_json(&r["messages"], Some(tools), true)
                .unwrap();
            assert_eq!(got, r["text"].as_str().unwrap(), "{key} {}", r["name"]);
        }
    }
    let Some(file) = open_model("smollm2") else {
        return;
    };
    let template = ChatTemplate::from_gguf(&file).expect("chat template");
    assert!(!template.supports_tools());
    // The Qwen fixture's round trip, rendered by SmolLM2's template: the same tool text, carried in
    // plain system/assistant/user turns.
    let round_trip = &fx["models"]["qwen2.5-coder"]["renderings"][1];
    let got = template
        .render_json(&round_trip["messages"], Some(tools), true)
        .unwrap();
    let qwen = round_trip["text"].as_str().unwrap();
    assert_eq!(got, qwen, "same ChatML turns, same tool format");
    let plain = template
        .render_json(
            &serde_json::json!([{"role": "user", "content": "hi"}]),
            None,
            true,
        )
        .unwrap();
    assert_eq!(
        plain,
        template
            .render(&[ChatMessage::new("user", "hi")], true)
            .unwrap()
    );
}

/// Throughput on the whole GPL-3 text, cold and warm cache. Prints tokens/s (run with
/// `--release -- --nocapture` for the number worth quoting); asserts a generous bound so a
/// pathological slowdown fails even in the dev profile.
#[test]
fn encode_speed_on_gpl3() {
    let text = gpl_text(usize::MAX);
    for model in MODELS {
        let Some(tok) = tokenizer(model) else {
            continue;
        };
        tok.clear_cache();
        let start = Instant::now();
        let ids = tok.encode(&text, false, true).unwrap();
        let cold = start.elapsed().as_secs_f64();
        let reps = 5;
        let start = Instant::now();
        for _ in 0..reps {
            assert_eq!(tok.encode(&text, false, true).unwrap().len(), ids.len());
        }
        let warm = start.elapsed().as_secs_f64() / reps as f64;
        println!(
            "{model}: {} bytes -> {} tokens; cold {:.1} ms ({:.0} tok/s, {:.2} MB/s), warm {:.1} ms ({:.0} tok/s)",
            text.len(),
            ids.len(),
            cold * 1e3,
            ids.len() as f64 / cold,
            text.len() as f64 / cold / 1e6,
            warm * 1e3,
            ids.len() as f64 / warm,
        );
        assert!(
            cold < 2.0,
            "{model}: encoding {} bytes took {cold:.2} s",
            text.len()
        );
    }
}

/// Long runs that one regex alternative or one BPE piece must swallow whole: these must neither hit
/// the regex engine's backtracking limit nor go quadratic in the merge loop, and must round-trip.
#[test]
fn pathological_inputs_stay_linear_and_round_trip() {
    let inputs = [
        " ".repeat(200_000),
        "\t \n".repeat(60_000),
        "a".repeat(200_000),
        "9".repeat(100_000),
        "😀".repeat(30_000),
        "!?".repeat(60_000) + "x",
        format!("{}<|im_end|>{}", "é".repeat(50_000), " \n".repeat(50_000)),
    ];
    for model in MODELS {
        let Some(tok) = tokenizer(model) else {
            continue;
        };
        for text in &inputs {
            let start = Instant::now();
            let ids = tok
                .encode(text, false, true)
                .unwrap_or_else(|e| panic!("{model}: {e}"));
            let secs = start.elapsed().as_secs_f64();
            println!(
                "{model}: {} bytes -> {} ids in {:.1} ms",
                text.len(),
                ids.len(),
                secs * 1e3
            );
            assert!(secs < 3.0, "{model}: {} bytes took {secs:.2} s", text.len());
            assert_eq!(&tok.decode(&ids, false).unwrap(), text, "{model}");
        }
    }
}
