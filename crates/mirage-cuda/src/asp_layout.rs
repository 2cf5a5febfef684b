//! The GPU channel-major layout that `cuda/activation_sparse.cu`'s
//! `asp_mv_*` kernels read (its head comment is the specification), built
//! from the CPU channel-major layout of an activation artifact
//! (`mirage_gguf::quant::channel_major`): every code and scale bit of the
//! source blocks, moved. Host code only (no device), so it is tested on any
//! machine.
//!
//! Q8_0, Q4_K, Q4_1, Q5_0 and Q6_K. Two layouts rather than one because the two
//! kernels want different grains: the CPU one places the codes for the
//! AVX-512 transpose (blocks of 128 outputs, Q8_0 stored + 128, the high
//! bits of 5- and 6-bit codes in that transpose's order, Q4_K scale and min
//! a byte each), the GPU one for a warp's 16-byte loads (runs of a tile's
//! outputs in order, int8 Q8_0 codes, the low 4 bits of the other codes in
//! nibbles and their high bits in a second run per channel, Q4_K's 6-bit
//! scales in nibble and 2-bit planes, Q6_K's int8 scales in pairs).

use mirage_gguf::quant::channel_major::{code_position, ChannelMajorLayout};
use mirage_gguf::GgmlType;
use rayon::prelude::*;

/// Outputs per warp of the kernels (`ASP_WARP_OUT`): tile widths are
/// multiples of it.
pub const WARP_OUTPUTS: usize = 512;

/// The types the kernels read.
pub const TYPES: [GgmlType; 5] = [
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q6_K,
];

/// Channels per scale group and list record (`ASP_GROUP`).
pub const GROUP: usize = 32;

/// Bytes of one group's list record (`ASP_REC_WORDS` words).
pub const RECORD_BYTES: usize = 128;

/// Why a matrix has no GPU channel-major layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AspLayoutError {
    /// The kernels read Q8_0, Q4_K, Q4_1, Q5_0 and Q6_K only.
    #[error("activation-sparse CUDA kernels read Q8_0, Q4_K, Q4_1, Q5_0 and Q6_K, not {0}")]
    Unsupported(GgmlType),
    /// A shape the kernels cannot take.
    #[error("{0}")]
    Shape(String),
}

/// The shape of one matrix in the GPU layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AspLayout {
    /// Q8_0, Q4_K, Q4_1, Q5_0 or Q6_K.
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
            GgmlType::Q8_0 | GgmlType::Q4_1 | GgmlType::Q5_0 => GROUP,
            GgmlType::Q4_K | GgmlType::Q6_K => 256,
            t => return Err(AspLayoutError::Unsupported(t)),
        };
        if cols == 0 || !cols.is_multiple_of(unit) || rows == 0 {
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

    /// Bytes per output row: codes and their scales (as ggml's blocks:
    /// Q8_0 34 bytes per 32 weights, Q4_1 20, Q5_0 22, Q4_K 144 per 256,
    /// Q6_K 210).
    pub fn row_bytes(&self) -> usize {
        self.code_bytes_per_output() + self.scale_bytes_per_output()
    }

    /// Code bytes per output: low 4 bits (all 8 for Q8_0) and high bits.
    fn code_bytes_per_output(&self) -> usize {
        match self.ty {
            GgmlType::Q8_0 => self.cols,
            GgmlType::Q5_0 => self.cols / 2 + self.cols / 8,
            GgmlType::Q6_K => self.cols / 2 + self.cols / 4,
            _ => self.cols / 2,
        }
    }

    /// Scale bytes per output: an f16 per 32 channels (Q8_0, Q5_0; Q4_K's
    /// 16 bytes per 256), two per 32 (Q4_1's d and m), Q6_K's f16 and 16
    /// int8 per 256.
    fn scale_bytes_per_output(&self) -> usize {
        match self.ty {
            GgmlType::Q6_K => 9 * self.cols / 128,
            GgmlType::Q4_1 => self.cols / 8,
            _ => self.cols / 16,
        }
    }

    /// Bits above the low 4 of a code in the high-bit region (0: none).
    fn high_bits(&self) -> usize {
        match self.ty {
            GgmlType::Q5_0 => 1,
            GgmlType::Q6_K => 2,
            _ => 0,
        }
    }

    /// Bytes of a channel's run of codes in a tile of `rp` (padded)
    /// outputs: the low-code run, the high-bit run.
    fn runs(&self, rp: usize) -> (usize, usize) {
        let run = if self.ty == GgmlType::Q8_0 {
            rp
        } else {
            rp / 2
        };
        (run, rp * self.high_bits() / 8)
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
        // Codes: the active channels' share of an output's code bytes.
        // Scales: a group's share of an output's scale bytes (super-block
        // headers spread over their groups).
        padded * active * self.code_bytes_per_output() / self.cols
            + padded * groups * self.scale_bytes_per_output() * GROUP / self.cols
    }
}

