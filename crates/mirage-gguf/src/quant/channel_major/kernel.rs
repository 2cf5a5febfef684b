//! The tile kernels: the families a CPU runs, the checked entry point, and
//! the portable scalar kernel with the scale arithmetic every kernel shares.

use std::ops::Range;

#[cfg(target_arch = "x86_64")]
use super::avx512;
use super::layout::{get_code, scheme};
use super::{ActiveChannels, ChannelMajorLayout};
use crate::quant::util::f16_at;
use crate::quant::QuantError;
use crate::types::GgmlType;

/// Per-output scale values of one (tile, group): what the epilogue of the
/// kernels reads (see [`epilogue`]).
#[derive(Debug, Clone, Copy)]
pub(super) enum Scales {
    /// `w = d * (q - off)`: Q4_0 (8), Q5_0 (16), Q8_0 (128).
    Offset { d: f32, off: i32 },
    /// `w = d * q + m`: Q4_1, Q5_1.
    Min { d: f32, m: f32 },
    /// `w = d * sc * q - dmin * mn`: Q4_K, Q5_K.
    K { d: f32, sc: f32, dmin: f32, mn: f32 },
    /// `w = d * sc * (q - 32)`: Q6_K.
    K6 { d: f32, sc: f32 },
}

/// The scales of output position `p` of tile `t` and group `g`.
pub(super) fn scales(
    layout: &ChannelMajorLayout,
    data: &[u8],
    t: usize,
    g: usize,
    p: usize,
) -> Scales {
    use GgmlType::*;
    let r = layout.tile_rows(t);
    let rec = &data[layout.record_offset(t, g)..][..layout.record_bytes(r)];
    let hdr = || {
        let sb = g / layout.groups_per_superblock();
        &data[layout.header_offset(t, sb)..][..layout.header_bytes(r)]
    };
    match layout.ty {
        Q4_0 | Q5_0 | Q8_0 => Scales::Offset {
            d: f16_at(rec, 2 * p),
            off: match layout.ty {
                Q4_0 => 8,
                Q5_0 => 16,
                _ => 128,
            },
        },
        Q4_1 | Q5_1 => Scales::Min {
            d: f16_at(rec, 2 * p),
            m: f16_at(rec, 2 * r + 2 * p),
        },
        Q6_K => Scales::K6 {
            d: f16_at(hdr(), 2 * p),
            sc: rec[p] as i8 as f32,
        },
        _ => {
            let h = hdr();
            Scales::K {
                d: f16_at(h, 2 * p),
                sc: rec[p] as f32,
                dmin: f16_at(h, 2 * r + 2 * p),
                mn: rec[r + p] as f32,
            }
        }
    }
}

/// `y + dx * (a * acc + c * sum)` for one output, with the float operations
/// (and their order) of the SIMD kernels, so that they agree bit for bit.
#[inline]
fn epilogue(sc: Scales, acc: i32, sum: i32, dx: f32, y: f32) -> f32 {
    let dxs = dx * sum as f32;
    match sc {
        Scales::Offset { d, off } => (d * dx).mul_add((acc - off * sum) as f32, y),
        Scales::Min { d, m } => m.mul_add(dxs, (d * dx).mul_add(acc as f32, y)),
        Scales::K { d, sc, dmin, mn } => {
            let y = ((d * sc) * dx).mul_add(acc as f32, y);
            (-(dmin * mn)).mul_add(dxs, y)
        }
        Scales::K6 { d, sc } => ((d * sc) * dx).mul_add((acc - 32 * sum) as f32, y),
    }
}

/// [`epilogue`] of a group with a lone channel (`acc2`, `sum2` at the
/// scale `dx2`): both sums scaled and added before the per-output scales,
/// with the float operations of the SIMD kernels.
#[inline]
#[allow(clippy::too_many_arguments)]
fn epilogue_lone(
    sc: Scales,
    acc: i32,
    sum: i32,
    dx: f32,
    acc2: i32,
    sum2: i32,
    dx2: f32,
    y: f32,
) -> f32 {
    let offset_sum =
        |off: i32| ((acc2 - off * sum2) as f32).mul_add(dx2, (acc - off * sum) as f32 * dx);
    let a = (acc2 as f32).mul_add(dx2, acc as f32 * dx);
    let s = (sum2 as f32).mul_add(dx2, dx * sum as f32);
    match sc {
        Scales::Offset { d, off } => d.mul_add(offset_sum(off), y),
        Scales::Min { d, m } => m.mul_add(s, d.mul_add(a, y)),
        Scales::K { d, sc, dmin, mn } => (-(dmin * mn)).mul_add(s, (d * sc).mul_add(a, y)),
        Scales::K6 { d, sc } => (d * sc).mul_add(offset_sum(32), y),
    }
}

