//! The AVX-512 VNNI tile kernel of the channel-major layout.
//!
//! Per group and block of 128 outputs, the active channels go 4 at a time:
//! the 64 base-plane bytes of each of the 4 runs are loaded and transposed
//! in registers (`unpack` of bytes, then of 16-bit pairs), so that each
//! 32-bit lane holds the same output's byte of the 4 channels; the low and
//! high nibbles (`and`, GFNI affine) are that lane's 4 codes for two
//! outputs, and one `vpdpbusd` against the 4 channels' int8 activations
//! (broadcast) adds their 4 products to each of 16 outputs' i32 sums. The
//! 5- and 6-bit types transpose their high-bit plane the same way and merge
//! the bits in with GFNI affine maps; Q8_0 transposes two vectors of codes.
//! The code placement of the layout ([`super::code_position`]) is what
//! makes each vector's 16 lanes 16 consecutive outputs. After a group's
//! channels, its i32 sums are scaled once per output (the epilogue of the
//! parent module, the same float operations in the same order).

use std::arch::x86_64::*;
use std::ops::Range;

use super::active::{GroupTop, Lone};
use super::{ActiveChannels, ChannelMajorLayout, TileKernel, BLOCK};
use crate::types::GgmlType;

/// Whether this CPU runs the kernels here.
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("gfni")
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

// Epilogue kinds.
const OFF8: u8 = 0; // Q4_0
const OFF16: u8 = 1; // Q5_0
const OFF128: u8 = 2; // Q8_0
const MIN: u8 = 3; // Q4_1, Q5_1
const KQ: u8 = 4; // Q4_K, Q5_K
const K6: u8 = 5; // Q6_K

/// The kernel for `ty`. Callers check [`available`] first.
pub(super) fn kernel(ty: GgmlType) -> Option<TileKernel> {
    use GgmlType::*;
    Some(match ty {
        Q4_0 => tile::<4, OFF8>,
        Q4_1 => tile::<4, MIN>,
        Q5_0 => tile::<5, OFF16>,
        Q5_1 => tile::<5, MIN>,
        Q8_0 => tile::<8, OFF128>,
        Q4_K => tile::<4, KQ>,
        Q5_K => tile::<5, KQ>,
        Q6_K => tile::<6, K6>,
        _ => return None,
    })
}

/// GF(2) affine map (`gf2p8affine`) moving bit `s` of each byte to bit `t`.
const fn bit_move(s: u32, t: u32) -> u64 {
    (1u64 << s) << (8 * (7 - t))
}
/// High nibble to low nibble.
const HI_NIBBLE: u64 = bit_move(4, 0) | bit_move(5, 1) | bit_move(6, 2) | bit_move(7, 3);
/// Bit `f` to bit 4 (the fifth bit of a 5-bit code).
const fn fifth(f: u32) -> u64 {
    bit_move(f, 4)
}
/// Bits `2f, 2f+1` to bits 4, 5 (the top of a 6-bit code).
const fn top2(f: u32) -> u64 {
    bit_move(2 * f, 4) | bit_move(2 * f + 1, 5)
}
/// `(a & c) | b` for `vpternlogd`.
const AND_OR: i32 = 0xEC;

/// The 4x4 byte transpose of 4 vectors: lane `4L + m` of result `q` holds
/// byte `16L + 4q + m` of `a`, `b`, `c`, `d` (in that byte order).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c")]
#[inline]
fn transpose512(a: __m512i, b: __m512i, c: __m512i, d: __m512i) -> [__m512i; 4] {
    let ab_lo = _mm512_unpacklo_epi8(a, b);
    let ab_hi = _mm512_unpackhi_epi8(a, b);
    let cd_lo = _mm512_unpacklo_epi8(c, d);
    let cd_hi = _mm512_unpackhi_epi8(c, d);
    [
        _mm512_unpacklo_epi16(ab_lo, cd_lo),
        _mm512_unpackhi_epi16(ab_lo, cd_lo),
        _mm512_unpacklo_epi16(ab_hi, cd_hi),
        _mm512_unpackhi_epi16(ab_hi, cd_hi),
    ]
}

