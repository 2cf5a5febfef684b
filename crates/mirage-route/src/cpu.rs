//! Software routers: brute force (the reference) and the CPU BVH traversal.

use crate::bvh::Bvh;
use crate::data::RouterData;
use crate::{check_points, CandidateSet, RouteError, Router, RouterKind};

/// Tests every box of every page: the reference every other router must equal.
#[derive(Clone, Debug)]
pub struct BruteForce {
    data: RouterData,
}

impl BruteForce {
    /// Validates and keeps the data.
    pub fn new(data: &RouterData) -> Result<Self, RouteError> {
        data.validate()?;
        Ok(Self { data: data.clone() })
    }
}

impl Router for BruteForce {
    fn kind(&self) -> RouterKind {
        RouterKind::BruteForce
    }

    fn route(&mut self, points: &[[f32; 3]]) -> Result<CandidateSet, RouteError> {
        let d = &self.data;
        let queries = check_points(points, d.slices)?;
        let mut out = CandidateSet::new(queries, d.pages());
        for q in 0..queries {
            let pts = &points[q * d.slices..][..d.slices];
            for page in 0..d.pages() {
                let hits = (0..d.slices)
                    .filter(|&s| d.page_box(page, s).contains(pts[s]))
                    .count() as u32;
                if hits >= d.thresholds[page] {
                    out.insert(q, page);
                }
            }
        }
        Ok(out)
    }
}

/// Stack-based traversal of the flattened [`Bvh`], one query at a time.
#[derive(Clone, Debug)]
pub struct CpuBvh {
    bvh: Bvh,
    thresholds: Vec<u32>,
    /// Pages with threshold 0: candidates for every query.
    always: Vec<u32>,
    /// Per page slice-hit bits of the query in flight (zeroed after each query).
    masks: Vec<u32>,
    touched: Vec<u32>,
}

impl CpuBvh {
    /// Builds the BVH (once per router load).
    pub fn new(data: &RouterData) -> Result<Self, RouteError> {
        Ok(Self::from_bvh(Bvh::build(data)?, data.thresholds.clone()))
    }

    /// Wraps an already built (or deserialized) tree.
    pub fn from_bvh(bvh: Bvh, thresholds: Vec<u32>) -> Self {
        let pages = thresholds.len();
        let mut always = vec![0u32; pages.div_ceil(32)];
        for (p, t) in thresholds.iter().enumerate() {
            if *t == 0 {
                always[p / 32] |= 1 << (p % 32);
            }
        }
        Self {
            bvh,
            thresholds,
            always,
            masks: vec![0; pages],
            touched: Vec::new(),
        }
    }

    /// The tree this router walks.
    pub fn bvh(&self) -> &Bvh {
        &self.bvh
    }
}

impl Router for CpuBvh {
    fn kind(&self) -> RouterKind {
        RouterKind::CpuBvh
    }

    fn route(&mut self, points: &[[f32; 3]]) -> Result<CandidateSet, RouteError> {
        let slices = self.bvh.slices;
        let queries = check_points(points, slices)?;
        let mut out = CandidateSet::new(queries, self.thresholds.len());
        let words = out.words_per_query;
        for q in 0..queries {
            let (masks, touched) = (&mut self.masks, &mut self.touched);
            for s in 0..slices {
                self.bvh.for_each_hit(s, points[q * slices + s], |page| {
                    let m = &mut masks[page as usize];
                    if *m == 0 {
                        touched.push(page);
                    }
                    *m |= 1 << s;
                });
            }
            let row = &mut out.bits[q * words..][..words];
            row.copy_from_slice(&self.always);
            for &page in touched.iter() {
                let p = page as usize;
                if masks[p].count_ones() >= self.thresholds[p] {
                    row[p / 32] |= 1 << (p % 32);
                }
                masks[p] = 0;
            }
            touched.clear();
        }
        Ok(out)
    }
}
