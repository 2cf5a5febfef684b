//! AVX2 + FMA + F16C tile kernels of the channel-major layout.
//!
//! As the AVX-512 kernels, with 8-lane vectors: a tile is done in passes of
//! 64 outputs (8 accumulators; 16 would not leave registers for the codes),
//! each pass over the group's active channels (the second pass finds the
//! channel bytes in L1).

use std::arch::x86_64::*;
use std::ops::Range;

use super::{ActiveChannels, ChannelMajorLayout, TileKernel};
use crate::types::GgmlType;

/// Whether this CPU runs the kernels here.
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// The kernel for `ty`. Callers check [`available`] first.
pub(super) fn kernel(ty: GgmlType) -> Option<TileKernel> {
    use GgmlType::*;
    Some(match ty {
        Q4_0 => tile_q4_0,
        Q4_1 => tile_q4_1,
        Q5_0 => tile_q5_0,
        Q5_1 => tile_q5_1,
        Q8_0 => tile_q8_0,
        Q4_K => tile_q4_k,
        Q5_K => tile_q5_k,
        Q6_K => tile_q6_k,
        _ => return None,
    })
}

/// The codes of chunk `c` (32 outputs) of a channel as four 8-lane integer
/// vectors (outputs 0..8, 8..16, 16..24, 24..32 of the chunk).
macro_rules! codes {
    (4, $ch:expr, $tile:expr, $c:expr) => {{
        let b = _mm_loadu_si128($ch.add(16 * $c) as *const __m128i);
        let v0 = _mm256_cvtepu8_epi32(b);
        let v1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
        let f = _mm256_set1_epi32(15);
        [
            _mm256_and_si256(v0, f),
            _mm256_and_si256(v1, f),
            _mm256_srli_epi32(v0, 4),
            _mm256_srli_epi32(v1, 4),
        ]
    }};
    (5, $ch:expr, $tile:expr, $c:expr) => {{
        let q = codes!(4, $ch, $tile, $c);
        let h =
            _mm256_set1_epi32(($ch.add($tile / 2 + 4 * $c) as *const u32).read_unaligned() as i32);
        let one = _mm256_set1_epi32(1);
        let bit = |s: __m256i| _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(h, s), one), 4);
        [
            _mm256_or_si256(q[0], bit(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))),
            _mm256_or_si256(q[1], bit(_mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15))),
            _mm256_or_si256(q[2], bit(_mm256_setr_epi32(16, 17, 18, 19, 20, 21, 22, 23))),
            _mm256_or_si256(q[3], bit(_mm256_setr_epi32(24, 25, 26, 27, 28, 29, 30, 31))),
        ]
    }};
    (6, $ch:expr, $tile:expr, $c:expr) => {{
        let q = codes!(4, $ch, $tile, $c);
        let w = ($ch.add($tile / 2 + 8 * $c) as *const u64).read_unaligned();
        let (lo, hi) = (
            _mm256_set1_epi32(w as u32 as i32),
            _mm256_set1_epi32((w >> 32) as u32 as i32),
        );
        let three = _mm256_set1_epi32(3);
        let top = |h: __m256i, s: __m256i| {
            _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(h, s), three), 4)
        };
        let s0 = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
        let s1 = _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30);
        [
            _mm256_or_si256(q[0], top(lo, s0)),
            _mm256_or_si256(q[1], top(lo, s1)),
            _mm256_or_si256(q[2], top(hi, s0)),
            _mm256_or_si256(q[3], top(hi, s1)),
        ]
    }};
    (8, $ch:expr, $tile:expr, $c:expr) => {{
        let p = $ch.add(32 * $c);
        let l = |o: usize| _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(o) as *const __m128i));
        [l(0), l(8), l(16), l(24)]
    }};
}

/// 8 f16 values at `p` as floats.
macro_rules! f16x8 {
    ($p:expr) => {
        _mm256_cvtph_ps(_mm_loadu_si128($p as *const __m128i))
    };
}

/// 8 bytes at `p` as floats (unsigned, or signed with `i8`).
macro_rules! bytes8 {
    (u8, $p:expr) => {
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64($p as *const __m128i)))
    };
    (i8, $p:expr) => {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64($p as *const __m128i)))
    };
}

