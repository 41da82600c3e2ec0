"""Routing capture over HTTP: the `capture_routes` extension field of
/v1/completions, /v1/chat/completions, /generate and `jpaged batch` lines
(SamplingParams.capture_routes).  In process on the tiny Qwen3-MoE (uvicorn in a
thread); the oracle is the Python API on the same engine, asked before the server
takes it.  A dense model refuses the field with a 400 naming it."""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request

import pytest

uvicorn = pytest.importorskip("uvicorn")

from helpers import TINY_ENGINE, random_prompts, serve_in_thread, with_tokenizer  # noqa: E402
from jpaged.core.sequence import SamplingParams  # noqa: E402
from jpaged.entrypoints.openai.app import create_app  # noqa: E402

SECONDS = 120
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, capture_routes=True)
MESSAGES = [{"role": "user", "content": "Route me."}]
SEED = 7


def http(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=SECONDS) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream(url: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed answer (up to data: [DONE])."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=SECONDS) as r:
        events = [line[len(b"data: "):] for line in r.read().split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


def routes(sample: dict) -> list:
    return sample["routed_experts"].tolist()


def sampled_with_uneven_ends(llm, prompt: list[int]) -> SamplingParams:
    """Seeded n=2 sampling with a stop token that ends sample 0 in an earlier step than
    sample 1: its last streamed chunk must wait for the request's routes."""
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=SEED, n=2, ignore_eos=True, capture_routes=True)
    first, second = (s["token_ids"] for s in llm.generate([prompt], params)[0].samples)
    stop = next(t for i, t in enumerate(first) if t not in second[:i + 2])
    return dataclasses.replace(params, stop_token_ids=(stop,))


@pytest.fixture(scope="module")
def served(tiny_qwen3_moe, tmp_path_factory):
    """(base url, {case: the Python API's RequestOutputs}) of a server on the tiny Qwen3-MoE."""
    from jpaged.engine.llm import LLM
    model = with_tokenizer(str(tiny_qwen3_moe[0]), tmp_path_factory.mktemp("moe-http") / "qwen3_moe")
    llm = LLM(model=str(model), **TINY_ENGINE)
    prompts = random_prompts([9, 14], seed=21)
    uneven = sampled_with_uneven_ends(llm, prompts[0])
    expected = {"greedy": llm.generate(prompts, GREEDY),
                "chat": llm.generate([{"messages": MESSAGES}], GREEDY),
                "uneven": llm.generate([prompts[0]], uneven)}
    finished = [len(s["token_ids"]) for s in expected["uneven"][0].samples]
    assert finished[0] < finished[1], finished  # (sampled_with_uneven_ends' promise)
    app = create_app(llm, model_name="tiny-moe")
    with serve_in_thread(app, SECONDS) as url:
        yield url, prompts, uneven, expected


def test_completions_return_each_choices_routes(served):
    """Each prompt's choice carries its routes [prompt + output - 1][L_moe][k], the
    library's; a request that does not ask has no such field."""
    url, prompts, _, expected = served
    body = {"prompt": prompts, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    status, answer = http(url + "/v1/completions", {**body, "capture_routes": True})
    assert status == 200, answer
    for choice, out in zip(answer["choices"], expected["greedy"]):
        assert choice["text"] == out.text
        assert choice["routed_experts"] == routes(out.samples[0])
        assert len(choice["routed_experts"]) == len(out.prompt_token_ids) + len(out.token_ids) - 1
    status, plain = http(url + "/v1/completions", body)
    assert status == 200 and all("routed_experts" not in c for c in plain["choices"])
    status, generated = http(url + "/generate", {**body, "prompt": prompts[1], "capture_routes": True})
    assert status == 200, generated
    want = routes(expected["greedy"][1].samples[0])
    assert generated["routed_experts"] == generated["samples"][0]["routed_experts"] == want


def test_chat_returns_routes_whole_and_in_the_last_chunk(served):
    url, _, _, expected = served
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "capture_routes": True}
    want = routes(expected["chat"][0].samples[0])
    status, answer = http(url + "/v1/chat/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == expected["chat"][0].text
    assert answer["choices"][0]["routed_experts"] == want
    chunks = [c["choices"][0] for c in stream(url + "/v1/chat/completions", body) if c["choices"]]
    assert [c["routed_experts"] for c in chunks if "routed_experts" in c] == [want]
    assert chunks[-1]["finish_reason"] is not None and "routed_experts" in chunks[-1]


def test_openai_clients_extra_body_asks_for_routes(served):
    """As an RL rollout worker would ask: OpenAI's client, the field in extra_body."""
    openai = pytest.importorskip("openai")
    url, _, _, expected = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=SECONDS, max_retries=0)
    answer = client.chat.completions.create(model="tiny-moe", messages=MESSAGES, max_tokens=6, temperature=0,
                                            extra_body={"ignore_eos": True, "capture_routes": True})
    assert answer.choices[0].model_extra["routed_experts"] == routes(expected["chat"][0].samples[0])


def test_a_sample_that_ends_first_gets_its_routes_in_its_last_chunk(served):
    """n=2: sample 0 hits its stop token steps before sample 1 ends; its finishing
    chunk waits for the request's routes and carries sample 0's own."""
    url, prompts, uneven, expected = served
    body = {"prompt": prompts[0], "max_tokens": uneven.max_tokens, "temperature": uneven.temperature,
            "seed": SEED, "n": 2, "ignore_eos": True, "stop_token_ids": list(uneven.stop_token_ids),
            "capture_routes": True}
    chunks = [c["choices"][0] for c in stream(url + "/v1/completions", body)]
    samples = expected["uneven"][0].samples
    for index, sample in enumerate(samples):
        mine = [c for c in chunks if c["index"] == index]
        assert "".join(c["text"] for c in mine) == sample["text"]
        assert all("routed_experts" not in c for c in mine[:-1])
        assert mine[-1]["finish_reason"] == sample["finish_reason"]
        assert mine[-1]["routed_experts"] == routes(sample)
    status, whole = http(url + "/v1/completions", body)
    assert status == 200 and [c["routed_experts"] for c in whole["choices"]] == [routes(s) for s in samples]


def test_capture_routes_must_be_a_boolean(served):
    url, prompts, _, _ = served
    status, answer = http(url + "/v1/completions", {"prompt": prompts[0], "max_tokens": 2, "capture_routes": 1})
    assert status == 400 and answer["error"]["param"] == "capture_routes", answer


def test_a_dense_model_refuses_capture_routes_alone(tiny_llama_tok_dir):
    """A 400 naming the field for that request; the next request is answered."""
    from jpaged.engine.llm import LLM
    app = create_app(LLM(model=tiny_llama_tok_dir, **TINY_ENGINE), model_name="tiny")
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
    with serve_in_thread(app, SECONDS) as url:
        status, answer = http(url + "/v1/completions", {**body, "capture_routes": True})
        assert status == 400, answer
        assert answer["error"]["param"] == "capture_routes"
        assert "capture_routes needs a mixture-of-experts model" in answer["error"]["message"]
        status, answer = http(url + "/v1/completions", body)
        assert status == 200 and "routed_experts" not in answer["choices"][0], answer


def test_batch_lines_take_capture_routes():
    """`jpaged batch` parses its lines with the server's body models: the field is
    known (no warning) and typed."""
    from jpaged.entrypoints.batch_requests import parse_request
    line = parse_request({"prompt": "Hi", "capture_routes": True}, SamplingParams())
    assert line.error is None and not line.warnings and line.params.capture_routes
    line = parse_request({"prompt": "Hi", "capture_routes": "yes"}, SamplingParams())
    assert line.params is None and "capture_routes" in line.error
