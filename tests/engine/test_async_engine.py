"""AsyncEngine, the HTTP server's engine loop, on the tiny Llama: deltas add up
to generate()'s tokens (and logprobs), aborts free blocks, a stop string ends
a sample in the engine's step, a failure pinned to one request fails it alone,
the queue bound holds, close() aborts what is left, and the snapshots sent to
the metrics are the engine's."""

from __future__ import annotations

import asyncio

import pytest

from helpers import assert_all_blocks_free, random_prompts
from jpaged.core.stats import EngineSnapshot
from jpaged.engine.async_engine import AsyncEngine, EngineMetrics, QueueFull, ended
from jpaged.core.sequence import SamplingParams

PROMPTS = random_prompts([5, 40, 17, 70], seed=7)
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
SECONDS = 60  # every await has a deadline


@pytest.fixture(scope="module")
def llm(make_tiny_llm):
    return make_tiny_llm(enable_prefix_caching=True)  # the server's default: finished blocks stay cached


@pytest.fixture(scope="module")
def expected(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def run(llm, scenario, **kwargs):
    """Runs `scenario(engine)` on an event loop with a started AsyncEngine, then closes it."""
    async def main():
        engine = AsyncEngine(llm, max_queued_requests=kwargs.get("max_queued_requests", 64))
        engine.start()
        try:
            return await asyncio.wait_for(scenario(engine), SECONDS)
        finally:
            await asyncio.to_thread(engine.close, SECONDS)
    return asyncio.run(main())


async def collect(submission) -> list[dict]:
    """Per request: its tokens (sample 0), finish reasons and error, once all finished."""
    out = [{"tokens": [], "reasons": None, "error": None} for _ in submission.requests]
    left = len(out)
    while left:
        index, delta = await submission.queue.get()
        r = out[index]
        r["tokens"] += delta.samples[0].token_ids
        if ended(delta):
            r["reasons"], r["error"] = [s.finish_reason for s in delta.samples], delta.error
            left -= 1
    return out


def test_deltas_add_up_to_generate(llm, expected):
    async def scenario(engine):
        return await collect(engine.submit([(p, GREEDY, None) for p in PROMPTS]))
    results = run(llm, scenario)
    assert [r["tokens"] for r in results] == expected
    assert all(r["reasons"] == ["length"] for r in results)
    assert_all_blocks_free(llm)


def test_abort_frees_blocks_wherever_the_request_is(llm):
    long = SamplingParams(max_tokens=100, ignore_eos=True)

    async def scenario(engine):
        running, queued = engine.submit([(PROMPTS[0], long, None)]), engine.submit([(PROMPTS[1], long, None)])
        await running.queue.get()  # it has a token: it runs
        engine.abort(running.requests + queued.requests)
        return await collect(running), await collect(queued)
    for results in run(llm, scenario):
        assert results[0]["reasons"] == ["abort"] and len(results[0]["tokens"]) < 100
    assert_all_blocks_free(llm)


def test_deltas_carry_the_logprobs_of_their_tokens(llm):
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    want = llm.generate(PROMPTS[:2], params)

    async def scenario(engine):
        submission = engine.submit([(p, params, None) for p in PROMPTS[:2]])
        got, left = [{"logprobs": [], "prompt": []} for _ in PROMPTS[:2]], 2
        while left:
            index, delta = await submission.queue.get()
            got[index]["logprobs"] += delta.samples[0].logprobs
            if delta.prompt_logprobs is not None:
                got[index]["prompt"].append(delta.prompt_logprobs)
            left -= ended(delta)
        return got
    for g, w in zip(run(llm, scenario), want):
        assert g["logprobs"] == w.logprobs
        assert g["prompt"] == [w.prompt_logprobs]  # once, with the first tokens


class LetterTokenizer:
    """Token t reads as one letter: stop strings on the tiny model (which has no tokenizer)."""

    eos_token_ids: list[int] = []

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


def test_a_stop_string_ends_the_sample_in_the_engine(llm, expected, monkeypatch):
    tokenizer = LetterTokenizer()
    for part in (llm.inputs, llm.outputs):
        monkeypatch.setattr(part, "tokenizer", tokenizer)
    text = tokenizer.decode(expected[1])
    stop = text[3]
    cut = text.index(stop) + 1  # tokens up to the one that completes the stop string
    params = SamplingParams(max_tokens=10, ignore_eos=True, stop=(stop,))

    async def scenario(engine):
        return await collect(engine.submit([(PROMPTS[1], params, None)]))
    (result,) = run(llm, scenario)
    assert result["reasons"] == ["stop"]
    assert result["tokens"] == expected[1][:cut]  # the engine computed nothing past the stop
    assert_all_blocks_free(llm)


def test_a_failure_pinned_to_one_request_fails_it_alone(llm, expected, monkeypatch):
    bad = [3, 4, 5]
    real = llm.scheduler._apply_row

    def apply_row(s, *args):
        if s.seq.prompt_token_ids == bad:
            raise RuntimeError("injected per-request failure")
        return real(s, *args)
    monkeypatch.setattr(llm.scheduler, "_apply_row", apply_row)

    async def scenario(engine):
        return await collect(engine.submit([(bad, GREEDY, None)] + [(p, GREEDY, None) for p in PROMPTS]))
    results = run(llm, scenario)
    assert results[0]["reasons"] == ["error"] and "injected per-request failure" in results[0]["error"]
    assert [r["tokens"] for r in results[1:]] == expected
    assert_all_blocks_free(llm)


def test_a_failed_step_fails_its_requests_and_the_loop_keeps_serving(llm, expected, monkeypatch):
    real, calls = llm.runner.launch, [0]

    def launch(out):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected device failure")
        return real(out)
    monkeypatch.setattr(llm.runner, "launch", launch)

    async def scenario(engine):
        first = await collect(engine.submit([(PROMPTS[0], GREEDY, None)]))
        return first, await collect(engine.submit([(p, GREEDY, None) for p in PROMPTS]))
    first, later = run(llm, scenario)
    assert first[0]["reasons"] == ["error"] and "injected device failure" in first[0]["error"]
    assert [r["tokens"] for r in later] == expected
    assert_all_blocks_free(llm)


def test_queue_bound_refuses_a_submission_that_does_not_fit(llm):
    async def scenario(engine):
        with pytest.raises(QueueFull):
            engine.submit([(p, GREEDY, None) for p in PROMPTS[:3]])
        return await collect(engine.submit([(p, GREEDY, None) for p in PROMPTS[:2]]))
    results = run(llm, scenario, max_queued_requests=2)
    assert all(r["reasons"] == ["length"] for r in results)


def test_close_aborts_what_is_in_flight(llm):
    async def scenario(engine):
        submission = engine.submit([(p, SamplingParams(max_tokens=100, ignore_eos=True), None) for p in PROMPTS])
        await submission.queue.get()
        await asyncio.to_thread(engine.close, SECONDS)
        return await collect(submission)
    results = run(llm, scenario)
    # The delta already read may have been a request's first tokens; every request ends in abort.
    assert all(r["reasons"] == ["abort"] for r in results)
    assert_all_blocks_free(llm)


def test_snapshots_are_the_engines(llm):
    """The metrics' snapshot is llm.snapshot(): pool size before any request,
    running requests while they run, counters since the engine started."""
    class Recorder(EngineMetrics):
        def __init__(self):
            self.snapshots = []

        def on_snapshot(self, snapshot):
            self.snapshots.append(snapshot)
    recorder = Recorder()

    async def main():
        engine = AsyncEngine(llm, max_queued_requests=64, metrics=recorder)
        engine.start()
        try:
            return await asyncio.wait_for(collect(engine.submit([(p, GREEDY, None) for p in PROMPTS])), SECONDS)
        finally:
            await asyncio.to_thread(engine.close, SECONDS)
    before = llm.snapshot().totals
    asyncio.run(main())
    first, last = recorder.snapshots[0], recorder.snapshots[-1]
    assert isinstance(first, EngineSnapshot) and first.num_blocks == llm.num_blocks
    assert max(s.running for s in recorder.snapshots) > 0
    assert (last.running, last.waiting, last.used_blocks) == (0, 0, 0)
    assert last.totals.prompt_tokens >= before.prompt_tokens + sum(map(len, PROMPTS))