/// [`transpose512`] on 256-bit vectors (2 lanes of 128 bits).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c")]
#[inline]
fn transpose256(a: __m256i, b: __m256i, c: __m256i, d: __m256i) -> [__m256i; 4] {
    let ab_lo = _mm256_unpacklo_epi8(a, b);
    let ab_hi = _mm256_unpackhi_epi8(a, b);
    let cd_lo = _mm256_unpacklo_epi8(c, d);
    let cd_hi = _mm256_unpackhi_epi8(c, d);
    [
        _mm256_unpacklo_epi16(ab_lo, cd_lo),
        _mm256_unpackhi_epi16(ab_lo, cd_lo),
        _mm256_unpacklo_epi16(ab_hi, cd_hi),
        _mm256_unpackhi_epi16(ab_hi, cd_hi),
    ]
}

/// [`transpose512`] on 128-bit vectors.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c")]
#[inline]
fn transpose128(a: __m128i, b: __m128i, c: __m128i, d: __m128i) -> [__m128i; 4] {
    let ab_lo = _mm_unpacklo_epi8(a, b);
    let ab_hi = _mm_unpackhi_epi8(a, b);
    let cd_lo = _mm_unpacklo_epi8(c, d);
    let cd_hi = _mm_unpackhi_epi8(c, d);
    [
        _mm_unpacklo_epi16(ab_lo, cd_lo),
        _mm_unpackhi_epi16(ab_lo, cd_lo),
        _mm_unpacklo_epi16(ab_hi, cd_hi),
        _mm_unpackhi_epi16(ab_hi, cd_hi),
    ]
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c")]
#[inline]
unsafe fn load512(p: *const u8) -> __m512i {
    _mm512_loadu_si512(p as *const __m512i)
}
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c")]
#[inline]
unsafe fn load256(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c")]
#[inline]
unsafe fn load128(p: *const u8) -> __m128i {
    _mm_loadu_si128(p as *const __m128i)
}

/// Adds one set of 4 channels (`p`: their runs; `xb`: their 4 int8
/// activations in every lane) to the 8 sums of block `b` (128 outputs) of a
/// tile of `r` outputs.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c")]
#[inline]
unsafe fn block_set<const BITS: usize>(
    p: [*const u8; 4],
    r: usize,
    b: usize,
    xb: __m512i,
    acc: &mut [__m512i; 8],
) {
    let m0f = _mm512_set1_epi8(0x0f);
    if BITS == 8 {
        for z in 0..2 {
            let at = BLOCK * b + 64 * z;
            let q = transpose512(
                load512(p[0].add(at)),
                load512(p[1].add(at)),
                load512(p[2].add(at)),
                load512(p[3].add(at)),
            );
            for k in 0..4 {
                acc[4 * z + k] = _mm512_dpbusd_epi32(acc[4 * z + k], q[k], xb);
            }
        }
        return;
    }
    let at = (BLOCK / 2) * b;
    let q = transpose512(
        load512(p[0].add(at)),
        load512(p[1].add(at)),
        load512(p[2].add(at)),
        load512(p[3].add(at)),
    );
    let hi_nib = _mm512_set1_epi64(HI_NIBBLE as i64);
    match BITS {
        4 => {
            for k in 0..4 {
                let lo = _mm512_and_si512(q[k], m0f);
                let hi = _mm512_gf2p8affine_epi64_epi8::<0>(q[k], hi_nib);
                acc[k] = _mm512_dpbusd_epi32(acc[k], lo, xb);
                acc[4 + k] = _mm512_dpbusd_epi32(acc[4 + k], hi, xb);
            }
        }
        5 => {
            let at = r / 2 + 16 * b;
            let h = transpose128(
                load128(p[0].add(at)),
                load128(p[1].add(at)),
                load128(p[2].add(at)),
                load128(p[3].add(at)),
            );
            let z = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_set_m128i(h[1], h[0])),
                _mm256_set_m128i(h[3], h[2]),
            );
            macro_rules! f5 {
                ($f:expr) => {
                    _mm512_gf2p8affine_epi64_epi8::<0>(z, _mm512_set1_epi64(fifth($f) as i64))
                };
            }
            let tops = [
                f5!(0),
                f5!(1),
                f5!(2),
                f5!(3),
                f5!(4),
                f5!(5),
                f5!(6),
                f5!(7),
            ];
            for k in 0..4 {
                let lo = _mm512_ternarylogic_epi32::<AND_OR>(q[k], tops[k], m0f);
                let hi = _mm512_or_si512(
                    _mm512_gf2p8affine_epi64_epi8::<0>(q[k], hi_nib),
                    tops[4 + k],
                );
                acc[k] = _mm512_dpbusd_epi32(acc[k], lo, xb);
                acc[4 + k] = _mm512_dpbusd_epi32(acc[4 + k], hi, xb);
            }
        }
        _ => {
            let at = r / 2 + 32 * b;
            let h = transpose256(
                load256(p[0].add(at)),
                load256(p[1].add(at)),
                load256(p[2].add(at)),
                load256(p[3].add(at)),
            );
            let z0 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(h[0]), h[1]);
            let z1 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(h[2]), h[3]);
            macro_rules! t2 {
                ($z:expr, $f:expr) => {
                    _mm512_gf2p8affine_epi64_epi8::<0>($z, _mm512_set1_epi64(top2($f) as i64))
                };
            }
            let lo_tops = [t2!(z0, 0), t2!(z0, 1), t2!(z0, 2), t2!(z0, 3)];
            let hi_tops = [t2!(z1, 0), t2!(z1, 1), t2!(z1, 2), t2!(z1, 3)];
            for k in 0..4 {
                let lo = _mm512_ternarylogic_epi32::<AND_OR>(q[k], lo_tops[k], m0f);
                let hi =
                    _mm512_or_si512(_mm512_gf2p8affine_epi64_epi8::<0>(q[k], hi_nib), hi_tops[k]);
                acc[k] = _mm512_dpbusd_epi32(acc[k], lo, xb);
                acc[4 + k] = _mm512_dpbusd_epi32(acc[4 + k], hi, xb);
            }
        }
    }
}

