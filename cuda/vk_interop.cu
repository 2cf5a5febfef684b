// MIRAGE CUDA–Vulkan routing interop (crates/mirage-cuda/src/vk_interop.rs).
// Compiled after route.cu (same module). The Vulkan ray-tracing router
// (crates/mirage-route/src/vk_rt.rs) traverses the page boxes; CUDA does the
// two ends:
//   vki_project: slice points z[q][s][a] = P[s][a] . x[q], written straight
//     into the Vulkan-exported points buffer (query-major, 3 floats per slice,
//     slice-local: the ray generation shader adds the slice offsets) by
//     route.cu's rt_project: bit-identical to RouterData::project_into;
//   vki_compact: the Vulkan candidate bitsets (one u32 word per 32 pages per
//     query) to route.cu's active list by route.cu's rt_compact: page p is
//     active when p < n_trunk or (p < router_pages and its bit is set),
//     ascending ids, the count.
// One block of VKI_THREADS per query for both; ids has n_pages entries per
// query, count one int per query.

#define VKI_THREADS 256

extern "C" __global__ void __launch_bounds__(VKI_THREADS)
    vki_project(const float* __restrict__ x, int d, const float* __restrict__ proj, int slices,
                float* __restrict__ points) {
    PDL_ENTRY();
    const int q = blockIdx.x;
    rt_project(x + (long)q * d, d, proj, slices * 3, points + (long)q * slices * 3);
}

struct VkiBitRule {
    const unsigned* bits;
    int words, n_trunk, router_pages;
    __device__ bool operator()(int p) const {
        return p < n_trunk || (p < router_pages && (p >> 5) < words && ((bits[p >> 5] >> (p & 31)) & 1u));
    }
};

extern "C" __global__ void __launch_bounds__(VKI_THREADS)
    vki_compact(const unsigned* __restrict__ bits, int words, int router_pages, int n_pages, int n_trunk,
                unsigned* __restrict__ ids, int* __restrict__ count) {
    PDL_ENTRY();
    const int q = blockIdx.x;
    rt_compact(n_pages, VkiBitRule{bits + (long)q * words, words, n_trunk, router_pages}, ids + (long)q * n_pages,
               count + q);
}
