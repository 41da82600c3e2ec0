"""Pausing the engine for a weight update (RL): abort, keep and wait, and what
in-flight requests do across update_params (keep their K/V, or recompute it)."""

from __future__ import annotations

import jax
import pytest

from helpers import assert_all_blocks_free, random_prompts
from jpaged.core.sequence import SamplingParams

TOKENS = 16
PROMPTS = random_prompts([9, 14, 20], seed=51)


def greedy(n: int = TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(make_tiny_llm, request):
    return make_tiny_llm(async_scheduling=request.param)


@pytest.fixture(scope="module")
def new_params(llm):
    return jax.tree.map(lambda x: x * 1.05, llm.params)


def run(llm) -> dict[int, object]:
    """Steps until nothing can run; each finished request's first sample by id (once each)."""
    done = {}
    while llm.has_unfinished_requests():
        for delta in llm.step():
            if delta.finished:
                assert delta.request_id not in done, "a request finished twice"
                done[delta.request_id] = delta.output
    return done


def start(llm, steps: int) -> list[int]:
    ids = [llm.add_request(p, greedy()) for p in PROMPTS]
    for _ in range(steps):
        llm.step()
    return ids


def test_keep_freezes_then_continues(llm):
    want = [o.token_ids for o in llm.generate(PROMPTS, greedy())]
    ids = start(llm, 5)
    llm.pause("keep")
    frozen = {i: len(llm.get_sequence(i).output_token_ids) for i in ids}
    for _ in range(3):
        assert llm.step() == []
    assert not llm.has_unfinished_requests() and llm.is_paused
    assert {i: len(llm.get_sequence(i).output_token_ids) for i in ids} == frozen
    late = llm.add_request(PROMPTS[0], greedy())  # held until resume
    assert llm.step() == [] and llm.get_sequence(late).num_computed_tokens == 0
    llm.resume()
    done = run(llm)
    assert sorted(done) == sorted(ids + [late])
    assert [done[i].token_ids for i in ids] == want and done[late].token_ids == want[0]
    assert_all_blocks_free(llm)


def test_abort_returns_partial_outputs(llm):
    ids = start(llm, 4)
    llm.pause("abort")
    done = run(llm)
    assert sorted(done) == sorted(ids)
    for out in done.values():
        assert out.finish_reason == "abort" and 0 < len(out.token_ids) < TOKENS
    llm.resume()
    assert llm.generate(PROMPTS[:1], greedy(4))[0].finish_reason == "length"
    assert_all_blocks_free(llm)


def test_wait_lets_earlier_requests_finish(llm):
    want = [o.token_ids for o in llm.generate(PROMPTS, greedy())]
    ids = start(llm, 2)
    llm.pause("wait")
    late = llm.add_request(PROMPTS[1], greedy())
    done = run(llm)
    assert sorted(done) == sorted(ids) and [done[i].token_ids for i in ids] == want
    assert llm.get_sequence(late).num_computed_tokens == 0
    llm.resume()
    assert run(llm)[late].token_ids == want[1]
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("in_flight", ["keep", "recompute"])
def test_update_params_while_paused(llm, new_params, make_tiny_llm, in_flight):
    """keep: the rest of each answer runs on the old weights' K/V; recompute: it is
    what the new weights continue from the prompt and the output so far."""
    old_params = llm.params
    ids = start(llm, 6)
    llm.pause("keep")
    before = {i: list(llm.get_sequence(i).output_token_ids) for i in ids}
    llm.update_params(new_params, in_flight=in_flight)
    llm.resume()
    done = run(llm)
    assert sorted(done) == sorted(ids)
    fresh = make_tiny_llm()
    fresh.update_params(new_params)
    for i, p in zip(ids, PROMPTS):
        head = before[i]
        assert done[i].token_ids[:len(head)] == head
        tail = fresh.generate([p + head], greedy(TOKENS - len(head)))[0].token_ids
        if in_flight == "recompute":
            assert done[i].token_ids[len(head):] == tail
    if in_flight == "keep":  # an old-policy prefix: not what the new weights alone give (for some row)
        assert any(done[i].token_ids[len(before[i]):] != fresh.generate([p + before[i]],
                   greedy(TOKENS - len(before[i])))[0].token_ids for i, p in zip(ids, PROMPTS))
    assert_all_blocks_free(llm)
    llm.update_params(old_params)


def test_bad_mode(llm):
    with pytest.raises(ValueError, match="pause mode"):
        llm.pause("later")
    with pytest.raises(ValueError, match="in_flight"):
        llm.update_params(llm.params, in_flight="later")


def test_update_params_from_a_path(llm, new_params, tiny_llama_dir, tmp_path):
    """What a trainer saved: an orbax checkpoint of the params tree, or a HF directory."""
    import orbax.checkpoint as ocp
    original = llm.params
    want_new = None
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save((tmp_path / "ckpt").resolve(), new_params)
    llm.update_params(new_params)
    want_new = llm.generate(PROMPTS, greedy())
    llm.update_params(original)
    want_old = llm.generate(PROMPTS, greedy())
    llm.update_params(str(tmp_path / "ckpt"))
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy())] == [o.token_ids for o in want_new]
    llm.update_params(tiny_llama_dir)  # the checkpoint the engine was built from
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy())] == [o.token_ids for o in want_old]
    with pytest.raises((ValueError, FileNotFoundError)):
        llm.update_params(str(tmp_path / "missing"))
    llm.update_params(original)


def test_a_request_that_ends_in_the_step_pause_completes_is_returned(llm):
    """pause() completes the step in flight: what finished in it comes back from the next step()."""
    rid = llm.add_request(PROMPTS[0], greedy(2))
    finished = [d for _ in range(2) for d in llm.step() if d.finished]  # (sync: it ends in the second)
    llm.pause("keep")
    done = run(llm)
    done.update({d.request_id: d.output for d in finished})
    llm.resume()
    done.update(run(llm))
    assert list(done) == [rid] and len(done[rid].token_ids) == 2


def test_data_parallel_replicas_pause_sleep_and_load_together(llm, tiny_llama_dir):
    from helpers import TINY_ENGINE
    from jpaged.engine.router import create_engine
    want = [o.token_ids for o in llm.generate(PROMPTS, greedy())]
    dp = create_engine(model=tiny_llama_dir, **TINY_ENGINE, data_parallel_size=2)
    ids = [dp.add_request(p, greedy()) for p in PROMPTS]
    dp.step()
    dp.pause("keep")
    assert dp.is_paused and all(r.is_paused for r in dp.replicas)
    with pytest.raises(ValueError, match="unfinished"):
        dp.sleep()
    dp.resume()
    done = run(dp)
    assert [done[i].token_ids for i in ids] == want
    dp.sleep(1)
    assert dp.is_sleeping and all(r.is_sleeping for r in dp.replicas)
    dp.update_params(tiny_llama_dir, in_flight="abort")  # a path: each replica loads its own copy
    dp.wake_up()
    assert [o.token_ids for o in dp.generate(PROMPTS, greedy())] == want
    with pytest.raises(ValueError, match="as a path"):
        dp.update_params(llm.params)
