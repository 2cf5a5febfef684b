//! The channel-major layout's shape and byte offsets, and where each code
//! lies in a channel's run (see the module doc of `channel_major`).

use super::ActiveChannels;
use crate::quant::QuantError;
use crate::types::GgmlType;

/// Outputs per code block (the unit of the in-register transpose).
pub const BLOCK: usize = 128;

/// Most outputs of a tile: a channel's run in a tile is one contiguous span
/// of bytes, and the longer it is, the more a skipped run saves. On an Intel
/// Xeon VM short runs cost nearly as much skipped as read (the hardware
/// prefetchers fetch ahead within a 4 KiB page): one thread, Q4_K 8960 x
/// 1536 out of cache, ran 0.86x the dense mat-vec with every channel and
/// 1.23x with half of them in tiles of 1,792 (1 KiB runs), 1.21x and 1.99x
/// as one tile (4.4 KiB runs). 12,288 outputs
/// (48 KiB of f32 results, within an L1 data cache of that size) keep the
/// FFN matrices up to 7B shapes at one or two tiles.
pub const MAX_TILE: usize = 12288;

/// How a source type's blocks map to the channel-major layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Scheme {
    /// Input channels sharing one scale record per output.
    pub(super) group: usize,
    /// Input channels sharing one header per output (= `group` without one).
    pub(super) superblock: usize,
    /// Bits per code.
    pub(super) bits: usize,
    /// Bytes of one scale record per output.
    pub(super) rec: usize,
    /// Bytes of one super-block header per output (0: none).
    pub(super) hdr: usize,
}

pub(super) fn scheme(ty: GgmlType) -> Option<Scheme> {
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
    pub(super) ty: GgmlType,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) tile: usize,
    pub(super) s: Scheme,
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
        if cols == 0 || !cols.is_multiple_of(s.superblock) {
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
        if rows == 0 || !rows.is_multiple_of(row_unit) {
            return Err(QuantError::NotBlockMultiple {
                ty,
                n: rows,
                block_size: row_unit,
            });
        }
        if tile == 0 || !tile.is_multiple_of(BLOCK) || tile > MAX_TILE {
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
pub(super) fn put_code(bits: usize, r: usize, run: &mut [u8], o: usize, q: u8) {
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
pub(super) fn get_code(bits: usize, r: usize, run: &[u8], o: usize) -> u8 {
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

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(default_tile(8960), 8960);
        assert_eq!(default_tile(18944), 9472);
        assert_eq!(default_tile(151936), 11776);
        assert_eq!(default_tile(1536), 1536);
        assert_eq!(default_tile(576), 640);
        assert_eq!(default_tile(128), 128);
        for rows in (64..40000).step_by(64) {
            let t = default_tile(rows);
            assert!(t.is_multiple_of(BLOCK) && t <= MAX_TILE, "{rows}: {t}");
            assert_eq!(
                rows.div_ceil(t),
                rows.div_ceil(MAX_TILE),
                "{rows}: fewest tiles"
            );
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
