"""Oversubscribed KV pool: preemption by recompute or swap, and no request lost.

A pool with room for about two sequences serves 24 requests of varied lengths
(max_num_seqs 8, so admission oversubscribes it): every request must complete
with the tokens a large pool gives, in both preemption modes, with prefix
caching on and off, and the pool (and host swap space) must be empty at the end.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import assert_all_blocks_free, random_prompts
from jpaged.runtime.kv_pool import _gather_blocks, _scatter_blocks, gather_blocks, scatter_blocks
from jpaged.entrypoints.metrics import format_summary, summarize
from jpaged.core.sequence import SamplingParams
from jpaged.core.swap_space import HostSwapSpace

BS = 8
SMALL = dict(block_size=BS, num_blocks=21, max_num_seqs=8, max_num_batched_tokens=64)  # 20 usable blocks
BIG = dict(block_size=BS, num_blocks=160, max_num_seqs=8, max_num_batched_tokens=64)

_rng = np.random.default_rng(7)
LENGTHS = _rng.integers(3, 40, size=24).tolist()
MAX_TOKENS = _rng.integers(4, 41, size=24).tolist()  # longest: 39 + 40 tokens = 10 blocks
# Half the prompts share a 2-block system prefix, so prefix caching has shared blocks to handle.
SYSTEM = random_prompts([16], seed=99)[0]
PROMPTS = [(SYSTEM + p if i % 2 else p) for i, p in enumerate(random_prompts(LENGTHS, seed=5))]
PROMPTS = [p[:72] for p in PROMPTS]
GREEDY = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
SEEDED = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.9, top_k=50, seed=1000 + i)
          for i, n in enumerate(MAX_TOKENS)]


def tokens(outs):
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def big(make_tiny_llm):
    return make_tiny_llm(**BIG)


@pytest.fixture(scope="module")
def want_greedy(big):
    outs = big.generate(PROMPTS, GREEDY)
    assert big.stats.preemptions == 0
    return tokens(outs)


@pytest.fixture(scope="module")
def want_seeded(big):
    outs = big.generate(PROMPTS, SEEDED)
    assert big.stats.preemptions == 0
    return tokens(outs)


def assert_clean(llm):
    assert_all_blocks_free(llm)
    llm.block_manager.check_invariants()
    sched = llm.scheduler
    assert not sched.waiting and not sched.running and not sched.swapped
    assert llm.swap_space.num_used_blocks == 0


@pytest.mark.parametrize("caching", [False, True], ids=["nocache", "cache"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_oversubscribed_pool_completes_every_request(make_tiny_llm, want_greedy, mode, caching):
    llm = make_tiny_llm(**SMALL, preemption_mode=mode, enable_prefix_caching=caching)
    _gather_blocks.clear_cache()  # count this run's shapes only (other modules' engines swap too)
    _scatter_blocks.clear_cache()
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.finish_reason for o in outs] == ["length"] * len(PROMPTS)
    for i, (o, w) in enumerate(zip(outs, want_greedy)):
        assert o.token_ids == w, f"request {i} ({mode}, prefix caching {caching})"
    s = llm.stats
    assert s.peak_blocks_used <= 20
    assert s.preemptions > 0 and s.swap_fallbacks == 0
    if mode == "swap":
        assert s.swap_preemptions > 0
        assert s.swapped_out_blocks == s.swapped_in_blocks > 0
        assert s.swapped_out_bytes == s.swapped_in_bytes == s.swapped_in_blocks * llm.swap_space.block_bytes
        # Padded to powers of two: a handful of gather/scatter shapes at most.
        assert _gather_blocks._cache_size() <= 6 and _scatter_blocks._cache_size() <= 6
    else:
        assert s.recompute_preemptions == s.preemptions and s.swapped_out_bytes == 0
    assert_clean(llm)
    text = format_summary(summarize(outs, llm, 1.0))
    assert f"preemptions ({mode})" in text and ("swapped out / in" in text) == (mode == "swap")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_sampling_survives_preemption(make_tiny_llm, want_seeded, mode):
    llm = make_tiny_llm(**SMALL, preemption_mode=mode, enable_prefix_caching=True)
    outs = llm.generate(PROMPTS, SEEDED)
    assert llm.stats.preemptions > 0
    assert tokens(outs) == want_seeded
    assert_clean(llm)


def test_swap_space_exhaustion_falls_back_to_recompute(make_tiny_llm, want_greedy):
    block_bytes = HostSwapSpace(0, (2, 2, 2, BS, 16), np.float32).block_bytes
    llm = make_tiny_llm(**SMALL, preemption_mode="swap", swap_space_gb=6 * block_bytes / 2**30)
    assert llm.swap_space.capacity == 6
    outs = llm.generate(PROMPTS, GREEDY)
    assert tokens(outs) == want_greedy
    s = llm.stats
    assert s.swap_preemptions > 0 and s.swap_fallbacks > 0
    assert s.recompute_preemptions >= s.swap_fallbacks
    assert s.swap_blocks_peak <= 6
    assert_clean(llm)


def test_swap_space_zero_is_recompute(make_tiny_llm, want_greedy):
    llm = make_tiny_llm(**SMALL, preemption_mode="swap", swap_space_gb=0)
    outs = llm.generate(PROMPTS[:12], GREEDY[:12])
    assert tokens(outs) == want_greedy[:12]
    assert llm.stats.swap_preemptions == 0 and llm.stats.swap_fallbacks == llm.stats.preemptions > 0
    assert_clean(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_request_that_never_fits_errors_while_others_complete(make_tiny_llm, big, mode):
    """20 usable blocks of 8 = 160 tokens: a prompt of 170 is refused at admission,
    one of 20 + 200 new tokens ends with an error once it outgrows the whole pool;
    the others (also preempted by the long one) complete with the right tokens."""
    long_params = SamplingParams(max_tokens=200, ignore_eos=True)
    prompts = PROMPTS[:6] + random_prompts([20, 170], seed=3)
    params = GREEDY[:6] + [long_params, GREEDY[0]]
    llm = make_tiny_llm(**SMALL, max_model_len=256, preemption_mode=mode)
    outs = llm.generate(prompts, params)
    assert [o.finish_reason for o in outs] == ["length"] * 6 + ["error", "error"]
    assert "whole pool" in outs[6].error and len(outs[6].token_ids) > 100
    assert "pool" in outs[7].error
    want = tokens(big.generate(prompts[:6], params[:6]))
    assert tokens(outs[:6]) == want
    assert_clean(llm)


def test_static_scheduler_with_swap(make_tiny_llm, want_greedy):
    llm = make_tiny_llm(**SMALL, scheduler="static", preemption_mode="swap")
    outs = llm.generate(PROMPTS[:10], GREEDY[:10])
    assert tokens(outs) == want_greedy[:10]
    assert_clean(llm)


def test_admission_oversubscribes():
    """Admission needs blocks for the first chunk only, not max_model_len per sequence."""
    from jpaged.core.block_manager import BlockManager
    from jpaged.core.config import SchedulerConfig
    from jpaged.core.scheduler import Scheduler
    from jpaged.core.sequence import Sequence

    sched = Scheduler(BlockManager(9, 4, enable_prefix_caching=False),
                      SchedulerConfig(scheduler="continuous", max_num_seqs=8, max_num_batched_tokens=64))
    for i in range(4):  # each may grow to 128 tokens = 32 blocks; the pool has 8
        sched.add(Sequence(i, [5, 6, 7], SamplingParams(max_tokens=125)))
    out = sched.schedule()
    assert [s.num_new for s in out.scheduled] == [3] * 4 and len(sched.running) == 4


def test_gather_scatter_roundtrip():
    pool = np.arange(6 * 2 * 3, dtype=np.float32).reshape(6, 2, 3)
    got = gather_blocks(pool, [4, 1, 3])
    np.testing.assert_array_equal(got, pool[[4, 1, 3]])
    import jax.numpy as jnp
    new = np.asarray(scatter_blocks(jnp.asarray(pool), [2, 5, 1], got))
    want = pool.copy()
    want[[2, 5, 1]] = pool[[4, 1, 3]]
    want[0] = new[0]  # padding rows land in the null block
    np.testing.assert_array_equal(new, want)
