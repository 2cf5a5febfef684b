//! SentencePiece vocabularies against independent implementations (fixtures written by
//! scripts/gen_sentencepiece_fixtures.py):
//! - Gemma-3-270M's SentencePiece BPE vocabulary (262,144 tokens, byte fallback), read from the GGUF
//!   in models/, against Hugging Face `tokenizers` (GemmaTokenizerFast);
//! - a real Unigram vocabulary (SentencePiece's own 1,000-piece test model with its NFKC charsmap,
//!   committed as a tokenizer-only GGUF), against the `sentencepiece` library.

use std::path::PathBuf;
use std::sync::OnceLock;

use mirage_gguf::GgufFile;
use mirage_tokenizer::{StreamDecoder, TokenType, Tokenizer};
use serde_json::Value;
use sha2::{Digest, Sha256};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn fixture() -> &'static Value {
    static F: OnceLock<Value> = OnceLock::new();
    F.get_or_init(|| {
        let path = fixtures().join("sentencepiece.json");
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    })
}

/// Gemma's tokenizer from models/, or `None` (with a printed reason) when model tests are skipped.
fn gemma() -> Option<&'static Tokenizer> {
    static T: OnceLock<Option<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| {
        let file = fixture()["gemma3"]["file"].as_str().expect("file name");
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
                "{} is missing: run `cargo xtask fetch-models --only gemma3-270m`",
                path.display()
            );
        }
        let gguf = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Some(Tokenizer::from_gguf(&gguf).expect("Gemma tokenizer"))
    })
    .as_ref()
}

fn unigram() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let path = fixtures().join(fixture()["unigram"]["file"].as_str().expect("file"));
        let gguf = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Tokenizer::from_gguf(&gguf).expect("Unigram tokenizer")
    })
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

fn gpl_text() -> String {
    let bytes = fixture()["gpl"]["bytes"].as_u64().unwrap() as usize;
    let path = "/usr/share/common-licenses/GPL-3";
    let data = std::fs::read(path)
        .unwrap_or_else(|e| panic!("{path}: {e} (it ships with Debian's base-files)"));
    String::from_utf8(data[..bytes.min(data.len())].to_vec()).expect("GPL-3 is ASCII")
}

/// Streaming the ids token by token gives the same text as decoding them at once.
fn stream(tok: &Tokenizer, ids: &[u32]) -> String {
    let mut d = StreamDecoder::new();
    let mut out: String = ids.iter().map(|&id| d.push_token(tok, id)).collect();
    out.push_str(&d.finish());
    out
}

#[test]
fn gemma_encodings_match_hugging_face() {
    let Some(tok) = gemma() else { return };
    let m = &fixture()["gemma3"];
    assert_eq!(tok.vocab_size() as u64, m["vocab_size"].as_u64().unwrap());
    let cases = m["cases"].as_array().expect("cases");
    assert!(cases.len() >= 30, "fixture has too few cases");
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
                    "{what} {text:?}:\n  expected {expected:?}\n  got      {got:?}"
                ));
            }
        }
        let ids = ids_of(&case["ids"]);
        let decoded = tok.decode(&ids, false).unwrap();
        if decoded != case["decoded"].as_str().unwrap() {
            failures.push(format!("decode {text:?} gave {decoded:?}"));
        }
        let skipped = tok.decode(&ids, true).unwrap();
        if skipped != case["decoded_skip_special"].as_str().unwrap() {
            failures.push(format!("decode(skip_special) {text:?} gave {skipped:?}"));
        }
        // Byte-fallback tokens reassemble into whole characters when streamed.
        if stream(tok, &ids) != decoded {
            failures.push(format!("streamed decode of {text:?} differs"));
        }
        // A literal `▁` in the text is SentencePiece's space mark and decodes as a space.
        let plain = tok.encode(text, false, false).unwrap();
        if !text.contains('▁') && tok.decode(&plain, false).unwrap() != text {
            failures.push(format!("decode(encode(s)) != s for {text:?}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn gemma_gpl_20kb_matches_hugging_face() {
    let Some(tok) = gemma() else { return };
    let m = &fixture()["gemma3"];
    let text = gpl_text();
    let ids = tok.encode(&text, false, true).unwrap();
    let head = ids_of(&m["gpl_head"]);
    assert_eq!(&ids[..head.len().min(ids.len())], &head[..]);
    assert_eq!(ids.len() as u64, m["gpl_len"].as_u64().unwrap());
    assert_eq!(ids_sha256(&ids), m["gpl_sha256"].as_str().unwrap());
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
}

#[test]
fn gemma_special_tokens() {
    let Some(tok) = gemma() else { return };
    assert_eq!(tok.bos(), Some(2));
    assert_eq!(tok.eos(), Some(1));
    assert!(tok.add_bos() && !tok.add_eos());
    let eot = tok.token_id("<end_of_turn>").expect("<end_of_turn>");
    assert!(tok.is_eog(eot) && tok.is_eog(1) && !tok.is_eog(2));
    assert_eq!(tok.token_type(238), Some(TokenType::Byte));
    assert_eq!(tok.token_to_piece(238 + 0x41), b"A");
    // A character split into byte tokens: nothing until the last byte arrives.
    let ids = tok.encode("\u{0378}", false, false).unwrap();
    assert_eq!(ids.len(), 2, "{ids:?}");
    let mut d = StreamDecoder::new();
    assert_eq!(d.push_token(tok, ids[0]), "");
    assert_eq!(d.push_token(tok, ids[1]), "\u{0378}");
}

#[test]
fn unigram_encodings_match_sentencepiece() {
    let tok = unigram();
    let m = &fixture()["unigram"];
    assert_eq!(tok.vocab_size() as u64, m["vocab_size"].as_u64().unwrap());
    let mut failures = Vec::new();
    for case in m["cases"].as_array().expect("cases") {
        let text = case["text"].as_str().expect("text");
        let expected = ids_of(&case["ids"]);
        let got = tok.encode(text, false, false).unwrap();
        if got != expected {
            failures.push(format!(
                "{text:?}:\n  expected {expected:?}\n  got      {got:?}"
            ));
        }
        // add_special appends EOS (T5 style), no BOS.
        let with_eos = tok.encode(text, true, false).unwrap();
        if with_eos.split_last() != Some((&tok.eos().unwrap(), &got[..])) {
            failures.push(format!("add_special {text:?} gave {with_eos:?}"));
        }
        // SentencePiece shows the unknown token as " ⁇ ", MIRAGE as its text.
        let decoded = tok.decode(&expected, false).unwrap();
        let unk = tok
            .token_str(tok.token_id("<unk>").expect("<unk>"))
            .unwrap();
        if decoded != case["decoded"].as_str().unwrap().replace(" \u{2047} ", unk) {
            failures.push(format!("decode {text:?} gave {decoded:?}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn unigram_gpl_20kb_matches_sentencepiece() {
    let tok = unigram();
    let m = &fixture()["unigram"];
    let ids = tok.encode(&gpl_text(), false, false).unwrap();
    let head = ids_of(&m["gpl_head"]);
    assert_eq!(&ids[..head.len().min(ids.len())], &head[..]);
    assert_eq!(ids.len() as u64, m["gpl_len"].as_u64().unwrap());
    assert_eq!(ids_sha256(&ids), m["gpl_sha256"].as_str().unwrap());
}
