//! The channel-major layout of a quantized matrix: the same ggml blocks,
//! re-arranged so that the weights one *input channel* multiplies are
//! contiguous, and sparse matrix-vector kernels over a subset of input
//! channels (activation sparsity: the channels whose activation is too small
//! to matter are skipped, and their bytes are never read).
//!
//! A ggml matrix `W` (`rows` outputs x `cols` input channels) stores each
//! output row as blocks along the input dimension: every block holds the
//! integer codes of a run of input channels plus the scale(s) those codes
//! share. Those scales belong to one output row and one *group* of input
//! channels (32 channels for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K, 16 for
//! Q6_K; the K-quants add one header per output row and 256 channels). The
//! channel-major layout keeps every code and every scale bit for bit — the
//! repacked matrix is the source matrix, not a re-quantization of it — and
//! orders them as:
//!
//! ```text
//! for tile t (TILE outputs: the largest multiple of 128 — else 64, else 32 —
//!             up to MAX_TILE that divides `rows`)
//!   for super-block s (256 channels for K-quants, one group otherwise)
//!     [K-quants only] header: per output of the tile, d (and dmin) as f16
//!     for group g of s
//!       scales: per output of the tile, the group's scale record
//!       for channel i of g: the codes of W[t*TILE .. (t+1)*TILE, i]
//! ```
//!
//! Codes of one channel within a tile come in chunks of 32 outputs:
//! 16 bytes of nibbles (byte k: output k in the low nibble, output k + 16 in
//! the high one, as ggml's Q4_0), then for 5-bit types a `u32` of fifth bits
//! per chunk (bit k: output k) and for Q6_K a `u64` of the top two bits per
//! chunk (bits 2k, 2k+1: output k); Q8_0 codes are one signed byte each.
//! Scale records per output: Q4_0/Q5_0/Q8_0 `d` (f16); Q4_1/Q5_1 `d` then
//! `m` (f16 arrays of TILE each); Q4_K/Q5_K the 6-bit scale and min as two
//! `u8` arrays; Q6_K the `i8` scale. Bytes per weight equal the source's,
//! except Q4_K/Q5_K (+0.125 bit: their 6-bit scale/min pairs are stored a
//! byte each).
//!
//! With codes `q` (unsigned; signed for Q8_0) and per (output `j`, group `g`)
//! an affine map `w = a_jg * q + c_jg`, a sparse product over the active
//! channels `A` is, group by group,
//! `y_j += a_jg * (sum_{i in A_g} x_i q_ji) + c_jg * (sum_{i in A_g} x_i)`:
//! one float multiply-add per active weight plus one epilogue per group and
//! output. The `(a, c)` maps: Q4_0 `(d, -8d)`, Q5_0 `(d, -16d)`, Q8_0
//! `(d, 0)`, Q4_1/Q5_1 `(d, m)`, Q4_K/Q5_K `(d*sc, -dmin*m)`, Q6_K
//! `(d*sc, -32*d*sc)`.
//!
//! Kernels ([`TileKernel`]) compute one tile of outputs over a range of
//! groups, from an [`ActiveChannels`] list built once per input vector; the
//! caller spreads tiles (and, for matrices with few tiles, group ranges) over
//! threads. AVX-512 and AVX2 kernels are chosen at run time
//! ([`ChannelMajorKernel::best`]); the scalar kernel is the portable
//! fallback and the reference they are tested against.

#![allow(clippy::needless_range_loop)]

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

use std::ops::Range;

use super::util::f16_at;
use super::QuantError;
use crate::types::GgmlType;

/// Outputs per code chunk (the nibble interleave unit).
pub const CHUNK: usize = 32;

/// Most outputs of a tile.
pub const MAX_TILE: usize = 1024;

/// How a source type's blocks map to the channel-major layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Scheme {
    /// Input channels sharing one scale record per output.
    group: usize,
    /// Input channels sharing one header per output (= `group` without one).
    superblock: usize,
    /// Bits per code.
    bits: usize,
    /// Bytes of one scale record per output.
    rec: usize,
    /// Bytes of one super-block header per output (0: none).
    hdr: usize,
}

