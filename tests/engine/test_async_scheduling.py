"""Asynchronous scheduling (config async_scheduling): the host schedules step n+1
while the device runs step n, and step n's sampled tokens reach step n+1 on the
device.  Whatever it changes in the order of host work, every request's tokens,
logprobs and finish reasons equal the synchronous engine's: under preemption
(recompute and swap), prefix caching, n > 1, stop strings and stop token ids,
logprobs and prompt logprobs, and aborts.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from helpers import TINY_ENGINE, assert_all_blocks_free, random_prompts
from jpaged.engine.async_engine import AsyncEngine
from jpaged.engine.llm import LLM
from jpaged.core.sequence import PLACEHOLDER, SamplingParams

BS = 8
# A pool of 20 usable blocks under 8 seats: admission oversubscribes it.
SMALL = dict(block_size=BS, num_blocks=21, max_num_seqs=8, max_num_batched_tokens=64)

_rng = np.random.default_rng(3)
LENGTHS = _rng.integers(3, 40, size=12).tolist()
MAX_TOKENS = _rng.integers(4, 25, size=12).tolist()
SYSTEM = random_prompts([16], seed=98)[0]
PROMPTS = [(SYSTEM + p if i % 2 else p)[:64] for i, p in enumerate(random_prompts(LENGTHS, seed=4))]


def mixed_params() -> list[SamplingParams]:
    """Greedy and seeded rows, n > 1, logprobs, prompt logprobs, stop token ids."""
    out = []
    for i, n in enumerate(MAX_TOKENS):
        kind = i % 4
        if kind == 0:
            out.append(SamplingParams(max_tokens=n, ignore_eos=True))
        elif kind == 1:
            out.append(SamplingParams(max_tokens=n, temperature=0.8, top_k=40, seed=100 + i, n=2, ignore_eos=True))
        elif kind == 2:
            out.append(SamplingParams(max_tokens=n, logprobs=3, prompt_logprobs=2, ignore_eos=True))
        else:  # stops at the first sampled token in 30..60, if any
            out.append(SamplingParams(max_tokens=n, temperature=1.0, seed=200 + i,
                                      stop_token_ids=tuple(range(30, 60)), ignore_eos=True))
    return out


def results(outs) -> list:
    """Finish reasons, every sample's tokens and the logprobs' token ids (exact),
    and the logprob values (see close_values)."""
    def ids(lps):
        return None if lps is None else [None if t is None else (t.token_id, tuple(i for i, _ in t.top))
                                         for t in lps]
    return [(o.finish_reason, [s["token_ids"] for s in o.samples], ids(o.logprobs), ids(o.prompt_logprobs))
            for o in outs]


def logprob_values(outs) -> np.ndarray:
    return np.array([t.logprob for o in outs for lps in (o.logprobs, o.prompt_logprobs) if lps
                     for t in lps if t is not None])


def close_values(a, b) -> bool:
    """Equal to fp32 rounding: a step's batch differs between the modes, and fp32
    matmuls of other shapes round differently in the last bits."""
    return a.shape == b.shape and np.allclose(a, b, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def engines(make_tiny_llm):
    def pair(**overrides):
        return (make_tiny_llm(async_scheduling=False, **overrides),
                make_tiny_llm(async_scheduling=True, **overrides))
    return pair


# (swap preemption and the prefix cache under asynchronous scheduling, the default,
# are checked against unpreempted runs in test_preemption.py and test_prefix_cache.py)
@pytest.mark.parametrize("mode, caching", [("recompute", False)], ids=["recompute, no cache"])
def test_async_equals_sync_under_preemption(engines, mode, caching):
    sync, async_ = engines(preemption_mode=mode, enable_prefix_caching=caching, **SMALL)
    params = mixed_params()
    want_outs, got_outs = sync.generate(PROMPTS, params), async_.generate(PROMPTS, params)
    want, got = results(want_outs), results(got_outs)
    assert close_values(logprob_values(got_outs), logprob_values(want_outs))
    assert async_.stats.preemptions > 0 and sync.stats.preemptions > 0
    assert [g[0] for g in got] == [w[0] for w in want]
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i} ({mode}, caching {caching})"
    assert "stop" in [w[0] for w in want]  # the stop ids did end some requests early
    for llm in (sync, async_):
        assert_all_blocks_free(llm)
        assert llm.swap_space.num_used_blocks == 0


@pytest.fixture(scope="module")
def default_engines(tiny_llama_tok_dir):
    """(synchronous, asynchronous) TINY_ENGINE engines that take text, built once for
    the tests below (each leaves them idle, with every block free)."""
    return tuple(LLM(**{**TINY_ENGINE, "model": tiny_llama_tok_dir, "async_scheduling": mode})
                 for mode in (False, True))


def test_async_equals_sync_with_stop_strings(default_engines):
    """Stop strings are matched on the text as tokens arrive; the output stops at
    the same token in both modes, and nothing past it is returned."""
    prompts = ["hello there", "a b c d", "zzz", "the quick brown fox"]
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=5, stop=tuple("aeiounrst"), ignore_eos=True)
    outs = {}
    for llm in default_engines:
        outs[llm.async_scheduling] = [(o.finish_reason, o.token_ids, o.text) for o in llm.generate(prompts, params)]
        assert_all_blocks_free(llm)
    assert outs[True] == outs[False]
    assert any(r == "stop" for r, _, _ in outs[False])


@pytest.mark.parametrize("abort_after", [1, 2, 5])
def test_abort_keeps_the_tokens_already_launched(default_engines, abort_after):
    """An abort after k step() calls: both modes have launched k steps, and the
    aborted request keeps every token those steps sample (asynchronously, the
    last one arrives after the abort) and nothing else."""
    outs = {}
    for llm in default_engines:
        assert not llm.has_unfinished_requests()
        ids = [llm.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in PROMPTS[:4]]
        for _ in range(abort_after):
            llm.step()
        llm.abort([ids[1]])
        done = {}
        while llm.has_unfinished_requests():
            done.update({d.request_id: d.output for d in llm.step() if d.finished})
        outs[llm.async_scheduling] = [(done[i].finish_reason, done[i].token_ids) for i in ids]
        assert all(PLACEHOLDER not in t for _, t in outs[llm.async_scheduling])
        assert_all_blocks_free(llm)
    assert outs[True] == outs[False]
    assert outs[True][1][0] == "abort" and len(outs[True][1][1]) <= abort_after


def test_steps_overlap(make_tiny_llm):
    """The host launches step n+1 before it collects step n (and never two ahead)."""
    llm = make_tiny_llm(async_scheduling=True)
    events, runner = [], llm.runner
    launch, collect = runner.launch, runner.collect

    def logged_launch(out):
        events.append("launch")
        return launch(out)

    def logged_collect(pending):
        events.append("collect")
        return collect(pending)
    runner.launch, runner.collect = logged_launch, logged_collect
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=6, ignore_eos=True))
    assert all(len(o.token_ids) == 6 for o in outs)
    ahead = np.cumsum([1 if e == "launch" else -1 for e in events])
    assert events[:3] == ["launch", "launch", "collect"] and ahead.max() == 2 and ahead[-1] == 0, events


def test_placeholders_read_on_the_device(make_tiny_llm):
    """A decode row whose last token is still on the device reads it from the
    previous step's token buffer: prev_rows names its row there."""
    from jpaged.core.scheduler import ScheduledSeq
    from jpaged.core.sequence import Sequence
    from jpaged.runtime.step_inputs import build_step_inputs
    seq = Sequence(0, [5, 6, 7], SamplingParams())
    seq.output_token_ids = [9, PLACEHOLDER]
    seq.num_computed_tokens, seq.sample_row = 4, 3
    seq.block_table.block_ids = [1]
    other = Sequence(1, [8, 8], SamplingParams())
    other.block_table.block_ids = [2]
    inputs = build_step_inputs([ScheduledSeq(other, 2), ScheduledSeq(seq, 1)], num_tokens=8, num_seqs=4,
                               block_size=BS, table_width=2, vocab_size=64, chained=True)
    assert inputs.prev_rows.tolist() == [-1, -1, 3, -1, -1, -1, -1, -1]
    assert inputs.tokens.tolist()[:3] == [8, 8, 0]
    assert build_step_inputs([ScheduledSeq(other, 2)], num_tokens=8, num_seqs=4, block_size=BS,
                             table_width=2, vocab_size=64).prev_rows is None  # synchronous: no field, another program


