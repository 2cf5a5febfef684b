//! NVFP4: NVIDIA's 4-bit float weight format, as an artifact-level type.
//!
//! Layout of a tensor of `n` elements (`n` a multiple of 16):
//! - one FP32 `tensor_scale` for the whole tensor;
//! - `n / 16` block scales, one unsigned E4M3 byte per 16 consecutive
//!   elements (E4M3 "fn": bias 7, 3 mantissa bits, max 448, sign bit 0);
//! - `n / 2` bytes of E2M1 codes (values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}; bit 3
//!   is the sign), element `2j` in the low nibble of byte `j`, `2j + 1` in
//!   the high nibble (the order CUTLASS's `float_e2m1_t` arrays use).
//!
//! Element `i` decodes to `e2m1(code_i) * (e4m3(scale_{i/16}) * tensor_scale)`,
//! the product in brackets rounded to f32 first.
//!
//! Quantization rule (all arithmetic in f32, every rounding to nearest with
//! ties to even, as `ml_dtypes` casts do; `scripts/gen_nvfp4_fixtures.py`
//! is the independent reference and the tests compare bit for bit):
//! 1. `tensor_scale = amax / 2688` (2688 = 6 · 448), amax over the tensor;
//! 2. per block: `s = min(block_amax / (6 · tensor_scale), 448)`, rounded to
//!    E4M3; `denom = e4m3(s) · tensor_scale`;
//! 3. per element: `q = clamp(x / denom, -6, 6)`, rounded to E2M1 (ties go
//!    to the even code: 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4;
//!    the sign is kept, so -0.1 gives code 8, "-0");
//! 4. when `tensor_scale` or `denom` is 0 (all-zero tensor or block, or a
//!    block so small its scale rounds to E4M3 zero) the codes are 0.
//!
//! This is not ggml's NVFP4 (GGUF type id 40 in gguf-py 0.19): that one has
//! blocks of 64 (four E4M3 scales + 32 bytes, elements 0..7 of each 16 in
//! low nibbles, 8..15 in high nibbles) and no per-tensor scale. MIRAGE keeps
//! NVFP4 out of [`crate::GgmlType`] and stores it in its artifacts with the
//! byte layout of [`Nvfp4Tensor::to_bytes`]; docs/NVFP4.md says why.

use super::QuantError;
use crate::types::GgmlType;

/// Elements per block scale.
pub const NVFP4_BLOCK_SIZE: usize = 16;
/// Largest E2M1 magnitude.
pub const E2M1_MAX: f32 = 6.0;
/// Largest finite E4M3 ("fn") value.
pub const E4M3_MAX: f32 = 448.0;
/// The tag MIRAGE artifacts use for this type (it has no GGUF type id).
pub const NVFP4_ARTIFACT_TAG: &str = "nvfp4";

/// E2M1 values of the 16 codes (bit 3 = sign).
pub const E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Twice the E2M1 values: integers, so a dot with Q8 activations is exact.
const E2M1_DOUBLED: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Why an NVFP4 call was refused.
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
pub enum Nvfp4Error {
    /// The element count (or row length) is not a multiple of the block.
    #[error("NVFP4: {n} elements is not a multiple of {block}")]
    NotBlockMultiple {
        /// The count asked for.
        n: usize,
        /// The multiple required (16, or 32 with Q8_0 activations).
        block: usize,
    },
    /// A buffer's length does not match the element count.
    #[error("NVFP4: {what} holds {got}, expected {expected}")]
    LengthMismatch {
        /// Which buffer.
        what: &'static str,
        /// The length the element count requires.
        expected: usize,
        /// The length passed in.
        got: usize,
    },
    /// An input value is NaN or infinite (NVFP4 cannot represent it).
    #[error("NVFP4: element {index} is not finite ({value})")]
    NonFinite {
        /// Its index.
        index: usize,
        /// The value.
        value: f32,
    },
    /// The tensor scale read back is negative or not finite.
    #[error("NVFP4: tensor scale {0} is not a finite non-negative number")]
    BadTensorScale(f32),
    /// Decoding the source tensor failed.
    #[error("NVFP4 requantize: {0}")]
    Source(#[from] QuantError),
}

/// Decodes an E2M1 code (low 4 bits of `code`).
#[inline]
pub fn e2m1_to_f32(code: u8) -> f32 {
    E2M1_VALUES[(code & 0x0f) as usize]
}

/// Rounds `x` to the nearest E2M1 code, ties to even, saturating at ±6.
/// NaN maps to +0 (callers reject non-finite input first).
#[inline]
pub fn f32_to_e2m1(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 8 } else { 0 };
    let a = x.abs();
    // Midpoints between neighbours; `<=` where the lower code is even, `<`
    // where the upper one is: that is round-half-to-even on the codes.
    let magnitude = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else if a >= 5.0 {
        7
    } else {
        0 // NaN
    };
    sign | magnitude
}