fn scheme(ty: GgmlType) -> Option<Scheme> {
    use GgmlType::*;
    let s = |group, superblock, bits, rec, hdr| Scheme {
        group,
        superblock,
        bits,
        rec,
        hdr,
    };
    Some(match ty {
        Q4_0 => s(32, 32, 4, 2, 0),
        Q4_1 => s(32, 32, 4, 4, 0),
        Q5_0 => s(32, 32, 5, 2, 0),
        Q5_1 => s(32, 32, 5, 4, 0),
        Q8_0 => s(32, 32, 8, 2, 0),
        Q4_K => s(32, 256, 4, 2, 4),
        Q5_K => s(32, 256, 5, 2, 4),
        Q6_K => s(16, 256, 6, 1, 2),
        _ => return None,
    })
}

/// Whether [`ChannelMajorLayout`] supports matrices of type `ty`.
pub fn supports(ty: GgmlType) -> bool {
    scheme(ty).is_some()
}

/// Shape and byte layout of one channel-major matrix (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelMajorLayout {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    tile: usize,
    s: Scheme,
}

impl ChannelMajorLayout {
    /// The layout of a `rows` x `cols` matrix of type `ty` (ggml dims
    /// `[cols, rows]`). Refuses types without a channel-major form (the
    /// float types, Q2_K, Q3_K), `cols` that is not a whole number of
    /// blocks and `rows` that is not a multiple of [`CHUNK`].
    pub fn new(ty: GgmlType, rows: usize, cols: usize) -> Result<ChannelMajorLayout, QuantError> {
        let s = scheme(ty).ok_or(QuantError::UnsupportedType {
            ty,
            op: "channel-major layout",
        })?;
        if cols == 0 || cols % s.superblock != 0 {
            return Err(QuantError::NotBlockMultiple {
                ty,
                n: cols,
                block_size: s.superblock,
            });
        }
        let unit = [128, 64, 32]
            .into_iter()
            .find(|t| rows % t == 0 && rows > 0)
            .ok_or(QuantError::NotBlockMultiple {
                ty,
                n: rows,
                block_size: CHUNK,
            })?;
        // The fewest tiles of at most MAX_TILE outputs: a channel's codes in
        // a tile are one contiguous run, and a skipped channel skips the
        // whole run (runs of a single cache line are fetched anyway by the
        // hardware prefetchers when their neighbours are read).
        let units = rows / unit;
        let per_tile = (1..=units)
            .rev()
            .find(|&k| units % k == 0 && k * unit <= MAX_TILE)
            .unwrap_or(1);
        let tile = per_tile * unit;
        Ok(ChannelMajorLayout {
            ty,
            rows,
            cols,
            tile,
            s,
        })
    }

