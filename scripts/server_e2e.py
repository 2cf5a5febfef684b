#!/usr/bin/env python3
"""Starts mirage-server on an ephemeral loopback port and runs one check
against it:

  browser  the chat page in headless Chromium (scripts/server_chat_page.js)
  load     load, faults and bad input in one run (loopback only): N
           concurrent streaming clients for S seconds and, during them,
           malformed requests, clients killed mid-stream and a flood of
           half-open connections; asserts 0 responses 5xx, no crash,
           /health answering within 1 s throughout (sampled every ~100 ms
           by a separate process), active sequences back to 0, RSS flat
           after warm-up; prints one table
  openai   scripts/server_openai_test.py
  structured
           scripts/server_openai_structured_test.py (json_schema on
           --prompts prompts, tool calls, logprobs, embeddings)
  determinism
           the cost of --deterministic: tok/s with 1 and 8 concurrent
           greedy clients, default vs --deterministic servers measured in
           alternation in one run, and whether each prompt's text stayed
           the same in every round

    python3 scripts/server_e2e.py load --binary target/release/mirage-server \
        [--model models/smollm2-135m-instruct-q4_1.gguf] [--clients 64] [--seconds 60] \
        [--malformed 200] [--killed 100] [--half-open 2000] [--json out.json]
    python3 scripts/server_e2e.py determinism --binary target/release/mirage-server \
        [--rounds 2] [--max-tokens 64] [--server-args "--max-batch 8 --ctx 1024"]

Exits non-zero when a check fails. Standard library only (the clients
speak HTTP/1.1 over asyncio streams).
"""
import argparse
import asyncio
import http.client
import json
import multiprocessing
import os
import re
import resource
import socket
import struct
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_server(binary, model, extra, files=None):
    cmd = [binary, "--model", model, "--host", "127.0.0.1", "--port", "0", *extra]
    if files:
        # Under this open-file limit (soft and hard: the server cannot raise it).
        cmd = ["sh", "-c", f'ulimit -n {int(files)} && exec "$0" "$@"', *cmd]
    env = dict(os.environ)
    env.setdefault("RUST_LOG", "warn")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
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


def split_base(base):
    host, port = base.split("//")[1].rsplit(":", 1)
    return host, int(port)


async def streaming_client(i, host, port, deadline, max_tokens, stats, once=False):
    """Streams chat completions back to back until the deadline (or one
    completion with `once`)."""
    prompts = ["Tell me about the moon.", "Write a short poem about rain.", "What is 12 times 7?",
               "Explain what a CPU does.", "Name three colors.", "Describe a cat in two sentences."]
    n = completed = 0
    while (completed == 0 and n < 100) if once else time.monotonic() < deadline:
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
                completed += 1
                stats["ok"] += 1
                stats["latency"].append(time.monotonic() - t0)
                if first is not None:
                    stats["ttft"].append(first)
            else:
                stats["errors"].append("stream ended without [DONE]")
        except Exception as e:  # noqa: BLE001 - counted as a failure
            stats["errors"].append(repr(e))


