"""scripts/serve.py end to end: a real server subprocess on 127.0.0.1, the
embedded SmolLM2, the real `openai` client.  One server for the module (the
last test stops it with SIGTERM); every wait has a deadline, so a hung server
fails a test instead of hanging the suite."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import pathlib
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from helpers import SMOLLM_STEP_XLA, cached_compiles_env, config_flags, free_port, parse_metrics  # noqa: E402
from jpaged.core.sequence import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"
# Small enough that the step programs compile quickly; room for 12 queued requests in test 3.
# A few programs (the finer ladder is tested in-process), built as the suite's
# SmolLM2 engine's are (helpers.SMOLLM_ENGINE says why).
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, max_queued_requests=24,
              buckets_per_octave=1, **SMOLLM_STEP_XLA)
START_SECONDS = 180     # server start (model load + precompile), on a loaded 2-core machine
REQUEST_SECONDS = 120   # any one client call
MAX_TOKENS = 8
PROMPTS = [f"Question {i}: name a fruit that is {c}." for i, c in enumerate(
    ["red", "yellow", "green", "orange", "purple", "blue", "brown", "pink",
     "sweet", "sour", "small", "big", "round", "long", "soft", "hard"])]



def http(method: str, url: str, body: bytes | None = None, timeout: float = 30) -> tuple[int, dict, str]:
    """(status, headers, text) of one plain HTTP request; error statuses too."""
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode()


class Server:
    def __init__(self, tmp: pathlib.Path, engine: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "server.log"
        overrides = config_flags({**(engine or ENGINE), "shutdown_grace_seconds": 30})
        cmd = [sys.executable, "scripts/serve.py", "--config", "configs/smollm2_135m.py", "--port",
               str(self.port), "--precompile", "--noaccess_log", *overrides]
        env = {**cached_compiles_env(), "PYTHONPATH": str(ROOT)}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}:\n{self.log.read_text()}"
            try:
                if http("GET", self.url + "/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        raise AssertionError(f"server not ready in {START_SECONDS} s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def metrics(self) -> dict[str, float]:
        """{sample name with labels: value} of /metrics, parsed by prometheus_client."""
        status, _, text = http("GET", self.url + "/metrics")
        assert status == 200
        return parse_metrics(text)

    def client(self) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=REQUEST_SECONDS,
                             max_retries=0)

    def async_client(self) -> "openai.AsyncOpenAI":
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", timeout=REQUEST_SECONDS,
                                  max_retries=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Prompt lookup drafts in the server: every test below compares its answers
    # with the in-process engine's, which does not speculate.
    srv = Server(tmp_path_factory.mktemp("server"), {**ENGINE, "speculative_method": "ngram"})
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def llm(server):
    """The same engine in this process (built while the server starts): the oracle."""
    from jpaged.engine.llm import LLM
    return LLM(model=MODEL, compilation_cache=True, **{k: v for k, v in ENGINE.items() if k != "max_queued_requests"})


@pytest.fixture(scope="module")
def ready(server, llm):
    server.wait_ready()
    return server


@pytest.fixture(scope="module")
def expected(llm):
    """Greedy texts of PROMPTS, as LLM.generate gives them."""
    return [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))]


def test_completion_equals_llm_generate(ready, llm):
    prompt = "The three primary colours are"
    want = llm.generate([prompt], SamplingParams(max_tokens=12))[0]
    got = ready.client().completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_token_ids),
                                                                       len(want.token_ids))


def test_streamed_chat_concatenates_to_the_whole_answer(ready, llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    client = ready.client()
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    pieces, usage, reasons = [], None, []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    text = whole.choices[0].message.content
    assert text and "".join(pieces) == text
    assert reasons[-1] == whole.choices[0].finish_reason
    want = llm.generate([{"messages": messages}], SamplingParams(max_tokens=16))[0]
    assert text == want.text
    counts = (len(want.prompt_token_ids), len(want.token_ids), len(want.prompt_token_ids) + len(want.token_ids))
    for u in (whole.usage, usage):
        assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == counts


def test_16_concurrent_requests_complete(ready, expected):
    async def run():
        async with ready.async_client() as client:
            return await asyncio.gather(*(client.completions.create(
                model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0) for p in PROMPTS))
    results = asyncio.run(asyncio.wait_for(run(), REQUEST_SECONDS))
    assert [r.choices[0].text for r in results] == expected
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)


BAD_REQUESTS = [
    ({"model": "no-such-model", "prompt": "hi"}, "model"),
    ({"model": MODEL, "prompt": "hi " * 600}, "prompt"),            # longer than max_model_len
    ({"model": MODEL, "prompt": "hi", "n": 0}, "n"),
    ({"model": MODEL, "prompt": "hi", "n": 5}, "n"),                  # more than max_num_seqs
    ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": [10**9]}, "prompt"),                  # outside the vocabulary
    ({"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),   # above MAX_LOGPROBS
    ({"model": MODEL, "prompt": "hi", "logprobs": -1}, "logprobs"),
]
BAD_CHAT_REQUESTS = [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),                             # without logprobs: true
]


def test_bad_requests_get_400_while_good_ones_complete(ready, expected):
    async def run():
        async with ready.async_client() as client:
            good = [asyncio.create_task(client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS,
                                                                  temperature=0)) for p in PROMPTS[:4]]
            for body, param in BAD_REQUESTS:
                status, _, text = await asyncio.to_thread(http, "POST", ready.url + "/v1/completions",
                                                          json.dumps(body).encode())
                error = json.loads(text)["error"]
                want = 404 if param == "model" else 400  # an unknown model: 404 model_not_found (as OpenAI)
                assert (status, error["type"], error["param"]) == (want, "invalid_request_error", param), text
                assert error["message"]
            for fields, param in BAD_CHAT_REQUESTS:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
                status, _, text = await asyncio.to_thread(http, "POST", ready.url + "/v1/chat/completions",
                                                          json.dumps(body).encode())
                assert (status, json.loads(text)["error"]["param"]) == (400, param), text
            status, _, text = await asyncio.to_thread(http, "POST", ready.url + "/v1/chat/completions",
                                                      b'{"model": "smollm2-135m", "messages": [')
            assert status == 400 and "JSON" in json.loads(text)["error"]["message"]
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(model=MODEL, messages=[{"role": "user"}])
            # More prompts in one request than the queue bound (24): a 400, never a 429 to retry.
            status, headers, text = await asyncio.to_thread(http, "POST", ready.url + "/v1/completions",
                                                            json.dumps({"prompt": ["hi"] * 25}).encode())
            assert status == 400 and "max_queued_requests" in json.loads(text)["error"]["message"], text
            return await asyncio.gather(*good)
    results = asyncio.run(asyncio.wait_for(run(), REQUEST_SECONDS))
    assert [r.choices[0].text for r in results] == expected[:4]


TOP = 5  # alternatives asked for per token


def check_top_logprobs(token: str, logprob: float, top: list[tuple[str, float]], k: int = TOP) -> None:
    """Greedy: the chosen token is the best; the alternatives come best first, k of them."""
    values = [v for _, v in top]
    assert len(top) == k and values == sorted(values, reverse=True)
    assert top[0] == (token, logprob)


def test_completion_logprobs_of_a_greedy_completion(ready, llm):
    prompt = "The three primary colours are"
    want = llm.generate([prompt], SamplingParams(max_tokens=8, logprobs=TOP, prompt_logprobs=TOP))[0]
    client = ready.client()
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=TOP)
    choice = got.choices[0]
    lp = choice.logprobs
    assert choice.finish_reason == "length" and len(lp.tokens) == got.usage.completion_tokens == 8
    assert "".join(lp.tokens) == choice.text  # each token decoded alone, joined
    assert lp.text_offset == [0, *itertools.accumulate(map(len, lp.tokens[:-1]))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        check_top_logprobs(token, value, list(top.items()))  # (this prompt's alternatives decode apart)
    assert lp.token_logprobs == pytest.approx([t.logprob for t in want.logprobs], abs=1e-4)
    assert 0 < math.exp(sum(lp.token_logprobs)) < 1
    # echo: the prompt's tokens lead, the first with no logprob; streamed, the same in pieces.
    n_prompt = got.usage.prompt_tokens
    echo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=TOP,
                                     echo=True).choices[0]
    assert echo.text == prompt + choice.text
    assert echo.logprobs.tokens[n_prompt:] == lp.tokens and len(echo.logprobs.tokens) == n_prompt + 8
    assert echo.logprobs.token_logprobs[0] is None and echo.logprobs.top_logprobs[0] is None
    assert echo.logprobs.token_logprobs[1:n_prompt] == pytest.approx(
        [t.logprob for t in want.prompt_logprobs[1:]], abs=1e-4)
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                           logprobs=TOP, echo=True, stream=True):
        for key, values in streamed.items():
            values += getattr(chunk.choices[0].logprobs, key)
    # (the values to fp32 rounding: a step may run in a larger bucket while its own is built)
    assert streamed["tokens"] == echo.logprobs.tokens and streamed["text_offset"] == echo.logprobs.text_offset
    assert streamed["token_logprobs"][0] is None
    assert streamed["token_logprobs"][1:] == pytest.approx(echo.logprobs.token_logprobs[1:], abs=1e-4)
    # /generate: the batch CLI's form, token ids and [id, logprob] pairs.
    status, _, text = http("POST", ready.url + "/generate", json.dumps(
        {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 2, "prompt_logprobs": 1}).encode())
    body = json.loads(text)
    assert status == 200 and [t["token_id"] for t in body["logprobs"]] == body["token_ids"]
    assert [t["logprob"] for t in body["logprobs"]] == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert all(len(t["top"]) == 2 and t["top"][0] == [t["token_id"], t["logprob"]] for t in body["logprobs"])
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == n_prompt


def test_echo_of_token_ids_keeps_special_tokens_as_its_logprobs_do(ready, llm):
    """The echoed text of a token-id prompt shows its special tokens, so that
    text_offset points at each echoed token."""
    ids = llm.tokenizer.encode("<|im_start|>user\nhi", add_special_tokens=False)
    assert ids[0] == llm.tokenizer.token_to_id("<|im_start|>")
    got = ready.client().completions.create(model=MODEL, prompt=ids, echo=True, logprobs=0, max_tokens=2,
                                            temperature=0)
    choice = got.choices[0]
    assert choice.text.startswith("<|im_start|>user")
    for token, offset in zip(choice.logprobs.tokens, choice.logprobs.text_offset):
        assert choice.text[offset:].startswith(token), (token, offset, choice.text)


def test_streamed_chat_logprobs_concatenate_to_the_whole_ones(ready):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    client = ready.client()
    ask = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0, logprobs=True, top_logprobs=TOP)
    answer = client.chat.completions.create(**ask)
    whole, content = answer.choices[0], answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    # The tokens spell the text (then the end-of-turn token, if that is how it stopped).
    assert "".join(t.token for t in content).startswith(whole.message.content)
    for t in content:
        assert t.bytes == list(t.token.encode("utf-8"))
        check_top_logprobs(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
    streamed, texts = [], []
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            pieces = choice.logprobs.content if choice.logprobs is not None else []
            streamed += pieces
            if choice.delta.content:  # a chunk's text comes with its tokens' logprobs
                assert "".join(t.token for t in pieces).startswith(choice.delta.content)
            texts.append(choice.delta.content or "")
    assert "".join(texts) == whole.message.content
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in content]


def test_a_stop_string_ends_its_samples_in_the_engine(ready):
    """The engine computes a stopped sample no further (a step or two of slack),
    rather than to max_tokens: generation tokens ~ the tokens the answer used."""
    client = ready.client()
    for n in (1, 2):
        before = _wait_for(lambda: (m := ready.metrics())["vllm:num_requests_running"] == 0 and m, 30, "idle")
        got = client.completions.create(model=MODEL, prompt="Write three short sentences about cats.", n=n,
                                        max_tokens=120, temperature=0.8, seed=3, stop=["."],
                                        extra_body={"ignore_eos": True})
        assert [c.finish_reason for c in got.choices] == ["stop"] * n
        assert all(len(c.text) > 0 and "." not in c.text for c in got.choices)
        # The engine ends the request just after the answer (it counts as a success, not an abort).
        stops = "vllm:request_success_total{finished_reason=stop}"
        after = _wait_for(lambda: (m := ready.metrics()).get(stops, 0) == before.get(stops, 0) + 1 and m, 10,
                          "the request finished with reason stop")
        computed = after["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0)
        assert got.usage.completion_tokens <= computed <= got.usage.completion_tokens + 3 * n


def test_a_stop_string_cuts_the_answer_where_the_library_does(ready, llm):
    """The same request as the batch CLI's stop line (tests/entrypoints/test_serve_batch.py)."""
    question = "Write three short sentences about the sea."
    whole = llm.generate([{"prompt": question}], SamplingParams(max_tokens=48))[0]
    assert "." in whole.text
    got = ready.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                 max_tokens=48, temperature=0, stop=["."])
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].message.content == whole.text[:whole.text.index(".")]


