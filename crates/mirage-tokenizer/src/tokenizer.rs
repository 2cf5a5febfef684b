//! The public [`Tokenizer`]: vocabulary, special tokens, encode and decode.

use std::collections::HashMap;

use crate::bpe::Bpe;
use crate::byte_level::{byte_token_text, token_text_to_bytes};
use crate::pretokenize::{PreTokenizer, PreTokenizerKind};
use crate::special::{Segment, SpecialMatcher};
use crate::TokenizerError;

/// A token's type, as stored in `tokenizer.ggml.token_type` (llama.cpp's `llama_token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    /// An ordinary vocabulary entry, produced by BPE (1).
    Normal,
    /// The unknown token (2).
    Unknown,
    /// A control token such as `<|im_start|>`: matched in text only when special parsing is requested,
    /// dropped by `decode(.., skip_special = true)` (3).
    Control,
    /// A user-defined added token such as `<tool_call>`: always matched whole in text, stored as raw
    /// text rather than byte-level characters (4).
    UserDefined,
    /// A reserved, unused slot (5).
    Unused,
    /// A byte-fallback token `<0xNN>` (6).
    Byte,
}

impl TokenType {
    /// Convert the GGUF integer code; unknown codes are treated as [`TokenType::Normal`], as llama.cpp
    /// does for undefined types.
    pub fn from_code(code: i32) -> TokenType {
        match code {
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Normal,
        }
    }
}

/// Texts of control tokens that end a generation (end of turn / end of text) in common chat models,
/// in addition to the metadata's EOS / EOT / EOM ids. The same list llama.cpp uses for its EOG set.
const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "<|end_of_text|>",
    "<|return|>",
    "<|call|>",
];

/// Everything a tokenizer is built from, as plain vectors: what the GGUF keys hold, or what a test or
/// another model format provides.
#[derive(Debug, Clone)]
pub struct TokenizerParts {
    /// Token strings (byte-level encoded for normal tokens), indexed by id.
    pub tokens: Vec<String>,
    /// Token types, same length as `tokens`; empty means all normal.
    pub token_types: Vec<TokenType>,
    /// Merges in rank order, each `"left right"` over byte-level token strings.
    pub merges: Vec<String>,
    /// The pre-tokenizer.
    pub pre_tokenizer: PreTokenizerKind,
    /// Beginning-of-sequence token.
    pub bos_id: Option<u32>,
    /// End-of-sequence token.
    pub eos_id: Option<u32>,
    /// End-of-turn token, if distinct from EOS.
    pub eot_id: Option<u32>,
    /// Padding token.
    pub padding_id: Option<u32>,
    /// Unknown token.
    pub unknown_id: Option<u32>,
    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub add_bos: bool,
    /// Whether `encode(.., add_special = true, ..)` appends EOS.
    pub add_eos: bool,
}

/// A byte-level BPE tokenizer.
#[derive(Debug)]
pub struct Tokenizer {
    tokens: Vec<String>,
    token_types: Vec<TokenType>,
    /// Raw bytes of each token (byte-level decoded for BPE tokens, verbatim for control/user tokens).
    pieces: Vec<Vec<u8>>,
    bpe: Bpe,
    pre_tokenizer: PreTokenizer,
    specials: SpecialMatcher,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    padding_id: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    end_of_generation: Vec<u32>,
}