# generate() returns with the engine idle, whichever way its last request stopped:
# asynchronously, a request that stops on EOS or a stop string leaves the step
# launched after its last token on the device, and the calls documented for
# "between generate() calls" need an idle engine (an RL loop makes them every round).
EOS_PROMPT = "What is the capital of Italy? Once upon a time"  # the tiny Llama's greedy answer ends in EOS
STOPS = {"eos": SamplingParams(max_tokens=16),
         "stop string": SamplingParams(max_tokens=16, stop=("tp",), ignore_eos=True),  # its 4th and 5th tokens
         "max_tokens": SamplingParams(max_tokens=5, ignore_eos=True)}
BETWEEN_CALLS = {
    "reset_prefix_cache": lambda llm, adapter: llm.reset_prefix_cache(),
    "update_params": lambda llm, adapter: llm.update_params(llm.params),
    "pause": lambda llm, adapter: (llm.pause(), llm.resume()),
    "sleep": lambda llm, adapter: (llm.sleep(1), llm.wake_up()),
    "load_lora_adapter": lambda llm, adapter: llm.load_lora_adapter("a", adapter),
    "unload_lora_adapter": lambda llm, adapter: llm.unload_lora_adapter("a"),
}


@pytest.fixture(scope="module")
def rollout_llm(tiny_llama, tiny_llama_tok_dir, tmp_path_factory):
    """(an engine as an RL rollout runs one: prefix caching, LoRA slots, asynchronous
    scheduling, the default; a PEFT adapter directory)."""
    pytest.importorskip("peft")
    from helpers import make_peft_adapter
    adapter = tmp_path_factory.mktemp("between-calls") / "a"
    make_peft_adapter(tiny_llama[1], adapter, seed=0, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    llm = LLM(**{**TINY_ENGINE, "model": tiny_llama_tok_dir, "max_loras": 2, "enable_prefix_caching": True})
    assert llm.async_scheduling
    return llm, str(adapter)


@pytest.mark.parametrize("stop", list(STOPS))
def test_generate_returns_with_the_engine_idle(rollout_llm, stop):
    llm, adapter = rollout_llm
    params = STOPS[stop]
    first = llm.generate([EOS_PROMPT], params)[0]
    eos = set(llm.tokenizer.eos_token_ids)
    if stop == "max_tokens":
        assert (first.finish_reason, len(first.token_ids)) == ("length", params.max_tokens)
    else:  # stopped before max_tokens, on EOS or else on a stop string
        assert first.finish_reason == "stop" and len(first.token_ids) < params.max_tokens, first.error
        assert (first.token_ids[-1] in eos) == (stop == "eos"), first.token_ids
    for name, call in BETWEEN_CALLS.items():
        out = llm.generate([EOS_PROMPT], params)[0]
        assert (out.finish_reason, out.token_ids) == (first.finish_reason, first.token_ids), name
        assert not llm.has_unfinished_requests() and llm.block_manager.num_used_blocks == 0, name
        call(llm, adapter)  # raised "needs an idle engine" (or "unfinished requests") before
        if name == "load_lora_adapter":
            assert llm.generate([EOS_PROMPT], dataclasses.replace(params, lora="a"))[0].error is None
    assert llm.generate([EOS_PROMPT], params)[0].token_ids == first.token_ids
    assert_all_blocks_free(llm)


def test_a_server_call_after_the_last_request_finds_the_engine_idle(rollout_llm):
    """The server's RL and LoRA routes run on the engine thread (AsyncEngine.call),
    between two steps: one queued as the last request ends runs before the step
    that request left in flight is completed, and must find the engine idle."""
    llm, _ = rollout_llm
    ids, params, text, _ = llm.prepare_prompt(EOS_PROMPT, STOPS["eos"])
    rid = llm.add_request(ids, params, text)
    while llm.get_sequence(rid) is not None:
        llm.step()
    assert llm.has_unfinished_requests()  # the step launched after its EOS is still on the device

    async def reset_on_the_engine_thread():
        engine = AsyncEngine(llm, max_queued_requests=4)
        call = asyncio.ensure_future(engine.call(lambda e: e.reset_prefix_cache()))
        await asyncio.sleep(0)  # queued before the thread starts: the thread's first work
        engine.start()
        try:
            await asyncio.wait_for(call, 60)
        finally:
            engine.close(60)
    asyncio.run(reset_on_the_engine_thread())
    assert not llm.has_unfinished_requests()
    assert_all_blocks_free(llm)
