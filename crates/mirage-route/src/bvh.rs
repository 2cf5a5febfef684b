//! Binned-SAH BVH over every box of every slice, flattened for GPUs.
//!
//! All slices share one scene: slice `s` is translated along x by
//! `slice_offsets[s]`, so one tree serves every slice point and the slices
//! hardly overlap. Node bounds are unions of the translated boxes, padded
//! outward so that culling is conservative whatever the rounding of
//! `p.x + offset` on the device; the exact test at a leaf is always the
//! closed containment of the *untranslated* point in the *untranslated* box,
//! plus `prim.slice == query slice`. That makes CPU, wgpu and Vulkan RT agree
//! bit for bit with brute force.
//!
//! # Flattened layout (both `#[repr(C)]`, 32 bytes, std430-compatible)
//!
//! `BvhNode { min: [f32; 3], left_or_first: u32, max: [f32; 3], count: u32 }`:
//! `count == 0` is an interior node whose children are `left_or_first` and
//! `left_or_first + 1`; `count > 0` is a leaf holding
//! `prims[left_or_first .. left_or_first + count]`. Node 0 is the root.
//!
//! `BvhPrim { min: [f32; 3], page: u32, max: [f32; 3], slice: u32 }`: one page
//! box of one slice in that slice's own (untranslated) coordinates.
//!
//! # Byte layout of [`Bvh::to_bytes`] (version 1, little-endian)
//!
//! magic `b"MRBV"`, `u32` version = 1, `u32` slices, `u32` pages, `u32` node
//! count, `u32` prim count, `slices` x `f32` offsets, then the nodes and the
//! prims exactly as the 32-byte records above.

use crate::data::{Aabb, RouterData};
use crate::RouteError;

/// Deepest tree the builder makes; traversal stacks of 64 entries always suffice.
pub const MAX_DEPTH: usize = 48;
/// Traversal stack size used by every path (CPU, WGSL).
pub const STACK_SIZE: usize = 64;
const BINS: usize = 16;
const MAX_LEAF: usize = 4;

/// One flattened BVH node (see the module docs for the layout).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct BvhNode {
    /// Lower corner of the (translated, padded) bounds.
    pub min: [f32; 3],
    /// First child (interior) or first primitive (leaf).
    pub left_or_first: u32,
    /// Upper corner of the (translated, padded) bounds.
    pub max: [f32; 3],
    /// 0 for interior nodes, else the number of primitives in the leaf.
    pub count: u32,
}

/// One primitive: a page's box in one slice, untranslated.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct BvhPrim {
    /// Lower corner, slice-local.
    pub min: [f32; 3],
    /// Page index.
    pub page: u32,
    /// Upper corner, slice-local.
    pub max: [f32; 3],
    /// Slice index.
    pub slice: u32,
}

impl BvhPrim {
    /// Closed containment of a slice-local point.
    #[inline]
    pub fn contains(&self, p: [f32; 3]) -> bool {
        Aabb::new(self.min, self.max).contains(p)
    }
}

/// A flattened BVH over all page boxes of all slices.
#[derive(Clone, Debug, PartialEq)]
pub struct Bvh {
    /// Number of slices.
    pub slices: usize,
    /// Number of pages.
    pub pages: usize,
    /// x translation of each slice in the shared scene.
    pub slice_offsets: Vec<f32>,
    /// Nodes; node 0 is the root (absent when there are no primitives).
    pub nodes: Vec<BvhNode>,
    /// Primitives in leaf order.
    pub prims: Vec<BvhPrim>,
}

/// Moves a bound outward by a small relative margin (conservative culling).
fn pad_down(v: f32) -> f32 {
    v - (v.abs() * 1e-5 + 1e-5)
}
fn pad_up(v: f32) -> f32 {
    v + (v.abs() * 1e-5 + 1e-5)
}

struct Item {
    bounds: Aabb,
    centroid: [f32; 3],
    prim: BvhPrim,
}

