#!/usr/bin/env python3
"""Drives a running mirage-server with the official `openai` Python package:
chat and completions, streaming and not, plus an error case.

    python3 scripts/server_openai_test.py --base-url http://127.0.0.1:8080/v1 [--api-key KEY]

Prints one line per check and `openai client: N passed, M failed`; exits
non-zero on any failure.
"""
import argparse
import sys
import traceback

import openai
from openai import OpenAI


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", default="none")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
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

    state = {}

    @check("chat")
    def _():
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
        text = r.choices[0].message.content
        assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
        assert text and "Paris" in text, text
        assert r.usage.prompt_tokens > 5 and r.usage.completion_tokens >= 1
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        state["chat"] = text

    @check("chat stream")
    def _():
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True})
        parts, usage, finish = [], None, None
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                if c.delta.content:
                    parts.append(c.delta.content)
                finish = c.finish_reason or finish
        text = "".join(parts)
        assert text == state.get("chat"), (text, state.get("chat"))
        assert finish in ("stop", "length") and usage and usage.completion_tokens >= 1

    @check("completion")
    def _():
        r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
        assert r.object == "text_completion"
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
        state["completion"] = r.choices[0].text
        assert state["completion"].strip()

    @check("completion stream")
    def _():
        stream = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                           temperature=0, stream=True)
        text = "".join(c.choices[0].text for c in stream if c.choices)
        assert text == state.get("completion"), (text, state.get("completion"))

    @check("seeded sampling repeats")
    def _():
        kw = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=0.9, top_p=0.95, seed=7,
                  presence_penalty=0.5, frequency_penalty=0.3, extra_body={"top_k": 40, "min_p": 0.05})
        a = client.completions.create(**kw).choices[0].text
        b = client.completions.create(**kw).choices[0].text
        assert a == b, (a, b)

    @check("bad request raises BadRequestError")
    def _():
        try:
            client.chat.completions.create(model=model, messages=messages, max_tokens=10**6)
        except openai.BadRequestError as e:
            assert e.status_code == 400 and e.body and e.body.get("code") == "context_length_exceeded", e.body
        else:
            raise AssertionError("no error")

    failed = sum(1 for v in results.values() if v is not None)
    print(f"openai client: {len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
