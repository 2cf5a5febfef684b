"""Activation-sparse decode mat-vecs on the GPU (cuda/activation_sparse.cu,
compiled with NVRTC) beside the shipped dense kernels on the same shapes, in
one run. Needs CuPy and numpy (the GPU machine has them); about 2 minutes on
an H100.

    python3 benches/gpu/sparse_matvec.py [--real REAL.npz] [--correctness-only]

First the correctness of the sparse kernels: on one shape per type (Q8_0 at
1152 x 896, Q4_K at 896 x 4864, both with a partial last tile) matrices
packed from random ggml blocks and, with --real, the real Q8_0 and Q4_K
matrices that benches/gpu/real_blocks.py copies from the shipped
Qwen2.5-Coder-0.5B (after checking this script's reading of their blocks
against the gguf package's dequantization), the channel lists against the
CPU rule, and
every kernel variant's product against an f64 numpy product over the same
active channels (error = max |y - ref| / max |ref|; bounds: 1e-5 against
the list's int8 activations dx * xq, 2e-2 against x itself; all channels
skipped: exactly 0). Then one table: for the Qwen2.5-7B and -0.5B shapes,
Q8_0 and Q4_K, and 0 / 25 / 50 / 75 % of the input channels skipped (random
activations, one threshold), each variant at its best launch shape:

  launch       the fastest launch shape of the variant: w warps a block,
               tiles of t outputs (t / 512 warps side by side on a tile, so
               an active channel's run, t / 2 bytes in Q4_K and t in Q8_0,
               is read at once), g groups of 32 channels a warp
  us +select   a product including the list kernel (asp_select) before it
  us product   the product alone (the list made once per input vector is
               shared by every matrix reading it: Q/K/V, gate and up)
  MB read      weight bytes the product reads: the runs of the active
               channels and the scales of groups with an active channel
  % copy       those bytes a second / the device-to-device copy rate
               (read + written), as matvec_shapes.py reports the dense ones
  dense        the shipped dense kernel (best column split, the same
               graphs), its time and its share of copy for the whole matrix
  sparse/dense time ratios, with the list kernel and without

A second table gives, at 50 % skipped, the best product time per tile width
(any variant, warps, groups). Each timing is a graph of 40 launches, each
reading another copy of the matrices (L2 holds none of them). Exits non-zero
when a correctness bound fails.
"""
import math
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import matvec_shapes as dense  # noqa: E402  (the dense module, copy rate, timed graphs)

cp = dense.cp
ROOT = dense.ROOT
I32, NULL = np.int32, np.uint64(0)
REC, MAX_BLOCK_GROUPS = 128, 64
SHAPES = [("7B Q/K/V", 4608, 3584, 1), ("7B O", 3584, 3584, 1), ("7B gate+up", 18944, 3584, 2),
          ("7B down", 3584, 18944, 1), ("0.5B Q/K/V", 1152, 896, 1), ("0.5B O", 896, 896, 1),
          ("0.5B gate+up", 4864, 896, 2), ("0.5B down", 896, 4864, 1)]
SKIPPED = (0.0, 0.25, 0.5, 0.75)
# Per type: the dense split layout, and the variants (name, channels a round).
TYPES = {"q8_0": ("q8_0s", [("serial", 8), ("pipelined", 8)]),
         "q4_k": ("q4_ks", [("serial", 16), ("pipelined", 8)])}
# Block shapes: (warps, tile width); then groups of 32 channels a warp.
BLOCKS, GROUPS_PER_WARP = ((4, 512), (8, 512), (4, 1024), (8, 1024), (8, 2048)), (1, 2, 4, 8)
BOUND_CODES, BOUND_X = 1e-5, 2e-2
rng = np.random.default_rng(3)


# ---------------------------------------------------------------------------
# The layout (activation_sparse.cu's head) and ggml's blocks, in numpy.

