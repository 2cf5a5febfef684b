#!/usr/bin/env python3
"""Write the reference token ids that crates/mirage-tokenizer/tests/sentencepiece.rs compares against.

Two SentencePiece vocabularies, each with an independent reference implementation:

1. Gemma-3-270M (models/gemma-3-270m-q4_k_m.gguf, `tokenizer.ggml.model` = "llama": SentencePiece
   BPE, 262,144 tokens, byte fallback). The GGUF's pieces, scores and types are written back into a
   SentencePiece ModelProto (BPE, byte_fallback, identity normalizer, no dummy prefix: Gemma's own
   settings, which the GGUF records as add_space_prefix = false), and transformers'
   GemmaTokenizerFast converts that model into a Hugging Face `tokenizers` BPE with byte fallback and
   the user-defined pieces as added tokens, which is how Gemma's tokenizer.json is built. Its ids
   are the expectation. (transformers' own GGUF loader is not used: it needs torch, and for Gemma 3
   it builds a Unigram model, which segments "Hello world" as Hello/▁w/or/ld.) The `sentencepiece`
   library's ids for the same model are kept as "ids_sentencepiece" where they differ: SentencePiece
   escapes spaces before it looks for user-defined pieces, so Gemma's whitespace-run tokens ("  ",
   "\\t\\t", ...) never match there, while llama.cpp and Hugging Face split them out first (and
   so does MIRAGE).

2. A real Unigram vocabulary: test/test_model.model from the `sentencepiece` sdist on PyPI (1,000
   pieces trained on "Botchan", NFKC precompiled charsmap, dummy prefix, extra-whitespace removal).
   It is written as a tokenizer-only GGUF the way llama.cpp's converter writes T5 vocabularies
   (`tokenizer.ggml.model` = "t5", scores, types, add_space_prefix, remove_extra_whitespaces,
   precompiled_charsmap), committed as a fixture (~260 KB), and the `sentencepiece` library's
   encode/decode of each text are the expectation.

Usage (from the repository root, after `cargo xtask fetch-models --only gemma3-270m`):
    pip install gguf numpy sentencepiece protobuf tokenizers "transformers<5"
    python3 scripts/gen_sentencepiece_fixtures.py
Outputs: crates/mirage-tokenizer/tests/fixtures/sentencepiece.json and
crates/mirage-tokenizer/tests/fixtures/unigram-botchan.gguf.
"""
import glob
import hashlib
import json
import os
import struct
import subprocess
import sys
import tarfile
import tempfile

import gguf
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb
from transformers import GemmaTokenizerFast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "crates", "mirage-tokenizer", "tests", "fixtures")
GEMMA = os.path.join(ROOT, "models", "gemma-3-270m-q4_k_m.gguf")
GPL = "/usr/share/common-licenses/GPL-3"
GPL_BYTES = 20000
SENTENCEPIECE_SDIST = "sentencepiece==0.2.1"

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
    "ｆｕｌｌｗｉｄｔｈ ＡＢＣ　１２３ ﬁ ligature ㌔ ① Ⅻ",
    "مرحبا بالعالم، كيف حالك؟ שלום עולם",
    "Москва — столица России. Ελληνικά γράμματα.",
    "emoji 😀😃 family 👨‍👩‍👧‍👦 thumbs 👍🏽 flag 🇩🇪 heart ❤️ rainbow flag 🏳️‍🌈",
    "rare: \u0378 \U0001f9ff \U00010348 \ue000 \U000e0041 \u2028 end",
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
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> <pad> <unk> <mask>",
    "<start_of_turn <end_of_turn <<start_of_turn>> [multimodal] <0x41>",
    "<h1>Title</h1><div class=\"x\">body</div>",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "https://example.com/path?query=1&x=y#frag `code` **bold** _it_ [link](url)",
    "!!!??? ... --- *** ### $$$ %%% ^^^ &&& ((( ))) {{{ }}}",
    "MixedCASE camelCase snake_case SCREAMING_CASE kebab-case",
    "▁ already escaped ▁▁ marks",
]


def ids_hash(ids):
    return hashlib.sha256(b"".join(struct.pack("<I", i) for i in ids)).hexdigest()


def gguf_vocab(path):
    """tokens, types, scores and the flags of a GGUF's tokenizer."""
    reader = gguf.GGUFReader(path)
    f = reader.fields
    tokens = [bytes(f["tokenizer.ggml.tokens"].parts[i]).decode("utf-8") for i in f["tokenizer.ggml.tokens"].data]
    types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
    scores = [float(f["tokenizer.ggml.scores"].parts[i][0]) for i in f["tokenizer.ggml.scores"].data]
    flags = {}
    for key in ("add_space_prefix", "add_bos_token", "add_eos_token"):
        field = f.get("tokenizer.ggml." + key)
        if field is not None:
            flags[key] = bool(field.parts[field.data[0]][0])
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        field = f.get("tokenizer.ggml." + key)
        if field is not None:
            flags[key] = int(field.parts[field.data[0]][0])
    return tokens, types, scores, flags


