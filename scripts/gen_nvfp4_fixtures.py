#!/usr/bin/env python3
"""NVFP4 fixtures for crates/mirage-gguf/tests/nvfp4.rs.

Independent reference: the quantization rule of docs/NVFP4.md written in
numpy, with every rounding done by ml_dtypes casts (float8_e4m3fn for the
block scales, float4_e2m1fn for the elements; both round to nearest, ties
to even). The Rust codec must reproduce every byte and every decoded bit.

Rule (all arithmetic in float32):
  amax         = max |x| over the tensor
  tensor_scale = amax / 2688                      (2688 = 6 * 448)
  per block of 16:
    s     = min(max|x_block| / (6 * tensor_scale), 448)   -> E4M3 (RNE)
    denom = float(E4M3(s)) * tensor_scale
    q     = clip(x / denom, -6, 6)                        -> E2M1 (RNE)
  tensor_scale == 0 or denom == 0: scales and codes are 0.
  packing: element 2j in the low nibble of byte j, 2j+1 in the high nibble.
  decode: e2m1(code) * (e4m3(scale) * tensor_scale)

Each case is one binary file: u32 n, f32 tensor_scale, n f32 inputs,
n/16 scale bytes, n/2 packed bytes, n f32 decoded values (little endian).

Usage: pip install ml_dtypes numpy; python3 scripts/gen_nvfp4_fixtures.py
"""
import json
import pathlib

import ml_dtypes
import numpy as np

OUT = pathlib.Path(__file__).resolve().parent.parent / "crates/mirage-gguf/tests/fixtures/nvfp4"
F32 = np.float32


def quantize(x: np.ndarray):
    x = np.ascontiguousarray(x, dtype=F32)
    assert x.size % 16 == 0
    blocks = x.reshape(-1, 16)
    amax = np.max(np.abs(x)) if x.size else F32(0)
    ts = F32(amax) / F32(2688.0)
    if ts == 0:
        scales = np.zeros(blocks.shape[0], np.uint8)
        codes = np.zeros(blocks.shape, np.uint8)
    else:
        bamax = np.max(np.abs(blocks), axis=1)
        s = np.minimum(bamax / (F32(6.0) * ts), F32(448.0)).astype(F32)
        s8 = s.astype(ml_dtypes.float8_e4m3fn)
        scales = s8.view(np.uint8)
        denom = (s8.astype(F32) * ts).astype(F32)
        safe = np.where(denom > 0, denom, F32(1.0)).astype(F32)
        q = np.where(denom[:, None] > 0, blocks / safe[:, None], F32(0.0)).astype(F32)
        q = np.clip(q, F32(-6.0), F32(6.0))
        codes = q.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & np.uint8(0x0F)
    flat = codes.reshape(-1)
    packed = (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)
    return F32(ts), scales.astype(np.uint8), packed


def dequantize(ts, scales, packed):
    codes = np.empty(packed.size * 2, np.uint8)
    codes[0::2] = packed & 0x0F
    codes[1::2] = packed >> 4
    vals = codes.view(ml_dtypes.float4_e2m1fn).astype(F32).reshape(-1, 16)
    bs = (scales.view(ml_dtypes.float8_e4m3fn).astype(F32) * F32(ts)).astype(F32)
    return (vals * bs[:, None]).astype(F32).reshape(-1)


def ties_case():
    # tensor_scale = 1 exactly (amax 2688 in one block), a block whose amax
    # is 6 (scale byte 1.0), holding every E2M1 midpoint and its negation.
    x = np.zeros(64, F32)
    x[0:16] = 2688.0
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    x[16:24] = mids
    x[24:32] = [-m for m in mids]
    # Just above / below each midpoint.
    x[32:40] = np.nextafter(F32(mids), F32(10))
    x[40:48] = np.nextafter(F32(mids), F32(-10))
    x[48:64] = [-0.0, 0.0, -0.1, 0.1, 6.0, -6.0, 0.5, -0.5, 1, -1, 1.5, -1.5, 2, 3, 4, -4]
    return x


def zeros_tiny_case(rng):
    x = rng.standard_normal(256).astype(F32) * F32(100.0)
    x[16:32] = 0.0                       # all-zero block: scale byte 0
    x[32:48] = -0.0
    x[48:64] = rng.standard_normal(16).astype(F32) * F32(1e-4)  # E4M3 subnormal / zero scale
    x[64:80] = rng.standard_normal(16).astype(F32) * F32(1e-2)
    x[80:96] = F32(1e-30)
    return x


def main():
    rng = np.random.default_rng(20251202)
    cases = {
        "single_block": rng.standard_normal(16).astype(F32),
        "normal_4096": rng.standard_normal(4096).astype(F32),
        "heavy_tail_4096": (rng.standard_t(3, 4096) * 0.02).astype(F32),
        "ties": ties_case(),
        "zeros_tiny": zeros_tiny_case(rng),
        "all_zero": np.zeros(32, F32),
        "large_8192": (rng.standard_normal(8192) * 3e4).astype(F32),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    manifest = []
    for name, x in cases.items():
        ts, scales, packed = quantize(x)
        dec = dequantize(ts, scales, packed)
        blob = (
            np.array([x.size], "<u4").tobytes()
            + np.array([ts], "<f4").tobytes()
            + x.astype("<f4").tobytes()
            + scales.tobytes()
            + packed.tobytes()
            + dec.astype("<f4").tobytes()
        )
        (OUT / f"{name}.bin").write_bytes(blob)
        err = np.abs(dec - x)
        manifest.append({"name": name, "n": int(x.size), "tensor_scale": float(ts),
                         "max_abs_err": float(err.max()), "amax": float(np.abs(x).max())})
        print(f"{name}: n={x.size} tensor_scale={ts:.6g} max|err|={err.max():.4g}")
    (OUT / "manifest.json").write_text(json.dumps(
        {"generator": "scripts/gen_nvfp4_fixtures.py",
         "ml_dtypes": ml_dtypes.__version__, "numpy": np.__version__, "cases": manifest},
        indent=1) + "\n")


if __name__ == "__main__":
    main()
