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
//! for tile t (outputs t*T .. min((t+1)*T, rows); T a multiple of 128)
//!   for super-block s (256 channels for K-quants, one group otherwise)
//!     [K-quants only] header: per output of the tile, d (and dmin) as f16
//!     for group g of s
//!       scales: per output of the tile, the group's scale record
//!       for channel i of g: its run, the codes of W[tile outputs, i]
//! ```
//!
//! A channel's run holds the codes of the tile's R outputs: a base plane of
//! the low 4 bits (R/2 bytes; Q8_0: the 8-bit code + 128, R bytes), then for
//! 5- and 6-bit types a plane of the high bits (R/8 or R/4 bytes). Within a
//! block of 128 outputs (a tile's last block may hold 64 for Q4_0, Q4_1 and
//! Q8_0), codes are placed so that the AVX-512 kernel's in-register 4x4
//! byte transpose ([`code_position`]) yields 16 consecutive outputs per
//! vector: base byte `16L + 4q + m` holds output `16q + 4L + m` in its low
//! nibble and output `64 + 16q + 4L + m` in its high one. Scale records per
//! output: Q4_0/Q5_0/Q8_0 `d` (f16); Q4_1/Q5_1 `d` then `m` (f16 arrays of R
//! each); Q4_K/Q5_K the 6-bit scale and min as two `u8` arrays; Q6_K the `i8`
//! scale. Bytes per weight equal the source's, except Q4_K/Q5_K (+0.125 bit:
//! their 6-bit scale/min pairs are stored a byte each).
//!
//! **Arithmetic.** The active inputs of each group are quantized to int8
//! with one scale per group (`x_i ~ dx_g * xq_i`, `dx_g = max |x_i| / 127`
//! over the group's active channels). With codes `q` (unsigned) and per
//! (output `j`, group `g`) an affine map `w = a_jg * q + c_jg`, the product
//! over the active channels `A` is, group by group, exactly in integers
//! `acc_jg = sum_{i in A_g} xq_i q_ji`, then once per (output, group)
//! `y_j += dx_g * (a_jg * acc_jg + c_jg * S_g)` with `S_g = sum_{i in A_g}
//! xq_i`. The `(a, c)` maps: Q4_0 `(d, -8d)`, Q5_0 `(d, -16d)`, Q8_0
//! `(d, -128d)` (its codes are stored + 128), Q4_1/Q5_1 `(d, m)`,
//! Q4_K/Q5_K `(d*sc, -dmin*m)`, Q6_K `(d*sc, -32*d*sc)`. This is the dense
//! path's integer dot product (weights times int8 activations), at the grain
//! of single input channels: every active channel costs its run's bytes and
//! a quarter of a `vpdpbusd` per 16 outputs.
//!
//! Kernels ([`TileKernel`]) compute one tile of outputs over a range of
//! groups, from an [`ActiveChannels`] list built once per input vector; the
//! caller spreads tiles (and, for matrices with few tiles, group ranges) over
//! threads. The AVX-512 VNNI kernel is chosen at run time
//! ([`ChannelMajorKernel::best`]); the scalar kernel, with the same integer
//! arithmetic, is the portable fallback and the reference it is tested
//! against.

#![allow(clippy::needless_range_loop)]

#[cfg(target_arch = "x86_64")]
mod avx512;

use std::ops::Range;

use super::util::f16_at;
use super::QuantError;
use crate::types::GgmlType;

/// Outputs per code block (the unit of the in-register transpose).
pub const BLOCK: usize = 128;

/// Most outputs of a tile: a channel's run in a tile is one contiguous span
/// of bytes (1 KiB for 4-bit codes), long enough that skipping it skips the
/// lines the hardware prefetchers would otherwise fetch.
pub const MAX_TILE: usize = 2048;

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