/// One output's code in a conversion: its channel-major tile `ct` (less
/// the GPU tile's first), the byte and shift of its low 4 bits (`lo`, `sh`)
/// and of its high bits (`hi`, `hsh`) in that tile's run of a channel, and
/// the shifts of both in its lane's GPU words (`dsh`: of the lane's 8 low
/// bytes as a little-endian u64; `dhsh`: of its 2 or 4 high-bit bytes).
struct Pos {
    ct: u32,
    lo: u32,
    hi: u32,
    sh: u8,
    hsh: u8,
    dsh: u8,
    dhsh: u8,
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
            let (run, hrun) = l.runs(rp);
            let scales = cols * (run + hrun);
            let t0 = t * l.tile;
            let hmask = (1u8 << l.high_bits()) - 1;
            // Where output o's code sits in its channel-major tile's run of
            // every channel (the same for all channels): the tile, the byte
            // and shift of its low 4 bits and of its high bits in the run
            // (`code_position`, what `source_code` reads per code, hoisted
            // out of the loop over channels), and where its bits go in the
            // GPU runs.
            let ct_lo = t0 / cm.tile();
            let at: Vec<Pos> = (t0..t0 + r)
                .map(|j| {
                    let (ct, p) = (j / cm.tile(), j % cm.tile());
                    let ((b, sh), hi) = code_position(cm.bits(), cm.tile_rows(ct), p);
                    let (hb, hsh) = hi.unwrap_or((0, 0));
                    // Output 16 l + k of lane l: low nibble in byte k % 8,
                    // the high one from k = 8 on.
                    let k = (j - t0) % 16;
                    let dhsh = match l.ty {
                        // The lane's u16, bit 4 m + i: output 16 l + 4 i + m.
                        GgmlType::Q5_0 => 4 * (k % 4) + k / 4,
                        // The lane's byte m, bits 2 i: output 16 l + 4 i + m.
                        GgmlType::Q6_K => 8 * (k % 4) + 2 * (k / 4),
                        _ => 0,
                    };
                    Pos {
                        ct: (ct - ct_lo) as u32,
                        lo: b as u32,
                        hi: hb as u32,
                        sh: sh as u8,
                        hsh: hsh as u8,
                        dsh: (8 * (k % 8) + 4 * (k / 8)) as u8,
                        dhsh: dhsh as u8,
                    }
                })
                .collect();
            let ct_hi = (t0 + r - 1) / cm.tile();
            let mut run_at = vec![0usize; ct_hi - ct_lo + 1];
            let (codes, rest) = tile_out.split_at_mut(cols * run);
            let highs = &mut rest[..cols * hrun];
            // Codes: channel i's run at i * run, its high bits' at i * hrun;
            // a lane's bytes gathered in a word and written once.
            for i in 0..cols {
                for (k, ct) in (ct_lo..=ct_hi).enumerate() {
                    run_at[k] = cm.channel_offset(ct, i);
                }
                let dst = &mut codes[i * run..(i + 1) * run];
                let hdst = &mut highs[i * hrun..(i + 1) * hrun];
                let hl = hrun * 16 / rp; // high-bit bytes of a lane
                match l.ty {
                    // Q8_0 codes are stored + 128.
                    GgmlType::Q8_0 => {
                        for (d, a) in dst.iter_mut().zip(&at) {
                            *d = data[run_at[a.ct as usize] + a.lo as usize] ^ 0x80;
                        }
                    }
                    GgmlType::Q4_K | GgmlType::Q4_1 => {
                        for (lane, ats) in at.chunks(16).enumerate() {
                            let mut lo = 0u64;
                            for a in ats {
                                let src = run_at[a.ct as usize];
                                let q = (data[src + a.lo as usize] >> a.sh) & 0xf;
                                lo |= (q as u64) << a.dsh;
                            }
                            dst[8 * lane..8 * lane + 8].copy_from_slice(&lo.to_le_bytes());
                        }
                    }
                    _ => {
                        for (lane, ats) in at.chunks(16).enumerate() {
                            let (mut lo, mut hi) = (0u64, 0u32);
                            for a in ats {
                                let src = run_at[a.ct as usize];
                                let q = (data[src + a.lo as usize] >> a.sh) & 0xf;
                                lo |= (q as u64) << a.dsh;
                                let h = (data[src + a.hi as usize] >> a.hsh) & hmask;
                                hi |= (h as u32) << a.dhsh;
                            }
                            dst[8 * lane..8 * lane + 8].copy_from_slice(&lo.to_le_bytes());
                            hdst[hl * lane..hl * (lane + 1)]
                                .copy_from_slice(&hi.to_le_bytes()[..hl]);
                        }
                    }
                }
            }
            // Scales: per channel-major tile the GPU tile overlaps, its
            // outputs o0 .. o0 + n at p0 .. p0 + n there.
            for (k, ct) in (ct_lo..=ct_hi).enumerate() {
                let (c0, cr) = (ct * cm.tile(), cm.tile_rows(ct));
                let j0 = t0.max(c0);
                let n = (t0 + r).min(c0 + cr) - j0;
                let (o0, p0) = (j0 - t0, j0 - c0);
                debug_assert!(k > 0 || o0 == 0);
                match l.ty {
                    // The f16 d of each output.
                    GgmlType::Q8_0 | GgmlType::Q5_0 => {
                        for g in 0..cols / GROUP {
                            let rec = cm.record_offset(ct, g) + 2 * p0;
                            let at = scales + g * 2 * rp + 2 * o0;
                            tile_out[at..at + 2 * n].copy_from_slice(&data[rec..rec + 2 * n]);
                        }
                    }
                    GgmlType::Q4_1 => {
                        // (d, m) of each output as two f16 at 4 o; the
                        // channel-major record holds the d's, then the m's.
                        for g in 0..cols / GROUP {
                            let (rec, at) = (cm.record_offset(ct, g), scales + g * 4 * rp);
                            pair_f16s(&mut tile_out[at + 4 * o0..], &data[rec..], cr, p0, n);
                        }
                    }
                    GgmlType::Q6_K => {
                        for sb in 0..cols / 256 {
                            // d of each output as f16, then the int8 scales
                            // of sub-blocks 2 j and 2 j + 1 (16 channels
                            // each) at bytes 2 o and 2 o + 1 of plane j.
                            let s = scales + sb * 18 * rp;
                            let h = cm.header_offset(ct, sb) + 2 * p0;
                            tile_out[s + 2 * o0..s + 2 * (o0 + n)]
                                .copy_from_slice(&data[h..h + 2 * n]);
                            for sub in 0..16 {
                                let rec = cm.record_offset(ct, 16 * sb + sub) + p0;
                                let plane = s + (1 + sub / 2) * 2 * rp + sub % 2;
                                let dst = &mut tile_out[plane + 2 * o0..plane + 2 * (o0 + n) - 1];
                                for (d, &v) in dst.iter_mut().step_by(2).zip(&data[rec..rec + n]) {
                                    *d = v;
                                }
                            }
                        }
                    }
                    _ => {
                        for sb in 0..cols / 256 {
                            let s = scales + sb * 16 * rp;
                            let h = cm.header_offset(ct, sb);
                            let recs: [usize; 8] =
                                std::array::from_fn(|j8| cm.record_offset(ct, 8 * sb + j8));
                            // (d, dmin) of each output as two f16.
                            pair_f16s(&mut tile_out[s + 4 * o0..], &data[h..], cr, p0, n);
                            for x in 0..n {
                                let (o, p) = (o0 + x, p0 + x);
                                let sc: [u8; 8] = std::array::from_fn(|j8| data[recs[j8] + p]);
                                let mn: [u8; 8] = std::array::from_fn(|j8| data[recs[j8] + cr + p]);
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
            }
        });
    Ok((l, out))
}

/// Outputs `p0 .. p0 + n` of a channel-major record or header of two f16
/// planes (`src`: the first plane's `cr` values, then the second's) into
/// `dst` as a pair per output, 4 bytes apart.
fn pair_f16s(dst: &mut [u8], src: &[u8], cr: usize, p0: usize, n: usize) {
    for (x, d) in dst[..4 * n].chunks_exact_mut(4).enumerate() {
        let p = p0 + x;
        d[..2].copy_from_slice(&src[2 * p..2 * p + 2]);
        d[2..].copy_from_slice(&src[2 * cr + 2 * p..2 * cr + 2 * p + 2]);
    }
}

/// The f32 weights of a GPU-layout matrix, row-major, with ggml's float
/// expression per type (Q8_0 `d * q`; Q4_K `d * sc * q - dmin * m`; Q4_1
/// `q * d + m`; Q5_0
/// `(q - 16) * d`; Q6_K `d * sc * (q - 32)`, left to right):
/// decoded straight from the kernel's specification, so that tests can
/// hold the layout to ggml's own dequantizer bit for bit.
pub fn dequantize(l: &AspLayout, bytes: &[u8]) -> Vec<f32> {
    let f16 = |b: &[u8], at: usize| half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
    let mut w = vec![0f32; l.rows * l.cols];
    for t in 0..l.n_tiles() {
        let (r, rp) = l.tile_rows(t);
        let base = t * l.tile * l.row_bytes();
        let (run, hrun) = l.runs(rp);
        let highs = base + l.cols * run;
        let scales = highs + l.cols * hrun;
        for o in 0..r {
            let j = t * l.tile + o;
            for i in 0..l.cols {
                let rb = &bytes[base + i * run..];
                let hb = &bytes[highs + i * hrun..];
                let g = i / GROUP;
                let (blk, k) = (o / 16, o % 16);
                // The low 4 bits (not Q8_0): byte 8 l + b, output 16 l + b
                // low, 16 l + 8 + b high.
                let byte = rb[8 * blk + k % 8];
                let lo = if k < 8 { byte & 15 } else { byte >> 4 };
                // Output 16 l + 4 i + m's high bits.
                let (i4, m) = (k / 4, k % 4);
                w[j * l.cols + i] = match l.ty {
                    GgmlType::Q8_0 => f16(bytes, scales + g * 2 * rp + 2 * o) * rb[o] as i8 as f32,
                    GgmlType::Q4_1 => {
                        let at = scales + g * 4 * rp + 4 * o;
                        lo as f32 * f16(bytes, at) + f16(bytes, at + 2)
                    }
                    GgmlType::Q5_0 => {
                        // Lane l's u16 at 2 l, bit 4 m + i.
                        let h = u16::from_le_bytes([hb[2 * blk], hb[2 * blk + 1]]);
                        let q = lo | ((h >> (4 * m + i4)) as u8 & 1) << 4;
                        let d = f16(bytes, scales + g * 2 * rp + 2 * o);
                        (q as i32 - 16) as f32 * d
                    }
                    GgmlType::Q6_K => {
                        // Lane l's byte m at 4 l + m, bits 2 i.
                        let q = lo | ((hb[4 * blk + m] >> (2 * i4)) & 3) << 4;
                        let s = scales + (i / 256) * 18 * rp;
                        let sub = i % 256 / 16;
                        let d = f16(bytes, s + 2 * o);
                        let sc = bytes[s + (1 + sub / 2) * 2 * rp + 2 * o + sub % 2] as i8;
                        d * sc as f32 * (q as i8 - 32) as f32
                    }
                    _ => {
                        let q = lo;
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
        // The f16 scales' byte offsets in a block: d (Q4_K also dmin).
        let f16_at: &[usize] = match ty {
            GgmlType::Q4_K | GgmlType::Q4_1 => &[0, 2],
            GgmlType::Q6_K => &[208],
            _ => &[0],
        };
        for b in out.chunks_exact_mut(bs) {
            for &at in f16_at {
                let v = half::f16::from_f32(0.001 + (next() % 1000) as f32 * 1e-5);
                b[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        out
    }

    fn round_trip(ty: GgmlType, rows: usize, cols: usize, tile: usize) {
        let cm = ChannelMajorLayout::new(ty, rows, cols).unwrap();
        round_trip_from(cm, tile);
    }

    /// `round_trip` from a channel-major layout of the given tiles.
    fn round_trip_from(cm: ChannelMajorLayout, tile: usize) {
        let (ty, rows, cols) = (cm.ty(), cm.rows(), cm.cols());
        let src = blocks(ty, rows, cols, (rows + cols + tile) as u64);
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
        // Q5_0 and Q6_K: rows a multiple of 128 (the CPU layout's blocks).
        for tile in [512, 1024, 2048] {
            round_trip(GgmlType::Q5_0, 1152, 96, tile);
            round_trip(GgmlType::Q6_K, 640, 512, tile);
        }
        round_trip(GgmlType::Q5_0, 2432, 64, 512);
        // Q4_1: rows a multiple of 64.
        for tile in [512, 1024, 2048] {
            round_trip(GgmlType::Q4_1, 1216, 96, tile);
        }
        round_trip(GgmlType::Q6_K, 2304, 256, 512);
        // GPU tiles across CPU tiles (of 384 outputs, the last shorter).
        for ty in TYPES {
            let cm = ChannelMajorLayout::with_tile(ty, 1280, 256, 384).unwrap();
            round_trip_from(cm, 512);
            round_trip_from(cm, 1024);
        }
    }

    /// The code of output `o`, channel `c` of ggml blocks `src` (`cols`
    /// channels a row) and its f16 d's bytes, with Q6_K's int8 scale.
    fn source_code(ty: GgmlType, src: &[u8], cols: usize, o: usize, c: usize) -> (u8, [u8; 2], u8) {
        let (bs, n) = (ty.type_size(), ty.block_size());
        let b = &src[(o * cols + c) / n * bs..][..bs];
        let e = c % n;
        if ty == GgmlType::Q5_0 {
            let h = u32::from_le_bytes([b[2], b[3], b[4], b[5]]) >> e & 1;
            let lo = if e < 16 {
                b[6 + e] & 15
            } else {
                b[6 + e - 16] >> 4
            };
            return (lo | (h as u8) << 4, [b[0], b[1]], 0);
        }
        // Q6_K: half h of 128, quarter k of 32, position p.
        let (h, k, p) = (e / 128, e % 128 / 32, e % 32);
        let ql = b[64 * h + p + 32 * (k % 2)];
        let lo = if k < 2 { ql & 15 } else { ql >> 4 };
        let hi = (b[128 + 32 * h + p] >> (2 * k)) & 3;
        (lo | hi << 4, [b[208], b[209]], b[192 + e / 16])
    }

    /// The byte positions of the specification, read for every weight of a
    /// one-tile matrix, independently of `dequantize`.
    #[test]
    fn codes_and_scales_sit_where_the_specification_puts_them() {
        let (rows, cols, rp) = (128, 256, 128);
        for ty in [GgmlType::Q5_0, GgmlType::Q6_K] {
            let src = blocks(ty, rows, cols, 7);
            let cm = ChannelMajorLayout::new(ty, rows, cols).unwrap();
            let mut cmb = vec![0u8; cm.bytes()];
            repack(&cm, &src, &mut cmb).unwrap();
            let (_, gpu) = from_channel_major(&cm, &cmb, 512).unwrap();
            let hrun = if ty == GgmlType::Q5_0 { rp / 8 } else { rp / 4 };
            let (highs, scales) = (cols * rp / 2, cols * (rp / 2 + hrun));
            for o in 0..rows {
                let (l, k) = (o / 16, o % 16);
                let (i, m) = (k / 4, k % 4);
                for c in 0..cols {
                    let (q, d, sc) = source_code(ty, &src, cols, o, c);
                    let lo = gpu[c * rp / 2 + 8 * l + k % 8] >> (4 * (k / 8)) & 15;
                    let (hi, d_at) = if ty == GgmlType::Q5_0 {
                        let at = highs + c * hrun + 2 * l;
                        let h = u16::from_le_bytes([gpu[at], gpu[at + 1]]);
                        (
                            (h >> (4 * m + i)) as u8 & 1,
                            scales + c / 32 * 2 * rp + 2 * o,
                        )
                    } else {
                        let s = scales + c / 256 * 18 * rp;
                        let j = c % 256 / 32;
                        let sc_at = s + 2 * rp + j * 2 * rp + 2 * o + c % 32 / 16;
                        assert_eq!(gpu[sc_at], sc, "{ty} output {o} channel {c}: scale");
                        (gpu[highs + c * hrun + 4 * l + m] >> (2 * i) & 3, s + 2 * o)
                    };
                    assert_eq!(lo | hi << 4, q, "{ty} output {o} channel {c}: code");
                    assert_eq!(gpu[d_at..d_at + 2], d, "{ty} output {o} channel {c}: d");
                }
            }
        }
    }

    #[test]
    fn other_types_and_shapes_are_refused_by_name() {
        let e = AspLayout::new(GgmlType::Q5_K, 256, 256, 512).unwrap_err();
        assert_eq!(e, AspLayoutError::Unsupported(GgmlType::Q5_K));
        assert!(e.to_string().contains("Q5_K"), "{e}");
        let e = AspLayout::new(GgmlType::Q5_1, 256, 256, 512).unwrap_err();
        assert_eq!(e, AspLayoutError::Unsupported(GgmlType::Q5_1));
        assert!(AspLayout::new(GgmlType::Q4_1, 256, 48, 512).is_err());
        assert!(AspLayout::new(GgmlType::Q4_1, 256, 96, 512).is_ok());
        assert!(AspLayout::new(GgmlType::Q4_K, 256, 96, 512).is_err());
        assert!(AspLayout::new(GgmlType::Q6_K, 256, 96, 512).is_err());
        assert!(AspLayout::new(GgmlType::Q6_K, 256, 288, 512).is_err());
        assert!(AspLayout::new(GgmlType::Q6_K, 256, 512, 512).is_ok());
        assert!(AspLayout::new(GgmlType::Q5_0, 256, 48, 512).is_err());
        assert!(AspLayout::new(GgmlType::Q5_0, 256, 96, 512).is_ok());
        assert!(AspLayout::new(GgmlType::Q8_0, 256, 96, 768).is_err());
        assert!(AspLayout::new(GgmlType::Q8_0, 0, 96, 512).is_err());
    }
}
