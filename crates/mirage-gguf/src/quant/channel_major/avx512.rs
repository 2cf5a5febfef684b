//! AVX-512 tile kernels of the channel-major layout.
//!
//! One channel's codes of a whole tile (64 or 128 outputs) are widened to
//! 16-lane integers, converted to floats and multiplied into `tile / 16`
//! accumulators with the channel's activation broadcast: every code byte is
//! read once, the accumulators stay in registers for the whole group, and
//! the group's scales are applied once per output at its end (see the
//! parent module for the arithmetic). Tiles of 32 outputs go to the AVX2
//! kernels.

use std::arch::x86_64::*;
use std::ops::Range;

use super::{ActiveChannels, ChannelMajorLayout, TileKernel};
use crate::types::GgmlType;

/// Whether this CPU runs the kernels here.
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && super::avx2::available()
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

/// Widens the codes of chunk `c` (32 outputs) of a channel into two
/// 16-lane integer vectors (outputs 0..16 and 16..32 of the chunk).
macro_rules! codes {
    (4, $ch:expr, $tile:expr, $c:expr) => {{
        let v = _mm512_cvtepu8_epi32(_mm_loadu_si128($ch.add(16 * $c) as *const __m128i));
        (
            _mm512_and_si512(v, _mm512_set1_epi32(15)),
            _mm512_srli_epi32(v, 4),
        )
    }};
    (5, $ch:expr, $tile:expr, $c:expr) => {{
        let (lo, hi) = codes!(4, $ch, $tile, $c);
        let h = ($ch.add($tile / 2 + 4 * $c) as *const u32).read_unaligned();
        let sixteen = _mm512_set1_epi32(16);
        (
            _mm512_mask_or_epi32(lo, h as u16, lo, sixteen),
            _mm512_mask_or_epi32(hi, (h >> 16) as u16, hi, sixteen),
        )
    }};
    (6, $ch:expr, $tile:expr, $c:expr) => {{
        let (lo, hi) = codes!(4, $ch, $tile, $c);
        let h = ($ch.add($tile / 2 + 8 * $c) as *const u64).read_unaligned();
        let shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let three = _mm512_set1_epi32(3);
        let top = |w: u32| {
            _mm512_slli_epi32(
                _mm512_and_si512(
                    _mm512_srlv_epi32(_mm512_set1_epi32(w as i32), shifts),
                    three,
                ),
                4,
            )
        };
        (
            _mm512_or_si512(lo, top(h as u32)),
            _mm512_or_si512(hi, top((h >> 32) as u32)),
        )
    }};
    (8, $ch:expr, $tile:expr, $c:expr) => {{
        (
            _mm512_cvtepi8_epi32(_mm_loadu_si128($ch.add(32 * $c) as *const __m128i)),
            _mm512_cvtepi8_epi32(_mm_loadu_si128($ch.add(32 * $c + 16) as *const __m128i)),
        )
    }};
}

/// 16 f16 values at `p` as floats.
macro_rules! f16x16 {
    ($p:expr) => {
        _mm512_cvtph_ps(_mm256_loadu_si256($p as *const __m256i))
    };
}