    /// The source type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    /// Outputs.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Input channels.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Outputs per tile.
    pub fn tile(&self) -> usize {
        self.tile
    }
    /// Tiles (`rows / tile`).
    pub fn n_tiles(&self) -> usize {
        self.rows / self.tile
    }
    /// Input channels per scale group.
    pub fn group(&self) -> usize {
        self.s.group
    }
    /// Scale groups (`cols / group`).
    pub fn n_groups(&self) -> usize {
        self.cols / self.s.group
    }
    /// Input channels per super-block (header) — equals [`Self::group`]
    /// for types without a header.
    pub fn superblock(&self) -> usize {
        self.s.superblock
    }
    /// Bits per code.
    pub fn bits(&self) -> usize {
        self.s.bits
    }
    /// Bytes of one channel's codes in one tile.
    pub fn channel_bytes(&self) -> usize {
        self.tile * self.s.bits / 8
    }
    /// Bytes of one group's scale records in one tile.
    pub fn record_bytes(&self) -> usize {
        self.tile * self.s.rec
    }
    /// Bytes of one super-block header in one tile (0: none).
    pub fn header_bytes(&self) -> usize {
        self.tile * self.s.hdr
    }
    fn group_bytes(&self) -> usize {
        self.record_bytes() + self.s.group * self.channel_bytes()
    }
    fn groups_per_superblock(&self) -> usize {
        self.s.superblock / self.s.group
    }
    fn superblock_bytes(&self) -> usize {
        self.header_bytes() + self.groups_per_superblock() * self.group_bytes()
    }
    /// Bytes of one tile.
    pub fn tile_bytes(&self) -> usize {
        self.cols / self.s.superblock * self.superblock_bytes()
    }
    /// Bytes of the whole matrix.
    pub fn bytes(&self) -> usize {
        self.n_tiles() * self.tile_bytes()
    }
    /// Offset of the header of super-block `sb` in tile `t`.
    pub fn header_offset(&self, t: usize, sb: usize) -> usize {
        t * self.tile_bytes() + sb * self.superblock_bytes()
    }
    /// Offset of the scale records of group `g` in tile `t`.
    pub fn record_offset(&self, t: usize, g: usize) -> usize {
        let gps = self.groups_per_superblock();
        self.header_offset(t, g / gps) + self.header_bytes() + (g % gps) * self.group_bytes()
    }
    /// Offset of the codes of channel `i` in tile `t`.
    pub fn channel_offset(&self, t: usize, i: usize) -> usize {
        let g = i / self.s.group;
        self.record_offset(t, g) + self.record_bytes() + (i % self.s.group) * self.channel_bytes()
    }

    /// Bytes a product over `active` reads: the codes of every active
    /// channel, the scale records of every group with an active channel and
    /// the headers of every super-block with one, in every tile.
    pub fn bytes_read(&self, active: &ActiveChannels) -> usize {
        let gps = self.groups_per_superblock();
        let (mut groups, mut sbs) = (0usize, 0usize);
        for sb in 0..self.cols / self.s.superblock {
            let mut any = false;
            for g in sb * gps..(sb + 1) * gps {
                if !active.group(g).is_empty() {
                    groups += 1;
                    any = true;
                }
            }
            sbs += any as usize;
        }
        self.n_tiles()
            * (active.len() * self.channel_bytes()
                + groups * self.record_bytes()
                + sbs * self.header_bytes())
    }
}

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
                    let (sc, m) = super::kquants::scale_min_k4(sub, &b[4..16]);
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

/// Writes code `q` of output position `p` (within the tile) into a channel's
/// code bytes.
#[inline]
fn put_code(bits: usize, tile: usize, chan: &mut [u8], p: usize, q: u8) {
    let (chunk, k) = (p / CHUNK, p % CHUNK);
    if bits == 8 {
        chan[p] = q;
        return;
    }
    let byte = chunk * 16 + k % 16;
    chan[byte] |= (q & 0xf) << (4 * (k / 16));
    let hi_at = tile / 2;
    match bits {
        5 => chan[hi_at + chunk * 4 + k / 8] |= ((q >> 4) & 1) << (k % 8),
        6 => chan[hi_at + chunk * 8 + k / 4] |= ((q >> 4) & 3) << (2 * (k % 4)),
        _ => {}
    }
}

/// Reads code `p` of a channel's code bytes (inverse of [`put_code`]).
#[inline]
fn get_code(bits: usize, tile: usize, chan: &[u8], p: usize) -> u8 {
    let (chunk, k) = (p / CHUNK, p % CHUNK);
    if bits == 8 {
        return chan[p];
    }
    let mut q = (chan[chunk * 16 + k % 16] >> (4 * (k / 16))) & 0xf;
    let hi_at = tile / 2;
    match bits {
        5 => q |= ((chan[hi_at + chunk * 4 + k / 8] >> (k % 8)) & 1) << 4,
        6 => q |= ((chan[hi_at + chunk * 8 + k / 4] >> (2 * (k % 4))) & 3) << 4,
        _ => {}
    }
    q
}

