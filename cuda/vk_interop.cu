// MIRAGE CUDA–Vulkan routing interop (crates/mirage-cuda/src/vk_interop.rs).
// Compiled after route.cu (same module). The Vulkan ray-tracing router
// (crates/mirage-route/src/vk_rt.rs) traverses the page boxes; CUDA does the
// two ends:
//   vki_project: slice points z[q][s][a] = P[s][a] . x[q], written straight
//     into the Vulkan-exported points buffer (query-major, 3 floats per
//     slice, slice-local: the ray generation shader adds the slice offsets);
//     `exact` is route.cu's CPU-order summation, bit-identical to
//     RouterData::project_into;
//   vki_compact: the Vulkan candidate bitsets (one u32 word per 32 pages per
//     query) to route.cu's active list: page p is active when p < n_trunk or
//     (p < router_pages and its bit is set), ascending ids, the count.
// One block of VKI_THREADS per query for both; ids has n_pages entries per
// query, count one int per query.

#define VKI_THREADS 256

extern "C" __global__ void __launch_bounds__(VKI_THREADS)
    vki_project(const float* __restrict__ x, int d, const float* __restrict__ proj, int slices, int exact,
                float* __restrict__ points) {
    const int q = blockIdx.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float* xq = x + (long)q * d;
    float* out = points + (long)q * slices * 3;
    const int rows = slices * 3;
    if (exact) {
        for (int r = tid; r < rows; r += blockDim.x) {
            const float* pr = proj + (long)r * d;
            float acc = -0.0f;  // Rust's f32 Sum starts from -0.0
            for (int i = 0; i < d; i++) acc = __fadd_rn(acc, __fmul_rn(__ldg(pr + i), __ldg(xq + i)));
            out[r] = acc;
        }
    } else {
        for (int r = warp; r < rows; r += blockDim.x >> 5) {
            const float* pr = proj + (long)r * d;
            float acc = 0.f;
            for (int i = lane; i < d; i += 32) acc += __ldg(pr + i) * __ldg(xq + i);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            if (lane == 0) out[r] = acc;
        }
    }
}

extern "C" __global__ void __launch_bounds__(VKI_THREADS)
    vki_compact(const unsigned* __restrict__ bits, int words, int router_pages, int n_pages, int n_trunk,
                unsigned* __restrict__ ids, int* __restrict__ count) {
    __shared__ int vki_warp_base[VKI_THREADS / 32];
    __shared__ int vki_running;
    const int q = blockIdx.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const unsigned* bq = bits + (long)q * words;
    unsigned* iq = ids + (long)q * n_pages;
    if (tid == 0) vki_running = 0;
    __syncthreads();
    for (int base = 0; base < n_pages; base += blockDim.x) {
        const int p = base + tid;
        bool on = false;
        if (p < n_pages) {
            if (p < n_trunk) {
                on = true;
            } else if (p < router_pages && (p >> 5) < words) {
                on = (bq[p >> 5] >> (p & 31)) & 1u;
            }
        }
        const unsigned b = __ballot_sync(0xffffffffu, on);
        if (lane == 0) vki_warp_base[warp] = __popc(b);
        __syncthreads();
        if (tid == 0) {
            int acc = vki_running;
            for (int w = 0; w < (int)(blockDim.x >> 5); w++) {
                const int c = vki_warp_base[w];
                vki_warp_base[w] = acc;
                acc += c;
            }
            vki_running = acc;
        }
        __syncthreads();
        if (on) iq[vki_warp_base[warp] + __popc(b & ((1u << lane) - 1u))] = (unsigned)p;
        __syncthreads();
    }
    if (tid == 0) count[q] = vki_running;
}