/// Defines one tile kernel: `$bits` per code, `$epi` the group epilogue
/// `|rec, hdr, tile, p, t, sum, y| -> new y` over 16 outputs at position
/// `p` of the tile.
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
            match layout.tile() {
                t128 if t128 % 128 == 0 => $inner::<8>(layout, data, t, groups, active, y),
                t64 if t64 % 64 == 0 => $inner::<4>(layout, data, t, groups, active, y),
                // 32-output tiles: the AVX2 kernel (same arithmetic).
                _ => {
                    if let Some(k) = super::avx2::kernel(layout.ty()) {
                        k(layout, data, t, groups, active, y)
                    }
                }
            }
        }

        /// Sub-strips of `16 V` outputs; every active channel's codes of the
        /// tile are prefetched when its group starts.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
        unsafe fn $inner<const V: usize>(
            layout: &ChannelMajorLayout,
            data: &[u8],
            t: usize,
            groups: Range<usize>,
            active: &ActiveChannels,
            y: &mut [f32],
        ) {
            let tile = layout.tile();
            let base = data.as_ptr();
            let (gsize, cb, rb) = (
                layout.group(),
                layout.channel_bytes(),
                layout.record_bytes(),
            );
            let yp = y.as_mut_ptr();
            for v in 0..tile / 16 {
                _mm512_storeu_ps(yp.add(16 * v), _mm512_setzero_ps());
            }
            let per_sb = layout.superblock() / gsize;
            let strips = tile / (16 * V);
            for g in groups {
                let r = active.range(g);
                if r.is_empty() {
                    continue;
                }
                let rec = base.add(layout.record_offset(t, g));
                let chans = rec.add(rb);
                if strips > 1 {
                    for k in r.clone() {
                        let i = *active.idx.get_unchecked(k) as usize;
                        let ch = chans.add((i - g * gsize) * cb);
                        let mut off = 0;
                        while off < cb {
                            _mm_prefetch(ch.add(off) as *const i8, _MM_HINT_T0);
                            off += 64;
                        }
                    }
                }
                let sum = *active.sums.get_unchecked(g);
                let hdr = base.add(layout.header_offset(t, g / per_sb));
                for strip in 0..strips {
                    let mut acc = [_mm512_setzero_ps(); V];
                    for k in r.clone() {
                        let i = *active.idx.get_unchecked(k) as usize;
                        let x = _mm512_set1_ps(*active.vals.get_unchecked(k));
                        let ch = chans.add((i - g * gsize) * cb);
                        for c in 0..V / 2 {
                            let (lo, hi) = codes!($bits, ch, tile, strip * (V / 2) + c);
                            acc[2 * c] = _mm512_fmadd_ps(x, _mm512_cvtepi32_ps(lo), acc[2 * c]);
                            acc[2 * c + 1] =
                                _mm512_fmadd_ps(x, _mm512_cvtepi32_ps(hi), acc[2 * c + 1]);
                        }
                    }
                    for v in 0..V {
                        let p = strip * 16 * V + 16 * v;
                        let yv = _mm512_loadu_ps(yp.add(p));
                        let out = ($epi)(rec, hdr, tile, p, acc[v], sum, yv);
                        _mm512_storeu_ps(yp.add(p), out);
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
    |rec: *const u8, _h: *const u8, _t: usize, p: usize, acc: __m512, sum: f32, y: __m512| {
        _mm512_fmadd_ps(
            f16x16!(rec.add(2 * p)),
            _mm512_add_ps(acc, _mm512_set1_ps(-8.0 * sum)),
            y,
        )
    }
);
tile_kernel!(
    tile_q5_0,
    inner_q5_0,
    5,
    |rec: *const u8, _h: *const u8, _t: usize, p: usize, acc: __m512, sum: f32, y: __m512| {
        _mm512_fmadd_ps(
            f16x16!(rec.add(2 * p)),
            _mm512_add_ps(acc, _mm512_set1_ps(-16.0 * sum)),
            y,
        )
    }
);
tile_kernel!(
    tile_q8_0,
    inner_q8_0,
    8,
    |rec: *const u8, _h: *const u8, _t: usize, p: usize, acc: __m512, _sum: f32, y: __m512| {
        _mm512_fmadd_ps(f16x16!(rec.add(2 * p)), acc, y)
    }
);
tile_kernel!(
    tile_q4_1,
    inner_q4_1,
    4,
    |rec: *const u8, _h: *const u8, tile: usize, p: usize, acc: __m512, sum: f32, y: __m512| {
        let y = _mm512_fmadd_ps(f16x16!(rec.add(2 * p)), acc, y);
        _mm512_fmadd_ps(f16x16!(rec.add(2 * tile + 2 * p)), _mm512_set1_ps(sum), y)
    }
);
tile_kernel!(
    tile_q5_1,
    inner_q5_1,
    5,
    |rec: *const u8, _h: *const u8, tile: usize, p: usize, acc: __m512, sum: f32, y: __m512| {
        let y = _mm512_fmadd_ps(f16x16!(rec.add(2 * p)), acc, y);
        _mm512_fmadd_ps(f16x16!(rec.add(2 * tile + 2 * p)), _mm512_set1_ps(sum), y)
    }
);

macro_rules! k_epilogue {
    () => {
        |rec: *const u8, hdr: *const u8, tile: usize, p: usize, acc: __m512, sum: f32, y: __m512| {
            let sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                rec.add(p) as *const __m128i
            )));
            let m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                rec.add(tile + p) as *const __m128i
            )));
            let a = _mm512_mul_ps(f16x16!(hdr.add(2 * p)), sc);
            let c = _mm512_mul_ps(f16x16!(hdr.add(2 * tile + 2 * p)), m);
            _mm512_fnmadd_ps(c, _mm512_set1_ps(sum), _mm512_fmadd_ps(a, acc, y))
        }
    };
}
tile_kernel!(tile_q4_k, inner_q4_k, 4, k_epilogue!());
tile_kernel!(tile_q5_k, inner_q5_k, 5, k_epilogue!());
tile_kernel!(
    tile_q6_k,
    inner_q6_k,
    6,
    |rec: *const u8, hdr: *const u8, _t: usize, p: usize, acc: __m512, sum: f32, y: __m512| {
        let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
            rec.add(p) as *const __m128i
        )));
        let a = _mm512_mul_ps(f16x16!(hdr.add(2 * p)), sc);
        _mm512_fmadd_ps(a, _mm512_add_ps(acc, _mm512_set1_ps(-32.0 * sum)), y)
    }
);