def _wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} not within {seconds} s")


ABORTED = "vllm:request_success_total{finished_reason=abort}"


def wait_back_to_idle_with_one_more_abort(server: Server, idle: dict[str, float]) -> None:
    """Within a few seconds: nothing running, the KV usage of `idle`, and one abort more."""
    def back_to_idle():
        m = server.metrics()
        return (m["vllm:num_requests_running"] == 0
                and m["vllm:kv_cache_usage_perc"] == idle["vllm:kv_cache_usage_perc"]
                and m.get(ABORTED, 0) == idle.get(ABORTED, 0) + 1)
    _wait_for(back_to_idle, 10, "running 0, the idle KV usage and one abort after the client left")


def test_disconnect_mid_stream_aborts_and_frees_blocks(ready):
    idle = _wait_for(lambda: (m := ready.metrics())["vllm:num_requests_running"] == 0 and m, 30, "idle")
    stream = ready.client().completions.create(model=MODEL, prompt="Tell me a long story.", max_tokens=400,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert ready.metrics()["vllm:kv_cache_usage_perc"] > idle["vllm:kv_cache_usage_perc"]
    stream.close()
    wait_back_to_idle_with_one_more_abort(ready, idle)


def test_client_gone_before_a_whole_answer_aborts_it(ready):
    idle = _wait_for(lambda: (m := ready.metrics())["vllm:num_requests_running"] == 0 and m, 30, "idle")
    client = openai.OpenAI(base_url=ready.url + "/v1", api_key="unused", timeout=2, max_retries=0)
    with pytest.raises(openai.APITimeoutError):  # the client gives up and closes the connection
        client.completions.create(model=MODEL, prompt="Tell me a long story.", max_tokens=400, temperature=0,
                                  extra_body={"ignore_eos": True})
    wait_back_to_idle_with_one_more_abort(ready, idle)


def test_metrics_parse(ready):
    status, headers, text = http("GET", ready.url + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:cache_config_info", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                 "vllm:num_preemptions", "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens", "vllm:generation_tokens",
                 "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens"):
        assert name in families, name
    m = ready.metrics()
    assert 0 <= m["vllm:kv_cache_usage_perc"] <= 1
    assert m["vllm:generation_tokens_total"] > 0 and m["vllm:time_to_first_token_seconds_count"] > 0
    assert m["vllm:prefix_cache_hits_total"] <= m["vllm:prefix_cache_queries_total"]
    # (the answers so far repeat words of their questions: prompt lookup drafted them)
    assert 0 < m["vllm:spec_decode_num_accepted_tokens_total"] <= m["vllm:spec_decode_num_draft_tokens_total"]
    info = families["vllm:cache_config_info"].samples[0].labels
    assert info["block_size"] == "16" and int(info["num_gpu_blocks"]) > 0
    status, _, text = http("GET", ready.url + "/v1/models")
    assert status == 200 and json.loads(text)["data"][0]["id"] == MODEL


def test_sigterm_finishes_in_flight_requests_and_exits_0(ready):
    stream = ready.client().completions.create(model=MODEL, prompt="Count to twenty:", max_tokens=64,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    ready.proc.send_signal(signal.SIGTERM)
    # While the request drains, the server still listens: /health and new requests get 503,
    # so that a load balancer sends its traffic elsewhere.
    _wait_for(lambda: http("GET", ready.url + "/health", timeout=5)[0] == 503, 10, "/health 503 after SIGTERM")
    status, headers, _ = http("POST", ready.url + "/v1/completions", json.dumps({"prompt": "hi"}).encode())
    assert status == 503 and "retry-after" in headers
    rest = list(chunks)  # the request in flight finishes within the grace period
    assert rest[-1].choices[0].finish_reason == "length"
    assert ready.proc.wait(timeout=60) == 0, ready.log.read_text()
    with pytest.raises(OSError):
        http("GET", ready.url + "/health", timeout=5)