impl Bvh {
    /// Builds the tree (binned SAH, 16 bins, leaves of up to 4 primitives).
    pub fn build(data: &RouterData) -> Result<Self, RouteError> {
        data.validate()?;
        let slices = data.slices;
        let pages = data.pages();
        // Stride between slices: wider than any slice's x extent, so that slices never overlap.
        let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
        for b in &data.boxes {
            lo = lo.min(b.min[0]);
            hi = hi.max(b.max[0]);
        }
        let stride = if data.boxes.is_empty() {
            1.0
        } else {
            (hi - lo) * 1.25 + 1.0
        };
        if !stride.is_finite() {
            return Err(RouteError::InvalidData("box x extent overflows f32".into()));
        }
        let slice_offsets: Vec<f32> = (0..slices).map(|s| s as f32 * stride).collect();

        let mut items: Vec<Item> = Vec::with_capacity(data.boxes.len());
        for page in 0..pages {
            for (slice, off) in slice_offsets.iter().enumerate() {
                let b = data.page_box(page, slice);
                let mut t = *b;
                t.min[0] += off;
                t.max[0] += off;
                let centroid = [
                    0.5 * (t.min[0] + t.max[0]),
                    0.5 * (t.min[1] + t.max[1]),
                    0.5 * (t.min[2] + t.max[2]),
                ];
                items.push(Item {
                    bounds: t,
                    centroid,
                    prim: BvhPrim {
                        min: b.min,
                        page: page as u32,
                        max: b.max,
                        slice: slice as u32,
                    },
                });
            }
        }
        let mut nodes = Vec::new();
        if !items.is_empty() {
            nodes.reserve(2 * items.len() / MAX_LEAF + 1);
            nodes.push(BvhNode::default());
            // (node index, start, end, depth)
            let mut work = vec![(0usize, 0usize, items.len(), 0usize)];
            while let Some((ni, start, end, depth)) = work.pop() {
                let bounds = items[start..end]
                    .iter()
                    .fold(Aabb::empty(), |a, it| a.union(&it.bounds));
                let node = &mut nodes[ni];
                node.min = bounds.min.map(pad_down);
                node.max = bounds.max.map(pad_up);
                let count = end - start;
                let split = if count <= MAX_LEAF || depth >= MAX_DEPTH {
                    None
                } else {
                    sah_split(&mut items[start..end], &bounds)
                };
                match split {
                    None => {
                        node.left_or_first = start as u32;
                        node.count = count as u32;
                    }
                    Some(mid) => {
                        let left = nodes.len();
                        nodes[ni].left_or_first = left as u32;
                        nodes[ni].count = 0;
                        nodes.push(BvhNode::default());
                        nodes.push(BvhNode::default());
                        work.push((left, start, start + mid, depth + 1));
                        work.push((left + 1, start + mid, end, depth + 1));
                    }
                }
            }
        }
        let prims = items.into_iter().map(|it| it.prim).collect();
        Ok(Self {
            slices,
            pages,
            slice_offsets,
            nodes,
            prims,
        })
    }

    /// Calls `hit(page)` for every primitive of `slice` whose box contains the
    /// slice-local point `p`.
    #[inline]
    pub fn for_each_hit(&self, slice: usize, p: [f32; 3], mut hit: impl FnMut(u32)) {
        if self.nodes.is_empty() {
            return;
        }
        let t = [p[0] + self.slice_offsets[slice], p[1], p[2]];
        let mut stack = [0u32; STACK_SIZE];
        let mut sp = 1usize;
        while sp > 0 {
            sp -= 1;
            let n = &self.nodes[stack[sp] as usize];
            if !(t[0] >= n.min[0]
                && t[0] <= n.max[0]
                && t[1] >= n.min[1]
                && t[1] <= n.max[1]
                && t[2] >= n.min[2]
                && t[2] <= n.max[2])
            {
                continue;
            }
            if n.count > 0 {
                let first = n.left_or_first as usize;
                for prim in &self.prims[first..first + n.count as usize] {
                    if prim.slice as usize == slice && prim.contains(p) {
                        hit(prim.page);
                    }
                }
            } else {
                stack[sp] = n.left_or_first;
                stack[sp + 1] = n.left_or_first + 1;
                sp += 2;
            }
        }
    }

    /// Serializes to the documented little-endian layout.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out =
            Vec::with_capacity(24 + 4 * self.slices + 32 * (self.nodes.len() + self.prims.len()));
        out.extend_from_slice(b"MRBV");
        for v in [
            1u32,
            self.slices as u32,
            self.pages as u32,
            self.nodes.len() as u32,
            self.prims.len() as u32,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for o in &self.slice_offsets {
            out.extend_from_slice(&o.to_le_bytes());
        }
        for n in &self.nodes {
            push_record(&mut out, n.min, n.left_or_first, n.max, n.count);
        }
        for p in &self.prims {
            push_record(&mut out, p.min, p.page, p.max, p.slice);
        }
        out
    }

