//! Reading the `tokenizer.*` keys of a GGUF file into [`TokenizerParts`].

use mirage_gguf::{GgufFile, Metadata, Value};

use crate::{
    PreTokenizerKind, TokenType, Tokenizer, TokenizerError, TokenizerModel, TokenizerParts,
};

/// The tokenizer-related metadata of one GGUF file.
pub(crate) struct TokenizerMetadata {
    pub(crate) model: String,
    pub(crate) pre: Option<String>,
    pub(crate) tokens: Vec<String>,
    pub(crate) token_types: Vec<TokenType>,
    pub(crate) merges: Vec<String>,
    pub(crate) scores: Vec<f32>,
    pub(crate) bos_id: Option<u32>,
    pub(crate) eos_id: Option<u32>,
    pub(crate) eot_id: Option<u32>,
    pub(crate) padding_id: Option<u32>,
    pub(crate) unknown_id: Option<u32>,
    pub(crate) add_bos: Option<bool>,
    pub(crate) add_eos: Option<bool>,
    pub(crate) add_space_prefix: Option<bool>,
    pub(crate) remove_extra_whitespaces: Option<bool>,
    pub(crate) precompiled_charsmap: Vec<u8>,
    pub(crate) chat_template: Option<String>,
}

fn token_id(meta: &Metadata, key: &'static str) -> Result<Option<u32>, TokenizerError> {
    match meta.get(key) {
        None => Ok(None),
        Some(v) => {
            // llama.cpp writes -1 (as a signed value) for "no such token".
            if v.as_i64().is_some_and(|x| x < 0) {
                return Ok(None);
            }
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| TokenizerError::BadMetadata {
                    key,
                    reason: format!("expected a token id, found {:?}", v.value_type()),
                })
        }
    }
}

fn flag(meta: &Metadata, key: &'static str) -> Result<Option<bool>, TokenizerError> {
    match meta.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| TokenizerError::BadMetadata {
                key,
                reason: format!("expected a bool, found {:?}", v.value_type()),
            }),
    }
}

fn string_array(meta: &Metadata, key: &'static str) -> Result<Option<Vec<String>>, TokenizerError> {
    if !meta.contains_key(key) {
        return Ok(None);
    }
    meta.get_str_array(key)
        .map(|v| Some(v.into_iter().map(str::to_owned).collect()))
        .ok_or_else(|| TokenizerError::BadMetadata {
            key,
            reason: "expected an array of strings".into(),
        })
}

fn byte_array(meta: &Metadata, key: &'static str) -> Result<Vec<u8>, TokenizerError> {
    let Some(v) = meta.get(key) else {
        return Ok(Vec::new());
    };
    let bad = || TokenizerError::BadMetadata {
        key,
        reason: "expected an array of bytes".into(),
    };
    v.as_array()
        .ok_or_else(bad)?
        .values
        .iter()
        .map(|x| match x {
            Value::U8(b) => Ok(*b),
            Value::I8(b) => Ok(*b as u8),
            _ => Err(bad()),
        })
        .collect()
}

impl TokenizerMetadata {
    pub(crate) fn read(file: &GgufFile) -> Result<TokenizerMetadata, TokenizerError> {
        let meta = file.metadata();
        let model = meta
            .get_str("tokenizer.ggml.model")
            .ok_or(TokenizerError::MissingKey("tokenizer.ggml.model"))?
            .to_owned();
        let tokens = string_array(meta, "tokenizer.ggml.tokens")?
            .ok_or(TokenizerError::MissingKey("tokenizer.ggml.tokens"))?;
        let token_types = if meta.contains_key("tokenizer.ggml.token_type") {
            meta.get_i32_array("tokenizer.ggml.token_type")
                .ok_or_else(|| TokenizerError::BadMetadata {
                    key: "tokenizer.ggml.token_type",
                    reason: "expected an array of integers".into(),
                })?
                .into_iter()
                .map(TokenType::from_code)
                .collect()
        } else {
            Vec::new()
        };
        Ok(TokenizerMetadata {
            model,
            pre: meta.get_str("tokenizer.ggml.pre").map(str::to_owned),
            tokens,
            token_types,
            merges: string_array(meta, "tokenizer.ggml.merges")?.unwrap_or_default(),
            scores: match meta.get("tokenizer.ggml.scores") {
                None => Vec::new(),
                Some(_) => meta.get_f32_array("tokenizer.ggml.scores").ok_or_else(|| {
                    TokenizerError::BadMetadata {
                        key: "tokenizer.ggml.scores",
                        reason: "expected an array of floats".into(),
                    }
                })?,
            },
            bos_id: token_id(meta, "tokenizer.ggml.bos_token_id")?,
            eos_id: token_id(meta, "tokenizer.ggml.eos_token_id")?,
            eot_id: token_id(meta, "tokenizer.ggml.eot_token_id")?,
            padding_id: token_id(meta, "tokenizer.ggml.padding_token_id")?,
            unknown_id: token_id(meta, "tokenizer.ggml.unknown_token_id")?,
            add_bos: flag(meta, "tokenizer.ggml.add_bos_token")?,
            add_eos: flag(meta, "tokenizer.ggml.add_eos_token")?,
            add_space_prefix: flag(meta, "tokenizer.ggml.add_space_prefix")?,
            remove_extra_whitespaces: flag(meta, "tokenizer.ggml.remove_extra_whitespaces")?,
            precompiled_charsmap: byte_array(meta, "tokenizer.ggml.precompiled_charsmap")?,
            chat_template: meta.get_str("tokenizer.chat_template").map(str::to_owned),
        })
    }
}

