"""Activation-sparse decode mat-vecs on the GPU (cuda/activation_sparse.cu,
compiled with NVRTC) beside the shipped dense kernels on the same shapes, in
one run, for Q8_0, Q4_K, Q4_1, Q5_0 and Q6_K matrices. Needs CuPy and numpy
(the GPU machine has them); about 5 minutes on an H100 for all five types
(about 1 minute a type; Q4_K and Q6_K, on fewer shapes, less).

    python3 benches/gpu/sparse_matvec.py [--types q8_0,q4_k,q4_1,q5_0,q6_k] [--real REAL.npz]
                                         [--correctness-only]

--types: the types to check and time (comma-separated; default all five).

First the correctness of the sparse kernels: on one shape per type (Q8_0,
Q4_1 and Q5_0 at 1152 x 896, Q4_K and Q6_K at 896 x 4864, all with a
partial last tile) matrices packed from random ggml blocks (this script's
reading of the blocks checked against the gguf package's dequantization
where the package is installed) and, with --real, the real matrices that
benches/gpu/real_blocks.py copies from the shipped Qwen2.5-Coder-0.5B (Q8_0,
Q4_K, Q5_0, Q6_K) and SmolLM2-135M Q4_1 (after checking this script's
reading of their blocks against the gguf package's dequantization), the
channel lists against the CPU rule, and every kernel variant's product
against an f64 numpy product of ggml's dequantized weights over the same
active channels (error = max |y - ref| / max |ref|; bounds: 1e-5 against
the list's int8 activations dx * xq, 2e-2 against x itself; all channels
skipped: exactly 0). Then one table: for the Qwen2.5-7B and -0.5B shapes
(Q4_K and Q6_K only where the columns are whole 256-channel super-blocks),
each type, and 0 / 25 / 50 / 75 % of the input channels skipped (random
activations, one threshold), each variant at its best launch shape:

  launch       the fastest launch shape of the variant: w warps a block,
               tiles of t outputs (t / 512 warps side by side on a tile, so
               an active channel's run, t bytes in Q8_0 and t / 2 in the
               others, is read at once), g groups of 32 channels a warp
  us +select   a product including the list kernel (asp_select) before it
  us product   the product alone (the list made once per input vector is
               shared by every matrix reading it: Q/K/V, gate and up)
  MB read      weight bytes the product reads: the runs (and high-bit runs)
               of the active channels and the scales of groups with an
               active channel
  % copy       those bytes a second / the device-to-device copy rate
               (read + written), as matvec_shapes.py reports the dense ones
  dense        the shipped dense kernel of the type's split layout (best
               column split, the same graphs; Q4_1 has none: "-"), its time
               and its share of copy for the whole matrix
  sparse/dense time ratios, with the list kernel and without

A second table gives, at 50 % skipped, the best product time per tile width
(any variant, warps, groups). Each timing is a graph of 40 launches, each
reading another copy of the matrices (L2 holds none of them). Exits non-zero
when a correctness bound fails.

The numpy parts (random ggml blocks, the packer into the GPU layout, the f64
references) import without CuPy.
"""
import argparse
import math
import pathlib
import sys
from collections import namedtuple

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
try:
    import matvec_shapes as dense  # noqa: E402  (the dense module, copy rate, timed graphs; imports CuPy)
    cp = dense.cp
except ModuleNotFoundError as e:  # without CuPy: the numpy parts only
    if e.name != "cupy":
        raise
    dense = cp = None

ROOT = pathlib.Path(__file__).resolve().parents[2]
I32, NULL = np.int32, np.uint64(0)
REC, MAX_BLOCK_GROUPS = 128, 64
SHAPES = [("7B Q/K/V", 4608, 3584, 1), ("7B O", 3584, 3584, 1), ("7B gate+up", 18944, 3584, 2),
          ("7B down", 3584, 18944, 1), ("0.5B Q/K/V", 1152, 896, 1), ("0.5B O", 896, 896, 1),
          ("0.5B gate+up", 4864, 896, 2), ("0.5B down", 896, 4864, 1)]
