"""The HTTP server's hardening (issue 22), in process on the tiny Llama with a
byte-level tokenizer, uvicorn in a thread on 127.0.0.1: the event loop never
waits on host work, body and prompt caps, the API key, connection limits and
timeouts, the queue bound, a drain that ends streams properly, vLLM's tokenizer
routes and OpenAI conformance.  Every wait has a deadline."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import signal
import socket
import threading
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")

from helpers import TINY_ENGINE, free_port, random_prompts  # noqa: E402
from jpaged.entrypoints import serve  # noqa: E402
from jpaged.entrypoints.openai.app import create_app  # noqa: E402
from jpaged.entrypoints.openai.guard import DrainingServer, RequestGuard, uvicorn_config  # noqa: E402
from jpaged.entrypoints.openai.state import ServerOptions  # noqa: E402

KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_QUEUED = 8
SECONDS = 60  # any one wait
OPTIONS = ServerOptions(api_key=KEY, body_timeout_seconds=2.0, header_timeout_seconds=1.0)



class Served:
    """A DrainingServer on 127.0.0.1 in a thread."""

    def __init__(self, engine, options: ServerOptions, grace_seconds: float = 30.0):
        self.port = free_port()
        self.app = create_app(engine, model_name="tiny", options=options)
        config = uvicorn_config(self.app, "127.0.0.1", self.port, access_log=False, log_level="warning",
                                timeout_graceful_shutdown=grace_seconds)
        self.server = DrainingServer(config, self.app.state.jpaged, grace_seconds)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + SECONDS
        while self.request("GET", "/health", timeout=5, quiet=True)[0] != 200:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not get ready"
            time.sleep(0.1)

    def request(self, method: str, path: str, body=None, headers=None, timeout: float = SECONDS,
                quiet: bool = False) -> tuple[int, dict, bytes]:
        """(status, lower-cased headers, body); (0, {}, b"") for no connection when quiet."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
            conn.request(method, path, body=data, headers={"Content-Type": "application/json", **AUTH,
                                                           **(headers or {})})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        except OSError:
            if quiet:
                return 0, {}, b""
            raise
        finally:
            conn.close()

    def json(self, method: str, path: str, body=None, **kw) -> tuple[int, dict]:
        status, _, data = self.request(method, path, body, **kw)
        return status, json.loads(data)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(SECONDS)


def raw_exchange(port: int, data: bytes, read_seconds: float = 10) -> bytes:
    """Sends `data` on a fresh connection; what comes back until it closes (or the deadline)."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_seconds) as s:
        s.sendall(data)
        out = b""
        deadline = time.monotonic() + read_seconds
        while time.monotonic() < deadline:
            try:
                part = s.recv(65536)
            except socket.timeout:
                break
            if not part:
                break
            out += part
        return out


@pytest.fixture(scope="module")
def llm(tiny_llama_tok_dir):
    from jpaged.engine.llm import LLM
    return LLM(model=tiny_llama_tok_dir, **TINY_ENGINE, max_queued_requests=MAX_QUEUED)


@pytest.fixture(scope="module")
def served(llm):
    srv = Served(llm, OPTIONS)
    try:
        yield srv
    finally:
        srv.stop()


def health_latencies_while(srv: Served, busy: threading.Thread) -> list[float]:
    """GET /health again and again while `busy` runs: each answer's latency."""
    latencies = []
    while busy.is_alive():
        t0 = time.monotonic()
        status, _, _ = srv.request("GET", "/health", timeout=10, headers={"Authorization": ""})
        latencies.append(time.monotonic() - t0)
        assert status == 200
        time.sleep(0.01)
    return latencies


# ------------------------------------------------- 1. the loop never waits
def test_health_answers_while_a_huge_prompt_is_refused(served):
    """A 15 MB prompt, sent over ~0.5 s: refused by max_prompt_bytes before any
    tokenizing (the old server tokenized it on the event loop, for seconds)."""
    body = json.dumps({"model": "tiny", "prompt": "ab" * 7_500_000, "max_tokens": 1}).encode()
    result = {}

    def send():
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=SECONDS)
        conn.putrequest("POST", "/v1/completions")
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(body)), **AUTH}.items():
            conn.putheader(k, v)
        conn.endheaders()
        step = 1 << 20
        for i in range(0, len(body), step):
            conn.send(body[i:i + step])
            time.sleep(0.03)
        r = conn.getresponse()
        result["status"], result["body"] = r.status, json.loads(r.read())
        conn.close()
    busy = threading.Thread(target=send)
    busy.start()
    latencies = health_latencies_while(served, busy)
    busy.join()
    assert result["status"] == 400, result
    error = result["body"]["error"]
    assert error["param"] == "prompt" and "max_prompt_bytes" in error["message"] and "65536" in error["message"]
    assert latencies and max(latencies) < 0.5, latencies