/// Decodes an unsigned E4M3 ("fn") byte (the sign bit is ignored). 0x7f,
/// E4M3fn's NaN pattern, which the quantizer never writes, decodes as NaN.
#[inline]
pub fn e4m3_to_f32(code: u8) -> f32 {
    E4M3_LUT[code as usize]
}

const fn e4m3_decode(code: u8) -> f32 {
    let exp = (code >> 3) & 0x0f;
    let man = (code & 0x07) as f32;
    if exp == 0x0f && code & 0x07 == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        man * (1.0 / 512.0)
    } else {
        (1.0 + man / 8.0) * f32::from_bits(((exp as u32 + 127 - 7) & 0xff) << 23)
    }
}

/// All 256 E4M3 values: the dot kernels read a block scale per 16 elements.
static E4M3_LUT: [f32; 256] = {
    let mut lut = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        lut[i] = e4m3_decode(i as u8);
        i += 1;
    }
    lut
};

/// Rounds a non-negative `x` to unsigned E4M3, ties to even, saturating at
/// 448 (E4M3 "fn" has no infinity; ml_dtypes would give NaN above 464).
/// Negative input and NaN give 0.
#[inline]
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() || x <= 0.0 {
        return 0;
    }
    let x = x.min(E4M3_MAX);
    if x < 1.0 / 64.0 {
        // Subnormal range: multiples of 2^-9; 8 · 2^-9 is the first normal,
        // whose code is 8 as well.
        return (x * 512.0).round_ties_even() as u8;
    }
    let e = ((x.to_bits() >> 23) & 0xff) as i32 - 127; // -6..=8
                                                       // x · 2^(3-e) is in [8, 16) and exact (a power-of-two scaling).
    let scaled = x * f32::from_bits(((3 - e + 127) as u32) << 23);
    let mut mantissa = scaled.round_ties_even() as i32;
    let mut e = e;
    if mantissa == 16 {
        mantissa = 8;
        e += 1;
    }
    (((e + 7) as u8) << 3) | (mantissa - 8) as u8
}

/// A tensor in NVFP4 (see the module doc for the layout and the rule).
#[derive(Debug, Clone, PartialEq)]
pub struct Nvfp4Tensor {
    /// Dims in ggml order (`dims[0]` is the contiguous row length, a
    /// multiple of 16, so no block straddles two rows).
    pub dims: Vec<u64>,
    /// The per-tensor FP32 scale.
    pub tensor_scale: f32,
    /// One E4M3 byte per 16 elements, row-major.
    pub block_scales: Vec<u8>,
    /// Two E2M1 codes per byte, low nibble first.
    pub packed: Vec<u8>,
}

fn check_len(what: &'static str, expected: usize, got: usize) -> Result<(), Nvfp4Error> {
    if expected != got {
        return Err(Nvfp4Error::LengthMismatch {
            what,
            expected,
            got,
        });
    }
    Ok(())
}

fn check_blocks(n: usize) -> Result<(), Nvfp4Error> {
    if !n.is_multiple_of(NVFP4_BLOCK_SIZE) {
        return Err(Nvfp4Error::NotBlockMultiple {
            n,
            block: NVFP4_BLOCK_SIZE,
        });
    }
    Ok(())
}

/// Quantizes `src` (length a multiple of 16) into `block_scales`
/// (`len/16` bytes) and `packed` (`len/2` bytes); returns the tensor scale.
pub fn quantize_into(
    src: &[f32],
    block_scales: &mut [u8],
    packed: &mut [u8],
) -> Result<f32, Nvfp4Error> {
    let n = src.len();
    check_blocks(n)?;
    check_len("block scales", n / NVFP4_BLOCK_SIZE, block_scales.len())?;
    check_len("packed bytes", n / 2, packed.len())?;
    let mut amax = 0f32;
    for (index, &value) in src.iter().enumerate() {
        if !value.is_finite() {
            return Err(Nvfp4Error::NonFinite { index, value });
        }
        amax = amax.max(value.abs());
    }
    let tensor_scale = amax / (E2M1_MAX * E4M3_MAX);
    encode_blocks(src, tensor_scale, block_scales, packed);
    Ok(tensor_scale)
}

