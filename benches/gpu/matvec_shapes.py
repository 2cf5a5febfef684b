"""Decode mat-vecs in isolation on the GPU: each kernel of the dense module
(cuda/*.cu, compiled with NVRTC as the backend does) on random split-layout
matrices (Q8_0, Q4_K, Q6_K, Q5_0) of the Qwen2.5-7B and -0.5B shapes, timed as graphs of 40 launches
(no host gaps, no PDL overlap; every launch reads another copy of the
matrix, so L2 holds none of it), beside a plain 16-byte streaming read of
the same bytes: how close each kernel comes to the copy rate, shape by
shape. Needs CuPy (the GPU machine has it).

    python3 benches/gpu/matvec_shapes.py [--kinds q4_ks,q6_ks]

Prints one table: microseconds a launch and the weight bytes a second as a
share of the device-to-device copy rate (read + written), for the best
column split of each kernel.
"""
import argparse
import pathlib
import sys

import cupy as cp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
# crates/mirage-cuda/src/module.rs DENSE_SOURCE, in its order.
FILES = ["pdl", "norm", "nvfp4", "ggml", "elementwise", "attention", "matvec", "matvec_lanes", "matvec_split",
         "matvec_imma", "mmq", "attention_pruned", "attention_mma"]
READ = r'''
extern "C" __global__ void __launch_bounds__(256) stream_read(const uint4* p, long n16, unsigned* out) {
    unsigned a = 0;
    const long stride = (long)gridDim.x * blockDim.x;
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 v0 = __ldg(p + i), v1 = __ldg(p + i + stride), v2 = __ldg(p + i + 2 * stride), v3 = __ldg(p + i + 3 * stride);
        a ^= v0.x ^ v0.y ^ v0.z ^ v0.w ^ v1.x ^ v1.y ^ v1.z ^ v1.w ^ v2.x ^ v2.y ^ v2.z ^ v2.w ^ v3.x ^ v3.y ^ v3.z ^ v3.w;
    }
    for (; i < n16; i += stride) { uint4 v = __ldg(p + i); a ^= v.x ^ v.y ^ v.z ^ v.w; }
    if (a == 0x12345678u) out[0] = a;
}
'''
SHAPES = [("7B Q/K/V", 4608, 3584), ("7B output", 3584, 3584), ("7B gate+up", 18944, 3584),
          ("7B down", 3584, 18944), ("0.5B Q/K/V", 1152, 896), ("0.5B gate+up", 4864, 896),
          ("0.5B down", 896, 4864)]
I32, I64, F32, NULL = np.int32, np.int64, np.float32, np.uint64(0)
rng = np.random.default_rng(1)
STREAM = cp.cuda.Stream(non_blocking=True)


def timed(launch, reps=40):
    """Seconds a launch, from a graph of `reps` launches."""
    with STREAM:
        for i in range(3):
            launch(i)
        STREAM.begin_capture()
        for i in range(reps):
            launch(i)
        graph = STREAM.end_capture()
        graph.launch(stream=STREAM)
        t0, t1 = cp.cuda.Event(), cp.cuda.Event()
        t0.record(STREAM)
        graph.launch(stream=STREAM)
        t1.record(STREAM)
        t1.synchronize()
    return cp.cuda.get_elapsed_time(t0, t1) / reps * 1e-3


def f16_bytes(n, lo, hi):
    return rng.uniform(lo, hi, size=n).astype(np.float16).view(np.uint8)


