// MIRAGE sparse-path CUDA kernels, part 3: routing on the device. One block
// turns a layer's FFN input x into the active page list the fused FFN reads
// (superblock.cu), with no host round trip:
//   1. slice points z[s][a] = P[s][a] . x (the artifact's router projection);
//   2. BVH traversal of every slice point (mirage_route::Bvh, flattened
//      32-byte nodes and prims, one thread per slice), setting bit s of the
//      page's hit mask for every leaf box that contains the point;
//   3. page p is active when p < n_trunk or popcount(mask[p]) >= thresholds[p]
//      (the PageSelector rule: trunk, then the CpuBvh candidates), written in
//      ascending order to ids[], the count to *count.
//
// Exactness: the traversal's culling is conservative (node bounds padded on
// the host) and the leaf test is the closed containment of the untranslated
// point in the untranslated box, so for the same points the set is exactly
// the CPU's. The projection in `exact` mode is one thread per row adding
// p[i] * x[i] in index order with round-to-nearest and no FMA contraction,
// which is what the CPU's `iter().map(p * v).sum()` computes, bit for bit;
// the fast mode reduces each row over a warp (different rounding: points can
// move by an ulp, which changes a set only for a point on a box face).
//
// Block RT_THREADS; dynamic shared memory: the hit masks (4 * n_pages bytes,
// rounded up to 16) at least; when the launch gives more, the kernel also
// stages x (4 * d bytes) and then the BVH nodes (32 * n_nodes bytes) there,
// in that order, as far as they fit (`route_smem_bytes` on the host). A
// thread walking the tree from shared memory waits ~30 cycles per node
// instead of a global-memory round trip, and the exact projection's loads
// of x come from shared memory; neither changes any arithmetic.

#define RT_THREADS 256
#define RT_STACK 64

struct RtNode {
    float min[3];
    unsigned left_or_first;
    float max[3];
    unsigned count;
};

struct RtPrim {
    float min[3];
    unsigned page;
    float max[3];
    unsigned slice;
};

