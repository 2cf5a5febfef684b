"""The long-context decode attention in isolation on the GPU: the tensor-core
split kernel (`attend_split_mma_f16_d*`, cuda/attention_mma.cu) and
`attend_combine` on an f16 cache of one decode row, for the Qwen2.5 head
shapes, over a sweep of its warps a block, ring stages and splits a KV head,
beside a plain 16-byte streaming read of the same cache bytes. Each variant is
a copy of attention_mma.cu compiled in the same module with its constants
redefined; every launch reads another copy of the cache (L2 holds none), and
each variant's output is checked against a float64 reference. Needs CuPy (the
GPU machine has it).

    python3 benches/gpu/attention_split.py [--depths 4096,32768]

Prints one table: microseconds of the split kernel, the combine and both (one
graph), and the cache bytes a second of both as a share of the
device-to-device copy rate (read + written).
"""
import argparse
import pathlib
import re
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from matvec_shapes import FILES, READ, ROOT, device_line, timed as timed_one  # noqa: E402

# (name, query heads, KV heads, head size)
SHAPES = [("0.5B", 14, 2, 64), ("1.5B", 12, 2, 128), ("7B", 28, 4, 128)]
# (warps a block, ring stages); the shipped forms are attention_mma.cu's
# tm_warps / tm_stages: (4, 3) at head size 64, (2, 4) at 128.
VARIANTS = [(4, 3), (4, 4), (8, 2), (8, 3), (2, 4)]
SHIPPED = {64: (4, 3), 128: (2, 4)}
# Warps an SM the shipped splits are sized for (decode.rs MMA_SM_WARPS).
SM_WARPS = 4
SPLITS = [32, 64, 128, 256, 512]
SMEM_OPTIN = 227 * 1024
I32, F32, NULL = np.int32, np.float32, np.uint64(0)


def smem(warps, stages, hd):
    """attention/decode.rs mma_smem for these constants."""
    return warps * stages * 2 * 16 * (hd + 8) * 2


def module():
    """The dense module plus one renamed copy of attention_mma.cu per variant."""
    src = "".join((ROOT / "cuda" / f"{f}.cu").read_text() for f in FILES) + READ
    mma = (ROOT / "cuda" / "attention_mma.cu").read_text()
    for i, (warps, stages) in enumerate(VARIANTS):
        v = re.sub(r"\b(tm_issue|tm_rope_q|tm_warps|tm_stages|attend_split_mma)\b", rf"\1_v{i}", mma)
        v = v.replace("attend_split_mma_f16_d", f"attend_split_mma_v{i}_f16_d")
        v = re.sub(rf"(tm_warps_v{i}\(int hd\) {{ return )[^;]*;", rf"\g<1>{warps};", v)
        v = re.sub(rf"(tm_stages_v{i}\(int hd\) {{ return )[^;]*;", rf"\g<1>{stages};", v)
        v = re.sub(r"#define (TM_KEYS|TM_MAX_G|TM_STAGE_HALVES|SPLIT_MMA_INSTANCE)\b", r"#undef \1\n#define \1", v)
        src += v
    return cp.RawModule(code=src, options=("--std=c++17", "-default-device"), backend="nvrtc")


def timed(launches, reps=20):
    """Seconds of one pass of `launches` (each a function of the copy index)."""
    return timed_one(lambda i: [f(i) for f in launches], reps)