/// Repacks a ggml row-major matrix (`src`: `rows` rows of `cols` elements
/// of `layout.ty()`) into the channel-major layout (`dst`: exactly
/// [`ChannelMajorLayout::bytes`]).
pub fn repack(layout: &ChannelMajorLayout, src: &[u8], dst: &mut [u8]) -> Result<(), QuantError> {
    let ty = layout.ty;
    let row_bytes = super::row_bytes(ty, layout.cols)?;
    super::check_len(ty, "src bytes", row_bytes * layout.rows, src.len())?;
    super::check_len(ty, "dst bytes", layout.bytes(), dst.len())?;
    dst.fill(0);
    let (s, tile) = (layout.s, layout.tile);
    let cb = layout.channel_bytes();
    for j in 0..layout.rows {
        let parts = split_row(
            ty,
            &s,
            &src[j * row_bytes..(j + 1) * row_bytes],
            layout.cols,
        );
        let (t, p) = (j / tile, j % tile);
        for (sb, h) in parts.hdrs.iter().enumerate() {
            let at = layout.header_offset(t, sb);
            let hb = &mut dst[at..at + layout.header_bytes()];
            hb[2 * p..2 * p + 2].copy_from_slice(&h[..2]);
            if s.hdr == 4 {
                hb[2 * tile + 2 * p..2 * tile + 2 * p + 2].copy_from_slice(&h[2..4]);
            }
        }
        for (g, r) in parts.recs.iter().enumerate() {
            let at = layout.record_offset(t, g);
            let rb = &mut dst[at..at + layout.record_bytes()];
            match (ty, s.rec) {
                (GgmlType::Q4_K | GgmlType::Q5_K, _) => {
                    rb[p] = r[0];
                    rb[tile + p] = r[1];
                }
                (_, 1) => rb[p] = r[0],
                (_, 2) => rb[2 * p..2 * p + 2].copy_from_slice(&r[..2]),
                _ => {
                    rb[2 * p..2 * p + 2].copy_from_slice(&r[..2]);
                    rb[2 * tile + 2 * p..2 * tile + 2 * p + 2].copy_from_slice(&r[2..4]);
                }
            }
        }
        for (i, &q) in parts.codes.iter().enumerate() {
            let at = layout.channel_offset(t, i);
            put_code(s.bits, tile, &mut dst[at..at + cb], p, q);
        }
    }
    Ok(())
}

/// The `(a, c)` map of output position `p` of tile `t` and group `g`
/// (`w = a * q + c`; for the K-quants `a = d * sc` and `c = -(dmin * m)`,
/// the products ggml's dequantizer forms).
fn affine(layout: &ChannelMajorLayout, data: &[u8], t: usize, g: usize, p: usize) -> (f32, f32) {
    use GgmlType::*;
    let tile = layout.tile;
    let rec = &data[layout.record_offset(t, g)..][..layout.record_bytes()];
    let hdr = || {
        let sb = g * layout.s.group / layout.s.superblock;
        &data[layout.header_offset(t, sb)..][..layout.header_bytes()]
    };
    match layout.ty {
        Q4_0 => {
            let d = f16_at(rec, 2 * p);
            (d, -8.0 * d)
        }
        Q5_0 => {
            let d = f16_at(rec, 2 * p);
            (d, -16.0 * d)
        }
        Q8_0 => (f16_at(rec, 2 * p), 0.0),
        Q4_1 | Q5_1 => (f16_at(rec, 2 * p), f16_at(rec, 2 * tile + 2 * p)),
        Q4_K | Q5_K => {
            let h = hdr();
            let (d, dmin) = (f16_at(h, 2 * p), f16_at(h, 2 * tile + 2 * p));
            (d * rec[p] as f32, -(dmin * rec[tile + p] as f32))
        }
        Q6_K => {
            let a = f16_at(hdr(), 2 * p) * rec[p] as i8 as f32;
            (a, -32.0 * a)
        }
        _ => (f32::NAN, f32::NAN),
    }
}

