"""Real ggml blocks for the GPU correctness check of the activation-sparse
kernels (`python3 benches/gpu/sparse_matvec.py --real FILE.npz`): the real
models do not fit on the GPU machine, so this copies two Q8_0 and two Q4_K
matrices of the shipped Qwen2.5-Coder-0.5B-Instruct Q4_K_M (layers 0 and 1's
V, layers 11 and 12's down; about 5 MB compressed) into an .npz, each with a
product computed from the `gguf` package's own dequantization (W @ v for a
random v), against which sparse_matvec.py first checks its numpy reading of
the blocks. Runs here (numpy and gguf), not on the GPU machine:

    python3 benches/gpu/real_blocks.py models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf real.npz
"""
import sys

import gguf
import numpy as np
from gguf import quants

PAIRS = {
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, ("blk.0.attn_v.weight", "blk.1.attn_v.weight")),
    "q4_k": (gguf.GGMLQuantizationType.Q4_K, ("blk.11.ffn_down.weight", "blk.12.ffn_down.weight")),
}


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    model, out = argv[1], argv[2]
    tensors = {t.name: t for t in gguf.GGUFReader(model).tensors}
    rng = np.random.default_rng(0)
    arrays = {}
    for ty, (qtype, names) in PAIRS.items():
        for i, name in enumerate(names):
            t = tensors.get(name)
            if t is None or t.tensor_type != qtype:
                found = "missing" if t is None else t.tensor_type.name
                print(f"{model}: {name} is {found}, not {qtype.name}", file=sys.stderr)
                return 1
            cols, rows = int(t.shape[0]), int(t.shape[1])
            per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            blocks = np.asarray(t.data, np.uint8).reshape(rows, cols // per_block, block_bytes)
            w = quants.dequantize(np.asarray(t.data), qtype).reshape(rows, cols).astype(np.float64)
            v = rng.standard_normal(cols)
            arrays[f"{ty}_{i}"] = blocks
            arrays[f"{ty}_{i}_v"] = v
            arrays[f"{ty}_{i}_wv"] = w @ v
            print(f"{name}: {ty} {rows} x {cols}")
    np.savez_compressed(out, **arrays)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
