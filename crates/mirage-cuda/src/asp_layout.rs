//! The GPU channel-major layout that `cuda/activation_sparse.cu`'s
//! `asp_mv_*` kernels read (its head comment is the specification), built
//! from the CPU channel-major layout of an activation artifact
//! (`mirage_gguf::quant::channel_major`): every code and scale bit of the
//! source blocks, moved. Host code only (no device), so it is tested on any
//! machine.
//!
//! Two layouts rather than one because the two kernels want different
//! grains: the CPU one places the codes for the AVX-512 transpose (blocks
//! of 128 outputs, Q8_0 stored + 128, Q4_K scale and min a byte each), the
//! GPU one for a warp's 16-byte loads (runs of a tile's outputs in order,
//! int8 Q8_0 codes, Q4_K's 6-bit scales in nibble and 2-bit planes).

use mirage_gguf::quant::channel_major::{code_position, ChannelMajorLayout};
use mirage_gguf::GgmlType;
use rayon::prelude::*;

/// Outputs per warp of the kernels (`ASP_WARP_OUT`): tile widths are
/// multiples of it.
pub const WARP_OUTPUTS: usize = 512;

/// Channels per scale group and list record (`ASP_GROUP`).
pub const GROUP: usize = 32;

/// Bytes of one group's list record (`ASP_REC_WORDS` words).
pub const RECORD_BYTES: usize = 128;

/// Why a matrix has no GPU channel-major layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AspLayoutError {
    /// The kernels read Q8_0 and Q4_K only.
    #[error("activation-sparse CUDA kernels read Q8_0 and Q4_K, not {0}")]
    Unsupported(GgmlType),
    /// A shape the kernels cannot take.
    #[error("{0}")]
    Shape(String),
}

/// The shape of one matrix in the GPU layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AspLayout {
    /// Q8_0 or Q4_K.
    pub ty: GgmlType,
    /// Outputs.
    pub rows: usize,
    /// Input channels.
    pub cols: usize,
    /// Outputs of a tile: 512, 1024 or 2048.
    pub tile: usize,
}

impl AspLayout {
    /// The layout of a `rows x cols` matrix of `ty` in tiles of `tile`
    /// outputs; typed errors for what the kernels do not take.
    pub fn new(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        tile: usize,
    ) -> Result<AspLayout, AspLayoutError> {
        let unit = match ty {
            GgmlType::Q8_0 => GROUP,
            GgmlType::Q4_K => 256,
            t => return Err(AspLayoutError::Unsupported(t)),
        };
        if cols == 0 || cols % unit != 0 || rows == 0 {
            return Err(AspLayoutError::Shape(format!(
                "a {rows} x {cols} {ty} matrix: the kernels take rows > 0 and columns a multiple of {unit}"
            )));
        }
        if ![512, 1024, 2048].contains(&tile) {
            return Err(AspLayoutError::Shape(format!(
                "tiles of {tile} outputs: the kernels take 512, 1024 or 2048"
            )));
        }
        // The kernels index with 32-bit ints.
        if rows > i32::MAX as usize || cols > i32::MAX as usize {
            return Err(AspLayoutError::Shape(format!(
                "a {rows} x {cols} matrix is too large"
            )));
        }
        Ok(AspLayout {
            ty,
            rows,
            cols,
            tile,
        })
    }

    /// Bytes per output row: codes and their scales.
    pub fn row_bytes(&self) -> usize {
        self.code_bytes_per_output() + self.cols / 16
    }

    fn code_bytes_per_output(&self) -> usize {
        match self.ty {
            GgmlType::Q8_0 => self.cols,
            _ => self.cols / 2,
        }
    }

    /// Tiles.
    pub fn n_tiles(&self) -> usize {
        self.rows.div_ceil(self.tile)
    }

    /// Outputs of tile `t`, and that padded to 16.
    fn tile_rows(&self, t: usize) -> (usize, usize) {
        let r = self.tile.min(self.rows - t * self.tile);
        (r, r.next_multiple_of(16))
    }

    /// Bytes of the whole matrix (the last tile padded to 16 outputs).
    pub fn bytes(&self) -> usize {
        let (_, rp) = self.tile_rows(self.n_tiles() - 1);
        ((self.n_tiles() - 1) * self.tile + rp) * self.row_bytes()
    }

    /// Weight bytes the kernel reads for `active` channels in `groups`
    /// groups with one (runs of the active channels, the scales of those
    /// groups), padding counted.
    pub fn bytes_read(&self, active: usize, groups: usize) -> usize {
        let padded = self.bytes() / self.row_bytes();
        // Codes: a byte (Q8_0) or half a byte (Q4_K) an output. Scales: two
        // bytes an output and group (Q8_0's d; Q4_K's super-block of 16
        // bytes an output over its 8 groups).
        padded * active * self.code_bytes_per_output() / self.cols + padded * groups * 2
    }
}