def malformed_requests(hostport):
    """(category, raw request, statuses that are right) for each kind of bad input."""
    host = f"Host: {hostport}\r\n"
    chat = "/v1/chat/completions"

    def post(path, body, ct="application/json"):
        b = body if isinstance(body, bytes) else body.encode()
        cth = f"Content-Type: {ct}\r\n" if ct else ""
        return (f"POST {path} HTTP/1.1\r\n{host}{cth}Content-Length: {len(b)}\r\nConnection: close\r\n\r\n").encode() + b

    def get(path, extra=""):
        return f"GET {path} HTTP/1.1\r\n{host}Connection: close\r\n{extra}\r\n".encode()

    msg = '"messages": [{"role": "user", "content": "hi"}]'
    return [
        ("bad JSON", post(chat, '{"messages": ['), {400}),
        ("bad JSON", post("/v1/completions", '{"prompt": "x",}'), {400}),
        ("bad JSON", post(chat, b'{"messages": "\xff\xfe"}'), {400}),
        ("bad JSON", post(chat, "[1, 2]"), {400}),
        ("wrong types", post(chat, '{"messages": "hi"}'), {400}),
        ("wrong types", post(chat, "{" + msg + ', "temperature": "hot"}'), {400}),
        ("wrong types", post("/v1/completions", '{"prompt": 5, "max_tokens": -1}'), {400}),
        ("wrong types", post(chat, "{" + msg + ', "max_tokens": 100000}'), {400}),
        ("wrong types", post(chat, "{" + msg + ', "tools": [{"type": "function"}]}'), {400}),
        ("huge headers", get("/health", "X-Big: " + "a" * 65536 + "\r\n"), {431}),
        ("huge headers", get("/health", "".join(f"X-H{i}: {i}\r\n" for i in range(300))), {431}),
        ("bad Content-Length", f"POST {chat} HTTP/1.1\r\n{host}Content-Type: application/json\r\n"
                               f"Content-Length: 12abc\r\n\r\n{{}}".encode(), {400}),
        ("bad Content-Length", f"POST {chat} HTTP/1.1\r\n{host}Content-Type: application/json\r\n"
                               f"Content-Length: 2\r\nContent-Length: 5\r\n\r\n{{}}".encode(), {400}),
        ("bad Content-Length", f"POST {chat} HTTP/1.1\r\n{host}Content-Type: application/json\r\n"
                               f"Content-Length: 10000000000\r\n\r\n{{".encode(), {413}),
        ("bad request line", b"GARBAGE\r\n\r\n", {400}),
        ("bad request line", f"GET / HTTP/7.0\r\n{host}\r\n".encode(), {400, 505}),
        ("wrong content type", post(chat, "{" + msg + "}", ct="text/plain"), {415}),
        ("wrong content type", post(chat, "messages=hi", ct="application/x-www-form-urlencoded"), {415}),
        ("wrong content type", post(chat, "{" + msg + "}", ct=None), {415}),
        ("unknown route", get("/v1/nothing"), {404}),
        ("unknown route", post("/admin", "{}"), {404}),
        ("unknown route", get(chat), {405}),
        ("unknown route", b"GET /v1/models HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n", {403}),
    ]


async def read_response(reader):
    """Status, headers and body of one response (by Content-Length)."""
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("no response")
    status = int(status_line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


async def malformed_one(host, port, category, raw, expected, stats):
    try:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(raw)
            try:
                await writer.drain()
            except ConnectionError:
                pass  # answered and closed before the whole request was read (431, 413)
            status, headers, body = await asyncio.wait_for(read_response(reader), 10)
        finally:
            writer.transport.abort()
        stats["status"][status] = stats["status"].get(status, 0) + 1
        ok = status in expected and headers.get("content-type", "").startswith("application/json") \
            and "error" in json.loads(body)
        if not ok:
            stats["wrong"].append(f"{category}: {status} {body[:120]!r}")
    except Exception as e:  # noqa: BLE001 - no answer is a failure
        stats["wrong"].append(f"{category}: {e!r}")
    stats["sent"][category] = stats["sent"].get(category, 0) + 1


async def killed_client(i, host, port, stats):
    """A streaming client that goes away (connection reset) mid-stream: it
    waits for a slot as long as it takes (retrying after a 429), reads three
    events, then resets its connection."""
    # No max_tokens: it may generate as much as the context holds.
    body = {"messages": [{"role": "user", "content": "Tell me a long story about a dragon."}], "stream": True,
            "temperature": 0.8, "seed": 77 + i}
    payload = json.dumps(body).encode()
    while True:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
                         + payload)
            await writer.drain()
            status = int((await reader.readline()).split()[1])
            stats["status"][status] = stats["status"].get(status, 0) + 1
            if status == 429:
                await asyncio.sleep(1)
                continue
            if status == 200:
                seen = b""
                while seen.count(b"data:") < 3:
                    chunk = await reader.read(4096)
                    if not chunk:
                        break
                    seen += chunk
                stats["mid_stream"] += seen.count(b"data:") >= 3
            else:
                stats["errors"].append(f"killed client: status {status}")
            return
        except Exception as e:  # noqa: BLE001
            stats["errors"].append(f"killed client: {e!r}")
            return
        finally:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                # Reset, as a killed process's connection is.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()