/// [`block_set`] for a last block of 64 outputs (4- and 8-bit types only):
/// 8 sums of 8 outputs.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c")]
#[inline]
unsafe fn half_block_set<const BITS: usize>(
    p: [*const u8; 4],
    b: usize,
    xb: __m256i,
    acc: &mut [__m256i; 8],
) {
    if BITS == 8 {
        for z in 0..2 {
            let at = BLOCK * b + 32 * z;
            let q = transpose256(
                load256(p[0].add(at)),
                load256(p[1].add(at)),
                load256(p[2].add(at)),
                load256(p[3].add(at)),
            );
            for k in 0..4 {
                acc[4 * z + k] = _mm256_dpbusd_epi32(acc[4 * z + k], q[k], xb);
            }
        }
        return;
    }
    let at = (BLOCK / 2) * b;
    let q = transpose256(
        load256(p[0].add(at)),
        load256(p[1].add(at)),
        load256(p[2].add(at)),
        load256(p[3].add(at)),
    );
    let m0f = _mm256_set1_epi8(0x0f);
    let hi_nib = _mm256_set1_epi64x(HI_NIBBLE as i64);
    for k in 0..4 {
        let lo = _mm256_and_si256(q[k], m0f);
        let hi = _mm256_gf2p8affine_epi64_epi8::<0>(q[k], hi_nib);
        acc[k] = _mm256_dpbusd_epi32(acc[k], lo, xb);
        acc[4 + k] = _mm256_dpbusd_epi32(acc[4 + k], hi, xb);
    }
}

/// 16 f16 values at `p` as floats.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c")]
#[inline]
unsafe fn f16x16(p: *const u8) -> __m512 {
    _mm512_cvtph_ps(load256(p))
}
/// 8 f16 values at `p` as floats.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c")]
#[inline]
unsafe fn f16x8(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(load128(p))
}

