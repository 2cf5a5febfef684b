//! The public [`Tokenizer`]: vocabulary, special tokens, encode and decode.

use std::collections::HashMap;

use crate::bpe::Bpe;
use crate::byte_level::{byte_token_text, token_text_to_bytes};
use crate::charsmap::CharsMap;
use crate::pretokenize::{PreTokenizer, PreTokenizerKind};
use crate::special::{Segment, SpecialMatcher};
use crate::spm::SpmBpe;
use crate::unigram::{Unigram, UnigramOptions};
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

/// How a vocabulary turns text into ids (`tokenizer.ggml.model`).
#[derive(Debug, Clone, PartialEq)]
pub enum TokenizerModel {
    /// GPT-2 style byte-level BPE (`gpt2`): a regex pre-tokenizer, then merges by rank over
    /// byte-level token strings.
    ByteLevelBpe {
        /// Merges in rank order, each `"left right"` over byte-level token strings.
        merges: Vec<String>,
        /// The pre-tokenizer.
        pre_tokenizer: PreTokenizerKind,
    },
    /// SentencePiece BPE (`llama`: Llama 2, Mistral, Gemma): spaces become `▁`, merges by token
    /// score, characters outside the vocabulary fall back to `<0xNN>` byte tokens.
    SentencePieceBpe {
        /// Prepend a space to text that starts the input or follows a special token.
        add_space_prefix: bool,
    },
    /// SentencePiece Unigram (`t5`): the segmentation with the highest total score after the
    /// vocabulary's normalization.
    Unigram {
        /// Prepend `▁` to each run of text (SentencePiece `add_dummy_prefix`).
        add_space_prefix: bool,
        /// Trim whitespace at the ends and collapse inner runs.
        remove_extra_whitespaces: bool,
        /// SentencePiece's precompiled normalization map (may be empty).
        precompiled_charsmap: Vec<u8>,
    },
}

