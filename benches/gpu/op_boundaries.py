"""What the boundary between two dependent ops of a decode step costs on the
GPU, and what a persistent kernel would save: a chain of PHASES ops, each of
which reads the whole activation vector the op before it wrote (so none may
start before the previous one has finished), streams its own weight bytes
(another slice for every op, so L2 holds none of them) and writes its
part of the next vector. The same ops run three ways:

  graph      one kernel launch per op in a CUDA graph (stream-ordered);
  graph+pdl  the same with programmatic dependent launch, each kernel
             asking L2 for its weight slice before `griddepcontrol.wait`
             (how MIRAGE's decode graph launches its kernels);
  persistent one launch: every block runs all ops, a barrier in device
             memory between them; the next op's weights are asked for
             before the barrier (L2), or loaded into registers before it
             (`persistent+regs`: the bytes in flight while the barrier
             waits, where a thread's share fits 16 loads).

Per op size (bytes of weights) it prints microseconds an op for each way,
the share of the copy rate, and the copy-rate time of the bytes alone.
0 B is the bare boundary. Needs CuPy and cuda-bindings (the GPU machine has
both).

    python3 benches/gpu/op_boundaries.py [--phases 168]
"""
import argparse
import ctypes

import cupy as cp
import numpy as np
from cuda.bindings import driver as cu

SRC = r'''
typedef unsigned int u32;

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Thread t of block b asks L2 for lines t, t + blockDim.x, ... of the block's slice.
__device__ __forceinline__ void prefetch_slice(const uint4* w, long n16) {
    const long per = (n16 + gridDim.x - 1) / gridDim.x;
    const long lo = (long)blockIdx.x * per, hi = min(n16, lo + per);
    for (long i = lo + 8L * threadIdx.x; i < hi; i += 8L * blockDim.x)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(w + i));
}

// The op: every block reads the n floats of x (L2, written by the op
// before), xors its slice of the weights, and writes outputs b, b + grid,
// ... of y. `pre`: the first R loads of the slice, already made.
template <int R>
__device__ __forceinline__ void op_body(const float* x, float* y, int n, const uint4* w, long n16, const uint4* pre) {
    __shared__ float red[32];
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += __ldcg(x + i);
    const long per = (n16 + gridDim.x - 1) / gridDim.x;
    const long lo = (long)blockIdx.x * per, hi = min(n16, lo + per);
    u32 a = 0;
    long i = lo + threadIdx.x;
#pragma unroll
    for (int r = 0; r < R; r++, i += blockDim.x) a ^= pre[r].x ^ pre[r].y ^ pre[r].z ^ pre[r].w;
    for (; i + 3L * blockDim.x < hi; i += 4L * blockDim.x) {
        const uint4 v0 = __ldcs(w + i), v1 = __ldcs(w + i + blockDim.x), v2 = __ldcs(w + i + 2 * blockDim.x),
                    v3 = __ldcs(w + i + 3 * blockDim.x);
        a ^= v0.x ^ v0.y ^ v0.z ^ v0.w ^ v1.x ^ v1.y ^ v1.z ^ v1.w ^ v2.x ^ v2.y ^ v2.z ^ v2.w ^ v3.x ^ v3.y ^ v3.z ^ v3.w;
    }
    for (; i < hi; i += blockDim.x) {
        const uint4 v = __ldcs(w + i);
        a ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    s += (float)(a & 1u) * 1e-30f;
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        float t = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.f;
        for (int o = 16; o; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
        // y[j] = 0.5 * sum(x) / n + j: finite and checkable after any number of ops.
        for (int j = blockIdx.x + threadIdx.x * gridDim.x; j < n; j += 32 * gridDim.x) y[j] = 0.5f * t / n + j;
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(256) op_launch(const float* x, float* y, int n, const uint4* w, long n16,
                                                          int prefetch) {
    if (prefetch) prefetch_slice(w, n16);
    pdl_wait();
    pdl_trigger();
    op_body<0>(x, y, n, w, n16, nullptr);
}

// Barrier of all blocks: the counter grows by gridDim.x an op (zeroed by
// the host before the launch).
__device__ __forceinline__ void grid_barrier(u32* bar, u32 target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(bar, 1u);
        u32 v;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(bar) : "memory");
        } while (v < target);
    }
    __syncthreads();
}

template <int R>
__device__ __forceinline__ void persistent(float* act, int n, const uint4* w, long n16, int phases, u32* bar) {
    for (int p = 0; p < phases; p++) {
        const uint4* wp = w + (long)p * n16;
        uint4 pre[R > 0 ? R : 1];
        if (R > 0) {
            const long per = (n16 + gridDim.x - 1) / gridDim.x;
            const long lo = (long)blockIdx.x * per, hi = min(n16, lo + per);
#pragma unroll
            for (int r = 0; r < R; r++) {
                const long i = lo + threadIdx.x + (long)r * blockDim.x;
                pre[r] = i < hi ? __ldcs(wp + i) : make_uint4(0, 0, 0, 0);
            }
        } else {
            prefetch_slice(wp, n16);
        }
        if (p > 0) grid_barrier(bar, (u32)p * gridDim.x);
        // Loads past `pre` start where the preloaded ones end.
        op_body<R>(act + (p & 1) * n, act + ((p + 1) & 1) * n, n, wp, n16, pre);
    }
}

extern "C" __global__ void __launch_bounds__(256) op_persistent(float* act, int n, const uint4* w, long n16, int phases,
                                                              u32* bar) {
    persistent<0>(act, n, w, n16, phases, bar);
}
extern "C" __global__ void __launch_bounds__(256) op_persistent_r4(float* act, int n, const uint4* w, long n16,
                                                                 int phases, u32* bar) {
    persistent<4>(act, n, w, n16, phases, bar);
}
extern "C" __global__ void __launch_bounds__(256) op_persistent_r16(float* act, int n, const uint4* w, long n16,
                                                                  int phases, u32* bar) {
    persistent<16>(act, n, w, n16, phases, bar);
}
'''

