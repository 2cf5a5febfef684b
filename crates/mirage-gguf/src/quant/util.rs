//! Small helpers shared by the codecs.

use half::f16;

/// Reads the little-endian f16 at `b[0..2]` as f32 (exact).
#[inline(always)]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

/// Writes `v` as a little-endian f16 (round to nearest even, like
/// `GGML_FP32_TO_FP16`).
#[inline(always)]
pub(crate) fn put_f16(b: &mut [u8], off: usize, v: f32) {
    b[off..off + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

/// Reads the little-endian f32 at `off`.
#[inline(always)]
pub(crate) fn f32_at(b: &[u8], off: usize) -> f32 {
    f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// ggml's `nearest_int`: round half to even through the 1.5*2^23 trick.
/// Exact for |v| <= 4194303, which the quantizers guarantee for finite input.
#[inline(always)]
pub(crate) fn nearest_int(v: f32) -> i32 {
    let val = v + 12_582_912.0f32;
    ((val.to_bits() & 0x007f_ffff) as i32) - 0x0040_0000
}

/// The value of largest magnitude (the first one on ties), as ggml's
/// quantizers pick it; its magnitude is their `amax`.
#[inline(always)]
pub(crate) fn signed_absmax(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// ggml's `GROUP_MAX_EPS`: groups whose largest magnitude is below this are
/// stored as all zero.
pub(crate) const GROUP_MAX_EPS: f32 = 1e-15;