impl Tokenizer {
    /// Build a tokenizer from plain parts.
    pub fn from_parts(parts: TokenizerParts) -> Result<Tokenizer, TokenizerError> {
        let n = parts.tokens.len();
        if n == 0 {
            return Err(TokenizerError::InvalidConfig("empty vocabulary".into()));
        }
        if u32::try_from(n).is_err() {
            return Err(TokenizerError::InvalidConfig(format!(
                "vocabulary of {n} tokens exceeds u32"
            )));
        }
        let token_types = if parts.token_types.is_empty() {
            vec![TokenType::Normal; n]
        } else if parts.token_types.len() == n {
            parts.token_types
        } else {
            return Err(TokenizerError::InvalidConfig(format!(
                "{} token types for {} tokens",
                parts.token_types.len(),
                n
            )));
        };
        for (name, id) in [
            ("bos", parts.bos_id),
            ("eos", parts.eos_id),
            ("eot", parts.eot_id),
            ("padding", parts.padding_id),
            ("unknown", parts.unknown_id),
        ] {
            if id.is_some_and(|id| id as usize >= n) {
                return Err(TokenizerError::InvalidConfig(format!(
                    "{name} token id {} outside vocabulary of {n}",
                    id.unwrap_or_default()
                )));
            }
        }

        let is_bpe_text =
            |t: TokenType| matches!(t, TokenType::Normal | TokenType::Unused | TokenType::Byte);
        let pieces: Vec<Vec<u8>> = parts
            .tokens
            .iter()
            .zip(&token_types)
            .map(|(text, &ty)| {
                if is_bpe_text(ty) {
                    token_text_to_bytes(text)
                } else {
                    text.as_bytes().to_vec()
                }
            })
            .collect();

        // Lookups by byte-level string; only BPE-produced tokens take part in merging.
        let mut by_text: HashMap<&str, u32> = HashMap::with_capacity(n);
        for (id, (text, &ty)) in parts.tokens.iter().zip(&token_types).enumerate() {
            if matches!(ty, TokenType::Normal | TokenType::Byte | TokenType::Unused) {
                by_text.entry(text.as_str()).or_insert(id as u32);
            }
        }
        let mut byte_ids = [None; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = by_text.get(byte_token_text(b as u8).as_str()).copied();
        }
        let mut merges = Vec::with_capacity(parts.merges.len());
        let mut merged_text = String::new();
        for (rank, line) in parts.merges.iter().enumerate() {
            let (left, right) = line.split_once(' ').ok_or_else(|| {
                TokenizerError::InvalidConfig(format!(
                    "merge {rank} `{line}` has no space separator"
                ))
            })?;
            merged_text.clear();
            merged_text.push_str(left);
            merged_text.push_str(right);
            // A merge whose parts or result are not in the vocabulary can never fire usefully; skip
            // it (llama.cpp and Hugging Face reject such vocabularies or ignore the merge).
            if let (Some(&l), Some(&r), Some(&m)) = (
                by_text.get(left),
                by_text.get(right),
                by_text.get(merged_text.as_str()),
            ) {
                merges.push((l, r, m));
            }
        }

        let specials = SpecialMatcher::new(
            parts
                .tokens
                .iter()
                .zip(&token_types)
                .enumerate()
                .filter(|(_, (_, &ty))| {
                    matches!(
                        ty,
                        TokenType::Control | TokenType::UserDefined | TokenType::Unknown
                    )
                })
                .map(|(id, (text, _))| (text.clone(), id as u32))
                .collect(),
        );

        let mut end_of_generation: Vec<u32> =
            [parts.eos_id, parts.eot_id].into_iter().flatten().collect();
        for (id, (text, &ty)) in parts.tokens.iter().zip(&token_types).enumerate() {
            if matches!(ty, TokenType::Control | TokenType::UserDefined)
                && END_OF_GENERATION_TEXTS.contains(&text.as_str())
            {
                end_of_generation.push(id as u32);
            }
        }
        end_of_generation.sort_unstable();
        end_of_generation.dedup();

        Ok(Tokenizer {
            bpe: Bpe::new(merges, byte_ids, parts.unknown_id),
            pre_tokenizer: PreTokenizer::new(parts.pre_tokenizer)?,
            tokens: parts.tokens,
            token_types,
            pieces,
            specials,
            bos_id: parts.bos_id,
            eos_id: parts.eos_id,
            padding_id: parts.padding_id,
            add_bos: parts.add_bos,
            add_eos: parts.add_eos,
            end_of_generation,
        })
    }

