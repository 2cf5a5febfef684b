//! Router input: per-page, per-slice boxes, thresholds and (optionally) the
//! slice projections, with a stable little-endian byte layout.
//!
//! # Byte layout of [`RouterData::to_bytes`] (version 1, all little-endian)
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 4 | magic `b"MRRD"` |
//! | 4 | 4 | version `u32` = 1 |
//! | 8 | 4 | `slices` `u32` (1..=32) |
//! | 12 | 4 | `pages` `u32` |
//! | 16 | 4 | `d_model` `u32` (0 when no projection is stored) |
//! | 20 | 4 | reserved `u32` = 0 |
//! | 24 | 4 x pages | `thresholds[page]` `u32` |
//! | … | 24 x pages x slices | boxes, page-major: for page p, slice s: `min[3]`, `max[3]` as `f32` |
//! | … | 4 x slices x 3 x d_model | projection, `f32`, row-major `[slice][axis][d_model]` |
//!
//! The reader rejects any other magic or version, and any length mismatch.

use crate::RouteError;

/// Largest number of slices: the GPU paths keep one bit per slice in a `u32`.
pub const MAX_SLICES: usize = 32;

/// Lanes of [`slice_dot`]'s summation order (one GPU warp).
pub const DOT_LANES: usize = 32;

/// `row . x` in the routers' canonical order, so that every implementation
/// (this CPU code, CUDA's `route.cu`, the Vulkan interop projection) computes
/// the same slice points bit for bit and hence the same page sets:
/// 1. lane `l` (0..32) sums `row[i] * x[i]` for `i = l, l + 32, l + 64, ...`
///    in increasing `i`, starting from `+0.0`, each product and each sum
///    rounded to nearest (no fused multiply-add);
/// 2. the 32 lane sums are combined pairwise, `s[l] += s[l + h]` for
///    `h = 16, 8, 4, 2, 1` (a warp's xor butterfly), giving `s[0]`.
///
/// Why this order and not index order: a GPU warp computes it with coalesced
/// loads and `d / 32` dependent adds per lane, where the index-order sum is one
/// chain of `d` dependent adds on one thread (the first device router spent
/// most of its time there). Lengths must match (the caller checks).
pub fn slice_dot(row: &[f32], x: &[f32]) -> f32 {
    debug_assert_eq!(row.len(), x.len());
    let mut lanes = [0f32; DOT_LANES];
    for (rc, xc) in row.chunks(DOT_LANES).zip(x.chunks(DOT_LANES)) {
        for ((acc, p), v) in lanes.iter_mut().zip(rc).zip(xc) {
            *acc += p * v;
        }
    }
    let mut h = DOT_LANES / 2;
    while h > 0 {
        for l in 0..h {
            lanes[l] += lanes[l + h];
        }
        h /= 2;
    }
    lanes[0]
}

const MAGIC: &[u8; 4] = b"MRRD";
const VERSION: u32 = 1;
const HEADER_BYTES: usize = 24;

/// An axis-aligned box in one slice's 3-D space (closed: a point on a face is inside).
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct Aabb {
    /// Lower corner.
    pub min: [f32; 3],
    /// Upper corner.
    pub max: [f32; 3],
}

impl Aabb {
    /// The box `[min, max]`.
    pub fn new(min: [f32; 3], max: [f32; 3]) -> Self {
        Self { min, max }
    }

    /// Closed containment test; `false` for NaN coordinates.
    #[inline]
    pub fn contains(&self, p: [f32; 3]) -> bool {
        p[0] >= self.min[0]
            && p[0] <= self.max[0]
            && p[1] >= self.min[1]
            && p[1] <= self.max[1]
            && p[2] >= self.min[2]
            && p[2] <= self.max[2]
    }

    /// The empty box (min = +inf, max = -inf), neutral for [`Aabb::union`].
    pub fn empty() -> Self {
        Self {
            min: [f32::INFINITY; 3],
            max: [f32::NEG_INFINITY; 3],
        }
    }

    /// Smallest box holding both.
    #[inline]
    pub fn union(&self, o: &Aabb) -> Aabb {
        let mut r = *self;
        for a in 0..3 {
            r.min[a] = r.min[a].min(o.min[a]);
            r.max[a] = r.max[a].max(o.max[a]);
        }
        r
    }

