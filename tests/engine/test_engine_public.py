"""The engine's small public surface for experiments: tokenize, get_sequence,
has_unfinished_requests, install_pool."""

from __future__ import annotations

import pytest

from jpaged.engine.llm import LLM
from jpaged.core.sequence import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_tok_dir):
    # The tiny Llama with a byte-level tokenizer: these tests are about the
    # engine's surface, not the model (prefix caching on, as by default).
    return LLM(model=tiny_llama_tok_dir, load_format="hf", max_model_len=64, num_blocks=12, max_num_seqs=2,
               attention_impl="auto", buckets_per_octave=1, build_padded_buckets=False)  # few programs


def test_tokenize_matches_generate_and_rejects_bad_prompts(llm):
    ids = llm.tokenize({"prompt": "Hi"})
    out = llm.generate([{"prompt": "Hi"}], SamplingParams(max_tokens=2))[0]
    assert ids == out.prompt_token_ids
    assert llm.tokenize([1, 2, 3]) == [1, 2, 3]
    with pytest.raises(ValueError, match="integers"):
        llm.tokenize([1, "x"])


def test_get_sequence_follows_a_request_until_it_finishes(llm):
    rid = llm.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    seq = llm.get_sequence(rid)
    assert seq is not None and seq.prompt_token_ids == [1, 2, 3]
    assert llm.has_unfinished_requests()
    while llm.has_unfinished_requests():
        llm.step()
    assert len(seq.output_token_ids) == 2 and llm.get_sequence(rid) is None


def test_install_pool(llm):
    with pytest.raises(ValueError):
        llm.install_pool(llm.num_blocks + 1, "recompute")
    with pytest.raises(ValueError):
        llm.install_pool(4, "drop")
    llm.install_pool(4, "swap")
    assert llm.block_manager.num_free_blocks <= 3 and llm.scheduler.preemption_mode == "swap"
    out = llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=3))
    assert all(o.error is None and len(o.token_ids) == 3 for o in out)
    llm.install_pool(llm.num_blocks, "recompute")
    assert llm.config.preemption_mode == "recompute"


def test_one_statistics_object(llm):
    """The block manager and the scheduler count into the engine's own totals;
    `stats` is the last generate() call's share of them."""
    llm.reset_prefix_cache()
    assert llm.block_manager.stats is llm.totals and llm.scheduler.stats is llm.totals
    prompt = list(range(1, 40))
    first = llm.generate([prompt], SamplingParams(max_tokens=2))[0]
    before = llm.totals.snapshot()
    second = llm.generate([prompt], SamplingParams(max_tokens=2))[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0
    stats = llm.stats
    assert stats.prompt_tokens == len(prompt)
    assert stats.cached_prompt_tokens == second.num_cached_tokens
    assert llm.totals.cached_prompt_tokens == before.cached_prompt_tokens + second.num_cached_tokens
    assert llm.totals.steps == before.steps + stats.steps and stats.steps >= 2
    assert 0 < stats.peak_blocks_used <= llm.num_blocks


def test_finish_sample_ends_one_sample_and_frees_its_blocks(llm):
    params = SamplingParams(max_tokens=40, ignore_eos=True, n=2, temperature=1.0, seed=0)
    rid = llm.add_request(list(range(1, 21)), params)  # 20 tokens: the samples' own copies of block 1
    group = llm.get_sequence(rid).group
    while not all(s.output_token_ids for s in group):
        llm.step()
    used = llm.block_manager.num_used_blocks
    llm.finish_sample(rid, 0)
    first = group[0]
    assert (first.finish_reason, first.error, len(first.output_token_ids)) == ("stop", None, 1)
    assert llm.block_manager.num_used_blocks < used  # its own blocks are free now, not at max_tokens
    assert llm.step() == [] and not group[1].is_done  # sample 0 has ended; the request goes on
    llm.abort([rid])  # sample 0 has left the engine's books: the abort still reaches sample 1
    assert group[1].finish_reason == "abort" and llm.block_manager.num_used_blocks == 0
    assert llm.has_unfinished_requests()  # until step() has returned it
    (delta,) = llm.step()
    assert delta.request_id == rid and not llm.has_unfinished_requests()
    assert [s["finish_reason"] for s in delta.output.samples] == ["stop", "abort"]
    assert len(delta.output.samples[0]["token_ids"]) == 1


def test_step_returns_each_aborted_request_once(llm):
    """A driver that loops on step() until has_unfinished_requests() is False sees
    every request it added come back, aborted ones included (LLM.abort and
    update_params(in_flight="abort")), each exactly once."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    for how in ("abort", "update_params"):
        ids = [llm.add_request([1, 2, 3 + i], params) for i in range(3)]
        llm.step()
        if how == "abort":
            llm.abort(ids[:2])
            llm.abort(ids[:1])  # twice: still returned once
        else:
            llm.update_params(llm.params, in_flight="abort")
        returned = []
        while llm.has_unfinished_requests():
            returned += [d.output for d in llm.step()]  # (final outputs: one delta per request)
        assert sorted(o.request_id for o in returned) == ids, how
        reasons = [o.finish_reason for o in sorted(returned, key=lambda o: o.request_id)]
        assert reasons == (["abort", "abort", "length"] if how == "abort" else ["abort"] * 3), how
        assert llm.get_sequence(ids[0]) is None and llm.block_manager.num_used_blocks == 0