/// The epilogue of 16 outputs `j0..j0 + 16` of a tile of `r` outputs:
/// `y += dx * (a * acc + c * sum)` with the parent module's float operations
/// (`epilogue`; with a lone channel `epilogue_lone`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn epilogue16<const E: u8>(
    rec: *const u8,
    hdr: *const u8,
    r: usize,
    j0: usize,
    acc: __m512i,
    sum: i32,
    dx: f32,
    lone: Option<LoneSums<__m512i>>,
    y: *mut f32,
) {
    let yv = _mm512_loadu_ps(y.add(j0));
    let dxv = _mm512_set1_ps(dx);
    let int_part =
        |off: i32| _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_set1_epi32(off * sum)));
    // With a lone channel both sums are scaled and added before the
    // per-output scales (the parent module's `epilogue_lone`): `offset_sum`
    // for the offset forms, `a` and `s` for the min forms.
    let offset_sum = |off: i32, l: LoneSums<__m512i>| {
        let t2 = _mm512_cvtepi32_ps(_mm512_sub_epi32(l.lone_acc, _mm512_set1_epi32(off * l.sum)));
        _mm512_fmadd_ps(t2, _mm512_set1_ps(l.dx), _mm512_mul_ps(int_part(off), dxv))
    };
    let (a, s) = match lone {
        None => (_mm512_cvtepi32_ps(acc), dx * sum as f32),
        Some(l) => (
            _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(l.lone_acc),
                _mm512_set1_ps(l.dx),
                _mm512_mul_ps(_mm512_cvtepi32_ps(acc), dxv),
            ),
            (l.sum as f32).mul_add(l.dx, dx * sum as f32),
        ),
    };
    let s = _mm512_set1_ps(s);
    // The per-output factor of `a`: times `dx` without a lone channel.
    let scaled = |f: __m512| {
        if lone.is_some() {
            f
        } else {
            _mm512_mul_ps(f, dxv)
        }
    };
    let out = match E {
        OFF8 | OFF16 | OFF128 => {
            let off = match E {
                OFF8 => 8,
                OFF16 => 16,
                _ => 128,
            };
            let d = f16x16(rec.add(2 * j0));
            match lone {
                None => _mm512_fmadd_ps(_mm512_mul_ps(d, dxv), int_part(off), yv),
                Some(l) => _mm512_fmadd_ps(d, offset_sum(off, l), yv),
            }
        }
        MIN => {
            let d = f16x16(rec.add(2 * j0));
            let m = f16x16(rec.add(2 * r + 2 * j0));
            _mm512_fmadd_ps(m, s, _mm512_fmadd_ps(scaled(d), a, yv))
        }
        KQ => {
            let d = f16x16(hdr.add(2 * j0));
            let dmin = f16x16(hdr.add(2 * r + 2 * j0));
            let sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(load128(rec.add(j0))));
            let mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(load128(rec.add(r + j0))));
            let y1 = _mm512_fmadd_ps(scaled(_mm512_mul_ps(d, sc)), a, yv);
            _mm512_fnmadd_ps(_mm512_mul_ps(dmin, mn), s, y1)
        }
        _ => {
            let d = f16x16(hdr.add(2 * j0));
            let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load128(rec.add(j0))));
            match lone {
                None => _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(d, sc), dxv), int_part(32), yv),
                Some(l) => _mm512_fmadd_ps(_mm512_mul_ps(d, sc), offset_sum(32, l), yv),
            }
        }
    };
    _mm512_storeu_ps(y.add(j0), out);
}

/// [`epilogue16`] for 8 outputs (the last block of 64; types without a
/// header).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn epilogue8<const E: u8>(
    rec: *const u8,
    r: usize,
    j0: usize,
    acc: __m256i,
    sum: i32,
    dx: f32,
    lone: Option<LoneSums<__m256i>>,
    y: *mut f32,
) {
    let yv = _mm256_loadu_ps(y.add(j0));
    let dxv = _mm256_set1_ps(dx);
    // As in `epilogue16`: with a lone channel both sums are scaled and added
    // before the per-output scales.
    let out = match E {
        MIN => {
            let d = f16x8(rec.add(2 * j0));
            let m = f16x8(rec.add(2 * r + 2 * j0));
            match lone {
                None => {
                    let y1 = _mm256_fmadd_ps(_mm256_mul_ps(d, dxv), _mm256_cvtepi32_ps(acc), yv);
                    _mm256_fmadd_ps(m, _mm256_set1_ps(dx * sum as f32), y1)
                }
                Some(l) => {
                    let a = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(l.lone_acc),
                        _mm256_set1_ps(l.dx),
                        _mm256_mul_ps(_mm256_cvtepi32_ps(acc), dxv),
                    );
                    let s = _mm256_set1_ps((l.sum as f32).mul_add(l.dx, dx * sum as f32));
                    _mm256_fmadd_ps(m, s, _mm256_fmadd_ps(d, a, yv))
                }
            }
        }
        _ => {
            let off = if E == OFF8 { 8 } else { 128 };
            let d = f16x8(rec.add(2 * j0));
            let t = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc, _mm256_set1_epi32(off * sum)));
            match lone {
                None => _mm256_fmadd_ps(_mm256_mul_ps(d, dxv), t, yv),
                Some(l) => {
                    let t2 = _mm256_cvtepi32_ps(_mm256_sub_epi32(
                        l.lone_acc,
                        _mm256_set1_epi32(off * l.sum),
                    ));
                    let comb = _mm256_fmadd_ps(t2, _mm256_set1_ps(l.dx), _mm256_mul_ps(t, dxv));
                    _mm256_fmadd_ps(d, comb, yv)
                }
            }
        }
    };
    _mm256_storeu_ps(y.add(j0), out);
}

