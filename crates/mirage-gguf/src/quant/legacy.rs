//! The 32-element "legacy" block types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1.
//!
//! Layouts (ggml `block_q4_0` etc.): Q4_0 = d:f16, qs[16]; Q4_1 = d, m, qs[16];
//! Q5_0 = d, qh:u32, qs[16]; Q5_1 = d, m, qh, qs[16]; Q8_0 = d, qs:i8[32];
//! Q8_1 = d, s = d*sum(qs), qs:i8[32]. A nibble byte j holds element j (low)
//! and element j+16 (high); qh bit j is element j's fifth bit.

use super::util::{f16_at, put_f16, signed_absmax};

const QK: usize = 32;

/// Unpacks the 4- or 5-bit codes of one block (no offset applied).
#[inline(always)]
fn unpack_nibbles(qs: &[u8], qh: u32, out: &mut [u8; QK]) {
    for j in 0..16 {
        out[j] = (qs[j] & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
        out[j + 16] = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
    }
}

#[inline(always)]
fn qh_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

pub(crate) fn dequantize_q4_0(src: &[u8], dst: &mut [f32]) {
    let mut q = [0u8; QK];
    for (b, y) in src.chunks_exact(18).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        unpack_nibbles(&b[2..18], 0, &mut q);
        for j in 0..QK {
            y[j] = (q[j] as i32 - 8) as f32 * d;
        }
    }
}

pub(crate) fn dequantize_q4_1(src: &[u8], dst: &mut [f32]) {
    let mut q = [0u8; QK];
    for (b, y) in src.chunks_exact(20).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        let m = f16_at(b, 2);
        unpack_nibbles(&b[4..20], 0, &mut q);
        for j in 0..QK {
            y[j] = q[j] as f32 * d + m;
        }
    }
}

pub(crate) fn dequantize_q5_0(src: &[u8], dst: &mut [f32]) {
    let mut q = [0u8; QK];
    for (b, y) in src.chunks_exact(22).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        unpack_nibbles(&b[6..22], qh_at(b, 2), &mut q);
        for j in 0..QK {
            y[j] = (q[j] as i32 - 16) as f32 * d;
        }
    }
}

pub(crate) fn dequantize_q5_1(src: &[u8], dst: &mut [f32]) {
    let mut q = [0u8; QK];
    for (b, y) in src.chunks_exact(24).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        let m = f16_at(b, 2);
        unpack_nibbles(&b[8..24], qh_at(b, 4), &mut q);
        for j in 0..QK {
            y[j] = q[j] as f32 * d + m;
        }
    }
}

pub(crate) fn dequantize_q8_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(34).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        for j in 0..QK {
            y[j] = b[2 + j] as i8 as f32 * d;
        }
    }
}

pub(crate) fn dequantize_q8_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(36).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        for j in 0..QK {
            y[j] = b[4 + j] as i8 as f32 * d;
        }
    }
}

#[inline(always)]
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

#[inline(always)]
fn pack_nibbles(q: &[u8; QK], qs: &mut [u8]) -> u32 {
    let mut qh = 0u32;
    for j in 0..16 {
        qs[j] = (q[j] & 0x0f) | ((q[j + 16] & 0x0f) << 4);
        qh |= (((q[j] >> 4) & 1) as u32) << j;
        qh |= (((q[j + 16] >> 4) & 1) as u32) << (j + 16);
    }
    qh
}

/// ggml's `(int8_t)(v)` then `MIN(hi, .)`, for the non-negative range the
/// quantizers produce; the lower clamp only matters for NaN/inf input.
#[inline(always)]
fn trunc_code(v: f32, hi: i32) -> u8 {
    (v as i32).clamp(0, hi) as u8
}

/// Symmetric 4/5-bit quantizers: d = max / -(2^(bits-1)).
fn quantize_symmetric(src: &[f32], dst: &mut [u8], bits: u32) {
    let half = (1 << (bits - 1)) as f32;
    let hi = (1 << bits) - 1;
    let ts = if bits == 4 { 18 } else { 22 };
    let mut q = [0u8; QK];
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(ts)) {
        let d = signed_absmax(x) / -half;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        for j in 0..QK {
            q[j] = trunc_code(x[j] * id + (half + 0.5), hi);
        }
        if bits == 4 {
            pack_nibbles(&q, &mut b[2..18]);
        } else {
            let qh = pack_nibbles(&q, &mut b[6..22]);
            b[2..6].copy_from_slice(&qh.to_le_bytes());
        }
    }
}

/// Asymmetric 4/5-bit quantizers: d = (max - min) / (2^bits - 1), m = min.
fn quantize_asymmetric(src: &[f32], dst: &mut [u8], bits: u32) {
    let hi = (1 << bits) - 1;
    let ts = if bits == 4 { 20 } else { 24 };
    let mut q = [0u8; QK];
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(ts)) {
        let (min, max) = min_max(x);
        let d = (max - min) / hi as f32;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        put_f16(b, 2, min);
        for j in 0..QK {
            q[j] = trunc_code((x[j] - min) * id + 0.5, hi);
        }
        if bits == 4 {
            pack_nibbles(&q, &mut b[4..20]);
        } else {
            let qh = pack_nibbles(&q, &mut b[8..24]);
            b[4..8].copy_from_slice(&qh.to_le_bytes());
        }
    }
}