macro_rules! tile_kernel {
    ($name:ident, $inner:ident, $bits:tt, $epi:expr) => {
        /// See [`TileKernel`].
        unsafe fn $name(
            layout: &ChannelMajorLayout,
            data: &[u8],
            t: usize,
            groups: Range<usize>,
            active: &ActiveChannels,
            y: &mut [f32],
        ) {
            if layout.tile() % 64 == 0 {
                for pass in 0..layout.tile() / 64 {
                    $inner::<2>(layout, data, t, groups.clone(), active, y, pass);
                }
            } else {
                for pass in 0..layout.tile() / 32 {
                    $inner::<1>(layout, data, t, groups.clone(), active, y, pass);
                }
            }
        }

        /// Outputs `pass * 32C .. (pass + 1) * 32C` of the tile.
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $inner<const C: usize>(
            layout: &ChannelMajorLayout,
            data: &[u8],
            t: usize,
            groups: Range<usize>,
            active: &ActiveChannels,
            y: &mut [f32],
            pass: usize,
        ) {
            let tile = layout.tile();
            let base = data.as_ptr();
            let (gsize, cb, rb) = (
                layout.group(),
                layout.channel_bytes(),
                layout.record_bytes(),
            );
            let p0 = pass * 32 * C;
            let yp = y.as_mut_ptr().add(p0);
            for v in 0..4 * C {
                _mm256_storeu_ps(yp.add(8 * v), _mm256_setzero_ps());
            }
            let per_sb = layout.superblock() / gsize;
            for g in groups {
                let r = active.range(g);
                if r.is_empty() {
                    continue;
                }
                let rec = base.add(layout.record_offset(t, g));
                let chans = rec.add(rb);
                let mut acc = [[_mm256_setzero_ps(); 4]; C];
                for k in r.clone() {
                    let i = *active.idx.get_unchecked(k) as usize;
                    let x = _mm256_set1_ps(*active.vals.get_unchecked(k));
                    let ch = chans.add((i - g * gsize) * cb);
                    for c in 0..C {
                        let q = codes!($bits, ch, tile, pass * C + c);
                        for m in 0..4 {
                            acc[c][m] = _mm256_fmadd_ps(x, _mm256_cvtepi32_ps(q[m]), acc[c][m]);
                        }
                    }
                }
                let sum = *active.sums.get_unchecked(g);
                let hdr = base.add(layout.header_offset(t, g / per_sb));
                for c in 0..C {
                    for m in 0..4 {
                        let o = 32 * c + 8 * m;
                        let yv = _mm256_loadu_ps(yp.add(o));
                        let out = ($epi)(rec, hdr, tile, p0 + o, acc[c][m], sum, yv);
                        _mm256_storeu_ps(yp.add(o), out);
                    }
                }
            }
        }
    };
}

tile_kernel!(
    tile_q4_0,
    inner_q4_0,
    4,
    |rec: *const u8, _h: *const u8, _t: usize, p: usize, acc: __m256, sum: f32, y: __m256| {
        _mm256_fmadd_ps(
            f16x8!(rec.add(2 * p)),
            _mm256_add_ps(acc, _mm256_set1_ps(-8.0 * sum)),
            y,
        )
    }
);
tile_kernel!(
    tile_q5_0,
    inner_q5_0,
    5,
    |rec: *const u8, _h: *const u8, _t: usize, p: usize, acc: __m256, sum: f32, y: __m256| {
        _mm256_fmadd_ps(
            f16x8!(rec.add(2 * p)),
            _mm256_add_ps(acc, _mm256_set1_ps(-16.0 * sum)),
            y,
        )
    }
);
tile_kernel!(
    tile_q8_0,
    inner_q8_0,
    8,
    |rec: *const u8, _h: *const u8, _t: usize, p: usize, acc: __m256, _sum: f32, y: __m256| {
        _mm256_fmadd_ps(f16x8!(rec.add(2 * p)), acc, y)
    }
);
tile_kernel!(
    tile_q4_1,
    inner_q4_1,
    4,
    |rec: *const u8, _h: *const u8, tile: usize, p: usize, acc: __m256, sum: f32, y: __m256| {
        let y = _mm256_fmadd_ps(f16x8!(rec.add(2 * p)), acc, y);
        _mm256_fmadd_ps(f16x8!(rec.add(2 * tile + 2 * p)), _mm256_set1_ps(sum), y)
    }
);
tile_kernel!(
    tile_q5_1,
    inner_q5_1,
    5,
    |rec: *const u8, _h: *const u8, tile: usize, p: usize, acc: __m256, sum: f32, y: __m256| {
        let y = _mm256_fmadd_ps(f16x8!(rec.add(2 * p)), acc, y);
        _mm256_fmadd_ps(f16x8!(rec.add(2 * tile + 2 * p)), _mm256_set1_ps(sum), y)
    }
);

macro_rules! k_epilogue {
    () => {
        |rec: *const u8, hdr: *const u8, tile: usize, p: usize, acc: __m256, sum: f32, y: __m256| {
            let a = _mm256_mul_ps(f16x8!(hdr.add(2 * p)), bytes8!(u8, rec.add(p)));
            let c = _mm256_mul_ps(
                f16x8!(hdr.add(2 * tile + 2 * p)),
                bytes8!(u8, rec.add(tile + p)),
            );
            _mm256_fnmadd_ps(c, _mm256_set1_ps(sum), _mm256_fmadd_ps(a, acc, y))
        }
    };
}
tile_kernel!(tile_q4_k, inner_q4_k, 4, k_epilogue!());
tile_kernel!(tile_q5_k, inner_q5_k, 5, k_epilogue!());
tile_kernel!(
    tile_q6_k,
    inner_q6_k,
    6,
    |rec: *const u8, hdr: *const u8, _t: usize, p: usize, acc: __m256, sum: f32, y: __m256| {
        let a = _mm256_mul_ps(f16x8!(hdr.add(2 * p)), bytes8!(i8, rec.add(p)));
        _mm256_fmadd_ps(a, _mm256_add_ps(acc, _mm256_set1_ps(-32.0 * sum)), y)
    }
);
