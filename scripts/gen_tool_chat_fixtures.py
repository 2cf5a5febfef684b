#!/usr/bin/env python3
"""Reference renderings of chat templates with tools, for crates/mirage-tokenizer/tests/tokenizer.rs.

Each GGUF's `tokenizer.chat_template` (read with the `gguf` package) is rendered by Python jinja2 in
the environment transformers builds for `apply_chat_template` (trim_blocks, lstrip_blocks,
`raise_exception`, and `tojson` as `json.dumps(x, ensure_ascii=False, indent=indent)`), with OpenAI-style
tools, an assistant tool call (arguments as an object, as transformers expects) and tool results.
Only templates that read `tools` are rendered (Qwen2.5's); the others get MIRAGE's documented
fallback, which the Rust test checks by construction.

Usage: python3 scripts/gen_tool_chat_fixtures.py   (from the repository root; needs models/).
Output: crates/mirage-tokenizer/tests/fixtures/chat_tools.json. Needs jinja2 and gguf.
"""
import json
import os

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from gguf import GGUFReader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "crates", "mirage-tokenizer", "tests", "fixtures", "chat_tools.json")
MODELS = {"qwen2.5-coder": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city. Ünïcödé \"quoted\" too.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "threshold": {"type": "number", "default": 0.5},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "now", "description": "The time.", "parameters": {"type": "object", "properties": {}}},
    },
]

CONVERSATIONS = [
    {"name": "tools_user", "messages": [{"role": "user", "content": "Weather in Paris?"}]},
    {
        "name": "tools_system_round_trip",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}},
                ],
            },
            {"role": "tool", "content": "{\"temp\": 21}"},
            {"role": "tool", "content": "{\"temp\": 25}"},
        ],
    },
]


def chat_template(path):
    r = GGUFReader(path)
    f = r.fields["tokenizer.chat_template"]
    return bytes(f.parts[f.data[0]]).decode("utf-8")


def render(source, messages, tools):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render(messages=messages, tools=tools, add_generation_prompt=True)


def main():
    out = {"tools": TOOLS, "models": {}}
    for key, file in MODELS.items():
        source = chat_template(os.path.join(ROOT, "models", file))
        out["models"][key] = {
            "file": file,
            "renderings": [
                {"name": c["name"], "messages": c["messages"], "text": render(source, c["messages"], TOOLS)}
                for c in CONVERSATIONS
            ],
        }
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