/// Everything a tokenizer is built from, as plain vectors: what the GGUF keys hold, or what a test or
/// another model format provides.
#[derive(Debug, Clone)]
pub struct TokenizerParts {
    /// Token strings (byte-level encoded for GPT-2 BPE tokens, `▁` for spaces in SentencePiece
    /// vocabularies), indexed by id.
    pub tokens: Vec<String>,
    /// Token types, same length as `tokens`; empty means all normal.
    pub token_types: Vec<TokenType>,
    /// Token scores, same length as `tokens` (SentencePiece vocabularies; empty for byte-level BPE).
    pub scores: Vec<f32>,
    /// The segmentation algorithm and its settings.
    pub model: TokenizerModel,
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

/// The segmentation state of a [`Tokenizer`].
#[derive(Debug)]
enum Encoder {
    ByteLevel {
        bpe: Bpe,
        pre_tokenizer: PreTokenizer,
    },
    SentencePiece {
        bpe: SpmBpe,
        add_space_prefix: bool,
    },
    Unigram(Unigram),
}

/// A tokenizer: byte-level BPE, SentencePiece BPE or Unigram, with special tokens.
#[derive(Debug)]
pub struct Tokenizer {
    tokens: Vec<String>,
    token_types: Vec<TokenType>,
    /// Raw bytes of each token (byte-level decoded for BPE tokens, `▁` as space and `<0xNN>` as
    /// its byte for SentencePiece tokens, verbatim for control/user tokens).
    pieces: Vec<Vec<u8>>,
    encoder: Encoder,
    /// Decoding drops one leading space of the first normal token (SentencePiece's dummy prefix).
    strip_space_prefix: bool,
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
    pub fn from_parts(mut parts: TokenizerParts) -> Result<Tokenizer, TokenizerError> {
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
            std::mem::take(&mut parts.token_types)
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

        if !parts.scores.is_empty() && parts.scores.len() != n {
            return Err(TokenizerError::InvalidConfig(format!(
                "{} scores for {} tokens",
                parts.scores.len(),
                n
            )));
        }
        let (pieces, encoder, strip_space_prefix) = match &parts.model {
            TokenizerModel::ByteLevelBpe {
                merges,
                pre_tokenizer,
            } => {
                let (pieces, encoder) =
                    byte_level_encoder(&parts, &token_types, merges, *pre_tokenizer)?;
                (pieces, encoder, false)
            }
            TokenizerModel::SentencePieceBpe { add_space_prefix } => {
                let encoder = Encoder::SentencePiece {
                    bpe: SpmBpe::new(
                        mergeable(&parts, &token_types),
                        sentencepiece_byte_ids(&parts.tokens, &token_types),
                        parts.unknown_id,
                    ),
                    add_space_prefix: *add_space_prefix,
                };
                (
                    sentencepiece_pieces(&parts.tokens, &token_types),
                    encoder,
                    *add_space_prefix,
                )
            }
            TokenizerModel::Unigram {
                add_space_prefix,
                remove_extra_whitespaces,
                precompiled_charsmap,
            } => {
                let unknown_id = parts.unknown_id.ok_or_else(|| {
                    TokenizerError::InvalidConfig(
                        "a Unigram vocabulary needs an unknown token".into(),
                    )
                })?;
                let normal_scores = token_types
                    .iter()
                    .zip(scores_or_zero(&parts.scores, n))
                    .filter(|(&ty, _)| ty == TokenType::Normal)
                    .map(|(_, s)| s);
                let candidates =
                    mergeable(&parts, &token_types)
                        .into_iter()
                        .map(|(text, id, score)| {
                            let user = token_types[id as usize] == TokenType::UserDefined;
                            (text, id, score, user)
                        });
                let unigram = Unigram::new(
                    candidates,
                    normal_scores,
                    unknown_id,
                    CharsMap::parse(precompiled_charsmap)?,
                    UnigramOptions {
                        add_space_prefix: *add_space_prefix,
                        remove_extra_whitespaces: *remove_extra_whitespaces,
                    },
                );
                (
                    sentencepiece_pieces(&parts.tokens, &token_types),
                    Encoder::Unigram(unigram),
                    *add_space_prefix,
                )
            }
        };

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
            encoder,
            strip_space_prefix,
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
        // SentencePiece BPE prefixes a space to text at the start or right after a special token.
        let mut after_special = true;
        let mut escaped = String::new();
        for segment in self.specials.split(text, allow) {
            match segment {
                Segment::Special(id) => {
                    ids.push(id);
                    after_special = true;
                }
                Segment::Text(t) => {
                    match &self.encoder {
                        Encoder::ByteLevel { bpe, pre_tokenizer } => {
                            let ids_ref = &mut ids;
                            pre_tokenizer.split(t, &mut |piece| {
                                bpe.encode_piece(piece.as_bytes(), ids_ref)
                            })?;
                        }
                        Encoder::SentencePiece {
                            bpe,
                            add_space_prefix,
                        } => {
                            escaped.clear();
                            if *add_space_prefix && after_special {
                                escaped.push(SPACE_MARK);
                            }
                            escaped
                                .extend(t.chars().map(|c| if c == ' ' { SPACE_MARK } else { c }));
                            bpe.encode(&escaped, &mut ids)?;
                        }
                        Encoder::Unigram(unigram) => unigram.encode(t, &mut ids)?,
                    }
                    after_special = false;
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
    /// With `skip_special`, control and unknown tokens are left out. A SentencePiece vocabulary
    /// that adds a space prefix loses it again: the first normal token's leading space is dropped.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        let mut strip_space = self.strip_space_prefix;
        for &id in ids {
            let ty = *self
                .token_types
                .get(id as usize)
                .ok_or(TokenizerError::UnknownTokenId {
                    id,
                    vocab_size: self.tokens.len(),
                })?;
            if skip_special && matches!(ty, TokenType::Control | TokenType::Unknown) {
                continue;
            }
            let mut piece = &self.pieces[id as usize][..];
            if strip_space && ty != TokenType::Control {
                // SentencePiece's dummy prefix: the space the encoder added before the first word
                // (a piece that was only that space leaves the next one to lose its own).
                if ty == TokenType::Normal {
                    piece = piece.strip_prefix(b" ").unwrap_or(piece);
                }
                strip_space = piece.is_empty();
            }
            bytes.extend_from_slice(piece);
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
        if let Encoder::ByteLevel { bpe, .. } = &self.encoder {
            bpe.clear_cache();
        }
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }
}

/// SentencePiece's visible space, `▁` (U+2581).
const SPACE_MARK: char = '\u{2581}';

fn scores_or_zero(scores: &[f32], n: usize) -> impl Iterator<Item = f32> + '_ {
    (0..n).map(move |i| scores.get(i).copied().unwrap_or(0.0))
}

/// (text, id, score) of the tokens SentencePiece segmentation may produce: normal, user-defined and
/// unused ones (control, unknown and byte tokens only enter as specials or byte fallback).
fn mergeable(parts: &TokenizerParts, token_types: &[TokenType]) -> Vec<(String, u32, f32)> {
    parts
        .tokens
        .iter()
        .zip(token_types)
        .zip(scores_or_zero(&parts.scores, parts.tokens.len()))
        .enumerate()
        .filter(|(_, ((_, &ty), _))| {
            matches!(
                ty,
                TokenType::Normal | TokenType::UserDefined | TokenType::Unused
            )
        })
        .map(|(id, ((text, _), score))| (text.clone(), id as u32, score))
        .collect()
}

/// The byte a SentencePiece byte token `<0xNN>` stands for.
fn byte_token_value(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

fn sentencepiece_byte_ids(tokens: &[String], token_types: &[TokenType]) -> [Option<u32>; 256] {
    let mut ids = [None; 256];
    for (id, (text, &ty)) in tokens.iter().zip(token_types).enumerate() {
        if ty == TokenType::Byte {
            if let Some(b) = byte_token_value(text) {
                ids[b as usize].get_or_insert(id as u32);
            }
        }
    }
    ids
}

/// What each SentencePiece token decodes to: `▁` as a space for normal tokens, the byte for
/// `<0xNN>` tokens, the text itself for control and user-defined ones.
fn sentencepiece_pieces(tokens: &[String], token_types: &[TokenType]) -> Vec<Vec<u8>> {
    tokens
        .iter()
        .zip(token_types)
        .map(|(text, &ty)| match ty {
            TokenType::Normal | TokenType::Unused => text.replace(SPACE_MARK, " ").into_bytes(),
            TokenType::Byte => match byte_token_value(text) {
                Some(b) => vec![b],
                None => text.as_bytes().to_vec(),
            },
            _ => text.as_bytes().to_vec(),
        })
        .collect()
}

/// Pieces and encoder of a GPT-2 byte-level BPE vocabulary.
fn byte_level_encoder(
    parts: &TokenizerParts,
    token_types: &[TokenType],
    merge_lines: &[String],
    pre_tokenizer: PreTokenizerKind,
) -> Result<(Vec<Vec<u8>>, Encoder), TokenizerError> {
    let is_bpe_text =
        |t: TokenType| matches!(t, TokenType::Normal | TokenType::Unused | TokenType::Byte);
    let pieces: Vec<Vec<u8>> = parts
        .tokens
        .iter()
        .zip(token_types)
        .map(|(text, &ty)| {
            if is_bpe_text(ty) {
                token_text_to_bytes(text)
            } else {
                text.as_bytes().to_vec()
            }
        })
        .collect();

    // Lookups by byte-level string; only BPE-produced tokens take part in merging.
    let mut by_text: HashMap<&str, u32> = HashMap::with_capacity(parts.tokens.len());
    for (id, (text, &ty)) in parts.tokens.iter().zip(token_types).enumerate() {
        if is_bpe_text(ty) {
            by_text.entry(text.as_str()).or_insert(id as u32);
        }
    }
    let mut byte_ids = [None; 256];
    for (b, slot) in byte_ids.iter_mut().enumerate() {
        *slot = by_text.get(byte_token_text(b as u8).as_str()).copied();
    }
    let mut merges = Vec::with_capacity(merge_lines.len());
    let mut merged_text = String::new();
    for (rank, line) in merge_lines.iter().enumerate() {
        let (left, right) = line.split_once(' ').ok_or_else(|| {
            TokenizerError::InvalidConfig(format!("merge {rank} `{line}` has no space separator"))
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
    let encoder = Encoder::ByteLevel {
        bpe: Bpe::new(merges, byte_ids, parts.unknown_id),
        pre_tokenizer: PreTokenizer::new(pre_tokenizer)?,
    };
    Ok((pieces, encoder))
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
            scores: Vec::new(),
            model: TokenizerModel::ByteLevelBpe {
                merges: vec!["h e".into(), "l l".into(), "he ll".into(), "hell o".into()],
                pre_tokenizer: PreTokenizerKind::Gpt2,
            },
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
