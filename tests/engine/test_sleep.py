"""Sleep mode (LLM.sleep / wake_up): the engine gives back its device memory
between rollouts and comes back with the same (level 1) or new (level 2)
weights, without recompiling a step."""

from __future__ import annotations

import gc

import jax
import numpy as np
import pytest

from helpers import make_peft_adapter
from jpaged.core.sequence import SamplingParams

PROMPTS = [[1, 5, 9, 13, 17, 21], [1, 30, 31, 32], [1, 7] * 9]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def tokens(llm, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def live_bytes() -> int:
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays())


def engine_bytes(llm) -> int:
    return sum(x.nbytes for x in jax.tree.leaves((llm.params, llm.runner.kv_pool, llm.runner.lora)))


def test_sleep_level1_frees_memory_and_wakes_unchanged(make_tiny_llm):
    llm = make_tiny_llm()
    before = tokens(llm)
    llm.runner.wait_for_programs()
    compiled = llm.num_compilations
    held, live = engine_bytes(llm), live_bytes()
    llm.sleep()
    assert llm.is_sleeping
    freed = live - live_bytes()
    assert freed >= 0.95 * held, (freed, held)
    assert llm.memory_per_device() == {}
    llm.sleep()  # no-op
    llm.wake_up()
    assert not llm.is_sleeping
    llm.wake_up()  # no-op
    assert tokens(llm) == before
    assert llm.num_compilations == compiled


def test_sleep_level2_wakes_with_new_weights(make_tiny_llm):
    llm = make_tiny_llm()
    before = tokens(llm)
    llm.runner.wait_for_programs()
    compiled = llm.num_compilations
    new = jax.tree.map(lambda x: x * 1.01, llm.params)  # the trainer's next weights
    wrong = jax.tree.map(lambda x: x.astype(np.float16), new)
    held, live = engine_bytes(llm), live_bytes()
    llm.sleep(2)
    assert live - live_bytes() >= 0.95 * held
    with pytest.raises(RuntimeError, match="update_params"):
        llm.wake_up()
    assert llm.is_sleeping
    with pytest.raises(ValueError, match="float16"):
        llm.update_params(wrong)
    llm.update_params(new)
    llm.wake_up()
    got = tokens(llm)
    assert got != before  # the new weights serve
    assert llm.num_compilations == compiled
    fresh = make_tiny_llm()
    fresh.update_params(new)
    assert got == tokens(fresh)


def test_asleep_engine_refuses_requests(make_tiny_llm):
    llm = make_tiny_llm()
    rid = llm.add_request([1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="unfinished"):
        llm.sleep()
    llm.abort([rid])
    while llm.has_unfinished_requests():
        llm.step()
    llm.sleep()
    with pytest.raises(RuntimeError, match="asleep: call wake_up"):
        llm.add_request([1, 2, 3], GREEDY)
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate([[1, 2, 3]], GREEDY)
    assert not llm.has_unfinished_requests()
    llm.wake_up()
    assert len(tokens(llm)[0]) == GREEDY.max_tokens


def test_lora_adapters_survive_sleep(make_tiny_llm, tiny_llama, tmp_path):
    make_peft_adapter(tiny_llama[1], tmp_path / "a", seed=0, r=8, lora_alpha=16,
                      target_modules=["q_proj", "v_proj", "down_proj"])
    llm = make_tiny_llm(lora_modules=f"a={tmp_path / 'a'}", max_loras=2)
    adapted = SamplingParams(max_tokens=10, temperature=0.0, lora="a")
    before = tokens(llm, adapted), tokens(llm)
    assert before[0] != before[1]  # the adapter changes the tokens
    llm.sleep()
    assert llm.runner.lora is None
    with pytest.raises(RuntimeError, match="asleep"):
        llm.load_lora_adapter("b", str(tmp_path / "a"))
    llm.wake_up()
    assert (tokens(llm, adapted), tokens(llm)) == before