N = 896  # the 0.5B's width: the vector every op reads
THREADS = 256


def check(r):
    err = r[0] if isinstance(r, tuple) else r
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver error {err}")
    return r[1] if isinstance(r, tuple) and len(r) == 2 else r


def launch(fn, grid, args, types, stream, pdl):
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid, 1, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = THREADS, 1, 1
    cfg.sharedMemBytes = 0
    cfg.hStream = cu.CUstream(stream.ptr)
    if pdl:
        at = cu.CUlaunchAttribute()
        at.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        at.value.programmaticStreamSerializationAllowed = 1
        cfg.attrs = [at]
        cfg.numAttrs = 1
    else:
        cfg.numAttrs = 0
    check(cu.cuLaunchKernelEx(cfg, cu.CUfunction(fn.kernel.ptr), (tuple(args), tuple(types)), 0))


def graph_time(stream, body, reps):
    """Median seconds of one replay of the graph `body` records."""
    with stream:
        body()
        stream.synchronize()
        stream.begin_capture()
        body()
        g = stream.end_capture()
        g.launch(stream=stream)
        stream.synchronize()
        times = []
        for _ in range(reps):
            t0, t1 = cp.cuda.Event(), cp.cuda.Event()
            t0.record(stream)
            g.launch(stream=stream)
            t1.record(stream)
            t1.synchronize()
            times.append(cp.cuda.get_elapsed_time(t0, t1) * 1e-3)
    return float(np.median(times))