async def half_open(host, port, n, hold_s, stats):
    """Opens n connections that never finish a request (silent, a partial
    head, a head with a partial body), holds them for hold_s seconds, and
    notes which ones the server closed meanwhile and what it answered."""
    conns = []
    t0 = time.monotonic()
    for i in range(n):
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
        except Exception:  # noqa: BLE001
            stats["open_failed"] += 1
            continue
        kind = i % 3
        if kind == 1:
            writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nX-Slow: ".encode())
        elif kind == 2:
            writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: 1000\r\n\r\n{{\"prompt\": \"Once".encode())
        conns.append((reader, writer))
    stats["opened"] = len(conns)
    stats["open_s"] = time.monotonic() - t0

    async def watch(reader):
        data = b""
        while chunk := await reader.read(65536):
            data += chunk
        if data:
            status = int(data.split()[1])
            stats["status"][status] = stats["status"].get(status, 0) + 1
        stats["closed_by_server"] += 1

    watchers = [asyncio.create_task(watch(r)) for r, _ in conns]
    await asyncio.sleep(max(0.0, hold_s - (time.monotonic() - t0)))
    for t in watchers:
        t.cancel()
    await asyncio.gather(*watchers, return_exceptions=True)
    for _, w in conns:
        w.transport.abort()


def probe(base, pid, stop, out):
    """Separate process: GET /health every ~100 ms (1 s timeout) and the
    server's VmRSS, until stopped; sends [(t, rss_kib, latency_s|None, status|None)]."""
    host, port = split_base(base)
    samples = []
    while not stop.is_set():
        t0 = time.monotonic()
        rss = None
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss = int(line.split()[1])
        except OSError:
            pass
        status, latency = None, None
        try:
            c = http.client.HTTPConnection(host, port, timeout=1.0)
            c.request("GET", "/health")
            r = c.getresponse()
            r.read()
            status, latency = r.status, time.monotonic() - t0
            c.close()
        except Exception:  # noqa: BLE001 - a failed probe is recorded as such
            pass
        samples.append((t0, rss, latency, status))
        time.sleep(max(0.0, 0.1 - (time.monotonic() - t0)))
    out.send(samples)


def open_files_limit(pid="self"):
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    return None


async def load(args, base):
    host, port = split_base(base)
    seconds = args.seconds
    streaming = {"ok": 0, "status": {}, "tokens": 0, "latency": [], "ttft": [], "errors": []}
    bad = {"status": {}, "wrong": [], "sent": {}}
    killed = {"status": {}, "errors": [], "mid_stream": 0}
    flood = {"status": {}, "opened": 0, "open_failed": 0, "open_s": 0.0, "closed_by_server": 0}
    t0 = time.monotonic()
    deadline = t0 + seconds
    tasks = [asyncio.create_task(streaming_client(i, host, port, deadline, args.max_tokens, streaming))
             for i in range(args.clients)]

    async def at(frac, coro):
        await asyncio.sleep(max(0.0, t0 + frac * seconds - time.monotonic()))
        await coro

    async def spread(n, start, end, make):
        # n tasks started evenly over [start, end] of the run
        subs = []
        for k in range(n):
            await asyncio.sleep(max(0.0, t0 + (start + (end - start) * k / max(1, n)) * seconds - time.monotonic()))
            subs.append(asyncio.create_task(make(k)))
        await asyncio.gather(*subs)

    variants = malformed_requests(f"{host}:{port}")
    faults = [
        asyncio.create_task(spread(args.malformed, 0.1, 0.9, lambda k: malformed_one(
            host, port, variants[k % len(variants)][0], variants[k % len(variants)][1],
            variants[k % len(variants)][2], bad))),
        asyncio.create_task(spread(args.killed, 0.1, 0.9, lambda k: killed_client(k, host, port, killed))),
        asyncio.create_task(at(0.2, half_open(host, port, args.half_open, 0.6 * seconds, flood))),
    ]
    # Requests in flight at the deadline may finish within `drain` seconds;
    # the rest are cancelled (their connections close, which must free
    # their sequences on the server).
    _, pending = await asyncio.wait(tasks + faults, timeout=seconds + args.drain)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    streaming["cancelled_at_drain"] = len(pending)
    return streaming, bad, killed, flood, (t0, time.monotonic())


def run_load(args, base, proc):
    # Room for the half-open flood and the clients.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = args.half_open + args.clients + args.killed + 256
    try:
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(want, soft)), hard))
    except (ValueError, OSError):
        pass
    client_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if client_files < want:
        print(f"note: this process may open {client_files} files; the half-open flood is cut to fit")
        args.half_open = max(0, client_files - args.clients - args.killed - 256)
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    recv, send = ctx.Pipe(duplex=False)
    prober = ctx.Process(target=probe, args=(base, proc.pid, stop, send), daemon=True)
    prober.start()
    # Warm-up: one request per sequence slot at once, so that the KV cache
    # pages a run touches are touched before RSS is watched.
    slots = json.loads(urllib.request.urlopen(base + "/health", timeout=10).read())["max_batch"]
    t_warm = time.monotonic()
    warm = {"ok": 0, "status": {}, "tokens": 0, "latency": [], "ttft": [], "errors": []}

    async def warm_up():
        host, port = split_base(base)
        await asyncio.gather(*(streaming_client(i, host, port, 0, args.max_tokens, warm, once=True)
                               for i in range(slots)))

    asyncio.run(warm_up())
    warm_s = time.monotonic() - t_warm
    streaming, bad, killed, flood, (t_start, t_end) = asyncio.run(load(args, base))
    # Every stream is closed: no sequence may stay behind.
    t0 = time.monotonic()
    m = metrics(base)
    while (m["mirage_active_sequences"] != 0 or m["mirage_queue_depth"] != 0) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
        m = metrics(base)
    time.sleep(0.3)
    stop.set()
    samples = recv.recv()
    prober.join(5)
    alive = proc.poll() is None
    wall = t_end - t_start

    # /health through the whole run, drain included.
    probes = [s for s in samples if t_start <= s[0] <= time.monotonic()]
    answered = [s[2] for s in probes if s[3] == 200]
    failed = [s for s in probes if s[3] != 200 or s[2] is None or s[2] > 1.0]
    # RSS: its level at 25 % of the run against the most it reached after.
    run_s = [s for s in samples if t_start <= s[0] <= t_end and s[1]]
    at25 = [s[1] for s in run_s if t_start + 0.2 * wall <= s[0] <= t_start + 0.3 * wall]
    after = [s[1] for s in run_s if s[0] >= t_start + 0.25 * wall]
    rss25 = sorted(at25)[len(at25) // 2] if at25 else float("nan")
    rss_max = max(after) if after else float("nan")
    rss_end = run_s[-1][1] if run_s else float("nan")
    growth = rss_max / rss25 - 1 if at25 and after else float("nan")

    statuses = {}
    for d in (streaming["status"], bad["status"], killed["status"], flood["status"]):
        for k, v in d.items():
            statuses[k] = statuses.get(k, 0) + v
    five = sum(v for k, v in statuses.items() if k >= 500) + sum(1 for s in probes if s[3] and s[3] >= 500)
    closed = {k: int(m.get(f'mirage_connections_closed_total{{reason="{k}"}}', 0))
              for k in ("header_timeout", "idle_timeout", "evicted", "refused")}
    server_files = open_files_limit(proc.pid)
    rows = [
        ("warm-up", f"{slots} requests at once (one per sequence slot) in {warm_s:.1f} s; "
         f"{len(warm['errors'])} errors", not warm["errors"]),
        ("streaming clients", f"{args.clients} for {args.seconds:g} s (wall {wall:.1f} s)", None),
        ("streamed requests completed", f"{streaming['ok']}, {streaming['tokens']} tokens, "
         f"{streaming['tokens'] / wall:.1f} tok/s, latency p50 {pct(streaming['latency'], 50):.2f} s "
         f"p99 {pct(streaming['latency'], 99):.2f} s", streaming["ok"] > 0),
        ("stream errors", f"{len(streaming['errors'])} (+{len(killed['errors'])} in killed clients)",
         not streaming["errors"] and not killed["errors"]),
        ("malformed requests", f"{sum(bad['sent'].values())} sent, {len(bad['wrong'])} without the right 4xx JSON "
         f"({', '.join(f'{k} {v}' for k, v in sorted(bad['sent'].items()))})",
         sum(bad["sent"].values()) == args.malformed and not bad["wrong"]),
        ("clients killed mid-stream", f"{killed['mid_stream']} of {args.killed} reset after 3 events "
         f"(server cancelled {int(m.get('mirage_cancelled_sequences_total', 0))} sequences in all)",
         killed["mid_stream"] == args.killed),
        ("half-open connections", f"{flood['opened']} opened in {flood['open_s']:.1f} s ({flood['open_failed']} "
         f"failed to open), {flood['closed_by_server']} closed by the server while held "
         f"{0.6 * args.seconds:.0f} s", flood["opened"] + flood["open_failed"] == args.half_open
         and flood["open_failed"] == 0),
        ("server closed connections", ", ".join(f"{k} {v}" for k, v in closed.items())
         + f"; protocol errors {int(m.get('mirage_protocol_errors_total', 0))}", None),
        ("open-file limits", f"server {server_files}, this client {client_files}", None),
        ("responses by status", ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())), None),
        ("responses 5xx", str(five), five == 0),
        ("/health within 1 s", f"{len(probes)} probes every ~100 ms, {len(failed)} late or failed, max "
         f"{max(answered) if answered else float('nan'):.3f} s, p99 {pct(answered, 99):.3f} s",
         probes and not failed),
        ("active sequences after", f"{m['mirage_active_sequences']:g} (queue {m['mirage_queue_depth']:g})",
         m["mirage_active_sequences"] == 0 and m["mirage_queue_depth"] == 0),
        ("RSS flat after warm-up", f"{rss25 / 1024:.0f} MiB at 25 %, max {rss_max / 1024:.0f} MiB after "
         f"(+{100 * growth:.1f} %), {rss_end / 1024:.0f} MiB at the end; flat: < 10 %", growth < 0.10),
        ("server alive (no crash)", "yes" if alive else f"no (exit {proc.poll()})", alive),
    ]
    return rows, {"statuses": statuses, "closed": closed, "rss_kib": [rss25, rss_max, rss_end],
                  "health_max_s": max(answered) if answered else None, "malformed_wrong": bad["wrong"][:10],
                  "stream_errors": (streaming["errors"] + killed["errors"])[:10]}


