//! SentencePiece BPE (`tokenizer.ggml.model` = `llama`): merges chosen by token score.
//!
//! A piece of text (spaces already escaped to `▁`) starts as one symbol per UTF-8 character. The
//! adjacent pair whose concatenation is a vocabulary token with the highest score is merged (the
//! leftmost pair among equal scores), until no adjacent pair forms a token. A final symbol that is
//! not a token (a character the vocabulary lacks) falls back to its bytes as `<0xNN>` tokens, or to
//! the unknown token when the vocabulary has no byte tokens. This is SentencePiece's
//! `bpe_model.cc` and llama.cpp's `llm_tokenizer_spm`; like SentencePiece, only normal,
//! user-defined and unused tokens take part in merges (control, unknown and byte tokens are matched
//! only as special tokens or produced by the fallback).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use crate::TokenizerError;

/// The merge table of a SentencePiece BPE vocabulary.
#[derive(Debug)]
pub(crate) struct SpmBpe {
    /// Mergeable token text -> (id, score).
    by_text: HashMap<String, (u32, f32)>,
    /// `<0xNN>` token of each byte value.
    byte_ids: [Option<u32>; 256],
    unknown_id: Option<u32>,
}

/// A candidate merge: the heap pops the highest score, then the leftmost.
#[derive(Debug, PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Byte length of the merged text, to detect entries made stale by earlier merges.
    len: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// A run of the input: `start..start + len`, linked to its neighbours (`usize::MAX`: none).
#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

const NONE: usize = usize::MAX;

impl SpmBpe {
    /// `mergeable` are (text, id, score) of the tokens merges may produce; a later duplicate text
    /// replaces an earlier one (llama.cpp's token map does the same).
    pub(crate) fn new(
        mergeable: impl IntoIterator<Item = (String, u32, f32)>,
        byte_ids: [Option<u32>; 256],
        unknown_id: Option<u32>,
    ) -> SpmBpe {
        let by_text = mergeable
            .into_iter()
            .map(|(text, id, score)| (text, (id, score)))
            .collect();
        SpmBpe {
            by_text,
            byte_ids,
            unknown_id,
        }
    }

    /// Append the ids of `text` (whitespace already escaped) to `out`.
    pub(crate) fn encode(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (start, ch) in text.char_indices() {
            let i = symbols.len();
            symbols.push(Symbol {
                start,
                len: ch.len_utf8(),
                prev: if i == 0 { NONE } else { i - 1 },
                next: i + 1,
            });
        }
        let Some(last) = symbols.last_mut() else {
            return Ok(());
        };
        last.next = NONE;

        let mut queue = BinaryHeap::with_capacity(symbols.len());
        for i in 1..symbols.len() {
            self.push_bigram(text, &symbols, i - 1, i, &mut queue);
        }
        while let Some(bigram) = queue.pop() {
            let (left, right) = (symbols[bigram.left], symbols[bigram.right]);
            // Skip pairs one of whose symbols has merged since the entry was pushed.
            if left.len == 0 || right.len == 0 || left.len + right.len != bigram.len {
                continue;
            }
            symbols[bigram.left].len += right.len;
            symbols[bigram.right].len = 0;
            symbols[bigram.left].next = right.next;
            if right.next != NONE {
                symbols[right.next].prev = bigram.left;
            }
            if left.prev != NONE {
                self.push_bigram(text, &symbols, left.prev, bigram.left, &mut queue);
            }
            if right.next != NONE {
                self.push_bigram(text, &symbols, bigram.left, right.next, &mut queue);
            }
        }

        let mut i = 0;
        while i != NONE {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match self.by_text.get(piece) {
                Some(&(id, _)) => out.push(id),
                None => self.byte_fallback(piece.as_bytes(), out)?,
            }
            i = s.next;
        }
        Ok(())
    }

    fn byte_fallback(&self, bytes: &[u8], out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        for &b in bytes {
            let id = self.byte_ids[b as usize]
                .or(self.unknown_id)
                .ok_or(TokenizerError::UnencodableByte(b))?;
            out.push(id);
        }
        Ok(())
    }

    fn push_bigram(
        &self,
        text: &str,
        symbols: &[Symbol],
        left: usize,
        right: usize,
        queue: &mut BinaryHeap<Bigram>,
    ) {
        let (l, r) = (symbols[left], symbols[right]);
        let len = l.len + r.len;
        if let Some(&(_, score)) = self.by_text.get(&text[l.start..l.start + len]) {
            queue.push(Bigram {
                score,
                left,
                right,
                len,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// a b c, "ab" (score -2), "bc" (score -1), "abc" (-3); byte tokens for 0x00..=0xFF at 100+.
    fn toy() -> SpmBpe {
        let mut byte_ids = [None; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = Some(100 + b as u32);
        }
        SpmBpe::new(
            [
                ("a".into(), 0, -10.0),
                ("b".into(), 1, -10.0),
                ("c".into(), 2, -10.0),
                ("ab".into(), 3, -2.0),
                ("bc".into(), 4, -1.0),
                ("abc".into(), 5, -3.0),
                ("▁".into(), 6, -5.0),
            ],
            byte_ids,
            None,
        )
    }

    #[test]
    fn highest_score_merges_first() {
        let t = toy();
        let mut out = Vec::new();
        // "bc" (-1) beats "ab" (-2), then "a" + "bc" makes "abc".
        t.encode("abc", &mut out).unwrap();
        assert_eq!(out, vec![5]);
        out.clear();
        t.encode("cab", &mut out).unwrap();
        assert_eq!(out, vec![2, 3]);
        out.clear();
        t.encode("abab", &mut out).unwrap();
        assert_eq!(out, vec![3, 3]);
    }

    #[test]
    fn unknown_characters_fall_back_to_bytes() {
        let t = toy();
        let mut out = Vec::new();
        t.encode("aé▁", &mut out).unwrap();
        assert_eq!(out, vec![0, 100 + 0xC3, 100 + 0xA9, 6]);
        let no_bytes = SpmBpe::new([("a".into(), 0, 0.0)], [None; 256], None);
        assert!(matches!(
            no_bytes.encode("ab", &mut Vec::new()),
            Err(TokenizerError::UnencodableByte(b'b'))
        ));
    }
}
