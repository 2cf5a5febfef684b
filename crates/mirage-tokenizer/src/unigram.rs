//! SentencePiece Unigram (`tokenizer.ggml.model` = `t5`): the most probable segmentation.
//!
//! Text is first normalized as the vocabulary's SentencePiece normalizer did at training time: the
//! precompiled character map ([`CharsMap`]: NFKC and similar rules), then whitespace: runs
//! collapsed and ends trimmed (`remove_extra_whitespaces`), a `▁` before the first word
//! (`add_space_prefix`), every space written as `▁`. Then a Viterbi pass over the normalized bytes
//! picks the segmentation whose token scores (log probabilities) sum highest; a character no token
//! covers is the unknown token with the lowest normal score minus 10, and a run of unknown tokens
//! collapses into one. This is SentencePiece's `unigram_model.cc` (`EncodeOptimized`) as
//! llama.cpp's `llm_tokenizer_ugm` implements it, scores summed in f64 as both do.

use std::collections::HashMap;

use crate::charsmap::CharsMap;
use crate::TokenizerError;

/// What SentencePiece subtracts from the lowest normal score to score an unknown character.
const UNKNOWN_PENALTY: f64 = 10.0;

/// Whitespace handling of the normalizer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct UnigramOptions {
    /// Prepend `▁` to the text (SentencePiece `add_dummy_prefix`).
    pub(crate) add_space_prefix: bool,
    /// Drop leading and trailing whitespace and collapse inner runs to one space.
    pub(crate) remove_extra_whitespaces: bool,
}

/// A Unigram vocabulary ready to encode.
#[derive(Debug)]
pub(crate) struct Unigram {
    /// Token text -> (id, score used by the search).
    by_text: HashMap<String, (u32, f64)>,
    /// Longest token text, in bytes (bounds the prefix search).
    max_len: usize,
    unknown_id: u32,
    unknown_score: f64,
    charsmap: CharsMap,
    options: UnigramOptions,
}

/// Best segmentation found so far of the normalized text up to some byte offset.
#[derive(Debug, Clone, Copy)]
struct Best {
    id: u32,
    start: usize,
    score: f64,
}

impl Unigram {
    /// `candidates` are (text, id, score, is_user_defined) of the tokens the search may use
    /// (normal, user-defined and unused ones); `normal_scores` are the scores of the normal tokens.
    pub(crate) fn new(
        candidates: impl IntoIterator<Item = (String, u32, f32, bool)>,
        normal_scores: impl IntoIterator<Item = f32>,
        unknown_id: u32,
        charsmap: CharsMap,
        options: UnigramOptions,
    ) -> Unigram {
        let mut by_text = HashMap::new();
        let mut max_len = 0;
        for (text, id, score, user_defined) in candidates {
            max_len = max_len.max(text.len());
            // User-defined tokens score 0 so that they win over any split of their text (normal
            // scores are log probabilities, below 0).
            let score = if user_defined { 0.0 } else { f64::from(score) };
            by_text.insert(text, (id, score));
        }
        let min_score = normal_scores
            .into_iter()
            .map(f64::from)
            .fold(f64::from(f32::MAX), f64::min);
        Unigram {
            by_text,
            max_len,
            unknown_id,
            unknown_score: min_score - UNKNOWN_PENALTY,
            charsmap,
            options,
        }
    }

    /// The normalized form of `text`: character map applied, whitespace escaped to `▁`.
    pub(crate) fn normalize(&self, text: &str) -> Vec<u8> {
        const SPACE: &[u8] = "▁".as_bytes();
        let o = self.options;
        let mut out = Vec::with_capacity(text.len() * 3 / 2 + 3);
        let mut in_word = false;
        let mut space_prepended = false;
        let bytes = text.as_bytes();
        let mut at = 0;
        while at < bytes.len() {
            let (piece, consumed): (&[u8], usize) = match self.charsmap.longest_match(&bytes[at..])
            {
                Some((consumed, replacement)) => (replacement, consumed),
                None => {
                    // One character unchanged (`text` is valid UTF-8, so this is a boundary).
                    let len = utf8_len(bytes[at]).min(bytes.len() - at);
                    (&bytes[at..at + len], len)
                }
            };
            for &c in piece {
                if c != b' ' {
                    if !in_word {
                        in_word = true;
                        if (o.add_space_prefix && !space_prepended) || o.remove_extra_whitespaces {
                            out.extend_from_slice(SPACE);
                            space_prepended = true;
                        }
                    }
                    out.push(c);
                } else {
                    in_word = false;
                    if !o.remove_extra_whitespaces {
                        out.extend_from_slice(SPACE);
                    }
                }
            }
            at += consumed;
        }
        out
    }