/// Dequantizes a channel-major matrix back to row-major f32 (`dst`:
/// `rows * cols`), with ggml's own float expression per type, so the result
/// is bit-identical to [`super::dequantize`] of the source rows: the proof
/// that [`repack`] keeps every code and scale.
pub fn dequantize(
    layout: &ChannelMajorLayout,
    data: &[u8],
    dst: &mut [f32],
) -> Result<(), QuantError> {
    use GgmlType::*;
    let ty = layout.ty;
    super::check_len(ty, "channel-major bytes", layout.bytes(), data.len())?;
    super::check_len(ty, "dst floats", layout.rows * layout.cols, dst.len())?;
    let (tile, bits, cb) = (layout.tile, layout.s.bits, layout.channel_bytes());
    for t in 0..layout.n_tiles() {
        for g in 0..layout.n_groups() {
            let rec = &data[layout.record_offset(t, g)..][..layout.record_bytes()];
            let sb = g * layout.s.group / layout.s.superblock;
            let hdr = &data[layout.header_offset(t, sb)..][..layout.header_bytes()];
            for i in g * layout.s.group..(g + 1) * layout.s.group {
                let chan = &data[layout.channel_offset(t, i)..][..cb];
                for p in 0..tile {
                    let q = get_code(bits, tile, chan, p);
                    let v = match ty {
                        Q4_0 => (q as i32 - 8) as f32 * f16_at(rec, 2 * p),
                        Q5_0 => (q as i32 - 16) as f32 * f16_at(rec, 2 * p),
                        Q8_0 => q as i8 as f32 * f16_at(rec, 2 * p),
                        Q4_1 | Q5_1 => {
                            q as f32 * f16_at(rec, 2 * p) + f16_at(rec, 2 * tile + 2 * p)
                        }
                        Q4_K | Q5_K => {
                            let d1 = f16_at(hdr, 2 * p) * rec[p] as f32;
                            let m1 = f16_at(hdr, 2 * tile + 2 * p) * rec[tile + p] as f32;
                            d1 * q as f32 - m1
                        }
                        Q6_K => f16_at(hdr, 2 * p) * rec[p] as i8 as f32 * (q as i8 - 32) as f32,
                        _ => f32::NAN,
                    };
                    dst[(t * tile + p) * layout.cols + i] = v;
                }
            }
        }
    }
    Ok(())
}

/// The active input channels of one input vector, grouped by scale group:
/// channel ids ascending, their activations, and per group the range of
/// the list it owns and the sum of its activations. Built once per input
/// vector and matrix shape, read by every tile.
#[derive(Debug, Clone, Default)]
pub struct ActiveChannels {
    group: usize,
    idx: Vec<u32>,
    vals: Vec<f32>,
    starts: Vec<u32>,
    sums: Vec<f32>,
}

impl ActiveChannels {
    /// Rebuilds the list from `x` (one input vector) keeping channel `i`
    /// when `keep(i, x_i)`; `group` is the layout's [`ChannelMajorLayout::group`].
    /// The allocations are reused.
    pub fn fill(&mut self, x: &[f32], group: usize, mut keep: impl FnMut(usize, f32) -> bool) {
        let group = group.max(1);
        self.group = group;
        self.idx.clear();
        self.vals.clear();
        self.starts.clear();
        self.sums.clear();
        for (g, xs) in x.chunks(group).enumerate() {
            self.starts.push(self.idx.len() as u32);
            let mut sum = 0f32;
            for (k, &v) in xs.iter().enumerate() {
                let i = g * group + k;
                if keep(i, v) {
                    self.idx.push(i as u32);
                    self.vals.push(v);
                    sum += v;
                }
            }
            self.sums.push(sum);
        }
        self.starts.push(self.idx.len() as u32);
    }

    /// Every channel of `x` active.
    pub fn all(x: &[f32], group: usize) -> ActiveChannels {
        let mut a = ActiveChannels::default();
        a.fill(x, group, |_, _| true);
        a
    }