def gemma_cases(tmp):
    if not os.path.exists(GEMMA):
        sys.exit(f"missing {GEMMA}: run `cargo xtask fetch-models --only gemma3-270m`")
    tokens, types, scores, flags = gguf_vocab(GEMMA)
    assert flags["add_space_prefix"] is False and flags["add_bos_token"] is True
    proto = pb.ModelProto()
    for text, ty, score in zip(tokens, types, scores):
        piece = proto.pieces.add()
        piece.piece, piece.type, piece.score = text, ty, score
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_id = flags["unknown_token_id"]
    proto.trainer_spec.bos_id = flags["bos_token_id"]
    proto.trainer_spec.eos_id = flags["eos_token_id"]
    proto.trainer_spec.pad_id = flags["padding_token_id"]
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    model_path = os.path.join(tmp, "gemma.model")
    with open(model_path, "wb") as out:
        out.write(proto.SerializeToString())
    sp = spm.SentencePieceProcessor(model_file=model_path)
    hf = GemmaTokenizerFast(vocab_file=model_path, from_slow=True)
    cases = []
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        case = {
            "text": text,
            "ids": ids,
            "ids_no_parse_special": hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"],
            "ids_add_special": hf.encode(text, add_special_tokens=True),
            "decoded": hf.decode(ids, skip_special_tokens=False),
            "decoded_skip_special": hf.decode(ids, skip_special_tokens=True),
        }
        spm_ids = sp.encode(text)
        if spm_ids != case["ids_no_parse_special"]:
            case["ids_sentencepiece"] = spm_ids
        cases.append(case)
    gpl_text = open(GPL, "rb").read()[:GPL_BYTES].decode("utf-8")
    gpl_ids = hf.encode(gpl_text, add_special_tokens=False)
    return {
        "file": os.path.basename(GEMMA),
        "reference": "transformers GemmaTokenizerFast (Hugging Face tokenizers BPE) from a SentencePiece model rebuilt from the GGUF",
        "vocab_size": len(tokens),
        "cases": cases,
        "gpl_head": gpl_ids[:64],
        "gpl_len": len(gpl_ids),
        "gpl_sha256": ids_hash(gpl_ids),
    }


def unigram_model(tmp):
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
         SENTENCEPIECE_SDIST, "-d", tmp],
        check=True,
    )
    sdist = glob.glob(os.path.join(tmp, "sentencepiece-*.tar.gz"))[0]
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/test/test_model.model"))
        data = tar.extractfile(member).read()
    path = os.path.join(tmp, "test_model.model")
    with open(path, "wb") as out:
        out.write(data)
    return path


def unigram_cases(tmp):
    model_path = unigram_model(tmp)
    proto = pb.ModelProto()
    proto.ParseFromString(open(model_path, "rb").read())
    assert proto.trainer_spec.model_type == pb.TrainerSpec.UNIGRAM
    sp = spm.SentencePieceProcessor(model_file=model_path)
    out_path = os.path.join(FIXTURES, "unigram-botchan.gguf")
    writer = gguf.GGUFWriter(out_path + ".tmp", "t5")
    writer.add_tokenizer_model("t5")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([p.piece.encode("utf-8") for p in proto.pieces])
    writer.add_token_scores([p.score for p in proto.pieces])
    writer.add_token_types([p.type for p in proto.pieces])
    writer.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)
    writer.add_remove_extra_whitespaces(proto.normalizer_spec.remove_extra_whitespaces)
    writer.add_precompiled_charsmap(proto.normalizer_spec.precompiled_charsmap)
    writer.add_unk_token_id(sp.unk_id())
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(out_path + ".tmp", out_path)
    cases = []
    for text in TEXTS:
        ids = sp.encode(text)
        cases.append({"text": text, "ids": ids, "decoded": sp.decode(ids)})
    gpl_text = open(GPL, "rb").read()[:GPL_BYTES].decode("utf-8")
    gpl_ids = sp.encode(gpl_text)
    return {
        "file": os.path.basename(out_path),
        "source": f"test/test_model.model of the {SENTENCEPIECE_SDIST} sdist",
        "reference": f"sentencepiece {spm.__version__} SentencePieceProcessor.encode / decode",
        "vocab_size": len(proto.pieces),
        "cases": cases,
        "gpl_head": gpl_ids[:64],
        "gpl_len": len(gpl_ids),
        "gpl_sha256": ids_hash(gpl_ids),
    }


def main():
    with tempfile.TemporaryDirectory() as tmp:
        fixture = {
            "generator": "scripts/gen_sentencepiece_fixtures.py",
            "gpl": {"path": GPL, "bytes": GPL_BYTES},
            "gemma3": gemma_cases(tmp),
            "unigram": unigram_cases(tmp),
        }
    path = os.path.join(FIXTURES, "sentencepiece.json")
    with open(path + ".tmp", "w", encoding="utf-8") as out:
        json.dump(fixture, out, ensure_ascii=False, indent=1)
        out.write("\n")
    os.replace(path + ".tmp", path)
    print(f"wrote {path} ({os.path.getsize(path)} bytes) and unigram-botchan.gguf "
          f"({os.path.getsize(os.path.join(FIXTURES, 'unigram-botchan.gguf'))} bytes)")


if __name__ == "__main__":
    main()