SKIPPED = (0.0, 0.25, 0.5, 0.75)
# Per type: ggml's block (weights, bytes), the dense split layout of
# matvec_shapes.py (None: no split-layout kernel), the sparse variants (name,
# channels a round: the ASP_MV_SHAPES lines of activation_sparse.cu), and the
# correctness shape (rows, cols).
Type = namedtuple("Type", "block nbytes dense variants check")
TYPES = {"q8_0": Type(32, 34, "q8_0s", [("serial", 8), ("pipelined", 8)], (1152, 896)),
         "q4_k": Type(256, 144, "q4_ks", [("serial", 16), ("pipelined", 8)], (896, 4864)),
         "q4_1": Type(32, 20, None, [("serial", 16), ("pipelined", 8)], (1152, 896)),
         "q5_0": Type(32, 22, "q5_0s", [("serial", 8), ("pipelined", 8)], (1152, 896)),
         "q6_k": Type(256, 210, "q6_ks", [("serial", 8), ("pipelined", 4)], (896, 4864))}
# The gguf package's quantization type ids (ggml's).
GGML_TYPE = {"q4_1": 3, "q5_0": 6, "q8_0": 8, "q4_k": 12, "q6_k": 14}
# Block shapes: (warps, tile width); then groups of 32 channels a warp.
BLOCKS, GROUPS_PER_WARP = ((4, 512), (8, 512), (4, 1024), (8, 1024), (8, 2048)), (1, 2, 4, 8)
BOUND_CODES, BOUND_X = 1e-5, 2e-2
rng = np.random.default_rng(3)


# ---------------------------------------------------------------------------
# The layout (activation_sparse.cu's head) and ggml's blocks, in numpy.