def split_matrix(kind, rows, cols):
    """Random split-layout bytes (weights.rs) with sane f16 scales."""
    n = rows * cols
    if kind == "q8_0s":
        q = rng.integers(-127, 128, size=n, dtype=np.int8).view(np.uint8)
        return np.concatenate([q, f16_bytes(n // 32, 0.002, 0.02)])
    if kind == "q5_0s":
        # quants [rows][cols/2], high-bit words [rows][cols/32], f16 d
        return np.concatenate([rng.integers(0, 256, size=n // 2 + 4 * (n // 32), dtype=np.uint8),
                               f16_bytes(n // 32, 0.002, 0.02)])
    if kind == "q6_ks":
        # ql [rows][cols/2], qh [rows][cols/4], int8 scales [rows][cols/16], f16 d
        scales = rng.integers(-32, 32, size=n // 16, dtype=np.int8).view(np.uint8)
        return np.concatenate([rng.integers(0, 256, size=n // 2 + n // 4, dtype=np.uint8), scales,
                               f16_bytes(n // 256, 0.0005, 0.003)])
    ns = cols // 256
    qs = rng.integers(0, 256, size=rows * cols // 2, dtype=np.uint8)
    hdr = rng.integers(0, 256, size=(rows * ns, 16), dtype=np.uint8)
    hdr[:, 0:4] = rng.uniform(0.0005, 0.003, size=(rows * ns, 2)).astype(np.float16).view(np.uint8)
    return np.concatenate([qs, hdr.ravel()])


def dense_module():
    """The dense module (cuda/*.cu in DENSE_SOURCE order) and the streaming read."""
    src = "".join((ROOT / "cuda" / f"{f}.cu").read_text() for f in FILES) + READ
    return cp.RawModule(code=src, options=("--std=c++17", "-default-device"), backend="nvrtc")


def copy_rate():
    """Device-to-device copy rate, bytes read + written a second."""
    a, b = cp.empty(1 << 30, cp.uint8), cp.empty(1 << 30, cp.uint8)
    b[:] = a
    t0, t1 = cp.cuda.Event(), cp.cuda.Event()
    t0.record()
    for _ in range(10):
        b[:] = a
    t1.record()
    t1.synchronize()
    rate = 2 * (1 << 30) * 10 / (cp.cuda.get_elapsed_time(t0, t1) * 1e-3)
    del a, b
    cp.get_default_memory_pool().free_all_blocks()
    return rate


def device_line():
    """(SM count, copy rate) of the device, after printing both with its name."""
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    sms, copy = props["multiProcessorCount"], copy_rate()
    print(f"{props['name'].decode()}, {sms} SMs, copy {copy / 1e9:.0f} GB/s (read + written)")
    return sms, copy


def dense_launches(mod, kind, ffn, rows, cols, ws, x, y):
    """(kernel name, launch(i)) of every column split of the dense kernel for
    split-layout matrices `ws` (launch i reads copy i % len(ws); gate+up:
    copies i and i + 1 as gate and up, `rows` channels)."""
    copies = len(ws)
    imma = kind in ("q4_ks", "q6_ks")
    smem = 2 * cols + 8 * (cols // 32) if imma else 0
    out = []
    for s in (1, 2, 4, 8):
        suffix = "" if s == 1 else f"_k{s}"
        if ffn:
            if not imma and s > 1:
                continue
            name = f"ffn_{kind}{suffix}"
            fn = mod.get_function(name)
            per = (8 // s) * 16 if imma else 16
            grid = ((rows + per - 1) // per, 1)

            def launch(i, fn=fn, grid=grid):
                fn(grid, (256,), (ws[i % copies], ws[(i + 1) % copies], I32(rows), I64(0), I32(cols), x, y,
                                  F32(1), F32(1), NULL, NULL, F32(0), NULL), shared_mem=smem)
        else:
            name = f"mv3_{kind}{suffix}"
            fn = mod.get_function(name)
            per = (8 // s) * (16 if imma else 4)
            grid = ((rows + per - 1) // per, 1)

            def launch(i, fn=fn, grid=grid):
                fn(grid, (256,), (ws[i % copies], NULL, NULL, I32(rows), I32(0), I32(0), I64(0), I32(cols),
                                  x, y, NULL, NULL, F32(1), F32(1), F32(1), NULL, NULL, NULL, NULL, NULL,
                                  NULL, F32(0), NULL), shared_mem=smem)
        out.append((name, launch))
    if imma and not ffn and cols // 256 >= 16:
        # The column split across blocks (matvec.rs XSPLIT, which the backend
        # takes for rows of 32 super-blocks and more; timed here from 16):
        # each block rounds only its slice of x.
        tiles = (rows + 127) // 128
        for s in (2, 4, 8, 16):
            fn = mod.get_function(f"mvx_{kind}_x{s}")
            part, ctr = cp.zeros(s * rows, cp.float32), cp.zeros(tiles, cp.uint32)
            slice_cols = -(-(cols // 256) // s) * 256
            slice_smem = 2 * slice_cols + 8 * (slice_cols // 32)

            def launch(i, fn=fn, s=s, part=part, ctr=ctr, slice_smem=slice_smem):
                fn((tiles * s, 1), (256,), (ws[i % copies], NULL, NULL, I32(rows), I32(0), I32(0), I64(0), I32(cols),
                                           x, y, NULL, NULL, F32(1), F32(1), F32(1), NULL, NULL, NULL, NULL, NULL,
                                           NULL, F32(0), NULL, part, ctr), shared_mem=slice_smem)
            out.append((f"mvx_{kind}_x{s}", launch))
    return out


def best_dense(mod, kind, ffn, rows, cols, ws, x, y):
    """(kernel name, seconds a launch) of the fastest column split."""
    return min(((name, timed(launch)) for name, launch in dense_launches(mod, kind, ffn, rows, cols, ws, x, y)),
               key=lambda b: b[1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="q8_0s,q4_ks,q6_ks,q5_0s",
                    help="split layouts to time, comma-separated (default: all four)")
    kinds = ap.parse_args().kinds.split(",")
    mod = dense_module()
    sms, copy = device_line()
    read = mod.get_function("stream_read")
    out = cp.zeros(4, cp.uint32)
    print("| shape | layout | MB | kernel (best split) | µs | share of copy | streaming read µs | its share |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    # The types of the Q4_K_M mix as shipped: Q4_K, Q6_K (down, V, head), Q5_0 (some Q/K/V).
    for kind in kinds:
        for name, rows, cols in SHAPES:
            if kind in ("q4_ks", "q6_ks") and cols % 256:
                continue
            ffn = name.endswith("gate+up")
            raw = split_matrix(kind, rows, cols)
            copies = max(2, int(np.ceil(256e6 / raw.size)))
            ws = [cp.asarray(raw) for _ in range(copies)]
            nbytes = raw.size * (2 if ffn else 1)
            x = cp.asarray(rng.standard_normal(cols).astype(np.float32))
            y = cp.zeros(rows, cp.float32)
            label, t = best_dense(mod, kind, ffn, rows, cols, ws, x, y)
            n16 = raw.size // 16
            tr = min(timed(lambda i, g=g: read((g,), (256,), (ws[i % copies], I64(n16), out)))
                     for g in (2 * sms, 4 * sms, 8 * sms))
            tr *= 2 if ffn else 1
            print(f"| {name} | {kind} | {nbytes / 1e6:.1f} | `{label}` | {t * 1e6:.2f} | {nbytes / t / copy:.0%} | "
                  f"{tr * 1e6:.2f} | {nbytes / tr / copy:.0%} |", flush=True)
            del ws
            cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    sys.exit(main())
