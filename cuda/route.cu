// MIRAGE sparse-path CUDA kernels, part 3: routing on the device. One block
// turns a layer's FFN input x into the active page list the fused FFN reads
// (superblock.cu), with no host round trip:
//   1. slice points z[s][a] = P[s][a] . x (the artifact's router projection),
//      one warp per row in mirage_route::slice_dot's canonical order;
//   2. page hit masks: bit s of mask[p] is set when slice s's point lies in
//      page p's box, found either by testing every leaf primitive at once
//      (`scan`: one thread per primitive) or by walking the BVH
//      (mirage_route::Bvh, flattened 32-byte nodes and prims, one thread per
//      slice);
//   3. page p is active when p < n_trunk or popcount(mask[p]) >= thresholds[p]
//      (the PageSelector rule: trunk, then the CpuBvh candidates), written in
//      ascending order to ids[], the count to *count.
//
// Exactness: both hit-mask paths use the closed containment of the
// untranslated point in the untranslated leaf box, and the traversal's
// culling is conservative (node bounds padded on the host), so for the same
// points the sets are exactly the CPU's; the projection is slice_dot's order
// (lane-strided sums, then the xor butterfly, round to nearest, no FMA), so
// the points are the CPU's bit for bit.
//
// Why a scan beside the BVH: the routers of these models have a few hundred
// primitives (pages x slices) whose boxes overlap almost everywhere (margin-0
// boxes of the calibration points), so a traversal visits nearly every leaf,
// one dependent primitive load after another on `slices` threads (the first
// version spent ~30 us per layer there); a block tests 512 primitives in one
// parallel load. The host picks (RouteTraversal::scans, sparse/router.rs); the
// traversal stays for large routers and is tested against the CPU too.
//
// Block RT_THREADS; dynamic shared memory: the hit masks (4 * n_pages bytes,
// rounded up to 16) at least; when the launch gives more, the kernel also
// stages x (4 * d bytes) and then the BVH nodes (32 * n_nodes bytes) there,
// in that order, as far as they fit (`route_smem_bytes` on the host).

#define RT_THREADS 512
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

// Strides of 32 elements whose projection loads a lane issues at once: 28
// covers a 896-wide row (the 0.5B models) in one round trip and a 3584-wide
// one in four (16 took two and seven).
#define RT_DOT_BATCH 28
// Leaf primitives a thread of the scan loads before it tests any of them.
#define RT_SCAN_BATCH 4

// row[k] . x for NR rows in mirage_route::slice_dot's order (each lane sums
// its elements lane, lane + 32, ... in turn, then the xor butterfly); every
// lane gets the sums. The loads of RT_DOT_BATCH strides of every row go
// out before their (ordered) adds: the projection is a chain of memory
// round trips on one block, ceil(d / (32 RT_DOT_BATCH)) per NR rows.
// How the loads are kept together (SASS checked with nvdisasm, sm_90): they
// are unconditional (clamped index; predicated loads were issued one to
// eight at a time between the adds), and a __syncwarp separates them from
// the adds (without it, even clamped loads went out a few at a time). The
// fence steers ptxas's schedule here; it does not bind it, so check the SASS
// after changing this code. The warp's trip count is uniform (base runs over
// the warp's strides, not the lane's), as __syncwarp needs.
template <int NR>
__device__ __forceinline__ void rt_slice_dots(const float* const (&row)[NR], const float* x, int d, int lane,
                                              float (&acc)[NR]) {
#pragma unroll
    for (int k = 0; k < NR; k++) acc[k] = 0.f;
    for (int base = 0; base < d; base += 32 * RT_DOT_BATCH) {
        float p[NR][RT_DOT_BATCH];
#pragma unroll
        for (int u = 0; u < RT_DOT_BATCH; u++) {
            const int i = min(base + lane + 32 * u, d - 1);
#pragma unroll
            for (int k = 0; k < NR; k++) p[k][u] = __ldg(row[k] + i);
        }
        __syncwarp();
#pragma unroll
        for (int u = 0; u < RT_DOT_BATCH; u++) {
            const int i = base + lane + 32 * u;
            if (i < d) {
                const float xv = x[i];
#pragma unroll
                for (int k = 0; k < NR; k++) acc[k] = __fadd_rn(acc[k], __fmul_rn(p[k][u], xv));
            }
        }
    }
#pragma unroll
    for (int k = 0; k < NR; k++)
#pragma unroll
        for (int h = 16; h > 0; h >>= 1) acc[k] = __fadd_rn(acc[k], __shfl_xor_sync(0xffffffffu, acc[k], h));
}

