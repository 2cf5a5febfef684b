#!/usr/bin/env python3
"""cuBLAS side of the H200 check: times torch's BF16 matmul (cuBLAS, BF16
out) on the shapes the cutlass-sys device test times, same timing method
(CUDA events around 20 runs after one warm-up). Prints one line per shape
in the test's format so the two can be read side by side."""
import torch

SHAPES = [(512, 4096, 4096), (2048, 4096, 4096), (4096, 4096, 4096), (8192, 8192, 8192)]
ITERS = 20

for m, n, k in SHAPES:
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.rand(m, k, device="cuda", generator=g, dtype=torch.float32).mul_(2).sub_(1).bfloat16()
    b = torch.rand(n, k, device="cuda", generator=g, dtype=torch.float32).mul_(2).sub_(1).bfloat16()
    bt = b.t()  # [k, n] column-major view: the same TN problem as cutlass-sys
    d = a @ bt
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(ITERS):
        torch.matmul(a, bt, out=d)
    stop.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(stop) / ITERS
    print(f"cublas (torch {torch.__version__}) bf16 gemm {m}x{n}x{k}: {ms:.3f} ms, "
          f"{2 * m * n * k / (ms * 1e-3) / 1e12:.0f} TFLOP/s (bf16 out)")
