//! Pre-tokenization: splitting text into the pieces BPE merges within.
//!
//! The regular expressions are the ones llama.cpp (`llama-vocab.cpp`) and the Hugging Face
//! `tokenizer.json` files use for each `tokenizer.ggml.pre` value. Like Hugging Face's `Split` with
//! `Isolated` behaviour, text between matches is kept as its own piece; several regexes run in
//! sequence, each splitting the pieces of the previous one.

use fancy_regex::Regex;

use crate::TokenizerError;

/// GPT-2's pattern (also the `ByteLevel` pre-tokenizer's default in Hugging Face tokenizers).
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Qwen2's pattern: like Llama 3's, but digits are split one by one.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Llama 3's pattern: numbers in groups of up to three digits.
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Individual digits, the first stage of SmolLM/StarCoder pre-tokenization.
const DIGITS_PATTERN: &str = r"\p{N}";

/// Which pre-tokenizer a vocabulary uses (the `tokenizer.ggml.pre` metadata value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizerKind {
    /// Plain GPT-2 regex (`tokenizer.ggml.pre` = "gpt-2" or absent).
    Gpt2,
    /// Qwen2 / Qwen2.5 ("qwen2").
    Qwen2,
    /// Llama 3 ("llama-bpe", "llama3").
    Llama3,
    /// SmolLM / StarCoder family: digits split individually, then the GPT-2 regex
    /// ("smollm", "starcoder", "refact", "codeshell").
    SmolLm,
}

impl PreTokenizerKind {
    /// Map a `tokenizer.ggml.pre` value to a kind; `None` for names this crate does not know.
    pub fn from_gguf_name(name: &str) -> Option<PreTokenizerKind> {
        match name {
            "default" | "gpt-2" | "gpt2" => Some(PreTokenizerKind::Gpt2),
            "qwen2" => Some(PreTokenizerKind::Qwen2),
            "llama-bpe" | "llama3" | "llama-v3" => Some(PreTokenizerKind::Llama3),
            "smollm" | "starcoder" | "refact" | "codeshell" => Some(PreTokenizerKind::SmolLm),
            _ => None,
        }
    }

    fn patterns(self) -> &'static [&'static str] {
        match self {
            PreTokenizerKind::Gpt2 => &[GPT2_PATTERN],
            PreTokenizerKind::Qwen2 => &[QWEN2_PATTERN],
            PreTokenizerKind::Llama3 => &[LLAMA3_PATTERN],
            PreTokenizerKind::SmolLm => &[DIGITS_PATTERN, GPT2_PATTERN],
        }
    }
}

/// Compiled pre-tokenizer.
#[derive(Debug)]
pub(crate) struct PreTokenizer {
    regexes: Vec<Regex>,
}

/// `pattern` compiled, once per process: compiling the GPT-2 pattern takes
/// milliseconds, far more than building the rest of a tokenizer.
fn compiled(pattern: &'static str) -> Result<Regex, TokenizerError> {
    use std::collections::HashMap;
    use std::sync::Mutex;
    static CACHE: Mutex<Option<HashMap<&'static str, Regex>>> = Mutex::new(None);
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    let cache = cache.get_or_insert_with(HashMap::new);
    if let Some(r) = cache.get(pattern) {
        return Ok(r.clone());
    }
    let r = Regex::new(pattern).map_err(|e| TokenizerError::Regex(e.to_string()))?;
    cache.insert(pattern, r.clone());
    Ok(r)
}

impl PreTokenizer {
    pub(crate) fn new(kind: PreTokenizerKind) -> Result<PreTokenizer, TokenizerError> {
        let regexes = kind
            .patterns()
            .iter()
            .map(|p| compiled(p))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(PreTokenizer { regexes })
    }

    /// Split `text` into pieces, calling `sink` for each non-empty piece in order.
    pub(crate) fn split<'t>(
        &self,
        text: &'t str,
        sink: &mut dyn FnMut(&'t str) -> Result<(), TokenizerError>,
    ) -> Result<(), TokenizerError> {
        self.split_stage(0, text, sink)
    }

    fn split_stage<'t>(
        &self,
        stage: usize,
        text: &'t str,
        sink: &mut dyn FnMut(&'t str) -> Result<(), TokenizerError>,
    ) -> Result<(), TokenizerError> {
        let Some(regex) = self.regexes.get(stage) else {
            return if text.is_empty() { Ok(()) } else { sink(text) };
        };
        let mut last = 0;
        for m in regex.find_iter(text) {
            let m = m.map_err(|e| TokenizerError::Regex(e.to_string()))?;
            if m.start() > last {
                self.split_stage(stage + 1, &text[last..m.start()], sink)?;
            }
            if m.end() > m.start() {
                self.split_stage(stage + 1, m.as_str(), sink)?;
            }
            last = m.end();
        }
        if last < text.len() {
            self.split_stage(stage + 1, &text[last..], sink)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(kind: PreTokenizerKind, text: &str) -> Vec<String> {
        let pre = PreTokenizer::new(kind).unwrap();
        let mut out = Vec::new();
        pre.split(text, &mut |p| {
            out.push(p.to_string());
            Ok(())
        })
        .unwrap();
        out
    }

    #[test]
    fn qwen2_splits_digits_and_keeps_trailing_space_with_run() {
        assert_eq!(
            pieces(PreTokenizerKind::Qwen2, "Hello  world 123's\n\n"),
            vec!["Hello", " ", " world", " ", "1", "2", "3", "'s", "\n\n"]
        );
    }

    #[test]
    fn smollm_splits_digits_before_gpt2_regex() {
        assert_eq!(
            pieces(PreTokenizerKind::SmolLm, "x 3.14 ok"),
            vec!["x", " ", "3", ".", "1", "4", " ok"]
        );
    }

    #[test]
    fn llama3_groups_three_digits() {
        assert_eq!(
            pieces(PreTokenizerKind::Llama3, "1234567"),
            vec!["123", "456", "7"]
        );
    }
}
