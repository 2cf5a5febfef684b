#!/usr/bin/env python3
"""Write the reference chat-template renderings that crates/mirage-tokenizer/tests/tokenizer.rs compares
against: transformers' `apply_chat_template(..., tokenize=False)` on a tokenizer built from each GGUF
(`tokenizer.chat_template` from the file, rendered by Python jinja2), plus the ids of the rendered text.

Usage: python3 scripts/gen_chat_fixtures.py   (from the repository root; needs models/, run
`cargo xtask fetch-models` first). Output: crates/mirage-tokenizer/tests/fixtures/chat.json.
"""
import json
import os
import sys

from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")
OUT = os.path.join(ROOT, "crates", "mirage-tokenizer", "tests", "fixtures", "chat.json")

MODEL_FILES = {
    "smollm2": "smollm2-135m-instruct-q4_1.gguf",
    "qwen2.5-coder": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
}

CONVERSATIONS = [
    {
        "name": "system_and_user",
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "What is 2 + 2?"},
        ],
    },
    {
        "name": "user_only_default_system",
        "messages": [{"role": "user", "content": "Write a haiku about Rust.\nMake it rhyme."}],
    },
    {
        "name": "multi_turn",
        "messages": [
            {"role": "system", "content": "You help with code."},
            {"role": "user", "content": "How do I reverse a list in Python?"},
            {"role": "assistant", "content": "Use `xs[::-1]` or `xs.reverse()`."},
            {"role": "user", "content": "And in Rust? Ünïcödé 😀 too."},
        ],
    },
    {
        "name": "user_assistant_no_system",
        "messages": [
            {"role": "user", "content": "  spaced  "},
            {"role": "assistant", "content": "ok\n\n"},
        ],
    },
]


def main():
    out = {"generator": "scripts/gen_chat_fixtures.py", "models": {}}
    for name, file in MODEL_FILES.items():
        path = os.path.join(MODELS, file)
        if not os.path.exists(path):
            sys.exit(f"missing {path}: run `cargo xtask fetch-models`")
        tok = AutoTokenizer.from_pretrained(MODELS, gguf_file=file)
        cases = []
        for conv in CONVERSATIONS:
            for add_generation_prompt in (False, True):
                text = tok.apply_chat_template(
                    conv["messages"], tokenize=False, add_generation_prompt=add_generation_prompt
                )
                cases.append(
                    {
                        "name": conv["name"],
                        "messages": conv["messages"],
                        "add_generation_prompt": add_generation_prompt,
                        "rendered": text,
                        "ids": tok.encode(text, add_special_tokens=False),
                    }
                )
        out["models"][name] = {"file": file, "cases": cases}
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
