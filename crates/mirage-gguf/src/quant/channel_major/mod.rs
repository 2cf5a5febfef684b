//! The channel-major layout of a quantized matrix: the same ggml blocks,
//! re-arranged so that the weights one *input channel* multiplies are
//! contiguous, and sparse matrix-vector kernels over a subset of input
//! channels (activation sparsity: the channels whose activation is too small
//! to matter are skipped, and their bytes are never read).
//!
//! A ggml matrix `W` (`rows` outputs x `cols` input channels) stores each
//! output row as blocks along the input dimension: every block holds the
//! integer codes of a run of input channels plus the scale(s) those codes
//! share. Those scales belong to one output row and one *group* of input
//! channels (32 channels for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K, 16 for
//! Q6_K; the K-quants add one header per output row and 256 channels). The
//! channel-major layout keeps every code and every scale bit for bit — the
//! repacked matrix is the source matrix, not a re-quantization of it — and
//! orders them as:
//!
//! ```text
//! for tile t (outputs t*T .. min((t+1)*T, rows); T a multiple of 128)
//!   for super-block s (256 channels for K-quants, one group otherwise)
//!     [K-quants only] header: per output of the tile, d (and dmin) as f16
//!     for group g of s
//!       scales: per output of the tile, the group's scale record
//!       for channel i of g: its run, the codes of W[tile outputs, i]
//! ```
//!
//! A channel's run holds the codes of the tile's R outputs: a base plane of
//! the low 4 bits (R/2 bytes; Q8_0: the 8-bit code + 128, R bytes), then for
//! 5- and 6-bit types a plane of the high bits (R/8 or R/4 bytes). Within a
//! block of 128 outputs (a tile's last block may hold 64 for Q4_0, Q4_1 and
//! Q8_0), codes are placed so that the AVX-512 kernel's in-register 4x4
//! byte transpose ([`code_position`]) yields 16 consecutive outputs per
//! vector: base byte `16L + 4q + m` holds output `16q + 4L + m` in its low
//! nibble and output `64 + 16q + 4L + m` in its high one. Scale records per
//! output: Q4_0/Q5_0/Q8_0 `d` (f16); Q4_1/Q5_1 `d` then `m` (f16 arrays of R
//! each); Q4_K/Q5_K the 6-bit scale and min as two `u8` arrays; Q6_K the `i8`
//! scale. Bytes per weight equal the source's, except Q4_K/Q5_K (+0.125 bit:
//! their 6-bit scale/min pairs are stored a byte each).
//!
//! **Arithmetic.** The active inputs of each group are quantized to int8
//! with one scale per group (`x_i ~ dx_g * xq_i`, `dx_g = max |x_i| / 127`
//! over the group's active channels). With codes `q` (unsigned) and per
//! (output `j`, group `g`) an affine map `w = a_jg * q + c_jg`, the product
//! over the active channels `A` is, group by group, exactly in integers
//! `acc_jg = sum_{i in A_g} xq_i q_ji`, then once per (output, group)
//! `y_j += dx_g * (a_jg * acc_jg + c_jg * S_g)` with `S_g = sum_{i in A_g}
//! xq_i`. The `(a, c)` maps: Q4_0 `(d, -8d)`, Q5_0 `(d, -16d)`, Q8_0
//! `(d, -128d)` (its codes are stored + 128), Q4_1/Q5_1 `(d, m)`,
//! Q4_K/Q5_K `(d*sc, -dmin*m)`, Q6_K `(d*sc, -32*d*sc)`. This is the dense
//! path's integer dot product (weights times int8 activations), at the grain
//! of single input channels: every active channel costs its run's bytes and
//! a quarter of a `vpdpbusd` per 16 outputs.
//!
//! **Lone channels.** One channel far above the rest of its group (the
//! outlier features of these models) would set the group's `dx` and round
//! the other 31 coarsely. When taking a group's largest channel out lowers
//! the group's rounding error energy (`~ amax^2`) by more than the input
//! vector's average group holds, that channel becomes the group's *lone*
//! channel: the group's sets and `dx` cover the rest, and the lone channel
//! is one more set with code `±127` at scale `|x| / 127`, so it enters
//! exactly; both sums meet in the same epilogue. About one group in seven
//! splits on the real models, and the repacked model at sparsity 0 comes
//! within a logit cosine of 0.99992 of f32 activations (0.99964 on SmolLM2
//! without it).
//!
//! Kernels ([`TileKernel`]) compute one tile of outputs over a range of
//! groups, from an [`ActiveChannels`] list built once per input vector; the
//! caller spreads tiles (and, for matrices with few tiles, group ranges) over
//! threads. The AVX-512 VNNI kernel is chosen at run time
//! ([`ChannelMajorKernel::best`]); the scalar kernel, with the same integer
//! arithmetic, is the portable fallback and the reference it is tested
//! against.

#![allow(clippy::needless_range_loop)]

mod active;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod codec;
mod kernel;
mod layout;

pub use active::ActiveChannels;
pub use codec::{dequantize, repack};
pub use kernel::{tile_checked, ChannelMajorKernel, TileKernel};
pub use layout::{
    code_position, default_tile, source_code, supports, ChannelMajorLayout, BLOCK, MAX_TILE,
};

/// Deterministic inputs in about [-1, 1] for the submodules' tests.
#[cfg(test)]
mod test_inputs {
    pub(super) fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    pub(super) fn lcg(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }
}