/// Encodes whole blocks of `src` with a given tensor scale (the part of
/// [`quantize_into`] after the tensor's absolute maximum is known). Lengths
/// are the caller's to check.
fn encode_blocks(src: &[f32], tensor_scale: f32, block_scales: &mut [u8], packed: &mut [u8]) {
    for ((block, scale), out) in src
        .chunks_exact(NVFP4_BLOCK_SIZE)
        .zip(block_scales.iter_mut())
        .zip(packed.chunks_exact_mut(NVFP4_BLOCK_SIZE / 2))
    {
        if tensor_scale == 0.0 {
            *scale = 0;
            out.fill(0);
            continue;
        }
        let block_amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        *scale = f32_to_e4m3((block_amax / (E2M1_MAX * tensor_scale)).min(E4M3_MAX));
        let denom = e4m3_to_f32(*scale) * tensor_scale;
        if denom == 0.0 {
            out.fill(0);
            continue;
        }
        let code = |x: f32| f32_to_e2m1((x / denom).clamp(-E2M1_MAX, E2M1_MAX));
        for (byte, pair) in out.iter_mut().zip(block.chunks_exact(2)) {
            *byte = code(pair[0]) | (code(pair[1]) << 4);
        }
    }
}

/// Decodes `dst.len()` elements from NVFP4 parts.
pub fn dequantize_into(
    tensor_scale: f32,
    block_scales: &[u8],
    packed: &[u8],
    dst: &mut [f32],
) -> Result<(), Nvfp4Error> {
    let n = dst.len();
    check_blocks(n)?;
    check_len("block scales", n / NVFP4_BLOCK_SIZE, block_scales.len())?;
    check_len("packed bytes", n / 2, packed.len())?;
    for ((out, &scale), bytes) in dst
        .chunks_exact_mut(NVFP4_BLOCK_SIZE)
        .zip(block_scales)
        .zip(packed.chunks_exact(NVFP4_BLOCK_SIZE / 2))
    {
        let block_scale = e4m3_to_f32(scale) * tensor_scale;
        for (pair, &byte) in out.chunks_exact_mut(2).zip(bytes) {
            pair[0] = e2m1_to_f32(byte) * block_scale;
            pair[1] = e2m1_to_f32(byte >> 4) * block_scale;
        }
    }
    Ok(())
}

impl Nvfp4Tensor {
    /// Quantizes `src` of shape `dims` (ggml order; `dims[0] % 16 == 0`).
    pub fn quantize(src: &[f32], dims: &[u64]) -> Result<Self, Nvfp4Error> {
        let n = dims_elements(dims)?;
        check_len("source elements", n, src.len())?;
        let mut block_scales = vec![0u8; n / NVFP4_BLOCK_SIZE];
        let mut packed = vec![0u8; n / 2];
        let tensor_scale = quantize_into(src, &mut block_scales, &mut packed)?;
        Ok(Nvfp4Tensor {
            dims: dims.to_vec(),
            tensor_scale,
            block_scales,
            packed,
        })
    }

    /// Dequantizes a GGUF tensor of any supported [`GgmlType`] and quantizes
    /// it to NVFP4 (the artifact builder's requantize step). The NVFP4
    /// error adds to the source format's: this is a second rounding.
    pub fn requantize(ty: GgmlType, data: &[u8], dims: &[u64]) -> Result<Self, Nvfp4Error> {
        let n = dims_elements(dims)?;
        let mut values = vec![0f32; n];
        super::dequantize(ty, data, &mut values)?;
        Self::quantize(&values, dims)
    }