pub(crate) fn quantize_q4_0(src: &[f32], dst: &mut [u8]) {
    quantize_symmetric(src, dst, 4)
}
pub(crate) fn quantize_q5_0(src: &[f32], dst: &mut [u8]) {
    quantize_symmetric(src, dst, 5)
}
pub(crate) fn quantize_q4_1(src: &[f32], dst: &mut [u8]) {
    quantize_asymmetric(src, dst, 4)
}
pub(crate) fn quantize_q5_1(src: &[f32], dst: &mut [u8]) {
    quantize_asymmetric(src, dst, 5)
}

/// Q8_0/Q8_1 codes: d = amax/127, q = roundf(x/d) (half away from zero).
#[inline(always)]
fn quantize_8bit(x: &[f32], qs: &mut [u8]) -> (f32, i32) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for j in 0..QK {
        let q = (x[j] * id).round() as i8;
        qs[j] = q as u8;
        sum += q as i32;
    }
    (d, sum)
}

pub(crate) fn quantize_q8_0(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(34)) {
        let (d, _) = quantize_8bit(x, &mut b[2..34]);
        put_f16(b, 0, d);
    }
}

pub(crate) fn quantize_q8_1(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(36)) {
        let (d, sum) = quantize_8bit(x, &mut b[4..36]);
        put_f16(b, 0, d);
        put_f16(b, 2, sum as f32 * d);
    }
}

#[inline(always)]
fn idot(w: &[u8; QK], offset: i32, a: &[u8]) -> i32 {
    let mut s = 0i32;
    for j in 0..QK {
        s += (w[j] as i32 - offset) * (a[j] as i8 as i32);
    }
    s
}

pub(crate) fn dot_q4_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0u8; QK];
    let mut sum = 0f32;
    for i in 0..n / QK {
        let (b, y) = (&w[i * 18..i * 18 + 18], &a[i * 34..i * 34 + 34]);
        unpack_nibbles(&b[2..18], 0, &mut q);
        sum += idot(&q, 8, &y[2..]) as f32 * (f16_at(b, 0) * f16_at(y, 0));
    }
    sum
}

pub(crate) fn dot_q5_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0u8; QK];
    let mut sum = 0f32;
    for i in 0..n / QK {
        let (b, y) = (&w[i * 22..i * 22 + 22], &a[i * 34..i * 34 + 34]);
        unpack_nibbles(&b[6..22], qh_at(b, 2), &mut q);
        sum += idot(&q, 16, &y[2..]) as f32 * (f16_at(b, 0) * f16_at(y, 0));
    }
    sum
}

pub(crate) fn dot_q8_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0f32;
    for i in 0..n / QK {
        let (b, y) = (&w[i * 34..i * 34 + 34], &a[i * 34..i * 34 + 34]);
        let mut s = 0i32;
        for j in 0..QK {
            s += (b[2 + j] as i8 as i32) * (y[2 + j] as i8 as i32);
        }
        sum += s as f32 * (f16_at(b, 0) * f16_at(y, 0));
    }
    sum
}

pub(crate) fn dot_q4_1_q8_1(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0u8; QK];
    let mut sum = 0f32;
    for i in 0..n / QK {
        let (b, y) = (&w[i * 20..i * 20 + 20], &a[i * 36..i * 36 + 36]);
        unpack_nibbles(&b[4..20], 0, &mut q);
        let s = idot(&q, 0, &y[4..]);
        sum += (f16_at(b, 0) * f16_at(y, 0)) * s as f32 + f16_at(b, 2) * f16_at(y, 2);
    }
    sum
}

pub(crate) fn dot_q5_1_q8_1(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0u8; QK];
    let mut sum = 0f32;
    for i in 0..n / QK {
        let (b, y) = (&w[i * 24..i * 24 + 24], &a[i * 36..i * 36 + 36]);
        unpack_nibbles(&b[8..24], qh_at(b, 4), &mut q);
        let s = idot(&q, 0, &y[4..]);
        sum += (f16_at(b, 0) * f16_at(y, 0)) * s as f32 + f16_at(b, 2) * f16_at(y, 2);
    }
    sum
}

pub(crate) fn dot_q8_1_q8_1(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0f32;
    for i in 0..n / QK {
        let (b, y) = (&w[i * 36..i * 36 + 36], &a[i * 36..i * 36 + 36]);
        let mut s = 0i32;
        for j in 0..QK {
            s += (b[4 + j] as i8 as i32) * (y[4 + j] as i8 as i32);
        }
        sum += s as f32 * (f16_at(b, 0) * f16_at(y, 0));
    }
    sum
}