def row_bytes(ty, cols):
    return (cols if ty == "q8_0" else cols // 2) + cols // 16


def padded(rows):
    return (rows + 15) // 16 * 16


def layout_bytes(ty, rows, cols):
    return padded(rows) * row_bytes(ty, cols)


def random_blocks(ty, rows, cols):
    """ggml blocks of a random rows x cols matrix: [rows, blocks, bytes]."""
    if ty == "q8_0":
        b = np.empty((rows, cols // 32, 34), np.uint8)
        b[..., 2:] = rng.integers(-128, 128, (rows, cols // 32, 32)).astype(np.int8).view(np.uint8)
        b[..., :2] = rng.uniform(0.002, 0.02, (rows, cols // 32)).astype(np.float16)[..., None].view(np.uint8)
        return b
    b = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    b[..., 0:4] = rng.uniform(0.0005, 0.003, (rows, cols // 256, 2)).astype(np.float16).view(np.uint8)
    return b


def q4k_fields(b):
    """Per element its 4-bit code; per (row, super-block) d, dmin; per
    sub-block the 6-bit scale and min (ggml's get_scale_min_k4)."""
    rows, sbs = b.shape[:2]
    qs = b[..., 16:].reshape(rows, sbs, 4, 1, 32)
    q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(rows, sbs * 256)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0]
    s = b[..., 4:16].astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return q, d, dmin, sc, m


def dequantize(ty, b):
    """The f64 weights of ggml blocks (ggml's dequantize_row_*)."""
    rows = b.shape[0]
    if ty == "q8_0":
        d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
        q = b[..., 2:].view(np.int8).astype(np.float64)
        return (d[..., None] * q).reshape(rows, -1)
    q, d, dmin, sc, m = q4k_fields(b)
    sub = lambda v: np.repeat(v.reshape(rows, -1), 32, axis=1).astype(np.float64)  # noqa: E731
    dd = np.repeat(d.astype(np.float64), 256, axis=1)
    dm = np.repeat(dmin.astype(np.float64), 256, axis=1)
    return dd * sub(sc) * q - dm * sub(m)


def pack(ty, b, rows, cols, tile):
    """The channel-major bytes of ggml blocks b for tiles of `tile` outputs
    (every bit of them, moved)."""
    out = np.zeros(layout_bytes(ty, rows, cols), np.uint8)
    if ty == "q8_0":
        q = b[..., 2:].reshape(rows, cols)
        d = b[..., :2].copy().view(np.float16)[..., 0]
    else:
        q, d, dmin, sc, m = q4k_fields(b)
        q = q.astype(np.uint8)
    for t in range((rows + tile - 1) // tile):
        r = min(tile, rows - t * tile)
        rp = padded(r)
        rs = slice(t * tile, t * tile + r)
        at = t * tile * row_bytes(ty, cols)
        codes = np.zeros((cols, rp), np.uint8)
        codes[:, :r] = q[rs].T
        if ty == "q8_0":
            runs = codes
            scales = np.zeros((cols // 32, rp), np.float16)
            scales[:, :r] = d[rs].T
            scales = scales.view(np.uint8)
        else:
            v = codes.reshape(cols, rp // 16, 2, 8)
            runs = (v[:, :, 0, :] | (v[:, :, 1, :] << 4)).reshape(cols, rp // 2)
            sbs = cols // 256
            dd = np.zeros((sbs, rp, 2), np.float16)
            dd[:, :r, 0] = d[rs].T
            dd[:, :r, 1] = dmin[rs].T
            scr, mr = sc[rs].transpose(1, 2, 0), m[rs].transpose(1, 2, 0)  # [sb, j, r]
            lo = np.zeros((sbs, 8, rp), np.uint8)
            lo[..., :r] = (scr & 15) | ((mr & 15) << 4)
            hi = np.zeros((sbs, 4, rp), np.uint8)
            hi[..., :r] = ((scr[:, 0::2] >> 4) | ((mr[:, 0::2] >> 4) << 2) | ((scr[:, 1::2] >> 4) << 4)
                           | ((mr[:, 1::2] >> 4) << 6))
            scales = np.concatenate([dd.view(np.uint8).reshape(sbs, -1), lo.reshape(sbs, -1),
                                     hi.reshape(sbs, -1)], axis=1)
        out[at:at + runs.size] = runs.ravel()
        out[at + runs.size:at + runs.size + scales.size] = scales.ravel()
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
    pairs = int((k.reshape(-1, 2) > 0).any(axis=1).sum())
    sbs = int((k.reshape(-1, 8) > 0).any(axis=1).sum())
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

def real_pairs(path, failures):
    """The real matrix pairs of real_blocks.py's file: (label, type, rows,
    cols, blocks 0, blocks 1), each matrix's numpy reading checked against
    the gguf package's product stored beside it."""
    data = np.load(path)
    pairs = []
    for ty in ("q8_0", "q4_k"):
        bs = [data[f"{ty}_{i}"] for i in (0, 1)]
        for i, b in enumerate(bs):
            got = dequantize(ty, b) @ data[f"{ty}_{i}_v"]
            want = data[f"{ty}_{i}_wv"]
            err = np.abs(got - want).max() / np.abs(want).max()
            if not err <= 1e-6:
                failures.append(f"real {ty} {i}: this script's dequantization differs from gguf's ({err:.3g})")
        rows, cols = bs[0].shape[0], bs[0].shape[1] * (32 if ty == "q8_0" else 256)
        pairs.append((f"real {ty}", ty, rows, cols, bs[0], bs[1]))
    return pairs


def correctness(sp, failures, real=None):
    print("Correctness (error = max |y - ref| / max |ref|; bounds "
          f"{BOUND_CODES:g} against the list's dx * xq, {BOUND_X:g} against x):")
    print("| type | shape | skipped | lists = CPU rule | worst error (dx * xq) | worst error (x) | kernels |")
    print("|---|---|---:|---|---:|---:|---|")
    cases = [(ty, ty, rows, cols, random_blocks(ty, rows, cols), random_blocks(ty, rows, cols))
             for ty, rows, cols in (("q8_0", 1152, 896), ("q4_k", 896, 4864))]
    if real:
        cases += real_pairs(real, failures)
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
            for variant, ch in TYPES[ty][1]:
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


def main():
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    copy = dense.copy_rate()
    print(f"{props['name'].decode()}, {props['multiProcessorCount']} SMs, copy {copy / 1e9:.0f} GB/s "
          "(read + written)\n")
    dmod = dense.dense_module()
    sp = Sparse()
    failures = []
    args = sys.argv[1:]
    real = args[args.index("--real") + 1] if "--real" in args else None
    correctness(sp, failures, real)
    if "--correctness-only" in args:
        return verdict(failures)
    print("\nTimings (graphs of 40 launches, every launch another copy of the matrices; each variant at its "
          "fastest launch: w warps a block, t outputs a tile, g groups of 32 channels a warp; skipped: the share "
          "of input channels the list skips):")
    print("| shape | type | skipped | variant | launch | µs +select | µs product | MB read | % copy | dense kernel | "
          "dense µs | dense MB | dense % copy | sparse/dense +select | sparse/dense product |")
    print("|---|---|---:|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    summary, by_tile = [], {}
    for ty, (kind, variants) in TYPES.items():
        for name, rows, cols, mats in SHAPES:
            if ty == "q4_k" and cols % 256:
                print(f"| {name} | {ty} | - | - | - | - | - | - | - | {cols} channels are not whole Q4_K "
                      "super-blocks | - | - | - | - | - |", flush=True)
                continue
            raw = dense.split_matrix(kind, rows, cols)
            copies = max(2, math.ceil(256e6 / raw.size))
            dws = [cp.asarray(raw) for _ in range(copies)]
            x = rng.standard_normal(cols).astype(np.float32)
            xd = cp.asarray(x)
            dy = cp.zeros(rows, cp.float32)
            dense_name, t_dense = dense.best_dense(dmod, kind, mats == 2, rows, cols, dws, xd, dy)
            dense_bytes = raw.size * mats
            del dws, raw
            cp.get_default_memory_pool().free_all_blocks()
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
                          f"{t * 1e6:.2f} | {nbytes / 1e6:.1f} | {share:.0%} | `{dense_name}` | "
                          f"{t_dense * 1e6:.2f} | {dense_bytes / 1e6:.1f} | {dense_bytes / t_dense / copy:.0%} | "
                          f"{t_sel / t_dense:.2f} | {t / t_dense:.2f} |", flush=True)
                    summary.append((name, ty, skipped, variant, share, t_dense / t, t_dense / t_sel))
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
            cells.append(f"{t * 1e6:.2f} µs, {nbytes / t / copy:.0%}, {t / t_dense:.2f} ({how})")
        print(f"| {name} | {ty} | " + " | ".join(cells) + " |")
    print("\nAt 50 % skipped, 7B shapes (goal: product >= 75 % of copy for its bytes):")
    for name, ty, skipped, variant, share, speed, speed_sel in summary:
        if skipped == 0.5 and name.startswith("7B"):
            print(f"  {name:11s} {ty} {variant:9s}: {share:4.0%} of copy, {speed:.2f}x dense "
                  f"({speed_sel:.2f}x with the list kernel)")
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