    /// [`Nvfp4Tensor::requantize`] on up to `threads` threads (rows split in
    /// contiguous chunks): bit-identical to it. The tensor scale needs the
    /// whole tensor's absolute maximum, so the rows are first dequantized
    /// (and their maxima taken) in parallel, then encoded in parallel with
    /// the shared scale. A 7B model's matrices take minutes on one core.
    pub fn requantize_parallel(
        ty: GgmlType,
        data: &[u8],
        dims: &[u64],
        threads: usize,
    ) -> Result<Self, Nvfp4Error> {
        let n = dims_elements(dims)?;
        let row_len = dims.first().copied().unwrap_or(0) as usize;
        let rows = n.checked_div(row_len).unwrap_or(0);
        let threads = threads.clamp(1, rows.max(1));
        let row_bytes = crate::quant::row_bytes(ty, row_len)?;
        if threads == 1
            || !row_len.is_multiple_of(NVFP4_BLOCK_SIZE)
            || row_bytes.checked_mul(rows) != Some(data.len())
        {
            return Self::requantize(ty, data, dims);
        }
        let per = rows.div_ceil(threads);
        let mut values = vec![0f32; n];
        let maxima = std::thread::scope(|s| {
            let jobs: Vec<_> = values
                .chunks_mut(per * row_len)
                .zip(data.chunks(per * row_bytes))
                .enumerate()
                .map(|(c, (dst, src))| {
                    s.spawn(move || -> Result<f32, Nvfp4Error> {
                        super::dequantize(ty, src, dst)?;
                        let mut amax = 0f32;
                        for (i, &value) in dst.iter().enumerate() {
                            if !value.is_finite() {
                                let index = c * per * row_len + i;
                                return Err(Nvfp4Error::NonFinite { index, value });
                            }
                            amax = amax.max(value.abs());
                        }
                        Ok(amax)
                    })
                })
                .collect();
            jobs.into_iter()
                .map(|j| j.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect::<Result<Vec<f32>, Nvfp4Error>>()
        })?;
        let amax = maxima.into_iter().fold(0f32, f32::max);
        let tensor_scale = amax / (E2M1_MAX * E4M3_MAX);
        let mut block_scales = vec![0u8; n / NVFP4_BLOCK_SIZE];
        let mut packed = vec![0u8; n / 2];
        std::thread::scope(|s| {
            for ((src, bs), pk) in values
                .chunks(per * row_len)
                .zip(block_scales.chunks_mut(per * row_len / NVFP4_BLOCK_SIZE))
                .zip(packed.chunks_mut(per * row_len / 2))
            {
                s.spawn(move || encode_blocks(src, tensor_scale, bs, pk));
            }
        });
        Ok(Nvfp4Tensor {
            dims: dims.to_vec(),
            tensor_scale,
            block_scales,
            packed,
        })
    }

    /// [`Nvfp4Tensor::requantize`] of a tensor read from a GGUF file.
    pub fn from_gguf(view: &crate::tensor::TensorView<'_>) -> Result<Self, Nvfp4Error> {
        Self::requantize(view.ty(), view.data, view.dims())
    }

    /// Element count.
    pub fn n_elements(&self) -> usize {
        self.packed.len() * 2
    }

    /// Row length (`dims[0]`).
    pub fn row_len(&self) -> usize {
        self.dims.first().copied().unwrap_or(0) as usize
    }

    /// Decodes the whole tensor.
    pub fn dequantize(&self) -> Result<Vec<f32>, Nvfp4Error> {
        let mut out = vec![0f32; self.n_elements()];
        dequantize_into(
            self.tensor_scale,
            &self.block_scales,
            &self.packed,
            &mut out,
        )?;
        Ok(out)
    }

    /// The NVFP4 parts of row `r`: `(block scales, packed bytes)`.
    pub fn row(&self, r: usize) -> Option<(&[u8], &[u8])> {
        let len = self.row_len();
        let (s, p) = (len / NVFP4_BLOCK_SIZE, len / 2);
        Some((
            self.block_scales.get(r * s..(r + 1) * s)?,
            self.packed.get(r * p..(r + 1) * p)?,
        ))
    }

    /// Serialized form in MIRAGE artifacts, little endian:
    /// `tensor_scale: f32`, then the block scales (`n/16` bytes), then the
    /// packed codes (`n/2` bytes). Dims live in the artifact's tensor record.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + self.block_scales.len() + self.packed.len());
        out.extend_from_slice(&self.tensor_scale.to_le_bytes());
        out.extend_from_slice(&self.block_scales);
        out.extend_from_slice(&self.packed);
        out
    }