    /// Append the ids of `text` to `out`.
    pub(crate) fn encode(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        let normalized = self.normalize(text);
        let n = normalized.len();
        if n == 0 {
            return Ok(());
        }
        let unreached = Best {
            id: self.unknown_id,
            start: 0,
            score: f64::MIN,
        };
        let mut best = vec![unreached; n + 1];
        best[0].score = 0.0;
        let mut at = 0;
        while at < n {
            let char_len = utf8_len(normalized[at]).min(n - at);
            let here = best[at].score;
            let mut covers_char = false;
            for len in 1..=self.max_len.min(n - at) {
                // Token texts are valid UTF-8; a slice that is not cannot match one.
                let Ok(candidate) = std::str::from_utf8(&normalized[at..at + len]) else {
                    continue;
                };
                if let Some(&(id, score)) = self.by_text.get(candidate) {
                    covers_char |= len == char_len;
                    let score = here + score;
                    if score > best[at + len].score {
                        best[at + len] = Best {
                            id,
                            start: at,
                            score,
                        };
                    }
                }
            }
            if !covers_char {
                let score = here + self.unknown_score;
                if score > best[at + char_len].score {
                    best[at + char_len] = Best {
                        id: self.unknown_id,
                        start: at,
                        score,
                    };
                }
            }
            at += char_len;
        }
        let first = out.len();
        let mut pos = n;
        let mut previous_unknown = false;
        loop {
            let b = best[pos];
            let unknown = b.id == self.unknown_id;
            if !(previous_unknown && unknown) {
                out.push(b.id);
            }
            if b.start == 0 {
                break;
            }
            previous_unknown = unknown;
            pos = b.start;
        }
        out[first..].reverse();
        Ok(())
    }
}

/// Length of the UTF-8 sequence a lead byte starts (1 for a stray continuation byte).
fn utf8_len(lead: u8) -> usize {
    match lead {
        0xF0..=0xFF => 4,
        0xE0..=0xEF => 3,
        0xC0..=0xDF => 2,
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toy(options: UnigramOptions) -> Unigram {
        let vocab = [
            ("<unk>", 0, 0.0),
            ("▁", 1, -2.0),
            ("▁ab", 2, -3.0),
            ("a", 3, -2.0),
            ("b", 4, -2.0),
            ("▁a", 5, -1.5),
            ("c", 6, -4.0),
        ];
        Unigram::new(
            vocab
                .iter()
                .skip(1)
                .map(|&(t, id, s)| (t.to_string(), id, s, false)),
            vocab.iter().skip(1).map(|v| v.2),
            0,
            CharsMap::default(),
            options,
        )
    }

    #[test]
    fn viterbi_picks_the_best_sum() {
        let t = toy(UnigramOptions {
            add_space_prefix: true,
            remove_extra_whitespaces: true,
        });
        assert_eq!(t.normalize("  ab   c "), "▁ab▁c".as_bytes());
        let mut out = Vec::new();
        // "▁ab" (-3) beats "▁a" + "b" (-3.5); "▁c" is "▁" + "c" (-6).
        t.encode("  ab   c ", &mut out).unwrap();
        assert_eq!(out, vec![2, 1, 6]);
        out.clear();
        // Unknown characters collapse into one unknown token.
        t.encode("abxyz", &mut out).unwrap();
        assert_eq!(out, vec![2, 0]);
    }

    #[test]
    fn whitespace_kept_without_removal() {
        let t = toy(UnigramOptions {
            add_space_prefix: false,
            remove_extra_whitespaces: false,
        });
        assert_eq!(t.normalize(" a  b"), "▁a▁▁b".as_bytes());
        let mut out = Vec::new();
        t.encode("", &mut out).unwrap();
        assert!(out.is_empty());
    }
}