    /// Surface area (0 for an empty box).
    pub fn area(&self) -> f32 {
        let d = [
            self.max[0] - self.min[0],
            self.max[1] - self.min[1],
            self.max[2] - self.min[2],
        ];
        if d.iter().any(|x| x.is_nan() || *x < 0.0) {
            return 0.0;
        }
        2.0 * (d[0] * d[1] + d[1] * d[2] + d[2] * d[0])
    }
}

/// One layer's router: `pages` pages, each with one box per slice, and the
/// number of slice hits a page needs to be a candidate.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterData {
    /// Number of slices (query points per token), 1..=[`MAX_SLICES`].
    pub slices: usize,
    /// Boxes, page-major: `boxes[page * slices + slice]`.
    pub boxes: Vec<Aabb>,
    /// Per page: a page is a candidate when at least this many of its slice
    /// boxes contain the query's slice point (0 = always a candidate).
    pub thresholds: Vec<u32>,
    /// Width of the FFN input `x` the projection reads (0 = no projection stored).
    pub d_model: usize,
    /// Projection `P`, row-major `[slice][axis][d_model]`; empty when `d_model == 0`.
    pub projection: Vec<f32>,
}

impl RouterData {
    /// Router data without a projection, with one threshold for every page.
    pub fn new(slices: usize, boxes: Vec<Aabb>, threshold: u32) -> Result<Self, RouteError> {
        let pages = boxes.len().checked_div(slices).unwrap_or(0);
        let data = Self {
            slices,
            boxes,
            thresholds: vec![threshold; pages],
            d_model: 0,
            projection: Vec::new(),
        };
        data.validate()?;
        Ok(data)
    }

    /// Number of pages.
    pub fn pages(&self) -> usize {
        self.thresholds.len()
    }

    /// The box of `page` in `slice`.
    #[inline]
    pub fn page_box(&self, page: usize, slice: usize) -> &Aabb {
        &self.boxes[page * self.slices + slice]
    }

    /// Checks the shape and the boxes (finite, `min <= max`).
    pub fn validate(&self) -> Result<(), RouteError> {
        if self.slices == 0 || self.slices > MAX_SLICES {
            return Err(RouteError::InvalidData(format!(
                "slices = {} (must be 1..={MAX_SLICES})",
                self.slices
            )));
        }
        if self.boxes.len() != self.thresholds.len() * self.slices {
            return Err(RouteError::InvalidData(format!(
                "{} boxes for {} pages x {} slices",
                self.boxes.len(),
                self.thresholds.len(),
                self.slices
            )));
        }
        if self.pages() > u32::MAX as usize / MAX_SLICES {
            return Err(RouteError::InvalidData(format!(
                "{} pages is too many",
                self.pages()
            )));
        }
        for (i, b) in self.boxes.iter().enumerate() {
            for a in 0..3 {
                if !b.min[a].is_finite() || !b.max[a].is_finite() || b.min[a] > b.max[a] {
                    return Err(RouteError::InvalidData(format!(
                        "box {i} (page {}, slice {}) is not a finite min<=max box: {b:?}",
                        i / self.slices,
                        i % self.slices
                    )));
                }
            }
        }
        if self.projection.len() != self.slices * 3 * self.d_model {
            return Err(RouteError::InvalidData(format!(
                "projection has {} floats, want slices*3*d_model = {}",
                self.projection.len(),
                self.slices * 3 * self.d_model
            )));
        }
        Ok(())
    }

    /// Projects one FFN input `x` (length `d_model`) to its slice points `z_s = P_s x`,
    /// appending `slices` points to `out`. Every coordinate is [`slice_dot`], whose fixed
    /// summation order the GPU routers reproduce bit for bit.
    pub fn project_into(&self, x: &[f32], out: &mut Vec<[f32; 3]>) -> Result<(), RouteError> {
        if self.d_model == 0 || x.len() != self.d_model {
            return Err(RouteError::InvalidInput(format!(
                "x has {} values, router projects d_model = {}",
                x.len(),
                self.d_model
            )));
        }
        for s in 0..self.slices {
            let mut z = [0f32; 3];
            for (a, za) in z.iter_mut().enumerate() {
                let row = &self.projection[(s * 3 + a) * self.d_model..][..self.d_model];
                *za = slice_dot(row, x);
            }
            out.push(z);
        }
        Ok(())
    }