    /// Parses [`Nvfp4Tensor::to_bytes`]'s layout for a tensor of shape `dims`.
    pub fn from_bytes(bytes: &[u8], dims: &[u64]) -> Result<Self, Nvfp4Error> {
        let n = dims_elements(dims)?;
        let expected = serialized_len(n);
        check_len("serialized bytes", expected, bytes.len())?;
        let tensor_scale = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        if !(tensor_scale.is_finite() && tensor_scale >= 0.0) {
            return Err(Nvfp4Error::BadTensorScale(tensor_scale));
        }
        let (scales, packed) = bytes[4..].split_at(n / NVFP4_BLOCK_SIZE);
        Ok(Nvfp4Tensor {
            dims: dims.to_vec(),
            tensor_scale,
            block_scales: scales.to_vec(),
            packed: packed.to_vec(),
        })
    }
}

/// Bytes of [`Nvfp4Tensor::to_bytes`] for `n` elements (4.5 bits/element + 4).
pub fn serialized_len(n: usize) -> usize {
    4 + n / NVFP4_BLOCK_SIZE + n / 2
}

fn dims_elements(dims: &[u64]) -> Result<usize, Nvfp4Error> {
    let row = dims.first().copied().unwrap_or(0) as usize;
    if !row.is_multiple_of(NVFP4_BLOCK_SIZE) {
        return Err(Nvfp4Error::NotBlockMultiple {
            n: row,
            block: NVFP4_BLOCK_SIZE,
        });
    }
    let n = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .and_then(|n| usize::try_from(n).ok())
        .ok_or(Nvfp4Error::LengthMismatch {
            what: "dims product",
            expected: usize::MAX,
            got: 0,
        })?;
    Ok(n)
}

/// Dot product of one NVFP4 row (`block_scales`, `packed`, `n = act.len()`
/// elements) with f32 activations: per block, the E2M1 values times the
/// activations summed in f32, times the block scale.
pub fn dot_f32(
    tensor_scale: f32,
    block_scales: &[u8],
    packed: &[u8],
    act: &[f32],
) -> Result<f32, Nvfp4Error> {
    let n = act.len();
    check_blocks(n)?;
    check_len("block scales", n / NVFP4_BLOCK_SIZE, block_scales.len())?;
    check_len("packed bytes", n / 2, packed.len())?;
    let mut sum = 0f32;
    for ((x, &scale), bytes) in act
        .chunks_exact(NVFP4_BLOCK_SIZE)
        .zip(block_scales)
        .zip(packed.chunks_exact(NVFP4_BLOCK_SIZE / 2))
    {
        let mut block = 0f32;
        for (pair, &byte) in x.chunks_exact(2).zip(bytes) {
            block += e2m1_to_f32(byte) * pair[0] + e2m1_to_f32(byte >> 4) * pair[1];
        }
        sum += block * (e4m3_to_f32(scale) * tensor_scale);
    }
    Ok(sum)
}

const Q8_0_BLOCK: usize = 32;
const Q8_0_BYTES: usize = 34;

fn check_q8(n: usize, block_scales: &[u8], packed: &[u8], act: &[u8]) -> Result<(), Nvfp4Error> {
    if !n.is_multiple_of(Q8_0_BLOCK) {
        return Err(Nvfp4Error::NotBlockMultiple {
            n,
            block: Q8_0_BLOCK,
        });
    }
    check_len("block scales", n / NVFP4_BLOCK_SIZE, block_scales.len())?;
    check_len("packed bytes", n / 2, packed.len())?;
    check_len(
        "Q8_0 activation bytes",
        n / Q8_0_BLOCK * Q8_0_BYTES,
        act.len(),
    )
}

/// Dot product of one NVFP4 row with `n` activations quantized as ggml
/// Q8_0 (`n` a multiple of 32; each Q8_0 block spans two NVFP4 blocks).
/// Each 16-element product is summed exactly in integers (doubled E2M1
/// values are integers); the fastest kernel this CPU runs is used.
pub fn dot_q8_0(
    n: usize,
    tensor_scale: f32,
    block_scales: &[u8],
    packed: &[u8],
    act: &[u8],
) -> Result<f32, Nvfp4Error> {
    check_q8(n, block_scales, packed, act)?;
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            // SAFETY: lengths checked above; AVX2, FMA and F16C detected.
            return Ok(unsafe { dot_q8_0_avx2(n, tensor_scale, block_scales, packed, act) });
        }
    }
    Ok(dot_q8_0_kernel(n, tensor_scale, block_scales, packed, act))
}

