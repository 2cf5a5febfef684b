//! Perplexity exactly as llama.cpp's `llama-perplexity` computes it.
//!
//! The token stream is cut into non-overlapping windows of `n_ctx` tokens;
//! each window runs from an empty cache with its first token replaced by
//! BOS when the model adds one; only the second half of each window is
//! scored (`first = n_ctx / 2`: every scored token sees at least `n_ctx/2`
//! tokens of context). The ± is llama.cpp's: the standard error of the mean
//! negative log-likelihood, times the perplexity.

use crate::backend::Backend;
use crate::engine::Engine;
use crate::error::{Result, RuntimeError};

/// Result of [`perplexity`].
#[derive(Debug, Clone, PartialEq)]
pub struct PerplexityReport {
    /// `exp(mean NLL)`.
    pub ppl: f64,
    /// llama.cpp's uncertainty estimate of `ppl`.
    pub ppl_err: f64,
    /// Mean negative log-likelihood (nats per token).
    pub mean_nll: f64,
    /// Windows evaluated.
    pub n_chunks: usize,
    /// Tokens scored.
    pub n_scored: usize,
    /// Tokens in the whole text.
    pub n_tokens: usize,
    /// Window length.
    pub n_ctx: usize,
    /// Perplexity of each window alone.
    pub chunk_ppl: Vec<f64>,
}

/// Log-softmax probability of `target` under `logits` (computed in f64).
pub fn log_prob(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    logits[target as usize] as f64 - max - sum.ln()
}

/// Perplexity of `text` with windows of `n_ctx` tokens; `max_chunks` caps
/// the windows (0: all). `on_chunk(i, n_chunks, running_ppl)` is called
/// after each window.
pub fn perplexity<B: Backend>(
    engine: &Engine<B>,
    text: &str,
    n_ctx: usize,
    max_chunks: usize,
    mut on_chunk: impl FnMut(usize, usize, f64),
) -> Result<PerplexityReport> {
    if n_ctx < 4 {
        return Err(RuntimeError::InvalidArgument(format!(
            "context {n_ctx} is too short"
        )));
    }
    let tok = engine.tokenizer();
    let add_bos = tok.add_bos();
    let tokens = engine.encode(text, add_bos)?;
    let mut n_chunks = tokens.len() / n_ctx;
    if max_chunks > 0 {
        n_chunks = n_chunks.min(max_chunks);
    }
    if n_chunks == 0 {
        return Err(RuntimeError::InvalidArgument(format!(
            "the text has {} tokens, fewer than one window of {n_ctx}",
            tokens.len()
        )));
    }
    let first = n_ctx / 2;
    let (mut nll, mut nll2, mut count) = (0.0f64, 0.0f64, 0usize);
    let mut chunk_ppl = Vec::with_capacity(n_chunks);
    let mut window = Vec::with_capacity(n_ctx);
    for i in 0..n_chunks {
        let start = i * n_ctx;
        window.clear();
        window.extend_from_slice(&tokens[start..start + n_ctx]);
        if add_bos {
            if let Some(bos) = tok.bos() {
                window[0] = bos;
            }
        }
        let logits = engine.logits_for(&window)?;
        let vocab = logits.len() / n_ctx;
        let mut chunk_nll = 0.0;
        for j in first..n_ctx - 1 {
            // Targets come from the original stream (the BOS swap only
            // touches position 0, which is never a target).
            let v = -log_prob(&logits[j * vocab..(j + 1) * vocab], tokens[start + j + 1]);
            nll += v;
            nll2 += v * v;
            chunk_nll += v;
            count += 1;
        }
        chunk_ppl.push((chunk_nll / (n_ctx - 1 - first) as f64).exp());
        on_chunk(i, n_chunks, (nll / count as f64).exp());
    }
    let mean = nll / count as f64;
    let ppl = mean.exp();
    let var = nll2 / count as f64 - mean * mean;
    let ppl_err = if var > 0.0 && count > 1 {
        (var / (count - 1) as f64).sqrt() * ppl
    } else {
        0.0
    };
    Ok(PerplexityReport {
        ppl,
        ppl_err,
        mean_nll: mean,
        n_chunks,
        n_scored: count,
        n_tokens: tokens.len(),
        n_ctx,
        chunk_ppl,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_prob_is_log_softmax() {
        let l = [1.0f32, 2.0, 3.0];
        let z: f64 = l.iter().map(|&x| (x as f64).exp()).sum();
        assert!((log_prob(&l, 2) - (3.0f64.exp() / z).ln()).abs() < 1e-12);
    }
}