def test_the_loop_does_not_wait_on_tokenizing(served, llm, monkeypatch):
    tokenize = llm.tokenize

    def slow_tokenize(prompt):
        time.sleep(1.5)  # a slow chat template / tokenizer (releasing the GIL, as a native one may)
        return tokenize(prompt)
    monkeypatch.setattr(llm, "tokenize", slow_tokenize)
    result = {}
    busy = threading.Thread(target=lambda: result.update(zip(("status", "body"), served.json(
        "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))))
    busy.start()
    latencies = health_latencies_while(served, busy)
    busy.join()
    assert result["status"] == 200, result
    assert len(latencies) > 3 and max(latencies) < 0.5, latencies


# ------------------------------------------------------------- 2. the key
def test_every_route_but_health_needs_the_key(served):
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize"),
                             ("GET", "/no/such/route")]:
            status, got, data = served.request(method, path, {"prompt": "hi"}, headers=headers)
            error = json.loads(data)["error"]
            assert (status, error["code"], error["type"]) == (401, "invalid_api_key", "invalid_request_error")
            assert got["www-authenticate"] == "Bearer"
    assert served.request("GET", "/health", headers={"Authorization": ""})[0] == 200
    assert served.request("GET", "/metrics", headers={"Authorization": ""})[0] == 200  # (by default)
    assert served.request("GET", "/v1/models", headers={"Authorization": f"bearer {KEY}"})[0] == 200
    # /metrics behind the key on request; the key from the environment when --api_key is not given.
    state = served.app.state.jpaged
    guard = RequestGuard(None, state)
    scope = {"path": "/metrics", "headers": []}
    assert guard._check_headers(scope, state.options) is None
    assert guard._check_headers(scope, ServerOptions(api_key=KEY, metrics_require_key=True).resolved(
        state.config)).status == 401
    assert serve.server_options(serve.Args(), {"JPAGED_API_KEY": "k"}).api_key == "k"
    assert serve.server_options(serve.Args(api_key="a"), {"JPAGED_API_KEY": "k"}).api_key == "a"
    assert serve.server_options(serve.Args(), {}).api_key is None


def test_an_open_address_without_a_key_is_warned_about():
    assert serve.open_address_warning("0.0.0.0", None) and "JPAGED_API_KEY" in serve.open_address_warning(
        "0.0.0.0", None)
    assert serve.open_address_warning("10.1.2.3", None) and serve.open_address_warning("my-host", None)
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert serve.open_address_warning(host, None) is None
    assert serve.open_address_warning("0.0.0.0", "key") is None


# ------------------------------------------------ 3. connection hygiene
def head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {KEY}",
             "Content-Type: application/json", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


def test_framing_and_size_limits(served):
    cap = served.app.state.jpaged.options.max_request_body_bytes
    # Transfer-Encoding with Content-Length: refused (request smuggling).
    body = b'{"prompt": "hi", "max_tokens": 1}'
    reply = raw_exchange(served.port, head("/v1/completions", {"Content-Length": str(len(body)),
                                                              "Transfer-Encoding": "chunked"})
                         + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    assert status_of(reply) == 400, reply[:300]
    # A head over 16 KiB: 400.
    reply = raw_exchange(served.port, head("/v1/completions", {"X-Big": "y" * 20_000, "Content-Length": "0"}))
    assert status_of(reply) == 400, reply[:300]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"
    # A Content-Length over the cap: 413 before a byte of the body is read.
    reply = raw_exchange(served.port, head("/v1/completions", {"Content-Length": str(cap + 1)}))
    assert status_of(reply) == 413 and b"max_request_body_bytes" in reply, reply[:300]
    # A chunked body is held to the same cap as it arrives.
    chunk = b"x" * (1 << 20)
    with socket.create_connection(("127.0.0.1", served.port), timeout=SECONDS) as s:
        s.sendall(head("/v1/completions", {"Transfer-Encoding": "chunked"}))
        try:
            for _ in range(cap // len(chunk) + 2):
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except OSError:
            pass  # the server answered and closed
        reply = b""
        while b"max_request_body_bytes" not in reply and (part := s.recv(65536)):
            reply += part
    assert status_of(reply) == 413 and b"max_request_body_bytes" in reply, reply[:300]


def test_connections_past_the_limit_get_503(served):
    """limit_concurrency live: with that many connections open, one more request
    gets uvicorn's 503; once they close (the header timeout cuts idle ones), 200."""
    limit = served.server.config.limit_concurrency
    assert limit is not None and limit < 200
    idle = [socket.create_connection(("127.0.0.1", served.port), timeout=SECONDS) for _ in range(limit)]
    try:
        time.sleep(0.1)  # let the server accept them all
        assert status_of(raw_exchange(served.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")) == 503
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + SECONDS
    while served.request("GET", "/health", timeout=5, quiet=True)[0] != 200:
        assert time.monotonic() < deadline, "the server did not take connections again"
        time.sleep(0.1)


def test_slow_bodies_and_slow_headers_are_cut(served):
    t0 = time.monotonic()
    reply = raw_exchange(served.port, head("/v1/completions", {"Content-Length": "100"}) + b'{"prompt": ')
    assert status_of(reply) == 408 and b"body_timeout_seconds" in reply, reply[:300]
    assert time.monotonic() - t0 < 1.9 + 5
    # Header bytes trickling in: the connection is closed after header_timeout_seconds (1 s).
    with socket.create_connection(("127.0.0.1", served.port), timeout=SECONDS) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        closed = False
        while time.monotonic() - t0 < 10 and not closed:
            try:
                s.sendall(b"X")
                s.settimeout(0.3)
                closed = s.recv(100) == b""
            except socket.timeout:
                pass
            except OSError:
                closed = True
        assert closed and time.monotonic() - t0 < 5
    # Connections and tasks are bounded (uvicorn's 503 past the limit), and the head's size.
    config = uvicorn_config(served.app)
    state = served.app.state.jpaged
    assert config.limit_concurrency == 2 * (MAX_QUEUED + state.config.max_num_seqs) + 64
    assert config.h11_max_incomplete_event_size == 16 * 1024 and config.timeout_keep_alive == 5.0


# ------------------------------------------------------- 4. the queue bound
def test_more_prompts_than_the_queue_holds_is_a_400(served):
    status, body = served.json("POST", "/v1/completions", {"prompt": ["hi"] * (MAX_QUEUED + 1), "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "prompt", body
    assert "max_queued_requests" in body["error"]["message"] and str(MAX_QUEUED) in body["error"]["message"]
    status, body = served.json("POST", "/v1/completions", {"prompt": ["hi"] * MAX_QUEUED, "max_tokens": 1})
    assert status == 200 and len(body["choices"]) == MAX_QUEUED


# --------------------------------------------------- 6. tokenizer routes
def test_tokenizer_routes_in_vllms_shapes(served, llm):
    status, body = served.json("POST", "/tokenize", {"model": "tiny", "prompt": "héllo"})
    assert status == 200 and body["tokens"] == llm.tokenize("héllo")
    assert (body["count"], body["max_model_len"], body["token_strs"]) == (len(body["tokens"]), 128, None)
    messages = [{"role": "user", "content": "hi there"}]
    status, chat = served.json("POST", "/tokenize", {"messages": messages, "return_token_strs": True})
    assert status == 200 and chat["tokens"] == llm.tokenize({"messages": messages})
    assert "".join(chat["token_strs"]) == llm.tokenizer.decode(chat["tokens"], skip_special_tokens=False)
    status, back = served.json("POST", "/detokenize", {"model": "tiny", "tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": "héllo"}
    status, info = served.json("GET", "/tokenizer_info")
    assert status == 200 and info["model_max_length"] == 128 and info["chat_template"] == llm.tokenizer.chat_template
    assert info["tokenizer_class"] and info["vocab_size"] == llm.tokenizer.vocab_size
    for path, bad, param in [("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                             ("/tokenize", {"prompt": 3}, "prompt"),
                             ("/tokenize", {"prompt": "a" * 70_000}, "prompt"),
                             ("/detokenize", {"tokens": [1, 10**6]}, "tokens")]:
        status, body = served.json("POST", path, bad)
        assert (status, body["error"]["param"]) == (400, param), body
    status, body = served.json("POST", "/tokenize", {"model": "other", "prompt": "a"})
    assert (status, body["error"]["code"]) == (404, "model_not_found")


# --------------------------------------------------------- 7. conformance
def test_models_routes_and_unknown_routes(served):
    status, card = served.json("GET", "/v1/models/tiny")
    assert status == 200 and card["id"] == "tiny" and card["object"] == "model"
    status, body = served.json("GET", "/v1/models/other")
    assert (status, body["error"]["code"]) == (404, "model_not_found")
    for method, path in [("GET", "/v1/nope"), ("POST", "/nope"), ("GET", "/v1/completions")]:
        status, body = served.json(method, path)
        assert status in (404, 405) and set(body) == {"error"} and body["error"]["message"], body
    assert served.json("GET", "/v1/nope")[0] == 404
    status, body = served.json("POST", "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert (status, body["error"]["code"], body["error"]["param"]) == (404, "model_not_found", "model")
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key=KEY, max_retries=0, timeout=30)
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).models.list()


def test_prompt_plus_max_tokens_beyond_max_model_len_is_a_400(served):
    prompt = random_prompts([100], seed=3)[0]
    for route, body, param in [("/v1/completions", {"prompt": prompt, "max_tokens": 40}, "max_tokens"),
                               ("/generate", {"prompt": prompt, "max_tokens": 40}, "max_tokens"),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 100}],
                                                         "max_completion_tokens": 40}, "max_completion_tokens")]:
        status, got = served.json("POST", route, body)
        assert status == 400 and got["error"]["param"] == param, got
        assert "maximum context length is 128 tokens" in got["error"]["message"]
        assert got["error"]["code"] == "context_length_exceeded"
    # Without max_tokens: the default, cut at max_model_len as the generation goes (as before).
    status, got = served.json("POST", "/v1/completions", {"prompt": prompt, "ignore_eos": True})
    assert status == 200 and got["choices"][0]["finish_reason"] == "length"
    assert got["usage"]["prompt_tokens"] + got["usage"]["completion_tokens"] == 128
    status, got = served.json("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 28, "ignore_eos": True})
    assert status == 200 and got["usage"]["completion_tokens"] == 28


def test_completions_logprobs_0_give_the_sampled_tokens_entry(served):
    for echo in (False, True):
        status, got = served.json("POST", "/v1/completions", {"prompt": "hello", "max_tokens": 4, "logprobs": 0,
                                                              "echo": echo, "temperature": 0})
        assert status == 200, got
        lp = got["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == 4 + 5 * echo
        for i, (token, value, top) in enumerate(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])):
            if echo and i == 0:
                assert value is None and top is None
            else:
                assert top == {token: value}, (i, top)


# ------------------------------------------------------------- 5. drain
class SlowSteps:
    """An engine whose steps take 50 ms more: a stream still runs at the drain's deadline."""

    def __init__(self, llm):
        self._llm = llm

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def step(self):
        time.sleep(0.05)
        return self._llm.step()


def test_a_stream_cut_by_the_drain_ends_with_abort_and_done(tiny_llama_tok_dir, caplog):
    from jpaged.engine.llm import LLM
    engine = SlowSteps(LLM(model=tiny_llama_tok_dir, **TINY_ENGINE))
    srv = Served(engine, ServerOptions(), grace_seconds=1.0)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=SECONDS)
        conn.request("POST", "/v1/completions", body=json.dumps({
            "prompt": [5, 6, 7], "max_tokens": 120, "ignore_eos": True, "stream": True}),
            headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        lines = [r.readline()]
        with caplog.at_level(logging.INFO):
            srv.server.handle_exit(signal.SIGTERM, None)
            while lines[-1]:
                lines.append(r.readline())
            srv.thread.join(SECONDS)
        assert not srv.thread.is_alive()
    finally:
        srv.stop()
    events = [line.decode().strip()[len("data: "):] for line in lines if line.startswith(b"data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert reasons[-1] == "abort" and reasons.count(None) == len(reasons) - 1 and len(reasons) < 120
    records = [r for r in caplog.records if r.name.startswith("jpaged")]
    assert [r.levelno for r in records].count(logging.WARNING) == 1, [r.getMessage() for r in records]
    assert any("grace period over" in r.getMessage() for r in records)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
