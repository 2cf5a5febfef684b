//! Into and out of the channel-major layout: [`repack`] from ggml's
//! row-major blocks, [`dequantize`] back to f32 rows.

use super::kernel::{scales, Scales};
use super::layout::{get_code, put_code, Scheme};
use super::ChannelMajorLayout;
use crate::quant::QuantError;
use crate::types::GgmlType;

/// Integer codes and scale records of one source block row segment.
struct BlockParts {
    /// One code per element (unsigned; Q8_0 as its i8 bits).
    codes: Vec<u8>,
    /// Per group of the segment: the record bytes for this output.
    recs: Vec<[u8; 4]>,
    /// Per super-block of the segment: the header bytes for this output.
    hdrs: Vec<[u8; 4]>,
}

/// Splits one output row of the source (`cols` elements of `ty`) into codes,
/// group records and headers.
fn split_row(ty: GgmlType, s: &Scheme, row: &[u8], cols: usize) -> BlockParts {
    use GgmlType::*;
    let mut p = BlockParts {
        codes: vec![0; cols],
        recs: Vec::with_capacity(cols / s.group),
        hdrs: Vec::with_capacity(cols / s.superblock),
    };
    let bs = ty.type_size();
    let blocks = row.chunks_exact(bs);
    match ty {
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 => {
            for (bi, b) in blocks.enumerate() {
                let c = &mut p.codes[32 * bi..32 * bi + 32];
                let (rec_len, qh, qs) = match ty {
                    Q4_0 => (2, None, &b[2..18]),
                    Q4_1 => (4, None, &b[4..20]),
                    Q5_0 => (
                        2,
                        Some(u32::from_le_bytes([b[2], b[3], b[4], b[5]])),
                        &b[6..22],
                    ),
                    Q5_1 => (
                        4,
                        Some(u32::from_le_bytes([b[4], b[5], b[6], b[7]])),
                        &b[8..24],
                    ),
                    _ => (2, None, &b[2..34]),
                };
                if ty == Q8_0 {
                    c.copy_from_slice(qs);
                } else {
                    for j in 0..16 {
                        let h = qh.unwrap_or(0);
                        c[j] = (qs[j] & 0xf) | ((((h >> j) & 1) as u8) << 4);
                        c[j + 16] = (qs[j] >> 4) | ((((h >> (j + 16)) & 1) as u8) << 4);
                    }
                }
                let mut r = [0u8; 4];
                r[..rec_len].copy_from_slice(&b[..rec_len]);
                p.recs.push(r);
            }
        }
        Q4_K | Q5_K => {
            let five = ty == Q5_K;
            let qs_at = if five { 48 } else { 16 };
            for (bi, b) in blocks.enumerate() {
                p.hdrs.push([b[0], b[1], b[2], b[3]]);
                for sub in 0..8 {
                    let (sc, m) = crate::quant::kquants::scale_min_k4(sub, &b[4..16]);
                    p.recs.push([sc, m, 0, 0]);
                }
                let c = &mut p.codes[256 * bi..256 * bi + 256];
                for ch in 0..4 {
                    let q = &b[qs_at + 32 * ch..qs_at + 32 * ch + 32];
                    for l in 0..32 {
                        let (mut lo, mut hi) = (q[l] & 0xf, q[l] >> 4);
                        if five {
                            let qh = b[16 + l];
                            lo |= ((qh >> (2 * ch)) & 1) << 4;
                            hi |= ((qh >> (2 * ch + 1)) & 1) << 4;
                        }
                        c[64 * ch + l] = lo;
                        c[64 * ch + 32 + l] = hi;
                    }
                }
            }
        }
        Q6_K => {
            for (bi, b) in blocks.enumerate() {
                p.hdrs.push([b[208], b[209], 0, 0]);
                for sub in 0..16 {
                    p.recs.push([b[192 + sub], 0, 0, 0]);
                }
                let c = &mut p.codes[256 * bi..256 * bi + 256];
                for h in 0..2 {
                    let ql = &b[64 * h..64 * h + 64];
                    let qh = &b[128 + 32 * h..160 + 32 * h];
                    for l in 0..32 {
                        let e = 128 * h + l;
                        c[e] = (ql[l] & 0xf) | ((qh[l] & 3) << 4);
                        c[e + 32] = (ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4);
                        c[e + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                        c[e + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                    }
                }
            }
        }
        _ => {}
    }
    p
}

/// Repacks a ggml row-major matrix (`src`: `rows` rows of `cols` elements
/// of `layout.ty()`) into the channel-major layout (`dst`: exactly
/// [`ChannelMajorLayout::bytes`]).
pub fn repack(layout: &ChannelMajorLayout, src: &[u8], dst: &mut [u8]) -> Result<(), QuantError> {
    let ty = layout.ty;
    let row_bytes = crate::quant::row_bytes(ty, layout.cols)?;
    crate::quant::check_len(ty, "src bytes", row_bytes * layout.rows, src.len())?;
    crate::quant::check_len(ty, "dst bytes", layout.bytes(), dst.len())?;
    dst.fill(0);
    let s = layout.s;
    for j in 0..layout.rows {
        let parts = split_row(
            ty,
            &s,
            &src[j * row_bytes..(j + 1) * row_bytes],
            layout.cols,
        );
        let (t, p) = (j / layout.tile, j % layout.tile);
        let r = layout.tile_rows(t);
        for (sb, h) in parts.hdrs.iter().enumerate() {
            let at = layout.header_offset(t, sb);
            let hb = &mut dst[at..at + layout.header_bytes(r)];
            hb[2 * p..2 * p + 2].copy_from_slice(&h[..2]);
            if s.hdr == 4 {
                hb[2 * r + 2 * p..2 * r + 2 * p + 2].copy_from_slice(&h[2..4]);
            }
        }
        for (g, rc) in parts.recs.iter().enumerate() {
            let at = layout.record_offset(t, g);
            let rb = &mut dst[at..at + layout.record_bytes(r)];
            match (ty, s.rec) {
                (GgmlType::Q4_K | GgmlType::Q5_K, _) => {
                    rb[p] = rc[0];
                    rb[r + p] = rc[1];
                }
                (_, 1) => rb[p] = rc[0],
                (_, 2) => rb[2 * p..2 * p + 2].copy_from_slice(&rc[..2]),
                _ => {
                    rb[2 * p..2 * p + 2].copy_from_slice(&rc[..2]);
                    rb[2 * r + 2 * p..2 * r + 2 * p + 2].copy_from_slice(&rc[2..4]);
                }
            }
        }
        let rl = layout.run_bytes(r);
        for (i, &q) in parts.codes.iter().enumerate() {
            let at = layout.channel_offset(t, i);
            // Q8_0 codes are stored + 128 (unsigned, for `vpdpbusd`).
            let q = if ty == GgmlType::Q8_0 { q ^ 0x80 } else { q };
            put_code(s.bits, r, &mut dst[at..at + rl], p, q);
        }
    }
    Ok(())
}

/// Dequantizes a channel-major matrix back to row-major f32 (`dst`:
/// `rows * cols`), with ggml's own float expression per type, so the result
/// is bit-identical to [`crate::quant::dequantize`] of the source rows: the proof
/// that [`repack`] keeps every code and scale.
pub fn dequantize(
    layout: &ChannelMajorLayout,
    data: &[u8],
    dst: &mut [f32],
) -> Result<(), QuantError> {
    let ty = layout.ty;
    crate::quant::check_len(ty, "channel-major bytes", layout.bytes(), data.len())?;
    crate::quant::check_len(ty, "dst floats", layout.rows * layout.cols, dst.len())?;
    let bits = layout.s.bits;
    for t in 0..layout.n_tiles() {
        let r = layout.tile_rows(t);
        let rl = layout.run_bytes(r);
        for g in 0..layout.n_groups() {
            for i in g * layout.s.group..(g + 1) * layout.s.group {
                let run = &data[layout.channel_offset(t, i)..][..rl];
                for p in 0..r {
                    let q = get_code(bits, r, run, p);
                    let v = match scales(layout, data, t, g, p) {
                        Scales::Offset { d, off: 128 } => (q ^ 0x80) as i8 as f32 * d,
                        Scales::Offset { d, off } => (q as i32 - off) as f32 * d,
                        Scales::Min { d, m } => q as f32 * d + m,
                        Scales::K { d, sc, dmin, mn } => (d * sc) * q as f32 - dmin * mn,
                        Scales::K6 { d, sc } => d * sc * (q as i8 - 32) as f32,
                    };
                    dst[(t * layout.tile + p) * layout.cols + i] = v;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::channel_major::test_inputs::values;

    const TYPES: [GgmlType; 8] = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    fn random_matrix(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let rb = crate::quant::row_bytes(ty, cols).unwrap();
        let mut out = vec![0u8; rb * rows];
        crate::quant::quantize(ty, &values(seed, rows * cols), &mut out).unwrap();
        out
    }

    /// Shapes of every kind: one tile, several tiles with a short last one,
    /// a last block of 64 outputs (4- and 8-bit types only).
    fn shapes(ty: GgmlType) -> Vec<(usize, usize, usize)> {
        let mut v = vec![(128, 256, 128), (384, 512, 256), (640, 256, 256)];
        if matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0) {
            v.push((192, 256, 128));
            v.push((576, 256, 256));
        }
        v
    }

    /// Repacking keeps every code and scale: dequantizing the channel-major
    /// form gives the source's dequantization bit for bit.
    #[test]
    fn repack_is_lossless_for_every_type() {
        for ty in TYPES {
            for (rows, cols, tile) in shapes(ty) {
                let src = random_matrix(ty, rows, cols, rows as u64 + cols as u64);
                let layout = ChannelMajorLayout::with_tile(ty, rows, cols, tile).unwrap();
                let mut cm = vec![0u8; layout.bytes()];
                repack(&layout, &src, &mut cm).unwrap();
                let mut want = vec![0f32; rows * cols];
                crate::quant::dequantize(ty, &src, &mut want).unwrap();
                let mut got = vec![0f32; rows * cols];
                dequantize(&layout, &cm, &mut got).unwrap();
                for (k, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(a.to_bits(), b.to_bits(), "{ty} {rows}x{cols} element {k}");
                }
                let size = crate::quant::row_bytes(ty, cols).unwrap() * rows;
                let extra = layout.bytes() as f64 / size as f64;
                assert!(extra <= 1.03, "{ty}: {extra}x the source bytes");
            }
        }
    }
}
