//! The one error type of the facade.

use crate::LoadError;

/// Anything that can go wrong through the facade: loading, running,
/// tokenizing or compiling a grammar. Each variant keeps the layer's own
/// typed error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The model, artifact or backend could not be loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// A forward pass, session or generation failed.
    #[error(transparent)]
    Runtime(#[from] mirage_runtime::RuntimeError),
    /// Text could not be tokenized or a chat template rendered.
    #[error(transparent)]
    Tokenizer(#[from] mirage_tokenizer::TokenizerError),
    /// A grammar or JSON schema could not be compiled.
    #[error(transparent)]
    Grammar(#[from] mirage_grammar::GrammarError),
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