def reference(q, k, v, n_head, n_kv):
    """float64 attention of one query row over every key: [n_head, hd]."""
    hd = q.shape[1]
    g = n_head // n_kv
    out = np.empty((n_head, hd))
    for h in range(n_head):
        kh, vh = k[h // g].astype(np.float64), v[h // g].astype(np.float64)
        s = kh @ q[h].astype(np.float64) / np.sqrt(hd)
        p = np.exp(s - s.max())
        out[h] = p @ vh / p.sum()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", default="4096,32768", help="cache positions, comma-separated")
    depths = [int(d) for d in ap.parse_args().depths.split(",")]
    mod = module()
    sms, copy = device_line()
    read = mod.get_function("stream_read")
    rd_out = cp.zeros(4, cp.uint32)
    comb = mod.get_function("attend_combine")
    rng = np.random.default_rng(3)
    print("| shape | depth | warps × stages | splits a KV head | split µs | combine µs | both µs | share of copy "
          "| worst error | streaming read µs |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, n_head, n_kv, hd in SHAPES:
        for n_ctx in depths:
            kv_bytes = 2 * n_kv * n_ctx * hd * 2
            copies = max(2, int(np.ceil(300e6 / kv_bytes)))
            k_h = (rng.standard_normal((n_kv, n_ctx, hd)) * 2).astype(np.float16)
            v_h = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float16)
            q_h = rng.standard_normal((n_head, hd)).astype(np.float32)
            ref = reference(q_h, k_h, v_h, n_head, n_kv)
            kc = [cp.asarray(k_h.view(np.uint16)) for _ in range(copies)]
            vc = [cp.asarray(v_h.view(np.uint16)) for _ in range(copies)]
            q = cp.asarray(q_h)
            slots = cp.asarray(np.array([0, n_ctx - 1], np.int32))
            out = cp.zeros((n_head, hd), cp.float32)
            n16 = kv_bytes // 2 // 16
            tr = min(timed([lambda i, g=g: (read((g,), (256,), (kc[i % copies], np.int64(n16), rd_out)),
                                            read((g,), (256,), (vc[i % copies], np.int64(n16), rd_out)))])
                     for g in (2 * sms, 4 * sms, 8 * sms))
            for vi, (warps, stages) in enumerate(VARIANTS):
                sm = smem(warps, stages, hd)
                if sm > SMEM_OPTIN:
                    continue
                fn = mod.get_function(f"attend_split_mma_v{vi}_f16_d{hd}")
                fn.max_dynamic_shared_size_bytes = sm
                per_sm = min(max(SM_WARPS // warps, 1), (SMEM_OPTIN + 1024) // (sm + 1024))
                shipped = min(-(-per_sm * sms // n_kv), -(-n_ctx // 64), 1024)
                for n_split in sorted(set(SPLITS + [shipped])):
                    if n_split > n_ctx // 64:
                        continue
                    chunk = -(-n_ctx // n_split)
                    part = cp.zeros((n_head, n_split, hd + 2), cp.float32)
                    cthreads = 512 // hd * hd

                    def split(i, fn=fn, n_split=n_split, chunk=chunk, part=part, sm=sm):
                        fn((1, n_kv, n_split), (32 * warps,),
                           (q, kc[i % copies], vc[i % copies], slots, I32(n_head), I32(n_kv), I32(n_ctx),
                            I32(chunk), F32(1 / np.sqrt(hd)), part, NULL, NULL, I32(0), NULL), shared_mem=sm)

                    def combine(i, n_split=n_split, chunk=chunk, part=part):
                        comb((1, n_head), (cthreads,), (part, slots, I32(n_head), I32(hd), I32(n_split), I32(chunk),
                                                        I32(0), I32(1), I32(0), out))

                    split(0)
                    combine(0)
                    err = float(np.abs(out.get() - ref).max() / np.abs(ref).max())
                    ts, tc, tb = timed([split]), timed([combine]), timed([split, combine])
                    mark = " (shipped)" if SHIPPED[hd] == (warps, stages) and n_split == shipped else ""
                    print(f"| {name} | {n_ctx} | {warps} × {stages} | {n_split}{mark} | {ts * 1e6:.2f} | "
                          f"{tc * 1e6:.2f} | {tb * 1e6:.2f} | {kv_bytes / tb / copy:.0%} | {err:.1e} | "
                          f"{tr * 1e6:.2f} |", flush=True)
            del kc, vc
            cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    sys.exit(main())
