// MIRAGE CUDA kernels, part 0: programmatic dependent launch (PDL), shared
// by every module (each module's source starts with this file).
//
// A decode step is ~10 dependent kernels per layer in one CUDA graph, most
// of them a few microseconds long, so the gap between two kernels (the
// next grid's launch and ramp while the previous one drains) is a large
// share of the step. On sm_90+ the backend launches a kernel whose PTX
// waits on its prerequisite grid (`griddepcontrol.wait`, found by name in
// the module's PTX, crates/mirage-cuda/src/module.rs) with programmatic
// stream serialization, so its blocks may start before the previous kernel
// has finished. Every kernel therefore begins with PDL_ENTRY():
//   pdl_wait()    blocks until the previous grid has completed and its
//                 writes are visible (immediately when launched normally,
//                 or on a device without PDL). Nothing before it may read
//                 what an earlier kernel of the step wrote, nor write
//                 anything; reading weights (constant during a step) is
//                 allowed, which is what the mat-vecs' L2 prefetch does.
//   pdl_trigger() lets the next kernel's blocks launch once every block of
//                 this grid has passed here. Called after the wait, so at
//                 most two grids overlap: one computing, the next one
//                 staged behind its own wait.

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#define PDL_ENTRY()     \
    do {                \
        pdl_wait();     \
        pdl_trigger();  \
    } while (0)

// Asks L2 to fetch bytes [p, p + n) (whole 128-byte lines around them), this
// thread's share of a block-wide prefetch: thread t of the block takes lines
// t, t + blockDim.x, ... Issued before pdl_wait() on weights, and by the
// decode attention on the KV cache positions before its rows' own, so the
// lines stream in while the previous kernel still runs (a prefetch changes
// no value, so it cannot race a write). No-op for n <= 0 at an aligned p.
__device__ __forceinline__ void l2_prefetch_block(const void* p, long n) {
    const char* a = (const char*)((unsigned long long)p & ~127ull);
    const long span = (const char*)p + n - a;
    for (long o = (long)threadIdx.x * 128; o < span; o += (long)blockDim.x * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(a + o));
}

// The first `per_row` bytes (whole lines) of each of `n` rows that start at
// p + i * stride, spread over the block's threads. The mat-vecs' warps walk
// their rows from column 0, so the head of every row is what the first loads
// after pdl_wait() need.
__device__ __forceinline__ void l2_prefetch_rows(const void* p, long stride, int n, long per_row) {
    if (per_row <= 0 || n <= 0) return;
    const long lines = (per_row + 127) >> 7;
    const long total = lines * n;
    for (long i = threadIdx.x; i < total; i += blockDim.x) {
        const char* a = (const char*)p + (i / lines) * stride + ((i % lines) << 7);
        asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
    }
}

// Bytes of each weight row the split mat-vecs ask L2 for before pdl_wait().
#define L2_PREFETCH_ROW 2048
