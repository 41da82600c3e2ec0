"""An exception inside a step fails the requests in it, frees their blocks, and
leaves the engine usable; a step that cannot progress raises instead of spinning;
outputs stream as they finish and closing the stream aborts the rest."""

from __future__ import annotations

import threading

import pytest

from helpers import assert_all_blocks_free, random_prompts
from jpaged.core.progress import EngineStalled
from jpaged.core.sequence import SamplingParams

PROMPTS = random_prompts([5, 40, 17, 70], seed=31)
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(make_tiny_llm):
    # Prefix caching on: recovery must also leave the cache consistent.
    return make_tiny_llm(enable_prefix_caching=True, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def expected(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def fail_on_call(monkeypatch, runner, call: int, *, lose_pool: bool = False) -> None:
    """Makes the runner's call-th launch() (a step's dispatch) raise (after consuming the pool, if lose_pool)."""
    real, count = runner.launch, [0]

    def launch(out):
        count[0] += 1
        if count[0] == call:
            if lose_pool:
                runner.kv_pool.delete()  # as if the donated buffer went with the failed program
            raise RuntimeError("injected device failure")
        return real(out)
    monkeypatch.setattr(runner, "launch", launch)


@pytest.mark.parametrize("lose_pool", [False, True], ids=["pool kept", "pool lost"])
@pytest.mark.parametrize("call", [1, 4])
def test_failed_step_fails_its_requests_and_engine_recovers(llm, expected, monkeypatch, call, lose_pool):
    fail_on_call(monkeypatch, llm.runner, call, lose_pool=lose_pool)
    outs = llm.generate(PROMPTS, GREEDY)
    failed = [o for o in outs if o.finish_reason == "error"]
    assert failed, "the injected failure must fail the requests of its step"
    for o in failed:
        assert "step failed" in o.error and "injected device failure" in o.error
    for o, want in zip(outs, expected):
        if o.finish_reason != "error":  # the others are untouched (or recomputed: same tokens)
            assert o.token_ids == want
    assert_all_blocks_free(llm)
    monkeypatch.undo()
    again = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in again] == expected
    assert_all_blocks_free(llm)


def test_failure_after_the_step_is_pinned_to_one_request(llm, expected, monkeypatch):
    real = llm.scheduler._apply_row

    def apply_row(s, *args):
        if s.seq.seq_id == target[0] and s.output_index == 2:  # its third token
            raise KeyError("bad stop rule")
        return real(s, *args)
    target = [llm._next_id + 2]  # the third request of the next generate()
    monkeypatch.setattr(llm.scheduler, "_apply_row", apply_row)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.finish_reason for o in outs] == ["length", "length", "error", "length"]
    assert "bad stop rule" in outs[2].error
    assert [o.token_ids for i, o in enumerate(outs) if i != 2] == [e for i, e in enumerate(expected) if i != 2]
    assert_all_blocks_free(llm)


def test_stall_raises_instead_of_spinning(llm, expected, monkeypatch):
    from jpaged.core.scheduler import SchedulerOutput
    monkeypatch.setattr(llm.scheduler, "schedule", lambda drafts=None: SchedulerOutput([], [], [], []))
    with pytest.raises(EngineStalled, match="stalled"):
        llm.generate(PROMPTS, GREEDY)
    monkeypatch.undo()
    assert not llm.scheduler.has_work
    assert_all_blocks_free(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


def test_generate_iter_streams_in_finish_order_with_index(llm, expected):
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 2, 6, 4)]
    outs = list(llm.generate_iter(PROMPTS, params))
    assert [o.index for o in outs] == [1, 3, 2, 0]  # shortest answers finish first
    for o in outs:
        assert o.token_ids == expected[o.index][:params[o.index].max_tokens]


def test_closing_the_stream_aborts_the_rest(llm, expected):
    stream = llm.generate_iter(PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True) for n in (30, 1, 30, 30)])
    first = next(stream)
    assert first.index == 1
    stream.close()
    assert not llm.scheduler.has_work
    assert_all_blocks_free(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


def test_stop_event_stops_before_the_next_step(llm):
    stop = threading.Event()
    stop.set()
    assert list(llm.generate_iter(PROMPTS, GREEDY, stop=stop)) == []
    assert not llm.scheduler.has_work
    assert_all_blocks_free(llm)


def test_out_of_range_values_fail_alone(llm, expected):
    """What used to pass validation and then break the step on the device."""
    bad = [SamplingParams(top_k=2**40, temperature=1.0), SamplingParams(seed=2**32),
           SamplingParams(seed=-1), SamplingParams(temperature=float("inf")),
           SamplingParams(max_tokens=True), SamplingParams(n=2, seed=2**32 - 1),
           SamplingParams(cache_salt=7), SamplingParams(stop_token_ids=("a",))]
    outs = llm.generate([PROMPTS[0]] * len(bad) + [PROMPTS[1]], bad + [GREEDY])
    for o, field in zip(outs, ["top_k", "seed", "seed", "temperature", "max_tokens", "seed",
                               "cache_salt", "stop_token_ids"]):
        assert o.finish_reason == "error" and o.error.startswith(field), o.error
    assert outs[-1].token_ids == expected[1]
    assert_all_blocks_free(llm)


def test_non_string_salt_in_a_chat_dict_is_that_requests_error(llm, expected):
    outs = llm.generate([{"prompt": "hi", "cache_salt": 5}, PROMPTS[2]], GREEDY)
    assert outs[0].finish_reason == "error" and "cache_salt" in outs[0].error
    assert outs[1].token_ids == expected[2]


def test_unknown_keys_in_a_prompt_dict_are_that_requests_error(llm, expected):
    outs = llm.generate([{"prompt": "hi", "temperature": 0.5}, PROMPTS[3]], GREEDY)
    assert outs[0].finish_reason == "error" and "temperature" in outs[0].error
    assert "SamplingParams" in outs[0].error
    assert outs[1].token_ids == expected[3]
