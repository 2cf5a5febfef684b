// One CUDA thread block emulated on the host, for the host checks that run
// block-wide device code (check_norm.cpp, check_attend.cpp): every CUDA
// thread an std::thread, __shared__ = a static (one block runs at a time),
// __syncthreads = a block barrier, __shfl_xor_sync = a 32-thread exchange
// between two warp barriers, __syncwarp = a warp barrier. run_block(threads, f) runs f on every thread
// of one block (threadIdx set; blockIdx / gridDim are the caller's).
#pragma once
#include <barrier>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

struct dim3_ { unsigned x = 1, y = 1, z = 1; };
thread_local dim3_ threadIdx, blockIdx;
dim3_ blockDim, gridDim;
static std::barrier<>* g_block = nullptr;
static std::vector<std::unique_ptr<std::barrier<>>> g_warps;
static std::vector<float> g_slots;

#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
struct float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
template <class T> T __ldg(const T* p) { return *p; }
inline float rsqrtf(float v) { return 1.f / std::sqrt(v); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline void __syncthreads() { g_block->arrive_and_wait(); }
// A warp barrier: every lane of the warp must reach it (as on the GPU with
// the full mask); a lane that does not would hang the check.
inline void __syncwarp() { g_warps[threadIdx.x >> 5]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
    int t = threadIdx.x, lane = t & 31, w = t >> 5;
    g_slots[t] = v;
    g_warps[w]->arrive_and_wait();
    float r = g_slots[w * 32 + (lane ^ o)];
    g_warps[w]->arrive_and_wait();
    return r;
}

// Runs f() on `threads` threads (a multiple of 32) as one block; the
// blockIdx of every thread is `block`.
template <class F>
void run_block(int threads, dim3_ block, F f) {
    blockDim.x = threads;
    std::barrier<> bar(threads);
    g_block = &bar;
    g_warps.clear();
    for (int i = 0; i < threads / 32; i++) g_warps.push_back(std::make_unique<std::barrier<>>(32));
    g_slots.assign(threads, 0.f);
    std::vector<std::thread> th;
    for (int t = 0; t < threads; t++)
        th.emplace_back([&, t] {
            threadIdx.x = t;
            blockIdx = block;
            f();
        });
    for (auto& x : th) x.join();
}
