#!/usr/bin/env python3
"""Record what llama.cpp computes on Gemma-3-270M, for crates/mirage-runtime/tests/gemma3.rs.

llama.cpp (an independent implementation of the gemma3 graph) runs the real model
models/gemma-3-270m-q4_k_m.gguf on the CPU with flash attention off (`-fa off`: its flash-attention
kernel rounds the queries to f16, which moves near-tied greedy choices; the plain path computes the
attention in f32 like MIRAGE) and its default f16 KV cache (MIRAGE's `--kv-f16`):

- greedy continuations (`llama-completion --temp 0`) of a few short prompts, and of a prompt longer
  than the 512-position sliding window (the first bytes of the GPL-3 text), so that the local
  layers' window matters;
- the perplexity of one 1024-token window of the GPL-3 text (`llama-perplexity -c 1024 --chunks 1`):
  its scored half sits past the sliding window.

Usage (from the repository root; llama.cpp's binaries from scripts/build_llamacpp.sh):
    python3 scripts/gen_gemma3_fixtures.py [--bin target/llamacpp/build/bin]
Output: crates/mirage-runtime/tests/fixtures/gemma3_llamacpp.json
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "gemma-3-270m-q4_k_m.gguf")
OUT = os.path.join(ROOT, "crates", "mirage-runtime", "tests", "fixtures", "gemma3_llamacpp.json")
GPL = "/usr/share/common-licenses/GPL-3"
# About 640 Gemma tokens: past the 512-position window of the sliding layers.
LONG_PROMPT_BYTES = 2900

PROMPTS = [
    ("The capital of France is", 32),
    ("def fibonacci(n):", 32),
    ("The three primary colors are", 24),
]
COMMON = ["-m", MODEL, "-t", "2", "-fa", "off", "--temp", "0", "--seed", "1"]


def run(cmd):
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return done.stdout, done.stderr


def complete(bin_dir, prompt_args, n):
    out, _ = run([os.path.join(bin_dir, "llama-completion"), *COMMON, *prompt_args, "-n", str(n),
                  "-no-cnv", "--no-display-prompt", "--no-escape"])
    # llama-completion ends its output with "\n\n", after " [end of text]\n" when the model
    # produced an end-of-generation token.
    if not out.endswith("\n\n"):
        sys.exit(f"unexpected llama-completion output {out!r}")
    out = out[:-2]
    return out.removesuffix(" [end of text]\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "llamacpp", "build", "bin"))
    args = ap.parse_args()
    if not os.path.exists(MODEL):
        sys.exit(f"missing {MODEL}: run `cargo xtask fetch-models --only gemma3-270m`")
    _, version = run([os.path.join(args.bin, "llama-completion"), "--version"])
    version = " ".join(version.split())
    greedy = [{"prompt": p, "n": n, "text": complete(args.bin, ["-p", p], n)} for p, n in PROMPTS]
    long_prompt = open(GPL, "rb").read()[:LONG_PROMPT_BYTES].decode("utf-8")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(long_prompt)
        prompt_file = f.name
    try:
        greedy.append({
            "prompt_gpl_bytes": LONG_PROMPT_BYTES,
            "n": 16,
            "text": complete(args.bin, ["-f", prompt_file], 16),
        })
    finally:
        os.unlink(prompt_file)
    _, log = run([os.path.join(args.bin, "llama-perplexity"), "-m", MODEL, "-t", "2", "-fa", "off",
                  "-f", GPL, "-c", "1024", "--chunks", "1"])
    ppl = float(re.search(r"Final estimate: PPL = ([0-9.]+)", log).group(1))
    fixture = {
        "generator": "scripts/gen_gemma3_fixtures.py",
        "llama_cpp": version,
        "settings": "CPU, -fa off, f16 KV cache (llama.cpp's default), greedy",
        "model": os.path.basename(MODEL),
        "greedy": greedy,
        "perplexity": {"text": GPL, "ctx": 1024, "chunks": 1, "ppl": ppl},
    }
    with open(OUT + ".tmp", "w", encoding="utf-8") as out:
        json.dump(fixture, out, ensure_ascii=False, indent=1)
        out.write("\n")
    os.replace(OUT + ".tmp", OUT)
    print(json.dumps(fixture, ensure_ascii=False, indent=1))


if __name__ == "__main__":
    main()
