#!/usr/bin/env python3
"""Starts mirage-server on an ephemeral loopback port and runs one check
against it:

  browser  the chat page in headless Chromium (scripts/server_chat_page.js)
  load     N concurrent streaming clients for S seconds (loopback only):
           throughput, latency p50/p99, zero 5xx, active sequences back to 0
  openai   scripts/server_openai_test.py

    python3 scripts/server_e2e.py load --binary target/release/mirage-server \
        [--model models/smollm2-135m-instruct-q4_1.gguf] [--clients 64] [--seconds 30] [--json out.json]

Exits non-zero when a check fails. Standard library only (the load client
speaks HTTP/1.1 over asyncio streams).
"""
import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_server(binary, model, extra):
    cmd = [binary, "--model", model, "--host", "127.0.0.1", "--port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    m = re.search(r"http://(\S+)", line)
    if not m:
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return proc, "http://" + m.group(1)


def stop_server(proc):
    proc.terminate()
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return -9


def metrics(base):
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def sse_post(host, port, path, body):
    """POSTs JSON over a fresh HTTP/1.1 connection and yields (status,
    headers) and then each `data:` payload of the chunked event stream."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        payload = json.dumps(body).encode()
        writer.write((f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode() + payload)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        yield status, headers
        chunked = "chunked" in headers.get("transfer-encoding", "")
        buf = b""
        while True:
            if chunked:
                size = int((await reader.readline()).strip() or b"0", 16)
                if size == 0:
                    break
                buf += await reader.readexactly(size)
                await reader.readexactly(2)
            else:
                data = await reader.read(65536)
                if not data:
                    break
                buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.decode().splitlines():
                    if line.startswith("data:"):
                        yield line[5:].strip()
    finally:
        writer.close()


async def load(base, clients, seconds, max_tokens, drain):
    host, port = base.split("//")[1].rsplit(":", 1)
    port = int(port)
    prompts = ["Tell me about the moon.", "Write a short poem about rain.", "What is 12 times 7?",
               "Explain what a CPU does.", "Name three colors.", "Describe a cat in two sentences."]
    stats = {"ok": 0, "status": {}, "tokens": 0, "latency": [], "ttft": [], "errors": []}
    deadline = time.monotonic() + seconds

    async def client(i):
        n = 0
        while time.monotonic() < deadline:
            body = {"messages": [{"role": "user", "content": prompts[(i + n) % len(prompts)]}], "stream": True,
                    "max_tokens": max_tokens, "temperature": 0.7, "seed": i * 1000 + n}
            n += 1
            t0 = time.monotonic()
            first = None
            done = False
            try:
                stream = sse_post(host, port, "/v1/chat/completions", body)
                status, headers = await stream.__anext__()
                stats["status"][status] = stats["status"].get(status, 0) + 1
                if status != 200:
                    await stream.aclose()
                    if status == 429:
                        await asyncio.sleep(float(headers.get("retry-after", "1")))
                    continue
                async for data in stream:
                    if data == "[DONE]":
                        done = True
                        continue
                    j = json.loads(data)
                    if "error" in j:
                        stats["errors"].append(j["error"]["message"])
                        continue
                    if j["choices"] and j["choices"][0]["delta"].get("content") and first is None:
                        first = time.monotonic() - t0
                    if j.get("usage") and j["choices"] and j["choices"][0].get("finish_reason"):
                        stats["tokens"] += j["usage"]["completion_tokens"]
                if done:
                    stats["ok"] += 1
                    stats["latency"].append(time.monotonic() - t0)
                    if first is not None:
                        stats["ttft"].append(first)
                else:
                    stats["errors"].append("stream ended without [DONE]")
            except Exception as e:  # noqa: BLE001 - counted as a failure
                stats["errors"].append(repr(e))

    t0 = time.monotonic()
    tasks = [asyncio.create_task(client(i)) for i in range(clients)]
    # Requests in flight at the deadline may finish within `drain` seconds;
    # the rest are cancelled (their connections close, which must free
    # their sequences on the server).
    _, pending = await asyncio.wait(tasks, timeout=seconds + drain)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    stats["cancelled_at_drain"] = len(pending)
    return stats, time.monotonic() - t0


def run_load(args, base):
    stats, wall = asyncio.run(load(base, args.clients, args.seconds, args.max_tokens, args.drain))
    # Every stream is closed: no sequence may stay behind.
    t0 = time.monotonic()
    m = metrics(base)
    while (m["mirage_active_sequences"] != 0 or m["mirage_queue_depth"] != 0) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
        m = metrics(base)
    five = sum(v for k, v in stats["status"].items() if k >= 500)
    report = {
        "clients": args.clients, "seconds": args.seconds, "wall_s": round(wall, 1), "max_tokens": args.max_tokens,
        "server_args": args.server_args,
        "requests_ok": stats["ok"], "status_counts": {str(k): v for k, v in sorted(stats["status"].items())},
        "stream_errors": len(stats["errors"]), "cancelled_at_drain": stats["cancelled_at_drain"], "completion_tokens": stats["tokens"],
        "throughput_tok_s": round(stats["tokens"] / wall, 1), "requests_per_s": round(stats["ok"] / wall, 2),
        "latency_p50_s": round(pct(stats["latency"], 50), 2), "latency_p99_s": round(pct(stats["latency"], 99), 2),
        "ttft_p50_s": round(pct(stats["ttft"], 50), 2), "ttft_p99_s": round(pct(stats["ttft"], 99), 2),
        "active_sequences_after": m["mirage_active_sequences"], "queue_depth_after": m["mirage_queue_depth"],
        "server_completion_tokens_total": m["mirage_completion_tokens_total"],
        "server_forward_steps_total": m["mirage_forward_steps_total"],
    }
    print(json.dumps(report, indent=2))
    if stats["errors"]:
        print("stream errors (first 5):", stats["errors"][:5])
    checks = {
        "zero 5xx": five == 0,
        "no stream errors": not stats["errors"],
        "requests completed": stats["ok"] > 0,
        "active sequences back to 0": m["mirage_active_sequences"] == 0,
        "queue empty": m["mirage_queue_depth"] == 0,
    }
    for k, ok in checks.items():
        print(("ok   " if ok else "FAIL ") + k)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    failed = sum(not ok for ok in checks.values())
    print(f"load: {len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("check", choices=["browser", "load", "openai"])
    ap.add_argument("--binary", default=os.path.join(ROOT, "target/release/mirage-server"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models/smollm2-135m-instruct-q4_1.gguf"))
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--drain", type=float, default=120, help="seconds after the deadline for requests in flight")
    ap.add_argument("--screenshot", default="/tmp/mirage-chat-page.png")
    ap.add_argument("--json")
    ap.add_argument("--server-args", default="--max-batch 16 --queue 128 --ctx 1024",
                    help="extra mirage-server flags")
    args = ap.parse_args()
    if not os.path.exists(args.model):
        raise SystemExit(f"{args.model} is missing: run `cargo xtask fetch-models`")
    proc, base = start_server(args.binary, args.model, args.server_args.split())
    try:
        if args.check == "load":
            rc = run_load(args, base)
        elif args.check == "browser":
            env = dict(os.environ)
            env.setdefault("NODE_PATH", "/tmp/mirage-node/node_modules")
            rc = subprocess.call(["node", os.path.join(ROOT, "scripts/server_chat_page.js"), base, args.screenshot], env=env)
        else:
            rc = subprocess.call([sys.executable, os.path.join(ROOT, "scripts/server_openai_test.py"),
                                  "--base-url", base + "/v1"])
    finally:
        code = stop_server(proc)
    if code != 0:
        print(f"FAIL server exit status {code} after SIGTERM")
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