/// [`dot_q8_0`] with the portable scalar kernel (the SIMD kernel's reference).
pub fn dot_q8_0_scalar(
    n: usize,
    tensor_scale: f32,
    block_scales: &[u8],
    packed: &[u8],
    act: &[u8],
) -> Result<f32, Nvfp4Error> {
    check_q8(n, block_scales, packed, act)?;
    Ok(dot_q8_0_kernel(n, tensor_scale, block_scales, packed, act))
}

fn q8_scale(block: &[u8]) -> f32 {
    half::f16::from_le_bytes([block[0], block[1]]).to_f32()
}

fn dot_q8_0_kernel(n: usize, tensor_scale: f32, scales: &[u8], packed: &[u8], act: &[u8]) -> f32 {
    let mut sum = 0f32;
    for b in 0..n / Q8_0_BLOCK {
        let q8 = &act[b * Q8_0_BYTES..(b + 1) * Q8_0_BYTES];
        let d = q8_scale(q8);
        let mut block_sum = 0f32;
        for half_block in 0..2 {
            let bytes = &packed[b * 16 + half_block * 8..b * 16 + half_block * 8 + 8];
            let y = &q8[2 + half_block * 16..2 + half_block * 16 + 16];
            let mut isum = 0i32;
            for (j, &byte) in bytes.iter().enumerate() {
                isum += E2M1_DOUBLED[(byte & 0x0f) as usize] as i32 * y[2 * j] as i8 as i32;
                isum += E2M1_DOUBLED[(byte >> 4) as usize] as i32 * y[2 * j + 1] as i8 as i32;
            }
            block_sum += isum as f32 * e4m3_to_f32(scales[b * 2 + half_block]);
        }
        sum += block_sum * d;
    }
    // Halve once: the integer sums used doubled E2M1 values.
    sum * (0.5 * tensor_scale)
}

/// AVX2 kernel of [`dot_q8_0`]: nibbles → doubled E2M1 bytes by `pshufb`,
/// ggml's sign trick for `maddubs`, per-16 integer sums scaled in f32.
///
/// # Safety
/// Lengths as checked by `check_q8`; the CPU has AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q8_0_avx2(
    n: usize,
    tensor_scale: f32,
    scales: &[u8],
    packed: &[u8],
    act: &[u8],
) -> f32 {
    use std::arch::x86_64::*;
    let lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(E2M1_DOUBLED.as_ptr() as *const __m128i));
    let low_mask = _mm_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    for b in 0..n / Q8_0_BLOCK {
        let q8 = act.as_ptr().add(b * Q8_0_BYTES);
        // 16 bytes = 32 codes; byte j holds elements 2j (low) and 2j+1 (high).
        let bytes = _mm_loadu_si128(packed.as_ptr().add(b * 16) as *const __m128i);
        let lo = _mm_and_si128(bytes, low_mask);
        let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);
        let codes = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
        let w = _mm256_shuffle_epi8(lut, codes);
        let y = _mm256_loadu_si256(q8.add(2) as *const __m256i);
        let products = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w));
        // Lanes 0..3 sum elements 0..15 (first scale), lanes 4..7 the rest.
        let isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(products, ones));
        let d_bits = u16::from_le_bytes([*q8, *q8.add(1)]);
        let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(d_bits as i32)));
        let s0 = E4M3_LUT[*scales.get_unchecked(b * 2) as usize] * d;
        let s1 = E4M3_LUT[*scales.get_unchecked(b * 2 + 1) as usize] * d;
        let scale = _mm256_set_ps(s1, s1, s1, s1, s0, s0, s0, s0);
        acc = _mm256_fmadd_ps(isum, scale, acc);
    }
    let sum128 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    let sum64 = _mm_add_ps(sum128, _mm_movehl_ps(sum128, sum128));
    let sum32 = _mm_add_ss(sum64, _mm_shuffle_ps(sum64, sum64, 1));
    _mm_cvtss_f32(sum32) * (0.5 * tensor_scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_codes_round_trip() {
        for code in 0u8..0x7f {
            let v = e4m3_to_f32(code);
            assert_eq!(f32_to_e4m3(v), code, "code {code:#x} value {v}");
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(f32_to_e4m3(1e9), 0x7e);
        assert_eq!(f32_to_e4m3(-1.0), 0);
    }

    #[test]
    fn e2m1_codes_round_trip() {
        for code in 0u8..16 {
            assert_eq!(f32_to_e2m1(e2m1_to_f32(code)), code);
        }
    }
}
