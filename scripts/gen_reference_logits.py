#!/usr/bin/env python3
"""Generate independent reference logits for the two real GGUF models.

transformers loads each model straight from its GGUF file (it dequantizes every tensor to f32 with
the `gguf` package) and runs it in float32 on the CPU.  That is an implementation of the model
graph and of the dequantizers which shares no code with MIRAGE, so MIRAGE's runtime tests compare
against these fixtures.  The format is documented in
crates/mirage-runtime/tests/fixtures/reference/FORMAT.md.

Usage:  python3 scripts/gen_reference_logits.py [--models-dir models] [--out DIR] [--only smollm2|qwen2]

Needs torch, transformers (>= 4.46, GGUF loading), accelerate, gguf, numpy.  Runs in a few minutes
on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "crates" / "mirage-runtime" / "tests" / "fixtures" / "reference"

MODELS = {
    "smollm2": "smollm2-135m-instruct-q4_1.gguf",
    "qwen2": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
}

# Both models use the ChatML template, so the same chat prompt is valid for both.  It is written
# out as text (not produced by apply_chat_template) so that the fixture does not depend on each
# GGUF's embedded template or default system prompt.
CHAT_QUESTION = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nExplain in a few sentences why the sky is blue.<|im_end|>\n"
    "<|im_start|>assistant\n"
)

# (name, text, greedy?) -- prose, code, a chat question, a list, non-English text.
PROMPTS = [
    (
        "prose",
        "The capital of France is Paris, a city known for its museums, its cafés and the river "
        "Seine that runs through its centre. Every year, millions of visitors",
        True,
    ),
    (
        "code",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n"
        "        return n\n    a, b = 0, 1\n    for _ in range(n - 1):\n",
        False,
    ),
    ("chat_question", CHAT_QUESTION, True),
    (
        "list",
        "Shopping list for the weekend:\n1. eggs\n2. whole milk\n3. flour\n4. butter\n5.",
        False,
    ),
    (
        "non_english",
        "La vie est belle quand le soleil brille sur les montagnes. "
        "Die Katze schläft auf dem Sofa. 東京は日本の首都です。",
        False,
    ),
]

TOP_K = 5
GREEDY_STEPS = 64
GREEDY_TOP = 2


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def floats(values) -> list[float]:
    """f32 values as JSON floats; float(np.float32) round-trips the f32 exactly."""
    return [float(v) for v in values]


def generate_model(key: str, models_dir: Path, out_root: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    file_name = MODELS[key]
    model_path = models_dir / file_name
    if not model_path.is_file():
        sys.exit(f"{model_path} is missing: run `cargo xtask fetch-models`")

    tokenizer = AutoTokenizer.from_pretrained(str(models_dir), gguf_file=file_name)
    model = AutoModelForCausalLM.from_pretrained(
        str(models_dir), gguf_file=file_name, dtype=torch.float32
    )
    model.eval()

    # Which matrix is the LM head matters for matching llama.cpp: SmolLM2's GGUF has no
    # output.weight (tied to token_embd), Qwen2.5's GGUF carries a separate Q8_0 output.weight.
    lm_head_is_embedding = bool(
        torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    )

    # Sanity check of the reference itself before writing anything.
    probe = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        probe_out = model.generate(probe, max_new_tokens=8, do_sample=False)
    probe_text = tokenizer.decode(probe_out[0][probe.shape[1]:])
    print(f"[{key}] sanity: 'The capital of France is' -> {probe_text!r}")
    if "Paris" not in probe_text:
        sys.exit(f"[{key}] reference model looks broken: {probe_text!r}")

    out_dir = out_root / key
    out_dir.mkdir(parents=True, exist_ok=True)

    bos_id = tokenizer.bos_token_id
    # Plain text that cannot start with a special token: does the tokenizer prepend BOS?
    adds_bos = tokenizer("hello world").input_ids[0] == bos_id
    prompt_records = []
    vocab_size = None
    for name, text, greedy in PROMPTS:
        ids = tokenizer(text, return_tensors="pt").input_ids
        n = ids.shape[1]
        if not 16 <= n <= 64:
            sys.exit(f"[{key}] prompt {name!r} has {n} tokens, want 16..64")
        with torch.no_grad():
            logits = model(ids).logits[0].to(torch.float32)  # [n, vocab]
        vocab_size = logits.shape[1]
        top = torch.topk(logits, TOP_K, dim=-1)
        lse = torch.logsumexp(logits, dim=-1)

        last = logits[-1].numpy().astype("<f2")
        bin_name = f"{name}.last_logits.f16.bin"
        (out_dir / bin_name).write_bytes(last.tobytes())

        record = {
            "name": name,
            "text": text,
            "token_ids": ids[0].tolist(),
            "top5_ids": top.indices.tolist(),
            "top5_logits": [floats(row) for row in top.values.numpy()],
            "logsumexp": floats(lse.numpy()),
            "last_logits_file": bin_name,
            "greedy": None,
        }
        if greedy:
            record["greedy"] = greedy_continuation(model, ids)
            check_greedy_without_cache(model, ids, record["greedy"], f"{key}/{name}")
            decoded = tokenizer.decode(record["greedy"]["ids"])
            record["greedy"]["text"] = decoded
            print(f"[{key}] greedy {name}: {decoded!r}")
        prompt_records.append(record)
        print(f"[{key}] {name}: {n} tokens, last argmax {top.indices[-1, 0].item()}")

    document = {
        "model_file": file_name,
        "model_sha256": sha256_of(model_path),
        "generator": "scripts/gen_reference_logits.py",
        "reference": "transformers AutoModelForCausalLM loaded from the GGUF (gguf-package "
        "dequantization), float32, CPU",
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "gguf": importlib.metadata.version("gguf"),
            "numpy": np.__version__,
        },
        "vocab_size": vocab_size,
        "bos_token_id": bos_id,
        "adds_bos": adds_bos,
        "lm_head_is_token_embd": lm_head_is_embedding,
        "top_k": TOP_K,
        "greedy_steps": GREEDY_STEPS,
        "prompts": prompt_records,
    }
    (out_dir / "reference.json").write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n")
    print(f"[{key}] wrote {out_dir}")


def greedy_continuation(model, ids) -> dict:
    """Greedy decoding for GREEDY_STEPS tokens with a KV cache, never stopping at EOS.

    generate() is avoided on purpose: forcing a fixed length there needs min_new_tokens, which
    edits the logits (EOS masked) and would change the greedy path.
    """
    import torch

    out_ids, top_ids, top_logits = [], [], []
    with torch.no_grad():
        result = model(ids, use_cache=True)
        past = result.past_key_values
        next_logits = result.logits[0, -1]
        for _ in range(GREEDY_STEPS):
            top = torch.topk(next_logits, GREEDY_TOP)
            token = int(top.indices[0])
            out_ids.append(token)
            top_ids.append(top.indices.tolist())
            top_logits.append(floats(top.values.numpy()))
            result = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past = result.past_key_values
            next_logits = result.logits[0, -1]
    return {"ids": out_ids, "top2_ids": top_ids, "top2_logits": top_logits}


def check_greedy_without_cache(model, ids, greedy: dict, label: str) -> None:
    """Re-run prompt + continuation in one uncached forward pass; each greedy pick must be the
    argmax there too (up to a near-tie), so the KV-cache path of the reference is not suspect."""
    import torch

    full = torch.cat([ids, torch.tensor([greedy["ids"][:-1]])], dim=1)
    with torch.no_grad():
        logits = model(full).logits[0, ids.shape[1] - 1 :]
    for step, token in enumerate(greedy["ids"]):
        row = logits[step]
        best = int(torch.argmax(row))
        if best != token and float(row[best] - row[token]) > 1e-3:
            sys.exit(f"[{label}] step {step}: cached greedy picked {token}, uncached argmax {best}")
    worst = max(
        float(torch.max(torch.abs(logits[s, torch.tensor(greedy["top2_ids"][s])] -
                                  torch.tensor(greedy["top2_logits"][s]))))
        for s in range(len(greedy["ids"]))
    )
    print(f"[{label}] greedy verified without cache, max |top2 logit diff| {worst:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=REPO_ROOT / "models")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--only", choices=sorted(MODELS), action="append")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    for key in args.only or list(MODELS):
        generate_model(key, args.models_dir.resolve(), args.out)


if __name__ == "__main__":
    main()
