"""The HTTP server over a data-parallel engine: create_app(DataParallelLLM) on two
of the simulated CPU devices (conftest.py), served by uvicorn in a thread and
asked over HTTP.  Greedy answers are the single engine's tokens, requests
reach both replicas, and /metrics reads the combined snapshot.  Both engines
offer every member of the Engine protocol, and the entry points read no other.
(`jpaged serve` and `jpaged batch` start a data-parallel engine in
tests/entrypoints/test_startup_matrix.py.)"""

from __future__ import annotations

import ast
import concurrent.futures
import json
import pathlib
import time
import urllib.error
import urllib.request

import pytest

uvicorn = pytest.importorskip("uvicorn")

from helpers import TINY_ENGINE, serve_in_thread, parse_metrics, random_prompts  # noqa: E402
from jpaged.core.sequence import SamplingParams  # noqa: E402
from jpaged.engine.protocol import Engine  # noqa: E402
from jpaged.engine.router import DataParallelLLM, create_engine  # noqa: E402
from jpaged.entrypoints.openai.app import create_app  # noqa: E402

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
def expected(tiny_llm):
    return [o.token_ids for o in tiny_llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))]


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


def protocol_members() -> set[str]:
    """Engine's attributes, methods and properties."""
    return set(Engine.__annotations__) | {name for name, value in vars(Engine).items()
                                          if not name.startswith("_") and (callable(value) or isinstance(value, property))}


def engine_reads(source: str) -> set[str]:
    """The attributes a module reads off an engine: `llm.x`, `state.llm.x`,
    `getattr(llm, "x")`, `create_engine(...).x` (the entry points' names for one)."""
    def is_engine(node: ast.AST) -> bool:
        return ((isinstance(node, ast.Name) and node.id == "llm")
                or (isinstance(node, ast.Attribute) and node.attr == "llm")
                or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "create_engine"))
    reads = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and is_engine(node.value):
            reads.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and is_engine(node.args[0]) and isinstance(node.args[1], ast.Constant)):
            reads.add(node.args[1].value)
    return reads


def test_entry_points_read_only_protocol_members():
    """What serve, the server package (jpaged.entrypoints.openai: its routes too),
    batch, metrics, ray_serve and the AsyncEngine read off an engine is in the
    protocol: a data-parallel engine has it too (the check below)."""
    package = pathlib.Path(__file__).resolve().parents[2] / "jpaged"
    modules = [*sorted((package / "entrypoints").rglob("*.py")), package / "engine" / "async_engine.py"]
    reads = {str(m.relative_to(package)): engine_reads(m.read_text()) for m in modules}
    assert {"kv_dtype", "loaded", "num_blocks"} <= reads["entrypoints/serve.py"]  # the walk does see the reads
    # ... in the server package too: the RL and LoRA verbs, read as protocol members, never probed.
    assert {"pause", "sleep", "is_sleeping", "is_paused", "update_params"} <= reads["entrypoints/openai/admin.py"]
    assert {"load_lora_adapter", "unload_lora_adapter", "lora_adapters"} <= (
        reads["entrypoints/openai/lora_routes.py"] | reads["entrypoints/openai/state.py"])
    assert {name: sorted(r - protocol_members()) for name, r in reads.items() if r - protocol_members()} == {}


def test_both_engines_have_every_protocol_member(served, tiny_llm):
    _, dp = served
    for engine in (tiny_llm, dp):
        assert isinstance(engine, Engine)
        assert sorted(m for m in protocol_members() if not hasattr(engine, m)) == [], type(engine).__name__
    assert dp.kv_dtype == tiny_llm.kv_dtype and dp.attention_impl == tiny_llm.attention_impl