/// A group's int32 sums with its lone channel's (see
/// [`super::ActiveChannels`]): `acc` and `sum` over the group's sets at the
/// scale `dx`, `lone_acc` and `lone.sum` of the lone channel at `lone.dx`.
#[derive(Clone, Copy)]
struct LoneSums<V> {
    lone_acc: V,
    sum: i32,
    dx: f32,
}

impl<V> LoneSums<V> {
    fn of(l: Lone, lone_acc: V) -> LoneSums<V> {
        LoneSums {
            lone_acc,
            sum: l.sum,
            dx: l.dx,
        }
    }
}

/// Blocks ahead that the kernel prefetches. The prefetches go to the outer
/// caches (`T2`): prefetching into L1 (`T0`) this far ahead holds the L1
/// miss buffers and halves the kernel's memory bandwidth, while too short a
/// distance leaves the runs' first lines (each run starts a new stream the
/// hardware prefetchers have not learnt) waiting on memory.
const PREFETCH_BLOCKS: usize = 8;

/// Prefetches the lines of block `b` (of a tile of `r` outputs) of the
/// channels `ids` of one group (runs at `chans`, `rl` bytes each).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c")]
#[inline]
unsafe fn prefetch_block<const BITS: usize, const N: usize>(
    chans: *const u8,
    ids: &[[u8; N]],
    rl: usize,
    r: usize,
    b: usize,
) {
    for set in ids {
        for &i in set {
            let run = chans.add(i as usize * rl);
            if BITS == 8 {
                _mm_prefetch::<_MM_HINT_T2>(run.add(BLOCK * b) as *const i8);
                _mm_prefetch::<_MM_HINT_T2>(run.add(BLOCK * b + 64) as *const i8);
            } else {
                _mm_prefetch::<_MM_HINT_T2>(run.add((BLOCK / 2) * b) as *const i8);
                if BITS == 5 {
                    _mm_prefetch::<_MM_HINT_T2>(run.add(r / 2 + 16 * b) as *const i8);
                } else if BITS == 6 {
                    _mm_prefetch::<_MM_HINT_T2>(run.add(r / 2 + 32 * b) as *const i8);
                }
            }
        }
    }
}

