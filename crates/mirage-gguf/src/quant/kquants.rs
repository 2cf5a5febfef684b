//! The K-quants: 256-element super-blocks Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K.
//!
//! Layouts (ggml `block_q2_K` etc.), byte offsets within a block:
//! - Q2_K (84):  scales[16] (low nibble scale, high nibble min) @0, qs[64] @16,
//!   d:f16 @80, dmin:f16 @82.
//! - Q3_K (110): hmask[32] @0, qs[64] @32, scales[12] (16 x 6-bit) @96, d @108.
//! - Q4_K (144): d @0, dmin @2, scales[12] (8 x 6-bit scale + min) @4, qs[128] @16.
//! - Q5_K (176): d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48.
//! - Q6_K (210): ql[128] @0, qh[64] @128, scales:i8[16] @192, d @208.
//! - Q8_K (292): d:f32 @0, qs:i8[256] @4, bsums:i16[16] @260.
//!
//! Element e of a block uses scale e/16 (Q2/Q3/Q6) or e/32 (Q4/Q5). The
//! 2-bit planes of Q2/Q3 and the nibbles of Q4/Q5 interleave as ggml's
//! dequantize_row_* walk them; [`codes_q2_k`] etc. spell that out once and
//! both the dequantizers and the scalar dots read codes through them.

use super::util::{f16_at, f32_at, nearest_int, put_f16, signed_absmax, GROUP_MAX_EPS};
use crate::types::QK_K;

const Q2_K_SIZE: usize = 84;
const Q3_K_SIZE: usize = 110;
const Q4_K_SIZE: usize = 144;
const Q5_K_SIZE: usize = 176;
const Q6_K_SIZE: usize = 210;
const Q8_K_SIZE: usize = 292;

// ---------------------------------------------------------------- unpacking

/// Q2_K codes 0..=3 of one block.
#[inline(always)]
fn codes_q2_k(b: &[u8], out: &mut [i8; QK_K]) {
    let qs = &b[16..80];
    for e in 0..QK_K {
        let byte = qs[(e / 128) * 32 + e % 32];
        out[e] = ((byte >> (2 * ((e % 128) / 32))) & 3) as i8;
    }
}

