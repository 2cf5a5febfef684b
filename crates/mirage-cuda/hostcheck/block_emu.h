// One CUDA thread block emulated on the host, for the host checks that run
// block-wide device code (check_norm.cpp, check_attend.cpp, ...): every CUDA
// thread an std::thread, __shared__ = a static (one block runs at a time;
// code run as a cluster takes its shared arrays as arguments instead),
// __syncthreads = a block barrier, __shfl_xor_sync = a 32-thread exchange
// between two warp barriers, __syncwarp = a warp barrier. run_block(threads,
// f) runs f on every thread of one block (threadIdx set; blockIdx / gridDim
// are the caller's); run_cluster runs several blocks at once.
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
// One emulated block's barriers and shuffle slots; every thread of it points
// at its block's (so the blocks of a cluster can run at once).
struct EmuBlock {
    std::unique_ptr<std::barrier<>> bar;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    std::vector<float> slots;
    explicit EmuBlock(int threads) : bar(std::make_unique<std::barrier<>>(threads)), slots(threads, 0.f) {
        for (int i = 0; i < threads / 32; i++) warps.push_back(std::make_unique<std::barrier<>>(32));
    }
};
thread_local EmuBlock* t_block = nullptr;
thread_local unsigned t_cluster_rank = 0;

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
inline void __syncthreads() { t_block->bar->arrive_and_wait(); }
// A warp barrier: every lane of the warp must reach it (as on the GPU with
// the full mask); a lane that does not would hang the check.
inline void __syncwarp() { t_block->warps[threadIdx.x >> 5]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
    int t = threadIdx.x, lane = t & 31, w = t >> 5;
    t_block->slots[t] = v;
    t_block->warps[w]->arrive_and_wait();
    float r = t_block->slots[w * 32 + (lane ^ o)];
    t_block->warps[w]->arrive_and_wait();
    return r;
}

// Runs f() on `threads` threads (a multiple of 32) as one block; the
// blockIdx of every thread is `block`.
template <class F>
void run_block(int threads, dim3_ block, F f) {
    blockDim.x = threads;
    EmuBlock b(threads);
    std::vector<std::thread> th;
    for (int t = 0; t < threads; t++)
        th.emplace_back([&, t] {
            threadIdx.x = t;
            blockIdx = block;
            t_block = &b;
            f();
        });
    for (auto& x : th) x.join();
}

// Runs f() on `blocks` blocks of `threads` threads at once, as one cluster:
// block r (t_cluster_rank r) has blockIdx.x = first + r; f's cluster
// barriers are the caller's to emulate (every thread of every block).
template <class F>
void run_cluster(int blocks, int threads, unsigned first, F f) {
    blockDim.x = threads;
    std::vector<std::unique_ptr<EmuBlock>> bs;
    for (int r = 0; r < blocks; r++) bs.push_back(std::make_unique<EmuBlock>(threads));
    std::vector<std::thread> th;
    for (int r = 0; r < blocks; r++)
        for (int t = 0; t < threads; t++)
            th.emplace_back([&, r, t] {
                threadIdx.x = t;
                blockIdx = dim3_{first + r, 0, 0};
                t_block = bs[r].get();
                t_cluster_rank = r;
                f();
            });
    for (auto& x : th) x.join();
}
