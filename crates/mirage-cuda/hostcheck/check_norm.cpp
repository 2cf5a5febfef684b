// Host check of dense.cu's rms_norm_row (no GPU): the function cut out of the
// kernel source (extract.py -> norm_extract.h) and run as one block, every
// CUDA thread an std::thread (shared memory = a static array, __syncthreads
// = a block barrier, warp shuffles = a 32-thread exchange with barriers, as
// check_pruned.cpp). For row widths that take the vector path in one round,
// in several rounds and with a partial last round, and widths / misaligned
// rows that take the scalar loop, at 256 threads (the backend's launch):
// every element is emitted exactly once, the values equal an f64 RMSNorm to
// 2e-6 relative, and the vector path equals the scalar loop on the same row
// to the same bound (they sum in different orders).
// Build and run: hostcheck/run.sh.
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

struct dim3_ { unsigned x = 1, y = 1, z = 1; };
thread_local dim3_ threadIdx, blockIdx;
dim3_ blockDim;
static std::barrier<>* g_block = nullptr;
static std::vector<std::unique_ptr<std::barrier<>>> g_warps;
static std::vector<float> g_slots;

#define __device__
#define __forceinline__ inline
#define __restrict__
struct float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
template <class T> T __ldg(const T* p) { return *p; }
inline float rsqrtf(float v) { return 1.f / std::sqrt(v); }
inline void __syncthreads() { g_block->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
    int t = threadIdx.x, lane = t & 31, w = t >> 5;
    g_slots[t] = v;
    g_warps[w]->arrive_and_wait();
    float r = g_slots[w * 32 + (lane ^ o)];
    g_warps[w]->arrive_and_wait();
    return r;
}
inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
#include "norm_extract.h"

// Runs rms_norm_row over xr on one block of `threads`; out[i] gets emit's
// value, hits[i] how many times element i was emitted.
static void run_block(const float* xr, const float* w, int cols, int threads, std::vector<float>& out,
                      std::vector<int>& hits) {
    blockDim.x = threads;
    std::barrier<> bar(threads);
    g_block = &bar;
    g_warps.clear();
    for (int i = 0; i < threads / 32; i++) g_warps.push_back(std::make_unique<std::barrier<>>(32));
    g_slots.assign(threads, 0.f);
    out.assign(cols, NAN);
    hits.assign(cols, 0);
    static float s32[32];
    std::vector<std::thread> th;
    for (int t = 0; t < threads; t++)
        th.emplace_back([&, t] {
            threadIdx.x = t;
            rms_norm_row(xr, w, 1e-6f, cols, s32, [&](int i, float v) {
                out[i] = v;
                __atomic_fetch_add(&hits[i], 1, __ATOMIC_RELAXED);
            });
        });
    for (auto& x : th) x.join();
}

int main() {
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.f, 1.f);
    int fails = 0, cases = 0;
    // 4 * 256 * NORM_VEC floats per round of the vector path.
    const int widths[] = {896, 1024, 3584, 4096, 5120, 4100, 8192 + 16, 90, 6, 2};
    for (int cols : widths) {
        for (int misalign = 0; misalign < 2; misalign++) {
            // 16-byte aligned storage; misalign = 1 shifts the row by one float (scalar path).
            std::vector<float4> xs(cols / 4 + 2), ws(cols / 4 + 2);
            float* x = reinterpret_cast<float*>(xs.data()) + misalign;
            float* w = reinterpret_cast<float*>(ws.data());
            for (int i = 0; i < cols; i++) x[i] = 3.f * nd(rng), w[i] = 1.f + 0.5f * nd(rng);
            double ss = 0;
            for (int i = 0; i < cols; i++) ss += (double)x[i] * x[i];
            double scale = 1.0 / std::sqrt(ss / cols + 1e-6);
            std::vector<float> out, scalar_out;
            std::vector<int> hits, scalar_hits;
            run_block(x, w, cols, 256, out, hits);
            // The scalar loop on the same values: copy x to a row one float off alignment.
            std::vector<float4> xs2(cols / 4 + 2);
            float* x2 = reinterpret_cast<float*>(xs2.data()) + 1;
            memcpy(x2, x, cols * sizeof(float));
            run_block(x2, w, cols, 256, scalar_out, scalar_hits);
            double worst = 0, worst_sc = 0;
            int bad_hits = 0;
            for (int i = 0; i < cols; i++) {
                double ref = x[i] * scale * w[i];
                worst = std::max(worst, std::fabs(out[i] - ref) / (std::fabs(ref) + 1e-3));
                worst_sc = std::max(worst_sc, std::fabs((double)out[i] - scalar_out[i]) / (std::fabs(ref) + 1e-3));
                bad_hits += hits[i] != 1 || scalar_hits[i] != 1;
            }
            bool vec = cols % 4 == 0 && misalign == 0;
            bool ok = bad_hits == 0 && worst < 2e-6 && worst_sc < 2e-6;
            cases++;
            fails += !ok;
            printf("rms_norm_row cols %5d %s: %s (elements not emitted once: %d, vs f64 %.2e, vs scalar loop %.2e)\n", cols,
                   vec ? "vector" : "scalar", ok ? "ok" : "FAIL", bad_hits, worst, worst_sc);
        }
    }
    printf("rms_norm_row: %d of %d cases ok\n", cases - fails, cases);
    return fails ? 1 : 0;
}