def complete_once(base, prompt, max_tokens):
    """One greedy non-streaming completion: (text, completion tokens)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    j = json.loads(urllib.request.urlopen(req, timeout=600).read())
    return j["choices"][0]["text"], j["usage"]["completion_tokens"]


def run_determinism(args):
    """Deterministic mode's cost and effect: the same server binary twice,
    default and --deterministic, both up for the whole run; rounds of 1 and
    of 8 concurrent clients (greedy requests, 8 fixed prompts) alternate
    between them, so both see the same machine load. Prints tok/s per
    setting and whether each prompt's text was the same in every round."""
    import concurrent.futures as cf
    # Plain completions that run to max_tokens (so both settings generate
    # about as many tokens).
    prompts = ["Once upon a time, in a land far away, there lived a", "The history of the Roman Empire begins",
               "Here is a long list of fruits: apple, banana,", "def fibonacci(n):\n",
               "The following is a detailed description of a cat:", "Chapter 1\n\nIt was a dark and stormy night",
               "Dear diary, today I", "The ten largest cities in the world are"]
    extra = args.server_args.split()
    servers = {name: start_server(args.binary, args.model, extra + flags)
               for name, flags in (("default", []), ("deterministic", ["--deterministic"]))}
    tok = {(n, c): [0, 0.0] for n in servers for c in (1, 8)}
    texts = {n: {p: set() for p in prompts} for n in servers}
    try:
        for _ in range(args.rounds):
            for clients in (1, 8):
                for name, (_, base) in servers.items():
                    todo = prompts if clients == 8 else prompts[:2]
                    t0 = time.monotonic()
                    with cf.ThreadPoolExecutor(clients) as pool:
                        out = list(pool.map(lambda p: (p, *complete_once(base, p, args.max_tokens)), todo))
                    wall = time.monotonic() - t0
                    for p, text, n in out:
                        texts[name][p].add(text)
                        tok[(name, clients)][0] += n
                    tok[(name, clients)][1] += wall
    finally:
        codes = {name: stop_server(proc) for name, (proc, _) in servers.items()}
    print("| clients | default tok/s (tokens, s) | deterministic tok/s (tokens, s) | deterministic / default |")
    print("|---|---|---|---|")
    for c in (1, 8):
        (na, sa), (nb, sb) = tok[("default", c)], tok[("deterministic", c)]
        print(f"| {c} | {na / sa:.1f} ({na}, {sa:.1f}) | {nb / sb:.1f} ({nb}, {sb:.1f}) | {(nb / sb) / (na / sa):.2f}x |")
    same = {n: sum(len(v) == 1 for v in texts[n].values()) for n in servers}
    print(f"prompts whose greedy text was the same alone and in every 8-client round: "
          f"default {same['default']}/{len(prompts)}, deterministic {same['deterministic']}/{len(prompts)} "
          f"(the 1-client rounds run the first 2 prompts alone)")
    ok = same["deterministic"] == len(prompts) and all(c == 0 for c in codes.values())
    print(f"determinism: {'1 passed, 0 failed' if ok else '0 passed, 1 failed'}")
    return 0 if ok else 1