    /// Encode `text` to token ids.
    ///
    /// `add_special` adds BOS / EOS as the metadata's `add_bos_token` / `add_eos_token` say.
    /// With `parse_special`, control tokens written in the text (e.g. `<|im_start|>`) become their ids;
    /// without it they are tokenized as ordinary text. User-defined tokens are always matched whole.
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            if let Some(bos) = self.bos_id {
                ids.push(bos);
            }
        }
        let allow = |id: u32| match self.token_types[id as usize] {
            TokenType::UserDefined => true,
            _ => parse_special,
        };
        for segment in self.specials.split(text, allow) {
            match segment {
                Segment::Special(id) => ids.push(id),
                Segment::Text(t) => {
                    let bpe = &self.bpe;
                    let ids_ref = &mut ids;
                    self.pre_tokenizer
                        .split(t, &mut |piece| bpe.encode_piece(piece.as_bytes(), ids_ref))?;
                }
            }
        }
        if add_special && self.add_eos {
            if let Some(eos) = self.eos_id {
                ids.push(eos);
            }
        }
        Ok(ids)
    }

    /// Decode ids to text. Invalid UTF-8 (e.g. a multi-byte character cut in half) becomes U+FFFD.
    /// With `skip_special`, control tokens are left out.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let ty = *self
                .token_types
                .get(id as usize)
                .ok_or(TokenizerError::UnknownTokenId {
                    id,
                    vocab_size: self.tokens.len(),
                })?;
            if skip_special && ty == TokenType::Control {
                continue;
            }
            bytes.extend_from_slice(&self.pieces[id as usize]);
        }
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// The raw bytes a token stands for (empty for an id outside the vocabulary). Feed these to a
    /// [`crate::StreamDecoder`] when streaming, since one token may hold part of a UTF-8 character.
    pub fn token_to_piece(&self, id: u32) -> &[u8] {
        self.pieces.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// The token's vocabulary string (byte-level characters for BPE tokens), if the id exists.
    pub fn token_str(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The id of a vocabulary string, if present (linear scan: for setup code, not hot loops).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.tokens.iter().position(|t| t == text).map(|i| i as u32)
    }

    /// The token's type, if the id exists.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.token_types.get(id as usize).copied()
    }

    /// Beginning-of-sequence token.
    pub fn bos(&self) -> Option<u32> {
        self.bos_id
    }

    /// End-of-sequence token.
    pub fn eos(&self) -> Option<u32> {
        self.eos_id
    }

    /// Padding token.
    pub fn padding(&self) -> Option<u32> {
        self.padding_id
    }

    /// Whether `add_special` encoding prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `add_special` encoding appends EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Whether generating `id` ends the turn: EOS, EOT, or a control token such as `<|im_end|>` or
    /// `<|endoftext|>`.
    pub fn is_eog(&self, id: u32) -> bool {
        self.end_of_generation.binary_search(&id).is_ok()
    }

    /// All end-of-generation ids, sorted.
    pub fn eog_ids(&self) -> &[u32] {
        &self.end_of_generation
    }

    /// Empty the BPE piece cache (for timing cold encodes; encoding results never depend on it).
    pub fn clear_cache(&self) {
        self.bpe.clear_cache();
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toy() -> Tokenizer {
        let mut tokens: Vec<String> = (0..=255u8).map(byte_token_text).collect();
        tokens.push("he".into()); // 256
        tokens.push("ll".into()); // 257
        tokens.push("hell".into()); // 258
        tokens.push("hello".into()); // 259
        tokens.push("<|end|>".into()); // 260
        let mut token_types = vec![TokenType::Normal; tokens.len()];
        token_types[260] = TokenType::Control;
        Tokenizer::from_parts(TokenizerParts {
            tokens,
            token_types,
            merges: vec!["h e".into(), "l l".into(), "he ll".into(), "hell o".into()],
            pre_tokenizer: PreTokenizerKind::Gpt2,
            bos_id: Some(260),
            eos_id: Some(260),
            eot_id: None,
            padding_id: None,
            unknown_id: None,
            add_bos: true,
            add_eos: false,
        })
        .unwrap()
    }

    #[test]
    fn encode_decode_roundtrip_with_specials() {
        let t = toy();
        let ids = t.encode("hello<|end|>", true, true).unwrap();
        assert_eq!(ids, vec![260, 259, 260]);
        let plain = t.encode("hello<|end|>", false, false).unwrap();
        assert_eq!(plain[0], 259);
        assert!(plain.len() > 2 && !plain.contains(&260));
        assert_eq!(t.decode(&ids, false).unwrap(), "<|end|>hello<|end|>");
        assert_eq!(t.decode(&ids, true).unwrap(), "hello");
        assert!(t.is_eog(260));
        assert!(t.decode(&[9999], false).is_err());
        assert_eq!(t.token_to_piece(9999), b"");
    }
}
