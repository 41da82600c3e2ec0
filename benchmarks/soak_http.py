"""HTTP soak: one live `jpaged serve` process, 200 concurrent mixed requests
(good, bad, disconnecting, slow), /health polled throughout.

    python benchmarks/soak_http.py [--num_requests=200 --max_tokens=16 --total_timeout=300 \
        --config=configs/smollm2_135m.py --max_num_seqs=8]

The server runs on the embedded SmolLM2-135M (configs/smollm2_135m.py) with
small limits: max_num_seqs=8, a 4 KiB prompt cap, a 64 KiB body cap and a 2 s
body timeout, --precompile (every step bucket compiled before /health says
ready).  Traffic goes only to 127.0.0.1, over a minimal asyncio HTTP/1.1 client
(one connection per request, `Connection: close`) so that bodies can be
malformed, oversized, trickled or abandoned at will.

1. Reference: each distinct good (route, prompt) is sent alone, sequentially,
   non-streamed and greedy; its text is the reference.
2. Warm-up: a concurrent burst of the good requests (not checked against
   anything but the references), and each hostile case once (with
   --hostile_requests > 0).
3. Soak: --num_requests requests, all started at once (seeded mix):
   * good (50%): /v1/completions and /v1/chat/completions, half streamed,
     greedy, max_tokens=--max_tokens; the text (a stream's concatenated deltas)
     must equal the reference exactly (greedy tokens are batch-invariant);
   * bad (20%): invalid JSON, `min_p: 0.5` (changes generation, unsupported),
     wrong types, a prompt over the prompt byte cap -> 400; a body over the
     body cap (by Content-Length, or chunked) -> 413;
   * disconnecting (15%): a streamed chat, closed after its first chunk;
   * slow (15%): a raw socket that trickles its body a byte every 0.5 s -> 408
     after the body timeout.
   A thread polls GET /health every 100 ms (its own connection each time) from
   before the soak to its end: p50 / p99 / max latency (target p99 < 0.5 s),
   and every answer must be 200.
4. Hostile (--hostile_requests > 0): the same soak again, seed and mix, with
   that many of issue 37's hostile requests (benchmarks/hostile_requests.py:
   constraints that crashed or stalled the server, a tool call injected through
   the user's text, malformed LoRA adapters and names, RL-route parameters that
   were 500s) mixed in.  Each must get its 4xx (or, for the injection, a 200
   calling no undeclared function); the ordinary requests must all pass as
   before, their p99 latency within --hostile_p99_ratio of the first soak's,
   and /health's p99 must stay under target.  The server runs with the RL
   routes and two LoRA slots on, and a body cap that lets the 1 MB constraints
   reach the constraint checks.
5. After: /metrics must show vllm:num_requests_running 0, nothing waiting and
   vllm:kv_cache_usage_perc back at its idle value within --settle_seconds; the
   references are asked again (still exact); the server's VmRSS (from
   /proc/<pid>/status) at start, after warm-up and at the end must be flat (end
   vs after warm-up within --rss_tolerance_mb).

Writes benchmarks/results/soak_http.{csv,md}, prints the table, exits 1 if any
check fails.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import pathlib
import random
import re
import socket
import sys
import tempfile
import threading
import time
from typing import Any, Callable

from absl import app, flags

import harness as B  # benchmarks/harness.py (the script's own directory is on sys.path)
import hostile_requests as H

_N = flags.DEFINE_integer("num_requests", 200, "Soak requests, all started at once.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 16, "max_tokens of a good request.")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 8, "The server's max_num_seqs.")
_CONFIG = flags.DEFINE_string("config", "configs/smollm2_135m.py", "The server's --config.")
_EXTRA = flags.DEFINE_list("server_flags", [], "More server flags, e.g. --config.num_blocks=256.")
_TOTAL_TIMEOUT = flags.DEFINE_float("total_timeout", 300, "Seconds the soak phase may take in all.")
_REQUEST_TIMEOUT = flags.DEFINE_float("request_timeout", 120, "Seconds one request may take.")
_START_TIMEOUT = flags.DEFINE_float("start_timeout", 600, "Seconds the server may take to turn healthy.")
_BODY_TIMEOUT = flags.DEFINE_float("body_timeout", 2.0, "The server's --body_timeout_seconds.")
_PROMPT_CAP = flags.DEFINE_integer("max_prompt_bytes", 4096, "The server's --max_prompt_bytes.")
_BODY_CAP = flags.DEFINE_integer("max_request_body_bytes", 2 << 20, "The server's --max_request_body_bytes "
                                 "(2 MiB: the hostile 100,000-entry choice is under it).")
_SETTLE = flags.DEFINE_float("settle_seconds", 5.0, "Seconds /metrics may take to show an idle engine.")
_HEALTH_P99 = flags.DEFINE_float("health_p99_s", 0.5, "Target p99 of GET /health latency.")
_RSS_TOL = flags.DEFINE_float("rss_tolerance_mb", 64.0, "Allowed VmRSS growth, end vs after warm-up.")
_SEED = flags.DEFINE_integer("seed", 0, "Mix seed.")
_HOSTILE = flags.DEFINE_integer("hostile_requests", 40, "Hostile requests mixed into a second soak (0: none).")
_HOSTILE_RATIO = flags.DEFINE_float("hostile_p99_ratio", 2.0,
                                    "Ordinary requests' p99 latency with the hostile ones / without, at most.")

HOST = "127.0.0.1"
MODEL = "smollm2-135m"
COLUMNS = ["check", "value", "target", "ok"]
COMPLETION_PROMPTS = ["The capital of France is", "Once upon a time, in a small village,",
                      "def fibonacci(n):", "The three primary colors are", "Water boils at",
                      "My favourite book is"]
CHAT_PROMPTS = ["What is the capital of Japan?", "Name three animals that live in Kenya.",
                "Write one sentence about Norway.", "What is 12 times 12?", "Say hello in Spanish.",
                "Why is the sky blue?"]


# ------------------------------------------------------------------ server
def vm_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Server(B.ServerProcess):
    """The jpaged server under soak."""

    def __init__(self, log: pathlib.Path):
        port = B.free_port()
        super().__init__("server", [
            sys.executable, "scripts/serve.py", "--config", _CONFIG.value, "--host", HOST,
            "--port", str(port), "--precompile", "--noaccess_log",
            f"--config.max_num_seqs={_MAX_NUM_SEQS.value}", "--config.max_queued_requests=1000",
            f"--max_prompt_bytes={_PROMPT_CAP.value}", f"--max_request_body_bytes={_BODY_CAP.value}",
            f"--body_timeout_seconds={_BODY_TIMEOUT.value:g}",
            *(["--enable_rl_routes", "--config.max_loras=2"] if _HOSTILE.value else []), *_EXTRA.value], port, log)

    def rss(self) -> float:
        return vm_rss_mb(self.proc.pid)


def get_sync(port: int, path: str, timeout: float) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def metrics(port: int) -> dict[str, float]:
    status, body = get_sync(port, "/metrics", 10)
    assert status == 200, status
    out = {}
    for line in body.decode().splitlines():
        m = re.match(r"^(vllm:[a-z_]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m and (m.group(2) is None or re.fullmatch(r'\{model_name="[^"]*"\}', m.group(2))):
            out[m.group(1)] = float(m.group(3))
    return out


class HealthPoller(threading.Thread):
    """GET /health every `period` s on a fresh connection; latencies and non-200s."""

    def __init__(self, port: int, period: float = 0.1, max_seconds: float = 900):
        super().__init__(daemon=True)
        self.port, self.period, self.max_seconds = port, period, max_seconds
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        t_end = time.monotonic() + self.max_seconds
        while not self.stop_event.is_set() and time.monotonic() < t_end:
            t0 = time.perf_counter()
            try:
                status, _ = get_sync(self.port, "/health", 10)
                if status != 200:
                    self.failures.append(f"status {status}")
            except OSError as e:
                self.failures.append(f"{type(e).__name__}: {e}")
            dt = time.perf_counter() - t0
            self.latencies.append(dt)
            self.stop_event.wait(max(0.0, self.period - dt))


# ------------------------------------------------------------------ client
def dechunk(data: bytes) -> bytes:
    out, i = [], 0
    while i < len(data):
        j = data.find(b"\r\n", i)
        if j < 0:
            break
        size = int(data[i:j].split(b";")[0], 16)
        if size == 0:
            break
        out.append(data[j + 2:j + 2 + size])
        i = j + 2 + size + 2
    return b"".join(out)


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines and len(lines[0].split()) > 1 else 0
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = dechunk(body)
    return status, headers, body


def request_head(method: str, path: str, length: int | None, extra: str = "") -> bytes:
    h = f"{method} {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\nContent-Type: application/json\r\n"
    if length is not None:
        h += f"Content-Length: {length}\r\n"
    return (h + extra + "\r\n").encode()


async def read_all(reader: asyncio.StreamReader, limit: int = 1 << 24) -> bytes:
    parts, size = [], 0
    while size < limit:
        chunk = await reader.read(65536)
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)


async def post(port: int, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(request_head("POST", path, len(body)) + body)
        await writer.drain()
        return parse_response(await read_all(reader))
    finally:
        writer.close()


def sse_text(body: bytes, chat: bool) -> tuple[str, bool]:
    """The concatenated deltas of a stream, and whether it ended with [DONE]."""
    text, done = [], False
    for line in body.decode().splitlines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            continue
        obj = json.loads(data)
        if "error" in obj:
            raise RuntimeError(f"error event: {obj['error']}")
        for c in obj.get("choices", []):
            text.append((c.get("delta", {}).get("content") or "") if chat else (c.get("text") or ""))
    return "".join(text), done


def good_body(route: str, prompt: str, stream: bool) -> bytes:
    if route == "chat":
        b = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
    else:
        b = {"model": MODEL, "prompt": prompt}
    b.update(max_tokens=_MAX_TOKENS.value, temperature=0, stream=stream)
    return json.dumps(b).encode()


PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


async def good(port: int, route: str, prompt: str, stream: bool) -> str:
    status, _, body = await post(port, PATHS[route], good_body(route, prompt, stream))
    if status != 200:
        raise RuntimeError(f"status {status}: {body[:300]!r}")
    if stream:
        text, done = sse_text(body, route == "chat")
        if not done:
            raise RuntimeError("stream without [DONE]")
        return text
    choice = json.loads(body)["choices"][0]
    return choice["message"]["content"] if route == "chat" else choice["text"]


def bad_cases() -> list[tuple[str, str, bytes, int]]:
    """(name, path, body, expected status); the 413s are sent by bad_oversized."""
    big = "word " * (_PROMPT_CAP.value // 5 + 50)  # over the prompt cap, under the body cap
    chat = lambda **kw: json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                    "max_tokens": 4, **kw}).encode()
    comp = lambda **kw: json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 4, **kw}).encode()
    return [
        ("invalid_json", PATHS["chat"], b'{"model": "smollm2-135m", "messages": [', 400),
        ("invalid_json_completion", PATHS["completion"], b"not json at all", 400),
        ("min_p", PATHS["chat"], chat(min_p=0.5), 400),
        ("min_p_completion", PATHS["completion"], comp(min_p=0.5), 400),
        ("max_tokens_str", PATHS["completion"], comp(max_tokens="ten"), 400),
        ("temperature_str", PATHS["chat"], chat(temperature="hot"), 400),
        ("messages_str", PATHS["chat"], json.dumps({"model": MODEL, "messages": "hello"}).encode(), 400),
        ("prompt_dict", PATHS["completion"], json.dumps({"model": MODEL, "prompt": {"a": 1}}).encode(), 400),
        ("prompt_over_cap", PATHS["completion"], comp(prompt=big), 400),
        ("chat_over_cap", PATHS["chat"],
         json.dumps({"model": MODEL, "messages": [{"role": "user", "content": big}]}).encode(), 400),
    ]


async def bad(port: int, path: str, body: bytes, expect: int) -> None:
    status, _, resp = await post(port, path, body)
    if status != expect:
        raise RuntimeError(f"status {status}, expected {expect}: {resp[:300]!r}")
    err = json.loads(resp).get("error")
    if not isinstance(err, dict) or "message" not in err:
        raise RuntimeError(f"no OpenAI error body: {resp[:300]!r}")


async def bad_oversized(port: int, chunked: bool) -> None:
    """A body over max_request_body_bytes -> 413: by Content-Length (the body is
    never sent), or chunked (refused while it arrives)."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        size = _BODY_CAP.value + 4096
        if chunked:
            writer.write(request_head("POST", PATHS["completion"], None, "Transfer-Encoding: chunked\r\n"))
            piece = b"x" * 8192
            try:
                for _ in range(size // len(piece) + 1):
                    writer.write(b"%x\r\n" % len(piece) + piece + b"\r\n")
                    await writer.drain()
            except (ConnectionError, OSError):
                pass  # the server answered and closed mid-body
        else:
            writer.write(request_head("POST", PATHS["completion"], size))
            await writer.drain()
        status, _, resp = parse_response(await read_all(reader))
        if status != 413:
            raise RuntimeError(f"status {status}, expected 413: {resp[:300]!r}")
    finally:
        writer.close()


async def hostile(port: int, case: tuple) -> None:
    """One of hostile_requests.cases(): its allowed status, an error body with a
    message when refused, and its check when answered."""
    name, _, path, body, allowed, check = case
    status, _, resp = await post(port, path, b"" if body is None else json.dumps(body).encode())
    if status not in allowed:
        raise RuntimeError(f"status {status}, expected {allowed}: {resp[:300]!r}")
    answer = json.loads(resp)
    if status != 200:
        err = answer.get("error")
        if not isinstance(err, dict) or not err.get("message"):
            raise RuntimeError(f"no OpenAI error body: {resp[:300]!r}")
    elif check is not None and (why := check(answer)):
        raise RuntimeError(why)


async def disconnect(port: int) -> None:
    """A streamed chat of up to 64 tokens, abandoned after its first data chunk."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
                       "max_tokens": 64, "temperature": 0, "stream": True}).encode()
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(request_head("POST", PATHS["chat"], len(body)) + body)
        await writer.drain()
        buf = b""
        while b"data: " not in buf.partition(b"\r\n\r\n")[2]:
            chunk = await reader.read(4096)
            if not chunk:
                raise RuntimeError(f"closed before the first chunk: {buf[:300]!r}")
            buf += chunk
        if not buf.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"not a 200: {buf[:300]!r}")
    finally:
        writer.transport.abort()  # drop the connection at once


async def slow(port: int) -> tuple[float, bool]:
    """Trickles a body a byte every 0.5 s over a raw socket; the server must
    answer 408 within about body_timeout.  Returns the seconds to the answer and
    whether the connection was then reset (the server closes with our trickled
    bytes unread: its kernel answers them with a RST).  A raw socket, not
    asyncio streams: recv() hands over the queued 408 before it reports the
    reset, whereas a StreamReader raises the reset and drops what it holds."""
    loop = asyncio.get_running_loop()
    body = good_body("completion", "Slow", False)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    t0 = time.perf_counter()
    try:
        await loop.sock_connect(sock, (HOST, port))
        await loop.sock_sendall(sock, request_head("POST", PATHS["completion"], len(body)))

        async def trickle() -> None:
            for b in body[:-1]:  # never the whole body
                await asyncio.sleep(0.5)
                await loop.sock_sendall(sock, bytes([b]))

        async def receive() -> tuple[bytes, bool]:
            raw = b""
            while True:
                try:
                    chunk = await loop.sock_recv(sock, 65536)
                except ConnectionResetError:
                    return raw, True
                if not chunk:
                    return raw, False
                raw += chunk
        task = asyncio.create_task(trickle())
        try:
            raw, reset = await asyncio.wait_for(receive(), _BODY_TIMEOUT.value + 10)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        status, _, resp = parse_response(raw)
        if status != 408:
            raise RuntimeError(f"status {status}, expected 408 (reset: {reset}): {raw[:300]!r}")
        return time.perf_counter() - t0, reset
    finally:
        sock.close()


# ------------------------------------------------------------------ soak
def with_hostile(reqs: list[dict[str, Any]], cases: list[tuple], n: int,
                 rng: random.Random) -> list[dict[str, Any]]:
    """`reqs` with n hostile requests (the cases in turn) at random places."""
    out = list(reqs)
    for j in range(n):
        case = cases[j % len(cases)]
        out.insert(rng.randrange(len(out) + 1), {"kind": "hostile", "name": case[0], "case": case})
    return [{**r, "i": i} for i, r in enumerate(out)]


def plan(n: int, rng: random.Random) -> list[dict[str, Any]]:
    """The soak's requests, shuffled."""
    kinds = (["good"] * (n * 50 // 100) + ["bad"] * (n * 20 // 100) + ["disconnect"] * (n * 15 // 100))
    kinds += ["slow"] * (n - len(kinds))
    rng.shuffle(kinds)
    goods = [("completion", p) for p in COMPLETION_PROMPTS] + [("chat", p) for p in CHAT_PROMPTS]
    bads = bad_cases()
    out = []
    for i, kind in enumerate(kinds):
        r = {"i": i, "kind": kind}
        if kind == "good":
            r["route"], r["prompt"] = goods[i % len(goods)]
            r["stream"] = (i // len(goods)) % 2 == 1
            r["name"] = f"{r['route']}{'_stream' if r['stream'] else ''}"
        elif kind == "bad":
            j = i % (len(bads) + 2)
            if j < len(bads):
                r["name"], r["path"], r["body"], r["expect"] = bads[j]
            else:
                r["name"], r["chunked"] = ("body_over_cap_chunked", True) if j == len(bads) else \
                    ("body_over_cap_length", False)
        else:
            r["name"] = kind
        out.append(r)
    return out


async def run_one(port: int, r: dict[str, Any], refs: dict[tuple[str, str], str]) -> dict[str, Any]:
    t0 = time.perf_counter()
    error = None
    extra: dict[str, Any] = {}
    try:
        async def go() -> None:
            if r["kind"] == "good":
                text = await good(port, r["route"], r["prompt"], r["stream"])
                ref = refs[(r["route"], r["prompt"])]
                if text != ref:
                    raise RuntimeError(f"text {text!r} != reference {ref!r}")
            elif r["kind"] == "bad":
                if "path" in r:
                    await bad(port, r["path"], r["body"], r["expect"])
                else:
                    await bad_oversized(port, r["chunked"])
            elif r["kind"] == "hostile":
                await hostile(port, r["case"])
            elif r["kind"] == "disconnect":
                await disconnect(port)
            else:
                extra["reset"] = (await slow(port))[1]
        await asyncio.wait_for(go(), _REQUEST_TIMEOUT.value)
    except Exception as e:  # noqa: BLE001 - a failure is recorded, not fatal
        error = f"{type(e).__name__}: {e}"
    return {**{k: v for k, v in r.items() if k not in ("body", "case")}, **extra, "error": error,
            "seconds": time.perf_counter() - t0}


async def soak(port: int, reqs: list[dict], refs: dict) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(run_one(port, r, refs)) for r in reqs]
    done, pending = await asyncio.wait(tasks, timeout=_TOTAL_TIMEOUT.value)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    results = [t.result() for t in tasks if t in done]
    results += [{**{k: v for k, v in r.items() if k not in ("body", "case")}, "error": "not finished in total_timeout",
                 "seconds": _TOTAL_TIMEOUT.value} for r, t in zip(reqs, tasks) if t in pending]
    return results, time.perf_counter() - t0


async def references(port: int) -> dict[tuple[str, str], str]:
    refs = {}
    for route, prompts in (("completion", COMPLETION_PROMPTS), ("chat", CHAT_PROMPTS)):
        for p in prompts:
            refs[(route, p)] = await asyncio.wait_for(good(port, route, p, False), _REQUEST_TIMEOUT.value)
    return refs


def wait_idle(port: int, idle_kv: float) -> tuple[float | None, dict[str, float]]:
    """Seconds until /metrics shows an idle engine (None: not within settle_seconds)."""
    t0 = time.perf_counter()
    m: dict[str, float] = {}
    while True:
        m = metrics(port)
        if (m.get("vllm:num_requests_running") == 0 and m.get("vllm:num_requests_waiting") == 0
                and abs(m.get("vllm:kv_cache_usage_perc", -1) - idle_kv) < 1e-9):
            return time.perf_counter() - t0, m
        if time.perf_counter() - t0 > _SETTLE.value:
            return None, m
        time.sleep(0.1)


def polled(poller: HealthPoller, port: int, reqs: list[dict], refs: dict) -> tuple[list[dict], float]:
    """soak(), with `poller` on /health from half a second before it to its end."""
    poller.start()
    time.sleep(0.5)
    try:
        return asyncio.run(soak(port, reqs, refs))
    finally:
        poller.stop_event.set()
        poller.join(timeout=15)


def good_p99(results: list[dict]) -> float:
    """p99 seconds of the ordinary requests that passed (good and bad answered, not slow ones)."""
    return B.pct([r["seconds"] for r in results if r["kind"] in ("good", "bad") and not r["error"]], 99)


def hostile_check(check: Callable[..., None], baseline: list[dict], results: list[dict], span: float,
                  poller: HealthPoller) -> None:
    """The hostile soak's rows: every request answered as it should, the ordinary
    ones as fast as without the hostile ones (p99 within the ratio), /health fast."""
    for kind in ("good", "bad", "disconnect", "slow", "hostile"):
        rs = [r for r in results if r["kind"] == kind]
        failed = [r for r in rs if r["error"]]
        check(f"hostile soak: {kind} requests failing", f"{len(failed)}/{len(rs)}", "0", not failed)
    p99_base, p99_hostile = good_p99(baseline), good_p99(results)
    ratio = p99_hostile / p99_base
    check("ordinary p99 (s): soak / hostile soak", f"{p99_base:.2f} / {p99_hostile:.2f}", "-", True)
    check("ordinary p99, hostile / plain", round(ratio, 2), f"<= {_HOSTILE_RATIO.value:g}", ratio <= _HOSTILE_RATIO.value)
    check("hostile soak wall time (s)", round(span, 1), f"< {_TOTAL_TIMEOUT.value:g}", span < _TOTAL_TIMEOUT.value)
    lat = poller.latencies
    check("hostile soak: /health polls", len(lat), "> 0, all 200", bool(lat) and not poller.failures)
    if lat:
        p99 = B.pct(lat, 99)
        check("hostile soak: /health p99 (ms)", round(1000 * p99, 1), f"< {1000 * _HEALTH_P99.value:g}",
              p99 < _HEALTH_P99.value)
        check("hostile soak: /health max (ms)", round(1000 * max(lat), 1), "-", True)


def main(argv: list[str]) -> None:
    del argv
    B.header("http soak")
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    failures: list[str] = []

    def check(name: str, value: Any, target: str, ok: bool) -> None:
        rows.append({"check": name, "value": value, "target": target, "ok": "yes" if ok else "NO"})
        if not ok:
            failures.append(f"{name}: {value} (target {target})")

    with tempfile.TemporaryDirectory() as tmp:
        server = Server(pathlib.Path(tmp) / "server.log")
        poller = None
        try:
            ready = server.wait_healthy(_START_TIMEOUT.value)
            rss_start = server.rss()
            print(f"healthy after {ready:.1f} s (pid {server.proc.pid}, VmRSS {rss_start:.0f} MiB)")
            port = server.port
            refs = asyncio.run(references(port))
            print(f"{len(refs)} references computed")
            warm = plan(4 * len(refs), random.Random(_SEED.value + 1))
            if _HOSTILE.value:  # each hostile case once: its one-time costs (llguidance's tokenizer, the
                # compiler workers, the LoRA steps) paid before the RSS baseline, as the ordinary ones' are
                cases = H.cases(MODEL, H.write_adapters(pathlib.Path(tmp) / "adapters"))
                warm = with_hostile(warm, cases, len(cases), random.Random(_SEED.value + 3))
            warm_results, _ = asyncio.run(soak(port, warm, refs))
            warm_errors = [r for r in warm_results if r["error"]]
            for r in warm_errors[:5]:
                print(f"  warm-up failure: {r['name']}: {r['error']}")
            time.sleep(1.0)
            idle_kv = metrics(port).get("vllm:kv_cache_usage_perc", 0.0)
            rss_warm = server.rss()
            print(f"warm-up: {len(warm_results)} requests, {len(warm_errors)} failed; VmRSS {rss_warm:.0f} MiB, "
                  f"idle KV usage {idle_kv:g}")

            reqs = plan(_N.value, random.Random(_SEED.value))
            poller = HealthPoller(port, max_seconds=_TOTAL_TIMEOUT.value + 60)
            results, span = polled(poller, port, reqs, refs)
            rss_plain = server.rss()
            if _HOSTILE.value:
                mixed = with_hostile(reqs, cases, _HOSTILE.value, random.Random(_SEED.value + 2))
                hostile_poller = HealthPoller(port, max_seconds=_TOTAL_TIMEOUT.value + 60)
                hostile_results, hostile_span = polled(hostile_poller, port, mixed, refs)

            settle, m = wait_idle(port, idle_kv)
            after = asyncio.run(references(port))
            time.sleep(1.0)
            rss_end = server.rss()
            alive = server.proc.poll() is None
        finally:
            if poller is not None:
                poller.stop_event.set()
            rc = server.stop()
            log_tail = server.log.read_text(errors="replace")[-3000:]
    load_after = os.getloadavg()

    by_kind: dict[str, list[dict]] = {}
    for r in results:
        by_kind.setdefault(r["kind"], []).append(r)
    for kind, target in (("good", "greedy-exact text, 200"), ("bad", "400 / 413 + error body"),
                         ("disconnect", "200, first chunk, then closed"), ("slow", "408")):
        rs = by_kind.get(kind, [])
        bad_rs = [r for r in rs if r["error"]]
        check(f"{kind} requests failing", f"{len(bad_rs)}/{len(rs)}", f"0 ({target})", not bad_rs)
    slow_s = [r["seconds"] for r in by_kind.get("slow", []) if not r["error"]]
    if slow_s:
        check("slow: s to the 408 (max)", round(max(slow_s), 2), f"<= body_timeout {_BODY_TIMEOUT.value:g} + 2",
              max(slow_s) <= _BODY_TIMEOUT.value + 2)
    resets = sum(bool(r.get("reset")) for r in by_kind.get("slow", []))
    check("slow: reset after the 408", f"{resets}/{len(by_kind.get('slow', []))}", "- (408 read first)", True)
    check("soak wall time (s)", round(span, 1), f"< {_TOTAL_TIMEOUT.value:g}", span < _TOTAL_TIMEOUT.value)
    lat = poller.latencies
    check("/health polls", len(lat), "> 0, all 200", bool(lat) and not poller.failures)
    if poller.failures:
        check("/health failures", len(poller.failures), "0", False)
    if lat:
        check("/health p50 (ms)", round(1000 * B.pct(lat, 50), 1), "-", True)
        check("/health p99 (ms)", round(1000 * B.pct(lat, 99), 1), f"< {1000 * _HEALTH_P99.value:g}", B.pct(lat, 99) < _HEALTH_P99.value)
        check("/health max (ms)", round(1000 * max(lat), 1), "-", True)
    if _HOSTILE.value:
        hostile_check(check, results, hostile_results, hostile_span, hostile_poller)
    check("s until /metrics idle", None if settle is None else round(settle, 2), f"<= {_SETTLE.value:g}",
          settle is not None)
    check("vllm:num_requests_running", m.get("vllm:num_requests_running"), "0", m.get("vllm:num_requests_running") == 0)
    check("vllm:kv_cache_usage_perc", m.get("vllm:kv_cache_usage_perc"), f"{idle_kv:g} (idle, after warm-up)",
          m.get("vllm:kv_cache_usage_perc") == idle_kv)
    check("references after the soak", sum(after[k] == refs[k] for k in refs), f"{len(refs)} equal",
          after == refs)
    check("VmRSS at start (MiB)", round(rss_start), "-", True)
    check("VmRSS after warm-up (MiB)", round(rss_warm), "-", True)
    check("VmRSS after the plain soak (MiB)", round(rss_plain), "-", True)
    check("VmRSS at end (MiB)", round(rss_end), f"<= after warm-up + {_RSS_TOL.value:g}",
          rss_end - rss_warm <= _RSS_TOL.value)
    check("server alive at end", alive, "True", alive)
    check("server exit code (SIGTERM)", rc, "0", rc == 0)

    every = results + ([{**r, "i": f"h{r['i']}"} for r in hostile_results] if _HOSTILE.value else [])
    for r in every:
        if r["error"]:
            print(f"FAILED #{r['i']} {r['kind']} {r['name']}: {r['error']}")
    load = (f"load average 1/5/15 min before {'/'.join(f'{x:.2f}' for x in load_before)}, "
            f"after {'/'.join(f'{x:.2f}' for x in load_after)}")
    counts = ", ".join(f"{len(v)} {k}" for k, v in by_kind.items())
    title = (f"HTTP soak: {len(results)} concurrent requests ({counts}), max_tokens={_MAX_TOKENS.value}, "
             f"max_num_seqs={_MAX_NUM_SEQS.value}, config {_CONFIG.value}"
             + (f"; then the same with {_HOSTILE.value} hostile requests mixed in" if _HOSTILE.value else ""))
    B.report("soak_http", rows, COLUMNS, title=title)
    print(load)
    lines = [f"{title}; {B.machine()}, {B.today()}; {load}", "", B.markdown_table(rows, COLUMNS), ""]
    lines.append("Server: `" + " ".join(server.cmd[1:]).replace(str(server.port), "PORT") + "`")
    if failures:
        lines += ["", "Failures:", *[f"- {f}" for f in failures]]
        lines += [f"- request #{r['i']} ({r['kind']} {r['name']}): {r['error']}" for r in every if r["error"]][:50]
    B.write_markdown("soak_http", "\n".join(lines))
    if failures:
        print("\nserver log tail:\n" + log_tail)
        print(f"\n{len(failures)} check(s) failed:\n" + "\n".join(failures))
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    app.run(main)