extern "C" __global__ void __launch_bounds__(RT_THREADS)
    route_bvh(const float* __restrict__ x, int d, const float* __restrict__ proj, int slices, int exact,
              const float* __restrict__ slice_offsets, const RtNode* __restrict__ nodes, int n_nodes,
              const RtPrim* __restrict__ prims, const unsigned* __restrict__ thresholds, int router_pages,
              int n_pages, int n_trunk, unsigned* __restrict__ ids, int* __restrict__ count) {
    extern __shared__ __align__(16) unsigned char rt_smem[];
    unsigned* rt_mask = (unsigned*)rt_smem;
    __shared__ float pts[32 * 3];
    __shared__ int warp_base[RT_THREADS / 32];
    __shared__ int running;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    const unsigned mask_bytes = ((unsigned)n_pages * 4u + 15u) & ~15u;
    const bool x_in_smem = dyn >= mask_bytes + 4u * (unsigned)d;
    const bool nodes_in_smem = x_in_smem && dyn >= mask_bytes + 4u * (unsigned)d + 32u * (unsigned)n_nodes;
    float* xs = (float*)(rt_smem + mask_bytes);
    RtNode* ns = (RtNode*)(rt_smem + mask_bytes + 4u * (unsigned)d);
    for (int p = tid; p < n_pages; p += blockDim.x) rt_mask[p] = 0u;
    if (x_in_smem)
        for (int i = tid; i < d; i += blockDim.x) xs[i] = __ldg(x + i);
    if (nodes_in_smem) {
        const uint4* src = (const uint4*)nodes;  // 32-byte nodes: two uint4 each
        uint4* dst = (uint4*)ns;
        for (int i = tid; i < 2 * n_nodes; i += blockDim.x) dst[i] = __ldg(src + i);
    }
    __syncthreads();
    const float* xp = x_in_smem ? xs : x;
    const RtNode* np = nodes_in_smem ? ns : nodes;
    const int rows = slices * 3;
    if (exact) {
        for (int r = tid; r < rows; r += blockDim.x) {
            const float* pr = proj + (long)r * d;
            float acc = -0.0f;  // Rust's f32 Sum starts from -0.0
            // Loads batched 8 at a time (independent), the adds still one by
            // one in index order: the same sum, bit for bit.
            int i = 0;
            for (; i + 8 <= d; i += 8) {
                float pv[8], xv[8];
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    pv[k] = __ldg(pr + i + k);
                    xv[k] = xp[i + k];
                }
#pragma unroll
                for (int k = 0; k < 8; k++) acc = __fadd_rn(acc, __fmul_rn(pv[k], xv[k]));
            }
            for (; i < d; i++) acc = __fadd_rn(acc, __fmul_rn(__ldg(pr + i), xp[i]));
            pts[r] = acc;
        }
    } else {
        for (int r = warp; r < rows; r += blockDim.x >> 5) {
            const float* pr = proj + (long)r * d;
            float acc = 0.f;
            for (int i = lane; i < d; i += 32) acc += __ldg(pr + i) * xp[i];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            if (lane == 0) pts[r] = acc;
        }
    }
    __syncthreads();
    if (tid < slices && n_nodes > 0) {
        const int s = tid;
        const float p0 = pts[3 * s], p1 = pts[3 * s + 1], p2 = pts[3 * s + 2];
        const float t0 = __fadd_rn(p0, slice_offsets[s]);
        unsigned stack[RT_STACK];
        int sp = 1;
        stack[0] = 0;
        while (sp > 0) {
            const RtNode n = np[stack[--sp]];
            if (!(t0 >= n.min[0] && t0 <= n.max[0] && p1 >= n.min[1] && p1 <= n.max[1] && p2 >= n.min[2] &&
                  p2 <= n.max[2]))
                continue;
            if (n.count > 0) {
                for (unsigned k = 0; k < n.count; k++) {
                    const RtPrim q = prims[n.left_or_first + k];
                    if ((int)q.slice == s && p0 >= q.min[0] && p0 <= q.max[0] && p1 >= q.min[1] && p1 <= q.max[1] &&
                        p2 >= q.min[2] && p2 <= q.max[2] && (int)q.page < n_pages)
                        atomicOr(&rt_mask[q.page], 1u << s);
                }
            } else if (sp + 2 <= RT_STACK) {  // the builder bounds the depth (MAX_DEPTH 48)
                stack[sp] = n.left_or_first;
                stack[sp + 1] = n.left_or_first + 1;
                sp += 2;
            }
        }
    }
    __syncthreads();
    // Ordered compaction, blockDim pages at a time: ballot per warp, warp
    // offsets in shared memory, a running total across rounds.
    if (tid == 0) running = 0;
    __syncthreads();
    for (int base = 0; base < n_pages; base += blockDim.x) {
        const int p = base + tid;
        bool on = false;
        if (p < n_pages) {
            if (p < n_trunk) {
                on = true;
            } else if (p < router_pages) {
                on = (unsigned)__popc(rt_mask[p]) >= thresholds[p];
            }
        }
        const unsigned b = __ballot_sync(0xffffffffu, on);
        if (lane == 0) warp_base[warp] = __popc(b);
        __syncthreads();
        if (tid == 0) {
            int acc = running;
            for (int w = 0; w < (int)(blockDim.x >> 5); w++) {
                const int c = warp_base[w];
                warp_base[w] = acc;
                acc += c;
            }
            running = acc;
        }
        __syncthreads();
        if (on) ids[warp_base[warp] + __popc(b & ((1u << lane) - 1u))] = (unsigned)p;
        __syncthreads();
    }
    if (tid == 0) *count = running;
}

// Fills a layer's active list with the first n ids of `order` (prefix-slice
// mode: order = 0, 1, 2, ...; forced random subsets: a sorted random list),
// count on the device. Used once at set-up; a graph can replay it too.
extern "C" __global__ void set_active_prefix(const unsigned* __restrict__ order, int n, unsigned* __restrict__ ids,
                                             int* __restrict__ count) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) ids[i] = order[i];
    if (blockIdx.x == 0 && threadIdx.x == 0) *count = n;
}