/// The GPU layout of a channel-major matrix `data` (`cm`'s layout, as an
/// activation artifact stores it), in tiles of `tile` outputs.
pub fn from_channel_major(
    cm: &ChannelMajorLayout,
    data: &[u8],
    tile: usize,
) -> Result<(AspLayout, Vec<u8>), AspLayoutError> {
    let l = AspLayout::new(cm.ty(), cm.rows(), cm.cols(), tile)?;
    if data.len() != cm.bytes() {
        return Err(AspLayoutError::Shape(format!(
            "{} channel-major bytes for a layout of {}",
            data.len(),
            cm.bytes()
        )));
    }
    let mut out = vec![0u8; l.bytes()];
    let cols = l.cols;
    // Tiles are independent, each a contiguous part of `out` (the last one
    // padded to 16 outputs): converted in parallel (a 7B FFN matrix took
    // about a second on one core, so a 7B model's 84 of them dominated the
    // backend's load).
    out.par_chunks_mut(l.tile * l.row_bytes())
        .enumerate()
        .for_each(|(t, tile_out)| {
            let (r, rp) = l.tile_rows(t);
            let run = if l.ty == GgmlType::Q8_0 { rp } else { rp / 2 };
            let scales = cols * run;
            let t0 = t * l.tile;
            // Where output o's code sits in its channel-major tile's run of
            // every channel (the same for all channels): the tile, the byte
            // in the run and the shift (`code_position`, what `source_code`
            // reads per code, hoisted out of the loop over channels).
            let at: Vec<(usize, usize, u32)> = (t0..t0 + r)
                .map(|j| {
                    let (ct, p) = (j / cm.tile(), j % cm.tile());
                    let ((b, sh), hi) = code_position(cm.bits(), cm.tile_rows(ct), p);
                    debug_assert!(hi.is_none(), "4- and 8-bit codes only");
                    (ct, b, sh)
                })
                .collect();
            let (ct_lo, ct_hi) = (at[0].0, at[r - 1].0);
            let mut run_at = vec![0usize; ct_hi - ct_lo + 1];
            // Codes: channel i's run at i * run.
            for i in 0..cols {
                for (k, ct) in (ct_lo..=ct_hi).enumerate() {
                    run_at[k] = cm.channel_offset(ct, i);
                }
                let dst = &mut tile_out[i * run..(i + 1) * run];
                for (o, &(ct, b, sh)) in at.iter().enumerate() {
                    let byte = data[run_at[ct - ct_lo] + b];
                    let q = match l.ty {
                        // Q8_0 codes are stored + 128.
                        GgmlType::Q8_0 => byte ^ 0x80,
                        _ => (byte >> sh) & 0xf,
                    };
                    match l.ty {
                        GgmlType::Q8_0 => dst[o] = q,
                        _ => {
                            // byte 8 l + b: output 16 l + b low, 16 l + 8 + b high.
                            let (blk, k) = (o / 16, o % 16);
                            let at = 8 * blk + (k % 8);
                            dst[at] |= if k < 8 { q & 0xf } else { (q & 0xf) << 4 };
                        }
                    }
                }
            }
            for o in 0..r {
                let j = t0 + o;
                let (ct, p) = (j / cm.tile(), j % cm.tile());
                let cr = cm.tile_rows(ct);
                match l.ty {
                    GgmlType::Q8_0 => {
                        for g in 0..cols / GROUP {
                            let rec = cm.record_offset(ct, g);
                            let d = &data[rec + 2 * p..rec + 2 * p + 2];
                            let at = scales + g * 2 * rp + 2 * o;
                            tile_out[at..at + 2].copy_from_slice(d);
                        }
                    }
                    _ => {
                        for sb in 0..cols / 256 {
                            let s = scales + sb * 16 * rp;
                            let h = cm.header_offset(ct, sb);
                            // (d, dmin) of output o as two f16.
                            tile_out[s + 4 * o..s + 4 * o + 2]
                                .copy_from_slice(&data[h + 2 * p..h + 2 * p + 2]);
                            tile_out[s + 4 * o + 2..s + 4 * o + 4]
                                .copy_from_slice(&data[h + 2 * cr + 2 * p..h + 2 * cr + 2 * p + 2]);
                            let mut sc = [0u8; 8];
                            let mut mn = [0u8; 8];
                            for j8 in 0..8 {
                                let rec = cm.record_offset(ct, 8 * sb + j8);
                                sc[j8] = data[rec + p];
                                mn[j8] = data[rec + cr + p];
                            }
                            for j8 in 0..8 {
                                tile_out[s + (4 + j8) * rp + o] =
                                    (sc[j8] & 15) | ((mn[j8] & 15) << 4);
                            }
                            for k in 0..4 {
                                let (a, b) = (2 * k, 2 * k + 1);
                                tile_out[s + (12 + k) * rp + o] = (sc[a] >> 4)
                                    | ((mn[a] >> 4) << 2)
                                    | ((sc[b] >> 4) << 4)
                                    | ((mn[b] >> 4) << 6);
                            }
                        }
                    }
                }
            }
        });
    Ok((l, out))
}

