//! Grammar-constrained decoding: a JSON schema, a GBNF grammar (llama.cpp's
//! format), a Lark grammar or a regular expression compiled against a
//! model's vocabulary into a [`Grammar`], which the runtime's sampler asks
//! for a token mask before every sample (`mirage_runtime::Constraint`).
//!
//! The engine underneath is llguidance (the one llama.cpp links for the
//! same job): an Earley parser over a derivative-based lexer that walks
//! the vocabulary as a byte trie, so a mask over 151,936 tokens costs tens
//! to hundreds of microseconds. GBNF is converted to its Lark syntax by
//! [`gbnf_to_lark`].
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use mirage_runtime::{Engine, EngineOptions, GenerateParams};
//! use mirage_grammar::{GrammarCompiler, GrammarSpec};
//! let engine = Engine::load("models/smollm2-135m-instruct-q4_1.gguf", EngineOptions::default())?;
//! let grammars = GrammarCompiler::new(engine.tokenizer(), engine.model().config().vocab_size)?;
//! let schema = serde_json::json!({"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]});
//! let params = GenerateParams {
//!     constraint: Some(grammars.compile(&GrammarSpec::JsonSchema(schema))?),
//!     ..Default::default()
//! };
//! let out = engine.session()?.generate("Alice is 30. As JSON:", &params, |_| true)?;
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

pub mod gbnf;
pub mod tools;

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{JsonCompileOptions, Matcher, ParserFactory, TokenParser};
use mirage_runtime::{Constraint, ConstraintError, ConstraintState, TokenMask};
use mirage_tokenizer::{TokenType, Tokenizer};
use toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};

pub use gbnf::{gbnf_to_lark, GbnfError};
pub use tools::{
    parse_tool_calls, tool_call_grammar, ToolCall, ToolCallStream, ToolChoice, ToolStreamEvent,
};

/// A grammar source.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// A JSON schema (draft 2020-12 subset llguidance supports); output is
    /// compact JSON (`", "` and `": "` separators, no other whitespace).
    JsonSchema(serde_json::Value),
    /// Any JSON object (OpenAI's `json_object` response format).
    JsonObject,
    /// A GBNF grammar (llama.cpp's format), start rule `root`.
    Gbnf(String),
    /// A grammar in llguidance's Lark syntax, start rule `start`.
    Lark(String),
    /// A regular expression (Rust `regex` syntax) the whole output matches.
    Regex(String),
}

/// Why a grammar could not be built.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    /// The GBNF text is malformed.
    #[error(transparent)]
    Gbnf(#[from] GbnfError),
    /// The grammar or schema is refused by the compiler (unsupported
    /// feature, unsatisfiable schema, bad Lark syntax, ...).
    #[error("grammar: {0}")]
    Invalid(String),
    /// The tokenizer has no end-of-generation token to end a grammar with.
    #[error("the tokenizer has no end-of-sequence token")]
    NoEos,
}

/// Compiles grammars against one vocabulary (build once per model; it is
/// `Send + Sync` and compiling is `&self`).
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
    ends: Arc<Ends>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab", &self.ends.vocab)
            .finish()
    }
}

/// How a generation may end, and how long the logits are.
#[derive(Debug)]
struct Ends {
    /// The token llguidance allows where the grammar may end.
    eos: u32,
    /// Every end-of-generation token: each is allowed where `eos` is.
    eog: Vec<u32>,
    /// Logit rows (may exceed the tokenizer's vocabulary).
    vocab: usize,
}