impl Tokenizer {
    /// Build the tokenizer a GGUF file describes: `tokenizer.ggml.model` `gpt2` (byte-level BPE),
    /// `llama` (SentencePiece BPE) or `t5` (SentencePiece Unigram). Absent keys take llama.cpp's
    /// defaults for that model.
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer, TokenizerError> {
        let meta = TokenizerMetadata::read(file)?;
        let parts = match meta.model.as_str() {
            "gpt2" => byte_level_parts(meta)?,
            "llama" => sentencepiece_parts(meta, false),
            "t5" => sentencepiece_parts(meta, true),
            _ => return Err(TokenizerError::UnsupportedModel(meta.model)),
        };
        Tokenizer::from_parts(parts)
    }
}

fn byte_level_parts(meta: TokenizerMetadata) -> Result<TokenizerParts, TokenizerError> {
    let pre_tokenizer = match meta.pre.as_deref() {
        None => PreTokenizerKind::Gpt2,
        Some(name) => {
            PreTokenizerKind::from_gguf_name(name).ok_or_else(|| TokenizerError::BadMetadata {
                key: "tokenizer.ggml.pre",
                reason: format!("unsupported pre-tokenizer `{name}`"),
            })?
        }
    };
    Ok(TokenizerParts {
        tokens: meta.tokens,
        token_types: meta.token_types,
        scores: Vec::new(),
        model: TokenizerModel::ByteLevelBpe {
            merges: meta.merges,
            pre_tokenizer,
        },
        bos_id: meta.bos_id,
        eos_id: meta.eos_id,
        eot_id: meta.eot_id,
        padding_id: meta.padding_id,
        unknown_id: meta.unknown_id,
        // Without the key, llama.cpp adds BOS for BPE vocabularies only where the pre-tokenizer
        // says so (Llama 3); both shipped models carry the key explicitly.
        add_bos: meta
            .add_bos
            .unwrap_or(pre_tokenizer == PreTokenizerKind::Llama3),
        add_eos: meta.add_eos.unwrap_or(false),
    })
}

/// SentencePiece vocabularies: BPE (`llama`) or Unigram (`t5`). llama.cpp's defaults when a key
/// is absent: `llama` has BOS 1, EOS 2, unknown 0, adds BOS and a space prefix; `t5` has EOS 1,
/// unknown 2, padding 0, adds EOS and no BOS.
fn sentencepiece_parts(meta: TokenizerMetadata, unigram: bool) -> TokenizerParts {
    let n = meta.tokens.len() as u32;
    let default_id = |id: u32| (id < n).then_some(id);
    let model = if unigram {
        TokenizerModel::Unigram {
            add_space_prefix: meta.add_space_prefix.unwrap_or(false),
            remove_extra_whitespaces: meta.remove_extra_whitespaces.unwrap_or(false),
            precompiled_charsmap: meta.precompiled_charsmap,
        }
    } else {
        TokenizerModel::SentencePieceBpe {
            add_space_prefix: meta.add_space_prefix.unwrap_or(true),
        }
    };
    let (bos, eos, unknown, padding) = if unigram {
        (None, default_id(1), default_id(2), default_id(0))
    } else {
        (default_id(1), default_id(2), default_id(0), None)
    };
    TokenizerParts {
        tokens: meta.tokens,
        token_types: meta.token_types,
        scores: meta.scores,
        model,
        bos_id: meta.bos_id.or(bos),
        eos_id: meta.eos_id.or(eos),
        eot_id: meta.eot_id,
        padding_id: meta.padding_id.or(padding),
        unknown_id: meta.unknown_id.or(unknown),
        add_bos: meta.add_bos.unwrap_or(!unigram),
        add_eos: meta.add_eos.unwrap_or(unigram),
    }
}