def print_table(rows, exit_row=None):
    rows = rows + ([exit_row] if exit_row else [])
    w = max(len(r[0]) for r in rows)
    print(f"| {'check':<{w}} | result | pass |")
    print(f"|{'-' * (w + 2)}|--------|------|")
    for name, value, ok in rows:
        mark = "" if ok is None else ("ok" if ok else "FAIL")
        print(f"| {name:<{w}} | {value} | {mark} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("check", choices=["browser", "load", "openai", "structured", "determinism"])
    ap.add_argument("--binary", default=os.path.join(ROOT, "target/release/mirage-server"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models/smollm2-135m-instruct-q4_1.gguf"))
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--malformed", type=int, default=200, help="malformed requests during the run")
    ap.add_argument("--killed", type=int, default=100, help="streaming clients killed mid-stream")
    ap.add_argument("--half-open", type=int, default=2000,
                    help="connections opened at 20 %% of the run that never finish a request, held for 60 %% of it")
    ap.add_argument("--drain", type=float, default=120, help="seconds after the deadline for requests in flight")
    ap.add_argument("--screenshot", default="/tmp/mirage-chat-page.png")
    ap.add_argument("--rounds", type=int, default=2, help="determinism: rounds of 1 and 8 clients")
    ap.add_argument("--prompts", type=int, default=20, help="structured: json_schema prompts")
    ap.add_argument("--server-files", type=int, help="run the server under this open-file limit (ulimit -n)")
    ap.add_argument("--json")
    ap.add_argument("--server-args", default="--max-batch 16 --queue 128 --ctx 1024",
                    help="extra mirage-server flags")
    args = ap.parse_args()
    if not os.path.exists(args.model):
        raise SystemExit(f"{args.model} is missing: run `cargo xtask fetch-models`")
    if args.check == "determinism":
        return run_determinism(args)
    proc, base = start_server(args.binary, args.model, args.server_args.split(), args.server_files)
    rows = None
    try:
        if args.check == "load":
            rows, details = run_load(args, base, proc)
        elif args.check == "browser":
            env = dict(os.environ)
            env.setdefault("NODE_PATH", "/tmp/mirage-node/node_modules")
            rc = subprocess.call(["node", os.path.join(ROOT, "scripts/server_chat_page.js"), base, args.screenshot], env=env)
        elif args.check == "structured":
            rc = subprocess.call([sys.executable, os.path.join(ROOT, "scripts/server_openai_structured_test.py"),
                                  "--base-url", base + "/v1", "--prompts", str(args.prompts)])
        else:
            rc = subprocess.call([sys.executable, os.path.join(ROOT, "scripts/server_openai_test.py"),
                                  "--base-url", base + "/v1"])
    finally:
        code = stop_server(proc)
    if rows is not None:
        print_table(rows, ("server exit after SIGTERM", str(code), code == 0))
        if details["malformed_wrong"] or details["stream_errors"]:
            print("first problems:", json.dumps(details["malformed_wrong"] + details["stream_errors"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows, **details}, f, indent=2, default=str)
        failed = sum(ok is False for _, _, ok in rows) + (code != 0)
        print(f"load: {sum(ok is True for _, _, ok in rows) + (code == 0)} passed, {failed} failed")
        return 1 if failed else 0
    if code != 0:
        print(f"FAIL server exit status {code} after SIGTERM")
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