impl GrammarCompiler {
    /// Indexes `tokenizer`'s vocabulary for masks over `logits_vocab`
    /// tokens (the lm head's rows; ids past the tokenizer's vocabulary are
    /// never allowed). Control tokens (`<|im_end|>`, ...) are entered so
    /// that no grammar text can match them; end-of-generation tokens are
    /// allowed exactly where the grammar can end.
    pub fn new(
        tokenizer: &Tokenizer,
        logits_vocab: usize,
    ) -> Result<GrammarCompiler, GrammarError> {
        let n = tokenizer.vocab_size();
        let eos = tokenizer
            .eos()
            .filter(|&e| tokenizer.is_eog(e))
            .or_else(|| tokenizer.eog_ids().first().copied())
            .ok_or(GrammarError::NoEos)?;
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| match tokenizer.token_type(id) {
                Some(TokenType::Normal | TokenType::UserDefined | TokenType::Byte)
                    if !tokenizer.is_eog(id) =>
                {
                    tokenizer.token_to_piece(id).to_vec()
                }
                // Special: llguidance's marker byte first, so no text matches.
                _ => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tokenizer.token_str(id).unwrap_or("").as_bytes());
                    w
                }
            })
            .collect();
        let info = TokRxInfo {
            tok_bos: tokenizer.bos(),
            tok_pad: tokenizer.padding(),
            ..TokRxInfo::new(n as u32, eos)
        };
        let trie = TokTrie::from(&info, &words);
        let env: toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Invalid(e.to_string()))?;
        factory.quiet();
        Ok(GrammarCompiler {
            factory: Arc::new(factory),
            ends: Arc::new(Ends {
                eos,
                eog: tokenizer.eog_ids().to_vec(),
                vocab: logits_vocab.max(n),
            }),
        })
    }

    /// Compiles `spec`; errors name what is wrong with it.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Arc<Grammar>, GrammarError> {
        let top = match spec {
            GrammarSpec::JsonSchema(schema) => {
                let mut schema = schema.clone();
                if schema.get("x-guidance").is_none() {
                    if let Some(obj) = schema.as_object_mut() {
                        let opts = JsonCompileOptions {
                            item_separator: ", ".into(),
                            key_separator: ": ".into(),
                            whitespace_flexible: false,
                            ..Default::default()
                        };
                        obj.insert(
                            "x-guidance".into(),
                            serde_json::to_value(&opts)
                                .map_err(|e| GrammarError::Invalid(e.to_string()))?,
                        );
                    }
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            GrammarSpec::JsonObject => {
                return self.compile(&GrammarSpec::JsonSchema(
                    serde_json::json!({"type": "object"}),
                ))
            }
            GrammarSpec::Gbnf(src) => TopLevelGrammar::from_lark(gbnf_to_lark(src)?),
            GrammarSpec::Lark(src) => TopLevelGrammar::from_lark(src.clone()),
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
        };
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| GrammarError::Invalid(e.to_string()))?;
        Ok(Arc::new(Grammar {
            parser,
            ends: self.ends.clone(),
        }))
    }
}

/// A compiled grammar: starts one matcher per generation
/// (`mirage_runtime::Constraint`).
pub struct Grammar {
    parser: TokenParser,
    ends: Arc<Ends>,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar").finish_non_exhaustive()
    }
}

impl Grammar {
    /// A matcher at the start of the grammar.
    pub fn matcher(&self) -> GrammarMatcher {
        GrammarMatcher {
            matcher: Matcher::new(Ok(self.parser.deep_clone())),
            ends: self.ends.clone(),
        }
    }
}

impl Constraint for Grammar {
    fn start(&self) -> Result<Box<dyn ConstraintState>, ConstraintError> {
        let m = self.matcher();
        if let Some(e) = m.matcher.get_error() {
            return Err(ConstraintError(e));
        }
        Ok(Box::new(m))
    }
}

/// One generation's place in a [`Grammar`].
pub struct GrammarMatcher {
    matcher: Matcher,
    ends: Arc<Ends>,
}

impl GrammarMatcher {
    /// Whether the text so far is a complete match (end of generation is
    /// allowed now).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

impl ConstraintState for GrammarMatcher {
    fn fill_mask(&mut self, mask: &mut TokenMask) -> Result<(), ConstraintError> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| ConstraintError(e.to_string()))?;
        let src = allowed.as_slice();
        let dst = mask.words_mut();
        let n = src.len().min(dst.len());
        dst[..n].copy_from_slice(&src[..n]);
        // The trie covers the tokenizer's ids only; its last word may hold
        // bits past them, which must stay clear.
        let ends = &self.ends;
        let trie_len = allowed.len().min(ends.vocab);
        for id in trie_len..(n * 32).min(ends.vocab) {
            mask.forbid(id as u32);
        }
        if allowed.is_allowed(ends.eos) {
            for &t in &ends.eog {
                mask.allow(t);
            }
        }
        Ok(())
    }

    fn accept(&mut self, token: u32) -> Result<(), ConstraintError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| ConstraintError(e.to_string()))
    }
}