/// Q3_K signed codes -4..=3 of one block (the hmask bit set means +0).
#[inline(always)]
fn codes_q3_k(b: &[u8], out: &mut [i8; QK_K]) {
    let hmask = &b[0..32];
    let qs = &b[32..96];
    for e in 0..QK_K {
        let low = (qs[(e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3;
        let high = (hmask[e % 32] >> (e / 32)) & 1;
        out[e] = low as i8 - if high != 0 { 0 } else { 4 };
    }
}

/// Q3_K's 16 signed 6-bit scales (already minus 32): scale j has its low
/// nibble in byte j (j < 8, low) or j-8 (high nibble), its top two bits in
/// byte 8 + j%4 at bit 2*(j/4). Unpacked four at a time as ggml does.
#[inline(always)]
pub(crate) fn scales_q3_k(b: &[u8]) -> [i8; 16] {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let s = &b[96..108];
    let word = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (a0, a1, tmp) = (word(0), word(1), word(2));
    let words = [
        (a0 & KMASK2) | ((tmp & KMASK1) << 4),
        (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4),
        ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4),
        ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4),
    ];
    let mut out = [0i8; 16];
    for (i, w) in words.iter().enumerate() {
        for (k, byte) in w.to_le_bytes().iter().enumerate() {
            out[4 * i + k] = (*byte as i8).wrapping_sub(32);
        }
    }
    out
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j`.
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q4_K codes 0..=15 (`qh` = None) or Q5_K codes 0..=31.
#[inline(always)]
fn codes_q45_k(qs: &[u8], qh: Option<&[u8]>, out: &mut [i8; QK_K]) {
    for e in 0..QK_K {
        let byte = qs[32 * (e / 64) + e % 32];
        let nib = if (e / 32) % 2 == 0 {
            byte & 0xf
        } else {
            byte >> 4
        };
        let high = qh.map_or(0, |h| ((h[e % 32] >> (e / 32)) & 1) << 4);
        out[e] = (nib | high) as i8;
    }
}

/// Q6_K signed codes -32..=31 of one block.
#[inline(always)]
fn codes_q6_k(b: &[u8], out: &mut [i8; QK_K]) {
    for e in 0..QK_K {
        let (h, r) = (e / 128, e % 128);
        let (k, l) = (r / 32, r % 32);
        let ql = &b[64 * h..];
        let qh = b[128 + 32 * h + l];
        let low = match k {
            0 => ql[l] & 0xf,
            1 => ql[l + 32] & 0xf,
            2 => ql[l] >> 4,
            _ => ql[l + 32] >> 4,
        };
        let high = (qh >> (2 * k)) & 3;
        out[e] = (low | (high << 4)) as i8 - 32;
    }
}

// ------------------------------------------------------------- dequantizers

// The dequantizers walk the blocks in ggml's loop order (which keeps the
// inner loops branch-free and vectorizable) and use its float expressions.

pub(crate) fn dequantize_q2_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q2_K_SIZE).zip(dst.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
        for h in 0..2 {
            let q = &b[16 + 32 * h..48 + 32 * h];
            for j in 0..4 {
                let shift = 2 * j;
                for half in 0..2 {
                    let sc = b[8 * h + 2 * j + half];
                    let dl = d * (sc & 0xf) as f32;
                    let ml = dmin * (sc >> 4) as f32;
                    let out = &mut y[128 * h + 32 * j + 16 * half..][..16];
                    for (l, o) in out.iter_mut().enumerate() {
                        *o = dl * ((q[16 * half + l] >> shift) & 3) as f32 - ml;
                    }
                }
            }
        }
    }
}

pub(crate) fn dequantize_q3_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q3_K_SIZE).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 108);
        let scales = scales_q3_k(b);
        let hm = &b[0..32];
        for h in 0..2 {
            let q = &b[32 + 32 * h..64 + 32 * h];
            for j in 0..4 {
                let (shift, bit) = (2 * j, 4 * h + j);
                for half in 0..2 {
                    let dl = d * scales[8 * h + 2 * j + half] as f32;
                    let out = &mut y[128 * h + 32 * j + 16 * half..][..16];
                    for (l, o) in out.iter_mut().enumerate() {
                        let i = 16 * half + l;
                        let low = ((q[i] >> shift) & 3) as i8;
                        let sub = if (hm[i] >> bit) & 1 != 0 { 0 } else { 4 };
                        *o = dl * (low - sub) as f32;
                    }
                }
            }
        }
    }
}

fn dequantize_q45_k(src: &[u8], dst: &mut [f32], five_bit: bool) {
    let (size, qs_at) = if five_bit {
        (Q5_K_SIZE, 48)
    } else {
        (Q4_K_SIZE, 16)
    };
    for (b, y) in src.chunks_exact(size).zip(dst.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        let qh = &b[16..48];
        for c in 0..4 {
            let q = &b[qs_at + 32 * c..qs_at + 32 * c + 32];
            let (sc1, m1) = scale_min_k4(2 * c, &b[4..16]);
            let (sc2, m2) = scale_min_k4(2 * c + 1, &b[4..16]);
            let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
            let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
            let (lo, hi) = y[64 * c..64 * c + 64].split_at_mut(32);
            for l in 0..32 {
                let (mut a, mut b2) = (q[l] & 0xf, q[l] >> 4);
                if five_bit {
                    a |= ((qh[l] >> (2 * c)) & 1) << 4;
                    b2 |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                }
                lo[l] = d1 * a as f32 - min1;
                hi[l] = d2 * b2 as f32 - min2;
            }
        }
    }
}

pub(crate) fn dequantize_q4_k(src: &[u8], dst: &mut [f32]) {
    dequantize_q45_k(src, dst, false)
}

pub(crate) fn dequantize_q5_k(src: &[u8], dst: &mut [f32]) {
    dequantize_q45_k(src, dst, true)
}

pub(crate) fn dequantize_q6_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q6_K_SIZE).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 208);
        for h in 0..2 {
            let ql = &b[64 * h..64 * h + 64];
            let qh = &b[128 + 32 * h..160 + 32 * h];
            let sc = &b[192 + 8 * h..200 + 8 * h];
            let out = &mut y[128 * h..128 * h + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0xf) | ((qh[l] & 3) << 4)) as i8 - 32;
                let q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                // ggml computes `d * sc * q` left to right.
                out[l] = d * sc[is] as i8 as f32 * q1 as f32;
                out[l + 32] = d * sc[is + 2] as i8 as f32 * q2 as f32;
                out[l + 64] = d * sc[is + 4] as i8 as f32 * q3 as f32;
                out[l + 96] = d * sc[is + 6] as i8 as f32 * q4 as f32;
            }
        }
    }
}

pub(crate) fn dequantize_q8_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q8_K_SIZE).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f32_at(b, 0);
        for e in 0..QK_K {
            y[e] = d * b[4 + e] as i8 as f32;
        }
    }
}

// ------------------------------------------------------ quantizer helpers

/// ggml's `make_qx_quants` with `qw == NULL`; writes codes `l + nmax` to `l_out`.
fn make_qx_quants(x: &[f32], nmax: i32, l_out: &mut [i8], rmse_type: i32) -> f32 {
    let n = x.len();
    let max = signed_absmax(x);
    if max.abs() < GROUP_MAX_EPS {
        l_out[..n].fill(0);
        return 0.0;
    }
    let mut iscale = -(nmax as f32) / max;
    if rmse_type == 0 {
        for i in 0..n {
            let l = nearest_int(iscale * x[i]);
            l_out[i] = (nmax + l.clamp(-nmax, nmax - 1)) as i8;
        }
        return 1.0 / iscale;
    }
    let (rmse_type, return_early) = if rmse_type < 0 {
        (-rmse_type, true)
    } else {
        (rmse_type, false)
    };
    let weight = |v: f32| -> f32 {
        match rmse_type {
            1 => v * v,
            2 => 1.0,
            3 => v.abs(),
            _ => v.abs().sqrt(),
        }
    };
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..n {
        let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l_out[i] = (l + nmax) as i8;
        let w = weight(x[i]);
        sumlx += w * x[i] * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    if return_early {
        return if suml2 > 0.0 {
            0.5 * (scale + 1.0 / iscale)
        } else {
            1.0 / iscale
        };
    }
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1f32 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for i in 0..n {
            let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
            let w = weight(x[i]);
            sumlx += w * x[i] * l as f32;
            suml2 += w * l as f32 * l as f32;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for i in 0..n {
                let l = nearest_int(iscale * x[i]);
                l_out[i] = (nmax + l.clamp(-nmax, nmax - 1)) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// ggml's `make_q3_quants` with `do_rmse = true`; writes codes `l + nmax`.
fn make_q3_quants(x: &[f32], nmax: i32, l_out: &mut [i8]) -> f32 {
    let n = x.len();
    let max = signed_absmax(x);
    if max.abs() < GROUP_MAX_EPS {
        l_out[..n].fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..n {
        let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l_out[i] = l as i8;
        let w = x[i] * x[i];
        sumlx += w * x[i] * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for i in 0..n {
            let w = x[i] * x[i];
            let li = l_out[i] as f32;
            let mut slx = sumlx - w * x[i] * li;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * li * li;
                let new_l = nearest_int(x[i] * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != l_out[i] as i32 {
                    slx += w * x[i] * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l_out[i] = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    for l in l_out[..n].iter_mut() {
        *l += nmax as i8;
    }
    sumlx / suml2
}

/// ggml's `make_qkx2_quants`: scale and (returned, negated) min of an
/// asymmetric `nmax`-level quantization of `x`, searched over `nstep` steps.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    x: &[f32],
    weights: &[f32],
    nmax: i32,
    l_out: &mut [u8],
    the_min: &mut f32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> f32 {
    let n = x.len();
    let mut laux = [0u8; 32];
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out[..n].fill(0);
        *the_min = -min;
        return 0.0;
    }
    let nmaxf = nmax as f32;
    let mut iscale = nmaxf / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l_out[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        let diff = if use_mad { diff.abs() } else { diff * diff };
        best_error += weights[i] * diff;
    }
    if nstep < 1 {
        *the_min = -min;
        return scale;
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmaxf) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = l as u8;
            let w = weights[i];
            let lf = l as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut error = 0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                let diff = if use_mad { diff.abs() } else { diff * diff };
                error += weights[i] * diff;
            }
            if error < best_error {
                l_out[..n].copy_from_slice(&laux[..n]);
                best_error = error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    scale
}

/// Packs four 2-bit planes: byte l of each 32-byte group holds elements
/// l, l+32, l+64, l+96 of its 128-element half.
fn pack_2bit_planes(l: &[u8; QK_K], qs: &mut [u8]) {
    for j in (0..QK_K).step_by(128) {
        for k in 0..32 {
            qs[j / 4 + k] =
                l[j + k] | (l[j + k + 32] << 2) | (l[j + k + 64] << 4) | (l[j + k + 96] << 6);
        }
    }
}

// --------------------------------------------------------------- quantizers

pub(crate) fn quantize_q2_k(src: &[f32], dst: &mut [u8]) {
    const Q4SCALE: f32 = 15.0;
    let mut l = [0u8; QK_K];
    let mut weights = [0f32; 16];
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q2_K_SIZE)) {
        let mut scales = [0f32; 16];
        let mut mins = [0f32; 16];
        let (mut max_scale, mut max_min) = (0f32, 0f32);
        for j in 0..16 {
            let xs = &x[16 * j..16 * j + 16];
            for (w, v) in weights.iter_mut().zip(xs) {
                *w = v.abs();
            }
            scales[j] = make_qkx2_quants(
                xs,
                &weights,
                3,
                &mut l[16 * j..16 * j + 16],
                &mut mins[j],
                -0.5,
                0.1,
                15,
                true,
            );
            if scales[j] > max_scale {
                max_scale = scales[j];
            }
            if mins[j] > max_min {
                max_min = mins[j];
            }
        }
        if max_scale > 0.0 {
            let iscale = Q4SCALE / max_scale;
            for j in 0..16 {
                b[j] = nearest_int(iscale * scales[j]) as u8;
            }
            put_f16(b, 80, max_scale / Q4SCALE);
        } else {
            b[..16].fill(0);
            put_f16(b, 80, 0.0);
        }
        if max_min > 0.0 {
            let iscale = Q4SCALE / max_min;
            for j in 0..16 {
                b[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
            }
            put_f16(b, 82, max_min / Q4SCALE);
        } else {
            put_f16(b, 82, 0.0);
        }
        let (dall, dmin) = (f16_at(b, 80), f16_at(b, 82));
        for j in 0..16 {
            let d = dall * (b[j] & 0xf) as f32;
            if d == 0.0 {
                continue;
            }
            let dm = dmin * (b[j] >> 4) as f32;
            for i in 16 * j..16 * j + 16 {
                l[i] = nearest_int((x[i] + dm) / d).clamp(0, 3) as u8;
            }
        }
        pack_2bit_planes(&l, &mut b[16..80]);
    }
}

pub(crate) fn quantize_q3_k(src: &[f32], dst: &mut [u8]) {
    let mut l = [0i8; QK_K];
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q3_K_SIZE)) {
        let mut scales = [0f32; 16];
        let (mut max_scale, mut amax) = (0f32, 0f32);
        for j in 0..16 {
            scales[j] = make_q3_quants(&x[16 * j..16 * j + 16], 4, &mut l[16 * j..16 * j + 16]);
            let scale = scales[j].abs();
            if scale > amax {
                amax = scale;
                max_scale = scales[j];
            }
        }
        let sc = &mut b[96..108];
        sc.fill(0);
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for j in 0..16 {
                // ggml stores nearest_int into an int8_t before clamping.
                let li = (nearest_int(iscale * scales[j]) as i8).clamp(-32, 31) + 32;
                let li = li as u8;
                if j < 8 {
                    sc[j] = li & 0xf;
                } else {
                    sc[j - 8] |= (li & 0xf) << 4;
                }
                sc[j % 4 + 8] |= (li >> 4) << (2 * (j / 4));
            }
            put_f16(b, 108, 1.0 / iscale);
        } else {
            put_f16(b, 108, 0.0);
        }
        let d_all = f16_at(b, 108);
        let scales_q = scales_q3_k(b);
        for j in 0..16 {
            let d = d_all * scales_q[j] as f32;
            if d == 0.0 {
                continue;
            }
            for i in 16 * j..16 * j + 16 {
                l[i] = (nearest_int(x[i] / d).clamp(-4, 3) + 4) as i8;
            }
        }
        let hmask = &mut b[0..32];
        hmask.fill(0);
        let mut lu = [0u8; QK_K];
        for j in 0..QK_K {
            let mut v = l[j] as u8;
            if v > 3 {
                hmask[j % 32] |= 1 << (j / 32);
                v -= 4;
            }
            lu[j] = v;
        }
        pack_2bit_planes(&lu, &mut b[32..96]);
    }
}

/// Q4_K and Q5_K share everything but the code width and the packing.
fn quantize_q45_k(src: &[f32], dst: &mut [u8], five_bit: bool) {
    let (size, nmax, rmin, nstep) = if five_bit {
        (Q5_K_SIZE, 31, -0.5f32, 15)
    } else {
        (Q4_K_SIZE, 15, -1.0f32, 20)
    };
    let mut l = [0u8; QK_K];
    let mut weights = [0f32; 32];
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(size)) {
        let mut scales = [0f32; 8];
        let mut mins = [0f32; 8];
        let (mut max_scale, mut max_min) = (0f32, 0f32);
        for j in 0..8 {
            let xs = &x[32 * j..32 * j + 32];
            let mut sum_x2 = 0f32;
            for v in xs {
                sum_x2 += v * v;
            }
            let av_x = (sum_x2 / 32.0).sqrt();
            for (w, v) in weights.iter_mut().zip(xs) {
                *w = av_x + v.abs();
            }
            scales[j] = make_qkx2_quants(
                xs,
                &weights,
                nmax,
                &mut l[32 * j..32 * j + 32],
                &mut mins[j],
                rmin,
                0.1,
                nstep,
                false,
            );
            if scales[j] > max_scale {
                max_scale = scales[j];
            }
            if mins[j] > max_min {
                max_min = mins[j];
            }
        }
        let inv_scale = if max_scale > 0.0 {
            63.0 / max_scale
        } else {
            0.0
        };
        let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
        let sc = &mut b[4..16];
        for j in 0..8 {
            // ggml truncates nearest_int to uint8_t before MIN(63, .).
            let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
            let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
            if j < 4 {
                sc[j] = ls;
                sc[j + 4] = lm;
            } else {
                sc[j + 4] = (ls & 0xf) | ((lm & 0xf) << 4);
                sc[j - 4] |= (ls >> 4) << 6;
                sc[j] |= (lm >> 4) << 6;
            }
        }
        put_f16(b, 0, max_scale / 63.0);
        put_f16(b, 2, max_min / 63.0);
        let (dall, dmin) = (f16_at(b, 0), f16_at(b, 2));
        for j in 0..8 {
            let (s, m) = scale_min_k4(j, &b[4..16]);
            let d = dall * s as f32;
            if d == 0.0 {
                continue;
            }
            let dm = dmin * m as f32;
            for i in 32 * j..32 * j + 32 {
                l[i] = nearest_int((x[i] + dm) / d).clamp(0, nmax) as u8;
            }
        }
        if five_bit {
            let (qh, qs) = b[16..176].split_at_mut(32);
            qh.fill(0);
            let (mut m1, mut m2) = (1u8, 2u8);
            for (c, n) in (0..QK_K).step_by(64).enumerate() {
                for j in 0..32 {
                    let mut l1 = l[n + j];
                    if l1 > 15 {
                        l1 -= 16;
                        qh[j] |= m1;
                    }
                    let mut l2 = l[n + j + 32];
                    if l2 > 15 {
                        l2 -= 16;
                        qh[j] |= m2;
                    }
                    qs[32 * c + j] = l1 | (l2 << 4);
                }
                m1 <<= 2;
                m2 <<= 2;
            }
        } else {
            let qs = &mut b[16..144];
            for (c, n) in (0..QK_K).step_by(64).enumerate() {
                for j in 0..32 {
                    qs[32 * c + j] = l[n + j] | (l[n + j + 32] << 4);
                }
            }
        }
    }
}

pub(crate) fn quantize_q4_k(src: &[f32], dst: &mut [u8]) {
    quantize_q45_k(src, dst, false)
}

pub(crate) fn quantize_q5_k(src: &[f32], dst: &mut [u8]) {
    quantize_q45_k(src, dst, true)
}

pub(crate) fn quantize_q6_k(src: &[f32], dst: &mut [u8]) {
    let mut l = [0i8; QK_K];
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q6_K_SIZE)) {
        let mut scales = [0f32; 16];
        let (mut max_scale, mut max_abs_scale) = (0f32, 0f32);
        for ib in 0..16 {
            let scale = make_qx_quants(
                &x[16 * ib..16 * ib + 16],
                32,
                &mut l[16 * ib..16 * ib + 16],
                1,
            );
            scales[ib] = scale;
            if scale.abs() > max_abs_scale {
                max_abs_scale = scale.abs();
                max_scale = scale;
            }
        }
        if max_abs_scale < GROUP_MAX_EPS {
            b.fill(0);
            continue;
        }
        let iscale = -128.0 / max_scale;
        put_f16(b, 208, 1.0 / iscale);
        for ib in 0..16 {
            b[192 + ib] = nearest_int(iscale * scales[ib]).min(127) as i8 as u8;
        }
        let d_all = f16_at(b, 208);
        for j in 0..16 {
            let d = d_all * b[192 + j] as i8 as f32;
            if d == 0.0 {
                continue;
            }
            for i in 16 * j..16 * j + 16 {
                l[i] = (nearest_int(x[i] / d).clamp(-32, 31) + 32) as i8;
            }
        }
        let (ql, rest) = b.split_at_mut(128);
        let qh = &mut rest[..64];
        for (h, j) in (0..QK_K).step_by(128).enumerate() {
            for k in 0..32 {
                let q = |o: usize| l[j + k + o] as u8;
                ql[64 * h + k] = (q(0) & 0xf) | ((q(64) & 0xf) << 4);
                ql[64 * h + k + 32] = (q(32) & 0xf) | ((q(96) & 0xf) << 4);
                qh[32 * h + k] =
                    (q(0) >> 4) | ((q(32) >> 4) << 2) | ((q(64) >> 4) << 4) | ((q(96) >> 4) << 6);
            }
        }
    }
}

pub(crate) fn quantize_q8_k(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q8_K_SIZE)) {
        let max = signed_absmax(x);
        if max == 0.0 {
            // ggml leaves bsums unwritten here; zero is their true value.
            b.fill(0);
            continue;
        }
        let iscale = -127.0 / max;
        for j in 0..QK_K {
            b[4 + j] = nearest_int(iscale * x[j]).min(127) as i8 as u8;
        }
        for j in 0..16 {
            let sum: i32 = (0..16).map(|i| b[4 + 16 * j + i] as i8 as i32).sum();
            b[260 + 2 * j..262 + 2 * j].copy_from_slice(&(sum as i16).to_le_bytes());
        }
        b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}

// ------------------------------------------------------------- scalar dots
//
// Each block's products are summed exactly in i32, per scale group, then
// combined with the float scales in one fixed expression; the AVX2 kernels
// compute the same integers and the same expression, so they match these
// bit for bit.

#[inline(always)]
fn q8k_bsum(y: &[u8], j: usize) -> i32 {
    i16::from_le_bytes([y[260 + 2 * j], y[261 + 2 * j]]) as i32
}

/// Per-element integer products of weight codes and Q8_K activations.
#[inline(always)]
fn products(q: &[i8; QK_K], y: &[u8]) -> [i32; QK_K] {
    let mut p = [0i32; QK_K];
    for e in 0..QK_K {
        p[e] = q[e] as i32 * y[4 + e] as i8 as i32;
    }
    p
}

pub(crate) fn dot_q2_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let mut sum = 0f32;
    for i in 0..n / QK_K {
        let b = &w[i * Q2_K_SIZE..(i + 1) * Q2_K_SIZE];
        let y = &a[i * Q8_K_SIZE..(i + 1) * Q8_K_SIZE];
        codes_q2_k(b, &mut q);
        let p = products(&q, y);
        let (mut isum, mut summs) = (0i32, 0i32);
        for j in 0..16 {
            let s: i32 = p[16 * j..16 * j + 16].iter().sum();
            isum += (b[j] & 0xf) as i32 * s;
            summs += (b[j] >> 4) as i32 * q8k_bsum(y, j);
        }
        let dy = f32_at(y, 0);
        sum += dy * f16_at(b, 80) * isum as f32 - dy * f16_at(b, 82) * summs as f32;
    }
    sum
}

pub(crate) fn dot_q3_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let mut sum = 0f32;
    for i in 0..n / QK_K {
        let b = &w[i * Q3_K_SIZE..(i + 1) * Q3_K_SIZE];
        let y = &a[i * Q8_K_SIZE..(i + 1) * Q8_K_SIZE];
        codes_q3_k(b, &mut q);
        let scales = scales_q3_k(b);
        let p = products(&q, y);
        let mut isum = 0i32;
        for j in 0..16 {
            let s: i32 = p[16 * j..16 * j + 16].iter().sum();
            isum += scales[j] as i32 * s;
        }
        sum += f32_at(y, 0) * f16_at(b, 108) * isum as f32;
    }
    sum
}

fn dot_q45_k_q8_k(n: usize, w: &[u8], a: &[u8], five_bit: bool) -> f32 {
    let (size, qs_at) = if five_bit {
        (Q5_K_SIZE, 48)
    } else {
        (Q4_K_SIZE, 16)
    };
    let mut q = [0i8; QK_K];
    let mut sum = 0f32;
    for i in 0..n / QK_K {
        let b = &w[i * size..(i + 1) * size];
        let y = &a[i * Q8_K_SIZE..(i + 1) * Q8_K_SIZE];
        let qh = if five_bit { Some(&b[16..48]) } else { None };
        codes_q45_k(&b[qs_at..qs_at + 128], qh, &mut q);
        let p = products(&q, y);
        let (mut isum, mut summs) = (0i32, 0i32);
        for j in 0..8 {
            let (sc, m) = scale_min_k4(j, &b[4..16]);
            let s: i32 = p[32 * j..32 * j + 32].iter().sum();
            isum += sc as i32 * s;
            summs += m as i32 * (q8k_bsum(y, 2 * j) + q8k_bsum(y, 2 * j + 1));
        }
        let dy = f32_at(y, 0);
        sum += dy * f16_at(b, 0) * isum as f32 - dy * f16_at(b, 2) * summs as f32;
    }
    sum
}

pub(crate) fn dot_q4_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_q45_k_q8_k(n, w, a, false)
}

pub(crate) fn dot_q5_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_q45_k_q8_k(n, w, a, true)
}

pub(crate) fn dot_q6_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let mut sum = 0f32;
    for i in 0..n / QK_K {
        let b = &w[i * Q6_K_SIZE..(i + 1) * Q6_K_SIZE];
        let y = &a[i * Q8_K_SIZE..(i + 1) * Q8_K_SIZE];
        codes_q6_k(b, &mut q);
        let p = products(&q, y);
        let mut isum = 0i32;
        for j in 0..16 {
            let s: i32 = p[16 * j..16 * j + 16].iter().sum();
            isum += b[192 + j] as i8 as i32 * s;
        }
        sum += f32_at(y, 0) * f16_at(b, 208) * isum as f32;
    }
    sum
}

pub(crate) fn dot_q8_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0f32;
    for i in 0..n / QK_K {
        let b = &w[i * Q8_K_SIZE..(i + 1) * Q8_K_SIZE];
        let y = &a[i * Q8_K_SIZE..(i + 1) * Q8_K_SIZE];
        let mut isum = 0i32;
        for e in 0..QK_K {
            isum += b[4 + e] as i8 as i32 * y[4 + e] as i8 as i32;
        }
        sum += f32_at(y, 0) * f32_at(b, 0) * isum as f32;
    }
    sum
}
