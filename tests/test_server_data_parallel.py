"""The HTTP server over a data-parallel engine: create_app(DataParallelLLM) on two
of the simulated CPU devices (conftest.py), served by uvicorn in a thread and
asked over HTTP.  Greedy answers are the single engine's tokens, requests
reach both replicas, and /metrics reads the combined snapshot."""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import pytest

uvicorn = pytest.importorskip("uvicorn")

from helpers import TINY_ENGINE, serve_in_thread, parse_metrics, random_prompts  # noqa: E402
from jpaged.core.sequence import SamplingParams  # noqa: E402
from jpaged.engine.router import DataParallelLLM, create_engine  # noqa: E402
from jpaged.entrypoints.server import create_app  # noqa: E402

PROMPTS = random_prompts([5, 17, 40, 3, 29, 11], seed=11)
MAX_TOKENS = 12
SECONDS = 120  # every wait has a deadline



def http(method: str, url: str, body: dict | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=SECONDS) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metrics(url: str) -> dict[str, float]:
    status, text = http("GET", url + "/metrics")
    assert status == 200
    return parse_metrics(text)


@pytest.fixture(scope="module")
def expected(make_tiny_llm):
    return [o.token_ids for o in make_tiny_llm().generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))]


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    """(base url, the engine) of a server running in this process."""
    dp = create_engine(model=tiny_llama_dir, **TINY_ENGINE, data_parallel_size=2)
    assert isinstance(dp, DataParallelLLM)
    with serve_in_thread(create_app(dp, model_name="tiny"), SECONDS) as url:
        yield url, dp


def test_greedy_requests_get_the_single_engine_tokens(served, expected):
    url, dp = served
    before = [r["requests"] for r in dp.replica_summary()]

    def ask(prompt):
        status, text = http("POST", url + "/generate", {"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                        "temperature": 0})
        assert status == 200, text
        return json.loads(text)["token_ids"]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: both replicas busy
        got = list(pool.map(ask, PROMPTS))
    assert got == expected
    sent = [r["requests"] - b for r, b in zip(dp.replica_summary(), before)]
    assert sum(sent) == len(PROMPTS) and all(sent), sent
    # A batch of prompts in one request is routed prompt by prompt too.
    status, text = http("POST", url + "/v1/completions", {"model": "tiny", "prompt": PROMPTS[:3],
                                                          "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200, text
    assert [c["finish_reason"] for c in json.loads(text)["choices"]] == ["length"] * 3


def test_metrics_read_the_combined_snapshot(served):
    url, dp = served
    deadline = time.monotonic() + SECONDS
    while (m := metrics(url))["vllm:num_requests_running"] or m["vllm:kv_cache_usage_perc"]:
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    snap = dp.snapshot()
    assert snap.num_blocks == sum(r.num_blocks for r in dp.replicas)
    assert m["vllm:cache_config_info{block_size=16,enable_prefix_caching=False,num_gpu_blocks=%d}"
             % snap.num_blocks] == 1
    assert m["vllm:prefix_cache_queries_total"] == snap.totals.prompt_tokens > 0
    assert m["vllm:request_success_total{finished_reason=length}"] >= len(PROMPTS)
    assert not dp.has_unfinished_requests() and not dp._requests  # the router forgot finished requests
