//! Packing: one page = gate rows, up rows, then the transposed down slice
//! (`PAGE_CHANNELS` rows of `d_model` each), re-quantized from f32. Every
//! row is a whole number of quant blocks, so a page never splits a block.

use mirage_gguf::{quant, GgmlType};

use crate::error::Result;
use crate::ffn::FfnF32;
use crate::format::{page_bytes, PAGE_CHANNELS};

/// Packs page `p` (channels `p * PAGE_CHANNELS ..` of `ffn`, already in
/// page order) as `ty`.
pub fn pack_page(ffn: &FfnF32, p: usize, ty: GgmlType) -> Result<Vec<u8>> {
    let d = ffn.d_model;
    let pb = page_bytes(ty, d)?;
    let rb = quant::row_bytes(ty, d)?;
    let mut out = vec![0u8; pb];
    let range = p * PAGE_CHANNELS * d..(p + 1) * PAGE_CHANNELS * d;
    for (k, m) in [&ffn.gate, &ffn.up, &ffn.down_t].into_iter().enumerate() {
        let src = &m[range.clone()];
        for i in 0..PAGE_CHANNELS {
            let o = (k * PAGE_CHANNELS + i) * rb;
            quant::quantize(ty, &src[i * d..(i + 1) * d], &mut out[o..o + rb])?;
        }
    }
    Ok(out)
}

/// Dequantizes packed pages back into an [`FfnF32`] (channels in page order).
pub fn unpack_pages(pages: &[&[u8]], ty: GgmlType, d_model: usize) -> Result<FfnF32> {
    let rb = quant::row_bytes(ty, d_model)?;
    let n_ff = pages.len() * PAGE_CHANNELS;
    let mut f = FfnF32 {
        d_model,
        n_ff,
        gate: vec![0.0; n_ff * d_model],
        up: vec![0.0; n_ff * d_model],
        down_t: vec![0.0; n_ff * d_model],
    };
    for (p, bytes) in pages.iter().enumerate() {
        for (k, m) in [&mut f.gate, &mut f.up, &mut f.down_t]
            .into_iter()
            .enumerate()
        {
            let src = &bytes[k * PAGE_CHANNELS * rb..(k + 1) * PAGE_CHANNELS * rb];
            quant::dequantize(
                ty,
                src,
                &mut m[p * PAGE_CHANNELS * d_model..(p + 1) * PAGE_CHANNELS * d_model],
            )?;
        }
    }
    Ok(f)
}

/// The quant type a layer really gets for `wanted`: K-quants need
/// `d_model % 256 == 0`; otherwise Q8_0 (what llama.cpp falls back to).
pub fn effective_quant(wanted: GgmlType, d_model: usize) -> GgmlType {
    if d_model.is_multiple_of(wanted.block_size()) {
        wanted
    } else {
        GgmlType::Q8_0
    }
}
