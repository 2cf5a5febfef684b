#!/usr/bin/env python3
"""Fixtures for crates/mirage-gguf/tests: an independent view of the two real
GGUF models (through the `gguf` package's GGUFReader) and a tiny safetensors
file (written by the `safetensors` package) with its expected values.

Usage: python3 scripts/gen_format_fixtures.py   (from the repository root;
needs gguf, numpy, safetensors and torch; models from `cargo xtask fetch-models`)

Outputs, all small:
  crates/mirage-gguf/tests/fixtures/<model>.gguf.json
  crates/mirage-gguf/tests/fixtures/tiny.safetensors
  crates/mirage-gguf/tests/fixtures/tiny.safetensors.json
  crates/mirage-gguf/tests/fixtures/tiny_py.gguf   (written by gguf.GGUFWriter;
      also the seed of the fuzz corpus, fuzz/corpus/gguf_parse/)
"""
import hashlib
import json
import struct
from pathlib import Path

import gguf

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
OUT = ROOT / "crates" / "mirage-gguf" / "tests" / "fixtures"

MODEL_FILES = [
    "smollm2-135m-instruct-q4_1.gguf",
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
]


def scalar_json(v):
    """A metadata scalar as JSON; floats as their exact f64 value."""
    if isinstance(v, (bool, int, str)):
        return v
    return float(v)


def strings_sha256(items):
    """sha256 over each string as GGUF stores it: u64 LE byte length + UTF-8."""
    h = hashlib.sha256()
    for s in items:
        b = s.encode("utf-8")
        h.update(struct.pack("<Q", len(b)))
        h.update(b)
    return h.hexdigest()


def ints_sha256(items):
    """sha256 over the integers as i64 LE."""
    h = hashlib.sha256()
    for x in items:
        h.update(struct.pack("<q", int(x)))
    return h.hexdigest()


def dump_model(path: Path) -> dict:
    r = gguf.GGUFReader(str(path))
    fields = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    scalars, arrays = {}, {}
    for k, f in fields.items():
        t = f.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            vals = f.contents()
            entry = {"elem_type": int(f.types[1]), "len": len(vals)}
            if f.types[1] == gguf.GGUFValueType.STRING:
                entry["first"] = vals[:5]
                entry["last"] = vals[-5:]
                entry["sha256"] = strings_sha256(vals)
            elif f.types[1] in (gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64):
                entry["first"] = [float(x) for x in vals[:5]]
            else:
                entry["first"] = [int(x) for x in vals[:5]]
                entry["sha256"] = ints_sha256(vals)
            arrays[k] = entry
        else:
            scalars[k] = {"type": int(t), "value": scalar_json(f.contents())}
    tensors = [
        {
            "name": t.name,
            "type": int(t.tensor_type),
            # GGUFReader keeps ggml order (shape[0] is the row length).
            "dims": [int(d) for d in t.shape],
            "offset": int(t.data_offset - r.data_offset),
            "n_bytes": int(t.n_bytes),
        }
        for t in r.tensors
    ]
    return {
        "file": path.name,
        "file_len": path.stat().st_size,
        "version": int(r.fields["GGUF.version"].contents()),
        "n_kv": len(fields),
        "n_tensors": len(r.tensors),
        "alignment": int(r.alignment),
        "data_offset": int(r.data_offset),
        "key_order": list(fields.keys()),
        "scalars": scalars,
        "arrays": arrays,
        "tensors": tensors,
    }


def tiny_safetensors():
    import torch
    from safetensors.torch import save_file

    f32 = torch.arange(6, dtype=torch.float32).reshape(2, 3) * 0.5 - 1.0
    f16 = torch.tensor([1.0, -2.5, 65504.0, 0.000061035156], dtype=torch.float16)
    bf16 = (torch.arange(12, dtype=torch.float32).reshape(3, 2, 2) * 1.25 - 3.0).to(torch.bfloat16)
    tensors = {"a.f32": f32, "b.f16": f16, "c.bf16": bf16}
    path = OUT / "tiny.safetensors"
    save_file(tensors, str(path), metadata={"note": "mirage-gguf test fixture"})
    expect = {
        name: {
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            # Values as exactly representable f32, row-major.
            "values": [float(x) for x in t.to(torch.float32).flatten().tolist()],
        }
        for name, t in tensors.items()
    }
    (OUT / "tiny.safetensors.json").write_text(json.dumps(expect, indent=1) + "\n")


def tiny_gguf():
    """A small GGUF written by the independent Python writer: every metadata
    value type, a nested array, F32/F16/Q8_0 tensors. tests/format.rs checks
    these exact values."""
    import shutil

    import numpy as np

    path = OUT / "tiny_py.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    T = gguf.GGUFValueType
    w.add_key_value("t.u8", 200, T.UINT8)
    w.add_key_value("t.i8", -100, T.INT8)
    w.add_key_value("t.u16", 60000, T.UINT16)
    w.add_key_value("t.i16", -30000, T.INT16)
    w.add_key_value("t.u32", 4000000000, T.UINT32)
    w.add_key_value("t.i32", -2000000000, T.INT32)
    w.add_key_value("t.u64", 2**63 + 5, T.UINT64)
    w.add_key_value("t.i64", -(2**62), T.INT64)
    w.add_key_value("t.f32", 0.15625, T.FLOAT32)
    w.add_key_value("t.f64", -1e300, T.FLOAT64)
    w.add_key_value("t.bool", True, T.BOOL)
    w.add_key_value("t.str", "héllo ✓", T.STRING)
    w.add_key_value("t.strs", ["a", "", "ü"], T.ARRAY, sub_type=T.STRING)
    w.add_key_value("t.nested", [[1, 2], [3], [4, 5, 6]], T.ARRAY, sub_type=T.ARRAY)
    w.add_key_value("t.f32s", [0.5, -1.5], T.ARRAY, sub_type=T.FLOAT32)
    a = (np.arange(8, dtype=np.float32) - 3.5).reshape(2, 4)
    w.add_tensor("a.f32", a)
    b = np.array([1.0, -2.0, 0.25, 1024.0], dtype=np.float16)
    w.add_tensor("b.f16", b)
    c = (np.arange(64, dtype=np.float32).reshape(2, 32) / 8.0 - 4.0)
    cq = gguf.quants.quantize(c, gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c.q8_0", cq, raw_shape=cq.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    corpus = ROOT / "fuzz" / "corpus" / "gguf_parse"
    corpus.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, corpus / "seed-tiny_py.gguf")
    # A second seed: metadata only, alignment 64, nested string arrays.
    w = gguf.GGUFWriter(str(corpus / "seed-kv-only.gguf"), arch="qwen2")
    w.add_uint32("general.alignment", 64)
    w.add_key_value("n.strs", [["ab", "c"], ["d"]], T.ARRAY, sub_type=T.ARRAY)
    w.add_key_value("n.f64", [1.5, 2.5], T.ARRAY, sub_type=T.FLOAT64)
    w.add_bool("n.flag", False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        path = MODELS / name
        if not path.exists():
            raise SystemExit(f"{path} missing: run `cargo xtask fetch-models`")
        d = dump_model(path)
        (OUT / f"{name}.json").write_text(json.dumps(d, indent=0, ensure_ascii=False) + "\n")
    tiny_safetensors()
    tiny_gguf()
    for p in sorted(OUT.iterdir()):
        print(f"{p.relative_to(ROOT)}: {p.stat().st_size} bytes")


if __name__ == "__main__":
    main()