    /// Active channels.
    pub fn len(&self) -> usize {
        self.idx.len()
    }
    /// Whether no channel is active.
    pub fn is_empty(&self) -> bool {
        self.idx.is_empty()
    }
    /// Input channels the list was built over.
    pub fn n_groups(&self) -> usize {
        self.sums.len()
    }
    /// The channel ids of group `g`.
    pub fn group(&self, g: usize) -> &[u32] {
        &self.idx[self.starts[g] as usize..self.starts[g + 1] as usize]
    }
    /// The channel ids, ascending.
    pub fn channels(&self) -> &[u32] {
        &self.idx
    }
    fn range(&self, g: usize) -> Range<usize> {
        self.starts[g] as usize..self.starts[g + 1] as usize
    }
}

/// An unchecked tile kernel: `y = sum over groups in `groups` of the
/// active channels' contributions to the outputs of tile `t`` (`y` holds
/// [`ChannelMajorLayout::tile`] floats and is overwritten).
///
/// # Safety
/// `data` holds [`ChannelMajorLayout::bytes`] bytes of `layout`; `t <
/// n_tiles`, `groups` lies within `0..n_groups`; `active` was built with
/// `layout.group()` over `cols` channels; `y.len() == layout.tile()`. The
/// CPU features the kernel needs are guaranteed by
/// [`ChannelMajorKernel::kernel`].
pub type TileKernel = unsafe fn(
    layout: &ChannelMajorLayout,
    data: &[u8],
    t: usize,
    groups: Range<usize>,
    active: &ActiveChannels,
    y: &mut [f32],
);

/// The kernel families, fastest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChannelMajorKernel {
    /// AVX-512F/BW (x86_64).
    Avx512,
    /// AVX2 + FMA + F16C (x86_64).
    Avx2,
    /// Portable scalar code (the reference).
    Scalar,
}

impl ChannelMajorKernel {
    /// The fastest family this CPU runs.
    pub fn best() -> ChannelMajorKernel {
        #[cfg(target_arch = "x86_64")]
        {
            if avx512::available() {
                return ChannelMajorKernel::Avx512;
            }
            if avx2::available() {
                return ChannelMajorKernel::Avx2;
            }
        }
        ChannelMajorKernel::Scalar
    }

