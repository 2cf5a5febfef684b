#!/usr/bin/env python3
"""Structured output, tools, log-probabilities and embeddings of a running mirage-server, driven with
the official `openai` Python package (the part of the OpenAI API a client reaches for after chat):

- `response_format` json_schema (strict) on varied prompts: every reply parses and validates against its
  schema (the `jsonschema` package); json_object parses as an object;
- a tool-call round trip (tools -> tool_calls -> tool message -> final answer), streaming and not, with
  tool_choice required, a named function, and none;
- `logprobs` / `top_logprobs` on chat (streaming too) and legacy completions: the tokens spell the text,
  greedy picks the top alternative, log-probabilities are <= 0;
- `/v1/embeddings` with a batch of inputs: unit vectors, similar texts closer than unrelated ones.

    python3 scripts/server_openai_structured_test.py --base-url http://127.0.0.1:8080/v1 [--prompts 20]

Prints one line per check and `openai structured: N passed, M failed`; exits non-zero on any failure.
"""
import argparse
import json
import math
import sys
import traceback

import jsonschema
from openai import OpenAI

SCHEMAS = [
    ("person", {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
                       "city": {"type": "string", "maxLength": 40}},
        "required": ["name", "age", "city"], "additionalProperties": False}),
    ("answer", {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no", "unsure"]}, "confidence": {"type": "number"}},
        "required": ["answer", "confidence"], "additionalProperties": False}),
    ("list", {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                 "minItems": 1, "maxItems": 4}},
        "required": ["items"], "additionalProperties": False}),
    ("book", {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 60}, "year": {"type": "integer"},
                       "genres": {"type": "array", "items": {"enum": ["fiction", "science", "history", "poetry"]},
                                  "maxItems": 3},
                       "available": {"type": "boolean"}},
        "required": ["title", "year", "genres", "available"], "additionalProperties": False}),
]
PROMPTS = [
    "Describe a software engineer from Berlin.", "Is the sky blue?", "List some fruits.",
    "Recommend a classic novel.", "Tell me about a teacher in Tokyo.", "Is water wet?",
    "Name a few programming languages.", "Suggest a book about space.", "Invent a chef from Lyon.",
    "Can penguins fly?", "What should I pack for a beach trip?", "Pick a poetry collection.",
    "Describe a retired pilot.", "Is 17 a prime number?", "Give me colors of the rainbow.",
    "Name a history book about Rome.", "Describe a musician from Lagos.", "Does ice float on water?",
    "List three planets.", "Choose a science book for children.",
]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                       "required": ["city"], "additionalProperties": False}}},
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--prompts", type=int, default=20, help="json_schema prompts (varied schemas and prompts)")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    results = {}

    def check(name):
        def wrap(fn):
            try:
                fn()
                results[name] = None
                print(f"ok   {name}")
            except Exception as e:  # noqa: BLE001 - report every failure
                results[name] = e
                print(f"FAIL {name}: {e!r}")
                traceback.print_exc()
            return fn
        return wrap

    @check(f"json_schema strict on {args.prompts} prompts validates")
    def _():
        bad = []
        for i in range(args.prompts):
            name, schema = SCHEMAS[i % len(SCHEMAS)]
            r = client.chat.completions.create(
                model=model, max_tokens=160, temperature=0.7 if i % 2 else 0, seed=i,
                messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + " Answer in JSON."}],
                response_format={"type": "json_schema",
                                 "json_schema": {"name": name, "schema": schema, "strict": True}})
            text = r.choices[0].message.content
            try:
                jsonschema.validate(json.loads(text), schema)
                assert r.choices[0].finish_reason == "stop", r.choices[0].finish_reason
            except Exception as e:  # noqa: BLE001
                bad.append((i, name, text, repr(e)))
        assert not bad, bad

    @check("json_object")
    def _():
        r = client.chat.completions.create(
            model=model, max_tokens=200, temperature=0, response_format={"type": "json_object"},
            messages=[{"role": "user", "content": "Give me a JSON object with the name and age of a cat."}])
        assert r.choices[0].finish_reason == "stop", (r.choices[0].finish_reason, r.choices[0].message.content)
        assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content

    question = [{"role": "user", "content": "What is the weather in Paris right now?"}]

    def tool_round_trip(stream: bool, choice):
        kw = dict(model=model, messages=question, tools=TOOLS, tool_choice=choice, max_tokens=80, temperature=0)
        if stream:
            calls, finish = {}, None
            for chunk in client.chat.completions.create(stream=True, **kw):
                for c in chunk.choices:
                    finish = c.finish_reason or finish
                    for tc in c.delta.tool_calls or []:
                        slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                        slot["id"] = tc.id or slot["id"]
                        if tc.function and tc.function.name:
                            slot["name"] += tc.function.name
                        if tc.function and tc.function.arguments:
                            slot["arguments"] += tc.function.arguments
            calls = [calls[k] for k in sorted(calls)]
        else:
            r = client.chat.completions.create(**kw)
            finish = r.choices[0].finish_reason
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for c in r.choices[0].message.tool_calls or []]
        assert finish == "tool_calls", finish
        assert calls, "no tool calls"
        for c in calls:
            assert c["id"], c
            assert c["name"] in ("get_weather", "get_time"), c
            assert isinstance(json.loads(c["arguments"]).get("city"), str), c
        if isinstance(choice, dict):
            assert all(c["name"] == choice["function"]["name"] for c in calls), calls
        messages = question + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls]},
        ] + [{"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"temperature_c": 18, "sky": "cloudy"})}
             for c in calls]
        final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                               max_tokens=48, temperature=0)
        msg = final.choices[0].message
        assert not msg.tool_calls and msg.content and msg.content.strip(), msg
        return calls

    @check("tool call round trip (required)")
    def _():
        tool_round_trip(False, "required")

    @check("tool call round trip streaming (required), same calls as not streaming")
    def _():
        a = tool_round_trip(False, "required")
        b = tool_round_trip(True, "required")
        assert [(c["name"], c["arguments"]) for c in a] == [(c["name"], c["arguments"]) for c in b], (a, b)

    @check("tool call round trip (named function)")
    def _():
        tool_round_trip(False, {"type": "function", "function": {"name": "get_time"}})

    @check("tool_choice none answers in text")
    def _():
        r = client.chat.completions.create(model=model, messages=question, tools=TOOLS, tool_choice="none",
                                           max_tokens=32, temperature=0)
        assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")

    def check_logprobs(content, entries, k):
        assert entries, "no logprobs"
        assert "".join(e.token for e in entries) == content, ([e.token for e in entries], content)
        for e in entries:
            assert e.logprob <= 0 and math.isfinite(e.logprob), e
            assert len(e.top_logprobs) == k, e
            assert e.top_logprobs[0].token == e.token, e
            assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-4, e
            assert all(a.logprob >= b.logprob for a, b in zip(e.top_logprobs, e.top_logprobs[1:])), e

    chat_q = [{"role": "user", "content": "Name three colors."}]

    @check("chat logprobs (greedy: the chosen token is the top one)")
    def _():
        r = client.chat.completions.create(model=model, messages=chat_q, max_tokens=16, temperature=0,
                                           logprobs=True, top_logprobs=5)
        check_logprobs(r.choices[0].message.content, r.choices[0].logprobs.content, 5)

    @check("chat logprobs streaming")
    def _():
        content, entries = "", []
        for chunk in client.chat.completions.create(model=model, messages=chat_q, max_tokens=16, temperature=0,
                                                    logprobs=True, top_logprobs=3, stream=True):
            for c in chunk.choices:
                content += c.delta.content or ""
                if c.logprobs and c.logprobs.content:
                    entries.extend(c.logprobs.content)
        check_logprobs(content, entries, 3)

    @check("completion logprobs")
    def _():
        r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
                                      logprobs=3)
        lp = r.choices[0].logprobs
        assert "".join(lp.tokens) == r.choices[0].text, (lp.tokens, r.choices[0].text)
        assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs)
        for tok, l, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert l <= 0 and len(top) == 3 and max(top.values()) == top.get(tok, None), (tok, l, top)

    @check("embeddings (batched, normalised, similar closer than unrelated)")
    def _():
        texts = ["The cat sat on the mat.", "A cat is sitting on a rug.", "Quarterly tax filing deadlines."]
        r = client.embeddings.create(model=model, input=texts)  # the client asks for base64
        vs = [d.embedding for d in sorted(r.data, key=lambda d: d.index)]
        f = client.embeddings.create(model=model, input=texts, encoding_format="float")
        vf = [d.embedding for d in sorted(f.data, key=lambda d: d.index)]
        assert all(abs(a - b) < 1e-6 for u, w in zip(vs, vf) for a, b in zip(u, w)), "base64 and float differ"
        assert len(vs) == 3 and r.usage.prompt_tokens > 0
        for v in vs:
            assert abs(sum(x * x for x in v) - 1) < 1e-3
        dot = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731
        assert dot(vs[0], vs[1]) > dot(vs[0], vs[2]), (dot(vs[0], vs[1]), dot(vs[0], vs[2]))

    failed = sum(1 for v in results.values() if v is not None)
    print(f"openai structured: {len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