/// See [`TileKernel`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c")]
unsafe fn tile<const BITS: usize, const E: u8>(
    layout: &ChannelMajorLayout,
    data: &[u8],
    t: usize,
    groups: Range<usize>,
    active: &ActiveChannels,
    y: &mut [f32],
) {
    let r = layout.tile_rows(t);
    let rl = layout.run_bytes(r);
    let (full, tail) = (r / BLOCK, !r.is_multiple_of(BLOCK));
    let base = data.as_ptr();
    let yp = y.as_mut_ptr();
    y.fill(0.0);
    let gps = layout.groups_per_superblock();
    let rec_bytes = layout.record_bytes(r);
    let nblocks = full + tail as usize;
    // The next group with active channels (its first blocks are prefetched
    // while this group's last ones run).
    let next_after = |g: usize| (g + 1..groups.end).find(|&n| !active.sets(n).is_empty());
    let mut next = groups.clone().find(|&n| !active.sets(n).is_empty());
    if let Some(g) = next {
        let chans = base.add(layout.record_offset(t, g) + rec_bytes);
        let ids = active.set_idx.get_unchecked(active.sets(g));
        for b in 0..PREFETCH_BLOCKS.min(nblocks) {
            prefetch_block::<BITS, _>(chans, ids, rl, r, b);
        }
    }
    while let Some(g) = next {
        next = next_after(g);
        let sets = active.sets(g);
        let rec = base.add(layout.record_offset(t, g));
        let chans = rec.add(rec_bytes);
        let hdr = base.add(layout.header_offset(t, g / gps));
        let (dx, sum) = (*active.dx.get_unchecked(g), *active.sum.get_unchecked(g));
        let idx = active.set_idx.get_unchecked(sets.clone());
        let xqs = active.set_xq.get_unchecked(sets);
        let lone = *active.lone.get_unchecked(g);
        let (next_chans, next_ids) = match next {
            Some(n) => (
                base.add(layout.record_offset(t, n) + rec_bytes),
                active.set_idx.get_unchecked(active.sets(n)),
            ),
            None => (chans, &[][..]),
        };
        for b in 0..full {
            let ahead = b + PREFETCH_BLOCKS;
            if ahead < nblocks {
                prefetch_block::<BITS, _>(chans, idx, rl, r, ahead);
                if let Some(l) = lone {
                    prefetch_block::<BITS, _>(chans, &[[l.idx[0]; 1]], rl, r, ahead);
                }
            } else if ahead - nblocks < nblocks {
                prefetch_block::<BITS, _>(next_chans, next_ids, rl, r, ahead - nblocks);
            }
            let mut acc = [_mm512_setzero_si512(); 8];
            for (ids, &xq) in idx.iter().zip(xqs) {
                let p = ids.map(|i| chans.add(i as usize * rl));
                block_set::<BITS>(p, r, b, _mm512_set1_epi32(xq), &mut acc);
            }
            let mut lacc = [_mm512_setzero_si512(); 8];
            if let Some(l) = lone {
                let p = l.idx.map(|i| chans.add(i as usize * rl));
                block_set::<BITS>(p, r, b, _mm512_set1_epi32(l.xq), &mut lacc);
            }
            for (v, (a, la)) in acc.iter().zip(lacc).enumerate() {
                let ls = lone.map(|l| LoneSums::of(l, la));
                epilogue16::<E>(rec, hdr, r, BLOCK * b + 16 * v, *a, sum, dx, ls, yp);
            }
        }
        if tail && (BITS == 4 || BITS == 8) {
            let mut acc = [_mm256_setzero_si256(); 8];
            for (ids, &xq) in idx.iter().zip(xqs) {
                let p = ids.map(|i| chans.add(i as usize * rl));
                half_block_set::<BITS>(p, full, _mm256_set1_epi32(xq), &mut acc);
            }
            let mut lacc = [_mm256_setzero_si256(); 8];
            if let Some(l) = lone {
                let p = l.idx.map(|i| chans.add(i as usize * rl));
                half_block_set::<BITS>(p, full, _mm256_set1_epi32(l.xq), &mut lacc);
            }
            for (v, (a, la)) in acc.iter().zip(lacc).enumerate() {
                let ls = lone.map(|l| LoneSums::of(l, la));
                epilogue8::<E>(rec, r, BLOCK * full + 8 * v, *a, sum, dx, ls, yp);
            }
        }
    }
}

/// One group's active channels as [`super::ActiveChannels::fill_above`]
/// stores them: positions and int8 codes of the `k` kept channels in order
/// (then padded to a multiple of 4: positions with the last kept one,
/// codes with 0), the group's scale and the sum of its codes.
pub(super) struct FilledGroup {
    pub k: usize,
    pub idx: [u8; 48],
    pub codes: [u8; 48],
    pub dx: f32,
    pub sum: i32,
}

/// Half `h` (16 values) of a group: the values, their magnitudes and the
/// mask of those kept (`|x_j| >= thr_j`; `thr` `None`: all).
///
/// # Safety
/// The CPU runs [`available`]'s features; `x` (and `thr`) hold `16 * (h + 1)` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c")]
#[inline]
unsafe fn half_kept(x: &[f32], thr: Option<&[f32]>, h: usize) -> (__m512, __m512, u16) {
    let v = _mm512_loadu_ps(x.as_ptr().add(16 * h));
    let a = _mm512_castsi512_ps(_mm512_and_si512(
        _mm512_castps_si512(v),
        _mm512_set1_epi32(0x7fff_ffff),
    ));
    let m = match thr {
        Some(t) => _mm512_cmp_ps_mask::<_CMP_GE_OQ>(a, _mm512_loadu_ps(t.as_ptr().add(16 * h))),
        None => 0xffff,
    };
    (v, a, m)
}

