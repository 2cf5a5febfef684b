#!/usr/bin/env python3
"""Build a tiny randomly initialised Qwen3 model and record its logits as a reference.

No trained Qwen3 GGUF ships here, so the qwen3 graph (QK-norm) is checked against transformers'
Qwen3ForCausalLM: this script saves the model as model.safetensors + config.json, three fixed
token-id sequences and the full f32 logits at every position.  MIRAGE converts the safetensors to
GGUF with its own writer and must reproduce these logits.

It also re-implements the forward pass in plain numpy from the saved safetensors (QK-norm per head
on head_dim, before NeoX-style RoPE) and checks it against torch, and checks that the two wrong
orders (norm after RoPE, norm over the whole projection) give clearly different logits, so a test
against these fixtures can tell them apart.

Usage:  python3 scripts/gen_qwen3_tiny.py [--out DIR]
Format: crates/mirage-runtime/tests/fixtures/reference/FORMAT.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = (
    REPO_ROOT / "crates" / "mirage-runtime" / "tests" / "fixtures" / "reference" / "qwen3_tiny"
)

# vocab 256 (not 512) keeps model.safetensors at ~0.5 MB; every other dimension is as specified.
# head_dim * heads (128) != hidden (64) on purpose, as in real Qwen3.
CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=False,
    max_position_embeddings=128,
    attention_bias=False,
)
INIT_STD = 0.1
SEQUENCE_LENGTHS = (16, 24, 32)
SEED = 0


def build_model():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(SEED)
    config = Qwen3Config(**CONFIG)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                # Norm weights away from 1.0 and different per tensor, so that dropping a norm or
                # swapping q_norm/k_norm in a converter changes the logits.
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0.0, INIT_STD)
    model.eval()
    return model


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * weight


def rope_neox(x: np.ndarray, theta: float) -> np.ndarray:
    """x: [seq, heads, head_dim]; rotates pairs (i, i + head_dim/2) as HF's rotate_half does."""
    seq, _, dim = x.shape
    inv_freq = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    angles = np.arange(seq, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos = np.cos(np.concatenate([angles, angles], axis=-1))[:, None, :]
    sin = np.sin(np.concatenate([angles, angles], axis=-1))[:, None, :]
    half = dim // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def numpy_forward(tensors: dict, ids: list[int], qk_norm: str = "per_head_before_rope") -> np.ndarray:
    """Plain numpy Qwen3 forward from the safetensors dict; returns logits [seq, vocab].

    qk_norm selects where the q/k RMSNorm goes: "per_head_before_rope" (Qwen3), or the two wrong
    variants "per_head_after_rope" and "whole_projection" (weights tiled over heads) used only to
    show that the fixtures discriminate between them.
    """
    c = CONFIG
    eps, hd = c["rms_norm_eps"], c["head_dim"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    t = {k: v.astype(np.float64) for k, v in tensors.items()}
    x = t["model.embed_tokens.weight"][ids]
    seq = len(ids)
    mask = np.triu(np.full((seq, seq), -np.inf), k=1)
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = rms_norm(x, t[p + "input_layernorm.weight"], eps)
        q_flat = h @ t[p + "self_attn.q_proj.weight"].T
        k_flat = h @ t[p + "self_attn.k_proj.weight"].T
        v = (h @ t[p + "self_attn.v_proj.weight"].T).reshape(seq, nkv, hd)
        qn, kn = t[p + "self_attn.q_norm.weight"], t[p + "self_attn.k_norm.weight"]
        if qk_norm == "whole_projection":
            q = rms_norm(q_flat, np.tile(qn, nh), eps).reshape(seq, nh, hd)
            k = rms_norm(k_flat, np.tile(kn, nkv), eps).reshape(seq, nkv, hd)
            q, k = rope_neox(q, c["rope_theta"]), rope_neox(k, c["rope_theta"])
        else:
            q, k = q_flat.reshape(seq, nh, hd), k_flat.reshape(seq, nkv, hd)
            if qk_norm == "per_head_before_rope":
                q, k = rms_norm(q, qn, eps), rms_norm(k, kn, eps)
                q, k = rope_neox(q, c["rope_theta"]), rope_neox(k, c["rope_theta"])
            elif qk_norm == "per_head_after_rope":
                q, k = rope_neox(q, c["rope_theta"]), rope_neox(k, c["rope_theta"])
                q, k = rms_norm(q, qn, eps), rms_norm(k, kn, eps)
            else:
                raise ValueError(qk_norm)
        group = nh // nkv
        out = np.empty((seq, nh, hd))
        for head in range(nh):
            kv = head // group  # GQA: query head h uses kv head h // (nh / nkv)
            scores = q[:, head, :] @ k[:, kv, :].T / np.sqrt(hd) + mask
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            scores /= scores.sum(axis=-1, keepdims=True)
            out[:, head, :] = scores @ v[:, kv, :]
        x = x + out.reshape(seq, nh * hd) @ t[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, t[p + "post_attention_layernorm.weight"], eps)
        gate = h @ t[p + "mlp.gate_proj.weight"].T
        up = h @ t[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, t["model.norm.weight"], eps)
    return x @ t["lm_head.weight"].T


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    import torch
    import transformers
    from safetensors.numpy import load_file

    model = build_model()
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    # generation_config.json carries nothing MIRAGE needs.
    (out_dir / "generation_config.json").unlink(missing_ok=True)

    rng = np.random.default_rng(SEED)
    sequences = [rng.integers(0, CONFIG["vocab_size"], size=n).tolist() for n in SEQUENCE_LENGTHS]

    tensors = load_file(str(out_dir / "model.safetensors"))
    records, blobs = [], []
    offset = 0
    for index, ids in enumerate(sequences):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].to(torch.float32).numpy()
        reference = numpy_forward(tensors, ids)
        numpy_err = float(np.max(np.abs(reference - logits)))
        if numpy_err > 1e-4:
            sys.exit(f"sequence {index}: numpy forward disagrees with torch by {numpy_err}")
        for wrong in ("per_head_after_rope", "whole_projection"):
            gap = float(np.max(np.abs(numpy_forward(tensors, ids, wrong) - logits)))
            if gap < 1e-2:
                sys.exit(f"sequence {index}: wrong QK-norm order {wrong} is not distinguishable ({gap})")
            print(f"seq {index}: QK-norm {wrong} would differ by up to {gap:.3f}")
        print(
            f"seq {index}: {len(ids)} tokens, logits std {logits.std():.3f}, "
            f"max |numpy - torch| {numpy_err:.2e}"
        )
        blobs.append(logits.astype("<f4").tobytes())
        records.append(
            {
                "token_ids": ids,
                "logits_offset_bytes": offset,
                "positions": len(ids),
                "argmax": logits.argmax(axis=-1).tolist(),
                "max_abs_numpy_vs_torch": numpy_err,
            }
        )
        offset += len(blobs[-1])
    (out_dir / "logits.f32.bin").write_bytes(b"".join(blobs))

    shapes = {name: list(value.shape) for name, value in sorted(tensors.items())}
    document = {
        "generator": "scripts/gen_qwen3_tiny.py",
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "seed": SEED,
        "init_std": INIT_STD,
        "vocab_size": CONFIG["vocab_size"],
        "logits_file": "logits.f32.bin",
        "logits_dtype": "f32 little-endian, row-major [position][vocab]",
        "sequences": records,
        "tensor_shapes": shapes,
    }
    (out_dir / "reference.json").write_text(json.dumps(document, indent=1) + "\n")
    size = (out_dir / "model.safetensors").stat().st_size
    print(f"wrote {out_dir} (model.safetensors {size} bytes)")


if __name__ == "__main__":
    main()