/// An unchecked tile kernel: `y = sum over groups in `groups` of the
/// active channels' contributions to the outputs of tile `t`` (`y` holds
/// [`ChannelMajorLayout::tile_rows`] floats and is overwritten).
///
/// # Safety
/// `data` holds [`ChannelMajorLayout::bytes`] bytes of `layout`; `t <
/// n_tiles`, `groups` lies within `0..n_groups`; `active` was built with
/// `layout.group()` over `cols` channels; `y.len() == layout.tile_rows(t)`.
/// The CPU features the kernel needs are guaranteed by
/// [`ChannelMajorKernel::kernel`].
pub type TileKernel = unsafe fn(
    layout: &ChannelMajorLayout,
    data: &[u8],
    t: usize,
    groups: Range<usize>,
    active: &ActiveChannels,
    y: &mut [f32],
);

/// The kernel families, fastest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChannelMajorKernel {
    /// AVX-512 VNNI + GFNI (x86_64).
    Avx512Vnni,
    /// Portable scalar code (the reference; same integer arithmetic).
    Scalar,
}

impl ChannelMajorKernel {
    /// The fastest family this CPU runs.
    pub fn best() -> ChannelMajorKernel {
        #[cfg(target_arch = "x86_64")]
        {
            if avx512::available() {
                return ChannelMajorKernel::Avx512Vnni;
            }
        }
        ChannelMajorKernel::Scalar
    }

