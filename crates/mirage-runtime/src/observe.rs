//! Watching a dense forward pass: each layer's FFN input, for calibration
//! and evaluation of sparse FFN execution (the artifact builder records
//! which FFN pages each token needs from these inputs).
//!
//! The hook is [`Model::forward_observed`]; [`Model::forward`] passes no
//! observer, so the decode hot path pays nothing for it.

use crate::backend::{Backend, TokenSlot};
use crate::error::{Result, RuntimeError};
use crate::kv_cache::KvDtype;
use crate::model::Model;

/// Runs `tokens` as one sequence, `n_batch` tokens per forward pass, and
/// calls `on_ffn_input(layer, first_pos, x)` with every layer's FFN input
/// (`x` holds the rows of positions `first_pos..`, `n_embd` floats each) and
/// `on_logits(first_pos, logits)` with the logits of every position of each
/// pass (`vocab_size` floats per row).
pub fn observe_ffn_inputs<B: Backend>(
    model: &Model<B>,
    tokens: &[u32],
    n_batch: usize,
    kv_dtype: KvDtype,
    on_ffn_input: &mut dyn FnMut(usize, usize, &[f32]),
    on_logits: &mut dyn FnMut(usize, &[f32]),
) -> Result<()> {
    if tokens.is_empty() || n_batch == 0 {
        return Err(RuntimeError::InvalidArgument(
            "observe_ffn_inputs needs tokens and n_batch > 0".into(),
        ));
    }
    let mut cache = model.new_kv_cache(tokens.len(), 1, kv_dtype)?;
    let mut scratch = model.new_scratch();
    let mut logits = Vec::new();
    for (ci, chunk) in tokens.chunks(n_batch).enumerate() {
        let first = ci * n_batch;
        let slots: Vec<TokenSlot> = (0..chunk.len())
            .map(|i| TokenSlot {
                seq: 0,
                pos: first + i,
            })
            .collect();
        let rows: Vec<usize> = (0..chunk.len()).collect();
        let mut obs = |layer: usize, x: &[f32]| on_ffn_input(layer, first, x);
        model.forward_observed(
            chunk,
            &slots,
            &rows,
            &mut cache,
            &mut scratch,
            &mut logits,
            Some(&mut obs),
        )?;
        on_logits(first, &logits);
    }
    Ok(())
}
