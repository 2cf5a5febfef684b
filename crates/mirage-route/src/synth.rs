//! Synthetic router data and query points, for tests and benchmarks until
//! the artifact builder writes real router data. Deterministic (SplitMix64).

use crate::data::{Aabb, RouterData};

/// A small deterministic generator (SplitMix64).
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi)`.
    pub fn range(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * u
    }

    /// Uniform integer in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Shape of synthetic router data.
#[derive(Clone, Copy, Debug)]
pub struct SynthSpec {
    /// Pages.
    pub pages: usize,
    /// Slices.
    pub slices: usize,
    /// Box half-extents are drawn from `[half_min, half_max)` per axis; centres from `[-1, 1)^3`.
    pub half_min: f32,
    /// See `half_min`.
    pub half_max: f32,
    /// `Some(t)`: every page needs `t` hits; `None`: random per page in `0..=slices`.
    pub threshold: Option<u32>,
}

/// Random page boxes per the spec.
pub fn router_data(spec: &SynthSpec, seed: u64) -> RouterData {
    let mut rng = SplitMix64(seed);
    let mut boxes = Vec::with_capacity(spec.pages * spec.slices);
    for _ in 0..spec.pages * spec.slices {
        let mut b = Aabb::default();
        for a in 0..3 {
            let c = rng.range(-1.0, 1.0);
            let h = rng.range(spec.half_min, spec.half_max);
            b.min[a] = c - h;
            b.max[a] = c + h;
        }
        boxes.push(b);
    }
    let thresholds = (0..spec.pages)
        .map(|_| {
            spec.threshold
                .unwrap_or_else(|| rng.below(spec.slices as u64 + 1) as u32)
        })
        .collect();
    RouterData {
        slices: spec.slices,
        boxes,
        thresholds,
        d_model: 0,
        projection: Vec::new(),
    }
}

/// `queries * slices` query points: most uniform in `[-1.2, 1.2)^3`, some
/// inside a random page's box, some exactly on a box corner (closedness).
pub fn query_points(data: &RouterData, queries: usize, seed: u64) -> Vec<[f32; 3]> {
    let mut rng = SplitMix64(seed ^ 0x5EED);
    let mut pts = Vec::with_capacity(queries * data.slices);
    for _ in 0..queries {
        for s in 0..data.slices {
            let kind = rng.below(8);
            let p = if data.pages() > 0 && kind == 0 {
                let b = data.page_box(rng.below(data.pages() as u64) as usize, s);
                let corner = rng.below(8);
                std::array::from_fn(|a| {
                    if corner >> a & 1 == 1 {
                        b.max[a]
                    } else {
                        b.min[a]
                    }
                })
            } else if data.pages() > 0 && kind <= 2 {
                let b = data.page_box(rng.below(data.pages() as u64) as usize, s);
                std::array::from_fn(|a| rng.range(b.min[a], b.max[a]))
            } else {
                std::array::from_fn(|_| rng.range(-1.2, 1.2))
            };
            pts.push(p);
        }
    }
    pts
}
