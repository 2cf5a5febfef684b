// MIRAGE router: BVH traversal as a wgpu compute shader.
// Same flattened BVH as crates/mirage-route/src/bvh.rs (32-byte nodes and prims).
// Pass 1 `traverse`: one invocation per (query, slice); each leaf primitive of
// the query's slice that contains the slice-local point ORs bit `slice` into
// masks[query * pages + page]. Pass 2 `threshold`: one invocation per
// (query, 32-page word); a page is a candidate when popcount(mask) >= threshold.

struct Params {
    queries: u32,
    slices: u32,
    pages: u32,
    words: u32,
    node_count: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

// vec3<f32> has size 12 and alignment 16: the u32 after it sits at offset 12,
// exactly like the #[repr(C)] Rust records.
struct Node {
    min: vec3<f32>,
    left_or_first: u32,
    max: vec3<f32>,
    count: u32,
}

struct Prim {
    min: vec3<f32>,
    page: u32,
    max: vec3<f32>,
    slice: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> nodes: array<Node>;
@group(0) @binding(2) var<storage, read> prims: array<Prim>;
@group(0) @binding(3) var<storage, read> offsets: array<f32>;
@group(0) @binding(4) var<storage, read> points: array<f32>;
@group(0) @binding(5) var<storage, read> thresholds: array<u32>;
@group(0) @binding(6) var<storage, read_write> masks: array<atomic<u32>>;
@group(0) @binding(7) var<storage, read_write> out_bits: array<u32>;

const WORKGROUP: u32 = 64u;
const STACK_SIZE: u32 = 64u;

@compute @workgroup_size(64)
fn traverse(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = gid.x + gid.y * nwg.x * WORKGROUP;
    if (idx >= params.queries * params.slices || params.node_count == 0u) {
        return;
    }
    let q = idx / params.slices;
    let s = idx % params.slices;
    let p = vec3<f32>(points[idx * 3u], points[idx * 3u + 1u], points[idx * 3u + 2u]);
    let t = vec3<f32>(p.x + offsets[s], p.y, p.z);
    var stack: array<u32, 64>;
    stack[0] = 0u;
    var sp = 1u;
    loop {
        if (sp == 0u) {
            break;
        }
        sp = sp - 1u;
        let n = nodes[stack[sp]];
        // Written as "inside" so that NaN points are culled, as on the CPU.
        if (!(all(t >= n.min) && all(t <= n.max))) {
            continue;
        }
        if (n.count > 0u) {
            for (var i = n.left_or_first; i < n.left_or_first + n.count; i = i + 1u) {
                let pr = prims[i];
                if (pr.slice == s && all(p >= pr.min) && all(p <= pr.max)) {
                    atomicOr(&masks[q * params.pages + pr.page], 1u << s);
                }
            }
        } else if (sp + 2u <= STACK_SIZE) {
            stack[sp] = n.left_or_first;
            stack[sp + 1u] = n.left_or_first + 1u;
            sp = sp + 2u;
        }
    }
}

@compute @workgroup_size(64)
fn threshold(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = gid.x + gid.y * nwg.x * WORKGROUP;
    if (idx >= params.queries * params.words) {
        return;
    }
    let q = idx / params.words;
    let w = idx % params.words;
    var bits = 0u;
    for (var b = 0u; b < 32u; b = b + 1u) {
        let page = w * 32u + b;
        if (page >= params.pages) {
            break;
        }
        let m = atomicLoad(&masks[q * params.pages + page]);
        if (countOneBits(m) >= thresholds[page]) {
            bits = bits | (1u << b);
        }
    }
    out_bits[idx] = bits;
}