/// The default tile of a matrix of `rows` outputs: the fewest tiles of at
/// most [`MAX_TILE`] outputs, of equal size rounded up to [`BLOCK`].
pub fn default_tile(rows: usize) -> usize {
    let n = rows.div_ceil(MAX_TILE).max(1);
    rows.div_ceil(n).next_multiple_of(BLOCK).min(MAX_TILE)
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
    /// `[cols, rows]`) with the [`default_tile`].
    pub fn new(ty: GgmlType, rows: usize, cols: usize) -> Result<ChannelMajorLayout, QuantError> {
        ChannelMajorLayout::with_tile(ty, rows, cols, default_tile(rows))
    }

    /// The layout with tiles of `tile` outputs (a multiple of [`BLOCK`] up
    /// to [`MAX_TILE`]). Refuses types without a channel-major form (the
    /// float types, Q2_K, Q3_K), `cols` that is not a whole number of
    /// blocks, and `rows` that is not a multiple of 128 (of 64 for Q4_0,
    /// Q4_1 and Q8_0, whose last block may hold 64 outputs).
    pub fn with_tile(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        tile: usize,
    ) -> Result<ChannelMajorLayout, QuantError> {
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
        // A last block of 64 outputs: only types without high-bit planes
        // or headers (the kernels' half-width path).
        let row_unit = if matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0) {
            64
        } else {
            BLOCK
        };
        if rows == 0 || rows % row_unit != 0 {
            return Err(QuantError::NotBlockMultiple {
                ty,
                n: rows,
                block_size: row_unit,
            });
        }
        if tile == 0 || tile % BLOCK != 0 || tile > MAX_TILE {
            return Err(QuantError::NotBlockMultiple {
                ty,
                n: tile,
                block_size: BLOCK,
            });
        }
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
    /// Outputs per (full) tile.
    pub fn tile(&self) -> usize {
        self.tile
    }
    /// Tiles (`ceil(rows / tile)`).
    pub fn n_tiles(&self) -> usize {
        self.rows.div_ceil(self.tile)
    }
    /// Outputs of tile `t` (the last one may hold fewer).
    pub fn tile_rows(&self, t: usize) -> usize {
        self.tile.min(self.rows - t * self.tile)
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
    /// Bytes of one channel's run in a tile of `r` outputs.
    pub fn run_bytes(&self, r: usize) -> usize {
        r * self.s.bits / 8
    }
    /// Bytes of one group's scale records in a tile of `r` outputs.
    pub fn record_bytes(&self, r: usize) -> usize {
        r * self.s.rec
    }
    /// Bytes of one super-block header in a tile of `r` outputs (0: none).
    pub fn header_bytes(&self, r: usize) -> usize {
        r * self.s.hdr
    }
    fn group_bytes(&self, r: usize) -> usize {
        self.record_bytes(r) + self.s.group * self.run_bytes(r)
    }
    /// Groups per super-block.
    pub fn groups_per_superblock(&self) -> usize {
        self.s.superblock / self.s.group
    }
    fn superblock_bytes(&self, r: usize) -> usize {
        self.header_bytes(r) + self.groups_per_superblock() * self.group_bytes(r)
    }
    fn tile_bytes(&self, r: usize) -> usize {
        self.cols / self.s.superblock * self.superblock_bytes(r)
    }
    /// Bytes of the whole matrix.
    pub fn bytes(&self) -> usize {
        (0..self.n_tiles())
            .map(|t| self.tile_bytes(self.tile_rows(t)))
            .sum()
    }
    /// Offset of tile `t`.
    pub fn tile_offset(&self, t: usize) -> usize {
        t * self.tile_bytes(self.tile)
    }
    /// Offset of the header of super-block `sb` in tile `t`.
    pub fn header_offset(&self, t: usize, sb: usize) -> usize {
        self.tile_offset(t) + sb * self.superblock_bytes(self.tile_rows(t))
    }
    /// Offset of the scale records of group `g` in tile `t`.
    pub fn record_offset(&self, t: usize, g: usize) -> usize {
        let gps = self.groups_per_superblock();
        let r = self.tile_rows(t);
        self.header_offset(t, g / gps) + self.header_bytes(r) + (g % gps) * self.group_bytes(r)
    }
    /// Offset of the run of channel `i` in tile `t`.
    pub fn channel_offset(&self, t: usize, i: usize) -> usize {
        let g = i / self.s.group;
        let r = self.tile_rows(t);
        self.record_offset(t, g) + self.record_bytes(r) + (i % self.s.group) * self.run_bytes(r)
    }

    /// Bytes a product over `active` reads: the runs of every active
    /// channel, the scale records of every group with an active channel and
    /// the headers of every super-block with one, in every tile.
    pub fn bytes_read(&self, active: &ActiveChannels) -> usize {
        let gps = self.groups_per_superblock();
        let (mut groups, mut sbs) = (0usize, 0usize);
        for sb in 0..self.cols / self.s.superblock {
            let mut any = false;
            for g in sb * gps..(sb + 1) * gps {
                if active.group_len(g) > 0 {
                    groups += 1;
                    any = true;
                }
            }
            sbs += any as usize;
        }
        self.rows * active.len() * self.s.bits / 8
            + self.rows * (groups * self.s.rec + sbs * self.s.hdr)
    }
}

/// Where the code of output `o` of a tile of `r` outputs lies in a
/// channel's run: `(byte, shift)` of its low 4 bits (8-bit types: the whole
/// code, shift 0), and for 5- and 6-bit types `(byte, shift)` of its high
/// bits. See the module doc; the AVX-512 kernel's transpose depends on it.
pub fn code_position(bits: usize, r: usize, o: usize) -> ((usize, u32), Option<(usize, u32)>) {
    let (b, ob) = (o / BLOCK, o % BLOCK);
    // A tile's last block holds 64 outputs when `r` is an odd multiple of 64.
    let w = BLOCK.min(r - b * BLOCK);
    let nl = w / 32; // 128-bit lanes of the block's transpose
    let half = w / 2;
    let (z, o2) = (ob / half, ob % half);
    let (q, l, m) = (o2 / (4 * nl), (o2 % (4 * nl)) / 4, o2 % 4);
    let k = 16 * l + 4 * q + m;
    if bits == 8 {
        return ((b * BLOCK + z * half + k, 0), None);
    }
    let lo = (b * (BLOCK / 2) + k, 4 * z as u32);
    let hi = match bits {
        5 => Some((r / 2 + 16 * b + ob % 16, (ob / 16) as u32)),
        6 => {
            let (v, lane) = (ob / 16, ob % 16);
            let (i, f) = (v / 4, v % 4);
            let (h, l2, m2) = (lane / 8, (lane % 8) / 4, lane % 4);
            Some((r / 2 + 32 * b + 16 * l2 + 8 * i + 4 * h + m2, 2 * f as u32))
        }
        _ => None,
    };
    (lo, hi)
}

/// Writes code `q` of output `o` into a channel's run of a tile of `r`
/// outputs (the run starts zeroed).
#[inline]
fn put_code(bits: usize, r: usize, run: &mut [u8], o: usize, q: u8) {
    let ((at, sh), hi) = code_position(bits, r, o);
    if bits == 8 {
        run[at] = q;
        return;
    }
    run[at] |= (q & 0xf) << sh;
    if let Some((hat, hsh)) = hi {
        let mask = if bits == 5 { 1 } else { 3 };
        run[hat] |= ((q >> 4) & mask) << hsh;
    }
}

/// Reads code `o` of a channel's run (inverse of [`put_code`]).
#[inline]
fn get_code(bits: usize, r: usize, run: &[u8], o: usize) -> u8 {
    let ((at, sh), hi) = code_position(bits, r, o);
    if bits == 8 {
        return run[at];
    }
    let mut q = (run[at] >> sh) & 0xf;
    if let Some((hat, hsh)) = hi {
        let mask = if bits == 5 { 1 } else { 3 };
        q |= ((run[hat] >> hsh) & mask) << 4;
    }
    q
}

/// The source's code of output `j`, input channel `i` of a channel-major
/// matrix `data` (as ggml stores it: Q8_0 its int8 bits, the K-quants their
/// unsigned codes), read back from the channel's run: for converters to
/// other layouts that must keep every bit.
pub fn source_code(layout: &ChannelMajorLayout, data: &[u8], j: usize, i: usize) -> u8 {
    let (t, p) = (j / layout.tile, j % layout.tile);
    let r = layout.tile_rows(t);
    let at = layout.channel_offset(t, i);
    let q = get_code(layout.s.bits, r, &data[at..at + layout.run_bytes(r)], p);
    // Q8_0 codes are stored + 128.
    if layout.ty == GgmlType::Q8_0 {
        q ^ 0x80
    } else {
        q
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

/// Repacks a ggml row-major matrix (`src`: `rows` rows of `cols` elements
/// of `layout.ty()`) into the channel-major layout (`dst`: exactly
/// [`ChannelMajorLayout::bytes`]).
pub fn repack(layout: &ChannelMajorLayout, src: &[u8], dst: &mut [u8]) -> Result<(), QuantError> {
    let ty = layout.ty;
    let row_bytes = super::row_bytes(ty, layout.cols)?;
    super::check_len(ty, "src bytes", row_bytes * layout.rows, src.len())?;
    super::check_len(ty, "dst bytes", layout.bytes(), dst.len())?;
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

/// Per-output scale values of one (tile, group): what the epilogue of the
/// kernels reads (see [`epilogue`]).
#[derive(Debug, Clone, Copy)]
enum Scales {
    /// `w = d * (q - off)`: Q4_0 (8), Q5_0 (16), Q8_0 (128).
    Offset { d: f32, off: i32 },
    /// `w = d * q + m`: Q4_1, Q5_1.
    Min { d: f32, m: f32 },
    /// `w = d * sc * q - dmin * mn`: Q4_K, Q5_K.
    K { d: f32, sc: f32, dmin: f32, mn: f32 },
    /// `w = d * sc * (q - 32)`: Q6_K.
    K6 { d: f32, sc: f32 },
}

/// The scales of output position `p` of tile `t` and group `g`.
fn scales(layout: &ChannelMajorLayout, data: &[u8], t: usize, g: usize, p: usize) -> Scales {
    use GgmlType::*;
    let r = layout.tile_rows(t);
    let rec = &data[layout.record_offset(t, g)..][..layout.record_bytes(r)];
    let hdr = || {
        let sb = g / layout.groups_per_superblock();
        &data[layout.header_offset(t, sb)..][..layout.header_bytes(r)]
    };
    match layout.ty {
        Q4_0 | Q5_0 | Q8_0 => Scales::Offset {
            d: f16_at(rec, 2 * p),
            off: match layout.ty {
                Q4_0 => 8,
                Q5_0 => 16,
                _ => 128,
            },
        },
        Q4_1 | Q5_1 => Scales::Min {
            d: f16_at(rec, 2 * p),
            m: f16_at(rec, 2 * r + 2 * p),
        },
        Q6_K => Scales::K6 {
            d: f16_at(hdr(), 2 * p),
            sc: rec[p] as i8 as f32,
        },
        _ => {
            let h = hdr();
            Scales::K {
                d: f16_at(h, 2 * p),
                sc: rec[p] as f32,
                dmin: f16_at(h, 2 * r + 2 * p),
                mn: rec[r + p] as f32,
            }
        }
    }
}

/// `y + dx * (a * acc + c * sum)` for one output, with the float operations
/// (and their order) of the SIMD kernels, so that they agree bit for bit.
#[inline]
fn epilogue(sc: Scales, acc: i32, sum: i32, dx: f32, y: f32) -> f32 {
    let dxs = dx * sum as f32;
    match sc {
        Scales::Offset { d, off } => (d * dx).mul_add((acc - off * sum) as f32, y),
        Scales::Min { d, m } => m.mul_add(dxs, (d * dx).mul_add(acc as f32, y)),
        Scales::K { d, sc, dmin, mn } => {
            let y = ((d * sc) * dx).mul_add(acc as f32, y);
            (-(dmin * mn)).mul_add(dxs, y)
        }
        Scales::K6 { d, sc } => ((d * sc) * dx).mul_add((acc - 32 * sum) as f32, y),
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
    let ty = layout.ty;
    super::check_len(ty, "channel-major bytes", layout.bytes(), data.len())?;
    super::check_len(ty, "dst floats", layout.rows * layout.cols, dst.len())?;
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

/// `q` (|q| <= 127) rounded to the nearest integer, ties to even: the
/// float add of 1.5 * 2^23 leaves the rounded value in the low mantissa
/// bits (no call into libm's `roundf`, which the baseline x86-64 target
/// does not inline).
#[inline]
fn round_i8(q: f32) -> i8 {
    let r = (q + 12_582_912.0f32).to_bits() as i32 - 0x4B40_0000;
    r.clamp(-127, 127) as i8
}

/// The active input channels of one input vector, grouped by scale group
/// and quantized to int8 with one scale per group: per group, sets of 4
/// channels (their positions in the group and their 4 codes packed in one
/// `i32`, a short last set padded with code 0), the scale `dx` and the sum
/// of the codes. Built once per input vector and matrix, read by every tile;
/// the allocations are reused.
#[derive(Debug, Clone, Default)]
pub struct ActiveChannels {
    group: usize,
    len: usize,
    set_start: Vec<u32>,
    set_idx: Vec<[u8; 4]>,
    set_xq: Vec<i32>,
    count: Vec<u16>,
    dx: Vec<f32>,
    sum: Vec<i32>,
}

impl ActiveChannels {
    /// Empties the list (keeping its allocations) for groups of `group`.
    fn reset(&mut self, group: usize) {
        self.group = group;
        self.len = 0;
        self.set_start.clear();
        self.set_idx.clear();
        self.set_xq.clear();
        self.count.clear();
        self.dx.clear();
        self.sum.clear();
    }

    /// Rebuilds the list from `x` (one input vector) keeping channel `i`
    /// when `keep(i, x_i)`; `group` is the layout's [`ChannelMajorLayout::group`]
    /// (at most 32).
    pub fn fill(&mut self, x: &[f32], group: usize, mut keep: impl FnMut(usize, f32) -> bool) {
        let group = group.clamp(1, 32);
        self.reset(group);
        let mut idx = [0u8; 32];
        let mut val = [0f32; 32];
        for (g, xs) in x.chunks(group).enumerate() {
            self.set_start.push(self.set_idx.len() as u32);
            // Branch-free compaction: which channels pass is data, and at
            // the sparsities used about every other test would mispredict.
            let (mut k, mut amax) = (0usize, 0f32);
            for (j, &v) in xs.iter().enumerate() {
                let on = keep(g * group + j, v);
                idx[k] = j as u8;
                val[k] = v;
                amax = amax.max(if on { v.abs() } else { 0.0 });
                k += on as usize;
            }
            let dx = amax / 127.0;
            let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            let mut sum = 0i32;
            for s in (0..k).step_by(4) {
                let (mut ids, mut codes) = ([idx[k - 1]; 4], [0i8; 4]);
                for c in 0..4.min(k - s) {
                    ids[c] = idx[s + c];
                    codes[c] = round_i8(val[s + c] * id);
                    sum += codes[c] as i32;
                }
                self.set_idx.push(ids);
                self.set_xq.push(i32::from_le_bytes(codes.map(|c| c as u8)));
            }
            self.len += k;
            self.count.push(k as u16);
            self.dx.push(dx);
            self.sum.push(sum);
        }
        self.set_start.push(self.set_idx.len() as u32);
    }

    /// [`Self::fill`] keeping channel `i` when `|x_i| >= thr[i]` (`thr`
    /// `None`: every channel), with the same result bit for bit. With
    /// AVX-512 each group's test, scale and codes take a few vector
    /// instructions (the scalar loop cost about as much as a sparse
    /// product's synchronisation: a decode token builds ~200 lists).
    ///
    /// # Panics
    /// When `thr` is shorter than `x`.
    pub fn fill_above(&mut self, x: &[f32], group: usize, thr: Option<&[f32]>) {
        if let Some(t) = thr {
            assert!(
                t.len() >= x.len(),
                "{} thresholds for {} channels",
                t.len(),
                x.len()
            );
        }
        #[cfg(target_arch = "x86_64")]
        {
            if matches!(group, 16 | 32) && x.len() % group == 0 && avx512::available() {
                self.reset(group);
                for (g, xs) in x.chunks_exact(group).enumerate() {
                    let t = thr.map(|t| &t[g * group..(g + 1) * group]);
                    // SAFETY: AVX-512 checked above; `xs` and `t` hold
                    // `group` (16 or 32) values.
                    let f = unsafe { avx512::fill_group(xs, t) };
                    self.set_start.push(self.set_idx.len() as u32);
                    let k = f.k;
                    for s in (0..k).step_by(4) {
                        let mut ids = [0u8; 4];
                        ids.copy_from_slice(&f.idx[s..s + 4]);
                        self.set_idx.push(ids);
                        self.set_xq.push(i32::from_le_bytes([
                            f.codes[s],
                            f.codes[s + 1],
                            f.codes[s + 2],
                            f.codes[s + 3],
                        ]));
                    }
                    self.len += k;
                    self.count.push(k as u16);
                    self.dx.push(f.dx);
                    self.sum.push(f.sum);
                }
                self.set_start.push(self.set_idx.len() as u32);
                return;
            }
        }
        match thr {
            Some(t) => self.fill(x, group, |i, v| v.abs() >= t[i]),
            None => self.fill(x, group, |_, _| true),
        }
    }

    /// Every channel of `x` active.
    pub fn all(x: &[f32], group: usize) -> ActiveChannels {
        let mut a = ActiveChannels::default();
        a.fill(x, group, |_, _| true);
        a
    }

    /// Active channels.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether no channel is active.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Groups the list was built over.
    pub fn n_groups(&self) -> usize {
        self.count.len()
    }
    /// Channels per group.
    pub fn group_size(&self) -> usize {
        self.group
    }
    /// Active channels of group `g`.
    pub fn group_len(&self, g: usize) -> usize {
        self.count[g] as usize
    }
    /// The active channel ids, ascending.
    pub fn channels(&self) -> Vec<u32> {
        let mut v = Vec::with_capacity(self.len);
        for g in 0..self.n_groups() {
            let r = self.sets(g);
            let n = self.count[g] as usize;
            for (k, ids) in self.set_idx[r].iter().enumerate() {
                for (c, &i) in ids.iter().enumerate() {
                    if 4 * k + c < n {
                        v.push((g * self.group) as u32 + i as u32);
                    }
                }
            }
        }
        v
    }
    /// The (dequantized) value the kernels use for each channel of `x`:
    /// `dx * xq` where active, 0 elsewhere (for references and tests).
    pub fn values(&self, cols: usize) -> Vec<f32> {
        let mut v = vec![0f32; cols];
        for g in 0..self.n_groups() {
            let n = self.count[g] as usize;
            for (k, (ids, xq)) in self.set_idx[self.sets(g)]
                .iter()
                .zip(&self.set_xq[self.sets(g)])
                .enumerate()
            {
                let codes = xq.to_le_bytes();
                for c in 0..4 {
                    if 4 * k + c < n {
                        v[g * self.group + ids[c] as usize] = self.dx[g] * codes[c] as i8 as f32;
                    }
                }
            }
        }
        v
    }
    fn sets(&self, g: usize) -> Range<usize> {
        self.set_start[g] as usize..self.set_start[g + 1] as usize
    }
}

/// An unchecked tile kernel: `y = sum over groups in `groups` of the
/// active channels' contributions to the outputs of tile `t`` (`y` holds
/// [`ChannelMajorLayout::tile_rows`] floats and is overwritten).
///
/// # Safety
/// `data` holds [`ChannelMajorLayout::bytes`] bytes of `layout`; `t <
/// n_tiles`, `groups` lies within `0..n_groups`; `active` was built with
/// `layout.group()` over `cols` channels; `y.len() == layout.tile_rows(t)`.
/// The CPU features the kernel needs are guaranteed by
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
    /// AVX-512 VNNI + GFNI (x86_64).
    Avx512Vnni,
    /// Portable scalar code (the reference; same integer arithmetic).
    Scalar,
}

impl ChannelMajorKernel {
    /// The fastest family this CPU runs.
    pub fn best() -> ChannelMajorKernel {
        #[cfg(target_arch = "x86_64")]
        {
            if avx512::available() {
                return ChannelMajorKernel::Avx512Vnni;
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
                v.push(ChannelMajorKernel::Avx512Vnni);
            }
        }
        v.push(ChannelMajorKernel::Scalar);
        v
    }

    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            ChannelMajorKernel::Avx512Vnni => "avx512-vnni",
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
            ChannelMajorKernel::Avx512Vnni if avx512::available() => avx512::kernel(ty),
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
    if t >= layout.n_tiles() || groups.end > layout.n_groups() || groups.start > groups.end {
        return Err(QuantError::LengthMismatch {
            ty,
            what: "tile / group range",
            expected: layout.n_tiles(),
            got: t,
        });
    }
    super::check_len(ty, "tile outputs", layout.tile_rows(t), y.len())?;
    super::check_len(ty, "active groups", layout.n_groups(), active.n_groups())?;
    super::check_len(ty, "active group size", layout.s.group, active.group)?;
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

/// The portable kernel (see [`TileKernel`]): per output and group the exact
/// integer sum, then [`epilogue`].
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
    let r = layout.tile_rows(t);
    let (bits, rl) = (layout.s.bits, layout.run_bytes(r));
    y.fill(0.0);
    for g in groups {
        let sets = active.sets(g);
        if sets.is_empty() {
            continue;
        }
        let chans = layout.record_offset(t, g) + layout.record_bytes(r);
        for p in 0..r {
            let mut acc = 0i32;
            for k in sets.clone() {
                let xq = active.set_xq[k].to_le_bytes();
                for (c, &i) in active.set_idx[k].iter().enumerate() {
                    let run = &data[chans + i as usize * rl..][..rl];
                    acc += xq[c] as i8 as i32 * get_code(bits, r, run, p) as i32;
                }
            }
            y[p] = epilogue(
                scales(layout, data, t, g, p),
                acc,
                active.sum[g],
                active.dx[g],
                y[p],
            );
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

    #[test]
    fn code_positions_are_a_bijection() {
        for bits in [4usize, 5, 6, 8] {
            for r in [128usize, 256, 192, 64] {
                if !matches!(bits, 4 | 8) && r % 128 != 0 {
                    continue;
                }
                let rl = r * bits / 8;
                let mut seen = vec![0u8; rl];
                for o in 0..r {
                    let ((b, sh), hi) = code_position(bits, r, o);
                    let w = if bits == 8 { 8 } else { 4 };
                    for k in 0..w {
                        let bit = b * 8 + sh as usize + k;
                        assert_eq!(seen[bit / 8] >> (bit % 8) & 1, 0, "bits {bits} r {r} o {o}");
                        seen[bit / 8] |= 1 << (bit % 8);
                    }
                    if let Some((hb, hsh)) = hi {
                        for k in 0..bits - 4 {
                            let bit = hb * 8 + hsh as usize + k;
                            assert_eq!(seen[bit / 8] >> (bit % 8) & 1, 0);
                            seen[bit / 8] |= 1 << (bit % 8);
                        }
                    }
                }
                assert!(
                    seen.iter().all(|&b| b == 0xff),
                    "bits {bits} r {r}: every bit used"
                );
            }
        }
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

    /// The vector list builder gives the scalar one's lists exactly, at
    /// every density, for both group sizes, with and without thresholds.
    #[test]
    fn fill_above_matches_fill() {
        for group in [16usize, 32] {
            for (seed, cut) in [(1u64, 0.0f32), (2, 0.3), (3, 0.6), (4, 0.95), (5, 2.0)] {
                let cols = 512;
                let mut x = values(seed, cols);
                // Some exact zeros, a group entirely below, one entirely above.
                x[7] = 0.0;
                for v in &mut x[group..2 * group] {
                    *v *= 1e-3;
                }
                let thr: Vec<f32> = values(seed + 100, cols)
                    .iter()
                    .map(|v| cut * (0.5 + 0.5 * v.abs()))
                    .collect();
                for t in [Some(&thr[..]), None] {
                    let mut want = ActiveChannels::default();
                    match t {
                        Some(t) => want.fill(&x, group, |i, v| v.abs() >= t[i]),
                        None => want.fill(&x, group, |_, _| true),
                    }
                    let mut got = ActiveChannels::default();
                    got.fill_above(&x, group, t);
                    let ctx = format!("group {group} cut {cut} thr {}", t.is_some());
                    assert_eq!(got.len, want.len, "{ctx}");
                    assert_eq!(got.set_start, want.set_start, "{ctx}");
                    assert_eq!(got.set_idx, want.set_idx, "{ctx}");
                    assert_eq!(got.set_xq, want.set_xq, "{ctx}");
                    assert_eq!(got.count, want.count, "{ctx}");
                    assert_eq!(got.sum, want.sum, "{ctx}");
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got.dx), bits(&want.dx), "{ctx}");
                }
            }
        }
    }

    #[test]
    fn unsupported_shapes_and_types_are_refused() {
        assert!(ChannelMajorLayout::new(GgmlType::F16, 64, 64).is_err());
        assert!(ChannelMajorLayout::new(GgmlType::Q2_K, 64, 256).is_err());
        assert!(ChannelMajorLayout::new(GgmlType::Q4_K, 128, 128).is_err());
        assert!(ChannelMajorLayout::new(GgmlType::Q8_0, 48, 64).is_err());
        assert!(ChannelMajorLayout::new(GgmlType::Q8_0, 0, 64).is_err());
        assert!(ChannelMajorLayout::new(GgmlType::Q6_K, 192, 256).is_err());
        assert!(ChannelMajorLayout::new(GgmlType::Q4_K, 192, 256).is_err());
        assert!(ChannelMajorLayout::new(GgmlType::Q4_0, 192, 256).is_ok());
        assert!(ChannelMajorLayout::with_tile(GgmlType::Q4_0, 256, 64, 96).is_err());
    }

    #[test]
    fn default_tiles_are_balanced_and_bounded() {
        assert_eq!(default_tile(8960), 1792);
        assert_eq!(default_tile(1536), 1536);
        assert_eq!(default_tile(576), 640);
        assert_eq!(default_tile(128), 128);
        for rows in (64..20000).step_by(64) {
            let t = default_tile(rows);
            assert!(t % BLOCK == 0 && t <= MAX_TILE, "{rows}: {t}");
            assert_eq!(
                rows.div_ceil(t),
                rows.div_ceil(MAX_TILE),
                "{rows}: fewest tiles"
            );
        }
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

    /// Every kernel family equals the scalar reference bit for bit (same
    /// integer sums, same float epilogue), and the scalar reference equals
    /// the f64 product of the dequantized source with the int8 activations
    /// to float rounding; on random matrices of every type, at several
    /// sparsities, over whole and split group ranges.
    #[test]
    fn kernels_equal_the_reference_on_random_weights() {
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
            let mut shapes = vec![
                (128usize, 512usize, 128usize),
                (256, 256, 256),
                (640, 256, 256),
                (2304, 256, 2048),
            ];
            if matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0) {
                shapes.push((192, 256, 128));
                shapes.push((576, 256, 640));
            }
            for (rows, cols, tile) in shapes {
                let rb = super::super::row_bytes(ty, cols).unwrap();
                let mut src = vec![0u8; rb * rows];
                super::super::quantize(ty, &lcg(7 + rows as u64, rows * cols), &mut src).unwrap();
                let mut w = vec![0f32; rows * cols];
                super::super::dequantize(ty, &src, &mut w).unwrap();
                let layout = ChannelMajorLayout::with_tile(ty, rows, cols, tile).unwrap();
                let mut cm = vec![0u8; layout.bytes()];
                repack(&layout, &src, &mut cm).unwrap();
                let x = lcg(99, cols);
                for keep_share in [1.0f32, 0.5, 0.13, 0.0] {
                    let mut act = ActiveChannels::default();
                    act.fill(&x, layout.group(), |i, _| {
                        ((i * 2654435761) % 1000) as f32 / 1000.0 < keep_share
                    });
                    let xv = act.values(cols);
                    let want: Vec<f64> = (0..rows)
                        .map(|j| {
                            (0..cols)
                                .map(|i| w[j * cols + i] as f64 * xv[i] as f64)
                                .sum()
                        })
                        .collect();
                    let scale = want.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
                    let ng = layout.n_groups();
                    let run = |fam: ChannelMajorKernel| -> Vec<f32> {
                        let mut y = vec![0f32; rows];
                        for t in 0..layout.n_tiles() {
                            // Two group ranges summed: the split-K path.
                            let r = layout.tile_rows(t);
                            let mid = ng / 2;
                            let (mut a, mut b) = (vec![0f32; r], vec![0f32; r]);
                            tile_checked(fam, &layout, &cm, t, 0..mid, &act, &mut a).unwrap();
                            tile_checked(fam, &layout, &cm, t, mid..ng, &act, &mut b).unwrap();
                            for p in 0..r {
                                y[t * layout.tile() + p] = a[p] + b[p];
                            }
                        }
                        y
                    };
                    let reference = run(ChannelMajorKernel::Scalar);
                    for j in 0..rows {
                        let e = (reference[j] as f64 - want[j]).abs() / scale;
                        assert!(
                            e < 1e-5,
                            "{ty} {rows}x{cols} keep {keep_share}: out {j} {} vs {} (rel {e})",
                            reference[j],
                            want[j]
                        );
                    }
                    for fam in ChannelMajorKernel::available() {
                        let y = run(fam);
                        for j in 0..rows {
                            assert_eq!(
                                y[j].to_bits(),
                                reference[j].to_bits(),
                                "{ty} {rows}x{cols} tile {tile} keep {keep_share} {}: out {j} {} vs {}",
                                fam.name(),
                                y[j],
                                reference[j]
                            );
                        }
                    }
                }
            }
        }
    }

    /// The int8 activations stay within the quantization step of the
    /// inputs: the kernels' product is the exact one to about 1 %.
    #[test]
    fn int8_activations_are_close_to_the_inputs() {
        let x = lcg(5, 1024);
        let act = ActiveChannels::all(&x, 32);
        let v = act.values(1024);
        for g in 0..32 {
            let amax = x[32 * g..32 * g + 32]
                .iter()
                .fold(0f32, |m, a| m.max(a.abs()));
            for i in 32 * g..32 * g + 32 {
                assert!((v[i] - x[i]).abs() <= amax / 254.0 * 1.0001, "{i}");
            }
        }
        assert_eq!(act.len(), 1024);
        assert_eq!(act.channels(), (0..1024).collect::<Vec<u32>>());
    }

    #[test]
    fn bytes_read_counts_active_channels_groups_and_headers() {
        let layout = ChannelMajorLayout::new(GgmlType::Q4_K, 128, 512).unwrap();
        let x = vec![1f32; 512];
        let all = ActiveChannels::all(&x, layout.group());
        assert_eq!(layout.bytes_read(&all), layout.bytes());
        let mut one = ActiveChannels::default();
        one.fill(&x, layout.group(), |i, _| i == 300);
        assert_eq!(one.channels(), vec![300]);
        assert_eq!(
            layout.bytes_read(&one),
            64 + 2 * 128 + 4 * 128,
            "one channel: its codes, its group's scales, its super-block's header"
        );
        let mut none = ActiveChannels::default();
        none.fill(&x, layout.group(), |_, _| false);
        assert_eq!(layout.bytes_read(&none), 0);
    }
}
