// One CUDA thread block emulated on the host, for the host checks that run
// block-wide device code: every CUDA thread a fiber (ucontext) on the
// calling OS thread, so a check is one runnable thread however many CUDA
// threads it emulates (it shares small CI machines with the rest of the test
// suite) and every run interleaves the same way. __shared__ = a static (one
// block runs at a time), __syncthreads = a block barrier, __syncwarp and the
// shuffles = warp barriers; a thread that returns drops out of its block's
// and warp's barriers, as an exited CUDA thread does. run_block(threads,
// block, f) runs f on every thread of one block (threadIdx and blockIdx
// set; gridDim is the caller's).
#pragma once
#include <ucontext.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

struct dim3_ { unsigned x = 1, y = 1, z = 1; };
// The running fiber's; the scheduler sets them before it resumes a fiber.
dim3_ threadIdx, blockIdx;
dim3_ blockDim, gridDim;

namespace emu {
// A barrier of the threads still running (`live`): released when every one
// of them has arrived; waiting fibers yield to the scheduler.
struct Barrier {
    int live = 0, count = 0;
    unsigned gen = 0;
};
struct Fiber {
    ucontext_t ctx;
    char* stack;
    unsigned tid;
    bool done;
};
inline ucontext_t sched;
inline std::vector<Fiber>* fibers;
inline int cur;
inline const std::function<void()>* body;
inline Barrier block_bar;
inline std::vector<Barrier> warp_bars;
inline std::vector<unsigned long long> slots;  // one per thread, for shuffles
constexpr size_t STACK = 256 << 10;

inline void yield() { swapcontext(&(*fibers)[cur].ctx, &sched); }
inline void release_if_complete(Barrier& b) {
    if (b.count > 0 && b.count >= b.live) {
        b.count = 0;
        b.gen++;
    }
}
inline void wait(Barrier& b) {
    const unsigned g = b.gen;
    b.count++;
    release_if_complete(b);
    while (b.gen == g) yield();
}
inline void entry() {
    (*body)();
    Fiber& f = (*fibers)[cur];
    f.done = true;
    block_bar.live--;
    release_if_complete(block_bar);
    Barrier& w = warp_bars[f.tid >> 5];
    w.live--;
    release_if_complete(w);
}
// Lane `src(lane, o)`'s v (its own v when the source is off the warp), every
// lane of the warp taking part.
template <class T> T shfl(T v, int (*src)(int, int), int o) {
    const int t = threadIdx.x, lane = t & 31, w = t >> 5;
    unsigned long long bits = 0;
    memcpy(&bits, &v, sizeof(T));
    slots[t] = bits;
    wait(warp_bars[w]);
    const int s = src(lane, o);
    T r = v;
    if (s >= 0 && s < 32) memcpy(&r, &slots[w * 32 + s], sizeof(T));
    wait(warp_bars[w]);
    return r;
}
inline int up_src(int lane, int o) { return lane >= o ? lane - o : -1; }
inline int down_src(int lane, int o) { return lane + o < 32 ? lane + o : -1; }
inline int xor_src(int lane, int o) { return lane ^ o; }
inline int idx_src(int, int o) { return o & 31; }
}  // namespace emu

#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
struct float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
template <class T> T __ldg(const T* p) { return *p; }
template <class T> T __ldcg(const T* p) { return *p; }
inline float rsqrtf(float v) { return 1.f / std::sqrt(v); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline void __syncthreads() { emu::wait(emu::block_bar); }
// A warp barrier: every lane of the warp must reach it (as on the GPU with
// the full mask).
inline void __syncwarp() { emu::wait(emu::warp_bars[threadIdx.x >> 5]); }
template <class T> T __shfl_xor_sync(unsigned, T v, int o) { return emu::shfl<T>(v, emu::xor_src, o); }
template <class T> T __shfl_up_sync(unsigned, T v, int o) { return emu::shfl<T>(v, emu::up_src, o); }
template <class T> T __shfl_down_sync(unsigned, T v, int o) { return emu::shfl<T>(v, emu::down_src, o); }
template <class T> T __shfl_sync(unsigned, T v, int src) { return emu::shfl<T>(v, emu::idx_src, src); }
// ggml.cu's warp reductions (butterfly over the warp's 32 lanes).
inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
inline float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// The fibers share one OS thread: every write is seen at once.
inline void __threadfence() {}

// Runs f() on `threads` threads as one block whose blockIdx is `block`.
inline void run_block(int threads, dim3_ block, const std::function<void()>& f) {
    using namespace emu;
    blockDim = dim3_{(unsigned)threads, 1, 1};
    std::vector<Fiber> fs(threads);
    fibers = &fs;
    body = &f;
    block_bar = Barrier{threads, 0, 0};
    warp_bars.assign((threads + 31) / 32, Barrier{});
    for (int w = 0; w < (int)warp_bars.size(); w++) warp_bars[w].live = min(32, threads - 32 * w);
    slots.assign(threads, 0);
    for (int t = 0; t < threads; t++) {
        Fiber& x = fs[t];
        x.tid = t;
        x.done = false;
        x.stack = (char*)malloc(STACK);
        if (!x.stack || getcontext(&x.ctx) != 0) {
            fprintf(stderr, "block_emu: no fiber\n");
            abort();
        }
        x.ctx.uc_stack.ss_sp = x.stack;
        x.ctx.uc_stack.ss_size = STACK;
        x.ctx.uc_link = &sched;
        makecontext(&x.ctx, entry, 0);
    }
    for (int left = threads; left > 0;) {
        left = 0;
        for (int t = 0; t < threads; t++) {
            if (fs[t].done) continue;
            cur = t;
            threadIdx = dim3_{(unsigned)t, 0, 0};
            blockIdx = block;
            swapcontext(&sched, &fs[t].ctx);
            left += !fs[t].done;
        }
    }
    for (auto& x : fs) free(x.stack);
}
