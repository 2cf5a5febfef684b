//! The runtime: Backend trait, CPU backend, model graph, KV cache, sampling.
#![deny(missing_docs)]