/// The f32 weights of a GPU-layout matrix, row-major, with ggml's float
/// expression per type (Q8_0 `d * q`; Q4_K `d * sc * q - dmin * m`):
/// decoded straight from the kernel's specification, so that tests can
/// hold the layout to ggml's own dequantizer bit for bit.
pub fn dequantize(l: &AspLayout, bytes: &[u8]) -> Vec<f32> {
    let f16 = |b: &[u8], at: usize| half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
    let mut w = vec![0f32; l.rows * l.cols];
    for t in 0..l.n_tiles() {
        let (r, rp) = l.tile_rows(t);
        let base = t * l.tile * l.row_bytes();
        let run = if l.ty == GgmlType::Q8_0 { rp } else { rp / 2 };
        let scales = base + l.cols * run;
        for o in 0..r {
            let j = t * l.tile + o;
            for i in 0..l.cols {
                let rb = &bytes[base + i * run..];
                let g = i / GROUP;
                w[j * l.cols + i] = match l.ty {
                    GgmlType::Q8_0 => f16(bytes, scales + g * 2 * rp + 2 * o) * rb[o] as i8 as f32,
                    _ => {
                        let (blk, k) = (o / 16, o % 16);
                        let byte = rb[8 * blk + k % 8];
                        let q = if k < 8 { byte & 15 } else { byte >> 4 };
                        let s = scales + (g / 8) * 16 * rp;
                        let (d, dmin) = (f16(bytes, s + 4 * o), f16(bytes, s + 4 * o + 2));
                        let sub = g % 8;
                        let lo = bytes[s + (4 + sub) * rp + o];
                        let hi = bytes[s + (12 + sub / 2) * rp + o] >> (4 * (sub % 2));
                        let sc = (lo & 15) | ((hi & 3) << 4);
                        let m = (lo >> 4) | (((hi >> 2) & 3) << 4);
                        d * sc as f32 * q as f32 - dmin * m as f32
                    }
                };
            }
        }
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;
    use mirage_gguf::quant::channel_major::repack;

    /// Random ggml blocks of a `rows x cols` matrix (scales kept small and
    /// finite).
    fn blocks(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let bs = ty.type_size();
        let n = rows * cols / ty.block_size();
        let mut out: Vec<u8> = (0..n * bs).map(|_| next() as u8).collect();
        for b in out.chunks_exact_mut(bs) {
            let n_scales = if ty == GgmlType::Q8_0 { 1 } else { 2 };
            for k in 0..n_scales {
                let v = half::f16::from_f32(0.001 + (next() % 1000) as f32 * 1e-5);
                b[2 * k..2 * k + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        out
    }

    fn round_trip(ty: GgmlType, rows: usize, cols: usize, tile: usize) {
        let src = blocks(ty, rows, cols, (rows + cols + tile) as u64);
        let cm = ChannelMajorLayout::new(ty, rows, cols).unwrap();
        let mut cmb = vec![0u8; cm.bytes()];
        repack(&cm, &src, &mut cmb).unwrap();
        let (l, gpu) = from_channel_major(&cm, &cmb, tile).unwrap();
        assert_eq!(gpu.len(), l.bytes());
        assert_eq!(l.bytes(), rows.next_multiple_of(16) * l.row_bytes());
        let mut want = vec![0f32; rows * cols];
        mirage_gguf::quant::dequantize(ty, &src, &mut want).unwrap();
        let got = dequantize(&l, &gpu);
        let differ = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ, 0,
            "{ty} {rows}x{cols} tile {tile}: {differ} weights differ from ggml's"
        );
    }

    #[test]
    fn the_gpu_layout_keeps_every_weight_of_the_source_blocks() {
        // A partial last tile (rows not a multiple of the tile), several
        // tiles, and tiles wider than the CPU layout's.
        for tile in [512, 1024, 2048] {
            round_trip(GgmlType::Q8_0, 1216, 96, tile);
            round_trip(GgmlType::Q4_K, 640, 512, tile);
        }
        round_trip(GgmlType::Q4_K, 2304, 256, 512);
    }

    #[test]
    fn other_types_and_shapes_are_refused_by_name() {
        let e = AspLayout::new(GgmlType::Q6_K, 256, 256, 512).unwrap_err();
        assert_eq!(e, AspLayoutError::Unsupported(GgmlType::Q6_K));
        assert!(e.to_string().contains("Q6_K"), "{e}");
        assert!(AspLayout::new(GgmlType::Q4_K, 256, 96, 512).is_err());
        assert!(AspLayout::new(GgmlType::Q8_0, 256, 96, 768).is_err());
        assert!(AspLayout::new(GgmlType::Q8_0, 0, 96, 512).is_err());
    }
}
