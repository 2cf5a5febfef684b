"""Real ggml blocks for the GPU correctness check of the activation-sparse
kernels (`python3 benches/gpu/sparse_matvec.py --real FILE.npz`): the real
models do not fit on the GPU machine, so this copies two matrices of each
type of the shipped Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Q8_0: layers 0 and
1's V; Q4_K: layers 11 and 12's down; Q5_0: layers 0 and 1's Q; Q6_K:
layers 0 and 1's down) and, given the SmolLM2-135M-Instruct Q4_1 file as
well, two Q4_1 matrices of it (layer 0's gate and up) into an .npz (about
15 MB compressed), each with a product computed from the `gguf` package's
own dequantization (W @ v for a random v), against which sparse_matvec.py
first checks its numpy reading of the blocks. Runs here (numpy and gguf),
not on the GPU machine:

    python3 benches/gpu/real_blocks.py models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf real.npz \\
        [models/smollm2-135m-instruct-q4_1.gguf]
"""
import sys

import gguf
import numpy as np
from gguf import quants

Q = gguf.GGMLQuantizationType
# Per type: (the model argument it comes from: 0 the 0.5B, 1 the Q4_1 file), ggml type, the two matrices.
PAIRS = {
    "q8_0": (0, Q.Q8_0, ("blk.0.attn_v.weight", "blk.1.attn_v.weight")),
    "q4_k": (0, Q.Q4_K, ("blk.11.ffn_down.weight", "blk.12.ffn_down.weight")),
    "q5_0": (0, Q.Q5_0, ("blk.0.attn_q.weight", "blk.1.attn_q.weight")),
    "q6_k": (0, Q.Q6_K, ("blk.0.ffn_down.weight", "blk.1.ffn_down.weight")),
    "q4_1": (1, Q.Q4_1, ("blk.0.ffn_gate.weight", "blk.0.ffn_up.weight")),
}


def main(argv):
    if len(argv) not in (3, 4):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    models, out = [argv[1]] + argv[3:], argv[2]
    readers = [{t.name: t for t in gguf.GGUFReader(m).tensors} for m in models]
    rng = np.random.default_rng(0)
    arrays = {}
    for ty, (src, qtype, names) in PAIRS.items():
        if src >= len(readers):
            print(f"{ty}: no model given (the Q4_1 file is the optional third argument)")
            continue
        tensors, model = readers[src], models[src]
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