def copy_rate(stream):
    """Device-to-device copy: bytes read and written a second."""
    a = cp.zeros(1 << 28, dtype=cp.uint8)
    b = cp.empty_like(a)
    t = graph_time(stream, lambda: cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, a.nbytes, 3, stream.ptr), 10)
    return 2 * a.nbytes / t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phases", type=int, default=168, help="ops in the chain (the 0.5B step has about 170)")
    ap.add_argument("--reps", type=int, default=20)
    opts = ap.parse_args()
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    grid = 2 * sms
    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    f_launch = mod.get_function("op_launch")
    f_pers = {0: mod.get_function("op_persistent"), 4: mod.get_function("op_persistent_r4"),
              16: mod.get_function("op_persistent_r16")}
    occ = min(check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(cu.CUfunction(f.kernel.ptr), THREADS, 0))
              for f in f_pers.values())
    if occ < 2:
        raise SystemExit(f"the persistent kernel fits {occ} blocks an SM, needs 2 for a grid of {grid}")
    stream = cp.cuda.Stream(non_blocking=True)
    copy = copy_rate(stream)
    print(f"{sms} SMs, copy {copy / 1e12:.2f} TB/s, {opts.phases} ops, grid {grid} x {THREADS}")
    P = opts.phases
    act = cp.zeros(2 * N, dtype=cp.float32)
    bar = cp.zeros(1, dtype=cp.uint32)
    V, L, I32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    print("| bytes an op | graph µs/op | graph+pdl | persistent | persistent+regs | copy-rate µs/op | best share of copy |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for nbytes in [0, 256 << 10, 1 << 20, 4 << 20, 9 << 20, 16 << 20]:
        n16 = nbytes // 16
        w = cp.random.randint(0, 2**31 - 1, size=max(1, P * n16 * 4), dtype=cp.int32)
        wp = w.data.ptr

        def chain(pdl, prefetch):
            def body():
                for p in range(P):
                    x, y = act.data.ptr + 4 * N * (p & 1), act.data.ptr + 4 * N * ((p + 1) & 1)
                    launch(f_launch, grid, [x, y, N, wp + 16 * p * n16, n16, prefetch],
                           [V, V, I32, V, L, I32], stream, pdl)
            return body

        def pers(r):
            def body():
                bar.fill(0)
                launch(f_pers[r], grid, [act.data.ptr, N, wp, n16, P, bar.data.ptr], [V, I32, V, L, I32, V], stream,
                       False)
            return body

        def result():
            stream.synchronize()
            return act.get()

        t_g = graph_time(stream, chain(False, 0), opts.reps) / P
        ref = result()
        t_p = graph_time(stream, chain(True, 1), opts.reps) / P
        assert np.array_equal(result(), ref), "graph+pdl gave other outputs"
        t_q = graph_time(stream, pers(0), opts.reps) / P
        assert np.array_equal(result(), ref), "persistent gave other outputs"
        per_thread = -(-n16 // (grid * THREADS))
        r = 4 if per_thread <= 4 else 16 if per_thread <= 16 else None
        t_r = None
        if r is not None and n16 > 0:
            t_r = graph_time(stream, pers(r), opts.reps) / P
            assert np.array_equal(result(), ref), "persistent+regs gave other outputs"
        # The last op's output: y[j] = 0.5 sum(x) / n + j, a fixed point
        # reached after a few ops from zeros.
        j = np.arange(N, dtype=np.float64)
        want = 0.5 * (N - 1) + j  # sum(y) = 0.5 sum(x) + n (n - 1) / 2 has the fixed point n (n - 1)
        assert np.allclose(ref[(P & 1) * N:(P & 1) * N + N], want, rtol=1e-4), "the chain's result is wrong"
        t_copy = nbytes / copy
        best = min(t for t in [t_g, t_p, t_q, t_r] if t is not None)
        share = f"{t_copy / best * 100:.0f} %" if nbytes else "-"
        fmt = lambda t: f"{t * 1e6:.2f}" if t is not None else "-"
        print(f"| {nbytes >> 10} KiB | {fmt(t_g)} | {fmt(t_p)} | {fmt(t_q)} | {fmt(t_r)} | {fmt(t_copy)} | {share} |")
        del w


if __name__ == "__main__":
    main()