    /// Every family this CPU runs (for tests and benchmarks).
    pub fn available() -> Vec<ChannelMajorKernel> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if avx512::available() {
                v.push(ChannelMajorKernel::Avx512);
            }
            if avx2::available() {
                v.push(ChannelMajorKernel::Avx2);
            }
        }
        v.push(ChannelMajorKernel::Scalar);
        v
    }

    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            ChannelMajorKernel::Avx512 => "avx512",
            ChannelMajorKernel::Avx2 => "avx2",
            ChannelMajorKernel::Scalar => "scalar",
        }
    }

    /// The tile kernel of this family for `ty`; `None` when this CPU lacks
    /// the family's features or the type has no channel-major form.
    pub fn kernel(self, ty: GgmlType) -> Option<TileKernel> {
        scheme(ty)?;
        match self {
            ChannelMajorKernel::Scalar => Some(scalar_tile),
            #[cfg(target_arch = "x86_64")]
            ChannelMajorKernel::Avx512 if avx512::available() => avx512::kernel(ty),
            #[cfg(target_arch = "x86_64")]
            ChannelMajorKernel::Avx2 if avx2::available() => avx2::kernel(ty),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
}

/// Checks a tile call's arguments (for the checked entry point and tests).
fn check_tile(
    layout: &ChannelMajorLayout,
    data: &[u8],
    t: usize,
    groups: &Range<usize>,
    active: &ActiveChannels,
    y: &[f32],
) -> Result<(), QuantError> {
    let ty = layout.ty;
    super::check_len(ty, "channel-major bytes", layout.bytes(), data.len())?;
    super::check_len(ty, "tile outputs", layout.tile, y.len())?;
    super::check_len(ty, "active groups", layout.n_groups(), active.n_groups())?;
    super::check_len(ty, "active group size", layout.s.group, active.group)?;
    if t >= layout.n_tiles() || groups.end > layout.n_groups() || groups.start > groups.end {
        return Err(QuantError::LengthMismatch {
            ty,
            what: "tile / group range",
            expected: layout.n_tiles(),
            got: t,
        });
    }
    Ok(())
}

/// [`TileKernel`] of `family` with every argument checked.
pub fn tile_checked(
    family: ChannelMajorKernel,
    layout: &ChannelMajorLayout,
    data: &[u8],
    t: usize,
    groups: Range<usize>,
    active: &ActiveChannels,
    y: &mut [f32],
) -> Result<(), QuantError> {
    check_tile(layout, data, t, &groups, active, y)?;
    let k = family
        .kernel(layout.ty)
        .ok_or(QuantError::UnsupportedType {
            ty: layout.ty,
            op: "channel-major kernel on this CPU",
        })?;
    // SAFETY: arguments checked above; `kernel` only hands out kernels this
    // CPU runs.
    unsafe { k(layout, data, t, groups, active, y) };
    Ok(())
}

/// The portable kernel (see [`TileKernel`]).
///
/// # Safety
/// [`TileKernel`]'s contract (it only indexes checked slices, so a broken
/// contract panics instead of reading out of bounds).
unsafe fn scalar_tile(
    layout: &ChannelMajorLayout,
    data: &[u8],
    t: usize,
    groups: Range<usize>,
    active: &ActiveChannels,
    y: &mut [f32],
) {
    let (tile, bits, cb) = (layout.tile, layout.s.bits, layout.channel_bytes());
    y.fill(0.0);
    let mut acc = vec![0f32; tile];
    let signed = layout.ty == GgmlType::Q8_0;
    for g in groups {
        let r = active.range(g);
        if r.is_empty() {
            continue;
        }
        acc.fill(0.0);
        for k in r {
            let i = active.idx[k] as usize;
            let xv = active.vals[k];
            let chan = &data[layout.channel_offset(t, i)..][..cb];
            for (p, a) in acc.iter_mut().enumerate() {
                let q = get_code(bits, tile, chan, p);
                let q = if signed { q as i8 as f32 } else { q as f32 };
                *a += xv * q;
            }
        }
        let sum = active.sums[g];
        for p in 0..tile {
            let (a, c) = affine(layout, data, t, g, p);
            y[p] += a * acc[p] + c * sum;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

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
        let rb = super::super::row_bytes(ty, cols).unwrap();
        let mut out = vec![0u8; rb * rows];
        super::super::quantize(ty, &values(seed, rows * cols), &mut out).unwrap();
        out
    }

    /// Repacking keeps every code and scale: dequantizing the channel-major
    /// form gives the source's dequantization bit for bit.
    #[test]
    fn repack_is_lossless_for_every_type() {
        for ty in TYPES {
            for (rows, cols) in [(64usize, 256usize), (192, 512), (128, 768)] {
                let src = random_matrix(ty, rows, cols, rows as u64 + cols as u64);
                let layout = ChannelMajorLayout::new(ty, rows, cols).unwrap();
                let mut cm = vec![0u8; layout.bytes()];
                repack(&layout, &src, &mut cm).unwrap();
                let mut want = vec![0f32; rows * cols];
                super::super::dequantize(ty, &src, &mut want).unwrap();
                let mut got = vec![0f32; rows * cols];
                dequantize(&layout, &cm, &mut got).unwrap();
                for (k, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(a.to_bits(), b.to_bits(), "{ty} {rows}x{cols} element {k}");
                }
                let size = super::super::row_bytes(ty, cols).unwrap() * rows;
                let extra = layout.bytes() as f64 / size as f64;
                assert!(extra <= 1.03, "{ty}: {extra}x the source bytes");
            }
        }
    }

    #[test]
    fn unsupported_shapes_and_types_are_refused() {
        assert!(ChannelMajorLayout::new(GgmlType::F16, 64, 64).is_err());
        assert!(ChannelMajorLayout::new(GgmlType::Q2_K, 64, 256).is_err());
        assert!(ChannelMajorLayout::new(GgmlType::Q4_K, 64, 128).is_err());
        assert!(ChannelMajorLayout::new(GgmlType::Q8_0, 48, 64).is_err());
        assert!(ChannelMajorLayout::new(GgmlType::Q8_0, 0, 64).is_err());
    }
}

#[cfg(test)]
mod kernel_tests {
    use super::*;

    fn lcg(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Every kernel family equals the f64 product of the dequantized source
    /// matrix with the masked input, on random matrices of every type, at
    /// several sparsities, over whole and split group ranges.
    #[test]
    fn kernels_equal_the_dense_reference_on_random_weights() {
        let types = [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
        ];
        for ty in types {
            for (rows, cols) in [
                (128usize, 512usize),
                (64, 256),
                (96, 256),
                (768, 256),
                (1280, 256),
            ] {
                let rb = super::super::row_bytes(ty, cols).unwrap();
                let mut src = vec![0u8; rb * rows];
                super::super::quantize(ty, &lcg(7 + rows as u64, rows * cols), &mut src).unwrap();
                let mut w = vec![0f32; rows * cols];
                super::super::dequantize(ty, &src, &mut w).unwrap();
                let layout = ChannelMajorLayout::new(ty, rows, cols).unwrap();
                let mut cm = vec![0u8; layout.bytes()];
                repack(&layout, &src, &mut cm).unwrap();
                let x = lcg(99, cols);
                for keep_share in [1.0f32, 0.5, 0.1, 0.0] {
                    let mut act = ActiveChannels::default();
                    act.fill(&x, layout.group(), |i, _| {
                        ((i * 2654435761) % 1000) as f32 / 1000.0 < keep_share
                    });
                    let want: Vec<f64> = (0..rows)
                        .map(|j| {
                            act.channels()
                                .iter()
                                .map(|&i| w[j * cols + i as usize] as f64 * x[i as usize] as f64)
                                .sum()
                        })
                        .collect();
                    let scale = want.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
                    for fam in ChannelMajorKernel::available() {
                        let mut y = vec![0f32; rows];
                        let tile = layout.tile();
                        let ng = layout.n_groups();
                        for t in 0..layout.n_tiles() {
                            // Two group ranges summed: the split-K path.
                            let mid = ng / 2;
                            let (mut a, mut b) = (vec![0f32; tile], vec![0f32; tile]);
                            tile_checked(fam, &layout, &cm, t, 0..mid, &act, &mut a).unwrap();
                            tile_checked(fam, &layout, &cm, t, mid..ng, &act, &mut b).unwrap();
                            for p in 0..tile {
                                y[t * tile + p] = a[p] + b[p];
                            }
                        }
                        for j in 0..rows {
                            let e = (y[j] as f64 - want[j]).abs() / scale;
                            assert!(
                                e < 1e-5,
                                "{ty} {rows}x{cols} keep {keep_share} {}: out {j} {} vs {} (rel {e})",
                                fam.name(),
                                y[j],
                                want[j]
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn bytes_read_counts_active_channels_groups_and_headers() {
        let layout = ChannelMajorLayout::new(GgmlType::Q4_K, 128, 512).unwrap();
        let x = vec![1f32; 512];
        let all = ActiveChannels::all(&x, layout.group());
        assert_eq!(layout.bytes_read(&all), layout.bytes());
        let mut one = ActiveChannels::default();
        one.fill(&x, layout.group(), |i, _| i == 300);
        assert_eq!(
            layout.bytes_read(&one),
            64 + 2 * 128 + 4 * 128,
            "one channel: its codes, its group's scales, its super-block's header"
        );
        let none = {
            let mut a = ActiveChannels::default();
            a.fill(&x, layout.group(), |_, _| false);
            a
        };
        assert_eq!(layout.bytes_read(&none), 0);
    }
}
