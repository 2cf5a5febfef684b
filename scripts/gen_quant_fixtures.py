#!/usr/bin/env python3
"""Writes crates/mirage-gguf/tests/fixtures/quant/: reference data for the
quantization codecs, computed by the `gguf` Python package (gguf.quants),
an implementation independent of ours.

Per type (little-endian raw files):
  <type>.blocks.bin  random blocks (random code bytes; scale fields set to chosen
                     f16 values: normal, zero, negative, subnormal, large)
  <type>.deq.f32     gguf.quants.dequantize of those blocks
  <type>.qin.f32     random f32 input (outliers, zeros, negatives, tiny values)
  <type>.qout.bin    gguf.quants.quantize of it (only types gguf quantizes)
real_tensors.json: for a few real tensors of each model in ../models, the
absolute byte offset, type, element count, and from gguf's dequantize: a
positional checksum sum((i+1) * f32_bits[i]) mod 2^64, the f64 sum of squares
and a few sampled values (as f32 bits).

Usage: python3 scripts/gen_quant_fixtures.py   (from the repository root)
"""
import json
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as T, GGUFReader
from gguf import quants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "crates", "mirage-gguf", "tests", "fixtures", "quant")
MODELS = os.path.join(ROOT, "models")

# (type, number of blocks, byte offsets of f16 scale fields within a block)
DEQUANT_TYPES = [
    (T.F16, 256, []),
    (T.BF16, 256, []),
    (T.Q4_0, 24, [0]),
    (T.Q4_1, 24, [0, 2]),
    (T.Q5_0, 24, [0]),
    (T.Q5_1, 24, [0, 2]),
    (T.Q8_0, 24, [0]),
    (T.Q2_K, 8, [80, 82]),
    (T.Q3_K, 8, [108]),
    (T.Q4_K, 8, [0, 2]),
    (T.Q5_K, 8, [0, 2]),
    (T.Q6_K, 8, [208]),
]
# Types gguf can quantize (F16 is numpy's astype, round to nearest even).
QUANT_TYPES = [T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
# Types only we quantize: their inputs are still written so the Rust tests
# use the same hard cases.
OWN_QUANT_TYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_K]

rng = np.random.default_rng(20240601)


def scale_values(n):
    """f16 scale values: mostly normal, plus zero, negative, subnormal, large."""
    v = (rng.standard_normal(n) * 0.02).astype(np.float32)
    special = np.array([0.0, -0.05, 6e-8, 1e-6, 3.0, -1.5e3, 6.0e4, 1e-4], dtype=np.float32)
    v[: min(n, len(special))] = special[: min(n, len(special))]
    rng.shuffle(v)
    return v.astype(np.float16)


def random_blocks(qtype, n_blocks, scale_offsets):
    block_size, type_size = quants.GGML_QUANT_SIZES[qtype]
    if qtype in (T.F16, T.BF16):
        x = random_input(n_blocks * block_size)
        return quants.quantize(x, qtype).view(np.uint8).reshape(-1).copy() if qtype == T.BF16 \
            else x.astype(np.float16).view(np.uint8).reshape(-1).copy()
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in scale_offsets:
        raw[:, off:off + 2] = scale_values(n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1)


def random_input(n):
    """f32 values in blocks of 32 with different characters per block."""
    x = (rng.standard_normal(n) * 0.05).astype(np.float32)
    blocks = x.reshape(-1, 32)
    for i, b in enumerate(blocks):
        kind = i % 8
        if kind == 1:
            b[:] = 0.0                                      # all zero
        elif kind == 2:
            b[rng.integers(0, 32)] = 25.0                   # one outlier
        elif kind == 3:
            b[:] = -np.abs(b)                               # all negative
        elif kind == 4:
            b *= np.float32(1e-7)                           # tiny values
        elif kind == 5:
            b[:] = np.abs(b) + 1.0                          # positive, offset
        elif kind == 6:
            b[::3] = 0.0                                    # sparse zeros
    return x


def write(name, arr):
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(np.ascontiguousarray(arr).tobytes())


def checksum(values):
    bits = values.view(np.uint32).astype(np.uint64)
    idx = np.arange(1, bits.size + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return int(np.sum(bits * idx, dtype=np.uint64))


def real_tensors():
    out = []
    for fname in sorted(os.listdir(MODELS)) if os.path.isdir(MODELS) else []:
        if not fname.endswith(".gguf"):
            continue
        reader = GGUFReader(os.path.join(MODELS, fname))
        by_type = {}
        for t in reader.tensors:
            by_type.setdefault(t.tensor_type, []).append(t)
        for qtype, tensors in sorted(by_type.items()):
            if qtype == T.F32:
                continue
            tensors.sort(key=lambda t: int(t.n_elements))
            # the smallest one, and a mid-sized one (well under 10M elements)
            picks = [tensors[0]]
            mid = [t for t in tensors if int(t.n_elements) <= 6_000_000]
            if mid and mid[-1] is not tensors[0]:
                picks.append(mid[-1])
            for t in picks:
                deq = quants.dequantize(np.asarray(t.data), qtype).reshape(-1).astype(np.float32)
                n = int(t.n_elements)
                sample_idx = sorted(set([0, 1, n - 1] + [int(i) for i in rng.integers(0, n, 13)]))
                out.append({
                    "model": fname,
                    "tensor": t.name,
                    "type": qtype.name,
                    "offset": int(t.data_offset),
                    "n_elements": n,
                    "n_bytes": int(t.n_bytes),
                    "checksum": str(checksum(deq)),
                    "sum_squares": float(np.sum(deq.astype(np.float64) ** 2)),
                    "samples": [[i, int(deq[i:i + 1].view(np.uint32)[0])] for i in sample_idx],
                })
                print(f"  {fname}: {t.name} {qtype.name} n={n}", file=sys.stderr)
    return out


def main():
    os.makedirs(OUT, exist_ok=True)
    for qtype, n_blocks, offs in DEQUANT_TYPES:
        name = qtype.name.lower()
        blocks = random_blocks(qtype, n_blocks, offs)
        deq = quants.dequantize(blocks, qtype).astype(np.float32, copy=False)
        write(f"{name}.blocks.bin", blocks)
        write(f"{name}.deq.f32", deq)
    for qtype in QUANT_TYPES + OWN_QUANT_TYPES:
        name = qtype.name.lower()
        block_size = quants.GGML_QUANT_SIZES[qtype][0]
        n = max(block_size, 256) * 4
        x = random_input(n)
        write(f"{name}.qin.f32", x)
        if qtype in QUANT_TYPES:
            write(f"{name}.qout.bin", quants.quantize(x, qtype).view(np.uint8))
    tensors = real_tensors()
    with open(os.path.join(OUT, "real_tensors.json"), "w") as f:
        json.dump({"generator": "scripts/gen_quant_fixtures.py", "tensors": tensors}, f, indent=1)
    total = sum(os.path.getsize(os.path.join(OUT, p)) for p in os.listdir(OUT))
    print(f"wrote {OUT} ({total} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
