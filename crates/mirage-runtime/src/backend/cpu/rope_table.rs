//! Rotary tables of the CPU backend's attention: cos/sin per position,
//! computed once per configuration rather than per token.

use crate::backend::AttentionParams;

/// cos/sin of every rotary pair for positions `0..n_pos` of one RoPE
/// configuration.
pub(super) struct RopeTable {
    head_dim: usize,
    base_bits: u32,
    scaling: crate::rope::RopeScaling,
    n_pos: usize,
    pub(super) cos: Vec<f32>,
    pub(super) sin: Vec<f32>,
}

/// The table of `p`'s RoPE configuration covering `0..=max_pos`, built (or
/// grown) on demand; at most a few configurations are kept.
pub(super) fn rope_table<'a>(
    tables: &'a mut Vec<RopeTable>,
    p: &AttentionParams,
    n_ctx: usize,
    max_pos: usize,
) -> &'a RopeTable {
    const KEPT: usize = 4;
    let hd = p.head_dim;
    let found = tables.iter().position(|t| {
        t.head_dim == hd && t.base_bits == p.rope_freq_base.to_bits() && t.scaling == p.rope_scaling
    });
    let i = match found {
        Some(i) if tables[i].n_pos > max_pos => return &tables[i],
        Some(i) => i,
        None => {
            if tables.len() == KEPT {
                tables.remove(0);
            }
            tables.push(RopeTable {
                head_dim: hd,
                base_bits: p.rope_freq_base.to_bits(),
                scaling: p.rope_scaling,
                n_pos: 0,
                cos: Vec::new(),
                sin: Vec::new(),
            });
            tables.len() - 1
        }
    };
    let n_pos = (max_pos + 1)
        .next_power_of_two()
        .max(64)
        .min(n_ctx.max(max_pos + 1));
    let t = &mut tables[i];
    t.cos.clear();
    t.sin.clear();
    let inv_freqs = p.rope_scaling.inv_freqs(hd, p.rope_freq_base);
    let mscale = p.rope_scaling.mscale();
    for pos in 0..n_pos {
        let a = crate::rope::angles(pos, &inv_freqs, mscale);
        t.cos.extend_from_slice(&a.cos);
        t.sin.extend_from_slice(&a.sin);
    }
    t.n_pos = n_pos;
    t
}
