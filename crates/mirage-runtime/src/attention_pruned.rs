//! Attention of one query over a subset of KV pages.
//!
//! The softmax runs over exactly the positions of the selected pages: the
//! result is the attention the model would compute if the other positions
//! did not exist. With every page selected it is full attention.

use half::f16;

use crate::ops;

/// Keys and values of one KV head of one sequence, rows of `head_dim`
/// elements from position 0 on.
#[derive(Debug, Clone, Copy)]
pub enum KvHeadView<'a> {
    /// f32 storage.
    F32 {
        /// Keys, row-major.
        k: &'a [f32],
        /// Values, row-major.
        v: &'a [f32],
    },
    /// f16 storage.
    F16 {
        /// Keys, row-major.
        k: &'a [f16],
        /// Values, row-major.
        v: &'a [f16],
    },
    /// Q8_0 storage: (quantized values, one scale per 32 of them).
    Q8_0 {
        /// Keys, row-major.
        k: (&'a [i8], &'a [f16]),
        /// Values, row-major.
        v: (&'a [i8], &'a [f16]),
    },
}

/// Rows `span` (of `d` values) of Q8_0 storage widened to f32 in `out`.
fn widen_q8_0(rows: (&[i8], &[f16]), d: usize, span: std::ops::Range<usize>, out: &mut Vec<f32>) {
    use crate::kv_cache::{dequantize_q8_0, Q8_0_BLOCK};
    out.resize(span.len() * d, 0.0);
    let (a, b) = (span.start * d, span.end * d);
    dequantize_q8_0(&rows.0[a..b], &rows.1[a / Q8_0_BLOCK..b / Q8_0_BLOCK], out);
}

impl KvHeadView<'_> {
    /// Copies the key at `pos` into `out` (`head_dim` elements).
    pub fn key(&self, pos: usize, out: &mut [f32]) {
        let d = out.len();
        match self {
            KvHeadView::F32 { k, .. } => out.copy_from_slice(&k[pos * d..(pos + 1) * d]),
            KvHeadView::F16 { k, .. } => {
                for (o, x) in out.iter_mut().zip(&k[pos * d..(pos + 1) * d]) {
                    *o = x.to_f32();
                }
            }
            KvHeadView::Q8_0 { k, .. } => {
                let mut row = Vec::new();
                widen_q8_0(*k, d, pos..pos + 1, &mut row);
                out.copy_from_slice(&row);
            }
        }
    }
}

/// `out = softmax(q·K_S^T * scale) V_S` where `S` is the positions `< n` of
/// the pages listed in `pages` (`page` positions each; any order, no
/// duplicates). `scores` needs as many elements as `S` has positions; `out`
/// gets `q.len()`. Callers check the ranges.
#[allow(clippy::too_many_arguments)]
pub fn attend_pages(
    view: &KvHeadView<'_>,
    page: usize,
    pages: &[usize],
    n: usize,
    q: &[f32],
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let d = q.len();
    let spans = || {
        pages
            .iter()
            .map(move |&p| (p * page).min(n)..((p + 1) * page).min(n))
    };
    let mut m = 0;
    match view {
        KvHeadView::F32 { k, .. } => {
            // The same score kernel as full attention, per page span (a
            // key's score does not depend on the span it comes in).
            for span in spans() {
                let len = span.len();
                ops::attention_scores(
                    q,
                    &k[span.start * d..span.end * d],
                    len,
                    scale,
                    &mut scores[m..m + len],
                );
                m += len;
            }
        }
        KvHeadView::F16 { k, .. } => {
            for span in spans() {
                let len = span.len();
                ops::attention_scores(
                    q,
                    &k[span.start * d..span.end * d],
                    len,
                    scale,
                    &mut scores[m..m + len],
                );
                m += len;
            }
        }
        KvHeadView::Q8_0 { k, .. } => {
            let mut wide = Vec::new();
            for span in spans() {
                let len = span.len();
                widen_q8_0(*k, d, span, &mut wide);
                ops::attention_scores(q, &wide, len, scale, &mut scores[m..m + len]);
                m += len;
            }
        }
    }
    ops::softmax_in_place(&mut scores[..m]);
    out.fill(0.0);
    let mut m = 0;
    for span in spans() {
        match view {
            // As full attention's weighted sum (keys added in order), so
            // every page selected reproduces it bit for bit (f32 and f16).
            KvHeadView::F32 { v, .. } => {
                let len = span.len();
                ops::attention_weighted_sum(
                    &scores[m..m + len],
                    &v[span.start * d..span.end * d],
                    len,
                    out,
                );
                m += len;
            }
            KvHeadView::F16 { v, .. } => {
                let len = span.len();
                ops::attention_weighted_sum(
                    &scores[m..m + len],
                    &v[span.start * d..span.end * d],
                    len,
                    out,
                );
                m += len;
            }
            KvHeadView::Q8_0 { v, .. } => {
                let len = span.len();
                let mut wide = Vec::new();
                widen_q8_0(*v, d, span, &mut wide);
                ops::attention_weighted_sum(&scores[m..m + len], &wide, len, out);
                m += len;
            }
        }
    }
}

/// For each row of a batch, whether it is the only row of its sequence:
/// a decode step, the rows pruning applies to (prefill attends every page so
/// that the cache it fills is exact).
pub fn decode_rows(slots: &[crate::backend::TokenSlot]) -> Vec<bool> {
    let mut counts: std::collections::HashMap<usize, usize> = std::collections::HashMap::new();
    for s in slots {
        *counts.entry(s.seq).or_default() += 1;
    }
    slots.iter().map(|s| counts[&s.seq] == 1).collect()
}
