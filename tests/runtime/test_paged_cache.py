"""The paged KV cache: layout independence, batching, chunking, in-place updates, compile counts.

All on the tiny random Llama (greedy; ignore_eos so every length is known).
The reference for every comparison is the same request run alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import assert_all_blocks_free, random_prompts
from jpaged.core.sequence import SamplingParams
from jpaged.runtime.buckets import min_step_tokens

# Prompt lengths straddle the 16- and 64-token block boundaries; answers cross more.
LENGTHS = [3, 15, 16, 17, 63, 64, 65]
MAX_TOKENS = [30, 20, 33, 16, 40, 1, 9]
PROMPTS = random_prompts(LENGTHS, seed=10)
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


@pytest.fixture(scope="module")
def alone(tiny_llm):
    """Tokens of each request run on its own (block_size 16, the shared engine)."""
    outs = [tiny_llm.generate([p], sp)[0] for p, sp in zip(PROMPTS, PARAMS)]
    for o, n in zip(outs, MAX_TOKENS):
        assert o.finish_reason == "length" and len(o.token_ids) == n
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def contiguous(make_tiny_llm):
    """The whole batch on a contiguous cache: one block of max_model_len per sequence."""
    llm = make_tiny_llm(block_size=128, num_blocks=len(PROMPTS) + 1)
    outs = llm.generate(PROMPTS, PARAMS)
    assert llm.stats.peak_blocks_used <= len(PROMPTS)  # one block per sequence
    return [o.token_ids for o in outs]


def test_contiguous_equals_alone(contiguous, alone):
    assert contiguous == alone


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_paged_equals_contiguous(make_tiny_llm, contiguous, block_size):
    blocks_per_seq = -(-128 // block_size)
    llm = make_tiny_llm(block_size=block_size, num_blocks=len(PROMPTS) * blocks_per_seq + 1)
    outs = llm.generate(PROMPTS, PARAMS)
    for i, (o, want) in enumerate(zip(outs, contiguous)):
        assert o.token_ids == want, f"request {i} (prompt {LENGTHS[i]}, block_size {block_size})"
    if block_size < 64:  # sequences really were spread over many blocks
        assert llm.stats.peak_blocks_used > 2 * len(PROMPTS)
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def batched(make_tiny_llm):
    """{policy: (its engine, the batch's outputs, the steps they took)}: 3 seats
    for the 7 requests, under each scheduler."""
    runs = {}
    for policy in ("continuous", "static"):
        llm = make_tiny_llm(scheduler=policy, max_num_seqs=3)
        outs = llm.generate(PROMPTS, PARAMS)
        runs[policy] = llm, outs, llm.stats.steps
    return runs


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_batching_equals_alone(batched, alone, policy):
    llm, outs, _ = batched[policy]
    for i, (o, want) in enumerate(zip(outs, alone)):
        assert o.finish_reason == "length"
        assert o.token_ids == want, f"request {i} under {policy} batching"
    assert_all_blocks_free(llm)


def test_continuous_refills_slots(batched):
    """Continuous batching admits a waiting request as soon as a slot frees up;
    static waits for the whole batch: it must take strictly more steps."""
    steps = {policy: run[2] for policy, run in batched.items()}
    assert steps["continuous"] < steps["static"], steps


@pytest.mark.parametrize("budget", [7, 16])
def test_chunked_prefill_equals_alone(make_tiny_llm, alone, budget):
    """max_num_batched_tokens below the prompt lengths: prompts are prefilled in chunks."""
    llm = make_tiny_llm(max_num_batched_tokens=budget, max_num_seqs=4)
    outs = llm.generate(PROMPTS, PARAMS)
    assert llm.stats.prefill_steps >= -(-max(LENGTHS) // budget)
    for i, (o, want) in enumerate(zip(outs, alone)):
        assert o.token_ids == want, f"request {i} with prefill chunks of {budget}"


def test_preemption_equals_alone(make_tiny_llm, tiny_llm):
    """A pool too small for the running batch forces recompute preemption; the
    preempted sequences resume and still produce the same tokens."""
    prompts = random_prompts([15, 14, 13, 12], seed=11)
    params = SamplingParams(max_tokens=40, ignore_eos=True)  # each grows 1 -> 4 blocks
    want = [tiny_llm.generate([p], params)[0].token_ids for p in prompts]
    for caching in (False, True):
        llm = make_tiny_llm(num_blocks=9, max_num_seqs=4, enable_prefix_caching=caching)
        outs = llm.generate(prompts, params)
        assert llm.scheduler.stats.preemptions > 0
        for i, (o, w) in enumerate(zip(outs, want)):
            assert o.finish_reason == "length"
            assert o.token_ids == w, f"request {i} after preemption (prefix caching {caching})"
        assert_all_blocks_free(llm)


def test_pool_donated_and_updated_in_place(make_tiny_llm):
    llm = make_tiny_llm(num_blocks=2048)  # a 16 MiB pool: much larger than any temporary
    runner = llm.runner
    pool_bytes = runner.kv_pool.nbytes
    assert pool_bytes == llm.kv_pool_bytes
    ptr = runner.kv_pool.unsafe_buffer_pointer()
    out = llm.generate([PROMPTS[2], PROMPTS[4]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert all(len(o.token_ids) == 5 for o in out)
    assert runner.kv_pool.unsafe_buffer_pointer() == ptr, "the pool was copied, not updated in place"
    assert float(np.abs(np.asarray(runner.kv_pool[1:])).sum()) > 0  # and it holds the new K/V

    assert runner.executables()
    for exe in runner.executables():
        mem = exe.memory_analysis()
        assert mem.alias_size_in_bytes >= pool_bytes, (mem.alias_size_in_bytes, pool_bytes)
        assert mem.temp_size_in_bytes < pool_bytes / 4, (mem.temp_size_in_bytes, pool_bytes)


def test_compilations_are_bounded(make_tiny_llm):
    """One compiled program per step-size bucket: with max_num_seqs 4 and
    max_num_batched_tokens 32 the ladder is T in {4, 8, 16, 18, ..., 32} (eighths
    of an octave above 16), whatever the mix of prompts and decodes."""
    llm = make_tiny_llm(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, buckets_per_octave=8)
    assert llm.runner.token_buckets == (4, 8, 16, 18, 20, 22, 24, 26, 28, 30, 32)
    lengths = [1, 2, 5, 7, 8, 9, 13, 20, 31, 33, 40, 47, 50, 60, 62]
    max_tokens = [3, 17, 1, 9, 30, 2, 12, 7, 25, 4, 11, 16, 5, 8, 10]
    outs = llm.generate(random_prompts(lengths, seed=3),
                        [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens])
    for o, n, m in zip(outs, lengths, max_tokens):
        assert o.finish_reason == "length"
        assert len(o.token_ids) == min(m, 64 - n)  # max_model_len caps the answer
    assert 0 < llm.num_compilations <= len(llm.runner.token_buckets), llm.runner.compiled_shapes
    assert len(llm.runner.executables()) == llm.num_compilations
    assert llm.runner.compile_seconds > 0 and llm.stats.padding_ratio >= 1.0


def test_jnp_attention_ladder_starts_at_one_token(make_tiny_llm):
    """min_step_tokens 0 (the default) is 1 with the jnp or CPU attention, 8 with a
    Pallas kernel: a one-row decode on the CPU pads to no more rows, and gives the
    tokens it gives padded to 4 (TINY_ENGINE's 8, capped by max_num_seqs)."""
    assert [min_step_tokens(0, impl) for impl in ("reference", "cpu", "pallas_gpu", "pallas_tpu")] == [1, 1, 8, 8]
    engine = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32)
    small, padded = make_tiny_llm(**engine, min_step_tokens=0), make_tiny_llm(**engine)
    assert small.runner.token_buckets[:4] == (1, 2, 4, 8) and padded.runner.token_buckets[0] == 4
    small.precompile()  # bucket 1 ready: no decode runs padded while it builds
    prompt, params = random_prompts([4], seed=9), SamplingParams(max_tokens=6, ignore_eos=True)
    assert [o.token_ids for o in small.generate(prompt, params)] == [o.token_ids for o in padded.generate(prompt, params)]
    assert small.stats.padding_ratio == 1.0 < padded.stats.padding_ratio  # a 4-token prefill, then 1-token decodes


def test_precompile_covers_the_workload(make_tiny_llm):
    """precompile() builds the power-of-two buckets (4, 8, 16, 32 of a ladder of
    11): after it, no step of a greedy workload waits for a build (a step between
    two rungs runs padded to the next while its own bucket is built in the
    background), and its tokens equal those of a fresh engine's: the warm-up steps
    (all padding) leave the pool as it was."""
    engine = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, build_padded_buckets=True)
    llm = make_tiny_llm(**engine)
    n = llm.precompile()
    assert n == llm.num_compilations == 4
    assert sorted(k[0] for k in llm.runner.compiled_shapes) == [4, 8, 16, 32]
    lengths = [1, 5, 9, 16, 17, 20, 31, 32, 3, 12]
    max_tokens = [30, 2, 9, 20, 5, 31, 3, 12, 40, 7]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(random_prompts(lengths, seed=5), params)
    assert llm.stats.compile_seconds == 0  # no step waited for a program
    fresh = make_tiny_llm(**engine).generate(random_prompts(lengths, seed=5), params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in fresh]
    llm.runner.wait_for_programs()
    assert llm.precompile() == 0


def test_padded_steps_build_their_bucket_only_when_asked(make_tiny_llm):
    """A 30-token prompt's first step builds bucket 32; its decodes (1 row, bucket 4)
    then run padded to 32.  With build_padded_buckets bucket 4 is built in the
    background; without it nothing more is built and every step stays in 32.  The
    tokens are the same either way: padding is masked out."""
    engine = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32)
    lazy = make_tiny_llm(**engine, build_padded_buckets=False)
    eager = make_tiny_llm(**engine, build_padded_buckets=True)
    prompts, params = random_prompts([30], seed=21), SamplingParams(max_tokens=12, ignore_eos=True)
    lazy_tokens, eager_tokens = (llm.generate(prompts, params)[0].token_ids for llm in (lazy, eager))
    assert lazy_tokens == eager_tokens and len(lazy_tokens) == 12
    for llm in (lazy, eager):
        llm.runner.wait_for_programs()
    assert [k[0] for k in lazy.runner.compiled_shapes] == [32]
    assert sorted(k[0] for k in eager.runner.compiled_shapes) == [4, 32]
    assert lazy.stats.padding_ratio > 9  # 12 steps of 32 slots for 30 + 11 tokens
