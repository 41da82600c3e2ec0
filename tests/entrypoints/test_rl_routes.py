"""The RL rollout routes (--enable_rl_routes): /pause, /resume, /sleep, /wake_up,
/is_paused, /is_sleeping, /update_weights, /reset_prefix_cache, as verl, slime
and OpenRLHF call them on vLLM/SGLang servers.  In process on the tiny Llama
(uvicorn in a thread); the oracle is the Python API on the same engine, asked
before the server takes it."""

from __future__ import annotations

import json
import pathlib
import threading
import urllib.error
import urllib.request

import pytest

uvicorn = pytest.importorskip("uvicorn")

from helpers import TINY_ENGINE, serve_in_thread  # noqa: E402
from jpaged.core.sequence import SamplingParams  # noqa: E402
from jpaged.entrypoints.openai.app import create_app  # noqa: E402
from jpaged.entrypoints.openai.state import ServerOptions  # noqa: E402

SECONDS = 60
NEW_TOKENS = 8
PROMPT = "Tell me about the sea."


def http(method: str, url: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=SECONDS) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def complete(url: str, max_tokens: int = NEW_TOKENS) -> tuple[int, dict]:
    return http("POST", url + "/v1/completions", {"prompt": PROMPT, "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True})


def text(url: str) -> str:
    status, body = complete(url)
    assert status == 200, body
    return body["choices"][0]["text"]


@pytest.fixture(scope="module")
def served(tiny_llama_tok_dir):
    """(base url, expected greedy text, model dir) of a server with the RL routes on."""
    from jpaged.engine.llm import LLM
    llm = LLM(model=tiny_llama_tok_dir, **TINY_ENGINE)
    expected = llm.generate([PROMPT], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                     ignore_eos=True))[0].text
    app = create_app(llm, model_name="tiny", options=ServerOptions(enable_rl_routes=True))
    with serve_in_thread(app, SECONDS) as url:
        yield url, expected, tiny_llama_tok_dir


def test_pause_keep_holds_requests_until_resume(served):
    url, expected, _ = served
    assert http("POST", url + "/pause", {"mode": "keep"}) == (200, {"status": "ok"})
    assert http("GET", url + "/is_paused") == (200, {"is_paused": True})
    result = {}
    worker = threading.Thread(target=lambda: result.update(answer=complete(url)))
    worker.start()
    worker.join(1.0)
    assert worker.is_alive() and not result  # queued behind the pause
    assert http("POST", url + "/resume") == (200, {"status": "ok"})
    worker.join(SECONDS)
    status, body = result["answer"]
    assert status == 200 and body["choices"][0]["text"] == expected
    assert http("GET", url + "/is_paused") == (200, {"is_paused": False})


def test_sleep_and_wake_up(served):
    url, expected, _ = served
    assert http("GET", url + "/is_sleeping") == (200, {"is_sleeping": False})
    assert http("POST", url + "/sleep", {"level": 1}) == (200, {"status": "ok"})
    assert http("GET", url + "/is_sleeping") == (200, {"is_sleeping": True})
    status, body = complete(url)
    assert status == 503 and "asleep" in body["error"]["message"]
    assert http("POST", url + "/wake_up") == (200, {"status": "ok"})
    assert http("GET", url + "/is_sleeping") == (200, {"is_sleeping": False})
    assert text(url) == expected


def test_sleep_level_2_needs_new_weights(served):
    """vLLM's query-parameter form; waking without weights is a 400, /update_weights
    while asleep gives them."""
    url, expected, model_dir = served
    assert http("POST", url + "/sleep?level=2") == (200, {"status": "ok"})
    status, body = http("POST", url + "/wake_up")
    assert status == 400 and body["error"]["message"]
    assert http("GET", url + "/is_sleeping") == (200, {"is_sleeping": True})
    assert http("POST", url + "/update_weights", {"path": model_dir}) == (200, {"status": "ok"})
    assert http("POST", url + "/wake_up") == (200, {"status": "ok"})
    assert text(url) == expected


def test_sleep_with_a_request_in_flight_is_400(served):
    """A streamed request that has started, then frozen by /pause (keep), is
    unfinished: /sleep refuses (400, the engine's message); after /resume it ends."""
    url, _, _ = served
    req = urllib.request.Request(url + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"prompt": PROMPT, "max_tokens": 100, "temperature": 0,
                                                  "ignore_eos": True, "stream": True}).encode())
    with urllib.request.urlopen(req, timeout=SECONDS) as stream:
        assert stream.readline().startswith(b"data: {")  # running
        assert http("POST", url + "/pause", {"mode": "keep"})[0] == 200
        status, body = http("POST", url + "/sleep", {"level": 1})
        assert status == 400 and "unfinished" in body["error"]["message"]
        assert http("GET", url + "/is_sleeping") == (200, {"is_sleeping": False})
        assert http("POST", url + "/resume")[0] == 200
        lines = [line for line in stream.read().split(b"\n") if line.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_update_weights(served):
    url, expected, model_dir = served
    assert http("POST", url + "/update_weights", {"path": model_dir, "in_flight": "keep"}) == (200, {"status": "ok"})
    assert text(url) == expected
    assert http("POST", url + "/update_weights", {"model_path": model_dir})[0] == 200  # SGLang's name
    status, body = http("POST", url + "/update_weights", {"path": model_dir + "/nowhere"})
    assert status == 400 and "nowhere" in body["error"]["message"]
    status, body = http("POST", url + "/update_weights", {})
    assert status == 400 and body["error"]["param"] == "path"
    status, body = http("POST", url + "/update_weights", {"path": model_dir, "in_flight": "later"})
    assert status == 400 and body["error"]["param"] == "in_flight"
    assert text(url) == expected


def test_bad_fields_and_reset_prefix_cache(served):
    url, _, _ = served
    status, body = http("POST", url + "/pause", {"mode": "now"})
    assert status == 400 and body["error"]["param"] == "mode"
    status, body = http("POST", url + "/sleep", {"level": 3})
    assert status == 400 and body["error"]["param"] == "level"
    assert http("POST", url + "/reset_prefix_cache") == (200, {"status": "ok"})


@pytest.mark.parametrize("path, body, param, words", [
    ("/sleep?level=%C2%B2", None, "level", "level must be 1 or 2, got '²'"),  # '²'.isdigit() is true
    ("/sleep?level=1&level=2", None, "level", "given more than once"),
    ("/sleep?level=01", None, "level", "level must be 1 or 2"),
    ("/sleep?level=1", {"level": True}, "level", "must be an integer"),
    ("/sleep", {"level": 1.0}, "level", "must be an integer"),
    ("/sleep", {"level": 1, "tags": ["weights"]}, "tags", "Extra inputs"),
    ("/sleep?lvl=1", None, "lvl", "Extra inputs"),
    ("/pause", {"mod": "keep"}, "mod", "Extra inputs"),
    ("/pause?mode=keep&mode=abort", None, "mode", "given more than once"),
    ("/resume", [1], None, "JSON object"),
    ("/update_weights", {"path": "/", "in_flight": "keep", "load_format": "hf"}, "load_format", "Extra inputs"),
    ("/is_paused?x=1", None, "x", "no query parameters"),
    ("/wake_up?tags=weights&tags=gpu", None, "tags", "'weights' or 'kv_cache'"),
])
def test_rl_inputs_are_strict(served, path, body, param, words):
    """Every RL route input is a 400 naming its field; nothing changes, the server serves on."""
    url, expected, _ = served
    status, answer = http("GET" if path.startswith("/is_") else "POST", url + path, body)
    assert (status, answer["error"]["param"]) == (400, param) and words in answer["error"]["message"], answer
    assert http("GET", url + "/is_sleeping") == (200, {"is_sleeping": False})
    assert http("GET", url + "/is_paused") == (200, {"is_paused": False})
    assert text(url) == expected


def test_wake_up_takes_vllms_tags(served):
    """vLLM's /wake_up?tags=weights&tags=kv_cache (the query's list repeated, or the body's):
    jpaged wakes the whole engine."""
    url, expected, _ = served
    for query, body in (("?tags=weights&tags=kv_cache", None), ("?tags=weights", None), ("", {"tags": ["kv_cache"]})):
        assert http("POST", url + "/sleep") == (200, {"status": "ok"})
        assert http("POST", url + "/wake_up" + query, body) == (200, {"status": "ok"})
        assert http("GET", url + "/is_sleeping") == (200, {"is_sleeping": False})
    assert text(url) == expected


def test_update_weights_names_only_its_fields(served, tmp_path):
    """A path that is not a checkpoint, missing or not, is one 400 naming "path" (not
    load_format, which the route has not, nor what the disk holds)."""
    url, expected, model_dir = served
    (tmp_path / "file.bin").write_bytes(b"x")
    messages = set()
    for path in (tmp_path / "missing", tmp_path, tmp_path / "file.bin", "x" * 5000, "a\0b"):
        status, body = http("POST", url + "/update_weights", {"path": str(path)})
        assert (status, body["error"]["param"]) == (400, "path"), body
        assert "load_format" not in body["error"]["message"]
        if isinstance(path, pathlib.Path):
            messages.add(body["error"]["message"].replace(str(path), "<path>"))
    assert len(messages) == 1, messages
    assert text(url) == expected


def test_off_by_default_and_behind_the_key(tiny_llm):
    """Without the option the routes are 404s; with a key they need it (the
    engine never starts here: no lifespan, so a keyed call gets "not ready")."""
    from starlette.testclient import TestClient
    off = TestClient(create_app(tiny_llm, model_name="tiny"))
    assert off.post("/pause").status_code == 404
    assert off.get("/is_sleeping").status_code == 404
    keyed = TestClient(create_app(tiny_llm, model_name="tiny",
                                  options=ServerOptions(api_key="k", enable_rl_routes=True)))
    assert keyed.post("/pause").status_code == 401
    assert keyed.post("/update_weights", json={"path": "/"}).status_code == 401
    assert keyed.post("/pause", headers={"Authorization": "Bearer k"}).status_code == 503
