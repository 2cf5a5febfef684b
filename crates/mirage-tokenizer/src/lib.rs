//! Tokenizer and chat templates from GGUF metadata.
#![deny(missing_docs)]