def row_bytes(ty, cols):
    """Bytes of one output row in the layout."""
    return {"q8_0": cols + cols // 16, "q4_k": cols // 2 + cols // 16, "q4_1": 5 * cols // 8,
            "q5_0": 11 * cols // 16, "q6_k": 105 * cols // 128}[ty]


def padded(rows):
    return (rows + 15) // 16 * 16


def layout_bytes(ty, rows, cols):
    return padded(rows) * row_bytes(ty, cols)


def fits(ty, cols):
    """Whether a matrix of `cols` channels is whole ggml blocks of the type."""
    return cols % TYPES[ty].block == 0


def f16_bytes(shape, lo, hi):
    """Random normal finite f16 values in [lo, hi), as their bytes: shape + (2,)."""
    return rng.uniform(lo, hi, shape).astype(np.float16)[..., None].view(np.uint8)


def random_blocks(ty, rows, cols):
    """ggml blocks of a random rows x cols matrix: [rows, blocks, bytes]."""
    t = TYPES[ty]
    n = cols // t.block
    b = rng.integers(0, 256, (rows, n, t.nbytes), dtype=np.uint8)
    if ty == "q8_0":
        b[..., :2] = f16_bytes((rows, n), 0.002, 0.02)
    elif ty == "q4_k":
        b[..., 0:4] = f16_bytes((rows, n, 2), 0.0005, 0.003).reshape(rows, n, 4)
    elif ty == "q4_1":
        # d, then m (the block's minimum: about -8 d, as ggml's quantizer makes it)
        d = rng.uniform(0.002, 0.02, (rows, n)).astype(np.float16)
        m = (-d.astype(np.float64) * rng.uniform(6, 10, (rows, n))).astype(np.float16)
        b[..., 0:2] = d[..., None].view(np.uint8)
        b[..., 2:4] = m[..., None].view(np.uint8)
    elif ty == "q5_0":
        b[..., :2] = f16_bytes((rows, n), 0.002, 0.02)
    else:  # q6_k: ql, qh and the int8 scales random, d at 208
        b[..., 208:210] = f16_bytes((rows, n), 0.0005, 0.003)
    return b


def f16_at(b, at):
    """The f16 at byte `at` of every block, as float16 [rows, blocks]."""
    return b[..., at:at + 2].copy().view(np.float16)[..., 0]


def nibbles32(qs):
    """ggml's 32-weight nibble order (Q4_0/Q4_1/Q5_0): qs [.., 16] -> [.., 32],
    element j < 16 the low nibble of qs[j], j >= 16 the high one of qs[j - 16]."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def fields(ty, b):
    """The codes and scales of ggml blocks b [rows, blocks, bytes]: a dict
    with q, the code of every weight [rows, cols] as stored (Q8_0: the int8's
    byte; Q4_K and Q4_1 0..15; Q5_0 0..31; Q6_K 0..63), and per type d
    (per block; Q4_K and Q6_K per super-block), Q4_1 m, Q4_K dmin and the
    6-bit sc, m per 32-channel sub-block, Q6_K the int8 sc per 16-channel
    sub-block (ggml's dequantize_row_*)."""
    rows, n = b.shape[:2]
    if ty == "q8_0":
        return {"q": b[..., 2:].reshape(rows, -1), "d": f16_at(b, 0)}
    if ty == "q4_k":
        qs = b[..., 16:].reshape(rows, n, 4, 1, 32)
        q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(rows, n * 256)
        s = b[..., 4:16].astype(np.int32)
        sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
        m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
        return {"q": q, "d": f16_at(b, 0), "dmin": f16_at(b, 2), "sc": sc, "m": m}
    if ty == "q4_1":
        return {"q": nibbles32(b[..., 4:20]).reshape(rows, -1), "d": f16_at(b, 0), "m": f16_at(b, 2)}
    if ty == "q5_0":
        qh = b[..., 2:6].copy().view("<u4")  # [rows, n, 1]: bit e is element e's bit 4
        hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        return {"q": (nibbles32(b[..., 6:22]) | (hi << 4)).reshape(rows, -1), "d": f16_at(b, 0)}
    # q6_k: element e = 128 h + 32 k + l of a super-block: low 4 bits
    # (ql[64 h + 32 (k & 1) + l] >> 4 (k >> 1)) & 15, high 2 bits
    # (qh[32 h + l] >> 2 k) & 3, scale sc[e // 16]
    ql = b[..., :128].reshape(rows, n, 2, 2, 32)
    lo = np.stack([ql[..., 0, :] & 15, ql[..., 1, :] & 15, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], axis=3)
    qh = b[..., 128:192].reshape(rows, n, 2, 1, 32)
    hi = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    q = (lo | (hi << 4)).reshape(rows, n * 256)
    return {"q": q, "d": f16_at(b, 208), "sc": b[..., 192:208].view(np.int8).reshape(rows, n * 16)}


def dequantize(ty, b):
    """The f64 weights of ggml blocks (ggml's dequantize_row_*)."""
    f = fields(ty, b)
    rows = b.shape[0]
    per = lambda v, k: np.repeat(v.reshape(rows, -1).astype(np.float64), k, axis=1)  # noqa: E731
    if ty == "q8_0":
        return per(f["d"], 32) * f["q"].view(np.int8).astype(np.float64)
    q = f["q"].astype(np.float64)
    if ty == "q4_k":
        return per(f["d"], 256) * per(f["sc"], 32) * q - per(f["dmin"], 256) * per(f["m"], 32)
    if ty == "q4_1":
        return per(f["d"], 32) * q + per(f["m"], 32)
    if ty == "q5_0":
        return per(f["d"], 32) * (q - 16)
    return per(f["d"], 256) * per(f["sc"], 16) * (q - 32)


def gguf_dequantize(ty, b):
    """The gguf package's f32 dequantization of blocks b (None without it)."""
    try:
        from gguf import quants
    except ImportError:
        return None
    rows = b.shape[0]
    return quants.dequantize(np.ascontiguousarray(b).reshape(rows, -1), GGML_TYPE[ty]).reshape(rows, -1)


def pack(ty, b, rows, cols, tile):
    """The channel-major bytes of ggml blocks b for tiles of `tile` outputs
    (every bit of them, moved)."""
    out = np.zeros(layout_bytes(ty, rows, cols), np.uint8)
    f = fields(ty, b)
    q = f["q"].astype(np.uint8)
    groups = cols // 32
    for t in range((rows + tile - 1) // tile):
        r = min(tile, rows - t * tile)
        rp = padded(r)
        rs = slice(t * tile, t * tile + r)
        at = t * tile * row_bytes(ty, cols)
        codes = np.zeros((cols, rp), np.uint8)
        codes[:, :r] = q[rs].T
        parts = []
        if ty == "q8_0":
            parts.append(codes)
        else:
            # byte 8 l + b of a run: output 16 l + b (low nibble), 16 l + 8 + b (high)
            v = (codes & 15).reshape(cols, rp // 16, 2, 8)
            parts.append(v[:, :, 0, :] | (v[:, :, 1, :] << 4))
        if ty == "q5_0":
            # lane l's u16: bit 4 m + i = bit 4 of output 16 l + 4 i + m
            h = ((codes >> 4) & 1).reshape(cols, rp // 16, 4, 4).astype(np.uint16)  # [c, l, i, m]
            shift = (4 * np.arange(4, dtype=np.uint16)[None, :] + np.arange(4, dtype=np.uint16)[:, None])
            parts.append((h << shift).sum(axis=(2, 3), dtype=np.uint16).astype("<u2").view(np.uint8))
        elif ty == "q6_k":
            # lane l's 4 bytes: bits 2 i, 2 i + 1 of byte m = bits 4, 5 of output 16 l + 4 i + m
            h = ((codes >> 4) & 3).reshape(cols, rp // 16, 4, 4)  # [c, l, i, m]
            parts.append((h << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=2, dtype=np.uint8))

        def plane(v, *lead):
            """v [r, *lead] as [*lead, rp] (outputs last), zero-padded."""
            p = np.zeros(tuple(lead) + (rp,), v.dtype)
            p[..., :r] = np.moveaxis(v, 0, -1)
            return p
        if ty in ("q8_0", "q5_0"):
            parts.append(plane(f["d"][rs], groups).view(np.uint8))  # [g, rp] f16
        elif ty == "q4_1":
            dm = np.stack([f["d"][rs], f["m"][rs]], axis=-1)  # [r, g, 2]
            parts.append(np.moveaxis(plane(dm, groups, 2), -1, -2).copy().view(np.uint8))  # [g, rp, 2] f16
        elif ty == "q4_k":
            sbs = cols // 256
            dd = np.stack([f["d"][rs], f["dmin"][rs]], axis=-1)  # [r, sb, 2]
            dd = np.moveaxis(plane(dd, sbs, 2), -1, -2).copy().view(np.uint8).reshape(sbs, -1)
            sc, m = f["sc"][rs], f["m"][rs]  # [r, sb, 8]
            lo = plane(((sc & 15) | ((m & 15) << 4)).astype(np.uint8), sbs, 8)
            hi = plane(((sc[..., 0::2] >> 4) | ((m[..., 0::2] >> 4) << 2) | ((sc[..., 1::2] >> 4) << 4)
                        | ((m[..., 1::2] >> 4) << 6)).astype(np.uint8), sbs, 4)
            parts.append(np.concatenate([dd, lo.reshape(sbs, -1), hi.reshape(sbs, -1)], axis=1))
        else:  # q6_k: per super-block d [rp] f16, then 8 planes [rp, 2] of int8 sub-block scales
            sbs = cols // 256
            d = plane(f["d"][rs], sbs).view(np.uint8)  # [sb, 2 rp]
            sc = f["sc"][rs].reshape(r, sbs, 8, 2)
            sc = np.moveaxis(plane(sc, sbs, 8, 2), -1, -2).copy().view(np.uint8).reshape(sbs, -1)  # [sb, 16 rp]
            parts.append(np.concatenate([d, sc], axis=1))
        tile_bytes = np.concatenate([p.ravel() for p in parts])
        assert tile_bytes.size == rp * row_bytes(ty, cols), (ty, tile_bytes.size, rp, cols)
        out[at:at + tile_bytes.size] = tile_bytes
    return out


def cpu_list(x, thr):
    """The list the CPU rule makes (mirage-gguf's ActiveChannels::fill), as
    asp_select's records."""
    xs = x.reshape(-1, 32)
    groups = xs.shape[0]
    on = np.abs(xs) >= thr.reshape(-1, 32) if thr is not None else np.ones(xs.shape, bool)
    amax = np.where(on, np.abs(xs), np.float32(0)).max(axis=1).astype(np.float32)
    dx = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xs * inv[:, None]), -127, 127).astype(np.int32) * on
    rec = np.zeros((groups, 32), np.uint32)
    k = on.sum(axis=1)
    rec[:, 0] = k
    rec[:, 1] = dx.view(np.uint32)
    rec[:, 2] = (dx * q.sum(axis=1).astype(np.float32)).astype(np.float32).view(np.uint32)
    idx = np.full((groups, 32), 255, np.uint8)
    xq = np.zeros((groups, 32), np.int8)
    for g in range(groups):
        pos = np.flatnonzero(on[g])
        idx[g, :len(pos)] = pos
        xq[g, :len(pos)] = q[g, pos]
    rec[:, 4:12] = idx.view(np.uint32)
    rec[:, 12:20] = xq.view(np.uint32)
    return rec.view(np.uint8).ravel()


def list_fields(lst):
    """Per group: count, dx, and the dense vector of dx * xq (0 where skipped)."""
    rec = lst.view(np.uint32).reshape(-1, 32)
    k = rec[:, 0].astype(np.int64)
    dx = rec[:, 1].view(np.float32).astype(np.float64)
    idx = rec[:, 4:12].copy().view(np.uint8)
    xq = rec[:, 12:20].copy().view(np.int8).astype(np.float64)
    xd = np.zeros(rec.shape[0] * 32)
    for g in range(rec.shape[0]):
        xd[32 * g + idx[g, :k[g]].astype(np.int64)] = dx[g] * xq[g, :k[g]]
    return k, xd


def bytes_read(ty, rows, cols, k):
    """Weight bytes a product over a list with per-group counts k reads."""
    rp = padded(rows)  # the tiles' padded outputs: only the last tile is padded
    active, groups = int(k.sum()), int((k > 0).sum())
    if ty == "q8_0":
        return active * rp + groups * 2 * rp
    if ty == "q4_1":
        return active * rp // 2 + groups * 4 * rp
    if ty == "q5_0":
        return active * (rp // 2 + rp // 8) + groups * 2 * rp
    sbs = int((k.reshape(-1, 8) > 0).any(axis=1).sum())
    if ty == "q6_k":  # per group its plane, per super-block its d
        return active * (rp // 2 + rp // 4) + groups * 2 * rp + sbs * 2 * rp
    pairs = int((k.reshape(-1, 2) > 0).any(axis=1).sum())
    return active * rp // 2 + groups * rp + pairs * rp + sbs * 4 * rp


def thresholds(x, skipped):
    """One threshold for every channel that skips `skipped` of x's channels."""
    if skipped <= 0:
        return np.zeros_like(x)
    a = np.sort(np.abs(x))
    return np.full_like(x, a[int(round(skipped * len(x)))])


# ---------------------------------------------------------------------------
# Launches.

class Sparse:
    def __init__(self):
        src = "".join((ROOT / "cuda" / f).read_text() for f in ("pdl.cu", "norm.cu", "activation_sparse.cu"))
        self.mod = cp.RawModule(code=src, options=("--std=c++17", "-default-device"), backend="nvrtc")
        self.select = self.mod.get_function("asp_select")

    def kernel(self, ty, variant, ch, nw, tile):
        return self.mod.get_function(f"asp_mv_{ty}_{variant}_c{ch}_w{nw}_t{tile}")

    def select_launch(self, x, thr, lst):
        groups = x.size // 32
        # asp_select(x, cols, norm_w, eps, norm_out, thr0..2, list0..2): no folded norm, one matrix.
        return lambda: self.select(((groups + 7) // 8, 1), (256,), (x, I32(x.size), NULL, np.float32(0), NULL, thr,
                                                                     NULL, NULL, lst, NULL, NULL))

    def product_launch(self, fn, nw, tile, gpw, rows, cols, mats, ws, lst, ys, part, ctr):
        """launch(i): the product of matrix copy i (gate+up: copies i, i + 1)."""
        n_tiles = (rows + tile - 1) // tile
        subsets = nw // (tile // 512)  # warps of a block on one output range
        splits = -(-(cols // 32) // (subsets * gpw))
        assert subsets * gpw <= MAX_BLOCK_GROUPS and part.size >= mats * splits * n_tiles * tile
        assert ctr.size >= mats * n_tiles
        copies = len(ws)

        def launch(i):
            w1 = ws[(i + 1) % copies] if mats == 2 else NULL
            fn((n_tiles * splits, mats), (32 * nw,),
               (ws[i % copies], w1, lst, lst if mats == 2 else NULL, ys[0], ys[1] if mats == 2 else NULL,
                I32(rows), I32(cols), I32(gpw), I32(splits), part, ctr, NULL, NULL, I32(0)))  # no epilogue
        return launch


def configs():
    return [(nw, tile, gpw) for nw, tile in BLOCKS for gpw in GROUPS_PER_WARP
            if nw // (tile // 512) * gpw <= MAX_BLOCK_GROUPS]


def scratch(rows, cols, mats):
    """Partial rows and counters enough for every launch shape."""
    most = max(mats * -(-(cols // 32) // (nw // (tile // 512))) * -(-rows // tile) * tile for nw, tile in BLOCKS)
    return cp.zeros(most, cp.float32), cp.zeros(mats * -(-rows // 512), cp.uint32)


# ---------------------------------------------------------------------------

def real_pairs(path, types, failures):
    """The real matrix pairs of real_blocks.py's file for `types` (those the
    file has): (label, type, rows, cols, blocks 0, blocks 1), each matrix's
    numpy reading checked against the gguf package's product stored beside
    it."""
    data = np.load(path)
    pairs = []
    for ty in types:
        if f"{ty}_0" not in data:
            print(f"({path} has no real {ty} matrices)")
            continue
        bs = [data[f"{ty}_{i}"] for i in (0, 1)]
        for i, b in enumerate(bs):
            got = dequantize(ty, b) @ data[f"{ty}_{i}_v"]
            want = data[f"{ty}_{i}_wv"]
            err = np.abs(got - want).max() / np.abs(want).max()
            if not err <= 1e-6:
                failures.append(f"real {ty} {i}: this script's dequantization differs from gguf's ({err:.3g})")
        rows, cols = bs[0].shape[0], bs[0].shape[1] * TYPES[ty].block
        pairs.append((f"real {ty}", ty, rows, cols, bs[0], bs[1]))
    return pairs


def check_reading(label, ty, blocks, failures):
    """This script's reading of ggml blocks against the gguf package's
    dequantization (f32), where the package is installed."""
    for i, b in enumerate(blocks):
        want = gguf_dequantize(ty, b)
        if want is None:
            return False
        got = dequantize(ty, b)
        err = np.abs(got - want).max() / np.abs(want).max()
        if not err <= 1e-6:
            failures.append(f"{label} {i}: this script's dequantization differs from gguf's ({err:.3g})")
    return True


def correctness(sp, types, failures, real=None):
    print("Correctness (error = max |y - ref| / max |ref|; bounds "
          f"{BOUND_CODES:g} against the list's dx * xq, {BOUND_X:g} against x):")
    cases = []
    for ty in types:
        rows, cols = TYPES[ty].check
        cases.append((ty, ty, rows, cols, random_blocks(ty, rows, cols), random_blocks(ty, rows, cols)))
    checked = [check_reading(label, ty, (b0, b1), failures) for label, ty, _, _, b0, b1 in cases]
    print("(random blocks' reading " + ("checked against gguf.quants.dequantize)" if all(checked)
                                         else "not checked: no gguf package)"))
    if real:
        cases += real_pairs(real, types, failures)
    print("| type | shape | skipped | lists = CPU rule | worst error (dx * xq) | worst error (x) | kernels |")
    print("|---|---|---:|---|---:|---:|---|")
    for label, ty, rows, cols, b0, b1 in cases:
        W = [dequantize(ty, b0), dequantize(ty, b1)]
        tiles = sorted({tile for _, tile in BLOCKS})
        ws = {tile: [cp.asarray(pack(ty, b, rows, cols, tile)) for b in (b0, b1)] for tile in tiles}
        x = rng.standard_normal(cols).astype(np.float32)
        x[5] = 0
        xd = cp.asarray(x)
        lst = cp.zeros(cols // 32 * REC, cp.uint8)
        ys = [cp.zeros(rows, cp.float32), cp.zeros(rows, cp.float32)]
        part, ctr = scratch(rows, cols, 2)
        for skipped in (0.0, 0.5, 1.0):
            thr = thresholds(x, skipped) if skipped < 1 else np.full_like(x, np.inf)
            sp.select_launch(xd, cp.asarray(thr), lst)()
            got = cp.asnumpy(lst)
            same = bool(np.array_equal(got, cpu_list(x, thr)))
            if not same:
                failures.append(f"{label}: list differs from the CPU rule at {skipped:.0%} skipped")
            k, xq = list_fields(got)
            act = np.zeros(cols, bool)  # the listed channels
            rec = got.view(np.uint32).reshape(-1, 32)
            for g in range(cols // 32):
                act[32 * g + rec[g, 4:12].copy().view(np.uint8)[:k[g]].astype(np.int64)] = True
            refs_q = [w @ xq for w in W]
            refs_x = [w @ np.where(act, x.astype(np.float64), 0) for w in W]
            worst_q = worst_x = 0.0
            names = []
            for variant, ch in TYPES[ty].variants:
                for nw, tile in BLOCKS:
                    fn = sp.kernel(ty, variant, ch, nw, tile)
                    names.append(f"{variant}_c{ch}_w{nw}_t{tile}")
                    for gpw in (1, 3):
                        launch = sp.product_launch(fn, nw, tile, gpw, rows, cols, 2, ws[tile], lst, ys, part, ctr)
                        outs = []
                        for _ in range(2):
                            for y in ys:
                                y.fill(np.nan)
                            launch(0)
                            outs.append([cp.asnumpy(y) for y in ys])
                        if any(not np.array_equal(a.view(np.uint32), b.view(np.uint32))
                               for a, b in zip(outs[0], outs[1])):
                            failures.append(f"{label} {variant} w{nw} t{tile} gpw {gpw}: two runs differ")
                        if int(cp.asnumpy(ctr).max()) != 0:
                            failures.append(f"{label} {variant} w{nw} t{tile} gpw {gpw}: counters left non-zero")
                        for y, rq, rx in zip(outs[0], refs_q, refs_x):
                            if skipped >= 1:
                                if np.any(y != 0):
                                    failures.append(f"{label} {variant} w{nw} t{tile}: all skipped but y != 0")
                                continue
                            scale = np.abs(rq).max()
                            eq = np.abs(y - rq).max() / scale
                            ex = np.abs(y - rx).max() / scale
                            eq = np.inf if np.isnan(eq) else eq
                            worst_q, worst_x = max(worst_q, eq), max(worst_x, ex)
                            if not eq <= BOUND_CODES or not ex <= BOUND_X:
                                failures.append(f"{label} {variant} w{nw} t{tile} gpw {gpw} at {skipped:.0%} skipped: error "
                                                f"{eq:.3g} (dx * xq) {ex:.3g} (x)")
            print(f"| {label} | {rows} x {cols} | {skipped:.0%} | {'yes' if same else 'NO'} | {worst_q:.2e} | "
                  f"{worst_x:.2e} | {len(names)} ({', '.join(names[:2])}, ...), 1 and 3 groups a warp |", flush=True)
        del ws, ys, part, ctr
        cp.get_default_memory_pool().free_all_blocks()


def parse_args(argv):
    ap = argparse.ArgumentParser(description="Activation-sparse mat-vecs: correctness, then timings beside the "
                                 "dense kernels (see the module's doc).")
    ap.add_argument("--types", default=",".join(TYPES),
                    help="comma-separated types to check and time (default: %(default)s)")
    ap.add_argument("--real", metavar="REAL.npz", help="real_blocks.py's file: real matrices for the check too")
    ap.add_argument("--correctness-only", action="store_true", help="skip the timings")
    args = ap.parse_args(argv)
    args.types = [t.strip().lower() for t in args.types.split(",") if t.strip()]
    unknown = [t for t in args.types if t not in TYPES]
    if unknown or not args.types:
        ap.error(f"--types: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(TYPES)}")
    return args


def ratio(a, b):
    return "-" if b is None else f"{a / b:.2f}"


def main():
    args = parse_args(sys.argv[1:])
    if cp is None:
        print("sparse_matvec.py needs CuPy (the GPU machine has it)", file=sys.stderr)
        return 2
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    copy = dense.copy_rate()
    print(f"{props['name'].decode()}, {props['multiProcessorCount']} SMs, copy {copy / 1e9:.0f} GB/s "
          f"(read + written); types {', '.join(args.types)}\n")
    sp = Sparse()
    failures = []
    correctness(sp, args.types, failures, args.real)
    if args.correctness_only:
        return verdict(failures)
    dmod = dense.dense_module()
    print("\nTimings (graphs of 40 launches, every launch another copy of the matrices; each variant at its "
          "fastest launch: w warps a block, t outputs a tile, g groups of 32 channels a warp; skipped: the share "
          "of input channels the list skips; dense: the type's split-layout kernel, \"-\" where it has none):")
    print("| shape | type | skipped | variant | launch | µs +select | µs product | MB read | % copy | dense kernel | "
          "dense µs | dense MB | dense % copy | sparse/dense +select | sparse/dense product |")
    print("|---|---|---:|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    summary, by_tile = [], {}
    for ty in args.types:
        kind, variants = TYPES[ty].dense, TYPES[ty].variants
        for name, rows, cols, mats in SHAPES:
            if not fits(ty, cols):
                print(f"| {name} | {ty} | - | - | - | - | - | - | - | {cols} channels are not whole {ty.upper()} "
                      "blocks | - | - | - | - | - |", flush=True)
                continue
            x = rng.standard_normal(cols).astype(np.float32)
            xd = cp.asarray(x)
            dense_name, t_dense, dense_bytes = "-", None, None
            if kind is not None:
                raw = dense.split_matrix(kind, rows, cols)
                copies = max(2, math.ceil(256e6 / raw.size))
                dws = [cp.asarray(raw) for _ in range(copies)]
                dy = cp.zeros(rows, cp.float32)
                dense_name, t_dense = dense.best_dense(dmod, kind, mats == 2, rows, cols, dws, xd, dy)
                dense_name = f"`{dense_name}`"
                dense_bytes = raw.size * mats
                del dws, raw, dy
                cp.get_default_memory_pool().free_all_blocks()
            dense_cells = ("- | - | -" if t_dense is None else
                           f"{t_dense * 1e6:.2f} | {dense_bytes / 1e6:.1f} | {dense_bytes / t_dense / copy:.0%}")
            size = layout_bytes(ty, rows, cols)
            copies = max(2, math.ceil(256e6 / size))
            first = cp.asarray(rng.integers(0, 256, size, dtype=np.uint8))
            ws = [first] + [first.copy() for _ in range(copies - 1)]
            lst = cp.zeros(cols // 32 * REC, cp.uint8)
            ys = [cp.zeros(rows, cp.float32), cp.zeros(rows, cp.float32)]
            part, ctr = scratch(rows, cols, mats)
            for skipped in SKIPPED:
                thr = cp.asarray(thresholds(x, skipped))
                select = sp.select_launch(xd, thr, lst)
                select()
                k, _ = list_fields(cp.asnumpy(lst))
                nbytes = bytes_read(ty, rows, cols, k) * mats
                measured = 1 - k.sum() / cols
                for variant, ch in variants:
                    best = None
                    for nw, tile, gpw in configs():
                        launch = sp.product_launch(sp.kernel(ty, variant, ch, nw, tile), nw, tile, gpw, rows, cols,
                                                   mats, ws, lst, ys, part, ctr)
                        cp.cuda.Device().synchronize()
                        t = dense.timed(launch)
                        if best is None or t < best[0]:
                            best = (t, nw, tile, gpw, launch)
                        key = (name, ty, skipped, tile)
                        if key not in by_tile or t < by_tile[key][0]:
                            by_tile[key] = (t, f"{variant} w{nw} g{gpw}", nbytes, t_dense)
                    t, nw, tile, gpw, launch = best

                    def with_select(i, launch=launch):
                        select()
                        launch(i)
                    t_sel = dense.timed(with_select)
                    share = nbytes / t / copy
                    print(f"| {name} | {ty} | {measured:.0%} | {variant} c{ch} | w{nw} t{tile} g{gpw} | {t_sel * 1e6:.2f} | "
                          f"{t * 1e6:.2f} | {nbytes / 1e6:.1f} | {share:.0%} | {dense_name} | {dense_cells} | "
                          f"{ratio(t_sel, t_dense)} | {ratio(t, t_dense)} |", flush=True)
                    summary.append((name, ty, skipped, variant, share, t, t_sel, t_dense))
            del ws, first, ys, part, ctr, lst
            cp.get_default_memory_pool().free_all_blocks()
    tiles = sorted({tile for _, tile in BLOCKS})
    print("\nAt 50 % skipped, the best product per tile width (µs, % of copy for its bytes, sparse/dense time; "
          "variant and launch):")
    print("| shape | type | " + " | ".join(f"tiles of {tile}" for tile in tiles) + " |")
    print("|---|---|" + "---|" * len(tiles))
    for (name, ty) in dict.fromkeys((k[0], k[1]) for k in by_tile):
        cells = []
        for tile in tiles:
            t, how, nbytes, t_dense = by_tile[(name, ty, 0.5, tile)]
            cells.append(f"{t * 1e6:.2f} µs, {nbytes / t / copy:.0%}, {ratio(t, t_dense)} ({how})")
        print(f"| {name} | {ty} | " + " | ".join(cells) + " |")
    print("\nAt 50 % skipped, 7B shapes (goal: product >= 75 % of copy for its bytes):")
    for name, ty, skipped, variant, share, t, t_sel, t_dense in summary:
        if skipped == 0.5 and name.startswith("7B"):
            vs = ("no dense split-layout kernel" if t_dense is None else
                  f"{t_dense / t:.2f}x dense ({t_dense / t_sel:.2f}x with the list kernel)")
            print(f"  {name:11s} {ty} {variant:9s}: {share:4.0%} of copy, {vs}")
    return verdict(failures)


def verdict(failures):
    """Prints the failed checks (exit status 1) or that all passed (0)."""
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
        return 1
    print("\nall correctness checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
