"""Two jpaged replicas on Ray Serve (jpaged.entrypoints.ray_serve): a local Ray on
loopback, the tiny Llama in each replica (one process each), requests over HTTP
to Ray's proxy.  Both replicas answer, every greedy answer is the in-process
engine's, and each replica exports its own vLLM-named load and prefix-cache metrics."""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
import urllib.error
import urllib.request

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from helpers import TINY_ENGINE, free_port  # noqa: E402
from jpaged.core.sequence import SamplingParams  # noqa: E402
from jpaged.entrypoints.ray_serve import REPLICA_HEADER, deployment, replica_metrics  # noqa: E402

SECONDS = 120  # every wait has a deadline
MAX_TOKENS = 8
PROMPTS = ["The quick brown fox", "jumps over", "the lazy dog.", "Paged attention", "Ray Serve", "hello world",
           "0123456789", "abc abc abc abc"]
LLM_D_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits", "vllm:prefix_cache_queries")



def post(url: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=SECONDS) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"{}")


def metric_values(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value  # summed over labels
    return out


@pytest.fixture(scope="module")
def fields(tiny_llama_tok_dir):
    # prefix caching on: the prefix-cache counters the endpoint picker reads move
    return dict(model=tiny_llama_tok_dir, **{**TINY_ENGINE, "enable_prefix_caching": True})


@pytest.fixture(scope="module")
def expected(fields):
    from jpaged.engine.llm import LLM
    llm = LLM(**fields)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return [(o.token_ids, o.text) for o in outs]


@pytest.fixture(scope="module")
def proxy(fields):
    """The base URL of Ray's proxy in front of two replicas; Ray is shut down after."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=200 * 2**20, log_to_driver=False, configure_logging=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = deployment(fields, num_replicas=2, model_name="tiny")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # serve.run waits for the replicas: bounded
            pool.submit(serve.run, app, name="default", route_prefix="/").result(timeout=SECONDS)
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def test_two_replicas_greedy_and_metrics(proxy, expected):
    t0 = time.monotonic()
    replicas: dict[str, int] = {}
    answers: dict[int, tuple[list[int], str]] = {}

    def ask(i: int) -> None:
        status, headers, body = post(proxy + "/generate", {"prompt": PROMPTS[i], "max_tokens": MAX_TOKENS,
                                                           "temperature": 0})
        assert status == 200, body
        replica = {k.lower(): v for k, v in headers.items()}[REPLICA_HEADER]
        replicas[replica] = replicas.get(replica, 0) + 1
        answers[i] = (body["token_ids"], body["text"])

    # Rounds of concurrent requests until both replicas have answered (Ray's
    # router spreads them by requests in flight; a round usually reaches both).
    rounds = 0
    while len(replicas) < 2 and time.monotonic() - t0 < SECONDS:
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            list(pool.map(ask, range(len(PROMPTS))))
        rounds += 1
        assert [answers[i] for i in range(len(PROMPTS))] == expected  # greedy-exact, whichever replica answered
    assert len(replicas) == 2, replicas

    # The OpenAI route through the proxy: the same greedy text.
    status, headers, body = post(proxy + "/v1/completions", {"model": "tiny", "prompt": PROMPTS[0],
                                                              "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"] == expected[0][1], body

    # Each replica's own registry, over Ray's handles: the llm-d names, and together
    # they counted every request sent.
    per_replica = replica_metrics("default", timeout=SECONDS)
    assert set(per_replica) == set(replicas)
    queries = 0.0
    for replica, text in per_replica.items():
        values = metric_values(text)
        for name in LLM_D_METRICS:
            assert name in values or name + "_total" in values, (replica, name)
        assert values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0
        assert 0 <= values["vllm:kv_cache_usage_perc"] <= 1
        queries += values.get("vllm:prefix_cache_queries_total", values.get("vllm:prefix_cache_queries", 0))
        assert values["vllm:request_success_total"] > 0  # every replica served something
    assert queries > 0

    # /metrics through the proxy: one replica's, named by the header.
    with urllib.request.urlopen(proxy + "/metrics", timeout=SECONDS) as r:
        assert r.headers[REPLICA_HEADER] in replicas
        assert "vllm:num_requests_waiting" in r.read().decode()
    with urllib.request.urlopen(proxy + "/health", timeout=SECONDS) as r:
        assert r.status == 200


# ------------------------------------------------- the docs' Ray Serve examples (docs/parallelism.md)
class RayCalls:
    """ray.init / serve.start / serve.run / serve.shutdown as the examples call them, recorded
    instead of run: a cluster and GPUs that this machine does not have (the calls themselves
    run for real in test_two_replicas_greedy_and_metrics above)."""

    def __init__(self, monkeypatch):
        self.calls: dict[str, tuple] = {}
        for owner, name in ((ray, "init"), (serve, "start"), (serve, "run"), (serve, "shutdown")):
            monkeypatch.setattr(owner, name, self.recorder(name))

    def recorder(self, name):
        return lambda *args, **kwargs: self.calls.setdefault(name, (args, kwargs))


def test_docs_ray_serve_example(monkeypatch, tiny_llama_tok_dir):
    """The Python example builds the application it describes: 4 replicas of 2 GPUs each,
    the config's fields (its model path swapped for a checkpoint this machine has)."""
    from doc_examples import marked_blocks
    [code] = marked_blocks("docs/parallelism.md", "test_docs_ray_serve_example")
    assert '"/models/llama-3-8b"' in code
    calls = RayCalls(monkeypatch)
    exec(compile(code.replace('"/models/llama-3-8b"', repr(tiny_llama_tok_dir)), "docs/parallelism.md", "exec"), {})
    assert calls.calls["init"] == ((), {})
    assert calls.calls["start"] == ((), {"http_options": {"host": "0.0.0.0", "port": 8000}})
    (app,), kwargs = calls.calls["run"]
    assert kwargs == {"route_prefix": "/"}
    bound = app._bound_deployment
    assert (bound.num_replicas, bound.ray_actor_options["num_gpus"]) == (4, 2)
    assert bound.init_args[0]["tensor_parallel_size"] == 2 and bound.init_args[0]["model"] == tiny_llama_tok_dir


def test_docs_ray_serve_command(monkeypatch):
    """The documented `python -m jpaged.entrypoints.ray_serve ...` line, through the command's
    main(): the application it hands to Ray, served until interrupted, then shut down."""
    import shlex
    import signal as signal_module

    from doc_examples import ROOT, marked_blocks
    from jpaged.entrypoints import ray_serve
    [code] = marked_blocks("docs/parallelism.md", "test_docs_ray_serve_command", language="bash")
    line = code.replace("\\\n", " ").replace("[", "").replace("]", "")
    argv = shlex.split(line)
    assert argv[:3] == ["python", "-m", "jpaged.entrypoints.ray_serve"]
    calls = RayCalls(monkeypatch)
    sleep = ray_serve.time.sleep

    def interrupted_wait(seconds):  # main() serves until interrupted: interrupt its first wait
        if seconds == 3600:
            raise KeyboardInterrupt
        sleep(seconds)
    monkeypatch.setattr(ray_serve.time, "sleep", interrupted_wait)
    monkeypatch.chdir(ROOT)  # the command's --config path is the repository's
    monkeypatch.setattr(ray_serve.signal, "signal", lambda *a: None)  # the test process keeps its handlers
    assert ray_serve.main(argv[3:]) == 0
    assert calls.calls["init"] == ((), {"address": "auto"})
    assert calls.calls["start"] == ((), {"http_options": {"host": "0.0.0.0", "port": 8000}})
    (app,), kwargs = calls.calls["run"]
    assert kwargs == {"name": "jpaged", "route_prefix": "/"} and "shutdown" in calls.calls
    bound = app._bound_deployment
    assert (bound.num_replicas, bound.ray_actor_options) == (2, {"num_cpus": 1, "num_gpus": 1})
    assert bound.init_args[0]["max_num_seqs"] == 16
    assert signal_module.getsignal(signal_module.SIGTERM) is not signal_module.default_int_handler