    /// Parses [`Bvh::to_bytes`] output, checking every index it holds.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, RouteError> {
        let bad = |m: &str| RouteError::InvalidData(format!("BVH bytes: {m}"));
        if bytes.len() < 24 || &bytes[..4] != b"MRBV" {
            return Err(bad("bad magic or short header"));
        }
        let u = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
        let f = |i: usize| f32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
        if u(4) != 1 {
            return Err(bad("unknown version"));
        }
        let (slices, pages, n_nodes, n_prims) = (
            u(8) as usize,
            u(12) as usize,
            u(16) as usize,
            u(20) as usize,
        );
        let want = (n_nodes as u128 + n_prims as u128) * 32 + 24 + 4 * slices as u128;
        if bytes.len() as u128 != want {
            return Err(bad("length does not match header"));
        }
        let slice_offsets = (0..slices).map(|s| f(24 + 4 * s)).collect();
        let rec = |i: usize| {
            let o = 24 + 4 * slices + 32 * i;
            (
                [f(o), f(o + 4), f(o + 8)],
                u(o + 12),
                [f(o + 16), f(o + 20), f(o + 24)],
                u(o + 28),
            )
        };
        let nodes: Vec<BvhNode> = (0..n_nodes)
            .map(|i| {
                let (min, left_or_first, max, count) = rec(i);
                BvhNode {
                    min,
                    left_or_first,
                    max,
                    count,
                }
            })
            .collect();
        let prims: Vec<BvhPrim> = (0..n_prims)
            .map(|i| {
                let (min, page, max, slice) = rec(n_nodes + i);
                BvhPrim {
                    min,
                    page,
                    max,
                    slice,
                }
            })
            .collect();
        for n in &nodes {
            let (a, c) = (n.left_or_first as usize, n.count as usize);
            let ok = if c == 0 {
                a > 0 && a + 1 < n_nodes
            } else {
                a + c <= n_prims
            };
            if !ok {
                return Err(bad("node index out of range"));
            }
        }
        if prims
            .iter()
            .any(|p| p.page as usize >= pages || p.slice as usize >= slices)
        {
            return Err(bad("primitive page or slice out of range"));
        }
        // A malicious file could make cycles; traversal is bounded by its stack, but
        // the depth guarantee only holds for trees this builder made, so check it.
        let mut depth_stack = vec![(0usize, 0usize)];
        while let Some((i, d)) = depth_stack.pop() {
            if nodes.is_empty() {
                break;
            }
            if d > MAX_DEPTH {
                return Err(bad("tree deeper than MAX_DEPTH"));
            }
            let n = nodes[i];
            if n.count == 0 {
                depth_stack.push((n.left_or_first as usize, d + 1));
                depth_stack.push((n.left_or_first as usize + 1, d + 1));
            }
        }
        Ok(Self {
            slices,
            pages,
            slice_offsets,
            nodes,
            prims,
        })
    }
}

fn push_record(out: &mut Vec<u8>, min: [f32; 3], a: u32, max: [f32; 3], b: u32) {
    for v in min {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(&a.to_le_bytes());
    for v in max {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(&b.to_le_bytes());
}

/// Binned SAH split; reorders `items` and returns the left count, or `None`
/// when a leaf is cheaper or no split separates the centroids.
fn sah_split(items: &mut [Item], bounds: &Aabb) -> Option<usize> {
    let cb = items.iter().fold(Aabb::empty(), |a, it| {
        a.union(&Aabb::new(it.centroid, it.centroid))
    });
    let mut best: Option<(f32, usize, usize)> = None; // (cost, axis, bin boundary)
    for axis in 0..3 {
        let (lo, hi) = (cb.min[axis], cb.max[axis]);
        // Also skips NaN extents (the data is validated finite, this is belt and braces).
        if hi.partial_cmp(&lo) != Some(std::cmp::Ordering::Greater) {
            continue;
        }
        let scale = BINS as f32 / (hi - lo);
        let bin_of = |c: f32| (((c - lo) * scale) as usize).min(BINS - 1);
        let mut counts = [0usize; BINS];
        let mut boxes = [Aabb::empty(); BINS];
        for it in items.iter() {
            let b = bin_of(it.centroid[axis]);
            counts[b] += 1;
            boxes[b] = boxes[b].union(&it.bounds);
        }
        let mut right_area = [0f32; BINS];
        let mut right_count = [0usize; BINS];
        let (mut acc, mut n) = (Aabb::empty(), 0);
        for b in (1..BINS).rev() {
            acc = acc.union(&boxes[b]);
            n += counts[b];
            right_area[b] = acc.area();
            right_count[b] = n;
        }
        let (mut acc, mut n) = (Aabb::empty(), 0);
        for b in 1..BINS {
            acc = acc.union(&boxes[b - 1]);
            n += counts[b - 1];
            if n == 0 || right_count[b] == 0 {
                continue;
            }
            let cost = acc.area() * n as f32 + right_area[b] * right_count[b] as f32;
            if best.is_none_or(|(c, _, _)| cost < c) {
                best = Some((cost, axis, b));
            }
        }
    }
    let (cost, axis, boundary) = best?;
    let leaf_cost = bounds.area() * items.len() as f32;
    if items.len() <= 2 * MAX_LEAF && cost >= leaf_cost {
        return None;
    }
    let (lo, hi) = (cb.min[axis], cb.max[axis]);
    let scale = BINS as f32 / (hi - lo);
    let mut mid = 0;
    for i in 0..items.len() {
        let b = (((items[i].centroid[axis] - lo) * scale) as usize).min(BINS - 1);
        if b < boundary {
            items.swap(i, mid);
            mid += 1;
        }
    }
    if mid == 0 || mid == items.len() {
        return None;
    }
    Some(mid)
}
