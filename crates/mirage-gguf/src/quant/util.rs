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

/// How far ahead of the weight bytes it is reading a decode kernel asks
/// for the next ones. Decode streams each matrix once, front to back, and
/// on some machines (an Intel Xeon VM: 6.5 against 12.3 GB/s for one
/// thread on Q4_K out of cache) the hardware prefetchers alone keep too
/// few lines in flight; 2 KiB ahead was the best of 256 B to 4 KiB there.
pub(crate) const PREFETCH_AHEAD: usize = 2048;

/// Asks the caches for the lines of `span` moved 2 KiB (`PREFETCH_AHEAD`)
/// on: a kernel calls it with each block it reads, so the stream it will
/// read is in flight before it gets there. A hint only: it reads nothing
/// the program sees and never faults, past the end of the data included.
#[inline(always)]
pub fn prefetch_ahead(span: &[u8]) {
    prefetch_ahead_of(span.as_ptr(), span.len());
}

/// [`prefetch_ahead`] of the `len` bytes at `p` (which may point anywhere:
/// nothing is read).
#[inline(always)]
pub(crate) fn prefetch_ahead_of(p: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let p = p.wrapping_add(PREFETCH_AHEAD);
        let mut o = 0;
        while o < len {
            // SAFETY: a prefetch has no architectural effect and does not
            // fault on any address; `wrapping_add` keeps the address
            // arithmetic defined beyond the allocation.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(o) as *const i8) };
            o += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, len);
}
