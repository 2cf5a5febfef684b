#!/usr/bin/env python3
"""Write the reference token ids that crates/mirage-tokenizer/tests/tokenizer.rs compares against.

The reference is Hugging Face transformers building a tokenizer straight from each GGUF file
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)`, via the `gguf` package): an independent
implementation (the Rust `tokenizers` library behind it) of the same vocabulary and merges.

One correction: transformers' GGUF converter ignores `tokenizer.ggml.pre` and gives SmolLM2 the plain
GPT-2 ByteLevel pre-tokenizer, while SmolLM2's own tokenizer.json (and llama.cpp's "smollm" pre type)
first splits every digit (`Digits(individual_digits=True)`), then applies ByteLevel. The two differ on
e.g. "a  12" (whitespace run before a digit) and " ½". So for SmolLM2 the reference tokenizer is the
transformers one with its pre-tokenizer replaced by that Sequence; the ids the unmodified converter
gives are kept under "ids_transformers_gguf" where they differ, for the record (the tests do not use them).

Usage: python3 scripts/gen_tokenizer_fixtures.py   (from the repository root; needs models/, run
`cargo xtask fetch-models` first). Output: crates/mirage-tokenizer/tests/fixtures/tokenizer.json.
"""
import hashlib
import json
import os
import struct
import sys

from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")
OUT = os.path.join(ROOT, "crates", "mirage-tokenizer", "tests", "fixtures", "tokenizer.json")
GPL = "/usr/share/common-licenses/GPL-3"
GPL_BYTES = 20000

MODEL_FILES = {
    "smollm2": "smollm2-135m-instruct-q4_1.gguf",
    "qwen2.5-coder": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
}

TEXTS = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks were striking thirteen.",
    "It's they're we've I'm you'll he'd DON'T SHE'S o'clock rock'n'roll",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])\n",
    "fn main() {\n\tlet v: Vec<u32> = (0..10).map(|x| x * x).collect();\n\tprintln!(\"{:?}\", v);\n}\n",
    "Café naïve résumé façade Ærøskøbing Ångström crème brûlée",
    "e\u0301 combining accent, a\u00a0non-breaking space, zero\u200bwidth",
    "你好，世界。日本語のテキストです。한국어 문장입니다.",
    "مرحبا بالعالم، كيف حالك؟ שלום עולם",
    "Москва — столица России. Ελληνικά γράμματα.",
    "emoji 😀😃 family 👨‍👩‍👧‍👦 thumbs 👍🏽 flag 🇩🇪 heart ❤️ rainbow flag 🏳️‍🌈",
    "   leading spaces",
    "trailing spaces   ",
    "tabs\t\tand\ttabs\t",
    "\n\n\n",
    "paragraph one\n\n\nparagraph two\r\nwindows line\rcarriage",
    "a  \n  b   c    d \t e",
    "    indented\n        more indented\n  \n",
    "1234567890",
    "version  12 and\t\t7 and\n\n42 items",
    "pi is 3.14159 and e is 2.71828; 1,000,000 and 2^32 = 4294967296",
    "x² ½ Ⅻ ٣ ۴ ①",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "Hello<|im_end|>world<|endoftext|>",
    "<|im_start <|im_end| |im_end|> <<|im_end|>>",
    "<tool_call>{\"name\": \"f\"}</tool_call>",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "https://example.com/path?query=1&x=y#frag `code` **bold** _it_ [link](url)",
    "!!!??? ... --- *** ### $$$ %%% ^^^ &&& ((( ))) {{{ }}}",
    "MixedCASE camelCase snake_case SCREAMING_CASE kebab-case",
]

# SmolLM2's tokenizer.json pre-tokenizer (llama.cpp: "\p{N}" then the GPT-2 regex).
PRE_TOKENIZER_FIX = {
    "smollm2": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    ),
}


def ids_hash(ids):
    return hashlib.sha256(b"".join(struct.pack("<I", i) for i in ids)).hexdigest()


def main():
    gpl_text = open(GPL, "rb").read()[:GPL_BYTES].decode("utf-8")
    out = {
        "generator": "scripts/gen_tokenizer_fixtures.py",
        "reference": "transformers AutoTokenizer.from_pretrained(models, gguf_file=...)",
        "gpl": {"path": GPL, "bytes": GPL_BYTES},
        "models": {},
    }
    for name, file in MODEL_FILES.items():
        path = os.path.join(MODELS, file)
        if not os.path.exists(path):
            sys.exit(f"missing {path}: run `cargo xtask fetch-models`")
        tok = AutoTokenizer.from_pretrained(MODELS, gguf_file=file)
        converter_ids = {text: tok.encode(text, add_special_tokens=False) for text in TEXTS}
        if name in PRE_TOKENIZER_FIX:
            tok.backend_tokenizer.pre_tokenizer = PRE_TOKENIZER_FIX[name]()
        cases = []
        for text in TEXTS:
            ids = tok.encode(text, add_special_tokens=False)
            plain = tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            with_special = tok.encode(text, add_special_tokens=True)
            cases.append(
                {
                    "text": text,
                    "ids": ids,
                    "ids_no_parse_special": plain,
                    "ids_add_special": with_special,
                    "decoded": tok.decode(ids, skip_special_tokens=False),
                    "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
                }
            )
            if converter_ids[text] != ids:
                cases[-1]["ids_transformers_gguf"] = converter_ids[text]
        gpl_ids = tok.encode(gpl_text, add_special_tokens=False)
        out["models"][name] = {
            "file": file,
            "vocab_size": len(tok.get_vocab()),
            "bos": tok.bos_token_id,
            "eos": tok.eos_token_id,
            "pad": tok.pad_token_id,
            "pre_tokenizer": json.loads(tok.backend_tokenizer.to_str())["pre_tokenizer"],
            "cases": cases,
            "gpl_len": len(gpl_ids),
            "gpl_sha256": ids_hash(gpl_ids),
            "gpl_head": gpl_ids[:64],
        }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