// out[r] = row r of proj (rows x d) . x, one warp per row (the block's warps
// take rows w, w + warps, ..., two at a time).
__device__ __forceinline__ void rt_project(const float* x, int d, const float* __restrict__ proj, int rows,
                                           float* out) {
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int r = threadIdx.x >> 5; r < rows; r += 2 * warps) {
        if (r + warps < rows) {
            const float* const two[2] = {proj + (long)r * d, proj + (long)(r + warps) * d};
            float v[2];
            rt_slice_dots<2>(two, x, d, lane, v);
            if (lane == 0) {
                out[r] = v[0];
                out[r + warps] = v[1];
            }
        } else {
            const float* const one[1] = {proj + (long)r * d};
            float v[1];
            rt_slice_dots<1>(one, x, d, lane, v);
            if (lane == 0) out[r] = v[0];
        }
    }
}

// Ordered compaction of the block: ids[] = the pages p < n_pages with on(p)
// in ascending order, *count = how many. blockDim pages per round: a ballot
// per warp, warp offsets in shared memory, a running total across rounds.
// Every thread of the block must call it.
template <class On>
__device__ __forceinline__ void rt_compact(int n_pages, On on_page, unsigned* __restrict__ ids,
                                           int* __restrict__ count) {
    __shared__ int warp_base[32];
    __shared__ int running;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
    if (tid == 0) running = 0;
    __syncthreads();
    for (int base = 0; base < n_pages; base += blockDim.x) {
        const int p = base + tid;
        const bool on = p < n_pages && on_page(p);
        const unsigned b = __ballot_sync(0xffffffffu, on);
        if (lane == 0) warp_base[warp] = __popc(b);
        __syncthreads();
        if (tid == 0) {
            int acc = running;
            for (int w = 0; w < warps; w++) {
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

struct RtMaskRule {
    const unsigned* mask;
    const unsigned* thresholds;
    int n_trunk, router_pages;
    __device__ bool operator()(int p) const {
        return p < n_trunk || (p < router_pages && (unsigned)__popc(mask[p]) >= thresholds[p]);
    }
};

__device__ __forceinline__ bool rt_prim_hit(const RtPrim& q, int s, const float* pts) {
    const float p0 = pts[3 * s], p1 = pts[3 * s + 1], p2 = pts[3 * s + 2];
    return p0 >= q.min[0] && p0 <= q.max[0] && p1 >= q.min[1] && p1 <= q.max[1] && p2 >= q.min[2] &&
           p2 <= q.max[2];
}

// Folded RMSNorm (nw != null; a recorded step sets it when the norm before
// the FFN is this launch's input, `CudaBackend::fold_norm`): x is then the
// norm's INPUT; the block normalizes it with the rms_norm kernel's
// arithmetic and bits (rms_norm_row_by on 256 of its threads), routes on
// the result and writes it to nout, the buffer the fused FFN reads next.
// One launch fewer per layer: routing then costs only what it adds to the
// norm launch it replaces.
extern "C" __global__ void __launch_bounds__(RT_THREADS, 1)
    route_bvh(const float* __restrict__ x, int d, const float* __restrict__ proj, int slices,
              const float* __restrict__ slice_offsets, const RtNode* __restrict__ nodes, int n_nodes,
              const RtPrim* __restrict__ prims, int n_prims, int scan, const unsigned* __restrict__ thresholds,
              int router_pages, int n_pages, int n_trunk, unsigned* __restrict__ ids, int* __restrict__ count,
              const float* __restrict__ nw, float neps, float* __restrict__ nout) {
    // The router's tables are constants of the model: ask L2 for them
    // before waiting on the previous kernel (pdl.cu), so that the
    // projection's loads after the wait hit L2 (the FFN weights streamed
    // through since the last token have evicted them).
    l2_prefetch_block(proj, 12L * slices * d);
    if (scan)
        l2_prefetch_block(prims, 32L * n_prims);
    else
        l2_prefetch_block(nodes, 32L * n_nodes);
    l2_prefetch_block(thresholds, 4L * router_pages);
    PDL_ENTRY();
    extern __shared__ __align__(16) unsigned char rt_smem[];
    unsigned* rt_mask = (unsigned*)rt_smem;
    __shared__ float pts[32 * 3];
    const int tid = threadIdx.x;
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    const unsigned mask_bytes = ((unsigned)n_pages * 4u + 15u) & ~15u;
    const bool x_in_smem = dyn >= mask_bytes + 4u * (unsigned)d;
    const bool nodes_in_smem =
        !scan && x_in_smem && dyn >= mask_bytes + 4u * (unsigned)d + 32u * (unsigned)n_nodes;
    float* xs = (float*)(rt_smem + mask_bytes);
    RtNode* ns = (RtNode*)(rt_smem + mask_bytes + 4u * (unsigned)d);
    for (int p = tid; p < n_pages; p += blockDim.x) rt_mask[p] = 0u;
    if (nw != 0) {
        __shared__ float s32[32];
        rms_norm_row_by(256, x, nw, neps, d, s32, [&](int i, float v) {
            nout[i] = v;
            if (x_in_smem) xs[i] = v;
        });
    } else if (x_in_smem) {
        for (int i = tid; i < d; i += blockDim.x) xs[i] = __ldg(x + i);
    }
    if (nodes_in_smem) {
        const uint4* src = (const uint4*)nodes;  // 32-byte nodes: two uint4 each
        uint4* dst = (uint4*)ns;
        for (int i = tid; i < 2 * n_nodes; i += blockDim.x) dst[i] = __ldg(src + i);
    }
    __syncthreads();
    // Without room for x in shared memory, the folded norm's output is read
    // back from nout (written above by this block: visible after the
    // barrier; plain loads, not __ldg).
    rt_project(x_in_smem ? xs : nw != 0 ? nout : x, d, proj, slices * 3, pts);
    __syncthreads();
    if (scan) {
        // RT_SCAN_BATCH primitives a thread in flight at once (a few
        // hundred to a few thousand primitives: one or two round trips
        // instead of one per blockDim primitives); the hit masks are ORs,
        // so the order of the tests does not matter.
        for (int base = tid; base < n_prims; base += RT_SCAN_BATCH * blockDim.x) {
            RtPrim q[RT_SCAN_BATCH];
#pragma unroll
            for (int u = 0; u < RT_SCAN_BATCH; u++) {
                const int k = base + u * blockDim.x;
                if (k < n_prims) q[u] = prims[k];
            }
#pragma unroll
            for (int u = 0; u < RT_SCAN_BATCH; u++) {
                const int k = base + u * blockDim.x, s = (int)q[u].slice;
                if (k < n_prims && s < slices && (int)q[u].page < n_pages && rt_prim_hit(q[u], s, pts))
                    atomicOr(&rt_mask[q[u].page], 1u << s);
            }
        }
    } else if (tid < slices && n_nodes > 0) {
        const RtNode* np = nodes_in_smem ? ns : nodes;
        const int s = tid;
        const float t0 = __fadd_rn(pts[3 * s], slice_offsets[s]);
        const float p1 = pts[3 * s + 1], p2 = pts[3 * s + 2];
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
                    if ((int)q.slice == s && (int)q.page < n_pages && rt_prim_hit(q, s, pts))
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
    rt_compact(n_pages, RtMaskRule{rt_mask, thresholds, n_trunk, router_pages}, ids, count);
}
