//! F32, F16 and BF16: plain conversions and f32-activation dots.

use half::f16;

pub(crate) fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    }
}

pub(crate) fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    // `src` may be unaligned for u16: stage 256 halves at a time, then let
    // half convert them with F16C when the CPU has it.
    let mut stage = [f16::ZERO; 256];
    for (s, d) in src.chunks(512).zip(dst.chunks_mut(256)) {
        let halves = &mut stage[..d.len()];
        for (h, b) in halves.iter_mut().zip(s.chunks_exact(2)) {
            *h = f16::from_bits(u16::from_le_bytes([b[0], b[1]]));
        }
        halves.convert_to_f32_slice(d);
    }
}

/// bf16 is the top half of an f32.
#[inline(always)]
pub(crate) fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

pub(crate) fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = bf16_to_f32(u16::from_le_bytes([s[0], s[1]]));
    }
}

pub(crate) fn quantize_f32(src: &[f32], dst: &mut [u8]) {
    for (s, d) in src.iter().zip(dst.chunks_exact_mut(4)) {
        d.copy_from_slice(&s.to_le_bytes());
    }
}

pub(crate) fn quantize_f16(src: &[f32], dst: &mut [u8]) {
    for (s, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&f16::from_f32(*s).to_bits().to_le_bytes());
    }
}

/// ggml's `ggml_compute_fp32_to_bf16`: NaN made quiet, else round to
/// nearest even.
#[inline(always)]
pub(crate) fn f32_to_bf16(v: f32) -> u16 {
    let u = v.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    ((u as u64 + (0x7fff + ((u >> 16) & 1)) as u64) >> 16) as u16
}

pub(crate) fn quantize_bf16(src: &[f32], dst: &mut [u8]) {
    for (s, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&f32_to_bf16(*s).to_le_bytes());
    }
}

/// Eight running partial sums, so the scalar kernel has the same summation
/// shape as the 8-lane SIMD one and is not bound by one add's latency.
#[inline(always)]
fn dot_by_lanes(n: usize, mut w: impl FnMut(usize) -> f32, a: &[u8]) -> f32 {
    let mut acc = [0f32; 8];
    for i in 0..n {
        let x = f32::from_le_bytes([a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3]]);
        acc[i % 8] += w(i) * x;
    }
    acc.iter().sum()
}

pub(crate) fn dot_f32_scalar(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_by_lanes(
        n,
        |i| f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]]),
        a,
    )
}

pub(crate) fn dot_f16_scalar(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_by_lanes(
        n,
        |i| f16::from_bits(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])).to_f32(),
        a,
    )
}

pub(crate) fn dot_bf16_scalar(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_by_lanes(
        n,
        |i| bf16_to_f32(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])),
        a,
    )
}