    /// Serializes to the documented little-endian layout.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            HEADER_BYTES + 4 * self.pages() + 24 * self.boxes.len() + 4 * self.projection.len(),
        );
        out.extend_from_slice(MAGIC);
        for v in [
            VERSION,
            self.slices as u32,
            self.pages() as u32,
            self.d_model as u32,
            0,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for t in &self.thresholds {
            out.extend_from_slice(&t.to_le_bytes());
        }
        for b in &self.boxes {
            for v in b.min.iter().chain(b.max.iter()) {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        for v in &self.projection {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }

    /// Parses the documented layout and validates the result.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, RouteError> {
        let bad = |m: String| RouteError::InvalidData(m);
        if bytes.len() < HEADER_BYTES || &bytes[..4] != MAGIC {
            return Err(bad(
                "not MIRAGE router data (bad magic or short header)".into()
            ));
        }
        let u = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
        if u(4) != VERSION {
            return Err(bad(format!(
                "router data version {} (this reader knows {VERSION})",
                u(4)
            )));
        }
        let (slices, pages, d_model) = (u(8) as usize, u(12) as usize, u(16) as usize);
        if slices == 0 || slices > MAX_SLICES {
            return Err(bad(format!("slices = {slices}")));
        }
        let want = (|| {
            let n_boxes = pages.checked_mul(slices)?;
            HEADER_BYTES
                .checked_add(pages.checked_mul(4)?)?
                .checked_add(n_boxes.checked_mul(24)?)?
                .checked_add(slices.checked_mul(12)?.checked_mul(d_model)?)
        })()
        .ok_or_else(|| bad("size overflows".into()))?;
        if bytes.len() != want {
            return Err(bad(format!("{} bytes, header says {want}", bytes.len())));
        }
        let f = |i: usize| f32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
        let mut at = HEADER_BYTES;
        let thresholds = (0..pages).map(|i| u(at + 4 * i)).collect();
        at += 4 * pages;
        let boxes = (0..pages * slices)
            .map(|i| {
                let o = at + 24 * i;
                Aabb::new(
                    [f(o), f(o + 4), f(o + 8)],
                    [f(o + 12), f(o + 16), f(o + 20)],
                )
            })
            .collect();
        at += 24 * pages * slices;
        let projection = (0..slices * 3 * d_model).map(|i| f(at + 4 * i)).collect();
        let data = Self {
            slices,
            boxes,
            thresholds,
            d_model,
            projection,
        };
        data.validate()?;
        Ok(data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a warp computes: every lane sums its strided share, then each
    /// butterfly step adds the value of lane `l ^ h` (so lanes `>= h` add in
    /// the other operand order). Exactly `slice_dot`'s pairwise order only
    /// because IEEE addition is commutative; this checks that claim on data.
    fn warp_xor_butterfly(row: &[f32], x: &[f32]) -> [f32; DOT_LANES] {
        let mut v = [0f32; DOT_LANES];
        for (l, acc) in v.iter_mut().enumerate() {
            let mut i = l;
            while i < row.len() {
                *acc += row[i] * x[i];
                i += DOT_LANES;
            }
        }
        let mut h = DOT_LANES / 2;
        while h > 0 {
            let prev = v;
            for l in 0..DOT_LANES {
                v[l] = prev[l] + prev[l ^ h];
            }
            h /= 2;
        }
        v
    }

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
    }

    #[test]
    fn slice_dot_is_the_warp_butterfly_bit_for_bit_and_close_to_f64() {
        let mut seed = 7u64;
        for d in [1usize, 5, 31, 32, 33, 64, 96, 577, 896, 3584] {
            for _ in 0..20 {
                let row: Vec<f32> = (0..d).map(|_| lcg(&mut seed)).collect();
                let x: Vec<f32> = (0..d).map(|_| lcg(&mut seed) * 1e3).collect();
                let got = slice_dot(&row, &x);
                for (l, w) in warp_xor_butterfly(&row, &x).iter().enumerate() {
                    assert_eq!(
                        got.to_bits(),
                        w.to_bits(),
                        "d {d}: lane {l} of the butterfly differs"
                    );
                }
                let exact: f64 = row.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                let scale: f64 = row
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                assert!(
                    ((got as f64) - exact).abs() <= 1e-5 * scale.max(1e-30),
                    "d {d}: {got} vs f64 {exact}"
                );
            }
        }
        // Signed zeros: the sum starts from +0.0, as the GPU's does.
        assert_eq!(slice_dot(&[-0.0], &[1.0]).to_bits(), 0f32.to_bits());
    }
}