/// The largest and second-largest `|x_j|` of one group's kept channels
/// (kept as in [`fill_group`]; NaN never counts) and the first position of
/// the largest, as the scalar builder finds them.
///
/// # Safety
/// The CPU runs [`available`]'s features; `x.len()` (and `thr`'s) is 16 or 32.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c")]
pub(super) unsafe fn group_top(x: &[f32], thr: Option<&[f32]>) -> GroupTop {
    let halves = x.len() / 16;
    let mut va = [_mm512_setzero_ps(); 2];
    let mut amax = _mm512_setzero_ps();
    for h in 0..halves {
        let (_, a, m) = half_kept(x, thr, h);
        let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(a, a);
        let a = _mm512_maskz_mov_ps(m & ordered, a);
        amax = _mm512_max_ps(a, amax);
        va[h] = a;
    }
    let a1 = _mm512_reduce_max_ps(amax);
    let mut top = GroupTop {
        a1,
        a2: 0.0,
        pos: GroupTop::NONE,
    };
    if a1 <= 0.0 {
        return top;
    }
    for h in 0..halves {
        let eq = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(va[h], _mm512_set1_ps(a1));
        if eq != 0 {
            top.pos = (16 * h) as u8 + eq.trailing_zeros() as u8;
            break;
        }
    }
    let mut rest = _mm512_setzero_ps();
    for h in 0..halves {
        let lane = top.pos as usize;
        let m = if lane / 16 == h {
            !(1u16 << (lane % 16))
        } else {
            0xffff
        };
        rest = _mm512_max_ps(_mm512_maskz_mov_ps(m, va[h]), rest);
    }
    top.a2 = _mm512_reduce_max_ps(rest);
    top
}

/// Builds one group (16 or 32 channels) of an active-channel list: channel
/// `j` kept when `|x_j| >= thr_j` (`thr` `None`: every channel) and `j` is
/// not `lone` (the channel multiplied on its own), with the scalar
/// builder's float operations, so that the result is the same bits.
///
/// # Safety
/// The CPU runs [`available`]'s features; `x.len()` (and `thr`'s) is 16 or 32.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c")]
pub(super) unsafe fn fill_group(x: &[f32], thr: Option<&[f32]>, lone: Option<u8>) -> FilledGroup {
    let halves = x.len() / 16;
    let mut on = [0u16; 2];
    let mut vx = [_mm512_setzero_ps(); 2];
    let mut amax = _mm512_setzero_ps();
    for h in 0..halves {
        let (v, a, m) = half_kept(x, thr, h);
        let m = match lone {
            Some(j) if j as usize / 16 == h => m & !(1u16 << (j % 16)),
            _ => m,
        };
        // `max(a, amax)` returns `amax` where `a` is NaN, as `f32::max` does.
        amax = _mm512_max_ps(_mm512_maskz_mov_ps(m, a), amax);
        on[h] = m;
        vx[h] = v;
    }
    let amax = _mm512_reduce_max_ps(amax);
    let dx = amax / 127.0;
    let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    let mut f = FilledGroup {
        k: 0,
        idx: [0; 48],
        codes: [0; 48],
        dx,
        sum: 0,
    };
    let idv = _mm512_set1_ps(id);
    let magic = _mm512_set1_ps(12_582_912.0);
    let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let mut sum = _mm512_setzero_si512();
    for h in 0..halves {
        let m = on[h];
        // round_i8: (q + 1.5 * 2^23) bits - 0x4B40_0000, clamped to +-127.
        let r = _mm512_add_ps(_mm512_mul_ps(vx[h], idv), magic);
        let q = _mm512_sub_epi32(_mm512_castps_si512(r), _mm512_set1_epi32(0x4B40_0000));
        let q = _mm512_max_epi32(
            _mm512_min_epi32(q, _mm512_set1_epi32(127)),
            _mm512_set1_epi32(-127),
        );
        let q = _mm512_maskz_compress_epi32(m, q);
        let ids = _mm512_maskz_compress_epi32(
            m,
            _mm512_add_epi32(lanes, _mm512_set1_epi32(16 * h as i32)),
        );
        sum = _mm512_add_epi32(sum, q);
        _mm_storeu_si128(
            f.codes.as_mut_ptr().add(f.k) as *mut __m128i,
            _mm512_cvtepi32_epi8(q),
        );
        _mm_storeu_si128(
            f.idx.as_mut_ptr().add(f.k) as *mut __m128i,
            _mm512_cvtepi32_epi8(ids),
        );
        f.k += m.count_ones() as usize;
    }
    f.sum = _mm512_reduce_add_epi32(sum);
    if f.k > 0 {
        let last = f.idx[f.k - 1];
        for j in f.k..f.k.next_multiple_of(4) {
            f.idx[j] = last;
            f.codes[j] = 0;
        }
    }
    f
}
