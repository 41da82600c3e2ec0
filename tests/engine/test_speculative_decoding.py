"""Speculative decoding in the engine (config speculative_method): a decoding
sequence verifies draft tokens in its row of the ragged step, keeps the
accepted ones plus one token, and gives back the blocks of the rejected ones.

Greedy tokens equal the engine's without speculation, synchronous and
asynchronous, under preemption (recompute and swap) and with the prefix cache;
sampled tokens keep their distribution (a chi-square test of the engine's
samples with and without drafts); no block leaks.  The draft-model proposer's
own tests are in test_draft_model.py; the verification rule's in
test_speculative_verify.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import assert_all_blocks_free, random_prompts
from jpaged.core.config import ConfigError, default_config, validate_config
from jpaged.core.sequence import SamplingParams, Sequence, Status
from jpaged.engine.speculation import Speculator
from jpaged.entrypoints.metrics import format_summary, summarize

# Drafts for every sequence whose last token occurred before, whatever the batch size.
NGRAM = dict(speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
             speculative_disable_by_batch_size=0)
BS = 8
# 20 usable blocks under 8 seats: admission oversubscribes the pool.
SMALL = dict(block_size=BS, num_blocks=21, max_num_seqs=8, max_num_batched_tokens=64)

_rng = np.random.default_rng(5)
# Half the prompts repeat a short pattern: the tiny model continues some of them
# and prompt lookup drafts right; the other half are random (drafts mostly rejected).
PROMPTS = [p * (1 + 40 // len(p)) if i % 2 else p
           for i, p in enumerate(random_prompts(_rng.integers(3, 12, size=10).tolist(), seed=6))]
PROMPTS = [p[:48] for p in PROMPTS]
MAX_TOKENS = _rng.integers(6, 40, size=10).tolist()


def greedy_params() -> list[SamplingParams]:
    """Greedy rows: plain, n = 2, stop token ids, and logprobs (never drafted)."""
    out = []
    for i, n in enumerate(MAX_TOKENS):
        kind = i % 4
        if kind == 0:
            out.append(SamplingParams(max_tokens=n, ignore_eos=True))
        elif kind == 1:
            out.append(SamplingParams(max_tokens=n, n=2, ignore_eos=True))
        elif kind == 2:
            out.append(SamplingParams(max_tokens=n, stop_token_ids=tuple(range(40, 50)), ignore_eos=True))
        else:
            out.append(SamplingParams(max_tokens=n, logprobs=2, ignore_eos=True))
    return out


def results(outs) -> list:
    return [(o.finish_reason, [s["token_ids"] for s in o.samples],
             None if o.logprobs is None else [t.token_id for t in o.logprobs]) for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llm):
    """Every test's expected tokens: the engine without speculation, no preemption
    (the session's TINY_ENGINE engine)."""
    return results(tiny_llm.generate(PROMPTS, greedy_params()))


def check_drafting(llm, accepted: bool = True) -> None:
    """The run verified drafts, accepted some and rejected some (so both paths ran)."""
    s = llm.stats
    assert s.spec_decode_num_drafts > 0
    assert s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens
    assert s.spec_decode_num_accepted_tokens > 0 or not accepted


@pytest.fixture(scope="module")
def ngram_llm(make_tiny_llm):
    """TINY_ENGINE with n-gram drafts (asynchronous scheduling, the default), shared by
    the tests below that run it as is: each checks the stats of its own generate()."""
    return make_tiny_llm(async_scheduling=True, **NGRAM)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_tokens_equal_without_speculation(make_tiny_llm, ngram_llm, reference, async_scheduling):
    llm = ngram_llm if async_scheduling else make_tiny_llm(async_scheduling=False, **NGRAM)
    assert results(llm.generate(PROMPTS, greedy_params())) == reference
    check_drafting(llm)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_prefix_cache(make_tiny_llm, reference, mode):
    llm = make_tiny_llm(preemption_mode=mode, enable_prefix_caching=True, **SMALL, **NGRAM)
    for _ in range(2):  # the second run finds the first one's blocks in the cache
        assert results(llm.generate(PROMPTS, greedy_params())) == reference
        llm.block_manager.check_invariants()
        assert_all_blocks_free(llm)
        assert llm.swap_space.num_used_blocks == 0
    assert llm.stats.preemptions > 0
    if mode == "recompute":  # resumes hit the cache (swapped ones bring their blocks back)
        assert llm.totals.cached_prompt_tokens > 0
    check_drafting(llm)


def test_a_small_token_budget_trims_drafts(make_tiny_llm, reference):
    """Decodes first: with 8 tokens per step for 8 seats, drafts take what is left."""
    llm = make_tiny_llm(max_num_seqs=4, max_num_batched_tokens=8, **NGRAM)
    assert results(llm.generate(PROMPTS, greedy_params())) == reference
    check_drafting(llm)
    assert_all_blocks_free(llm)


def sampled_params() -> list[SamplingParams]:
    """Seeded sampled rows: temperature only, top-p, top-k, and n = 2."""
    return [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9 if i % 3 == 1 else 1.0,
                           top_k=20 if i % 3 == 2 else 0, n=1 + i % 2, seed=i, ignore_eos=True)
            for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def sampled_reference(tiny_llm):
    return results(tiny_llm.generate(PROMPTS, sampled_params()))


def test_seeded_sampled_tokens_equal_without_speculation(ngram_llm, sampled_reference):
    """Sampled rows draw each position's token exactly as without drafts (the
    row's uniform for that position) and keep the drafts that equal it: the
    same seeded tokens whether or not, and however much, a step drafted; also
    in another batch order, where other steps draft."""
    llm = ngram_llm
    params = sampled_params()
    assert results(llm.generate(PROMPTS, params)) == sampled_reference
    check_drafting(llm, accepted=False)  # (sampled tokens rarely repeat the prompt's)
    assert results(llm.generate(PROMPTS[::-1], params[::-1]))[::-1] == sampled_reference
    assert_all_blocks_free(llm)


def test_draft_model(make_tiny_llm, tiny_llama_dir, reference, sampled_reference, monkeypatch):
    """A draft model (here the target itself: its greedy drafts are mostly kept,
    sampled tokens sometimes) under preemption and the prefix cache: greedy and
    seeded sampled tokens equal the engine's without speculation; the draft
    pool gives every block back.  (Another model as the draft, and the draft
    pool's own bookkeeping: test_draft_model.py.)"""
    llm = make_tiny_llm(**{**NGRAM, "speculative_method": "draft", "speculative_model": tiny_llama_dir},
                        enable_prefix_caching=True, **SMALL)
    assert results(llm.generate(PROMPTS, greedy_params())) == reference
    s = llm.stats  # the target's own greedy tokens: kept (up to fp32 rounding between batch shapes)
    assert s.spec_decode_num_accepted_tokens >= 0.95 * s.spec_decode_num_draft_tokens > 0
    assert s.preemptions > 0
    # Every third request samples with temperature only (one program variant less to build).
    assert results(llm.generate(PROMPTS[::3], sampled_params()[::3])) == sampled_reference[::3]
    check_drafting(llm)
    assert_all_blocks_free(llm)
    draft = llm.speculator.draft_model
    assert draft.allocator.num_free_blocks == draft.num_blocks - 1

    def broken(requests):
        raise RuntimeError("draft model down")
    monkeypatch.setattr(draft, "propose", broken)  # drafts are optional: the steps run without them
    assert results(llm.generate(PROMPTS, greedy_params())) == reference
    assert llm.stats.spec_decode_num_drafts == 0


def test_speculation_switches_off_above_the_batch_size():
    spec = Speculator("ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2,
                      disable_by_batch_size=2, max_model_len=64)
    seqs = []
    for i in range(3):
        seq = Sequence(i, [5, 6, 7, 5, 6], SamplingParams(max_tokens=10))
        seq.output_token_ids = [7, 5]
        seq.status = Status.DECODING
        seqs.append(seq)
    assert spec.propose(seqs) == {}  # 3 running > 2
    assert spec.propose(seqs[:2]) == {0: [6, 7, 5], 1: [6, 7, 5]}
    seqs[0].params = SamplingParams(max_tokens=4)  # 2 tokens left: 1 draft + 1 token
    seqs[1].params = SamplingParams(max_tokens=10, logprobs=1)  # never drafted
    assert spec.propose(seqs[:2]) == {0: [6]}


@pytest.mark.parametrize("fields, field", [
    (dict(prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min"),
    (dict(speculative_method="draft"), "speculative_model"),
    (dict(speculative_method="ngram", speculative_model="smollm2-135m"), "speculative_model"),
    (dict(speculative_method="draft", speculative_model="/no/such/model"), "speculative_model"),
    (dict(speculative_method="medusa"), "speculative_method"),
    (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative_disable_by_batch_size=-1), "speculative_disable_by_batch_size"),
])
def test_bad_speculative_config_names_its_field(fields, field):
    cfg = default_config()
    cfg.update(fields)
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert e.value.field == field


def test_summary_reports_acceptance(ngram_llm):
    llm = ngram_llm
    outs = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=20, ignore_eos=True))
    summary = summarize(outs, llm, 1.0)
    s = llm.stats
    assert summary["spec_decode_num_draft_tokens"] == s.spec_decode_num_draft_tokens > 0
    assert summary["mean_accepted_length"] == pytest.approx(1 + s.spec_decode_num_accepted_tokens
                                                            / s.spec_decode_num_drafts)
    assert "speculative decoding (ngram)" in format_summary(summary)