    /// Every family this CPU runs (for tests and benchmarks).
    pub fn available() -> Vec<ChannelMajorKernel> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if avx512::available() {
                v.push(ChannelMajorKernel::Avx512Vnni);
            }
        }
        v.push(ChannelMajorKernel::Scalar);
        v
    }

    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            ChannelMajorKernel::Avx512Vnni => "avx512-vnni",
            ChannelMajorKernel::Scalar => "scalar",
        }
    }

    /// The tile kernel of this family for `ty`; `None` when this CPU lacks
    /// the family's features or the type has no channel-major form.
    pub fn kernel(self, ty: GgmlType) -> Option<TileKernel> {
        scheme(ty)?;
        match self {
            ChannelMajorKernel::Scalar => Some(scalar_tile),
            #[cfg(target_arch = "x86_64")]
            ChannelMajorKernel::Avx512Vnni if avx512::available() => avx512::kernel(ty),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
}

/// Checks a tile call's arguments (for the checked entry point and tests).
fn check_tile(
    layout: &ChannelMajorLayout,
    data: &[u8],
    t: usize,
    groups: &Range<usize>,
    active: &ActiveChannels,
    y: &[f32],
) -> Result<(), QuantError> {
    let ty = layout.ty;
    crate::quant::check_len(ty, "channel-major bytes", layout.bytes(), data.len())?;
    if t >= layout.n_tiles() || groups.end > layout.n_groups() || groups.start > groups.end {
        return Err(QuantError::LengthMismatch {
            ty,
            what: "tile / group range",
            expected: layout.n_tiles(),
            got: t,
        });
    }
    crate::quant::check_len(ty, "tile outputs", layout.tile_rows(t), y.len())?;
    crate::quant::check_len(ty, "active groups", layout.n_groups(), active.n_groups())?;
    crate::quant::check_len(ty, "active group size", layout.s.group, active.group)?;
    Ok(())
}

/// [`TileKernel`] of `family` with every argument checked.
pub fn tile_checked(
    family: ChannelMajorKernel,
    layout: &ChannelMajorLayout,
    data: &[u8],
    t: usize,
    groups: Range<usize>,
    active: &ActiveChannels,
    y: &mut [f32],
) -> Result<(), QuantError> {
    check_tile(layout, data, t, &groups, active, y)?;
    let k = family
        .kernel(layout.ty)
        .ok_or(QuantError::UnsupportedType {
            ty: layout.ty,
            op: "channel-major kernel on this CPU",
        })?;
    // SAFETY: arguments checked above; `kernel` only hands out kernels this
    // CPU runs.
    unsafe { k(layout, data, t, groups, active, y) };
    Ok(())
}

/// The portable kernel (see [`TileKernel`]): per output and group the exact
/// integer sum, then [`epilogue`].
///
/// # Safety
/// [`TileKernel`]'s contract (it only indexes checked slices, so a broken
/// contract panics instead of reading out of bounds).
unsafe fn scalar_tile(
    layout: &ChannelMajorLayout,
    data: &[u8],
    t: usize,
    groups: Range<usize>,
    active: &ActiveChannels,
    y: &mut [f32],
) {
    let r = layout.tile_rows(t);
    let (bits, rl) = (layout.s.bits, layout.run_bytes(r));
    y.fill(0.0);
    for g in groups {
        let sets = active.sets(g);
        if sets.is_empty() {
            continue;
        }
        let chans = layout.record_offset(t, g) + layout.record_bytes(r);
        let set_sum = |idx: &[[u8; 4]], xqs: &[i32], p: usize| {
            let mut acc = 0i32;
            for (ids, xq) in idx.iter().zip(xqs) {
                let xq = xq.to_le_bytes();
                for (c, &i) in ids.iter().enumerate() {
                    let run = &data[chans + i as usize * rl..][..rl];
                    acc += xq[c] as i8 as i32 * get_code(bits, r, run, p) as i32;
                }
            }
            acc
        };
        let (idx, xqs) = (&active.set_idx[sets.clone()], &active.set_xq[sets]);
        let (sum, dx, lone) = (active.sum[g], active.dx[g], active.lone[g]);
        for p in 0..r {
            let sc = scales(layout, data, t, g, p);
            let acc = set_sum(idx, xqs, p);
            y[p] = match lone {
                None => epilogue(sc, acc, sum, dx, y[p]),
                Some(l) => {
                    let acc2 = set_sum(&[l.idx], &[l.xq], p);
                    epilogue_lone(sc, acc, sum, dx, acc2, l.sum, l.dx, y[p])
                }
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::channel_major::test_inputs::lcg;
    use crate::quant::channel_major::{repack, ChannelMajorKernel};

    /// Every kernel family equals the scalar reference bit for bit (same
    /// integer sums, same float epilogue), and the scalar reference equals
    /// the f64 product of the dequantized source with the int8 activations
    /// to float rounding; on random matrices of every type, at several
    /// sparsities, over whole and split group ranges.
    #[test]
    fn kernels_equal_the_reference_on_random_weights() {
        let types = [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
        ];
        for ty in types {
            let mut shapes = vec![
                (128usize, 512usize, 128usize),
                (256, 256, 256),
                (640, 256, 256),
                (2304, 256, 2048),
            ];
            if matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0) {
                shapes.push((192, 256, 128));
                shapes.push((576, 256, 640));
            }
            for (rows, cols, tile) in shapes {
                let rb = crate::quant::row_bytes(ty, cols).unwrap();
                let mut src = vec![0u8; rb * rows];
                crate::quant::quantize(ty, &lcg(7 + rows as u64, rows * cols), &mut src).unwrap();
                let mut w = vec![0f32; rows * cols];
                crate::quant::dequantize(ty, &src, &mut w).unwrap();
                let layout = ChannelMajorLayout::with_tile(ty, rows, cols, tile).unwrap();
                let mut cm = vec![0u8; layout.bytes()];
                repack(&layout, &src, &mut cm).unwrap();
                // Plain inputs, and inputs with channels far above their
                // groups (the kernels' lone-channel path).
                let plain = lcg(99, cols);
                let mut outliers = plain.clone();
                for i in (5..cols).step_by(97) {
                    outliers[i] *= 40.0;
                }
                for (x, keep_share) in [
                    (&plain, 1.0f32),
                    (&plain, 0.5),
                    (&plain, 0.13),
                    (&plain, 0.0),
                ]
                .into_iter()
                .chain([1.0f32, 0.5].map(|k| (&outliers, k)))
                {
                    let mut act = ActiveChannels::default();
                    act.fill(x, layout.group(), |i, _| {
                        ((i * 2654435761) % 1000) as f32 / 1000.0 < keep_share
                    });
                    let xv = act.values(cols);
                    let want: Vec<f64> = (0..rows)
                        .map(|j| {
                            (0..cols)
                                .map(|i| w[j * cols + i] as f64 * xv[i] as f64)
                                .sum()
                        })
                        .collect();
                    let scale = want.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
                    let ng = layout.n_groups();
                    let run = |fam: ChannelMajorKernel| -> Vec<f32> {
                        let mut y = vec![0f32; rows];
                        for t in 0..layout.n_tiles() {
                            // Two group ranges summed: the split-K path.
                            let r = layout.tile_rows(t);
                            let mid = ng / 2;
                            let (mut a, mut b) = (vec![0f32; r], vec![0f32; r]);
                            tile_checked(fam, &layout, &cm, t, 0..mid, &act, &mut a).unwrap();
                            tile_checked(fam, &layout, &cm, t, mid..ng, &act, &mut b).unwrap();
                            for p in 0..r {
                                y[t * layout.tile() + p] = a[p] + b[p];
                            }
                        }
                        y
                    };
                    let reference = run(ChannelMajorKernel::Scalar);
                    for j in 0..rows {
                        let e = (reference[j] as f64 - want[j]).abs() / scale;
                        assert!(
                            e < 1e-5,
                            "{ty} {rows}x{cols} keep {keep_share}: out {j} {} vs {} (rel {e})",
                            reference[j],
                            want[j]
                        );
                    }
                    for fam in ChannelMajorKernel::available() {
                        let y = run(fam);
                        for j in 0..rows {
                            assert_eq!(
                                y[j].to_bits(),
                                reference[j].to_bits(),
                                "{ty} {rows}x{cols} tile {tile} keep {keep_share} {}: out {j} {} vs {}",
                                fam.name(),
                                y[j],
                                reference[j]
                            );
                        }
                    }
                }
            }
        }
    }
}
